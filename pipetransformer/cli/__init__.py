"""Command line: `pipetransformer train | plan | compare | export CONFIG [key.sub=value ...]`.

Everything that can be checked before a process starts is checked (config keys, types,
values, data paths, model construction on the meta device: preflight.py), so a mistake is
one clear line, not a stack trace from each of N workers. parser.py holds the flags,
commands.py what each subcommand does; here are `main` (parse, run, map errors to exit
codes) and `entry` (the installed command).
"""

from __future__ import annotations

import os
import sys

from pipetransformer.cli.parser import build_parser
from pipetransformer.config import ConfigError


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
    from pipetransformer.utils.allocator import use_expandable_segments
    from pipetransformer.utils.logging import setup_logging

    use_expandable_segments()  # before anything here can initialise CUDA (utils/allocator.py)
    setup_logging(rank="-")
    parser = build_parser()
    # Overrides may come before or after options (`train CONFIG --nproc 2 a.b=1`).
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    from pipetransformer.cli.libraries import LibraryBuildError, check_library_builds

    try:  # before anything imports them deep inside a command (cli/libraries.py)
        check_library_builds()
    except LibraryBuildError as exc:
        print(f"pipetransformer: error: {exc}", file=sys.stderr)
        sys.exit(2)
    from pipetransformer.runs.rundir import RunDirError

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
