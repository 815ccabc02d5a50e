"""A user's own labelled images (data.name 'hf_image': a `datasets` table with an image
column, data/table.py and data/vision.py): each form it is kept in reads the same images and
labels, through ImageFolder's transforms; bad data is one line before any process; and a
run through a freeze transition whose export, loaded by timm, names the classes and gives
the run's score. Every image is one of scikit-learn's digits, written by the test."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli, train_offline
from test_failures import one_line_error

from pipetransformer.config import ConfigError, DataConfig, check_config, config_from_dict
from pipetransformer.data import build_data, image_normalization, label_names

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digit_images(lo: int, hi: int) -> tuple[list, list[str]]:
    """Digits lo..hi-1 as 8x8 greyscale PIL images, and their names as labels."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = [
        Image.fromarray((digits.images[i] * 16).clip(0, 255).astype("uint8"), "L")
        for i in range(lo, hi)
    ]
    return images, [NAMES[t] for t in digits.target[lo:hi]]


def image_table(lo: int, hi: int, label_feature=None):
    import datasets

    images, labels = digit_images(lo, hi)
    features = {"image": datasets.Image(), "label": label_feature or datasets.Value("string")}
    if label_feature is not None:
        labels = [label_feature.str2int(name) for name in labels]
    return datasets.Dataset.from_dict(
        {"image": images, "label": labels}, features=datasets.Features(features)
    )


def write_image_folder(root: Path, split: str, lo: int, hi: int) -> None:
    images, labels = digit_images(lo, hi)
    for index, (image, label) in enumerate(zip(images, labels)):
        (root / split / label).mkdir(parents=True, exist_ok=True)
        image.save(root / split / label / f"{lo + index:04d}.png")


def samples(dataset) -> list[tuple[bytes, int]]:
    """Every (input tensor, target) of a split, as comparable values, in a fixed order."""
    (inputs,), targets = dataset.fetch(range(len(dataset)))
    return sorted((x.numpy().tobytes(), int(t)) for x, t in zip(inputs, targets))


def test_each_form_of_an_image_table_reads_the_same_images_through_imagefolder_transforms(
    tmp_path,
):
    import datasets
    from torchvision import transforms as T

    # The same 48 training and 24 evaluation digits: as torchvision's ImageFolder layout
    # (read by data.name imagefolder, and by `datasets` as a directory of class folders),
    # as a save_to_disk DatasetDict, and as Parquet files.
    write_image_folder(tmp_path / "folder", "train", 0, 48)
    write_image_folder(tmp_path / "folder", "val", 48, 72)
    tables = datasets.DatasetDict({"train": image_table(0, 48), "validation": image_table(48, 72)})
    tables.save_to_disk(str(tmp_path / "disk"))
    tables["train"].to_parquet(str(tmp_path / "train.parquet"))
    tables["validation"].to_parquet(str(tmp_path / "dev.parquet"))
    files = {"train": str(tmp_path / "train.parquet"), "validation": str(tmp_path / "dev.parquet")}
    reference = build_data(
        DataConfig(name="imagefolder", root=str(tmp_path / "folder"), image_size=16), seed=0
    )
    folder_names = sorted(set(digit_images(0, 48)[1]))
    cases = [
        dict(path=str(tmp_path / "folder")),
        dict(path=str(tmp_path / "disk")),
        dict(path="parquet", data_files=files),
    ]
    for case in cases:
        config = DataConfig(name="hf_image", image_size=16, **case)
        bundle = build_data(config, seed=0)
        # Labels sorted by name, as ImageFolder numbers its class folders.
        assert bundle.label_names == folder_names == label_names(config), case
        assert bundle.num_classes == len(folder_names) and bundle.in_chans == 3, case
        assert (len(bundle.train), len(bundle.eval)) == (48, 24), case
        assert not bundle.train.random_inputs, case  # AutoCache may cache it
        # The very tensors (and targets) ImageFolder's loader gives for the same images.
        assert samples(bundle.train) == samples(reference.train), case
        assert samples(bundle.eval) == samples(reference.eval), case
    assert image_normalization(config) == image_normalization(
        DataConfig(name="imagefolder", root=str(tmp_path / "folder"))
    )
    # In table order, each sample is its image through the evaluation transform.
    images, _ = digit_images(48, 72)
    normalization = image_normalization(config)
    transform = T.Compose(
        [
            T.Resize(16),
            T.CenterCrop(16),
            T.ToTensor(),
            T.Normalize(normalization.mean, normalization.std),
        ]
    )
    (inputs,), _ = build_data(config, seed=0).eval.fetch(range(24))
    torch.testing.assert_close(inputs, torch.stack([transform(i.convert("RGB")) for i in images]))


def test_classlabel_names_holdout_subsets_and_augmentation(tmp_path):
    import datasets

    # No evaluation split: a tenth held out; ClassLabel names keep their own order.
    feature = datasets.ClassLabel(names=list(reversed(NAMES)))
    image_table(0, 60, feature).save_to_disk(str(tmp_path / "one"))
    config = DataConfig(name="hf_image", path=str(tmp_path / "one"), image_size=16)
    bundle = build_data(config, seed=0)
    assert bundle.label_names == list(reversed(NAMES))
    assert (len(bundle.train), len(bundle.eval)) == (54, 6)
    # Subsets are drawn per seed from the same split; ids are renumbered 0..size-1.
    subset = build_data(dataclasses.replace(config, train_subset=20), seed=3)
    assert len(subset.train) == 20
    (first,), _ = subset.train.fetch(range(20))
    (again,), _ = subset.train.fetch(range(20))
    assert torch.equal(first, again)  # the same sample id reads the same input
    augmented = build_data(dataclasses.replace(config, augment=True), seed=0)
    assert augmented.train.random_inputs and not augmented.eval.random_inputs
    # AutoCache refuses to cache augmented inputs unless told to (as for ImageFolder).
    quickstart = {"data": {"name": "hf_image", "path": str(tmp_path / "one"), "augment": True}}
    with pytest.raises(ConfigError, match="cache.allow_augmented"):
        check_config(config_from_dict({**quickstart, "cache": {"enabled": True}}))
    # `plan --predict` counts the table's training rows (it has no published size).
    from pipetransformer.planning.prediction_inputs import train_samples_for

    samples, source = train_samples_for(config_from_dict({"data": vars(config)}))
    assert samples == 54 and str(tmp_path / "one") in source


