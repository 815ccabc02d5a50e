"""`pipetransformer compare`: the baseline and the elastic system, one after the other, on the
same seed, data and machine; with --ablations also the paper's speedup breakdown (Fig. 9);
with --seeds every variant once per seed (trainer.seed), in `seed-<s>/<variant>/`, in an
order that rotates with the seed (compare/order.py); with --budgets (or --peers) DDP, and
every variant --curves names, at several budgets too, every variant set against DDP's
curve (compare/budgets.py) and every side's time-to-target and frontier against the full
system's (compare/frontiers.py).

A comparison is three steps, each in its own module: the plan of runs, checked before
anything is written (variants.py); each run (execute.py: finished runs kept, a stopped one
resumed from its checkpoint, a peer that does not fit recorded as refused); the outputs
(outputs.py). `--report-only` is the last step alone.

Owns: the order of those steps. Must not: build a variant's overrides, run one, or write
an output itself.
"""

from __future__ import annotations

import json

from pipetransformer.compare import outputs
from pipetransformer.compare.budgets import budget_of, variant_title
from pipetransformer.compare.execute import run_variant
from pipetransformer.compare.report import (
    BASELINE,
    DDP,
    ELASTIC,
    TITLES,
    finished_seed_runs,
    is_finished,
    read_run,
    refusal,
    seed_dir,
)
from pipetransformer.compare.request import CompareRequest
from pipetransformer.compare.stats import DEFAULT_MARGIN_POINTS
from pipetransformer.compare.variants import plan_runs, plan_variants
from pipetransformer.config import Config, ConfigError, load_config


def run_compare(config: Config, request: CompareRequest) -> int:
    """Run every variant (once per seed with `request.seeds`), then write the outputs. A
    variant whose run directory holds a finished run (summary.json) is not run again; one
    an interrupted comparison stopped resumes from its checkpoint. Raises ConfigError before
    anything is written where the request does not fit the config, and CompareStopped on
    SIGINT or SIGTERM while it runs under `stop_signals_raise`."""
    variants = plan_variants(config, request)
    request.out.mkdir(parents=True, exist_ok=True)
    runs = plan_runs(variants, request)
    for index, run in enumerate(runs, start=1):
        seed = "" if run.seed is None else f", seed {run.seed}"
        label = f"[{index}/{len(runs)}] {variant_title(run.name)}{seed}"
        run_config = load_config(request.config_path, [*request.run_overrides, *run.overrides])
        if not run_variant(run_config, run.name, run.run_dir, label):
            return 1
    costs = outputs.measured_unit_costs(config)
    margin = DEFAULT_MARGIN_POINTS if request.margin_points is None else request.margin_points
    context = request.context(config)
    context.update(margin_points=margin, target=request.target)
    out = request.out
    if request.seeds is None:
        finished = {
            name: read_run(out / name)
            for name in variants
            if is_finished(out / name) and budget_of(name) is None
        }
        context["refused"] = {name: r for name in variants if (r := refusal(out / name))}
        return outputs.write_outputs(finished, costs, context, config, out)
    return outputs.write_seeded_outputs(costs, context, config, out, margin, request.seeds)


def rebuild_compare(config: Config, request: CompareRequest) -> int:
    """results.json, report.md and plots again from the variants' run directories in
    `request.out` (after an upgrade of the report, or when a later variant failed): nothing
    is rerun. The unit costs of an earlier results.json are reused, so the ideal speedup is
    comparable. A comparison over seeds (seed-<s>/ directories) is rebuilt from the seeds
    that finished; the margin and the target are the earlier ones unless the request gives
    them; the command and machine recorded are the earlier ones."""
    out = request.out
    seeded = finished_seed_runs(out)
    if seeded:
        found = {name for finished in seeded.values() for name in finished}
        names = [name for name in TITLES if name in found]
        complete = [s for s, finished in seeded.items() if {BASELINE, ELASTIC} <= set(finished)]
        if not complete:
            raise ConfigError(
                f"--report-only: no seed-<s>/ in {out} has finished {BASELINE}/ and {ELASTIC}/ runs"
            )
        elastic_dir = seed_dir(out, complete[0]) / ELASTIC
    else:
        names = [name for name in TITLES if is_finished(out / name)]
        if BASELINE not in names or ELASTIC not in names:
            raise ConfigError(
                f"--report-only: {out} has no finished {BASELINE}/ and {ELASTIC}/ runs "
                "(summary.json)"
            )
        elastic_dir = out / ELASTIC
    # What the elastic run resolved (cache on or off), whatever this invocation's overrides say.
    resolved = elastic_dir / "config.yaml"
    if resolved.is_file():
        config = load_config(str(resolved))
    results = out / "results.json"
    previous = json.loads(results.read_text()) if results.is_file() else {}
    margin_points = request.margin_points
    if margin_points is None:
        margin_points = previous.get("margin_points")
    target = previous.get("target") if request.target is None else request.target
    found_request = CompareRequest(
        request.config_path,
        out,
        request.overrides,
        ablations="freeze_only" in names,
        peers=DDP in names,
        seeds=list(seeded) if seeded else None,
        margin_points=margin_points,
    )
    context = found_request.context(config)
    # The command and machine that produced the runs, not this invocation's.
    context.update({key: previous[key] for key in context if key in previous})
    context.update(margin_points=margin_points, target=target)
    costs = previous.get("unit_costs") or outputs.measured_unit_costs(config)
    if seeded:
        margin = DEFAULT_MARGIN_POINTS if margin_points is None else margin_points
        return outputs.write_seeded_outputs(costs, context, config, out, margin)
    runs = {name: read_run(out / name) for name in names}
    context["refused"] = {name: r for name in TITLES if (r := refusal(out / name))}
    return outputs.write_outputs(runs, costs, context, config, out)
