"""Time-based vs parameter-based stage balance, and seconds per step for each micro-batch count.

Model: a small random BERT (hidden 64, 4 layers, 4 heads, intermediate 256, sequence 128)
with the real BERT vocabulary (30,522 tokens), so that its embedding holds most of the
parameters while costing little time, as in BERT-base. No download.

Table 1 (balance): unit costs measured on this machine with `measure_unit_costs` at one
micro-batch size (median of --repeats). For K = 2 and 4, the greedy planner splits the
units once on measured forward+backward seconds (`balance: time`) and once on parameter
counts (`balance: params`); both splits are then judged by the same yardstick, the
largest stage time = sum of the profiled forward+backward seconds of the stage's units.

Table 2 (micro-batches): for K = 2 and 1, every candidate M (divisors of the replica
batch in [K, 6K]). "measured" is the wall time of one replica batch through a
single-process, sequential GPipe-order loop (forward every micro-batch through all units,
then backward each, no optimizer step), i.e. what splitting into M micro-batches costs in
compute efficiency on this device. It does NOT include pipeline concurrency, bubbles or
communication: real multi-process pipelines are the trainer's job (it times them with
`time_schedule_steps`). "modelled" is an ideal GPipe estimate without communication,
(M + K - 1) x the largest stage's per-micro-batch time, from unit profiles measured at
micro-batch size B/M and the time-balanced split.

    python benchmarks/balance.py                  # CPU, one thread
    python benchmarks/balance.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.nn.functional as F

from pipetransformer.autopipe.planner import UnitCosts, balance
from pipetransformer.autopipe.profiles import (
    UnitProfile,
    candidate_micro_batches,
    choose_micro_batches,
    unit_costs_from_profile,
)
from pipetransformer.config import ModelConfig
from pipetransformer.models import LayeredModel, build_model
from pipetransformer.pipe.measure import measure_unit_costs, time_schedule_steps

BERT = ModelConfig(
    name="bert",
    kwargs={
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 256,
    },
)
VOCAB = 30522
SEQ = 128


def machine(device: torch.device) -> str:
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    return (
        f"{platform.platform()}; {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads; device {device} ({name})"
    )


def profile(
    model: LayeredModel, micro_batch: int, device: torch.device, repeats: int
) -> UnitProfile:
    units = dict(enumerate(model.units))
    measured = measure_unit_costs(units, model.spec, micro_batch, device, repeats=repeats, warmup=2)
    return UnitProfile.from_measurements(measured, micro_batch)


def stage_time(costs: UnitCosts, ranges) -> float:
    return max(sum(costs.trained[u] for u in range(a, b)) for a, b in ranges)


def ranges_text(model: LayeredModel, ranges) -> str:
    names = model.spec.unit_names
    return " | ".join(f"{names[a]}..{names[b - 1]}" if b - a > 1 else names[a] for a, b in ranges)


def balance_table(model: LayeredModel, unit_profile: UnitProfile) -> None:
    time_costs = unit_costs_from_profile(unit_profile)
    param_costs = UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6)
    print(
        f"unit costs at micro-batch {unit_profile.micro_batch_size} "
        "(forward+backward ms, parameters):"
    )
    for unit, name in enumerate(model.spec.unit_names):
        print(
            f"  {name:<16} {1e3 * time_costs.trained[unit]:8.3f} ms  "
            f"{model.spec.unit_param_counts[unit]:>10,}"
        )
    print()
    print("| K | balance | max stage time (ms) | stages |")
    print("|---|---|---|---|")
    for pipe_len in (2, 4):
        for label, costs in (("time", time_costs), ("params", param_costs)):
            plan = balance(costs, 0, pipe_len)
            seconds = stage_time(time_costs, plan.stage_ranges)
            print(
                f"| {pipe_len} | {label} | {1e3 * seconds:.3f} | "
                f"{ranges_text(model, plan.stage_ranges)} |"
            )
    print()


def sequential_step(
    model: LayeredModel, replica_batch: int, num_micro_batches: int, device: torch.device
):
    """One replica batch in GPipe order in one process: all forwards, then each backward."""
    ids = torch.randint(0, VOCAB, (replica_batch, SEQ), device=device)
    types = torch.zeros_like(ids)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (replica_batch,), device=device)
    chunks = list(zip(*(t.chunk(num_micro_batches) for t in (ids, types, mask, labels))))
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        losses = [F.cross_entropy(model(i, t, m), y) / num_micro_batches for i, t, m, y in chunks]
        for loss in reversed(losses):
            loss.backward()

    return step


def micro_batch_table(model, replica_batch: int, device, steps: int, repeats: int) -> None:
    measured: dict[int, float] = {}
    modelled: dict[tuple[int, int], float] = {}
    profiles: dict[int, UnitCosts] = {}
    print(
        "| K | M | micro-batch | measured s/step (sequential) "
        "| modelled s/step (ideal K-stage GPipe) |"
    )
    print("|---|---|---|---|---|")
    for pipe_len in (2, 1):
        candidates = candidate_micro_batches(pipe_len, replica_batch)
        for m in candidates:
            if m not in measured:
                step = sequential_step(model, replica_batch, m, device)
                measured[m] = time_schedule_steps(step, steps=steps, warmup=2, device=device)
                profiles[m] = unit_costs_from_profile(
                    profile(model, replica_batch // m, device, repeats)
                )
            plan = balance(profiles[m], 0, pipe_len)
            modelled[pipe_len, m] = (m + pipe_len - 1) * stage_time(profiles[m], plan.stage_ranges)
            print(
                f"| {pipe_len} | {m} | {replica_batch // m} | {measured[m]:.4f} | "
                f"{modelled[pipe_len, m]:.4f} |"
            )
        best_measured = choose_micro_batches(measured, candidates)
        best_modelled = choose_micro_batches(
            {m: modelled[pipe_len, m] for m in candidates}, candidates
        )
        print(f"| {pipe_len} | best | | M={best_measured} | M={best_modelled} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU intra-op threads (a worker per core uses 1)"
    )
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="micro-batch size of table 1's profile"
    )
    parser.add_argument("--replica-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per unit (median)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per M (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(
        BERT, task="classification", num_classes=2, vocab_size=VOCAB, max_seq_length=SEQ
    ).to(device)
    model.train()

    print(f"machine: {machine(device)}")
    print(
        f"model: random BERT, hidden 64, 4 layers, vocab {VOCAB:,}, sequence {SEQ}; "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print()
    print(
        "## Table 1: balance on measured time vs parameter counts "
        "(greedy partition, nothing frozen)"
    )
    print("max stage time = sum of profiled forward+backward seconds of the stage's units")
    print()
    balance_table(model, profile(model, args.micro_batch, device, args.repeats))
    print(
        f"## Table 2: seconds per step of one replica batch ({args.replica_batch} samples) "
        "per micro-batch count"
    )
    print(
        "measured = single process, sequential GPipe-order loop "
        "(no pipeline concurrency, no communication);"
    )
    print(
        "modelled = (M + K - 1) x largest stage time per micro-batch, "
        "from profiles at micro-batch B/M"
    )
    print()
    micro_batch_table(model, args.replica_batch, device, args.steps, args.repeats)


if __name__ == "__main__":
    main()
