"""Rank-prefixed logging. Every module logs through `logging.getLogger(__name__)`."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s [rank%(rank)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int | str) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int | str = "-", level: int = logging.INFO) -> None:
    """Route the package's logs to stderr, each line tagged with the process's rank."""
    logger = logging.getLogger("pipetransformer")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
