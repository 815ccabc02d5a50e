"""The frozen prefix served from AutoCache equals recomputing it: hits, upgrades, misses."""

import numpy as np
import pytest
import torch
from helpers import tiny_bert, tiny_vit

from pipetransformer.autocache import CacheClient, CacheDaemon
from pipetransformer.models import UnitSequence
from pipetransformer.pipe.prefix import CachedPrefix
from pipetransformer.utils.units import prefix_end


def recompute(model, frozen, inputs):
    end = prefix_end(frozen)
    units = list(model.units)[:end]
    with torch.no_grad():
        out = UnitSequence(units, [True] * end)(*inputs)
    return out if isinstance(out, tuple) else (out,)


def vit_batch(n=12):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, 1, 8, 8, generator=g),)


def bert_batch(n=12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (n, 16), generator=g)
    mask = (torch.arange(16)[None] < torch.randint(4, 17, (n, 1), generator=g)).long()
    return ids * mask, torch.zeros_like(ids), mask


@pytest.fixture(params=["vit", "bert"])
def model_and_batch(request):
    model = tiny_vit() if request.param == "vit" else tiny_bert()
    model.eval()
    batch = vit_batch() if request.param == "vit" else bert_batch()
    return model, batch


def start_cache(model, num_samples, budget=None, dtype="float32"):
    return CacheDaemon.start(
        splits={"train": (num_samples, list(model.spec.activation_specs))},
        memory_budget_bytes=budget if budget is not None else 1 << 26,
        storage_dtype=dtype,
    )


def test_hits_upgrades_and_misses_equal_recompute(model_and_batch):
    model, inputs = model_and_batch
    units = dict(enumerate(model.units))
    ids = list(range(12))
    with start_cache(model, 12) as daemon, CacheClient.attach(daemon.address) as client:
        counts = {"hits": 0, "upgrades": 0, "misses": 0}
        # F = 1: everything misses and is stored (by the next call or a flush: a step
        # never waits for its outputs to reach the host).
        prefix1 = CachedPrefix(units, 1, client, torch.device("cpu"), counts, defer_writes=True)
        out = prefix1("train", ids, inputs)
        for got, expected in zip(out, recompute(model, 1, inputs)):
            assert torch.equal(got, expected)
        assert counts == {"hits": 0, "upgrades": 0, "misses": 12}
        assert (client.read("train", ids)[0] == -1).all()
        prefix1.flush()
        # F = 3, first 6 samples: upgraded from F = 1 by running only layers 1 and 2.
        prefix3 = CachedPrefix(units, 3, client, torch.device("cpu"), counts, defer_writes=True)
        half = [t[:6] for t in inputs]
        out = prefix3("train", ids[:6], half)
        for got, expected in zip(out, recompute(model, 3, half)):
            assert torch.equal(got, expected)
        assert counts["upgrades"] == 6
        # Whole batch at F = 3: 6 hits (upgraded once, not again) + 6 more upgrades.
        out = prefix3("train", ids, inputs)
        for got, expected in zip(out, recompute(model, 3, inputs)):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        assert counts == {"hits": 6, "upgrades": 12, "misses": 12}
        prefix3.flush()
        tags, _ = client.read("train", ids)
        assert (tags == 3).all()


def test_padding_repeats_are_looked_up_once(model_and_batch):
    model, inputs = model_and_batch
    units = dict(enumerate(model.units))
    ids = [0, 1, 2, 3, 0, 1]  # the last two rows repeat samples 0 and 1 (shape padding)
    padded = tuple(torch.cat([t[:4], t[:2]]) for t in inputs)
    with start_cache(model, 12) as daemon, CacheClient.attach(daemon.address) as client:
        counts = {"hits": 0, "upgrades": 0, "misses": 0}
        out = CachedPrefix(units, 2, client, torch.device("cpu"), counts)("train", ids, padded)
        assert counts["misses"] == 4
        expected = recompute(model, 2, padded)
        for got, want in zip(out, expected):
            assert torch.equal(got[4:], got[:2]) and torch.equal(got, want)


def test_disk_tier_serves_the_same_values():
    model = tiny_vit().eval()
    units = dict(enumerate(model.units))
    inputs = vit_batch(12)
    slot = 5 * 32 * 4
    with (
        start_cache(model, 12, budget=3 * slot) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
        filling = CachedPrefix(units, 2, client, torch.device("cpu"))
        first = filling("train", list(range(12)), inputs)
        filling.flush()
        client.prefetch("train", list(range(12)))
        prefix = CachedPrefix(units, 2, client, torch.device("cpu"))
        again = prefix("train", list(range(12)), inputs)
        assert prefix.counts["hits"] == 12 and client.stats().bytes_on_disk > 0
        assert torch.equal(first[0], again[0])


@pytest.mark.parametrize("dtype, tolerance", [("float16", 1e-2), ("bfloat16", 5e-2)])
def test_reduced_precision_within_tolerance(dtype, tolerance):
    model = tiny_vit().eval()
    units = dict(enumerate(model.units))
    inputs = vit_batch(12)
    with (
        start_cache(model, 12, dtype=dtype) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
        filling = CachedPrefix(units, 2, client, torch.device("cpu"))
        filling("train", list(range(12)), inputs)
        filling.flush()
        hit = CachedPrefix(units, 2, client, torch.device("cpu"))("train", list(range(12)), inputs)
        expected = recompute(model, 2, inputs)[0]
        relative = ((hit[0] - expected).abs().max() / expected.abs().max()).item()
        assert 0 < relative < tolerance  # rounded, but close
        assert np.isclose(client.layout("train").slot_bytes, 5 * 32 * 2, rtol=0.2)


def test_a_batch_the_loader_did_not_decode(model_and_batch):
    """The loader skips decoding a batch whose every sample is cached at the boundary
    (CacheClient.serves_all); the prefix serves it without inputs, and loads them itself
    for a sample that turns out not to be cached."""
    model, inputs = model_and_batch
    units = dict(enumerate(model.units))
    loaded = []

    def load_inputs(split, ids):
        loaded.append(list(ids))
        return [t[list(ids)] for t in inputs]

    with start_cache(model, 12) as daemon, CacheClient.attach(daemon.address) as client:
        prefix = CachedPrefix(
            units, 2, client, torch.device("cpu"), load_inputs=load_inputs, defer_writes=True
        )
        prefix("train", list(range(6)), [t[:6] for t in inputs])
        prefix.flush()
        assert client.serves_all("train", range(6), 2)
        assert not client.serves_all("train", range(7), 2)
        assert not client.serves_all("train", range(6), 3)
        out = prefix("train", list(range(6)), None)  # all hits: no inputs needed
        assert loaded == []
        expected = recompute(model, 2, [t[:6] for t in inputs])
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        out = prefix("train", list(range(8)), None)  # 6 and 7 are not cached: loaded
        assert loaded == [list(range(8))]
        for got, want in zip(out, recompute(model, 2, [t[:8] for t in inputs])):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
