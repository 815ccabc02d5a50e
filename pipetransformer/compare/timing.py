"""When each variant of a comparison ran, and beside how much other work: the variants run
one after the other, so a machine busier during one of them slows it alone, and the
speedups move with it. The runner records each attempt of a variant's run (its start and
end, the 1-minute load average at both, the cores) in `attempts.json` in the variant's run
directory; a resumed run adds an attempt, a run started over starts a new list. The report
shows them beside the times.

Owns: that record and its one-line description. Must not: judge the load or the times.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.runs.records import Record
from pipetransformer.utils.files import write_json_atomic

ATTEMPTS = "attempts.json"


@dataclass
class VariantAttempt(Record):
    """One attempt of a variant's run, as the runner saw it."""

    started: float  # time.time() when its workers were started
    load_at_start: float  # the 1-minute load average then
    cores: int
    ended: float | None = None
    load_at_end: float | None = None
    outcome: str = "running"  # finished, stopped, failed or refused


def load_average() -> float:
    return os.getloadavg()[0]


def start_attempt(run_dir: Path, resumed: bool) -> list[VariantAttempt]:
    """The attempts of `run_dir` with a new one begun now (`resumed`: after the earlier
    ones; else the only one), written at once so a killed compare leaves it behind."""
    attempts = read_attempts(run_dir) if resumed else []
    attempts.append(VariantAttempt(time.time(), load_average(), os.cpu_count() or 1))
    _write(run_dir, attempts)
    return attempts


def end_attempt(run_dir: Path, attempts: list[VariantAttempt], outcome: str) -> None:
    last = attempts[-1]
    last.ended, last.load_at_end, last.outcome = time.time(), load_average(), outcome
    _write(run_dir, attempts)


def read_attempts(run_dir: Path) -> list[VariantAttempt]:
    """[] for a run directory without the record (a comparison made before it existed)."""
    path = run_dir / ATTEMPTS
    if not path.is_file():
        return []
    return [VariantAttempt.from_dict(a) for a in json.loads(path.read_text())]


def _write(run_dir: Path, attempts: list[VariantAttempt]) -> None:
    write_json_atomic(run_dir / ATTEMPTS, [a.to_dict() for a in attempts])


def describe_attempt(attempt: VariantAttempt) -> str:
    """'2026-11-23 14:02:11, load 1.9 -> 2.4 on 2 cores' (local time)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(attempt.started))
    end = "" if attempt.load_at_end is None else f" -> {attempt.load_at_end:.1f}"
    outcome = "" if attempt.outcome == "finished" else f" ({attempt.outcome})"
    return f"{started}, load {attempt.load_at_start:.1f}{end} on {attempt.cores} cores{outcome}"
