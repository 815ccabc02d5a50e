"""Typed run configuration: YAML in, checked dataclasses out.

Owns: one small dataclass per component, the YAML loader, ``key.sub=value`` overrides and
every check that can be made before a process starts (each error names the key).
Must not: import any other part of the package (it is the bottom layer), touch torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or impossible. Names the key."""


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{key}: {message}")


@dataclass(frozen=True)
class TrainerConfig:
    epochs: int = 10
    seed: int = 0
    global_batch_size: int = 64
    # The paper's batch semantics: every pipeline replica trains this many samples a step,
    # so the global batch is batch_per_replica x R and grows as AutoDP adds replicas; an
    # epoch then has fewer steps, and the learning rate is not scaled with the batch (as the
    # paper's code does). null: the fixed global batch above, split over the replicas.
    # Setting both is an error. docs/architecture.md, "Batch semantics".
    batch_per_replica: int | None = None
    # Local worker processes (one per device). None: one per initial pipeline stage.
    nproc_per_node: int | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_interval_steps: int = 10
    eval_interval_epochs: int = 1
    # Seconds a collective may wait for a peer before the run fails (gloo's default is 30 min).
    timeout_s: float = 600.0
    progress_bar: bool = True
    # At the end, export the trained model to RUN_DIR/export as its library loads it
    # (transformers save_pretrained for BERT, a timm checkpoint for ViT).
    save_model: bool = False
    # 'auto': when the run directory already holds a checkpoint, continue from its latest
    # (as `train --resume RUN_DIR` does); 'never': a run directory is for one run.
    resume: Literal["never", "auto"] = "never"
    # When a worker dies (killed, out of memory, a failed collective), end the others and
    # restart all of them from the latest checkpoint, at most this many times.
    max_restarts: int = 0
    # Compute precision: 'bf16' runs every stage's forward (and the frozen prefix) under
    # bfloat16 autocast with float32 weights, gradients and optimizer state; activations
    # cross stage boundaries in bfloat16.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # On CUDA, float32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs,
    # float32 accumulation); false: full float32 (several times slower on A100/H100).
    tf32: bool = True
    # Audit the data order: every first-stage rank appends the sample ids it trains on
    # (shape padding left out) to RUN_DIR/samples/rank<r>.jsonl, one line per step.
    record_sample_ids: bool = False

    def __post_init__(self) -> None:
        if self.epochs < 1:
            _fail("trainer.epochs", f"must be >= 1, got {self.epochs}")
        if self.global_batch_size < 1:
            _fail("trainer.global_batch_size", f"must be >= 1, got {self.global_batch_size}")
        if self.batch_per_replica is not None and self.batch_per_replica < 1:
            _fail("trainer.batch_per_replica", "must be >= 1 or null")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            _fail("trainer.nproc_per_node", f"must be >= 1, got {self.nproc_per_node}")
        if self.log_interval_steps < 1:
            _fail("trainer.log_interval_steps", "must be >= 1")
        if self.eval_interval_epochs < 1:
            _fail("trainer.eval_interval_epochs", "must be >= 1")
        if self.timeout_s <= 0:
            _fail("trainer.timeout_s", "must be > 0")
        if self.max_restarts < 0:
            _fail("trainer.max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.precision == "fp16":
            _fail(
                "trainer.precision",
                "fp16 needs dynamic loss scaling agreed across pipeline stages and replicas, "
                "which this system does not implement; use bf16 (no scaling needed, the same "
                "speed on GPUs with bfloat16 units) or fp32",
            )

    def replica_batch_size(self, dp_degree: int) -> int:
        """Samples one replica trains a step in a layout of `dp_degree` replicas."""
        if self.batch_per_replica is not None:
            return self.batch_per_replica
        return self.global_batch_size // dp_degree

    def global_batch_size_at(self, dp_degree: int) -> int:
        """Samples a step trains over all `dp_degree` replicas."""
        if self.batch_per_replica is not None:
            return self.batch_per_replica * dp_degree
        return self.global_batch_size

    @property
    def autocast_dtype(self) -> str | None:
        """The autocast dtype name, None for float32 training."""
        return "bfloat16" if self.precision == "bf16" else None


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["sgd", "adam", "adamw"] = "adamw"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = 0
    # Final learning rate of the cosine/linear decay, as a fraction of `lr`.
    min_lr_ratio: float = 0.0
    # Clip the global gradient norm (over every stage of a replica). None: no clipping.
    max_grad_norm: float | None = None
    # torch's optimizer implementation. 'auto': fused kernels for Adam/AdamW on CUDA and the
    # CPU (one pass over the parameters; on CUDA the step count kept on the device), foreach
    # for SGD.
    implementation: Literal["auto", "foreach", "fused"] = "auto"

    def __post_init__(self) -> None:
        if not self.lr > 0:
            _fail("optimizer.lr", f"must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            _fail("optimizer.momentum", f"must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            _fail("optimizer.weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            _fail("optimizer.betas", f"must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            _fail("optimizer.warmup_steps", "must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("optimizer.min_lr_ratio", "must be in [0, 1]")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            _fail("optimizer.max_grad_norm", "must be > 0 or null")


@dataclass(frozen=True)
class PipelineConfig:
    # Stages of the first pipeline. 'auto': the shortest pipeline whose stages fit a device
    # (pipeline.device_memory_bytes), 1 (plain DDP) when the whole model fits.
    initial_pipe_len: int | Literal["auto"] = "auto"
    # Memory of one device for the planner. None: on CUDA the device's total memory less a
    # reserve (1 GiB + 10% for the CUDA context, NCCL and fragmentation); on CPU unlimited.
    device_memory_bytes: int | None = None
    # An int is used for every layout. 'auto': for each layout the smallest M >= K that
    # divides the replica batch (1 for plain DDP), what `plan` and `plan --predict` assume:
    # a function of the config, so the same on any machine and under any load. 'measured'
    # (opt-in) times M in [K, 6K] the first time a layout (K, replica batch) is seen and
    # keeps the fastest (profile file): faster where it wins, but a busy machine may choose
    # another M, and M changes the arithmetic, so the freeze decisions may differ.
    num_micro_batches: int | Literal["auto", "measured"] = "auto"
    schedule: Literal["gpipe", "1f1b"] = "gpipe"
    # How stages are balanced: measured forward+backward time per unit, or parameter counts.
    balance: Literal["time", "params"] = "time"
    # JSON file of measured profiles (per-sublayer costs, micro-batch timings). None: the
    # run's own RUN_DIR/profiles.json; a path shared by several runs (of the same model on
    # the same kind of machine) lets later runs skip the measurements.
    profile_path: str | None = None
    # FSDP2 (fsdp/): 'always' trains one stage on every process with the trained layers'
    # parameters, gradients and optimizer state sharded over them (the fsdp peers of
    # `compare --peers`); 'auto' takes that sharded layout at a frozen boundary where it
    # fits and is predicted faster than the pipeline layout AutoPipe plans (from the measured
    # unit times and the collectives timed at start; under trainer.batch_per_replica never:
    # every process a replica would multiply the batch); 'never' keeps pipelines and DDP
    # (docs/architecture.md, "Sharded layouts").
    sharding: Literal["never", "always", "auto"] = "auto"

    def __post_init__(self) -> None:
        if self.sharding == "always" and self.initial_pipe_len not in (1, "auto"):
            _fail(
                "pipeline.sharding",
                f"'always' trains one stage: pipeline.initial_pipe_len must be 1 or 'auto', "
                f"got {self.initial_pipe_len}",
            )
        if isinstance(self.initial_pipe_len, int) and self.initial_pipe_len < 1:
            _fail(
                "pipeline.initial_pipe_len", f"must be >= 1 or 'auto', got {self.initial_pipe_len}"
            )
        if self.device_memory_bytes is not None and self.device_memory_bytes < 1:
            _fail(
                "pipeline.device_memory_bytes",
                f"must be >= 1 or null, got {self.device_memory_bytes}",
            )
        if isinstance(self.num_micro_batches, int) and self.num_micro_batches < 1:
            _fail(
                "pipeline.num_micro_batches",
                f"must be >= 1, 'auto' or 'measured', got {self.num_micro_batches}",
            )


@dataclass(frozen=True)
class FreezeConfig:
    # gradient_norm: the paper's Eq. 1 (the layers below the smallest gradient norm freeze);
    # gradient_norm_inclusive: the same with that layer frozen too; freeze.py says more.
    strategy: Literal[
        "none",
        "gradient_norm",
        "gradient_norm_inclusive",
        "convergence",
        "signal_to_noise",
        "autofreeze",
        "alpha_schedule",
        "manual",
    ] = "none"
    alpha: float = 1 / 3
    # For strategy 'convergence' (this project's rule): a bottom layer freezes once the RMS
    # of its per-step gradient norms changed by less than this share between two decision
    # points (still at most alpha of the active layers per decision).
    convergence_threshold: float = 0.05
    # For strategy 'signal_to_noise': a bottom layer freezes once the share of its gradient
    # that is signal (the rest being minibatch noise) has fallen below this (freeze.py).
    signal_threshold: float = 0.1
    # For strategy 'autofreeze' (Liu et al. 2021): the layers below the first active layer
    # whose accumulated gradient changed by at least this percentile of the active layers'
    # changes freeze (50: the median, AutoFreeze's default).
    percentile: float = 50.0
    # With a freezing strategy: the embedding is frozen from the first step (no gradient, no
    # all-reduce, no optimizer state for it), as fine-tuning often does; the layers freeze as
    # the strategy decides. The baseline (strategy 'none') trains it.
    embedding: bool = False
    # Decision every N optimizer steps; null: at the end of every epoch; 'auto': three per
    # epoch of the starting layout's steps (from the data size and the batch: the same on
    # any machine); 'measured' (opt-in): 'auto', spaced further apart when the run's first
    # transition cost more than 5% of the time between decisions, which depends on the
    # machine's load (docs/architecture.md, "Decision cadence").
    interval_steps: int | Literal["auto", "measured"] | None = "auto"
    # No decision before this many epochs have completed (layers must learn something first).
    warmup_epochs: int = 0
    # Most layers that may freeze; None: all but the last layer.
    max_frozen_layers: int | None = None
    # For strategy 'manual': num_frozen_layers at each decision point, in order.
    manual_schedule: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            _fail("freeze.alpha", f"must be in (0, 1), got {self.alpha}")
        if not self.convergence_threshold >= 0:  # NaN fails too
            _fail("freeze.convergence_threshold", f"must be >= 0, got {self.convergence_threshold}")
        if not 0 <= self.signal_threshold <= 1:  # NaN fails too
            _fail("freeze.signal_threshold", f"must be in [0, 1], got {self.signal_threshold}")
        if not 0 <= self.percentile <= 100:  # NaN fails too
            _fail("freeze.percentile", f"must be in [0, 100], got {self.percentile}")
        if isinstance(self.interval_steps, int) and self.interval_steps < 1:
            _fail("freeze.interval_steps", "must be >= 1, 'auto', 'measured' or null")
        if self.warmup_epochs < 0:
            _fail("freeze.warmup_epochs", "must be >= 0")
        if self.max_frozen_layers is not None and self.max_frozen_layers < 0:
            _fail("freeze.max_frozen_layers", "must be >= 0 or null")
        if self.strategy == "manual":
            if not self.manual_schedule:
                _fail("freeze.manual_schedule", "strategy 'manual' needs a non-empty list")
            if any(b < a for a, b in zip(self.manual_schedule, self.manual_schedule[1:])):
                _fail("freeze.manual_schedule", f"must never decrease, got {self.manual_schedule}")
            if any(n < 0 for n in self.manual_schedule):
                _fail("freeze.manual_schedule", "entries must be >= 0")

    @property
    def embedding_frozen(self) -> bool:
        """Whether the embedding is frozen from the start: `embedding` with a strategy that
        freezes (the baseline trains everything)."""
        return self.embedding and self.strategy != "none"


@dataclass(frozen=True)
class AutoPipeConfig:
    # False: the 'freeze only' ablation (frozen layers skip backward, layout never changes).
    enabled: bool = True
    # Cost of a frozen (forward-only) sublayer relative to a trained one, for `balance: params`.
    lambda_frozen: float = 1 / 6
    # 'greedy' fills stages towards the average as the paper's Algorithm 1 does (without its
    # variance term); 'optimal' minimises the largest stage exactly.
    partition_method: Literal["greedy", "optimal"] = "greedy"

    def __post_init__(self) -> None:
        if not 0 <= self.lambda_frozen <= 1:
            _fail("autopipe.lambda_frozen", f"must be in [0, 1], got {self.lambda_frozen}")


@dataclass(frozen=True)
class AutoDPConfig:
    # False: pipelines compress but freed devices stay idle (no new replicas).
    enabled: bool = True


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = False
    # Host memory for cached activations; None: a quarter of the free memory at start.
    memory_budget_bytes: int | None = None
    # Directory of the disk tier; None: a temporary directory removed after the run.
    dir: str | None = None
    # Storage precision; float16/bfloat16 halve the footprint (values rounded once). 'auto':
    # the training precision's (bfloat16 under trainer.precision bf16, else float32).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # Cache a randomly augmented training set anyway (its first view; the log says so).
    allow_augmented: bool = False
    # Keep the disk tier's files in cache.dir after the run (for inspection: a later run
    # does not reload them, since entries belong to one run's weights and sample ids).
    keep: bool = False
    # Batches read ahead from the disk tier (the epoch's sample order is known in advance).
    prefetch_batches: int = 4
    # Enable the cache only where a measured read beats recomputing the frozen prefix.
    profile: bool = True

    def __post_init__(self) -> None:
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 0:
            _fail("cache.memory_budget_bytes", "must be >= 0 or null")
        if self.prefetch_batches < 0:
            _fail("cache.prefetch_batches", "must be >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    # A checkpoint at the end of every N-th epoch (after its evaluation); 0: none at epoch ends.
    interval_epochs: int = 1
    # Also one every N optimizer steps; None: only at epoch ends.
    interval_steps: int | None = None
    # Complete checkpoints kept (the newest N); older ones go once a newer one exists.
    keep_last: int = 2
    # Also keep the checkpoint with the best eval metric (RUN_DIR/checkpoints/best).
    keep_best: bool = True

    def __post_init__(self) -> None:
        if self.interval_epochs < 0:
            _fail("checkpoint.interval_epochs", f"must be >= 0, got {self.interval_epochs}")
        if self.interval_steps is not None and self.interval_steps < 1:
            _fail("checkpoint.interval_steps", f"must be >= 1 or null, got {self.interval_steps}")
        if self.keep_last < 1:
            _fail("checkpoint.keep_last", f"must be >= 1, got {self.keep_last}")


# transformers model types with a built-in adapter (models/: bert.py, deberta.py,
# distilbert.py, modernbert.py); `model.name` set to one of them means a text encoder.
# A type added by a user's adapter (model.adapters) sets `model.family: bert`.
TEXT_MODEL_TYPES = (
    "bert",
    "roberta",
    "xlm-roberta",
    "electra",
    "deberta-v2",
    "distilbert",
    "modernbert",
)


@dataclass(frozen=True)
class ModelConfig:
    # A timm model name (ViT, DeiT, EVA, BEiT...) or a transformers model type ('bert',
    # 'roberta', 'deberta-v2', ...: a small random model of that family).
    name: str = "vit_tiny_patch16_224"
    # 'vit': a timm image model; 'bert': a transformers text encoder (any family with an
    # adapter); 'auto': a transformers model type or model_name_or_path means 'bert'.
    family: Literal["auto", "vit", "bert"] = "auto"
    pretrained: bool = False
    checkpoint_path: str | None = None
    # Text encoders: a hub id or a local directory with config.json (+ weights, tokenizer);
    # its config's model_type picks the adapter.
    model_name_or_path: str | None = None
    # Extra constructor arguments: timm.create_model kwargs or transformers config fields.
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Python modules to import before the model is built (in every process): each registers
    # model adapters with pipetransformer.models.register_adapter (docs/models.md).
    adapters: list[str] = field(default_factory=list)

    def resolved_family(self) -> str:
        if self.family != "auto":
            return self.family
        name = self.name.lower()
        if name.startswith("bert") or name in TEXT_MODEL_TYPES:
            return "bert"
        if self.model_name_or_path is not None:
            return "bert"
        return "vit"


DatasetName = Literal[
    "digits", "cifar10", "cifar100", "imagefolder", "synthetic", "sst2", "squad", "hf", "hf_image"
]
# The names whose data is a labelled table read through `datasets` (data/table.py): text
# classification, and image classification from a table with an image column.
TABLE_DATASETS = ("hf", "hf_image")
# data.metric: what eval_metric is (the best checkpoint and the compare report follow it);
# every metric of the task is recorded beside it (docs/data.md, "Metrics"). Higher is better
# for each (a regression's mean squared error is recorded, never followed).
MetricName = Literal["auto", "accuracy", "f1", "f1_macro", "mcc", "pearson", "spearman"]
REGRESSION_METRICS = ("pearson", "spearman")


@dataclass(frozen=True)
class DataConfig:
    name: DatasetName = "digits"
    # Dataset location: a directory (imagefolder, cifar, sst2 TSVs) or file (squad JSON).
    # None: fetch through torchvision / datasets. 'synthetic' (random ImageNet-shaped
    # images for benchmarks, deterministic from trainer.seed) reads no files.
    root: str | None = None
    # Where the evaluation split lives when it is not under data.root: for squad, a SQuAD
    # v1.1 JSON file (data.root, or datasets' "squad" when null, then gives only the
    # training split). Other datasets reject it.
    eval_root: str | None = None
    # Side length images are resized to; None: the dataset's default (16 for digits).
    image_size: int | None = None
    max_seq_length: int = 128
    # SQuAD: tokens of overlap between windows of a long context; None: max_seq_length // 4.
    doc_stride: int | None = None
    # Tokenizer (hub id or directory); None: the model's, or a word vocabulary built from
    # the training text when the model is random.
    tokenizer: str | None = None
    # Keep only the first N samples (after a seeded shuffle) of each split; None: all.
    train_subset: int | None = None
    eval_subset: int | None = None
    # SST-2: evaluate on this many sentences held out of the training split (one fixed draw,
    # the same for every trainer.seed, disjoint from what trains) instead of the 872 dev
    # sentences; train_subset is then drawn from the rest. None: the dev split.
    holdout: int | None = None
    augment: bool = False
    download: bool = False
    num_workers: int = 0
    # name 'hf' (text classification through `datasets`, docs/data.md) and 'hf_image' (image
    # classification, the same keys): what datasets.load_dataset(path, data_files=...)
    # reads: 'csv', 'tsv', 'json', 'parquet', a file of one of those kinds, a directory
    # written by save_to_disk (or of images in class folders, for hf_image), or a hub id.
    path: str | None = None
    # A file or list of files (the training split), or a mapping from split name to files.
    data_files: str | list[str] | dict[str, Any] | None = None
    # A hub dataset's configuration (datasets' `name`: 'mrpc' of 'nyu-mll/glue').
    config_name: str | None = None
    # The text column, or two for sentence pairs; None: 'text' or 'sentence', else the pair
    # 'sentence1', 'sentence2'.
    text_columns: str | list[str] | None = None
    # hf_image: the column of images (a `datasets` Image feature); None: the table's one
    # Image column.
    image_column: str | None = None
    label_column: str = "label"
    train_split: str = "train"
    # None: 'validation' (or 'dev') when the data has one, else data.eval_share of the
    # training split held out (a fixed draw, the same for every trainer.seed).
    eval_split: str | None = None
    eval_share: float = 0.1
    # Label names in class-id order. None: the dataset's ClassLabel names, else the training
    # split's distinct labels sorted (numbers numerically); the launcher writes them into
    # the run's config, and exports carry them (id2label).
    labels: list[str | int] | None = None
    # hf: 'regression' predicts the label column's number (one output, mean squared error;
    # STS-B); 'auto': regression when the training labels are numbers and one is not whole
    # (3.8), else classification. The launcher writes what it found into the run's config.
    task: Literal["auto", "classification", "regression"] = "auto"
    metric: MetricName = "auto"

    @property
    def text_column_names(self) -> list[str] | None:
        """data.text_columns as a list (None: the defaults)."""
        if isinstance(self.text_columns, str):
            return [self.text_columns]
        return self.text_columns

    @property
    def label_names(self) -> list[str] | None:
        """data.labels as strings (None: not set)."""
        return None if self.labels is None else [str(v) for v in self.labels]

    @property
    def resolved_doc_stride(self) -> int:
        return self.max_seq_length // 4 if self.doc_stride is None else self.doc_stride

    def __post_init__(self) -> None:
        for key in ("train_subset", "eval_subset", "image_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                _fail(f"data.{key}", f"must be >= 1 or null, got {value}")
        if self.max_seq_length < 8:
            _fail("data.max_seq_length", "must be >= 8")
        if self.doc_stride is not None and self.doc_stride < 0:
            _fail("data.doc_stride", "must be >= 0 or null")
        if self.num_workers < 0:
            _fail("data.num_workers", "must be >= 0")
        if self.name == "synthetic":
            for key in ("root", "augment"):
                if getattr(self, key):
                    _fail(f"data.{key}", "'synthetic' generates its images: leave it unset")
        if self.holdout is not None and (
            self.holdout < 1 or self.name not in ("sst2", *TABLE_DATASETS)
        ):
            _fail(
                "data.holdout",
                "must be >= 1 or null, and only sst2, hf and hf_image hold out a test split",
            )
        if not 0 < self.eval_share < 1:
            _fail("data.eval_share", f"must be in (0, 1), got {self.eval_share}")
        if self.name in TABLE_DATASETS:
            if self.path is None:
                _fail(
                    "data.path",
                    f"data.name '{self.name}' reads data.path (csv, json, parquet, a file, "
                    "a save_to_disk directory or a hub id)",
                )
            if self.root is not None:
                _fail("data.root", f"data.name '{self.name}' reads data.path and data.data_files")
            columns = self.text_column_names
            if columns is not None and not 1 <= len(columns) <= 2:
                _fail("data.text_columns", f"one column or two (a pair), got {columns}")
            if self.labels is not None and len({str(v) for v in self.labels}) != len(self.labels):
                _fail("data.labels", f"names must be distinct, got {self.labels}")
            if self.labels is not None and len(self.labels) < 2:
                _fail("data.labels", f"a classifier needs at least 2 labels, got {self.labels}")
        else:
            for key in ("path", "data_files", "config_name", "eval_split", "labels"):
                if getattr(self, key) is not None:
                    _fail(
                        f"data.{key}", f"only data.name hf and hf_image read it, not '{self.name}'"
                    )
        if self.task != "auto" and self.name != "hf":
            _fail("data.task", f"only data.name 'hf' reads it, not '{self.name}'")
        if self.task == "regression" and self.labels is not None:
            _fail("data.labels", "a regression has no labels to name (data.task regression)")
        regression_metric = self.metric in REGRESSION_METRICS
        if (
            self.task != "auto"
            and self.metric != "auto"
            and regression_metric != (self.task == "regression")
        ):
            _fail("data.metric", f"'{self.metric}' does not score a {self.task}")
        if self.text_columns is not None and self.name != "hf":
            _fail("data.text_columns", f"only data.name 'hf' reads it, not '{self.name}'")
        if self.image_column is not None and self.name != "hf_image":
            _fail("data.image_column", f"only data.name 'hf_image' reads it, not '{self.name}'")
        if self.metric != "auto" and self.name == "squad":
            _fail("data.metric", "squad reports the official F1 and exact match; leave it 'auto'")
        if self.eval_root is not None and self.name != "squad":
            # Nothing else reads it: refused here, not silently ignored.
            _fail(
                "data.eval_root",
                f"only squad reads a separate evaluation file; '{self.name}' takes its evaluation "
                "split from data.root",
            )


@dataclass(frozen=True)
class LoggingConfig:
    # Step and epoch metrics also to TensorBoard (RUN_DIR/tensorboard; the tensorboard extra).
    tensorboard: bool = False
    # ... and to Weights & Biases (the wandb extra; WANDB_MODE=offline works without network).
    wandb: bool = False


@dataclass(frozen=True)
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    autopipe: AutoPipeConfig = field(default_factory=AutoPipeConfig)
    autodp: AutoDPConfig = field(default_factory=AutoDPConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def nproc_per_node(self) -> int:
        """Local worker processes: trainer.nproc_per_node, else the configured pipeline
        length, else 2 (under torchrun the launcher's count replaces it)."""
        if self.trainer.nproc_per_node:
            return self.trainer.nproc_per_node
        setting = self.pipeline.initial_pipe_len
        return setting if isinstance(setting, int) else 2

    @property
    def cache_dtype(self) -> str:
        """What AutoCache stores activations as (cache.dtype with 'auto' resolved)."""
        if self.cache.dtype != "auto":
            return self.cache.dtype
        return self.trainer.autocast_dtype or "float32"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.trainer.batch_per_replica is not None:  # not used, and refused beside it
            del data["trainer"]["global_batch_size"]
        return data


# ---------------------------------------------------------------- loading and overrides


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to float)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in get_args(tp):
            try:
                return _coerce(key, value, option)
            except ConfigError:
                continue
        _fail(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        _fail(key, f"expected one of {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        _fail(key, f"expected null, got {value!r}")
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            _fail(key, f"expected a list, got {value!r}")
        (item_type,) = get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _fail(key, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(key, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _fail(key, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads '3e-5' (no dot) as a string; accept what Python reads as a number.
            try:
                return float(value)
            except ValueError:
                pass
        _fail(key, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(key, f"expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if cls is TrainerConfig and data.get("batch_per_replica") is not None:
        if "global_batch_size" in data:
            _fail(
                f"{prefix}global_batch_size",
                "not used with trainer.batch_per_replica (the global batch is then "
                "batch_per_replica x the replicas); set one of them",
            )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            _fail(full, f"unknown key{hint}; known keys: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                _fail(full, f"expected a mapping of {tp.__name__} fields, got {value!r}")
            kwargs[key] = _build(tp, value, f"{full}.")
        else:
            kwargs[key] = _coerce(full, value, tp)
    return cls(**kwargs)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: where (1-based line and column) and what; PyYAML's own
    text spans several lines and names the file "<unicode string>"."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    if mark is None:
        return what
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r}: empty key part")
    try:
        return path, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: not valid YAML: {_yaml_problem(exc)}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path)}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def read_config_data(
    path: str | os.PathLike | None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """The YAML's sections (or none) with the overrides applied: not yet typed or checked."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = loaded or {}
    return apply_overrides(data, overrides or [])


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults), apply overrides, check everything."""
    config = _build(Config, read_config_data(path, overrides), "")
    check_config(config)
    return config


def config_from_dict(data: dict[str, Any]) -> Config:
    config = _build(Config, data, "")
    check_config(config)
    return config


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
        if config.pipeline.schedule == "1f1b" and isinstance(m, int) and m < k:
            return "pipeline.num_micro_batches", f"1f1b needs at least pipe_len ({k}) micro-batches"
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
    family = config.model.resolved_family()
    image_sets = ("digits", "cifar10", "cifar100", "imagefolder", "synthetic", "hf_image")
    if family == "bert" and config.data.name in image_sets:
        _fail("data.name", f"'{config.data.name}' is an image dataset; model.name is BERT")
    if family == "vit" and config.data.name in ("sst2", "squad", "hf"):
        _fail("data.name", f"'{config.data.name}' is a text dataset; model.name is a ViT")


@dataclass(frozen=True)
class World:
    """The processes a run has, what `auto` settings are resolved against: the world size,
    the processes (devices) of one node, and the device type ('cpu' or 'cuda')."""

    world_size: int
    devices_per_node: int
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.world_size % self.devices_per_node:
            raise ValueError(
                f"{self.devices_per_node} devices per node do not divide "
                f"the world of {self.world_size}"
            )


def resolve(config: Config, world: World, initial_pipe_len: int | None = None) -> Config:
    """A new config with every setting that is `auto` (or unset) for the run's lifetime
    resolved for `world`: the processes per node, the device, AutoCache's storage dtype and,
    when given (AutoPipe's memory-aware choice, planning/context.py), the initial pipeline
    length. `config` is not changed. What stays `auto` is decided during the run from the
    config (`pipeline.num_micro_batches` per layout, `freeze.interval_steps` from the
    starting layout's steps); what is `measured` is timed during the run. Raises
    ConfigError as `check_config` does."""
    pipeline = config.pipeline
    if initial_pipe_len is not None:
        pipeline = dataclasses.replace(pipeline, initial_pipe_len=initial_pipe_len)
    resolved = dataclasses.replace(
        config,
        trainer=dataclasses.replace(
            config.trainer, nproc_per_node=world.devices_per_node, device=world.device_type
        ),
        pipeline=pipeline,
        cache=dataclasses.replace(config.cache, dtype=config.cache_dtype),
    )
    check_config(resolved, world_size=world.world_size)
    return resolved


def decided_by_measured_time(config: Config) -> list[str]:
    """The settings a run of `config` decides from times it measures ('measured', opt-in):
    what may differ between an idle and a busy machine. Empty: the same config and seed
    make the same decisions anywhere."""
    settings = {
        "pipeline.num_micro_batches": config.pipeline.num_micro_batches,
        "freeze.interval_steps": config.freeze.interval_steps,
    }
    return [key for key, value in settings.items() if value == "measured"]


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, value before, value after) for every setting that differs between two
    `Config.to_dict()`s; a key one of them lacks (a config written by an older release)
    counts as unchanged."""
    changes = []
    for section, values in after.items():
        old_values = before.get(section)
        if not isinstance(values, dict) or not isinstance(old_values, dict):
            continue
        for key, value in values.items():
            if key in old_values and old_values[key] != value:
                changes.append((f"{section}.{key}", old_values[key], value))
    return changes


def config_yaml(config: Config) -> str:
    """The resolved config as YAML text (what RUN_DIR/config.yaml holds)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
