"""The control group's collectives, in one small object: how ranks agree on numbers.

Every rank calls the same methods in the same order (they are collectives over the static
gloo world group). Values travel as float64 or int64 CPU tensors whatever device they come
from: the control group is gloo, and a device value read here is a host synchronisation,
so call these at log intervals, epoch ends and decision points, never per step.

`Control(None)` is a world of one process (no torch.distributed): every reduction returns
its input. Planning and profiling code is tested that way without starting processes.

Owns: the reductions, agreement checks and object exchange. Must not: create groups
(autodp/groups.py does) or know what the numbers mean.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class Control:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def _reduce(self, values: torch.Tensor | Sequence[float], op) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            dtype = torch.int64 if not values.is_floating_point() else torch.float64
            tensor = values.detach().to("cpu", dtype, copy=True).reshape(-1)
        else:
            tensor = torch.tensor(list(values), dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_sum(self, values: torch.Tensor | Sequence[float]) -> torch.Tensor:
        """Element-wise sum over the ranks, as a flat CPU tensor (float64 for floats)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def all_max(self, values: torch.Tensor | Sequence[float]) -> torch.Tensor:
        """Element-wise maximum over the ranks (the slowest rank's time, a signal any got)."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def all_min(self, values: torch.Tensor | Sequence[float]) -> torch.Tensor:
        """Element-wise minimum over the ranks (what every rank's device can hold)."""
        return self._reduce(values, dist.ReduceOp.MIN)

    def sum(self, value: float | torch.Tensor) -> float:
        """One number summed over the ranks."""
        return float(self.all_sum(value if isinstance(value, torch.Tensor) else [value])[0])

    def agree(self, value: int, what: str) -> int:
        """Check that every rank holds the same `value`; RuntimeError naming `what` if not."""
        both = self.all_max(torch.tensor([value, -value], dtype=torch.int64))
        high, low = int(both[0]), -int(both[1])
        if high != value or low != value:
            raise RuntimeError(f"ranks disagree on {what}: {value} here, max {high}, min {low}")
        return value

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """`value` of rank `src` on every rank (picklable objects)."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order."""
        if self.group is None:
            return [value]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def failures(self, failure: str | None, timeout_s: float) -> list[tuple[int, str]]:
        """Wait up to `timeout_s` for every rank to get here (gloo's monitored barrier: longer
        than the group's own timeout, for work as long as compiling a layout), then every
        rank's `failure` that is not None, as (rank, reason) in rank order."""
        if self.group is not None:
            timeout = datetime.timedelta(seconds=timeout_s)
            dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)
        reasons = self.all_gather(failure)
        return [(rank, reason) for rank, reason in enumerate(reasons) if reason is not None]
