"""AutoPipe planning: which units each pipeline stage runs, and how short the pipeline can be.

Pure functions of plain values; no processes, no torch.

Unit space (see models/layered.py): 0 = embedding, 1 + 2l / 2 + 2l = layer l's attention /
MLP sublayer, last = head. A stage is a contiguous range of units, so a boundary never
cuts a residual connection. With F layers frozen, units [0, prefix_end) are the frozen
prefix: they run on the first stage's device as input preprocessing (no backward), and
count on stage 0 at their forward-only cost.

Balancing: `greedy` fills each stage towards the average cost of the stages still to fill,
keeping a unit only when that lands closer to the average: the idea of the paper's
Algorithm 1 (`load_balance`), whose test is `stage + unit < mean + variance`; this one has no
variance term. `optimal` minimises the largest stage exactly (dynamic programming). Costs
are measured seconds (`pipeline.balance: time`) or parameter counts (`params`, the
paper's), the frozen prefix counted on stage 0.

Compression (the paper's Eq. 2, section 3.2.2): from the current K, try K/2 while the
largest stage of the packed plan, in *parameter size* with the frozen prefix at
`lambda_frozen` of its size on stage 0 (Algorithm 1, line 28), is no larger than the largest
stage of the initial plan (F = 0, K = initial_pipe_len), and, when memory is limited, every
stage of the packed plan fits the device (autopipe/memory.py). Parameter size is the
paper's proxy for a stage's memory; it is compared whatever the stages were balanced on,
because packing is a question of memory: a packed layout does the same work per sample on
half the stages with a smaller bubble. K only halves; it always divides the devices of a
node because the initial K does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipetransformer.utils.units import prefix_end

# Relative slack when comparing stage costs, so equal costs summed in another order compare equal.
_TOLERANCE = 1e-9


@dataclass(frozen=True)
class UnitCosts:
    """Per-unit cost when trained (forward + backward) and when frozen (forward only)."""

    trained: tuple[float, ...]
    frozen: tuple[float, ...]
    source: str = "params"  # "params" or "time" (measured)

    def __post_init__(self) -> None:
        if len(self.trained) != len(self.frozen):
            raise ValueError("one trained and one frozen cost per unit")
        if any(c < 0 for c in (*self.trained, *self.frozen)):
            raise ValueError("unit costs must be >= 0")

    @property
    def num_units(self) -> int:
        return len(self.trained)

    @classmethod
    def from_param_counts(cls, counts: Sequence[int], lambda_frozen: float) -> UnitCosts:
        return cls(
            trained=tuple(float(c) for c in counts),
            frozen=tuple(float(c) * lambda_frozen for c in counts),
            source="params",
        )


@dataclass(frozen=True)
class PipelinePlan:
    """One layout of one pipeline: which units each stage runs and what that costs."""

    num_frozen_layers: int
    pipe_len: int
    prefix_end: int  # units [0, prefix_end) run as preprocessing before stage 0
    stage_ranges: tuple[tuple[int, int], ...]  # [start, end) per stage, covering [prefix_end, U)
    stage_costs: tuple[float, ...]  # stage 0 includes the preprocessing cost
    num_micro_batches: int = 1
    frozen_embedding: bool = False  # freeze.embedding: the embedding frozen from the start

    @property
    def frozen_end(self) -> int:
        """Units below this are frozen (some may sit inside stages when AutoPipe is off)."""
        return prefix_end(self.num_frozen_layers, self.frozen_embedding)

    @property
    def max_stage_cost(self) -> float:
        return max(self.stage_costs)

    def stage_of_unit(self, unit: int) -> int | None:
        for stage, (start, end) in enumerate(self.stage_ranges):
            if start <= unit < end:
                return stage
        return None

    def stage_units(self, stage: int) -> list[int]:
        start, end = self.stage_ranges[stage]
        return list(range(start, end))

    def units_of_first_stage_rank(self) -> list[int]:
        """The first stage's device runs the preprocessing units and its own."""
        return list(range(0, self.prefix_end)) + self.stage_units(0)

    def to_dict(self) -> dict:
        return {
            "num_frozen_layers": self.num_frozen_layers,
            "pipe_len": self.pipe_len,
            "prefix_end": self.prefix_end,
            "stage_ranges": [list(r) for r in self.stage_ranges],
            "stage_costs": list(self.stage_costs),
            "num_micro_batches": self.num_micro_batches,
        }


def _stage_cost(costs: UnitCosts, start: int, end: int, frozen_end: int) -> float:
    return sum(costs.frozen[u] if u < frozen_end else costs.trained[u] for u in range(start, end))


def partition_greedy(
    weights: Sequence[float], num_stages: int, head_start: float = 0.0
) -> list[int]:
    """Paper-style greedy split of `weights` into `num_stages` non-empty contiguous groups.

    `head_start` is a cost already on the first stage (the frozen prefix). Returns the
    start index of each stage.
    """
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} units into {num_stages} non-empty stages")
    starts = [0]
    current = head_start
    remaining = head_start + sum(weights)
    for i, w in enumerate(weights):
        stages_left = num_stages - len(starts)  # stages still to open after the current one
        units_left = n - i
        if stages_left == 0:
            current += w
            continue
        target = remaining / (stages_left + 1)
        must_cut = units_left == stages_left  # every later stage needs one unit
        stage_empty = i == starts[-1]
        keep_closer = abs(current + w - target) <= abs(current - target)
        if not stage_empty and (must_cut or not keep_closer):
            starts.append(i)
            remaining -= current
            current = w
        else:
            current += w
    return starts


