"""The registry of model adapters: which code cuts which library model into units.

A transformers model is matched by its config's `model_type` ("bert", "roberta", ...), a
timm model by its class (the most specific registered class in its MRO, so
`VisionTransformerDistilled` finds its own adapter before `VisionTransformer`'s). Every
built-in adapter registers itself here with `register_adapter`, exactly as a user's adapter
does (docs/models.md); a user's module is named in `model.adapters` and imported before the
model is built, in every process.

Built-in adapters are imported one library at a time, on the first lookup that needs them:
a ViT run never imports transformers, a BERT run never imports timm.

Owns: `ModelAdapter`, `register_adapter` and the lookups.
Must not: import timm or transformers (the adapters do), know any architecture.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

if TYPE_CHECKING:
    from pipetransformer.models.layered import LayeredModel

Library = Literal["transformers", "timm"]

# The modules of the built-in adapters, by library; each calls register_adapter on import.
BUILTIN_ADAPTER_MODULES: dict[str, tuple[str, ...]] = {
    "transformers": (
        "pipetransformer.models.bert",
        "pipetransformer.models.deberta",
        "pipetransformer.models.distilbert",
        "pipetransformer.models.modernbert",
    ),
    "timm": (
        "pipetransformer.models.vit",
        "pipetransformer.models.eva",
        "pipetransformer.models.beit",
    ),
}


@dataclass(frozen=True)
class ExportInfo:
    """What a run knew about its model that the weights do not say, for export."""

    # transformers: the tokenizer the run encoded its text with (hub id or directory).
    tokenizer: str | None = None
    # timm: the create_model arguments that rebuild the architecture.
    model_args: Mapping[str, Any] = field(default_factory=dict)
    # timm: the preprocessing the run trained with (mean/std per channel, resize).
    image_mean: tuple[float, ...] | None = None
    image_std: tuple[float, ...] | None = None
    interpolation: str = "bilinear"
    crop_pct: float = 1.0
    # Whether the weights started from the library's pretrained checkpoint (timm keeps that
    # checkpoint's tag and licence in the export only then).
    pretrained: bool = False
    # Classification: the name of each class id (transformers id2label, timm label_names).
    labels: Sequence[str] | None = None


@dataclass(frozen=True)
class ModelAdapter:
    """How one family of library models becomes a LayeredModel.

    `cut(model, max_seq_length)` returns the LayeredModel whose units share the library
    model's modules (max_seq_length is None for image models). `export`, when given,
    replaces the library's default export (transformers `save_pretrained`, timm
    `save_for_hf`)."""

    family: str  # ModelSpec.family of what `cut` returns; unique in the registry
    library: Library
    cut: Callable[[nn.Module, int | None], LayeredModel]
    # transformers: the config `model_type`s it cuts.
    model_types: tuple[str, ...] = ()
    # timm: the model class it cuts (and its subclasses without an adapter of their own).
    model_class: type | None = None
    # transformers: config fields of the small random model that `model.name: <type>`
    # builds when no model_name_or_path is given (model.kwargs override them).
    random_config: Mapping[str, Any] = field(default_factory=dict)
    export: Callable[[LayeredModel, Path, ExportInfo], list[str]] | None = None

    def __post_init__(self) -> None:
        if self.library == "transformers" and not self.model_types:
            raise ValueError(f"adapter '{self.family}': a transformers adapter names model_types")
        if self.library == "timm" and self.model_class is None:
            raise ValueError(f"adapter '{self.family}': a timm adapter names its model_class")


_ADAPTERS: dict[str, ModelAdapter] = {}
_LOADED: set[str] = set()


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Add `adapter`; a family, model type or timm class registered twice is an error
    (re-registering the identical adapter, as a module imported twice does, is not)."""
    existing = _ADAPTERS.get(adapter.family)
    if existing is not None and existing != adapter:
        raise ValueError(f"an adapter for family '{adapter.family}' is already registered")
    for other in _ADAPTERS.values():
        if other.family == adapter.family:
            continue
        clash = set(other.model_types) & set(adapter.model_types)
        if clash or (adapter.model_class is not None and other.model_class is adapter.model_class):
            what = sorted(clash) or adapter.model_class
            raise ValueError(f"'{other.family}' already cuts {what}")
    _ADAPTERS[adapter.family] = adapter
    return adapter


def import_adapter_modules(names: Iterable[str]) -> None:
    """Import user modules that register adapters (`model.adapters`)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"model.adapters: cannot import '{name}': {exc}") from exc


def _load_builtins(library: str) -> None:
    if library not in _LOADED:
        for module in BUILTIN_ADAPTER_MODULES[library]:
            importlib.import_module(module)
        _LOADED.add(library)


def registered_adapters(library: Library | None = None) -> list[ModelAdapter]:
    """Every registered adapter (of `library`), built-ins included."""
    for name in [library] if library else BUILTIN_ADAPTER_MODULES:
        _load_builtins(name)
    return [a for a in _ADAPTERS.values() if library is None or a.library == library]


def adapter_for_model_type(model_type: str) -> ModelAdapter:
    """The adapter of a transformers `model_type`; ValueError naming the supported ones."""
    for adapter in registered_adapters("transformers"):
        if model_type in adapter.model_types:
            return adapter
    supported = sorted(t for a in registered_adapters("transformers") for t in a.model_types)
    raise ValueError(
        f"model.name: no adapter for the transformers model type '{model_type}' "
        f"(supported: {', '.join(supported)}; docs/models.md adds one)"
    )


def adapter_for_timm_class(model_class: type) -> ModelAdapter | None:
    """The adapter of the most specific registered class in `model_class`'s MRO."""
    adapters = registered_adapters("timm")
    for cls in model_class.__mro__:
        for adapter in adapters:
            if adapter.model_class is cls:
                return adapter
    return None


def adapter_for_family(family: str) -> ModelAdapter:
    if family not in _ADAPTERS:
        registered_adapters()
    if family not in _ADAPTERS:
        raise ValueError(f"no adapter registered for the model family '{family}'")
    return _ADAPTERS[family]
