"""The ideal speedup a run's own freeze trajectory allows. Pure arithmetic.

A perfect system spends, per training sample, the forward + backward time of the active
units and, for the frozen prefix, only the forward of the frozen units its cache entry does
not cover yet, spread evenly over the W devices, stretched only by the pipeline bubble of
GPipe, (M + K - 1) / M. A sample met one epoch earlier was stored at the boundary then in
effect, so at step s with F(s) frozen layers it runs the frozen units from
F(s - steps_per_epoch) to F(s) (upgrading its entry), and all of them in the first epoch:

    step_time(F, K, M) = (B / W) * C(F) * (M + K - 1) / M

The baseline is the same with F = 0 and its fixed K and M for every step. Evaluation runs
every unit forward; with the cache, an evaluation at F reads the prefix the previous
evaluation stored and runs only the units after it. The ideal elastic wall time scales the
baseline's training and evaluation times by those relative costs:

    ideal_wall = base_train_s * sum(ideal elastic steps) / sum(ideal baseline steps)
               + base_eval_s * sum(ideal elastic evals) / sum(ideal baseline evals)
    ideal_speedup = base_wall / ideal_wall;  efficiency = measured speedup / ideal speedup
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipetransformer.utils.units import prefix_end


@dataclass(frozen=True)
class StepLayout:
    """What was in effect for a range of optimizer steps [start, end)."""

    start: int
    end: int
    num_frozen_layers: int
    pipe_len: int
    num_micro_batches: int


def bubble(pipe_len: int, num_micro_batches: int) -> float:
    return (num_micro_batches + pipe_len - 1) / num_micro_batches


def sample_cost(
    trained: Sequence[float],
    frozen: Sequence[float],
    num_frozen_layers: int,
    cached_frozen_layers: int = 0,
) -> float:
    """Per-sample compute: active units forward+backward, plus the forward of the frozen
    units beyond the `cached_frozen_layers` whose output the cache already holds."""
    boundary = prefix_end(num_frozen_layers)
    active = sum(trained[boundary:])
    return active + sum(frozen[prefix_end(min(cached_frozen_layers, num_frozen_layers)) : boundary])


def ideal_step_costs(
    segments: Sequence[StepLayout],
    trained: Sequence[float],
    frozen: Sequence[float],
    steps_per_epoch: int,
    cache: bool,
) -> list[float]:
    """Relative cost of every step (the constant B / W factor left out)."""
    frozen_at: dict[int, int] = {}  # step -> F in effect
    costs: list[float] = []
    for seg in segments:
        for step in range(seg.start, seg.end):
            frozen_at[step] = seg.num_frozen_layers
            cached = frozen_at.get(step - steps_per_epoch, 0) if cache else 0
            costs.append(
                sample_cost(trained, frozen, seg.num_frozen_layers, cached)
                * bubble(seg.pipe_len, seg.num_micro_batches)
            )
    return costs


def ideal_eval_costs(
    eval_frozen: Sequence[int], frozen: Sequence[float], cache: bool
) -> list[float]:
    """Relative cost of each epoch's evaluation, given F at each evaluation: every unit's
    forward, less the frozen prefix the previous evaluation left in the cache."""
    costs, previous = [], 0
    for num_frozen in eval_frozen:
        cached = min(previous, num_frozen) if cache else 0
        costs.append(sum(frozen[prefix_end(cached) :]))
        previous = num_frozen
    return costs


@dataclass(frozen=True)
class IdealSpeedup:
    ideal_speedup: float
    measured_speedup: float
    efficiency: float
    ideal_elastic_wall_s: float


def ideal_speedup(
    *,
    baseline_segments: Sequence[StepLayout],
    elastic_segments: Sequence[StepLayout],
    trained: Sequence[float],
    frozen: Sequence[float],
    steps_per_epoch: int,
    cache: bool,
    baseline_wall_s: float,
    baseline_eval_s: float,
    elastic_wall_s: float,
    eval_frozen: Sequence[int] = (),
) -> IdealSpeedup:
    """`eval_frozen`: F at each of the elastic run's evaluations (none given: evaluation is
    counted at the baseline's time)."""
    base = sum(ideal_step_costs(baseline_segments, trained, frozen, steps_per_epoch, cache=False))
    elastic = sum(ideal_step_costs(elastic_segments, trained, frozen, steps_per_epoch, cache))
    base_train_s = max(0.0, baseline_wall_s - baseline_eval_s)
    eval_scale = 1.0
    if eval_frozen:
        full = sum(ideal_eval_costs([0] * len(eval_frozen), frozen, cache=False))
        eval_scale = sum(ideal_eval_costs(eval_frozen, frozen, cache)) / full
    ideal_wall = base_train_s * elastic / base + baseline_eval_s * eval_scale
    ideal = baseline_wall_s / ideal_wall
    measured = baseline_wall_s / elastic_wall_s
    return IdealSpeedup(ideal, measured, measured / ideal, ideal_wall)


def segments_from_run(
    metrics: Sequence[dict], events: Sequence[dict], steps_per_epoch: int, initial: StepLayout
) -> list[StepLayout]:
    """Step ranges of a run's layouts from its events (transitions at global steps)."""
    total = max((m["global_step"] for m in metrics), default=0)
    segments = []
    start, current = 0, initial
    for event in events:
        at = event["global_step"]
        if at > start:
            segments.append(
                StepLayout(
                    start,
                    at,
                    current.num_frozen_layers,
                    current.pipe_len,
                    current.num_micro_batches,
                )
            )
        start = at
        current = StepLayout(
            at,
            at,
            event["new_num_frozen_layers"],
            event["new_pipe_len"],
            event["num_micro_batches"],
        )
    if total > start:
        segments.append(
            StepLayout(
                start, total, current.num_frozen_layers, current.pipe_len, current.num_micro_batches
            )
        )
    return segments
