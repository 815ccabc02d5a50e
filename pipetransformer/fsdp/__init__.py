"""Sharded layouts: FSDP2 over every process, one stage, the frozen prefix in front of it.

runtime.py builds a rank's step (`build_sharded_runtime`, `ShardedRuntime`: the interface of
pipe/runtime.py's `StageRuntime`); state.py converts units and optimizer state into and out
of FSDP2's shards at transitions. The layout itself is autodp/topology.py's (`sharded`);
what it holds in memory and costs in time are autopipe/memory.py's and
planning/step_model.py's.
"""

from pipetransformer.fsdp.runtime import ShardedRuntime, build_sharded_runtime
from pipetransformer.fsdp.state import (
    gather_units,
    is_sharded,
    local,
    shard_optimizer_states,
    unit_is_sharded,
)

__all__ = [
    "ShardedRuntime",
    "build_sharded_runtime",
    "gather_units",
    "is_sharded",
    "local",
    "shard_optimizer_states",
    "unit_is_sharded",
]
