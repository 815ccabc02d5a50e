"""`compare --budgets`: variants at several budgets (epochs), each with its schedule fitted
to its budget: DDP by default, and every variant `--curves` names (the full system, the
peers); every variant set against DDP's curve (docs/compare.md, "Time-to-accuracy"; the
math is compare/curve.py). Time-to-target and frontier against frontier read the same runs
(compare/frontiers.py).

A budget run `<variant>_<E>ep` is the variant (DDP: K = 1, no freezing, the `--peers` DDP
variant's overrides) with `trainer.epochs` set to the budget. Its learning-rate schedule is
fitted to the budget: the decay (cosine or linear) runs over the budget's own steps, as
every run's does (the trainer decays over `trainer.epochs`), and the warm-up is the same
share of the run as the config's: `optimizer.warmup_steps` x budget / the config's epochs,
rounded, at least one step where the config warms up at all. A freezing variant's decision
cadence is fitted alike (`freeze.cadence_epochs`: its decisions at the same shares of the
run as at the config's epochs; freeze.py, DecisionSchedule). A run given less time is then
the run a user who simply trains less would make, not the first epochs of a longer run.

Owns: the budget variants' names and overrides, the default ladder, and the section of the
results and report that sets every variant against DDP's curve. Must not: run anything
(execute.py does) or compute statistics itself (curve.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetransformer.compare.curve import (
    Bounded,
    BoundedStats,
    CurvePoint,
    difference_stats,
    equal_time_difference,
    fmt_points,
    fmt_ratio,
    monotone_curve,
    ratio_stats,
    time_to_accuracy,
)
from pipetransformer.compare.order import read_order
from pipetransformer.compare.plots import plot_accuracy_time
from pipetransformer.compare.records import (
    RunRecord,
    decided_by_table,
    decided_by_variant,
    run_record,
)
from pipetransformer.compare.report import DDP, TITLES, is_finished, seed_dir
from pipetransformer.compare.stats import geometric_mean_ratio, mean_std
from pipetransformer.config import Config, ConfigError

_BUDGET = re.compile(r"^(.+)_(\d+)ep$")
# With --peers and no --budgets: these shares of the config's epochs (rounded half up,
# at least 1, below the config's epochs, which the DDP variant itself runs).
LADDER_SHARES = (0.25, 0.5, 0.75)


def budget_name(epochs: int, variant: str = DDP) -> str:
    return f"{variant}_{epochs}ep"


def budget_of(name: str) -> int | None:
    """The budget (epochs) of a budget run's name; None for any other variant."""
    found = _BUDGET.match(name)
    return int(found.group(2)) if found else None


def curve_of(name: str) -> str:
    """The variant whose curve a run is a point of: `ddp` for `ddp_2ep`, a variant's own."""
    found = _BUDGET.match(name)
    return found.group(1) if found else name


def variant_title(name: str) -> str:
    budget = budget_of(name)
    if budget is not None:
        base = curve_of(name)
        shown = "DDP" if base == DDP else TITLES.get(base, base)
        return f"{shown}, {budget} epoch{'s' if budget != 1 else ''} (schedule fitted)"
    return TITLES.get(name, name)


def default_ladder(epochs: int) -> list[int]:
    """Budgets below the config's epochs: 1, 2 for 3 epochs; 8, 15, 23 for 30."""
    found = {max(1, math.floor(share * epochs + 0.5)) for share in LADDER_SHARES}
    return sorted(b for b in found if b < epochs)


def fitted_warmup_steps(warmup_steps: int, epochs: int, budget: int) -> int:
    """The config's warm-up as the same share of a `budget`-epoch run (module docstring)."""
    if warmup_steps <= 0:
        return 0
    return max(1, math.floor(warmup_steps * budget / epochs + 0.5))


