"""`pipetransformer plan --predict`: what a run of a config would take on a cluster, before
it spends GPU hours: per frozen boundary, the layout the planner would pick, its predicted
step time and the bytes of its largest stage; along a freeze trajectory, the whole run
against what users run instead (`compare --peers`' variants): Pipe+DDP, plain DDP and
freeze + DDP, each with whether it fits a device's memory.

Inputs: a unit profile (measured by a run of this model, or roofline times from its
analytical profile: prediction_inputs.py), the cluster (nodes x devices per node, link
bandwidths, optionally a named device whose memory is the budget). The arithmetic is
step_model.py's; this module only turns a config into its inputs. Evaluation, transitions
and start-up are left out of every side. prediction_report.py prints the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.planner import balance
from pipetransformer.autopipe.profiles import (
    ProfileStore,
    UnitProfile,
    UnitProfileKey,
    unit_costs_from_profile,
)
from pipetransformer.config import Config, ConfigError, World, initial_pipe_lens, resolve
from pipetransformer.freeze import DecisionSchedule
from pipetransformer.models import ModelSpec
from pipetransformer.planning.context import (
    PlanContext,
    describe_model,
    format_bytes,
    usable_device_bytes,
)
from pipetransformer.planning.hardware import Device
from pipetransformer.planning.profile_keys import model_signature_for
from pipetransformer.planning.step_model import (
    Links,
    StepPrediction,
    UnitTimes,
    calibrate_overhead,
    paper_trajectory,
    predict_step,
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


@dataclass(frozen=True)
class PredictedLayout:
    """One frozen boundary: the layout the planner picks and its predicted step."""

    num_frozen_layers: int
    pipe_len: int
    dp_degree: int
    num_micro_batches: int
    compute_s: float
    p2p_s: float
    allreduce_s: float
    optimizer_s: float
    overhead_s: float
    step_s: float
    bubble: float
    peak_bytes: float  # the memory model's largest stage


@dataclass(frozen=True)
class PeerPrediction:
    """One way to train the same model without the full system, as `compare --peers` runs
    it: its layout at 0 frozen layers, its run time along its own trajectory (None when it
    cannot run) and whether its largest stage fits the budget."""

    name: str  # 'baseline' (Pipe+DDP), 'ddp' or 'freeze_ddp', as compare names them
    pipe_len: int
    dp_degree: int
    num_micro_batches: int
    step_s: float | None  # at 0 frozen layers
    run_s: float | None
    peak_bytes: float | None
    fits: bool
    problem: str | None = None  # why it cannot run (a batch that does not split), if so


@dataclass(frozen=True)
class Prediction:
    """What `plan --predict` prints (`--json`: `to_dict`)."""

    nodes: int
    devices_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    profile_micro_batch_size: int
    steps_per_epoch: int
    rows: list[PredictedLayout]
    trajectory: list[int]  # F in effect at the start of each epoch
    baseline: PeerPrediction  # Pipe+DDP
    baseline_s: float
    elastic_s: float
    peers: list[PeerPrediction]  # DDP and freeze + DDP
    device: str | None = None
    device_memory_bytes: float | None = None  # the stage budget, None: no limit
    intra_node_link: str | None = None
    inter_node_link: str | None = None
    unit_profile_source: str = ""
    steps_per_epoch_source: str = ""

    @property
    def speedup(self) -> float:
        return self.baseline_s / self.elastic_s

    def speedup_over(self, peer: PeerPrediction) -> float | None:
        """The full system's speedup over `peer`; None when the peer cannot run or fit."""
        if peer.run_s is None or not peer.fits:
            return None
        return peer.run_s / self.elastic_s

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        cluster = {
            key: data.pop(key)
            for key in (
                "nodes",
                "devices_per_node",
                "device",
                "device_memory_bytes",
                "intra_node_link",
                "intra_node_gbps",
                "inter_node_link",
                "inter_node_gbps",
            )
        }
        for entry, peer in zip([data["baseline"], *data["peers"]], [self.baseline, *self.peers]):
            entry["speedup"] = self.speedup_over(peer)
        return {"cluster": cluster, **data, "speedup": self.speedup}


