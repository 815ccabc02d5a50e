"""Optimizer and learning-rate schedule, keyed by global parameter names.

The optimizer is rebuilt at every transition over the parameters a rank trains in the new
layout; its per-parameter state is carried across by name (`param_key`:
'units.<unit>.<param>'), so a parameter that moved ranks continues with its own moments and
step count. The learning rate is a pure function of the global step, so nothing about it
needs moving.

Parameter groups: weight decay or none (`decay_groups`); with `optimizer.layerwise_anneal`
also one pair per layer (`layer_groups`), each group tagged with its layer (None: the head,
which keeps the run's schedule; the embedding anneals with layer 0, with which it freezes).
Groups are made from the parameters' names, so they are the same whichever rank holds a
unit and in any layout (sharded ones included), and each group's rate is a function of the
run's place and its freeze plan (pipetransformer/anneal.py), the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipetransformer.anneal import decay_shape
from pipetransformer.config import OptimizerConfig
from pipetransformer.fsdp import local
from pipetransformer.pipe.transfer import to_device
from pipetransformer.utils.units import layer_of_unit, parse_param_key


def learning_rate(config: OptimizerConfig, step: float, total_steps: int) -> float:
    """Linear warm-up, then constant / cosine / linear decay to `min_lr_ratio * lr`. `step`:
    the 0-based place in the schedule, fractional when the batch changed (clock.py)."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, max(0.0, (step - config.warmup_steps) / decay_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * decay_shape(config.lr_schedule, progress)


def implementation_options(config: OptimizerConfig, device_type: str) -> dict[str, bool]:
    """The constructor flag that picks torch's implementation (optimizer.implementation)."""
    choice = config.implementation
    if choice == "auto":
        # Adam's fused kernel is one pass over each parameter's memory on CUDA and on the CPU;
        # foreach on the CPU is a loop of a dozen elementwise passes. Measured on this
        # project's 2-core VM (one thread, MiniLM's 22.7M parameters): AdamW 110 ms a step
        # with foreach, 27 ms fused, results equal to 2.4e-7 (docs/benchmarks.md section 15).
        choice = "fused" if config.name != "sgd" else "foreach"
    return {choice: True}


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups: biases and norm weights (1-D) get no weight decay, as is standard
    for Transformers (and what transformers' Trainer does)."""
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def annealed_layer(name: str, num_layers: int) -> int | None:
    """The layer whose learning-rate curve a parameter follows under layer-wise annealing:
    its unit's layer, layer 0 for the embedding (it freezes with layer 0), None for the head
    (the run's schedule)."""
    unit = parse_param_key(name)[0]
    if unit == 0:
        return 0
    return layer_of_unit(unit, num_layers)


def layer_groups(
    params: list[tuple[str, nn.Parameter]], weight_decay: float, num_layers: int
) -> list[dict[str, Any]]:
    """`decay_groups` for each layer's parameters (and the head's), each tagged with its
    `layer` (`annealed_layer`), in the order of the parameters."""
    by_layer: dict[int | None, list[nn.Parameter]] = {}
    for name, p in params:
        by_layer.setdefault(annealed_layer(name, num_layers), []).append(p)
    return [
        {**group, "layer": layer}
        for layer, members in by_layer.items()
        for group in decay_groups(members, weight_decay)
    ]


def build_optimizer(
    config: OptimizerConfig,
    named_params: Mapping[str, nn.Parameter],
    num_layers: int | None = None,
) -> torch.optim.Optimizer | None:
    """None when there is nothing to train (a rank whose units are all frozen, or idle).
    `num_layers`: the model's, for `optimizer.layerwise_anneal`'s groups (module docstring)."""
    params = [(n, p) for n, p in named_params.items() if p.requires_grad]
    if not params:
        return None
    options = implementation_options(config, params[0][1].device.type)
    if config.layerwise_anneal and num_layers is not None:
        groups = layer_groups(params, config.weight_decay, num_layers)
    else:
        groups = decay_groups([p for _, p in params], config.weight_decay)
    if config.name == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, **options)
    cls = torch.optim.Adam if config.name == "adam" else torch.optim.AdamW
    return cls(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, **options)


def states_by_name(
    optimizer: torch.optim.Optimizer | None, named_params: Mapping[str, nn.Parameter]
) -> dict[str, dict[str, Any]]:
    if optimizer is None:
        return {}
    return {
        name: dict(optimizer.state[p]) for name, p in named_params.items() if p in optimizer.state
    }


