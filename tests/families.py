"""Every model family with an adapter, at test size: a tiny config, how its library is
called, and a batch. Shared by the exactness tests (test_families.py), the host-read audit
(test_gpu_rules.py) and the distributed transition run over all families (test_families.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipetransformer.config import ModelConfig
from pipetransformer.models import LayeredModel, build_model

SEQ_LEN = 16
VOCAB = 50
IMAGE_SIZE = 8

_TEXT = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
_BERT_DROPOUT_OFF = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
_IMAGE = {"patch_size": 4, "embed_dim": 32, "depth": 4, "num_heads": 2, "mlp_ratio": 2.0}


@dataclass(frozen=True)
class Family:
    """One adapter's family at test size. `dropout_off` are the kwargs that turn every
    dropout off (pipelines compare with single-process training only without dropout);
    `token_types`: the library model is called with token_type_ids (its tokenizer gives
    them)."""

    family: str  # ModelSpec.family
    name: str  # model.name
    kwargs: dict[str, Any]
    dropout_off: dict[str, Any] = field(default_factory=dict)
    token_types: bool = False

    @property
    def text(self) -> bool:
        return self.family not in IMAGE_FAMILIES

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("classification", "question_answering") if self.text else ("classification",)

    def config(self, dropout: bool = False) -> ModelConfig:
        kwargs = self.kwargs if dropout else {**self.kwargs, **self.dropout_off}
        return ModelConfig(name=self.name, kwargs=kwargs)

    def build(
        self, task: str = "classification", *, seed: int = 0, dropout: bool = False, device="cpu"
    ) -> LayeredModel:
        torch.manual_seed(seed)
        if self.text:
            return build_model(
                self.config(dropout),
                task=task,
                num_classes=2,
                vocab_size=VOCAB,
                max_seq_length=SEQ_LEN,
                device=device,
            )
        return build_model(
            self.config(dropout),
            task=task,
            num_classes=10,
            in_chans=1,
            image_size=IMAGE_SIZE,
            device=device,
        )


FAMILIES = {
    f.family: f
    for f in [
        Family("bert", "bert", _TEXT, _BERT_DROPOUT_OFF, token_types=True),
        Family("roberta", "roberta", _TEXT, _BERT_DROPOUT_OFF),
        Family("xlm-roberta", "xlm-roberta", _TEXT, _BERT_DROPOUT_OFF),
        # An embedding narrower than the hidden state: the embedding projection is cut too.
        Family("electra", "electra", {**_TEXT, "embedding_size": 16}, _BERT_DROPOUT_OFF, True),
        # DeBERTa-v3's architecture (relative attention over a bucketed, layer-normed table).
        Family(
            "deberta-v2",
            "deberta-v2",
            {**_TEXT, "position_buckets": 8},
            {**_BERT_DROPOUT_OFF, "pooler_dropout": 0.0},
            token_types=True,
        ),
        Family(
            "distilbert",
            "distilbert",
            {**_TEXT, "hidden_dim": 64},
            {
                "dropout": 0.0,
                "attention_dropout": 0.0,
                "seq_classif_dropout": 0.0,
                "qa_dropout": 0.0,
            },
        ),
        # Global and local (window 8 < SEQ_LEN) layers alternate; mean pooling reads the mask.
        Family(
            "modernbert",
            "modernbert",
            {
                **_TEXT,
                "local_attention": 8,
                "global_attn_every_n_layers": 2,
                "classifier_pooling": "mean",
                "embedding_dropout": 0.1,
                "mlp_dropout": 0.1,
                "attention_dropout": 0.1,
            },
            {"embedding_dropout": 0.0, "mlp_dropout": 0.0, "attention_dropout": 0.0},
        ),
        Family("vit", "vit_tiny_patch16_224", _IMAGE, {}),
        Family(
            "vit-distilled",
            "deit_tiny_distilled_patch16_224",
            {**_IMAGE, "drop_rate": 0.1},
            {"drop_rate": 0.0},
        ),
        # EVA-02: rotary position tables, SwiGLU, layer scale (init_values).
        Family(
            "eva",
            "eva02_tiny_patch14_224",
            {**_IMAGE, "init_values": 0.1, "proj_drop_rate": 0.1},
            {"proj_drop_rate": 0.0},
        ),
        # BEiT-v2: a relative position bias per layer, layer scale, mean pooling.
        Family(
            "beit",
            "beitv2_base_patch16_224",
            {**_IMAGE, "drop_rate": 0.1, "proj_drop_rate": 0.1},
            {"drop_rate": 0.0, "proj_drop_rate": 0.0},
        ),
    ]
}
IMAGE_FAMILIES = ("vit", "vit-distilled", "eva", "beit")
TEXT_FAMILIES = tuple(f for f in FAMILIES if f not in IMAGE_FAMILIES)


def text_batch(batch_size: int = 4, seed: int = 123, padded: bool = True):
    """(input_ids, token_type_ids, attention_mask): every sample but the first padded at a
    length of its own (4..SEQ_LEN-1), a second segment from position 6."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (batch_size, SEQ_LEN), generator=g)
    lengths = torch.randint(4, SEQ_LEN, (batch_size,), generator=g)
    lengths[0] = SEQ_LEN
    if not padded:
        lengths[:] = SEQ_LEN
    mask = (torch.arange(SEQ_LEN)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    return ids, types * mask, mask


def image_batch(batch_size: int = 4, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, 1, IMAGE_SIZE, IMAGE_SIZE, generator=g),)


def batch(family: Family, batch_size: int = 4, seed: int = 123):
    return text_batch(batch_size, seed) if family.text else image_batch(batch_size, seed)


def library_forward(family: Family, model: LayeredModel, inputs) -> torch.Tensor:
    """The library model's own forward on `inputs`, as its users call it, in the units'
    output format (question answering: start and end logits stacked on the last dim)."""
    source = model.source
    if not family.text:
        return source(*inputs)
    ids, types, mask = inputs
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if family.token_types:
        kwargs["token_type_ids"] = types
    out = source(**kwargs)
    if model.spec.task == "question_answering":
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.logits
