"""The trainer: the one place that coordinates. Step loop, evaluation, metrics, transitions.

Every rank runs this. Ranks agree on everything by computing it from the same values (the
config, the sampler, all-reduced gradient norms); the only messages are the pipeline's
own, DDP's, small all-reduces on the control group and the state handoff at transitions.

At a decision point: freeze decides F (pure) -> AutoPipe plans the layout (pure) -> AutoDP
moves units and optimizer state, rebuilds the groups -> the stage runtime is rebuilt.
"""

from __future__ import annotations

import logging
import math
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
from pipetransformer.config import Config, check_config, dump_config
from pipetransformer.data import build_data, iterate_batches
from pipetransformer.freeze import FreezeDecider, check_freeze_config
from pipetransformer.models import build_model, unit_param_names
from pipetransformer.pipe import StageRuntime, build_stage_runtime
from pipetransformer.pipe.prefix import CachedPrefix
from pipetransformer.trainer import optim
from pipetransformer.trainer.caching import RunCache
from pipetransformer.trainer.distributed import WorldInfo, init_distributed
from pipetransformer.trainer.planning import (
    build_planner,
    layout_for,
    profiling_micro_batch_size,
    with_micro_batches,
)
from pipetransformer.trainer.profiling import RunProfiler
from pipetransformer.trainer.reporting import Reporter
from pipetransformer.trainer.tasks import loss_weights, task_for
from pipetransformer.utils.units import layer_of_unit

logger = logging.getLogger(__name__)


