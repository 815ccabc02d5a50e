"""The run's first and last records: the start event (where it starts, in which layout and
world, what the plan predicts a stage holds) and the summary (what it reached, how long it
took, its peak memory), assembled from the run state, the world, the layout and the plan.

Owns: what those two records say. Must not: write them (the reporter does) or reduce
anything over the ranks (the caller hands the peaks in).
"""

from __future__ import annotations

import time

from pipetransformer.autodp.topology import Layout
from pipetransformer.config import decided_by_measured_time
from pipetransformer.planning import PlanContext
from pipetransformer.runs.records import RunSummary, StartEvent
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.clock import TrainingClock
from pipetransformer.trainer.distributed import WorldInfo


def start_event(
    state: RunState,
    world: WorldInfo,
    layout: Layout,
    plan: PlanContext,
    cache_daemons: list,
    counts_that_pay: list[int] | None = None,
) -> StartEvent:
    return StartEvent(
        global_step=state.global_step,
        attempt=state.attempt,
        time=time.time(),
        world_size=world.world_size,
        pipe_len=layout.pipe_len,
        dp_degree=layout.dp_degree,
        num_frozen_layers=layout.plan.num_frozen_layers,
        virtual_stages=layout.plan.virtual_stages,
        processes_per_node=world.devices_per_node,
        processes_per_node_from=world.devices_per_node_from,
        cache_daemons=cache_daemons,
        predicted_stage_bytes=[int(b) for b in plan.layout_bytes(layout)],
        device_memory_bytes=plan.budget_bytes,
        memory_source=plan.memory_source,
        sharded=layout.sharded,
        decided_by_measured_time=decided_by_measured_time(plan.config),
        planned_freeze_steps=[c.get("freeze_at") for c in state.anneal_plan] or None,
        freeze_counts_that_pay=counts_that_pay,
    )


def run_summary(
    state: RunState,
    layout: Layout,
    world: WorldInfo,
    clock: TrainingClock,
    peaks: tuple[int, int | None],
    *,
    metric_name: str,
    final_scores: dict | None,
    epochs: int,
    checkpoint: str | None,
    decision_interval_steps: int,
    num_layers: int,
    freeze_strategy: str = "",
    freeze_idle: bool = False,
) -> RunSummary:
    """`clock`: the run's training clock (every attempt; evaluation and checkpoint writes
    off it, beside it); `peaks`: (resident set, CUDA allocation)."""
    peak_rss, peak_allocated = peaks
    return RunSummary(
        training_time_s=clock.training_s(),
        eval_time_s=clock.total_eval_s,
        checkpoint_time_s=clock.total_checkpoint_s,
        attempts=state.attempt,
        final_eval_metric=state.last_eval_metric,
        best_eval_metric=state.best_eval_metric,
        metric_name=metric_name,
        final_scores=final_scores,
        epochs=epochs,
        global_steps=state.global_step,
        num_transitions=state.num_transitions,
        final_num_frozen_layers=layout.plan.num_frozen_layers,
        final_pipe_len=layout.pipe_len,
        final_dp_degree=layout.dp_degree,
        world_size=world.world_size,
        device=world.device.type,
        checkpoint=checkpoint,
        freeze_decisions=state.decision_index,
        freeze_decided_by=dict(state.decided_by),
        decision_interval_steps=decision_interval_steps,
        num_layers=num_layers,
        freeze_strategy=freeze_strategy,
        freeze_idle=freeze_idle,
        peak_rss_bytes=peak_rss,
        peak_allocated_bytes=peak_allocated,
    )
