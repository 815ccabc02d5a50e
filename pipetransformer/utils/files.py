"""Writing run outputs: every run file goes through here, atomically or append-only, with
one mode (0666 less the umask: 0644 by default), so a crash never leaves a half-written file
behind and no file is more private or more open than its neighbours for no reason."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _read_umask() -> int:
    try:  # Linux: read it without changing it (os.umask would, for a moment, in every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def run_file_mode() -> int:
    """The mode of every run file: what open() would give a new file (0666 less the umask)."""
    return 0o666 & ~_read_umask()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text`: a reader sees the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, run_file_mode())  # mkstemp creates 0600; run files share one mode
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """One JSON object per line, flushed at once so a killed run keeps what it measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines file ([] when it does not exist). A last line cut short by
    a killed writer is skipped with a warning; a bad line anywhere else is an error."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                logger.warning(
                    "%s: skipping its last line, cut short by an interrupted write", path
                )
                break
            raise ValueError(f"{path}:{number}: not a JSON record: {exc}") from exc
    return records


def rewrite_jsonl(path: str | os.PathLike, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Keep only the records for which `keep` is true (atomically); returns how many went."""
    records = read_jsonl(path)
    kept = [r for r in records if keep(r)]
    if len(kept) != len(records) or Path(path).exists():
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)
