"""Step-level logging: steps.jsonl every trainer.log_interval_steps steps (and at each epoch's
end), the same values in TensorBoard and in Weights & Biases (offline mode)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_steps_reach_jsonl_tensorboard_and_wandb_offline(tmp_path):
    """Slow: ~16 s on 2 cores (a CLI run with TensorBoard and wandb offline)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetransformer",
            "train",
            str(ROOT / "configs" / "quickstart.yaml"),
            "trainer.epochs=2",
            "data.train_subset=256",
            "data.eval_subset=64",
            "trainer.log_interval_steps=3",
            "trainer.progress_bar=false",
            "logging.tensorboard=true",
            "logging.wandb=true",
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["global_step"] for s in steps] == [
        3,
        4,
        6,
        8,
    ]  # every 3 steps and each epoch's end (4 steps)
    for record in steps:
        assert {"loss", "lr", "samples_per_s", "num_frozen_layers", "pipe_len", "dp_degree"} <= set(
            record
        )
        assert record["loss"] > 0 and record["samples_per_s"] > 0
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("step/loss")]
    assert [step for step, _ in logged] == [s["global_step"] for s in steps]
    assert [value for _, value in logged] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    content = wandb_file.read_bytes()
    assert content.count(b"step/loss") >= len(steps) and content.count(b"epoch/train_loss") >= 2


def test_rank_zero_speaks_for_the_run_and_other_ranks_only_warn():
    import logging

    from pipetransformer.utils.logging import setup_logging

    logger = logging.getLogger("pipetransformer")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        for rank, level in (("0", logging.INFO), ("1", logging.WARNING), ("-", logging.INFO)):
            setup_logging(rank=rank)
            assert logger.level == level, rank
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


def test_the_closing_line_says_time_metric_freezing_layout_and_outputs():
    from pipetransformer.runs.records import RunSummary

    summary = RunSummary(
        training_time_s=234.4,
        attempts=1,
        final_eval_metric=0.9611,
        best_eval_metric=0.975,
        epochs=30,
        global_steps=690,
        num_transitions=2,
        final_num_frozen_layers=6,
        final_pipe_len=1,
        final_dp_degree=2,
        world_size=2,
        device="cpu",
        checkpoint="runs/q/checkpoints/step-00000690",
        metric_name="accuracy",
        num_layers=8,
    )
    line = summary.closing_line("runs/q", total_s=352.0)
    assert line.startswith("done: training 3 min 54 s, this command 5 min 52 s: ")
    assert "accuracy 96.11% final, 97.50% best; 6 of 8 layers frozen" in line
    assert "pipe_len 1 x dp_degree 2; outputs in runs/q/" in line
    # A resumed run states the same two clocks, training over its attempts first.
    resumed = dataclasses.replace(summary, training_time_s=57.2, attempts=2)
    assert resumed.closing_line("runs/q", total_s=31.0).startswith(
        "done: training 57 s over 2 attempts, this command 31 s: "
    )
    assert resumed.closing_line("runs/q").startswith("done: training 57 s over 2 attempts: ")
    # A 60-row run trains for under a second: its clock says so, not "training 0 s".
    short = dataclasses.replace(summary, training_time_s=0.42)
    assert short.closing_line("runs/q", total_s=9.2).startswith(
        "done: training 0.4 s, this command 9.2 s: "
    )
    # summary.json files of older formats still load, their format told by their keys
    # (runs/records.py, "Formats"): 1 named the clock wall_time_s, 2-3 counted evaluation
    # and checkpoints on it, 4 (written now) keeps them beside it.
    from pipetransformer.runs.records import SUMMARY_FORMAT, summary_format

    written = summary.to_dict()
    assert written["format_version"] == SUMMARY_FORMAT == 4
    older = {k: v for k, v in written.items() if k not in ("format_version", "eval_time_s")}
    first = {k: v for k, v in older.items() if k != "training_time_s"} | {"wall_time_s": 12.5}
    assert RunSummary.from_dict(first).training_time_s == 12.5
    assert RunSummary.from_dict(first).format_version == 1
    assert summary_format({k: v for k, v in older.items() if k != "freeze_decided_by"}) == 2
    assert summary_format(older) == 3 and RunSummary.from_dict(older).evaluation_on_the_clock
    assert not RunSummary.from_dict({**older, "eval_time_s": 1.0}).evaluation_on_the_clock


