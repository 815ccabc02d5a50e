"""Layer-wise annealing (`optimizer.layerwise_anneal`): when each layer is planned to freeze,
and the learning rate each layer follows to zero by then. Pure: numbers in, numbers out.

FreezeOut (Brock, Lim, Ritchie, Weston, "FreezeOut: Accelerate Training by Progressively
Freezing Layers", 2017) anneals each layer's learning rate to zero by its own freeze time,
so a layer stops annealed rather than cut off mid-schedule. Here the freeze times come from
the freeze rule (its *plan*), not from FreezeOut's cubic spacing (docs/architecture.md,
"Layer-wise annealing"). Two shapes (`optimizer.layerwise_anneal`):
    freezeout       FreezeOut's own: a cosine from lr / t_i at the warm-up's end to zero at
                    the layer's freeze time, t_i that time's share of the run's steps (its
                    code's default `scale_lr`: a layer that trains for a shorter share
                    starts higher, so each gets about the same sum of rates); the warm-up
                    ramps to lr / t_i.
    run_schedule    (`true`) this project's variant: the run's own warm-up and decay shape
                    (cosine or linear) squeezed onto each freeze time, no rate scaling.

The plan (`plan_freezes`)
    From the run's position (epoch, samples of it trained, steps since the last decision,
    decisions so far, frozen layers F), the run's length and the decision cadence
    (`DecisionSchedule`: epoch ends, or every `freeze.interval_steps` steps), the places of
    the decision points still to come are simulated step by step as the trainer takes them
    (`decision_places`); at each the rule's planned count (`planned_count`) is:
      gradient_norm, gradient_norm_inclusive   Eq. 1's bound's path, F <- min(B(F), cap):
                                               the most Eq. 1 lets a decision freeze, and
                                               what it froze at every decision of the
                                               MiniLM fine-tune (docs/benchmarks.md 16-17);
      alpha_schedule                           its closed form ceil(L (1 - (1 - alpha)^T));
      manual                                   its list (the last entry repeats).
    Layer l is planned to freeze at the first decision whose count exceeds l; a layer no
    decision freezes (and the head) keeps the run's schedule. No plan exists for `none`
    (nothing freezes), for the rules whose signal alone decides (`convergence`,
    `signal_to_noise`, `autofreeze`, and any rule with `freeze.eq1_bound: false`), for
    `freeze.interval_steps: measured` (decisions spaced by measured times) and for decisions
    every N steps under `trainer.batch_per_replica` (the steps' places in the schedule depend
    on layouts to come): config/checks.py refuses those.

Places
    Plans and curves count in the learning-rate schedule's own unit (trainer/clock.py): the
    place of a step is `epoch x S + samples_in_epoch / B`, which under a fixed global batch is
    the number of steps before it. A layer planned to freeze at place p is trained by the
    steps before p and frozen at the decision point that ends them: its learning rate reaches
    0 at p, as the run's schedule reaches its floor at the place of the step after the last.

Each layer's curve (`LayerCurve`, `layer_learning_rate`)
    The run's warm-up, then the decay shape (the run's, or FreezeOut's cosine) run to zero
    at the layer's freeze place instead of at the run's end (whatever
    `optimizer.min_lr_ratio`: the floor is for the layers that train to the end), times the
    curve's `scale` (FreezeOut's 1 / t_i, fixed when the layer's curve is first made; 1 for
    run_schedule). A curve is a progress through the shape, linear in the place from an
    anchor: (W, 0) for a plan made at the start (W the warm-up steps), so progress =
    (s - W) / (p - W), the shape squeezed into [W, p].

Re-planning (`plan_freezes` with the previous plan, at every decision point and at a resume)
    The plan is made again from where the run is. A layer whose freeze place is unchanged
    keeps its curve (so re-planning a run that follows its plan changes nothing, bit for
    bit). A layer whose place moved is re-anchored at the current place with the progress it
    has reached, and runs on linearly to 1 at its new place, keeping its scale: its learning
    rate stays continuous and still reaches zero exactly at its new freeze place.

At a decision point (`reconcile`)
    The layers whose learning rate has reached zero (freeze place <= the current place)
    freeze, whatever the rule decided: such a layer would cost a full step's compute and
    learn nothing. If the rule freezes more, those layers freeze at their current rate and
    the rest re-plan. If the rule's signal would freeze fewer (Eq. 1's argmin below its
    bound), the plan's count stands: once a layer's rate has been annealed to zero there is
    nothing left to hold it back for. The rule's own count and the plan's are both recorded
    in the decision's event (`freeze_decision`: `rule_num_frozen_layers`,
    `planned_num_frozen_layers`; `decided_by` "plan" when the plan froze more than the rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetransformer.config import OptimizerConfig
from pipetransformer.freeze import DecisionSchedule, FreezeDecider, eq1_bound

# Rules whose plan is Eq. 1's bound's path (with freeze.eq1_bound on); config/checks.py
# refuses the others but the schedules' for optimizer.layerwise_anneal.
BOUND_PLANNED = ("gradient_norm", "gradient_norm_inclusive")
# Rules whose plan is their own schedule.
SCHEDULE_PLANNED = ("alpha_schedule", "manual")


def decay_shape(lr_schedule: str, progress: float) -> float:
    """The run's decay at `progress` in [0, 1]: 1 at the start, 0 at the end."""
    if lr_schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if lr_schedule == "linear":
        return 1 - progress
    return 1.0  # constant


