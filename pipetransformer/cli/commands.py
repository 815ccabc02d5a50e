"""What each subcommand does with its parsed flags: `train` (local workers, or this process
under torchrun), `plan` (the table, or `--predict`), `compare` and `export`. Each loads
the config and checks what it can (preflight.py) before any process starts.

Owns: the `cmd_*` handlers, the default run directory, the closing and resume lines.
Must not: define flags (parser.py) or map errors to exit codes (the package's `main`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
import uuid
from pathlib import Path

from pipetransformer.cli.preflight import preflight, resolve_model_settings
from pipetransformer.config import (
    Config,
    ConfigError,
    load_config,
    pretrained_settings,
    read_config_data,
)

logger = logging.getLogger("pipetransformer.cli")
_STARTED = time.monotonic()  # when this command began (its imports are before)


def _default_run_dir(
    config_path: str | None, config: Config, prefix: str = "runs", run_id: str | None = None
) -> Path:
    """runs/<name>-<time> (data/sources.py's `run_name`: one's own data, else the config);
    under torchrun runs/<name>-<rendezvous id>, the same for every node and across restarts
    (torchrun keeps the id), so a restarted worker finds its run."""
    from pipetransformer.data.sources import run_name

    stem = run_name(config_path, config.data)
    return Path(prefix) / f"{stem}-{run_id or time.strftime('%Y%m%d-%H%M%S')}"


def say_resolved_settings(config_path: str | None, overrides: list[str], notes: list[str]) -> None:
    """The settings this run takes from what it is rather than from the file's values, in one
    line on the reporting process: the config's when_pretrained settings where the weights
    are trained (config/loader.py), and `notes` (cli/preflight.py `resolve_model_settings`)."""
    parts = [
        f"{key} {json.dumps(value)} (random weights: {json.dumps(before)})"
        for key, value, before in pretrained_settings(config_path, overrides)
    ]
    if parts:
        parts[0] = (
            f"the config's when_pretrained settings, as pretrained weights are named: {parts[0]}"
        )
    parts += notes
    if parts and os.environ.get("RANK", "0") == "0":
        print(f"pipetransformer: {'; '.join(parts)}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> int:
    from pipetransformer.launcher import under_torchrun

    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"trainer.nproc_per_node={args.nproc}")
    if under_torchrun():
        overrides += _processes_per_node_from_torchrun(args.config, overrides)
    config = load_config(args.config, overrides)
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if args.resume and args.run_dir and Path(args.run_dir) != Path(args.resume):
        raise ConfigError(
            "--resume RUN_DIR continues in RUN_DIR: leave out --run-dir or give the same directory"
        )
    if args.resume:  # before anything is created or locked in it
        from pipetransformer.runs.rundir import check_resumable

        check_resumable(Path(args.resume))
    config, _, notes = resolve_model_settings(preflight(config))
    say_resolved_settings(args.config, overrides, notes)
    resume = "required" if args.resume else config.trainer.resume
    run_dir = Path(
        args.resume
        or args.run_dir
        or _default_run_dir(args.config, config, run_id=os.environ.get("TORCHELASTIC_RUN_ID"))
    )
    resume_line = shlex.join(["pipetransformer", *_train_arguments(args), "--resume", str(run_dir)])
    if under_torchrun():
        code = _train_under_torchrun(config, run_dir, resume, args.overwrite, resume_line)
    else:
        code = _train_locally(config, run_dir, resume, args.overwrite, resume_line)
    if code == 0 and os.environ.get("RANK", "0") == "0":
        if config.trainer.save_model:
            _export_trained(run_dir)
        _print_closing_line(run_dir)
    return code


def _processes_per_node_from_torchrun(config_path: str, overrides: list[str]) -> list[str]:
    """Under torchrun, torchrun says how many processes each node runs (LOCAL_WORLD_SIZE):
    that number overrules trainer.nproc_per_node (and --nproc) before the config is
    checked. A different configured number is a warning, printed once (global rank 0)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        return []
    trainer = read_config_data(config_path, overrides).get("trainer") or {}
    configured = trainer.get("nproc_per_node") if isinstance(trainer, dict) else None
    if configured is not None and str(configured) != local and os.environ.get("RANK") == "0":
        print(
            f"pipetransformer: warning: trainer.nproc_per_node is {configured} but torchrun "
            f"started {local} processes per node: using {local}",
            file=sys.stderr,
        )
    return [f"trainer.nproc_per_node={local}"]


