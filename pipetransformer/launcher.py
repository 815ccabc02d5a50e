"""Starting worker processes: under torchrun, this process is the worker; otherwise start
N local workers (one per device) with torchrun's environment variables.

Owns: the environment each worker sees (a free port on the loopback interface for the
rendezvous), watching the workers, and turning what happened to them into one outcome:
- all finished: their results;
- one failed (an exception, a signal such as SIGKILL, the out-of-memory killer): the others
  are ended at once (they cannot go on without it) and `WorkerFailed` names the first
  failure and carries its exception (a typed refusal reads as such);
- SIGINT / SIGTERM reached this process: it is forwarded to every worker, which finishes
  its step, writes a checkpoint and stops; `LaunchInterrupted` carries where. A second
  signal kills the workers at once.
Workers die with this process (PR_SET_PDEATHSIG on Linux), so none is left training alone.

Workers start with `spawn` (a fresh interpreter: nothing of this process's state, threads
or CUDA context is inherited). A caller that starts many short runs, the test suite, may
hand in a `forkserver` context whose server has already imported torch: each worker is
then a fork of that server, with this process's environment, and skips the imports.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipetransformer.utils.stopping import STOP_SIGNALS, RunStopped

logger = logging.getLogger(__name__)

# When the launcher started the workers (time.time()): a worker says how long start-up took.
LAUNCHED_AT_ENV = "PIPETRANSFORMER_LAUNCHED_AT"

# Seconds the other workers get to exit by themselves after one failed.
FAILURE_GRACE_S = 5.0


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(
        v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerFailed(RuntimeError):
    """A worker failed: the message names the first rank that did and its error's first
    line; `error` is that exception itself where it could be carried back (pickled), so
    that a caller tells a typed refusal from a failure without reading the message."""

    def __init__(self, message: str, error: BaseException | None = None) -> None:
        super().__init__(message)
        self.error = error


class LaunchInterrupted(Exception):
    """A stop signal reached the launcher; `stopped` is set when the workers wrote a
    checkpoint and stopped cleanly, None when they had to be killed."""

    def __init__(self, signum: int, stopped: RunStopped | None) -> None:
        super().__init__(str(stopped) if stopped else signal.Signals(signum).name)
        self.signum = signum
        self.stopped = stopped


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us when the parent goes
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # it went before prctl took effect
        os._exit(1)


def _worker_entry(
    local_rank: int,
    nproc: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    status_dir: str,
    parent_pid: int | None,
    environ: dict[str, str],
) -> None:
    # A forkserver's child (parent_pid None) dies with the server, which ends with the launcher.
    _die_with_parent(os.getppid() if parent_pid is None else parent_pid)
    os.environ.clear()  # the launcher's environment, also where a forkserver started earlier
    os.environ.update(environ)
    os.environ.update(
        {
            "RANK": str(local_rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # Local runs listen on the loopback interface only (see init_distributed).
            "PIPETRANSFORMER_LOOPBACK": "1",
        }
    )
    status = Path(status_dir)
    try:
        result = fn(*args)
    except RunStopped as stopped:
        (status / f"rank{local_rank}.stopped").write_bytes(pickle.dumps(stopped))
        _exit_now(0)
    except BaseException as exc:
        # The parent reports the first line; the whole traceback stays in the file.
        (status / f"rank{local_rank}.err").write_text(
            f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        )
        try:
            (status / f"rank{local_rank}.exception").write_bytes(pickle.dumps(exc))
        except Exception:  # an exception that does not pickle is reported by its text only
            pass
        _exit_now(1)
    (status / f"rank{local_rank}.result").write_bytes(pickle.dumps(result))
    _exit_now(0)


def _exit_now(code: int) -> None:
    """End a worker whose outcome is written, without the interpreter's finalization (full
    collections over torch's, timm's and transformers' modules: seconds, cli.entry says
    more); the run has closed what it owns."""
    import multiprocessing.util

    multiprocessing.util._exit_function()  # releases named semaphores (see cli.entry)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _describe(rank: int, exitcode: int | None, status: Path) -> str:
    err = status / f"rank{rank}.err"
    if err.exists():
        return f"rank{rank}: {err.read_text().splitlines()[0]}"
    if exitcode is not None and exitcode < 0:
        return f"rank{rank}: killed by {signal.Signals(-exitcode).name}"
    return f"rank{rank}: exited with code {exitcode}"


def launch_local(
    nproc: int,
    fn: Callable[..., Any],
    args: tuple = (),
    context: multiprocessing.context.BaseContext | None = None,
) -> list[Any]:
    """Run `fn(*args)` in `nproc` local worker processes; return each rank's result.
    Raises WorkerFailed or LaunchInterrupted (see the module docstring). `context`: how
    workers start, `spawn` unless given (see the module docstring)."""
    context = context or multiprocessing.get_context("spawn")
    parent_pid = None if context.get_start_method() == "forkserver" else os.getpid()
    port = free_port()
    received: list[int] = []
    previous = {}

    with tempfile.TemporaryDirectory(prefix="pipetransformer-status-") as status_dir:
        status = Path(status_dir)
        processes = [
            context.Process(
                target=_worker_entry,
                args=(
                    rank,
                    nproc,
                    port,
                    fn,
                    args,
                    status_dir,
                    parent_pid,
                    {**os.environ, LAUNCHED_AT_ENV: f"{time.time():.3f}"},
                ),
                daemon=False,
            )
            for rank in range(nproc)
        ]

        def forward(signum, frame) -> None:
            received.append(signum)
            first = len(received) == 1
            for process in processes:
                if process.pid is not None and process.is_alive():
                    try:
                        os.kill(process.pid, signum if first else signal.SIGKILL)
                    except ProcessLookupError:
                        pass

        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, forward)
        try:
            for process in processes:
                process.start()
            failure = _watch(processes, status)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        results = [status / f"rank{rank}.result" for rank in range(nproc)]
        if failure is None and all(path.exists() for path in results):
            return [pickle.loads(path.read_bytes()) for path in results]  # finished, signal or not
        stopped = sorted(status.glob("rank*.stopped"))
        if failure is None and stopped:  # the signal may have reached the workers only
            run_stopped = pickle.loads(stopped[0].read_bytes())
            raise LaunchInterrupted(received[0] if received else run_stopped.signum, run_stopped)
        if received:
            raise LaunchInterrupted(received[0], None)
        if failure is None:
            raise WorkerFailed("a worker exited without a result")
        raise WorkerFailed(failure, _worker_exception(status, failure))


def _worker_exception(status: Path, failure: str) -> BaseException | None:
    """The exception of the rank `failure` names (`_describe`), where it pickled."""
    rank = failure.partition(":")[0]
    path = status / f"{rank}.exception"
    try:
        return pickle.loads(path.read_bytes()) if path.is_file() else None
    except Exception:  # a class that cannot be rebuilt here: the message still says it
        return None


def _watch(processes: list, status: Path) -> str | None:
    """Wait for every worker; on the first failure end the rest. Returns that failure."""
    pending = {p.sentinel: rank for rank, p in enumerate(processes)}
    failure = None
    deadline = None
    while pending:
        timeout = 0.5 if deadline is None else max(0.0, deadline - time.monotonic())
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=timeout):
            rank = pending.pop(sentinel)
            process = processes[rank]
            process.join()
            if process.exitcode != 0 and failure is None:
                failure = _describe(rank, process.exitcode, status)
                deadline = time.monotonic() + FAILURE_GRACE_S
        if deadline is not None and time.monotonic() >= deadline:
            for sentinel, rank in list(pending.items()):
                processes[rank].kill()
                processes[rank].join()
                pending.pop(sentinel)
    return failure
