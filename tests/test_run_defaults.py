"""Defaults that resolve from what the run is (issue 62): a shipped config that names
pretrained weights takes the settings its pretrained benchmarks chose (the file's
`when_pretrained:`), a pretrained timm model its own architecture and input size, one's own
images say the size they are resized to, and a missing model directory is named before
anything else. Each was a trap: a default right for the tiny random model and silently
wrong for the case the docs point to. No worker starts here."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from helpers import ROOT, run_cli
from test_benchmark_settings import shell_benchmark_overrides

from pipetransformer.config import ConfigError, load_config, pretrained_settings

CONFIGS = ROOT / "configs"
SST2 = CONFIGS / "bert_sst2_local.yaml"
SQUAD = CONFIGS / "bert_squad_local.yaml"
QUICKSTART = CONFIGS / "quickstart.yaml"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A local model directory as the README's $MINILM names one (its contents are read by
    the workers, not by the config)."""
    path = tmp_path / "minilm"
    path.mkdir()
    return path


def value_of(config, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def test_the_readmes_minilm_command_runs_as_the_benchmarks_chose(model_dir, monkeypatch):
    """The README's "Offline pretrained BERT" command as written, against the time-to-target
    ground's run of the rule it chose (benchmarks/ttt_grounds.py `memory_aware_late` on the
    pipeline ground, issue 59): the same rate, warm-up, batch, epochs, rule, cadence,
    compression, embedding and cache; only the ground's data subset, sequence length and
    memory cap are its own."""
    import harness
    import ttt_grounds
    from test_doc_commands import documented_commands

    (command,) = {
        c
        for where, c in documented_commands()
        if where == "README.md" and "$MINILM" in c and "save_model" not in c
    }
    words = shlex.split(command.replace("$MINILM", str(model_dir)))
    readme = load_config(ROOT / words[2], words[3:])
    monkeypatch.setattr(harness, "minilm_dir", lambda script: str(model_dir))
    from test_time_to_target import pipeline_ground_args

    ground = load_config(
        SST2,
        [
            *ttt_grounds.workload(pipeline_ground_args()),
            *ttt_grounds.CANDIDATES["memory_aware_late"][1],
        ],
    )
    for key in (
        "optimizer.lr",
        "optimizer.warmup_steps",
        "trainer.global_batch_size",
        "trainer.epochs",
        "freeze.warmup_epochs",
        "freeze.strategy",
        "freeze.interval_steps",
        "freeze.alpha",
        "freeze.memory_aware",
        "freeze.eq1_bound",
        "autopipe.compression",
        "model.kwargs",
        "cache.enabled",
    ):
        assert value_of(readme, key) == value_of(ground, key), key
    assert readme.embedding_frozen and ground.embedding_frozen
    assert readme.freeze.memory_aware and readme.freeze.warmup_epochs == 2
    assert readme.data.train_subset is None  # all of the user's data


def test_the_sst2_config_takes_its_pretrained_settings_where_weights_are_named(model_dir):
    random = load_config(SST2)
    assert (random.optimizer.lr, random.freeze.warmup_epochs) == (5e-4, 2)
    assert random.data.train_subset == 8000 and random.model.kwargs
    named = load_config(SST2, [f"model.model_name_or_path={model_dir}"])
    assert (named.optimizer.lr, named.freeze.warmup_epochs) == (1e-4, 2)
    assert named.freeze.memory_aware and not named.freeze.eq1_bound  # section 23b's choice
    assert named.autopipe.compression == "memory" and not random.freeze.memory_aware
    assert named.model.kwargs == {} and named.data.train_subset is None
    # What the command line sets wins; the start line lists what applied and what it replaced.
    given = [f"model.model_name_or_path={model_dir}", "optimizer.lr=3e-5"]
    assert load_config(SST2, given).optimizer.lr == 3e-5
    applied = {key: (value, before) for key, value, before in pretrained_settings(SST2, given)}
    assert "optimizer.lr" not in applied
    assert applied["freeze.memory_aware"] == (True, False)
    assert applied["autopipe.compression"] == ("memory", "params")
    assert applied["data.train_subset"] == (None, 8000)
    assert pretrained_settings(SST2, []) == []
    # A checkpoint of the tiny model is trained weights, not a named pretrained model: its
    # architecture stays the file's.
    checkpoint = load_config(SST2, ["model.checkpoint_path=tiny.pt"])
    assert checkpoint.model.kwargs and checkpoint.embedding_frozen


def test_the_squad_config_starts_as_ddp_and_takes_its_benchmarks_settings(model_dir):
    """Its 2-stage start made the full system 0.6x DDP on 2 processes (docs/benchmarks.md
    section 18): it starts at the shortest pipeline that fits; with pretrained weights, the
    full files and bert_squad_minilm.sh's rate, length and epochs."""
    from pipetransformer.config import World
    from pipetransformer.planning import PlanContext, describe_model

    config = load_config(SQUAD)
    assert config.pipeline.initial_pipe_len == "auto"
    plan = PlanContext.build(config, describe_model(config), World(2, 2), None, None)
    assert plan.initial_pipe_len == 1
    named = load_config(SQUAD, [f"model.model_name_or_path={model_dir}"])
    _, overrides = shell_benchmark_overrides("bert_squad_minilm.sh", model_dir)
    bench = load_config(SQUAD, overrides)
    for key in ("optimizer.lr", "trainer.epochs", "data.max_seq_length", "data.doc_stride"):
        assert value_of(named, key) == value_of(bench, key), key
    assert named.data.train_subset is None and named.data.eval_subset is None
    assert named.freeze.warmup_epochs == 0 and named.model.kwargs == {}


def test_when_pretrained_is_checked_even_where_it_does_not_apply(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("model:\n  name: bert\nwhen_pretrained:\n  optimizer.lrr: 0.0001\n")
    with pytest.raises(ConfigError, match=r"^when_pretrained: optimizer\.lrr: unknown key"):
        load_config(config)
    config.write_text("when_pretrained:\n  - optimizer.lr\n")
    with pytest.raises(ConfigError, match="when_pretrained: expected a mapping"):
        load_config(config)


def test_a_pretrained_timm_model_takes_its_own_architecture_and_input_size():
    """The quickstart with a named pretrained ViT planned an 8-layer 269k-parameter model at
    16 pixels (the config's tiny sizes): now the model's own 12 layers at 224, said on the
    start line; sizes set on purpose are refused in one line."""
    result = run_cli(
        "plan", str(QUICKSTART), "model.name=vit_small_patch16_224", "model.pretrained=true"
    )
    assert result.returncode == 0, result.stderr
    assert "model vit_small_patch16_224: 12 layers" in result.stdout
    (said,) = [line for line in result.stderr.splitlines() if "when_pretrained" in line]
    assert "model.kwargs {} (random weights: {" in said
    assert "data.image_size 224 (vit_small_patch16_224's pretrained input size)" in said
    refused = run_cli(
        "plan",
        str(QUICKSTART),
        "model.name=vit_small_patch16_224",
        "model.pretrained=true",
        "model.kwargs={depth: 4}",
    )
    assert refused.returncode == 2
    assert "model.kwargs: depth would change vit_small_patch16_224's architecture" in (
        refused.stderr
    )


def test_own_images_are_not_shrunk_to_the_digits_size_silently():
    """The quickstart set data.image_size: 16 for its 8x8 digits, which resized one's own
    images (data.name=hf_image) to 16 pixels unsaid: the digits keep 16 as their dataset's
    size, one's own images get the documented 224 and the start line says it."""
    from pipetransformer.cli.preflight import resolve_model_settings
    from pipetransformer.data.checks import data_facts

    quickstart = load_config(QUICKSTART)
    assert quickstart.data.image_size is None and data_facts(quickstart.data).image_size == 16
    folder = load_config(QUICKSTART, ["data.name=imagefolder"])
    _, overrides, notes = resolve_model_settings(folder)
    assert overrides == [] and notes == ["data.image_size 224: your images are resized to 224x224"]
    sized = load_config(QUICKSTART, ["data.name=imagefolder", "data.image_size=32"])
    assert resolve_model_settings(sized)[2] == []


def test_a_missing_model_directory_is_named_before_the_data_check():
    result = run_cli("train", str(QUICKSTART), "model.model_name_or_path=/nonexistent")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "pipetransformer: config error: model.model_name_or_path: no such directory: /nonexistent"
    )


def test_a_missing_config_path_names_the_nearest_config():
    result = run_cli("train", "configs/quickstart.yml")
    assert result.returncode == 2
    assert (
        "config file not found: configs/quickstart.yml (did you mean configs/quickstart.yaml?)"
        in (result.stderr)
    )
