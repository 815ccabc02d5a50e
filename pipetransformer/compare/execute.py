"""Running one variant of a comparison: in its own run directory, on local worker
processes, unless it finished there earlier; resumed from the checkpoint a stopped run of
it left; a peer that does not fit even sharded recorded as refused (the planner's
`DoesNotFit`, as the worker raised it) and the comparison going on without it; SIGINT and
SIGTERM turned into `CompareStopped`, which the command line says in one line.

Owns: one variant's run and its attempt record (compare/timing.py). Must not: choose the
variants (variants.py) or read what they reached beyond the closing line (outputs.py).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipetransformer.compare.peers import run_peer
from pipetransformer.compare.report import (
    HF_TRAINER,
    REFUSED,
    TORCH_DDP,
    is_finished,
    read_run,
    refusal,
)
from pipetransformer.compare.timing import end_attempt, start_attempt
from pipetransformer.config import Config
from pipetransformer.launcher import LaunchInterrupted, WorkerFailed, launch_local
from pipetransformer.planning.context import DoesNotFit
from pipetransformer.runs.checkpoint import find_checkpoint
from pipetransformer.runs.rundir import RunLock, ensure_directory, prepare_run_dir
from pipetransformer.trainer import RunOptions, run_worker
from pipetransformer.utils.files import write_json_atomic
from pipetransformer.utils.stopping import STOP_SIGNALS

OUTSIDE_PEERS = (HF_TRAINER, TORCH_DDP)  # run by compare/peers.py, keep no checkpoint


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


def say(line: str) -> None:
    print(f"pipetransformer compare: {line}", file=sys.stderr)


def run_variant(variant_config: Config, name: str, run_dir: Path, label: str) -> bool:
    """One variant's run in `run_dir`, unless it finished there earlier (resumed from the
    checkpoint an interrupted run left); False if it failed. Raises CompareStopped on a
    stop signal."""
    if is_finished(run_dir):
        say(f"{label}: finished in {run_dir}, kept")
        return True
    if refusal(run_dir) is not None:
        say(f"{label}: refused earlier, kept")
        return True
    say(f"{label} -> {run_dir}")
    started = time.perf_counter()
    ensure_directory(run_dir)
    lock = RunLock(run_dir).acquire()  # a second compare into the same --out stops here
    outcome, attempts = "failed", None
    try:
        checkpoint = _prepare_variant_dir(run_dir, name)
        if checkpoint is not None:
            say(
                f"{label}: resuming from {checkpoint}, which an interrupted run left (its "
                "training time counts every attempt)"
            )
        attempts = start_attempt(run_dir, resumed=checkpoint is not None)
        if name in OUTSIDE_PEERS:
            launch_local(variant_config.nproc_per_node, run_peer, (name, variant_config, run_dir))
        else:
            options = RunOptions(prepared_checkpoint=str(checkpoint or ""))
            arguments = (variant_config, run_dir, options)
            launch_local(variant_config.nproc_per_node, run_worker, arguments)
        outcome = "finished"
    except LaunchInterrupted as exc:
        outcome = "stopped"
        raise CompareStopped(exc.signum, _stopped_what(name, label, run_dir, exc)) from None
    except WorkerFailed as exc:
        if isinstance(exc.error, DoesNotFit):  # a peer that cannot fit even sharded
            outcome = "refused"
            reason = str(exc.error)
            write_json_atomic(run_dir / REFUSED, {"reason": reason})
            say(f"{name} refused: {reason}")
            return True
        say(
            f"{name} failed: {exc} (the same command again resumes the comparison: finished "
            "runs are kept)"
        )
        return False
    finally:
        if attempts is not None:
            end_attempt(run_dir, attempts, outcome)
        lock.release()
    run = read_run(run_dir)
    say(
        f"{name} done in {time.perf_counter() - started:.0f} s: "
        f"training_time_s {run['training_time_s']:.1f}, "
        f"final {run['metric_name']} {run['final_eval_metric']:.4f}"
    )
    return True


def _prepare_variant_dir(run_dir: Path, name: str) -> Path | None:
    """Make `run_dir` ready for the variant's run; the checkpoint an interrupted run of it
    left, which it resumes from, or None: a run cut short before its first checkpoint, and
    the peers outside this trainer (they keep none), start over."""
    resumable = name not in OUTSIDE_PEERS and find_checkpoint(run_dir) is not None
    return prepare_run_dir(
        run_dir, resume="required" if resumable else "never", overwrite=not resumable
    )


def _stopped_what(name: str, label: str, run_dir: Path, exc: LaunchInterrupted) -> str:
    """What a stop signal stopped: the run, where it stopped and its checkpoint."""
    if exc.stopped is not None:
        return f"{label}: {exc.stopped}"
    signal_name = signal.Signals(exc.signum).name
    if name in OUTSIDE_PEERS:
        return f"{label}: stopped by {signal_name}; it keeps no checkpoint (it starts over)"
    checkpoint = find_checkpoint(run_dir)
    left = f"its latest checkpoint {checkpoint}" if checkpoint else "no checkpoint (it starts over)"
    return f"{label}: workers killed by a second {signal_name}; {left}"
