"""freeze.strategy signal_to_noise in a run: the optimizer's moving averages as the trainer
reads them, and the rule's decisions reaching the layout."""

import pytest
import torch

from pipetransformer.config import OptimizerConfig
from pipetransformer.trainer import optim


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_moving_average_of_gradients_by_unit(name):
    """Adam's first moment bias-corrected, SGD's momentum buffer times (1 - momentum): on a
    constant gradient both are that gradient, so ||m||^2 = ||g||^2 per unit."""
    torch.manual_seed(0)
    named = {
        "units.0.w": torch.nn.Parameter(torch.randn(3, 4)),
        "units.2.w": torch.nn.Parameter(torch.randn(5)),
        "units.2.b": torch.nn.Parameter(torch.randn(2)),
    }
    grads = {k: torch.randn_like(p) for k, p in named.items()}
    config = OptimizerConfig(name=name, lr=1e-3, momentum=0.9)
    optimizer = optim.build_optimizer(config, named)
    for _ in range(200 if name == "sgd" else 3):
        for key, p in named.items():
            p.grad = grads[key].clone()
        optimizer.step()
    squares = optim.momentum_sq_by_unit(optimizer, named, 4, torch.device("cpu"))
    expected = [
        grads["units.0.w"].square().sum(),
        0.0,
        grads["units.2.w"].square().sum() + grads["units.2.b"].square().sum(),
        0.0,
    ]
    torch.testing.assert_close(
        squares, torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=0
    )
    assert optim.momentum_decay(config) == (0.9 if name == "sgd" else config.betas[0])


@pytest.mark.distributed
def test_a_run_freezes_as_its_signal_says(tmp_path):
    """2 ranks, a pipeline then DDP: with every gradient counted as noise (threshold 1) each
    decision freezes up to Eq. 1's bound, as the pure rule says; the ranks agree (the run
    checks it at every decision)."""
    import json

    from helpers import run_workers
    from reference import elastic_config
    from workers import elastic_run

    from pipetransformer.freeze import bound_trajectory

    config = elastic_config(
        trainer__nproc_per_node=2,
        pipeline__initial_pipe_len=2,
        freeze__strategy="signal_to_noise",
        freeze__signal_threshold=1.0,
        freeze__interval_steps=None,
        freeze__manual_schedule=[],
    )
    run_workers(elastic_run, 2, config, str(tmp_path))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    depth = config["model"]["kwargs"]["depth"]
    assert [m["num_frozen_layers"] for m in metrics] == [0, *bound_trajectory(depth, 1 / 3, 2)]
