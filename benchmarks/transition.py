"""Time AutoDP transitions of a real run, phase by phase (the paper's Table 4).

Trains the given config for one epoch, then forces transitions to each requested number of
frozen layers and prints each transition's phases: plan, state move (weights + optimizer
state), groups (destroy old, create new), profile (timing the micro-batch candidates of a
layout seen for the first time, with num_micro_batches: auto), rebuild (optimizer, DDP,
PipelineStage, schedule). Run from the repository root:

    python benchmarks/transition.py configs/quickstart.yaml --frozen 2 5 --nproc 2
    python benchmarks/transition.py configs/quickstart.yaml --frozen 3 5 --nproc 4 \\
        pipeline.initial_pipe_len=4
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from harness import machine_line

from pipetransformer.config import load_config
from pipetransformer.launcher import launch_local

PHASES = ("plan_s", "state_move_s", "groups_s", "profile_s", "rebuild_s", "total_s")


def worker(config, run_dir: str, frozen: list[int], out_path: str) -> None:
    from pipetransformer.trainer.trainer import Trainer
    from pipetransformer.utils.logging import setup_logging

    setup_logging(os.environ["RANK"])
    trainer = Trainer(config, run_dir)
    try:
        trainer.setup()
        trainer.train()
        for value in frozen:
            trainer.transition(value)
        if trainer.world.rank == 0:
            with open(out_path, "w") as f:
                json.dump([t.to_dict() for t in trainer.transitions], f)
    finally:
        trainer.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument(
        "--frozen",
        type=int,
        nargs="+",
        required=True,
        help="num_frozen_layers to move to, in order",
    )
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_intermixed_args()
    overrides = [
        *args.overrides,
        f"trainer.nproc_per_node={args.nproc}",
        "trainer.epochs=1",
        "trainer.progress_bar=false",
        "freeze.strategy=manual",
        f"freeze.manual_schedule=[{args.frozen[-1]}]",
    ]
    config = load_config(args.config, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "transitions.json")
        launch_local(args.nproc, worker, (config, os.path.join(tmp, "run"), args.frozen, out))
        with open(out) as f:
            transitions = json.load(f)
    print(f"{machine_line()}; {args.nproc} processes, {config.model.name}")
    print(
        f"{'frozen':>9} {'K':>7} {'R':>7} {'units':>6} " + " ".join(f"{p[:-2]:>11}" for p in PHASES)
    )
    for t in transitions:
        print(
            f"{t['old_num_frozen_layers']:>3} -> {t['new_num_frozen_layers']:<3}"
            f"{t['old_pipe_len']:>3}->{t['new_pipe_len']:<2} "
            f"{t['old_dp_degree']:>3}->{t['new_dp_degree']:<2}"
            f"{t['units_moved']:>6} " + " ".join(f"{t[p] * 1000:>9.1f}ms" for p in PHASES)
        )


if __name__ == "__main__":
    main()
