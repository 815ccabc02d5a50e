"""Compare: baseline vs elastic (and ablations), speedup at equal accuracy, report and plots."""

from pipetransformer.compare.runner import rebuild_compare, run_compare

__all__ = ["rebuild_compare", "run_compare"]
