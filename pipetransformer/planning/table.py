"""`pipetransformer plan`: the layout a run of a config would use at each frozen boundary and
the bytes each stage would hold, before any process starts; under interleaved_1f1b and
zero_bubble which units each chunk holds and which stage (rank of a replica) runs it.

Owns: `PlanRow`, `plan_table` and its text form. Must not: measure anything (a stored
profile is used when the profile file has one) or start processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pipetransformer.autopipe.profiles import ProfileStore
from pipetransformer.config import (
    MULTI_CHUNK_SCHEDULES,
    TORCH_SCHEDULE_CLASS,
    Config,
    World,
    layout_schedule,
)
from pipetransformer.planning.context import (
    PlanContext,
    describe_model,
    device_memory_budget,
    profiling_micro_batch_size,
)
from pipetransformer.planning.profile_keys import (
    configured_device_type,
    profile_path_for,
    stored_micro_batch_chooser,
    unit_profile_key_for,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanRow:
    """One frozen boundary's layout (one element of `plan --json`)."""

    num_frozen_layers: int
    pipe_len: int
    dp_degree: int
    num_micro_batches: int
    prefix_units: list[int]  # [0, end) run before chunk 0
    stage_ranges: list[list[int]]  # per chunk (a stage's, with one chunk a stage)
    stage_names: list[str]  # per chunk
    stage_costs: list[float]  # per chunk
    max_stage_cost: float  # the largest stage's: its chunks' summed
    cost_source: str  # 'params' or 'time'
    stage_bytes: list[int]
    memory_source: str  # 'profile' or 'params'
    device_memory_bytes: float | None
    # The schedule the layout runs (config/schedules.py; None: plain DDP, K = 1), the chunks
    # a stage holds (v) and, per chunk, the stage (rank of the replica) that runs it.
    schedule: str | None = None
    virtual_stages: int = 1
    chunk_stages: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_table(
    config: Config,
    world_size: int | None = None,
    profile_path: str | os.PathLike | None = None,
    device_type: str | None = None,
) -> list[PlanRow]:
    """For F = 0 .. L-1 in order (K only shrinks), the layout the run would use and the
    bytes each stage would hold.

    With a unit profile for this model in the profile file (`profile_path`, default
    `profile_path_for(config)`): stages are balanced on measured seconds under
    `pipeline.balance: time` (rows say cost_source 'time'), stage bytes include activations
    (memory_source 'profile'), and `initial_pipe_len: auto` is resolved as a run would;
    with `num_micro_batches: measured`, stored timings choose M. Without one: parameter counts,
    and stage bytes of parameters, gradients and optimizer state only (memory_source
    'params'). The CPU has no memory limit unless pipeline.device_memory_bytes is set.
    """
    spec = describe_model(config)
    devices = config.nproc_per_node
    world = World(world_size or devices, devices, "cpu")
    path = Path(profile_path) if profile_path is not None else profile_path_for(config)
    device_type = device_type or configured_device_type(config)
    store = ProfileStore(path).load()
    micro_batch_size = profiling_micro_batch_size(config, world.world_size)
    profile = store.unit_profile(unit_profile_key_for(config, spec, device_type, micro_batch_size))
    if profile is None and (
        config.pipeline.balance == "time" or config.pipeline.initial_pipe_len == "auto"
    ):
        logger.warning(
            "%s has no unit profile for this model on %s at micro-batch %d: "
            "costs from parameter counts, memory without activations "
            "(a training run measures them)",
            path,
            device_type,
            micro_batch_size,
        )
    # The budget of this machine's device; a GPU profile planned elsewhere: the configured one.
    on_gpu = device_type.startswith("cuda") and torch.cuda.is_available()
    budget = device_memory_budget(config, "cuda" if on_gpu else "cpu")
    context = PlanContext.build(config, spec, world, profile, budget)
    chooser = stored_micro_batch_chooser(config, spec, store, device_type)
    rows = []
    pipe_len = context.initial_pipe_len
    source = context.costs.source
    for frozen in range(spec.num_layers):
        layout = context.layout_for(frozen, pipe_len, chooser)
        pipe_len = layout.pipe_len
        plan = layout.plan
        rows.append(
            PlanRow(
                num_frozen_layers=frozen,
                pipe_len=plan.pipe_len,
                dp_degree=layout.dp_degree,
                num_micro_batches=plan.num_micro_batches,
                prefix_units=[0, plan.prefix_end],
                stage_ranges=[list(r) for r in plan.stage_ranges],
                stage_names=[
                    f"{spec.unit_names[a]}..{spec.unit_names[b - 1]}" for a, b in plan.stage_ranges
                ],
                stage_costs=[_rounded(c, source) for c in plan.stage_costs],
                max_stage_cost=_rounded(plan.max_stage_cost, source),
                cost_source=source,
                stage_bytes=[int(b) for b in context.stage_bytes(plan)],
                memory_source=context.memory_source,
                device_memory_bytes=budget,
                schedule=layout_schedule(
                    config.pipeline.schedule, plan.pipe_len, plan.virtual_stages
                ),
                virtual_stages=plan.virtual_stages,
                chunk_stages=[plan.stage_of_chunk(c) for c in range(plan.num_chunks)],
            )
        )
    return rows


