"""One config, several variants, one after the other on the same machine: a table of wall
time, training throughput, the eval metric and the freeze trajectory of each. For settings
`compare` does not cover (precision, decision cadence). Run from the repository root:

    python benchmarks/variants.py configs/quickstart.yaml \\
        --variant fp32=trainer.precision=fp32 --variant bf16=trainer.precision=bf16
    python benchmarks/variants.py configs/quickstart.yaml \\
        --variant epoch=freeze.interval_steps=null \\
        --variant auto=freeze.interval_steps=auto trainer.seed=1

A variant is NAME=OVERRIDE[,OVERRIDE...]; the remaining arguments apply to every variant.
`--seeds 0,1,2` runs every variant once per seed (`trainer.seed`), seed by seed; without it
each variant runs once, at the config's seed. Each run is alone on the machine
(benchmarks/harness.py: idle cores first, once more if other work shared them). `--out DIR`
keeps the run directories (default: a temporary directory) and writes DIR/variants.json and
DIR/variants.md; interrupted, the same command with the same `--out` resumes (a finished run
is kept), and `--report-only` prints the table of the runs that finished.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import other_load, over_seeds, run_alone, train_command, write_results

from pipetransformer.compare.report import read_run

SEED_OF_THE_CONFIG = -1  # the key of a run without --seeds


def run_dir_of(out: Path, name: str, seed: int) -> Path:
    return out / name if seed == SEED_OF_THE_CONFIG else out / f"seed-{seed}" / name


def describe(run_dir: Path) -> dict:
    """What the table shows of one finished run."""
    run = read_run(run_dir)
    train_s = sum(run["epoch_time_s"])
    samples = sum(s * t for s, t in zip(run["samples_per_s"], run["epoch_time_s"]))
    path: list[str] = []
    for epoch in run["freeze_trajectory"]:
        point = f"F{epoch['num_frozen_layers']} {epoch['pipe_len']}x{epoch['dp_degree']}"
        if not path or path[-1] != point:
            path.append(point)
    return {
        "training_time_s": run["training_time_s"],
        "train_samples_per_s": samples / train_s,
        "final_eval_metric": run["final_eval_metric"],
        "metric_name": run["metric_name"],
        "trajectory": " → ".join(path),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument(
        "--variant", action="append", required=True, help="NAME=OVERRIDE[,OVERRIDE...]"
    )
    parser.add_argument("--seeds", default=None, help="e.g. 0,1,2 (default: the config's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for idle")
    parser.add_argument("--report-only", action="store_true", help="no runs: the table")
    args = parser.parse_intermixed_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="variants-"))
    variants = {name: extra for name, _, extra in (v.partition("=") for v in args.variant)}
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [SEED_OF_THE_CONFIG]

    def run_one(name: str, seed: int) -> dict:
        run_dir = run_dir_of(out, name, seed)
        overrides = [*args.overrides, *[e for e in variants[name].split(",") if e]]
        if seed != SEED_OF_THE_CONFIG:
            overrides.append(f"trainer.seed={seed}")
        # --overwrite: a run cut short, or repeated because other work shared the cores,
        # starts over in its directory (a finished one is kept before this).
        command = train_command(args.config, overrides, run_dir, "--overwrite")
        record = run_alone(command, run_dir, args.wait)
        print(f"{name}{'' if seed < 0 else f' seed {seed}'}: {record['last_line']}")
        return record

    records = over_seeds(
        seeds,
        variants,
        run_one,
        lambda name, seed: run_dir_of(out, name, seed),
        args.report_only,
    )
    rows = {
        name: {seed: describe(run_dir_of(out, name, seed)) for seed in by_seed}
        for name, by_seed in records.items()
    }
    metric = next((r["metric_name"] for by_seed in rows.values() for r in by_seed.values()), "")
    lines = [
        f"{args.config} {' '.join(args.overrides)}; runs in {out}",
        "",
        f"| variant | seed | training time (s) | training samples/s | final {metric} "
        "| trajectory |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, by_seed in rows.items():
        for seed, row in by_seed.items():
            lines.append(
                f"| {name} | {'config' if seed < 0 else seed} | {row['training_time_s']:.1f} | "
                f"{row['train_samples_per_s']:.1f} | {row['final_eval_metric']:.4f} | "
                f"{row['trajectory']} |"
            )
    results = {
        "settings": vars(args),
        "other_load": other_load(records),
        "records": records,
        "rows": rows,
    }
    write_results(out, "variants", results, "\n".join(lines))


if __name__ == "__main__":
    main()
