"""The step-time model: predicted time of one optimizer step of a layout, from unit times and
stated link speeds. Pure arithmetic: no processes, no torch (planning/cluster.py applies it
to a planner's layout on a cluster; prediction_inputs.py finds its unit times).

One optimizer step of a layout (K stages, M micro-batches of m samples, R replicas):

    compute   GPipe and 1F1B: (M + K - 1) x the slowest stage's time for one micro-batch (forward +
              backward of its trained units; on stage 0 also the frozen prefix's work: its
              forward, a read from AutoCache, or a read and the forward of the layers
              frozen since the entry was written: `prefix_work_s`), the fill and drain of
              the pipeline included
              interleaved_1f1b (v chunks a rank, v > 1; at v = 1 it runs 1F1B):
              M x the busiest rank's time (its chunks' summed) + (K - 1) x the slowest
              chunk's: for equal chunks a bubble of (K - 1) / (v M + K - 1) of the step, 1/v
              of 1F1B's (Narayanan et al. 2021, arXiv:2104.04473, section 2.2)
              zero_bubble (any v): M x the busiest rank's time + (K - 1) x the largest
              max(F_c, I_c, F_c + I_c - W_c), the backward B_c split into input (I) and
              weight (W) gradients, W_c = WEIGHT_GRADIENT_SHARE x B_c: the weight gradients
              fill the bubble but not below a forward or an input gradient a hop. For v = 1
              and F, I >= W that is ZB-H1's (K - 1)(T_F + T_B - T_W) (Qi et al. 2023,
              arXiv:2401.10241, T_B their input gradient); with T_F = T_I = T_W a third of
              1F1B's bubble, and 1/v of that with v chunks
              Both are what the event simulation of torch's own orders gives for M >= K
              (tests/test_schedules.py), communication aside
    stage p2p the hidden state (and its gradient) sent between stages, per micro-batch,
              over the intra-node link; with v chunks a rank v times as many:
              2 (v M + K - 2) on the critical path
    all-reduce DDP's ring all-reduce of the slowest stage's trained gradients:
              2 (R - 1) / R x bytes / bandwidth (the inter-node link once replicas span nodes).
              With `overlap` (GPUs: DDP reduces each 25 MB bucket while the backward goes
              on, and the schedule lets it sync on the last micro-batch only) what that
              micro-batch's backward of the stage hides is not added, never the last
              bucket's share: the same treatment as a sharded layout's collectives below.
              Not under zero_bubble: its rank averages each chunk's gradients itself,
              started after that chunk's last weight gradient (pipe/gradient_sync.py:
              torch's split backward bypasses DDP), which only the rank's later weight
              gradients can hide: added in full until a GPU measures what they hide
              (benchmarks/zero_bubble_sync.py)
    optimizer AdamW / SGD touch each trained parameter's bytes about 7 / 4 times (parameter,
              gradient, state read and written): bytes / the device's memory bandwidth
    overhead  what a step costs beyond its units' kernels (Python, the schedule, the loss,
              data): a + b (M + K - 1), a per step and b per pipeline slot (v M + K - 1
              slots with v chunks a rank), fitted to the whole steps the trainer times when
              it chooses M (`calibrate_overhead`), 0 without them. Measured here, the gap
              between those steps and the rest of the model grows linearly with the slots
              (about 7 ms a slot for the quickstart's ViT on this CPU), so a per-step
              constant would not do

A sharded layout (FSDP2 over R replicas, one stage, the replica batch in M micro-batches
one after the other; `predict_sharded_step`):

    compute   the frozen prefix's work for the replica batch (as stage 0's), then per
              micro-batch every trained unit's forward and backward (forward: the unit's
              time without autograd; backward: the rest)
    gathers   per shard group (a layer, the embedding, the head: autopipe/memory.py's
              `shard_groups`), a ring all-gather of its parameters before its forward, and
              again before its backward (groups reshard after forward, all but the head):
              (R - 1) / R x bytes / bandwidth + (R - 1) latencies (float32: fsdp/runtime.py
              gathers what it trains; `gather_bytes_factor` 0.5 prices bfloat16 gathers)
    reduce-scatter per group after its backward, the same volume in float32 (gathers and
              reduce-scatters once per micro-batch: the gradients stay sharded)
    overlap   on GPUs FSDP2 runs collectives on their own stream and prefetches the next
              group's all-gather while a group computes: the step is replayed on two
              resources, compute and the link, each in FSDP2's order (forward: gather g+1
              during g; backward: gather g-1 during g, then g's reduce-scatter), and only
              what the compute does not hide counts. On a CPU (gloo) nothing overlaps: the
              collectives' whole time adds (`overlap=False`; measured here, docs/profiling.md)
    optimizer the shard's bytes (1/R of the trained ones), as above
    overhead  a + b M (a slot per micro-batch)

Unit times scale linearly with the micro-batch size from the profile's. An epoch is
`steps_per_epoch` such steps. Evaluation, transitions and start-up are not included.
Checked against measured epoch times on this project's machine in tests/test_predict.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipetransformer.autopipe.planner import PipelinePlan
from pipetransformer.config import MULTI_CHUNK_SCHEDULES, SCHEDULE_PROPERTIES, layout_schedule

# DDP's default bucket_cap_mb: the last bucket's all-reduce starts after the backward ends.
DDP_BUCKET_BYTES = 25 * 2**20
# The weight gradients' share of a unit's backward (zero_bubble's W; the rest is I): a linear
# layer's backward is two matrix multiplies of its forward's size, one for each.
WEIGHT_GRADIENT_SHARE = 0.5


@dataclass(frozen=True)
class CollectiveCost:
    """A collective's measured seconds on some processes: `latency_s + bytes / bytes_per_s`,
    bytes the whole (gathered, or to be scattered) tensor's."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class Links:
    """Bandwidths in bytes per second and a fixed latency per message: `latency_s` inside a
    node, `inter_node_latency_s` between nodes (None: the same). `all_gather` and
    `reduce_scatter`: what those collectives measured on the processes a prediction is for
    (gloo on a CPU runs them far from a ring's (R - 1) / R of the bytes); None: the ring."""

    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    latency_s: float = 20e-6
    inter_node_latency_s: float | None = None
    all_gather: CollectiveCost | None = None
    reduce_scatter: CollectiveCost | None = None


