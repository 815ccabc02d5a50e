"""Functions that run inside gloo worker processes (module level, so spawn can import them)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from gpu_audit import HostReads, PipelineTraffic
from helpers import tiny_bert, tiny_vit

from pipetransformer.autodp.groups import build_training_groups
from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.planner import UnitCosts, balance
from pipetransformer.data.vision import digits_split
from pipetransformer.models import unit_param_names
from pipetransformer.pipe import build_stage_runtime
from pipetransformer.tasks import ClassificationTask, loss_weights
from pipetransformer.trainer.distributed import init_distributed

# The digits most tests train on, read here once (data/vision.py keeps them a process):
# helpers.WORKER_CONTEXT's server imports this module, so every worker it forks starts with
# them and with scikit-learn imported (its import and CSV parse, ~1.5 s a worker).
digits_split()


def fixed_batch(kind: str, batch_size: int):
    g = torch.Generator().manual_seed(123)
    labels = torch.randint(0, 10 if kind == "vit" else 2, (batch_size,), generator=g)
    if kind == "vit":
        return (torch.randn(batch_size, 1, 8, 8, generator=g),), labels
    ids = torch.randint(5, 50, (batch_size, 16), generator=g)
    lengths = torch.randint(4, 17, (batch_size,), generator=g)
    if kind == "bert-short":  # sentences of 2-6 tokens: several fill a row of 8 or 16
        lengths = torch.randint(2, 7, (batch_size,), generator=g)
    mask = (torch.arange(16)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    types = torch.zeros_like(ids)
    return (ids, types, mask), labels


def build(kind: str):
    return tiny_vit(seed=0) if kind == "vit" else tiny_bert(seed=0)


def step_lengths(kind: str) -> tuple[int | None, ...]:
    """The sequence length of each step the gradient tests take: text at its full 16
    tokens, then cut to 8 (another bucket: a pipeline builds a stage for it), then 16 again
    (the first bucket's stage, reused); one step for images."""
    return (16, 8, 16) if kind.startswith("bert") else (None,)


def cut(inputs, length: int | None):
    """Text inputs cut to their first `length` tokens (images as they are)."""
    return inputs if length is None else tuple(t[:, :length].contiguous() for t in inputs)


def packed_step(inputs, length: int, micro_batches: int, bucketed: bool = True):
    """A text batch cut to `length` tokens, packed as a pipeline's step packs it (rows of
    that length in a bucket, micro-batches of len / `micro_batches` samples): (its shape,
    its packed inputs)."""
    from pipetransformer.data.base import real_lengths
    from pipetransformer.utils.packing import Packing
    from pipetransformer.utils.padding import packed_shape

    lengths = real_lengths(inputs[-1])
    shape = packed_shape(lengths, len(lengths) // micro_batches, length, bucketed)
    return shape, list(Packing(lengths, shape).inputs(inputs))


def pipeline_gradients(
    kind: str,
    pipe_len: int,
    dp_degree: int,
    micro_batches: int,
    schedule: str,
    batch_size: int,
    autocast_dtype: torch.dtype | None = None,
    virtual_stages: int = 1,
    packed: bool = False,
    ragged: bool = False,
):
    """The steps of `step_lengths(kind)` of a K-stage x R-replica pipeline of `virtual_stages`
    chunks a stage, gradients summed over them (never zeroed); return this rank's gradients
    and losses. `packed`: text batches packed (data.padding packed), a step's shape built
    from its replica batch's real lengths as the trainer builds it. `ragged`: replica r
    takes the lengths r steps on, so the replicas of a step are in different buckets (for
    sentences no longer than the shortest, "bert-short": the same per-sample results)."""
    world = init_distributed("cpu", 60)
    model = build(kind)
    costs = UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6)
    plan = balance(costs, 0, pipe_len, virtual_stages=virtual_stages)
    layout = Layout(plan, world.world_size, world.world_size, dp_degree).with_micro_batches(
        micro_batches
    )
    plan = layout.plan
    groups = build_training_groups(layout, world.rank, 60)
    role = layout.role(world.rank)
    units = {u: model.units[u] for u in layout.units_of_rank(world.rank)}
    runtime = build_stage_runtime(
        plan=plan,
        stage_index=role.stage,
        replica_batch_size=batch_size // dp_degree,
        units=units,
        spec=model.spec,
        loss_fn=ClassificationTask.loss_fn,
        schedule_name=schedule,
        pipeline_group=groups.pipeline,
        data_group=groups.data,
        device=world.device,
        autocast_dtype=autocast_dtype,
    )
    linear_dtypes = set()  # what the stage's matrix multiplies ran in
    for module in runtime.module.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, args, out: linear_dtypes.add(out.dtype))
    inputs, labels = fixed_batch(kind, batch_size)
    share = batch_size // dp_degree
    window = slice(role.replica * share, (role.replica + 1) * share)
    target = None
    if role.is_last:
        target = ClassificationTask.make_target(
            labels[window], loss_weights([True] * share, dp_degree, batch_size)
        )
    losses = []
    host_reads = []  # in the steps of a length met before (the first builds its stages)

    def step_batch(length):
        """(the step's shape, this rank's inputs): every rank computes the shape."""
        batch = [t[window] for t in cut(inputs, length)]
        if packed:
            return packed_step(batch, length, micro_batches)
        return length, batch

    lengths = step_lengths(kind)
    if ragged:  # (16, 8, 16) on replica 0, (8, 16, 8) on replica 1
        lengths = tuple(lengths[(i + role.replica) % 2] for i in range(len(lengths)))
    for index, length in enumerate(lengths):
        shape, step_inputs = step_batch(length)
        audited = length in lengths[:index]
        with HostReads() if audited else contextlib.nullcontext() as audit:
            losses += runtime.train_step(
                step_inputs if role.is_first else None, target, seq_length=shape
            )
        host_reads += audit.reads if audited else []
    grads = {}
    for index, unit in units.items():
        for name, p in unit_param_names(unit, index).items():
            grads[name] = p.grad.clone()
    # The forward-only schedule (evaluation) at the first step's length: the last stage's
    # logits of its replica's samples (no optimizer step was taken: the initial weights).
    shape, eval_inputs = step_batch(step_lengths(kind)[0])
    eval_target = None
    if role.is_last:
        eval_target = ClassificationTask.make_target(labels[window], torch.zeros(share))
    logits = runtime.eval_step(
        eval_inputs if role.is_first else None, eval_target, seq_length=shape
    )
    # The first training step after that evaluation, and the one after it, at the same
    # length: what each sends, receives, votes and allocates (gpu_audit.PipelineTraffic).
    # One more step first, then the evaluation again: DDP rebuilds its buckets once, at its
    # second step (ViT's steps here are one), which is not the evaluation's doing.
    step_inputs = eval_inputs if role.is_first else None
    runtime.train_step(step_inputs, target, seq_length=shape)
    runtime.eval_step(step_inputs, eval_target, seq_length=shape)
    traffic = []
    for _ in range(2):
        with PipelineTraffic() as seen:
            runtime.train_step(step_inputs, target, seq_length=shape)
        traffic.append(seen.counts)
    torch.distributed.destroy_process_group()
    return {
        "after_eval": traffic,
        "rank": world.rank,
        "eval_logits": (window, logits) if role.is_last else None,
        "role": role,
        "grads": grads,
        "losses": [float(l.detach()) for l in losses],
        "linear_dtypes": linear_dtypes,
        "host_reads": host_reads,
        "lengths_built": runtime.seq_lengths_built,
        "stage_classes": sorted(
            {type(s).__name__ for s in runtime._built.values()}  # the schedules that ran
        ),
        "by_hand": runtime.gradient_sync is not None,
        "first_chunk_units": list(range(*plan.stage_ranges[0])),
        "ddp_chunks": sum(
            isinstance(m, torch.nn.parallel.DistributedDataParallel)
            for m in runtime.wrapped.modules()
        ),
    }


