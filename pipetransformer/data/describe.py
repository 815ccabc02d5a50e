"""What a run read from its data, in one line for its start: the table's columns and where
evaluation comes from (DataBundle.read_from), the task, each label's count in the training
split, and both splits' sizes after any subset, so a mistake in the columns or the labels
shows before the first epoch ends.

Owns: that line. Must not: read the data again (it counts the bundle's targets).
"""

from __future__ import annotations

import torch

from pipetransformer.data.base import DataBundle

# Up to this many classes the line lists each with its count (the class id where the
# classes have no names).
MAX_LABELS_LISTED = 20


def describe_bundle(bundle: DataBundle) -> str:
    """'text column 'review', label column 'stars' of reviews.csv; evaluation: 30 rows held
    out of the training split (...); classification, 3 labels: bad 120, good 300, ok 80;
    270 training samples, 30 evaluation samples'."""
    parts = [bundle.read_from] if bundle.read_from else []
    if bundle.task == "classification" and bundle.num_classes <= MAX_LABELS_LISTED:
        names = bundle.label_names or [str(c) for c in range(bundle.num_classes)]
        targets = bundle.train.targets(range(len(bundle.train)))
        counts = torch.bincount(targets.long(), minlength=len(names)).tolist()
        labels = ", ".join(f"{n} {c}" for n, c in zip(names, counts))
        parts.append(f"classification, {len(names)} labels: {labels}")
    elif bundle.task == "classification":  # ImageNet's thousand: a count, not a list
        parts.append(f"classification, {bundle.num_classes} labels")
    else:
        parts.append(bundle.task.replace("_", " "))
    parts.append(f"{len(bundle.train)} training samples, {len(bundle.eval)} evaluation samples")
    if bundle.subsets:  # a subset is said with what it was taken from
        parts.append(bundle.subsets)
    return "; ".join(parts)
