"""A training step that logs nothing makes the host wait for the device nowhere: the loss,
the gradient norms of the freeze signal and the clipping factor stay on the device
(counted as on a GPU: .item(), .tolist(), float(), int(), bool(), .cpu(), .numpy() and
blocking .to("cpu") on tensors). The loss leaves the device once per log interval, in
_log_steps. A new sync in the step fails here with where it is."""

import pytest
from helpers import run_workers
from reference import elastic_config
from workers import host_syncs_of_a_step

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("pipe_len", [2, 1], ids=["pipeline", "ddp"])
def test_a_training_step_has_no_host_sync(tmp_path, pipe_len):
    config = elastic_config(
        trainer__nproc_per_node=2,
        trainer__log_interval_steps=100,
        pipeline__initial_pipe_len=pipe_len,
        optimizer__max_grad_norm=1.0,
        freeze__strategy="gradient_norm",
        freeze__manual_schedule=[],
    )
    for syncs in run_workers(host_syncs_of_a_step, 2, config, str(tmp_path)):
        assert syncs == [], syncs
