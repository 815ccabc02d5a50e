"""Classification tables: a user's labelled text (CSV, TSV, JSON/JSONL, Parquet, a
`save_to_disk` directory or a hub dataset) or labelled images (a table with a `datasets`
Image column, or a directory of class folders) read through `datasets`, checked, labelled
and (text) encoded. SST-2 (text.py) is one source of the same text tables; vision.py turns
image tables into samples with ImageFolder's transforms.

A table is a split's texts (one column, or two for sentence pairs) or the rows of its
image column, and its raw labels.
Label names come from `data.labels`, else the dataset's ClassLabel names, else the
training split's distinct labels sorted (numbers numerically): one fixed order, mapped
once, which the launcher writes into the run's config and exports carry. Every problem in
the data (a missing column, an empty text, an unknown label, a file that does not parse)
is a ValueError naming the file or split and the row (1-based, the header not counted).

Owns: reading and checking the tables, the label names, the held-out evaluation share and
encoding tables into a DataBundle. Must not: know about ranks or samplers.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetransformer.config import DataConfig
from pipetransformer.data.base import DataBundle, TextSampleDataset, subset_indices, subset_note
from pipetransformer.data.sources import (
    FILE_BUILDERS,
    check_local_paths,
    json_error_line,
    path_kind,
)
from pipetransformer.data.text import (
    HOLDOUT_SEED,
    SST2_LABELS,
    encode,
    holdout_split,
    pick_tokenizer,
    read_sst2,
)

logger = logging.getLogger(__name__)

DEFAULT_TEXT_COLUMNS = (["text"], ["sentence"], ["sentence1", "sentence2"])
EVAL_SPLITS = ("validation", "dev")


@dataclass
class TextTable:
    """One split: texts (a second list for pairs), raw labels, and where they came from."""

    first: list[str]
    second: list[str] | None
    labels: list[Any]
    source: str  # for messages: the file, or the split of the dataset
    # The label column's ClassLabel names (its values are then indices into them).
    class_names: list[str] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, rows: Sequence[int]) -> TextTable:
        return TextTable(
            [self.first[i] for i in rows],
            None if self.second is None else [self.second[i] for i in rows],
            [self.labels[i] for i in rows],
            self.source,
            self.class_names,
        )


@dataclass
class ImageTable:
    """One split of an image table: the `datasets` split, its image column, the rows of it
    in this table (images are decoded only when a sample is fetched), the raw labels."""

    dataset: Any  # a datasets.Dataset
    column: str
    rows: list[int]
    labels: list[Any]
    source: str
    class_names: list[str] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, rows: Sequence[int]) -> ImageTable:
        return ImageTable(
            self.dataset,
            self.column,
            [self.rows[i] for i in rows],
            [self.labels[i] for i in rows],
            self.source,
            self.class_names,
        )

    def image(self, index: int):
        """Row `index` of this table as an RGB PIL image (as torchvision's ImageFolder
        loads its files)."""
        return self.dataset[self.rows[index]][self.column].convert("RGB")


@dataclass
class LabelledTables:
    train: TextTable | ImageTable
    eval: TextTable | ImageTable
    label_names: list[str]  # none for a regression
    task: str = "classification"  # or "regression" (text tables)
    # The columns read and where evaluation comes from, in words (DataBundle.read_from).
    read_from: str | None = None


# ----------------------------------------------------------------------------- reading


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars, and none of datasets' own error lines (the caller's one line says
    it): a failed parse is logged by datasets before it raises."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    level = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity(logging.CRITICAL + 1)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()


def _innermost(exc: BaseException) -> str:
    """The first line of the deepest cause: the parser's own words (line, row, position)."""
    while exc.__cause__ is not None or (
        exc.__context__ is not None and not exc.__suppress_context__
    ):
        deeper = exc.__cause__ or exc.__context__
        if not str(deeper).strip():
            break
        exc = deeper
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else 'no detail'}"


def _files_of(config: DataConfig) -> dict[str, list[str]] | None:
    """data.data_files as {split: [files]}; a bare file or list is the training split; a
    data.path that is itself a file is the training split when data_files is unset."""
    files = config.data_files
    if files is None:
        path = Path(config.path).expanduser()
        if path.is_file():
            return {config.train_split: [str(path)]}
        return None
    if not isinstance(files, dict):
        files = {config.train_split: files}
    return {
        str(split): [str(Path(f).expanduser()) for f in ([v] if isinstance(v, str) else v)]
        for split, v in files.items()
    }


