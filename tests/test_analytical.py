"""The analytical unit profile (planning/analytical.py): FLOPs against hand formulas, bytes
against what pipe/measure.py measures on the CPU, and ViT-B/16 against its published size.

Unit tier: no processes. Hand formulas appear here only, to check PyTorch's counter.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_BERT, TINY_VIT, tiny_bert, tiny_vit

from pipetransformer.config import ModelConfig
from pipetransformer.models import build_model
from pipetransformer.pipe.measure import measure_unit_costs
from pipetransformer.planning.analytical import AnalyticalProfile, UnitWork, analytical_profile

MICRO_BATCH = 2


def _dims(model) -> tuple[int, int, int]:
    """(tokens per sample, hidden size, MLP hidden size) of a tiny model."""
    tokens, hidden = model.spec.activation_specs[0].shape
    if model.spec.family == "vit":
        intermediate = int(hidden * TINY_VIT.kwargs["mlp_ratio"])
    else:
        intermediate = TINY_BERT.kwargs["intermediate_size"]
    return tokens, hidden, intermediate


@pytest.fixture(scope="module", params=["vit", "bert"])
def tiny(request):
    """(meta model, its float32 profile at MICRO_BATCH)."""
    make = tiny_vit if request.param == "vit" else tiny_bert
    model = make(device="meta")
    return model, analytical_profile(model, MICRO_BATCH)


# ----------------------------------------------------------------------------- FLOPs


def test_layer_flops_match_hand_formulas(tiny):
    model, profile = tiny
    seq, hidden, intermediate = _dims(model)
    tokens = MICRO_BATCH * seq
    # Two matmuls of the MLP; q, k, v and output projections plus the two attention matmuls
    # (scores, weighted values), 2 FLOPs per multiply-add.
    mlp = 2 * tokens * (2 * hidden * intermediate)
    projections = 2 * tokens * (4 * hidden * hidden)
    attention_matmuls = 2 * 2 * MICRO_BATCH * seq * seq * hidden
    for layer in range(model.spec.num_layers):
        attention_unit, mlp_unit = 1 + 2 * layer, 2 + 2 * layer
        assert profile.units[mlp_unit].forward_flops == pytest.approx(mlp, rel=0.02)
        assert profile.units[attention_unit].forward_flops == pytest.approx(
            projections + attention_matmuls, rel=0.02
        )


def test_head_and_embedding_flops_match_hand_formulas(tiny):
    model, profile = tiny
    _, hidden, _ = _dims(model)
    head, embedding = profile.units[-1], profile.units[0]
    if model.spec.family == "vit":
        num_classes = model.spec.output_spec.shape[0]
        assert head.forward_flops == 2 * MICRO_BATCH * hidden * num_classes
        channels, height, width = model.spec.input_specs[0].shape
        patch = TINY_VIT.kwargs["patch_size"]
        patches = (height // patch) * (width // patch)
        assert embedding.forward_flops == 2 * MICRO_BATCH * patches * channels * patch**2 * hidden
    else:  # pooler dense + classifier; embedding lookups are not FLOPs
        assert head.forward_flops == 2 * MICRO_BATCH * (hidden * hidden + hidden * 2)
        assert embedding.forward_flops == 0


def test_backward_counts_weight_and_input_gradients(tiny):
    model, profile = tiny
    for unit in range(1, model.spec.num_units):
        work = profile.units[unit]
        # Weight + input gradient: two matmuls per forward matmul. Fused attention's backward
        # also recomputes the scores (5 matmuls for 2), so attention units land a little above.
        assert 2.0 <= work.backward_flops / work.forward_flops <= 2.2, unit
    for layer in range(model.spec.num_layers):
        mlp = profile.units[2 + 2 * layer]
        assert mlp.backward_flops == 2 * mlp.forward_flops
    embedding = profile.units[0]
    if model.spec.family == "vit":
        # The images need no gradient: only the patch projection's weight gradient, one
        # convolution as large as the forward one.
        assert embedding.backward_flops == embedding.forward_flops
    else:
        assert embedding.backward_flops == 0


def test_frozen_forward_flops_equal_forward(tiny):
    _, profile = tiny
    assert profile.column("frozen_forward_flops") == profile.column("forward_flops")


def test_flops_scale_linearly_with_micro_batch(tiny):
    model, profile = tiny
    larger = analytical_profile(model, 3 * MICRO_BATCH)
    for column in ("forward_flops", "backward_flops", "frozen_forward_flops", "output_bytes"):
        assert larger.column(column) == tuple(3 * v for v in profile.column(column)), column
    assert larger.column("param_bytes") == profile.column("param_bytes")


# ----------------------------------------------------------------------------- bytes


def test_bytes_bound_what_a_unit_must_move(tiny):
    model, profile = tiny
    for unit in range(1, model.spec.head_unit):
        work = profile.units[unit]
        # Without fusion a layer reads at least its weights and input and writes its output.
        input_bytes = MICRO_BATCH * model.spec.activation_specs[0].nbytes()
        assert work.forward_bytes >= work.param_bytes + input_bytes + work.output_bytes, unit
        assert work.backward_bytes > work.param_bytes, unit  # weight gradients are written
    assert all(w.param_count == c for w, c in zip(profile.units, model.spec.unit_param_counts))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bytes_equal_measured_on_cpu(tiny, dtype):
    meta_model, _ = tiny
    profile = analytical_profile(meta_model, MICRO_BATCH, dtype)
    cpu_model = (tiny_vit if meta_model.spec.family == "vit" else tiny_bert)()
    measured = measure_unit_costs(
        dict(enumerate(cpu_model.units)),
        cpu_model.spec,
        MICRO_BATCH,
        "cpu",
        repeats=1,
        warmup=0,
        autocast_dtype=torch.bfloat16 if dtype == "bfloat16" else None,
    )
    for unit, work in enumerate(profile.units):
        assert work.output_bytes == measured[unit].output_bytes, unit
        assert work.param_bytes == measured[unit].param_bytes, unit
        # BERT's attention units build the attention bias whatever the mask holds (an
        # all-ones mask would otherwise be read on the host to drop it): counted and
        # measured alike.
        assert work.saved_bytes == measured[unit].saved_bytes, unit


def test_bfloat16_autocast_keeps_flops_and_float32_weights():
    model = tiny_vit(device="meta")
    batch = 64  # large enough that activations, not weight casts, dominate the bytes
    full = analytical_profile(model, batch, "float32")
    mixed = analytical_profile(model, batch, "bfloat16")
    assert mixed.column("forward_flops") == full.column("forward_flops")
    assert mixed.column("backward_flops") == full.column("backward_flops")
    assert mixed.column("param_bytes") == full.column("param_bytes")  # float32 master weights
    # The residual stream stays float32 under autocast; the head's logits come out bfloat16.
    assert mixed.column("output_bytes")[:-1] == full.column("output_bytes")[:-1]
    assert 2 * mixed.units[-1].output_bytes == full.units[-1].output_bytes
    for unit in range(1, model.spec.head_unit):
        saved_ratio = mixed.units[unit].saved_bytes / full.units[unit].saved_bytes
        assert 0.5 <= saved_ratio <= 0.75, (unit, saved_ratio)
        assert mixed.units[unit].forward_bytes < full.units[unit].forward_bytes, unit


# ----------------------------------------------------------------------------- full size


def test_vit_base_forward_flops_match_published_figure():
    # ViT-B/16 at 224 px (DeiT-B) does 17.6 G multiply-adds per image: the DeiT paper's
    # "17.6 GFLOPs" (fvcore counts a multiply-add as one), timm's model cards in GMACs
    # (deit_base_distilled_patch16_224, one token more: 17.7). PyTorch counts 2 per
    # multiply-add.
    model = build_model(
        ModelConfig(name="vit_base_patch16_224"),
        task="classification",
        num_classes=1000,
        device="meta",
    )
    profile = analytical_profile(model, 1)
    assert profile.total("forward_flops") == pytest.approx(2 * 17.6e9, rel=0.05)
    assert profile.total("param_count") == pytest.approx(86.6e6, rel=0.01)


# ----------------------------------------------------------------------------- contract


def test_model_is_left_as_it_was():
    model = tiny_bert()  # real weights: they are never read
    model.train()
    model.units[0].requires_grad_(False)
    model.units[3].eval()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    flags = [p.requires_grad for p in model.parameters()]
    rng = torch.get_rng_state()

    profile = analytical_profile(model, MICRO_BATCH)

    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == modes
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    # Frozen units are counted as trained; where the weights live does not matter.
    assert profile == analytical_profile(tiny_bert(device="meta"), MICRO_BATCH)


def test_identical_layers_are_counted_once_and_different_ones_apart():
    model = tiny_vit(device="meta")
    model.units[3].attn.attn_drop.p = 0.1  # layer 1 only: its attention leaves the fused kernel
    profile = analytical_profile(model, MICRO_BATCH)
    assert profile.units[1] == profile.units[5] == profile.units[7]
    changed, plain = profile.units[3], profile.units[1]
    assert changed.forward_flops == plain.forward_flops
    assert changed.backward_flops < plain.backward_flops  # no recomputation of the scores
    assert changed.saved_bytes > plain.saved_bytes  # probabilities and dropout mask are kept


def test_profile_round_trips_and_rejects_bad_values(tiny):
    model, profile = tiny
    assert AnalyticalProfile.from_dict(profile.to_dict()) == profile
    assert profile.num_units == model.spec.num_units
    with pytest.raises(ValueError, match="dtype"):
        analytical_profile(model, 1, "float16x")
    with pytest.raises(ValueError, match="micro_batch_size"):
        analytical_profile(model, 0)
    with pytest.raises(ValueError, match="saved_bytes"):
        UnitWork(**{**profile.units[0].__dict__, "saved_bytes": -1})
