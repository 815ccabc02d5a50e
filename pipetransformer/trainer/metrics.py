"""Every counter of a run, kept in one place, reset in one place, and when they are logged.

Three intervals are counted: the step log (`trainer.log_interval_steps`: loss and samples
per second to steps.jsonl), the epoch (loss, training seconds, transitions, DDP
communication: one line of metrics.jsonl) and the freeze decision interval (per-unit
squared gradient norms, steps, training seconds: the freeze signal, its sums kept by
freeze_signal.py's `GradNormInterval`, which the integrations share). Per-step values stay
on the device (no host synchronisation in a step); they are reduced over the ranks, on the
control group, only when logged, at an epoch's end, at a decision and for a checkpoint.

A checkpoint written inside an interval carries what was counted so far, reduced (the
`RunState`'s partial sums); `snapshot` gives that state without resetting anything, and a
resumed run starts its counters from it.

Owns: the counters and `due` of the step log. Must not: decide when an epoch or a decision
happens (the clock and the freeze control do) or compute what it counts (the step runner).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.topology import Layout
from pipetransformer.freeze_signal import GradNormInterval
from pipetransformer.pipe.timing import IntervalTimer
from pipetransformer.runs.records import CacheCounters, EpochMetrics, EvalResult, StepMetrics
from pipetransformer.runs.reporting import Reporter
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.clock import Tick


@dataclass(frozen=True)
class StepResult:
    """What one step of this rank produced (the step runner's output)."""

    layout: Layout
    started_s: float  # perf_counter at the step's start
    marks: tuple[object, object]  # the step's start and end on the device (IntervalTimer.mark)
    samples: int  # valid samples in the global batch
    replica_loss: (
        torch.Tensor | None
    )  # this replica's summed per-sample loss (last stage), on the device
    unit_grad_sq: (
        torch.Tensor | None
    )  # per unit, squared norm of the gradients applied, on the device
    padded_tokens: int = 0  # tokens the global step computed (text; every rank counts them)


@dataclass(frozen=True)
class FreezeSignal:
    layer_grad_norms: list[float] | None  # RMS per layer over the interval; None: not gathered
    steps: int
    step_s: float  # this rank's mean seconds of a training step in the interval


class MetricsTracker:
    def __init__(
        self,
        *,
        control: Control,
        reporter: Reporter,
        num_layers: int,
        num_units: int,
        num_train_samples: int,
        device: torch.device,
        num_train_tokens: int = 0,
        log_interval_steps: int,
        carried: RunState,
    ) -> None:
        """`carried`: the run state a resumed run starts from; the tracker takes its partial
        sums (they are the tracker's to count from here on, and `snapshot` puts them back)."""
        self.control = control
        self.reporter = reporter
        self.num_layers = num_layers
        self.num_units = num_units
        self.num_train_samples = num_train_samples
        self.num_train_tokens = num_train_tokens  # real tokens of an epoch (text)
        self.device = device
        self.log_interval_steps = log_interval_steps
        # Device time, read only where the counters are (decisions, epoch ends): a step's
        # interval and DDP's all-reduces (marked by the stage runtime's comm hook).
        self.step_timer = IntervalTimer(device)
        self.comm_timer = IntervalTimer(device)
        self._reset_log(time.perf_counter())
        self._reset_epoch()
        # The decision interval: the freeze signal's bookkeeping, shared with the
        # integrations (freeze_signal.py), and the interval's training seconds.
        self.grad_norms = GradNormInterval(
            num_layers, device, carried.interval_grad_sq, carried.interval_steps
        )
        self._decision_train_s = 0.0
        # Sums of intervals begun in an earlier attempt, already reduced over the ranks.
        self._carried_epoch = (
            carried.epoch_loss_sum,
            carried.epoch_train_s,
            carried.epoch_transition_s,
            carried.epoch_comm_s,
        )
        self._epoch_padded_tokens = carried.epoch_padded_tokens
        self._epoch_eval_s = carried.epoch_eval_s
        carried.epoch_eval_s = 0.0
        carried.epoch_loss_sum = carried.epoch_train_s = carried.epoch_transition_s = (
            carried.epoch_comm_s
        ) = 0.0
        carried.epoch_padded_tokens = 0
        carried.interval_grad_sq, carried.interval_steps = [], 0

    # ------------------------------------------------------------------ resets, one each

    def _reset_log(self, now: float) -> None:
        self._log_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._log_samples = 0
        self._log_started = now

    def _reset_epoch(self) -> None:
        self._epoch_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._epoch_started: float | None = None  # the clock runs from the epoch's first step
        self._epoch_excluded_s = 0.0
        self._epoch_transition_s = 0.0
        self._epoch_comm_s = 0.0
        self._epoch_padded_tokens = 0  # every rank counts the global step's
        self._epoch_eval_s = 0.0  # evaluations inside the epoch (trainer.evals_per_epoch)
        self._carried_epoch = (0.0, 0.0, 0.0, 0.0)
        self._bar_epoch: int | None = None

    def _reset_decision(self) -> None:
        self.grad_norms.reset()
        self._decision_train_s = 0.0
        self.step_timer.take()

    # ------------------------------------------------------------------ counting

    def record(self, tick: Tick, result: StepResult) -> None:
        """Count one step (no host synchronisation)."""
        if self._epoch_started is None:
            self._epoch_started = result.started_s
        if self._bar_epoch != tick.epoch:
            self.reporter.start_epoch(
                tick.epoch, tick.epochs, tick.steps_per_epoch, tick.step_in_epoch
            )
            self._bar_epoch = tick.epoch
        if result.replica_loss is not None:
            self._log_loss += result.replica_loss
            self._epoch_loss += result.replica_loss
        self.grad_norms.add(result.unit_grad_sq)
        self._log_samples += result.samples
        self._epoch_padded_tokens += result.padded_tokens
        self.step_timer.add(*result.marks)
        layout = result.layout
        self.reporter.step(
            frozen=layout.plan.num_frozen_layers,
            pipe_len=layout.pipe_len,
            dp_degree=layout.dp_degree,
        )

    def _drain_timers(self) -> None:
        """Read the device timers into the interval sums (waits for the device on CUDA: only
        where a collective reads the counters anyway, never per step)."""
        self._decision_train_s += self.step_timer.take()
        self._epoch_comm_s += self.comm_timer.take()

    def add_transition(self, seconds: float) -> None:
        self._epoch_transition_s += seconds

    def exclude(self, seconds: float) -> None:
        """Seconds inside the epoch that were not training (a checkpoint write)."""
        if self._epoch_started is not None:
            self._epoch_excluded_s += seconds

    def add_evaluation(self, seconds: float) -> None:
        """An evaluation inside the epoch (not at its end): off its training time, into its
        evaluation time."""
        self.exclude(seconds)
        self._epoch_eval_s += seconds

    @property
    def steps_since_decision(self) -> int:
        return self.grad_norms.steps

    # ------------------------------------------------------------------ reporting

    def due(self, tick: Tick) -> bool:
        """Whether the step log is written after this step."""
        return tick.global_step % self.log_interval_steps == 0 or tick.epoch_end

    def log_steps(
        self, tick: Tick, layout: Layout, lr: float, layer_lrs: list[float] | None = None
    ) -> None:
        """steps.jsonl (and TensorBoard / W&B): the mean loss of the steps since the last
        line. Collective; the one place a step's loss leaves the device. `layer_lrs`: each
        layer's rate under layer-wise annealing."""
        loss = self.control.sum(self._log_loss) / max(1, self._log_samples)
        now = time.perf_counter()  # after the loss reached the host: the steps are done
        self._drain_timers()
        self.reporter.log_step(
            StepMetrics(
                global_step=tick.global_step,
                epoch=tick.epoch + 1,
                loss=loss,
                lr=lr,
                samples_per_s=self._log_samples / max(1e-9, now - self._log_started),
                num_frozen_layers=layout.plan.num_frozen_layers,
                pipe_len=layout.pipe_len,
                dp_degree=layout.dp_degree,
                layer_lrs=layer_lrs,
            )
        )
        self._reset_log(now)

    def end_epoch(
        self,
        tick: Tick,
        layout: Layout,
        *,
        lr: float,
        evaluation: EvalResult | None,
        eval_s: float,
        cache: CacheCounters | None,
        cache_active: bool,
    ) -> None:
        """The epoch's line of metrics.jsonl (collective); starts the next epoch's counters."""
        self.reporter.end_epoch()
        loss_sum, train_s, transition_s, comm_s = self._epoch_partials(time.perf_counter() - eval_s)
        cache = cache or CacheCounters()
        plan = layout.plan
        self.reporter.metrics(
            EpochMetrics(
                epoch=tick.epoch + 1,
                global_step=tick.global_step,
                train_loss=loss_sum / self.num_train_samples,
                eval_metric=evaluation.eval_metric if evaluation else None,
                eval_loss=evaluation.eval_loss if evaluation else None,
                eval_samples=evaluation.eval_samples if evaluation else None,
                exact_match=evaluation.exact_match if evaluation else None,
                scores=evaluation.scores if evaluation else None,
                samples_per_s=self.num_train_samples / train_s,
                epoch_time_s=train_s,
                eval_time_s=self._epoch_eval_s + eval_s,
                transition_time_s=transition_s,
                ddp_comm_s=comm_s,
                ddp_comm_share=comm_s / train_s,
                num_frozen_layers=plan.num_frozen_layers,
                pipe_len=plan.pipe_len,
                dp_degree=layout.dp_degree,
                num_micro_batches=plan.num_micro_batches,
                lr=lr,
                cache_active=cache_active,
                sharded=layout.sharded,
                virtual_stages=plan.virtual_stages,
                real_tokens=self.num_train_tokens,
                padded_tokens=self._epoch_padded_tokens,
                **dataclasses.asdict(cache),
            )
        )
        self._reset_epoch()

    def _epoch_partials(self, now: float) -> tuple[float, float, float, float]:
        """The epoch so far, this attempt's part reduced over the ranks plus the carried part
        (collective): loss sum, training seconds (this rank's), transition seconds and DDP
        communication seconds (mean over the ranks that ran DDP)."""
        loss, train, transition, comm = self._carried_epoch
        self._drain_timers()
        ran_ddp = 1.0 if self._epoch_comm_s > 0 else 0.0
        totals = self.control.all_sum(
            torch.stack(
                [
                    self._epoch_loss.detach().to("cpu", torch.float64),
                    torch.tensor(self._epoch_comm_s, dtype=torch.float64),
                    torch.tensor(ran_ddp, dtype=torch.float64),
                ]
            )
        )
        if self._epoch_started is not None:
            train += max(0.0, now - self._epoch_started - self._epoch_excluded_s)
        comm += float(totals[1] / totals[2]) if totals[2] > 0 else 0.0
        return loss + float(totals[0]), train, transition + self._epoch_transition_s, comm

    def freeze_signal(self, dp_degree: int, with_norms: bool) -> FreezeSignal:
        """The decision interval's signal (collective when `with_norms`); starts the next
        interval. Norms: per layer, the RMS over the interval's steps of the gradient norm,
        reduced over the replicas (which hold the same, DDP-averaged, gradients)."""
        interval = self.grad_norms
        norms = interval.layer_norms(self.control.all_sum, dp_degree) if with_norms else None
        self._drain_timers()
        step_s = self._decision_train_s / max(1, interval.counted)
        signal = FreezeSignal(norms, interval.steps, step_s)
        self._reset_decision()
        return signal

    def snapshot(self, state: RunState, dp_degree: int) -> RunState:
        """`state` as a checkpoint holds it: with the partial sums of the epoch and of the
        decision interval in progress, reduced over the ranks (collective). Changes nothing."""
        loss, train, transition, comm = self._epoch_partials(time.perf_counter())
        return dataclasses.replace(
            state,
            epoch_loss_sum=loss,
            epoch_train_s=train,
            epoch_transition_s=transition,
            epoch_comm_s=comm,
            epoch_padded_tokens=self._epoch_padded_tokens,
            epoch_eval_s=self._epoch_eval_s,
            interval_grad_sq=self.grad_norms.unit_squares(self.control.all_sum, dp_degree),
            interval_steps=self.steps_since_decision,
        )
