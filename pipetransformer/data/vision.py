"""Image datasets: scikit-learn digits (offline default), CIFAR-10/100, ImageFolder, image
tables read through `datasets` (hf_image: read and labelled by table.py), and synthetic
ImageNet-shaped images for benchmarks at full model size without the data.

Owns: reading (or generating) the images, resizing and normalising them, optional random
augmentation.
Must not: know about ranks or samplers.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipetransformer.config import DataConfig
from pipetransformer.data.base import (
    DataBundle,
    ItemSampleDataset,
    SampleDataset,
    TensorSampleDataset,
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# What `synthetic` stands in for: ImageNet-1k's classes and split sizes.
SYNTHETIC_CLASSES = 1000
SYNTHETIC_SPLIT_SAMPLES = {"train": 1_281_167, "eval": 50_000}


@dataclass(frozen=True)
class ImageNormalization:
    """How a dataset turns its images into model inputs: resize (interpolation, the share of
    the resized image kept by the centre crop), then (x - mean) / std per channel, on pixel
    values in [0, 1]. What an export's timm config must say for timm's own transforms to
    give the model the inputs it trained on."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"
    crop_pct: float = 1.0


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits as read: (images (N, 1, 8, 8) in [0, 1], labels, train ids, eval ids), a
    fixed 80/20 stratified split (part of the dataset's definition, not of the run)."""
    return tuple(t.clone() for t in _digits_read())


@functools.cache
def _digits_read() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """digits_split's tensors, read once a process: a run reads them for its normalisation
    and for its data, and scikit-learn's import and CSV parse cost a second or more."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, eval_idx = train_test_split(
        np.arange(len(labels)), test_size=0.2, random_state=0, stratify=labels.numpy()
    )
    return images, labels, torch.as_tensor(train_idx), torch.as_tensor(eval_idx)


def _digits_resized(
    config: DataConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    images, labels, train_idx, eval_idx = digits_split()
    size = config.image_size or 16
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return images, labels, train_idx, eval_idx


def _digits_statistics(
    images: torch.Tensor, train_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return images[train_idx].mean(), images[train_idx].std()


def image_normalization(config: DataConfig) -> ImageNormalization | None:
    """The normalisation `config`'s images are trained with; None for text datasets."""
    if config.name == "digits":
        images, _, train_idx, _ = _digits_resized(config)
        mean, std = _digits_statistics(images, train_idx)
        return ImageNormalization((float(mean),), (float(std),))
    if config.name in ("cifar10", "cifar100", "imagefolder", "hf_image"):
        return ImageNormalization(IMAGENET_MEAN, IMAGENET_STD)  # Resize + CenterCrop(size)
    if config.name == "synthetic":  # already what normalised pixels look like
        return ImageNormalization((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    return None


def load_digits_bundle(config: DataConfig, seed: int) -> DataBundle:
    """1,797 real 8x8 handwritten digits, upscaled (bilinear); a fixed 80/20 stratified split,
    normalised with the training split's own mean and std."""
    images, labels, train_idx, eval_idx = _digits_resized(config)
    mean, std = _digits_statistics(images, train_idx)
    images = (images - mean) / std
    return DataBundle(
        train=TensorSampleDataset([images[train_idx]], labels[train_idx]),
        eval=TensorSampleDataset([images[eval_idx]], labels[eval_idx]),
        task="classification",
        num_classes=10,
        in_chans=1,
        image_size=config.image_size or 16,
    )


def _transforms(size: int, augment: bool):
    from torchvision import transforms as T

    normalize = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if augment:
        train = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), *normalize])
    else:
        train = T.Compose([T.Resize(size), T.CenterCrop(size), *normalize])
    eval_ = T.Compose([T.Resize(size), T.CenterCrop(size), *normalize])
    return train, eval_


def _torchvision_split(dataset, transform, random_inputs: bool) -> ItemSampleDataset:
    targets = torch.as_tensor(list(dataset.targets), dtype=torch.long)
    return ItemSampleDataset(
        load=lambda i: dataset[i][0],  # built without a transform: a PIL image
        transform=transform,
        targets=targets,
        random_inputs=random_inputs,
    )


def load_cifar_bundle(config: DataConfig, num_classes: int) -> DataBundle:
    from torchvision import datasets

    if config.root is None:
        raise ValueError(
            f"data.root: cifar{num_classes} needs a directory (data.download=true fetches into it)"
        )
    root = Path(config.root).expanduser()
    cls = datasets.CIFAR10 if num_classes == 10 else datasets.CIFAR100
    if config.download:  # one process fetches; the others wait and find the files
        from pipetransformer.data.fetch import fetch_cifar

        fetch_cifar(root, num_classes)
    try:
        train = cls(str(root), train=True, download=False)
        eval_ = cls(str(root), train=False, download=False)
    except RuntimeError as exc:
        raise FileNotFoundError(
            f"data.root: no CIFAR-{num_classes} data under {root} ({exc}); "
            "set data.download=true to fetch it"
        ) from exc
    size = config.image_size or 224
    train_tf, eval_tf = _transforms(size, config.augment)
    return DataBundle(
        train=_torchvision_split(train, train_tf, config.augment),
        eval=_torchvision_split(eval_, eval_tf, False),
        task="classification",
        num_classes=num_classes,
        in_chans=3,
        image_size=size,
    )


