"""Checkpoints, resume, crash restarts and clean stops.

Exactness: a run resumed at the same world size continues bit for bit as the uninterrupted
run would have (same layout, micro-batches, data order, optimizer state and random
streams): per-step losses and final parameters agree to 1e-6. Resumed at another world
size the layout changes, so it is held to the elastic tests' tolerances against
single-process training (1e-5 on losses, rtol 1e-4 / atol 1e-5 on parameters).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import run_workers
from reference import elastic_config, reference_run, step_losses
from workers import checkpoint_killed_half_way, elastic_run, start_in_run_dir

from pipetransformer.autodp.control import Control
from pipetransformer.config import CheckpointConfig, config_from_dict
from pipetransformer.launcher import WorkerFailed
from pipetransformer.runs.checkpoint import Checkpointer, complete_checkpoints, find_checkpoint
from pipetransformer.runs.rundir import RunDirError, RunOptions, prepare_run_dir
from pipetransformer.trainer.clock import Tick

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
RESUME = RunOptions(resume="required")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in records(run_dir / "events.jsonl") if e["kind"] == kind]


def continue_from(run_dir: Path, into: Path, step: int) -> None:
    """A copy of `run_dir` as a run interrupted after its checkpoint at `step` would leave it."""
    shutil.copytree(run_dir, into)
    for path in complete_checkpoints(into):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    (into / "checkpoints" / "latest").write_text(f"step-{step:08d}\n")


# ---------------------------------------------------------------- without processes


def test_find_checkpoint_ignores_incomplete_writes(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (3, 6):
        (root / f"step-{step:08d}").mkdir(parents=True)
        (root / f"step-{step:08d}" / ".metadata").write_bytes(b"m")
        (root / f"step-{step:08d}" / "run_state.json").write_text("{}")
    # A write that died before its rename, and one that died before run_state.json.
    (root / ".tmp-step-00000009").mkdir()
    (root / "step-00000012").mkdir()
    (root / "step-00000012" / ".metadata").write_bytes(b"m")
    (root / "latest").write_text("step-00000012\n")  # a pointer to something incomplete
    assert find_checkpoint(tmp_path) == root / "step-00000006"
    assert find_checkpoint(tmp_path, "best") is None
    assert prepare_run_dir(tmp_path, resume="auto", overwrite=False) == root / "step-00000006"
    assert not (root / ".tmp-step-00000009").exists()  # leftovers of the interrupted write go


def test_checkpoint_cadence():
    def tick(step: int, epochs: int = 3) -> Tick:  # 7 steps an epoch
        return Tick((step - 1) // 7, (step - 1) % 7, step, steps_per_epoch=7, epochs=epochs)

    ckpt = Checkpointer(
        CheckpointConfig(interval_epochs=2, interval_steps=5), Path("/nonexistent"), Control(None)
    )
    due = [s for s in range(1, 22) if ckpt.due(tick(s))]
    assert due == [5, 10, 14, 15, 20]  # every 5 steps, and at the end of epoch 2 (step 14)
    ckpt.last_step = 10
    assert not ckpt.due(tick(10))  # written already
    # For an export: also after the last step, whatever the interval.
    final = Checkpointer(
        CheckpointConfig(interval_epochs=0), Path("/nonexistent"), Control(None), save_final=True
    )
    assert [s for s in range(1, 22) if final.due(tick(s))] == [21]


class _Weights:
    """A stateful of one tensor and one plain value."""

    def __init__(self) -> None:
        self.weight = torch.arange(1000.0)

    def state_dict(self) -> dict:
        return {"model/weight": self.weight, "note": "kept"}

    def load_state_dict(self, state_dict: dict) -> None:
        self.weight = state_dict["model/weight"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["dcp", "rank0"])
def test_a_full_disk_is_one_line_naming_errno_path_and_the_checkpoint_kept(
    tmp_path, monkeypatch, where
):
    """A full disk once stopped a run with `CheckpointException ranks:dict_keys([0, 1])`:
    the cause, the path and the checkpoint left to resume from all went unsaid. ENOSPC while
    DCP writes a tensor file (every rank learns it) or while rank 0 writes run_state.json."""
    import errno

    from pipetransformer.runs import checkpoint as checkpoint_module
    from pipetransformer.runs.checkpoint import CheckpointWriteError

    ckpt = Checkpointer(CheckpointConfig(), tmp_path, Control(None))
    kept = ckpt.save(3, {"model": _Weights()}, "epoch", None).path
    real_fsync = os.fsync

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x" / "file"))

    if where == "dcp":  # DCP fsyncs every file it writes (sync_files=True)
        monkeypatch.setattr(os, "fsync", full)
    else:
        monkeypatch.setattr(checkpoint_module, "write_json_atomic", full)
    with pytest.raises(CheckpointWriteError) as error:
        ckpt.save(6, {"model": _Weights()}, "epoch", None)
    monkeypatch.setattr(os, "fsync", real_fsync)
    message = str(error.value)
    assert "\n" not in message and "No space left on device (ENOSPC)" in message
    assert str(tmp_path / "x" / "file") in message and f"{kept}, is intact" in message
    assert find_checkpoint(tmp_path) == kept  # the failed write left nothing half-done
    assert not (tmp_path / "checkpoints" / ".tmp-step-00000006").exists()
    # The command line's failure line ends with the command that resumes from it.
    from pipetransformer.cli.commands import _resume_hint

    assert _resume_hint(tmp_path, "pipetransformer train C --resume R") == (
        ". Resume with: pipetransformer train C --resume R"
    )


def test_a_used_run_directory_is_refused_and_left_untouched(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')
    with pytest.raises(RunDirError, match="already holds a run"):
        prepare_run_dir(tmp_path, resume="never", overwrite=False)
    with pytest.raises(RunDirError, match="no complete checkpoint"):
        prepare_run_dir(tmp_path, resume="required", overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
    (tmp_path / "notes.txt").write_text("mine")
    assert prepare_run_dir(tmp_path, resume="never", overwrite=True) is None
    assert (
        not (tmp_path / "metrics.jsonl").exists() and (tmp_path / "notes.txt").read_text() == "mine"
    )


def _mid_epoch_checkpoint(run_dir: Path, config, step_in_epoch: int) -> Path:
    """A run directory holding one complete checkpoint of `config` (no tensors: what a
    resume reads before any worker starts) at `step_in_epoch` of epoch 2."""
    from pipetransformer.runs.state import CheckpointRecord, ModelRecord, RunState

    checkpoint = run_dir / "checkpoints" / "step-00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").write_bytes(b"m")
    state = RunState(epoch=1, step_in_epoch=step_in_epoch, global_step=10)
    record = CheckpointRecord(state, config.to_dict(), ModelRecord([], [], {}))
    (checkpoint / "run_state.json").write_text(json.dumps(record.to_dict()))
    (run_dir / "checkpoints" / "latest").write_text("step-00000010\n")
    return checkpoint


def test_a_resume_refuses_a_new_length_grouping_or_padding_inside_an_epoch(tmp_path, sst2_dir):
    """The epoch's order is cut at the checkpoint's sample offset: grouped anew, some samples
    would repeat and others be skipped. Refused in one line naming the key, before any
    worker starts; at an epoch boundary, and for any other setting, a resume goes on."""
    from helpers import run_cli

    from pipetransformer.config import ConfigError, load_config
    from pipetransformer.runs.resume import refuse_mid_epoch_changes
    from pipetransformer.runs.state import RunState

    config_path = str(ROOT / "configs" / "bert_sst2_local.yaml")
    base = [f"data.root={sst2_dir}", "data.train_subset=null"]
    trained = load_config(config_path, base)
    mid, boundary = RunState(epoch=1, step_in_epoch=3), RunState(epoch=2, step_in_epoch=0)
    for key, value in (("data.group_by_length", "true"), ("data.padding", "max_length")):
        changed = load_config(config_path, [*base, f"{key}={value}"])
        with pytest.raises(ConfigError, match=f"^{key}: .* in the middle of an epoch"):
            refuse_mid_epoch_changes(trained.to_dict(), changed, mid, tmp_path)
        refuse_mid_epoch_changes(trained.to_dict(), changed, boundary, tmp_path)  # allowed
    longer = load_config(config_path, [*base, "trainer.epochs=4"])
    refuse_mid_epoch_changes(trained.to_dict(), longer, mid, tmp_path)  # said, not refused
    images = load_config(QUICKSTART)  # padding means nothing to images
    refuse_mid_epoch_changes(
        images.to_dict(), load_config(QUICKSTART, ["data.padding=max_length"]), mid, tmp_path
    )

    run_dir = tmp_path / "run"
    checkpoint = _mid_epoch_checkpoint(run_dir, trained, step_in_epoch=3)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    result = run_cli(
        "train", config_path, *base, "data.group_by_length=true", "--resume", str(run_dir)
    )
    assert result.returncode == 2 and "training on" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("pipetransformer: config error: data.group_by_length: False -> True")
    assert f"{checkpoint} is at step 3 of epoch 2" in line
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


# ---------------------------------------------------------------- distributed, in process


@pytest.mark.distributed
def test_a_restart_counted_by_one_torchrun_agent_is_a_restart_for_every_rank(tmp_path):
    """Across torchrun nodes only the agent whose workers failed counts the restart; rank 0's
    may not have. The run is still a restart: its directory is not refused, and the command
    line's --overwrite (repeated by torchrun) does not wipe the run."""
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / ".run_id").write_text("job-7\n")
    results = run_workers(start_in_run_dir, 2, str(tmp_path), [1], "job-7")
    assert results == [None, None]  # its attempt died before a checkpoint: it starts over
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # Another job's directory is still refused, whoever restarted.
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')
    (tmp_path / ".run_id").write_text("job-6\n")
    results = run_workers(start_in_run_dir, 2, str(tmp_path), [1], "job-7")
    assert all("already holds a run" in r for r in results), results


