"""transformers BERT (sequence classification, question answering) -> LayeredModel.

Owns: building BERT from a hub id, a local directory or a plain config, and cutting it into
units that reproduce the transformers forward exactly. Every unit after the embedding
takes (hidden_states, attention_mask) and passes the 2-D mask on, so the mask reaches every
block of every stage; each attention unit rebuilds the attention bias from it exactly as
BertModel does. Token type ids are consumed by the embedding, which is always the first
unit of the first stage (or of the frozen prefix).
Must not: know about pipelines, freezing or ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import BertConfig, BertForQuestionAnswering, BertForSequenceClassification
from transformers.masking_utils import create_bidirectional_mask

from pipetransformer.models.layered import LayeredModel, ModelSpec, TensorSpec, count_params
from pipetransformer.utils.files import looks_like_path

logger = logging.getLogger(__name__)

# A small random BERT for CPU runs and tests (used when no model_name_or_path is given).
TINY_BERT = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
}


class BertEmbeddingUnit(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids, token_type_ids, attention_mask):
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return hidden, attention_mask


class BertAttentionUnit(nn.Module):
    """Self-attention + output dense/dropout/LayerNorm with the residual inside.

    The bias is always materialised from the mask: by default transformers reads
    `padding_mask.all()` on the host to skip it for unpadded batches, which on a GPU is a
    device-to-host synchronisation in every attention unit of every micro-batch."""

    def __init__(self, attention: nn.Module, config: BertConfig) -> None:
        super().__init__()
        self.attention = attention
        self.config = config

    def forward(self, hidden, attention_mask):
        bias = create_bidirectional_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            allow_is_bidirectional_skip=False,
        )
        output, _ = self.attention(hidden, bias)
        return output, attention_mask


class BertMlpUnit(nn.Module):
    """Intermediate dense + activation, output dense/dropout/LayerNorm with the residual."""

    def __init__(self, intermediate: nn.Module, output: nn.Module) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.output = output

    def forward(self, hidden, attention_mask):
        return self.output(self.intermediate(hidden), hidden), attention_mask


class BertClassificationHead(nn.Module):
    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, hidden, attention_mask):
        return self.classifier(self.dropout(self.pooler(hidden)))


class BertQuestionAnsweringHead(nn.Module):
    """Start/end logits per token, stacked on the last dimension: (batch, seq, 2)."""

    def __init__(self, qa_outputs: nn.Module) -> None:
        super().__init__()
        self.qa_outputs = qa_outputs

    def forward(self, hidden, attention_mask):
        return self.qa_outputs(hidden)


# Architectures of common hub checkpoints, so planning (`pipetransformer plan`, config
# checks on the meta device) works offline. Training still downloads the real config and
# weights through transformers.
_BASE = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
}
_LARGE = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
}
KNOWN_HUB_CONFIGS = {
    "bert-base-uncased": {**_BASE, "vocab_size": 30522},
    "bert-base-cased": {**_BASE, "vocab_size": 28996},
    "bert-large-uncased": {**_LARGE, "vocab_size": 30522},
    "bert-large-cased": {**_LARGE, "vocab_size": 28996},
    "google-bert/bert-base-uncased": {**_BASE, "vocab_size": 30522},
    "google-bert/bert-large-uncased": {**_LARGE, "vocab_size": 30522},
}


def _is_local(path: str) -> bool:
    return Path(path).expanduser().exists()


# Config fields that fix the shapes of pretrained weights: model.kwargs may not change them.
_SHAPE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "type_vocab_size",
)


def _check_kwargs_fit_weights(model_name_or_path: str, kwargs: dict[str, Any]) -> None:
    saved = BertConfig.from_pretrained(model_name_or_path)
    for key in _SHAPE_FIELDS:
        if key in kwargs and kwargs[key] != getattr(saved, key):
            raise ValueError(
                f"model.kwargs.{key}={kwargs[key]} does not fit the pretrained weights of "
                f"{model_name_or_path} ({key}={getattr(saved, key)}); drop it "
                "(e.g. the override model.kwargs={}) or set model.pretrained=false"
            )


def create_bert(
    *,
    task: str,
    num_labels: int,
    vocab_size: int | None,
    model_name_or_path: str | None = None,
    pretrained: bool = True,
    kwargs: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """BertForSequenceClassification / BertForQuestionAnswering, pretrained or random."""
    model_cls = (
        BertForQuestionAnswering if task == "question_answering" else BertForSequenceClassification
    )
    labels = 2 if task == "question_answering" else num_labels
    kwargs = dict(kwargs or {})
    if model_name_or_path is not None:
        if looks_like_path(model_name_or_path) and not _is_local(model_name_or_path):
            raise FileNotFoundError(
                f"model.model_name_or_path: no such directory: {model_name_or_path}"
            )
        if (
            _is_local(model_name_or_path)
            and not (Path(model_name_or_path) / "config.json").is_file()
        ):
            raise FileNotFoundError(
                f"model.model_name_or_path: {model_name_or_path} has no config.json"
            )
        if str(device) == "meta" and model_name_or_path in KNOWN_HUB_CONFIGS:
            config = BertConfig(
                num_labels=labels, **{**KNOWN_HUB_CONFIGS[model_name_or_path], **kwargs}
            )
        else:
            config = BertConfig.from_pretrained(model_name_or_path, num_labels=labels, **kwargs)
        if pretrained and str(device) != "meta":
            _check_kwargs_fit_weights(model_name_or_path, kwargs)
            model = model_cls.from_pretrained(model_name_or_path, config=config)
            logger.info("loaded pretrained BERT weights from %s", model_name_or_path)
            return model
    else:
        options = {**TINY_BERT, **kwargs}
        if vocab_size is not None:
            options["vocab_size"] = vocab_size
        try:
            config = BertConfig(num_labels=labels, **options)
        except TypeError as exc:
            raise ValueError(f"model.kwargs: {exc}") from exc
    with torch.device(device):
        return model_cls(config)


def layered_bert(model: nn.Module, max_seq_length: int) -> LayeredModel:
    qa = isinstance(model, BertForQuestionAnswering)
    bert = model.bert
    config = bert.config
    units: list[nn.Module] = [BertEmbeddingUnit(bert.embeddings)]
    for layer in bert.encoder.layer:
        if getattr(layer, "add_cross_attention", False):
            raise ValueError("BERT layers with cross-attention are not supported")
        units += [
            BertAttentionUnit(layer.attention, config),
            BertMlpUnit(layer.intermediate, layer.output),
        ]
    if qa:
        units.append(BertQuestionAnsweringHead(model.qa_outputs))
        output = TensorSpec((max_seq_length, 2), torch.float32)
    else:
        units.append(BertClassificationHead(bert.pooler, model.dropout, model.classifier))
        output = TensorSpec((config.num_labels,), torch.float32)
    tokens = TensorSpec((max_seq_length,), torch.long)
    num_layers = len(bert.encoder.layer)
    spec = ModelSpec(
        family="bert",
        task="question_answering" if qa else "classification",
        num_layers=num_layers,
        unit_names=tuple(
            ["embedding"]
            + [f"layer{l}.{part}" for l in range(num_layers) for part in ("attention", "mlp")]
            + ["head"]
        ),
        unit_param_counts=tuple(count_params(u) for u in units),
        input_specs=(tokens, tokens, tokens),
        activation_specs=(TensorSpec((max_seq_length, config.hidden_size), torch.float32), tokens),
        output_spec=output,
    )
    return LayeredModel(units, spec, source=model)


def export_bert(model: LayeredModel, out_dir: Path, tokenizer: str | None) -> list[str]:
    """Write a transformers `save_pretrained` directory (config.json, model.safetensors and,
    from `tokenizer` (a hub id or directory), the tokenizer's files), which
    AutoModelForSequenceClassification / AutoModelForQuestionAnswering.from_pretrained
    loads. Returns the files written."""
    model.source.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(str(out_dir))
    else:
        logger.warning(
            "no tokenizer exported: the run used a word vocabulary built from its training "
            "text (set data.tokenizer or model.model_name_or_path to train with a "
            "transformers tokenizer)"
        )
    return sorted(p.name for p in out_dir.iterdir())
