"""The pipeline section: the first pipeline's length, micro-batches, schedule and its chunks
a rank, balance, profiles and FSDP2 sharding.

Owns: PipelineConfig and its single-key checks (whether a length fits the devices and the
batch is checks.py's). Must not: import anything outside config/, touch torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipetransformer.config.errors import _fail
from pipetransformer.config.schedules import MULTI_CHUNK_SCHEDULES, ScheduleName


@dataclass(frozen=True)
class PipelineConfig:
    # Stages of the first pipeline. 'auto': the shortest pipeline whose stages fit a device
    # (pipeline.device_memory_bytes), 1 (plain DDP) when the whole model fits.
    initial_pipe_len: int | Literal["auto"] = "auto"
    # Memory of one device for the planner. None: on CUDA the device's total memory less a
    # reserve (1 GiB + 10% for the CUDA context, NCCL and fragmentation); on CPU unlimited.
    device_memory_bytes: int | None = None
    # An int is used for every layout. 'auto': for each layout the smallest M >= K that
    # divides the replica batch (1 for plain DDP), what `plan` and `plan --predict` assume:
    # a function of the config, so the same on any machine and under any load. 'measured'
    # (opt-in) times M in [K, 6K] the first time a layout (K, replica batch) is seen and
    # keeps the fastest (profile file): faster where it wins, but a busy machine may choose
    # another M, and M changes the arithmetic, so the freeze decisions may differ.
    num_micro_batches: int | Literal["auto", "measured"] = "auto"
    # torch.distributed.pipelining's schedule (config/schedules.py): gpipe, 1f1b, and the
    # ones that hold several chunks (virtual stages) a rank, interleaved_1f1b and
    # zero_bubble.
    schedule: ScheduleName = "gpipe"
    # Chunks a rank holds under interleaved_1f1b and zero_bubble. 'auto': 2 (torchtitan's
    # default; the bubble falls as 1/v, the sends grow as v), fewer at a layout whose active
    # units cannot fill K v chunks (one sublayer at least each); an int: that many, fewer
    # likewise. Always 1 for the others.
    virtual_stages: int | Literal["auto"] = "auto"
    # How stages are balanced: measured forward+backward time per unit, or parameter counts.
    balance: Literal["time", "params"] = "time"
    # JSON file of measured profiles (per-sublayer costs, micro-batch timings). None: the
    # run's own RUN_DIR/profiles.json; a path shared by several runs (of the same model on
    # the same kind of machine) lets later runs skip the measurements.
    profile_path: str | None = None
    # FSDP2 (fsdp/): 'always' trains one stage on every process with the trained layers'
    # parameters, gradients and optimizer state sharded over them (the fsdp peers of
    # `compare --peers`); 'auto' takes that sharded layout at a frozen boundary where it
    # fits and is predicted faster than the pipeline layout AutoPipe plans (from the measured
    # unit times and the collectives timed at start; under trainer.batch_per_replica never:
    # every process a replica would multiply the batch); 'never' keeps pipelines and DDP
    # (docs/architecture.md, "Sharded layouts").
    sharding: Literal["never", "always", "auto"] = "auto"
    # In a sharded layout, whether each layer's gathered parameters are freed after its
    # forward and gathered again for its backward (true, FSDP2's default: ZeRO-3, full
    # shard) or kept until its backward (false: ZeRO-2, FSDP1's SHARD_GRAD_OP, one gather a
    # layer a step fewer, the trained layers held unsharded meanwhile).
    fsdp_reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.sharding == "always" and self.initial_pipe_len not in (1, "auto"):
            _fail(
                "pipeline.sharding",
                f"'always' trains one stage: pipeline.initial_pipe_len must be 1 or 'auto', "
                f"got {self.initial_pipe_len}",
            )
        if isinstance(self.initial_pipe_len, int) and self.initial_pipe_len < 1:
            _fail(
                "pipeline.initial_pipe_len", f"must be >= 1 or 'auto', got {self.initial_pipe_len}"
            )
        if self.device_memory_bytes is not None and self.device_memory_bytes < 1:
            _fail(
                "pipeline.device_memory_bytes",
                f"must be >= 1 or null, got {self.device_memory_bytes}",
            )
        if isinstance(self.virtual_stages, int) and self.virtual_stages < 1:
            _fail("pipeline.virtual_stages", f"must be >= 1 or 'auto', got {self.virtual_stages}")
        if (
            isinstance(self.virtual_stages, int)
            and self.virtual_stages > 1
            and self.schedule not in MULTI_CHUNK_SCHEDULES
        ):
            _fail(
                "pipeline.virtual_stages",
                f"{self.virtual_stages} chunks a rank need pipeline.schedule "
                f"{' or '.join(MULTI_CHUNK_SCHEDULES)}; {self.schedule} runs one",
            )
        if isinstance(self.num_micro_batches, int) and self.num_micro_batches < 1:
            _fail(
                "pipeline.num_micro_batches",
                f"must be >= 1, 'auto' or 'measured', got {self.num_micro_batches}",
            )
