"""A sharded layout's step for one rank: FSDP2 (`torch.distributed.fsdp.fully_shard`) over
the trained units, the frozen prefix in front of it as input preprocessing.

Every rank of the world runs the whole model on its replica's batch (one stage, the same
roles as a one-stage pipeline layout, so data, targets and evaluation are unchanged). The
trained units are sharded over the data group (every rank): each layer's two sublayers form
one FSDP2 group, as do the embedding and the head alone (`shard_groups`), with a root over
them all. A layer is what torchtitan shards and what the freeze algorithm freezes, so a
group is always wholly trained or wholly frozen, and one all-gather and one reduce-scatter
per layer keep the collectives few (a group per sublayer would double them for half the
buffer). Groups reshard after forward (their parameters are gathered again in backward),
except the head's, whose backward follows at once.

The frozen prefix is not sharded: the transition that froze it gathered it once
(fsdp/state.py), every rank holds it in full without gradients or optimizer state and runs
it, or reads its output from AutoCache, exactly as a pipeline's first stage does
(pipe/runtime.py `prefix_output`). Its parameters are never gathered again.

Precision (`gather_policy`): under `trainer.precision: bf16` the step runs in one autocast
region, as the pipeline's stages do. On CUDA, FSDP2 gathers bfloat16 copies of the float32
shards (`MixedPrecisionPolicy(param_dtype=bfloat16)`, as torchtitan does) and reduces the
gradients in float32: half the bytes of a float32 gather, and the gathered layer is the
copy autograd saves, freed when the layer reshards (a float32 gather left autocast a full
bfloat16 copy of every resharded layer, held from its forward to its backward). Each group
receives its input as it comes (`cast_forward_inputs=False`): the hidden state between
layers stays the float32 residual stream a pipeline stage or DDP keeps under autocast
(FSDP2's default casts every group's input to `param_dtype`, which rounded the whole stream
to bfloat16, so a DDP <-> sharded transition changed the numbers). CUDA autocast runs layer
norm in float32 whatever its inputs' and weights' dtype. On the CPU FSDP2 gathers float32:
CPU autocast's layer norm refuses bfloat16 weights under the float32 residual stream
("mixed dtype (CPU): expect parameter to have scalar type of Float", torch 2.14).

Owns: `ShardedRuntime`, `build_sharded_runtime`, `gather_policy`. Must not: create process
groups, choose layouts, or move state between ranks (fsdp/state.py converts it; the
trainer moves it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from pipetransformer.autopipe.memory import shard_groups
from pipetransformer.autopipe.planner import PipelinePlan
from pipetransformer.fsdp.state import CARRIED, carried_shards, local
from pipetransformer.models.layered import UnitSequence
from pipetransformer.pipe.runtime import prefix_output
from pipetransformer.utils.padding import PackedShape

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ShardedRuntime:
    """StageRuntime's interface for a sharded layout: every rank is stage 0 and the last."""

    module: nn.Module  # the FSDP2 root over the trained units
    preprocess: UnitSequence | None
    loss_fn: LossFn
    data_group: dist.ProcessGroup
    device: torch.device
    micro_batch_size: int
    num_micro_batches: int = 1
    autocast_dtype: torch.dtype | None = None
    # (split, sample ids, inputs, sequence length) -> the frozen prefix's output, served
    # from AutoCache.
    cached_prefix: Callable[..., tuple[torch.Tensor, ...]] | None = None
    stage_index: int = 0
    pipe_len: int = 1
    comm_timer: None = None  # FSDP2's collectives are not timed (DDP's all-reduce is)

    is_first = True
    is_last = True

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _autocast(self):
        return torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )

    def run_prefix(
        self,
        inputs: Sequence[torch.Tensor] | None,
        ids: Sequence[int] | None = None,
        split: str = "train",
        seq_length: int | PackedShape | None = None,
    ) -> tuple[torch.Tensor, ...]:
        return prefix_output(
            self.preprocess, self.cached_prefix, self._autocast(), inputs, ids, split, seq_length
        )

    def _micro_batches(self, *tensors: torch.Tensor):
        """M pieces of every tensor, zipped: a packed batch's rows and its sample starts
        alike; always M, so every rank makes the same forward calls (each one FSDP2's
        all-gathers) whatever its batch's rows."""
        return zip(*(t.tensor_split(self.num_micro_batches) for t in tensors))

    def train_step(
        self,
        inputs: Sequence[torch.Tensor] | None,
        target: torch.Tensor | None,
        ids: Sequence[int] | None = None,
        seq_length: int | PackedShape | None = None,
    ) -> list[torch.Tensor]:
        """Forward and backward of the replica batch (of any sequence length: `seq_length`
        only tells AutoCache the batch's), micro-batch after micro-batch; each backward
        reduce-scatters into the sharded gradients, which sum them (averaged over the
        replicas as DDP averages them). Returns each micro-batch's loss."""
        self.module.train()
        activations = self.run_prefix(inputs, ids, "train", seq_length)
        losses = []
        for *micro, micro_target in self._micro_batches(*activations, target):
            with self._autocast():
                logits = self.module(*micro)
            loss = self.loss_fn(logits.float(), micro_target)
            loss.backward()
            losses.append(loss.detach())
        return losses

    def eval_step(
        self,
        inputs: Sequence[torch.Tensor] | None,
        target: torch.Tensor | None,
        ids: Sequence[int] | None = None,
        seq_length: int | PackedShape | None = None,
    ) -> torch.Tensor:
        """Forward only (collective: every rank gathers every trained group), micro-batch
        by micro-batch as the training step runs it: every rank makes the same number of
        forward calls whatever its batch's shape (under `data.padding: auto` one replica's
        batch may pack where another's is padded, and a packed batch's sample starts count
        within one micro-batch). Every group is resharded after it: between steps a unit's
        parameters are its shards, the objects the optimizer and the checkpoint know (the
        head's group keeps its gathered parameters after a forward otherwise)."""
        self.module.eval()
        try:
            with torch.no_grad():
                activations = self.run_prefix(inputs, ids, "eval", seq_length)
                with self._autocast():
                    outputs = [
                        self.module(*micro).float() for micro in self._micro_batches(*activations)
                    ]
                return torch.cat(outputs)
        finally:
            self.module.train()
            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def gather_policy(device: torch.device, autocast_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """What FSDP2 gathers parameters and reduces gradients in (module docstring)."""
    if device.type == "cuda" and autocast_dtype is not None:
        return MixedPrecisionPolicy(
            param_dtype=autocast_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return MixedPrecisionPolicy()


def _fill(unit: nn.Module, shards: dict[str, torch.Tensor], device: torch.device) -> None:
    """A unit sharded on the meta device, materialised and given the local shards (and
    buffers) it carried from the previous sharded layout: the same cut of the same world."""
    delattr(unit, CARRIED)
    unit.to_empty(device=device)
    with torch.no_grad():
        for name, param in unit.named_parameters():
            local(param).copy_(shards[name])
        for name, buffer in unit.named_buffers():
            buffer.copy_(shards[name])


def build_sharded_runtime(
    *,
    plan: PipelinePlan,
    replica_batch_size: int,
    units: dict[int, nn.Module],
    loss_fn: LossFn,
    data_group: dist.ProcessGroup,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> ShardedRuntime:
    """Shards this rank's trained units in place (their parameters become DTensor shards)
    and returns the runtime. Collective over `data_group`. The units must be plain (never
    sharded before): a transition gathers them first (fsdp/state.py).
    `reshard_after_forward` false: a layer's gathered parameters stay from its forward to
    its backward (ZeRO-2, FSDP1's SHARD_GRAD_OP): one all-gather a layer a step instead of
    two, the trained layers held unsharded meanwhile (autopipe/memory.py)."""
    if plan.pipe_len != 1:
        raise ValueError("a sharded layout is one stage")
    if replica_batch_size % plan.num_micro_batches:
        raise ValueError(
            f"{plan.num_micro_batches} micro-batches do not divide the replica batch "
            f"{replica_batch_size}"
        )
    num_units = len(units)
    if sorted(units) != list(range(num_units)):
        raise ValueError("a sharded layout's rank holds every unit")
    frozen_end = plan.frozen_end
    # Named after the group: DeviceMesh equality ignores the process group, and a DTensor
    # spec cached for an equal mesh of an earlier layout (whose group is destroyed) would
    # otherwise be reused ("Could not resolve the process group", measured on torch 2.14).
    mesh = DeviceMesh.from_group(
        data_group, device.type, mesh_dim_names=(f"data_{data_group.group_name}",)
    )
    policy = gather_policy(device, autocast_dtype)
    head = num_units - 1
    carried = {u: carried_shards(units[u]) for u in range(frozen_end, num_units)}
    for group in shard_groups(frozen_end, num_units):
        modules = [units[u] for u in group]
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward and head not in group,
        )
    for index, shards in carried.items():  # sharded before: its shards, copied in place
        if shards is not None:
            _fill(units[index], shards, device)
    trained = [units[u] for u in range(frozen_end, num_units)]
    root = UnitSequence(trained, [False] * len(trained), checkpoint=activation_checkpointing)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    preprocess = None
    if plan.prefix_end > 0:
        prefix = [units[u] for u in range(plan.prefix_end)]
        preprocess = UnitSequence(prefix, [True] * len(prefix))
    return ShardedRuntime(
        module=root,
        preprocess=preprocess,
        loss_fn=loss_fn,
        data_group=data_group,
        device=device,
        micro_batch_size=replica_batch_size // plan.num_micro_batches,
        num_micro_batches=plan.num_micro_batches,
        autocast_dtype=autocast_dtype,
    )
