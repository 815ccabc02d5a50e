"""Predicted against measured memory of one pipeline stage, in a worker process: the check
that keeps the memory model honest (tests/test_memory.py, benchmarks/memory_model.py, which
puts this directory on its path).

Owns: building one rank's stage of a K x R layout of a ViT fed with synthetic images,
measuring its unit profile and the peak of a training step, and predicting that peak.
Must not: run anywhere but inside a worker started with torchrun's environment.
"""

from __future__ import annotations

import gc

import torch

from pipetransformer.autodp.groups import build_training_groups
from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.memory import LayoutShape, MemoryModel
from pipetransformer.autopipe.planner import UnitCosts, balance
from pipetransformer.autopipe.profiles import UnitProfile
from pipetransformer.config import config_from_dict
from pipetransformer.models import build_model, unit_param_names
from pipetransformer.pipe import build_stage_runtime
from pipetransformer.pipe.measure import bytes_in_use, measure_unit_costs, peak_bytes
from pipetransformer.tasks import ClassificationTask, loss_weights
from pipetransformer.trainer import optim as optim_module
from pipetransformer.trainer.distributed import init_distributed


def _training_step(
    runtime, units, config, replica_batch, image_size, dp_degree, batch, seed, role=None
):
    """One training step of `runtime` with its optimizer over `units`, on a synthetic batch of
    `replica_batch` images: inputs to the first stage, targets to the last (`role` None: a
    one-stage runtime that is both)."""
    named = {
        name: p
        for index, unit in units.items()
        for name, p in unit_param_names(unit, index).items()
    }
    optimizer = optim_module.build_optimizer(config.optimizer, named)
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(replica_batch, 1, image_size, image_size, generator=g)
    target = ClassificationTask.make_target(
        torch.randint(0, 10, (replica_batch,), generator=g),
        loss_weights([True] * replica_batch, dp_degree, batch),
    )
    first = role is None or role.is_first
    last = role is None or role.is_last

    def step():
        runtime.train_step([images] if first else None, target if last else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure_stage_memory(
    config_dict: dict,
    pipe_len: int,
    dp_degree: int,
    schedule: str,
    micro_batches: int,
    image_size: int = 32,
) -> dict:
    """One rank of a K x R layout: its stage's predicted peak bytes (MemoryModel over a unit
    profile measured here) and its measured peak (pipe/measure.py: malloc's bytes in
    use, sampled after every operator of a training step, above what the process held
    before the stage existed)."""
    config = config_from_dict(config_dict)
    world = init_distributed("cpu", 120)
    batch = config.trainer.global_batch_size
    replica_batch = batch // dp_degree
    micro = replica_batch // micro_batches
    torch.manual_seed(0)
    model = build_model(
        config.model, task="classification", num_classes=10, in_chans=1, image_size=image_size
    )
    profile = UnitProfile.from_measurements(
        measure_unit_costs(dict(enumerate(model.units)), model.spec, micro, "cpu"), micro
    )
    # The first model and measurement also paid for lazy imports and oneDNN's primitive
    # caches (tens of MB, once per process): the baseline is taken after them.
    del model
    gc.collect()
    baseline = bytes_in_use()
    model = build_model(
        config.model, task="classification", num_classes=10, in_chans=1, image_size=image_size
    )
    plan = balance(UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6), 0, pipe_len)
    layout = Layout(plan, world.world_size, world.world_size, dp_degree).with_micro_batches(
        micro_batches
    )
    plan = layout.plan
    groups = build_training_groups(layout, world.rank, 120)
    role = layout.role(world.rank)
    units = {u: model.units[u] for u in layout.units_of_rank(world.rank)}
    spec = model.spec
    del model  # only this stage's units stay alive, as in training
    gc.collect()
    runtime = build_stage_runtime(
        plan=plan,
        stage_index=role.stage,
        replica_batch_size=replica_batch,
        units=units,
        spec=spec,
        loss_fn=ClassificationTask.loss_fn,
        schedule_name=schedule,
        pipeline_group=groups.pipeline,
        data_group=groups.data,
        device=world.device,
    )
    step = _training_step(
        runtime, units, config, replica_batch, image_size, dp_degree, batch, seed=1, role=role
    )
    step()  # optimizer state and the pipeline's buffers exist from here on, as in training
    gc.collect()
    peak = peak_bytes(step)
    memory = MemoryModel.from_profile(profile, config.optimizer.name, config.optimizer.momentum)
    predicted = memory.stage_memory(
        plan, role.stage, LayoutShape(micro, micro_batches, dp_degree, schedule)
    )
    torch.distributed.destroy_process_group()
    return {"stage": role.stage, "predicted": predicted.to_dict(), "measured": peak - baseline}


