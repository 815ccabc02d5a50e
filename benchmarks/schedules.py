"""The pipeline schedules against each other on layouts this CPU holds (issue 50): GPipe,
1F1B, interleaved 1F1B and zero bubble (`pipeline.schedule`), two ways.

Workloads (`--workloads`, default both):
- `bert_local_k2`: configs/bert_sst2_local.yaml started as a 2-stage pipeline on 2 processes
  (`pipeline.initial_pipe_len=2`; the tiny random BERT, SST-2 beside the repository);
- `vit4_k4`: the quickstart's ViT cut to 4 blocks on 4 processes, a 4-stage pipeline.

Part `steps`: one training step of the starting layout (no frozen layer), each schedule in a
launch of its own (`virtual_stages: auto`: two chunks a rank for the chunked ones; M the
trainer's `auto`, or `--micro-batches`), stages balanced as the trainer balances them by
default, on unit times measured first (`--balance params`: parameter counts). After a warm-up
pass over the batches (every sequence-length bucket built), `--steps` steps are timed on
every rank behind a barrier; a rank is busy while it runs one of its PipelineStages'
forward, backward (zero bubble: input gradient) or weight-gradient calls (torch's
`_PipelineStageBase` methods, wrapped in the worker; on a CPU a call's wall time is its
compute) or the first rank's frozen prefix, and idle otherwise: waiting for a
neighbour's activations or gradients, the bubble, plus the sends. Each rank's idle share
(1 - busy / step, median over the steps) is set against the formula of docs/profiling.md
("The bubble of each schedule": equal stages, zero bubble with F = I = W).

Part `runs`: whole `pipetransformer train` runs, each a fresh process tree alone on the
machine (benchmarks/harness.py), seed by seed with the variants' order rotating
(compare/order.py): `pipe_ddp` (the baseline: freezing and AutoCache off, GPipe) and
`full_<schedule>` (the config's freezing, AutoPipe, AutoDP and AutoCache under each
schedule). Training samples per second (over its epochs), its ratio to Pipe+DDP's by seed
(geometric mean, 95% interval), the final metric and the layouts the run went through.

    python benchmarks/schedules.py [--parts steps,runs] [--workloads bert_local_k2,vit4_k4]
        [--seeds 0,1,2] [--steps 20] [--micro-batches M] [--balance time|params]
        [--out runs/bench_schedules] [--report-only]
    python benchmarks/schedules.py --smoke --out /tmp/schedules   # tiny sizes: checks the script

Interrupted, the same command resumes the runs (a finished run is kept; the steps part is
measured again). Writes OUT/schedules.json and OUT/schedules.md and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import ROOT, other_load, run_alone, train_command, wait_until_idle, write_results

from pipetransformer.compare.order import rotated_order
from pipetransformer.compare.report import read_run, throughput
from pipetransformer.compare.stats import geometric_mean_ratio, mean_std
from pipetransformer.config import (
    SCHEDULE_PROPERTIES,
    SCHEDULES,
    Config,
    layout_schedule,
    load_config,
)

DATA = ROOT.parent / "shared" / "data"


@dataclass(frozen=True)
class Workload:
    config: str
    nproc: int
    overrides: tuple[str, ...]


WORKLOADS = {
    "bert_local_k2": Workload(
        "bert_sst2_local.yaml",
        2,
        ("pipeline.initial_pipe_len=2", "trainer.nproc_per_node=2", f"data.root={DATA / 'sst2'}"),
    ),
    "vit4_k4": Workload(
        "quickstart.yaml",
        4,
        ("pipeline.initial_pipe_len=4", "trainer.nproc_per_node=4", "model.kwargs.depth=4"),
    ),
}
# Every run keeps its pipelines (`sharding: auto` only shards on GPUs with a memory budget).
COMMON = ("pipeline.sharding=never", "checkpoint.keep_last=1")
RUN_VARIANTS = {
    "pipe_ddp": ("freeze.strategy=none", "cache.enabled=false", "pipeline.schedule=gpipe"),
    **{f"full_{s}": (f"pipeline.schedule={s}",) for s in SCHEDULES},
}
SMOKE = ("data.train_subset=128", "data.eval_subset=32", "trainer.epochs=1")


def formula_bubble(schedule: str, pipe_len: int, virtual_stages: int, micro: int) -> float:
    """The idle share of a step of equal stages (docs/profiling.md, "The bubble of each
    schedule"): (K - 1) / (M + K - 1) for GPipe and 1F1B, M counted v times over with v
    chunks a rank, and three times over again for zero bubble's F, I and W of equal time."""
    runs = layout_schedule(schedule, pipe_len, virtual_stages)
    if runs is None:  # plain DDP: no pipeline, no bubble
        return 0.0
    properties = SCHEDULE_PROPERTIES[runs]
    slots = micro * (virtual_stages if properties.multi_chunk else 1)
    if properties.split_backward:
        slots *= 3
    return (pipe_len - 1) / (slots + pipe_len - 1)


# ----------------------------------------------------------------------------- steps


class BusyClock:
    """Seconds this process spends inside PipelineStage compute calls (wraps torch's
    `_PipelineStageBase` methods for the worker's lifetime: a benchmark's instrument, not
    the runtime's), and in whatever else `timed` wraps (the first rank's frozen prefix)."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.seconds = 0.0
        for name in self.METHODS:
            setattr(_PipelineStageBase, name, self.timed(getattr(_PipelineStageBase, name)))

    def timed(self, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def unit_costs(config: Config, balance: str):
    """What the stages are balanced on, as the trainer's `pipeline.balance` does: each
    unit's forward + backward seconds measured here at the replica's GPipe micro-batch (one
    thread, as a worker), or parameter counts; the same costs for every rank and schedule."""
    import torch

    from pipetransformer.autopipe.planner import UnitCosts
    from pipetransformer.config import smallest_micro_batches
    from pipetransformer.models import build_model
    from pipetransformer.pipe.measure import measure_unit_costs
    from pipetransformer.planning.context import model_build_args

    torch.manual_seed(config.trainer.seed)
    model = build_model(config.model, **model_build_args(config))
    if balance == "params":
        return UnitCosts.from_param_counts(
            model.spec.unit_param_counts, config.autopipe.lambda_frozen
        )
    torch.set_num_threads(1)
    pipe_len = config.pipeline.initial_pipe_len
    replica_batch = config.trainer.replica_batch_size(config.nproc_per_node // pipe_len)
    micro = replica_batch // smallest_micro_batches("gpipe", pipe_len, replica_batch)
    measured = measure_unit_costs(dict(enumerate(model.units)), model.spec, micro, "cpu")
    return UnitCosts(
        trained=tuple(measured[u].forward_s + measured[u].backward_s for u in sorted(measured)),
        frozen=tuple(measured[u].frozen_forward_s for u in sorted(measured)),
        source="time",
    )


def step_worker(
    config: Config, costs, schedule: str, steps: int, micro_batches: int | None
) -> dict:
    """One rank: the starting layout of `config` under `schedule`, its stages balanced on
    `costs`, `steps` batches run once to warm up and once timed; this rank's step and busy
    seconds per timed step."""
    import torch
    import torch.distributed as dist

    from pipetransformer.autodp.groups import build_training_groups
    from pipetransformer.autodp.topology import Layout
    from pipetransformer.autopipe.planner import balance
    from pipetransformer.config import smallest_micro_batches, virtual_stages_for
    from pipetransformer.data import build_data
    from pipetransformer.models import build_model
    from pipetransformer.pipe import build_stage_runtime
    from pipetransformer.planning.context import model_build_args
    from pipetransformer.tasks import ClassificationTask, loss_weights
    from pipetransformer.trainer.distributed import init_distributed
    from pipetransformer.trainer.step import step_seq_length
    from pipetransformer.utils.units import prefix_end

    world = init_distributed("cpu", config.trainer.timeout_s)
    data = build_data(config.data, seed=config.trainer.seed)
    torch.manual_seed(config.trainer.seed)
    model = build_model(config.model, **model_build_args(config))
    pipe_len = config.pipeline.initial_pipe_len
    replicas = world.world_size // pipe_len
    frozen_embedding = config.embedding_frozen
    active = model.spec.num_units - prefix_end(0, frozen_embedding)
    chunks = virtual_stages_for(schedule, config.pipeline.virtual_stages, pipe_len, active)
    method = config.autopipe.partition_method
    plan = balance(costs, 0, pipe_len, method, None, frozen_embedding, chunks)
    replica_batch = config.trainer.replica_batch_size(replicas)
    micro = micro_batches or smallest_micro_batches(schedule, pipe_len, replica_batch)
    layout = Layout(plan, world.world_size, world.world_size, replicas).with_micro_batches(micro)
    groups = build_training_groups(layout, world.rank, config.trainer.timeout_s)
    role = layout.role(world.rank)
    units = {u: model.units[u] for u in layout.units_of_rank(world.rank)}
    for index, unit in units.items():
        unit.requires_grad_(index >= layout.plan.frozen_end)
    runtime = build_stage_runtime(
        plan=layout.plan,
        stage_index=role.stage,
        replica_batch_size=replica_batch,
        units=units,
        spec=model.spec,
        loss_fn=ClassificationTask.loss_fn,
        schedule_name=schedule,
        pipeline_group=groups.pipeline,
        data_group=groups.data,
        device=world.device,
    )
    clock = BusyClock()
    runtime.run_prefix = clock.timed(runtime.run_prefix)  # the frozen prefix is compute too
    train = data.train
    global_batch = replica_batch * replicas
    step_s, busy_s = [], []
    for timed in (False, True):
        for step in range(steps):
            first = (step * global_batch + role.replica * replica_batch) % len(train)
            ids = [(first + i) % len(train) for i in range(replica_batch)]
            length = step_seq_length(config, layout, train, ids)
            inputs = train.fetch(ids, length)[0] if role.is_first else None
            target = None
            if role.is_last:
                weights = loss_weights([True] * replica_batch, replicas, global_batch)
                target = ClassificationTask.make_target(train.targets(ids), weights)
            dist.barrier()
            clock.take()
            started = time.perf_counter()
            runtime.train_step(inputs, target, seq_length=length)
            if timed:
                step_s.append(time.perf_counter() - started)
                busy_s.append(clock.take())
            for p in runtime.trainable_parameters():
                p.grad = None
    dist.destroy_process_group()
    return {
        "rank": world.rank,
        "stage": role.stage,
        "pipe_len": pipe_len,
        "virtual_stages": chunks,
        "num_micro_batches": micro,
        "runs": layout_schedule(schedule, pipe_len, chunks),
        "step_s": step_s,
        "busy_s": busy_s,
    }


def measure_steps(args, workload_name: str) -> dict:
    from pipetransformer.launcher import launch_local

    workload = WORKLOADS[workload_name]
    overrides = [*workload.overrides, *COMMON, *(SMOKE if args.smoke else ())]
    config = load_config(ROOT / "configs" / workload.config, overrides)
    wait_until_idle(args.wait)
    costs = unit_costs(config, args.balance)
    found = {}
    for schedule in SCHEDULES:
        wait_until_idle(args.wait)
        ranks = launch_local(
            workload.nproc, step_worker, (config, costs, schedule, args.steps, args.micro_batches)
        )
        found[schedule] = ranks
        median = statistics.median(ranks[0]["step_s"])
        print(f"  {workload_name} {schedule}: step {1e3 * median:.1f} ms", file=sys.stderr)
    return found


def steps_table(measured: dict) -> str:
    lines = [
        "| workload | schedule (runs) | K | v | M | step, median (ms) | idle share by rank, "
        "measured | formula |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for workload, by_schedule in measured.items():
        for schedule, ranks in by_schedule.items():
            first = ranks[0]
            k, v, m = first["pipe_len"], first["virtual_stages"], first["num_micro_batches"]
            idle = [
                1 - statistics.median(b / s for b, s in zip(r["busy_s"], r["step_s"]))
                for r in sorted(ranks, key=lambda r: r["stage"])
            ]
            lines.append(
                f"| {workload} | {schedule} ({first['runs']}) | {k} | {v} | {m} | "
                f"{1e3 * statistics.median(first['step_s']):.1f} | "
                f"{' / '.join(f'{share:.2f}' for share in idle)} | "
                f"{formula_bubble(schedule, k, v, m):.2f} |"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- runs


def run_one(args, workload_name: str, variant: str, seed: int) -> dict:
    workload = WORKLOADS[workload_name]
    run_dir = Path(args.out) / workload_name / f"seed{seed}" / variant
    overrides = [
        *workload.overrides,
        *COMMON,
        *RUN_VARIANTS[variant],
        f"trainer.seed={seed}",
        *(SMOKE if args.smoke else ()),
    ]
    command = train_command(ROOT / "configs" / workload.config, overrides, run_dir, "--overwrite")
    record = run_alone(command, run_dir, args.wait)
    if "epochs" not in record:  # what every figure of this part is computed from
        run = read_run(run_dir)
        record.update(
            epochs={key: run[key] for key in ("epoch_time_s", "samples_per_s")},
            metric_name=run["metric_name"],
            final_eval_metric=run["final_eval_metric"],
            layouts=[
                f"{e['num_frozen_layers']}: {e['pipe_len']}x{e['dp_degree']}"
                + (f" v{e['virtual_stages']}" if e["virtual_stages"] > 1 else "")
                for e in run["freeze_trajectory"]
            ],
        )
        (run_dir / "bench.json").write_text(json.dumps(record, indent=2))
    return record


def run_variants(args, workloads: list[str]) -> dict:
    """Records by workload, variant, seed; seed by seed, each seed's variants rotated."""
    records: dict = {w: {v: {} for v in RUN_VARIANTS} for w in workloads}
    for seed in args.seeds:
        for workload in workloads:
            for variant in rotated_order(list(RUN_VARIANTS), seed):
                run_dir = Path(args.out) / workload / f"seed{seed}" / variant
                if args.report_only:
                    path = run_dir / "bench.json"
                    if path.is_file():
                        records[workload][variant][seed] = json.loads(path.read_text())
                else:
                    records[workload][variant][seed] = run_one(args, workload, variant, seed)
    return records


def runs_table(records: dict) -> str:
    lines = [
        "| workload | variant | samples/s, mean (sd) | vs Pipe+DDP [95%] | final metric | "
        "layouts of the first seed (frozen: K x R, v chunks a stage) |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for workload, by_variant in records.items():
        base = {
            s: throughput(r["epochs"])["samples_per_s"] for s, r in by_variant["pipe_ddp"].items()
        }
        for variant, by_seed in by_variant.items():
            if not by_seed:
                continue
            rates = {s: throughput(r["epochs"])["samples_per_s"] for s, r in by_seed.items()}
            rate = mean_std(list(rates.values()))
            paired = [rates[s] / base[s] for s in rates if s in base and base[s] > 0]
            ratio = geometric_mean_ratio(paired) if paired else None
            versus = "-"
            if ratio is not None:
                interval = f" [{ratio.low:.2f}, {ratio.high:.2f}]" if ratio.low else ""
                versus = f"{ratio.mean:.2f}x{interval}"
            metric = mean_std([r["final_eval_metric"] for r in by_seed.values()])
            first = by_seed[min(by_seed)]
            lines.append(
                f"| {workload} | {variant} | {rate.mean:.1f} ({rate.std:.1f}) | {versus} | "
                f"{metric.mean:.4f} | {', '.join(dict.fromkeys(first['layouts']))} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="steps,runs")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20, help="timed steps a schedule")
    parser.add_argument("--micro-batches", type=int, default=None, help="M (default: auto)")
    parser.add_argument(
        "--balance", choices=("time", "params"), default="time", help="steps: stages balanced on"
    )
    parser.add_argument("--out", default="runs/bench_schedules")
    parser.add_argument("--wait", type=float, default=120.0, help="longest wait for idle cores")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one seed: a check")
    args = parser.parse_args()
    args.seeds = [0] if args.smoke else [int(s) for s in args.seeds.split(",")]
    if args.smoke:
        args.steps, args.wait = 2, 5.0
    parts = args.parts.split(",")
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    results: dict = {"smoke": args.smoke, "seeds": args.seeds}
    tables = []
    if "steps" in parts and not args.report_only:
        results["steps"] = {w: measure_steps(args, w) for w in workloads}
        tables.append("One step of the starting layout, each rank's idle share:\n\n")
        tables[-1] += steps_table(results["steps"])
    if "runs" in parts:
        records = run_variants(args, workloads)
        results["runs"] = records
        results["other_load"] = other_load(
            {f"{w}/{v}": r for w in records for v, r in records[w].items()}
        )
        tables.append("Whole runs:\n\n" + runs_table(records))
    write_results(Path(args.out), "schedules", results, "\n\n".join(tables))


if __name__ == "__main__":
    main()
