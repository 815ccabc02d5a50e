"""The error every configuration check raises, and the helper that raises it naming the key.

Owns: ConfigError and `_fail` (private to this package: each section's checks call it).
Must not: import anything outside config/ or know any section's keys.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or impossible. Names the key."""


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{key}: {message}")