def pipeline_gradients_ddp_everywhere(*args):
    """pipeline_gradients with every trained chunk wrapped in DDP whatever the schedule (as
    the runtime wraps interleaved 1F1B's): what zero bubble would do with DDP."""
    from pipetransformer.pipe import runtime

    runtime.SPLIT_BACKWARD_SCHEDULES = ()
    return pipeline_gradients(*args)


def reference_gradients(kind: str, batch_size: int, autocast_dtype: torch.dtype | None = None):
    """The whole model's summed loss and gradients over the steps of `step_lengths(kind)`."""
    model = build(kind)
    inputs, labels = fixed_batch(kind, batch_size)
    total = 0.0
    for length in step_lengths(kind):
        with torch.autocast(
            "cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
        ):
            logits = model(*cut(inputs, length))
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        total += float(loss.detach())
    grads = {}
    for index, unit in enumerate(model.units):
        for name, p in unit_param_names(unit, index).items():
            grads[name] = p.grad.clone()
    return total, grads


def env_rank() -> int:
    return int(os.environ["RANK"])


def gather_state(trainer, include_optimizer: bool = False):
    """The whole model's state (LayeredModel keys) and optimizer state by parameter name,
    assembled on rank 0 from every rank's units (None elsewhere). Collective."""
    from torch.distributed.tensor import DTensor

    from pipetransformer.trainer import optim as optim_module
    from pipetransformer.utils.units import param_key, parse_param_key

    stage = trainer.stage

    def reporter(unit: int) -> int:  # the lowest rank holding a unit reports it
        return min(
            r for r in range(trainer.world.world_size) if unit in stage.layout.units_of_rank(r)
        )

    def full(tensor):  # a sharded layout's shard, gathered (every rank takes part)
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    mine, states = {}, {}
    for index, unit in sorted(stage.units.items()):
        for name, tensor in unit.state_dict().items():
            value = full(tensor)
            if reporter(index) == trainer.world.rank:
                mine[param_key(index, name)] = value.detach().cpu().clone()
    if include_optimizer:
        for name, state in optim_module.states_by_name(
            stage.optimizer, stage.named_params()
        ).items():
            values = {k: full(v) for k, v in state.items()}
            if reporter(parse_param_key(name)[0]) == trainer.world.rank:
                states[name] = {
                    k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                    for k, v in values.items()
                }
    gathered = [None] * trainer.world.world_size if trainer.world.rank == 0 else None
    torch.distributed.gather_object((mine, states), gathered, dst=0, group=trainer.control.group)
    if trainer.world.rank != 0:
        return None
    model_state, optimizer_state = {}, {}
    for part, part_states in gathered:
        model_state.update(part)
        optimizer_state.update(part_states)
    return model_state, optimizer_state


