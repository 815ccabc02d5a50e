"""A GPU's rules, enforced on this CPU (the `gpu_rules` marker is the contract; docs/gpus.md
says what each test stands for and what only a GPU can show)."""

from __future__ import annotations

import pytest
from families import FAMILIES, TEXT_FAMILIES, batch, text_batch
from gpu_audit import HostReads

pytestmark = pytest.mark.gpu_rules

CASES = [(name, True) for name in FAMILIES] + [(name, False) for name in TEXT_FAMILIES]


@pytest.mark.parametrize(
    "name, padded", CASES, ids=lambda v: {True: "padded", False: "unpadded"}.get(v, v)
)
def test_a_forward_and_backward_read_nothing_on_the_host(name, padded):
    """Every unit forward and backward, train mode, every family: no value reaches the host.
    transformers' bidirectional masks read `padding_mask.all()` unless told not to (one
    read per attention unit per micro-batch on a GPU)."""
    family = FAMILIES[name]
    model = family.build(dropout=True).train()
    inputs = batch(family) if padded or not family.text else text_batch(padded=False)
    with HostReads() as audit:
        out = model(*inputs)
        out.float().sum().backward()
    assert audit.reads == []
