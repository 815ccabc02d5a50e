"""Measured profiles for AutoPipe: what they hold, where they are kept, what they turn into.

Owns:
- the records: `UnitProfile` (per-unit forward / backward / frozen-forward seconds and
  output / saved-for-backward / parameter bytes at one micro-batch size) and micro-batch
  timings (`{M: seconds per step}` for one layout);
- their signatures: `UnitProfileKey` and `MicroBatchKey` (built by `unit_profile_key` and
  `micro_batch_key` from plain values) are written as explicit key strings and parsed back
  here, so a record is reused only for the same model, device, shapes and layout;
- `ProfileStore`, the versioned JSON file they live in (atomic writes);
- the conversions the planner needs: `unit_costs_from_profile` (memory: autopipe/memory.py's
  `MemoryModel.from_profile`), and the micro-batch count choice
  (`candidate_micro_batches`, `choose_micro_batches`).

Must not: measure anything, build models or touch torch / torch.distributed. Measuring is
pipe/measure.py's job; deciding who measures and who writes the file is the trainer's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pipetransformer.autopipe.planner import UnitCosts
from pipetransformer.utils.files import write_json_atomic

logger = logging.getLogger(__name__)

# Bump when the file layout or the meaning of a field changes; older files are refused.
FORMAT_VERSION = 1


class ProfileError(ValueError):
    """A profile file cannot be read or a record is malformed. Names the file."""


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class UnitMeasurement:
    """What one unit costs at one micro-batch size (as measured by pipe/measure.py)."""

    forward_s: float  # train mode, autograd recording
    backward_s: float  # backward of the output hidden state (weight and input grads)
    frozen_forward_s: float  # eval mode under no_grad
    output_bytes: int  # tensors the unit hands to the next unit, one micro-batch
    saved_bytes: int  # tensors autograd keeps for backward (parameters excluded), one micro-batch
    param_bytes: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class UnitProfile:
    """Per-unit measurements of a whole model (unit i at index i) at `micro_batch_size`."""

    micro_batch_size: int
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    frozen_forward_s: tuple[float, ...]
    output_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]

    _COLUMNS = (
        "forward_s",
        "backward_s",
        "frozen_forward_s",
        "output_bytes",
        "saved_bytes",
        "param_bytes",
    )

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        lengths = {len(getattr(self, c)) for c in self._COLUMNS}
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError("a unit profile needs one value per unit in every column")
        for column in self._COLUMNS:
            values = getattr(self, column)
            if any(not (math.isfinite(v) and v >= 0) for v in values):
                raise ValueError(f"{column} values must be finite and >= 0")

    @property
    def num_units(self) -> int:
        return len(self.forward_s)

    @classmethod
    def from_measurements(
        cls, measurements: Mapping[int, UnitMeasurement], micro_batch_size: int
    ) -> UnitProfile:
        """Assemble per-unit measurements (e.g. gathered from every stage) into one profile."""
        if sorted(measurements) != list(range(len(measurements))):
            raise ValueError(f"need measurements of units 0..n-1, got units {sorted(measurements)}")
        ordered = [measurements[u] for u in range(len(measurements))]
        return cls(
            micro_batch_size,
            **{column: tuple(getattr(m, column) for m in ordered) for column in cls._COLUMNS},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            **{c: list(getattr(self, c)) for c in self._COLUMNS},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UnitProfile:
        return cls(
            int(data["micro_batch_size"]),
            **{
                c: tuple(int(v) if c.endswith("_bytes") else float(v) for v in data[c])
                for c in cls._COLUMNS
            },
        )


# ----------------------------------------------------------------------------- keys


def stable_hash(value: Any, length: int = 16) -> str:
    """Hash of a JSON-able value that does not depend on dict order or the Python process."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def model_signature(name: str, settings: Mapping[str, Any]) -> str:
    """'<name>:<hash of settings>'. Put in `settings` everything that changes the model's
    shape or cost (constructor kwargs, task, classes, vocabulary, per-unit parameter
    counts), and nothing that does not (weights, paths to them)."""
    return f"{name}:{stable_hash(dict(settings))}"


def _shapes_text(shapes: Sequence[Sequence[int]]) -> str:
    # One 'AxB' per input tensor (batch dimension excluded), e.g. '128,128,128' for BERT.
    return ",".join("x".join(str(int(d)) for d in shape) or "scalar" for shape in shapes)


def _fields(text: str, kind: str) -> dict[str, str]:
    """The `name=value` fields of a key string of `kind` ('unit' or 'micro')."""
    head, *parts = text.split("|")
    if head != kind or not all("=" in part for part in parts):
        raise ValueError(f"not a {kind} profile key: {text!r}")
    return dict(part.split("=", 1) for part in parts)


