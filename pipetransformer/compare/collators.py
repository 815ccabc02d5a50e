"""How the `Trainer` peer's text batches are collated, as its users collate them: padded per
batch (`DataCollatorWithPadding`) or flattened into one row (`DataCollatorWithFlattening`),
which is refused where the model cannot keep the row's samples apart.

Owns: the peer's tokenizer for padding, its collators and the flattening refusal. Must
not: train anything (compare/peers.py runs the peer).
"""

from __future__ import annotations

from torch import nn

from pipetransformer.compare.report import HF_TRAINER
from pipetransformer.config import Config


def padding_tokenizer(config: Config):
    """The tokenizer `DataCollatorWithPadding` pads with: the run's (data.tokenizer, or the
    pretrained model's), else one that only pads, with the word vocabulary's [PAD] id 0
    (data/text.py), padding on the right as the data is."""
    from pipetransformer.data.text import WordVocabTokenizer, load_tokenizer

    name = config.data.tokenizer or config.model.model_name_or_path
    if name is not None:
        return load_tokenizer(name)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    pad, unk = WordVocabTokenizer.SPECIALS[:2]
    vocabulary = Tokenizer(WordLevel({pad: 0, unk: 1}, unk_token=unk))
    vocabulary.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=vocabulary, pad_token=pad, unk_token=unk)


def padding_collator(config: Config):
    """How a `Trainer` user pads: DataCollatorWithPadding to each batch's longest, rounded up
    to data.pad_to_multiple_of (data.padding batch), or to max_seq_length (max_length)."""
    from transformers import DataCollatorWithPadding

    tokenizer = padding_tokenizer(config)
    tokenizer.padding_side = "right"
    if config.data.padding == "max_length":
        return DataCollatorWithPadding(
            tokenizer, padding="max_length", max_length=config.data.max_seq_length
        )
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=config.data.pad_to_multiple_of)


def flattening_refusal(model: nn.Module) -> str | None:
    """Why `Trainer` with DataCollatorWithFlattening cannot train `model` correctly (None:
    it can). The collator lays a batch in one row and gives position ids restarting per
    sample: a sequence classifier's head reads one first token a row (one prediction for
    the batch, its labels made per token), and only flash attention's kernels read the
    samples' bounds from the position ids. transformers 5.24's create_bidirectional_mask
    passes no position ids to the packed-sequence detection (masking_utils: only
    create_causal_mask finds packed sequences), so an encoder under sdpa or eager attends
    across samples (tests/test_peers.py shows it)."""
    name = type(model).__name__
    implementation = model.config._attn_implementation
    if name.endswith("ForSequenceClassification"):
        return (
            f"{name} reads one first token a row, and DataCollatorWithFlattening puts the "
            f"whole batch in one row (under {implementation} attention would also cross "
            "samples: create_bidirectional_mask ignores position ids)"
        )
    if not implementation.startswith("flash_attention"):
        return (
            f"under {implementation} attention, create_bidirectional_mask ignores the position "
            "ids DataCollatorWithFlattening restarts per sample: attention would cross samples"
        )
    return None


def meta_text_model(config: Config) -> nn.Module:
    """The peer's model class and attention on the meta device (no weights, no data)."""
    from pipetransformer.models.text_models import create_text_model

    model, _ = create_text_model(
        config.model, task="classification", num_labels=2, vocab_size=None, device="meta"
    )
    return model


def collator(config: Config, model: nn.Module, hf_collator: str):
    """The data collator of `--hf-collator`: DataCollatorWithPadding as users pad, or
    DataCollatorWithFlattening where the model supports it (refused otherwise)."""
    if hf_collator == "padding":
        return padding_collator(config)
    if hf_collator != "flattening":
        raise ValueError(f"--hf-collator: 'padding' or 'flattening', got {hf_collator!r}")
    reason = flattening_refusal(model)
    if reason is not None:
        raise ValueError(f"{HF_TRAINER} with DataCollatorWithFlattening: refused: {reason}")
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening()
