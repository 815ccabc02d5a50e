"""The data section: the dataset, where it is read from, its columns, split, task and metric.

Owns: DataConfig, the dataset and metric names (DatasetName, TABLE_DATASETS, MetricName,
REGRESSION_METRICS) and the checks of the data keys (whether the model reads the data is
checks.py's). Must not: import anything outside config/ or read any data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipetransformer.config.errors import _fail

DatasetName = Literal[
    "digits", "cifar10", "cifar100", "imagefolder", "synthetic", "sst2", "squad", "hf", "hf_image"
]
# The names whose data is a labelled table read through `datasets` (data/table.py): text
# classification, and image classification from a table with an image column.
TABLE_DATASETS = ("hf", "hf_image")
# The names whose samples are token sequences (padded: data.padding, data.group_by_length).
TEXT_DATASETS = ("sst2", "squad", "hf")
# data.metric: what eval_metric is (the best checkpoint and the compare report follow it);
# every metric of the task is recorded beside it (docs/data.md, "Metrics"). Higher is better
# for each (a regression's mean squared error is recorded, never followed).
MetricName = Literal["auto", "accuracy", "f1", "f1_macro", "mcc", "pearson", "spearman"]
REGRESSION_METRICS = ("pearson", "spearman")


@dataclass(frozen=True)
class DataConfig:
    name: DatasetName = "digits"
    # Dataset location: a directory (imagefolder, cifar, sst2 TSVs) or file (squad JSON).
    # None: fetch through torchvision / datasets. 'synthetic' (random ImageNet-shaped
    # images for benchmarks, deterministic from trainer.seed) reads no files.
    root: str | None = None
    # Where the evaluation split lives when it is not under data.root: for squad, a SQuAD
    # v1.1 JSON file (data.root, or datasets' "squad" when null, then gives only the
    # training split). Other datasets reject it.
    eval_root: str | None = None
    # Side length images are resized to; None: the dataset's default (16 for digits).
    image_size: int | None = None
    max_seq_length: int = 128
    # Text: 'batch' pads each batch to its longest sample, rounded up to a multiple of
    # pad_to_multiple_of (transformers' DataCollatorWithPadding); 'max_length' pads every
    # batch to max_seq_length; 'packed' keeps each batch's samples and lays them end to end
    # in rows of that length, attention and positions confined to each sample; 'auto'
    # packs a batch where that saves enough of its padded tokens, else pads it (per batch,
    # from its lengths: utils/padding.py `packing_pays`), and is the default: packing
    # measured fastest on SST-2 at 128 tokens and SQuAD at 384 (docs/architecture.md, "Which
    # padding by default"); data without a sequence ignores it. Per-sample results are the
    # same (docs/data.md, "Padding").
    padding: Literal["batch", "max_length", "packed", "auto"] = "auto"
    pad_to_multiple_of: int = 8
    # Text: draw each epoch's batches from pools of samples of similar length (transformers'
    # group_by_length: megabatches of 50 batches sorted longest first).
    group_by_length: bool = False
    # SQuAD: tokens of overlap between windows of a long context; None: max_seq_length // 4.
    doc_stride: int | None = None
    # Tokenizer (hub id or directory); None: the model's, or a word vocabulary built from
    # the training text when the model is random.
    tokenizer: str | None = None
    # Keep only the first N samples (after a seeded shuffle) of each split; None: all.
    train_subset: int | None = None
    eval_subset: int | None = None
    # SST-2: evaluate on this many phrases held out of the training split (one fixed draw,
    # the same for every trainer.seed, no row of them trains) instead of the 872 dev
    # sentences; train_subset is then drawn from the rest. SST-2's training rows are phrases
    # of the same sentences, so held-out rows share text with training rows: the dev split
    # is the clean test (docs/data.md). None: the dev split.
    holdout: int | None = None
    augment: bool = False
    download: bool = False
    # Loader worker processes per training process (and as many for evaluation), at most the
    # process's share of the node's cores less one (data/loader.py `workers_per_process`).
    num_workers: int = 0
    # name 'hf' (text classification through `datasets`, docs/data.md) and 'hf_image' (image
    # classification, the same keys): what datasets.load_dataset(path, data_files=...)
    # reads: 'csv', 'tsv', 'json', 'parquet', a file of one of those kinds, a directory
    # written by save_to_disk (or of images in class folders, for hf_image), or a hub id.
    path: str | None = None
    # A file or list of files (the training split), or a mapping from split name to files.
    data_files: str | list[str] | dict[str, Any] | None = None
    # A hub dataset's configuration (datasets' `name`: 'mrpc' of 'nyu-mll/glue').
    config_name: str | None = None
    # The text column, or two for sentence pairs; None: 'text' or 'sentence', else the pair
    # 'sentence1', 'sentence2'.
    text_columns: str | list[str] | None = None
    # hf_image: the column of images (a `datasets` Image feature); None: the table's one
    # Image column.
    image_column: str | None = None
    label_column: str = "label"
    train_split: str = "train"
    # None: 'validation' (or 'dev') when the data has one, else data.eval_share of the
    # training split held out (a fixed draw, the same for every trainer.seed).
    eval_split: str | None = None
    eval_share: float = 0.1
    # Label names in class-id order. None: the dataset's ClassLabel names, else the training
    # split's distinct labels sorted (numbers numerically); the launcher writes them into
    # the run's config, and exports carry them (id2label).
    labels: list[str | int] | None = None
    # hf: 'regression' predicts the label column's number (one output, mean squared error;
    # STS-B); 'auto': regression when the training labels are numbers and one is not whole
    # (3.8), else classification. The launcher writes what it found into the run's config.
    task: Literal["auto", "classification", "regression"] = "auto"
    metric: MetricName = "auto"

    @property
    def text_column_names(self) -> list[str] | None:
        """data.text_columns as a list (None: the defaults)."""
        if isinstance(self.text_columns, str):
            return [self.text_columns]
        return self.text_columns

    @property
    def label_names(self) -> list[str] | None:
        """data.labels as strings (None: not set)."""
        return None if self.labels is None else [str(v) for v in self.labels]

    @property
    def resolved_doc_stride(self) -> int:
        return self.max_seq_length // 4 if self.doc_stride is None else self.doc_stride

    def __post_init__(self) -> None:
        for key in ("train_subset", "eval_subset", "image_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                _fail(f"data.{key}", f"must be >= 1 or null, got {value}")
        if self.max_seq_length < 8:
            _fail("data.max_seq_length", "must be >= 8")
        if self.padding not in ("batch", "max_length", "packed", "auto"):
            _fail(
                "data.padding",
                f"'batch', 'max_length', 'packed' or 'auto', got {self.padding!r}",
            )
        if self.padding == "packed" and self.name not in TEXT_DATASETS:
            _fail(
                "data.padding",
                f"'{self.padding}' lays text samples end to end; '{self.name}' is not text "
                f"({', '.join(TEXT_DATASETS)} are)",
            )
        if isinstance(self.pad_to_multiple_of, bool) or self.pad_to_multiple_of < 1:
            _fail("data.pad_to_multiple_of", f"must be >= 1, got {self.pad_to_multiple_of}")
        if self.group_by_length and self.name not in TEXT_DATASETS:
            _fail(
                "data.group_by_length",
                f"groups text by its length; '{self.name}' is not text "
                f"({', '.join(TEXT_DATASETS)} are)",
            )
        if self.doc_stride is not None and self.doc_stride < 0:
            _fail("data.doc_stride", "must be >= 0 or null")
        if self.num_workers < 0:
            _fail("data.num_workers", "must be >= 0")
        if self.name == "synthetic":
            for key in ("root", "augment"):
                if getattr(self, key):
                    _fail(f"data.{key}", "'synthetic' generates its images: leave it unset")
        if self.holdout is not None and (
            self.holdout < 1 or self.name not in ("sst2", *TABLE_DATASETS)
        ):
            _fail(
                "data.holdout",
                "must be >= 1 or null, and only sst2, hf and hf_image hold out a test split",
            )
        if not 0 < self.eval_share < 1:
            _fail("data.eval_share", f"must be in (0, 1), got {self.eval_share}")
        if self.name in TABLE_DATASETS:
            if self.path is None:
                _fail(
                    "data.path",
                    f"data.name '{self.name}' reads data.path (csv, json, parquet, a file, "
                    "a save_to_disk directory or a hub id)",
                )
            if self.root is not None:
                _fail("data.root", f"data.name '{self.name}' reads data.path and data.data_files")
            columns = self.text_column_names
            if columns is not None and not 1 <= len(columns) <= 2:
                _fail("data.text_columns", f"one column or two (a pair), got {columns}")
            if self.labels is not None and len({str(v) for v in self.labels}) != len(self.labels):
                _fail("data.labels", f"names must be distinct, got {self.labels}")
            if self.labels is not None and len(self.labels) < 2:
                _fail("data.labels", f"a classifier needs at least 2 labels, got {self.labels}")
        else:
            for key in ("path", "data_files", "config_name", "eval_split", "labels"):
                if getattr(self, key) is not None:
                    _fail(
                        f"data.{key}", f"only data.name hf and hf_image read it, not '{self.name}'"
                    )
        if self.task != "auto" and self.name != "hf":
            _fail("data.task", f"only data.name 'hf' reads it, not '{self.name}'")
        if self.task == "regression" and self.labels is not None:
            _fail("data.labels", "a regression has no labels to name (data.task regression)")
        regression_metric = self.metric in REGRESSION_METRICS
        if (
            self.task != "auto"
            and self.metric != "auto"
            and regression_metric != (self.task == "regression")
        ):
            _fail("data.metric", f"'{self.metric}' does not score a {self.task}")
        if self.text_columns is not None and self.name != "hf":
            _fail("data.text_columns", f"only data.name 'hf' reads it, not '{self.name}'")
        if self.image_column is not None and self.name != "hf_image":
            _fail("data.image_column", f"only data.name 'hf_image' reads it, not '{self.name}'")
        if self.metric != "auto" and self.name == "squad":
            _fail("data.metric", "squad reports the official F1 and exact match; leave it 'auto'")
        if self.eval_root is not None and self.name != "squad":
            # Nothing else reads it: refused here, not silently ignored.
            _fail(
                "data.eval_root",
                f"only squad reads a separate evaluation file; '{self.name}' takes its evaluation "
                "split from data.root",
            )