def elastic_run(
    config_dict: dict,
    run_dir: str,
    gather_optimizer: bool = False,
    options=None,
    handoffs: bool = False,
):
    """A whole Trainer run; returns transitions and (rank 0) the final state. Per-step
    losses are in RUN_DIR/steps.jsonl (log_interval_steps 1). With `handoffs`, also this
    rank's (layout, state) before and after each transition (`_snapshot`: exact copies)."""
    from pipetransformer.config import config_from_dict
    from pipetransformer.trainer.trainer import Trainer

    trainer = Trainer(config_from_dict(config_dict), run_dir, options)
    snapshots = []
    if handoffs:
        transition = trainer.transition

        def recorded(*args, **kwargs):
            before = (trainer.stage.layout, _snapshot(trainer))
            record = transition(*args, **kwargs)
            snapshots.append((before, (trainer.stage.layout, _snapshot(trainer))))
            return record

        trainer.transition = recorded
    try:
        trainer.setup()
        summary = trainer.train()
        state = gather_state(trainer, include_optimizer=gather_optimizer)
        return {
            "rank": trainer.world.rank,
            "summary": summary.to_dict(),
            "transitions": trainer.transitions,
            "state": state,
            "handoffs": snapshots,
        }
    finally:
        trainer.cleanup()


def _snapshot(trainer) -> dict:
    """This rank's parameters and optimizer state by global name (exact copies)."""
    from pipetransformer.trainer import optim as optim_module

    named = trainer.stage.named_params()
    states = optim_module.states_by_name(trainer.stage.optimizer, named)
    return {
        name: (
            p.detach().clone(),
            {k: v.clone() if torch.is_tensor(v) else v for k, v in states.get(name, {}).items()},
        )
        for name, p in named.items()
    }


