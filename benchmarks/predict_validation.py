"""`plan --predict` against measured epoch times: the steady epochs (the layout already in
effect the epoch before, no transition inside it) of the runs of one or more `compare`
directories, grouped by run and layout (the median epoch: single epochs of a few seconds
vary by +-20% on a shared VM), predicted from the unit profile those runs measured, this
machine's measured memory and loopback bandwidth, and the per-step overhead calibrated
from the trainer's own micro-batch timings. Prints predicted vs measured and writes the
records (with everything the prediction needs) to --out, which tests/test_predict.py
recomputes. From the repository root:

    python benchmarks/predict_validation.py runs/compare/quickstart runs/bench_bert_sst2 \\
        --out docs/benchmarks/predict_validation.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import machine

from pipetransformer.autopipe.profiles import ProfileStore
from pipetransformer.config import load_config
from pipetransformer.launcher import launch_local
from pipetransformer.planning import describe_model, profiling_micro_batch_size
from pipetransformer.planning.cluster import layout_epoch_s, unit_times
from pipetransformer.planning.prediction_inputs import calibrated_times
from pipetransformer.planning.profile_keys import unit_profile_key_for
from pipetransformer.planning.step_model import CollectiveCost, Links
from pipetransformer.utils.files import read_jsonl, write_json_atomic


def memory_bandwidth() -> float:
    """Bytes per second one core copies (read + write) through a tensor larger than its caches."""
    torch.set_num_threads(1)
    source = torch.ones(64 * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    return 10 * 2 * source.nbytes / (time.perf_counter() - start)


def _allreduce_worker(out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tensor = torch.ones(8 * 2**20)  # 32 MB
    dist.all_reduce(tensor)
    start = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(tensor)
    seconds = (time.perf_counter() - start) / 5
    if dist.get_rank() == 0:
        # A ring all-reduce moves 2 (R - 1) / R of the bytes through each link.
        Path(out).write_text(str(tensor.nbytes / seconds))
    dist.destroy_process_group()


def link_bandwidth() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bw")
        launch_local(2, _allreduce_worker, (out,))
        return float(Path(out).read_text())


def _collectives_worker(out: str) -> None:
    """FSDP2's collectives on 2 gloo processes: the median of 7 calls at 4, 16 and 64 MB."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    sizes = [4 * 2**20, 16 * 2**20, 64 * 2**20]
    found: dict[str, list[list[float]]] = {"all_gather": [], "reduce_scatter": []}
    for size in sizes:
        full, shard = torch.ones(size // 4), torch.ones(size // 8)
        calls = {
            "all_gather": lambda f=full, s=shard: dist.all_gather_into_tensor(f, s),
            "reduce_scatter": lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f),
        }
        for name, call in calls.items():
            call()
            seconds = []
            for _ in range(7):
                dist.barrier()
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
            found[name].append([size, statistics.median(seconds)])
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


