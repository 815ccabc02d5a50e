"""Freeze algorithm: how many bottom layers have converged. Pure: numbers in, a number out.

`num_frozen_layers` (F) counts frozen layers from the bottom; the embedding freezes with
the first of them, the head never freezes. A decision never lowers F and never exceeds
`max_frozen_layers` (default L - 1: one block always trains).

gradient_norm (the paper's Eq. 1)
    F_T = min(F_{T-1} + floor(alpha * (L - F_{T-1})),  argmin_{l in [F_{T-1}, L)} ||g_l|| + 1)

    ||g_l|| is layer l's gradient norm accumulated over the decision interval (the trainer
    sums each step's per-layer norm and reduces it over all ranks, so every rank holds the
    same numbers). "Freeze up to the argmin layer" is taken *inclusively*: the layer whose
    gradient moved least is the most converged one, so it freezes together with every
    layer below it (freezing stops at a layer boundary, so the layers below must go too).
    Eq. 1 caps each step at alpha of the still-active layers; when
    floor(alpha * (L - F)) is 0, freezing stops there.

convergence (AutoFreeze's test: freeze a layer once its gradient norm has stopped changing)
    r_l = | ||g_l||_T - ||g_l||_{T-1} | / ||g_l||_{T-1}
    F_T = min(F_{T-1} + floor(alpha * (L - F_{T-1})),  F_{T-1} + c)

    ||g_l|| is the same per-layer signal gradient_norm reads (the trainer's RMS over the
    interval's steps of layer l's gradient norm, reduced over all ranks). c is the number of
    consecutive active layers, from F_{T-1} up, whose r_l is strictly below `threshold`:
    freezing stops at the first layer that has not converged, whatever lies above it. The
    previous decision's norms are handed in: the trainer keeps them in the checkpointed run
    state (`previous_layer_grad_norms`); with none (the first decision, or an empty list:
    the run state's default) nothing freezes. |change| counts, so a norm that rose a little
    has converged as much as one that fell a little. A layer without a usable ratio has not
    converged, so freezing stops there: a previous norm of 0 (no gradient, so no relative
    change; 0 -> 0 included), or a NaN or infinite norm on either side. A norm that dropped
    to 0 changed by 100%.
    Negative norms, a negative or NaN threshold and norm lists of different lengths are
    errors (ValueError). Against gradient_norm: a layer whose gradient is small but still
    moving does not freeze, and nothing freezes before two decisions have been measured.

alpha_schedule (the closed form the paper's released code ran)
    F_T = ceil(L * (1 - (1 - alpha)^T))

manual
    F_T = manual_schedule[T - 1] (the last entry repeats).

none
    F_T = 0: the baseline.

T counts decision points from 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipetransformer.config import FreezeConfig


def _clamp(previous: int, proposed: int, max_frozen_layers: int) -> int:
    return max(previous, min(proposed, max_frozen_layers))


def gradient_norm_decision(
    num_frozen_layers: int,
    layer_grad_norms: Sequence[float],
    alpha: float,
    max_frozen_layers: int,
) -> int:
    num_layers = len(layer_grad_norms)
    previous = num_frozen_layers
    if previous >= min(max_frozen_layers, num_layers):
        return previous
    # alpha is often written as a rounded fraction (0.3333333333 for 1/3): treat products
    # within 1e-6 of an integer as that integer, or floor(0.9999999999) would stop freezing.
    bound = previous + math.floor(alpha * (num_layers - previous) + 1e-6)
    active = range(previous, num_layers)
    # Ties go to the lower layer: fewer layers freeze when the signal is ambiguous.
    argmin = min(active, key=lambda layer: (layer_grad_norms[layer], layer))
    return _clamp(previous, min(bound, argmin + 1), max_frozen_layers)


def alpha_schedule_decision(
    decision_index: int, num_layers: int, alpha: float, previous: int, max_frozen_layers: int
) -> int:
    proposed = math.ceil(num_layers * (1 - (1 - alpha) ** decision_index) - 1e-6)
    return _clamp(previous, proposed, max_frozen_layers)


def manual_decision(
    decision_index: int, schedule: Sequence[int], previous: int, max_frozen_layers: int
) -> int:
    proposed = schedule[min(decision_index, len(schedule)) - 1]
    return _clamp(previous, proposed, max_frozen_layers)


@dataclass
class FreezeDecider:
    """Applies the configured strategy at successive decision points."""

    config: FreezeConfig
    num_layers: int

    @property
    def max_frozen_layers(self) -> int:
        cap = self.config.max_frozen_layers
        return self.num_layers - 1 if cap is None else min(cap, self.num_layers)

    @property
    def needs_grad_norms(self) -> bool:
        return self.config.strategy in ("gradient_norm", "convergence")

    def decide(
        self,
        decision_index: int,
        num_frozen_layers: int,
        layer_grad_norms: Sequence[float] | None = None,
        previous_layer_grad_norms: Sequence[float] | None = None,
    ) -> int:
        """`previous_layer_grad_norms`: the norms the previous decision saw (convergence
        only; the caller keeps them, in the run state, so they survive a resume)."""
        if decision_index < 1:
            raise ValueError("decision points are counted from 1")
        strategy = self.config.strategy
        if strategy == "none":
            return num_frozen_layers
        norms_missing = layer_grad_norms is None or len(layer_grad_norms) != self.num_layers
        if self.needs_grad_norms and norms_missing:
            raise ValueError(f"{strategy} needs {self.num_layers} layer gradient norms")
        if strategy == "gradient_norm":
            return gradient_norm_decision(
                num_frozen_layers, layer_grad_norms, self.config.alpha, self.max_frozen_layers
            )
        if strategy == "convergence":
            return convergence_decision(
                num_frozen_layers,
                layer_grad_norms,
                previous_layer_grad_norms,
                self.config.alpha,
                self.config.convergence_threshold,
                self.max_frozen_layers,
            )
        if strategy == "alpha_schedule":
            return alpha_schedule_decision(
                decision_index,
                self.num_layers,
                self.config.alpha,
                num_frozen_layers,
                self.max_frozen_layers,
            )
        if strategy == "manual":
            return manual_decision(
                decision_index,
                self.config.manual_schedule,
                num_frozen_layers,
                self.max_frozen_layers,
            )
        raise ValueError(f"freeze.strategy: unknown strategy '{strategy}'")


# freeze.interval_steps 'auto': decisions per epoch, and the share of the time between two
# decisions a transition may take before decisions are spaced further apart.
DECISIONS_PER_EPOCH = 3
TRANSITION_TIME_SHARE = 0.05


@dataclass(frozen=True)
class DecisionSchedule:
    """When decision points fall: every `interval_steps` optimizer steps (counted from the
    previous decision), or (None) at the end of every epoch; none during the first
    `warmup_epochs` epochs and none after the last step (nothing would train in the new
    layout). Pure: the trainer asks `due` once after every step."""

    interval_steps: int | None
    warmup_epochs: int
    epochs: int
    steps_per_epoch: int

    @classmethod
    def for_config(
        cls, config: FreezeConfig, epochs: int, steps_per_epoch: int, min_interval_steps: int = 1
    ):
        """`min_interval_steps`: the lower bound 'auto' has learnt from transition costs."""
        interval = config.interval_steps
        if interval == "auto":
            interval = max(math.ceil(steps_per_epoch / DECISIONS_PER_EPOCH), min_interval_steps)
        return cls(interval, config.warmup_epochs, epochs, steps_per_epoch)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def due(self, global_step: int, epoch_end: bool, steps_since_decision: int) -> bool:
        """After step `global_step` (1-based count of steps taken); `epoch_end`: that step
        finished an epoch; `steps_since_decision`: steps since the previous decision point
        (since the start before the first)."""
        if global_step >= self.total_steps:
            return False
        epoch_of_step = (global_step - 1) // self.steps_per_epoch
        if self.interval_steps is None:
            return epoch_end and epoch_of_step + 1 >= self.warmup_epochs
        return steps_since_decision >= self.interval_steps and epoch_of_step >= self.warmup_epochs


def min_interval_for(transition_s: float, step_s: float) -> int:
    """Fewest steps between decisions for a transition of `transition_s` to take at most
    TRANSITION_TIME_SHARE of the time between them."""
    if step_s <= 0:
        return 1
    return max(1, math.ceil(transition_s / (TRANSITION_TIME_SHARE * step_s)))


def check_freeze_config(config: FreezeConfig, num_layers: int) -> None:
    """Checks that need the model's depth; raised before any process starts."""
    from pipetransformer.config import ConfigError

    if config.max_frozen_layers is not None and config.max_frozen_layers > num_layers:
        raise ConfigError(
            f"freeze.max_frozen_layers: {config.max_frozen_layers} exceeds "
            f"the model's {num_layers} layers"
        )
    if config.strategy == "manual" and max(config.manual_schedule) > num_layers:
        raise ConfigError(
            f"freeze.manual_schedule: {max(config.manual_schedule)} exceeds "
            f"the model's {num_layers} layers"
        )


