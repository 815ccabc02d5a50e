"""AutoPipe profiles: time-based balance, micro-batch choice, the profile file, measurement."""

import gc
import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers import tiny_bert, tiny_vit

from pipetransformer.autopipe.planner import UnitCosts, balance
from pipetransformer.autopipe.profiles import (
    FORMAT_VERSION,
    MicroBatchKey,
    ProfileError,
    ProfileStore,
    UnitMeasurement,
    UnitProfile,
    UnitProfileKey,
    candidate_micro_batches,
    choose_micro_batches,
    micro_batch_key,
    model_signature,
    unit_costs_from_profile,
    unit_profile_key,
)
from pipetransformer.config import load_config
from pipetransformer.pipe.measure import measure_unit_costs, time_schedule_steps

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"

# ------------------------------------------------------------------ synthetic BERT-base-like


def bert_base_like_profile(num_layers=12) -> UnitProfile:
    """Embedding: most parameters of any unit, almost no time; layers: the time."""
    params = [30522 * 768 + 512 * 768] + [4 * 768 * 768, 8 * 768 * 768] * num_layers + [768 * 768]
    forward = [0.0005] + [0.010, 0.008] * num_layers + [0.0002]
    n = len(params)
    return UnitProfile(
        micro_batch_size=8,
        forward_s=tuple(forward),
        backward_s=tuple(2 * f for f in forward),
        frozen_forward_s=tuple(0.9 * f for f in forward),
        output_bytes=tuple([8 * 128 * 768 * 4] * n),
        saved_bytes=tuple([5 * 8 * 128 * 768 * 4] * n),
        param_bytes=tuple(4 * p for p in params),
    )


def stage_time(costs: UnitCosts, ranges) -> float:
    return max(sum(costs.trained[u] for u in range(a, b)) for a, b in ranges)


