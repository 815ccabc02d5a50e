"""The table of `plan --predict` for the paper's four workloads on two clusters, as docs/results.md
and docs/profiling.md print it ("The paper's workloads, predicted"): one markdown row per
workload and cluster, from the configs as shipped, no profile file (unit times from the
analytical profile and a roofline on the named device). With `--schedules`, the table of
docs/profiling.md's "The paper's workloads under each schedule": the same workloads on the
paper's cluster and on one node of 8 H100s under each `pipeline.schedule`.

    python benchmarks/paper_predictions.py              # print the rows
    python benchmarks/paper_predictions.py --schedules  # the rows per schedule
    python benchmarks/paper_predictions.py --check      # exit 1 naming each row the docs lack

tests/test_paper_predictions.py runs the check, so a change to the planner or the step
model that moves a number fails until the tables are regenerated from this script.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "results.md", ROOT / "docs" / "profiling.md")

WORKLOADS = {  # name in the table -> config
    "ViT-B/16 ImageNet": "vit_imagenet.yaml",
    "ViT-B/16 CIFAR-100": "vit_cifar100.yaml",
    "BERT-large SQuAD (512 tokens)": "bert_squad.yaml",
    "BERT-base SST-2": "bert_sst2.yaml",
}
CLUSTERS = {  # name in the table -> (--device, --intra-node, --inter-node), 2 nodes of 8
    "Quadro RTX 5000, PCIe 3.0, IB 5 GB/s": ("quadro-rtx-5000", "pcie3-x16", "infiniband-cx353a"),
    "H100 SXM (TF32), NVLink 4, IB NDR": ("h100-sxm", "nvlink4", "infiniband-ndr"),
}
# The per-schedule table's clusters: name -> (nodes, --device, --intra-node, --inter-node).
SCHEDULE_CLUSTERS = {
    "2 x 8 Quadro RTX 5000": (2, "quadro-rtx-5000", "pcie3-x16", "infiniband-cx353a"),
    "1 x 8 H100 SXM": (1, "h100-sxm", "nvlink4", "infiniband-ndr"),
}
SCHEDULE_HEADER = (
    "| workload | cluster | schedule | start: K, v, M | idle share at the start | Pipe+DDP | "
    "PipeTransformer | vs the shipped schedule's Pipe+DDP: Pipe+DDP / PipeTransformer |"
)
HEADER = (
    "| workload, cluster (2 x 8) | Pipe+DDP | DDP | freeze + DDP | PipeTransformer | "
    "speedup vs Pipe+DDP / DDP / freeze + DDP | frozen layers per epoch; layouts (F: K x R) |"
)


def duration(seconds: float) -> str:
    """Seconds under a minute, minutes to one decimal under 10, whole minutes under 100,
    else hours to one decimal."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 600:
        return f"{seconds / 60:.1f} min"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _peer_cell(peer) -> str:
    if peer.problem:
        return "cannot run"
    if not peer.fits or peer.run_s is None:
        return "does not fit"
    return duration(peer.run_s)


def _trajectory(result) -> str:
    """Frozen layers per epoch (a run of equal values as 'F x n'), then the layout each time
    it changes, at the boundary it starts at."""
    runs: list[list[int]] = []
    for frozen in result.trajectory:
        if runs and runs[-1][0] == frozen:
            runs[-1][1] += 1
        else:
            runs.append([frozen, 1])
    frozen = ", ".join(f"{f} x {n}" if n > 1 else str(f) for f, n in runs)
    layouts, previous = [], None
    for epoch in result.epochs:
        shape = f"{epoch.pipe_len}x{epoch.dp_degree}{'s' if epoch.sharded else ''}"
        if shape != previous:
            layouts.append(f"{epoch.num_frozen_layers}: {shape}")
            previous = shape
    return f"{frozen}; {', '.join(layouts)}"


def predicted(
    config_name: str,
    cluster: tuple[str, str, str],
    no_profile: Path,
    nodes: int = 2,
    schedule: str | None = None,
):
    """`plan CONFIG --predict --nodes NODES --devices-per-node 8 --device ... ` as a
    Prediction (under `schedule`: pipeline.schedule=SCHEDULE)."""
    from pipetransformer.config import load_config
    from pipetransformer.planning.predict import predict
    from pipetransformer.planning.prediction_inputs import (
        cluster_from_flags,
        prediction_unit_times,
        train_samples_for,
    )

    device, intra, inter = cluster
    overrides = [f"pipeline.profile_path={no_profile}"]  # none: the roofline, whatever runs/ holds
    if schedule is not None:
        overrides.append(f"pipeline.schedule={schedule}")
    config = load_config(ROOT / "configs" / config_name, overrides)
    flags = cluster_from_flags(nodes, 8, device_name=device, intra_node=intra, inter_node=inter)
    chosen = prediction_unit_times(config, flags)
    samples, _ = train_samples_for(config)
    return predict(config, chosen.profile, flags, samples, "auto", chosen.times)


