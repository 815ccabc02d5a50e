"""The order in which torch's pipeline schedules post their sends and receives, replayed
against a model of NCCL's point-to-point rules: no processes, no tensors.

`record_programs` runs a torch schedule class's own `_step_microbatches` once per rank of a
pipeline (the stages are stand-ins that do no work, `_initialize_stage(s)` is skipped), with
`torch.distributed.isend`, `irecv` and `batch_isend_irecv` replaced by recorders, so torch's
own code (its `_batch_p2p`, its fused 1F1B batches, its `_PipelineScheduleRuntime` actions)
decides what is posted, grouped and waited for, in which order. Each rank's program is the
sequence of posts (an op, or a group from `batch_isend_irecv`) and waits (`Work.wait()`).

`simulate` replays the programs under the strictest rules a GPU imposes:
- a wait blocks its rank until that op has completed (on NCCL a stream wait: everything the
  rank posts afterwards is ordered behind it, so blocking the program is the same order);
- posted ops queue in FIFOs, one per rank pair (`fifo="pair"`: NCCL's point-to-point
  communicator and stream per pair) or one per rank (`fifo="rank"`: every peer on one
  stream); only the group at the head of a FIFO can run, on both sides;
- rendezvous: a send completes only together with its receive (no buffering, as NCCL for
  tensors of any size), the k-th send from a to b with the k-th receive at b from a; a group
  completes when all its ops have;
- a send and its receive must carry the same tensor (direction, chunk boundary and
  micro-batch): a mismatch would deliver the wrong activations silently.
Deadlock (no rank can move and some have not finished) and mismatches are reported.

Owns: the recorder and the simulator. Must not: start processes or touch a device.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import types
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

from pipetransformer.config import SCHEDULE_PROPERTIES


@dataclass(frozen=True)
class Tensor:
    """What a P2P op carries: 'F' an activation leaving chunk `chunk`, 'B' a gradient leaving
    it, for micro-batch `micro_batch`."""

    kind: str
    chunk: int
    micro_batch: int


@dataclass(eq=False)
class Op:
    send: bool
    rank: int
    peer: int
    tensor: Tensor


@dataclass(eq=False)
class Group:
    ops: list[Op]


@dataclass
class _P2P:
    """torch's P2POp as the schedules read it."""

    op: object
    tensor: Tensor
    peer: int
    group: object
    tag: int = 0

    @property
    def group_peer(self) -> int:
        return self.peer


class _Work:
    def __init__(self, op: Op, program: list) -> None:
        self.op, self.program = op, program

    def wait(self) -> None:
        self.program.append(("wait", self.op))


class _Stage:
    """A stand-in for one chunk (torch's stage_index `index`) on pipeline rank `rank`: what
    the schedules call, doing nothing but naming the ops a real PipelineStage would post."""

    def __init__(self, index: int, num_chunks: int, pipe_len: int, has_backward: bool) -> None:
        self.stage_index, self.num_stages, self.group_size = index, num_chunks, pipe_len
        self.group_rank = index % pipe_len
        self.is_first, self.is_last = index == 0, index == num_chunks - 1
        self.has_backward = has_backward
        self.stage_index_to_group_rank = None
        self.submod = None
        self.output_chunks: list = []

    def _rank_of(self, chunk: int) -> int:
        return chunk % self.group_size

    def _ops(self, send: bool, kind: str, chunk: int, peer_chunk: int, mb: int) -> list[_P2P]:
        op = dist.isend if send else dist.irecv
        return [_P2P(op, Tensor(kind, chunk, mb), self._rank_of(peer_chunk), _GROUP)]

    def get_fwd_recv_ops(self, mb: int) -> list[_P2P]:
        if self.is_first:
            return []
        return self._ops(False, "F", self.stage_index - 1, self.stage_index - 1, mb)

    def get_fwd_send_ops(self, mb: int) -> list[_P2P]:
        if self.is_last:
            return []
        return self._ops(True, "F", self.stage_index, self.stage_index + 1, mb)

    def get_bwd_recv_ops(self, mb: int) -> list[_P2P]:
        if not self.has_backward or self.is_last:
            return []
        return self._ops(False, "B", self.stage_index + 1, self.stage_index + 1, mb)

    def get_bwd_send_ops(self, mb: int) -> list[_P2P]:
        if not self.has_backward or self.is_first:
            return []
        return self._ops(True, "B", self.stage_index, self.stage_index - 1, mb)

    def forward_one_chunk(self, mb, *args, **kwargs):
        return None

    def backward_one_chunk(self, mb, *args, **kwargs) -> None:
        pass

    def backward_weight_one_chunk(self, mb, *args, **kwargs) -> None:
        pass

    def perform_reduce_grad(self, *args) -> None:
        pass

    def scale_grads(self, *args) -> None:
        pass

    def clear_runtime_states(self) -> None:
        pass


_GROUP = types.SimpleNamespace(group_name="pipeline")


