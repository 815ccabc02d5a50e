"""Slot layout of the AutoCache store: pure arithmetic on plain values.

Owns: the dtype table, the static split of each data split's samples between the memory
tier and the disk tier, the byte offset of every tensor inside a slot, and the manifest
(JSON) through which the daemon tells clients where everything is.
Must not: create, map or remove files (the daemon and the client do), import torch (the
daemon process imports this module and starts in a fraction of a second without it).

Layout of one split
-------------------
A sample's value is a tuple of fixed-shape tensors, so every sample of a split gets a slot
of the same size: its tensors one after another, each at a 64-byte aligned offset (one
sample is one contiguous extent, which keeps disk reads to one extent per sample). The
split owns two files:

* ``<shm dir>/<name>-<split>``: the tag array (one int64 per sample; the number of frozen
  layers the entry was taken at, -1 = absent), then, at a page boundary, the memory-tier
  slots of samples ``0 .. memory_rows - 1``;
* ``<disk dir>/<split>.slots``: the disk-tier slots of samples ``memory_rows .. n - 1``.

Sample id -> (tier, slot) is therefore computed, not looked up: ``id < memory_rows`` is in
memory at slot ``id``, otherwise on disk at slot ``id - memory_rows``.

Why a static assignment and no LRU: every epoch reads every sample of the node's subset
exactly once, in a fresh random order. Whichever fixed subset stays in memory, the same
fraction of reads is served from memory, while moving samples between tiers would only
add I/O (an LRU over a cyclic scan evicts exactly what the next epoch needs next). The
disk tier is made fast by prefetching in the epoch's known order instead.

The memory budget is shared by the splits in the order they are given (list ``train``
first: it is read every epoch, ``eval`` only every few); the tag arrays (8 bytes per
sample) always live in shared memory and are not counted against it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SLOT_ALIGN_BYTES = 64
PAGE_BYTES = 4096
TAG_BYTES = 8
ABSENT = -1
MANIFEST_VERSION = 1

# Bytes per element of every dtype the store accepts, by torch/numpy name.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
STORAGE_DTYPES = ("float32", "float16", "bfloat16")
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32, numpy.float32, np.dtype('float32') or 'float32'."""
    name = getattr(dtype, "name", None)  # numpy dtypes
    if not isinstance(name, str):
        name = getattr(dtype, "__name__", None)  # numpy scalar types
    if not isinstance(name, str):
        name = str(dtype)
    name = name.removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(ITEMSIZE)}")
    return name


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class FieldLayout:
    """One tensor of a sample: its shape and dtype, how it is stored and where in the slot."""

    shape: tuple[int, ...]
    dtype: str  # the spec's dtype
    stored_dtype: str  # the storage dtype for floating point, else `dtype` (exact)
    offset: int  # bytes from the start of the slot

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.stored_dtype]

    @property
    def returned_dtype(self) -> str:
        """What reads return: float32 for floating point, the exact dtype otherwise."""
        return "float32" if self.dtype in FLOAT_DTYPES else self.dtype


@dataclass(frozen=True)
class SplitLayout:
    """Where one split's tags and slots live."""

    name: str
    num_samples: int
    fields: tuple[FieldLayout, ...]
    slot_bytes: int
    memory_rows: int
    shm_path: str
    disk_path: str | None  # None when every sample fits in memory

    @property
    def disk_rows(self) -> int:
        return self.num_samples - self.memory_rows

    @property
    def row_bytes(self) -> int:
        """Bytes of tensor data in one slot (without alignment padding)."""
        return sum(f.nbytes for f in self.fields)

    @property
    def slots_offset(self) -> int:
        """Where the memory-tier slots start in the shared-memory file (after the tags)."""
        return _align(self.num_samples * TAG_BYTES, PAGE_BYTES)

    @property
    def shm_bytes(self) -> int:
        return self.slots_offset + self.memory_rows * self.slot_bytes

    @property
    def disk_bytes(self) -> int:
        return self.disk_rows * self.slot_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SplitLayout:
        fields = tuple(
            FieldLayout(
                shape=tuple(f["shape"]),
                dtype=f["dtype"],
                stored_dtype=f["stored_dtype"],
                offset=f["offset"],
            )
            for f in data["fields"]
        )
        return cls(**{**data, "fields": fields})


