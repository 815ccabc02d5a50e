"""Which samples each replica trains on at each step. Pure: no processes, no tensors.

Paper App. D: each node keeps a fixed subset of the training set for the whole run (so a
node-local activation cache stays useful), reshuffled every epoch. A step takes the node's
next `node_batch_size` samples of its epoch order and splits them into contiguous
per-replica chunks. Where a step starts is counted in samples (its offset in the node's
epoch order), so a change of layout in the middle of an epoch re-splits the samples that
remain and every sample is still trained exactly once per epoch.

Two batch semantics (`trainer.batch_per_replica`):
- a fixed global batch (the default): every step trains `global_batch_size` samples, split
  over however many replicas there are; a node's batch does not depend on the layout.
- a fixed replica batch (the paper's: its per-pipeline batch of 400 images or 64 sequences,
  the released code's per-process loader batch): every replica trains
  `batch_per_replica` samples a step, so a node's batch is that times its replicas and the
  global batch grows as AutoDP adds replicas; an epoch then has fewer steps.

Which batch applies from which step is a `Segment`: the trainer tells the sampler where
the run is each time the layout changes (`continue_at`); steps of a later epoch start from
offset 0 with the newest segment's batch.

Batches keep a fixed number of samples (the pipeline's buffers are sized for it): the last
step of an epoch is topped up with repeats marked invalid, which the loss weights to zero.
The repeats are the epoch's first samples, or with lengths (length grouping) its shortest
sample repeated: a batch is padded to its longest sample, and the first samples of a
grouped epoch are its longest, which would pad the last step's real samples, or a replica
of fillers only, to the epoch's longest length.

Length grouping (`data.group_by_length`, text): a node's epoch order, once shuffled, is cut
into megabatches of 50 batches (fewer when the epoch is short), each sorted by length,
longest first, and the longest sample of the epoch moved to the front (transformers'
`LengthGroupedSampler`, which users know: the first step is the longest, so a batch that
does not fit fails at once). The batch it counts in is the config's (`group_batch_size`:
a node's share of the global batch, or the batch per replica), never the layout's, so the
order of an epoch is the same whatever the layout, across a change in the middle of an
epoch or a resume at another world size, and every sample is still trained once an epoch.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

# Batches per megabatch of length grouping (transformers' default).
MEGABATCH_BATCHES = 50


def length_grouped(order: list[int], lengths: Sequence[int], batch_size: int) -> list[int]:
    """`order` (already shuffled) regrouped: megabatches of up to MEGABATCH_BATCHES
    batches of `batch_size`, each sorted longest first (stable: ties keep their shuffled
    order), the longest sample of all moved to the front (module docstring)."""
    batches = min(len(order) // (4 * batch_size), MEGABATCH_BATCHES) or 1
    size = batches * batch_size
    megabatches = [
        sorted(order[i : i + size], key=lambda sample: -lengths[sample])
        for i in range(0, len(order), size)
    ]
    if not megabatches:
        return []
    longest = max(range(len(megabatches)), key=lambda k: lengths[megabatches[k][0]])
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [sample for megabatch in megabatches for sample in megabatch]


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


@dataclass(frozen=True)
class Segment:
    """From step `step` of `epoch` on, whose first sample is number `offset` of each node's
    epoch order, a node's batch is that of `replicas_per_node` replicas."""

    epoch: int
    step: int
    offset: int
    replicas_per_node: int


