"""The freeze rules' signal and the step from it to a decision, shared by this project's
trainer and the integrations with other trainers (`pipetransformer.integrations`), so that
both gather the same numbers and decide by the same code.

- `unit_grad_squares`: one step's squared gradient norm of each unit (utils/units.py: 0 the
  embedding, 1 + 2l and 2 + 2l layer l's sublayers, 2L + 1 the head), one multi-tensor norm
  kernel and a scatter-add on the device.
- `GradNormInterval`: those squares summed over a decision interval on the device (no host
  read per step), with the part a checkpoint carried over; read once, reduced over the
  ranks, at a decision point.
- `layer_grad_norms`: per layer, the RMS over the interval's steps of its gradient norm
  (freeze.py's ||g_l||).
- `FreezeDriver`: freeze.py's `FreezeDecider` at successive decision points, with what the
  next decision and a resume need (the decision index, the norms the previous decision
  saw, how many decisions each term set), kept in a `DecisionHistory` the caller owns (the
  trainer's `RunState`, an integration's saved state).

Owns: the signal's bookkeeping and the decision driver. Must not: communicate (the caller
hands in its reduction), know a trainer, a pipeline or a model's internals, decide anything
itself (freeze.py's rules do).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pipetransformer.config import FreezeConfig
from pipetransformer.freeze import FreezeDecider, FreezeOutcome
from pipetransformer.utils.units import layer_of_unit, num_units

# Element-wise sum of a tensor over the ranks, returned as a CPU tensor (the caller's
# collective: the trainer's control group, an integration's default group).
AllSum = Callable[[torch.Tensor], torch.Tensor]


def unit_grad_squares(
    grads: Sequence[torch.Tensor], owner_index: torch.Tensor, num_units: int
) -> torch.Tensor:
    """Squared norm of the gradients of each unit, float64 on `owner_index`'s device:
    `grads[i]` belongs to unit `owner_index[i]` (an index the caller builds once and keeps on
    the device). One multi-tensor norm kernel over every gradient (float32 norms of float32
    gradients), then a scatter-add of their squares: no host synchronisation."""
    squares = torch.zeros(num_units, dtype=torch.float64, device=owner_index.device)
    if grads:
        norms = torch.stack(torch._foreach_norm(list(grads))).double()
        squares.index_add_(0, owner_index, norms.square())
    return squares


def layer_grad_norms(unit_squares: Sequence[float], steps: int, num_layers: int) -> list[float]:
    """Per layer, the RMS over `steps` steps of its gradient norm: its units' summed squares
    over the steps, square-rooted (the embedding and the head belong to no layer)."""
    per_layer = [0.0] * num_layers
    for unit, value in enumerate(unit_squares):
        layer = layer_of_unit(unit, num_layers)
        if layer is not None:
            per_layer[layer] += value
    return [math.sqrt(value / max(1, steps)) for value in per_layer]


class GradNormInterval:
    """Per unit, the squared gradient norms of a decision interval's steps, summed on the
    device; and the steps counted. `carried_squares` and `carried_steps`: what an earlier
    attempt had gathered of this interval when its checkpoint was taken (already reduced
    over the ranks), counted on top of this attempt's."""

    def __init__(
        self,
        num_layers: int,
        device: torch.device | str,
        carried_squares: Sequence[float] = (),
        carried_steps: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.num_units = num_units(num_layers)
        self.device = torch.device(device)
        self.reset()
        if len(carried_squares) == self.num_units:
            self._carried_squares = [float(v) for v in carried_squares]
        self._carried_steps = carried_steps

    def reset(self) -> None:
        """Start the next interval (nothing carried)."""
        self._squares = torch.zeros(self.num_units, dtype=torch.float64, device=self.device)
        self._carried_squares = [0.0] * self.num_units
        self._carried_steps = 0
        self.counted = 0  # this attempt's steps of the interval

    def add(self, unit_squares: torch.Tensor | None) -> None:
        """Count one step, and its per-unit squared norms where it measured them (no host
        synchronisation)."""
        if unit_squares is not None:
            self._squares += unit_squares
        self.counted += 1

    @property
    def steps(self) -> int:
        """Steps of the interval so far, the carried ones included."""
        return self._carried_steps + self.counted

    def unit_squares(self, all_sum: AllSum, copies: int = 1) -> list[float]:
        """The interval's per-unit sums over the whole model (collective through `all_sum`):
        this attempt's summed over the ranks, divided by `copies` (ranks that hold the same
        gradients, as DDP's replicas do, are counted once), plus the carried part."""
        live = all_sum(self._squares) / copies
        return [carried + float(value) for carried, value in zip(self._carried_squares, live)]

    def layer_norms(self, all_sum: AllSum, copies: int = 1) -> list[float]:
        """Per layer, the RMS gradient norm over the interval (collective)."""
        return layer_grad_norms(self.unit_squares(all_sum, copies), self.steps, self.num_layers)

    def local_unit_squares(self) -> list[float]:
        """This rank's sums plus the carried part, without a collective: what a checkpoint
        written by one rank keeps where every rank holds the same gradients (DDP)."""
        live = self._squares.tolist()
        return [carried + value for carried, value in zip(self._carried_squares, live)]


class DecisionHistory(Protocol):
    """What the decision driver keeps between decision points (and a checkpoint keeps):
    the trainer's `RunState` has these fields, an integration's saved state too."""

    decision_index: int
    previous_layer_grad_norms: list[float]
    previous_layer_grad_sums: list[float]
    decided_by: dict[str, int]


class FreezeDriver:
    """freeze.py's decider at successive decision points: `outcome` counts the decision and
    asks the rule (with the previous decision's signal, which the `convergence` and
    `autofreeze` rules compare against); `record` keeps, once the caller has settled the
    count (every rank agreeing, layer-wise annealing raising it), what the next decision
    reads and who set this one."""

    def __init__(self, config: FreezeConfig, num_layers: int, history: DecisionHistory) -> None:
        self.decider = FreezeDecider(config, num_layers)
        self.history = history

    def outcome(
        self,
        num_frozen_layers: int,
        layer_grad_norms: Sequence[float] | None = None,
        layer_signal_fractions: Sequence[float] | None = None,
        layer_grad_sums: Sequence[float] | None = None,
    ) -> FreezeOutcome:
        """The next decision point's outcome from this interval's signal (freeze.py)."""
        history = self.history
        history.decision_index += 1
        return self.decider.outcome(
            history.decision_index,
            num_frozen_layers,
            layer_grad_norms,
            history.previous_layer_grad_norms,
            layer_signal_fractions,
            layer_grad_sums,
            history.previous_layer_grad_sums,
        )

    def record(
        self,
        decided_by: str,
        layer_grad_norms: Sequence[float] | None = None,
        layer_grad_sums: Sequence[float] | None = None,
    ) -> None:
        """What the next decision compares against, and who set this one (counted)."""
        history = self.history
        if layer_grad_norms is not None:
            history.previous_layer_grad_norms = list(layer_grad_norms)
        if layer_grad_sums is not None:
            history.previous_layer_grad_sums = list(layer_grad_sums)
        history.decided_by[decided_by] = history.decided_by.get(decided_by, 0) + 1
