import pytest
import yaml

from pipetransformer.config import Config, ConfigError, config_from_dict, config_yaml, load_config

ROOT_CONFIGS = __import__("pathlib").Path(__file__).resolve().parent.parent / "configs"


def write(tmp_path, data):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_required_keys_exist_with_defaults():
    c = Config()
    for section, key in [
        ("trainer", "epochs"),
        ("trainer", "seed"),
        ("trainer", "global_batch_size"),
        ("optimizer", "name"),
        ("optimizer", "lr"),
        ("pipeline", "initial_pipe_len"),
        ("pipeline", "num_micro_batches"),
        ("pipeline", "schedule"),
        ("freeze", "strategy"),
        ("freeze", "alpha"),
        ("model", "name"),
        ("data", "name"),
    ]:
        assert hasattr(getattr(c, section), key), f"{section}.{key}"


def test_overrides_are_typed_and_nested(tmp_path):
    c = load_config(
        write(tmp_path, {"trainer": {"epochs": 3}}),
        ["trainer.epochs=5", "optimizer.lr=0.01", "freeze.strategy=alpha_schedule"],
    )
    assert (
        c.trainer.epochs == 5 and c.optimizer.lr == 0.01 and c.freeze.strategy == "alpha_schedule"
    )
    c = load_config(None, ["model.kwargs.depth=6", "optimizer.lr=1"])
    assert c.model.kwargs == {"depth": 6} and isinstance(c.optimizer.lr, float)
    # YAML reads 3e-5 (no dot) as a string; it is still a number to the user.
    assert load_config(None, ["optimizer.lr=3e-5"]).optimizer.lr == 3e-5


@pytest.mark.parametrize(
    "data, key",
    [
        ({"trainer": {"epoch": 3}}, "trainer.epoch"),  # unknown key
        ({"trainr": {"epochs": 3}}, "trainr"),  # unknown section
        ({"trainer": {"epochs": "three"}}, "trainer.epochs"),  # wrong type
        ({"trainer": {"epochs": 2.5}}, "trainer.epochs"),
        ({"trainer": {"epochs": 0}}, "trainer.epochs"),
        ({"freeze": {"alpha": 1.5}}, "freeze.alpha"),
        ({"freeze": {"alpha": 0}}, "freeze.alpha"),
        ({"pipeline": {"schedule": "zigzag"}}, "pipeline.schedule"),
        ({"optimizer": {"name": "lamb"}}, "optimizer.name"),
        (
            {"pipeline": {"initial_pipe_len": 3}, "trainer": {"nproc_per_node": 4}},
            "pipeline.initial_pipe_len",
        ),
        (
            {"trainer": {"global_batch_size": 60}, "pipeline": {"num_micro_batches": 8}},
            "pipeline.num_micro_batches",
        ),
        ({"pipeline": {"num_micro_batches": "many"}}, "pipeline.num_micro_batches"),
        ({"freeze": {"strategy": "manual"}}, "freeze.manual_schedule"),
        ({"freeze": {"strategy": "manual", "manual_schedule": [2, 1]}}, "freeze.manual_schedule"),
        ({"model": {"name": "bert"}}, "data.name"),  # BERT on digits
        ({"trainer": {"nproc_per_node": 4}, "trainer_extra": 1}, "trainer_extra"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(tmp_path, data, key):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data))
    assert str(info.value).startswith(key), str(info.value)


def test_batch_must_split_over_every_reachable_layout(tmp_path):
    # 4 devices, K 4 -> 2 -> 1 when elastic: R reaches 4, so 4 * M must divide the batch.
    base = {
        "trainer": {"nproc_per_node": 4, "global_batch_size": 24},
        "pipeline": {"initial_pipe_len": 4, "num_micro_batches": 4},
    }
    load_config(write(tmp_path, base))  # baseline: R = 1, 24 % 4 == 0
    elastic = {**base, "freeze": {"strategy": "alpha_schedule"}}
    with pytest.raises(ConfigError, match="pipeline.num_micro_batches"):
        load_config(write(tmp_path, elastic))


def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'trainer.epochs'"):
        load_config(write(tmp_path, {"trainer": {"epocs": 3}}))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)


