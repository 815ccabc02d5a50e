"""The freeze algorithm in a run: when a decision is due, and the decision from the signal
the metrics gathered, the same on every rank.

`freeze.interval_steps: auto` keeps the recurring cost of a transition (not the one-time
micro-batch profiling of a new layout) within TRANSITION_TIME_SHARE of the time between
decisions; the slowest rank's figures decide, and the bound only grows (it is part of the
run state).

Owns: `FreezeControl`. Must not: decide anything itself (freeze.py's pure functions do) or
carry out a transition (the trainer does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipetransformer.config import Config
from pipetransformer.freeze import DecisionSchedule, FreezeDecider, min_interval_for
from pipetransformer.trainer.clock import Tick
from pipetransformer.trainer.control import Control
from pipetransformer.trainer.metrics import MetricsTracker
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
        return DecisionSchedule.for_config(self.config.freeze, self.steps_per_epoch, min_interval)

    @property
    def needs_grad_norms(self) -> bool:
        return self.decider.needs_grad_norms

    def due(self, tick: Tick) -> bool:
        return self.schedule.due(
            tick.epoch, tick.epoch_end, tick.last, self.metrics.steps_since_decision
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

    def space(self, transition_s: float, step_s: float) -> None:
        """freeze.interval_steps 'auto': space decisions so a transition of `transition_s`
        stays within the allowed share of the steps between them (collective)."""
        if self.config.freeze.interval_steps != "auto":
            return
        transition_s, step_s = self.control.all_max([transition_s, step_s]).tolist()
        bound = min_interval_for(transition_s, step_s)
        if bound > self.state.min_decision_interval:
            self.state.min_decision_interval = bound
            self.schedule = self._schedule(bound)
            logger.info(
                "decision interval: %d steps (a transition took %.3f s, a step %.3f s)",
                self.schedule.interval_steps,
                transition_s,
                step_s,
            )
