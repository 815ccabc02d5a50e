"""Regression: one output per sample, the mean squared error; scored by Pearson's r,
Spearman's rank correlation and the mse over the whole eval set.

Owns: `RegressionTask` and its accumulator. Must not: know about layouts or the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipetransformer.autodp.control import Control
from pipetransformer.pipe.transfer import to_device
from pipetransformer.runs.records import EvalResult


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
