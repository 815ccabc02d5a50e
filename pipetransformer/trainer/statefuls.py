"""The statefuls of a rank's tensors: its units' weights, its optimizer state, its random
streams, handed to the checkpointer (runs/checkpoint.py) under the keys runs/state.py names.

Owns: what of a rank's units, optimizer and streams a checkpoint holds, and how a load fills
them in place. Must not: know the directory layout (the checkpointer does).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pipetransformer.runs.state import (
    CheckpointRecord,
    RunRecordState,
    Stateful,
    model_key,
    optimizer_key,
    rng_key,
)
from pipetransformer.trainer import optim
from pipetransformer.trainer.distributed import WorldInfo
from pipetransformer.trainer.step import Stage
from pipetransformer.utils.units import param_key


class UnitWeights:
    """Every parameter and buffer of the units this rank holds, by global name (buffers
    include non-persistent ones: a resumed unit is materialised without initialisation)."""

    def __init__(self, units: Mapping[int, nn.Module]) -> None:
        self.units = units

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for index, unit in self.units.items():
            for name, param in unit.named_parameters():
                tensors[model_key(param_key(index, name))] = param.detach()
            for name, buffer in unit.named_buffers():
                tensors[model_key(param_key(index, name))] = buffer
        return tensors

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.state_dict()) - set(state_dict))
        if missing:
            raise KeyError(
                f"no {missing[0]} ({len(missing)} tensors missing): "
                "it was written for another model"
            )


class OptimizerState:
    """The optimizer state of this rank's trained parameters, by parameter name."""

    def __init__(
        self, optimizer: torch.optim.Optimizer | None, named_params: Mapping[str, nn.Parameter]
    ) -> None:
        self.optimizer = optimizer
        self.named_params = named_params

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.optimizer is not None and not self.optimizer.state:
            optim.materialize_state(self.optimizer)  # a load before the first step
        tensors = {}
        for name, entries in optim.states_by_name(self.optimizer, self.named_params).items():
            for entry, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[optimizer_key(name, entry)] = value
        return tensors

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loaded in place; a parameter the checkpoint had no state for goes back to none
        (as before its first step)."""
        if self.optimizer is None:
            return
        loaded = {key.split("/")[1] for key in state_dict}
        for name, param in self.named_params.items():
            if name not in loaded:
                self.optimizer.state.pop(param, None)


class RngState:
    """This process's random streams: the CPU generator and, on a GPU, the device's."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device

    def state_dict(self) -> dict[str, torch.Tensor]:
        states = {rng_key(self.rank, "cpu"): torch.get_rng_state()}
        if self.device.type == "cuda":
            states[rng_key(self.rank, "cuda")] = torch.cuda.get_rng_state(self.device)
        return states

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        cpu = state_dict.get(rng_key(self.rank, "cpu"))
        if cpu is not None:
            torch.set_rng_state(cpu.cpu())
        cuda = state_dict.get(rng_key(self.rank, "cuda"))
        if cuda is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(cuda.cpu(), self.device)


def reseed(seed: int, rank: int, global_step: int) -> None:
    """A deterministic fresh stream for a rank whose saved one cannot be used (the world
    size changed): a function of the seed, the rank and where the run resumes."""
    torch.manual_seed((seed * 1_000_003 + global_step) * 65_537 + rank + 1)


def seed_streams(seed: int, rank: int, global_step: int, restored: bool | None) -> None:
    """Each rank's own random stream (dropout) from here on, which simply continues across
    transitions: a fresh run's from the seed and the rank; a resume's as the checkpoint
    restored it (`restored`), or reseeded where the world size changed. Last in setup, so
    nothing there draws from the streams a checkpoint restored. `restored` None: no resume."""
    if restored is None:
        torch.manual_seed(seed + 1 + rank)
    elif not restored:
        reseed(seed, rank, global_step)


def checkpoint_statefuls(
    stage: Stage, world: WorldInfo, record: CheckpointRecord | None = None, rng: bool = True
) -> dict[str, Stateful]:
    """What a checkpoint holds of this rank, in the same order on every rank: the run's
    record (when saving), its units, its optimizer state and (`rng`) its random streams."""
    statefuls: dict[str, Stateful] = {}
    if record is not None:
        statefuls["run"] = RunRecordState(record)
    statefuls["units"] = UnitWeights(stage.units)
    statefuls["optimizer"] = OptimizerState(stage.optimizer, stage.named_params())
    if rng:
        statefuls["rng"] = RngState(world.rank, world.device)
    return statefuls
