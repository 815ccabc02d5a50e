"""The memory model: its arithmetic by hand, the starting pipeline length it picks, and its
prediction of a stage's peak against a measured one (within 25%).

Measured peak: glibc malloc's bytes in use (PyTorch's CPU tensors come from malloc),
sampled after every operator of a training step (forward, backward, optimizer step), above
what the process held before it built anything of the stage. On a GPU the same comparison
uses torch.cuda.max_memory_allocated (docs/profiling.md)."""

from __future__ import annotations

import pytest
from helpers import run_workers
from memory_check import measure_stage_memory

from pipetransformer.autopipe.memory import LayoutShape, MemoryModel
from pipetransformer.autopipe.planner import UnitCosts, balance
from pipetransformer.config import ConfigError, config_from_dict
from pipetransformer.planning.context import choose_initial_pipe_len

# Six units: embedding, two layers (attention, MLP), head. Parameters 100 bytes each, 10
# bytes saved for backward and 4 bytes of output per unit and micro-batch of 2 samples.
TOY = MemoryModel(
    (100,) * 6, (10,) * 6, (4,) * 6, profile_micro_batch_size=2, optimizer_state_factor=2.0
)


def test_stage_memory_by_hand():
    plan = balance(UnitCosts.from_param_counts([1] * 6, 1 / 6), 0, 2)  # stages [0, 3), [3, 6)
    first = TOY.stage_memory(
        plan, 0, LayoutShape(micro_batch_size=4, num_micro_batches=3, dp_degree=2)
    )
    assert (first.parameters, first.gradients, first.optimizer, first.ddp_buckets) == (
        300,
        300,
        600,
        300,
    )
    # 3 micro-batches in flight x (4 / 2 samples) x 3 units x 10 bytes saved.
    assert first.activations == 3 * 2 * 30
    # Outputs kept (3) and output gradients received (3) at 4 bytes x 2.
    assert first.boundary == 2 * (3 * 4 + 3 * 4)
    last = TOY.stage_memory(plan, 1, LayoutShape(4, 3, dp_degree=1, schedule="1f1b"))
    assert last.ddp_buckets == 0  # one replica: no DDP
    assert last.activations == 1 * 2 * 30  # 1F1B: at most K - s = 1 micro-batch in flight
    assert last.boundary == 2 * (1 * 4 + 3 * 4)  # its output kept, its inputs received
    # With 4 of the 6 units frozen (F = 2 ... not possible with 2 layers; take F = 1):
    frozen = balance(
        UnitCosts.from_param_counts([1] * 6, 1 / 6), 1, 1
    )  # prefix [0, 3), stage [3, 6)
    only = TOY.stage_memory(frozen, 0, LayoutShape(4, 1, 2))
    assert (only.parameters, only.gradients) == (600, 300)  # holds the prefix, trains 3 units


def test_initial_pipe_len_auto_is_the_shortest_that_fits():
    config = config_from_dict(
        {
            "trainer": {"nproc_per_node": 4, "global_batch_size": 16},
            "pipeline": {"initial_pipe_len": "auto", "num_micro_batches": 4},
        }
    )
    costs = UnitCosts.from_param_counts([1] * 6, 1 / 6)
    assert choose_initial_pipe_len(config, costs, TOY, None, 4) == 1  # unlimited: DDP
    peaks = {
        k: max(TOY.peak_bytes(balance(costs, 0, k), LayoutShape(16 // (4 // k) // 4, 4, 4 // k)))
        for k in (1, 2, 4)
    }
    assert peaks[1] > peaks[2] > peaks[4]
    assert choose_initial_pipe_len(config, costs, TOY, peaks[2], 4) == 2
    assert choose_initial_pipe_len(config, costs, TOY, peaks[4], 4) == 4
    with pytest.raises(ConfigError, match="pipeline.initial_pipe_len: auto: no pipeline fits"):
        choose_initial_pipe_len(config, costs, TOY, peaks[4] - 1, 4)


CONFIG = {
    "trainer": {"global_batch_size": 32},
    "optimizer": {"name": "adamw"},
    "model": {
        "name": "vit_tiny_patch16_224",
        "kwargs": {"patch_size": 4, "embed_dim": 128, "depth": 4, "num_heads": 4, "mlp_ratio": 4.0},
    },
}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "pipe_len, dp_degree, schedule, micro",
    [(2, 1, "gpipe", 4), (1, 2, "gpipe", 2), (2, 1, "1f1b", 4)],
)
def test_predicted_stage_peak_is_within_25_percent_of_the_measured_one(
    pipe_len, dp_degree, schedule, micro
):
    results = run_workers(
        measure_stage_memory, pipe_len * dp_degree, CONFIG, pipe_len, dp_degree, schedule, micro
    )
    for result in results:
        predicted, measured = result["predicted"]["total"], result["measured"]
        assert measured > 0
        assert abs(predicted - measured) <= 0.25 * measured, (
            result["stage"],
            predicted,
            measured,
            result["predicted"],
        )
