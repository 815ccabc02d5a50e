"""Compare: baseline vs elastic (and ablations), speedup at equal accuracy, report and plots."""

from pipetransformer.compare.runner import run_compare

__all__ = ["run_compare"]
