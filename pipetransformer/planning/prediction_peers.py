"""`plan --predict`'s comparison with what users run instead (`compare --peers`' variants):
Pipe+DDP (the baseline: the configured pipeline, no freezing), plain DDP, freeze + DDP,
FSDP2 and freeze + FSDP2 (sharded over every device), each replayed over the same training
set as the full system (prediction_run.py), with whether its largest stage fits a device.

The peers keep the baseline's global batch: with `trainer.batch_per_replica` that is the
replica batch times the starting layout's replicas (the full system's own batch grows as it
adds replicas; DDP and freeze + DDP train the batch Pipe+DDP trains).

Owns: `PeerPrediction`, `PeerSetting`, `baseline_peer`, `ddp_peer`. Must not: replay the
full system (predict.py asks prediction_run.py) or print anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipetransformer.autopipe.profiles import UnitProfile
from pipetransformer.config import Config, ConfigError, resolve
from pipetransformer.models import ModelSpec
from pipetransformer.planning.cluster import Cluster
from pipetransformer.planning.context import DoesNotFit, PlanContext
from pipetransformer.planning.prediction_run import Variant
from pipetransformer.planning.step_model import UnitTimes


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
class PeerSetting:
    """What every peer of one prediction shares: the model, its unit profile and times,
    the cluster, the samples a node trains an epoch, the global batch at the full system's
    start and the stage budget (None: no limit)."""

    spec: ModelSpec
    profile: UnitProfile
    cluster: Cluster
    times: UnitTimes
    node_samples: int
    global_batch_size: int
    budget: float | None


def without_freezing(config: Config) -> Config:
    return dataclasses.replace(config, freeze=dataclasses.replace(config.freeze, strategy="none"))


def baseline_peer(config: Config, replayed: Config, setting: PeerSetting) -> PeerPrediction:
    """Pipe+DDP: the configured pipeline length (or a whole node's), no freezing, the
    replayed config's batch."""
    cluster, budget = setting.cluster, setting.budget
    configured = config.pipeline.initial_pipe_len
    fixed = configured if isinstance(configured, int) else cluster.devices_per_node
    base_config = without_freezing(replayed)
    context = PlanContext.build(base_config, setting.spec, cluster.world(), setting.profile)
    context = context.with_pipeline(fixed)
    variant = Variant(base_config, context, cluster, setting.times, setting.node_samples)
    return _replayed_peer("baseline", variant, context, None, budget)


def _replayed_peer(
    name: str,
    variant: Variant,
    context: PlanContext,
    per_epoch: list[int] | None,
    budget: float | None,
) -> PeerPrediction:
    """A peer's prediction from its replayed run: its first layout, step, run time and peak."""
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


def ddp_peer(
    name: str,
    config: Config,
    per_epoch: list[int] | None,
    setting: PeerSetting,
    sharded: bool = False,
) -> PeerPrediction:
    """DDP over every device (pipe_len 1) at the baseline's global batch; with freezing
    (`config`'s rule, or `per_epoch`): freeze + DDP, the frozen prefix cached as the full
    system caches it. `sharded`: FSDP2 over every device instead of DDP, the replica batch in
    the fewest micro-batches that fit the budget (gradient accumulation, as an FSDP2 user
    fits a batch); DDP runs it in one piece."""
    cluster, budget = setting.cluster, setting.budget
    world = cluster.world()
    trainer = dataclasses.replace(
        config.trainer, batch_per_replica=None, global_batch_size=setting.global_batch_size
    )
    # Plain DDP: one stage, the replica's batch in one piece.
    pipeline = dataclasses.replace(
        config.pipeline,
        initial_pipe_len=1,
        num_micro_batches="auto" if sharded else 1,  # sharded: the fewest that fit
        schedule="gpipe",
        virtual_stages="auto",
        sharding="always" if sharded else "never",
    )
    peer = dataclasses.replace(config, trainer=trainer, pipeline=pipeline)
    try:
        resolve(peer, world)  # the checks a run of it would meet (a batch that must split)
    except ConfigError as exc:
        return PeerPrediction(
            name,
            pipe_len=1,
            dp_degree=world.world_size,
            num_micro_batches=1,
            step_s=None,
            run_s=None,
            peak_bytes=None,
            fits=False,
            problem=str(exc),
        )
    try:
        context = PlanContext.build(
            peer, setting.spec, world, setting.profile, budget if sharded else None
        )
    except DoesNotFit as exc:
        return PeerPrediction(name, 1, world.world_size, 1, None, None, None, False, str(exc))
    variant = Variant(peer, context, cluster, setting.times, setting.node_samples)
    return _replayed_peer(name, variant, context, per_epoch, budget)
