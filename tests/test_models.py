"""Adapters: the units, stacked, are the original model; BERT's mask reaches every unit."""

import pytest
import timm
import torch
from helpers import TINY_BERT, TINY_VIT, tiny_bert, tiny_vit

from pipetransformer.config import ModelConfig
from pipetransformer.models import UnitSequence, build_model
from pipetransformer.models.text_models import create_text_model


def test_vit_units_reproduce_timm_exactly():
    torch.manual_seed(0)
    original = timm.create_model(
        "vit_tiny_patch16_224", num_classes=10, in_chans=1, img_size=8, **TINY_VIT.kwargs
    )
    torch.manual_seed(0)
    layered = tiny_vit()
    original.eval(), layered.eval()
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(original(x), layered(x))
    # Any split into stages gives the same result as the whole.
    units = list(layered.units)
    for cut in range(1, len(units)):
        first = UnitSequence(units[:cut], [False] * cut)
        second = UnitSequence(units[cut:], [False] * (len(units) - cut))
        out = first(x)
        out = second(*(out if isinstance(out, tuple) else (out,)))
        assert torch.equal(out, original(x)), f"cut at unit {cut}"


def test_vit_spec_describes_units():
    model = tiny_vit()
    spec = model.spec
    assert spec.num_layers == 4 and spec.num_units == 10
    assert spec.unit_names[1] == "layer0.attention" and spec.unit_names[2] == "layer0.mlp"
    assert sum(spec.unit_param_counts) == sum(p.numel() for p in model.parameters())
    # Sublayer granularity: each block's attention and MLP are separate units with params.
    assert all(c > 0 for c in spec.unit_param_counts)
    assert spec.activation_specs[0].shape == (5, 32)  # 4 patches + class token


@pytest.mark.parametrize("task", ["classification", "question_answering"])
def test_bert_units_reproduce_transformers_exactly(task):
    torch.manual_seed(0)
    original, _ = create_text_model(TINY_BERT, task=task, num_labels=2, vocab_size=50)
    torch.manual_seed(0)
    layered = tiny_bert(task=task)
    original.eval(), layered.eval()
    ids = torch.randint(5, 50, (3, 16))
    types = torch.zeros_like(ids)
    types[:, 8:] = 1
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    mask[2, 5:] = 0
    expected = original(input_ids=ids, token_type_ids=types, attention_mask=mask)
    got = layered(ids, types, mask)
    if task == "classification":
        assert torch.equal(got, expected.logits)
    else:
        assert torch.equal(got[..., 0], expected.start_logits)
        assert torch.equal(got[..., 1], expected.end_logits)


