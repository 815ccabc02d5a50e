"""One config, several variants, one after the other on the same machine: a table of wall
time, training throughput, the eval metric and the freeze trajectory of each. For settings
`compare` does not cover (precision, decision cadence). Run from the repository root:

    python benchmarks/variants.py configs/quickstart.yaml \\
        --variant fp32=trainer.precision=fp32 --variant bf16=trainer.precision=bf16
    python benchmarks/variants.py configs/quickstart.yaml \\
        --variant epoch=freeze.interval_steps=null \\
        --variant auto=freeze.interval_steps=auto trainer.seed=1

A variant is NAME=OVERRIDE[,OVERRIDE...]; the remaining arguments apply to every variant.
`--out DIR` keeps the run directories (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pipetransformer.utils.files import read_jsonl


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument(
        "--variant", action="append", required=True, help="NAME=OVERRIDE[,OVERRIDE...]"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_intermixed_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="variants-"))
    rows = []
    for variant in args.variant:
        name, _, extra = variant.partition("=")
        run_dir = out / name
        command = [
            sys.executable,
            "-m",
            "pipetransformer",
            "train",
            args.config,
            "trainer.progress_bar=false",
            *args.overrides,
            *[e for e in extra.split(",") if e],
            "--run-dir",
            str(run_dir),
        ]
        result = subprocess.run(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        if result.returncode != 0:
            sys.exit(f"variant {name} failed:\n{result.stderr[-2000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        samples = sum(m["samples_per_s"] * m["epoch_time_s"] for m in metrics)
        train_s = sum(m["epoch_time_s"] for m in metrics)
        path = []
        for m in metrics:
            point = f"F{m['num_frozen_layers']} {m['pipe_len']}x{m['dp_degree']}"
            if not path or path[-1] != point:
                path.append(point)
        rows.append(
            (
                name,
                summary.get("training_time_s", summary.get("wall_time_s")),
                samples / train_s,
                summary["final_eval_metric"],
                summary["metric_name"],
                " → ".join(path),
            )
        )
        print(f"{name}: done", file=sys.stderr)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{args.config} {' '.join(args.overrides)}; runs in {out}"
    )
    print(f"| variant | wall time (s) | training samples/s | final {rows[0][4]} | trajectory |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, wall, throughput, metric, _, path in rows:
        print(f"| {name} | {wall:.1f} | {throughput:.1f} | {metric:.4f} | {path} |")


if __name__ == "__main__":
    main()
