"""Elastic freeze training inside a transformers `Trainer` script: one callback.

    trainer = Trainer(model=model, args=args, ..., callbacks=[FreezeCallback()])

The keyword arguments are the config's `freeze:` keys (integrations/freezer.py: the same
checks, errors and defaults, except that it freezes by Eq. 1 at epoch ends from the end of
the second: `CALLBACK_DEFAULTS`). Where the
Trainer's events fall:
- `on_init_end` / `on_train_begin`: the layer stack is found (one-line error otherwise),
  the keys checked against its depth; at the start of training the embedding (by
  `freeze.embedding`) or, on `resume_from_checkpoint`, the layers the checkpoint had frozen
  are frozen, and the interval it was in continues;
- `on_pre_optimizer_step` (after accumulation, unscaling and clipping): the step's
  per-unit gradient norms are added on the device;
- `on_step_end` (`interval_steps` decisions) or `on_epoch_end` (the default): the decision,
  logged through `Trainer.log` (so `state.log_history`, TensorBoard and W&B get
  `frozen_layers` and who set it) before the Trainer logs, evaluates or saves that point.
- `state()`: the callback's progress in the checkpoint's `trainer_state.json`
  (`stateful_callbacks`), read back at `on_train_begin` of a resumed run.

Under DDP (torchrun) the wrapper the Trainer trains through is `Trainer.model_wrapped`; its
reducer is rebuilt at each freeze (integrations/ddp.py), so `ddp_find_unused_parameters`
can stay False. The Trainer is found on the call stack of the event (a callback is handed
the model, not the Trainer): its `model_wrapped`, `accelerator` and `log`.

AutoCache is not done here: a Trainer batch carries no sample ids to key the frozen
prefix's outputs by, and its collator pads each batch afresh; `prefix_frozen` is the hook a
cache would start from (docs/integrations.md).

Owns: `FreezeCallback`. Must not: decide or freeze anything itself (freezer.py does).
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

from torch import nn

from pipetransformer.integrations.ddp import check_rebuildable, ddp_of
from pipetransformer.integrations.freezer import Freezer, freeze_config, world_size

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # transformers is a dependency: only a broken install lands here
    raise ImportError(f"FreezeCallback needs transformers' Trainer: {exc}") from exc

logger = logging.getLogger(__name__)

OWNER = "FreezeCallback"


def _calling_trainer(limit: int = 12) -> Trainer | None:
    """The Trainer whose event is being handled: the `self` of the first Trainer method on
    the call stack (the callback handler calls the callbacks from inside it)."""
    frame = inspect.currentframe()
    try:
        for _ in range(limit):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
        return None
    finally:
        del frame


def _trained_weights(model: nn.Module) -> bool:
    """Whether the model was loaded from trained weights (`freeze.embedding: auto`): a
    transformers model from `from_pretrained` keeps where it came from; a timm model keeps
    no such record, and one fine-tuned under a Trainer is taken as pretrained."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_name_or_path"):
            return bool(config._name_or_path)
    return True


