"""This rank's runtime in a layout: its pipeline stage (pipe/: PipelineStage + DDP + the
schedule) or, in a sharded layout, its shard of the model (fsdp/: FSDP2).

Owns: which runtime a layout's role asks for, and what each is built from (the layout's
plan, the replica's batch, the units, the loss, the groups, the device, autocast). Must not:
choose layouts or hold the optimizer (the trainer's stage does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipetransformer.autodp.groups import TrainingGroups
from pipetransformer.autodp.topology import Layout
from pipetransformer.config import Config
from pipetransformer.fsdp import build_sharded_runtime
from pipetransformer.models import ModelSpec
from pipetransformer.pipe import StageRuntime, build_stage_runtime
from pipetransformer.pipe.timing import IntervalTimer
from pipetransformer.trainer.distributed import WorldInfo


def build_runtime(
    layout: Layout,
    world: WorldInfo,
    config: Config,
    units: dict[int, nn.Module],
    groups: TrainingGroups,
    spec: ModelSpec,
    loss_fn: Callable,
    comm_timer: IntervalTimer | None = None,
) -> StageRuntime | None:
    """None for a rank without a role in `layout`. Collective over the layout's groups.
    `comm_timer` marks the data-parallel all-reduce only where logging.time_communication
    asks for it: timing DDP's buckets takes a Python hook in place of its C++ all-reduce."""
    role = layout.role(world.rank)
    if not config.logging.time_communication:
        comm_timer = None
    if role is None:
        return None
    name = config.trainer.autocast_dtype
    if layout.sharded:
        return build_sharded_runtime(
            plan=layout.plan,
            replica_batch_size=config.trainer.replica_batch_size(layout.dp_degree),
            units=units,
            loss_fn=loss_fn,
            data_group=groups.data,
            device=world.device,
            autocast_dtype=getattr(torch, name) if name else None,
        )
    return build_stage_runtime(
        plan=layout.plan,
        stage_index=role.stage,
        replica_batch_size=config.trainer.replica_batch_size(layout.dp_degree),
        units=units,
        spec=spec,
        loss_fn=loss_fn,
        schedule_name=config.pipeline.schedule,
        pipeline_group=groups.pipeline,
        data_group=groups.data,
        device=world.device,
        autocast_dtype=getattr(torch, name) if name else None,
        comm_timer=comm_timer,
    )
