"""Packed text batches (data.padding packed): the placements and shapes, the tensors, every
text family's per-sample results against the same batch padded (and a negative control:
attention let across samples fails the same check), the spec and the step's shape. The
runs through the trainer are in tests/test_padding.py (one launch with the other
paddings'), the pipelines' gradients in tests/test_pipeline_equivalence.py and the frozen
prefix served packed from AutoCache in tests/test_cached_prefix.py.

Tolerance: float32 sums in another order (a sample's attention over a row of other
samples, masked to exact zeros): hidden states and logits 1e-5, gradients rtol 1e-4 /
atol 1e-6, as tests/test_pipeline_equivalence.py.
"""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest
import torch
from families import FAMILIES, TEXT_FAMILIES, Family

import pipetransformer.models.packed as packed_units
from pipetransformer.config import ConfigError, config_from_dict
from pipetransformer.data.base import TextSampleDataset, real_lengths
from pipetransformer.models import UnitSequence
from pipetransformer.tasks import ClassificationTask, QuestionAnsweringTask
from pipetransformer.trainer.step import padded_length_share, step_seq_length
from pipetransformer.utils.packing import Packing
from pipetransformer.utils.padding import (
    PACKING_MIN_SAVING,
    PackedShape,
    batch_tokens,
    bucket_buffer_share,
    bucket_length,
    first_fit_decreasing,
    packed_buffer_share,
    packed_placements,
    packed_shape,
    packing_pays,
    padded_length,
    row_buckets,
)

# ----------------------------------------------------------------------------- arithmetic


def test_first_fit_decreasing_places_every_sample_once_within_its_rows():
    lengths = [5, 3, 8, 2, 7, 1, 1, 4]
    rows = first_fit_decreasing(lengths, 8)
    assert rows == [[2], [4, 5], [0, 1], [7, 3, 6]]  # longest first, ties by index
    assert sorted(i for row in rows for i in row) == list(range(8))
    assert all(sum(lengths[i] for i in row) <= 8 for row in rows)
    assert first_fit_decreasing(lengths, 8) == rows  # every rank computes the same
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([9], 8)
    # Where each sample lies, in batch order: (row, first token).
    placements = packed_placements(lengths, PackedShape(4, 8, 8))
    assert placements[0] == (2, 0) and placements[1] == (2, 5) and placements[6] == (3, 6)
    with pytest.raises(ValueError, match="needs 4 rows"):
        packed_placements(lengths, PackedShape(3, 8, 8))


def test_a_packed_batch_never_computes_more_tokens_than_the_same_batch_padded():
    """One shape a step: rows of the batch's padded length (in a bucket in a pipeline), as
    many as its fullest micro-batch needs (in a power-of-two bucket, at most its samples).
    A row holds at least one sample, so packing computes at most what padding does."""
    assert row_buckets(8) == [1, 2, 4, 8] and row_buckets(6) == [1, 2, 4, 6]
    rng = random.Random(0)
    for _ in range(300):
        micro = rng.choice([1, 2, 4, 6, 8])
        lengths = [rng.randint(1, rng.choice([16, 64, 128])) for _ in range(micro * 2)]
        for bucketed in (False, True):
            length = padded_length(max(lengths), 8, 128)
            if bucketed:
                length = bucket_length(length, 8, 128)
            shape = packed_shape(lengths, micro, length, bucketed)
            assert shape.row_length == length and shape.samples == micro
            assert not bucketed or shape.rows in row_buckets(micro)
            assert batch_tokens(shape, len(lengths)) <= batch_tokens(length, len(lengths))
            assert batch_tokens(shape, len(lengths)) >= sum(lengths)
    # Two micro-batches: the fuller one sets the rows.
    assert packed_shape([3, 3, 3, 3, 8, 8, 2, 2], 4, 8, False) == PackedShape(3, 8, 4)
    assert packed_shape([3, 3, 3, 3, 8, 8, 2, 2], 4, 8, True) == PackedShape(4, 8, 4)
    assert PackedShape(3, 8, 4).tokens(8) == 2 * 3 * 8


def test_the_receive_buffers_of_every_bucket_are_under_three_times_the_longest():
    """The buckets below max_seq_length double, so they sum to under twice the largest of
    them, itself under max_seq_length: under 3 in all, under 2 only where max_seq_length is
    the multiple times a power of two."""
    assert bucket_buffer_share(8, 128) == pytest.approx(248 / 128)  # 1.94
    assert bucket_buffer_share(8, 384) == pytest.approx(888 / 384)  # 2.31
    assert bucket_buffer_share(8, 200) == pytest.approx(448 / 200)  # 2.24
    shares = [bucket_buffer_share(m, n) for m in (1, 8, 16, 64) for n in range(max(m, 8), 2049)]
    assert max(shares) < 3 and max(shares) > 2.9
    assert packed_buffer_share(8, 128, 8) == pytest.approx(15 / 8 * 248 / 128)


