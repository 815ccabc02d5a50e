"""PNG plots of a comparison. Each function returns the series it drew, so tests can check
what a plot shows without reading pixels. Over seeds, each point or bar is the mean over the
seeds with an error bar of one standard deviation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a training node
import matplotlib.pyplot as plt  # noqa: E402

from pipetransformer.compare.report import TITLES  # noqa: E402
from pipetransformer.compare.stats import SeededStats, mean_std  # noqa: E402


def _epochs(run: dict[str, Any]) -> list[int]:
    return [p["epoch"] for p in run["freeze_trajectory"]]


def _finish(fig, ax, ylabel: str, title: str, path: Path) -> None:
    """Label a per-epoch plot, save it as PNG and release the figure."""
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(runs: dict[str, dict[str, Any]], path: Path) -> dict[str, list[float]]:
    series = {name: run["samples_per_s"] for name, run in runs.items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        ax.plot(_epochs(runs[name]), values, marker="o", label=TITLES.get(name, name))
    _finish(fig, ax, "training samples / s", "Throughput per epoch", path)
    return series


def plot_eval_metric(runs: dict[str, dict[str, Any]], path: Path) -> dict[str, list[float]]:
    series = {name: run["eval_metric"] for name, run in runs.items()}
    metric = next(iter(runs.values()))["metric_name"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        points = [(e, v) for e, v in zip(_epochs(runs[name]), values) if v is not None]
        ax.plot(
            [e for e, _ in points], [v for _, v in points], marker="o", label=TITLES.get(name, name)
        )
    _finish(fig, ax, f"eval {metric}", f"Eval {metric} per epoch", path)
    return series


def plot_trajectory(runs: dict[str, dict[str, Any]], path: Path) -> dict[str, dict[str, list[int]]]:
    keys = ("num_frozen_layers", "pipe_len", "dp_degree")
    series = {
        name: {key: [p[key] for p in run["freeze_trajectory"]] for key in keys}
        for name, run in runs.items()
    }
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for ax, key in zip(axes, keys):
        for name, values in series.items():
            ax.step(
                _epochs(runs[name]),
                values[key],
                where="post",
                marker="o",
                label=TITLES.get(name, name),
            )
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].set_title("Freeze trajectory and layout per epoch")
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series


def write_plots(runs: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    return {
        "throughput.png": plot_throughput(runs, out / "throughput.png"),
        "trajectory.png": plot_trajectory(runs, out / "trajectory.png"),
        "eval_metric.png": plot_eval_metric(runs, out / "eval_metric.png"),
    }


def plot_over_seeds(
    runs_by_seed: dict[int, dict[str, dict[str, Any]]],
    key: str,
    ylabel: str,
    title: str,
    path: Path,
) -> dict[str, dict[str, list[float]]]:
    """A per-epoch series (`samples_per_s`, `eval_metric`) as mean ± std over the seeds, per
    variant; epochs without a value (no evaluation) are left out."""
    values: dict[str, dict[int, list[float]]] = {}
    for runs in runs_by_seed.values():
        for name, run in runs.items():
            for epoch, value in zip(_epochs(run), run[key]):
                if value is not None:
                    values.setdefault(name, {}).setdefault(epoch, []).append(value)
    series = {}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, by_epoch in values.items():
        epochs = sorted(by_epoch)
        spread = [mean_std(by_epoch[e]) for e in epochs]
        means, stds = [m.mean for m in spread], [m.std for m in spread]
        series[name] = {"epoch": epochs, "mean": means, "std": stds}
        ax.errorbar(epochs, means, yerr=stds, marker="o", capsize=3, label=TITLES.get(name, name))
    _finish(fig, ax, ylabel, title, path)
    return series


def plot_seed_summary(stats: SeededStats, metric: str, path: Path) -> dict[str, Any]:
    """Per variant, mean ± std over the seeds: wall time as bars from zero, the final metric
    as points on an axis zoomed in on them (bars on a cut axis would mislead)."""
    names = [v.variant for v in stats.variants]
    walls = [v.training_time_s for v in stats.variants]
    finals = [v.final_eval_metric for v in stats.variants]
    series = {
        "training_time_s": {"mean": [w.mean for w in walls], "std": [w.std for w in walls]},
        "final_eval_metric": {"mean": [f.mean for f in finals], "std": [f.std for f in finals]},
    }
    fig, (wall_ax, metric_ax) = plt.subplots(1, 2, figsize=(9, 4))
    wall_ax.bar(
        names, series["training_time_s"]["mean"], yerr=series["training_time_s"]["std"], capsize=4
    )
    metric_ax.errorbar(
        names,
        series["final_eval_metric"]["mean"],
        yerr=series["final_eval_metric"]["std"],
        fmt="o",
        capsize=4,
    )
    metric_ax.margins(x=0.3)
    for ax, ylabel in [(wall_ax, "wall time (s)"), (metric_ax, f"final {metric}")]:
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"Over seeds {', '.join(map(str, stats.seeds))}: mean ± std")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"names": names, **series}


def write_seeded_plots(
    runs_by_seed: dict[int, dict[str, dict[str, Any]]],
    stats: SeededStats,
    detail_seed: int,
    out: Path,
) -> dict[str, Any]:
    """Throughput and eval metric per epoch over the seeds, the wall time and metric bars, and
    the freeze trajectory of one seed (each seed freezes at its own epochs)."""
    metric = next(iter(runs_by_seed[detail_seed].values()))["metric_name"]
    spread = "per epoch (mean ± std over seeds)"
    return {
        "throughput.png": plot_over_seeds(
            runs_by_seed,
            "samples_per_s",
            "training samples / s",
            f"Throughput {spread}",
            out / "throughput.png",
        ),
        "trajectory.png": plot_trajectory(runs_by_seed[detail_seed], out / "trajectory.png"),
        "eval_metric.png": plot_over_seeds(
            runs_by_seed,
            "eval_metric",
            f"eval {metric}",
            f"Eval {metric} {spread}",
            out / "eval_metric.png",
        ),
        "seeds.png": plot_seed_summary(stats, metric, out / "seeds.png"),
    }


def plot_accuracy_time(series: dict[str, Any], metric: str, path: Path) -> dict[str, Any]:
    """Final metric against training time (compare/budgets.py's `plot_series`): DDP's budget
    points and its monotone curve through their means, every variant's point; mean ± std
    over the seeds on both axes."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    curve = series["ddp_curve"]
    if curve:
        times = [p["time_s"] for p in curve]
        best, envelope = float("-inf"), []
        for point in curve:
            best = max(best, point["metric"])
            envelope.append(best)
        ax.errorbar(
            times,
            [p["metric"] for p in curve],
            xerr=[p["time_std"] for p in curve],
            yerr=[p["metric_std"] for p in curve],
            fmt="s",
            color="black",
            capsize=3,
            label="DDP at each budget (schedule fitted)",
        )
        ax.plot(times, envelope, color="black", linewidth=1, label="DDP's curve (monotone)")
    for name, point in series["variants"].items():
        ax.errorbar(
            point["time_s"],
            point["metric"],
            xerr=point["time_std"],
            yerr=point["metric_std"],
            fmt="o",
            capsize=3,
            label=name,
        )
    ax.set_xlabel("training time (s)")
    ax.set_ylabel(f"final {metric}")
    ax.set_title(f"Final {metric} against training time (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series


def plot_frontiers(series: dict[str, Any], metric: str, path: Path) -> dict[str, Any]:
    """Every run's evaluations against training time, a colour a side (compare/frontiers.py's
    `plot_series`), each side's frontier (the median over the seeds of the best reached by
    then, a step function) and the target."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (side, drawn) in enumerate(series["sides"].items()):
        colour = colours[index % len(colours)]
        for run in drawn["runs"]:
            ax.plot(run["time_s"], run["metric"], marker=".", color=colour, alpha=0.3, lw=0.7)
        frontier = drawn["frontier"]
        known = [(t, m) for t, m in zip(frontier["time_s"], frontier["metric"]) if m is not None]
        if known:
            ax.step(*zip(*known), where="post", color=colour, lw=2, label=f"{side} (median)")
    ax.axhline(series["target"], color="black", ls="--", lw=1, label="target")
    ax.set_xlabel("training time (s), evaluation and checkpoints off the clock")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} against training time: every run's evaluations and each frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series
