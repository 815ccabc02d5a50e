"""The step-time model of a sharded layout (FSDP2), by hand, and `plan --predict`'s FSDP2
peers. Unit tier: no processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipetransformer.autopipe.memory import shard_groups
from pipetransformer.autopipe.planner import UnitCosts, balance
from pipetransformer.config import config_from_dict, load_config
from pipetransformer.planning.predict import predict
from pipetransformer.planning.prediction_inputs import cluster_from_flags, prediction_unit_times
from pipetransformer.planning.step_model import Links, UnitTimes, predict_sharded_step

ROOT = Path(__file__).resolve().parent.parent

# Six units (embedding, two layers of two sublayers, head): forward 1 s and forward +
# backward 3 s each at micro-batch 2; 100 bytes of parameters each. Links of 100 B/s.
TIMES = UnitTimes(
    trained_s=(3.0,) * 6,
    frozen_s=(1.0,) * 6,
    output_bytes=(4,) * 6,
    param_bytes=(100,) * 6,
    micro_batch_size=2,
    memory_bytes_per_s=1e12,
    optimizer_passes=0.0,
)
LINKS = Links(100.0, 10.0, latency_s=0.0)


def _step(frozen: int, overlap: bool, shards: int = 2, m: int = 1, spans_nodes: bool = False):
    plan = balance(UnitCosts.from_param_counts([1] * 6, 1 / 6), frozen, 1)
    return predict_sharded_step(
        TIMES,
        plan,
        shard_groups(plan.frozen_end, 6),
        micro_batch_size=2,
        num_micro_batches=m,
        shards=shards,
        spans_nodes=spans_nodes,
        links=LINKS,
        prefix_s=0.5 if frozen else 0.0,
        overlap=overlap,
    )


def test_a_sharded_step_without_overlap_adds_every_collective():
    """Groups: embedding (100 B), two layers (200 B each), head (100 B); over 2 ranks a
    ring moves half of each: gathers 0.5, 1, 1, 0.5 s, again before backward but the head's
    (2.5 s), reduce-scatters 3 s. Compute: 6 forwards of 1 s, 6 backwards of 2 s."""
    step = _step(0, overlap=False)
    assert step.compute_s == pytest.approx(18.0)
    assert step.allreduce_s == pytest.approx(3.0 + 2.5 + 3.0)
    assert step.hidden_s == 0.0 and step.p2p_s == 0.0
    # Two micro-batches: twice the units' time and the collectives, the same prefix.
    two = _step(0, overlap=False, m=2)
    assert (two.compute_s, two.allreduce_s) == pytest.approx((36.0, 17.0))
    # Between nodes (10 B/s) the collectives take ten times as long.
    assert _step(0, overlap=False, spans_nodes=True).allreduce_s == pytest.approx(85.0)
    # One shard: nothing to gather.
    assert _step(0, overlap=False, shards=1).allreduce_s == 0.0


def test_a_sharded_step_with_overlap_hides_what_compute_covers():
    """Forward: the embedding's gather (0.5 s) is exposed, each next gather runs under the
    current group's compute. Backward: each group's gather for the one below and its own
    reduce-scatter run under the next group's backward; the last reduce-scatter (the
    embedding's, 0.5 s) is exposed."""
    step = _step(0, overlap=True)
    assert step.compute_s == pytest.approx(18.0)
    assert step.allreduce_s == pytest.approx(1.0)  # 0.5 before, 0.5 after
    assert step.hidden_s == pytest.approx(8.5 - 1.0)
    # Layer 0 and the embedding frozen (their prefix, 0.5 s, runs in front of the root,
    # which issues the first gather only when it is called): layer 1 (200 B) is gathered
    # first and reduce-scattered last, both exposed (1 s each).
    frozen = _step(1, overlap=True)
    assert frozen.compute_s == pytest.approx(0.5 + 3 * 1.0 + 3 * 2.0)
    assert frozen.allreduce_s == pytest.approx(2.0)


