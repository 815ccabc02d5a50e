"""How long a batch of text is once padded, and how a packed batch is laid out: pure
arithmetic shared by the data, the trainer's batches, the pipeline runtime, AutoCache and
the memory model.

A text sample has a *real length* (its tokens before padding: [CLS] ... [SEP]). A batch is
padded to its longest real length rounded up to a multiple of `data.pad_to_multiple_of`
(what tensor cores want), never beyond `data.max_seq_length` (`data.padding: batch`, what
transformers' DataCollatorWithPadding does), or always to `max_seq_length`
(`data.padding: max_length`). A pipeline of several stages declares its shapes before the
first step (torch.distributed.pipelining's receive buffers are sized then), so there a
batch's length is further rounded up to one of a few *buckets*: the multiple times a power
of two, and `max_seq_length` itself (multiple 8, at most 128: 8, 16, 32, 64, 128); one
stage and schedule is kept per bucket.

`data.padding: packed` keeps the same samples a step and lays each micro-batch's samples
end to end in rows (`PackedShape`): rows as long as the batch's padded length (its bucket
in a pipeline), first-fit decreasing (`first_fit_decreasing`), as many rows as the fullest
micro-batch of the step needs (in a pipeline rounded up to a power of two, at most the
micro-batch's samples). One shape a step; a row holds at least one sample, so a packed
batch never computes more tokens than the same batch padded.

`data.padding: auto` packs a batch where that computes at most 1 - `PACKING_MIN_SAVING` of
its padded tokens (`packing_pays`), and pads it otherwise: packing costs a block-diagonal
mask per attention unit, the placement on the loader and a gather in the head, which a
small saving does not repay. The threshold is to be measured (docs/architecture.md,
"Packed text").

Owns: those roundings and placements. Must not: know tensors, datasets or layouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_length(longest: int, multiple: int, max_length: int) -> int:
    """The length a batch whose longest sample has `longest` real tokens is padded to."""
    if longest > max_length:
        raise ValueError(f"a sample of {longest} tokens is longer than max_seq_length {max_length}")
    return min(max_length, round_up(max(1, longest), multiple))


def bucket_lengths(multiple: int, max_length: int) -> list[int]:
    """Every bucket a pipeline may be built for, shortest first: multiple * 2^k below
    `max_length`, then `max_length`."""
    buckets, length = [], multiple
    while length < max_length:
        buckets.append(length)
        length *= 2
    return [*buckets, max_length]


def bucket_length(length: int, multiple: int, max_length: int) -> int:
    """The shortest bucket that holds `length` tokens."""
    return next(b for b in bucket_lengths(multiple, max_length) if b >= length)


def bucket_buffer_share(multiple: int, max_length: int) -> float:
    """What the pipeline's receive buffers of every bucket hold together, in multiples of
    the max-length bucket's. Under 3: the buckets below max_length double, so they sum to
    under twice the largest of them, itself under max_length (under 2 where max_length is
    the multiple times a power of two: 248/128 at 8/128; 888/384 = 2.31 at 8/384)."""
    return sum(bucket_lengths(multiple, max_length)) / max_length


def row_buckets(samples: int) -> list[int]:
    """The row counts a pipeline's packed micro-batch of `samples` samples may take: the
    powers of two below `samples`, then `samples` (a row holds at least one sample)."""
    return bucket_lengths(1, samples)


def packed_buffer_share(multiple: int, max_length: int, samples: int) -> float:
    """What a pipeline's receive buffers of every packed shape it may build hold together,
    in multiples of a micro-batch of `samples` samples padded to max_length: every row
    bucket times every length bucket (under 9; 1.875 x 1.94 = 3.6 at 8 samples, 8/128). A
    bound: a run builds the shapes its batches bring, which are fewer (longer rows go with
    fewer of them)."""
    rows = sum(row_buckets(samples)) / samples
    return rows * bucket_buffer_share(multiple, max_length)


@dataclass(frozen=True)
class PackedShape:
    """A packed text batch, per micro-batch: its `samples` samples laid end to end in `rows`
    rows of `row_length` tokens (a micro-batch's tensors are `rows` rows, its outputs one a
    sample). The shape a pipeline builds a stage for."""

    rows: int
    row_length: int
    samples: int

    def tokens(self, num_samples: int) -> int:
        """Tokens a batch of `num_samples` samples in this shape computes (rows times their
        length, every micro-batch)."""
        return num_samples // self.samples * self.rows * self.row_length


# The share of a batch's padded tokens packing must save for `data.padding: auto` to pack
# it. Measured (docs/benchmarks.md section 18, MiniLM on SST-2 at 128 tokens, 2 processes):
# a step costs about 0.16 s fixed (the optimizer and the gradient all-reduce) plus 0.30 ms a
# computed token, and a packed step about 0.01 s more than its tokens predict (the masks,
# the gathers); packing a batch padded per batch (about 1,250 tokens a step there) pays from
# about 3% of its tokens, a length-grouped one (about 570) from about 6%: 10% keeps a margin.
PACKING_MIN_SAVING = 0.1


def packing_pays(shape: PackedShape, length: int, num_samples: int) -> bool:
    """Whether a batch of `num_samples` samples packed in `shape` saves at least
    PACKING_MIN_SAVING of its tokens padded to `length` (data.padding auto)."""
    padded = num_samples * length
    return shape.tokens(num_samples) <= (1 - PACKING_MIN_SAVING) * padded


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The samples of `lengths` (by index) in rows of `capacity` tokens: longest first, each
    into the first row it fits, a new row when none does (ties in index order, so every
    rank computes the same rows). Each row lists its samples in the order they were placed."""
    if any(length > capacity for length in lengths):
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a row of {capacity}")
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, room in enumerate(free) if room >= lengths[index]), None)
        if row is None:
            rows.append([])
            free.append(capacity)
            row = len(rows) - 1
        rows[row].append(index)
        free[row] -= lengths[index]
    return rows


