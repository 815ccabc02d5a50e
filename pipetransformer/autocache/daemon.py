"""The AutoCache daemon: one process per node that owns the store's files.

Owns: starting the daemon process (a fresh interpreter, so it inherits no
torch.distributed state, threads or CUDA context from the trainer; its request comes on
stdin, never on the command line every local user can read), creating the shared-memory
files and the disk-tier files inside the store's two private directories (private.py: the
starter sweeps stale stores and creates the directories, so it knows their names before
the daemon runs), publishing the manifest clients attach by, and removing all of it: on
``stop()``, on SIGTERM/SIGINT/SIGHUP, when every watched trainer process is gone (SIGKILL
included) and when the process that started it dies.
Must not: import torch (the daemon starts in well under a second without it), read or
write cached values (clients do that directly in shared memory), or let a client own
anything. Clients map plain files under /dev/shm with ``mmap`` rather than
``multiprocessing.shared_memory``, so Python's resource_tracker never tracks, unlinks or
warns about a segment: only the daemon and its starter create or remove files.

Cleanup paths, all ending in ``remove_store_files``:
(a) ``stop()`` sends SIGTERM and waits; (b) ``with CacheDaemon.start(...)`` stops on an
exception too, and ``atexit`` stops a daemon its starter forgot; (c) the daemon polls the
watched pids every ``poll_interval_s`` (a zombie or a reused pid counts as gone); (d) it
polls ``getppid()``, which changes when its starter dies; signals are blocked and taken
synchronously with ``sigtimedwait`` so a second signal cannot interrupt the cleanup. If the
daemon itself is SIGKILLed, ``stop()`` removes what it left (the names are known); if the
starter is SIGKILLed with it, the next start of a store by the same user removes it
(``sweep_stale_stores``, by the owner record the daemon writes first).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipetransformer.autocache.layout import (
    TAG_BYTES,
    CacheManifest,
    SplitLayout,
    SplitRequest,
    plan_layout,
)
from pipetransformer.autocache.private import (
    DISK_SUFFIX,
    create_file,
    make_private_dir,
    mark_kept,
    open_private_dir,
    open_private_file,
    sweep_stale_stores,
    write_new_file,
    write_owner,
)

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_MANIFEST_STAGING = f".{MANIFEST_FILE}.tmp"

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_BOOT = "from pipetransformer.autocache.daemon import main; main()"
# Head-room left free in /dev/shm when the budget is larger than what tmpfs can hold.
_SHM_SPARE_FRACTION = 0.1


def shm_capacity(free_bytes: int, reserve_bytes: int, tag_bytes: int) -> int:
    """What the memory tier may take of a tmpfs with `free_bytes` free: all but the spare
    fraction, the bytes reserved for others (NCCL) and the tags."""
    return int(free_bytes * (1 - _SHM_SPARE_FRACTION)) - reserve_bytes - tag_bytes


def shm_dir() -> Path:
    """/dev/shm where it exists (Linux); elsewhere a temporary directory (not RAM-backed)."""
    path = Path("/dev/shm")
    if path.is_dir() and os.access(path, os.W_OK):
        return path
    logger.warning("/dev/shm is not available; the memory tier lives in %s", tempfile.gettempdir())
    return Path(tempfile.gettempdir())


def default_memory_budget() -> int:
    """A quarter of the memory currently available (MemAvailable on Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 4
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return text[text.rindex(")") + 2 :].split()


def process_start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot): tells a reused pid apart."""
    try:
        fields = _proc_stat(pid)
    except OSError:
        return None
    return int(fields[19]) if fields else None


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True while `pid` runs; a zombie or a different process under the same pid is gone."""
    try:
        fields = _proc_stat(pid)
    except OSError:  # no /proc: fall back to signal 0 (cannot tell zombies apart)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start_ticks is None or int(fields[19]) == start_ticks


def read_manifest(path: Path) -> CacheManifest:
    """A store's manifest, read only from a private directory of this user."""
    fd = open_private_file(path, os.O_RDONLY)
    with os.fdopen(fd) as f:
        return CacheManifest.from_json(f.read())


def remove_store_files(shm_store: Path, disk_store: Path, keep: bool) -> None:
    """Remove a store's private shared-memory directory and (unless `keep`) its disk tier."""
    shutil.rmtree(shm_store, ignore_errors=True)  # rmtree never follows a symlink
    if keep:
        if disk_store.exists():
            try:
                mark_kept(disk_store)
            except OSError as error:  # the files stay all the same; only the marker is missing
                logger.warning("could not mark %s as kept: %s", disk_store, error)
            logger.info("cache.keep: the disk tier stays in %s", disk_store)
    else:
        shutil.rmtree(disk_store, ignore_errors=True)