def test_plan_predict_prices_the_fsdp_peers(tmp_path):
    """BERT-large at 512 on the paper's cluster: DDP's replica does not fit a 16 GB Quadro,
    FSDP2's does, with the batch in the fewest micro-batches that fit; freezing makes it
    faster, and its peak is the sharded one."""
    config = load_config(
        ROOT / "configs" / "bert_squad.yaml", [f"pipeline.profile_path={tmp_path / 'no.json'}"]
    )
    cluster = cluster_from_flags(
        2, 8, device_name="quadro-rtx-5000", intra_node="pcie3-x16", inter_node="infiniband-cx353a"
    )
    chosen = prediction_unit_times(config, cluster)
    result = predict(config, chosen.profile, cluster, 87_599, "auto", chosen.times)
    peers = {p.name: p for p in result.peers}
    assert not peers["ddp"].fits
    fsdp, freeze_fsdp = peers["fsdp"], peers["freeze_fsdp"]
    assert fsdp.fits and freeze_fsdp.fits
    assert (fsdp.pipe_len, fsdp.dp_degree) == (1, 16) and fsdp.num_micro_batches > 1
    assert fsdp.peak_bytes <= result.device_memory_bytes < peers["ddp"].peak_bytes
    assert freeze_fsdp.run_s < fsdp.run_s
    # The baseline's global batch: 128 sequences, 8 a device; 87,599 / 2 a node.
    steps = math.ceil(math.ceil(87_599 / 2) / 64)
    assert fsdp.run_s == pytest.approx(3 * steps * fsdp.step_s)


def _tiny(**pipeline) -> tuple:
    from helpers import TINY_VIT, tiny_vit

    from pipetransformer.config import config_from_dict

    config = config_from_dict(
        {
            "trainer": {"global_batch_size": 8, "nproc_per_node": 2},
            "optimizer": {"name": "adamw"},
            "pipeline": {
                "initial_pipe_len": 2,
                "num_micro_batches": 2,
                "balance": "params",
                **pipeline,
            },
            "model": {"name": TINY_VIT.name, "kwargs": TINY_VIT.kwargs},
        }
    )
    return config, tiny_vit().spec


def test_auto_shards_where_only_it_fits_or_it_is_faster_and_fits():
    """The tiny ViT on 2 devices: the 2-stage pipeline needs 285 KB at F = 0 and 242 KB at
    F = 1, the sharded layout 419 KB and 382 KB."""
    from pipetransformer.config import World
    from pipetransformer.planning.context import PlanContext

    config, spec = _tiny()
    world = World(2, 2)

    def prefer(sharded: bool):
        return lambda layout, prefix_s: 1.0 if layout.sharded == sharded else 2.0

    def layouts(budget, pricer):
        context = PlanContext.build(config, spec, world, budget_bytes=budget).with_pricer(pricer)
        return [context.layout_for(f, 2) for f in (0, 1)], context

    unlimited, _ = layouts(None, prefer(True))
    assert all(layout.sharded for layout in unlimited)
    (first, second), context = layouts(500_000, prefer(True))
    assert first.sharded and second.sharded and first.dp_degree == 2
    slower, _ = layouts(500_000, prefer(False))
    assert [(s.pipe_len, s.sharded) for s in slower] == [(2, False), (2, False)]
    tight, context = layouts(400_000, prefer(True))  # sharded fits at F = 1 only
    assert [s.sharded for s in tight] == [False, True]
    # Out of a sharded layout the pipeline is AutoPipe's from the initial length again
    # (no budget here: at 400 KB the move back, every unit gathered, would not fit).
    free = PlanContext.build(config, spec, world).with_pricer(prefer(False))
    back = free.layout_for(1, 1, moving_from=tight[1])
    assert (back.pipe_len, back.sharded) == (2, False)
    assert context.with_pricer(prefer(False)).layout_for(1, 1, moving_from=tight[1]).sharded
    # Where only the sharded layout fits, it is taken without a price. With 1,000 bytes
    # saved a sample and unit, 64 samples a step: AutoPipe's 2 stages of 2 micro-batches
    # need 547 KB, the sharded layout fits 500 KB in more micro-batches.
    import dataclasses

    from pipetransformer.autopipe.memory import MemoryModel

    crowded = config_from_dict(
        {**config.to_dict(), "trainer": {"global_batch_size": 64, "nproc_per_node": 2}}
    )
    params = tuple(4 * count for count in spec.unit_param_counts)
    memory = MemoryModel(params, (1000,) * len(params), (100,) * len(params), 1, 2.0)
    squeezed = dataclasses.replace(
        PlanContext.build(crowded, spec, world), memory=memory, budget_bytes=500_000
    )
    assert max(squeezed.layout_bytes(squeezed._pipeline_layout(0, 2, None, None, None))) > 500_000
    taken = squeezed.layout_for(0, 2)  # no pricer
    assert taken.sharded and taken.plan.num_micro_batches > 1
    assert max(squeezed.layout_bytes(taken)) <= 500_000
    # Under the paper's batch semantics every process a replica would grow the batch: never.
    per_replica = config_from_dict(
        {"trainer": {"batch_per_replica": 4, "nproc_per_node": 2}, "pipeline": {"sharding": "auto"}}
    )
    assert not PlanContext.prices(per_replica) and PlanContext.prices(config)
    never, _ = _tiny(sharding="never")
    assert not PlanContext.prices(never)
