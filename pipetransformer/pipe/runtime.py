"""Pipeline execution for one rank in one layout, over torch.distributed.pipelining.

Owns: the stage module (a UnitSequence of this stage's units), its DDP wrapper over the
data group (active parameters only), the PipelineStage with declared shapes and the
schedule for each sequence length a step brings, and the frozen prefix that the first
stage runs as input preprocessing.
Must not: create process groups, choose layouts or a batch's length (trainer/step.py does,
from the sample ids: every stage of a replica computes the same), or move state between
ranks.

Text of several lengths: a PipelineStage's receive buffers are sized from its declared
shapes the first time it runs, and a step of another shape fails (PYTORCH_NOTES.md). So a
pipeline of K > 1 stages keeps one PipelineStage and schedule per sequence length it has
met, built the first time a step brings that length (`PipelineSchedules`, around the same
DDP-wrapped module): the trainer rounds a text batch's length up to one of a few buckets
(utils/padding.py) for such layouts, every micro-batch of a step in its replica batch's
bucket. A one-stage layout (OneStageSchedule) and a sharded one take any length.

Facts this rests on (measured on torch 2.14; re-check them on another release): shapes are
declared, because DDP with inferred shapes crashes; the stage module handed to
PipelineStage *is* the DDP module, so the schedule syncs gradients once per step; DDP never
sees a frozen parameter; a stage with nothing to train is not wrapped in DDP. A pipeline of
one stage needs none of the pipelining machinery: `OneStageSchedule` runs it as DDP does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel

from pipetransformer.autopipe.planner import PipelinePlan
from pipetransformer.models.layered import ModelSpec, UnitSequence
from pipetransformer.pipe.timing import IntervalTimer

logger = logging.getLogger(__name__)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _examples(specs, batch_size: int, device, grad_first: bool) -> tuple[torch.Tensor, ...]:
    tensors = [s.example(batch_size, device) for s in specs]
    if grad_first:
        tensors[0].requires_grad_(True)
    return tuple(tensors)


class CommTimer:
    """A DDP communication hook that times each bucket's all-reduce (the paper's App. F.4
    method): from the bucket being ready to its reduced gradients being back, marked on the
    device (CUDA events on CUDA) into `timer`, which is read at log intervals."""

    def __init__(self, timer: IntervalTimer) -> None:
        self.timer = timer

    # No annotations: DDP inspects them, and postponed ones are strings it rejects.
    def hook(self, group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        start = self.timer.mark()
        future = allreduce_hook(group, bucket)

        def record(fut: torch.futures.Future) -> torch.Tensor:
            # On CUDA the callback's stream waits for the collective: the event marks its end.
            self.timer.add(start, self.timer.mark())
            return fut.value()

        return future.then(record)


class OneStageSchedule:
    """What ScheduleGPipe runs for a pipeline of one stage (plain data parallelism, the start of
    every run whose model fits a device), without its machinery: each micro-batch's forward,
    loss and backward in turn, DDP's all-reduce on the last one only (`no_sync` before it),
    the micro-batches' losses summed as GPipe sums them (`scale_grads=False`). The same
    operations in the same order, so the same gradients and random draws; each micro-batch's
    activations are freed before the next one's forward (GPipe holds all of them, which the
    memory model budgets). What it saves: the pytree splitting, shape checks and send/receive
    bookkeeping of a pipeline stage, about 1 ms a step of the quickstart's 13 ms on this CPU
    (benchmarks/step_profile.py). Same interface as the schedules it stands for."""

    def __init__(self, module: nn.Module, num_micro_batches: int, loss_fn: LossFn) -> None:
        self.module = module
        self.num_micro_batches = num_micro_batches
        self.loss_fn = loss_fn

    def _chunks(self, tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        split = [t.tensor_split(self.num_micro_batches) for t in tensors]
        return list(zip(*split))

    def step(
        self,
        *inputs: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
    ):
        outputs = []
        targets = target.tensor_split(self.num_micro_batches)
        last = self.num_micro_batches - 1
        ddp = isinstance(self.module, DistributedDataParallel)
        for index, chunk in enumerate(self._chunks(inputs)):
            with self.module.no_sync() if ddp and index < last else contextlib.nullcontext():
                output = self.module(*chunk)
                loss = self.loss_fn(output, targets[index])
                loss.backward()
            if losses is not None:
                losses.append(loss.detach())
            if return_outputs:
                outputs.append(_detached(output))
        return _merged(outputs) if return_outputs else None

    def eval(self, *inputs: torch.Tensor, target: torch.Tensor | None = None):
        return _merged([_detached(self.module(*chunk)) for chunk in self._chunks(inputs)])


def _detached(output):
    if isinstance(output, torch.Tensor):
        return output.detach()
    return tuple(t.detach() for t in output)


def _merged(outputs: list):
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs))


class MixedPrecisionStage(nn.Module):
    """The dtypes at a mixed-precision stage's edges (float32 weights, gradients and
    optimizer state; the autocast region itself is entered once per step by StageRuntime).

    Activations enter the units in float32, so the residual stream inside a stage is float32
    as in single-process autocast training; the hidden state leaving a stage is cast to the
    autocast dtype (half the bytes on the wire), the last stage's logits to float32 (the
    loss is computed in float32)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, is_last: bool) -> None:
        super().__init__()
        self.module = module
        self.output_dtype = torch.float32 if is_last else dtype

    def forward(self, *inputs: torch.Tensor):
        inputs = tuple(t.float() if t.is_floating_point() else t for t in inputs)
        out = self.module(*inputs)
        if isinstance(out, torch.Tensor):
            return out.to(self.output_dtype)
        return tuple(t.to(self.output_dtype) if t.is_floating_point() else t for t in out)


