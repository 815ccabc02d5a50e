"""The frozen prefix on the first stage's device, served from AutoCache where it pays.

For a batch of sample ids at frozen boundary F (units [0, prefix_end(F))), every sample is
one of:

    hit      cached at F                    -> read, nothing computed
    upgrade  cached at an earlier F' < F    -> run only units [prefix_end(F'), prefix_end(F))
                                               on the cached value, store it at F
    miss     not cached                     -> run the whole prefix from the inputs, store it

so no sample runs through a frozen layer twice. Frozen units run in eval mode without
autograd (no dropout: the output is a pure function of the input, which is what makes a
cached value valid). Text runs at the batch's padded length: the store keeps each sample's
real rows and pads a read to that length with zeros (autocache/layout.py), where a
recomputed row holds what the prefix made of the padding tokens; no real token's output
depends on either (attention masks every padding key), so the step computes the same. A
packed batch (data.padding packed) is read and computed one sample a row at its rows'
length, as a padded one, and its samples' rows are then laid out packed
(utils/packing.py): the store holds per-sample rows whatever the padding, so entries
written under one padding serve the other.

On a GPU, cached rows travel from pinned staging buffers to the device on a stream of their
own, ordered by events (`_CopyStream`): the copy runs beside the compute stream's queued
work rather than in front of stage 0's compute.

Owns: that decision and the computation for one batch. Must not: decide whether caching
is on (the trainer's profiler does), own the store (the AutoCache daemon does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from pipetransformer.autocache.store import torch_dtype
from pipetransformer.models.layered import UnitSequence
from pipetransformer.pipe.transfer import to_device
from pipetransformer.utils.packing import Packing
from pipetransformer.utils.padding import PackedShape
from pipetransformer.utils.units import prefix_end


def _run(
    units: dict[int, nn.Module], start: int, end: int, x: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    if start == end:
        return x
    sequence = UnitSequence([units[u] for u in range(start, end)], [True] * (end - start))
    with torch.no_grad():
        out = sequence(*x)
    return out if isinstance(out, tuple) else (out,)


class _Staging:
    """Host buffers for one split's cached rows, reused every step: pinned on a GPU (so the
    copy to the device is asynchronous), two of them in turn, each reused only once the
    device has finished copying out of it. Sized for the largest batch at full length,
    viewed at the shapes of each batch's length."""

    def __init__(self, fields: Sequence, device) -> None:
        self.fields = fields  # autocache FieldLayouts
        self.on_cuda = device.type == "cuda"
        self.rows = 0
        self.buffers: list[tuple[torch.Tensor, ...]] = []
        self.copied: list[object | None] = [None, None]  # per buffer: the copy's CUDA event
        self.turn = 0

    def take(self, rows: int, length: int) -> tuple[torch.Tensor, ...]:
        if rows > self.rows:
            self.rows = rows
            self.buffers = [self._allocate(rows) for _ in range(2)]
            self.copied = [None, None]
        self.turn = 1 - self.turn
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()  # long done: it was two steps ago
        views = []
        for field, flat in zip(self.fields, self.buffers[self.turn]):
            shape = field.shape_at(length)
            views.append(flat[: rows * math.prod(shape)].view(rows, *shape))
        return tuple(views)

    def _allocate(self, rows: int) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.empty(
                rows * field.numel, dtype=torch_dtype(field.stored_dtype), pin_memory=self.on_cuda
            )
            for field in self.fields
        )

    def sent(self, stream=None) -> object | None:
        """The buffer just taken has been handed to a non-blocking copy on `stream` (the
        current one by default); returns the event that marks the copy's end (CUDA)."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        self.copied[self.turn] = event
        return event


class _CopyStream:
    """Cached rows to the device on a CUDA stream of their own, so the copy runs beside the
    compute stream's queued work (the previous step's backward and optimizer, which the
    host has run ahead of) instead of after it, in front of stage 0's compute: ViT-B/16 on
    CIFAR at 320 samples x 197 x 768 in bfloat16 is about 97 MB a step.

    The copy is ordered by events: the compute stream waits for the copy's event before it
    touches the rows (the conversion to float32 and everything after), and the host waits
    for it only before refilling that staging buffer (two steps later, `_Staging.take`).
    The rows are allocated on the copy stream and used on the compute stream: each is
    marked with `record_stream`, so the allocator does not hand its memory back to the copy
    stream while the compute stream may still read it."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.device = device

    def copy(self, staging: _Staging, cached: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            on_device = tuple(t.to(self.device, non_blocking=True) for t in cached)
        compute.wait_event(staging.sent(self.stream))
        for tensor in on_device:
            tensor.record_stream(compute)
        return on_device


class _PendingWrite:
    """Computed rows on their way to the store: cast to the stored dtype on the device,
    copied to the host without waiting, written once the copy is done (at the next call or
    a flush), so a step never waits for the device to hand its outputs back."""

    def __init__(self, split: str, ids: np.ndarray, values: tuple[torch.Tensor, ...]) -> None:
        self.split = split
        self.ids = ids
        on_cuda = values[0].device.type == "cuda"
        self.host = tuple(
            torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
            if on_cuda
            else v
            for v in values
        )
        self.done = None
        if on_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def write(self, client, layer: int) -> None:
        if self.done is not None:
            self.done.synchronize()
        client.write(self.split, self.ids, layer, self.host)


class CachedPrefix:
    """Computes the frozen prefix's output for a batch, reading and filling the cache."""

    def __init__(
        self,
        units: dict[int, nn.Module],
        num_frozen_layers: int,
        client,
        device: torch.device,
        counts: dict[str, int] | None = None,
        load_inputs: Callable[[str, Sequence[int]], Sequence[torch.Tensor]] | None = None,
        defer_writes: bool | None = None,
    ) -> None:
        """`load_inputs(split, ids, seq_length)`: the inputs of a batch on the device, for a
        batch the loader did not decode (every sample was cached when it was asked) that needs them.
        `defer_writes` (default: on a GPU) writes a call's computed rows at the next call or
        `flush()`, once their copy to the host is done, instead of waiting for it: another
        replica of the node may then compute a sample of the step just before once more
        (the same value). On the CPU the rows are on the host already: written at once."""
        self.units = units
        self.num_frozen_layers = num_frozen_layers
        self.end = prefix_end(num_frozen_layers)
        self.client = client
        self.device = device
        # hits / upgrades / misses by sample, shared with whoever reports them.
        self.counts = counts if counts is not None else {"hits": 0, "upgrades": 0, "misses": 0}
        self.load_inputs = load_inputs
        self._staging: dict[str, _Staging] = {}
        self._copies = _CopyStream(device) if device.type == "cuda" else None
        self._pending: list[_PendingWrite] = []
        self.defer_writes = device.type == "cuda" if defer_writes is None else defer_writes

    def flush(self) -> None:
        """Write every computed row still on its way (before the boundary moves)."""
        pending, self._pending = self._pending, []
        for write in pending:
            write.write(self.client, self.num_frozen_layers)

    def _read_staged(
        self, split: str, unique_ids: np.ndarray, length: int
    ) -> tuple[_Staging, np.ndarray, tuple[torch.Tensor, ...]]:
        """Tags of `unique_ids` and their stored rows (padded to `length` tokens, in the
        stored dtype) in this split's staging buffers on the host."""
        staging = self._staging.get(split)
        if staging is None:
            fields = self.client.layout(split).fields
            staging = self._staging[split] = _Staging(fields, self.device)
        buffers = staging.take(unique_ids.size, length)
        tags, cached = self.client.read(
            split, unique_ids, out=buffers, as_stored=True, length=length
        )
        return staging, tags, cached

    def _send(
        self, staging: _Staging, cached: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Staged rows to the device without waiting (on a side stream: `_CopyStream`),
        converted to float32 there."""
        if self._copies is not None:
            on_device = self._copies.copy(staging, cached)
        else:
            on_device = tuple(t.to(self.device, non_blocking=True) for t in cached)
            staging.sent()
        return tuple(t.float() if t.is_floating_point() else t for t in on_device)

    def _read_to_device(
        self, split: str, unique_ids: np.ndarray, length: int
    ) -> tuple[np.ndarray, tuple[torch.Tensor, ...] | None]:
        """Tags of `unique_ids`, and (when any is cached) their stored rows on the device in
        float32 padded to `length` tokens (read in the stored dtype, converted on the
        device)."""
        staging, tags, cached = self._read_staged(split, unique_ids, length)
        if not (tags >= 1).any():
            return tags, None
        return tags, self._send(staging, cached)

    def read_rows(self, split: str, ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The stored rows of `ids` (text at the longest of them) on the device exactly as a
        step reads cached rows (the pinned staging buffers, a copy without waiting, float32
        made on the device), whatever their tags: what the trainer times to decide whether
        caching pays (trainer/caching.py)."""
        ids_array = np.asarray(ids, dtype=np.int64)
        layout = self.client.layout(split)
        if layout.lengths is not None:
            length = max(layout.lengths[i] for i in ids_array.tolist())
        else:
            length = layout.max_length or 0
        staging, _, cached = self._read_staged(split, ids_array, length)
        return self._send(staging, cached)

    def __call__(
        self,
        split: str,
        ids: Sequence[int],
        inputs: Sequence[torch.Tensor] | None,
        seq_length: int | PackedShape | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The prefix's output for the batch `ids` of `split` at `seq_length` tokens (text;
        default the inputs' width, else the store's longest of `ids`), or packed in the
        shape `seq_length` (module docstring)."""
        if isinstance(seq_length, PackedShape):
            return self._packed(split, ids, inputs, seq_length)
        self.flush()  # the previous batch's rows: copied to the host by now
        ids_array = np.asarray(ids, dtype=np.int64)
        # Shape padding repeats samples: look each id up once, then scatter back.
        unique_ids, first_index, inverse = np.unique(
            ids_array, return_index=True, return_inverse=True
        )
        layout = self.client.layout(split)
        if seq_length is None and layout.lengths is not None:
            seq_length = (
                inputs[-1].shape[1]
                if inputs is not None
                else max(layout.lengths[i] for i in unique_ids.tolist())
            )
        length = seq_length if seq_length is not None else layout.max_length or 0
        tags, cached = self._read_to_device(split, unique_ids, length)
        frozen = self.num_frozen_layers
        hit = tags == frozen
        upgrade = (tags >= 1) & (tags < frozen)
        miss = ~(hit | upgrade)
        self.counts["hits"] += int(hit.sum())
        self.counts["upgrades"] += int(upgrade.sum())
        self.counts["misses"] += int(miss.sum())

        rows_out: list[tuple[np.ndarray, tuple[torch.Tensor, ...]]] = []
        if hit.any():
            index = to_device(torch.from_numpy(np.flatnonzero(hit)), self.device)
            rows_out.append((np.flatnonzero(hit), tuple(t[index] for t in cached)))
        computed: list[tuple[np.ndarray, tuple[torch.Tensor, ...]]] = []
        for tag in np.unique(tags[upgrade]):
            rows = np.flatnonzero(tags == tag)
            index = to_device(torch.from_numpy(rows), self.device)
            start = tuple(t[index] for t in cached)
            computed.append((rows, _run(self.units, prefix_end(int(tag)), self.end, start)))
        if miss.any():
            if inputs is None:
                inputs = self.load_inputs(split, ids, seq_length)
            rows = np.flatnonzero(miss)
            positions = to_device(torch.from_numpy(first_index[rows]), inputs[0].device)
            computed.append(
                (rows, _run(self.units, 0, self.end, tuple(t[positions] for t in inputs)))
            )
        rows_out += computed

        if computed:
            written_rows = np.concatenate([rows for rows, _ in computed])
            stored = [torch_dtype(f.stored_dtype) for f in layout.fields]
            written = tuple(
                torch.cat([values[i] for _, values in computed]).to(dtype)
                for i, dtype in enumerate(stored)
            )
            self._pending.append(_PendingWrite(split, unique_ids[written_rows], written))
            if not self.defer_writes:
                self.flush()

        # Assemble in unique-id order, then expand to the batch's order (with repeats).
        count = len(unique_ids)
        template = rows_out[0][1]
        assembled = [
            torch.empty((count, *t.shape[1:]), dtype=t.dtype, device=self.device) for t in template
        ]
        for rows, values in rows_out:
            index = to_device(torch.from_numpy(rows), self.device)
            for target, value in zip(assembled, values):
                target[index] = value.to(target.dtype)
        order = to_device(torch.from_numpy(inverse.reshape(-1)), self.device)
        return tuple(t[order] for t in assembled)

    def _packed(
        self,
        split: str,
        ids: Sequence[int],
        inputs: Sequence[torch.Tensor] | None,
        shape: PackedShape,
    ) -> tuple[torch.Tensor, ...]:
        """A packed batch's prefix output: its samples' rows one a row at the rows' length
        (read, upgraded or computed from its inputs unpacked), laid out packed."""
        lengths = self.client.layout(split).lengths
        packing = Packing([lengths[i] for i in ids], shape)
        padded = None if inputs is None else packing.padded_inputs(inputs)
        hidden, _ = self(split, ids, padded, shape.row_length)
        device = hidden.device
        segments, starts = (to_device(t, device) for t in (packing.segments, packing.starts))
        return packing.pack(hidden), segments, starts
