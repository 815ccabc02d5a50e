"""The trainer: orchestrates freeze, AutoPipe, AutoDP and AutoCache around the step loop."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipetransformer.config import Config
from pipetransformer.trainer.records import RunSummary
from pipetransformer.trainer.rundir import RunOptions

logger = logging.getLogger(__name__)


def run_worker(
    config: Config, run_dir: str | Path, options: RunOptions | None = None
) -> RunSummary:
    """One rank's whole run: setup, train, cleanup (also after a failure or a stop).
    Raises RunStopped when a stop signal ended the run after a checkpoint."""
    from pipetransformer.trainer.trainer import Trainer
    from pipetransformer.utils.logging import setup_logging
    from pipetransformer.utils.stopping import StopRequest

    setup_logging(rank=os.environ.get("RANK", "-"))
    stop = (
        StopRequest().install()
    )  # before anything slow: a signal during setup still stops cleanly
    trainer = Trainer(config, run_dir, options, stop)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()


__all__ = ["RunOptions", "run_worker"]
