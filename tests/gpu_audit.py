"""What a GPU would enforce, checked on the CPU: host reads of tensor values.

`HostReads` is a TorchDispatchMode that records every operator that hands a tensor's value
to the host: `aten._local_scalar_dense` (what `.item()`, `float()`, `int()` and `.tolist()`
of a one-element tensor call) and `aten.is_nonzero` (`bool(tensor)`, `if tensor:`). On a
GPU each is a device-to-host synchronisation that stalls the stream. It runs on real CPU
tensors, so it sees reads that fake tensors skip (transformers skips its mask read for a
fake tensor). Each record names the innermost frame of this package that caused it.
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


def _caller() -> str:
    frames = traceback.extract_stack()[:-2]
    for frame in reversed(frames):
        if "/pipetransformer/" in frame.filename or "transformers/" in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"
    return "torch"


class HostReads(TorchDispatchMode):
    """Records (operator, where) for every host read while active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_OPS:
            self.reads.append((func.__name__, _caller()))
        return func(*args, **(kwargs or {}))
