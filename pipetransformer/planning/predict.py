"""`pipetransformer plan --predict`: what a run of a config would take on a cluster, before
it spends GPU hours: per frozen boundary, the layout the planner would pick, its predicted
step time and the bytes of its largest stage (prediction_layouts.py); along the run,
replayed as the trainer would take it (prediction_run.py over run_model.py: its decisions,
layouts, batch semantics and cache), the whole run against what users run instead
(prediction_peers.py, `compare --peers`' variants): Pipe+DDP, plain DDP, freeze + DDP, FSDP2
and freeze + FSDP2 (sharded over every device), each with whether it fits a device's memory.

Inputs (prediction_inputs.py): the model's spec, built once there and passed on, a unit
profile (measured by a run of this model, or roofline times from its analytical profile),
the cluster (cluster.py: nodes x devices per node, link bandwidths, optionally a named
device whose memory is the budget) and the training-set size. The arithmetic is
step_model.py's. Evaluation, transitions and start-up are left out of every side.
prediction_report.py prints the result.

The trajectory: `auto` replays the config's own rule at its own decision points (gradient
rules at the fastest pace their bound allows, run_model.py says how); `paper` replays Eq. 1's
bound, rounded as freeze.py rounds it, at every epoch end; a list gives F per epoch.

Owns: `predict`, `Prediction`, `freeze_for`. Must not: read flags or files
(prediction_inputs.py) or print (prediction_report.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipetransformer.autopipe.profiles import UnitProfile
from pipetransformer.config import Config, ConfigError
from pipetransformer.models import ModelSpec
from pipetransformer.planning.cluster import Cluster, step_pricer, unit_times
from pipetransformer.planning.context import PlanContext, describe_model
from pipetransformer.planning.prediction_layouts import (
    PredictedLayout,
    boundary_rows,
    require_a_start_that_fits,
)
from pipetransformer.planning.prediction_peers import (
    PeerPrediction,
    PeerSetting,
    baseline_peer,
    ddp_peer,
    without_freezing,
)
from pipetransformer.planning.prediction_run import EpochPrediction, Variant
from pipetransformer.planning.step_model import UnitTimes


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
    schedule: str = "gpipe"  # pipeline.schedule (each row's v: the chunks a stage holds)

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


def predict(
    config: Config,
    profile: UnitProfile,
    cluster: Cluster,
    train_samples: int,
    trajectory: str = "auto",
    times: UnitTimes | None = None,
    *,
    spec: ModelSpec | None = None,
    unit_profile_source: str = "",
    steps_per_epoch_source: str = "",
) -> Prediction:
    """Layouts per frozen boundary and the run's predicted time against Pipe+DDP, DDP,
    freeze + DDP, FSDP2 and freeze + FSDP2, over `train_samples` training samples an epoch.
    `times`: the profile's unit times with the device's memory bandwidth and step overhead
    (default: a GPU's bandwidth, no overhead). `spec`: the model's (prediction_inputs.py
    builds it once; default: built here). The stage budget is `cluster.memory_budget`: the
    planner compresses only into layouts that fit it, and a run that fits no pipeline at 0
    frozen layers is a ConfigError naming the device."""
    spec = spec or describe_model(config)
    times = times or unit_times(profile)
    world = cluster.world()
    budget = cluster.memory_budget(config)
    if budget is not None:
        require_a_start_that_fits(config, spec, world, profile, budget, cluster)
    replayed, per_epoch = freeze_for(config, trajectory)
    context = PlanContext.build(replayed, spec, world, profile, budget)
    if context.prices_sharded_layouts:  # sharded where predicted faster
        context = context.with_pricer(step_pricer(times, context.config, cluster))
    node_samples = math.ceil(train_samples / cluster.nodes)
    elastic = Variant(replayed, context, cluster, times, node_samples)
    run = elastic.run(per_epoch)
    rows = boundary_rows(elastic, run)
    start = run.segments[0].layout
    start_global = context.config.trainer.global_batch_size_at(start.dp_degree)

    setting = PeerSetting(spec, profile, cluster, times, node_samples, start_global, budget)
    baseline = baseline_peer(config, replayed, setting)
    peers = [
        ddp_peer("ddp", without_freezing(replayed), None, setting),
        ddp_peer("freeze_ddp", replayed, per_epoch, setting),
        ddp_peer("fsdp", without_freezing(replayed), None, setting, sharded=True),
        ddp_peer("freeze_fsdp", replayed, per_epoch, setting, sharded=True),
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
        schedule=config.pipeline.schedule,
    )
