"""A run replayed step by step without processes, as the trainer would take it: when decision
points fall and what the configured freeze rule decides there (the trainer's own
`DecisionSchedule` and `FreezeDecider`), the layout each frozen boundary gets, how many
steps an epoch takes under the run's batch semantics, and what AutoCache holds for the
samples of each step, so that each step's frozen-prefix work is known. `plan --predict`
prices the steps (prediction_run.py); the trainer keeps the same `CachedShares` to balance a
boundary for the prefix work its steps will do.

Gradient-driven rules decide from gradient norms no prediction has. They are replayed on
norms that put the smallest at the top layer and never change, so every rule freezes as
fast as Eq. 1's bound allows: gradient_norm and its inclusive variant take the bound at
every decision, convergence takes it from its second decision on (its first only measures),
signal_to_noise (given gradients that are all noise) at every decision; autofreeze, which
has no bound, is replayed on drifts whose change grows with height, so from its second
decision on the layers below the active layers' median freeze.

Owns: `RunShape`, `CachedShares`, `prefix_cost_to_balance`, `Segment`, `simulate_run`. Pure:
no processes, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipetransformer.autodp.topology import Layout
from pipetransformer.config import FreezeConfig
from pipetransformer.freeze import DecisionSchedule, FreezeDecider
from pipetransformer.planning.step_model import prefix_work
from pipetransformer.utils.units import prefix_end


@dataclass(frozen=True)
class RunShape:
    """How many steps an epoch takes: a node's `node_samples` in batches of the node's
    replicas x `batch_per_replica` (the paper's semantics), or of `global_batch_size /
    nodes` whatever the layout (a fixed global batch)."""

    epochs: int
    node_samples: int
    nodes: int
    global_batch_size: int | None
    batch_per_replica: int | None = None

    def __post_init__(self) -> None:
        if (self.global_batch_size is None) == (self.batch_per_replica is None):
            raise ValueError("give a global batch or a batch per replica, not both")
        if self.epochs < 1 or self.node_samples < 1:
            raise ValueError("a run has at least one epoch of at least one sample")

    def node_batch(self, replicas_per_node: int) -> int:
        if self.batch_per_replica is not None:
            return self.batch_per_replica * replicas_per_node
        return self.global_batch_size // self.nodes

    def steps_per_epoch(self, replicas_per_node: int) -> int:
        return math.ceil(self.node_samples / self.node_batch(replicas_per_node))


@dataclass
class CachedShares:
    """Shares of a node's training samples by the frozen boundary (F > 0) their AutoCache
    entry was taken at; a sample without an entry counts in none. Every epoch trains each
    sample once in a fresh order, so every step of an epoch draws its samples from the
    shares at the epoch's start (in expectation); a step with the cache serving at F writes
    its samples' entries at F, a step without it leaves their entries as they were."""

    at_start: dict[int, float] = field(default_factory=dict)
    written: dict[int, float] = field(default_factory=dict)
    untouched: float = 0.0

    def record(self, num_frozen_layers: int | None, share: float) -> None:
        """A step trained `share` of the epoch's samples; the cache served it at
        `num_frozen_layers` (None: it did not serve)."""
        if share < 0:
            raise ValueError("a step trains a share >= 0 of the samples")
        if num_frozen_layers is None:
            self.untouched += share
        else:
            self.written[num_frozen_layers] = self.written.get(num_frozen_layers, 0.0) + share

    def end_epoch(self) -> None:
        """Every sample was trained once: what its entry holds now starts the next epoch."""
        total = sum(self.written.values()) + self.untouched
        if total <= 0:
            return
        shares = {f: w / total for f, w in self.written.items()}
        for f, share in self.at_start.items():
            shares[f] = shares.get(f, 0.0) + share * self.untouched / total
        self.at_start = {f: s for f, s in sorted(shares.items()) if s > 0}
        self.written, self.untouched = {}, 0.0

    def to_dict(self) -> dict:
        return {
            "at_start": {str(f): s for f, s in self.at_start.items()},
            "written": {str(f): s for f, s in self.written.items()},
            "untouched": self.untouched,
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> CachedShares:
        if not data:
            return cls()
        return cls(
            {int(f): float(s) for f, s in data.get("at_start", {}).items()},
            {int(f): float(s) for f, s in data.get("written", {}).items()},
            float(data.get("untouched", 0.0)),
        )


@dataclass(frozen=True)
class Segment:
    """Consecutive steps of one epoch in one state: the frozen boundary, the layout, whether
    AutoCache serves the prefix, the entries the steps' samples have (shares at the epoch's
    start) and the prefix work that makes for stage 0."""

    epoch: int  # 0-based
    num_frozen_layers: int
    layout: Layout
    steps: int
    cache_active: bool
    cached: tuple[tuple[int, float], ...]
    prefix_s: float  # per micro-batch of the profile's size


def prefix_cost_to_balance(
    frozen_s: Sequence[float],
    read_s: float,
    num_frozen_layers: int,
    cached: dict[int, float],
    serves: bool,
) -> float:
    """The frozen prefix's cost a boundary's stage 0 is balanced for: the work the coming
    steps will do there (step_model.prefix_work) under `cached`, the shares of samples by
    the boundary their entry holds (CachedShares.at_start), when the cache serves; its whole
    forward otherwise. A boundary new to the cache is balanced for filling it (or upgrading
    older entries), and balanced again for reading once a decision point finds every entry
    written (the trainer and `simulate_run` re-plan at every decision point)."""
    end = prefix_end(num_frozen_layers)
    entries = {prefix_end(f): s for f, s in cached.items() if f > 0} if serves else {}
    return prefix_work(frozen_s, read_s, end, entries)


# (F, the layout the run is in, the prefix's cost to balance stage 0 for) -> the new layout
LayoutFor = Callable[[int, Layout, float], Layout]
# (F, shares of samples by the boundary of their entry, whether the cache serves) -> seconds
PrefixCost = Callable[[int, dict[int, float], bool], float]


def synthetic_norms(num_layers: int) -> list[float]:
    """Gradient norms under which every gradient rule freezes as fast as its bound allows:
    the smallest at the top layer, and the same at every decision."""
    return [float(num_layers - layer) for layer in range(num_layers)]


def simulate_run(
    shape: RunShape,
    freeze: FreezeConfig,
    num_layers: int,
    start: Layout,
    layout_for: LayoutFor,
    prefix_cost: PrefixCost,
    cache_serves: Callable[[int], bool],
    per_epoch: Sequence[int] | None = None,
) -> list[Segment]:
    """The run's steps as segments. `per_epoch`: F at the start of each epoch (the last
    repeats) instead of the freeze rule's decisions. At every decision point (and every
    epoch start under `per_epoch`) the layout is planned again for F and for the prefix
    work of the steps that follow, so a boundary first balanced for filling the cache is
    balanced for reading it once its entries are written (the trainer does the same)."""
    decider = FreezeDecider(freeze, num_layers)
    schedule = DecisionSchedule.for_config(
        freeze, shape.steps_per_epoch(start.replicas_per_node), epochs=shape.epochs
    )
    norms = synthetic_norms(num_layers)
    # autofreeze: drifts whose change grows with height, so the median falls mid-way
    drifts = [n * (1 - (layer + 1) / (num_layers + 1)) for layer, n in enumerate(norms)]
    noise_only = [0.0] * num_layers  # signal_to_noise: every gradient is noise
    shares = CachedShares()
    frozen, layout = 0, start
    decisions, since = 0, 0
    segments: list[Segment] = []

    def replan(new_frozen: int, cached: dict[int, float]) -> None:
        nonlocal frozen, layout
        serves = cache_serves(new_frozen)
        layout = layout_for(new_frozen, layout, prefix_cost(new_frozen, cached, serves))
        frozen = new_frozen

    for epoch in range(shape.epochs):
        if per_epoch is not None:
            wanted = min(per_epoch[min(epoch, len(per_epoch) - 1)], num_layers - 1)
            replan(max(frozen, wanted), shares.at_start)
        offset = 0
        cached = dict(shares.at_start)  # what this epoch's samples hold, step after step
        while offset < shape.node_samples:
            serves = cache_serves(frozen)
            previous = segments[-1] if segments else None
            if (
                previous is not None
                and (previous.epoch, previous.num_frozen_layers)
                == (
                    epoch,
                    frozen,
                )
                and (previous.layout, previous.cache_active) == (layout, serves)
            ):
                segments[-1] = dataclasses.replace(previous, steps=previous.steps + 1)
            else:
                work = prefix_cost(frozen, cached, serves)
                segments.append(
                    Segment(epoch, frozen, layout, 1, serves, tuple(cached.items()), work)
                )
            node_batch = shape.node_batch(layout.replicas_per_node)
            trained = min(node_batch, shape.node_samples - offset)
            shares.record(frozen if serves else None, trained / shape.node_samples)
            offset += node_batch
            since += 1
            epoch_end = offset >= shape.node_samples
            if epoch_end:
                shares.end_epoch()
            last = epoch_end and epoch == shape.epochs - 1
            if per_epoch is None and schedule.due(epoch, epoch_end, last, since):
                decisions += 1
                # The previous decision's norms, none at the first (as the run state has).
                previous = norms if decisions > 1 else None
                decided = decider.decide(
                    decisions, frozen, norms, previous, noise_only, drifts, previous
                )
                replan(decided, shares.at_start)
                since = 0
    return segments
