"""The training clock (trainer/clock.py, TrainingClock): evaluation and checkpoint writes are
off `training_time_s`, recorded beside it, across a resume too; and evaluations at the same
shares of every epoch (trainer.evals_per_epoch) through a transition, each a line of
evaluations.jsonl. One launch of 2 gloo workers: a run whose every evaluation and
checkpoint write is made slow, then the same run resumed from a mid-run checkpoint."""

import json

import pytest
from helpers import run_workers
from reference import elastic_config
from workers import slow_evaluation_runs

from pipetransformer.utils.files import read_jsonl

pytestmark = pytest.mark.distributed

SLOW_S = 0.25  # added to every evaluation and every checkpoint write


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    """2 ranks, 64 digits in batches of 16 (4 steps an epoch), 2 epochs, 4 evaluations an
    epoch; a 2-stage pipeline until 5 of 6 layers freeze at the first epoch's end, then 2
    replicas; checkpoints every 3 steps and at each epoch's end (steps 3, 4, 6, 8). About 10 s
    on 2 busy cores (17 s with the workers' first start), most of it the two set-ups."""
    config = elastic_config(
        trainer__nproc_per_node=2,
        trainer__epochs=2,
        trainer__global_batch_size=16,
        trainer__evals_per_epoch=4,
        pipeline__initial_pipe_len=2,
        freeze__manual_schedule=[5],
        data__train_subset=64,
        data__eval_subset=32,
        checkpoint__interval_steps=3,
        checkpoint__keep_last=10,
    )
    root = tmp_path_factory.mktemp("clock")
    results = run_workers(slow_evaluation_runs, 2, config, str(root), SLOW_S, 6)
    return root, results[0]


def test_evaluation_and_checkpoints_are_off_the_training_clock(slow_runs):
    root, results = slow_runs
    train_s, summary = results["run"]
    # 8 evaluations and 4 checkpoint writes, each made SLOW_S slower, beside the clock ...
    assert summary["eval_time_s"] >= 8 * SLOW_S and summary["checkpoint_time_s"] >= 4 * SLOW_S
    # ... and off it: the three add up to the loop's seconds.
    total = summary["training_time_s"] + summary["eval_time_s"] + summary["checkpoint_time_s"]
    assert total == pytest.approx(train_s, abs=0.5)
    assert summary["training_time_s"] < train_s - 12 * SLOW_S + 0.5
    metrics = read_jsonl(root / "run" / "metrics.jsonl")
    assert all(m["eval_time_s"] >= 4 * SLOW_S for m in metrics)  # every evaluation of it
    assert sum(m["epoch_time_s"] for m in metrics) <= summary["training_time_s"]


def test_evaluations_fall_at_the_same_shares_through_a_transition(slow_runs):
    root, results = slow_runs
    evaluations = read_jsonl(root / "run" / "evaluations.jsonl")
    assert [e["epochs_done"] for e in evaluations] == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    assert [e["global_step"] for e in evaluations] == list(range(1, 9))
    assert [e["samples"] for e in evaluations] == [16 * step for step in range(1, 9)]
    layouts = [(e["pipe_len"], e["dp_degree"], e["num_frozen_layers"]) for e in evaluations]
    assert layouts == [(2, 1, 0)] * 4 + [(1, 2, 5)] * 4
    times = [e["training_time_s"] for e in evaluations]
    assert times == sorted(times) and times[-1] <= results["run"][1]["training_time_s"]
    # Each record counts the checkpoint writes before it: steps 3 | 4, 6 | 8.
    written = [e["checkpoint_time_s"] for e in evaluations]
    assert written[2] == 0.0 and written[3] >= SLOW_S and written[6] >= 3 * SLOW_S
    # The epoch's line carries its end's evaluation.
    metrics = read_jsonl(root / "run" / "metrics.jsonl")
    ends = [evaluations[3]["eval_metric"], evaluations[7]["eval_metric"]]
    assert [m["eval_metric"] for m in metrics] == ends
    assert (
        json.loads((root / "run" / "summary.json").read_text())["final_eval_metric"]
        == (evaluations[-1]["eval_metric"])
    )


def test_a_resumed_run_keeps_both_clocks(slow_runs):
    root, results = slow_runs
    first = results["run"][1]
    resumed_s, resumed = results["resumed"]
    assert resumed["attempts"] == 2
    # The first attempt's 8 evaluations and 4 writes (those after the checkpoint it resumes
    # from took its time too), then 2 evaluations and 1 write of its own.
    assert resumed["eval_time_s"] >= 10 * SLOW_S
    assert resumed["checkpoint_time_s"] >= 5 * SLOW_S
    # Training: the first attempt's, then only the training of the second.
    added = resumed["training_time_s"] - first["training_time_s"]
    assert -0.5 < added < resumed_s - 3 * SLOW_S + 0.5
    evaluations = read_jsonl(root / "resumed" / "evaluations.jsonl")
    assert [e["global_step"] for e in evaluations] == list(range(1, 9))  # 7, 8 written again
