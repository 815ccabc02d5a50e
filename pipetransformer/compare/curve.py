"""DDP's budget curve and what a variant is worth against it. Pure: numbers in, typed
results out (docs/compare.md, "Time-to-accuracy").

The budget curve is DDP's final metric against its training time over several budgets
(epochs), each run with its schedule fitted to its budget (compare/budgets.py). Made
monotone (sorted by time, each point's metric the best of it and every shorter run: what a
user gets within that time by picking the budget) and linear between measured points, it
answers two questions about a variant that trained for time t to metric a:

- **time-to-accuracy**: the time the curve needs to reach a, over t. Where a lies above
  every DDP point the curve never reaches it within the budgets measured, so the ratio is
  **at least** t_longest / t; where a is at or below the shortest budget's metric, DDP may
  have needed less than that budget, so it is **at most** t_shortest / t.
- **accuracy at equal time**: a - the curve's metric at t, in points. Beyond the longest
  budget the curve is at least its last metric (the difference at most a - that); before
  the shortest it is at most its first (the difference at least a - that).

Over seeds each seed's variant is set against the same seed's curve; ratios average as
geometric means with a t interval on the logarithms (as compare/stats.py's speedups), the
differences as means with a t interval, only where every seed's value is a value. A bound is
never averaged with values: where some seeds are bounds and some values there is no mean
and no interval, only the seeds' own figures; where every seed is bounded the same way the
mean is a bound the same way ("at least": the seeds' true values can only raise it), with no
interval; bounds both ways leave no estimate ("mixed").

Must not: read files or know variant names (compare/budgets.py does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipetransformer.compare.stats import (
    POINTS_PER_UNIT,
    confidence_interval,
    geometric_mean_ratio,
    mean_std,
)

EXACT, AT_LEAST, AT_MOST, MIXED = "exact", "at least", "at most", "mixed"
_FLIP = {EXACT: EXACT, AT_LEAST: AT_MOST, AT_MOST: AT_LEAST}


@dataclass(frozen=True)
class CurvePoint:
    time_s: float
    metric: float  # a fraction (accuracy, F1), as the runs record it


@dataclass(frozen=True)
class Bounded:
    """A value that is exact, or only a bound on the true one ('at least', 'at most')."""

    value: float
    kind: str = EXACT


def monotone_curve(points: Sequence[CurvePoint]) -> list[CurvePoint]:
    """Sorted by time, each metric the best of its point and every earlier one (points at
    the same time merged into their best)."""
    if not points:
        raise ValueError("monotone_curve: no DDP budget point")
    curve: list[CurvePoint] = []
    for point in sorted(points, key=lambda p: (p.time_s, p.metric)):
        if point.time_s <= 0:
            raise ValueError(f"monotone_curve: a training time must be > 0, got {point.time_s}")
        best = max(point.metric, curve[-1].metric) if curve else point.metric
        if curve and curve[-1].time_s == point.time_s:
            curve[-1] = CurvePoint(point.time_s, best)
        else:
            curve.append(CurvePoint(point.time_s, best))
    return curve


def time_to_reach(curve: Sequence[CurvePoint], metric: float) -> Bounded:
    """The time the monotone curve first reaches `metric`, linear between points."""
    if metric <= curve[0].metric:  # DDP's shortest budget reaches it; a shorter one may
        return Bounded(curve[0].time_s, AT_MOST)
    if metric > curve[-1].metric:
        return Bounded(curve[-1].time_s, AT_LEAST)
    for before, after in zip(curve, curve[1:]):
        if after.metric >= metric:
            share = (metric - before.metric) / (after.metric - before.metric)
            return Bounded(before.time_s + share * (after.time_s - before.time_s))
    raise AssertionError("unreachable: the last point reaches the metric")


def metric_at(curve: Sequence[CurvePoint], time_s: float) -> Bounded:
    """The monotone curve's metric at `time_s`, linear between points."""
    if time_s < curve[0].time_s:
        return Bounded(curve[0].metric, AT_MOST)
    if time_s > curve[-1].time_s:
        return Bounded(curve[-1].metric, AT_LEAST)
    for before, after in zip(curve, curve[1:]):
        if after.time_s >= time_s:
            share = (time_s - before.time_s) / (after.time_s - before.time_s)
            return Bounded(before.metric + share * (after.metric - before.metric))
    return Bounded(curve[-1].metric)  # time_s is the last point's


