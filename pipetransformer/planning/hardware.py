"""Named hardware for the roofline step-time model: devices (peak FLOP/s per dtype, memory
bandwidth and size) and links (bandwidth and latency), read from hardware.yaml beside this
module, where every figure names the data sheet, standard or measurement it comes from.

The file keeps the units of the documents it cites (TFLOP/s, GB/s, microseconds) in its key
names; `Device` and `Link` mirror its rows and give SI values (FLOP/s, bytes/s, seconds) as
properties, so the model never converts units itself. Every row is checked on load: a
missing or unknown key, a value that is not a number, or a negative one (or zero, except a
latency: the model divides by peaks and bandwidths) is a `ValueError` naming the row and the
key.

Owns: `Device`, `Link`, `HardwareTable`, `load_hardware`, and `device` / `link` (rows of the
packaged table by name).
Must not: import torch, detect or query the hardware it runs on, measure anything, or
predict times (planning/step_model.py does the arithmetic).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

NAME_PATTERN = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")

# dtype name -> the Device field with its peak, in the compute dtype names the config uses
# ("float32", "bfloat16") plus "tf32" (float32 matmuls on tensor cores) and "float16".
PEAK_FIELDS: dict[str, str] = {
    "float32": "peak_fp32_tflops",
    "tf32": "peak_tf32_tflops",
    "bfloat16": "peak_bf16_tflops",
    "float16": "peak_fp16_tflops",
}


@dataclass(frozen=True)
class Device:
    """One accelerator (or a CPU VM): dense peak compute, memory bandwidth and size.

    A tensor-core peak (tf32, bf16, fp16) is None where the device has no such unit.
    """

    name: str
    description: str
    peak_fp32_tflops: float
    peak_tf32_tflops: float | None
    peak_bf16_tflops: float | None
    peak_fp16_tflops: float | None
    memory_bandwidth_gbps: float
    memory_bytes: int
    source: str
    notes: str = ""

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for matrix multiplies in `dtype` ('float32', 'tf32', 'bfloat16' or
        'float16'). Where the device has no tensor-core figure for the dtype (None: V100 and
        Turing have no TF32 or BF16, a CPU has no matrix units) this falls back to the plain
        FP32 peak: the dtype then runs no faster than float32 would."""
        if dtype not in PEAK_FIELDS:
            raise ValueError(
                f"unknown dtype {dtype!r} for {self.name}; known: {', '.join(PEAK_FIELDS)}"
            )
        tflops = getattr(self, PEAK_FIELDS[dtype])
        return (self.peak_fp32_tflops if tflops is None else tflops) * 1e12

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_bandwidth_gbps * 1e9


@dataclass(frozen=True)
class Link:
    """One interconnect: bandwidth per direction and a typical one-way small-message latency."""

    name: str
    description: str
    bandwidth_gbps: float
    latency_us: float
    source: str
    notes: str = ""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class HardwareTable:
    """Rows by name; read-only (load_hardware wraps both mappings in MappingProxyType)."""

    devices: Mapping[str, Device]
    links: Mapping[str, Link]

    def device(self, name: str) -> Device:
        return _lookup(self.devices, name, "device")

    def link(self, name: str) -> Link:
        return _lookup(self.links, name, "link")


def _lookup(rows: Mapping[str, Any], name: str, kind: str) -> Any:
    if name not in rows:
        raise ValueError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(sorted(rows))}")
    return rows[name]


# Which keys hold which kind of value; None allowed only for the tensor-core peaks.
_OPTIONAL_KEYS = {"notes"}
_NULLABLE_NUMBERS = {"peak_tf32_tflops", "peak_bf16_tflops", "peak_fp16_tflops"}
_INTEGERS = {"memory_bytes"}
_STRINGS = {"name", "description", "source", "notes"}
_ZERO_ALLOWED = {"latency_us"}


def _check_value(where: str, key: str, value: Any) -> Any:
    if key in _STRINGS:
        if not isinstance(value, str) or (key != "notes" and not value.strip()):
            raise ValueError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
        return value.strip()
    if value is None and key in _NULLABLE_NUMBERS:
        return None
    number_types = int if key in _INTEGERS else (int, float)
    if isinstance(value, number_types) and not isinstance(value, bool) and math.isfinite(value):
        if value > 0 or (value == 0 and key in _ZERO_ALLOWED):
            return value
    kind = "a whole number" if key in _INTEGERS else "a number"
    bound = ">= 0" if key in _ZERO_ALLOWED else "> 0"
    raise ValueError(f"{where}: {key!r} must be {kind} {bound}, got {value!r}")


def _parse_rows(
    data: Mapping[str, Any], section: str, row_type: type, origin: str
) -> dict[str, Any]:
    rows = data.get(section)
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{origin}: {section!r} must be a non-empty list of rows")
    known = {field.name for field in fields(row_type)}
    parsed: dict[str, Any] = {}
    for index, row in enumerate(rows):
        label = row.get("name") if isinstance(row, dict) else None
        where = f"{origin}: {section} row {label!r}" if label else f"{origin}: {section}[{index}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a mapping, got {row!r}")
        unknown = sorted(set(row) - known)
        if unknown:
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}"
            )
        missing = sorted(known - _OPTIONAL_KEYS - set(row))
        if missing:
            raise ValueError(f"{where}: missing key {missing[0]!r}")
        values = {key: _check_value(where, key, value) for key, value in row.items()}
        name = values["name"]
        if not NAME_PATTERN.match(name):
            raise ValueError(
                f"{where}: 'name' must be lowercase words joined by hyphens, got {name!r}"
            )
        if name in parsed:
            raise ValueError(f"{where}: 'name' {name!r} appears twice")
        parsed[name] = row_type(**values)
    return parsed


def load_hardware(path: str | Path | None = None) -> HardwareTable:
    """The table in `path`, or the packaged hardware.yaml when None; every row checked."""
    if path is None:
        origin = "hardware.yaml"
        text = resources.files(__package__).joinpath("hardware.yaml").read_text(encoding="utf-8")
    else:
        origin = str(path)
        text = Path(path).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a mapping with 'devices' and 'links'")
    unknown = sorted(set(data) - {"devices", "links"})
    if unknown:
        raise ValueError(f"{origin}: unknown section {unknown[0]!r}; known: devices, links")
    return HardwareTable(
        devices=MappingProxyType(_parse_rows(data, "devices", Device, origin)),
        links=MappingProxyType(_parse_rows(data, "links", Link, origin)),
    )


@lru_cache(maxsize=1)
def packaged_hardware() -> HardwareTable:
    """The packaged table, read once."""
    return load_hardware()


def device(name: str) -> Device:
    """A device of the packaged table, e.g. device("a100-80gb")."""
    return packaged_hardware().device(name)


def link(name: str) -> Link:
    """A link of the packaged table, e.g. link("infiniband-hdr")."""
    return packaged_hardware().link(name)
