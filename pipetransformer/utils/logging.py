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


def setup_logging(rank: int | str = "-", level: int | None = None) -> None:
    """Route the package's logs to stderr, each line tagged with the process's rank. By
    default the reporting process (the CLI, global rank 0, a node's cache daemon) logs
    from INFO and every other rank only its warnings and errors: the ranks agree on
    everything, so they would each say the same."""
    if level is None:
        level = logging.INFO if str(rank) in ("-", "0", "cache") else logging.WARNING
    logger = logging.getLogger("pipetransformer")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
