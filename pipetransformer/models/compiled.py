"""Regional torch.compile (`trainer.compile`): each unit's forward compiled on its own, as
torchtitan compiles each transformer block, and the peers' blocks alike.

Units of one class share their compiled code. Dynamo keeps a unit class's graphs with the
code of its `forward` and guards each on what it assumed (training mode, grad mode, whether
the parameters and the input need gradients, autocast, dtypes, shapes); the module's
parameters are graph inputs (torch's default, `inline_inbuilt_nn_modules`), so the twelve
attention units of a BERT-base run one graph, compiled once. A transition therefore compiles
only the variants it creates: the units that froze (eval mode, no autograd) and the first
trained unit (its input no longer carries a gradient); every unit whose state did not change
runs what was compiled for it, and a unit arriving from another rank runs its class's graph
for its state without compiling. A unit keeps its compiled forward for the run
(`compile_unit` is idempotent), so what is compiled is the cache, reused across transitions.

Shapes: the batch dimension of every input tensor, and for text models the sequence
dimension, are marked dynamic (`torch._dynamo.maybe_mark_dynamic`) before each call, so
another layout's micro-batch size or a batch padded to another length runs the same graph
instead of compiling one per size (dynamo still specialises a dimension of size 0 or 1).

`COMPILES` counts, per unit class, the graphs this process compiled (the tests check a
transition against it; benchmarks/compile.py reports it).

How many graphs a class needs (`unit_graph_bound`): one per state it runs in (trained; the
first trained unit, whose input carries no gradient; frozen: eval mode without autograd;
evaluation: eval mode without autograd, its parameters still trained) and form of input it
is given: a batch of several samples padded (or images); a batch of one sample (dynamo
specialises a dimension of size 1: a micro-batch of one sample, or a cache upgrade or miss
of one sample on the first stage); a packed batch (data.padding packed or auto), which
takes the sample starts as one more input. Packed shapes are bucketed so that a packed
batch is one form: a micro-batch of one sample is never packed, and under compile a packed
micro-batch takes at least two rows (trainer/step.py `batch_shape`), so no packed dimension
has size 1. At most 4 x 3 = 12 for any class, any padding and micro-batch count
(tests/test_gpu_path.py compiles padded and packed batches through a transition and counts
them). Dynamo compiles at most `recompile_limit` graphs per code object (8 by default) and
past it silently runs the unit eagerly; here the limit is `UNIT_RECOMPILE_LIMIT` (16: a
form's worth of headroom over the bound) and passing it is an error naming
`trainer.compile` (`fail_on_recompile_limit_hit`), not a slow run nobody is told about. The
trainer compiles every graph a layout needs before its first step (pipe/warmup.py), so the
error comes then, on every rank, not in the middle of a step.

Owns: `compile_unit`, `compile_units`, `is_compiled`, `library_blocks`, `COMPILES`,
`unit_graph_bound`. Must not: know layouts, freezing or ranks (the trainer compiles the
units a layout gives a rank).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

COMPILES: Counter[str] = Counter()
_COMPILED = "_pipetransformer_compiled"  # the backend a unit's forward was compiled with
_BACKENDS: dict[tuple[str, str], Callable] = {}
# The states a unit runs in: trained, first trained, frozen, evaluation (module docstring).
UNIT_STATES = 4
# Graphs a unit class may compile: the bound's 12 and a form's worth (4) of headroom.
UNIT_RECOMPILE_LIMIT = 16


def unit_graph_bound(one_sample: bool, packed: bool) -> int:
    """The most graphs a unit class compiles in a run (module docstring): a graph per state
    for each form of input, padded always, of one sample where `one_sample` (a micro-batch
    of one sample, or AutoCache serving), packed where `packed` (data.padding packed or
    auto on text)."""
    return UNIT_STATES * (1 + int(one_sample) + int(packed))


def _counted(class_name: str, backend: str) -> Callable:
    """The backend `backend`, counting the graphs it compiles for units of `class_name`;
    one object per (class, backend): a unit arriving later shares its class's graphs."""
    key = (class_name, backend)
    if key not in _BACKENDS:
        inner = torch._dynamo.lookup_backend(backend)

        def compile_graph(graph_module, example_inputs):
            COMPILES[class_name] += 1
            return inner(graph_module, example_inputs)

        _BACKENDS[key] = compile_graph
    return _BACKENDS[key]


class _DynamicForward:
    """A compiled forward whose inputs' batch (and sequence) dimensions are marked dynamic."""

    def __init__(self, compiled: Callable, dynamic_dims: Sequence[int], class_name: str) -> None:
        self.compiled = compiled
        self.dynamic_dims = tuple(dynamic_dims)
        self.class_name = class_name

    def __call__(self, *args, **kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                for dim in self.dynamic_dims:
                    if dim < value.dim():
                        torch._dynamo.maybe_mark_dynamic(value, dim)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise RuntimeError(
                f"trainer.compile: {self.class_name} needed more than "
                f"{torch._dynamo.config.recompile_limit} compiled graphs (one per state and "
                "form of input; models/compiled.py); dynamo would run it eagerly from now "
                "on. Set trainer.compile=false, or report the shapes and states this run met"
            ) from exc


def _fail_past_the_recompile_limit() -> None:
    """Past `UNIT_RECOMPILE_LIMIT` graphs a unit class is an error, not eager code."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, UNIT_RECOMPILE_LIMIT)
    config.fail_on_recompile_limit_hit = True


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` (or a module inside it) runs a forward `compile_unit` compiled."""
    return any(getattr(m, _COMPILED, None) is not None for m in module.modules())


def compile_unit(
    module: nn.Module, backend: str = "inductor", dynamic_dims: Sequence[int] = (0,)
) -> None:
    """Compile `module`'s forward in place (its parameters, buffers, hooks and state dict
    are unchanged; hooks such as FSDP2's run around the compiled forward, not in it)."""
    if getattr(module, _COMPILED, None) == backend:
        return
    _fail_past_the_recompile_limit()
    name = type(module).__name__
    forward = type(module).forward.__get__(module)
    compiled = torch.compile(forward, backend=_counted(name, backend))
    module.forward = _DynamicForward(compiled, dynamic_dims, name)
    setattr(module, _COMPILED, backend)


def compile_units(
    units: Iterable[nn.Module], backend: str = "inductor", text: bool = False
) -> None:
    """Every unit not yet compiled (with `backend`): the batch dimension dynamic, and the
    sequence dimension for a text model (`text`)."""
    for unit in units:
        compile_unit(unit, backend, (0, 1) if text else (0,))


# Where a library model keeps its transformer blocks, in the order tried: timm's ViT, DeiT,
# EVA, BEiT (`blocks`); transformers' BERT family and DeBERTa (`encoder.layer`),
# DistilBERT (`transformer.layer`), ModernBERT (`layers`).
_BLOCK_PATHS = ("blocks", "encoder.layer", "transformer.layer", "layers")


def library_blocks(model: nn.Module) -> list[nn.Module]:
    """A timm or transformers model's transformer blocks (what the peers compile one by
    one, as the trainer compiles its units); ValueError where none is found."""
    base = getattr(model, "base_model", model)
    for owner in (model, base):
        for path in _BLOCK_PATHS:
            found = owner
            for name in path.split("."):
                found = getattr(found, name, None)
            if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 0:
                return list(found)
    raise ValueError(f"no transformer blocks found in {type(model).__name__}")
