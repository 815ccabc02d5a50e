"""Command line: `pipetransformer train | plan | compare CONFIG [key.sub=value ...]`.

Everything that can be checked before a process starts is checked here (config keys, types,
values, data paths, model construction on the meta device), so a mistake is one clear line,
not a stack trace from each of N workers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from pipetransformer.config import Config, ConfigError, load_config

logger = logging.getLogger("pipetransformer.cli")


def _default_run_dir(config_path: str | None, prefix: str = "runs") -> Path:
    stem = Path(config_path).stem if config_path else "default"
    return Path(prefix) / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def preflight(config: Config) -> None:
    """Checks that need more than the config itself; raise ConfigError naming the key."""
    from pipetransformer.data.checks import check_data_config
    from pipetransformer.trainer.planning import describe_model

    check_data_config(config.data)
    describe_model(config)  # builds the model on the meta device: bad names/kwargs fail here


def cmd_train(args: argparse.Namespace) -> int:
    from pipetransformer.launcher import WorkerFailed, launch_local, under_torchrun
    from pipetransformer.trainer import run_worker

    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"trainer.nproc_per_node={args.nproc}")
    config = load_config(args.config, overrides)
    preflight(config)
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(args.config)
    if under_torchrun():
        run_worker(config, run_dir)
        return 0
    nproc = config.nproc_per_node
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"pipetransformer: training on {nproc} local process(es); run directory {run_dir}", file=sys.stderr)
    try:
        launch_local(nproc, run_worker, (config, run_dir))
    except WorkerFailed as exc:
        print(f"pipetransformer: {exc}", file=sys.stderr)
        return 1
    summary = run_dir / "summary.json"
    if summary.exists():
        print(summary.read_text().strip())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pipetransformer.trainer.planning import plan_table

    config = load_config(args.config, args.overrides)
    rows = plan_table(config)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from pipetransformer.trainer.planning import format_plan_table

    print(format_plan_table(config, rows))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from pipetransformer.compare import rebuild_compare, run_compare

    config = load_config(args.config, args.overrides)
    if args.report_only:
        if not args.out:
            raise ConfigError("--report-only needs --out DIR: the directory of an earlier compare")
        return rebuild_compare(config, args.config, args.overrides, Path(args.out))
    preflight(config)
    out = Path(args.out) if args.out else _default_run_dir(args.config, "runs/compare")
    return run_compare(config, args.config, args.overrides, out, ablations=args.ablations)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipetransformer",
        description="Elastic freeze training of Transformers (PipeTransformer) on PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="YAML config file (see configs/)")
        p.add_argument("overrides", nargs="*", help="overrides such as trainer.epochs=3 freeze.alpha=0.5")

    train = sub.add_parser("train", help="train a model (starts local workers unless under torchrun)")
    common(train)
    train.add_argument("--nproc", type=int, default=None, help="local worker processes (default: trainer.nproc_per_node)")
    train.add_argument("--run-dir", default=None, help="output directory (default: runs/<config>-<time>)")
    train.set_defaults(func=cmd_train)

    plan = sub.add_parser("plan", help="print the layout AutoPipe would choose at each frozen boundary")
    common(plan)
    plan.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    plan.set_defaults(func=cmd_plan)

    compare = sub.add_parser("compare", help="baseline (Pipe+DDP) vs elastic run: speedup, accuracy, plots")
    common(compare)
    compare.add_argument("--ablations", action="store_true", help="also run freeze-only, no-AutoDP and no-cache")
    compare.add_argument("--out", default=None, help="output directory (default: runs/compare/<config>-<time>)")
    compare.add_argument(
        "--report-only", action="store_true",
        help="rerun nothing: rebuild results.json, report.md and plots from the runs already in --out",
    )
    compare.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> None:
    from pipetransformer.utils.logging import setup_logging

    setup_logging(rank="-")
    parser = build_parser()
    # Overrides may come before or after options (`train CONFIG --nproc 2 a.b=1`).
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    try:
        code = args.func(args)
    except ConfigError as exc:
        print(f"pipetransformer: config error: {exc}", file=sys.stderr)
        code = 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"pipetransformer: error: {exc}", file=sys.stderr)
        code = 2
    except BrokenPipeError:  # e.g. `pipetransformer plan ... | head`
        code = 0
    sys.exit(code)