@dataclass(frozen=True)
class UnitTimes:
    """Per unit, seconds for one micro-batch of `micro_batch_size` samples."""

    trained_s: tuple[float, ...]  # forward + backward
    frozen_s: tuple[float, ...]  # forward without autograd
    output_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    micro_batch_size: int
    cache_read_s_per_sample: float = 0.0
    memory_bytes_per_s: float = 2e12  # the device's memory bandwidth (the optimizer's step)
    optimizer_passes: float = 7.0  # AdamW: parameter, gradient, two moments read; three written
    step_overhead_s: float = 0.0
    slot_overhead_s: float = 0.0  # per micro-batch slot of the schedule: (M + K - 1) of them a step


@dataclass(frozen=True)
class StepPrediction:
    compute_s: float
    p2p_s: float
    allreduce_s: float  # DDP's all-reduce; a sharded layout's collectives not hidden by compute
    optimizer_s: float = 0.0
    overhead_s: float = 0.0
    hidden_s: float = 0.0  # a sharded layout's collective time that compute hides (not added)
    # compute over the busiest rank's own work (interleaved_1f1b, zero_bubble); None: the
    # one-chunk schedules' (M + K - 1) / M
    bubble_factor: float | None = None

    @property
    def step_s(self) -> float:
        return self.compute_s + self.p2p_s + self.allreduce_s + self.optimizer_s + self.overhead_s


def prefix_work(
    frozen_s: Sequence[float], read_s: float, prefix_end: int, cached: dict[int, float]
) -> float:
    """Seconds the frozen prefix, units [0, prefix_end), costs stage 0 per micro-batch, when
    a share `cached[e]` of the samples have an AutoCache entry taken at unit `e`
    (0 < e <= prefix_end) and the rest none: a sample cached at prefix_end is read (`read_s`
    a micro-batch), one cached lower is read and taken through units [e, prefix_end) (an
    upgrade), one without an entry runs the whole prefix (AutoCache's hits, upgrades and
    misses, pipe/prefix.py). `frozen_s`: each unit's forward without autograd."""
    work = sum(frozen_s[:prefix_end]) * max(0.0, 1 - sum(cached.values()))
    for end, share in cached.items():
        if not 0 < end <= prefix_end:
            raise ValueError(f"an entry at unit {end} cannot serve a prefix of {prefix_end}")
        work += share * (read_s + sum(frozen_s[end:prefix_end]))
    return work


def prefix_work_s(times: UnitTimes, prefix_end: int, cached: dict[int, float]) -> float:
    """`prefix_work` per micro-batch of the profile's size, from `times`."""
    read = times.cache_read_s_per_sample * times.micro_batch_size
    return prefix_work(times.frozen_s, read, prefix_end, cached)


