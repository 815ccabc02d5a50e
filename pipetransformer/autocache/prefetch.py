"""Reads disk-tier rows ahead of the trainer, in the order it announced, on a thread.

Owns: one background thread per (client, split) and a bounded buffer of rows copied out of
the disk tier. The plan is the disk-tier ids of the latest hint, in order; the thread keeps
the rows at plan positions [reached, reached + window) loaded, where `reached` is one past
the furthest plan position a read has asked for. Rows the reader has passed are dropped,
so the buffer never holds more than `window` rows (loaded in chunks of CHUNK_ROWS rows,
each kept while any of its rows is buffered: memory for at most window + 2 * CHUNK_ROWS
rows), and a hint that is never read costs that memory and an idle thread.
Must not: write to the store, make a read wait (a read takes what is buffered and reads the
rest itself), or serve a row whose tag changed after it was buffered.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np
import torch

from pipetransformer.autocache.store import SplitStore

logger = logging.getLogger(__name__)

# Rows loaded per step of the thread: large enough for sequential reads, small enough
# that the first rows of a window arrive early.
CHUNK_ROWS = 32

# Buffered rows of one chunk: a tensor per field, stored dtype, batch-first, padded to the
# chunk's longest sample (store.py), and that length.
Chunk = tuple[list[torch.Tensor], int]


class SplitPrefetcher:
    """Background reader of one split's disk tier."""

    def __init__(self, store: SplitStore) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._plan = np.empty(0, dtype=np.int64)
        self._position: dict[int, int] = {}
        self._window = 0
        self._fill = 0  # next plan position to load
        self._reached = 0  # plan positions before this one will not be read
        self._generation = 0
        # id -> (plan position, tag when loaded, its chunk, row in the chunk); in plan order.
        self._buffer: OrderedDict[int, tuple[int, int, Chunk, int]] = OrderedDict()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"autocache-prefetch-{store.layout.name}", daemon=True
        )
        self._thread.start()

    def hint(self, ids: np.ndarray, window_rows: int) -> None:
        """Replace the plan: these ids will be read next, in this order."""
        disk_ids = ids[ids >= self._store.layout.memory_rows]
        _, first = np.unique(disk_ids, return_index=True)  # a repeated id: its first read
        disk_ids = disk_ids[np.sort(first)]
        position = {sample: k for k, sample in enumerate(disk_ids.tolist())}
        with self._cond:
            self._generation += 1
            self._plan, self._position, self._window = disk_ids, position, max(0, window_rows)
            self._fill = self._reached = 0
            self._buffer.clear()
            self._cond.notify()

    def take(self, ids: np.ndarray, tags: np.ndarray) -> dict[int, tuple[Chunk, int]]:
        """Remove and return (chunk, row) of the buffered `ids` whose tag is still `tags`."""
        taken: dict[int, tuple[Chunk, int]] = {}
        with self._cond:
            reached = self._reached
            for sample, tag in zip(ids.tolist(), tags.tolist()):
                position = self._position.get(sample)
                if position is None:
                    continue
                reached = max(reached, position + 1)
                entry = self._buffer.pop(sample, None)
                if entry is not None and entry[1] == tag:
                    taken[sample] = (entry[2], entry[3])
            if reached > self._reached:
                self._reached = reached
                while self._buffer and next(iter(self._buffer.values()))[0] < reached:
                    self._buffer.popitem(last=False)
        return taken

    def resume(self) -> None:
        """Let the thread refill the window. Called after a read, not inside it: the read
        is on the trainer's critical path, the refill should overlap its compute instead."""
        with self._cond:
            self._cond.notify()

    def invalidate(self, ids: np.ndarray) -> None:
        """Forget buffered copies of rows that were just written."""
        with self._cond:
            if self._buffer:
                for sample in ids.tolist():
                    self._buffer.pop(sample, None)

    def buffered_rows(self) -> int:
        with self._cond:
            return len(self._buffer)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._buffer.clear()
            self._cond.notify()
        self._thread.join(timeout=10)

    def _has_work(self) -> bool:
        self._fill = max(self._fill, self._reached)
        return self._fill < min(len(self._plan), self._reached + self._window)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._has_work())
                    if self._stopping:
                        return
                    start = self._fill
                    end = min(len(self._plan), self._reached + self._window, start + CHUNK_ROWS)
                    plan_ids, generation = self._plan[start:end], self._generation
                    self._fill = end
                ids, tags, chunk = self._load(plan_ids)  # outside the lock: reads go on
                with self._cond:
                    if generation != self._generation:
                        continue
                    # In plan order, which `take` relies on to drop passed rows from the front.
                    loaded = [
                        (self._position[i], i, t, r)
                        for r, (i, t) in enumerate(zip(ids.tolist(), tags.tolist()))
                    ]
                    for position, sample, tag, row in sorted(loaded):
                        if position >= self._reached and tag >= 0:
                            self._buffer[sample] = (position, tag, chunk, row)
        except Exception:  # reads still work without it, from the disk tier
            logger.exception("prefetch thread of split %s failed", self._store.layout.name)

    def _load(self, plan_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, Chunk]:
        """Copy the present rows of `plan_ids` out of the disk tier, tags checked around it.

        Returns (ids, tags, chunk): row r of the chunk holds ids[r], valid if tags[r] >= 0
        (a row whose tag changed during the copy gets -1).
        """
        ids = np.sort(plan_ids[self._store.read_tags(plan_ids) >= 0])  # sequential reads
        if ids.size == 0:
            return ids, ids, ([], 0)
        tags = self._store.read_tags(ids)
        length = self._store.batch_length(ids)
        chunk = (self._store.gather(ids, length, convert=False), length)
        tags[self._store.read_tags(ids) != tags] = -1
        return ids, tags, chunk
