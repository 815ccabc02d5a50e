"""Per-batch padding (data.padding), length grouping (data.group_by_length) and what a run
counts of its tokens: pure arithmetic, the text dataset, every text family's per-sample
results under both paddings, question answering's masking, the sampler's grouping, and
one launch of 2 gloo workers that trains a pipeline of text of several lengths.

The distributed runs (one launch, seven runs: about 50 s on 2 busy cores) use text the
test writes: short, middling and over-long sentences, so a 2-stage pipeline meets batches
of 8, 16 and 32 tokens, each length a PipelineStage of its own. Every run equals
single-process training step by step (losses 1e-5, weights rtol 1e-4 / atol 1e-5: float32
sums in another order, as tests/test_elastic.py), whatever the padding: per batch, to
max_seq_length, and packed (data.padding packed: the pipeline, its frozen prefix on stage 0,
its transition into DDP with AutoCache upgrading packed rows, a resume, and FSDP2;
tests/test_packing.py checks packing itself).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from families import FAMILIES, TEXT_FAMILIES
from helpers import TINY_BERT, run_workers
from reference import reference_run, step_losses
from workers import elastic_runs

from pipetransformer.autodp.sampler import EvalSampler, TrainSampler, length_grouped
from pipetransformer.config import ConfigError, DataConfig, config_from_dict
from pipetransformer.data import build_data
from pipetransformer.data.base import Subset, TextSampleDataset, real_lengths
from pipetransformer.tasks import (
    ClassificationTask,
    QuestionAnsweringAccumulator,
    QuestionAnsweringTask,
)
from pipetransformer.trainer.step import step_seq_length, train_sampler
from pipetransformer.utils.padding import (
    bucket_buffer_share,
    bucket_length,
    bucket_lengths,
    padded_length,
)

# ----------------------------------------------------------------------------- arithmetic


def test_a_batch_pads_to_its_longest_rounded_up_and_a_pipeline_to_a_bucket():
    assert [padded_length(n, 8, 128) for n in (1, 8, 9, 13, 121, 128)] == [8, 8, 16, 16, 128, 128]
    assert padded_length(57, 8, 60) == 60  # never beyond max_seq_length
    assert padded_length(13, 1, 128) == 13
    with pytest.raises(ValueError, match="longer than max_seq_length"):
        padded_length(129, 8, 128)
    assert bucket_lengths(8, 128) == [8, 16, 32, 64, 128]
    assert bucket_lengths(8, 48) == [8, 16, 32, 48]
    assert [bucket_length(n, 8, 128) for n in (8, 16, 24, 72)] == [8, 16, 32, 128]
    assert bucket_buffer_share(8, 128) == pytest.approx((8 + 16 + 32 + 64 + 128) / 128)


def text_split(lengths, max_length=16, padding="batch", multiple=8, seed=0):
    """A TextSampleDataset of random tokens, sample i real for lengths[i] tokens."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = (torch.arange(max_length)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(5, 50, (n, max_length), generator=g) * mask
    return TextSampleDataset(
        (ids, torch.zeros_like(ids), mask), torch.arange(n) % 2, padding, multiple
    )


def test_a_text_batch_is_cut_to_its_padded_length():
    split = text_split([3, 9, 12, 16, 5, 0])
    assert split.lengths == [3, 9, 12, 16, 5, 0]
    full, labels = split.fetch([0, 4], 16)
    (ids, types, mask), same = split.fetch([0, 4])
    assert ids.shape == types.shape == mask.shape == (2, 8) and ids.is_contiguous()
    assert torch.equal(ids, full[0][:, :8]) and torch.equal(same, labels)
    assert full[0].shape == (2, 16) and int(full[2][:, 8:].sum()) == 0  # only padding cut
    assert split.batch_length([1, 0]) == 16 and split.batch_length([5]) == 8
    with pytest.raises(ValueError, match="longest sample"):
        split.fetch([1], 8)
    assert text_split([3, 5], padding="max_length").fetch([0, 1])[0][0].shape == (2, 16)
    assert text_split([3, 5], multiple=1).fetch([0, 1])[0][0].shape == (2, 5)
    subset = Subset(split, 4, seed=0)
    assert subset.lengths == [split.lengths[i] for i in subset.index]
    assert subset.batch_length([0]) == split.batch_length([subset.index[0]])