class FreezeCallback(TrainerCallback, ExportableState):
    """Freeze converged bottom layers while a transformers `Trainer` trains (module
    docstring). Keyword arguments: the config's `freeze` keys (docs/integrations.md)."""

    def __init__(self, **freeze_keys: Any) -> None:
        self.freeze_keys = dict(freeze_keys)
        self.freezer = Freezer(freeze_config(freeze_keys, OWNER, raw_gradients=False), OWNER)
        self.saved_progress: dict[str, Any] | None = None  # restore_callback_states_...
        self._trainer: Trainer | None = None
        self._steps_per_epoch = 1

    # ------------------------------------------------------------------ set-up

    def on_init_end(self, args, state, control, model=None, **kwargs):
        """Map the model as the Trainer is built: an unmappable model, or a key beyond its
        depth, is an error before anything trains."""
        if model is not None:
            self.freezer.attach(model, trained_weights=_trained_weights(model))

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        trainer = _calling_trainer()
        self._trainer = trainer
        steps = self._steps_per_epoch_of(args, kwargs.get("train_dataloader"), state)
        self._steps_per_epoch = steps
        saved = self._saved(state)
        if saved is not None:
            self.freezer.restore(saved)
        self.freezer.attach(model, trained_weights=_trained_weights(model))
        self.freezer.set_schedule(steps, state.num_train_epochs)
        ddp = self._ddp()
        if ddp is not None and ddp.find_unused_parameters:
            logger.info(
                "%s: DDP searches for unused parameters every step "
                "(ddp_find_unused_parameters); freezing does not need it: set it to False",
                OWNER,
            )
        self.freezer.enter([optimizer], ddp)
        if self.freezer.frozen_modules():  # the embedding, or a resumed run's frozen layers
            self.prefix_frozen(self.freezer.progress.num_frozen_layers, self.freezer)
        if saved is not None:
            logger.info(
                "%s: resumed at step %d with %d frozen layers",
                OWNER,
                state.global_step,
                self.freezer.progress.num_frozen_layers,
            )

    def _saved(self, state) -> dict[str, Any] | None:
        """The progress of the checkpoint this run resumes from (None: a fresh run)."""
        if state.global_step == 0:
            return None
        if self.saved_progress is not None:
            return self.saved_progress
        stored = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(stored, list):
            stored = stored[0] if stored else None
        return (stored or {}).get("attributes", {}).get("saved_progress")

    @staticmethod
    def _steps_per_epoch_of(args, dataloader, state) -> int:
        """Optimizer steps an epoch, as the Trainer counts them."""
        if dataloader is not None and hasattr(dataloader, "__len__"):
            return max(1, math.ceil(len(dataloader) / args.gradient_accumulation_steps))
        return max(1, state.max_steps // max(1, state.num_train_epochs))

    def _ddp(self):
        """The DDP wrapper the Trainer trains through (None: one process)."""
        if world_size() == 1:
            return None
        wrapped = self._trainer.model_wrapped if self._trainer is not None else None
        ddp = ddp_of(wrapped)
        if ddp is None:
            what = type(wrapped).__name__ if wrapped is not None else "nothing found"
            raise ValueError(
                f"{OWNER}: {world_size()} processes but the Trainer's model is not wrapped in "
                f"DistributedDataParallel ({what}); FSDP and DeepSpeed are not supported"
            )
        check_rebuildable(ddp, OWNER)
        return ddp

    # ------------------------------------------------------------------ steps and decisions

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.freezer.record_step()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.freezer.schedule.interval_steps is None:
            return
        step = state.global_step
        epoch = (step - 1) // self._steps_per_epoch
        epoch_end = step % self._steps_per_epoch == 0
        self._maybe_decide(epoch, epoch_end, step >= state.max_steps, state, optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        if self.freezer.schedule.interval_steps is not None:
            return
        step = state.global_step
        epoch = max(0, (step - 1) // self._steps_per_epoch)
        self._maybe_decide(epoch, True, step >= state.max_steps, state, optimizer)

    def _maybe_decide(self, epoch, epoch_end, last, state, optimizer) -> None:
        if not self.freezer.due(epoch, epoch_end, last, state.global_step):
            return
        before = self.freezer.progress.num_frozen_layers
        record = self.freezer.decide([optimizer], self._ddp(), epoch, state.global_step, epoch_end)
        if self._trainer is not None:
            self._trainer.log(record)  # state.log_history and every reporting callback
        else:
            state.log_history.append({**record, "epoch": state.epoch, "step": state.global_step})
        if self.freezer.progress.num_frozen_layers > before:
            self.prefix_frozen(self.freezer.progress.num_frozen_layers, self.freezer)

    def prefix_frozen(self, num_frozen_layers: int, freezer: Freezer) -> None:
        """Called after each freeze, on every rank (and at the start where something is
        frozen already): override to act on the frozen prefix (`freezer.frozen_modules()`),
        e.g. to serve its outputs from a cache."""

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        """What `Trainer` keeps of the callback in a checkpoint's trainer_state.json (called
        on the saving rank only: no collective)."""
        return {
            "args": dict(self.freeze_keys),
            "attributes": {"saved_progress": self.freezer.state(local=True)},
        }
