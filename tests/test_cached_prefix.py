"""The frozen prefix served from AutoCache equals recomputing it: hits, upgrades, misses.

Text is stored at each sample's real length and read back padded with zeros to the batch's
length, where a recomputed row holds what the prefix made of the padding tokens: the two
agree on every real token (and the mask), which is all a later unit reads (attention
masks the padding keys), at any batch length, DeBERTa's table rows included.
"""

import numpy as np
import pytest
import torch
from families import FAMILIES, text_batch
from helpers import tiny_bert, tiny_vit

from pipetransformer.autocache import CacheClient, CacheDaemon
from pipetransformer.data.base import real_lengths
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


def assert_real_rows_equal(got, expected, inputs, atol: float = 0.0):
    """The prefix's outputs agree on every real token: text outputs are compared with the
    padding rows of the hidden state zeroed (the tokens' rows, then any table rows)."""
    if len(inputs) == 1:  # images: no padding
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)
        return
    mask = inputs[-1]
    seq = mask.shape[1]
    keep = torch.cat([mask, torch.ones(mask.shape[0], got[0].shape[1] - seq, dtype=mask.dtype)], 1)
    hidden = [t * keep[..., None] for t in (got[0], expected[0])]
    torch.testing.assert_close(hidden[0], hidden[1], rtol=0, atol=atol)
    assert torch.equal(got[1], expected[1])


@pytest.fixture(params=["vit", "bert"])
def model_and_batch(request):
    model = tiny_vit() if request.param == "vit" else tiny_bert()
    model.eval()
    batch = vit_batch() if request.param == "vit" else bert_batch()
    return model, batch


def start_cache(model, num_samples, budget=None, dtype="float32", inputs=None):
    """A store for the prefix outputs of `model`; text at the real lengths of `inputs`."""
    lengths = None if inputs is None or len(inputs) == 1 else real_lengths(inputs[-1])
    return CacheDaemon.start(
        splits={
            "train": (
                num_samples,
                list(model.spec.activation_specs),
                lengths,
                model.spec.max_seq_length,
            )
        },
        memory_budget_bytes=budget if budget is not None else 1 << 26,
        storage_dtype=dtype,
    )


