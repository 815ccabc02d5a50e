"""The shipped configs that run on a CPU learn as shipped, on their local data: only the
length of the run is cut (epochs, subsets), every other setting is the file's. The full
length (bert_sst2_local.yaml reaching 70% on SST-2's dev sentences) is a measurement, not a
test: docs/benchmarks.md section 19 gives its command. That no shipped config freezes a
random embedding from the first step is checked without a run in test_config.py."""

import json
from pathlib import Path

import pytest
from helpers import ROOT, train_offline

CONFIGS = ROOT / "configs"


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.slow
def test_bert_sst2_local_learns_sst2(tmp_path, shared_data):
    """Slow: ~35-70 s on 2 loaded cores (2 of its 3 epochs of 8,000 SST-2 sentences, as
    shipped otherwise). With the embedding frozen on its random weights (what the config
    said before freeze.embedding: auto) the same run stayed at the majority class, 50.9%."""
    _, metrics = train_offline(
        str(CONFIGS / "bert_sst2_local.yaml"),
        tmp_path,
        f"data.root={shared_data / 'sst2'}",
        "trainer.epochs=2",
    )
    assert metrics[-1]["eval_metric"] >= 0.65  # dev: 51% is the majority class
    assert metrics[-1]["train_loss"] < 0.9 * metrics[0]["train_loss"]


@pytest.mark.slow
def test_bert_squad_local_learns_its_spans(tmp_path, shared_data):
    """Slow: ~35 s on 2 loaded cores (the config as shipped: 2 epochs of 128 windows of
    the real mini SQuAD, 12 steps). The tiny random BERT does not answer questions in 12
    steps (its comment says so; F1 stays below 0.1): what it shows is that the span loss
    falls (4.50 over the first 6 steps, 4.37 over the last 2, seed 0)."""
    squad = shared_data / "squad"
    _, metrics = train_offline(
        str(CONFIGS / "bert_squad_local.yaml"),
        tmp_path,
        f"data.root={squad / 'train-mini-v1.1.json'}",
        f"data.eval_root={squad / 'eval-mini-v1.1.json'}",
    )
    steps = losses(tmp_path)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    assert steps[-1] < 0.98 * steps[0]


@pytest.mark.slow
def test_quickstart_learns_digits(tmp_path):
    """Slow: ~40 s on 2 loaded cores (4 of its 30 epochs of the digits; no decision yet:
    the config waits 18 epochs before freezing). 10% is chance; it reached 36% (seed 0)."""
    _, metrics = train_offline(str(CONFIGS / "quickstart.yaml"), tmp_path, "trainer.epochs=4")
    assert metrics[-1]["eval_metric"] >= 0.25
    assert metrics[-1]["train_loss"] < 0.9 * metrics[0]["train_loss"]  # 2.29 -> 1.86
