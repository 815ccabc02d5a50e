"""`pipetransformer plan --predict`: what a run of a config would take on a cluster, before
it spends GPU hours: per frozen boundary, the layout the planner would pick, its predicted
step time and the bytes of its largest stage; along the run, replayed as the trainer would
take it (run_model.py: its decisions, layouts, batch semantics and cache), the whole run
against what users run instead (`compare --peers`' variants): Pipe+DDP, plain DDP,
freeze + DDP, FSDP2 and freeze + FSDP2 (sharded over every device), each with whether it fits
a device's memory.

Inputs: a unit profile (measured by a run of this model, or roofline times from its
analytical profile: prediction_inputs.py), the cluster (nodes x devices per node, link
bandwidths, optionally a named device whose memory is the budget) and the training-set size.
The arithmetic is step_model.py's; this module only turns a config into its inputs.
Evaluation, transitions and start-up are left out of every side. prediction_report.py
prints the result.

The trajectory: `auto` replays the config's own rule at its own decision points (gradient
rules at the fastest pace their bound allows, run_model.py says how); `paper` replays Eq. 1's
bound, rounded as freeze.py rounds it, at every epoch end; a list gives F per epoch.

The peers keep the baseline's global batch: with `trainer.batch_per_replica` that is the
replica batch times the starting layout's replicas (the full system's own batch grows as it
adds replicas; DDP and freeze + DDP train the batch Pipe+DDP trains).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.memory import shard_groups
from pipetransformer.autopipe.planner import balance
from pipetransformer.autopipe.profiles import (
    ProfileStore,
    UnitProfile,
    UnitProfileKey,
    unit_costs_from_profile,
)
from pipetransformer.config import Config, ConfigError, World, initial_pipe_lens, resolve
from pipetransformer.models import ModelSpec
from pipetransformer.planning.context import (
    DoesNotFit,
    PlanContext,
    StepPricer,
    describe_model,
    format_bytes,
    usable_device_bytes,
)
from pipetransformer.planning.hardware import Device
from pipetransformer.planning.profile_keys import model_signature_for
from pipetransformer.planning.run_model import (
    RunShape,
    Segment,
    prefix_cost_to_balance,
    simulate_run,
)
from pipetransformer.planning.step_model import (
    CollectiveCost,
    Links,
    StepPrediction,
    UnitTimes,
    calibrate_overhead,
    predict_sharded_step,
    predict_step,
    prefix_work_s,
)
from pipetransformer.utils.units import prefix_end

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
    sharded: bool = False  # FSDP2 over every device (pipeline.sharding)


@dataclass(frozen=True)
class PeerPrediction:
    """One way to train the same model without the full system, as `compare --peers` runs
    it: its layout at 0 frozen layers, its run time along its own trajectory (None when it
    cannot run) and whether its largest stage fits the budget."""

    name: str  # 'baseline' (Pipe+DDP), 'ddp', 'freeze_ddp', 'fsdp', 'freeze_fsdp' (compare's)
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
    steps_per_epoch: int  # in the layout the run starts in
    rows: list[PredictedLayout]
    trajectory: list[int]  # F in effect at the start of each epoch
    baseline: PeerPrediction  # Pipe+DDP
    baseline_s: float
    elastic_s: float
    peers: list[PeerPrediction]  # DDP, freeze + DDP, FSDP2, freeze + FSDP2
    epochs: list[EpochPrediction] = dataclasses.field(default_factory=list)  # the full system's
    batch_per_replica: int | None = None  # the paper's batch semantics; None: a fixed global batch
    global_batch_size: int = 0  # at the start
    train_samples: int = 0
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
        if config.trainer.batch_per_replica is None:
            replicas = max(1, config.trainer.global_batch_size // key.replica_batch)
        else:  # the timed layout's replicas, on the run's one node
            replicas = max(1, config.nproc_per_node // key.pipe_len)
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


def freeze_for(config: Config, trajectory: str) -> tuple[Config, list[int] | None]:
    """The config whose decisions the run replays, and F per epoch for a list trajectory.
    `paper`: Eq. 1's bound (gradient_norm, replayed at its fastest) at every epoch end."""
    freeze = config.freeze
    if trajectory == "auto":
        return config, None
    if trajectory == "paper":
        paper = dataclasses.replace(
            freeze, strategy="gradient_norm", interval_steps=None, warmup_epochs=0
        )
        return dataclasses.replace(config, freeze=paper), None
    try:
        values = [int(v) for v in trajectory.split(",")]
    except ValueError:
        raise ConfigError(
            f"--trajectory: 'auto', 'paper' or F per epoch such as 0,0,2,4; got {trajectory!r}"
        ) from None
    if any(v < 0 for v in values):
        raise ConfigError(f"--trajectory: frozen layers must be >= 0, got {trajectory!r}")
    return config, values


