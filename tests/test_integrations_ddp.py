"""The integrations as a user runs them: a transformers `Trainer` script and a Lightning
script with the callback added, under `torchrun --nproc-per-node 2` on the CPU (gloo),
without `find_unused_parameters` (hf_freeze_script.py and lightning_freeze_script.py), each
against the same script in one process. One launch per script serves every test of it.

Slow (`pytest -m slow`, which CI runs): the Trainer launch (4 runs on 2 processes, one
compiled) with its single-process reference took 45-58 s, the Lightning launch with its
reference 17-24 s, on this 2-core VM while other work shared it (two measurements)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

TESTS = ROOT / "tests"
pytestmark = pytest.mark.slow


def torchrun(script: str, out) -> list[dict]:
    """`torchrun --standalone --nproc-per-node 2 tests/SCRIPT OUT` with this checkout first on
    the path; each rank's record."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(TESTS / script), str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def weights_apart(a, b) -> float:
    first, second = torch.load(a), torch.load(b)
    assert first.keys() == second.keys()
    return max(float((first[k] - second[k]).abs().max()) for k in first)


def steps(decisions, key="step") -> list[tuple]:
    return [(d[key], d["frozen_layers"], d["freeze_decided_by"]) for d in decisions]


# --- transformers' Trainer ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """The Trainer script on 2 processes, and in this one (its uninterrupted and
    accumulated runs)."""
    import hf_freeze_script

    out = tmp_path_factory.mktemp("hf_ddp")
    ranks = torchrun("hf_freeze_script.py", out)
    alone = tmp_path_factory.mktemp("hf_alone")
    hf_freeze_script.main(str(alone), runs=("uninterrupted", "accumulated"))
    return out, ranks, alone, json.loads((alone / "rank0.json").read_text())


def test_under_torchrun_the_trainer_freezes_the_same_layers_on_both_ranks_as_alone(hf_runs):
    """Every decision, the same on both ranks and as in one process (the norms reduced over
    the ranks are those of the whole batch), with at least one freeze; DDP never searched for
    unused parameters."""
    _, ranks, _, alone = hf_runs
    for run in ("uninterrupted", "accumulated"):
        expected = steps(alone[run]["decisions"])
        assert [steps(rank[run]["decisions"]) for rank in ranks] == [expected, expected]
        assert any(frozen for _, frozen, _ in expected)
    for rank in ranks:
        for run in rank.values():
            assert run["find_unused"] and not any(run["find_unused"])


def test_under_torchrun_frozen_weights_stay_and_trained_ones_match_one_process(hf_runs):
    """SGD: the 2-process run ends with the weights of the one-process run of the same
    steps (float error), evaluation loss alike; under bf16 autocast with gradient
    accumulation, to bf16's error. Frozen weights never moved after their freeze."""
    out, ranks, alone, alone_runs = hf_runs
    assert weights_apart(out / "uninterrupted.pt", alone / "uninterrupted.pt") < 1e-6
    assert weights_apart(out / "accumulated.pt", alone / "accumulated.pt") < 5e-3
    assert ranks[0]["uninterrupted"]["eval_losses"] == pytest.approx(
        alone_runs["uninterrupted"]["eval_losses"], rel=1e-5
    )
    for rank in ranks:
        for run in rank.values():
            assert run["frozen_changed"] and max(run["frozen_changed"].values()) == 0.0


def test_a_checkpoint_after_a_freeze_resumes_with_its_frozen_layers_and_the_same_losses(hf_runs):
    """Resumed 2 steps after the first freeze, inside a decision interval: the frozen layers
    frozen again from the first step, the interval's norms carried (the next decisions the
    same), and every later step's loss and the final weights those of the uninterrupted run."""
    out, ranks, _, _ = hf_runs
    for rank in ranks:
        uninterrupted, resumed = rank["uninterrupted"], rank["resumed"]
        first = next(d["step"] for d in uninterrupted["decisions"] if d["frozen_layers"])
        assert resumed["checkpoint"] == f"checkpoint-{first + 2}"
        assert steps(resumed["decisions"]) == steps(uninterrupted["decisions"])
        later = {s: loss for s, loss in uninterrupted["losses"].items() if int(s) > first + 2}
        assert later and {s: resumed["losses"][s] for s in later} == pytest.approx(later, rel=1e-6)
    assert weights_apart(out / "uninterrupted.pt", out / "resumed.pt") < 1e-6


def test_under_torchrun_a_compiled_model_freezes_and_trains_as_the_eager_one(hf_runs):
    """With `torch_compile` accelerate compiles the DDP wrapper; after the freeze at the first
    epoch's end its steps are the eager run's (losses to float error), the frozen weights
    stay."""
    _, ranks, _, _ = hf_runs
    for rank in ranks:
        compiled, eager = rank["compiled"], rank["uninterrupted"]
        assert compiled["wrapped"] == "OptimizedModule"
        assert steps(compiled["decisions"]) == steps(eager["decisions"])[:1]
        assert compiled["losses"] == pytest.approx(
            {s: eager["losses"][s] for s in compiled["losses"]}, rel=1e-5
        )
        assert max(compiled["frozen_changed"].values()) == 0.0


# --- Lightning --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    pytest.importorskip("lightning", reason="the .[lightning] extra is not installed")
    import lightning_freeze_script

    out = tmp_path_factory.mktemp("lightning_ddp")
    ranks = torchrun("lightning_freeze_script.py", out)
    alone = tmp_path_factory.mktemp("lightning_alone")
    lightning_freeze_script.main(str(alone))
    return out, ranks, alone, json.loads((alone / "rank0.json").read_text())


def test_under_lightnings_ddp_the_same_freeze_and_the_same_weights_as_alone(lightning_runs):
    """Lightning's DDP strategy over 2 processes, find_unused_parameters False: the same
    decisions on both ranks as in one process, frozen weights unchanged, the trained ones
    those of the one-process fit; resumed from the checkpoint of the epoch after the first
    freeze (the next decision's interval carried), the same decisions, losses and weights."""
    out, ranks, alone, alone_runs = lightning_runs
    expected = steps(alone_runs["uninterrupted"]["decisions"], "global_step")
    assert any(frozen for _, frozen, _ in expected)
    for rank in ranks:
        for run in ("uninterrupted", "resumed"):
            assert steps(rank[run]["decisions"], "global_step") == expected
            assert not any(rank[run]["find_unused"])
            assert max(rank[run]["frozen_changed"].values()) == 0.0
        later = {
            s: v
            for s, v in rank["uninterrupted"]["losses"].items()
            if s in rank["resumed"]["losses"]
        }
        assert len(later) == 8 and later == pytest.approx(rank["resumed"]["losses"], rel=1e-6)
    assert weights_apart(out / "uninterrupted.pt", alone / "uninterrupted.pt") < 1e-6
    assert weights_apart(out / "uninterrupted.pt", out / "resumed.pt") < 1e-6
