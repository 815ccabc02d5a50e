"""What a pipeline stage holds in device memory at its peak, from a measured unit profile.
Pure arithmetic on plain values: no processes, no torch.

For one rank of a layout (stage s of K, M micro-batches of m samples, R replicas):

    parameters      every unit the rank holds (its stage's, and on stage 0 the frozen prefix)
    gradients       one per trained parameter
    optimizer       Adam/AdamW two moments, SGD with momentum one buffer, per trained parameter
    gradient sums   freeze.strategy autofreeze: each trained parameter's gradients summed
                    over the decision interval, a float32 copy of it (trainer/step.py)
    DDP buckets     a flat copy of the trained gradients when R > 1 (DDP's reducer buckets);
                    none under zero_bubble, whose gradients are views of the flat buffers
                    it reduces (pipe/gradient_sync.py)
    activations     what autograd saves for backward, per micro-batch still waiting for its
                    backward: GPipe holds all M, 1F1B at most K - s on stage s, one
                    stage (K = 1) one: each micro-batch's backward follows its forward
    overlap         (subtracted) gradients and activations are not all held at once when
                    every forward precedes every backward (GPipe; 1F1B with M <= K - s): the
                    gradients (set to None after each step) are made by the first backward,
                    which frees its micro-batch's activations as it goes, so with n in flight
                    the peak holds max(n micro-batches, n - 1 and the gradients); in 1F1B's
                    steady phase a forward follows a backward: both are held in full
    boundary        the pipeline's buffers: received inputs (M, stage > 0; twice: the
                    evaluation's stage receives into buffers of its own, pipe/runtime.py),
                    received output gradients (M, all but the last stage) and the outputs
                    kept for backward;
                    stage 0 also holds the frozen prefix's output for the replica batch.
                    Text padded per batch keeps a stage (and its receive buffers) for each
                    length bucket it meets (pipe/runtime.py): the receive buffers of every
                    bucket together, `receive_buffer_share` times the max-length ones
                    (under 3; under 2 where max_seq_length is pad_to_multiple_of times a
                    power of two: utils/padding.py), packed text one for each shape it may
                    build (rows and their length in buckets: under 9), all other terms at
                    max_seq_length

Under interleaved_1f1b and zero_bubble (v chunks a rank, torch's order in
autopipe/schedule_order.py; `_chunked_stage_memory`; interleaved_1f1b at v = 1 runs 1F1B,
above) a rank's terms are its chunks' summed:

    activations     the most it holds at once walking its order: a forward adds its chunk's
                    saved bytes for a micro-batch, that chunk's backward frees them; with
                    equal chunks, in micro-batches of one chunk, rank r of K (rounds of
                    R = M // max(1, M // K) micro-batches):
                      interleaved 1F1B  min((v - 1) R + 2 (K - 1 - r) + 1, M v): Megatron's
                                        warm-up and the steady phase's forward (Narayanan et
                                        al. 2021, arXiv:2104.04473, section 2.2); about
                                        K + (K - 1) / v a rank's worth on rank 0, against
                                        1F1B's K
                      zero bubble       min((v - 1) R + K, M v) on every rank: the weight
                                        gradient (W) of a micro-batch waits r backwards, so
                                        its activations stay until W (torch's input backward
                                        keeps the graph for it, retain_graph=True); at v = 1
                                        K on every rank, 1F1B's first-stage peak (ZB-H1's
                                        memory, Qi et al. 2023, arXiv:2401.10241)
                    the gradients kept for W are not counted beyond that
    boundary        per chunk: received inputs (2 M: training's and evaluation's, all but
                    chunk 0), received output
                    gradients (M, all but the last chunk), outputs kept for backward (the
                    most in flight of that chunk); on stage 0 the prefix's output
    overlap         none: a forward follows a backward in the steady phase

A sharded layout (FSDP2: one stage, its trained units' parameters, gradients and optimizer
state sharded over the R replicas; `sharded_memory`) holds on each rank:

    parameters      the frozen prefix in full (gathered once at the transition that froze it,
                    then computed locally or served from AutoCache), the trained units' shard
                    (1/R of their bytes)
    gradients       the sharded gradients (1/R), made by the reduce-scatters
    optimizer       state of the shard (1/R), and AutoFreeze's gradient sums of it
    gathered        FSDP2's unsharded buffers in flight, one shard group (a layer: both its
                    sublayers; the embedding and the head alone) at a time: in backward the
                    group's all-gathered parameters, their unsharded gradients, the
                    reduce-scatter's input copy of them and the next group's prefetched
                    parameters: four times the largest group's bytes
    activations     saved for backward for one micro-batch (the replica batch in M pieces one
                    after the other, each reduce-scattered into the sharded gradients:
                    gradient accumulation that keeps them sharded)
    boundary        the prefix's output for the replica batch, the logits of a micro-batch
    overlap         with one micro-batch, as GPipe's: the smaller of gradients and activations;
                    with more, the sharded gradients are held while later ones run: none

With activation checkpointing (trainer.activation_checkpointing) a trained unit saves only
its inputs for the backward (the previous unit's output bytes) in place of `saved_bytes`,
and its backward rebuilds its full activations for the one micro-batch it runs: one
trained unit's saved bytes, the largest the rank holds, counted once on top. With
`pipeline.fsdp_reshard_after_forward: false` (ZeRO-2) the gathered parameters of every
trained layer stay from its forward to its backward: `gathered` holds the trained units'
unsharded bytes plus the largest group's unsharded gradients and reduce-scatter copy.

A transition (`move_bytes`) holds something else: no activations, but for a while both
layouts' weights. Walking the transfer list in the order every rank runs it
(autodp/handoff.py), a rank holds its old units with their optimizer state, less each unit
it keeps no longer once nothing more is sent from it, plus each unit as it arrives (with
its optimizer state when it stays trained), plus the unit in flight: the sender's flat copy
(one unit's bytes), the receiver's payload and the tensors unpacked from it (two).

Activation terms are measured at the profile's micro-batch size and scale linearly with the
micro-batch size (and are taken in the precision the profile was measured in). The sum is
checked against measured peaks in tests/test_memory.py and docs/profiling.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from pipetransformer.autopipe.planner import PipelinePlan
from pipetransformer.autopipe.schedule_order import Op, rank_order
from pipetransformer.config import MULTI_CHUNK_SCHEDULES, SCHEDULE_PROPERTIES, layout_schedule
from pipetransformer.utils.units import layer_of_unit

# Optimizer state per parameter, in multiples of the parameter's own bytes.
_OPTIMIZER_STATE_FACTOR = {"adam": 2.0, "adamw": 2.0}


def optimizer_state_factor(optimizer_name: str, momentum: float = 0.9) -> float:
    """Optimizer state bytes per parameter byte: Adam/AdamW 2, SGD 1 with momentum else 0."""
    name = optimizer_name.lower()
    if name in _OPTIMIZER_STATE_FACTOR:
        return _OPTIMIZER_STATE_FACTOR[name]
    if name == "sgd":
        return 1.0 if momentum > 0 else 0.0
    raise ValueError(f"unknown optimizer '{optimizer_name}' (expected adam, adamw or sgd)")


def shard_groups(frozen_end: int, num_units: int) -> list[list[int]]:
    """The units FSDP2 gathers together in a sharded layout, in forward order: the embedding
    and the head alone, each layer's two sublayers as one group (a transformer block, the
    unit torchtitan shards and the freeze algorithm freezes); only trained units."""
    num_layers = (num_units - 2) // 2
    groups: dict[object, list[int]] = {}
    for unit in range(frozen_end, num_units):
        layer = layer_of_unit(unit, num_layers)
        groups.setdefault(("unit", unit) if layer is None else ("layer", layer), []).append(unit)
    return list(groups.values())


def held_activations(
    order: Sequence[Op], saved_bytes: Sequence[float], release: str
) -> tuple[float, list[int]]:
    """Walking a rank's `order` (autopipe/schedule_order.py): the most activation bytes it
    holds at once, a forward adding its chunk's `saved_bytes` until the op of kind `release`
    of the same chunk frees them ('B', or 'W' when the backward is split), and the most
    micro-batches each chunk holds at once."""
    held = [0] * len(saved_bytes)
    most = [0] * len(saved_bytes)
    peak = 0.0
    for op in order:
        if op.kind == "F":
            held[op.chunk] += 1
            most[op.chunk] = max(most[op.chunk], held[op.chunk])
            peak = max(peak, sum(n * b for n, b in zip(held, saved_bytes)))
        elif op.kind == release:
            held[op.chunk] -= 1
    return peak, most


class Move(Protocol):
    """One unit's transfer (autodp/handoff.py's Transfer)."""

    unit: int
    src: int
    dst: int
    with_optimizer_state: bool


@dataclass(frozen=True)
class LayoutShape:
    """The layout facts memory depends on besides the plan."""

    micro_batch_size: int
    num_micro_batches: int
    dp_degree: int
    schedule: str = "gpipe"
    # The receive buffers a pipeline stage holds, in multiples of the max-length ones (text
    # padded per batch: one set per length bucket; module docstring).
    receive_buffer_share: float = 1.0


@dataclass(frozen=True)
class StageMemory:
    parameters: float
    gradients: float
    optimizer: float
    ddp_buckets: float
    activations: float
    boundary: float
    overlap: float = 0.0  # subtracted: gradients made while activations are freed
    gathered: float = 0.0  # FSDP2's unsharded parameters and gradients in flight
    gradient_sums: float = 0.0  # autofreeze: a float32 copy of the trained parameters

    def with_overlap(self, overlap: float) -> StageMemory:
        return dataclasses.replace(self, overlap=overlap)

    @property
    def total(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.gradient_sums
            + self.ddp_buckets
            + self.gathered
            + self.activations
            + self.boundary
            - self.overlap
        )

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class MemoryModel:
    param_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]  # per unit, one micro-batch of `profile_micro_batch_size`
    output_bytes: tuple[int, ...]  # likewise
    profile_micro_batch_size: int
    optimizer_state_factor: float
    # Bytes of gradient sums per trained parameter byte: 1 under freeze.strategy autofreeze
    # (float32 sums of float32 parameters), else 0. Dropped at a transition: not moved.
    gradient_sums_factor: float = 0.0
    # trainer.activation_checkpointing: a trained unit saves its inputs only (module docstring).
    activation_checkpointing: bool = False
    # pipeline.fsdp_reshard_after_forward (sharded layouts only).
    reshard_after_forward: bool = True

    def unit_saved_bytes(self, unit: int) -> int:
        """What a trained unit saves for its backward, a micro-batch of the profile's size:
        its measured saved bytes, or with activation checkpointing its inputs."""
        if not self.activation_checkpointing:
            return self.saved_bytes[unit]
        return self.output_bytes[unit - 1] if unit > 0 else 0

    def recompute_bytes(self, trained: Iterable[int]) -> int:
        """With activation checkpointing, the activations one trained unit's backward
        rebuilds (the largest of `trained`, a micro-batch of the profile's size); else 0."""
        if not self.activation_checkpointing:
            return 0
        return max((self.saved_bytes[u] for u in trained), default=0)

    @classmethod
    def from_profile(
        cls,
        profile,
        optimizer_name: str,
        momentum: float = 0.9,
        gradient_sums: bool = False,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
    ) -> MemoryModel:
        """From a UnitProfile (autopipe/profiles.py); `gradient_sums`: AutoFreeze's."""
        return cls(
            tuple(profile.param_bytes),
            tuple(profile.saved_bytes),
            tuple(profile.output_bytes),
            profile.micro_batch_size,
            optimizer_state_factor(optimizer_name, momentum),
            1.0 if gradient_sums else 0.0,
            activation_checkpointing,
            reshard_after_forward,
        )

    def stage_memory(self, plan: PipelinePlan, stage: int, shape: LayoutShape) -> StageMemory:
        schedule = layout_schedule(shape.schedule, plan.pipe_len, plan.virtual_stages)
        if schedule in MULTI_CHUNK_SCHEDULES:
            return self._chunked_stage_memory(plan, stage, shape, schedule)
        start, end = plan.stage_ranges[stage]
        frozen_end = plan.frozen_end
        held = list(range(start, end)) + (list(range(plan.prefix_end)) if stage == 0 else [])
        trained = [u for u in range(start, end) if u >= frozen_end]
        scale = shape.micro_batch_size / self.profile_micro_batch_size
        m = shape.num_micro_batches
        # Micro-batches whose activations are held at once: GPipe holds all of them, 1F1B at
        # most those ahead of stage s; one stage runs each micro-batch's forward and backward
        # in turn (pipe/runtime.py's OneStageSchedule), whatever the schedule's name.
        if plan.pipe_len == 1:
            in_flight = 1
        elif shape.schedule == "gpipe":
            in_flight = m
        else:
            in_flight = min(m, plan.pipe_len - stage)
        grads = float(sum(self.param_bytes[u] for u in trained))
        boundary = self._chunk_boundary(plan, stage, in_flight, m, shape.receive_buffer_share)
        boundary += self._prefix_boundary(plan, stage, m)
        activations = in_flight * scale * sum(self.unit_saved_bytes(u) for u in trained)
        activations += scale * self.recompute_bytes(trained)
        with_gradients = activations + grads
        if m == in_flight:  # no forward after the first backward (GPipe; 1F1B with M <= K - s)
            with_gradients = max(activations, activations * (in_flight - 1) / in_flight + grads)
        return self._terms(held, trained, shape, activations, scale * boundary).with_overlap(
            activations + grads - with_gradients
        )

    def _chunk_boundary(
        self, plan: PipelinePlan, chunk: int, kept: int, m: int, receive_share: float = 1.0
    ) -> float:
        """A chunk's pipeline buffers: its outputs kept for their backward (`kept` micro-batches),
        its received inputs (all but chunk 0; for training and for evaluation, each its own
        stage) and output gradients (all but the last chunk), the receive buffers
        `receive_share` times the max-length ones (one set per length bucket of text padded
        per batch, per shape of packed text)."""
        start, end = plan.stage_ranges[chunk]
        boundary = kept * self.output_bytes[end - 1]
        received = receive_share * m
        if chunk > 0:
            boundary += 2 * received * self.output_bytes[start - 1]
        if chunk < plan.num_chunks - 1:
            boundary += received * self.output_bytes[end - 1]
        return boundary

    def _prefix_boundary(self, plan: PipelinePlan, stage: int, m: int) -> int:
        """Stage 0 holds the frozen prefix's output for the replica batch."""
        if stage == 0 and plan.prefix_end > 0:
            return m * self.output_bytes[plan.prefix_end - 1]
        return 0

    def _terms(
        self,
        held: Sequence[int],
        trained: Sequence[int],
        shape: LayoutShape,
        activations: float,
        boundary: float,
        reduced_in_place: bool = False,
    ) -> StageMemory:
        """A stage's terms from the units it holds and trains (no overlap).
        `reduced_in_place`: the gradients are views of the buffers the data-parallel
        all-reduce reduces (zero bubble's, pipe/gradient_sync.py): no bucket copy."""
        grads = float(sum(self.param_bytes[u] for u in trained))
        return StageMemory(
            parameters=float(sum(self.param_bytes[u] for u in held)),
            gradients=grads,
            optimizer=grads * self.optimizer_state_factor,
            gradient_sums=grads * self.gradient_sums_factor,
            ddp_buckets=grads if shape.dp_degree > 1 and not reduced_in_place else 0.0,
            activations=activations,
            boundary=boundary,
        )

    def _chunked_stage_memory(
        self, plan: PipelinePlan, stage: int, shape: LayoutShape, schedule: str
    ) -> StageMemory:
        """A stage of interleaved_1f1b or zero_bubble: its chunks' terms summed, the
        activations at the most the rank holds at once in its schedule's order (see the
        module docstring)."""
        frozen_end, m = plan.frozen_end, shape.num_micro_batches
        scale = shape.micro_batch_size / self.profile_micro_batch_size
        chunks = plan.chunks_of_stage(stage)
        units = plan.stage_units(stage)
        trained = [u for u in units if u >= frozen_end]
        held = units + (list(range(plan.prefix_end)) if stage == 0 else [])
        saved = [
            scale
            * sum(self.unit_saved_bytes(u) for u in range(*plan.stage_ranges[c]) if u >= frozen_end)
            for c in chunks
        ]
        order = rank_order(schedule, plan.pipe_len, plan.virtual_stages, m, stage)
        split = SCHEDULE_PROPERTIES[schedule].split_backward
        activations, in_flight = held_activations(order, saved, release="W" if split else "B")
        activations += scale * self.recompute_bytes(trained)
        boundary = sum(
            self._chunk_boundary(plan, chunk, most, m, shape.receive_buffer_share)
            for chunk, most in zip(chunks, in_flight)
        )
        boundary += self._prefix_boundary(plan, stage, m)
        return self._terms(held, trained, shape, activations, scale * boundary, split)

    def sharded_memory(self, plan: PipelinePlan, shape: LayoutShape) -> StageMemory:
        """One rank of a sharded layout (FSDP2 over `shape.dp_degree` ranks, `plan` a single
        stage, the replica batch in `shape.num_micro_batches` micro-batches of
        `shape.micro_batch_size`, one after the other): see the module docstring."""
        if plan.pipe_len != 1:
            raise ValueError("a sharded layout is one stage")
        shards = shape.dp_degree
        frozen_end, num_units = plan.frozen_end, len(self.param_bytes)
        trained = range(frozen_end, num_units)
        scale = shape.micro_batch_size / self.profile_micro_batch_size
        shard = sum(self.param_bytes[u] for u in trained) / shards
        activations = scale * sum(self.unit_saved_bytes(u) for u in trained)
        activations += scale * self.recompute_bytes(trained)
        largest = max(
            sum(self.param_bytes[u] for u in group) for group in shard_groups(frozen_end, num_units)
        )
        gathered = 4.0 * largest
        if not self.reshard_after_forward:  # every trained layer gathered until its backward
            gathered = float(sum(self.param_bytes[u] for u in trained)) + 2.0 * largest
        boundary = self.output_bytes[num_units - 1]
        if plan.prefix_end > 0:  # computed or read for the whole replica batch up front
            boundary += shape.num_micro_batches * self.output_bytes[plan.prefix_end - 1]
        return StageMemory(
            parameters=float(sum(self.param_bytes[: plan.prefix_end])) + shard,
            gradients=shard,
            optimizer=shard * self.optimizer_state_factor,
            gradient_sums=shard * self.gradient_sums_factor,
            ddp_buckets=0.0,
            activations=activations,
            boundary=scale * boundary,
            overlap=min(activations, shard) if shape.num_micro_batches == 1 else 0.0,
            gathered=gathered if shards > 1 else 0.0,
        )

    def sharded_move_bytes(
        self, plan: PipelinePlan, shards: int, stays_sharded_from: int | None = None
    ) -> float:
        """The most a rank holds while it leaves a sharded layout whose plan is `plan`: the
        trained units gathered in full with their optimizer state, on top of the shards (the
        handoff of autodp/handoff.py then runs as from a one-stage layout, whose every rank
        already holds every unit). `stays_sharded_from`: into another sharded layout, the
        units from there on stay shards and only those frozen between are gathered."""
        opt = self.optimizer_state_factor
        end = len(self.param_bytes) if stays_sharded_from is None else stays_sharded_from
        trained = sum(self.param_bytes[plan.frozen_end :]) * (1 + opt)
        gathered = sum(self.param_bytes[plan.frozen_end : end]) * (1 + opt)
        return sum(self.param_bytes[: plan.frozen_end]) + trained / shards + gathered

    def peak_bytes(self, plan: PipelinePlan, shape: LayoutShape) -> list[float]:
        return [self.stage_memory(plan, s, shape).total for s in range(plan.pipe_len)]

    def fits(self, plan: PipelinePlan, shape: LayoutShape, budget_bytes: float | None) -> bool:
        return budget_bytes is None or max(self.peak_bytes(plan, shape)) <= budget_bytes

    def move_bytes(
        self,
        transfers: Sequence[Move],
        rank: int,
        held: Iterable[int],
        trained: Iterable[int],
        keep: Iterable[int],
    ) -> float:
        """The most bytes `rank` holds while `transfers` run: `held`, the units it held in the
        old layout, `trained` those of them with optimizer state, `keep` those it holds next
        (see the module docstring)."""
        opt = self.optimizer_state_factor
        keep = set(keep)
        with_state = set(trained)
        units = set(held)
        last_send = {t.unit: i for i, t in enumerate(transfers) if t.src == rank}

        def unit_bytes(unit: int, state: bool) -> float:
            return self.param_bytes[unit] * (1 + (opt if state else 0.0))

        def holding() -> float:
            return sum(unit_bytes(u, u in with_state) for u in units)

        units -= {u for u in units if u not in keep and u not in last_send}
        peak = holding()
        for i, transfer in enumerate(transfers):
            if transfer.src == rank:
                in_flight = unit_bytes(transfer.unit, transfer.with_optimizer_state)
                peak = max(peak, holding() + in_flight)
                if last_send[transfer.unit] == i and transfer.unit not in keep:
                    units.discard(transfer.unit)
            elif transfer.dst == rank:
                arriving = unit_bytes(transfer.unit, transfer.with_optimizer_state)
                peak = max(peak, holding() + 2 * arriving)
                units.add(transfer.unit)
                if transfer.with_optimizer_state:
                    with_state.add(transfer.unit)
        return peak
