"""The data-parallel all-reduce of a rank's gradients, where DDP cannot do it (zero bubble).

torch's zero-bubble schedules (ScheduleInterleavedZeroBubble, torch 2.14) split a chunk's
backward into the input gradient (I) and the weight gradient (W), both through
`torch.autograd.grad` (pipelining/_backward.py `stage_backward_input`,
`stage_backward_weight`), which writes `param.grad` itself: the AccumulateGrad hooks that DDP's
reducer counts never fire. The stage still tells a DDP module that its last W is coming
(`prepare_for_backward`), so DDP would wait for a reduction that never happens ("Expected to
have finished reduction in the prior iteration") and the replicas' gradients would never be
averaged. Only the first chunk's W is a full `autograd.backward` (stage.py
`backward_weight_one_chunk`), which DDP would see. So under zero_bubble no chunk is wrapped in
DDP and the rank averages the gradients of every chunk it holds itself, over the stage's data
group, as DDP's default hook averages (each gradient divided by R, then summed). The same for
every rank of the data group (the same stage of every replica: the same chunks, the same
trained parameters in the same order, the same schedule), so the collective order is the same
everywhere. Every trained parameter takes part, one without a gradient on this rank as zeros,
and every one leaves with the average: were a rank to leave out a parameter another includes,
the flat buffers would differ in size (NCCL hangs or reduces the wrong bytes) and the
replicas' weights would drift apart. DDP (without `find_unused_parameters`) refuses a trained
parameter without a gradient; here it counts as zero on that replica, as one that the whole
batch left untouched would under one process.

When: each chunk's all-reduce starts as soon as torch's schedule has run that chunk's last
weight gradient (its REDUCE_GRAD action calls the stage's `perform_reduce_grad`, which
`ReducingStage` in pipe/runtime.py passes on to `chunk_done`), asynchronously, while the
rank's other chunks still compute; the step waits for every chunk at its end (`__call__`).
Where: a chunk's trained gradients live in one flat buffer per dtype, allocated once per
layout; before a step (`prepare`) every trained parameter's `.grad` is set to its view of it
(zeroed where the gradient was None, holding it where a gradient had accumulated: a step
adds to .grad as a backward does), so the weight-gradient steps (`weight.grad += dw`) and
autograd's accumulation write straight into the buffer, which is reduced in place: no
flattening copy before the all-reduce and none back after it (the buffer is the
gradients).

Owns: that all-reduce. Must not: create groups or decide when a layout needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.pipe.timing import IntervalTimer


class _Bucket:
    """One chunk's trained parameters of one dtype and the flat buffer their gradients are
    views of."""

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.parameters = parameters
        first = parameters[0]
        total = sum(p.numel() for p in parameters)
        self.flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in parameters:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def attach(self) -> None:
        """Every parameter's gradient as its view of the buffer, holding what the gradient
        held: zeros where it was None (the optimizer's zero_grad), what it had accumulated
        otherwise (a backward adds to .grad, it does not replace it)."""
        self.gather()

    def gather(self) -> None:
        """The buffer holds every gradient: one set to None since counts as zero, one that
        something replaced (not accumulated into the view) is copied in."""
        for p, view in zip(self.parameters, self.views):
            if p.grad is view:
                continue
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view


class GradientAllReduce:
    """Averages the trained gradients of a rank's chunks over `group`: `prepare()` before the
    step, `chunk_done(c)` when chunk c's gradients are final, and the call after the step
    (reduces what no `chunk_done` started, then waits for every chunk)."""

    def __init__(
        self,
        chunks: Mapping[int, Sequence[nn.Parameter]] | Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        timer: IntervalTimer | None = None,
    ) -> None:
        """`chunks`: chunk index -> its parameters (a plain sequence: one chunk, index 0)."""
        if not isinstance(chunks, Mapping):
            chunks = {0: chunks}
        self.buckets: dict[int, list[_Bucket]] = {}
        for chunk, parameters in chunks.items():
            trained = [p for p in parameters if p.requires_grad]
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in trained:
                by_dtype.setdefault(p.dtype, []).append(p)
            if by_dtype:
                self.buckets[chunk] = [_Bucket(ps) for ps in by_dtype.values()]
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.timer = timer  # marks each chunk's all-reduce as DDP's communication hook a bucket
        self._pending: dict[int, tuple[list, object]] = {}  # chunk -> (works, start mark)

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for buckets in self.buckets.values() for b in buckets for p in b.parameters]

    def prepare(self) -> None:
        """Before a step: each trained gradient a view of its chunk's buffer (`_Bucket.attach`)."""
        for buckets in self.buckets.values():
            for bucket in buckets:
                bucket.attach()

    def chunk_done(self, chunk: int) -> None:
        """Chunk `chunk`'s gradients are final for this step: start averaging them."""
        if chunk not in self.buckets or chunk in self._pending:
            return
        start = self.timer.mark() if self.timer is not None else None
        works = []
        for bucket in self.buckets[chunk]:
            bucket.gather()
            bucket.flat.div_(self.replicas)
            works.append(dist.all_reduce(bucket.flat, group=self.group, async_op=True))
        self._pending[chunk] = (works, start)

    def __call__(self) -> None:
        """After the step: every chunk averaged (the order of the chunks' all-reduces is the
        schedule's, the same on every rank of the group), waited for."""
        for chunk in self.buckets:
            self.chunk_done(chunk)
        pending, self._pending = self._pending, {}
        for works, _ in pending.values():
            for work in works:
                work.wait()
        if self.timer is not None:
            end = self.timer.mark()
            for _, start in pending.values():
                self.timer.add(start, end)