def handoff_snapshots(config_dict: dict, run_dir: str, new_frozen: list[int]):
    """Train, then force transitions; return this rank's state before and after each, after
    each whether the old layout's runtime was still alive when the new stage was built (None
    on a rank that had none), and the unit move's peak bytes above what the rank held when
    it began: (measured by pipe/measure.py, predicted by MemoryModel.move_bytes)."""
    import gc
    import weakref

    import pipetransformer.trainer.transition as transition_module
    from pipetransformer.autopipe.memory import MemoryModel, optimizer_state_factor
    from pipetransformer.config import config_from_dict
    from pipetransformer.pipe.measure import bytes_in_use, peak_bytes
    from pipetransformer.trainer.trainer import Trainer
    from pipetransformer.utils.units import parse_param_key

    config = config_from_dict(config_dict)
    trainer = Trainer(config, run_dir)
    execute = transition_module.execute_transfers
    moves: list[tuple[int, float]] = []

    def measured_move(transfers, rank, units, states, *rest):
        skeleton = trainer.skeleton.units
        param_bytes = tuple(
            sum(p.numel() * p.element_size() for p in skeleton[u].parameters())
            for u in range(len(skeleton))
        )
        factor = optimizer_state_factor(config.optimizer.name, config.optimizer.momentum)
        memory = MemoryModel(param_bytes, (), (), 1, factor)
        held = list(units)
        trained = {parse_param_key(k)[0] for k in states}
        holding = sum(param_bytes[u] * (1 + (factor if u in trained else 0)) for u in held)
        predicted = memory.move_bytes(transfers, rank, held, trained, rest[-1]) - holding
        gc.collect()
        start = bytes_in_use()
        out = []
        peak = peak_bytes(lambda: out.append(execute(transfers, rank, units, states, *rest)))
        moves.append((peak - start, predicted))
        return out[0]

    transition_module.execute_transfers = measured_move
    try:
        trainer.setup()
        trainer.train()
        snapshots = [(trainer.stage.layout, _snapshot(trainer), None, None)]
        enter = trainer._enter
        for frozen in new_frozen:
            runtime = trainer.stage.runtime
            old = weakref.ref(runtime) if runtime is not None else None
            del runtime
            alive: list[bool | None] = []

            def entering(*args, old=old, alive=alive, **kwargs):
                alive.append(None if old is None else old() is not None)
                return enter(*args, **kwargs)

            trainer._enter = entering
            gc.collect()
            gc.disable()  # what reference counting alone frees, as in a run
            try:
                trainer.transition(frozen)
            finally:
                gc.enable()
            snapshots.append((trainer.stage.layout, _snapshot(trainer), alive[0], moves[-1]))
        return snapshots
    finally:
        transition_module.execute_transfers = execute
        trainer.cleanup()


def prefer_sharded_at(frozen: list[int]):
    """A step pricer for pipeline.sharding 'auto' under which a sharded layout is the faster
    exactly at the frozen boundaries in `frozen` (what a run on a cluster would measure)."""

    def pricer(times, config, cluster):
        def price(layout, prefix_s):
            wanted = layout.plan.num_frozen_layers in frozen
            return 1.0 if layout.sharded == wanted else 2.0

        return price

    return pricer


def sharded_handoff_snapshots(
    config_dict: dict, run_dir: str, new_frozen: list[int], sharded_at: list[int] | None = None
):
    """Train a run (sharded, or under pipeline.sharding 'auto' with a sharded layout the
    faster exactly at the boundaries `sharded_at`), then force transitions to each of
    `new_frozen`; on rank 0 the whole state before and after each, gathered in full: per
    parameter name its value and optimizer state, whether it is trained, and the layout's
    frozen end (None elsewhere). Per-step losses are in RUN_DIR/steps.jsonl."""
    import pipetransformer.trainer.run_plan as run_plan
    from pipetransformer.config import config_from_dict
    from pipetransformer.trainer.trainer import Trainer
    from pipetransformer.utils.units import param_key

    if sharded_at is not None:  # priced as on a GPU cluster
        run_plan.step_pricer = prefer_sharded_at(sharded_at)
        run_plan.prices_layouts = lambda config, budget, device: True  # as on a GPU

    def snapshot(trainer) -> dict | None:
        gathered = gather_state(trainer, include_optimizer=True)  # collective
        if gathered is None:
            return None
        model_state, optimizer_state = gathered
        parameters = {
            param_key(index, name)
            for index, unit in enumerate(trainer.skeleton.units)
            for name, _ in unit.named_parameters()
        }
        layout = trainer.stage.layout
        return {
            "layout": (layout.pipe_len, layout.dp_degree, layout.sharded),
            "state": {
                name: (value, optimizer_state.get(name, {}))
                for name, value in model_state.items()
                if name in parameters
            },
            "frozen_end": layout.plan.frozen_end,
            "sharded": layout.sharded,
        }

    trainer = Trainer(config_from_dict(config_dict), run_dir)
    try:
        trainer.setup()
        trainer.train()
        snapshots = [snapshot(trainer)]
        for frozen in new_frozen:
            trainer.transition(frozen)
            snapshots.append(snapshot(trainer))
        return snapshots if trainer.world.rank == 0 else None
    finally:
        trainer.cleanup()


