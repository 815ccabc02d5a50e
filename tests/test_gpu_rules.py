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


OPTIMIZERS = [
    ("sgd", "auto"),
    ("adam", "foreach"),
    ("adamw", "foreach"),
    ("adam", "fused"),
    ("adamw", "fused"),
]


@pytest.mark.parametrize(("name", "implementation"), OPTIMIZERS, ids=lambda v: str(v))
def test_the_state_handoff_keeps_every_entry_on_the_device_torch_expects(name, implementation):
    """A unit and its optimizer state as torch creates them on a GPU (fake CUDA tensors: a
    device mix raises as on a GPU), packed as a transition sends it and unpacked as the
    receiving rank materialises it: every entry comes back on the device it left from.
    Adam without `fused` keeps its step count on the host ("Deliberately host `step` on
    CPU"): concatenating it with the device tensors failed at every first transition."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.autodp.handoff import pack_unit, unpack_unit
    from pipetransformer.config import OptimizerConfig
    from pipetransformer.models import unit_param_names
    from pipetransformer.trainer import optim

    cuda = torch.device("cuda", 0)
    skeleton = tiny_bert(device="meta").units[1]
    with FakeTensorMode(allow_non_fake_inputs=True):
        unit = tiny_bert(device=cuda).units[1]  # layer 0's attention unit
        named = unit_param_names(unit, 1)
        config = OptimizerConfig(name=name, implementation=implementation)
        optimizer = optim.build_optimizer(config, named)
        for p in named.values():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        states = optim.states_by_name(optimizer, named)
        packed = pack_unit(1, unit, states, cuda)
        received, received_states = unpack_unit(packed.manifest, packed.payload, skeleton, cuda)

        assert packed.payload.device == cuda
        assert all(p.device == cuda for p in received.parameters())
        assert received_states.keys() == states.keys()
        for key, state in states.items():
            assert received_states[key].keys() == state.keys()
            for entry, value in state.items():
                got = received_states[key][entry]
                assert (got.device, got.dtype, got.shape) == (
                    value.device,
                    value.dtype,
                    value.shape,
                )
        # ... and the next optimizer (rebuilt over the received parameters) takes it as is.
        rebuilt = optim.build_optimizer(config, unit_param_names(received, 1))
        optim.load_states_by_name(rebuilt, unit_param_names(received, 1), received_states)
        for p in received.parameters():
            for entry, value in rebuilt.state[p].items():
                assert value.device == (
                    torch.device("cpu") if entry == "step" and implementation != "fused" else cuda
                ), (entry, value.device)
