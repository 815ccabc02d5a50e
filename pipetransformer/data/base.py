"""What every dataset looks like to the rest of the system.

A dataset is indexed by sample id (0..len-1, its position in the split after any subset
selection). `fetch(ids)` returns the batched model inputs and targets for those ids;
`dataset[i]` returns `(sample_id, inputs, target)` for one sample.

Owns: the `SampleDataset` interface, the in-memory and per-sample implementations and the
`DataBundle` that describes a task's two splits.
Must not: know about ranks, replicas or samplers (AutoDP decides which ids go where).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class SampleDataset:
    """Random access by sample id, batched."""

    # True when inputs differ between two reads of the same id (random augmentation).
    random_inputs: bool = False

    def __len__(self) -> int:
        raise NotImplementedError

    def fetch(self, ids: Sequence[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        raise NotImplementedError

    def targets(self, ids: Sequence[int]) -> torch.Tensor:
        """Targets only (cheap: the last pipeline stage never needs the inputs)."""
        return self.fetch(ids)[1]

    def __getitem__(self, index: int) -> tuple[int, tuple[torch.Tensor, ...], torch.Tensor]:
        inputs, target = self.fetch([index])
        return index, tuple(t[0] for t in inputs), target[0]


class TensorSampleDataset(SampleDataset):
    """Inputs and targets held as tensors whose first dimension is the sample id."""

    def __init__(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor) -> None:
        if any(t.shape[0] != targets.shape[0] for t in inputs):
            raise ValueError("every input tensor needs one row per target")
        self.inputs = tuple(inputs)
        self.target_tensor = targets

    def __len__(self) -> int:
        return self.target_tensor.shape[0]

    def fetch(self, ids):
        index = torch.as_tensor(list(ids), dtype=torch.long)
        return tuple(t[index] for t in self.inputs), self.target_tensor[index]

    def targets(self, ids):
        return self.target_tensor[torch.as_tensor(list(ids), dtype=torch.long)]


class ItemSampleDataset(SampleDataset):
    """Samples loaded one at a time (images on disk), with an optional random transform."""

    def __init__(
        self,
        load: Callable[[int], Any],
        transform: Callable[[Any], torch.Tensor],
        targets: torch.Tensor,
        random_inputs: bool,
    ) -> None:
        self._load = load
        self._transform = transform
        self.target_tensor = targets
        self.random_inputs = random_inputs

    def __len__(self) -> int:
        return self.target_tensor.shape[0]

    def fetch(self, ids):
        images = torch.stack([self._transform(self._load(i)) for i in ids])
        return (images,), self.targets(ids)

    def targets(self, ids):
        return self.target_tensor[torch.as_tensor(list(ids), dtype=torch.long)]


def subset_indices(total: int, size: int, seed: int) -> list[int]:
    """The first `size` positions of a seeded permutation of range(total)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=generator)[: min(size, total)].tolist()


class Subset(SampleDataset):
    """The first `size` samples of a seeded permutation; ids are renumbered 0..size-1."""

    def __init__(self, base: SampleDataset, size: int, seed: int) -> None:
        self.base = base
        self.index = subset_indices(len(base), size, seed)
        self.random_inputs = base.random_inputs

    def __len__(self) -> int:
        return len(self.index)

    def fetch(self, ids):
        return self.base.fetch([self.index[i] for i in ids])

    def targets(self, ids):
        return self.base.targets([self.index[i] for i in ids])


@dataclass
class DataBundle:
    """A task's train and eval splits plus the facts a model adapter needs."""

    train: SampleDataset
    eval: SampleDataset
    task: str  # "classification" | "regression" (num_classes 1) | "question_answering"
    num_classes: int
    in_chans: int = 3
    image_size: int = 224
    vocab_size: int | None = None
    max_seq_length: int = 128
    # Classification: the name of each class id (None: the classes have no names).
    label_names: list[str] | None = None
    # Anything the task's evaluation needs beyond targets (e.g. SQuAD gold answers).
    eval_extras: dict[str, Any] = field(default_factory=dict)
    # A table's columns and where evaluation comes from, for the run's first log line
    # (data/describe.py); None where the dataset has no columns to name.
    read_from: str | None = None

    def model_args(self) -> dict[str, Any]:
        """What build_model needs to know about the data (task, classes, input shapes)."""
        return dict(
            task=self.task,
            num_classes=self.num_classes,
            in_chans=self.in_chans,
            image_size=self.image_size,
            vocab_size=self.vocab_size,
            max_seq_length=self.max_seq_length,
        )


def iterate_batches(
    dataset: SampleDataset, id_batches: Sequence[Sequence[int]], num_workers: int = 0
) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Fetch batches in order; with workers, in background processes, a few batches ahead."""
    if num_workers == 0 or isinstance(dataset, TensorSampleDataset):
        for ids in id_batches:
            yield dataset.fetch(ids)
        return
    loader = torch.utils.data.DataLoader(
        _FetchByBatch(dataset),
        batch_size=None,
        sampler=[list(ids) for ids in id_batches],
        num_workers=num_workers,
        persistent_workers=False,
    )
    yield from loader


class _FetchByBatch(torch.utils.data.Dataset):
    def __init__(self, dataset: SampleDataset) -> None:
        self.dataset = dataset

    def __getitem__(self, ids):
        return self.dataset.fetch(ids)

    def __len__(self) -> int:
        return len(self.dataset)