def _builder(config: DataConfig, files: dict[str, list[str]] | None) -> tuple[str, dict]:
    """(datasets builder, its options) for local files; ('', {}) for anything else."""
    kind = config.path.lower()
    if kind not in FILE_BUILDERS and files is not None:
        suffixes = {Path(f).suffix.lower().lstrip(".") for fs in files.values() for f in fs}
        if len(suffixes) == 1 and next(iter(suffixes)) in FILE_BUILDERS:
            kind = next(iter(suffixes))
    if kind not in FILE_BUILDERS:
        return "", {}
    return FILE_BUILDERS[kind], ({"delimiter": "\t"} if kind == "tsv" else {})


def hub_dataset(config: DataConfig) -> bool:
    """Whether data.path names a hub dataset (owner/name: not a file builder, not a local
    path; data/sources.py)."""
    return path_kind(config.path) == "hub"


def load_splits(config: DataConfig) -> dict[str, Any]:
    """{split name: datasets.Dataset} of data.path (and data.data_files)."""
    import datasets

    check_local_paths(config)  # a missing local path is one line, never a Hub request
    files = _files_of(config)
    builder, options = _builder(config, files)
    path = Path(config.path).expanduser()
    with _quiet_datasets():
        if builder:
            if files is None:
                raise ValueError(f"data.data_files: data.path '{config.path}' needs files to read")
            splits = {}
            for split, fs in files.items():
                splits[split] = _load_files(builder, options, split, fs)
            return splits
        if path.is_dir() and any(
            (path / marker).is_file() for marker in ("dataset_dict.json", "state.json")
        ):
            try:
                loaded = datasets.load_from_disk(str(path))
            except Exception as exc:  # a damaged or foreign directory
                raise ValueError(
                    f"data.path: {path}: not a save_to_disk dataset ({_innermost(exc)})"
                ) from None
            return (
                dict(loaded)
                if isinstance(loaded, datasets.DatasetDict)
                else {config.train_split: loaded}
            )
        try:
            loaded = datasets.load_dataset(config.path, config.config_name, data_files=files)
        except Exception as exc:  # offline, unknown id, a directory of unreadable files
            label = f"{config.path}/{config.config_name}" if config.config_name else config.path
            raise ValueError(
                f"data.path: cannot load '{label}' through `datasets` ({_innermost(exc)}); "
                "download it where the hub is in reach and save_to_disk, or name local files"
            ) from None
    return dict(loaded)


def _load_files(builder: str, options: dict, split: str, files: list[str]):
    import datasets

    try:
        return datasets.load_dataset(builder, data_files={split: files}, split=split, **options)
    except Exception as first:
        # JSON: the line at fault, which datasets' parsers do not name ("Trailing data").
        for f in files if builder == "json" else []:
            line = json_error_line(f)
            if line is not None:
                raise ValueError(f"{f}: cannot be read as json: {line}") from None
        # Name the file at fault: read each alone (a split is usually one file).
        for f in files if len(files) > 1 else []:
            try:
                datasets.load_dataset(builder, data_files={split: [f]}, split=split, **options)
            except Exception as exc:
                raise ValueError(f"{f}: cannot be read as {builder}: {_innermost(exc)}") from None
        raise ValueError(
            f"{', '.join(files)}: cannot be read as {builder}: {_innermost(first)}"
        ) from None


def _source(config: DataConfig, split: str) -> str:
    files = (_files_of(config) or {}).get(split)
    if files:
        return files[0] if len(files) == 1 else f"{', '.join(files)} (split '{split}')"
    return f"split '{split}' of {config.path}"


def _text_columns(config: DataConfig, columns: Sequence[str], source: str) -> list[str]:
    wanted = config.text_column_names
    candidates = [wanted] if wanted is not None else DEFAULT_TEXT_COLUMNS
    for names in candidates:
        if all(n in columns for n in names):
            return names
    missing = [n for n in (wanted or ["text"]) if n not in columns]
    key = "data.text_columns" + ("" if wanted else " (default 'text' or 'sentence')")
    raise ValueError(
        f"{key}: no column {', '.join(repr(m) for m in missing)} in {source}; "
        f"its columns: {', '.join(columns)}"
    )


