"""What a peer of `compare --peers` (compare/peers.py) records, as the trainer records its
own: each epoch's training seconds with evaluation off the clock (`EpochClock`), the
trainer's evaluation points (`PeerEvaluations`, trainer/evaluation.py `evaluation_due`:
every epoch's end and `trainer.evals_per_epoch` shares of each epoch's samples) scored on
rank 0, and the run records `compare` reads (summary.json, metrics.jsonl,
evaluations.jsonl, events.jsonl: `write_records`; with a freezing callback in the peer,
its decisions as the trainer's freeze events).

Owns: the peers' clock, evaluation points and records. Must not: train (peers.py does) or
know how a peer scores (it is handed `score`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipetransformer.config import Config
from pipetransformer.data import DataBundle
from pipetransformer.runs.records import (
    EpochMetrics,
    Evaluation,
    FreezeDecisionEvent,
    RunSummary,
)
from pipetransformer.trainer.clock import Tick
from pipetransformer.trainer.evaluation import evaluation_due
from pipetransformer.utils.files import append_jsonl, write_json_atomic


class EpochClock:
    """Each epoch's training seconds and steps, evaluation off the clock (as the trainer's
    TrainingClock keeps it): an evaluation inside an epoch is `exclude`d from it."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self._started = time.perf_counter()
        self._excluded_s = 0.0
        self._running = False

    def start(self) -> None:
        self._started = time.perf_counter()
        self._excluded_s = 0.0
        self._running = True

    def exclude(self, seconds: float) -> None:
        """Seconds inside the epoch that were not training (an evaluation)."""
        self._excluded_s += seconds

    def training_s(self) -> float:
        """Training seconds so far: the finished epochs' and the running one's."""
        done = sum(r["epoch_time_s"] for r in self.records)
        if not self._running:
            return done
        return done + max(0.0, time.perf_counter() - self._started - self._excluded_s)

    def end(
        self,
        global_step: int,
        samples: int,
        train_loss: float,
        lr: float,
        tokens: tuple[int, int] = (0, 0),
    ) -> None:
        """`tokens`: the epoch's real and padded tokens (text; 0 for images)."""
        seconds = max(0.0, time.perf_counter() - self._started - self._excluded_s)
        self._running = False
        self.records.append(
            {
                "epoch": len(self.records) + 1,
                "global_step": global_step,
                "train_loss": train_loss,
                "samples_per_s": samples / seconds if seconds > 0 else 0.0,
                "epoch_time_s": seconds,
                "lr": lr,
                "real_tokens": tokens[0],
                "padded_tokens": tokens[1],
            }
        )


class PeerEvaluations:
    """The trainer's evaluation points in a peer's loop (trainer/evaluation.py
    `evaluation_due`), each scored on rank 0 (the others wait for it in their next
    collective) and kept off the epoch's clock; the records are rank 0's."""

    def __init__(self, config: Config, data: DataBundle, clock: EpochClock, rank: int) -> None:
        self.config, self.data, self.clock, self.rank = config, data, clock, rank
        self.records: list[Evaluation] = []
        self.score: Callable[[], float] | None = None  # set once the model exists

    def after_step(self, tick: Tick) -> None:
        """After a step inside an epoch (its last step: `at_epoch_end`)."""
        if not tick.epoch_end and evaluation_due(tick, self.config.trainer):
            self.clock.exclude(self._evaluate(tick))

    def at_epoch_end(self, tick: Tick) -> None:
        """After the epoch's clock stopped."""
        if evaluation_due(tick, self.config.trainer):
            self._evaluate(tick)

    def _evaluate(self, tick: Tick) -> float:
        if self.rank != 0 or self.score is None:
            return 0.0
        training_s = self.clock.training_s()
        started = time.perf_counter()
        metric = self.score()
        seconds = time.perf_counter() - started
        self.records.append(
            Evaluation(
                global_step=tick.global_step,
                epoch=tick.epoch + 1,
                epochs_done=tick.epochs_done,
                samples=round(tick.epochs_done * len(self.data.train)),
                training_time_s=training_s,
                eval_time_s=seconds,
                eval_metric=metric,
                dp_degree=int(os.environ.get("WORLD_SIZE", "1")),
            )
        )
        return seconds


def peer_tick(epoch: int, step: int, steps: int, global_step: int, config: Config, batch: int,
              epoch_samples: int) -> Tick:  # fmt: skip
    """The trainer's tick of a peer's step: step `step` (0-based) of `steps` in `epoch`, a
    rank's `batch` samples of its `epoch_samples` (the last batch smaller)."""
    before = min(step * batch, epoch_samples)
    return Tick(
        epoch,
        step,
        global_step,
        steps,
        config.trainer.epochs,
        samples=min(batch, epoch_samples - before),
        samples_before=before,
        epoch_samples=epoch_samples,
    )


def write_records(
    run_dir: Path,
    epochs: list[dict],
    evaluations: list[Evaluation],
    world_size: int,
    peak_rss_bytes: int,
    decisions: list[FreezeDecisionEvent] = (),
) -> None:
    """summary.json, metrics.jsonl, evaluations.jsonl and events.jsonl as the trainer writes
    them: an epoch's line carries its end's evaluation and the seconds of all of its
    evaluations; training_time_s is the epochs' training, evaluation off it. `decisions`:
    a freezing callback's (integrations/), as freeze events, each epoch's line with the
    layers frozen at its end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for record in epochs:
        own = [e for e in evaluations if e.epoch == record["epoch"]]
        at_end = [e for e in own if e.epochs_done >= record["epoch"]]
        before = [d for d in decisions if d.global_step <= record["global_step"]]
        line = EpochMetrics(
            **record,
            eval_metric=at_end[-1].eval_metric if at_end else None,
            num_frozen_layers=before[-1].new_num_frozen_layers if before else 0,
            pipe_len=1,
            dp_degree=world_size,
            num_micro_batches=1,
            eval_time_s=sum(e.eval_time_s for e in own),
        )
        append_jsonl(run_dir / "metrics.jsonl", line.to_dict())
    for evaluation in evaluations:
        append_jsonl(run_dir / "evaluations.jsonl", evaluation.to_dict())
    (run_dir / "events.jsonl").touch()
    for decision in decisions:
        append_jsonl(run_dir / "events.jsonl", decision.to_dict())
    decided_by: dict[str, int] = {}
    for decision in decisions:
        decided_by[decision.decided_by] = decided_by.get(decision.decided_by, 0) + 1
    metrics = [e.eval_metric for e in evaluations]
    summary = RunSummary(
        training_time_s=sum(r["epoch_time_s"] for r in epochs),
        eval_time_s=sum(e.eval_time_s for e in evaluations),
        checkpoint_time_s=0.0,
        attempts=1,
        final_eval_metric=metrics[-1] if metrics else None,
        best_eval_metric=max(metrics) if metrics else None,
        epochs=len(epochs),
        global_steps=epochs[-1]["global_step"] if epochs else 0,
        num_transitions=sum(d.new_num_frozen_layers > d.old_num_frozen_layers for d in decisions),
        final_num_frozen_layers=decisions[-1].new_num_frozen_layers if decisions else 0,
        final_pipe_len=1,
        final_dp_degree=world_size,
        world_size=world_size,
        device="cuda" if torch.cuda.is_available() else "cpu",
        checkpoint=None,
        metric_name="accuracy",
        peak_rss_bytes=peak_rss_bytes,
        freeze_decisions=len(decisions),
        freeze_decided_by=decided_by,
    )
    write_json_atomic(run_dir / "summary.json", summary.to_dict())
