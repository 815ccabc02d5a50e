"""Starting a run in its directory, fresh or from a checkpoint, identically on every rank.

Rank 0 (or the launcher, which then hands the answer over in RunOptions) decides whether
the run may start and from which checkpoint, and prepares the directory: it locks it,
writes the resolved config, and on a resume drops the records written after the
checkpoint. The decision (or the error) is broadcast so that every rank acts on the same
one. `load_checkpoint_tensors` then fills the units a rank holds in its new layout, their
optimizer state and (when the world has the checkpoint's size) its random streams.

Owns: that sequence. Must not: plan layouts or build models (the trainer does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.autodp.topology import Layout
from pipetransformer.config import Config, config_yaml
from pipetransformer.models import ModelSpec
from pipetransformer.trainer.checkpoint import (
    load_tensors,
    model_key,
    read_run_state,
    rng_key,
    stored_tensors,
)
from pipetransformer.trainer.records import ResumeEvent
from pipetransformer.trainer.rundir import (
    RunDirError,
    RunLock,
    RunOptions,
    prepare_run_dir,
    previous_attempt_wall_s,
    truncate_after,
    write_run_id,
)
from pipetransformer.trainer.state import RunState
from pipetransformer.utils.files import write_text_atomic
from pipetransformer.utils.units import param_key

logger = logging.getLogger(__name__)

# The run directory's lock, held for the life of the process that took it (rank 0 under
# torchrun; the local launcher takes it itself).
_held_locks: list[RunLock] = []


@dataclass
class Resumption:
    """A run continuing from `checkpoint`."""

    checkpoint: Path
    saved: dict[str, Any]  # the checkpoint's run_state.json
    previous_attempt_wall_s: float
    world_size: int = 0
    load_s: float = 0.0

    def state(self, spec: ModelSpec) -> RunState:
        """The run state to continue from, after checking the checkpoint is of this model."""
        model = self.saved.get("model", {})
        if list(model.get("unit_names", [])) != list(spec.unit_names) or list(
            model.get("unit_param_counts", [])
        ) != list(spec.unit_param_counts):
            raise RunDirError(
                f"{self.checkpoint} was written for another model ({len(model.get('unit_names', []))} units); "
                "resume it with the config it was trained with"
            )
        state = RunState.from_dict(self.saved["state"])
        self.world_size = state.world_size
        state.previous_attempts_wall_s += self.previous_attempt_wall_s
        state.attempt += 1
        return state

    def event(self, layout: Layout, world) -> ResumeEvent:
        state = RunState.from_dict(self.saved["state"])
        return ResumeEvent(
            global_step=state.global_step,
            epoch=state.epoch,
            step=state.step_in_epoch,
            checkpoint=str(self.checkpoint),
            attempt=state.attempt + 1,
            num_frozen_layers=layout.plan.num_frozen_layers,
            pipe_len=layout.pipe_len,
            dp_degree=layout.dp_degree,
            num_micro_batches=layout.plan.num_micro_batches,
            world_size=world.world_size,
            checkpoint_world_size=state.world_size,
            rng="restored" if state.world_size == world.world_size else "reseeded",
            load_s=self.load_s,
            previous_attempt_wall_s=self.previous_attempt_wall_s,
        )


def start_run_directory(
    run_dir: Path, options: RunOptions, config: Config, rank: int, group
) -> Resumption | None:
    """Decide on rank 0 how the run starts in `run_dir` and prepare the directory; every
    rank returns the same answer (collective). Raises RunDirError on every rank."""
    answer: dict[str, Any] = {}
    if rank == 0:
        try:
            answer = _prepare(run_dir, options, config)
        except RunDirError as exc:
            answer = {"error": str(exc)}
    box = [answer]
    dist.broadcast_object_list(box, src=0, group=group)
    answer = box[0]
    if "error" in answer:
        raise RunDirError(answer["error"])
    if answer["checkpoint"] is None:
        return None
    return Resumption(Path(answer["checkpoint"]), answer["saved"], answer["previous_attempt_wall_s"])


def _prepare(run_dir: Path, options: RunOptions, config: Config) -> dict[str, Any]:
    if options.prepared_checkpoint is None:
        checkpoint = prepare_run_dir(
            run_dir, resume=options.resume, overwrite=options.overwrite, restart=options.restart, run_id=options.run_id
        )
        _held_locks.append(RunLock(run_dir).acquire())
    else:
        checkpoint = Path(options.prepared_checkpoint) if options.prepared_checkpoint else None
    answer: dict[str, Any] = {"checkpoint": None}
    if checkpoint is not None:
        saved = read_run_state(checkpoint)
        state = RunState.from_dict(saved["state"])
        previous = previous_attempt_wall_s(run_dir)  # before the records it reads are trimmed
        truncate_after(run_dir, state.global_step, state.epoch)
        answer = {"checkpoint": str(checkpoint), "saved": saved, "previous_attempt_wall_s": previous}
        logger.info("resuming from %s (global step %d, attempt %d)", checkpoint, state.global_step, state.attempt + 1)
    elif options.run_id is not None:
        write_run_id(run_dir, options.run_id)
    write_text_atomic(run_dir / "config.yaml", config_yaml(config))
    return answer


def load_checkpoint_tensors(
    checkpoint: Path,
    units: dict[int, nn.Module],
    frozen_end: int,
    world,
    group,
    checkpoint_world_size: int,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]:
    """Fill `units` in place from the checkpoint; return the optimizer state of their trained
    parameters (by parameter name) and this rank's saved random streams (None when the
    world size changed). Collective over `group`."""
    stored = stored_tensors(checkpoint)
    destinations: dict[str, torch.Tensor] = {}
    for index, unit in units.items():
        named = [*unit.named_parameters(), *unit.named_buffers()]
        for name, tensor in named:
            key = model_key(param_key(index, name))
            if key not in stored:
                raise RunDirError(f"{checkpoint} has no {key}: it was written for another model")
            destinations[key] = tensor.detach()
    optimizer_states: dict[str, dict[str, torch.Tensor]] = {}
    by_param: dict[str, list[tuple[str, str]]] = {}
    for key in stored:
        if key.startswith("optim/"):
            name, _, entry = key[len("optim/") :].rpartition("/")
            by_param.setdefault(name, []).append((entry, key))
    for index, unit in units.items():
        if index < frozen_end:
            continue
        for name, _ in unit.named_parameters():
            for entry, key in by_param.get(param_key(index, name), []):
                size, dtype = stored[key]
                # On the CPU: load_states_by_name moves them next to their parameter.
                destinations[key] = torch.empty(size, dtype=dtype)
                optimizer_states.setdefault(param_key(index, name), {})[entry] = destinations[key]
    rng: dict[str, torch.Tensor] | None = None
    if checkpoint_world_size == world.world_size:
        rng = {}
        for stream in ("cpu", "cuda"):
            key = rng_key(world.rank, stream)
            if key in stored:
                size, dtype = stored[key]
                destinations[key] = rng[stream] = torch.empty(size, dtype=dtype)
    with torch.no_grad():
        load_tensors(checkpoint, destinations, group)
    return optimizer_states, rng
