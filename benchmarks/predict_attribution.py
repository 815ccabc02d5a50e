"""Which of three changes moves a `plan --predict` figure, each undone in turn (issue 31): the
compression test (parameter sizes, Eq. 2, against the balanced stage seconds it compared
before), stage 0's balance (for the prefix work a boundary's steps do, against cache reads
whatever the epoch does) and the model of a boundary's first epochs (AutoCache upgrading
the previous boundary's entries, against computing the whole prefix). Prints one line per
combination: the full system, Pipe+DDP and each epoch's frozen layers, layout, minutes and
prefix work. A prediction, not a measurement: no profile, roofline times on the named
device (docs/profiling.md, "The paper's workloads, predicted").

    python benchmarks/predict_attribution.py configs/bert_squad.yaml [key=value ...]

Undoing a change patches this process's copy of the planner and of the prediction only.
"""

from __future__ import annotations

import argparse
import itertools

from pipetransformer.config import load_config
from pipetransformer.planning import context as context_module
from pipetransformer.planning import predict as predict_module
from pipetransformer.planning.prediction_inputs import (
    cluster_from_flags,
    prediction_unit_times,
    train_samples_for,
)
from pipetransformer.planning.prediction_run import Variant

CLUSTERS = {
    "paper (2 x 8 Quadro RTX 5000, PCIe 3.0 x16, 5 GB/s IB)": dict(
        device_name="quadro-rtx-5000", intra_node="pcie3-x16", inter_node="infiniband-cx353a"
    ),
    "2 x 8 H100 SXM, NVLink 4, IB NDR": dict(
        device_name="h100-sxm", intra_node="nvlink4", inter_node="infiniband-ndr"
    ),
}
SIZES, LAYOUT_FOR, PREFIX_S = context_module.parameter_sizes, Variant.layout_for, Variant.prefix_s


def _balanced_for_reads(self, frozen, current, prefix_s):
    read = PREFIX_S(self, frozen, {frozen: 1.0}, self.serves(frozen))
    return self.context.layout_for(frozen, current.pipe_len, prefix_cost=self.balance_cost(read))


def _first_epochs_compute(self, frozen, cached, serves):
    every_entry_at_frozen = cached.get(frozen, 0.0) > 1 - 1e-9
    return PREFIX_S(self, frozen, {frozen: 1.0} if every_entry_at_frozen else {}, serves)


def undo(compression: bool, balance: bool, model: bool) -> None:
    """Put back what each change replaced (False: keep today's)."""
    context_module.parameter_sizes = (lambda config, spec: None) if compression else SIZES
    Variant.layout_for = _balanced_for_reads if balance else LAYOUT_FOR
    Variant.prefix_s = _first_epochs_compute if model else PREFIX_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config(args.config, ["pipeline.profile_path=/nonexistent.json", *args.overrides])
    samples, _ = train_samples_for(config)
    for name, flags in CLUSTERS.items():
        print(f"## {name}")
        cluster = cluster_from_flags(2, 8, **flags)
        chosen = prediction_unit_times(config, cluster)
        for undone in itertools.product((True, False), repeat=3):
            undo(*undone)
            result = predict_module.predict(
                config, chosen.profile, cluster, samples, "auto", chosen.times
            )
            labels = [
                "compression on seconds" if undone[0] else "compression on sizes",
                "stage 0 for reads" if undone[1] else "stage 0 for its work",
                "first epochs computed" if undone[2] else "upgrades",
            ]
            epochs = "; ".join(
                f"F {e.num_frozen_layers}: {e.pipe_len}x{e.dp_degree}, "
                f"{e.seconds / 60:.1f} min, {e.prefix}"
                for e in result.epochs
            )
            print(
                f"{', '.join(labels)}: {result.elastic_s / 60:.1f} min against Pipe+DDP's "
                f"{result.baseline_s / 60:.1f} min, {result.speedup:.2f}x | {epochs}"
            )
        undo(False, False, False)


if __name__ == "__main__":
    main()