def test_dump_round_trips(tmp_path):
    c = load_config(ROOT_CONFIGS / "quickstart.yaml", ["trainer.epochs=2"])
    again = config_from_dict(yaml.safe_load(config_yaml(c)))
    assert again == c


@pytest.mark.parametrize("path", sorted(ROOT_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    load_config(path)


def test_cache_refuses_augmented_training_inputs_unless_allowed(tmp_path):
    data = {
        "data": {"name": "imagefolder", "root": str(tmp_path), "augment": True},
        "cache": {"enabled": True},
        "freeze": {"strategy": "gradient_norm"},
    }
    with pytest.raises(ConfigError, match="cache.allow_augmented"):
        load_config(write(tmp_path, data))
    data["cache"]["allow_augmented"] = True
    assert load_config(write(tmp_path, data)).cache.allow_augmented


def test_malformed_yaml_is_one_line_naming_the_file_line_and_column(tmp_path):
    """It was 8 lines naming "<unicode string>" instead of the file."""
    from pipetransformer.config import ConfigError, load_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  epochs: [1\n  seed: 0\n")
    with pytest.raises(ConfigError) as error:
        load_config(bad)
    message = str(error.value)
    assert "\n" not in message and "unicode string" not in message
    assert message.startswith(f"{bad}: not valid YAML: line 3, column 7: expected ',' or ']'")
    with pytest.raises(ConfigError, match=r"override 'trainer.epochs=\[1': not valid YAML: line 1"):
        load_config(None, ["trainer.epochs=[1"])


def test_the_package_re_exports_every_public_name_of_its_modules():
    """Callers import from `pipetransformer.config`, never from its modules: a section,
    constant or function added to a module (config/freeze.py, config/checks.py...) must be
    re-exported by config/__init__.py, and each module says what it owns."""
    import ast
    from pathlib import Path

    import pipetransformer.config as package

    missing = []
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        assert "Owns:" in (ast.get_docstring(tree) or ""), f"config/{path.name}: docstring"
        if path.name == "__init__.py":
            continue
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                continue
            public = [n for n in names if n[0] != "_"]
            missing += [f"config/{path.name}: {n}" for n in public if n not in package.__all__]
    assert not missing, "not in config/__init__.py's __all__: " + ", ".join(missing)
    assert all(hasattr(package, name) for name in package.__all__)


def test_the_embedding_freezes_only_on_trained_weights():
    """freeze.embedding: auto (the default, and what the local BERT configs say) freezes the
    embedding from the first step where the weights are trained and trains it on random
    weights; an explicit true on random weights is flagged (the run warns), never 'auto'."""
    from pipetransformer.config import frozen_random_embedding

    local_bert = ROOT_CONFIGS / "bert_sst2_local.yaml"
    shipped = load_config(local_bert)
    assert shipped.freeze.embedding == "auto"
    assert not shipped.embedding_frozen  # the tiny random BERT trains its embedding
    assert not any(frozen_random_embedding(load_config(p)) for p in ROOT_CONFIGS.glob("*.yaml"))
    trained = [
        load_config(local_bert, overrides=[o])
        for o in ("model.model_name_or_path=some-org/minilm", "model.checkpoint_path=/some/m.pth")
    ]
    assert all(c.embedding_frozen for c in trained)
    assert not load_config(
        local_bert, ["model.model_name_or_path=some-org/m", "freeze.strategy=none"]
    ).embedding_frozen
    forced = load_config(local_bert, overrides=["freeze.embedding=true"])
    assert forced.embedding_frozen and frozen_random_embedding(forced)
    assert not any(frozen_random_embedding(c) for c in trained)
    assert config_from_dict({}).freeze.embedding == "auto"
    with pytest.raises(ConfigError, match=r"^freeze\.embedding: expected bool \| 'auto'"):
        load_config(local_bert, overrides=["freeze.embedding=maybe"])