def test_a_run_that_froze_nothing_says_why():
    """The rule, the decisions it made and what held each at zero (freeze.py, "Who
    decided"), from the summary's counts; nothing of it where layers froze."""
    from pipetransformer.runs.records import RunSummary

    summary = RunSummary(
        training_time_s=40.0,
        attempts=1,
        final_eval_metric=0.8,
        best_eval_metric=0.8,
        epochs=3,
        global_steps=90,
        num_transitions=0,
        final_num_frozen_layers=0,
        final_pipe_len=1,
        final_dp_degree=2,
        world_size=2,
        device="cpu",
        checkpoint=None,
        metric_name="accuracy",
        num_layers=6,
        freeze_decisions=3,
        freeze_decided_by={"signal": 3},
        freeze_strategy="gradient_norm",
    )
    line = summary.closing_line("runs/own")
    assert (
        "0 of 6 layers frozen (gradient_norm: 3 decisions, none froze a layer: held by its "
        "signal 3; the smallest gradient norm was at layer 0, which Eq. 1 keeps active); "
    ) in line
    mixed = dataclasses.replace(
        summary, freeze_strategy="convergence", freeze_decided_by={"no_signal": 1, "signal": 2}
    )
    assert "held by its signal 2, nothing to read yet 1; layer 0's gradient norms" in (
        mixed.closing_line("runs/own")
    )
    capped = dataclasses.replace(summary, freeze_decided_by={"cap": 3})
    assert "held by freeze.max_frozen_layers 3)" in capped.closing_line("runs/own")
    waited = dataclasses.replace(summary, freeze_decisions=0, freeze_decided_by={})
    assert "(gradient_norm: no decision point in the run, where freeze.warmup_epochs" in (
        waited.closing_line("runs/own")
    )
    idle = dataclasses.replace(waited, freeze_idle=True)  # freeze.memory_aware as DDP
    assert "(freeze.memory_aware: no count of frozen layers changes a layout of one stage" in (
        idle.closing_line("runs/own")
    )
    baseline = dataclasses.replace(summary, freeze_strategy="none", freeze_decisions=0)
    assert "0 of 6 layers frozen (freeze.strategy none: nothing freezes);" in (
        baseline.closing_line("runs/own")
    )
    froze = dataclasses.replace(summary, final_num_frozen_layers=2)
    assert "2 of 6 layers frozen; pipe_len" in froze.closing_line("runs/own")


def test_colour_codes_stay_out_of_a_redirected_log():
    """transformers colours its loading report when stdout is a terminal and writes it to
    stderr: a log redirected to a file held raw escape codes."""
    import io
    import logging

    from transformers.utils import logging as transformers_logging

    from pipetransformer.utils.logging import plain_text_when_redirected

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    coloured = "\x1b[31mMISSING\x1b[0m\tclassifier.weight: %s"
    for stream, expected in ((io.StringIO(), "MISSING\t"), (Terminal(), "\x1b[31mMISSING")):
        logger = logging.getLogger(f"test-plain-{type(stream).__name__}")
        logger.addHandler(logging.StreamHandler(stream))
        logger.propagate = False
        plain_text_when_redirected(logger)
        plain_text_when_redirected(logger)  # once per handler
        logger.warning(coloured, "newly initialized")
        assert stream.getvalue().startswith(expected)
        assert stream.getvalue().endswith("classifier.weight: newly initialized\n")
        assert len(logger.handlers[0].filters) == 1
    # What loading a pretrained BERT installs on transformers' own handler.
    root = transformers_logging.get_logger()
    plain_text_when_redirected(root)
    assert all(handler.filters for handler in root.handlers)
