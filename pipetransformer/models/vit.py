"""timm VisionTransformer and VisionTransformerDistilled (DeiT) -> LayeredModel.

Owns: cutting them into embedding / attention / MLP / head units that reproduce their
`forward` exactly, and registering both adapters. The distillation token is one more
prefix token: the embedding adds it, the blocks carry it as any token, and the head
averages the class and distillation heads as timm does outside distillation training (the
trainer has no teacher; timm's `distilled_training` mode is refused).
Must not: know about pipelines, freezing or ranks.
"""

from __future__ import annotations

import torch
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from pipetransformer.models.image_models import image_spec
from pipetransformer.models.layered import LayeredModel
from pipetransformer.models.registry import ModelAdapter, register_adapter


class VitEmbedding(nn.Module):
    """patch_embed + class/register (and distillation) tokens + position embedding, as in
    forward_features."""

    _COPIED = ("num_prefix_tokens", "no_embed_class", "dynamic_img_size", "has_class_token")

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.patch_embed = vit.patch_embed
        self.cls_token = vit.cls_token
        self.reg_token = vit.reg_token
        self.dist_token = getattr(vit, "dist_token", None)
        self.pos_embed = vit.pos_embed
        self.pos_drop = vit.pos_drop
        self.patch_drop = vit.patch_drop
        self.norm_pre = vit.norm_pre
        for name in self._COPIED:
            setattr(self, name, getattr(vit, name))
        # timm's own method, run on this unit: it only reads the attributes copied above.
        self._pos_embed_of = type(vit)._pos_embed

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.patch_embed(images)
        x = self._pos_embed_of(self, x)
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


class DistilledHead(nn.Module):
    """Final norm, then the class token through `head` and the distillation token through
    `head_dist`, averaged: VisionTransformerDistilled.forward_head outside distillation
    training, timm's own method run on this unit (it reads the attributes set here; its
    dropout differs between timm releases)."""

    def __init__(self, vit: VisionTransformerDistilled) -> None:
        super().__init__()
        self.norm = vit.norm
        self.head_drop = vit.head_drop
        self.head = vit.head
        self.head_dist = vit.head_dist
        self.distilled_training = False
        self._forward_head = type(vit).forward_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_head(self, self.norm(x))


def _cut(model: VisionTransformer, head: nn.Module, family: str) -> LayeredModel:
    units: list[nn.Module] = [VitEmbedding(model)]
    for block in model.blocks:
        units += [VitAttention(block), VitMlp(block)]
    units.append(head)
    num_tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    spec = image_spec(family=family, model=model, units=units, num_tokens=num_tokens)
    return LayeredModel(units, spec, source=model)


def layered_vit(model: VisionTransformer, max_seq_length: int | None = None) -> LayeredModel:
    return _cut(model, VitHead(model), "vit")


def layered_vit_distilled(
    model: VisionTransformerDistilled, max_seq_length: int | None = None
) -> LayeredModel:
    if model.distilled_training:
        raise ValueError(
            "VisionTransformerDistilled in distilled_training mode returns two predictions "
            "for a teacher's loss, which this trainer does not have"
        )
    return _cut(model, DistilledHead(model), "vit-distilled")


VIT = register_adapter(
    ModelAdapter(family="vit", library="timm", model_class=VisionTransformer, cut=layered_vit)
)
VIT_DISTILLED = register_adapter(
    ModelAdapter(
        family="vit-distilled",
        library="timm",
        model_class=VisionTransformerDistilled,
        cut=layered_vit_distilled,
    )
)
