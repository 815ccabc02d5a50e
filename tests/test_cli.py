"""The command line: errors before any process starts, the plan dry run, a real short run."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "pipetransformer", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_config_errors_stop_before_any_worker_starts():
    result = run_cli("train", QUICKSTART, "freeze.alpha=2")
    assert result.returncode == 2
    assert "freeze.alpha" in result.stderr and "training on" not in result.stderr
    result = run_cli("train", QUICKSTART, "trainer.epochz=2")
    assert (
        result.returncode == 2
        and "trainer.epochz" in result.stderr
        and "did you mean 'trainer.epochs'" in result.stderr
    )
    result = run_cli("train", QUICKSTART, "model.kwargs.depthh=3")
    assert result.returncode == 2 and "model.kwargs" in result.stderr
    result = run_cli(
        "train", QUICKSTART, "data.name=sst2", "model.name=bert", "data.root=/nonexistent/sst2"
    )
    assert result.returncode == 2 and "/nonexistent/sst2" in result.stderr


def _compare_help() -> dict[str, str]:
    """`compare --help`'s text of each flag, unwrapped."""
    import argparse

    from pipetransformer.cli.parser import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {a.dest: a.help for a in sub.choices["compare"]._actions}


def test_compare_help_names_exactly_the_variants_it_accepts():
    """--peers and --ablations name every variant --variants accepts, spelled as it accepts
    them (the help said freeze-ddp where --variants takes freeze_ddp, and left out the
    hf_trainer and torch_ddp peers)."""
    import re

    from pipetransformer.compare.report import BASELINE, ELASTIC
    from pipetransformer.compare.variants import variant_overrides
    from pipetransformer.config import load_config

    accepted = set()
    # image, text, and pretrained weights (which add ddp_frozen_embedding)
    for config, overrides in (
        (QUICKSTART, []),
        (ROOT / "configs" / "bert_sst2_local.yaml", []),
        (QUICKSTART, ["model.pretrained=true"]),
    ):
        found = variant_overrides(load_config(config, overrides), ablations=True, peers=True)
        accepted |= set(found)
    accepted -= {BASELINE, ELASTIC}
    flags = _compare_help()
    named = " ".join([flags["peers"], flags["ablations"]])
    words = set(re.findall(r"[a-z0-9]+(?:[-_][a-z0-9]+)*", named.lower()))
    assert accepted <= words, f"not named in the help: {sorted(accepted - words)}"
    compounds = {w for w in words if "_" in w or "-" in w}
    assert compounds <= accepted, f"named but not accepted: {sorted(compounds - accepted)}"
    for name in re.findall(r"--variants ([a-z_,]+)", flags["variants"]):
        assert set(name.split(",")) <= accepted


def test_a_refused_compare_creates_nothing(tmp_path):
    out = tmp_path / "cmp"
    result = run_cli(
        "compare", QUICKSTART, "--peers", "--variants", "freeze-ddp", "--out", str(out)
    )
    assert result.returncode == 2 and "--variants: freeze-ddp is not one of" in result.stderr
    assert "(did you mean freeze_ddp?)" in result.stderr and not out.exists()
    # A curve that is not a variant was checked after --out was made: it is refused first.
    result = run_cli("compare", QUICKSTART, "--curves", "bogus", "--out", str(out))
    assert result.returncode == 2 and "--curves: bogus is not a variant" in result.stderr
    assert not out.exists()
    result = run_cli("compare", QUICKSTART, "--budgets", "0", "--out", str(out))
    assert result.returncode == 2 and not out.exists()


@pytest.mark.parametrize(
    "config, options, reason",
    [  # a variant this config has not says why, not only which names it has
        (QUICKSTART, ["--peers"], "hf_trainer is the peer of text models; this config's model "
         "is a timm image model, whose peer is torch_ddp"),
        (QUICKSTART, ["--peers"], "ddp_frozen_embedding freezes a pretrained embedding; this "
         "config's weights are random"),
        (QUICKSTART, [], "fsdp is a peer: add --peers"),
        (QUICKSTART, ["--peers"], "no_autodp is an ablation: add --ablations"),
    ],
)  # fmt: skip
def test_a_variant_this_comparison_has_not_is_refused_with_why(tmp_path, config, options, reason):
    from pipetransformer.compare import CompareRequest
    from pipetransformer.compare.variants import plan_variants
    from pipetransformer.config import ConfigError, load_config

    name = reason.split(" ", 1)[0]
    peers = "--peers" in options
    request = CompareRequest(str(config), tmp_path / "out", peers=peers, only=[name])
    with pytest.raises(ConfigError, match="--variants: " + re.escape(reason)):
        plan_variants(load_config(config), request)
    assert not (tmp_path / "out").exists()


