"""Command line: `pipetransformer train | plan | compare CONFIG [key.sub=value ...]`.

Everything that can be checked before a process starts is checked here (config keys, types,
values, data paths, model construction on the meta device), so a mistake is one clear line,
not a stack trace from each of N workers.
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

from pipetransformer.config import Config, ConfigError, load_config, read_config_data

logger = logging.getLogger("pipetransformer.cli")
_STARTED = time.monotonic()  # when this command began (its imports are before)


def _default_run_dir(
    config_path: str | None, prefix: str = "runs", run_id: str | None = None
) -> Path:
    """runs/<config>-<time>; under torchrun runs/<config>-<rendezvous id>, the same for every
    node and across restarts (torchrun keeps the id), so a restarted worker finds its run."""
    stem = Path(config_path).stem if config_path else "default"
    return Path(prefix) / f"{stem}-{run_id or time.strftime('%Y%m%d-%H%M%S')}"


def preflight(config: Config) -> Config:
    """Checks that need more than the config itself, before any worker starts; raise
    ConfigError naming the key or the file. Fetches datasets from the network (once: the
    workers find them on disk) and parses local data files, so bad contents are one line
    here rather than one traceback per worker. Returns the config the run is to train
    with: `config` with the label names and task of a data.name 'hf' or 'hf_image' table
    written in (data.labels, data.task), so the run keeps them."""
    import dataclasses

    from pipetransformer.data.checks import check_data_config
    from pipetransformer.data.fetch import fetch_data
    from pipetransformer.data.validate import validate_data_files
    from pipetransformer.planning import describe_model

    check_devices(config)
    check_data_config(config.data)
    labelled = config.data.name in ("hf", "hf_image")  # its head's size is read from the data
    if not labelled:
        describe_model(config)  # builds the model on the meta device: bad names/kwargs fail here
    fetch_data(config.data)
    config = dataclasses.replace(config, data=validate_data_files(config.data))
    if labelled:
        check_head_fits_labels(config)
        describe_model(config)
    check_metric_fits_classes(config)
    return config


def check_metric_fits_classes(config: Config) -> None:
    """data.metric must score the data's task (pearson/spearman a regression, the others a
    classifier), and 'f1' is binary F1 (of class 1): two classes; else a ConfigError."""
    from pipetransformer.config import REGRESSION_METRICS
    from pipetransformer.data.checks import data_facts

    facts = data_facts(config.data)
    metric = config.data.metric
    if metric == "auto":
        return
    if facts.task not in ("classification", "regression") or (
        (metric in REGRESSION_METRICS) != (facts.task == "regression")
    ):
        choices = "pearson, spearman" if facts.task == "regression" else "accuracy, f1_macro, mcc"
        raise ConfigError(f"data.metric: '{metric}' does not score a {facts.task} ({choices})")
    if metric == "f1" and facts.num_classes != 2:
        names = config.data.label_names
        raise ConfigError(
            f"data.metric: 'f1' is binary F1; the data has {facts.num_classes} classes"
            f"{f' {names}' if names else ''}: use f1_macro (or accuracy, mcc)"
        )


def check_head_fits_labels(config: Config) -> None:
    """A classifier head the model config fixes (model.kwargs num_labels or id2label, timm's
    num_classes, or a fine-tuned sequence-classification checkpoint) must have one output
    per label."""
    labels = config.data.label_names or []
    kwargs = config.model.kwargs
    sizes = []
    for key in ("num_labels", "num_classes"):
        if key in kwargs:
            sizes.append((f"model.kwargs.{key}", int(kwargs[key])))
    if "id2label" in kwargs:
        sizes.append(("model.kwargs.id2label", len(kwargs["id2label"])))
    path = config.model.model_name_or_path
    saved = Path(path).expanduser() / "config.json" if path else None
    if saved is not None and saved.is_file():
        fields = json.loads(saved.read_text())
        fine_tuned = any(
            a.endswith("ForSequenceClassification") for a in fields.get("architectures") or []
        )
        if fine_tuned and "id2label" in fields:
            sizes.append((f"model.model_name_or_path ({saved})", len(fields["id2label"])))
    regression = config.data.task == "regression"
    for key, size in sizes:
        if regression and size != 1:
            raise ConfigError(f"{key}: a head of {size} outputs, but a regression has one")
        if not regression and size != len(labels):
            raise ConfigError(
                f"{key}: a head of {size} outputs, but the data has {len(labels)} labels "
                f"{labels} (data.labels, or the training split's)"
            )


def check_devices(config: Config) -> None:
    """More processes on a node than visible GPUs would put two ranks on one GPU, which NCCL
    refuses (raises ConfigError naming trainer.nproc_per_node); bf16 on a GPU older than
    Ampere (the paper's Turing Quadro) is emulated or refused (ConfigError naming
    trainer.precision)."""
    import torch

    from pipetransformer.trainer.distributed import (
        check_visible_gpus,
        cuda_unusable_reason,
        uses_cuda,
    )

    if config.trainer.device == "cuda" and not torch.cuda.is_available():
        reason = cuda_unusable_reason() or "no GPU is visible"
        raise ConfigError(
            f"trainer.device: 'cuda' but CUDA is unusable here ({reason}); set "
            "trainer.device=cpu to train on CPU processes"
        )
    if config.trainer.device != "cpu" and uses_cuda(config.trainer.device):
        check_visible_gpus(config.nproc_per_node, torch.cuda.device_count())
        major, minor = torch.cuda.get_device_capability(0)
        if config.trainer.precision == "bf16" and major < 8:  # bfloat16 needs Ampere or later
            raise ConfigError(
                f"trainer.precision: bf16 but {torch.cuda.get_device_name(0)} (compute "
                f"capability {major}.{minor}) has no bfloat16 support; set "
                "trainer.precision=fp16 or fp32"
            )


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
        from pipetransformer.trainer.rundir import check_resumable

        check_resumable(Path(args.resume))
    config = preflight(config)
    resume = "required" if args.resume else config.trainer.resume
    run_dir = Path(
        args.resume
        or args.run_dir
        or _default_run_dir(args.config, run_id=os.environ.get("TORCHELASTIC_RUN_ID"))
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
    from pipetransformer.trainer import RunOptions, run_worker
    from pipetransformer.trainer.rundir import (
        RunDirError,
        RunLock,
        ensure_directory,
        prepare_run_dir,
    )
    from pipetransformer.utils.stopping import exit_code_for

    ensure_directory(run_dir)
    lock = RunLock(run_dir).acquire()  # before looking inside: a second run must not touch it
    try:
        try:
            checkpoint = prepare_run_dir(run_dir, resume=resume, overwrite=overwrite)
        except RunDirError:
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
    from pipetransformer.trainer.records import RunSummary

    path = run_dir / "summary.json"
    if path.exists():
        summary = RunSummary.from_dict(json.loads(path.read_text()))
        total_s = time.monotonic() - _STARTED
        print(f"pipetransformer: {summary.closing_line(str(run_dir), total_s)}", file=sys.stderr)


def _resume_hint(run_dir: Path, resume_line: str) -> str:
    """'. Resume with: ...' when the run has a complete checkpoint to resume from."""
    from pipetransformer.trainer.checkpoint import find_checkpoint

    return f". Resume with: {resume_line}" if find_checkpoint(run_dir) is not None else ""


def _killed_report(run_dir: Path, resume_line: str) -> str:
    """What a second Ctrl-C (the workers killed at once) left: the newest complete
    checkpoint, which may be the one the first Ctrl-C asked for, and how to resume it."""
    from pipetransformer.trainer.checkpoint import find_checkpoint, read_run_state

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
    from pipetransformer.trainer import RunOptions, run_worker
    from pipetransformer.trainer.checkpoint import CheckpointWriteError
    from pipetransformer.trainer.rundir import RunDirError
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

    config = load_config(args.config, args.overrides)
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
    from pipetransformer.compare import rebuild_compare, run_compare

    config = load_config(args.config, args.overrides)
    seeds = list(range(args.repeats)) if args.repeats is not None else args.seeds
    if args.margin is not None and args.margin < 0:
        raise ConfigError(f"--margin: {args.margin} is negative (metric points a variant may lose)")
    if args.report_only:
        if not args.out:
            raise ConfigError("--report-only needs --out DIR: the directory of an earlier compare")
        if seeds is not None:
            raise ConfigError(
                "--report-only reads the seeds from the seed-<s>/ directories in --out: "
                "leave out --seeds/--repeats"
            )
        return rebuild_compare(config, args.config, args.overrides, Path(args.out), args.margin)
    if args.margin is not None and seeds is None:
        raise ConfigError("--margin judges differences over seeds: give --seeds or --repeats")
    config = preflight(config)
    overrides = list(args.overrides)
    if config.data.name in ("hf", "hf_image"):  # every variant trains with what was found once
        if config.data.name == "hf":
            overrides.append(f"data.task={config.data.task}")
        if config.data.labels is not None:
            overrides.append(f"data.labels={json.dumps(config.data.label_names)}")
    out = Path(args.out) if args.out else _default_run_dir(args.config, "runs/compare")
    return run_compare(
        config,
        args.config,
        overrides,
        out,
        ablations=args.ablations,
        peers=args.peers,
        seeds=seeds,
        margin_points=args.margin,
        only=args.variants,
    )


def _seed_list(text: str) -> list[int]:
    """--seeds 0,1,2: distinct integers."""
    try:
        seeds = [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': not integers, comma-separated") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"'{text}': give distinct seeds, at least one")
    return seeds


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive integer")
    return value


def cmd_export(args: argparse.Namespace) -> int:
    from pipetransformer.export import export_run

    checkpoint, files = export_run(Path(args.run_dir), Path(args.out), args.checkpoint)
    print(
        f"pipetransformer: exported {checkpoint} to {args.out}: {', '.join(files)}", file=sys.stderr
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipetransformer",
        description="Elastic freeze training of Transformers (PipeTransformer) on PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="YAML config file (see configs/)")
        p.add_argument(
            "overrides", nargs="*", help="overrides such as trainer.epochs=3 freeze.alpha=0.5"
        )

    train = sub.add_parser(
        "train", help="train a model (starts local workers unless under torchrun)"
    )
    common(train)
    train.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local worker processes (default: trainer.nproc_per_node)",
    )
    train.add_argument(
        "--run-dir", default=None, help="output directory (default: runs/<config>-<time>)"
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue the run in RUN_DIR from its latest checkpoint (at any number of processes)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run directory that holds a run (deletes its outputs)",
    )
    train.set_defaults(func=cmd_train)

    plan = sub.add_parser(
        "plan", help="print the layout AutoPipe would choose at each frozen boundary"
    )
    common(plan)
    plan.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    predict = plan.add_argument_group(
        "prediction (--predict): step times and the run's speedup over Pipe+DDP"
    )
    predict.add_argument(
        "--predict", action="store_true", help="predict step times and the speedup on a cluster"
    )
    predict.add_argument("--nodes", type=int, default=1, help="nodes of the cluster (default 1)")
    predict.add_argument(
        "--devices-per-node", type=int, default=None, help="default: trainer.nproc_per_node"
    )
    predict.add_argument(
        "--profile",
        default=None,
        help="profile file with this model's unit profile (default: the runs')",
    )
    predict.add_argument(
        "--trajectory",
        default="auto",
        help="'auto' (the config's freeze rule and cadence, replayed as the trainer decides; "
        "gradient rules at their bound), 'paper' (Eq. 1's bound at every epoch end) or F per "
        "epoch: 0,0,2,4",
    )
    predict.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="training samples an epoch; default: the training data on disk, else the "
        "dataset's published size",
    )
    predict.add_argument(
        "--device",
        metavar="NAME",
        default=None,
        help="a device of planning/hardware.yaml (e.g. quadro-rtx-5000): without a profile "
        "measured on one, unit times from the model's analytical profile and a roofline; "
        "its memory is the stage budget",
    )
    predict.add_argument(
        "--intra-node",
        metavar="LINK",
        default=None,
        help="the link between devices of a node, from hardware.yaml (e.g. pcie3-x16)",
    )
    predict.add_argument(
        "--inter-node",
        metavar="LINK",
        default=None,
        help="the link between nodes, from hardware.yaml (e.g. infiniband-edr)",
    )
    predict.add_argument(
        "--intra-node-gbps",
        type=float,
        default=None,
        help="GB/s between devices of a node, instead of --intra-node (default 150)",
    )
    predict.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        help="GB/s between nodes, instead of --inter-node (default 25)",
    )
    predict.add_argument(
        "--memory-gbps",
        type=float,
        default=None,
        help="a device's memory bandwidth, GB/s, without --device (default 2000)",
    )
    plan.set_defaults(func=cmd_plan)

    compare = sub.add_parser(
        "compare", help="baseline (Pipe+DDP) vs elastic run: speedup, accuracy, plots"
    )
    common(compare)
    compare.add_argument(
        "--ablations", action="store_true", help="also run freeze-only, no-AutoDP and no-cache"
    )
    compare.add_argument(
        "--peers",
        action="store_true",
        help="also run what users run instead: ddp (K=1, no freezing), "
        "freeze-ddp (K=1, freezing and AutoCache), fsdp (FSDP2 over every process, no "
        "freezing) and freeze-fsdp (FSDP2, freezing and AutoCache)",
    )
    compare.add_argument(
        "--variants",
        type=lambda text: [w.strip() for w in text.split(",") if w.strip()],
        default=None,
        metavar="NAME,...",
        help="run only these of the variants (baseline and elastic always run), e.g. "
        "--peers --variants fsdp,freeze_fsdp where DDP's replica does not fit a device",
    )
    seeding = compare.add_mutually_exclusive_group()
    seeding.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        metavar="S,S,...",
        help="run every variant once per seed (trainer.seed), in OUT/seed-<s>/<variant>/; "
        "the report adds mean ± std and paired statistics over the seeds",
    )
    seeding.add_argument(
        "--repeats", type=_positive_int, default=None, metavar="N", help="as --seeds 0,...,N-1"
    )
    compare.add_argument(
        "--margin",
        type=float,
        default=None,
        metavar="POINTS",
        help="non-inferiority margin in metric points (default 1.0): a variant is 'not worse' "
        "when the 95%% interval of its difference to the baseline lies above -POINTS",
    )
    compare.add_argument(
        "--out", default=None, help="output directory (default: runs/compare/<config>-<time>)"
    )
    compare.add_argument(
        "--report-only",
        action="store_true",
        help="rerun nothing: rebuild results.json, report.md and plots "
        "from the runs already in --out",
    )
    compare.set_defaults(func=cmd_compare)

    export = sub.add_parser(
        "export",
        help="write a run's trained model as transformers / timm load it (from a checkpoint)",
    )
    export.add_argument("run_dir", help="the run directory (holds checkpoints/)")
    export.add_argument(
        "--checkpoint", choices=["latest", "best"], default="latest", help="which checkpoint"
    )
    export.add_argument("--out", required=True, help="output directory")
    export.set_defaults(func=cmd_export)
    return parser


def entry() -> None:
    """The `pipetransformer` command and `python -m pipetransformer`: main(), then an exit
    that skips the interpreter's finalization. Finalizing a process that imported torch,
    timm and transformers runs full collections over every module's objects: seconds on
    a busy machine, after the run has written everything (a stopped run took 8 s to exit
    after its checkpoint). Everything the run owns is closed before main() returns."""
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    _release_and_exit(code)


def _release_and_exit(code: int) -> None:
    """What interpreter finalization would do that matters outside the process: flush the
    streams and run multiprocessing's finalizers (they release the named semaphores the
    libraries create, which the resource tracker otherwise reports as leaked)."""
    import multiprocessing.util

    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    from pipetransformer.utils.logging import setup_logging

    setup_logging(rank="-")
    parser = build_parser()
    # Overrides may come before or after options (`train CONFIG --nproc 2 a.b=1`).
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    from pipetransformer.trainer.rundir import RunDirError

    # Exit codes: 0 done, 1 a failure during training, 2 bad input found before training,
    # 128 + signal for a run stopped by SIGINT (130) or SIGTERM (143).
    try:
        code = args.func(args)
    except ConfigError as exc:
        print(f"pipetransformer: config error: {exc}", file=sys.stderr)
        code = 2
    except RunDirError as exc:
        print(f"pipetransformer: {exc}", file=sys.stderr)
        code = 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"pipetransformer: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # before any worker started: nothing to save
        print("pipetransformer: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # e.g. `pipetransformer plan ... | head`
        code = 0
    sys.exit(code)
