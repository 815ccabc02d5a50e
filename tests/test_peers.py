"""The peers of `compare --peers` that are not this trainer (compare/peers.py): transformers'
Trainer for text models and a plain timm + DDP loop for image models. They must train what
the trainer trains (the same weights, data and batch) and split it as DDP does."""

import json

import pytest
import torch
from helpers import ROOT, run_workers
from workers import peer_run

from pipetransformer.compare.report import read_run, read_seed_run, throughput
from pipetransformer.compare.variants import variant_overrides
from pipetransformer.config import load_config
from pipetransformer.data import build_data
from pipetransformer.utils.files import read_jsonl

TINY_VIT = [
    "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 4}",
    "data.train_subset=256",
    "data.eval_subset=64",
    "trainer.epochs=2",
    "trainer.global_batch_size=32",
    "optimizer.name=sgd",
    "optimizer.max_grad_norm=1.0",
]


def test_compare_peers_add_the_peer_of_the_model_family():
    """--peers runs what a user of the family runs today, with DDP's settings: the timm loop
    beside DDP for an image model, transformers' Trainer for a text model."""
    image = load_config(str(ROOT / "configs" / "quickstart.yaml"))
    variants = variant_overrides(image, ablations=False, peers=True)
    assert "torch_ddp" in variants and "hf_trainer" not in variants
    assert variants["torch_ddp"] == variants["ddp"]
    text = load_config(str(ROOT / "configs" / "bert_sst2_local.yaml"))
    variants = variant_overrides(text, ablations=False, peers=True)
    assert "hf_trainer" in variants and "torch_ddp" not in variants
    assert "freeze.strategy=none" in variants["hf_trainer"]


def test_the_hf_peer_starts_from_the_trainers_weights():
    """The same seed before the model is built: the Trainer's model is the trainer's."""
    from pipetransformer.models import build_model
    from pipetransformer.models.text_models import create_text_model

    config = load_config(str(ROOT / "configs" / "bert_sst2_local.yaml"))
    torch.manual_seed(config.trainer.seed)
    layered = build_model(config.model, task="classification", num_classes=2, vocab_size=500)
    torch.manual_seed(config.trainer.seed)
    model, _ = create_text_model(config.model, task="classification", num_labels=2, vocab_size=500)
    ours = torch.cat([p.detach().flatten() for p in layered.parameters()])
    theirs = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert ours.shape == theirs.shape and torch.equal(ours.sort().values, theirs.sort().values)


def test_the_torch_ddp_peer_on_two_processes_trains_as_one_does(tmp_path):
    """The plain loop's DistributedSampler and DDP split each global batch over the ranks and
    average the gradients: 2 processes train what 1 process trains on the whole batch (SGD,
    clipping), to float rounding. Its records are what `compare` reads."""
    config = load_config(str(ROOT / "configs" / "quickstart.yaml"), TINY_VIT)
    one, two = tmp_path / "one", tmp_path / "two"
    run_workers(peer_run, 1, "torch_ddp", config, one)
    run_workers(peer_run, 2, "torch_ddp", config, two)
    lines = {
        d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (one, two)
    }
    assert [m["global_step"] for m in lines[two]] == [8, 16]  # 256 samples / 32 a step
    for a, b in zip(lines[one], lines[two]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
    run = read_run(two)
    assert run["final_eval_metric"] == read_run(one)["final_eval_metric"]
    # Scored at every epoch's end, as the trainer scores (evaluations.jsonl too).
    assert None not in run["eval_metric"] and 0 < run["final_eval_metric"] <= 1
    assert read_seed_run(two, "torch_ddp", 0).training_time_s == run["training_time_s"] > 0


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, sst2_dir):
    """transformers' Trainer on 2 processes (accelerate's multi-process state over gloo), a
    tiny random BERT on 128 SST-2-like sentences, audited as a GPU would run it
    (tests/gpu_workers.py `audited_peer_run`): (run directory, each rank's audit, config)."""
    from gpu_workers import audited_peer_run

    pytest.importorskip("accelerate")
    config = load_config(
        str(ROOT / "configs" / "bert_sst2_local.yaml"),
        [
            f"data.root={sst2_dir}",
            "data.train_subset=128",
            "data.eval_subset=64",
            "data.max_seq_length=16",
            "trainer.epochs=2",
            "trainer.evals_per_epoch=2",
            "trainer.global_batch_size=32",
            "model.kwargs={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, "
            "intermediate_size: 64}",
        ],
    )
    run_dir = tmp_path_factory.mktemp("hf-peer")
    return run_dir, run_workers(audited_peer_run, 2, "hf_trainer", config, run_dir), config


