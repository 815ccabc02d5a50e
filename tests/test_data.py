"""Data modules: sample ids, shapes, subsets, and errors that name the bad path."""

import re
from pathlib import Path

import pytest
import torch

from pipetransformer.config import ConfigError, DataConfig, load_config
from pipetransformer.data import build_data
from pipetransformer.data.checks import check_data_config, data_facts
from pipetransformer.data.text import WordVocabTokenizer, read_sst2_tsv


def test_digits_split_shapes_and_ids():
    bundle = build_data(DataConfig(name="digits", image_size=16), seed=0)
    assert (len(bundle.train), len(bundle.eval)) == (1437, 360)
    sample_id, (image,), label = bundle.train[5]
    assert sample_id == 5 and image.shape == (1, 16, 16) and 0 <= int(label) < 10
    (images,), labels = bundle.train.fetch([5, 6])
    assert torch.equal(images[0], image) and images.shape == (2, 1, 16, 16)
    assert torch.equal(bundle.train.targets([5, 6]), labels)
    assert bundle.num_classes == 10 and bundle.in_chans == 1
    # The split is fixed: independent of the run's seed.
    other = build_data(DataConfig(name="digits", image_size=16), seed=3)
    assert torch.equal(other.eval.fetch([0])[0][0], bundle.eval.fetch([0])[0][0])


def test_subsets_are_seeded_and_renumbered():
    a = build_data(
        DataConfig(name="digits", image_size=8, train_subset=100, eval_subset=50), seed=1
    )
    b = build_data(
        DataConfig(name="digits", image_size=8, train_subset=100, eval_subset=50), seed=1
    )
    c = build_data(DataConfig(name="digits", image_size=8, train_subset=100), seed=2)
    assert len(a.train) == 100 and len(a.eval) == 50
    assert torch.equal(a.train.fetch(range(100))[0][0], b.train.fetch(range(100))[0][0])
    assert not torch.equal(a.train.fetch(range(100))[0][0], c.train.fetch(range(100))[0][0])


