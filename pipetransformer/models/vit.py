"""timm Vision Transformer -> LayeredModel.

Owns: building a timm ViT by name (random init, timm's pretrained loader, or a local
checkpoint) and cutting it into embedding / attention / MLP / head units that reproduce
`VisionTransformer.forward` exactly.
Must not: know about pipelines, freezing or ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from pipetransformer.models.layered import LayeredModel, ModelSpec, TensorSpec, count_params

logger = logging.getLogger(__name__)


class VitEmbedding(nn.Module):
    """patch_embed + class/register tokens + position embedding, as in forward_features."""

    _COPIED = ("num_prefix_tokens", "no_embed_class", "dynamic_img_size", "has_class_token")

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.patch_embed = vit.patch_embed
        self.cls_token = vit.cls_token
        self.reg_token = vit.reg_token
        self.pos_embed = vit.pos_embed
        self.pos_drop = vit.pos_drop
        self.patch_drop = vit.patch_drop
        self.norm_pre = vit.norm_pre
        for name in self._COPIED:
            setattr(self, name, getattr(vit, name))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.patch_embed(images)
        # timm's own method, run on this unit: it only reads the attributes copied above.
        x = VisionTransformer._pos_embed(self, x)
        x = self.patch_drop(x)
        return (self.norm_pre(x),)


class VitAttention(nn.Module):
    """x + drop_path(ls(attn(norm1(x)))): the first half of a timm Block."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.ls1, self.drop_path1 = (
            block.norm1,
            block.attn,
            block.ls1,
            block.drop_path1,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + self.drop_path1(self.ls1(self.attn(self.norm1(x)))),)


class VitMlp(nn.Module):
    """x + drop_path(ls(mlp(norm2(x)))): the second half of a timm Block."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm2, self.mlp, self.ls2, self.drop_path2 = (
            block.norm2,
            block.mlp,
            block.ls2,
            block.drop_path2,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))),)


class VitHead(nn.Module):
    """Final norm, pooling and classifier, as in forward_features' tail + forward_head."""

    _COPIED = ("global_pool", "num_prefix_tokens", "pool_include_prefix")

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.norm = vit.norm
        self.attn_pool = vit.attn_pool
        self.fc_norm = vit.fc_norm
        self.head_drop = vit.head_drop
        self.head = vit.head
        for name in self._COPIED:
            setattr(self, name, getattr(vit, name, False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        x = VisionTransformer.pool(self, x)
        x = self.fc_norm(x)
        x = self.head_drop(x)
        return self.head(x)


def create_vit(
    name: str,
    *,
    num_classes: int,
    in_chans: int,
    img_size: int,
    pretrained: bool = False,
    checkpoint_path: str | None = None,
    kwargs: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> VisionTransformer:
    """Build a timm ViT; `kwargs` override the named architecture (depth, embed_dim...)."""
    options = {"num_classes": num_classes, "in_chans": in_chans, "img_size": img_size}
    options.update(kwargs or {})
    if checkpoint_path is not None and not Path(checkpoint_path).is_file():
        raise FileNotFoundError(f"model.checkpoint_path: no such file: {checkpoint_path}")
    try:
        with torch.device(device):
            model = timm.create_model(name, pretrained=pretrained and device != "meta", **options)
    except RuntimeError as exc:
        if "Unknown model" in str(exc):
            raise ValueError(f"model.name: timm has no model named '{name}'") from exc
        raise
    except TypeError as exc:
        raise ValueError(f"model.kwargs: {exc}") from exc
    if not isinstance(model, VisionTransformer):
        raise ValueError(
            f"model.name: '{name}' is a {type(model).__name__}, not a timm VisionTransformer"
        )
    if checkpoint_path is not None and device != "meta":
        # What create_model(checkpoint_path=...) does, but never unpickling arbitrary objects:
        # timm before 1.0.31 loads with weights_only=False by default.
        timm.models.load_checkpoint(model, checkpoint_path, weights_only=True)
    return model


def layered_vit(model: VisionTransformer) -> LayeredModel:
    units: list[nn.Module] = [VitEmbedding(model)]
    for block in model.blocks:
        units += [VitAttention(block), VitMlp(block)]
    units.append(VitHead(model))
    num_tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    in_chans = model.patch_embed.proj.in_channels
    height, width = model.patch_embed.img_size
    dtype = model.patch_embed.proj.weight.dtype
    spec = ModelSpec(
        family="vit",
        task="classification",
        num_layers=len(model.blocks),
        unit_names=tuple(
            ["embedding"]
            + [
                f"layer{l}.{part}"
                for l in range(len(model.blocks))
                for part in ("attention", "mlp")
            ]
            + ["head"]
        ),
        unit_param_counts=tuple(count_params(u) for u in units),
        input_specs=(TensorSpec((in_chans, height, width), dtype),),
        activation_specs=(TensorSpec((num_tokens, model.embed_dim), dtype),),
        output_spec=TensorSpec((model.num_classes,), dtype),
    )
    return LayeredModel(units, spec, source=model)


def export_vit(
    model: LayeredModel, out_dir: Path, model_args: dict[str, Any] | None = None
) -> list[str]:
    """Write the ViT as timm writes a hub checkpoint: model.safetensors (what
    `timm.create_model(name, num_classes=..., checkpoint_path=...)` loads, with the run's
    model kwargs) and config.json (architecture, `model_args`: what create_model was given,
    pretrained_cfg), so that `timm.create_model("local-dir:OUT", pretrained=True)` rebuilds
    it. Returns the files written."""
    from timm.models import save_for_hf

    save_for_hf(model.source, str(out_dir), model_args=model_args, safe_serialization=True)
    return sorted(p.name for p in out_dir.iterdir())
