"""Evaluation: when it is due, and a forward pass over the whole eval set, split over every
replica of the current layout, scored the same on every rank. Text batches run at their
padded length (a bucket in a pipeline of several stages), as training batches do
(trainer/step.py); with data.group_by_length the eval set goes longest first, so each batch
holds samples of similar length.

When: at the end of every `trainer.eval_interval_epochs`-th epoch and of the last, and with
`trainer.evals_per_epoch` N > 1 also after the first step that takes an epoch to k/N of its
samples (k < N). The points are shares of the epoch's samples, not step counts, so runs in
layouts with other steps an epoch (AutoDP under trainer.batch_per_replica) evaluate at the
same points, to within a step's batch; with a fixed global batch exactly. Every evaluation
is off the training clock (trainer/clock.py, TrainingClock) and becomes an `Evaluation`
record: where the run was and how much training it had had.

Owns: `Evaluator` (its cadence, the pass, the run's last and best metric, the evaluation's
record). Must not: know how a task scores (tasks/ do) or write
records (the trainer hands them to the reporter).
"""

from __future__ import annotations

import time

import torch

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.sampler import EvalSampler
from pipetransformer.config import Config, TrainerConfig
from pipetransformer.data import DataBundle
from pipetransformer.data.loader import BatchLoader, workers_per_process
from pipetransformer.pipe.transfer import to_device
from pipetransformer.runs.records import EvalResult, Evaluation
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.caching import RunCache
from pipetransformer.trainer.clock import Tick, TrainingClock
from pipetransformer.trainer.distributed import WorldInfo
from pipetransformer.trainer.step import Stage, step_seq_length


def evaluation_due(tick: Tick, trainer: TrainerConfig) -> bool:
    """Whether an evaluation follows `tick`'s step: at the end of every
    `trainer.eval_interval_epochs`-th epoch and of the last, and at the
    `trainer.evals_per_epoch` points inside every epoch (module docstring). The peers of
    `compare` (compare/peers.py) evaluate at the same points."""
    if tick.epoch_end:
        return tick.completed_epochs % trainer.eval_interval_epochs == 0 or tick.last
    parts = trainer.evals_per_epoch
    return any(tick.reaches(part, parts) for part in range(1, parts))


class Evaluator:
    def __init__(
        self,
        config: Config,
        data: DataBundle,
        task,
        world: WorldInfo,
        control: Control,
        cache: RunCache | None,
        state: RunState,
    ) -> None:
        self.config = config
        self.data = data
        self.task = task
        self.world = world
        self.control = control
        self.cache = cache
        self.state = state  # holds the last and best metric
        self.last_scores: dict[str, float] | None = None  # the last evaluation's metrics
        self._loader = BatchLoader(
            data.eval,
            workers_per_process(config.data.num_workers, world.devices_per_node),
            pin_memory=world.device.type == "cuda",
        )

    def close(self) -> None:
        self._loader.close()

    def due(self, tick: Tick) -> bool:
        return evaluation_due(tick, self.config.trainer)

    def evaluate_at(
        self, tick: Tick, stage: Stage, clock: TrainingClock
    ) -> tuple[EvalResult, float, Evaluation]:
        """The evaluation due after `tick`'s step, off the training clock: its metrics, its
        seconds and its record (collective)."""
        training_s = clock.training_s()
        result, seconds = self.evaluate(stage)
        clock.exclude_evaluation(seconds)
        layout = stage.layout
        epochs_done = tick.epochs_done
        record = Evaluation(
            global_step=tick.global_step,
            epoch=tick.epoch + 1,
            epochs_done=epochs_done,
            samples=round(epochs_done * len(self.data.train)),
            training_time_s=training_s,
            eval_time_s=seconds,
            eval_metric=result.eval_metric,
            checkpoint_time_s=clock.total_checkpoint_s,
            eval_loss=result.eval_loss,
            scores=result.scores,
            num_frozen_layers=layout.plan.num_frozen_layers,
            pipe_len=layout.pipe_len,
            dp_degree=layout.dp_degree,
        )
        return result, seconds, record

    def evaluate(self, stage: Stage) -> tuple[EvalResult, float]:
        """The eval set's metrics and the seconds they took (collective)."""
        started = time.perf_counter()
        result = self._evaluate(stage)
        self.state.last_eval_metric = result.eval_metric
        self.last_scores = result.scores
        best = self.state.best_eval_metric
        self.state.best_eval_metric = (
            result.eval_metric if best is None else max(best, result.eval_metric)
        )
        return result, time.perf_counter() - started

    def _evaluate(self, stage: Stage) -> EvalResult:
        layout, device = stage.layout, self.world.device
        role = layout.role(self.world.rank)
        accumulator = self.task.new_accumulator(self.data.eval_extras)
        if role is not None:
            # The training batch of this layout (it grows with R under batch_per_replica).
            replica_batch = self.config.trainer.replica_batch_size(layout.dp_degree)
            dataset = self.data.eval
            grouped = self.config.data.group_by_length and dataset.lengths is not None
            sampler = EvalSampler(
                len(dataset), replica_batch * layout.dp_degree, dataset.lengths if grouped else None
            )
            batches = [
                sampler.replica_batch(role.replica, layout.dp_degree, s)
                for s in range(sampler.steps)
            ]
            seq_lengths = [step_seq_length(self.config, layout, dataset, b.ids) for b in batches]
            loader = None
            if role.is_first:
                loader = self._loader.start([b.ids for b in batches], lengths=seq_lengths)
                if stage.cache_active:
                    self.cache.client.prefetch("eval", [i for b in batches for i in b.ids])
            for batch, seq_length in zip(batches, seq_lengths):
                inputs = target = labels = lengths = None
                if role.is_first:
                    inputs = [to_device(t, device) for t in next(loader)]
                if role.is_last:
                    labels = dataset.targets(batch.ids)
                    if dataset.lengths is not None:
                        lengths = [dataset.lengths[i] for i in batch.ids]
                    target = self.task.make_target(labels, torch.zeros(len(batch.ids)), lengths)
                    target = to_device(target, device)
                outputs = stage.runtime.eval_step(inputs, target, batch.ids, seq_length)
                if role.is_last:
                    accumulator.add(outputs.detach(), batch.ids, batch.valid, labels, lengths)
        return accumulator.reduce(self.control)
