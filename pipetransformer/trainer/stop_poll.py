"""When the ranks agree on a stop signal: often enough that a run stops within about a
second of a signal, never every step.

Agreeing is a collective over the control group (gloo, every node): per step it is a
cross-node barrier that holds back every pipeline stage's run-ahead. So the ranks poll every
N steps, where N is chosen at each poll from the slowest rank's seconds per step since the
previous one (the same numbers on every rank, so the same N), such that a poll happens
about every POLL_TARGET_S, and at least at every step log and epoch end.

Owns: `StopPoll`. Must not: write the checkpoint or raise (the trainer does).
"""

from __future__ import annotations

import math
import time

from pipetransformer.autodp.control import Control
from pipetransformer.trainer.clock import Tick
from pipetransformer.utils.stopping import StopRequest

POLL_TARGET_S = 1.0


def steps_between_polls(step_s: float, most: int) -> int:
    """Steps that take about POLL_TARGET_S, between 1 and `most`."""
    if step_s <= 0:
        return 1
    return max(1, min(most, math.floor(POLL_TARGET_S / step_s)))


class StopPoll:
    def __init__(self, control: Control, stop: StopRequest, most_steps: int) -> None:
        self.control = control
        self.stop = stop
        self.most_steps = most_steps
        self.next_step = 0  # the first step after start polls (global step counts from 1)
        self._since = (time.perf_counter(), 0)  # (host time, global step) of the last poll

    def due(self, tick: Tick) -> bool:
        return tick.global_step >= self.next_step or tick.epoch_end

    def poll(self, tick: Tick) -> int:
        """The stop signal any rank received (0: none); collective."""
        started, step = self._since
        now = time.perf_counter()
        step_s = (now - started) / max(1, tick.global_step - step)
        signum, slowest = self.control.all_max([self.stop.signum, step_s]).tolist()
        self.next_step = tick.global_step + steps_between_polls(slowest, self.most_steps)
        self._since = (now, tick.global_step)
        return int(signum)
