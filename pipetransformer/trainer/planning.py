"""From config to layouts, without processes: shared by the trainer and `pipetransformer plan`.

Owns: the model description on the meta device (no weights, no download), the planner
built from a config, the layout for a frozen boundary, the dry-run table, and the
config-level names of measured profiles (where the file is, which signature a run's
profile has, at which micro-batch size the unit costs are taken).
Must not: measure anything (pipe/profiling.py does) or start processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipetransformer.autodp.topology import Layout, dp_degree_for
from pipetransformer.autopipe.planner import (
    AutoPipePlanner,
    PipelinePlan,
    UnitCosts,
    fixed_plan,
)
from pipetransformer.autopipe.profiles import (
    ProfileStore,
    candidate_micro_batches,
    choose_micro_batches,
    micro_batch_key,
    model_signature,
    unit_costs_from_profile,
    unit_profile_key,
)
from pipetransformer.config import Config, ConfigError, initial_pipe_lens
from pipetransformer.data.checks import data_facts
from pipetransformer.freeze import check_freeze_config
from pipetransformer.models import ModelSpec, build_model

logger = logging.getLogger(__name__)

# Where `plan` (which has no run directory) looks for profiles when pipeline.profile_path is
# unset: the profiles directory beside the default run directories (runs/<config>-<time>),
# i.e. what RUN_DIR/../profiles resolves to for a run started with the default --run-dir.
# Relative to the current directory, like those run directories.
PLAN_PROFILE_PATH = Path("runs") / "profiles" / "profiles.json"


def model_build_args(config: Config) -> dict[str, Any]:
    """What build_model needs to know about the data (task, classes, input shapes)."""
    facts = data_facts(config.data)
    return dict(
        task=facts.task,
        num_classes=facts.num_classes,
        in_chans=facts.in_chans,
        image_size=facts.image_size,
        vocab_size=facts.vocab_size,
        max_seq_length=facts.max_seq_length,
    )


def describe_model(config: Config, **overrides: Any) -> ModelSpec:
    """The model's spec, built on the meta device. Raises ConfigError for a bad model."""
    args = {**model_build_args(config), **overrides}
    try:
        spec = build_model(config.model, device="meta", **args).spec
    except (ValueError, TypeError, OSError) as exc:
        message = str(exc)
        if message.startswith("model."):
            raise ConfigError(message) from exc
        raise ConfigError(f"model: cannot build '{config.model.name}': {message}") from exc
    check_freeze_config(config.freeze, spec.num_layers)
    return spec


def planner_costs(config: Config, spec: ModelSpec, costs: UnitCosts | None = None) -> UnitCosts:
    """Measured `costs` when given, else parameter counts with lambda_frozen."""
    if costs is None:
        costs = UnitCosts.from_param_counts(spec.unit_param_counts, config.autopipe.lambda_frozen)
    if costs.num_units != spec.num_units:
        raise ValueError(f"{costs.num_units} unit costs for a model of {spec.num_units} units")
    return costs


def build_planner(
    config: Config, spec: ModelSpec, costs: UnitCosts | None = None, fits=None
) -> AutoPipePlanner:
    """The run's planner (config.pipeline.initial_pipe_len resolved to a number); `fits`: the
    memory check of trainer/sizing.py, None when memory is unlimited."""
    return AutoPipePlanner(
        planner_costs(config, spec, costs), config.pipeline.initial_pipe_len, config.autopipe.partition_method, fits
    )


# ----------------------------------------------------------------------------- profiles


def profile_path_for(config: Config, run_dir: str | os.PathLike | None = None) -> Path:
    """pipeline.profile_path; else RUN_DIR/../profiles/profiles.json; else (no run
    directory, as for `plan`) runs/profiles/profiles.json under the current directory."""
    if config.pipeline.profile_path is not None:
        return Path(config.pipeline.profile_path).expanduser()
    if run_dir is not None:
        return Path(run_dir).parent / "profiles" / "profiles.json"
    return PLAN_PROFILE_PATH