@dataclass
class TrainSampler:
    num_samples: int
    num_nodes: int
    global_batch_size: int | None  # the fixed global batch; None with batch_per_replica
    seed: int
    batch_per_replica: int | None = None  # set: the paper's semantics (module docstring)
    replicas_per_node: int = 1  # of the layout the run starts in
    # data.group_by_length: each sample's length, and the batch the megabatches count in
    # (module docstring); None: no grouping.
    lengths: Sequence[int] | None = None
    group_batch_size: int | None = None
    _orders: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)
    segment: Segment = field(init=False)

    def __post_init__(self) -> None:
        if (self.global_batch_size is None) == (self.batch_per_replica is None):
            raise ValueError("give a global batch or a batch per replica, not both")
        if self.batch_per_replica is None and self.global_batch_size % self.num_nodes:
            raise ValueError("the global batch must split evenly over the nodes")
        if (self.lengths is None) != (self.group_batch_size is None):
            raise ValueError("length grouping needs both the lengths and the batch it counts in")
        if self.lengths is not None and len(self.lengths) != self.num_samples:
            raise ValueError(f"{len(self.lengths)} lengths for {self.num_samples} samples")
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
        self.segment = Segment(0, 0, 0, self.replicas_per_node)

    # ------------------------------------------------------------------ sizes

    @property
    def epoch_samples(self) -> int:
        """Samples a node trains an epoch (the largest subset; smaller ones are padded)."""
        return max(len(s) for s in self.node_subsets)

    def node_batch_size(self, replicas_per_node: int) -> int:
        if self.batch_per_replica is not None:
            return self.batch_per_replica * replicas_per_node
        return self.global_batch_size // self.num_nodes

    def steps_per_epoch_at(self, replicas_per_node: int) -> int:
        """Steps of a whole epoch in a layout of `replicas_per_node` replicas a node."""
        return math.ceil(self.epoch_samples / self.node_batch_size(replicas_per_node))

    @property
    def node_batch_size_now(self) -> int:
        return self.node_batch_size(self.segment.replicas_per_node)

    # ------------------------------------------------------------------ position

    def continue_at(self, epoch: int, step: int, offset: int, replicas_per_node: int) -> None:
        """The layout from step `step` of `epoch` (the node's `offset`-th sample) on."""
        if not 0 <= offset <= self.epoch_samples:
            raise ValueError(f"offset {offset} outside an epoch of {self.epoch_samples} samples")
        self.segment = Segment(epoch, step, offset, replicas_per_node)

    def enter_epoch(self, epoch: int) -> None:
        """A new epoch starts at offset 0 with the newest segment's batch."""
        if epoch != self.segment.epoch:
            self.continue_at(epoch, 0, 0, self.segment.replicas_per_node)

    def offset(self, epoch: int, step: int) -> int:
        """The node's first sample of step `step` of `epoch` (in its epoch order)."""
        segment, size = self.segment, self.node_batch_size_now
        if epoch != segment.epoch:  # a later epoch: from its start, in today's layout
            return step * size
        if step < segment.step:
            raise ValueError(f"step {step} of epoch {epoch} precedes the layout's first")
        return segment.offset + (step - segment.step) * size

    def steps_in_epoch(self, epoch: int) -> int:
        segment = self.segment
        if epoch != segment.epoch:
            return self.steps_per_epoch_at(segment.replicas_per_node)
        left = max(0, self.epoch_samples - segment.offset)
        return segment.step + math.ceil(left / self.node_batch_size_now)

    @property
    def steps_per_epoch(self) -> int:
        """Steps of the epoch the current segment belongs to."""
        return self.steps_in_epoch(self.segment.epoch)

    # ------------------------------------------------------------------ batches

    def epoch_order(self, node: int, epoch: int) -> list[int]:
        key = (node, epoch)
        if key not in self._orders:
            order = list(self.node_subsets[node])
            random.Random(f"{self.seed}/{node}/{epoch}").shuffle(order)
            if self.lengths is not None:
                order = length_grouped(order, self.lengths, self.group_batch_size)
            self._orders = {k: v for k, v in self._orders.items() if k[1] >= epoch}
            self._orders[key] = order
        return self._orders[key]

    def node_batch(self, node: int, epoch: int, step: int) -> Batch:
        order = self.epoch_order(node, epoch)
        size, start = self.node_batch_size_now, self.offset(epoch, step)
        ids = order[start : start + size]
        valid = [True] * len(ids)
        fill = size - len(ids)
        ids += self._fillers(node, epoch, fill)  # shape padding: real samples, weight 0
        valid += [False] * fill
        return Batch(tuple(ids), tuple(valid))

    def _fillers(self, node: int, epoch: int, fill: int) -> list[int]:
        """`fill` repeats of the node's epoch (module docstring): its first samples, or with
        lengths its shortest sample, `fill` times (the first of the shortest in epoch order)."""
        if fill == 0:
            return []
        order = self.epoch_order(node, epoch)
        if self.lengths is not None:
            lengths = self.lengths
            return [min(order, key=lambda i: lengths[i])] * fill
        return [order[i % len(order)] for i in range(fill)]

    def replica_batch(
        self, node: int, local_replica: int, replicas_per_node: int, epoch: int, step: int
    ) -> Batch:
        if self.node_batch_size(replicas_per_node) != self.node_batch_size_now:
            raise ValueError(
                f"a layout of {replicas_per_node} replicas a node is not the sampler's "
                f"({self.segment.replicas_per_node}): call continue_at first"
            )
        return _split(self.node_batch(node, epoch, step), replicas_per_node, local_replica)

    def global_num_valid(self, epoch: int, step: int) -> int:
        return sum(self.node_batch(n, epoch, step).num_valid for n in range(self.num_nodes))


@dataclass(frozen=True)
class EvalSampler:
    """The whole eval set in order (with `lengths`, longest first: each batch then holds
    samples of similar length), each step's batch split over all replicas."""

    num_samples: int
    global_batch_size: int
    lengths: Sequence[int] | None = None

    @property
    def steps(self) -> int:
        return math.ceil(self.num_samples / self.global_batch_size)

    @functools.cached_property
    def order(self) -> Sequence[int]:
        if self.lengths is None:
            return range(self.num_samples)
        return sorted(range(self.num_samples), key=lambda sample: -self.lengths[sample])

    def replica_batch(self, replica: int, dp_degree: int, step: int) -> Batch:
        start = step * self.global_batch_size
        ids = list(self.order[start : min(start + self.global_batch_size, self.num_samples)])
        valid = [True] * len(ids) + [False] * (self.global_batch_size - len(ids))
        ids += [ids[0] if ids else 0] * (self.global_batch_size - len(ids))
        return _split(Batch(tuple(ids), tuple(valid)), dp_degree, replica)
