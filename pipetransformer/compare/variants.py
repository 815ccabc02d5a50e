"""The variants of a comparison and the runs they make: each variant's overrides, which of
them a request runs (--peers, --ablations, --variants, --curves, --budgets) and in what
order, seed by seed.

Everything a request asks for is checked here, before anything is written: a variant or a
curve that this config has not is refused in one line that says why, and --out is not
created for a refused command.

Owns: the variants' overrides and the plan of runs. Must not: run anything (execute.py)
or write anything but each seed's order (compare/order.py), once the request is checked.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.compare.budgets import budget_variants, default_ladder
from pipetransformer.compare.order import record_order, rotated_order
from pipetransformer.compare.peers import peer_for
from pipetransformer.compare.report import (
    BASELINE,
    DDP,
    DDP_FROZEN_EMBEDDING,
    ELASTIC,
    FREEZE_DDP,
    FREEZE_FSDP,
    FSDP,
    HF_TRAINER,
    TORCH_DDP,
    seed_dir,
)
from pipetransformer.compare.request import CompareRequest
from pipetransformer.config import Config, ConfigError

PEERS = (DDP, DDP_FROZEN_EMBEDDING, HF_TRAINER, TORCH_DDP, FREEZE_DDP, FSDP, FREEZE_FSDP)
ABLATIONS = ("freeze_only", "no_autodp", "no_cache")


def variant_overrides(config: Config, ablations: bool, peers: bool = False) -> dict[str, list[str]]:
    """Overrides per variant, in the order they run. The baseline is the same config with
    freezing (and so every elastic component) off, as a fixed pipeline: the configured
    length, or with 'auto' the whole node (the paper's Pipe+DDP). Peers are what a user
    would run instead: when the model fits one device, plain DDP, and DDP with the same
    freeze algorithm and AutoCache but no pipeline; when it does not, FSDP2 over every
    process (fully_shard per layer and at the root), without freezing and with the same
    freeze algorithm (its frozen prefix gathered once at the transition that froze it, then
    served from AutoCache where that is faster than recomputing it, as the full system
    serves it; with cache.enabled=false recomputed). Under trainer.batch_per_replica the
    peers train the baseline's global batch (its replicas never change), as `plan
    --predict`'s peers do."""
    pipe_len = config.pipeline.initial_pipe_len
    fixed = pipe_len if isinstance(pipe_len, int) else config.nproc_per_node
    per_replica = config.trainer.batch_per_replica
    peer_batch = []
    if per_replica is not None:
        baseline_global = per_replica * (config.nproc_per_node // fixed)
        peer_batch = [
            "trainer.batch_per_replica=null",
            f"trainer.global_batch_size={baseline_global}",
        ]
    no_freezing = ["freeze.strategy=none", "cache.enabled=false"]
    variants = {
        BASELINE: [*no_freezing, f"pipeline.initial_pipe_len={fixed}", "pipeline.sharding=never"]
    }
    if peers:
        one_stage = ["pipeline.initial_pipe_len=1", "pipeline.sharding=never", *peer_batch]
        variants[DDP] = [*no_freezing, *one_stage]
        if config.starts_from_trained_weights:
            variants[DDP_FROZEN_EMBEDDING] = frozen_embedding_overrides(variants[DDP])
        # What a user of this model family runs today (compare/peers.py), on the DDP run's
        # batch: transformers' Trainer for text models, a plain timm + DDP loop for images.
        variants[peer_for(config)] = variants[DDP]
        variants[FREEZE_DDP] = one_stage
        # The fewest micro-batches that fit (gradient accumulation, how FSDP2 users fit a
        # batch), not the pipeline's M.
        sharded = [
            "pipeline.initial_pipe_len=1",
            "pipeline.sharding=always",
            "pipeline.num_micro_batches=auto",
            *peer_batch,
        ]
        variants[FSDP] = [*no_freezing, *sharded]
        variants[FREEZE_FSDP] = sharded
    if ablations:
        never = "pipeline.sharding=never"  # a sharded layout is AutoPipe's and AutoDP's
        variants["freeze_only"] = ["autopipe.enabled=false", "cache.enabled=false", never]
        variants["no_autodp"] = ["autodp.enabled=false", "cache.enabled=false", never]
        if config.cache.enabled:
            variants["no_cache"] = ["cache.enabled=false"]
    variants[ELASTIC] = []
    return variants


def frozen_embedding_overrides(ddp: list[str]) -> list[str]:
    """What a DDP user can freeze without this system (`ddp`: DDP's overrides): the
    pretrained embedding, from the first step, and no layer after it (one decision that
    keeps 0 layers; no cache: DDP has none), so that freezing layers shows its own share."""
    return [
        "freeze.strategy=manual",
        "freeze.manual_schedule=[0]",
        "freeze.interval_steps=null",
        "freeze.embedding=true",
        *(o for o in ddp if not o.startswith("freeze.strategy=")),
    ]


def why_not_a_variant(name: str, config: Config, request: CompareRequest, variants) -> str:
    """Why `name` is not among this comparison's `variants`, in words a user can act on."""
    if name in PEERS and not request.peers:
        return f"{name} is a peer: add --peers"
    if name in ABLATIONS and not request.ablations:
        return f"{name} is an ablation: add --ablations"
    own_peer = peer_for(config)
    if name in (HF_TRAINER, TORCH_DDP) and name != own_peer:
        family = "text" if name == HF_TRAINER else "image"
        kind = "a timm image model" if own_peer == TORCH_DDP else "a transformers text model"
        return (
            f"{name} is the peer of {family} models; this config's model is {kind}, whose "
            f"peer is {own_peer}"
        )
    if name == DDP_FROZEN_EMBEDDING:
        return (
            f"{name} freezes a pretrained embedding; this config's weights are random (set "
            "model.model_name_or_path, model.pretrained or model.checkpoint_path)"
        )
    if name == "no_cache":
        return "no_cache turns AutoCache off, which this config has off already"
    close = difflib.get_close_matches(name, list(variants), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{name} is not one of {', '.join(variants)}{hint}"


@dataclass(frozen=True)
class PlannedRun:
    seed: int | None
    name: str
    overrides: list[str]  # the variant's own, after the request's
    run_dir: Path


def plan_variants(config: Config, request: CompareRequest) -> dict[str, list[str]]:
    """Every variant the request runs, budget runs included, with its overrides; refused in
    one line (ConfigError) before anything is written."""
    if config.freeze.strategy == "none":
        raise ConfigError(
            "freeze.strategy: compare needs a freeze strategy (the baseline turns it off)"
        )
    if request.seeds is not None and any(
        o.partition("=")[0].strip() == "trainer.seed" for o in request.overrides
    ):
        raise ConfigError(
            "trainer.seed: --seeds/--repeats set it for each run; leave out the override"
        )
    variants = variant_overrides(config, request.ablations, request.peers)
    if request.only is not None:
        unknown = [name for name in request.only if name not in variants]
        if unknown:
            why = "; ".join(why_not_a_variant(n, config, request, variants) for n in unknown)
            raise ConfigError(f"--variants: {why}")
        variants = {k: v for k, v in variants.items() if k in {*request.only, BASELINE, ELASTIC}}
    ladder = request.budgets
    if ladder is None:  # with --peers, DDP's default ladder, unless --variants left DDP out
        wanted = (request.peers and DDP in variants) or request.curves is not None
        ladder = default_ladder(config.trainer.epochs) if wanted else []
    every = variant_overrides(config, ablations=False, peers=True)
    for name in request.curves or [DDP]:
        if name not in variants and name != DDP:
            raise ConfigError(
                f"--curves: {name} is not a variant of this comparison "
                f"({', '.join(variants)}; DDP always may be)"
            )
        own = variants.get(name, every[DDP])
        variants.update(budget_variants(config, ladder, own, name in variants, name))
    return variants


def plan_runs(variants: dict[str, list[str]], request: CompareRequest) -> list[PlannedRun]:
    """The runs, seed by seed (an interrupted comparison leaves whole seeds behind); within
    a seed in an order that rotates with the seed, recorded in the seed's directory, so
    that a resumed seed keeps it (compare/order.py)."""
    out = request.out
    if request.seeds is None:
        return [PlannedRun(None, name, extra, out / name) for name, extra in variants.items()]
    runs = []
    for seed in request.seeds:
        directory = seed_dir(out, seed)
        for name in record_order(directory, rotated_order(list(variants), seed)):
            seeding = [*variants[name], f"trainer.seed={seed}"]
            runs.append(PlannedRun(seed, name, seeding, directory / name))
    return runs
