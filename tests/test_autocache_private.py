"""AutoCache: who may touch a store (private directories, planted symlinks, files a client
cannot trust) and sweeping the stale stores of killed runs. The daemon fixture and helpers
are test_autocache.py's."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_autocache import BIG_BUDGET, VIT_SPECS, daemon_starter, sample_values

from pipetransformer.autocache import CacheClient, CacheDaemon
from pipetransformer.autocache.daemon import shm_dir
from pipetransformer.autocache.private import STALE_WITHOUT_OWNER_S


@pytest.fixture
def start_daemon(tmp_path):
    with daemon_starter(tmp_path) as start:
        yield start


# ---------------------------------------------------------------- who can touch the store


def test_the_store_is_private_and_not_on_the_command_line(start_daemon):
    import stat

    # 4 rows in memory, 4 on disk: files in both directories.
    daemon = start_daemon({"train": (8, VIT_SPECS)}, memory_budget_bytes=4 * 4352)
    shm_store = Path(daemon.address).parent
    for directory in (shm_store, daemon.disk_dir):
        info = directory.lstat()
        assert (
            stat.S_ISDIR(info.st_mode)
            and stat.S_IMODE(info.st_mode) == 0o700
            and info.st_uid == os.geteuid()
        )
        for path in directory.iterdir():
            assert (
                stat.S_IMODE(path.lstat().st_mode) == 0o600 and path.lstat().st_uid == os.geteuid()
            ), path
    assert {p.name for p in shm_store.iterdir()} == {"store-train", "manifest.json", "owner.json"}
    assert {p.name for p in daemon.disk_dir.iterdir()} == {
        "train.slots",
        "manifest.json",
        "owner.json",
    }
    cmdline = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().decode(errors="replace")
    assert shm_store.name not in cmdline and "disk" not in cmdline


def test_planted_symlinks_are_never_followed(tmp_path, monkeypatch):
    """A local attacker who knows the next store's name plants symlinks at every path it will
    create: the store takes another, fresh private directory and writes nothing outside it."""
    from pipetransformer.autocache import private

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    before = (victim.read_text(), victim.stat().st_mtime_ns)
    names = itertools.cycle(["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"])
    monkeypatch.setattr(private.secrets, "token_hex", lambda n: next(names))
    prefix = private.store_prefix()
    planted = []
    for parent, suffix in ((shm_dir(), ""), (tmp_path / "cache", "-disk")):
        parent.mkdir(exist_ok=True)
        first = parent / f"{prefix}-aaaaaaaaaaaaaaaa{suffix}"
        first.symlink_to(tmp_path)  # the directory itself
        planted.append(first)
    # And inside a directory the attacker made at the second name: it is not ours to use.
    decoy = shm_dir() / f"{prefix}-bbbbbbbbbbbbbbbb"
    decoy.mkdir(mode=0o777)
    os.chmod(decoy, 0o777)
    for name in ("store-train", "manifest.json", ".manifest.json.tmp", "owner.json"):
        (decoy / name).symlink_to(victim)
    planted.append(decoy)
    try:
        with pytest.raises(OSError):  # the only names left are taken or unsafe: refused
            CacheDaemon.start(
                {"train": (4, VIT_SPECS)},
                memory_budget_bytes=BIG_BUDGET,
                disk_dir=tmp_path / "cache",
            )
        monkeypatch.undo()
        daemon = CacheDaemon.start(
            {"train": (4, VIT_SPECS)}, memory_budget_bytes=BIG_BUDGET, disk_dir=tmp_path / "cache"
        )
        with CacheClient.attach(daemon.address) as client:
            client.write("train", [0], 1, sample_values(VIT_SPECS, [0], seed=0))
        daemon.stop()
    finally:
        for path in planted:
            if path.is_symlink():
                path.unlink()
            else:
                shutil.rmtree(path)
    assert (victim.read_text(), victim.stat().st_mtime_ns) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["victim.txt"]


def test_a_client_refuses_a_store_it_cannot_trust(start_daemon, tmp_path):
    from pipetransformer.autocache.private import UnsafeStore

    daemon = start_daemon({"train": (4, VIT_SPECS)})
    store = Path(daemon.address).parent
    os.chmod(store, 0o755)
    try:
        with pytest.raises(UnsafeStore, match="open to other users"):
            CacheClient.attach(daemon.address)
    finally:
        os.chmod(store, 0o700)
    link = tmp_path / "linked"
    link.symlink_to(store)
    with pytest.raises(UnsafeStore, match="not a directory"):
        CacheClient.attach(str(link / "manifest.json"))


def test_stale_stores_of_killed_runs_are_swept_at_the_next_start(start_daemon, tmp_path, caplog):
    """Every process SIGKILLed at once (trainer and daemon) leaves the store behind; the next
    start removes it and says so, and leaves a live store alone."""
    import logging

    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = start_daemon({"train": (4, VIT_SPECS)}, memory_budget_bytes=0)  # a disk tier to keep
    dead = CacheDaemon.start(
        {"train": (8, VIT_SPECS)},
        memory_budget_bytes=0,
        disk_dir=tmp_path / "cache",
        watched_pids=[trainer.pid],
    )
    shm_store = Path(dead.address).parent
    os.kill(dead.pid, signal.SIGKILL)
    trainer.kill()
    trainer.wait()
    dead._process.wait()
    assert shm_store.exists() and dead.disk_dir.exists()  # the leak
    dead._stopped = True  # its handle must not clean up: the sweep has to
    # A long run's store is as old as the run: age alone must not make a live store stale.
    long_ago = time.time() - 2 * STALE_WITHOUT_OWNER_S
    for directory in (Path(live.address).parent, live.disk_dir):
        os.utime(directory, (long_ago, long_ago))
    with caplog.at_level(logging.INFO, logger="pipetransformer.autocache.private"):
        fresh = start_daemon({"train": (4, VIT_SPECS)})
    assert not shm_store.exists() and not dead.disk_dir.exists()
    assert f"removed a stale AutoCache store {shm_store} left by pid {dead.pid}" in caplog.text
    assert f"removed a stale AutoCache store {dead.disk_dir} left by pid {dead.pid}" in caplog.text
    assert live.alive() and fresh.alive() and live.disk_dir.exists()
    with CacheClient.attach(live.address) as client:  # every file of the live store is there
        assert client.splits == ("train",)


def test_planted_names_are_passed_over_for_fresh_private_directories(tmp_path, monkeypatch):
    """The attacker guessed the first two names of both directories (a symlink, then a
    directory of theirs full of symlinks at every file name a store creates): the store
    skips both and runs in fresh private directories, writing nothing through the plants."""
    import stat

    from pipetransformer.autocache import private

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    before = (victim.read_text(), victim.stat().st_mtime_ns)
    # shm: aaaa, bbbb taken, cccc free; disk: aaaa-disk, bbbb-disk taken, dddd-disk free.
    names = iter(["a" * 16, "b" * 16, "c" * 16, "a" * 16, "b" * 16, "d" * 16])
    monkeypatch.setattr(private.secrets, "token_hex", lambda n: next(names))
    prefix = private.store_prefix()
    files = (
        "store-train",
        "manifest.json",
        ".manifest.json.tmp",
        "owner.json",
        "train.slots",
        "KEPT",
    )
    planted = []
    for parent, suffix in ((shm_dir(), ""), (tmp_path / "cache", "-disk")):
        parent.mkdir(exist_ok=True)
        link = parent / f"{prefix}-{'a' * 16}{suffix}"
        link.symlink_to(tmp_path)
        decoy = parent / f"{prefix}-{'b' * 16}{suffix}"
        decoy.mkdir()
        os.chmod(decoy, 0o777)
        for name in files:
            (decoy / name).symlink_to(victim)
        planted += [link, decoy]
    try:
        daemon = CacheDaemon.start(
            {"train": (8, VIT_SPECS)}, memory_budget_bytes=4 * 4352, disk_dir=tmp_path / "cache"
        )
        try:
            assert daemon.name == f"{prefix}-{'c' * 16}"
            assert daemon.disk_dir.name == f"{prefix}-{'d' * 16}-disk"
            for directory in (Path(daemon.address).parent, daemon.disk_dir):
                assert stat.S_IMODE(directory.lstat().st_mode) == 0o700
            with CacheClient.attach(daemon.address) as client:
                client.write("train", [0, 7], 1, sample_values(VIT_SPECS, [0, 7], seed=0))
        finally:
            daemon.stop()
        for decoy in planted[1::2]:  # nothing added to, or removed from, the attacker's dirs
            assert sorted(p.name for p in decoy.iterdir()) == sorted(files)
    finally:
        for path in planted:
            if path.is_symlink():
                path.unlink()
            else:
                shutil.rmtree(path)
    assert (victim.read_text(), victim.stat().st_mtime_ns) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "victim.txt"]
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_client_refuses_files_it_cannot_trust(start_daemon):
    """The manifest and the data files: open to others, a symlink, or (as root) a stranger's."""
    from pipetransformer.autocache.private import UnsafeStore

    daemon = start_daemon({"train": (4, VIT_SPECS)}, memory_budget_bytes=0)
    manifest, data = Path(daemon.address), daemon.disk_dir / "train.slots"
    for path in (manifest, data):
        os.chmod(path, 0o644)
        with pytest.raises(UnsafeStore, match=re.escape(f"{path} is open to other users")):
            CacheClient.attach(daemon.address)
        os.chmod(path, 0o600)
    real = manifest.with_name("manifest.real")
    manifest.rename(real)
    manifest.symlink_to(real)  # inside the private directory, even
    with pytest.raises(UnsafeStore, match=re.escape(f"{manifest} is a symlink")):
        CacheClient.attach(daemon.address)
    manifest.unlink()
    real.rename(manifest)
    if os.geteuid() == 0:  # only root can hand a file to someone else
        for path in (manifest.parent, manifest, data):
            owner = path.stat()
            os.chown(path, 65534, 65534)
            with pytest.raises(UnsafeStore, match=re.escape(f"{path} belongs to uid 65534")):
                CacheClient.attach(daemon.address)
            os.chown(path, owner.st_uid, owner.st_gid)
    CacheClient.attach(daemon.address).close()  # restored: trusted again


