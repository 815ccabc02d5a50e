"""`pipetransformer compare`: the baseline and the elastic system, one after the other, on the
same seed, data and machine; with --ablations also the paper's speedup breakdown (Fig. 9).

Owns: the variants' overrides, running them (local worker processes), measuring the
per-unit costs the ideal speedup needs, and writing results.json, report.md and plots.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipetransformer.compare.plots import write_plots
from pipetransformer.compare.report import (
    BASELINE,
    DDP,
    ELASTIC,
    FREEZE_DDP,
    TITLES,
    build_results,
    read_run,
    save_results,
    write_report,
)
from pipetransformer.config import Config, ConfigError, load_config
from pipetransformer.launcher import WorkerFailed, launch_local
from pipetransformer.trainer import run_worker

logger = logging.getLogger(__name__)


def variant_overrides(config: Config, ablations: bool, peers: bool = False) -> dict[str, list[str]]:
    """Overrides per variant, in the order they run. The baseline is the same config with
    freezing (and so every elastic component) off, as a fixed pipeline: the configured
    length, or with 'auto' the whole node (the paper's Pipe+DDP). Peers are what a user
    would run instead when the model fits one device: plain DDP, and DDP with the same
    freeze algorithm and AutoCache but no pipeline."""
    pipe_len = config.pipeline.initial_pipe_len
    fixed = pipe_len if isinstance(pipe_len, int) else config.nproc_per_node
    variants = {BASELINE: ["freeze.strategy=none", "cache.enabled=false", f"pipeline.initial_pipe_len={fixed}"]}
    if peers:
        variants[DDP] = ["freeze.strategy=none", "cache.enabled=false", "pipeline.initial_pipe_len=1"]
        variants[FREEZE_DDP] = ["pipeline.initial_pipe_len=1"]
    if ablations:
        variants["freeze_only"] = ["autopipe.enabled=false", "cache.enabled=false"]
        variants["no_autodp"] = ["autodp.enabled=false", "cache.enabled=false"]
        if config.cache.enabled:
            variants["no_cache"] = ["cache.enabled=false"]
    variants[ELASTIC] = []
    return variants


def machine_description(config: Config) -> str:
    device = "CUDA: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() and config.trainer.device != "cpu" else "CPU"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {device}, {config.nproc_per_node} processes, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def measured_unit_costs(config: Config) -> dict[str, list[float]] | None:
    """Per-unit forward+backward and forward-only seconds at the run's micro-batch size,
    measured in this process (the ideal speedup needs times, not parameter counts)."""
    try:
        return measure_model_costs(config)
    except Exception as exc:  # the report stays useful without the ideal figure
        logger.warning("could not measure unit costs for the ideal speedup: %s", exc)
        return None


def measure_model_costs(config: Config) -> dict[str, list[float]]:
    """Per-unit seconds (trained: forward + backward; frozen: forward only) of the config's
    model at the baseline layout's micro-batch size, measured in this process."""
    from pipetransformer.models import build_model
    from pipetransformer.pipe.measure import measure_unit_costs
    from pipetransformer.planning import (
        describe_model,
        model_build_args,
        profiling_micro_batch_size,
    )

    spec = describe_model(config)
    micro = profiling_micro_batch_size(config)
    model = build_model(config.model, **model_build_args(config))
    measured = measure_unit_costs(dict(enumerate(model.units)), spec, micro, "cpu")
    units = range(spec.num_units)
    return {
        "trained": [measured[u].forward_s + measured[u].backward_s for u in units],
        "frozen": [measured[u].frozen_forward_s for u in units],
        "micro_batch_size": micro,
    }


def run_compare(
    config: Config, config_path: str | None, overrides: list[str], out: Path, ablations: bool, peers: bool = False
) -> int:
    if config.freeze.strategy == "none":
        raise ConfigError("freeze.strategy: compare needs a freeze strategy (the baseline turns it off)")
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    variants = variant_overrides(config, ablations, peers)
    for index, (name, extra) in enumerate(variants.items(), start=1):
        variant_config = load_config(config_path, [*overrides, *extra])
        run_dir = out / name
        print(f"pipetransformer compare: [{index}/{len(variants)}] {TITLES[name]} -> {run_dir}", file=sys.stderr)
        started = time.perf_counter()
        try:
            launch_local(variant_config.nproc_per_node, run_worker, (variant_config, run_dir))
        except WorkerFailed as exc:
            print(f"pipetransformer compare: {name} failed: {exc}", file=sys.stderr)
            return 1
        runs[name] = read_run(run_dir)
        run = runs[name]
        print(
            f"pipetransformer compare: {name} done in {time.perf_counter() - started:.0f} s: wall_time_s "
            f"{run['wall_time_s']:.1f}, final {run['metric_name']} {run['final_eval_metric']:.4f}",
            file=sys.stderr,
        )
    costs = measured_unit_costs(config)
    return _write_outputs(runs, costs, _context(config, config_path, overrides, ablations, peers), config, out)


def rebuild_compare(config: Config, config_path: str | None, overrides: list[str], out: Path) -> int:
    """results.json, report.md and plots again from the variants' run directories in `out`
    (after an upgrade of the report, or when a later variant failed): nothing is rerun. The
    unit costs of an earlier results.json are reused, so the ideal speedup is comparable."""
    names = [name for name in TITLES if (out / name / "summary.json").is_file()]
    if BASELINE not in names or ELASTIC not in names:
        raise ConfigError(f"--report-only: {out} has no finished {BASELINE}/ and {ELASTIC}/ runs (summary.json)")
    runs = {name: read_run(out / name) for name in names}
    # What the elastic run resolved (cache on or off), whatever this invocation's overrides say.
    resolved = out / ELASTIC / "config.yaml"
    if resolved.is_file():
        config = load_config(str(resolved))
    previous = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    context = _context(
        config, config_path, overrides, ablations="freeze_only" in names, peers=DDP in names
    )
    # The command and machine that produced the runs, not this invocation's.
    context.update({key: previous[key] for key in context if key in previous})
    costs = previous.get("unit_costs") or measured_unit_costs(config)
    return _write_outputs(runs, costs, context, config, out)


def _context(
    config: Config, config_path: str | None, overrides: list[str], ablations: bool, peers: bool = False
) -> dict[str, Any]:
    options = [*(["--peers"] if peers else []), *(["--ablations"] if ablations else [])]
    return {
        "config": config_path,
        "config_name": Path(config_path).stem if config_path else "default",
        "overrides": overrides,
        "command": " ".join(["pipetransformer compare", config_path or "", *overrides, *options]),
        "machine": machine_description(config),
    }


def _write_outputs(
    runs: dict[str, dict[str, Any]],
    costs: dict[str, list[float]] | None,
    context: dict[str, Any],
    config: Config,
    out: Path,
) -> int:
    results = build_results(runs, costs, config.cache.enabled, context)
    plots = write_plots(runs, out)
    results["plots"] = sorted(plots)
    save_results(results, out)
    print(write_report(results, out, sorted(plots)))
    return 0
