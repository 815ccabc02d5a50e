"""`pipetransformer compare`: the baseline and the elastic system, one after the other, on the
same seed, data and machine; with --ablations also the paper's speedup breakdown (Fig. 9);
with --seeds every variant once per seed (trainer.seed), in `seed-<s>/<variant>/`, in an
order that rotates with the seed (compare/order.py); with --budgets (or --peers) DDP, and
every variant --curves names, at several budgets too, every variant set against DDP's
curve (compare/budgets.py) and every side's time-to-target and frontier against the full
system's (compare/frontiers.py).

Owns: the variants' overrides, running them (local worker processes), skipping runs that
finished earlier and resuming one a stop signal cut short from its checkpoint (an
interrupted comparison resumes), turning SIGINT / SIGTERM into `CompareStopped` (the command
line says it in one line), recording when each attempt ran (compare/timing.py), measuring
the per-unit costs the ideal speedup needs, and writing results.json, report.md and plots.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pipetransformer.compare import frontiers
from pipetransformer.compare.budgets import (
    add_to_results,
    budget_of,
    budget_variants,
    collect_records,
    default_ladder,
    variant_title,
)
from pipetransformer.compare.order import record_order, rotated_order
from pipetransformer.compare.peers import peer_for, run_peer
from pipetransformer.compare.plots import write_plots, write_seeded_plots
from pipetransformer.compare.report import (
    BASELINE,
    DDP,
    DDP_FROZEN_EMBEDDING,
    ELASTIC,
    FREEZE_DDP,
    FREEZE_FSDP,
    FSDP,
    HF_TRAINER,
    REFUSED,
    TITLES,
    TORCH_DDP,
    build_results,
    finished_seed_runs,
    is_finished,
    read_run,
    read_seed_run,
    refusal,
    save_results,
    seed_dir,
    write_report,
)
from pipetransformer.compare.stats import DEFAULT_MARGIN_POINTS, seeded_stats
from pipetransformer.compare.timing import end_attempt, start_attempt
from pipetransformer.config import Config, ConfigError, load_config
from pipetransformer.data.sources import run_name
from pipetransformer.launcher import LaunchInterrupted, WorkerFailed, launch_local
from pipetransformer.runs.checkpoint import find_checkpoint
from pipetransformer.runs.rundir import RunLock, ensure_directory, prepare_run_dir
from pipetransformer.trainer import RunOptions, run_worker
from pipetransformer.utils.files import write_json_atomic
from pipetransformer.utils.stopping import STOP_SIGNALS

logger = logging.getLogger(__name__)


def variant_overrides(config: Config, ablations: bool, peers: bool = False) -> dict[str, list[str]]:
    """Overrides per variant, in the order they run. The baseline is the same config with
    freezing (and so every elastic component) off, as a fixed pipeline: the configured
    length, or with 'auto' the whole node (the paper's Pipe+DDP). Peers are what a user
    would run instead: when the model fits one device, plain DDP, and DDP with the same
    freeze algorithm and AutoCache but no pipeline; when it does not, FSDP2 over every
    process (fully_shard per layer and at the root), without freezing and with the same
    freeze algorithm (its frozen prefix gathered once at the transition that froze it, then
    served from AutoCache where that is faster than recomputing it, as the full system
    serves it; with cache.enabled=false recomputed). Under trainer.batch_per_replica the
    peers train the baseline's global batch (its replicas never change), as `plan
    --predict`'s peers do."""
    pipe_len = config.pipeline.initial_pipe_len
    fixed = pipe_len if isinstance(pipe_len, int) else config.nproc_per_node
    per_replica = config.trainer.batch_per_replica
    peer_batch = []
    if per_replica is not None:
        baseline_global = per_replica * (config.nproc_per_node // fixed)
        peer_batch = [
            "trainer.batch_per_replica=null",
            f"trainer.global_batch_size={baseline_global}",
        ]
    variants = {
        BASELINE: [
            "freeze.strategy=none",
            "cache.enabled=false",
            f"pipeline.initial_pipe_len={fixed}",
            "pipeline.sharding=never",
        ]
    }
    if peers:
        variants[DDP] = [
            "freeze.strategy=none",
            "cache.enabled=false",
            "pipeline.initial_pipe_len=1",
            "pipeline.sharding=never",
            *peer_batch,
        ]
        model = config.model
        if model.pretrained or model.model_name_or_path or model.checkpoint_path:
            variants[DDP_FROZEN_EMBEDDING] = frozen_embedding_overrides(variants[DDP])
        # What a user of this model family runs today (compare/peers.py), on the DDP run's
        # batch: transformers' Trainer for text models, a plain timm + DDP loop for images.
        variants[peer_for(config)] = variants[DDP]
        variants[FREEZE_DDP] = [
            "pipeline.initial_pipe_len=1",
            "pipeline.sharding=never",
            *peer_batch,
        ]
        # The fewest micro-batches that fit (gradient accumulation, how FSDP2 users fit a
        # batch), not the pipeline's M.
        sharded = [
            "pipeline.initial_pipe_len=1",
            "pipeline.sharding=always",
            "pipeline.num_micro_batches=auto",
            *peer_batch,
        ]
        variants[FSDP] = ["freeze.strategy=none", "cache.enabled=false", *sharded]
        variants[FREEZE_FSDP] = sharded
    if ablations:
        never = "pipeline.sharding=never"  # a sharded layout is AutoPipe's and AutoDP's
        variants["freeze_only"] = ["autopipe.enabled=false", "cache.enabled=false", never]
        variants["no_autodp"] = ["autodp.enabled=false", "cache.enabled=false", never]
        if config.cache.enabled:
            variants["no_cache"] = ["cache.enabled=false"]
    variants[ELASTIC] = []
    return variants


def frozen_embedding_overrides(ddp: list[str]) -> list[str]:
    """What a DDP user can freeze without this system (`ddp`: DDP's overrides): the
    pretrained embedding, from the first step, and no layer after it (one decision that
    keeps 0 layers; no cache: DDP has none), so that freezing layers shows its own share."""
    return [
        "freeze.strategy=manual",
        "freeze.manual_schedule=[0]",
        "freeze.interval_steps=null",
        "freeze.embedding=true",
        *(o for o in ddp if not o.startswith("freeze.strategy=")),
    ]


def machine_description(config: Config) -> str:
    device = (
        "CUDA: " + torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and config.trainer.device != "cpu"
        else "CPU"
    )
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {device}, "
        f"{config.nproc_per_node} processes, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def measured_unit_costs(config: Config) -> dict[str, list[float]] | None:
    """Per-unit forward+backward and forward-only seconds at the run's micro-batch size,
    measured in this process (the ideal speedup needs times, not parameter counts). None
    under trainer.batch_per_replica: the ideal model (compare/ideal.py) counts a fixed number
    of steps an epoch, which a growing global batch does not have."""
    if config.trainer.batch_per_replica is not None:
        logger.info("no ideal speedup: trainer.batch_per_replica changes the steps an epoch")
        return None
    try:
        return measure_model_costs(config)
    except Exception as exc:  # the report stays useful without the ideal figure
        logger.warning("could not measure unit costs for the ideal speedup: %s", exc)
        return None


def measure_model_costs(config: Config) -> dict[str, list[float]]:
    """Per-unit seconds (trained: forward + backward; frozen: forward only) of the config's
    model at the baseline layout's micro-batch size, measured in this process."""
    from pipetransformer.models import build_model
    from pipetransformer.pipe.measure import measure_unit_costs
    from pipetransformer.planning import (
        describe_model,
        model_build_args,
        profiling_micro_batch_size,
    )

    spec = describe_model(config)
    micro = profiling_micro_batch_size(config)
    model = build_model(config.model, **model_build_args(config))
    measured = measure_unit_costs(dict(enumerate(model.units)), spec, micro, "cpu")
    units = range(spec.num_units)
    return {
        "trained": [measured[u].forward_s + measured[u].backward_s for u in units],
        "frozen": [measured[u].frozen_forward_s for u in units],
        "micro_batch_size": micro,
    }


def run_compare(
    config: Config,
    config_path: str | None,
    overrides: list[str],
    out: Path,
    ablations: bool,
    peers: bool = False,
    seeds: list[int] | None = None,
    margin_points: float | None = None,
    only: list[str] | None = None,
    budgets: list[int] | None = None,
    command: str | None = None,
    curves: list[str] | None = None,
    target: float | None = None,
) -> int:
    """Run every variant (once per seed with `seeds`), then write the outputs. A variant whose
    run directory holds a finished run (summary.json) is not run again; one an interrupted
    comparison stopped resumes from its checkpoint. `only`: of the variants, these (and the
    baseline and the full system, which the report needs). `command`: the command line
    that made the comparison, as the report records it (shell-quoted, with --out).
    `budgets`: the `curves` (default: DDP) also at these epochs (compare/budgets.py); None:
    the default ladder below the config's epochs with `peers` (and DDP among the variants
    run) or `curves`, else none. `target`: time-to-target's, in the metric's units (None:
    the reference's median less the margin; compare/frontiers.py). Raises CompareStopped
    on SIGINT or SIGTERM while it runs under `stop_signals_raise`."""
    if config.freeze.strategy == "none":
        raise ConfigError(
            "freeze.strategy: compare needs a freeze strategy (the baseline turns it off)"
        )
    if seeds is not None and any(o.partition("=")[0].strip() == "trainer.seed" for o in overrides):
        raise ConfigError(
            "trainer.seed: --seeds/--repeats set it for each run; leave out the override"
        )
    variants = variant_overrides(config, ablations, peers)
    if only is not None:
        unknown = sorted(set(only) - set(variants))
        if unknown:
            raise ConfigError(
                f"--variants: {', '.join(unknown)} is not one of {', '.join(variants)}"
            )
        variants = {k: v for k, v in variants.items() if k in {*only, BASELINE, ELASTIC}}
    out.mkdir(parents=True, exist_ok=True)  # a refused command leaves nothing behind
    ladder = budgets
    if ladder is None:  # with --peers, DDP's default ladder, unless --variants left DDP out
        wanted = (peers and DDP in variants) or curves is not None
        ladder = default_ladder(config.trainer.epochs) if wanted else []
    every = variant_overrides(config, ablations=False, peers=True)
    for name in curves or [DDP]:
        if name not in variants and name != DDP:
            raise ConfigError(
                f"--curves: {name} is not a variant of this comparison "
                f"({', '.join(variants)}; DDP always may be)"
            )
        own = variants.get(name, every[DDP])
        variants.update(budget_variants(config, ladder, own, name in variants, name))
    # Seed by seed, so that an interrupted comparison leaves whole seeds behind; within a
    # seed in an order that rotates with the seed (compare/order.py), recorded.
    plan = [
        (seed, name, variants[name])
        for seed in seeds or [None]
        for name in (
            list(variants)
            if seed is None
            else record_order(seed_dir(out, seed), rotated_order(list(variants), seed))
        )
    ]
    for index, (seed, name, extra) in enumerate(plan, start=1):
        seeding = [] if seed is None else [f"trainer.seed={seed}"]
        run_dir = out / name if seed is None else seed_dir(out, seed) / name
        label = f"[{index}/{len(plan)}] {variant_title(name)}" + (
            "" if seed is None else f", seed {seed}"
        )
        variant_config = load_config(config_path, [*overrides, *extra, *seeding])
        if not _run_variant(variant_config, name, run_dir, label):
            return 1
    costs = measured_unit_costs(config)
    margin = DEFAULT_MARGIN_POINTS if margin_points is None else margin_points
    context = _context(config, config_path, overrides, ablations, peers, seeds, margin_points, only)
    context["command"] = command or context["command"]
    if command is None and budgets is not None:
        context["command"] += " --budgets " + (",".join(map(str, budgets)) or "none")
    if command is None and curves is not None:
        context["command"] += " --curves " + ",".join(curves)
    if command is None and target is not None:
        context["command"] += f" --target {target:g}"
    context.update(margin_points=margin, target=target)
    if seeds is None:
        runs = {
            name: read_run(out / name)
            for name in variants
            if is_finished(out / name) and budget_of(name) is None
        }
        refused = {name: refusal(out / name) for name in variants if refusal(out / name)}
        context["refused"] = refused
        return _write_outputs(runs, costs, context, config, out)
    return _write_seeded_outputs(costs, context, config, out, margin, seeds)


def _run_variant(variant_config: Config, name: str, run_dir: Path, label: str) -> bool:
    """One variant's run in `run_dir`, unless it finished there earlier (resumed from the
    checkpoint an interrupted run left); False if it failed. Raises CompareStopped on a
    stop signal."""
    if is_finished(run_dir):
        print(f"pipetransformer compare: {label}: finished in {run_dir}, kept", file=sys.stderr)
        return True
    if refusal(run_dir) is not None:
        print(f"pipetransformer compare: {label}: refused earlier, kept", file=sys.stderr)
        return True
    print(f"pipetransformer compare: {label} -> {run_dir}", file=sys.stderr)
    started = time.perf_counter()
    ensure_directory(run_dir)
    lock = RunLock(run_dir).acquire()  # a second compare into the same --out stops here
    outcome, attempts = "failed", None
    try:
        checkpoint = _prepare_variant_dir(run_dir, name)
        if checkpoint is not None:
            print(
                f"pipetransformer compare: {label}: resuming from {checkpoint}, which an "
                "interrupted run left (its training time counts every attempt)",
                file=sys.stderr,
            )
        attempts = start_attempt(run_dir, resumed=checkpoint is not None)
        if name in (HF_TRAINER, TORCH_DDP):
            arguments = (name, variant_config, run_dir)
            launch_local(variant_config.nproc_per_node, run_peer, arguments)
        else:
            options = RunOptions(prepared_checkpoint=str(checkpoint or ""))
            arguments = (variant_config, run_dir, options)
            launch_local(variant_config.nproc_per_node, run_worker, arguments)
        outcome = "finished"
    except LaunchInterrupted as exc:
        outcome = "stopped"
        raise CompareStopped(exc.signum, _stopped_what(name, label, run_dir, exc)) from None
    except WorkerFailed as exc:
        # A peer that cannot fit even sharded is refused in one line, and the comparison goes
        # on without it (planning/context.py's DoesNotFit, the first line of a rank's error).
        reason = str(exc).partition("DoesNotFit: ")[2]
        if reason:
            outcome = "refused"
            write_json_atomic(run_dir / REFUSED, {"reason": reason})
            print(f"pipetransformer compare: {name} refused: {reason}", file=sys.stderr)
            return True
        print(
            f"pipetransformer compare: {name} failed: {exc} (the same command again resumes the "
            "comparison: finished runs are kept)",
            file=sys.stderr,
        )
        return False
    finally:
        if attempts is not None:
            end_attempt(run_dir, attempts, outcome)
        lock.release()
    run = read_run(run_dir)
    print(
        f"pipetransformer compare: {name} done in {time.perf_counter() - started:.0f} s: "
        f"training_time_s {run['training_time_s']:.1f}, "
        f"final {run['metric_name']} {run['final_eval_metric']:.4f}",
        file=sys.stderr,
    )
    return True


class CompareStopped(Exception):
    """A stop signal ended the comparison: `what` says where (the run it stopped and its
    checkpoint, or between runs)."""

    def __init__(self, signum: int, what: str) -> None:
        super().__init__(what)
        self.signum = signum


@contextmanager
def stop_signals_raise(out: Path) -> Iterator[None]:
    """SIGINT and SIGTERM raise CompareStopped while a comparison runs (launch_local forwards
    them to a run's workers while one runs); the handlers before are restored after."""

    def stop(signum: int, frame) -> None:
        raise CompareStopped(
            signum,
            f"stopped by {signal.Signals(signum).name} between runs; the finished ones are "
            f"kept in {out}",
        )

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _prepare_variant_dir(run_dir: Path, name: str) -> Path | None:
    """Make `run_dir` ready for the variant's run; the checkpoint an interrupted run of it
    left, which it resumes from, or None: a run cut short before its first checkpoint, and
    the peers outside this trainer (they keep none), start over."""
    resumable = name not in (HF_TRAINER, TORCH_DDP) and find_checkpoint(run_dir) is not None
    return prepare_run_dir(
        run_dir, resume="required" if resumable else "never", overwrite=not resumable
    )


def _stopped_what(name: str, label: str, run_dir: Path, exc: LaunchInterrupted) -> str:
    """What a stop signal stopped: the run, where it stopped and its checkpoint."""
    if exc.stopped is not None:
        return f"{label}: {exc.stopped}"
    signal_name = signal.Signals(exc.signum).name
    if name in (HF_TRAINER, TORCH_DDP):
        return f"{label}: stopped by {signal_name}; it keeps no checkpoint (it starts over)"
    checkpoint = find_checkpoint(run_dir)
    left = f"its latest checkpoint {checkpoint}" if checkpoint else "no checkpoint (it starts over)"
    return f"{label}: workers killed by a second {signal_name}; {left}"


def rebuild_compare(
    config: Config,
    config_path: str | None,
    overrides: list[str],
    out: Path,
    margin_points: float | None = None,
    target: float | None = None,
) -> int:
    """results.json, report.md and plots again from the variants' run directories in `out`
    (after an upgrade of the report, or when a later variant failed): nothing is rerun. The
    unit costs of an earlier results.json are reused, so the ideal speedup is comparable.
    A comparison over seeds (seed-<s>/ directories) is rebuilt from the seeds that finished;
    the margin and the target are the earlier ones unless `margin_points` or `target` is
    given."""
    seeded = finished_seed_runs(out)
    if seeded:
        found = {name for finished in seeded.values() for name in finished}
        names = [name for name in TITLES if name in found]
        complete = [s for s, finished in seeded.items() if {BASELINE, ELASTIC} <= set(finished)]
        if not complete:
            raise ConfigError(
                f"--report-only: no seed-<s>/ in {out} has finished {BASELINE}/ and {ELASTIC}/ runs"
            )
        elastic_dir = seed_dir(out, complete[0]) / ELASTIC
    else:
        names = [name for name in TITLES if is_finished(out / name)]
        if BASELINE not in names or ELASTIC not in names:
            raise ConfigError(
                f"--report-only: {out} has no finished {BASELINE}/ and {ELASTIC}/ runs "
                "(summary.json)"
            )
        elastic_dir = out / ELASTIC
    # What the elastic run resolved (cache on or off), whatever this invocation's overrides say.
    resolved = elastic_dir / "config.yaml"
    if resolved.is_file():
        config = load_config(str(resolved))
    previous = (
        json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    )
    if margin_points is None:
        margin_points = previous.get("margin_points")
    if target is None:
        target = previous.get("target")
    context = _context(
        config,
        config_path,
        overrides,
        ablations="freeze_only" in names,
        peers=DDP in names,
        seeds=list(seeded) if seeded else None,
        margin_points=margin_points,
    )
    # The command and machine that produced the runs, not this invocation's.
    context.update({key: previous[key] for key in context if key in previous})
    context.update(margin_points=margin_points, target=target)
    costs = previous.get("unit_costs") or measured_unit_costs(config)
    if seeded:
        margin = DEFAULT_MARGIN_POINTS if margin_points is None else margin_points
        return _write_seeded_outputs(costs, context, config, out, margin)
    runs = {name: read_run(out / name) for name in names}
    context["refused"] = {name: r for name in TITLES if (r := refusal(out / name))}
    return _write_outputs(runs, costs, context, config, out)


def _context(
    config: Config,
    config_path: str | None,
    overrides: list[str],
    ablations: bool,
    peers: bool = False,
    seeds: list[int] | None = None,
    margin_points: float | None = None,
    only: list[str] | None = None,
) -> dict[str, Any]:
    options = [*(["--peers"] if peers else []), *(["--ablations"] if ablations else [])]
    if only is not None:
        options += ["--variants", ",".join(only)]
    if seeds is not None:
        options += ["--seeds", ",".join(map(str, seeds))]
    if margin_points is not None:
        options += ["--margin", f"{margin_points:g}"]
    return {
        "config": config_path,
        "config_name": run_name(config_path, config.data),  # one's own data: named after it
        "overrides": overrides,
        "command": shlex.join(
            ["pipetransformer", "compare", config_path or "", *overrides, *options]
        ),
        "machine": machine_description(config),
    }


def _say_where(out: Path) -> None:
    """The last line of a comparison: where its outputs are (the report goes to stdout
    above it, the runs' logs to stderr before it)."""
    print(
        f"pipetransformer compare: report in {out / 'report.md'} (results.json and plots "
        f"beside it; each run in {out}/)",
        file=sys.stderr,
    )


def _write_outputs(
    runs: dict[str, dict[str, Any]],
    costs: dict[str, list[float]] | None,
    context: dict[str, Any],
    config: Config,
    out: Path,
) -> int:
    results = build_results(runs, costs, config.cache.enabled, context)
    plots = write_plots(runs, out)
    metric = runs[BASELINE]["metric_name"]
    extra, extra_plots = _sections(results, out, None, metric, config.trainer.epochs)
    results["plots"] = sorted([*plots, *extra_plots])
    save_results(results, out)
    print(_with_section(write_report(results, out, sorted(plots)), extra, extra_plots, out))
    _say_where(out)
    return 0


def _sections(
    results: dict[str, Any], out: Path, seeds: list[int] | None, metric: str, epochs: int
) -> tuple[list[str], list[str]]:
    """Every run's record into `results`, with the sections read from them: against DDP's
    budget curve (compare/budgets.py), time-to-target and frontier against frontier
    (compare/frontiers.py, at results' margin and target); their lines and plots."""
    records = collect_records(out, seeds)
    lines, plots = add_to_results(results, records, out, seeds, metric)
    margin = results.get("margin_points")
    margin = DEFAULT_MARGIN_POINTS if margin is None else margin
    more, more_plots = frontiers.add_to_results(
        results, records, out, epochs, margin, results.get("target"), metric
    )
    return lines + more, plots + more_plots


def _with_section(report: str, lines: list[str], plots: list[str], out: Path) -> str:
    """report.md with the sections read from every run's record (`_sections`) appended."""
    if not lines and not plots:
        return report
    text = report + "\n".join([*lines, "", *[f"![{p}]({p})" for p in plots]]) + "\n"
    (out / "report.md").write_text(text)
    return text


def _write_seeded_outputs(
    costs: dict[str, list[float]] | None,
    context: dict[str, Any],
    config: Config,
    out: Path,
    margin_points: float,
    seeds: list[int] | None = None,
) -> int:
    """The outputs of a comparison over seeds, from the runs that finished in `out` (of
    `seeds`; None: of every seed there): the statistics over the seeds, and in detail the
    first seed that has baseline and elastic."""
    finished = finished_seed_runs(out)
    runs_by_seed = {
        seed: {name: read_run(seed_dir(out, seed) / name) for name in names}
        for seed, names in finished.items()
        if names and (seeds is None or seed in seeds)
    }
    detail = next(s for s, runs in runs_by_seed.items() if BASELINE in runs and ELASTIC in runs)
    seed_runs = [
        read_seed_run(seed_dir(out, seed) / name, name, seed)
        for seed, runs in runs_by_seed.items()
        for name in runs
    ]
    stats = seeded_stats(seed_runs, BASELINE, margin_points, peer=DDP, subject=ELASTIC)
    context["refused"] = {
        name: reason
        for seed in runs_by_seed
        for name in TITLES
        if (reason := refusal(seed_dir(out, seed) / name))
    }
    results = build_results(runs_by_seed[detail], costs, config.cache.enabled, context)
    results.update(detail_seed=detail, margin_points=margin_points, seeded=stats.to_dict())
    plots = write_seeded_plots(runs_by_seed, stats, detail, out)
    metric = runs_by_seed[detail][BASELINE]["metric_name"]
    seeds_done = list(runs_by_seed)
    extra, extra_plots = _sections(results, out, seeds_done, metric, config.trainer.epochs)
    results["plots"] = sorted([*plots, *extra_plots])
    save_results(results, out)
    report = write_report(results, out, sorted(plots), stats)
    print(_with_section(report, extra, extra_plots, out))
    _say_where(out)
    return 0
