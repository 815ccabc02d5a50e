"""AutoCache storage: values, tags, tiers, prefetch, cross-process sharing and cleanup;
who may touch a store (private directories, planted symlinks) and sweeping stale ones.

Unit tests plan layouts and judge stale stores without processes; the rest start real
daemons (a fresh Python process each, ~0.1 s) and, where a second trainer process
matters, spawn one. Tolerances:
float32 and integers round-trip exactly; float16/bfloat16 return exactly
`x.to(dtype).float()`, i.e. within one rounding of the storage dtype (relative 2**-11 and
2**-8).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipetransformer.autocache import CacheClient, CacheDaemon, default_memory_budget
from pipetransformer.autocache.daemon import process_alive, shm_dir
from pipetransformer.autocache.layout import plan_layout
from pipetransformer.autocache.private import STALE_WITHOUT_OWNER_S

VIT_SPECS = [((17, 64), torch.float32)]
BERT_SPECS = [((128, 384), torch.float32), ((128,), torch.int64)]
BIG_BUDGET = 1 << 30


class Spec:  # stands in for models.layered.TensorSpec, which autocache must not import
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def full_bytes(specs, storage_dtype: str = "float32") -> int:
    """Stored bytes of one sample of `specs` at its whole shape."""
    layout = plan_layout({"s": (1, specs)}, 0, storage_dtype, "/tmp", "/tmp", "x")[0]
    return layout.full_sample_bytes


def residue(name: str) -> list[str]:
    return sorted(p.name for p in shm_dir().glob(f"{name}*"))


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def sample_values(specs, ids, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in specs:
        if dtype.is_floating_point:
            out.append(torch.randn((len(ids), *shape), generator=generator))
        else:
            out.append(torch.randint(0, 2, (len(ids), *shape), generator=generator, dtype=dtype))
    return out


@pytest.fixture
def start_daemon(tmp_path):
    """Start daemons with a disk dir under tmp_path; stop them and check no residue."""
    daemons = []

    def start(splits, **kwargs):
        kwargs.setdefault("memory_budget_bytes", BIG_BUDGET)
        kwargs.setdefault("disk_dir", tmp_path / "cache")
        daemon = CacheDaemon.start(splits, **kwargs)
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.stop()
        assert residue(daemon.name) == []
        assert daemon.keep or not daemon.disk_dir.exists()


# ---------------------------------------------------------------- unit: layout, no processes


def test_plan_layout_fills_the_budget_in_split_order(tmp_path):
    specs = [((17, 64), "float32")]
    sample = full_bytes(specs)
    assert sample == 17 * 64 * 4 and sample % 64 == 0
    splits = {"train": (10, specs), "eval": (10, specs)}
    train, evaluation = plan_layout(splits, 13 * sample + 5, "float32", tmp_path, tmp_path, "x")
    assert (train.memory_rows, train.disk_rows) == (10, 0) and train.disk_path is None
    assert (evaluation.memory_rows, evaluation.disk_rows) == (3, 7)
    assert evaluation.shm_bytes == evaluation.slots_offset + 3 * sample
    assert evaluation.slots_offset % 4096 == 0 and evaluation.slots_offset >= 10 * 8


def test_field_regions_are_aligned_and_integers_stay_exact(tmp_path):
    specs = [((3,), "float32"), ((5,), "int64"), ((), "bool")]
    (layout,) = plan_layout({"s": (3, specs)}, 1 << 20, "bfloat16", tmp_path, tmp_path, "x")
    assert [f.stored_dtype for f in layout.fields] == ["bfloat16", "int64", "bool"]
    assert [f.returned_dtype for f in layout.fields] == ["float32", "int64", "bool"]
    # 3 samples a field, each field's region 64-byte aligned: 18, 120 and 3 bytes.
    assert layout.region_offsets(0, 3) == [0, 64, 192]
    assert layout.tier_bytes(0, 3) == 256 and layout.full_sample_bytes == 6 + 40 + 1


def test_reduced_precision_halves_float_samples():
    full = full_bytes([((17, 64), "float32")])
    for dtype in ("float16", "bfloat16"):
        assert full_bytes([((17, 64), "float32")], dtype) * 2 == full


def test_text_is_stored_at_each_samples_real_length(tmp_path):
    """A sequence field takes a sample's real length plus its extra rows (DeBERTa's table),
    so a budget holds more short samples; the memory tier is counted at real lengths."""
    specs = [((20, 8), "float32", True), ((16,), "int64", True)]
    lengths = [3, 5, 16, 1, 0, 8]
    request = (6, specs, lengths, 16)
    (layout,) = plan_layout({"s": request}, 1 << 20, "float32", tmp_path, tmp_path, "x")
    assert [layout.sample_bytes(i) for i in range(6)] == [(v + 4) * 8 * 4 + v * 8 for v in lengths]
    assert layout.field_rows(layout.fields[0], 0, 6) == sum(lengths) + 6 * 4
    # The first three samples take (3+5+16) + 3*4 = 36 rows of 32 bytes (1152) and 24
    # tokens of 8 bytes (192): 1344 bytes; with a fourth (length 1) the regions take 1600.
    (tight,) = plan_layout({"s": request}, 1344 + 63, "float32", tmp_path, tmp_path, "x")
    assert tight.memory_rows == 3 and tight.disk_rows == 3
    for bad, match in (
        ((6, specs, lengths[:5], 16), "5 lengths"),
        ((6, specs, [17] * 6, 16), "in \\[0, 16\\]"),
        ((6, specs, lengths), "max_length"),
        ((6, [((12, 8), "float32", True)], lengths, 16), "shorter"),
    ):
        with pytest.raises(ValueError, match=match):
            plan_layout({"s": bad}, 0, "float32", tmp_path, tmp_path, "x")


def test_bad_requests_fail_in_the_caller(tmp_path):
    with pytest.raises(ValueError, match="storage dtype"):
        CacheDaemon.start({"train": (4, VIT_SPECS)}, storage_dtype="int8", disk_dir=tmp_path)
    with pytest.raises(ValueError, match="num_samples"):
        CacheDaemon.start({"train": (0, VIT_SPECS)}, disk_dir=tmp_path)
    assert default_memory_budget() > 0


def test_daemon_module_does_not_import_torch():
    code = "import sys, pipetransformer.autocache.daemon; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------- values and tags


@pytest.mark.parametrize("specs", [VIT_SPECS, BERT_SPECS], ids=["vit", "bert"])
def test_write_then_read_is_exact_in_float32(start_daemon, specs):
    daemon = start_daemon({"train": (40, [Spec(*s) for s in specs])})
    ids = [3, 17, 0, 39, 8]
    values = sample_values(specs, ids, seed=1)
    with CacheClient.attach(daemon.address) as client:
        client.write("train", ids, 2, values)
        tags, tensors = client.read("train", [39, 3, 8])
        assert tags.tolist() == [2, 2, 2]
        assert len(tensors) == len(specs)
        for got, want in zip(tensors, values):
            assert got.dtype == (torch.float32 if want.is_floating_point() else torch.int64)
            assert torch.equal(got, want[[3, 0, 4]])


@pytest.mark.parametrize("storage_dtype", ["float16", "bfloat16"])
def test_reduced_precision_round_trips_and_halves_bytes(start_daemon, storage_dtype):
    ids = list(range(16))
    values = sample_values(BERT_SPECS, ids, seed=2)
    footprint = {}
    for dtype in ("float32", storage_dtype):
        daemon = start_daemon(
            {"vit": (16, VIT_SPECS), "bert": (16, BERT_SPECS)}, storage_dtype=dtype
        )
        with CacheClient.attach(daemon.address) as client:
            client.write("vit", ids, 1, sample_values(VIT_SPECS, ids, 3))
            client.write("bert", ids, 1, values)
            _, (hidden, mask) = client.read("bert", ids)
            assert hidden.dtype == torch.float32
            assert torch.equal(hidden, values[0].to(getattr(torch, dtype)).float())
            torch.testing.assert_close(hidden, values[0], rtol=2**-7, atol=1e-6)
            assert torch.equal(mask, values[1])
            footprint[dtype] = client.layout("vit").full_sample_bytes * 16
            assert client.stats().bytes_in_memory >= footprint[dtype]
    assert footprint[storage_dtype] * 2 == footprint["float32"]


def test_tags_absent_overwrite_and_splits_do_not_collide(start_daemon):
    daemon = start_daemon({"train": (8, VIT_SPECS), "eval": (8, VIT_SPECS)})
    with CacheClient.attach(daemon.address) as client:
        tags, _ = client.read("train", range(8))
        assert (tags == -1).all()
        first, second, other = (sample_values(VIT_SPECS, [0, 1], seed) for seed in (4, 5, 6))
        client.write("train", [0, 1], 1, first)
        client.write("eval", [0, 1], 5, other)
        client.write("train", [1, 0], 3, second)  # an upgrade, in another order
        tags, (train,) = client.read("train", [0, 1, 2])
        assert tags.tolist() == [3, 3, -1]
        assert torch.equal(train[:2], second[0][[1, 0]])
        tags, (evaluation,) = client.read("eval", [0, 1])
        assert tags.tolist() == [5, 5] and torch.equal(evaluation, other[0])


def test_bad_arguments_are_rejected(start_daemon):
    daemon = start_daemon({"train": (8, BERT_SPECS)})
    with CacheClient.attach(daemon.address) as client:
        good = sample_values(BERT_SPECS, [0, 1], 0)
        with pytest.raises(ValueError, match="expected shape"):
            client.write("train", [0, 1], 1, [good[0][:, :5], good[1]])
        with pytest.raises(ValueError, match="2 tensors"):
            client.write("train", [0, 1], 1, good[:1])
        with pytest.raises(ValueError, match="repeat"):
            client.write("train", [1, 1], 1, good)
        with pytest.raises(IndexError):
            client.read("train", [8])
        with pytest.raises(KeyError, match="eval"):
            client.read("eval", [0])
    with pytest.raises(FileNotFoundError, match="not running"):
        CacheClient.attach(str(shm_dir() / "ptcache-none.json"))


def test_stats_count_hits_misses_bytes_and_upgrades(start_daemon):
    daemon = start_daemon({"train": (10, BERT_SPECS)})
    with CacheClient.attach(daemon.address) as client:
        client.write("train", [1, 4, 7], 2, sample_values(BERT_SPECS, [1, 4, 7], 0))
        client.read("train", [0, 1, 2, 3, 4])
        client.read("train", [7, 8])
        client.count_upgrades(3)
        stats = client.stats()
        row_bytes = 128 * 384 * 4 + 128 * 8
        assert (stats.hits, stats.misses, stats.upgrades) == (3, 4, 3)
        assert stats.bytes_read == 3 * row_bytes and stats.bytes_written == 3 * row_bytes
        assert stats.read_seconds > 0 and stats.read_bytes_per_s > 0
        assert stats.bytes_in_memory == 3 * client.layout("train").full_sample_bytes
        assert stats.bytes_on_disk == 0
        client.reset_stats()
        assert client.stats().hits == 0 and client.stats().bytes_in_memory > 0


def test_a_row_rewritten_during_a_read_is_reported_absent(start_daemon):
    daemon = start_daemon({"train": (8, VIT_SPECS)})
    with CacheClient.attach(daemon.address) as reader, CacheClient.attach(daemon.address) as writer:
        reader.write("train", range(8), 1, sample_values(VIT_SPECS, range(8), 0))
        store = reader._stores["train"]
        gather = store.gather

        def gather_while_another_process_writes(*args, **kwargs):
            writer.write("train", [2, 5], 2, sample_values(VIT_SPECS, [2, 5], 1))
            return gather(*args, **kwargs)

        store.gather = gather_while_another_process_writes
        tags, _ = reader.read("train", range(8))
        assert tags.tolist() == [1, 1, -1, 1, 1, -1, 1, 1]  # possibly torn: not a hit
        assert reader.stats().misses == 2


# ---------------------------------------------------------------- disk tier and prefetch


def test_disk_tier_returns_the_same_values_and_prefetch_serves_them(start_daemon):
    specs = BERT_SPECS
    slot = full_bytes(BERT_SPECS)
    ids = list(range(48))
    values = sample_values(specs, ids, seed=7)
    reads = {}
    for budget in (BIG_BUDGET, 5 * slot):
        daemon = start_daemon({"train": (48, specs)}, memory_budget_bytes=budget)
        with CacheClient.attach(daemon.address) as client:
            client.write("train", ids, 4, values)
            order = np.random.default_rng(0).permutation(48).tolist()
            reads[budget] = client.read("train", order)
            assert (reads[budget][0] == 4).all()
            assert torch.equal(reads[budget][1][0], values[0][order])
    assert all(torch.equal(a, b) for a, b in zip(reads[BIG_BUDGET][1], reads[5 * slot][1]))
    # The last daemon has 5 rows in memory and 43 on disk.
    with CacheClient.attach(daemon.address) as client:
        assert client.layout("train").memory_rows == 5
        assert client.stats().bytes_on_disk == 43 * slot
        client.prefetch("train", order, window_rows=16)
        assert wait_until(lambda: client.buffered_rows("train") == 16)
        batch = order[:16]
        tags, (hidden, mask) = client.read("train", batch)
        stats = client.stats()
        assert stats.prefetched_rows == sum(i >= 5 for i in batch) and stats.prefetched_rows > 0
        assert stats.disk_rows_read == 0
        assert torch.equal(hidden, values[0][batch]) and torch.equal(mask, values[1][batch])
        # The window slides: the thread refills behind the reader, never beyond 16 rows.
        assert wait_until(lambda: client.buffered_rows("train") == 16)
        tags, (hidden, _) = client.read("train", order[16:])
        assert torch.equal(hidden, values[0][order[16:]]) and (tags == 4).all()
        assert client.buffered_rows("train") == 0


def test_reads_while_the_prefetch_thread_gathers_return_the_stored_rows(start_daemon):
    """The prefetch thread gathers disk-tier chunks while the reading thread gathers the
    rows it was not handed: each through its own scratch rows (a shared one let one thread
    copy out rows the other had just overwritten: a step read another sample's values)."""
    specs = BERT_SPECS
    ids = list(range(48))
    values = sample_values(specs, ids, seed=3)
    daemon = start_daemon({"train": (48, specs)}, memory_budget_bytes=5 * full_bytes(specs))
    with CacheClient.attach(daemon.address) as client:
        client.write("train", ids, 2, values)
        order = np.random.default_rng(1).permutation(48).tolist()
        for _ in range(20):
            client.prefetch("train", order, window_rows=8)
            for start in range(0, 48, 6):  # reads race the thread's refills
                batch = order[start : start + 6]
                tags, (hidden, mask) = client.read("train", batch)
                assert (tags == 2).all()
                assert torch.equal(hidden, values[0][batch]) and torch.equal(mask, values[1][batch])


@pytest.mark.parametrize("storage_dtype", ["float32", "float16"])
def test_read_into_reused_out_buffers(start_daemon, storage_dtype):
    slot = full_bytes(BERT_SPECS, storage_dtype)
    daemon = start_daemon(
        {"train": (24, BERT_SPECS)}, memory_budget_bytes=6 * slot, storage_dtype=storage_dtype
    )
    values = sample_values(BERT_SPECS, range(24), seed=12)
    with CacheClient.attach(daemon.address) as client:
        client.write("train", range(24), 1, values)
        out = (torch.empty(8, 128, 384), torch.empty(8, 128, dtype=torch.int64))
        client.prefetch("train", [9, 10, 11], window_rows=3)
        assert wait_until(lambda: client.buffered_rows("train") == 3)
        # memory only, disk only, mixed, mixed with prefetched rows
        for batch in (
            [0, 5, 1, 2, 3, 4, 0, 5],
            list(range(16, 24)),
            list(range(2, 10)),
            list(range(4, 12)),
        ):
            _, tensors = client.read("train", batch, out=out)
            assert all(got is buffer for got, buffer in zip(tensors, out))
            want = values[0][batch].to(getattr(torch, storage_dtype)).float()
            assert torch.equal(out[0], want) and torch.equal(out[1], values[1][batch])
        assert client.stats().prefetched_rows == 3  # 9, then 10 and 11
        with pytest.raises(ValueError, match="out\\[1\\]"):
            client.read("train", range(8), out=(out[0], out[1].float()))


def test_prefetched_rows_that_are_rewritten_are_not_served_stale(start_daemon):
    daemon = start_daemon({"train": (32, VIT_SPECS)}, memory_budget_bytes=0)
    ids = list(range(32))
    old, new = sample_values(VIT_SPECS, ids, 8), sample_values(VIT_SPECS, ids, 9)
    with CacheClient.attach(daemon.address) as writer, CacheClient.attach(daemon.address) as reader:
        writer.write("train", ids, 1, old)
        reader.prefetch("train", ids, window_rows=32)
        assert wait_until(lambda: reader.buffered_rows("train") == 32)
        writer.write("train", ids[:10], 2, [new[0][:10]])  # another client upgrades 10 rows
        tags, (got,) = reader.read("train", ids)
        assert tags.tolist() == [2] * 10 + [1] * 22
        assert torch.equal(got[:10], new[0][:10]) and torch.equal(got[10:], old[0][10:])
        assert reader.stats().prefetched_rows == 22


def test_a_prefetch_hint_that_is_never_read_is_harmless(start_daemon):
    daemon = start_daemon({"train": (64, VIT_SPECS)}, memory_budget_bytes=0)
    client = CacheClient.attach(daemon.address)
    client.write("train", range(64), 1, sample_values(VIT_SPECS, range(64), 0))
    client.prefetch("train", range(64), window_rows=8)
    assert wait_until(lambda: client.buffered_rows("train") == 8)
    time.sleep(0.1)
    assert client.buffered_rows("train") == 8  # bounded: it waits for the reader
    client.prefetch("train", [60, 61], window_rows=8)  # a new hint replaces the old one
    assert wait_until(lambda: client.buffered_rows("train") == 2)
    client.close()
    client.close()


def test_prefetch_moves_on_past_absent_rows(start_daemon):
    daemon = start_daemon({"train": (32, VIT_SPECS)}, memory_budget_bytes=0)
    with CacheClient.attach(daemon.address) as client:
        client.write("train", range(16, 32), 1, sample_values(VIT_SPECS, range(16, 32), 0))
        client.prefetch("train", range(32), window_rows=8)
        time.sleep(0.1)
        assert client.buffered_rows("train") == 0  # the window covers absent rows only
        tags, _ = client.read("train", range(8))
        assert (tags == -1).all()
        tags, _ = client.read("train", range(8, 16))  # the window now reaches present rows
        assert wait_until(lambda: client.buffered_rows("train") == 8)
        tags, _ = client.read("train", range(16, 24))
        assert (tags == 1).all() and client.stats().prefetched_rows == 8


# ---------------------------------------------------------------- several processes


def _second_process(address: str, results) -> None:
    torch.set_num_threads(1)
    client = CacheClient.attach(address)
    ids = list(range(24))
    tags, (hidden, mask) = client.read("train", ids)
    values = sample_values(BERT_SPECS, ids, seed=10)
    equal = torch.equal(hidden, values[0]) and torch.equal(mask, values[1])
    client.write("train", range(24, 40), 6, sample_values(BERT_SPECS, range(24, 40), seed=11))
    results.put((tags.tolist(), equal, client.stats().hits))
    client.close()


def test_two_processes_see_each_others_writes(start_daemon, capfd):
    slot = full_bytes(BERT_SPECS)
    daemon = start_daemon({"train": (40, BERT_SPECS)}, memory_budget_bytes=10 * slot)
    with CacheClient.attach(daemon.address) as client:
        client.write("train", range(24), 5, sample_values(BERT_SPECS, range(24), seed=10))
        context = mp.get_context("spawn")
        results = context.Queue()
        child = context.Process(target=_second_process, args=(daemon.address, results))
        child.start()  # attaches after the writes, like a replica created at a transition
        tags, equal, hits = results.get(timeout=60)
        child.join(timeout=30)
        assert child.exitcode == 0
        assert tags == [5] * 24 and equal and hits == 24
        tags, (hidden, mask) = client.read("train", range(24, 40))
        want = sample_values(BERT_SPECS, range(24, 40), seed=11)
        assert (tags == 6).all() and torch.equal(hidden, want[0]) and torch.equal(mask, want[1])
    assert "resource_tracker" not in capfd.readouterr().err


# ---------------------------------------------------------------- cleanup


def test_stop_removes_everything_and_keep_keeps_the_disk_dir(start_daemon, tmp_path):
    daemon = start_daemon({"train": (8, VIT_SPECS)}, memory_budget_bytes=0)
    # One private directory in /dev/shm.
    assert len(residue(daemon.name)) == 1 and (daemon.disk_dir / "train.slots").exists()
    daemon.stop()
    daemon.stop()
    assert residue(daemon.name) == [] and not daemon.disk_dir.exists() and not daemon.alive()
    kept = start_daemon({"train": (8, VIT_SPECS)}, memory_budget_bytes=0, keep=True)
    kept.stop()
    assert residue(kept.name) == [] and (kept.disk_dir / "train.slots").exists()


def test_an_exception_in_the_trainer_still_cleans_up(tmp_path):
    with pytest.raises(RuntimeError, match="trainer failed"):
        with CacheDaemon.start(
            {"train": (8, VIT_SPECS)}, memory_budget_bytes=0, disk_dir=tmp_path
        ) as daemon:
            with CacheClient.attach(daemon.address) as client:
                client.write("train", [0], 1, sample_values(VIT_SPECS, [0], 0))
                raise RuntimeError("trainer failed")
    assert residue(daemon.name) == [] and not daemon.disk_dir.exists() and not daemon.alive()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_signalled_daemon_leaves_nothing(start_daemon, how):
    daemon = start_daemon({"train": (8, VIT_SPECS)}, memory_budget_bytes=0)
    os.kill(daemon.pid, getattr(signal, how))
    assert wait_until(lambda: not daemon.alive())
    if how == "SIGTERM":  # it cleans up itself
        assert residue(daemon.name) == [] and not daemon.disk_dir.exists()
    daemon.stop()  # after SIGKILL, stop() sweeps what it left
    assert residue(daemon.name) == [] and not daemon.disk_dir.exists()


def _attached_trainer(addresses, ready) -> None:
    torch.set_num_threads(1)
    client = CacheClient.attach(addresses.get(timeout=60))
    client.write("train", [0], 1, sample_values(VIT_SPECS, [0], 0))
    ready.put(True)
    time.sleep(120)


def test_sigkill_of_the_watched_trainers_cleans_up(start_daemon):
    context = mp.get_context("spawn")
    addresses, ready = context.Queue(), context.Queue()
    trainer = context.Process(target=_attached_trainer, args=(addresses, ready))
    trainer.start()
    try:
        daemon = start_daemon(
            {"train": (8, VIT_SPECS)}, memory_budget_bytes=0, watched_pids=[trainer.pid]
        )
        addresses.put(daemon.address)
        assert ready.get(timeout=60)
        os.kill(trainer.pid, signal.SIGKILL)  # not reaped yet: a zombie counts as gone
        assert wait_until(lambda: not daemon.alive(), timeout_s=5)
        assert daemon._process.returncode == 0  # the daemon cleaned up, not a sweep
        assert residue(daemon.name) == [] and not daemon.disk_dir.exists()
    finally:
        trainer.kill()
        trainer.join()


def test_the_death_of_the_starter_cleans_up(tmp_path):
    code = (
        "import os, sys, time\n"
        "from pipetransformer.autocache import CacheDaemon\n"
        f"d = CacheDaemon.start({{'train': (8, [((4,), 'float32')])}}, memory_budget_bytes=0, "
        f"disk_dir={str(tmp_path)!r})\n"
        "print(d.name, d.pid, d.disk_dir, flush=True)\n"
        "time.sleep(120)\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    name, pid, disk_dir = starter.stdout.readline().split()
    try:
        assert residue(name) and Path(disk_dir).exists()
        starter.kill()
        starter.wait()
        assert wait_until(lambda: not process_alive(int(pid)), timeout_s=5)
        assert residue(name) == [] and not Path(disk_dir).exists()
        assert "resource_tracker" not in starter.stderr.read()
    finally:
        starter.kill()
        if process_alive(int(pid)):  # only when the test failed: do not leak its daemon
            os.kill(int(pid), signal.SIGTERM)


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
