"""Process groups of a layout. The only module that creates or destroys process groups.

The control group is the static world (gloo) for small control messages; it is created
once and never changes. Training groups (one pipeline group per replica, one data group per
stage across replicas) are rebuilt at every transition. Every rank creates every group in
the same order: `new_group` is collective over the whole world, and a rank that skipped a
call would hang a later collective without an error.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field

import torch.distributed as dist

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.topology import Layout

logger = logging.getLogger(__name__)


class LayoutDisagreement(RuntimeError):
    """Ranks about to build the groups of different layouts (one line: which ranks, what
    differs). Built anyway, `new_group`/`split_group` would receive different partitions and
    the run would hang until the collective timeout without a word."""


def layout_digest(layout: Layout) -> dict[str, str]:
    """What the ranks of one layout must agree on before building its groups."""
    plan = layout.plan
    return {
        "pipe_len": str(layout.pipe_len),
        "dp_degree": str(layout.dp_degree),
        "sharded": str(layout.sharded),
        "frozen_layers": str(plan.num_frozen_layers),
        "stage_units": str([list(r) for r in plan.stage_ranges]),
        "micro_batches": str(plan.num_micro_batches),
        "world": f"{layout.world_size}/{layout.devices_per_node}",
    }


def check_layouts_agree(control: Control, layout: Layout) -> None:
    """Compare every rank's digest of the layout it is entering (collective over the
    control group); raise LayoutDisagreement naming the ranks and what differs."""
    digests = control.all_gather(layout_digest(layout))
    differences = []
    for key in digests[0]:
        ranks_by_value: dict[str, list[int]] = {}
        for rank, digest in enumerate(digests):
            ranks_by_value.setdefault(digest[key], []).append(rank)
        if len(ranks_by_value) > 1:
            held = [f"{value} on rank(s) {_ranks(r)}" for value, r in ranks_by_value.items()]
            differences.append(f"{key} {' but '.join(held)}")
    if differences:
        raise LayoutDisagreement(
            "ranks disagree on the layout they enter, before building its groups: "
            + "; ".join(differences)
        )


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def create_control_group(timeout_s: float) -> dist.ProcessGroup:
    """The static world group for control messages; gloo whatever the training backend."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class TrainingGroups:
    """This rank's groups in one layout; `owned` holds every group it must destroy."""

    pipeline: dist.ProcessGroup | None
    data: dist.ProcessGroup | None
    owned: list[dist.ProcessGroup] = field(default_factory=list)

    def destroy(self) -> None:
        for group in self.owned:
            dist.destroy_process_group(group)
        self.owned.clear()
        self.pipeline = self.data = None


def group_partitions(layout: Layout) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of every pipeline group and of every data group of `layout` (pure). A
    pipeline of one stage still gets its one-rank group: a PipelineStage needs one."""
    pipelines = [layout.pipeline_ranks(replica) for replica in range(layout.dp_degree)]
    data = (
        [layout.data_ranks(stage) for stage in range(layout.pipe_len)]
        if layout.dp_degree > 1
        else []
    )
    return pipelines, data


def _splits_communicators() -> bool:
    """NCCL with a device bound at init (what init_distributed does) creates a group's
    communicator eagerly, by a split of the world's that every rank takes part in: one
    `split_group` per partition costs one such split, a `new_group` per group costs one each.
    gloo cannot split (no device); its new_group connects only the members."""
    default = dist.distributed_c10d._get_default_group()
    return dist.get_backend() == "nccl" and default.bound_device_id is not None


def _groups_of(
    partition: list[list[int]], rank: int, timeout: datetime.timedelta, owned: list
) -> dist.ProcessGroup | None:
    """This rank's group of `partition`, made collectively (every rank, same order)."""
    if not partition:
        return None
    if _splits_communicators():
        group = dist.split_group(split_ranks=partition, timeout=timeout)
        if isinstance(group, dist.ProcessGroup):
            owned.append(group)
            return group
        return None
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
            owned.append(group)
    return mine


def build_training_groups(layout: Layout, rank: int, timeout_s: float) -> TrainingGroups:
    """This rank's training groups of `layout` (collective: every rank, same calls, same
    order; two communicator splits on NCCL, one new_group per group on gloo)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    pipelines, data = group_partitions(layout)
    owned: list[dist.ProcessGroup] = []
    pipeline = _groups_of(pipelines, rank, timeout, owned)
    data_group = _groups_of(data, rank, timeout, owned)
    return TrainingGroups(pipeline=pipeline, data=data_group, owned=owned)
