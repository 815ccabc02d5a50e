"""The trainer: orchestrates freeze, AutoPipe, AutoDP and AutoCache around the step loop."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipetransformer.config import Config
from pipetransformer.runs.records import RunSummary
from pipetransformer.runs.rundir import RunOptions

logger = logging.getLogger(__name__)


def quiet_libraries(speaking: bool) -> None:
    """transformers' own output: its weight-loading report on the reporting rank only, and
    its progress bars only on a terminal (in a log file they are carriage-return debris).
    Through the environment, which transformers reads when it is imported (a ViT run never
    imports it); applied at once where it already is."""
    import sys

    bars = speaking and sys.stderr.isatty()
    if not speaking:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not bars:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        if not speaking:
            transformers_logging.set_verbosity_error()
        if not bars:
            transformers_logging.disable_progress_bar()


def run_worker(
    config: Config, run_dir: str | Path, options: RunOptions | None = None
) -> RunSummary:
    """One rank's whole run: setup, train, cleanup (also after a failure or a stop).
    Raises RunStopped when a stop signal ended the run after a checkpoint."""
    from pipetransformer.trainer.trainer import Trainer
    from pipetransformer.utils.logging import setup_logging
    from pipetransformer.utils.stopping import StopRequest

    rank = os.environ.get("RANK", "-")
    setup_logging(rank=rank)
    quiet_libraries(speaking=rank in ("0", "-"))
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
