"""DDP's budget curve, time-to-accuracy and accuracy at equal time (compare/curve.py), and
the budgets' fitted schedules and the variants' run order (compare/budgets.py,
compare/order.py). Pure: no processes."""

import math

import pytest

from pipetransformer.compare.curve import (
    AT_LEAST,
    AT_MOST,
    EXACT,
    MIXED,
    Bounded,
    CurvePoint,
    difference_stats,
    equal_time_difference,
    fmt_points,
    fmt_ratio,
    metric_at,
    monotone_curve,
    ratio_stats,
    time_to_accuracy,
    time_to_reach,
)

# DDP at 1, 2 and 3 epochs: 80 s to 0.80, 160 s to 0.84, 240 s to 0.83 (a third epoch that
# lost a little: the monotone curve keeps 0.84 from 160 s on).
POINTS = [CurvePoint(240.0, 0.83), CurvePoint(80.0, 0.80), CurvePoint(160.0, 0.84)]


def test_the_curve_is_sorted_by_time_and_never_falls():
    curve = monotone_curve(POINTS)
    assert [(p.time_s, p.metric) for p in curve] == [(80.0, 0.80), (160.0, 0.84), (240.0, 0.84)]
    # Two runs at the same time merge into the better one.
    merged = monotone_curve([CurvePoint(10.0, 0.5), CurvePoint(10.0, 0.7), CurvePoint(5.0, 0.6)])
    assert [(p.time_s, p.metric) for p in merged] == [(5.0, 0.6), (10.0, 0.7)]
    with pytest.raises(ValueError, match="no DDP budget point"):
        monotone_curve([])
    with pytest.raises(ValueError, match="> 0"):
        monotone_curve([CurvePoint(0.0, 0.5)])


def test_time_to_reach_interpolates_and_says_where_it_is_only_a_bound():
    curve = monotone_curve(POINTS)
    halfway = time_to_reach(curve, 0.82)  # halfway from 0.80 to 0.84
    assert (halfway.value, halfway.kind) == (pytest.approx(120.0), EXACT)
    assert time_to_reach(curve, 0.84) == Bounded(160.0, EXACT)
    # Above every DDP point: DDP needs more than its longest budget.
    assert time_to_reach(curve, 0.85) == Bounded(240.0, AT_LEAST)
    # At or below the shortest budget's metric: it may have needed less than that budget.
    assert time_to_reach(curve, 0.80) == Bounded(80.0, AT_MOST)
    assert time_to_reach(curve, 0.70) == Bounded(80.0, AT_MOST)


def test_metric_at_a_time_interpolates_and_bounds_outside_the_budgets():
    curve = monotone_curve(POINTS)
    assert metric_at(curve, 120.0).value == pytest.approx(0.82)
    assert metric_at(curve, 120.0).kind == EXACT
    assert metric_at(curve, 200.0) == Bounded(0.84, EXACT)  # the plateau
    assert metric_at(curve, 80.0) == Bounded(0.80, EXACT)
    assert metric_at(curve, 240.0) == Bounded(0.84, EXACT)
    assert metric_at(curve, 40.0) == Bounded(0.80, AT_MOST)
    assert metric_at(curve, 300.0) == Bounded(0.84, AT_LEAST)


def test_time_to_accuracy_and_accuracy_at_equal_time_of_one_variant():
    curve = monotone_curve(POINTS)
    # A variant at 100 s and 0.82: DDP's curve needs 120 s for 0.82, so 1.2x; at 100 s the
    # curve is at 0.81, so the variant is 1 point above it.
    ratio = time_to_accuracy(curve, 100.0, 0.82)
    assert (ratio.value, ratio.kind) == (pytest.approx(1.2), EXACT)
    difference = equal_time_difference(curve, 100.0, 0.82)
    assert (difference.value, difference.kind) == (pytest.approx(1.0), EXACT)
    # Above every DDP point: at least 240 / 200.
    above = time_to_accuracy(curve, 200.0, 0.86)
    assert (above.value, above.kind) == (pytest.approx(1.2), AT_LEAST)
    # Faster than DDP's shortest budget: the curve there is at most 0.80, so the difference is
    # at least +1; slower than its longest: at most.
    early = equal_time_difference(curve, 40.0, 0.81)
    assert (early.value, early.kind) == (pytest.approx(1.0), AT_LEAST)
    late = equal_time_difference(curve, 300.0, 0.83)
    assert (late.value, late.kind) == (pytest.approx(-1.0), AT_MOST)
    with pytest.raises(ValueError, match="> 0"):
        time_to_accuracy(curve, 0.0, 0.8)