def device_type_for(device: torch.device | str) -> str:
    """The device part of profile signatures: 'cpu', or 'cuda:<GPU name>' so that profiles
    of different GPU models are never mixed."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def configured_device_type(config: Config) -> str:
    """device_type_for the device a run of this config would use on this machine."""
    use_cuda = config.trainer.device == "cuda" or (config.trainer.device == "auto" and torch.cuda.is_available())
    if use_cuda and torch.cuda.is_available():
        return device_type_for(torch.device("cuda", 0))
    return "cuda" if use_cuda else "cpu"


def model_signature_for(config: Config, spec: ModelSpec) -> str:
    """Everything that changes the model's cost: constructor settings and the unit shapes.

    Per-unit parameter counts and tensor shapes catch what the config alone does not say
    (vocabulary, classes, image size); weights and checkpoint files do not change costs.
    """
    return model_signature(
        config.model.name,
        {
            "family": spec.family,
            "task": spec.task,
            "model_name_or_path": config.model.model_name_or_path,
            "kwargs": config.model.kwargs,
            "unit_param_counts": list(spec.unit_param_counts),
            "inputs": [list(s.shape) for s in spec.input_specs],
            "activations": [list(s.shape) for s in spec.activation_specs],
            "output": list(spec.output_spec.shape),
        },
    )


def _input_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    return [s.shape for s in spec.input_specs]


def _dtype_name(config: Config, spec: ModelSpec) -> str:
    """The compute dtype costs are measured in: the autocast dtype, else the activations'."""
    return config.trainer.autocast_dtype or str(spec.activation_specs[0].dtype).removeprefix("torch.")


def unit_profile_key_for(config: Config, spec: ModelSpec, device_type: str, micro_batch_size: int) -> str:
    return unit_profile_key(
        model_signature_for(config, spec), device_type, _dtype_name(config, spec), micro_batch_size, _input_shapes(spec)
    )


def micro_batch_key_for(
    config: Config, spec: ModelSpec, device_type: str, pipe_len: int, replica_batch: int,
    num_frozen_layers: int | None = None,
) -> str:
    return micro_batch_key(
        model_signature_for(config, spec),
        device_type,
        pipe_len,
        replica_batch,
        _input_shapes(spec),
        config.pipeline.schedule,
        num_frozen_layers,
        _dtype_name(config, spec),
    )


def profiling_micro_batch_size(config: Config, world_size: int | None = None) -> int:
    """The micro-batch size unit costs are measured (and looked up) at: that of the initial
    layout, with 'auto' resolved by the measurement-free rule (smallest divisor >= K),
    because the measured choice of M itself needs the plan these costs produce."""
    world = world_size or config.nproc_per_node
    pipe_len = config.pipeline.initial_pipe_len
    if pipe_len == "auto":  # before the start is chosen: the shortest pipeline's (the costs
        pipe_len = min(initial_pipe_lens(config, world))  # of other sizes scale from it)
    dp_degree = dp_degree_for(pipe_len, world, world // pipe_len, config.autodp.enabled)
    replica_batch = config.trainer.global_batch_size // dp_degree
    return replica_batch // choose_num_micro_batches(config.pipeline.num_micro_batches, pipe_len, replica_batch)


def stored_micro_batch_chooser(
    config: Config, spec: ModelSpec, store: ProfileStore, device_type: str
) -> Callable[[int, int], int]:
    """A (pipe_len, replica_batch) -> M chooser for layout_for: a configured int as is;
    'auto' picks the fastest stored timing among the candidates, and falls back to the
    measurement-free rule for layouts never measured."""

    def chooser(pipe_len: int, replica_batch: int) -> int:
        setting = config.pipeline.num_micro_batches
        if setting == "auto":
            key = micro_batch_key_for(config, spec, device_type, pipe_len, replica_batch)
            timings = store.micro_batch_timings(key)
            minimum = pipe_len if config.pipeline.schedule == "1f1b" else 1
            candidates = candidate_micro_batches(pipe_len, replica_batch, minimum)
            if any(m in timings for m in candidates):
                return choose_micro_batches(timings, candidates)
        return choose_num_micro_batches(setting, pipe_len, replica_batch)

    return chooser


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
    prefix_cost: float | None = None,
) -> Layout:
    """The layout a run moves to when `num_frozen_layers` layers are frozen.
    `prefix_cost`: the frozen prefix's cost on stage 0 when AutoCache serves it."""
    if config.autopipe.enabled:
        plan = planner.plan(num_frozen_layers, current_pipe_len, prefix_cost)
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


