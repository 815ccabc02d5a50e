"""Which rank plays which stage of which replica. Pure arithmetic, no communication.

A stage holds one chunk of units, or under interleaved_1f1b and zero_bubble several: chunk c
of a replica runs on its stage c mod K (autopipe/planner.py's PipelinePlan), so a rank's
units are then several non-contiguous ranges.

Ranks are numbered node by node (rank = node * devices_per_node + local_rank). On every
node, replica j uses local ranks [j*K, (j+1)*K), stage s on local rank j*K + s, so a
pipeline never spans nodes. Halving K turns the later half of each old pipeline into the
stages of a new replica. With AutoDP off the number of replicas stays at its initial value
and the ranks past them idle.

A *sharded* layout is one stage replicated over every rank of the world whose trained units
FSDP2 shards over those replicas (fsdp/): the same roles as K = 1, every rank a first and a
last stage holding every unit (the trained ones as shards).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipetransformer.autopipe.planner import PipelinePlan


@dataclass(frozen=True)
class Role:
    replica: int
    stage: int
    pipe_len: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pipe_len - 1


@dataclass(frozen=True)
class Layout:
    plan: PipelinePlan
    world_size: int
    devices_per_node: int
    dp_degree: int  # R: number of pipeline replicas
    sharded: bool = False  # FSDP2 over the replicas instead of DDP (one stage, every rank)

    def __post_init__(self) -> None:
        k = self.plan.pipe_len
        if self.sharded and (k != 1 or self.dp_degree != self.world_size):
            raise ValueError("a sharded layout is one stage replicated over every rank")
        if self.world_size % self.devices_per_node:
            raise ValueError("devices_per_node must divide the world size")
        if self.devices_per_node % k:
            raise ValueError(
                f"pipe_len {k} must divide the {self.devices_per_node} devices per node"
            )
        if self.dp_degree % self.num_nodes:
            raise ValueError("every node holds the same number of replicas")
        if self.replicas_per_node * k > self.devices_per_node:
            raise ValueError(f"{self.replicas_per_node} replicas of {k} stages exceed a node")

    @property
    def pipe_len(self) -> int:
        return self.plan.pipe_len

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.devices_per_node

    @property
    def replicas_per_node(self) -> int:
        return self.dp_degree // self.num_nodes

    def rank_of(self, replica: int, stage: int) -> int:
        node, local_replica = divmod(replica, self.replicas_per_node)
        return node * self.devices_per_node + local_replica * self.pipe_len + stage

    def role(self, rank: int) -> Role | None:
        """This rank's stage and replica, or None when it idles in this layout."""
        node, local = divmod(rank, self.devices_per_node)
        local_replica, stage = divmod(local, self.pipe_len)
        if local_replica >= self.replicas_per_node:
            return None
        return Role(node * self.replicas_per_node + local_replica, stage, self.pipe_len)

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [self.rank_of(replica, s) for s in range(self.pipe_len)]

    def data_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(r, stage) for r in range(self.dp_degree)]

    def units_of_rank(self, rank: int) -> list[int]:
        """Units whose weights this rank holds: its stage's (every chunk's, under the
        multi-chunk schedules: ranges that need not be contiguous), plus the frozen prefix on
        stage 0."""
        role = self.role(rank)
        if role is None:
            return []
        if role.is_first:
            return self.plan.units_of_first_stage_rank()
        return self.plan.stage_units(role.stage)

    def with_micro_batches(self, num_micro_batches: int) -> Layout:
        return dataclasses.replace(
            self, plan=dataclasses.replace(self.plan, num_micro_batches=num_micro_batches)
        )

    def replica_batch_size(self, global_batch_size: int) -> int:
        return global_batch_size // self.dp_degree

    def describe(self) -> str:
        plan = self.plan
        if plan.virtual_stages == 1:
            units = "stage_units=[" + ", ".join(f"{a}-{b - 1}" for a, b in plan.stage_ranges)
        else:  # each chunk with the stage (rank of the replica) that runs it
            chunks = enumerate(plan.stage_ranges)
            units = f"virtual_stages={plan.virtual_stages} chunk_units=[" + ", ".join(
                f"{a}-{b - 1}@{plan.stage_of_chunk(c)}" for c, (a, b) in chunks
            )
        return (
            f"pipe_len={self.pipe_len} dp_degree={self.dp_degree}"
            f"{' sharded' if self.sharded else ''} "
            f"frozen_layers={plan.num_frozen_layers} {units}] "
            f"micro_batches={plan.num_micro_batches}"
        )


def dp_degree_for(
    pipe_len: int, world_size: int, initial_dp_degree: int, autodp_enabled: bool
) -> int:
    """AutoDP fills every freed device with replicas; without it R never changes."""
    return world_size // pipe_len if autodp_enabled else initial_dp_degree
