"""The trainer: orchestrates freeze, AutoPipe, AutoDP and AutoCache around the step loop."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipetransformer.config import Config

logger = logging.getLogger(__name__)


def run_worker(config: Config, run_dir: str | Path) -> dict[str, Any]:
    """One rank's whole run: setup, train, cleanup (also after a failure)."""
    import os

    from pipetransformer.trainer.trainer import Trainer
    from pipetransformer.utils.logging import setup_logging

    setup_logging(rank=os.environ.get("RANK", "-"))
    trainer = Trainer(config, run_dir)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()
