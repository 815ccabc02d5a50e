"""AutoPipe: pure planning of pipeline layouts (planner) and the measurements feeding it."""

from pipetransformer.autopipe.memory import LayoutShape, MemoryModel, StageMemory
from pipetransformer.autopipe.planner import (
    AutoPipePlanner,
    PipelinePlan,
    UnitCosts,
    balance,
    fixed_plan,
    partition_greedy,
    partition_optimal,
)

__all__ = [
    "LayoutShape",
    "MemoryModel",
    "StageMemory",
    "AutoPipePlanner",
    "PipelinePlan",
    "UnitCosts",
    "balance",
    "fixed_plan",
    "partition_greedy",
    "partition_optimal",
]