def _store_dir(parent: Path, pid: int, suffix: str = "", **changes) -> Path:
    """A private store directory as a daemon leaves it, its owner record edited by `changes`."""
    import json

    from pipetransformer.autocache import private

    path = private.make_private_dir(parent, suffix)
    fd = private.open_private_dir(path)
    try:
        private.write_owner(
            fd, pid, None, Path(changes.pop("disk_dir", path)), changes.pop("keep", False)
        )
    finally:
        os.close(fd)
    if changes:
        record = path / private.OWNER_FILE
        record.write_text(json.dumps({**json.loads(record.read_text()), **changes}))
    return path


def test_the_sweep_removes_only_this_users_stores_whose_daemon_is_gone(tmp_path, caplog):
    """The sweep's rules, without processes: `alive` stands in for the process table."""
    import logging

    from pipetransformer.autocache import private

    shm, disk, elsewhere = (tmp_path / name for name in ("shm", "disk", "elsewhere"))
    for parent in (shm, disk, elsewhere):
        parent.mkdir()
    live_pid, dead_pid = 1000, 1001
    long_ago = time.time() - 2 * STALE_WITHOUT_OWNER_S
    # Stale: a dead daemon's store, its disk tier under another cache.dir; an old directory
    # without a record.
    dead_disk = _store_dir(elsewhere, dead_pid, "-disk")
    dead = _store_dir(shm, dead_pid, disk_dir=dead_disk)
    unrecorded_old = private.make_private_dir(disk, "-disk")
    os.utime(unrecorded_old, (long_ago, long_ago))
    # Kept: a live daemon's store, however old; records from another host, boot or pid
    # namespace (a shared cache.dir or /dev/shm); a disk tier kept by cache.keep; a young
    # directory without a record (a daemon starting).
    live = _store_dir(shm, live_pid)
    live_disk = _store_dir(disk, live_pid, "-disk")
    for path in (live, live_disk):
        os.utime(path, (long_ago, long_ago))
    foreign = [
        _store_dir(disk, dead_pid, "-disk", host="another-host"),
        _store_dir(shm, dead_pid, boot_id="another-boot"),
        _store_dir(shm, dead_pid, pid_namespace="pid:[1]"),
    ]
    kept = _store_dir(disk, dead_pid, "-disk", keep=True)
    unrecorded_young = private.make_private_dir(shm)
    # Never judged, however old and unrecorded: not this package's name for this user, open
    # to others, a symlink, (as root) a stranger's.
    others = [
        shm / f"ptcache-{os.geteuid() + 1}-{'e' * 16}",
        shm / f"{private.store_prefix()}-not-hex",
        shm / f"{private.store_prefix()}-{'f' * 16}",
    ]
    if os.geteuid() == 0:
        others.append(shm / f"{private.store_prefix()}-{'9' * 16}")
    for path in others:
        path.mkdir(mode=0o700)
    os.chmod(others[2], 0o755)
    if os.geteuid() == 0:
        os.chown(others[3], 65534, 65534)
    link = shm / f"{private.store_prefix()}-{'1' * 16}"
    link.symlink_to(live)
    for path in [*others, link]:
        os.utime(path, (long_ago, long_ago), follow_symlinks=False)

    with caplog.at_level(logging.INFO, logger="pipetransformer.autocache.private"):
        removed = private.sweep_stale_stores(shm, disk, lambda pid, ticks: pid == live_pid)
    assert sorted(removed) == sorted([dead, dead_disk, unrecorded_old])
    assert f"removed a stale AutoCache store {dead} left by pid {dead_pid}" in caplog.text
    assert f"removed a stale AutoCache store {unrecorded_old} with no owner record" in caplog.text
    for path in [live, live_disk, *foreign, kept, unrecorded_young, *others, link]:
        assert os.path.lexists(path), path
    assert (live / private.OWNER_FILE).exists()
