"""The process's place in the world, read from the launcher's environment (torchrun's names)."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    devices_per_node: int
    device: torch.device

    @property
    def node(self) -> int:
        return self.rank // self.devices_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.devices_per_node


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set (start through the CLI or torchrun)")
        return default
    return int(value)


def init_distributed(device_kind: str, timeout_s: float) -> WorldInfo:
    rank = _env_int("RANK")
    world_size = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    devices_per_node = _env_int("LOCAL_WORLD_SIZE", world_size)
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device: 'cuda' was asked for but CUDA is not available")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Several processes share the cores: one thread each, or they slow each other 5-15x.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices_per_node))
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    return WorldInfo(rank, world_size, local_rank, devices_per_node, device)
