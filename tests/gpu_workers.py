"""A run audited as a GPU would run it (tests/test_gpu_rules.py): collectives and group
creation (gpu_audit.CollectiveAudit), host reads and blocking transfers over whole steps
(HostReads, BlockingTransfers), the low-precision copies of weights a step makes, the
micro-batch trials and a sharded layout's FSDP2 modules left alive. Runs inside gloo worker
processes."""

from __future__ import annotations

import gc
import weakref

import torch
from gpu_audit import BlockingTransfers, CollectiveAudit, HostHeld, HostReads

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

    from pipetransformer.trainer.freezing import unit_momentum_sq
    from pipetransformer.utils.units import parse_param_key

    got = unit_momentum_sq(
        trainer.stage, trainer.spec.num_units, trainer.world.device, trainer.control
    )
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

    old_tensors: list[weakref.ref] = []  # the old stage's, taken just before the transition
    old_alive: list[int] = []

    def recorded_runtime(*args, **kwargs):
        if old_tensors:  # building the new layout: the old one's tensors must be gone
            units = args[1]
            held = {id(t) for u in units.values() for t in (*u.parameters(), *u.buffers())}
            alive = [ref() for ref in old_tensors]
            old_alive.append(sum(1 for t in alive if t is not None and id(t) not in held))
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
    held = HostHeld()  # from the first step on: what a GPU run would hold on the host
    audit.install()
    phases = []
    trials_alive = []
    try:
        gc.collect()
        gc.disable()  # what reference counting alone frees, as in a run
        trainer.setup()
        trainer.steps.grad_sums = True  # AutoFreeze's sums too (freeze.strategy: autofreeze)
        audit.host_held = held.__enter__()
        trials_alive.append(alive_trials())
        ticks = trainer.clock.ticks()
        phases.append(_audited_steps(trainer, ticks, trainer.stage.layout.describe()))
        old_sharded = []  # a sharded layout's FSDP2 modules: the root and what it holds
        if trainer.stage.layout.sharded:
            old_sharded = [weakref.ref(m) for m in trainer.stage.runtime.module.modules()]
        stage = trainer.stage
        trained, owners = stage.grad_owners
        old_tensors.extend(weakref.ref(t) for t in (*trained, owners, *stage.grad_sums))
        del stage, trained, owners
        trainer.transition(frozen_after)
        trials_alive.append(alive_trials())
        sharded_alive = sum(1 for ref in old_sharded if ref() is not None)
        phases.append(_audited_steps(trainer, ticks, trainer.stage.layout.describe()))
        return {
            "phases": phases,
            "trials_alive": trials_alive,
            "trials_built": len(runtimes),
            "old_tensors": [len(old_tensors), old_alive],
            "old_sharded_modules": [sharded_alive, len(old_sharded)],
            "violations": audit.violations,
            "groups": audit.groups,
            "counts": audit.counts,
            "collectives": audit.collectives,
        }
    finally:
        if audit.host_held is not None:
            held.__exit__(None, None, None)
        gc.enable()
        audit.uninstall()
        trainer_module.create_control_group = make_control
        trainer.cleanup()


def sharded_stream_dtypes(cuda_policy: bool) -> dict:
    """A real one-rank FSDP2 sharded runtime (gloo) of a tiny BERT, built with the policy
    `gather_policy` gives a CUDA device under bf16 (`cuda_policy`) or the CPU's, one training
    step under bf16 autocast with layer norm run in float32 as CUDA autocast runs it (CPU
    autocast refuses bfloat16 weights under a float32 input). Returns the dtype of the hidden
    state each trained unit received, in forward order, and the gathered weights' dtype."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from helpers import tiny_bert
    from torch.overrides import TorchFunctionMode

    from pipetransformer.autopipe.planner import PipelinePlan
    from pipetransformer.fsdp import runtime

    class LayerNormInFloat32(TorchFunctionMode):
        """CUDA autocast's rule for layer norm: every floating input in float32."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.layer_norm:
                args = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                kwargs = {
                    k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
                }
            return func(*args, **kwargs)

    dist.init_process_group("gloo")
    try:
        model = tiny_bert()
        units = dict(enumerate(model.units))
        received: list[str] = []
        weights: list[str] = []
        for index in range(1, len(units)):  # the trained units; the embedding is the prefix
            units[index].register_forward_pre_hook(
                lambda module, args: received.append(str(args[0].dtype))
            )
        for module in units[1].modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(
                    lambda module, args: weights.append(str(module.weight.dtype))
                )
                break
        if cuda_policy:
            policy = runtime.gather_policy(torch.device("cuda", 0), torch.bfloat16)
            runtime.gather_policy = lambda device, dtype: policy
        group = dist.new_group([0])
        plan = PipelinePlan(0, 1, 1, ((1, len(units)),), (1.0,), frozen_embedding=True)
        sharded = runtime.build_sharded_runtime(
            plan=plan,
            replica_batch_size=4,
            units=units,
            loss_fn=lambda logits, target: F.cross_entropy(logits, target),
            data_group=group,
            device=torch.device("cpu"),
            autocast_dtype=torch.bfloat16,
        )
        ids = torch.randint(0, 50, (4, 16))
        inputs = [ids, torch.zeros_like(ids), torch.ones_like(ids)]
        with LayerNormInFloat32():
            losses = sharded.train_step(inputs, torch.tensor([0, 1, 0, 1]))
        return {"received": received, "weights": weights, "loss": float(losses[0])}
    finally:
        dist.destroy_process_group()


