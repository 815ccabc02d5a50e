"""Time-to-target and frontier against frontier. Pure: numbers in, typed results out
(docs/compare.md, "Time-to-target"; the words are docs/vocabulary.md's).

A **side** is what a user could run (DDP, Pipe+DDP, FSDP2, the full system) at one or more
budgets, each run with its schedule (and a freezing run's decision cadence) fitted to its
budget; every run evaluates at the same shares of its epochs, off its training clock. Per
seed a side is the evaluations of all its budget runs: points (training time, metric).

- **Target**: the reference side's median final metric over the seeds at the config's full
  budget, less the non-inferiority margin (or a target given outright).
- **A run's time-to-target**: its training time at its first evaluation at or above the
  target; **a side's** at a seed: the earliest over its budget runs; None where no run
  reached it ("not reached": never a bound put into an average).
- **Over seeds** per side: the median and the interquartile range with not-reached counted
  as later than any time (as a median survival time: the median is a time only where more
  than half of the seeds reached the target), and how many reached. The **ratio** of a peer
  over the system, paired by seed, over the seeds where both reached: the geometric mean
  with a 95% t interval on the logarithms (compare/stats.py), and how many seeds the
  system alone, the peer alone or neither reached.
- **Peak**: a side's best metric at a seed over every evaluation of all its budget runs
  (the frontier's last value); the system's peak less each peer's, paired by seed, in
  points with a 95% t interval: the non-inferiority figure (its lower end against a margin).
- **Frontier against frontier**: a side's frontier at a seed is the step function "the best
  metric any of its evaluations reached by time t" (not straight lines between budgets,
  which on a concave curve would understate the side read between its points). Each side's
  budget ends (a run's last evaluation) are read on the other's frontier: the difference in
  points, over the seeds with a t interval; "none by then" where the other had not
  evaluated yet (left out and counted), and how many lay beyond the other's longest run
  (read there as its best: what its measured budgets reached).

Must not: read files, know variant names or format reports (compare/frontiers.py does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipetransformer.compare.stats import (
    POINTS_PER_UNIT,
    Interval,
    MeanStd,
    RatioStats,
    confidence_interval,
    geometric_mean_ratio,
    mean_std,
)

# A metric equal to its target can come out a hair below it after the subtraction
# (0.9 - 0.005 = 0.8949999999999999); counts that far below still reach it.
TARGET_SLACK = 1e-9


@dataclass(frozen=True)
class Point:
    """One evaluation: training seconds before it (evaluation off the clock) and its metric
    (a fraction, as runs record it)."""

    time_s: float
    metric: float


def run_time_to_target(points: Sequence[Point], target: float) -> float | None:
    """The training time of the run's first evaluation at or above `target` (None: never)."""
    for point in sorted(points, key=lambda p: p.time_s):
        if point.metric >= target - TARGET_SLACK:
            return point.time_s
    return None


def side_time_to_target(runs: Sequence[Sequence[Point]], target: float) -> float | None:
    """A side's time-to-target at one seed: the earliest over its budget runs."""
    reached = [t for run in runs if (t := run_time_to_target(run, target)) is not None]
    return min(reached) if reached else None


def quantile(values: Sequence[float], share: float) -> float:
    """The `share` quantile, linear between order statistics (numpy's default); a value
    that leans on an infinite neighbour at all is that infinity."""
    if not values:
        raise ValueError("quantile: no values")
    ordered = sorted(values)
    place = share * (len(ordered) - 1)
    low, high = math.floor(place), math.ceil(place)
    weight = place - low
    if low == high or weight == 0:
        return ordered[low]
    if math.isinf(ordered[high]) and ordered[high] > 0:
        return math.inf
    if math.isinf(ordered[low]) and ordered[low] < 0:
        return -math.inf
    return ordered[low] + weight * (ordered[high] - ordered[low])


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def reference_target(finals: Sequence[float], margin_points: float) -> float:
    """The reference side's median final metric at the full budget less the margin."""
    if margin_points < 0:
        raise ValueError(f"--margin: {margin_points} is negative (it is in metric points)")
    return median(finals) - margin_points / POINTS_PER_UNIT


@dataclass(frozen=True)
class SideTarget:
    """A side's time-to-target over the seeds. `times`: per seed (None: not reached), in the
    order of `seeds`. The median and quartiles count not reached as later than any time:
    None where they fall on it."""

    side: str
    seeds: tuple[int | None, ...]
    times: tuple[float | None, ...]
    reached: int
    median_s: float | None
    q1_s: float | None
    q3_s: float | None


def side_target(side: str, times: Mapping[int | None, float | None]) -> SideTarget:
    if not times:
        raise ValueError(f"side_target: {side} has no seed")
    seeds = tuple(times)
    values = [math.inf if times[s] is None else times[s] for s in seeds]

    def finite(value: float) -> float | None:
        return None if math.isinf(value) else value

    return SideTarget(
        side,
        seeds,
        tuple(times[s] for s in seeds),
        sum(t is not None for t in times.values()),
        finite(quantile(values, 0.5)),
        finite(quantile(values, 0.25)),
        finite(quantile(values, 0.75)),
    )


