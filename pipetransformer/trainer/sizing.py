"""Memory in planning: the device budget, whether a layout's stages fit it, and the
pipeline length a run starts at (`pipeline.initial_pipe_len: auto`). No processes: shared by
the trainer and `pipetransformer plan`.

The run starts at the shortest pipeline whose stages fit (K = 1, plain DDP over every
device, when the whole model fits), and AutoPipe refuses any compression whose packed
stages would not fit. Stage bytes come from autopipe/memory.py's MemoryModel over the
measured unit profile; without one (a `plan` before any run measured this model) only
parameters, gradients and optimizer state are known, and the caller is told so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pipetransformer.autodp.topology import dp_degree_for
from pipetransformer.autopipe.memory import LayoutShape, MemoryModel, optimizer_state_factor
from pipetransformer.autopipe.planner import PipelinePlan, UnitCosts, balance
from pipetransformer.config import Config, ConfigError, initial_pipe_lens
from pipetransformer.models import ModelSpec

logger = logging.getLogger(__name__)

# Kept free on a GPU for the CUDA context, NCCL's buffers and allocator fragmentation.
CUDA_RESERVE_BYTES = 1 << 30
CUDA_RESERVE_FRACTION = 0.10


def device_memory_budget(config: Config, device: torch.device | str) -> float | None:
    """pipeline.device_memory_bytes; else a CUDA device's total memory less the reserve; on
    the CPU None (unlimited)."""
    if config.pipeline.device_memory_bytes is not None:
        return float(config.pipeline.device_memory_bytes)
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return float(total * (1 - CUDA_RESERVE_FRACTION) - CUDA_RESERVE_BYTES)
    return None


def memory_model(config: Config, spec: ModelSpec, profile=None) -> MemoryModel:
    """From the measured unit profile; without one, from parameter counts alone (float32
    parameters, activations unknown: counted as zero)."""
    optimizer = config.optimizer
    if profile is not None:
        return MemoryModel.from_profile(profile, optimizer.name, optimizer.momentum)
    params = tuple(4 * c for c in spec.unit_param_counts)
    zeros = tuple(0 for _ in params)
    return MemoryModel(params, zeros, zeros, 1, optimizer_state_factor(optimizer.name, optimizer.momentum))


def layout_shape(config: Config, pipe_len: int, world_size: int, initial_pipe_len: int) -> LayoutShape:
    """Micro-batch size, micro-batch count (the measurement-free rule: for GPipe the total
    activation bytes do not depend on it), replicas and schedule of a layout with `pipe_len`."""
    from pipetransformer.trainer.planning import choose_num_micro_batches

    dp = dp_degree_for(pipe_len, world_size, world_size // initial_pipe_len, config.autodp.enabled)
    replica_batch = config.trainer.global_batch_size // dp
    m = choose_num_micro_batches(config.pipeline.num_micro_batches, pipe_len, replica_batch)
    return LayoutShape(replica_batch // m, m, dp, config.pipeline.schedule)


def plan_fits(
    config: Config, memory: MemoryModel, budget: float | None, world_size: int, initial_pipe_len: int
) -> Callable[[PipelinePlan], bool] | None:
    """The planner's fit check for a run starting at `initial_pipe_len`; None: unlimited."""
    if budget is None:
        return None

    def fits(plan: PipelinePlan) -> bool:
        return memory.fits(plan, layout_shape(config, plan.pipe_len, world_size, initial_pipe_len), budget)

    return fits


def stage_bytes(config: Config, memory: MemoryModel, plan: PipelinePlan, world_size: int, initial_pipe_len: int) -> list[float]:
    return memory.peak_bytes(plan, layout_shape(config, plan.pipe_len, world_size, initial_pipe_len))


def choose_initial_pipe_len(
    config: Config, costs: UnitCosts, memory: MemoryModel, budget: float | None, world_size: int
) -> int:
    """The configured K, or for 'auto' the shortest candidate whose stages fit `budget`.
    Raises ConfigError naming the key when none fits."""
    candidates = initial_pipe_lens(config, world_size)
    if isinstance(config.pipeline.initial_pipe_len, int):
        return candidates[0]
    peaks = {}
    for pipe_len in candidates:
        plan = balance(costs, 0, pipe_len, config.autopipe.partition_method)
        peaks[pipe_len] = max(stage_bytes(config, memory, plan, world_size, pipe_len))
        if budget is None or peaks[pipe_len] <= budget:
            return pipe_len
    described = ", ".join(f"K={k}: {format_bytes(v)}" for k, v in peaks.items())
    raise ConfigError(
        f"pipeline.initial_pipe_len: auto: no pipeline fits pipeline.device_memory_bytes "
        f"({format_bytes(budget)} per device); largest stage at {described}; use more devices per "
        "node, a smaller trainer.global_batch_size, or trainer.precision=bf16"
    )


def format_bytes(count: float) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"
