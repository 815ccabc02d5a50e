"""Every family trains through the trainer's own code paths: a 2-stage pipeline that packs
into one stage (AutoPipe) whose freed process becomes a second replica (AutoDP), moving
units and momentum between ranks, equals single-process training with the same freeze
schedule (losses at every step 1e-5, final weights rtol 1e-4 / atol 1e-5: float32
summation order only, as tests/test_elastic.py); resumed from its checkpoint after the
transition it ends the same; its checkpoint exports in the library's own format, which the
library loads with the trained model's logits, bit for bit.

One launch of 2 gloo workers runs every family one after the other (the suite must stay
fast): text families on SST-2-like sentences (tests/datagen.py), image families on the
digits; each text family once more packed (data.padding packed: packed shapes through the
pipeline's stage boundaries, the frozen prefix packed in DDP), against the same reference,
without its resume (tests/test_padding.py resumes a packed run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import FAMILIES, IMAGE_SIZE, SEQ_LEN, TEXT_FAMILIES, Family
from helpers import run_workers
from reference import reference_run, step_losses
from workers import elastic_runs

from pipetransformer.config import config_from_dict
from pipetransformer.data import build_data
from pipetransformer.export import export_run
from pipetransformer.models import build_model

pytestmark = pytest.mark.distributed


def family_config(family: Family, sst2_root: Path) -> dict:
    if family.text:
        data = {
            "name": "sst2",
            "root": str(sst2_root),
            "max_seq_length": SEQ_LEN,
            "train_subset": 32,
            "eval_subset": 16,
        }
    else:
        data = {"name": "digits", "image_size": IMAGE_SIZE, "train_subset": 32, "eval_subset": 16}
    return {
        "trainer": {
            "epochs": 2,
            "seed": 0,
            "global_batch_size": 16,
            "nproc_per_node": 2,
            "progress_bar": False,
            "log_interval_steps": 1,
        },
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "lr_schedule": "constant"},
        "pipeline": {"initial_pipe_len": 2, "num_micro_batches": 2, "balance": "params"},
        # Three of four layers freeze at the end of the first epoch.
        "freeze": {"strategy": "manual", "manual_schedule": [3], "interval_steps": None},
        "autopipe": {"lambda_frozen": 0.02},
        "checkpoint": {"keep_best": False},
        "model": {"name": family.name, "kwargs": {**family.kwargs, **family.dropout_off}},
        "data": data,
    }


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory, sst2_dir):
    root = tmp_path_factory.mktemp("families")
    runs = [(name, family_config(family, sst2_dir)) for name, family in FAMILIES.items()]
    for name in TEXT_FAMILIES:  # at 32 tokens: two sentences fill a row of the longest
        config = family_config(FAMILIES[name], sst2_dir)
        data = {**config["data"], "padding": "packed", "max_seq_length": 2 * SEQ_LEN}
        runs.append((f"{name}-packed", {**config, "data": data}))
    # Each unpacked run is also resumed from its checkpoint at the end of epoch 1 (step 2:
    # after the transition), at the new frozen boundary and layout.
    results = run_workers(elastic_runs, 2, runs, str(root), 2, set(FAMILIES))
    return root, dict(runs), results[0]


def _trained_model(config_dict: dict, state: dict):
    config = config_from_dict(config_dict)
    data = build_data(config.data, seed=0)
    model = build_model(
        config.model,
        task=data.task,
        num_classes=data.num_classes,
        in_chans=data.in_chans,
        image_size=data.image_size,
        vocab_size=data.vocab_size,
        max_seq_length=data.max_seq_length,
    )
    model.load_state_dict(state)
    return model.eval(), data


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _assert_state_equal(state: dict, ref_state: dict) -> None:
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(
            state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.mark.parametrize("name", list(FAMILIES) + [f"{n}-packed" for n in TEXT_FAMILIES])
def test_a_transition_trains_every_family_as_one_process_does(family_runs, name):
    root, configs, results = family_runs
    run_dir = root / name
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["pipe_len"], m["dp_degree"]) for m in metrics] == [(2, 1), (1, 2)]
    assert [m["num_frozen_layers"] for m in metrics] == [0, 3]
    events = _events(run_dir)
    assert sum(e["units_moved"] > 0 for e in events if e["kind"] == "transition") == 1

    ref_losses, ref_state, _ = reference_run(config_from_dict(configs[name]))
    got = step_losses(run_dir)
    assert len(got) == len(ref_losses) == 4
    for step, (a, b) in enumerate(zip(got, ref_losses)):
        assert a == pytest.approx(b, abs=1e-5), f"step {step}"
    _assert_state_equal(results[name]["state"][0], ref_state)
    if name.endswith("-packed"):  # rows held two sentences: about half the tokens of 32 each
        assert all(m["padded_tokens"] < 0.6 * 32 * 2 * SEQ_LEN for m in metrics)
        return

    # Resumed from the checkpoint after the transition: the same steps, the same weights.
    resumed = root / f"{name}-resumed"
    (event,) = [e for e in _events(resumed) if e["kind"] == "resume"]
    assert (event["global_step"], event["num_frozen_layers"]) == (2, 3)
    assert (event["pipe_len"], event["dp_degree"]) == (1, 2)
    resumed_losses = step_losses(resumed)
    for step, (a, b) in enumerate(zip(resumed_losses, ref_losses, strict=True)):
        assert a == pytest.approx(b, abs=1e-5), f"resumed, step {step}"
    _assert_state_equal(results[f"{name}-resumed"]["state"][0], ref_state)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_exports_in_its_library_format_with_the_trained_logits(
    family_runs, tmp_path, name
):
    root, configs, results = family_runs
    family = FAMILIES[name]
    out = tmp_path / "export"
    export_run(root / name, out)
    model, data = _trained_model(configs[name], results[name]["state"][0])
    inputs, _ = data.eval.fetch(range(8))
    with torch.no_grad():
        want = model(*inputs)
        if family.text:
            from transformers import AutoModelForSequenceClassification

            exported = AutoModelForSequenceClassification.from_pretrained(out).eval()
            assert type(exported) is type(model.source)
            ids, types, mask = inputs
            kwargs = {"input_ids": ids, "attention_mask": mask}
            if family.token_types:
                kwargs["token_type_ids"] = types
            got = exported(**kwargs).logits
        else:
            import timm

            exported = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
            assert type(exported) is type(model.source)
            got = exported(*inputs)
    assert torch.equal(got, want)
    assert {"config.json", "model.safetensors"} <= {p.name for p in Path(out).iterdir()}
