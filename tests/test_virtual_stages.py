"""Several chunks (virtual stages) a rank under interleaved_1f1b and zero_bubble: AutoPipe's
partition into K v chunks placed round-robin, Eq. 2 on what a rank holds, v decided again at
every transition, and the handoff between layouts whose ranks hold non-contiguous units.
Pure: no processes."""

import json
from pathlib import Path

import pytest
from helpers import run_cli
from test_planner import vit_like

from pipetransformer.autodp.handoff import Transfer, plan_transfers
from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.memory import LayoutShape, MemoryModel, held_activations
from pipetransformer.autopipe.planner import (
    AutoPipePlanner,
    PipelinePlan,
    UnitCosts,
    balance,
    fixed_plan,
    stage_sizes,
)
from pipetransformer.autopipe.schedule_order import rank_order


def uniform(num_units, lam=1 / 6):
    return UnitCosts.from_param_counts([1] * num_units, lam)


def test_chunks_cover_the_active_units_in_order_and_run_round_robin():
    costs = vit_like()
    for frozen in (0, 3):
        for k, v in [(2, 2), (2, 3), (4, 2)]:
            plan = balance(costs, frozen, k, virtual_stages=v)
            assert plan.num_chunks == k * v and plan.virtual_stages == v
            bounds = [a for a, _ in plan.stage_ranges] + [plan.stage_ranges[-1][1]]
            assert bounds[0] == plan.prefix_end and bounds[-1] == costs.num_units
            assert all(a < b for a, b in zip(bounds, bounds[1:]))  # contiguous, non-empty
            for stage in range(k):
                chunks = plan.chunks_of_stage(stage)
                assert chunks == [stage + i * k for i in range(v)]
                assert all(plan.stage_of_chunk(c) == stage for c in chunks)
                units = plan.stage_units(stage)
                assert units == [u for c in chunks for u in range(*plan.stage_ranges[c])]
                assert all(plan.stage_of_unit(u) == stage for u in units)
                load = sum(plan.stage_costs[c] for c in chunks)
                assert plan.stage_loads[stage] == pytest.approx(load)
            every = sorted(u for s in range(k) for u in plan.stage_units(s))
            assert every == list(range(plan.prefix_end, costs.num_units))
            assert plan.max_stage_cost == pytest.approx(max(plan.stage_loads))
            # the first stage's rank runs the frozen prefix too
            assert plan.units_of_first_stage_rank()[: plan.prefix_end] == list(
                range(plan.prefix_end)
            )


def test_a_stage_of_several_chunks_holds_non_contiguous_units():
    plan = balance(uniform(12), 0, 2, virtual_stages=2)
    assert plan.stage_ranges == ((0, 3), (3, 6), (6, 9), (9, 12))
    assert plan.stage_units(0) == [0, 1, 2, 6, 7, 8]
    assert plan.stage_units(1) == [3, 4, 5, 9, 10, 11]
    assert plan.stage_loads == (6.0, 6.0) and plan.stage_costs == (3.0,) * 4


def test_chunks_are_balanced_by_the_same_cost_model_prefix_on_chunk_zero():
    costs = uniform(18)
    plan = balance(costs, 2, 2, "optimal", virtual_stages=2)  # prefix: units 0-4 at 1/6
    prefix = 5 / 6
    assert plan.prefix_end == 5
    assert plan.stage_costs[0] == pytest.approx(prefix + plan.stage_ranges[0][1] - 5)
    # 13 active units + the prefix's 5/6 in 4 chunks: the largest holds 4 units (optimal).
    assert max(plan.stage_costs) == pytest.approx(4.0)
    assert stage_sizes(costs, plan) == pytest.approx(list(plan.stage_loads))


def test_a_plan_must_hold_k_times_v_chunks():
    with pytest.raises(ValueError, match="3 chunks for 2 stages of 2 chunks"):
        PipelinePlan(0, 2, 0, ((0, 1), (1, 2), (2, 3)), (1.0, 1.0, 1.0), virtual_stages=2)


def test_records_of_one_chunk_plans_are_unchanged():
    one = balance(uniform(6), 0, 2)
    assert "virtual_stages" not in one.to_dict()
    assert balance(uniform(6), 0, 2, virtual_stages=3).to_dict()["virtual_stages"] == 3