def test_the_hf_trainer_peer_writes_a_run_compare_reads(hf_run):
    """The steps the batch gives, scored on rank 0 at the trainer's evaluation points (half
    of each epoch's samples and its end, trainer.evals_per_epoch 2), off its clock."""
    run = read_run(hf_run[0])
    assert [t["global_step"] for t in run["freeze_trajectory"]] == [4, 8]
    evaluations = read_jsonl(hf_run[0] / "evaluations.jsonl")
    assert [(e["global_step"], e["epochs_done"]) for e in evaluations] == [
        (2, 0.5),
        (4, 1.0),
        (6, 1.5),
        (8, 2.0),
    ]
    times = [e["training_time_s"] for e in evaluations]
    assert times == sorted(times) and times[-1] <= run["training_time_s"]
    assert run["eval_time_s"] == pytest.approx(sum(e["eval_time_s"] for e in evaluations))
    assert 0 < run["final_eval_metric"] <= 1 and run["metric_name"] == "accuracy"
    assert all(s > 0 for s in run["samples_per_s"])
    # Each sentence once an epoch, at its real length; batches padded to their longest
    # rounded up to 8 (DataCollatorWithPadding), so no more than 16 tokens a sentence.
    lengths = build_data(hf_run[2].data, seed=hf_run[2].trainer.seed).train.lengths
    assert run["real_tokens"] == [sum(lengths)] * 2
    assert all(sum(lengths) < padded <= 128 * 16 for padded in run["padded_tokens"])
    assert 0 < throughput(run)["padded_share"] < 1


@pytest.mark.gpu_rules
def test_the_hf_trainer_peers_collectives_are_what_nccl_takes(hf_run):
    """Both ranks' collectives on the default group carry tensors a GPU run holds on the
    device: the peak memory's all-reduce made its tensor on the host, which NCCL (the
    default group of a GPU run) refuses at the end of every run: no summary.json."""
    for result in hf_run[1]:
        assert result["violations"] == [], result["violations"]
        assert result["counts"].get("default:all_reduce", 0) >= 1, result["counts"]


@pytest.mark.gpu_rules
def test_the_torch_ddp_peer_computes_as_the_trainer_and_as_nccl_requires(tmp_path):
    """The plain timm loop on 2 processes under bf16, audited as a GPU would run it
    (tests/gpu_workers.py): its matmuls compute in bfloat16 as the trainer's autocast does
    (it ignored trainer.precision); within an epoch no copy blocks (they copied every batch
    from pageable memory with a blocking `.to(device)`), the epoch's mean loss read once;
    and every collective on the default group (NCCL's) carries device tensors (the peak
    memory's and an empty epoch's loss were made on the host)."""
    from gpu_workers import audited_peer_run

    config = load_config(
        str(ROOT / "configs" / "quickstart.yaml"),
        [*TINY_VIT, "data.train_subset=128", "trainer.precision=bf16"],
    )
    results = run_workers(audited_peer_run, 2, "torch_ddp", config, tmp_path)
    for result in results:
        assert result["violations"] == [], result["violations"]
        assert result["counts"].get("default:all_reduce", 0) >= 3  # 2 epochs' loss, peak
        assert result["matmul_dtypes"] == ["torch.bfloat16"], result["matmul_dtypes"]
        assert len(result["blocking"]) == 2  # epochs
        for found in result["blocking"]:
            assert [name for name, _ in found] == ["__float__"], found
    assert 0 < read_run(tmp_path)["final_eval_metric"] <= 1