def _rounded(cost: float, source: str) -> float:
    # Parameter counts are large numbers; measured seconds are small ones: keep 4 digits.
    return round(cost, 3) if source == "params" else float(f"{cost:.4g}")


def format_plan_table(config: Config, rows: list[PlanRow]) -> str:
    first = rows[0] if rows else None
    unit = "params" if first is None or first.cost_source == "params" else "s"
    described = (
        "params"
        if unit == "params"
        else "s (measured: forward+backward, frozen prefix forward only)"
    )
    auto = " (auto)" if config.pipeline.initial_pipe_len == "auto" else ""
    memory = (
        "measured unit profile"
        if first and first.memory_source == "profile"
        else "parameters, gradients, optimizer state (no profile yet: activations unknown)"
    )
    budget = (
        f"; device budget {first.device_memory_bytes / 2**20:,.0f} MiB"
        if first and first.device_memory_bytes
        else "; no device limit"
    )
    pipeline = config.pipeline
    chunked = pipeline.schedule in MULTI_CHUNK_SCHEDULES
    lines = [
        f"model {config.model.name}: {len(rows)} layers, initial pipe_len "
        f"{first.pipe_len if first else pipeline.initial_pipe_len}{auto}, "
        f"{config.nproc_per_node} devices per node; costs in {described}",
        f"memory per stage: {memory}{budget}",
    ]
    if chunked:
        lines.append(
            f"schedule {pipeline.schedule} ({TORCH_SCHEDULE_CLASS[pipeline.schedule]}), "
            f"virtual_stages {pipeline.virtual_stages}: v chunks a stage, chunk c on stage "
            "c mod K (cN@s: chunk N on stage s); 1F1B where v = 1 for interleaved_1f1b"
        )
    v = f" {'v':>2}" if chunked else ""
    chunks = "chunks" if chunked else "stages"
    lines.append(
        f"{'frozen':>6} {'K':>3}{v} {'R':>3} {'M':>3}  {'max stage':>12}  {'MiB/stage':>16}  "
        f"{chunks}"
    )
    for row in rows:
        names = [
            f"{name} ({cost:,.0f})" if unit == "params" else f"{name} ({cost:.4g})"
            for name, cost in zip(row.stage_names, row.stage_costs)
        ]
        if chunked:
            names = [f"c{c}@{s} {name}" for c, (s, name) in enumerate(zip(row.chunk_stages, names))]
        mib = "/".join(f"{b / 2**20:.1f}" for b in row.stage_bytes)
        v = f" {row.virtual_stages:>2}" if chunked else ""
        lines.append(
            f"{row.num_frozen_layers:>6} {row.pipe_len:>3}{v} {row.dp_degree:>3} "
            f"{row.num_micro_batches:>3}  {row.max_stage_cost:>12,.6g}  {mib:>16}  "
            + " | ".join(names)
        )
    return "\n".join(lines)
