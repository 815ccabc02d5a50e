"""Run outputs: metrics.jsonl, events.jsonl, summary.json, the progress bar, TensorBoard.

Only the reporting rank (global rank 0) writes; every value it writes was reduced over the
ranks that own it before it got here.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from pipetransformer.utils.files import append_jsonl, write_json_atomic

logger = logging.getLogger(__name__)


class Reporter:
    def __init__(self, run_dir: Path, enabled: bool, progress_bar: bool, tensorboard: bool) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.progress_bar = progress_bar and enabled
        self._bar = None
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                logger.warning("logging.tensorboard: the tensorboard package is not installed; skipping")

    def start_epoch(self, epoch: int, epochs: int, steps: int) -> None:
        if not self.progress_bar:
            return
        from tqdm import tqdm

        self._bar = tqdm(
            total=steps, desc=f"epoch {epoch + 1}/{epochs}", unit="step", file=sys.stderr, leave=True,
            dynamic_ncols=True,
        )

    def step(self, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def metrics(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        append_jsonl(self.run_dir / "metrics.jsonl", record)
        logger.info(
            "epoch %d: train_loss %.4f eval_metric %.4f, %.1f samples/s, frozen %d, pipe_len %d, dp_degree %d",
            record["epoch"], record["train_loss"],
            float("nan") if record.get("eval_metric") is None else record["eval_metric"],
            record["samples_per_s"], record["num_frozen_layers"], record["pipe_len"], record["dp_degree"],
        )
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "epoch":
                    self._tb.add_scalar(key, value, record["epoch"])
            self._tb.flush()

    def event(self, record: dict[str, Any]) -> None:
        if self.enabled:
            append_jsonl(self.run_dir / "events.jsonl", record)

    def summary(self, record: dict[str, Any]) -> None:
        if self.enabled:
            write_json_atomic(self.run_dir / "summary.json", record)

    def close(self) -> None:
        self.end_epoch()
        if self._tb is not None:
            self._tb.close()
