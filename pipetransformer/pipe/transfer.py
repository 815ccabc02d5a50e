"""Host-to-device copies that do not make the host wait.

A copy from pageable host memory to a GPU is synchronous: the host waits until the stream
has reached the copy, which stalls everything queued before it. From pinned (page-locked)
memory with `non_blocking=True` it is queued like a kernel. Every host tensor a step sends
to the device goes through `to_device`.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