def plan_table(
    config: Config,
    world_size: int | None = None,
    profile_path: str | os.PathLike | None = None,
    device_type: str | None = None,
) -> list[dict[str, Any]]:
    """For F = 0 .. L-1 in order (K only shrinks), the layout the run would use and the
    bytes each stage would hold.

    With a unit profile for this model in the profile file (`profile_path`, default
    `profile_path_for(config)`): stages are balanced on measured seconds under
    `pipeline.balance: time` (rows say cost_source 'time'), stage bytes include activations
    (memory_source 'profile'), and `initial_pipe_len: auto` is resolved as a run would;
    with `num_micro_batches: auto`, stored timings choose M. Without one: parameter counts,
    and stage bytes of parameters, gradients and optimizer state only (memory_source
    'params'). The CPU has no memory limit unless pipeline.device_memory_bytes is set.
    """
    import dataclasses

    from pipetransformer.trainer.sizing import (
        choose_initial_pipe_len,
        device_memory_budget,
        memory_model,
        plan_fits,
        stage_bytes,
    )

    spec = describe_model(config)
    devices = config.nproc_per_node
    world = world_size or devices
    path = Path(profile_path) if profile_path is not None else profile_path_for(config)
    device_type = device_type or configured_device_type(config)
    store = ProfileStore(path).load()
    micro_batch_size = profiling_micro_batch_size(config, world)
    profile = store.unit_profile(unit_profile_key_for(config, spec, device_type, micro_batch_size))
    if profile is None and (config.pipeline.balance == "time" or config.pipeline.initial_pipe_len == "auto"):
        logger.warning(
            "%s has no unit profile for this model on %s at micro-batch %d: costs from parameter counts, "
            "memory without activations (a training run measures them)", path, device_type, micro_batch_size,
        )
    measured = unit_costs_from_profile(profile) if profile is not None and config.pipeline.balance == "time" else None
    costs = planner_costs(config, spec, measured)
    memory = memory_model(config, spec, profile)
    # The budget of this machine's device; a GPU profile planned elsewhere: the configured one.
    on_gpu = device_type.startswith("cuda") and torch.cuda.is_available()
    budget = device_memory_budget(config, "cuda" if on_gpu else "cpu")
    initial = choose_initial_pipe_len(config, costs, memory, budget, world)
    config = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, initial_pipe_len=initial))
    planner = build_planner(config, spec, costs, plan_fits(config, memory, budget, world, initial))
    rows = []
    pipe_len = initial
    for frozen in range(spec.num_layers):
        chooser = stored_micro_batch_chooser(config, spec, store, device_type)
        layout = layout_for(config, planner, frozen, pipe_len, world, devices, chooser)
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
                "stage_costs": [_rounded(c, planner.costs.source) for c in plan.stage_costs],
                "max_stage_cost": _rounded(plan.max_stage_cost, planner.costs.source),
                "cost_source": planner.costs.source,
                "stage_bytes": [int(b) for b in stage_bytes(config, memory, plan, world, initial)],
                "memory_source": "profile" if profile is not None else "params",
                "device_memory_bytes": budget,
            }
        )
    return rows


def _rounded(cost: float, source: str) -> float:
    # Parameter counts are large numbers; measured seconds are small ones: keep 4 digits.
    return round(cost, 3) if source == "params" else float(f"{cost:.4g}")


def format_plan_table(config: Config, rows: list[dict[str, Any]]) -> str:
    unit = "params" if rows and rows[0]["cost_source"] == "params" else "s"
    described = "params" if unit == "params" else "s (measured: forward+backward, frozen prefix forward only)"
    lines = [
        f"model {config.model.name}: {len(rows)} layers, initial pipe_len "
        f"{rows[0]['pipe_len'] if rows else config.pipeline.initial_pipe_len}"
        f"{' (auto)' if config.pipeline.initial_pipe_len == 'auto' else ''}, {config.nproc_per_node} devices per "
        f"node; costs in {described}",
        "memory per stage: "
        + ("measured unit profile" if rows and rows[0]["memory_source"] == "profile" else
           "parameters, gradients, optimizer state (no profile yet: activations unknown)")
        + (f"; device budget {rows[0]['device_memory_bytes'] / 2**20:,.0f} MiB" if rows and rows[0]["device_memory_bytes"] else
           "; no device limit"),
        f"{'frozen':>6} {'K':>3} {'R':>3} {'M':>3}  {'max stage':>12}  {'MiB/stage':>16}  stages",
    ]
    for row in rows:
        stages = " | ".join(
            f"{name} ({cost:,.0f})" if unit == "params" else f"{name} ({cost:.4g})"
            for name, cost in zip(row["stage_names"], row["stage_costs"])
        )
        mib = "/".join(f"{b / 2**20:.1f}" for b in row["stage_bytes"])
        lines.append(
            f"{row['num_frozen_layers']:>6} {row['pipe_len']:>3} {row['dp_degree']:>3} "
            f"{row['num_micro_batches']:>3}  {row['max_stage_cost']:>12,.6g}  {mib:>16}  {stages}"
        )
    return "\n".join(lines)


def measure_model_costs(config: Config) -> dict[str, list[float]]:
    """Per-unit seconds (trained: forward + backward; frozen: forward only) of the config's
    model at the baseline layout's micro-batch size, measured in this process."""
    from pipetransformer.pipe.profiling import measure_unit_costs

    spec = describe_model(config)
    micro = profiling_micro_batch_size(config)
    model = build_model(config.model, **model_build_args(config))
    measured = measure_unit_costs(dict(enumerate(model.units)), spec, micro, "cpu")
    units = range(spec.num_units)
    return {
        "trained": [measured[u].forward_s + measured[u].backward_s for u in units],
        "frozen": [measured[u].frozen_forward_s for u in units],
        "micro_batch_size": micro,
    }
