"""Compare: baseline vs elastic (and ablations), speedup at equal accuracy, report and plots."""

from pipetransformer.compare.runner import (
    CompareStopped,
    rebuild_compare,
    run_compare,
    stop_signals_raise,
)

__all__ = ["CompareStopped", "rebuild_compare", "run_compare", "stop_signals_raise"]
