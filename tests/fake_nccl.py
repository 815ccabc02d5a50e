"""NCCL's communicators, counted on this CPU: a world of ranks played by threads of this
process, with torch.distributed's point-to-point calls replaced by mailboxes that carry the
real tensors, and ProcessGroupNCCL's rule for which communicator each call runs on.

ProcessGroupNCCL (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, `pointToPoint`): inside
a batch of point-to-point operations (`batch_isend_irecv`, an NCCL group) a send or receive
runs on the group's own communicator, "like a collective" (`getKeyFromDevice`); a send,
receive, isend or irecv on its own opens a communicator for the pair of ranks
(`getKeySendRecv(rank, peer)`), created on first use and kept, with its buffers on both
GPUs, until the group is destroyed. `FakeNccl.opened` records, per rank, the communicators
the calls made: ("group", name) for the group's own, ("pair", name, low, high) for a pair's.
Object lists (`send_object_list`, `recv_object_list`) travel on the control group, which is
gloo on every run: they open no NCCL communicator.

Owns: the fake world and its count. Must not: be imported by the package.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

WAIT_S = 30.0  # a receive that waits longer has no sender: the test fails instead of hanging


@dataclass
class FakeP2POp:
    op: Callable
    tensor: torch.Tensor
    peer: int | None = None
    group: Any = None
    tag: int = 0


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FakeNccl:
    """`world_size` ranks as threads; install() patches torch.distributed's point-to-point
    calls; run(fn) calls fn(rank) on every rank at once and returns the results by rank."""

    def __init__(self, world_size: int, control: object) -> None:
        self.world_size = world_size
        self.control = control  # the control group object the code under test is handed
        self.mailboxes: dict[tuple, queue.Queue] = defaultdict(queue.Queue)
        self.opened: list[set[tuple]] = [set() for _ in range(world_size)]
        self.plain_calls = 0  # point-to-point calls outside a batch (each opens a pair's)
        self._lock = threading.Lock()
        self._local = threading.local()

    # ------------------------------------------------------------------ the calls

    @property
    def rank(self) -> int:
        return self._local.rank

    def _group(self, group) -> str:
        if group is self.control:
            return "control"
        return "world" if group is None else str(id(group))

    def _box(self, group: str, src: int, dst: int) -> queue.Queue:
        with self._lock:
            return self.mailboxes[(group, src, dst)]

    def _open(self, key: tuple) -> None:
        self.opened[self.rank].add(key)

    def _send(self, tensor, dst: int, group, batched: bool) -> None:
        name = self._group(group)
        if name != "control":
            self._open(("group", name) if batched else ("pair", name, *sorted((self.rank, dst))))
        self._box(name, self.rank, dst).put(tensor.detach().clone())

    def _recv(self, tensor, src: int, group, batched: bool) -> None:
        name = self._group(group)
        if name != "control":
            self._open(("group", name) if batched else ("pair", name, *sorted((self.rank, src))))
        tensor.copy_(self._box(name, src, self.rank).get(timeout=WAIT_S))

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.plain_calls += 1
        self._send(tensor, dst, group, batched=False)

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.plain_calls += 1
        self._recv(tensor, src, group, batched=False)
        return src

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.send(tensor, dst, group)
        return _Done()

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.recv(tensor, src, group)
        return _Done()

    def batch_isend_irecv(self, ops: list[FakeP2POp]) -> list[_Done]:
        if len({self._group(op.group) for op in ops}) != 1:
            raise ValueError("All ops need to use the same group.")
        for op in ops:  # sends first: a batch's order does not matter to NCCL
            if op.op == self.isend:
                self._send(op.tensor, op.peer, op.group, batched=True)
        for op in ops:
            if op.op == self.irecv:
                self._recv(op.tensor, op.peer, op.group, batched=True)
        return [_Done() for _ in ops]

    def send_object_list(self, objects, dst=None, group=None, device=None, group_dst=None):
        self._box(self._group(group), self.rank, dst).put(list(objects))

    def recv_object_list(self, objects, src=None, group=None, device=None, group_src=None):
        objects[:] = self._box(self._group(group), src, self.rank).get(timeout=WAIT_S)
        return src

    # ------------------------------------------------------------------ the world

    def install(self, monkeypatch) -> None:
        import torch.distributed as dist

        for name in (
            "send",
            "recv",
            "isend",
            "irecv",
            "batch_isend_irecv",
            "send_object_list",
            "recv_object_list",
        ):
            monkeypatch.setattr(dist, name, getattr(self, name))
        monkeypatch.setattr(dist, "P2POp", FakeP2POp)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def play(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=play, args=(r,)) for r in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results

    def communicators(self) -> set[tuple]:
        """Every NCCL communicator any rank opened (a pair's counted once for both)."""
        return set().union(*self.opened)
