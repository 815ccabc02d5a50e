"""The `convergence` freeze rule (this project's; AutoFreeze's is tests/test_autofreeze.py):
a bottom layer freezes once the relative change of its gradient norm between two decisions
is below a threshold. Also how a run selects it: the config keys, the decider, and the
previous norms in the run state."""

import json
import math

import pytest

from pipetransformer.autodp.control import Control
from pipetransformer.config import ConfigError, FreezeConfig, config_from_dict, load_config
from pipetransformer.freeze import FreezeDecider, convergence_outcome
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.freezing import FreezeControl
from pipetransformer.trainer.metrics import FreezeSignal

L = 6


def convergence_count(*args) -> int:
    return convergence_outcome(*args).num_frozen_layers


STEADY = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def decide(frozen, norms, previous, alpha=0.9, threshold=0.05, max_frozen=L - 1):
    return convergence_outcome(
        frozen, norms, previous, alpha, threshold, max_frozen
    ).num_frozen_layers


def test_first_decision_freezes_nothing():
    # Perfectly steady norms, but nothing to compare them with yet.
    assert decide(0, STEADY, None) == 0
    assert decide(2, STEADY, None) == 2
    # An empty list is the run state's "no previous norms".
    assert decide(0, STEADY, []) == 0
    # The same norms with a previous decision behind them: the cap (max_frozen) binds.
    assert decide(0, STEADY, STEADY) == L - 1


def test_freezing_is_contiguous_from_the_bottom():
    previous = [1.0] * L
    # Layer 0 still moves (20%), layer 1 is steady: nothing freezes.
    assert decide(0, [1.2, 1.0, 1.0, 1.0, 1.0, 1.0], previous, threshold=0.1) == 0
    # Layers 0 and 1 steady, layer 2 moves, 3 and 4 steady: only 0 and 1 freeze.
    assert decide(0, [1.01, 0.99, 1.5, 1.0, 1.0, 1.0], previous, threshold=0.1) == 2


def test_only_active_layers_are_tested():
    # Layers below F are frozen: whatever their norms (0, NaN), the test starts at F.
    previous = [0.0, math.nan, 1.0, 1.0, 1.0, 1.0]
    norms = [0.0, math.nan, 1.0, 1.0, 2.0, 1.0]
    assert decide(2, norms, previous) == 4
    # Not converged at F: F stays.
    assert decide(2, [0.0, 0.0, 3.0, 1.0, 1.0, 1.0], previous) == 2


def test_alpha_cap_binds():
    steady = [1.0] * 12
    # F=0, L=12, alpha=1/3: the bound is 4 even though all 12 have converged.
    assert convergence_count(0, steady, steady, 1 / 3, 0.05, 11) == 4
    # F=4: Eq. 1's bound, rounded up as every rule rounds it: 4 + ceil(8/3) = 7.
    assert convergence_count(4, steady, steady, 1 / 3, 0.05, 11) == 7
    # A rounded alpha counts as the fraction: 9 + ceil(3 * 0.3333333333) = 10.
    assert convergence_count(9, steady, steady, 0.3333333333, 0.05, 11) == 10
    # ceil(alpha * (L - F)) = 1 while a layer remains: 10 -> 11, the cap.
    assert convergence_count(10, steady, steady, 1 / 3, 0.05, 11) == 11


def test_max_frozen_layers_binds():
    steady = [1.0] * L
    assert decide(0, steady, steady, max_frozen=3) == 3
    assert decide(3, steady, steady, max_frozen=3) == 3
    assert decide(0, steady, steady, max_frozen=0) == 0


def test_never_decreases():
    moving = [9.0] * L
    steady = [1.0] * L
    assert decide(3, moving, steady) == 3
    # Already past the cap (a config that lowered it on resume): F is kept, not lowered.
    assert decide(5, steady, steady, max_frozen=2) == 5
    # A sequence of decisions, each fed the previous decision's norms.
    sequence = [
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        [1.02, 1.5, 1.0, 1.0, 1.0, 1.0],  # layer 0 steady, layer 1 moved: F = 1
        [1.0, 1.5, 1.7, 2.0, 1.0, 1.0],  # layer 1 steady now, layer 2 moved: F = 2
        [5.0, 5.0, 1.7, 2.0, 3.0, 1.0],  # frozen layers' norms do not matter; 2, 3 steady: F = 4
        [5.0, 5.0, 9.0, 9.0, 1.0, 1.0],  # layer 4 moved: F stays 4
    ]
    frozen, previous, history = 0, None, []
    for norms in sequence:
        frozen = decide(frozen, norms, previous, alpha=0.5)
        previous = norms
        history.append(frozen)
    assert history == [0, 1, 2, 4, 4]