def collective_costs() -> dict[str, list[float]]:
    """(latency s, bytes/s) of gloo's all-gather and reduce-scatter on 2 processes: the
    least-squares line through the measured medians (bytes: the whole tensor)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives")
        launch_local(2, _collectives_worker, (out,))
        found = json.loads(Path(out).read_text())
    costs = {}
    for name, points in found.items():
        slope, intercept = statistics.linear_regression(
            [b for b, _ in points], [s for _, s in points]
        )
        costs[name] = [max(0.0, intercept), 1.0 / slope]
    return costs


def links_of(record: dict) -> Links:
    """The links a validation file's predictions used (the collectives where it has them)."""
    bandwidth = record["link_bytes_per_s"]
    measured = {
        name: CollectiveCost(*record[name])
        for name in ("all_gather", "reduce_scatter")
        if name in record
    }
    return Links(bandwidth, bandwidth, **measured)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("compare_dirs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--bandwidths-from",
        default=None,
        help="reuse the memory and link bandwidths of an earlier output file "
        "instead of measuring them (when the machine is busy now)",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the records already in --out (of runs no longer on disk) and add these",
    )
    args = parser.parse_args()
    if args.bandwidths_from:
        earlier = json.loads(Path(args.bandwidths_from).read_text())
        memory_bps, link_bps = earlier["memory_bytes_per_s"], earlier["link_bytes_per_s"]
        collectives = {k: earlier[k] for k in ("all_gather", "reduce_scatter") if k in earlier}
    else:
        memory_bps, link_bps = memory_bandwidth(), link_bandwidth()
        collectives = {}
    if not collectives:  # measured now (files older than the sharded layouts lack them)
        collectives = collective_costs()
    links = links_of({"link_bytes_per_s": link_bps, **collectives})
    entries = []
    for compare_dir in map(Path, args.compare_dirs):
        for run_dir in sorted(p for p in compare_dir.iterdir() if (p / "metrics.jsonl").exists()):
            # Each run's own measurements (older compare directories shared one file).
            shared = compare_dir / "profiles" / "profiles.json"
            store = ProfileStore(run_dir / "profiles.json" if not shared.exists() else shared)
            store.load()
            config = load_config(str(run_dir / "config.yaml"))
            spec = describe_model(config)
            key = unit_profile_key_for(config, spec, "cpu", profiling_micro_batch_size(config))
            profile = store.unit_profile(key)
            if profile is None:
                continue
            times = calibrated_times(config, store, key, unit_times(profile, memory_bps), links)
            metrics = read_jsonl(run_dir / "metrics.jsonl")
            transitions = [
                e["global_step"]
                for e in read_jsonl(run_dir / "events.jsonl")
                if e["kind"] == "transition"
            ]
            steps = metrics[0]["global_step"]
            layout_keys = ("num_frozen_layers", "pipe_len", "dp_degree", "num_micro_batches")
            steady: dict[tuple, list[dict]] = {}
            for previous, epoch in zip(metrics, metrics[1:]):
                if all(previous[k] == epoch[k] for k in layout_keys) and not any(
                    previous["global_step"] <= t < epoch["global_step"] for t in transitions
                ):
                    steady.setdefault(tuple(epoch[k] for k in layout_keys), []).append(epoch)
            sharded = bool(metrics and metrics[-1].get("sharded"))
            for (frozen, pipe_len, dp_degree, micro), epochs in steady.items():
                cached = bool(epochs[0].get("cache_active")) and frozen > 0
                predicted = layout_epoch_s(
                    config,
                    profile,
                    times,
                    links,
                    num_frozen_layers=frozen,
                    pipe_len=pipe_len,
                    num_micro_batches=micro,
                    steps=steps,
                    cached=cached,
                    sharded=sharded,
                )
                seconds = [e["epoch_time_s"] for e in epochs]
                entries.append(
                    {
                        "workload": compare_dir.name,
                        "variant": run_dir.name,
                        "epochs": [e["epoch"] for e in epochs],
                        "num_frozen_layers": frozen,
                        "pipe_len": pipe_len,
                        "dp_degree": dp_degree,
                        "num_micro_batches": micro,
                        "cached": cached,
                        "sharded": sharded,
                        "steps": steps,
                        "measured_s": statistics.median(seconds),
                        "measured_min_s": min(seconds),
                        "measured_max_s": max(seconds),
                        "predicted_s": predicted,
                        "config": config.to_dict(),
                        "profile": profile.to_dict(),
                        "step_overhead_s": times.step_overhead_s,
                        "slot_overhead_s": times.slot_overhead_s,
                    }
                )
    if args.append and Path(args.out).is_file():
        earlier = json.loads(Path(args.out).read_text())
        if (earlier["memory_bytes_per_s"], earlier["link_bytes_per_s"]) != (memory_bps, link_bps):
            raise SystemExit("--append: give --bandwidths-from the same file (one set of links)")
        if any(earlier.get(k, collectives[k]) != collectives[k] for k in collectives):
            raise SystemExit("--append: the file's collectives differ from these")
        entries = earlier["epochs"] + entries
    write_json_atomic(
        args.out,
        {
            **machine(),
            "memory_bytes_per_s": memory_bps,
            "link_bytes_per_s": link_bps,
            **collectives,
            "epochs": entries,
        },
    )
    print(f"memory {memory_bps / 1e9:.1f} GB/s, gloo loopback all-reduce {link_bps / 1e9:.2f} GB/s")
    print(
        "| workload | variant | steady epochs | frozen | K x R | M "
        "| measured, median (range) (s) | predicted (s) | error |"
    )
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for e in entries:
        error = (e["predicted_s"] - e["measured_s"]) / e["measured_s"]
        print(
            f"| {e['workload']} | {e['variant']} | {len(e['epochs'])} | {e['num_frozen_layers']} | "
            f"{e['pipe_len']}x{e['dp_degree']}{' sharded' if e.get('sharded') else ''} | "
            f"{e['num_micro_batches']} | {e['measured_s']:.2f} "
            f"({e['measured_min_s']:.2f}-{e['measured_max_s']:.2f}) | "
            f"{e['predicted_s']:.2f} | {error:+.1%} |"
        )


if __name__ == "__main__":
    main()