def test_a_variant_on_the_curve_is_worth_exactly_one():
    curve = monotone_curve(POINTS)
    for point in (CurvePoint(120.0, 0.82), CurvePoint(160.0, 0.84)):
        assert time_to_accuracy(curve, point.time_s, point.metric).value == pytest.approx(1.0)
        assert equal_time_difference(curve, point.time_s, point.metric).value == pytest.approx(0)


def test_over_seeds_the_ratio_is_a_geometric_mean_and_censoring_is_said():
    exact = ratio_stats([Bounded(2.0), Bounded(0.5), Bounded(1.0)])
    assert (exact.mean, exact.kind, exact.at_least, exact.n) == (pytest.approx(1.0), EXACT, 0, 3)
    assert exact.low < 1.0 < exact.high
    # A bound is never averaged with values (issue 53: "at least 1.11x [0.44, 2.79]" came
    # from 0.91x, 0.87x and a bound of 1.70x): no mean, no interval, the seeds' range.
    censored = ratio_stats([Bounded(0.91), Bounded(1.70, AT_LEAST), Bounded(0.87)])
    assert (censored.kind, censored.mean, censored.low) == (MIXED, None, None)
    assert censored.at_least == 1
    assert (
        fmt_ratio(censored) == "no estimate: 1 seed(s) at least, 0 at most, 2 exact (0.87 to 1.70)"
    )
    # Every seed bounded the same way: the mean is a bound, with no interval.
    bounded = ratio_stats([Bounded(1.2, AT_LEAST), Bounded(1.5, AT_LEAST)])
    assert bounded.kind == AT_LEAST and (bounded.low, bounded.high) == (None, None)
    assert bounded.mean == pytest.approx(math.sqrt(1.2 * 1.5))
    assert fmt_ratio(bounded).startswith("at least 1.34x (")
    assert "[" not in fmt_ratio(bounded) and "2 of 2 seed(s) bounded" in fmt_ratio(bounded)
    # Bounds both ways: no estimate.
    mixed = ratio_stats([Bounded(1.2, AT_MOST), Bounded(1.5, AT_LEAST)])
    assert (mixed.kind, mixed.mean, mixed.low) == (MIXED, None, None)
    assert fmt_ratio(mixed).startswith("no estimate: 1 seed(s) at least, 1 at most")
    one = ratio_stats([Bounded(1.4)])
    assert (one.low, one.high) == (None, None) and fmt_ratio(one) == "1.40x (1.40 to 1.40)"


def test_over_seeds_the_difference_is_a_mean_with_a_t_interval():
    stats = difference_stats([Bounded(0.5), Bounded(-0.3), Bounded(0.1)])
    assert stats.mean == pytest.approx(0.1) and stats.kind == EXACT
    half = 4.302652729911275 * 0.4 / math.sqrt(3)  # t(0.975, 2) x std / sqrt(n)
    assert (stats.low, stats.high) == (pytest.approx(0.1 - half), pytest.approx(0.1 + half))
    assert fmt_points(stats).startswith("+0.10 [")
    late = difference_stats([Bounded(-0.2, AT_MOST), Bounded(-0.4)])
    assert (late.kind, late.mean, late.low) == (MIXED, None, None)
    assert fmt_points(late).startswith("no estimate: 0 seed(s) at least, 1 at most, 1 exact")
    both = difference_stats([Bounded(-0.2, AT_MOST), Bounded(-0.4, AT_MOST)])
    assert both.kind == AT_MOST and fmt_points(both) == (
        "at most -0.30 (-0.40 to -0.20), 2 of 2 seed(s) bounded"
    )