@contextlib.contextmanager
def _recording(program: list, rank: int):
    """torch.distributed's P2P calls recorded into `program` as rank `rank` posts them."""
    saved = dist.isend, dist.irecv, dist.batch_isend_irecv

    def post(send: bool):
        def call(tensor, group=None, tag=0, group_dst=None, group_src=None, **kwargs):
            peer = group_dst if send else group_src
            op = Op(send, rank, peer, tensor)
            program.append(("post", Group([op])))
            return _Work(op, program)

        return call

    isend, irecv = post(True), post(False)

    def batch(p2p_ops):
        ops = [Op(p.op is isend, rank, p.peer, p.tensor) for p in p2p_ops]
        program.append(("post", Group(ops)))
        return [_Work(op, program) for op in ops]

    dist.isend, dist.irecv, dist.batch_isend_irecv = isend, irecv, batch
    # The profiler's labels of each action: a third of the replay's time, and no op.
    labels = torch_schedules.record_function
    torch_schedules.record_function = lambda name: contextlib.nullcontext()
    try:
        yield
    finally:
        dist.isend, dist.irecv, dist.batch_isend_irecv = saved
        torch_schedules.record_function = labels


def record_programs(
    schedule: str, pipe_len: int, virtual_stages: int, num_micro_batches: int
) -> dict[bool, dict[int, list]]:
    """Every rank's program for one training step (key True) and one evaluation (False) of
    `schedule` (config/schedules.py's name) over a pipeline of `pipe_len` ranks with
    `virtual_stages` chunks each (the looped placement), as torch's class runs it."""
    properties = SCHEDULE_PROPERTIES[schedule]
    cls = getattr(torch_schedules, properties.torch_class)
    chunks = pipe_len * virtual_stages

    def stages_of(rank: int, training: bool) -> list[_Stage]:
        return [_Stage(c, chunks, pipe_len, training) for c in range(rank, chunks, pipe_len)]

    # A multi-chunk class computes every rank's order (with its sends and receives) when it
    # is built: built once, then run as each rank with that rank's stages.
    base = cls(stages_of(0, True), num_micro_batches) if properties.multi_chunk else None
    recorded: dict[bool, dict[int, list]] = {}
    for training in (True, False):
        recorded[training] = {}
        for rank in range(pipe_len):
            program: list = []
            stages = stages_of(rank, training)
            if properties.multi_chunk:
                runner = copy.copy(base)
                runner._stages, runner.rank = stages, rank
                runner.fwd_recv_ops, runner.bwd_recv_ops = {}, {}
                runner.backward_counter = collections.Counter()
                runner._initialize_stages = lambda *args, **kwargs: None
            else:
                runner = cls(stages[0], num_micro_batches)
                runner._initialize_stage = lambda *args, **kwargs: None
            with _recording(program, rank):  # the ops are made while the step runs
                runner._step_microbatches(None, None, None, None)
            recorded[training][rank] = program
    return recorded


@dataclass
class Outcome:
    deadlock: bool
    mismatches: list[str] = field(default_factory=list)
    stuck: dict[int, str] = field(default_factory=dict)  # rank -> what it waits for
    ops: int = 0


def simulate(programs: dict[int, list], fifo: str = "pair") -> Outcome:
    """Replay `programs` under the rules of the module docstring."""
    queues: dict[tuple[int, ...], deque[Group]] = {}
    done: set[int] = set()  # ids of the completed ops

    def key(rank: int, peer: int) -> tuple[int, ...]:
        return (rank, peer) if fifo == "pair" else (rank,)

    position = dict.fromkeys(programs, 0)
    outcome = Outcome(deadlock=False)
    moved = True
    while moved:
        moved = False
        for rank, program in programs.items():  # each rank runs until it must wait
            while position[rank] < len(program):
                what, item = program[position[rank]]
                if what == "wait" and id(item) not in done:
                    break
                if what == "post":
                    outcome.ops += len(item.ops)
                    # A group spanning several peers holds each of their FIFOs until done.
                    for fifo_key in {key(rank, op.peer) for op in item.ops}:
                        queues.setdefault(fifo_key, deque()).append(item)
                position[rank] += 1
                moved = True
        moved |= _match(queues, key, done, outcome)
    unfinished = [r for r, p in programs.items() if position[r] < len(p)]
    outcome.deadlock = bool(unfinished) or any(queues.values())
    for rank in unfinished:
        _, op = programs[rank][position[rank]]
        outcome.stuck[rank] = f"waits for its {'send' if op.send else 'recv'} of {op.tensor}"
    return outcome


def _match(queues, key, done: set[int], outcome: Outcome) -> bool:
    """Complete every send and receive that meet at the heads of their FIFOs."""
    moved = False
    for (rank, *_), queue in list(queues.items()):
        if not queue:
            continue
        for op in queue[0].ops:
            if id(op) in done or op.rank != rank or not op.send:
                continue
            theirs = queues.get(key(op.peer, rank))
            if not theirs:
                continue
            receive = next(
                (o for o in theirs[0].ops if id(o) not in done and not o.send and o.peer == rank),
                None,
            )
            if receive is None:
                continue
            if receive.tensor != op.tensor:
                outcome.mismatches.append(f"{rank}->{op.peer}: {op.tensor} into {receive.tensor}")
            done.update((id(op), id(receive)))
            moved = True
    for queue in queues.values():
        while queue and all(id(op) in done for op in queue[0].ops):
            queue.popleft()
            moved = True
    return moved
