"""The pipeline schedules' rules (config/schedules.py) against torch's own schedule classes,
built in this process from stand-in stages (torch builds a schedule's order without
communicating), and the config errors those rules give before any process starts."""

import types
from pathlib import Path

import pytest
from helpers import run_cli
from torch.distributed.pipelining import schedules as torch_schedules

from pipetransformer.config import (
    TORCH_SCHEDULE_CLASS,
    ConfigError,
    config_from_dict,
    layout_schedule,
    micro_batch_problem,
    smallest_micro_batches,
    virtual_stages_for,
    virtual_stages_problem,
)

QUICKSTART = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml")


def torch_schedule(schedule: str, pipe_len: int, virtual_stages: int, num_micro_batches: int):
    """torch's schedule object for rank 0 of a looped layout, from stand-in stages: its
    constructor computes and validates every rank's order (`pipeline_order`) without any
    communication."""
    stages = [
        types.SimpleNamespace(
            group_size=pipe_len,
            num_stages=pipe_len * virtual_stages,
            group_rank=0,
            stage_index=chunk * pipe_len,
            stage_index_to_group_rank=None,
            submod=None,
        )
        for chunk in range(virtual_stages)
    ]
    cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASS[schedule])
    return cls(stages, num_micro_batches)


def test_the_schedule_table_is_what_torchs_classes_are():
    """config/schedules.py's one table (what everything reads: the runtime, the step and
    memory models, the schedule orders, the benchmarks) against torch: the class exists,
    takes several chunks a rank exactly when PipelineScheduleMulti, and splits the backward
    into I and W exactly when its order has W actions; the names are the config's."""
    from typing import get_args

    from pipetransformer.config import SCHEDULE_PROPERTIES, SCHEDULES, ScheduleName

    assert get_args(ScheduleName) == SCHEDULES == tuple(SCHEDULE_PROPERTIES)
    for name, properties in SCHEDULE_PROPERTIES.items():
        cls = getattr(torch_schedules, properties.torch_class)
        multi = issubclass(cls, torch_schedules.PipelineScheduleMulti)
        assert multi == properties.multi_chunk, name
        if multi:
            order = torch_schedule(name, 2, 2, 4).pipeline_order
        else:
            stage = types.SimpleNamespace(num_stages=2)
            order = cls(stage, 4)._get_pipeline_order()
        kinds = {a.computation_type.value for actions in order.values() for a in actions if a}
        assert ("W" in kinds) == properties.split_backward, (name, kinds)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
@pytest.mark.parametrize("pipe_len", [2, 4, 8])
def test_the_micro_batch_rule_is_torchs_from_pipe_len_up(schedule, pipe_len):
    """Every M >= K the rule accepts, torch's class builds; every one it refuses, torch
    refuses too (K = 4: 9 micro-batches in 2 rounds)."""
    for m in range(pipe_len, 4 * pipe_len + 1):
        ours = micro_batch_problem(schedule, pipe_len, m) is None
        try:
            torch_schedule(schedule, pipe_len, 2, m)
            theirs = True
        except ValueError:
            theirs = False
        assert ours == theirs, (schedule, pipe_len, m)
    assert micro_batch_problem(schedule, 4, 9) is not None
    assert micro_batch_problem(schedule, 4, 10) is None


def test_fewer_micro_batches_than_stages_are_refused_as_for_1f1b():
    # torch runs them (its 'flex' rounds); this project refuses them like 1F1B.
    torch_schedule("interleaved_1f1b", 4, 2, 3)
    for schedule in ("1f1b", "interleaved_1f1b", "zero_bubble"):
        assert "needs at least pipe_len (4)" in micro_batch_problem(schedule, 4, 3)
    assert micro_batch_problem("gpipe", 4, 3) is None
    assert micro_batch_problem("zero_bubble", 1, 1) is None  # plain DDP: no schedule


