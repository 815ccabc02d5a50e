"""The sharded layout's evaluation, without processes: every rank must make the same
forward calls, since each call all-gathers every trained FSDP2 group (a rank that calls
once where another calls twice leaves the two in different collectives: gloo's size check
aborts, NCCL hangs). Under `data.padding: auto` one replica's batch can pack where
another's is padded (issue 59's frozen-embedding FSDP2 peer died so at its first
evaluation), so the number of calls must not depend on the batch's shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetransformer.fsdp.runtime import ShardedRuntime
from pipetransformer.utils.padding import PackedShape

pytestmark = pytest.mark.gpu_rules  # NCCL's rule: every rank, the same collectives


class CountingHead(nn.Module):
    """A linear head that counts its forward calls (each one FSDP2's all-gathers)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


def runtime(num_micro_batches: int) -> ShardedRuntime:
    return ShardedRuntime(
        module=CountingHead(),
        preprocess=None,
        loss_fn=nn.functional.cross_entropy,
        data_group=None,
        device=torch.device("cpu"),
        micro_batch_size=3,
        num_micro_batches=num_micro_batches,
    )


def test_evaluation_calls_the_module_once_a_micro_batch_packed_or_padded():
    torch.manual_seed(0)
    batch = torch.randn(6, 4)
    calls = []
    for shape in (8, PackedShape(rows=2, row_length=8, samples=3), None):
        sharded = runtime(num_micro_batches=2)
        outputs = sharded.eval_step([batch], None, seq_length=shape)
        calls.append(sharded.module.calls)
        # The same outputs as the whole batch at once, in the batch's order.
        torch.testing.assert_close(outputs, sharded.module.linear(batch))
        assert sharded.module.training  # back in training mode after the evaluation
    assert calls == [2, 2, 2]


def test_a_batch_with_fewer_rows_than_micro_batches_still_calls_each_one():
    """The last evaluation batch of a replica can hold fewer rows than micro-batches: the
    empty pieces are still forward calls, as on the replica whose batch is full."""
    sharded = runtime(num_micro_batches=4)
    outputs = sharded.eval_step([torch.randn(2, 4)], None, seq_length=8)
    assert sharded.module.calls == 4 and outputs.shape == (2, 2)
