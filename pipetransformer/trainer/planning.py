"""From config to layouts, without processes: shared by the trainer and `pipetransformer plan`.

Owns: the model description on the meta device (no weights, no download), the planner
built from a config, the layout for a frozen boundary, and the dry-run table.
"""

from __future__ import annotations

from typing import Any

from pipetransformer.autodp.topology import Layout, dp_degree_for
from pipetransformer.autopipe.planner import AutoPipePlanner, PipelinePlan, UnitCosts, fixed_plan
from pipetransformer.config import Config, ConfigError
from pipetransformer.data.checks import data_facts
from pipetransformer.freeze import check_freeze_config
from pipetransformer.models import ModelSpec, build_model


def describe_model(config: Config, **overrides: Any) -> ModelSpec:
    """The model's spec, built on the meta device. Raises ConfigError for a bad model."""
    facts = data_facts(config.data)
    args = dict(
        task=facts.task,
        num_classes=facts.num_classes,
        in_chans=facts.in_chans,
        image_size=facts.image_size,
        vocab_size=facts.vocab_size,
        max_seq_length=facts.max_seq_length,
    )
    args.update(overrides)
    try:
        spec = build_model(config.model, device="meta", **args).spec
    except (ValueError, TypeError, OSError) as exc:
        message = str(exc)
        if message.startswith("model."):
            raise ConfigError(message) from exc
        raise ConfigError(f"model: cannot build '{config.model.name}': {message}") from exc
    check_freeze_config(config.freeze, spec.num_layers)
    return spec


def build_planner(config: Config, spec: ModelSpec, costs: UnitCosts | None = None) -> AutoPipePlanner:
    if costs is None:
        costs = UnitCosts.from_param_counts(spec.unit_param_counts, config.autopipe.lambda_frozen)
    return AutoPipePlanner(costs, config.pipeline.initial_pipe_len, config.autopipe.partition_method)


def choose_num_micro_batches(setting: int | str, pipe_len: int, replica_batch: int) -> int:
    """A configured M, or for 'auto' without measurements the smallest divisor >= pipe_len."""
    if isinstance(setting, int):
        return setting
    for m in range(pipe_len, replica_batch + 1):
        if replica_batch % m == 0:
            return m
    return replica_batch


def with_micro_batches(plan: PipelinePlan, num_micro_batches: int) -> PipelinePlan:
    return PipelinePlan(
        plan.num_frozen_layers,
        plan.pipe_len,
        plan.prefix_end,
        plan.stage_ranges,
        plan.stage_costs,
        num_micro_batches,
    )


def layout_for(
    config: Config,
    planner: AutoPipePlanner,
    num_frozen_layers: int,
    current_pipe_len: int,
    world_size: int,
    devices_per_node: int,
    micro_batch_chooser=None,
) -> Layout:
    """The layout a run moves to when `num_frozen_layers` layers are frozen."""
    if config.autopipe.enabled:
        plan = planner.plan(num_frozen_layers, current_pipe_len)
    else:
        plan = fixed_plan(planner.costs, planner.initial, num_frozen_layers)
    initial_dp = world_size // config.pipeline.initial_pipe_len
    dp_degree = dp_degree_for(plan.pipe_len, world_size, initial_dp, config.autodp.enabled)
    replica_batch = config.trainer.global_batch_size // dp_degree
    chooser = micro_batch_chooser or (
        lambda k, b: choose_num_micro_batches(config.pipeline.num_micro_batches, k, b)
    )
    plan = with_micro_batches(plan, chooser(plan.pipe_len, replica_batch))
    return Layout(plan, world_size, devices_per_node, dp_degree)


def plan_table(config: Config, world_size: int | None = None) -> list[dict[str, Any]]:
    """For F = 0 .. L-1 in order (K only shrinks), the layout the run would use."""
    spec = describe_model(config)
    planner = build_planner(config, spec)
    devices = config.nproc_per_node
    world = world_size or devices
    rows = []
    pipe_len = config.pipeline.initial_pipe_len
    for frozen in range(spec.num_layers):
        layout = layout_for(config, planner, frozen, pipe_len, world, devices)
        pipe_len = layout.pipe_len
        plan = layout.plan
        rows.append(
            {
                "num_frozen_layers": frozen,
                "pipe_len": plan.pipe_len,
                "dp_degree": layout.dp_degree,
                "num_micro_batches": plan.num_micro_batches,
                "prefix_units": [0, plan.prefix_end],
                "stage_ranges": [list(r) for r in plan.stage_ranges],
                "stage_names": [
                    f"{spec.unit_names[a]}..{spec.unit_names[b - 1]}" for a, b in plan.stage_ranges
                ],
                "stage_costs": [round(c, 3) for c in plan.stage_costs],
                "max_stage_cost": round(plan.max_stage_cost, 3),
                "cost_source": planner.costs.source,
            }
        )
    return rows


def format_plan_table(config: Config, rows: list[dict[str, Any]]) -> str:
    unit = "params" if rows and rows[0]["cost_source"] == "params" else "s"
    lines = [
        f"model {config.model.name}: {len(rows)} layers, initial pipe_len "
        f"{config.pipeline.initial_pipe_len}, {config.nproc_per_node} devices per node; costs in {unit}",
        f"{'frozen':>6} {'K':>3} {'R':>3} {'M':>3}  {'max stage':>12}  stages",
    ]
    for row in rows:
        stages = " | ".join(
            f"{name} ({cost:,.0f})" if unit == "params" else f"{name} ({cost:.4g})"
            for name, cost in zip(row["stage_names"], row["stage_costs"])
        )
        lines.append(
            f"{row['num_frozen_layers']:>6} {row['pipe_len']:>3} {row['dp_degree']:>3} "
            f"{row['num_micro_batches']:>3}  {row['max_stage_cost']:>12,.6g}  {stages}"
        )
    return "\n".join(lines)
