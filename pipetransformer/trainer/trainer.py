"""The trainer: the one place that coordinates. Set-up, the step loop and transitions.

Every rank runs this. Ranks agree on everything by computing it from the same values (the
resolved config, the sampler, all-reduced gradient norms); the only messages are the
pipeline's own, DDP's, the control group's small collectives (autodp/control.py), the state
handoff at transitions and checkpoint writes.

`train()` is the loop: one tick of the clock per step; after it each periodic component
says whether it acts now (`due(tick)`): the step log, evaluation (off the training clock),
a freeze decision, a checkpoint; and every rank agrees on whether a stop signal arrived. At a
decision point: freeze decides F (pure) -> AutoPipe plans the layout (planning/, pure) ->
AutoDP moves units and optimizer state, rebuilds the groups -> the stage is rebuilt.
Everything that must survive a crash is `self.state` (a RunState) and the statefuls of
runs/state.py and trainer/statefuls.py, which the checkpointer saves and loads the same way.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.groups import (
    TrainingGroups,
    build_training_groups,
    check_layouts_agree,
    create_control_group,
)
from pipetransformer.autodp.handoff import plan_transfers
from pipetransformer.autodp.topology import Layout
from pipetransformer.config import Config, random_embedding_warning, resolve, resolve_padding
from pipetransformer.data import build_data
from pipetransformer.data.describe import describe_bundle
from pipetransformer.fsdp import shard_optimizer_states
from pipetransformer.models import build_model
from pipetransformer.models.compiled import compile_units
from pipetransformer.models.packed import packed_refusal
from pipetransformer.pipe import StageRuntime
from pipetransformer.pipe.prefix import CachedPrefix
from pipetransformer.pipe.timing import IntervalTimer
from pipetransformer.planning import (
    format_bytes,
)
from pipetransformer.planning.run_model import prefix_cost_to_balance
from pipetransformer.runs.checkpoint import PROFILES, Checkpointer
from pipetransformer.runs.records import (
    CheckpointEvent,
    EvalResult,
    ProfileEvent,
    RunSummary,
    StartEvent,
    TransitionEvent,
)
from pipetransformer.runs.reporting import Reporter
from pipetransformer.runs.resume import Resumption, start_run_directory, write_resolved_config
from pipetransformer.runs.rundir import RunOptions
from pipetransformer.runs.state import (
    CheckpointRecord,
    ModelRecord,
    RunRecordState,
    RunState,
    Stateful,
)
from pipetransformer.tasks import task_for
from pipetransformer.trainer import optim
from pipetransformer.trainer.caching import RunCache
from pipetransformer.trainer.clock import StepClock, Tick, TrainingClock
from pipetransformer.trainer.distributed import WorldInfo, init_distributed, peak_memory
from pipetransformer.trainer.evaluation import Evaluator
from pipetransformer.trainer.freezing import FreezeControl
from pipetransformer.trainer.metrics import MetricsTracker
from pipetransformer.trainer.run_plan import measured_micro_batches, plan_run
from pipetransformer.trainer.runtime import build_runtime, warm_up_layout
from pipetransformer.trainer.statefuls import checkpoint_statefuls, seed_streams
from pipetransformer.trainer.step import (
    Batches,
    Stage,
    StepRunner,
    padded_length_share,
    train_sampler,
)
from pipetransformer.trainer.stop_poll import StopPoll
from pipetransformer.trainer.summary import run_summary, start_event
from pipetransformer.trainer.transition import hand_over, transition_event
from pipetransformer.utils.stopping import RunStopped, StopRequest

logger = logging.getLogger(__name__)


class Trainer:
    """setup() -> train() -> cleanup(); see the module docstring."""

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        options: RunOptions | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        self.config = config  # setup replaces it by the resolved config (planning/context.py)
        self.run_dir = Path(run_dir)
        self.options = options or RunOptions()
        self.stop = stop or StopRequest()
        self.world: WorldInfo | None = None
        self.control: Control | None = None
        self.reporter: Reporter | None = None
        self.cache: RunCache | None = None
        self.stage: Stage | None = None
        self.state = RunState()
        self.transitions: list[TransitionEvent] = []
        self._pending_events: list = []  # made before the reporter exists
        self.counts_that_pay: list[int] | None = None  # freeze.memory_aware, at the start

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Named steps, each done by the room that owns it; the order is the dependencies'."""
        resumption = self._join()  # processes, control group, run directory, checkpointer
        full = self._build_model(resumption)  # data, task, skeleton; the run state resumed
        self._plan(full, resumption)  # profiles -> PlanContext: the resolved config
        self._build_components(fresh=resumption is None)  # reporter, clock, metrics, ...
        layout, units = self._first_layout(full)
        del full  # the units this rank does not hold go before the first stage is built
        profile_s = self._enter_first_layout(layout, units, resumption)
        self._report_setup(resumption, profile_s)
        # Last, so nothing in setup draws from the streams a checkpoint restored.
        restored = None if resumption is None else resumption.world_size == self.world.world_size
        seed_streams(self.config.trainer.seed, self.world.rank, self.state.global_step, restored)

    def _join(self) -> Resumption | None:
        """Join the processes; decide once (rank 0 or the launcher) for all ranks whether
        this run resumes, and load the record of the checkpoint it resumes from."""
        trainer_config = self.config.trainer
        self.world = world = init_distributed(
            trainer_config.device, trainer_config.timeout_s, trainer_config.tf32
        )
        self.control = control = Control(create_control_group(trainer_config.timeout_s))
        world.note_processes_per_node(trainer_config.nproc_per_node)
        # Every node writes where rank 0 does.
        self.run_dir = Path(control.broadcast(str(self.run_dir)))
        resumption = start_run_directory(self.run_dir, self.options, control)
        # The launcher's processes; K may be 'auto' yet (the plan resolves it).
        self.config = config = resolve(self.config, world.shape)
        self.checkpointer = Checkpointer(
            config.checkpoint, self.run_dir, control, config.trainer.save_model
        )
        if resumption is not None:
            run = RunRecordState()
            self.checkpointer.load(resumption.checkpoint, {"run": run})
            resumption.record = run.record
        return resumption

    def _build_model(self, resumption: Resumption | None) -> nn.Module:
        """The data, the task, the model's skeleton on the meta device (every unit's structure
        without weights: what a rank receives at a transition is materialised from it) and
        the full model, initialised alike on every rank."""
        config = self.config
        self.data = build_data(
            config.data,
            seed=config.trainer.seed,
            model_name_or_path=config.model.model_name_or_path,
        )
        self.task = task_for(
            self.data.task, self.data.num_classes, config.data.metric, len(self.data.eval)
        )
        self.model_args = self.data.model_args()
        self.skeleton = build_model(config.model, device="meta", **self.model_args)
        self.spec = self.skeleton.spec
        # Packed text needs units that run it under the model's attention (models/packed.py).
        self.config, padding_note = resolve_padding(config, packed_refusal(self.skeleton))
        config = self.config
        if self.world.rank == 0:  # what it read: before an epoch shows a wrong column
            note = f"; {padding_note}" if padding_note else ""
            logger.info("data: %s%s", describe_bundle(self.data), note)
            if (warning := random_embedding_warning(config)) is not None:
                logger.warning(warning)
        if resumption is not None:
            self.state = resumption.state(self.spec)
        # Same seed on every rank: the full model is initialised identically everywhere
        # (and equals single-process training); each rank then keeps only its own units.
        torch.manual_seed(config.trainer.seed)
        return build_model(config.model, device="cpu", **self.model_args)

    def _plan(self, full: nn.Module, resumption: Resumption | None) -> None:
        """The run's plan (trainer/run_plan.py) and with it the resolved config, said where
        a resume changes it and written to the run directory."""
        configured = self.config
        carried = resumption.checkpoint / PROFILES if resumption is not None else None
        run_plan = plan_run(
            configured,
            self.spec,
            list(full.units),
            self.world,
            self.control,
            self.run_dir,
            self.state,
            carried,
        )
        self.plan, self.profiler = run_plan.plan, run_plan.profiler
        self.measured_costs = run_plan.measured_costs
        self.profile_micro_batch_size = run_plan.profile_micro_batch_size
        self.config = self.plan.config
        if self.config.pipeline.initial_pipe_len != configured.pipeline.initial_pipe_len:
            logger.info(
                "initial_pipe_len auto: %d (device memory %s)",
                self.plan.initial_pipe_len,
                "unlimited" if run_plan.budget is None else format_bytes(run_plan.budget),
            )
        if resumption is not None:
            change = resumption.config_change(self.config, speak=self.world.rank == 0)
            if change is not None:
                self._pending_events.append(change)  # reported once the reporter exists
        if self.world.rank == 0:  # the resolved config says where the run started
            write_resolved_config(self.run_dir, self.config)

    def _build_components(self, fresh: bool) -> None:
        """The components the loop asks `due(tick)`, and what they share."""
        config, world, control, spec = self.config, self.world, self.control, self.spec
        self.reporter = Reporter(
            self.run_dir,
            world.rank == 0,
            config.trainer.progress_bar,
            config.logging.tensorboard,
            config.logging.wandb,
            config.to_dict(),
            progress_interval_s=config.trainer.progress_interval_s,
        )
        # One stage, every process a replica: no count of frozen layers changes it, so
        # freeze.memory_aware freezes none there (freezing.py `idle`).
        final = 1 == self.state.resume_pipe_len(
            self.plan.initial_pipe_len, world.world_size, world.devices_per_node
        )
        self.sampler = train_sampler(config, self.data.train, world.num_nodes)
        # Replicas a node has at the start (R = W / K0 with or without AutoDP).
        start_replicas = world.devices_per_node // self.plan.initial_pipe_len
        steps = self.sampler.steps_per_epoch_at(start_replicas)
        # What recomputing the frozen prefix costs at the lengths the starting layout runs
        # its batches at, a pipeline's buckets included (caching.py).
        self.length_share = padded_length_share(
            config, self.data.train, self.sampler, start_replicas, self.plan.initial_pipe_len
        )
        self.clock = StepClock(self.state, self.sampler, config.trainer.epochs, start_replicas)
        self.training_clock = TrainingClock(self.state)  # evaluation, checkpoints off it
        self.metrics = MetricsTracker(
            control=control,
            reporter=self.reporter,
            num_layers=spec.num_layers,
            num_units=spec.num_units,
            num_train_samples=len(self.data.train),
            num_train_tokens=sum(self.data.train.lengths or ()),
            device=world.device,
            log_interval_steps=config.trainer.log_interval_steps,
            carried=self.state,
        )
        self.freezer = FreezeControl(
            config, spec.num_layers, steps, self.state, self.metrics, control, self.clock, final
        )
        if world.rank == 0 and fresh:
            self.freezer.warn_if_nothing_can_freeze()
        # The cache serves frozen layers: with none ever frozen (the baseline, or an idle
        # memory-aware run that has frozen none) it stays off.
        idle = self.freezer.idle and not self.state.num_frozen_layers
        if config.cache.enabled and config.freeze.strategy != "none" and not idle:
            self.cache = RunCache(
                config,
                spec,
                self.data,
                world,
                control,
                read_s_per_sample=self.state.cache_read_s_per_sample,
            )
            self.state.cache_read_s_per_sample = self.cache.read_s_per_sample
        self.batches = Batches(
            config, self.data, self.sampler, self.task, world, self.run_dir, self.cache
        )
        self.steps = StepRunner(
            config,
            self.batches,
            world,
            spec.num_units,
            self.freezer.needs_grad_norms,
            self.freezer.needs_grad_sums,
            self.freezer.layer_rates,
        )
        # All ranks stop after the same step; agreed about every second, not every step.
        self.stop_poll = StopPoll(control, self.stop, config.trainer.log_interval_steps)
        self.evaluator = Evaluator(
            config, self.data, self.task, world, control, self.cache, self.state
        )

    def _first_layout(self, full: nn.Module) -> tuple[Layout, dict[int, nn.Module]]:
        """The first layout (a resume's boundary, its pipeline where the world is the same)
        and the units this rank holds in it, on its device."""
        state, world = self.state, self.world
        pipe_len = state.resume_pipe_len(
            self.plan.initial_pipe_len, world.world_size, world.devices_per_node
        )
        layout = self.layout_for(state.num_frozen_layers, pipe_len)
        return layout, {u: full.units[u].to(world.device) for u in layout.units_of_rank(world.rank)}

    def _enter_first_layout(
        self, layout: Layout, units: dict[int, nn.Module], resumption: Resumption | None
    ) -> float:
        """This rank's first stage, a resume's tensors loaded into it (collective). Returns
        the profiling seconds it took over (unit costs, micro-batches)."""
        times: dict[str, float] = {}
        self.stage = self._enter(layout, units, {}, times)
        if "compile_s" in times and self.world.rank == 0:
            logger.info("compiled the first layout's units in %.1f s", times["compile_s"])
        if resumption is not None:
            started = time.perf_counter()
            same_world = resumption.world_size == self.world.world_size
            self.checkpointer.load(resumption.checkpoint, self._statefuls(rng=same_world))
            resumption.load_s = time.perf_counter() - started
        return times["profile_s"]

    def _report_setup(self, resumption: Resumption | None, profiled_s: float) -> None:
        """What setup measured and decided, as events: the profiling's seconds (unit costs
        and micro-batches), the resume, and the events made before the reporter existed."""
        profile_s = profiled_s + self.profiler.take_seconds()
        if profile_s > 0:
            self.reporter.event(
                ProfileEvent(self.state.global_step, profile_s, self.plan.costs.source)
            )
        if resumption is not None:
            self.reporter.event(resumption.event(self.stage.layout, self.world))
        for event in self._pending_events:
            self.reporter.event(event)
        self._pending_events.clear()
        logger.info(
            "initial layout: %s (stage costs from %s)",
            self.stage.layout.describe(),
            self.plan.costs.source,
        )
        self.counts_that_pay = self.freezer.counts_that_pay(self.stage.layout, self._pays)

    def cache_serves(self, num_frozen_layers: int) -> bool:
        """Whether AutoCache serves the frozen prefix at this boundary (same on every rank)."""
        if self.cache is None or not self.config.autopipe.enabled:
            return False  # without AutoPipe frozen layers stay inside stages: nothing to serve
        return self.cache.profitable(
            num_frozen_layers,
            self.measured_costs,
            self.profile_micro_batch_size,
            self.length_share,
        )

    def layout_for(
        self, num_frozen_layers: int, current_pipe_len: int, moving_from: Layout | None = None
    ) -> Layout:
        prefix_cost = None  # parameter counts: the frozen prefix at lambda_frozen of its size
        if self.plan.costs.source == "time" and self.cache is not None:
            # Measured seconds of the work the coming steps do there: the prefix's forward,
            # filling or upgrading cache entries, or reading them (planning/run_model.py).
            prefix_cost = prefix_cost_to_balance(
                self.measured_costs.frozen,
                self.cache.prefix_cost(self.profile_micro_batch_size),
                num_frozen_layers,
                self.clock.cached.at_start,
                self.cache_serves(num_frozen_layers),
            )
        return self.plan.layout_for(
            num_frozen_layers, current_pipe_len, prefix_cost=prefix_cost, moving_from=moving_from
        )

    # ------------------------------------------------------------------ the stage of a layout

    def _enter(
        self,
        layout: Layout,
        units: dict[int, nn.Module],
        optimizer_states: dict[str, dict],
        times: dict[str, float] | None = None,
    ) -> Stage:
        """This rank's stage of `layout`: training groups, frozen units, the micro-batch count
        (measured for 'auto'), the optimizer over the active parameters with their carried
        state, and the runtime. Collective. `times`: filled with the phases' seconds."""
        times = {} if times is None else times
        check_layouts_agree(self.control, layout)  # a mismatch would hang in new_group
        # The batch may change with the layout, and what the cache serves with the boundary.
        frozen = layout.plan.num_frozen_layers
        self.clock.use_layout(
            layout.replicas_per_node, frozen if self.cache_serves(frozen) else None
        )
        started = time.perf_counter()
        groups = build_training_groups(layout, self.world.rank, self.config.trainer.timeout_s)
        times["groups_s"] = times.get("groups_s", 0.0) + time.perf_counter() - started
        frozen_end = layout.plan.frozen_end
        for index, unit in units.items():  # below the boundary: no grad, no stale grads
            if index < frozen_end:
                unit.requires_grad_(False)
                for p in unit.parameters():
                    p.grad = None
        if self.config.trainer.compile:  # units not compiled yet: those that arrived
            compile_units(units.values(), self.config.trainer.compile_backend, self.spec.text)
            times["compile_s"] = warm_up_layout(  # every graph, before any step (collective)
                layout,
                self.world,
                self.config,
                units,
                self.spec,
                self.control,
                one_sample=self.cache_serves(frozen),
            )
        trial = self._trial_step(units, groups)
        layout = measured_micro_batches(layout, self.config, self.profiler, trial)
        times["profile_s"] = self.profiler.take_seconds()
        started = time.perf_counter()
        runtime = self._runtime(layout, units, groups, comm_timer=self.metrics.comm_timer)
        stage = Stage(layout, groups, units, None, runtime, False)
        named = stage.named_params()
        if layout.sharded:  # the carried state, cut like the parameters it belongs to
            optimizer_states = shard_optimizer_states(optimizer_states, named)
        layers = self.freezer.anneal_layers  # a group per layer under layer-wise annealing
        stage.optimizer = optim.build_optimizer(self.config.optimizer, named, layers)
        optim.load_states_by_name(stage.optimizer, named, optimizer_states)
        frozen = layout.plan.num_frozen_layers
        stage.cache_active = self.cache_serves(frozen)
        if stage.cache_active and stage.runtime is not None and stage.runtime.is_first:
            stage.runtime.cached_prefix = CachedPrefix(
                units,
                frozen,
                self.cache.client,
                self.world.device,
                self.cache.counts,
                load_inputs=self.batches.device_inputs,
            )
        self.state.enter_layout(layout, self.world.world_size, self.world.devices_per_node)
        self.control.barrier()
        times["rebuild_s"] = time.perf_counter() - started
        return stage

    def _runtime(
        self,
        layout: Layout,
        units: dict[int, nn.Module],
        groups: TrainingGroups,
        comm_timer: IntervalTimer | None = None,
    ) -> StageRuntime | None:
        return build_runtime(
            layout, self.world, self.config, units, groups, self.spec, self.task.loss_fn, comm_timer
        )

    def _trial_step(self, units: dict[int, nn.Module], groups: TrainingGroups):
        """A step of a trial layout to time (run_plan.py `measured_micro_batches`) where the
        run continues (the last step for a finished run), leaving no gradients behind."""
        epoch = min(self.state.epoch, self.config.trainer.epochs - 1)
        step = min(self.state.step_in_epoch, self.sampler.steps_per_epoch - 1)

        def step_of(trial: Layout) -> Callable[[], None]:
            runtime = self._runtime(trial, units, groups)
            if runtime is None:
                return lambda: None
            data = self.batches.step_data(trial, epoch, step)

            def run() -> None:
                runtime.train_step(data.inputs, data.target, seq_length=data.seq_length)
                for p in runtime.module.parameters():
                    p.grad = None

            return run

        return step_of

    # ------------------------------------------------------------------ training

    def train(self) -> RunSummary:
        """Train to the last epoch (from wherever the state says the run is). Raises
        RunStopped after writing a checkpoint when a stop signal arrives."""
        self.training_clock.start()
        start = self._start_event()
        if start.decided_by_measured_time and self.control.rank == 0:
            logger.info(
                "%s: measured (opt-in), decided from times this run measures, so a busier "
                "machine may decide otherwise; 'auto' decides from the config alone",
                ", ".join(start.decided_by_measured_time),
            )
        self.reporter.event(start)
        for tick in self.clock.ticks():
            self.metrics.record(tick, self.steps.run(tick, self.stage))
            if self.metrics.due(tick):
                self.metrics.log_steps(tick, self.stage.layout, *self.steps.learning_rates(tick))
            evaluation = self._evaluate(tick)
            if self.freezer.due(tick):
                self._decision_point(tick)
            stop = self.stop_poll.poll(tick) if self.stop_poll.due(tick) else 0
            if stop or self.checkpointer.due(tick):
                reason = (
                    signal.Signals(stop).name if stop else "epoch" if tick.epoch_end else "steps"
                )
                self.save_checkpoint(tick, reason, evaluation.eval_metric if evaluation else None)
            if stop:
                state = self.state
                raise RunStopped(
                    stop,
                    state.global_step,
                    state.epoch,
                    state.step_in_epoch,
                    str(self.checkpointer.last_path),
                )
        return self._finish()

    def _evaluate(self, tick: Tick) -> EvalResult | None:
        """Evaluation when due, off the training clock, and at an epoch's end the epoch's
        metrics line (collective)."""
        evaluation, eval_s = None, 0.0
        if self.evaluator.due(tick):
            evaluation, eval_s, record = self.evaluator.evaluate_at(
                tick, self.stage, self.training_clock
            )
            self.reporter.evaluation(record)
        if not tick.epoch_end:
            self.metrics.add_evaluation(eval_s)
            return evaluation
        self.metrics.end_epoch(
            tick,
            self.stage.layout,
            lr=self.steps.learning_rate(tick),
            evaluation=evaluation,
            eval_s=eval_s,
            cache=self.cache.epoch_counters() if self.cache is not None else None,
            cache_active=self.stage.cache_active,
        )
        return evaluation

    def _decision_point(self, tick: Tick) -> None:
        layout = self.stage.layout
        momentum = self.freezer.momentum(self.stage, self.spec.num_units, self.world.device)
        sums = (
            self.steps.unit_grad_sums(self.stage, self.control)
            if self.freezer.needs_grad_sums
            else None
        )
        decision = self.freezer.decide(
            layout.plan.num_frozen_layers, layout.dp_degree, momentum, sums, self._pays(layout)
        )
        self.reporter.event(
            decision.event(layout.plan.num_frozen_layers, self.state.decision_index, tick)
        )
        # A new boundary, or the same one balanced again now that the cache holds what its
        # stage 0 was balanced to fill (the new plan is the same on every rank).
        new = self.layout_for(decision.num_frozen_layers, layout.pipe_len, layout)
        replanned = new.plan
        if (replanned.num_frozen_layers, replanned.stage_ranges, new.sharded) != (
            layout.plan.num_frozen_layers,
            layout.plan.stage_ranges,
            layout.sharded,
        ):
            record = self.transition(decision.num_frozen_layers, decision.layer_grad_norms, tick)
            cadence = self.freezer.space(  # less its one-off measuring and compiling
                record.total_s - record.profile_s - record.compile_s,
                decision.step_s,
                tick.global_step,
            )
            if cadence is not None:
                self.reporter.event(cadence)

    def _pays(self, layout: Layout) -> Callable[[int], bool]:
        """Whether freezing that many layers moves the run out of `layout` into fewer stages
        or more replicas (freeze.memory_aware); planned, not measured: the same on every rank."""

        def pays(num_frozen_layers: int) -> bool:
            new = self.layout_for(num_frozen_layers, layout.pipe_len, layout)
            return new.pipe_len < layout.pipe_len or new.dp_degree > layout.dp_degree

        return pays

    # ------------------------------------------------------------------ transitions

    def transition(
        self,
        num_frozen_layers: int,
        grad_norms: list[float] | None = None,
        tick: Tick | None = None,
    ) -> TransitionEvent:
        """Move to the layout for `num_frozen_layers` after the step of `tick` (default: the
        newest). Collective: every rank, same order."""
        rank, old = self.world.rank, self.stage
        times = {}
        started = time.perf_counter()
        new = self.layout_for(num_frozen_layers, old.layout.pipe_len, moving_from=old.layout)
        transfers = plan_transfers(old.layout, new)
        move_bytes = self.plan.move_bytes(old.layout, new, transfers)
        times["plan_s"] = time.perf_counter() - started

        started = time.perf_counter()
        skeletons = {u: self.skeleton.units[u] for u in range(self.spec.num_units)}
        handover = hand_over(old, new, transfers, skeletons, rank, self.control, self.world.device)
        times["state_move_s"] = time.perf_counter() - started

        started = time.perf_counter()
        self.batches.restart()  # the data split changes with the layout
        old.groups.destroy()
        self.stage = None
        times["groups_s"] = time.perf_counter() - started
        self.stage = self._enter(new, handover.units, handover.states, times)
        record = transition_event(
            old.layout,
            self.stage.layout,
            tick or self.clock.last,
            self.state.global_step,
            len(transfers),
            move_bytes,
            grad_norms,
            times,
            handover.release_s,
        )
        self.state.num_transitions += 1
        self.metrics.add_transition(record.total_s)
        self.transitions.append(record)
        self.reporter.event(record)
        logger.info("transition: %s (%.3f s)", self.stage.layout.describe(), record.total_s)
        return record

    # ------------------------------------------------------------------ checkpoints

    def _statefuls(
        self, record: CheckpointRecord | None = None, rng: bool = True
    ) -> dict[str, Stateful]:
        return checkpoint_statefuls(self.stage, self.world, record, rng)

    def save_checkpoint(self, tick: Tick, reason: str, eval_metric: float | None = None) -> None:
        """A checkpoint of the run as it stands after the step of `tick` (collective)."""
        state = self.metrics.snapshot(self.state, self.stage.layout.dp_degree)
        model = ModelRecord(
            list(self.spec.unit_names), list(self.spec.unit_param_counts), self.model_args
        )
        record = CheckpointRecord(state, self.config.to_dict(), model, time.time())
        saved = self.checkpointer.save(
            state.global_step,
            self._statefuls(record),
            reason,
            eval_metric,
            lambda directory: self.profiler.store.save_copy(directory / PROFILES),
        )
        self.reporter.event(
            CheckpointEvent(
                state.global_step,
                tick.completed_epochs,
                str(saved.path),
                reason,
                saved.write_s,
                saved.bytes,
                eval_metric,
            )
        )
        self.metrics.exclude(saved.write_s)  # writing a checkpoint is not training time
        self.training_clock.exclude_checkpoint(saved.write_s)

    # ------------------------------------------------------------------ records

    def _finish(self) -> RunSummary:
        last = self.checkpointer.last_path
        summary = run_summary(
            self.state,
            self.stage.layout,
            self.world,
            self.training_clock,
            peak_memory(self.control, self.world.device),
            metric_name=self.task.metric_name,
            final_scores=self.evaluator.last_scores,
            epochs=self.config.trainer.epochs,
            checkpoint=str(last) if last else None,
            decision_interval_steps=self.freezer.schedule.interval_steps,
            num_layers=self.spec.num_layers,
            freeze_strategy=self.config.freeze.strategy,
            freeze_idle=self.freezer.idle,
        )
        self.reporter.summary(summary)
        return summary

    def _start_event(self) -> StartEvent:
        daemons = self.cache.daemons if self.cache is not None else []
        return start_event(
            self.state, self.world, self.stage.layout, self.plan, daemons, self.counts_that_pay
        )

    # ------------------------------------------------------------------ teardown

    def cleanup(self) -> None:
        for loading in (getattr(self, "batches", None), getattr(self, "evaluator", None)):
            if loading is not None:
                loading.close()
        if self.stage is not None:
            self.stage.runtime = None
            self.stage.groups.destroy()
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.reporter is not None:
            self.reporter.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
