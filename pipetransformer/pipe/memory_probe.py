"""Measuring the peak memory of a training step, to hold the memory model to account.

On a GPU: the CUDA caching allocator's own statistics (`max_memory_allocated`). On the CPU
there are no allocator statistics, but PyTorch takes CPU tensors from glibc's malloc, so
malloc's bytes in use (`mallinfo2`) count them exactly; the peak is sampled after every
operator (a TorchDispatchMode), which sees an operator's outputs before its inputs are
freed. Bytes are counted above a baseline the caller takes before building what it
measures (after any first, throwaway build: lazy imports and oneDNN's primitive caches
cost tens of MB once per process).

Owns: those two measurements. Must not: predict anything (autopipe/memory.py does).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


_libc = None


def bytes_in_use(device: torch.device | str = "cpu") -> int:
    """Bytes held now: glibc malloc's in use (CPU) or the CUDA allocator's allocated."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallinfo2.restype = _MallInfo2
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def peak_bytes(step: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """The most bytes in use at any point of `step()` (absolute, not above a baseline)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    peak = [bytes_in_use()]

    class Sampler(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            peak[0] = max(peak[0], bytes_in_use())
            return out

    with Sampler():
        step()
    return peak[0]
