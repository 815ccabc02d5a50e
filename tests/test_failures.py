"""What a careless or unlucky user meets: each is one line and a documented exit code
(2: bad input found before training; 1: a failure during it; 130/143: interrupted), and
nothing of theirs is lost. Also what a local run exposes: sockets on loopback only."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CliResult, run_cli

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
SHORT = [
    "trainer.epochs=2",
    "data.train_subset=128",
    "data.eval_subset=32",
    "trainer.progress_bar=false",
]


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipetransformer", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def one_line_error(result: subprocess.CompletedProcess | CliResult, code: int, *words: str) -> None:
    assert result.returncode == code, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("pipetransformer: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    for word in words:
        assert word in errors[0], errors[0]
    assert "training on" not in result.stderr  # no worker was started


def digest(directory: Path) -> dict[str, str]:
    """Every file's contents (a refused run leaves no lock file behind either)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_resume_of_a_path_that_is_not_a_run_is_one_line_and_creates_nothing(tmp_path):
    missing = tmp_path / "no-such-run"
    result = run_cli("train", QUICKSTART, "--resume", str(missing))
    one_line_error(result, 2, f"--resume {missing}: no such directory")
    assert not missing.exists()
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    before = digest(foreign)
    result = run_cli("train", QUICKSTART, "--resume", str(foreign))
    one_line_error(result, 2, "not a run directory")
    assert digest(foreign) == before and sorted(p.name for p in foreign.iterdir()) == ["cat.jpg"]


def test_a_second_interrupt_names_the_checkpoint_that_exists(tmp_path, elastic_full_run):
    """The first Ctrl-C writes a checkpoint; a second kills the workers at once, and the
    report must not say there is none (a user who believed it would pass --overwrite)."""
    import shutil

    from pipetransformer.cli.commands import _killed_report
    from pipetransformer.runs.checkpoint import find_checkpoint

    run_dir = tmp_path / "run"
    shutil.copytree(elastic_full_run.run_dir, run_dir)
    report = _killed_report(run_dir, "pipetransformer train X --resume RUN")
    latest = find_checkpoint(run_dir)
    assert f"the latest complete checkpoint is {latest} (after global step 21" in report
    assert report.endswith("Resume with: pipetransformer train X --resume RUN")
    shutil.rmtree(run_dir / "checkpoints")
    report = _killed_report(run_dir, "pipetransformer train X --resume RUN")
    assert "before any checkpoint was complete" in report and "Resume with" not in report


