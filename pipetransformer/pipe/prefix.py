"""The frozen prefix on the first stage's device, served from AutoCache where it pays.

For a batch of sample ids at frozen boundary F (units [0, prefix_end(F))), every sample is
one of:

    hit      cached at F                    -> read, nothing computed
    upgrade  cached at an earlier F' < F    -> run only units [prefix_end(F'), prefix_end(F))
                                               on the cached value, store it at F
    miss     not cached                     -> run the whole prefix from the inputs, store it

so no sample runs through a frozen layer twice. Frozen units run in eval mode without
autograd (no dropout: the output is a pure function of the input, which is what makes a
cached value valid).

Owns: that decision and the computation for one batch. Must not: decide whether caching
is on (the trainer's profiler does), own the store (the AutoCache daemon does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pipetransformer.models.layered import UnitSequence
from pipetransformer.utils.units import prefix_end


def _run(
    units: dict[int, nn.Module], start: int, end: int, x: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    if start == end:
        return x
    sequence = UnitSequence([units[u] for u in range(start, end)], [True] * (end - start))
    with torch.no_grad():
        out = sequence(*x)
    return out if isinstance(out, tuple) else (out,)


class CachedPrefix:
    """Computes the frozen prefix's output for a batch, reading and filling the cache."""

    def __init__(
        self,
        units: dict[int, nn.Module],
        num_frozen_layers: int,
        client,
        device: torch.device,
        counts: dict[str, int] | None = None,
    ) -> None:
        self.units = units
        self.num_frozen_layers = num_frozen_layers
        self.end = prefix_end(num_frozen_layers)
        self.client = client
        self.device = device
        # hits / upgrades / misses by sample, shared with whoever reports them.
        self.counts = counts if counts is not None else {"hits": 0, "upgrades": 0, "misses": 0}

    def __call__(
        self, split: str, ids: Sequence[int], inputs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        ids_array = np.asarray(ids, dtype=np.int64)
        # Shape padding repeats samples: look each id up once, then scatter back.
        unique_ids, first_index, inverse = np.unique(
            ids_array, return_index=True, return_inverse=True
        )
        tags, cached = self.client.read(split, unique_ids)
        frozen = self.num_frozen_layers
        hit = tags == frozen
        upgrade = (tags >= 1) & (tags < frozen)
        miss = ~(hit | upgrade)
        self.counts["hits"] += int(hit.sum())
        self.counts["upgrades"] += int(upgrade.sum())
        self.counts["misses"] += int(miss.sum())

        rows_out: list[tuple[np.ndarray, tuple[torch.Tensor, ...]]] = []
        if hit.any():
            index = torch.from_numpy(np.flatnonzero(hit))
            rows_out.append((np.flatnonzero(hit), tuple(t[index].to(self.device) for t in cached)))
        computed: list[tuple[np.ndarray, tuple[torch.Tensor, ...]]] = []
        for tag in np.unique(tags[upgrade]):
            rows = np.flatnonzero(tags == tag)
            index = torch.from_numpy(rows)
            start = tuple(t[index].to(self.device) for t in cached)
            computed.append((rows, _run(self.units, prefix_end(int(tag)), self.end, start)))
        if miss.any():
            rows = np.flatnonzero(miss)
            positions = torch.from_numpy(first_index[rows]).to(inputs[0].device)
            computed.append(
                (rows, _run(self.units, 0, self.end, tuple(t[positions] for t in inputs)))
            )
        rows_out += computed

        if computed:
            written_rows = np.concatenate([rows for rows, _ in computed])
            written = tuple(
                torch.cat([values[i] for _, values in computed]).cpu()
                for i in range(len(computed[0][1]))
            )
            self.client.write(split, unique_ids[written_rows], frozen, written)

        # Assemble in unique-id order, then expand to the batch's order (with repeats).
        count = len(unique_ids)
        template = rows_out[0][1]
        assembled = [
            torch.empty((count, *t.shape[1:]), dtype=t.dtype, device=self.device) for t in template
        ]
        for rows, values in rows_out:
            index = torch.from_numpy(rows).to(self.device)
            for target, value in zip(assembled, values):
                target[index] = value.to(target.dtype)
        order = torch.from_numpy(inverse.reshape(-1)).to(self.device)
        return tuple(t[order] for t in assembled)