def predict_step(
    times: UnitTimes,
    plan: PipelinePlan,
    *,
    micro_batch_size: int,
    num_micro_batches: int,
    dp_degree: int,
    replicas_per_node: int,
    links: Links,
    cached_prefix: bool = False,
    prefix_s: float | None = None,
    overlap: bool = False,
    schedule: str = "gpipe",
) -> StepPrediction:
    """`prefix_s`: the frozen prefix's seconds per micro-batch of the profile's size
    (`prefix_work_s`); None: read from the cache (`cached_prefix`) or computed in full.
    `overlap`: DDP's all-reduce overlaps the last micro-batch's backward (GPUs).
    `schedule`: pipeline.schedule (with `plan.virtual_stages`, what the layout runs)."""
    scale = micro_batch_size / times.micro_batch_size
    frozen_end = plan.frozen_end
    if prefix_s is None:
        prefix_s = prefix_work_s(
            times, plan.prefix_end, {plan.prefix_end: 1.0} if cached_prefix else {}
        )
    k, m = plan.pipe_len, num_micro_batches
    runs = layout_schedule(schedule, k, plan.virtual_stages)
    bubble_factor = None
    if runs in MULTI_CHUNK_SCHEDULES:
        compute, bubble_factor = _chunked_compute(times, plan, scale, prefix_s, m, runs)
        slots = plan.virtual_stages * m + k - 1  # a forward and a backward a chunk a slot
    else:
        stage_s = []
        for stage, (start, end) in enumerate(plan.stage_ranges):
            seconds = sum(
                times.frozen_s[u] if u < frozen_end else times.trained_s[u]
                for u in range(start, end)
            )
            if stage == 0 and plan.prefix_end > 0:
                seconds += prefix_s
            stage_s.append(seconds * scale)
        compute = (m + k - 1) * max(stage_s)
        slots = m + k - 1
    p2p = 0.0
    if k > 1:  # forward activation and backward gradient across each boundary, per micro-batch
        boundary_bytes = (
            max(times.output_bytes[end - 1] for _, end in plan.stage_ranges[:-1]) * scale
        )
        p2p = 2 * (slots - 1) * (links.latency_s + boundary_bytes / links.intra_node_bytes_per_s)
    trained = [[u for u in plan.stage_units(s) if u >= frozen_end] for s in range(k)]
    grads = max(sum(times.param_bytes[u] for u in units) for units in trained)
    allreduce = 0.0
    if dp_degree > 1:
        spans_nodes = dp_degree > replicas_per_node
        bandwidth = links.inter_node_bytes_per_s if spans_nodes else links.intra_node_bytes_per_s
        latency = links.latency_s
        if spans_nodes and links.inter_node_latency_s is not None:
            latency = links.inter_node_latency_s
        allreduce = (
            2 * (dp_degree - 1) / dp_degree * grads / bandwidth + 2 * (dp_degree - 1) * latency
        )
    hidden = 0.0
    # A split backward (zero_bubble) writes the weight gradients past DDP: its rank averages
    # each chunk's after its last weight gradient (pipe/gradient_sync.py), behind what is
    # left of the step at most: priced in full until measured on a GPU.
    after_step = runs is not None and SCHEDULE_PROPERTIES[runs].split_backward
    if overlap and allreduce > 0 and not after_step:
        backward = max(
            scale * sum(times.trained_s[u] - times.frozen_s[u] for u in units) for units in trained
        )
        last_bucket = min(1.0, DDP_BUCKET_BYTES / grads) * allreduce
        hidden = min(backward, allreduce - last_bucket)
    optimizer = times.optimizer_passes * grads / times.memory_bytes_per_s
    overhead = times.step_overhead_s + slots * times.slot_overhead_s
    return StepPrediction(
        compute, p2p, allreduce - hidden, optimizer, overhead, hidden, bubble_factor
    )


def _chunked_compute(
    times: UnitTimes,
    plan: PipelinePlan,
    scale: float,
    prefix_s: float,
    num_micro_batches: int,
    schedule: str,
) -> tuple[float, float]:
    """(compute seconds, compute over the busiest rank's work) of a step of interleaved_1f1b
    or zero_bubble (the module docstring): chunk c's forward F_c (its units' forward; the
    frozen prefix's work on chunk 0) and backward B_c = I_c + W_c, W_c its
    WEIGHT_GRADIENT_SHARE."""
    frozen_end = plan.frozen_end
    chunk_s, fill_s = [], []
    for chunk, (start, end) in enumerate(plan.stage_ranges):
        forward = sum(times.frozen_s[u] for u in range(start, end))
        backward = sum(
            times.trained_s[u] - times.frozen_s[u] for u in range(start, end) if u >= frozen_end
        )
        if chunk == 0 and plan.prefix_end > 0:
            forward += prefix_s
        weight = WEIGHT_GRADIENT_SHARE * backward
        chunk_s.append(scale * (forward + backward))
        inputs = backward - weight
        fill_s.append(scale * max(forward, inputs, forward + inputs - weight))
    busiest = max(sum(chunk_s[c] for c in plan.chunks_of_stage(s)) for s in range(plan.pipe_len))
    hops = plan.pipe_len - 1
    fill = max(fill_s) if SCHEDULE_PROPERTIES[schedule].split_backward else max(chunk_s)
    compute = num_micro_batches * busiest + hops * fill
    return compute, compute / (num_micro_batches * busiest)


