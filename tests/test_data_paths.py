"""What a data.path names (data/sources.py): a local path, however mistyped, is never sent
to the Hub and fails at once in one line naming what is close to it; a Hub id is only
owner/name; a JSON-lines file that does not parse names its line; a run of one's own data
is named after it. Every file is written by the test itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import run_cli
from test_failures import one_line_error

from pipetransformer.config import DataConfig
from pipetransformer.data.sources import data_stem, json_error_line, path_kind
from pipetransformer.data.table import read_tables

ROOT = Path(__file__).resolve().parent.parent
SST2_LOCAL = str(ROOT / "configs" / "bert_sst2_local.yaml")


@pytest.fixture
def closed_network(monkeypatch):
    """A closed local proxy for "no network", whatever the machine can reach; not offline
    by configuration (that would skip the question to the Hub)."""
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("no_proxy", "NO_PROXY", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_hub(monkeypatch, closed_network):
    """Any question to the Hub fails the test."""
    import pipetransformer.data.fetch as fetch

    def refuse(name, timeout_s=10.0):
        raise AssertionError(f"the Hub was asked about {name!r}")

    monkeypatch.setattr(fetch, "_hub_reach", refuse)


def test_what_a_data_path_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "saved").mkdir()
    assert path_kind("csv") == path_kind("JSONL") == "builder"
    assert path_kind("nyu-mll/glue") == path_kind("stanfordnlp/sst2") == "hub"
    for local in (
        "does_not_exist.csv",  # a data suffix
        "reviews.jsonl",
        "owner/name.parquet",
        "data/reviews.cvs",  # its directory is here
        "./anything",
        "../up",
        "/abs/path",
        "~/home",
        "saved",  # exists
        "glue",  # not owner/name: a Hub id is never a bare name
        "a/b/c",
    ):
        assert path_kind(local) == "local", local


def test_a_mistyped_local_path_is_one_line_at_once_naming_what_is_close(tmp_path, no_hub):
    data = tmp_path / "data"
    data.mkdir()
    (data / "reviews.csv").write_text("text,label\na fine film,pos\na dull film,neg\n")
    (data / "ratings.json").write_text("{}")
    cases = [
        (str(data / "reviews.cvs"), [f"{data / 'reviews.cvs'} does not exist", "did you mean"]),
        ("does_not_exist.csv", ["data.path: does_not_exist.csv does not exist"]),
        (str(tmp_path / "nowhere" / "x.csv"), ["does not exist", f"no directory {tmp_path}"]),
        ("imdb", ["data.path: imdb does not exist", "owner/name"]),
    ]
    for path, words in cases:
        started = time.monotonic()
        result = run_cli(
            "train", SST2_LOCAL, "data.name=hf", f"data.path={path}", "--run-dir", str(tmp_path)
        )
        assert time.monotonic() - started < 10.0, path
        one_line_error(result, 2, *words)
    result = run_cli(
        "train", SST2_LOCAL, "data.name=hf", f"data.path={data / 'reviews.cvs'}", "--run-dir", "x"
    )
    assert f"did you mean {data / 'reviews.csv'}?" in result.stderr
    result = run_cli(
        "train",
        SST2_LOCAL,
        "data.name=hf",
        "data.path=csv",
        f"data.data_files={{train: {data / 'reviews.csv'}, validation: {data / 'reveiws.csv'}}}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    one_line_error(result, 2, "data.data_files", "does not exist", str(data / "reviews.csv"))


@pytest.mark.parametrize("offline", [False, True])
def test_a_hub_failure_is_one_line_at_once_without_retry_noise(
    tmp_path, closed_network, monkeypatch, capfd, offline
):
    """Out of reach, the Hub is asked once: no 'Retrying in' warnings, one line saying the
    Hub is out of reach and the dataset not in the cache, in seconds; offline by
    configuration, the cache alone is asked."""
    import datasets

    if offline:
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    started = time.monotonic()
    result = run_cli(
        "train",
        SST2_LOCAL,
        "data.name=hf",
        "data.path=no-such-user/no-such-dataset",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert time.monotonic() - started < 10.0
    words = ["data.path", "no-such-user/no-such-dataset", "save_to_disk"]
    one_line_error(result, 2, *words, *([] if offline else ["out of reach", "cache"]))
    assert not (tmp_path / "run").exists()
    captured = capfd.readouterr()
    assert "Retrying" not in result.stderr + captured.err + captured.out


def jsonl_rows(n: int) -> list[str]:
    return [json.dumps({"text": f"review {i}", "label": ["neg", "pos"][i % 2]}) for i in range(n)]


def test_a_bad_json_lines_file_names_its_line(tmp_path):
    rows = jsonl_rows(400)
    rows[299] = rows[299][:-1] + ', "label" "pos"}'  # line 300: a missing colon
    bad = tmp_path / "reviews.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError) as raised:
        read_tables(DataConfig(name="hf", path=str(bad)))
    message = str(raised.value)
    assert message.startswith(f"{bad}: cannot be read as json: line 300, column "), message
    # One JSON document over many lines: the parser's own line.
    document = tmp_path / "reviews.json"
    lines = json.dumps([json.loads(r) for r in jsonl_rows(20)], indent=1).splitlines()
    at = next(i for i, line in enumerate(lines) if i > 40 and '"label":' in line)
    lines[at] = lines[at].replace('"label":', '"label"')
    document.write_text("\n".join(lines) + "\n")
    assert json_error_line(document).startswith(f"line {at + 1}, column ")
    # A bad first line of JSON lines is at fault itself.
    first = tmp_path / "first.jsonl"
    first.write_text("\n".join(['{"text": "a", ', *jsonl_rows(5)]) + "\n")
    assert json_error_line(first).startswith("line 1, column ")
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(jsonl_rows(5)) + "\n")
    assert json_error_line(good) is None


def test_runs_of_own_data_are_named_after_it(tmp_path):
    (tmp_path / "saved_dataset").mkdir()
    cases = [
        (dict(path=str(tmp_path / "reviews.csv")), "reviews"),
        (dict(path="csv", data_files={"validation": "x/dev.csv", "train": "x/train.csv"}), "train"),
        (dict(path="json", data_files="tickets-2026.jsonl"), "tickets-2026"),
        (dict(path=str(tmp_path / "saved_dataset")), "saved_dataset"),
        (dict(path="nyu-mll/glue", config_name="mrpc"), "glue-mrpc"),
        (dict(path="./my images"), "my-images"),
    ]
    for keys, stem in cases:
        assert data_stem(DataConfig(name="hf", **keys)) == stem, keys
    assert data_stem(DataConfig(name="sst2")) is None


def test_run_and_report_names_come_from_ones_own_data(tmp_path):
    from pipetransformer.cli.commands import _default_run_dir
    from pipetransformer.compare import CompareRequest
    from pipetransformer.compare.report import write_report
    from pipetransformer.config import load_config

    reviews = tmp_path / "reviews.csv"
    reviews.write_text("text,label\na fine film,pos\na dull film,neg\n")
    config = load_config(SST2_LOCAL, ["data.name=hf", f"data.path={reviews}"])
    run_dir = _default_run_dir(SST2_LOCAL, config)
    assert run_dir.parent == Path("runs") and run_dir.name.startswith("reviews-")
    compare_dir = _default_run_dir(SST2_LOCAL, config, "runs/compare")
    assert compare_dir.parent == Path("runs/compare") and compare_dir.name.startswith("reviews-")
    sst2 = load_config(SST2_LOCAL, [])  # the config's own data: named after the config
    assert _default_run_dir(SST2_LOCAL, sst2).name.startswith("bert_sst2_local-")
    context = CompareRequest(SST2_LOCAL, tmp_path).context(config)
    assert context["config_name"] == "reviews"
    run = {
        "training_time_s": 10.0,
        "final_eval_metric": 0.5,
        "best_eval_metric": 0.5,
        "metric_name": "accuracy",
        "freeze_trajectory": [{"num_frozen_layers": 0, "pipe_len": 1, "dp_degree": 2}],
        "ddp_comm_share": 0.0,
        "transitions": [],
    }
    results = {**context, "variants": {"baseline": run, "elastic": run}, "speedup": 1.0}
    results.update(eval_metric_delta=0.0, speedups={"baseline": 1.0, "elastic": 1.0})
    title = write_report(results, tmp_path, []).splitlines()[0]
    assert title == "# reviews: PipeTransformer vs Pipe+DDP baseline"
