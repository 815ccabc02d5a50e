"""trainer.batch_per_replica, the paper's batch semantics: every replica keeps its batch, so
the global batch grows as AutoDP adds replicas and an epoch has fewer steps.

Pure parts (sampler, clock, config) without processes; then 4 gloo ranks going 1 x 4 ->
2 x 2 -> 4 x 1 against a single-process loop whose batch grows the same way (global batch
16 -> 32 -> 64), and that run resumed in the middle of an epoch at another world size (4
ranks -> 2: the global batch halves mid-epoch). Tolerances are the elastic tests'
(float32 summation order only)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import run_workers
from reference import elastic_config, reference_run, step_losses
from workers import elastic_run

from pipetransformer.autodp.sampler import TrainSampler
from pipetransformer.config import ConfigError, config_from_dict, load_config
from pipetransformer.runs.rundir import RunOptions
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.clock import StepClock

# ---------------------------------------------------------------- sampler and clock


def every_id_once(sampler: TrainSampler, epoch: int, steps: int) -> list[int]:
    ids = []
    for step in range(steps):
        batch = sampler.node_batch(0, epoch, step)
        ids += [i for i, valid in zip(batch.ids, batch.valid) if valid]
    return sorted(ids)


def test_a_replica_keeps_its_batch_and_the_node_batch_grows_with_the_replicas():
    sampler = TrainSampler(100, 1, None, 0, batch_per_replica=8)
    assert [sampler.node_batch_size(r) for r in (1, 2, 4)] == [8, 16, 32]
    assert [sampler.steps_per_epoch_at(r) for r in (1, 2, 4)] == [13, 7, 4]
    sampler.continue_at(0, 0, 0, 2)
    # Each of the 2 replicas gets 8 samples of the node's 16.
    halves = [sampler.replica_batch(0, r, 2, 0, 1) for r in (0, 1)]
    assert [len(h.ids) for h in halves] == [8, 8]
    assert halves[0].ids + halves[1].ids == sampler.node_batch(0, 0, 1).ids
    with pytest.raises(ValueError, match="continue_at"):
        sampler.replica_batch(0, 0, 4, 0, 1)  # a layout the sampler was not told of
    assert every_id_once(sampler, 0, 7) == list(range(100))


def test_a_fixed_global_batch_does_not_depend_on_the_layout():
    sampler = TrainSampler(100, 2, 16, 0)
    assert sampler.node_batch_size(1) == sampler.node_batch_size(4) == 8
    before = [sampler.node_batch(1, 0, s) for s in range(7)]
    sampler.continue_at(0, 3, 24, 4)
    assert [sampler.node_batch(1, 0, s) for s in range(3, 7)] == before[3:]
    assert sampler.steps_in_epoch(0) == sampler.steps_per_epoch_at(1) == 7


def test_a_change_in_the_middle_of_an_epoch_resplits_what_remains():
    sampler = TrainSampler(100, 1, None, 3, batch_per_replica=8)
    sampler.continue_at(0, 0, 0, 1)
    first = [sampler.node_batch(0, 0, s) for s in range(5)]  # 40 samples at 8 a step
    sampler.continue_at(0, 5, 40, 4)  # 4 replicas from step 5 on: 32 a step
    assert sampler.steps_in_epoch(0) == 5 + math.ceil(60 / 32) == 7
    rest = [sampler.node_batch(0, 0, s) for s in range(5, 7)]
    order = sampler.epoch_order(0, 0)
    assert rest[0].ids == tuple(order[40:72])
    assert rest[1].num_valid == 28 and len(rest[1].ids) == 32  # padded to its shape
    seen = [i for b in first + rest for i, v in zip(b.ids, b.valid) if v]
    assert sorted(seen) == list(range(100))
    with pytest.raises(ValueError, match="precedes"):
        sampler.node_batch(0, 0, 4)
    # The next epoch starts at 0 with the newest layout's batch.
    assert sampler.steps_in_epoch(1) == 4 and sampler.offset(1, 2) == 64
    sampler.enter_epoch(1)
    assert sampler.steps_per_epoch == 4 and every_id_once(sampler, 1, 4) == list(range(100))
    with pytest.raises(ValueError, match="outside"):
        sampler.continue_at(1, 0, 101, 1)


def test_the_sampler_takes_one_batch_semantics():
    with pytest.raises(ValueError, match="not both"):
        TrainSampler(100, 1, 16, 0, batch_per_replica=8)
    with pytest.raises(ValueError, match="not both"):
        TrainSampler(100, 1, None, 0)


def test_the_clock_counts_a_fixed_batch_in_steps_as_before():
    sampler = TrainSampler(50, 1, 8, 0)
    state = RunState()
    clock = StepClock(state, sampler, 2, replicas_per_node=2)
    ticks = list(clock.ticks())
    assert len(ticks) == 14 and [t.steps_per_epoch for t in ticks] == [7] * 14
    assert [t.schedule_step for t in ticks] == [float(t.global_step - 1) for t in ticks]
    assert {t.schedule_steps for t in ticks} == {14}
    assert ticks[6].epoch_end and ticks[-1].last and state.epoch == 2


def test_the_clock_shortens_the_epoch_and_keeps_the_schedule_on_samples():
    sampler = TrainSampler(100, 1, None, 0, batch_per_replica=10)
    state = RunState()
    clock = StepClock(state, sampler, 2, replicas_per_node=1)
    assert state.lr_reference_node_batch == 10
    ticks, layout_at = [], {(0, 4): 2, (1, 0): 5}  # (epoch, step) -> replicas a node from then
    for tick in clock.ticks():
        ticks.append(tick)
        following = (state.epoch, state.step_in_epoch)
        if following in layout_at:
            clock.use_layout(layout_at[following])
    # Epoch 0: 4 steps of 10, then 60 samples in steps of 20; epoch 1: 2 steps of 50.
    assert [t.step_in_epoch for t in ticks] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    # A tick knows its epoch's length as the layout it runs in would make it.
    assert [t.steps_per_epoch for t in ticks] == [10, 10, 10, 10, 7, 7, 7, 2, 2]
    # The schedule advances by samples over the first layout's batch: 10 steps an epoch.
    assert [t.schedule_step for t in ticks] == [0, 1, 2, 3, 4, 6, 8, 10, 15]
    assert {t.schedule_steps for t in ticks} == {20}
    assert ticks[6].epoch_end and ticks[-1].last


def test_a_resumed_clock_keeps_its_position_and_schedule():
    sampler = TrainSampler(100, 1, None, 0, batch_per_replica=10)
    state = RunState(epoch=0, step_in_epoch=5, samples_in_epoch=60, lr_reference_node_batch=10)
    clock = StepClock(state, sampler, 1, replicas_per_node=4)  # another world: 40 a step
    assert state.lr_reference_node_batch == 10  # kept from the checkpoint
    ticks = list(clock.ticks())
    # One step left (40 samples at 40 a step), at sample 60 of the schedule's 10 a step.
    assert [t.schedule_step for t in ticks] == [6.0] and ticks[0].schedule_steps == 10
    assert ticks[0].steps_per_epoch == 6 and ticks[0].last  # 5 + ceil(40 / 40)
    # A checkpoint older than samples_in_epoch: its steps all had one batch.
    legacy = RunState(epoch=0, step_in_epoch=3)
    StepClock(legacy, TrainSampler(100, 1, 8, 0), 1, replicas_per_node=1)
    assert legacy.samples_in_epoch == 24


# ---------------------------------------------------------------- config


def per_replica_config(**changes) -> dict:
    data = elastic_config(**{"trainer__batch_per_replica": 16, **changes})
    del data["trainer"]["global_batch_size"]
    return data


def test_config_takes_one_batch_key_and_checks_every_layout():
    config = config_from_dict(per_replica_config())
    trainer = config.trainer
    assert [trainer.replica_batch_size(r) for r in (1, 2, 4)] == [16, 16, 16]
    assert [trainer.global_batch_size_at(r) for r in (1, 2, 4)] == [16, 32, 64]
    assert config_from_dict(config.to_dict()) == config  # round trip: the unused key is left out
    both = per_replica_config()
    both["trainer"]["global_batch_size"] = 64
    with pytest.raises(ConfigError, match="trainer.global_batch_size: not used"):
        config_from_dict(both)
    with pytest.raises(ConfigError, match="trainer.batch_per_replica"):
        config_from_dict(per_replica_config(trainer__batch_per_replica=0))
    # Micro-batches must divide the replica batch in every layout.
    with pytest.raises(ConfigError, match="pipeline.num_micro_batches"):
        config_from_dict(per_replica_config(pipeline__num_micro_batches=3))
    fixed = config_from_dict(elastic_config())
    assert [fixed.trainer.replica_batch_size(r) for r in (1, 2, 4)] == [32, 16, 8]


def test_the_paper_configs_keep_the_replica_batch():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    batches = {
        name: load_config(root / name).trainer.batch_per_replica
        for name in ("vit_imagenet.yaml", "vit_cifar100.yaml", "bert_squad.yaml", "bert_sst2.yaml")
    }
    assert batches == {
        "vit_imagenet.yaml": 400,
        "vit_cifar100.yaml": 320,
        "bert_squad.yaml": 64,
        "bert_sst2.yaml": 64,
    }
    assert load_config(root / "quickstart.yaml").trainer.batch_per_replica is None


# ---------------------------------------------------------------- runs


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_matches(run_dir, results, reference) -> None:
    ref_losses, ref_state, _ = reference
    got = step_losses(run_dir)
    assert len(got) == len(ref_losses)
    for step, (a, b) in enumerate(zip(got, ref_losses)):
        assert a == pytest.approx(b, abs=1e-5), f"step {step}"
    state = results[0]["state"][0]
    assert set(state) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(
            state[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.fixture(scope="module")
def growing_run(tmp_path_factory):
    """4 ranks, 1 x 4 -> 2 x 2 -> 4 x 1 at 16 images a replica, a checkpoint every 2 steps
    (all kept), the sample ids each rank read: the run checked against single-process
    training, and the one the resume test continues at another world size."""
    config_dict = per_replica_config(
        trainer__record_sample_ids=True, checkpoint__interval_steps=2, checkpoint__keep_last=30
    )
    run_dir = tmp_path_factory.mktemp("growing")
    return config_dict, run_dir, run_workers(elastic_run, 4, config_dict, str(run_dir))


def every_sample_once_an_epoch(run_dir) -> None:
    seen = [r for p in sorted((run_dir / "samples").glob("rank*.jsonl")) for r in records(p)]
    for epoch in (1, 2, 3):
        ids = sorted(i for r in seen if r["epoch"] == epoch for i in r["ids"])
        assert ids == list(range(200)), f"epoch {epoch}"


@pytest.mark.distributed
def test_elastic_run_with_a_growing_global_batch_matches_single_process(growing_run):
    config_dict, run_dir, results = growing_run
    metrics = records(run_dir / "metrics.jsonl")
    assert [(m["pipe_len"], m["dp_degree"]) for m in metrics] == [(4, 1), (2, 2), (1, 4)]
    # 200 samples at 16, 32 and 64 a step: 13, 7 and 4 steps.
    assert [m["global_step"] for m in metrics] == [13, 20, 24]
    replicas = [1, 2, 4]
    reference = reference_run(
        config_from_dict(config_dict), replicas_per_node=lambda epoch, step: replicas[epoch]
    )
    assert_matches(run_dir, results, reference)
    # The learning rate is not scaled with the batch: it follows the schedule on samples.
    lrs = [r["lr"] for r in records(run_dir / "steps.jsonl")]
    assert lrs[0] == pytest.approx(0.05 / 2) and lrs[1] == pytest.approx(0.05)  # warm-up
    every_sample_once_an_epoch(run_dir)


@pytest.mark.distributed
def test_resume_mid_epoch_at_another_world_size_keeps_every_sample_once(tmp_path, growing_run):
    """The 4-rank run, interrupted after 2 of its 4 steps of epoch 3 (64 images a step), is
    resumed by 2 ranks, whose layout at 5 frozen layers is 1 x 2: 32 a step for the 72
    images left. The 2-rank run starts as DDP (2 replicas), so a schedule recomputed from its
    own start would count 32 images a step, not the first run's 16."""
    from test_checkpoint import continue_from, events

    config_dict, first_dir, _ = growing_run
    resumed_config = per_replica_config(
        trainer__nproc_per_node=2,
        pipeline__initial_pipe_len=1,
        trainer__record_sample_ids=True,
    )
    resumed_dir = tmp_path / "resumed"
    continue_from(first_dir, resumed_dir, 22)  # 13 + 7 + 2 steps
    results = run_workers(
        elastic_run, 2, resumed_config, str(resumed_dir), False, RunOptions(resume="required")
    )
    (event,) = events(resumed_dir, "resume")
    assert (event["world_size"], event["pipe_len"], event["dp_degree"]) == (2, 1, 2)
    # 128 samples of epoch 3 done; 72 left at 32 a step: 3 more steps.
    assert [m["global_step"] for m in records(resumed_dir / "metrics.jsonl")] == [13, 20, 25]

    def replicas(epoch: int, step: int) -> int:
        return [1, 2][epoch] if epoch < 2 else 4 if step < 2 else 2

    reference = reference_run(config_from_dict(config_dict), replicas_per_node=replicas)
    assert_matches(resumed_dir, results, reference)
    every_sample_once_an_epoch(resumed_dir)


def test_compare_leaves_out_the_ideal_speedup_under_a_growing_batch():
    from pipetransformer.compare.outputs import measured_unit_costs

    # The ideal model counts a fixed number of steps an epoch: nothing is measured for it.
    assert measured_unit_costs(config_from_dict(per_replica_config())) is None


def test_compare_peers_train_the_baselines_global_batch():
    from pipetransformer.compare.variants import variant_overrides
    from pipetransformer.config import apply_overrides

    config = config_from_dict(per_replica_config())  # 4 processes, a 4-stage baseline: R = 1
    variants = variant_overrides(config, ablations=False, peers=True)
    for name in ("ddp", "freeze_ddp"):
        data = apply_overrides(json.loads(json.dumps(config.to_dict())), variants[name])
        peer = config_from_dict(data)
        assert peer.trainer.batch_per_replica is None and peer.trainer.global_batch_size == 16
    assert not any("batch" in o for o in variants["baseline"] + variants["elastic"])
