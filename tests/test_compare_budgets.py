"""`compare --budgets` end to end with faked training (no process starts): the budget runs
and their fitted schedules, the rotated run order and its record, every run's per-epoch
record, who decided each freeze, time-to-accuracy and accuracy at equal time in
results.json, report.md and a plot, and `--report-only` recomputing them."""

import json
import math
from pathlib import Path

import pytest

from pipetransformer.compare import CompareRequest, execute, outputs, rebuild_compare, run_compare
from pipetransformer.compare.budgets import (
    budget_of,
    budget_variants,
    curve_of,
    default_ladder,
    fitted_warmup_steps,
)
from pipetransformer.compare.order import read_order, record_order, rotated_order
from pipetransformer.config import load_config
from pipetransformer.runs.records import (
    EpochMetrics,
    FreezeDecisionEvent,
    RunSummary,
)
from pipetransformer.utils.files import append_jsonl, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
SECONDS_PER_EPOCH = 10.0


def test_budgets_fit_their_warmup_and_the_ladder_stays_below_the_epochs():
    assert default_ladder(3) == [1, 2] and default_ladder(2) == [1] and default_ladder(1) == []
    assert default_ladder(30) == [8, 15, 23] and default_ladder(4) == [1, 2, 3]
    # The config's warm-up as the same share of the run, at least one step.
    assert fitted_warmup_steps(10, 3, 1) == 3 and fitted_warmup_steps(10, 3, 2) == 7
    assert fitted_warmup_steps(10, 3, 3) == 10 and fitted_warmup_steps(1, 30, 1) == 1
    assert fitted_warmup_steps(0, 3, 1) == 0
    config = load_config(QUICKSTART, ["trainer.epochs=3", "optimizer.warmup_steps=10"])
    found = budget_variants(config, [1, 2, 3], ["freeze.strategy=none"], runs_full=True)
    assert list(found) == ["ddp_1ep", "ddp_2ep"]  # the DDP variant is the 3-epoch point
    assert found["ddp_1ep"] == [
        "freeze.strategy=none",
        "trainer.epochs=1",
        "optimizer.warmup_steps=3",
    ]
    assert "ddp_3ep" in budget_variants(config, [3], ["freeze.strategy=none"], runs_full=False)
    # A freezing variant's budget runs decide at the same shares of their run as at the
    # config's 3 epochs (freeze.cadence_epochs; tests/test_time_to_target.py checks where).
    elastic = budget_variants(config, [1, 3], [], runs_full=True, variant="elastic")
    assert elastic == {
        "elastic_1ep": ["trainer.epochs=1", "optimizer.warmup_steps=3", "freeze.cadence_epochs=3"]
    }
    assert budget_of("ddp_12ep") == 12 and budget_of("ddp") is None and budget_of("ddp_ep") is None
    assert budget_of("freeze_ddp_2ep") == 2 and curve_of("freeze_ddp_2ep") == "freeze_ddp"
    assert curve_of("ddp_1ep") == "ddp" and curve_of("freeze_only") == "freeze_only"


