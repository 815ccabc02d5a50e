"""This rank's runtime in a layout: its pipeline stage (pipe/: PipelineStage + DDP + the
schedule) or, in a sharded layout, its shard of the model (fsdp/: FSDP2).

Owns: which runtime a layout's role asks for, and what each is built from (the layout's
plan, the replica's batch, the units, the loss, the groups, the device, autocast), and the
compilation of its units before its first step (`warm_up_layout`). Must not: choose layouts
or hold the optimizer (the trainer's stage does).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.groups import TrainingGroups
from pipetransformer.autodp.topology import Layout
from pipetransformer.config import Config
from pipetransformer.fsdp import build_sharded_runtime
from pipetransformer.models import ModelSpec
from pipetransformer.pipe import StageRuntime, build_stage_runtime
from pipetransformer.pipe.timing import IntervalTimer
from pipetransformer.pipe.warmup import warm_up_forms, warm_up_units
from pipetransformer.planning.profile_keys import micro_batch_candidates
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
            activation_checkpointing=config.trainer.activation_checkpointing,
            reshard_after_forward=config.pipeline.fsdp_reshard_after_forward,
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
        activation_checkpointing=config.trainer.activation_checkpointing,
    )


class CompileFailed(RuntimeError):
    """A rank could not compile its units for a layout: raised on every rank, before a step."""


def warm_up_layout(
    layout: Layout,
    world: WorldInfo,
    config: Config,
    units: dict[int, nn.Module],
    spec: ModelSpec,
    control: Control,
    one_sample: bool,
) -> float:
    """Compile every graph this rank's units need in `layout` before its first step
    (pipe/warmup.py), then wait for every rank to have done the same (collective over the
    control group, for up to trainer.compile_timeout_s: no NCCL operation is pending while
    any rank compiles). A rank that failed, on its units' graph limit or otherwise, fails
    every rank with its reason. `one_sample`: some batch may bring one sample (AutoCache
    serving). Returns the seconds it took."""
    started = time.perf_counter()
    error = None
    if layout.role(world.rank) is not None and not layout.sharded:
        replica_batch = config.trainer.replica_batch_size(layout.dp_degree)
        counts = [layout.plan.num_micro_batches]
        if config.pipeline.num_micro_batches == "measured":  # its trials run steps too
            counts = micro_batch_candidates(config, layout.pipe_len, replica_batch)
        packs = config.data.padding in ("packed", "auto")
        forms = warm_up_forms(spec, [replica_batch // m for m in counts], packs, one_sample)
        name = config.trainer.autocast_dtype
        dtype = getattr(torch, name) if name else None
        try:
            warm_up_units(units, layout.plan.frozen_end, spec, forms, world.device, dtype)
        except Exception as exc:  # noqa: BLE001 - every rank is told, then raises
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    failed = control.failures(error, config.trainer.compile_timeout_s)
    if failed:
        rank, reason = failed[0]
        raise CompileFailed(
            f"trainer.compile: rank {rank} could not compile its units before the layout's "
            f"first step ({reason}); no step was taken"
        )
    return time.perf_counter() - started
