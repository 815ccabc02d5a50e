"""Where a store's files live, and who may touch them: private directories and stale ones.

A store is two directories, each created with mode 0700 by the user who trains:
`/dev/shm/ptcache-<uid>-<random>/` (tags and memory-tier slots, the manifest, the owner
record) and `<disk parent>/ptcache-<uid>-<random>-disk/` (disk-tier slots). Every file in
them is created with O_CREAT | O_EXCL | O_NOFOLLOW, and renames stay inside them, so another
local user can neither read the cache nor, by planting a symlink at a path the store is
about to create, make the trainer write elsewhere (/dev/shm is world-writable; its
directories' names are listed to everyone). Clients check a store's directory is a real
directory of theirs, closed to others, before they map anything in it.

The owner record (`owner.json`: the daemon's pid and start time, the disk directory) lets
the next start of a store remove what a store whose daemon is gone left behind (every
process SIGKILLed at once leaves it): only directories of this naming pattern, of this
user, whose daemon is gone, or which have no owner record and are older than
STALE_WITHOUT_OWNER_S (a daemon writes its record before anything else, so a younger one
may be starting).

Owns: those rules. Must not: import torch (the daemon imports this module).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

NAME_PREFIX = "ptcache"
OWNER_FILE = "owner.json"
KEEP_FILE = "KEPT"  # in a disk tier kept by cache.keep: never swept
STALE_WITHOUT_OWNER_S = 600.0
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


class UnsafeStore(OSError):
    """A store path is not a private directory of this user (or not a plain file in one)."""


def store_prefix() -> str:
    return f"{NAME_PREFIX}-{os.geteuid()}"


def make_private_dir(parent: Path, suffix: str = "") -> Path:
    """A new directory `<parent>/<prefix>-<random><suffix>` only this user can enter."""
    parent.mkdir(parents=True, exist_ok=True)
    for _ in range(16):
        path = parent / f"{store_prefix()}-{secrets.token_hex(8)}{suffix}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # taken (or planted): another name
            continue
        check_private_dir(path)
        return path
    raise UnsafeStore(f"could not create a private cache directory in {parent}")


def check_private_dir(path: Path) -> None:
    """Raise UnsafeStore unless `path` is a directory (not a symlink to one) owned by this
    user, with no permission for group or others."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no AutoCache at {path}: its daemon is not running or has stopped") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeStore(f"{path} is not a directory (a symlink or a file): refusing to use it as a cache store")
    if info.st_uid != os.geteuid():
        raise UnsafeStore(f"{path} belongs to uid {info.st_uid}, not this user: refusing to use it as a cache store")
    if info.st_mode & 0o077:
        raise UnsafeStore(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): refusing to use it as a cache store"
        )


def open_private_file(path: Path, flags: int) -> int:
    """Open an existing file of a store without following a symlink; checks its directory."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no AutoCache at {path}: its daemon is not running or has stopped")
    check_private_dir(path.parent)
    fd = os.open(path, flags | os.O_NOFOLLOW)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeStore(f"{path} is not a regular file of this user")
    return fd


def create_file(path: Path, mode: int = 0o600) -> int:
    """A new file (fails if anything, a symlink included, is already at `path`)."""
    return os.open(path, _OPEN_NEW, mode)


def write_new_file(path: Path, text: str) -> None:
    fd = create_file(path)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_owner(directory: Path, pid: int, start_ticks: int | None, disk_dir: Path) -> None:
    write_new_file(
        directory / OWNER_FILE, json.dumps({"pid": pid, "start_ticks": start_ticks, "disk_dir": str(disk_dir)})
    )


def _owner(directory: Path) -> dict[str, Any] | None:
    try:
        fd = open_private_file(directory / OWNER_FILE, os.O_RDONLY)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        try:
            return json.loads(f.read())
        except json.JSONDecodeError:
            return None


def sweep_stale_stores(shm_parent: Path, disk_parent: Path, process_alive) -> list[Path]:
    """Remove this user's stores whose daemon is gone; returns the directories removed.
    `process_alive(pid, start_ticks)` tells a live daemon (a reused pid is not one)."""
    removed: list[Path] = []
    pattern = re.compile(rf"^{re.escape(store_prefix())}-[0-9a-f]{{16}}(-disk)?$")
    now = time.time()
    for parent in dict.fromkeys([shm_parent, disk_parent]):
        if not parent.is_dir():
            continue
        for path in parent.iterdir():
            if not pattern.match(path.name):
                continue
            if path.name.endswith("-disk"):  # a disk tier whose store is gone entirely
                orphan = not (shm_parent / path.name.removesuffix("-disk")).exists()
                kept = (path / KEEP_FILE).exists()  # cache.keep: left for inspection
                if orphan and not kept and now - os.lstat(path).st_mtime > STALE_WITHOUT_OWNER_S:
                    try:
                        check_private_dir(path)
                    except OSError:
                        continue
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
                    logger.info("removed a stale AutoCache disk tier %s", path)
                continue
            try:
                check_private_dir(path)
            except OSError:
                continue  # not ours, or not a store: never touched
            owner = _owner(path)
            if owner is not None:
                if process_alive(int(owner["pid"]), owner.get("start_ticks")):
                    continue
                why = f"left by pid {owner['pid']}"
            elif now - os.lstat(path).st_mtime > STALE_WITHOUT_OWNER_S:
                why = "with no owner record"
            else:
                continue
            disk = Path(owner["disk_dir"]) if owner and owner.get("disk_dir") else None
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            if disk is not None and pattern.match(disk.name) and not (disk / KEEP_FILE).exists():
                try:
                    check_private_dir(disk)
                except OSError:
                    pass
                else:
                    shutil.rmtree(disk, ignore_errors=True)
                    removed.append(disk)
            logger.info("removed a stale AutoCache store %s %s", path, why)
    return removed
