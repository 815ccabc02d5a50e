"""Where a store's files live, and who may touch them: private directories and stale ones.

A store is two directories, each created with ``os.mkdir(path, 0o700)`` by the user who
trains: `/dev/shm/ptcache-<uid>-<random>/` (tags and memory-tier slots, the manifest, the
owner record) and `<disk parent>/ptcache-<uid>-<random>-disk/` (disk-tier slots, a copy of
the manifest, the owner record), where the disk parent is `cache.dir` or the temp
directory. The random part is 16 hex digits from `secrets`; a name that already exists (a
planted symlink, say) is never reused: mkdir fails and another name is drawn. The
directory is then opened with O_DIRECTORY | O_NOFOLLOW and checked through that fd
(a directory of this user, no permission for group or others), and every file in it is
created relative to that fd with O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600; renames stay
inside it. So another local user can neither read the cache nor, by planting a symlink at
a path the store is about to create, make the trainer write elsewhere (/dev/shm and /tmp
are world-writable; the directories' names are listed to everyone). Even if the parent
lets another user swap the directory for another (a `cache.dir` others may write), the
fds keep the daemon in the directory it checked and clients refuse the swapped one: at
worst the cache fails to start. Clients open the directory and each file the same way and
check owner and mode before they map anything.

The owner record (`owner.json` in both directories: the daemon's pid and start time, the
node's host name, boot id and pid namespace, the disk directory, `keep`) lets the next start
remove what a store whose daemon is gone left behind (every process SIGKILLed at once
leaves it). A start sweeps /dev/shm, its own disk parent and the disk tier named by the
record of a store it removes, and removes only directories
that match this naming pattern, belong to this user and are closed to others, and either
have an owner record saying the daemon is gone (same host name, boot id and pid namespace,
and the pid no longer runs the process that started at the recorded time: a reused pid is
not the daemon), or have no readable record and were last modified more than
STALE_WITHOUT_OWNER_S ago (a daemon writes its records first thing, so a younger one may
be starting). A store recorded by another host (a `cache.dir` on a shared file system),
another boot (indistinguishable from another machine of the same name) or another pid
namespace (a container sharing /dev/shm) is never judged: its pids mean nothing here, and
a live store is never removed. The price: a disk tier left by a crash just before a reboot
stays until removed by hand (/dev/shm itself is empty after a reboot). A disk tier kept by
`cache.keep` is never removed.

Owns: those rules and the owner record's format (written and read here only). Must not:
import torch (the daemon imports this module), or remove anything these rules do not name.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

NAME_PREFIX = "ptcache"
DISK_SUFFIX = "-disk"
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


def _check_private(
    path: Path, info: os.stat_result, is_kind: Callable[[int], bool], kind: str
) -> None:
    if not is_kind(info.st_mode):
        raise UnsafeStore(
            f"{path} is not a {kind} (a symlink or another kind of file): "
            "refusing to use it as a cache store"
        )
    if info.st_uid != os.geteuid():
        raise UnsafeStore(
            f"{path} belongs to uid {info.st_uid}, not this user: "
            "refusing to use it as a cache store"
        )
    if info.st_mode & 0o077:
        raise UnsafeStore(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): "
            "refusing to use it as a cache store"
        )


def check_private_dir(path: Path) -> None:
    """Raise UnsafeStore unless `path` is a directory (not a symlink to one) owned by this
    user, with no permission for group or others."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no AutoCache at {path}: its daemon is not running or has stopped"
        ) from None
    _check_private(path, info, stat.S_ISDIR, "directory")


