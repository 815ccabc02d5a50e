"""Starting a run in its directory, fresh or from a checkpoint, identically on every rank.

Rank 0 (or the launcher, which then hands the answer over in RunOptions) decides whether
the run may start and from which checkpoint, and prepares the directory: it locks it and,
on a resume, reads the checkpoint's record and drops the records written after the
checkpoint. The decision (or the error) is broadcast so that every rank acts on the same
one. The checkpoint's tensors are loaded later, by the checkpointer, into the layout
planned for the world that resumes; the resolved config is written once it is known.

Owns: that sequence, and which changed settings a resume refuses. Must not: plan layouts,
build models or load tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.topology import Layout
from pipetransformer.config import (
    TEXT_DATASETS,
    Config,
    ConfigError,
    config_changes,
    config_yaml,
)
from pipetransformer.models import ModelSpec
from pipetransformer.runs.checkpoint import read_run_state
from pipetransformer.runs.records import ConfigChangeEvent, ResumeEvent
from pipetransformer.runs.rundir import (
    RunDirError,
    RunLock,
    RunOptions,
    prepare_run_dir,
    previous_attempt_excluded_s,
    previous_attempt_wall_s,
    truncate_after,
    write_run_id,
)
from pipetransformer.runs.state import CheckpointRecord, RunState
from pipetransformer.utils.files import write_text_atomic

logger = logging.getLogger(__name__)

# The run directory's lock, held for the life of the process that took it (rank 0 under
# torchrun; the local launcher takes it itself).
_held_locks: list[RunLock] = []

# Text settings that shape an epoch's batches: the epoch's sample order (group_by_length:
# the order is cut at the checkpoint's sample offset, so a new one would repeat some
# samples and skip others) and the lengths its batches run at (padding: the epoch's token
# counts would mix both). A resume may change them where an epoch starts, not inside one.
EPOCH_SETTINGS = ("data.group_by_length", "data.padding")


def refuse_mid_epoch_changes(
    before: dict, config: Config, state: RunState, checkpoint: Path
) -> None:
    """Raise ConfigError, one line naming the key, where a resume from `checkpoint` (its
    run `state`, its config `before` as a dict) changes an EPOCH_SETTINGS key of text in the
    middle of an epoch; at an epoch boundary any change is allowed."""
    if state.step_in_epoch == 0 or config.data.name not in TEXT_DATASETS:
        return
    for key, old, new in config_changes(before, config.to_dict()):
        if key in EPOCH_SETTINGS:
            setting = key.rpartition(".")[2]
            raise ConfigError(
                f"{key}: {old!r} -> {new!r} cannot change in the middle of an epoch: "
                f"{checkpoint} is at step {state.step_in_epoch} of epoch {state.epoch + 1}, "
                f"and the rest of the epoch follows its {setting}; resume with {key}="
                f"{str(old).lower()}, or from a checkpoint at an epoch's end"
            )


@dataclass
class Resumption:
    """A run continuing from `checkpoint`; `record` is its run_state.json, which every rank
    loads through the checkpointer once the run has one."""

    checkpoint: Path
    previous_attempt_wall_s: float
    record: CheckpointRecord | None = None
    # Of previous_attempt_wall_s: its evaluations and checkpoint writes (off the clock).
    previous_attempt_eval_s: float = 0.0
    previous_attempt_checkpoint_s: float = 0.0
    load_s: float = 0.0

    @property
    def world_size(self) -> int:
        """The world size the checkpoint was written at."""
        return self.record.state.world_size

    def state(self, spec: ModelSpec) -> RunState:
        """The run state to continue from, after checking the checkpoint is of this model."""
        model = self.record.model
        if model.unit_names != list(spec.unit_names) or model.unit_param_counts != list(
            spec.unit_param_counts
        ):
            raise RunDirError(
                f"{self.checkpoint} was written for another model ({len(model.unit_names)} units); "
                "resume it with the config it was trained with"
            )
        state = dataclasses.replace(self.record.state)
        state.previous_attempts_wall_s += self.previous_attempt_wall_s
        state.previous_attempts_eval_s += self.previous_attempt_eval_s
        state.previous_attempts_checkpoint_s += self.previous_attempt_checkpoint_s
        state.attempt += 1
        return state

    def config_change(self, config: Config, speak: bool) -> ConfigChangeEvent | None:
        """The settings this resume changes from the checkpoint's, said (when `speak`) and
        recorded as an event, never silent; None when there are none. The processes per
        node follow the world that resumes; that is the resume event's to say. Raises
        ConfigError for a change the middle of an epoch cannot take (EPOCH_SETTINGS)."""
        record = self.record
        refuse_mid_epoch_changes(record.config, config, record.state, self.checkpoint)
        changes = {
            key: [before, after]
            for key, before, after in config_changes(self.record.config, config.to_dict())
            if key != "trainer.nproc_per_node"
        }
        if not changes:
            return None
        if speak:
            logger.warning(
                "resuming %s with changed settings: %s (recorded in events.jsonl)",
                self.checkpoint,
                ", ".join(f"{k} {b!r} -> {a!r}" for k, (b, a) in changes.items()),
            )
        return ConfigChangeEvent(self.record.state.global_step, str(self.checkpoint), changes)

    def event(self, layout: Layout, world) -> ResumeEvent:
        state = self.record.state
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


def start_run_directory(run_dir: Path, options: RunOptions, control: Control) -> Resumption | None:
    """Decide on rank 0 how the run starts in `run_dir` and prepare the directory; every
    rank returns the same answer (collective). Raises RunDirError on every rank."""
    answer: Resumption | RunDirError | None = None
    # Under torchrun the agent whose workers failed counts the restart; another node's agent
    # restarts its own workers without counting it (for it, a membership change). So any
    # rank that says 'restart' speaks for the run, and a restart never overwrites.
    if bool(control.all_max([float(options.restart)])[0]):
        options = dataclasses.replace(options, restart=True, overwrite=False)
    if control.rank == 0:
        try:
            answer = _prepare(run_dir, options)
        except RunDirError as exc:
            answer = exc
    answer = control.broadcast(answer)
    if isinstance(answer, RunDirError):
        raise answer
    return answer


def write_resolved_config(run_dir: Path, config: Config) -> None:
    """RUN_DIR/config.yaml: the config as the run resolved it (rank 0, once it is known)."""
    write_text_atomic(run_dir / "config.yaml", config_yaml(config))


def _prepare(run_dir: Path, options: RunOptions) -> Resumption | None:
    if options.prepared_checkpoint is None:
        checkpoint = prepare_run_dir(
            run_dir,
            resume=options.resume,
            overwrite=options.overwrite,
            restart=options.restart,
            run_id=options.run_id,
        )
        _held_locks.append(RunLock(run_dir).acquire())
    else:
        checkpoint = Path(options.prepared_checkpoint) if options.prepared_checkpoint else None
    if checkpoint is None:
        if options.run_id is not None:
            write_run_id(run_dir, options.run_id)
        return None
    state = read_run_state(checkpoint).state
    previous = previous_attempt_wall_s(run_dir)  # before the records it reads are trimmed
    eval_s, checkpoint_s = previous_attempt_excluded_s(run_dir)
    truncate_after(run_dir, state.global_step, state.epoch, state.step_in_epoch)
    logger.info(
        "resuming from %s (global step %d, attempt %d)",
        checkpoint,
        state.global_step,
        state.attempt + 1,
    )
    return Resumption(
        checkpoint,
        previous,
        previous_attempt_eval_s=eval_s,
        previous_attempt_checkpoint_s=checkpoint_s,
    )
