"""Tasks: how targets, losses and evaluation metrics look for each kind of model head.

Targets travel to the last stage as one float tensor per micro-batch whose last column is
the sample's loss weight: `replicas / valid samples in the global batch` for real samples,
0 for shape padding. With gradients summed over micro-batches and averaged by DDP over the
replicas, the update is exactly the mean over the global batch's real samples, whatever
the layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipetransformer.pipe.transfer import to_device
from pipetransformer.trainer.control import Control
from pipetransformer.trainer.records import EvalResult


def loss_weights(valid: Sequence[bool], dp_degree: int, global_num_valid: int) -> torch.Tensor:
    scale = dp_degree / max(1, global_num_valid)
    return torch.tensor([scale if v else 0.0 for v in valid], dtype=torch.float32)


class ClassificationAccumulator:
    """Correct predictions and the loss summed on the device, batch by batch; read on the
    host once, by `reduce` (per batch it was three reads, each a wait for the device)."""

    def __init__(self) -> None:
        self.count = 0  # valid samples: known on the host
        self.totals: torch.Tensor | None = None  # (correct, loss sum), float64 on the device

    def add(
        self, logits: torch.Tensor, ids: Sequence[int], valid: Sequence[bool], labels: torch.Tensor
    ) -> None:
        mask = to_device(torch.tensor(valid, dtype=torch.bool), logits.device)
        labels = to_device(labels, logits.device)
        correct = ((logits.argmax(-1) == labels) & mask).sum()
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        batch = torch.stack([correct.double(), (losses * mask).sum().double()])
        self.totals = batch if self.totals is None else self.totals + batch
        self.count += sum(bool(v) for v in valid)

    def reduce(self, control: Control) -> EvalResult:
        """Collective (every rank calls it, adding nothing if it saw nothing)."""
        correct, loss_sum = (0.0, 0.0) if self.totals is None else self.totals.tolist()
        correct, count, loss_sum = control.all_sum([correct, self.count, loss_sum]).tolist()
        if count == 0:
            raise RuntimeError("evaluation saw no samples")
        return EvalResult(
            eval_metric=correct / count, eval_samples=int(count), eval_loss=loss_sum / count
        )


class ClassificationTask:
    name = "classification"
    metric_name = "accuracy"

    @staticmethod
    def make_target(labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.stack([labels.float(), weights], dim=1)

    @staticmethod
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, weights = target[:, 0].long(), target[:, 1]
        return (F.cross_entropy(logits.float(), labels, reduction="none") * weights).sum()

    @staticmethod
    def new_accumulator(eval_extras: dict) -> ClassificationAccumulator:
        return ClassificationAccumulator()


def task_for(name: str):
    if name == "classification":
        return ClassificationTask()
    if name == "question_answering":
        from pipetransformer.trainer.qa import QuestionAnsweringTask

        return QuestionAnsweringTask()
    raise ValueError(f"unknown task '{name}'")
