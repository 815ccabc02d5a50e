"""The memory model against measured peaks: for each layout, every stage's predicted peak
bytes (autopipe/memory.py over a unit profile measured in the same process) beside the
measured peak of a training step (pipe/measure.py: malloc's bytes in use on the CPU,
max_memory_allocated on a GPU). Run from the repository root:

    python benchmarks/memory_model.py                 # a ViT (embed 128, depth 4) at 32x32 px
    python benchmarks/memory_model.py --embed-dim 256 --batch 64
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from harness import machine_line

from pipetransformer.launcher import launch_local

# The measurement is the memory test's own (tests/memory_check.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memory_check import measure_stage_memory  # noqa: E402

LAYOUTS = [  # (K, R, schedule, M)
    (2, 1, "gpipe", 4),
    (2, 1, "1f1b", 4),
    (1, 2, "gpipe", 2),
]


def worker(config_dict, pipe_len, dp_degree, schedule, micro, out_dir):
    import json

    torch.set_num_threads(1)
    result = measure_stage_memory(config_dict, pipe_len, dp_degree, schedule, micro)
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    import json
    import tempfile

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--embed-dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    config = {
        "trainer": {"global_batch_size": args.batch},
        "optimizer": {"name": "adamw"},
        "model": {
            "name": "vit_tiny_patch16_224",
            "kwargs": {
                "patch_size": 4,
                "embed_dim": args.embed_dim,
                "depth": args.depth,
                "num_heads": 4,
                "mlp_ratio": 4.0,
            },
        },
    }
    print(
        f"{machine_line()}; "
        f"ViT embed {args.embed_dim}, depth {args.depth}, 32x32 px, global batch {args.batch}, "
        "AdamW, float32"
    )
    print(
        f"{'layout':>16} {'stage':>5} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}   "
        "predicted parts (MiB)"
    )
    for pipe_len, dp_degree, schedule, micro in LAYOUTS:
        with tempfile.TemporaryDirectory() as out:
            launch_local(
                pipe_len * dp_degree, worker, (config, pipe_len, dp_degree, schedule, micro, out)
            )
            results = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
        for rank, result in enumerate(results):
            predicted, measured = result["predicted"]["total"], result["measured"]
            parts = ", ".join(
                f"{k} {v / 2**20:.1f}" for k, v in result["predicted"].items() if k != "total"
            )
            layout = f"K={pipe_len} R={dp_degree} {schedule} M={micro}"
            print(
                f"{layout:>16} {result['stage']:>5} {predicted / 2**20:>14.1f} "
                f"{measured / 2**20:>13.1f} "
                f"{(predicted - measured) / measured:>+7.1%}   {parts}   (rank {rank})"
            )


if __name__ == "__main__":
    main()