def schedule_place(epoch: int, samples_in_epoch: float, per_epoch: int, reference: int) -> float:
    """The place in the learning-rate schedule of a position (trainer/clock.py)."""
    return epoch * per_epoch + samples_in_epoch / reference


@dataclass(frozen=True)
class Cadence:
    """What places the decision points in the schedule: the run's epochs, a node's epoch in
    samples, a node's batch, the schedule's unit (a node's batch in the layout the run
    started in) and when decisions fall."""

    epochs: int
    epoch_samples: int
    node_batch: int
    reference_node_batch: int
    schedule: DecisionSchedule

    @property
    def per_epoch(self) -> int:
        return math.ceil(self.epoch_samples / self.reference_node_batch)

    def place(self, epoch: int, samples_in_epoch: int) -> float:
        return schedule_place(epoch, samples_in_epoch, self.per_epoch, self.reference_node_batch)


@dataclass(frozen=True)
class Position:
    """Where the run is: the next step's epoch and the samples of it already trained, the
    steps since the last decision point, decision points so far and the frozen layers."""

    epoch: int
    samples_in_epoch: int
    steps_since_decision: int
    decision_index: int
    num_frozen_layers: int
    global_step: int = 0  # steps taken (a fitted warm-up counts them: freeze.cadence_epochs)


def decision_places(cadence: Cadence, position: Position) -> list[float]:
    """The places of the decision points from `position` to the run's end, stepping as the
    trainer's clock does (trainer/clock.py) and asking the schedule as FreezeControl does."""
    places = []
    epoch, samples, since = position.epoch, position.samples_in_epoch, position.steps_since_decision
    step = position.global_step
    while epoch < cadence.epochs:
        samples = min(samples + cadence.node_batch, cadence.epoch_samples)
        since += 1
        step += 1
        epoch_end = samples >= cadence.epoch_samples
        last = epoch_end and epoch == cadence.epochs - 1
        due = cadence.schedule.due(epoch, epoch_end, last, since, step)
        if epoch_end:
            epoch, samples = epoch + 1, 0
        if due:
            places.append(cadence.place(epoch, samples))
            since = 0
    return places


def planned_count(decider: FreezeDecider, decision_index: int, num_frozen_layers: int) -> int:
    """The layers the plan has frozen after decision `decision_index` (from 1), from
    `num_frozen_layers` before it (module docstring, "The plan")."""
    config = decider.config
    cap = decider.max_frozen_layers
    if config.strategy in BOUND_PLANNED and config.eq1_bound:
        bound = eq1_bound(num_frozen_layers, decider.num_layers, config.alpha)
        return max(num_frozen_layers, min(bound, cap))
    if config.strategy in SCHEDULE_PLANNED:
        return decider.outcome(decision_index, num_frozen_layers).num_frozen_layers
    raise ValueError(f"freeze.strategy {config.strategy}: its freeze times cannot be planned")


