"""What every dataset looks like to the rest of the system.

A dataset is indexed by sample id (0..len-1, its position in the split after any subset
selection). `fetch(ids)` returns the batched model inputs and targets for those ids;
`dataset[i]` returns `(sample_id, inputs, target)` for one sample.

Text is held at `max_seq_length` tokens a sample, with each sample's real length
(`lengths`): `fetch` cuts a batch to `batch_length(ids)` (data.padding: its longest sample
rounded up to data.pad_to_multiple_of, or max_seq_length), or to the `length` it is given
(a pipeline's bucket, utils/padding.py), or packs it in the `PackedShape` it is given
(data.padding packed: utils/packing.py; input_ids, token_type_ids, segment ids, sample
starts). Every rank holds the dataset, so every rank computes a batch's length, or its
packing, from its sample ids alone.

Owns: the `SampleDataset` interface, the in-memory, text and per-sample implementations
and the `DataBundle` that describes a task's two splits.
Must not: know about ranks, replicas or samplers (AutoDP decides which ids go where).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipetransformer.utils.packing import Packing
from pipetransformer.utils.padding import PackedShape, batch_length


class SampleDataset:
    """Random access by sample id, batched."""

    # True when inputs differ between two reads of the same id (random augmentation).
    random_inputs: bool = False
    # Text: each sample's real length in tokens; None: inputs without a sequence (images).
    lengths: Sequence[int] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def batch_length(self, ids: Sequence[int]) -> int | None:
        """The sequence length `fetch(ids)` pads the batch to; None without a sequence."""
        return None

    def fetch(
        self, ids: Sequence[int], length: int | PackedShape | None = None
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Inputs and targets of `ids`; text padded to `length` tokens (default
        `batch_length(ids)`), which must hold every sample of the batch, or packed in the
        `PackedShape` `length`."""
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

    def fetch(self, ids, length=None):
        index = torch.as_tensor(list(ids), dtype=torch.long)
        return tuple(t[index] for t in self.inputs), self.target_tensor[index]

    def targets(self, ids):
        return self.target_tensor[torch.as_tensor(list(ids), dtype=torch.long)]


def real_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Each row's real length: one past its last attended position (text is padded on the
    right)."""
    positions = torch.arange(1, attention_mask.shape[1] + 1)
    return (attention_mask.ne(0) * positions).amax(dim=1).tolist()


class TextSampleDataset(TensorSampleDataset):
    """Token sequences (input_ids, token_type_ids, attention_mask), held at max_seq_length
    and fetched cut to the batch's padded length (module docstring)."""

    def __init__(
        self,
        inputs: Sequence[torch.Tensor],
        targets: torch.Tensor,
        padding: str = "batch",
        pad_to_multiple_of: int = 8,
    ) -> None:
        super().__init__(inputs, targets)
        self.max_length = inputs[-1].shape[1]
        self.lengths = real_lengths(inputs[-1])
        self.padding = padding
        self.pad_to_multiple_of = pad_to_multiple_of

    def batch_length(self, ids):
        return batch_length(
            self.lengths, ids, self.padding, self.pad_to_multiple_of, self.max_length
        )

    def fetch(self, ids, length=None):
        if isinstance(length, PackedShape):
            inputs, targets = self.fetch(ids, length.row_length)
            return Packing([self.lengths[i] for i in ids], length).inputs(inputs), targets
        length = self.batch_length(ids) if length is None else length
        longest = max((self.lengths[i] for i in ids), default=0)
        if not longest <= length <= self.max_length:
            raise ValueError(
                f"a batch padded to {length} tokens must hold its longest sample ({longest}) "
                f"and at most max_seq_length ({self.max_length})"
            )
        index = torch.as_tensor(list(ids), dtype=torch.long)
        return tuple(t[:, :length][index] for t in self.inputs), self.target_tensor[index]


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

    def fetch(self, ids, length=None):
        images = torch.stack([self._transform(self._load(i)) for i in ids])
        return (images,), self.targets(ids)

    def targets(self, ids):
        return self.target_tensor[torch.as_tensor(list(ids), dtype=torch.long)]


def subset_indices(total: int, size: int, seed: int) -> list[int]:
    """The first `size` positions of a seeded permutation of range(total)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=generator)[: min(size, total)].tolist()


def subset_note(kind: str, sizes: dict[str, tuple[int | None, int]]) -> str | None:
    """'data.train_subset: 8000 of 67349 training rows' for each split whose subset is set:
    `sizes` maps 'train'/'eval' to (the subset's size or None, the split's size before)."""
    parts = [
        f"data.{split}_subset: {min(size, total)} of {total} {label} {kind}"
        for split, label in (("train", "training"), ("eval", "evaluation"))
        if split in sizes
        for size, total in [sizes[split]]
        if size is not None
    ]
    return ", ".join(parts) or None


class Subset(SampleDataset):
    """The first `size` samples of a seeded permutation; ids are renumbered 0..size-1."""

    def __init__(self, base: SampleDataset, size: int, seed: int) -> None:
        self.base = base
        self.index = subset_indices(len(base), size, seed)
        self.random_inputs = base.random_inputs
        if base.lengths is not None:
            self.lengths = [base.lengths[i] for i in self.index]

    def __len__(self) -> int:
        return len(self.index)

    def batch_length(self, ids):
        return self.base.batch_length([self.index[i] for i in ids])

    def fetch(self, ids, length=None):
        return self.base.fetch([self.index[i] for i in ids], length)

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
    # What data.train_subset / data.eval_subset kept of how many, for the same line
    # (`subset_note`); None where neither is set.
    subsets: str | None = None

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
