"""SQuAD v1.1's official metric (data/squad_metric.py) by hand: normalisation, exact match,
F1 and the maximum over a question's gold answers."""

import pytest

from pipetransformer.data.squad_metric import (
    exact_match_score,
    f1_score,
    normalize_answer,
    squad_evaluate,
)


def test_normalize_answer_follows_the_official_definition():
    assert normalize_answer("  The   Denver\tBroncos!! ") == "denver broncos"
    assert normalize_answer("an apple, a pear and the plum") == "apple pear and plum"
    # Articles only as whole words; punctuation goes first, so "U.S." becomes "us".
    assert normalize_answer("Theatre of U.S. anthems") == "theatre of us anthems"
    assert normalize_answer("a-the") == "athe"  # '-' removed before articles are matched


def test_exact_match_and_f1_by_hand():
    assert exact_match_score("the Denver Broncos", "Denver Broncos.") == 1.0
    assert exact_match_score("Denver", "Denver Broncos") == 0.0
    # Prediction 3 tokens, gold 2 (after "the" goes), 2 in common: P=2/3, R=1, F1=0.8.
    assert f1_score("Denver Broncos won", "the Denver Broncos") == pytest.approx(0.8)
    # Repeated tokens count once per occurrence in both (multiset overlap): P=1/2, R=1.
    assert f1_score("blue blue", "blue") == pytest.approx(2 / 3)
    assert f1_score("nothing shared", "Denver") == 0.0
    assert f1_score("", "Denver") == 0.0
    # The official quirk: answers that normalise to nothing match exactly but have F1 0.
    assert exact_match_score("a", "The") == 1.0 and f1_score("a", "The") == 0.0


def test_squad_evaluate_takes_the_max_over_gold_answers_and_counts_unanswered_as_zero():
    gold = {"q1": ["Denver Broncos", "The Broncos"], "q2": ["1998"], "q3": ["blue whale"]}
    predictions = {"q1": "broncos", "q2": "in 1998.", "not-a-question": "ignored"}
    scores = squad_evaluate(gold, predictions)
    # q1: EM 1 and F1 1 against "The Broncos"; q2: EM 0, F1 2/3; q3 unanswered: 0 and 0.
    assert scores["exact_match"] == pytest.approx(1 / 3)
    assert scores["f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert squad_evaluate({"q": ["x"]}, {"q": "X"}) == {"exact_match": 1.0, "f1": 1.0}
    with pytest.raises(ValueError):
        squad_evaluate({}, {})
