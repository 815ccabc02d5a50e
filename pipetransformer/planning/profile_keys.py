"""Which measured profile belongs to a config: where the profile file is, the device part of
its keys, the model's signature, and the unit-profile and micro-batch keys of a run.

Owns: turning a config and its model spec into autopipe/profiles.py's key types, and the
chooser of M from stored timings. Must not: measure anything or read a file other than the
profile store it is handed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipetransformer.autopipe.profiles import (
    MicroBatchKey,
    ProfileStore,
    UnitProfileKey,
    candidate_micro_batches,
    choose_micro_batches,
    micro_batch_key,
    model_signature,
    unit_profile_key,
)
from pipetransformer.config import MULTI_CHUNK_SCHEDULES, Config, micro_batch_problem
from pipetransformer.models import ModelSpec
from pipetransformer.planning.context import MicroBatchChooser, choose_num_micro_batches

# Where `plan` (which has no run directory) looks for profiles when pipeline.profile_path is
# unset: a cache shared between runs, used by runs that set
# pipeline.profile_path=runs/profiles/profiles.json (relative to the current directory,
# like the default run directories). A run's own measurements are in RUN_DIR/profiles.json
# (`plan --profile` reads them).
PLAN_PROFILE_PATH = Path("runs") / "profiles" / "profiles.json"


def profile_path_for(config: Config, run_dir: str | os.PathLike | None = None) -> Path:
    """pipeline.profile_path; else the run's own RUN_DIR/profiles.json (a run measures for
    itself: a file shared by every run of a directory kept one run's measurements, even one
    taken under load, for all later ones); else (no run directory, as for `plan`)
    runs/profiles/profiles.json under the current directory."""
    if config.pipeline.profile_path is not None:
        return Path(config.pipeline.profile_path).expanduser()
    if run_dir is not None:
        return Path(run_dir) / "profiles.json"
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
    setting = config.trainer.device
    use_cuda = setting == "cuda" or (setting == "auto" and torch.cuda.is_available())
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
    return config.trainer.autocast_dtype or str(spec.activation_specs[0].dtype).removeprefix(
        "torch."
    )


def unit_profile_key_for(
    config: Config, spec: ModelSpec, device_type: str, micro_batch_size: int
) -> UnitProfileKey:
    return unit_profile_key(
        model_signature_for(config, spec),
        device_type,
        _dtype_name(config, spec),
        micro_batch_size,
        _input_shapes(spec),
    )


def micro_batch_key_for(
    config: Config,
    spec: ModelSpec,
    device_type: str,
    pipe_len: int,
    replica_batch: int,
    num_frozen_layers: int | None = None,
) -> MicroBatchKey:
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


def micro_batch_candidates(config: Config, pipe_len: int, replica_batch: int) -> list[int]:
    """The M a layout may use: [K, 6K] dividing the replica batch, those the schedule runs
    (1F1B and the multi-chunk schedules need M >= K; those also torch's rounds rule,
    config/schedules.py)."""
    schedule = config.pipeline.schedule
    minimum = pipe_len if schedule == "1f1b" else 1
    if schedule not in MULTI_CHUNK_SCHEDULES:
        return candidate_micro_batches(pipe_len, replica_batch, minimum)
    candidates = candidate_micro_batches(pipe_len, replica_batch, pipe_len)
    return [m for m in candidates if micro_batch_problem(schedule, pipe_len, m) is None]


def stored_micro_batch_chooser(
    config: Config, spec: ModelSpec, store: ProfileStore, device_type: str
) -> MicroBatchChooser:
    """A (pipe_len, replica_batch) -> M chooser for PlanContext.layout_for: a configured int
    as is; 'measured' picks the fastest stored timing among the candidates, and falls back to
    the measurement-free rule for layouts never measured."""

    def chooser(pipe_len: int, replica_batch: int) -> int:
        setting = config.pipeline.num_micro_batches
        if setting == "measured":
            key = micro_batch_key_for(config, spec, device_type, pipe_len, replica_batch)
            timings = store.micro_batch_timings(key)
            candidates = micro_batch_candidates(config, pipe_len, replica_batch)
            if any(m in timings for m in candidates):
                return choose_micro_batches(timings, candidates)
        return choose_num_micro_batches(setting, pipe_len, replica_batch, config.pipeline.schedule)

    return chooser