def packed_shape(
    lengths: Sequence[int], samples: int, row_length: int, bucketed: bool, min_rows: int = 1
) -> PackedShape:
    """The shape of a batch of samples of real lengths `lengths` (in batch order) packed in
    micro-batches of `samples` consecutive samples into rows of `row_length` tokens: the
    most rows any micro-batch needs, at least `min_rows` (at most `samples`: compiled units
    take no packed micro-batch of one row, whose size-1 dimension would be a graph of its
    own: models/compiled.py), rounded up to a row bucket when `bucketed` (a pipeline of
    several stages)."""
    if not lengths or len(lengths) % samples:
        raise ValueError(f"{len(lengths)} samples do not split into micro-batches of {samples}")
    rows = max(
        min(min_rows, samples),
        *(
            len(first_fit_decreasing(lengths[start : start + samples], row_length))
            for start in range(0, len(lengths), samples)
        ),
    )
    if bucketed:
        rows = next(b for b in row_buckets(samples) if b >= rows)
    return PackedShape(rows, row_length, samples)


def packed_placements(lengths: Sequence[int], shape: PackedShape) -> list[tuple[int, int]]:
    """Where each sample of one micro-batch (real lengths `lengths`, in batch order) lies in
    its packed rows: (row, first token) per sample, in batch order."""
    rows = first_fit_decreasing(lengths, shape.row_length)
    if len(rows) > shape.rows:
        raise ValueError(f"the micro-batch needs {len(rows)} rows, the shape has {shape.rows}")
    placements = [(0, 0)] * len(lengths)
    for row, members in enumerate(rows):
        offset = 0
        for index in members:
            placements[index] = (row, offset)
            offset += lengths[index]
    return placements


def batch_length(
    lengths: Sequence[int], ids: Iterable[int], padding: str, multiple: int, max_length: int
) -> int:
    """The padded length of the batch `ids` of samples whose real lengths are `lengths`."""
    if padding == "max_length":
        return max_length
    return padded_length(max(lengths[i] for i in ids), multiple, max_length)


def batch_tokens(shape: int | PackedShape | None, num_samples: int) -> int:
    """Tokens a batch of `num_samples` samples computes padded to `shape` tokens or packed
    in it (0 without a sequence)."""
    if isinstance(shape, PackedShape):
        return shape.tokens(num_samples)
    return num_samples * (shape or 0)