def bad_image_cases(tmp_path: Path) -> list[tuple[list[str], list[str]]]:
    import datasets

    good = tmp_path / "good"
    datasets.DatasetDict(
        {"train": image_table(0, 40), "validation": image_table(40, 50)}
    ).save_to_disk(str(good))
    text = tmp_path / "text.csv"
    text.write_text("text,label\na,1\nb,0\n")
    gap = tmp_path / "gap"
    rows = image_table(0, 20).to_dict()
    rows["image"][6] = None
    datasets.Dataset.from_dict(rows, features=image_table(0, 1).features).save_to_disk(str(gap))
    unknown = tmp_path / "unknown"
    evaluation = image_table(40, 50).to_dict()
    evaluation["label"][3] = "ten"
    datasets.DatasetDict(
        {
            "train": image_table(0, 40),
            "validation": datasets.Dataset.from_dict(
                evaluation, features=image_table(0, 1).features
            ),
        }
    ).save_to_disk(str(unknown))
    return [
        ([f"data.path={text}"], ["data.image_column", "no image column", "text, label"]),
        (
            [f"data.path={good}", "data.image_column=label"],
            ["data.image_column", "'label'", "not images"],
        ),
        ([f"data.path={good}", "data.image_column=picture"], ["'picture'", "image, label"]),
        ([f"data.path={good}", "data.label_column=class"], ["data.label_column", "image, label"]),
        ([f"data.path={gap}"], [str(gap), "row 7", "no image"]),
        ([f"data.path={unknown}"], ["split 'validation'", "row 4", "'ten'", "'zero'"]),
        (
            [f"data.path={good}", "model.kwargs={num_classes: 3, depth: 2}"],
            ["model.kwargs.num_classes", "3 outputs", "10 labels"],
        ),
        ([f"data.path={good}", "model.name=bert"], ["data.name", "image dataset"]),
        ([f"data.path={good}", "data.text_columns=image"], ["data.text_columns", "hf_image"]),
    ]


def test_bad_image_data_is_one_line_with_exit_2_and_nothing_created(tmp_path):
    for index, (overrides, words) in enumerate(bad_image_cases(tmp_path)):
        run_dir = tmp_path / f"run{index}"
        result = run_cli(
            "train", QUICKSTART, "data.name=hf_image", *overrides, "--run-dir", str(run_dir)
        )
        one_line_error(result, 2, *words)
        assert not run_dir.exists(), overrides


@pytest.mark.slow
def test_an_image_table_trains_through_a_transition_and_its_timm_export_names_the_classes(
    tmp_path,
):
    """Slow: ~20 s on 2 cores. `train` with the quickstart config and overrides on a
    save_to_disk table of 320 + 80 digits with string labels, 2 ranks, freeze transitions
    with AutoCache on; the export loads in timm, names the classes, and scores the
    evaluation images through timm's own transform exactly as the run did (its accuracy
    and its mean cross-entropy)."""
    import datasets

    datasets.DatasetDict(
        {"train": image_table(0, 320), "validation": image_table(320, 400)}
    ).save_to_disk(str(tmp_path / "digits"))
    run_dir = tmp_path / "run"
    stderr, metrics = train_offline(
        QUICKSTART,
        run_dir,
        "data.name=hf_image",
        f"data.path={tmp_path / 'digits'}",
        "data.image_size=16",
        "data.metric=f1_macro",
        "freeze.strategy=alpha_schedule",  # a transition for sure
        "freeze.warmup_epochs=0",
        "trainer.epochs=3",
        "trainer.global_batch_size=32",
        "optimizer.warmup_steps=2",
        "optimizer.lr=0.004",
        "trainer.save_model=true",
    )
    assert metrics[-1]["num_frozen_layers"] > 0
    # AutoCache served frozen layers' outputs by sample id.
    assert sum(m["cache_hits"] for m in metrics) > 0
    scores = metrics[-1]["scores"]
    assert metrics[-1]["eval_metric"] == scores["f1_macro"] and "f1" not in scores
    names = sorted(set(digit_images(0, 320)[1]))
    import yaml

    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["labels"] == names

    import timm
    from PIL import Image

    export = run_dir / "export"
    assert json.loads((export / "config.json").read_text())["pretrained_cfg"]["label_names"] == (
        names
    )
    model = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    images, labels = digit_images(320, 400)
    assert isinstance(images[0], Image.Image)
    with torch.no_grad():
        logits = model(torch.stack([transform(image.convert("RGB")) for image in images]))
    predicted = [names[i] for i in logits.argmax(-1).tolist()]
    accuracy = sum(p == t for p, t in zip(predicted, labels)) / len(labels)
    assert accuracy == pytest.approx(scores["accuracy"], abs=1e-9)
    # Every logit as the run computed it: the mean cross-entropy is the run's eval loss.
    targets = torch.tensor([names.index(label) for label in labels])
    loss = torch.nn.functional.cross_entropy(logits, targets).item()
    assert loss == pytest.approx(metrics[-1]["eval_loss"], abs=1e-5)
