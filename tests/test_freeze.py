"""Freeze decisions: Eq. 1, the closed form, manual; monotone and capped."""

import math

import pytest

from pipetransformer.config import ConfigError, FreezeConfig
from pipetransformer.freeze import (
    FreezeDecider,
    alpha_schedule_decision,
    check_freeze_config,
    gradient_norm_decision,
)


def test_eq1_bound_by_alpha():
    # L=12, F=0: the bound is floor(12/3)=4; the smallest norm is at layer 9, so Eq. 1
    # takes the bound.
    norms = [5, 4, 3, 3.5, 2, 2.5, 2, 1.9, 1.8, 0.5, 1, 1.2]
    assert gradient_norm_decision(0, norms, 1 / 3, 11) == 4


def test_eq1_bound_by_argmin_inclusive():
    # The smallest norm at layer 1 (inside the alpha bound): freeze layers 0 and 1.
    norms = [5, 0.1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    assert gradient_norm_decision(0, norms, 1 / 3, 11) == 2


def test_eq1_only_looks_at_active_layers():
    # Frozen layers' norms (whatever they are) are ignored: from F=4, argmin over 4..11.
    norms = [0, 0, 0, 0, 9, 9, 0.2, 9, 9, 9, 9, 9]
    assert gradient_norm_decision(4, norms, 0.5, 11) == 7
    # floor(alpha * (L - F)) = floor(0.2 * 8) = 1: one more layer at most.
    assert gradient_norm_decision(4, norms, 0.2, 11) == 5


def test_eq1_stops_when_the_bound_rounds_to_zero():
    norms = [1.0] * 8
    assert gradient_norm_decision(6, norms, 1 / 3, 7) == 6  # floor(2/3) = 0


def test_eq1_rounded_alpha_counts_as_the_fraction():
    # 0.3333333333 * 3 = 0.9999999999: one more layer, as with alpha = 1/3 exactly.
    assert gradient_norm_decision(5, [1.0] * 8, 0.3333333333, 7) == 6
    assert gradient_norm_decision(5, [1.0] * 8, 1 / 3, 7) == 6


def test_eq1_ties_go_to_the_lower_layer():
    assert gradient_norm_decision(0, [2, 1, 1, 1, 2, 2], 0.9, 5) == 2


def test_eq1_sequence_is_monotone_and_capped():
    norms_seq = [
        [3, 2, 1, 4, 4, 4, 4, 4],
        [3, 2, 1, 0.5, 4, 4, 4, 4],
        [9, 9, 9, 9, 9, 9, 9, 0.1],
        [9, 9, 9, 9, 9, 9, 9, 0.1],
        [9, 9, 9, 9, 9, 9, 9, 0.1],
    ]
    frozen, history = 0, []
    for norms in norms_seq:
        frozen = gradient_norm_decision(frozen, norms, 0.5, 7)
        history.append(frozen)
    assert history == [3, 4, 6, 7, 7]
    assert all(b >= a for a, b in zip(history, history[1:]))


def test_closed_form_matches_formula_and_is_monotone():
    L, alpha = 12, 1 / 3
    values = [alpha_schedule_decision(t, L, alpha, 0, L) for t in range(1, 8)]
    assert values == [math.ceil(L * (1 - (1 - alpha) ** t) - 1e-6) for t in range(1, 8)]
    assert values[:3] == [4, 7, 9]
    assert alpha_schedule_decision(50, L, alpha, 0, 11) == 11  # capped


def test_decider_strategies():
    L = 8
    manual = FreezeDecider(FreezeConfig(strategy="manual", manual_schedule=[1, 3, 3, 6]), L)
    assert [manual.decide(t, 0) for t in (1, 2, 3, 4, 5)] == [1, 3, 3, 6, 6]
    assert manual.decide(1, 4) == 4  # never decreases
    none = FreezeDecider(FreezeConfig(strategy="none"), L)
    assert none.decide(3, 0) == 0
    capped = FreezeDecider(
        FreezeConfig(strategy="alpha_schedule", alpha=0.9, max_frozen_layers=5), L
    )
    assert capped.decide(4, 0) == 5
    default_cap = FreezeDecider(FreezeConfig(strategy="alpha_schedule", alpha=0.9), L)
    assert default_cap.decide(10, 0) == L - 1  # the last block always trains by default
    grad = FreezeDecider(FreezeConfig(strategy="gradient_norm", alpha=0.5), L)
    with pytest.raises(ValueError):
        grad.decide(1, 0, None)
    assert grad.decide(1, 0, [1, 0.1, 1, 1, 1, 1, 1, 1]) == 2


def test_depth_dependent_checks():
    with pytest.raises(ConfigError, match="freeze.max_frozen_layers"):
        check_freeze_config(FreezeConfig(max_frozen_layers=9), 8)
    with pytest.raises(ConfigError, match="freeze.manual_schedule"):
        check_freeze_config(FreezeConfig(strategy="manual", manual_schedule=[2, 12]), 8)


def test_decision_cadence():
    from pipetransformer.config import FreezeConfig
    from pipetransformer.freeze import DecisionSchedule, min_interval_for

    def due_steps(schedule, steps_per_epoch=7, epochs=3):
        found, since = [], 0
        for step in range(1, steps_per_epoch * epochs + 1):
            since += 1
            if schedule.due(step, step % steps_per_epoch == 0, since):
                found.append(step)
                since = 0
        return found

    # Epoch ends (null), after one warm-up epoch; never after the last step.
    per_epoch = DecisionSchedule.for_config(
        FreezeConfig(interval_steps=None, warmup_epochs=1), 3, 7
    )
    assert due_steps(per_epoch) == [7, 14]
    # auto: three a 7-step epoch (every ceil(7 / 3) = 3 steps); none in the warm-up epoch, the
    # first once it is over (its steps count towards the interval).
    auto = DecisionSchedule.for_config(FreezeConfig(interval_steps="auto", warmup_epochs=1), 3, 7)
    assert auto.interval_steps == 3 and due_steps(auto) == [8, 11, 14, 17, 20]
    # ... spaced out when transitions are costly: 0.2 s transitions, 0.1 s steps -> 40 steps.
    assert min_interval_for(0.2, 0.1) == 40 and min_interval_for(0.001, 0.1) == 1
    spaced = DecisionSchedule.for_config(
        FreezeConfig(interval_steps="auto"), 3, 7, min_interval_steps=10
    )
    assert due_steps(spaced) == [10, 20]
