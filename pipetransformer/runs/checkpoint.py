"""Checkpoints: sharded with torch.distributed.checkpoint (DCP), loadable at any layout.

A checkpoint is a directory `RUN_DIR/checkpoints/step-<global step>/` holding DCP's files
and two small ones written by rank 0: `run_state.json` (a CheckpointRecord: the RunState,
the resolved config, the model's unit names) and `profiles.json` (what the profilers had
measured). What goes in is handed over as Stateful objects (runs/state.py,
trainer/statefuls.py); `save` and `load` treat them alike: tensors go through DCP, anything
else into run_state.json. Tensors are keyed by name, not by rank or layout:

    model/units.<u>.<name>                   every parameter and buffer of unit u
    optim/units.<u>.<name>/<state>           optimizer state of a trained parameter
    rng/rank<r>/cpu, rng/rank<r>/cuda        rank r's random streams

Every rank offers the units it holds; replicas hold the same units, and DCP's planner
keeps one writer per key, so each rank writes a share of the model and no rank gathers it.
A resuming rank asks for exactly the keys of the units it holds in the layout planned for
the new world, and DCP reads them from whichever files hold them: the same world size or
another, any layout.

A checkpoint exists once every rank has finished writing it: the files go to
`.tmp-step-N/`, then, after a barrier, rank 0 adds run_state.json, renames the directory
to `step-N/` and only then moves the `latest` pointer. A crash at any point leaves either
no `step-N/` or a complete one; `find_checkpoint` never picks a `.tmp-` directory or one
without run_state.json, and leftovers of an interrupted write are removed at the next
start.

A write that fails with an OSError (a full disk, a quota, a read-only file system), on any
rank, is a CheckpointWriteError: one line with the errno, the path, and the newest complete
checkpoint, which the failed write leaves as it was (its staging directory is removed, to
give the space back). The command line adds the command that resumes from it.

Owns: the directory layout, writing and reading, and when a checkpoint is due. Must not:
know what the state means (the statefuls do).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pipetransformer.autodp.control import Control
from pipetransformer.config import CheckpointConfig
from pipetransformer.runs.state import CheckpointRecord, Stateful
from pipetransformer.utils.files import write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
RUN_STATE = "run_state.json"
PROFILES = "profiles.json"
_NAME = re.compile(r"^step-(\d{8,})$")


class StepPosition(Protocol):
    """Where a step leaves the run (the trainer's clock.Tick is one)."""

    global_step: int

    @property
    def completed_epochs(self) -> int: ...

    @property
    def epoch_end(self) -> bool: ...

    @property
    def last(self) -> bool: ...


def checkpoint_name(global_step: int) -> str:
    return f"step-{global_step:08d}"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def is_complete(path: Path) -> bool:
    return (
        bool(_NAME.match(path.name))
        and (path / RUN_STATE).is_file()
        and (path / ".metadata").is_file()
    )


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the message is one line: cause, path, the newest
    complete checkpoint)."""


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, one a rank reported to DCP (CheckpointException's
    failures by rank), or one it was raised from."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        if isinstance(current, CheckpointException):
            pending += [failure[0] for _, failure in sorted(current.failures.items())]
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


def _write_failure(cause: OSError, staging: Path, newest: Path | None) -> str:
    code = errno.errorcode.get(cause.errno, "") if cause.errno is not None else ""
    reason = f"{cause.strerror or cause} ({code})" if code else str(cause.strerror or cause)
    where = cause.filename or staging
    kept = (
        f"the newest complete checkpoint, {newest}, is intact"
        if newest is not None
        else "no complete checkpoint exists yet"
    )
    return f"checkpoint not written: {reason}: {where}; {kept}"


def find_checkpoint(run_dir: str | os.PathLike, which: str = "latest") -> Path | None:
    """The checkpoint `latest` (or `best`) points at; for `latest`, the newest complete one
    when the pointer is missing or names a checkpoint that is gone. None when there is none."""
    root = checkpoints_dir(run_dir)
    if which not in ("latest", "best"):
        raise ValueError(f"which checkpoint: 'latest' or 'best', got {which!r}")
    pointer = root / (which if which == "latest" else "best.json")
    if pointer.is_file():
        text = pointer.read_text().strip()
        name = json.loads(text)["checkpoint"] if which == "best" else text
        if _NAME.match(name) and is_complete(root / name):
            return root / name
    if which == "best":
        return None
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def read_run_state(path: Path) -> CheckpointRecord:
    """A checkpoint's run_state.json as its record (ValueError naming the file if unreadable)."""
    try:
        return CheckpointRecord.from_dict(json.loads((path / RUN_STATE).read_text()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path / RUN_STATE}: not a readable run state ({exc})") from exc


def stored_tensors(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor key of a checkpoint with its shape and dtype (from DCP's metadata)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    found = {}
    for key, entry in metadata.state_dict_metadata.items():
        if hasattr(entry, "size"):
            found[key] = (entry.size, entry.properties.dtype)
    return found


def remove_interrupted_writes(run_dir: str | os.PathLike) -> list[Path]:
    """Delete `.tmp-` directories an interrupted checkpoint write left behind."""
    root = checkpoints_dir(run_dir)
    removed = []
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(".tmp-") and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    for path in removed:
        logger.info("removed %s, left by an interrupted checkpoint write", path)
    return removed


@dataclass(frozen=True)
class SavedCheckpoint:
    path: Path
    write_s: float
    bytes: int


class Checkpointer:
    """Writes a run's checkpoints on every rank (collective), keeps the newest few, and
    loads one into the statefuls a rank holds."""

    def __init__(
        self, config: CheckpointConfig, run_dir: Path, control: Control, save_final: bool = False
    ) -> None:
        self.config = config
        self.root = checkpoints_dir(run_dir)
        self.control = control
        self.save_final = save_final  # also after the last step (for an export)
        self.last_step: int | None = None  # global step of the newest checkpoint written or loaded

    @property
    def last_path(self) -> Path | None:
        return None if self.last_step is None else self.root / checkpoint_name(self.last_step)

    def due(self, tick: StepPosition) -> bool:
        """Whether a checkpoint is due after the step of `tick`."""
        if self.last_step == tick.global_step:
            return False
        every_steps = self.config.interval_steps
        if every_steps is not None and tick.global_step % every_steps == 0:
            return True
        every_epochs = self.config.interval_epochs
        if tick.epoch_end and every_epochs > 0 and tick.completed_epochs % every_epochs == 0:
            return True
        return self.save_final and tick.last

    def save(
        self,
        global_step: int,
        statefuls: Mapping[str, Stateful],
        reason: str,
        eval_metric: float | None,
        write_extra: Callable[[Path], None] | None = None,
    ) -> SavedCheckpoint:
        """Write a checkpoint of `global_step`. Collective: every rank, its own statefuls, in
        the same order. `write_extra(directory)`: rank 0 adds its own files (the profiles).
        Raises CheckpointWriteError when a file cannot be written."""
        try:
            return self._save(global_step, statefuls, reason, eval_metric, write_extra)
        except (OSError, CheckpointException) as exc:
            cause = _os_error(exc)
            if cause is None:
                raise
            staging = self.root / f".tmp-{checkpoint_name(global_step)}"
            if self.control.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointWriteError(
                _write_failure(cause, staging, find_checkpoint(self.root.parent))
            ) from exc

    def _save(
        self,
        global_step: int,
        statefuls: Mapping[str, Stateful],
        reason: str,
        eval_metric: float | None,
        write_extra: Callable[[Path], None] | None = None,
    ) -> SavedCheckpoint:
        start = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        record: dict[str, Any] = {}
        for stateful in statefuls.values():
            for key, value in stateful.state_dict().items():
                (tensors if isinstance(value, torch.Tensor) else record)[key] = value
        record["reason"] = reason
        rank0 = self.control.rank == 0
        name = checkpoint_name(global_step)
        final = self.root / name
        staging = self.root / f".tmp-{name}"
        if rank0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.control.barrier()
        dcp.save(
            tensors,
            storage_writer=dcp.FileSystemWriter(str(staging), sync_files=True),
            process_group=self.control.group,
            no_dist=self.control.group is None,
        )
        self.control.barrier()  # every rank's files are written
        size = 0
        if rank0:
            if write_extra is not None:
                write_extra(staging)
            write_json_atomic(staging / RUN_STATE, record)  # last: marks the files complete
            size = sum(p.stat().st_size for p in staging.iterdir() if p.is_file())
            if final.exists():  # the same step again (e.g. written before a crash): replace it
                shutil.rmtree(final)
            os.replace(staging, final)
            _fsync_dir(self.root)
            write_text_atomic(self.root / "latest", name + "\n")
            if eval_metric is not None and self.config.keep_best:
                self._update_best(name, eval_metric)
            self._prune()
        self.control.barrier()
        self.last_step = global_step
        seconds = time.perf_counter() - start
        logger.info("checkpoint %s written in %.2f s", final, seconds)
        return SavedCheckpoint(final, seconds, size)

    def load(self, path: Path, statefuls: Mapping[str, Stateful]) -> None:
        """Fill `statefuls` from the checkpoint at `path` (collective): each gets the keys of
        its `state_dict()` that the checkpoint has, tensors loaded in place."""
        wanted: dict[str, dict[str, Any]] = {name: s.state_dict() for name, s in statefuls.items()}
        stored = stored_tensors(path)
        record = None
        tensors: dict[str, torch.Tensor] = {}
        for values in wanted.values():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    if key in stored:
                        tensors[key] = value
                elif record is None:
                    record = json.loads((path / RUN_STATE).read_text())
        if self.control.all_max([len(tensors)])[0] > 0:  # the same answer on every rank
            with torch.no_grad():
                dcp.load(
                    tensors,
                    storage_reader=dcp.FileSystemReader(str(path)),
                    process_group=self.control.group,
                    no_dist=self.control.group is None,
                )
        for name, stateful in statefuls.items():
            loaded = {}
            for key, value in wanted[name].items():
                if isinstance(value, torch.Tensor):
                    if key in tensors:
                        loaded[key] = tensors[key]
                elif record is not None and key in record:
                    loaded[key] = record[key]
            stateful.load_state_dict(loaded)
        if record is not None:
            self.last_step = CheckpointRecord.from_dict(record).state.global_step

    def _update_best(self, name: str, eval_metric: float) -> None:
        path = self.root / "best.json"
        best = json.loads(path.read_text()) if path.is_file() else None
        if (
            best is None
            or not is_complete(self.root / best["checkpoint"])
            or eval_metric > best["eval_metric"]
        ):
            write_json_atomic(path, {"checkpoint": name, "eval_metric": eval_metric})

    def _prune(self) -> None:
        """Keep the newest `keep_last` complete checkpoints and the best one."""
        complete = complete_checkpoints(self.root.parent)
        keep = {p.name for p in complete[-self.config.keep_last :]}
        best = find_checkpoint(self.root.parent, "best") if self.config.keep_best else None
        if best is not None:
            keep.add(best.name)
        for path in complete:
            if path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a power cut after it cannot undo it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
