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
