"""How long a batch of text is once padded: pure arithmetic shared by the data, the
trainer's batches, the pipeline runtime, AutoCache and the memory model.

A text sample has a *real length* (its tokens before padding: [CLS] ... [SEP]). A batch is
padded to its longest real length rounded up to a multiple of `data.pad_to_multiple_of`
(what tensor cores want), never beyond `data.max_seq_length` (`data.padding: batch`, what
transformers' DataCollatorWithPadding does), or always to `max_seq_length`
(`data.padding: max_length`). A pipeline of several stages declares its shapes before the
first step (torch.distributed.pipelining's receive buffers are sized then), so there a
batch's length is further rounded up to one of a few *buckets*: the multiple times a power
of two, and `max_seq_length` itself (multiple 8, at most 128: 8, 16, 32, 64, 128); one
stage and schedule is kept per bucket.

Owns: those roundings. Must not: know tensors, datasets or layouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


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
    the max-length bucket's (under 2: the buckets double)."""
    return sum(bucket_lengths(multiple, max_length)) / max_length


def batch_length(
    lengths: Sequence[int], ids: Iterable[int], padding: str, multiple: int, max_length: int
) -> int:
    """The padded length of the batch `ids` of samples whose real lengths are `lengths`."""
    if padding == "max_length":
        return max_length
    return padded_length(max(lengths[i] for i in ids), multiple, max_length)
