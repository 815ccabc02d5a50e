"""What a text unit computes differently when its batch is packed (`data.padding: packed`,
utils/packing.py): samples laid end to end in rows, the padded batch's 2-D attention mask
replaced by per-token segment ids (0: padding at a row's end, k: the micro-batch's k-th
sample), and the sample starts riding after them.

Every unit takes what it takes unpadded plus the sample starts at the end (`packed(rest)`
says which), so the same units run either batch:
- attention stays inside a sample: a query attends to the keys of its own segment (the
  padding at a row's end to itself, so no row of the softmax is empty); what a sample's
  tokens compute is what they compute padded, where every padding key is masked;
- positions restart at each sample's first token (`positions_in_sample`), from which the
  embedding's absolute positions, RoBERTa's (offset by the padding index + 1) and
  ModernBERT's rotary tables are made; relative positions (DeBERTa) and sliding windows
  (ModernBERT) are differences of row positions, which within a sample are differences of
  its own positions, and attention never crosses a sample;
- a head reads each sample's own first token (`first_tokens`), or each sample's tokens
  (`sample_tokens`: question answering), in the micro-batch's sample order: its outputs
  are those of the padded batch, row for row.

Owns: those tensor functions. Must not: know a family's modules (the adapters call these).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def packed(rest: Sequence[torch.Tensor]) -> bool:
    """Whether a unit's inputs after (hidden or tokens, mask) are a packed batch's sample
    starts."""
    return len(rest) > 0


def positions_in_sample(segments: torch.Tensor) -> torch.Tensor:
    """(rows, length) int64: each token's position within its sample (from 0 at the
    sample's first token; a row's padding counts on from its own start)."""
    length = segments.shape[1]
    index = torch.arange(length, device=segments.device).expand_as(segments)
    begins = torch.ones_like(segments, dtype=torch.bool)
    begins[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(begins, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def same_sample(segments: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(rows, 1, length, length) bool: query i may attend to key j (the same segment, and
    with `window` at most that many positions apart)."""
    allowed = segments[:, None, :, None] == segments[:, None, None, :]
    if window is not None:
        index = torch.arange(segments.shape[1], device=segments.device)
        allowed = allowed & ((index[:, None] - index[None, :]).abs() <= window)
    return allowed


def attention_bias(
    config, hidden: torch.Tensor, segments: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """The 4-D mask a transformers attention module takes for a packed batch, in its
    attention implementation's form: SDPA's boolean, eager's additive (0 / the dtype's
    minimum), else what transformers' mask interface makes of the same mask function."""
    allowed = same_sample(segments, window)
    implementation = config._attn_implementation
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        blocked = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
        return blocked.masked_fill(~allowed, torch.finfo(hidden.dtype).min)
    from transformers.masking_utils import create_bidirectional_mask

    def inside(batch_idx, head_idx, q_idx, kv_idx):
        return allowed[batch_idx, 0, q_idx, kv_idx]

    bias = create_bidirectional_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, and_mask_function=inside
    )
    if bias is None:  # the implementation takes no mask (flash attention's kernels)
        raise ValueError(
            f"data.padding packed: attention '{implementation}' takes no mask, so attention "
            "would cross samples; use sdpa or eager"
        )
    return bias


def first_tokens(hidden: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """(samples, 1, ...) each sample's first token of a packed micro-batch's (rows, length,
    ...) hidden state: what a pooler that reads `hidden[:, 0]` takes."""
    flat = hidden.reshape(-1, *hidden.shape[2:])
    return flat.index_select(0, starts).unsqueeze(1)


def sample_tokens(values: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """(samples, length, ...) each sample's tokens of a packed micro-batch's (rows, length,
    ...) values, from its first on: its real tokens, then whatever follows them in the rows
    (the padded batch's padding positions, which question answering masks by the samples'
    real lengths: tasks/question_answering.py)."""
    rows, length = values.shape[:2]
    flat = values.reshape(rows * length, *values.shape[2:])
    index = starts[:, None] + torch.arange(length, device=starts.device)[None, :]
    taken = flat.index_select(0, index.clamp(max=rows * length - 1).reshape(-1))
    return taken.view(starts.shape[0], length, *values.shape[2:])


def sample_means(hidden: torch.Tensor, segments: torch.Tensor, samples: int) -> torch.Tensor:
    """(samples, hidden) the mean over each sample's tokens (ModernBERT's mean pooling)."""
    which = segments.reshape(-1)
    one_hot = which[None, :] == torch.arange(1, samples + 1, device=which.device)[:, None]
    weights = one_hot.to(hidden.dtype)
    sums = weights @ hidden.reshape(-1, hidden.shape[-1])
    return sums / weights.sum(dim=1, keepdim=True)
