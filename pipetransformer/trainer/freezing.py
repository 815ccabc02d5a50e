"""The freeze algorithm in a run: when a decision is due, and the decision from the signal
the metrics gathered, the same on every rank.

`freeze.interval_steps: auto` decides three times an epoch of the starting layout's steps:
a function of the config, the same on any machine and under any load. `measured` (opt-in)
keeps the recurring cost of a transition (not the one-time micro-batch profiling of a new
layout) within TRANSITION_TIME_SHARE of the time between decisions; the slowest rank's
figures at the run's first transition decide, once (the interval is part of the run state,
so a resumed run keeps it), and a cadence event and a log line say what was measured, that
it depends on the machine's load, and how to pin it.

With `optimizer.layerwise_anneal` it also keeps the freeze plan (pipetransformer/anneal.py):
made at the start (or taken from a resumed run state and made again where the run is), it
gives every layer's learning rate at each step, raises a decision to the layers whose rate
has reached zero, and is made again after every decision; it lives in the run state, so a
checkpoint carries it.

Owns: `FreezeControl`. Must not: decide anything itself (freeze.py's and anneal.py's pure
functions do) or carry out a transition (the trainer does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pipetransformer.anneal import (
    Cadence,
    FreezePlan,
    Position,
    layer_learning_rate,
    plan_freezes,
    reconcile,
)
from pipetransformer.autodp.control import Control
from pipetransformer.autodp.topology import Layout
from pipetransformer.config import Config, ConfigError
from pipetransformer.freeze import (
    PLAN,
    TRANSITION_TIME_SHARE,
    DecisionSchedule,
    FreezeOutcome,
    counts_that_pay,
    fewest_that_pay,
    min_interval_for,
    signal_fraction,
)
from pipetransformer.freeze_signal import FreezeDriver
from pipetransformer.runs.records import CadenceEvent, FreezeDecisionEvent
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.clock import StepClock, Tick
from pipetransformer.trainer.metrics import MetricsTracker
from pipetransformer.trainer.optim import learning_rate, momentum_decay, momentum_sq_by_unit
from pipetransformer.utils.units import layer_of_unit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    num_frozen_layers: int
    layer_grad_norms: list[float] | None
    step_s: float  # this rank's mean step time over the interval
    outcome: FreezeOutcome | None = None  # what set the count (freeze.py, "Who decided")
    decided_by: str = ""  # the outcome's, or "plan" where layer-wise annealing froze more
    # Layer-wise annealing (None without): the plan's count here, and its places after it.
    planned: int | None = None
    planned_freeze_steps: list[float | None] | None = None

    def event(self, previous: int, decision_index: int, tick: Tick) -> FreezeDecisionEvent:
        """The decision as events.jsonl records it."""
        outcome = self.outcome
        return FreezeDecisionEvent(
            decision_index=decision_index,
            epoch=tick.epoch,
            global_step=tick.global_step,
            old_num_frozen_layers=previous,
            new_num_frozen_layers=self.num_frozen_layers,
            proposed=outcome.proposed if outcome else None,
            bound=outcome.bound if outcome else None,
            cap=outcome.cap if outcome else self.num_frozen_layers,
            decided_by=self.decided_by or (outcome.decided_by if outcome else ""),
            layer_grad_norms=self.layer_grad_norms,
            rule_num_frozen_layers=(
                outcome.num_frozen_layers if outcome and self.planned is not None else None
            ),
            planned_num_frozen_layers=self.planned,
            planned_freeze_steps=self.planned_freeze_steps,
        )


class FreezeControl:
    def __init__(
        self,
        config: Config,
        num_layers: int,
        steps_per_epoch: int,
        state: RunState,
        metrics: MetricsTracker,
        control: Control,
        clock: StepClock | None = None,
        layout_final: bool = False,
    ) -> None:
        """`clock`: the run's, which layer-wise annealing reads its places from (without it
        the run does not anneal). `layout_final`: the run starts as one stage with every
        process a replica, a layout no count of frozen layers can change (no fewer stages,
        no more replicas); with freeze.memory_aware no layer will freeze then, so the run
        takes no decision and gathers no signal (`idle`)."""
        self.config = config
        self.idle = layout_final and config.freeze.memory_aware and config.freeze.strategy != "none"
        # The decision driver the integrations share (freeze_signal.py); the run state keeps
        # what it carries from one decision to the next.
        self.driver = FreezeDriver(config.freeze, num_layers, state)
        self.decider = self.driver.decider
        self.steps_per_epoch = steps_per_epoch
        self.state = state  # decision_index, min_decision_interval, previous_layer_grad_norms
        self.metrics = metrics
        self.control = control
        self.clock = clock
        self.schedule = self._schedule(state.min_decision_interval)
        self.plan: FreezePlan | None = None
        if self.anneals:
            carried = FreezePlan.from_list(state.anneal_plan) if state.anneal_plan else None
            self.plan = self._replan(state.num_frozen_layers, carried)
            self._check_warmup()
            if control.rank == 0:
                logger.info(
                    "layer-wise annealing: each layer's learning rate reaches 0 at its planned "
                    "freeze step: %s (the head and '-' keep the run's schedule)",
                    " ".join("-" if p is None else f"{p:g}" for p in self.plan.freeze_places()),
                )
        else:  # a run resumed without annealing from a checkpoint that annealed
            state.anneal_plan = []

    def _schedule(self, min_interval: int) -> DecisionSchedule:
        return DecisionSchedule.for_config(
            self.config.freeze, self.steps_per_epoch, min_interval, self.config.trainer.epochs
        )

    @property
    def needs_grad_norms(self) -> bool:
        return self.decider.needs_grad_norms and not self.idle

    # ------------------------------------------------------------------ layer-wise annealing

    @property
    def anneals(self) -> bool:
        """optimizer.layerwise_anneal with a rule that freezes (with 'none' every layer keeps
        the run's schedule: config/checks.py)."""
        return (
            self.config.optimizer.layerwise_anneal
            and self.config.freeze.strategy != "none"
            and self.clock is not None
        )

    @property
    def anneal_layers(self) -> int | None:
        """The model's layers when the optimizer needs a group per layer, else None."""
        return self.decider.num_layers if self.anneals else None

    def layer_rates(self, tick: Tick) -> list[float] | None:
        """Each layer's learning rate at the step of `tick` (None: no annealing)."""
        if self.plan is None:
            return None
        optimizer = self.config.optimizer
        place, total = tick.schedule_step, tick.schedule_steps
        run = learning_rate(optimizer, place, total)
        return [
            layer_learning_rate(optimizer, curve, place, total, run) for curve in self.plan.curves
        ]

    def _cadence(self) -> Cadence:
        sampler = self.clock.sampler
        return Cadence(
            self.config.trainer.epochs,
            sampler.epoch_samples,
            sampler.node_batch_size_now,
            self.state.lr_reference_node_batch,
            self.schedule,
        )

    def _place_now(self) -> float:
        """The place in the schedule of the next step (where the run state is)."""
        return self._cadence().place(self.state.epoch, self.state.samples_in_epoch)

    def _replan(self, num_frozen_layers: int, previous: FreezePlan | None) -> FreezePlan:
        """The plan from where the run is (anneal.py), kept in the run state."""
        state = self.state
        position = Position(
            state.epoch,
            state.samples_in_epoch,
            self.metrics.steps_since_decision,
            state.decision_index,
            num_frozen_layers,
            state.global_step,
        )
        plan = plan_freezes(
            self.decider, self.config.optimizer, self._cadence(), position, previous
        )
        state.anneal_plan = plan.to_list()
        return plan

    def _check_warmup(self) -> None:
        """A layer planned to freeze before the warm-up ends would have no decay to anneal
        along: refused, naming the key (one line, the same on every rank)."""
        warmup = self.config.optimizer.warmup_steps
        active = self.plan.curves[self.state.num_frozen_layers :]
        places = [c.freeze_at for c in active if c.freeze_at is not None]
        if warmup and places and min(places) <= warmup:
            raise ConfigError(
                f"optimizer.warmup_steps: the warm-up ({warmup} steps) reaches the first "
                f"planned freeze (step {min(places):g}), so that layer's learning rate cannot "
                "anneal to zero by then (optimizer.layerwise_anneal); warm up for fewer steps "
                "or decide later (freeze.interval_steps, freeze.warmup_epochs)"
            )

    def due(self, tick: Tick) -> bool:
        # The baseline and the peers never freeze, nor a memory-aware run whose layout no
        # count changes: no decision point, no collective to agree on zero layers.
        if self.config.freeze.strategy == "none" or self.idle:
            return False
        return self.schedule.due(
            tick.epoch,
            tick.epoch_end,
            tick.last,
            self.metrics.steps_since_decision,
            tick.global_step,
        )

    @property
    def needs_grad_sums(self) -> bool:
        """autofreeze reads each layer's gradient summed over the interval."""
        return self.decider.needs_grad_sums and not self.idle

    @property
    def needs_momentum(self) -> bool:
        """signal_to_noise also reads the optimizer's moving average of gradients."""
        return self.config.freeze.strategy == "signal_to_noise"

    def decide(
        self,
        num_frozen_layers: int,
        dp_degree: int,
        unit_momentum_sq: list[float] | None = None,
        unit_grad_sums: tuple[list[float], int] | None = None,
        pays: Callable[[int], bool] | None = None,
    ) -> Decision:
        """The decision at this point (collective); starts the next interval.
        `unit_momentum_sq`: per unit, ||m||^2 of the optimizer's moving average of gradients
        summed over the ranks (replicas counted once): signal_to_noise reads it.
        `unit_grad_sums`: per unit, the L1 norm of the gradient summed over the interval
        (over the whole model, replicas counted once), and the steps the sum holds:
        autofreeze reads it. `pays`: whether freezing that many layers changes the layout
        (fewer stages or more replicas; the same on every rank), which freeze.memory_aware
        reads."""
        signal = self.metrics.freeze_signal(dp_degree, with_norms=self.needs_grad_norms)
        fractions = sums = None
        if self.needs_momentum:
            fractions = self._signal_fractions(signal.layer_grad_norms, unit_momentum_sq)
        if self.needs_grad_sums:
            sums = self._layer_grad_sums(*unit_grad_sums)
        outcome = self.driver.outcome(num_frozen_layers, signal.layer_grad_norms, fractions, sums)
        if self.config.freeze.memory_aware:
            if pays is None:
                raise ValueError("freeze.memory_aware needs the layouts' `pays`")
            outcome = fewest_that_pay(outcome, num_frozen_layers, pays)
        decided, decided_by, planned = outcome.num_frozen_layers, outcome.decided_by, None
        if self.plan is not None:
            # The layers whose rate reached zero freeze; more if the rule says so (anneal.py).
            reconciled = reconcile(self.plan, self._place_now(), num_frozen_layers, decided)
            decided, planned = reconciled.num_frozen_layers, reconciled.planned
            if reconciled.plan_decided:
                decided_by = PLAN
        self.control.agree(decided, "num_frozen_layers")
        if self.plan is not None:
            self.plan = self._replan(decided, self.plan)
        self.driver.record(decided_by, signal.layer_grad_norms, sums)
        return Decision(
            decided,
            signal.layer_grad_norms,
            signal.step_s,
            outcome,
            decided_by,
            planned,
            self.plan.freeze_places() if self.plan is not None else None,
        )

    def _layer_grad_sums(self, unit_l1: list[float], steps: int) -> list[float]:
        """Per layer, its attention and MLP units' L1 norms of the interval's summed
        gradient, per step (autofreeze's signal; freeze.py)."""
        num_layers = self.decider.num_layers
        per_layer = [0.0] * num_layers
        for unit, value in enumerate(unit_l1):
            layer = layer_of_unit(unit, num_layers)
            if layer is not None:
                per_layer[layer] += value
        sums = [value / max(1, steps) for value in per_layer]
        if self.control.rank == 0:
            logger.info(
                "decision %d: accumulated gradient (L1 per step, %d steps) %s",
                self.state.decision_index + 1,  # the one being taken
                steps,
                " ".join(f"{v:.4g}" for v in sums),
            )
        return sums

    def _signal_fractions(
        self, layer_grad_norms: list[float], unit_momentum_sq: list[float]
    ) -> list[float]:
        """Per layer, the share of its gradient that is signal (freeze.signal_fraction):
        its attention and MLP units' moving averages against the interval's mean squared
        gradient norm (the RMS norms' squares)."""
        beta = momentum_decay(self.config.optimizer)
        momentum = [0.0] * len(layer_grad_norms)
        for unit, value in enumerate(unit_momentum_sq):
            layer = layer_of_unit(unit, len(layer_grad_norms))
            if layer is not None:
                momentum[layer] += value
        fractions = [
            signal_fraction(m, norm * norm, beta) for m, norm in zip(momentum, layer_grad_norms)
        ]
        if self.control.rank == 0:
            logger.info(
                "decision %d: signal share of each layer's gradient %s (freeze below %g)",
                self.state.decision_index + 1,  # the one being taken
                " ".join(f"{f:.3f}" for f in fractions),
                self.config.freeze.signal_threshold,
            )
        return fractions

    def count_decisions(self, after_step: int = 0) -> int:
        """Decision points the schedule holds after `after_step` (a decision there, or the
        start), counting epochs of the starting layout's steps (with
        `trainer.batch_per_replica` later epochs are shorter: an estimate then)."""
        per_epoch = self.steps_per_epoch
        total = self.config.trainer.epochs * per_epoch
        count = since = 0
        for global_step in range(after_step + 1, total + 1):
            since += 1
            epoch, epoch_end = (global_step - 1) // per_epoch, global_step % per_epoch == 0
            if self.schedule.due(epoch, epoch_end, global_step == total, since, global_step):
                count, since = count + 1, 0
        return count

    def momentum(self, stage, num_units: int, device) -> list[float] | None:
        """`unit_momentum_sq` where the rule reads it (signal_to_noise), else None."""
        return (
            unit_momentum_sq(stage, num_units, device, self.control)
            if self.needs_momentum
            else None
        )

    def counts_that_pay(
        self, layout: Layout, pays_from: Callable[[Layout], Callable[[int], bool]]
    ) -> list[int] | None:
        """freeze.memory_aware, at the start: the counts of frozen layers that would change
        the first layout (`pays_from(layout)` says), empty where none would (no layer will
        freeze in it), said on rank 0; None without it. Planned layouts only: the same on
        every rank, no collective."""
        freeze = self.config.freeze
        if not freeze.memory_aware or freeze.strategy == "none":
            return None
        frozen = layout.plan.num_frozen_layers
        paying = (
            []
            if self.idle
            else counts_that_pay(frozen, self.decider.max_frozen_layers, pays_from(layout))
        )
        if self.control.rank != 0:
            return paying
        shape = f"{layout.pipe_len} stage(s) x {layout.dp_degree} replica(s)"
        if paying:
            logger.info(
                "freeze.memory_aware: from %s, freezing %s layers changes the layout; the "
                "rule's decisions are held to the fewest of these",
                shape,
                ", ".join(map(str, paying)),
            )
        elif self.idle:
            logger.info(
                "freeze.memory_aware: %s is one stage with every process a replica, which no "
                "count of frozen layers changes, so no %slayer will freeze and no decision is "
                "taken%s; freeze.memory_aware=false freezes by the rule alone",
                shape,
                "more " if frozen else "",
                "" if frozen else " (AutoCache stays off; the embedding as freeze.embedding says)",
            )
        else:
            logger.info(
                "freeze.memory_aware: from %s no count of frozen layers up to %d "
                "(freeze.max_frozen_layers) changes the layout, so no more layer will freeze",
                shape,
                self.decider.max_frozen_layers,
            )
        return paying

    def warn_if_nothing_can_freeze(self) -> None:
        """A freezing strategy whose schedule holds no decision point (a warm-up as long as
        the run, say) trains exactly as the baseline: said once, at the start."""
        freeze = self.config.freeze
        if freeze.strategy == "none" or self.count_decisions() > 0:
            return
        logger.warning(
            "nothing will freeze: freeze.strategy %s, but with freeze.warmup_epochs %d and "
            "trainer.epochs %d no decision point falls before the run ends",
            freeze.strategy,
            freeze.warmup_epochs,
            self.config.trainer.epochs,
        )

    def space(self, transition_s: float, step_s: float, global_step: int) -> CadenceEvent | None:
        """freeze.interval_steps 'measured', at the run's first transition: space decisions so
        that a transition of `transition_s` takes at most TRANSITION_TIME_SHARE of the steps
        between two (collective). Measured once and kept in the run state: later transitions
        and resumes keep the interval, so a run decides at the same steps after a resume."""
        if self.config.freeze.interval_steps != "measured" or self.state.decision_interval_measured:
            return None
        transition_s, step_s = self.control.all_max([transition_s, step_s]).tolist()
        default = self.schedule.interval_steps
        self.state.min_decision_interval = max(1, min_interval_for(transition_s, step_s))
        self.state.decision_interval_measured = True
        self.schedule = self._schedule(self.state.min_decision_interval)
        event = CadenceEvent(
            global_step=global_step,
            interval_steps=self.schedule.interval_steps,
            default_interval_steps=default,
            transition_s=transition_s,
            step_s=step_s,
            time_share=TRANSITION_TIME_SHARE,
            decisions_left=self.count_decisions(global_step),
        )
        logger.info(
            "freeze decisions every %d steps (freeze.interval_steps: measured; 'auto' decides "
            "every %d): a transition took %.3f s and a step %.3f s, and transitions may take "
            "%.0f%% of the time between decisions; measured times depend on the machine's "
            "load; %d decision(s) left in the run (pin it with freeze.interval_steps=%d)",
            event.interval_steps,
            default,
            transition_s,
            step_s,
            100 * TRANSITION_TIME_SHARE,
            event.decisions_left,
            event.interval_steps,
        )
        if event.decisions_left == 0:
            logger.warning(
                "no freeze decision is left before the run ends: transitions cost %.3f s against "
                "%.3f s steps; set freeze.interval_steps to decide more often",
                transition_s,
                step_s,
            )
        return event


def unit_momentum_sq(stage, num_units: int, device, control: Control) -> list[float]:
    """Per unit, ||m||^2 of the optimizer's moving average of gradients over the whole model
    (collective). Replicas hold the same state, counted once; the ranks of a sharded layout
    hold a shard each, summed."""
    squares = momentum_sq_by_unit(stage.optimizer, stage.named_params(), num_units, device)
    copies = 1 if stage.layout.sharded else stage.layout.dp_degree
    return (control.all_sum(squares) / copies).tolist()
