"""A comparison's outputs: results.json, report.md and the plots, from the runs its
variants left (one run each, or one per seed with the statistics over seeds), with the
sections read from every run's record (against DDP's budget curve: compare/budgets.py;
time-to-target and frontiers: compare/frontiers.py); and the per-unit costs the ideal
speedup needs, measured in this process.

Owns: assembling and writing the outputs. Must not: run a variant (execute.py) or compute
statistics itself (stats.py, curve.py).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from pipetransformer.compare import frontiers
from pipetransformer.compare.budgets import add_to_results, collect_records
from pipetransformer.compare.plots import write_plots, write_seeded_plots
from pipetransformer.compare.report import (
    BASELINE,
    DDP,
    ELASTIC,
    TITLES,
    build_results,
    finished_seed_runs,
    read_run,
    read_seed_run,
    refusal,
    save_results,
    seed_dir,
    write_report,
)
from pipetransformer.compare.stats import DEFAULT_MARGIN_POINTS, seeded_stats
from pipetransformer.config import Config

logger = logging.getLogger(__name__)


def measured_unit_costs(config: Config) -> dict[str, list[float]] | None:
    """Per-unit forward+backward and forward-only seconds at the run's micro-batch size,
    measured in this process (the ideal speedup needs times, not parameter counts). None
    under trainer.batch_per_replica: the ideal model (compare/ideal.py) counts a fixed number
    of steps an epoch, which a growing global batch does not have."""
    if config.trainer.batch_per_replica is not None:
        logger.info("no ideal speedup: trainer.batch_per_replica changes the steps an epoch")
        return None
    try:
        return measure_model_costs(config)
    except Exception as exc:  # the report stays useful without the ideal figure
        logger.warning("could not measure unit costs for the ideal speedup: %s", exc)
        return None


def measure_model_costs(config: Config) -> dict[str, list[float]]:
    """Per-unit seconds (trained: forward + backward; frozen: forward only) of the config's
    model at the baseline layout's micro-batch size, measured in this process."""
    from pipetransformer.models import build_model
    from pipetransformer.pipe.measure import measure_unit_costs
    from pipetransformer.planning import (
        describe_model,
        model_build_args,
        profiling_micro_batch_size,
    )

    spec = describe_model(config)
    micro = profiling_micro_batch_size(config)
    model = build_model(config.model, **model_build_args(config))
    measured = measure_unit_costs(dict(enumerate(model.units)), spec, micro, "cpu")
    units = range(spec.num_units)
    return {
        "trained": [measured[u].forward_s + measured[u].backward_s for u in units],
        "frozen": [measured[u].frozen_forward_s for u in units],
        "micro_batch_size": micro,
    }


def say_where(out: Path) -> None:
    """The last line of a comparison: where its outputs are (the report goes to stdout
    above it, the runs' logs to stderr before it)."""
    print(
        f"pipetransformer compare: report in {out / 'report.md'} (results.json and plots "
        f"beside it; each run in {out}/)",
        file=sys.stderr,
    )


def write_outputs(
    runs: dict[str, dict[str, Any]],
    costs: dict[str, list[float]] | None,
    context: dict[str, Any],
    config: Config,
    out: Path,
) -> int:
    results = build_results(runs, costs, config.cache.enabled, context)
    plots = write_plots(runs, out)
    metric = runs[BASELINE]["metric_name"]
    extra, extra_plots = _sections(results, out, None, metric, config.trainer.epochs)
    results["plots"] = sorted([*plots, *extra_plots])
    save_results(results, out)
    print(_with_section(write_report(results, out, sorted(plots)), extra, extra_plots, out))
    say_where(out)
    return 0


def _sections(
    results: dict[str, Any], out: Path, seeds: list[int] | None, metric: str, epochs: int
) -> tuple[list[str], list[str]]:
    """Every run's record into `results`, with the sections read from them: against DDP's
    budget curve (compare/budgets.py), time-to-target and frontier against frontier
    (compare/frontiers.py, at results' margin and target); their lines and plots."""
    records = collect_records(out, seeds)
    lines, plots = add_to_results(results, records, out, seeds, metric)
    margin = results.get("margin_points")
    margin = DEFAULT_MARGIN_POINTS if margin is None else margin
    more, more_plots = frontiers.add_to_results(
        results, records, out, epochs, margin, results.get("target"), metric
    )
    return lines + more, plots + more_plots


def _with_section(report: str, lines: list[str], plots: list[str], out: Path) -> str:
    """report.md with the sections read from every run's record (`_sections`) appended."""
    if not lines and not plots:
        return report
    text = report + "\n".join([*lines, "", *[f"![{p}]({p})" for p in plots]]) + "\n"
    (out / "report.md").write_text(text)
    return text


def write_seeded_outputs(
    costs: dict[str, list[float]] | None,
    context: dict[str, Any],
    config: Config,
    out: Path,
    margin_points: float,
    seeds: list[int] | None = None,
) -> int:
    """The outputs of a comparison over seeds, from the runs that finished in `out` (of
    `seeds`; None: of every seed there): the statistics over the seeds, and in detail the
    first seed that has baseline and elastic."""
    finished = finished_seed_runs(out)
    runs_by_seed = {
        seed: {name: read_run(seed_dir(out, seed) / name) for name in names}
        for seed, names in finished.items()
        if names and (seeds is None or seed in seeds)
    }
    detail = next(s for s, runs in runs_by_seed.items() if BASELINE in runs and ELASTIC in runs)
    seed_runs = [
        read_seed_run(seed_dir(out, seed) / name, name, seed)
        for seed, runs in runs_by_seed.items()
        for name in runs
    ]
    stats = seeded_stats(seed_runs, BASELINE, margin_points, peer=DDP, subject=ELASTIC)
    context["refused"] = {
        name: reason
        for seed in runs_by_seed
        for name in TITLES
        if (reason := refusal(seed_dir(out, seed) / name))
    }
    results = build_results(runs_by_seed[detail], costs, config.cache.enabled, context)
    results.update(detail_seed=detail, margin_points=margin_points, seeded=stats.to_dict())
    plots = write_seeded_plots(runs_by_seed, stats, detail, out)
    metric = runs_by_seed[detail][BASELINE]["metric_name"]
    seeds_done = list(runs_by_seed)
    extra, extra_plots = _sections(results, out, seeds_done, metric, config.trainer.epochs)
    results["plots"] = sorted([*plots, *extra_plots])
    save_results(results, out)
    report = write_report(results, out, sorted(plots), stats)
    print(_with_section(report, extra, extra_plots, out))
    say_where(out)
    return 0