def calibrate_overhead(gaps: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(per step, per slot) overhead: the least-squares line through what whole measured
    steps took beyond the prediction without overhead, as (slots = M + K - 1, seconds)
    pairs; neither part below 0."""
    if not gaps:
        return 0.0, 0.0
    xs, ys = [float(x) for x, _ in gaps], [y for _, y in gaps]
    n, mean_x, mean_y = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread > 0 else 0.0
    if slope <= 0:
        return max(0.0, sorted(ys)[n // 2]), 0.0
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # through the origin instead
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return intercept, slope


def _ring_s(num_bytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """A ring all-gather or reduce-scatter of `num_bytes` (the whole tensor) over `ranks`."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * num_bytes / bandwidth + (ranks - 1) * latency


def predict_sharded_step(
    times: UnitTimes,
    plan: PipelinePlan,
    groups: Sequence[Sequence[int]],
    *,
    micro_batch_size: int,
    num_micro_batches: int,
    shards: int,
    spans_nodes: bool,
    links: Links,
    prefix_s: float = 0.0,
    overlap: bool = True,
    gather_bytes_factor: float = 1.0,
) -> StepPrediction:
    """One step of a sharded layout (see the module docstring). `groups`: the trained units
    of each shard group in forward order (the last, the head's, does not reshard after
    forward); `prefix_s`: the frozen prefix's work per micro-batch of the profile's size."""
    if plan.pipe_len != 1:
        raise ValueError("a sharded layout is one stage")
    m = num_micro_batches
    scale = micro_batch_size / times.micro_batch_size
    bandwidth = links.inter_node_bytes_per_s if spans_nodes else links.intra_node_bytes_per_s
    latency = links.latency_s
    if spans_nodes and links.inter_node_latency_s is not None:
        latency = links.inter_node_latency_s
    forward = [scale * sum(times.frozen_s[u] for u in g) for g in groups]
    backward = [scale * sum(times.trained_s[u] - times.frozen_s[u] for u in g) for g in groups]
    param_bytes = [sum(times.param_bytes[u] for u in g) for g in groups]

    def cost(measured: CollectiveCost | None, num_bytes: float) -> float:
        if shards <= 1:
            return 0.0
        if measured is not None:
            return measured.seconds(num_bytes)
        return _ring_s(num_bytes, shards, bandwidth, latency)

    gather = [cost(links.all_gather, b * gather_bytes_factor) for b in param_bytes]
    scatter = [cost(links.reduce_scatter, b) for b in param_bytes]
    regathered = [i != len(groups) - 1 for i in range(len(groups))]
    prefix = prefix_s * scale * m  # the whole replica batch's, before the first micro-batch
    compute = prefix + m * (sum(forward) + sum(backward))
    collectives = sum(gather) + sum(g for g, again in zip(gather, regathered) if again)
    collectives = m * (collectives + sum(scatter))
    step = prefix + m * _replay(0.0, forward, backward, gather, scatter, regathered)
    exposed = step - compute if overlap else collectives
    trained = sum(param_bytes) / max(1, shards)
    return StepPrediction(
        compute_s=compute,
        p2p_s=0.0,
        allreduce_s=exposed,
        optimizer_s=times.optimizer_passes * trained / times.memory_bytes_per_s,
        overhead_s=times.step_overhead_s + m * times.slot_overhead_s,
        hidden_s=collectives - exposed,
    )


def _replay(
    prefix: float,
    forward: Sequence[float],
    backward: Sequence[float],
    gather: Sequence[float],
    scatter: Sequence[float],
    regathered: Sequence[bool],
) -> float:
    """The step's end on two resources, compute and the link, each busy with one thing at a
    time in FSDP2's order: forward gathers group g + 1 while g computes (issued once g's
    gather is done and g has started), backward gathers g - 1 while g computes, then
    reduce-scatters g."""
    count = len(forward)
    if count == 0:
        return prefix
    compute, link = prefix, gather[0]
    ready = {0: link}
    for g in range(count):
        start = max(compute, ready[g])
        if g + 1 < count:
            link = max(link, start) + gather[g + 1]
            ready[g + 1] = link
        compute = start + forward[g]
    ready = {count - 1: compute}  # the head keeps its parameters for its backward
    for g in reversed(range(count)):
        if g not in ready:  # a group that reshards: gathered when its turn comes
            link = max(link, compute) + gather[g]
            ready[g] = link
        start = max(compute, ready[g])
        if g > 0 and regathered[g - 1]:
            link = max(link, start) + gather[g - 1]
            ready[g - 1] = link
        compute = start + backward[g]
        link = max(link, compute) + scatter[g]
    return max(compute, link)
