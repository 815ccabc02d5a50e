"""Stopping a run cleanly: SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C).

A worker that receives either only notes it; the trainer agrees on it with every rank at
the next poll, about a second later (trainer/stop_poll.py: a signal reaches ranks at
slightly different moments, but all of them must stop after the same step), writes a
checkpoint and raises `RunStopped`. The
launcher turns that into one line with the command that resumes the run.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code_for(signum: int) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


class StopRequest:
    """Remembers the first stop signal this process received."""

    def __init__(self) -> None:
        self.signum: int = 0

    def install(self) -> StopRequest:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if not self.signum:
            self.signum = signum
            logger.info(
                "received %s: stopping at the next step the ranks agree on",
                signal.Signals(signum).name,
            )


@dataclass
class RunStopped(Exception):
    """The run stopped on a signal after writing a checkpoint."""

    signum: int
    global_step: int
    epoch: int  # 0-based epoch in progress
    step_in_epoch: int
    checkpoint: str

    def __str__(self) -> str:
        return (
            f"stopped by {signal.Signals(self.signum).name} at epoch {self.epoch + 1}, step "
            f"{self.step_in_epoch} (global step {self.global_step}); checkpoint {self.checkpoint}"
        )
