"""Analytical unit profile: what each unit of a model costs in FLOPs and bytes, computed
without weights, without a device and without timing anything.

For every unit (embedding, attention / MLP sublayers, head) at one micro-batch size and one
compute dtype: forward, backward and frozen-forward FLOPs; the bytes those passes read and
write; parameter count and bytes; the bytes the unit hands on (output); the bytes autograd
keeps for backward (saved). These are the inputs of a roofline estimate of step time and of
the memory model, for models and micro-batch sizes that were never run.

How it is counted, and why it needs no weights:
- The unit runs on fake tensors (`torch._subclasses.FakeTensorMode`): tensors with a shape, a
  dtype and a device but whose storage lives on the meta device, so no memory is allocated and
  no kernel runs. The unit's own parameters and buffers (meta, or real: they are never read)
  are swapped for fake ones with `torch.func.functional_call`, so the model is not touched.
  Fake tensors say they are CPU tensors: the CPU dispatcher chooses the kernels (e.g. its
  fused flash attention for `scaled_dot_product_attention` when no attention dropout is
  active, the unfused math path otherwise) and CPU autocast works. Plain meta tensors do not
  do: `torch.autocast("meta")` is refused ("unsupported autocast device_type"),
  `torch.autocast("cpu")` ignores meta tensors, and SDPA on meta always takes the math path.
- FLOPs: PyTorch's own `torch.utils.flop_counter.FlopCounterMode`, which counts
  matrix-multiply class operators only (mm, addmm, bmm, convolution, attention; 2 FLOPs per
  multiply-add); elementwise, normalization and softmax work counts as zero. Its table has no
  entry for the CPU flash attention operators, so they are mapped to PyTorch's own SDPA
  formulas (`sdpa_flop`, `sdpa_backward_flop`; the backward one includes the recomputation
  of the attention scores that flash kernels do).
- Bytes: per aten operator, the bytes of its tensor inputs plus its tensor outputs (distinct
  elements addressed: a broadcast input counts once), views and metadata operators counted as
  zero. That is a memory-traffic *upper bound without fusion*: a compiler or fused kernel
  that keeps intermediates in registers or cache moves less.
- Backward: the gradients of the weights and of the unit's hidden-state input, seeded with a
  gradient of the unit's first output; unit 0's inputs are data (no input gradient).
  Parameters of frozen units are treated as trained, as pipe/measure.py does.
- Saved bytes: distinct storages packed by `saved_tensors_hooks` in one trained forward,
  parameters and buffers excluded; output bytes: the unit's outputs, distinct storages (BERT's
  mask rides along once) -- both exactly as pipe/measure.py's `measure_unit_costs` counts them.
- Compute dtype "bfloat16" runs the unit under `torch.autocast("cpu", torch.bfloat16)` as the
  trainer does (float32 weights and residual stream, bfloat16 matrix multiplies). Parameter
  bytes stay float32 there; only what autocast runs in bfloat16 shrinks, and the bfloat16
  weight copies autocast makes each forward are read, written and saved like any tensor.
- What follows from counting the CPU's choices on tensors without values: attention with
  dropout active (BERT's training forward) takes SDPA's math path, which keeps the
  (batch, heads, seq, seq) probabilities and dropout mask -- a CUDA flash or memory-efficient
  kernel keeps neither, so there these bytes are an upper bound. transformers cannot see
  that an attention mask is all ones and keeps it, so BERT is counted as for a padded batch.
- Identical layers are counted once: units whose fingerprint (module types, attributes,
  parameter shapes) matches share one count.

Owns: `UnitWork`, `AnalyticalProfile` and `analytical_profile`.
Must not: allocate device memory, read or change weights, requires_grad flags, train/eval
modes or the RNG stream of the model it is given, time anything, or pick a layout.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipetransformer.models.layered import LayeredModel, TensorSpec

# Compute dtype name -> autocast dtype (None: no autocast, the model's own dtypes).
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}

_aten = torch.ops.aten

# The CPU's fused attention has no entry in FlopCounterMode's table: give it the formulas
# PyTorch registers for the CUDA fused attentions (unwrapped: the counter wraps them again).
_EXTRA_FLOP_FORMULAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: inspect.unwrap(flop_counter.sdpa_flop),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: inspect.unwrap(
        flop_counter.sdpa_backward_flop
    ),
}

# Operators that allocate without writing, or read only the shape of their tensor inputs.
_ALLOCATE_ONLY = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
)
_WRITE_ONLY = frozenset(
    {"fill_", "zero_", "ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full"}
)
# Lookups read only the rows they return, not the whole table (BERT's word embeddings are
# 90 MiB, a batch of lookups a few): operator name -> position of the table argument.
_LOOKUPS = {"embedding": 0, "index_select": 0, "index": 0, "gather": 0}


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class UnitWork:
    """What one unit costs at one micro-batch size, counted (not timed)."""

    forward_flops: int  # train mode, autograd recording
    backward_flops: int  # weight gradients + hidden-state input gradient (unit 0: weights only)
    frozen_forward_flops: int  # eval mode under no_grad
    forward_bytes: int  # read + written by the forward's operators (no fusion)
    backward_bytes: int
    frozen_forward_bytes: int
    param_count: int
    param_bytes: int
    output_bytes: int  # tensors the unit hands to the next unit, distinct storages
    saved_bytes: int  # tensors autograd keeps for backward, parameters excluded

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{f.name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class AnalyticalProfile:
    """Per-unit work of a whole model (unit i at index i) at `micro_batch_size` in `dtype`."""

    micro_batch_size: int
    dtype: str
    units: tuple[UnitWork, ...]

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(COMPUTE_DTYPES)}, got {self.dtype!r}")
        if not self.units:
            raise ValueError("an analytical profile needs at least one unit")

    @property
    def num_units(self) -> int:
        return len(self.units)

    def column(self, name: str) -> tuple[int, ...]:
        """One field of every unit, e.g. `column("forward_flops")`."""
        return tuple(getattr(unit, name) for unit in self.units)

    def total(self, name: str, units: Iterable[int] | None = None) -> int:
        """Sum of one field over `units` (default: all)."""
        indices = range(self.num_units) if units is None else units
        return sum(getattr(self.units[i], name) for i in indices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "dtype": self.dtype,
            "units": [asdict(unit) for unit in self.units],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AnalyticalProfile:
        names = [f.name for f in fields(UnitWork)]
        return cls(
            micro_batch_size=int(data["micro_batch_size"]),
            dtype=str(data["dtype"]),
            units=tuple(UnitWork(**{n: int(unit[n]) for n in names}) for unit in data["units"]),
        )


# ----------------------------------------------------------------------------- counting


def _storage_key(tensor: torch.Tensor) -> int:
    # Fake and meta tensors have no data pointer (it is 0 for all): the StorageImpl's own
    # address identifies a storage, shared by every view of it.
    return tensor.untyped_storage()._cdata


def _addressed_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (a broadcast dimension counts once)."""
    if tensor.numel() == 0:
        return 0
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride != 0:
            elements *= size
    return elements * tensor.element_size()


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [value for value in tree_leaves(list(values)) if isinstance(value, torch.Tensor)]