def test_plan_json_for_the_quickstart():
    result = run_cli(
        "plan", QUICKSTART, "--json", "pipeline.balance=params", "pipeline.initial_pipe_len=2"
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["num_frozen_layers"] for r in rows] == list(range(8))
    for row in rows:
        assert {"num_frozen_layers", "pipe_len", "dp_degree", "stage_costs"} <= set(row)
        assert row["pipe_len"] * row["dp_degree"] == 2
    assert rows[0]["pipe_len"] == 2 and rows[-1]["pipe_len"] == 1  # compresses as layers freeze
    # The README's pipeline start packs once 5 of 8 layers are frozen (Eq. 2), not at 4, where
    # Eq. 1 leaves the quickstart: hence its alpha_schedule.
    assert [r["pipe_len"] for r in rows[4:6]] == [2, 1]


def test_plan_for_a_large_model_needs_no_download():
    result = run_cli(
        "plan",
        QUICKSTART,
        "model.name=vit_base_patch16_224",
        "model.kwargs={}",
        "data.image_size=224",
        "pipeline.initial_pipe_len=8",
        "trainer.nproc_per_node=8",
        "trainer.global_batch_size=384",
        "pipeline.num_micro_batches=8",
        "freeze.strategy=gradient_norm",
        "pipeline.balance=params",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "12 layers" in lines[0] and len(lines) == 3 + 12
    assert "memory per stage" in lines[1] and "MiB/stage" in lines[2]
    pipe_lens = [int(line.split()[1]) for line in lines[3:]]
    assert pipe_lens[0] == 8 and all(b <= a for a, b in zip(pipe_lens, pipe_lens[1:]))
    # ViT-B/16 on 8 devices: ~86M float32 parameters with AdamW's two moments, ~170 MB a stage.
    first_stage_mib = [float(v) for v in lines[3].split()[5].split("/")]
    assert len(first_stage_mib) == 8 and all(100 < v < 250 for v in first_stage_mib)


@pytest.mark.slow
def test_short_training_run_writes_its_outputs(tmp_path):
    """Slow: ~20 s on 2 cores (the CLI in a subprocess, end to end)."""
    run_dir = tmp_path / "run"
    result = cli(
        "train",
        QUICKSTART,
        "trainer.epochs=2",
        "data.train_subset=256",
        "data.eval_subset=64",
        "freeze.strategy=manual",
        "freeze.manual_schedule=[5]",
        "freeze.warmup_epochs=0",
        "freeze.interval_steps=null",
        "trainer.save_model=true",
        "pipeline.balance=params",
        "pipeline.initial_pipe_len=2",
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Output a person reads: rank 0 speaks for the run, no progress bar into a pipe, and
    # one closing line (not summary.json dumped).
    lines = result.stderr.strip().splitlines()
    assert "\r" not in result.stderr and not any("[rank1] INFO" in line for line in lines)
    assert lines[-1].startswith("pipetransformer: done: training ") and str(run_dir) in lines[-1]
    assert "layers frozen; pipe_len 1 x dp_degree 2" in lines[-1]
    assert result.stdout == ""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2]
    for key in (
        "epoch",
        "train_loss",
        "eval_metric",
        "samples_per_s",
        "epoch_time_s",
        "num_frozen_layers",
        "pipe_len",
        "dp_degree",
        "num_micro_batches",
    ):
        assert all(key in m for m in metrics), key
    assert 0.0 <= metrics[-1]["eval_metric"] <= 1.0
    assert (metrics[0]["pipe_len"], metrics[1]["pipe_len"], metrics[1]["dp_degree"]) == (2, 1, 2)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"training_time_s", "final_eval_metric", "best_eval_metric"} <= set(summary)
    assert summary["final_eval_metric"] == metrics[-1]["eval_metric"]
    resolved = (run_dir / "config.yaml").read_text()
    assert "epochs: 2" in resolved and "train_subset: 256" in resolved
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    transitions = [e for e in events if e["kind"] == "transition"]
    assert len(transitions) == 1 and transitions[0]["new_pipe_len"] == 1
    # num_micro_batches: auto (the default) profiles the initial layout at start-up, as its own
    # event; a checkpoint follows each epoch (the decision after epoch 1 comes first, recorded
    # before the transition it causes).
    assert [e["kind"] for e in events] == [
        "profile",
        "start",
        "freeze_decision",
        "transition",
        "checkpoint",
        "checkpoint",
    ]
    decision = events[2]
    assert (decision["old_num_frozen_layers"], decision["new_num_frozen_layers"]) == (0, 5)
    assert decision["decided_by"] == "schedule" and decision["epoch"] == 0
    assert events[0]["profile_s"] > 0
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["global_step"] for s in steps] == [4, 5, 8]  # every 5 steps and at each epoch's end
    # trainer.save_model: the model exported as timm loads it, from the final checkpoint.
    assert {"config.json", "model.safetensors"} <= {p.name for p in (run_dir / "export").iterdir()}
    assert summary["checkpoint"].endswith("step-00000008")
    assert "[rank0]" in result.stderr and "[rank1]" not in result.stderr  # nothing of its own


