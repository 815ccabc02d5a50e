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

On a GPU, BERT-like attention units (models/bert.py) run a packed batch through
variable-length attention instead of a block-diagonal mask, whose cost grows with the square
of a row's length whatever the samples in it: the row's tokens are one flat sequence, cut at
`varlen_offsets` (every sample, and the padding at each row's end, a sequence of its own),
and attention runs within each piece (`varlen_attention`: flash-attention's varlen kernel
where the `flash_attn` package is installed, else SDPA over a nested jagged tensor). The
dense mask stays the CPU's path and the fallback of every other family. A family whose
units have no variable-length path cannot take a packed batch under an attention
implementation that takes no mask (`packed_refusal`: flash attention): data.padding auto
pads per batch there, and packed is refused (config/data.py `resolve_padding`).

Owns: those tensor functions. Must not: know a family's modules (the adapters call these).
"""

from __future__ import annotations

import importlib.util
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


# Families whose attention units take a packed batch under any attention implementation:
# the dense mask where it takes one, variable-length attention where it does not (bert.py).
VARLEN_FAMILIES = ("bert", "roberta", "xlm-roberta", "electra")


def packed_refusal(model) -> str | None:
    """Why the units of `model` (a LayeredModel) cannot run a packed batch (None: they can,
    or it has no text): `refusal_for` its family and its library model's attention."""
    if not model.spec.text:
        return None
    library_config = getattr(getattr(model, "source", None), "config", None)
    implementation = getattr(library_config, "_attn_implementation", None)
    return refusal_for(model.spec.family, implementation)


def refusal_for(family: str, implementation: str | None) -> str | None:
    """Why units of `family` under attention `implementation` cannot run a packed batch
    (None: they can): an implementation that takes no mask (flash attention's kernels),
    in a family without a variable-length path."""
    if implementation is None or "flash" not in implementation or family in VARLEN_FAMILIES:
        return None
    return (
        f"attention '{implementation}' takes no mask and {family}'s units have no "
        "variable-length path"
    )


# flash-attention's kernels, where its package is installed (registered as torch custom
# ops: dynamo compiles them into a unit's graph).
FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None


def use_varlen(hidden: torch.Tensor) -> bool:
    """Whether a packed batch runs variable-length attention: on CUDA (the dense mask on the
    CPU), by flash-attention's kernels in half precision, or else by SDPA over nested
    tensors when not compiled (dynamo breaks a unit's graph at a nested tensor made inside
    it: a compiled unit keeps the dense mask there)."""
    if not hidden.is_cuda:
        return False
    return (FLASH_ATTN_INSTALLED and _half(hidden)) or not torch.compiler.is_compiling()


def _half(hidden: torch.Tensor) -> bool:
    """Whether attention runs in float16 or bfloat16 (the hidden state's, or autocast's)."""
    half = (torch.float16, torch.bfloat16)
    kind = hidden.device.type
    autocast = torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) in half
    return hidden.dtype in half or autocast


def varlen_offsets(segments: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """(samples + rows + 1,) int64: where each piece of a packed micro-batch's flat
    rows * row_length tokens begins, and their end: every sample's first token (each row's
    first token is one, an empty row's excepted), where each row's padding begins (a full
    row's padding is empty: a piece of no tokens), and the end of the last row. Computed on
    the device, sized by the shape alone: no value is read on the host."""
    rows, length = segments.shape
    used = (segments != 0).sum(dim=1)
    padding = torch.arange(rows, device=segments.device) * length + used
    end = torch.full((1,), rows * length, dtype=torch.long, device=segments.device)
    return torch.cat([starts.long(), padding, end]).sort().values


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offsets: torch.Tensor,
    max_length: int,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention within each piece of flat (tokens, heads, head_dim) queries, keys and values
    cut at `offsets` (`varlen_offsets`), at most `max_length` tokens a piece; the output is
    shaped as `query`. flash-attention's varlen kernel on CUDA in half precision where the
    `flash_attn` package is installed, else SDPA over nested jagged tensors (torch picks a
    variable-length kernel on CUDA; the CPU's runs each piece)."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and FLASH_ATTN_INSTALLED:
        from flash_attn import flash_attn_varlen_func

        cu_seqlens = offsets.to(torch.int32)
        return flash_attn_varlen_func(
            query,
            key,
            value,
            cu_seqlens,
            cu_seqlens,
            max_length,
            max_length,
            dropout_p=dropout_p,
            softmax_scale=scale,
        )

    def nested(flat: torch.Tensor) -> torch.Tensor:
        jagged = torch.nested.nested_tensor_from_jagged(
            flat, offsets, min_seqlen=0, max_seqlen=max_length
        )
        return jagged.transpose(1, 2)  # (pieces, heads, j, head_dim)

    out = torch.nn.functional.scaled_dot_product_attention(
        nested(query), nested(key), nested(value), dropout_p=dropout_p, scale=scale
    )
    return out.transpose(1, 2).values()
