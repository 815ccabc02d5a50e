"""The cluster a prediction is for and what one step of a layout costs on it: nodes x
devices per node, the links between them and the device whose memory is the stage budget
(`Cluster`, from `plan --predict`'s flags in prediction_inputs.py or measured at a run's
start, `measured_cluster`); a unit profile's unit times (`unit_times`); the step model of
step_model.py applied to a planner's layout (`price_step`, `step_pricer`, `layout_epoch_s`).

The trainer prices sharded layouts against pipelines with `step_pricer` over a
`measured_cluster`; `plan --predict` replays whole runs with `price_step` (prediction_run.py).

Owns: `Cluster`, the stated link and cache-read defaults, `unit_times`, `price_step`.
Must not: choose layouts (context.py does) or replay a run (prediction_run.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.memory import shard_groups
from pipetransformer.autopipe.profiles import UnitProfile, unit_costs_from_profile
from pipetransformer.config import Config, World
from pipetransformer.planning.context import (
    PlanContext,
    StepPricer,
    describe_model,
    format_bytes,
    usable_device_bytes,
)
from pipetransformer.planning.hardware import Device
from pipetransformer.planning.step_model import (
    CollectiveCost,
    Links,
    StepPrediction,
    UnitTimes,
    predict_sharded_step,
    predict_step,
    prefix_work_s,
)

# Stated defaults of a GPU cluster: NVLink-class links inside a node, one 200 Gb/s
# InfiniBand / RoCE port per GPU between nodes.
INTRA_NODE_GBPS = 150.0
INTER_NODE_GBPS = 25.0
# A cache read moves the prefix's output from host shared memory: at this bandwidth.
CACHE_READ_GBPS = 10.0


@dataclass(frozen=True)
class Cluster:
    """Nodes x devices per node and the links between them; `device` (a row of
    hardware.yaml) when the devices are named: its memory is then the stage budget."""

    nodes: int
    devices_per_node: int
    links: Links
    device: Device | None = None
    intra_node_link: str | None = None  # names of hardware.yaml links, None when stated
    inter_node_link: str | None = None
    # FSDP2 hides collectives behind compute on a GPU (its own stream); gloo on a CPU does not.
    overlaps_collectives: bool = True

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def world(self) -> World:
        return World(self.world_size, self.devices_per_node, "cuda")

    def memory_budget(self, config: Config) -> float | None:
        """Bytes a stage may use: pipeline.device_memory_bytes when set, else the named
        device's memory less the CUDA reserve, else None (no limit)."""
        if config.pipeline.device_memory_bytes is not None:
            return float(config.pipeline.device_memory_bytes)
        return None if self.device is None else usable_device_bytes(self.device.memory_bytes)

    def memory_label(self, config: Config) -> str:
        """What the budget is, for a message: the device's name and the key that set it."""
        if self.device is None:
            return "pipeline.device_memory_bytes"
        if config.pipeline.device_memory_bytes is not None:
            return f"a {self.device.name} under pipeline.device_memory_bytes"
        return f"a {self.device.name} ({format_bytes(self.device.memory_bytes)})"


def unit_times(
    profile: UnitProfile,
    memory_bytes_per_s: float = 2e12,
    cache_read_s_per_sample: float | None = None,
) -> UnitTimes:
    """The step model's unit times of `profile`: its trained and frozen seconds a unit,
    output and parameter bytes; a cache read at CACHE_READ_GBPS unless stated."""
    costs = unit_costs_from_profile(profile)
    if cache_read_s_per_sample is None:
        # Reading the prefix's output back: its bytes at the stated bandwidth.
        cache_read_s_per_sample = (
            profile.output_bytes[0] / profile.micro_batch_size / (CACHE_READ_GBPS * 1e9)
        )
    return UnitTimes(
        costs.trained,
        costs.frozen,
        profile.output_bytes,
        profile.param_bytes,
        profile.micro_batch_size,
        cache_read_s_per_sample,
        memory_bytes_per_s,
    )