@dataclass(frozen=True)
class UnitProfileKey:
    """Signature of a UnitProfile: model signature, device, dtype, micro-batch, input shapes.

    `device` is compared as a plain string: 'cpu', 'cuda', or something more specific (the
    GPU's name) to keep profiles of different GPUs apart. `str(key)` is the file's key;
    `parse` reads one back, so no reader splits key strings itself.
    """

    model: str
    device: str
    dtype: str
    micro_batch_size: int
    inputs: str  # the input shapes, as _shapes_text writes them

    def __str__(self) -> str:
        return (
            f"unit|model={self.model}|device={self.device}|dtype={self.dtype}"
            f"|micro_batch={self.micro_batch_size}|inputs={self.inputs}"
        )

    @classmethod
    def parse(cls, text: str) -> UnitProfileKey:
        f = _fields(text, "unit")
        return cls(f["model"], f["device"], f["dtype"], int(f["micro_batch"]), f["inputs"])


@dataclass(frozen=True)
class MicroBatchKey:
    """Signature of the micro-batch timings of one layout (K, replica batch, schedule, and
    F when given). The trainer leaves F out: a layout is measured the first time its K and
    batch are seen, not again at every freeze."""

    model: str
    device: str
    dtype: str
    pipe_len: int
    replica_batch: int
    inputs: str
    schedule: str
    num_frozen_layers: int | None = None

    def __str__(self) -> str:
        frozen = "" if self.num_frozen_layers is None else f"|frozen={self.num_frozen_layers}"
        return (
            f"micro|model={self.model}|device={self.device}|dtype={self.dtype}"
            f"|pipe_len={self.pipe_len}|replica_batch={self.replica_batch}|inputs={self.inputs}"
            f"|schedule={self.schedule}{frozen}"
        )

    @classmethod
    def parse(cls, text: str) -> MicroBatchKey:
        f = _fields(text, "micro")
        frozen = f.get("frozen")
        return cls(
            f["model"],
            f["device"],
            f["dtype"],
            int(f["pipe_len"]),
            int(f["replica_batch"]),
            f["inputs"],
            f["schedule"],
            None if frozen is None else int(frozen),
        )


def unit_profile_key(
    model: str,
    device_type: str,
    dtype: str,
    micro_batch_size: int,
    input_shapes: Sequence[Sequence[int]],
) -> UnitProfileKey:
    return UnitProfileKey(
        model, device_type, dtype, int(micro_batch_size), _shapes_text(input_shapes)
    )


def micro_batch_key(
    model: str,
    device_type: str,
    pipe_len: int,
    replica_batch: int,
    input_shapes: Sequence[Sequence[int]],
    schedule: str,
    num_frozen_layers: int | None = None,
    dtype: str = "float32",
) -> MicroBatchKey:
    return MicroBatchKey(
        model,
        device_type,
        dtype,
        int(pipe_len),
        int(replica_batch),
        _shapes_text(input_shapes),
        schedule,
        None if num_frozen_layers is None else int(num_frozen_layers),
    )


# ----------------------------------------------------------------------------- store


