"""Freeze decisions: Eq. 1, the closed form, manual; monotone and capped."""

import math

import pytest

from pipetransformer.config import ConfigError, FreezeConfig
from pipetransformer.freeze import (
    FreezeDecider,
    bound_trajectory,
    check_freeze_config,
    eq1_bound,
    gradient_norm_outcome,
)


def gradient_norm_decision(*args, **kwargs) -> int:
    return gradient_norm_outcome(*args, **kwargs).num_frozen_layers


def alpha_schedule_decision(t: int, num_layers: int, alpha: float, frozen: int, cap: int) -> int:
    """The closed form's count at decision `t` from `frozen`, through the rule's one
    implementation (FreezeDecider)."""
    config = FreezeConfig(strategy="alpha_schedule", alpha=alpha, max_frozen_layers=cap)
    return FreezeDecider(config, num_layers).decide(t, frozen)


def test_eq1_bound_rounds_up():
    # L = 12, alpha = 1/3: 4, then 4 + ceil(8/3) = 7, 7 + ceil(5/3) = 9, 9 + 1, 10 + ceil(2/3).
    assert [eq1_bound(f, 12, 1 / 3) for f in (0, 4, 7, 9, 10, 11)] == [4, 7, 9, 10, 11, 12]
    # Rounded down it would stall at 10 (floor(2/3) = 0): up, every decision may freeze one.
    assert eq1_bound(10, 12, 1 / 3) == 11
    # Products within 1e-6 of an integer are that integer: 0.1 * 30 is 3.0000000000000004,
    # 0.3333333333 * 3 is 0.9999999999.
    assert eq1_bound(0, 30, 0.1) == 3
    assert eq1_bound(5, 8, 0.3333333333) == 6 == eq1_bound(5, 8, 1 / 3)
    # Nothing left to freeze: the bound is F itself.
    assert eq1_bound(12, 12, 0.5) == 12 and eq1_bound(13, 12, 0.5) == 13


def test_bound_trajectory_against_the_released_codes_closed_form():
    def closed_form(num_layers, alpha, decisions):
        values, frozen = [], 0
        for t in range(1, decisions + 1):
            frozen = alpha_schedule_decision(t, num_layers, alpha, frozen, num_layers - 1)
            values.append(frozen)
        return values

    # Equal where no rounding compounds ...
    assert bound_trajectory(12, 1 / 3, 6) == closed_form(12, 1 / 3, 6) == [4, 7, 9, 10, 11, 11]
    assert bound_trajectory(12, 0.5, 4) == closed_form(12, 0.5, 4) == [6, 9, 11, 11]
    # ... one layer ahead where each decision rounds up again (BERT-large's 24 layers).
    assert bound_trajectory(24, 1 / 3, 5) == [8, 14, 18, 20, 22]
    assert closed_form(24, 1 / 3, 5) == [8, 14, 17, 20, 21]
    # Never behind it, and capped.
    for num_layers in range(2, 30):
        for alpha in (0.1, 0.25, 1 / 3, 0.5, 0.9):
            ahead = bound_trajectory(num_layers, alpha, 12)
            assert all(a >= b for a, b in zip(ahead, closed_form(num_layers, alpha, 12)))
            assert max(ahead) <= num_layers - 1
    assert bound_trajectory(12, 0.5, 6, max_frozen_layers=8) == [6, 8, 8, 8, 8, 8]


def test_eq1_bound_by_alpha():
    # L=12, F=0: the bound is 4; the smallest norm is at layer 9, so Eq. 1 takes the bound.
    norms = [5, 4, 3, 3.5, 2, 2.5, 2, 1.9, 1.8, 0.5, 1, 1.2]
    assert gradient_norm_decision(0, norms, 1 / 3, 11) == 4


