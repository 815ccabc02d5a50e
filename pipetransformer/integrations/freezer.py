"""What the integrations share: elastic freeze training of a model someone else's trainer
runs, whatever that trainer is.

A `Freezer` takes the config's freeze keys (the same defaults, checks and errors as a
config file's `freeze:` section, except the two a callback needs: it freezes by the paper's
Eq. 1, at epoch ends), finds the model's layer stack (models/stack.py), and then, told by
its trainer's glue when an optimizer step happened and when an epoch ended:
- counts each optimizer step, and where the rule reads them adds the step's per-unit
  squared gradient norms to the interval's sums on the device (freeze_signal.py: the
  trainer's own bookkeeping; no host read per step);
- at a decision point (freeze.py's `DecisionSchedule`: epoch ends by default) reads the
  sums once, reduced over the ranks, and decides by the trainer's own driver and rules
  (freeze_signal.py, freeze.py), checking that every rank decided the same;
- freezes the new prefix: `requires_grad_(False)`, gradients cleared, optimizer state
  released (the parameters stay in their groups, so checkpoints load either way), the
  frozen modules held in eval mode (no dropout: as `pipetransformer train` runs a frozen
  prefix), and the DDP wrapper's reducer rebuilt over the active parameters (ddp.py).
Its state (`FreezeProgress`) is plain values, for the trainer's checkpoint.

Owns: `FreezeProgress`, `Freezer`, the integrations' defaults and refusals. Must not: know
transformers' or Lightning's classes (their modules do), copy a rule (freeze.py has them).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipetransformer.config import ConfigError, FreezeConfig, section_from_dict
from pipetransformer.freeze import DecisionSchedule, FreezeOutcome, check_freeze_config
from pipetransformer.freeze_signal import FreezeDriver, GradNormInterval, unit_grad_squares
from pipetransformer.integrations.ddp import rebuild_reducer
from pipetransformer.models import find_layer_stack
from pipetransformer.utils.units import num_units, prefix_end

logger = logging.getLogger(__name__)

# Where a callback's defaults differ from the config's: a freezing callback freezes (the
# config's 'none' is the baseline), by the paper's Eq. 1, at epoch ends (the paper's T), and
# not before two epochs have completed: in `Trainer`'s default 3 epochs, one decision, whose
# layers miss only the last third of a decaying schedule's updates (docs/benchmarks.md
# section 24c: 1.31x plain `Trainer` at +0.16 points, where deciding from epoch 1's end cost
# 1.17 points).
CALLBACK_DEFAULTS: dict[str, Any] = {
    "strategy": "gradient_norm",
    "interval_steps": None,
    "warmup_epochs": 2,
}
# Rules that read more than per-layer gradient norms, which the integrations do not gather.
NOT_IN_INTEGRATIONS = {
    "signal_to_noise": "it reads the optimizer's moving average of gradients per layer",
    "autofreeze": "it keeps a copy of every gradient summed over the interval",
}


def freeze_config(freeze_keys: dict[str, Any], owner: str, raw_gradients: bool) -> FreezeConfig:
    """The callback's `FreezeConfig`: `CALLBACK_DEFAULTS` under the keys given, checked as a
    config file's `freeze:` section (ConfigError naming the key), then what an integration
    refuses. `raw_gradients`: whether the trainer shows the gradients before clipping."""
    config = section_from_dict(FreezeConfig, {**CALLBACK_DEFAULTS, **freeze_keys}, "freeze.")
    if config.strategy in NOT_IN_INTEGRATIONS:
        raise ConfigError(
            f"freeze.strategy: '{config.strategy}' is not available in {owner} "
            f"({NOT_IN_INTEGRATIONS[config.strategy]}); pipetransformer train runs it"
        )
    if config.interval_steps == "measured":
        raise ConfigError(
            f"freeze.interval_steps: 'measured' times pipetransformer train's transitions; "
            f"{owner} takes a number of steps, 'auto' or None (epoch ends)"
        )
    if config.memory_aware:
        raise ConfigError(
            f"freeze.memory_aware: {owner} trains one replica a process, so no layer it could "
            "freeze changes a pipeline layout (pipetransformer train packs pipelines); "
            "use False here"
        )
    if config.signal_before_clipping and not raw_gradients:
        raise ConfigError(
            f"freeze.signal_gradients: {owner} sees the gradients after clipping only; "
            "use 'clipped' or 'auto'"
        )
    return config


@dataclass
class FreezeProgress:
    """Where freezing is, in plain values (what a checkpoint keeps): the frozen layers, the
    decision driver's history (freeze_signal.DecisionHistory), the decision interval in
    progress (per-unit squared norms and steps) and every decision so far."""

    num_frozen_layers: int = 0
    decision_index: int = 0
    previous_layer_grad_norms: list[float] = field(default_factory=list)
    previous_layer_grad_sums: list[float] = field(default_factory=list)
    decided_by: dict[str, int] = field(default_factory=dict)
    interval_grad_sq: list[float] = field(default_factory=list)
    interval_steps: int = 0
    decisions: list[dict[str, Any]] = field(default_factory=list)
    # The last epoch whose end was a decision point (-1: none): a trainer that decides at
    # the next epoch's start (Lightning's BaseFinetuning) and resumes inside that epoch
    # must not decide for it twice.
    last_epoch_end: int = -1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FreezeProgress:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    """A frozen module's `train`: eval whatever its trainer asks (its subtree with it)."""
    return nn.Module.train(module, False)


