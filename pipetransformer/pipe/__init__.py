"""Pipeline execution: one rank's stage, DDP wrapper and schedule for one layout."""

from pipetransformer.pipe.runtime import StageRuntime, build_stage_runtime

__all__ = ["StageRuntime", "build_stage_runtime"]
