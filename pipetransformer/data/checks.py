"""Cheap checks and static facts about a dataset, for use before any worker starts.

Nothing here loads the data but the labels of a data.name 'hf' or 'hf_image' table whose
config does not name them (the launcher writes them into the run's config, so its workers
read nothing here): paths are checked for existence, and the facts a model adapter needs (task,
classes, input size) come from what the dataset is known to be.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipetransformer.config import ConfigError, DataConfig


@dataclass(frozen=True)
class DataFacts:
    task: str
    num_classes: int
    in_chans: int = 3
    image_size: int = 224
    vocab_size: int | None = None
    max_seq_length: int = 128


def data_facts(config: DataConfig) -> DataFacts:
    if config.name == "digits":
        return DataFacts("classification", 10, 1, config.image_size or 16)
    if config.name in ("cifar10", "cifar100"):
        return DataFacts(
            "classification", 10 if config.name == "cifar10" else 100, 3, config.image_size or 224
        )
    if config.name == "imagefolder":
        classes = 1000
        if config.root is not None and (Path(config.root) / "train").is_dir():
            classes = (
                sum(1 for p in (Path(config.root) / "train").iterdir() if p.is_dir()) or classes
            )
        return DataFacts("classification", classes, 3, config.image_size or 224)
    if config.name == "synthetic":  # ImageNet-shaped (data/vision.py)
        return DataFacts("classification", 1000, 3, config.image_size or 224)
    if config.name == "sst2":
        return DataFacts("classification", 2, max_seq_length=config.max_seq_length)
    if config.name in ("hf", "hf_image"):
        from pipetransformer.data.table import resolved_task

        try:
            task, labels = resolved_task(config)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(str(exc)) from None
        if config.name == "hf_image":  # RGB, as ImageFolder reads its files
            return DataFacts("classification", len(labels), 3, config.image_size or 224)
        outputs = 1 if task == "regression" else len(labels)
        return DataFacts(task, outputs, max_seq_length=config.max_seq_length)
    return DataFacts("question_answering", 2, max_seq_length=config.max_seq_length)


def check_data_config(config: DataConfig) -> None:
    """Raise ConfigError naming `data.root` or `data.eval_root` when a local dataset is
    missing. (A set `data.eval_root` on a dataset other than squad is refused by
    DataConfig itself.)"""
    if config.name == "squad":
        from pipetransformer.data.squad import check_window

        try:
            check_window(config.max_seq_length, config.resolved_doc_stride)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    if config.eval_root is not None:
        eval_root = Path(config.eval_root).expanduser()
        if not eval_root.exists():
            raise ConfigError(
                f"data.eval_root: {eval_root} does not exist (a SQuAD v1.1 JSON file)"
            )
        if not eval_root.is_file():
            raise ConfigError(f"data.eval_root: {eval_root} is not a file (a SQuAD v1.1 JSON file)")
    if config.root is None:
        if config.name in ("cifar10", "cifar100", "imagefolder"):
            raise ConfigError(f"data.root: '{config.name}' needs a directory")
        return
    root = Path(config.root).expanduser()
    if config.name == "sst2":
        for name in ("train.tsv", "dev.tsv"):
            if not (root / name).is_file():
                raise ConfigError(
                    f"data.root: {root / name} does not exist (a directory with GLUE's SST-2 "
                    "train.tsv and dev.tsv, from https://dl.fbaipublicfiles.com/glue/data/"
                    "SST-2.zip; or leave data.root unset to read glue/sst2 through datasets)"
                )
    elif config.name == "squad":
        if not root.exists():
            raise ConfigError(
                f"data.root: {root} does not exist (a SQuAD v1.1 JSON file or a directory "
                "with train-v1.1.json and dev-v1.1.json, from https://rajpurkar.github.io/"
                "SQuAD-explorer/; or leave data.root and data.eval_root unset to read squad "
                "through datasets)"
            )
    elif config.name == "imagefolder":
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise ConfigError(f"data.root: {root / split} is not a directory (ImageNet layout)")
    elif config.name in ("cifar10", "cifar100") and not config.download and not root.is_dir():
        raise ConfigError(
            f"data.root: {root} does not exist (set data.download=true to fetch CIFAR)"
        )
