"""Text data: SST-2 from a local TSV directory or GLUE through `datasets` (table.py makes
it one case of its text classification tables), and the tokenizers every text task
encodes with.

Owns: reading SST-2's sentences and labels, choosing a tokenizer (a pretrained one, or a
word vocabulary built from the training text for random BERTs) and pre-tokenising texts or
text pairs to max_seq_length tensors (input_ids, token_type_ids, attention_mask), padded
on the right (a batch is cut to its own length when fetched: data/base.py).
Must not: know about ranks or samplers.
"""

from __future__ import annotations

import csv
import logging
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from pipetransformer.config import DataConfig, looks_like_path
from pipetransformer.data.base import subset_indices

logger = logging.getLogger(__name__)

_WORD = re.compile(r"[\w']+|[^\w\s]")


class WordVocabTokenizer:
    """Lower-cased words and punctuation -> ids, with BERT's special tokens.

    For random-init BERTs, which have no vocabulary of their own. Built from training text
    only, most frequent words first, so every rank builds the same one.
    """

    SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

    def __init__(self, texts: Sequence[str], max_size: int = 30000) -> None:
        counts = Counter(word for text in texts for word in _WORD.findall(text.lower()))
        words = sorted(counts, key=lambda w: (-counts[w], w))[: max_size - len(self.SPECIALS)]
        self.vocab = {token: i for i, token in enumerate([*self.SPECIALS, *words])}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id = 0, 1, 2, 3

    def __len__(self) -> int:
        return len(self.vocab)

    def encode_pairs(self, first: Sequence[str], second: Sequence[str] | None, max_length: int):
        n = len(first)
        input_ids = torch.zeros(n, max_length, dtype=torch.long)
        token_type_ids = torch.zeros(n, max_length, dtype=torch.long)
        for row in range(n):
            a = [self.vocab.get(w, self.unk_id) for w in _WORD.findall(first[row].lower())]
            b = (
                []
                if second is None
                else [self.vocab.get(w, self.unk_id) for w in _WORD.findall(second[row].lower())]
            )
            budget = max_length - 2 - (1 if b else 0)
            b = b[: max(0, budget - len(a))] if b else b
            a = a[: budget - len(b)]
            ids = [self.cls_id, *a, self.sep_id] + ([*b, self.sep_id] if b else [])
            input_ids[row, : len(ids)] = torch.tensor(ids)
            token_type_ids[row, len(a) + 2 : len(ids)] = 1
        attention_mask = (input_ids != self.pad_id).long()
        return input_ids, token_type_ids, attention_mask

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of one text, no special tokens, each with its (start, end) character
        span in `text` (the offset mapping that question answering maps answers through).

        Matches on the original text and lower-cases each word for lookup, so the offsets
        index `text` itself; `_WORD` does not depend on case, so the words are those
        `encode_pairs` sees (up to characters whose lower-case form changes length).
        A (question, context) pair is assembled from two such encodings by the caller,
        which also cuts long contexts into windows.
        """
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for match in _WORD.finditer(text):
            ids.append(self.vocab.get(match.group().lower(), self.unk_id))
            offsets.append(match.span())
        return ids, offsets


def encode(
    tokenizer, sentences: Sequence[str], max_length: int, second: Sequence[str] | None = None
):
    """max_length tensors of texts, or of text pairs when `second` is given (joined as the
    tokenizer's family joins them, second segment token type 1 where the family has types),
    padded on the right whatever the tokenizer's own side (a batch is cut from the right)."""
    if isinstance(tokenizer, WordVocabTokenizer):
        return tokenizer.encode_pairs(sentences, second, max_length)
    out = tokenizer(
        list(sentences),
        None if second is None else list(second),
        max_length=max_length,
        truncation=True,
        padding="max_length",
        padding_side="right",
        return_tensors="pt",
        return_token_type_ids=True,
    )
    return out["input_ids"], out["token_type_ids"], out["attention_mask"]


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if looks_like_path(name) and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"data.tokenizer: no such directory: {name}")
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise FileNotFoundError(
            f"data.tokenizer: cannot load a tokenizer from '{name}': {exc}"
        ) from exc


def read_sst2_tsv(path: Path) -> tuple[list[str], list[int]]:
    """`sentence<TAB>label` with a header line; every malformed row is an error naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"data.root: no such file: {path}")
    sentences, labels = [], []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None or [h.strip().lower() for h in header[:2]] != ["sentence", "label"]:
            raise ValueError(f"{path}: expected a header line 'sentence<TAB>label', got {header!r}")
        for line_number, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 2 or row[1].strip() not in ("0", "1"):
                raise ValueError(f"{path}:{line_number}: expected 'sentence<TAB>0|1', got {row!r}")
            sentences.append(row[0])
            labels.append(int(row[1]))
    if not sentences:
        raise ValueError(f"{path}: no samples")
    return sentences, labels


# GLUE's names of SST-2's labels 0 and 1 (what exports answer with).
SST2_LABELS = ["negative", "positive"]


def read_sst2(root: str | None) -> dict[str, tuple[list[str], list[int]]]:
    if root is not None:
        base = Path(root).expanduser()
        if not base.is_dir():
            raise FileNotFoundError(
                f"data.root: {base} is not a directory with train.tsv and dev.tsv"
            )
        return {split: read_sst2_tsv(base / f"{split}.tsv") for split in ("train", "dev")}
    import datasets

    logger.info("data.root is not set: SST-2 comes from the hub through datasets (glue/sst2)")
    glue = datasets.load_dataset("glue", "sst2")
    return {
        "train": (list(glue["train"]["sentence"]), list(glue["train"]["label"])),
        "dev": (list(glue["validation"]["sentence"]), list(glue["validation"]["label"])),
    }


def pick_tokenizer(config: DataConfig, model_name_or_path: str | None, train_texts: Sequence[str]):
    name = config.tokenizer or model_name_or_path
    if name is not None:
        return load_tokenizer(name)
    tokenizer = WordVocabTokenizer(train_texts)
    logger.info("built a %d-word vocabulary from the training text", len(tokenizer))
    return tokenizer


# data.holdout draws its test sentences with this seed, whatever trainer.seed is: every
# seed and every variant of a comparison is scored on the same sentences.
HOLDOUT_SEED = 20_211


def holdout_split(
    sentences: Sequence[str], labels: Sequence[int], size: int
) -> tuple[tuple[list[str], list[int]], tuple[list[str], list[int]]]:
    """(training pool, held-out test set): `size` sentences of a fixed permutation held out,
    the rest left to train on; disjoint."""
    if size >= len(labels):
        raise ValueError(f"data.holdout: {size} leaves nothing of {len(labels)} to train on")
    order = subset_indices(len(labels), len(labels), HOLDOUT_SEED)
    held, rest = order[:size], order[size:]
    return (
        ([sentences[i] for i in rest], [labels[i] for i in rest]),
        ([sentences[i] for i in held], [labels[i] for i in held]),
    )
