"""Planning: what a run of a config will do and cost, without starting a process.

`PlanContext` (context.py) is built once from the config, the model's spec, its unit
profile, the device's memory budget and the world, and gives the layout at every frozen
boundary; the trainer, `plan` (table.py) and `plan --predict` (predict.py, over the step
model of step_model.py; its inputs from prediction_inputs.py, unit times measured or from
roofline.py over analytical.py's counts on a hardware.py device) all use it.
profile_keys.py names the profiles a config has.
"""

from pipetransformer.planning.context import (
    PlanContext,
    describe_model,
    device_memory_budget,
    format_bytes,
    model_build_args,
    profiling_micro_batch_size,
)

__all__ = [
    "PlanContext",
    "describe_model",
    "device_memory_budget",
    "format_bytes",
    "model_build_args",
    "profiling_micro_batch_size",
]
