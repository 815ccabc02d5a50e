"""`plan --predict`'s layouts at each frozen boundary: the layout the planner picks there
in the run's steady state (the prefix read from AutoCache where it serves), its predicted
step and the bytes of its largest stage; and the check, before anything is replayed, that
the run can start at all on the device's memory.

Owns: `PredictedLayout`, `boundary_rows`, `require_a_start_that_fits`. Must not: replay the
run (prediction_run.py) or price the peers (prediction_peers.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.profiles import UnitProfile
from pipetransformer.config import Config, ConfigError, World, initial_pipe_lens, resolve
from pipetransformer.models import ModelSpec
from pipetransformer.planning.cluster import Cluster
from pipetransformer.planning.context import PlanContext, format_bytes
from pipetransformer.planning.prediction_run import RunPrediction, Variant, pipe_len_from
from pipetransformer.planning.step_model import StepPrediction


@dataclass(frozen=True)
class PredictedLayout:
    """One frozen boundary: the layout the planner picks and its predicted step."""

    num_frozen_layers: int
    pipe_len: int
    dp_degree: int
    num_micro_batches: int
    compute_s: float
    p2p_s: float
    allreduce_s: float
    optimizer_s: float
    overhead_s: float
    step_s: float
    bubble: float
    peak_bytes: float  # the memory model's largest stage
    sharded: bool = False  # FSDP2 over every device (pipeline.sharding)
    virtual_stages: int = 1  # chunks a stage holds (interleaved_1f1b, zero_bubble)


def boundary_rows(elastic: Variant, run: RunPrediction) -> list[PredictedLayout]:
    """Each boundary's steady state, the prefix read wherever the cache serves it: the
    planner's layout for reading, from the pipeline the run holds at that boundary where
    it reaches it (the run plans a boundary when it gets there, for the prefix work of
    that moment, and K only halves: planned from the row before, a row could disagree
    with the epoch table), from the row before elsewhere."""
    context = elastic.context
    held = {s.num_frozen_layers: pipe_len_from(context, s.layout) for s in run.segments}
    rows, pipe_len = [], context.initial_pipe_len
    for frozen in range(context.spec.num_layers):
        serves = elastic.serves(frozen)
        read = elastic.prefix_s(frozen, {frozen: 1.0}, serves)
        layout = context.layout_for(
            frozen, held.get(frozen, pipe_len), prefix_cost=elastic.balance_cost(read)
        )
        pipe_len = pipe_len_from(context, layout)
        peak_bytes = max(context.layout_bytes(layout))
        rows.append(_predicted(frozen, layout, elastic.step(layout, read), peak_bytes))
    return rows


def require_a_start_that_fits(
    config: Config,
    spec: ModelSpec,
    world: World,
    profile: UnitProfile,
    budget: float,
    cluster: Cluster,
) -> None:
    """A ConfigError naming the device and the need when no pipeline length the run may
    start at fits `budget` with nothing frozen (and, under pipeline.sharding 'auto', no
    sharded layout either)."""
    if PlanContext.prices(config):
        try:
            sharded = dataclasses.replace(
                config, pipeline=dataclasses.replace(config.pipeline, sharding="always")
            )
            PlanContext.build(sharded, spec, world, profile, budget)
            return
        except ConfigError:
            pass
    unlimited = PlanContext.build(config, spec, world, profile)
    needs = {}
    for pipe_len in initial_pipe_lens(resolve(config, world), world.world_size):
        fixed = unlimited.with_pipeline(pipe_len)
        needs[pipe_len] = max(fixed.stage_bytes(fixed.layout_for(0, pipe_len).plan))
        if needs[pipe_len] <= budget:
            return
    pipe_len = max(needs)
    setting = config.pipeline.initial_pipe_len
    hint = (
        "; pipeline.initial_pipe_len=auto tries longer pipelines"
        if isinstance(setting, int) and setting < world.devices_per_node
        else ""
    )
    raise ConfigError(
        f"no pipeline fits {cluster.memory_label(config)} at 0 frozen layers: the largest "
        f"stage needs {format_bytes(needs[pipe_len])} at pipe_len {pipe_len}, a device has "
        f"{format_bytes(budget)} for stages{hint}"
    )


def _predicted(
    frozen: int, layout: Layout, step: StepPrediction, peak_bytes: float
) -> PredictedLayout:
    m, k = layout.plan.num_micro_batches, layout.pipe_len
    return PredictedLayout(
        num_frozen_layers=frozen,
        pipe_len=k,
        dp_degree=layout.dp_degree,
        num_micro_batches=m,
        compute_s=step.compute_s,
        p2p_s=step.p2p_s,
        allreduce_s=step.allreduce_s,
        optimizer_s=step.optimizer_s,
        overhead_s=step.overhead_s,
        step_s=step.step_s,
        bubble=_bubble(layout, step),
        peak_bytes=peak_bytes,
        sharded=layout.sharded,
        virtual_stages=layout.plan.virtual_stages,
    )


def _bubble(layout: Layout, step: StepPrediction) -> float:
    """A step's compute over its busiest rank's own work: 1 sharded, (M + K - 1) / M for the
    one-chunk schedules, the step model's figure for interleaved_1f1b and zero_bubble."""
    if layout.sharded:
        return 1.0
    if step.bubble_factor is not None:
        return step.bubble_factor
    m, k = layout.plan.num_micro_batches, layout.pipe_len
    return (m + k - 1) / m