def _export_trained(run_dir: Path) -> None:
    """trainer.save_model: the final checkpoint's model to RUN_DIR/export, as its library
    loads it (one process, after training)."""
    from pipetransformer.export import export_run

    checkpoint, files = export_run(run_dir, run_dir / "export")
    print(
        f"pipetransformer: exported {checkpoint} to {run_dir / 'export'}: {', '.join(files)}",
        file=sys.stderr,
    )


def _train_arguments(args: argparse.Namespace) -> list[str]:
    """The command line of this run, less its run-directory options (to print how to resume)."""
    words = ["train", args.config, *args.overrides]
    if args.nproc is not None:
        words += ["--nproc", str(args.nproc)]
    return words


def _train_locally(
    config: Config, run_dir: Path, resume: str, overwrite: bool, resume_line: str
) -> int:
    """Start the local workers; restart them from the latest checkpoint when one dies
    (trainer.max_restarts); turn a Ctrl-C or SIGTERM into a checkpoint and a resume line."""
    from pipetransformer.launcher import LaunchInterrupted, WorkerFailed, launch_local
    from pipetransformer.runs.checkpoint import read_run_state
    from pipetransformer.runs.resume import refuse_mid_epoch_changes
    from pipetransformer.runs.rundir import (
        RunDirError,
        RunLock,
        ensure_directory,
        prepare_run_dir,
    )
    from pipetransformer.trainer import RunOptions, run_worker
    from pipetransformer.utils.stopping import exit_code_for

    ensure_directory(run_dir)
    lock = RunLock(run_dir).acquire()  # before looking inside: a second run must not touch it
    try:
        try:
            checkpoint = prepare_run_dir(run_dir, resume=resume, overwrite=overwrite)
            if checkpoint is not None:  # one line here rather than a failed worker
                record = read_run_state(checkpoint)
                refuse_mid_epoch_changes(record.config, config, record.state, checkpoint)
        except (RunDirError, ValueError):  # ConfigError, an unreadable run state
            lock.release(remove=True)  # refused: leave the directory as it was
            raise
        nproc = config.nproc_per_node
        start = f"from {checkpoint}" if checkpoint else "from the start"
        print(
            f"pipetransformer: training on {nproc} local process(es) {start}; "
            f"run directory {run_dir} (starting the workers: each imports torch, timm and "
            "transformers, a few seconds)",
            file=sys.stderr,
        )
        run_id = uuid.uuid4().hex
        restarts = 0
        first_failure = None
        while True:
            options = RunOptions(
                restart=restarts > 0,
                run_id=run_id,
                prepared_checkpoint=str(checkpoint) if checkpoint else "",
            )
            try:
                launch_local(nproc, run_worker, (config, run_dir, options))
                break
            except LaunchInterrupted as exc:
                if exc.stopped is None:
                    print(
                        f"pipetransformer: {_killed_report(run_dir, resume_line)}", file=sys.stderr
                    )
                else:
                    print(
                        f"pipetransformer: {exc.stopped}. Resume with: {resume_line}",
                        file=sys.stderr,
                    )
                return exit_code_for(exc.signum)
            except WorkerFailed as exc:
                first_failure = first_failure or str(exc)
                if restarts >= config.trainer.max_restarts:
                    after = (
                        f" (gave up after {restarts} restarts; first failure: {first_failure})"
                        if restarts
                        else ""
                    )
                    print(
                        f"pipetransformer: a worker process failed ({exc}){after}"
                        f"{_resume_hint(run_dir, resume_line)}",
                        file=sys.stderr,
                    )
                    return 1
                restarts += 1
                checkpoint = prepare_run_dir(
                    run_dir, resume="auto", overwrite=False, restart=True, run_id=run_id
                )
                start = f"from {checkpoint}" if checkpoint else "from the start (no checkpoint yet)"
                print(
                    f"pipetransformer: a worker process failed ({exc}); restart {restarts} of "
                    f"{config.trainer.max_restarts} {start}",
                    file=sys.stderr,
                )
    finally:
        lock.release()
    return 0


