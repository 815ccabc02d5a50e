"""Moving units (weights, buffers, optimizer state) to the ranks that hold them next.

`plan_transfers` is pure: for every unit a rank needs in the new layout and does not hold,
it names a source that held it in the old layout, preferring the destination's own old
replica (so traffic stays inside the node). Every rank computes the same list. A rank's
units are its stage's, several non-contiguous ranges when it holds several chunks
(interleaved_1f1b, zero_bubble): the list is per unit, so that changes nothing here.

`execute_transfers` runs that list in order, each rank taking part only in its own
transfers. A global order of blocking point-to-point messages cannot deadlock: the first
unfinished transfer always has both of its ranks waiting on it. A transfer is a small
manifest (names, shapes, dtypes, non-tensor optimizer values, and the few tensors torch keeps
on the host, such as Adam's step count) over the control group, then one flat byte buffer of
everything on the device over the default group (NCCL on GPUs), each entry at an offset
aligned for any dtype, so the copy is bit-exact and every entry arrives on the device it
left from. The buffer goes as batched point-to-point (`batch_isend_irecv`), which on NCCL
runs on the default group's own communicator: a plain send/recv would open a communicator
for each pair of ranks a transition pairs (`_point_to_point`).
A receiving rank materialises only the units it receives, from the meta-device skeleton.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.autodp.topology import Layout
from pipetransformer.utils.units import param_key, parse_param_key

logger = logging.getLogger(__name__)

OptimizerStates = dict[str, dict[str, Any]]  # global parameter name -> optimizer state


@dataclass(frozen=True)
class Transfer:
    unit: int
    src: int
    dst: int
    with_optimizer_state: bool


def _holder(layout: Layout, replica: int, unit: int) -> int:
    stage = 0 if unit < layout.plan.prefix_end else layout.plan.stage_of_unit(unit)
    if stage is None:
        raise ValueError(f"unit {unit} has no stage in the layout")
    return layout.rank_of(replica, stage)


def plan_transfers(old: Layout, new: Layout) -> list[Transfer]:
    if old.world_size != new.world_size or old.devices_per_node != new.devices_per_node:
        raise ValueError("the world never changes size during a run")
    transfers = []
    for dst in range(new.world_size):
        held = set(old.units_of_rank(dst))
        old_role = old.role(dst)
        if old_role is not None:
            replica = old_role.replica
        else:  # an idle rank: any old replica on its node holds every unit
            replica = (dst // old.devices_per_node) * old.replicas_per_node
        for unit in new.units_of_rank(dst):
            if unit in held:
                continue
            src = _holder(old, replica, unit)
            transfers.append(Transfer(unit, src, dst, unit >= new.plan.frozen_end))
    return transfers


def unit_tensors(
    unit_index: int, unit: nn.Module, optimizer_states: Mapping[str, dict[str, Any]] | None
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """(name, tensor) pairs to ship and the non-tensor optimizer values, in a fixed order."""
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    for name, param in unit.named_parameters():
        tensors.append((f"param:{name}", param.detach()))
        if optimizer_states is not None:
            for key, value in optimizer_states.get(param_key(unit_index, name), {}).items():
                if isinstance(value, torch.Tensor):
                    tensors.append((f"opt:{name}:{key}", value))
                else:
                    scalars[f"opt:{name}:{key}"] = value
    for name, buffer in unit.named_buffers():
        tensors.append((f"buffer:{name}", buffer))
    return tensors, scalars


@dataclass(frozen=True)
class Packed:
    """A unit ready to send: the manifest (small, over the control group) and one flat byte
    buffer on the compute device (over the default group: NCCL on GPUs).

    Every tensor on the compute device travels in the buffer. A tensor torch keeps on the
    host although its parameter lives on the device (Adam's `step` without `capturable` or
    `fused`: "Deliberately host `step` on CPU") travels in the manifest, so it is never
    concatenated with device tensors and arrives on the host again."""

    manifest: dict[str, Any]
    payload: torch.Tensor


def pack_unit(
    unit_index: int,
    unit: nn.Module,
    optimizer_states: Mapping[str, dict[str, Any]] | None,
    device: torch.device,
) -> Packed:
    tensors, scalars = unit_tensors(unit_index, unit, optimizer_states)
    on_device = [(n, t) for n, t in tensors if t.device.type == device.type]
    host = {n: t.detach().clone() for n, t in tensors if t.device.type != device.type}
    manifest = {
        "unit": unit_index,
        "entries": [(name, tuple(t.shape), t.dtype) for name, t in on_device],
        "host_tensors": host,
        "scalars": scalars,
    }
    offsets, total = payload_layout(manifest)
    payload = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), start in zip(on_device, offsets):
        flat = t.detach().reshape(-1).contiguous().view(torch.uint8)
        payload[start : start + flat.numel()].copy_(flat)
    return Packed(manifest, payload)


# Every buffer entry starts at a multiple of this many bytes: a view of the buffer as an
# entry's dtype needs an offset divisible by the element size (an int64 buffer after fused
# Adam's 4-byte device `step` was refused, "storage_offset() must be divisible by 8"), and
# 16 bytes keeps every entry as aligned as the buffer itself for vectorised copies.
ENTRY_ALIGNMENT = 16


def payload_layout(manifest: dict[str, Any]) -> tuple[list[int], int]:
    """(byte offset of each buffer entry of a manifest, in order; the buffer's size)."""
    offsets, end = [], 0
    for _, shape, dtype in manifest["entries"]:
        start = -(-end // ENTRY_ALIGNMENT) * ENTRY_ALIGNMENT
        offsets.append(start)
        end = start + torch.Size(shape).numel() * dtype.itemsize
    return offsets, end


def unpack_unit(
    manifest: dict[str, Any], payload: torch.Tensor, skeleton: nn.Module, device: torch.device
) -> tuple[nn.Module, OptimizerStates]:
    """The unit materialised on `device` from its meta-device skeleton, and its optimizer
    state: buffer entries on `device`, host tensors on the host, as the sender held them."""
    unit_index = manifest["unit"]
    unit = skeleton.to_empty(device=device)
    params = dict(unit.named_parameters())
    buffers = dict(unit.named_buffers())
    states: OptimizerStates = {}
    offsets, _ = payload_layout(manifest)
    for (name, shape, dtype), start in zip(manifest["entries"], offsets):
        size = torch.Size(shape).numel() * dtype.itemsize
        value = payload[start : start + size].view(dtype).reshape(shape).clone()
        kind, _, rest = name.partition(":")
        if kind == "param":
            params[rest].data = value
        elif kind == "buffer":
            _set_buffer(unit, rest, value)
            buffers.pop(rest)
        else:
            param_name, _, key = rest.rpartition(":")
            states.setdefault(param_key(unit_index, param_name), {})[key] = value
    for name, value in (*manifest["host_tensors"].items(), *manifest["scalars"].items()):
        param_name, _, key = name[len("opt:") :].rpartition(":")
        states.setdefault(param_key(unit_index, param_name), {})[key] = value
    if buffers:
        raise RuntimeError(f"unit {unit_index}: buffers {sorted(buffers)} were not received")
    return unit, states


def _send_unit(transfer: Transfer, unit: nn.Module, states, control, device) -> None:
    packed = pack_unit(
        transfer.unit, unit, states if transfer.with_optimizer_state else None, device
    )
    dist.send_object_list([packed.manifest], dst=transfer.dst, group=control)
    _point_to_point(dist.isend, packed.payload, transfer.dst)


def _point_to_point(op, tensor: torch.Tensor, peer: int) -> None:
    """One send or receive on the default group, as a batch of one, waited for. On NCCL a
    plain `send`/`recv` opens a communicator of its own for every pair of ranks that talk
    that way (ProcessGroupNCCL `pointToPoint`: `getKeySendRecv`), kept with its buffers on
    both GPUs until the group goes: one per pair a run's transitions ever pair, which no
    memory budget counts. Inside a batch (`batch_isend_irecv`: an NCCL group) it runs on the
    group's own communicator, which exists from the start (the world is initialised with its
    device bound). gloo runs it as a plain send or receive."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)]):
        work.wait()


def _receive_unit(
    transfer: Transfer, skeleton: nn.Module, control, device
) -> tuple[nn.Module, OptimizerStates]:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=transfer.src, group=control)
    manifest = box[0]
    if manifest["unit"] != transfer.unit:
        raise RuntimeError(
            f"expected unit {transfer.unit} from rank {transfer.src}, got {manifest['unit']}"
        )
    payload = torch.empty(payload_layout(manifest)[1], dtype=torch.uint8, device=device)
    _point_to_point(dist.irecv, payload, transfer.src)
    return unpack_unit(manifest, payload, skeleton, device)


def _set_buffer(module: nn.Module, dotted: str, value: torch.Tensor) -> None:
    owner_path, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    owner._buffers[leaf] = value


def _release(unit: int, units: dict[int, nn.Module], optimizer_states: OptimizerStates) -> None:
    del units[unit]
    for key in [k for k in optimizer_states if parse_param_key(k)[0] == unit]:
        del optimizer_states[key]


def execute_transfers(
    transfers: list[Transfer],
    rank: int,
    units: dict[int, nn.Module],
    optimizer_states: OptimizerStates,
    skeletons: Mapping[int, nn.Module],
    control: dist.ProcessGroup,
    device: torch.device,
    keep: set[int],
) -> tuple[dict[int, nn.Module], OptimizerStates]:
    """Run this rank's part of `transfers`; return the units and states it received.

    `keep`: the units this rank holds in the new layout. Every other unit is removed from
    `units` and `optimizer_states` once this rank has nothing more to send from it (before
    anything arrives, for a unit nobody needs from it), so the old stage and the arriving
    units are held together no longer than they must be; the caller must hold no other
    reference to them (the old runtime and optimizer go first)."""
    last_send = {t.unit: i for i, t in enumerate(transfers) if t.src == rank}
    for unit in [u for u in units if u not in keep and u not in last_send]:
        _release(unit, units, optimizer_states)
    received: dict[int, nn.Module] = {}
    received_states: OptimizerStates = {}
    for i, transfer in enumerate(transfers):
        if transfer.src == rank:
            _send_unit(transfer, units[transfer.unit], optimizer_states, control, device)
            if transfer.unit not in keep and last_send[transfer.unit] == i:
                _release(transfer.unit, units, optimizer_states)
        elif transfer.dst == rank:
            skeleton = copy.deepcopy(skeletons[transfer.unit])
            unit, states = _receive_unit(transfer, skeleton, control, device)
            received[transfer.unit] = unit
            received_states.update(states)
    return received, received_states
