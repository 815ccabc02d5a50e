"""The integrations with other trainers (pipetransformer/integrations/, docs/integrations.md):
their keys and errors, the decisions against the trainer's own for the same gradient norms,
the layer stack of the families, DDP's reducer rebuilt after a freeze, and single-process
`Trainer` runs. Their runs under torchrun on 2 processes (transformers' Trainer and
Lightning) are in test_integrations_ddp.py."""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
from helpers import run_workers
from torch import nn

from pipetransformer.autodp.control import Control
from pipetransformer.config import ConfigError, FreezeConfig, config_from_dict
from pipetransformer.integrations.freezer import Freezer, freeze_config
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.freezing import FreezeControl
from pipetransformer.trainer.metrics import FreezeSignal

# --- the keys ------------------------------------------------------------------------------


def test_the_keys_are_the_configs_with_the_configs_defaults_but_three():
    """A freezing callback freezes by the paper's Eq. 1 at epoch ends, from the end of the
    second epoch; every other key keeps the config's default, and a key given wins."""
    config = freeze_config({}, "FreezeCallback", raw_gradients=False)
    assert config == FreezeConfig(strategy="gradient_norm", interval_steps=None, warmup_epochs=2)
    config = freeze_config({"alpha": 0.5, "interval_steps": 7}, "X", raw_gradients=False)
    assert (config.alpha, config.interval_steps, config.warmup_epochs) == (0.5, 7, 2)
    config = freeze_config({"warmup_epochs": 0}, "X", raw_gradients=False)
    assert (config.strategy, config.warmup_epochs) == ("gradient_norm", 0)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"alpha": 2}, "freeze.alpha: must be in (0, 1), got 2.0"),
        ({"alhpa": 0.5}, "freeze.alhpa: unknown key (did you mean 'freeze.alpha'?)"),
        ({"interval_steps": "often"}, "freeze.interval_steps: expected "),
        ({"strategy": "manual"}, "freeze.manual_schedule: strategy 'manual' needs a non-empty"),
        ({"strategy": "autofreeze"}, "freeze.strategy: 'autofreeze' is not available in"),
        ({"strategy": "signal_to_noise"}, "freeze.strategy: 'signal_to_noise' is not available"),
        ({"interval_steps": "measured"}, "freeze.interval_steps: 'measured' times"),
        ({"signal_gradients": "raw"}, "freeze.signal_gradients: FreezeCallback sees the"),
        ({"memory_aware": True}, "freeze.memory_aware: FreezeCallback trains one replica"),
    ],
)
def test_a_bad_key_is_one_line_naming_it_when_the_callback_is_made(keys, message):
    from pipetransformer.integrations.transformers import FreezeCallback

    with pytest.raises(ConfigError) as error:
        FreezeCallback(**keys)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


# --- the decisions against the trainer's -----------------------------------------------------

L = 4  # tiny_bert's layers


