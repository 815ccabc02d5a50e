"""`plan --predict` replays the run as the trainer takes it (planning/prediction_run.py over
run_model.py): the freeze rule's own decisions at its cadence (`auto`) or Eq. 1's bound at
epoch ends (`paper`), epochs that shorten as the paper's per-replica batch grows with the
replicas, what AutoCache holds each epoch, and peers at the baseline's global batch. The
paper's cluster, no profile: roofline times from the analytical profile. Unit tier."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipetransformer.config import load_config
from pipetransformer.freeze import bound_trajectory
from pipetransformer.planning.predict import predict
from pipetransformer.planning.prediction_inputs import cluster_from_flags, prediction_unit_times

ROOT = Path(__file__).resolve().parent.parent
CIFAR_SAMPLES = 50_000


def _predict(config_path: str, tmp_path: Path, *overrides: str, trajectory="auto", samples=None):
    config = load_config(
        ROOT / "configs" / config_path,
        [f"pipeline.profile_path={tmp_path / 'no.json'}", *overrides],
    )
    cluster = cluster_from_flags(
        2, 8, device_name="quadro-rtx-5000", intra_node="pcie3-x16", inter_node="infiniband-cx353a"
    )
    chosen = prediction_unit_times(config, cluster)
    return predict(
        config, chosen.profile, cluster, samples or CIFAR_SAMPLES, trajectory, chosen.times
    )


def test_the_paper_trajectory_is_eq1s_bound_at_epoch_ends_with_a_growing_batch(tmp_path):
    result = _predict("vit_cifar100.yaml", tmp_path, trajectory="paper")
    assert result.trajectory == [0, *bound_trajectory(12, 1 / 3, 9)]
    assert result.trajectory == [0, 4, 7, 9, 10, 11, 11, 11, 11, 11]
    # 320 images a replica: a node trains 320 x its replicas a step.
    node_samples = math.ceil(CIFAR_SAMPLES / 2)
    for epoch in result.epochs:
        replicas_per_node = epoch.dp_degree // 2
        assert epoch.steps == math.ceil(node_samples / (320 * replicas_per_node)), epoch
    assert result.epochs[0].dp_degree == 2 and result.epochs[-1].dp_degree > 2
    assert result.batch_per_replica == 320 and result.global_batch_size == 640
    # The config decides at epoch ends with Eq. 1 itself: `auto` is the same run.
    auto = _predict("vit_cifar100.yaml", tmp_path)
    assert auto.trajectory == result.trajectory and auto.elastic_s == result.elastic_s


def test_the_cache_is_filled_upgraded_then_read(tmp_path):
    result = _predict("vit_cifar100.yaml", tmp_path, trajectory="paper")
    kinds = [e.prefix for e in result.epochs]
    assert kinds[:2] == ["none", "filled"]  # F = 4: nothing was cached before
    assert set(kinds[2:6]) == {"upgraded"}  # 7, 9, 10, 11: from the previous boundary's entries
    assert set(kinds[6:]) == {"read"}  # F stays at 11
    # Without the cache every frozen epoch computes its prefix.
    plain = _predict("vit_cifar100.yaml", tmp_path, "cache.enabled=false", trajectory="paper")
    assert {e.prefix for e in plain.epochs[1:]} == {"computed"}
    assert plain.elastic_s > result.elastic_s


def test_peers_train_the_baselines_global_batch(tmp_path):
    result = _predict("vit_cifar100.yaml", tmp_path)
    ddp = next(p for p in result.peers if p.name == "ddp")
    assert (ddp.pipe_len, ddp.dp_degree, ddp.num_micro_batches) == (1, 16, 1)
    # 640 images a step over 16 devices: 79 steps an epoch, every epoch.
    steps = math.ceil(math.ceil(CIFAR_SAMPLES / 2) / 320)
    assert ddp.run_s == pytest.approx(10 * steps * ddp.step_s)
    baseline = result.baseline
    assert (baseline.pipe_len, baseline.dp_degree) == (8, 2)
    assert baseline.run_s == pytest.approx(10 * steps * baseline.step_s)


def test_a_list_trajectory_is_taken_as_given(tmp_path):
    result = _predict("vit_cifar100.yaml", tmp_path, trajectory="0,6,6,9")
    assert result.trajectory == [0, 6, 6, 9, 9, 9, 9, 9, 9, 9]


def test_the_full_system_is_not_predicted_slower_than_pipe_ddp_on_squad(tmp_path):
    """BERT-large on SQuAD at 512 tokens, the paper's cluster: 0.68x before the fixes of the
    compression test, of stage 0's balance for filling the cache and of the model's
    fill epochs (docs/profiling.md)."""
    result = _predict("bert_squad.yaml", tmp_path, samples=87_599)
    assert result.trajectory == [0, 8, 14]
    assert result.speedup > 1.0
    assert [e.prefix for e in result.epochs] == ["none", "filled", "upgraded"]


def test_the_command_prints_the_run_epoch_by_epoch(tmp_path):
    from helpers import run_cli

    result = run_cli(
        "plan",
        str(ROOT / "configs" / "quickstart.yaml"),
        f"pipeline.profile_path={tmp_path / 'no.json'}",
        "--predict",
        "--device",
        "quadro-rtx-5000",
        "--train-samples",
        "1000",
        "--trajectory",
        "paper",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(
        line.startswith("1000 training samples an epoch (--train-samples); a global batch of 64")
        for line in lines
    ), result.stdout
    table = lines.index(next(line for line in lines if line.strip().startswith("epoch ")))
    epochs = [line.split() for line in lines[table + 1 : table + 31]]
    assert [int(e[0]) for e in epochs] == list(range(1, 31))
    # The paper's trajectory on 8 layers: the bound at every epoch end (3, 5, 6, 7).
    assert [e[1] for e in epochs[:5]] == ["0", "3", "5", "6", "7"]
    # What stage 0 does with the prefix: nothing frozen, then filling the cache, upgrading it.
    assert [e[-1] for e in epochs[:3]] == ["none", "filled", "upgraded"]