@dataclass(frozen=True)
class EpochPrediction:
    """One epoch of a predicted run: its frozen boundaries and layouts (at its start and
    end), steps, seconds, and what the frozen prefix cost stage 0."""

    epoch: int  # 1-based, as metrics.jsonl counts
    num_frozen_layers: int  # at the epoch's start
    pipe_len: int
    dp_degree: int
    steps: int
    seconds: float
    prefix: str  # 'none', 'computed', 'filled', 'upgraded', 'read' or 'mixed'
    final_num_frozen_layers: int
    final_pipe_len: int
    final_dp_degree: int
    sharded: bool = False  # at the epoch's start, and at its end
    final_sharded: bool = False


@dataclass(frozen=True)
class _RunPrediction:
    seconds: float
    segments: list[Segment]
    epochs: list[EpochPrediction]


def _prefix_kind(segment: Segment) -> str:
    """What stage 0 does with the frozen prefix in `segment` (EpochPrediction.prefix)."""
    if segment.num_frozen_layers == 0:
        return "none"
    if not segment.cache_active:
        return "computed"
    cached = dict(segment.cached)
    covered = sum(cached.values())
    if covered < 1e-9:
        return "filled"
    if cached.get(segment.num_frozen_layers, 0.0) > 1 - 1e-9:
        return "read"
    if covered > 1 - 1e-9 and segment.num_frozen_layers not in cached:
        return "upgraded"
    return "mixed"