def _relative_change(previous_norm: float, norm: float) -> float:
    """|norm - previous| / previous; infinite when there is no usable ratio (a previous norm
    of 0, a NaN or an infinite norm), so such a layer never counts as converged."""
    if not (math.isfinite(previous_norm) and math.isfinite(norm)) or previous_norm == 0:
        return math.inf
    return abs(norm - previous_norm) / previous_norm


def convergence_decision(
    num_frozen_layers: int,
    layer_grad_norms: Sequence[float],
    previous_layer_grad_norms: Sequence[float] | None,
    alpha: float,
    threshold: float,
    max_frozen_layers: int,
) -> int:
    """The `convergence` rule (module docstring): `previous_layer_grad_norms` are the norms
    the previous decision saw, None or empty at the first decision."""
    num_layers = len(layer_grad_norms)
    previous_norms = [] if previous_layer_grad_norms is None else list(previous_layer_grad_norms)
    if previous_norms and len(previous_norms) != num_layers:
        raise ValueError(
            f"convergence: {len(previous_norms)} previous layer gradient norms "
            f"for {num_layers} layers"
        )
    if any(norm < 0 for norm in (*layer_grad_norms, *previous_norms)):
        raise ValueError("convergence: gradient norms must not be negative")
    if not threshold >= 0:
        raise ValueError(f"convergence: threshold must be >= 0, got {threshold}")
    previous = num_frozen_layers
    if not previous_norms or previous >= min(max_frozen_layers, num_layers):
        return previous
    bound = previous + math.floor(alpha * (num_layers - previous) + 1e-6)  # as in Eq. 1
    proposed = previous
    while proposed < min(bound, num_layers) and (
        _relative_change(previous_norms[proposed], layer_grad_norms[proposed]) < threshold
    ):
        proposed += 1
    return _clamp(previous, proposed, max_frozen_layers)
