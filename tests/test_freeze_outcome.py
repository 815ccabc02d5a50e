"""Who decided a freeze decision (freeze.py, "Who decided"): the rule's signal, Eq. 1's
bound, the cap or a schedule; and Eq. 1 without its bound (`freeze.eq1_bound: false`), the
version in which the signal decides. Pure: no processes."""

import pytest

from pipetransformer.config import FreezeConfig
from pipetransformer.freeze import (
    AGREE,
    BOUND,
    CAP,
    NO_SIGNAL,
    SCHEDULE,
    SIGNAL,
    FreezeDecider,
    autofreeze_outcome,
    bound_trajectory,
    convergence_outcome,
    gradient_norm_outcome,
    signal_to_noise_outcome,
)

L = 6
# The first decision of the MiniLM SST-2 fine-tune (issue 47's review of a run's
# events.jsonl): the norms fall from the bottom layer to the top.
FALLING = [0.56, 0.48, 0.35, 0.26, 0.23, 0.16]


def test_falling_norms_make_eq1_the_bounds_fixed_schedule():
    """The argmin is always the top layer: the bound decides (or, where it reaches the top
    layer, agrees with it), never the signal, and the path is the bound's (0, 2, 4 at alpha
    1/3; 0, 3, 5 at 1/2)."""
    for alpha, path, deciders in ((1 / 3, [2, 4], [BOUND, BOUND]), (0.5, [3, 5], [BOUND, AGREE])):
        frozen, seen = 0, []
        for expected in deciders:
            outcome = gradient_norm_outcome(frozen, FALLING, alpha, L - 1)
            assert (outcome.proposed, outcome.decided_by) == (L - 1, expected)
            frozen = outcome.num_frozen_layers
            seen.append(frozen)
        assert seen == path == bound_trajectory(L, alpha, 2)


def test_the_signal_decides_when_its_argmin_lies_below_the_bound():
    outcome = gradient_norm_outcome(0, [5, 3, 0.1, 3, 3, 3, 3, 3, 3, 3, 3, 3], 1 / 3, 11)
    assert (outcome.num_frozen_layers, outcome.proposed, outcome.bound) == (2, 2, 4)
    assert outcome.decided_by == SIGNAL
    # The argmin exactly at the bound: both agree, the signal decided nothing on its own.
    agree = gradient_norm_outcome(0, [5, 5, 5, 5, 0.1, 5, 5, 5, 5, 5, 5, 5], 1 / 3, 11)
    assert (agree.num_frozen_layers, agree.decided_by) == (4, AGREE)


def test_without_the_bound_the_signal_alone_decides_up_to_the_cap():
    """freeze.eq1_bound false: Eq. 1's argmin term alone. On falling norms it freezes every
    layer but the top one at once; with max_frozen_layers the cap holds it."""
    free = gradient_norm_outcome(0, FALLING, 1 / 3, L - 1, bounded=False)
    assert (free.num_frozen_layers, free.bound, free.decided_by) == (L - 1, None, AGREE)
    capped = gradient_norm_outcome(0, FALLING, 1 / 3, 3, bounded=False)
    assert (capped.num_frozen_layers, capped.decided_by) == (3, CAP)
    middle = gradient_norm_outcome(0, [3, 2, 1, 4, 4, 4], 1 / 3, L - 1, bounded=False)
    assert (middle.num_frozen_layers, middle.decided_by) == (2, SIGNAL)
    # The config key reaches the decider; with the bound (the default) the same norms bind.
    decider = FreezeDecider(FreezeConfig(strategy="gradient_norm", eq1_bound=False), L)
    assert decider.outcome(1, 0, FALLING).num_frozen_layers == L - 1
    bounded = FreezeDecider(FreezeConfig(strategy="gradient_norm"), L)
    assert bounded.outcome(1, 0, FALLING).num_frozen_layers == 2


def test_convergence_and_signal_to_noise_report_their_run_against_the_bound():
    steady = [1.0] * L
    first = convergence_outcome(0, steady, None, 1 / 3, 0.05, L - 1)
    assert (first.num_frozen_layers, first.decided_by) == (0, NO_SIGNAL)
    all_converged = convergence_outcome(0, steady, steady, 1 / 3, 0.05, L - 1)
    assert (all_converged.proposed, all_converged.num_frozen_layers) == (L, 2)
    assert all_converged.decided_by == BOUND
    one = convergence_outcome(0, [1.0, 2.0, *steady[2:]], steady, 1 / 3, 0.05, L - 1)
    assert (one.num_frozen_layers, one.decided_by) == (1, SIGNAL)
    unbounded = convergence_outcome(0, steady, steady, 1 / 3, 0.05, L - 1, bounded=False)
    assert (unbounded.num_frozen_layers, unbounded.decided_by) == (L - 1, CAP)
    noise = signal_to_noise_outcome(0, [0.0, 0.0, 0.9, 0.0, 0.0, 0.0], 1 / 3, 0.1, L - 1)
    assert (noise.num_frozen_layers, noise.decided_by) == (2, AGREE)
    quiet = signal_to_noise_outcome(0, [0.0] * L, 0.5, 0.1, L - 1)
    assert (quiet.num_frozen_layers, quiet.decided_by) == (3, BOUND)


def test_autofreeze_has_no_bound_and_schedules_read_no_signal():
    previous = [1.0] * L
    now = [0.99, 1.02, 1.5, 0.97, 1.6, 1.7]  # the first change at or above the median: 2
    outcome = autofreeze_outcome(0, now, previous, 50.0, L - 1)
    assert (outcome.num_frozen_layers, outcome.bound, outcome.decided_by) == (2, None, SIGNAL)
    assert autofreeze_outcome(0, now, None, 50.0, L - 1).decided_by == NO_SIGNAL
    manual = FreezeDecider(FreezeConfig(strategy="manual", manual_schedule=[2, 9]), L)
    assert manual.outcome(1, 0).decided_by == SCHEDULE
    assert manual.outcome(2, 2).decided_by == CAP  # 9 asked, 5 allowed
    done = gradient_norm_outcome(L - 1, FALLING, 0.5, L - 1)
    assert (done.num_frozen_layers, done.decided_by) == (L - 1, CAP)


@pytest.mark.parametrize("bounded", [True, False])
def test_outcome_and_decision_agree(bounded):
    """decide() is outcome().num_frozen_layers: the counts never disagree with what ran."""
    config = FreezeConfig(strategy="gradient_norm", alpha=0.5, eq1_bound=bounded)
    decider = FreezeDecider(config, L)
    for frozen in range(L):
        for norms in (FALLING, [3, 2, 1, 4, 4, 4], [0.1, 5, 5, 5, 5, 5]):
            outcome = decider.outcome(1, frozen, norms)
            assert decider.decide(1, frozen, norms) == outcome.num_frozen_layers >= frozen