class _Variant:
    """One way to run the model (the full system or a peer) replayed and priced."""

    def __init__(
        self,
        config: Config,
        context: PlanContext,
        cluster: Cluster,
        times: UnitTimes,
        node_samples: int,
    ) -> None:
        self.config = context.config
        self.context = context
        self.cluster = cluster
        self.times = times
        trainer = self.config.trainer
        self.shape = RunShape(
            trainer.epochs,
            node_samples,
            cluster.nodes,
            None if trainer.batch_per_replica else trainer.global_batch_size,
            trainer.batch_per_replica,
        )
        cache = config.cache
        self.caching = (
            cache.enabled and config.freeze.strategy != "none" and config.autopipe.enabled
        )
        self._step_s: dict[tuple, float] = {}

    def serves(self, num_frozen_layers: int) -> bool:
        """The trainer's test (trainer/caching.py): the cache serves a boundary whose prefix
        takes longer to compute than to read."""
        if not self.caching or num_frozen_layers == 0:
            return False
        if not self.config.cache.profile:
            return True
        times = self.times
        compute = sum(times.frozen_s[: prefix_end(num_frozen_layers)]) / times.micro_batch_size
        return times.cache_read_s_per_sample < compute

    def prefix_s(self, num_frozen_layers: int, cached: dict[int, float], serves: bool) -> float:
        """Stage 0's frozen-prefix seconds per micro-batch of the profile's size (the same
        rule the trainer balances a boundary by)."""
        times = self.times
        read = times.cache_read_s_per_sample * times.micro_batch_size
        return prefix_cost_to_balance(times.frozen_s, read, num_frozen_layers, cached, serves)

    def balance_cost(self, prefix_s: float) -> float | None:
        """The prefix's cost in the planner's units: seconds under `balance: time`;
        parameter counts (`balance: params`) have none for a read, so the frozen prefix
        counts at lambda_frozen of its size there."""
        return prefix_s if self.context.costs.source == "time" else None

    def layout_for(self, num_frozen_layers: int, current: Layout, prefix_s: float) -> Layout:
        return self.context.layout_for(
            num_frozen_layers,
            _pipe_len_from(self.context, current),
            prefix_cost=self.balance_cost(prefix_s),
        )

    def step(self, layout: Layout, prefix_s: float | None) -> StepPrediction:
        return _step(self.times, layout, self.config, self.cluster, prefix_s)

    def step_s(self, layout: Layout, prefix_s: float) -> float:
        key = (layout, round(prefix_s, 15))
        if key not in self._step_s:
            self._step_s[key] = self.step(layout, prefix_s).step_s
        return self._step_s[key]

    def run(self, per_epoch: list[int] | None) -> _RunPrediction:
        context = self.context
        start = context.layout_for(0, context.initial_pipe_len)
        spec = context.spec
        segments = simulate_run(
            self.shape,
            self.config.freeze,
            spec.num_layers,
            start,
            self.layout_for,
            self.prefix_s,
            self.serves,
            per_epoch,
        )
        priced = [
            (segment, segment.steps * self.step_s(segment.layout, segment.prefix_s))
            for segment in segments
        ]
        epochs = []
        for epoch in range(self.shape.epochs):
            mine = [(seg, secs) for seg, secs in priced if seg.epoch == epoch]
            first, last = mine[0][0], mine[-1][0]
            kinds = {_prefix_kind(seg) for seg, _ in mine}
            epochs.append(
                EpochPrediction(
                    epoch + 1,
                    first.num_frozen_layers,
                    first.layout.pipe_len,
                    first.layout.dp_degree,
                    sum(seg.steps for seg, _ in mine),
                    sum(secs for _, secs in mine),
                    kinds.pop() if len(kinds) == 1 else "mixed",
                    last.num_frozen_layers,
                    last.layout.pipe_len,
                    last.layout.dp_degree,
                    first.layout.sharded,
                    last.layout.sharded,
                )
            )
        return _RunPrediction(sum(secs for _, secs in priced), segments, epochs)