def _captured_training_arguments(config, monkeypatch, tmp_path, hf_optim):
    """The keyword arguments the hf_trainer peer builds its TrainingArguments with."""
    import inspect

    import transformers

    from pipetransformer.compare import peers

    class Stop(Exception):
        pass

    def arguments(**kwargs):
        raise Stop(kwargs)

    arguments.__signature__ = inspect.signature(transformers.TrainingArguments)
    monkeypatch.setattr(transformers, "TrainingArguments", arguments)
    bundle = type("Data", (), {"task": "classification", "num_classes": 2, "vocab_size": 50})()
    with pytest.raises(Stop) as stopped:
        peers._run_hf_trainer(config, bundle, tmp_path, 1, hf_optim)
    monkeypatch.undo()
    return stopped.value.args[0]


def test_the_hf_trainer_peer_runs_trainings_own_default_optimizer(monkeypatch, tmp_path):
    """Unless told (--hf-optim), the peer leaves `optim` to TrainingArguments, as its users
    do: the optimizer Trainer then builds is the installed version's default
    (adamw_torch_fused with transformers 5 on torch >= 2.8: torch's fused AdamW), where
    the peer used to ask for adamw_torch (torch's per-parameter loop on the CPU)."""
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (the .[peers] extra)
    from transformers import Trainer, TrainingArguments

    config = load_config(str(ROOT / "configs" / "bert_sst2_local.yaml"))
    default = TrainingArguments(output_dir=str(tmp_path / "default")).optim
    model = torch.nn.Linear(4, 2)
    built = {}
    for hf_optim in (None, "adamw_torch"):
        kwargs = _captured_training_arguments(config, monkeypatch, tmp_path, hf_optim)
        assert ("optim" in kwargs) == (hf_optim is not None)
        kwargs.pop("ddp_backend")  # one process here: no process group to join
        args = TrainingArguments(**{**kwargs, "output_dir": str(tmp_path / str(hf_optim))})
        built[hf_optim] = Trainer(model=model, args=args).create_optimizer()
        assert args.optim == (default if hf_optim is None else hf_optim)
    assert type(built[None]) is torch.optim.AdamW
    assert bool(built[None].defaults["fused"]) == (default == "adamw_torch_fused")
    assert not built["adamw_torch"].defaults["fused"]
    sgd = load_config(str(ROOT / "configs" / "bert_sst2_local.yaml"), ["optimizer.name=sgd"])
    assert _captured_training_arguments(sgd, monkeypatch, tmp_path, None)["optim"] == "sgd"


def test_flattening_lets_a_bert_attend_across_samples_so_the_peer_refuses_it(tmp_path, capsys):
    """transformers' DataCollatorWithFlattening lays a batch in one row with position ids
    restarting per sample. A BERT under sdpa (the CPU's attention) attends across the row:
    create_bidirectional_mask takes no position ids (only causal masks look for packed
    sequences in them), so a sample's hidden states change with its neighbours. The
    sequence classifier's head also reads one [CLS] a row. The peer variant refuses, one
    line, before any process starts. If this test finds no leak, transformers keeps the
    samples apart now: the refusal may give way to the variant."""
    from transformers import BertConfig, BertModel, DataCollatorWithFlattening

    from pipetransformer.compare import peers

    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            attn_implementation="sdpa",
        )
    ).eval()
    samples = [[2, 7, 9, 11, 3], [2, 20, 21, 3]]
    flat = DataCollatorWithFlattening()([{"input_ids": s} for s in samples])
    assert flat["input_ids"].shape == (1, 9) and flat["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2, 3]
    ]
    with torch.no_grad():
        together = bert(input_ids=flat["input_ids"], position_ids=flat["position_ids"])
        alone = bert(input_ids=torch.tensor([samples[0]]))
    leak = (together.last_hidden_state[0, :5] - alone.last_hidden_state[0]).abs().max()
    assert leak > 1e-3  # float32 rounding is 1e-6: the second sample reached the first
    reason = peers.flattening_refusal(bert)
    assert reason is not None and "attention would cross samples" in reason
    with pytest.raises(SystemExit) as exited:
        peers.main(
            [
                "hf_trainer",
                str(ROOT / "configs" / "bert_sst2_local.yaml"),
                "--run-dir",
                str(tmp_path / "run"),
                "--hf-collator",
                "flattening",
            ]
        )
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("hf_trainer with DataCollatorWithFlattening: refused:")
    assert "BertForSequenceClassification reads one first token a row" in line
    assert not (tmp_path / "run").exists()
