"""The question-answering task: span targets, the span loss and SQuAD evaluation.

Targets travel to the last stage as (start, end, weight, real length) per feature, the
weight `loss_weights` (tasks/__init__.py: the update is the mean over the global batch's
real features).
Padding positions take no part in the span softmax: their logits are masked out of the
loss, and out of the logits evaluation keeps, so a batch padded to its longest feature
trains and scores exactly as one padded to max_seq_length (data.padding). Evaluation
cannot be reduced by sums: a question's answer is chosen over all of its features, which
the eval sampler spreads over replicas. So every last-stage rank keeps its features'
logits, rank 0 of the control group gathers them all, post-processes and scores the whole
eval set, and broadcasts the scores.

Owns: `QuestionAnsweringTask` and its accumulator.
Must not: know about layouts or the pipeline; scoring itself is `data.squad_metric`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetransformer.autodp.control import Control
from pipetransformer.data.squad_metric import postprocess_predictions, squad_evaluate
from pipetransformer.pipe.transfer import to_device
from pipetransformer.runs.records import EvalResult

logger = logging.getLogger(__name__)

EXTRAS_KEYS = ("feature_example_index", "feature_offsets", "examples")
# The logit a padding position gets: no span starts or ends there.
MASKED_LOGIT = torch.finfo(torch.float32).min


def mask_padding(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(n, seq, 2) float32 span logits with every position at or past its feature's real
    length set to MASKED_LOGIT."""
    positions = torch.arange(logits.shape[1], device=logits.device)
    padding = positions[None, :] >= lengths.to(logits.device)[:, None]
    return logits.masked_fill(padding.unsqueeze(-1), MASKED_LOGIT)


class QuestionAnsweringAccumulator:
    """This rank's eval logits by feature id; `reduce` scores all ranks' together."""

    def __init__(
        self, eval_extras: dict[str, Any], n_best_size: int = 20, max_answer_length: int = 30
    ) -> None:
        missing = [key for key in EXTRAS_KEYS if eval_extras.get(key) is None]
        if missing:
            raise ValueError(
                f"question answering evaluation needs eval_extras {missing} (from data.squad)"
            )
        self.extras = eval_extras
        # Every feature's logits are kept at max_seq_length (its offsets' width).
        self.max_length = np.asarray(eval_extras["feature_offsets"]).shape[1]
        self.n_best_size = n_best_size
        self.max_answer_length = max_answer_length
        self.feature_ids: list[int] = []
        # float32 on the device, batch by batch, brought to the host once by `reduce` (a
        # copy per batch waited for the device each time): exactly what scoring all
        # features in one process would see. SQuAD's dev set at 384 tokens: about 33 MB.
        self.logits: list[torch.Tensor] = []

    def add(
        self,
        logits: torch.Tensor,
        ids: Sequence[int],
        valid: Sequence[bool],
        targets: torch.Tensor | None = None,
        lengths: Sequence[int] | None = None,
    ) -> None:
        """Keep the (seq, 2) logits of the valid features in this batch, padding positions
        masked (`lengths`: each feature's real length) and padded to max_seq_length
        (targets unused)."""
        keep = [row for row, is_valid in enumerate(valid) if is_valid]
        if not keep:
            return
        rows = to_device(torch.tensor(keep, dtype=torch.long), logits.device)
        kept = logits.detach()[rows].float()
        if lengths is not None:
            real = to_device(torch.tensor([lengths[row] for row in keep]), logits.device)
            kept = mask_padding(kept, real)
        if kept.shape[1] < self.max_length:
            kept = F.pad(kept, (0, 0, 0, self.max_length - kept.shape[1]), value=MASKED_LOGIT)
        self.logits.append(kept)
        self.feature_ids.extend(int(ids[row]) for row in keep)

    def reduce(self, control: Control) -> EvalResult:
        """Collective: every rank calls it and gets the same scores."""
        group = control.group
        mine = (
            np.asarray(self.feature_ids, dtype=np.int64),
            torch.cat(self.logits).cpu().numpy() if self.logits else None,
        )
        if group is None:  # one process
            return self._score([mine])
        is_root = dist.get_rank(group) == 0
        gathered: list[Any] | None = [None] * dist.get_world_size(group) if is_root else None
        dist.gather_object(mine, gathered, group=group, group_dst=0)
        result: list[Any] = [None]
        if is_root:
            try:
                result[0] = self._score(gathered)
            except Exception as exc:  # every rank must leave the broadcast, then raise
                result[0] = RuntimeError(f"question answering evaluation failed: {exc}")
        dist.broadcast_object_list(result, group=group, group_src=0)
        if isinstance(result[0], Exception):
            raise result[0]
        return result[0]

    def _score(self, gathered: list[tuple[np.ndarray, np.ndarray | None]]) -> EvalResult:
        feature_ids = np.concatenate([ids for ids, _ in gathered])
        parts = [logits for _, logits in gathered if logits is not None]
        if feature_ids.size == 0:
            raise RuntimeError("evaluation saw no samples")
        logits = np.concatenate(parts)
        # A feature seen twice (it should not be) counts once: unique keeps the first.
        feature_ids, first = np.unique(feature_ids, return_index=True)
        logits = logits[first]
        example_index = np.asarray(self.extras["feature_example_index"])[feature_ids]
        offsets = np.asarray(self.extras["feature_offsets"])[feature_ids]
        total = len(self.extras["feature_example_index"])
        if feature_ids.size != total:
            logger.warning(
                "scoring %d of %d eval features; questions left without any score 0",
                feature_ids.size,
                total,
            )
        examples = self.extras["examples"]
        predictions = postprocess_predictions(
            logits[..., 0],
            logits[..., 1],
            example_index,
            offsets,
            examples,
            n_best_size=self.n_best_size,
            max_answer_length=self.max_answer_length,
        )
        scores = squad_evaluate({e["id"]: e["answers"] for e in examples}, predictions)
        return EvalResult(
            eval_metric=scores["f1"], eval_samples=len(examples), exact_match=scores["exact_match"]
        )


class QuestionAnsweringTask:
    name = "question_answering"
    metric_name = "f1"

    @staticmethod
    def make_target(
        positions: torch.Tensor, weights: torch.Tensor, lengths: Sequence[int] | None = None
    ) -> torch.Tensor:
        """(n, 2) start/end token positions + (n,) weights + the features' real lengths ->
        (n, 4) float (without lengths, nothing is masked: every position counts)."""
        if lengths is None:
            lengths = [torch.iinfo(torch.int32).max] * positions.shape[0]
        real = torch.tensor(list(lengths), dtype=torch.float32).unsqueeze(1)
        return torch.cat([positions.float(), weights.float().unsqueeze(1), real], dim=1)

    @staticmethod
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Sum over features of weight * (start CE + end CE) / 2, as BertForQuestionAnswering
        averages the two (its batch mean is the weight 1/batch), over the real positions
        only (padding masked: module docstring)."""
        logits = mask_padding(logits.float(), target[:, 3])
        start, end, weights = target[:, 0].long(), target[:, 1].long(), target[:, 2].float()
        start_loss = F.cross_entropy(logits[..., 0], start, reduction="none")
        end_loss = F.cross_entropy(logits[..., 1], end, reduction="none")
        return ((start_loss + end_loss) / 2 * weights).sum()

    @staticmethod
    def new_accumulator(eval_extras: dict[str, Any]) -> QuestionAnsweringAccumulator:
        return QuestionAnsweringAccumulator(eval_extras)
