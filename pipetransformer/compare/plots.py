"""PNG plots of a comparison. Each function returns the series it drew, so tests can check
what a plot shows without reading pixels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a training node
import matplotlib.pyplot as plt  # noqa: E402

from pipetransformer.compare.report import TITLES  # noqa: E402


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
        ax.plot([e for e, _ in points], [v for _, v in points], marker="o", label=TITLES.get(name, name))
    _finish(fig, ax, f"eval {metric}", f"Eval {metric} per epoch", path)
    return series


def plot_trajectory(runs: dict[str, dict[str, Any]], path: Path) -> dict[str, dict[str, list[int]]]:
    keys = ("num_frozen_layers", "pipe_len", "dp_degree")
    series = {
        name: {key: [p[key] for p in run["freeze_trajectory"]] for key in keys} for name, run in runs.items()
    }
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for ax, key in zip(axes, keys):
        for name, values in series.items():
            ax.step(_epochs(runs[name]), values[key], where="post", marker="o", label=TITLES.get(name, name))
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
