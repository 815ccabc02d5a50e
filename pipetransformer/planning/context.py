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

With `pipeline.sharding: always` every layout is sharded (FSDP2, fsdp/): one stage on every
process, the trained units sharded over them, the replica batch in the fewest micro-batches
that fit the budget; a run whose sharded layout does not fit it even at one sample a
micro-batch, at 0 frozen layers, is refused (`DoesNotFit`). With `auto` (the default) a
boundary gets the sharded layout instead of AutoPipe's pipeline where only it fits the
device, or where it fits too and a `pricer` (planning/cluster.py's step model over the
run's measured unit times and collectives; the trainer has one on GPUs) predicts it faster
a sample.

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
from pipetransformer.config import (
    TEXT_DATASETS,
    Config,
    ConfigError,
    World,
    initial_pipe_lens,
    resolve,
    smallest_micro_batches,
    virtual_stages_for,
    virtual_stages_problem,
)
from pipetransformer.data.checks import data_facts
from pipetransformer.freeze import check_freeze_config
from pipetransformer.models import ModelSpec, build_model
from pipetransformer.utils.padding import bucket_buffer_share, packed_buffer_share
from pipetransformer.utils.units import prefix_end

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
#   and allocates another's, reserved memory exceeds allocated memory (expandable
#   segments, set before CUDA initialises: utils/allocator.py, keep this small).
FRAGMENTATION_ALLOWANCE = 0.05


class DoesNotFit(ConfigError):
    """A run refused at start because its first layout cannot fit the device budget, even
    sharded (compare reports such a peer as refused and goes on)."""


# (pipe_len, replica batch) -> the number of micro-batches of that layout.
MicroBatchChooser = Callable[[int, int], int]
# (layout, the frozen prefix's seconds a micro-batch of the profile's size, None: computed
# in full) -> predicted seconds of one step of it (planning/cluster.py `step_pricer`).
StepPricer = Callable[[Layout, float | None], float]


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


def parameter_sizes(config: Config, spec: ModelSpec) -> UnitCosts:
    """What the compression criterion compares (Eq. 2): each unit's parameter count, a
    frozen one at autopipe.lambda_frozen of it."""
    return UnitCosts.from_param_counts(spec.unit_param_counts, config.autopipe.lambda_frozen)


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
    sums = config.freeze.strategy == "autofreeze"  # its gradient sums (trainer/step.py)
    checkpointing = config.trainer.activation_checkpointing
    reshard = config.pipeline.fsdp_reshard_after_forward
    if profile is not None:
        return MemoryModel.from_profile(
            profile, optimizer.name, optimizer.momentum, sums, checkpointing, reshard
        )
    params = tuple(4 * c for c in spec.unit_param_counts)
    zeros = tuple(0 for _ in params)
    factor = optimizer_state_factor(optimizer.name, optimizer.momentum)
    sums_factor = 1.0 if sums else 0.0
    return MemoryModel(params, zeros, zeros, 1, factor, sums_factor, checkpointing, reshard)


def format_bytes(count: float) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- micro-batches


def choose_num_micro_batches(
    setting: int | str, pipe_len: int, replica_batch: int, schedule: str = "gpipe"
) -> int:
    """A configured M; for 'auto' (and 'measured' before any measurement) the smallest
    divisor of the replica batch >= pipe_len that `schedule` runs (torch's rule,
    config/schedules.py): 1 for plain DDP, and for a pipeline the fewest micro-batches that
    keep every stage busy in the steady state."""
    if isinstance(setting, int):
        return setting
    m = smallest_micro_batches(schedule, pipe_len, replica_batch)
    return replica_batch if m is None else m


def profiling_micro_batch_size(config: Config, world_size: int | None = None) -> int:
    """The micro-batch size unit costs are measured (and looked up) at: that of the initial
    layout, with 'auto' resolved by the measurement-free rule (smallest divisor >= K),
    because the measured choice of M itself needs the plan these costs produce."""
    world = world_size or config.nproc_per_node
    pipe_len = config.pipeline.initial_pipe_len
    if pipe_len == "auto":  # before the start is chosen: the shortest pipeline's (the costs
        pipe_len = min(initial_pipe_lens(config, world))  # of other sizes scale from it)
    dp_degree = dp_degree_for(pipe_len, world, world // pipe_len, config.autodp.enabled)
    replica_batch = config.trainer.replica_batch_size(dp_degree)
    return replica_batch // choose_num_micro_batches(
        config.pipeline.num_micro_batches, pipe_len, replica_batch, config.pipeline.schedule
    )


def _layout_shape(
    config: Config, pipe_len: int, world_size: int, initial_pipe_len: int
) -> LayoutShape:
    """Micro-batch size, micro-batch count (the measurement-free rule: for GPipe the total
    activation bytes do not depend on it), replicas and schedule of a layout with `pipe_len`."""
    dp = dp_degree_for(pipe_len, world_size, world_size // initial_pipe_len, config.autodp.enabled)
    replica_batch = config.trainer.replica_batch_size(dp)
    pipeline = config.pipeline
    m = choose_num_micro_batches(
        pipeline.num_micro_batches, pipe_len, replica_batch, pipeline.schedule
    )
    micro = replica_batch // m
    return LayoutShape(micro, m, dp, pipeline.schedule, receive_buffer_share(config, micro))


def receive_buffer_share(config: Config, micro_batch_size: int = 1) -> float:
    """A pipeline stage's receive buffers over the max-length ones: text padded per batch
    keeps a set for each length bucket, packed text one for each shape (rows and their
    length in buckets, micro-batches of `micro_batch_size` samples: pipe/runtime.py), auto
    both; 1 otherwise (utils/padding.py gives the bounds)."""
    data = config.data
    if data.name not in TEXT_DATASETS or data.padding == "max_length":
        return 1.0
    buckets = bucket_buffer_share(data.pad_to_multiple_of, data.max_seq_length)
    packed = packed_buffer_share(data.pad_to_multiple_of, data.max_seq_length, micro_batch_size)
    # auto: a step is padded or packed, so a stage of either kind may be built.
    return {"batch": buckets, "packed": packed, "auto": buckets + packed}[data.padding]


def sharded_shape(config: Config, world_size: int, num_micro_batches: int = 1) -> LayoutShape:
    """A sharded layout's shape: every process a replica, its batch in micro-batches."""
    replica_batch = config.trainer.replica_batch_size(world_size)
    micro = replica_batch // num_micro_batches
    return LayoutShape(micro, num_micro_batches, world_size, config.pipeline.schedule)


def sharded_micro_batches(
    config: Config, memory: MemoryModel, plan: PipelinePlan, budget: float | None, world_size: int
) -> int | None:
    """The fewest micro-batches (dividing the replica batch) a sharded layout of `plan`
    fits `budget` with: gradient accumulation is how an FSDP2 user fits a batch, and more
    micro-batches only cost time there (every one gathers and reduce-scatters the trained
    layers again). None: not even one sample a micro-batch fits."""
    replica_batch = config.trainer.replica_batch_size(world_size)
    for m in (d for d in range(1, replica_batch + 1) if replica_batch % d == 0):
        shape = sharded_shape(config, world_size, m)
        if budget is None or memory.sharded_memory(plan, shape).total <= budget:
            return m
    return None


def _require_sharded_fit(
    config: Config, costs: UnitCosts, memory: MemoryModel, budget: float, world_size: int
) -> None:
    plan = balance(
        costs, 0, 1, config.autopipe.partition_method, frozen_embedding=config.embedding_frozen
    )
    if sharded_micro_batches(config, memory, plan, budget, world_size) is None:
        replica_batch = config.trainer.replica_batch_size(world_size)
        shape = sharded_shape(config, world_size, replica_batch)
        need = memory.sharded_memory(plan, shape).total
        raise DoesNotFit(
            f"pipeline.sharding: always: does not fit even sharded over {world_size} "
            f"processes: {format_bytes(need)} a process at 0 frozen layers with one sample a "
            f"micro-batch, pipeline.device_memory_bytes allows {format_bytes(budget)}"
        )


def _require_configured_fit(
    config: Config, costs: UnitCosts, memory: MemoryModel, world_size: int
) -> None:
    """A pipeline length given outright (sharding 'never') under a declared
    pipeline.device_memory_bytes whose first layout is predicted not to fit is refused
    (DoesNotFit), not run: on a GPU it would run out of memory, and a comparison that ran it
    on the CPU would compare against a layout its user could not have (a peer that does not
    fit is refused, never run slowly)."""
    budget = config.pipeline.device_memory_bytes
    if budget is None or config.pipeline.sharding != "never":
        return
    pipe_len = config.pipeline.initial_pipe_len
    plan = balance(
        costs,
        0,
        pipe_len,
        config.autopipe.partition_method,
        frozen_embedding=config.embedding_frozen,
        virtual_stages=_initial_virtual_stages(config, costs, pipe_len),
    )
    need = max(memory.peak_bytes(plan, _layout_shape(config, pipe_len, world_size, pipe_len)))
    if need > budget:
        remedies = "more stages, pipeline.initial_pipe_len=auto, pipeline.sharding=auto"
        if not config.trainer.activation_checkpointing:
            remedies += " or trainer.activation_checkpointing=true"
        raise DoesNotFit(
            f"pipeline.initial_pipe_len: {pipe_len} stage(s) do not fit: the largest is "
            f"predicted at {format_bytes(need)} a process at 0 frozen layers, "
            f"pipeline.device_memory_bytes allows {format_bytes(budget)}; use {remedies}"
        )


def _initial_virtual_stages(config: Config, costs: UnitCosts, pipe_len: int) -> int:
    """The chunks a stage of a run starting at `pipe_len` holds, at 0 frozen layers."""
    pipeline = config.pipeline
    active = costs.num_units - prefix_end(0, config.embedding_frozen)
    return virtual_stages_for(pipeline.schedule, pipeline.virtual_stages, pipe_len, active)


def check_virtual_stages(config: Config, num_units: int, pipe_len: int) -> None:
    """A configured pipeline.virtual_stages must fit the active units at the start (later
    layouts fall back to fewer chunks): ConfigError naming the key."""
    pipeline = config.pipeline
    active = num_units - prefix_end(0, config.embedding_frozen)
    problem = virtual_stages_problem(pipeline.schedule, pipeline.virtual_stages, pipe_len, active)
    if problem:
        raise ConfigError(f"pipeline.virtual_stages: {problem} ({pipeline.schedule})")


def choose_initial_pipe_len(
    config: Config, costs: UnitCosts, memory: MemoryModel, budget: float | None, world_size: int
) -> int:
    """The configured K, or for 'auto' the shortest candidate whose stages fit `budget`.
    Raises ConfigError naming the key when none fits, unless a sharded layout may be taken
    (pipeline.sharding 'auto') and fits: then the longest candidate, the pipeline the run
    would pack from once freezing shrinks it."""
    candidates = initial_pipe_lens(config, world_size)
    if isinstance(config.pipeline.initial_pipe_len, int) or config.pipeline.sharding == "always":
        return candidates[0]  # a sharded start's fit is checked sharded (DoesNotFit)
    peaks = {}
    for pipe_len in candidates:
        plan = balance(
            costs,
            0,
            pipe_len,
            config.autopipe.partition_method,
            frozen_embedding=config.embedding_frozen,
            virtual_stages=_initial_virtual_stages(config, costs, pipe_len),
        )
        shape = _layout_shape(config, pipe_len, world_size, pipe_len)
        peaks[pipe_len] = max(memory.peak_bytes(plan, shape))
        if budget is None or peaks[pipe_len] <= budget:
            return pipe_len
    if PlanContext.prices(config):
        plan = balance(
            costs, 0, 1, config.autopipe.partition_method, frozen_embedding=config.embedding_frozen
        )
        if sharded_micro_batches(config, memory, plan, budget, world_size) is not None:
            return candidates[-1]
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
    # Prices layouts for pipeline.sharding 'auto'; None: no sharded layout is taken.
    pricer: StepPricer | None = None

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
        check_virtual_stages(config, costs.num_units, initial)
        _require_configured_fit(config, costs, memory, world.world_size)
        if config.pipeline.sharding == "always" and budget_bytes is not None:
            _require_sharded_fit(config, costs, memory, budget_bytes, world.world_size)
        fits = None
        if budget_bytes is not None:

            def fits(plan: PipelinePlan) -> bool:
                shape = _layout_shape(config, plan.pipe_len, world.world_size, initial)
                return memory.fits(plan, shape, budget_bytes)

        peak_bytes = None
        if config.autopipe.compression == "memory":

            def peak_bytes(plan: PipelinePlan) -> float:
                shape = _layout_shape(config, plan.pipe_len, world.world_size, initial)
                return max(memory.peak_bytes(plan, shape))

        planner = AutoPipePlanner(
            costs,
            initial,
            config.autopipe.partition_method,
            fits,
            parameter_sizes(config, spec),
            frozen_embedding=config.embedding_frozen,
            schedule=config.pipeline.schedule,
            virtual_stages=config.pipeline.virtual_stages,
            peak_bytes=peak_bytes,
        )
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
        if config.pipeline.sharding == "always":
            return self._sharded_layout(num_frozen_layers, prefix_cost)
        if moving_from is not None and moving_from.sharded:
            # Out of a sharded layout: the pipeline AutoPipe would hold at this boundary.
            current_pipe_len = self.initial_pipe_len
        layout = self._pipeline_layout(
            num_frozen_layers, current_pipe_len, micro_batches, prefix_cost, moving_from
        )
        if self.prices_sharded_layouts:
            sharded = self._sharded_layout(num_frozen_layers, prefix_cost)
            if not self._fits(layout, moving_from) and self._fits(sharded, moving_from):
                return sharded  # only the sharded layout fits: no price needed
            if self.pricer is not None and self._faster_and_fits(
                sharded, layout, prefix_cost, moving_from
            ):
                return sharded
        return layout

    def _fits(self, layout: Layout, moving_from: Layout | None) -> bool:
        """`layout` fits the budget, and so does the move to it from `moving_from`."""
        budget = self.budget_bytes
        if budget is None:
            return True
        if max(self.layout_bytes(layout)) > budget:
            return False
        return moving_from is None or max(self.move_bytes(moving_from, layout)) <= budget

    def _faster_and_fits(
        self,
        sharded: Layout,
        pipeline: Layout,
        prefix_cost: float | None,
        moving_from: Layout | None,
    ) -> bool:
        """Whether `sharded` fits the budget (and the move to it does) and is predicted
        faster than `pipeline` at its best micro-batch count (of the [K, 6K] AutoPipe
        measures: the pipeline is given the benefit of the doubt), in seconds a sample: under
        trainer.batch_per_replica a step's batch grows with the replicas."""
        if not self._fits(sharded, moving_from):
            return False
        prefix_s = prefix_cost if self.costs.source == "time" else None
        trainer = self.config.trainer
        replica_batch = trainer.replica_batch_size(pipeline.dp_degree)
        k, setting = pipeline.pipe_len, self.config.pipeline.num_micro_batches
        counts = [m for m in range(k, 6 * k + 1) if replica_batch % m == 0]
        if setting != "measured" or not counts:  # 'auto' and an int: the plan's M
            counts = [pipeline.plan.num_micro_batches]
        pipeline_s = min(self.pricer(pipeline.with_micro_batches(m), prefix_s) for m in counts)
        sharded_s = self.pricer(sharded, prefix_s)
        return sharded_s / trainer.global_batch_size_at(sharded.dp_degree) < (
            pipeline_s / trainer.global_batch_size_at(pipeline.dp_degree)
        )

    def _pipeline_layout(
        self,
        num_frozen_layers: int,
        current_pipe_len: int,
        micro_batches: MicroBatchChooser | None,
        prefix_cost: float | None,
        moving_from: Layout | None,
    ) -> Layout:
        config = self.config
        if config.autopipe.enabled:
            fits = self.planner.fits
            if fits is not None and moving_from is not None:
                fits = self._fits_with_move(fits, moving_from)
            plan = self.planner.plan(num_frozen_layers, current_pipe_len, prefix_cost, fits)
        else:
            plan = fixed_plan(self.costs, self.planner.initial, num_frozen_layers)
        layout = self._layout(plan)
        replica_batch = config.trainer.replica_batch_size(layout.dp_degree)
        if micro_batches is None:
            m = choose_num_micro_batches(
                config.pipeline.num_micro_batches,
                plan.pipe_len,
                replica_batch,
                config.pipeline.schedule,
            )
        else:
            m = micro_batches(plan.pipe_len, replica_batch)
        return layout.with_micro_batches(m)

    def _sharded_layout(self, num_frozen_layers: int, prefix_cost: float | None) -> Layout:
        """One stage over every process (FSDP2), the replica batch in the configured number
        of micro-batches, or for 'auto' the fewest that fit the budget
        (`sharded_micro_batches`)."""
        plan = balance(
            self.costs,
            num_frozen_layers,
            1,
            self.config.autopipe.partition_method,
            prefix_cost,
            self.config.embedding_frozen,
        )
        world = self.world
        layout = Layout(plan, world.world_size, world.devices_per_node, world.world_size, True)
        setting = self.config.pipeline.num_micro_batches
        m = (
            setting  # 'auto' sharding takes the fewest that fit, not the pipeline's M
            if isinstance(setting, int) and self.config.pipeline.sharding == "always"
            else sharded_micro_batches(
                self.config, self.memory, plan, self.budget_bytes, world.world_size
            )
        )
        if m is None:  # the frozen prefix held in full does not fit: the most there are (the
            m = self.config.trainer.replica_batch_size(world.world_size)  # bytes say so)
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
        if old.sharded:  # every unit in full again but those staying sharded (fsdp/state.py)
            stays = new.plan.frozen_end if new.sharded else None
            peak = self.memory.sharded_move_bytes(old.plan, old.dp_degree, stays)
            return [peak] * old.world_size
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

    @property
    def prices_sharded_layouts(self) -> bool:
        return self.prices(self.config)

    @staticmethod
    def prices(config: Config) -> bool:
        """pipeline.sharding 'auto' with a fixed global batch, AutoPipe and AutoDP (under
        trainer.batch_per_replica a sharded layout, every process a replica, would multiply
        the batch a step trains): a sharded layout is then taken at a boundary where only it
        fits, or where a pricer predicts it faster than AutoPipe's pipeline."""
        return (
            config.pipeline.sharding == "auto"
            and config.trainer.batch_per_replica is None
            and config.autopipe.enabled  # the layout is AutoPipe's choice, with AutoDP's
            and config.autodp.enabled  # replicas
        )

    def with_pricer(self, pricer: StepPricer | None) -> PlanContext:
        """The same context pricing layouts with `pricer` (pipeline.sharding 'auto')."""
        return dataclasses.replace(self, pricer=pricer)

    def layout_bytes(self, layout: Layout) -> list[float]:
        """The memory model's peak bytes of each stage of `layout` (sharded or not)."""
        if layout.sharded:
            m = layout.plan.num_micro_batches
            shape = sharded_shape(self.config, self.world.world_size, m)
            return [self.memory.sharded_memory(layout.plan, shape).total]
        return self.stage_bytes(layout.plan)

    def with_pipeline(self, initial_pipe_len: int) -> PlanContext:
        """The same run started at another fixed pipeline length, with no memory limit on
        compression: what Pipe+DDP and DDP baselines plan."""
        pipeline = dataclasses.replace(self.config.pipeline, initial_pipe_len=initial_pipe_len)
        config = dataclasses.replace(self.config, pipeline=pipeline)
        planner = AutoPipePlanner(
            self.costs,
            initial_pipe_len,
            config.autopipe.partition_method,
            sizes=parameter_sizes(config, self.spec),
            frozen_embedding=config.embedding_frozen,
            schedule=config.pipeline.schedule,
            virtual_stages=config.pipeline.virtual_stages,
        )
        return dataclasses.replace(self, config=config, planner=planner)