def partition_optimal(
    weights: Sequence[float], num_stages: int, head_start: float = 0.0
) -> list[int]:
    """Contiguous split minimising the largest stage; ties prefer later cuts."""
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} units into {num_stages} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (head_start if i == 0 else 0.0)

    inf = math.inf
    # best[k][j]: minimal max-stage cost of units [0, j) in k stages; cut[k][j]: last start.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value <= best[k][j] * (1 + _TOLERANCE):
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(num_stages, 0, -1):
        starts.append(cut[k][j])
        j = cut[k][j]
    return starts[::-1]


PARTITIONERS: dict[str, Callable[[Sequence[float], int, float], list[int]]] = {
    "greedy": partition_greedy,
    "optimal": partition_optimal,
}


def balance(
    costs: UnitCosts,
    num_frozen_layers: int,
    pipe_len: int,
    method: str = "greedy",
    prefix_cost: float | None = None,
    frozen_embedding: bool = False,
) -> PipelinePlan:
    """Split the active units over `pipe_len` stages; the frozen prefix precedes stage 0.

    `prefix_cost` overrides the frozen prefix's cost on stage 0 (e.g. a cache read);
    `frozen_embedding`: the embedding is frozen from the start (`freeze.embedding`).
    """
    start = prefix_end(num_frozen_layers, frozen_embedding)
    if start >= costs.num_units:
        raise ValueError("the head never freezes")
    head_start = _stage_cost(costs, 0, start, start) if prefix_cost is None else prefix_cost
    weights = [costs.trained[u] for u in range(start, costs.num_units)]
    starts = PARTITIONERS[method](weights, pipe_len, head_start)
    bounds = [start + s for s in starts] + [costs.num_units]
    ranges = tuple((bounds[i], bounds[i + 1]) for i in range(pipe_len))
    stage_costs = tuple(
        _stage_cost(costs, a, b, start) + (head_start if i == 0 else 0.0)
        for i, (a, b) in enumerate(ranges)
    )
    return PipelinePlan(
        num_frozen_layers, pipe_len, start, ranges, stage_costs, frozen_embedding=frozen_embedding
    )


def fixed_plan(costs: UnitCosts, initial: PipelinePlan, num_frozen_layers: int) -> PipelinePlan:
    """AutoPipe off (the 'freeze only' ablation): the initial stages, frozen units inside them."""
    frozen_end = prefix_end(num_frozen_layers, initial.frozen_embedding)
    stage_costs = tuple(_stage_cost(costs, a, b, frozen_end) for a, b in initial.stage_ranges)
    return PipelinePlan(
        num_frozen_layers,
        initial.pipe_len,
        0,
        initial.stage_ranges,
        stage_costs,
        initial.num_micro_batches,
        initial.frozen_embedding,
    )


def stage_sizes(sizes: UnitCosts, plan: PipelinePlan) -> list[float]:
    """Each stage's size under `sizes` (parameter counts; frozen units at their frozen size),
    the frozen prefix on stage 0: Eq. 2's S_{p_k}."""
    frozen_end = plan.frozen_end
    prefix = _stage_cost(sizes, 0, plan.prefix_end, frozen_end)
    return [
        _stage_cost(sizes, a, b, frozen_end) + (prefix if stage == 0 else 0.0)
        for stage, (a, b) in enumerate(plan.stage_ranges)
    ]


@dataclass
class AutoPipePlanner:
    """Chooses the plan for each frozen boundary. Holds only the run's fixed inputs."""

    costs: UnitCosts  # what stages are balanced on
    initial_pipe_len: int
    method: str = "greedy"
    # Whether a plan's stages fit the device (autopipe/memory.py); None: memory is not limited.
    fits: Callable[[PipelinePlan], bool] | None = None
    # What the compression criterion compares (Eq. 2): parameter sizes, frozen units at
    # lambda_frozen. None: `costs` themselves (when they are parameter counts already).
    sizes: UnitCosts | None = None
    # freeze.embedding (with a freezing strategy): the embedding is part of the frozen
    # prefix from the start.
    frozen_embedding: bool = False
    initial: PipelinePlan = field(init=False)

    def __post_init__(self) -> None:
        if self.method not in PARTITIONERS:
            raise ValueError(f"unknown partition method '{self.method}'")
        if self.sizes is None:
            self.sizes = self.costs
        if self.sizes.num_units != self.costs.num_units:
            raise ValueError("one size per unit")
        self.initial = balance(
            self.costs,
            0,
            self.initial_pipe_len,
            self.method,
            frozen_embedding=self.frozen_embedding,
        )

    @property
    def initial_max_size(self) -> float:
        """M_GPU(0): the largest stage of the initial plan, in size."""
        return max(stage_sizes(self.sizes, self.initial))

    def plan(
        self,
        num_frozen_layers: int,
        current_pipe_len: int,
        prefix_cost: float | None = None,
        fits: Callable[[PipelinePlan], bool] | None = None,
    ) -> PipelinePlan:
        """The plan at `num_frozen_layers`: compressed as far as the criterion allows.
        `fits`: instead of the planner's own (PlanContext adds the move's memory)."""
        fits = fits or self.fits
        budget = self.initial_max_size * (1 + _TOLERANCE)
        active_units = self.costs.num_units - prefix_end(num_frozen_layers, self.frozen_embedding)
        pipe_len = current_pipe_len
        while pipe_len > active_units:  # never more stages than units
            pipe_len //= 2
        embedding = self.frozen_embedding
        plan = balance(self.costs, num_frozen_layers, pipe_len, self.method, prefix_cost, embedding)
        while plan.pipe_len % 2 == 0:
            packed = balance(
                self.costs,
                num_frozen_layers,
                plan.pipe_len // 2,
                self.method,
                prefix_cost,
                embedding,
            )
            if max(stage_sizes(self.sizes, packed)) > budget:
                break
            if fits is not None and not fits(packed):
                break
            plan = packed
        return plan