def price_step(
    times: UnitTimes,
    layout: Layout,
    config: Config,
    cluster: Cluster,
    prefix_s: float | None = None,
    cached: bool = False,
) -> StepPrediction:
    """The predicted step of `layout` of a run of `config` on `cluster`. `prefix_s`: stage
    0's frozen-prefix work (step_model.prefix_work_s); None: all read (`cached`) or all
    computed."""
    replica_batch = config.trainer.replica_batch_size(layout.dp_degree)
    if layout.sharded:
        plan = layout.plan
        if prefix_s is None:
            prefix_s = prefix_work_s(
                times, plan.prefix_end, {plan.prefix_end: 1.0} if cached else {}
            )
        return predict_sharded_step(
            times,
            plan,
            shard_groups(plan.frozen_end, len(times.param_bytes)),
            micro_batch_size=replica_batch // layout.plan.num_micro_batches,
            num_micro_batches=layout.plan.num_micro_batches,
            shards=layout.dp_degree,
            spans_nodes=layout.dp_degree > cluster.devices_per_node,
            links=cluster.links,
            prefix_s=prefix_s,
            overlap=cluster.overlaps_collectives,
        )
    m = layout.plan.num_micro_batches
    return predict_step(
        times,
        layout.plan,
        micro_batch_size=replica_batch // m,
        num_micro_batches=m,
        dp_degree=layout.dp_degree,
        replicas_per_node=layout.replicas_per_node,
        links=cluster.links,
        cached_prefix=cached,
        prefix_s=prefix_s,
        overlap=cluster.overlaps_collectives,
        schedule=config.pipeline.schedule,
    )


def step_pricer(times: UnitTimes, config: Config, cluster: Cluster) -> StepPricer:
    """Predicted seconds of a step of any layout of a run of `config` on `cluster` (what
    PlanContext compares a sharded layout with a pipeline by, pipeline.sharding 'auto')."""

    def price(layout: Layout, prefix_s: float | None) -> float:
        return price_step(times, layout, config, cluster, prefix_s).step_s

    return price


def measured_cluster(costs: dict, nodes: int, devices_per_node: int, device_type: str) -> Cluster:
    """The cluster a run measured at start (profiling/run_profiler.py `RunProfiler.links`): its
    all-reduce's line as the ring's link (2 (R - 1) / R of the bytes a rank sends), its
    all-gather and reduce-scatter as measured; collectives overlap compute on GPUs only."""
    world = nodes * devices_per_node
    latency, bytes_per_s = costs["all_reduce"]
    ring = 2 * (world - 1) / world if world > 1 else 1.0
    links = Links(
        bytes_per_s * ring,
        bytes_per_s * ring,
        latency_s=latency / max(1, 2 * (world - 1)),
        all_gather=CollectiveCost(*costs["all_gather"]),
        reduce_scatter=CollectiveCost(*costs["reduce_scatter"]),
    )
    return Cluster(nodes, devices_per_node, links, overlaps_collectives=device_type == "cuda")


def layout_epoch_s(
    config: Config,
    profile: UnitProfile,
    times: UnitTimes,
    links: Links,
    *,
    num_frozen_layers: int,
    pipe_len: int,
    num_micro_batches: int,
    steps: int,
    cached: bool,
    sharded: bool = False,
) -> float:
    """Predicted training seconds of an epoch of `steps` steps in one layout of a run of
    `config` on its own processes (its initial_pipe_len resolved), stages planned as the run
    plans them from `profile`; `times`: that profile's unit times with the overheads.
    `sharded`: the run's layout was sharded (FSDP2, pipeline.sharding: always). On this
    CPU's gloo no collective overlaps compute."""
    spec = describe_model(config)
    world = config.nproc_per_node
    if sharded != (config.pipeline.sharding == "always"):
        raise ValueError("sharded layouts come from pipeline.sharding: always")
    context = PlanContext.build(config, spec, World(world, world, "cpu"), profile)
    layout = context.layout_for(num_frozen_layers, pipe_len, lambda k, b: num_micro_batches)
    cluster = Cluster(1, world, links, overlaps_collectives=False)
    return steps * price_step(times, layout, context.config, cluster, cached=cached).step_s
