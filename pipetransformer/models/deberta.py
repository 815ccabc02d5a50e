"""transformers DeBERTa-v2 and DeBERTa-v3 (model type 'deberta-v2') -> LayeredModel.

DeBERTa's disentangled attention reads two things besides the hidden state:
- the relative positions of query and key tokens (bucketed), a function of the sequence
  length alone: made once per length and device, on the device, and shared by the model's
  attention units (`RelativePositions`; transformers' `build_relative_position`, called in
  every layer, copies a host scalar to the device each time: a blocking copy per layer on
  a GPU);
- the relative-position embedding table (`encoder.rel_embeddings`, layer-normed by
  `encoder.LayerNorm`), ONE trained parameter that every layer reads. It belongs to the
  embedding unit, which computes LayerNorm(table) once per forward, as DebertaV2Encoder
  does. For its gradient (the sum over every layer, as in the library's model) to reach
  the embedding unit across stage boundaries, it cannot ride as an extra activation
  (those carry no gradient): it rides at the end of the hidden state, each sample holding
  a copy, so the hidden state is (seq + 2 * span, hidden). Attention units read sample 0's
  copy (the gradients of the other copies are zero; the embedding's `expand` sums them
  back), MLP units and the head touch only the first `seq` rows. The cost is activation
  bytes: (seq + 2 * span) / seq times a BERT's of the same size (deberta-v3-base: span 256,
  so 5x at seq 128, 2x at seq 512). Once the embedding freezes (with layer 0) the table
  freezes with it, in training and in the single-process reference alike. `seq` is the
  batch's own (read from the mask's width): a batch padded to its longest sample runs as
  one padded to max_seq_length.
- the 2-D padding mask, which rides along as BERT's does; each attention unit expands it
  to DeBERTa's (batch, 1, seq, seq) mask as DebertaV2Encoder.get_attention_mask does.
  A packed batch (models/packed.py) brings segment ids in its place, and the sample starts
  after them: the mask keeps each query in its sample, and the relative positions of a
  row are those of each sample within it (a difference of positions does not change when
  both move by the sample's offset in the row); absolute positions (position_biased_input,
  DeBERTa-v2) restart per sample; the table's copy rides at the end of every row.
The ConvLayer of DeBERTa-v2-xlarge/xxlarge (conv_kernel_size > 0) mixes the embedding
output into layer 0's output: refused.

Owns: those units and the 'deberta-v2' adapter. Must not: know pipelines, freezing, ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from pipetransformer.models import packed as packing
from pipetransformer.models.bert import first_tokens, sample_positions
from pipetransformer.models.layered import LayeredModel
from pipetransformer.models.registry import ModelAdapter, register_adapter
from pipetransformer.models.text_models import check_fits, text_spec, text_task


def _split(x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tokens' hidden state, the table's copy) of a hidden state; the batch's length is
    the mask's."""
    seq = attention_mask.shape[1]
    return x[:, :seq], x[:, seq:]


class DebertaEmbedding(nn.Module):
    """Word (+ position, + token type) embeddings, LayerNorm, masked, dropout; then the
    layer-normed relative-position table appended to every sample's hidden state."""

    def __init__(self, deberta: nn.Module) -> None:
        super().__init__()
        encoder = deberta.encoder
        self.embeddings = deberta.embeddings
        self.rel_embeddings = encoder.rel_embeddings if encoder.relative_attention else None
        norm = "layer_norm" in encoder.norm_rel_ebd and encoder.relative_attention
        self.rel_norm = encoder.LayerNorm if norm else None

    def forward(self, input_ids, token_type_ids, attention_mask, *rest):
        positions, mask = None, attention_mask
        if packing.packed(rest):
            positions, mask = sample_positions(attention_mask), (attention_mask > 0).long()
        hidden = self.embeddings(
            input_ids=input_ids, token_type_ids=token_type_ids, position_ids=positions, mask=mask
        )
        if self.rel_embeddings is not None:
            table = self.rel_embeddings.weight
            if self.rel_norm is not None:
                table = self.rel_norm(table)
            tail = table.unsqueeze(0).expand(hidden.shape[0], -1, -1)
            hidden = torch.cat([hidden, tail.to(hidden.dtype)], dim=1)
        return hidden, attention_mask, *rest


class RelativePositions:
    """The bucketed relative positions of query and key tokens of a sequence length, as
    transformers' `build_relative_position` makes them (the same values), made on the device
    without a host copy and kept per length and device: every attention unit of a model
    reads the same ones. Not a module: nothing to train, save or move between ranks (a unit
    that moves makes its own again). Under torch.compile they are made inside the graph."""

    def __init__(self, bucket_size: int, max_position: int) -> None:
        self.bucket_size = bucket_size
        self.max_position = max_position
        self._made: dict[tuple[int, str], torch.Tensor] = {}

    def __call__(self, length: int, device: torch.device) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._make(length, device)
        key = (length, str(device))
        if key not in self._made:
            self._made[key] = self._make(length, device)
        return self._made[key]

    def _make(self, length: int, device: torch.device) -> torch.Tensor:
        ids = torch.arange(length, dtype=torch.long, device=device)
        relative = ids[:, None] - ids[None, :]
        if self.bucket_size > 0 and self.max_position > 0:
            relative = self._log_buckets(relative)
        return relative.to(torch.long).unsqueeze(0)

    def _log_buckets(self, relative: torch.Tensor) -> torch.Tensor:
        """transformers' `make_log_bucket_position`, its host scalar an operand instead
        (`torch.tensor(mid - 1).type_as(relative)` copied it to the device)."""
        sign = torch.sign(relative)
        mid = self.bucket_size // 2
        near = (relative < mid) & (relative > -mid)
        absolute = torch.where(near, mid - 1, torch.abs(relative))
        # A 0-dim host tensor, read on the host by the kernel (no copy), as transformers has it.
        scale = torch.log(torch.tensor((self.max_position - 1) / mid))
        log_pos = torch.ceil(torch.log(absolute / mid) / scale * (mid - 1)) + mid
        return torch.where(absolute <= mid, relative.type_as(log_pos), log_pos * sign)


