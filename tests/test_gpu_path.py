"""The GPU path, fifth pass (issue 61), under a GPU's rules on this CPU: what a first run on
one node of 8 GPUs (NCCL) would meet at transitions, in compiled and packed text, in the
cache's copies and in the data-parallel all-reduce. docs/gpus.md says what each test stands
for and what only a GPU can show."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, tiny_vit

from pipetransformer.config import load_config

pytestmark = pytest.mark.gpu_rules
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


@pytest.fixture
def fake_world():
    """This process as rank 0 of a world of `size` over torch's `fake` process-group backend
    (collectives return at once, without peers): one rank of a larger layout, built as the
    trainer builds it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")

    def start(size: int) -> None:
        dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- DDP's hook


@pytest.mark.parametrize("timed", [False, True], ids=["default", "time_communication"])
def test_the_default_step_reduces_in_ddps_own_all_reduce_without_a_python_hook(timed, fake_world):
    """`CommTimer` replaced DDP's C++ all-reduce by a Python hook in every DDP layout (a
    `.then` callback and two CUDA events per bucket per step), also when nobody asked for
    the timing. The runtime the trainer builds for a DDP layout of 2 replicas (rank 0 of a
    fake world): by default DDP has no communication hook (its reducer all-reduces each
    bucket in C++); with logging.time_communication the timing hook is registered."""
    from torch.nn.parallel import DistributedDataParallel

    from pipetransformer.autodp.groups import build_training_groups
    from pipetransformer.autodp.topology import Layout
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.pipe.timing import IntervalTimer
    from pipetransformer.trainer.distributed import WorldInfo
    from pipetransformer.trainer.runtime import build_runtime
    from pipetransformer.trainer.tasks import ClassificationTask

    fake_world(2)
    overrides = [f"logging.time_communication={str(timed).lower()}"]
    config = load_config(QUICKSTART, overrides)
    model = tiny_vit()
    plan = balance(UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6), 0, 1)
    layout = Layout(plan, 2, 2, 2)
    world = WorldInfo(0, 2, 0, 2, torch.device("cpu"))
    groups = build_training_groups(layout, 0, 60)
    units = dict(enumerate(model.units))
    timer = IntervalTimer(torch.device("cpu"))
    runtime = build_runtime(
        layout, world, config, units, groups, model.spec, ClassificationTask.loss_fn, timer
    )
    assert isinstance(runtime.wrapped, DistributedDataParallel)
    # DDP's C++ reducer all-reduces each bucket itself unless a hook was registered.
    hooks = [hook for hook, _ in runtime.wrapped._comm_hooks]
    assert hooks == ([runtime.comm_timer.hook] if timed else [])
    assert (runtime.comm_timer is not None) == timed
    groups.destroy()