def failing_run(config_dict: dict, run_dir: str):
    """A run that raises at its first decision point (after the cache is up)."""
    from pipetransformer.config import config_from_dict
    from pipetransformer.trainer.trainer import Trainer

    trainer = Trainer(config_from_dict(config_dict), run_dir)
    try:
        trainer.setup()

        def fail(*args, **kwargs):
            raise RuntimeError("injected failure")

        trainer._decision_point = fail
        try:
            trainer.train()
        except RuntimeError as exc:
            return str(exc)
        return "no failure"
    finally:
        trainer.cleanup()


def checkpoint_killed_half_way(config_dict: dict, run_dir: str, step: int, options=None):
    """A run (resumed with `options`) whose rank 0 is SIGKILLed while it completes the
    checkpoint of `step`: every rank has written its tensors, run_state.json is not there."""
    import signal

    from pipetransformer.runs import checkpoint

    write = checkpoint.write_json_atomic

    def dying_write(path, payload):
        if env_rank() == 0 and str(path).endswith(f".tmp-step-{step:08d}/run_state.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, payload)

    checkpoint.write_json_atomic = dying_write
    return elastic_run(config_dict, run_dir, False, options)


def start_in_run_dir(run_dir: str, restarting_ranks: list[int], run_id: str):
    """start_run_directory as a torchrun restart in which only `restarting_ranks` were told
    so (TORCHELASTIC_RESTART_COUNT > 0): what each rank got, or the refusal's text."""
    from pathlib import Path

    from pipetransformer.autodp.control import Control
    from pipetransformer.runs.resume import start_run_directory
    from pipetransformer.runs.rundir import RunDirError, RunOptions

    world = init_distributed("cpu", 60)
    restart = world.rank in restarting_ranks
    options = RunOptions(restart=restart, overwrite=True, run_id=run_id)
    try:
        return start_run_directory(Path(run_dir), options, Control(torch.distributed.group.WORLD))
    except RunDirError as exc:
        return str(exc)
    finally:
        torch.distributed.destroy_process_group()


def _fresh_rendezvous(port_file, prepare=None) -> None:
    """A new process group after the previous one was destroyed: rank 0 runs `prepare` (if
    any), picks a free port and publishes it in `port_file`; every rank waits for it (a
    barrier without a process group) and points MASTER_PORT at it."""
    import time
    from pathlib import Path

    from pipetransformer.launcher import free_port

    path = Path(port_file)
    if env_rank() == 0:
        if prepare is not None:
            prepare()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(free_port()))
        tmp.rename(path)
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no port in {path}")
        time.sleep(0.01)
    os.environ["MASTER_PORT"] = path.read_text()


def _continue_from(run_dir, into, step: int) -> None:
    """A copy of `run_dir` as a run interrupted after its checkpoint at `step` leaves it."""
    import shutil

    from pipetransformer.runs.checkpoint import complete_checkpoints

    shutil.copytree(run_dir, into)
    for path in complete_checkpoints(into):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    (into / "checkpoints" / "latest").write_text(f"step-{step:08d}\n")


def elastic_runs(
    runs: list[tuple[str, dict]],
    root: str,
    resume_at_step: int | None = None,
    resume_names: set[str] | None = None,
    handoff_names: set[str] = frozenset(),
):
    """Whole Trainer runs one after the other in the same workers (one process start for
    all of them), each in a process group of its own, in ROOT/<name>: {name: elastic_run's
    result}. With `resume_at_step`, each run (of `resume_names`, if given) is then also
    continued from a copy of its directory cut back to that step's checkpoint, in
    ROOT/<name>-resumed ({name-resumed: result}). The runs of `handoff_names` record their
    state around each transition (elastic_run's `handoffs`)."""
    from pathlib import Path

    from pipetransformer.runs.rundir import RunOptions

    root = Path(root)
    results = {}
    for index, (name, config_dict) in enumerate(runs):
        if index:
            _fresh_rendezvous(root / f"port-{name}")
        results[name] = elastic_run(config_dict, str(root / name), handoffs=name in handoff_names)
        if resume_at_step is not None and (resume_names is None or name in resume_names):
            resumed = root / f"{name}-resumed"
            _fresh_rendezvous(
                root / f"port-{name}-resumed",
                lambda name=name, resumed=resumed: _continue_from(
                    root / name, resumed, resume_at_step
                ),
            )
            options = RunOptions(resume="required")
            results[f"{name}-resumed"] = elastic_run(config_dict, str(resumed), False, options)
    return results