class DebertaAttention(nn.Module):
    """Disentangled self-attention + output dense/dropout/LayerNorm with the residual."""

    def __init__(self, layer: nn.Module, positions: RelativePositions | None) -> None:
        super().__init__()
        self.attention = layer.attention
        self.positions = positions  # None without relative attention

    def forward(self, x, attention_mask, *rest):
        hidden, tail = _split(x, attention_mask)
        if packing.packed(rest):
            mask = packing.same_sample(attention_mask)
        else:
            mask = attention_mask.unsqueeze(1).unsqueeze(2)
            mask = mask * mask.squeeze(-2).unsqueeze(-1)  # DebertaV2Encoder.get_attention_mask
        relative_pos, table = None, None
        if self.positions is not None:
            relative_pos = self.positions(hidden.shape[-2], hidden.device)
            table = tail[0]
        output, _ = self.attention(hidden, mask, relative_pos=relative_pos, rel_embeddings=table)
        return torch.cat([output, tail], dim=1), attention_mask, *rest


class DebertaMlp(nn.Module):
    """Intermediate dense + activation, output dense/dropout/LayerNorm with the residual."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.intermediate = layer.intermediate
        self.output = layer.output

    def forward(self, x, attention_mask, *rest):
        hidden, tail = _split(x, attention_mask)
        output = self.output(self.intermediate(hidden), hidden)
        return torch.cat([output, tail], dim=1), attention_mask, *rest


class DebertaClassificationHead(nn.Module):
    """ContextPooler (first token, dropout, dense, activation), dropout, classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = model.pooler, model.dropout, model.classifier

    def forward(self, x, attention_mask, *rest):
        hidden = first_tokens(_split(x, attention_mask)[0], rest)
        return self.classifier(self.dropout(self.pooler(hidden)))


class DebertaQuestionAnsweringHead(nn.Module):
    def __init__(self, qa_outputs: nn.Module) -> None:
        super().__init__()
        self.qa_outputs = qa_outputs

    def forward(self, x, attention_mask, *rest):
        logits = self.qa_outputs(_split(x, attention_mask)[0])
        return packing.sample_tokens(logits, rest[0]) if packing.packed(rest) else logits


def layered_deberta(model: nn.Module, max_seq_length: int | None) -> LayeredModel:
    task = text_task(model)
    deberta = model.deberta
    config = deberta.config
    encoder = deberta.encoder
    if encoder.conv is not None:
        raise ValueError(
            "DeBERTa with conv_kernel_size > 0 (v2-xlarge/xxlarge) feeds the embedding output "
            "into layer 0's output: not cut into units"
        )
    if getattr(deberta, "z_steps", 0) > 1:
        raise ValueError("DeBERTa with z_steps > 1 reruns its last layer: not cut into units")
    if getattr(config, "position_biased_input", True):
        check_fits(max_seq_length, config.max_position_embeddings)
    seq = max_seq_length
    positions = None
    if encoder.relative_attention:
        positions = RelativePositions(encoder.position_buckets, encoder.max_relative_positions)
    units: list[nn.Module] = [DebertaEmbedding(deberta)]
    for layer in encoder.layer:
        units += [DebertaAttention(layer, positions), DebertaMlp(layer)]
    if task == "question_answering":
        units.append(DebertaQuestionAnsweringHead(model.qa_outputs))
    else:
        units.append(DebertaClassificationHead(model))
    span = encoder.rel_embeddings.num_embeddings if encoder.relative_attention else 0
    spec = text_spec(
        family="deberta-v2",
        task=task,
        units=units,
        max_seq_length=seq,
        hidden_size=config.hidden_size,
        num_labels=config.num_labels,
        hidden_tokens=seq + span,
    )
    return LayeredModel(units, spec, source=model)


DEBERTA_V2 = register_adapter(
    ModelAdapter(
        family="deberta-v2",
        library="transformers",
        model_types=("deberta-v2",),
        cut=layered_deberta,
        # DeBERTa-v3's architecture at small size: relative attention over a bucketed
        # table, shared keys, no absolute positions, no token types.
        random_config={
            "relative_attention": True,
            "pos_att_type": ["p2c", "c2p"],
            "position_buckets": 32,
            "max_relative_positions": -1,
            "norm_rel_ebd": "layer_norm",
            "share_att_key": True,
            "position_biased_input": False,
            "type_vocab_size": 0,
            "hidden_act": "gelu",
        },
    )
)
