"""Tasks: how targets, losses and evaluation metrics look for each kind of model head.

Targets travel to the last stage as one float tensor per micro-batch that carries the
sample's loss weight (`make_target` also takes each sample's real length, which only
question answering needs: trainer/qa.py): `replicas / valid samples in the global batch`
for real samples, 0 for shape padding. With gradients summed over micro-batches and
averaged by DDP over the replicas, the update is exactly the mean over the global batch's
real samples, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipetransformer.autodp.control import Control
from pipetransformer.pipe.transfer import to_device
from pipetransformer.runs.records import EvalResult


def loss_weights(valid: Sequence[bool], dp_degree: int, global_num_valid: int) -> torch.Tensor:
    scale = dp_degree / max(1, global_num_valid)
    return torch.tensor([scale if v else 0.0 for v in valid], dtype=torch.float32)


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


def regression_scores(predicted: torch.Tensor, true: torch.Tensor) -> dict[str, float]:
    """pearson, spearman (Pearson of the ranks, ties at their average rank, as scipy's
    spearmanr) and mse of predictions against true values. A correlation with a constant
    side is 0 (scipy gives nan, which no best checkpoint could follow)."""
    from scipy.stats import rankdata

    def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x - x.mean(), y - y.mean()
        spread = float((x @ x) * (y @ y))
        return float(x @ y) / spread**0.5 if spread > 0 else 0.0

    predicted, true = predicted.double(), true.double()
    ranks = [torch.as_tensor(rankdata(v.numpy()), dtype=torch.float64) for v in (predicted, true)]
    return {
        "pearson": pearson(predicted, true),
        "spearman": pearson(*ranks),
        "mse": float(((predicted - true) ** 2).mean()),
    }


class RegressionAccumulator:
    """Each eval sample's prediction and target by sample id (zeros for the ids other ranks
    evaluate), kept on the device (no host read per batch); summed over every rank they
    are the whole eval set's, which the correlations need (a rank correlation cannot be
    summed from per-rank parts)."""

    def __init__(self, eval_samples: int, metric: str) -> None:
        self.metric = metric
        self.eval_samples = eval_samples
        # Rows: prediction, target, how often the id was evaluated (once, over all ranks).
        self.columns: torch.Tensor | None = None

    def add(
        self,
        outputs: torch.Tensor,
        ids: Sequence[int],
        valid: Sequence[bool],
        labels: torch.Tensor,
        lengths: Sequence[int] | None = None,
    ) -> None:
        device = outputs.device
        if self.columns is None:
            self.columns = torch.zeros(3, self.eval_samples, dtype=torch.float64, device=device)
        weight = to_device(torch.tensor(valid, dtype=torch.float64), device)
        at = to_device(torch.tensor(list(ids), dtype=torch.long), device)
        predicted = outputs.detach().double().reshape(-1)
        target = to_device(labels, device).double().reshape(-1)
        # Padding rows (weight 0) add nothing at the id they borrow.
        self.columns.index_add_(
            1, at, torch.stack([predicted, target, torch.ones_like(weight)]) * weight
        )

    def reduce(self, control: Control) -> EvalResult:
        """Collective (every rank calls it, adding nothing if it saw nothing)."""
        mine = self.columns if self.columns is not None else torch.zeros(3, self.eval_samples)
        summed = control.all_sum(mine.double().flatten()).reshape(3, -1)
        seen = summed[2] > 0
        count = int(seen.sum())
        if count == 0:
            raise RuntimeError("evaluation saw no samples")
        if bool((summed[2] > 1).any()):
            raise RuntimeError("an eval sample was evaluated twice")
        scores = regression_scores(summed[0][seen], summed[1][seen])
        return EvalResult(
            eval_metric=scores[self.metric],
            eval_samples=count,
            eval_loss=scores["mse"],
            scores=scores,
        )


class RegressionTask:
    """One output per sample, the mean squared error; eval_metric Pearson's r (or
    data.metric spearman)."""

    name = "regression"

    def __init__(self, eval_samples: int, metric: str = "auto") -> None:
        self.eval_samples = eval_samples
        self.metric_name = "pearson" if metric == "auto" else metric

    @staticmethod
    def make_target(
        values: torch.Tensor, weights: torch.Tensor, lengths: Sequence[int] | None = None
    ) -> torch.Tensor:
        return torch.stack([values.float(), weights], dim=1)

    @staticmethod
    def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        values, weights = target[:, 0], target[:, 1]
        return (((outputs.float().reshape(-1) - values) ** 2) * weights).sum()

    def new_accumulator(self, eval_extras: dict) -> RegressionAccumulator:
        return RegressionAccumulator(self.eval_samples, self.metric_name)


def task_for(name: str, num_classes: int = 2, metric: str = "auto", eval_samples: int = 0):
    """The task of a DataBundle's `task`; a classifier's or a regression's eval_metric is
    data.metric (a regression's accumulator holds a prediction for each of the
    `eval_samples`)."""
    if name == "classification":
        return ClassificationTask(num_classes, metric)
    if name == "regression":
        return RegressionTask(eval_samples, metric)
    if name == "question_answering":
        from pipetransformer.trainer.qa import QuestionAnsweringTask

        return QuestionAnsweringTask()
    raise ValueError(f"unknown task '{name}'")
