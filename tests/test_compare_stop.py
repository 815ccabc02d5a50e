"""compare stopped by SIGINT or SIGTERM: one line (what stopped, where its checkpoint is,
the same command to resume), exit 130 / 143, no traceback; the rerun resumes the stopped
variant from its checkpoint and says so. The report records that command shell-quoted
with --out, when each variant ran and under what load, and what its efficiency means."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
from pathlib import Path

import pytest
from helpers import TINY_QUICKSTART, run_cli
from test_checkpoint import start_cli, wait_for_checkpoint
from test_compare import fake_run
from test_failures import cli

import pipetransformer.compare.execute as execute
import pipetransformer.compare.outputs as outputs
import pipetransformer.compare.runner as runner
from pipetransformer.compare.report import EFFICIENCY_MEANING
from pipetransformer.launcher import LaunchInterrupted
from pipetransformer.runs.checkpoint import find_checkpoint
from pipetransformer.utils.stopping import RunStopped

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
# A list with a space in it: the recorded command must quote it for a shell.
ARGS = ["compare", QUICKSTART, "freeze.strategy=manual", "freeze.manual_schedule=[3, 5]"]
FINISHED = {  # what each variant's fake run reached: (metric, frozen, pipe_len, dp, samples/s)
    "baseline": [(0.5, 0, 2, 1, 100.0), (0.9, 0, 2, 1, 99.0)],
    "elastic": [(0.5, 0, 2, 1, 100.0), (0.89, 3, 1, 2, 170.0)],
}


def finish(run_dir: Path, staging: Path) -> None:
    """Leave in `run_dir` what a finished run of its variant writes."""
    name = run_dir.name
    fake_run(staging / name, {"baseline": 30.0, "elastic": 20.0}[name], FINISHED[name])
    for path in (staging / name).iterdir():
        shutil.copy(path, run_dir / path.name)


def stopped_line(returncode: int, stderr: str, code: int) -> str:
    """The last line of a stopped compare, checked: the exit code, no traceback, the form."""
    assert returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("pipetransformer compare: ") and ". Resume with: " in last, last
    return last


def test_a_stopped_compare_is_one_line_and_the_rerun_resumes_from_the_checkpoint(
    tmp_path, monkeypatch, elastic_full_run
):
    out = tmp_path / "cmp"
    launched: list[tuple[str, str]] = []

    def launch(nproc, fn, arguments, context=None):
        config, run_dir, options = arguments
        launched.append((run_dir.name, options.prepared_checkpoint))
        if len(launched) == 1:  # the workers wrote a checkpoint and stopped
            stop = RunStopped(signal.SIGINT, 3, 0, 3, str(run_dir / "checkpoints" / "step-3"))
            raise LaunchInterrupted(signal.SIGINT, stop)
        finish(run_dir, tmp_path / "staging")
        return [None] * nproc

    monkeypatch.setattr(execute, "launch_local", launch)
    monkeypatch.setattr(
        outputs, "measured_unit_costs", lambda config: {"trained": [3.0] * 18, "frozen": [1.0] * 18}
    )
    result = run_cli(*ARGS, "--out", str(out))
    last = stopped_line(result.returncode, result.stderr, 130)
    assert "[1/2] baseline" in last and "stopped by SIGINT at epoch 1, step 3" in last
    assert f"checkpoint {out / 'baseline' / 'checkpoints' / 'step-3'}" in last
    command = last.split(". Resume with: ", 1)[1]
    assert shlex.split(command) == ["pipetransformer", *ARGS, "--out", str(out)]
    attempts = json.loads((out / "baseline" / "attempts.json").read_text())
    assert [a["outcome"] for a in attempts] == ["stopped"]

    # The stopped run's checkpoint, as the workers left it (a real run's, without its end).
    shutil.copytree(elastic_full_run.run_dir, out / "baseline", dirs_exist_ok=True)
    (out / "baseline" / "summary.json").unlink()
    checkpoint = find_checkpoint(out / "baseline")
    again = run_cli(*shlex.split(command)[1:])
    assert again.returncode == 0, again.stderr[-3000:]
    assert launched[1:] == [("baseline", str(checkpoint)), ("elastic", "")]
    assert f"baseline (Pipe + DDP, no freezing): resuming from {checkpoint}" in again.stderr
    attempts = json.loads((out / "baseline" / "attempts.json").read_text())
    assert [a["outcome"] for a in attempts] == ["stopped", "finished"]
    assert attempts[0]["started"] <= attempts[1]["started"] and attempts[1]["cores"] >= 1

    results = json.loads((out / "results.json").read_text())
    assert results["command"] == command  # shell-quoted, with --out
    assert results["variants"]["baseline"]["training_time_s"] == 30.0
    report = (out / "report.md").read_text()
    assert f"Command: `{command}`" in report
    assert "| variant | training time (s) |" in report and "wall time" not in report
    assert EFFICIENCY_MEANING in report and "above 1" in EFFICIENCY_MEANING
    assert "## When each variant ran" in report
    (baseline_row,) = [
        line for line in report.splitlines() if line.startswith("| baseline (") and " load " in line
    ]
    assert "(stopped); then " in baseline_row and " on " in baseline_row
    assert "training_time_s 30.0" in again.stderr  # the console says what the report does


def test_a_signal_between_runs_is_one_line_too(tmp_path, monkeypatch):
    """SIGTERM while no run is going (here: as the second variant's config loads): exit 143,
    one line, the finished run kept."""
    out = tmp_path / "cmp"
    loads = []

    def launch(nproc, fn, arguments, context=None):
        finish(arguments[1], tmp_path / "staging")
        return [None] * nproc

    def load_config(*args, **kwargs):
        loads.append(args)
        if len(loads) == 2:
            signal.raise_signal(signal.SIGTERM)
        return real_load(*args, **kwargs)

    real_load = runner.load_config
    monkeypatch.setattr(execute, "launch_local", launch)
    monkeypatch.setattr(runner, "load_config", load_config)
    result = run_cli(*ARGS, "--out", str(out))
    last = stopped_line(result.returncode, result.stderr, 143)
    assert f"stopped by SIGTERM between runs; the finished ones are kept in {out}" in last
    assert (out / "baseline" / "summary.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


@pytest.mark.slow
def test_ctrl_c_on_a_real_compare_then_the_same_command_resumes_it(tmp_path):
    """Slow: 1-2 min on 2 cores (a real compare of a tiny quickstart, stopped by SIGINT in its
    baseline, then the printed command finishing it)."""
    out = tmp_path / "cmp"
    args = ["compare", QUICKSTART, *TINY_QUICKSTART, "--out", str(out)]
    process = start_cli(args)
    wait_for_checkpoint(out / "baseline", 1, process)  # epoch 1's
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    last = stopped_line(process.returncode, stderr, 130)
    assert "baseline" in last and "stopped by SIGINT" in last
    checkpoint = find_checkpoint(out / "baseline")
    assert f"checkpoint {checkpoint}" in last
    command = shlex.split(last.split(". Resume with: ", 1)[1])
    assert command == ["pipetransformer", *args]
    finished = cli(*command[1:], timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"resuming from {checkpoint}" in finished.stderr
    summary = json.loads((out / "baseline" / "summary.json").read_text())
    assert summary["attempts"] == 2
    metrics = (out / "baseline" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in metrics] == [1, 2]
    assert (out / "report.md").is_file()
