"""Statistics of a comparison repeated over seeds. Pure: numbers in, typed results out.

Owns: mean and spread per variant, each variant paired with the baseline by seed (speedup,
metric difference with its t-interval, a non-inferiority verdict against a margin). Must
not read or write files: report.py reads the run directories. Time-to-target is
compare/target.py's.

Units: eval metrics are fractions (accuracy, F1), as the runs record them; the report shows
their differences in points (100 x the fraction), so the margin and the differences here are
in points too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

POINTS_PER_UNIT = 100.0  # a metric of 0.9712 is 97.12 points
# Non-inferiority, and the target's distance below the reference (compare/target.py).
DEFAULT_MARGIN_POINTS = 0.5
NOT_WORSE, WORSE, INCONCLUSIVE = "not worse", "worse", "inconclusive"
LOWER, HIGHER, NOT_DISTINGUISHED = "lower", "higher", "no"
ONE_SEED = "one seed: no interval"


@dataclass(frozen=True)
class SeedRun:
    """What the statistics need of one finished run of one variant at one seed."""

    variant: str
    seed: int
    training_time_s: float
    final_eval_metric: float
    best_eval_metric: float


@dataclass(frozen=True)
class MeanStd:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for one value)."""

    mean: float
    std: float
    n: int


@dataclass(frozen=True)
class VariantStats:
    variant: str
    seeds: tuple[int, ...]
    training_time_s: MeanStd
    final_eval_metric: MeanStd
    best_eval_metric: MeanStd


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


@dataclass(frozen=True)
class PairStats:
    """A variant against a reference (the baseline, or the peer) over the seeds both ran.
    Speedup: reference wall time / variant wall time at the same seed, averaged as a ratio
    (the geometric mean, with its 95% interval: t on the logarithms); beside it the ratio of
    the mean wall times. Difference: variant - reference final metric, points."""

    variant: str
    seeds: tuple[int, ...]
    speedup_mean: float  # geometric mean of the per-seed speedups
    speedup_min: float
    speedup_max: float
    metric_difference_points: MeanStd
    interval_points: Interval | None  # 95%, t-distribution with n - 1 degrees of freedom
    verdict: str
    # Whether the interval excludes 0: the variant's metric is distinguishable from the
    # reference's ('lower' / 'higher'), whatever the margin says.
    distinguishable: str = ONE_SEED
    speedup_interval: Interval | None = None  # 95%; None for one seed
    speedup_of_mean_times: float | None = None  # mean reference time / mean variant time


