"""A run audited as a GPU would run it (tests/test_gpu_rules.py): collectives and group
creation (gpu_audit.CollectiveAudit), host reads and blocking transfers over whole steps
(HostReads, BlockingTransfers), the low-precision copies of weights a step makes, the
micro-batch trials and a sharded layout's FSDP2 modules left alive. Runs inside gloo worker
processes."""

from __future__ import annotations

import gc
import weakref

import torch
from gpu_audit import BlockingTransfers, CollectiveAudit, HostReads

AUDITED_STEPS = 2  # per layout, after one step that builds what a layout builds once


def _host_kept(trainer) -> set[int]:
    """Storages torch keeps on the host on a GPU too: Adam's step count (not fused)."""
    optimizer = trainer.stage.optimizer
    if optimizer is None:
        return set()
    return {
        state["step"].untyped_storage().data_ptr()
        for state in optimizer.state.values()
        if isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "cpu"
    }


def _trained(trainer) -> set[int]:
    from pipetransformer.fsdp import local  # a sharded layout's parameter: its shard

    return {
        local(p).untyped_storage().data_ptr()
        for p in trainer.stage.named_params().values()
        if p.requires_grad
    }


def _audited_steps(trainer, ticks, layout_name: str) -> dict:
    """One step to warm up, then AUDITED_STEPS steps under the audits."""

    def step() -> None:
        tick = next(ticks)
        trainer.metrics.record(tick, trainer.steps.run(tick, trainer.stage))

    step()
    host_kept = _host_kept(trainer)
    reads = HostReads(host_kept, _trained(trainer))
    transfers = BlockingTransfers(host_kept)
    with reads, transfers:
        for _ in range(AUDITED_STEPS):
            step()
    casts = reads.casts.values()
    momentum = _momentum_check(trainer) if trainer.stage.layout.pipe_len == 1 else None
    return {
        "momentum": momentum,
        "layout": layout_name,
        "host_reads": reads.reads,
        "blocking": transfers.found,
        "most_casts_of_a_weight": max(casts) / AUDITED_STEPS if casts else 0,
        "num_micro_batches": trainer.stage.layout.plan.num_micro_batches,
        "cache_active": trainer.stage.cache_active,
    }


def _momentum_check(trainer) -> tuple[list[float], list[float]]:
    """(the trainer's per-unit ||m||^2 for signal_to_noise, the same from each of this
    rank's bias-corrected first moments in full) in a one-stage layout, where every rank
    trains every unit: replicated (DDP) or sharded (each moment a DTensor shard)."""
    from torch.distributed.tensor import DTensor

    from pipetransformer.utils.units import parse_param_key

    got = trainer.unit_momentum_sq()
    optimizer = trainer.stage.optimizer
    expected = [0.0] * trainer.spec.num_units
    group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
    for name, p in trainer.stage.named_params().items():
        state = optimizer.state.get(p)
        if not state:
            continue
        moment = state["exp_avg"]
        moment = moment.full_tensor() if isinstance(moment, DTensor) else moment
        correction = 1.0 - group_of[p]["betas"][0] ** float(state["step"])
        expected[parse_param_key(name)[0]] += (moment.double().norm().item() / correction) ** 2
    return got, expected


def audited_run(config_dict: dict, run_dir: str, frozen_after: int):
    import datetime

    import torch.distributed as dist

    import pipetransformer.trainer.trainer as trainer_module
    from pipetransformer.config import config_from_dict
    from pipetransformer.trainer.trainer import Trainer

    trainer = Trainer(config_from_dict(config_dict), run_dir)
    audit = CollectiveAudit(torch.device("cpu"), None)
    make_control = trainer_module.create_control_group
    runtimes: list[weakref.ref] = []
    make_runtime = trainer._runtime

    def separate_control(timeout_s: float):
        # On gloo the control group is the world; apart, the audit tells them apart.
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        audit.control_group = group
        return group

    def recorded_runtime(*args, **kwargs):
        runtime = make_runtime(*args, **kwargs)
        if runtime is not None:
            runtimes.append(weakref.ref(runtime))
        return runtime

    def alive_trials() -> int:
        """Runtimes built so far that are still alive, the current stage's left out."""
        current = trainer.stage.runtime
        return sum(1 for ref in runtimes if ref() is not None and ref() is not current)

    trainer_module.create_control_group = separate_control
    trainer._runtime = recorded_runtime
    audit.install()
    phases = []
    trials_alive = []
    try:
        gc.collect()
        gc.disable()  # what reference counting alone frees, as in a run
        trainer.setup()
        trials_alive.append(alive_trials())
        ticks = trainer.clock.ticks()
        phases.append(_audited_steps(trainer, ticks, trainer.stage.layout.describe()))
        old_sharded = []  # a sharded layout's FSDP2 modules: the root and what it holds
        if trainer.stage.layout.sharded:
            old_sharded = [weakref.ref(m) for m in trainer.stage.runtime.module.modules()]
        trainer.transition(frozen_after)
        trials_alive.append(alive_trials())
        sharded_alive = sum(1 for ref in old_sharded if ref() is not None)
        phases.append(_audited_steps(trainer, ticks, trainer.stage.layout.describe()))
        return {
            "phases": phases,
            "trials_alive": trials_alive,
            "trials_built": len(runtimes),
            "old_sharded_modules": [sharded_alive, len(old_sharded)],
            "violations": audit.violations,
            "groups": audit.groups,
            "counts": audit.counts,
            "collectives": audit.collectives,
        }
    finally:
        gc.enable()
        audit.uninstall()
        trainer_module.create_control_group = make_control
        trainer.cleanup()
