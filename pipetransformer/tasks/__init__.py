"""Tasks: how targets, losses and evaluation metrics look for each kind of model head.

Targets travel to the last stage as one float tensor per micro-batch that carries the
sample's loss weight (`make_target` also takes each sample's real length, which only
question answering needs: question_answering.py): `replicas / valid samples in the global batch`
for real samples, 0 for shape padding. With gradients summed over micro-batches and
averaged by DDP over the replicas, the update is exactly the mean over the global batch's
real samples, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipetransformer.tasks.classification import (
    ClassificationAccumulator,
    ClassificationTask,
    classification_scores,
)
from pipetransformer.tasks.question_answering import (
    QuestionAnsweringAccumulator,
    QuestionAnsweringTask,
)
from pipetransformer.tasks.regression import (
    RegressionAccumulator,
    RegressionTask,
    regression_scores,
)


def loss_weights(valid: Sequence[bool], dp_degree: int, global_num_valid: int) -> torch.Tensor:
    scale = dp_degree / max(1, global_num_valid)
    return torch.tensor([scale if v else 0.0 for v in valid], dtype=torch.float32)


def task_for(name: str, num_classes: int = 2, metric: str = "auto", eval_samples: int = 0):
    """The task of a DataBundle's `task`; a classifier's or a regression's eval_metric is
    data.metric (a regression's accumulator holds a prediction for each of the
    `eval_samples`)."""
    if name == "classification":
        return ClassificationTask(num_classes, metric)
    if name == "regression":
        return RegressionTask(eval_samples, metric)
    if name == "question_answering":
        return QuestionAnsweringTask()
    raise ValueError(f"unknown task '{name}'")


__all__ = [
    "ClassificationAccumulator",
    "ClassificationTask",
    "QuestionAnsweringAccumulator",
    "QuestionAnsweringTask",
    "RegressionAccumulator",
    "RegressionTask",
    "classification_scores",
    "loss_weights",
    "regression_scores",
    "task_for",
]
