"""Compare: baseline vs elastic (and ablations), speedup at equal accuracy, report and plots."""

from pipetransformer.compare.execute import CompareStopped, stop_signals_raise
from pipetransformer.compare.request import CompareRequest
from pipetransformer.compare.runner import rebuild_compare, run_compare

__all__ = [
    "CompareRequest",
    "CompareStopped",
    "rebuild_compare",
    "run_compare",
    "stop_signals_raise",
]
