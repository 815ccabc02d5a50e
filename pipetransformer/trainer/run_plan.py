"""The run's plan at its start: what this run measures (unit profiles, and the links where
sharded layouts are priced) and the PlanContext built from it, which carries the resolved
config. Measured unit profiles balance the stages (balance: time), tell when the cache pays
and what a stage holds in memory.

Owns: which measurements a run's plan needs, assembling the plan from them, and the
measured micro-batch count of a layout. Must not: plan layouts itself (planning/ does) or
measure (profiling/run_profiler.py does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.planner import UnitCosts
from pipetransformer.autopipe.profiles import unit_costs_from_profile
from pipetransformer.config import Config
from pipetransformer.models import ModelSpec
from pipetransformer.planning import PlanContext, device_memory_budget, profiling_micro_batch_size
from pipetransformer.planning.cluster import measured_cluster, step_pricer, unit_times
from pipetransformer.profiling import RunProfiler
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.distributed import WorldInfo


@dataclass
class RunPlan:
    plan: PlanContext
    profiler: RunProfiler
    measured_costs: UnitCosts | None  # None where nothing was profiled
    profile_micro_batch_size: int
    budget: float | None  # device memory, None: unlimited


def prices_layouts(config: Config, budget: float | None, device: torch.device) -> bool:
    """Whether sharded layouts are priced against pipelines (pipeline.sharding 'auto'):
    where a replica may not fit (a memory budget), on GPUs. Over gloo on a CPU FSDP2's
    step costs what the step model cannot price (measured: 1.4x DDP's for MiniLM,
    docs/benchmarks.md section 13), so a CPU run keeps pipelines."""
    return PlanContext.prices(config) and budget is not None and device.type == "cuda"


def plan_run(
    config: Config,
    spec: ModelSpec,
    units: list[nn.Module],
    world: WorldInfo,
    control: Control,
    run_dir: Path,
    state: RunState,
    carried_profiles: Path | None,
) -> RunPlan:
    """Measure what the plan needs (collective) and build it. `units`: the full model's,
    profiled where measured; `state` keeps the measured links for a resume."""
    profiler = RunProfiler(config, spec, run_dir, world.device, control, carried_profiles)
    # Each rank reads its own device's free memory; the plan (the first pipeline length,
    # which transitions fit) must be the same on every rank, so they plan with the least.
    budget = device_memory_budget(config, world.device)
    if budget is not None:
        budget = float(control.all_min([budget])[0])
    # Measured at the initial layout's micro-batch size, 'auto' K as the shortest start.
    micro_batch_size = profiling_micro_batch_size(config, world.world_size)
    pricing = prices_layouts(config, budget, world.device)
    profile = None
    if config.pipeline.balance == "time" or config.cache.enabled or pricing or budget is not None:
        profile = profiler.unit_profile(units, micro_batch_size)
    measured_costs = unit_costs_from_profile(profile) if profile is not None else None
    plan = PlanContext.build(config, spec, world.shape, profile, budget)
    if pricing:  # sharded layouts where predicted faster (planning/context.py)
        costs = state.link_costs or profiler.links()
        state.link_costs = costs
        cluster = measured_cluster(
            costs, world.num_nodes, world.devices_per_node, world.device.type
        )
        times = unit_times(profile, costs["memory_bytes_per_s"])
        plan = plan.with_pricer(step_pricer(times, plan.config, cluster))
    return RunPlan(plan, profiler, measured_costs, micro_batch_size, budget)


def measured_micro_batches(
    layout: Layout,
    config: Config,
    profiler: RunProfiler,
    step_of: Callable[[Layout], Callable[[], None]],
) -> Layout:
    """For num_micro_batches 'measured': `layout` with the fastest M measured (collective),
    `step_of(trial)` giving a step of each trial layout to time. 'auto' and an int were set
    by the plan from the config alone; a sharded layout's M is the fewest that fit
    (planning/context.py)."""
    if config.pipeline.num_micro_batches != "measured" or layout.sharded:
        return layout
    replica_batch = config.trainer.replica_batch_size(layout.dp_degree)
    trials = lambda m: step_of(layout.with_micro_batches(m))  # noqa: E731
    return layout.with_micro_batches(profiler.micro_batches(layout.pipe_len, replica_batch, trials))