@pytest.mark.distributed
def test_resume_after_a_transition_reproduces_the_uninterrupted_run(tmp_path, elastic_full_run):
    """4 ranks, 1x4 -> 2x2 -> 4x1; interrupted mid-epoch after the first transition."""
    config_dict, full, uninterrupted = (
        elastic_full_run.config_dict,
        elastic_full_run.run_dir,
        elastic_full_run.results,
    )
    steps = [int(p.name.split("-")[1]) for p in complete_checkpoints(full)]
    assert steps == [5, 7, 10, 14, 15, 20, 21]  # every 5 steps and at each epoch's end
    resumed_dir = tmp_path / "resumed"
    continue_from(full, resumed_dir, 10)  # epoch 2, step 3 of 7, layout 2x2
    # A setting changed on resume is said, never silent (this one changes nothing trained).
    changed = {**config_dict, "checkpoint": {**config_dict["checkpoint"], "keep_last": 21}}
    resumed = run_workers(elastic_run, 4, changed, str(resumed_dir), False, RESUME)

    (change,) = events(resumed_dir, "config_change")
    assert change["changes"] == {"checkpoint.keep_last": [20, 21]}
    (event,) = events(resumed_dir, "resume")
    assert (event["global_step"], event["epoch"], event["step"]) == (10, 1, 3)
    assert (event["pipe_len"], event["dp_degree"], event["rng"]) == (2, 2, "restored")
    assert step_losses(resumed_dir) == pytest.approx(step_losses(full), abs=1e-6)
    # The epoch split across attempts has the same training loss; every epoch appears once.
    got, want = records(resumed_dir / "metrics.jsonl"), records(full / "metrics.jsonl")
    assert [m["epoch"] for m in got] == [1, 2, 3]
    assert [m["train_loss"] for m in got] == pytest.approx(
        [m["train_loss"] for m in want], abs=1e-6
    )
    assert [m["eval_metric"] for m in got] == [m["eval_metric"] for m in want]
    assert [(m["pipe_len"], m["dp_degree"]) for m in got] == [(4, 1), (2, 2), (1, 4)]
    # Every sample once per epoch: the interrupted attempt's batches after step 10 were
    # dropped from the sample records with the other records, and read again.
    seen = [r for p in sorted((resumed_dir / "samples").glob("rank*.jsonl")) for r in records(p)]
    for epoch in (1, 2, 3):
        ids = sorted(i for r in seen if r["epoch"] == epoch for i in r["ids"])
        assert ids == list(range(config_dict["data"]["train_subset"])), f"epoch {epoch}"
    state, reference = resumed[0]["state"][0], uninterrupted[0]["state"][0]
    assert set(state) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(
            state[name], value, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert resumed[0]["summary"]["attempts"] == 2


@pytest.mark.distributed
@pytest.mark.parametrize("first, second", [(2, 4), (4, 2)])
def test_resume_at_another_world_size_matches_single_process(
    tmp_path, elastic_full_run, first, second
):
    def config(world: int) -> dict:
        return elastic_config(
            trainer__nproc_per_node=world,
            pipeline__initial_pipe_len=world,
            checkpoint__interval_steps=5,
            checkpoint__keep_last=20,
            trainer__record_sample_ids=True,
            optimizer__layerwise_anneal=True,  # the plan carried to another world size
        )

    if first == 4:  # the shared run is this first run
        assert config(4) == elastic_full_run.config_dict
        first_dir = elastic_full_run.run_dir
    else:  # only its step-7 checkpoint is read: it stops at the next one (killed writing it)
        first_dir = tmp_path / "first"
        with pytest.raises(WorkerFailed, match="SIGKILL"):
            run_workers(checkpoint_killed_half_way, first, config(first), str(first_dir), 10)
    resumed_dir = tmp_path / "resumed"
    continue_from(first_dir, resumed_dir, 7)  # after epoch 1 and the 0 -> 3 transition
    results = run_workers(elastic_run, second, config(second), str(resumed_dir), False, RESUME)

    (event,) = events(resumed_dir, "resume")
    assert (event["world_size"], event["checkpoint_world_size"], event["rng"]) == (
        second,
        first,
        "reseeded",
    )
    assert event["num_frozen_layers"] == 3 and event["pipe_len"] * event["dp_degree"] == second
    # The pipeline length this world starts at was changed by hand: recorded, and nothing
    # else (the processes per node follow the world, which the resume event says).
    (change,) = events(resumed_dir, "config_change")
    assert change["changes"] == {"pipeline.initial_pipe_len": [first, second]}
    ref_losses, ref_state, _ = reference_run(config_from_dict(config(first)))
    assert step_losses(resumed_dir) == pytest.approx(ref_losses, abs=1e-5)
    state = results[0]["state"][0]
    assert set(state) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(
            state[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.distributed
def test_a_checkpoint_write_killed_half_way_is_ignored(tmp_path, elastic_full_run):
    """Resumed from the shared run's step-14 checkpoint, rank 0 is killed after every rank
    wrote its tensors for step 15 but before the checkpoint was complete: the next resume
    takes step 14 again and the run ends as the uninterrupted one did."""
    config_dict, full = elastic_full_run.config_dict, elastic_full_run.run_dir
    run_dir = tmp_path / "run"
    continue_from(full, run_dir, 14)
    with pytest.raises(WorkerFailed, match="SIGKILL"):
        run_workers(checkpoint_killed_half_way, 4, config_dict, str(run_dir), 15, RESUME)
    assert (run_dir / "checkpoints" / ".tmp-step-00000015").is_dir()
    assert find_checkpoint(run_dir).name == "step-00000014"
    run_workers(elastic_run, 4, config_dict, str(run_dir), False, RESUME)
    assert not (run_dir / "checkpoints" / ".tmp-step-00000015").exists()
    assert [e["global_step"] for e in events(run_dir, "resume")] == [14, 14]
    assert step_losses(run_dir) == pytest.approx(step_losses(full), abs=1e-6)
    assert [m["epoch"] for m in records(run_dir / "metrics.jsonl")] == [1, 2, 3]


# ---------------------------------------------------------------- the command line


def quick_run_args(run_dir: Path, *extra: str) -> list[str]:
    """A short elastic quickstart: 6 epochs of 4 steps, two transitions, cache on."""
    return [
        "train",
        QUICKSTART,
        "trainer.epochs=6",
        "data.train_subset=256",
        "data.eval_subset=64",
        "freeze.strategy=manual",
        "freeze.manual_schedule=[3,5]",
        "freeze.warmup_epochs=1",
        "freeze.interval_steps=null",
        "pipeline.balance=params",
        "pipeline.initial_pipe_len=2",
        "pipeline.num_micro_batches=2",
        "trainer.progress_bar=false",
        *extra,
        "--run-dir",
        str(run_dir),
    ]


def start_cli(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipetransformer", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_checkpoint(
    run_dir: Path, step: int, process: subprocess.Popen, timeout_s: float = 240
) -> None:
    """Until the run has a complete checkpoint at `step` or later."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        latest = find_checkpoint(run_dir) if (run_dir / "checkpoints").is_dir() else None
        if latest is not None and int(latest.name.split("-")[1]) >= step:
            return
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint at step {step} in {timeout_s} s")


def worker_pids(pid: int) -> list[int]:
    """The trainer processes the launcher `pid` started (not multiprocessing's helpers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return sorted(found)


@pytest.mark.slow
def test_sigkill_of_a_worker_restarts_from_the_latest_checkpoint(tmp_path):
    """Slow: ~37 s on 2 cores (a CLI run, a kill, a restart from the checkpoint)."""
    run_dir = tmp_path / "run"
    process = start_cli(quick_run_args(run_dir, "trainer.max_restarts=1"))
    wait_for_checkpoint(run_dir, 8, process)  # past the first transition (after epoch 1)
    workers = worker_pids(process.pid)
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    assert "killed by SIGKILL" in stderr and "restart 1 of 1 from" in stderr
    assert [m["epoch"] for m in records(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    (resume,) = events(run_dir, "resume")
    assert resume["global_step"] >= 8 and resume["num_frozen_layers"] >= 3
    assert [e["attempt"] for e in events(run_dir, "start")] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["attempts"] == 2 and summary["final_eval_metric"] is not None


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_the_parent_checkpoints_and_the_resume_command_finishes(tmp_path, signum):
    """Slow: ~39 s (SIGTERM) and ~19 s (SIGINT) on 2 cores: a CLI run stopped, then resumed."""
    run_dir = tmp_path / "run"
    process = start_cli(quick_run_args(run_dir))
    wait_for_checkpoint(run_dir, 8, process)
    process.send_signal(signum)  # to the parent only, as a scheduler may
    _, stderr = process.communicate(timeout=120)
    exited = time.time()
    assert process.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert f"stopped by {signal.Signals(signum).name}" in last and "Resume with: " in last
    (checkpoint,) = [
        e for e in events(run_dir, "checkpoint") if e["reason"] == signal.Signals(signum).name
    ]
    assert find_checkpoint(run_dir).name == Path(checkpoint["path"]).name
    # The processes end promptly once the checkpoint is written (the interpreter's own
    # finalization took 7-8 s here, which invites a second Ctrl-C).
    written = (Path(checkpoint["path"]) / "run_state.json").stat().st_mtime
    assert exited - written < 3.0, exited - written
    if signum != signal.SIGTERM:
        return
    command = shlex.split(last.split("Resume with: ", 1)[1])
    assert command[0] == "pipetransformer" and command[-2:] == ["--resume", str(run_dir)]
    finished = subprocess.run(
        [sys.executable, "-m", "pipetransformer", *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert [m["epoch"] for m in records(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run_dir / "summary.json").read_text())["attempts"] == 2


@pytest.mark.slow
def test_a_second_ctrl_c_reports_the_checkpoint_it_left(tmp_path):
    """Slow: ~15 s on 2 cores. Two Ctrl-C in a row: the workers are killed at once, and the
    last line names the newest complete checkpoint (whichever the first press got to) with
    the command that resumes it."""
    run_dir = tmp_path / "run"
    process = start_cli(quick_run_args(run_dir))
    wait_for_checkpoint(run_dir, 8, process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    latest = find_checkpoint(run_dir)
    assert f"the latest complete checkpoint is {latest}" in last and "Resume with: " in last
