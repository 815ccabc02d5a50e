"""Run outputs: metrics.jsonl, evaluations.jsonl, steps.jsonl, events.jsonl, summary.json,
the progress bar, and optionally TensorBoard and Weights & Biases.

Only the reporting rank (global rank 0) writes; every value it writes was reduced over the
ranks that own it before it got here. The JSON-lines files are always written; TensorBoard
(`logging.tensorboard`) and W&B (`logging.wandb`, offline with WANDB_MODE=offline) get the
same step and epoch values when their packages are installed. The progress bar is drawn on
a terminal only; where stderr is a file, the same progress is a log line at the step log
(every `trainer.log_interval_steps` steps), at most one every `trainer.progress_interval_s`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipetransformer.runs.records import (
    EpochMetrics,
    Evaluation,
    Event,
    RunSummary,
    StepMetrics,
)
from pipetransformer.utils.files import append_jsonl, write_json_atomic

logger = logging.getLogger(__name__)


def _numbers(record: dict[str, Any], skip: tuple[str, ...]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in skip
    }


def _clock_time(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_line(
    epoch: int, epochs: int, done: int, steps: int, rate_steps_per_s: float, record: StepMetrics
) -> str:
    """What the progress bar shows, as one log line: 'epoch 1/3: step 120/500 (24%), about
    1:38 left; loss 0.6931, 210.3 samples/s, frozen 0, pipe_len 2, dp_degree 1'."""
    left = (
        f", about {_clock_time((steps - done) / rate_steps_per_s)} left"
        if rate_steps_per_s > 0
        else ""
    )
    return (
        f"epoch {epoch + 1}/{epochs}: step {done}/{steps} ({100 * done // max(1, steps)}%)"
        f"{left}; loss {record.loss:.4f}, {record.samples_per_s:.1f} samples/s, "
        f"frozen {record.num_frozen_layers}, pipe_len {record.pipe_len}, "
        f"dp_degree {record.dp_degree}"
    )


class Reporter:
    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        progress_bar: bool,
        tensorboard: bool,
        wandb: bool = False,
        wandb_config: dict[str, Any] | None = None,
        *,
        progress_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        # On a terminal only: in a log file its carriage-return updates make one line of
        # thousands of characters. There, a progress line now and then instead.
        self.progress_bar = progress_bar and enabled and sys.stderr.isatty()
        self.progress_lines = progress_bar and enabled and not self.progress_bar
        self._progress_interval_s = progress_interval_s
        self._clock = clock
        self._last_line_s = clock()
        # The epoch in progress: (epoch, epochs, steps), steps done, and when and where in
        # it this attempt began (for the rate).
        self._epoch = (0, 1, 0)
        self._done = 0
        self._epoch_began: tuple[float, int] = (self._last_line_s, 0)
        self._bar = None
        self._tb = None
        self._wandb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                logger.warning(
                    "logging.tensorboard: the tensorboard package is not installed; skipping"
                )
        if enabled and wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                logger.warning(
                    "logging.wandb: the wandb package is not installed "
                    "(pip install wandb); skipping"
                )
            else:
                # The run's id (kept in RUN_DIR across resumes and restarts) names the W&B
                # run, so a resumed run continues its own W&B run and no other.
                run_id = run_dir / ".run_id"
                self._wandb = wandb_module.init(
                    project="pipetransformer",
                    name=run_dir.name,
                    dir=str(run_dir),
                    config=wandb_config or {},
                    resume="allow",
                    id=run_id.read_text().strip() if run_id.is_file() else None,
                )

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int = 0) -> None:
        self._epoch, self._done = (epoch, epochs, steps), done
        self._epoch_began = (self._clock(), done)
        if not self.progress_bar:
            return
        from tqdm import tqdm

        self._bar = tqdm(
            total=steps,
            initial=done,
            desc=f"epoch {epoch + 1}/{epochs}",
            unit="step",
            file=sys.stderr,
            leave=True,
            dynamic_ncols=True,
        )

    def step(self, **postfix: Any) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def log_step(self, record: StepMetrics) -> None:
        if not self.enabled:
            return
        values = record.to_dict()
        append_jsonl(self.run_dir / "steps.jsonl", values)
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{record.loss:.4f}",
                frozen=record.num_frozen_layers,
                pipe_len=record.pipe_len,
                dp_degree=record.dp_degree,
                refresh=False,
            )
        if self.progress_lines:
            self._progress_line(record)
        scalars = _numbers(values, skip=("global_step", "epoch"))
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"step/{key}", value, record.global_step)
        if self._wandb is not None:
            self._wandb.log({f"step/{k}": v for k, v in scalars.items()}, step=record.global_step)

    def _progress_line(self, record: StepMetrics) -> None:
        """The bar's progress as a log line, at most one every progress_interval_s; none at
        an epoch's end (its own line follows)."""
        epoch, epochs, steps = self._epoch
        now = self._clock()
        if self._done >= steps or now - self._last_line_s < self._progress_interval_s:
            return
        self._last_line_s = now
        began_s, began_done = self._epoch_began
        rate = (self._done - began_done) / max(1e-9, now - began_s)
        logger.info("%s", progress_line(epoch, epochs, self._done, steps, rate, record))

    def metrics(self, record: EpochMetrics) -> None:
        if not self.enabled:
            return
        values = record.to_dict()
        append_jsonl(self.run_dir / "metrics.jsonl", values)
        logger.info(
            "epoch %d: train_loss %.4f eval_metric %.4f, %.1f samples/s, "
            "frozen %d, pipe_len %d, dp_degree %d",
            record.epoch,
            record.train_loss,
            float("nan") if record.eval_metric is None else record.eval_metric,
            record.samples_per_s,
            record.num_frozen_layers,
            record.pipe_len,
            record.dp_degree,
        )
        scalars = _numbers(values, skip=("epoch", "global_step"))
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record.epoch)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(
                {f"epoch/{k}": v for k, v in scalars.items()} | {"epoch": record.epoch},
                step=record.global_step,
            )

    def evaluation(self, record: Evaluation) -> None:
        """One line of evaluations.jsonl (every evaluation, at an epoch's end or inside it)."""
        if self.enabled:
            append_jsonl(self.run_dir / "evaluations.jsonl", record.to_dict())

    def event(self, record: Event) -> None:
        if self.enabled:
            append_jsonl(self.run_dir / "events.jsonl", record.to_dict())

    def summary(self, record: RunSummary) -> None:
        if self.enabled:
            values = record.to_dict()
            write_json_atomic(self.run_dir / "summary.json", values)
            if self._wandb is not None:
                self._wandb.summary.update(_numbers(values, skip=()))

    def close(self) -> None:
        self.end_epoch()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