def test_hits_upgrades_and_misses_equal_recompute(model_and_batch):
    model, inputs = model_and_batch
    units = dict(enumerate(model.units))
    ids = list(range(12))
    with (
        start_cache(model, 12, inputs=inputs) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
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
        assert_real_rows_equal(out, recompute(model, 3, half), half)
        assert counts["upgrades"] == 6
        # Whole batch at F = 3: 6 hits (upgraded once, not again) + 6 more upgrades.
        out = prefix3("train", ids, inputs)
        assert_real_rows_equal(out, recompute(model, 3, inputs), inputs, atol=1e-6)
        assert counts == {"hits": 6, "upgrades": 12, "misses": 12}
        prefix3.flush()
        tags, _ = client.read("train", ids)
        assert (tags == 3).all()


def test_padding_repeats_are_looked_up_once(model_and_batch):
    model, inputs = model_and_batch
    units = dict(enumerate(model.units))
    ids = [0, 1, 2, 3, 0, 1]  # the last two rows repeat samples 0 and 1 (shape padding)
    padded = tuple(torch.cat([t[:4], t[:2]]) for t in inputs)
    with (
        start_cache(model, 12, inputs=inputs) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
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
        assert np.isclose(client.layout("train").full_sample_bytes, 5 * 32 * 2, rtol=0.2)


def test_a_batch_the_loader_did_not_decode(model_and_batch):
    """The loader skips decoding a batch whose every sample is cached at the boundary
    (CacheClient.serves_all); the prefix serves it without inputs, and loads them itself
    for a sample that turns out not to be cached."""
    model, inputs = model_and_batch
    units = dict(enumerate(model.units))
    loaded = []

    def load_inputs(split, ids, seq_length):
        loaded.append(list(ids))
        return [t[list(ids)] for t in inputs]

    with (
        start_cache(model, 12, inputs=inputs) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
        prefix = CachedPrefix(
            units, 2, client, torch.device("cpu"), load_inputs=load_inputs, defer_writes=True
        )
        prefix("train", list(range(6)), [t[:6] for t in inputs])
        prefix.flush()
        assert client.serves_all("train", range(6), 2)
        assert not client.serves_all("train", range(7), 2)
        assert not client.serves_all("train", range(6), 3)
        length = None if len(inputs) == 1 else inputs[0].shape[1]
        out = prefix("train", list(range(6)), None, length)  # all hits: no inputs needed
        assert loaded == []
        six = [t[:6] for t in inputs]
        assert_real_rows_equal(out, recompute(model, 2, six), six, atol=1e-6)
        out = prefix("train", list(range(8)), None, length)  # 6 and 7 are not cached: loaded
        assert loaded == [list(range(8))]
        eight = [t[:8] for t in inputs]
        assert_real_rows_equal(out, recompute(model, 2, eight), eight, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_a_mixed_length_batch_at_its_own_length_equals_recompute(family):
    """Samples of 4 to 15 tokens stored at their real lengths, read back (hits) and upgraded
    in batches padded to 16 and to their own longest: the prefix's output is the one
    recomputed at that length on every real token. DeBERTa's hidden state carries its
    relative-position table after the tokens: stored once a sample, it follows the padding
    of whatever length the batch is read at."""
    model = FAMILIES[family].build().eval()
    units = dict(enumerate(model.units))
    inputs = text_batch(12, seed=5)
    lengths = real_lengths(inputs[-1])
    short = [i for i, v in enumerate(lengths) if v <= 8]
    assert len(short) >= 3 and max(lengths) > 8
    cpu = torch.device("cpu")
    with (
        start_cache(model, 12, inputs=inputs) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
        assert client.layout("train").lengths == tuple(lengths)
        filling = CachedPrefix(units, 1, client, cpu)
        filling("train", list(range(12)), inputs, 16)
        counts = {"hits": 0, "upgrades": 0, "misses": 0}
        # At F = 1, the short samples at 8 tokens: hits, padded to 8.
        cut = [t[short, :8] for t in inputs]
        out = CachedPrefix(units, 1, client, cpu, counts)("train", short, cut, 8)
        assert out[0].shape[1] == recompute(model, 1, cut)[0].shape[1]
        # (Computed at 16 tokens, recomputed at 8: float32 rounding of other shapes apart.)
        assert_real_rows_equal(out, recompute(model, 1, cut), cut, atol=1e-6)
        # At F = 2: the same batch upgraded from its stored rows at 8 tokens, then the whole
        # split at 16 (the short ones hits now, the others upgrades).
        upgrade = CachedPrefix(units, 2, client, cpu, counts)
        assert_real_rows_equal(upgrade("train", short, cut, 8), recompute(model, 2, cut), cut, 1e-6)
        out = upgrade("train", list(range(12)), inputs, 16)
        assert_real_rows_equal(out, recompute(model, 2, inputs), inputs, atol=1e-6)
        assert counts == {"hits": len(short) * 2, "upgrades": 12, "misses": 0}


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_a_packed_batch_is_served_from_the_cache_as_recomputed_packed(family):
    """data.padding packed: the store keeps each sample's rows whatever the padding; a
    packed batch's misses are computed from its inputs unpacked, its hits and upgrades read
    one sample a row at the rows' length, and the whole assembled packed (DeBERTa's table
    rows at the end of every row). On every real token it is what the prefix computes on
    the packed batch itself; rows written under packing serve a padded batch and back."""
    from pipetransformer.utils.packing import Packing
    from pipetransformer.utils.padding import packed_shape

    model = FAMILIES[family].build().eval()
    units = dict(enumerate(model.units))
    inputs = text_batch(12, seed=5)
    lengths = real_lengths(inputs[-1])
    shape = packed_shape(lengths, 6, 16, False)  # 2 micro-batches of 6
    packing = Packing(lengths, shape)
    packed = packing.inputs(inputs)
    assert shape.rows < shape.samples
    ids, cpu = list(range(12)), torch.device("cpu")

    def assert_packed_equal(out, frozen):
        """Segment ids and sample starts as the inputs', the hidden state on every real
        token (and the table rows) as recomputed packed."""
        expected = recompute(model, frozen, packed)
        assert torch.equal(out[1], packed[2]) and torch.equal(out[2], packed[3])
        real = (packed[2] > 0).float()[..., None]
        keep = torch.cat([real, real.new_ones(real.shape[0], out[0].shape[1] - 16, 1)], 1)
        got, want = (packing.unpack(t * keep) for t in (out[0], expected[0]))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    with (
        start_cache(model, 12, inputs=inputs) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
        counts = {"hits": 0, "upgrades": 0, "misses": 0}
        out = CachedPrefix(units, 1, client, cpu, counts)("train", ids, packed, shape)
        assert_packed_equal(out, 1)  # misses, computed from the inputs unpacked
        out = CachedPrefix(units, 1, client, cpu, counts)("train", ids, None, shape)
        assert_packed_equal(out, 1)  # hits: nothing decoded
        out = CachedPrefix(units, 2, client, cpu, counts)("train", ids, packed, shape)
        assert_packed_equal(out, 2)  # upgrades
        assert counts == {"hits": 12, "upgrades": 12, "misses": 12}
        # The rows written packed serve the batch padded to 16.
        padded = CachedPrefix(units, 2, client, cpu, counts)("train", ids, inputs, 16)
        assert_real_rows_equal(padded, recompute(model, 2, inputs), inputs, atol=1e-5)
        assert counts["hits"] == 24
