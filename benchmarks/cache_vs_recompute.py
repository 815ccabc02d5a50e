"""Serving the frozen prefix from AutoCache vs recomputing it, per batch, by frozen depth.

For each number of frozen layers F, times (median of --repeats) on one batch of the
config's model: recomputing the frozen prefix (eval mode, no autograd: what the first
stage does without the cache) and serving it from a warm AutoCache (all hits: read the
shared-memory store, copy to the device). Single process, this machine. Run from the
repository root:

    python benchmarks/cache_vs_recompute.py configs/quickstart.yaml --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import machine_line

from pipetransformer.autocache import CacheClient, CacheDaemon
from pipetransformer.config import load_config
from pipetransformer.data import build_data
from pipetransformer.models import UnitSequence, build_model
from pipetransformer.pipe.prefix import CachedPrefix
from pipetransformer.utils.units import prefix_end


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (a trainer process uses 1 on 2 cores)"
    )
    args = parser.parse_intermixed_args()
    torch.set_num_threads(args.threads)
    config = load_config(args.config, args.overrides)
    data = build_data(
        config.data, seed=config.trainer.seed, model_name_or_path=config.model.model_name_or_path
    )
    model = build_model(
        config.model,
        task=data.task,
        num_classes=data.num_classes,
        in_chans=data.in_chans,
        image_size=data.image_size,
        vocab_size=data.vocab_size,
        max_seq_length=data.max_seq_length,
    ).eval()
    units = dict(enumerate(model.units))
    ids = list(range(args.batch))
    inputs = data.train.fetch(ids)[0]
    print(
        f"{machine_line()}; "
        f"{args.threads} thread(s); model {config.model.name}, {model.spec.num_layers} layers, "
        f"batch {args.batch}, "
        f"cache dtype {config.cache_dtype}"
    )
    print(f"{'frozen':>6} {'recompute (ms)':>15} {'cache hit (ms)':>15} {'speedup':>8}")
    specs = list(model.spec.activation_specs)
    # Text at each sample's real length, as a run stores it (autocache/layout.py).
    split = (len(data.train), specs, data.train.lengths, model.spec.max_seq_length)
    with CacheDaemon.start(splits={"train": split}, storage_dtype=config.cache_dtype) as daemon:
        with CacheClient.attach(daemon.address) as client:
            for frozen in range(1, model.spec.num_layers):
                end = prefix_end(frozen)
                sequence = UnitSequence([units[u] for u in range(end)], [True] * end)

                def recompute(sequence=sequence):
                    with torch.no_grad():
                        sequence(*inputs)

                prefix = CachedPrefix(units, frozen, client, torch.device("cpu"))
                prefix("train", ids, inputs)  # fill (or upgrade) the entries: later calls are hits

                def serve(prefix=prefix):
                    prefix("train", ids, inputs)

                slow, fast = (
                    median_seconds(recompute, args.repeats),
                    median_seconds(serve, args.repeats),
                )
                assert prefix.counts["misses"] + prefix.counts["upgrades"] == len(ids)
                print(f"{frozen:>6} {1000 * slow:>15.3f} {1000 * fast:>15.3f} {slow / fast:>7.1f}x")


if __name__ == "__main__":
    main()
