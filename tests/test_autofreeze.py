"""AutoFreeze's rule (freeze.strategy autofreeze) as its paper and released code state it,
and `freeze.embedding`: the rule's ranks and percentiles, its interval, the accumulated
signal the trainer hands it (a 2-stage pipeline against one process), and an embedding
that stays frozen from the first step."""

import math

import numpy as np
import pytest
import torch

from pipetransformer.autopipe.planner import AutoPipePlanner, UnitCosts, balance
from pipetransformer.config import ConfigError, FreezeConfig, config_from_dict
from pipetransformer.freeze import (
    DecisionSchedule,
    FreezeDecider,
    autofreeze_outcome,
    percentile,
)

L = 6


def decide(frozen, sums, previous, q=50.0, max_frozen=L - 1):
    return autofreeze_outcome(frozen, sums, previous, q, max_frozen).num_frozen_layers


@pytest.mark.parametrize("q", [0, 10, 25, 50, 62.5, 90, 100])
@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [0.4, 0.1, 0.3, 0.2], [5, 1, 4, 2, 3, 9]])
def test_percentile_is_numpys_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_layers_below_the_first_change_at_or_above_the_median_freeze():
    previous = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # changes 0.01 0.02 0.5 0.03 0.6 0.7: median 0.265; the first at or above it is layer 2
    now = [0.99, 1.02, 1.5, 0.97, 1.6, 1.7]
    assert decide(0, now, previous) == 2
    # a rank, not a threshold: the same pattern ten times larger freezes the same layers
    now_large = [1 - 0.1, 1 + 0.2, 1 + 5, 1 - 0.3, 1 + 6, 1 + 7]
    assert decide(0, now_large, previous) == 2
    # only the active layers rank: from F = 3 the changes are 0.03 0.6 0.7 (median 0.6)
    assert decide(3, now, previous) == 4


def test_the_released_codes_example_by_hand():
    """AutoFreeze's loop: ratio |prev - cur| / prev per layer, numpy's percentile of the
    active layers' ratios, the first layer whose ratio is at least that."""
    prev = [4.0, 3.0, 2.5, 2.0, 1.5, 1.0]
    cur = [3.8, 2.7, 2.5, 1.0, 1.4, 0.5]
    ratios = [abs(p - c) / p for p, c in zip(prev, cur)]
    cut = np.percentile(ratios, 50)
    expected = next(i for i, r in enumerate(ratios) if r >= cut)
    assert decide(0, cur, prev) == expected == 1


def test_first_decision_only_measures_and_nothing_ever_unfreezes():
    assert decide(0, [1.0] * L, None) == 0
    assert decide(2, [1.0] * L, []) == 2
    # every ratio equal: the median is that ratio and the first active layer reaches it
    assert decide(2, [1.0] * L, [1.0] * L) == 2
    assert decide(4, [1.0] * L, [2.0] * L, max_frozen=3) == 4


def test_caps_and_unusable_ratios():
    previous = [1.0] * L
    rising = [1.0 + 0.1 * (layer + 1) for layer in range(L)]  # median between layers 2 and 3
    assert decide(0, rising, previous) == 3
    assert decide(0, rising, previous, max_frozen=2) == 2
    # a previous signal of 0 or a NaN has no ratio: it ranks as unconverged (infinite)
    assert decide(0, rising, [0.0, *previous[1:]]) == 0
    assert decide(0, [math.nan, *rising[1:]], previous) == 0
    assert decide(0, rising, previous, q=100) == L - 1


def test_bad_input_is_an_error():
    with pytest.raises(ValueError, match="previous layer gradient sums"):
        decide(0, [1.0] * L, [1.0] * (L - 1))
    with pytest.raises(ValueError, match="negative"):
        decide(0, [-1.0, *([1.0] * (L - 1))], [1.0] * L)
    with pytest.raises(ValueError, match="percentile"):
        decide(0, [1.0] * L, [1.0] * L, q=101)
    with pytest.raises(ValueError, match="gradient sums"):
        FreezeDecider(FreezeConfig(strategy="autofreeze"), L).decide(1, 0, [1.0] * L)


