"""Elastic freeze training inside a Lightning script: a `BaseFinetuning` callback.

    trainer = L.Trainer(..., callbacks=[FreezeFinetuning()])

The same rule, keys and defaults as transformers' `FreezeCallback` (integrations/
freezer.py); needs the `.[lightning]` extra (`pip install lightning`). Where Lightning's
hooks fall:
- `setup` (BaseFinetuning calls `freeze_before_training`): the layer stack of the
  LightningModule is found (a transformers encoder or a timm ViT inside it; one-line error
  otherwise), the keys checked, the embedding frozen by `freeze.embedding` before DDP wraps
  the module (so DDP never synchronises it);
- `load_state_dict` / `on_fit_start` (a resumed fit): the checkpoint's progress, and its
  frozen layers frozen again once DDP is set up (its reducer rebuilt);
- `on_before_optimizer_step`: the step's per-unit gradient norms added on the device (before
  Lightning clips by norm: the clipping factor is applied to them, so the rule reads the
  gradients the step applies, `freeze.signal_gradients: auto`);
- `finetune_function` at each epoch's start (BaseFinetuning's contract) decides for the
  epoch that ended (the default, epoch ends), `on_train_batch_end` every `interval_steps`;
  each decision goes to the loggers (`frozen_layers`, `freeze_decision`, who set it).
- `state_dict`: the progress, in Lightning's checkpoint beside BaseFinetuning's own.

Under Lightning's DDP strategy (torchrun or its own launcher) the wrapper is
`trainer.strategy.model`; its reducer is rebuilt at each freeze (integrations/ddp.py), so
`find_unused_parameters` stays False (the strategy's default).

Owns: `FreezeFinetuning`. Must not: decide or freeze anything itself (freezer.py does).
"""

from __future__ import annotations

import math
from typing import Any

from pipetransformer.integrations.ddp import check_rebuildable, ddp_of
from pipetransformer.integrations.freezer import Freezer, freeze_config

try:
    from lightning.pytorch.callbacks import BaseFinetuning
except ImportError as exc:
    raise ImportError(
        "FreezeFinetuning needs Lightning: pip install 'pipetransformer[lightning]' "
        "(or pip install lightning)"
    ) from exc

OWNER = "FreezeFinetuning"


def _trained_weights(module) -> bool:
    """As FreezeCallback: a transformers model knows whether it was loaded pretrained."""
    for inner in module.modules():
        config = getattr(inner, "config", None)
        if config is not None and hasattr(config, "_name_or_path"):
            return bool(config._name_or_path)
    return True


class FreezeFinetuning(BaseFinetuning):
    """Freeze converged bottom layers while Lightning trains (module docstring). Keyword
    arguments: the config's `freeze` keys (docs/integrations.md)."""

    def __init__(self, **freeze_keys: Any) -> None:
        super().__init__()
        self.freeze_keys = dict(freeze_keys)
        self.freezer = Freezer(freeze_config(freeze_keys, OWNER, raw_gradients=True), OWNER)
        self._seen_step = 0

    # ------------------------------------------------------------------ set-up

    def freeze_before_training(self, pl_module) -> None:
        self.freezer.attach(pl_module, trained_weights=_trained_weights(pl_module))
        self.freezer.enter([], None)  # the embedding, before DDP wraps the module

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        clip = trainer.gradient_clip_val
        by_value = trainer.gradient_clip_algorithm == "value"
        if clip and by_value and not self.freezer.config.signal_before_clipping:
            raise ValueError(
                f"{OWNER}: freeze.signal_gradients: the gradients are clipped by value after "
                "the hook that reads them; set signal_gradients='raw' or clip by norm"
            )

    def on_fit_start(self, trainer, pl_module) -> None:
        super().on_fit_start(trainer, pl_module)
        self.freezer.enter(trainer.optimizers, self._ddp(trainer))  # a resumed fit's layers

    def on_train_start(self, trainer, pl_module) -> None:
        batches = trainer.num_training_batches
        steps = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
        self.freezer.set_schedule(steps, trainer.max_epochs or 1)
        self._seen_step = trainer.global_step

    def _ddp(self, trainer):
        ddp = ddp_of(trainer.strategy.model) if trainer.world_size > 1 else None
        if trainer.world_size > 1 and ddp is None:
            raise ValueError(
                f"{OWNER}: {trainer.world_size} processes but the strategy's model is not "
                f"DistributedDataParallel ({type(trainer.strategy).__name__}); use DDP"
            )
        if ddp is not None:
            check_rebuildable(ddp, OWNER)
        return ddp

    # ------------------------------------------------------------------ steps and decisions

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        clip = trainer.gradient_clip_val
        clipped = clip and not self.freezer.config.signal_before_clipping
        self.freezer.record_step(float(clip) if clipped else None)

    def finetune_function(self, pl_module, epoch: int, optimizer) -> None:
        """Epoch ends (the default): the decision for the epoch that ended, once (Lightning
        calls this for each optimizer, and again when it resumes inside an epoch)."""
        trainer = pl_module.trainer
        ended = epoch - 1
        if self.freezer.schedule.interval_steps is not None or ended < 0:
            return
        if self.freezer.progress.last_epoch_end >= ended:
            return
        if self.freezer.due(ended, True, False, trainer.global_step):
            self._decide(trainer, ended, True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.freezer.schedule.interval_steps is None or trainer.global_step == self._seen_step:
            return  # epoch ends decide in finetune_function; no optimizer step in this batch
        self._seen_step = trainer.global_step
        epoch_end = (batch_idx + 1) >= trainer.num_training_batches
        last = trainer.global_step >= trainer.estimated_stepping_batches
        if self.freezer.due(trainer.current_epoch, epoch_end, last, trainer.global_step):
            self._decide(trainer, trainer.current_epoch, epoch_end)

    def _decide(self, trainer, epoch: int, epoch_end: bool) -> None:
        record = self.freezer.decide(
            trainer.optimizers, self._ddp(trainer), epoch, trainer.global_step, epoch_end
        )
        numbers = {k: float(v) for k, v in record.items() if isinstance(v, (int, float))}
        for logger in trainer.loggers:
            logger.log_metrics(numbers, step=trainer.global_step)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "freeze_progress": self.freezer.state(local=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "freeze_progress" in state_dict:
            self.freezer.restore(state_dict["freeze_progress"])