def test_eq1_freezes_the_layers_below_the_argmin_and_keeps_it_active():
    # The smallest norm at layer 2 (inside the bound): layers 0 and 1 freeze, 2 trains.
    norms = [5, 3, 0.1, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    assert gradient_norm_decision(0, norms, 1 / 3, 11) == 2
    # The inclusive variant freezes the argmin layer too.
    assert gradient_norm_decision(0, norms, 1 / 3, 11, inclusive=True) == 3


def test_eq1_argmin_at_the_lowest_active_layer_freezes_nothing():
    norms = [0.1, 5, 5, 5, 5, 5]
    assert gradient_norm_decision(0, norms, 0.5, 5) == 0
    assert gradient_norm_decision(0, norms, 0.5, 5, inclusive=True) == 1
    # From F = 2 the lowest active layer is 2.
    assert gradient_norm_decision(2, [9, 9, 0.1, 5, 5, 5], 0.5, 5) == 2


def test_eq1_only_looks_at_active_layers():
    # Frozen layers' norms (whatever they are) are ignored: from F=4, argmin over 4..11.
    norms = [0, 0, 0, 0, 9, 9, 0.2, 9, 9, 9, 9, 9]
    assert gradient_norm_decision(4, norms, 0.5, 11) == 6
    # ceil(0.2 * 8 - 1e-6) = 2: two more layers at most, and the argmin (6) allows two.
    assert gradient_norm_decision(4, norms, 0.2, 11) == 6
    assert gradient_norm_decision(4, norms, 0.1, 11) == 5  # ceil(0.8) = 1


def test_eq1_top_layer_argmin_and_the_cap():
    norms = [1.0] * 7 + [0.1]
    # The argmin is the top layer: the bound binds (ceil(8/3) = 3).
    assert gradient_norm_decision(0, norms, 1 / 3, 7) == 3
    # At the cap nothing more freezes; the inclusive variant is capped too.
    assert gradient_norm_decision(7, norms, 1 / 3, 7) == 7
    assert gradient_norm_decision(6, norms, 0.9, 7, inclusive=True) == 7
    assert gradient_norm_decision(0, norms, 0.9, 5) == 5


def test_eq1_ties_go_to_the_lower_layer():
    assert gradient_norm_decision(0, [2, 1, 1, 1, 2, 2], 0.9, 5) == 1
    assert gradient_norm_decision(0, [2, 1, 1, 1, 2, 2], 0.9, 5, inclusive=True) == 2


def test_eq1_non_finite_norms_are_never_the_argmin():
    nan, inf = math.nan, math.inf
    assert gradient_norm_decision(0, [5, nan, 2, 3], 0.9, 3) == 2
    assert gradient_norm_decision(0, [5, inf, 2, 3], 0.9, 3) == 2
    # No finite norm among the active layers: nothing freezes, with either reading.
    assert gradient_norm_decision(1, [0.1, nan, inf, nan], 0.9, 3) == 1
    assert gradient_norm_decision(1, [0.1, nan, inf, nan], 0.9, 3, inclusive=True) == 1
    with pytest.raises(ValueError, match="negative"):
        gradient_norm_decision(0, [1, -0.5, 2], 0.5, 2)


def test_eq1_sequence_is_monotone_and_capped():
    norms_seq = [
        [3, 2, 1, 4, 4, 4, 4, 4],
        [3, 2, 1, 0.5, 4, 4, 4, 4],
        [9, 9, 9, 9, 9, 9, 9, 0.1],
        [9, 9, 9, 0.1, 9, 9, 9, 9],  # the argmin is below F now: only active layers count
        [9, 9, 9, 9, 9, 9, 9, 0.1],
    ]
    frozen, history = 0, []
    for norms in norms_seq:
        frozen = gradient_norm_decision(frozen, norms, 0.5, 7)
        history.append(frozen)
    assert history == [2, 3, 6, 6, 7]
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
    assert grad.decide(1, 0, [1, 0.1, 1, 1, 1, 1, 1, 1]) == 1
    inclusive = FreezeDecider(FreezeConfig(strategy="gradient_norm_inclusive", alpha=0.5), L)
    assert inclusive.needs_grad_norms and grad.needs_grad_norms
    assert inclusive.decide(1, 0, [1, 0.1, 1, 1, 1, 1, 1, 1]) == 2


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
            epoch, in_epoch = divmod(step - 1, steps_per_epoch)
            end = in_epoch == steps_per_epoch - 1
            if schedule.due(epoch, end, step == steps_per_epoch * epochs, since):
                found.append(step)
                since = 0
        return found

    # Epoch ends (null), after one warm-up epoch; never after the last step.
    per_epoch = DecisionSchedule.for_config(FreezeConfig(interval_steps=None, warmup_epochs=1), 7)
    assert due_steps(per_epoch) == [7, 14]
    # Epochs of different lengths (a growing global batch): the epoch is handed in.
    assert per_epoch.due(1, True, False, 3) and not per_epoch.due(1, False, False, 3)
    assert not DecisionSchedule(None, 3).due(1, True, False, 3)  # still warming up
    # auto: three a 7-step epoch (every ceil(7 / 3) = 3 steps); none in the warm-up epoch, the
    # first once it is over (its steps count towards the interval).
    auto = DecisionSchedule.for_config(FreezeConfig(interval_steps="auto", warmup_epochs=1), 7)
    assert auto.interval_steps == 3 and due_steps(auto) == [8, 11, 14, 17, 20]
    # 'measured' is spaced out when transitions are costly: 0.2 s transitions, 0.1 s steps
    # -> 40 steps; 'auto' is a function of the config alone and ignores what was measured.
    assert min_interval_for(0.2, 0.1) == 40 and min_interval_for(0.001, 0.1) == 1
    unmeasured = DecisionSchedule.for_config(FreezeConfig(interval_steps="auto"), 7, 10)
    assert unmeasured.interval_steps == 3
    spaced = DecisionSchedule.for_config(FreezeConfig(interval_steps="measured"), 7, 10)
    assert due_steps(spaced) == [10, 20]


# ----------------------------------------------------------------------------- signal_to_noise


def test_signal_fraction_removes_the_moving_averages_noise_floor():
    import math

    from pipetransformer.freeze import signal_fraction

    beta = 0.9
    floor = (1 - beta) / (1 + beta)
    # Pure noise: an EMA of independent gradients keeps c of their energy -> 0 signal.
    assert signal_fraction(floor * 4.0, 4.0, beta) == pytest.approx(0.0)
    # Pure signal: the average is the gradient -> 1.
    assert signal_fraction(4.0, 4.0, beta) == pytest.approx(1.0)
    # Half the energy is signal: E||m||^2 = s + c n with s = n = 2.
    assert signal_fraction(2.0 + floor * 2.0, 4.0, beta) == pytest.approx(0.5)
    # Clamped to [0, 1]; no gradient measured is NaN; negative input is an error.
    assert signal_fraction(0.0, 4.0, beta) == 0.0 and signal_fraction(9.0, 4.0, beta) == 1.0
    assert math.isnan(signal_fraction(1.0, 0.0, beta))
    with pytest.raises(ValueError):
        signal_fraction(-1.0, 4.0, beta)
    with pytest.raises(ValueError):
        signal_fraction(1.0, 4.0, 1.0)


def test_signal_to_noise_freezes_the_noisy_bottom_layers_up_to_the_bound():
    import math

    from pipetransformer.freeze import signal_to_noise_outcome

    def decide(*args, **kwargs) -> int:
        return signal_to_noise_outcome(*args, **kwargs).num_frozen_layers

    # Layers 0-2 noisy, 3 still learning: 3 freeze (bound at F=0, L=6, alpha=1/2 is 3).
    assert decide(0, [0.01, 0.02, 0.05, 0.6, 0.01, 0.01], 0.5, 0.1, 5) == 3
    # The bound caps it (alpha 1/3 of 6 -> 2), and freezing stops at the first layer that
    # is not noise, whatever lies above it.
    assert decide(0, [0.01, 0.02, 0.05, 0.6, 0.01, 0.01], 1 / 3, 0.1, 5) == 2
    assert decide(0, [0.5, 0.01, 0.01, 0.01, 0.01, 0.01], 0.5, 0.1, 5) == 0
    # From F = 2: only layers from F up are read; never below F; the cap holds.
    assert decide(2, [0.9, 0.9, 0.01, 0.01, 0.01, 0.01], 0.9, 0.1, 4) == 4
    assert decide(3, [0.9] * 6, 0.5, 0.1, 5) == 3
    # A layer without a measured gradient (NaN) stops the freezing; strictly below.
    assert decide(0, [0.01, math.nan, 0.01, 0.01], 0.9, 0.1, 3) == 1
    assert decide(0, [0.1, 0.1, 0.1, 0.1], 0.9, 0.1, 3) == 0
    with pytest.raises(ValueError):
        decide(0, [-0.1, 0.2], 0.5, 0.1, 1)
    with pytest.raises(ValueError):
        decide(0, [0.1, 0.2], 0.5, 1.5, 1)


def test_signal_to_noise_needs_an_optimizer_with_momentum():
    from pipetransformer.config import ConfigError, config_from_dict

    base = {"trainer": {"nproc_per_node": 1}, "freeze": {"strategy": "signal_to_noise"}}
    config_from_dict({**base, "optimizer": {"name": "adamw"}})
    config_from_dict({**base, "optimizer": {"name": "sgd", "momentum": 0.9}})
    with pytest.raises(ConfigError, match="freeze.strategy: signal_to_noise reads"):
        config_from_dict({**base, "optimizer": {"name": "sgd", "momentum": 0.0}})