def test_a_used_run_directory_is_refused_with_its_files_untouched(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("trainer: {}\n")
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')
    before = digest(run_dir)
    one_line_error(
        run_cli("train", QUICKSTART, *SHORT, "--run-dir", str(run_dir)),
        2,
        str(run_dir),
        "--resume",
        "--overwrite",
    )
    one_line_error(
        run_cli("train", QUICKSTART, *SHORT, "--resume", str(run_dir)), 2, "no complete checkpoint"
    )
    assert digest(run_dir) == before


def test_a_file_in_the_way_of_the_run_directory(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("mine")
    one_line_error(
        run_cli("train", QUICKSTART, *SHORT, "--run-dir", str(blocker)), 2, "a file is in the way"
    )
    assert blocker.read_text() == "mine"


@pytest.mark.parametrize("kind", ["truncated_tsv", "malformed_squad"])
def test_bad_data_files_are_one_line_before_any_worker(tmp_path, sst2_dir, squad_files, kind):
    if kind == "truncated_tsv":
        root = tmp_path / "sst2"
        root.mkdir()
        lines = (sst2_dir / "train.tsv").read_text().splitlines()[:200]
        (root / "train.tsv").write_text(
            "\n".join(lines) + "\nthe film is a cut-off line with no lab"
        )
        (root / "dev.tsv").write_text((sst2_dir / "dev.tsv").read_text())
        args = ["train", str(ROOT / "configs" / "bert_sst2_local.yaml"), f"data.root={root}"]
        words = [str(root / "train.tsv") + ":201"]
    else:
        bad = tmp_path / "squad.json"
        text = squad_files.train.read_text()
        bad.write_text(text[: len(text) // 2])  # a download cut short
        args = [
            "train",
            str(ROOT / "configs" / "bert_squad_local.yaml"),
            f"data.root={bad}",
            f"data.eval_root={bad}",
        ]
        words = [str(bad), "not valid JSON"]
    result = run_cli(*args, "--run-dir", str(tmp_path / "run"))
    one_line_error(result, 2, *words)
    assert not (tmp_path / "run").exists()


def test_a_missing_local_model_directory_is_named_as_such(tmp_path):
    data = tmp_path / "sst2"  # valid data of its own, so that the model directory is what fails
    data.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (data / name).write_text("sentence\tlabel\na fine film\t1\na dull film\t0\n")
    result = run_cli(
        "train",
        str(ROOT / "configs" / "bert_sst2_local.yaml"),
        "model.model_name_or_path=/no/such/dir",
        f"data.root={data}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    one_line_error(result, 2, "model.model_name_or_path: no such directory: /no/such/dir")


def test_a_dataset_that_cannot_be_fetched_is_one_line(tmp_path, monkeypatch):
    # A closed local proxy stands in for "no network" whatever the machine can reach.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    result = run_cli(
        "train",
        str(ROOT / "configs" / "vit_cifar100.yaml"),
        "trainer.device=cpu",  # a GPU config; the data is what is tested
        f"data.root={tmp_path / 'cifar'}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    one_line_error(result, 2, "CIFAR-100", str(tmp_path / "cifar"), "point data.root")


def listening_sockets(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that `pids` hold."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def run_pids(parent: int) -> list[int]:
    pids = [parent]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) in pids:
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_concurrent_runs_local_sockets_and_file_modes(tmp_path):
    """Slow: ~31 s on 2 cores. A second run on a live run's directory is refused (even with
    --overwrite) and the first finishes intact; a local run listens on the loopback
    interface only; every run file has the same mode."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipetransformer",
            "train",
            QUICKSTART,
            "trainer.epochs=20",
            "data.train_subset=512",
            "trainer.progress_bar=false",
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "steps.jsonl").exists():  # training has started
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)
    addresses = listening_sockets(run_pids(first.pid))
    assert addresses, "the run's rendezvous store listens somewhere"
    # 0100007F: 127.0.0.1 in /proc/net/tcp; ::1 in tcp6.
    loopback = ("0100007F:", "00000000000000000000000001000000:")
    assert all(a.startswith(loopback) for a in addresses), addresses
    second = cli("train", QUICKSTART, *SHORT, "--run-dir", str(run_dir), "--overwrite")
    one_line_error(second, 2, "in use by another run", f"pid {first.pid}")
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    assert [
        json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ] == list(range(1, 21))
    umask = os.umask(0)
    os.umask(umask)
    modes = {
        p.name: p.stat().st_mode & 0o777
        for p in run_dir.iterdir()
        if p.is_file() and p.name != ".lock"
    }
    assert set(modes) >= {
        "config.yaml",
        "metrics.jsonl",
        "events.jsonl",
        "steps.jsonl",
        "summary.json",
    }
    assert set(modes.values()) == {0o666 & ~umask}, modes


def refuse_on_rank_one() -> None:
    """A worker of the test below: rank 1 refuses as the planner does when nothing fits."""
    from pipetransformer.planning.context import DoesNotFit

    if os.environ["RANK"] == "1":
        raise DoesNotFit("pipeline.sharding: always: does not fit even sharded")


def test_a_workers_exception_comes_back_typed():
    """compare reads a peer's refusal from the type of the worker's exception, not from its
    text: the launcher carries the failing rank's exception back."""
    from helpers import WORKER_CONTEXT

    from pipetransformer.launcher import WorkerFailed, launch_local
    from pipetransformer.planning.context import DoesNotFit

    with pytest.raises(WorkerFailed) as failed:
        launch_local(2, refuse_on_rank_one, (), context=WORKER_CONTEXT)
    assert str(failed.value).startswith("rank1: DoesNotFit: pipeline.sharding: always")
    assert isinstance(failed.value.error, DoesNotFit)
    assert str(failed.value.error) == "pipeline.sharding: always: does not fit even sharded"
