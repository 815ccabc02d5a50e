"""The freeze algorithm in a run: when a decision is due, and the decision from the signal
the metrics gathered, the same on every rank.

`freeze.interval_steps: auto` keeps the recurring cost of a transition (not the one-time
micro-batch profiling of a new layout) within TRANSITION_TIME_SHARE of the time between
decisions; the slowest rank's figures at the run's first transition decide, once (the
interval is part of the run state, so a resumed run keeps it), and a cadence event and a
log line say what was measured and how to pin it.

Owns: `FreezeControl`. Must not: decide anything itself (freeze.py's pure functions do) or
carry out a transition (the trainer does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipetransformer.config import Config
from pipetransformer.freeze import (
    TRANSITION_TIME_SHARE,
    DecisionSchedule,
    FreezeDecider,
    min_interval_for,
)
from pipetransformer.trainer.clock import Tick
from pipetransformer.trainer.control import Control
from pipetransformer.trainer.metrics import MetricsTracker
from pipetransformer.trainer.records import CadenceEvent
from pipetransformer.trainer.state import RunState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    num_frozen_layers: int
    layer_grad_norms: list[float] | None
    step_s: float  # this rank's mean step time over the interval


class FreezeControl:
    def __init__(
        self,
        config: Config,
        num_layers: int,
        steps_per_epoch: int,
        state: RunState,
        metrics: MetricsTracker,
        control: Control,
    ) -> None:
        self.config = config
        self.decider = FreezeDecider(config.freeze, num_layers)
        self.steps_per_epoch = steps_per_epoch
        self.state = state  # decision_index, min_decision_interval, previous_layer_grad_norms
        self.metrics = metrics
        self.control = control
        self.schedule = self._schedule(state.min_decision_interval)

    def _schedule(self, min_interval: int) -> DecisionSchedule:
        return DecisionSchedule.for_config(
            self.config.freeze, self.config.trainer.epochs, self.steps_per_epoch, min_interval
        )

    @property
    def needs_grad_norms(self) -> bool:
        return self.decider.needs_grad_norms

    def due(self, tick: Tick) -> bool:
        return self.schedule.due(
            tick.global_step, tick.epoch_end, self.metrics.steps_since_decision
        )

    def decide(self, num_frozen_layers: int, dp_degree: int) -> Decision:
        """The decision at this point (collective); starts the next interval."""
        self.state.decision_index += 1
        signal = self.metrics.freeze_signal(dp_degree, with_norms=self.needs_grad_norms)
        decided = self.decider.decide(
            self.state.decision_index,
            num_frozen_layers,
            signal.layer_grad_norms,
            self.state.previous_layer_grad_norms,
        )
        self.control.agree(decided, "num_frozen_layers")
        if signal.layer_grad_norms is not None:
            self.state.previous_layer_grad_norms = list(signal.layer_grad_norms)
        return Decision(decided, signal.layer_grad_norms, signal.step_s)

    def decisions_left(self, global_step: int) -> int:
        """Decision points after `global_step` at the current schedule (without warm-up)."""
        schedule = self.schedule
        if schedule.interval_steps is None:
            return max(0, schedule.epochs - 1 - (global_step // self.steps_per_epoch))
        return max(0, (schedule.total_steps - 1 - global_step) // schedule.interval_steps)

    def space(self, transition_s: float, step_s: float, global_step: int) -> CadenceEvent | None:
        """freeze.interval_steps 'auto', at the run's first transition: space decisions so
        that a transition of `transition_s` takes at most TRANSITION_TIME_SHARE of the steps
        between two (collective). Measured once and kept in the run state: later transitions
        and resumes keep the interval, so a run decides at the same steps after a resume."""
        if self.config.freeze.interval_steps != "auto" or self.state.decision_interval_measured:
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
            decisions_left=self.decisions_left(global_step),
        )
        if event.interval_steps > default:
            logger.info(
                "freeze decisions every %d steps instead of %d: a transition took %.3f s and a "
                "step %.3f s, and transitions may take %.0f%% of the time between decisions; "
                "%d decision(s) left in the run (pin it with freeze.interval_steps=N)",
                event.interval_steps,
                default,
                transition_s,
                step_s,
                100 * TRANSITION_TIME_SHARE,
                event.decisions_left,
            )
        if event.decisions_left == 0:
            logger.warning(
                "no freeze decision is left before the run ends: transitions cost %.3f s against "
                "%.3f s steps; set freeze.interval_steps to decide more often",
                transition_s,
                step_s,
            )
        return event
