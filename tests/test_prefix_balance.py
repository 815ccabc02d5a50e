"""A frozen boundary's stage 0 is balanced for the prefix work its steps do: filling the
cache in the boundary's first epoch, reading it once a decision point finds every entry
written (then the run re-plans the same boundary and moves units). Stage times come from a
unit profile written beforehand, so the plans do not depend on this machine's timings: every
unit takes 1 s forward and 2 s backward, and a frozen unit 1 s, against a cache read of
microseconds, so filling costs stage 0 the whole prefix and reading almost nothing.

2 ranks, one 2-stage pipeline (the packed stage would not fit Eq. 2's bound), manual freeze
of 3 of 6 layers at the end of epoch 1 and nothing more; checked against single-process
training as the elastic tests are."""

from __future__ import annotations

import json

import pytest
from helpers import run_workers
from reference import elastic_config, reference_run, step_losses
from workers import elastic_run

from pipetransformer.autopipe.profiles import ProfileStore, UnitProfile
from pipetransformer.config import config_from_dict
from pipetransformer.planning import describe_model, profiling_micro_batch_size
from pipetransformer.planning.profile_keys import unit_profile_key_for

pytestmark = pytest.mark.distributed


def test_a_boundary_is_balanced_for_filling_the_cache_then_for_reading_it(tmp_path):
    profiles = tmp_path / "profiles.json"
    config_dict = elastic_config(
        trainer__nproc_per_node=2,
        pipeline__initial_pipe_len=2,
        pipeline__balance="time",
        pipeline__profile_path=str(profiles),
        freeze__manual_schedule=[3],
    )
    config_dict["cache"] = {"enabled": True}
    config = config_from_dict(config_dict)
    spec = describe_model(config)
    micro = profiling_micro_batch_size(config, 2)
    n = spec.num_units
    store = ProfileStore(profiles)
    store.put_unit_profile(
        unit_profile_key_for(config, spec, "cpu", micro),
        UnitProfile(micro, (1.0,) * n, (2.0,) * n, (1.0,) * n, (64,) * n, (64,) * n, (4,) * n),
    )
    store.save()

    run_dir = tmp_path / "run"
    results = run_workers(elastic_run, 2, config_dict, str(run_dir))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    transitions = [e for e in events if e["kind"] == "transition"]
    # F 0 -> 3 at the end of epoch 1, then 3 -> 3 at the end of epoch 2: the same boundary
    # balanced again, units moved, the pipeline unchanged.
    assert [(t["old_num_frozen_layers"], t["new_num_frozen_layers"]) for t in transitions] == [
        (0, 3),
        (3, 3),
    ]
    assert [(t["new_pipe_len"], t["new_dp_degree"]) for t in transitions] == [(2, 1), (2, 1)]
    filling, reading = (t["new_stage_ranges"] for t in transitions)
    # Active units [7, 14) at 3 s: filling, stage 0 also runs the 7 frozen units' forward
    # (7 s) and takes 2 units (13 s against 15 s); reading, it takes 3 (9 s against 12 s).
    assert filling == [[7, 9], [9, 14]] and reading == [[7, 10], [10, 14]]
    assert transitions[1]["units_moved"] > 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["num_frozen_layers"] for m in metrics] == [0, 3, 3]
    assert metrics[1]["cache_misses"] > 0 and metrics[2]["cache_hits"] > 0

    ref_losses, ref_state, _ = reference_run(config)
    assert step_losses(run_dir) == pytest.approx(ref_losses, abs=1e-5)
    state = results[0]["state"][0]
    for name, value in ref_state.items():
        assert state[name].allclose(value, rtol=1e-4, atol=1e-5), name