def planner(schedule, initial, virtual_stages="auto", costs=None):
    return AutoPipePlanner(
        costs or vit_like(), initial, schedule=schedule, virtual_stages=virtual_stages
    )


def test_v_is_decided_again_for_every_layout():
    """auto: two chunks a rank where the active units fill them; a configured v falls back
    when they are too few; K = 1 is plain DDP: one chunk."""
    auto = planner("interleaved_1f1b", 2)  # 18 units: 2 chunks a rank at K = 2
    assert auto.initial.virtual_stages == 2
    assert [auto.plan(f, 2).virtual_stages for f in range(5)] == [2] * 5
    assert auto.plan(5, 2).pipe_len == 1 and auto.plan(5, 2).virtual_stages == 1
    many = planner("interleaved_1f1b", 2, virtual_stages=9)  # an int is used as given
    assert [many.plan(f, 2).virtual_stages for f in range(5)] == [9, 7, 6, 5, 4]
    fixed = planner("zero_bubble", 4, virtual_stages=2)
    plans = [fixed.plan(f, 4) for f in range(8)]
    assert [p.virtual_stages for p in plans[:5]] == [2] * 5
    assert all(p.num_chunks <= fixed.active_units(f) for f, p in enumerate(plans))
    assert plans[7].virtual_stages == 1  # 3 active units on 2 stages: one chunk each


def test_one_chunk_schedules_plan_as_before():
    """gpipe and 1f1b (and 'auto' v, their default) give the plans they gave before."""
    costs = vit_like()
    for schedule in ("gpipe", "1f1b"):
        new, old = planner(schedule, 4, costs=costs), AutoPipePlanner(costs, 4)
        for frozen in range(8):
            assert new.plan(frozen, 4) == old.plan(frozen, 4)
            assert new.plan(frozen, 4).virtual_stages == 1


def test_eq2_compares_what_a_rank_holds():
    """The budget is the initial plan's largest rank (its chunks summed), and a packed plan
    is compared the same way: interleaved layouts pack at the boundary GPipe packs at."""
    costs = vit_like()
    interleaved = planner("interleaved_1f1b", 4, virtual_stages=4, costs=costs)
    rank_loads = [
        sum(
            costs.trained[u] if u >= interleaved.initial.frozen_end else costs.frozen[u]
            for u in interleaved.initial.stage_units(s)
        )
        for s in range(4)
    ]
    assert interleaved.initial_max_size == pytest.approx(max(rank_loads))
    # a chunk's size alone would be a quarter of that: the wrong budget packs far later
    assert max(interleaved.initial.stage_costs) < 0.5 * interleaved.initial_max_size
    gpipe = AutoPipePlanner(costs, 4)
    assert [interleaved.plan(f, 4).pipe_len for f in range(8)] == [
        gpipe.plan(f, 4).pipe_len for f in range(8)
    ]


def test_a_packed_layout_takes_fewer_chunks_where_more_would_break_eq2():
    """At 5 of 8 layers frozen, 7 active units and the frozen prefix in 2 x 2 chunks leave the
    first rank above the budget; in 2 x 1 they pack, as GPipe does."""
    p = planner("interleaved_1f1b", 4, virtual_stages=2)
    too_many = p.balanced(5, 2, virtual_stages=2)
    assert max(stage_sizes(p.sizes, too_many)) > p.initial_max_size
    packed = p.plan(5, 4)
    assert (packed.pipe_len, packed.virtual_stages) == (2, 1)
    assert max(stage_sizes(p.sizes, packed)) <= p.initial_max_size


def test_a_memory_limit_still_has_the_last_word():
    costs = vit_like()
    refuse_two_stages = AutoPipePlanner(
        costs, 4, fits=lambda plan: plan.pipe_len != 2, schedule="zero_bubble"
    )
    assert refuse_two_stages.plan(6, 4).pipe_len == 4


def test_autopipe_off_keeps_the_initial_chunks():
    initial = planner("interleaved_1f1b", 2, virtual_stages=2).initial
    frozen = fixed_plan(vit_like(), initial, 3)
    assert frozen.stage_ranges == initial.stage_ranges and frozen.virtual_stages == 2
    assert frozen.prefix_end == 0 and frozen.frozen_end == 7


