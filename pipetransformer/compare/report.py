"""From finished run directories to results.json and report.md.

Everything here is read back from what the runs wrote (summary.json, metrics.jsonl,
events.jsonl), so the report can never disagree with the runs. A comparison over seeds keeps
each seed's runs in `seed-<s>/<variant>/`; its statistics come from compare/stats.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from pipetransformer.compare.ideal import StepLayout, ideal_speedup, segments_from_run
from pipetransformer.compare.stats import (
    MeanStd,
    PairStats,
    SeededStats,
    SeedRun,
)
from pipetransformer.compare.timing import VariantAttempt, describe_attempt, read_attempts
from pipetransformer.runs.records import (
    EpochMetrics,
    RunSummary,
    StartEvent,
    TransitionEvent,
    event_from_dict,
)
from pipetransformer.utils.files import read_jsonl, write_json_atomic

BASELINE = "baseline"
DDP = "ddp"
DDP_FROZEN_EMBEDDING = "ddp_frozen_embedding"
FREEZE_DDP = "freeze_ddp"
FSDP = "fsdp"
FREEZE_FSDP = "freeze_fsdp"
ELASTIC = "elastic"
# What users run instead of this trainer (compare/peers.py): transformers' Trainer for text
# models, the plain timm + DDP loop for image models.
HF_TRAINER = "hf_trainer"
TORCH_DDP = "torch_ddp"
REFUSED = "refused.json"  # in a variant's directory: it was refused (does not fit), and why
TITLES = {
    BASELINE: "baseline (Pipe + DDP, no freezing)",
    DDP: "DDP (K = 1, no freezing)",
    DDP_FROZEN_EMBEDDING: "DDP, embedding frozen (K = 1, no layer freezing)",
    HF_TRAINER: "transformers Trainer + DDP (no freezing)",
    TORCH_DDP: "timm model + plain DDP loop (no freezing)",
    FREEZE_DDP: "freeze + DDP (K = 1, freeze algorithm and AutoCache)",
    FSDP: "FSDP2 (sharded over every process, no freezing)",
    FREEZE_FSDP: "freeze + FSDP2 (sharded, freeze algorithm and AutoCache)",
    "freeze_only": "freeze only (no AutoPipe)",
    "no_autodp": "freeze + AutoPipe (no AutoDP)",
    "no_cache": "freeze + AutoPipe + AutoDP (no cache)",
    ELASTIC: "PipeTransformer (full system)",
}
SEED_PREFIX = "seed-"


def seed_dir(out: Path, seed: int) -> Path:
    return out / f"{SEED_PREFIX}{seed}"


def is_finished(run_dir: Path) -> bool:
    """A run that ended writes summary.json last: without it the run is to be done (again)."""
    return (run_dir / "summary.json").is_file()


def refusal(run_dir: Path) -> str | None:
    """Why a variant was refused at start (it does not fit even sharded), or None."""
    path = run_dir / REFUSED
    return json.loads(path.read_text())["reason"] if path.is_file() else None


def finished_seed_runs(out: Path) -> dict[int, list[str]]:
    """Per seed of a comparison over seeds in `out` (its seed-<s>/ directories), the
    variants whose run finished, in the order compare runs them."""
    found: dict[int, list[str]] = {}
    for path in out.glob(f"{SEED_PREFIX}*"):
        seed = path.name.removeprefix(SEED_PREFIX)
        if path.is_dir() and seed.lstrip("-").isdigit():
            found[int(seed)] = [name for name in TITLES if is_finished(path / name)]
    return dict(sorted(found.items()))


def _timed_communication(run_dir: Path) -> bool:
    """Whether the run in `run_dir` timed its data-parallel all-reduce (its resolved config's
    logging.time_communication; a run without one, from before the key, always did)."""
    resolved = run_dir / "config.yaml"
    if not resolved.exists():
        return True
    logging_section = (yaml.safe_load(resolved.read_text()) or {}).get("logging") or {}
    return bool(logging_section.get("time_communication", True))


def _comm_share(run: dict[str, Any]) -> str:
    """The report's DDP comm share cell ('not timed' unless logging.time_communication)."""
    if not run.get("ddp_comm_timed", True):
        return "not timed"
    return f"{100 * run['ddp_comm_share']:.1f}%"


