"""The trainer section: epochs, batch semantics, processes, precision, restarts.

Owns: TrainerConfig and its single-key checks (the checks across sections are in
checks.py). Must not: import anything outside config/, touch torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipetransformer.config.errors import _fail


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
    # Where stderr is not a terminal (a log file), the progress bar's progress as a log line
    # at the step log, at most one every this many seconds (0: at every step log).
    progress_interval_s: float = 30.0
    eval_interval_epochs: int = 1
    # Evaluations an epoch, at the same shares of it in every run: the k-th after the first
    # step that reaches k/N of the epoch's samples (the last at its end), whatever the
    # layout and its steps an epoch (trainer/evaluation.py). Each is off the training
    # clock and a line of evaluations.jsonl; time-to-target reads them (docs/compare.md).
    evals_per_epoch: int = 1
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
    # torch.compile each unit's forward (regional, as torchtitan compiles each block; the
    # peers of `compare --peers` compile each block alike): a graph per unit class and
    # state, shared by the units of a class, reused across transitions; the batch and
    # sequence dimensions dynamic (models/compiled.py). Every graph a layout needs is
    # compiled before its first step (pipe/warmup.py: a transition's compile_s). Refused
    # with pipeline.schedule zero_bubble, whose split backward would run each compiled
    # unit's backward twice (config/checks.py).
    compile: bool = False
    # What compiles the graphs: 'inductor' (generated kernels); 'aot_eager' and 'eager'
    # trace without generating code (to check a model compiles, or find what breaks).
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # Activation checkpointing: each trained unit (a layer's attention or MLP sublayer)
    # keeps only its inputs for the backward and recomputes its forward there, about a
    # third more compute for the activations of one unit at a time instead of all of them
    # (what transformers' gradient_checkpointing does per layer); counted by the memory model
    # (autopipe/memory.py), so a layout that fits only with it is planned with it.
    activation_checkpointing: bool = False
    # How long the ranks wait for one another to compile a layout's units before its first
    # step (pipe/warmup.py): every graph a layout needs is compiled then, with no collective
    # pending, so trainer.timeout_s (NCCL's) never has to cover inductor's minutes.
    compile_timeout_s: float = 3600.0
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
        if self.progress_interval_s < 0:
            _fail("trainer.progress_interval_s", f"must be >= 0, got {self.progress_interval_s}")
        if self.eval_interval_epochs < 1:
            _fail("trainer.eval_interval_epochs", "must be >= 1")
        if self.evals_per_epoch < 1:
            _fail("trainer.evals_per_epoch", f"must be >= 1, got {self.evals_per_epoch}")
        if self.evals_per_epoch > 1 and self.eval_interval_epochs > 1:
            _fail(
                "trainer.evals_per_epoch",
                "evaluating several times an epoch needs trainer.eval_interval_epochs 1",
            )
        if self.timeout_s <= 0:
            _fail("trainer.timeout_s", "must be > 0")
        if self.compile_timeout_s <= 0:
            _fail("trainer.compile_timeout_s", "must be > 0")
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