def predict(
    config: Config,
    profile: UnitProfile,
    cluster: Cluster,
    train_samples: int,
    trajectory: str = "auto",
    times: UnitTimes | None = None,
    *,
    unit_profile_source: str = "",
    steps_per_epoch_source: str = "",
) -> Prediction:
    """Layouts per frozen boundary and the run's predicted time against Pipe+DDP, DDP and
    freeze + DDP, over `train_samples` training samples an epoch. `times`: the profile's
    unit times with the device's memory bandwidth and step overhead (default: a GPU's
    bandwidth, no overhead). The stage budget is `cluster.memory_budget`: the planner
    compresses only into layouts that fit it, and a run that fits no pipeline at 0 frozen
    layers is a ConfigError naming the device."""
    spec = describe_model(config)
    times = times or unit_times(profile)
    world = cluster.world()
    budget = cluster.memory_budget(config)
    if budget is not None:
        _require_a_start_that_fits(config, spec, world, profile, budget, cluster)
    replayed, per_epoch = freeze_for(config, trajectory)
    context = PlanContext.build(replayed, spec, world, profile, budget)
    if context.prices_sharded_layouts:  # sharded where predicted faster
        context = context.with_pricer(step_pricer(times, context.config, cluster))
    node_samples = math.ceil(train_samples / cluster.nodes)
    elastic = _Variant(replayed, context, cluster, times, node_samples)

    def peak(ctx: PlanContext, layout: Layout) -> float:
        return max(ctx.layout_bytes(layout))

    run = elastic.run(per_epoch)
    # Each boundary's steady state, the prefix read wherever the cache serves it: the
    # planner's layout for reading, from the pipeline the run holds at that boundary where
    # it reaches it (the run plans a boundary when it gets there, for the prefix work of
    # that moment, and K only halves: planned from the row before, a row could disagree
    # with the epoch table), from the row before elsewhere.
    held = {s.num_frozen_layers: _pipe_len_from(context, s.layout) for s in run.segments}
    rows, pipe_len = [], context.initial_pipe_len
    for frozen in range(spec.num_layers):
        serves = elastic.serves(frozen)
        read = elastic.prefix_s(frozen, {frozen: 1.0}, serves)
        layout = context.layout_for(
            frozen, held.get(frozen, pipe_len), prefix_cost=elastic.balance_cost(read)
        )
        pipe_len = _pipe_len_from(context, layout)
        rows.append(_predicted(frozen, layout, elastic.step(layout, read), peak(context, layout)))
    start = run.segments[0].layout
    start_global = context.config.trainer.global_batch_size_at(start.dp_degree)

    # Pipe+DDP: the configured pipeline length (or a whole node's), no freezing.
    setting = config.pipeline.initial_pipe_len
    fixed = setting if isinstance(setting, int) else cluster.devices_per_node
    base_config = _without_freezing(replayed)
    base_context = PlanContext.build(base_config, spec, world, profile).with_pipeline(fixed)
    base = _Variant(base_config, base_context, cluster, times, node_samples)
    base_run = base.run(None)
    base_layout = base_run.segments[0].layout
    baseline = PeerPrediction(
        "baseline",
        base_layout.pipe_len,
        base_layout.dp_degree,
        base_layout.plan.num_micro_batches,
        base.step(base_layout, None).step_s,
        base_run.seconds,
        peak(base_context, base_layout),
        budget is None or peak(base_context, base_layout) <= budget,
    )
    peer_args = (spec, profile, cluster, times, node_samples, start_global, budget)
    peers = [
        _ddp_peer(
            "ddp",
            _without_freezing(replayed),
            None,
            spec,
            profile,
            cluster,
            times,
            node_samples,
            start_global,
            budget,
        ),
        _ddp_peer(
            "freeze_ddp",
            replayed,
            per_epoch,
            spec,
            profile,
            cluster,
            times,
            node_samples,
            start_global,
            budget,
        ),
        _ddp_peer("fsdp", _without_freezing(replayed), None, *peer_args, sharded=True),
        _ddp_peer("freeze_fsdp", replayed, per_epoch, *peer_args, sharded=True),
    ]
    links = cluster.links
    return Prediction(
        nodes=cluster.nodes,
        devices_per_node=cluster.devices_per_node,
        intra_node_gbps=links.intra_node_bytes_per_s / 1e9,
        inter_node_gbps=links.inter_node_bytes_per_s / 1e9,
        profile_micro_batch_size=profile.micro_batch_size,
        steps_per_epoch=elastic.shape.steps_per_epoch(start.replicas_per_node),
        rows=rows,
        trajectory=[e.num_frozen_layers for e in run.epochs],
        baseline=baseline,
        baseline_s=baseline.run_s,
        elastic_s=run.seconds,
        peers=peers,
        epochs=run.epochs,
        batch_per_replica=config.trainer.batch_per_replica,
        global_batch_size=start_global,
        train_samples=train_samples,
        device=cluster.device.name if cluster.device else None,
        device_memory_bytes=budget,
        intra_node_link=cluster.intra_node_link,
        inter_node_link=cluster.inter_node_link,
        unit_profile_source=unit_profile_source,
        steps_per_epoch_source=steps_per_epoch_source,
    )


def _pipe_len_from(context: PlanContext, layout: Layout) -> int:
    """The pipeline length the planner halves from after `layout`: its own, or out of a
    sharded layout the initial one (what the trainer passes, planning/context.py)."""
    return context.initial_pipe_len if layout.sharded else layout.pipe_len


