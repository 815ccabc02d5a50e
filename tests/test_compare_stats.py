"""compare over seeds: the statistics on hand-made numbers, the verdict at the margin's edges,
and resuming / rebuilding a comparison over seeds from finished run directories (the runs
are faked: no training process starts). Time-to-target: tests/test_time_to_target.py."""

import json
import math
from pathlib import Path

import pytest

from pipetransformer import cli
from pipetransformer.compare import CompareRequest, execute, outputs, rebuild_compare, run_compare
from pipetransformer.compare.report import (
    finished_seed_runs,
    read_seed_run,
    seeded_section,
    write_report,
)
from pipetransformer.compare.stats import (
    HIGHER,
    INCONCLUSIVE,
    LOWER,
    NOT_DISTINGUISHED,
    NOT_WORSE,
    ONE_SEED,
    WORSE,
    Interval,
    SeedRun,
    distinguishable,
    mean_std,
    seeded_stats,
    t_quantile_975,
    verdict,
)
from pipetransformer.config import ConfigError, load_config
from pipetransformer.runs.records import CheckpointEvent, EpochMetrics, RunSummary
from pipetransformer.utils.files import append_jsonl, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def seed_run(variant, seed, wall, final, best=None):
    return SeedRun(variant, seed, wall, final, final if best is None else best)


