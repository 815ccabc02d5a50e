"""SQuAD v1.1 question answering data: examples, features and what evaluation needs.

An *example* is one question with its context and gold answers; a *feature* is one
model input cut from it: `[CLS] question [SEP] context window [SEP] [PAD]...`, held at
max_seq_length and cut to its batch's padded length when fetched (data/base.py).
A context longer than the room left after the question is covered by several windows that
overlap by `doc_stride` tokens (the `stride` of transformers' tokenizers with
`truncation="only_second"` and `return_overflowing_tokens=True`, as in its run_qa
example). Sample ids of both splits are feature ids; evaluation maps features back to
questions through `DataBundle.eval_extras`.

Owns: reading SQuAD v1.1 JSON (a training and an evaluation file, one file for both, a
directory with train-v1.1.json and dev-v1.1.json, or `datasets`' "squad"), choosing the
tokenizer, locating answers in the context, cutting features, labelling them with answer
token positions, and the per-feature character offsets that post-processing needs.
Must not: know about ranks or samplers, or score predictions (`squad_metric` does).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from pipetransformer.config import DataConfig
from pipetransformer.data.base import DataBundle, TextSampleDataset, subset_indices, subset_note
from pipetransformer.data.text import WordVocabTokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# BERT's reference SQuAD recipe truncates questions to 64 tokens; never let a question
# take more than half of a short sequence either, so every window keeps room for context.
MAX_QUERY_TOKENS = 64
SPLIT_FILES = {"train": "train-v1.1.json", "eval": "dev-v1.1.json"}


@dataclass(frozen=True)
class SquadExample:
    id: str
    question: str
    context: str
    answers: tuple[str, ...]  # gold texts; the first one labels training features
    answer_starts: tuple[int | None, ...]  # character starts as annotated (None: not given)


@dataclass
class SquadFeatures:
    """Features of one split, row f = feature f."""

    input_ids: torch.Tensor  # (F, S) int64
    token_type_ids: torch.Tensor  # (F, S) int64: 0 for [CLS] question [SEP], 1 after
    attention_mask: torch.Tensor  # (F, S) int64
    # (start, end) token positions of the first answer; (0, 0) = [CLS] when the answer is
    # not entirely inside this window or cannot be found in the context.
    positions: torch.Tensor  # (F, 2) int64
    example_index: np.ndarray  # (F,) int64: position of the feature's question in the examples
    # (F, S, 2) int32 character span in the context of every context token, -1 elsewhere;
    # None when not asked for (training needs no offsets).
    offsets: np.ndarray | None

    def __len__(self) -> int:
        return self.positions.shape[0]


# ---------------------------------------------------------------- reading


def _fail(path: Path | str, where: str, message: str) -> NoReturn:
    raise ValueError(f"{path}: {where}: {message} (expected SQuAD v1.1 JSON)")


def read_squad_file(path: str | Path, key: str = "data.root") -> list[SquadExample]:
    """Every question of a SQuAD v1.1 JSON file; any malformed entry is an error naming it,
    a missing file an error naming `key` (the config key that gave the path).

    `answer_start` may be null (some SQuAD-format files leave it out); the answer is then
    searched for in the context.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{key}: no such SQuAD file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), list):
        _fail(path, "top level", 'needs an object with a "data" list of articles')
    version = str(raw.get("version", "1.1"))
    if version.lstrip("v").startswith("2"):
        _fail(path, "version", f"SQuAD {version} (with unanswerable questions) is not supported")
    examples: list[SquadExample] = []
    seen: set[str] = set()
    for a, article in enumerate(raw["data"]):
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            _fail(path, f"data[{a}]", 'needs a "paragraphs" list')
        for p, paragraph in enumerate(article["paragraphs"]):
            where = f"data[{a}].paragraphs[{p}]"
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("context"), str):
                _fail(path, where, 'needs a "context" string')
            if not isinstance(paragraph.get("qas"), list):
                _fail(path, where, 'needs a "qas" list')
            for q, qa in enumerate(paragraph["qas"]):
                examples.append(_read_qa(path, f"{where}.qas[{q}]", qa, paragraph["context"], seen))
    if not examples:
        raise ValueError(f"{path}: no questions")
    return examples


