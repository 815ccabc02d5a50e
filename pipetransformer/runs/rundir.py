"""The run directory: whose it is, whether a run may start in it, and what a resume keeps.

One directory holds one run. A directory that already holds a run is refused (its files are
left untouched) unless the run is resumed (`--resume`, `trainer.resume: auto`, or a restart
after a crash) or replaced (`--overwrite`, which removes only the files a run writes). A
lock file keeps two live runs out of one directory: the process that owns the run (the
local launcher, or rank 0 under torchrun) holds an exclusive `flock` on RUN_DIR/.lock for
as long as the run lives, restarts included; the kernel releases it when that process dies.

On resume, the records written after the checkpoint are dropped from metrics.jsonl,
events.jsonl and steps.jsonl (they are written again), so each epoch appears once.

Owns: those rules and the files' names. Must not: start processes or read checkpoints'
tensors.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.runs.checkpoint import (
    CHECKPOINTS,
    find_checkpoint,
    remove_interrupted_writes,
)
from pipetransformer.runs.records import CheckpointEvent, StartEvent, event_from_dict
from pipetransformer.utils.files import read_jsonl, rewrite_jsonl, write_text_atomic

logger = logging.getLogger(__name__)

# Everything a run writes in its directory (what --overwrite removes).
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "events.jsonl",
    "steps.jsonl",
    "summary.json",
    CHECKPOINTS,
    "export",
    "tensorboard",
    "wandb",
    "samples",
    "profiles.json",
    ".run_id",
)
LOCK_FILE = ".lock"
RUN_ID_FILE = ".run_id"


class RunDirError(Exception):
    """The run directory cannot be used as asked. One line, naming the directory."""


@dataclass(frozen=True)
class RunOptions:
    """How a run starts in its directory (picklable: the launcher hands it to workers)."""

    resume: str = "never"  # 'never', 'auto' (resume when a checkpoint exists), 'required'
    overwrite: bool = False
    restart: bool = False  # a restart of this run after a failure
    run_id: str | None = None  # names this run across restarts
    # Set by a launcher that already checked and locked the directory: the checkpoint to
    # continue from ('' for none); None: rank 0 checks and locks it.
    prepared_checkpoint: str | None = None


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in ("config.yaml", "metrics.jsonl", CHECKPOINTS))


def check_resumable(run_dir: Path) -> None:
    """`--resume RUN_DIR` names a run directory: raise RunDirError (one line) otherwise,
    creating nothing. Whether it holds a complete checkpoint is decided under its lock."""
    if not run_dir.exists():
        raise RunDirError(f"--resume {run_dir}: no such directory")
    if not run_dir.is_dir():
        raise RunDirError(f"--resume {run_dir}: not a directory")
    if not holds_run(run_dir):
        raise RunDirError(
            f"--resume {run_dir}: not a run directory (it has no config.yaml, metrics.jsonl "
            f"or {CHECKPOINTS}/); pass the directory a run printed at its start"
        )


def ensure_directory(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"run directory {run_dir}: a file is in the way") from None
    except NotADirectoryError:
        raise RunDirError(f"run directory {run_dir}: a parent of it is a file") from None
    except PermissionError:
        raise RunDirError(f"run directory {run_dir}: permission denied") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {run_dir}: not writable")


def prepare_run_dir(
    run_dir: Path, *, resume: str, overwrite: bool, restart: bool = False, run_id: str | None = None
) -> Path | None:
    """Check that a run may start in `run_dir`; return the checkpoint to resume from.

    `resume`: 'required' (`--resume`: a checkpoint must exist), 'auto' (resume when there is
    one) or 'never'. `restart`: this is a restart of the run `run_id` after a failure, so
    its own files are not a reason to refuse. Raises RunDirError with one line.
    """
    ensure_directory(run_dir)
    ours = restart and run_id is not None and _read_run_id(run_dir) == run_id
    if overwrite:
        clear_run_files(run_dir)
        return None
    remove_interrupted_writes(run_dir)
    checkpoint = find_checkpoint(run_dir)
    if resume == "required":
        if checkpoint is None:
            raise RunDirError(
                f"--resume {run_dir}: no complete checkpoint in {run_dir / CHECKPOINTS}"
            )
        return checkpoint
    if checkpoint is not None and (resume == "auto" or ours):
        return checkpoint
    if holds_run(run_dir):
        if ours:  # our own earlier attempt died before its first checkpoint: start over
            clear_run_files(run_dir)
            return None
        raise RunDirError(
            f"run directory {run_dir} already holds a run; pass --resume {run_dir} to continue it, "
            "--overwrite to start over in it, or another --run-dir"
        )
    return None


def clear_run_files(run_dir: Path) -> None:
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def write_run_id(run_dir: Path, run_id: str) -> None:
    write_text_atomic(run_dir / RUN_ID_FILE, run_id + "\n")


def _read_run_id(run_dir: Path) -> str | None:
    try:
        return (run_dir / RUN_ID_FILE).read_text().strip()
    except OSError:
        return None


class RunLock:
    """An exclusive lock on a run directory for the life of this process (or `release`)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> RunLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            self._created = True
        except FileExistsError:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(
                f"run directory {self.path.parent} is in use by another run (pid {holder}); "
                "wait for it to end or choose another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self, remove: bool = False) -> None:
        """`remove`: also delete the lock file if this lock created it (a refused start
        leaves the directory as it found it)."""
        if self._fd is not None:
            if remove and self._created:
                self.path.unlink(missing_ok=True)  # while held: no other run holds it
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def truncate_after(run_dir: Path, global_step: int, epoch: int, step_in_epoch: int) -> None:
    """Drop the records written after a checkpoint at `global_step` (`epoch` in progress,
    0-based, with `step_in_epoch` of its steps taken): the resumed run writes them again."""
    dropped = rewrite_jsonl(run_dir / "metrics.jsonl", lambda r: r["epoch"] <= epoch)
    dropped += rewrite_jsonl(
        run_dir / "evaluations.jsonl", lambda r: r["global_step"] <= global_step
    )
    dropped += rewrite_jsonl(run_dir / "steps.jsonl", lambda r: r["global_step"] <= global_step)
    dropped += rewrite_jsonl(
        run_dir / "events.jsonl", lambda r: r.get("global_step", 0) <= global_step
    )
    # trainer.record_sample_ids: (1-based epoch, 0-based step) of each batch a rank read.
    for samples in sorted((run_dir / "samples").glob("rank*.jsonl")):
        dropped += rewrite_jsonl(
            samples, lambda r: (r["epoch"] - 1, r["step"]) < (epoch, step_in_epoch)
        )
    if dropped:
        logger.info(
            "dropped %d records written after the checkpoint at step %d", dropped, global_step
        )


def previous_attempt_wall_s(run_dir: Path) -> float:
    """Wall time of the attempt that ran last: from its start event to the last time it
    wrote anything (so work lost after its last checkpoint counts too)."""
    starts = [
        e
        for e in map(event_from_dict, read_jsonl(run_dir / "events.jsonl"))
        if isinstance(e, StartEvent)
    ]
    if not starts:
        return 0.0
    written = [
        p.stat().st_mtime
        for p in (
            run_dir / "metrics.jsonl",
            run_dir / "evaluations.jsonl",
            run_dir / "events.jsonl",
            run_dir / "steps.jsonl",
        )
        if p.exists()
    ]
    checkpoints = run_dir / CHECKPOINTS / "latest"
    if checkpoints.exists():
        written.append(checkpoints.stat().st_mtime)
    last = max(written, default=starts[-1].time)
    return max(0.0, min(last, time.time()) - starts[-1].time)


def previous_attempt_excluded_s(run_dir: Path) -> tuple[float, float]:
    """The seconds of the attempt that ran last that were off its training clock: its
    evaluations and its checkpoint writes (records after its start, those a resume is about
    to drop included: they took its time all the same)."""
    events = list(map(event_from_dict, read_jsonl(run_dir / "events.jsonl")))
    starts = [e for e in events if isinstance(e, StartEvent)]
    if not starts:
        return 0.0, 0.0
    began = starts[-1].global_step
    eval_s = sum(
        float(r.get("eval_time_s", 0.0))
        for r in read_jsonl(run_dir / "evaluations.jsonl")
        if r["global_step"] > began
    )
    checkpoint_s = sum(
        e.write_s for e in events if isinstance(e, CheckpointEvent) and e.global_step > began
    )
    return eval_s, checkpoint_s
