"""BERT and the encoders built like it (RoBERTa, XLM-RoBERTa, ELECTRA) -> LayeredModel.

Owns: cutting `*ForSequenceClassification` / `*ForQuestionAnswering` of these families into
units that reproduce the transformers forward exactly, and registering their adapters.
Every unit after the embedding takes (hidden_states, attention_mask) and passes the 2-D
mask on, so the mask reaches every block of every stage; each attention unit rebuilds the
attention bias from it exactly as the library's model does. A packed batch (models/packed.py)
brings segment ids in the mask's place and the sample starts after them: positions restart
per sample (RoBERTa's after its padding index), attention stays in a sample, heads read
each sample's own tokens. Token type ids are consumed by
the embedding, which is always the first unit of the first stage (or of the frozen prefix);
RoBERTa's tokenizers give none, so its embedding ignores them (the library's zeros).
ELECTRA's embedding projection (embedding_size != hidden_size) belongs to the embedding unit.
Must not: know about pipelines, freezing or ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask
from transformers.pytorch_utils import apply_chunking_to_forward

from pipetransformer.models import packed as packing
from pipetransformer.models.layered import LayeredModel
from pipetransformer.models.registry import ModelAdapter, register_adapter
from pipetransformer.models.text_models import check_fits, text_spec, text_task


def attention_bias(config, hidden, attention_mask, packed: bool = False):
    """The 4-D bias transformers builds from a 2-D mask, always materialised: by default
    transformers reads `padding_mask.all()` on the host to skip it for unpadded batches,
    which on a GPU is a device-to-host synchronisation in every attention unit of every
    micro-batch. `packed`: the mask is a packed batch's segment ids (models/packed.py)."""
    if packed:
        return packing.attention_bias(config, hidden, attention_mask)
    return create_bidirectional_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        allow_is_bidirectional_skip=False,
    )


def sample_positions(segments: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """A packed batch's position ids: each sample's from `offset` (RoBERTa's: its padding
    index + 1, the padding at the padding index, as the library numbers a padded row)."""
    positions = packing.positions_in_sample(segments) + offset
    if offset:
        positions = positions.masked_fill(segments == 0, offset - 1)
    return positions


class BertEmbeddingUnit(nn.Module):
    def __init__(
        self,
        embeddings: nn.Module,
        project: nn.Module | None = None,
        token_types: bool = True,
        position_offset: int = 0,
    ) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.project = project  # ELECTRA's embeddings_project
        self.token_types = token_types
        self.position_offset = position_offset  # RoBERTa's first position

    def forward(self, input_ids, token_type_ids, attention_mask, *rest):
        types = token_type_ids if self.token_types else None
        positions = None
        if packing.packed(rest):  # padded, the library numbers the positions itself
            positions = sample_positions(attention_mask, self.position_offset)
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=types, position_ids=positions)
        if self.project is not None:
            hidden = self.project(hidden)
        return hidden, attention_mask, *rest


class BertAttentionUnit(nn.Module):
    """Self-attention + output dense/dropout/LayerNorm with the residual inside."""

    def __init__(self, attention: nn.Module, config) -> None:
        super().__init__()
        self.attention = attention
        self.config = config

    def forward(self, hidden, attention_mask, *rest):
        if packing.packed(rest) and packing.use_varlen(hidden):
            return self._varlen(hidden, attention_mask, rest[0]), attention_mask, *rest
        bias = attention_bias(self.config, hidden, attention_mask, packing.packed(rest))
        output, _ = self.attention(hidden, bias)
        return output, attention_mask, *rest

    def _varlen(self, hidden, segments, starts):
        """A packed batch's attention confined to each sample by variable-length attention
        (models/packed.py) instead of a block-diagonal mask: the library's self-attention
        projections, scale and dropout, then its output block (dense, dropout, LayerNorm
        with the residual), as its forward runs them."""
        heads = self.attention.self
        rows, length, _ = hidden.shape

        def project(linear: nn.Module):
            shape = (rows * length, heads.num_attention_heads, heads.attention_head_size)
            return linear(hidden).view(shape)

        context = packing.varlen_attention(
            project(heads.query),
            project(heads.key),
            project(heads.value),
            packing.varlen_offsets(segments, starts),
            length,
            dropout_p=heads.dropout.p if self.training else 0.0,
            scale=heads.scaling,
        )
        return self.attention.output(context.reshape(rows, length, -1), hidden)


class BertMlpUnit(nn.Module):
    """Intermediate dense + activation, output dense/dropout/LayerNorm with the residual
    (chunked along the sequence as the layer chunks it, when chunk_size_feed_forward > 0)."""

    def __init__(self, intermediate: nn.Module, output: nn.Module, chunk_size: int = 0) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.output = output
        self.chunk_size = chunk_size

    def _feed_forward(self, hidden):
        return self.output(self.intermediate(hidden), hidden)

    def forward(self, hidden, attention_mask, *rest):
        output = apply_chunking_to_forward(self._feed_forward, self.chunk_size, 1, hidden)
        return output, attention_mask, *rest


