"""Loading a replica's batches ahead of the step that needs them.

`BatchLoader` keeps its worker processes for the whole run (`data.num_workers`): a new
epoch or a transition's new data split starts another pass over the same workers instead
of forking them again. Batches come out in pinned memory when they are bound for a GPU, so
the copy to the device is asynchronous (from pageable memory the host waits for the
stream). A pass may be told which batches it need not decode (`skip`): the first stage asks
it for batches whose every sample AutoCache already serves, and gets None for them; and the
sequence length of each text batch (`lengths`: a pipeline's bucket, or the `PackedShape`
a packed batch is laid out in; default each batch's own, data/base.py).

How many workers a process may start is bounded by the cores it has (`workers_per_process`):
every process of a node starts its own loaders, so the paper's ViT configs (8 workers, 8
processes a node) started 64 training and 64 evaluation workers on a 16-core host.

Owns: the workers and the order of a pass. Must not: know about devices beyond pinning,
replicas or the cache (the caller's `skip` decides).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import torch

from pipetransformer.data.base import SampleDataset, TensorSampleDataset

Inputs = tuple[torch.Tensor, ...]
Skip = Callable[[Sequence[int]], bool]


def available_cores() -> int:
    """The cores this process may run on (its affinity: a container's or a job's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def workers_per_process(configured: int, processes_per_node: int, cores: int | None = None) -> int:
    """`data.num_workers` bounded by this process's share of the node's cores, less the one
    its own main thread runs on (at least one worker where any was asked for: decoding then
    still overlaps the step). A loader's workers run while the other loader's (training,
    evaluation) wait, so each loader gets the bound."""
    if configured <= 0:
        return 0
    share = (available_cores() if cores is None else cores) // max(1, processes_per_node)
    return min(configured, max(1, share - 1))


def pin(inputs: Inputs) -> Inputs:
    return tuple(t.pin_memory() for t in inputs)


class _Requests:
    """The pass in progress, iterated by the DataLoader in this process: (ids, skip?, length)
    per batch, `skip` asked when the request is made (a few batches ahead)."""

    def __init__(self) -> None:
        self.id_batches: list[list[int]] = []
        self.skip: Skip | None = None
        self.lengths: list[int | None] = []

    def __iter__(self):
        for ids, length in zip(self.id_batches, self.lengths):
            yield ids, bool(self.skip is not None and self.skip(ids)), length

    def __len__(self) -> int:
        return len(self.id_batches)


class _Fetch(torch.utils.data.Dataset):
    def __init__(self, dataset: SampleDataset) -> None:
        self.dataset = dataset

    def __getitem__(self, request) -> Inputs | None:
        ids, skip, length = request
        return None if skip else self.dataset.fetch(ids, length)[0]

    def __len__(self) -> int:
        return len(self.dataset)


class BatchLoader:
    def __init__(self, dataset: SampleDataset, num_workers: int, pin_memory: bool) -> None:
        self.dataset = dataset
        self.pin_memory = pin_memory
        self._requests = _Requests()
        self._loader = None
        if num_workers > 0 and not isinstance(dataset, TensorSampleDataset):
            self._loader = torch.utils.data.DataLoader(
                _Fetch(dataset),
                batch_size=None,
                sampler=self._requests,
                num_workers=num_workers,
                persistent_workers=True,
                pin_memory=pin_memory,
            )

    def start(
        self,
        id_batches: Sequence[Sequence[int]],
        skip: Skip | None = None,
        lengths: Sequence[int | None] | None = None,
    ) -> Iterator[Inputs | None]:
        """A pass over `id_batches` in order (abandoning any pass in progress): each
        batch's inputs (text padded to `lengths[k]` tokens), or None where `skip(ids)` was
        true."""
        self._requests.id_batches = [list(ids) for ids in id_batches]
        self._requests.lengths = list(lengths) if lengths is not None else [None] * len(id_batches)
        self._requests.skip = skip
        if self._loader is not None:
            return iter(self._loader)
        return self._in_process()

    def _in_process(self) -> Iterator[Inputs | None]:
        for ids, skip, length in iter(self._requests):
            if skip:
                yield None
                continue
            inputs = self.dataset.fetch(ids, length)[0]
            yield pin(inputs) if self.pin_memory else inputs

    def close(self) -> None:
        """Stop the workers (they would otherwise outlive a process that exits at once)."""
        if self._loader is not None and self._loader._iterator is not None:
            self._loader._iterator._shutdown_workers()
            self._loader._iterator = None
