"""Profiling inside a run: the unit costs and micro-batch timings a run measures at setup
and at transitions, collectively, kept in the run's profile file for its resumes.

Measuring a module is `pipe/measure.py`'s; the records and their keys are
`autopipe/profiles.py`'s and `planning/profile_keys.py`'s. This package is the part that
needs every rank (broadcast, reduce) and the run's directory.
"""

from pipetransformer.profiling.run_profiler import RunProfiler

__all__ = ["RunProfiler"]