def _table(config: DataConfig, dataset, split: str) -> TextTable:
    """The split as a TextTable, every text checked."""
    source = _source(config, split)
    columns = list(dataset.column_names)
    names = _text_columns(config, columns, source)
    if config.label_column not in columns:
        raise ValueError(
            f"data.label_column: no column '{config.label_column}' in {source}; "
            f"its columns: {', '.join(columns)}"
        )
    texts = [dataset[name] for name in names]
    for name, column in zip(names, texts):
        for row, text in enumerate(column, start=1):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{source}: row {row}: column '{name}' has no text ({text!r})")
    feature = dataset.features.get(config.label_column)
    class_names = list(feature.names) if hasattr(feature, "names") else None
    return TextTable(
        list(texts[0]),
        list(texts[1]) if len(texts) > 1 else None,
        list(dataset[config.label_column]),
        source,
        class_names,
    )


def _image_column(config: DataConfig, dataset, source: str) -> str:
    import datasets

    columns = list(dataset.column_names)
    images = [n for n in columns if isinstance(dataset.features[n], datasets.Image)]
    name = config.image_column
    if name is None:
        if not images:
            raise ValueError(
                f"data.image_column: no image column (a `datasets` Image feature) in {source}; "
                f"its columns: {', '.join(columns)}"
            )
        if len(images) > 1:
            raise ValueError(
                f"data.image_column: {source} has several image columns ({', '.join(images)}); "
                "name one"
            )
        return images[0]
    if name not in columns:
        raise ValueError(
            f"data.image_column: no column '{name}' in {source}; its columns: {', '.join(columns)}"
        )
    if name not in images:
        raise ValueError(
            f"data.image_column: column '{name}' of {source} holds {dataset.features[name]}, "
            "not images (a `datasets` Image feature)"
        )
    return name


def _first_missing_image(stored) -> int | None:
    """The first row (1-based) of an Image column's storage (a struct of the file's bytes
    and path) with neither, read without decoding an image; None when every row has one."""
    import pyarrow.compute as pc

    missing = pc.or_kleene(
        pc.is_null(stored),
        pc.and_kleene(
            pc.is_null(pc.struct_field(stored, "bytes")),
            pc.is_null(pc.struct_field(stored, "path")),
        ),
    )
    index = pc.index(pc.fill_null(missing, True), True).as_py()
    return None if index < 0 else index + 1


def _image_table(config: DataConfig, dataset, split: str) -> ImageTable:
    """The split as an ImageTable, every row checked to have an image (present, not
    decoded: a damaged file fails when its sample is first read)."""
    source = _source(config, split)
    column = _image_column(config, dataset, source)
    if config.label_column not in dataset.column_names:
        raise ValueError(
            f"data.label_column: no column '{config.label_column}' in {source}; "
            f"its columns: {', '.join(dataset.column_names)}"
        )
    row = _first_missing_image(dataset.with_format("arrow")[column])
    if row is not None:
        raise ValueError(f"{source}: row {row}: column '{column}' has no image")
    feature = dataset.features.get(config.label_column)
    return ImageTable(
        dataset,
        column,
        list(range(len(dataset))),
        list(dataset[config.label_column]),
        source,
        list(feature.names) if hasattr(feature, "names") else None,
    )


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _label_key(value: Any, class_names: list[str] | None) -> str:
    if class_names is not None and isinstance(value, int) and 0 <= value < len(class_names):
        return class_names[value]
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # a CSV column with a gap reads as floats
    return str(value)


def discover_labels(table: TextTable | ImageTable) -> list[str]:
    """The label names of a training table: ClassLabel names, else its distinct labels
    sorted (numbers numerically, else as text)."""
    if table.class_names is not None:
        return list(table.class_names)
    values = {v for v in table.labels if not _missing(v)}
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        ordered = sorted(values)
    else:
        ordered = sorted(values, key=str)
    names = list(dict.fromkeys(_label_key(v, None) for v in ordered))
    if len(names) < 2:
        raise ValueError(
            f"{table.source}: column labels: a classifier needs at least 2 distinct labels, "
            f"found {names}"
        )
    return names


