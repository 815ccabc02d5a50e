"""One split of the store as seen from one client process: mappings and row copies.

Owns: the mappings of a split's shared-memory file (tags + memory-tier slots) and of its
disk-tier file, the torch views over them (one per tensor per tier, zero-copy: reads and
writes go straight into the shared pages), gathering rows for a read, scattering rows for
a write, and the order in which a write publishes its rows.
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


def _field_views(
    buffer: mmap.mmap, offset: int, rows: int, layout: SplitLayout
) -> list[torch.Tensor]:
    """One (rows, *shape) view per tensor over `rows` slots starting at byte `offset`."""
    if rows == 0:
        return []
    slots = torch.frombuffer(
        buffer, dtype=torch.uint8, count=rows * layout.slot_bytes, offset=offset
    )
    slots = slots.view(rows, layout.slot_bytes)
    views = []
    for field in layout.fields:
        raw = slots[:, field.offset : field.offset + field.nbytes]
        views.append(raw.view(torch_dtype(field.stored_dtype)).view(rows, *field.shape))
    return views


class SplitStore:
    """Tags and slots of one split, mapped into this process."""

    def __init__(self, layout: SplitLayout) -> None:
        self.layout = layout
        self._maps = [_map(layout.shm_path, layout.shm_bytes)]
        self.tags: np.ndarray = np.frombuffer(
            self._maps[0], dtype=np.int64, count=layout.num_samples
        )
        self.memory = _field_views(self._maps[0], layout.slots_offset, layout.memory_rows, layout)
        self.disk: list[torch.Tensor] = []
        self._scratch_buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        if layout.disk_path is not None:
            self._maps.append(_map(layout.disk_path, layout.disk_bytes))
            self.disk = _field_views(self._maps[1], 0, layout.disk_rows, layout)

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

    def gather(
        self,
        ids: np.ndarray,
        convert: bool = True,
        out: Sequence[torch.Tensor] | None = None,
        positions: np.ndarray | None = None,
    ) -> list[torch.Tensor]:
        """Batch-first tensors of the rows `ids`, in the returned (or stored) dtype.

        Fresh tensors, or `out` (one per tensor of the slot, shape and dtype checked by the
        caller) filled in place: row k goes to `out[...][positions[k]]` (default: k).
        Intermediate copies go through reused scratch tensors, because a fresh
        multi-megabyte tensor costs more in first-touch page faults than the copy itself.
        """
        in_memory = ids < self.layout.memory_rows
        if in_memory.all():
            parts = [(self.memory, ids, positions)]
        elif not in_memory.any():
            parts = [(self.disk, ids - self.layout.memory_rows, positions)]
        else:
            if positions is None:
                positions = np.arange(ids.size)
            parts = [
                (self.memory, ids[in_memory], positions[in_memory]),
                (self.disk, ids[~in_memory] - self.layout.memory_rows, positions[~in_memory]),
            ]
        result = []
        for index, field in enumerate(self.fields):
            dtype = torch_dtype(field.returned_dtype if convert else field.stored_dtype)
            if out is None and len(parts) == 1 and parts[0][2] is None:
                # Fresh tensors: one copy (two when the dtype changes).
                source, rows = parts[0][0][index], torch.from_numpy(parts[0][1])
                result.append(torch.index_select(source, 0, rows).to(dtype))
                continue
            target = (
                out[index]
                if out is not None
                else torch.empty((ids.size, *field.shape), dtype=dtype)
            )
            for views, rows, where in parts:
                source, rows = views[index], torch.from_numpy(rows)
                if where is None and source.dtype == dtype:
                    torch.index_select(source, 0, rows, out=target)
                    continue
                scratch = self._scratch(index, source.dtype, rows.numel())
                selected = torch.index_select(source, 0, rows, out=scratch)
                if where is None:
                    target.copy_(selected)
                    continue
                if source.dtype != dtype:
                    selected = self._scratch(index, dtype, rows.numel()).copy_(selected)
                target.index_copy_(0, torch.from_numpy(where), selected)
            result.append(target)
        return result

    def _scratch(self, index: int, dtype: torch.dtype, rows: int) -> torch.Tensor:
        """A reused (rows, *shape) tensor. Only the reading thread gathers through it (the
        prefetch thread gathers whole disk-tier chunks into fresh tensors)."""
        buffer = self._scratch_buffers.get((index, dtype))
        if buffer is None or buffer.shape[0] < rows:
            buffer = torch.empty((rows, *self.fields[index].shape), dtype=dtype)
            self._scratch_buffers[(index, dtype)] = buffer
        return buffer[:rows]

    def write(self, ids: np.ndarray, layer: int, tensors: Sequence[torch.Tensor]) -> None:
        """Store rows and publish them with tag `layer` (ordering: see the module docstring)."""
        self.tags[ids] = ABSENT
        in_memory = ids < self.layout.memory_rows
        parts = [
            (self.memory, ids[in_memory], in_memory),
            (self.disk, ids[~in_memory] - self.layout.memory_rows, ~in_memory),
        ]
        for views, rows, selected in parts:
            if rows.size == 0:
                continue
            select_all = rows.size == ids.size
            mask = torch.from_numpy(selected)
            for view, tensor in zip(views, tensors):
                source = tensor if select_all else tensor[mask]
                view.index_copy_(0, torch.from_numpy(rows), source.to(view.dtype))
        self.tags[ids] = layer

    def count_present(self) -> tuple[int, int]:
        """Rows with a tag, in the memory tier and in the disk tier."""
        present = self.tags >= 0
        in_memory = int(np.count_nonzero(present[: self.layout.memory_rows]))
        return in_memory, int(np.count_nonzero(present)) - in_memory

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
        self._scratch_buffers.clear()
        self.tags = np.empty(0, dtype=np.int64)
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:  # a view is still referenced; the mapping goes with it
                logger.debug("a view of %s outlives close()", self.layout.name)
        self._maps = []