def peer_run(name: str, config, run_dir) -> None:
    """One rank of a `compare --peers` peer that is not this trainer (compare/peers.py)."""
    from pipetransformer.compare.peers import run_peer

    run_peer(name, config, Path(run_dir))


def one_stage_against_gpipe(kind: str, micro_batches: int, batch_size: int):
    """One step of a one-stage layout on every rank (DDP over the ranks) through the
    runtime's OneStageSchedule, then the same step through PipelineStage + ScheduleGPipe
    around the same DDP module, as the runtime built it before: both gradients and losses,
    and the units' modes after the build (the profiler leaves units in eval mode)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from pipetransformer.pipe.runtime import _examples

    world = init_distributed("cpu", 60)
    model = build(kind)
    for unit in model.units:
        unit.eval()  # as pipe/measure.py leaves a unit it timed
    plan = balance(UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6), 0, 1)
    layout = Layout(plan, world.world_size, world.world_size, world.world_size)
    plan = layout.with_micro_batches(micro_batches).plan
    groups = build_training_groups(layout, world.rank, 60)
    units = dict(enumerate(model.units))
    share = batch_size // world.world_size
    runtime = build_stage_runtime(
        plan=plan,
        stage_index=0,
        replica_batch_size=share,
        units=units,
        spec=model.spec,
        loss_fn=ClassificationTask.loss_fn,
        schedule_name="gpipe",
        pipeline_group=groups.pipeline,
        data_group=groups.data,
        device=world.device,
    )
    modes = [unit.training for unit in model.units]
    inputs, labels = fixed_batch(kind, batch_size)
    window = slice(world.rank * share, (world.rank + 1) * share)
    target = ClassificationTask.make_target(
        labels[window], loss_weights([True] * share, world.world_size, batch_size)
    )
    inputs = [t[window] for t in inputs]

    def step(schedule) -> tuple[list[float], dict]:
        losses: list = []
        schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        grads = {}
        for index, unit in units.items():
            for name, p in unit_param_names(unit, index).items():
                grads[name] = p.grad.clone()
                p.grad = None
        return [float(loss) for loss in losses], grads

    one_stage = step(runtime.schedule())
    micro = share // micro_batches
    stage = PipelineStage(
        runtime.wrapped,
        0,
        1,
        world.device,
        input_args=_examples(model.spec.unit_input_specs(0), micro, world.device, False),
        output_args=_examples(
            model.spec.unit_output_specs(model.spec.num_units - 1), micro, world.device, True
        ),
        group=groups.pipeline,
    )
    gpipe = step(
        ScheduleGPipe(
            stage,
            n_microbatches=micro_batches,
            loss_fn=ClassificationTask.loss_fn,
            scale_grads=False,
        )
    )
    by_hand = zero_bubble_average(runtime, units, inputs, target, groups.data)
    torch.distributed.destroy_process_group()
    return {"modes": modes, "one_stage": one_stage, "gpipe": gpipe, **by_hand}


def zero_bubble_average(runtime, units, inputs, target, data_group) -> dict:
    """The same step on the units themselves (no DDP), its gradients averaged over the data
    group by zero bubble's GradientAllReduce, unclipped; then again with one trained
    parameter's gradient missing on rank 1 only (a replica that left it out)."""
    from pipetransformer.pipe.gradient_sync import GradientAllReduce

    params = [p for unit in units.values() for p in unit.parameters()]
    named = {name: p for i, unit in units.items() for name, p in unit_param_names(unit, i).items()}
    sync = GradientAllReduce(params, data_group)

    def local_step(drop: str | None) -> dict:
        runtime.module.train()
        for p in params:
            p.grad = None
        sync.prepare()  # the gradients as views of its buffer, as a zero-bubble step has them
        ClassificationTask.loss_fn(runtime.module(*inputs), target).backward()
        if drop is not None and torch.distributed.get_rank() == 1:
            named[drop].grad = None
        local = {name: p.grad.clone() for name, p in named.items() if p.grad is not None}
        sync()
        return local, {name: p.grad.clone() for name, p in named.items()}

    dropped = next(iter(named))
    _, averaged = local_step(None)
    local, averaged_missing = local_step(dropped)
    return {
        "gradient_all_reduce": averaged,
        "with_missing": (dropped, local, averaged_missing),
    }


