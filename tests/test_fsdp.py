"""Sharded layouts (FSDP2, `pipeline.sharding: always`): what DDP and single-process training
compute, across freeze transitions, and through checkpoints at other layouts.

- FSDP2 against DDP: 2 gloo ranks, the same seed, config and batches, AdamW, nothing
  frozen: the same loss at every step (1e-5) and the same final parameters (rtol 1e-4 /
  atol 1e-5: the reduce-scatter sums in another order than the all-reduce; Adam amplifies
  that, docs/pytorch.md).
- With freezing (the elastic tests' config on 2 ranks: SGD with momentum, F 0 -> 3 -> 5 at
  epoch ends, AutoCache serving the frozen prefix): the losses and final parameters of
  single-process training with the same freeze points (the elastic tests' tolerances). Each
  transition gathers the units in full and shards the trained ones again.
- A transition keeps every weight and optimizer entry bit for bit (two forced transitions
  after the FSDP2 run above, the state gathered in full before and after).
- Checkpoints: the sharded run resumed after its first transition at the same world
  continues exactly; resumed as a 2-stage pipeline on 2 ranks, and a pipeline checkpoint
  resumed sharded, both match single-process training (DCP reshards DTensor shards into
  whole tensors and back).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import assert_unit_state_carried, run_workers
from reference import elastic_config, reference_run, step_losses
from workers import elastic_run, sharded_handoff_snapshots

from pipetransformer.config import config_from_dict
from pipetransformer.runs.checkpoint import complete_checkpoints
from pipetransformer.runs.rundir import RunOptions

pytestmark = pytest.mark.distributed

RESUME = RunOptions(resume="required")


def sharded_config(**changes) -> dict:
    settings = dict(
        pipeline__initial_pipe_len=1,
        pipeline__sharding="always",
        pipeline__num_micro_batches=1,
        cache__enabled=True,
        cache__profile=False,  # always served, so the cached prefix path runs
        checkpoint__interval_steps=5,
        checkpoint__keep_last=20,
    )
    return elastic_config(**{**settings, **changes})


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def continue_from(run_dir, into, step: int) -> None:
    """A copy of `run_dir` as a run interrupted after its checkpoint at `step` leaves it."""
    shutil.copytree(run_dir, into)
    for path in complete_checkpoints(into):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    (into / "checkpoints" / "latest").write_text(f"step-{step:08d}\n")


def assert_state_close(state: dict, reference: dict, rtol: float, atol: float) -> None:
    assert set(state) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(
            state[name], value, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """2 ranks sharded from the start, F 0 -> 3 -> 5, checkpoints every 5 steps."""
    config_dict = sharded_config(trainer__nproc_per_node=2)
    run_dir = tmp_path_factory.mktemp("sharded")
    return config_dict, run_dir, run_workers(elastic_run, 2, config_dict, str(run_dir))


def test_fsdp_computes_what_ddp_computes_and_its_transitions_keep_every_bit(tmp_path):
    """2 ranks, one epoch of each, two micro-batches a step, AdamW, clipped; then the FSDP2
    run is taken through two forced transitions (F 0 -> 3 -> 5) with its whole state
    gathered before and after."""
    common = dict(
        trainer__nproc_per_node=2,
        trainer__epochs=1,
        optimizer__name="adamw",
        optimizer__lr=0.003,
        optimizer__weight_decay=0.01,
        optimizer__max_grad_norm=0.5,  # clipped by the norm over the shards
        freeze__strategy="none",
        freeze__manual_schedule=[],
        pipeline__initial_pipe_len=1,
        pipeline__num_micro_batches=2,  # gradient accumulation, reduce-scattered each time
    )
    ddp_dict = elastic_config(**common)
    fsdp_dict = elastic_config(**common, pipeline__sharding="always")
    ddp = run_workers(elastic_run, 2, ddp_dict, str(tmp_path / "ddp"))
    fsdp = run_workers(sharded_handoff_snapshots, 2, fsdp_dict, str(tmp_path / "fsdp"), [3, 5])
    assert [m["sharded"] for m in metrics(tmp_path / "fsdp")] == [True]
    assert not any(m["sharded"] for m in metrics(tmp_path / "ddp"))
    want, got = step_losses(tmp_path / "ddp"), step_losses(tmp_path / "fsdp")
    assert len(got) == len(want) == 7
    assert got == pytest.approx(want, abs=1e-5)
    snapshots = fsdp[0]  # rank 0 gathered every unit in full
    trained = {name: value for name, (value, _) in snapshots[0]["state"].items()}
    ddp_state = ddp[0]["state"][0]
    assert_state_close(trained, {k: v for k, v in ddp_state.items() if k in trained}, 1e-4, 1e-5)

    assert [s["layout"] for s in snapshots] == [(1, 2, True)] * 3
    assert_handoffs_bit_exact(snapshots)


def test_shard_grad_op_and_checkpointed_ddp_compute_what_ddp_computes(tmp_path):
    """The peers a user tries where a replica does not fit: FSDP2 keeping each layer's
    gathered parameters until its backward (pipeline.fsdp_reshard_after_forward=false, with
    activation checkpointing), and DDP with activation checkpointing: the same losses and
    weights as plain DDP over one epoch (2 ranks, 2 micro-batches a step, AdamW, clipped)."""
    common = dict(
        trainer__nproc_per_node=2,
        trainer__epochs=1,
        optimizer__name="adamw",
        optimizer__lr=0.003,
        optimizer__max_grad_norm=0.5,
        freeze__strategy="none",
        freeze__manual_schedule=[],
        pipeline__initial_pipe_len=1,
        pipeline__num_micro_batches=2,
    )
    runs = {
        "ddp": elastic_config(**common),
        "zero2": elastic_config(
            **common,
            pipeline__sharding="always",
            pipeline__fsdp_reshard_after_forward=False,
            trainer__activation_checkpointing=True,
        ),
        "checkpointed": elastic_config(**common, trainer__activation_checkpointing=True),
    }
    states = {
        name: run_workers(elastic_run, 2, config, str(tmp_path / name))[0]["state"][0]
        for name, config in runs.items()
    }
    assert [m["sharded"] for m in metrics(tmp_path / "zero2")] == [True]
    want = step_losses(tmp_path / "ddp")
    for name in ("zero2", "checkpointed"):
        assert step_losses(tmp_path / name) == pytest.approx(want, abs=1e-5), name
        assert_state_close(states[name], states["ddp"], 1e-4, 1e-5)


def assert_handoffs_bit_exact(snapshots: list[dict]) -> None:
    """Every parameter equal before and after each transition, and the optimizer state of
    those still trained; none for those frozen by it."""
    for before, after in zip(snapshots, snapshots[1:]):
        frozen_units = after["frozen_end"]
        assert set(after["state"]) == set(before["state"])
        assert frozen_units > before["frozen_end"]
        for name, (param, opt_state) in after["state"].items():
            old_param, old_state = before["state"][name]
            assert_unit_state_carried(name, param, opt_state, old_param, old_state, frozen_units)


def auto_config(**changes) -> dict:
    """pipeline.sharding 'auto' on 2 ranks from a 2-stage pipeline, with a device budget
    (layouts are priced only then); a replica never fits and the pricer is the test's
    (tests/workers.py `prefer_sharded_at`)."""
    settings = dict(
        trainer__nproc_per_node=2,
        pipeline__initial_pipe_len=2,
        pipeline__sharding="auto",
        pipeline__device_memory_bytes=2**34,
        cache__enabled=True,
        cache__profile=False,
    )
    return elastic_config(**{**settings, **changes})


def test_auto_shards_where_faster_and_trains_what_single_process_training_does(tmp_path):
    """F 0 -> 3 -> 5 at epoch ends; a sharded layout priced faster at F = 3 only: pipeline,
    then sharded, then a pipeline again (AutoPipe's, packed from the initial K)."""
    results = run_workers(sharded_handoff_snapshots, 2, auto_config(), str(tmp_path), [], [3])
    got = metrics(tmp_path)
    assert [(m["pipe_len"], m["dp_degree"], m["sharded"]) for m in got] == [
        (2, 1, False),
        (1, 2, True),
        (1, 2, False),
    ]
    assert [m["num_frozen_layers"] for m in got] == [0, 3, 5]
    ref_losses, ref_state, _ = reference_run(config_from_dict(auto_config()))
    assert step_losses(tmp_path) == pytest.approx(ref_losses, abs=1e-5)
    final = {name: value for name, (value, _) in results[0][0]["state"].items()}
    assert_state_close(final, {k: v for k, v in ref_state.items() if k in final}, 1e-4, 1e-5)


def test_auto_moves_into_and_out_of_a_sharded_layout_bit_for_bit(tmp_path):
    """One epoch as a 2-stage pipeline, then forced transitions: F = 3 sharded (every unit
    sent to every rank, the trained ones sharded), F = 5 a pipeline again (gathered)."""
    config = auto_config(
        trainer__epochs=1,
        optimizer__name="adamw",
        optimizer__weight_decay=0.01,
        freeze__strategy="none",
        freeze__manual_schedule=[],
        cache__enabled=False,
    )
    snapshots = run_workers(sharded_handoff_snapshots, 2, config, str(tmp_path), [3, 5], [3])[0]
    assert [s["layout"][2] for s in snapshots] == [False, True, False]
    assert snapshots[0]["layout"] == (2, 1, False)
    assert_handoffs_bit_exact(snapshots)


def test_fsdp_with_freezing_matches_single_process(sharded_run):
    config_dict, run_dir, results = sharded_run
    got = metrics(run_dir)
    assert [(m["pipe_len"], m["dp_degree"], m["sharded"]) for m in got] == [(1, 2, True)] * 3
    assert [m["num_frozen_layers"] for m in got] == [0, 3, 5]
    assert got[2]["cache_hits"] > 0  # the frozen prefix was read from AutoCache
    ref_losses, ref_state, _ = reference_run(config_from_dict(config_dict))
    assert step_losses(run_dir) == pytest.approx(ref_losses, abs=1e-5)
    assert_state_close(results[0]["state"][0], ref_state, rtol=1e-4, atol=1e-5)
    assert results[0]["summary"]["final_num_frozen_layers"] == 5


def test_a_sharded_run_resumed_after_a_transition_continues_exactly(tmp_path, sharded_run):
    config_dict, run_dir, results = sharded_run
    resumed_dir = tmp_path / "resumed"
    continue_from(run_dir, resumed_dir, 15)  # epoch 3 (F = 5), 1 of 7 steps taken
    resumed = run_workers(elastic_run, 2, config_dict, str(resumed_dir), False, RESUME)
    assert step_losses(resumed_dir) == pytest.approx(step_losses(run_dir), abs=1e-6)
    assert_state_close(resumed[0]["state"][0], results[0]["state"][0], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "direction",
    # One direction in the default suite; the other slow (about 6 s on 2 shared cores).
    [pytest.param("sharded_to_pipeline", marks=pytest.mark.slow), "pipeline_to_sharded"],
)
def test_a_checkpoint_resumes_across_sharded_and_pipeline_layouts(
    tmp_path, sharded_run, elastic_full_run, direction
):
    """After the first transition (step 7, F = 3): the sharded checkpoint (2 ranks) resumed
    by a 2-stage pipeline on 2 ranks, or the 4-rank pipeline checkpoint (the full system's
    run, tests/conftest.py) resumed sharded on 2 ranks."""
    if direction == "sharded_to_pipeline":
        first_dict, first_dir = sharded_run[0], sharded_run[1]
        second_dict = elastic_config(
            trainer__nproc_per_node=2,
            pipeline__initial_pipe_len=2,
            cache__enabled=True,
            cache__profile=False,
            checkpoint__interval_steps=5,
            checkpoint__keep_last=20,
        )
        sharded = False
    else:
        first_dict, first_dir = elastic_full_run.config_dict, elastic_full_run.run_dir
        # It anneals layer-wise: the plan and the per-layer groups carried into shards.
        second_dict = sharded_config(trainer__nproc_per_node=2, optimizer__layerwise_anneal=True)
        sharded = True
    resumed_dir = tmp_path / "resumed"
    continue_from(first_dir, resumed_dir, 7)
    results = run_workers(elastic_run, 2, second_dict, str(resumed_dir), False, RESUME)
    got = metrics(resumed_dir)
    assert [m["sharded"] for m in got[1:]] == [sharded] * 2
    assert [m["num_frozen_layers"] for m in got] == [0, 3, 5]
    ref_losses, ref_state, _ = reference_run(config_from_dict(first_dict))
    assert step_losses(resumed_dir) == pytest.approx(ref_losses, abs=1e-5)
    assert_state_close(results[0]["state"][0], ref_state, rtol=1e-4, atol=1e-5)