class CacheDaemon:
    """Handle held by the process that started the daemon. Not picklable: pass `address`."""

    def __init__(
        self, process: subprocess.Popen, shm_store: Path, disk_store: Path, keep: bool
    ) -> None:
        self._process = process
        self._owner_pid = os.getpid()
        self._stopped = False
        self.name = shm_store.name
        self.address = str(shm_store / MANIFEST_FILE)
        self.disk_dir = disk_store
        self.keep = keep
        self._shm_store = shm_store
        self.manifest = read_manifest(Path(self.address))

    @classmethod
    def start(
        cls,
        splits: Mapping[str, tuple[int, Sequence[Any]]],
        memory_budget_bytes: int | None = None,
        disk_dir: str | os.PathLike | None = None,
        storage_dtype: str = "float32",
        keep: bool = False,
        watched_pids: Sequence[int] = (),
        poll_interval_s: float = 0.25,
        start_timeout_s: float = 60.0,
        shm_reserve_bytes: int = 0,
    ) -> CacheDaemon:
        """Start the node's daemon and wait until its files exist.

        `splits` maps a split name to (num_samples, specs) or, for text, (num_samples,
        specs, lengths, max_length): a spec is any object with `.shape`, `.dtype` (and
        `.sequence` when its first dimension holds the tokens) or a (shape, dtype[,
        sequence]) tuple; sequence fields are stored at each sample's real length
        (layout.py). `memory_budget_bytes` None: a
        quarter of the available memory. `disk_dir` None: the system temporary directory.
        The store's own private directory `<disk_dir>/ptcache-<uid>-<random>-disk` is
        removed at cleanup unless `keep`. Stale stores of this user, under /dev/shm and
        `disk_dir`, are removed first (private.py says which are stale).
        `shm_reserve_bytes`: left free in /dev/shm besides the spare fraction (NCCL's
        intra-node buffers live there, and are built again at every transition).
        """
        shm_parent = shm_dir()
        # Absolute: the owner record and the manifest must mean the same from any directory.
        disk_parent = Path(disk_dir if disk_dir is not None else tempfile.gettempdir()).absolute()
        budget = default_memory_budget() if memory_budget_bytes is None else memory_budget_bytes
        request = {
            "splits": {k: SplitRequest.of(v).to_json() for k, v in splits.items()},
            "memory_budget_bytes": int(budget),
            "storage_dtype": storage_dtype,
            "keep": keep,
            "watched_pids": [int(p) for p in watched_pids],
            "parent_pid": os.getpid(),
            "poll_interval_s": poll_interval_s,
            "shm_reserve_bytes": int(shm_reserve_bytes),
        }
        # Checks the request here, so that a bad spec fails in the caller, not in the daemon.
        plan_layout(
            request["splits"],
            request["memory_budget_bytes"],
            storage_dtype,
            shm_parent,
            disk_parent,
            "check",
        )
        sweep_stale_stores(shm_parent, disk_parent, process_alive)
        shm_store = make_private_dir(shm_parent)
        try:
            disk_store = make_private_dir(disk_parent, DISK_SUFFIX)
        except BaseException:
            shutil.rmtree(shm_store, ignore_errors=True)
            raise
        request.update(name=shm_store.name, shm_dir=str(shm_store), disk_dir=str(disk_store))
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        # The request goes through stdin: nothing about the store shows in the command line.
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C aimed at the trainers does not reach it
            env=env,
        )
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(request).encode())
        process.stdin.close()
        readable, _, _ = select.select([process.stdout], [], [], start_timeout_s)
        line = process.stdout.readline() if readable else b""
        process.stdout.close()
        if line.strip() != b"ready":
            if process.poll() is None:
                process.kill()
            code = process.wait()
            remove_store_files(shm_store, disk_store, keep=False)
            raise RuntimeError(
                f"the cache daemon did not start (exit code {code}); see its log above"
            )
        daemon = cls(process, shm_store, disk_store, keep)
        atexit.register(daemon.stop)
        logger.debug("cache daemon %s started (pid %d)", daemon.name, process.pid)
        return daemon

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the daemon and wait until it has removed its files. Idempotent."""
        if self._stopped or os.getpid() != self._owner_pid:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "cache daemon %s did not stop in %.0f s; killing it", self.name, timeout_s
                )
                self._process.kill()
                self._process.wait()
        if self._process.returncode != 0:
            logger.warning(
                "cache daemon %s exited with code %s; removing what it left",
                self.name,
                self._process.returncode,
            )
            remove_store_files(self._shm_store, self.disk_dir, self.keep)

    def __enter__(self) -> CacheDaemon:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# ------------------------------------------------------------------ the daemon process


def _create_file(dir_fd: int, path: str, size: int, reserve: bool, tag_count: int = 0) -> None:
    # `path` lies in the directory of `dir_fd` (plan_layout put it there); the name is
    # created relative to the checked descriptor, O_EXCL | O_NOFOLLOW, mode 0600.
    fd = create_file(dir_fd, Path(path).name)
    try:
        if reserve:  # tmpfs: fail now with ENOSPC rather than SIGBUS on a later write
            os.posix_fallocate(fd, 0, size)
        else:  # disk: sparse, blocks are allocated as slots are written
            os.ftruncate(fd, size)
        if tag_count:
            os.pwrite(fd, b"\xff" * (tag_count * TAG_BYTES), 0)  # int64 -1 = absent
    finally:
        os.close(fd)


def _create_store(request: dict[str, Any], shm_fd: int, disk_fd: int) -> CacheManifest:
    """Every file of the store, relative to the descriptors of its two private directories."""
    name = request["name"]
    shm_store, disk_store = Path(request["shm_dir"]), Path(request["disk_dir"])
    splits = request["splits"]
    budget = request["memory_budget_bytes"]
    usage = shutil.disk_usage(shm_store)
    tag_bytes = sum(SplitRequest.of(v).num_samples * TAG_BYTES for v in splits.values())
    reserve = int(request.get("shm_reserve_bytes", 0))
    shm_cap = shm_capacity(usage.free, reserve, tag_bytes)
    if budget > shm_cap:
        logger.warning(
            "memory budget %d bytes exceeds what %s can hold (less %d bytes kept for NCCL); "
            "using %d",
            budget,
            shm_store.parent,
            reserve,
            max(0, shm_cap),
        )
        budget = max(0, shm_cap)
    layouts = plan_layout(splits, budget, request["storage_dtype"], shm_store, disk_store, "store")
    disk_bytes = sum(layout.disk_bytes for layout in layouts)
    if disk_bytes > shutil.disk_usage(disk_store).free:
        raise OSError(f"the disk tier needs {disk_bytes} bytes; {disk_store} has less free")
    for layout in layouts:
        _create_file(
            shm_fd, layout.shm_path, layout.shm_bytes, reserve=True, tag_count=layout.num_samples
        )
        if layout.disk_path is not None:
            _create_file(disk_fd, layout.disk_path, layout.disk_bytes, reserve=False)
    manifest = CacheManifest(
        name=name,
        daemon_pid=os.getpid(),
        storage_dtype=request["storage_dtype"],
        disk_dir=str(disk_store),
        keep=request["keep"],
        splits=tuple(layouts),
    )
    text = manifest.to_json()
    write_new_file(disk_fd, MANIFEST_FILE, text)  # what a kept disk tier holds, for people
    write_new_file(shm_fd, _MANIFEST_STAGING, text)
    # Atomic, and inside the private directory: a client sees no manifest or a whole one.
    os.replace(_MANIFEST_STAGING, MANIFEST_FILE, src_dir_fd=shm_fd, dst_dir_fd=shm_fd)
    _log_layout(layouts)
    return manifest


def _log_layout(layouts: Sequence[SplitLayout]) -> None:
    for layout in layouts:
        logger.debug(
            "split %s: %d samples, %d bytes at full length, %d in memory, %d on disk",
            layout.name,
            layout.num_samples,
            layout.full_sample_bytes,
            layout.memory_rows,
            layout.disk_rows,
        )


def _wait_for_shutdown(request: dict[str, Any]) -> str:
    """Block until a stop signal, the starter's death or every watched pid's death."""
    watched = {pid: process_start_ticks(pid) for pid in request["watched_pids"]}
    while True:
        if os.getppid() != request["parent_pid"]:
            return "the process that started it exited"
        if watched and not any(process_alive(pid, ticks) for pid, ticks in watched.items()):
            return "every watched trainer process exited"
        info = signal.sigtimedwait(_STOP_SIGNALS, request["poll_interval_s"])
        if info is not None:
            return f"received {signal.Signals(info.si_signo).name}"


def main() -> None:
    """Entry of the daemon process: create the store, wait, always clean up. The request
    comes on stdin: a command line is readable by every local user (/proc/PID/cmdline)."""
    # Blocked signals stay pending until sigtimedwait takes them, so none can cut the
    # creation or the cleanup short.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    from pipetransformer.utils.logging import setup_logging

    setup_logging(rank="cache")
    request = json.loads(sys.stdin.read())
    name = request["name"]
    shm_store, disk_store = Path(request["shm_dir"]), Path(request["disk_dir"])
    code = 0
    fds: list[int] = []
    try:
        for directory in (shm_store, disk_store):
            fds.append(open_private_dir(directory))
        # First, before any data file: the records that let a later start sweep this store.
        owner = (os.getpid(), process_start_ticks(os.getpid()), disk_store, request["keep"])
        for fd in fds:
            write_owner(fd, *owner)
        _create_store(request, *fds)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        reason = _wait_for_shutdown(request)
        logger.debug("cache %s: %s; removing its files", name, reason)
    except Exception:
        logger.exception("cache daemon %s failed", name)
        code = 1
    finally:
        for fd in fds:
            os.close(fd)
        remove_store_files(shm_store, disk_store, request["keep"])
    sys.exit(code)
