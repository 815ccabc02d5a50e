"""transformers' weight-loading report, in one line of ours when all it says is that the
head is new.

Fine-tuning a pretrained encoder for classification always adds a head the checkpoint does
not hold, and transformers 5 says so as a warning table ("BertForSequenceClassification
LOAD REPORT ... classifier.weight | MISSING"), which a user reads as an error. Around
`from_pretrained`, the table is held back (a filter on transformers' `modeling_utils`
logger, where it is logged); when the checkpoint lacked only the head's weights, one line
of ours says which ("new head: classifier.weight, classifier.bias"); anything else it
reports (unexpected keys, a missing encoder weight, a shape mismatch) lets the whole table
through as transformers wrote it.

Owns: that filter and the line. Must not: change what is loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

REPORT_LOGGER = "transformers.modeling_utils"  # where log_state_dict_report writes the table


class _HoldReport(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            self.held.append(record)
            return False
        return True


def new_head_keys(model: Any, info: dict[str, Any]) -> list[str] | None:
    """The missing weights, in the model's order, when they are all outside the pretrained
    encoder (its `base_model_prefix`) and nothing else was reported; else None."""
    prefix = f"{model.base_model_prefix}."
    missing = set(info.get("missing_keys") or ())
    others = (
        info.get("unexpected_keys")
        or info.get("mismatched_keys")
        or info.get("error_msgs")
        or any(key.startswith(prefix) for key in missing)
    )
    if others or not missing:
        return None
    return [key for key in model.state_dict() if key in missing]


def load_with_own_report(load: Callable[..., tuple[Any, dict[str, Any]]], source: str) -> Any:
    """`load(output_loading_info=True)` (a `from_pretrained`), its report said as one line
    when only the head is new (see the module docstring); the model."""
    report_logger = logging.getLogger(REPORT_LOGGER)
    hold = _HoldReport()
    report_logger.addFilter(hold)
    keys = None
    try:
        model, info = load(output_loading_info=True)
        keys = new_head_keys(model, info)
    finally:
        report_logger.removeFilter(hold)
        if keys is None:  # anything else it reports, or a failure: transformers' own words
            for record in hold.held:
                report_logger.handle(record)
    if keys:
        logger.info(
            "new head: %s (not in %s: trained from random weights)", ", ".join(keys), source
        )
    return model
