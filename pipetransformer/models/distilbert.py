"""transformers DistilBERT -> LayeredModel.

A DistilBERT block is post-norm like BERT's: sa_layer_norm(attention(x) + x), then
output_layer_norm(ffn(x) + x); each half is one unit. The 2-D padding mask rides along as
BERT's does (a packed batch's segment ids and sample starts too: models/packed.py).
DistilBERT has no token types: its embedding ignores token_type_ids.

Owns: those units and the 'distilbert' adapter. Must not: know pipelines, freezing, ranks.
"""

from __future__ import annotations

from torch import nn

from pipetransformer.models import packed as packing
from pipetransformer.models.bert import attention_bias, first_tokens, sample_positions
from pipetransformer.models.layered import LayeredModel
from pipetransformer.models.registry import ModelAdapter, register_adapter
from pipetransformer.models.text_models import check_fits, text_spec, text_task


class DistilBertEmbedding(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids, token_type_ids, attention_mask, *rest):
        positions = sample_positions(attention_mask) if packing.packed(rest) else None
        return self.embeddings(input_ids, position_ids=positions), attention_mask, *rest


class DistilBertAttention(nn.Module):
    """sa_layer_norm(attention(x) + x): the first half of a TransformerBlock."""

    def __init__(self, block: nn.Module, config) -> None:
        super().__init__()
        self.attention = block.attention
        self.sa_layer_norm = block.sa_layer_norm
        self.config = config

    def forward(self, hidden, attention_mask, *rest):
        bias = attention_bias(self.config, hidden, attention_mask, packing.packed(rest))
        output, _ = self.attention(hidden, attention_mask=bias)
        return self.sa_layer_norm(output + hidden), attention_mask, *rest


class DistilBertMlp(nn.Module):
    """output_layer_norm(ffn(x) + x): the second half of a TransformerBlock."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.ffn = block.ffn
        self.output_layer_norm = block.output_layer_norm

    def forward(self, hidden, attention_mask, *rest):
        return self.output_layer_norm(self.ffn(hidden) + hidden), attention_mask, *rest


class DistilBertClassificationHead(nn.Module):
    """First token, pre_classifier, ReLU, dropout, classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.pre_classifier = model.pre_classifier
        self.dropout = model.dropout
        self.classifier = model.classifier

    def forward(self, hidden, attention_mask, *rest):
        pooled = nn.functional.relu(self.pre_classifier(first_tokens(hidden, rest)[:, 0]))
        return self.classifier(self.dropout(pooled))


class DistilBertQuestionAnsweringHead(nn.Module):
    """Dropout, then start/end logits per token: (batch, seq, 2)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.dropout = model.dropout
        self.qa_outputs = model.qa_outputs

    def forward(self, hidden, attention_mask, *rest):
        logits = self.qa_outputs(self.dropout(hidden))
        return packing.sample_tokens(logits, rest[0]) if packing.packed(rest) else logits


def layered_distilbert(model: nn.Module, max_seq_length: int | None) -> LayeredModel:
    task = text_task(model)
    distilbert = model.distilbert
    config = distilbert.config
    check_fits(max_seq_length, config.max_position_embeddings)
    units: list[nn.Module] = [DistilBertEmbedding(distilbert.embeddings)]
    for block in distilbert.transformer.layer:
        units += [DistilBertAttention(block, config), DistilBertMlp(block)]
    if task == "question_answering":
        units.append(DistilBertQuestionAnsweringHead(model))
    else:
        units.append(DistilBertClassificationHead(model))
    spec = text_spec(
        family="distilbert",
        task=task,
        units=units,
        max_seq_length=max_seq_length,
        hidden_size=config.dim,
        num_labels=config.num_labels,
    )
    return LayeredModel(units, spec, source=model)


DISTILBERT = register_adapter(
    ModelAdapter(
        family="distilbert",
        library="transformers",
        model_types=("distilbert",),
        cut=layered_distilbert,
        random_config={"hidden_dim": 128},
    )
)
