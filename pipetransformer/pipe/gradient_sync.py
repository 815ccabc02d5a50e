"""The data-parallel all-reduce of a rank's gradients, once per step, where DDP cannot do it.

torch's zero-bubble schedules (ScheduleInterleavedZeroBubble, torch 2.14) split a chunk's
backward into the input gradient (I) and the weight gradient (W), both through
`torch.autograd.grad` (pipelining/_backward.py `stage_backward_input`,
`stage_backward_weight`), which writes `param.grad` itself: the AccumulateGrad hooks that DDP's
reducer counts never fire. The stage still tells a DDP module that its last W is coming
(`prepare_for_backward`), so DDP would wait for a reduction that never happens ("Expected to
have finished reduction in the prior iteration") and the replicas' gradients would never be
averaged. Only the first chunk's W is a full `autograd.backward` (stage.py
`backward_weight_one_chunk`), which DDP would see. So under zero_bubble no chunk is wrapped in
DDP and the rank averages the gradients of every chunk it holds here after the schedule's
step, over the stage's data group: one flat buffer, one all-reduce, as DDP's default hook
averages (each gradient divided by R, then summed). The same for every rank of the data group
(the same stage of every replica: the same chunks, the same trained parameters in the same
order), so the collective order is the same everywhere. Every trained parameter takes part,
one without a gradient on this rank as zeros, and every one leaves with the average: were a
rank to leave out a parameter another includes, the flat buffers would differ in size (NCCL
hangs or reduces the wrong bytes) and the replicas' weights would drift apart. DDP (without
`find_unused_parameters`) refuses a trained parameter without a gradient; here it counts as
zero on that replica, as one that the whole batch left untouched would under one process.

Owns: that all-reduce. Must not: create groups or decide when a layout needs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.pipe.timing import IntervalTimer


class GradientAllReduce:
    """Averages `parameters`' gradients over `group` (call once per step, after backward)."""

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        timer: IntervalTimer | None = None,
    ) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.timer = timer  # marks the all-reduce as DDP's communication hook marks a bucket

    def __call__(self) -> None:
        if not self.parameters:
            return
        for p in self.parameters:
            if p.grad is None:  # none on this replica: zeros, so every rank sends the same bytes
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.parameters]
        start = self.timer.mark() if self.timer is not None else None
        flat = torch._utils._flatten_dense_tensors(grads)
        flat.div_(self.replicas)
        dist.all_reduce(flat, group=self.group)
        torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))
        if self.timer is not None:
            self.timer.add(start, self.timer.mark())
