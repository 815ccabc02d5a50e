"""Packed text batches as tensors: samples padded one a row, laid end to end in rows of a
`PackedShape` (utils/padding.py places them), and back.

A packed micro-batch of `b` samples is `rows` rows of `row_length` tokens. Its *segment
ids* (rows, row_length) say which sample each token is: k + 1 for the micro-batch's k-th
sample, 0 for the padding at a row's end; they take the padded batch's attention mask's
place between units, so every stage boundary carries the tensors it carries unpadded, plus
the *sample starts* (b,): where each sample's first token lies in the micro-batch's
rows * row_length tokens, flat, in batch order (what a head reads each sample from). A
batch of M micro-batches is their rows stacked (M * rows) and their starts stacked (M * b),
so a schedule that splits every tensor into M along the first dimension hands each
micro-batch its own.

Tensors with rows past the tokens (DeBERTa's relative-position table rides at the end of
the hidden state: `extra_rows`) keep them: a packed row takes those of the first sample
placed in it (an empty row those of its micro-batch's first sample), a sample unpacked
those of its row. They are the same for every sample wherever they are used.

Owns: `Packing` (the index arithmetic of one batch in one shape). Must not: know models,
datasets or the cache (they call it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipetransformer.utils.padding import PackedShape, packed_placements


class Packing:
    """Where the real tokens of a batch of samples of real lengths `lengths` (in batch
    order) go when the batch, padded one sample a row to `shape.row_length`, is packed in
    `shape` (micro-batches of `shape.samples` consecutive samples)."""

    def __init__(self, lengths: Sequence[int], shape: PackedShape) -> None:
        n, b, rows, width = len(lengths), shape.samples, shape.rows, shape.row_length
        if n % b:
            raise ValueError(f"{n} samples do not split into micro-batches of {b}")
        self.shape = shape
        self.num_samples = n
        self.lengths = list(lengths)
        sample_row, sample_offset = [], []
        for start in range(0, n, b):
            base = start // b * rows
            for row, offset in packed_placements(lengths[start : start + b], shape):
                sample_row.append(base + row)
                sample_offset.append(offset)
        self.num_rows = n // b * rows
        # Each sample's packed row (global over the batch) and its first token in it.
        self.sample_row = torch.tensor(sample_row, dtype=torch.long)
        offsets = torch.tensor(sample_offset, dtype=torch.long)
        # Index arithmetic from the lengths alone, with no read of a tensor's value on the
        # host: the sizes come from the Python lists (`output_size`), not from the tensors.
        counts = torch.tensor(self.lengths, dtype=torch.long)
        total = sum(self.lengths)
        within = torch.arange(total) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts, output_size=total
        )
        sample = torch.repeat_interleave(torch.arange(n), counts, output_size=total)
        # Every real token, sample by sample: its flat place padded (n, width) and packed
        # (num_rows, width).
        self.padded_index = sample * width + within
        self.packed_index = (self.sample_row[sample] * width + offsets[sample]) + within
        segments = torch.zeros(self.num_rows * width, dtype=torch.long)
        segments[self.packed_index] = sample % b + 1
        self.segments = segments.view(self.num_rows, width)
        # Flat within the micro-batch's rows.
        self.starts = (self.sample_row % rows) * width + offsets
        # The sample whose extra rows each packed row carries: the one at its first token;
        # an empty row, its micro-batch's first sample.
        self.row_owner = torch.arange(self.num_rows) // rows * b
        first = [i for i, offset in enumerate(sample_offset) if offset == 0]
        self.row_owner[torch.tensor([sample_row[i] for i in first], dtype=torch.long)] = (
            torch.tensor(first, dtype=torch.long)
        )

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(n, row_length [+ extra rows], ...) one sample a row -> (num_rows, row_length
        [+ extra rows], ...) packed, zeros past each row's samples."""
        width = self.shape.row_length
        packed = padded.new_zeros((self.num_rows, *padded.shape[1:]))
        tokens = padded.reshape(self.num_samples * padded.shape[1], *padded.shape[2:])
        flat = packed.view(self.num_rows * packed.shape[1], *packed.shape[2:])
        flat.index_copy_(
            0,
            self._rows_index(self.packed_index, packed.shape[1], padded),
            tokens.index_select(0, self._rows_index(self.padded_index, padded.shape[1], padded)),
        )
        if padded.shape[1] > width:
            packed[:, width:] = padded[self._on(self.row_owner, padded), width:]
        return packed

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(num_rows, row_length [+ extra rows], ...) packed -> (n, row_length [+ extra
        rows], ...) one sample a row, zeros past each sample's length."""
        width = self.shape.row_length
        padded = packed.new_zeros((self.num_samples, *packed.shape[1:]))
        flat = packed.reshape(self.num_rows * packed.shape[1], *packed.shape[2:])
        tokens = flat.index_select(0, self._rows_index(self.packed_index, packed.shape[1], packed))
        padded_flat = padded.view(self.num_samples * padded.shape[1], *packed.shape[2:])
        padded_flat.index_copy_(
            0, self._rows_index(self.padded_index, padded.shape[1], packed), tokens
        )
        if packed.shape[1] > width:
            padded[:, width:] = packed[self._on(self.sample_row, packed), width:]
        return padded

    def _rows_index(self, index: torch.Tensor, rows_per_sample: int, like: torch.Tensor):
        """A flat token index over rows of `row_length` as one over rows of
        `rows_per_sample` (the tokens first, extra rows after them)."""
        width = self.shape.row_length
        if rows_per_sample != width:
            index = index // width * rows_per_sample + index % width
        return self._on(index, like)

    @staticmethod
    def _on(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return index if index.device == like.device else index.to(like.device, non_blocking=True)

    def inputs(self, padded: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """A text batch's inputs (input_ids, token_type_ids, attention_mask), padded one
        sample a row to row_length, packed: (input_ids, token_type_ids, segment ids, sample
        starts)."""
        input_ids, token_type_ids, _ = padded
        return self.pack(input_ids), self.pack(token_type_ids), self.segments, self.starts

    def padded_inputs(self, packed: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Packed inputs back to (input_ids, token_type_ids, attention_mask) one sample a
        row (what the frozen prefix runs a cache miss on)."""
        input_ids, token_type_ids = packed[:2]
        mask = self.unpack(torch.ones_like(self.segments, device=input_ids.device))
        return self.unpack(input_ids), self.unpack(token_type_ids), mask
