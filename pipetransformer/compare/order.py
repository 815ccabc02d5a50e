"""The order in which a comparison runs the variants of one seed, and its record.

Variants of a seed run one after the other on the same machine; when its speed drifts
within a seed (a slower start, another job arriving), the variant that always runs first
would take the drift on every seed, and pairing by seed cannot absorb it. So the order
rotates with the seed: seed s starts at variant s mod n of the comparison's list and wraps
around. What ran in which order is written beside the seed's runs (`order.json`) before the
first of them starts, so a resumed comparison and `--report-only` read the order the runs
were planned in.

Owns: `rotated_order` (pure) and the order files. Must not: run anything.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pipetransformer.utils.files import write_json_atomic

ORDER_FILE = "order.json"


def rotated_order(names: Sequence[str], seed: int | None) -> list[str]:
    """`names` rotated to start at the (seed mod n)-th; as given without a seed."""
    names = list(names)
    if seed is None or not names:
        return names
    start = seed % len(names)
    return names[start:] + names[:start]


def record_order(seed_directory: Path, names: Sequence[str]) -> list[str]:
    """The order to run `names` in: as recorded there earlier (a resumed comparison runs
    what is left in the same order), then the names not recorded yet, in the order given,
    appended to the record (variants added to a comparison later run after those planned
    before, and the record keeps every variant the seed was planned with, in order)."""
    recorded = read_order(seed_directory) or []
    merged = recorded + [name for name in names if name not in recorded]
    if merged != recorded:
        seed_directory.mkdir(parents=True, exist_ok=True)
        write_json_atomic(seed_directory / ORDER_FILE, {"order": merged})
    return [name for name in merged if name in names]


def read_order(seed_directory: Path) -> list[str] | None:
    path = seed_directory / ORDER_FILE
    return json.loads(path.read_text())["order"] if path.is_file() else None
