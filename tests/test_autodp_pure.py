"""AutoDP without processes: topology arithmetic, the sampler, the transfer plan."""

from collections import Counter

import pytest

from pipetransformer.autodp.handoff import plan_transfers
from pipetransformer.autodp.sampler import EvalSampler, TrainSampler
from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.planner import AutoPipePlanner, UnitCosts, balance, fixed_plan

COSTS = UnitCosts.from_param_counts([2] + [10, 10] * 8 + [1], 1 / 6)


def layout(frozen, pipe_len, world=8, per_node=8, dp=None):
    plan = balance(COSTS, frozen, pipe_len)
    return Layout(plan, world, per_node, dp or world // pipe_len)


def test_every_rank_has_one_role_and_pipelines_stay_on_a_node():
    for pipe_len in (8, 4, 2, 1):
        lay = layout(0, pipe_len, world=16, per_node=8)
        roles = [lay.role(r) for r in range(16)]
        assert all(r is not None for r in roles)
        assert len({(r.replica, r.stage) for r in roles}) == 16
        for replica in range(lay.dp_degree):
            ranks = lay.pipeline_ranks(replica)
            assert len({r // 8 for r in ranks}) == 1
            assert [lay.role(r).stage for r in ranks] == list(range(pipe_len))
        for stage in range(pipe_len):
            assert [lay.role(r).replica for r in lay.data_ranks(stage)] == list(
                range(lay.dp_degree)
            )


def test_halving_turns_later_stages_into_a_new_replica():
    old, new = layout(0, 4, world=4, per_node=4), layout(5, 2, world=4, per_node=4)
    assert [old.role(r).stage for r in range(4)] == [0, 1, 2, 3]
    assert [(new.role(r).replica, new.role(r).stage) for r in range(4)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]


def test_idle_ranks_without_autodp():
    lay = layout(5, 2, world=4, per_node=4, dp=1)
    assert [lay.role(r) is None for r in range(4)] == [False, False, True, True]
    assert lay.units_of_rank(3) == []


def test_first_stage_rank_holds_the_frozen_prefix():
    lay = layout(3, 2, world=2, per_node=2)
    assert lay.units_of_rank(0)[:7] == list(range(7))
    held = Counter(u for r in range(2) for u in lay.units_of_rank(r))
    assert set(held) == set(range(COSTS.num_units)) and max(held.values()) == 1


def test_sampler_every_sample_once_per_epoch_across_a_transition():
    sampler = TrainSampler(num_samples=203, num_nodes=2, global_batch_size=16, seed=7)
    steps = sampler.steps_per_epoch
    assert steps == 13  # ceil(102 / 8)
    for epoch in range(2):
        seen = Counter()
        for step in range(steps):
            replicas_per_node = 1 if step < 5 else 4  # R changes mid-epoch: 2 -> 8
            for node in range(2):
                for local in range(replicas_per_node):
                    batch = sampler.replica_batch(node, local, replicas_per_node, epoch, step)
                    assert len(batch.ids) == 16 // 2 // replicas_per_node
                    seen.update(i for i, v in zip(batch.ids, batch.valid) if v)
        assert seen == Counter(range(203))


def test_sampler_nodes_keep_their_subset_and_reshuffle():
    sampler = TrainSampler(num_samples=100, num_nodes=2, global_batch_size=10, seed=1)
    a0, a1 = sampler.epoch_order(0, 0), sampler.epoch_order(0, 1)
    assert set(a0) == set(a1) and a0 != a1
    assert not set(a0) & set(sampler.epoch_order(1, 0))
    again = TrainSampler(num_samples=100, num_nodes=2, global_batch_size=10, seed=1)
    assert again.epoch_order(0, 1) == a1  # a pure function of (seed, node, epoch)


def test_sampler_padding_is_marked_and_counted():
    sampler = TrainSampler(num_samples=10, num_nodes=1, global_batch_size=4, seed=0)
    assert sampler.steps_per_epoch == 3
    last = sampler.node_batch(0, 0, 2)
    assert len(last.ids) == 4 and last.valid == (True, True, False, False)
    assert sampler.global_num_valid(0, 2) == 2


def test_eval_sampler_covers_the_set_once_over_replicas():
    sampler = EvalSampler(num_samples=37, global_batch_size=8)
    seen = Counter()
    for step in range(sampler.steps):
        for replica in range(4):
            batch = sampler.replica_batch(replica, 4, step)
            assert len(batch.ids) == 2
            seen.update(i for i, v in zip(batch.ids, batch.valid) if v)
    assert seen == Counter(range(37))


def check_transfers(old, new):
    transfers = plan_transfers(old, new)
    for rank in range(new.world_size):
        have = set(old.units_of_rank(rank)) | {t.unit for t in transfers if t.dst == rank}
        assert set(new.units_of_rank(rank)) <= have
    for t in transfers:
        assert t.unit in old.units_of_rank(t.src)
        assert t.src // old.devices_per_node == t.dst // old.devices_per_node  # stays on the node
        assert t.with_optimizer_state == (t.unit >= new.plan.frozen_end)
    # Nothing is sent to a rank that already holds it, nor twice.
    assert len({(t.unit, t.dst) for t in transfers}) == len(transfers)
    return transfers


def test_transfers_cover_every_new_need():
    old = layout(0, 4, world=8, per_node=4)
    mid = layout(3, 2, world=8, per_node=4)
    end = layout(7, 1, world=8, per_node=4)
    first = check_transfers(old, mid)
    assert first  # the new replicas' ranks need units
    check_transfers(mid, end)
    check_transfers(old, end)


def test_transfers_with_fixed_layout_move_nothing():
    planner = AutoPipePlanner(COSTS, 2)
    old = Layout(planner.initial, 2, 2, 1)
    new = Layout(fixed_plan(COSTS, planner.initial, 4), 2, 2, 1)
    assert plan_transfers(old, new) == []


def test_layout_rejects_pipelines_that_do_not_fit_a_node():
    with pytest.raises(ValueError):
        Layout(balance(COSTS, 0, 4), 6, 6, 1)


@pytest.mark.parametrize("pipe_len", [8, 4, 2, 1])
def test_a_layouts_groups_are_two_partitions_of_the_world(pipe_len):
    """On NCCL each partition is one communicator split of the world (two per transition,
    not one per group); each partition covers every active rank once."""
    from pipetransformer.autodp.groups import group_partitions

    lay = layout(0, pipe_len, world=16, per_node=8)
    pipelines, data = group_partitions(lay)
    assert len(pipelines) == lay.dp_degree and all(len(g) == pipe_len for g in pipelines)
    assert sorted(r for g in pipelines for r in g) == list(range(16))
    if lay.dp_degree == 1:
        assert data == []
    else:
        assert len(data) == pipe_len and sorted(r for g in data for r in g) == list(range(16))
