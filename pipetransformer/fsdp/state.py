"""Units and optimizer state in and out of FSDP2's sharding, bit-exact both ways.

Entering a sharded layout, `fully_shard` (fsdp/runtime.py) turns each trained parameter into
a `DTensor` holding this rank's shard (dim 0 cut as `torch.chunk` cuts it); the optimizer
state the transition carried in full is cut the same way (`shard_optimizer_states`), locally,
without communication. Leaving one, `gather_units` all-gathers every sharded parameter and
optimizer state entry into fresh plain units built from the meta-device skeletons: every
rank then holds every unit in full, as every rank of a one-stage layout does, and the
ordinary handoff (autodp/handoff.py) takes over. A unit that stays trained in a next sharded
layout is not gathered: its shard is the same cut of the same world, so the fresh unit
stays on the meta device carrying its local shards (`carried_shards`), which the new
layout's runtime copies in once it has sharded the unit again, and its optimizer state keeps
its local shards under the new mesh. FSDP2 modules are not reused across layouts: a root
that has run once cannot adopt its groups under another root, and the process groups of a
layout are destroyed at the next transition.

Owns: those conversions and `local` (the shard of a possibly sharded tensor).
Must not: create or destroy process groups, or decide anything about layouts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from pipetransformer.utils.units import param_key

OptimizerStates = dict[str, dict[str, Any]]  # global parameter name -> optimizer state


def is_sharded(tensor: object) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: the shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def unit_is_sharded(unit: nn.Module) -> bool:
    """Whether FSDP2 manages `unit` (its parameters may be gathered at the moment: a group
    that does not reshard after forward keeps them after an evaluation)."""
    return isinstance(unit, FSDPModule)


CARRIED = "_pipetransformer_carried_shards"  # attribute of a meta unit: its local shards


def carried_shards(unit: nn.Module) -> dict[str, torch.Tensor] | None:
    """The local shards (parameters by name, buffers in full) a meta-device unit carries
    into the next sharded layout, or None for an ordinary unit."""
    return getattr(unit, CARRIED, None)


def gather_units(
    units: Mapping[int, nn.Module],
    states: OptimizerStates,
    skeletons: Mapping[int, nn.Module],
    device: torch.device,
    keep_sharded: frozenset[int] | set[int] = frozenset(),
) -> tuple[dict[int, nn.Module], OptimizerStates]:
    """Every unit in full and plain (no FSDP2 hooks), with its optimizer state in full,
    except the units of `keep_sharded` (trained in a next sharded layout): those come back
    as meta-device units carrying their local shards, their state as it is. Collective over
    the sharded units' mesh: every rank, the same units in the same order. Units that hold
    no shard (the frozen prefix) are kept as they are."""
    gathered: dict[int, nn.Module] = {}
    full_states: OptimizerStates = {}
    for index in sorted(units):
        unit = units[index]
        if not unit_is_sharded(unit):
            gathered[index] = unit
            continue
        unit.reshard()  # its parameters as shards, whatever the last forward left
        if index in keep_sharded:
            carried = copy.deepcopy(skeletons[index])
            shards = {name: local(p.detach()) for name, p in unit.named_parameters()}
            shards.update(dict(unit.named_buffers()))
            setattr(carried, CARRIED, shards)
            carried.train(unit.training)
            gathered[index] = carried
            continue
        fresh = copy.deepcopy(skeletons[index]).to_empty(device=device)
        params = dict(fresh.named_parameters())
        for name, param in unit.named_parameters():
            value = param.detach()
            params[name].data = value.full_tensor() if isinstance(value, DTensor) else value
            params[name].requires_grad_(param.requires_grad)
        for name, buffer in unit.named_buffers():
            owner_path, _, leaf = name.rpartition(".")
            owner = fresh.get_submodule(owner_path) if owner_path else fresh
            owner._buffers[leaf] = buffer
        fresh.train(unit.training)
        gathered[index] = fresh
        for name, _ in unit.named_parameters():
            key = param_key(index, name)
            if key in states:
                full_states[key] = {
                    entry: value.full_tensor() if isinstance(value, DTensor) else value
                    for entry, value in states[key].items()
                }
    for key, entries in states.items():
        full_states.setdefault(key, entries)
    return gathered, full_states


def shard_optimizer_states(
    states: Mapping[str, dict[str, Any]], named_params: Mapping[str, nn.Parameter]
) -> OptimizerStates:
    """`states` (full tensors) cut into the shards of the sharded parameters they belong to,
    locally: an entry shaped like its parameter becomes a DTensor placed as the parameter is;
    anything else (Adam's step count) stays as it is."""
    sharded: OptimizerStates = {}
    for name, entries in states.items():
        param = named_params.get(name)
        if not isinstance(param, DTensor):
            sharded[name] = dict(entries)
            continue
        sharded[name] = {
            entry: _like(param, value)
            if isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for entry, value in entries.items()
        }
    return sharded


def _like(param: DTensor, value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):  # the same shard, carried from the previous layout's mesh
        return DTensor.from_local(
            value.to_local(),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return distribute_tensor(
        value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
    )
