"""The checkpoint section: how often a run saves and how many checkpoints it keeps.

Owns: CheckpointConfig and its checks. Must not: import anything outside config/.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetransformer.config.errors import _fail


@dataclass(frozen=True)
class CheckpointConfig:
    # A checkpoint at the end of every N-th epoch (after its evaluation); 0: none at epoch ends.
    interval_epochs: int = 1
    # Also one every N optimizer steps; None: only at epoch ends.
    interval_steps: int | None = None
    # Complete checkpoints kept (the newest N); older ones go once a newer one exists.
    keep_last: int = 2
    # Also keep the checkpoint with the best eval metric (RUN_DIR/checkpoints/best).
    keep_best: bool = True

    def __post_init__(self) -> None:
        if self.interval_epochs < 0:
            _fail("checkpoint.interval_epochs", f"must be >= 0, got {self.interval_epochs}")
        if self.interval_steps is not None and self.interval_steps < 1:
            _fail("checkpoint.interval_steps", f"must be >= 1 or null, got {self.interval_steps}")
        if self.keep_last < 1:
            _fail("checkpoint.keep_last", f"must be >= 1, got {self.keep_last}")
