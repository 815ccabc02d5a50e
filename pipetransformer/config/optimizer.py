"""The optimizer section: the optimizer, its learning-rate schedule and gradient clipping.

Owns: OptimizerConfig and its checks. Must not: import anything outside config/,
touch torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipetransformer.config.errors import _fail


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["sgd", "adam", "adamw"] = "adamw"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = 0
    # Final learning rate of the cosine/linear decay, as a fraction of `lr`.
    min_lr_ratio: float = 0.0
    # Clip the global gradient norm (over every stage of a replica). None: no clipping.
    max_grad_norm: float | None = None
    # torch's optimizer implementation. 'auto': fused kernels for Adam/AdamW on CUDA and the
    # CPU (one pass over the parameters; on CUDA the step count kept on the device), foreach
    # for SGD.
    implementation: Literal["auto", "foreach", "fused"] = "auto"
    # Layer-wise annealing: each layer's learning rate reaches zero at the layer's *planned*
    # freeze time (from the run's length, the decision cadence and the freeze rule: Eq. 1's
    # bound's path, alpha_schedule's closed form, manual's list), so it freezes annealed
    # instead of cut off mid-schedule; the head and the layers the plan never freezes keep
    # the run's schedule. 'freezeout': FreezeOut as published (Brock et al. 2017, and its
    # code's default): a cosine from the layer's initial rate lr / t_i to zero at its freeze
    # time, t_i that time's share of the run. true ('run_schedule'): the run's own warm-up
    # and decay shape squeezed onto the freeze time, no rate scaling (this project's
    # variant). A layer whose rate reached zero freezes at that decision point even where
    # the rule's signal would hold it back. pipetransformer/anneal.py; docs/architecture.md,
    # "Layer-wise annealing".
    layerwise_anneal: bool | Literal["run_schedule", "freezeout"] = False

    def __post_init__(self) -> None:
        if not self.lr > 0:
            _fail("optimizer.lr", f"must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            _fail("optimizer.momentum", f"must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            _fail("optimizer.weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            _fail("optimizer.betas", f"must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            _fail("optimizer.warmup_steps", "must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("optimizer.min_lr_ratio", "must be in [0, 1]")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            _fail("optimizer.max_grad_norm", "must be > 0 or null")

    @property
    def anneal_shape(self) -> str | None:
        """The layer-wise annealing in use: 'run_schedule', 'freezeout' or None (off)."""
        if self.layerwise_anneal is True:
            return "run_schedule"
        return self.layerwise_anneal or None
