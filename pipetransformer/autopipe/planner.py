"""AutoPipe planning: which units each pipeline stage runs, and how short the pipeline can be.

Pure functions of plain values; no processes, no torch.

Unit space (see models/layered.py): 0 = embedding, 1 + 2l / 2 + 2l = layer l's attention /
MLP sublayer, last = head. A chunk is a contiguous range of units, so a boundary never
cuts a residual connection; a stage (a rank of the pipeline) runs one chunk, or under
interleaved_1f1b and zero_bubble v chunks placed round-robin (chunk c on stage c mod K,
torch's looped placement; config/schedules.py decides v for each K and boundary). With F
layers frozen, units [0, prefix_end) are the frozen prefix: they run on the first stage's
device as input preprocessing (no backward), and count on chunk 0 at their forward-only
cost.

Balancing: `greedy` fills each chunk towards the average cost of the chunks still to fill,
keeping a unit only when that lands closer to the average: the idea of the paper's
Algorithm 1 (`load_balance`), whose test is `stage + unit < mean + variance`; this one has no
variance term. `optimal` minimises the largest chunk exactly (dynamic programming). Costs
are measured seconds (`pipeline.balance: time`) or parameter counts (`params`, the
paper's), the frozen prefix counted on stage 0.

Compression (the paper's Eq. 2, section 3.2.2): from the current K, try K/2 while the
largest stage of the packed plan, in *parameter size* with the frozen prefix at
`lambda_frozen` of its size on stage 0 (Algorithm 1, line 28) and a stage's chunks summed
(what its rank holds), is no larger than the largest stage of the initial plan (F = 0,
K = initial_pipe_len, with its chunks), and, when memory is limited, every stage of the
packed plan fits the device (autopipe/memory.py); with several chunks a stage, the packed
plan takes the most chunks that pass. Parameter size is the paper's proxy for a stage's
memory; it is compared whatever the stages were balanced on, because packing is a question
of memory: a packed layout does the same work per sample on half the stages with a smaller
bubble. K only halves; it always divides the devices of a node because the initial K does.

`autopipe.compression: memory` asks what the proxy stands for (section 3.2.2: the memory cost
of the largest partition after compression against that of the largest partition at T=0,
the parameter size standing in "to avoid extensive memory profiling"; the largest partition
at T=0 stands for what a device holds): with a device budget (`fits`), the packed plan is
taken when every stage fits it, by the memory model of autopipe/memory.py at the layout's
own micro-batches and replicas; without one, when its largest stage's predicted peak bytes
(`peak_bytes`) are no more than the initial plan's. The proxy counts a frozen unit at
lambda_frozen of its size and ignores activations, gradients and optimizer state, so where
a large frozen embedding sits on stage 0 (a pretrained encoder fine-tuned with its embedding
frozen) it holds a pipeline that the device's memory would already pack: MiniLM at 228 MiB a
process packs its 2-stage pipeline at 3 frozen layers of 6 by memory, at 5 by the proxy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipetransformer.config import virtual_stages_for
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
    """One layout of one pipeline: which units each chunk runs, on which stage, and what
    that costs.

    A chunk (virtual stage; torch's stage_index, one PipelineStage) is a contiguous range of
    units. With one chunk a stage (gpipe, 1f1b; `virtual_stages` 1) chunk s is stage s.
    With v > 1 (interleaved_1f1b, zero_bubble) the K v chunks follow each other in pipeline
    order and chunk c runs on stage c mod K (the looped placement): stage s holds chunks
    s, s + K, ..., units that are not contiguous. `stage_ranges` and `stage_costs` are per
    chunk; `stage_units`, `stage_loads` and `stage_of_unit` per stage (a rank's)."""

    num_frozen_layers: int
    pipe_len: int
    prefix_end: int  # units [0, prefix_end) run as preprocessing before chunk 0
    stage_ranges: tuple[tuple[int, int], ...]  # [start, end) per chunk, covering [prefix_end, U)
    stage_costs: tuple[float, ...]  # per chunk; chunk 0 includes the preprocessing cost
    num_micro_batches: int = 1
    frozen_embedding: bool = False  # freeze.embedding: the embedding frozen from the start
    virtual_stages: int = 1  # chunks a stage holds (v)

    def __post_init__(self) -> None:
        if len(self.stage_ranges) != self.pipe_len * self.virtual_stages:
            raise ValueError(
                f"{len(self.stage_ranges)} chunks for {self.pipe_len} stages of "
                f"{self.virtual_stages} chunks"
            )

    @property
    def frozen_end(self) -> int:
        """Units below this are frozen (some may sit inside stages when AutoPipe is off)."""
        return prefix_end(self.num_frozen_layers, self.frozen_embedding)

    @property
    def num_chunks(self) -> int:
        return len(self.stage_ranges)

    @property
    def max_stage_cost(self) -> float:
        """The largest stage's cost: with several chunks a stage, the sum of its chunks'."""
        if self.virtual_stages == 1:
            return max(self.stage_costs)
        return max(self.stage_loads)

    @property
    def stage_loads(self) -> tuple[float, ...]:
        """Each stage's cost: the sum of its chunks' (`stage_costs` with one chunk a stage)."""
        if self.virtual_stages == 1:
            return self.stage_costs
        return tuple(
            sum(self.stage_costs[c] for c in self.chunks_of_stage(s)) for s in range(self.pipe_len)
        )

    def stage_of_chunk(self, chunk: int) -> int:
        return chunk % self.pipe_len

    def chunks_of_stage(self, stage: int) -> list[int]:
        """The chunks stage `stage` runs, in pipeline order (torch's local stages)."""
        return list(range(stage, self.num_chunks, self.pipe_len))

    def chunk_of_unit(self, unit: int) -> int | None:
        for chunk, (start, end) in enumerate(self.stage_ranges):
            if start <= unit < end:
                return chunk
        return None

    def stage_of_unit(self, unit: int) -> int | None:
        """The stage whose rank runs `unit` (None: the frozen prefix, or no such unit)."""
        chunk = self.chunk_of_unit(unit)
        return None if chunk is None else self.stage_of_chunk(chunk)

    def stage_unit_ranges(self, stage: int) -> list[tuple[int, int]]:
        """The unit ranges of the chunks stage `stage` runs, in pipeline order."""
        return [self.stage_ranges[c] for c in self.chunks_of_stage(stage)]

    def stage_units(self, stage: int) -> list[int]:
        return [u for start, end in self.stage_unit_ranges(stage) for u in range(start, end)]

    def units_of_first_stage_rank(self) -> list[int]:
        """The first stage's device runs the preprocessing units and its own."""
        return list(range(0, self.prefix_end)) + self.stage_units(0)

    def to_dict(self) -> dict:
        record = {
            "num_frozen_layers": self.num_frozen_layers,
            "pipe_len": self.pipe_len,
            "prefix_end": self.prefix_end,
            "stage_ranges": [list(r) for r in self.stage_ranges],
            "stage_costs": list(self.stage_costs),
            "num_micro_batches": self.num_micro_batches,
        }
        if self.virtual_stages > 1:  # records of one-chunk plans stay as they were
            record["virtual_stages"] = self.virtual_stages
        return record


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
    virtual_stages: int = 1,
) -> PipelinePlan:
    """Split the active units over `pipe_len` stages of `virtual_stages` chunks each (K v
    chunks in pipeline order, balanced on `costs`); the frozen prefix precedes chunk 0.

    `prefix_cost` overrides the frozen prefix's cost on chunk 0 (e.g. a cache read);
    `frozen_embedding`: the embedding is frozen from the start (`freeze.embedding`).
    """
    start = prefix_end(num_frozen_layers, frozen_embedding)
    if start >= costs.num_units:
        raise ValueError("the head never freezes")
    head_start = _stage_cost(costs, 0, start, start) if prefix_cost is None else prefix_cost
    weights = [costs.trained[u] for u in range(start, costs.num_units)]
    num_chunks = pipe_len * virtual_stages
    starts = PARTITIONERS[method](weights, num_chunks, head_start)
    bounds = [start + s for s in starts] + [costs.num_units]
    ranges = tuple((bounds[i], bounds[i + 1]) for i in range(num_chunks))
    stage_costs = tuple(
        _stage_cost(costs, a, b, start) + (head_start if i == 0 else 0.0)
        for i, (a, b) in enumerate(ranges)
    )
    return PipelinePlan(
        num_frozen_layers,
        pipe_len,
        start,
        ranges,
        stage_costs,
        frozen_embedding=frozen_embedding,
        virtual_stages=virtual_stages,
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
        initial.virtual_stages,
    )


def stage_sizes(sizes: UnitCosts, plan: PipelinePlan) -> list[float]:
    """Each stage's size under `sizes` (parameter counts; frozen units at their frozen size),
    the frozen prefix on stage 0, a stage's chunks summed: Eq. 2's S_{p_k}, what a rank
    holds."""
    frozen_end = plan.frozen_end
    prefix = _stage_cost(sizes, 0, plan.prefix_end, frozen_end)
    chunks = [
        _stage_cost(sizes, a, b, frozen_end) + (prefix if chunk == 0 else 0.0)
        for chunk, (a, b) in enumerate(plan.stage_ranges)
    ]
    if plan.virtual_stages == 1:
        return chunks
    return [sum(chunks[c] for c in plan.chunks_of_stage(s)) for s in range(plan.pipe_len)]


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
    # pipeline.schedule and pipeline.virtual_stages: the chunks a stage holds, decided again
    # for every K and frozen boundary (config/schedules.py `virtual_stages_for`).
    schedule: str = "gpipe"
    virtual_stages: int | str = "auto"
    # autopipe.compression 'memory': a plan's largest stage's predicted peak bytes, which
    # the criterion then compares instead of parameter sizes (module docstring). None: Eq. 2
    # on `sizes`.
    peak_bytes: Callable[[PipelinePlan], float] | None = None
    initial: PipelinePlan = field(init=False)

    def __post_init__(self) -> None:
        if self.method not in PARTITIONERS:
            raise ValueError(f"unknown partition method '{self.method}'")
        if self.sizes is None:
            self.sizes = self.costs
        if self.sizes.num_units != self.costs.num_units:
            raise ValueError("one size per unit")
        self.initial = self.balanced(0, self.initial_pipe_len)

    @property
    def initial_max_size(self) -> float:
        """M_GPU(0): the largest stage of the initial plan, in size (a rank's chunks summed),
        or in predicted peak bytes under autopipe.compression 'memory'."""
        return self.largest_stage(self.initial)

    def largest_stage(self, plan: PipelinePlan) -> float:
        """M_GPU of `plan`: what the compression criterion compares (module docstring)."""
        if self.peak_bytes is not None:
            return self.peak_bytes(plan)
        return max(stage_sizes(self.sizes, plan))

    def active_units(self, num_frozen_layers: int) -> int:
        return self.costs.num_units - prefix_end(num_frozen_layers, self.frozen_embedding)

    def balanced(
        self,
        num_frozen_layers: int,
        pipe_len: int,
        prefix_cost: float | None = None,
        virtual_stages: int | None = None,
    ) -> PipelinePlan:
        """The balanced plan of `pipe_len` stages at `num_frozen_layers`, with the chunks a
        stage holds there (`virtual_stages`, default the most the schedule and the active
        units allow; one for gpipe and 1f1b)."""
        chunks = virtual_stages or self.most_virtual_stages(num_frozen_layers, pipe_len)
        return balance(
            self.costs,
            num_frozen_layers,
            pipe_len,
            self.method,
            prefix_cost,
            self.frozen_embedding,
            chunks,
        )

    def most_virtual_stages(self, num_frozen_layers: int, pipe_len: int) -> int:
        active = self.active_units(num_frozen_layers)
        return virtual_stages_for(self.schedule, self.virtual_stages, pipe_len, active)

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
        active_units = self.active_units(num_frozen_layers)
        pipe_len = current_pipe_len
        while pipe_len > active_units:  # never more stages than units
            pipe_len //= 2
        plan = self.balanced(num_frozen_layers, pipe_len, prefix_cost)
        while plan.pipe_len % 2 == 0:
            packed = self._packed(num_frozen_layers, plan.pipe_len // 2, prefix_cost, fits)
            if packed is None:
                break
            plan = packed
        return plan

    def _packed(
        self,
        num_frozen_layers: int,
        pipe_len: int,
        prefix_cost: float | None,
        fits: Callable[[PipelinePlan], bool] | None,
    ) -> PipelinePlan | None:
        """The plan of `pipe_len` stages if Eq. 2 (its largest stage's size, a rank's chunks
        summed, against the initial plan's) and `fits` allow it, else None. With several
        chunks a stage, from the most chunks down: few units cut into many chunks can leave a
        rank with more than its share (chunk 0 carries the frozen prefix), where fewer
        chunks pack."""
        budget = self.initial_max_size * (1 + _TOLERANCE)
        # By memory with a device budget, fitting it is the criterion (module docstring).
        by_fit = self.peak_bytes is not None and fits is not None
        for chunks in range(self.most_virtual_stages(num_frozen_layers, pipe_len), 0, -1):
            packed = self.balanced(num_frozen_layers, pipe_len, prefix_cost, chunks)
            if not by_fit and self.largest_stage(packed) > budget:
                continue
            if fits is not None and not fits(packed):
                continue
            return packed
        return None