def tiny_bert(seed: int = 0, dropout: float = 0.0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=L,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(config)


class NormsOf:
    """The trainer's metrics as FreezeControl reads them: one interval's per-layer norms
    per decision."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.steps_since_decision = 0

    def freeze_signal(self, dp_degree, with_norms):
        return FreezeSignal(self.norms if with_norms else None, self.steps_since_decision, 0.1)


RULES = [
    {"strategy": "gradient_norm", "alpha": 0.5},
    {"strategy": "gradient_norm", "eq1_bound": False, "max_frozen_layers": 2},
    {"strategy": "gradient_norm_inclusive", "alpha": 0.3},
    {"strategy": "convergence", "alpha": 0.9, "convergence_threshold": 0.6},
    {"strategy": "alpha_schedule", "alpha": 0.3},
    {"strategy": "manual", "manual_schedule": [1, 1, 3]},
    {"strategy": "none"},
]


@pytest.mark.parametrize("keys", RULES, ids=lambda keys: "-".join(map(str, keys.values())))
def test_the_callbacks_decisions_are_the_trainers_for_the_same_gradient_norms(keys):
    """The freezer measures the norms of the gradients a step leaves (random, one scale a
    layer and interval, so that the argmin moves) and decides; the trainer's FreezeControl,
    handed the same per-layer RMS norms, decides the same count, by the same term, at every
    one of 4 decision points, and the norms the freezer measured are that RMS."""
    model = tiny_bert()
    keys = {"interval_steps": 3, "warmup_epochs": 0, **keys}
    freezer = Freezer(freeze_config(keys, "test", raw_gradients=False), "test")
    freezer.attach(model, trained_weights=False)
    freezer.set_schedule(steps_per_epoch=6, epochs=4)
    layers = model.bert.encoder.layer
    metrics, state = NormsOf(), RunState()
    config = config_from_dict({"freeze": {"embedding": False, **keys}})
    control = FreezeControl(config, L, 6, state, metrics, Control(None))
    generator = torch.Generator().manual_seed(7)
    step = 0
    for decision in range(4):
        squares = [0.0] * L
        for _ in range(3):
            step += 1
            scales = torch.rand(L, generator=generator) * (1 + decision)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator) if p.requires_grad else None
            for layer, scale in zip(layers, scales):
                for p in layer.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
                        squares[layers_index(layers, layer)] += float(p.grad.square().sum())
            freezer.record_step()
        assert freezer.due(step // 6, step % 6 == 0, False, step) == (keys["strategy"] != "none")
        metrics.norms = [math.sqrt(s / 3) for s in squares]
        metrics.steps_since_decision = 3
        expected = control.decide(state.num_frozen_layers, dp_degree=1)
        if keys["strategy"] == "none":
            assert expected.num_frozen_layers == 0
            continue
        record = freezer.decide([], None, step // 6, step)
        state.num_frozen_layers = expected.num_frozen_layers
        assert record["frozen_layers"] == expected.num_frozen_layers
        assert record["freeze_decided_by"] == expected.decided_by
        measured = freezer.progress.decisions[-1]["layer_grad_norms"]
        if measured is not None:
            assert measured == pytest.approx(metrics.norms, rel=1e-6)
        # The frozen prefix: the embedding with the first layer, then the layers below F.
        prefix = [*layers[: expected.num_frozen_layers]]
        if prefix:
            prefix.append(model.bert.embeddings)
        frozen = {p for module in prefix for p in module.parameters()}
        assert frozen == {p for p in model.parameters() if not p.requires_grad}


def layers_index(layers, layer) -> int:
    return next(i for i, other in enumerate(layers) if other is layer)


# --- the layer stack -----------------------------------------------------------------------


def test_a_model_without_a_layer_stack_is_one_error_when_the_trainer_is_built(tmp_path):
    """An encoder without a task head (a BertModel) and a model of no supported library:
    the Trainer is not even built, and the line says what was looked for."""
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (the .[peers] extra)
    from transformers import BertConfig, BertModel, Trainer, TrainingArguments

    from pipetransformer.integrations.transformers import FreezeCallback

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    bare = BertModel(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2))
    cases = {
        bare: "FreezeCallback: cannot find the layer stack of BertModel: itself (BertModel): "
        "BertModel: only sequence classification and question answering are cut",
        nn.Linear(4, 2): "FreezeCallback: cannot find the layer stack of Linear: none of its "
        "modules is a transformers or timm model",
    }
    for model, message in cases.items():
        with pytest.raises(ValueError) as error:
            Trainer(model=model, args=args, callbacks=[FreezeCallback()])
        assert str(error.value).startswith(message) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="freeze.max_frozen_layers: 9 exceeds the model's 4"):
        Trainer(model=tiny_bert(), args=args, callbacks=[FreezeCallback(max_frozen_layers=9)])


class VitClassifier(nn.Module):
    """A timm ViT as a Trainer user trains one: a wrapper that returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        import timm

        torch.manual_seed(0)
        self.vit = timm.create_model(
            "vit_tiny_patch16_224",
            img_size=8,
            patch_size=4,
            in_chans=1,
            embed_dim=16,
            depth=3,
            num_heads=2,
            num_classes=2,
            drop_rate=0.1,
        )

    def forward(self, pixel_values, labels):
        logits = self.vit(pixel_values)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Images(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.images = torch.randn(32, 1, 8, 8, generator=generator)
        self.labels = (self.images.mean((1, 2, 3)) > 0).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return {"pixel_values": self.images[index], "labels": self.labels[index]}


def test_a_timm_vit_under_trainer_freezes_its_bottom_blocks(tmp_path):
    """A ViT inside the user's wrapper, one process: the blocks freeze at the epoch ends
    (the embedding from the start: a timm model counts as pretrained), frozen blocks stay in
    eval mode through the Trainer's model.train(), the decisions are in log_history and the
    head keeps training."""
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (the .[peers] extra)
    from transformers import Trainer, TrainingArguments

    from pipetransformer.integrations.transformers import FreezeCallback

    model = VitClassifier()
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=8,
        num_train_epochs=3,
        learning_rate=0.05,
        optim="sgd",
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    head_before = model.vit.head.weight.detach().clone()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Images(),
        callbacks=[FreezeCallback(strategy="manual", manual_schedule=[1, 2], warmup_epochs=0)],
    )
    trainer.train()
    decisions = [h for h in trainer.state.log_history if "frozen_layers" in h]
    assert [(d["step"], d["frozen_layers"], d["freeze_decided_by"]) for d in decisions] == [
        (4, 1, "schedule"),
        (8, 2, "schedule"),
    ]
    vit = model.vit
    frozen = [vit.patch_embed, *vit.blocks[:2]]
    assert not any(p.requires_grad for module in frozen for p in module.parameters())
    assert not vit.cls_token.requires_grad and not vit.pos_embed.requires_grad
    assert all(p.requires_grad for p in vit.blocks[2].parameters())
    assert not vit.blocks[1].attn.training and vit.blocks[2].attn.training
    assert not torch.equal(head_before, vit.head.weight)


def test_every_interval_steps_the_trainer_decides_and_releases_the_frozen_optimizer_state(
    tmp_path,
):
    """A BERT under Trainer's default optimizer (fused AdamW), deciding every 3 optimizer
    steps of 2 micro-batches: decisions after steps 3, 6 and 9 of 10 (none after the last),
    each in log_history with who set it, and no optimizer state left for a frozen
    parameter."""
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (the .[peers] extra)
    from transformers import Trainer, TrainingArguments

    from pipetransformer.integrations.transformers import FreezeCallback

    model = tiny_bert()
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    callback = FreezeCallback(interval_steps=3, alpha=0.5, warmup_epochs=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    decisions = [h for h in trainer.state.log_history if "frozen_layers" in h]
    assert [d["step"] for d in decisions] == [3, 6, 9]
    assert {d["freeze_decided_by"] for d in decisions} <= {"signal", "agree", "bound", "cap"}
    frozen = decisions[-1]["frozen_layers"]
    assert frozen == callback.freezer.progress.num_frozen_layers > 0
    state = trainer.optimizer.state
    for p in model.parameters():
        assert (p in state) == p.requires_grad
    assert not any(p.requires_grad for p in model.bert.encoder.layer[frozen - 1].parameters())


def test_by_default_the_callback_decides_once_at_the_second_epochs_end(tmp_path):
    """`FreezeCallback()` in `Trainer`'s default 3 epochs (5 steps each): no decision at the
    end of epoch 1, one at the end of epoch 2, by Eq. 1 at alpha 1/3 (at most 2 of 4 layers),
    none at the run's end (section 24c's late rule as the default)."""
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (the .[peers] extra)
    from transformers import Trainer, TrainingArguments

    from pipetransformer.integrations.transformers import FreezeCallback

    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    assert args.num_train_epochs == 3
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=Tokens(), callbacks=[FreezeCallback()]
    )
    trainer.train()
    decisions = [h for h in trainer.state.log_history if "frozen_layers" in h]
    assert [d["step"] for d in decisions] == [10]
    assert decisions[0]["frozen_layers"] <= 2
    assert decisions[0]["freeze_decided_by"] in {"signal", "agree", "bound"}


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, 50, (40, 8), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": int(self.ids[index, 0] > 25)}


def test_the_hf_trainer_peer_records_its_callbacks_decisions_as_the_trainers(tmp_path):
    """`compare.peers --hf-callback` (the benchmark's sides): `freeze` takes the config's
    freeze section as the callback's keys, `embedding` freezes the embedding alone; the
    decisions land in events.jsonl and summary.json as the trainer's, each epoch's line
    with the layers frozen at its end, so compare's records read them."""
    from pipetransformer.compare.peer_records import write_records
    from pipetransformer.compare.peers import freeze_callback
    from pipetransformer.compare.records import run_record
    from pipetransformer.config import load_config
    from pipetransformer.runs.records import Evaluation, FreezeDecisionEvent

    config = load_config(None, ["freeze.strategy=alpha_schedule", "freeze.alpha=0.5"])
    rule = freeze_callback(config, "freeze").freezer.config
    assert (rule.strategy, rule.alpha, rule.interval_steps) == ("alpha_schedule", 0.5, "auto")
    alone = freeze_callback(config, "embedding").freezer.config
    assert (alone.strategy, alone.manual_schedule, alone.embedding) == ("manual", [0], True)
    assert freeze_callback(config, None) is None
    epochs = [
        {"epoch": e, "global_step": 4 * e, "train_loss": 0.5, "samples_per_s": 10.0}
        | {"epoch_time_s": 1.0, "lr": 0.1, "real_tokens": 0, "padded_tokens": 0}
        for e in (1, 2)
    ]
    evaluations = [Evaluation(4 * e, e, float(e), 16 * e, float(e), 0.1, 0.5) for e in (1, 2)]
    decision = FreezeDecisionEvent(1, 0, 4, 0, 2, 2, 2, 3, "agree", [0.1, 0.2, 0.3, 0.4])
    write_records(tmp_path, epochs, evaluations, 2, 1, [decision])
    record = run_record(tmp_path, "trainer_freeze", 0)
    assert [d.new_num_frozen_layers for d in record.decisions] == [2]
    assert record.freeze_decided_by == {"agree": 1}
    assert [e.num_frozen_layers for e in record.epochs] == [2, 2]


# --- DDP ----------------------------------------------------------------------------------


def test_after_a_freeze_ddp_trains_without_find_unused_parameters_once_its_reducer_is_rebuilt():
    """2 gloo processes, DDP without find_unused_parameters, the first layer frozen after 2
    of 5 steps. Rebuilt, the reducer reduces only the trained parameters (through the
    communication hook registered before), the frozen weights stay, and every weight equals
    a single process's training on the whole batch. Not rebuilt, the next step fails as
    DDP does when a parameter it waits for never gets a gradient."""
    from integration_workers import FREEZE_AT, STEPS, reducer_rebuild_run

    rebuilt = run_workers(reducer_rebuild_run, 2, True)
    for result in rebuilt:
        assert result["error"] is None
        assert result["frozen_changed"] == 0.0
        assert result["against_reference"] < 1e-6
        assert result["trained_parameters"] == 4
        assert result["parameters_reduced_after_freeze"] == 4 * (STEPS - FREEZE_AT)
    stale = run_workers(reducer_rebuild_run, 2, False)
    assert all("Expected to have finished reduction" in r["error"] for r in stale)


# --- Lightning's extra ----------------------------------------------------------------------


def test_lightnings_callback_checks_its_keys_and_finds_the_stack_before_training():
    """The same keys and errors as FreezeCallback (raw gradients allowed: Lightning's hook
    sees them before it clips), and the layer stack looked for as Lightning sets up."""
    pytest.importorskip("lightning")
    from pipetransformer.integrations.lightning import FreezeFinetuning

    with pytest.raises(ConfigError, match=r"^freeze.alpha: must be in \(0, 1\), got 2.0$"):
        FreezeFinetuning(alpha=2)
    assert FreezeFinetuning(signal_gradients="raw").freezer.config.signal_before_clipping
    with pytest.raises(ValueError, match="^FreezeFinetuning: cannot find the layer stack of"):
        FreezeFinetuning().freeze_before_training(nn.Linear(2, 2))
    callback = FreezeFinetuning()
    model = tiny_bert()
    callback.freeze_before_training(model)  # random weights: the embedding keeps training
    assert all(p.requires_grad for p in model.parameters())


def test_without_lightning_the_callback_names_the_extra(monkeypatch):
    """Where `lightning` cannot be imported (every module of it hidden)."""
    for name in [n for n in sys.modules if n == "lightning" or n.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.delitem(sys.modules, "pipetransformer.integrations.lightning", raising=False)
    with pytest.raises(ImportError) as error:
        importlib.import_module("pipetransformer.integrations.lightning")
    assert str(error.value) == (
        "FreezeFinetuning needs Lightning: pip install 'pipetransformer[lightning]' "
        "(or pip install lightning)"
    )
