"""The trainer: the one place that coordinates. Step loop, evaluation, metrics, transitions,
checkpoints.

Every rank runs this. Ranks agree on everything by computing it from the same values (the
config, the sampler, all-reduced gradient norms); the only messages are the pipeline's
own, DDP's, small all-reduces on the control group, the state handoff at transitions and
checkpoint writes.

`train()` reads top to bottom: after every step each component says whether it acts now
(evaluation and metrics at an epoch's end, a freeze decision, a checkpoint, a stop).
At a decision point: freeze decides F (pure) -> AutoPipe plans the layout (pure) -> AutoDP
moves units and optimizer state, rebuilds the groups -> the stage runtime is rebuilt.
Everything that must survive a crash is `self.state` (a RunState) plus the units' weights
and optimizer state, which a checkpoint writes by parameter name.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.autodp.groups import (
    TrainingGroups,
    build_training_groups,
    create_control_group,
)
from pipetransformer.autodp.handoff import execute_transfers, plan_transfers
from pipetransformer.autodp.sampler import EvalSampler, TrainSampler
from pipetransformer.autodp.topology import Layout
from pipetransformer.autopipe.profiles import unit_costs_from_profile
from pipetransformer.config import Config, check_config, config_yaml
from pipetransformer.data import build_data, iterate_batches
from pipetransformer.freeze import (
    DecisionSchedule,
    FreezeDecider,
    check_freeze_config,
    min_interval_for,
)
from pipetransformer.models import build_model, unit_param_names
from pipetransformer.pipe import StageRuntime, build_stage_runtime
from pipetransformer.pipe.prefix import CachedPrefix
from pipetransformer.trainer import optim
from pipetransformer.trainer.caching import RunCache
from pipetransformer.trainer.checkpoint import (
    PROFILES,
    Checkpointer,
    model_key,
    optimizer_key,
    rng_key,
)
from pipetransformer.trainer.distributed import WorldInfo, init_distributed
from pipetransformer.trainer.planning import (
    build_planner,
    layout_for,
    planner_costs,
    profiling_micro_batch_size,
    with_micro_batches,
)
from pipetransformer.trainer.profiling import RunProfiler
from pipetransformer.trainer.records import (
    CheckpointEvent,
    EpochMetrics,
    ProfileEvent,
    StartEvent,
    StepMetrics,
    TransitionEvent,
)
from pipetransformer.trainer.reporting import Reporter
from pipetransformer.trainer.resume import load_checkpoint_tensors, start_run_directory
from pipetransformer.trainer.rundir import RunOptions
from pipetransformer.trainer.sizing import (
    choose_initial_pipe_len,
    device_memory_budget,
    format_bytes,
    memory_model,
    plan_fits,
    stage_bytes,
)
from pipetransformer.trainer.state import RunState, reseed, rng_state, set_rng_state
from pipetransformer.trainer.tasks import loss_weights, task_for
from pipetransformer.utils.files import append_jsonl, write_text_atomic
from pipetransformer.utils.stopping import RunStopped, StopRequest
from pipetransformer.utils.units import layer_of_unit, param_key

logger = logging.getLogger(__name__)


class Trainer:
    """setup() -> train() -> cleanup(); see the module docstring."""

    def __init__(
        self, config: Config, run_dir: str | Path, options: RunOptions | None = None, stop: StopRequest | None = None
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.options = options or RunOptions()
        self.stop = stop or StopRequest()
        self.world: WorldInfo | None = None
        self.units: dict[int, nn.Module] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.runtime: StageRuntime | None = None
        self.groups: TrainingGroups | None = None
        self.layout: Layout | None = None
        self.state = RunState()
        self.transitions: list[TransitionEvent] = []
        self.cache: RunCache | None = None
        self.cache_active = False
        self.reporter: Reporter | None = None
        self._loader = None
        self._loader_position: tuple[int, int] | None = None
        self._batch_ids: tuple[int, ...] | None = None
        self._comm_s = 0.0  # DDP all-reduce seconds on this rank since the last reduction

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.config
        self.world = world = init_distributed(cfg.trainer.device, cfg.trainer.timeout_s)
        name = cfg.trainer.autocast_dtype
        self.autocast_dtype = getattr(torch, name) if name else None
        self.control = create_control_group(cfg.trainer.timeout_s)
        if cfg.nproc_per_node != world.devices_per_node:
            # Under torchrun the launcher decides how many devices a node has.
            logger.info("using %d processes per node from the launcher", world.devices_per_node)
            cfg.trainer.nproc_per_node = world.devices_per_node
        check_config(cfg, world_size=world.world_size)
        # Every node must write to the same run directory: rank 0's choice wins.
        chosen = [str(self.run_dir)]
        dist.broadcast_object_list(chosen, src=0, group=self.control)
        self.run_dir = Path(chosen[0])
        # Whether this run resumes, decided once (by rank 0 or the launcher) for all ranks.
        resumption = start_run_directory(self.run_dir, self.options, cfg, world.rank, self.control)
        self.reporter = Reporter(
            self.run_dir, world.rank == 0, cfg.trainer.progress_bar, cfg.logging.tensorboard, cfg.logging.wandb,
            cfg.to_dict(),
        )

        self.data = build_data(cfg.data, seed=cfg.trainer.seed, model_name_or_path=cfg.model.model_name_or_path)
        self.task = task_for(self.data.task)
        self.model_args = model_args = dict(
            task=self.data.task,
            num_classes=self.data.num_classes,
            in_chans=self.data.in_chans,
            image_size=self.data.image_size,
            vocab_size=self.data.vocab_size,
            max_seq_length=self.data.max_seq_length,
        )
        # The skeleton gives every rank the structure of every unit without weights: what a
        # rank receives at a transition is materialised from it.
        self.skeleton = build_model(cfg.model, device="meta", **model_args)
        self.spec = self.skeleton.spec
        check_freeze_config(cfg.freeze, self.spec.num_layers)
        self.decider = FreezeDecider(cfg.freeze, self.spec.num_layers)
        checkpoint = resumption.checkpoint if resumption is not None else None
        if resumption is not None:
            self.state = resumption.state(self.spec)

        # Same seed on every rank: the full model is initialised identically everywhere
        # (and equals single-process training); each rank then keeps only its own units.
        torch.manual_seed(cfg.trainer.seed)
        full = build_model(cfg.model, device="cpu", **model_args)
        carried_profiles = checkpoint / PROFILES if checkpoint is not None else None
        self.profiler = RunProfiler(
            cfg, self.spec, self.run_dir, world.rank, world.world_size, world.device, self.control, carried_profiles
        )
        # Measured unit profiles balance the stages (balance: time), tell when the cache
        # pays and what a stage holds in memory.
        budget = device_memory_budget(cfg, world.device)
        profile = None
        if cfg.pipeline.balance == "time" or cfg.cache.enabled or budget is not None:
            profile = self.profiler.unit_profile(list(full.units))
        self.measured_costs = unit_costs_from_profile(profile) if profile is not None else None
        self.profile_micro_batch_size = (
            profile.micro_batch_size if profile is not None else profiling_micro_batch_size(cfg, world.world_size)
        )
        costs = planner_costs(cfg, self.spec, self.measured_costs if cfg.pipeline.balance == "time" else None)
        memory = memory_model(cfg, self.spec, profile)
        if cfg.pipeline.initial_pipe_len == "auto":
            cfg.pipeline.initial_pipe_len = choose_initial_pipe_len(cfg, costs, memory, budget, world.world_size)
            logger.info("initial_pipe_len auto: %d (device memory %s)", cfg.pipeline.initial_pipe_len,
                        "unlimited" if budget is None else format_bytes(budget))
            if world.rank == 0:  # the resolved config says where the run started
                write_text_atomic(self.run_dir / "config.yaml", config_yaml(cfg))
        self.planner = build_planner(
            cfg, self.spec, costs, plan_fits(cfg, memory, budget, world.world_size, cfg.pipeline.initial_pipe_len)
        )
        self.memory, self.memory_budget = memory, budget
        self.memory_source = "profile" if profile is not None else "params"
        # The cache serves frozen layers: with nothing ever frozen (the baseline) it stays off.
        if cfg.cache.enabled and cfg.freeze.strategy != "none":
            self.cache = RunCache(
                cfg, self.spec, self.data, world, self.control, read_s_per_sample=self.state.cache_read_s_per_sample
            )
            self.state.cache_read_s_per_sample = self.cache.read_s_per_sample
        layout = self.layout_for(self.state.num_frozen_layers, self._resume_pipe_len())
        self.units = {u: full.units[u].to(world.device) for u in layout.units_of_rank(world.rank)}
        del full

        self.sampler = TrainSampler(len(self.data.train), world.num_nodes, cfg.trainer.global_batch_size, cfg.trainer.seed)
        self.eval_sampler = EvalSampler(len(self.data.eval), cfg.trainer.global_batch_size)
        self.total_steps = cfg.trainer.epochs * self.sampler.steps_per_epoch
        self.decisions = DecisionSchedule.for_config(
            cfg.freeze, cfg.trainer.epochs, self.sampler.steps_per_epoch, self.state.min_decision_interval
        )
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, world.rank, self.control)
        self.layout = layout
        self._build_groups()
        self._apply_frozen()
        optimizer_states: dict[str, dict] = {}
        saved_rng = None
        if checkpoint is not None:
            start = time.perf_counter()
            optimizer_states, saved_rng = load_checkpoint_tensors(
                checkpoint, self.units, layout.plan.frozen_end, world, self.control, resumption.world_size
            )
            resumption.load_s = time.perf_counter() - start
            self.checkpointer.last_step = self.state.global_step
        self.layout = self._resolve_micro_batches(layout, epoch=self.state.epoch, step=self.state.step_in_epoch)
        self._build_runtime(optimizer_states)
        self._reset_interval()
        profile_s = self.profiler.take_seconds()
        if profile_s > 0:
            self.reporter.event(ProfileEvent(self.state.global_step, profile_s, self.planner.costs.source))
        if resumption is not None:
            self.reporter.event(resumption.event(self.layout, world))
        logger.info("initial layout: %s (stage costs from %s)", self.layout.describe(), self.planner.costs.source)
        # Last, so nothing in setup draws from the streams a checkpoint restored.
        if saved_rng is not None:
            set_rng_state(saved_rng, world.device)
        elif checkpoint is not None:
            reseed(cfg.trainer.seed, world.rank, self.state.global_step)
        else:
            # From here on each rank has its own random stream (dropout), which simply
            # continues across transitions.
            torch.manual_seed(cfg.trainer.seed + 1 + world.rank)

    def _resume_pipe_len(self) -> int:
        """The pipeline length to plan the (resumed) layout from: the checkpoint's when it
        was taken in a world of the same shape (so a resumed run continues exactly as it
        would have), otherwise the initial one (re-planned for the new world)."""
        initial = self.config.pipeline.initial_pipe_len
        state, world = self.state, self.world
        same_world = (state.world_size, state.devices_per_node) == (world.world_size, world.devices_per_node)
        return min(state.pipe_len, initial) if same_world and state.pipe_len > 0 else initial

    def cache_serves(self, num_frozen_layers: int) -> bool:
        """Whether AutoCache serves the frozen prefix at this boundary (same on every rank)."""
        if self.cache is None or not self.config.autopipe.enabled:
            return False  # without AutoPipe frozen layers stay inside stages: nothing to serve
        return self.cache.profitable(num_frozen_layers, self.measured_costs, self.profile_micro_batch_size)

    def layout_for(self, num_frozen_layers: int, current_pipe_len: int) -> Layout:
        prefix_cost = None
        if self.cache_serves(num_frozen_layers) and self.planner.costs.source == "time":
            prefix_cost = self.cache.prefix_cost(self.profile_micro_batch_size)
        elif self.cache_serves(num_frozen_layers):
            prefix_cost = 0.0  # parameter counts: a cache read costs next to nothing
        return layout_for(
            self.config,
            self.planner,
            num_frozen_layers,
            current_pipe_len,
            self.world.world_size,
            self.world.devices_per_node,
            prefix_cost=prefix_cost,
        )

    def _named_params(self) -> dict[str, nn.Parameter]:
        named = {}
        for index, unit in self.units.items():
            named.update(unit_param_names(unit, index))
        return named

    def _build_groups(self) -> None:
        self.groups = build_training_groups(self.layout, self.world.rank, self.config.trainer.timeout_s)

    def _apply_frozen(self) -> None:
        """Units below the layout's frozen boundary stop training: no grad, no stale grads."""
        frozen_end = self.layout.plan.frozen_end
        for index, unit in self.units.items():
            if index < frozen_end:
                unit.requires_grad_(False)
                for p in unit.parameters():
                    p.grad = None

    def _stage_runtime(self, layout: Layout) -> StageRuntime | None:
        role = layout.role(self.world.rank)
        if role is None:
            return None
        return build_stage_runtime(
            plan=layout.plan,
            stage_index=role.stage,
            replica_batch_size=layout.replica_batch_size(self.config.trainer.global_batch_size),
            units=self.units,
            spec=self.spec,
            loss_fn=self.task.loss_fn,
            schedule_name=self.config.pipeline.schedule,
            pipeline_group=self.groups.pipeline,
            data_group=self.groups.data,
            device=self.world.device,
            autocast_dtype=self.autocast_dtype,
        )

    def _build_runtime(self, optimizer_states: dict[str, dict]) -> None:
        """The optimizer over this rank's active parameters (with their carried state) and
        the stage runtime of the current layout."""
        named = self._named_params()
        self.optimizer = optim.build_optimizer(self.config.optimizer, named)
        optim.load_states_by_name(self.optimizer, named, optimizer_states)
        self.runtime = self._stage_runtime(self.layout)
        frozen = self.layout.plan.num_frozen_layers
        self.cache_active = self.cache_serves(frozen)
        if self.cache_active and self.runtime is not None and self.runtime.is_first:
            self.runtime.cached_prefix = CachedPrefix(
                self.units, frozen, self.cache.client, self.world.device, self.cache.counts
            )
        state, layout = self.state, self.layout
        state.num_frozen_layers, state.pipe_len, state.dp_degree = frozen, layout.pipe_len, layout.dp_degree
        state.num_micro_batches = layout.plan.num_micro_batches
        state.world_size, state.devices_per_node = self.world.world_size, self.world.devices_per_node

    def _resolve_micro_batches(self, layout: Layout, epoch: int, step: int) -> Layout:
        """For num_micro_batches 'auto': the measured fastest M of this layout (collective)."""
        if self.config.pipeline.num_micro_batches != "auto":
            return layout
        replica_batch = layout.replica_batch_size(self.config.trainer.global_batch_size)

        def measure_step(m: int):
            trial = Layout(with_micro_batches(layout.plan, m), layout.world_size, layout.devices_per_node, layout.dp_degree)
            runtime = self._stage_runtime(trial)
            if runtime is None:
                return lambda: None
            inputs, target = self._step_data(
                trial, min(epoch, self.config.trainer.epochs - 1), min(step, self.sampler.steps_per_epoch - 1)
            )

            def run() -> None:
                runtime.train_step(inputs, target)
                for p in runtime.module.parameters():
                    p.grad = None

            return run

        m = self.profiler.micro_batches(layout.pipe_len, replica_batch, measure_step)
        return Layout(with_micro_batches(layout.plan, m), layout.world_size, layout.devices_per_node, layout.dp_degree)

    def _step_data(self, layout: Layout, epoch: int, step: int, prefetched: bool = False):
        """This rank's (inputs, target) for one step in `layout` (None where not needed).
        `prefetched`: take the inputs from the loader that reads ahead (the training loop)."""
        role = layout.role(self.world.rank)
        node, local_replica = divmod(role.replica, layout.replicas_per_node)
        batch = self.sampler.replica_batch(node, local_replica, layout.replicas_per_node, epoch, step)
        inputs = target = None
        if role.is_first:
            raw = self._next_inputs(epoch, step) if prefetched else self.data.train.fetch(batch.ids)[0]
            inputs = [t.to(self.world.device, non_blocking=True) for t in raw]
            self._batch_ids = batch.ids
            if prefetched and self.config.trainer.record_sample_ids:
                trained = [i for i, valid in zip(batch.ids, batch.valid) if valid]
                append_jsonl(
                    self.run_dir / "samples" / f"rank{self.world.rank}.jsonl",
                    {"epoch": epoch + 1, "step": step, "node": node, "ids": trained},
                )
        if role.is_last:
            weights = loss_weights(batch.valid, layout.dp_degree, self.sampler.global_num_valid(epoch, step))
            target = self.task.make_target(self.data.train.targets(batch.ids), weights)
            target = target.to(self.world.device, non_blocking=True)  # host to device: no sync
        return inputs, target

    # ------------------------------------------------------------------ training

    def train(self) -> dict[str, Any]:
        """Train to the last epoch (from wherever the state says the run is). Raises
        RunStopped after writing a checkpoint when a stop signal arrives."""
        cfg, state = self.config, self.state
        steps = self.sampler.steps_per_epoch
        started = self._interval_clock = time.perf_counter()
        self.reporter.event(self._start_event())
        self._start_epoch()
        while state.epoch < cfg.trainer.epochs:
            self._train_step()
            epoch_end = state.step_in_epoch == steps
            if state.global_step % cfg.trainer.log_interval_steps == 0 or epoch_end:
                self._log_steps()
            eval_metric = self._end_epoch() if epoch_end else None
            if self.decisions.due(state.global_step, epoch_end, state.interval_steps):
                self._decision_point()
            stop = self._agree_on_stop()
            if stop or self.checkpointer.due(
                epoch_end=epoch_end, completed_epochs=state.epoch, global_step=state.global_step
            ):
                self.save_checkpoint(signal_name(stop) if stop else "epoch" if epoch_end else "steps", eval_metric)
            if stop:
                raise RunStopped(stop, state.global_step, state.epoch, state.step_in_epoch, str(self.last_checkpoint))
            if epoch_end and state.epoch < cfg.trainer.epochs:
                self._start_epoch()
        if cfg.trainer.save_model:
            self.export_model()
        return self._finish(time.perf_counter() - started)

    def export_model(self) -> None:
        """Write the trained model as its library loads it to RUN_DIR/export, from a final
        checkpoint (collective: the checkpoint; rank 0 exports)."""
        if self.checkpointer.last_step != self.state.global_step:
            self.save_checkpoint("final")
        if self.world.rank == 0:
            from pipetransformer.trainer.export import export_run

            export_run(self.run_dir, self.run_dir / "export")
        dist.barrier(group=self.control)

    def _start_epoch(self) -> None:
        steps = self.sampler.steps_per_epoch
        self.reporter.start_epoch(self.state.epoch, self.config.trainer.epochs, steps, self.state.step_in_epoch)
        self._epoch_clock = time.perf_counter()

    def _train_step(self) -> None:
        """Forward, backward and update for this rank's part of one global step. No host
        synchronisation: the loss and the gradient norms stay on the device."""
        state, layout = self.state, self.layout
        epoch, step = state.epoch, state.step_in_epoch
        role = layout.role(self.world.rank)
        started = time.perf_counter()
        if role is not None:
            inputs, target = self._step_data(layout, epoch, step, prefetched=True)
            optim.set_learning_rate(self.optimizer, self._learning_rate(state.global_step))
            losses = self.runtime.train_step(inputs, target, self._batch_ids if inputs is not None else None)
            if self.runtime.comm_timer is not None:
                self._comm_s += self.runtime.comm_timer.take()
            clip = self.config.optimizer.max_grad_norm
            if clip is not None or self.decider.needs_grad_norms:
                # One pass over the gradients serves both.
                unit_sq = self._unit_grad_squares()
                scale = self._clip_gradients(unit_sq, clip) if clip is not None else None
                if self.decider.needs_grad_norms:
                    # The norms of the gradients applied.
                    self.unit_grad_sq += unit_sq if scale is None else unit_sq * scale.square()
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if losses:
                # Losses are weighted by R / (valid samples in the global batch): undo that to
                # get this replica's sum of per-sample losses.
                weight = self.sampler.global_num_valid(epoch, step) / layout.dp_degree
                replica_loss = torch.stack([l.detach() for l in losses]).double().sum() * weight
                self._interval_loss += replica_loss
                self._epoch_loss += replica_loss
        self._interval_samples += self.sampler.global_num_valid(epoch, step)
        self._interval_train_s += time.perf_counter() - started
        state.interval_steps += 1
        state.global_step += 1
        state.step_in_epoch += 1
        self.reporter.step(frozen=layout.plan.num_frozen_layers, K=layout.pipe_len, R=layout.dp_degree)

    def _learning_rate(self, global_step: int) -> float:
        return optim.learning_rate(self.config.optimizer, global_step, self.total_steps)

    def _log_steps(self) -> None:
        """steps.jsonl (and TensorBoard / W&B): the mean loss of the steps since the last
        line. Collective; the one place a step's loss leaves the device."""
        now = time.perf_counter()
        loss = self._all_sum(self._interval_loss) / max(1, self._interval_samples)
        record = StepMetrics(
            global_step=self.state.global_step,
            epoch=self.state.epoch + 1,
            loss=loss,
            lr=self._learning_rate(self.state.global_step - 1),
            samples_per_s=self._interval_samples / max(1e-9, now - self._interval_clock),
            num_frozen_layers=self.layout.plan.num_frozen_layers,
            pipe_len=self.layout.pipe_len,
            dp_degree=self.layout.dp_degree,
        )
        self.reporter.log_step(record)
        self._interval_loss.zero_()
        self._interval_samples = 0
        self._interval_clock = now

    def _end_epoch(self) -> float | None:
        """Evaluation (when due) and the epoch's metrics line; moves the state to the next
        epoch. Collective. Returns the eval metric when this epoch evaluated."""
        cfg, state = self.config, self.state
        self.reporter.end_epoch()
        self._carry_epoch_partials()
        epoch_time = state.epoch_train_s
        eval_metrics: dict[str, float] = {}
        eval_time = 0.0
        if (state.epoch + 1) % cfg.trainer.eval_interval_epochs == 0 or state.epoch + 1 == cfg.trainer.epochs:
            eval_start = time.perf_counter()
            eval_metrics = self.evaluate()
            eval_time = time.perf_counter() - eval_start
            state.last_eval_metric = eval_metrics["eval_metric"]
            best = state.best_eval_metric
            state.best_eval_metric = state.last_eval_metric if best is None else max(best, state.last_eval_metric)
        cache_metrics = self.cache.epoch_metrics() if self.cache is not None else {}
        plan = self.layout.plan
        self.reporter.metrics(
            EpochMetrics(
                epoch=state.epoch + 1,
                global_step=state.global_step,
                train_loss=state.epoch_loss_sum / len(self.data.train),
                eval_metric=eval_metrics.get("eval_metric"),
                eval_loss=eval_metrics.get("eval_loss"),
                eval_samples=eval_metrics.get("eval_samples"),
                exact_match=eval_metrics.get("exact_match"),
                samples_per_s=len(self.data.train) / epoch_time,
                epoch_time_s=epoch_time,
                eval_time_s=eval_time,
                transition_time_s=state.epoch_transition_s,
                ddp_comm_s=state.epoch_comm_s,
                ddp_comm_share=state.epoch_comm_s / epoch_time,
                num_frozen_layers=plan.num_frozen_layers,
                pipe_len=plan.pipe_len,
                dp_degree=self.layout.dp_degree,
                num_micro_batches=plan.num_micro_batches,
                lr=self._learning_rate(max(0, state.global_step - 1)),
                cache_active=self.cache_active,
                **cache_metrics,
            )
        )
        state.epoch += 1
        state.step_in_epoch = 0
        state.epoch_loss_sum = state.epoch_train_s = state.epoch_transition_s = state.epoch_comm_s = 0.0
        return eval_metrics.get("eval_metric")

    def _carry_epoch_partials(self) -> None:
        """Fold what this attempt accumulated of the epoch in progress into the state, reduced
        over the ranks (collective): the loss, training seconds, DDP communication."""
        state = self.state
        now = time.perf_counter()
        state.epoch_train_s += now - self._epoch_clock
        self._epoch_clock = now
        state.epoch_loss_sum += self._all_sum(self._epoch_loss)
        self._epoch_loss.zero_()
        state.epoch_comm_s += self._mean_comm_seconds()

    def _finish(self, wall_s: float) -> dict[str, Any]:
        state = self.state
        summary = {
            "wall_time_s": state.previous_attempts_wall_s + wall_s,
            "attempts": state.attempt,
            "final_eval_metric": state.last_eval_metric,
            "best_eval_metric": state.best_eval_metric,
            "metric_name": self.task.metric_name,
            "epochs": self.config.trainer.epochs,
            "global_steps": state.global_step,
            "num_transitions": state.num_transitions,
            "final_num_frozen_layers": self.layout.plan.num_frozen_layers,
            "final_pipe_len": self.layout.pipe_len,
            "final_dp_degree": self.layout.dp_degree,
            "world_size": self.world.world_size,
            "device": str(self.world.device.type),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }
        self.reporter.summary(summary)
        return summary

    def _start_event(self) -> StartEvent:
        return StartEvent(
            global_step=self.state.global_step,
            attempt=self.state.attempt,
            time=time.time(),
            world_size=self.world.world_size,
            pipe_len=self.layout.pipe_len,
            dp_degree=self.layout.dp_degree,
            num_frozen_layers=self.layout.plan.num_frozen_layers,
            cache_daemons=self.cache.daemons if self.cache is not None else [],
            predicted_stage_bytes=[
                int(b) for b in stage_bytes(
                    self.config, self.memory, self.layout.plan, self.world.world_size, self.config.pipeline.initial_pipe_len
                )
            ],
            device_memory_bytes=self.memory_budget,
            memory_source=self.memory_source,
        )

    def _agree_on_stop(self) -> int:
        """The stop signal any rank received (0: none), the same on every rank (collective:
        all ranks stop after the same step)."""
        flag = torch.tensor([self.stop.signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return int(flag)

    def _mean_comm_seconds(self) -> float:
        """DDP all-reduce seconds since the last call, averaged over the ranks that ran DDP
        (collective)."""
        ran_ddp = 1.0 if self._comm_s > 0 else 0.0
        totals = torch.tensor([self._comm_s, ran_ddp], dtype=torch.float64)
        dist.all_reduce(totals, group=self.control)
        self._comm_s = 0.0
        return float(totals[0] / totals[1]) if totals[1] > 0 else 0.0

    def _all_sum(self, value: torch.Tensor) -> float:
        """Sum over all ranks (control group; collective). A host sync on a GPU: call it at
        log intervals and epoch ends, never per step."""
        total = value.detach().to("cpu", torch.float64).clone().reshape(1)
        dist.all_reduce(total, group=self.control)
        return float(total.item())

    def _next_inputs(self, epoch: int, step: int) -> tuple[torch.Tensor, ...]:
        """This replica's inputs for `step`, loaded ahead by `data.num_workers` workers.

        The rest of the epoch's batches are known in advance for the current layout; a
        transition changes the split, so the loader restarts at the step after it.
        """
        if self._loader is None or self._loader_position != (epoch, step):
            layout = self.layout
            role = layout.role(self.world.rank)
            node, local_replica = divmod(role.replica, layout.replicas_per_node)
            id_batches = [
                self.sampler.replica_batch(node, local_replica, layout.replicas_per_node, epoch, s).ids
                for s in range(step, self.sampler.steps_per_epoch)
            ]
            self._loader = iterate_batches(self.data.train, id_batches, self.config.data.num_workers)
            if self.cache_active:  # the cache's disk tier reads ahead in the same order
                self.cache.client.prefetch("train", [i for ids in id_batches for i in ids])
        inputs, _ = next(self._loader)
        self._loader_position = (epoch, step + 1)
        return inputs

    def _unit_grad_squares(self) -> torch.Tensor:
        """Squared gradient norm of each unit this rank trains, float64 on the device."""
        squares = torch.zeros(self.spec.num_units, dtype=torch.float64, device=self.world.device)
        for index, unit in self.units.items():
            grads = [p.grad.detach() for p in unit.parameters() if p.requires_grad and p.grad is not None]
            if grads:
                squares[index] = torch.stack([g.double().pow(2).sum() for g in grads]).sum()
        return squares

    def _clip_gradients(self, unit_squares: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Clip by the global norm; returns the factor applied to every gradient, on the
        device (as torch.nn.utils.clip_grad_norm_ does: no host sync)."""
        total_sq = unit_squares.sum()
        if self.layout.pipe_len > 1:  # the replica's stages together hold the whole model
            dist.all_reduce(total_sq, group=self.groups.pipeline)
        scale = (max_norm / (total_sq.sqrt() + 1e-6)).clamp(max=1.0)
        grads = [p.grad for p in self.runtime.trainable_parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        return scale

    # ------------------------------------------------------------------ freezing

    def _reset_interval(self) -> None:
        """Start the device-side accumulators of a decision interval and of the step log."""
        device = self.world.device
        self.unit_grad_sq = torch.zeros(self.spec.num_units, dtype=torch.float64, device=device)
        self._interval_loss = torch.zeros((), dtype=torch.float64, device=device)
        self._epoch_loss = torch.zeros((), dtype=torch.float64, device=device)
        self._interval_samples = 0
        self._interval_train_s = 0.0  # seconds of training steps since the last decision
        if len(self.state.interval_grad_sq) != self.spec.num_units:
            self.state.interval_grad_sq = [0.0] * self.spec.num_units

    def _reduced_grad_squares(self) -> list[float]:
        """Per unit, the interval's squared gradient norms summed over its steps, reduced over
        replicas (collective): this attempt's part plus what a checkpoint carried."""
        totals = self.unit_grad_sq.to("cpu", copy=True)  # the control group is gloo
        dist.all_reduce(totals, group=self.control)
        totals /= self.layout.dp_degree  # every replica holds the same (DDP-averaged) gradients
        self.unit_grad_sq.zero_()
        return [carried + float(t) for carried, t in zip(self.state.interval_grad_sq, totals)]

    def layer_grad_norms(self) -> list[float]:
        """Per-layer RMS gradient norm over the interval, identical on every rank (collective)."""
        totals = self._reduced_grad_squares()
        steps = max(1, self.state.interval_steps)
        norms = [0.0] * self.spec.num_layers
        for unit in range(self.spec.num_units):
            layer = layer_of_unit(unit, self.spec.num_layers)
            if layer is not None:
                norms[layer] += totals[unit]
        return [math.sqrt(n / steps) for n in norms]

    def _decision_point(self) -> None:
        state = self.state
        state.decision_index += 1
        current = self.layout.plan.num_frozen_layers
        norms = self.layer_grad_norms() if self.decider.needs_grad_norms else None
        decided = self.decider.decide(state.decision_index, current, norms)
        self._check_agreement(decided)
        step_s = self._interval_train_s / max(1, state.interval_steps)
        state.interval_grad_sq = [0.0] * self.spec.num_units
        state.interval_steps = 0
        self._interval_train_s = 0.0
        self.unit_grad_sq.zero_()
        if decided != current:
            started = time.perf_counter()
            record = self.transition(decided, grad_norms=norms)
            state.epoch_transition_s += time.perf_counter() - started
            self._space_decisions(record.total_s - record.profile_s, step_s)

    def _space_decisions(self, transition_s: float, step_s: float) -> None:
        """freeze.interval_steps 'auto': keep the recurring cost of a transition (not the
        one-time micro-batch profiling of a new layout) within TRANSITION_TIME_SHARE of the
        time between decisions. The slowest rank's figures decide, the same on every rank."""
        if self.config.freeze.interval_steps != "auto":
            return
        figures = torch.tensor([transition_s, step_s], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.control)
        bound = min_interval_for(float(figures[0]), float(figures[1]))
        if bound > self.state.min_decision_interval:
            self.state.min_decision_interval = bound
            self.decisions = DecisionSchedule.for_config(
                self.config.freeze, self.config.trainer.epochs, self.sampler.steps_per_epoch, bound
            )
            logger.info(
                "decision interval: %d steps (a transition took %.3f s, a step %.3f s)",
                self.decisions.interval_steps, float(figures[0]), float(figures[1]),
            )

    def _check_agreement(self, value: int) -> None:
        both = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.control)
        if both[0].item() != value or -both[1].item() != value:
            raise RuntimeError(f"ranks disagree on num_frozen_layers: {value} here, max {both[0].item()}, min {-both[1].item()}")

    # ------------------------------------------------------------------ transitions

    def transition(self, num_frozen_layers: int, grad_norms: list[float] | None = None) -> TransitionEvent:
        """Move to the layout for `num_frozen_layers`. Collective: every rank, same order."""
        state = self.state
        times = {}
        t = time.perf_counter()
        old = self.layout
        new = self.layout_for(num_frozen_layers, old.pipe_len)
        times["plan_s"] = time.perf_counter() - t

        t = time.perf_counter()
        named = self._named_params()
        states = optim.states_by_name(self.optimizer, named)
        transfers = plan_transfers(old, new)
        skeletons = {u: self.skeleton.units[u] for u in range(self.spec.num_units)}
        received, received_states = execute_transfers(
            transfers, self.world.rank, self.units, states, skeletons, self.control, self.world.device
        )
        keep = set(new.units_of_rank(self.world.rank))
        self.units = {u: m for u, m in {**self.units, **received}.items() if u in keep}
        states.update(received_states)
        times["state_move_s"] = time.perf_counter() - t

        t = time.perf_counter()
        self._loader = None  # the data split changes with the layout
        self.runtime = None
        self.optimizer = None
        self.groups.destroy()
        self.layout = new
        self._build_groups()
        times["groups_s"] = time.perf_counter() - t
        self._apply_frozen()
        self.layout = new = self._resolve_micro_batches(new, state.epoch, state.step_in_epoch)
        times["profile_s"] = self.profiler.take_seconds()
        t = time.perf_counter()
        self._build_runtime(states)
        dist.barrier(group=self.control)
        times["rebuild_s"] = time.perf_counter() - t

        record = TransitionEvent(
            epoch=state.epoch if state.step_in_epoch else state.epoch - 1,
            step=state.step_in_epoch or self.sampler.steps_per_epoch,
            global_step=state.global_step,
            old_num_frozen_layers=old.plan.num_frozen_layers,
            new_num_frozen_layers=new.plan.num_frozen_layers,
            old_pipe_len=old.pipe_len,
            new_pipe_len=new.pipe_len,
            old_dp_degree=old.dp_degree,
            new_dp_degree=new.dp_degree,
            new_stage_ranges=[list(r) for r in new.plan.stage_ranges],
            num_micro_batches=new.plan.num_micro_batches,
            units_moved=len(transfers),
            layer_grad_norms=grad_norms,
            data_groups=[new.data_ranks(s) for s in range(new.pipe_len)] if new.dp_degree > 1 else [],
            **times,
            total_s=sum(times.values()),
        )
        state.num_transitions += 1
        self.transitions.append(record)
        self.reporter.event(record)
        logger.info("transition: %s (%.3f s)", new.describe(), record.total_s)
        return record

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """Forward over the whole eval set, split over all replicas; metrics reduced everywhere."""
        layout, world = self.layout, self.world
        role = layout.role(world.rank)
        accumulator = self.task.new_accumulator(self.data.eval_extras)
        if role is not None:
            batches = [
                self.eval_sampler.replica_batch(role.replica, layout.dp_degree, s) for s in range(self.eval_sampler.steps)
            ]
            loader = iterate_batches(self.data.eval, [b.ids for b in batches], self.config.data.num_workers) if role.is_first else None
            if role.is_first and self.cache_active:
                self.cache.client.prefetch("eval", [i for b in batches for i in b.ids])
            for batch in batches:
                inputs = target = labels = None
                if role.is_first:
                    inputs = [t.to(world.device) for t in next(loader)[0]]
                if role.is_last:
                    labels = self.data.eval.targets(batch.ids)
                    target = self.task.make_target(labels, torch.zeros(len(batch.ids))).to(world.device)
                outputs = self.runtime.eval_step(inputs, target, batch.ids)
                if role.is_last:
                    accumulator.add(outputs.detach(), batch.ids, batch.valid, labels)
        return accumulator.reduce(self.control)

    # ------------------------------------------------------------------ checkpoints

    @property
    def last_checkpoint(self) -> Path | None:
        step = self.checkpointer.last_step
        return None if step is None else self.checkpointer.root / f"step-{step:08d}"

    def save_checkpoint(self, reason: str, eval_metric: float | None = None) -> None:
        """A checkpoint of the run as it stands after the current step (collective)."""
        state = self.state
        if state.step_in_epoch:  # inside an epoch: its partial sums travel in the state
            self._carry_epoch_partials()
        state.interval_grad_sq = self._reduced_grad_squares()
        tensors: dict[str, torch.Tensor] = {}
        for key, tensor in self._unit_tensors().items():
            tensors[model_key(key)] = tensor
        named = self._named_params()
        for key, entries in optim.states_by_name(self.optimizer, named).items():
            for name, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[optimizer_key(key, name)] = value
        for stream, value in rng_state(self.world.device).items():
            tensors[rng_key(self.world.rank, stream)] = value
        run_state = {
            "state": state.to_dict(),
            "config": self.config.to_dict(),
            "model": {
                "unit_names": list(self.spec.unit_names),
                "unit_param_counts": list(self.spec.unit_param_counts),
                "build_args": self.model_args,  # what export rebuilds the model from
            },
            "time": time.time(),
            "reason": reason,
        }
        saved = self.checkpointer.save(
            state.global_step, tensors, run_state, eval_metric, lambda directory: self.profiler.store.save_copy(directory / PROFILES)
        )
        self.reporter.event(
            CheckpointEvent(state.global_step, state.epoch, str(saved.path), reason, saved.write_s, saved.bytes, eval_metric)
        )
        self._epoch_clock = time.perf_counter()  # writing a checkpoint is not training time

    def _unit_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer this rank holds, by global name (buffers include the
        non-persistent ones: a resumed unit is materialised without initialisation)."""
        tensors = {}
        for index, unit in self.units.items():
            for name, param in unit.named_parameters():
                tensors[param_key(index, name)] = param.detach()
            for name, buffer in unit.named_buffers():
                tensors[param_key(index, name)] = buffer
        return tensors

    # ------------------------------------------------------------------ teardown

    def cleanup(self) -> None:
        self.runtime = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.groups is not None:
            self.groups.destroy()
        if self.reporter is not None:
            self.reporter.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
