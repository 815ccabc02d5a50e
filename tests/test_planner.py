"""AutoPipe planner: balance, compression, K only halves, boundaries between units."""

import itertools

import pytest

from pipetransformer.autopipe.planner import (
    AutoPipePlanner,
    UnitCosts,
    balance,
    fixed_plan,
    partition_greedy,
    partition_optimal,
    stage_sizes,
)


def vit_like(num_layers=8, embed=2240, attn=16768, mlp=16704, head=778, lam=1 / 6):
    return UnitCosts.from_param_counts([embed] + [attn, mlp] * num_layers + [head], lam)


def brute_force_best(weights, k, head_start=0.0):
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        cost = max(
            sum(weights[a:b]) + (head_start if a == 0 else 0) for a, b in zip(bounds, bounds[1:])
        )
        best = min(best, cost)
    return best


def stage_max(weights, starts, head_start=0.0):
    bounds = [*starts, len(weights)]
    return max(
        sum(weights[a:b]) + (head_start if a == 0 else 0) for a, b in zip(bounds, bounds[1:])
    )


@pytest.mark.parametrize("seed", range(20))
def test_optimal_matches_brute_force_and_greedy_is_close(seed):
    import random

    rng = random.Random(seed)
    weights = [rng.uniform(0.1, 10) for _ in range(rng.randint(4, 10))]
    k = rng.randint(1, min(4, len(weights)))
    head = rng.uniform(0, 5)
    best = brute_force_best(weights, k, head)
    optimal = partition_optimal(weights, k, head)
    assert stage_max(weights, optimal, head) == pytest.approx(best)
    greedy = partition_greedy(weights, k, head)
    assert len(greedy) == k and greedy[0] == 0 and sorted(set(greedy)) == greedy
    # The greedy fill is within one unit of the optimum.
    assert stage_max(weights, greedy, head) <= best + max(weights) + 1e-9


def test_balance_covers_active_units_contiguously():
    costs = vit_like()
    for frozen in range(8):
        for k in (1, 2, 4):
            if k > costs.num_units - (1 + 2 * frozen if frozen else 0):
                continue
            plan = balance(costs, frozen, k)
            assert plan.stage_ranges[0][0] == plan.prefix_end
            assert plan.stage_ranges[-1][1] == costs.num_units
            assert all(a < b for a, b in plan.stage_ranges)
            assert all(plan.stage_ranges[i][1] == plan.stage_ranges[i + 1][0] for i in range(k - 1))
            assert plan.prefix_end == (0 if frozen == 0 else 1 + 2 * frozen)


def test_balance_is_balanced_for_uniform_layers():
    costs = UnitCosts.from_param_counts([1] + [1] * 16 + [1], 1 / 6)
    plan = balance(costs, 0, 2)
    assert plan.stage_costs == (9.0, 9.0)
    plan = balance(costs, 0, 2, "optimal")
    assert plan.stage_costs == (9.0, 9.0)


def test_frozen_prefix_counts_at_lambda_on_stage_zero():
    costs = UnitCosts.from_param_counts([6] * 10, 1 / 6)  # 4 layers
    plan = balance(costs, 2, 1)
    assert plan.prefix_end == 5
    assert plan.stage_costs == (5 * 1.0 + 5 * 6.0,)


