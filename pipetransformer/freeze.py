"""Freeze algorithm: how many bottom layers have converged. Pure: numbers in, a number out.

`num_frozen_layers` (F) counts frozen layers from the bottom; the embedding freezes with the
first of them (or from the first step, `freeze.embedding`), the head never does. A decision
never lowers F and never exceeds `max_frozen_layers` (default L - 1). docs/architecture.md
("A training step and a decision point") gives each rule's reasoning and readings.

Eq. 1's bound, one rounding for every rule and every prediction:
    B(F) = F + ceil(alpha (L - F))      (a product within 1e-6 of an integer is that integer)
    Rounded up so each decision may freeze a layer until the cap (rounded down it stalls once
    alpha (L - F) < 1); iterated, it never falls behind the released code's closed form
    ceil(L (1 - (1 - alpha)^T)) and may run one layer ahead of it (`bound_trajectory`).

The rules (`freeze.strategy`); each with a signal proposes P, then F = max(F', min(P, B, cap)):
    gradient_norm            Eq. 1 as Appendix B states it: P = argmin_{l >= F'} ||g_l||, the
                             layers below the least-moving one freeze. ||g_l||: layer l's RMS
                             gradient norm over the interval, reduced over every rank. Ties go
                             to the lower layer; NaN or infinite norms are never the argmin.
    gradient_norm_inclusive  the same with the argmin layer frozen too (P + 1).
    convergence              P = the end of the run of layers from F' up whose norm changed
                             by less than `convergence_threshold` since the last decision
                             (the first decision only measures).
    signal_to_noise          P = the end of the run of layers whose gradient is mostly noise:
                             rho = clamp((r - c) / (1 - c), 0, 1) below `signal_threshold`,
                             r = ||m||^2 / E||g||^2 (m the optimizer's moving average),
                             c = (1 - beta) / (1 + beta) (`signal_fraction`).
    autofreeze               AutoFreeze (Liu et al. 2021): each layer's gradient summed over
                             the interval (L1 norm per step), its relative change since the
                             last decision; P = the first active layer whose change reaches
                             the `percentile` of the active layers'. No bound.
    alpha_schedule           the released code's closed form ceil(L (1 - (1 - alpha)^T)).
    manual                   `manual_schedule[T - 1]` (the last entry repeats).
    none                     F = 0: the baseline.
T counts decision points from 1; `DecisionSchedule` places them (epoch ends, or every
`interval_steps` steps, fitted to a shorter budget by `cadence_epochs`).
`freeze.eq1_bound: false` drops B: the signal alone decides, up to the cap.

Who decided (`FreezeOutcome.decided_by`, recorded with every decision): `signal` (P below
what the bound and the cap allowed), `agree` (P equal to it), `bound` (Eq. 1's bound held P
back), `cap`, `no_signal` (nothing to read yet), `schedule` (alpha_schedule, manual), `plan`
(layer-wise annealing froze layers whose rate had reached zero, anneal.py) and `layout`
(`freeze.memory_aware` kept only the fewest layers that change the layout,
`fewest_that_pay`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetransformer.config import FreezeConfig

# A product alpha * (L - F) within this of an integer counts as that integer.
_ROUNDING_SLACK = 1e-6

# Strategies that read per-layer gradient norms.
GRADIENT_RULES = ("gradient_norm", "gradient_norm_inclusive", "convergence", "signal_to_noise")
# Strategies that read each layer's gradient summed over the decision interval.
ACCUMULATED_RULES = ("autofreeze",)

# Who set a decision's layer count (FreezeOutcome.decided_by; module docstring, "Who decided").
SIGNAL = "signal"  # the rule's signal, below what the bound and the cap allowed
AGREE = "agree"  # the signal proposed exactly what the bound (or the cap) allowed
BOUND = "bound"  # Eq. 1's bound: the signal would have frozen more
CAP = "cap"  # max_frozen_layers (or every layer it allows is frozen already)
SCHEDULE = "schedule"  # a rule without a signal: alpha_schedule, manual
NO_SIGNAL = "no_signal"  # nothing to read yet (a first decision that only measures)
PLAN = "plan"  # layer-wise annealing froze layers the rule held back (their rate reached 0)
LAYOUT = "layout"  # freeze.memory_aware held the rule to the fewest layers that pay a layout
DECIDERS = (SIGNAL, AGREE, BOUND, CAP, SCHEDULE, NO_SIGNAL, PLAN, LAYOUT)


@dataclass(frozen=True)
class FreezeOutcome:
    """A decision and what set it: the layer count, the signal's own proposal (None: the
    rule read no signal), Eq. 1's bound B(F) (None: the rule has none, or freeze.eq1_bound
    is off), the cap, and which of them decided (`DECIDERS`)."""

    num_frozen_layers: int
    proposed: int | None
    bound: int | None
    cap: int
    decided_by: str


def _clamp(previous: int, proposed: int, max_frozen_layers: int) -> int:
    return max(previous, min(proposed, max_frozen_layers))


def _outcome(previous: int, proposed: int | None, bound: int | None, cap: int) -> FreezeOutcome:
    """F = clamp(min(proposed, bound, cap)) and which term set it."""
    if previous >= cap:
        return FreezeOutcome(previous, proposed, bound, cap, CAP)
    if proposed is None:
        return FreezeOutcome(previous, None, bound, cap, NO_SIGNAL)
    allowed = cap if bound is None else min(bound, cap)
    decided = _clamp(previous, min(proposed, allowed), cap)
    if proposed < allowed:
        by = SIGNAL
    elif proposed == allowed:
        by = AGREE
    else:
        by = BOUND if bound is not None and bound <= cap else CAP
    return FreezeOutcome(decided, proposed, bound, cap, by)


def fewest_that_pay(
    outcome: FreezeOutcome, previous: int, pays: Callable[[int], bool]
) -> FreezeOutcome:
    """freeze.memory_aware: of the layers `outcome` freezes, only the fewest whose freezing
    pays, `pays(F)` saying whether at F frozen layers AutoPipe packs the pipeline onto fewer
    devices or AutoDP adds a replica; nothing where no count up to the rule's pays. A layer
    frozen for no layout buys its backward and costs its learning, which a run that trains
    it longer keeps (the pipeline ground's peak, docs/benchmarks.md); the rule's signal and
    bound still say which layers may freeze at all."""
    wanted = outcome.num_frozen_layers
    decided = next((count for count in range(previous + 1, wanted + 1) if pays(count)), previous)
    if decided == wanted:
        return outcome
    return dataclasses.replace(outcome, num_frozen_layers=decided, decided_by=LAYOUT)


def counts_that_pay(previous: int, most: int, pays: Callable[[int], bool]) -> list[int]:
    """freeze.memory_aware: the counts of frozen layers above `previous`, up to `most`, whose
    freezing changes the layout (`pays`). Empty: in this layout no layer will freeze (a model
    that fits a process, every process a replica already)."""
    return [count for count in range(previous + 1, most + 1) if pays(count)]


def eq1_bound(num_frozen_layers: int, num_layers: int, alpha: float) -> int:
    """B(F) = F + ceil(alpha (L - F)): the most layers Eq. 1 lets a decision freeze (the
    module docstring says why up)."""
    remaining = num_layers - num_frozen_layers
    if remaining <= 0:
        return num_frozen_layers
    return num_frozen_layers + max(0, math.ceil(alpha * remaining - _ROUNDING_SLACK))


def bound_trajectory(
    num_layers: int, alpha: float, decisions: int, max_frozen_layers: int | None = None
) -> list[int]:
    """F after each of `decisions` decisions when the bound always binds (every gradient
    rule's fastest pace; `plan --predict --trajectory paper`)."""
    cap = num_layers - 1 if max_frozen_layers is None else max_frozen_layers
    frozen, values = 0, []
    for _ in range(decisions):
        frozen = _clamp(frozen, eq1_bound(frozen, num_layers, alpha), cap)
        values.append(frozen)
    return values


def gradient_norm_outcome(
    num_frozen_layers: int,
    layer_grad_norms: Sequence[float],
    alpha: float,
    max_frozen_layers: int,
    inclusive: bool = False,
    bounded: bool = True,
) -> FreezeOutcome:
    """Eq. 1 (module docstring) and what decided it: `inclusive` freezes the argmin layer
    too; `bounded` False drops the bound (freeze.eq1_bound)."""
    if any(norm < 0 for norm in layer_grad_norms):
        raise ValueError("gradient_norm: gradient norms must not be negative")
    num_layers = len(layer_grad_norms)
    previous = num_frozen_layers
    bound = eq1_bound(previous, num_layers, alpha) if bounded else None
    cap = min(max_frozen_layers, num_layers)
    usable = [l for l in range(previous, num_layers) if math.isfinite(layer_grad_norms[l])]
    if previous >= cap or not usable:
        return _outcome(previous, None, bound, cap)
    # Ties go to the lower layer: fewer layers freeze when the signal is ambiguous.
    argmin = min(usable, key=lambda layer: (layer_grad_norms[layer], layer))
    return _outcome(previous, argmin + 1 if inclusive else argmin, bound, cap)


def signal_fraction(momentum_sq: float, mean_grad_sq: float, beta: float) -> float:
    """rho = clamp((r - c) / (1 - c), 0, 1), r = ||m||^2 / E||g||^2, c = (1 - beta) /
    (1 + beta): the share of a gradient that is signal (module docstring). NaN when no
    gradient was measured (E||g||^2 = 0)."""
    if momentum_sq < 0 or mean_grad_sq < 0:
        raise ValueError("signal_to_noise: squared norms must not be negative")
    if not 0 <= beta < 1:
        raise ValueError(f"signal_to_noise: the moving average's decay must be in [0, 1): {beta}")
    if mean_grad_sq == 0 or not math.isfinite(momentum_sq / mean_grad_sq):
        return math.nan
    floor = (1 - beta) / (1 + beta)
    return min(1.0, max(0.0, (momentum_sq / mean_grad_sq - floor) / (1 - floor)))


def signal_to_noise_outcome(
    num_frozen_layers: int,
    layer_signal_fractions: Sequence[float],
    alpha: float,
    threshold: float,
    max_frozen_layers: int,
    bounded: bool = True,
) -> FreezeOutcome:
    """The `signal_to_noise` rule (module docstring) and what decided it: from F up, the
    layers whose gradient is mostly noise freeze, up to the first that is not, at most
    B(F)."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"signal_to_noise: threshold must be in [0, 1], got {threshold}")
    if any(rho < 0 for rho in layer_signal_fractions if not math.isnan(rho)):
        raise ValueError("signal_to_noise: signal fractions must not be negative")
    num_layers = len(layer_signal_fractions)
    previous = num_frozen_layers
    bound = eq1_bound(previous, num_layers, alpha) if bounded else None
    cap = min(max_frozen_layers, num_layers)
    # NaN compares false: a layer without a measured gradient stops the freezing.
    proposed = _run_below(previous, [rho < threshold for rho in layer_signal_fractions])
    return _outcome(previous, proposed, bound, cap)


def _run_below(previous: int, converged: Sequence[bool]) -> int:
    """From `previous` up, the end of the run of consecutive converged layers: the signal's
    proposal of the rules that freeze up to the first unconverged layer."""
    proposed = previous
    while proposed < len(converged) and converged[proposed]:
        proposed += 1
    return proposed


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's
    default); infinite values sort last and an interpolation that touches one is infinite."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = q / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    fraction = rank - low
    if low == high or fraction == 0:
        return ordered[low]
    if math.isinf(ordered[high]):
        return ordered[high]
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def autofreeze_outcome(
    num_frozen_layers: int,
    layer_grad_sums: Sequence[float],
    previous_layer_grad_sums: Sequence[float] | None,
    percentile_q: float,
    max_frozen_layers: int,
) -> FreezeOutcome:
    """The `autofreeze` rule (module docstring) and what decided it (it has no bound):
    `layer_grad_sums` are this interval's per-layer L1 norms of the accumulated gradient
    (per step), the previous ones those the previous decision saw (None or empty at the
    first decision: nothing freezes)."""
    num_layers = len(layer_grad_sums)
    previous_sums = [] if previous_layer_grad_sums is None else list(previous_layer_grad_sums)
    if previous_sums and len(previous_sums) != num_layers:
        raise ValueError(
            f"autofreeze: {len(previous_sums)} previous layer gradient sums for {num_layers} layers"
        )
    if any(value < 0 for value in (*layer_grad_sums, *previous_sums)):
        raise ValueError("autofreeze: gradient norms must not be negative")
    if not 0 <= percentile_q <= 100:
        raise ValueError(f"autofreeze: percentile must be in [0, 100], got {percentile_q}")
    previous = num_frozen_layers
    cap = min(max_frozen_layers, num_layers)
    if not previous_sums or previous >= cap:
        return _outcome(previous, None, None, cap)
    active = range(previous, num_layers)
    ratios = {l: _relative_change(previous_sums[l], layer_grad_sums[l]) for l in active}
    cut = percentile(list(ratios.values()), percentile_q)
    return _outcome(previous, next(l for l in active if ratios[l] >= cut), None, cap)


def _closed_form(decision_index: int, num_layers: int, alpha: float) -> int:
    return math.ceil(num_layers * (1 - (1 - alpha) ** decision_index) - _ROUNDING_SLACK)


def _scheduled(previous: int, proposed: int, max_frozen_layers: int) -> FreezeOutcome:
    """A rule without a signal: the schedule decides unless the cap holds it."""
    decided = _clamp(previous, proposed, max_frozen_layers)
    by = CAP if proposed > max_frozen_layers or previous >= max_frozen_layers else SCHEDULE
    return FreezeOutcome(decided, None, None, max_frozen_layers, by)


@dataclass
class FreezeDecider:
    """Applies the configured strategy at successive decision points."""

    config: FreezeConfig
    num_layers: int

    @property
    def max_frozen_layers(self) -> int:
        cap = self.config.max_frozen_layers
        return self.num_layers - 1 if cap is None else min(cap, self.num_layers)

    @property
    def needs_grad_norms(self) -> bool:
        return self.config.strategy in GRADIENT_RULES

    @property
    def needs_grad_sums(self) -> bool:
        """The rule reads each layer's gradient accumulated over the interval."""
        return self.config.strategy in ACCUMULATED_RULES

    def decide(self, decision_index: int, num_frozen_layers: int, *signals, **named) -> int:
        """The layer count `outcome` decides (the same arguments)."""
        return self.outcome(decision_index, num_frozen_layers, *signals, **named).num_frozen_layers

    def outcome(
        self,
        decision_index: int,
        num_frozen_layers: int,
        layer_grad_norms: Sequence[float] | None = None,
        previous_layer_grad_norms: Sequence[float] | None = None,
        layer_signal_fractions: Sequence[float] | None = None,
        layer_grad_sums: Sequence[float] | None = None,
        previous_layer_grad_sums: Sequence[float] | None = None,
    ) -> FreezeOutcome:
        """The decision and what set it. `previous_layer_grad_norms`: the norms the previous
        decision saw (convergence only; the caller keeps them, in the run state, so they
        survive a resume). `layer_signal_fractions`: per layer, `signal_fraction`
        (signal_to_noise only). `layer_grad_sums` and the previous decision's: per layer,
        the L1 norm of the gradient accumulated over the interval, per step (autofreeze
        only)."""
        if decision_index < 1:
            raise ValueError("decision points are counted from 1")
        strategy = self.config.strategy
        cap = self.max_frozen_layers
        bounded = self.config.eq1_bound
        if strategy == "none":
            return FreezeOutcome(num_frozen_layers, None, None, cap, SCHEDULE)
        norms_missing = layer_grad_norms is None or len(layer_grad_norms) != self.num_layers
        if self.needs_grad_norms and norms_missing:
            raise ValueError(f"{strategy} needs {self.num_layers} layer gradient norms")
        if strategy in ("gradient_norm", "gradient_norm_inclusive"):
            return gradient_norm_outcome(
                num_frozen_layers,
                layer_grad_norms,
                self.config.alpha,
                cap,
                inclusive=strategy == "gradient_norm_inclusive",
                bounded=bounded,
            )
        if strategy == "convergence":
            return convergence_outcome(
                num_frozen_layers,
                layer_grad_norms,
                previous_layer_grad_norms,
                self.config.alpha,
                self.config.convergence_threshold,
                cap,
                bounded,
            )
        if strategy == "signal_to_noise":
            if layer_signal_fractions is None or len(layer_signal_fractions) != self.num_layers:
                raise ValueError(f"{strategy} needs {self.num_layers} layer signal fractions")
            return signal_to_noise_outcome(
                num_frozen_layers,
                layer_signal_fractions,
                self.config.alpha,
                self.config.signal_threshold,
                cap,
                bounded,
            )
        if strategy == "autofreeze":
            if layer_grad_sums is None or len(layer_grad_sums) != self.num_layers:
                raise ValueError(f"{strategy} needs {self.num_layers} layer gradient sums")
            return autofreeze_outcome(
                num_frozen_layers,
                layer_grad_sums,
                previous_layer_grad_sums,
                self.config.percentile,
                cap,
            )
        if strategy == "alpha_schedule":
            proposed = _closed_form(decision_index, self.num_layers, self.config.alpha)
            return _scheduled(num_frozen_layers, proposed, cap)
        if strategy == "manual":
            schedule = self.config.manual_schedule
            proposed = schedule[min(decision_index, len(schedule)) - 1]
            return _scheduled(num_frozen_layers, proposed, cap)
        raise ValueError(f"freeze.strategy: unknown strategy '{strategy}'")


# freeze.interval_steps 'auto' (and 'measured'): decisions per epoch; for 'measured', the
# share of the time between two decisions a transition may take before decisions are spaced
# further apart.
DECISIONS_PER_EPOCH = 3
TRANSITION_TIME_SHARE = 0.05


@dataclass(frozen=True)
class DecisionSchedule:
    """When decision points fall: every `interval_steps` optimizer steps (counted from the
    previous decision), or (None) at the end of every epoch; none during the first
    `warmup_epochs` epochs and none after the run's last step (nothing would train in the
    new layout). Pure: the trainer asks `due` once after every step. The step's epoch is
    handed in, not derived from a step count: with `trainer.batch_per_replica` an epoch's
    steps change with the number of replicas.

    Fitted to a shorter run (`freeze.cadence_epochs` C, the run E epochs: a budget run of
    `compare --budgets`): the decisions fall at the same shares of the run as in a run of C
    epochs, so the interval (an epoch's steps for decisions at epoch ends) and the warm-up
    are scaled by E / C and rounded up: a 1-epoch budget of a 3-epoch config deciding at
    epoch ends decides after a third and two thirds of its epoch (`warmup_steps` then
    replaces `warmup_epochs`)."""

    interval_steps: int | None
    warmup_epochs: int
    warmup_steps: int | None = None  # fitted: no decision before this global step

    @classmethod
    def for_config(
        cls,
        config: FreezeConfig,
        steps_per_epoch: int,
        min_interval_steps: int = 1,
        epochs: int = 1,
    ) -> DecisionSchedule:
        """`steps_per_epoch`: of the layout the run starts in (what 'auto' divides);
        `min_interval_steps`: the lower bound 'measured' has learnt from transition costs
        ('auto' ignores it: its interval is a function of the config alone); `epochs`: the
        run's, for autofreeze's 'auto' (the run's steps over `freeze.num_intervals`, rounded
        down, as its code has it)."""
        interval = config.interval_steps
        reference = config.cadence_epochs or epochs  # the run the cadence is set for
        if interval == "auto" and config.strategy == "autofreeze":
            # As AutoFreeze's code cuts the run: int(epochs * steps / num_intervals).
            interval = max(1, steps_per_epoch * reference // config.num_intervals)
        elif interval in ("auto", "measured"):
            interval = math.ceil(steps_per_epoch / DECISIONS_PER_EPOCH)
        if reference == epochs:
            if config.interval_steps == "measured":
                interval = max(interval, min_interval_steps)
            return cls(interval, config.warmup_epochs)
        # Fitted to this run's share of the reference run (class docstring), rounded up.
        steps = steps_per_epoch if interval is None else interval
        fitted = max(1, -(-steps * epochs // reference))
        if config.interval_steps == "measured":
            fitted = max(fitted, min_interval_steps)
        warmup = -(-config.warmup_epochs * steps_per_epoch * epochs // reference)
        return cls(fitted, config.warmup_epochs, warmup)

    def due(
        self,
        epoch: int,
        epoch_end: bool,
        last: bool,
        steps_since_decision: int,
        global_step: int = 0,
    ) -> bool:
        """After a step of `epoch` (0-based); `epoch_end`: that step finished its epoch;
        `last`: it was the run's last step; `steps_since_decision`: steps since the previous
        decision point (since the start before the first), this one included;
        `global_step`: steps of the run, this one included (a fitted warm-up reads it)."""
        if last:
            return False
        if self.interval_steps is None:
            return epoch_end and epoch + 1 >= self.warmup_epochs
        warm = (
            epoch >= self.warmup_epochs
            if self.warmup_steps is None
            else (global_step >= self.warmup_steps)
        )
        return steps_since_decision >= self.interval_steps and warm


def min_interval_for(transition_s: float, step_s: float) -> int:
    """Fewest steps between decisions for a transition of `transition_s` to take at most
    TRANSITION_TIME_SHARE of the time between them."""
    if step_s <= 0:
        return 1
    return max(1, math.ceil(transition_s / (TRANSITION_TIME_SHARE * step_s)))


def check_freeze_config(config: FreezeConfig, num_layers: int) -> None:
    """Checks that need the model's depth; raised before any process starts."""
    from pipetransformer.config import ConfigError

    if config.max_frozen_layers is not None and config.max_frozen_layers > num_layers:
        raise ConfigError(
            f"freeze.max_frozen_layers: {config.max_frozen_layers} exceeds "
            f"the model's {num_layers} layers"
        )
    if config.strategy == "manual" and max(config.manual_schedule) > num_layers:
        raise ConfigError(
            f"freeze.manual_schedule: {max(config.manual_schedule)} exceeds "
            f"the model's {num_layers} layers"
        )


def _relative_change(previous_norm: float, norm: float) -> float:
    """|norm - previous| / previous; infinite when there is no usable ratio (a previous norm
    of 0, a NaN or an infinite norm), so such a layer never counts as converged."""
    if not (math.isfinite(previous_norm) and math.isfinite(norm)) or previous_norm == 0:
        return math.inf
    return abs(norm - previous_norm) / previous_norm


def convergence_outcome(
    num_frozen_layers: int,
    layer_grad_norms: Sequence[float],
    previous_layer_grad_norms: Sequence[float] | None,
    alpha: float,
    threshold: float,
    max_frozen_layers: int,
    bounded: bool = True,
) -> FreezeOutcome:
    """The `convergence` rule (module docstring) and what decided it:
    `previous_layer_grad_norms` are the norms the previous decision saw, None or empty at
    the first decision."""
    num_layers = len(layer_grad_norms)
    previous_norms = [] if previous_layer_grad_norms is None else list(previous_layer_grad_norms)
    if previous_norms and len(previous_norms) != num_layers:
        raise ValueError(
            f"convergence: {len(previous_norms)} previous layer gradient norms "
            f"for {num_layers} layers"
        )
    if any(norm < 0 for norm in (*layer_grad_norms, *previous_norms)):
        raise ValueError("convergence: gradient norms must not be negative")
    if not threshold >= 0:
        raise ValueError(f"convergence: threshold must be >= 0, got {threshold}")
    previous = num_frozen_layers
    bound = eq1_bound(previous, num_layers, alpha) if bounded else None
    cap = min(max_frozen_layers, num_layers)
    if not previous_norms:
        return _outcome(previous, None, bound, cap)
    converged = [
        _relative_change(before, now) < threshold
        for before, now in zip(previous_norms, layer_grad_norms)
    ]
    return _outcome(previous, _run_below(previous, converged), bound, cap)
