"""The checks across sections that can be made before a process starts: whether the
pipeline lengths a run may reach fit the devices, the batch and the micro-batches (as the
schedule needs them: config/schedules.py), and whether the sections agree with each other
(cache and augmentation, freeze rule and optimizer, model and data). Each error names the
key.

Owns: check_config and the pipeline lengths a run may start at or reach. Must not: import
anything outside config/, start processes or measure anything.
"""

from __future__ import annotations

from pathlib import Path

from pipetransformer.config.errors import _fail
from pipetransformer.config.model import looks_like_path
from pipetransformer.config.run import Config
from pipetransformer.config.schedules import (
    SCHEDULE_PROPERTIES,
    micro_batch_problem,
    smallest_micro_batches,
)


def pipe_len_candidates(devices_per_node: int) -> list[int]:
    """Pipeline lengths a run with `initial_pipe_len: auto` may start at: the powers of two
    dividing a node's devices, and the whole node (a pipeline never spans nodes)."""
    powers = {2**i for i in range(devices_per_node.bit_length()) if devices_per_node % 2**i == 0}
    return sorted(powers | {devices_per_node})


def reachable_pipe_lens(config: Config, initial: int | None = None) -> list[int]:
    """Every K a run starting at `initial` (default: the configured K) may use: K only
    halves, and only when AutoPipe and freezing are on."""
    k = initial if initial is not None else config.pipeline.initial_pipe_len
    lens = [k]
    if config.autopipe.enabled and config.freeze.strategy != "none":
        while k % 2 == 0:
            k //= 2
            lens.append(k)
    return lens


def _layout_problem(config: Config, world: int, k0: int) -> tuple[str, str] | None:
    """(key, message) of the first reason a run cannot start at pipeline length `k0`."""
    nproc = config.nproc_per_node
    if nproc % k0 != 0:
        return (
            "pipeline.initial_pipe_len",
            f"{k0} does not divide the {nproc} devices per node (trainer.nproc_per_node)",
        )
    trainer = config.trainer
    batch = trainer.global_batch_size
    batch_key = "trainer.global_batch_size"
    if trainer.batch_per_replica is not None:
        batch_key = "trainer.batch_per_replica"
    m = config.pipeline.num_micro_batches
    for k in reachable_pipe_lens(config, k0):
        replicas = world // k if (config.autodp.enabled or k == k0) else world // k0
        if trainer.batch_per_replica is None and batch % replicas != 0:
            return batch_key, (
                f"{batch} does not split evenly over {replicas} pipeline replicas "
                f"(pipe_len {k} on {world} devices)"
            )
        per_replica = trainer.replica_batch_size(replicas)
        if isinstance(m, int) and per_replica % m != 0:
            return "pipeline.num_micro_batches", (
                f"{m} does not divide the per-replica batch {per_replica} "
                f"({replicas} replicas at pipe_len {k})"
            )
        if m in ("auto", "measured") and per_replica < k:
            return (batch_key, f"per-replica batch {per_replica} is smaller than pipe_len {k}")
        schedule = config.pipeline.schedule
        if isinstance(m, int) and (problem := micro_batch_problem(schedule, k, m)):
            return "pipeline.num_micro_batches", f"{problem} (pipeline.schedule)"
        if m in ("auto", "measured") and smallest_micro_batches(schedule, k, per_replica) is None:
            return batch_key, (
                f"no micro-batch count pipeline.schedule {schedule} runs divides the per-replica "
                f"batch {per_replica} at pipe_len {k} (it needs M >= {k}, a multiple of "
                f"max(1, M // {k})); use a batch divisible by {k}"
            )
    return None


def initial_pipe_lens(config: Config, world_size: int | None = None) -> list[int]:
    """The pipeline lengths a run may start at: the configured one, or for 'auto' every
    candidate whose layouts the batch and micro-batch settings allow."""
    world = world_size or config.nproc_per_node
    setting = config.pipeline.initial_pipe_len
    if config.pipeline.sharding == "always":
        return [1]
    if isinstance(setting, int):
        return [setting]
    return [
        k
        for k in pipe_len_candidates(config.nproc_per_node)
        if _layout_problem(config, world, k) is None
    ]


