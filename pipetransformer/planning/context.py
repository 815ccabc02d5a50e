"""One run's planning inputs, built once: the model's description, its unit costs, the memory
model, the device's memory budget, the world, the initial pipeline length and AutoPipe's
planner. The trainer, `pipetransformer plan` and `plan --predict` all build their layouts
from a `PlanContext`, so they cannot drift apart.

The run starts at the shortest pipeline whose stages fit the device (K = 1, plain DDP over
every device, when the whole model fits; `pipeline.initial_pipe_len: auto`), and AutoPipe
refuses any compression whose packed stages would not fit. Stage bytes come from
autopipe/memory.py's MemoryModel over the measured unit profile; without one (a `plan`
before any run measured this model) only parameters, gradients and optimizer state are
known, and `memory_source` says so.

Owns: that set-up and the layout for a frozen boundary. Must not: measure anything, start
processes or mutate the config it is given (`config.resolve` makes the resolved copy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipetransformer.autodp.handoff import Transfer, plan_transfers
from pipetransformer.autodp.topology import Layout, dp_degree_for
from pipetransformer.autopipe.memory import LayoutShape, MemoryModel, optimizer_state_factor
from pipetransformer.autopipe.planner import (
    AutoPipePlanner,
    PipelinePlan,
    UnitCosts,
    balance,
    fixed_plan,
)
from pipetransformer.autopipe.profiles import UnitProfile, unit_costs_from_profile
from pipetransformer.config import Config, ConfigError, World, initial_pipe_lens, resolve
from pipetransformer.data.checks import data_facts
from pipetransformer.freeze import check_freeze_config
from pipetransformer.models import ModelSpec, build_model

# What a GPU holds besides the tensors the memory model counts (its predictions are
# allocated bytes, what torch.cuda.max_memory_allocated reports):
# - the CUDA context and kernels' modules, and NCCL's default communicator: measured at
#   start on the device (total - free - what torch reserved); before that, an estimate;
CUDA_CONTEXT_BYTES = 1 << 30
# - NCCL's buffers of the communicators a rank builds during the run: its pipeline and data
#   groups of a layout, and the pair communicators of pipeline send/recv (rebuilt at every
#   transition, so a layout's are held while the next one's are built);
NCCL_COMMUNICATOR_BYTES = 128 << 20
NCCL_COMMUNICATORS_HELD = 6
# - the caching allocator's fragmentation: after a transition frees one layout's tensors
#   and allocates another's, reserved memory exceeds allocated memory (init_distributed
#   sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which keeps this small).
FRAGMENTATION_ALLOWANCE = 0.05

# (pipe_len, replica batch) -> the number of micro-batches of that layout.
MicroBatchChooser = Callable[[int, int], int]


# ----------------------------------------------------------------------------- the model


def model_build_args(config: Config) -> dict[str, Any]:
    """What build_model needs to know about the data (task, classes, input shapes)."""
    facts = data_facts(config.data)
    return dict(
        task=facts.task,
        num_classes=facts.num_classes,
        in_chans=facts.in_chans,
        image_size=facts.image_size,
        vocab_size=facts.vocab_size,
        max_seq_length=facts.max_seq_length,
    )


def describe_model(config: Config, **overrides: Any) -> ModelSpec:
    """The model's spec, built on the meta device. Raises ConfigError for a bad model."""
    args = {**model_build_args(config), **overrides}
    try:
        spec = build_model(config.model, device="meta", **args).spec
    except (ValueError, TypeError, OSError) as exc:
        message = str(exc)
        if message.startswith("model."):
            raise ConfigError(message) from exc
        raise ConfigError(f"model: cannot build '{config.model.name}': {message}") from exc
    check_freeze_config(config.freeze, spec.num_layers)
    return spec


# ----------------------------------------------------------------------------- memory


def device_memory_budget(config: Config, device: torch.device | str) -> float | None:
    """pipeline.device_memory_bytes; else what a CUDA device leaves the memory model's
    tensors (`usable_device_bytes`, with its context measured); on the CPU None
    (unlimited)."""
    if config.pipeline.device_memory_bytes is not None:
        return float(config.pipeline.device_memory_bytes)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        context = total - free - torch.cuda.memory_reserved(device)
        return usable_device_bytes(total, context_bytes=context)
    return None


def usable_device_bytes(total_bytes: float, context_bytes: float | None = None) -> float:
    """What a GPU of `total_bytes` leaves for the tensors the memory model counts (allocated
    bytes): less the CUDA context (`context_bytes`, measured; else CUDA_CONTEXT_BYTES) and
    NCCL's communicators, and divided by the allocator's fragmentation allowance."""
    context = CUDA_CONTEXT_BYTES if context_bytes is None else context_bytes
    nccl = NCCL_COMMUNICATORS_HELD * NCCL_COMMUNICATOR_BYTES
    return max(0.0, float(total_bytes - context - nccl) / (1 + FRAGMENTATION_ALLOWANCE))