def audited_peer_run(name: str, config, run_dir: str) -> dict:
    """One rank of a `compare --peers` peer (compare/peers.py) audited as a GPU would run it:
    every collective (CollectiveAudit, with HostHeld following which tensors a GPU run holds
    on the host: NCCL refuses them on the default group); and, within each epoch's training
    (`EpochClock.start` to `.end`), the blocking copies the peer makes (BlockingTransfers)
    and the dtypes its matmuls compute in."""
    from pathlib import Path

    from torch.overrides import TorchFunctionMode

    from pipetransformer.compare import peers

    class MatmulDtypes(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if getattr(func, "__name__", "") in ("linear", "matmul", "conv2d"):
                self.seen.add(str(out.dtype))
            return out

    audit = CollectiveAudit(torch.device("cpu"), None)
    audit.host_held = held = HostHeld()
    epochs: list[tuple[MatmulDtypes, BlockingTransfers]] = []
    start, end = peers.EpochClock.start, peers.EpochClock.end

    def epoch_start(clock) -> None:
        # The audit innermost: it names the caller of what it records.
        modes = (MatmulDtypes(), BlockingTransfers(host_held=held))
        for mode in modes:
            mode.__enter__()
        epochs.append(modes)
        start(clock)

    def epoch_end(clock, *args) -> None:
        for mode in reversed(epochs[-1]):  # the modes entered at the epoch's start
            mode.__exit__(None, None, None)
        end(clock, *args)

    build_data = peers.build_data

    def host_batches(*args, **kwargs):
        """The data as built, its batches marked as held on the host (as on a GPU run)."""
        data = build_data(*args, **kwargs)
        for split in (data.train, data.eval):

            def fetch(ids, fetch=split.fetch):
                inputs, target = fetch(ids)
                held.mark(*inputs, target)
                return inputs, target

            split.fetch = fetch
        return data

    peers.EpochClock.start, peers.EpochClock.end = epoch_start, epoch_end
    peers.build_data = host_batches
    audit.install()
    try:
        with held:
            peers.run_peer(name, config, Path(run_dir))
    finally:
        audit.uninstall()
        peers.EpochClock.start, peers.EpochClock.end = start, end
        peers.build_data = build_data
    return {
        "violations": audit.violations,
        "counts": audit.counts,
        "blocking": [transfers.found for _, transfers in epochs],
        "matmul_dtypes": sorted(set().union(*(dtypes.seen for dtypes, _ in epochs))),
    }


def ranks_planning_apart(config_dict: dict, run_dir: str) -> dict:
    """Two ranks whose devices report different free memory (rank r: 2^(30 + r) bytes): the
    run's plan (trainer/run_plan.py `plan_run`) on each; then each enters a layout of its own
    (the first layout with a different micro-batch count on rank 1) through the trainer's
    `_enter`, its group building recorded (and stopped: ranks that disagree would hang there).
    Returns the budget planned with, the first pipeline length, and the error entering."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    import pipetransformer.trainer.run_plan as run_plan_module
    import pipetransformer.trainer.trainer as trainer_module
    from pipetransformer.autodp.control import Control
    from pipetransformer.config import config_from_dict, resolve
    from pipetransformer.models import build_model
    from pipetransformer.runs.state import RunState
    from pipetransformer.trainer.distributed import init_distributed
    from pipetransformer.trainer.trainer import Trainer

    config = config_from_dict(config_dict)
    world = init_distributed("cpu", 30.0)
    try:
        control = Control(dist.group.WORLD)
        run_plan_module.device_memory_budget = lambda config, device: float(2 ** (30 + world.rank))
        config = resolve(config, world.shape)
        model = build_model(config.model, device="cpu", **_digits_args())
        plan = run_plan_module.plan_run(
            config, model.spec, list(model.units), world, control, Path(run_dir), RunState(), None
        )
        built = []

        class GroupsBuilt(Exception):
            pass

        def build_groups(*args, **kwargs):
            built.append(args)
            raise GroupsBuilt

        trainer_module.build_training_groups = build_groups
        trainer = Trainer.__new__(Trainer)
        trainer.config, trainer.world, trainer.control = plan.plan.config, world, control
        trainer.cache = None
        trainer.clock = SimpleNamespace(use_layout=lambda *args: None)
        layout = plan.plan.layout_for(0, plan.plan.initial_pipe_len)
        if world.rank == 1:
            layout = layout.with_micro_batches(2 * layout.plan.num_micro_batches)
        try:
            trainer._enter(layout, {}, {})
            error = None
        except GroupsBuilt:
            error = "groups built"
        except RuntimeError as exc:
            error = str(exc)
        return {
            "budget": plan.budget,
            "initial_pipe_len": plan.plan.initial_pipe_len,
            "error": error,
            "groups_built": len(built),
        }
    finally:
        dist.destroy_process_group()


def _digits_args() -> dict:
    return dict(task="classification", num_classes=10, in_chans=1, image_size=8)
