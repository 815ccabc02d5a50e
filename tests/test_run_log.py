"""What a run says while it runs: at its start one line of what it read from the data
(columns, task, label names with counts, split sizes, where evaluation comes from), and
in a log that is not a terminal the progress bar's progress as a line at the step log, at
most one every trainer.progress_interval_s."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import run_workers
from workers import logged_run

from pipetransformer.config import ConfigError, DataConfig, load_config
from pipetransformer.data import build_data
from pipetransformer.data.describe import describe_bundle
from pipetransformer.runs.records import StepMetrics
from pipetransformer.runs.reporting import Reporter

ROOT = Path(__file__).resolve().parent.parent


def reviews_csv(path: Path, n: int, seed: int = 0) -> tuple[Path, list[str]]:
    """A CSV with its own column names (review, stars) and string labels."""
    rng = random.Random(seed)
    labels = [rng.choice(["good", "bad", "bad"]) for _ in range(n)]
    rows = [f"a {label} film number {i},{label}" for i, label in enumerate(labels)]
    path.write_text("review,stars\n" + "\n".join(rows) + "\n")
    return path, labels


def test_the_data_line_names_columns_labels_with_counts_sizes_and_the_eval_source(tmp_path):
    path, labels = reviews_csv(tmp_path / "reviews.csv", 40)
    config = DataConfig(name="hf", path=str(path), text_columns="review", label_column="stars")
    bundle = build_data(config, seed=0)
    line = describe_bundle(bundle)
    counts = bundle.train.targets(range(len(bundle.train))).bincount().tolist()
    assert line == (
        f"text column 'review', label column 'stars' of {path}; evaluation: 4 rows held out "
        "of the training split (data.eval_share 0.1, one fixed draw); classification, "
        f"2 labels: bad {counts[0]}, good {counts[1]}; 36 training samples, 4 evaluation samples"
    )
    assert counts[0] + counts[1] == 36 and counts[0] > counts[1]  # two bad in three drawn
    dev, _ = reviews_csv(tmp_path / "dev.csv", 8, seed=1)
    split = DataConfig(
        name="hf",
        path="csv",
        data_files={"train": str(path), "validation": str(dev)},
        text_columns="review",
        label_column="stars",
        train_subset=20,
    )
    line = describe_bundle(build_data(split, seed=0))
    assert f"evaluation: split 'validation' ({dev})" in line
    # After the subset, and what it was taken from (the SST-2 config's 8,000 capped one's own
    # data unsaid).
    assert line.endswith(
        "; 20 training samples, 8 evaluation samples; data.train_subset: 20 of 40 training rows"
    )
    # Classes without names (the digits' ids here), counted the same way; a thousand are
    # only counted.
    digits = build_data(DataConfig(name="digits", image_size=8), seed=0)
    line = describe_bundle(digits)
    listed = line.split("10 labels: ")[1].split(";")[0].split(", ")
    assert [item.split()[0] for item in listed] == [str(c) for c in range(10)]
    assert sum(int(item.split()[1]) for item in listed) == len(digits.train) == 1437
    synthetic = DataConfig(name="synthetic", image_size=8, train_subset=10, eval_subset=4)
    assert describe_bundle(build_data(synthetic, seed=0)).startswith("classification, 1000 labels;")


def step(loss: float = 0.5) -> StepMetrics:
    return StepMetrics(
        global_step=1,
        epoch=1,
        loss=loss,
        lr=0.1,
        samples_per_s=200.0,
        num_frozen_layers=2,
        pipe_len=2,
        dp_degree=1,
    )


def test_progress_lines_at_the_step_log_at_most_one_an_interval(tmp_path, caplog, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    now = [100.0]
    reporter = Reporter(tmp_path, True, True, False, progress_interval_s=30.0, clock=lambda: now[0])
    assert reporter.progress_lines and not reporter.progress_bar
    reporter.start_epoch(0, 3, 100)
    lines = []
    with caplog.at_level("INFO", logger="pipetransformer.runs.reporting"):
        for index in range(1, 101):
            now[0] += 1.0  # a step a second
            reporter.step()
            if index % 10 == 0:  # the step log
                caplog.clear()
                reporter.log_step(step())
                lines += [r.getMessage() for r in caplog.records]
    # Steps 30, 60 and 90: the first step logs 30 s apart; none at the epoch's end.
    assert lines == [
        "epoch 1/3: step 30/100 (30%), about 1:10 left; loss 0.5000, 200.0 samples/s, "
        "frozen 2, pipe_len 2, dp_degree 1",
        "epoch 1/3: step 60/100 (60%), about 0:40 left; loss 0.5000, 200.0 samples/s, "
        "frozen 2, pipe_len 2, dp_degree 1",
        "epoch 1/3: step 90/100 (90%), about 0:10 left; loss 0.5000, 200.0 samples/s, "
        "frozen 2, pipe_len 2, dp_degree 1",
    ]
    # On a terminal the bar shows it; trainer.progress_bar=false shows neither.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert not Reporter(tmp_path, True, True, False).progress_lines
    assert not Reporter(tmp_path, True, False, False).progress_lines
    with pytest.raises(ConfigError, match="trainer.progress_interval_s"):
        load_config(str(ROOT / "configs" / "quickstart.yaml"), ["trainer.progress_interval_s=-1"])


@pytest.mark.distributed
def test_rank_zero_logs_what_it_read_and_its_progress(tmp_path):
    """2 ranks, a tiny BERT on a CSV of its own column names: rank 0's log opens with the
    data line and has a progress line at each step log but the epoch's last (interval 0);
    rank 1 says neither."""
    path, _ = reviews_csv(tmp_path / "reviews.csv", 48)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {
        "trainer": {
            "epochs": 1,
            "global_batch_size": 8,
            "nproc_per_node": 2,
            "log_interval_steps": 2,
            "progress_interval_s": 0,
        },
        "pipeline": {"initial_pipe_len": 1, "sharding": "never"},
        "freeze": {"strategy": "none"},
        "cache": {"enabled": False},
        "model": {
            "name": "bert",
            "kwargs": {
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 64,
            },
        },
        "data": {
            "name": "hf",
            "path": str(path),
            "text_columns": "review",
            "label_column": "stars",
            "max_seq_length": 16,
        },
    }
    run_workers(logged_run, 2, config, str(run_dir))
    log = (run_dir / "rank0.log").read_text().splitlines()
    (data,) = [line for line in log if line.startswith("pipetransformer.trainer.trainer: data: ")]
    assert "text column 'review', label column 'stars'" in data and "2 labels: bad " in data
    assert data.endswith("43 training samples, 5 evaluation samples")
    progress = [line for line in log if ": epoch 1/1: step " in line]
    assert [line.split("step ")[1].split(" ")[0] for line in progress] == ["2/6", "4/6"]
    assert (run_dir / "rank1.log").read_text() == ""


@pytest.fixture
def transformers_records():
    """What transformers logs (at its default verbosity, warnings), collected."""
    import logging

    from transformers.utils import logging as transformers_logging

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    root = transformers_logging.get_logger("transformers")
    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_warning()
    collect = Collect()
    root.addHandler(collect)
    yield collect.records
    root.removeHandler(collect)
    transformers_logging.set_verbosity(level)


def test_a_new_head_is_one_line_of_ours_and_anything_else_keeps_the_load_report(
    tmp_path, caplog, transformers_records
):
    """transformers' LOAD REPORT table, which a user reads as an error, is one line when all
    it says is that the classifier is new; unexpected or missing encoder weights keep it."""
    import transformers

    from pipetransformer.config import ModelConfig
    from pipetransformer.models.text_models import create_text_model

    small = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertModel(small).save_pretrained(tmp_path / "encoder")  # no head
    transformers.BertForMaskedLM(small).save_pretrained(tmp_path / "masked_lm")  # another

    def load(name: str) -> list[str]:
        caplog.clear()
        transformers_records.clear()
        config = ModelConfig(name="bert", model_name_or_path=str(tmp_path / name))
        with caplog.at_level("INFO", logger="pipetransformer"):
            create_text_model(config, task="classification", num_labels=3, vocab_size=None)
        return [r.getMessage() for r in caplog.records if r.name.startswith("pipetransformer")]

    ours = load("encoder")
    assert [m for m in ours if m.startswith("new head: ")] == [
        f"new head: classifier.weight, classifier.bias (not in {tmp_path / 'encoder'}: "
        "trained from random weights)"
    ]
    assert not [r for r in transformers_records if "LOAD REPORT" in r.getMessage()]
    ours = load("masked_lm")  # unexpected cls.* weights, no pooler: transformers' table
    assert not [m for m in ours if m.startswith("new head: ")]
    (report,) = [r.getMessage() for r in transformers_records if "LOAD REPORT" in r.getMessage()]
    assert "UNEXPECTED" in report and "classifier.weight" in report