@pytest.mark.parametrize("pipe_len", [2, 4])
def test_time_costs_balance_stage_time_better_than_param_counts(pipe_len):
    profile = bert_base_like_profile()
    time_costs = unit_costs_from_profile(profile)
    param_costs = UnitCosts.from_param_counts([b // 4 for b in profile.param_bytes], 1 / 6)
    by_time = balance(time_costs, 0, pipe_len)
    by_params = balance(param_costs, 0, pipe_len)
    assert by_time.stage_ranges != by_params.stage_ranges
    # Judged by what matters, the slowest stage's measured time.
    assert stage_time(time_costs, by_time.stage_ranges) < 0.9 * stage_time(
        time_costs, by_params.stage_ranges
    )
    # The parameter split gives the (cheap) embedding's stage too few layers.
    assert by_params.stage_ranges[0][1] < by_time.stage_ranges[0][1]


def test_unit_costs_from_profile_sums_forward_and_backward():
    profile = bert_base_like_profile(num_layers=2)
    costs = unit_costs_from_profile(profile)
    assert costs.source == "time" and costs.num_units == 6
    assert costs.trained[1] == pytest.approx(0.030) and costs.frozen[1] == pytest.approx(0.009)


# ------------------------------------------------------------------ micro-batch choice


def test_candidate_micro_batches_are_divisors_in_k_to_6k():
    assert candidate_micro_batches(2, 32) == [2, 4, 8]
    assert candidate_micro_batches(1, 32) == [1, 2, 4]
    assert candidate_micro_batches(4, 48) == [4, 6, 8, 12, 16, 24]
    assert candidate_micro_batches(8, 64) == [8, 16, 32]
    # None in range: the nearest divisors on either side.
    assert candidate_micro_batches(8, 4) == [4]
    assert candidate_micro_batches(4, 87) == [3, 29]
    assert candidate_micro_batches(4, 87, minimum=4) == [29]  # 1F1B needs M >= K
    with pytest.raises(ValueError):
        candidate_micro_batches(0, 8)


def test_choose_micro_batches_is_the_argmin_over_candidates_only():
    candidates = candidate_micro_batches(2, 32)
    timings = {2: 0.9, 4: 0.5, 8: 0.7, 6: 0.1}  # 6 does not divide 32: ignored
    assert choose_micro_batches(timings, candidates) == 4
    assert choose_micro_batches({2: 0.5, 4: 0.5, 8: 0.5}, candidates) == 2  # ties -> smaller M
    assert choose_micro_batches({8: 0.3, 12: 0.1}, candidates) == 8
    with pytest.raises(ValueError):
        choose_micro_batches({6: 0.1}, candidates)


# ------------------------------------------------------------------ the profile store


MODEL = model_signature("bert", {"hidden_size": 64, "num_layers": 4})
OTHER_MODEL = model_signature("bert", {"hidden_size": 64, "num_layers": 6})


def test_model_signature_is_stable_and_separates_configs():
    assert model_signature("bert", {"a": 1, "b": [1, 2]}) == model_signature(
        "bert", {"b": [1, 2], "a": 1}
    )
    assert MODEL != OTHER_MODEL
    assert unit_profile_key(MODEL, "cpu", "float32", 4, [(128,)] * 3) != unit_profile_key(
        MODEL, "cpu", "float32", 8, [(128,)] * 3
    )


def test_store_round_trip(tmp_path):
    path = tmp_path / "profiles" / "profiles.json"
    store = ProfileStore(path).load()  # missing file: empty
    assert store.keys() == []
    profile = bert_base_like_profile(num_layers=2)
    store.put_unit_profile("u", profile)
    store.put_micro_batch_timings("m", {2: 0.5, 4: 0.25})
    store.save()
    assert json.loads(path.read_text())["format_version"] == FORMAT_VERSION
    assert [p.name for p in path.parent.iterdir()] == ["profiles.json"]  # no temp file left
    again = ProfileStore(path).load()
    assert again.unit_profile("u") == profile
    assert again.micro_batch_timings("m") == {2: 0.5, 4: 0.25}
    # A second writer's records survive this one's save.
    other = ProfileStore(path)
    other.put_micro_batch_timings("m2", {1: 1.0})
    other.save()
    assert set(ProfileStore(path).load().keys()) == {"u", "m", "m2"}


def test_keys_separate_what_changes_costs_and_parse_back():
    layout = dict(
        device_type="cpu", input_shapes=[(128,)] * 3, schedule="gpipe", num_frozen_layers=0
    )
    key = micro_batch_key(MODEL, pipe_len=2, replica_batch=32, **layout)
    others = [
        micro_batch_key(OTHER_MODEL, pipe_len=2, replica_batch=32, **layout),
        micro_batch_key(MODEL, pipe_len=1, replica_batch=32, **layout),
        micro_batch_key(MODEL, pipe_len=2, replica_batch=16, **layout),
        micro_batch_key(MODEL, pipe_len=2, replica_batch=32, **{**layout, "num_frozen_layers": 1}),
        micro_batch_key(MODEL, pipe_len=2, replica_batch=32, **{**layout, "schedule": "1f1b"}),
    ]
    assert len({str(k) for k in [key, *others]}) == 6
    for k in [key, *others]:
        assert MicroBatchKey.parse(str(k)) == k
    unit = unit_profile_key(MODEL, "cuda:NVIDIA H100 80GB HBM3", "bfloat16", 8, [(128,)] * 3)
    assert UnitProfileKey.parse(str(unit)) == unit and unit.device == "cuda:NVIDIA H100 80GB HBM3"
    # The file's key strings are those of earlier releases (profile files stay readable).
    assert str(unit) == (
        f"unit|model={MODEL}|device=cuda:NVIDIA H100 80GB HBM3|dtype=bfloat16|micro_batch=8"
        "|inputs=128,128,128"
    )
    with pytest.raises(ValueError, match="not a unit profile key"):
        UnitProfileKey.parse(str(key))


def test_second_run_reads_the_profile_instead_of_measuring(tmp_path, monkeypatch):
    """The trainer's profiler (in a world of one process) measures what the profile file
    lacks and nothing it has: a second run of the same model measures nothing; another
    model, K or replica batch is measured afresh."""
    from pipetransformer.autodp.control import Control
    from pipetransformer.planning import describe_model
    from pipetransformer.profiling import run_profiler as profiler_module

    calls = {"units": 0, "micro": []}

    def measure(units, spec, micro, device, autocast_dtype=None):
        calls["units"] += 1
        return {u: UnitMeasurement(0.01, 0.02, 0.009, 64, 128, 256) for u in units}

    def measure_step(m):
        calls["micro"].append(m)
        return lambda: None

    monkeypatch.setattr(profiler_module, "measure_unit_costs", measure)
    path = tmp_path / "profiles.json"

    def profiler(*overrides):
        config = load_config(QUICKSTART, [f"pipeline.profile_path={path}", *overrides])
        spec = describe_model(config)
        run = profiler_module.RunProfiler(
            config, spec, tmp_path / "run", torch.device("cpu"), Control(None)
        )
        return run, [torch.nn.Identity() for _ in range(spec.num_units)]

    candidates = candidate_micro_batches(2, 32)
    for _run in range(2):  # each "run" opens the file afresh
        run, units = profiler()
        run.unit_profile(units, 8)
        assert run.micro_batches(2, 32, measure_step) in candidates
    assert calls == {"units": 1, "micro": candidates}
    assert run.take_seconds() == 0.0  # the second run measured nothing

    calls["micro"].clear()
    run.micro_batches(1, 32, measure_step)
    run.micro_batches(2, 16, measure_step)
    assert calls["micro"] == candidate_micro_batches(1, 32) + candidate_micro_batches(2, 16)
    deeper, units = profiler("model.kwargs.depth=2")
    deeper.unit_profile(units, 8)
    assert calls["units"] == 2


def test_a_micro_batch_timing_taken_under_load_is_measured_again_and_not_kept(
    tmp_path, monkeypatch, caplog
):
    """Repeats of one timing that disagree (another job on the machine) are measured again;
    if they still disagree the timing serves this layout but is not written for later
    runs, and a warning says how to pin M. A run's profiles live in its own directory."""
    import itertools
    import logging

    from pipetransformer.autodp.control import Control
    from pipetransformer.planning import describe_model
    from pipetransformer.profiling import run_profiler as profiler_module

    samples = {1: itertools.cycle([0.010, 0.011]), 2: itertools.cycle([0.010, 0.030, 0.010])}
    monkeypatch.setattr(
        profiler_module,
        "time_schedule_samples",
        lambda step, steps, warmup, device: [next(step) for _ in range(steps)],
    )
    config = load_config(QUICKSTART)
    run = profiler_module.RunProfiler(
        config, describe_model(config), tmp_path / "run", torch.device("cpu"), Control(None)
    )
    assert run.path == tmp_path / "run" / "profiles.json"
    with caplog.at_level(logging.WARNING, logger="pipetransformer"):
        chosen = run.micro_batches(1, 2, lambda m: samples[m])
    assert chosen == 1 and "look taken under load" in caplog.text and "M=2" in caplog.text
    stored = ProfileStore(run.path).load()
    (timings,) = stored._micro_batch_timings.values()
    assert set(timings) == {1}  # the noisy M=2 was not kept


def test_corrupt_or_foreign_profile_file_is_an_error_naming_the_path(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match=str(path)):
        ProfileStore(path).load()
    path.write_text(json.dumps({"format_version": FORMAT_VERSION + 1}))
    with pytest.raises(ProfileError, match="version"):
        ProfileStore(path).load()
    path.write_text(
        json.dumps({"format_version": FORMAT_VERSION, "unit_profiles": {"u": {"forward_s": [1]}}})
    )
    with pytest.raises(ProfileError, match=str(path)):
        ProfileStore(path).load()


# ------------------------------------------------------------------ measurement


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _graph_bytes() -> int:
    """Bytes of live tensors that belong to an autograd graph (collected ones excluded)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated aliases
        warnings.simplefilter("ignore", FutureWarning)
        return sum(
            o.untyped_storage().nbytes()
            for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and o.grad_fn is not None
        )


@pytest.mark.parametrize("make", [tiny_vit, tiny_bert], ids=["vit", "bert"])
def test_measure_unit_costs_on_tiny_models(make):
    model = make()
    spec = model.spec
    model.train()
    model.units[0].requires_grad_(False)  # a frozen unit is measured as trained, then restored
    before = _snapshot(model)
    rng = torch.get_rng_state()
    graphs = _graph_bytes()
    units = dict(enumerate(model.units))
    small = measure_unit_costs(units, spec, micro_batch_size=2, device="cpu", repeats=2, warmup=0)
    large = measure_unit_costs(units, spec, micro_batch_size=4, device="cpu", repeats=1, warmup=0)

    assert sorted(small) == list(range(spec.num_units))
    for unit, m in small.items():
        assert m.forward_s > 0 and m.backward_s > 0 and m.frozen_forward_s > 0, unit
        assert m.param_bytes == 4 * spec.unit_param_counts[unit]
    for layer in range(spec.num_layers):
        attention = 1 + 2 * layer
        assert small[attention].saved_bytes > small[attention].output_bytes
        for unit in (attention, attention + 1):
            ratio = large[unit].saved_bytes / small[unit].saved_bytes
            assert 1.5 <= ratio <= 2.5, (unit, ratio)
            assert large[unit].output_bytes == 2 * small[unit].output_bytes

    # No trace left: weights, grads, flags, modes, the RNG stream.
    after = _snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert not any(p.requires_grad for p in model.units[0].parameters())
    assert all(p.requires_grad for p in model.units[1].parameters())
    assert all(module.training for module in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)
    # Nor an autograd graph: the saved-bytes forward once kept every attention unit's
    # activations alive for the rest of the run (0.7 GiB on BERT-base's last stage).
    assert _graph_bytes() == graphs

    profile = UnitProfile.from_measurements(small, micro_batch_size=2)
    assert unit_costs_from_profile(profile).num_units == spec.num_units


def test_measure_keeps_eval_mode_and_existing_grads():
    model = tiny_vit()
    model.eval()
    head = model.units[spec_head := model.spec.head_unit]
    for p in head.parameters():
        p.grad = torch.full_like(p, 7.0)
    measure_unit_costs(
        {spec_head: head}, model.spec, micro_batch_size=2, device="cpu", repeats=1, warmup=0
    )
    assert not any(module.training for module in model.modules())
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in head.parameters())


@pytest.mark.gpu
def test_measure_unit_costs_on_cuda():
    model = tiny_vit(device="cpu").to("cuda")
    before = _snapshot(model)
    cuda_rng = torch.cuda.get_rng_state()
    measured = measure_unit_costs(
        dict(enumerate(model.units)), model.spec, 4, "cuda", repeats=2, warmup=1
    )
    assert all(
        m.forward_s > 0 and m.backward_s > 0 and m.saved_bytes > 0 for m in measured.values()
    )
    assert all(torch.equal(before[k], v) for k, v in _snapshot(model).items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)


def test_time_schedule_steps_runs_warmup_then_timed_steps():
    calls = []
    seconds = time_schedule_steps(lambda: calls.append(1), steps=3, warmup=2)
    assert len(calls) == 5 and seconds >= 0
    with pytest.raises(ValueError):
        time_schedule_steps(lambda: None, steps=0, warmup=0)


def test_unit_measurement_rejects_negative_values():
    with pytest.raises(ValueError):
        UnitMeasurement(-1.0, 0.0, 0.0, 0, 0, 0)


# ------------------------------------------------------------------ the plan command


def test_plan_table_uses_a_stored_profile(tmp_path):
    from pipetransformer.planning import describe_model, profiling_micro_batch_size
    from pipetransformer.planning.profile_keys import micro_batch_key_for, unit_profile_key_for
    from pipetransformer.planning.table import plan_table

    path = tmp_path / "profiles.json"
    config = load_config(
        QUICKSTART,
        [
            "pipeline.balance=time",
            "pipeline.num_micro_batches=measured",
            "pipeline.initial_pipe_len=2",
            f"pipeline.profile_path={path}",
        ],
    )
    spec = describe_model(config)
    # Without a profile: parameter counts, as before.
    assert {row.cost_source for row in plan_table(config, device_type="cpu")} == {"params"}

    n = spec.num_units
    heavy_first = UnitProfile(
        micro_batch_size=profiling_micro_batch_size(config),
        forward_s=(1e-4,) + (0.01,) * (n - 1),
        backward_s=(1e-4,) + (0.02,) * (n - 1),
        frozen_forward_s=(1e-4,) + (0.009,) * (n - 1),
        output_bytes=(1,) * n,
        saved_bytes=(1,) * n,
        param_bytes=(4,) * n,
    )
    store = ProfileStore(path)
    store.put_unit_profile(
        unit_profile_key_for(config, spec, "cpu", heavy_first.micro_batch_size), heavy_first
    )
    # K=2, one replica of the global batch 64, nothing frozen: M=8 measured fastest.
    store.put_micro_batch_timings(
        micro_batch_key_for(config, spec, "cpu", 2, 64), {2: 0.3, 4: 0.2, 8: 0.1}
    )
    store.save()

    rows = plan_table(config, device_type="cpu")
    assert {row.cost_source for row in rows} == {"time"}
    assert rows[0].max_stage_cost == pytest.approx(max(rows[0].stage_costs))
    assert rows[0].max_stage_cost < 1.0  # seconds, not parameter counts
    assert rows[0].num_micro_batches == 8
    # Another device type has no profile: back to parameter counts.
    assert {row.cost_source for row in plan_table(config, device_type="cuda:other")} == {"params"}


def test_plan_predict_finds_the_newest_profile_of_the_model_under_runs(tmp_path):
    """Without --profile, `plan --predict` takes the newest profile file under ./runs with a
    unit profile of this model (a run's RUN_DIR/profiles.json); with none, one error line
    names both ways to a prediction (it once named runs/profiles/profiles.json, a file no
    run writes)."""
    import os

    from pipetransformer.config import ConfigError
    from pipetransformer.planning import describe_model, profiling_micro_batch_size
    from pipetransformer.planning.prediction_inputs import _newest_run_profile
    from pipetransformer.planning.profile_keys import unit_profile_key_for

    runs = tmp_path / "runs"
    config = load_config(QUICKSTART, [])
    with pytest.raises(ConfigError) as error:
        _newest_run_profile(config, describe_model(config), runs)
    message = str(error.value)
    assert "\n" not in message and "--device NAME" in message and "quadro-rtx-5000" in message
    assert "--profile RUN_DIR/profiles.json" in message and "profiles/profiles.json" not in message

    def profile_of(config, run: str, forward_s: float, mtime: float) -> None:
        spec = describe_model(config)
        n, micro = spec.num_units, profiling_micro_batch_size(config)
        profile = UnitProfile(micro, (forward_s,) * n, (0.02,) * n, (0.009,) * n, *([(4,) * n] * 3))
        store = ProfileStore(runs / run / "profiles.json")
        store.put_unit_profile(unit_profile_key_for(config, spec, "cpu", micro), profile)
        store.save()
        os.utime(runs / run / "profiles.json", (mtime, mtime))

    profile_of(config, "quickstart-old", 0.01, 1_000)
    profile_of(config, "quickstart-new", 0.03, 2_000)
    other = load_config(QUICKSTART, ["model.kwargs.depth=4"])
    profile_of(other, "another-model", 0.05, 3_000)  # newest, but not this model's
    path, (profile, _, _) = _newest_run_profile(config, describe_model(config), runs)
    assert path == runs / "quickstart-new" / "profiles.json" and profile.forward_s[0] == 0.03
