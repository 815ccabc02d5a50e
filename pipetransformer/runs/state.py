"""Everything a checkpoint holds, as objects the checkpointer saves and loads the same way.

`RunState` holds plain values only: where the run is (epoch, step inside it, global step),
what the freeze decider has gathered since its last decision and what that decision saw,
the frozen boundary and the layout it was in (a hint: the layout is planned again for the
world that resumes), the partial sums of the epoch in progress, the eval metrics so far,
and how many attempts the run has taken. Values that live on a device during training
(per-unit gradient norms, the epoch's loss) are reduced over the ranks before they are
written, so the record means the same at any world size. A checkpoint's `run_state.json`
is a `CheckpointRecord`: the run state, the resolved config, what the model was built
from, when and why.

The checkpointer is handed `Stateful` objects (torch.distributed.checkpoint's protocol:
`state_dict()` and `load_state_dict()`), one per kind of state, and treats them alike:

    RunRecordState  the CheckpointRecord                       -> run_state.json
    UnitWeights     every parameter and buffer of this rank's units     model/...
    OptimizerState  the optimizer state of its trained parameters       optim/...
    RngState        its random streams                                  rng/rank<r>/...

The first is here with the records it carries and the tensors' keys; the three that hold a
rank's tensors are the trainer's (trainer/statefuls.py), which owns the units, the optimizer
and the streams.

`state_dict()` gives what to save and, on load, the tensors to fill in place; calling it
changes nothing a run can observe (the optimizer's lazily created state is made up front
only on a load, as torch.distributed.checkpoint does). `load_state_dict()` gets the keys
the checkpoint had.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipetransformer.autodp.topology import Layout


STATE_VERSION = 1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class RunState:
    epoch: int = 0  # the epoch in progress (0-based); epochs before it are complete
    step_in_epoch: int = 0  # steps of `epoch` already taken
    # Samples of each node's epoch order those steps took (the steps' sizes change with the
    # layout under trainer.batch_per_replica; 0 in checkpoints older than the field).
    samples_in_epoch: int = 0
    global_step: int = 0  # optimizer steps taken in the whole run
    # A node's batch in the layout the run started in: the learning-rate schedule's unit
    # (trainer/clock.py); 0 until the clock sets it.
    lr_reference_node_batch: int = 0
    num_frozen_layers: int = 0
    pipe_len: int = 0  # the layout at the checkpoint (a hint for a resume at the same world)
    dp_degree: int = 0
    sharded: bool = False
    num_micro_batches: int = 0
    world_size: int = 0
    devices_per_node: int = 0
    # Freeze decider: decision points so far, and what the current interval has gathered:
    # per unit, summed squared gradient norms reduced over replicas (as the freeze signal
    # reduces them) and the number of steps summed.
    decision_index: int = 0
    # freeze.interval_steps 'measured': the fewest steps between decisions transition costs allow,
    # measured once, at the first transition (0: not yet), and kept for the rest of the run,
    # resumes included, so that the same run decides at the same steps.
    min_decision_interval: int = 1
    decision_interval_measured: bool = False
    interval_grad_sq: list[float] = field(default_factory=list)
    interval_steps: int = 0
    # Per layer, the gradient norms the previous decision saw (the `convergence` rule
    # compares against them); empty before the first decision, and in checkpoints older
    # than the field.
    previous_layer_grad_norms: list[float] = field(default_factory=list)
    # Per layer, the accumulated-gradient signal the previous decision saw (the `autofreeze`
    # rule compares against it); empty before its first decision.
    previous_layer_grad_sums: list[float] = field(default_factory=list)
    # Decisions so far by what set the layer count (freeze.FreezeOutcome.decided_by).
    decided_by: dict[str, int] = field(default_factory=dict)
    # optimizer.layerwise_anneal: each layer's learning-rate curve and planned freeze place
    # (anneal.FreezePlan.to_list), made again at every decision point and at a resume; kept
    # because a re-planned curve remembers where it was re-anchored. Empty: no annealing.
    anneal_plan: list[dict[str, Any]] = field(default_factory=list)
    # The epoch in progress, so far: sum of per-sample losses over all replicas, seconds of
    # training, of transitions and of DDP communication, tokens computed (text).
    epoch_loss_sum: float = 0.0
    epoch_train_s: float = 0.0
    epoch_transition_s: float = 0.0
    epoch_comm_s: float = 0.0
    epoch_padded_tokens: int = 0
    epoch_eval_s: float = 0.0  # evaluations inside the epoch so far (trainer.evals_per_epoch)
    last_eval_metric: float | None = None
    best_eval_metric: float | None = None
    num_transitions: int = 0
    # Attempts of this run (1 = never resumed) and the wall time of the earlier ones, with
    # the seconds of it their evaluations and checkpoint writes took (off the training
    # clock: trainer/clock.py's TrainingClock).
    attempt: int = 1
    previous_attempts_wall_s: float = 0.0
    previous_attempts_eval_s: float = 0.0
    previous_attempts_checkpoint_s: float = 0.0
    # Shares of the training samples by the frozen boundary of their AutoCache entry
    # (planning/run_model.py CachedShares.to_dict; empty: none cached).
    cache_shares: dict[str, Any] = field(default_factory=dict)
    # What the profilers measured that is not in the profile file: a cache read, and for
    # pipeline.sharding 'auto' the collectives and memory bandwidth that price layouts
    # (RunProfiler.links; kept so that a resumed run decides as the first attempt did).
    cache_read_s_per_sample: float | None = None
    link_costs: dict[str, Any] = field(default_factory=dict)

    def enter_layout(self, layout: Layout, world_size: int, devices_per_node: int) -> None:
        """Where the run is now: the boundary, the layout and the world it is in."""
        self.num_frozen_layers = layout.plan.num_frozen_layers
        self.pipe_len, self.dp_degree = layout.pipe_len, layout.dp_degree
        self.sharded = layout.sharded
        self.num_micro_batches = layout.plan.num_micro_batches
        self.world_size, self.devices_per_node = world_size, devices_per_node

    def resume_pipe_len(self, initial: int, world_size: int, devices_per_node: int) -> int:
        """The pipeline length to plan the (resumed) layout from: the checkpoint's when it
        was taken in a world of the same shape (so a resumed run continues exactly as it
        would have), otherwise the initial one (re-planned for the new world)."""
        same_world = (self.world_size, self.devices_per_node) == (world_size, devices_per_node)
        if self.sharded:  # the pipeline AutoPipe would hold there (planning/context.py)
            return initial
        return min(self.pipe_len, initial) if same_world and self.pipe_len > 0 else initial

    def to_dict(self) -> dict[str, Any]:
        return {"state_version": STATE_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        data = dict(data)
        version = data.pop("state_version", None)
        if version != STATE_VERSION:
            raise ValueError(
                f"run state version {version!r}; this code reads version {STATE_VERSION}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class ModelRecord:
    """What a checkpoint's model was: its units, and what export rebuilds it from."""

    unit_names: list[str]
    unit_param_counts: list[int]
    build_args: dict[str, Any]


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint's run_state.json, read back as types."""

    state: RunState
    config: dict[str, Any]  # the resolved config (config_from_dict reads it)
    model: ModelRecord
    time: float = 0.0  # unix time of the write
    reason: str = ""  # 'epoch', 'steps', 'final' or the signal that stopped the run

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.to_dict(),
            "config": self.config,
            "model": dataclasses.asdict(self.model),
            "time": self.time,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointRecord:
        model = data.get("model", {})
        return cls(
            state=RunState.from_dict(data["state"]),
            config=data["config"],
            model=ModelRecord(
                list(model.get("unit_names", [])),
                list(model.get("unit_param_counts", [])),
                dict(model.get("build_args", {})),
            ),
            time=float(data.get("time", 0.0)),
            reason=str(data.get("reason", "")),
        )


# ----------------------------------------------------------------------------- statefuls


class RunRecordState:
    """The run's CheckpointRecord (run_state.json). To save, hand it the record of the run
    as a checkpoint must hold it (the trainer reduces the partial sums first); to load, one
    without a record: `record` is set from the file."""

    KEYS = ("state", "config", "model", "time")

    def __init__(self, record: CheckpointRecord | None = None) -> None:
        self.record = record

    def state_dict(self) -> dict[str, Any]:
        if self.record is None:
            return dict.fromkeys(self.KEYS)
        return {key: value for key, value in self.record.to_dict().items() if key in self.KEYS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.record = CheckpointRecord.from_dict(state_dict)


def model_key(name: str) -> str:
    return f"model/{name}"


def optimizer_key(name: str, entry: str) -> str:
    return f"optim/{name}/{entry}"


def rng_key(rank: int, stream: str) -> str:
    return f"rng/rank{rank}/{stream}"