@pytest.mark.slow
def test_a_failing_worker_is_reported_once_with_its_cause(tmp_path):
    """Slow: ~10 s on 2 cores (the CLI in a subprocess, two workers started and one failing)."""
    bad = tmp_path / "broken.pth"
    bad.write_bytes(b"not a checkpoint")
    result = cli(
        "train",
        QUICKSTART,
        f"model.checkpoint_path={bad}",
        "trainer.epochs=1",
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert result.returncode == 1
    # The cause: torch's refusal to unpickle it (loaded with weights_only=True on every timm).
    assert "a worker process failed (rank" in result.stderr and "weights_only" in result.stderr
    assert "Traceback" not in result.stderr


def test_under_torchrun_its_processes_per_node_overrule_the_config(monkeypatch, capsys):
    """torchrun --nproc-per-node 8 with a config of 2 processes per node and an 8-stage
    pipeline: the config is checked with torchrun's 8 (it fails with the config's 2), and
    only global rank 0 warns."""
    from pipetransformer.cli.commands import _processes_per_node_from_torchrun
    from pipetransformer.config import ConfigError, load_config

    overrides = ["trainer.nproc_per_node=2", "pipeline.initial_pipe_len=8"]
    with pytest.raises(ConfigError, match="does not divide the 2 devices per node"):
        load_config(QUICKSTART, overrides)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for rank in ("3", "0"):
        monkeypatch.setenv("RANK", rank)
        extra = _processes_per_node_from_torchrun(QUICKSTART, overrides)
        assert extra == ["trainer.nproc_per_node=8"]
        assert load_config(QUICKSTART, overrides + extra).nproc_per_node == 8
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "pipetransformer: warning: trainer.nproc_per_node is 2 but torchrun started 8 "
        "processes per node: using 8"
    ]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert _processes_per_node_from_torchrun(QUICKSTART, overrides) == []


def test_a_torchvision_built_for_another_torch_is_one_line(monkeypatch):
    """A torchvision of another torch build fails inside its import ('operator
    torchvision::nms does not exist'): one line naming the versions and the fix, exit 2,
    no traceback (simulated: the import of torchvision raises as such a build does)."""
    import importlib.abc
    from importlib import metadata

    from pipetransformer.cli.libraries import matching_torchvision, reinstall_options

    class OtherBuild(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torchvision":
                raise RuntimeError("operator torchvision::nms does not exist")
            return None

    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.setattr(sys, "meta_path", [OtherBuild(), *sys.meta_path])
    result = run_cli("plan", QUICKSTART)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    torch_version, vision_version = metadata.version("torch"), metadata.version("torchvision")
    assert f"torchvision {vision_version} does not import beside torch {torch_version}" in line
    assert "operator torchvision::nms does not exist" in line
    wanted = matching_torchvision(torch_version)
    assert f"pip install {reinstall_options(torch_version)} 'torchvision=={wanted}.*'" in line
    assert (matching_torchvision("2.14.1+cpu"), matching_torchvision("2.0.0")) == ("0.29", "0.15")


def test_a_library_fix_reinstalls_from_the_build_torch_came_from():
    """The fix names the build, not only the version: 'pip install torchvision==0.29.*' where
    0.29.1 of the wrong build is installed does nothing, and 'pip install torch' on a CPU
    machine with PyTorch's CPU build would fetch PyPI's CUDA build."""
    from pipetransformer.cli.libraries import _message, reinstall_options

    cpu = reinstall_options("2.14.1+cpu")
    assert cpu == "--force-reinstall --no-deps --index-url https://download.pytorch.org/whl/cpu"
    assert reinstall_options("2.14.1") == "--force-reinstall --no-deps"  # PyPI's build
    assert "/whl/cu128" in reinstall_options("2.14.1+cu128")
    line = _message("torchvision", "2.14.1+cpu", "operator torchvision::nms does not exist")
    assert line.endswith(f"pip install {cpu} 'torchvision==0.29.*'")
    line = _message("torch", "2.14.1+cpu", "libtorch_cpu.so: cannot open shared object file")
    assert "--index-url https://download.pytorch.org/whl/cpu" in line and "'torch==" in line
