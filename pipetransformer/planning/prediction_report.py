"""The text form of `plan --predict` (`--json` prints `Prediction.to_dict()` instead): the
cluster and where the unit times came from, a row per frozen boundary, the trajectory, and
the run against Pipe+DDP, DDP, freeze + DDP, FSDP2 and freeze + FSDP2.

Owns: `format_prediction`. Must not: compute anything predict.py has not.
"""

from __future__ import annotations

from pipetransformer.config import MULTI_CHUNK_SCHEDULES, TORCH_SCHEDULE_CLASS
from pipetransformer.planning.context import format_bytes
from pipetransformer.planning.predict import Prediction
from pipetransformer.planning.prediction_peers import PeerPrediction
from pipetransformer.planning.prediction_run import EpochPrediction

# compare's variant names (compare/report.py) -> how the table names them.
PEER_LABELS = {
    "baseline": "Pipe+DDP",
    "ddp": "DDP",
    "freeze_ddp": "freeze+DDP",
    "fsdp": "FSDP2",
    "freeze_fsdp": "freeze+FSDP2",
}


def _link_text(name: str | None, gbps: float) -> str:
    return f"{name} ({gbps:g} GB/s)" if name else f"{gbps:g} GB/s"


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.2f} min"


def _peer_text(result: Prediction, peer: PeerPrediction) -> str:
    label = PEER_LABELS.get(peer.name, peer.name)
    layout = f"{label} (K={peer.pipe_len}, R={peer.dp_degree}, M={peer.num_micro_batches})"
    if peer.problem is not None:
        return f"{layout}: cannot run ({peer.problem})"
    if not peer.fits:
        return (
            f"{layout}: does not fit (needs {format_bytes(peer.peak_bytes)}, "
            f"has {format_bytes(result.device_memory_bytes)})"
        )
    return (
        f"{layout}: {_duration(peer.run_s)}; "
        f"PipeTransformer's speedup over it {result.speedup_over(peer):.2f}x"
    )


def _change(start, end) -> str:
    return f"{start}" if start == end else f"{start}->{end}"


def _epoch_line(e: EpochPrediction) -> str:
    start = f"{e.pipe_len}x{e.dp_degree}{'s' if e.sharded else ''}"
    end = f"{e.final_pipe_len}x{e.final_dp_degree}{'s' if e.final_sharded else ''}"
    layouts = _change(start, end)
    frozen = _change(e.num_frozen_layers, e.final_num_frozen_layers)
    return (
        f"{e.epoch:>6} {frozen:>9} {layouts:>11} {e.steps:>7} {_duration(e.seconds):>11}  "
        f"{e.prefix}"
    )


def format_prediction(result: Prediction) -> str:
    devices = result.device or "devices"
    budget = (
        f"; stages may use {format_bytes(result.device_memory_bytes)} of a device"
        if result.device_memory_bytes is not None
        else ""
    )
    samples_source = f" ({result.steps_per_epoch_source})" if result.steps_per_epoch_source else ""
    if result.batch_per_replica is not None:
        batch = (
            f"{result.batch_per_replica} samples a replica, a global batch of "
            f"{result.global_batch_size} at the start that grows with the replicas"
        )
    else:
        batch = f"a global batch of {result.global_batch_size}"
    lines = [
        f"predicted for {result.nodes} node(s) x {result.devices_per_node} {devices}, links "
        f"{_link_text(result.intra_node_link, result.intra_node_gbps)} in a node, "
        f"{_link_text(result.inter_node_link, result.inter_node_gbps)} between nodes{budget}",
        f"unit profile {result.unit_profile_source} (micro-batch "
        f"{result.profile_micro_batch_size})",
        f"{result.train_samples} training samples an epoch{samples_source}; {batch}: "
        f"{result.steps_per_epoch} steps an epoch at the start",
        "steady state per frozen boundary (the layout the run holds there, the prefix read "
        "from AutoCache where it serves; s: sharded, FSDP2 over every device):",
    ]
    chunked = result.schedule in MULTI_CHUNK_SCHEDULES
    if chunked:
        lines.append(
            f"schedule {result.schedule} ({TORCH_SCHEDULE_CLASS[result.schedule]}): v chunks "
            "a stage; bubble: a step's compute over its busiest rank's work"
        )
    v = f" {'v':>2}" if chunked else ""
    lines.append(
        f"{'frozen':>6} {'K':>3}{v} {'R':>3} {'M':>3} {'bubble':>7} {'compute':>10} {'p2p':>9} "
        f"{'all-reduce':>10} {'optimizer':>10} {'overhead':>9} {'step':>10} {'memory':>10}"
    )
    for r in result.rows:
        v = f" {r.virtual_stages:>2}" if chunked else ""
        lines.append(
            f"{r.num_frozen_layers:>6} {r.pipe_len:>3}{v} {r.dp_degree:>3}"
            f"{'s' if r.sharded else ' '}"
            f"{r.num_micro_batches:>3} "
            f"{r.bubble:>7.2f} {1e3 * r.compute_s:>8.2f}ms {1e3 * r.p2p_s:>7.2f}ms "
            f"{1e3 * r.allreduce_s:>8.2f}ms {1e3 * r.optimizer_s:>8.2f}ms "
            f"{1e3 * r.overhead_s:>7.2f}ms {1e3 * r.step_s:>8.2f}ms "
            f"{format_bytes(r.peak_bytes):>10}"
        )
    lines += [
        f"trajectory (frozen layers per epoch): {result.trajectory}",
        "the run, epoch by epoch (frozen prefix: computed, filled into the cache, upgraded "
        "from an older entry, read):",
        f"{'epoch':>6} {'frozen':>9} {'K x R':>11} {'steps':>7} {'time':>11}  prefix",
        *(_epoch_line(e) for e in result.epochs),
        f"PipeTransformer: {_duration(result.elastic_s)} of training; against what users "
        "run instead:",
        *(f"  {_peer_text(result, peer)}" for peer in [result.baseline, *result.peers]),
    ]
    return "\n".join(lines)