def memory_model(
    config: Config, spec: ModelSpec, profile: UnitProfile | None = None
) -> MemoryModel:
    """From the measured unit profile; without one, from parameter counts alone (float32
    parameters, activations unknown: counted as zero)."""
    optimizer = config.optimizer
    if profile is not None:
        return MemoryModel.from_profile(profile, optimizer.name, optimizer.momentum)
    params = tuple(4 * c for c in spec.unit_param_counts)
    zeros = tuple(0 for _ in params)
    factor = optimizer_state_factor(optimizer.name, optimizer.momentum)
    return MemoryModel(params, zeros, zeros, 1, factor)


def format_bytes(count: float) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- micro-batches


def choose_num_micro_batches(setting: int | str, pipe_len: int, replica_batch: int) -> int:
    """A configured M, or for 'auto' without measurements the smallest divisor >= pipe_len."""
    if isinstance(setting, int):
        return setting
    for m in range(pipe_len, replica_batch + 1):
        if replica_batch % m == 0:
            return m
    return replica_batch


def profiling_micro_batch_size(config: Config, world_size: int | None = None) -> int:
    """The micro-batch size unit costs are measured (and looked up) at: that of the initial
    layout, with 'auto' resolved by the measurement-free rule (smallest divisor >= K),
    because the measured choice of M itself needs the plan these costs produce."""
    world = world_size or config.nproc_per_node
    pipe_len = config.pipeline.initial_pipe_len
    if pipe_len == "auto":  # before the start is chosen: the shortest pipeline's (the costs
        pipe_len = min(initial_pipe_lens(config, world))  # of other sizes scale from it)
    dp_degree = dp_degree_for(pipe_len, world, world // pipe_len, config.autodp.enabled)
    replica_batch = config.trainer.global_batch_size // dp_degree
    return replica_batch // choose_num_micro_batches(
        config.pipeline.num_micro_batches, pipe_len, replica_batch
    )