def test_t_quantiles_are_the_tables():
    # Two-sided 95% quantiles of Student's t, as printed in any statistics table.
    assert t_quantile_975(1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile_975(2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile_975(30) == pytest.approx(2.042, abs=1e-3)


def test_statistics_over_three_seeds_by_hand():
    runs = [
        seed_run("baseline", 0, 100.0, 0.90),
        seed_run("baseline", 1, 110.0, 0.80),
        seed_run("baseline", 2, 120.0, 0.85, best=0.86),
        seed_run("elastic", 0, 50.0, 0.91),
        seed_run("elastic", 1, 55.0, 0.82),
        seed_run("elastic", 2, 80.0, 0.88),
    ]
    stats = seeded_stats(runs, "baseline", margin_points=1.0)
    assert stats.seeds == (0, 1, 2)
    base, elastic = stats.variants
    assert (base.variant, elastic.variant) == ("baseline", "elastic")
    assert base.training_time_s.mean == pytest.approx(
        110.0
    ) and base.training_time_s.std == pytest.approx(10.0)
    assert base.final_eval_metric.mean == pytest.approx(0.85)
    assert base.final_eval_metric.std == pytest.approx(0.05)
    assert base.best_eval_metric.mean == pytest.approx((0.90 + 0.80 + 0.86) / 3)
    (pair,) = stats.pairs
    # Speedups paired by seed: 100/50, 110/55, 120/80.
    assert pair.speedup_mean == pytest.approx((2.0 * 2.0 * 1.5) ** (1 / 3))  # geometric
    assert pair.speedup_of_mean_times == pytest.approx((100 + 110 + 120) / (50 + 55 + 80))
    logs = [math.log(2.0), math.log(2.0), math.log(1.5)]
    spread = math.sqrt(sum((v - sum(logs) / 3) ** 2 for v in logs) / 2)
    half = 4.30265273 * spread / math.sqrt(3)  # t(0.975, 2 degrees of freedom)
    assert pair.speedup_interval.low == pytest.approx(pair.speedup_mean * math.exp(-half))
    assert pair.speedup_interval.high == pytest.approx(pair.speedup_mean * math.exp(half))
    assert (pair.speedup_min, pair.speedup_max) == (pytest.approx(1.5), pytest.approx(2.0))
    # Differences +1, +2, +3 points: mean 2, sample std 1, half width 4.303 / sqrt(3).
    assert pair.metric_difference_points.mean == pytest.approx(2.0)
    assert pair.metric_difference_points.std == pytest.approx(1.0)
    half = 4.3027 / math.sqrt(3)
    assert pair.interval_points.low == pytest.approx(2.0 - half, abs=1e-3)
    assert pair.interval_points.high == pytest.approx(2.0 + half, abs=1e-3)
    assert pair.verdict == NOT_WORSE  # -0.48 > -1
    # A tighter margin than the interval's lower bound: no longer shown to be not worse.
    assert seeded_stats(runs, "baseline", margin_points=0.4).pairs[0].verdict == INCONCLUSIVE


def test_pairs_use_the_seeds_both_ran_and_one_seed_has_no_interval():
    runs = [
        seed_run("baseline", 0, 100.0, 0.90),
        seed_run("baseline", 1, 100.0, 0.90),
        seed_run("elastic", 1, 40.0, 0.70),
        seed_run("ddp", 5, 40.0, 0.70),  # no baseline at seed 5: nothing to pair
    ]
    stats = seeded_stats(runs, "baseline")
    (pair,) = stats.pairs
    assert pair.seeds == (1,) and pair.speedup_mean == pytest.approx(2.5)
    assert pair.interval_points is None and pair.verdict == ONE_SEED
    assert pair.metric_difference_points.mean == pytest.approx(-20.0)
    assert [v.variant for v in stats.variants] == ["baseline", "elastic", "ddp"]
    assert mean_std([3.0]).std == 0.0
    with pytest.raises(ValueError, match="no finished baseline"):
        seeded_stats(runs[2:], "baseline")


def test_pairs_against_the_peer_leave_out_baseline_and_peer():
    runs = [
        seed_run("baseline", 0, 100.0, 0.80),
        seed_run("baseline", 1, 100.0, 0.80),
        seed_run("ddp", 0, 80.0, 0.90),
        seed_run("ddp", 1, 90.0, 0.92),
        seed_run("elastic", 0, 40.0, 0.85),
        seed_run("elastic", 1, 45.0, 0.87),
    ]
    stats = seeded_stats(runs, "baseline", margin_points=1.0, peer="ddp")
    assert [p.variant for p in stats.pairs] == ["ddp", "elastic"]
    (pair,) = stats.peer_pairs
    assert stats.peer == "ddp" and pair.variant == "elastic"
    # Speedups 80/40 and 90/45; differences -5 and -5 points against DDP (+5, +7 against the
    # baseline): an interval of width 0 at -5, below -1.
    assert pair.speedup_mean == pytest.approx(2.0)
    assert pair.metric_difference_points.mean == pytest.approx(-5.0)
    assert pair.verdict == WORSE
    assert stats.pairs[1].metric_difference_points.mean == pytest.approx(6.0)
    text = "\n".join(seeded_section(stats, "accuracy"))
    assert "| against ddp | seeds |" in text
    assert (
        "| elastic | 2 | 2.00x [2.00, 2.00] (2.00 - 2.00x); 2.00x | -5.00 ± 0.00 | [-5.00, -5.00] "
        "| worse | lower |" in text
    )
    # No such peer run: no peer pairs, and the report has no second table.
    no_peer = seeded_stats([r for r in runs if r.variant != "ddp"], "baseline", peer="ddp")
    assert no_peer.peer is None and no_peer.peer_pairs == ()


def test_distinguishable_only_when_the_interval_excludes_zero():
    # An interval wholly below 0 that still reaches past -margin: the verdict cannot decide,
    # yet the variant is measurably less accurate, and the report must say so.
    interval = Interval(-3.71, -0.57)
    assert verdict(interval, 1.0) == INCONCLUSIVE and distinguishable(interval) == LOWER
    assert distinguishable(Interval(0.2, 1.0)) == HIGHER
    assert distinguishable(Interval(-0.5, 0.0)) == NOT_DISTINGUISHED  # touching 0 is not
    assert distinguishable(Interval(0.0, 0.5)) == NOT_DISTINGUISHED
    assert distinguishable(None) == ONE_SEED


def test_verdict_at_the_margin_edges():
    assert verdict(Interval(-1.0, 2.0), 1.0) == INCONCLUSIVE  # touching -margin is not above it
    assert verdict(Interval(-0.999, 2.0), 1.0) == NOT_WORSE
    assert verdict(Interval(-3.0, -1.0), 1.0) == INCONCLUSIVE  # nor below it
    assert verdict(Interval(-3.0, -1.001), 1.0) == WORSE
    assert verdict(Interval(-3.0, 0.5), 1.0) == INCONCLUSIVE
    assert (
        verdict(Interval(0.0, 0.5), 0.0) == INCONCLUSIVE
        and verdict(Interval(0.01, 0.5), 0.0) == NOT_WORSE
    )
    assert verdict(None, 1.0) == ONE_SEED


def epoch_line(epoch, metric, train_s, eval_s=1.0):
    return EpochMetrics(
        epoch=epoch,
        global_step=10 * epoch,
        train_loss=1.0,
        eval_metric=metric,
        samples_per_s=100.0,
        epoch_time_s=train_s,
        eval_time_s=eval_s if metric is not None else 0.0,
        num_frozen_layers=0,
        pipe_len=2,
        dp_degree=1,
        num_micro_batches=2,
    )


def checkpoint(global_step, write_s):
    return CheckpointEvent(
        global_step, global_step // 10, f"ckpt-{global_step}", "epoch", write_s, 1
    )


def fake_finished_run(run_dir: Path, wall: float, metrics: list[float], frozen: int = 0) -> None:
    """The records a finished run leaves: metrics.jsonl, events.jsonl, summary.json (last)."""
    for epoch, metric in enumerate(metrics, start=1):
        line = epoch_line(epoch, metric, wall / len(metrics) - 1.0)
        line.num_frozen_layers = frozen if epoch > 1 else 0
        append_jsonl(run_dir / "metrics.jsonl", line.to_dict())
        append_jsonl(run_dir / "events.jsonl", checkpoint(10 * epoch, 0.0).to_dict())
    summary = RunSummary(
        training_time_s=wall,
        attempts=1,
        final_eval_metric=metrics[-1],
        best_eval_metric=max(metrics),
        epochs=len(metrics),
        global_steps=10 * len(metrics),
        num_transitions=0,
        final_num_frozen_layers=frozen,
        final_pipe_len=2,
        final_dp_degree=1,
        world_size=2,
        device="cpu",
        checkpoint=None,
        metric_name="accuracy",
    )
    write_json_atomic(run_dir / "summary.json", summary.to_dict())


# What the fake training reaches: baseline 0.90 + seed/100 in 100 s, elastic `seed` points
# less in 80 - seed s.
def fake_launch(launched: list):
    def launch_local(nproc, fn, args):
        config, run_dir, _options = args
        seed, baseline = config.trainer.seed, config.freeze.strategy == "none"
        launched.append((run_dir.parent.name, run_dir.name))
        assert not (run_dir / "metrics.jsonl").exists(), "an unfinished run must start over"
        final = 0.90 + seed / 100 - (0 if baseline else seed / 100)
        fake_finished_run(
            run_dir, 100.0 if baseline else 80.0 - seed, [final - 0.1, final], 0 if baseline else 3
        )

    return launch_local


@pytest.fixture
def fake_training(monkeypatch):
    launched: list = []
    monkeypatch.setattr(execute, "launch_local", fake_launch(launched))
    monkeypatch.setattr(outputs, "measured_unit_costs", lambda config: None)
    return launched


def test_seeded_compare_skips_finished_runs_and_rebuilds(tmp_path, fake_training, capsys):
    out = tmp_path / "cmp"
    fake_finished_run(
        out / "seed-0" / "baseline", 100.0, [0.8, 0.9]
    )  # finished before the interruption
    append_jsonl(
        out / "seed-0" / "elastic" / "metrics.jsonl", {"epoch": 1}
    )  # cut short: no summary
    config = load_config(QUICKSTART)
    with pytest.raises(ConfigError, match="trainer.seed"):
        run_compare(config, CompareRequest(QUICKSTART, out, ["trainer.seed=3"], seeds=[0, 1]))
    assert run_compare(config, CompareRequest(QUICKSTART, out, seeds=[0, 1, 2])) == 0
    assert fake_training == [  # within a seed in an order that rotates (compare/order.py)
        ("seed-0", "elastic"),
        ("seed-1", "elastic"),
        ("seed-1", "baseline"),
        ("seed-2", "baseline"),
        ("seed-2", "elastic"),
    ]
    assert "finished in" in capsys.readouterr().err
    assert finished_seed_runs(out) == {s: ["baseline", "elastic"] for s in (0, 1, 2)}
    assert read_seed_run(
        out / "seed-1" / "elastic", "elastic", 1
    ).final_eval_metric == pytest.approx(0.90)

    results = json.loads((out / "results.json").read_text())
    assert results["detail_seed"] == 0 and results["margin_points"] == 0.5  # the default
    assert "--seeds 0,1,2" in results["command"]
    (pair,) = results["seeded"]["pairs"]
    # Speedups 100/80, 100/79, 100/78; differences 0, -1, -2 points: mean -1, std 1.
    assert pair["speedup_min"] == pytest.approx(1.25) and pair["speedup_max"] == pytest.approx(
        100 / 78
    )
    assert pair["metric_difference_points"]["mean"] == pytest.approx(-1.0)
    assert pair["metric_difference_points"]["std"] == pytest.approx(1.0)
    assert pair["interval_points"]["low"] == pytest.approx(-1.0 - 4.3027 / math.sqrt(3), abs=1e-3)
    assert pair["verdict"] == INCONCLUSIVE
    report = (out / "report.md").read_text()
    assert "## Over 3 seed(s): 0, 1, 2" in report and "## Seed 0 in detail" in report
    assert (
        "| elastic | 3 | 1.27x [1.23, 1.31] (1.25 - 1.28x); 1.27x | -1.00 ± 1.00 | [-3.48, +1.48] "
        "| inconclusive |" in report
    )
    for plot in results["plots"]:
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
    assert "seeds.png" in results["plots"]

    # Run again: everything is finished, nothing starts.
    fake_training.clear()
    assert run_compare(config, CompareRequest(QUICKSTART, out, seeds=[0, 1, 2])) == 0
    assert fake_training == []

    # --report-only with a wider margin: rebuilt from the runs, nothing started; the command
    # that produced the runs is kept.
    (out / "report.md").unlink()
    assert rebuild_compare(config, CompareRequest(QUICKSTART, out, margin_points=4.0)) == 0
    rebuilt = json.loads((out / "results.json").read_text())
    assert fake_training == [] and rebuilt["command"] == results["command"]
    assert rebuilt["margin_points"] == 4.0 and rebuilt["seeded"]["pairs"][0]["verdict"] == NOT_WORSE
    assert rebuilt["variants"] == results["variants"]
    assert "not worse" in (out / "report.md").read_text()
    # Without --margin the rebuild keeps the margin of the last results.json.
    assert rebuild_compare(config, CompareRequest(QUICKSTART, out)) == 0
    assert json.loads((out / "results.json").read_text())["margin_points"] == 4.0


def test_report_only_through_the_command_line(tmp_path, fake_training, capsys):
    out = tmp_path / "cmp"
    for seed in (0, 1):
        fake_finished_run(out / f"seed-{seed}" / "baseline", 100.0, [0.8, 0.9])
        fake_finished_run(out / f"seed-{seed}" / "elastic", 70.0 + seed, [0.8, 0.9], frozen=3)
    fake_finished_run(out / "seed-2" / "baseline", 100.0, [0.8, 0.9])  # its elastic never ran

    def main(*argv):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["compare", QUICKSTART, *argv])
        return exit_.value.code

    assert main("--out", str(out), "--report-only") == 0
    assert fake_training == []
    results = json.loads((out / "results.json").read_text())
    assert [v["variant"] for v in results["seeded"]["variants"]] == ["baseline", "elastic"]
    assert results["seeded"]["variants"][0]["seeds"] == [0, 1, 2]
    assert results["seeded"]["pairs"][0]["seeds"] == [0, 1]
    assert main("--out", str(out), "--report-only", "--seeds", "0,1") == 2
    assert main("--out", str(out), "--report-only", "--curves", "ddp") == 2
    assert main("--out", str(out), "--report-only", "--margin", "-1") == 2
    assert main("--seeds", "0,0", "--out", str(out)) == 2  # argparse: duplicate seeds
    assert main("--seeds", "0", "--repeats", "2", "--out", str(out)) == 2  # one or the other
    err = capsys.readouterr().err
    assert "leave out --seeds/--repeats/--budgets/--curves" in err
    assert "not allowed with argument" in err


def test_write_report_shows_one_seed_without_interval(tmp_path):
    fake_finished_run(tmp_path / "baseline", 100.0, [0.8, 0.9])
    fake_finished_run(tmp_path / "elastic", 80.0, [0.8, 0.88], frozen=3)
    runs = [read_seed_run(tmp_path / name, name, 0) for name in ("baseline", "elastic")]
    stats = seeded_stats(runs, "baseline")
    from pipetransformer.compare.report import build_results, read_run

    results = build_results(
        {name: read_run(tmp_path / name) for name in ("baseline", "elastic")}, None, False, {}
    )
    results["detail_seed"] = 0
    text = write_report(results, tmp_path, [], stats)
    assert (
        "| elastic | 1 | 1.25x (1.25 - 1.25x); 1.25x | -2.00 ± 0.00 | - | one seed: no interval |"
        in text
    )


def test_speedups_average_as_ratios():
    """2x and 0.5x average to 1x (the mean of logs), with the t interval on the logs: by hand,
    logs +-ln 2, mean 0, std ln(2) * sqrt(2), half-width 12.706 * std / sqrt(2)."""
    from pipetransformer.compare.stats import geometric_mean_ratio

    stats = geometric_mean_ratio([2.0, 0.5])
    assert stats.mean == pytest.approx(1.0)
    half = 12.7062047 * math.log(2.0)
    assert stats.low == pytest.approx(math.exp(-half), rel=1e-6)
    assert stats.high == pytest.approx(math.exp(half), rel=1e-6)
    assert (stats.min, stats.max, stats.n) == (0.5, 2.0, 2)
    one = geometric_mean_ratio([1.3])
    assert one.mean == pytest.approx(1.3) and one.low is None
    with pytest.raises(ValueError, match="positive"):
        geometric_mean_ratio([1.0, 0.0])