# ----------------------------------------------------------------------------- handoff


def two_chunk_plan(frozen=0):
    """12 units in 4 chunks on 2 stages: stage 0 holds 0-2 and 6-8, stage 1 3-5 and 9-11."""
    costs = uniform(12)
    return balance(costs, frozen, 2, virtual_stages=2)


def test_from_two_chunks_a_rank_to_one():
    old = Layout(two_chunk_plan(), 2, 2, 1)
    new = Layout(balance(uniform(12), 0, 2), 2, 2, 1)  # stages 0-5 | 6-11
    assert new.plan.stage_ranges == ((0, 6), (6, 12))
    assert plan_transfers(old, new) == [
        *(Transfer(u, 1, 0, True) for u in (3, 4, 5)),
        *(Transfer(u, 0, 1, True) for u in (6, 7, 8)),
    ]
    # and back: the same units the other way
    assert plan_transfers(new, old) == [
        *(Transfer(u, 1, 0, True) for u in (6, 7, 8)),
        *(Transfer(u, 0, 1, True) for u in (3, 4, 5)),
    ]


def test_from_two_chunks_a_rank_to_ddp():
    """K = 1, R = 2 with one layer frozen: each rank receives what the other held, the
    frozen units (0-2, the new prefix) without optimizer state."""
    old = Layout(two_chunk_plan(), 2, 2, 1)
    new = Layout(balance(uniform(12), 1, 1), 2, 2, 2)
    assert new.plan.prefix_end == 3
    assert plan_transfers(old, new) == [
        *(Transfer(u, 1, 0, True) for u in (3, 4, 5, 9, 10, 11)),
        *(Transfer(u, 0, 1, u >= 3) for u in (0, 1, 2, 6, 7, 8)),
    ]


