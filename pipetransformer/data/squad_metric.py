"""SQuAD v1.1 scoring and the post-processing that turns span logits into answer text.

Owns: answer normalisation, exact match and F1 exactly as the official v1.1 evaluation
script defines them (max over the gold answers, averaged over every question, an
unanswered question scoring 0), and choosing each question's best span from the start/end
logits of all its features.
Must not: import torch, know about ranks or tokenizers. Inputs are plain arrays (numpy,
or anything `np.asarray` accepts, CPU tensors included) and lists; scores are fractions
in [0, 1], not the official script's percentages.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace
    (in the official script's order: punctuation goes before articles are matched)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
    """Harmonic mean of token precision and recall after normalisation."""
    prediction_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(ground_truth).split()
    num_same = sum((Counter(prediction_tokens) & Counter(truth_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_evaluate(
    gold: Mapping[str, Sequence[str]], predictions: Mapping[str, str]
) -> dict[str, float]:
    """{"exact_match", "f1"} as fractions, averaged over every question in `gold`.

    A question without a prediction scores 0 (and is counted); predictions for ids not in
    `gold` are ignored, as in the official script.
    """
    if not gold:
        raise ValueError("squad_evaluate: no gold questions to score")
    exact_match = f1 = 0.0
    unanswered = 0
    for question_id, answers in gold.items():
        if not answers:
            raise ValueError(f"squad_evaluate: question '{question_id}' has no gold answer")
        if question_id not in predictions:
            unanswered += 1
            continue
        prediction = predictions[question_id]
        exact_match += max(exact_match_score(prediction, answer) for answer in answers)
        f1 += max(f1_score(prediction, answer) for answer in answers)
    if unanswered:
        logger.warning("%d of %d questions have no prediction; they score 0", unanswered, len(gold))
    return {"exact_match": exact_match / len(gold), "f1": f1 / len(gold)}


def _offset_array(feature_offsets: Any, num_features: int, seq_length: int) -> np.ndarray:
    """(features, seq, 2) int64 with -1 for tokens outside the context.

    Accepts that array already, or per feature a list of (start, end) or None (the form
    transformers' run_qa example uses).
    """
    if isinstance(feature_offsets, np.ndarray) or hasattr(feature_offsets, "numpy"):
        offsets = np.asarray(feature_offsets, dtype=np.int64)
    else:
        offsets = np.full((num_features, seq_length, 2), -1, dtype=np.int64)
        for row, feature in enumerate(feature_offsets):
            for position, span in enumerate(feature):
                if span is not None:
                    offsets[row, position] = span
    if offsets.shape != (num_features, seq_length, 2):
        raise ValueError(
            f"feature offsets have shape {offsets.shape}, expected {(num_features, seq_length, 2)}"
        )
    return offsets


def postprocess_predictions(
    start_logits: Any,
    end_logits: Any,
    feature_example_index: Sequence[int] | np.ndarray,
    feature_offsets: Any,
    examples: Sequence[Mapping[str, Any]],
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """The best-scoring answer text of every example: {example id: context substring}.

    `start_logits` / `end_logits`: (features, seq). `feature_example_index[f]`: the
    position in `examples` (each with "id" and "context") of feature f's question.
    `feature_offsets[f][t]`: token t's (start, end) character span in the context, or
    None / -1 for question, special and padding tokens.

    Over all features of an example, the candidates are the `n_best_size` highest start and
    end logits among the context tokens, paired; spans that end before they start, are
    longer than `max_answer_length` tokens or are empty are skipped, and the pair with the
    highest start + end logit wins. (transformers' run_qa takes the top n over all tokens
    and drops non-context ones afterwards, which can leave an example with no candidate;
    taking them among context tokens only ever finds a better-or-equal valid span.) An
    example with no valid span at all gets "".
    """
    start = np.asarray(start_logits, dtype=np.float32)
    end = np.asarray(end_logits, dtype=np.float32)
    if start.ndim != 2 or start.shape != end.shape:
        raise ValueError(
            f"start/end logits must both be (features, seq), got {start.shape} and {end.shape}"
        )
    num_features, seq_length = start.shape
    example_index = np.asarray(feature_example_index, dtype=np.int64).reshape(-1)
    if example_index.shape[0] != num_features:
        raise ValueError(f"{example_index.shape[0]} example indices for {num_features} features")
    offsets = _offset_array(feature_offsets, num_features, seq_length)

    best_score = np.full(len(examples), -np.inf)
    best_span: list[tuple[int, int] | None] = [None] * len(examples)
    for feature in range(num_features):
        context_positions = np.flatnonzero(offsets[feature, :, 0] >= 0)
        if context_positions.size == 0:
            continue
        k = min(n_best_size, context_positions.size)
        # Stable sorts: equal logits resolve to the earlier token, the same on every run.
        starts = context_positions[
            np.argsort(-start[feature, context_positions], kind="stable")[:k]
        ]
        ends = context_positions[np.argsort(-end[feature, context_positions], kind="stable")[:k]]
        length = ends[None, :] - starts[:, None]
        char_starts = offsets[feature, starts, 0]
        char_ends = offsets[feature, ends, 1]
        valid = (
            (length >= 0)
            & (length < max_answer_length)
            & (char_ends[None, :] > char_starts[:, None])
        )
        if not valid.any():
            continue
        scores = np.where(
            valid, start[feature, starts][:, None] + end[feature, ends][None, :], -np.inf
        )
        i, j = np.unravel_index(int(np.argmax(scores)), scores.shape)
        example = int(example_index[feature])
        if scores[i, j] > best_score[example]:
            best_score[example] = scores[i, j]
            best_span[example] = (int(char_starts[i]), int(char_ends[j]))

    predictions = {}
    for example, span in zip(examples, best_span):
        predictions[example["id"]] = "" if span is None else example["context"][span[0] : span[1]]
    return predictions
