"""Where the run is: one `Tick` per optimizer step, made once per iteration of the loop.

A tick names the step being taken (its epoch and its place in the epoch, 0-based) and
the global step count once it is done; every periodic component answers `due(tick)` from
it, and no component moves the run's position but the clock. The position itself lives in
the run state (`RunState.epoch`, `.step_in_epoch`, `.samples_in_epoch`, `.global_step`:
where the next step starts), so a checkpoint written after a step resumes at the step after
it. How many steps an epoch has is the sampler's answer for the current layout: with
`trainer.batch_per_replica` it falls as replicas are added (autodp/sampler.py).

The clock also counts what AutoCache holds for the samples (`CachedShares`, kept in the run
state): each step's share of the epoch is recorded at the boundary the cache serves it at,
so that a boundary's stage 0 can be balanced for the prefix work its steps will do
(planning/run_model.py).

The learning-rate schedule runs on the samples trained, not on the step count, so that a
growing global batch does not stretch it: a step's place in the schedule is
`epoch x S + samples_in_epoch / B`, over `epochs x S` in all, where B is a node's batch in
the layout the run started in (kept in the run state, so a resume at another world size
keeps the schedule) and S = ceil(a node's epoch / B). With a fixed global batch B never
changes and the place is the step count, exactly as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pipetransformer.anneal import schedule_place
from pipetransformer.autodp.sampler import TrainSampler
from pipetransformer.planning.run_model import CachedShares
from pipetransformer.runs.state import RunState


@dataclass(frozen=True)
class Tick:
    epoch: int  # 0-based epoch this step belongs to
    step_in_epoch: int  # 0-based place of this step in its epoch
    global_step: int  # steps taken in the whole run once this one is done (1-based)
    steps_per_epoch: int  # of this step's epoch, in the current layout
    epochs: int
    schedule_step: float = -1.0  # this step's place in the learning-rate schedule (0-based)
    schedule_steps: int = 0  # the schedule's length
    samples: int = 0  # of its node's epoch order this step trains (shape padding aside)
    samples_before: int = 0  # of its node's epoch order trained before this step
    epoch_samples: int = 0  # a node's epoch (the sampler's epoch_samples)

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

    @property
    def epochs_done(self) -> float:
        """Epochs trained once this step is done: its epoch's share of samples added."""
        if self.epoch_end or self.epoch_samples <= 0:
            return float(self.completed_epochs)
        return self.epoch + (self.samples_before + self.samples) / self.epoch_samples

    def reaches(self, part: int, parts: int) -> bool:
        """Whether this step is the first to take its epoch's training to `part`/`parts` of
        its samples (a node's), whatever the batch: exact, in integers."""
        if self.epoch_samples <= 0:
            return self.epoch_end and part >= parts
        point = part * self.epoch_samples
        return self.samples_before * parts < point <= (self.samples_before + self.samples) * parts


class StepClock:
    """Yields the ticks from the run state's position to the end of the last epoch and
    moves that position as it goes. `replicas_per_node`: of the layout the run starts in
    (a new run's learning-rate schedule is counted in its node batches)."""

    def __init__(
        self, state: RunState, sampler: TrainSampler, epochs: int, replicas_per_node: int
    ) -> None:
        self.state = state
        self.sampler = sampler
        self.epochs = epochs
        self.last: Tick | None = None  # the tick of the newest step
        self.cached = CachedShares.from_dict(state.cache_shares)
        self.cache_serves_at: int | None = None  # the boundary AutoCache serves; None: off
        if state.lr_reference_node_batch <= 0:
            state.lr_reference_node_batch = sampler.node_batch_size(replicas_per_node)
        if state.step_in_epoch > 0 and state.samples_in_epoch <= 0:
            # A checkpoint older than the field: every step of its epoch had this batch.
            state.samples_in_epoch = state.step_in_epoch * sampler.node_batch_size(
                replicas_per_node
            )
        sampler.continue_at(
            state.epoch, state.step_in_epoch, state.samples_in_epoch, replicas_per_node
        )

    def use_layout(self, replicas_per_node: int, cache_serves_at: int | None = None) -> None:
        """The layout from the run state's position on (at the start and every transition),
        and the frozen boundary AutoCache serves its prefix at (None: it does not)."""
        self.cache_serves_at = cache_serves_at
        state = self.state
        self.sampler.continue_at(
            state.epoch, state.step_in_epoch, state.samples_in_epoch, replicas_per_node
        )

    @property
    def schedule_steps(self) -> int:
        """The learning-rate schedule's length (module docstring)."""
        per_epoch = math.ceil(self.sampler.epoch_samples / self.state.lr_reference_node_batch)
        return self.epochs * per_epoch

    def ticks(self) -> Iterator[Tick]:
        state, sampler = self.state, self.sampler
        reference = state.lr_reference_node_batch
        schedule_steps = self.schedule_steps
        per_epoch = schedule_steps // self.epochs
        while state.epoch < self.epochs:
            sampler.enter_epoch(state.epoch)
            offset = sampler.offset(state.epoch, state.step_in_epoch)
            tick = Tick(
                state.epoch,
                state.step_in_epoch,
                state.global_step + 1,
                sampler.steps_in_epoch(state.epoch),
                self.epochs,
                schedule_place(state.epoch, offset, per_epoch, reference),
                schedule_steps,
                min(sampler.node_batch_size_now, sampler.epoch_samples - offset),
                offset,
                sampler.epoch_samples,
            )
            self.cached.record(self.cache_serves_at, tick.samples / sampler.epoch_samples)
            if tick.epoch_end:
                self.cached.end_epoch()
            state.cache_shares = self.cached.to_dict()
            state.global_step = tick.global_step
            if tick.epoch_end:
                state.epoch, state.step_in_epoch, state.samples_in_epoch = tick.epoch + 1, 0, 0
            else:
                state.step_in_epoch = tick.step_in_epoch + 1
                state.samples_in_epoch = offset + sampler.node_batch_size_now
            self.last = tick
            yield tick


class TrainingClock:
    """The run's training seconds: the training loop's time with every evaluation and
    checkpoint write taken off it, the earlier attempts' added (their wall time less their
    evaluations and checkpoint writes, from the run state; work a crash lost counts, as it
    cost training time). summary.json's `training_time_s` and every evaluation's time into
    the run read this one clock, so a time-to-target measures training alone.
    `time.perf_counter` is read at each call (a test's stalled clock applies)."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.eval_s = 0.0  # this attempt's, off the clock
        self.checkpoint_s = 0.0
        self._started = time.perf_counter()

    def start(self) -> None:
        """The loop starts: this attempt's clock runs from now."""
        self._started = time.perf_counter()
        self.eval_s = self.checkpoint_s = 0.0

    def exclude_evaluation(self, seconds: float) -> None:
        self.eval_s += seconds

    def exclude_checkpoint(self, seconds: float) -> None:
        self.checkpoint_s += seconds

    def training_s(self) -> float:
        """Training seconds so far, every attempt."""
        state = self.state
        earlier = (
            state.previous_attempts_wall_s
            - state.previous_attempts_eval_s
            - state.previous_attempts_checkpoint_s
        )
        now = time.perf_counter() - self._started - self.eval_s - self.checkpoint_s
        return max(0.0, earlier) + max(0.0, now)

    @property
    def total_eval_s(self) -> float:
        return self.state.previous_attempts_eval_s + self.eval_s

    @property
    def total_checkpoint_s(self) -> float:
        return self.state.previous_attempts_checkpoint_s + self.checkpoint_s