def test_real_lengths_are_one_past_the_last_attended_position():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert real_lengths(mask) == [2, 4, 0]


def test_the_padding_keys_are_checked_and_name_themselves():
    # Packing where it pays is the default (docs/architecture.md, "Which padding by
    # default"); data without a sequence takes it as a no-op, and refuses 'packed' by name.
    assert DataConfig(name="sst2").padding == "auto"
    assert DataConfig(name="digits").padding == "auto"
    with pytest.raises(ConfigError, match="data.padding: 'packed' .*'digits' is not text"):
        DataConfig(name="digits", padding="packed")
    assert DataConfig(name="sst2").pad_to_multiple_of == 8
    assert not DataConfig(name="sst2").group_by_length
    with pytest.raises(ConfigError, match="data.pad_to_multiple_of: must be >= 1"):
        DataConfig(name="sst2", pad_to_multiple_of=0)
    with pytest.raises(ConfigError, match="data.group_by_length: .*'digits' is not text"):
        DataConfig(name="digits", group_by_length=True)
    with pytest.raises(ConfigError, match="data.padding"):
        config_from_dict({"model": {"name": "bert"}, "data": {"name": "sst2", "padding": "no"}})


def test_text_is_encoded_padded_on_the_right_whatever_the_tokenizers_side():
    from pipetransformer.compare.collators import padding_tokenizer
    from pipetransformer.config import Config
    from pipetransformer.data.text import encode

    tokenizer = padding_tokenizer(Config())
    tokenizer.padding_side = "left"
    ids, _, mask = encode(tokenizer, ["x y z", "x"], 6)
    assert real_lengths(mask) == [3, 1] and mask[:, 0].tolist() == [1, 1]


def test_a_pipeline_stage_budgets_the_receive_buffers_of_every_bucket():
    """Text padded per batch keeps a stage per bucket: the memory model counts their receive
    buffers together (8, 16, 32, 64, 128: 248/128 times the max-length ones), nothing else."""
    from pipetransformer.autopipe.memory import LayoutShape, MemoryModel
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.planning.context import receive_buffer_share

    model = MemoryModel((100,) * 6, (10,) * 6, (4,) * 6, 2, 2.0)
    plan = balance(UnitCosts.from_param_counts([1] * 6, 1 / 6), 0, 2)  # [0, 3), [3, 6)
    share = bucket_buffer_share(8, 128)
    for stage in (0, 1):
        one = model.stage_memory(plan, stage, LayoutShape(4, 2, 1))
        buckets = model.stage_memory(plan, stage, LayoutShape(4, 2, 1, "gpipe", share))
        # Receive buffers of M = 2 micro-batches of a unit's 4 bytes, at micro-batches of 4
        # samples where the profile's held 2: the output gradients on stage 0, the inputs on
        # stage 1 twice (training's stage and evaluation's, pipe/runtime.py).
        received = (1 if stage == 0 else 2) * 2 * 4 * (4 / 2)
        assert buckets.boundary - one.boundary == pytest.approx((share - 1) * received)
        assert buckets.activations == one.activations and buckets.parameters == one.parameters
    text = {"model": {"name": "bert"}, "data": {"name": "sst2", "padding": "batch"}}
    assert receive_buffer_share(config_from_dict(text)) == pytest.approx(share)
    text["data"]["padding"] = "max_length"
    assert receive_buffer_share(config_from_dict(text)) == 1.0
    assert receive_buffer_share(config_from_dict({})) == 1.0  # images


