"""transformers text encoders: building one from a ModelConfig, the spec every text adapter
shares, and export.

`model.name` is a transformers model type ("bert", "roberta", "deberta-v2", ...): a small
random model of that family (the adapter's `random_config`, then `model.kwargs`). With
`model.model_name_or_path` (a hub id or a local directory) the family comes from that
config's `model_type` and the weights are the pretrained ones. The adapter is looked up
before any weight is loaded, so an unsupported family fails at once. On the meta device only
the config is read: local directories and `KNOWN_HUB_CONFIGS` plan offline.

Every text model takes (input_ids, token_type_ids, attention_mask), each (batch, seq) int64,
and passes (hidden_state, attention_mask, ...) between units: the 2-D mask rides to every
unit of every stage, and each attention unit builds its own bias from it.

Owns: that construction, `text_spec`, the offline hub configs, transformers export.
Must not: know any family's internals (the adapters do), pipelines, freezing or ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetransformer.config import ModelConfig, looks_like_path
from pipetransformer.models.layered import (
    LayeredModel,
    ModelSpec,
    TensorSpec,
    count_params,
    layer_unit_names,
)
from pipetransformer.models.load_report import load_with_own_report
from pipetransformer.models.registry import ExportInfo, ModelAdapter, adapter_for_model_type
from pipetransformer.utils.logging import plain_text_when_redirected

logger = logging.getLogger(__name__)

# The word vocabulary a run builds for a random model (data/text.py's WordVocabTokenizer:
# [PAD] [UNK] [CLS] [SEP] [MASK]): random models get its special token ids, whatever their
# family's pretrained tokenizer uses (RoBERTa pads with 1, ModernBERT with 50283).
WORD_VOCAB_SPECIAL_TOKENS = {
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 3,
    "cls_token_id": 2,
    "sep_token_id": 3,
}

# A small random encoder for CPU runs and tests (the sizes BERT always had here).
SMALL_ENCODER = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
}

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
_DEBERTA_V3 = {
    "relative_attention": True,
    "pos_att_type": ["p2c", "c2p"],
    "position_buckets": 256,
    "max_relative_positions": -1,
    "norm_rel_ebd": "layer_norm",
    "share_att_key": True,
    "position_biased_input": False,
    "type_vocab_size": 0,
    "vocab_size": 128100,
    "hidden_act": "gelu",
}
# Architectures of common hub checkpoints (model_type, config fields), so planning
# (`pipetransformer plan`, config checks on the meta device) works offline. Training still
# downloads the real config and weights through transformers.
KNOWN_HUB_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert-base-uncased": ("bert", {**_BASE, "vocab_size": 30522}),
    "bert-base-cased": ("bert", {**_BASE, "vocab_size": 28996}),
    "bert-large-uncased": ("bert", {**_LARGE, "vocab_size": 30522}),
    "bert-large-cased": ("bert", {**_LARGE, "vocab_size": 28996}),
    "google-bert/bert-base-uncased": ("bert", {**_BASE, "vocab_size": 30522}),
    "google-bert/bert-large-uncased": ("bert", {**_LARGE, "vocab_size": 30522}),
    "roberta-base": (
        "roberta",
        {**_BASE, "vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1},
    ),
    "FacebookAI/roberta-base": (
        "roberta",
        {**_BASE, "vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1},
    ),
    "roberta-large": (
        "roberta",
        {**_LARGE, "vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1},
    ),
    "FacebookAI/xlm-roberta-base": (
        "xlm-roberta",
        {**_BASE, "vocab_size": 250002, "max_position_embeddings": 514, "type_vocab_size": 1},
    ),
    "FacebookAI/xlm-roberta-large": (
        "xlm-roberta",
        {**_LARGE, "vocab_size": 250002, "max_position_embeddings": 514, "type_vocab_size": 1},
    ),
    "google/electra-base-discriminator": (
        "electra",
        {**_BASE, "embedding_size": 768, "vocab_size": 30522},
    ),
    "google/electra-large-discriminator": (
        "electra",
        {**_LARGE, "embedding_size": 1024, "vocab_size": 30522},
    ),
    "microsoft/deberta-v3-small": (
        "deberta-v2",
        {**_BASE, **_DEBERTA_V3, "num_hidden_layers": 6},
    ),
    "microsoft/deberta-v3-base": ("deberta-v2", {**_BASE, **_DEBERTA_V3}),
    "microsoft/deberta-v3-large": ("deberta-v2", {**_LARGE, **_DEBERTA_V3}),
    "distilbert-base-uncased": (
        "distilbert",
        {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072, "vocab_size": 30522},
    ),
    "distilbert/distilbert-base-uncased": (
        "distilbert",
        {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072, "vocab_size": 30522},
    ),
    "answerdotai/ModernBERT-base": (
        "modernbert",
        {
            "hidden_size": 768,
            "num_hidden_layers": 22,
            "num_attention_heads": 12,
            "intermediate_size": 1152,
            "vocab_size": 50368,
        },
    ),
    "answerdotai/ModernBERT-large": (
        "modernbert",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "intermediate_size": 2624,
            "vocab_size": 50368,
        },
    ),
}

# Config fields that fix the shapes of pretrained weights: model.kwargs may not change them.
_SHAPE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "type_vocab_size",
    "embedding_size",
    "hidden_dim",
    "position_buckets",
)


def _is_local(path: str) -> bool:
    return Path(path).expanduser().exists()


def _check_kwargs_fit_weights(saved, model_name_or_path: str, kwargs: dict[str, Any]) -> None:
    for key in _SHAPE_FIELDS:
        if key in kwargs and hasattr(saved, key) and kwargs[key] != getattr(saved, key):
            raise ValueError(
                f"model.kwargs.{key}={kwargs[key]} does not fit the pretrained weights of "
                f"{model_name_or_path} ({key}={getattr(saved, key)}); drop it "
                "(e.g. the override model.kwargs={}) or set model.pretrained=false"
            )


def _model_class(task: str):
    from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification

    if task == "question_answering":
        return AutoModelForQuestionAnswering
    return AutoModelForSequenceClassification


def _checked_path(model_name_or_path: str) -> None:
    if looks_like_path(model_name_or_path) and not _is_local(model_name_or_path):
        raise FileNotFoundError(
            f"model.model_name_or_path: no such directory: {model_name_or_path}"
        )
    if _is_local(model_name_or_path) and not (Path(model_name_or_path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model.model_name_or_path: {model_name_or_path} has no config.json"
        )


def text_config(
    config: ModelConfig, *, task: str, num_labels: int, vocab_size: int | None, device
) -> tuple[Any, ModelAdapter]:
    """(the transformers config of the model to build, its adapter)."""
    from transformers import AutoConfig

    # A regression is a one-output sequence-classification head that transformers (its
    # loss, pipeline("text-classification")) reads as a regression.
    head = {"num_labels": 2 if task == "question_answering" else num_labels}
    if task == "regression":
        head["problem_type"] = "regression"
    kwargs = dict(config.kwargs)
    name = config.model_name_or_path
    if name is not None:
        _checked_path(name)
        if str(device) == "meta" and name in KNOWN_HUB_CONFIGS:
            model_type, fields = KNOWN_HUB_CONFIGS[name]
            adapter = adapter_for_model_type(model_type)
            return AutoConfig.for_model(model_type, **head, **{**fields, **kwargs}), adapter
        saved = AutoConfig.from_pretrained(name)
        adapter = adapter_for_model_type(saved.model_type)
        if str(device) != "meta":
            _check_kwargs_fit_weights(saved, name, kwargs)
        return AutoConfig.from_pretrained(name, **head, **kwargs), adapter
    model_type = "bert" if config.name.lower().startswith("bert") else config.name
    adapter = adapter_for_model_type(model_type)
    options = {**SMALL_ENCODER, **WORD_VOCAB_SPECIAL_TOKENS, **adapter.random_config, **kwargs}
    if vocab_size is not None:
        options["vocab_size"] = vocab_size
    try:
        return AutoConfig.for_model(model_type, **head, **options), adapter
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model.kwargs: {exc}") from exc


def create_text_model(
    config: ModelConfig,
    *,
    task: str,
    num_labels: int,
    vocab_size: int | None,
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, ModelAdapter]:
    """The sequence-classification or question-answering model of `config` (pretrained
    weights with model_name_or_path, else random) and the adapter that cuts it."""
    hf_config, adapter = text_config(
        config, task=task, num_labels=num_labels, vocab_size=vocab_size, device=device
    )
    model_class = _model_class(task)
    if config.model_name_or_path is not None and str(device) != "meta":
        from transformers.utils import logging as transformers_logging

        # Its loading report is coloured for a terminal on stdout, written to stderr; when
        # all it says is that the head is new, one line of ours says it (load_report.py).
        plain_text_when_redirected(transformers_logging.get_logger())
        name = config.model_name_or_path
        model = load_with_own_report(
            lambda **options: model_class.from_pretrained(name, config=hf_config, **options),
            name,
        )
        logger.info("loaded pretrained weights from %s", name)
        return model.to(device), adapter
    with torch.device(device):
        return model_class.from_config(hf_config), adapter


def text_spec(
    *,
    family: str,
    task: str,
    units: Sequence[nn.Module],
    max_seq_length: int,
    hidden_size: int,
    num_labels: int,
    hidden_tokens: int | None = None,
    extra_activations: Sequence[TensorSpec] = (),
) -> ModelSpec:
    """The spec of a text model: inputs (input_ids, token_type_ids, attention_mask), each
    (seq,) int64; activations (hidden (hidden_tokens, hidden_size) float32, the mask, then
    `extra_activations`); output (num_labels,) or, for question answering, (seq, 2). Every
    spec with a sequence dimension follows a batch's length (`ModelSpec.at_length`)."""
    tokens = TensorSpec((max_seq_length,), torch.long, sequence=True)
    if task == "question_answering":
        output = TensorSpec((max_seq_length, 2), torch.float32, sequence=True)
    else:
        output = TensorSpec((num_labels,), torch.float32)
    num_layers = (len(units) - 2) // 2
    hidden = TensorSpec(
        (hidden_tokens or max_seq_length, hidden_size), torch.float32, sequence=True
    )
    return ModelSpec(
        family=family,
        task=task,
        num_layers=num_layers,
        unit_names=layer_unit_names(num_layers),
        unit_param_counts=tuple(count_params(u) for u in units),
        input_specs=(tokens, tokens, tokens),
        activation_specs=(hidden, tokens, *extra_activations),
        output_spec=output,
        max_seq_length=max_seq_length,
    )


