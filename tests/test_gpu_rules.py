"""A GPU's rules, enforced on this CPU (the `gpu_rules` marker is the contract; docs/gpus.md
says what each test stands for and what only a GPU can show)."""

from __future__ import annotations

import pytest
import torch
from gpu_audit import HostReads
from helpers import tiny_bert, tiny_vit
from workers import fixed_batch

pytestmark = pytest.mark.gpu_rules


@pytest.mark.parametrize("kind", ["bert", "vit"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_a_forward_and_backward_read_nothing_on_the_host(kind, padded):
    """Every unit forward and backward, train mode: no value reaches the host. transformers'
    bidirectional mask reads `padding_mask.all()` unless told not to (one read per attention
    unit per micro-batch on a GPU)."""
    model = tiny_bert() if kind == "bert" else tiny_vit()
    inputs, _ = fixed_batch(kind, 4)
    if kind == "bert" and not padded:
        ids, types, mask = inputs
        inputs = (ids.clamp(min=5), types, torch.ones_like(mask))
    with HostReads() as audit:
        out = model(*inputs)
        out.float().sum().backward()
    assert audit.reads == []
