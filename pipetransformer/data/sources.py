"""What a `data.path` names, before anything is read: a `datasets` file builder ('csv',
'json', ...), a local file or directory, or a dataset on the Hub; the name a run of it is
given; and, when a local file does not parse, the line at fault.

A path is local when it exists, has a data file's suffix (`reviews.cvs` does not, but its
directory exists), starts with `./`, `../`, `/` or `~`, or its first directory exists
here; a Hub id is only what looks like one (`owner/name`, no data suffix). Anything else is
a local path that is missing. So a mistyped local path fails at once, naming what is close
to it in its directory, instead of after half a minute of retries against the Hub.

Owns: those rules, the messages of a missing path, the run's name (`run_name`) and
`json_error_line`.
Must not: load, fetch or parse a table (table.py and fetch.py do).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Literal

from pipetransformer.config import DataConfig, looks_like_path

# data.path values that name a `datasets` file builder (tsv: csv with tab separators).
FILE_BUILDERS = {"csv": "csv", "tsv": "csv", "json": "json", "jsonl": "json", "parquet": "parquet"}
# Suffixes of files people keep tables in: a path ending in one is never a Hub id.
DATA_SUFFIXES = frozenset(
    {".csv", ".tsv", ".json", ".jsonl", ".parquet", ".arrow", ".txt", ".xlsx", ".gz", ".zip"}
)
# A Hub dataset id: owner/name, each of letters, digits, '-', '_' and '.'.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
MISSING_HINT = (
    "a file, a save_to_disk directory, or csv/tsv/json/parquet with data.data_files; "
    "a Hub dataset is named owner/name"
)

PathKind = Literal["builder", "local", "hub"]


def path_kind(path: str) -> PathKind:
    """What `path` names: a file builder, a local path (existing or not) or a Hub id."""
    if path.lower() in FILE_BUILDERS:
        return "builder"
    if _looks_local(path) or not HUB_ID.fullmatch(path):
        return "local"
    return "hub"


def _looks_local(path: str) -> bool:
    expanded = Path(path).expanduser()
    first = Path(path).parts[0] if Path(path).parts else ""
    return (
        expanded.exists()
        or path in (".", "..")
        or path.startswith(("./", "../", "/", "~"))
        or looks_like_path(path)
        or expanded.suffix.lower() in DATA_SUFFIXES
        or (len(Path(path).parts) > 1 and Path(first).is_dir())
    )


def close_matches(path: str, limit: int = 3) -> list[str]:
    """Entries of `path`'s directory whose names are close to its own (difflib), written as
    the user wrote the directory."""
    directory = os.path.dirname(path)
    try:
        names = sorted(os.listdir(Path(directory or ".").expanduser()))
    except OSError:
        return []
    found = difflib.get_close_matches(os.path.basename(path), names, n=limit, cutoff=0.6)
    return [os.path.join(directory, name) for name in found]


def missing_path_message(key: str, path: str, hint: str = MISSING_HINT) -> str:
    """One line: `path` does not exist, with what is close to it or what the key takes."""
    directory = os.path.dirname(path)
    if directory and not Path(directory).expanduser().is_dir():
        return f"{key}: {path} does not exist (no directory {directory}/; {hint})"
    close = close_matches(path)
    if close:
        return f"{key}: {path} does not exist; did you mean {' or '.join(close)}?"
    return f"{key}: {path} does not exist ({hint})"


def check_local_paths(config: DataConfig) -> None:
    """Raise FileNotFoundError (one line, naming the key and what is close) when data.path
    is a local path that does not exist or a data.data_files entry is missing."""
    if path_kind(config.path) == "local" and not Path(config.path).expanduser().exists():
        raise FileNotFoundError(missing_path_message("data.path", config.path))
    for files in training_and_other_files(config):
        if not Path(files).expanduser().is_file():
            raise FileNotFoundError(
                missing_path_message("data.data_files", files, "a file of the table")
            )


def training_and_other_files(config: DataConfig) -> list[str]:
    """Every file data.data_files names, the training split's first, as written."""
    files = config.data_files
    if files is None:
        return []
    if not isinstance(files, dict):
        files = {config.train_split: files}
    ordered = sorted(files.items(), key=lambda item: str(item[0]) != config.train_split)
    return [str(f) for _, value in ordered for f in ([value] if isinstance(value, str) else value)]


def data_stem(config: DataConfig) -> str | None:
    """What a run of a data.name 'hf' / 'hf_image' table is named after: the training file's
    or the directory's stem (`reviews` for reviews.csv), a Hub id's name (with its
    configuration: `glue-mrpc`); None for the other datasets (their config names them)."""
    if config.name not in ("hf", "hf_image") or config.path is None:
        return None
    kind = path_kind(config.path)
    files = training_and_other_files(config)
    if kind == "builder" or (kind == "local" and files):
        stem = Path(files[0]).stem if files else config.path
    elif kind == "hub":
        stem = config.path.split("/")[-1] + (f"-{config.config_name}" if config.config_name else "")
    else:
        path = Path(config.path).expanduser()
        stem = path.resolve().name if path.is_dir() else path.stem
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.")
    return cleaned or None


def run_name(config_path: str | None, config: DataConfig) -> str:
    """What a run and its compare report are named after: one's own data (`data_stem`),
    else the config file."""
    return data_stem(config) or (Path(config_path).stem if config_path else "default")


def json_error_line(path: str | os.PathLike) -> str | None:
    """Where a JSON or JSON-lines file stops parsing ('line 300, column 41: Expecting ...'),
    as Python's json reads it; None when it parses (its problem is elsewhere). The file is
    JSON lines when its first line, or else its second, holds a whole value (then the first
    bad line is at fault); otherwise it is one document (the parser's position in it)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if _parses(lines[:1]) or (len(lines) > 1 and _parses(lines[1:2], whole=True)):
        for number, line in lines:
            try:
                json.loads(line)
            except json.JSONDecodeError as exc:
                return f"line {number}, column {exc.colno}: {exc.msg}"
        return None
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    return None


def _parses(lines: list[tuple[int, str]], whole: bool = False) -> bool:
    """Whether each line is a JSON value alone (`whole`: an object or an array)."""
    try:
        values = [json.loads(line) for _, line in lines]
    except json.JSONDecodeError:
        return False
    return bool(values) and (not whole or all(isinstance(v, (dict, list)) for v in values))
