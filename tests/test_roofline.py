"""Predicting a named cluster without a measured profile (planning/roofline.py,
planning/prediction_inputs.py, `plan --predict --device`): the roofline's arithmetic, the
choice of peak, and the command on the paper's cluster (2 nodes x 8 Quadro RTX 5000).

Unit tier: no processes; the models are counted on the meta device, nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from pipetransformer.autopipe.profiles import ProfileStore, UnitProfile
from pipetransformer.config import load_config
from pipetransformer.planning import describe_model
from pipetransformer.planning.analytical import AnalyticalProfile, UnitWork
from pipetransformer.planning.context import format_bytes, usable_device_bytes
from pipetransformer.planning.hardware import device
from pipetransformer.planning.predict import predict
from pipetransformer.planning.prediction_inputs import (
    cluster_from_flags,
    measured_on,
    prediction_unit_times,
    train_samples_for,
)
from pipetransformer.planning.profile_keys import unit_profile_key_for
from pipetransformer.planning.roofline import (
    ACHIEVED_COMPUTE_FRACTION,
    ACHIEVED_MEMORY_FRACTION,
    AchievedFractions,
    roofline_profile,
    roofline_seconds,
)

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
VIT_IMAGENET = str(ROOT / "configs" / "vit_imagenet.yaml")
BERT_SQUAD = str(ROOT / "configs" / "bert_squad.yaml")
PAPER_CLUSTER = (
    "--predict",
    "--device",
    "quadro-rtx-5000",
    "--intra-node",
    "pcie3-x16",
    "--inter-node",
    "infiniband-cx353a",
    "--nodes",
    "2",
    "--devices-per-node",
    "8",
)


def _work(flops: int, bytes_moved: int) -> UnitWork:
    return UnitWork(
        forward_flops=flops,
        backward_flops=2 * flops,
        frozen_forward_flops=flops,
        forward_bytes=bytes_moved,
        backward_bytes=3 * bytes_moved,
        frozen_forward_bytes=bytes_moved // 2,
        param_count=10,
        param_bytes=40,
        output_bytes=64,
        saved_bytes=128,
    )


def _profile(dtype: str = "float32", *units: UnitWork) -> AnalyticalProfile:
    return AnalyticalProfile(4, dtype, units or (_work(10**9, 10**6),))


# ----------------------------------------------------------------------------- arithmetic


def test_unit_time_is_the_larger_of_compute_and_memory_time():
    quadro = device("quadro-rtx-5000")
    flops, bytes_moved = 3 * 10**9, 2 * 10**8
    profile = roofline_profile(_profile("float32", _work(flops, bytes_moved)), quadro)
    compute_s = flops / (11.2e12 * ACHIEVED_COMPUTE_FRACTION)
    memory_s = bytes_moved / (448e9 * ACHIEVED_MEMORY_FRACTION)
    assert profile.forward_s[0] == pytest.approx(max(compute_s, memory_s), rel=1e-12)
    # Backward and frozen forward separately, from their own FLOPs and bytes.
    assert profile.backward_s[0] == pytest.approx(max(2 * compute_s, 3 * memory_s), rel=1e-12)
    assert profile.frozen_forward_s[0] == pytest.approx(
        max(compute_s, bytes_moved // 2 / (448e9 * ACHIEVED_MEMORY_FRACTION)), rel=1e-12
    )
    # Bytes the memory model needs pass through as counted.
    assert (profile.output_bytes, profile.saved_bytes, profile.param_bytes) == (
        (64,),
        (128,),
        (40,),
    )
    assert profile.micro_batch_size == 4


def test_compute_bound_and_memory_bound_switch_at_the_ridge_point():
    peak, bandwidth = 10e12, 500e9
    fractions = AchievedFractions(compute=0.5, memory=0.8)
    flops = 1e9
    # Ridge: FLOPs / (peak x 0.5) = bytes / (bandwidth x 0.8).
    ridge_bytes = flops / (peak * 0.5) * (bandwidth * 0.8)
    compute_s = flops / (peak * 0.5)
    below = roofline_seconds(flops, 0.5 * ridge_bytes, peak, bandwidth, fractions)
    above = roofline_seconds(flops, 4 * ridge_bytes, peak, bandwidth, fractions)
    assert below == pytest.approx(compute_s)  # compute-bound: bytes do not matter
    assert roofline_seconds(flops, 0.9 * ridge_bytes, peak, bandwidth, fractions) == below
    assert above == pytest.approx(4 * ridge_bytes / (bandwidth * 0.8))  # memory-bound
    assert above == pytest.approx(4 * compute_s)


def test_the_peak_follows_the_training_precision():
    work = _work(10**12, 1)  # compute-bound everywhere
    a100, quadro = device("a100-80gb"), device("quadro-rtx-5000")
    fp32 = roofline_profile(_profile("float32", work), a100).forward_s[0]
    bf16 = roofline_profile(_profile("bfloat16", work), a100).forward_s[0]
    # float32 runs at the FP32 peak, not TF32's (the trainer leaves TF32 off), bf16 at its own.
    assert fp32 == pytest.approx(1e12 / (19.5e12 * ACHIEVED_COMPUTE_FRACTION))
    assert bf16 == pytest.approx(1e12 / (312e12 * ACHIEVED_COMPUTE_FRACTION))
    # Turing has no bfloat16 units: the FP32 peak.
    assert roofline_profile(_profile("bfloat16", work), quadro).forward_s[0] == pytest.approx(
        roofline_profile(_profile("float32", work), quadro).forward_s[0]
    )


def test_fractions_outside_zero_to_one_are_refused():
    for compute, memory in ((0.0, 0.5), (0.5, 1.5), (-0.1, 0.5)):
        with pytest.raises(ValueError, match="fraction must be in"):
            AchievedFractions(compute, memory)


def test_profiles_are_matched_to_named_devices_by_type():
    quadro, a100, cpu = device("quadro-rtx-5000"), device("a100-80gb"), device("cpu-2core")
    assert measured_on(quadro, "cuda:Quadro RTX 5000")
    assert measured_on(a100, "cuda:NVIDIA A100-SXM4-80GB")
    assert measured_on(device("h100-sxm"), "cuda:NVIDIA H100 80GB HBM3")
    assert measured_on(cpu, "cpu")
    assert not measured_on(quadro, "cpu") and not measured_on(quadro, "cuda")
    assert not measured_on(a100, "cuda:NVIDIA A100-SXM4-40GB")
    assert not measured_on(cpu, "cuda:Quadro RTX 5000")


def _predicted_step_s(config_path: str, device_name: str, tmp_path: Path) -> float:
    config = load_config(config_path, [f"pipeline.profile_path={tmp_path / 'none.json'}"])
    cluster = cluster_from_flags(2, 8, device_name=device_name)
    chosen = prediction_unit_times(config, cluster)
    assert chosen.source.startswith(f"analytical, roofline on {device_name}")
    return predict(config, chosen.profile, cluster, 4000, "auto", chosen.times).rows[0].step_s


def test_a_faster_device_predicts_a_shorter_step(tmp_path):
    quadro = _predicted_step_s(VIT_IMAGENET, "quadro-rtx-5000", tmp_path)
    a100 = _predicted_step_s(VIT_IMAGENET, "a100-80gb", tmp_path)
    assert a100 < quadro / 1.5  # FP32 19.5 against 11.2 TFLOP/s, 2039 against 448 GB/s


def test_a_prediction_describes_the_model_once(tmp_path, monkeypatch):
    """prediction_unit_times builds the model's spec and predict() takes it from there:
    however many profile files under runs/ it reads (here three of another model), the
    model is described once (the roofline counts it once more, on the meta device). It
    was described once per file read, once more for the roofline and again in predict."""
    from pipetransformer.planning import context

    other = load_config(QUICKSTART, ["model.kwargs.depth=4"])
    spec = describe_model(other)
    n, micro = spec.num_units, 8
    for run in ("a", "b", "c"):
        store = ProfileStore(tmp_path / "runs" / run / "profiles.json")
        profile = UnitProfile(micro, (0.01,) * n, (0.02,) * n, (0.009,) * n, *([(4,) * n] * 3))
        store.put_unit_profile(unit_profile_key_for(other, spec, "cpu", micro), profile)
        store.save()
    built = []
    build_model = context.build_model
    monkeypatch.setattr(
        context, "build_model", lambda *a, **k: built.append(a) or build_model(*a, **k)
    )
    monkeypatch.chdir(tmp_path)
    config = load_config(QUICKSTART, [])
    cluster = cluster_from_flags(1, 2, device_name="cpu-2core")
    chosen = prediction_unit_times(config, cluster)
    assert chosen.source.startswith("analytical, roofline on cpu-2core")
    result = predict(config, chosen.profile, cluster, 64, times=chosen.times, spec=chosen.spec)
    assert len(built) == 1 and result.rows


def test_training_samples_come_from_a_published_size_when_the_data_is_not_on_disk():
    config = load_config(VIT_IMAGENET, ["data.root=/nonexistent/imagenet"])
    samples, source = train_samples_for(config)
    assert samples == 1_281_167
    assert "ImageNet-1k" in source and "not on disk" in source
    subset = load_config(VIT_IMAGENET, ["data.root=/nonexistent", "data.train_subset=1000"])
    assert train_samples_for(subset)[0] == 1000


# ----------------------------------------------------------------------------- the command


def _plan(config: str, tmp_path: Path, *extra: str):
    # An empty profile file: no measured profile, whatever runs/ holds.
    return run_cli(
        "plan", config, f"pipeline.profile_path={tmp_path / 'none.json'}", *PAPER_CLUSTER, *extra
    )


@pytest.mark.parametrize("config", [QUICKSTART, VIT_IMAGENET])
def test_paper_cluster_prediction_without_a_profile(config, tmp_path):
    result = _plan(config, tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    num_layers = describe_model(load_config(config)).num_layers
    assert [row["num_frozen_layers"] for row in data["rows"]] == list(range(num_layers))
    assert data["cluster"]["device"] == "quadro-rtx-5000"
    assert data["cluster"]["intra_node_link"] == "pcie3-x16"
    assert data["cluster"]["intra_node_gbps"] == pytest.approx(15.754)
    assert data["cluster"]["inter_node_link"] == "infiniband-cx353a"
    assert data["cluster"]["inter_node_gbps"] == pytest.approx(5.0)
    assert data["unit_profile_source"].startswith("analytical, roofline on quadro-rtx-5000")
    assert data["baseline"]["name"] == "baseline" and data["baseline"]["fits"]
    ddp, freeze_ddp, fsdp, freeze_fsdp = data["peers"]
    assert [p["name"] for p in data["peers"]] == ["ddp", "freeze_ddp", "fsdp", "freeze_fsdp"]
    for peer in data["peers"]:
        assert peer["pipe_len"] == 1 and peer["dp_degree"] == 16 and peer["fits"]
        assert peer["run_s"] > 0 and peer["speedup"] == pytest.approx(
            peer["run_s"] / data["elastic_s"]
        )
    assert freeze_ddp["run_s"] <= ddp["run_s"]  # the same layout, less to train
    assert freeze_fsdp["run_s"] <= fsdp["run_s"]
    text = _plan(config, tmp_path)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "2 node(s) x 8 quadro-rtx-5000" in lines[0] and "pcie3-x16" in lines[0]
    labels = ("Pipe+DDP (K=", "DDP (K=1, R=16", "freeze+DDP (K=1, R=16", "FSDP2 (K=1, R=16")
    for label in (*labels, "freeze+FSDP2 (K=1, R=16"):
        assert any(line.strip().startswith(label) for line in lines), (label, text.stdout)


def test_an_unknown_device_is_one_line_listing_the_known_ones(tmp_path):
    result = _plan(QUICKSTART, tmp_path, "--device", "quadro-rtx-9000")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'quadro-rtx-9000'" in lines[0]
    assert "known devices:" in lines[0] and "quadro-rtx-5000" in lines[0]


def test_a_named_link_and_its_bandwidth_together_are_an_error(tmp_path):
    result = _plan(QUICKSTART, tmp_path, "--intra-node-gbps", "100")
    assert result.returncode == 2 and "--intra-node and --intra-node-gbps" in result.stderr


def test_ddp_does_not_fit_when_the_whole_model_exceeds_a_device(tmp_path):
    """BERT-large on SQuAD at 512 tokens as bert_squad.yaml runs it: its 8-stage 1F1B
    pipelines of 64 sequences fit a Quadro RTX 5000's 16 GiB less the CUDA reserve, and so
    does every layout the planner packs them into; DDP at the baseline's global batch (128
    over 16 devices: 8 sequences a replica, the whole model on each) does not; FSDP2 over
    the 16 does, its 8 sequences in micro-batches (gradient accumulation)."""
    result = _plan(BERT_SQUAD, tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    budget = data["cluster"]["device_memory_bytes"]
    assert budget == pytest.approx(usable_device_bytes(16 * 2**30))
    assert data["baseline"]["fits"] and data["baseline"]["peak_bytes"] <= budget
    assert all(row["peak_bytes"] <= budget for row in data["rows"])
    for peer in data["peers"][:2]:  # DDP and freeze + DDP
        assert not peer["fits"] and peer["peak_bytes"] > budget and peer["speedup"] is None
    for peer in data["peers"][2:]:  # FSDP2 and freeze + FSDP2
        assert peer["fits"] and peer["peak_bytes"] <= budget and peer["num_micro_batches"] > 1
    text = _plan(BERT_SQUAD, tmp_path)
    ddp_line = next(line for line in text.stdout.splitlines() if "  DDP (K=1" in line)
    assert "does not fit (needs" in ddp_line and f"has {format_bytes(budget)})" in ddp_line
    # Under GPipe, 64 sequences of 512 tokens in flight do not fit stage 0.
    gpipe = _plan(BERT_SQUAD, tmp_path, "pipeline.schedule=gpipe", "pipeline.num_micro_batches=8")
    assert gpipe.returncode == 2 and "no pipeline fits a quadro-rtx-5000" in gpipe.stderr


def test_no_pipeline_that_fits_at_the_start_is_one_line_naming_the_device(tmp_path):
    result = _plan(QUICKSTART, tmp_path, "pipeline.device_memory_bytes=1000000")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no pipeline fits a quadro-rtx-5000" in lines[0]
    assert "the largest stage needs" in lines[0]


def _store_with_a_cpu_profile(tmp_path: Path) -> Path:
    """A profile file holding a (made-up) quickstart unit profile measured on 'cpu'."""
    config = load_config(QUICKSTART, ["trainer.nproc_per_node=8"])
    spec = describe_model(config)
    n = spec.num_units
    profile = UnitProfile(4, (1e-3,) * n, (2e-3,) * n, (1e-3,) * n, (10,) * n, (10,) * n, (4,) * n)
    path = tmp_path / "profiles.json"
    store = ProfileStore(path)
    store.put_unit_profile(unit_profile_key_for(config, spec, "cpu", 4), profile)
    store.save()
    return path


def test_a_measured_profile_wins_only_on_its_own_device_type(tmp_path):
    path = _store_with_a_cpu_profile(tmp_path)
    args = ("plan", QUICKSTART, "--predict", "--nodes", "2", "--devices-per-node", "8")
    same = run_cli(*args, "--profile", str(path), "--device", "cpu-2core", "--json")
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["unit_profile_source"] == f"{path} [cpu]"
    other = run_cli(*args, "--profile", str(path), "--device", "quadro-rtx-5000", "--json")
    assert other.returncode == 0, other.stderr
    source = json.loads(other.stdout)["unit_profile_source"]
    assert source.startswith("analytical, roofline on quadro-rtx-5000")
    assert "measured on cpu, not a quadro-rtx-5000" in source
    # Without --device, as before: the measured profile.
    plain = run_cli(*args, "--profile", str(path), "--json")
    assert json.loads(plain.stdout)["unit_profile_source"] == f"{path} [cpu]"