def test_the_order_rotates_with_the_seed_and_is_kept_on_resume(tmp_path):
    names = ["a", "b", "c"]
    assert [rotated_order(names, s) for s in (0, 1, 2, 3)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert rotated_order(names, None) == names
    assert record_order(tmp_path, ["b", "c", "a"]) == ["b", "c", "a"]
    assert record_order(tmp_path, ["a", "b", "c"]) == ["b", "c", "a"]  # the planned order
    # A variant added later runs after those planned before; the record keeps them all.
    assert record_order(tmp_path, ["d", "a"]) == ["a", "d"]
    assert read_order(tmp_path) == ["b", "c", "a", "d"]


def _accuracy(variant: str, epochs: int, seed: int) -> float:
    """DDP gains 5 points an epoch from 0.70; the full system reaches 0.82 (0.83 on seed 1)
    in 18 s whatever its epochs; the baseline is DDP's 3 epochs, slower."""
    if variant == "elastic":
        return 0.82 + seed / 100
    return 0.70 + 0.05 * epochs


def _fake_run(run_dir: Path, variant: str, epochs: int, seed: int, warmup: int) -> None:
    time_s = 18.0 if variant == "elastic" else SECONDS_PER_EPOCH * epochs
    if variant == "baseline":
        time_s *= 1.5
    final = _accuracy(variant, epochs, seed)
    for epoch in range(1, epochs + 1):
        line = EpochMetrics(
            epoch=epoch,
            global_step=10 * epoch,
            train_loss=1.0 / epoch,
            eval_metric=final - 0.01 * (epochs - epoch),
            samples_per_s=100.0,
            epoch_time_s=time_s / epochs - 0.5,
            num_frozen_layers=2 * (epoch - 1) if variant == "elastic" else 0,
            pipe_len=1,
            dp_degree=2,
            num_micro_batches=1,
            lr=float(warmup),  # what the fake was handed, for the test to read back
            eval_time_s=0.5,
        )
        append_jsonl(run_dir / "metrics.jsonl", line.to_dict())
    decided_by = {}
    if variant == "elastic":
        for index in range(1, epochs):
            event = FreezeDecisionEvent(
                index, index - 1, 10 * index, 2 * (index - 1), 2 * index, 5, 2 * index, 5, "bound"
            )
            append_jsonl(run_dir / "events.jsonl", event.to_dict())
        decided_by = {"bound": epochs - 1}
    else:
        (run_dir / "events.jsonl").touch()
    summary = RunSummary(
        training_time_s=time_s,
        attempts=1,
        final_eval_metric=final,
        best_eval_metric=final,
        epochs=epochs,
        global_steps=10 * epochs,
        num_transitions=0,
        final_num_frozen_layers=0,
        final_pipe_len=1,
        final_dp_degree=2,
        world_size=2,
        device="cpu",
        checkpoint=None,
        metric_name="accuracy",
        freeze_decisions=sum(decided_by.values()),
        freeze_decided_by=decided_by,
        format_version=3,  # evaluations at epoch ends only (runs/records.py, "Formats")
    )
    write_json_atomic(run_dir / "summary.json", summary.to_dict())


@pytest.fixture
def fake_training(monkeypatch):
    launched: list = []

    def launch_local(nproc, fn, args):
        # A trainer run's arguments, or a peer's (its name first).
        config, run_dir = args[1:3] if isinstance(args[0], str) else args[:2]
        launched.append((run_dir.parent.name, run_dir.name, config.optimizer.warmup_steps))
        variant = run_dir.name if budget_of(run_dir.name) is None else "ddp"
        _fake_run(
            run_dir,
            variant,
            config.trainer.epochs,
            config.trainer.seed,
            config.optimizer.warmup_steps,
        )

    monkeypatch.setattr(execute, "launch_local", launch_local)
    monkeypatch.setattr(outputs, "measured_unit_costs", lambda config: None)
    return launched


def test_compare_budgets_end_to_end(tmp_path, fake_training, capsys):
    out = tmp_path / "cmp"
    overrides = ["trainer.epochs=3", "optimizer.warmup_steps=10"]
    config = load_config(QUICKSTART, overrides)
    assert (
        run_compare(
            config, CompareRequest(QUICKSTART, out, overrides, seeds=[0, 1], budgets=[1, 2, 3])
        )
        == 0
    )
    # Five runs a seed, in an order that rotates with the seed, each budget with its warm-up.
    planned = ["baseline", "elastic", "ddp_1ep", "ddp_2ep", "ddp_3ep"]
    assert [r[1] for r in fake_training if r[0] == "seed-0"] == planned
    assert [r[1] for r in fake_training if r[0] == "seed-1"] == planned[1:] + planned[:1]
    assert read_order(out / "seed-1") == planned[1:] + planned[:1]
    warmups = {name: warmup for seed, name, warmup in fake_training if seed == "seed-0"}
    assert warmups == {"baseline": 10, "elastic": 10, "ddp_1ep": 3, "ddp_2ep": 7, "ddp_3ep": 10}

    results = json.loads((out / "results.json").read_text())
    assert results["run_order"] == {"0": planned, "1": planned[1:] + planned[:1]}
    assert "--budgets 1,2,3" in results["command"]
    # The existing tables are unchanged: budget runs are not variants of the seeded stats.
    assert [v["variant"] for v in results["seeded"]["variants"]] == ["baseline", "elastic"]
    # Every run of every seed with its per-epoch record.
    runs = {(r["variant"], r["seed"]): r for r in results["runs"]}
    assert len(runs) == 10
    elastic = runs[("elastic", 1)]
    assert [e["num_frozen_layers"] for e in elastic["epochs"]] == [0, 2, 4]
    # Training time at each epoch's end: these fakes are of summary format 3 (no
    # evaluations.jsonl), so their epochs' training seconds add up.
    assert [e["training_time_s"] for e in elastic["epochs"]] == pytest.approx([5.5, 11.0, 16.5])
    assert [e["eval_metric"] for e in elastic["epochs"]] == pytest.approx([0.81, 0.82, 0.83])
    assert elastic["freeze_decided_by"] == {"bound": 2}
    assert [d["decided_by"] for d in elastic["decisions"]] == ["bound", "bound"]
    assert results["decided_by"] == [
        {
            "variant": "elastic",
            "runs": 2,
            "decisions": 4,
            "counts": {
                "signal": 0,
                "agree": 0,
                "bound": 4,
                "cap": 0,
                "schedule": 0,
                "no_signal": 0,
                "plan": 0,
                "layout": 0,
            },
        }
    ]

    # DDP's curve per seed: (10 s, 0.75), (20 s, 0.80), (30 s, 0.85). Seed 0's full system
    # (18 s, 0.82) needs 24 s of DDP: 24/18; at 18 s DDP is at 0.79: +3 points. Seed 1's
    # (18 s, 0.83) needs 26 s: 26/18, +4 points. The baseline (45 s, 0.85) is reached at
    # 30 s: 30/45, and at 45 s DDP is at least 0.85 (beyond its longest budget): at most 0.
    tta = results["time_to_accuracy"]
    assert tta["curve_variants"] == ["ddp_1ep", "ddp_2ep", "ddp_3ep"]
    assert [p["time_s"] for p in tta["curves"]["0"]] == [10.0, 20.0, 30.0]
    by_variant = {v["variant"]: v for v in tta["variants"]}
    full = by_variant["elastic"]
    expected = math.sqrt(24 / 18 * 26 / 18)
    assert full["time_to_accuracy"]["mean"] == pytest.approx(expected)
    assert full["time_to_accuracy"]["kind"] == "exact"
    assert full["equal_time_points"]["mean"] == pytest.approx(3.5)
    assert full["equal_time_points"]["low"] < 3.5 < full["equal_time_points"]["high"]
    base = by_variant["baseline"]
    assert base["time_to_accuracy"]["mean"] == pytest.approx(30 / 45)
    assert base["equal_time_points"]["kind"] == "at most"
    assert base["equal_time_points"]["mean"] == pytest.approx(0.0, abs=1e-9)

    report = (out / "report.md").read_text()
    assert "## Time-to-accuracy against DDP's budget curve" in report
    assert f"| PipeTransformer (full system) | 2 | {expected:.2f}x [" in report
    assert "(+3.00 to +4.00) | 1.67x |" in report  # fixed-epoch: DDP's 3 epochs, 30 s / 18 s
    assert full["fixed_epoch_speedup"] == pytest.approx(30 / 18)
    assert "| DDP, 1 epoch (schedule fitted) | 2 | 10.0 ± 0.0 | 0.7500 ± 0.0000 |" in report
    assert "at most +0.00" in report and "**fixed-epoch**" in report
    assert "## Who set the frozen layer count" in report
    assert "| PipeTransformer (full system) | 2 | 4 | 0 | 0 | 4 | 0 | 0 | 0 |" in report
    assert "seed 1: elastic, ddp_1ep, ddp_2ep, ddp_3ep, baseline" in report
    assert (out / "accuracy_time.png").read_bytes()[:4] == b"\x89PNG"
    assert "accuracy_time.png" in results["plots"]
    assert report in capsys.readouterr().out

    # --report-only: the same figures from the records, nothing run.
    fake_training.clear()
    (out / "report.md").unlink()
    assert rebuild_compare(config, CompareRequest(QUICKSTART, out)) == 0
    again = json.loads((out / "results.json").read_text())
    assert fake_training == []
    assert again["time_to_accuracy"] == results["time_to_accuracy"]
    assert again["runs"] == results["runs"] and again["run_order"] == results["run_order"]
    assert (out / "report.md").read_text() == report


def test_without_seeds_one_curve_and_the_detail_tables_keep_their_variants(tmp_path, fake_training):
    out = tmp_path / "one"
    overrides = ["trainer.epochs=2"]
    config = load_config(QUICKSTART, overrides)
    assert run_compare(config, CompareRequest(QUICKSTART, out, overrides, budgets=[1])) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["variants"]) == ["baseline", "elastic"]
    (elastic,) = [v for v in results["time_to_accuracy"]["variants"] if v["variant"] == "elastic"]
    # One DDP point (10 s, 0.75): the full system's 0.82 is above it: at least 10/18.
    assert elastic["time_to_accuracy"]["kind"] == "at least"
    assert elastic["time_to_accuracy"]["mean"] == pytest.approx(10 / 18)
    assert elastic["time_to_accuracy"]["low"] is None  # one seed: no interval
    assert "run_order" not in results