# ----------------------------------------------------------------------------- tensors


def test_a_packed_batch_round_trips_and_keeps_extra_rows():
    lengths = [5, 3, 8, 2, 7, 7, 1, 1]
    shape = packed_shape(lengths, 4, 8, False)
    packing = Packing(lengths, shape)
    assert packing.segments.shape == (2 * shape.rows, 8) and packing.starts.shape == (8,)
    # Segment k + 1 marks the micro-batch's k-th sample, 0 the padding at a row's end.
    for index, length in enumerate(lengths):
        micro, k = divmod(index, 4)
        rows = packing.segments[micro * shape.rows : (micro + 1) * shape.rows].reshape(-1)
        assert int((rows == k + 1).sum()) == length
        assert int(rows[packing.starts[index]]) == k + 1  # its first token
    mask = torch.arange(8)[None] < torch.tensor(lengths)[:, None]
    hidden = torch.randn(8, 8 + 3, 4)  # 3 rows past the tokens, the same for every sample
    hidden[:, :8][~mask] = 0
    hidden[:, 8:] = torch.randn(3, 4)
    packed = packing.pack(hidden)
    assert packed.shape == (2 * shape.rows, 11, 4)
    assert torch.equal(packed[:, 8:], hidden[:1, 8:].expand(2 * shape.rows, -1, -1))
    assert torch.equal(packing.unpack(packed), hidden)


def text_split(lengths, padding="packed", max_length=16):
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(max_length)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(5, 50, (len(lengths), max_length), generator=g) * mask
    types = torch.zeros_like(ids)
    types[:, 3:] = 1
    return TextSampleDataset((ids, types * mask, mask), torch.arange(len(lengths)) % 2, padding)


def test_a_text_batch_is_fetched_packed_in_its_shape():
    split = text_split([3, 9, 12, 2, 5, 1, 4, 6])
    ids = [0, 3, 5, 6, 1, 2, 4, 7]
    shape = packed_shape([split.lengths[i] for i in ids], 4, split.batch_length(ids), False)
    (input_ids, types, segments, starts), labels = split.fetch(ids, shape)
    assert input_ids.shape == types.shape == segments.shape == (2 * shape.rows, 16)
    assert starts.shape == (8,) and torch.equal(labels, split.targets(ids))
    padded, _ = split.fetch(ids, 16)
    packing = Packing([split.lengths[i] for i in ids], shape)
    assert torch.equal(packing.unpack(input_ids), padded[0])
    assert torch.equal(packing.unpack(types), padded[1])
    assert int((segments > 0).sum()) == sum(split.lengths)  # no padding inside a row's samples


def test_packed_padding_is_checked():
    assert text_split([3]).batch_length([0]) == 8  # rows of the batch's padded length
    with pytest.raises(ConfigError, match="data.padding: 'packed' lays text samples"):
        config_from_dict({"data": {"name": "digits", "padding": "packed"}})
    with pytest.raises(ConfigError, match=re.escape("'batch' | 'max_length' | 'packed' | 'auto'")):
        config_from_dict({"model": {"name": "bert"}, "data": {"name": "sst2", "padding": "no"}})


# ----------------------------------------------------------------------------- models


