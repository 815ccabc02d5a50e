"""`pipetransformer plan --predict`: what a run of a config would take on a cluster, before
it spends GPU hours: per frozen boundary, the layout the planner would pick and its
predicted step time; along a freeze trajectory, the whole run against Pipe+DDP.

Inputs: a unit profile (a profile file of a run of this model, on the target device type
when there is one), the cluster shape (nodes x devices per node) and stated link
bandwidths. The arithmetic is step_model.py's; this module only turns a config into its
inputs. Evaluation, transitions and start-up are left out of both sides.
"""

from __future__ import annotations

import dataclasses
import math
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
from pipetransformer.config import Config, ConfigError, World
from pipetransformer.freeze import DecisionSchedule
from pipetransformer.planning.context import PlanContext, describe_model
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
    nodes: int
    devices_per_node: int
    links: Links

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def world(self) -> World:
        return World(self.world_size, self.devices_per_node, "cuda")


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


@dataclass(frozen=True)
class BaselineLayout:
    pipe_len: int
    dp_degree: int
    num_micro_batches: int
    step_s: float


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
    baseline: BaselineLayout
    baseline_s: float
    elastic_s: float

    @property
    def speedup(self) -> float:
        return self.baseline_s / self.elastic_s

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        cluster = {
            key: data.pop(key)
            for key in ("nodes", "devices_per_node", "intra_node_gbps", "inter_node_gbps")
        }
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
            "a run of this config writes one (RUN_DIR/../profiles/profiles.json)"
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
) -> Prediction:
    """Layouts per frozen boundary and the run's predicted time against Pipe+DDP. `times`:
    the profile's unit times with the device's memory bandwidth and step overhead (default:
    a GPU's bandwidth, no overhead)."""
    spec = describe_model(config)
    times = times or unit_times(profile)
    budget = config.pipeline.device_memory_bytes  # the configured budget; GPUs: set it
    context = PlanContext.build(config, spec, cluster.world(), profile, budget)
    rows, layouts = [], {}
    pipe_len = context.initial_pipe_len
    for frozen in range(spec.num_layers):
        layout = context.layout_for(frozen, pipe_len)
        pipe_len = layout.pipe_len
        layouts[frozen] = layout
        step = _step(times, layout, context.config, cluster, cached=frozen > 0)
        rows.append(_predicted(frozen, layout, step))
    # The baseline: Pipe+DDP at the configured pipeline length, or a whole node's.
    setting = config.pipeline.initial_pipe_len
    fixed = setting if isinstance(setting, int) else cluster.devices_per_node
    base_layout = context.with_pipeline(fixed).layout_for(0, fixed)
    base_step = _step(times, base_layout, context.config, cluster, cached=False).step_s
    frozen = frozen_per_step(config, trajectory, spec.num_layers, steps_per_epoch)
    elastic_s = 0.0
    for step, value in enumerate(frozen):
        # A boundary's first epoch computes the prefix (filling the cache); then it is read.
        first_epoch = step < steps_per_epoch or frozen[step - steps_per_epoch] != value
        if not first_epoch or value == 0:
            elastic_s += rows[value].step_s
        else:
            elastic_s += _step(times, layouts[value], context.config, cluster, cached=False).step_s
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
        baseline=BaselineLayout(
            base_layout.pipe_len,
            base_layout.dp_degree,
            base_layout.plan.num_micro_batches,
            base_step,
        ),
        baseline_s=base_step * len(frozen),
        elastic_s=elastic_s,
    )


def _predicted(frozen: int, layout: Layout, step: StepPrediction) -> PredictedLayout:
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


def format_prediction(result: Prediction, source: str) -> str:
    lines = [
        f"predicted for {result.nodes} node(s) x {result.devices_per_node} devices, links "
        f"{result.intra_node_gbps:g} GB/s in a node, "
        f"{result.inter_node_gbps:g} GB/s between nodes; "
        f"unit profile {source} (micro-batch {result.profile_micro_batch_size}); "
        f"{result.steps_per_epoch} steps an epoch",
        f"{'frozen':>6} {'K':>3} {'R':>3} {'M':>3} {'bubble':>7} {'compute':>10} {'p2p':>9} "
        f"{'all-reduce':>10} {'optimizer':>10} {'overhead':>9} {'step':>10}",
    ]
    for r in result.rows:
        lines.append(
            f"{r.num_frozen_layers:>6} {r.pipe_len:>3} {r.dp_degree:>3} {r.num_micro_batches:>3} "
            f"{r.bubble:>7.2f} {1e3 * r.compute_s:>8.2f}ms {1e3 * r.p2p_s:>7.2f}ms "
            f"{1e3 * r.allreduce_s:>8.2f}ms {1e3 * r.optimizer_s:>8.2f}ms "
            f"{1e3 * r.overhead_s:>7.2f}ms {1e3 * r.step_s:>8.2f}ms"
        )
    b = result.baseline
    lines += [
        f"trajectory (frozen layers per epoch): {result.trajectory}",
        f"Pipe+DDP (K={b.pipe_len}, R={b.dp_degree}, M={b.num_micro_batches}): "
        f"{result.baseline_s / 60:.2f} min of training; "
        f"PipeTransformer: {result.elastic_s / 60:.2f} min; "
        f"predicted speedup {result.speedup:.2f}x",
    ]
    return "\n".join(lines)


def steps_per_epoch_for(config: Config, nodes: int) -> int:
    """Steps an epoch, from the size of the local training data."""
    if config.data.root is None and config.data.name != "digits":
        raise ConfigError(
            "--steps-per-epoch: needed when the data is fetched from the network (data.root unset)"
        )
    from pipetransformer.data import build_data

    samples = len(
        build_data(
            config.data,
            seed=config.trainer.seed,
            model_name_or_path=config.model.model_name_or_path,
        ).train
    )
    per_node = config.trainer.global_batch_size // nodes
    return math.ceil(math.ceil(samples / nodes) / per_node)


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
