"""Where a whole training run's time goes, by phase, from a py-spy sample of its workers
(issue 37): this trainer's DDP run and a peer's (transformers' Trainer, the plain timm loop)
split alike into forward, backward (DDP's all-reduce waits inside it), optimizer, gradient
norms and clipping, data, evaluation, checkpoints, start-up and the rest.

    pip install py-spy
    python benchmarks/step_split.py OUT.txt -- python -m pipetransformer train CONFIG ...
    python benchmarks/step_split.py OUT.txt --report-only

Samples every process of the command (`py-spy record --subprocesses`, raw stacks, idle
frames included: a rank waiting in a collective counts where it waits) and prints the
workers' share of samples by phase (the command must start its workers through this
project's local launcher: `pipetransformer train`, `python -m pipetransformer.compare.peers`).
Sampling costs the run a few percent: use it to see where time goes, and plain_step.py's
unsampled runs for speed.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from pathlib import Path

# phase -> substrings of a frame ("function (file:line)") that put a sample there; the first
# phase whose pattern any frame of the stack matches wins, so the order matters.
PHASES = {
    "start-up": ("_find_and_load", "from_pretrained", "init_process_group", "setup ("),
    "checkpoint": ("checkpoint.py", "state_dict_saver", "torch/distributed/checkpoint"),
    "evaluation": ("evaluation.py", "evaluate", "_accuracy (", "prediction_step"),
    "optimizer": ("torch/optim/",),
    "norms + clipping": ("clip_grad", "_unit_grad_squares", "_clip (", "_foreach_norm"),
    "backward (+ all-reduce)": ("_engine_run_backward", "autograd/__init__.py", "backward ("),
    "data": ("step_data", "fetch (", "dataloader", "data_loader", "_next_data", "collate"),
    "forward": ("forward (", "_call_impl"),
}
WORKER = "_worker_entry ("  # the local launcher's worker function (pipetransformer/launcher.py)


def phase_of(frames: list[str]) -> str:
    for phase, patterns in PHASES.items():
        if any(p in frame for frame in frames for p in patterns):
            return phase
    return "other"


def split(raw: Path) -> dict[str, collections.Counter]:
    """Samples of the worker processes by phase, from py-spy's raw output (one stack a line,
    ';'-joined frames from the root, then a count); the launcher's own samples are left out.
    py-spy labels the stacks of every process with the root's name: one row."""
    by_process: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        inside = [i for i, frame in enumerate(frames) if WORKER in frame]
        if inside:
            by_process[frames[0]][phase_of(frames[inside[0] + 1 :])] += int(count)
    return by_process


def table(by_process: dict[str, collections.Counter]) -> str:
    phases = [*PHASES, "other"]
    lines = [
        "| process | samples | " + " | ".join(phases) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in phases) + " |",
    ]
    for process, counts in by_process.items():
        total = sum(counts.values())
        if total < 20:  # the launcher, helpers
            continue
        shares = " | ".join(f"{100 * counts[p] / total:.1f}%" for p in phases)
        lines.append(f"| {process[:60]} | {total} | {shares} |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="py-spy's raw stacks")
    parser.add_argument("--rate", type=int, default=25, help="samples a second")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not args.report_only:
        if not command:
            sys.exit("step_split.py: the command to sample goes after --")
        subprocess.run(
            [
                "py-spy",
                "record",
                "--subprocesses",
                "--idle",
                "--format",
                "raw",
                "--rate",
                str(args.rate),
                "-o",
                str(args.out),
                "--",
                *command,
            ],
            check=True,
        )
    print(table(split(args.out)))


if __name__ == "__main__":
    main()
