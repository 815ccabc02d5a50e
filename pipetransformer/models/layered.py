"""The model shape every other component works with: embedding + L blocks + head, as units.

A *unit* is the smallest piece a stage boundary may fall between:

    unit 0            embedding          (raw inputs -> activations)
    unit 1 + 2l       layer l attention  (activations -> activations, residual inside)
    unit 2 + 2l       layer l MLP        (activations -> activations, residual inside)
    unit 2L + 1       head               (activations -> logits)

*Activations* are a tuple of tensors; the first is the hidden state (it carries gradients),
the others (e.g. BERT's attention mask) ride along unchanged and never need gradients. A
packed text batch (`ModelSpec.at_length` of a `PackedShape`) adds the sample starts at the
end of the inputs and of the activations: a tensor of one value a sample, where the others
have one row per packed row (`TensorSpec.per_sample`, as the outputs).

Owns: `LayeredModel` (the units and their static description) and `UnitSequence` (runs a
contiguous range of units, frozen ones in eval mode without autograd).
Must not: know any concrete architecture (the adapters registered in registry.py do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from pipetransformer.utils.padding import PackedShape
from pipetransformer.utils.units import (
    attention_unit,
    layer_of_unit,
    mlp_unit,
    param_key,
    prefix_end,
)

Activations = tuple[torch.Tensor, ...]

__all__ = ["attention_unit", "layer_of_unit", "mlp_unit", "prefix_end"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape (without the batch dimension) and dtype of one tensor in a batch. `sequence`:
    its first dimension holds the text's tokens (max_seq_length of them, then any rows that
    do not depend on the length, as DeBERTa's table), so it follows the batch's length."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    sequence: bool = False
    # Its batch dimension counts samples where the others count a packed batch's rows (the
    # outputs, the sample starts); the same thing unpacked.
    per_sample: bool = False

    def at_length(self, length: int, max_length: int) -> TensorSpec:
        """This spec for a batch padded to `length` tokens instead of `max_length`."""
        if not self.sequence:
            return self
        return TensorSpec((self.shape[0] - max_length + length, *self.shape[1:]), self.dtype, True)

    def example(
        self, batch_size: int, device: torch.device | str = "cpu", rows: int | None = None
    ) -> torch.Tensor:
        """A zero tensor of `batch_size` samples (of `rows` packed rows, when given and the
        spec counts rows)."""
        size = rows if rows is not None and not self.per_sample else batch_size
        return torch.zeros((size, *self.shape), dtype=self.dtype, device=device)

    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model that planning and stage building need, without weights."""

    family: str
    task: str  # "classification" | "question_answering"
    num_layers: int
    unit_names: tuple[str, ...]
    unit_param_counts: tuple[int, ...]
    input_specs: tuple[TensorSpec, ...]
    activation_specs: tuple[TensorSpec, ...]
    output_spec: TensorSpec
    # Text: the tokens the specs are sized for (data.max_seq_length); None: no sequence.
    max_seq_length: int | None = None

    def at_length(self, length: int | PackedShape | None) -> ModelSpec:
        """The spec of a batch padded to `length` tokens (itself for None or no sequence),
        or packed in a `PackedShape`'s rows (the sample starts added to the inputs and the
        activations; the outputs, one a sample, per sample)."""
        if isinstance(length, PackedShape):
            padded = self.at_length(length.row_length)
            starts = TensorSpec((), torch.long, per_sample=True)
            return dataclasses.replace(
                padded,
                input_specs=(*padded.input_specs, starts),
                activation_specs=(*padded.activation_specs, starts),
                output_spec=dataclasses.replace(padded.output_spec, per_sample=True),
            )
        if length is None or self.max_seq_length is None or length == self.max_seq_length:
            return self

        def resized(specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
            return tuple(s.at_length(length, self.max_seq_length) for s in specs)

        return dataclasses.replace(
            self,
            input_specs=resized(self.input_specs),
            activation_specs=resized(self.activation_specs),
            output_spec=self.output_spec.at_length(length, self.max_seq_length),
            max_seq_length=length,
        )

    @property
    def num_units(self) -> int:
        return len(self.unit_names)

    @property
    def text(self) -> bool:
        """A text encoder (token ids in, a sequence length that varies between batches)."""
        return not self.input_specs[0].dtype.is_floating_point

    @property
    def head_unit(self) -> int:
        return self.num_units - 1

    def examples(self, specs: Sequence[TensorSpec], batch_size: int, device, grad_first: bool):
        tensors = [s.example(batch_size, device) for s in specs]
        if grad_first:
            tensors[0].requires_grad_(True)
        return tuple(tensors)

    def unit_input_specs(self, unit: int) -> tuple[TensorSpec, ...]:
        return self.input_specs if unit == 0 else self.activation_specs

    def unit_output_specs(self, unit: int) -> tuple[TensorSpec, ...]:
        return (self.output_spec,) if unit == self.head_unit else self.activation_specs


class LayeredModel(nn.Module):
    """A model cut into units. Adapters build it; nothing else looks inside the units."""

    def __init__(
        self, units: Sequence[nn.Module], spec: ModelSpec, source: nn.Module | None = None
    ) -> None:
        super().__init__()
        if len(units) != spec.num_units:
            raise ValueError(f"{len(units)} units but the spec names {spec.num_units}")
        self.units = nn.ModuleList(units)
        self.spec = spec
        # The timm / transformers model the units were cut from: they share its modules, so
        # it holds whatever the units hold (what export writes). Not a submodule: its
        # parameters are the units' and must not appear twice.
        object.__setattr__(self, "source", source)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return UnitSequence(list(self.units), frozen=[False] * len(self.units))(*inputs)


def unit_param_names(unit: nn.Module, unit_index: int) -> dict[str, nn.Parameter]:
    """Parameters of a unit under their global names (`param_key`, stable across ranks)."""
    return {param_key(unit_index, name): p for name, p in unit.named_parameters()}


class UnitSequence(nn.Module):
    """Runs units in order. Frozen units run in eval mode without building a graph.

    The frozen units of a sequence must come first: a frozen unit after a trained one would
    cut the gradient path to the units before it.

    `checkpoint` (trainer.activation_checkpointing): each trained unit's forward under
    torch.utils.checkpoint (non-reentrant, the RNG state kept so dropout draws the same
    mask again): autograd keeps only the unit's inputs and runs its forward once more in
    the backward, as transformers' `gradient_checkpointing_enable` does per layer.
    """

    def __init__(
        self, units: Sequence[nn.Module], frozen: Sequence[bool], checkpoint: bool = False
    ) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        if len(units) != len(frozen):
            raise ValueError("one frozen flag per unit")
        seen_active = False
        for is_frozen in frozen:
            if is_frozen and seen_active:
                raise ValueError("frozen units must precede trained units")
            seen_active |= not is_frozen
        self.units = nn.ModuleList(units)
        self.frozen = list(frozen)
        for unit, is_frozen in zip(self.units, self.frozen):
            if is_frozen:
                unit.eval()

    def train(self, mode: bool = True) -> UnitSequence:
        super().train(mode)
        for unit, is_frozen in zip(self.units, self.frozen):
            if is_frozen:
                unit.eval()  # no dropout in frozen layers: their output must be a pure function
        return self

    def forward(self, *x: torch.Tensor):
        for unit, is_frozen in zip(self.units, self.frozen):
            if is_frozen:
                with torch.no_grad():
                    x = unit(*x)
            elif self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(unit, *x, use_reentrant=False)
            else:
                x = unit(*x)
            if isinstance(x, torch.Tensor):
                x = (x,)
        return x[0] if len(x) == 1 else x


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def layer_unit_names(num_layers: int) -> tuple[str, ...]:
    """embedding, layer0.attention, layer0.mlp, ..., head: the names every adapter uses."""
    layers = [f"layer{l}.{part}" for l in range(num_layers) for part in ("attention", "mlp")]
    return ("embedding", *layers, "head")