def _operator_bytes(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> int:
    """Bytes one operator reads and writes: its tensor inputs plus the outputs it writes."""
    name = func._overloadpacket.__name__
    if name in _ALLOCATE_ONLY:
        return 0
    inputs = _tensors([args, kwargs])
    outputs = _tensors([out])
    input_storages = {_storage_key(t) for t in inputs}
    mutates = func._schema.is_mutable  # in-place or out=: writes into an input's storage
    written = [t for t in outputs if mutates or _storage_key(t) not in input_storages]
    if not written:
        return 0  # a view, an alias or a metadata query: nothing moves
    write = sum(_addressed_bytes(t) for t in written)
    table = args[_LOOKUPS[name]] if name in _LOOKUPS else None
    read = 0
    if name not in _WRITE_ONLY:
        seen: set[tuple[Any, ...]] = set()
        for t in inputs:
            key = (_storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key not in seen:  # x * x reads x once
                seen.add(key)
                read += min(_addressed_bytes(t), write) if t is table else _addressed_bytes(t)
    return read + write


class _TrafficCounter(TorchDispatchMode):
    """Adds up `_operator_bytes` of every aten operator that runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.bytes += _operator_bytes(func, args, kwargs, out)
        return out


class _Counted:
    """FLOPs and bytes of the operators run inside one `with` block."""

    flops: int = 0
    bytes: int = 0

    def __enter__(self) -> _Counted:
        # The traffic counter sits below the FLOP counter, so it sees the operators the FLOP
        # counter runs (after any decomposition), each once.
        self._traffic = _TrafficCounter()
        self._flops = flop_counter.FlopCounterMode(
            display=False, custom_mapping=_EXTRA_FLOP_FORMULAS
        )
        self._traffic.__enter__()
        self._flops.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._flops.__exit__(*exc)
        self._traffic.__exit__(*exc)
        self.flops = self._flops.get_total_flops()
        self.bytes = self._traffic.bytes


def _as_tuple(outputs: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _distinct_output_bytes(outputs: Sequence[torch.Tensor]) -> int:
    # As pipe/measure.py: a tensor passed through unchanged (BERT's mask) counts once.
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in outputs:
        key = (_storage_key(tensor), tensor.nbytes)
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total


def _fake_state(unit: nn.Module) -> dict[str, torch.Tensor]:
    """Fake CPU stand-ins for the unit's parameters (requiring grad) and buffers.

    Call inside the FakeTensorMode."""
    state: dict[str, torch.Tensor] = {}
    for name, param in unit.named_parameters():
        fake = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype)
        state[name] = fake.requires_grad_(param.is_floating_point())
    for name, buffer in unit.named_buffers():
        state[name] = torch.empty_strided(buffer.shape, buffer.stride(), dtype=buffer.dtype)
    return state


def _unit_work(
    unit: nn.Module,
    input_specs: Sequence[TensorSpec],
    micro_batch_size: int,
    autocast_dtype: torch.dtype | None,
    grad_input: bool,
) -> UnitWork:
    params = list(unit.parameters())
    modes = {module: module.training for module in unit.modules()}
    autocast = {"dtype": autocast_dtype or torch.float32, "enabled": autocast_dtype is not None}
    try:
        with FakeTensorMode():
            state = _fake_state(unit)
            held = {_storage_key(t) for t in state.values()}
            saved: dict[int, int] = {}

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                key = _storage_key(tensor)
                if key not in held:
                    saved.setdefault(key, tensor.untyped_storage().nbytes())
                return tensor

            inputs = tuple(s.example(micro_batch_size, "cpu") for s in input_specs)
            if grad_input and inputs[0].is_floating_point():
                inputs[0].requires_grad_(True)
            unit.train()
            with torch.autocast("cpu", **autocast), _Counted() as forward:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    outputs = _as_tuple(torch.func.functional_call(unit, state, inputs))
            hidden = outputs[0]  # the hidden state (or the head's logits) carries the gradient
            gradient = torch.empty_like(hidden)
            with _Counted() as backward:
                if hidden.requires_grad:
                    torch.autograd.backward(hidden, gradient)

            unit.eval()
            frozen_inputs = tuple(s.example(micro_batch_size, "cpu") for s in input_specs)
            with torch.no_grad(), torch.autocast("cpu", **autocast), _Counted() as frozen:
                torch.func.functional_call(unit, state, frozen_inputs)
    finally:
        for module, mode in modes.items():
            module.training = mode
    return UnitWork(
        forward_flops=forward.flops,
        backward_flops=backward.flops,
        frozen_forward_flops=frozen.flops,
        forward_bytes=forward.bytes,
        backward_bytes=backward.bytes,
        frozen_forward_bytes=frozen.bytes,
        param_count=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        output_bytes=_distinct_output_bytes(outputs),
        saved_bytes=sum(saved.values()),
    )


# Plain values an attribute may hold and still be compared by value in a unit's fingerprint.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)
# transformers' index of a layer in the model: it only addresses a key/value cache, which an
# encoder without one never reads, so it must not make identical layers look different.
_POSITION_ATTRIBUTES = frozenset({"layer_idx"})


def _is_plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_is_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _fingerprint(unit: nn.Module) -> tuple[Any, ...]:
    """Equal for two units that run the same operators on the same shapes: module types, plain
    attributes by value, any other attribute by identity (so a shared config matches and
    anything unknown does not), parameter and buffer shapes, strides and dtypes."""
    parts: list[Any] = []
    for name, module in unit.named_modules():
        attributes = []
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or key == "training" or key in _POSITION_ATTRIBUTES:
                continue
            attributes.append((key, value) if _is_plain(value) else (key, id(value)))
        parts.append((name, type(module), tuple(attributes)))
    for name, tensor in (*unit.named_parameters(), *unit.named_buffers()):
        parts.append((name, tuple(tensor.shape), tensor.stride(), tensor.dtype))
    return tuple(parts)


def analytical_profile(
    model: LayeredModel, micro_batch_size: int, dtype: str = "float32"
) -> AnalyticalProfile:
    """Count every unit of `model` at `micro_batch_size` in compute `dtype` ("float32", or
    "bfloat16": autocast). The model may live on any device, meta included: its weights are
    never read, and its modes and flags are as they were when this returns. Identical layers
    are counted once (a ViT-B's 24 sublayers are 2 runs)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(COMPUTE_DTYPES)}, got {dtype!r}")
    spec = model.spec
    counted: dict[tuple[Any, ...], UnitWork] = {}
    units = []
    for index, unit in enumerate(model.units):
        key = (_fingerprint(unit), spec.unit_input_specs(index), index > 0)
        if key not in counted:
            counted[key] = _unit_work(
                unit,
                spec.unit_input_specs(index),
                micro_batch_size,
                COMPUTE_DTYPES[dtype],
                grad_input=index > 0,
            )
        units.append(counted[key])
    return AnalyticalProfile(micro_batch_size, dtype, tuple(units))