def rows() -> list[str]:
    """The table's rows, in the docs' order: every workload on the first cluster, then on
    the second."""
    lines = []
    with tempfile.TemporaryDirectory() as scratch:
        no_profile = Path(scratch) / "none.json"
        for cluster_name, cluster in CLUSTERS.items():
            for workload, config_name in WORKLOADS.items():
                result = predicted(config_name, cluster, no_profile)
                peers = {p.name: p for p in result.peers}
                ddp, freeze_ddp = peers["ddp"], peers["freeze_ddp"]
                speedups = [result.speedup, *map(result.speedup_over, (ddp, freeze_ddp))]
                cells = [
                    f"{workload}, {cluster_name}",
                    duration(result.baseline_s),
                    _peer_cell(ddp),
                    _peer_cell(freeze_ddp),
                    duration(result.elastic_s),
                    " / ".join("-" if s is None else f"{s:.2f}x" for s in speedups),
                    _trajectory(result),
                ]
                lines.append(f"| {' | '.join(cells)} |")
    return lines


def schedule_rows() -> list[str]:
    """Each workload on each of SCHEDULE_CLUSTERS under each schedule: the starting layout,
    its idle share (1 - 1 / the step model's bubble factor), Pipe+DDP and PipeTransformer
    under that schedule, and both against Pipe+DDP under the config's own schedule (GPipe,
    1F1B for SQuAD: what the shipped configs run). A schedule whose activations in flight do
    not fit the device at the start is said so."""
    from pipetransformer.config import SCHEDULES, ConfigError, load_config

    lines = []
    with tempfile.TemporaryDirectory() as scratch:
        no_profile = Path(scratch) / "none.json"
        for cluster_name, (nodes, *cluster) in SCHEDULE_CLUSTERS.items():
            for workload, config_name in WORKLOADS.items():
                shipped = load_config(ROOT / "configs" / config_name).pipeline.schedule
                results = {}
                for schedule in SCHEDULES:
                    try:
                        results[schedule] = predicted(
                            config_name, tuple(cluster), no_profile, nodes, schedule
                        )
                    except ConfigError:  # no start fits the device
                        results[schedule] = None
                reference = results[shipped].baseline_s
                for schedule, result in results.items():
                    cells = [workload, cluster_name, schedule]
                    if result is None:
                        cells += ["does not fit", "-", "-", "-", "-"]
                    else:
                        start = result.rows[0]
                        ratios = (reference / result.baseline_s, reference / result.elastic_s)
                        cells += [
                            f"{start.pipe_len}, {start.virtual_stages}, {start.num_micro_batches}",
                            f"{1 - 1 / start.bubble:.2f}",
                            duration(result.baseline_s),
                            duration(result.elastic_s),
                            " / ".join(f"{v:.2f}x" for v in ratios),
                        ]
                    lines.append(f"| {' | '.join(cells)} |")
    return lines


def missing_rows(
    generated: list[str], docs: tuple[Path, ...] = DOCS, header: str = HEADER
) -> list[str]:
    """'FILE: ROW' for each generated row (and the header) a document lacks."""
    missing = []
    for path in docs:
        text = path.read_text().splitlines()
        for row in [header, *generated]:
            if row not in text:
                missing.append(f"{path.relative_to(ROOT)}: {row}")
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the docs' tables")
    parser.add_argument("--schedules", action="store_true", help="the table per schedule")
    args = parser.parse_args()
    if args.schedules and not args.check:
        alignment = "| --- | --- | --- | --- | ---: | ---: | ---: | --- |"
        print("\n".join([SCHEDULE_HEADER, alignment, *schedule_rows()]))
        return 0
    generated = rows()
    if not args.check:
        print("\n".join([HEADER, "| --- | ---: | ---: | ---: | ---: | --- | --- |", *generated]))
        return 0
    missing = missing_rows(generated)
    if args.schedules:
        profiling = (ROOT / "docs" / "profiling.md",)
        missing += missing_rows(schedule_rows(), profiling, SCHEDULE_HEADER)
    for line in missing:
        print(f"not in the docs (regenerate: python benchmarks/paper_predictions.py): {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
