"""Time-to-target and frontier against frontier in a comparison (docs/compare.md,
"Time-to-target"; the statistics are compare/target.py's).

Every variant of a comparison is a **side**: its run at the config's epochs and its budget
runs (`<variant>_<E>ep`, `--budgets` with `--curves`; compare/budgets.py), each with its
schedule and decision cadence fitted to its budget. Per seed a side is every evaluation of
those runs (`trainer.evals_per_epoch` an epoch, the training time before each: evaluation
and checkpoints off the clock). The full system is the side every other is set against.
The **target** is `--target`, or the reference side's median final metric over the seeds at
the config's epochs (DDP where it ran them, else the baseline, Pipe+DDP) less `--margin`.

Owns: grouping the runs into sides, results.json's `time_to_target`, the report's sections
"Time-to-target" and "Frontier against frontier", and the series of frontiers.png. Must
not: compute statistics (target.py) or run anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetransformer.compare.budgets import curve_of, variant_title
from pipetransformer.compare.plots import plot_frontiers
from pipetransformer.compare.records import RunRecord
from pipetransformer.compare.report import BASELINE, DDP, ELASTIC, TITLES
from pipetransformer.compare.target import (
    BudgetEnd,
    FrontierGap,
    PeakDifference,
    Point,
    SideTarget,
    TargetRatio,
    frontier_gap,
    median_frontier,
    peak_difference,
    reference_target,
    side_target,
    side_time_to_target,
    target_ratio,
)

REFERENCES = (DDP, BASELINE)  # the target's reference side, the first that ran in full
PLOT = "frontiers.png"


@dataclass(frozen=True)
class TimeToTargetResults:
    """results.json's `time_to_target`: the target and where it came from, each side's
    runs (epochs) and time-to-target over the seeds, each side against the full system
    (ratio), and the frontiers read at each other's budget ends."""

    system: str
    target: float
    target_source: str  # 'given' (--target), or the reference side
    reference_finals: tuple[float, ...]  # its final metrics at the config's epochs
    margin_points: float
    budgets: dict[str, list[int]]  # side -> the epochs of its runs
    sides: tuple[SideTarget, ...]
    ratios: tuple[TargetRatio, ...]
    gaps: tuple[FrontierGap, ...]
    # The system's peak (best over its whole curve) less each peer's, paired by seed.
    peaks: tuple[PeakDifference, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


Sides = dict[str, dict[int | None, list[RunRecord]]]


def group_sides(records: Sequence[RunRecord]) -> Sides:
    """Side -> seed -> its runs (the variant's and its budget runs), runs that evaluated."""
    sides: Sides = {}
    for record in records:
        if record.evaluations:
            side = sides.setdefault(curve_of(record.variant), {})
            side.setdefault(record.seed, []).append(record)
    return sides


def run_epochs(record: RunRecord) -> int:
    return len(record.epochs)


def points_of(record: RunRecord) -> list[Point]:
    return [Point(e.training_time_s, e.eval_metric) for e in record.evaluations]


def frontier_points(runs: Sequence[RunRecord]) -> list[Point]:
    return [point for run in runs for point in points_of(run)]


def time_to_target(
    records: Sequence[RunRecord],
    epochs: int,
    margin_points: float,
    target: float | None = None,
    system: str = ELASTIC,
    references: Sequence[str] = REFERENCES,
) -> TimeToTargetResults | None:
    """Everything the two sections show, from the runs' records; None without the full
    system, or without a target (none given and no side of `references` ran the config's
    epochs: the first that did sets it)."""
    sides = group_sides(records)
    if system not in sides:
        return None
    source, finals = "given", ()
    if target is None:
        found = [
            (side, finals)
            for side in references
            if (finals := _finals_at(sides.get(side, {}), epochs))
        ]
        if not found:
            return None
        source, finals = found[0]
        target = reference_target(finals, margin_points)
    times = {
        side: side_target(
            side,
            {
                seed: side_time_to_target([points_of(r) for r in runs], target)
                for seed, runs in seeded.items()
            },
        )
        for side, seeded in sides.items()
    }
    others = [side for side in sides if side != system]
    gaps = []
    for side in others:
        gaps += _gaps(side, system, sides[side], sides[system])
        gaps += _gaps(system, side, sides[system], sides[side])
    return TimeToTargetResults(
        system=system,
        target=target,
        target_source=source,
        reference_finals=tuple(finals),
        margin_points=margin_points,
        budgets={
            side: sorted({run_epochs(r) for runs in seeded.values() for r in runs})
            for side, seeded in sides.items()
        },
        sides=(times[system], *(times[side] for side in others)),
        ratios=tuple(target_ratio(times[side], times[system]) for side in others),
        gaps=tuple(gaps),
        peaks=tuple(
            peak_difference(side, system, _peaks(sides[side]), _peaks(sides[system]))
            for side in others
        ),
    )


def _peaks(seeded: dict[int | None, list[RunRecord]]) -> dict[int | None, float]:
    """Per seed, the best metric of every evaluation of the side's runs."""
    return {
        seed: max(point.metric for point in frontier_points(runs)) for seed, runs in seeded.items()
    }


def _finals_at(seeded: dict[int | None, list[RunRecord]], epochs: int) -> tuple[float, ...]:
    return tuple(
        r.final_eval_metric
        for runs in seeded.values()
        for r in runs
        if run_epochs(r) == epochs and r.final_eval_metric is not None
    )


def _gaps(
    reader: str,
    other: str,
    reader_runs: dict[int | None, list[RunRecord]],
    other_runs: dict[int | None, list[RunRecord]],
) -> list[FrontierGap]:
    """Each budget of `reader` read on `other`'s frontier."""
    frontiers = {seed: frontier_points(runs) for seed, runs in other_runs.items()}
    by_budget: dict[int, dict[int | None, BudgetEnd]] = {}
    for seed, runs in reader_runs.items():
        for run in runs:
            last = max(run.evaluations, key=lambda e: e.training_time_s)
            budget = run_epochs(run)
            by_budget.setdefault(budget, {})[seed] = BudgetEnd(
                budget, last.training_time_s, last.eval_metric
            )
    return [
        frontier_gap(reader, other, budget, ends, frontiers)
        for budget, ends in sorted(by_budget.items())
        if any(seed in frontiers for seed in ends)
    ]


def _side(name: str) -> str:
    return TITLES.get(name, name)


Title = Callable[[str], str]


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def report_lines(found: TimeToTargetResults, metric: str, title: Title = _side) -> list[str]:
    """The report's sections: time-to-target, then frontier against frontier; `title(side)`
    names a side (compare's titles by default)."""
    system = title(found.system)
    if found.target_source == "given":
        how = "given (--target)"
    else:
        finals = found.reference_finals
        how = (
            f"{title(found.target_source)}'s median final {metric} over {len(finals)} seed(s) at "
            f"the config's epochs less the margin of {found.margin_points:.2f} points"
        )
    lines = [
        "",
        "## Time-to-target",
        "",
        f"**Target {metric} {found.target:.4f}**: {how}. A run's **time-to-target** is its "
        "training time (evaluation and checkpoint writes off the clock) at its first "
        "evaluation at or above the target; a side's, at a seed, the earliest over its runs "
        "(its budgets, each with its schedule and decision cadence fitted). Median and "
        "interquartile range over the seeds count a seed that never reached the target as "
        "later than any time (**not reached** where the median or a quartile falls on one). "
        f"The ratio is a side's time over {system}'s (> 1: {system} reached it sooner), paired "
        "by seed over the seeds where both reached it: geometric mean with a 95% t interval on "
        "the logarithms; seeds where only one or neither reached it are counted, never "
        "averaged in.",
        "",
        "| side | runs (epochs) | seeds | reached | time-to-target (s): median [IQR] "
        "| per seed (s) |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for side in found.sides:
        per_seed = ", ".join(
            f"{seed}: {_seconds(time_s)}" for seed, time_s in zip(side.seeds, side.times)
        )
        lines.append(
            f"| {title(side.side)} | {', '.join(map(str, found.budgets[side.side]))} "
            f"| {len(side.seeds)} | {side.reached} | {_seconds(side.median_s)} "
            f"[{_seconds(side.q1_s)}, {_seconds(side.q3_s)}] | {per_seed} |"
        )
    lines += [
        "",
        f"| side over {system} | seeds both reached | ratio [95%] (range) "
        f"| {system} alone reached | side alone reached | neither |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for ratio in found.ratios:
        lines.append(
            f"| {title(ratio.peer)} | {len(ratio.seeds)} | {_ratio(ratio)} "
            f"| {ratio.system_only} | {ratio.peer_only} | {ratio.neither} |"
        )
    if found.peaks:
        lines += [
            "",
            "## Peak",
            "",
            f"A side's **peak** at a seed: the best {metric} over every evaluation of all its "
            f"runs. {system}'s peak less each side's, paired by seed, in points with a 95% t "
            "interval (non-inferior at a margin where the interval's lower end lies above "
            "minus the margin); each side's mean peak over those seeds.",
            "",
            f"| side | seeds | {system}'s mean peak | side's mean peak | {system} less side, "
            "points [95%] (per seed) |",
            "| --- | ---: | ---: | ---: | --- |",
        ]
        for peak in found.peaks:
            lines.append(
                f"| {title(peak.peer)} | {len(peak.seeds)} | {_metric(peak.system_peak)} "
                f"| {_metric(peak.peer_peak)} | {_peak(peak)} |"
            )
    if found.gaps:
        lines += [
            "",
            "## Frontier against frontier",
            "",
            "A side's **frontier** at a seed: the best "
            f"{metric} any of its evaluations reached by a given training time (a step "
            "function: straight lines between budgets would understate a concave curve between "
            "its points). Each run's end (its last evaluation) is read on the other side's "
            "frontier at the same training time: its metric less the other's best by then, in "
            "points (> 0: the run is ahead), over the seeds with a 95% t interval; **none by "
            "then**: the other had not evaluated yet (left out, counted); **beyond**: the time "
            "lay past the other's longest run (read as its best).",
            "",
            "| run | read on | seeds | training time (s) | points [95%] (range) "
            "| none by then | beyond |",
            "| --- | --- | ---: | ---: | --- | ---: | ---: |",
        ]
        for gap in found.gaps:
            lines.append(
                f"| {title(gap.reader)}, {gap.budget} epoch{'s' if gap.budget != 1 else ''} "
                f"| {title(gap.other)} | {len(gap.seeds)} "
                f"| {gap.reader_time_s.mean:.1f} ± {gap.reader_time_s.std:.1f} "
                f"| {_gap(gap)} | {gap.none_by_then} | {gap.beyond} |"
            )
    return lines


def _ratio(ratio: TargetRatio) -> str:
    stats = ratio.ratio
    if stats is None:
        return "-"
    interval = f" [{stats.low:.2f}, {stats.high:.2f}]" if stats.low is not None else ""
    return f"{stats.mean:.2f}x{interval} ({stats.min:.2f}-{stats.max:.2f})"


def _metric(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _peak(peak: PeakDifference) -> str:
    if peak.points is None:
        return "-"
    interval = f" [{peak.interval.low:+.2f}, {peak.interval.high:+.2f}]" if peak.interval else ""
    per_seed = ", ".join(f"{d:+.2f}" for d in peak.differences)
    return f"{peak.points.mean:+.2f}{interval} ({per_seed})"


def _gap(gap: FrontierGap) -> str:
    if gap.points is None:
        return "-"
    known = [d for d in gap.differences if d is not None]
    interval = f" [{gap.interval.low:+.2f}, {gap.interval.high:+.2f}]" if gap.interval else ""
    return f"{gap.points.mean:+.2f}{interval} ({min(known):+.2f} to {max(known):+.2f})"


def plot_series(
    found: TimeToTargetResults, records: Sequence[RunRecord], title: Title = _side
) -> dict[str, Any]:
    """What frontiers.png draws: per side every run's evaluations (training time, metric)
    and the median over the seeds of its frontier on a grid of times; the target."""
    sides = group_sides(records)
    latest = max(p.time_s for seeded in sides.values() for r in _all(seeded) for p in points_of(r))
    grid = [latest * i / 200 for i in range(201)]
    series: dict[str, Any] = {"target": found.target, "sides": {}}
    for side, seeded in sides.items():
        frontiers = {seed: frontier_points(runs) for seed, runs in seeded.items()}
        series["sides"][title(side)] = {
            "runs": [
                {
                    "run": variant_title(r.variant),
                    "seed": r.seed,
                    "time_s": [p.time_s for p in points_of(r)],
                    "metric": [p.metric for p in points_of(r)],
                }
                for r in _all(seeded)
            ],
            "frontier": {"time_s": grid, "metric": median_frontier(frontiers, grid)},
        }
    return series


def _all(seeded: dict[int | None, list[RunRecord]]) -> list[RunRecord]:
    return [r for runs in seeded.values() for r in runs]


def add_to_results(
    results: dict[str, Any],
    records: Sequence[RunRecord],
    out: Path,
    epochs: int,
    margin_points: float,
    target: float | None,
    metric: str,
) -> tuple[list[str], list[str]]:
    """results.json's `time_to_target`, the report's lines and the plot written."""
    found = time_to_target(records, epochs, margin_points, target)
    if found is None:
        return [], []
    results["time_to_target"] = found.to_dict()
    plot_frontiers(plot_series(found, records), metric, out / PLOT)
    return report_lines(found, metric), [PLOT]