def test_the_hf_trainer_peer_pads_as_its_users_do():
    """Trainer gets each sample at its real length; DataCollatorWithPadding pads a batch to
    its longest rounded up to data.pad_to_multiple_of (max_seq_length under max_length);
    the token counter reads real and padded tokens off the masks the model is called with."""
    from pipetransformer.compare.collators import padding_collator
    from pipetransformer.compare.peers import TokenCounter, _TextDataset
    from pipetransformer.config import Config

    split = text_split([3, 9, 12, 5])
    dataset = _TextDataset(split)
    assert [dataset[i]["input_ids"].shape[0] for i in range(4)] == [3, 9, 12, 5]
    batch = padding_collator(Config())([dataset[0], dataset[3]])
    assert batch["input_ids"].shape == (2, 8) and torch.equal(
        batch["input_ids"], split.fetch([0, 3])[0][0]
    )
    assert batch["labels"].tolist() == [0, 1]
    config = config_from_dict(
        {
            "model": {"name": "bert"},
            "data": {"name": "sst2", "max_seq_length": 16, "padding": "max_length"},
        }
    )
    assert padding_collator(config)([dataset[1]])["attention_mask"].shape == (1, 16)
    model = torch.nn.Module()
    model.forward = lambda input_ids, attention_mask: input_ids  # noqa: ARG005
    counter = TokenCounter(model)
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    model.eval()
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])  # not counted
    assert counter.take() == (3 + 5, 16) and counter.take() == (0, 0)


def test_the_hf_trainer_peer_groups_by_length_where_the_config_does(tmp_path):
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (the .[peers] extra)
    from transformers import TrainingArguments

    from pipetransformer.compare.peers import _length_grouping

    for grouped in (True, False):
        args = TrainingArguments(
            output_dir=str(tmp_path), **_length_grouping(TrainingArguments, grouped)
        )
        strategy = getattr(args, "train_sampling_strategy", None)
        assert (strategy == "group_by_length" or getattr(args, "group_by_length", False)) == grouped


# ----------------------------------------------------------------------------- models


def _short_text_batch(batch_size: int = 6, seed: int = 7):
    """(input_ids, token_type_ids, attention_mask) of 16 tokens, every sample at most 8
    real (a second segment from position 4): batch padding cuts it to 8."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([8, 3, 5, 7, 2, 6])[:batch_size]
    mask = (torch.arange(16)[None] < lengths[:, None]).long()
    ids = torch.randint(5, 50, (batch_size, 16), generator=g) * mask
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    return ids, types * mask, mask


@pytest.mark.parametrize("task", ["classification", "question_answering"])
@pytest.mark.parametrize("name", TEXT_FAMILIES)
def test_every_text_family_computes_the_same_per_sample_under_both_paddings(name, task):
    """A batch at its own length (8) and at max_seq_length (16): the same logits of every
    real token and the same loss, relative positions (DeBERTa) and rotary tables
    (ModernBERT) included. Question answering's loss masks the padding positions; without
    the mask (every position in the softmax) the two paddings train differently."""
    model = FAMILIES[name].build(task).eval()
    inputs = _short_text_batch()
    lengths = real_lengths(inputs[-1])
    cut = [t[:, :8] for t in inputs]
    with torch.no_grad():
        full, short = model(*inputs), model(*cut)
    weights = torch.full((6,), 1 / 6)
    if task == "classification":
        torch.testing.assert_close(short, full, rtol=0, atol=1e-5)
        labels = torch.tensor([0, 1, 1, 0, 1, 0])
        target = ClassificationTask.make_target(labels, weights, lengths)
        losses = [ClassificationTask.loss_fn(out, target) for out in (full, short)]
    else:
        for row, length in enumerate(lengths):
            torch.testing.assert_close(short[row, :length], full[row, :length], rtol=0, atol=1e-5)
        positions = torch.tensor([[1, 2], [0, 0], [4, 4], [2, 5], [1, 1], [3, 4]])
        target = QuestionAnsweringTask.make_target(positions, weights, lengths)
        losses = [QuestionAnsweringTask.loss_fn(out, target) for out in (full, short)]
        unmasked = QuestionAnsweringTask.make_target(positions, weights)
        assert (
            abs(
                float(QuestionAnsweringTask.loss_fn(full, unmasked))
                - float(QuestionAnsweringTask.loss_fn(short, unmasked))
            )
            > 1e-3
        )
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)


def test_the_model_spec_follows_a_batchs_length():
    bert = FAMILIES["bert"].build("question_answering")
    spec = bert.spec.at_length(8)
    assert spec.max_seq_length == 8 and bert.spec.at_length(None) is bert.spec
    assert [s.shape for s in spec.input_specs] == [(8,)] * 3
    assert spec.activation_specs[0].shape == (8, 32) and spec.output_spec.shape == (8, 2)
    classifier = FAMILIES["bert"].build().spec.at_length(8)
    assert classifier.output_spec.shape == (2,)
    deberta = FAMILIES["deberta-v2"].build().spec
    table = deberta.activation_specs[0].shape[0] - 16  # the relative-position table's rows
    assert deberta.at_length(8).activation_specs[0].shape == (8 + table, 32)


def test_question_answering_evaluation_keeps_the_same_logits_under_both_paddings():
    """Logits of features cut to 8 tokens and of the same at 16 are kept alike: padding
    positions masked, padded to max_seq_length; what post-processing scores is the same."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, 2, generator=g)
    lengths = [8, 5, 6]
    extras = {
        "feature_example_index": [0, 1, 2],
        "feature_offsets": torch.full((3, 16, 2), -1).numpy(),
        "examples": [{"id": str(i), "context": "c", "answers": ["c"]} for i in range(3)],
    }
    kept = []
    for width in (16, 8):
        accumulator = QuestionAnsweringAccumulator(extras)
        accumulator.add(logits[:, :width], [0, 1, 2], [True] * 3, None, lengths)
        kept.append(torch.cat(accumulator.logits))
    assert kept[0].shape == kept[1].shape == (3, 16, 2) and torch.equal(kept[0], kept[1])
    assert torch.equal(kept[0][1, :5], logits[1, :5]) and (kept[0][1, 5:] < -1e38).all()


