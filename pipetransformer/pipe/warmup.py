"""Compiling a layout's units before its first step (`trainer.compile`).

Dynamo compiles a unit's graph at the unit's first call in a new state or form of input
(models/compiled.py). Left to the steps, that is the first step of every layout (and the
first evaluation), while the ranks downstream sit in posted NCCL receives and the ranks
beside it in the data-parallel all-reduce: with a large model or a slow host, inductor's
minutes reach the NCCL timeout; and a unit class that passes its graph limit raises on
one rank in the middle of a step while its peers block in NCCL until the watchdog.

So before the first step of a layout (at the start and after each transition, before the
micro-batch trials of `num_micro_batches: measured`), each rank runs every unit it holds,
once, in every state the layout runs it in (frozen; trained, with or without a gradient
on its input; evaluation) and every form of input the run may give it (a batch of several
samples, of one sample, packed: `warm_up_forms`), forward and backward, on inputs of zeros
of those shapes, under the step's autocast, its random streams put back after. The
trainer then has the ranks agree that every one compiled (trainer/runtime.py): no NCCL
operation is pending while any rank compiles, and a compilation error is raised on every
rank before any step.

A sharded layout is not warmed: FSDP2's hooks gather each unit's parameters around its
forward, so a warm-up would be a step's collectives; it compiles at its first step.

Owns: `warm_up_forms`, `warm_up_units`. Must not: communicate, or decide what a layout is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from pipetransformer.models.layered import ModelSpec
from pipetransformer.utils.padding import PackedShape


@dataclass(frozen=True)
class Form:
    """One form of input: micro-batches of `samples` samples at `seq_length` (a length, a
    packed shape, or None without a sequence)."""

    samples: int
    seq_length: int | PackedShape | None


def warm_up_forms(
    spec: ModelSpec, micro_batch_sizes: Iterable[int], packs: bool, one_sample: bool
) -> list[Form]:
    """The forms a run's units may meet, one of each (the batch and sequence dimensions are
    dynamic, so one size stands for all but 1): several samples, padded (or images) and,
    where text `packs`, packed in two rows; one sample where a micro-batch holds one or
    `one_sample` (AutoCache upgrades and computes any subset of a batch)."""
    sizes = set(micro_batch_sizes)
    length = spec.max_seq_length
    forms = []
    several = max(sizes)
    if several >= 2:
        forms.append(Form(several, length))
        if packs and spec.text:
            forms.append(Form(several, PackedShape(2, length, several)))
    if one_sample or 1 in sizes:
        forms.append(Form(1, length))
    return forms


def _inputs(spec: ModelSpec, unit: int, form: Form, device: torch.device, grad: bool):
    """Zeros shaped as unit `unit`'s inputs in `form`; a padded text batch's attention mask
    (the inputs' third tensor, the activations' second: models/text_models.py) all ones."""
    shaped = spec.at_length(form.seq_length)
    rows = form.seq_length.rows if isinstance(form.seq_length, PackedShape) else None
    tensors = [s.example(form.samples, device, rows) for s in shaped.unit_input_specs(unit)]
    if spec.text and rows is None:
        tensors[2 if unit == 0 else 1].fill_(1)
    if grad:
        tensors[0].requires_grad_(True)
    return tuple(tensors)


def _backward(output) -> None:
    outputs = output if isinstance(output, tuple) else (output,)
    trained = [t.float().sum() for t in outputs if t.requires_grad]
    if trained:
        torch.stack(trained).sum().backward()


def warm_up_units(
    units: Mapping[int, nn.Module],
    frozen_end: int,
    spec: ModelSpec,
    forms: Iterable[Form],
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> None:
    """Run each of `units` (index -> unit; those below `frozen_end` frozen) once in each
    state and form (module docstring). Their parameters, gradients, modes and the random
    streams are as they were."""
    modes = {index: unit.training for index, unit in units.items()}
    autocast = torch.autocast(
        device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    )
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), autocast:
        for form in forms:
            for index in sorted(units):
                unit = units[index]
                if index < frozen_end:  # frozen: eval mode, no autograd
                    unit.eval()
                    with torch.no_grad():
                        unit(*_inputs(spec, index, form, device, grad=False))
                    continue
                unit.train()  # trained: the first trained unit's input carries no gradient
                inputs = _inputs(spec, index, form, device, grad=index > frozen_end)
                _backward(unit(*inputs))
                for p in unit.parameters():
                    p.grad = None
                unit.eval()  # evaluation: eval mode, no autograd, parameters still trained
                with torch.no_grad():
                    unit(*_inputs(spec, index, form, device, grad=False))
    for index, unit in units.items():
        unit.train(modes[index])
