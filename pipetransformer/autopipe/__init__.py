"""AutoPipe: pure planning of pipeline layouts (planner) and the measurements feeding it."""

from pipetransformer.autopipe.planner import (
    AutoPipePlanner,
    MemoryModel,
    PipelinePlan,
    UnitCosts,
    balance,
    fixed_plan,
    partition_greedy,
    partition_optimal,
)

__all__ = [
    "AutoPipePlanner",
    "MemoryModel",
    "PipelinePlan",
    "UnitCosts",
    "balance",
    "fixed_plan",
    "partition_greedy",
    "partition_optimal",
]
