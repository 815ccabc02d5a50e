"""A process's handle on the node's AutoCache: attach, read, write, prefetch, count.

Owns: this process's mappings of the store (one SplitStore per split, found through the
manifest the daemon published at `address`), argument checks, the prefetch threads, and
this process's counters (CacheStats). It opens the manifest and the data files only as
regular files of this user, closed to others, in a private directory of this user, never
through a symlink (private.py), and refuses anything else with UnsafeStore naming the path.
Must not: create or remove files (the daemon does), decide hit / upgrade / miss against
the current frozen boundary (the trainer compares the tags; the store keeps the latest
write per sample), or move tensors through pipes or sockets: values travel through
shared pages only. Attach after forking, not before: threads and mappings are per
process; and use one client from one thread (its counters are not locked).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipetransformer.autocache.layout import ABSENT, CacheManifest, SplitLayout
from pipetransformer.autocache.prefetch import Chunk, SplitPrefetcher
from pipetransformer.autocache.private import open_private_file
from pipetransformer.autocache.store import SplitStore, torch_dtype

logger = logging.getLogger(__name__)

Ids = Sequence[int] | np.ndarray | torch.Tensor


@dataclass
class CacheStats:
    """Counters of one client since attach or `reset_stats`, plus store-wide footprints."""

    hits: int = 0  # rows read with a tag (>= 0)
    misses: int = 0  # rows read without one (-1)
    upgrades: int = 0  # set by the trainer through `count_upgrades`
    bytes_read: int = 0  # stored bytes of the hit samples (at their real lengths)
    bytes_written: int = 0
    read_seconds: float = 0.0
    disk_rows_read: int = 0  # disk-tier rows read by `read` itself
    prefetched_rows: int = 0  # disk-tier rows served from the prefetch buffer
    bytes_in_memory: int = 0  # whole store: stored bytes of samples with a tag in memory
    bytes_on_disk: int = 0  # whole store: stored bytes of samples with a tag on disk

    @property
    def read_bytes_per_s(self) -> float:
        return self.bytes_read / self.read_seconds if self.read_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "read_bytes_per_s": self.read_bytes_per_s}


def _read_dtype(field, as_stored: bool) -> torch.dtype:
    return torch_dtype(field.stored_dtype if as_stored else field.returned_dtype)


class CacheClient:
    """Reads and writes the node's store directly in shared memory and the disk tier."""

    def __init__(self, manifest: CacheManifest, address: str, prefetch_window_rows: int) -> None:
        self.address = address
        self.manifest = manifest
        self.prefetch_window_rows = prefetch_window_rows
        self._stores = {layout.name: SplitStore(layout) for layout in manifest.splits}
        self._prefetchers: dict[str, SplitPrefetcher] = {}
        self._stats = CacheStats()

    @classmethod
    def attach(cls, address: str, prefetch_window_rows: int = 256) -> CacheClient:
        """Map the store published at `address` (CacheDaemon.address) into this process."""
        path = Path(address)
        try:  # only from a private directory of this user (private.py), never via a symlink
            fd = open_private_file(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no AutoCache at {address}: its daemon is not running or has stopped"
            ) from None
        with os.fdopen(fd) as f:
            manifest = CacheManifest.from_json(f.read())
        return cls(manifest, address, prefetch_window_rows)

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self._stores)

    def layout(self, split: str) -> SplitLayout:
        return self._store(split).layout

    def read(
        self,
        split: str,
        ids: Ids,
        out: Sequence[torch.Tensor] | None = None,
        as_stored: bool = False,
        length: int | None = None,
    ) -> tuple[np.ndarray, tuple[torch.Tensor, ...]]:
        """Tags (int64, -1 = absent) and batch-first tensors of `ids`, text padded to
        `length` tokens (default the longest of `ids`; zeros past each sample's length);
        floats as float32, or in the dtype the store holds them in with `as_stored` (half
        the bytes of a bfloat16 store to copy to a device, which converts them there).

        Rows whose tag is -1 hold undefined values. `out`: CPU tensors (e.g. pinned, reused
        every step) to fill instead of allocating; they are returned.
        """
        store = self._store(split)
        ids = store.check_ids(ids)
        length = store.batch_length(ids, length)
        if out is not None:
            self._check_out(store, ids.size, out, as_stored, length)
        start = time.perf_counter()
        tags = store.read_tags(ids)
        on_disk = ids >= store.layout.memory_rows
        taken: dict[int, tuple[list[torch.Tensor], int]] = {}
        prefetcher = self._prefetchers.get(split)
        if prefetcher is not None and on_disk.any():
            taken = prefetcher.take(ids[on_disk], tags[on_disk])
        if taken:
            from_buffer = np.fromiter(
                (i in taken for i in ids.tolist()), dtype=bool, count=ids.size
            )
            tensors = self._assemble(store, ids, from_buffer, taken, out, as_stored, length)
        else:
            from_buffer = np.zeros(ids.size, dtype=bool)
            tensors = store.gather(ids, length, convert=not as_stored, out=out)
        # A row rewritten while it was copied may be torn: report it as absent.
        tags[store.read_tags(ids) != tags] = ABSENT
        elapsed = time.perf_counter() - start
        hits = int(np.count_nonzero(tags >= 0))
        self._stats.hits += hits
        self._stats.misses += ids.size - hits
        self._stats.bytes_read += int(store.sample_bytes[ids[tags >= 0]].sum())
        self._stats.read_seconds += elapsed
        self._stats.prefetched_rows += int(np.count_nonzero(from_buffer))
        self._stats.disk_rows_read += int(np.count_nonzero(on_disk & ~from_buffer))
        if prefetcher is not None and on_disk.any():
            prefetcher.resume()
        return tags, tuple(tensors)

    @staticmethod
    def _assemble(
        store: SplitStore,
        ids: np.ndarray,
        from_buffer: np.ndarray,
        taken: dict[int, tuple[Chunk, int]],
        out: Sequence[torch.Tensor] | None,
        as_stored: bool,
        length: int,
    ) -> list[torch.Tensor]:
        """A batch from prefetched rows plus rows read from the store now."""
        if out is None:
            out = [
                torch.empty(
                    (ids.size, *field.shape_at(length)), dtype=_read_dtype(field, as_stored)
                )
                for field in store.fields
            ]
        rest = np.flatnonzero(~from_buffer)
        if rest.size:
            store.gather(ids[rest], length, convert=not as_stored, out=out, positions=rest)
        # Row by row: no intermediate batch, and copy_ converts from the stored dtype. A
        # chunk is padded to its own longest sample: a sample's real rows, and the extra
        # rows after the padding, go where the batch's length puts them.
        for position in np.flatnonzero(from_buffer).tolist():
            sample = int(ids[position])
            (chunk, chunk_length), row = taken[sample]
            real = int(store.lengths[sample])
            for field, batch, rows in zip(store.fields, out, chunk):
                if field.extra_rows is None:
                    batch[position].copy_(rows[row])
                    continue
                batch[position].zero_()
                batch[position, :real].copy_(rows[row, :real])
                batch[position, length:].copy_(rows[row, chunk_length:])
        return list(out)

    @staticmethod
    def _check_out(
        store: SplitStore,
        batch_size: int,
        out: Sequence[torch.Tensor],
        as_stored: bool,
        length: int,
    ) -> None:
        if len(out) != len(store.fields):
            raise ValueError(f"out: expected {len(store.fields)} tensors, got {len(out)}")
        for index, (tensor, field) in enumerate(zip(out, store.fields)):
            shape, dtype = (batch_size, *field.shape_at(length)), _read_dtype(field, as_stored)
            if (
                tuple(tensor.shape) != shape
                or tensor.dtype != dtype
                or tensor.device.type != "cpu"
                or not tensor.is_contiguous()
            ):
                raise ValueError(
                    f"out[{index}]: expected a contiguous CPU {dtype} tensor of shape {shape}, "
                    f"got {tensor.device.type} {tensor.dtype} {tuple(tensor.shape)}"
                )

    def serves_all(self, split: str, ids: Ids, layer: int) -> bool:
        """Whether every one of `ids` is stored, tagged `layer` (tags only: no values read)."""
        store = self._store(split)
        return bool(np.all(store.read_tags(store.check_ids(ids)) == layer))

    def write(self, split: str, ids: Ids, layer: int, tensors: Sequence[torch.Tensor]) -> None:
        """Store batch-first `tensors` as rows `ids`, tagged with `layer` (>= 0); text
        padded to any length that holds the samples (each is stored at its real length)."""
        store = self._store(split)
        ids = store.check_ids(ids)
        if isinstance(layer, bool) or int(layer) != layer or layer < 0:
            raise ValueError(f"layer must be an int >= 0, got {layer!r}")
        if np.unique(ids).size != ids.size:
            raise ValueError("write: sample ids must not repeat within one call")
        if len(tensors) != len(store.fields):
            raise ValueError(
                f"split {split!r} stores {len(store.fields)} tensors per sample, got {len(tensors)}"
            )
        length = store.tensors_length(tensors)
        for index, (tensor, field) in enumerate(zip(tensors, store.fields)):
            expected = (ids.size, *field.shape_at(length))
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"split {split!r} tensor {index}: expected shape {expected}, "
                    f"got {tuple(tensor.shape)}"
                )
        # Host tensors as they are (a step hands over rows already copied to the host).
        store.write(
            ids, int(layer), [t.detach() if t.is_cpu else t.detach().cpu() for t in tensors]
        )
        if split in self._prefetchers:
            self._prefetchers[split].invalidate(ids)
        self._stats.bytes_written += int(store.sample_bytes[ids].sum())

    def prefetch(self, split: str, ids: Ids, window_rows: int | None = None) -> None:
        """Hint: `ids` will be read next, in this order. Loads disk-tier rows ahead.

        Replaces the previous hint for `split`; keeps at most `window_rows` rows (default
        `prefetch_window_rows`) buffered ahead of the furthest row read so far.
        """
        store = self._store(split)
        if store.layout.disk_rows == 0:
            return
        ids = store.check_ids(ids)
        if split not in self._prefetchers:
            self._prefetchers[split] = SplitPrefetcher(store)
        window = self.prefetch_window_rows if window_rows is None else window_rows
        self._prefetchers[split].hint(ids, window)

    def buffered_rows(self, split: str) -> int:
        """Rows of `split` waiting in the prefetch buffer."""
        prefetcher = self._prefetchers.get(split)
        return prefetcher.buffered_rows() if prefetcher is not None else 0

    def count_upgrades(self, n: int) -> None:
        self._stats.upgrades += n

    def stats(self) -> CacheStats:
        stats = dataclasses.replace(self._stats)
        for store in self._stores.values():
            in_memory, on_disk = store.count_present()
            stats.bytes_in_memory += in_memory
            stats.bytes_on_disk += on_disk
        return stats

    def reset_stats(self) -> None:
        self._stats = CacheStats()

    def drop_disk_page_cache(self, split: str) -> None:
        """Evict `split`'s disk tier from the OS page cache (for cold-read benchmarks)."""
        self._store(split).drop_disk_page_cache()

    def close(self) -> None:
        """Stop the prefetch threads and unmap. Idempotent; never removes a file."""
        for prefetcher in self._prefetchers.values():
            prefetcher.close()
        self._prefetchers.clear()
        for store in self._stores.values():
            store.close()
        self._stores.clear()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _store(self, split: str) -> SplitStore:
        try:
            return self._stores[split]
        except KeyError:
            if not self._stores:
                raise RuntimeError("this CacheClient is closed") from None
            raise KeyError(
                f"unknown cache split {split!r}; this cache holds: {', '.join(self._stores)}"
            ) from None
