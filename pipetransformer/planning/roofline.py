"""Roofline unit times: what each unit of a model would take on a named device, from its
counted work (planning/analytical.py) and the device's data-sheet figures
(planning/hardware.py), without running anything on that device.

For each unit, and for its forward, backward and frozen forward separately:

    seconds = max(FLOPs / (peak FLOP/s x compute fraction),
                  bytes / (memory bandwidth x memory fraction))

The peak is the device's dense matrix peak for the run's matmuls (`matmul_peak`):
`trainer.precision: bf16` uses the bfloat16 peak; fp32 the TF32 tensor-core peak when
`trainer.tf32` is on (the default: the trainer sets `torch.backends.cuda.matmul.allow_tf32`
and cuDNN's), the plain FP32 peak when it is off. A dtype the device has no matrix units
for falls back to its FP32 peak (`Device.peak_flops`: a Quadro RTX 5000 or a V100 has no
TF32).

The achieved fractions say how much of a data-sheet peak real kernels get; the defaults are
published measurements (see each constant). The model takes the larger of the two terms over
a whole unit, not per operator: the FLOPs count only matrix multiplies, and the bytes are an
upper bound without kernel fusion (analytical.py), so for a compute-bound unit the time of its
elementwise kernels is left out, which the compute fraction, a whole-step figure, absorbs.

Owns: `AchievedFractions`, `roofline_seconds` and `roofline_profile` (an AnalyticalProfile
and a Device in, a UnitProfile out, the record measured profiles use).
Must not: import torch, measure or build anything, or pick a layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.autopipe.profiles import UnitProfile
from pipetransformer.planning.hardware import Device

if TYPE_CHECKING:  # analytical.py imports torch; only its record types are used here
    from pipetransformer.planning.analytical import AnalyticalProfile

# Fraction of the dense matrix peak a training step achieves. Narayanan et al., "Efficient
# Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21,
# arXiv:2104.04473): 44-52% of the A100's peak per GPU across their GPT runs, 52% at 1T
# parameters; Chowdhery et al., "PaLM" (arXiv:2204.02311): 46.2% model FLOPs utilization.
# These are whole-step figures (communication and pipeline bubbles included, which the step
# model adds on its own), so kernels alone reach more; the lower figure stands in for the
# elementwise kernels this roofline does not time (see the module docstring).
ACHIEVED_COMPUTE_FRACTION = 0.5
# Fraction of the data-sheet memory bandwidth that streaming kernels achieve. Jia et al.,
# "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking" (arXiv:1804.06826):
# 750 of the V100's 900 GB/s (83%); Jia et al., "Dissecting the NVidia Turing T4 GPU via
# Microbenchmarking" (arXiv:1903.07486): 220 of the T4's 320 GB/s (69%), GDDR6 on the same
# TU104 chip as the Quadro RTX 5000. 0.75 lies within 10% of both.
ACHIEVED_MEMORY_FRACTION = 0.75

# trainer.precision -> the compute dtype its activations are counted in.
PRECISION_PEAKS = {"fp32": "float32", "bf16": "bfloat16"}


def matmul_peak(precision: str, tf32: bool) -> str:
    """The peak (planning/hardware.py PEAK_FIELDS) a run's matmuls run at."""
    if precision == "fp32" and tf32:
        return "tf32"
    return PRECISION_PEAKS[precision]


@dataclass(frozen=True)
class AchievedFractions:
    """How much of a device's peak compute and memory bandwidth kernels achieve, in (0, 1]."""

    compute: float = ACHIEVED_COMPUTE_FRACTION
    memory: float = ACHIEVED_MEMORY_FRACTION

    def __post_init__(self) -> None:
        for name in ("compute", "memory"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"achieved {name} fraction must be in (0, 1], got {value!r}")


def roofline_seconds(
    flops: float,
    bytes_moved: float,
    peak_flops_per_s: float,
    memory_bytes_per_s: float,
    fractions: AchievedFractions | None = None,
) -> float:
    """The larger of the compute time and the memory time of one pass (`fractions`: the
    defaults when None)."""
    fractions = fractions or AchievedFractions()
    compute_s = flops / (peak_flops_per_s * fractions.compute)
    memory_s = bytes_moved / (memory_bytes_per_s * fractions.memory)
    return max(compute_s, memory_s)


def roofline_profile(
    work: AnalyticalProfile,
    device: Device,
    fractions: AchievedFractions | None = None,
    peak: str | None = None,
) -> UnitProfile:
    """Per-unit forward, backward and frozen-forward seconds of `work` on `device`, at the
    `peak` its matmuls run at (default: the work's compute dtype's; `matmul_peak`); output,
    saved and parameter bytes as counted."""
    fractions = fractions or AchievedFractions()
    peak = device.peak_flops(peak or work.dtype)
    bandwidth = device.memory_bytes_per_s

    def seconds(flops: str, bytes_moved: str) -> tuple[float, ...]:
        return tuple(
            roofline_seconds(getattr(u, flops), getattr(u, bytes_moved), peak, bandwidth, fractions)
            for u in work.units
        )

    return UnitProfile(
        micro_batch_size=work.micro_batch_size,
        forward_s=seconds("forward_flops", "forward_bytes"),
        backward_s=seconds("backward_flops", "backward_bytes"),
        frozen_forward_s=seconds("frozen_forward_flops", "frozen_forward_bytes"),
        output_bytes=work.column("output_bytes"),
        saved_bytes=work.column("saved_bytes"),
        param_bytes=work.column("param_bytes"),
    )