def budget_variants(
    config: Config,
    budgets: Sequence[int],
    overrides: Sequence[str],
    runs_full: bool,
    variant: str = DDP,
) -> dict[str, list[str]]:
    """Overrides of each budget run of `variant` (whose own are `overrides`). `runs_full`:
    the variant itself runs at the config's epochs (DDP under --peers), so that budget is
    not run twice. A freezing variant's decision cadence is fitted to the budget."""
    if any(b < 1 for b in budgets):
        raise ConfigError(f"--budgets: epochs must be >= 1, got {list(budgets)}")
    epochs = config.trainer.epochs
    warmup = config.optimizer.warmup_steps
    freezes = "freeze.strategy=none" not in overrides
    return {
        budget_name(b, variant): [
            *overrides,
            f"trainer.epochs={b}",
            f"optimizer.warmup_steps={fitted_warmup_steps(warmup, epochs, b)}",
            *([f"freeze.cadence_epochs={epochs}"] if freezes and b != epochs else []),
        ]
        for b in sorted(set(budgets))
        if not (runs_full and b == epochs)
    }


def finished_budgets(directory: Path) -> list[str]:
    """The budget runs that finished in `directory` (a seed's, or --out), by variant then
    budget."""
    found = [
        (curve_of(path.name), budget_of(path.name), path.name)
        for path in directory.glob("*_*ep")
        if budget_of(path.name) is not None and (path / "summary.json").is_file()
    ]
    return [name for _, _, name in sorted(found)]


@dataclass(frozen=True)
class VariantAgainstCurve:
    """One variant over the seeds against the same seed's DDP curve."""

    variant: str
    seeds: tuple[int | None, ...]
    time_to_accuracy: BoundedStats
    equal_time_points: BoundedStats
    # DDP's time for the variant's epochs over the variant's, paired by seed (None where DDP
    # did not run that many epochs): the fixed-epoch speedup, for comparison.
    fixed_epoch_speedup: float | None


@dataclass(frozen=True)
class SeedPair:
    variant: str
    seed: int | None
    time_s: float
    metric: float
    time_to_accuracy: Bounded
    equal_time_points: Bounded


@dataclass(frozen=True)
class TimeToAccuracy:
    """results.json's `time_to_accuracy`: the curve of every seed, each run against it,
    and the statistics over the seeds."""

    curve_variants: tuple[str, ...]  # the runs that make DDP's curve
    curves: dict[str, list[dict[str, Any]]]  # seed -> points (raw and made monotone)
    pairs: tuple[SeedPair, ...]
    variants: tuple[VariantAgainstCurve, ...]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def against_curve(records: Sequence[RunRecord]) -> TimeToAccuracy | None:
    """Every run that is not a point of its seed's DDP curve (DDP's budget runs and, where
    it ran, the DDP variant at the config's epochs) against that curve, other variants'
    budget runs included; None without DDP's budget runs."""
    by_seed: dict[int | None, list[RunRecord]] = {}
    for record in records:
        if record.final_eval_metric is not None:
            by_seed.setdefault(record.seed, []).append(record)
    if not any(budget_of(r.variant) is not None and curve_of(r.variant) == DDP for r in records):
        return None
    curves, pairs = {}, []
    for seed, runs in by_seed.items():
        points = [r for r in runs if curve_of(r.variant) == DDP]
        if not points:
            continue
        curve = monotone_curve([CurvePoint(r.training_time_s, r.final_eval_metric) for r in points])
        curves[str(seed)] = [
            {
                "variant": r.variant,
                "time_s": r.training_time_s,
                "metric": r.final_eval_metric,
                "monotone_metric": next(p.metric for p in curve if p.time_s == r.training_time_s),
            }
            for r in sorted(points, key=lambda r: r.training_time_s)
        ]
        for run in runs:
            if curve_of(run.variant) == DDP:  # a point of the curve itself
                continue
            time_s, metric = run.training_time_s, run.final_eval_metric
            pairs.append(
                SeedPair(
                    run.variant,
                    seed,
                    time_s,
                    metric,
                    time_to_accuracy(curve, time_s, metric),
                    equal_time_difference(curve, time_s, metric),
                )
            )
    names = list(dict.fromkeys(p.variant for p in pairs))
    # DDP's time for as many epochs as a run trained, by seed: the fixed-epoch reference.
    ddp_times = {
        (r.seed, len(r.epochs)): r.training_time_s for r in records if curve_of(r.variant) == DDP
    }
    epochs_of = {(r.variant, r.seed): len(r.epochs) for r in records}
    variants = []
    for name in names:
        own = [p for p in pairs if p.variant == name]
        keys = [(p, (p.seed, epochs_of[(name, p.seed)])) for p in own]
        paired = [ddp_times[key] / p.time_s for p, key in keys if key in ddp_times]
        speedup = geometric_mean_ratio(paired).mean if paired and name != DDP else None
        variants.append(
            VariantAgainstCurve(
                name,
                tuple(p.seed for p in own),
                ratio_stats([p.time_to_accuracy for p in own]),
                difference_stats([p.equal_time_points for p in own]),
                speedup,
            )
        )
    curve_names = sorted(
        {r.variant for r in records if curve_of(r.variant) == DDP},
        key=lambda n: budget_of(n) or math.inf,
    )
    return TimeToAccuracy(tuple(curve_names), curves, tuple(pairs), tuple(variants))


