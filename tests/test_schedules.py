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
    # auto: the largest v whose K v chunks the active units fill
    assert virtual_stages_for("interleaved_1f1b", "auto", 2, 17) == 8
    assert virtual_stages_for("zero_bubble", "auto", 4, 9) == 2
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
def test_train_refuses_a_planned_schedule_in_one_line(schedule):
    result = run_cli("train", QUICKSTART, f"pipeline.schedule={schedule}")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pipeline.schedule" in lines[0], result.stderr
    assert "not yet executable by train" in lines[0]
    assert "training on" not in result.stderr


def test_a_worker_started_without_the_cli_refuses_it_too(tmp_path):
    from pipetransformer.config import load_config
    from pipetransformer.trainer import run_worker

    config = load_config(QUICKSTART, ["pipeline.schedule=zero_bubble"])
    with pytest.raises(ConfigError, match=r"^pipeline.schedule: 'zero_bubble' is planned"):
        run_worker(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


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
