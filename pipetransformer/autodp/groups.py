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

from pipetransformer.autodp.topology import Layout

logger = logging.getLogger(__name__)


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


def build_training_groups(layout: Layout, rank: int, timeout_s: float) -> TrainingGroups:
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = TrainingGroups(pipeline=None, data=None)
    for replica in range(layout.dp_degree):
        ranks = layout.pipeline_ranks(replica)
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            groups.pipeline = group
            groups.owned.append(group)
    if layout.dp_degree > 1:
        for stage in range(layout.pipe_len):
            ranks = layout.data_ranks(stage)
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups.data = group
                groups.owned.append(group)
    return groups