def load_states_by_name(
    optimizer: torch.optim.Optimizer | None,
    named_params: Mapping[str, nn.Parameter],
    states: Mapping[str, dict[str, Any]],
) -> None:
    """Carried state (a handoff's, or another implementation's) put where this optimizer
    keeps it: every tensor on its parameter's device, except Adam's step count, which torch
    keeps on the host unless the optimizer is fused or capturable."""
    if optimizer is None:
        return
    group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
    for name, p in named_params.items():
        if p.requires_grad and name in states:
            group = group_of[p]
            step_on_device = bool(group.get("fused") or group.get("capturable"))
            optimizer.state[p] = {
                k: v.to(p.device if k != "step" or step_on_device else "cpu")
                if isinstance(v, torch.Tensor)
                else v
                for k, v in states[name].items()
            }


def materialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state the optimizer makes at its first step, without changing a parameter:
    a step with zero gradients at learning rate 0 (torch.distributed.checkpoint does the same
    before loading into an optimizer). Only for a load, which then overwrites every entry:
    Adam's step count would otherwise start at 1."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def set_learning_rate(
    optimizer: torch.optim.Optimizer | None,
    lr: float,
    layer_rates: list[float] | None = None,
) -> None:
    """`lr` for every group; with `layer_rates` (layer-wise annealing) a group tagged with a
    layer takes that layer's rate, the head's group `lr`."""
    if optimizer is not None:
        for group in optimizer.param_groups:
            layer = group.get("layer")
            group["lr"] = lr if layer is None or layer_rates is None else layer_rates[layer]


def momentum_decay(config: OptimizerConfig) -> float | None:
    """The decay of the optimizer's moving average of gradients (Adam's beta1, SGD's
    momentum); None when it keeps none."""
    if config.name in ("adam", "adamw"):
        return config.betas[0]
    return config.momentum if config.momentum > 0 else None


def momentum_sq_by_unit(
    optimizer: torch.optim.Optimizer | None,
    named_params: Mapping[str, nn.Parameter],
    num_units: int,
    device: torch.device,
) -> torch.Tensor:
    """Per unit, the squared norm of the optimizer's moving average of gradients as an
    estimate of the mean gradient: Adam's bias-corrected first moment, SGD's momentum
    buffer times (1 - momentum). float64 on `device`, without a host read of a device
    tensor (fused Adam keeps its step count on the device). In a sharded layout, the
    squares of this rank's shards: their sum over the ranks is the unit's."""
    squares = torch.zeros(num_units, dtype=torch.float64, device=device)
    if optimizer is None:
        return squares
    group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
    averages, owners, scales = [], [], []
    adam, steps, betas = [], [], []  # Adam's entries: where, their step counts, beta1
    for name, p in named_params.items():
        state = optimizer.state.get(p)
        if not state:
            continue
        group = group_of[p]
        if "exp_avg" in state:
            adam.append(len(averages))
            steps.append(state["step"])
            betas.append(group["betas"][0])
            scales.append(1.0)
            averages.append(local(state["exp_avg"]))
        elif state.get("momentum_buffer") is not None:
            scales.append(1.0 - group["momentum"])
            averages.append(local(state["momentum_buffer"]))
        else:
            continue
        owners.append(parse_param_key(name)[0])
    if averages:
        norms = torch.stack(torch._foreach_norm(averages)).double()
        scale = to_device(torch.tensor(scales, dtype=torch.float64), device)
        if adam:
            where = to_device(torch.tensor(adam, dtype=torch.long), device)
            scale[where] = _bias_corrections(steps, betas, device)
        index = to_device(torch.tensor(owners, dtype=torch.long), device)
        squares.index_add_(0, index, (norms * scale).square())
    return squares


def _bias_corrections(steps: list[Any], betas: list[float], device: torch.device) -> torch.Tensor:
    """Adam's 1 / (1 - beta1^step) of each entry (0 before its first step), float64 on
    `device`: step counts on the host are read there, those on the device stay there."""
    counts = torch.empty(len(steps), dtype=torch.float64, device=device)
    kept = [isinstance(s, torch.Tensor) and s.device.type != "cpu" for s in steps]
    host = [i for i, on_device in enumerate(kept) if not on_device]
    if host:
        values = torch.tensor([float(steps[i]) for i in host], dtype=torch.float64)
        counts[to_device(torch.tensor(host), device)] = to_device(values, device)
    if len(host) < len(steps):
        on_device = [i for i, k in enumerate(kept) if k]
        values = torch.stack([steps[i].reshape(()) for i in on_device]).double()
        counts[to_device(torch.tensor(on_device), device)] = values
    powers = to_device(torch.tensor(betas, dtype=torch.float64), device).pow(counts)
    return torch.where(counts > 0, 1.0 / (1.0 - powers), 0.0)