def _print_closing_line(run_dir: Path) -> None:
    """The run's one closing line (summary.json holds the figures)."""
    from pipetransformer.runs.records import RunSummary

    path = run_dir / "summary.json"
    if path.exists():
        summary = RunSummary.from_dict(json.loads(path.read_text()))
        total_s = time.monotonic() - _STARTED
        print(f"pipetransformer: {summary.closing_line(str(run_dir), total_s)}", file=sys.stderr)


def _resume_hint(run_dir: Path, resume_line: str) -> str:
    """'. Resume with: ...' when the run has a complete checkpoint to resume from."""
    from pipetransformer.runs.checkpoint import find_checkpoint

    return f". Resume with: {resume_line}" if find_checkpoint(run_dir) is not None else ""


def _killed_report(run_dir: Path, resume_line: str) -> str:
    """What a second Ctrl-C (the workers killed at once) left: the newest complete
    checkpoint, which may be the one the first Ctrl-C asked for, and how to resume it."""
    from pipetransformer.runs.checkpoint import find_checkpoint, read_run_state

    checkpoint = find_checkpoint(run_dir)
    if checkpoint is None:
        return (
            f"interrupted again: workers killed before any checkpoint was complete; nothing in "
            f"{run_dir} to resume (start again with --overwrite, or another --run-dir)"
        )
    try:
        record = read_run_state(checkpoint)
        written = f"after global step {record.state.global_step}, {record.reason or 'saved'}"
    except ValueError:
        written = "complete"
    return (
        f"interrupted again: workers killed; the latest complete checkpoint is {checkpoint} "
        f"({written}). Resume with: {resume_line}"
    )


def _train_under_torchrun(
    config: Config, run_dir: Path, resume: str, overwrite: bool, resume_line: str
) -> int:
    """This process is one worker; torchrun restarts workers (--max-restarts): a restarted
    worker continues from the latest checkpoint by itself."""
    from pipetransformer.runs.checkpoint import CheckpointWriteError
    from pipetransformer.runs.rundir import RunDirError
    from pipetransformer.trainer import RunOptions, run_worker
    from pipetransformer.utils.stopping import RunStopped, exit_code_for

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    options = RunOptions(
        resume=resume,
        overwrite=overwrite and not restart,
        restart=restart,
        run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
    )
    rank0 = os.environ.get("RANK", "0") == "0"
    if config.trainer.max_restarts and rank0:
        logger.warning(
            "trainer.max_restarts applies to local runs; under torchrun pass --max-restarts "
            "(MAX_RESTARTS for launch/)"
        )
    try:
        run_worker(config, run_dir, options)
    except RunStopped as stopped:
        if rank0:
            print(f"pipetransformer: {stopped}. Resume with: {resume_line}", file=sys.stderr)
        return exit_code_for(stopped.signum)
    except RunDirError as exc:  # every rank learns it; one says it
        if rank0:
            print(f"pipetransformer: {exc}", file=sys.stderr)
        return 2
    except CheckpointWriteError as exc:  # every rank of a DCP write learns it; one says it
        if rank0:
            print(f"pipetransformer: {exc}{_resume_hint(run_dir, resume_line)}", file=sys.stderr)
        return 1
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pipetransformer.planning.table import format_plan_table, plan_table

    config, _, notes = resolve_model_settings(load_config(args.config, args.overrides))
    say_resolved_settings(args.config, args.overrides, notes)
    if args.predict:
        return _predict(config, args)
    rows = plan_table(config)
    print(
        json.dumps([row.to_dict() for row in rows], indent=2)
        if args.json
        else format_plan_table(config, rows)
    )
    return 0


