"""YAML in, checked Config out: the file, `key.sub=value` overrides, typing each value
against its section's annotations (unknown keys get a 'did you mean'), and the resolved
config back out as YAML or as the list of settings that changed.

A config file may end with a `when_pretrained:` mapping of `key.sub: value` settings that
replace the file's own where the run names pretrained weights
(`Config.names_pretrained_weights`: model.model_name_or_path, or model.pretrained), so that
one file holds the settings for a tiny model trained from scratch and for the pretrained
one its users name (the BERT configs: the rate and freeze warm-up their pretrained
benchmarks chose). A setting given on the command line wins over it; `pretrained_settings`
says which applied, for the run's start line. The section is checked (typed, known keys)
whether or not it applies; the resolved config (config.yaml) holds the values the run
used, not the section.

Owns: load_config, config_from_dict, section_from_dict, the overrides, when_pretrained,
config_yaml and config_changes. Must not: import anything outside config/; every check is
the sections' or checks.py's.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from pipetransformer.config.checks import check_config, check_model_path
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


def _set(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: '{part}' is not a section")
        node = child
    node[path[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        _set(data, *parse_override(text))
    return data


WHEN_PRETRAINED = "when_pretrained"


def _file_data(path: str | os.PathLike | None) -> dict[str, Any]:
    """The YAML file's top-level mapping (empty without a file)."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}{_nearest_config(p)}")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(exc)}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return loaded or {}


def _nearest_config(path: Path) -> str:
    """' (did you mean configs/quickstart.yaml?)' for a missing config file whose name is
    close to a file beside where it was looked for, or to one of the shipped configs."""
    folders = [path.parent, Path("configs")]
    names = {
        str(folder / candidate.name): candidate.name
        for folder in folders
        if folder.is_dir()
        for candidate in folder.glob("*.y*ml")
    }
    close = difflib.get_close_matches(path.name, list(names.values()), n=1, cutoff=0.6)
    if not close:
        return ""
    found = next(full for full, name in names.items() if name == close[0])
    return f" (did you mean {found}?)"


def _when_pretrained(data: dict[str, Any], where: Any) -> dict[str, Any]:
    """The file's when_pretrained section as {dotted key: value}, checked as a mapping."""
    section = data.pop(WHEN_PRETRAINED, None)
    if section is None:
        return {}
    if not isinstance(section, dict) or not all(isinstance(k, str) for k in section):
        raise ConfigError(f"{WHEN_PRETRAINED}: expected a mapping of key.sub: value ({where})")
    return section


def _typed_keys(overrides: list[str]) -> set[str]:
    return {".".join(parse_override(text)[0]) for text in overrides}


def _with_pretrained_settings(
    data: dict[str, Any], section: dict[str, Any], overrides: list[str]
) -> dict[str, Any]:
    """`data` with the section's settings that the command line did not set."""
    typed = _typed_keys(overrides)
    merged = copy.deepcopy(data)
    for key, value in section.items():
        if key not in typed:
            _set(merged, key.split("."), copy.deepcopy(value))
    return merged


def read_config_data(
    path: str | os.PathLike | None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """The YAML's sections (or none) with the overrides applied, without its when_pretrained
    section: not yet typed or checked."""
    data = _file_data(path)
    data.pop(WHEN_PRETRAINED, None)
    return apply_overrides(data, overrides or [])


def _load(path: str | os.PathLike | None, overrides: list[str]) -> tuple[Config, dict[str, Any]]:
    """The config, and the when_pretrained settings it took ({} where none applied)."""
    data = _file_data(path)
    section = _when_pretrained(data, path)
    data = apply_overrides(data, overrides)
    config = _build(Config, data, "")
    if not section:
        return config, {}
    try:  # checked whether or not it applies: a typo shows before it matters
        _build(Config, _with_pretrained_settings(data, section, []), "")
    except ConfigError as exc:
        raise ConfigError(f"{WHEN_PRETRAINED}: {exc}") from None
    if not config.names_pretrained_weights:
        return config, {}
    applied = {k: v for k, v in section.items() if k not in _typed_keys(overrides)}
    if applied:
        config = _build(Config, _with_pretrained_settings(data, section, overrides), "")
    return config, applied


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults), apply overrides (and the file's when_pretrained
    settings where the weights are trained), check everything."""
    config, _ = _load(path, overrides or [])
    check_model_path(config)
    check_config(config)
    return config


def pretrained_settings(
    path: str | os.PathLike | None, overrides: list[str] | None = None
) -> list[tuple[str, Any, Any]]:
    """(key, value the run takes, the file's value for random weights) of every
    when_pretrained setting that applies to this command line; empty where none does."""
    config, applied = _load(path, overrides or [])
    if not applied:
        return []
    plain = _build(Config, read_config_data(path, overrides), "").to_dict()
    taken = config.to_dict()

    def at(data: dict[str, Any], key: str) -> Any:
        for part in key.split("."):
            data = data.get(part) if isinstance(data, dict) else None
        return data

    return [(key, at(taken, key), at(plain, key)) for key in applied]


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
