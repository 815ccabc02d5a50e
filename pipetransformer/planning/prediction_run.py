"""A run replayed and priced for `plan --predict`: the trainer's decisions, layouts, batch
semantics and cache (run_model.py's `simulate_run`) over one way to run the model, each
segment priced by the step model on the cluster (cluster.py), summed per epoch.

`Variant` is one way to run the model: the full system, or a peer (prediction_peers.py)
with its own config and plan context. The per-boundary rows (prediction_layouts.py) ask it
what the cache serves and what a step costs, so the rows and the replayed run agree.

Owns: `Variant`, `EpochPrediction`, `RunPrediction`. Must not: choose what to compare
(predict.py) or print anything (prediction_report.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetransformer.autodp.topology import Layout
from pipetransformer.config import Config
from pipetransformer.planning.cluster import Cluster, price_step
from pipetransformer.planning.context import PlanContext
from pipetransformer.planning.run_model import (
    RunShape,
    Segment,
    prefix_cost_to_balance,
    simulate_run,
)
from pipetransformer.planning.step_model import StepPrediction, UnitTimes
from pipetransformer.utils.units import prefix_end


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
class RunPrediction:
    """A replayed run: its seconds, its segments (run_model.py) and its epochs."""

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


class Variant:
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
            pipe_len_from(self.context, current),
            prefix_cost=self.balance_cost(prefix_s),
        )

    def step(self, layout: Layout, prefix_s: float | None) -> StepPrediction:
        return price_step(self.times, layout, self.config, self.cluster, prefix_s)

    def step_s(self, layout: Layout, prefix_s: float) -> float:
        key = (layout, round(prefix_s, 15))
        if key not in self._step_s:
            self._step_s[key] = self.step(layout, prefix_s).step_s
        return self._step_s[key]

    def run(self, per_epoch: list[int] | None) -> RunPrediction:
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
        return RunPrediction(sum(secs for _, secs in priced), segments, epochs)


def pipe_len_from(context: PlanContext, layout: Layout) -> int:
    """The pipeline length the planner halves from after `layout`: its own, or out of a
    sharded layout the initial one (what the trainer passes, planning/context.py)."""
    return context.initial_pipe_len if layout.sharded else layout.pipe_len
