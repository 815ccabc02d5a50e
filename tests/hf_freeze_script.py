"""A user's transformers `Trainer` script with `FreezeCallback` added, as the integration
tests run it: under `torchrun` on 2 CPU processes (gloo), or in the test's own process
as the single-process reference. Tiny random BERT, token ids from a fixed generator,
SGD at a constant rate and no dropout, so that runs that train on the same samples
compute the same weights (to float error), whatever the number of processes.

    torchrun --standalone --nproc-per-node 2 tests/hf_freeze_script.py OUT_DIR

Each rank runs, in one launch:
- `uninterrupted`: 4 epochs of 4 steps (global batch 16, evaluation every epoch, a
  checkpoint every 2 steps), the per-step losses logged;
- `resumed`: the same run resumed from the checkpoint 2 steps after the first freeze (in
  the middle of a decision interval);
- `accumulated`: 2 epochs with gradient accumulation (2 micro-batches of 4 a process) under
  bf16 autocast;
- `compiled`: 2 epochs with `torch_compile` (accelerate compiles the DDP-wrapped model).
and writes OUT_DIR/rank<r>.json (what each run logged and saw) and, on rank 0,
OUT_DIR/<run>.pt (its final weights).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from pipetransformer.integrations.transformers import FreezeCallback

VOCAB, LENGTH, SAMPLES = 50, 12, 64


class TokenDataset(torch.utils.data.Dataset):
    """Token ids whose label is whether the first token is in the upper half."""

    def __init__(self, samples: int = SAMPLES, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (samples, LENGTH), generator=generator)
        self.labels = (self.ids[:, 0] > VOCAB // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(LENGTH, dtype=torch.long)
        return {"input_ids": self.ids[index], "attention_mask": mask, "labels": self.labels[index]}


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


class Watching(FreezeCallback):
    """FreezeCallback that also keeps, at each freeze, a copy of the frozen parameters
    (through its `prefix_frozen` hook) and what DDP was set to."""

    def __init__(self, **keys) -> None:
        super().__init__(**keys)
        self.frozen_copies: dict[str, torch.Tensor] = {}
        self.find_unused: list[bool] = []

    def prefix_frozen(self, num_frozen_layers, freezer) -> None:
        names = {p: n for n, p in self._model.named_parameters()}
        for module in freezer.frozen_modules():
            for p in module.parameters():
                self.frozen_copies.setdefault(names[p], p.detach().clone())
        ddp = self._ddp()
        self.find_unused.append(bool(ddp.find_unused_parameters) if ddp is not None else False)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._model = model
        return super().on_train_begin(args, state, control, model=model, **kwargs)


def arguments(out_dir: Path, world: int, **overrides):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=16 // world,
        per_device_eval_batch_size=16,
        num_train_epochs=4,
        learning_rate=0.2,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=0,
        train_sampling_strategy="sequential",  # the same samples in a step at any world
        logging_strategy="steps",
        logging_steps=1,
        eval_strategy="epoch",
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_find_unused_parameters=False,
        # BERT's classification loss is a mean whatever the Trainer counts: scaling it by the
        # processes (Trainer's default for models that take loss kwargs) would double the
        # step on 2 processes, with or without the callback.
        average_tokens_across_devices=False,
        dataloader_num_workers=0,
    )
    if world > 1:
        settings["ddp_backend"] = "gloo"
    settings.update(overrides)
    return TrainingArguments(**settings)


def train(out_dir: Path, world: int, resume: str | None = None, **overrides) -> dict:
    """One Trainer run; what it logged and saw."""
    from transformers import Trainer

    callback = Watching(alpha=0.5, warmup_epochs=0)
    model = tiny_bert()
    trainer = Trainer(
        model=model,
        args=arguments(out_dir, world, **overrides),
        train_dataset=TokenDataset(),
        eval_dataset=TokenDataset(16, seed=2),
        callbacks=[callback],
    )
    trainer.train(resume_from_checkpoint=resume)
    changed = {
        name: float((dict(model.named_parameters())[name] - copy).abs().max())
        for name, copy in callback.frozen_copies.items()
    }
    history = trainer.state.log_history
    return {
        "wrapped": type(trainer.model_wrapped).__name__,
        "decisions": [h for h in history if "frozen_layers" in h],
        "losses": {h["step"]: h["loss"] for h in history if "loss" in h},
        "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h],
        "frozen_changed": changed,
        "find_unused": callback.find_unused,
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


RUNS = ("uninterrupted", "resumed", "accumulated", "compiled")


def main(out_dir: str, runs: tuple[str, ...] = RUNS) -> None:
    out = Path(out_dir)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    done = {"uninterrupted": train(out / "uninterrupted", world)}
    if "resumed" in runs:
        decisions = done["uninterrupted"]["decisions"]
        first = next(d["step"] for d in decisions if d["frozen_layers"])
        checkpoint = out / "uninterrupted" / f"checkpoint-{first + 2}"
        done["resumed"] = train(out / "resumed", world, resume=str(checkpoint))
        done["resumed"]["checkpoint"] = checkpoint.name
    if "accumulated" in runs:
        done["accumulated"] = train(
            out / "accumulated",
            world,
            per_device_train_batch_size=8 // world,
            gradient_accumulation_steps=2,
            num_train_epochs=2,
            bf16=True,
            save_strategy="no",
        )
    if "compiled" in runs:  # accelerate compiles the DDP wrapper (aot_eager: no C compiler)
        done["compiled"] = train(
            out / "compiled",
            world,
            num_train_epochs=2,
            save_strategy="no",
            torch_compile=True,
            torch_compile_backend="aot_eager",
        )
    if rank == 0:
        for name, run in done.items():
            torch.save(run["weights"], out / f"{name}.pt")
    for run in done.values():
        del run["weights"]
    (out / f"rank{rank}.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main(sys.argv[1])