def test_zero_previous_norm_is_not_convergence():
    # No gradient before: no relative change can be measured, whatever the norm is now.
    assert decide(0, [1.0] * L, [0.0] + [1.0] * (L - 1)) == 0
    assert decide(0, [0.0] + [1.0] * (L - 1), [0.0] + [1.0] * (L - 1)) == 0
    # Stops at the layer without a gradient, not before it.
    assert decide(0, [1.0, 1.0, 0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]) == 2
    # A gradient that dropped to 0 changed by 100%: converged only for a threshold above 1.
    dropped = [0.0] + [1.0] * (L - 1)
    assert decide(0, dropped, [1.0] * L, threshold=0.5) == 0
    assert decide(0, dropped, [1.0] * L, threshold=1.5, max_frozen=1) == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_norms_never_freeze(bad):
    steady = [1.0] * L
    with_bad = [1.0, 1.0, bad, 1.0, 1.0, 1.0]
    # A NaN/inf now or before stops freezing at that layer, even for a huge threshold.
    assert decide(0, with_bad, steady, threshold=1e9) == 2
    assert decide(0, steady, with_bad, threshold=1e9) == 2
    assert decide(0, with_bad, with_bad, threshold=1e9) == 2
    assert decide(2, with_bad, steady, threshold=math.inf) == 2
    # Above where freezing stops anyway, it changes nothing.
    late = [1.0, 9.0, 1.0, 1.0, 1.0, bad]
    assert decide(0, late, steady) == 1


def test_wrong_input_is_an_error():
    with pytest.raises(ValueError, match="5 previous layer gradient norms for 6 layers"):
        decide(0, [1.0] * L, [1.0] * (L - 1))
    with pytest.raises(ValueError, match="7 previous"):
        decide(0, [1.0] * L, [1.0] * (L + 1))
    with pytest.raises(ValueError, match="negative"):
        decide(0, [1.0, -0.5, 1.0, 1.0, 1.0, 1.0], [1.0] * L)
    with pytest.raises(ValueError, match="negative"):
        decide(0, [1.0] * L, [1.0] * (L - 1) + [-math.inf])
    with pytest.raises(ValueError, match="threshold"):
        decide(0, [1.0] * L, [1.0] * L, threshold=-0.1)
    with pytest.raises(ValueError, match="threshold"):
        decide(0, [1.0] * L, [1.0] * L, threshold=math.nan)
    # Errors are raised even where the decision would be trivial (first decision, capped).
    with pytest.raises(ValueError):
        decide(5, [1.0] * L, [1.0] * (L - 1))
    with pytest.raises(ValueError):
        decide(0, [-1.0] * L, None)


def test_small_rise_counts_as_converged():
    previous = [1.0] * L
    # +3% and -3% are both below 5%: |change| counts.
    assert decide(0, [1.03, 0.97, 1.0, 1.0, 1.0, 1.0], previous, max_frozen=2) == 2
    # +10% is not.
    assert decide(0, [1.03, 1.10, 1.0, 1.0, 1.0, 1.0], previous, max_frozen=2) == 1


def test_change_is_relative_to_the_previous_norm():
    # 1.0 -> 0.8 is a 20% change; 0.8 -> 1.0 is 25% (relative to the previous norm).
    assert decide(0, [0.8] * L, [1.0] * L, threshold=0.22, max_frozen=1) == 1
    assert decide(0, [1.0] * L, [0.8] * L, threshold=0.22, max_frozen=1) == 0
    # Scale-free: the same changes at any magnitude decide the same.
    for scale in (1e-9, 1.0, 1e9):
        previous = [scale * v for v in (1.0, 1.0, 1.0, 1.0, 1.0, 1.0)]
        norms = [scale * v for v in (1.04, 0.96, 1.2, 1.0, 1.0, 1.0)]
        assert decide(0, norms, previous) == 2


