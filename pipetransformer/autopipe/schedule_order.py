"""The order in which one rank of a multi-chunk schedule runs its work: a schedule as data, so
that the memory model can count what a rank holds at every moment without running it.

For interleaved_1f1b (torch's ScheduleInterleaved1F1B; Narayanan et al. 2021, "Efficient
large-scale language model training on GPU clusters using Megatron-LM", arXiv:2104.04473,
section 2.2) and zero_bubble (ScheduleInterleavedZeroBubble; Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", arXiv:2401.10241, its ZB1P order) over K ranks with v chunks each and
M micro-batches, in torch's rounds of R = M // max(1, M // K) micro-batches
(config/schedules.py):

    warm-up   rank r first runs W_r = min((v - 1) R + f (K - 1 - r), M v) forwards, f = 2
              for interleaved 1F1B (Megatron's warm-up, with R for K) and 1 for zero bubble
    steady    then a forward and a backward in turn until the M v forwards are done
    cool-down the remaining backwards
    chunks    forward number n runs chunk (n // R) mod v; backward number n runs chunk
              v - 1 - (n // R) mod v (the last chunk first)
    zero      zero_bubble's backward computes only the input gradient (I); the weight
    bubble    gradient (W) of the n-th backward follows once r more backwards have run (at
              once on the last rank), the rest after the cool-down

Ops carry the rank's local chunk index (0 .. v - 1; the global chunk is local * K + r) and
the micro-batch. tests/test_schedules.py checks this order against the one torch builds,
rank by rank, for many K, v and M.

Owns: `Op`, `rank_order`. Must not: import torch or know what a chunk holds.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from pipetransformer.config import SCHEDULE_PROPERTIES


class Op(NamedTuple):
    kind: str  # 'F' forward, 'B' full backward, 'I' input-gradient backward, 'W' weight gradient
    chunk: int  # the rank's local chunk, 0 .. v - 1
    micro_batch: int


def rank_order(
    schedule: str, pipe_len: int, virtual_stages: int, num_micro_batches: int, stage: int
) -> list[Op]:
    """The ops stage `stage` runs in one step, in order (see the module docstring)."""
    if not SCHEDULE_PROPERTIES[schedule].multi_chunk:
        raise ValueError(f"no multi-chunk order for schedule '{schedule}'")
    k, v, m, r = pipe_len, virtual_stages, num_micro_batches, stage
    zero_bubble = SCHEDULE_PROPERTIES[schedule].split_backward
    per_round = m // max(1, m // k)
    hops = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + hops * (k - 1 - r), m * v)
    total = m * v
    counters: dict[tuple[str, int], int] = defaultdict(int)
    ops: list[Op] = []

    def emit(kind: str, chunk: int) -> None:
        ops.append(Op(kind, chunk, counters[kind, chunk]))
        counters[kind, chunk] += 1

    def backward_chunk(n: int) -> int:
        return v - 1 - ((n - warmup) // per_round) % v

    backwards: list[int] = []  # the steps whose backward ran, for the delayed weight grads
    weights_done = 0
    for n in range(total + warmup):
        if n < total:
            emit("F", (n // per_round) % v)
        if n < warmup:
            continue
        emit("I" if zero_bubble else "B", backward_chunk(n))
        backwards.append(n)
        if zero_bubble and n - warmup >= r:
            emit("W", backward_chunk(backwards[weights_done]))
            weights_done += 1
    while zero_bubble and weights_done < len(backwards):
        emit("W", backward_chunk(backwards[weights_done]))
        weights_done += 1
    return ops
