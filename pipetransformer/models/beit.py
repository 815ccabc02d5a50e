"""timm Beit (BEiT, BEiT-v2) -> LayeredModel.

A Beit block is x + drop_path(gamma_1 * attn(norm1(x))), then the same with the MLP; the
layer-scale vectors gamma_1 / gamma_2 go with their halves. Each attention module owns its
relative position bias (a table and an index buffer) and recomputes it from them in its own
forward, so nothing but the hidden state passes between units. The shared bias of BEiT's
pretraining setup (`use_shared_rel_pos_bias`: one table read by every layer) is refused: no
timm Beit model is built with it.

Owns: those units and the 'beit' adapter. Must not: know pipelines, freezing or ranks.
"""

from __future__ import annotations

import torch
from timm.models.beit import Beit
from torch import nn

from pipetransformer.models.image_models import image_spec
from pipetransformer.models.layered import LayeredModel
from pipetransformer.models.registry import ModelAdapter, register_adapter


class BeitEmbedding(nn.Module):
    """patch_embed, class token, absolute position embedding (when used), dropout."""

    def __init__(self, beit: Beit) -> None:
        super().__init__()
        self.patch_embed = beit.patch_embed
        self.cls_token = beit.cls_token
        self.pos_embed = beit.pos_embed
        self.pos_drop = beit.pos_drop

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.patch_embed(images)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        return (self.pos_drop(x),)


class BeitAttention(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.drop_path1 = block.norm1, block.attn, block.drop_path1
        self.gamma_1 = block.gamma_1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        out = self.attn(self.norm1(x))
        if self.gamma_1 is not None:
            out = self.gamma_1 * out
        return (x + self.drop_path1(out),)


class BeitMlp(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm2, self.mlp, self.drop_path2 = block.norm2, block.mlp, block.drop_path2
        self.gamma_2 = block.gamma_2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        out = self.mlp(self.norm2(x))
        if self.gamma_2 is not None:
            out = self.gamma_2 * out
        return (x + self.drop_path2(out),)


class BeitHead(nn.Module):
    """norm, pooling (mean of the patch tokens, or the class token), fc_norm, classifier."""

    def __init__(self, beit: Beit) -> None:
        super().__init__()
        self.norm, self.fc_norm = beit.norm, beit.fc_norm
        self.head_drop, self.head = beit.head_drop, beit.head
        self.global_pool = beit.global_pool
        self.num_prefix_tokens = beit.num_prefix_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        if self.global_pool:
            x = x[:, self.num_prefix_tokens :].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        return self.head(self.head_drop(self.fc_norm(x)))


def layered_beit(model: Beit, max_seq_length: int | None = None) -> LayeredModel:
    if model.rel_pos_bias is not None:
        raise ValueError(
            "Beit with use_shared_rel_pos_bias: one relative position table read by every "
            "layer is not cut into units (no timm Beit model is built with it)"
        )
    units: list[nn.Module] = [BeitEmbedding(model)]
    for block in model.blocks:
        units += [BeitAttention(block), BeitMlp(block)]
    units.append(BeitHead(model))
    num_tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    spec = image_spec(family="beit", model=model, units=units, num_tokens=num_tokens)
    return LayeredModel(units, spec, source=model)


BEIT = register_adapter(
    ModelAdapter(family="beit", library="timm", model_class=Beit, cut=layered_beit)
)
