"""The cache section: AutoCache's memory budget, disk tier, storage dtype and prefetch.

Owns: CacheConfig and its checks (the one against data.augment is in checks.py).
Must not: import anything outside config/, touch torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipetransformer.config.errors import _fail


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = False
    # Host memory for cached activations; None: a quarter of the free memory at start.
    memory_budget_bytes: int | None = None
    # Directory of the disk tier; None: a temporary directory removed after the run.
    dir: str | None = None
    # Storage precision; float16/bfloat16 halve the footprint (values rounded once). 'auto':
    # the training precision's (bfloat16 under trainer.precision bf16, else float32).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # Cache a randomly augmented training set anyway (its first view; the log says so).
    allow_augmented: bool = False
    # Keep the disk tier's files in cache.dir after the run (for inspection: a later run
    # does not reload them, since entries belong to one run's weights and sample ids).
    keep: bool = False
    # Batches read ahead from the disk tier (the epoch's sample order is known in advance).
    prefetch_batches: int = 4
    # Enable the cache only where a measured read beats recomputing the frozen prefix.
    profile: bool = True

    def __post_init__(self) -> None:
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 0:
            _fail("cache.memory_budget_bytes", "must be >= 0 or null")
        if self.prefetch_batches < 0:
            _fail("cache.prefetch_batches", "must be >= 0")