def test_bert_padding_does_not_change_the_result():
    model = tiny_bert(seq_len=24).eval()
    ids = torch.randint(5, 50, (2, 10))
    types = torch.zeros_like(ids)
    short = model(ids, types, torch.ones_like(ids))
    padded_ids = torch.cat([ids, torch.zeros(2, 14, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(2, 10, dtype=torch.long), torch.zeros(2, 14, dtype=torch.long)], 1)
    padded = model(padded_ids, torch.zeros_like(padded_ids), mask)
    torch.testing.assert_close(padded, short, atol=1e-5, rtol=1e-5)
    # The hidden states of the real tokens match too, and without the mask they would not.
    encoder = UnitSequence(list(model.units)[:-1], [False] * (model.spec.num_units - 1))
    hidden_short = encoder(ids, types, torch.ones_like(ids))[0]
    hidden_padded = encoder(padded_ids, torch.zeros_like(padded_ids), mask)[0][:, :10]
    torch.testing.assert_close(hidden_padded, hidden_short, atol=1e-5, rtol=1e-5)
    unmasked = encoder(padded_ids, torch.zeros_like(padded_ids), torch.ones_like(padded_ids))[0][
        :, :10
    ]
    assert not torch.allclose(unmasked, hidden_short, atol=1e-3)


def test_bert_mask_reaches_every_stage():
    """The mask travels with the hidden state: a later stage sees each sample's own mask."""
    model = tiny_bert().eval()
    units = list(model.units)
    ids = torch.randint(5, 50, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    out = UnitSequence(units[:3], [False] * 3)(ids, torch.zeros_like(ids), mask)
    assert isinstance(out, tuple) and torch.equal(out[1], mask)
    final = UnitSequence(units[3:], [False] * (len(units) - 3))(*out)
    assert torch.equal(final, model(ids, torch.zeros_like(ids), mask))


def test_frozen_units_run_in_eval_mode_without_graph():
    model = build_model(
        ModelConfig(name="bert", kwargs={**TINY_BERT.kwargs, "hidden_dropout_prob": 0.5}),
        task="classification",
        num_classes=2,
        vocab_size=50,
        max_seq_length=16,
    )
    units = list(model.units)
    UnitSequence(units[:3], [True, True, False]).train()
    assert not units[0].training and not units[1].training and units[2].training
    ids = torch.randint(5, 50, (2, 16))
    out = UnitSequence(units[:2], [True, True])(ids, torch.zeros_like(ids), torch.ones_like(ids))
    assert not out[0].requires_grad
    again = UnitSequence(units[:2], [True, True])(ids, torch.zeros_like(ids), torch.ones_like(ids))
    assert torch.equal(out[0], again[0])  # no dropout: a pure function
    with pytest.raises(ValueError):
        UnitSequence(units[:2], [False, True])


def test_meta_build_has_no_storage_and_same_structure():
    meta = tiny_vit(device="meta")
    real = tiny_vit()
    assert meta.spec == real.spec
    assert all(p.is_meta for p in meta.parameters())


def test_large_model_builds_on_meta_quickly():
    spec = build_model(
        ModelConfig(name="vit_base_patch16_224"),
        task="classification",
        num_classes=1000,
        device="meta",
    ).spec
    assert spec.num_layers == 12 and 86_000_000 < sum(spec.unit_param_counts) < 87_000_000


def test_vit_checkpoint_path_loads_local_weights(tmp_path):
    source = tiny_vit(seed=3)
    torch.manual_seed(3)
    original = timm.create_model(
        "vit_tiny_patch16_224", num_classes=10, in_chans=1, img_size=8, **TINY_VIT.kwargs
    )
    path = tmp_path / "vit.pth"
    torch.save(original.state_dict(), path)
    cfg = ModelConfig(name=TINY_VIT.name, kwargs=TINY_VIT.kwargs, checkpoint_path=str(path))
    torch.manual_seed(99)  # a different random init, overwritten by the checkpoint
    loaded = build_model(cfg, task="classification", num_classes=10, in_chans=1, image_size=8)
    for a, b in zip(source.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(FileNotFoundError, match="checkpoint_path"):
        build_model(
            ModelConfig(name=TINY_VIT.name, checkpoint_path=str(tmp_path / "none.pth")),
            task="classification",
            num_classes=10,
        )


def test_unknown_model_names_and_kwargs_fail_clearly():
    with pytest.raises(ValueError, match="model.name"):
        build_model(
            ModelConfig(name="vit_nonexistent_xyz"),
            task="classification",
            num_classes=10,
            device="meta",
        )
    with pytest.raises(ValueError, match="model.kwargs"):
        build_model(
            ModelConfig(name="vit_tiny_patch16_224", kwargs={"depthh": 3}),
            task="classification",
            num_classes=10,
            device="meta",
        )


def test_pretrained_bert_loads_local_weights_and_rejects_kwargs_that_change_their_shapes(tmp_path):
    small = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 100,
    }
    saved, _ = create_text_model(
        ModelConfig(name="bert", kwargs=small), task="classification", num_labels=2, vocab_size=None
    )
    saved.save_pretrained(tmp_path)

    def load(kwargs):
        config = ModelConfig(name="bert", model_name_or_path=str(tmp_path), kwargs=kwargs)
        return create_text_model(config, task="classification", num_labels=2, vocab_size=None)[0]

    loaded = load({"hidden_dropout_prob": 0.0})
    assert torch.equal(
        loaded.bert.encoder.layer[1].output.dense.weight,
        saved.bert.encoder.layer[1].output.dense.weight,
    )
    assert loaded.config.hidden_dropout_prob == 0.0
    with pytest.raises(ValueError, match=r"model\.kwargs\.hidden_size=64 .*hidden_size=32"):
        load({"hidden_size": 64})
