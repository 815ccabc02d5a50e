"""Zero bubble's data parallelism, four ways, on one layout of K stages x R replicas (issues
55 and 61):

- `per_chunk`: what the trainer runs (pipe/gradient_sync.py): no chunk in DDP; each chunk's
  trained gradients are views of one flat buffer, all-reduced in place and asynchronously as
  soon as torch's schedule has run that chunk's last weight gradient (its REDUCE_GRAD
  action), while the rank's other chunks still compute; the step waits for them at its end;
- `after_step`: what the trainer ran before issue 61 (`AfterStepAllReduce` below): the
  rank's trained gradients flattened into a new buffer after the whole step, all-reduced
  with nothing left to overlap, and copied back (two gradient-sized copies a step);
- `replicate`: each trained chunk under torch's `replicate` (FSDP2's DDP,
  `torch.distributed._composable.replicate_with_fsdp`) over the data group, so torch's
  zero-bubble schedule reduces a chunk's gradients right after that chunk's last weight
  gradient (its REDUCE_GRAD action), while the rank's other chunks still compute (what
  torchtitan pairs with pipeline parallelism; it never uses nn.parallel.DDP there);
- `interleaved_ddp`: the reference without a split backward: interleaved 1F1B with each
  trained chunk in DDP (what the trainer runs under interleaved_1f1b), its buckets reduced
  during the chunk's last backward.

Each variant is one launch of K x R processes (gloo on this CPU; on a GPU node run it with
`--device cuda`, one process per GPU): the same tiny-to-BERT-base units, stages balanced by
parameter counts, v chunks a rank, M micro-batches; `--warmup` steps then `--steps` timed
steps behind a barrier, each rank's step seconds. `--check` first runs one step of each
variant on the same batch and compares every rank's gradients with `per_chunk`'s (the
average over replicas: the variants must compute the same thing before their times mean
anything).

    python benchmarks/zero_bubble_sync.py [--pipe-len 2] [--replicas 2] [--virtual-stages 2]
        [--micro-batches 4] [--layers 4] [--hidden 256] [--seq 128] [--batch 32]
        [--steps 20] [--warmup 3] [--device cpu] [--check] [--out runs/bench_zero_bubble]
    python benchmarks/zero_bubble_sync.py --smoke --out /tmp/zb   # tiny sizes: checks the script

Writes OUT/zero_bubble_sync.json and .md and prints the table. Not adopted by the trainer:
a chunk under `replicate` holds DTensor parameters, which the pipeline layouts' handoff,
optimizer state, clipping and gradient norms would all have to take (a sharded layout's
machinery, fsdp/state.py, for every pipeline layout): worth it only if this measures a gain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from harness import ROOT, write_results

VARIANTS = ("per_chunk", "after_step", "replicate", "interleaved_ddp")


class AfterStepAllReduce:
    """The trainer's zero-bubble averaging before issue 61: after the whole step, every
    trained gradient flattened into a new buffer, averaged by one all-reduce, copied back."""

    def __init__(self, parameters, group) -> None:
        import torch.distributed as dist

        self.parameters = [p for p in parameters if p.requires_grad]
        self.group = group
        self.replicas = dist.get_world_size(group)

    def prepare(self) -> None:
        """Nothing before the step: the gradients are made as autograd makes them."""

    def __call__(self) -> None:
        import torch
        import torch.distributed as dist

        for p in self.parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.parameters]
        flat = torch._utils._flatten_dense_tensors(grads)
        flat.div_(self.replicas)
        dist.all_reduce(flat, group=self.group)
        torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))


def _bert(args):
    from pipetransformer.config import ModelConfig
    from pipetransformer.models import build_model

    config = ModelConfig(
        name="bert",
        kwargs={
            "hidden_size": args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": max(1, args.hidden // 64),
            "intermediate_size": 4 * args.hidden,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
        },
    )
    return build_model(config, task="classification", num_classes=2, max_seq_length=args.seq)


def _batch(args, replica: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + replica)
    share = args.batch // args.replicas
    ids = torch.randint(5, 1000, (share, args.seq), generator=g)
    return (ids, torch.zeros_like(ids), torch.ones_like(ids)), torch.randint(
        0, 2, (share,), generator=g
    )


def worker(args, variant: str, check: bool) -> dict:
    """One rank of one variant: its step seconds, or with `check` its gradients after one
    step (parameter name -> tensor)."""
    import torch
    import torch.distributed as dist

    from pipetransformer.autodp.groups import build_training_groups
    from pipetransformer.autodp.topology import Layout
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.models import unit_param_names
    from pipetransformer.pipe import build_stage_runtime
    from pipetransformer.tasks import ClassificationTask, loss_weights
    from pipetransformer.trainer.distributed import init_distributed

    world = init_distributed(args.device, 300)
    torch.manual_seed(0)
    model = _bert(args).to(world.device)
    k, r = args.pipe_len, args.replicas
    plan = balance(
        UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6),
        0,
        k,
        virtual_stages=args.virtual_stages,
    )
    layout = Layout(plan, world.world_size, world.world_size, r).with_micro_batches(
        args.micro_batches
    )
    groups = build_training_groups(layout, world.rank, 300)
    role = layout.role(world.rank)
    units = {u: model.units[u] for u in layout.units_of_rank(world.rank)}
    schedule = "interleaved_1f1b" if variant == "interleaved_ddp" else "zero_bubble"
    runtime = build_stage_runtime(
        plan=layout.plan,
        stage_index=role.stage,
        replica_batch_size=args.batch // r,
        units=units,
        spec=model.spec,
        loss_fn=ClassificationTask.loss_fn,
        schedule_name=schedule,
        pipeline_group=groups.pipeline,
        data_group=None if variant == "replicate" else groups.data,
        device=world.device,
    )
    if variant == "after_step":  # before any stage is built: plain PipelineStages
        runtime.schedules.gradient_sync = None
        runtime.gradient_sync = AfterStepAllReduce(runtime.trainable_parameters(), groups.data)
    if variant == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(
            groups.data, world.device.type, mesh_dim_names=(f"data_{groups.data.group_name}",)
        )
        for chunk in runtime.schedules.chunks:  # replaced in place: the stages take it
            if any(p.requires_grad for p in chunk.wrapped.parameters()):
                replicate(chunk.wrapped, mesh=mesh)

    def step(index: int) -> None:
        inputs, labels = _batch(args, role.replica, index)
        inputs = [t.to(world.device) for t in inputs] if role.is_first else None
        target = None
        if role.is_last:
            weights = loss_weights([True] * len(labels), r, args.batch)
            target = ClassificationTask.make_target(labels.to(world.device), weights)
        runtime.train_step(inputs, target, seq_length=args.seq)

    def synchronize() -> None:
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        dist.barrier()

    if check:
        step(0)
        grads = {}
        for index, unit in units.items():
            for name, p in unit_param_names(unit, index).items():
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grads[name] = grad.detach().cpu().clone()
        dist.destroy_process_group()
        return {"rank": world.rank, "grads": grads}
    seconds = []
    for index in range(args.warmup + args.steps):
        synchronize()
        started = time.perf_counter()
        step(index)
        synchronize()
        if index >= args.warmup:
            seconds.append(time.perf_counter() - started)
        for p in runtime.trainable_parameters():
            p.grad = None
    dist.destroy_process_group()
    return {"rank": world.rank, "step_s": seconds}


def check(args) -> dict:
    """Every variant's gradients after one step against per_chunk's: the largest relative
    difference (norm of the difference over the norm) per variant."""
    import torch

    from pipetransformer.launcher import launch_local

    nproc = args.pipe_len * args.replicas
    grads = {v: launch_local(nproc, worker, (args, v, True)) for v in VARIANTS}
    reference = {n: g for rank in grads["per_chunk"] for n, g in rank["grads"].items()}
    worst = {}
    for variant, ranks in grads.items():
        errors = [
            float((g - reference[n]).norm() / reference[n].norm().clamp_min(1e-12))
            for rank in ranks
            for n, g in rank["grads"].items()
        ]
        worst[variant] = max(errors)
        print(f"  {variant}: largest relative difference {worst[variant]:.2e}", file=sys.stderr)
    if any(error > 1e-4 for error in worst.values()):
        sys.exit(f"the variants disagree with per_chunk: {worst}")
    del torch
    return worst


def table(args, measured: dict, checked: dict | None) -> str:
    lines = [
        f"K = {args.pipe_len}, R = {args.replicas}, v = {args.virtual_stages}, "
        f"M = {args.micro_batches}; BERT of {args.layers} layers, hidden {args.hidden}, "
        f"batch {args.batch} x {args.seq} tokens; {args.device}",
        "",
        "| variant | step, median over ranks' medians (ms) | slowest rank (ms) | vs per_chunk |"
        + (" gradients vs per_chunk |" if checked else ""),
        "| --- | ---: | ---: | ---: |" + (" ---: |" if checked else ""),
    ]
    base = None
    for variant, ranks in measured.items():
        medians = [statistics.median(rank["step_s"]) for rank in ranks]
        median, slowest = statistics.median(medians), max(medians)
        base = base or median
        row = f"| {variant} | {1e3 * median:.1f} | {1e3 * slowest:.1f} | {median / base:.2f} |"
        if checked:
            row += f" {checked[variant]:.1e} |"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pipe-len", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--virtual-stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--check", action="store_true", help="compare gradients first")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_zero_bubble"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check of the script")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.seq, args.batch = 2, 32, 16, 8
        args.steps, args.warmup, args.check = 2, 1, True
    from pipetransformer.launcher import launch_local

    checked = check(args) if args.check else None
    nproc = args.pipe_len * args.replicas
    measured = {}
    for variant in VARIANTS:
        measured[variant] = launch_local(nproc, worker, (args, variant, False))
        median = statistics.median(statistics.median(r["step_s"]) for r in measured[variant])
        print(f"  {variant}: step {1e3 * median:.1f} ms", file=sys.stderr)
    results = {"args": vars(args), "checked": checked, "steps": measured}
    write_results(Path(args.out), "zero_bubble_sync", results, table(args, measured, checked))


if __name__ == "__main__":
    main()
