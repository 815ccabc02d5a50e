"""Pipeline execution for one rank in one layout, over torch.distributed.pipelining.

Owns: the stage module (a UnitSequence of this stage's units; under interleaved_1f1b and
zero_bubble one per chunk the rank holds), its DDP wrapper over the data group (active
parameters only; per chunk), the PipelineStage(s) with declared shapes and the schedule for
each sequence length a step brings (`PipelineSchedules.schedule_for`: a stage per chunk and
torch's multi-stage schedule where a rank holds several), and the frozen prefix that the
first stage runs as input preprocessing.
Must not: create process groups, choose layouts or a batch's length (trainer/step.py does,
from the sample ids: every stage of a replica computes the same), or move state between
ranks.

Text of several lengths: a PipelineStage's receive buffers are sized from its declared
shapes the first time it runs, and a step of another shape fails (docs/pytorch.md). So a
pipeline of K > 1 stages keeps one PipelineStage and schedule per sequence length it has
met, built the first time a step brings that length (`PipelineSchedules`, around the same
DDP-wrapped module): the trainer rounds a text batch's length up to one of a few buckets
(utils/padding.py) for such layouts, every micro-batch of a step in its replica batch's
bucket. A packed batch (data.padding packed) is one `PackedShape` a step, its rows and
their length in buckets, and a stage and schedule per shape alike: its micro-batches carry
rows where they carried samples, and the last stage's outputs one row a sample. A one-stage
layout (OneStageSchedule) and a sharded one take any length.

Evaluation has stages and a schedule of its own per length, built at the first evaluation
of that length. torch's schedule re-initialises its stages whenever it switches between
`eval` and `step` (`_initialize_pp_stages`: `has_backward` changed): the warm-up vote (an
int32 send and receive and a `.item()`), the receive buffers allocated again, the backward
metadata inferred again, at the first training step after every evaluation. Apart, each
schedule initialises once; the evaluation's stages hold input buffers without gradients
(autopipe/memory.py counts them).

Facts this rests on (measured on torch 2.14; re-check them on another release): shapes are
declared, because DDP with inferred shapes crashes; the stage module handed to
PipelineStage *is* the DDP module, so the schedule syncs gradients once per step; DDP never
sees a frozen parameter; a stage with nothing to train is not wrapped in DDP. A pipeline of
one stage needs none of the pipelining machinery: `OneStageSchedule` runs it as DDP does.
Zero bubble's split backward writes the weight gradients past DDP's hooks, so its chunks are
not wrapped in DDP and the rank averages their gradients itself, each chunk's as soon as its
last weight gradient is done (`ReducingStage`, pipe/gradient_sync.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from pipetransformer.autopipe.planner import PipelinePlan
from pipetransformer.config import (
    SCHEDULE_PROPERTIES,
    SPLIT_BACKWARD_SCHEDULES,
    layout_schedule,
    split_backward_compile_problem,
)
from pipetransformer.models.compiled import is_compiled
from pipetransformer.models.layered import ModelSpec, UnitSequence
from pipetransformer.pipe.gradient_sync import GradientAllReduce
from pipetransformer.pipe.timing import IntervalTimer
from pipetransformer.utils.padding import PackedShape

logger = logging.getLogger(__name__)


def torch_schedule_class(name: str) -> type:
    """torch's class for what a layout runs (config/schedules.py `layout_schedule`): the
    multi-chunk ones take the list of the rank's chunks (PipelineScheduleMulti), the others
    its one stage."""
    return getattr(pipelining, SCHEDULE_PROPERTIES[name].torch_class)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _examples(
    specs, batch_size: int, device, grad_first: bool, rows: int | None = None
) -> tuple[torch.Tensor, ...]:
    tensors = [s.example(batch_size, device, rows) for s in specs]
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


@dataclass(frozen=True)
class Chunk:
    """One PipelineStage of a rank: chunk `index` of the pipeline (torch's stage_index; the
    rank's stage itself under gpipe and 1f1b), its units [start, end), and its module as the
    schedule drives it (mixed-precision edges, DDP)."""

    index: int
    unit_range: tuple[int, int]
    wrapped: nn.Module


class ReducingStage(PipelineStage):
    """A PipelineStage that says when its chunk's gradients are final: torch's split-backward
    schedules run a REDUCE_GRAD action for a chunk right after its last weight gradient
    (schedules.py `_add_reduce_grad`), calling `perform_reduce_grad`; zero bubble's
    all-reduce of that chunk starts there (pipe/gradient_sync.py), while the rank's other
    chunks still compute."""

    def __init__(self, *args, on_gradients_final: Callable[[int], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_gradients_final = on_gradients_final

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        super().perform_reduce_grad(grad_scale_factor)
        if self.has_backward:  # an evaluation runs the action too
            self.on_gradients_final(self.stage_index)


@dataclass
class PipelineSchedules:
    """What `schedule_for(seq_length)` needs: one rank's chunks of a pipeline of K > 1
    stages (one chunk under gpipe and 1f1b, v under interleaved_1f1b and zero_bubble, of
    `num_chunks` = K v in all), their shapes following the model spec at a given length."""

    chunks: tuple[Chunk, ...]
    num_chunks: int
    frozen_end: int
    spec: ModelSpec
    micro_batch_size: int
    num_micro_batches: int
    schedule_name: str  # what the layout runs (config/schedules.py `layout_schedule`)
    loss_fn: LossFn
    pipeline_group: dist.ProcessGroup
    device: torch.device
    autocast_dtype: torch.dtype | None = None
    # Zero bubble's per-chunk all-reduce, started when a chunk's gradients are final.
    gradient_sync: GradientAllReduce | None = None

    def schedule_for(self, seq_length: int | PackedShape | None) -> object:
        """A PipelineStage for each of the rank's chunks with the shapes of a batch of
        `seq_length` tokens (the spec's own for None; a packed batch's shape), and their
        schedule: the stages and schedule for shape S, in one place."""
        spec = self.spec.at_length(seq_length)
        rows = seq_length.rows if isinstance(seq_length, PackedShape) else None
        stages = [self._stage(chunk, spec, rows) for chunk in self.chunks]
        schedule = torch_schedule_class(self.schedule_name)
        if SCHEDULE_PROPERTIES[self.schedule_name].multi_chunk:  # torch's PipelineScheduleMulti
            return schedule(
                stages,
                n_microbatches=self.num_micro_batches,
                loss_fn=self.loss_fn,
                scale_grads=False,
            )
        (stage,) = stages
        return schedule(
            stage, n_microbatches=self.num_micro_batches, loss_fn=self.loss_fn, scale_grads=False
        )

    def _stage(self, chunk: Chunk, spec: ModelSpec, rows: int | None) -> PipelineStage:
        start, end = chunk.unit_range
        is_first = chunk.index == 0
        is_last = chunk.index == self.num_chunks - 1
        # The hidden state carries gradients into a chunk when a trained unit precedes it.
        input_specs = spec.unit_input_specs(start)
        input_args = _examples(
            input_specs if is_first else boundary_specs(input_specs, self.autocast_dtype),
            self.micro_batch_size,
            self.device,
            grad_first=not is_first and self.frozen_end < start,
            rows=rows,
        )
        output_specs = spec.unit_output_specs(end - 1)
        output_args = _examples(
            output_specs if is_last else boundary_specs(output_specs, self.autocast_dtype),
            self.micro_batch_size,
            self.device,
            grad_first=self.frozen_end < end,
            rows=rows,
        )
        # Under zero_bubble, torch's input-gradient step (I) finds the weights through the
        # graph from the chunk's inputs: a chunk after the first whose input carries no
        # gradient (frozen units inside the pipeline: autopipe.enabled false) would get no
        # weight gradients at all. Nothing upstream waits for such a chunk's input gradient,
        # so its whole backward runs at I and its W does nothing (torch's `dw_builder`).
        whole_backward = (
            self.schedule_name in SPLIT_BACKWARD_SCHEDULES
            and not is_first
            and self.frozen_end >= start
        )
        stage_class, extra = PipelineStage, {}
        if self.gradient_sync is not None:
            stage_class = ReducingStage
            extra = {"on_gradients_final": self.gradient_sync.chunk_done}
        return stage_class(
            chunk.wrapped,
            chunk.index,
            self.num_chunks,
            self.device,
            input_args=input_args,
            output_args=output_args,
            group=self.pipeline_group,
            dw_builder=(lambda: _nothing) if whole_backward else None,
            **extra,
        )


def _nothing() -> None:
    """A weight-gradient step with nothing left to do (the backward ran whole)."""


@dataclass
class StageRuntime:
    stage_index: int
    pipe_len: int
    # The stage's units: a UnitSequence, or under interleaved_1f1b and zero_bubble a ModuleList
    # of one UnitSequence per chunk (`wrapped` alike), in pipeline order.
    module: nn.Module
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
    # The replicas' gradients averaged after the step, where DDP cannot do it (zero_bubble).
    gradient_sync: GradientAllReduce | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.pipe_len - 1

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def schedule(
        self, seq_length: int | PackedShape | None = None, training: bool = True
    ) -> object:
        """The schedule of a training step (or with `training` false an evaluation) whose
        batch is `seq_length` tokens long (a packed batch's shape), built the first time
        that shape is met for it (module docstring)."""
        if isinstance(self.schedules, OneStageSchedule):
            return self.schedules
        built = self._built if training else self._built_eval
        if seq_length not in built:
            built[seq_length] = self.schedules.schedule_for(seq_length)
        return built[seq_length]

    @property
    def seq_lengths_built(self) -> list[int | PackedShape | None]:
        """The sequence lengths this rank's pipeline stage has been built for (training)."""
        return list(self._built)

    def __post_init__(self) -> None:
        self._built: dict[int | PackedShape | None, object] = {}
        self._built_eval: dict[int | PackedShape | None, object] = {}

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
        seq_length: int | PackedShape | None = None,
    ) -> list[torch.Tensor]:
        """One optimizer step's forward and backward of a batch of `seq_length` tokens (every
        stage is told: only the first holds the inputs); returns the last stage's
        micro-batch losses."""
        if not self.module.training:  # an evaluation switched it (a walk of every module)
            self.module.train()
        losses: list[torch.Tensor] = []
        schedule = self.schedule(seq_length)
        if self.gradient_sync is not None:
            self.gradient_sync.prepare()
        if self.is_first:
            activations = self.run_prefix(inputs, ids, "train", seq_length)
            with self._autocast():
                schedule.step(*activations, target=target, losses=losses, return_outputs=False)
        else:
            with self._autocast():
                if self.is_last:
                    schedule.step(target=target, losses=losses, return_outputs=False)
                else:
                    schedule.step()
        if self.gradient_sync is not None:
            self.gradient_sync()
        return losses

    def eval_step(
        self,
        inputs: Sequence[torch.Tensor] | None,
        target: torch.Tensor | None,
        ids: Sequence[int] | None = None,
        seq_length: int | PackedShape | None = None,
    ) -> torch.Tensor | None:
        """Forward only; returns the merged outputs on the last stage. Without gradients:
        the schedule's forward-only step builds an autograd graph otherwise, which the
        stage keeps (activations and all) until the next training step."""
        self.module.eval()
        schedule = self.schedule(seq_length, training=False)
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
        seq_length: int | PackedShape | None = None,
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
    seq_length: int | PackedShape | None = None,
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


def wrap_chunk(
    module: nn.Module,
    autocast_dtype: torch.dtype | None,
    is_last: bool,
    data_group: dist.ProcessGroup | None,
    device: torch.device,
    hook: CommTimer | None,
) -> nn.Module:
    """What the schedule drives for one chunk: its mixed-precision edges, then DDP over the
    data group when one is given (R > 1) and the chunk trains. The DDP module is the module
    the PipelineStage holds, so the schedule syncs it once per step (docs/pytorch.md)."""
    wrapped = module
    if autocast_dtype is not None:
        wrapped = MixedPrecisionStage(module, autocast_dtype, is_last)
    trainable = any(p.requires_grad for p in module.parameters())
    if data_group is not None and trainable:
        wrapped = DistributedDataParallel(
            wrapped,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=data_group,
            forward_sync_buffers=False,
            init_sync=False,  # replicas already hold identical weights (handoff is bit-exact)
            # After each backward the gradients are views into the all-reduce buckets, so no
            # second copy of them is held between steps. Not copy-free: the optimizer step
            # sets them to None (trainer/step.py), so each backward makes a fresh gradient
            # and the reducer copies it into its bucket once (`zero_grad(set_to_none=False)`
            # would accumulate into the bucket views instead, for a memset a step: to be
            # measured on a GPU, docs/gpus.md).
            gradient_as_bucket_view=True,
        )
        if hook is not None:
            wrapped.register_comm_hook(data_group, hook.hook)
    return wrapped


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
    activation_checkpointing: bool = False,
) -> StageRuntime:
    """`schedule_name`: pipeline.schedule (the layout runs `layout_schedule` of it);
    `comm_timer`: where the data group's all-reduce intervals are marked (DDP's, or the
    GradientAllReduce's under zero_bubble); `activation_checkpointing`: the trained units
    recompute their forward in the backward (models/layered.py UnitSequence)."""
    frozen_end = plan.frozen_end
    runs = layout_schedule(schedule_name, plan.pipe_len, plan.virtual_stages)
    chunk_ids = plan.chunks_of_stage(stage_index)
    modules = []
    for chunk in chunk_ids:
        start, end = plan.stage_ranges[chunk]
        chunk_units = list(range(start, end))
        modules.append(
            UnitSequence(
                [units[u] for u in chunk_units],
                [u < frozen_end for u in chunk_units],
                checkpoint=activation_checkpointing,
            )
        )
    module: nn.Module = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
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

    if runs in SPLIT_BACKWARD_SCHEDULES and any(is_compiled(m) for m in modules):
        raise ValueError(f"trainer.compile: {split_backward_compile_problem(runs)}")
    by_hand = runs in SPLIT_BACKWARD_SCHEDULES and data_group is not None
    hook = CommTimer(comm_timer) if comm_timer is not None and not by_hand else None
    wrapped = [
        wrap_chunk(
            m,
            autocast_dtype,
            chunk == plan.num_chunks - 1,
            None if by_hand else data_group,
            device,
            hook,
        )
        for chunk, m in zip(chunk_ids, modules)
    ]
    if not any(isinstance(w, DistributedDataParallel) for w in wrapped):
        hook = None  # nothing this stage runs is timed by it
    gradient_sync = None
    if by_hand and any(p.requires_grad for p in module.parameters()):
        chunks = {c: list(m.parameters()) for c, m in zip(chunk_ids, modules)}
        gradient_sync = GradientAllReduce(chunks, data_group, comm_timer)
    if runs is None:
        schedules = OneStageSchedule(wrapped[0], num_micro_batches, loss_fn)
    else:
        schedules = PipelineSchedules(
            chunks=tuple(Chunk(c, plan.stage_ranges[c], w) for c, w in zip(chunk_ids, wrapped)),
            num_chunks=plan.num_chunks,
            frozen_end=frozen_end,
            spec=spec,
            micro_batch_size=micro,
            num_micro_batches=num_micro_batches,
            schedule_name=runs,
            loss_fn=loss_fn,
            pipeline_group=pipeline_group,
            device=device,
            autocast_dtype=autocast_dtype,
            gradient_sync=gradient_sync,
        )
    return StageRuntime(
        stage_index,
        plan.pipe_len,
        module,
        wrapped[0] if len(wrapped) == 1 else nn.ModuleList(wrapped),
        device,
        schedules,
        preprocess,
        micro,
        num_micro_batches,
        hook,
        autocast_dtype=autocast_dtype,
        gradient_sync=gradient_sync,
    )