def find_unit_profile(
    config: Config, path: Path
) -> tuple[UnitProfile, UnitProfileKey, ProfileStore]:
    """This model's unit profile from a profile file: (profile, its key, the file's store).
    Prefers the largest micro-batch measured on a GPU, else any device."""
    spec = describe_model(config)
    signature = model_signature_for(config, spec)
    store = ProfileStore(path).load()
    keys = [k for k in store.unit_profile_keys() if k.model == signature]
    if not keys:
        raise ConfigError(
            f"--profile: {path} has no unit profile of this model ({config.model.name}); "
            "a run of this config writes one (RUN_DIR/profiles.json)"
        )
    keys.sort(key=lambda k: (k.device.startswith("cuda"), k.micro_batch_size))
    return store.unit_profile(keys[-1]), keys[-1], store


def unit_times(
    profile: UnitProfile,
    memory_bytes_per_s: float = 2e12,
    cache_read_s_per_sample: float | None = None,
) -> UnitTimes:
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


def calibrated_times(
    config: Config, store: ProfileStore, profile_key: UnitProfileKey, times: UnitTimes, links: Links
) -> UnitTimes:
    """`times` with the per-step and per-slot overhead calibrated from the whole steps the
    trainer timed for this model on the profile's device (micro-batch timings: forward and
    backward of the initial layout, nothing frozen)."""
    costs = unit_costs_from_profile(store.unit_profile(profile_key))
    gaps = []
    for key in store.micro_batch_keys():
        if (key.model, key.device) != (
            profile_key.model,
            profile_key.device,
        ) or key.num_frozen_layers is not None:
            continue
        plan = balance(costs, 0, key.pipe_len)
        replicas = max(1, config.trainer.global_batch_size // key.replica_batch)
        for m, seconds in store.micro_batch_timings(key).items():
            step = predict_step(
                times,
                plan,
                micro_batch_size=key.replica_batch // m,
                num_micro_batches=m,
                dp_degree=replicas,
                replicas_per_node=replicas,
                links=links,
                cached_prefix=False,
            )
            gaps.append((m + key.pipe_len - 1, seconds - (step.step_s - step.overhead_s)))
    per_step, per_slot = calibrate_overhead(gaps)
    return dataclasses.replace(times, step_overhead_s=per_step, slot_overhead_s=per_slot)


def frozen_per_step(
    config: Config, trajectory: str, num_layers: int, steps_per_epoch: int
) -> list[int]:
    """F during each step of the run. `trajectory`: 'auto' (the config's own: a manual
    schedule, or the paper's closed form with the config's alpha for gradient_norm and
    alpha_schedule — the fastest pace Eq. 1 allows — at the config's decision points; for
    convergence the same, one decision later: its first decision only measures),
    'paper' (the closed form at every epoch end, as the paper ran it) or F per epoch as a
    comma-separated list (the last value repeats)."""
    epochs = config.trainer.epochs
    total = epochs * steps_per_epoch
    freeze = config.freeze
    if trajectory not in ("auto", "paper"):
        try:
            values = [int(v) for v in trajectory.split(",")]
        except ValueError:
            raise ConfigError(
                f"--trajectory: 'auto', 'paper' or F per epoch such as 0,0,2,4; got {trajectory!r}"
            ) from None
        per_epoch = [values[min(e, len(values) - 1)] for e in range(epochs)]
        return [min(per_epoch[s // steps_per_epoch], num_layers - 1) for s in range(total)]
    fastest = paper_trajectory(num_layers, freeze.alpha, total, freeze.max_frozen_layers)
    if trajectory == "paper" or freeze.strategy in ("gradient_norm", "alpha_schedule"):
        decisions = fastest
    elif freeze.strategy == "convergence":
        decisions = [0, *fastest]
    elif freeze.strategy == "manual":
        decisions = freeze.manual_schedule
    else:
        return [0] * total
    cadence = (
        freeze
        if trajectory == "auto"
        else dataclasses.replace(freeze, interval_steps=None, warmup_epochs=0)
    )
    schedule = DecisionSchedule.for_config(cadence, epochs, steps_per_epoch)
    frozen, current, taken, since = [], 0, 0, 0
    for step in range(1, total + 1):
        frozen.append(current)
        since += 1
        if schedule.due(step, step % steps_per_epoch == 0, since):
            current = max(current, decisions[min(taken, len(decisions) - 1)])
            taken, since = taken + 1, 0
    return frozen


def predict(
    config: Config,
    profile: UnitProfile,
    cluster: Cluster,
    steps_per_epoch: int,
    trajectory: str = "auto",
    times: UnitTimes | None = None,
    *,
    unit_profile_source: str = "",
    steps_per_epoch_source: str = "",
) -> Prediction:
    """Layouts per frozen boundary and the run's predicted time against Pipe+DDP, DDP and
    freeze + DDP. `times`: the profile's unit times with the device's memory bandwidth and
    step overhead (default: a GPU's bandwidth, no overhead). The stage budget is
    `cluster.memory_budget`: the planner compresses only into layouts that fit it, and a run
    that fits no pipeline at 0 frozen layers is a ConfigError naming the device."""
    spec = describe_model(config)
    times = times or unit_times(profile)
    world = cluster.world()
    budget = cluster.memory_budget(config)
    if budget is not None:
        _require_a_start_that_fits(config, spec, world, profile, budget, cluster)
    context = PlanContext.build(config, spec, world, profile, budget)

    def peak(ctx: PlanContext, layout: Layout) -> float:
        return max(ctx.stage_bytes(layout.plan))

    rows, layouts = [], {}
    pipe_len = context.initial_pipe_len
    for frozen in range(spec.num_layers):
        layout = context.layout_for(frozen, pipe_len)
        pipe_len = layout.pipe_len
        layouts[frozen] = layout
        step = _step(times, layout, context.config, cluster, cached=frozen > 0)
        rows.append(_predicted(frozen, layout, step, peak(context, layout)))
    frozen = frozen_per_step(config, trajectory, spec.num_layers, steps_per_epoch)
    no_freezing = [0] * len(frozen)

    def elastic_step(value: int, cached: bool) -> float:
        if cached:
            return rows[value].step_s
        return _step(times, layouts[value], context.config, cluster, cached=False).step_s

    elastic_s = _run_s(frozen, steps_per_epoch, elastic_step)
    # The baseline: Pipe+DDP at the configured pipeline length, or a whole node's.
    setting = config.pipeline.initial_pipe_len
    fixed = setting if isinstance(setting, int) else cluster.devices_per_node
    base_context = context.with_pipeline(fixed)
    base_layout = base_context.layout_for(0, fixed)
    base_step = _step(times, base_layout, context.config, cluster, cached=False).step_s
    baseline = PeerPrediction(
        "baseline",
        base_layout.pipe_len,
        base_layout.dp_degree,
        base_layout.plan.num_micro_batches,
        base_step,
        base_step * len(frozen),
        peak(base_context, base_layout),
        budget is None or peak(base_context, base_layout) <= budget,
    )
    peers = [
        _ddp_peer("ddp", no_freezing, config, context, cluster, times, steps_per_epoch, budget),
        _ddp_peer("freeze_ddp", frozen, config, context, cluster, times, steps_per_epoch, budget),
    ]
    links = cluster.links
    return Prediction(
        nodes=cluster.nodes,
        devices_per_node=cluster.devices_per_node,
        intra_node_gbps=links.intra_node_bytes_per_s / 1e9,
        inter_node_gbps=links.inter_node_bytes_per_s / 1e9,
        profile_micro_batch_size=profile.micro_batch_size,
        steps_per_epoch=steps_per_epoch,
        rows=rows,
        trajectory=[frozen[e * steps_per_epoch] for e in range(config.trainer.epochs)],
        baseline=baseline,
        baseline_s=baseline.run_s,
        elastic_s=elastic_s,
        peers=peers,
        device=cluster.device.name if cluster.device else None,
        device_memory_bytes=budget,
        intra_node_link=cluster.intra_node_link,
        inter_node_link=cluster.inter_node_link,
        unit_profile_source=unit_profile_source,
        steps_per_epoch_source=steps_per_epoch_source,
    )


def _run_s(frozen: list[int], steps_per_epoch: int, step_s: Callable[[int, bool], float]) -> float:
    """Seconds of a run with F = frozen[step] at each step; `step_s(F, cached)`. A boundary's
    first epoch computes the frozen prefix (filling the cache); later epochs read it."""
    seconds: dict[tuple[int, bool], float] = {}
    total = 0.0
    for step, value in enumerate(frozen):
        first_epoch = step < steps_per_epoch or frozen[step - steps_per_epoch] != value
        key = (value, value > 0 and not first_epoch)
        if key not in seconds:
            seconds[key] = step_s(*key)
        total += seconds[key]
    return total


def _ddp_peer(
    name: str,
    frozen: list[int],
    config: Config,
    context: PlanContext,
    cluster: Cluster,
    times: UnitTimes,
    steps_per_epoch: int,
    budget: float | None,
) -> PeerPrediction:
    """DDP over every device (pipe_len 1) along `frozen` (all 0: plain DDP; the run's
    trajectory: freeze + DDP, the frozen prefix cached as the full system caches it)."""
    world = cluster.world()
    peer = dataclasses.replace(
        config, pipeline=dataclasses.replace(config.pipeline, initial_pipe_len=1)
    )
    if not any(frozen):
        peer = dataclasses.replace(peer, freeze=dataclasses.replace(peer.freeze, strategy="none"))
    try:
        resolve(peer, world)  # the checks a run of it would meet (a batch that must split)
    except ConfigError as exc:
        m = config.pipeline.num_micro_batches
        return PeerPrediction(
            name,
            pipe_len=1,
            dp_degree=world.world_size,
            num_micro_batches=m if isinstance(m, int) else 1,
            step_s=None,
            run_s=None,
            peak_bytes=None,
            fits=False,
            problem=str(exc),
        )
    ddp = context.with_pipeline(1)
    layout = ddp.layout_for(0, 1)
    peak_bytes = max(ddp.stage_bytes(layout.plan))

    def step_s(value: int, cached: bool) -> float:
        return _step(times, ddp.layout_for(value, 1), ddp.config, cluster, cached).step_s

    return PeerPrediction(
        name,
        layout.pipe_len,
        layout.dp_degree,
        layout.plan.num_micro_batches,
        step_s(0, False),
        _run_s(frozen, steps_per_epoch, step_s),
        peak_bytes,
        budget is None or peak_bytes <= budget,
    )


def _require_a_start_that_fits(
    config: Config,
    spec: ModelSpec,
    world: World,
    profile: UnitProfile,
    budget: float,
    cluster: Cluster,
) -> None:
    """A ConfigError naming the device and the need when no pipeline length the run may
    start at fits `budget` with nothing frozen."""
    unlimited = PlanContext.build(config, spec, world, profile)
    needs = {}
    for pipe_len in initial_pipe_lens(resolve(config, world), world.world_size):
        fixed = unlimited.with_pipeline(pipe_len)
        needs[pipe_len] = max(fixed.stage_bytes(fixed.layout_for(0, pipe_len).plan))
        if needs[pipe_len] <= budget:
            return
    pipe_len = max(needs)
    setting = config.pipeline.initial_pipe_len
    hint = (
        "; pipeline.initial_pipe_len=auto tries longer pipelines"
        if isinstance(setting, int) and setting < world.devices_per_node
        else ""
    )
    raise ConfigError(
        f"no pipeline fits {cluster.memory_label(config)} at 0 frozen layers: the largest "
        f"stage needs {format_bytes(needs[pipe_len])} at pipe_len {pipe_len}, a device has "
        f"{format_bytes(budget)} for stages{hint}"
    )


def _predicted(
    frozen: int, layout: Layout, step: StepPrediction, peak_bytes: float
) -> PredictedLayout:
    m, k = layout.plan.num_micro_batches, layout.pipe_len
    return PredictedLayout(
        num_frozen_layers=frozen,
        pipe_len=k,
        dp_degree=layout.dp_degree,
        num_micro_batches=m,
        compute_s=step.compute_s,
        p2p_s=step.p2p_s,
        allreduce_s=step.allreduce_s,
        optimizer_s=step.optimizer_s,
        overhead_s=step.overhead_s,
        step_s=step.step_s,
        bubble=(m + k - 1) / m,
        peak_bytes=peak_bytes,
    )


def _step(
    times: UnitTimes, layout: Layout, config: Config, cluster: Cluster, cached: bool
) -> StepPrediction:
    replica_batch = config.trainer.global_batch_size // layout.dp_degree
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
    )


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
) -> float:
    """Predicted training seconds of an epoch of `steps` steps in one layout of a run of
    `config` on its own processes (its initial_pipe_len resolved), stages planned as the run
    plans them from `profile`; `times`: that profile's unit times with the overheads."""
    spec = describe_model(config)
    world = config.nproc_per_node
    context = PlanContext.build(config, spec, World(world, world, "cpu"), profile)
    layout = context.layout_for(num_frozen_layers, pipe_len, lambda k, b: num_micro_batches)
    return steps * _step(times, layout, context.config, Cluster(1, world, links), cached).step_s