# ----------------------------------------------------------------------------- sampling


def _padded_tokens(order, lengths, batch):
    return sum(
        len(order[i : i + batch]) * max(lengths[j] for j in order[i : i + batch])
        for i in range(0, len(order), batch)
    )


def test_length_grouping_keeps_every_sample_once_longest_first_in_sorted_megabatches():
    rng = random.Random(0)
    lengths = [rng.randint(1, 128) for _ in range(1000)]
    plain = TrainSampler(1000, 2, 64, seed=3)
    grouped = TrainSampler(1000, 2, 64, seed=3, lengths=lengths, group_batch_size=32)
    again = TrainSampler(1000, 2, 64, seed=3, lengths=lengths, group_batch_size=32)
    assert grouped.node_subsets == plain.node_subsets  # the same samples on each node
    for node in range(2):
        for epoch in range(2):
            order = grouped.epoch_order(node, epoch)
            assert sorted(order) == plain.node_subsets[node]  # every sample once
            assert order == again.epoch_order(node, epoch)  # deterministic for a seed
            assert lengths[order[0]] == max(lengths[i] for i in order)  # longest first
            # Megabatches of min(500 // 128, 50) = 3 batches of 32, each sorted longest first
            # (the first one's head swapped for the longest of all).
            for start in range(0, 500, 96):
                block = [lengths[i] for i in order[start : start + 96]]
                assert block[1:] == sorted(block[1:], reverse=True)
            assert _padded_tokens(order, lengths, 32) < _padded_tokens(
                plain.epoch_order(node, epoch), lengths, 32
            )
        assert grouped.epoch_order(node, 0) != grouped.epoch_order(node, 1)