@pytest.mark.parametrize(
    "old_kv, new_kv", [((4, 2), (2, 2)), ((4, 2), (2, 1)), ((4, 1), (2, 3)), ((2, 3), (1, 1))]
)
def test_transfers_on_two_nodes_come_from_the_destinations_old_replica(old_kv, new_kv):
    costs = vit_like()
    (k0, v0), (k1, v1) = old_kv, new_kv
    old = Layout(balance(costs, 0, k0, virtual_stages=v0), 8, 4, 8 // k0)
    new = Layout(balance(costs, 4, k1, virtual_stages=v1), 8, 4, 8 // k1)
    transfers = plan_transfers(old, new)
    assert transfers
    for rank in range(8):
        received = {t.unit for t in transfers if t.dst == rank}
        assert set(new.units_of_rank(rank)) <= set(old.units_of_rank(rank)) | received
        assert not received & set(old.units_of_rank(rank))
    for t in transfers:
        role = old.role(t.dst)
        source_replica = old.pipeline_ranks(role.replica)
        assert t.src in source_replica and t.unit in old.units_of_rank(t.src)
        assert t.with_optimizer_state == (t.unit >= new.plan.frozen_end)


def test_a_layout_names_each_chunks_stage():
    layout = Layout(two_chunk_plan(), 2, 2, 1)
    assert "virtual_stages=2 chunk_units=[0-2@0, 3-5@1, 6-8@0, 9-11@1]" in layout.describe()
    assert layout.units_of_rank(1) == [3, 4, 5, 9, 10, 11]
    assert layout.units_of_rank(0) == [0, 1, 2, 6, 7, 8]


# ----------------------------------------------------------------------------- memory


def test_activations_in_flight_are_the_papers_counts():
    """Walking torch's order (checked against torch in test_schedules.py) with equal chunks:
    interleaved 1F1B holds Megatron's warm-up plus one on rank r, zero bubble (v - 1) R + K on
    every rank (ZB-H1's K at v = 1), both at most M v."""
    for k in (2, 4, 8):
        for v in (1, 2, 3, 4):
            for m in range(k, 4 * k + 1):
                if m % max(1, m // k):
                    continue
                rounds = m // max(1, m // k)
                for r in range(k):
                    interleaved, _ = held_activations(
                        rank_order("interleaved_1f1b", k, v, m, r), [1.0] * v, "B"
                    )
                    warmup = (v - 1) * rounds + 2 * (k - 1 - r)
                    assert interleaved == min(warmup + 1, m * v), (k, v, m, r)
                    zero, _ = held_activations(
                        rank_order("zero_bubble", k, v, m, r), [1.0] * v, "W"
                    )
                    assert zero == min((v - 1) * rounds + k, m * v), (k, v, m, r)


def chunked_memory(num_units=18, frozen=0, k=2, v=2, m=4, schedule="interleaved_1f1b", dp=1):
    params = tuple(100 * (u + 1) for u in range(num_units))
    saved = tuple(1000 for _ in range(num_units))
    outputs = tuple(10 for _ in range(num_units))
    model = MemoryModel(params, saved, outputs, 2, 2.0)
    plan = balance(uniform(num_units), frozen, k, virtual_stages=v)
    return model, plan, LayoutShape(4, m, dp, schedule)


def test_a_rank_holds_the_sum_of_its_chunks():
    model, plan, shape = chunked_memory(frozen=1, dp=2)
    assert plan.prefix_end == 3
    total_params = 0.0
    for stage in range(plan.pipe_len):
        memory = model.stage_memory(plan, stage, shape)
        units = plan.stage_units(stage)
        held = units + (list(range(plan.prefix_end)) if stage == 0 else [])
        assert memory.parameters == sum(model.param_bytes[u] for u in held)
        assert memory.gradients == sum(model.param_bytes[u] for u in units)
        assert memory.optimizer == 2.0 * memory.gradients == memory.ddp_buckets * 2.0
        # equal saved bytes a unit: every chunk of 15 active units in 4 holds 3 or 4
        per_chunk = [2 * 1000 * (b - a) for a, b in plan.stage_unit_ranges(stage)]
        order = rank_order("interleaved_1f1b", 2, 2, 4, stage)
        assert memory.activations == held_activations(order, per_chunk, "B")[0]
        total_params += memory.parameters
    assert total_params == sum(model.param_bytes)


def test_interleaved_at_one_chunk_holds_what_1f1b_holds():
    model, plan, _ = chunked_memory(k=4, v=1, m=8)
    for stage in range(4):
        ours = model.stage_memory(plan, stage, LayoutShape(4, 8, 1, "interleaved_1f1b"))
        assert ours == model.stage_memory(plan, stage, LayoutShape(4, 8, 1, "1f1b"))


def test_zero_bubble_at_one_chunk_holds_k_micro_batches_on_every_stage():
    model, plan, _ = chunked_memory(num_units=16, k=4, v=1, m=8)
    one_f_one_b = [
        model.stage_memory(plan, s, LayoutShape(4, 8, 1, "1f1b")).activations for s in range(4)
    ]
    zero = [
        model.stage_memory(plan, s, LayoutShape(4, 8, 1, "zero_bubble")).activations
        for s in range(4)
    ]
    per_micro_batch = [2 * 1000 * (b - a) for a, b in plan.stage_ranges]
    assert zero == [4 * b for b in per_micro_batch]
    assert one_f_one_b[0] == zero[0] and one_f_one_b[3] == per_micro_batch[3]


def test_more_chunks_hold_about_as_much_as_1f1b():
    """K = 4, M = 8 on 16 equal units: 1F1B's first stage holds 4 micro-batches of its
    stage; interleaved 1F1B with v chunks 4 + 3 / v of them, zero bubble 4."""
    model, one_chunk, _ = chunked_memory(num_units=16, k=4, v=1, m=8)
    stage_bytes = model.stage_memory(one_chunk, 0, LayoutShape(4, 8, 1, "1f1b")).activations
    for v in (2, 4):
        plan = balance(uniform(16), 0, 4, virtual_stages=v)
        interleaved = model.stage_memory(plan, 0, LayoutShape(4, 8, 1, "interleaved_1f1b"))
        zero = model.stage_memory(plan, 0, LayoutShape(4, 8, 1, "zero_bubble"))
        assert interleaved.activations == pytest.approx(stage_bytes / 4 * (4 + 3 / v))
        assert zero.activations == pytest.approx(stage_bytes)


# ----------------------------------------------------------------------------- plan


QUICKSTART = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml")


def test_plan_json_carries_the_chunk_placement():
    result = run_cli(
        "plan",
        QUICKSTART,
        "--json",
        "pipeline.balance=params",
        "pipeline.initial_pipe_len=2",
        "pipeline.schedule=interleaved_1f1b",
        "pipeline.virtual_stages=3",
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    for row in rows:
        k, v = row["pipe_len"], row["virtual_stages"]
        assert len(row["stage_ranges"]) == len(row["chunk_stages"]) == k * v
        assert len(row["stage_bytes"]) == k  # the memory model's bytes of each stage (rank)
        assert row["chunk_stages"] == [c % k for c in range(k * v)]
        starts = [a for a, _ in row["stage_ranges"]]
        assert starts[0] == row["prefix_units"][1] and starts == sorted(starts)
        assert row["schedule"] == (None if k == 1 else "1f1b" if v == 1 else "interleaved_1f1b")
        assert row["max_stage_cost"] == pytest.approx(
            max(
                sum(c for c, s in zip(row["stage_costs"], row["chunk_stages"]) if s == stage)
                for stage in range(k)
            ),
            abs=1,
        )
    assert rows[0]["virtual_stages"] == 3 and rows[0]["pipe_len"] == 2
    assert rows[-1]["pipe_len"] == 1 and rows[-1]["virtual_stages"] == 1  # plain DDP
    gpipe = json.loads(
        run_cli(
            "plan", QUICKSTART, "--json", "pipeline.balance=params", "pipeline.initial_pipe_len=2"
        ).stdout
    )
    assert all(
        r["virtual_stages"] == 1 and r["chunk_stages"] == list(range(r["pipe_len"])) for r in gpipe
    )


def test_plan_text_names_each_chunks_stage():
    result = run_cli(
        "plan",
        QUICKSTART,
        "pipeline.balance=params",
        "pipeline.initial_pipe_len=2",
        "pipeline.schedule=zero_bubble",
        "pipeline.virtual_stages=2",
    )
    assert result.returncode == 0, result.stderr
    assert "schedule zero_bubble (ScheduleInterleavedZeroBubble)" in result.stdout
    first = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["0"])
    assert first.split()[1:3] == ["2", "2"]  # K, v
    assert "c0@0 embedding" in first and "| c1@1 " in first and "| c3@1 " in first


def test_a_configured_v_the_model_cannot_hold_is_one_line_naming_the_key():
    result = run_cli(
        "plan",
        QUICKSTART,
        "pipeline.initial_pipe_len=2",
        "pipeline.schedule=zero_bubble",
        "pipeline.virtual_stages=20",
    )
    assert result.returncode == 2
    assert "pipeline.virtual_stages: 20 chunks a rank on pipe_len 2 need 40" in result.stderr


def test_predict_gives_each_boundary_its_chunks_and_a_smaller_bubble():
    """plan --predict on a named GPU: with interleaved 1F1B the rows carry v, and where v > 1
    the bubble is (K - 1) / (v M + K - 1) of equal chunks' step or near it, below GPipe's."""
    args = ["--predict", "--device", "h100-sxm", "--json", "pipeline.initial_pipe_len=2"]
    args += ["pipeline.sharding=never"]
    gpipe = json.loads(run_cli("plan", QUICKSTART, *args).stdout)
    result = run_cli("plan", QUICKSTART, *args, "pipeline.schedule=interleaved_1f1b")
    assert result.returncode == 0, result.stderr
    interleaved = json.loads(result.stdout)
    assert interleaved["schedule"] == "interleaved_1f1b" and gpipe["schedule"] == "gpipe"
    chunked = [r for r in interleaved["rows"] if r["virtual_stages"] > 1]
    assert chunked
    for row, plain in zip(interleaved["rows"], gpipe["rows"]):
        if row["virtual_stages"] > 1:
            assert row["pipe_len"] == plain["pipe_len"] > 1
            assert 1 < row["bubble"] < plain["bubble"]
            assert row["p2p_s"] > plain["p2p_s"]  # v times the sends