def short_batch(n: int = 8, seed: int = 3):
    """(input_ids, token_type_ids, attention_mask) of 16 tokens: one sample of 16, the others
    of 2-8 (two to four fill a row of 16), a second segment from position 5."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (n,), generator=g)
    lengths[0] = 16
    mask = (torch.arange(16)[None] < lengths[:, None]).long()
    ids = torch.randint(5, 50, (n, 16), generator=g) * mask
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    return ids, types * mask, mask


def in_micro_batches(model, inputs, micro_batches: int = 2):
    """The model run micro-batch by micro-batch, as a schedule runs it (a packed batch's
    sample starts count within one), outputs stacked."""
    pieces = zip(*(t.tensor_split(micro_batches) for t in inputs))
    return torch.cat([model(*piece) for piece in pieces])


def per_sample_runs(model, task: str, seed: int = 3):
    """(padded, packed): each the encoder's hidden state one sample a row (the packed one
    unpacked), the outputs, the loss and the gradients of the same batch of 8 samples."""
    inputs = short_batch(seed=seed)
    lengths = real_lengths(inputs[-1])
    shape = packed_shape(lengths, 4, 16, False)
    assert shape.rows < shape.samples  # rows hold several samples
    packing = Packing(lengths, shape)
    weights = torch.full((8,), 1 / 8)
    if task == "classification":
        target = ClassificationTask.make_target(torch.tensor([0, 1] * 4), weights, lengths)
        loss_fn = ClassificationTask.loss_fn
    else:
        positions = torch.tensor([[min(i, n - 1), n - 1] for i, n in enumerate(lengths)])
        target = QuestionAnsweringTask.make_target(positions, weights, lengths)
        loss_fn = QuestionAnsweringTask.loss_fn
    encoder = UnitSequence(list(model.units)[:-1], [False] * (len(model.units) - 1))
    runs = []
    for batch, unpack in ((inputs, lambda t: t), (packing.inputs(inputs), packing.unpack)):
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            hidden = unpack(encoder(*batch)[0])
        outputs = in_micro_batches(model, batch)
        loss = loss_fn(outputs, target)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        real = torch.cat([inputs[-1], torch.ones(8, hidden.shape[1] - 16, dtype=torch.long)], 1)
        runs.append(
            (hidden * real[..., None], outputs.detach(), float(loss.detach()), grads, lengths)
        )
    return runs


def assert_same_per_sample(padded, packed, task: str) -> None:
    (hidden, out, loss, grads, lengths), (p_hidden, p_out, p_loss, p_grads, _) = padded, packed
    torch.testing.assert_close(p_hidden, hidden, rtol=0, atol=1e-5)
    if task == "classification":
        torch.testing.assert_close(p_out, out, rtol=0, atol=1e-5)
    else:
        for row, length in enumerate(lengths):
            torch.testing.assert_close(p_out[row, :length], out[row, :length], rtol=0, atol=1e-5)
    assert p_loss == pytest.approx(loss, abs=1e-6)
    assert p_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(p_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


VARIANTS = [(name, task, {}) for name in TEXT_FAMILIES for task in FAMILIES[name].tasks] + [
    # DeBERTa-v2's absolute positions beside the relative ones; ModernBERT's CLS pooling.
    ("deberta-v2", "classification", {"position_biased_input": True}),
    ("modernbert", "classification", {"classifier_pooling": "cls"}),
]


@pytest.mark.parametrize("name, task, kwargs", VARIANTS, ids=lambda v: str(v))
def test_every_text_family_computes_the_same_per_sample_packed(name, task, kwargs):
    """The same batch padded and packed (2 micro-batches of 4 samples, rows of 16 holding
    several): the encoder's hidden state at every real token, the head's outputs (per
    sample: question answering's at every real position), the loss and every gradient.
    Positions restart per sample (RoBERTa's after its padding index; DeBERTa's relative ones
    and ModernBERT's rotary tables and sliding window from them), attention stays in a
    sample, heads read each sample's own tokens."""
    family = FAMILIES[name]
    family = Family(family.family, family.name, {**family.kwargs, **kwargs}, family.dropout_off)
    model = family.build(task)
    padded, packed = per_sample_runs(model.train(), task)
    assert_same_per_sample(padded, packed, task)


@pytest.mark.parametrize("name", ["bert", "deberta-v2", "modernbert"])
def test_the_check_fails_when_attention_crosses_samples(name, monkeypatch):
    """Negative control: the same check with attention let across the samples of a row
    (every real token of a row one segment) fails on the hidden states, by at least a
    hundred times the tolerance."""
    real = packed_units.same_sample
    monkeypatch.setattr(
        packed_units, "same_sample", lambda segments, window=None: real(segments > 0, window)
    )
    model = FAMILIES[name].build("classification")
    (hidden, *_), (leaked, *_) = per_sample_runs(model.train(), "classification")
    assert (leaked - hidden).abs().max() > 1e-3
    with pytest.raises(AssertionError):
        assert_same_per_sample(*per_sample_runs(model, "classification"), "classification")


def test_the_model_spec_of_a_packed_shape():
    """Inputs and activations a row each, then the sample starts one a sample; outputs one
    a sample (question answering's at the rows' length)."""
    shape = PackedShape(rows=3, row_length=8, samples=4)
    spec = FAMILIES["bert"].build("question_answering").spec.at_length(shape)
    assert [s.shape for s in spec.input_specs] == [(8,), (8,), (8,), ()]
    assert [s.per_sample for s in spec.input_specs] == [False, False, False, True]
    assert spec.activation_specs[0].shape == (8, 32) and spec.activation_specs[-1].per_sample
    assert spec.output_spec.shape == (8, 2) and spec.output_spec.per_sample
    examples = [s.example(4, rows=3) for s in spec.activation_specs]
    assert [e.shape[0] for e in examples] == [3, 3, 4]
    assert spec.output_spec.example(4, rows=3).shape == (4, 8, 2)


# ----------------------------------------------------------------------------- steps


def test_a_step_packs_at_the_batchs_length_and_a_pipeline_in_buckets():
    config = config_from_dict(
        {
            "model": {"name": "bert"},
            "data": {"name": "sst2", "max_seq_length": 64, "padding": "packed"},
        }
    )
    split = text_split([3, 9, 12, 5, 1, 2, 40, 30, 7, 4, 6, 2], max_length=64)
    plan = SimpleNamespace(num_micro_batches=2)
    one, two = SimpleNamespace(pipe_len=1, plan=plan), SimpleNamespace(pipe_len=2, plan=plan)
    ids = [0, 1, 2, 3, 4, 5, 8, 9]
    # One stage: rows of the batch's own padded length (16), exact rows.
    shape = step_seq_length(config, one, split, ids)
    assert shape == packed_shape([split.lengths[i] for i in ids], 4, 16, False)
    assert shape.rows == 2
    # A pipeline: rows of the bucket, rows in a power-of-two bucket.
    piped = step_seq_length(config, two, split, [6, 7, 0, 1, 2, 3, 4, 5])
    assert piped.row_length == 64 and piped.rows in row_buckets(4)
    # What recomputing the frozen prefix costs: the packed tokens over max_length's.
    sampler = SimpleNamespace(epoch_order=lambda node, epoch: list(range(12)), num_nodes=1)
    config = config_from_dict(
        {
            "model": {"name": "bert"},
            "trainer": {"global_batch_size": 4},
            "data": {"name": "sst2", "max_seq_length": 64, "padding": "packed"},
        }
    )
    share = padded_length_share(config, split, sampler, 1)
    batches = [list(range(i, i + 4)) for i in (0, 4, 8)]
    packed = sum(
        packed_shape([split.lengths[i] for i in b], 4, split.batch_length(b), False).tokens(4)
        for b in batches
    )
    assert share == pytest.approx(packed / (12 * 64))
    batch_config = config_from_dict(
        {**config.to_dict(), "data": {"name": "sst2", "max_seq_length": 64, "padding": "batch"}}
    )
    assert share < padded_length_share(batch_config, split, sampler, 1)


def test_auto_packs_a_batch_where_packing_saves_enough_of_its_tokens():
    """data.padding auto: a batch of one long and many short samples is packed (it saves
    well over PACKING_MIN_SAVING of its tokens), one of samples as long as each other is
    padded (packing would save nothing), step by step from the batch's own lengths."""
    config = config_from_dict(
        {
            "model": {"name": "bert"},
            "data": {"name": "sst2", "max_seq_length": 16, "padding": "auto"},
        }
    )
    split = text_split([16, 2, 3, 2, 4, 3, 2, 2, 15, 14, 16, 13, 16, 15, 14, 16], "auto")
    one = SimpleNamespace(pipe_len=1, plan=SimpleNamespace(num_micro_batches=1))
    short = list(range(8))
    shape = step_seq_length(config, one, split, short)
    assert isinstance(shape, PackedShape) and packing_pays(shape, 16, 8)
    assert shape.tokens(8) <= (1 - PACKING_MIN_SAVING) * 8 * 16
    assert step_seq_length(config, one, split, list(range(8, 16))) == 16  # padded
    # The default: data without a sequence takes it as nothing to pack; 'packed' is refused.
    assert config_from_dict({"data": {"name": "digits", "padding": "auto"}}).data.padding == "auto"
    with pytest.raises(ConfigError, match="data.padding: 'packed' lays text samples"):
        config_from_dict({"data": {"name": "digits", "padding": "packed"}})


def test_a_pipeline_budgets_the_receive_buffers_of_every_packed_shape():
    from pipetransformer.planning.context import receive_buffer_share

    text = {"model": {"name": "bert"}, "data": {"name": "sst2", "padding": "packed"}}
    assert receive_buffer_share(config_from_dict(text), 8) == pytest.approx(
        packed_buffer_share(8, 128, 8)
    )
    text["data"]["padding"] = "auto"  # a stage of either kind may be built
    assert receive_buffer_share(config_from_dict(text), 8) == pytest.approx(
        packed_buffer_share(8, 128, 8) + bucket_buffer_share(8, 128)
    )
