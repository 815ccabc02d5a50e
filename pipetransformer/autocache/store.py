"""One split of the store as seen from one client process: mappings and row copies.

Owns: the mappings of a split's shared-memory file (tags + memory tier) and of its
disk-tier file, the torch views over them (one per field per tier, zero-copy: reads and
writes go straight into the shared pages), gathering a batch's rows padded to the length
it asks for, taking each sample's real rows out of a padded batch for a write (layout.py
says how samples are packed), and the order in which a write publishes its rows.
Must not: create, resize or remove files (the daemon owns them), keep statistics or
prefetch state (the client does).

Write ordering. A row is published by its tag, so a write goes: (1) set the rows' tags to
-1, (2) copy the data into the slots, (3) set the tags to the new layer count. Steps are
separate numpy/torch operations, finished in program order, and x86-64 (TSO) makes stores
visible to other cores in that order. A reader does the mirror image: read tags, copy
data, read tags again, and treats a row whose tag changed in between as absent. So a
reader never takes half-written data for a hit, even when a row is overwritten (upgraded)
while it is read. In this system each sample is written by one process at a time (each
epoch gives each sample to one replica), which the scheme needs: two concurrent writers of
one row are not serialised. On weakly ordered CPUs (ARM) Python offers no store fence, so
there the guarantee rests on the trainer not reading a row while another process writes it.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pipetransformer.autocache.layout import ABSENT, FieldLayout, SplitLayout
from pipetransformer.autocache.private import open_private_file

logger = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _map(path: str, size: int) -> mmap.mmap:
    fd = open_private_file(Path(path), os.O_RDWR)  # in a private directory, not a symlink
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _region_views(
    buffer: mmap.mmap, offset: int, first: int, end: int, layout: SplitLayout
) -> list[torch.Tensor]:
    """One (rows, *row_shape) view per field over the regions of samples first .. end - 1,
    a tier starting at byte `offset` of `buffer`."""
    if end <= first:
        return []
    views = []
    for field, region in zip(layout.fields, layout.region_offsets(first, end)):
        rows = layout.field_rows(field, first, end)
        raw = torch.frombuffer(
            buffer, dtype=torch.uint8, count=rows * field.row_bytes, offset=offset + region
        )
        views.append(raw.view(torch_dtype(field.stored_dtype)).view(rows, *field.row_shape))
    return views


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """0 .. c - 1 for each c of `counts`, concatenated."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if ends.size else 0) - np.repeat(ends - counts, counts)


