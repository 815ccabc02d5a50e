"""The grounds of benchmarks/time_to_target.py: each setting's workload, its sides (peers,
the full system's candidates, the fixed schedules of the headroom sweep) and what each side
overrides. No runs here: time_to_target.py runs them.

Usable as `import ttt_grounds` from a script in benchmarks/ (harness.py puts the repository
on the path).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from harness import ROOT, minilm_sst2

from pipetransformer.compare.report import BASELINE, DDP, DDP_FROZEN_EMBEDDING, FSDP, TITLES
from pipetransformer.compare.variants import frozen_embedding_overrides, variant_overrides
from pipetransformer.config import load_config

MIB = 2**20
SYSTEM = "elastic"  # a candidate's side: elastic_<candidate>
SWEEP = "fixed"  # a sweep schedule's side: fixed_<schedule>

# The frozen-embedding peers of the pipeline ground (compare's peers, embedding frozen).
BASELINE_FE = "baseline_frozen_embedding"
FSDP_FE = "fsdp_frozen_embedding"
FSDP_ZERO2_FE = "fsdp_zero2_frozen_embedding"
DDP_CHECKPOINTED_FE = "ddp_checkpointed_frozen_embedding"
LOCAL_TITLES = {
    BASELINE_FE: "Pipe+DDP, embedding frozen",
    FSDP_FE: "FSDP2 (full shard), embedding frozen",
    FSDP_ZERO2_FE: "FSDP2 (shard-grad-op), embedding frozen",
    DDP_FROZEN_EMBEDDING: "DDP, embedding frozen",
    DDP_CHECKPOINTED_FE: "DDP + activation checkpointing, embedding frozen",
}

# By memory: AutoPipe packs a pipeline where the device holds the packed stages
# (autopipe/planner.py); the parameter-size proxy holds MiniLM's 2-stage pipeline until 5
# of its 6 layers are frozen.
BY_MEMORY = "autopipe.compression=memory"
# The fewest converged layers that pack the pipeline (freeze.py), packed by memory.
MEMORY_AWARE = ["freeze.memory_aware=true", "freeze.eq1_bound=false", BY_MEMORY]
# name -> (what it is, overrides on top of the setting's)
CANDIDATES: dict[str, tuple[str, list[str]]] = {
    # The config's own rule; on the MiniLM Eq. 1 as harness.minilm_sst2 pins it (EQ1_RULE,
    # the pretrained default until issue 59).
    "default": (
        "the config's own rule (the MiniLM's: Eq. 1, alpha 1/3, at epoch ends, embedding "
        "frozen, as pinned since the late memory-aware rule became its default)",
        [],
    ),
    "anneal": (
        "the default with layer-wise annealing on the run's schedule (section 22's variant)",
        ["optimizer.layerwise_anneal=true"],
    ),
    "embedding_only": (
        "the frozen embedding alone, no layer",
        [
            "freeze.strategy=manual",
            "freeze.manual_schedule=[0]",
            "freeze.interval_steps=null",
            "freeze.embedding=true",
        ],
    ),
    "memory": ("the default with AutoPipe's compression by memory", [BY_MEMORY]),
    "memory_aware": (
        "freeze.memory_aware: the fewest layers that pack the pipeline, Eq. 1's signal "
        "without its bound, compression by memory",
        MEMORY_AWARE,
    ),
    "memory_aware_early": (
        "freeze.memory_aware with its first decision a fifth into the run "
        "(freeze.warmup_epochs=6: the quickstart's 30 epochs, whose config waits 18)",
        [*MEMORY_AWARE, "freeze.warmup_epochs=6"],
    ),
    "memory_aware_late": (
        "freeze.memory_aware with one decision, at the second epoch's end "
        "(freeze.warmup_epochs=2, as the callbacks decide by default: section 24c)",
        [*MEMORY_AWARE, "freeze.warmup_epochs=2"],
    ),
    "memory_aware_autofreeze": (
        "freeze.memory_aware on AutoFreeze's signal (it can say 'not yet'), compression by memory",
        ["freeze.strategy=autofreeze", "freeze.memory_aware=true", BY_MEMORY],
    ),
    "alpha_sixth": (
        "Eq. 1 at alpha 1/6 (half the default's pace), compression by memory",
        ["freeze.alpha=0.16666666666666666", BY_MEMORY],
    ),
    "freezeout": (
        "the default with FreezeOut's annealing as published (cosine from lr / t_i), "
        "compression by memory",
        ["optimizer.layerwise_anneal=freezeout", BY_MEMORY],
    ),
}


def fixed(schedule: str, cadence: str = "null") -> list[str]:
    """A fixed freeze schedule (manual), compression by memory."""
    return [
        "freeze.strategy=manual",
        f"freeze.manual_schedule={schedule}",
        f"freeze.interval_steps={cadence}",
        BY_MEMORY,
    ]


# The headroom sweep: fixed schedules (which boundary, how many layers; the embedding is
# frozen on every side of the pipeline ground), each a budget curve on the choosing seeds.
SCHEDULES: dict[str, tuple[str, list[str]]] = {
    "2_after_epoch_1": ("2 layers at the first epoch's end", fixed("[2]")),
    "3_after_epoch_1": ("3 layers at the first epoch's end", fixed("[3]")),
    "4_after_epoch_1": ("4 layers at the first epoch's end", fixed("[4]")),
    "3_after_epoch_2": ("3 layers at the second epoch's end", fixed("[0,3]")),
    "3_after_a_third": ("3 layers after a third of the first epoch", fixed("[3]", "auto")),
}


@dataclass(frozen=True)
class Setting:
    config: Path
    peers: tuple[str, ...]
    epochs: int
    budgets: tuple[int, ...]
    candidates: tuple[str, ...]
    # The side the target is set from (its median final at the full budget).
    reference: str = DDP
    # Peers run on the choosing seeds too (the reference always is).
    sweep: tuple[str, ...] = ()
    # Sides predicted not to fit the cap: tried once, their refusal recorded.
    refused: tuple[str, ...] = ()


SETTINGS = {
    "fits": Setting(
        ROOT / "configs" / "bert_sst2_local.yaml",
        (DDP, DDP_FROZEN_EMBEDDING),
        3,
        (1, 2, 3),
        ("default", "anneal", "embedding_only"),
    ),
    # Section 22's ground: the embedding trained by the peers, frozen by the full system.
    "pipeline": Setting(
        ROOT / "configs" / "bert_sst2_local.yaml",
        (BASELINE, FSDP, DDP_FROZEN_EMBEDDING),
        3,
        (1, 2, 3),
        ("default", "anneal"),
        reference=BASELINE,
    ),
    # Issue 59's ground: the embedding frozen on every side, a cap where only a pipeline
    # (or a shard) holds a replica's training state.
    "frozen_pipeline": Setting(
        ROOT / "configs" / "bert_sst2_local.yaml",
        (BASELINE_FE, FSDP_FE, FSDP_ZERO2_FE),
        3,
        (1, 2, 3),
        (
            "default",
            "memory",
            "memory_aware",
            "memory_aware_late",
            "memory_aware_autofreeze",
            "alpha_sixth",
            "freezeout",
            "embedding_only",
        ),
        reference=BASELINE_FE,
        sweep=tuple(SCHEDULES),
        refused=(DDP_FROZEN_EMBEDDING, DDP_CHECKPOINTED_FE),
    ),
    "quickstart": Setting(
        ROOT / "configs" / "quickstart.yaml",
        (BASELINE, FSDP),
        30,
        (15, 30),
        ("default", "memory_aware"),
        reference=BASELINE,
    ),
}


def with_sweep(setting: Setting, names: str | None) -> Setting:
    """The setting with only the named fixed schedules in its sweep (comma-separated; None:
    all of them). An unknown name is an error that lists the known ones."""
    if names is None:
        return setting
    chosen = tuple(name for name in names.split(",") if name)
    unknown = sorted(set(chosen) - set(setting.sweep))
    if unknown:
        known = ", ".join(setting.sweep) or "none on this setting"
        raise SystemExit(f"--sweep: {', '.join(unknown)} unknown; known: {known}")
    return replace(setting, sweep=chosen)


def workload(args: argparse.Namespace) -> list[str]:
    """The overrides every run of the setting shares."""
    sst2 = f"data.root={ROOT.parent / 'shared' / 'data' / 'sst2'}"
    shared = [
        "trainer.evals_per_epoch=4",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=false",
        "cache.enabled=true",
    ]
    if args.setting == "quickstart":
        # A smoke run decides from the first epoch (the config waits 18 of 30).
        cut = ["data.train_subset=256", "data.eval_subset=64", "freeze.warmup_epochs=0"]
        cut = cut if args.tiny else []
        return [
            *shared,
            *cut,
            f"trainer.epochs={args.epochs}",
            # At the config's batch of 64 no cap forces a pipeline: activations dominate,
            # and a 2-stage pipeline's largest stage (18.8 MiB) is above one stage's (17.3
            # MiB). At 16 a replica is 7.4 MiB, a 2-stage pipeline's stage 5.6 MiB.
            "trainer.global_batch_size=16",
            "pipeline.initial_pipe_len=auto",
            "pipeline.num_micro_batches=auto",
            f"pipeline.device_memory_bytes={args.quickstart_cap}",
            # 'auto' takes a sharded layout there instead: the pipeline is the ground here.
            "pipeline.sharding=never",
            *args.override,
        ]
    if args.tiny:  # the config's tiny random BERT: a smoke run of this script
        text = [
            sst2,
            "data.train_subset=128",
            "data.eval_subset=64",
            "data.max_seq_length=16",
            "trainer.global_batch_size=16",
            f"trainer.epochs={args.epochs}",
            "freeze.embedding=false",  # random weights: its embedding must train
        ]
    else:
        text = minilm_sst2("time_to_target.py", args.train, args.epochs)
    shared += ["freeze.warmup_epochs=0"]
    if args.setting == "fits":
        # The model fits one process: the full system starts as DDP, where one micro-batch
        # is the fastest (no bubble to fill).
        return [
            *text,
            *shared,
            "pipeline.initial_pipe_len=auto",
            "pipeline.num_micro_batches=1",
            *args.override,
        ]
    if args.setting == "frozen_pipeline":
        # A smoke run freezes the tiny random BERT's embedding too, and starts as 2 stages
        # without a cap (its refusals are not tried).
        cap = ["freeze.embedding=true", "pipeline.initial_pipe_len=2"] if args.tiny else [
            "pipeline.initial_pipe_len=auto",
            f"pipeline.device_memory_bytes={args.pipeline_cap}",
        ]  # fmt: skip
        return [
            *text,
            *shared,
            *cap,
            "pipeline.num_micro_batches=auto",
            # The cut on parameter counts: a cut on measured times moves with the machine's
            # load, and with it each stage's predicted bytes against the cap.
            "pipeline.balance=params",
            f"pipeline.schedule={args.schedule}",
            "pipeline.sharding=never",  # the pipeline is the ground (the FSDP2 peers shard)
            *([] if args.tiny else ["data.eval_subset=436"]),
            *args.override,
        ]
    cap = ["pipeline.initial_pipe_len=2"] if args.tiny else [
        "pipeline.initial_pipe_len=auto",
        f"pipeline.device_memory_bytes={560 * MIB}",
    ]  # fmt: skip
    return [
        *text,
        *shared,
        *cap,
        "pipeline.num_micro_batches=auto",
        "pipeline.balance=time",
        "pipeline.sharding=never",  # the pipeline is the ground here (the FSDP2 peers shard)
        *([] if args.tiny else ["data.eval_subset=436"]),
        *args.override,
    ]


def peer_overrides(setting: Setting, common: list[str]) -> dict[str, list[str]]:
    """Every peer of the setting (its refused ones too), as `compare --peers` runs it after
    the setting's own overrides; the frozen-embedding ones with the embedding frozen from
    the first step and no layer after it (compare/variants.py)."""
    config = load_config(str(setting.config), common)
    peers = variant_overrides(config, ablations=False, peers=True)
    peers.setdefault(DDP_FROZEN_EMBEDDING, frozen_embedding_overrides(peers[DDP]))
    peers[BASELINE_FE] = frozen_embedding_overrides(peers[BASELINE])
    peers[FSDP_FE] = frozen_embedding_overrides(peers[FSDP])
    peers[FSDP_ZERO2_FE] = [*peers[FSDP_FE], "pipeline.fsdp_reshard_after_forward=false"]
    peers[DDP_CHECKPOINTED_FE] = [
        *peers[DDP_FROZEN_EMBEDDING],
        "trainer.activation_checkpointing=true",
    ]
    return {name: peers[name] for name in (*setting.peers, *setting.refused)}


def side_overrides(
    setting: Setting, candidates: list[str], common: list[str], sweep: bool = False
) -> dict[str, list[str]]:
    """Each side's own overrides: the peers (refused ones apart), each candidate's on the
    full system, and with `sweep` the fixed schedules."""
    peers = peer_overrides(setting, common)
    found = {name: peers[name] for name in setting.peers}
    for candidate in candidates:
        found[f"{SYSTEM}_{candidate}"] = CANDIDATES[candidate][1]
    if sweep:
        for schedule in setting.sweep:
            found[f"{SWEEP}_{schedule}"] = SCHEDULES[schedule][1]
    return found


def title(side: str) -> str:
    if side.startswith(f"{SYSTEM}_"):
        return f"PipeTransformer, {side.removeprefix(f'{SYSTEM}_')}"
    if side.startswith(f"{SWEEP}_"):
        return f"fixed: {SCHEDULES[side.removeprefix(f'{SWEEP}_')][0]}"
    return LOCAL_TITLES.get(side) or TITLES.get(side, side)