def time_to_accuracy(curve: Sequence[CurvePoint], time_s: float, metric: float) -> Bounded:
    """The curve's time to the variant's metric over the variant's time (> 1: sooner)."""
    if time_s <= 0:
        raise ValueError(f"time_to_accuracy: the variant's time must be > 0, got {time_s}")
    needed = time_to_reach(curve, metric)
    return Bounded(needed.value / time_s, needed.kind)


def equal_time_difference(curve: Sequence[CurvePoint], time_s: float, metric: float) -> Bounded:
    """The variant's metric less the curve's at the variant's time, in points."""
    reference = metric_at(curve, time_s)
    return Bounded(POINTS_PER_UNIT * (metric - reference.value), _FLIP[reference.kind])


@dataclass(frozen=True)
class BoundedStats:
    """A quantity over seeds whose per-seed values may be bounds: the mean (geometric for
    ratios) with its 95% interval (None for one seed), min, max, and how many seeds were
    bounded each way; `kind` says what the mean is (module docstring)."""

    mean: float | None
    low: float | None
    high: float | None
    min: float
    max: float
    n: int
    at_least: int
    at_most: int
    kind: str


def _kind(values: Sequence[Bounded]) -> tuple[int, int, str]:
    """Seeds bounded each way, and what a mean over them would be: a value (every seed
    exact), a bound (every seed bounded the same way), or none (MIXED: bounds with values,
    or bounds both ways)."""
    at_least = sum(v.kind == AT_LEAST for v in values)
    at_most = sum(v.kind == AT_MOST for v in values)
    if at_least == len(values):
        return at_least, at_most, AT_LEAST
    if at_most == len(values):
        return at_least, at_most, AT_MOST
    return at_least, at_most, MIXED if at_least or at_most else EXACT


def ratio_stats(values: Sequence[Bounded]) -> BoundedStats:
    """Per-seed ratios (time-to-accuracy) as a geometric mean with its interval."""
    if not values:
        raise ValueError("ratio_stats: no values")
    at_least, at_most, kind = _kind(values)
    ratio = geometric_mean_ratio([v.value for v in values])
    exact = kind == EXACT
    return BoundedStats(
        None if kind == MIXED else ratio.mean,
        ratio.low if exact else None,
        ratio.high if exact else None,
        ratio.min,
        ratio.max,
        ratio.n,
        at_least,
        at_most,
        kind,
    )


def difference_stats(values: Sequence[Bounded]) -> BoundedStats:
    """Per-seed differences in points (accuracy at equal time) as a mean with its t
    interval."""
    if not values:
        raise ValueError("difference_stats: no values")
    at_least, at_most, kind = _kind(values)
    numbers = [v.value for v in values]
    interval = confidence_interval(numbers) if kind == EXACT else None
    return BoundedStats(
        None if kind == MIXED else mean_std(numbers).mean,
        None if interval is None else interval.low,
        None if interval is None else interval.high,
        min(numbers),
        max(numbers),
        len(numbers),
        at_least,
        at_most,
        kind,
    )


def fmt_ratio(stats: BoundedStats) -> str:
    """'1.32x [1.10, 1.58] (1.05-1.71x)', 'at least 1.32x [...]' or 'censored both ways'."""
    return _fmt(stats, lambda v: f"{v:.2f}x", lambda v: f"{v:.2f}")


def fmt_points(stats: BoundedStats) -> str:
    """'+0.12 [-0.30, +0.54] (-0.5 to +0.8)' with the same prefixes as `fmt_ratio`."""
    return _fmt(stats, lambda v: f"{v:+.2f}", lambda v: f"{v:+.2f}")


def _fmt(stats: BoundedStats, shown, bare) -> str:
    bounded = stats.at_least + stats.at_most
    if stats.kind == MIXED or stats.mean is None:
        exact = stats.n - stats.at_least - stats.at_most
        return (
            f"no estimate: {stats.at_least} seed(s) at least, {stats.at_most} at most, "
            f"{exact} exact ({bare(stats.min)} to {bare(stats.max)})"
        )
    text = shown(stats.mean)
    if stats.low is not None and stats.high is not None and math.isfinite(stats.low):
        text += f" [{bare(stats.low)}, {bare(stats.high)}]"
    text += f" ({bare(stats.min)} to {bare(stats.max)})"
    if stats.kind != EXACT:
        text = f"{stats.kind} {text}, {bounded} of {stats.n} seed(s) bounded"
    return text
