"""transformers ModernBERT -> LayeredModel.

A ModernBERT layer is pre-norm: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)); each
half is one unit. What its attention reads besides the hidden state:
- rotary position tables (cos, sin), a function of the positions 0..seq-1 and of the
  layer's type (global layers and sliding-window layers use different bases): each
  attention unit recomputes them with its own copy of the model's rotary module (buffers
  only, no parameters), exactly as ModernBertModel does once per forward;
- a bias from the 2-D padding mask, full for global layers and banded for local
  (sliding-window) layers: each attention unit builds its own from the mask, which rides
  along as BERT's does.
The final norm belongs to the head. ModernBERT has no token types: ignored. A packed batch
(models/packed.py) brings segment ids in the mask's place and the sample starts after
them: the rotary tables come from each sample's own positions, the window and the global
mask stay inside a sample (a window is a difference of positions, the same in the row as
in the sample), the head pools each sample's own tokens.

Owns: those units and the 'modernbert' adapter. Must not: know pipelines, freezing, ranks.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_sliding_window_mask

from pipetransformer.models import packed as packing
from pipetransformer.models.bert import attention_bias, first_tokens
from pipetransformer.models.layered import LayeredModel
from pipetransformer.models.registry import ModelAdapter, register_adapter
from pipetransformer.models.text_models import text_spec, text_task


class ModernBertEmbedding(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids, token_type_ids, attention_mask, *rest):
        return self.embeddings(input_ids=input_ids), attention_mask, *rest


class ModernBertAttention(nn.Module):
    """x + attn(attn_norm(x)) with the layer type's rotary tables and mask."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config) -> None:
        super().__init__()
        self.attn_norm = layer.attn_norm
        self.attn = layer.attn
        self.rotary = rotary
        self.attention_type = layer.attention_type
        self.config = config

    def _bias(self, hidden, attention_mask, packed: bool):
        sliding = self.attention_type == "sliding_attention"
        if packed:
            window = self.config.sliding_window if sliding else None
            return packing.attention_bias(self.config, hidden, attention_mask, window)
        if sliding:
            return create_bidirectional_sliding_window_mask(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                allow_is_bidirectional_skip=False,
            )
        return attention_bias(self.config, hidden, attention_mask)

    def forward(self, hidden, attention_mask, *rest):
        is_packed = packing.packed(rest)
        if is_packed:
            positions = packing.positions_in_sample(attention_mask)
        else:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary(hidden, positions, self.attention_type)
        output, _ = self.attn(
            self.attn_norm(hidden),
            position_embeddings=rotary,
            attention_mask=self._bias(hidden, attention_mask, is_packed),
        )
        return hidden + output, attention_mask, *rest


class ModernBertMlp(nn.Module):
    """x + mlp(mlp_norm(x))."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.mlp_norm = layer.mlp_norm
        self.mlp = layer.mlp

    def forward(self, hidden, attention_mask, *rest):
        return hidden + self.mlp(self.mlp_norm(hidden)), attention_mask, *rest


class ModernBertHead(nn.Module):
    """final_norm, then (classification) CLS or masked-mean pooling, or (question
    answering) every token, through the prediction head, dropout and classifier."""

    def __init__(self, model: nn.Module, pooling: str | None) -> None:
        super().__init__()
        self.final_norm = model.model.final_norm
        self.head = model.head
        self.drop = model.drop
        self.classifier = model.classifier
        self.pooling = pooling  # None: per token (question answering)

    def forward(self, hidden, attention_mask, *rest):
        hidden = self.final_norm(hidden)
        is_packed = packing.packed(rest)
        if self.pooling == "cls":
            hidden = first_tokens(hidden, rest)[:, 0]
        elif self.pooling == "mean" and is_packed:
            hidden = packing.sample_means(hidden, attention_mask, rest[0].shape[0])
        elif self.pooling == "mean":
            hidden = (hidden * attention_mask.unsqueeze(-1)).sum(dim=1) / attention_mask.sum(
                dim=1, keepdim=True
            )
        logits = self.classifier(self.drop(self.head(hidden)))
        if self.pooling is None and is_packed:  # question answering: per token
            return packing.sample_tokens(logits, rest[0])
        return logits


def layered_modernbert(model: nn.Module, max_seq_length: int | None) -> LayeredModel:
    task = text_task(model)
    base = model.model
    config = base.config
    units: list[nn.Module] = [ModernBertEmbedding(base.embeddings)]
    for layer in base.layers:
        rotary = copy.deepcopy(base.rotary_emb)  # buffers only: each unit holds its own
        units += [ModernBertAttention(layer, rotary, config), ModernBertMlp(layer)]
    qa = task == "question_answering"
    if not qa and config.classifier_pooling not in ("cls", "mean"):
        raise ValueError(f"ModernBERT: unknown classifier_pooling '{config.classifier_pooling}'")
    units.append(ModernBertHead(model, None if qa else config.classifier_pooling))
    spec = text_spec(
        family="modernbert",
        task=task,
        units=units,
        max_seq_length=max_seq_length,
        hidden_size=config.hidden_size,
        num_labels=config.num_labels,
    )
    return LayeredModel(units, spec, source=model)


MODERNBERT = register_adapter(
    ModelAdapter(
        family="modernbert",
        library="transformers",
        model_types=("modernbert",),
        cut=layered_modernbert,
        # Every other layer local, with a window the test sequences are longer than.
        random_config={"global_attn_every_n_layers": 2, "local_attention": 8},
    )
)
