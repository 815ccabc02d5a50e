"""timm Eva (EVA, EVA-02, and the other ViTs timm builds on it) -> LayeredModel.

An Eva block is pre-norm (x + drop_path(gamma_1 * attn(norm1(x), rope)), then the MLP) or,
with use_post_norm, post-norm (x + drop_path(norm1(attn(x, rope)))); each half is one unit,
its layer scale with it. The rotary table (`rope`) is a function of the patch grid alone:
each attention unit recomputes it with its own copy of the model's rope module (buffers
only), as `Eva._pos_embed` does once per forward. Refused, because the table would then
differ from one forward (or one sample) to the next and so must be drawn once for all
layers: rope coordinate augmentation (shift/jitter/rescale), patch dropout with rope, a
dynamic image size with rope, and the 'mixed' rope whose frequencies are one trained
parameter for every layer.

Owns: those units and the 'eva' adapter. Must not: know pipelines, freezing or ranks.
"""

from __future__ import annotations

import copy

import torch
from timm.models.eva import Eva, EvaBlockPostNorm
from torch import nn

from pipetransformer.models.image_models import image_spec
from pipetransformer.models.layered import LayeredModel
from pipetransformer.models.registry import ModelAdapter, register_adapter


class EvaEmbedding(nn.Module):
    """patch_embed, class/register tokens, absolute position embedding, norm_pre (the rope
    table `Eva._pos_embed` returns is left to the attention units)."""

    _COPIED = ("dynamic_img_size", "no_embed_class", "num_prefix_tokens", "rope_mixed")

    def __init__(self, eva: Eva) -> None:
        super().__init__()
        self.patch_embed = eva.patch_embed
        self.cls_token = eva.cls_token
        self.reg_token = eva.reg_token
        self.pos_embed = eva.pos_embed
        self.pos_drop = eva.pos_drop
        self.patch_drop = eva.patch_drop
        self.rope = eva.rope
        self.norm_pre = eva.norm_pre
        for name in self._COPIED:
            setattr(self, name, getattr(eva, name, False))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.patch_embed(images)
        x, _ = Eva._pos_embed(self, x)  # timm's own method: reads the attributes above
        return (self.norm_pre(x),)


def _rope_table(rope: nn.Module | None, grid_size) -> torch.Tensor | None:
    if rope is None:
        return None
    if hasattr(rope, "feat_shape"):
        return rope.get_embed()
    return rope.get_embed(shape=grid_size)  # rope modules without a cached grid (MRoPE)


class EvaAttention(nn.Module):
    def __init__(self, block: nn.Module, rope: nn.Module | None, grid_size) -> None:
        super().__init__()
        self.norm1, self.attn, self.drop_path1 = block.norm1, block.attn, block.drop_path1
        self.post_norm = isinstance(block, EvaBlockPostNorm)
        self.gamma_1 = None if self.post_norm else block.gamma_1
        self.rope = rope
        self.grid_size = tuple(grid_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        rope = _rope_table(self.rope, self.grid_size)
        if self.post_norm:
            return (x + self.drop_path1(self.norm1(self.attn(x, rope=rope))),)
        out = self.attn(self.norm1(x), rope=rope)
        if self.gamma_1 is not None:
            out = self.gamma_1 * out
        return (x + self.drop_path1(out),)


class EvaMlp(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm2, self.mlp, self.drop_path2 = block.norm2, block.mlp, block.drop_path2
        self.post_norm = isinstance(block, EvaBlockPostNorm)
        self.gamma_2 = None if self.post_norm else block.gamma_2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        if self.post_norm:
            return (x + self.drop_path2(self.norm2(self.mlp(x))),)
        out = self.mlp(self.norm2(x))
        if self.gamma_2 is not None:
            out = self.gamma_2 * out
        return (x + self.drop_path2(out),)


class EvaHead(nn.Module):
    """norm, pooling (attention pool or timm's global pool), fc_norm, classifier."""

    def __init__(self, eva: Eva) -> None:
        super().__init__()
        self.norm, self.attn_pool, self.fc_norm = eva.norm, eva.attn_pool, eva.fc_norm
        self.head_drop, self.head = eva.head_drop, eva.head
        self.global_pool = eva.global_pool
        self.num_prefix_tokens = eva.num_prefix_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = Eva.pool(self, self.norm(x))  # timm's own method: attn_pool, global_pool, prefix
        return self.head(self.head_drop(self.fc_norm(x)))


def _check_rope(model: Eva) -> None:
    rope = model.rope
    if rope is None:
        return
    reasons = []
    if getattr(model, "rope_mixed", False) or any(True for _ in rope.parameters()):
        reasons.append("its rope frequencies are trained parameters shared by every layer")
    if getattr(rope, "aug_active", False):
        reasons.append("rope coordinate augmentation draws a new table every forward")
    if model.patch_drop is not None:
        reasons.append("patch dropout gives every sample its own rope table")
    if model.dynamic_img_size:
        reasons.append("a dynamic image size gives every batch its own rope table")
    if reasons:
        raise ValueError(f"Eva with rope is not cut into units: {'; '.join(reasons)}")


def layered_eva(model: Eva, max_seq_length: int | None = None) -> LayeredModel:
    _check_rope(model)
    grid = model.patch_embed.grid_size
    units: list[nn.Module] = [EvaEmbedding(model)]
    for block in model.blocks:
        rope = copy.deepcopy(model.rope)  # buffers only: each unit holds its own
        units += [EvaAttention(block, rope, grid), EvaMlp(block)]
    units.append(EvaHead(model))
    num_tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    spec = image_spec(family="eva", model=model, units=units, num_tokens=num_tokens)
    return LayeredModel(units, spec, source=model)


EVA = register_adapter(ModelAdapter(family="eva", library="timm", model_class=Eva, cut=layered_eva))