def text_task(model: nn.Module) -> str:
    """The task of a transformers model: question answering or sequence classification."""
    name = type(model).__name__
    if name.endswith("ForQuestionAnswering"):
        return "question_answering"
    if name.endswith("ForSequenceClassification"):
        return "classification"
    raise ValueError(f"{name}: only sequence classification and question answering are cut")


def check_fits(max_seq_length: int, max_positions: int, offset: int = 0) -> None:
    """Position embeddings must cover every position the run feeds (RoBERTa's start after
    the padding index: `offset`)."""
    if max_seq_length + offset > max_positions:
        raise ValueError(
            f"data.max_seq_length={max_seq_length} needs {max_seq_length + offset} position "
            f"embeddings; the model has {max_positions}"
        )


def export_text_model(model: LayeredModel, out_dir: Path, info: ExportInfo) -> list[str]:
    """A transformers `save_pretrained` directory: config.json, model.safetensors and, from
    `info.tokenizer` (a hub id or directory), the tokenizer with the run's maximum length,
    so that AutoTokenizer + AutoModelForSequenceClassification / ...ForQuestionAnswering
    `from_pretrained` reproduce the run's inputs and logits. Returns the files written."""
    if info.labels is not None:  # pipeline("text-classification") answers with the names
        model.source.config.id2label = dict(enumerate(info.labels))
        model.source.config.label2id = {name: i for i, name in enumerate(info.labels)}
    model.source.save_pretrained(str(out_dir), safe_serialization=True)
    if info.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(info.tokenizer)
        config = model.source.config
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != config.pad_token_id:
            logger.warning(
                "the tokenizer pads with id %d, the model's config says %s: a random model "
                "trained with data.tokenizer takes that tokenizer's special token ids in "
                "model.kwargs (pad_token_id, ...)",
                tokenizer.pad_token_id,
                config.pad_token_id,
            )
        # The run truncated every text to max_seq_length tokens (and padded each batch to
        # its longest, or to max_seq_length): the saved tokenizer truncates there too
        # (`truncation=True`), and says so in its config.
        tokenizer.model_max_length = model.spec.input_specs[0].shape[0]
        tokenizer.save_pretrained(str(out_dir))
    else:
        logger.warning(
            "no tokenizer exported: the run used a word vocabulary built from its training "
            "text (set data.tokenizer or model.model_name_or_path to train with a "
            "transformers tokenizer)"
        )
    return sorted(p.name for p in out_dir.iterdir())