def runs_under_load(runs: list[tuple[str, dict, float, int | None]], root: str):
    """Whole Trainer runs one after the other in the same workers, as `elastic_runs`, each
    (name, config, load_s, resume_at_step): with `load_s` > 0 the run reads a clock that
    stalls at every reading for a random time (exponential, mean `load_s`, the same draws
    on every attempt), as a machine that another job shares stretches whatever a run times
    by chance; with `resume_at_step` the run continues a copy of the first run cut back to
    that step's checkpoint. {name: elastic_run's result}."""
    import random
    import time
    from pathlib import Path

    from pipetransformer.runs.rundir import RunOptions

    root = Path(root)
    first = root / runs[0][0]
    results = {}
    real = time.perf_counter
    for index, (name, config_dict, load_s, resume_at_step) in enumerate(runs):
        into = root / name

        def prepare(into=into, step=resume_at_step):
            if step is not None:
                _continue_from(first, into, step)

        if index or resume_at_step is not None:
            _fresh_rendezvous(root / f"port-{name}", prepare)
        if load_s:
            draws, stalled = random.Random(env_rank()), [0.0]

            def loaded_clock(draws=draws, stalled=stalled, load_s=load_s) -> float:
                stalled[0] += draws.expovariate(1 / load_s)
                return real() + stalled[0]

            time.perf_counter = loaded_clock
        try:
            options = RunOptions(resume="required") if resume_at_step is not None else None
            results[name] = elastic_run(config_dict, str(into), False, options)
        finally:
            time.perf_counter = real
    return results


def freeze_signal_run(config_dict: dict, run_dir: str):
    """A whole Trainer run that also returns what the freeze rules read: the accumulated
    gradient signal the last decision saw, the frozen counts after each transition, this
    rank's copy of the embedding unit before and after training (None if it holds none),
    and the optimizer's parameter names."""
    from pipetransformer.config import config_from_dict
    from pipetransformer.trainer.trainer import Trainer

    def embedding(trainer):
        unit = trainer.stage.units.get(0)
        if unit is None:
            return None
        return {k: v.detach().clone() for k, v in unit.state_dict().items()}

    trainer = Trainer(config_from_dict(config_dict), run_dir)
    try:
        trainer.setup()
        before = embedding(trainer)
        optimizer = trainer.stage.optimizer
        held = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer else set()
        optimized = sorted(n for n, p in trainer.stage.named_params().items() if id(p) in held)
        trainer.train()
        return {
            "rank": trainer.world.rank,
            "sums": list(trainer.state.previous_layer_grad_sums),
            "frozen": [t.new_num_frozen_layers for t in trainer.transitions],
            "embedding_before": before,
            "embedding_after": embedding(trainer),
            "trainable_at_start": optimized,
        }
    finally:
        trainer.cleanup()