@dataclass(frozen=True)
class SeededStats:
    baseline: str
    margin_points: float
    seeds: tuple[int, ...]
    variants: tuple[VariantStats, ...]
    pairs: tuple[PairStats, ...]
    # The same pairing against a peer (DDP under --peers), for the variants that are neither
    # the baseline nor the peer: is the full system distinguishable from what a user runs?
    peer: str | None = None
    peer_pairs: tuple[PairStats, ...] = ()
    # One variant (the full system) against every other: speedup = the other's wall time /
    # its own, difference = its metric - the other's; `variant` names the other.
    subject: str | None = None
    subject_pairs: tuple[PairStats, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def mean_std(values: Sequence[float]) -> MeanStd:
    if not values:
        raise ValueError("mean_std: no values")
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return MeanStd(mean, std, n)


def t_quantile_975(degrees_of_freedom: int) -> float:
    """The two-sided 95% quantile of Student's t (its 97.5th percentile)."""
    # Imported here so the module stays light to import.
    from scipy.stats import t

    return float(t.ppf(0.975, degrees_of_freedom))


def confidence_interval(differences: Sequence[float]) -> Interval | None:
    """95% interval of the mean of paired differences; None for fewer than two."""
    if len(differences) < 2:
        return None
    summary = mean_std(differences)
    half = t_quantile_975(summary.n - 1) * summary.std / math.sqrt(summary.n)
    return Interval(summary.mean - half, summary.mean + half)


@dataclass(frozen=True)
class RatioStats:
    """Ratios over seeds (speedups): their geometric mean with a 95% interval (t on the
    logarithms; None for one seed), and the smallest and largest."""

    mean: float
    low: float | None
    high: float | None
    min: float
    max: float
    n: int


def geometric_mean_ratio(ratios: Sequence[float]) -> RatioStats:
    """A ratio's mean over seeds as a ratio: the mean of logs, back-transformed (a 2x and a
    0.5x average to 1x, not 1.25x)."""
    if not ratios or min(ratios) <= 0:
        raise ValueError(f"geometric_mean_ratio: needs positive ratios, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    interval = confidence_interval(logs)
    return RatioStats(
        math.exp(mean_std(logs).mean),
        math.exp(interval.low) if interval else None,
        math.exp(interval.high) if interval else None,
        min(ratios),
        max(ratios),
        len(ratios),
    )


def verdict(interval: Interval | None, margin_points: float) -> str:
    """Non-inferiority: 'not worse' only when the whole interval lies above -margin; 'worse'
    when it lies wholly below; otherwise (touching or spanning -margin) 'inconclusive'."""
    if interval is None:
        return ONE_SEED
    if interval.low > -margin_points:
        return NOT_WORSE
    if interval.high < -margin_points:
        return WORSE
    return INCONCLUSIVE


def distinguishable(interval: Interval | None) -> str:
    """'lower' / 'higher' when the 95% interval of the difference lies wholly below / above
    0 (touching 0 is not), 'no' when it contains 0: the verdict at a margin of 0."""
    return {NOT_WORSE: HIGHER, WORSE: LOWER, INCONCLUSIVE: NOT_DISTINGUISHED}.get(
        verdict(interval, 0.0), ONE_SEED
    )


def seeded_stats(
    runs: Sequence[SeedRun],
    baseline: str,
    margin_points: float = DEFAULT_MARGIN_POINTS,
    peer: str | None = None,
    subject: str | None = None,
) -> SeededStats:
    """Everything the seeded report shows. Variants keep the order of their first run;
    a pair uses the seeds both it and the baseline finished. With `peer` (a variant name)
    that finished, every other variant but the baseline is also paired with it. With
    `subject` (the full system) that finished, it is paired with every other variant."""
    if margin_points < 0:
        raise ValueError(f"--margin: {margin_points} is negative (it is in metric points, >= 0)")
    by_variant: dict[str, dict[int, SeedRun]] = {}
    for run in runs:
        by_variant.setdefault(run.variant, {})[run.seed] = run
    if baseline not in by_variant:
        raise ValueError(f"no finished {baseline} run: nothing to pair the variants with")
    base = by_variant[baseline]
    variants = tuple(_variant_stats(name, seeded) for name, seeded in by_variant.items())
    pairs = tuple(
        _pair_stats(name, base, seeded, margin_points)
        for name, seeded in by_variant.items()
        if name != baseline and set(seeded) & set(base)
    )
    reference = by_variant.get(peer) if peer is not None else None
    peer_pairs = (
        tuple(
            _pair_stats(name, reference, seeded, margin_points)
            for name, seeded in by_variant.items()
            if name not in (baseline, peer) and set(seeded) & set(reference)
        )
        if reference
        else ()
    )
    mine = by_variant.get(subject) if subject is not None else None
    subject_pairs = (
        tuple(
            dataclasses.replace(_pair_stats(subject, seeded, mine, margin_points), variant=name)
            for name, seeded in by_variant.items()
            if name != subject and set(seeded) & set(mine)
        )
        if mine
        else ()
    )
    return SeededStats(
        baseline=baseline,
        margin_points=margin_points,
        seeds=tuple(sorted({run.seed for run in runs})),
        variants=variants,
        pairs=pairs,
        peer=peer if reference else None,
        peer_pairs=peer_pairs,
        subject=subject if mine else None,
        subject_pairs=subject_pairs,
    )


def _variant_stats(name: str, seeded: dict[int, SeedRun]) -> VariantStats:
    ordered = [seeded[s] for s in sorted(seeded)]
    return VariantStats(
        variant=name,
        seeds=tuple(sorted(seeded)),
        training_time_s=mean_std([r.training_time_s for r in ordered]),
        final_eval_metric=mean_std([r.final_eval_metric for r in ordered]),
        best_eval_metric=mean_std([r.best_eval_metric for r in ordered]),
    )


def _pair_stats(
    name: str, base: dict[int, SeedRun], seeded: dict[int, SeedRun], margin_points: float
) -> PairStats:
    seeds = sorted(set(seeded) & set(base))
    speedups = [base[s].training_time_s / seeded[s].training_time_s for s in seeds]
    differences = [
        POINTS_PER_UNIT * (seeded[s].final_eval_metric - base[s].final_eval_metric) for s in seeds
    ]
    interval = confidence_interval(differences)
    ratio = geometric_mean_ratio(speedups)
    return PairStats(
        variant=name,
        seeds=tuple(seeds),
        speedup_mean=ratio.mean,
        speedup_min=ratio.min,
        speedup_max=ratio.max,
        metric_difference_points=mean_std(differences),
        interval_points=interval,
        verdict=verdict(interval, margin_points),
        distinguishable=distinguishable(interval),
        speedup_interval=Interval(ratio.low, ratio.high) if ratio.low is not None else None,
        speedup_of_mean_times=math.fsum(base[s].training_time_s for s in seeds)
        / math.fsum(seeded[s].training_time_s for s in seeds),
    )