def test_config_keys_name_themselves():
    config = config_from_dict(
        {"freeze": {"strategy": "autofreeze", "percentile": 40, "embedding": True}}
    )
    assert (config.freeze.percentile, config.embedding_frozen) == (40, True)
    with pytest.raises(ConfigError, match="freeze.percentile"):
        config_from_dict({"freeze": {"strategy": "autofreeze", "percentile": 150}})
    # the baseline trains the embedding whatever freeze.embedding says
    assert not config_from_dict({"freeze": {"embedding": True}}).embedding_frozen


def test_signal_to_noise_refuses_coupled_weight_decay():
    base = {"freeze": {"strategy": "signal_to_noise"}}
    with pytest.raises(ConfigError, match="coupled decay"):
        config_from_dict({**base, "optimizer": {"name": "adam", "weight_decay": 0.01}})
    config_from_dict({**base, "optimizer": {"name": "adamw", "weight_decay": 0.01}})


def test_auto_interval_is_a_tenth_of_the_run_for_autofreeze():
    """As AutoFreeze's code cuts the run: int(epochs * steps / num_intervals), 10 by its
    argparse default, 20 in its README's command."""
    auto = DecisionSchedule.for_config(FreezeConfig(strategy="autofreeze"), 125, epochs=3)
    assert auto.interval_steps == 37  # int(375 / 10)
    twentieth = FreezeConfig(strategy="autofreeze", num_intervals=20)
    assert DecisionSchedule.for_config(twentieth, 125, epochs=3).interval_steps == 18
    tiny = FreezeConfig(strategy="autofreeze", num_intervals=20)
    assert DecisionSchedule.for_config(tiny, 3, epochs=1).interval_steps == 1  # at least 1
    eq1 = DecisionSchedule.for_config(FreezeConfig(strategy="gradient_norm"), 125, epochs=3)
    assert eq1.interval_steps == 42  # three an epoch
    pinned = FreezeConfig(strategy="autofreeze", interval_steps=None)
    assert DecisionSchedule.for_config(pinned, 125, epochs=3).interval_steps is None
    with pytest.raises(ConfigError, match="freeze.num_intervals"):
        config_from_dict({"freeze": {"strategy": "autofreeze", "num_intervals": 0}})


def test_the_signal_reads_raw_gradients_for_autofreeze_and_clipped_for_the_others():
    """AutoFreeze's code sums param.grad before its optimizer clips; freeze.signal_gradients
    picks either for any rule."""
    assert FreezeConfig(strategy="autofreeze").signal_before_clipping
    assert not FreezeConfig(strategy="gradient_norm").signal_before_clipping
    clipped = FreezeConfig(strategy="autofreeze", signal_gradients="clipped")
    assert not clipped.signal_before_clipping
    assert FreezeConfig(strategy="gradient_norm", signal_gradients="raw").signal_before_clipping
    with pytest.raises(ConfigError, match="freeze.signal_gradients"):
        config_from_dict({"freeze": {"signal_gradients": "unclipped"}})


