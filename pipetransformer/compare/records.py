"""Every run of a comparison as its results file keeps it: its training time (evaluation
and checkpoint writes off the clock) with the seconds of both beside it; per epoch its
training and evaluation seconds, the training time at its end, the metric and the frozen
layers; every evaluation (`trainer.evals_per_epoch` an epoch) with the training time before
it, which time-to-target reads; and per freeze decision its epoch and step, the per-layer
gradient norms it read, the signal's proposal, Eq. 1's bound, the cap and what set the
count (freeze.py, "Who decided"). So every claim a report or a doc makes recomputes from
the results file, for every seed, not only the seed a report shows in detail.

Runs whose summary is of a format before `EVALUATIONS_FORMAT` (runs/records.py, "Formats")
have no evaluations.jsonl: their evaluations are the epochs' ends, at the training time
their epochs' lines add up (which left out evaluation and checkpoints already), and their
summary's training_time_s includes both (`eval_time_s` None).

Owns: `RunRecord` (read back from a run directory's metrics.jsonl, events.jsonl and
summary.json) and the counts of who decided, summed by variant. Must not: compute
statistics (stats.py, curve.py) or write files.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetransformer.freeze import DECIDERS, SIGNAL
from pipetransformer.runs.records import (
    EpochMetrics,
    Evaluation,
    FreezeDecisionEvent,
    RunSummary,
    event_from_dict,
)
from pipetransformer.utils.files import read_jsonl


@dataclass(frozen=True)
class EpochRecord:
    epoch: int  # 1-based
    epoch_time_s: float  # training, evaluation and checkpoints apart
    eval_time_s: float  # every evaluation of the epoch
    # The run's training time at the epoch's end (its evaluation's record; in older runs
    # the epochs' training seconds so far).
    training_time_s: float
    eval_metric: float | None
    num_frozen_layers: int
    pipe_len: int
    dp_degree: int
    train_loss: float
    lr: float


@dataclass(frozen=True)
class EvaluationRecord:
    """One evaluation: after how much training (seconds, evaluation and checkpoints off
    the clock; epochs, fractional) and what it scored."""

    global_step: int
    epochs_done: float
    training_time_s: float
    eval_metric: float


@dataclass(frozen=True)
class DecisionRecord:
    decision_index: int
    global_step: int
    old_num_frozen_layers: int
    new_num_frozen_layers: int
    proposed: int | None
    bound: int | None
    decided_by: str
    epoch: int = 0  # 0-based epoch it was taken in
    cap: int | None = None
    layer_grad_norms: tuple[float, ...] | None = None  # per layer, what the rule read


@dataclass(frozen=True)
class RunRecord:
    variant: str
    seed: int | None
    training_time_s: float
    final_eval_metric: float | None
    best_eval_metric: float | None
    metric_name: str
    epochs: tuple[EpochRecord, ...]
    freeze_decisions: int = 0
    freeze_decided_by: dict[str, int] = field(default_factory=dict)
    decisions: tuple[DecisionRecord, ...] = ()
    evaluations: tuple[EvaluationRecord, ...] = ()
    # Off the training clock, every attempt; None for summaries of formats 1-3 (their
    # training_time_s counts both).
    eval_time_s: float | None = None
    checkpoint_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """A record as `to_dict` wrote it (a results file's `runs`); keys it does not know
        (a benchmark's own, such as the harness's record) are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["epochs"] = tuple(EpochRecord(**e) for e in data.get("epochs", ()))
        values["decisions"] = tuple(
            DecisionRecord(
                **{
                    **d,
                    "layer_grad_norms": None
                    if d.get("layer_grad_norms") is None
                    else tuple(d["layer_grad_norms"]),
                }
            )
            for d in data.get("decisions", ())
        )
        values["evaluations"] = tuple(EvaluationRecord(**e) for e in data.get("evaluations", ()))
        return cls(**values)


def run_record(run_dir: Path, variant: str, seed: int | None) -> RunRecord:
    """A finished run's record, from what it wrote."""
    summary = RunSummary.from_dict(json.loads((run_dir / "summary.json").read_text()))
    metrics = [EpochMetrics.from_dict(m) for m in read_jsonl(run_dir / "metrics.jsonl")]
    events_path = run_dir / "events.jsonl"
    events = [event_from_dict(e) for e in read_jsonl(events_path)] if events_path.is_file() else []
    evaluations = _evaluations(run_dir, metrics, summary)
    at_step = {e.global_step: e.training_time_s for e in evaluations}
    epochs, trained_s = [], 0.0
    for line in metrics:
        trained_s += line.epoch_time_s
        epochs.append(
            EpochRecord(
                epoch=line.epoch,
                epoch_time_s=line.epoch_time_s,
                eval_time_s=line.eval_time_s,
                training_time_s=at_step.get(line.global_step, trained_s),
                eval_metric=line.eval_metric,
                num_frozen_layers=line.num_frozen_layers,
                pipe_len=line.pipe_len,
                dp_degree=line.dp_degree,
                train_loss=line.train_loss,
                lr=line.lr,
            )
        )
    decisions = [
        DecisionRecord(
            e.decision_index,
            e.global_step,
            e.old_num_frozen_layers,
            e.new_num_frozen_layers,
            e.proposed,
            e.bound,
            e.decided_by,
            e.epoch,
            e.cap,
            tuple(e.layer_grad_norms) if e.layer_grad_norms is not None else None,
        )
        for e in events
        if isinstance(e, FreezeDecisionEvent)
    ]
    return RunRecord(
        variant=variant,
        seed=seed,
        training_time_s=summary.training_time_s,
        final_eval_metric=summary.final_eval_metric,
        best_eval_metric=summary.best_eval_metric,
        metric_name=summary.metric_name,
        epochs=tuple(epochs),
        freeze_decisions=summary.freeze_decisions,
        freeze_decided_by=dict(summary.freeze_decided_by),
        decisions=tuple(decisions),
        evaluations=tuple(evaluations),
        eval_time_s=summary.eval_time_s,
        checkpoint_time_s=summary.checkpoint_time_s,
    )


def _evaluations(
    run_dir: Path, metrics: list[EpochMetrics], summary: RunSummary
) -> list[EvaluationRecord]:
    """The run's evaluations from evaluations.jsonl; for a run of an older format (none),
    its epochs' ends at the training seconds its epochs add up to."""
    if not summary.evaluation_on_the_clock:
        written = [Evaluation.from_dict(e) for e in read_jsonl(run_dir / "evaluations.jsonl")]
        return [
            EvaluationRecord(e.global_step, e.epochs_done, e.training_time_s, e.eval_metric)
            for e in written
        ]
    found, trained_s = [], 0.0
    for line in metrics:
        trained_s += line.epoch_time_s
        if line.eval_metric is not None:
            found.append(
                EvaluationRecord(line.global_step, float(line.epoch), trained_s, line.eval_metric)
            )
    return found


@dataclass(frozen=True)
class DecidedBy:
    """Over every run of one variant: its decisions and how many each term set; `signal`
    is how often the rule's signal, not its bound or cap, chose the layer count."""

    variant: str
    runs: int
    decisions: int
    counts: dict[str, int]

    @property
    def signal(self) -> int:
        return self.counts.get(SIGNAL, 0)


def decided_by_variant(records: Iterable[RunRecord]) -> list[DecidedBy]:
    """Who decided, summed over each variant's runs (variants in order of first record);
    variants that took no decision are left out."""
    totals: dict[str, tuple[int, int, dict[str, int]]] = {}
    for record in records:
        runs, decisions, counts = totals.get(record.variant, (0, 0, {}))
        merged = dict(counts)
        for name, count in record.freeze_decided_by.items():
            merged[name] = merged.get(name, 0) + count
        totals[record.variant] = (runs + 1, decisions + record.freeze_decisions, merged)
    return [
        DecidedBy(variant, runs, decisions, {k: counts.get(k, 0) for k in DECIDERS})
        for variant, (runs, decisions, counts) in totals.items()
        if decisions
    ]


def decided_by_table(rows: list[DecidedBy], title) -> list[str]:
    """The markdown table of who decided (`title(variant)` names a row)."""
    if not rows:
        return []
    lines = [
        "| variant | runs | decisions | "
        + " | ".join(k.replace("_", " ") for k in DECIDERS)
        + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in DECIDERS) + " |",
    ]
    for row in rows:
        cells = " | ".join(str(row.counts[k]) for k in DECIDERS)
        lines.append(f"| {title(row.variant)} | {row.runs} | {row.decisions} | {cells} |")
    return lines
