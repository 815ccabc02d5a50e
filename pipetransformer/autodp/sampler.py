"""Which samples each replica trains on at each step. Pure: no processes, no tensors.

Paper App. D: each node keeps a fixed subset of the training set for the whole run (so a
node-local activation cache stays useful), reshuffled every epoch. At step t the node
takes the next `global_batch / num_nodes` samples of its epoch order and splits them into
contiguous per-replica chunks. The node's chunk does not depend on the number of
replicas, so a transition in the middle of an epoch re-splits the remaining steps and every
sample is still trained exactly once per epoch.

Batches keep a fixed shape (the pipeline's buffers are sized once): the last step of an
epoch is topped up with repeats marked invalid, which the loss weights to zero.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Batch:
    """One replica's samples for one step; `valid[i]` False marks shape padding."""

    ids: tuple[int, ...]
    valid: tuple[bool, ...]

    @property
    def num_valid(self) -> int:
        return sum(self.valid)


def _split(batch: Batch, parts: int, index: int) -> Batch:
    size = len(batch.ids) // parts
    window = slice(index * size, (index + 1) * size)
    return Batch(batch.ids[window], batch.valid[window])


@dataclass
class TrainSampler:
    num_samples: int
    num_nodes: int
    global_batch_size: int
    seed: int
    _orders: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch_size % self.num_nodes:
            raise ValueError("the global batch must split evenly over the nodes")
        if self.num_samples < self.num_nodes:
            raise ValueError(
                f"{self.num_samples} samples cannot be shared by {self.num_nodes} nodes"
            )
        everything = list(range(self.num_samples))
        random.Random(self.seed).shuffle(everything)
        base, extra = divmod(self.num_samples, self.num_nodes)
        self.node_subsets: list[list[int]] = []
        start = 0
        for node in range(self.num_nodes):
            size = base + (1 if node < extra else 0)
            self.node_subsets.append(sorted(everything[start : start + size]))
            start += size

    @property
    def node_batch_size(self) -> int:
        return self.global_batch_size // self.num_nodes

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(max(len(s) for s in self.node_subsets) / self.node_batch_size)

    def epoch_order(self, node: int, epoch: int) -> list[int]:
        key = (node, epoch)
        if key not in self._orders:
            order = list(self.node_subsets[node])
            random.Random(f"{self.seed}/{node}/{epoch}").shuffle(order)
            self._orders = {k: v for k, v in self._orders.items() if k[1] >= epoch}
            self._orders[key] = order
        return self._orders[key]

    def node_batch(self, node: int, epoch: int, step: int) -> Batch:
        order = self.epoch_order(node, epoch)
        size = self.node_batch_size
        ids = order[step * size : (step + 1) * size]
        valid = [True] * len(ids)
        fill = size - len(ids)
        # Shape padding repeats the epoch's first samples (a real sample, weight 0).
        ids += [order[i % len(order)] for i in range(fill)]
        valid += [False] * fill
        return Batch(tuple(ids), tuple(valid))

    def replica_batch(
        self, node: int, local_replica: int, replicas_per_node: int, epoch: int, step: int
    ) -> Batch:
        return _split(self.node_batch(node, epoch, step), replicas_per_node, local_replica)

    def global_num_valid(self, epoch: int, step: int) -> int:
        return sum(self.node_batch(n, epoch, step).num_valid for n in range(self.num_nodes))


@dataclass(frozen=True)
class EvalSampler:
    """The whole eval set in order, each step's batch split over all replicas."""

    num_samples: int
    global_batch_size: int

    @property
    def steps(self) -> int:
        return math.ceil(self.num_samples / self.global_batch_size)

    def replica_batch(self, replica: int, dp_degree: int, step: int) -> Batch:
        start = step * self.global_batch_size
        ids = list(range(start, min(start + self.global_batch_size, self.num_samples)))
        valid = [True] * len(ids) + [False] * (self.global_batch_size - len(ids))
        ids += [0] * (self.global_batch_size - len(ids))
        return _split(Batch(tuple(ids), tuple(valid)), dp_degree, replica)
