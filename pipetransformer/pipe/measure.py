"""Measuring what units and pipeline steps cost on this process's device, in time and memory.

Owns: `measure_unit_costs` (per-unit forward / backward / frozen-forward time, output and
saved-for-backward activation bytes, parameter bytes, at one micro-batch size),
`time_schedule_steps` (median seconds per call of a step the caller builds), and the peak
memory of a step (`bytes_in_use`, `peak_bytes`; see "Memory" below).
Must not: call torch.distributed, choose a layout or decide which M wins
(autopipe/profiles.py does, from these numbers), write profile files, or leave any trace on the
units it measures: parameters, gradients, requires_grad flags, buffers, train/eval modes
and the global RNG stream are as they were when it returns.

Inputs are synthetic, built from the ModelSpec: floating tensors are standard normal,
integer tensors are all ones. One is a valid token id and token type for any vocabulary of
two or more entries, and an all-ones attention mask is a real mask (attend everywhere),
so BERT's embedding and attention run their ordinary path. Costs here depend on shapes,
not values.

Memory: on a GPU, the CUDA caching allocator's own statistics (`max_memory_allocated`). On
the CPU there are no allocator statistics, but PyTorch takes CPU tensors from glibc's
malloc, so malloc's bytes in use (`mallinfo2`) count them exactly; the peak is sampled after
every operator (a TorchDispatchMode), which sees an operator's outputs before its inputs
are freed. Bytes are counted above a baseline the caller takes before building what it
measures (after any first, throwaway build: lazy imports and oneDNN's primitive caches
cost tens of MB once per process). What the memory model predicts is autopipe/memory.py's.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipetransformer.autopipe.profiles import UnitMeasurement
from pipetransformer.models.layered import ModelSpec, TensorSpec

logger = logging.getLogger(__name__)


def _synchronize(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without this a timer measures the launch only.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def example_inputs(
    specs: Sequence[TensorSpec], batch_size: int, device: torch.device, grad_first: bool
) -> tuple[torch.Tensor, ...]:
    """Inputs of the given specs: normal floats, integer ones (see the module docstring)."""
    tensors = []
    for index, spec in enumerate(specs):
        shape = (batch_size, *spec.shape)
        if spec.dtype.is_floating_point:
            tensor = torch.randn(shape, dtype=spec.dtype, device=device)
            tensor.requires_grad_(grad_first and index == 0)
        else:
            tensor = torch.ones(shape, dtype=spec.dtype, device=device)
        tensors.append(tensor)
    return tuple(tensors)


def _as_tuple(outputs: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _distinct_bytes(tensors: Sequence[torch.Tensor]) -> int:
    # A tensor passed through unchanged (BERT's mask) may appear twice: count it once.
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in tensors:
        key = (tensor.data_ptr(), tensor.nbytes)
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total


def _saved_bytes(unit: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """(saved-for-backward bytes, output bytes) of one trained forward.

    Each saved storage counts once (views and tensors saved by several ops share one), and
    parameters/buffers do not count: they are held anyway. A saved unit input (e.g. the
    LayerNorm input) does count: the graph keeps it alive until this unit's backward.
    """
    held = {t.untyped_storage().data_ptr() for t in (*unit.parameters(), *unit.buffers())}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in held:
            storages.setdefault(pointer, storage.nbytes())
        # Detached: a packed tensor that is the op's own output (softmax saves its result)
        # would otherwise close a cycle through its grad_fn that Python's collector cannot
        # see, and the whole forward's graph would outlive this function (measured: every
        # attention unit's activations, for the rest of the run).
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = _as_tuple(unit(*inputs))
    output_bytes = _distinct_bytes(outputs)
    del outputs  # frees the graph before the timed passes
    return sum(storages.values()), output_bytes


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    _synchronize(device)
    start = time.perf_counter()
    result = fn()
    _synchronize(device)
    return time.perf_counter() - start, result


def _measure_unit(
    unit: nn.Module,
    specs: Sequence[TensorSpec],
    micro_batch_size: int,
    device: torch.device,
    repeats: int,
    warmup: int,
    grad_input: bool,
) -> UnitMeasurement:
    params = list(unit.parameters())
    unit.train()
    saved_bytes, output_bytes = _saved_bytes(
        unit, example_inputs(specs, micro_batch_size, device, grad_input)
    )

    forward, backward = [], []
    for index in range(warmup + repeats):
        inputs = example_inputs(specs, micro_batch_size, device, grad_input)
        forward_s, outputs = _timed(lambda inputs=inputs: _as_tuple(unit(*inputs)), device)
        hidden = outputs[0]  # the hidden state (or the head's logits) carries the gradient
        grad = torch.randn_like(hidden)
        backward_s, _ = _timed(
            lambda hidden=hidden, grad=grad: torch.autograd.backward(hidden, grad), device
        )
        if index >= warmup:
            forward.append(forward_s)
            backward.append(backward_s)
        del outputs, hidden

    unit.eval()
    frozen = []
    with torch.no_grad():
        for index in range(warmup + repeats):
            inputs = example_inputs(specs, micro_batch_size, device, grad_first=False)
            frozen_s, _ = _timed(lambda inputs=inputs: unit(*inputs), device)
            if index >= warmup:
                frozen.append(frozen_s)

    return UnitMeasurement(
        forward_s=statistics.median(forward),
        backward_s=statistics.median(backward),
        frozen_forward_s=statistics.median(frozen),
        output_bytes=output_bytes,
        saved_bytes=saved_bytes,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
    )


def measure_unit_costs(
    units: dict[int, nn.Module],
    spec: ModelSpec,
    micro_batch_size: int,
    device: torch.device | str,
    repeats: int = 3,
    warmup: int = 1,
    autocast_dtype: torch.dtype | None = None,
) -> dict[int, UnitMeasurement]:
    """Measure each given unit (already on `device`) at `micro_batch_size`; medians of `repeats`.

    Unit 0 gets the model inputs, every other unit activations. Hidden-state inputs of units
    after the embedding require grad, as inside a pipeline, so backward times include the
    input gradient. Frozen units are measured as if trained too (requires_grad is switched
    on for the measurement and restored), so one profile serves every frozen boundary.
    `autocast_dtype`: measure under autocast (times and saved bytes of bf16 training).
    """
    if micro_batch_size < 1 or repeats < 1 or warmup < 0:
        raise ValueError("need micro_batch_size >= 1, repeats >= 1, warmup >= 0")
    device = torch.device(device)
    results: dict[int, UnitMeasurement] = {}
    for index in sorted(units):
        unit = units[index]
        params = list(unit.parameters())
        modes = {module: module.training for module in unit.modules()}
        flags = [p.requires_grad for p in params]
        grads = [p.grad for p in params]
        buffers = [b.detach().clone() for b in unit.buffers()]  # e.g. running statistics
        try:
            for p in params:
                p.grad = None
                p.requires_grad_(True)
            # Random inputs and dropout draw from the RNG: leave the run's stream as it was.
            rng_devices = (
                [device.index if device.index is not None else torch.cuda.current_device()]
                if device.type == "cuda"
                else []
            )
            with (
                torch.random.fork_rng(devices=rng_devices),
                torch.autocast(
                    device.type,
                    dtype=autocast_dtype or torch.float32,
                    enabled=autocast_dtype is not None,
                ),
            ):
                results[index] = _measure_unit(
                    unit,
                    spec.unit_input_specs(index),
                    micro_batch_size,
                    device,
                    repeats,
                    warmup,
                    index > 0,
                )
        finally:
            with torch.no_grad():
                for buffer, saved in zip(unit.buffers(), buffers):
                    buffer.copy_(saved)
            for p, grad, flag in zip(params, grads, flags):
                p.grad = grad
                p.requires_grad_(flag)
            for module, mode in modes.items():
                module.training = mode
        logger.debug("unit %d: %s", index, results.get(index))
    return results


def time_schedule_steps(
    step_fn: Callable[[], None], steps: int, warmup: int, device: torch.device | str | None = None
) -> float:
    """Median seconds per `step_fn()` call after `warmup` untimed calls.

    Pass `device` when it is a GPU, so each timing waits for the step's kernels. In a
    pipeline every rank times its own step; the layout's step time is the slowest rank's.
    """
    return statistics.median(time_schedule_samples(step_fn, steps, warmup, device))


def time_schedule_samples(
    step_fn: Callable[[], None], steps: int, warmup: int, device: torch.device | str | None = None
) -> list[float]:
    """Seconds of each of `steps` timed `step_fn()` calls after `warmup` untimed ones."""
    if steps < 1 or warmup < 0:
        raise ValueError("need steps >= 1 and warmup >= 0")
    device = torch.device(device) if device is not None else torch.device("cpu")
    for _ in range(warmup):
        step_fn()
    return [_timed(step_fn, device)[0] for _ in range(steps)]


def relative_spread(samples: list[float]) -> float:
    """(slowest - fastest) / median: how much repeats of one measurement disagree."""
    median = statistics.median(samples)
    return (max(samples) - min(samples)) / median if median > 0 else 0.0


# ----------------------------------------------------------------------------- memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
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