def frozen_random_embedding(config: Config) -> bool:
    """`freeze.embedding: true` on a model that starts from random weights (no pretrained
    weights, `model.model_name_or_path` or `model.checkpoint_path`): the embedding is frozen
    from the first step, so it never leaves its random initialisation (a tiny random BERT
    scored chance on SST-2 that way, docs/benchmarks.md section 19). 'auto' never does."""
    return config.embedding_frozen and not config.starts_from_trained_weights


def random_embedding_warning(config: Config) -> str | None:
    """What a run with `frozen_random_embedding` warns at its start; None for any other."""
    if not frozen_random_embedding(config):
        return None
    return (
        "freeze.embedding: the embedding is frozen from the first step but the model starts "
        "from random weights (no model.model_name_or_path, model.pretrained or "
        "model.checkpoint_path), so it will never train; set freeze.embedding=auto (the "
        "default), or name pretrained weights"
    )


def split_backward_compile_problem(schedule: str) -> str:
    """Why a compiled unit cannot run under `schedule`'s split backward (pipe/runtime.py
    refuses it too, for a caller that built its units compiled)."""
    return (
        f"pipeline.schedule {schedule} splits each backward into its input and weight "
        "gradients (torch's stage_backward_input and stage_backward_weight), and a compiled "
        "unit is one autograd node: its whole compiled backward would run for each, twice "
        "the matmuls (or fail on AOTAutograd's donated buffers); use trainer.compile=false "
        "or pipeline.schedule interleaved_1f1b"
    )


def check_model_path(config: Config) -> None:
    """A model.model_name_or_path meant as a local directory must exist: said before the
    checks that take any model path for a text model's (a missing directory on an image
    config read as "an image dataset; model.name is BERT"). Made where a command line is
    read (load_config), not where a run's recorded config is read back."""
    path = config.model.model_name_or_path
    if path is not None and looks_like_path(path) and not Path(path).expanduser().exists():
        _fail("model.model_name_or_path", f"no such directory: {path}")


def check_config(config: Config, world_size: int | None = None) -> None:
    """Cross-field checks. `world_size` defaults to one node of `nproc_per_node` devices."""
    nproc = config.nproc_per_node
    world = world_size or nproc
    if world % nproc != 0:
        _fail("trainer.nproc_per_node", f"{nproc} does not divide the world size {world}")
    setting = config.pipeline.initial_pipe_len
    candidates = [setting] if isinstance(setting, int) else pipe_len_candidates(nproc)
    if config.pipeline.sharding == "always":
        candidates = [1]
    problems = [_layout_problem(config, world, k0) for k0 in candidates]
    if all(problems):  # 'auto' needs one possible start; a configured K must work itself
        _fail(*problems[0])
    schedule = config.pipeline.schedule
    if config.trainer.compile and SCHEDULE_PROPERTIES[schedule].split_backward:
        _fail("trainer.compile", split_backward_compile_problem(schedule))
    if config.trainer.activation_checkpointing:
        _check_activation_checkpointing(config)
    augmented = config.data.augment and config.data.name in (
        "cifar10",
        "cifar100",
        "imagefolder",
        "hf_image",
    )
    if config.cache.enabled and augmented and not config.cache.allow_augmented:
        _fail(
            "cache.allow_augmented",
            "data.augment makes each epoch's inputs differ, so cached frozen-layer outputs "
            "would be stale; set cache.allow_augmented=true to cache each sample's first view "
            "(the paper's behaviour), data.augment=false, or cache.enabled=false",
        )
    optimizer = config.optimizer
    if config.freeze.strategy == "signal_to_noise" and not (
        optimizer.name in ("adam", "adamw") or optimizer.momentum > 0
    ):
        _fail(
            "freeze.strategy",
            "signal_to_noise reads the optimizer's moving average of gradients: use "
            "optimizer.name adam or adamw, or sgd with optimizer.momentum > 0",
        )
    if (
        config.freeze.strategy == "signal_to_noise"
        and optimizer.name in ("adam", "sgd")
        and optimizer.weight_decay > 0
    ):
        _fail(
            "freeze.strategy",
            f"signal_to_noise with optimizer.name {optimizer.name} and weight_decay > 0: the "
            "coupled decay term enters the moving average of gradients but not the measured "
            "gradient norms, so the signal share is biased; use adamw (decoupled decay) or "
            "optimizer.weight_decay=0",
        )
    if optimizer.layerwise_anneal:
        _check_layerwise_anneal(config)
    family = config.model.resolved_family()
    image_sets = ("digits", "cifar10", "cifar100", "imagefolder", "synthetic", "hf_image")
    if family == "bert" and config.data.name in image_sets:
        _fail("data.name", f"'{config.data.name}' is an image dataset; model.name is BERT")
    if family == "vit" and config.data.name in ("sst2", "squad", "hf"):
        _fail("data.name", f"'{config.data.name}' is a text dataset; model.name is a ViT")