def test_budgets_through_the_command_line(tmp_path, fake_training, capsys):
    from pipetransformer import cli

    def main(*argv):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["compare", QUICKSTART, *argv])
        return exit_.value.code

    out = tmp_path / "cmp"
    assert main("trainer.epochs=2", "--budgets", "1", "--out", str(out)) == 0
    assert [name for _, name, _ in fake_training] == ["baseline", "elastic", "ddp_1ep"]
    assert "--budgets 1" in json.loads((out / "results.json").read_text())["command"]
    fake_training.clear()
    # --peers without --budgets: the default ladder below the config's epochs (1 of 2);
    # 'none' turns it off.
    assert (
        main("trainer.epochs=2", "--peers", "--budgets", "none", "--out", str(tmp_path / "p")) == 0
    )
    assert not [name for _, name, _ in fake_training if budget_of(name) is not None]
    fake_training.clear()
    assert main("trainer.epochs=2", "--peers", "--out", str(tmp_path / "ladder")) == 0
    assert [name for _, name, _ in fake_training if budget_of(name) is not None] == ["ddp_1ep"]
    # --variants without DDP (a model whose replica does not fit): no default ladder.
    fake_training.clear()
    only = ["--variants", "fsdp,freeze_fsdp", "--out", str(tmp_path / "fsdp")]
    assert main("trainer.epochs=2", "--peers", *only) == 0
    assert not [name for _, name, _ in fake_training if budget_of(name) is not None]
    assert main("--budgets", "0", "--out", str(out)) == 2
    assert main("--budgets", "1,1", "--out", str(out)) == 2
    assert main("--out", str(out), "--report-only", "--budgets", "1") == 2
    assert "leave out --seeds/--repeats/--budgets" in capsys.readouterr().err
