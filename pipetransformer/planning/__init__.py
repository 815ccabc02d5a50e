"""Planning: what a run of a config will do and cost, without starting a process.

`PlanContext` (context.py) is built once from the config, the model's spec, its unit
profile, the device's memory budget and the world, and gives the layout at every frozen
boundary; the trainer, `plan` (table.py) and `plan --predict` all use it.
profile_keys.py names the profiles a config has.

`plan --predict`, one file a step: prediction_inputs.py turns the flags into inputs (the
model's spec, built once; the cluster; unit times measured or from roofline.py over
analytical.py's counts on a hardware.py device; the training-set size); predict.py
replays the run (prediction_run.py over run_model.py, each step priced by cluster.py over
step_model.py), takes the layout at each boundary (prediction_layouts.py) and the peers
(prediction_peers.py); prediction_report.py prints it.
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