def test_the_shape_padding_of_a_grouped_epoch_is_no_longer_than_its_real_samples_need():
    """The last step's fillers are the epoch's shortest sample: a replica padded to its
    longest sample is no longer than its real samples need, and one of fillers only is as
    short as a batch of the epoch can be (they were the epoch's first samples, under
    grouping its longest: a replica of 16 fillers padded to 64 tokens instead of 8)."""
    rng = random.Random(0)
    lengths = [rng.randint(9, 64) for _ in range(100)]
    lengths[58] = lengths[17] = 3  # the epoch's shortest samples
    # One node, 2 replicas of 16: 3 full steps, then 4 real samples and 28 fillers.
    sampler = TrainSampler(
        100, 1, 32, seed=0, replicas_per_node=2, lengths=lengths, group_batch_size=32
    )
    last = sampler.steps_per_epoch - 1
    order = sampler.epoch_order(0, 0)
    node_batch = sampler.node_batch(0, 0, last)
    assert node_batch.ids[4:] == (min((17, 58), key=order.index),) * 28
    for replica in range(2):
        batch = sampler.replica_batch(0, replica, 2, 0, last)
        real = [i for i, valid in zip(batch.ids, batch.valid) if valid]
        needed = max((lengths[i] for i in real), default=3)
        padded = padded_length(max(lengths[i] for i in batch.ids), 8, 64)
        assert padded == padded_length(needed, 8, 64) == (8 if not real else padded)
    assert sampler.replica_batch(0, 1, 2, 0, last).num_valid == 0  # fillers only: 8 tokens
    # Without lengths the fillers stay the epoch's first samples.
    plain = TrainSampler(100, 1, 32, seed=0, replicas_per_node=2)
    assert plain.node_batch(0, 0, last).ids[4:] == tuple(plain.epoch_order(0, 0)[:28])