def label_ids(table: TextTable | ImageTable, names: list[str]) -> list[int]:
    """Each row's class id; an unknown or missing label is an error naming the row."""
    index = {name: i for i, name in enumerate(names)}
    ids = []
    for row, value in enumerate(table.labels, start=1):
        key = None if _missing(value) else _label_key(value, table.class_names)
        if key not in index:
            raise ValueError(
                f"{table.source}: row {row}: label {value!r} is not one of the labels "
                f"{names} (data.labels, or the training split's)"
            )
        ids.append(index[key])
    return ids


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def table_task(config: DataConfig, train: TextTable | ImageTable) -> str:
    """data.task, with 'auto' resolved from the training labels: a regression when they are
    numbers and one is not whole (3.8), else a classification."""
    if config.task != "auto" or config.name != "hf":
        return "classification" if config.task == "auto" else config.task
    values = [v for v in train.labels if not _missing(v)]
    if (
        config.labels is None
        and train.class_names is None
        and values
        and all(_is_number(v) for v in values)
        and any(isinstance(v, float) and not v.is_integer() for v in values)
    ):
        logger.info(
            "data.task: regression (the column '%s' of %s holds numbers that are not whole; "
            "data.task=classification makes each distinct value a class)",
            config.label_column,
            train.source,
        )
        return "regression"
    return "classification"


def targets_of(table: TextTable | ImageTable) -> list[float]:
    """A regression table's labels as numbers; a missing or non-numeric label is an error
    naming the row."""
    targets = []
    for row, value in enumerate(table.labels, start=1):
        try:
            number = float(value) if isinstance(value, str) or _is_number(value) else math.nan
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(
                f"{table.source}: row {row}: label {value!r} is not a number (data.task regression)"
            )
        targets.append(number)
    return targets


def read_tables(config: DataConfig) -> LabelledTables:
    """The training and evaluation tables of a data.name 'hf' (text) or 'hf_image' config,
    checked, with their task and label names; labels stay raw (map them with `label_ids`,
    or `targets_of` for a regression)."""
    read = _image_table if config.name == "hf_image" else _table
    splits = load_splits(config)
    if config.train_split not in splits:
        raise ValueError(
            f"data.train_split: no split '{config.train_split}' in {config.path}; "
            f"its splits: {', '.join(splits)}"
        )
    if config.eval_split is not None and config.eval_split not in splits:
        raise ValueError(
            f"data.eval_split: no split '{config.eval_split}' in {config.path}; "
            f"its splits: {', '.join(splits)}"
        )
    train = read(config, splits[config.train_split], config.train_split)
    columns = _columns_read(config, splits[config.train_split], train)
    task = table_task(config, train)
    names = [] if task == "regression" else config.label_names or discover_labels(train)

    def check(table: TextTable | ImageTable) -> None:  # every label known, or a number
        if task == "regression":
            targets_of(table)
        else:
            label_ids(table, names)

    check(train)  # before any share is held out: rows are the file's
    eval_split = config.eval_split
    if eval_split is None and config.holdout is None:
        eval_split = next((s for s in EVAL_SPLITS if s in splits), None)
    if eval_split is not None:
        evaluation = read(config, splits[eval_split], eval_split)
        check(evaluation)
        where = f"split '{eval_split}' ({evaluation.source})"
    else:
        size = config.holdout or max(1, round(config.eval_share * len(train)))
        if size >= len(train):
            raise ValueError(
                f"data.eval_share: holding out {size} of {len(train)} rows of {train.source} "
                "leaves nothing to train on"
            )
        order = subset_indices(len(train), len(train), HOLDOUT_SEED)
        evaluation = train.take(order[:size])
        train = train.take(order[size:])
        share = "data.holdout" if config.holdout else f"data.eval_share {config.eval_share:g}"
        where = f"{size} rows held out of the training split ({share}, one fixed draw)"
    read_from = f"{columns} of {train.source}; evaluation: {where}"
    return LabelledTables(train, evaluation, names, task, read_from)


def _columns_read(config: DataConfig, dataset, table: TextTable | ImageTable) -> str:
    """'text column 'review', label column 'stars'' (the pair's two columns, or the image
    column) of the training split."""
    if isinstance(table, ImageTable):
        read = f"image column '{table.column}'"
    else:
        names = _text_columns(config, list(dataset.column_names), table.source)
        read = f"text column{'s' if len(names) > 1 else ''} " + " + ".join(f"'{n}'" for n in names)
    return f"{read}, label column '{config.label_column}'"