def eval_retained_bytes(config_dict: dict, image_size: int = 32) -> dict:
    """One rank of a 2-stage pipeline: bytes still held after two evaluation steps (above
    what it held before them, after a training step), and whether the last stage's outputs
    carry an autograd graph."""
    config = config_from_dict(config_dict)
    world = init_distributed("cpu", 120)
    batch = config.trainer.global_batch_size
    torch.manual_seed(0)
    model = build_model(
        config.model, task="classification", num_classes=10, in_chans=1, image_size=image_size
    )
    plan = balance(UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6), 0, 2)
    layout = Layout(plan, world.world_size, world.world_size, 1).with_micro_batches(2)
    groups = build_training_groups(layout, world.rank, 120)
    role = layout.role(world.rank)
    units = {u: model.units[u] for u in layout.units_of_rank(world.rank)}
    runtime = build_stage_runtime(
        plan=layout.plan,
        stage_index=role.stage,
        replica_batch_size=batch,
        units=units,
        spec=model.spec,
        loss_fn=ClassificationTask.loss_fn,
        schedule_name="gpipe",
        pipeline_group=groups.pipeline,
        data_group=None,
        device=world.device,
    )
    g = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 1, image_size, image_size, generator=g)
    target = ClassificationTask.make_target(
        torch.randint(0, 10, (batch,), generator=g), loss_weights([True] * batch, 1, batch)
    )
    inputs = [images] if role.is_first else None
    runtime.train_step(inputs, target if role.is_last else None)
    for p in runtime.module.parameters():
        p.grad = None
    gc.collect()
    before = bytes_in_use()
    for _ in range(2):
        outputs = runtime.eval_step(inputs, target if role.is_last else None)
    with_graph = outputs is not None and outputs.requires_grad
    del outputs
    gc.collect()
    retained = bytes_in_use() - before
    torch.distributed.destroy_process_group()
    return {"stage": role.stage, "retained": retained, "with_graph": with_graph}


def measure_sharded_memory(
    config_dict: dict, num_frozen_layers: int = 0, image_size: int = 32
) -> dict:
    """One rank of a sharded layout over every process (FSDP2, fsdp/runtime.py), with
    `num_frozen_layers` frozen (their units held in full in front of it): the predicted
    peak (MemoryModel.sharded_memory over a unit profile measured here) and the measured
    one, as `measure_stage_memory` measures it."""
    from pipetransformer.fsdp import build_sharded_runtime
    from pipetransformer.utils.units import prefix_end

    config = config_from_dict(config_dict)
    world = init_distributed("cpu", 120)
    batch = config.trainer.global_batch_size
    replica_batch = batch // world.world_size
    torch.manual_seed(0)
    model = build_model(
        config.model, task="classification", num_classes=10, in_chans=1, image_size=image_size
    )
    profile = UnitProfile.from_measurements(
        measure_unit_costs(dict(enumerate(model.units)), model.spec, replica_batch, "cpu"),
        replica_batch,
    )
    del model
    gc.collect()
    baseline = bytes_in_use()
    model = build_model(
        config.model, task="classification", num_classes=10, in_chans=1, image_size=image_size
    )
    costs = UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6)
    plan = balance(costs, num_frozen_layers, 1)
    layout = Layout(plan, world.world_size, world.world_size, world.world_size, True)
    groups = build_training_groups(layout, world.rank, 120)
    units = dict(enumerate(model.units))
    del model
    for index in range(prefix_end(num_frozen_layers)):
        units[index].requires_grad_(False)
    runtime = build_sharded_runtime(
        plan=plan,
        replica_batch_size=replica_batch,
        units=units,
        loss_fn=ClassificationTask.loss_fn,
        data_group=groups.data,
        device=world.device,
    )
    step = _training_step(
        runtime, units, config, replica_batch, image_size, world.world_size, batch, 1 + world.rank
    )
    step()  # the optimizer state exists from here on, as in training
    gc.collect()
    peak = peak_bytes(step)
    memory = MemoryModel.from_profile(profile, config.optimizer.name, config.optimizer.momentum)
    predicted = memory.sharded_memory(plan, LayoutShape(replica_batch, 1, world.world_size))
    torch.distributed.destroy_process_group()
    return {"predicted": predicted.to_dict(), "measured": peak - baseline}
