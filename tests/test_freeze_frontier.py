"""benchmarks/freeze_frontier.py without training: the runs it plans (DDP at every budget,
candidates at their epochs, warm-ups fitted), the commands (scored on SST-2's dev split,
no phrase held out of the training split), and its tables from faked run records (time-to-
accuracy against DDP's curve, the same-epoch pairing, who decided, the rotated order)."""

import argparse
import json
import sys
from pathlib import Path

import pytest
from test_compare_budgets import _fake_run

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import freeze_frontier as frontier  # noqa: E402


def test_planned_runs_commands_and_fitted_warmups(tmp_path):
    runs = frontier.planned_runs([1, 2, 3], ["eq1_epoch_emb", "autofreeze@2"], 3)
    assert [r.name for r in runs] == [
        "ddp_1ep",
        "ddp_2ep",
        "ddp_3ep",
        "eq1_epoch_emb_3ep",
        "autofreeze_2ep",
    ]
    overrides = frontier.run_overrides(runs[-1], 3)
    assert overrides[-2:] == ["trainer.epochs=2", "optimizer.warmup_steps=7"]
    assert "freeze.strategy=autofreeze" in overrides and "freeze.embedding=false" in overrides
    assert frontier.run_overrides(runs[0], 3)[-1] == "optimizer.warmup_steps=3"
    args = argparse.Namespace(tiny=True, train=128, epochs=3)
    common = frontier.common_overrides(args)
    # Scored on the dev split: nothing is held out of SST-2's training phrases.
    assert not any(o.startswith("data.holdout") for o in common)
    assert "cache.enabled=true" in common
    command = frontier.command(runs[3], 4, common, tmp_path / "run", 3)
    assert command[1:4] == ["-m", "pipetransformer", "train"]
    assert "trainer.seed=4" in command and command[-3:] == [
        "--run-dir",
        str(tmp_path / "run"),
        "--overwrite",
    ]
    with pytest.raises(SystemExit):
        frontier.planned_runs([1], ["nope"], 3)
    with pytest.raises(SystemExit):
        frontier.planned_runs([3], ["eq1_epoch_emb", "eq1_epoch_emb@3"], 3)


def test_the_tables_come_from_the_records(tmp_path):
    runs = frontier.planned_runs([1, 2, 3], ["eq1_epoch_emb"], 3)
    for seed in (0, 1):
        names = frontier.rotated_order([r.name for r in runs], seed)
        (tmp_path / f"seed-{seed}").mkdir()
        (tmp_path / f"seed-{seed}" / "order.json").write_text(json.dumps({"order": names}))
        for run in runs:
            run_dir = tmp_path / f"seed-{seed}" / run.name
            variant = "elastic" if run.variant != "ddp" else "ddp"  # the fake's full system
            _fake_run(run_dir, variant, run.epochs, seed, 0)
            bench = {"cpu_s": 10.0 * run.epochs, "command_wall_s": 10.0, "other_cpu_s": 0.0}
            bench.update(load_1min_before=1.0, load_1min_after=1.0)
            (run_dir / "bench.json").write_text(json.dumps(bench))
    results, records, found = frontier.collect(tmp_path, [0, 1], runs, 0.5)
    rows = {row["run"]: row for row in results["rows"]}
    candidate = rows["eq1_epoch_emb_3ep"]
    # The fake: DDP 10 s an epoch from 0.75 by 5 points; the candidate 18 s to 0.82/0.83.
    assert candidate["against_curve"]["time_to_accuracy"]["mean"] == pytest.approx(
        (24 / 18 * 26 / 18) ** 0.5
    )
    assert candidate["vs_ddp_same_epochs"]["speedup_mean"] == pytest.approx(30 / 18)
    assert candidate["vs_ddp_same_epochs"]["metric_difference_points"]["mean"] == pytest.approx(
        -2.5
    )
    assert candidate["cpu_s_ratio_vs_ddp_same_epochs"] == pytest.approx(1.0)
    assert candidate["frozen_by_epoch"] == [(0, 2, 4)]
    assert results["order"]["1"][0] == "ddp_2ep"
    assert len(results["runs"]) == 8 and results["runs"][0]["harness"]["cpu_s"] == 10.0
    text = frontier.tables(results)
    assert "| Eq. 1 (gradient_norm), alpha 1/3, at epoch ends, embedding frozen" in text
    assert "| DDP (no freezing), schedule fitted to its epochs, 2 epochs | 2 | 20 ± 0 |" in text
    assert "Who set the frozen layer count" in text and "| 2 | 4 | 0 | 0 | 4 |" in text