def _read_qa(path: Path, where: str, qa: Any, context: str, seen: set[str]) -> SquadExample:
    if (
        not isinstance(qa, dict)
        or not isinstance(qa.get("id"), str)
        or not isinstance(qa.get("question"), str)
    ):
        _fail(path, where, 'needs "id" and "question" strings')
    if qa["id"] in seen:
        _fail(path, where, f"duplicate question id '{qa['id']}'")
    seen.add(qa["id"])
    if qa.get("is_impossible"):
        _fail(path, where, "unanswerable questions are SQuAD v2.0")
    answers = qa.get("answers")
    if not isinstance(answers, list) or not answers:
        _fail(path, where, 'needs a non-empty "answers" list')
    texts, starts = [], []
    for n, answer in enumerate(answers):
        if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
            _fail(path, f"{where}.answers[{n}]", 'needs a "text" string')
        start = answer.get("answer_start")
        if start is not None and (isinstance(start, bool) or not isinstance(start, int)):
            _fail(
                path, f"{where}.answers[{n}]", f'"answer_start" must be an integer, got {start!r}'
            )
        texts.append(answer["text"])
        starts.append(start)
    return SquadExample(qa["id"], qa["question"], context, tuple(texts), tuple(starts))


def load_squad_examples(
    root: str | None, eval_root: str | None = None
) -> dict[str, list[SquadExample]]:
    """{"train": ..., "eval": ...}: the training split from `root` (see `load_squad_bundle`)
    or `datasets`; the evaluation split from `eval_root` when given, else from there too."""
    own_eval = eval_root is None
    base = None if root is None else Path(root).expanduser()
    if base is None:
        import datasets

        squad = datasets.load_dataset("squad")
        raw = {"train": _from_datasets(squad["train"])}
        if own_eval:
            raw["eval"] = _from_datasets(squad["validation"])
    elif base.is_dir():
        files = SPLIT_FILES if own_eval else {"train": SPLIT_FILES["train"]}
        raw = {split: read_squad_file(base / name) for split, name in files.items()}
    elif not base.exists():
        raise FileNotFoundError(f"data.root: no such SQuAD file or directory: {base}")
    else:
        raw = {"train": read_squad_file(base)}
        if own_eval:
            logger.warning(
                "data.root is the single file %s and data.eval_root is not set: "
                "it is used for both training and evaluation",
                base,
            )
            raw["eval"] = raw["train"]
    if eval_root is not None:
        raw["eval"] = read_squad_file(eval_root, key="data.eval_root")
    return raw


def _from_datasets(split: Any) -> list[SquadExample]:
    return [
        SquadExample(
            row["id"],
            row["question"],
            row["context"],
            tuple(row["answers"]["text"]),
            tuple(row["answers"]["answer_start"]),
        )
        for row in split
    ]


