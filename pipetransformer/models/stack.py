"""The layer stack of a model someone else's trainer holds: the first of its modules that a
registered adapter cuts, as the units the rest of the package works in.

A transformers model is matched by its config's `model_type`, a timm model by its class
(registry.py); a wrapper (a LightningModule, a `nn.Module` that adds a loss around a timm
ViT) is searched for such a module, outermost first. The units share the library model's
modules and parameters, which is all an integration needs: which parameters are the
embedding, which are layer l, and the rest (the head, anything around the library model).

Owns: `find_layer_stack`. Must not: import timm or transformers unless the model comes from
them, know any architecture (the adapters do).
"""

from __future__ import annotations

from torch import nn

from pipetransformer.models.layered import LayeredModel
from pipetransformer.models.registry import (
    adapter_for_model_type,
    adapter_for_timm_class,
    registered_adapters,
)

# A text adapter sizes its spec for a sequence length; an integration reads only the units,
# so the shortest length every position table holds.
_SPEC_LENGTH = 1


def _library(module: nn.Module) -> str | None:
    top = type(module).__module__.split(".")[0]
    return top if top in ("transformers", "timm") else None


def _cut(module: nn.Module) -> LayeredModel:
    """`module` cut by its adapter; ValueError saying why not."""
    if _library(module) == "timm":
        adapter = adapter_for_timm_class(type(module))
        if adapter is None:
            classes = sorted(a.model_class.__name__ for a in registered_adapters("timm"))
            name = type(module).__name__
            raise ValueError(f"no adapter for timm's {name} (registered: {', '.join(classes)})")
        return adapter.cut(module, None)
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if model_type is None:
        raise ValueError(f"{type(module).__name__} has no config.model_type")
    return adapter_for_model_type(model_type).cut(module, _SPEC_LENGTH)


def find_layer_stack(model: nn.Module) -> LayeredModel:
    """The units of the outermost module of `model` that a registered adapter cuts (a
    transformers encoder for sequence classification or question answering, a timm image
    model). ValueError in one line naming `model` and why each library module found in it
    could not be cut (or that none was found)."""
    tried: list[str] = []
    failed: list[str] = []  # modules no adapter cut: their parts are not tried
    for name, module in model.named_modules():
        inside = any(not parent or name.startswith(f"{parent}.") for parent in failed)
        if inside or _library(module) is None:
            continue
        try:
            return _cut(module)
        except ValueError as exc:
            failed.append(name)
            where = f"'{name}'" if name else "itself"
            tried.append(f"{where} ({type(module).__name__}): {exc}")
    if not tried:
        reason = (
            "none of its modules is a transformers or timm model (a transformers encoder for "
            "sequence classification or question answering, or a timm ViT, EVA or BEiT)"
        )
    else:
        reason = "; ".join(tried)
    raise ValueError(f"cannot find the layer stack of {type(model).__name__}: {reason}")