def resolved_task(config: DataConfig) -> tuple[str, list[str]]:
    """The task a run of `config` trains ('classification' or 'regression') and its label
    names (none for a regression); reads the data unless the config already says both."""
    if config.task == "regression":
        return "regression", []
    if config.label_names is not None:
        return "classification", config.label_names
    tables = read_tables(config)
    return tables.task, tables.label_names


def resolved_labels(config: DataConfig) -> list[str]:
    """The label names a run of `config` trains with (reads the data unless data.labels);
    none for a regression."""
    return resolved_task(config)[1]


# ----------------------------------------------------------------------------- encoding


def encode_tables(
    tables: LabelledTables,
    config: DataConfig,
    model_name_or_path: str | None,
    seed: int,
) -> DataBundle:
    """The tables as a classification (or regression) DataBundle: subsets drawn before
    tokenising (seeded), texts encoded to max_seq_length tensors (pairs as the tokenizer
    joins them) and fetched as data.padding pads them, class ids (or float targets) as
    targets."""
    regression = tables.task == "regression"
    splits = {}
    sizes = {"train": (config.train_subset, len(tables.train))}
    sizes["eval"] = (config.eval_subset, len(tables.eval))
    for name, table, size in (
        ("train", tables.train, config.train_subset),
        ("eval", tables.eval, config.eval_subset),
    ):
        if size is not None:
            table = table.take(subset_indices(len(table), size, seed))
        if regression:
            targets = torch.tensor(targets_of(table), dtype=torch.float32)
        else:
            targets = torch.tensor(label_ids(table, tables.label_names), dtype=torch.long)
        splits[name] = (table, targets)
    train = splits["train"][0]
    tokenizer = pick_tokenizer(config, model_name_or_path, train.first + (train.second or []))
    datasets_ = {
        name: TextSampleDataset(
            encode(tokenizer, table.first, config.max_seq_length, table.second),
            targets,
            config.padding,
            config.pad_to_multiple_of,
        )
        for name, (table, targets) in splits.items()
    }
    return DataBundle(
        train=datasets_["train"],
        eval=datasets_["eval"],
        task=tables.task,
        num_classes=1 if regression else len(tables.label_names),
        vocab_size=len(tokenizer),
        max_seq_length=config.max_seq_length,
        label_names=None if regression else list(tables.label_names),
        subsets=subset_note("rows", sizes),
    )


def load_table_bundle(config: DataConfig, model_name_or_path: str | None, seed: int) -> DataBundle:
    tables = read_tables(config)
    bundle = encode_tables(tables, config, model_name_or_path, seed)
    bundle.read_from = tables.read_from
    return bundle


def load_sst2_bundle(config: DataConfig, model_name_or_path: str | None, seed: int) -> DataBundle:
    raw = read_sst2(config.root)
    train_sentences, train_labels = raw["train"]
    eval_sentences, eval_labels = raw["dev"]
    if config.holdout is not None:
        (train_sentences, train_labels), (eval_sentences, eval_labels) = holdout_split(
            train_sentences, train_labels, config.holdout
        )
        logger.warning(
            "data.holdout: SST-2's training split is phrases of the same sentences, so the "
            "%d held-out phrases share text with the phrases that train (a fragment of one "
            "training sentence, or a sentence whose fragments train): not an unseen test "
            "set; unset data.holdout to score on the %d dev sentences",
            len(eval_labels),
            len(raw["dev"][1]),
        )
    # Labels 0/1 index GLUE's names, as a ClassLabel column's values do.
    tables = LabelledTables(
        TextTable(train_sentences, None, train_labels, "sst2 train", SST2_LABELS),
        TextTable(eval_sentences, None, eval_labels, "sst2 dev", SST2_LABELS),
        SST2_LABELS,
    )
    bundle = encode_tables(tables, config, model_name_or_path, seed)
    where = f"{config.root}/train.tsv" if config.root else "GLUE's sst2 through `datasets`"
    held = f"{config.holdout} sentences held out of the training split (data.holdout)"
    bundle.read_from = f"SST-2 from {where}; evaluation: {held if config.holdout else 'dev'}"
    return bundle