class Trainer:
    """setup() -> train() -> cleanup(); see the module docstring."""

    def __init__(self, config: Config, run_dir: str | Path) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.world: WorldInfo | None = None
        self.units: dict[int, nn.Module] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.runtime: StageRuntime | None = None
        self.groups: TrainingGroups | None = None
        self.layout: Layout | None = None
        self.global_step = 0
        self.decision_index = 0
        self.transitions: list[dict[str, Any]] = []
        # (global_step, this replica's sum of per-sample losses) on last-stage ranks.
        self.step_losses: list[tuple[int, float]] = []
        self._loader = None
        self._loader_position: tuple[int, int] | None = None
        self._comm_s = 0.0  # DDP all-reduce seconds on this rank since the epoch began
        self.cache = None
        self.cache_active = False
        self._batch_ids: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.config
        self.world = world = init_distributed(cfg.trainer.device, cfg.trainer.timeout_s)
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
        self.reporter = Reporter(
            self.run_dir, world.rank == 0, cfg.trainer.progress_bar, cfg.logging.tensorboard
        )
        if world.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.run_dir / "config.yaml")

        self.data = build_data(cfg.data, seed=cfg.trainer.seed, model_name_or_path=cfg.model.model_name_or_path)
        self.task = task_for(self.data.task)
        model_args = dict(
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

        # Same seed on every rank: the full model is initialised identically everywhere
        # (and equals single-process training); each rank then keeps only its own units.
        torch.manual_seed(cfg.trainer.seed)
        full = build_model(cfg.model, device="cpu", **model_args)
        self.profiler = RunProfiler(cfg, self.spec, self.run_dir, world.rank, world.world_size, world.device, self.control)
        # Measured costs balance the stages (balance: time) and tell when the cache pays.
        self.measured_costs = None
        if cfg.pipeline.balance == "time" or cfg.cache.enabled:
            self.measured_costs = self.profiler.unit_costs(list(full.units))
        self.planner = build_planner(cfg, self.spec, self.measured_costs if cfg.pipeline.balance == "time" else None)
        # The cache serves frozen layers: with nothing ever frozen (the baseline) it stays off.
        if cfg.cache.enabled and cfg.freeze.strategy != "none":
            self.cache = RunCache(cfg, self.spec, self.data, world, self.control)
        layout = self.layout_for(0, cfg.pipeline.initial_pipe_len)
        self.units = {u: full.units[u].to(world.device) for u in layout.units_of_rank(world.rank)}
        del full
        # From here on each rank has its own random stream (dropout), which simply continues
        # across transitions.
        torch.manual_seed(cfg.trainer.seed + 1 + world.rank)

        self.sampler = TrainSampler(len(self.data.train), world.num_nodes, cfg.trainer.global_batch_size, cfg.trainer.seed)
        self.eval_sampler = EvalSampler(len(self.data.eval), cfg.trainer.global_batch_size)
        self.total_steps = cfg.trainer.epochs * self.sampler.steps_per_epoch
        self.layout = layout
        self._build_groups()
        self._apply_frozen()
        self.layout = self._resolve_micro_batches(layout, epoch=0, step=0)
        self._build_runtime({})
        self._reset_grad_norms()
        profile_s = self.profiler.take_seconds()
        if profile_s > 0:
            self.reporter.event({"kind": "profile", "global_step": 0, "profile_s": profile_s, "cost_source": self.planner.costs.source})
        logger.info("initial layout: %s (stage costs from %s)", self.layout.describe(), self.planner.costs.source)

    def cache_serves(self, num_frozen_layers: int) -> bool:
        """Whether AutoCache serves the frozen prefix at this boundary (same on every rank)."""
        if self.cache is None or not self.config.autopipe.enabled:
            return False  # without AutoPipe frozen layers stay inside stages: nothing to serve
        micro = profiling_micro_batch_size(self.config, self.world.world_size)
        return self.cache.profitable(num_frozen_layers, self.measured_costs, micro)

    def layout_for(self, num_frozen_layers: int, current_pipe_len: int) -> Layout:
        prefix_cost = None
        if self.cache_serves(num_frozen_layers) and self.planner.costs.source == "time":
            prefix_cost = self.cache.prefix_cost(profiling_micro_batch_size(self.config, self.world.world_size))
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
            inputs, target = self._step_data(trial, epoch % self.config.trainer.epochs, min(step, self.sampler.steps_per_epoch - 1))

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
        if role.is_last:
            weights = loss_weights(batch.valid, layout.dp_degree, self.sampler.global_num_valid(epoch, step))
            target = self.task.make_target(self.data.train.targets(batch.ids), weights).to(self.world.device)
        return inputs, target

    # ------------------------------------------------------------------ training

    def train(self) -> dict[str, Any]:
        cfg = self.config
        start = time.perf_counter()
        best = -math.inf
        last_eval = None
        for epoch in range(cfg.trainer.epochs):
            epoch_start = time.perf_counter()
            train_loss, transition_s = self._train_epoch(epoch)
            epoch_time = time.perf_counter() - epoch_start
            comm_s = self._mean_comm_seconds()
            eval_metrics: dict[str, float] = {}
            eval_time = 0.0
            if (epoch + 1) % cfg.trainer.eval_interval_epochs == 0 or epoch + 1 == cfg.trainer.epochs:
                eval_start = time.perf_counter()
                eval_metrics = self.evaluate()
                eval_time = time.perf_counter() - eval_start
                last_eval = eval_metrics["eval_metric"]
                best = max(best, last_eval)
            cache_metrics = self.cache.epoch_metrics() if self.cache is not None else {}
            plan = self.layout.plan
            self.reporter.metrics(
                {
                    "epoch": epoch + 1,
                    "global_step": self.global_step,
                    "train_loss": train_loss,
                    "eval_metric": eval_metrics.get("eval_metric"),
                    **{k: v for k, v in eval_metrics.items() if k != "eval_metric"},
                    "samples_per_s": len(self.data.train) / epoch_time,
                    "epoch_time_s": epoch_time,
                    "eval_time_s": eval_time,
                    "transition_time_s": transition_s,
                    "ddp_comm_s": comm_s,
                    "ddp_comm_share": comm_s / epoch_time,
                    "num_frozen_layers": plan.num_frozen_layers,
                    "pipe_len": plan.pipe_len,
                    "dp_degree": self.layout.dp_degree,
                    "num_micro_batches": plan.num_micro_batches,
                    **cache_metrics,
                    "cache_active": self.cache_active,
                    "lr": optim.learning_rate(cfg.optimizer, max(0, self.global_step - 1), self.total_steps),
                }
            )
            if cfg.freeze.interval_steps is None and epoch + 1 < cfg.trainer.epochs:
                if epoch + 1 >= cfg.freeze.warmup_epochs:
                    self._decision_point(epoch + 1)
        wall = time.perf_counter() - start
        summary = {
            "wall_time_s": wall,
            "final_eval_metric": last_eval,
            "best_eval_metric": best if best > -math.inf else None,
            "metric_name": self.task.metric_name,
            "epochs": cfg.trainer.epochs,
            "global_steps": self.global_step,
            "num_transitions": len(self.transitions),
            "final_num_frozen_layers": self.layout.plan.num_frozen_layers,
            "final_pipe_len": self.layout.pipe_len,
            "final_dp_degree": self.layout.dp_degree,
            "world_size": self.world.world_size,
            "device": str(self.world.device.type),
        }
        if cfg.trainer.save_model:
            self.save_model(self.run_dir / "model.pt")
        self.reporter.summary(summary)
        return summary

    def _train_epoch(self, epoch: int) -> tuple[float, float]:
        cfg = self.config
        steps = self.sampler.steps_per_epoch
        self.reporter.start_epoch(epoch, cfg.trainer.epochs, steps)
        loss_sum = torch.zeros((), dtype=torch.float64)  # sum of per-sample losses, this replica
        samples_seen = 0
        transition_s = 0.0
        for step in range(steps):
            step_loss = self._train_step(epoch, step)
            loss_sum += step_loss
            samples_seen += self.sampler.global_num_valid(epoch, step)
            self.global_step += 1
            postfix = {}
            if (step + 1) % cfg.trainer.log_interval_steps == 0 or step + 1 == steps:
                postfix["loss"] = f"{self._all_sum(loss_sum) / samples_seen:.4f}"
            self.reporter.step(**postfix, frozen=self.layout.plan.num_frozen_layers, K=self.layout.pipe_len, R=self.layout.dp_degree)
            interval = cfg.freeze.interval_steps
            if interval is not None and self.global_step % interval == 0 and epoch >= cfg.freeze.warmup_epochs:
                if not (epoch + 1 == cfg.trainer.epochs and step + 1 == steps):
                    t0 = time.perf_counter()
                    self._decision_point(epoch, step + 1)
                    transition_s += time.perf_counter() - t0
        self.reporter.end_epoch()
        return self._all_sum(loss_sum) / len(self.data.train), transition_s

    def _mean_comm_seconds(self) -> float:
        """DDP all-reduce seconds this epoch, averaged over the ranks that ran DDP (collective)."""
        ran_ddp = 1.0 if self._comm_s > 0 else 0.0
        totals = torch.tensor([self._comm_s, ran_ddp], dtype=torch.float64)
        dist.all_reduce(totals, group=self.control)
        self._comm_s = 0.0
        return float(totals[0] / totals[1]) if totals[1] > 0 else 0.0

    def _all_sum(self, value: torch.Tensor) -> float:
        """Sum over all ranks (control group; collective)."""
        total = value.detach().to(torch.float64).cpu().clone().reshape(1)
        dist.all_reduce(total, group=self.control)
        return float(total.item())

    def _train_step(self, epoch: int, step: int) -> torch.Tensor:
        """Forward, backward and update for this rank's part of one global step."""
        layout, world = self.layout, self.world
        role = layout.role(world.rank)
        if role is None:
            return torch.zeros((), dtype=torch.float64)
        inputs, target = self._step_data(layout, epoch, step, prefetched=True)
        optim.set_learning_rate(self.optimizer, optim.learning_rate(self.config.optimizer, self.global_step, self.total_steps))
        losses = self.runtime.train_step(inputs, target, self._batch_ids if inputs is not None else None)
        if self.runtime.comm_timer is not None:
            self._comm_s += self.runtime.comm_timer.take()
        clip = self.config.optimizer.max_grad_norm
        if clip is not None or self.decider.needs_grad_norms:
            # One pass over the gradients serves both; it stays on the device (no sync per unit).
            unit_sq = self._unit_grad_squares()
            scale = self._clip_gradients(unit_sq, clip) if clip is not None else 1.0
            if self.decider.needs_grad_norms:
                self.unit_grad_sq += unit_sq * scale**2  # the norms of the gradients applied
                self.grad_norm_steps += 1
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if not losses:
            return torch.zeros((), dtype=torch.float64)
        # Losses are weighted by R / (valid samples in the global batch): undo that to get
        # this replica's sum of per-sample losses.
        scale = self.sampler.global_num_valid(epoch, step) / layout.dp_degree
        replica_loss = torch.stack([l.detach().double().cpu() for l in losses]).sum() * scale
        self.step_losses.append((self.global_step, float(replica_loss)))
        return replica_loss

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

    def _clip_gradients(self, unit_squares: torch.Tensor, max_norm: float) -> float:
        """Clip by the global norm; returns the factor applied to every gradient."""
        total_sq = unit_squares.sum()
        # The replica's stages together hold the whole model: sum over the pipeline group.
        dist.all_reduce(total_sq, group=self.groups.pipeline)
        total = float(total_sq.sqrt())
        if total <= max_norm:
            return 1.0
        scale = max_norm / (total + 1e-6)
        for p in self.runtime.trainable_parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        return scale

    # ------------------------------------------------------------------ freezing

    def _reset_grad_norms(self) -> None:
        self.unit_grad_sq = torch.zeros(self.spec.num_units, dtype=torch.float64, device=self.world.device)
        self.grad_norm_steps = 0

    def layer_grad_norms(self) -> list[float]:
        """Per-layer RMS gradient norm over the interval, identical on every rank (collective)."""
        totals = self.unit_grad_sq.to("cpu", copy=True)  # the control group is gloo
        dist.all_reduce(totals, group=self.control)
        totals /= self.layout.dp_degree  # every replica holds the same (DDP-averaged) gradients
        steps = max(1, self.grad_norm_steps)
        norms = [0.0] * self.spec.num_layers
        for unit in range(self.spec.num_units):
            layer = layer_of_unit(unit, self.spec.num_layers)
            if layer is not None:
                norms[layer] += float(totals[unit])
        return [math.sqrt(n / steps) for n in norms]

    def _decision_point(self, epoch: int, step: int | None = None) -> None:
        self.decision_index += 1
        current = self.layout.plan.num_frozen_layers
        norms = self.layer_grad_norms() if self.decider.needs_grad_norms else None
        decided = self.decider.decide(self.decision_index, current, norms)
        self._check_agreement(decided)
        self._reset_grad_norms()
        if decided != current:
            self.transition(decided, epoch=epoch, step=step, grad_norms=norms)

    def _check_agreement(self, value: int) -> None:
        both = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.control)
        if both[0].item() != value or -both[1].item() != value:
            raise RuntimeError(f"ranks disagree on num_frozen_layers: {value} here, max {both[0].item()}, min {-both[1].item()}")

    # ------------------------------------------------------------------ transitions

    def transition(self, num_frozen_layers: int, *, epoch: int, step: int | None, grad_norms=None) -> Layout:
        """Move to the layout for `num_frozen_layers`. Collective: every rank, same order."""
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
        self.layout = new = self._resolve_micro_batches(new, epoch, step or 0)
        times["profile_s"] = self.profiler.take_seconds()
        t = time.perf_counter()
        self._build_runtime(states)
        dist.barrier(group=self.control)
        times["rebuild_s"] = time.perf_counter() - t

        record = {
            "kind": "transition",
            "epoch": epoch,
            "step": step,
            "global_step": self.global_step,
            "old_num_frozen_layers": old.plan.num_frozen_layers,
            "new_num_frozen_layers": new.plan.num_frozen_layers,
            "old_pipe_len": old.pipe_len,
            "new_pipe_len": new.pipe_len,
            "old_dp_degree": old.dp_degree,
            "new_dp_degree": new.dp_degree,
            "new_stage_ranges": [list(r) for r in new.plan.stage_ranges],
            "num_micro_batches": new.plan.num_micro_batches,
            "units_moved": len(transfers),
            "layer_grad_norms": grad_norms,
            **times,
            "total_s": sum(times.values()),
        }
        self.transitions.append(record)
        self.reporter.event(record)
        logger.info("transition: %s (%.3f s)", new.describe(), record["total_s"])
        return new

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

    # ------------------------------------------------------------------ model state

    def _designated_holder(self, unit: int) -> int:
        """The lowest rank holding `unit`: the one that reports it."""
        for rank in range(self.world.world_size):
            if unit in self.layout.units_of_rank(rank):
                return rank
        raise RuntimeError(f"no rank holds unit {unit}")

    def gather_state(self, include_optimizer: bool = False) -> tuple[dict, dict] | None:
        """The whole model's state dict (LayeredModel keys) and optimizer state by parameter
        name, assembled on rank 0 (None elsewhere). Collective."""
        mine: dict[str, torch.Tensor] = {}
        for index, unit in self.units.items():
            if self._designated_holder(index) == self.world.rank:
                for name, tensor in unit.state_dict().items():
                    mine[f"units.{index}.{name}"] = tensor.detach().cpu().clone()
        states = {}
        if include_optimizer:
            for name, state in optim.states_by_name(self.optimizer, self._named_params()).items():
                unit = int(name.split(".", 1)[0][1:])
                if self._designated_holder(unit) == self.world.rank:
                    states[name] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        gathered = [None] * self.world.world_size if self.world.rank == 0 else None
        dist.gather_object((mine, states), gathered, dst=0, group=self.control)
        if self.world.rank != 0:
            return None
        model_state: dict[str, torch.Tensor] = {}
        optimizer_state: dict[str, dict] = {}
        for part, part_states in gathered:
            model_state.update(part)
            for name, state in part_states.items():
                optimizer_state.setdefault(name, state)
        return model_state, optimizer_state

    def save_model(self, path: Path) -> None:
        """Write the trained model (all units) to `path` from rank 0. Collective."""
        gathered = self.gather_state()
        if gathered is not None:
            torch.save(gathered[0], path)
            logger.info("saved the model to %s", path)

    # ------------------------------------------------------------------ teardown

    def cleanup(self) -> None:
        self.runtime = None
        if getattr(self, "cache", None) is not None:
            self.cache.close()
            self.cache = None
        if self.groups is not None:
            self.groups.destroy()
        if getattr(self, "reporter", None) is not None:
            self.reporter.close()
        if dist.is_initialized():
            dist.destroy_process_group()
