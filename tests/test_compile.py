"""`trainer.compile`: each unit compiled on its own (models/compiled.py). A compiled run
trains what the uncompiled one trains, through a transition; a transition compiles only the
variants its state changes create, and a unit class's graphs serve all its units."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import run_workers, tiny_bert
from workers import compiled_run

from pipetransformer.models.compiled import COMPILES, compile_units, library_blocks

CONFIG = {
    "trainer": {
        "epochs": 1,
        "global_batch_size": 16,
        "nproc_per_node": 1,
        "device": "cpu",
        "progress_bar": False,
        "log_interval_steps": 1000,
    },
    "optimizer": {"name": "sgd", "lr": 0.05},
    "model": {
        "name": "vit_tiny_patch16_224",
        "kwargs": {"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2},
    },
    "data": {"name": "digits", "image_size": 8, "train_subset": 160},
    "pipeline": {"initial_pipe_len": 1, "balance": "params"},
    "freeze": {"strategy": "gradient_norm", "interval_steps": 1000},
    "cache": {"enabled": False},
}


def _new_compiles(before: dict, after: dict) -> dict:
    return {name: after.get(name, 0) - before.get(name, 0) for name in after}


@pytest.mark.slow
def test_a_compiled_run_trains_as_the_uncompiled_one_through_a_transition(tmp_path):
    """Slow (about 5 s idle; the default suite keeps the per-unit compile counts).
    One process, 2 steps, a transition that freezes layer 0, 2 steps and 2 more, with
    `trainer.compile` (dynamo's graphs run as captured, without code generation: the
    inductor and AOTAutograd runs are the slow tests below) and without: the same losses;
    at the transition only the variants it creates are compiled (the frozen embedding,
    attention and MLP in eval mode without autograd, and the first trained attention unit,
    whose input no longer carries a gradient), the head's graph is reused, and the steps
    after it compile nothing."""
    compiled = copy.deepcopy(CONFIG)
    compiled["trainer"].update(compile=True, compile_backend="eager")
    (plain,) = run_workers(compiled_run, 1, CONFIG, str(tmp_path / "plain"), 1, 2)
    (result,) = run_workers(compiled_run, 1, compiled, str(tmp_path / "compiled"), 1, 2)
    assert "frozen_layers=1" in result["layout"]
    assert result["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert plain["compiles"] == [{}, {}, {}]
    first, after, steady = result["compiles"]
    # One graph per unit class and state (trained, and evaluation: compiled before the first
    # step, pipe/warmup.py): both attention (and MLP) units run their class's graphs.
    assert first == {"VitEmbedding": 2, "VitAttention": 2, "VitMlp": 2, "VitHead": 2}
    assert _new_compiles(first, after) == {
        "VitEmbedding": 1,
        "VitAttention": 2,
        "VitMlp": 1,
        "VitHead": 0,
    }
    assert steady == after


def test_a_unit_class_compiles_once_for_its_units_and_once_per_state():
    """Four BERT layers, their units compiled in place (dynamo's `eager` backend): one graph
    per unit class; batches of other sizes padded to other lengths (per-batch padding) run
    the same graphs (the batch and sequence dimensions are dynamic); evaluation compiles each
    class once more; compiling again changes nothing; the state dict keeps its names."""
    model = tiny_bert(seq_len=16)
    names = list(model.state_dict())
    before = dict(COMPILES)
    compile_units(model.units, "eager", text=True)
    compile_units(model.units, "eager", text=True)  # idempotent
    assert list(model.state_dict()) == names

    def step(batch: int, length: int) -> None:  # a batch padded to its longest sentence
        ids = torch.randint(1, 50, (batch, length))
        mask = torch.ones_like(ids)
        mask[0, length // 2 :] = 0
        model(ids * mask, torch.zeros_like(ids), mask).sum().backward()

    step(4, 16)
    first = _new_compiles(before, COMPILES)
    assert set(first.values()) == {1} and len(first) == 4, first  # embedding, 2 units, head
    step(2, 9)
    step(3, 12)
    assert _new_compiles(before, COMPILES) == first
    with torch.no_grad():
        model.eval()
        model(torch.randint(0, 50, (4, 16)), torch.zeros(4, 16).long(), torch.ones(4, 16).long())
    assert set(_new_compiles(before, COMPILES).values()) == {2}


def test_the_peers_compile_each_block_as_the_trainer_compiles_each_unit():
    """With trainer.compile the peers compile each transformer block of the library's
    model (timm's `blocks`, transformers' encoder layers; found for every family the
    trainer cuts), with the trainer's backend: the blocks of a tiny timm ViT share one
    graph; without it nothing is compiled."""
    from families import FAMILIES
    from helpers import ROOT, tiny_vit

    from pipetransformer.compare import peers
    from pipetransformer.config import load_config

    for name, family in FAMILIES.items():
        model = family.build(device="meta")
        assert len(library_blocks(model.source)) == model.spec.num_layers, name
    quickstart = ROOT / "configs" / "quickstart.yaml"
    for compile_on in (False, True):
        config = load_config(
            quickstart,
            [f"trainer.compile={str(compile_on).lower()}", "trainer.compile_backend=eager"],
        )
        timm_model = tiny_vit().source
        before = dict(COMPILES)
        peers._compile_blocks(config, timm_model, text=False)
        timm_model(torch.randn(2, 1, 8, 8)).sum().backward()
        new = {k: v for k, v in _new_compiles(before, COMPILES).items() if v}
        assert new == ({"Block": 1} if compile_on else {}), new


@pytest.mark.slow
def test_an_inductor_compiled_pipeline_trains_as_the_uncompiled_one(tmp_path):
    """Two processes: a 2-stage pipeline, then (3 of 4 layers frozen) DDP over two replicas, with
    inductor (C++ kernels generated with gcc) and without: the same losses to float
    rounding (inductor fuses and reorders). Cost: 30 s (inductor's on-disk cache warm) to a
    few minutes on 2 cores (each rank compiles its units' forward and backward graphs)."""
    config = copy.deepcopy(CONFIG)
    config["trainer"]["nproc_per_node"] = 2
    config["pipeline"]["initial_pipe_len"] = 2
    config["model"]["kwargs"]["depth"] = 4  # 3 frozen: the rest packs into one stage
    compiled = copy.deepcopy(config)
    compiled["trainer"]["compile"] = True
    plain = run_workers(compiled_run, 2, config, str(tmp_path / "plain"), 3, 2)
    result = run_workers(compiled_run, 2, compiled, str(tmp_path / "compiled"), 3, 2)
    assert all("pipe_len=1 dp_degree=2" in r["layout"] for r in result), result
    for rank in range(2):
        expected = [x for x in plain[rank]["losses"]]
        got = result[rank]["losses"]
        assert [x is None for x in got] == [x is None for x in expected]
        pairs = [(g, e) for g, e in zip(got, expected) if e is not None]
        assert pairs and all(g == pytest.approx(e, rel=1e-3) for g, e in pairs), pairs
        assert sum(result[rank]["compiles"][-1].values()) > 0


@pytest.mark.slow
def test_a_compiled_sharded_layout_trains_as_the_uncompiled_one(tmp_path):
    """FSDP2 over two processes (`pipeline.sharding: always`) through a transition between
    sharded layouts, compiled (AOTAutograd: FSDP2's hooks run around each unit's compiled
    forward) and not: the same losses, the same graphs per unit class as a one-process
    layout. Cost: about 30 s on 2 cores."""
    config = copy.deepcopy(CONFIG)
    config["trainer"]["nproc_per_node"] = 2
    config["pipeline"]["sharding"] = "always"
    compiled = copy.deepcopy(config)
    compiled["trainer"].update(compile=True, compile_backend="aot_eager")
    plain = run_workers(compiled_run, 2, config, str(tmp_path / "plain"), 1, 2)
    result = run_workers(compiled_run, 2, compiled, str(tmp_path / "compiled"), 1, 2)
    for rank in range(2):
        assert "sharded frozen_layers=1" in result[rank]["layout"]
        assert result[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5)
        first, after, steady = result[rank]["compiles"]
        assert sum(first.values()) == 4 and steady == after
