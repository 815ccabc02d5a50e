"""Starting worker processes: under torchrun, this process is the worker; otherwise start
N local workers (one per device) with torchrun's environment variables.

Owns: the environment each worker sees, the free port of the local rendezvous, turning a
worker's failure into one clear error for the user.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

logger = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerFailed(RuntimeError):
    pass


def _worker_entry(local_rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple, error_dir: str) -> None:
    os.environ.update(
        {
            "RANK": str(local_rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        fn(*args)
    except BaseException as exc:
        # Keep the first line of each failure for the parent's one-line error.
        with open(os.path.join(error_dir, f"rank{local_rank}.err"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise


def launch_local(nproc: int, fn: Callable[..., Any], args: tuple = ()) -> None:
    """Run `fn(*args)` in `nproc` local worker processes; raise WorkerFailed on any failure."""
    import tempfile

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pipetransformer-errors-") as error_dir:
        try:
            mp.start_processes(
                _worker_entry,
                args=(nproc, port, fn, args, error_dir),
                nprocs=nproc,
                join=True,
                start_method="spawn",
            )
        except ProcessException as exc:
            messages = []
            for name in sorted(os.listdir(error_dir)):
                with open(os.path.join(error_dir, name)) as f:
                    messages.append(f"{name[:-4]}: {f.readline().strip()}")
            detail = "; ".join(messages) or str(exc).strip().splitlines()[-1]
            raise WorkerFailed(f"a worker process failed ({detail})") from exc
