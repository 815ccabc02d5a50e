"""The freeze section: which rule freezes layers, when it decides and how far it may go.

Owns: FreezeConfig and every check of its own keys, kept together here (the check that
needs the optimizer is in checks.py). Must not: import anything outside config/,
touch torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipetransformer.config.errors import _fail


@dataclass(frozen=True)
class FreezeConfig:
    # gradient_norm: the paper's Eq. 1 (the layers below the smallest gradient norm freeze);
    # gradient_norm_inclusive: the same with that layer frozen too; freeze.py says more.
    strategy: Literal[
        "none",
        "gradient_norm",
        "gradient_norm_inclusive",
        "convergence",
        "signal_to_noise",
        "autofreeze",
        "alpha_schedule",
        "manual",
    ] = "none"
    alpha: float = 1 / 3
    # For strategy 'convergence' (this project's rule): a bottom layer freezes once the RMS
    # of its per-step gradient norms changed by less than this share between two decision
    # points (still at most alpha of the active layers per decision).
    convergence_threshold: float = 0.05
    # For strategy 'signal_to_noise': a bottom layer freezes once the share of its gradient
    # that is signal (the rest being minibatch noise) has fallen below this (freeze.py).
    signal_threshold: float = 0.1
    # For strategy 'autofreeze' (Liu et al. 2021): the layers below the first active layer
    # whose accumulated gradient changed by at least this percentile of the active layers'
    # changes freeze (50: the median, AutoFreeze's default).
    percentile: float = 50.0
    # With a freezing strategy: the embedding is frozen from the first step (no gradient, no
    # all-reduce, no optimizer state for it), as fine-tuning often does; the layers freeze as
    # the strategy decides. The baseline (strategy 'none') trains it. 'auto': frozen where
    # the model starts from trained weights (model.model_name_or_path, model.pretrained or
    # model.checkpoint_path), trained where it starts random: a random embedding frozen
    # from the first step never learns (Config.embedding_frozen).
    embedding: bool | Literal["auto"] = "auto"
    # Eq. 1's bound B(F) = F + ceil(alpha (L - F)) on gradient_norm(_inclusive), convergence
    # and signal_to_noise; false drops it: the rule's signal alone decides, up to
    # max_frozen_layers (alpha unused). freeze.py, "Without the bound".
    eq1_bound: bool = True
    # Which gradients a rule's signal reads: 'raw' (after backward, before clipping: what
    # AutoFreeze's code sums), 'clipped' (what the optimizer applies); 'auto': raw for
    # autofreeze, clipped for the others.
    signal_gradients: Literal["auto", "raw", "clipped"] = "auto"
    # Decision every N optimizer steps; null: at the end of every epoch; 'auto': three per
    # epoch of the starting layout's steps (from the data size and the batch: the same on
    # any machine), for autofreeze the run's steps over num_intervals; 'measured' (opt-in):
    # 'auto', spaced further apart when the run's first transition cost more than 5% of the
    # time between decisions, which depends on the machine's load (docs/architecture.md,
    # "Decision cadence").
    interval_steps: int | Literal["auto", "measured"] | None = "auto"
    # The run length (epochs) the decision cadence above is set for; null: this run's
    # (trainer.epochs). A shorter run with the config's epochs here (a budget run of
    # `compare --budgets`) decides at the same shares of its run as the config's run does:
    # the interval and freeze.warmup_epochs scaled by trainer.epochs / cadence_epochs, so a
    # 1-epoch budget of a 3-epoch config deciding at epoch ends decides after a third and
    # two thirds of its epoch (freeze.py, DecisionSchedule). The rule is unchanged.
    cadence_epochs: int | None = None
    # For strategy 'autofreeze' with interval_steps 'auto': decide every 1/num_intervals of
    # the run's steps (AutoFreeze's --num_intervals: 10 its argparse default, 20 in the
    # command its README gives).
    num_intervals: int = 10
    # Freeze only what pays a layout: of the layers the rule would freeze, the fewest that let
    # AutoPipe pack the pipeline onto fewer devices (or AutoDP add a replica), and none
    # where no count the rule allows does (freeze.py `fewest_that_pay`). Where the model
    # already trains as DDP (one stage, every process a replica) nothing then freezes but
    # the embedding (freeze.embedding).
    memory_aware: bool = False
    # No decision before this many epochs have completed (layers must learn something first).
    warmup_epochs: int = 0
    # Most layers that may freeze; None: all but the last layer.
    max_frozen_layers: int | None = None
    # For strategy 'manual': num_frozen_layers at each decision point, in order.
    manual_schedule: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            _fail("freeze.alpha", f"must be in (0, 1), got {self.alpha}")
        if not self.convergence_threshold >= 0:  # NaN fails too
            _fail("freeze.convergence_threshold", f"must be >= 0, got {self.convergence_threshold}")
        if not 0 <= self.signal_threshold <= 1:  # NaN fails too
            _fail("freeze.signal_threshold", f"must be in [0, 1], got {self.signal_threshold}")
        if not 0 <= self.percentile <= 100:  # NaN fails too
            _fail("freeze.percentile", f"must be in [0, 100], got {self.percentile}")
        if self.num_intervals < 1:
            _fail("freeze.num_intervals", f"must be >= 1, got {self.num_intervals}")
        if isinstance(self.interval_steps, int) and self.interval_steps < 1:
            _fail("freeze.interval_steps", "must be >= 1, 'auto', 'measured' or null")
        if self.warmup_epochs < 0:
            _fail("freeze.warmup_epochs", "must be >= 0")
        if self.cadence_epochs is not None and self.cadence_epochs < 1:
            _fail("freeze.cadence_epochs", f"must be >= 1 or null, got {self.cadence_epochs}")
        if self.max_frozen_layers is not None and self.max_frozen_layers < 0:
            _fail("freeze.max_frozen_layers", "must be >= 0 or null")
        if self.strategy == "manual":
            if not self.manual_schedule:
                _fail("freeze.manual_schedule", "strategy 'manual' needs a non-empty list")
            if any(b < a for a, b in zip(self.manual_schedule, self.manual_schedule[1:])):
                _fail("freeze.manual_schedule", f"must never decrease, got {self.manual_schedule}")
            if any(n < 0 for n in self.manual_schedule):
                _fail("freeze.manual_schedule", "entries must be >= 0")

    @property
    def signal_before_clipping(self) -> bool:
        """Whether the rule's signal reads the gradients before clipping (signal_gradients)."""
        if self.signal_gradients == "auto":
            return self.strategy == "autofreeze"
        return self.signal_gradients == "raw"