def open_private_dir(path: Path) -> int:
    """A descriptor of the private directory `path`, for opens relative to it (`dir_fd=`):
    what is checked is what is used, even if someone swaps the path after the check."""
    check_private_dir(path)  # first, for a clear message
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:  # replaced by a symlink or a file since the check
        raise UnsafeStore(
            f"{path} changed while it was checked ({error.strerror}): refusing to use it"
        ) from None
    try:
        _check_private(path, os.fstat(fd), stat.S_ISDIR, "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_file(path: Path, flags: int) -> int:
    """Open an existing file of a store: a regular file of this user, closed to others, in a
    private directory, reached without following a symlink."""
    if not os.path.lexists(path):  # the likely mistake first: a stopped daemon's address
        raise FileNotFoundError(f"no AutoCache at {path}: its daemon is not running or has stopped")
    dir_fd = open_private_dir(path.parent)
    try:
        fd = os.open(path.name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no AutoCache at {path}: its daemon is not running or has stopped"
        ) from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeStore(f"{path} is a symlink: refusing to use it as a cache file") from None
        raise
    finally:
        os.close(dir_fd)
    try:
        _check_private(path, os.fstat(fd), stat.S_ISREG, "regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_file(dir_fd: int, name: str, mode: int = 0o600) -> int:
    """A new file `name` in the directory `dir_fd` (fails if anything, a symlink included,
    is already there)."""
    return os.open(name, _OPEN_NEW, mode, dir_fd=dir_fd)


def write_new_file(dir_fd: int, name: str, text: str) -> None:
    with os.fdopen(create_file(dir_fd, name), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def mark_kept(directory: Path) -> None:
    """Leave KEEP_FILE in a disk tier that cache.keep keeps (for people; sweeps skip it)."""
    dir_fd = open_private_dir(directory)
    try:
        os.close(os.open(KEEP_FILE, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd))
    finally:
        os.close(dir_fd)


def _read_or_empty(read: Callable[[str], str], path: str) -> str:
    try:
        return read(path).strip()
    except OSError:
        return ""


def this_machine() -> dict[str, str]:
    """What a pid means relative to: this host, this boot of it, this pid namespace
    (containers on one host may share /dev/shm yet not see each other's processes)."""
    return {
        "host": socket.gethostname(),
        "boot_id": _read_or_empty(lambda p: Path(p).read_text(), "/proc/sys/kernel/random/boot_id"),
        "pid_namespace": _read_or_empty(os.readlink, "/proc/self/ns/pid"),
    }


def write_owner(dir_fd: int, pid: int, start_ticks: int | None, disk_dir: Path, keep: bool) -> None:
    """The owner record of a store directory: who to ask whether the store is still in use."""
    record = {
        "pid": pid,
        "start_ticks": start_ticks,
        **this_machine(),
        "disk_dir": str(disk_dir),
        "keep": keep,
    }
    write_new_file(dir_fd, OWNER_FILE, json.dumps(record))


def read_owner(directory: Path) -> dict[str, Any] | None:
    """The owner record of a private store directory; None if absent or unreadable."""
    try:
        with os.fdopen(open_private_file(directory / OWNER_FILE, os.O_RDONLY)) as f:
            record = json.loads(f.read())
    except (OSError, ValueError):  # missing, not private, cut short by a SIGKILL
        return None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return None
    return record


def _stale_reason(
    path: Path,
    owner: dict[str, Any] | None,
    process_alive: Callable[[int, int | None], bool],
    now: float,
) -> str | None:
    """Why the private store directory `path` may go (the rules in the module docstring);
    None: leave it."""
    if path.name.endswith(DISK_SUFFIX) and (
        os.path.lexists(path / KEEP_FILE) or (owner or {}).get("keep")
    ):
        return None  # cache.keep: left for inspection, however the run ended
    if owner is None:
        try:
            modified_s = os.lstat(path).st_mtime
        except FileNotFoundError:  # removed meanwhile (its starter, or another start's sweep)
            return None
        if now - modified_s > STALE_WITHOUT_OWNER_S:
            return "with no owner record"
        return None  # may be a daemon that is starting: it writes its record first
    if any(owner.get(key) != value for key, value in this_machine().items()):
        return None  # another host (a shared cache.dir) or container: its pids mean nothing here
    if process_alive(owner["pid"], owner.get("start_ticks")):
        return None
    return f"left by pid {owner['pid']}"


def sweep_stale_stores(
    shm_parent: Path, disk_parent: Path, process_alive: Callable[[int, int | None], bool]
) -> list[Path]:
    """Remove this user's stores whose daemon is gone, under both parents; returns the
    directories removed. `process_alive(pid, start_ticks)` tells a live daemon (a reused
    pid is not one). A removed store's disk tier goes too, wherever its record says it is."""
    pattern = re.compile(rf"^{re.escape(store_prefix())}-[0-9a-f]{{16}}({DISK_SUFFIX})?$")
    now = time.time()
    queue: list[Path] = []
    for parent in dict.fromkeys([shm_parent, disk_parent]):
        try:
            queue.extend(sorted(parent.iterdir()))
        except OSError:  # no such directory (yet), or not readable: nothing of ours there
            continue
    removed: list[Path] = []
    while queue:
        path = queue.pop(0)
        if not pattern.match(path.name):
            continue
        try:
            check_private_dir(path)
        except OSError:
            continue  # not ours, not a store, or removed already: never touched
        owner = read_owner(path)
        why = _stale_reason(path, owner, process_alive, now)
        if why is None:
            continue
        shutil.rmtree(path, ignore_errors=True)  # never follows a symlink inside
        if os.path.lexists(path):
            logger.warning("could not remove the stale AutoCache store %s %s", path, why)
            continue
        removed.append(path)
        logger.info("removed a stale AutoCache store %s %s", path, why)
        if owner is not None and owner.get("disk_dir") and not path.name.endswith(DISK_SUFFIX):
            queue.append(Path(owner["disk_dir"]))  # judged by the same rules, by its own record
    return removed
