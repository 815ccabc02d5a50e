"""The benchmarks' shared harness (benchmarks/harness.py): a finished run is kept, so an
interrupted benchmark resumes instead of running it again; variants run seed by seed; a
report reads back only the runs that finished; the results file records the machine. Cheap:
the one "run" is a Python one-liner (about 2 s, the idle-cores check included)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402


def test_train_command_runs_the_cli_into_the_run_directory_or_resumes_it(tmp_path):
    command = harness.train_command("configs/quickstart.yaml", ["trainer.epochs=1"], tmp_path)
    assert command[:5] == [
        sys.executable,
        "-m",
        "pipetransformer",
        "train",
        "configs/quickstart.yaml",
    ]
    assert command[5:] == [
        "trainer.progress_bar=false",
        "trainer.epochs=1",
        "--run-dir",
        str(tmp_path),
    ]
    resumed = harness.train_command("c.yaml", [], tmp_path, "--overwrite", resume=True)
    assert resumed[-3:] == ["--resume", str(tmp_path), "--overwrite"]


def test_a_finished_run_is_kept_and_not_run_again(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "IDLE_SAMPLE_S", 0.05)  # the watch before a run, not its subject
    run_dir, count = tmp_path / "run", tmp_path / "count"
    script = (
        "import pathlib, sys; r = pathlib.Path(sys.argv[1]); r.mkdir(exist_ok=True); "
        "(r / 'summary.json').write_text('{}'); "
        "c = pathlib.Path(sys.argv[2]); c.write_text(c.read_text() + 'x' if c.exists() else 'x')"
    )
    command = [sys.executable, "-c", script, str(run_dir), str(count)]
    first = harness.run_alone(command, run_dir, wait_s=0)
    runs = len(count.read_text())
    assert runs == (2 if "repeated_after" in first else 1)  # once more only if cores were shared
    assert json.loads((run_dir / harness.RECORD).read_text()) == first
    assert harness.run_alone(command, run_dir, wait_s=0) == first  # resumed: kept, not run
    assert len(count.read_text()) == runs


def test_over_seeds_runs_seed_by_seed_and_reports_only_finished_runs(tmp_path):
    order = []

    def run_one(name, seed):
        order.append((seed, name))
        return {"name": name, "seed": seed}

    records = harness.over_seeds([0, 1], ["a", "b"], run_one, lambda n, s: tmp_path / f"{s}{n}")
    assert order == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert records == {n: {s: {"name": n, "seed": s} for s in (0, 1)} for n in ("a", "b")}

    (tmp_path / "1b").mkdir()
    (tmp_path / "1b" / harness.RECORD).write_text(json.dumps({"wall": 3}))
    read = harness.over_seeds([0, 1], ["a", "b"], None, lambda n, s: tmp_path / f"{s}{n}", True)
    assert read == {"a": {}, "b": {1: {"wall": 3}}}


def test_write_results_records_the_machine_beside_the_table(tmp_path, capsys):
    text = harness.write_results(tmp_path / "out", "bench", {"rows": [1]}, "| a |\n| --- |")
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written["rows"] == [1] and written["torch"] and "CPUs" in written["machine"]
    assert (tmp_path / "out" / "bench.md").read_text() == text + "\n"
    assert text.startswith("| a |") and "machine: " in text and text in capsys.readouterr().out