def test_compression_halves_only_when_it_fits_the_initial_maximum():
    planner = AutoPipePlanner(vit_like(), 8)
    initial_max = planner.initial.max_stage_cost
    lens = []
    pipe_len = 8
    for frozen in range(8):
        plan = planner.plan(frozen, pipe_len)
        assert plan.pipe_len in (pipe_len, pipe_len // 2, pipe_len // 4, pipe_len // 8)
        assert plan.pipe_len <= pipe_len  # K only shrinks
        active_units = planner.costs.num_units - (1 + 2 * frozen if frozen else 0)
        if plan.pipe_len < pipe_len <= active_units:  # a choice, not forced by too few units
            assert plan.max_stage_cost <= initial_max * (1 + 1e-9)
        pipe_len = plan.pipe_len
        lens.append(pipe_len)
    assert lens[0] == 8 and lens[-1] < 8
    # Every K is a power-of-two divisor of the initial 8.
    assert all(8 % k == 0 for k in lens)


def test_compression_stops_when_one_more_halving_would_exceed():
    planner = AutoPipePlanner(vit_like(), 2)
    # Nothing frozen: cannot halve (one stage would carry everything).
    assert planner.plan(0, 2).pipe_len == 2
    # Five of eight layers frozen at 1/6 cost: everything fits one stage.
    plan = planner.plan(5, 2)
    assert plan.pipe_len == 1 and plan.max_stage_cost <= planner.initial.max_stage_cost


def test_memory_can_veto_compression():
    costs = vit_like()

    def fits_in(budget):  # toy memory: one byte per trained unit, 0.1 per frozen one
        return lambda plan: (
            max(
                sum(0.1 if u < plan.frozen_end else 1.0 for u in range(a, b))
                + (0.1 * plan.prefix_end if s == 0 else 0)
                for s, (a, b) in enumerate(plan.stage_ranges)
            )
            <= budget
        )

    assert (
        AutoPipePlanner(costs, 2, fits=fits_in(8.0)).plan(5, 2).pipe_len == 2
    )  # 7 units + the prefix: 8.1
    assert AutoPipePlanner(costs, 2, fits=fits_in(100.0)).plan(5, 2).pipe_len == 1


def test_fixed_plan_keeps_the_initial_stages():
    planner = AutoPipePlanner(vit_like(), 4)
    plan = fixed_plan(planner.costs, planner.initial, 3)
    assert plan.stage_ranges == planner.initial.stage_ranges and plan.prefix_end == 0
    assert plan.frozen_end == 7
    assert plan.stage_costs[0] < planner.initial.stage_costs[0]  # frozen units cost less


def test_head_never_freezes():
    with pytest.raises(ValueError):
        balance(vit_like(num_layers=2), 3, 1)


def test_more_stages_than_units_shrinks_k():
    planner = AutoPipePlanner(vit_like(num_layers=4), 8)
    plan = planner.plan(3, 8)  # units left: layer 3 (2 units) + head = 3
    assert plan.pipe_len <= 3 and 8 % plan.pipe_len == 0


def test_stage_sizes_count_the_frozen_prefix_at_lambda_on_stage_0():
    sizes = UnitCosts.from_param_counts([60, 6, 12, 6, 12, 6, 12, 3], 1 / 6)  # 3 layers
    plan = balance(sizes, 1, 2)  # embedding and layer 0 frozen: prefix units [0, 3)
    assert plan.prefix_end == 3
    got = stage_sizes(sizes, plan)
    prefix = (60 + 6 + 12) / 6
    first, second = plan.stage_ranges
    assert got[0] == pytest.approx(prefix + sum(sizes.trained[u] for u in range(*first)))
    assert got[1] == pytest.approx(sum(sizes.trained[u] for u in range(*second)))


def test_compression_compares_parameter_sizes_not_the_balanced_costs():
    """Eq. 2 compares parameter sizes (a memory proxy). Stages balanced on time can be
    slower per micro-batch once packed and still fit the start's largest stage in size, and
    the other way round: the criterion follows the sizes either way."""
    layers = 6
    sizes = UnitCosts.from_param_counts([40] + [10, 20] * layers + [5], 1 / 6)
    # Attention 20x slower than its size says: packed stages take far longer than the
    # start's slowest, which a test on seconds refuses.
    slow_attention = UnitCosts(
        tuple([1.0] + [40.0, 2.0] * layers + [0.5]), tuple([0.3] + [12.0, 0.6] * layers + [0.2])
    )
    on_sizes = AutoPipePlanner(slow_attention, 4, sizes=sizes)
    on_seconds = AutoPipePlanner(slow_attention, 4)
    frozen = 4
    packed = on_sizes.plan(frozen, 4)
    assert packed.pipe_len < 4
    assert max(stage_sizes(sizes, packed)) <= on_sizes.initial_max_size * (1 + 1e-9)
    assert packed.max_stage_cost > on_sizes.initial.max_stage_cost  # slower, still packed
    assert on_seconds.plan(frozen, 4).pipe_len == 4
    # The other way: a slow embedding alone on stage 0 makes every packed layout faster than
    # the start's slowest stage, but the sizes of the active layers do not fit its largest.
    units = 2 * layers + 2
    slow_embedding = UnitCosts(tuple([1000.0] + [1.0] * (units - 1)), (1.0,) + (0.3,) * (units - 1))
    uniform = UnitCosts.from_param_counts([10] * units, 1 / 6)
    assert AutoPipePlanner(slow_embedding, 4).plan(1, 4).pipe_len == 1
    planner = AutoPipePlanner(slow_embedding, 4, sizes=uniform)
    assert planner.plan(1, 4).pipe_len == 4
    fast = uniform
    with pytest.raises(ValueError, match="one size per unit"):
        AutoPipePlanner(fast, 2, sizes=UnitCosts.from_param_counts([1, 2], 1 / 6))


def test_compression_by_memory_packs_where_the_device_holds_it():
    """autopipe.compression 'memory': with a device budget, fitting it decides (the proxy's
    size test is not asked); without one, the packed plan's predicted peak against the
    initial plan's. Toy memory: 1 byte per trained unit held, 0.1 per frozen one."""
    costs = vit_like()

    def peak(plan):
        return max(
            sum(0.1 if u < plan.frozen_end else 1.0 for u in range(a, b))
            + (0.1 * plan.prefix_end if s == 0 else 0)
            for s, (a, b) in enumerate(plan.stage_ranges)
        )

    by_params = AutoPipePlanner(costs, 2)
    initial_peak = peak(by_params.initial)  # 9 units: 9.0
    # The proxy holds 2 stages at F = 2; by memory, one stage of 13 trained units and a
    # prefix of 5 (13.5) is more than the initial 9.0 as well ...
    assert by_params.plan(2, 2).pipe_len == 2
    by_bytes = AutoPipePlanner(costs, 2, peak_bytes=peak)
    assert by_bytes.initial_max_size == initial_peak
    assert by_bytes.plan(2, 2).pipe_len == 2
    # ... until enough is frozen: F = 5 (7 trained, prefix of 11: 8.1 <= 9.0).
    assert by_bytes.plan(5, 2).pipe_len == 1
    # With a device budget, a layout that fits it packs although it is above the initial
    # plan's peak (the budget is what the initial peak stands for).
    roomy = AutoPipePlanner(costs, 2, fits=lambda plan: peak(plan) <= 14.0, peak_bytes=peak)
    assert roomy.plan(2, 2).pipe_len == 1
    # The proxy under the same budget still holds it at 2 stages (Eq. 2 on sizes).
    assert AutoPipePlanner(costs, 2, fits=lambda plan: peak(plan) <= 14.0).plan(2, 2).pipe_len == 2
    tight = AutoPipePlanner(costs, 2, fits=lambda plan: peak(plan) <= 12.0, peak_bytes=peak)
    assert tight.plan(2, 2).pipe_len == 2
