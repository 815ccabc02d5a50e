"""Time AutoCache reads of one batch from the memory tier and from the disk tier.

Scenarios, each over `--num-samples` rows read in random batches of `--batch-size`:
  memory          every row in shared memory; fresh output tensors per read
  memory, out=    the same, reading into one reused set of output tensors (no allocation,
                  no first-touch page faults of a fresh 12 MB batch); the disk rows below
                  read into reused tensors too
  disk, cached    disk tier, pages still in the OS page cache (right after the writes)
  disk, cold      disk tier, page cache dropped before each batch (fsync + FADV_DONTNEED)
  disk, prefetch  disk tier, page cache dropped, the prefetch thread (window 4 batches)
                  given time to fill its window before each read, as when compute hides
                  the I/O; it refills behind the reader during the timed read
MB/s counts the stored bytes of the batch. The comparison with recomputing the frozen
prefix belongs to the trainer's profiler, not here.

    python benchmarks/cache_read.py --batch-size 64 --num-samples 512
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

from pipetransformer.autocache import CacheClient, CacheDaemon

SHAPES = {
    "vit (17,64)": [((17, 64), torch.float32)],
    "bert (128,384)+mask": [((128, 384), torch.float32), ((128,), torch.int64)],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64, help="samples per read")
    parser.add_argument("--num-samples", type=int, default=1024, help="rows stored per config")
    parser.add_argument("--batches", type=int, default=16, help="timed batches per scenario")
    parser.add_argument(
        "--storage-dtype", default="float32", choices=["float32", "float16", "bfloat16"]
    )
    parser.add_argument("--disk-dir", default=None, help="disk tier location (default: tmp)")
    return parser.parse_args()


def fill(client: CacheClient, specs, num_samples: int) -> None:
    for start in range(0, num_samples, 256):
        ids = list(range(start, min(num_samples, start + 256)))
        tensors = [
            torch.randn(len(ids), *shape)
            if dtype.is_floating_point
            else torch.randint(0, 2, (len(ids), *shape), dtype=dtype)
            for shape, dtype in specs
        ]
        client.write("train", ids, 3, tensors)


def time_reads(client: CacheClient, batches: list[list[int]], before=None, out=None) -> list[float]:
    """Seconds of each `client.read`; `before(k)` runs untimed ahead of batch k."""
    if before is None:  # warm-up (allocator, first-touch page faults); not for the disk
        client.read("train", batches[0], out=out)  # scenarios: it would warm what they time
    times = []
    for k, batch in enumerate(batches):
        if before is not None:
            before(k)
        start = time.perf_counter()
        tags, _ = client.read("train", batch, out=out)
        times.append(time.perf_counter() - start)
        assert (tags == 3).all()
    return times


def disk_scenarios(
    client: CacheClient, order: list[int], batches: list[list[int]], window_rows: int, out
) -> dict[str, list[float]]:
    scenarios = {"disk, cached": time_reads(client, batches, out=out)}

    def drop(_k: int) -> None:
        client.drop_disk_page_cache("train")

    scenarios["disk, cold"] = time_reads(client, batches, before=drop, out=out)
    client.drop_disk_page_cache("train")
    client.prefetch("train", order, window_rows=window_rows)

    def window_full(k: int) -> None:  # compute hid the I/O: the window is full on asking
        expected = min(window_rows, len(order) - sum(len(b) for b in batches[:k]))
        deadline = time.monotonic() + 30
        while client.buffered_rows("train") < expected and time.monotonic() < deadline:
            time.sleep(0.001)

    scenarios["disk, prefetch"] = time_reads(client, batches, before=window_full, out=out)
    return scenarios


def run_config(name: str, specs, args: argparse.Namespace, disk_dir: str) -> list[tuple]:
    rng = np.random.default_rng(0)
    order = rng.permutation(args.num_samples).tolist()
    count = min(args.batches, args.num_samples // args.batch_size)
    batches = [order[i * args.batch_size : (i + 1) * args.batch_size] for i in range(count)]
    out = [  # reused output tensors, as a trainer would keep (pinned, on a GPU host)
        torch.empty(
            (args.batch_size, *shape), dtype=torch.float32 if dtype.is_floating_point else dtype
        )
        for shape, dtype in specs
    ]
    rows = []
    for budget in (None, 0):  # None: a quarter of the free memory; 0: all on disk
        with (
            CacheDaemon.start(
                {"train": (args.num_samples, specs)},
                memory_budget_bytes=budget,
                disk_dir=disk_dir,
                storage_dtype=args.storage_dtype,
            ) as daemon,
            CacheClient.attach(daemon.address) as client,
        ):
            fill(client, specs, args.num_samples)
            batch_bytes = client.layout("train").full_sample_bytes * args.batch_size
            if budget is None:
                scenarios = {
                    "memory": time_reads(client, batches),
                    "memory, out=": time_reads(client, batches, out=out),
                }
            else:
                scenarios = disk_scenarios(client, order, batches, 4 * args.batch_size, out)
            for scenario, times in scenarios.items():
                seconds = statistics.median(times)
                rows.append((name, scenario, seconds * 1e3, batch_bytes / seconds / 1e6))
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as disk_dir:
        rows = [r for n, s in SHAPES.items() for r in run_config(n, s, args, disk_dir)]
    print(f"batch {args.batch_size}, storage {args.storage_dtype}, median of {args.batches}")
    print(f"{'config':<22}{'tier':<16}{'ms/batch':>10}{'MB/s':>10}")
    for name, scenario, ms, mb_s in rows:
        print(f"{name:<22}{scenario:<16}{ms:>10.3f}{mb_s:>10.0f}")


if __name__ == "__main__":
    main()