def _check_activation_checkpointing(config: Config) -> None:
    """trainer.activation_checkpointing where it is implemented and tested: not under a split
    backward (zero_bubble runs a unit's input and weight gradients apart, and a recomputed
    forward would have to be kept between them), not with trainer.compile (a checkpointed
    compiled unit is not among the graphs models/compiled.py bounds and audits)."""
    schedule = config.pipeline.schedule
    if SCHEDULE_PROPERTIES[schedule].split_backward:
        _fail(
            "trainer.activation_checkpointing",
            f"pipeline.schedule {schedule} splits each unit's backward in two, which a "
            "recomputed forward cannot serve; use gpipe, 1f1b or interleaved_1f1b",
        )
    if config.trainer.compile:
        _fail(
            "trainer.activation_checkpointing",
            "with trainer.compile the recomputed forward would run outside the compiled "
            "graphs this system bounds; use one of the two",
        )


def _check_layerwise_anneal(config: Config) -> None:
    """optimizer.layerwise_anneal needs freeze times that can be planned at start-up
    (pipetransformer/anneal.py, "The plan") and a decay to squeeze onto them."""
    freeze = config.freeze
    key = "optimizer.layerwise_anneal"
    # With freeze.strategy 'none' no layer has a freeze time: every layer keeps the run's
    # schedule, as without the option. Accepted so that the baseline and the peers, which
    # `compare` and the benchmarks derive from a config by setting freeze.strategy=none,
    # still run from a config that anneals.
    if freeze.strategy == "none":
        return
    if freeze.memory_aware:
        _fail(
            key,
            "freeze.memory_aware freezes only where a layout would change, which the plan "
            "cannot know at start-up (it depends on the layouts the memory model allows); "
            "use one of the two",
        )
    if freeze.strategy in ("gradient_norm", "gradient_norm_inclusive") and not freeze.eq1_bound:
        _fail(
            key,
            f"freeze.strategy {freeze.strategy} with freeze.eq1_bound=false: its signal alone "
            "decides when a layer freezes, so no freeze time can be planned; the plan of Eq. 1 "
            "is its bound's path (freeze.eq1_bound=true)",
        )
    if freeze.strategy in ("convergence", "signal_to_noise", "autofreeze"):
        _fail(
            key,
            f"freeze.strategy {freeze.strategy} decides from its signal when a layer freezes, "
            "which cannot be planned (a layer annealed to zero must freeze, so a plan would "
            "overrule the signal); use gradient_norm, gradient_norm_inclusive, alpha_schedule "
            "or manual",
        )
    if freeze.interval_steps == "measured":
        _fail(
            key,
            "freeze.interval_steps 'measured' spaces decisions by times the run measures, so "
            "they cannot be planned at start-up; use 'auto', a number of steps or null",
        )
    if config.trainer.batch_per_replica is not None and freeze.interval_steps is not None:
        _fail(
            key,
            "with trainer.batch_per_replica a decision every freeze.interval_steps steps falls "
            "at a place in the schedule that depends on the layouts to come; use "
            "freeze.interval_steps=null (epoch ends) or trainer.global_batch_size",
        )
    if config.optimizer.lr_schedule == "constant":
        _fail(
            key,
            "optimizer.lr_schedule 'constant' has no decay for a layer's rate to follow to "
            "zero; use cosine or linear",
        )