def _layout_shape(
    config: Config, pipe_len: int, world_size: int, initial_pipe_len: int
) -> LayoutShape:
    """Micro-batch size, micro-batch count (the measurement-free rule: for GPipe the total
    activation bytes do not depend on it), replicas and schedule of a layout with `pipe_len`."""
    dp = dp_degree_for(pipe_len, world_size, world_size // initial_pipe_len, config.autodp.enabled)
    replica_batch = config.trainer.global_batch_size // dp
    m = choose_num_micro_batches(config.pipeline.num_micro_batches, pipe_len, replica_batch)
    return LayoutShape(replica_batch // m, m, dp, config.pipeline.schedule)


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
        shape = _layout_shape(config, pipe_len, world_size, pipe_len)
        peaks[pipe_len] = max(memory.peak_bytes(plan, shape))
        if budget is None or peaks[pipe_len] <= budget:
            return pipe_len
    described = ", ".join(f"K={k}: {format_bytes(v)}" for k, v in peaks.items())
    raise ConfigError(
        f"pipeline.initial_pipe_len: auto: no pipeline fits pipeline.device_memory_bytes "
        f"({format_bytes(budget)} per device); largest stage at {described}; use more devices per "
        "node, a smaller trainer.global_batch_size, or trainer.precision=bf16"
    )


# ----------------------------------------------------------------------------- the context


@dataclass(frozen=True)
class PlanContext:
    """Everything a run's layouts are planned from (see the module docstring)."""

    config: Config  # resolved: initial_pipe_len is a number
    spec: ModelSpec
    world: World
    costs: UnitCosts
    memory: MemoryModel
    memory_source: str  # 'profile' (measured activations) or 'params' (none known)
    budget_bytes: float | None  # one device's memory for stages; None: unlimited
    planner: AutoPipePlanner

    @classmethod
    def build(
        cls,
        config: Config,
        spec: ModelSpec,
        world: World,
        profile: UnitProfile | None = None,
        budget_bytes: float | None = None,
    ) -> PlanContext:
        """`profile`: the model's measured (or analytical) unit profile, None when there is
        none; stages are balanced on its times under `pipeline.balance: time`."""
        config = resolve(config, world)  # K may still be 'auto': it is chosen below
        measured = profile is not None and config.pipeline.balance == "time"
        costs = (
            unit_costs_from_profile(profile)
            if measured
            else UnitCosts.from_param_counts(spec.unit_param_counts, config.autopipe.lambda_frozen)
        )
        if costs.num_units != spec.num_units:
            raise ValueError(f"{costs.num_units} unit costs for a model of {spec.num_units} units")
        memory = memory_model(config, spec, profile)
        initial = choose_initial_pipe_len(config, costs, memory, budget_bytes, world.world_size)
        config = resolve(config, world, initial_pipe_len=initial)
        fits = None
        if budget_bytes is not None:

            def fits(plan: PipelinePlan) -> bool:
                shape = _layout_shape(config, plan.pipe_len, world.world_size, initial)
                return memory.fits(plan, shape, budget_bytes)

        planner = AutoPipePlanner(costs, initial, config.autopipe.partition_method, fits)
        source = "profile" if profile is not None else "params"
        return cls(config, spec, world, costs, memory, source, budget_bytes, planner)

    @property
    def initial_pipe_len(self) -> int:
        return self.planner.initial_pipe_len

    def layout_for(
        self,
        num_frozen_layers: int,
        current_pipe_len: int,
        micro_batches: MicroBatchChooser | None = None,
        prefix_cost: float | None = None,
        moving_from: Layout | None = None,
    ) -> Layout:
        """The layout a run moves to when `num_frozen_layers` layers are frozen, from a
        pipeline of `current_pipe_len` (K only halves). `micro_batches` chooses M (default:
        the configured number, or the measurement-free rule for 'auto'); `prefix_cost`: the
        frozen prefix's cost on stage 0 when AutoCache serves it; `moving_from`: the layout
        the run is in, whose units move (with a memory budget, a compression is taken only
        when the move fits too)."""
        config = self.config
        if config.autopipe.enabled:
            fits = self.planner.fits
            if fits is not None and moving_from is not None:
                fits = self._fits_with_move(fits, moving_from)
            plan = self.planner.plan(num_frozen_layers, current_pipe_len, prefix_cost, fits)
        else:
            plan = fixed_plan(self.costs, self.planner.initial, num_frozen_layers)
        layout = self._layout(plan)
        replica_batch = config.trainer.global_batch_size // layout.dp_degree
        if micro_batches is None:
            m = choose_num_micro_batches(
                config.pipeline.num_micro_batches, plan.pipe_len, replica_batch
            )
        else:
            m = micro_batches(plan.pipe_len, replica_batch)
        return layout.with_micro_batches(m)

    def _fits_with_move(
        self, steady: Callable[[PipelinePlan], bool], current: Layout
    ) -> Callable[[PipelinePlan], bool]:
        """`steady`, and the move from `current` to the plan within the budget too."""

        def fits(plan: PipelinePlan) -> bool:
            moved = self.move_bytes(current, self._layout(plan))
            return steady(plan) and max(moved) <= self.budget_bytes

        return fits

    def _layout(self, plan: PipelinePlan) -> Layout:
        """`plan` placed on this run's world, with the replicas AutoDP gives it."""
        world = self.world
        initial_dp = world.world_size // self.initial_pipe_len
        dp_degree = dp_degree_for(
            plan.pipe_len, world.world_size, initial_dp, self.config.autodp.enabled
        )
        return Layout(plan, world.world_size, world.devices_per_node, dp_degree)

    def move_bytes(
        self, old: Layout, new: Layout, transfers: list[Transfer] | None = None
    ) -> list[float]:
        """The memory model's peak bytes of each rank while units move from `old` to `new`
        (MemoryModel.move_bytes: no activations, both layouts' weights for a while).
        `transfers`: plan_transfers(old, new) when the caller has it already."""
        if transfers is None:
            transfers = plan_transfers(old, new)
        peaks = []
        for rank in range(old.world_size):
            held = old.units_of_rank(rank)
            trained = [u for u in held if u >= old.plan.frozen_end]
            keep = new.units_of_rank(rank)
            peaks.append(self.memory.move_bytes(transfers, rank, held, trained, keep))
        return peaks

    def stage_bytes(self, plan: PipelinePlan) -> list[float]:
        """The memory model's peak bytes of each stage of `plan` in this run."""
        shape = _layout_shape(
            self.config, plan.pipe_len, self.world.world_size, self.initial_pipe_len
        )
        return self.memory.peak_bytes(plan, shape)

    def with_pipeline(self, initial_pipe_len: int) -> PlanContext:
        """The same run started at another fixed pipeline length, with no memory limit on
        compression: what Pipe+DDP and DDP baselines plan."""
        pipeline = dataclasses.replace(self.config.pipeline, initial_pipe_len=initial_pipe_len)
        config = dataclasses.replace(self.config, pipeline=pipeline)
        planner = AutoPipePlanner(self.costs, initial_pipe_len, config.autopipe.partition_method)
        return dataclasses.replace(self, config=config, planner=planner)