def first_tokens(hidden, rest):
    """What a head that reads the first token takes: the hidden state, or of a packed batch
    each sample's first token (models/packed.py)."""
    return packing.first_tokens(hidden, rest[0]) if packing.packed(rest) else hidden


class BertClassificationHead(nn.Module):
    """BERT's pooler (first token, dense, tanh), dropout and classifier."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, hidden, attention_mask, *rest):
        return self.classifier(self.dropout(self.pooler(first_tokens(hidden, rest))))


class SequenceHead(nn.Module):
    """A head module that takes the whole hidden state: RoBERTa's and ELECTRA's
    classification heads (first token, dense, activation, projection), or the question
    answering `qa_outputs` (start/end logits per token, stacked: (batch, seq, 2);
    `per_token`)."""

    def __init__(self, head: nn.Module, per_token: bool = False) -> None:
        super().__init__()
        self.head = head
        self.per_token = per_token

    def forward(self, hidden, attention_mask, *rest):
        if not self.per_token:
            return self.head(first_tokens(hidden, rest))
        logits = self.head(hidden)
        return packing.sample_tokens(logits, rest[0]) if packing.packed(rest) else logits


def cut_bert_like(
    model: nn.Module,
    max_seq_length: int | None,
    *,
    family: str,
    token_types: bool = True,
    position_offset: int = 0,
) -> LayeredModel:
    """Cut a model whose base has `embeddings` (+ ELECTRA's `embeddings_project`) and
    `encoder.layer[i]` with `attention`, `intermediate`, `output` (BERT's layout, which
    RoBERTa, XLM-RoBERTa, ELECTRA, CamemBERT, ... share). The head: `qa_outputs`, or BERT's
    pooler + dropout + `classifier` when the classifier is a Linear, else the `classifier`
    module on the whole hidden state. `token_types`: whether the embedding reads
    token_type_ids (False where the family's tokenizer gives none); `position_offset`: the
    first position id (RoBERTa's: padding index + 1)."""
    task = text_task(model)
    base = model.base_model
    config = base.config
    check_fits(max_seq_length, config.max_position_embeddings, position_offset)
    project = getattr(base, "embeddings_project", None)
    units: list[nn.Module] = [
        BertEmbeddingUnit(base.embeddings, project, token_types, position_offset)
    ]
    for layer in base.encoder.layer:
        if getattr(layer, "add_cross_attention", False) or config.is_decoder:
            raise ValueError(f"{family}: decoder layers (cross-attention, causal) are not cut")
        units += [
            BertAttentionUnit(layer.attention, config),
            BertMlpUnit(layer.intermediate, layer.output, config.chunk_size_feed_forward),
        ]
    if task == "question_answering":
        units.append(SequenceHead(model.qa_outputs, per_token=True))
    elif isinstance(model.classifier, nn.Linear):
        units.append(BertClassificationHead(base.pooler, model.dropout, model.classifier))
    else:
        units.append(SequenceHead(model.classifier))
    spec = text_spec(
        family=family,
        task=task,
        units=units,
        max_seq_length=max_seq_length,
        hidden_size=config.hidden_size,
        num_labels=config.num_labels,
    )
    return LayeredModel(units, spec, source=model)


def _roberta_like(family: str):
    def cut(model: nn.Module, max_seq_length: int | None) -> LayeredModel:
        # RoBERTa numbers positions from the padding index + 1; its tokenizers give no
        # token types.
        offset = model.config.pad_token_id + 1
        return cut_bert_like(
            model, max_seq_length, family=family, token_types=False, position_offset=offset
        )

    return cut


BERT = register_adapter(
    ModelAdapter(
        family="bert",
        library="transformers",
        model_types=("bert",),
        cut=lambda model, max_seq_length: cut_bert_like(model, max_seq_length, family="bert"),
    )
)
ELECTRA = register_adapter(
    ModelAdapter(
        family="electra",
        library="transformers",
        model_types=("electra",),
        cut=lambda model, max_seq_length: cut_bert_like(model, max_seq_length, family="electra"),
        random_config={"embedding_size": 32},
    )
)
# A random RoBERTa has the pretrained checkpoints' single token type, and two more
# position embeddings for its positions' offset.
ROBERTA = register_adapter(
    ModelAdapter(
        family="roberta",
        library="transformers",
        model_types=("roberta",),
        cut=_roberta_like("roberta"),
        random_config={"type_vocab_size": 1, "max_position_embeddings": 514},
    )
)
XLM_ROBERTA = register_adapter(
    ModelAdapter(
        family="xlm-roberta",
        library="transformers",
        model_types=("xlm-roberta",),
        cut=_roberta_like("xlm-roberta"),
        random_config={"type_vocab_size": 1, "max_position_embeddings": 514},
    )
)