def hold_in_eval(module: nn.Module) -> None:
    """Put `module` in eval mode and keep it there through its trainer's `model.train()`
    (which transformers' `Trainer` calls every step): its instance's `train` is replaced."""
    module.train = functools.partial(_stay_in_eval, module)
    module.train()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over the default group's ranks, on the tensor's device (NCCL takes
    device tensors), returned on the CPU: one host read."""
    if world_size() > 1:
        tensor = tensor.detach().clone()
        dist.all_reduce(tensor)
    return tensor.cpu()


def agree(value: int, what: str) -> int:
    """Check that every rank holds `value`; RuntimeError naming `what` if not."""
    if world_size() == 1:
        return value
    both = torch.tensor([value, -value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        both = both.cuda()
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = int(both[0]), -int(both[1])
    if high != value or low != value:
        raise RuntimeError(f"ranks disagree on {what}: {value} here, max {high}, min {low}")
    return value


def _inner(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a trainer's wrappers (accelerate's, Lightning's)."""
    for _ in range(4):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class Freezer:
    """Elastic freezing of one model inside another trainer (module docstring)."""

    def __init__(self, config: FreezeConfig, owner: str) -> None:
        self.config = config
        self.owner = owner  # the callback's name, for errors and logs
        self.progress = FreezeProgress()
        self.num_layers = 0
        self.interval: GradNormInterval | None = None
        self._frozen_end = 0  # first unit after the frozen prefix
        self._owners: tuple[list[nn.Parameter], torch.Tensor] | None = None

    # ------------------------------------------------------------------ set-up

    def attach(self, model: nn.Module, *, trained_weights: bool) -> None:
        """Find `model`'s layer stack and check the keys against its depth (one-line errors,
        before training). `trained_weights`: whether `freeze.embedding: auto` freezes the
        embedding (the weights are pretrained)."""
        try:
            stack = find_layer_stack(model)
        except ValueError as exc:
            raise ValueError(f"{self.owner}: {exc}") from None
        self.num_layers = stack.spec.num_layers
        check_freeze_config(self.config, self.num_layers)
        unit_of: dict[nn.Parameter, int] = {}
        for index, unit in enumerate(stack.units):
            for p in unit.parameters():
                unit_of.setdefault(p, index)
        head = num_units(self.num_layers) - 1
        # Every parameter of the model the trainer holds: outside the library model (a
        # wrapper's own head, say) it counts as head, which never freezes.
        self.unit_params: list[list[nn.Parameter]] = [[] for _ in range(head + 1)]
        for p in model.parameters():
            self.unit_params[unit_of.get(p, head)].append(p)
        self.unit_modules = [list(unit.children()) for unit in stack.units]
        self.device = next(model.parameters()).device
        embedding = self.config.embedding
        self.embedding_frozen = self.config.strategy != "none" and (
            trained_weights if embedding == "auto" else bool(embedding)
        )
        self.schedule = DecisionSchedule.for_config(self.config, 1)  # until `set_schedule`
        self._continue()

    def set_schedule(self, steps_per_epoch: int, epochs: int) -> None:
        """Decision points for a run of `epochs` epochs of `steps_per_epoch` optimizer steps
        (freeze.py's `DecisionSchedule`, as the trainer's)."""
        self.schedule = DecisionSchedule.for_config(
            self.config, max(1, steps_per_epoch), epochs=max(1, epochs)
        )

    def restore(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's progress: where freezing was, and the decision interval it
        was in."""
        self.progress = FreezeProgress.from_dict(saved)
        if self.num_layers:
            self._continue()

    def _continue(self) -> None:
        """The decision driver and the interval, from the progress."""
        self.driver = FreezeDriver(self.config, self.num_layers, self.progress)
        self.interval = GradNormInterval(
            self.num_layers,
            self.device,
            self.progress.interval_grad_sq,
            self.progress.interval_steps,
        )

    def enter(self, optimizers: Iterable[Any], ddp: DistributedDataParallel | None) -> None:
        """Freeze what the progress says is frozen (the embedding at the start, the layers
        a resumed run had frozen), before the first step."""
        self._freeze_to(self.progress.num_frozen_layers, optimizers, ddp)

    # ------------------------------------------------------------------ every step

    @property
    def needs_grad_norms(self) -> bool:
        return self.driver.decider.needs_grad_norms

    def record_step(self, clip_max_norm: float | None = None) -> None:
        """One optimizer step, after its gradients are complete and before they are cleared:
        counted, and where the rule reads them its per-unit squared norms added on the
        device. `clip_max_norm`: clipping (by the total norm) the trainer applies after this
        point, so the norms are of the gradients the step applies."""
        squares = None
        if self.needs_grad_norms:
            params, owner_index = self._owner_index()
            grads = [p.grad for p in params]
            present = [i for i, g in enumerate(grads) if g is not None]
            if len(present) < len(grads):  # a parameter this step left without a gradient
                owner_index = owner_index[torch.tensor(present, device=owner_index.device)]
                grads = [grads[i] for i in present]
            squares = unit_grad_squares(grads, owner_index, num_units(self.num_layers))
            if clip_max_norm is not None:  # as torch.nn.utils.clip_grad_norm_ scales them
                scale = (clip_max_norm / (squares.sum().sqrt() + 1e-6)).clamp(max=1.0)
                squares = squares * scale.square()
            # An overflowing mixed-precision step (the scaler skips it) adds nothing.
            squares = torch.where(squares.sum().isfinite(), squares, torch.zeros_like(squares))
        self.interval.add(squares)

    def _owner_index(self) -> tuple[list[nn.Parameter], torch.Tensor]:
        """The trained parameters and, on the device, the unit of each: built once per
        frozen boundary."""
        if self._owners is None:
            params, owners = [], []
            for unit, unit_params in enumerate(self.unit_params):
                for p in unit_params:
                    if p.requires_grad:
                        params.append(p)
                        owners.append(unit)
            index = torch.tensor(owners, dtype=torch.long).to(self.device)
            self._owners = params, index
        return self._owners

    # ------------------------------------------------------------------ decisions

    def due(self, epoch: int, epoch_end: bool, last: bool, global_step: int) -> bool:
        """Whether a decision point falls after this optimizer step (freeze.py's schedule;
        `epoch` 0-based)."""
        if self.config.strategy == "none":
            return False
        steps = self.interval.steps
        return self.schedule.due(epoch, epoch_end, last, steps, global_step)

    def decide(
        self,
        optimizers: Iterable[Any],
        ddp: DistributedDataParallel | None,
        epoch: int,
        global_step: int,
        epoch_end: bool = False,
    ) -> dict[str, Any]:
        """The decision at this point (collective: every rank, the same point), after an
        optimizer step of `epoch` (0-based; `epoch_end`: its last), the new prefix frozen;
        returns the decision as the trainer's log records it."""
        previous = self.progress.num_frozen_layers
        norms = None
        if self.needs_grad_norms:
            norms = self.interval.layer_norms(all_sum, world_size())
        if epoch_end:
            self.progress.last_epoch_end = epoch
        outcome: FreezeOutcome = self.driver.outcome(previous, norms)
        decided = agree(outcome.num_frozen_layers, "num_frozen_layers")
        self.driver.record(outcome.decided_by, norms)
        self.interval.reset()
        if decided > previous:
            self._freeze_to(decided, optimizers, ddp)
        record = {
            "frozen_layers": decided,
            "freeze_decision": self.progress.decision_index,
            "freeze_decided_by": outcome.decided_by,
            "freeze_proposed": outcome.proposed,
            "freeze_bound": outcome.bound,
            "freeze_cap": outcome.cap,
        }
        self.progress.decisions.append(
            {
                **record,
                "previous_frozen_layers": previous,
                "epoch": epoch,
                "global_step": global_step,
                "layer_grad_norms": norms,
            }
        )
        if rank() == 0:
            logger.info(
                "%s: decision %d after step %d: %d -> %d frozen layers (set by %s)%s",
                self.owner,
                self.progress.decision_index,
                global_step,
                previous,
                decided,
                outcome.decided_by,
                "; layer gradient norms " + " ".join(f"{n:.3g}" for n in norms) if norms else "",
            )
        return {key: value for key, value in record.items() if value is not None}

    def _freeze_to(
        self,
        num_frozen_layers: int,
        optimizers: Iterable[Any],
        ddp: DistributedDataParallel | None,
    ) -> None:
        end = prefix_end(num_frozen_layers, self.embedding_frozen)
        newly = [p for unit in range(self._frozen_end, end) for p in self.unit_params[unit]]
        newly = [p for p in newly if p.requires_grad]
        inner = [o for o in (_inner(opt) for opt in optimizers) if o is not None]
        for p in newly:
            p.requires_grad_(False)
            p.grad = None  # a stale gradient would be applied, and DDP must not see one
            for optimizer in inner:
                optimizer.state.pop(p, None)  # its moments: memory the frozen layer frees
        for unit in range(self._frozen_end, end):
            for module in self.unit_modules[unit]:
                hold_in_eval(module)
        self._frozen_end = max(self._frozen_end, end)
        self.progress.num_frozen_layers = num_frozen_layers
        self._owners = None
        if ddp is not None and newly:
            rebuild_reducer(ddp)

    def frozen_modules(self) -> list[nn.Module]:
        """The frozen prefix's modules, embedding first (what a cache of the prefix's
        outputs would stand in for)."""
        return [m for unit in range(self._frozen_end) for m in self.unit_modules[unit]]

    # ------------------------------------------------------------------ checkpoints

    def state(self, local: bool = True) -> dict[str, Any]:
        """The progress as a checkpoint keeps it: with the decision interval's sums so far
        (`local`: this rank's, without a collective, where every rank holds the same
        gradients, as under DDP)."""
        if self.interval is not None:
            self.progress.interval_grad_sq = self.interval.local_unit_squares()
            self.progress.interval_steps = self.interval.steps
        return self.progress.to_dict()
