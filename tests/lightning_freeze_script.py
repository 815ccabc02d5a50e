"""A user's Lightning script with `FreezeFinetuning` added, as the integration tests run it:
under `torchrun` on 2 CPU processes (Lightning's DDP strategy over gloo, without
`find_unused_parameters`), or in the test's own process as the single-process reference.
The tiny BERT and token data of hf_freeze_script.py, SGD, no dropout, samples in order.

    torchrun --standalone --nproc-per-node 2 tests/lightning_freeze_script.py OUT_DIR

Each rank runs `uninterrupted` (4 epochs of 4 steps, global batch 16, a checkpoint at each
epoch's end) and `resumed` (the same fit from the checkpoint at the end of the epoch after
the first freeze, before the next decision),
and writes OUT_DIR/rank<r>.json and, on rank 0, OUT_DIR/<run>.pt (its final weights).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from hf_freeze_script import TokenDataset, tiny_bert

from pipetransformer.integrations.lightning import FreezeFinetuning


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_bert()
        self.losses: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses[self.trainer.global_step + 1] = float(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class Watching(FreezeFinetuning):
    """Keeps a copy of each parameter as it freezes, and what DDP was set to then."""

    def __init__(self, **keys) -> None:
        super().__init__(**keys)
        self.frozen_copies: dict[str, torch.Tensor] = {}
        self.find_unused: list[bool] = []

    def _decide(self, trainer, epoch, epoch_end) -> None:
        super()._decide(trainer, epoch, epoch_end)
        self._copy(trainer)

    def on_fit_start(self, trainer, pl_module) -> None:
        super().on_fit_start(trainer, pl_module)
        self._copy(trainer)

    def _copy(self, trainer) -> None:
        names = {p: n for n, p in trainer.lightning_module.named_parameters()}
        for module in self.freezer.frozen_modules():
            for p in module.parameters():
                self.frozen_copies.setdefault(names[p], p.detach().clone())
        ddp = self._ddp(trainer)
        self.find_unused.append(bool(ddp.find_unused_parameters) if ddp is not None else False)


def fit(out: Path, world: int, resume: str | None = None) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    module = Classifier()
    callback = Watching(alpha=0.5, warmup_epochs=0)
    # At each epoch's end (Lightning resumes a plain DataLoader only at an epoch's start),
    # before the decision for that epoch falls (at the next epoch's start): the checkpoint
    # carries a whole decision interval's sums.
    checkpoints = ModelCheckpoint(
        dirpath=out, every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1
    )
    trainer = pl.Trainer(
        max_epochs=4,
        accelerator="cpu",
        devices=world,
        strategy=(
            DDPStrategy(find_unused_parameters=False, process_group_backend="gloo")
            if world > 1
            else "auto"
        ),
        callbacks=[callback, checkpoints],
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    dataset = TokenDataset()
    # Lightning's own sampler would shuffle; in order, a global step trains on the same 16
    # samples at any world size.
    rank = int(os.environ.get("RANK", "0"))
    sampler = torch.utils.data.DistributedSampler(dataset, world, rank, shuffle=False)
    data = torch.utils.data.DataLoader(dataset, batch_size=16 // world, sampler=sampler)
    trainer.fit(module, data, ckpt_path=resume)
    changed = {
        name: float((dict(module.named_parameters())[name] - copy).abs().max())
        for name, copy in callback.frozen_copies.items()
    }
    return {
        "decisions": callback.freezer.progress.decisions,
        "losses": module.losses,
        "frozen_changed": changed,
        "find_unused": callback.find_unused,
        "requires_grad": {n: p.requires_grad for n, p in module.named_parameters()},
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
    }


def main(out_dir: str) -> None:
    out = Path(out_dir)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    runs = {"uninterrupted": fit(out / "uninterrupted", world)}
    first = next(d["global_step"] for d in runs["uninterrupted"]["decisions"] if d["frozen_layers"])
    checkpoint = next((out / "uninterrupted").glob(f"*step={first + 4}.ckpt"))
    runs["resumed"] = fit(out / "resumed", world, resume=str(checkpoint))
    runs["resumed"]["checkpoint"] = checkpoint.name
    if rank == 0:
        for name, run in runs.items():
            torch.save(run["weights"], out / f"{name}.pt")
    for run in runs.values():
        del run["weights"]
    (out / f"rank{rank}.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    main(sys.argv[1])
