"""trainer.activation_checkpointing: a checkpointed unit sequence computes the same loss and
gradients as the plain one (dropout included: the RNG state is kept for the recompute),
keeps fewer activations for the backward, and is refused where it cannot apply."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_BERT

from pipetransformer.config import ConfigError, ModelConfig, config_from_dict
from pipetransformer.models import build_model
from pipetransformer.models.layered import UnitSequence

DROPOUT_BERT = ModelConfig(
    name="bert",
    kwargs={**TINY_BERT.kwargs, "hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.1},
)


def _grads(checkpoint: bool, frozen_units: int) -> tuple[torch.Tensor, dict, int]:
    torch.manual_seed(0)
    model = build_model(
        DROPOUT_BERT, task="classification", num_classes=2, vocab_size=50, max_seq_length=16
    )
    units = list(model.units)
    frozen = [u < frozen_units for u in range(len(units))]
    for unit, is_frozen in zip(units, frozen):
        unit.requires_grad_(not is_frozen)
    sequence = UnitSequence(units, frozen, checkpoint=checkpoint).train()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (4, 16), generator=generator)
    types, mask = torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 16, dtype=torch.long)
    saved = []

    def pack(tensor):
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    torch.manual_seed(2)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = sequence(ids, types, mask)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1, 0]))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved)


@pytest.mark.parametrize("frozen_units", [0, 3])
def test_checkpointed_units_give_the_same_loss_and_gradients(frozen_units):
    plain_loss, plain, plain_saved = _grads(False, frozen_units)
    loss, grads, saved = _grads(True, frozen_units)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-7, msg=name)
    # Only the units' inputs are kept until the backward: less than a third here.
    assert saved < plain_saved / 3


def test_checkpointing_is_refused_with_a_split_backward_and_with_compile():
    base = {"trainer": {"activation_checkpointing": True}}
    config_from_dict(base)  # on its own: accepted
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing"):
        config_from_dict({**base, "pipeline": {"schedule": "zero_bubble"}})
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing"):
        config_from_dict({"trainer": {"activation_checkpointing": True, "compile": True}})
