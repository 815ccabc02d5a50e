"""One training step of this rank, and what it needs: its stage in the current layout and
its share of the step's batch.

`Stage` is what this rank runs in the current layout (units, optimizer, training groups,
the pipeline runtime); a transition replaces it. `Batches` gives a rank its replica's
inputs (first stage), weighted targets (last stage) and, for text, the sequence length
every stage of the replica runs the step at, for any step of any layout, loading ahead
with `data.num_workers` workers. The length is the replica batch's padded length
(data.padding), rounded up to a bucket in a pipeline of several stages (utils/padding.py),
or under data.padding packed the `PackedShape` of rows that long its micro-batches pack
into: a function of the sample ids, so every rank of a replica computes the same without a
word.
`StepRunner.run` takes one step: data, learning rate, forward and backward through the
schedule, gradient clipping over the pipeline's stages, the optimizer, and the per-step
values the metrics count: the replica's loss and each unit's squared gradient norm (before
or after clipping: `freeze.signal_gradients`), both left on the device (no host
synchronisation), and the tokens the step computed.

Owns: the step. Must not: decide anything about layouts, freezing or checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.autodp.groups import TrainingGroups
from pipetransformer.autodp.sampler import TrainSampler
from pipetransformer.autodp.topology import Layout, Role
from pipetransformer.config import Config
from pipetransformer.data import DataBundle, SampleDataset
from pipetransformer.data.loader import BatchLoader, workers_per_process
from pipetransformer.freeze_signal import unit_grad_squares
from pipetransformer.fsdp import local
from pipetransformer.models import unit_param_names
from pipetransformer.pipe import StageRuntime
from pipetransformer.pipe.timing import IntervalTimer
from pipetransformer.pipe.transfer import to_device
from pipetransformer.tasks import loss_weights
from pipetransformer.trainer import optim
from pipetransformer.trainer.caching import RunCache
from pipetransformer.trainer.clock import Tick
from pipetransformer.trainer.distributed import WorldInfo
from pipetransformer.trainer.metrics import StepResult
from pipetransformer.utils.files import append_jsonl
from pipetransformer.utils.padding import (
    PackedShape,
    batch_tokens,
    bucket_length,
    packed_shape,
    packing_pays,
)


def step_seq_length(
    config: Config, layout: Layout, dataset: SampleDataset, ids: Sequence[int]
) -> int | PackedShape | None:
    """The sequence length a replica of `layout` runs the batch `ids` of `dataset` at (None
    without a sequence): its padded length, in a bucket when the pipeline has several
    stages (the stages' receive buffers are built per shape: pipe/runtime.py); packed, the
    shape its micro-batches pack into in rows of that length (rows in a bucket too); under
    data.padding auto, that shape where packing pays (`packing_pays`), else the length."""
    length = dataset.batch_length(ids)
    if length is None:
        return None
    length = run_length(config, layout.pipe_len, length)
    if config.data.padding not in ("packed", "auto"):
        return length
    samples = len(ids) // layout.plan.num_micro_batches
    lengths = [dataset.lengths[i] for i in ids]
    return batch_shape(config, lengths, samples, length, bucketed=layout.pipe_len > 1)


def batch_shape(
    config: Config, lengths: Sequence[int], samples: int, length: int, bucketed: bool
) -> int | PackedShape:
    """A batch of samples of real lengths `lengths`, padded to `length`, in micro-batches of
    `samples`: `length`, or under data.padding packed (auto: where packing pays) its packed
    shape. A micro-batch of one sample is never packed (one row: the padded batch itself,
    and for compiled units a graph of its own), nor, compiled, into one row."""
    if config.data.padding not in ("packed", "auto") or samples < 2:
        return length
    min_rows = 2 if config.trainer.compile else 1
    shape = packed_shape(lengths, samples, length, bucketed, min_rows)
    if config.data.padding == "auto" and not packing_pays(shape, length, len(lengths)):
        return length
    return shape


def run_length(config: Config, pipe_len: int, padded: int | None) -> int | None:
    """The length a replica of a pipeline of `pipe_len` stages runs a batch padded to
    `padded` tokens at: in its bucket when there are several stages."""
    if padded is None or pipe_len == 1:
        return padded
    return bucket_length(padded, config.data.pad_to_multiple_of, config.data.max_seq_length)


def train_sampler(config: Config, train: SampleDataset, num_nodes: int) -> TrainSampler:
    """The run's sampler of the training split: the config's batch semantics and seed, and
    with data.group_by_length the samples' lengths, grouped in batches of the config's
    node batch (autodp/sampler.py)."""
    per_replica = config.trainer.batch_per_replica
    grouped = config.data.group_by_length and train.lengths is not None
    return TrainSampler(
        len(train),
        num_nodes,
        None if per_replica else config.trainer.global_batch_size,
        config.trainer.seed,
        per_replica,
        lengths=train.lengths if grouped else None,
        group_batch_size=(per_replica or config.trainer.global_batch_size // num_nodes)
        if grouped
        else None,
    )


def padded_length_share(
    config: Config,
    train: SampleDataset,
    sampler: TrainSampler,
    replicas_per_node: int,
    pipe_len: int = 1,
    num_micro_batches: int = 1,
) -> float:
    """The tokens an epoch's replica batches compute over those of the same batches padded
    to max_seq_length (node 0's first epoch, `replicas_per_node` replicas a node of
    `pipe_len` stages: each batch at its padded length, in its bucket in a pipeline of
    several stages, as `step_seq_length` runs it; under data.padding packed, packed in
    `num_micro_batches` micro-batches in rows of that length); 1 without a sequence. What
    recomputing a frozen prefix costs against its cost at max_seq_length
    (trainer/caching.py)."""
    if train.lengths is None:
        return 1.0
    order = sampler.epoch_order(0, 0)
    replica = config.trainer.replica_batch_size(replicas_per_node * sampler.num_nodes)
    batches = [order[i : i + replica] for i in range(0, len(order), replica)]
    tokens = 0
    for ids in batches:
        shape = run_length(config, pipe_len, train.batch_length(ids))
        samples = len(ids) // num_micro_batches
        if samples and len(ids) % samples == 0:
            lengths = [train.lengths[i] for i in ids]
            shape = batch_shape(config, lengths, samples, shape, bucketed=pipe_len > 1)
        tokens += batch_tokens(shape, len(ids))
    return tokens / (len(order) * config.data.max_seq_length)


@dataclass(frozen=True)
class StepData:
    """One rank's share of a step: inputs (first stage), weighted targets (last stage), the
    replica's sample ids and the sequence length every stage runs it at."""

    inputs: list[torch.Tensor] | None
    target: torch.Tensor | None
    ids: tuple[int, ...]
    seq_length: int | PackedShape | None


@dataclass
class Stage:
    """This rank's part of the current layout (an idle rank has no role and no runtime)."""

    layout: Layout
    groups: TrainingGroups
    units: dict[int, nn.Module]
    optimizer: torch.optim.Optimizer | None
    runtime: StageRuntime | None
    cache_active: bool  # AutoCache serves the frozen prefix
    # The trained parameters in unit order and, on the device, the unit owning each: built
    # at the layout's first step (StepRunner._unit_grad_squares), reused at every other.
    grad_owners: tuple[list[nn.Parameter], torch.Tensor] | None = field(
        default=None, init=False, repr=False
    )
    # autofreeze: per trained parameter (its local shard when sharded), the gradients
    # applied since the last decision, summed, and how many steps they hold.
    grad_sums: list[torch.Tensor] | None = field(default=None, init=False, repr=False)
    grad_sum_steps: int = field(default=0, init=False, repr=False)

    def named_params(self) -> dict[str, nn.Parameter]:
        named = {}
        for index, unit in self.units.items():
            named.update(unit_param_names(unit, index))
        return named


class Batches:
    def __init__(
        self,
        config: Config,
        data: DataBundle,
        sampler: TrainSampler,
        task,
        world: WorldInfo,
        run_dir: Path,
        cache: RunCache | None,
    ) -> None:
        self.config = config
        self.data = data
        self.sampler = sampler
        self.task = task
        self.world = world
        self.run_dir = run_dir
        self.cache = cache
        # Workers live for the run; a pass per epoch and per layout (data/loader.py).
        self._batch_loader = BatchLoader(
            data.train,
            workers_per_process(config.data.num_workers, world.devices_per_node),
            pin_memory=world.device.type == "cuda",
        )
        self._loader = None
        self._position: tuple[int, int] | None = None  # (epoch, step) the loader yields next

    def restart(self) -> None:
        """The data split changes with the layout: the loader restarts at the next step."""
        self._loader = None

    def close(self) -> None:
        self._loader = None
        self._batch_loader.close()

    def device_inputs(
        self, split: str, ids: Sequence[int], seq_length: int | PackedShape | None = None
    ) -> list[torch.Tensor]:
        """Inputs of `ids` on the device at `seq_length` tokens, loaded now (what a batch the
        loader skipped needs when the cache turns out not to serve all of it)."""
        dataset = self.data.train if split == "train" else self.data.eval
        return [to_device(t, self.world.device) for t in dataset.fetch(ids, seq_length)[0]]

    def seq_length(self, layout: Layout, ids: Sequence[int]) -> int | PackedShape | None:
        """The sequence length of training batch `ids` in `layout`."""
        return step_seq_length(self.config, layout, self.data.train, ids)

    def padded_tokens(self, layout: Layout, epoch: int, step: int) -> int:
        """Tokens the step computes over every replica (rows times their batch's length,
        shape padding included); 0 without a sequence."""
        if self.data.train.lengths is None:
            return 0
        total = 0
        for replica in range(layout.dp_degree):
            node, local_replica = divmod(replica, layout.replicas_per_node)
            ids = self.sampler.replica_batch(
                node, local_replica, layout.replicas_per_node, epoch, step
            ).ids
            total += batch_tokens(self.seq_length(layout, ids), len(ids))
        return total

    def step_data(
        self,
        layout: Layout,
        epoch: int,
        step: int,
        prefetched: bool = False,
        cache_active: bool = False,
    ) -> StepData:
        """This rank's share of one step in `layout` (None where not needed). `prefetched`:
        take the inputs from the loader that reads ahead (training)."""
        role = layout.role(self.world.rank)
        node, local_replica = divmod(role.replica, layout.replicas_per_node)
        batch = self.sampler.replica_batch(
            node, local_replica, layout.replicas_per_node, epoch, step
        )
        seq_length = self.seq_length(layout, batch.ids)
        inputs = target = None
        if role.is_first:
            if prefetched:
                raw = self._next_inputs(layout, role, epoch, step, cache_active)
            else:
                raw = self.data.train.fetch(batch.ids, seq_length)[0]
            # None: every sample is served by AutoCache, nothing was decoded.
            inputs = None if raw is None else [to_device(t, self.world.device) for t in raw]
            if prefetched and self.config.trainer.record_sample_ids:
                trained = [i for i, valid in zip(batch.ids, batch.valid) if valid]
                append_jsonl(
                    self.run_dir / "samples" / f"rank{self.world.rank}.jsonl",
                    {"epoch": epoch + 1, "step": step, "node": node, "ids": trained},
                )
        if role.is_last:
            weights = loss_weights(
                batch.valid, layout.dp_degree, self.sampler.global_num_valid(epoch, step)
            )
            lengths = self.data.train.lengths
            target = self.task.make_target(
                self.data.train.targets(batch.ids),
                weights,
                None if lengths is None else [lengths[i] for i in batch.ids],
            )
            target = to_device(target, self.world.device)
        return StepData(inputs, target, batch.ids, seq_length)

    def _next_inputs(
        self, layout: Layout, role: Role, epoch: int, step: int, cache_active: bool
    ) -> Sequence[torch.Tensor] | None:
        """The rest of the epoch's batches are known in advance for the current layout; a
        transition changes the split, so the loader restarts at the step after it. With the
        cache serving, a batch whose every sample is cached at this boundary is not decoded
        (None): entries at the current boundary stay valid until the next transition."""
        if self._loader is None or self._position != (epoch, step):
            node, local_replica = divmod(role.replica, layout.replicas_per_node)
            id_batches = [
                self.sampler.replica_batch(
                    node, local_replica, layout.replicas_per_node, epoch, s
                ).ids
                for s in range(step, self.sampler.steps_per_epoch)
            ]
            skip = None
            if cache_active:  # the cache's disk tier reads ahead in the same order
                self.cache.client.prefetch("train", [i for ids in id_batches for i in ids])
                frozen = layout.plan.num_frozen_layers
                client = self.cache.client
                skip = lambda ids: client.serves_all("train", ids, frozen)  # noqa: E731
            lengths = [self.seq_length(layout, ids) for ids in id_batches]
            self._loader = self._batch_loader.start(id_batches, skip, lengths)
        inputs = next(self._loader)
        self._position = (epoch, step + 1)
        return inputs


class StepRunner:
    def __init__(
        self,
        config: Config,
        batches: Batches,
        world: WorldInfo,
        num_units: int,
        grad_norms: bool,
        grad_sums: bool = False,
        layer_rates: Callable[[Tick], list[float] | None] | None = None,
    ) -> None:
        """`layer_rates`: each layer's learning rate at a step (layer-wise annealing:
        trainer/freezing.py), or None where every group takes the run's."""
        self.config = config
        self.layer_rates = layer_rates
        self.batches = batches
        self.world = world
        self.num_units = num_units
        self.grad_norms = grad_norms  # the freeze signal needs each unit's gradient norm
        self.grad_sums = grad_sums  # autofreeze: each gradient summed over the interval
        self.clock = IntervalTimer(world.device)  # marks a step's start and end on the device

    def learning_rate(self, tick: Tick) -> float:
        """The learning rate of the step of `tick` (its place in the schedule: clock.py)."""
        return optim.learning_rate(self.config.optimizer, tick.schedule_step, tick.schedule_steps)

    def learning_rates(self, tick: Tick) -> tuple[float, list[float] | None]:
        """The run's learning rate at the step of `tick` and each layer's (None: no
        layer-wise annealing)."""
        layers = self.layer_rates(tick) if self.layer_rates is not None else None
        return self.learning_rate(tick), layers

    def run(self, tick: Tick, stage: Stage) -> StepResult:
        """Forward, backward and update for this rank's part of one global step."""
        layout = stage.layout
        started = time.perf_counter()
        start_mark = self.clock.mark()
        samples = self.batches.sampler.global_num_valid(tick.epoch, tick.step_in_epoch)
        padded_tokens = self.batches.padded_tokens(layout, tick.epoch, tick.step_in_epoch)
        replica_loss = unit_sq = None
        runtime = stage.runtime
        if runtime is not None:
            data = self.batches.step_data(
                layout,
                tick.epoch,
                tick.step_in_epoch,
                prefetched=True,
                cache_active=stage.cache_active,
            )
            optim.set_learning_rate(stage.optimizer, *self.learning_rates(tick))
            losses = runtime.train_step(
                data.inputs,
                data.target,
                data.ids if runtime.is_first else None,
                data.seq_length,
            )
            clip = self.config.optimizer.max_grad_norm
            raw = self.config.freeze.signal_before_clipping  # freeze.signal_gradients
            if self.grad_sums and raw:  # the gradients as backward left them, summed
                self._accumulate(stage)
            if clip is not None or self.grad_norms:
                squares = self._unit_grad_squares(stage)  # one pass over the gradients serves both
                scale = self._clip(stage, squares, clip) if clip is not None else None
                if self.grad_norms:  # the norms of the raw or of the applied gradients
                    unit_sq = squares if scale is None or raw else squares * scale.square()
            if self.grad_sums and not raw:  # the gradients applied (after clipping), summed
                self._accumulate(stage)
            if stage.optimizer is not None:
                stage.optimizer.step()
                stage.optimizer.zero_grad(set_to_none=True)
            if losses:
                # Losses are weighted by R / (valid samples in the global batch): undo that to
                # get this replica's sum of per-sample losses.
                replica_loss = torch.stack([loss.detach() for loss in losses]).double().sum() * (
                    samples / layout.dp_degree
                )
        return StepResult(
            layout,
            started,
            (start_mark, self.clock.mark()),
            samples,
            replica_loss,
            unit_sq,
            padded_tokens,
        )

    def _grad_owners(self, stage: Stage) -> tuple[list[nn.Parameter], torch.Tensor]:
        if stage.grad_owners is None:
            params, owners = [], []
            for index, unit in stage.units.items():
                for p in unit.parameters():
                    if p.requires_grad:
                        params.append(p)
                        owners.append(index)
            owner_index = to_device(torch.tensor(owners, dtype=torch.long), self.world.device)
            stage.grad_owners = params, owner_index
        return stage.grad_owners

    def _accumulate(self, stage: Stage) -> None:
        """Adds this step's gradients to the interval's sums (one multi-tensor add)."""
        params, _ = self._grad_owners(stage)
        if stage.grad_sums is None:
            stage.grad_sums = [torch.zeros_like(local(p.detach())) for p in params]
        pairs = [
            (s, local(p.grad.detach()))
            for s, p in zip(stage.grad_sums, params)
            if p.grad is not None
        ]
        if pairs:
            torch._foreach_add_([s for s, _ in pairs], [g for _, g in pairs])
        stage.grad_sum_steps += 1

    def take_unit_grad_sums(self, stage: Stage) -> tuple[torch.Tensor, int]:
        """Per unit, the L1 norm of the gradients summed since the last call (float64 on the
        device; in a sharded layout this rank's shards', whose sum over the ranks is the
        unit's), and the steps they hold; starts a new sum."""
        l1 = torch.zeros(self.num_units, dtype=torch.float64, device=self.world.device)
        steps = stage.grad_sum_steps
        if stage.grad_sums:
            _, owner_index = self._grad_owners(stage)
            norms = torch.stack(torch._foreach_norm(stage.grad_sums, 1)).double()
            l1.index_add_(0, owner_index, norms)
            torch._foreach_zero_(stage.grad_sums)
        stage.grad_sum_steps = 0
        return l1, steps

    def unit_grad_sums(self, stage: Stage, control) -> tuple[list[float], int]:
        """Per unit, the L1 norm of the gradient summed since the last decision over the
        whole model, and the steps the sum holds (collective over `control`'s ranks).
        Replicas hold the same (averaged) gradients, counted once; shards add up."""
        l1, steps = self.take_unit_grad_sums(stage)
        copies = 1 if stage.layout.sharded else stage.layout.dp_degree
        # Idle ranks hold no sum; every rank that trains holds the same count.
        most = control.all_max([float(steps)])
        return (control.all_sum(l1) / copies).tolist(), int(most[0])

    def _unit_grad_squares(self, stage: Stage) -> torch.Tensor:
        """Squared gradient norm of each unit this rank trains, float64 on the device: one
        multi-tensor norm kernel over every gradient (float32 norms of float32 gradients),
        then a scatter-add of their squares by unit. The unit of each gradient is an index
        built, pinned and copied to the device once per layout (`Stage.grad_owners`). In a
        sharded layout each rank holds a shard of every gradient: the squares of the shards
        are summed over the replicas."""
        params, owner_index = self._grad_owners(stage)
        grads = [local(p.grad.detach()) for p in params if p.grad is not None]
        if grads and len(grads) < len(params):  # a parameter this step left without a gradient
            owned = [i for i, p in enumerate(params) if p.grad is not None]
            owner_index = owner_index[to_device(torch.tensor(owned), self.world.device)]
        # The kernel the integrations share (freeze_signal.py): one norm pass, a scatter-add.
        squares = unit_grad_squares(grads, owner_index, self.num_units)
        if stage.layout.sharded:
            dist.all_reduce(squares, group=stage.groups.data)
        return squares

    def _clip(self, stage: Stage, unit_squares: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over the replica's stages; returns the factor applied to
        every gradient, on the device (as torch.nn.utils.clip_grad_norm_ does: no host sync)."""
        total_sq = unit_squares.sum()
        if stage.layout.pipe_len > 1:  # the replica's stages together hold the whole model
            dist.all_reduce(total_sq, group=stage.groups.pipeline)
        scale = (max_norm / (total_sq.sqrt() + 1e-6)).clamp(max=1.0)
        grads = [local(p.grad) for p in stage.runtime.trainable_parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        return scale
