"""Model adapters: the only code that knows model internals.

`build_model` turns a ModelConfig plus facts about the data (task, classes, input size)
into a LayeredModel; on device 'meta' it builds the structure only (no weights, no
download), which is all the planners need.
"""

from __future__ import annotations

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

__all__ = [
    "LayeredModel",
    "export_model",
    "materialize",
    "ModelSpec",
    "TensorSpec",
    "UnitSequence",
    "attention_unit",
    "build_model",
    "layer_of_unit",
    "mlp_unit",
    "prefix_end",
    "unit_param_names",
]


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
    family = config.resolved_family()
    # Adapters import their libraries lazily: transformers and timm each take seconds.
    if family == "vit":
        from pipetransformer.models.vit import create_vit, layered_vit

        if task != "classification":
            raise ValueError(f"model.name: a ViT cannot do the '{task}' task")
        model = create_vit(
            config.name,
            num_classes=num_classes,
            in_chans=in_chans,
            img_size=image_size,
            pretrained=config.pretrained,
            checkpoint_path=config.checkpoint_path,
            kwargs=config.kwargs,
            device=device,
        )
        return layered_vit(model)
    from pipetransformer.models.bert import create_bert, layered_bert

    model = create_bert(
        task=task,
        num_labels=num_classes,
        vocab_size=vocab_size,
        model_name_or_path=config.model_name_or_path,
        pretrained=config.pretrained or config.model_name_or_path is not None,
        kwargs=config.kwargs,
        device=device,
    )
    return layered_bert(model, max_seq_length)


def export_model(
    model: LayeredModel, out_dir, tokenizer: str | None = None, model_args: dict | None = None
) -> list[str]:
    """Write `model` in its library's own format (transformers `save_pretrained` for BERT,
    a timm hub checkpoint for ViT, with `model_args`: the create_model arguments) into
    `out_dir`; returns the file names."""
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if model.spec.family == "vit":
        from pipetransformer.models.vit import export_vit

        return export_vit(model, out_dir, model_args)
    from pipetransformer.models.bert import export_bert

    return export_bert(model, out_dir, tokenizer)


def materialize(model: LayeredModel, device: str | torch.device = "cpu") -> LayeredModel:
    """A model built on the meta device, given real (uninitialised) storage on `device` and
    cut into units again, so that the units and the library model share every tensor (a
    tensor a unit registers itself, such as ViT's class token, would otherwise stay behind
    on the meta device in one of the two)."""
    source = model.source.to_empty(device=device)
    if model.spec.family == "vit":
        from pipetransformer.models.vit import layered_vit

        return layered_vit(source)
    from pipetransformer.models.bert import layered_bert

    return layered_bert(source, model.spec.input_specs[0].shape[0])