def report_lines(
    found: TimeToAccuracy | None, records: Sequence[RunRecord], metric: str
) -> list[str]:
    """The report's section: DDP's curve, every variant against it, who decided."""
    lines: list[str] = []
    if found is not None:
        lines += _curve_lines(found, records, metric)
    decided = decided_by_variant(records)
    if decided:
        lines += [
            "",
            "## Who set the frozen layer count",
            "",
            "At every freeze decision: `signal` when the rule's signal held freezing below "
            "what Eq. 1's bound and the cap allowed (the signal decided), `agree` when it "
            "proposed exactly that, `bound` when the bound set the count (the signal would "
            "have frozen more), `cap` for max_frozen_layers, `no signal` for a decision with "
            "nothing to read yet, `schedule` for rules that read no signal (freeze.py, "
            '"Who decided"). Summed over every seed.',
            "",
            *decided_by_table(decided, variant_title),
        ]
    return lines


def _curve_lines(found: TimeToAccuracy, records: Sequence[RunRecord], metric: str) -> list[str]:
    lines = [
        "",
        "## Time-to-accuracy against DDP's budget curve",
        "",
        "DDP's **budget curve**: DDP (K = 1, no freezing) at each budget, its learning-rate "
        "schedule fitted to the budget (the decay over the budget's steps, the warm-up the "
        "same share of the run as the config's), final "
        f"{metric} against training time, made monotone (each point the best of it and "
        "every shorter run) and linear between points; each seed's variants against the "
        "same seed's curve. **Time-to-accuracy**: the time the curve needs to reach the "
        "variant's final metric, over the variant's time (> 1: sooner than DDP given less "
        "time); **at least** where the variant is above every DDP point, **at most** where "
        "DDP's shortest budget already reaches it. **Accuracy at equal time**: the "
        "variant's metric less the curve's at the variant's time, in points. Over seeds: "
        "geometric mean (ratios) or mean (points) with 95% intervals; a seed that is only "
        "a bound enters with its bound and the mean is then a bound the same way "
        "(docs/compare.md). The speedups elsewhere in this report are **fixed-epoch**: "
        "every variant for the config's epochs.",
        "",
        f"| DDP budget | seeds | training time (s) | final {metric} |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in found.curve_variants:
        runs = [r for r in records if r.variant == name and r.final_eval_metric is not None]
        if not runs:
            continue
        times = mean_std([r.training_time_s for r in runs])
        metrics = mean_std([r.final_eval_metric for r in runs])
        title = variant_title(name) if name != DDP else f"{TITLES[DDP]}, the config's epochs"
        lines.append(
            f"| {title} | {len(runs)} | {times.mean:.1f} ± {times.std:.1f} "
            f"| {metrics.mean:.4f} ± {metrics.std:.4f} |"
        )
    lines += [
        "",
        "| variant | seeds | time-to-accuracy: geometric mean [95%] (range) "
        "| accuracy at equal time, points [95%] (range) "
        "| fixed-epoch speedup vs DDP (geometric mean) |",
        "| --- | ---: | --- | --- | ---: |",
    ]
    for v in found.variants:
        fixed = f"{v.fixed_epoch_speedup:.2f}x" if v.fixed_epoch_speedup else "-"
        lines.append(
            f"| {variant_title(v.variant)} | {len(v.seeds)} | {fmt_ratio(v.time_to_accuracy)} "
            f"| {fmt_points(v.equal_time_points)} | {fixed} |"
        )
    return lines


def plot_series(
    found: TimeToAccuracy, records: Sequence[RunRecord], title=variant_title
) -> dict[str, Any]:
    """What the accuracy-against-time plot draws (compare/plots.py): DDP's budget points
    and every variant's final point, mean ± std over the seeds, by `title(name)`."""

    def spread(runs: list[RunRecord]) -> dict[str, float]:
        times = mean_std([r.training_time_s for r in runs])
        metrics = mean_std([r.final_eval_metric for r in runs])
        return {"time_s": times.mean, "time_std": times.std, "metric": metrics.mean,
                "metric_std": metrics.std}  # fmt: skip

    def runs_of(name: str) -> list[RunRecord]:
        return [r for r in records if r.variant == name and r.final_eval_metric is not None]

    curve = [spread(runs_of(n)) for n in found.curve_variants if runs_of(n)]
    curve.sort(key=lambda p: p["time_s"])
    variants = {
        title(v.variant): spread(runs_of(v.variant)) for v in found.variants if v.variant != DDP
    }
    return {"ddp_curve": curve, "variants": variants}


def collect_records(out: Path, seeds: Sequence[int] | None) -> list[RunRecord]:
    """Every finished run of a comparison in `out` (of `seeds`; None: without seeds), the
    budget runs included, in the order compare lists the variants."""
    places = [(None, out)] if seeds is None else [(s, seed_dir(out, s)) for s in seeds]
    records = []
    for seed, directory in places:
        names = [n for n in TITLES if is_finished(directory / n)] + finished_budgets(directory)
        records += [run_record(directory / name, name, seed) for name in names]
    return records


def add_to_results(
    results: dict[str, Any],
    records: Sequence[RunRecord],
    out: Path,
    seeds: Sequence[int] | None,
    metric: str,
) -> tuple[list[str], list[str]]:
    """Every run's record (`collect_records`), each seed's run order, DDP's curve and every
    variant against it into `results`; the report's lines and the plots written
    (accuracy_time.png)."""
    results["runs"] = [r.to_dict() for r in records]
    if seeds is not None:
        results["run_order"] = {str(s): read_order(seed_dir(out, s)) for s in seeds}
    found = against_curve(records)
    plots = []
    if found is not None:
        results["time_to_accuracy"] = found.to_dict()
        plot_accuracy_time(plot_series(found, records), metric, out / "accuracy_time.png")
        plots.append("accuracy_time.png")
    results["decided_by"] = [dataclasses.asdict(d) for d in decided_by_variant(records)]
    lines = report_lines(found, records, metric)
    order = results.get("run_order")
    if order and any(order.values()):
        lines += ["", "Run order within each seed (rotated by the seed, compare/order.py): "]
        lines[-1] += "; ".join(
            f"seed {s}: {', '.join(names)}" for s, names in order.items() if names
        )
        lines[-1] += "."
    return lines, plots
