"""A run replayed without processes (planning/run_model.py): epochs under both batch
semantics, the freeze rule at its cadence, what AutoCache holds for each step's samples and
the frozen-prefix work that makes for stage 0. Unit tier."""

from __future__ import annotations

import pytest

from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.planner import UnitCosts, balance
from pipetransformer.config import FreezeConfig
from pipetransformer.freeze import bound_trajectory
from pipetransformer.planning.run_model import (
    CachedShares,
    RunShape,
    prefix_cost_to_balance,
    simulate_run,
    synthetic_norms,
)
from pipetransformer.planning.step_model import prefix_work
from pipetransformer.utils.units import prefix_end

LAYERS = 12
COSTS = UnitCosts.from_param_counts([10] * (2 * LAYERS + 2), 1 / 6)


def layout(frozen: int, pipe_len: int, world: int = 8) -> Layout:
    plan = balance(COSTS, frozen, pipe_len)
    return Layout(plan, world, world, world // pipe_len)


def halving_layout_for(calls: list):
    """K halves at F = 4 and F = 8 (a stand-in for the planner); records its arguments."""

    def layout_for(frozen: int, current: Layout, prefix_s: float) -> Layout:
        calls.append((frozen, current.pipe_len, prefix_s))
        pipe_len = 8 if frozen < 4 else 4 if frozen < 8 else 2
        return layout(frozen, min(pipe_len, current.pipe_len))

    return layout_for


def work(frozen: int, cached: dict[int, float], serves: bool) -> float:
    """Prefix seconds: 1 a frozen unit computed, 0.5 a read."""
    return prefix_cost_to_balance([1.0] * (2 * LAYERS + 2), 0.5, frozen, cached, serves)


# ---------------------------------------------------------------- pieces


def test_run_shape_steps_under_both_batch_semantics():
    fixed = RunShape(2, 1000, 2, global_batch_size=64)
    assert [fixed.steps_per_epoch(r) for r in (1, 2, 4)] == [32, 32, 32]
    per_replica = RunShape(2, 1000, 2, None, batch_per_replica=50)
    assert [per_replica.steps_per_epoch(r) for r in (1, 2, 4)] == [20, 10, 5]
    with pytest.raises(ValueError, match="not both"):
        RunShape(2, 1000, 1, 64, 50)
    with pytest.raises(ValueError, match="at least one"):
        RunShape(0, 1000, 1, 64)


def test_cached_shares_fill_upgrade_and_keep():
    shares = CachedShares()
    shares.record(None, 1.0)  # an epoch without the cache: nothing is cached
    shares.end_epoch()
    assert shares.at_start == {}
    shares.record(4, 0.25)  # the cache serves at F = 4 from a quarter of the epoch on
    shares.record(None, 0.75)
    shares.end_epoch()
    assert shares.at_start == {4: 0.25}
    shares.record(None, 0.5)  # half untouched keeps its quarter of F = 4 entries
    shares.record(6, 0.5)
    shares.end_epoch()
    assert shares.at_start == pytest.approx({4: 0.125, 6: 0.5})
    again = CachedShares.from_dict(shares.to_dict())
    assert again == shares and CachedShares.from_dict({}) == CachedShares()
    with pytest.raises(ValueError):
        shares.record(4, -0.1)


def test_prefix_work_reads_upgrades_and_computes():
    frozen_s = [1.0, 2.0, 2.0, 3.0, 3.0, 9.0]  # embedding, two layers, head
    end = prefix_end(2)  # 5: units [0, 5)
    assert prefix_work(frozen_s, 0.5, end, {}) == 11.0  # computed
    assert prefix_work(frozen_s, 0.5, end, {5: 1.0}) == 0.5  # read
    assert prefix_work(frozen_s, 0.5, end, {3: 1.0}) == 0.5 + 6.0  # upgraded from F = 1
    assert prefix_work(frozen_s, 0.5, end, {3: 0.5, 5: 0.25}) == pytest.approx(
        0.5 * 6.5 + 0.25 * 0.5 + 0.25 * 11.0
    )
    with pytest.raises(ValueError, match="cannot serve"):
        prefix_work(frozen_s, 0.5, 3, {5: 1.0})
    # Not served: always the whole forward, whatever is cached.
    assert prefix_cost_to_balance(frozen_s, 0.5, 2, {2: 1.0}, serves=False) == 11.0
    assert prefix_cost_to_balance(frozen_s, 0.5, 2, {1: 1.0}, serves=True) == 6.5
    assert prefix_cost_to_balance(frozen_s, 0.5, 0, {}, serves=False) == 0.0


def test_synthetic_norms_put_the_smallest_at_the_top():
    norms = synthetic_norms(5)
    assert norms.index(min(norms)) == 4 and len(set(norms)) == 5


# ---------------------------------------------------------------- runs


def epochs_of(segments) -> list[tuple[int, int, int]]:
    """(epoch, F at its start, steps in it)."""
    out: dict[int, list] = {}
    for s in segments:
        out.setdefault(s.epoch, [s.num_frozen_layers, 0])[1] += s.steps
    return [(e, f, n) for e, (f, n) in sorted(out.items())]


def run(shape, freeze, calls=None, per_epoch=None, serves=lambda f: f > 0):
    calls = [] if calls is None else calls
    return simulate_run(
        shape, freeze, LAYERS, layout(0, 8), halving_layout_for(calls), work, serves, per_epoch
    )


def test_the_bound_at_epoch_ends_with_a_growing_batch():
    """Eq. 1's bound (ceil) at every epoch end; one pipeline a node of 8 at the start, so a
    node's batch is 1, 2 then 4 replicas of 100 samples as K halves."""
    shape = RunShape(6, 1000, 1, None, batch_per_replica=100)
    freeze = FreezeConfig(strategy="gradient_norm", alpha=1 / 3, interval_steps=None)
    segments = run(shape, freeze)
    frozen = [f for _, f, _ in epochs_of(segments)]
    assert frozen == [0, *bound_trajectory(LAYERS, 1 / 3, 5)] == [0, 4, 7, 9, 10, 11]
    # K: 8 (R 1), then 4 (R 2) from F = 4, then 2 (R 4) from F = 8: 10, 5, 5, 3, 3, 3 steps.
    assert [n for _, _, n in epochs_of(segments)] == [10, 5, 5, 3, 3, 3]
    # The same with a fixed global batch of 100: 10 steps every epoch.
    fixed = RunShape(6, 1000, 1, 100)
    assert [n for _, _, n in epochs_of(run(fixed, freeze))] == [10] * 6


def test_every_gradient_rule_replays_at_its_bound():
    shape = RunShape(4, 100, 1, 10)
    for strategy, expected in (
        ("gradient_norm", [0, 4, 7, 9]),
        ("gradient_norm_inclusive", [0, 4, 7, 9]),
        ("convergence", [0, 0, 4, 7]),  # its first decision only measures
        ("alpha_schedule", [0, 4, 7, 9]),
        ("none", [0, 0, 0, 0]),
    ):
        freeze = FreezeConfig(strategy=strategy, alpha=1 / 3, interval_steps=None)
        assert [f for _, f, _ in epochs_of(run(shape, freeze))] == expected, strategy
    manual = FreezeConfig(strategy="manual", manual_schedule=[2, 5], interval_steps=None)
    assert [f for _, f, _ in epochs_of(run(shape, manual))] == [0, 2, 5, 5]


def test_the_cadence_is_the_trainers():
    shape = RunShape(2, 90, 1, 10)  # 9 steps an epoch
    # auto: three decisions an epoch (every 3 steps), none after the last step.
    auto = FreezeConfig(strategy="gradient_norm", alpha=1 / 3, interval_steps="auto")
    changes = [(s.epoch, s.num_frozen_layers) for s in run(shape, auto)]
    assert changes[:3] == [(0, 0), (0, 4), (0, 7)] and len(changes) == 6
    # A warm-up epoch: nothing before its end.
    warm = FreezeConfig(strategy="gradient_norm", interval_steps=None, warmup_epochs=2)
    assert {s.num_frozen_layers for s in run(RunShape(3, 90, 1, 10), warm)} == {0, 4}
    # F per epoch given: the rule is not asked.
    assert [f for _, f, _ in epochs_of(run(shape, auto, per_epoch=[0, 3]))] == [0, 3]


def test_the_cache_fills_upgrades_then_reads_and_the_layout_is_balanced_for_it():
    shape = RunShape(5, 100, 1, 10)
    freeze = FreezeConfig(strategy="manual", manual_schedule=[2, 5], interval_steps=None)
    calls = []
    segments = run(shape, freeze, calls)
    by_epoch = {s.epoch: s for s in segments}
    assert [by_epoch[e].num_frozen_layers for e in range(5)] == [0, 2, 5, 5, 5]
    assert by_epoch[1].cached == ()  # F = 2 fills: nothing cached yet
    assert by_epoch[2].cached == ((2, 1.0),)  # F = 5 upgrades every entry from F = 2
    assert by_epoch[3].cached == ((5, 1.0),)  # then reads
    assert by_epoch[1].prefix_s == 5.0  # units [0, 5) computed
    assert by_epoch[2].prefix_s == 0.5 + 6.0  # read, then units [5, 11)
    assert by_epoch[3].prefix_s == 0.5
    # Each decision plans for the work that follows it: fill, upgrade, then read at F = 5
    # (re-planned although F did not change), then read again.
    assert [(f, p) for f, _, p in calls] == [(2, 5.0), (5, 6.5), (5, 0.5), (5, 0.5)]


def test_a_boundary_the_cache_does_not_serve_is_computed_and_writes_nothing():
    shape = RunShape(3, 100, 1, 10)
    freeze = FreezeConfig(strategy="manual", manual_schedule=[2], interval_steps=None)
    segments = run(shape, freeze, serves=lambda f: False)
    assert all(not s.cache_active and s.cached == () for s in segments)
    assert {s.prefix_s for s in segments if s.num_frozen_layers == 2} == {5.0}