def locate_answer(context: str, text: str, start: int | None) -> tuple[int, int] | None:
    """The answer's [start, end) character span in `context`, without surrounding spaces.

    The annotated start is trusted when the text is there and begins and ends on word
    boundaries. Otherwise (no start; a start whose text differs, e.g. in case; or one inside
    a longer word, as when "7" was annotated inside "137.7") the exact text nearest to the
    annotated start is used, whole-word occurrences first, so labels cover the gold text
    itself. None when the text does not occur in the context: no span to learn.
    """
    stripped = text.strip()
    if not stripped:
        return None
    annotated = None
    if start is not None and 0 <= start and context[start : start + len(text)] == text:
        annotated = start + len(text) - len(text.lstrip())
        if _is_whole_word(context, annotated, len(stripped)):
            return annotated, annotated + len(stripped)
    occurrences = []
    found = context.find(stripped)
    while found >= 0:
        occurrences.append(found)
        found = context.find(stripped, found + 1)
    # A short answer ("7", "term") also occurs inside longer words ("137", "intermediate"),
    # where no tokenizer can place a span: prefer occurrences that are whole words.
    whole_words = [o for o in occurrences if _is_whole_word(context, o, len(stripped))]
    if whole_words:
        occurrences = whole_words
    elif annotated is not None:
        return annotated, annotated + len(stripped)
    if not occurrences:
        return None
    begin = min(occurrences, key=lambda o: abs(o - start)) if start is not None else occurrences[0]
    return begin, begin + len(stripped)


def _is_whole_word(text: str, begin: int, length: int) -> bool:
    return _is_word_boundary(text, begin) and _is_word_boundary(text, begin + length)


def _is_word_boundary(text: str, position: int) -> bool:
    """Whether no word continues across `position` (between text[position-1] and text[position]).

    A number's separators do not end it: "137.7" and "60,000" are one word each here.
    """
    if position <= 0 or position >= len(text):
        return True
    before, after = text[position - 1], text[position]
    if before.isalnum() and after.isalnum():
        return False
    if before in ".," and after.isdigit() and position >= 2 and text[position - 2].isdigit():
        return False
    return not (
        after in ".,"
        and before.isdigit()
        and position + 1 < len(text)
        and text[position + 1].isdigit()
    )


# ---------------------------------------------------------------- tokenizers


class _Encoder:
    """One interface over a WordVocabTokenizer and a fast transformers tokenizer: token ids
    and character offsets of plain texts, and the three special ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if isinstance(tokenizer, WordVocabTokenizer):
            self.cls_id, self.sep_id, self.pad_id = (
                tokenizer.cls_id,
                tokenizer.sep_id,
                tokenizer.pad_id,
            )
            return
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "data.tokenizer: SQuAD needs a fast tokenizer (for offset mappings), "
                f"got {type(tokenizer).__name__}"
            )
        self.cls_id, self.sep_id, self.pad_id = (
            tokenizer.cls_token_id,
            tokenizer.sep_token_id,
            tokenizer.pad_token_id,
        )

    def __len__(self) -> int:
        return len(self.tokenizer)

    def encode(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per text: token ids (n,) and character spans (n, 2), no special tokens."""
        if isinstance(self.tokenizer, WordVocabTokenizer):
            encoded = [self.tokenizer.encode_with_offsets(text) for text in texts]
        else:
            # Contexts are tokenised whole and windowed here; verbose=False silences the
            # "longer than the model's maximum" warning that does not apply to that.
            out = self.tokenizer(
                list(texts),
                add_special_tokens=False,
                return_offsets_mapping=True,
                return_attention_mask=False,
                return_token_type_ids=False,
                verbose=False,
            )
            encoded = list(zip(out["input_ids"], out["offset_mapping"]))
        return [
            (np.asarray(ids, dtype=np.int64), np.asarray(spans, dtype=np.int64).reshape(-1, 2))
            for ids, spans in encoded
        ]


def choose_tokenizer(
    config: DataConfig, model_name_or_path: str | None, train: Sequence[SquadExample]
) -> Any:
    """`data.tokenizer` or the model's (fast) tokenizer; for a random model, a word
    vocabulary built from the training contexts and questions."""
    name = config.tokenizer or model_name_or_path
    if name is not None:
        return load_tokenizer(name)
    contexts = list(dict.fromkeys(example.context for example in train))
    tokenizer = WordVocabTokenizer(contexts + [example.question for example in train])
    logger.info("built a %d-word vocabulary from the SQuAD training text", len(tokenizer))
    return tokenizer


# ---------------------------------------------------------------- features