def boundary_specs(specs, dtype: torch.dtype | None):
    """Specs of what crosses a stage boundary: floating tensors in `dtype` when given."""
    if dtype is None:
        return specs
    return tuple(
        dataclasses.replace(s, dtype=dtype) if s.dtype.is_floating_point else s for s in specs
    )


@dataclass
class PipelineSchedules:
    """What `schedule_for(seq_length)` needs: one rank's stage of a K-stage pipeline (K > 1),
    its shapes following the model spec at a given length."""

    wrapped: nn.Module
    stage_index: int
    pipe_len: int
    unit_range: tuple[int, int]
    frozen_end: int
    spec: ModelSpec
    micro_batch_size: int
    num_micro_batches: int
    schedule_name: str
    loss_fn: LossFn
    pipeline_group: dist.ProcessGroup
    device: torch.device
    autocast_dtype: torch.dtype | None = None

    def schedule_for(self, seq_length: int | None) -> object:
        """A PipelineStage with the shapes of a batch of `seq_length` tokens (the spec's
        own for None) and its schedule: the stage and schedule for shape S, in one place
        (a rank with several stages builds them all here)."""
        spec = self.spec.at_length(seq_length)
        start, end = self.unit_range
        is_last = self.stage_index == self.pipe_len - 1
        # The hidden state carries gradients into a stage when a trained unit precedes it.
        input_specs = spec.unit_input_specs(start)
        input_args = _examples(
            boundary_specs(input_specs, self.autocast_dtype)
            if self.stage_index > 0
            else input_specs,
            self.micro_batch_size,
            self.device,
            grad_first=self.stage_index > 0 and self.frozen_end < start,
        )
        output_specs = spec.unit_output_specs(end - 1)
        output_args = _examples(
            output_specs if is_last else boundary_specs(output_specs, self.autocast_dtype),
            self.micro_batch_size,
            self.device,
            grad_first=self.frozen_end < end,
        )
        stage = PipelineStage(
            self.wrapped,
            self.stage_index,
            self.pipe_len,
            self.device,
            input_args=input_args,
            output_args=output_args,
            group=self.pipeline_group,
        )
        return SCHEDULES[self.schedule_name](
            stage, n_microbatches=self.num_micro_batches, loss_fn=self.loss_fn, scale_grads=False
        )


