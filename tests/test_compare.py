"""compare: the ideal-speedup accounting, results/report agreeing with the runs, the plots."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TINY_QUICKSTART

from pipetransformer.compare.ideal import (
    StepLayout,
    bubble,
    ideal_eval_costs,
    ideal_speedup,
    ideal_step_costs,
    segments_from_run,
)
from pipetransformer.compare.plots import write_plots
from pipetransformer.compare.report import build_results, read_run, write_report
from pipetransformer.runs.records import RunSummary
from pipetransformer.utils.files import append_jsonl, read_jsonl, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent


def test_ideal_accounting_by_hand():
    # 2 layers: units embed, a0, m0, a1, m1, head. Trained costs 3 each, frozen 1 each.
    trained, frozen = [3.0] * 6, [1.0] * 6
    base = [StepLayout(0, 4, 0, 2, 2)]  # 4 steps, K=2, M=2: bubble 1.5
    elastic = [
        StepLayout(0, 2, 0, 2, 2),
        StepLayout(2, 4, 1, 1, 1),
    ]  # then F=1 (3 units frozen), K=1
    base_costs = ideal_step_costs(base, trained, frozen, steps_per_epoch=2, cache=False)
    assert base_costs == [18 * 1.5] * 4
    # Without cache: steps 2, 3 cost 3 active units x 3 + 3 frozen x 1 = 12, no bubble.
    assert ideal_step_costs(elastic, trained, frozen, 2, cache=False) == [27, 27, 12, 12]
    # With cache: the first epoch after the freeze fills it (12), then 9 per step.
    longer = [StepLayout(0, 2, 0, 2, 2), StepLayout(2, 6, 1, 1, 1)]
    assert ideal_step_costs(longer, trained, frozen, 2, cache=True) == [27, 27, 12, 12, 9, 9]
    # A boundary move F=1 -> 2 upgrades entries: a sample stored at F=1 one epoch earlier runs
    # only layer 1's two frozen units (2), on top of the one active unit, the head (3).
    moving = [StepLayout(0, 2, 1, 1, 1), StepLayout(2, 4, 2, 1, 1), StepLayout(4, 6, 2, 1, 1)]
    assert ideal_step_costs(moving, trained, frozen, 2, cache=True) == [12, 12, 5, 5, 3, 3]
    assert ideal_step_costs(moving, trained, frozen, 2, cache=False) == [12, 12, 8, 8, 8, 8]
    result = ideal_speedup(
        baseline_segments=base,
        elastic_segments=elastic,
        trained=trained,
        frozen=frozen,
        steps_per_epoch=2,
        cache=False,
        baseline_wall_s=110.0,
        baseline_eval_s=2.0,
        elastic_wall_s=80.0,
    )
    # Train part 108 s scales by 78 / 108; eval stays 2 s: ideal wall 80 s.
    assert result.ideal_elastic_wall_s == pytest.approx(108 * 78 / 108 + 2)
    assert result.ideal_speedup == pytest.approx(110 / 80)
    assert result.measured_speedup == pytest.approx(
        110 / 80
    ) and result.efficiency == pytest.approx(1.0)
    assert bubble(1, 4) == 1.0 and bubble(4, 4) == pytest.approx(7 / 4)
    # Evaluation runs all 6 units forward (1 each) unless the previous evaluation cached the
    # prefix: F = 0, 1, 1 costs 6, 6 (nothing cached at F=0), then 3 (units 0-2 cached).
    assert ideal_eval_costs([0, 1, 1], frozen, cache=True) == [6, 6, 3]
    assert ideal_eval_costs([0, 1, 1], frozen, cache=False) == [6, 6, 6]
    with_eval = ideal_speedup(
        baseline_segments=base,
        elastic_segments=longer[:1] + [StepLayout(2, 4, 1, 1, 1)],
        trained=trained,
        frozen=frozen,
        steps_per_epoch=2,
        cache=True,
        baseline_wall_s=110.0,
        baseline_eval_s=3.0,
        elastic_wall_s=80.0,
        eval_frozen=[0, 1],
    )
    # Train 107 s x 78 / 108 (the second epoch still fills the cache); eval 3 s x 12 / 12.
    assert with_eval.ideal_elastic_wall_s == pytest.approx(107 * 78 / 108 + 3)
    three = ideal_speedup(
        baseline_segments=[StepLayout(0, 6, 0, 2, 2)],
        elastic_segments=longer,
        trained=trained,
        frozen=frozen,
        steps_per_epoch=2,
        cache=True,
        baseline_wall_s=170.0,
        baseline_eval_s=6.0,
        elastic_wall_s=100.0,
        eval_frozen=[0, 1, 1],
    )
    # Train 164 s x (27+27+12+12+9+9) / (6 x 27); eval 6 s x 15 / 18.
    assert three.ideal_elastic_wall_s == pytest.approx(164 * 96 / 162 + 6 * 15 / 18)


def test_segments_follow_the_events():
    metrics = [{"global_step": 10}, {"global_step": 20}, {"global_step": 30}]
    events = [
        {"global_step": 10, "new_num_frozen_layers": 2, "new_pipe_len": 2, "num_micro_batches": 4},
        {"global_step": 25, "new_num_frozen_layers": 5, "new_pipe_len": 1, "num_micro_batches": 2},
    ]
    segs = segments_from_run(metrics, events, 10, StepLayout(0, 0, 0, 4, 4))
    assert [(s.start, s.end, s.num_frozen_layers, s.pipe_len) for s in segs] == [
        (0, 10, 0, 4),
        (10, 25, 2, 2),
        (25, 30, 5, 1),
    ]


def fake_run(path: Path, wall: float, metrics: list[tuple], events: list[dict] = ()):
    path.mkdir(parents=True)
    for epoch, (metric, frozen, pipe_len, dp, sps) in enumerate(metrics, start=1):
        append_jsonl(
            path / "metrics.jsonl",
            {
                "epoch": epoch,
                "global_step": 10 * epoch,
                "train_loss": 1.0 / epoch,
                "eval_metric": metric,
                "samples_per_s": sps,
                "epoch_time_s": 5.0,
                "eval_time_s": 0.5,
                "num_frozen_layers": frozen,
                "pipe_len": pipe_len,
                "dp_degree": dp,
                "num_micro_batches": 2,
                "ddp_comm_s": 0.5 if dp > 1 else 0.0,
            },
        )
    for event in events:
        append_jsonl(path / "events.jsonl", event)
    summary = RunSummary(
        training_time_s=wall,
        attempts=1,
        final_eval_metric=metrics[-1][0],
        best_eval_metric=max(m[0] for m in metrics),
        epochs=len(metrics),
        global_steps=10 * len(metrics),
        num_transitions=len(events),
        final_num_frozen_layers=metrics[-1][1],
        final_pipe_len=metrics[-1][2],
        final_dp_degree=metrics[-1][3],
        world_size=2,
        device="cpu",
        checkpoint=None,
        metric_name="accuracy",
    )
    write_json_atomic(path / "summary.json", summary.to_dict())


def test_results_and_report_agree_with_the_runs(tmp_path):
    fake_run(
        tmp_path / "baseline",
        30.0,
        [(0.5, 0, 2, 1, 100.0), (0.8, 0, 2, 1, 101.0), (0.9, 0, 2, 1, 99.0)],
    )
    event = {
        "epoch": 1,
        "step": None,
        "global_step": 10,
        "old_num_frozen_layers": 0,
        "new_num_frozen_layers": 3,
        "old_pipe_len": 2,
        "new_pipe_len": 1,
        "old_dp_degree": 1,
        "new_dp_degree": 2,
        "units_moved": 9,
        "new_stage_ranges": [[7, 18]],
        "num_micro_batches": 2,
        "plan_s": 0.001,
        "state_move_s": 0.05,
        "groups_s": 0.02,
        "rebuild_s": 0.01,
        "total_s": 0.081,
    }
    fake_run(
        tmp_path / "elastic",
        20.0,
        [(0.5, 0, 2, 1, 100.0), (0.82, 3, 1, 2, 160.0), (0.89, 3, 1, 2, 170.0)],
        [event],
    )
    runs = {name: read_run(tmp_path / name) for name in ("baseline", "elastic")}
    costs = {"trained": [3.0] * 18, "frozen": [1.0] * 18}
    results = build_results(runs, costs, cache_enabled=False, context={"config_name": "fake"})
    for name in runs:
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert results["variants"][name]["training_time_s"] == summary["training_time_s"]
        assert results["variants"][name]["final_eval_metric"] == summary["final_eval_metric"]
        assert results["variants"][name]["best_eval_metric"] == summary["best_eval_metric"]
    assert results["speedup"] == pytest.approx(1.5)
    assert results["eval_metric_delta"] == pytest.approx(-0.01)
    assert results["variants"]["elastic"]["samples_per_s"] == [100.0, 160.0, 170.0]
    assert [
        p["num_frozen_layers"] for p in results["variants"]["elastic"]["freeze_trajectory"]
    ] == [0, 3, 3]
    assert 1.0 < results["ideal_speedup"] and results["efficiency"] == pytest.approx(
        1.5 / results["ideal_speedup"]
    )
    text = write_report(results, tmp_path, [])
    assert "1.50x" in text and "0.8900" in text and "0.9000" in text and "-1.00 points" in text
    assert "2x1 → 1x2" in text and "| 9 |" in text  # layout path and units moved
    assert (tmp_path / "report.md").read_text() == text


def test_plots_are_pngs_with_the_expected_series(tmp_path):
    fake_run(tmp_path / "baseline", 30.0, [(0.5, 0, 2, 1, 100.0), (0.9, 0, 2, 1, 99.0)])
    fake_run(tmp_path / "elastic", 20.0, [(0.5, 0, 2, 1, 100.0), (0.88, 3, 1, 2, 170.0)])
    runs = {name: read_run(tmp_path / name) for name in ("baseline", "elastic")}
    series = write_plots(runs, tmp_path)
    for name in ("throughput.png", "trajectory.png", "eval_metric.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert series["throughput.png"] == {"baseline": [100.0, 99.0], "elastic": [100.0, 170.0]}
    assert series["trajectory.png"]["elastic"] == {
        "num_frozen_layers": [0, 3],
        "pipe_len": [2, 1],
        "dp_degree": [1, 2],
    }
    assert series["eval_metric.png"]["baseline"] == [0.5, 0.9]


@pytest.mark.slow
def test_compare_command_end_to_end(tmp_path):
    """Slow: ~270 s on 2 busy cores (`compare --peers --curves ddp,elastic` runs seven variants:
    the baseline, DDP, the plain timm + DDP loop, freeze + DDP, FSDP2, freeze + FSDP2 and
    the full system, and DDP and the full system for 1 epoch, the default budget ladder
    below the config's 2), every run evaluating 4 times an epoch."""
    out = tmp_path / "cmp"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetransformer",
            "compare",
            str(ROOT / "configs" / "quickstart.yaml"),
            *TINY_QUICKSTART,
            "trainer.evals_per_epoch=4",
            "--peers",
            "--curves",
            "ddp,elastic",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["variants"]) == [
        "baseline",
        "ddp",
        "torch_ddp",
        "freeze_ddp",
        "fsdp",
        "freeze_fsdp",
        "elastic",
    ]
    layouts = {
        name: [
            (p["pipe_len"], p["dp_degree"], p["num_frozen_layers"])
            for p in run["freeze_trajectory"]
        ]
        for name, run in results["variants"].items()
    }
    assert layouts == {
        "baseline": [(2, 1, 0), (2, 1, 0)],
        "ddp": [(1, 2, 0), (1, 2, 0)],
        "torch_ddp": [(1, 2, 0), (1, 2, 0)],
        "freeze_ddp": [(1, 2, 0), (1, 2, 5)],
        "fsdp": [(1, 2, 0), (1, 2, 0)],
        "freeze_fsdp": [(1, 2, 0), (1, 2, 5)],
        "elastic": [(2, 1, 0), (1, 2, 5)],
    }
    # DDP's budget curve: 1 epoch (its own run, schedule fitted) and the DDP variant's 2.
    curve = results["time_to_accuracy"]
    assert curve["curve_variants"] == ["ddp_1ep", "ddp"]
    assert json.loads((out / "ddp_1ep" / "summary.json").read_text())["epochs"] == 1
    assert {v["variant"] for v in curve["variants"]} >= {"baseline", "elastic", "torch_ddp"}
    assert {(r["variant"], len(r["epochs"])) for r in results["runs"]} >= {("ddp_1ep", 1)}
    # Every run, the peers outside this trainer included, evaluated at the same quarters of
    # each epoch, off its training clock (time-to-target reads them).
    quarters = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    for name in results["variants"]:
        evaluations = [e["epochs_done"] for e in read_jsonl(out / name / "evaluations.jsonl")]
        assert evaluations == quarters, name
        assert json.loads((out / name / "summary.json").read_text())["eval_time_s"] > 0
    found = results["time_to_target"]
    assert found["target_source"] == "ddp" and found["budgets"]["elastic"] == [1, 2]
    assert {s["side"] for s in found["sides"]} >= {"elastic", "ddp", "baseline", "torch_ddp"}
    # The full system's 1-epoch budget decided at half its epoch (its config's epoch ends,
    # 2 of them, fitted), froze and packed there.
    assert (
        yaml.safe_load((out / "elastic_1ep" / "config.yaml").read_text())["freeze"][
            "cadence_epochs"
        ]
        == 2
    )
    budget_run = read_run(out / "elastic_1ep")
    assert [t["global_step"] for t in budget_run["transitions"]] == [2]  # 4 steps an epoch
    assert (out / "frontiers.png").is_file() and "## Time-to-target" in (
        out / "report.md"
    ).read_text()
    assert results["variants"]["fsdp"]["sharded"] and results["variants"]["freeze_fsdp"]["sharded"]
    assert not results["variants"]["elastic"]["sharded"]
    matrix = results["speedup_matrix"]
    for a, run_a in results["variants"].items():
        for b, run_b in results["variants"].items():
            ratio = run_b["training_time_s"] / run_a["training_time_s"]
            assert matrix[a][b] == pytest.approx(ratio)
    assert "Each variant against each other" in (out / "report.md").read_text()
    for name in ("baseline", "torch_ddp", "elastic"):
        summary = json.loads((out / name / "summary.json").read_text())
        assert results["variants"][name]["training_time_s"] == summary["training_time_s"]
    assert results["speedup"] == pytest.approx(
        results["variants"]["baseline"]["training_time_s"]
        / results["variants"]["elastic"]["training_time_s"]
    )
    assert results["variants"]["elastic"]["freeze_trajectory"][-1]["pipe_len"] == 1
    assert (
        "ideal_speedup" in results
        and (out / "report.md").exists()
        and (out / "trajectory.png").exists()
    )
    assert "baseline done" in result.stderr and "elastic done" in result.stderr
    # --report-only rebuilds the outputs from the runs without rerunning them, keeping the
    # original command and the unit costs (hence the same ideal speedup).
    (out / "report.md").unlink()
    rebuilt = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetransformer",
            "compare",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--out",
            str(out),
            "--report-only",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    again = json.loads((out / "results.json").read_text())
    assert (
        again["command"] == results["command"]
        and again["ideal_speedup"] == results["ideal_speedup"]
    )
    assert again["variants"] == results["variants"] and (out / "report.md").exists()
    assert "baseline done" not in rebuilt.stderr
    empty = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetransformer",
            "compare",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--out",
            str(tmp_path / "nothing"),
            "--report-only",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert empty.returncode != 0 and "has no finished baseline/ and elastic/ runs" in empty.stderr