@dataclass(frozen=True)
class TargetRatio:
    """A peer's time-to-target over the system's, paired by seed (> 1: the system reached
    the target sooner), over the seeds where both reached it (`ratio` None where none
    did); the seeds where only the system, only the peer or neither reached it are counted,
    never averaged in."""

    peer: str
    system: str
    seeds: tuple[int | None, ...]  # where both reached
    ratios: tuple[float, ...]
    ratio: RatioStats | None
    system_only: int
    peer_only: int
    neither: int


def target_ratio(peer: SideTarget, system: SideTarget) -> TargetRatio:
    peer_times = dict(zip(peer.seeds, peer.times))
    system_times = dict(zip(system.seeds, system.times))
    common = [s for s in peer.seeds if s in system_times]
    both = [s for s in common if peer_times[s] is not None and system_times[s] is not None]
    ratios = [peer_times[s] / system_times[s] for s in both]
    if any(system_times[s] <= 0 for s in both):
        raise ValueError("target_ratio: a time-to-target must be > 0")

    def count(system_reached: bool, peer_reached: bool) -> int:
        return sum(
            (system_times[s] is not None) == system_reached
            and (peer_times[s] is not None) == peer_reached
            for s in common
        )

    return TargetRatio(
        peer.side,
        system.side,
        tuple(both),
        tuple(ratios),
        geometric_mean_ratio(ratios) if ratios else None,
        count(True, False),
        count(False, True),
        count(False, False),
    )


@dataclass(frozen=True)
class PeakDifference:
    """The system's peak (its best metric over its whole curve) less a peer's, paired by
    seed, in points: per seed, the mean with a 95% t interval (None under two seeds), and
    each side's mean peak over those seeds (as a metric, not points)."""

    peer: str
    system: str
    seeds: tuple[int | None, ...]
    differences: tuple[float, ...]  # points, in the order of `seeds`
    points: MeanStd | None
    interval: Interval | None
    system_peak: float | None
    peer_peak: float | None


def peak_difference(
    peer: str,
    system: str,
    peer_peaks: Mapping[int | None, float],
    system_peaks: Mapping[int | None, float],
) -> PeakDifference:
    """The system's peaks less the peer's at the seeds both have (module docstring)."""
    seeds = tuple(s for s in system_peaks if s in peer_peaks)
    differences = tuple(POINTS_PER_UNIT * (system_peaks[s] - peer_peaks[s]) for s in seeds)
    return PeakDifference(
        peer,
        system,
        seeds,
        differences,
        mean_std(differences) if differences else None,
        confidence_interval(differences),
        math.fsum(system_peaks[s] for s in seeds) / len(seeds) if seeds else None,
        math.fsum(peer_peaks[s] for s in seeds) / len(seeds) if seeds else None,
    )


def best_by(points: Sequence[Point], time_s: float) -> float | None:
    """The frontier: the best metric of the evaluations made by `time_s` (None: none yet)."""
    found = [p.metric for p in points if p.time_s <= time_s + 1e-9]
    return max(found) if found else None


@dataclass(frozen=True)
class BudgetEnd:
    """Where one budget run of a side ended: its last evaluation."""

    budget: int  # epochs
    time_s: float
    metric: float


@dataclass(frozen=True)
class FrontierGap:
    """Side `reader`'s runs of one budget read on side `other`'s frontier, over the seeds:
    the reader's final metric less the other's best by the same training time, in points
    (> 0: the reader is ahead at its own time). `differences` per seed of `seeds` (None:
    the other had not evaluated by then); `beyond`: seeds where the reader's time lay past
    the other's last evaluation (read as the other's best)."""

    reader: str
    other: str
    budget: int
    seeds: tuple[int | None, ...]
    reader_time_s: MeanStd
    differences: tuple[float | None, ...]
    points: MeanStd | None
    interval: Interval | None
    none_by_then: int
    beyond: int


def frontier_gap(
    reader: str,
    other: str,
    budget: int,
    ends: Mapping[int | None, BudgetEnd],
    frontiers: Mapping[int | None, Sequence[Point]],
) -> FrontierGap:
    """`ends`: per seed, the reader's run of `budget`; `frontiers`: per seed, every
    evaluation of the other side (seeds the other lacks are left out)."""
    seeds = tuple(s for s in ends if s in frontiers)
    if not seeds:
        raise ValueError(f"frontier_gap: {reader} and {other} share no seed")
    differences, beyond = [], 0
    for seed in seeds:
        end, points = ends[seed], frontiers[seed]
        best = best_by(points, end.time_s)
        differences.append(None if best is None else POINTS_PER_UNIT * (end.metric - best))
        beyond += bool(points) and end.time_s > max(p.time_s for p in points)
    known = [d for d in differences if d is not None]
    return FrontierGap(
        reader,
        other,
        budget,
        seeds,
        mean_std([ends[s].time_s for s in seeds]),
        tuple(differences),
        mean_std(known) if known else None,
        confidence_interval(known),
        len(differences) - len(known),
        beyond,
    )


def median_frontier(
    frontiers: Mapping[int | None, Sequence[Point]], times: Sequence[float]
) -> list[float | None]:
    """At each of `times`, the median over the seeds of their frontiers (a seed without an
    evaluation by then counts below any metric; None where that is the median): what the
    plot draws as a side's curve."""
    found = []
    for time_s in times:
        values = [best_by(points, time_s) for points in frontiers.values()]
        numbers = [-math.inf if v is None else v for v in values]
        middle = median(numbers) if numbers else -math.inf
        found.append(None if math.isinf(middle) else middle)
    return found