def test_the_looped_placement_is_torchs():
    """Chunk c runs on the replica's rank c mod K in both multi-chunk schedules."""
    for schedule in ("interleaved_1f1b", "zero_bubble"):
        for k, v in [(2, 2), (2, 3), (4, 2), (4, 4)]:
            placed = torch_schedule(schedule, k, v, 2 * k).stage_index_to_group_rank
            assert placed == {c: c % k for c in range(k * v)}


def test_the_measurement_free_micro_batch_count_runs():
    assert smallest_micro_batches("gpipe", 4, 36) == 4
    assert smallest_micro_batches("interleaved_1f1b", 4, 9) is None  # only 9: two rounds
    assert smallest_micro_batches("gpipe", 4, 9) == 9
    assert smallest_micro_batches("zero_bubble", 4, 40) == 4
    assert smallest_micro_batches("zero_bubble", 1, 7) == 1
    for k in (2, 4, 8):
        for batch in range(k, 12 * k):
            m = smallest_micro_batches("interleaved_1f1b", k, batch)
            if m is not None:
                assert batch % m == 0 and micro_batch_problem("interleaved_1f1b", k, m) is None
                torch_schedule("interleaved_1f1b", k, 2, m)


def test_virtual_stages_are_re_decided_for_each_layout():
    # auto: two chunks a rank (torchtitan's default), one where the units cannot fill 2 K
    assert virtual_stages_for("interleaved_1f1b", "auto", 2, 17) == 2
    assert virtual_stages_for("zero_bubble", "auto", 4, 9) == 2
    assert virtual_stages_for("zero_bubble", "auto", 4, 7) == 1
    assert virtual_stages_for("interleaved_1f1b", "auto", 2, 3) == 1
    # a configured v falls back when the units are too few, never below 1
    assert virtual_stages_for("interleaved_1f1b", 4, 2, 17) == 4
    assert virtual_stages_for("interleaved_1f1b", 4, 2, 5) == 2
    assert virtual_stages_for("interleaved_1f1b", 4, 4, 3) == 1
    # one chunk for the others and for plain DDP
    assert virtual_stages_for("gpipe", "auto", 2, 17) == 1
    assert virtual_stages_for("1f1b", "auto", 4, 17) == 1
    assert virtual_stages_for("zero_bubble", "auto", 1, 17) == 1
    # at the start a configured v must fit
    assert "need 8 active units" in virtual_stages_problem("zero_bubble", 4, 2, 5)
    assert virtual_stages_problem("zero_bubble", "auto", 2, 5) is None
    assert virtual_stages_problem("zero_bubble", 2, 2, 5) is None


def test_the_schedule_a_layout_runs():
    assert layout_schedule("interleaved_1f1b", 1, 1) is None  # plain DDP
    assert layout_schedule("interleaved_1f1b", 4, 1) == "1f1b"
    assert layout_schedule("interleaved_1f1b", 4, 2) == "interleaved_1f1b"
    assert layout_schedule("zero_bubble", 4, 1) == "zero_bubble"
    assert layout_schedule("gpipe", 2, 1) == "gpipe"


def config(**pipeline):
    return {
        "trainer": {"nproc_per_node": 4, "global_batch_size": 40},
        "pipeline": {"initial_pipe_len": 4, **pipeline},
    }


@pytest.mark.parametrize(
    "pipeline, key, words",
    [
        ({"schedule": "gpipe", "virtual_stages": 2}, "pipeline.virtual_stages", "need pipeline"),
        ({"schedule": "zero_bubble", "virtual_stages": 0}, "pipeline.virtual_stages", ">= 1"),
        (
            {"schedule": "interleaved_1f1b", "num_micro_batches": 2},
            "pipeline.num_micro_batches",
            "at least pipe_len (4)",
        ),
        (
            {"schedule": "zero_bubble", "num_micro_batches": 2},
            "pipeline.num_micro_batches",
            "at least pipe_len (4)",
        ),
    ],
)
def test_schedule_settings_are_checked_naming_the_keys(pipeline, key, words):
    with pytest.raises(ConfigError) as info:
        config_from_dict(config(**pipeline))
    assert str(info.value).startswith(key) and words in str(info.value), str(info.value)