def _predict(config: Config, args: argparse.Namespace) -> int:
    from pipetransformer.planning.predict import predict
    from pipetransformer.planning.prediction_inputs import (
        cluster_from_flags,
        prediction_unit_times,
        train_samples_for,
    )
    from pipetransformer.planning.prediction_report import format_prediction

    cluster = cluster_from_flags(
        args.nodes,
        args.devices_per_node or config.nproc_per_node,
        device_name=args.device,
        intra_node=args.intra_node,
        inter_node=args.inter_node,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
    )
    chosen = prediction_unit_times(config, cluster, args.profile, args.memory_gbps)
    if args.train_samples:
        samples, samples_source = args.train_samples, "--train-samples"
    else:
        samples, samples_source = train_samples_for(config)
    result = predict(
        config,
        chosen.profile,
        cluster,
        samples,
        args.trajectory,
        chosen.times,
        spec=chosen.spec,
        unit_profile_source=chosen.source,
        steps_per_epoch_source=samples_source,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_prediction(result))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from pipetransformer.compare import (
        CompareRequest,
        CompareStopped,
        rebuild_compare,
        run_compare,
        stop_signals_raise,
    )
    from pipetransformer.utils.stopping import exit_code_for

    config = load_config(args.config, args.overrides)
    seeds = list(range(args.repeats)) if args.repeats is not None else args.seeds
    if args.margin is not None and args.margin < 0:
        raise ConfigError(f"--margin: {args.margin} is negative (metric points a variant may lose)")
    if args.report_only:
        if not args.out:
            raise ConfigError("--report-only needs --out DIR: the directory of an earlier compare")
        if seeds is not None or args.budgets is not None or args.curves is not None:
            raise ConfigError(
                "--report-only reads the seeds and budgets from the directories in --out: "
                "leave out --seeds/--repeats/--budgets/--curves"
            )
        out = Path(args.out)
        request = CompareRequest(
            args.config, out, list(args.overrides), margin_points=args.margin, target=args.target
        )
        return rebuild_compare(config, request)
    config, found, notes = resolve_model_settings(preflight(config))
    say_resolved_settings(args.config, list(args.overrides), notes)
    if config.data.name in ("hf", "hf_image"):  # every variant trains with what was found once
        if config.data.name == "hf":
            found.append(f"data.task={config.data.task}")
        if config.data.labels is not None:
            found.append(f"data.labels={json.dumps(config.data.label_names)}")
    request = CompareRequest(
        args.config,
        Path(args.out) if args.out else _default_run_dir(args.config, config, "runs/compare"),
        list(args.overrides),
        ablations=args.ablations,
        peers=args.peers,
        seeds=seeds,
        margin_points=args.margin,
        only=args.variants,
        budgets=args.budgets,
        curves=args.curves,
        target=args.target,
        found=found,
    )
    try:
        with stop_signals_raise(request.out):
            return run_compare(config, request)
    except CompareStopped as stopped:  # one line; the run's checkpoint is where it says
        print(
            f"pipetransformer compare: {stopped}. Resume with: {request.command_line()}",
            file=sys.stderr,
        )
        return exit_code_for(stopped.signum)


def cmd_export(args: argparse.Namespace) -> int:
    from pipetransformer.export import export_run

    checkpoint, files = export_run(Path(args.run_dir), Path(args.out), args.checkpoint)
    print(
        f"pipetransformer: exported {checkpoint} to {args.out}: {', '.join(files)}", file=sys.stderr
    )
    return 0