def test_a_frozen_embedding_is_the_frozen_prefix_from_the_start():
    costs = UnitCosts.from_param_counts([100, 10, 20, 10, 20, 10, 20, 5], 1 / 6)
    plan = balance(costs, 0, 2, frozen_embedding=True)
    assert (plan.prefix_end, plan.frozen_end, plan.stage_ranges[0][0]) == (1, 1, 1)
    assert balance(costs, 0, 2).frozen_end == 0
    # from the first frozen layer on the prefix is the same either way
    assert balance(costs, 2, 2, frozen_embedding=True).prefix_end == balance(costs, 2, 2).prefix_end
    planner = AutoPipePlanner(costs, 2, frozen_embedding=True)
    assert planner.initial.frozen_end == 1 and planner.plan(0, 2).frozen_end == 1


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_hands_the_rule_what_one_process_measures(tmp_path):
    """Slow: ~10 s on 2 cores (a 2-stage pipeline and one process, each a run of its own).
    2 ranks in a 2-stage pipeline against 1 process, autofreeze at its 'auto' interval and
    the embedding frozen: the same accumulated signals (the stages' layers gathered), the
    same decisions, losses equal to float tolerance; the embedding's weights never move and
    the optimizer never holds them."""
    from helpers import run_workers
    from reference import elastic_config, step_losses
    from workers import freeze_signal_run

    common = dict(freeze__strategy="autofreeze", freeze__embedding=True, freeze__manual_schedule=[])
    common["freeze__interval_steps"] = "auto"
    pipe = elastic_config(trainer__nproc_per_node=2, pipeline__initial_pipe_len=2, **common)
    single = elastic_config(trainer__nproc_per_node=1, pipeline__initial_pipe_len=1, **common)
    piped = run_workers(freeze_signal_run, 2, pipe, str(tmp_path / "pipe"))
    (alone,) = run_workers(freeze_signal_run, 1, single, str(tmp_path / "single"))
    assert alone["frozen"] and alone["frozen"][-1] > 0  # the rule froze something
    for result in piped:
        assert result["frozen"] == alone["frozen"]
        assert result["sums"] == pytest.approx(alone["sums"], rel=1e-4)
    assert step_losses(tmp_path / "pipe") == pytest.approx(
        step_losses(tmp_path / "single"), rel=1e-4
    )
    for result in [*piped, alone]:
        assert not any(name.startswith("units.0.") for name in result["trainable_at_start"])
        if result["embedding_before"] is not None:
            for key, value in result["embedding_before"].items():
                assert torch.equal(value, result["embedding_after"][key]), key
    holders = [r for r in [*piped, alone] if r["embedding_before"] is not None]
    assert len(holders) == 2  # stage 0's rank and the single process


@pytest.mark.distributed
@pytest.mark.slow
def test_the_raw_signal_is_the_gradient_before_clipping_and_every_decision_is_recorded(tmp_path):
    """Slow (three one-process runs, about 5 s idle).
    One process, two steps, one decision after the first: with a clip far below the
    gradient's norm, the raw signal (AutoFreeze's: param.grad before its optimizer clips)
    equals an unclipped run's, and the clipped signal is smaller. Each decision is an event
    (freeze_decision) and summary.json counts what decided it."""
    import json

    from helpers import run_workers
    from reference import elastic_config
    from workers import freeze_signal_run

    def run(name, **changes):
        config = elastic_config(
            trainer__nproc_per_node=1,
            trainer__epochs=1,
            pipeline__initial_pipe_len=1,
            freeze__strategy="autofreeze",
            freeze__manual_schedule=[],
            freeze__interval_steps=1,
            data__train_subset=64,
            **changes,
        )
        (result,) = run_workers(freeze_signal_run, 1, config, str(tmp_path / name))
        return result["sums"]

    unclipped = run("unclipped", freeze__signal_gradients="clipped")
    raw = run("raw", optimizer__max_grad_norm=1e-4)  # 'auto' is raw for autofreeze
    clipped = run("clipped", optimizer__max_grad_norm=1e-4, freeze__signal_gradients="clipped")
    assert raw == pytest.approx(unclipped, rel=1e-6)
    assert all(c < 0.01 * r for c, r in zip(clipped, raw))
    events = [json.loads(line) for line in (tmp_path / "raw" / "events.jsonl").open()]
    decisions = [e for e in events if e["kind"] == "freeze_decision"]
    assert [(d["decision_index"], d["global_step"], d["decided_by"]) for d in decisions] == [
        (1, 1, "no_signal")  # autofreeze's first decision only measures
    ]
    summary = json.loads((tmp_path / "raw" / "summary.json").read_text())
    assert summary["freeze_decisions"] == 1 and summary["freeze_decided_by"] == {"no_signal": 1}
