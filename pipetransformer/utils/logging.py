"""Rank-prefixed logging. Every module logs through `logging.getLogger(__name__)`.

Also: terminal colour codes kept out of logs that are not a terminal. transformers colours
its loading report when stdout is a terminal, but logs it to stderr, which a user may have
redirected to a file (`2> train.log`): `plain_text_when_redirected` strips them there.
"""

from __future__ import annotations

import logging
import re
import sys

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

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


class _PlainText(logging.Filter):
    """Strips colour codes from the records a handler writes to `stream` unless it is a
    terminal."""

    def __init__(self, stream) -> None:
        super().__init__()
        self.stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        if not (callable(isatty) and isatty()):
            message = record.getMessage()
            if "\x1b[" in message:
                record.msg, record.args = _ANSI.sub("", message), None
        return True


def plain_text_when_redirected(logger: logging.Logger) -> None:
    """Every stream handler of `logger` writes without colour codes where its stream is not
    a terminal (once per handler)."""
    for handler in logger.handlers:
        stream = getattr(handler, "stream", None)
        if stream is not None and not any(isinstance(f, _PlainText) for f in handler.filters):
            handler.addFilter(_PlainText(stream))
