"""What each pipeline schedule asks of a layout, as torch.distributed.pipelining (2.14) asks
it, and how many chunks (virtual stages) each rank of a layout holds.

    schedule          torch class                      chunks a rank   micro-batches M
    gpipe             ScheduleGPipe                    1               any
    1f1b              Schedule1F1B                     1               M >= K
    interleaved_1f1b  ScheduleInterleaved1F1B          v >= 1          M >= K, M a multiple of
                      (Schedule1F1B where v = 1)                       max(1, M // K)
    zero_bubble       ScheduleInterleavedZeroBubble    v >= 1          the same

K = 1 is plain DDP: no schedule at all, whatever is configured, one chunk. The looped
placement of the multi-chunk schedules puts chunk c (torch's stage_index) on the replica's
rank c mod K, so every chunk boundary crosses ranks and the first and the last chunk sit on
the replica's first and last rank, as the single-chunk schedules have them.

- The multiple rule is torch's ("flex" interleaving): ScheduleInterleaved1F1B and
  ScheduleInterleavedZeroBubble run the micro-batches in max(1, M // K) rounds of equal size
  and raise ValueError when M is not a multiple of the number of rounds (K = 4: M = 9 is
  refused, 10 runs). M >= K is this project's rule (torch runs fewer): below K the fill and
  drain are not amortised and the bubble no longer follows the step model
  (planning/step_model.py), as 1F1B's does not.
- M does not bound v: torch's rules tie M to K only, and the interleaved bubble
  (K - 1) / (v M + K - 1) holds for M < K v too (tests/test_schedules.py simulates torch's
  orders). The active units do: K v chunks need K v units, a chunk at least one.
- `virtual_stages: auto` is 2 where the active units allow (torchtitan's default for looped
  schedules), else 1: the bubble falls as 1/v but every chunk boundary is a send, so v
  chunks a rank send v times as often; the largest v the units allow (9 on the quickstart at
  K = 2) multiplied the sends for a bubble already small.
- `zero_bubble` runs ScheduleInterleavedZeroBubble (Qi et al. 2023, arXiv:2401.10241: its ZB1P
  order with the backward split into input (I) and weight (W) gradients, W delayed into the
  bubble), not ScheduleZBVZeroBubble or ScheduleDualPipeV: those place chunks in a V (rank r
  holds chunks r and 2K - 1 - r, so the first rank also runs the last chunk) and need
  exactly two chunks a rank, which a layout loses once freezing leaves fewer than 2K active
  units; DualPipeV also needs M >= 2K. The interleaved one takes any v >= 1 with the looped
  placement interleaved_1f1b uses, so both share one partition, placement and handoff.
- interleaved_1f1b at v = 1 runs Schedule1F1B: ScheduleInterleaved1F1B with one chunk a rank
  has 1F1B's bubble but warms up 2 (K - 1 - r) micro-batches on rank r where 1F1B holds
  K - r. zero_bubble at v = 1 keeps its schedule (the I/W split still fills the bubble).

Owns: the schedule names and their properties (`SCHEDULE_PROPERTIES`: the one table the
runtime, the step and memory models, the schedule orders, the benchmarks and the tests
read), these rules and `virtual_stages_for` (v at a layout, re-decided at every
transition). Must not: import anything outside config/, touch torch or plan partitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]


@dataclass(frozen=True)
class ScheduleProperties:
    """What a schedule is to everything that runs, prices or plans it."""

    torch_class: str  # its class in torch.distributed.pipelining
    # Several chunks a rank (looped placement; torch's PipelineScheduleMulti, which takes the
    # list of a rank's stages): v chunks, M a multiple of max(1, M // K), M >= K.
    multi_chunk: bool
    # Each chunk's backward split into the input gradient (I) and the weight gradient (W),
    # W delayed into the bubble, both through `torch.autograd.grad`: DDP's hooks never fire
    # (the rank averages its gradients itself: pipe/gradient_sync.py), a compiled unit would
    # run its whole backward at I and again at W (config/checks.py refuses trainer.compile),
    # and a micro-batch's activations stay until its W (autopipe/memory.py).
    split_backward: bool


SCHEDULE_PROPERTIES: dict[str, ScheduleProperties] = {
    "gpipe": ScheduleProperties("ScheduleGPipe", multi_chunk=False, split_backward=False),
    "1f1b": ScheduleProperties("Schedule1F1B", multi_chunk=False, split_backward=False),
    "interleaved_1f1b": ScheduleProperties(
        "ScheduleInterleaved1F1B", multi_chunk=True, split_backward=False
    ),
    "zero_bubble": ScheduleProperties(
        "ScheduleInterleavedZeroBubble", multi_chunk=True, split_backward=True
    ),
}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_PROPERTIES)
MULTI_CHUNK_SCHEDULES: tuple[str, ...] = tuple(
    name for name, schedule in SCHEDULE_PROPERTIES.items() if schedule.multi_chunk
)
SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = tuple(
    name for name, schedule in SCHEDULE_PROPERTIES.items() if schedule.split_backward
)
TORCH_SCHEDULE_CLASS: dict[str, str] = {
    name: schedule.torch_class for name, schedule in SCHEDULE_PROPERTIES.items()
}


def layout_schedule(schedule: str, pipe_len: int, virtual_stages: int) -> str | None:
    """The schedule a layout of `pipe_len` stages with `virtual_stages` chunks a rank runs:
    None for plain DDP (K = 1), 1f1b for interleaved_1f1b at v = 1, else `schedule`.
    ValueError for several chunks a rank under a schedule that runs one."""
    if virtual_stages > 1 and schedule not in MULTI_CHUNK_SCHEDULES:
        raise ValueError(f"{schedule} runs one chunk a stage, not {virtual_stages}")
    if pipe_len == 1:
        return None
    if schedule == "interleaved_1f1b" and virtual_stages == 1:
        return "1f1b"
    return schedule


def micro_batch_problem(schedule: str, pipe_len: int, num_micro_batches: int) -> str | None:
    """Why `schedule` cannot run `num_micro_batches` over a pipeline of `pipe_len`, or None."""
    k, m = pipe_len, num_micro_batches
    if k == 1:  # plain DDP: no schedule
        return None
    if schedule in ("1f1b", *MULTI_CHUNK_SCHEDULES) and m < k:
        return f"{schedule} needs at least pipe_len ({k}) micro-batches, got {m}"
    if schedule in MULTI_CHUNK_SCHEDULES:
        rounds = max(1, m // k)
        if m % rounds:
            return (
                f"{schedule} ({TORCH_SCHEDULE_CLASS[schedule]}) runs the micro-batches in "
                f"max(1, M // K) = {rounds} rounds of equal size: {m} is not a multiple of "
                f"{rounds} (pipe_len {k}; a multiple of {k} always is)"
            )
    return None


def smallest_micro_batches(schedule: str, pipe_len: int, replica_batch: int) -> int | None:
    """The measurement-free M: the smallest divisor of the replica batch >= K that
    `schedule` runs (1 for plain DDP); None when there is none."""
    if pipe_len == 1:
        return 1
    for m in range(pipe_len, replica_batch + 1):
        if replica_batch % m == 0 and micro_batch_problem(schedule, pipe_len, m) is None:
            return m
    return None


# The chunks a rank holds under `virtual_stages: auto`: torchtitan's default for looped
# schedules (torchtitan/distributed/pipeline_parallel.py: "For multi-stage schedules, default
# is 2 virtual stages per rank"). The bubble falls as 1/v, the sends grow as v: two halves
# the bubble for twice the sends, and more is for a user who has measured their links.
AUTO_VIRTUAL_STAGES = 2


def virtual_stages_for(schedule: str, setting: int | str, pipe_len: int, active_units: int) -> int:
    """The chunks a rank holds in a layout of `pipe_len` stages over `active_units` units
    (those outside the frozen prefix), re-decided at every transition: 1 for gpipe, 1f1b and
    plain DDP; for the multi-chunk schedules the configured v ('auto': AUTO_VIRTUAL_STAGES),
    fewer where the K v chunks would not each hold a unit (at least 1)."""
    if schedule not in MULTI_CHUNK_SCHEDULES or pipe_len == 1:
        return 1
    most = max(1, active_units // pipe_len)
    wanted = AUTO_VIRTUAL_STAGES if setting == "auto" else int(setting)
    return max(1, min(wanted, most))


def virtual_stages_problem(
    schedule: str, setting: int | str, pipe_len: int, active_units: int
) -> str | None:
    """Why a run cannot start with `setting` chunks a rank at `pipe_len` over `active_units`
    units, or None (at later layouts a configured v falls back; at the start it must fit)."""
    if setting == "auto" or pipe_len == 1 or schedule not in MULTI_CHUNK_SCHEDULES:
        return None
    v = int(setting)
    if pipe_len * v > active_units:
        return (
            f"{v} chunks a rank on pipe_len {pipe_len} need {pipe_len * v} active units, the "
            f"model has {active_units} at the start (a chunk holds at least one sublayer); "
            f"use at most {max(1, active_units // pipe_len)} or 'auto'"
        )
    return None