def test_a_micro_batch_count_torch_refuses_is_refused_at_every_reachable_layout():
    # K = 4 -> 2 -> 1 with freezing: at K = 2 (R = 2, 20 a replica) M = 5 runs in two rounds
    # of 2.5: refused, although K = 4 (one round) runs it.
    base = {"trainer": {"nproc_per_node": 4, "global_batch_size": 40}}
    pipeline = {"initial_pipe_len": 4, "num_micro_batches": 5, "schedule": "interleaved_1f1b"}
    fixed = {**base, "pipeline": pipeline, "freeze": {"strategy": "none"}}
    config_from_dict(fixed)
    with pytest.raises(ConfigError, match=r"^pipeline.num_micro_batches: .*2 rounds"):
        config_from_dict({**base, "pipeline": pipeline, "freeze": {"strategy": "alpha_schedule"}})
    # 'auto' needs a divisor the schedule runs: a batch of 9 at K = 4 has none
    odd = {
        "trainer": {"nproc_per_node": 4, "global_batch_size": 9},
        "pipeline": {"initial_pipe_len": 4, "schedule": "zero_bubble"},
        "freeze": {"strategy": "none"},
    }
    with pytest.raises(ConfigError, match=r"^trainer.global_batch_size: no micro-batch count"):
        config_from_dict(odd)
    config_from_dict({**odd, "pipeline": {"initial_pipe_len": 4}})  # GPipe runs M = 9


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_train_refuses_chunks_the_model_cannot_hold_before_any_process(schedule):
    """The quickstart (8 layers: 18 units) at K = 2 holds at most 9 chunks a rank: 20 is one
    line naming pipeline.virtual_stages, before a worker starts."""
    result = run_cli(
        "train",
        QUICKSTART,
        f"pipeline.schedule={schedule}",
        "pipeline.initial_pipe_len=2",
        "pipeline.virtual_stages=20",
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "config error: pipeline.virtual_stages: 20 chunks" in lines[0]
    assert "use at most 9 or 'auto'" in lines[0], lines
    assert "training on" not in result.stderr and "process(es)" not in result.stderr


def torch_rank_order(schedule, pipe_len, virtual_stages, num_micro_batches):
    """Every rank's ops as torch orders them: (kind, the rank's local chunk, micro-batch)."""
    order = torch_schedule(schedule, pipe_len, virtual_stages, num_micro_batches).pipeline_order
    return {
        rank: [
            (a.computation_type.value, a.stage_index // pipe_len, a.microbatch_index)
            for a in actions
            if a is not None
        ]
        for rank, actions in order.items()
    }


LAYOUTS = [(2, 1, 2), (2, 2, 2), (2, 2, 4), (2, 3, 6), (2, 4, 3), (4, 2, 4), (4, 2, 6)]
LAYOUTS += [(4, 2, 10), (4, 3, 8), (4, 4, 4), (8, 2, 8), (8, 2, 12), (4, 1, 8), (2, 8, 4)]


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
@pytest.mark.parametrize("pipe_len, virtual_stages, num_micro_batches", LAYOUTS)
def test_the_rank_order_is_the_one_torch_builds(
    schedule, pipe_len, virtual_stages, num_micro_batches
):
    from pipetransformer.autopipe.schedule_order import rank_order

    theirs = torch_rank_order(schedule, pipe_len, virtual_stages, num_micro_batches)
    for rank in range(pipe_len):
        ours = rank_order(schedule, pipe_len, virtual_stages, num_micro_batches, rank)
        assert [tuple(op) for op in ours] == theirs[rank], rank


# ----------------------------------------------------------------------------- the step model


def simulated_compute_s(order, forward_s, backward_s, weight_share):
    """The step of a torch schedule's `order` (its `pipeline_order`: every rank running its
    ops in order as soon as what they need is done), from each chunk's forward and backward
    seconds: F after the previous chunk's F, a backward (B or I) after the next chunk's (the
    last chunk's after its own F), W after its I. No communication."""
    last = len(forward_s) - 1
    pending = {r: [a for a in actions if a is not None] for r, actions in order.items()}
    done, free = {}, dict.fromkeys(order, 0.0)
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in pending.items():
            while actions:
                chunk, mb = actions[0].stage_index, actions[0].microbatch_index
                kind = actions[0].computation_type.value
                if kind == "F":
                    needs, seconds = ("F", chunk - 1, mb) if chunk else None, forward_s[chunk]
                elif kind in ("B", "I"):
                    needs = ("F", chunk, mb) if chunk == last else ("B", chunk + 1, mb)
                    share = 1.0 if kind == "B" else 1.0 - weight_share
                    seconds = share * backward_s[chunk]
                else:
                    needs, seconds = ("I", chunk, mb), weight_share * backward_s[chunk]
                if needs is not None and needs not in done:
                    break
                free[rank] = max(free[rank], done.get(needs, 0.0)) + seconds
                done["B" if kind == "B" else kind, chunk, mb] = free[rank]
                if kind == "I":
                    done["B", chunk, mb] = free[rank]
                actions.pop(0)
                progressed = True
    assert not any(pending.values()), "torch's order deadlocked in the simulation"
    return max(free.values())


def predicted_and_simulated(schedule, trained_s, frozen_s, k, v, m):
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.planning.step_model import (
        WEIGHT_GRADIENT_SHARE,
        Links,
        UnitTimes,
        predict_step,
    )

    n = len(trained_s)
    times = UnitTimes(tuple(trained_s), tuple(frozen_s), (1,) * n, (1,) * n, 1)
    plan = balance(UnitCosts(tuple(trained_s), tuple(frozen_s)), 0, k, "optimal", virtual_stages=v)
    step = predict_step(
        times,
        plan,
        micro_batch_size=1,
        num_micro_batches=m,
        dp_degree=1,
        replicas_per_node=1,
        links=Links(1e12, 1e12, latency_s=0.0),
        schedule=schedule,
    )
    forward = [sum(frozen_s[a:b]) for a, b in plan.stage_ranges]
    backward = [sum(trained_s[a:b]) - f for (a, b), f in zip(plan.stage_ranges, forward)]
    order = torch_schedule(schedule, k, v, m).pipeline_order
    simulated = simulated_compute_s(order, forward, backward, WEIGHT_GRADIENT_SHARE)
    return step, simulated


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_the_bubble_is_what_torchs_order_gives_for_equal_chunks(schedule):
    for k, v, m in [(2, 1, 4), (2, 2, 2), (2, 2, 6), (2, 4, 4), (4, 2, 4), (4, 2, 6)]:
        if schedule == "interleaved_1f1b" and v == 1:
            continue  # runs 1F1B
        for forward_share in (1 / 3, 1 / 4):  # of a unit's forward + backward
            step, simulated = predicted_and_simulated(
                schedule, [1.0] * (k * v), [forward_share] * (k * v), k, v, m
            )
            assert step.compute_s == pytest.approx(simulated), (k, v, m, forward_share)
            work = m * v  # the busiest rank's forward + backward seconds
            assert step.bubble_factor == pytest.approx(step.compute_s / work)
            if schedule == "interleaved_1f1b":  # Narayanan et al.: (K - 1) / (v M + K - 1)
                assert 1 - 1 / step.bubble_factor == pytest.approx((k - 1) / (v * m + k - 1))


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_unequal_chunks_stay_near_torchs_order(schedule):
    """Units of random cost, chunks balanced by the optimal partition: the model's compute is
    an approximation, as (M + K - 1) x the slowest stage is GPipe's; within 30% here."""
    import random

    rng = random.Random(7)
    errors = []
    for _ in range(60):
        k = rng.choice([2, 4])
        v = rng.choice([2, 3]) if schedule == "interleaved_1f1b" else rng.choice([1, 2, 3])
        m = rng.choice([m for m in range(k, 4 * k + 1) if m % max(1, m // k) == 0])
        forward = [rng.uniform(0.5, 2.0) for _ in range(k * v + rng.randint(0, 8))]
        trained = [f * rng.uniform(2.5, 3.5) for f in forward]
        step, simulated = predicted_and_simulated(schedule, trained, forward, k, v, m)
        errors.append(step.compute_s / simulated - 1)
    assert max(abs(e) for e in errors) < 0.3, sorted(errors)
    assert abs(sorted(errors)[len(errors) // 2]) < 0.05


def test_more_chunks_shrink_the_bubble_and_multiply_the_sends():
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.planning.step_model import Links, UnitTimes, predict_step

    times = UnitTimes((3.0,) * 16, (1.0,) * 16, (1000,) * 16, (4,) * 16, 1)
    costs = UnitCosts((3.0,) * 16, (1.0,) * 16)
    links = Links(1e6, 1e6, latency_s=1e-3)

    def step(schedule, v):
        plan = balance(costs, 0, 4, virtual_stages=v)
        return predict_step(
            times,
            plan,
            micro_batch_size=1,
            num_micro_batches=4,
            dp_degree=1,
            replicas_per_node=1,
            links=links,
            schedule=schedule,
        )

    one_f_one_b, gpipe = step("1f1b", 1), step("gpipe", 1)
    assert one_f_one_b == gpipe and one_f_one_b.bubble_factor is None
    assert step("interleaved_1f1b", 1) == one_f_one_b  # runs 1F1B
    assert one_f_one_b.compute_s == 7 * 12.0  # (M + K - 1) x a stage
    two, four = step("interleaved_1f1b", 2), step("interleaved_1f1b", 4)
    assert two.compute_s == 4 * 12.0 + 3 * 6.0 and four.compute_s == 4 * 12.0 + 3 * 3.0
    zero = step("zero_bubble", 2)  # F = 2, I = W = 2 a chunk: a hop costs F
    assert zero.compute_s == 4 * 12.0 + 3 * 2.0
    per_send = 1e-3 + 1000 / 1e6
    assert one_f_one_b.p2p_s == pytest.approx(2 * (4 + 4 - 2) * per_send)
    assert two.p2p_s == pytest.approx(2 * (2 * 4 + 4 - 2) * per_send)
    assert four.p2p_s == pytest.approx(2 * (4 * 4 + 4 - 2) * per_send)


def most_held(order, num_chunks):
    """The most micro-batches of one chunk any rank of torch's `order` holds at once, each
    from its forward to its weight gradient."""
    from pipetransformer.autopipe.memory import held_activations
    from pipetransformer.autopipe.schedule_order import Op

    peaks = []
    for actions in order.values():
        ops = [
            Op(a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in actions
            if a is not None
        ]
        peaks.append(held_activations(ops, [1.0] * num_chunks, "W")[0])
    return max(peaks)


def test_zbv_would_not_fill_the_bubble_better_with_two_chunks_a_rank():
    """Why zero_bubble runs the looped ScheduleInterleavedZeroBubble and not the V-shaped
    ScheduleZBVZeroBubble (docs/architecture.md): with two chunks a rank and equal F, I and W
    the looped order's step is never longer (equal from M = 2K - 1, shorter below); ZBV
    holds no more activations, fewer where M is not a multiple of K."""
    for k in (2, 4, 8):
        for m in range(k, 3 * k + 1):
            if micro_batch_problem("zero_bubble", k, m):
                continue
            looped = torch_schedule("zero_bubble", k, 2, m)
            v_shaped = torch_schedules.ScheduleZBVZeroBubble(looped._stages, m).pipeline_order
            looped = looped.pipeline_order
            chunk_s = [1.0] * (2 * k)
            ours = simulated_compute_s(looped, chunk_s, [2.0] * (2 * k), 0.5)
            theirs = simulated_compute_s(v_shaped, chunk_s, [2.0] * (2 * k), 0.5)
            assert ours <= theirs + 1e-9 and (m < 2 * k - 1 or ours == pytest.approx(theirs))
            held, held_v = most_held(looped, 2 * k), most_held(v_shaped, 2 * k)
            assert held_v < held if m % k else held_v == held


def test_several_chunks_under_a_one_chunk_schedule_are_refused():
    with pytest.raises(ValueError, match="gpipe runs one chunk a stage"):
        layout_schedule("gpipe", 2, 2)


def test_autopipes_micro_batch_count_under_each_schedule():
    """'auto' keeps GPipe's and 1F1B's rule (the smallest divisor >= K); for the multi-chunk
    schedules it is the smallest divisor >= K torch runs, which is that same divisor wherever
    torch runs any (none for K = 4 and a batch of 99: 9 and 11 run in two rounds, 33 in eight,
    99 in 24: refused before any process starts); 'measured' times only what torch runs."""
    from pipetransformer.config import load_config
    from pipetransformer.planning.context import choose_num_micro_batches
    from pipetransformer.planning.profile_keys import micro_batch_candidates

    def old_rule(k, batch):
        return next((m for m in range(k, batch + 1) if batch % m == 0), batch)

    refused = 0
    for k in (1, 2, 4, 8):
        for batch in range(k, 160):
            for schedule in ("gpipe", "1f1b"):
                assert choose_num_micro_batches("auto", k, batch, schedule) == old_rule(k, batch)
            if smallest_micro_batches("interleaved_1f1b", k, batch) is None:
                refused += 1
                continue
            m = choose_num_micro_batches("auto", k, batch, "interleaved_1f1b")
            assert m == old_rule(k, batch) and micro_batch_problem("interleaved_1f1b", k, m) is None
            assert choose_num_micro_batches(6, k, batch, "zero_bubble") == 6  # as configured
    assert refused and smallest_micro_batches("zero_bubble", 4, 99) is None
    config = load_config(
        QUICKSTART, ["pipeline.schedule=zero_bubble", "pipeline.num_micro_batches=measured"]
    )
    assert micro_batch_candidates(config, 4, 72) == [4, 6, 8, 12, 24]  # 9, 18: not in rounds
    gpipe = load_config(QUICKSTART, ["pipeline.num_micro_batches=measured"])
    assert micro_batch_candidates(gpipe, 4, 72) == [4, 6, 8, 9, 12, 18, 24]


def test_zero_bubbles_all_reduce_is_not_hidden_behind_its_backward():
    """On GPUs DDP overlaps a stage's all-reduce with its last backward; zero bubble's rank
    averages its gradients after the step (pipe/gradient_sync.py), so nothing hides it."""
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.planning.step_model import Links, UnitTimes, predict_step

    times = UnitTimes((3.0,) * 16, (1.0,) * 16, (1000,) * 16, (10**7,) * 16, 1)  # 80 MB a stage
    plan = balance(UnitCosts((3.0,) * 16, (1.0,) * 16), 0, 4, virtual_stages=2)

    def step(schedule):
        return predict_step(
            times,
            plan,
            micro_batch_size=1,
            num_micro_batches=4,
            dp_degree=2,
            replicas_per_node=2,
            links=Links(1e7, 1e7),
            overlap=True,
            schedule=schedule,
        )

    interleaved, zero = step("interleaved_1f1b"), step("zero_bubble")
    assert interleaved.hidden_s > 0 and zero.hidden_s == 0
    assert zero.allreduce_s == pytest.approx(interleaved.allreduce_s + interleaved.hidden_s)