def _without_freezing(config: Config) -> Config:
    return dataclasses.replace(config, freeze=dataclasses.replace(config.freeze, strategy="none"))


def _ddp_peer(
    name: str,
    config: Config,
    per_epoch: list[int] | None,
    spec: ModelSpec,
    profile: UnitProfile,
    cluster: Cluster,
    times: UnitTimes,
    node_samples: int,
    global_batch_size: int,
    budget: float | None,
    sharded: bool = False,
) -> PeerPrediction:
    """DDP over every device (pipe_len 1) at the baseline's global batch; with freezing
    (`config`'s rule, or `per_epoch`): freeze + DDP, the frozen prefix cached as the full
    system caches it. `sharded`: FSDP2 over every device instead of DDP, the replica batch in
    the fewest micro-batches that fit the budget (gradient accumulation, as an FSDP2 user
    fits a batch); DDP runs it in one piece."""
    world = cluster.world()
    trainer = dataclasses.replace(
        config.trainer, batch_per_replica=None, global_batch_size=global_batch_size
    )
    # Plain DDP: one stage, the replica's batch in one piece.
    pipeline = dataclasses.replace(
        config.pipeline,
        initial_pipe_len=1,
        num_micro_batches="auto" if sharded else 1,  # sharded: the fewest that fit
        schedule="gpipe",
        sharding="always" if sharded else "never",
    )
    peer = dataclasses.replace(config, trainer=trainer, pipeline=pipeline)
    m = 1
    try:
        resolve(peer, world)  # the checks a run of it would meet (a batch that must split)
    except ConfigError as exc:
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
    try:
        context = PlanContext.build(peer, spec, world, profile, budget if sharded else None)
    except DoesNotFit as exc:
        return PeerPrediction(name, 1, world.world_size, 1, None, None, None, False, str(exc))
    variant = _Variant(peer, context, cluster, times, node_samples)
    run = variant.run(per_epoch)
    layout = run.segments[0].layout
    peak_bytes = max(context.layout_bytes(layout))
    return PeerPrediction(
        name,
        layout.pipe_len,
        layout.dp_degree,
        layout.plan.num_micro_batches,
        variant.step(layout, None).step_s,
        run.seconds,
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
    start at fits `budget` with nothing frozen (and, under pipeline.sharding 'auto', no
    sharded layout either)."""
    if PlanContext.prices(config):
        try:
            sharded = dataclasses.replace(
                config, pipeline=dataclasses.replace(config.pipeline, sharding="always")
            )
            PlanContext.build(sharded, spec, world, profile, budget)
            return
        except ConfigError:
            pass
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
        bubble=1.0 if layout.sharded else (m + k - 1) / m,
        peak_bytes=peak_bytes,
        sharded=layout.sharded,
    )


def _step(
    times: UnitTimes,
    layout: Layout,
    config: Config,
    cluster: Cluster,
    prefix_s: float | None = None,
    cached: bool = False,
) -> StepPrediction:
    """`prefix_s`: stage 0's frozen-prefix work (step_model.prefix_work_s); None: all read
    (`cached`) or all computed."""
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
    )


def step_pricer(times: UnitTimes, config: Config, cluster: Cluster) -> StepPricer:
    """Predicted seconds of a step of any layout of a run of `config` on `cluster` (what
    PlanContext compares a sharded layout with a pipeline by, pipeline.sharding 'auto')."""

    def price(layout: Layout, prefix_s: float | None) -> float:
        return _step(times, layout, config, cluster, prefix_s).step_s

    return price


def measured_cluster(costs: dict, nodes: int, devices_per_node: int, device_type: str) -> Cluster:
    """The cluster a run measured at start (trainer/profiler.py `RunProfiler.links`): its
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
    return steps * _step(times, layout, context.config, cluster, cached=cached).step_s
