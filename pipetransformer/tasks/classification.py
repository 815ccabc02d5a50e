"""Classification: cross-entropy over the head's logits, scored from a confusion matrix
summed over every rank (accuracy, F1, macro F1, Matthews correlation).

Owns: `ClassificationTask` and its accumulator. Must not: know about layouts or the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipetransformer.autodp.control import Control
from pipetransformer.pipe.transfer import to_device
from pipetransformer.runs.records import EvalResult


def classification_scores(confusion: torch.Tensor) -> dict[str, float]:
    """accuracy, f1 (binary: of class 1), f1_macro and mcc (Matthews, multi-class form) of
    a confusion matrix (rows: true class, columns: predicted). A score whose denominator is
    zero (no positive predicted, one class only) is 0, as scikit-learn reports it."""
    c = confusion.double()
    total = float(c.sum())
    correct = float(c.diag().sum())
    true, predicted = c.sum(1), c.sum(0)
    denominators = true + predicted
    f1s = torch.where(denominators > 0, 2 * c.diag() / denominators.clamp(min=1), 0.0)
    scores = {"accuracy": correct / total}
    if c.shape[0] == 2:
        scores["f1"] = float(f1s[1])
    scores["f1_macro"] = float(f1s.mean())
    covariance = correct * total - float(true @ predicted)
    spread = (total**2 - float(predicted @ predicted)) * (total**2 - float(true @ true))
    scores["mcc"] = covariance / spread**0.5 if spread > 0 else 0.0
    return scores


class ClassificationAccumulator:
    """The eval set's confusion matrix and summed loss, kept on the device (no host read per
    batch); the metrics are computed from them once they are summed over every rank."""

    def __init__(self, num_classes: int, metric: str) -> None:
        self.metric = metric
        self.num_classes = num_classes
        self.totals: torch.Tensor | None = None  # flat confusion + loss sum, float64

    def add(
        self,
        logits: torch.Tensor,
        ids: Sequence[int],
        valid: Sequence[bool],
        labels: torch.Tensor,
        lengths: Sequence[int] | None = None,
    ) -> None:
        k = self.num_classes
        if self.totals is None:
            self.totals = torch.zeros(k * k + 1, dtype=torch.float64, device=logits.device)
        mask = to_device(torch.tensor(valid, dtype=torch.bool), logits.device)
        labels = to_device(labels, logits.device)
        pairs = labels * k + logits.argmax(-1)  # padding rows count with weight 0
        self.totals[: k * k].index_add_(0, pairs, mask.double())
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        self.totals[k * k] += (losses * mask).sum().double()

    def reduce(self, control: Control) -> EvalResult:
        """Collective (every rank calls it, adding nothing if it saw nothing)."""
        k = self.num_classes
        mine = [0.0] * (k * k + 1) if self.totals is None else self.totals.tolist()
        summed = control.all_sum(mine)
        confusion = torch.as_tensor(summed[:-1].tolist(), dtype=torch.float64).reshape(k, k)
        count = float(confusion.sum())
        if count == 0:
            raise RuntimeError("evaluation saw no samples")
        scores = classification_scores(confusion)
        return EvalResult(
            eval_metric=scores[self.metric],
            eval_samples=int(count),
            eval_loss=float(summed[-1]) / count,
            scores=scores,
        )


class ClassificationTask:
    name = "classification"

    def __init__(self, num_classes: int, metric: str = "auto") -> None:
        self.num_classes = num_classes
        self.metric_name = "accuracy" if metric == "auto" else metric

    @staticmethod
    def make_target(
        labels: torch.Tensor, weights: torch.Tensor, lengths: Sequence[int] | None = None
    ) -> torch.Tensor:
        return torch.stack([labels.float(), weights], dim=1)

    @staticmethod
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, weights = target[:, 0].long(), target[:, 1]
        return (F.cross_entropy(logits.float(), labels, reduction="none") * weights).sum()

    def new_accumulator(self, eval_extras: dict) -> ClassificationAccumulator:
        return ClassificationAccumulator(self.num_classes, self.metric_name)