def logged_run(config_dict: dict, run_dir: str) -> dict:
    """elastic_run with the CLI's logging, each rank's log also in RUN_DIR/rank<r>.log (the
    workers' stderr, which is not a terminal)."""
    import logging

    from pipetransformer.utils.logging import setup_logging

    rank = os.environ["RANK"]
    setup_logging(rank=rank)
    handler = logging.FileHandler(Path(run_dir) / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.getLogger("pipetransformer").addHandler(handler)
    try:
        return elastic_run(config_dict, run_dir)["summary"]
    finally:
        handler.close()


def compiled_run(config_dict: dict, run_dir: str, frozen_after: int, steps: int) -> dict:
    """The trainer's own steps (`steps` before a transition to `frozen_after` frozen layers,
    `steps` after it, and `steps` more), each step's replica loss, and the graphs compiled
    per unit class (models/compiled.py `COMPILES`) at the end of each phase."""
    from pipetransformer.config import config_from_dict
    from pipetransformer.models.compiled import COMPILES
    from pipetransformer.trainer.trainer import Trainer

    trainer = Trainer(config_from_dict(config_dict), run_dir)
    losses, compiles = [], []
    try:
        trainer.setup()
        ticks = trainer.clock.ticks()
        for phase in range(3):
            if phase == 1:
                trainer.transition(frozen_after)
            for _ in range(steps):
                tick = next(ticks)
                result = trainer.steps.run(tick, trainer.stage)
                trainer.metrics.record(tick, result)
                loss = result.replica_loss  # None on a stage that is not the last
                losses.append(None if loss is None else float(loss))
            compiles.append(dict(COMPILES))
        return {
            "losses": losses,
            "compiles": compiles,
            "layout": trainer.stage.layout.describe(),
            "unit_classes": [type(u).__name__ for _, u in sorted(trainer.stage.units.items())],
        }
    finally:
        trainer.cleanup()


def warmed_run(config_dict: dict, run_dir: str, frozen_after: int, steps: int) -> dict:
    """The trainer compiled (pipe/warmup.py): the graphs per unit class (`COMPILES`) after
    setup, after `steps` steps and an evaluation, after a transition to `frozen_after`
    frozen layers, and after `steps` more and an evaluation; and the transition's record."""
    from pipetransformer.config import config_from_dict
    from pipetransformer.models.compiled import COMPILES
    from pipetransformer.trainer.trainer import Trainer

    trainer = Trainer(config_from_dict(config_dict), run_dir)
    compiles, losses = [], []
    try:
        trainer.setup()
        compiles.append(dict(COMPILES))
        ticks = trainer.clock.ticks()
        record = None
        for phase in range(2):
            if phase == 1:
                record = trainer.transition(frozen_after)
                compiles.append(dict(COMPILES))
            for _ in range(steps):
                result = trainer.steps.run(next(ticks), trainer.stage)
                losses.append(None if result.replica_loss is None else float(result.replica_loss))
            trainer.evaluator.evaluate(trainer.stage)
            compiles.append(dict(COMPILES))
        return {"compiles": compiles, "transition": record.to_dict(), "losses": losses}
    finally:
        trainer.cleanup()


def warm_up_with_a_limit() -> str | None:
    """Rank 1 of 2 warms a DDP layout's compiled units with a limit of one graph a unit
    class (trainer/runtime.py `warm_up_layout`); what each rank raises (None: nothing)."""
    import torch.distributed as dist
    from helpers import ROOT

    from pipetransformer.autodp.control import Control
    from pipetransformer.config import load_config
    from pipetransformer.models.compiled import compile_units
    from pipetransformer.trainer.distributed import init_distributed
    from pipetransformer.trainer.runtime import CompileFailed, warm_up_layout

    world = init_distributed("cpu", 60)
    overrides = ["trainer.compile=true", "trainer.compile_backend=eager"]
    config = load_config(ROOT / "configs" / "quickstart.yaml", overrides)
    model = tiny_vit()
    plan = balance(UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6), 0, 1)
    layout = Layout(plan, 2, 2, 2).with_micro_batches(2)
    units = dict(enumerate(model.units))
    compile_units(units.values(), "eager")
    if world.rank == 1:
        torch._dynamo.config.recompile_limit = 1
    try:
        warm_up_layout(layout, world, config, units, model.spec, Control(dist.group.WORLD), False)
        return None
    except CompileFailed as failed:
        return str(failed)
    finally:
        dist.destroy_process_group()


def slow_evaluation_runs(config_dict: dict, root: str, sleep_s: float, resume_at_step: int):
    """A whole Trainer run whose every evaluation and every checkpoint write takes `sleep_s`
    more (a slow eval set, a slow disk), then the same run resumed from a copy cut back to
    its checkpoint at `resume_at_step`. Returns rank 0's seconds around each `train()` and
    the summaries: {name: (train_s, summary dict)}."""
    import time

    from pipetransformer.runs.checkpoint import Checkpointer
    from pipetransformer.runs.rundir import RunOptions
    from pipetransformer.trainer.evaluation import Evaluator

    evaluate, prune = Evaluator._evaluate, Checkpointer._prune

    def slow_evaluate(self, *args, **kwargs):
        time.sleep(sleep_s)
        return evaluate(self, *args, **kwargs)

    def slow_prune(self, *args, **kwargs):  # rank 0, inside a save's timing; the rest wait
        time.sleep(sleep_s)
        return prune(self, *args, **kwargs)

    from pipetransformer.config import config_from_dict
    from pipetransformer.trainer.trainer import Trainer

    def timed(run_dir: Path, options=None):
        trainer = Trainer(config_from_dict(config_dict), run_dir, options)
        try:
            trainer.setup()
            started = time.perf_counter()
            summary = trainer.train()
            return time.perf_counter() - started, summary.to_dict()
        finally:
            trainer.cleanup()

    root = Path(root)
    Evaluator._evaluate, Checkpointer._prune = slow_evaluate, slow_prune
    try:
        results = {"run": timed(root / "run")}
        _fresh_rendezvous(
            root / "port-resumed",
            lambda: _continue_from(root / "run", root / "resumed", resume_at_step),
        )
        results["resumed"] = timed(root / "resumed", RunOptions(resume="required"))
    finally:
        Evaluator._evaluate, Checkpointer._prune = evaluate, prune
    return results