def load_imagefolder_bundle(config: DataConfig) -> DataBundle:
    """ImageNet layout: ROOT/train/<class>/*.jpg and ROOT/val/<class>/*.jpg."""
    from torchvision import datasets

    if config.root is None:
        raise ValueError("data.root: imagefolder needs a directory with train/ and val/")
    root = Path(config.root).expanduser()
    splits = {}
    for split in ("train", "val"):
        path = root / split
        if not path.is_dir():
            raise FileNotFoundError(
                f"data.root: {path} is not a directory (expected ImageNet layout)"
            )
        try:
            splits[split] = datasets.ImageFolder(str(path))
        except (FileNotFoundError, RuntimeError) as exc:
            raise FileNotFoundError(f"data.root: {path}: {exc}") from exc
    if splits["train"].classes != splits["val"].classes:
        raise ValueError(f"data.root: {root}/train and {root}/val hold different class folders")
    size = config.image_size or 224
    train_tf, eval_tf = _transforms(size, config.augment)
    return DataBundle(
        train=_torchvision_split(splits["train"], train_tf, config.augment),
        eval=_torchvision_split(splits["val"], eval_tf, False),
        task="classification",
        num_classes=len(splits["train"].classes),
        in_chans=3,
        image_size=size,
    )


def load_image_table_bundle(config: DataConfig) -> DataBundle:
    """An image table (data.name hf_image): its image column through ImageFolder's
    transforms, its labels mapped to class ids in the table's label order (table.py)."""
    from pipetransformer.data.table import label_ids, read_tables

    tables = read_tables(config)
    size = config.image_size or 224
    train_tf, eval_tf = _transforms(size, config.augment)
    splits = {}
    for name, table, transform, augment in (
        ("train", tables.train, train_tf, config.augment),
        ("eval", tables.eval, eval_tf, False),
    ):
        splits[name] = ItemSampleDataset(
            load=table.image,
            transform=transform,
            targets=torch.tensor(label_ids(table, tables.label_names), dtype=torch.long),
            random_inputs=augment,
        )
    return DataBundle(
        train=splits["train"],
        eval=splits["eval"],
        task="classification",
        num_classes=len(tables.label_names),
        in_chans=3,
        image_size=size,
        label_names=list(tables.label_names),
        read_from=tables.read_from,
    )


class SyntheticImages(SampleDataset):
    """Standard-normal images (what normalised pixels look like) with uniform labels, each
    a function of (seed, split, sample id) alone: the same in every epoch, process and
    attempt (so AutoCache and resume see the same samples), and nothing held in memory."""

    def __init__(self, split: str, image_size: int, seed: int) -> None:
        self.split, self.image_size, self.seed = split, image_size, seed

    def __len__(self) -> int:
        return SYNTHETIC_SPLIT_SAMPLES[self.split]

    def _generator(self, index: int) -> torch.Generator:
        if not 0 <= index < len(self):
            raise IndexError(f"sample id {index} outside the {self.split} split of {len(self)}")
        key = f"{self.seed}/{self.split}/{index}".encode()
        digest = hashlib.blake2b(key, digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little"))

    @staticmethod
    def _label(generator: torch.Generator) -> int:  # the first draw: no image needed for it
        return int(torch.randint(SYNTHETIC_CLASSES, (1,), generator=generator))

    def fetch(self, ids, length=None):
        images, labels = [], []
        for index in ids:
            generator = self._generator(index)
            labels.append(self._label(generator))
            size = self.image_size
            images.append(torch.randn(3, size, size, generator=generator))
        return (torch.stack(images),), torch.tensor(labels, dtype=torch.long)

    def targets(self, ids):
        return torch.tensor([self._label(self._generator(i)) for i in ids], dtype=torch.long)


def load_synthetic_bundle(config: DataConfig, seed: int) -> DataBundle:
    """ImageNet-shaped random data (1000 classes, ImageNet-1k's split sizes, 224 px unless
    data.image_size says otherwise), deterministic from the run's seed."""
    size = config.image_size or 224
    return DataBundle(
        train=SyntheticImages("train", size, seed),
        eval=SyntheticImages("eval", size, seed),
        task="classification",
        num_classes=SYNTHETIC_CLASSES,
        in_chans=3,
        image_size=size,
    )
