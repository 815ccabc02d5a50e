"""The trainer's state: everything that must survive a crash besides weights and optimizer
state, as one explicit record.

`RunState` holds plain values only (JSON in a checkpoint's run_state.json): where the run
is (epoch, step inside it, global step), what the freeze decider has accumulated since its
last decision, the frozen boundary and the layout it was in (a hint: the layout is planned
again for the world that resumes), the partial sums of the epoch in progress, the eval
metrics so far, and how many attempts the run has taken. Values that live on a device
during training (per-unit gradient norms, the epoch's loss) are reduced over the ranks
before they are written here, so the record means the same at any world size.

Per-rank RNG streams are tensors and travel in the checkpoint's tensor files (see
checkpoint.py); `rng_state` / `set_rng_state` read and restore them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

STATE_VERSION = 1


@dataclass
class RunState:
    epoch: int = 0  # the epoch in progress (0-based); epochs before it are complete
    step_in_epoch: int = 0  # steps of `epoch` already taken
    global_step: int = 0  # optimizer steps taken in the whole run
    num_frozen_layers: int = 0
    pipe_len: int = 0  # the layout at the checkpoint (a hint for a resume at the same world)
    dp_degree: int = 0
    num_micro_batches: int = 0
    world_size: int = 0
    devices_per_node: int = 0
    # Freeze decider: decision points so far, and what the current interval has gathered:
    # per unit, summed squared gradient norms reduced over replicas (as layer_grad_norms
    # reduces them) and the number of steps summed.
    decision_index: int = 0
    # freeze.interval_steps 'auto': the fewest steps between decisions transition costs allow.
    min_decision_interval: int = 1
    interval_grad_sq: list[float] = field(default_factory=list)
    interval_steps: int = 0
    # The epoch in progress, so far: sum of per-sample losses over all replicas, seconds of
    # training, of transitions and of DDP communication.
    epoch_loss_sum: float = 0.0
    epoch_train_s: float = 0.0
    epoch_transition_s: float = 0.0
    epoch_comm_s: float = 0.0
    last_eval_metric: float | None = None
    best_eval_metric: float | None = None
    num_transitions: int = 0
    # Attempts of this run (1 = never resumed) and the wall time of the earlier ones.
    attempt: int = 1
    previous_attempts_wall_s: float = 0.0
    # What the profilers measured that is not in the profile file.
    cache_read_s_per_sample: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"state_version": STATE_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        data = dict(data)
        version = data.pop("state_version", None)
        if version != STATE_VERSION:
            raise ValueError(f"run state version {version!r}; this code reads version {STATE_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random streams: the CPU generator and, on a GPU, the device's."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_state(states: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states["cpu"].cpu())
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def reseed(seed: int, rank: int, global_step: int) -> None:
    """A deterministic fresh stream for a rank whose saved one cannot be used (the world
    size changed): a function of the seed, the rank and where the run resumes."""
    torch.manual_seed((seed * 1_000_003 + global_step) * 65_537 + rank + 1)
