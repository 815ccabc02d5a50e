"""YAML in, checked Config out: the file, `key.sub=value` overrides, typing each value
against its section's annotations (unknown keys get a 'did you mean'), and the resolved
config back out as YAML or as the list of settings that changed.

Owns: load_config, config_from_dict, section_from_dict, the overrides, config_yaml and
config_changes.
Must not: import anything outside config/; every check is the sections' or checks.py's.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from pipetransformer.config.checks import check_config
from pipetransformer.config.errors import ConfigError, _fail
from pipetransformer.config.run import Config
from pipetransformer.config.trainer import TrainerConfig


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to float)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in get_args(tp):
            try:
                return _coerce(key, value, option)
            except ConfigError:
                continue
        _fail(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        _fail(key, f"expected one of {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        _fail(key, f"expected null, got {value!r}")
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            _fail(key, f"expected a list, got {value!r}")
        (item_type,) = get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _fail(key, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(key, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _fail(key, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads '3e-5' (no dot) as a string; accept what Python reads as a number.
            try:
                return float(value)
            except ValueError:
                pass
        _fail(key, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(key, f"expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if cls is TrainerConfig and data.get("batch_per_replica") is not None:
        if "global_batch_size" in data:
            _fail(
                f"{prefix}global_batch_size",
                "not used with trainer.batch_per_replica (the global batch is then "
                "batch_per_replica x the replicas); set one of them",
            )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            _fail(full, f"unknown key{hint}; known keys: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                _fail(full, f"expected a mapping of {tp.__name__} fields, got {value!r}")
            kwargs[key] = _build(tp, value, f"{full}.")
        else:
            kwargs[key] = _coerce(full, value, tp)
    return cls(**kwargs)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: where (1-based line and column) and what; PyYAML's own
    text spans several lines and names the file "<unicode string>"."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    if mark is None:
        return what
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r}: empty key part")
    try:
        return path, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: not valid YAML: {_yaml_problem(exc)}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path)}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def read_config_data(
    path: str | os.PathLike | None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """The YAML's sections (or none) with the overrides applied: not yet typed or checked."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = loaded or {}
    return apply_overrides(data, overrides or [])


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults), apply overrides, check everything."""
    config = _build(Config, read_config_data(path, overrides), "")
    check_config(config)
    return config


def config_from_dict(data: dict[str, Any]) -> Config:
    config = _build(Config, data, "")
    check_config(config)
    return config


def section_from_dict(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """One section's dataclass from plain values (`prefix`: its key, e.g. 'freeze.'), typed
    and checked as a config file's section is: the same one-line errors naming the key (an
    integration takes the freeze keys as keyword arguments)."""
    return _build(cls, data, prefix)


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, value before, value after) for every setting that differs between two
    `Config.to_dict()`s; a key one of them lacks (a config written by an older release)
    counts as unchanged."""
    changes = []
    for section, values in after.items():
        old_values = before.get(section)
        if not isinstance(values, dict) or not isinstance(old_values, dict):
            continue
        for key, value in values.items():
            if key in old_values and old_values[key] != value:
                changes.append((f"{section}.{key}", old_values[key], value))
    return changes


def config_yaml(config: Config) -> str:
    """The resolved config as YAML text (what RUN_DIR/config.yaml holds)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