@dataclass(frozen=True)
class LayerCurve:
    """One layer's learning-rate curve: it reaches 0 at `freeze_at` (a place; None: never,
    the run's schedule), its progress through the run's decay shape running linearly from
    `anchor_progress` at `anchor_place` (the warm-up's end at the latest) to 1 there."""

    freeze_at: float | None = None
    anchor_place: float = 0.0
    anchor_progress: float = 0.0
    scale: float = 1.0  # the layer's initial rate over optimizer.lr (FreezeOut's 1 / t_i)

    def to_dict(self) -> dict[str, Any]:
        return {
            "freeze_at": self.freeze_at,
            "anchor_place": self.anchor_place,
            "anchor_progress": self.anchor_progress,
            "scale": self.scale,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerCurve:
        freeze_at = data.get("freeze_at")
        return cls(
            None if freeze_at is None else float(freeze_at),
            float(data.get("anchor_place", 0.0)),
            float(data.get("anchor_progress", 0.0)),
            float(data.get("scale", 1.0)),
        )


def run_progress(config: OptimizerConfig, place: float, total_steps: int) -> float:
    """The run's progress through its decay at `place` (0 during the warm-up)."""
    decay_steps = max(1, total_steps - config.warmup_steps)
    return min(1.0, max(0.0, (place - config.warmup_steps) / decay_steps))


def curve_progress(
    config: OptimizerConfig, curve: LayerCurve, place: float, total_steps: int
) -> float:
    """How far through the decay shape `curve` is at `place` (module docstring)."""
    if curve.freeze_at is None:
        return run_progress(config, place, total_steps)
    if place >= curve.freeze_at:
        return 1.0
    start = max(curve.anchor_place, float(config.warmup_steps))
    if place <= start or curve.freeze_at <= start:
        return curve.anchor_progress
    fraction = (place - start) / (curve.freeze_at - start)
    return min(1.0, curve.anchor_progress + (1 - curve.anchor_progress) * fraction)


def layer_learning_rate(
    config: OptimizerConfig, curve: LayerCurve, place: float, total_steps: int, run_rate: float
) -> float:
    """The learning rate of a layer on `curve` at `place`; `run_rate`: the run's there
    (trainer/optim.learning_rate), which a layer without a freeze place and the warm-up keep."""
    if curve.freeze_at is None:
        return run_rate
    if place >= curve.freeze_at:
        return 0.0
    if config.warmup_steps and place < config.warmup_steps:
        return run_rate * curve.scale
    shape = "cosine" if config.anneal_shape == "freezeout" else config.lr_schedule
    progress = curve_progress(config, curve, place, total_steps)
    return config.lr * curve.scale * decay_shape(shape, progress)


def initial_scale(config: OptimizerConfig, freeze_at: float | None, total_steps: int) -> float:
    """A new curve's scale: FreezeOut's 1 / t_i, t_i = `freeze_at` over the run's steps
    (module docstring); 1 for run_schedule and for a layer that never freezes."""
    if config.anneal_shape != "freezeout" or freeze_at is None or freeze_at <= 0:
        return 1.0
    return max(1.0, total_steps / freeze_at)


@dataclass(frozen=True)
class FreezePlan:
    """Every layer's curve, bottom first; the head keeps the run's schedule."""

    curves: tuple[LayerCurve, ...]

    def freeze_places(self) -> list[float | None]:
        return [curve.freeze_at for curve in self.curves]

    def annealed(self, place: float, num_frozen_layers: int = 0) -> int:
        """The frozen layers and, above them, the run of layers whose learning rate has
        reached 0 at `place`: the fewest a decision point there may leave frozen."""
        count = num_frozen_layers
        while count < len(self.curves):
            freeze_at = self.curves[count].freeze_at
            if freeze_at is None or freeze_at > place:
                break
            count += 1
        return count

    def to_list(self) -> list[dict[str, Any]]:
        return [curve.to_dict() for curve in self.curves]

    @classmethod
    def from_list(cls, data: Sequence[dict[str, Any]]) -> FreezePlan:
        return cls(tuple(LayerCurve.from_dict(entry) for entry in data))


def plan_freezes(
    decider: FreezeDecider,
    optimizer: OptimizerConfig,
    cadence: Cadence,
    position: Position,
    previous: FreezePlan | None = None,
) -> FreezePlan:
    """The plan from `position` on (module docstring): layers below the frozen boundary keep
    their curves (the record of when they froze), the others get their planned freeze places,
    and a layer whose place moved from `previous` is re-anchored where the run is."""
    num_layers = decider.num_layers
    now = cadence.place(position.epoch, position.samples_in_epoch)
    total = cadence.epochs * cadence.per_epoch
    freeze_at: list[float | None] = [None] * num_layers
    frozen = position.num_frozen_layers
    for offset, place in enumerate(decision_places(cadence, position), start=1):
        after = planned_count(decider, position.decision_index + offset, frozen)
        for layer in range(frozen, after):
            freeze_at[layer] = place
        frozen = after
    old = previous.curves if previous is not None and len(previous.curves) == num_layers else None
    curves = []
    for layer in range(num_layers):
        kept = old[layer] if old is not None else LayerCurve()
        if layer < position.num_frozen_layers:
            # Frozen: its curve records when it froze (now, if the rule froze it early).
            if kept.freeze_at is None or kept.freeze_at > now:
                progress = curve_progress(optimizer, kept, now, total)
                kept = LayerCurve(now, now, progress, kept.scale)
            curves.append(kept)
        elif old is not None and kept.freeze_at == freeze_at[layer]:
            curves.append(kept)  # its place did not move: its curve goes on unchanged
        elif old is None and now <= optimizer.warmup_steps:
            # From the warm-up's end, progress 0.
            scale = initial_scale(optimizer, freeze_at[layer], total)
            curves.append(LayerCurve(freeze_at[layer], scale=scale))
        else:
            progress = curve_progress(optimizer, kept, now, total)
            scale = kept.scale
            if old is None:
                scale = initial_scale(optimizer, freeze_at[layer], total)
            curves.append(LayerCurve(freeze_at[layer], now, progress, scale))
    return FreezePlan(tuple(curves))


@dataclass(frozen=True)
class Reconciled:
    """A decision point's count: the plan's (the frozen layers and those annealed to zero),
    the rule's, and the one taken (the larger)."""

    num_frozen_layers: int
    planned: int
    rule: int

    @property
    def plan_decided(self) -> bool:
        """The plan froze layers the rule's signal would have held back."""
        return self.planned > self.rule


def reconcile(plan: FreezePlan, place: float, previous: int, rule_count: int) -> Reconciled:
    """The decision at `place`, from `previous` frozen layers, given the rule's count (module
    docstring, "At a decision point")."""
    planned = plan.annealed(place, previous)
    return Reconciled(max(planned, rule_count), planned, rule_count)
