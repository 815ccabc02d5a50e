"""Model adapters: the only code that knows model internals.

`build_model` turns a ModelConfig plus facts about the data (task, classes, input size)
into a LayeredModel: it builds the library's model (transformers for `model.family: bert`,
any text encoder with a registered adapter; timm for `vit`, any image model with one) and
hands it to the adapter registered for it (registry.py). On device 'meta' it builds the
structure only (no weights, no download), which is all the planners need.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipetransformer.config import ModelConfig
from pipetransformer.models.layered import (
    LayeredModel,
    ModelSpec,
    TensorSpec,
    UnitSequence,
    attention_unit,
    layer_of_unit,
    mlp_unit,
    prefix_end,
    unit_param_names,
)
from pipetransformer.models.registry import (
    ExportInfo,
    ModelAdapter,
    adapter_for_family,
    import_adapter_modules,
    register_adapter,
    registered_adapters,
)
from pipetransformer.models.stack import find_layer_stack

__all__ = [
    "ExportInfo",
    "LayeredModel",
    "ModelAdapter",
    "ModelSpec",
    "TensorSpec",
    "UnitSequence",
    "attention_unit",
    "build_model",
    "export_model",
    "find_layer_stack",
    "layer_of_unit",
    "materialize",
    "mlp_unit",
    "prefix_end",
    "pretrained_image_size",
    "register_adapter",
    "registered_adapters",
    "unit_param_names",
]


def pretrained_image_size(name: str) -> int | None:
    """The image size a timm model's pretrained weights were trained at, without a download
    (models/image_models.py); None where timm has no such record."""
    from pipetransformer.models.image_models import pretrained_image_size as size_of

    return size_of(name)


def build_model(
    config: ModelConfig,
    *,
    task: str,
    num_classes: int,
    in_chans: int = 3,
    image_size: int = 224,
    vocab_size: int | None = None,
    max_seq_length: int = 128,
    device: str | torch.device = "cpu",
) -> LayeredModel:
    import_adapter_modules(config.adapters)
    # Each library is imported only when used: transformers and timm each take seconds.
    if config.resolved_family() == "vit":
        from pipetransformer.models.image_models import create_timm_model

        if task != "classification":
            raise ValueError(f"model.name: a timm image model cannot do the '{task}' task")
        model, adapter = create_timm_model(
            config.name,
            num_classes=num_classes,
            in_chans=in_chans,
            img_size=image_size,
            pretrained=config.pretrained,
            checkpoint_path=config.checkpoint_path,
            kwargs=config.kwargs,
            device=device,
        )
        return adapter.cut(model, None)
    from pipetransformer.models.text_models import create_text_model

    model, adapter = create_text_model(
        config, task=task, num_labels=num_classes, vocab_size=vocab_size, device=device
    )
    return adapter.cut(model, max_seq_length)


def export_model(model: LayeredModel, out_dir, info: ExportInfo | None = None) -> list[str]:
    """Write `model` in its library's own format (transformers `save_pretrained`, a timm hub
    directory; or what its adapter's `export` writes) into `out_dir`; returns the file
    names."""
    info = info or ExportInfo()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter = adapter_for_family(model.spec.family)
    if adapter.export is not None:
        return adapter.export(model, out_dir, info)
    if adapter.library == "timm":
        from pipetransformer.models.image_models import export_timm_model

        return export_timm_model(model, out_dir, info)
    from pipetransformer.models.text_models import export_text_model

    return export_text_model(model, out_dir, info)


def materialize(model: LayeredModel, device: str | torch.device = "cpu") -> LayeredModel:
    """A model built on the meta device, given real (uninitialised) storage on `device` and
    cut into units again, so that the units and the library model share every tensor (a
    tensor a unit registers itself, such as ViT's class token, would otherwise stay behind
    on the meta device in one of the two)."""
    adapter = adapter_for_family(model.spec.family)
    source = model.source.to_empty(device=device)
    max_seq_length = model.spec.input_specs[0].shape[0] if adapter.library != "timm" else None
    return adapter.cut(source, max_seq_length)
