"""The model section: which model, which family's adapter, pretrained weights, user adapters.

Owns: ModelConfig, TEXT_MODEL_TYPES, the family a name resolves to, and whether a name is
meant as a local path (`looks_like_path`, which data names follow too). Must not: import
any other part of the package or a model library (models/ knows the models).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

# transformers model types with a built-in adapter (models/: bert.py, deberta.py,
# distilbert.py, modernbert.py); `model.name` set to one of them means a text encoder.
# A type added by a user's adapter (model.adapters) sets `model.family: bert`.
TEXT_MODEL_TYPES = (
    "bert",
    "roberta",
    "xlm-roberta",
    "electra",
    "deberta-v2",
    "distilbert",
    "modernbert",
)


@dataclass(frozen=True)
class ModelConfig:
    # A timm model name (ViT, DeiT, EVA, BEiT...) or a transformers model type ('bert',
    # 'roberta', 'deberta-v2', ...: a small random model of that family).
    name: str = "vit_tiny_patch16_224"
    # 'vit': a timm image model; 'bert': a transformers text encoder (any family with an
    # adapter); 'auto': a transformers model type or model_name_or_path means 'bert'.
    family: Literal["auto", "vit", "bert"] = "auto"
    pretrained: bool = False
    checkpoint_path: str | None = None
    # Text encoders: a hub id or a local directory with config.json (+ weights, tokenizer);
    # its config's model_type picks the adapter.
    model_name_or_path: str | None = None
    # Extra constructor arguments: timm.create_model kwargs or transformers config fields.
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Python modules to import before the model is built (in every process): each registers
    # model adapters with pipetransformer.models.register_adapter (docs/models.md).
    adapters: list[str] = field(default_factory=list)

    def resolved_family(self) -> str:
        if self.family != "auto":
            return self.family
        name = self.name.lower()
        if name.startswith("bert") or name in TEXT_MODEL_TYPES:
            return "bert"
        if self.model_name_or_path is not None:
            return "bert"
        return "vit"


def looks_like_path(name: str) -> bool:
    """Whether a model, tokenizer or data name is meant as a local path rather than a hub id
    ('org/name' has at most one slash and never starts with '/', '.' or '~')."""
    return (
        name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name
    )
