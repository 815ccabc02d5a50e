"""AutoCache storage: values, tags, tiers, prefetch, cross-process sharing and cleanup
(who may touch a store, and sweeping stale ones: test_autocache_private.py).

Unit tests plan layouts and judge stale stores without processes; the rest start real
daemons (a fresh Python process each, ~0.1 s) and, where a second trainer process
matters, spawn one. Tolerances:
float32 and integers round-trip exactly; float16/bfloat16 return exactly
`x.to(dtype).float()`, i.e. within one rounding of the storage dtype (relative 2**-11 and
2**-8).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
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


@contextlib.contextmanager
def daemon_starter(tmp_path: Path):
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


@pytest.fixture
def start_daemon(tmp_path):
    with daemon_starter(tmp_path) as start:
        yield start


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