@dataclass
class StageRuntime:
    stage_index: int
    pipe_len: int
    module: UnitSequence
    wrapped: nn.Module
    device: torch.device
    # One stage: the OneStageSchedule every length runs; else how to build one per length.
    schedules: OneStageSchedule | PipelineSchedules
    preprocess: UnitSequence | None
    micro_batch_size: int
    num_micro_batches: int
    comm_timer: CommTimer | None = None
    autocast_dtype: torch.dtype | None = None
    # (split, sample ids, inputs, sequence length) -> the frozen prefix's output, served
    # from AutoCache.
    cached_prefix: Callable[..., tuple[torch.Tensor, ...]] | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.pipe_len - 1

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def schedule(self, seq_length: int | None = None) -> object:
        """The schedule of a step whose batch is `seq_length` tokens long (built the first
        time that length is met: module docstring)."""
        if isinstance(self.schedules, OneStageSchedule):
            return self.schedules
        if seq_length not in self._built:
            self._built[seq_length] = self.schedules.schedule_for(seq_length)
        return self._built[seq_length]

    @property
    def seq_lengths_built(self) -> list[int | None]:
        """The sequence lengths this rank's pipeline stage has been built for."""
        return list(self._built)

    def __post_init__(self) -> None:
        self._built: dict[int | None, object] = {}

    def _autocast(self):
        """One autocast region for a whole step: autocast caches the low-precision copy of
        each trained weight for the region, so every micro-batch's forward (and the graph
        it keeps for backward) shares one copy. Entered per micro-batch, each of the M
        micro-batches in flight held its own copy of the stage's weights."""
        return torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )

    def train_step(
        self,
        inputs: Sequence[torch.Tensor] | None,
        target: torch.Tensor | None,
        ids: Sequence[int] | None = None,
        seq_length: int | None = None,
    ) -> list[torch.Tensor]:
        """One optimizer step's forward and backward of a batch of `seq_length` tokens (every
        stage is told: only the first holds the inputs); returns the last stage's
        micro-batch losses."""
        if not self.module.training:  # an evaluation switched it (a walk of every module)
            self.module.train()
        losses: list[torch.Tensor] = []
        schedule = self.schedule(seq_length)
        if self.is_first:
            activations = self.run_prefix(inputs, ids, "train", seq_length)
            with self._autocast():
                schedule.step(*activations, target=target, losses=losses, return_outputs=False)
            return losses
        with self._autocast():
            if self.is_last:
                schedule.step(target=target, losses=losses, return_outputs=False)
            else:
                schedule.step()
        return losses

    def eval_step(
        self,
        inputs: Sequence[torch.Tensor] | None,
        target: torch.Tensor | None,
        ids: Sequence[int] | None = None,
        seq_length: int | None = None,
    ) -> torch.Tensor | None:
        """Forward only; returns the merged outputs on the last stage. Without gradients:
        the schedule's forward-only step builds an autograd graph otherwise, which the
        stage keeps (activations and all) until the next training step."""
        self.module.eval()
        schedule = self.schedule(seq_length)
        try:
            with torch.no_grad():
                if self.is_first:
                    activations = self.run_prefix(inputs, ids, "eval", seq_length)
                    with self._autocast():
                        return schedule.eval(*activations, target=target)
                with self._autocast():
                    if self.is_last:
                        return schedule.eval(target=target)
                    schedule.eval()
                return None
        finally:
            self.module.train()

    def run_prefix(
        self,
        inputs: Sequence[torch.Tensor] | None,
        ids: Sequence[int] | None = None,
        split: str = "train",
        seq_length: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The frozen prefix's output (computed, or served by AutoCache), in float32: what
        stage 0 takes in."""
        return prefix_output(
            self.preprocess, self.cached_prefix, self._autocast(), inputs, ids, split, seq_length
        )


def prefix_output(
    preprocess: UnitSequence | None,
    cached_prefix: Callable | None,
    autocast,
    inputs: Sequence[torch.Tensor] | None,
    ids: Sequence[int] | None,
    split: str,
    seq_length: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """The frozen prefix's output for `inputs` (samples `ids` of `split`, a batch of
    `seq_length` tokens): read from AutoCache when `cached_prefix` serves, computed without
    autograd otherwise (under `autocast`, the step's region), in float32; the inputs
    themselves when nothing is frozen. Shared by the pipeline's first stage and the sharded
    layout's every rank (fsdp/runtime.py)."""
    if preprocess is None:
        return tuple(inputs)
    with autocast:
        if cached_prefix is not None and ids is not None:
            out = cached_prefix(split, ids, inputs, seq_length)
        else:
            with torch.no_grad():
                out = preprocess(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    return tuple(t.float() if t.is_floating_point() else t for t in out)


def build_stage_runtime(
    *,
    plan: PipelinePlan,
    stage_index: int,
    replica_batch_size: int,
    units: dict[int, nn.Module],
    spec: ModelSpec,
    loss_fn: LossFn,
    schedule_name: str,
    pipeline_group: dist.ProcessGroup,
    data_group: dist.ProcessGroup | None,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    comm_timer: IntervalTimer | None = None,
) -> StageRuntime:
    """`comm_timer`: where DDP's all-reduce intervals are marked (when the stage runs DDP)."""
    frozen_end = plan.frozen_end
    start, end = plan.stage_ranges[stage_index]
    stage_units = list(range(start, end))
    module = UnitSequence([units[u] for u in stage_units], [u < frozen_end for u in stage_units])
    # Units come in whatever mode they were left in (the profiler measures them in eval
    # mode); train_step sets the mode only when an evaluation changed it.
    module.train()
    preprocess = None
    if stage_index == 0 and plan.prefix_end > 0:
        prefix = list(range(plan.prefix_end))
        preprocess = UnitSequence([units[u] for u in prefix], [True] * len(prefix))

    replica_batch = replica_batch_size
    num_micro_batches = plan.num_micro_batches
    if replica_batch % num_micro_batches:
        raise ValueError(
            f"{num_micro_batches} micro-batches do not divide the replica batch {replica_batch}"
        )
    micro = replica_batch // num_micro_batches

    is_last = stage_index == plan.pipe_len - 1
    wrapped: nn.Module = module
    if autocast_dtype is not None:
        wrapped = MixedPrecisionStage(module, autocast_dtype, is_last)
    hook = None
    trainable = any(p.requires_grad for p in module.parameters())
    if data_group is not None and trainable:
        wrapped = DistributedDataParallel(
            wrapped,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=data_group,
            forward_sync_buffers=False,
            init_sync=False,  # replicas already hold identical weights (handoff is bit-exact)
            # Gradients are views into the all-reduce buckets: no second copy of them.
            gradient_as_bucket_view=True,
        )
        if comm_timer is not None:
            hook = CommTimer(comm_timer)
            wrapped.register_comm_hook(data_group, hook.hook)
    if plan.pipe_len == 1:
        schedules = OneStageSchedule(wrapped, num_micro_batches, loss_fn)
    else:
        schedules = PipelineSchedules(
            wrapped=wrapped,
            stage_index=stage_index,
            pipe_len=plan.pipe_len,
            unit_range=(start, end),
            frozen_end=frozen_end,
            spec=spec,
            micro_batch_size=micro,
            num_micro_batches=num_micro_batches,
            schedule_name=schedule_name,
            loss_fn=loss_fn,
            pipeline_group=pipeline_group,
            device=device,
            autocast_dtype=autocast_dtype,
        )
    return StageRuntime(
        stage_index,
        plan.pipe_len,
        module,
        wrapped,
        device,
        schedules,
        preprocess,
        micro,
        num_micro_batches,
        hook,
        autocast_dtype=autocast_dtype,
    )