def test_threshold_is_strict():
    # Binary-exact numbers: |5 - 4| / 4 and |3 - 4| / 4 are exactly 0.25.
    previous = [4.0] * L
    assert decide(0, [5.0] * L, previous, threshold=0.25) == 0
    assert decide(0, [3.0] * L, previous, threshold=0.25) == 0
    assert decide(0, [4.96875] * L, previous, threshold=0.25, max_frozen=1) == 1
    # A threshold of 0 never freezes, not even an unchanged norm.
    assert decide(0, previous, previous, threshold=0.0) == 0


# ------------------------------------------------------------ selected by the config


def test_config_selects_convergence_with_a_threshold():
    config = load_config(None, ["freeze.strategy=convergence"])
    assert config.freeze.strategy == "convergence" and config.freeze.convergence_threshold == 0.05
    config = load_config(None, ["freeze.strategy=convergence", "freeze.convergence_threshold=0"])
    assert config.freeze.convergence_threshold == 0.0


@pytest.mark.parametrize(
    "override, key",
    [
        ("freeze.convergence_threshold=-0.1", "freeze.convergence_threshold"),
        ("freeze.convergence_threshold=nan", "freeze.convergence_threshold"),
        ("freeze.convergence_threshold=high", "freeze.convergence_threshold"),
        ("freeze.strategy=converge", "freeze.strategy"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["freeze.strategy=convergence", override])
    assert str(info.value).startswith(key), str(info.value)


def test_decider_measures_first_then_freezes_converged_bottom_layers():
    config = FreezeConfig(strategy="convergence", alpha=0.9, convergence_threshold=0.1)
    decider = FreezeDecider(config, L)
    assert decider.needs_grad_norms
    first = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert decider.decide(1, 0, first, None) == 0
    assert decider.decide(1, 0, first, []) == 0
    # Layers 0 and 1 moved by 5%, layer 2 by 50%: the two bottom layers freeze.
    second = [1.05, 1.9, 4.5, 4.0, 5.0, 6.0]
    assert decider.decide(2, 0, second, first) == 2
    with pytest.raises(ValueError, match="convergence needs 6 layer gradient norms"):
        decider.decide(2, 0, None, first)
    with pytest.raises(ValueError, match="convergence needs 6"):
        decider.decide(2, 0, second[:-1], first)


class FakeMetrics:
    """Hands out one interval's norms per decision, as MetricsTracker.freeze_signal does."""

    def __init__(self, norms_per_decision):
        self.norms = list(norms_per_decision)

    def freeze_signal(self, dp_degree, with_norms):
        assert with_norms
        return FreezeSignal(self.norms.pop(0), steps=4, step_s=0.1)


def freeze_control(state, norms_per_decision):
    config = config_from_dict({"freeze": {"strategy": "convergence", "alpha": 0.9}})
    return FreezeControl(config, L, 10, state, FakeMetrics(norms_per_decision), Control(None))


def test_freeze_control_keeps_the_norms_in_the_run_state_across_a_resume():
    first = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    second = [1.01, 2.02, 9.0, 4.0, 5.0, 6.0]  # layers 0 and 1 converged
    state = RunState()
    control = freeze_control(state, [first])
    assert control.decide(0, dp_degree=1).num_frozen_layers == 0
    assert state.previous_layer_grad_norms == first
    # Resume from the checkpoint record (run_state.json): the second decision compares
    # against the first decision's norms.
    record = json.loads(json.dumps(state.to_dict()))
    resumed = RunState.from_dict(record)
    control = freeze_control(resumed, [second])
    assert control.decide(0, dp_degree=1).num_frozen_layers == 2
    assert resumed.decision_index == 2 and resumed.previous_layer_grad_norms == second


def test_run_state_round_trips_the_previous_norms_and_reads_old_checkpoints():
    state = RunState(decision_index=3, previous_layer_grad_norms=[0.5, 0.25, 0.125])
    again = RunState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state
    old = state.to_dict()
    del old["previous_layer_grad_norms"]  # written before the field existed
    loaded = RunState.from_dict(old)
    assert loaded.previous_layer_grad_norms == [] and loaded.decision_index == 3