def test_the_fsdp_peers_and_a_refusal_in_one_line(tmp_path, monkeypatch, capsys):
    """--peers adds FSDP2 without and with freezing (sharded from the start, the baseline's
    global batch); a peer that cannot fit even sharded is refused with its reason and the
    comparison goes on, and the report says so."""
    from pipetransformer.compare import execute
    from pipetransformer.compare.report import refusal
    from pipetransformer.compare.variants import variant_overrides
    from pipetransformer.config import load_config
    from pipetransformer.launcher import WorkerFailed
    from pipetransformer.planning.context import DoesNotFit

    config = load_config(str(ROOT / "configs" / "quickstart.yaml"))
    variants = variant_overrides(config, ablations=False, peers=True)
    assert list(variants) == [
        "baseline",
        "ddp",
        "torch_ddp",
        "freeze_ddp",
        "fsdp",
        "freeze_fsdp",
        "elastic",
    ]
    assert "pipeline.sharding=always" in variants["fsdp"]
    assert "freeze.strategy=none" in variants["fsdp"]
    assert "pipeline.sharding=always" in variants["freeze_fsdp"]
    assert not any(o.startswith("freeze.strategy") for o in variants["freeze_fsdp"])
    for name in ("fsdp", "freeze_fsdp"):  # each is a config a run accepts
        load_config(str(ROOT / "configs" / "quickstart.yaml"), variants[name])

    reason = "pipeline.sharding: always: does not fit even sharded over 2 processes: ..."

    def refused(*args, **kwargs):
        # The worker's exception, carried back typed: the refusal is read from its type.
        raise WorkerFailed(f"rank0: DoesNotFit: {reason}", DoesNotFit(reason))

    monkeypatch.setattr(execute, "launch_local", refused)
    run_dir = tmp_path / "fsdp"
    assert execute.run_variant(config, "fsdp", run_dir, "[4/6] FSDP2")
    assert refusal(run_dir) == reason
    assert f"fsdp refused: {reason}" in capsys.readouterr().err
    assert execute.run_variant(config, "fsdp", run_dir, "[4/6] FSDP2")  # not run again
    assert "refused earlier, kept" in capsys.readouterr().err

    def failed(*args, **kwargs):
        # A message that names DoesNotFit is not a refusal: only the type is.
        raise WorkerFailed("rank1: RuntimeError: DoesNotFit: something else", RuntimeError())

    monkeypatch.setattr(execute, "launch_local", failed)
    assert not execute.run_variant(config, "freeze_fsdp", tmp_path / "other", "[5/6]")
    assert refusal(tmp_path / "other") is None

    base = tmp_path / "runs"
    fake_run(base / "baseline", 10.0, [(0.5, 0, 2, 1, 100.0)])
    fake_run(base / "elastic", 8.0, [(0.5, 0, 2, 1, 100.0)])
    runs = {name: read_run(base / name) for name in ("baseline", "elastic")}
    results = build_results(runs, None, False, {"refused": {"fsdp": reason}})
    report = write_report(results, base, [])
    assert f"| FSDP2 (sharded over every process, no freezing) | refused: {reason} |" in report
