"""The argument parser of `pipetransformer train | plan | compare | export`: each
subcommand's flags with their help, and the handler (commands.py) it runs.

Owns: `build_parser` and the flag types. Must not: act on the flags (commands.py does).
"""

from __future__ import annotations

import argparse

from pipetransformer.cli.commands import cmd_compare, cmd_export, cmd_plan, cmd_train


def _seed_list(text: str) -> list[int]:
    """--seeds 0,1,2: distinct integers."""
    try:
        seeds = [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': not integers, comma-separated") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"'{text}': give distinct seeds, at least one")
    return seeds


def _budget_list(text: str) -> list[int]:
    """--budgets 1,2,3: distinct epoch counts >= 1; 'none': no budget run."""
    if text.strip().lower() == "none":
        return []
    try:
        budgets = [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': not integers, comma-separated") from None
    if not budgets or min(budgets) < 1 or len(set(budgets)) != len(budgets):
        raise argparse.ArgumentTypeError(f"'{text}': give distinct epoch counts >= 1, or none")
    return sorted(budgets)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipetransformer",
        description="Elastic freeze training of Transformers (PipeTransformer) on PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="YAML config file (see configs/)")
        p.add_argument(
            "overrides", nargs="*", help="overrides such as trainer.epochs=3 freeze.alpha=0.5"
        )

    train = sub.add_parser(
        "train", help="train a model (starts local workers unless under torchrun)"
    )
    common(train)
    train.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local worker processes (default: trainer.nproc_per_node)",
    )
    train.add_argument(
        "--run-dir", default=None, help="output directory (default: runs/<config>-<time>)"
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue the run in RUN_DIR from its latest checkpoint (at any number of processes)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run directory that holds a run (deletes its outputs)",
    )
    train.set_defaults(func=cmd_train)

    plan = sub.add_parser(
        "plan", help="print the layout AutoPipe would choose at each frozen boundary"
    )
    common(plan)
    plan.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    predict = plan.add_argument_group(
        "prediction (--predict): step times and the run's speedup over Pipe+DDP"
    )
    predict.add_argument(
        "--predict", action="store_true", help="predict step times and the speedup on a cluster"
    )
    predict.add_argument("--nodes", type=int, default=1, help="nodes of the cluster (default 1)")
    predict.add_argument(
        "--devices-per-node", type=int, default=None, help="default: trainer.nproc_per_node"
    )
    predict.add_argument(
        "--profile",
        default=None,
        help="profile file with this model's unit profile (default: the runs')",
    )
    predict.add_argument(
        "--trajectory",
        default="auto",
        help="'auto' (the config's freeze rule and cadence, replayed as the trainer decides; "
        "gradient rules at their bound), 'paper' (Eq. 1's bound at every epoch end) or F per "
        "epoch: 0,0,2,4",
    )
    predict.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="training samples an epoch; default: the training data on disk, else the "
        "dataset's published size",
    )
    predict.add_argument(
        "--device",
        metavar="NAME",
        default=None,
        help="a device of planning/hardware.yaml (e.g. quadro-rtx-5000): without a profile "
        "measured on one, unit times from the model's analytical profile and a roofline; "
        "its memory is the stage budget",
    )
    predict.add_argument(
        "--intra-node",
        metavar="LINK",
        default=None,
        help="the link between devices of a node, from hardware.yaml (e.g. pcie3-x16)",
    )
    predict.add_argument(
        "--inter-node",
        metavar="LINK",
        default=None,
        help="the link between nodes, from hardware.yaml (e.g. infiniband-edr)",
    )
    predict.add_argument(
        "--intra-node-gbps",
        type=float,
        default=None,
        help="GB/s between devices of a node, instead of --intra-node (default 150)",
    )
    predict.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        help="GB/s between nodes, instead of --inter-node (default 25)",
    )
    predict.add_argument(
        "--memory-gbps",
        type=float,
        default=None,
        help="a device's memory bandwidth, GB/s, without --device (default 2000)",
    )
    plan.set_defaults(func=cmd_plan)

    compare = sub.add_parser(
        "compare", help="baseline (Pipe+DDP) vs elastic run: speedup, accuracy, plots"
    )
    common(compare)
    # The names below are those --variants accepts (compare/variants.py variant_overrides;
    # tests/test_cli.py holds them equal).
    compare.add_argument(
        "--ablations",
        action="store_true",
        help="also run freeze_only (no AutoPipe, no AutoCache), no_autodp (no AutoDP, no "
        "AutoCache) and no_cache (no AutoCache)",
    )
    compare.add_argument(
        "--peers",
        action="store_true",
        help="also run what users run instead: ddp (K=1, no freezing); hf_trainer "
        "(transformers' Trainer, for text models) or torch_ddp (a plain timm + DDP loop, for "
        "image models) on DDP's batch; freeze_ddp (K=1, freezing and AutoCache); fsdp (FSDP2 "
        "over every process, no freezing); freeze_fsdp (FSDP2, freezing and AutoCache); for "
        "pretrained weights also ddp_frozen_embedding (K=1, the embedding frozen, no layer)",
    )
    compare.add_argument(
        "--variants",
        type=lambda text: [w.strip() for w in text.split(",") if w.strip()],
        default=None,
        metavar="NAME,...",
        help="run only these of the variants --peers and --ablations name (baseline and "
        "elastic always run), e.g. --peers --variants fsdp,freeze_fsdp where DDP's replica "
        "does not fit a device",
    )
    seeding = compare.add_mutually_exclusive_group()
    seeding.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        metavar="S,S,...",
        help="run every variant once per seed (trainer.seed), in OUT/seed-<s>/<variant>/; "
        "the report adds mean ± std and paired statistics over the seeds",
    )
    seeding.add_argument(
        "--repeats", type=_positive_int, default=None, metavar="N", help="as --seeds 0,...,N-1"
    )
    compare.add_argument(
        "--margin",
        type=float,
        default=None,
        metavar="POINTS",
        help="margin in metric points (default 0.5): a variant is 'not worse' when the 95%% "
        "interval of its difference to the baseline lies above -POINTS, and time-to-target's "
        "target is the reference's median final metric less POINTS",
    )
    compare.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="METRIC",
        help="time-to-target's target, in the metric's units as runs record it (accuracy "
        "0.83); default: DDP's median final metric over the seeds at the config's epochs (the "
        "baseline's where DDP did not run) less --margin",
    )
    compare.add_argument(
        "--budgets",
        type=_budget_list,
        default=None,
        metavar="E,E,...|none",
        help="also run DDP (and the --curves variants) for these epochs, each with its "
        "schedule fitted to its budget, and report every variant's time-to-accuracy and "
        "accuracy at equal time against DDP's curve (default with --peers or --curves: a "
        "ladder below the config's epochs; 'none': no budget)",
    )
    compare.add_argument(
        "--curves",
        type=lambda text: [w.strip() for w in text.split(",") if w.strip()],
        default=None,
        metavar="NAME,...",
        help="the variants that run at every --budgets epoch count (default: ddp), each with "
        "its schedule and a freezing variant's decision cadence fitted to the budget, e.g. "
        "--curves ddp,elastic: time-to-target and frontier against frontier read them",
    )
    compare.add_argument(
        "--out", default=None, help="output directory (default: runs/compare/<config>-<time>)"
    )
    compare.add_argument(
        "--report-only",
        action="store_true",
        help="rerun nothing: rebuild results.json, report.md and plots "
        "from the runs already in --out",
    )
    compare.set_defaults(func=cmd_compare)

    export = sub.add_parser(
        "export",
        help="write a run's trained model as transformers / timm load it (from a checkpoint)",
    )
    export.add_argument("run_dir", help="the run directory (holds checkpoints/)")
    export.add_argument(
        "--checkpoint", choices=["latest", "best"], default="latest", help="which checkpoint"
    )
    export.add_argument("--out", required=True, help="output directory")
    export.set_defaults(func=cmd_export)
    return parser
