"""Time spent on a device, measured where it is spent.

On CUDA kernels run asynchronously: a host clock around a step measures how long the host
took to enqueue it, and an NCCL future completes when the collective is enqueued, so a
host clock around an all-reduce reads about zero. `IntervalTimer` therefore marks intervals
with CUDA events on CUDA (recorded on the current stream, read only when `take` is called:
at log intervals, epoch ends and decision points, never per step, since reading waits for
the device) and with the host clock elsewhere.

`take` returns the length of the union of the intervals marked since the previous call:
intervals that overlap (DDP's buckets, each timed from the moment it is ready to the moment
its reduced gradients are back, queue behind one another on the communication stream)
count once, and gaps between them not at all, as the paper's Appendix F.4 measures DDP's
communication.

Owns: marks and their reading. Must not: decide what is timed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals, in the intervals' unit."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class IntervalTimer:
    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self._marked: list[tuple[object, object]] = []

    def mark(self) -> object:
        """A point in time on the device's current stream (on CUDA, an event recorded now)."""
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start: object, end: object) -> None:
        """Count the interval between two marks (read later, by `take`)."""
        self._marked.append((start, end))

    @property
    def pending(self) -> int:
        return len(self._marked)

    def take(self) -> float:
        """Seconds covered by the intervals added since the last call; resets. On CUDA this
        waits for the marked events."""
        marked, self._marked = self._marked, []
        if not marked:
            return 0.0
        if not self.on_cuda:
            return union_seconds(marked)
        reference = marked[0][0]
        for _, end in marked:
            end.synchronize()
        # elapsed_time is in milliseconds, relative to the first mark.
        positions = [(reference.elapsed_time(s), reference.elapsed_time(e)) for s, e in marked]
        return union_seconds(positions) / 1000.0