def test_length_grouping_orders_a_shuffled_list_as_transformers_does():
    """transformers' LengthGroupedSampler (get_length_grouped_indices) on the same shuffled
    order gives the same order, sample for sample."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = [random.Random(i).randint(1, 100) for i in range(1000)]
    for batch in (8, 16, 300):
        generator = torch.Generator().manual_seed(batch)
        reference = get_length_grouped_indices(lengths, batch, generator=generator)
        shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(batch)).tolist()
        assert length_grouped(shuffled, lengths, batch) == reference


def test_length_grouping_counts_in_the_configs_batch_so_a_layout_change_keeps_the_order():
    """The grouping's batch is the config's (a replica's under batch_per_replica), so the
    epoch order does not depend on the layout: a change in the middle of the epoch re-splits
    what remains of the same order, and every sample is trained once."""
    lengths = [random.Random(i).randint(1, 64) for i in range(96)]
    config = config_from_dict(
        {
            "trainer": {"batch_per_replica": 4, "nproc_per_node": 4},
            "model": {"name": "bert"},
            "data": {"name": "sst2", "group_by_length": True},
        }
    )
    split = type("Split", (), {"lengths": lengths, "__len__": lambda self: 96})()
    sampler = train_sampler(config, split, num_nodes=1)
    assert sampler.group_batch_size == 4 and sampler.lengths == lengths
    order = list(sampler.epoch_order(0, 0))
    seen = []
    for step in range(3):  # 1 replica of 4 a step
        seen += sampler.replica_batch(0, 0, 1, 0, step).ids
    sampler.continue_at(0, 3, 12, 2)  # two replicas from the 13th sample on
    step = 3
    while sampler.offset(0, step) < 96:
        for replica in range(2):
            batch = sampler.replica_batch(0, replica, 2, 0, step)
            seen += [i for i, valid in zip(batch.ids, batch.valid) if valid]
        step += 1
    assert seen == order and sorted(seen) == list(range(96))
    plain = config_from_dict({"model": {"name": "bert"}, "data": {"name": "sst2"}})
    assert train_sampler(plain, split, num_nodes=1).lengths is None


def test_the_eval_set_goes_longest_first_once_when_grouped():
    lengths = [3, 9, 1, 7, 7, 2, 8]
    sampler = EvalSampler(7, 4, lengths)
    batches = [sampler.replica_batch(r, 2, s) for s in range(2) for r in range(2)]
    ids = [i for b in batches for i, valid in zip(b.ids, b.valid) if valid]
    assert sorted(ids) == list(range(7)) and [lengths[i] for i in ids] == sorted(lengths)[::-1]
    assert batches[-1].valid == (True, False)  # padded with a sample of its own batch
    assert EvalSampler(7, 4).replica_batch(0, 1, 0).ids == (0, 1, 2, 3)


def test_a_pipeline_runs_a_batch_in_its_bucket_and_one_stage_at_its_own_length():
    config = config_from_dict(
        {
            "model": {"name": "bert"},
            "data": {"name": "sst2", "padding": "batch", "max_seq_length": 16},
        }
    )
    split = text_split([3, 9, 12, 5, 1, 2])
    one, two = SimpleNamespace(pipe_len=1), SimpleNamespace(pipe_len=2)
    assert step_seq_length(config, one, split, [0, 3]) == 8
    assert step_seq_length(config, two, split, [0, 1]) == 16
    config = config_from_dict(
        {
            "model": {"name": "bert"},
            "data": {"name": "sst2", "padding": "batch", "max_seq_length": 16},
        }
    )
    long = text_split([3, 9, 12, 5, 1, 2, 40, 30], max_length=64, multiple=8)
    wide = config_from_dict(
        {
            "model": {"name": "bert"},
            "data": {"name": "sst2", "padding": "batch", "max_seq_length": 64},
        }
    )
    assert step_seq_length(wide, one, long, [6, 0]) == 40  # 40 is a multiple of 8
    assert step_seq_length(wide, two, long, [6, 0]) == 64  # buckets 8, 16, 32, 64
    assert step_seq_length(wide, two, long, [7]) == 32


def test_whether_the_cache_pays_is_judged_at_the_batches_real_lengths():
    """Recomputing the frozen prefix costs what its units' times at max_seq_length say, times
    the run's mean padded length over max_seq_length: a read that beats recomputing full
    batches may lose to recomputing short ones."""
    from pipetransformer.autopipe.planner import UnitCosts
    from pipetransformer.trainer.caching import RunCache
    from pipetransformer.trainer.step import padded_length_share

    cache = RunCache.__new__(RunCache)
    cache.config, cache._said = config_from_dict({}), {}
    cache.read_s_per_sample = 0.6e-3
    # Embedding and layer 0 (units 0-2) take 10 ms a micro-batch of 10 at full length.
    costs = UnitCosts(trained=(0.0,) * 6, frozen=(4e-3, 3e-3, 3e-3, 0.0, 0.0, 0.0))
    assert cache.profitable(1, costs, 10)  # 1 ms a sample to recompute: read
    assert not cache.profitable(1, costs, 10, length_share=0.5)  # 0.5 ms: recompute
    config = config_from_dict(
        {
            "model": {"name": "bert"},
            "trainer": {"global_batch_size": 4},
            "data": {"name": "sst2", "padding": "batch", "max_seq_length": 16},
        }
    )
    split = text_split([3, 3, 3, 3, 12, 3, 3, 3], max_length=16)
    sampler = TrainSampler(8, 1, 4, seed=0)
    # Replica batches of 2 (2 replicas): the one with the 12-token sample at 16, three at 8.
    assert padded_length_share(config, split, sampler, 2) == pytest.approx(40 / 64)
    # A pipeline of several stages runs each batch in its bucket (8, 16, 32, 64 at
    # max_seq_length 64): the batch with a 20-token sample, padded to 24, runs at 32.
    odd = config_from_dict(
        {
            "model": {"name": "bert"},
            "trainer": {"global_batch_size": 4},
            "data": {"name": "sst2", "padding": "batch", "max_seq_length": 64},
        }
    )
    wide = text_split([3, 3, 20, 3, 3, 3, 3, 3], max_length=64)
    one_share = padded_length_share(odd, wide, sampler, 2)
    assert one_share == pytest.approx((24 + 8 + 8 + 8) / (4 * 64))
    assert padded_length_share(odd, wide, sampler, 2, pipe_len=2) == pytest.approx(
        (32 + 8 + 8 + 8) / (4 * 64)
    )
    images = SimpleNamespace(lengths=None)
    assert padded_length_share(config, images, sampler, 2) == 1.0


# ----------------------------------------------------------------------------- training

WORDS = "the a good bad film plot actor was very not quite fun dull great awful story".split()


def _write_text(path: Path) -> None:
    """48 training sentences: 28 of 1-5 words (at most 7 tokens: 8), 14 of 9-13 (16), 6 of
    40 (truncated at 32); 16 evaluation sentences."""
    rng = random.Random(4)
    sizes = [rng.randint(1, 5) for _ in range(28)] + [rng.randint(9, 13) for _ in range(14)]
    sizes += [40] * 6
    rng.shuffle(sizes)
    rows = ["text,label"]
    for i, n in enumerate(sizes):
        rows.append(" ".join(rng.choice(WORDS) for _ in range(n)) + f",{i % 2}")
    path.joinpath("train.csv").write_text("\n".join(rows) + "\n")
    rows = ["text,label"] + [
        " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 6, 12, 30]))) + f",{i % 2}"
        for i in range(16)
    ]
    path.joinpath("dev.csv").write_text("\n".join(rows) + "\n")


def _text_config(data_dir: Path, **data) -> dict:
    """A 2-stage pipeline of a tiny BERT whose first epoch packs it into one stage with 3 of
    4 layers frozen and a second replica (AutoCache serving them: filled in epoch 2, read
    in epoch 3)."""
    return {
        "trainer": {
            "epochs": 3,
            "seed": 0,
            "global_batch_size": 8,
            "nproc_per_node": 2,
            "progress_bar": False,
            "log_interval_steps": 1,
        },
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "lr_schedule": "constant"},
        "pipeline": {"initial_pipe_len": 2, "num_micro_batches": 2, "balance": "params"},
        "freeze": {"strategy": "manual", "manual_schedule": [3], "interval_steps": None},
        "autopipe": {"lambda_frozen": 0.02},
        "cache": {"enabled": True, "profile": False},
        "checkpoint": {"keep_best": False, "keep_last": 3},
        "model": {"name": TINY_BERT.name, "kwargs": dict(TINY_BERT.kwargs)},
        "data": {
            "name": "hf",
            "path": "csv",
            "data_files": {
                "train": str(data_dir / "train.csv"),
                "validation": str(data_dir / "dev.csv"),
            },
            "max_seq_length": 32,
            **{"padding": "batch", **data},  # per-batch padding unless a run says otherwise
        },
    }


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("padding")
    _write_text(root)
    runs = [
        ("batch", _text_config(root)),
        ("max_length", _text_config(root, padding="max_length")),
        ("grouped", _text_config(root, group_by_length=True)),
    ]
    # FSDP2 from the start (every rank a replica of the whole model, sharded), batches
    # grouped by length: the last run's layouts are one stage, every batch at its own length.
    sharded = _text_config(root, group_by_length=True)
    sharded["pipeline"] = {
        "initial_pipe_len": 1,
        "sharding": "always",
        "num_micro_batches": 1,
        "balance": "params",
    }
    runs[-1] = ("grouped", sharded)
    # Packed: the pipeline of packed shapes into DDP (AutoCache serving packed rows), and
    # FSDP2 grouped and packed.
    # The packed pipeline freezes one layer first (after epoch 1) and stays 2 stages, its
    # stage 0 running the frozen prefix on packed batches (AutoCache filling), then packs
    # into DDP after epoch 2 (upgrading the cached rows to 3 layers).
    packed = _text_config(root, padding="packed")
    packed["freeze"] = {**packed["freeze"], "manual_schedule": [1, 3]}
    runs.append(("packed", packed))
    runs.append(("packed_sharded", {**sharded, "data": {**sharded["data"], "padding": "packed"}}))
    # 6 steps an epoch: step 6 is the checkpoint after the transition.
    results = run_workers(elastic_runs, 2, runs, str(root), 6, {"batch", "packed"})
    return root, dict(runs), results[0]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_state_equal(state: dict, reference: dict) -> None:
    assert set(state) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(
            state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["batch", "max_length", "grouped", "packed", "packed_sharded"])
def test_a_pipeline_of_text_of_several_lengths_trains_as_one_process_does(text_runs, name):
    """Each run (per-batch padding, max_length padding, FSDP2 grouped by length, packed in
    the pipeline with a frozen prefix and then DDP, packed under FSDP2) equals the whole
    model trained in one process on the same batches, each padded to its own longest; the
    same run under another padding has the same losses at every step."""
    root, configs, results = text_runs
    metrics = _metrics(root / name)
    layouts = [(m["pipe_len"], m["dp_degree"], m["sharded"]) for m in metrics]
    if name in ("grouped", "packed_sharded"):
        assert layouts == [(1, 2, True)] * 3
    elif name == "packed":
        assert layouts == [(2, 1, False), (2, 1, False), (1, 2, False)]
        assert [m["num_frozen_layers"] for m in metrics] == [0, 1, 3]
    else:
        assert layouts == [(2, 1, False), (1, 2, False), (1, 2, False)]
    # Epoch 3 reads what epoch 2 stored (packed: upgrades it from 1 frozen layer to 3).
    assert metrics[2]["cache_hits"] + metrics[2]["cache_upgrades"] > 0
    reference_losses, reference_state, _ = reference_run(config_from_dict(configs[name]))
    losses = step_losses(root / name)
    assert len(losses) == len(reference_losses) == 18
    for step, (a, b) in enumerate(zip(losses, reference_losses)):
        assert a == pytest.approx(b, abs=1e-5), f"step {step}"
    _assert_state_equal(results[name]["state"][0], reference_state)
    same = {"max_length": "batch", "packed_sharded": "grouped"}
    if name in same:
        for step, (a, b) in enumerate(zip(losses, step_losses(root / same[name]))):
            assert a == pytest.approx(b, abs=1e-5), f"step {step}"


@pytest.mark.distributed
def test_the_pipeline_met_several_lengths_and_the_run_counts_its_tokens(text_runs):
    """The 2-stage pipeline's batches take 2 or 3 buckets in epoch 1; every epoch records its
    real tokens (every training sample's) and the tokens its batches held, which are what
    the layouts' lengths say: a quarter fewer than max_length's under per-batch padding,
    and packed what the packed shapes say."""
    root, configs, _ = text_runs
    config = config_from_dict(configs["batch"])
    data = build_data(config.data, seed=0)
    sampler = train_sampler(config, data.train, num_nodes=1)
    buckets = [
        bucket_length(data.train.batch_length(sampler.node_batch(0, 0, s).ids), 8, 32)
        for s in range(6)
    ]
    assert len(set(buckets)) >= 2, buckets
    padded = {name: [m["padded_tokens"] for m in _metrics(root / name)] for name in configs}
    assert padded["batch"][0] == 8 * sum(buckets)  # one replica of 8 a step, in its bucket
    assert padded["max_length"] == [6 * 8 * 32] * 3
    assert sum(padded["batch"]) < 0.75 * sum(padded["max_length"])
    # Packed, the pipeline's steps: 2 micro-batches of 4 in rows of the bucket, as many as
    # the fuller one needs in a bucket of 1, 2 or 4; a row holds several short sentences.
    pipeline = SimpleNamespace(pipe_len=2, plan=SimpleNamespace(num_micro_batches=2))
    packed = config_from_dict(configs["packed"])
    ids = [sampler.node_batch(0, 0, s).ids for s in range(6)]
    shapes = [step_seq_length(packed, pipeline, data.train, batch) for batch in ids]
    assert padded["packed"][0] == sum(s.tokens(8) for s in shapes)
    assert padded["packed"][0] < 0.7 * padded["batch"][0]
    # Never more than padded (DDP's micro-batches of 2 pack few); FSDP2's replica batches of
    # 4 in one micro-batch pack a third away.
    assert padded["packed"][2] <= padded["batch"][2]  # both DDP in epoch 3
    assert sum(padded["packed_sharded"]) < 0.75 * sum(padded["grouped"])
    # (48 samples make megabatches of one batch, as in transformers: grouping then only sorts
    # within a batch. test_length_grouping_* check what it saves on more data.)
    for name in configs:
        assert [m["real_tokens"] for m in _metrics(root / name)] == [sum(data.train.lengths)] * 3


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["batch", "packed"])
def test_a_resume_after_the_transition_ends_as_the_uninterrupted_run(text_runs, name):
    root, _, results = text_runs
    resumed = step_losses(root / f"{name}-resumed")
    assert resumed[6:] == pytest.approx(step_losses(root / name)[6:], abs=1e-6)
    _assert_state_equal(results[f"{name}-resumed"]["state"][0], results[name]["state"][0])
