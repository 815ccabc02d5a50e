"""Slot layout of the AutoCache store: pure arithmetic on plain values.

Owns: the dtype table, the static split of each data split's samples between the memory
tier and the disk tier, the byte offset of every tensor inside a slot, and the manifest
(JSON) through which the daemon tells clients where everything is.
Must not: create, map or remove files (the daemon and the client do), import torch (the
daemon process imports this module and starts in a fraction of a second without it).

Layout of one split
-------------------
A sample's value is a tuple of tensors (the frozen prefix's output: for text the hidden
state and the mask). A tensor whose first dimension holds the text's tokens (a *sequence*
field) is stored at the sample's real length only: `length + extra_rows` rows (extra rows:
those that do not follow the length, as DeBERTa's table), not `max_seq_length`; a client
pads a batch to the length it asks for when it reads (zeros past each sample's length),
and takes a sample's real rows out of a padded batch when it writes. Other fields (images)
take their whole shape, one row a sample. The split's real lengths are given when the
store is made (they are known before training starts) and travel in the manifest.

Each field is packed in a region of its own, rows of consecutive samples one after another
(a sample's rows of a field are one contiguous extent: a read gathers rows, not bytes),
each region at a 64-byte aligned offset. The split owns two files:

* ``<shm dir>/<name>-<split>``: the tag array (one int64 per sample; the number of frozen
  layers the entry was taken at, -1 = absent), then, at a page boundary, the memory tier:
  each field's rows of samples ``0 .. memory_rows - 1``;
* ``<disk dir>/<split>.slots``: the disk tier, each field's rows of samples
  ``memory_rows .. n - 1``.

Sample id -> (tier, rows) is therefore computed, not looked up: ``id < memory_rows`` is in
memory, otherwise on disk; its first row in a field's region is the rows of the samples
before it in the tier (prefix sums of the lengths).

Why a static assignment and no LRU: every epoch reads every sample of the node's subset
exactly once, in a fresh random order. Whichever fixed subset stays in memory, the same
fraction of reads is served from memory, while moving samples between tiers would only
add I/O (an LRU over a cyclic scan evicts exactly what the next epoch needs next). The
disk tier is made fast by prefetching in the epoch's known order instead.

The memory budget is shared by the splits in the order they are given (list ``train``
first: it is read every epoch, ``eval`` only every few), counted at the samples' real
lengths; the tag arrays (8 bytes per sample) always live in shared memory and are not
counted against it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
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
    """One tensor of a sample: its shape (at the split's max_length tokens), its dtype, how
    it is stored, and for a sequence field the rows that do not follow the length."""

    shape: tuple[int, ...]
    dtype: str  # the spec's dtype
    stored_dtype: str  # the storage dtype for floating point, else `dtype` (exact)
    extra_rows: int | None = None  # None: not a sequence (the whole shape is one row)

    @property
    def numel(self) -> int:
        return _product(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of a sample at the full shape (max_length tokens)."""
        return self.numel * ITEMSIZE[self.stored_dtype]

    @property
    def returned_dtype(self) -> str:
        """What reads return: float32 for floating point, the exact dtype otherwise."""
        return "float32" if self.dtype in FLOAT_DTYPES else self.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape if self.extra_rows is None else self.shape[1:]

    @property
    def row_bytes(self) -> int:
        return _product(self.row_shape) * ITEMSIZE[self.stored_dtype]

    def rows(self, length: int) -> int:
        """Rows a sample of `length` real tokens takes."""
        return 1 if self.extra_rows is None else length + self.extra_rows

    def shape_at(self, length: int) -> tuple[int, ...]:
        """A sample's shape in a batch padded to `length` tokens."""
        return self.shape if self.extra_rows is None else (self.rows(length), *self.row_shape)


def _product(values: Sequence[int]) -> int:
    count = 1
    for value in values:
        count *= value
    return count


@dataclass(frozen=True)
class SplitLayout:
    """Where one split's tags and rows live."""

    name: str
    num_samples: int
    fields: tuple[FieldLayout, ...]
    memory_rows: int  # samples in the memory tier: ids 0 .. memory_rows - 1
    shm_path: str
    disk_path: str | None  # None when every sample fits in memory
    # Sequence fields: the tokens the fields' shapes are at, and each sample's real length
    # (None: every sample at max_length).
    max_length: int | None = None
    lengths: tuple[int, ...] | None = None

    @property
    def disk_rows(self) -> int:
        """Samples in the disk tier."""
        return self.num_samples - self.memory_rows

    def length(self, sample: int) -> int:
        """A sample's real length (max_length without lengths; 0 without a sequence)."""
        if self.lengths is not None:
            return self.lengths[sample]
        return self.max_length or 0

    @functools.cached_property
    def _length_prefix(self) -> list[int]:
        """Real tokens of samples 0 .. i - 1, for every i in 0 .. num_samples."""
        lengths = (self.length(i) for i in range(self.num_samples))
        return list(itertools.accumulate(lengths, initial=0))

    def field_rows(self, field: FieldLayout, first: int, end: int) -> int:
        """Rows `field` takes for samples first .. end - 1."""
        if field.extra_rows is None:
            return end - first
        prefix = self._length_prefix
        return prefix[end] - prefix[first] + (end - first) * field.extra_rows

    def sample_bytes(self, sample: int) -> int:
        """Stored bytes of one sample (its real rows of every field)."""
        return sum(f.rows(self.length(sample)) * f.row_bytes for f in self.fields)

    @property
    def full_sample_bytes(self) -> int:
        """Stored bytes of a sample at max_length tokens."""
        return sum(f.nbytes for f in self.fields)

    def tier_bytes(self, first: int, end: int) -> int:
        """Bytes of the field regions of samples first .. end - 1 (each region aligned)."""
        return sum(
            _align(self.field_rows(f, first, end) * f.row_bytes, SLOT_ALIGN_BYTES)
            for f in self.fields
        )

    def region_offsets(self, first: int, end: int) -> list[int]:
        """Each field's region offset in a tier holding samples first .. end - 1."""
        offsets, offset = [], 0
        for field in self.fields:
            offsets.append(offset)
            offset += _align(self.field_rows(field, first, end) * field.row_bytes, SLOT_ALIGN_BYTES)
        return offsets

    @property
    def slots_offset(self) -> int:
        """Where the memory tier starts in the shared-memory file (after the tags)."""
        return _align(self.num_samples * TAG_BYTES, PAGE_BYTES)

    @property
    def shm_bytes(self) -> int:
        return self.slots_offset + self.tier_bytes(0, self.memory_rows)

    @property
    def disk_bytes(self) -> int:
        return self.tier_bytes(self.memory_rows, self.num_samples)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SplitLayout:
        fields = tuple(
            FieldLayout(
                shape=tuple(f["shape"]),
                dtype=f["dtype"],
                stored_dtype=f["stored_dtype"],
                extra_rows=f.get("extra_rows"),
            )
            for f in data["fields"]
        )
        lengths = data.get("lengths")
        return cls(
            **{
                **data,
                "fields": fields,
                "lengths": None if lengths is None else tuple(lengths),
            }
        )


@dataclass(frozen=True)
class SplitRequest:
    """What a split holds: its samples, each sample's tensors (shape at max_length tokens,
    dtype, whether the first dimension holds the tokens) and, for text, the max length and
    each sample's real length."""

    num_samples: int
    specs: tuple[tuple[tuple[int, ...], str, bool], ...]
    lengths: tuple[int, ...] | None = None
    max_length: int | None = None

    def to_json(self) -> list:
        return [self.num_samples, [list(s) for s in self.specs], self.lengths, self.max_length]

    @classmethod
    def of(cls, value: Any) -> SplitRequest:
        """From (num_samples, specs) or (num_samples, specs, lengths, max_length): specs as
        TensorSpec-like objects (`.shape`, `.dtype`, optional `.sequence`) or (shape, dtype[,
        sequence]) tuples; a SplitRequest as it is; checked."""
        if isinstance(value, SplitRequest):
            return value
        num_samples, specs, *rest = value
        lengths, max_length = (list(rest) + [None, None])[:2]
        request = cls(
            int(num_samples),
            tuple(normalize_specs(specs)),
            None if lengths is None else tuple(int(v) for v in lengths),
            None if max_length is None else int(max_length),
        )
        request.check()
        return request

    def check(self) -> None:
        sequence = [shape for shape, _, is_sequence in self.specs if is_sequence]
        if (self.lengths is not None or sequence) and self.max_length is None:
            raise ValueError("a split of sequences needs its max_length")
        if self.lengths is not None:
            if len(self.lengths) != self.num_samples:
                raise ValueError(f"{len(self.lengths)} lengths for {self.num_samples} samples")
            if any(not 0 <= v <= self.max_length for v in self.lengths):
                raise ValueError(f"every length must be in [0, {self.max_length}]")
        for shape in sequence:
            if not shape or shape[0] < self.max_length:
                raise ValueError(
                    f"a sequence field of shape {shape} is shorter than max_length "
                    f"{self.max_length}"
                )


def normalize_specs(specs: Sequence[Any]) -> list[tuple[tuple[int, ...], str, bool]]:
    """(shape, dtype name, sequence) triples from TensorSpec-like objects or (shape,
    dtype[, sequence]) tuples."""
    out = []
    for spec in specs:
        if hasattr(spec, "shape") and hasattr(spec, "dtype"):
            shape, dtype, sequence = spec.shape, spec.dtype, getattr(spec, "sequence", False)
        else:
            shape, dtype, *flag = spec
            sequence = bool(flag[0]) if flag else False
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in spec shape {shape}")
        out.append((shape, dtype_name(dtype), bool(sequence)))
    if not out:
        raise ValueError("a split needs at least one tensor spec")
    return out


def split_fields(request: SplitRequest, storage_dtype: str) -> tuple[FieldLayout, ...]:
    """The fields of a split's samples, floating point ones in the storage dtype."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {storage_dtype!r}")
    return tuple(
        FieldLayout(
            shape=shape,
            dtype=dtype,
            stored_dtype=storage_dtype if dtype in FLOAT_DTYPES else dtype,
            extra_rows=shape[0] - request.max_length if sequence else None,
        )
        for shape, dtype, sequence in request.specs
    )


def _memory_samples(layout: SplitLayout, budget: int) -> int:
    """The most samples, from the first, whose regions fit `budget` bytes (binary search:
    the bytes grow with the samples)."""
    low, high = 0, layout.num_samples
    while low < high:
        middle = (low + high + 1) // 2
        if layout.tier_bytes(0, middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def plan_layout(
    splits: Mapping[str, Any],
    memory_budget_bytes: int,
    storage_dtype: str,
    shm_dir: str | Path,
    disk_dir: str | Path,
    name: str,
) -> list[SplitLayout]:
    """Give each split, in order, as many memory-tier samples as the remaining budget holds
    (at their real lengths). A split is a SplitRequest or what `SplitRequest.of` takes."""
    if memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes must be >= 0, got {memory_budget_bytes}")
    remaining = memory_budget_bytes
    layouts = []
    for split, value in splits.items():
        if not _SPLIT_NAME.match(split):
            raise ValueError(f"split name {split!r} must match {_SPLIT_NAME.pattern}")
        request = SplitRequest.of(value)
        if request.num_samples < 1:
            raise ValueError(
                f"split {split!r}: num_samples must be >= 1, got {request.num_samples}"
            )
        fields = split_fields(request, storage_dtype)
        whole = SplitLayout(
            name=split,
            num_samples=request.num_samples,
            fields=fields,
            memory_rows=request.num_samples,
            shm_path=str(Path(shm_dir) / f"{name}-{split}"),
            disk_path=None,
            max_length=request.max_length,
            lengths=request.lengths,
        )
        memory_rows = _memory_samples(whole, remaining)
        remaining -= whole.tier_bytes(0, memory_rows)
        layouts.append(
            dataclasses.replace(
                whole,
                memory_rows=memory_rows,
                disk_path=str(Path(disk_dir) / f"{split}.slots")
                if memory_rows < request.num_samples
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
