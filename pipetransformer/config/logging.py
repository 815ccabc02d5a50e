"""The logging section: where step and epoch metrics go besides the log and RUN_DIR files.

Owns: LoggingConfig. Must not: import anything outside config/ or a logging backend.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoggingConfig:
    # Step and epoch metrics also to TensorBoard (RUN_DIR/tensorboard; the tensorboard extra).
    tensorboard: bool = False
    # ... and to Weights & Biases (the wandb extra; WANDB_MODE=offline works without network).
    wandb: bool = False