def read_run(run_dir: Path) -> dict[str, Any]:
    """One variant's entry of results.json, from the records its run wrote."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{summary_path} is missing: the run did not finish")
    summary = RunSummary.from_dict(json.loads(summary_path.read_text()))
    metrics = [EpochMetrics.from_dict(m) for m in read_jsonl(run_dir / "metrics.jsonl")]
    events = [event_from_dict(e) for e in read_jsonl(run_dir / "events.jsonl")]
    transitions = [e for e in events if isinstance(e, TransitionEvent)]
    starts = [e for e in events if isinstance(e, StartEvent)]
    epoch_time = sum(m.epoch_time_s for m in metrics)
    comm = sum(m.ddp_comm_s for m in metrics)
    return {
        "run_dir": str(run_dir),
        "training_time_s": summary.training_time_s,
        "final_eval_metric": summary.final_eval_metric,
        "best_eval_metric": summary.best_eval_metric,
        "metric_name": summary.metric_name,
        "final_scores": summary.final_scores,
        "samples_per_s": [m.samples_per_s for m in metrics],
        # Text: real and padded tokens an epoch (real tokens per second: real / epoch time).
        "real_tokens": [m.real_tokens for m in metrics],
        "padded_tokens": [m.padded_tokens for m in metrics],
        "epoch_time_s": [m.epoch_time_s for m in metrics],
        "eval_time_s": sum(m.eval_time_s for m in metrics),
        # Off training_time_s, every attempt (None: a summary of formats 1-3, whose
        # training_time_s counts evaluation and checkpoints: runs/records.py, "Formats").
        "checkpoint_time_s": summary.checkpoint_time_s,
        "evaluation_on_the_clock": summary.evaluation_on_the_clock,
        "eval_metric": [m.eval_metric for m in metrics],
        "freeze_trajectory": [
            {
                "epoch": m.epoch,
                "global_step": m.global_step,
                "num_frozen_layers": m.num_frozen_layers,
                "pipe_len": m.pipe_len,
                "dp_degree": m.dp_degree,
                "num_micro_batches": m.num_micro_batches,
                "sharded": m.sharded,
                "virtual_stages": m.virtual_stages,
            }
            for m in metrics
        ],
        "transitions": [t.to_dict() for t in transitions],
        # Whether its starting layout fits the device memory the run was planned for.
        "predicted_peak_bytes": max(starts[0].predicted_stage_bytes, default=None)
        if starts
        else None,
        "device_memory_bytes": starts[0].device_memory_bytes if starts else None,
        "ddp_comm_share": comm / epoch_time if epoch_time > 0 else 0.0,
        # Whether the run timed it (logging.time_communication: off by default).
        "ddp_comm_timed": _timed_communication(run_dir),
        "steps_per_epoch": metrics[0].global_step if metrics else 0,
        "sharded": bool(metrics and metrics[-1].sharded),
        "peak_rss_bytes": summary.peak_rss_bytes,
        "peak_allocated_bytes": summary.peak_allocated_bytes,
        # When it ran and beside how much other work (compare/timing.py), each attempt.
        "attempts": [a.to_dict() for a in read_attempts(run_dir)],
    }


def read_seed_run(run_dir: Path, variant: str, seed: int) -> SeedRun:
    """What the statistics over seeds need of one finished run."""
    summary = RunSummary.from_dict(json.loads((run_dir / "summary.json").read_text()))
    if summary.final_eval_metric is None or summary.best_eval_metric is None:
        raise ValueError(f"{run_dir / 'summary.json'}: no eval metric (the run never evaluated)")
    return SeedRun(
        variant=variant,
        seed=seed,
        training_time_s=summary.training_time_s,
        final_eval_metric=summary.final_eval_metric,
        best_eval_metric=summary.best_eval_metric,
    )


def build_results(
    runs: dict[str, dict[str, Any]],
    unit_costs: dict[str, list[float]] | None,
    cache_enabled: bool,
    context: dict[str, Any],
) -> dict[str, Any]:
    """results.json: per variant, plus speedup, metric delta, ideal speedup, efficiency."""
    base, elastic = runs[BASELINE], runs[ELASTIC]
    results: dict[str, Any] = {**context, "variants": runs}
    results["speedup"] = base["training_time_s"] / elastic["training_time_s"]
    results["eval_metric_delta"] = elastic["final_eval_metric"] - base["final_eval_metric"]
    results["speedups"] = {
        name: base["training_time_s"] / run["training_time_s"] for name, run in runs.items()
    }
    # How many times faster each variant is than each other one (row / column).
    results["speedup_matrix"] = {
        a: {b: runs[b]["training_time_s"] / runs[a]["training_time_s"] for b in runs} for a in runs
    }
    if unit_costs is not None:
        steps = base["steps_per_epoch"]
        first = base["freeze_trajectory"][0]
        initial = StepLayout(0, 0, 0, first["pipe_len"], first["num_micro_batches"])
        ideal = ideal_speedup(
            baseline_segments=segments_from_run(_metrics_of(base), [], steps, initial),
            elastic_segments=segments_from_run(
                _metrics_of(elastic), elastic["transitions"], steps, initial
            ),
            trained=unit_costs["trained"],
            frozen=unit_costs["frozen"],
            steps_per_epoch=steps,
            cache=cache_enabled,
            baseline_wall_s=base["training_time_s"],
            # Evaluation is on the training clock of summaries of formats 1-3 only.
            baseline_eval_s=base["eval_time_s"] if base["evaluation_on_the_clock"] else 0.0,
            elastic_wall_s=elastic["training_time_s"],
            eval_frozen=[point["num_frozen_layers"] for point in elastic["freeze_trajectory"]],
        )
        results["ideal_speedup"] = ideal.ideal_speedup
        results["efficiency"] = ideal.efficiency
        results["unit_costs"] = unit_costs
    return results


def _metrics_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"global_step": t["global_step"]} for t in run["freeze_trajectory"]]


def _fmt_layout(run: dict[str, Any]) -> str:
    path = []
    for point in run["freeze_trajectory"]:
        label = f"{point['pipe_len']}x{point['dp_degree']}"
        if point.get("sharded"):
            label += " sharded"
        if not path or path[-1] != label:
            path.append(label)
    return " → ".join(path)


def throughput(run: dict[str, Any]) -> dict[str, float]:
    """A run's training throughput over all its epochs, recomputed from its records:
    samples/s, real tokens/s and the share of its padded tokens that were padding (text)."""
    seconds = sum(run["epoch_time_s"])
    samples = sum(s * t for s, t in zip(run["samples_per_s"], run["epoch_time_s"]))
    real, padded = sum(run.get("real_tokens", [])), sum(run.get("padded_tokens", []))
    return {
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "real_tokens_per_s": real / seconds if seconds > 0 else 0.0,
        "padded_share": 1 - real / padded if padded > 0 else 0.0,
    }


def throughput_section(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Samples and real tokens per second of training, for text runs (none for images)."""
    if not any(sum(run.get("real_tokens", [])) for run in runs.values()):
        return []
    lines = [
        "",
        "Training throughput (real tokens: before padding; padded share: of the tokens the "
        "batches held):",
        "",
        "| variant | samples/s | real tokens/s | padded share |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, run in runs.items():
        rate = throughput(run)
        lines.append(
            f"| {TITLES.get(name, name)} | {rate['samples_per_s']:.1f} | "
            f"{rate['real_tokens_per_s']:.0f} | {100 * rate['padded_share']:.1f}% |"
        )
    return lines


def write_report(
    results: dict[str, Any], out: Path, plots: list[str], seeded: SeededStats | None = None
) -> str:
    """report.md. With `seeded` (a comparison over seeds), the statistics over the seeds
    come first and the rest describes the runs of the first seed."""
    runs = results["variants"]
    metric = runs[BASELINE]["metric_name"]
    lines = [f"# {results.get('config_name', 'run')}: PipeTransformer vs Pipe+DDP baseline"]
    if seeded is not None:
        lines += seeded_section(seeded, metric)
        lines += ["", f"## Seed {results['detail_seed']} in detail"]
    lines += [
        "",
        f"**Speedup {results['speedup']:.2f}x** (baseline training time / elastic training "
        "time, the same epochs: a fixed-epoch speedup); "
        f"final {metric} "
        f"{runs[ELASTIC]['final_eval_metric']:.4f} vs {runs[BASELINE]['final_eval_metric']:.4f} "
        f"(delta {100 * results['eval_metric_delta']:+.2f} points).",
    ]
    if "ideal_speedup" in results:
        lines.append(
            f"Ideal speedup for this freeze trajectory {results['ideal_speedup']:.2f}x; "
            f"efficiency {results['efficiency']:.2f} (measured / ideal). {EFFICIENCY_MEANING}"
        )
    lines += [
        "",
        (
            f"| variant | training time (s) | speedup | final {metric} | best {metric} "
            "| frozen layers | pipe_len x dp_degree | DDP comm share |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for name, run in runs.items():
        lines.append(
            f"| {TITLES.get(name, name)} | {run['training_time_s']:.1f} | "
            f"{results['speedups'][name]:.2f}x | "
            f"{run['final_eval_metric']:.4f} | {run['best_eval_metric']:.4f} | "
            f"{run['freeze_trajectory'][-1]['num_frozen_layers']} | {_fmt_layout(run)} | "
            f"{_comm_share(run)} |"
        )
    for name, reason in results.get("refused", {}).items():
        lines.append(f"| {TITLES.get(name, name)} | refused: {reason} | | | | | | |")
    lines += throughput_section(runs)
    scored = {name: run["final_scores"] for name, run in runs.items() if run.get("final_scores")}
    if scored:
        names = list(next(iter(scored.values())))
        lines += [
            "",
            "Final evaluation, every metric:",
            "",
            "| variant | " + " | ".join(names) + " |",
            "| --- | " + " | ".join("---:" for _ in names) + " |",
        ]
        for name, scores in scored.items():
            cells = " | ".join(f"{scores.get(m, float('nan')):.4f}" for m in names)
            lines.append(f"| {TITLES.get(name, name)} | {cells} |")
    if len(runs) > 2:
        names = list(runs)
        lines += [
            "",
            "## Each variant against each other (times faster: row over column)",
            "",
            "| | " + " | ".join(names) + " | fits the device |",
            "| --- | " + " | ".join("---:" for _ in names) + " | --- |",
        ]
        for a in names:
            cells = " | ".join(f"{results['speedup_matrix'][a][b]:.2f}x" for b in names)
            lines.append(f"| {a} | {cells} | {_fits(runs[a])} |")
    events = runs[ELASTIC]["transitions"]
    if events:
        lines += [
            "",
            "## Transitions of the full system",
            "",
            (
                "| epoch | step | frozen | pipe_len | dp_degree | units moved | plan (ms) "
                "| state move (ms) | groups (ms) | micro-batch profiling (ms) | compile (ms) "
                "| rebuild (ms) | total (ms) |"
            ),
            "| ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: |",
        ]
        for e in map(TransitionEvent.from_dict, events):
            lines.append(
                f"| {e.epoch} | {e.global_step} | "
                f"{e.old_num_frozen_layers} → {e.new_num_frozen_layers} | "
                f"{e.old_pipe_len} → {e.new_pipe_len} | "
                f"{e.old_dp_degree} → {e.new_dp_degree} | "
                f"{e.units_moved} | {1000 * e.plan_s:.1f} | {1000 * e.state_move_s:.1f} | "
                f"{1000 * e.groups_s:.1f} | {1000 * e.profile_s:.1f} | {1000 * e.compile_s:.1f} | "
                f"{1000 * e.rebuild_s:.1f} | {1000 * e.total_s:.1f} |"
            )
    lines += _when_section(runs)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    machine = results.get("machine")
    if machine:
        lines += ["", f"Machine: {machine}. Command: `{results.get('command', '')}`"]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


# What the efficiency is, beside it in the report: compare/ideal.py has the arithmetic.
EFFICIENCY_MEANING = (
    "The ideal is the baseline's training time scaled by the compute this run's own freeze "
    "trajectory leaves (the active layers' forward and backward, the frozen layers' forward "
    "where the cache does not serve them, the pipeline bubble): the gain of freezing alone, "
    "with every other cost of the baseline kept in proportion. Efficiency above 1 means the "
    "full system shed more than that: costs a shorter pipeline drops (activations sent "
    "between stages, a slower stage holding up the others, many small micro-batches), or a "
    "machine less busy during its run than during the baseline's (see when each ran)."
)


def _when_section(runs: dict[str, dict[str, Any]]) -> list[str]:
    """When each variant ran and beside how much other work (the 1-minute load average at
    its start and end): they ran one after the other, under whatever else the machine did."""
    rows = [
        f"| {TITLES.get(name, name)} | "
        + "; then ".join(describe_attempt(VariantAttempt.from_dict(a)) for a in run["attempts"])
        + " |"
        for name, run in runs.items()
        if run.get("attempts")
    ]
    if not rows:
        return []
    return [
        "",
        "## When each variant ran",
        "",
        "The variants ran one after the other: a machine busier during one of them (a load "
        "average above its cores) slows that one alone, and moves the speedups with it.",
        "",
        "| variant | started, 1-minute load average at start -> end |",
        "| --- | --- |",
        *rows,
    ]


def _mean_std(value: MeanStd, digits: int) -> str:
    return f"{value.mean:.{digits}f} ± {value.std:.{digits}f}"


def seeded_section(stats: SeededStats, metric: str) -> list[str]:
    """The tables over seeds: per variant, each variant against the baseline, per seed."""
    margin = stats.margin_points
    seeds = ", ".join(map(str, stats.seeds))
    lines = [
        "",
        f"## Over {len(stats.seeds)} seed(s): {seeds}",
        "",
        "Mean ± standard deviation over the seeds; training time has evaluation and checkpoint "
        "writes off the clock (time-to-target is its own section). A variant is **not "
        "worse** than the baseline when the 95% interval of its paired difference (t over the "
        f"seeds) lies above -{margin:.2f} points, **worse** when it lies below; its metric is "
        "**distinguishable** from the reference's (lower or higher) when the interval excludes "
        "0.",
        "",
        f"| variant | seeds | training time (s) | final {metric} | best {metric} |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for v in stats.variants:
        lines.append(
            f"| {TITLES.get(v.variant, v.variant)} | {len(v.seeds)} "
            f"| {_mean_std(v.training_time_s, 1)} | {_mean_std(v.final_eval_metric, 4)} "
            f"| {_mean_std(v.best_eval_metric, 4)} |"
        )
    lines += [
        "",
        f"| against {stats.baseline} | seeds | {SPEEDUP_COLUMN} "
        f"| final {metric} difference (points) | 95% interval (points) | verdict "
        "| distinguishable |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    lines += _pair_rows(stats.pairs)
    if stats.peer_pairs:
        lines += [
            "",
            f"The same pairing against {stats.peer} (what a user whose model fits one device "
            "runs): is the freezing variants' accuracy distinguishable from it?",
            "",
            f"| against {stats.peer} | seeds | {SPEEDUP_COLUMN} "
            f"| final {metric} difference (points) | 95% interval (points) | verdict "
            "| distinguishable |",
            "| --- | ---: | ---: | ---: | ---: | --- | --- |",
            *_pair_rows(stats.peer_pairs),
        ]
    if stats.subject_pairs:
        lines += [
            "",
            f"{TITLES.get(stats.subject, stats.subject)} against each variant (speedup: the "
            f"variant's wall time / its own; difference: its final {metric} - the variant's).",
            "",
            f"| {stats.subject} against | seeds | {SPEEDUP_COLUMN} "
            f"| final {metric} difference (points) | 95% interval (points) | verdict "
            "| distinguishable |",
            "| --- | ---: | ---: | ---: | ---: | --- | --- |",
            *_pair_rows(stats.subject_pairs),
        ]
    return lines


# A pair's speedup: the geometric mean of the per-seed ratios with its 95% interval, their
# range, and the ratio of the mean wall times (compare/stats.py, PairStats).
SPEEDUP_COLUMN = "fixed-epoch speedup: geometric mean [95%] (min - max); of mean times"


def _pair_rows(pairs: tuple[PairStats, ...]) -> list[str]:
    rows = []
    for p in pairs:
        interval = p.interval_points
        shown = f"[{interval.low:+.2f}, {interval.high:+.2f}]" if interval else "-"
        difference = p.metric_difference_points
        speed = p.speedup_interval
        speed_shown = f" [{speed.low:.2f}, {speed.high:.2f}]" if speed else ""
        of_means = f"; {p.speedup_of_mean_times:.2f}x" if p.speedup_of_mean_times else ""
        rows.append(
            f"| {p.variant} | {len(p.seeds)} | {p.speedup_mean:.2f}x{speed_shown} "
            f"({p.speedup_min:.2f} - {p.speedup_max:.2f}x){of_means} | "
            f"{difference.mean:+.2f} ± {difference.std:.2f} | {shown} | "
            f"{p.verdict} | {p.distinguishable} |"
        )
    return rows


def _fits(run: dict[str, Any]) -> str:
    peak, budget = run.get("predicted_peak_bytes"), run.get("device_memory_bytes")
    if peak is None:
        return "?"
    if budget is None:
        return f"yes ({peak / 2**20:,.0f} MiB a stage; no limit)"
    verdict = "yes" if peak <= budget else "**no**"
    return f"{verdict} ({peak / 2**20:,.0f} of {budget / 2**20:,.0f} MiB)"


def save_results(results: dict[str, Any], out: Path) -> None:
    write_json_atomic(out / "results.json", results)