def normalize_specs(specs: Sequence[Any]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype name) pairs from TensorSpec-like objects or (shape, dtype) tuples."""
    out = []
    for spec in specs:
        if hasattr(spec, "shape") and hasattr(spec, "dtype"):
            shape, dtype = spec.shape, spec.dtype
        else:
            shape, dtype = spec
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in spec shape {shape}")
        out.append((shape, dtype_name(dtype)))
    if not out:
        raise ValueError("a split needs at least one tensor spec")
    return out


def slot_fields(
    specs: Sequence[tuple[tuple[int, ...], str]], storage_dtype: str
) -> tuple[tuple[FieldLayout, ...], int]:
    """The fields of one slot at aligned offsets, and the slot size in bytes."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {storage_dtype!r}")
    fields = []
    offset = 0
    for shape, dtype in specs:
        stored = storage_dtype if dtype in FLOAT_DTYPES else dtype
        field = FieldLayout(shape=shape, dtype=dtype, stored_dtype=stored, offset=offset)
        fields.append(field)
        offset = _align(offset + field.nbytes, SLOT_ALIGN_BYTES)
    return tuple(fields), max(offset, SLOT_ALIGN_BYTES)


def plan_layout(
    splits: Mapping[str, tuple[int, Sequence[tuple[tuple[int, ...], str]]]],
    memory_budget_bytes: int,
    storage_dtype: str,
    shm_dir: str | Path,
    disk_dir: str | Path,
    name: str,
) -> list[SplitLayout]:
    """Give each split, in order, as many memory-tier slots as the remaining budget holds."""
    if memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes must be >= 0, got {memory_budget_bytes}")
    remaining = memory_budget_bytes
    layouts = []
    for split, (num_samples, specs) in splits.items():
        if not _SPLIT_NAME.match(split):
            raise ValueError(f"split name {split!r} must match {_SPLIT_NAME.pattern}")
        if num_samples < 1:
            raise ValueError(f"split {split!r}: num_samples must be >= 1, got {num_samples}")
        fields, slot_bytes = slot_fields([(tuple(s), d) for s, d in specs], storage_dtype)
        memory_rows = min(num_samples, remaining // slot_bytes)
        remaining -= memory_rows * slot_bytes
        layouts.append(
            SplitLayout(
                name=split,
                num_samples=num_samples,
                fields=fields,
                slot_bytes=slot_bytes,
                memory_rows=memory_rows,
                shm_path=str(Path(shm_dir) / f"{name}-{split}"),
                disk_path=str(Path(disk_dir) / f"{split}.slots")
                if memory_rows < num_samples
                else None,
            )
        )
    return layouts


@dataclass(frozen=True)
class CacheManifest:
    """What a client needs to attach: written by the daemon once every file exists."""

    name: str
    daemon_pid: int
    storage_dtype: str
    disk_dir: str  # this store's own directory (removed at cleanup unless keep)
    keep: bool
    splits: tuple[SplitLayout, ...]

    def to_json(self) -> str:
        data = asdict(self)
        data["version"] = MANIFEST_VERSION
        data["splits"] = [s.to_dict() for s in self.splits]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CacheManifest:
        data = json.loads(text)
        if data.pop("version", None) != MANIFEST_VERSION:
            raise ValueError("cache manifest has an unknown version")
        splits = tuple(SplitLayout.from_dict(s) for s in data.pop("splits"))
        return cls(**data, splits=splits)

    def split(self, name: str) -> SplitLayout:
        for layout in self.splits:
            if layout.name == name:
                return layout
        known = ", ".join(s.name for s in self.splits)
        raise KeyError(f"unknown cache split {name!r}; this cache holds: {known}")