def max_query_tokens(max_seq_length: int) -> int:
    return min(MAX_QUERY_TOKENS, max_seq_length // 2)


def check_window(max_seq_length: int, doc_stride: int) -> None:
    """Windows must advance: the overlap has to be shorter than the smallest window."""
    smallest_window = max_seq_length - 3 - max_query_tokens(max_seq_length)
    if doc_stride < 0 or doc_stride >= smallest_window:
        raise ValueError(
            f"data.doc_stride: must be in [0, {smallest_window}) "
            f"for data.max_seq_length={max_seq_length} "
            "(the context window left beside a question of up to "
            f"{max_query_tokens(max_seq_length)} tokens), "
            f"got {doc_stride}"
        )


def window_starts(num_tokens: int, window: int, doc_stride: int) -> list[int]:
    """First context token of each window: windows of `window` tokens, each overlapping the
    previous by `doc_stride`, until one reaches the end (the tokenizers' overflow rule)."""
    starts = [0]
    while starts[-1] + window < num_tokens:
        starts.append(starts[-1] + window - doc_stride)
    return starts


def featurize(
    examples: Sequence[SquadExample],
    tokenizer: Any,
    max_seq_length: int,
    doc_stride: int,
    with_offsets: bool = True,
) -> SquadFeatures:
    """Cut every example into features (see the module docstring)."""
    check_window(max_seq_length, doc_stride)
    encoder = tokenizer if isinstance(tokenizer, _Encoder) else _Encoder(tokenizer)
    # Many questions share a context (all of a paragraph's): tokenise each context once.
    unique_contexts = list(dict.fromkeys(example.context for example in examples))
    context_tokens = dict(zip(unique_contexts, encoder.encode(unique_contexts)))
    question_tokens = encoder.encode([example.question for example in examples])
    query_limit = max_query_tokens(max_seq_length)

    # First pass: which windows exist, so the arrays are allocated once.
    plan: list[tuple[int, np.ndarray, int, int, tuple[int, int] | None]] = []
    unlocated = 0
    for index, example in enumerate(examples):
        question = question_tokens[index][0][:query_limit]
        ids, spans = context_tokens[example.context]
        answer = _answer_tokens(example, spans)
        unlocated += answer is None
        window = max_seq_length - 3 - len(question)
        for start in window_starts(len(ids), window, doc_stride):
            plan.append((index, question, start, min(start + window, len(ids)), answer))
    if unlocated:
        logger.warning(
            "%d of %d questions: the first gold answer is not in the context; "
            "their features are labelled [CLS]",
            unlocated,
            len(examples),
        )

    num_features = len(plan)
    input_ids = np.full((num_features, max_seq_length), encoder.pad_id, dtype=np.int64)
    token_type_ids = np.zeros((num_features, max_seq_length), dtype=np.int64)
    attention_mask = np.zeros((num_features, max_seq_length), dtype=np.int64)
    positions = np.zeros((num_features, 2), dtype=np.int64)
    example_index = np.zeros(num_features, dtype=np.int64)
    offsets = (
        np.full((num_features, max_seq_length, 2), -1, dtype=np.int32) if with_offsets else None
    )
    for row, (index, question, begin, end, answer) in enumerate(plan):
        ids, spans = context_tokens[examples[index].context]
        first = len(question) + 2  # position of the window's first context token
        length = first + (end - begin) + 1
        input_ids[row, 0] = encoder.cls_id
        input_ids[row, 1 : first - 1] = question
        input_ids[row, first - 1] = encoder.sep_id
        input_ids[row, first : length - 1] = ids[begin:end]
        input_ids[row, length - 1] = encoder.sep_id
        token_type_ids[row, first:length] = 1
        attention_mask[row, :length] = 1
        example_index[row] = index
        if offsets is not None:
            offsets[row, first : length - 1] = spans[begin:end]
        if answer is not None and begin <= answer[0] and answer[1] < end:
            positions[row] = (answer[0] - begin + first, answer[1] - begin + first)
    return SquadFeatures(
        torch.from_numpy(input_ids),
        torch.from_numpy(token_type_ids),
        torch.from_numpy(attention_mask),
        torch.from_numpy(positions),
        example_index,
        offsets,
    )


def _answer_tokens(example: SquadExample, spans: np.ndarray) -> tuple[int, int] | None:
    """First and last context token covering the first answer's characters, or None."""
    located = locate_answer(example.context, example.answers[0], example.answer_starts[0])
    if located is None or len(spans) == 0:
        return None
    char_start, char_end = located
    # First token ending after the answer starts; last token starting before it ends.
    # (Token spans come in text order, so both columns are sorted.)
    first = int(np.searchsorted(spans[:, 1], char_start, side="right"))
    last = int(np.searchsorted(spans[:, 0], char_end, side="left")) - 1
    return (first, last) if first <= last else None


# ---------------------------------------------------------------- the bundle


def _subset(examples: list[SquadExample], size: int | None, seed: int) -> list[SquadExample]:
    if size is None:
        return examples
    # Sorted, so a paragraph's questions (and their features) stay together.
    return [examples[i] for i in sorted(subset_indices(len(examples), size, seed))]


def eval_extras(examples: Sequence[SquadExample], features: SquadFeatures) -> dict[str, Any]:
    """What post-processing and scoring need: per eval feature its question and offsets,
    per question its id, context and gold texts."""
    return {
        "feature_example_index": features.example_index,
        "feature_offsets": features.offsets,
        "examples": [
            {"id": e.id, "context": e.context, "answers": list(e.answers)} for e in examples
        ],
    }


def load_squad_bundle(config: DataConfig, model_name_or_path: str | None, seed: int) -> DataBundle:
    """SQuAD v1.1 as a question-answering DataBundle.

    `config.root`: a SQuAD v1.1 JSON file, a directory with train-v1.1.json and
    dev-v1.1.json, or None for `datasets`' "squad". `config.eval_root`, a SQuAD v1.1 JSON
    file, replaces the evaluation split wherever the training one comes from (how the
    offline mini files are used: train-mini as root, eval-mini as eval_root); a single
    file with no eval_root is used for BOTH training and evaluation, with a warning.
    `train_subset` / `eval_subset` keep that many questions (not features), chosen before
    tokenising.
    """
    check_window(config.max_seq_length, config.resolved_doc_stride)
    raw = load_squad_examples(config.root, config.eval_root)
    train = _subset(raw["train"], config.train_subset, seed)
    evaluation = _subset(raw["eval"], config.eval_subset, seed)
    encoder = _Encoder(choose_tokenizer(config, model_name_or_path, train))
    train_features = featurize(
        train, encoder, config.max_seq_length, config.resolved_doc_stride, with_offsets=False
    )
    eval_features = featurize(
        evaluation, encoder, config.max_seq_length, config.resolved_doc_stride
    )
    logger.info(
        "SQuAD: %d training questions -> %d features, %d eval questions -> %d features",
        len(train),
        len(train_features),
        len(evaluation),
        len(eval_features),
    )
    return DataBundle(
        train=_dataset(train_features, config),
        eval=_dataset(eval_features, config),
        task="question_answering",
        num_classes=2,
        vocab_size=len(encoder),
        max_seq_length=config.max_seq_length,
        eval_extras=eval_extras(evaluation, eval_features),
        subsets=subset_note(
            "questions",
            {
                "train": (config.train_subset, len(raw["train"])),
                "eval": (config.eval_subset, len(raw["eval"])),
            },
        ),
    )


def _dataset(features: SquadFeatures, config: DataConfig) -> TextSampleDataset:
    return TextSampleDataset(
        (features.input_ids, features.token_type_ids, features.attention_mask),
        features.positions,
        config.padding,
        config.pad_to_multiple_of,
    )