class SplitStore:
    """Tags and rows of one split, mapped into this process."""

    def __init__(self, layout: SplitLayout) -> None:
        self.layout = layout
        self._maps = [_map(layout.shm_path, layout.shm_bytes)]
        self.tags: np.ndarray = np.frombuffer(
            self._maps[0], dtype=np.int64, count=layout.num_samples
        )
        n, m = layout.num_samples, layout.memory_rows
        self.memory = _region_views(self._maps[0], layout.slots_offset, 0, m, layout)
        self.disk: list[torch.Tensor] = []
        # Per thread: the reading thread and the prefetch thread both gather.
        self._scratch_local = threading.local()
        if layout.disk_path is not None:
            self._maps.append(_map(layout.disk_path, layout.disk_bytes))
            self.disk = _region_views(self._maps[1], 0, m, n, layout)
        # Per sample: real length, and per field its rows and first row in its tier.
        self.lengths = np.fromiter((layout.length(i) for i in range(n)), np.int64, count=n)
        self.rows: list[np.ndarray] = []
        self.starts: list[np.ndarray] = []
        for field in layout.fields:
            rows = (
                np.ones(n, np.int64)
                if field.extra_rows is None
                else self.lengths + field.extra_rows
            )
            starts = np.cumsum(rows) - rows
            starts[m:] -= starts[m] if m < n else 0
            self.rows.append(rows)
            self.starts.append(starts)
        self.sample_bytes = sum(r * f.row_bytes for r, f in zip(self.rows, layout.fields))

    @property
    def fields(self) -> tuple[FieldLayout, ...]:
        return self.layout.fields

    def check_ids(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """Sample ids as an int64 array, each checked against the split's size."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= self.layout.num_samples):
            raise IndexError(
                f"sample ids of split {self.layout.name!r} must be in "
                f"[0, {self.layout.num_samples}), got {array.min()}..{array.max()}"
            )
        return array

    def read_tags(self, ids: np.ndarray) -> np.ndarray:
        return self.tags[ids]  # fancy indexing copies

    def batch_length(self, ids: np.ndarray, length: int | None = None) -> int:
        """`length`, checked to hold every one of `ids`; default the longest of them."""
        longest = int(self.lengths[ids].max()) if ids.size else 0
        if length is None:
            return longest
        if not longest <= length <= (self.layout.max_length or length):
            raise ValueError(
                f"split {self.layout.name!r}: a batch of {length} tokens must hold its "
                f"longest sample ({longest}) and at most max_length ({self.layout.max_length})"
            )
        return length

    def shapes(self, length: int) -> list[tuple[int, ...]]:
        """Each field's per-sample shape in a batch padded to `length` tokens."""
        return [field.shape_at(length) for field in self.fields]

    def _rows(
        self, index: int, ids: np.ndarray, positions: np.ndarray, length: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rows in the tier's region, rows in a flat (batch * rows_at_length) view) of field
        `index` for samples `ids` at batch `positions`: a sample's real rows, the extra rows
        (DeBERTa's table) after the padding."""
        field = self.fields[index]
        counts = self.rows[index][ids]
        offsets = ragged_arange(counts)
        source = np.repeat(self.starts[index][ids], counts) + offsets
        if field.extra_rows is None:
            return source, np.repeat(positions, counts) + offsets
        real = np.repeat(self.lengths[ids], counts)
        padding = np.where(offsets >= real, length - real, 0)
        batch_rows = field.rows(length)
        return source, np.repeat(positions * batch_rows, counts) + offsets + padding

    def gather(
        self,
        ids: np.ndarray,
        length: int | None = None,
        convert: bool = True,
        out: Sequence[torch.Tensor] | None = None,
        positions: np.ndarray | None = None,
    ) -> list[torch.Tensor]:
        """Batch-first tensors of the samples `ids` padded to `length` tokens (default their
        longest; zeros past each sample's own), in the returned (or stored) dtype.

        Fresh tensors, or `out` (one per field, shape and dtype checked by the caller)
        filled in place: sample k goes to `out[...][positions[k]]` (default: k).
        Intermediate copies go through reused scratch tensors, because a fresh
        multi-megabyte tensor costs more in first-touch page faults than the copy itself.
        """
        length = self.batch_length(ids, length)
        where = np.arange(ids.size) if positions is None else positions
        in_memory = ids < self.layout.memory_rows
        result = []
        for index, field in enumerate(self.fields):
            dtype = torch_dtype(field.returned_dtype if convert else field.stored_dtype)
            target = (
                out[index]
                if out is not None
                else torch.empty((ids.size, *field.shape_at(length)), dtype=dtype)
            )
            if positions is None:
                target.zero_()
            else:
                target.index_fill_(0, torch.from_numpy(positions), 0)
            flat = target.view(-1, *field.row_shape)
            for views, tier in ((self.memory, in_memory), (self.disk, ~in_memory)):
                if not tier.any():
                    continue
                source_rows, batch_rows = self._rows(index, ids[tier], where[tier], length)
                source = views[index]
                scratch = self._scratch(index, source.dtype, source_rows.size)
                selected = torch.index_select(source, 0, torch.from_numpy(source_rows), out=scratch)
                flat.index_copy_(0, torch.from_numpy(batch_rows), selected.to(dtype))
            result.append(target)
        return result

    def _scratch(self, index: int, dtype: torch.dtype, rows: int) -> torch.Tensor:
        """A reused (rows, *row_shape) tensor of the calling thread: the reading thread and the
        prefetch thread (which gathers disk-tier chunks while a step reads) each have their
        own, so neither overwrites rows the other is copying out."""
        buffers = getattr(self._scratch_local, "buffers", None)
        if buffers is None:
            buffers = self._scratch_local.buffers = {}
        buffer = buffers.get((index, dtype))
        if buffer is None or buffer.shape[0] < rows:
            buffer = torch.empty((rows, *self.fields[index].row_shape), dtype=dtype)
            buffers[(index, dtype)] = buffer
        return buffer[:rows]

    def write(self, ids: np.ndarray, layer: int, tensors: Sequence[torch.Tensor]) -> None:
        """Store each sample's real rows of batch-first `tensors` (padded to any length that
        holds them) and publish them with tag `layer` (ordering: see the module docstring)."""
        length = self.tensors_length(tensors)
        self.batch_length(ids, length)
        self.tags[ids] = ABSENT
        in_memory = ids < self.layout.memory_rows
        positions = np.arange(ids.size)
        for index, (field, tensor) in enumerate(zip(self.fields, tensors)):
            flat = tensor.reshape(-1, *field.row_shape)
            for views, tier in ((self.memory, in_memory), (self.disk, ~in_memory)):
                if not tier.any():
                    continue
                store_rows, batch_rows = self._rows(index, ids[tier], positions[tier], length)
                view = views[index]
                rows = flat.index_select(0, torch.from_numpy(batch_rows)).to(view.dtype)
                view.index_copy_(0, torch.from_numpy(store_rows), rows)
        self.tags[ids] = layer

    def tensors_length(self, tensors: Sequence[torch.Tensor]) -> int:
        """The token length batch-first `tensors` of this split are padded to (checked to be
        one for every sequence field; max_length without any)."""
        lengths = {
            int(t.shape[1]) - f.extra_rows
            for f, t in zip(self.fields, tensors)
            if f.extra_rows is not None and t.dim() > 1
        }
        if len(lengths) > 1:
            raise ValueError(f"split {self.layout.name!r}: tensors of several lengths {lengths}")
        return lengths.pop() if lengths else self.layout.max_length or 0

    def count_present(self) -> tuple[int, int]:
        """Stored bytes of the samples with a tag, in the memory tier and in the disk tier."""
        present = self.tags >= 0
        m = self.layout.memory_rows
        return int(self.sample_bytes[:m][present[:m]].sum()), int(
            self.sample_bytes[m:][present[m:]].sum()
        )

    def drop_disk_page_cache(self) -> None:
        """Write back and evict the disk tier's pages, so the next read is cold (benchmarks)."""
        if len(self._maps) < 2 or self.layout.disk_path is None:
            return
        disk_map = self._maps[1]
        disk_map.flush()
        disk_map.madvise(mmap.MADV_DONTNEED)
        fd = open_private_file(Path(self.layout.disk_path), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap. The files stay: only the daemon removes them."""
        self.memory, self.disk = [], []
        self._scratch_local = threading.local()
        self.tags = np.empty(0, dtype=np.int64)
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:  # a view is still referenced; the mapping goes with it
                logger.debug("a view of %s outlives close()", self.layout.name)
        self._maps = []