def test_sst2_local_tsv(sst2_dir):
    config = DataConfig(name="sst2", root=str(sst2_dir), max_seq_length=32, train_subset=300)
    bundle = build_data(config, seed=0)
    assert len(bundle.train) == 300 and len(bundle.eval) == 120
    sample_id, (ids, types, mask), label = bundle.eval[0]
    # A sample on its own is padded to its length rounded up to 8 (data.padding: batch).
    length = bundle.eval.lengths[0]
    assert ids.shape == types.shape == mask.shape == (-(-length // 8) * 8,)
    assert int(mask.sum()) == length
    assert bundle.eval.fetch([0], 32)[0][0].shape == (1, 32)
    assert ids[0] == 2 and int(label) in (0, 1)  # [CLS] first
    assert mask.sum() == (ids != 0).sum()
    assert bundle.vocab_size > 30 and bundle.task == "classification"


def test_sst2_full_sizes(shared_data):
    """The real training set is what the data README says (the other SST-2 tests read
    files of its format that they write)."""
    sentences, labels = read_sst2_tsv(shared_data / "sst2" / "train.tsv")
    assert len(sentences) == 67349 and set(labels) == {0, 1}


def test_word_tokenizer_is_deterministic_and_truncates():
    tok = WordVocabTokenizer(["a good movie .", "a bad movie !", "good good"])
    assert tok.vocab["good"] == 5  # most frequent word first after the specials
    ids, types, mask = tok.encode_pairs(["good movie", "unseen words here and more"], None, 5)
    assert ids[0].tolist() == [2, 5, tok.vocab["movie"], 3, 0]
    assert ids[1].tolist() == [2, 1, 1, 1, 3]  # unknown words, truncated, [SEP] kept
    assert mask[0].tolist() == [1, 1, 1, 1, 0]


def test_malformed_and_missing_files_name_the_path(tmp_path):
    (tmp_path / "train.tsv").write_text("sentence\tlabel\ngood\t1\nbad line without label\n")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nfine\t0\n")
    with pytest.raises(ValueError, match=r"train.tsv:3"):
        build_data(DataConfig(name="sst2", root=str(tmp_path)), seed=0)
    (tmp_path / "train.tsv").write_text("text,label\ngood,1\n")
    with pytest.raises(ValueError, match="train.tsv"):
        build_data(DataConfig(name="sst2", root=str(tmp_path)), seed=0)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_data(DataConfig(name="sst2", root=str(tmp_path / "nowhere")), seed=0)
    with pytest.raises(ConfigError, match="data.root"):
        check_data_config(DataConfig(name="sst2", root=str(tmp_path / "nowhere")))


def make_imagefolder(root, classes=("cat", "dog"), per_class=3):
    from PIL import Image

    for split in ("train", "val"):
        for i, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for j in range(per_class):
                Image.new("RGB", (20, 24), color=(40 * i, 10 * j, 200)).save(folder / f"{j}.png")


def test_imagefolder(tmp_path):
    make_imagefolder(tmp_path)
    bundle = build_data(DataConfig(name="imagefolder", root=str(tmp_path), image_size=16), seed=0)
    assert len(bundle.train) == 6 and bundle.num_classes == 2
    (images,), labels = bundle.train.fetch([0, 5])
    assert images.shape == (2, 3, 16, 16) and labels.tolist() == [0, 1]
    assert not bundle.train.random_inputs
    augmented = build_data(
        DataConfig(name="imagefolder", root=str(tmp_path), image_size=16, augment=True), seed=0
    )
    assert augmented.train.random_inputs and not augmented.eval.random_inputs
    assert data_facts(DataConfig(name="imagefolder", root=str(tmp_path))).num_classes == 2


def test_imagefolder_missing_split_names_the_path(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="val"):
        build_data(DataConfig(name="imagefolder", root=str(tmp_path)), seed=0)
    with pytest.raises(ConfigError, match="val"):
        check_data_config(DataConfig(name="imagefolder", root=str(tmp_path)))


def test_synthetic_images_are_imagenet_shaped_and_a_function_of_seed_and_id():
    config = DataConfig(name="synthetic", image_size=16, train_subset=40, eval_subset=8)
    bundle = build_data(config, seed=0)
    assert (len(bundle.train), len(bundle.eval)) == (40, 8)
    assert (bundle.num_classes, bundle.in_chans, bundle.image_size) == (1000, 3, 16)
    assert data_facts(config).num_classes == 1000 and not bundle.train.random_inputs
    sample_id, (image,), label = bundle.train[7]
    assert sample_id == 7 and image.shape == (3, 16, 16) and 0 <= int(label) < 1000
    (images,), labels = bundle.train.fetch([7, 3, 7])
    assert torch.equal(images[0], image) and torch.equal(images[2], image)
    assert torch.equal(bundle.train.targets([7, 3, 7]), labels) and labels[0] == label
    # Rebuilt (another process, a resumed attempt): the same samples; another seed: others.
    again = build_data(config, seed=0)
    assert torch.equal(again.train.fetch(range(40))[0][0], bundle.train.fetch(range(40))[0][0])
    other = build_data(DataConfig(name="synthetic", image_size=16), seed=1)
    assert not torch.equal(other.train.fetch([0])[0][0], bundle.train.base.fetch([0])[0][0])
    assert len(other.train) == 1_281_167 and len(other.eval) == 50_000
    assert data_facts(DataConfig(name="synthetic")).image_size == 224  # ImageNet's by default
    labels = other.train.targets(range(2000))
    assert labels.unique().numel() > 800  # spread over the 1000 classes
    with pytest.raises(ConfigError, match="data.root: 'synthetic' generates"):
        DataConfig(name="synthetic", root="/data/imagenet")


def test_cifar_without_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.root"):
        build_data(DataConfig(name="cifar100", root=str(tmp_path)), seed=0)
    with pytest.raises(ConfigError, match="data.root"):
        check_data_config(DataConfig(name="cifar10", root=str(tmp_path / "absent")))


def test_eval_root_is_checked_before_any_worker(squad_files, sst2_dir, tmp_path):
    from pipetransformer.data.validate import validate_data_files

    train, evaluation = str(squad_files.train), str(squad_files.eval)
    for root in (train, None):  # training data from a file, or from `datasets`
        check_data_config(DataConfig(name="squad", root=root, eval_root=evaluation))
    missing = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=re.escape(f"data.eval_root: {missing} does not exist")):
        check_data_config(DataConfig(name="squad", root=train, eval_root=str(missing)))
    with pytest.raises(ConfigError, match="data.eval_root: .* is not a file"):
        check_data_config(DataConfig(name="squad", root=train, eval_root=str(tmp_path)))
    # Only squad reads it: elsewhere a set eval_root would be silently ignored, so the
    # config itself refuses it (every command, `plan` included, and overrides alike).
    for name, root in (("sst2", str(sst2_dir)), ("digits", None)):
        with pytest.raises(ConfigError, match=f"data.eval_root: only squad .*'{name}'"):
            DataConfig(name=name, root=root, eval_root=evaluation)
    with pytest.raises(ConfigError, match="data.eval_root: only squad .*'sst2'"):
        load_config(None, ["data.name=sst2", f"data.eval_root={evaluation}"])
    # A malformed evaluation file is one line naming it, also when training data is fetched.
    cut = tmp_path / "cut.json"
    cut.write_text(Path(evaluation).read_text()[:5000])
    for root in (train, None):
        with pytest.raises(ConfigError, match=re.escape(f"{cut}: not valid JSON")):
            validate_data_files(DataConfig(name="squad", root=root, eval_root=str(cut)))


def test_sst2_holdout_is_one_fixed_test_set_disjoint_from_training(sst2_dir):
    """data.holdout: the same held-out sentences for every seed (every variant of a
    comparison is scored on them), none of them trained on."""
    from pipetransformer.config import DataConfig
    from pipetransformer.data import build_data
    from pipetransformer.data.text import holdout_split, read_sst2_tsv

    sentences, labels = read_sst2_tsv(sst2_dir / "train.tsv")
    (pool, _), (held, held_labels) = holdout_split(sentences, labels, 200)
    assert len(held) == 200 and len(pool) == len(sentences) - 200
    assert not set(map(id, held)) & set(map(id, pool))  # positions, not equal strings
    again = holdout_split(sentences, labels, 200)[1]
    assert again == (held, held_labels)
    config = DataConfig(name="sst2", root=str(sst2_dir), holdout=100, train_subset=64)
    bundles = [build_data(config, seed=s) for s in (0, 1)]
    assert len(bundles[0].eval) == 100 and len(bundles[0].train) == 64
    # The same sentences (a random model's word vocabulary comes from the training subset,
    # which differs by seed, so compare what does not depend on it).
    assert torch.equal(bundles[0].eval.target_tensor, bundles[1].eval.target_tensor)
    lengths = [b.eval.inputs[2].sum(dim=1) for b in bundles]  # tokens per sentence
    assert torch.equal(lengths[0], lengths[1])


def test_sst2_holdout_shares_text_with_training_and_says_so(shared_data, caplog):
    """SST-2's training rows are phrases of the same sentences, so held-out rows share text
    with training rows (most occur word for word inside another training phrase, where no
    dev sentence does), and the run says so. Needs the real SST-2 (the overlap is a
    property of its phrases, which generated rows do not have)."""
    from pipetransformer.config import DataConfig
    from pipetransformer.data import build_data
    from pipetransformer.data.text import holdout_split, read_sst2_tsv

    sentences, labels = read_sst2_tsv(shared_data / "sst2" / "train.tsv")
    (pool, _), (held, _) = holdout_split(sentences, labels, 5000)
    text = " " + " \n ".join(p.strip() for p in pool) + " "
    inside = sum(f" {h.strip()} " in text for h in held[:500])
    dev, _ = read_sst2_tsv(shared_data / "sst2" / "dev.tsv")
    assert inside > 400 and sum(f" {d.strip()} " in text for d in dev[:500]) < 5
    config = DataConfig(name="sst2", root=str(shared_data / "sst2"), holdout=300, train_subset=64)
    with caplog.at_level("WARNING"):
        build_data(config, seed=0)
    assert "share text with the phrases that train" in caplog.text
