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
    # Time the data-parallel all-reduce (the paper's App. F.4 method: `ddp_comm_s` in
    # metrics.jsonl, the compare report's DDP comm share). Costs Python on every step: DDP's
    # C++ all-reduce is replaced by a communication hook (a callback and two device events
    # per bucket per step). Off, DDP reduces on its own and nothing is timed.
    time_communication: bool = False
