"""Data modules: each turns a DataConfig into a DataBundle of two splits indexed by sample id.

`build_data` is the one entry point; it applies `train_subset` / `eval_subset`.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipetransformer.config import DataConfig
from pipetransformer.data.base import (
    DataBundle,
    SampleDataset,
    Subset,
    TensorSampleDataset,
    iterate_batches,
    subset_note,
)

__all__ = [
    "DataBundle",
    "SampleDataset",
    "TensorSampleDataset",
    "build_data",
    "image_normalization",
    "iterate_batches",
    "label_names",
]


def image_normalization(config: DataConfig):
    """The normalisation a run's images are trained with (an ImageNormalization), read from
    the config alone (no dataset is loaded but the bundled digits); None for text."""
    if config.name in ("sst2", "squad", "hf"):
        return None
    from pipetransformer.data.vision import image_normalization as normalization

    return normalization(config)


def label_names(config: DataConfig) -> list[str] | None:
    """The name of each class id of a classification run (what exports answer with), read
    from the config (an 'hf' table whose config does not name them is read, an ImageFolder's
    class folders listed); None where the classes have no names (CIFAR, synthetic, an
    ImageFolder no longer on disk)."""
    if config.name == "sst2":
        from pipetransformer.data.text import SST2_LABELS

        return list(SST2_LABELS)
    if config.name in ("hf", "hf_image"):
        from pipetransformer.data.table import resolved_labels

        return resolved_labels(config)
    if config.name == "digits":
        return [str(digit) for digit in range(10)]
    if config.name == "imagefolder" and config.root is not None:
        # torchvision's ImageFolder numbers the class folders in sorted order.
        train = Path(config.root).expanduser() / "train"
        if train.is_dir():
            return sorted(entry.name for entry in os.scandir(train) if entry.is_dir())
    return None


def build_data(
    config: DataConfig, *, seed: int, model_name_or_path: str | None = None
) -> DataBundle:
    if config.name == "digits":
        from pipetransformer.data.vision import load_digits_bundle

        bundle = load_digits_bundle(config, seed)
    elif config.name in ("cifar10", "cifar100"):
        from pipetransformer.data.vision import load_cifar_bundle

        bundle = load_cifar_bundle(config, 10 if config.name == "cifar10" else 100)
    elif config.name == "imagefolder":
        from pipetransformer.data.vision import load_imagefolder_bundle

        bundle = load_imagefolder_bundle(config)
    elif config.name == "hf_image":
        from pipetransformer.data.vision import load_image_table_bundle

        bundle = load_image_table_bundle(config)
    elif config.name == "synthetic":
        from pipetransformer.data.vision import load_synthetic_bundle

        bundle = load_synthetic_bundle(config, seed)
    elif config.name == "sst2":
        from pipetransformer.data.table import load_sst2_bundle

        # Subsets are taken inside, before tokenising.
        return load_sst2_bundle(config, model_name_or_path, seed)
    elif config.name == "hf":
        from pipetransformer.data.table import load_table_bundle

        return load_table_bundle(config, model_name_or_path, seed)
    elif config.name == "squad":
        from pipetransformer.data.squad import load_squad_bundle

        return load_squad_bundle(config, model_name_or_path, seed)
    else:  # config/data.py's Literal already rejects other names
        raise ValueError(f"data.name: unknown dataset '{config.name}'")
    sizes = {"train": (config.train_subset, len(bundle.train))}
    sizes["eval"] = (config.eval_subset, len(bundle.eval))
    bundle.subsets = subset_note("samples", sizes)
    if config.train_subset is not None:
        bundle.train = Subset(bundle.train, config.train_subset, seed)
    if config.eval_subset is not None:
        bundle.eval = Subset(bundle.eval, config.eval_subset, seed + 1)
    return bundle
