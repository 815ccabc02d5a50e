"""Where the run is: one `Tick` per optimizer step, made once per iteration of the loop.

A tick names the step being taken (its epoch and its place in the epoch, 0-based) and
the global step count once it is done; every periodic component answers `due(tick)` from
it, and no component moves the run's position but the clock. The position itself lives in
the run state (`RunState.epoch`, `.step_in_epoch`, `.global_step`: where the next step
starts), so a checkpoint written after a step resumes at the step after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pipetransformer.trainer.state import RunState


@dataclass(frozen=True)
class Tick:
    epoch: int  # 0-based epoch this step belongs to
    step_in_epoch: int  # 0-based place of this step in its epoch
    global_step: int  # steps taken in the whole run once this one is done (1-based)
    steps_per_epoch: int
    epochs: int

    @property
    def epoch_start(self) -> bool:
        return self.step_in_epoch == 0

    @property
    def epoch_end(self) -> bool:
        """This step completes its epoch."""
        return self.step_in_epoch == self.steps_per_epoch - 1

    @property
    def last(self) -> bool:
        """This step is the run's last."""
        return self.epoch_end and self.epoch == self.epochs - 1

    @property
    def completed_epochs(self) -> int:
        """Whole epochs done once this step is."""
        return self.epoch + 1 if self.epoch_end else self.epoch

    @property
    def steps_done_in_epoch(self) -> int:
        """Steps of this step's epoch taken once it is done."""
        return self.step_in_epoch + 1


class StepClock:
    """Yields the ticks from the run state's position to the end of the last epoch and
    moves that position as it goes."""

    def __init__(self, state: RunState, steps_per_epoch: int, epochs: int) -> None:
        self.state = state
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs
        self.last: Tick | None = None  # the tick of the newest step

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def ticks(self) -> Iterator[Tick]:
        state = self.state
        while state.epoch < self.epochs:
            tick = Tick(
                state.epoch,
                state.step_in_epoch,
                state.global_step + 1,
                self.steps_per_epoch,
                self.epochs,
            )
            state.global_step = tick.global_step
            if tick.epoch_end:
                state.epoch, state.step_in_epoch = tick.epoch + 1, 0
            else:
                state.step_in_epoch = tick.step_in_epoch + 1
            self.last = tick
            yield tick
