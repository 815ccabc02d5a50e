"""Step-level logging: steps.jsonl every trainer.log_interval_steps steps (and at each epoch's
end), the same values in TensorBoard and in Weights & Biases (offline mode)."""

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