class ProfileStore:
    """A JSON file of unit profiles and micro-batch timings, keyed by signature strings.

    `ProfileStore(path)` starts empty; `load()` reads the file (a missing file is an empty
    store, a corrupt one a ProfileError naming the path); `save()` merges with what is on
    disk now (this store's records win) and replaces the file atomically, so a crash never
    leaves half a file and a concurrent run's new keys survive. There is no lock: let one
    process per run write (the trainer's rank 0).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._unit_profiles: dict[str, UnitProfile] = {}
        self._micro_batch_timings: dict[str, dict[int, float]] = {}

    def load(self) -> ProfileStore:
        units, micro = self._read()
        self._unit_profiles, self._micro_batch_timings = units, micro
        return self

    def save(self) -> None:
        units, micro = self._read()
        units.update(self._unit_profiles)
        for key, timings in self._micro_batch_timings.items():
            micro.setdefault(key, {}).update(timings)
        write_json_atomic(self.path, _payload(units, micro))
        self._unit_profiles, self._micro_batch_timings = units, micro
        logger.debug(
            "saved %d unit profiles and %d micro-batch timings to %s",
            len(units),
            len(micro),
            self.path,
        )

    def save_copy(self, path: str | os.PathLike) -> None:
        """Write this store's records, and only them, to another file (a checkpoint's copy)."""
        write_json_atomic(path, _payload(self._unit_profiles, self._micro_batch_timings))

    def _read(self) -> tuple[dict[str, UnitProfile], dict[str, dict[int, float]]]:
        if not self.path.exists():
            return {}, {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(
                f"{self.path}: not a readable profile file ({exc}); delete it to measure again"
            ) from exc
        if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
            version = data.get("format_version") if isinstance(data, dict) else None
            raise ProfileError(
                f"{self.path}: profile format version {version!r}, this code reads version "
                f"{FORMAT_VERSION}; delete the file to measure again"
            )
        try:
            units = {
                str(k): UnitProfile.from_dict(v) for k, v in data.get("unit_profiles", {}).items()
            }
            micro = {
                str(k): {int(m): float(s) for m, s in v.items()}
                for k, v in data.get("micro_batch_timings", {}).items()
            }
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ProfileError(
                f"{self.path}: malformed profile record ({exc}); delete it to measure again"
            ) from exc
        return units, micro

    def update(self, other: ProfileStore) -> None:
        """Add `other`'s records (e.g. a checkpoint's copy of a run's measurements); where
        both hold a record, this store's stays."""
        for key, profile in other._unit_profiles.items():
            self._unit_profiles.setdefault(key, profile)
        for key, timings in other._micro_batch_timings.items():
            own = self._micro_batch_timings.setdefault(key, {})
            for m, seconds in timings.items():
                own.setdefault(m, seconds)

    def unit_profile(self, key: str | UnitProfileKey) -> UnitProfile | None:
        return self._unit_profiles.get(str(key))

    def put_unit_profile(self, key: str | UnitProfileKey, profile: UnitProfile) -> None:
        self._unit_profiles[str(key)] = profile

    def micro_batch_timings(self, key: str | MicroBatchKey) -> dict[int, float]:
        """Seconds per step by M for this layout; empty when never measured."""
        return dict(self._micro_batch_timings.get(str(key), {}))

    def put_micro_batch_timings(
        self, key: str | MicroBatchKey, timings: Mapping[int, float]
    ) -> None:
        """Add (or replace) the timings of some M; timings of other M are kept."""
        for m, seconds in timings.items():
            if int(m) < 1 or not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"bad micro-batch timing {m}: {seconds}")
        self._micro_batch_timings.setdefault(str(key), {}).update(
            {int(m): float(s) for m, s in timings.items()}
        )

    def keys(self) -> list[str]:
        return sorted([*self._unit_profiles, *self._micro_batch_timings])

    def unit_profile_keys(self) -> list[UnitProfileKey]:
        """The keys of the unit profiles held (those written by this code's key builder)."""
        return [
            UnitProfileKey.parse(k) for k in sorted(self._unit_profiles) if k.startswith("unit|")
        ]

    def micro_batch_keys(self) -> list[MicroBatchKey]:
        return [
            MicroBatchKey.parse(k)
            for k in sorted(self._micro_batch_timings)
            if k.startswith("micro|")
        ]


def _payload(
    units: Mapping[str, UnitProfile], micro: Mapping[str, Mapping[int, float]]
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "unit_profiles": {k: units[k].to_dict() for k in sorted(units)},
        "micro_batch_timings": {
            k: {str(m): micro[k][m] for m in sorted(micro[k])} for k in sorted(micro)
        },
    }


# ----------------------------------------------------------------------------- conversions


def unit_costs_from_profile(profile: UnitProfile) -> UnitCosts:
    """Trained cost = forward + backward seconds; frozen cost = no-grad forward seconds."""
    return UnitCosts(
        trained=tuple(f + b for f, b in zip(profile.forward_s, profile.backward_s)),
        frozen=tuple(profile.frozen_forward_s),
        source="time",
    )


# ----------------------------------------------------------------------------- micro-batches


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_micro_batches(pipe_len: int, replica_batch: int, minimum: int = 1) -> list[int]:
    """Every M in [K, 6K] that divides the replica batch, ascending (the paper's range,
    section 3.2; its released code fixes M at 2K for K = 8, 4K for K = 4 and 8K for K = 2).

    When none does, the divisors closest to the range on each side: the largest below K
    and the smallest above 6K (whichever exist), so that measurement decides between
    "fewer micro-batches than stages" (more bubble) and "more, smaller micro-batches".
    `minimum` drops smaller values from that fallback: 1F1B needs M >= K, pass `pipe_len`.
    """
    if pipe_len < 1 or replica_batch < 1:
        raise ValueError(
            f"pipe_len and replica_batch must be >= 1, got {pipe_len}, {replica_batch}"
        )
    divisors = _divisors(replica_batch)
    inside = [m for m in divisors if max(pipe_len, minimum) <= m <= 6 * pipe_len]
    if inside:
        return inside
    below = [m for m in divisors if minimum <= m < pipe_len]
    above = [m for m in divisors if m > 6 * pipe_len]
    fallback = ([below[-1]] if below else []) + ([above[0]] if above else [])
    if not fallback:
        raise ValueError(
            f"no micro-batch count >= {minimum} divides the replica batch {replica_batch} "
            f"(pipe_len {pipe_len})"
        )
    return fallback


def choose_micro_batches(timings: Mapping[int, float], candidates: Iterable[int]) -> int:
    """The candidate with the lowest measured time; exact ties go to the smaller M.

    Timings of values that are not candidates (e.g. a non-divisor) are ignored.
    """
    candidates = list(candidates)
    measured = [(timings[m], m) for m in candidates if m in timings]
    if not measured:
        raise ValueError(f"no timings for any candidate micro-batch count {candidates}")
    return min(measured)[1]
