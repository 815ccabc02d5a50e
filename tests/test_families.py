"""Every family with an adapter, on random init from its config (nothing downloaded): the
units, stacked, are the library's model, bit for bit, forward and backward; whatever a
family passes between layers reaches every unit wherever the model is cut; planning works
from the meta device.

Exact means torch.equal: the units call the library's own modules in the library's order,
so even dropout draws the same random numbers (train mode with dropout on compares equal
under the same seed)."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, IMAGE_FAMILIES, TEXT_FAMILIES, batch, library_forward, text_batch

from pipetransformer.config import TEXT_MODEL_TYPES, ModelConfig
from pipetransformer.models import UnitSequence, build_model, registered_adapters
from pipetransformer.models.registry import adapter_for_family
from pipetransformer.planning.analytical import analytical_profile

CASES = [(name, task) for name, family in FAMILIES.items() for task in family.tasks]


def _grads(model) -> dict[int, torch.Tensor]:
    return {id(p): p.grad.clone() for p in model.source.parameters() if p.grad is not None}


def _forward_backward(run, model, seed: int):
    model.source.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = run()
    out.float().square().sum().backward()
    return out.detach(), _grads(model)


@pytest.mark.parametrize("name, task", CASES, ids=lambda v: str(v))
def test_units_reproduce_the_library_model_forward_and_backward(name, task):
    family = FAMILIES[name]
    inputs = batch(family)
    for dropout, mode in [(False, "eval"), (False, "train"), (True, "train")]:
        model = family.build(task, dropout=dropout)
        model.train(mode == "train")
        model.source.train(mode == "train")
        want, want_grads = _forward_backward(
            lambda m=model: library_forward(family, m, inputs), model, 7
        )
        got, got_grads = _forward_backward(lambda m=model: m(*inputs), model, 7)
        case = f"{mode}, dropout {'on' if dropout else 'off'}"
        assert torch.equal(got, want), case
        # Every trained parameter gets its gradient, and the same one.
        assert len(want_grads) == sum(1 for p in model.source.parameters() if p.requires_grad)
        assert want_grads.keys() == got_grads.keys(), case
        assert all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads), case


@pytest.mark.parametrize("name", list(FAMILIES))
def test_any_cut_into_two_stages_gives_the_whole(name):
    """What a family passes between layers (mask, DeBERTa's table, ...) reaches every unit
    after every possible stage boundary, and each unit's outputs have the spec's shapes."""
    family = FAMILIES[name]
    model = family.build().eval()
    inputs = batch(family)
    whole = model(*inputs)
    units = list(model.units)
    x = inputs
    for index, unit in enumerate(units[:-1]):
        x = unit(*x)
        specs = model.spec.unit_output_specs(index)
        assert [tuple(t.shape[1:]) for t in x] == [s.shape for s in specs], index
        assert [t.dtype for t in x] == [s.dtype for s in specs], index
    for cut in range(1, len(units)):
        first = UnitSequence(units[:cut], [False] * cut)(*inputs)
        first = first if isinstance(first, tuple) else (first,)
        out = UnitSequence(units[cut:], [False] * (len(units) - cut))(*first)
        assert torch.equal(out, whole), f"cut at unit {cut}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_parameter_is_in_exactly_one_unit_and_meta_builds_the_same_spec(name):
    family = FAMILIES[name]
    model = family.build()
    spec = model.spec
    assert spec.family == name and spec.num_layers == 4 and spec.num_units == 10
    in_units = [p for unit in model.units for p in unit.parameters()]
    assert len({id(p) for p in in_units}) == len(in_units), "a parameter in two units"
    assert {id(p) for p in in_units} == {id(p) for p in model.source.parameters()}
    assert sum(spec.unit_param_counts) == sum(p.numel() for p in model.source.parameters())
    assert all(count > 0 for count in spec.unit_param_counts)
    meta = family.build(device="meta")
    assert meta.spec == spec and all(p.is_meta for p in meta.parameters())


@pytest.mark.parametrize("name", TEXT_FAMILIES)
def test_padding_does_not_change_text_results(name):
    """A text padded to the run's length gives its real tokens the hidden states it has
    unpadded (the mask reaches every attention unit); without the mask they would differ."""
    family = FAMILIES[name]
    model = family.build().eval()
    short = adapter_for_family(name).cut(model.source, 10).eval()  # the same weights
    ids, types, mask = text_batch(padded=False)
    ids, types, mask = ids[:, :10], types[:, :10], mask[:, :10]
    pad = torch.zeros(ids.shape[0], 6, dtype=torch.long)
    padded = (torch.cat([ids, pad], 1), torch.cat([types, pad], 1), torch.cat([mask, pad], 1))

    def hidden(layered, *inputs):
        units = list(layered.units)[:-1]
        return UnitSequence(units, [False] * len(units))(*inputs)[0][:, :10]

    want = hidden(short, ids, types, mask)
    torch.testing.assert_close(hidden(model, *padded), want, atol=1e-5, rtol=1e-5)
    unmasked = hidden(model, padded[0], padded[1], torch.ones_like(padded[2]))
    assert not torch.allclose(unmasked, want, atol=1e-3)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_analytical_profile_counts_every_unit_from_the_meta_device(name):
    """`plan --predict` and the memory model count FLOPs and bytes on fake tensors."""
    family = FAMILIES[name]
    model = family.build(device="meta")
    profile = analytical_profile(model, micro_batch_size=2)
    assert profile.column("param_count") == model.spec.unit_param_counts
    for unit in range(1, model.spec.num_units - 1):  # every sublayer multiplies matrices
        work = profile.units[unit]
        assert work.forward_flops > 0 and work.backward_flops > work.forward_flops / 2
        assert work.saved_bytes > 0 and work.output_bytes > 0


def test_every_builtin_adapter_is_registered_and_config_knows_the_text_types():
    adapters = {a.family: a for a in registered_adapters()}
    assert set(FAMILIES) <= set(adapters)
    text_types = {t for a in registered_adapters("transformers") for t in a.model_types}
    assert text_types == set(TEXT_MODEL_TYPES)
    assert {a.family for a in registered_adapters("timm")} == set(IMAGE_FAMILIES)


def test_unsupported_models_fail_with_a_message_naming_the_key():
    with pytest.raises(ValueError, match="model.name: no adapter for the transformers model type"):
        build_model(
            ModelConfig(name="albert", family="bert"),
            task="classification",
            num_classes=2,
            device="meta",
        )
    with pytest.raises(
        ValueError, match="model.name: 'swin_tiny_patch4_window7_224' is a timm SwinTransformer"
    ):
        build_model(
            ModelConfig(name="swin_tiny_patch4_window7_224"),
            task="classification",
            num_classes=2,
            device="meta",
        )


# Published sizes (millions of parameters, sequence classification with 2 labels).
HUB_SIZES = {
    "bert-base-uncased": 109.5,
    "roberta-base": 124.6,
    "FacebookAI/xlm-roberta-base": 278.0,
    "google/electra-base-discriminator": 109.5,
    "microsoft/deberta-v3-base": 184.4,
    "microsoft/deberta-v3-large": 435.1,
    "distilbert-base-uncased": 67.0,
    "answerdotai/ModernBERT-base": 149.6,
    "answerdotai/ModernBERT-large": 395.8,
}


@pytest.mark.parametrize("hub_id", list(HUB_SIZES))
def test_known_hub_checkpoints_plan_offline_with_their_published_sizes(hub_id):
    from pipetransformer.models.text_models import KNOWN_HUB_CONFIGS

    model_type, _ = KNOWN_HUB_CONFIGS[hub_id]
    spec = build_model(
        ModelConfig(name="bert", model_name_or_path=hub_id),
        task="classification",
        num_classes=2,
        device="meta",
    ).spec
    assert spec.family == model_type
    assert sum(spec.unit_param_counts) / 1e6 == pytest.approx(HUB_SIZES[hub_id], rel=0.005)


def test_plan_predict_runs_offline_for_deberta():
    """`plan --predict` from the meta device for the family with the widest activations
    (DeBERTa-v3-base's hidden state carries its 512-row relative-position table)."""
    from helpers import run_cli

    result = run_cli(
        "plan",
        "configs/bert_sst2.yaml",
        "model.model_name_or_path=microsoft/deberta-v3-base",
        "--predict",
        "--device",
        "h100-sxm",
    )
    assert result.returncode == 0, result.stderr
    assert "PipeTransformer:" in result.stdout and "trajectory" in result.stdout


def test_the_documented_user_adapter_runs_as_written(tmp_path, monkeypatch):
    """docs/models.md's CamemBERT adapter, copied from the page into a module named by
    `model.adapters`: build_model imports it and cuts CamemBERT exactly."""
    import re
    import sys
    from pathlib import Path

    from pipetransformer.models import registry

    page = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    (source,) = re.findall(r"```python\n(# my_adapters\.py\n.*?)```", page, flags=re.S)
    (tmp_path / "my_adapters.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ModelConfig(
        name="camembert", family="bert", adapters=["my_adapters"], kwargs=FAMILIES["roberta"].kwargs
    )
    try:
        for task in ("classification", "question_answering"):
            torch.manual_seed(0)
            model = build_model(config, task=task, num_classes=2, vocab_size=50, max_seq_length=16)
            assert model.spec.family == "camembert"
            assert type(model.source).__name__.startswith("Camembert")
            model.eval()
            inputs = text_batch()
            assert torch.equal(model(*inputs), library_forward(FAMILIES["roberta"], model, inputs))
    finally:
        registry._ADAPTERS.pop("camembert", None)
        sys.modules.pop("my_adapters", None)
    with pytest.raises(ValueError, match="model.adapters: cannot import 'no_such_module'"):
        build_model(
            ModelConfig(name="bert", adapters=["no_such_module"]),
            task="classification",
            num_classes=2,
            device="meta",
        )


def test_random_text_models_use_the_word_vocabularys_special_tokens():
    """A random model is trained on the word vocabulary data/text.py builds: padding,
    [CLS] and [SEP] must be the ids that vocabulary gives them (RoBERTa's positions and
    every embedding's padding row depend on the padding id)."""
    from pipetransformer.data.text import WordVocabTokenizer
    from pipetransformer.models.text_models import WORD_VOCAB_SPECIAL_TOKENS

    vocab = WordVocabTokenizer(["a b c"])
    assert WORD_VOCAB_SPECIAL_TOKENS["pad_token_id"] == vocab.pad_id == vocab.vocab["[PAD]"]
    assert WORD_VOCAB_SPECIAL_TOKENS["cls_token_id"] == vocab.cls_id == vocab.vocab["[CLS]"]
    assert WORD_VOCAB_SPECIAL_TOKENS["sep_token_id"] == vocab.sep_id == vocab.vocab["[SEP]"]
    for name in TEXT_FAMILIES:
        assert FAMILIES[name].build(device="meta").source.config.pad_token_id == vocab.pad_id


def test_timm_export_keeps_a_pretrained_tag_and_licence_only_for_pretrained_weights(tmp_path):
    """A model trained from scratch claims no hub checkpoint's provenance; one fine-tuned
    from hub weights keeps its source's tag and licence. Both carry the run's
    normalisation and read back through timm without channel warnings."""
    import json

    import timm

    from pipetransformer.models import ExportInfo, export_model

    model = FAMILIES["vit"].build()
    assert model.source.pretrained_cfg.get("tag")  # timm names the default weights' tag
    args = {**FAMILIES["vit"].kwargs, "num_classes": 10, "in_chans": 1, "img_size": 8}
    for pretrained in (False, True):
        out = tmp_path / str(pretrained)
        info = ExportInfo(
            model_args=args, image_mean=(0.3,), image_std=(0.2,), pretrained=pretrained
        )
        export_model(model, out, info)
        cfg = json.loads((out / "config.json").read_text())["pretrained_cfg"]
        assert ("tag" in cfg and "license" in cfg) == pretrained
        assert (cfg["mean"], cfg["std"], cfg["input_size"]) == ([0.3], [0.2], [1, 8, 8])
        loaded = timm.create_model(f"local-dir:{out}", pretrained=True)
        resolved = timm.data.resolve_data_config({}, model=loaded)
        assert (list(resolved["mean"]), list(resolved["std"]), resolved["crop_pct"]) == (
            [0.3],
            [0.2],
            1.0,
        )
