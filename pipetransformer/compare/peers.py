"""What users run today instead of this trainer, as peers of `compare --peers`.

- `hf_trainer` (text models): transformers' `Trainer` under DDP (accelerate's multi-process
  state, gloo on CPU, NCCL on GPUs), as a user fine-tuning BERT runs it under torchrun:
  `TrainingArguments`' own default `optim` (`adamw_torch_fused` on torch >= 2.8 with
  transformers 5; `--hf-optim` picks another, `adamw_torch` the per-parameter loop);
- `torch_ddp` (image models): the plain loop a timm user writes: the timm model in
  `DistributedDataParallel`, AdamW, a `DistributedSampler`, clipping, one step per batch.

`hf_trainer` can run with this project's `FreezeCallback` added (`hf_callback`, the
`--hf-callback` of `main`): `freeze` (the config's `freeze:` section as the callback's keys)
or `embedding` (the embedding frozen from the first step, no layer): `Trainer` with freezing
as a user adds it (integrations/transformers.py), its decisions recorded as the trainer's.

Both train what the trainer trains: the same model weights (the same seed before the model
is built, or the same pretrained directory), the same data (`build_data`: the same subsets,
tokenisation and image transforms), batch, optimizer, weight decay groups, schedule,
clipping and epochs, on the same processes (the local launcher's environment, as torchrun's).
Text is padded as its users pad it: `Trainer` gets each sample at its real length and
`DataCollatorWithPadding` pads each batch to its longest, rounded up to
data.pad_to_multiple_of (or to max_seq_length under data.padding max_length), and groups
batches by length (`group_by_length`) where the config does; `torch_ddp` fetches batches
as the trainer does. `DataCollatorWithFlattening` (`--hf-collator flattening`: a batch in
one row, position ids restarting per sample) is refused where the model cannot keep the
samples apart (`flattening_refusal`: every sequence classifier, and attention other than
flash attention's kernels). Each counts the real tokens and the padded tokens it trains (from the
attention masks) into its epochs' records.

They compute as the trainer does (`PeerMath`, from the same config): the process's own GPU
(`torch.cuda.set_device`), TF32 for float32 matmuls as `trainer.tf32` says, autocast in
`trainer.precision`'s dtype, batches decoded by loader workers (as many as the trainer's)
into pinned memory and copied without blocking; otherwise a GPU speedup against them would
measure the settings, not the system. Every collective they make on the default group (NCCL
on GPUs) carries device tensors, as NCCL requires.
Their accuracy is scored on rank 0 the way the trainer scores its own (argmax over the
evaluation split), at the trainer's evaluation points (trainer/evaluation.py
`evaluation_due`: every epoch's end, and `trainer.evals_per_epoch` shares of each epoch's
samples), each off their training clock as the trainer's are (`EpochClock`). Each writes
the run records `compare` reads (summary.json, metrics.jsonl, evaluations.jsonl,
events.jsonl), so they join the report, the statistics over seeds and time-to-target like
any variant.

Owns: the peers' training loops and their records. Must not: use anything of the trainer's
step (that is what they are measured against); they share its evaluation points only.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.compare.collators import collator as text_collator
from pipetransformer.compare.collators import flattening_refusal, meta_text_model
from pipetransformer.compare.peer_records import (
    EpochClock,
    PeerEvaluations,
    peer_tick,
    write_records,
)
from pipetransformer.compare.report import HF_TRAINER, TORCH_DDP
from pipetransformer.config import Config
from pipetransformer.data import DataBundle, build_data
from pipetransformer.data.base import TensorSampleDataset
from pipetransformer.data.loader import workers_per_process
from pipetransformer.models.compiled import compile_unit, library_blocks
from pipetransformer.runs.records import Evaluation, FreezeDecisionEvent, RunSummary
from pipetransformer.trainer.clock import Tick
from pipetransformer.trainer.optim import decay_groups, learning_rate

logger = logging.getLogger(__name__)


def peer_for(config: Config) -> str:
    """The peer a user of this model family runs: `hf_trainer` for transformers models,
    `torch_ddp` for timm models."""
    return TORCH_DDP if config.model.resolved_family() == "vit" else HF_TRAINER


def run_peer(
    name: str,
    config: Config,
    run_dir: Path,
    hf_optim: str | None = None,
    hf_collator: str = "padding",
    hf_callback: str | None = None,
) -> None:
    """One rank of peer `name` (a worker of the local launcher or of torchrun). `hf_optim`:
    the Trainer's `optim` (None: TrainingArguments' own default, as its users get it);
    `hf_collator`: 'padding' (DataCollatorWithPadding) or 'flattening'
    (DataCollatorWithFlattening, where the model supports it: `flattening_refusal`);
    `hf_callback`: None, or the freezing callback added to the Trainer (`HF_CALLBACKS`)."""
    _set_threads()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if config.trainer.global_batch_size is None or config.trainer.global_batch_size % world_size:
        raise ValueError(
            f"trainer.global_batch_size: the {name} peer needs a global batch that the "
            f"{world_size} processes split evenly"
        )
    if config.data.name == "squad":
        raise ValueError(f"data.name: the {name} peer trains classification only")
    data = build_data(
        config.data, seed=config.trainer.seed, model_name_or_path=config.model.model_name_or_path
    )
    decisions = []
    if name == HF_TRAINER:
        device, epochs, evaluations, decisions = _run_hf_trainer(
            config, data, run_dir, world_size, hf_optim, hf_collator, hf_callback
        )
    else:
        device, epochs, evaluations = _run_torch_ddp(config, data, rank, world_size)
    peak = _peak_rss_bytes(device)
    if rank == 0:
        write_records(run_dir, epochs, evaluations, world_size, peak, decisions)


@dataclass(frozen=True)
class PeerMath:
    """How a peer process computes: what the trainer's start-up and step set for the same
    config (trainer/distributed.py `init_distributed`, the runtime's autocast, the loaders)."""

    device: torch.device
    tf32: bool  # float32 matmuls on TF32 tensor cores (CUDA only)
    autocast_dtype: torch.dtype | None
    pin_memory: bool  # batches in pinned memory, copied to the device without blocking
    loader_workers: int  # processes decoding batches beside the training loop

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self):
        return torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )

    def enter(self) -> None:
        """This process's GPU and its float32 matmul precision, as the trainer sets them."""
        if self.cuda:
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.pin_memory and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)


def peer_math(config: Config) -> PeerMath:
    """The `PeerMath` of this process (torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE)."""
    cuda = torch.cuda.is_available() and config.trainer.device != "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    name = config.trainer.autocast_dtype
    return PeerMath(
        device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
        tf32=cuda and config.trainer.tf32,
        autocast_dtype=getattr(torch, name) if name else None,
        pin_memory=cuda,
        loader_workers=workers_per_process(config.data.num_workers, local),
    )


def _compile_blocks(config: Config, model: nn.Module, text: bool) -> None:
    """trainer.compile: each transformer block compiled on its own, as the trainer compiles
    each unit (regional compilation; the batch, and a text model's sequence, dynamic)."""
    if config.trainer.compile:
        for block in library_blocks(model):
            compile_unit(block, config.trainer.compile_backend, (0, 1) if text else (0,))


def _set_threads() -> None:
    """One thread per process where processes share the cores, as the trainer sets it."""
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def _optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the user picks, with the trainer's settings; torch's own default
    implementation (foreach on GPUs, a loop on the CPU), as a user gets it."""
    o = config.optimizer
    groups = decay_groups([p for p in model.parameters() if p.requires_grad], o.weight_decay)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def _accuracy(
    model: nn.Module, data: DataBundle, device: torch.device, forward, compute: PeerMath
) -> float:
    """Argmax accuracy over the whole evaluation split, as the trainer's evaluator scores it
    (the count kept on the device, read once)."""
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    batch = 256
    with torch.no_grad(), compute.autocast():
        for start in range(0, len(data.eval), batch):
            ids = range(start, min(start + batch, len(data.eval)))
            inputs, target = data.eval.fetch(ids)
            logits = forward(model, [compute.to_device(t) for t in inputs])
            correct += (logits.argmax(-1) == compute.to_device(target)).sum()
    model.train()
    return int(correct.item()) / len(data.eval)


def _peak_rss_bytes(device: torch.device) -> int:
    """The largest resident set over the ranks: reduced on the default group (NCCL on GPUs,
    which takes device tensors only)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if not dist.is_initialized():
        return rss
    peak = torch.tensor([rss], dtype=torch.long, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


# --- hf_trainer -----------------------------------------------------------------------------


class _TextDataset(torch.utils.data.Dataset):
    """The trainer's tokenised split as the dicts `Trainer` feeds the model: each sample at
    its real length, as a tokenizer that truncates (and does not pad) leaves it."""

    def __init__(self, split) -> None:
        inputs, labels = split.fetch(range(len(split)))
        self.columns = dict(zip(("input_ids", "token_type_ids", "attention_mask"), inputs))
        self.lengths = split.lengths
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        length = self.lengths[index]
        row = {name: column[index, :length] for name, column in self.columns.items()}
        return {**row, "labels": self.labels[index]}


class TokenCounter:
    """Real and padded tokens of the batches a model is called with (from the attention
    mask), summed on the device (no host read per step) and over every rank at `take`."""

    def __init__(self, model: nn.Module) -> None:
        self.real: torch.Tensor | None = None  # on the model's device
        self.padded = 0  # the masks' sizes, known on the host
        self.counting = True
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask")
        if not self.counting or mask is None or not module.training:
            return
        real = mask.sum()
        self.real = real if self.real is None else self.real + real
        self.padded += mask.numel()

    def take(self) -> tuple[int, int]:
        """(real, padded) since the last call, over every rank (collective); resets."""
        # On the device the counts are on: NCCL reduces device tensors only.
        real = torch.zeros((), dtype=torch.long) if self.real is None else self.real.long()
        sums = torch.stack([real, torch.tensor(self.padded, device=real.device)])
        if dist.is_initialized():
            dist.all_reduce(sums)
        self.real, self.padded = None, 0
        total_real, total_padded = sums.tolist()
        return int(total_real), int(total_padded)


def _text_forward(model: nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor:
    input_ids, token_type_ids, attention_mask = inputs
    return model(
        input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask
    ).logits


def _length_grouping(arguments: type, grouped: bool) -> dict[str, Any]:
    """The TrainingArguments that group batches by length (LengthGroupedSampler): since the
    sampler unification of transformers 5 (huggingface/transformers#43138),
    `train_sampling_strategy="group_by_length"`; before it, `group_by_length=True`."""
    if "train_sampling_strategy" in inspect.signature(arguments).parameters:
        return {"train_sampling_strategy": "group_by_length" if grouped else "random"}
    return {"group_by_length": grouped}


def optim_arguments(config: Config, hf_optim: str | None) -> dict[str, str]:
    """The TrainingArguments that pick the peer's optimizer: SGD where the config trains
    with it, `hf_optim` where asked, else none (TrainingArguments' own default optim)."""
    if config.optimizer.name == "sgd":
        return {"optim": "sgd"}
    return {} if hf_optim is None else {"optim": hf_optim}


# `--hf-callback`: the freezing callback added to the Trainer, as its keys from the config.
HF_CALLBACKS = ("freeze", "embedding")
# The embedding frozen from the first step and no layer after it (the time-to-target
# benchmark's `embedding_only`, as a Trainer user gets it).
EMBEDDING_ONLY = {
    "strategy": "manual",
    "manual_schedule": [0],
    "interval_steps": None,
    "embedding": True,
}


def freeze_callback(config: Config, kind: str | None):
    """The FreezeCallback of `--hf-callback` (None: none): `freeze` takes the config's
    freeze section as its keys, `embedding` freezes the embedding alone."""
    if kind is None:
        return None
    if kind not in HF_CALLBACKS:
        raise ValueError(f"--hf-callback: one of {', '.join(HF_CALLBACKS)}, got {kind!r}")
    from pipetransformer.integrations.transformers import FreezeCallback

    keys = dataclasses.asdict(config.freeze) if kind == "freeze" else EMBEDDING_ONLY
    return FreezeCallback(**keys)


def _decision_events(callback) -> list[FreezeDecisionEvent]:
    """A freezing callback's decisions as the trainer's freeze events."""
    if callback is None:
        return []
    return [
        FreezeDecisionEvent(
            decision_index=d["freeze_decision"],
            epoch=d["epoch"],
            global_step=d["global_step"],
            old_num_frozen_layers=d["previous_frozen_layers"],
            new_num_frozen_layers=d["frozen_layers"],
            proposed=d["freeze_proposed"],
            bound=d["freeze_bound"],
            cap=d["freeze_cap"],
            decided_by=d["freeze_decided_by"],
            layer_grad_norms=d["layer_grad_norms"],
        )
        for d in callback.freezer.progress.decisions
    ]


def _run_hf_trainer(
    config: Config,
    data: DataBundle,
    run_dir: Path,
    world_size: int,
    hf_optim: str | None,
    hf_collator: str = "padding",
    hf_callback: str | None = None,
) -> tuple[torch.device, list[dict], list[Evaluation], list[FreezeDecisionEvent]]:
    try:
        import accelerate  # noqa: F401  (Trainer needs it for DDP)
        from transformers import Trainer, TrainerCallback, TrainingArguments
    except ImportError as exc:
        raise ImportError(
            f"the {HF_TRAINER} peer needs transformers' Trainer and accelerate: "
            "pip install -e '.[peers]'"
        ) from exc
    from pipetransformer.models.text_models import create_text_model

    if data.task != "classification":
        raise ValueError(f"data.name: the {HF_TRAINER} peer trains classification only")
    torch.manual_seed(config.trainer.seed)  # the trainer's weights (trainer.py builds so)
    model, _ = create_text_model(
        config.model, task=data.task, num_labels=data.num_classes, vocab_size=data.vocab_size
    )
    collator = text_collator(config, model, hf_collator)
    _compile_blocks(config, model, text=True)
    o = config.optimizer
    compute = peer_math(config)
    use_cpu = not compute.cuda
    if o.lr_schedule == "linear" and o.min_lr_ratio > 0:
        raise ValueError("optimizer.min_lr_ratio: the hf_trainer peer decays to 0")
    args = TrainingArguments(
        output_dir=str(run_dir / "hf_output"),
        per_device_train_batch_size=config.trainer.global_batch_size // world_size,
        num_train_epochs=config.trainer.epochs,
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        **optim_arguments(config, hf_optim),
        lr_scheduler_type=o.lr_schedule if o.lr_schedule != "constant" else "constant_with_warmup",
        warmup_steps=o.warmup_steps,
        max_grad_norm=o.max_grad_norm or 0.0,
        seed=config.trainer.seed,
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=use_cpu,
        ddp_backend="gloo" if use_cpu else "nccl",
        # The trainer's math (PeerMath): loader workers into pinned memory, bf16, TF32
        # (None on the CPU: transformers refuses tf32 where no GPU has it).
        dataloader_num_workers=compute.loader_workers,
        dataloader_pin_memory=compute.pin_memory,
        # Every sample every epoch, as the trainer trains them (and Trainer's default).
        dataloader_drop_last=False,
        # Every parameter is used: the default (True) would traverse the graph every step.
        ddp_find_unused_parameters=False,
        bf16=compute.autocast_dtype == torch.bfloat16,
        tf32=compute.tf32 if compute.cuda else None,
        **_length_grouping(TrainingArguments, config.data.group_by_length),
    )
    _set_threads()  # accelerate's state may have changed it

    clock = EpochClock()
    tokens = TokenCounter(model)
    rank = int(os.environ.get("RANK", "0"))
    evaluations = PeerEvaluations(config, data, clock, rank)
    batch = config.trainer.global_batch_size // world_size
    epoch_samples = math.ceil(len(data.train) / world_size)  # a rank's (DistributedSampler)
    steps = math.ceil(epoch_samples / batch)
    began = [0, 0]  # the epoch in progress (0-based) and the global step it began at

    def tick(state, epoch_end: bool) -> Tick:
        step = steps - 1 if epoch_end else state.global_step - began[1] - 1
        return peer_tick(began[0], step, steps, state.global_step, config, batch, epoch_samples)

    class Epochs(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            began[:] = [len(clock.records), state.global_step]
            clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step - began[1] < steps:  # the epoch's last: at its end
                evaluations.after_step(tick(state, epoch_end=False))

        def on_epoch_end(self, args, state, control, **kwargs):
            counted = tokens.take()  # before the clock: the step's kernels are done
            clock.end(state.global_step, len(data.train), float("nan"), 0.0, counted)
            evaluations.at_epoch_end(tick(state, epoch_end=True))

    # The freezing callback before the clock's: a decision at an epoch's end is on the
    # epoch's training time, as the trainer's transitions are.
    freezing = freeze_callback(config, hf_callback)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_TextDataset(data.train),
        data_collator=collator,
        callbacks=[c for c in (freezing, Epochs()) if c is not None],
    )
    device = trainer.model.device
    evaluations.score = lambda: _accuracy(trainer.model, data, device, _text_forward, compute)
    output = trainer.train()
    tokens.counting = False
    for record in clock.records:  # Trainer reports the mean training loss over the run
        record["train_loss"] = float(output.training_loss)
    return trainer.model.device, clock.records, evaluations.records, _decision_events(freezing)


def _image_forward(model: nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor:
    return model(*inputs)


# --- torch_ddp ------------------------------------------------------------------------------


def _run_torch_ddp(
    config: Config, data: DataBundle, rank: int, world_size: int
) -> tuple[torch.device, list[dict], list[Evaluation]]:
    from torch.nn.parallel import DistributedDataParallel

    from pipetransformer.models.image_models import create_timm_model

    compute = peer_math(config)
    device = compute.device
    compute.enter()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if compute.cuda else "gloo")
    torch.manual_seed(config.trainer.seed)  # the trainer's weights (trainer.py builds so)
    model, _ = create_timm_model(
        config.model.name,
        num_classes=data.num_classes,
        in_chans=data.in_chans,
        img_size=data.image_size,
        pretrained=config.model.pretrained,
        checkpoint_path=config.model.checkpoint_path,
        kwargs=config.model.kwargs,
    )
    _compile_blocks(config, model, text=False)
    model = model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if compute.cuda else None)
    optimizer = _optimizer(config, ddp)
    batch = config.trainer.global_batch_size // world_size
    sampler = torch.utils.data.DistributedSampler(
        range(len(data.train)),
        num_replicas=world_size,
        rank=rank,
        seed=config.trainer.seed,
    )  # the defaults a user keeps: every sample every epoch, the last batch smaller
    steps_per_epoch = math.ceil(len(sampler) / batch)
    loader = _loader(data, sampler, batch, compute)
    total_steps = steps_per_epoch * config.trainer.epochs
    loss_fn = nn.CrossEntropyLoss()
    clock, step = EpochClock(), 0
    evaluations = PeerEvaluations(config, data, clock, rank)
    evaluations.score = lambda: _accuracy(model, data, device, _image_forward, compute)
    lr = config.optimizer.lr
    for epoch in range(config.trainer.epochs):
        sampler.set_epoch(epoch)
        clock.start()
        losses = []
        for index, (inputs, target) in enumerate(loader):
            lr = learning_rate(config.optimizer, step, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with compute.autocast():
                logits = ddp(*[compute.to_device(t) for t in inputs])
            loss = loss_fn(logits.float(), compute.to_device(target))
            loss.backward()
            if config.optimizer.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(ddp.parameters(), config.optimizer.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            step += 1
            tick = peer_tick(epoch, index, steps_per_epoch, step, config, batch, len(sampler))
            evaluations.after_step(tick)
        if losses:
            mean_loss = torch.stack(losses).mean()
        else:
            mean_loss = torch.tensor(float("nan"), device=device)  # NCCL takes device tensors
        dist.all_reduce(mean_loss)  # the global batch's mean: each rank holds half of it
        mean_loss = float(mean_loss) / world_size
        clock.end(step, len(data.train), mean_loss, lr)
        last = steps_per_epoch - 1
        evaluations.at_epoch_end(
            peer_tick(epoch, last, steps_per_epoch, step, config, batch, len(sampler))
        )
    return device, clock.records, evaluations.records


class _EpochBatches:
    """The sample ids of each of the rank's batches this epoch, in the sampler's order (the
    sampler's `set_epoch` reshuffles them)."""

    def __init__(self, sampler: torch.utils.data.Sampler, batch: int) -> None:
        self.sampler, self.batch = sampler, batch

    def __iter__(self):
        order = list(self.sampler)
        for start in range(0, len(order), self.batch):
            yield order[start : start + self.batch]

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch)


class _FetchBatch(torch.utils.data.Dataset):
    """A batch of samples by their ids: decoded in a loader worker, as the trainer's are."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, ids):
        return self.dataset.fetch(ids)

    def __len__(self) -> int:
        return len(self.dataset)


def _loader(data: DataBundle, sampler, batch: int, compute: PeerMath):
    """The DataLoader a timm user writes: workers decoding batches (as many as the trainer
    starts; none for in-memory tensors, which it does not decode either), pinned on a GPU."""
    workers = 0 if isinstance(data.train, TensorSampleDataset) else compute.loader_workers
    return torch.utils.data.DataLoader(
        _FetchBatch(data.train),
        batch_size=None,
        sampler=_EpochBatches(sampler, batch),
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=compute.pin_memory,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m pipetransformer.compare.peers NAME CONFIG --run-dir DIR [key=value ...]`: one
    peer's run in its own processes, as `pipetransformer train` runs one (benchmarks/)."""
    import argparse

    from pipetransformer.config import load_config
    from pipetransformer.launcher import launch_local
    from pipetransformer.utils.logging import setup_logging

    parser = argparse.ArgumentParser(prog="python -m pipetransformer.compare.peers")
    parser.add_argument("name", choices=[HF_TRAINER, TORCH_DDP])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument(
        "--hf-optim",
        default=None,
        help="the Trainer's optim (default: TrainingArguments' own, adamw_torch_fused on "
        "torch >= 2.8; adamw_torch is the per-parameter loop)",
    )
    parser.add_argument(
        "--hf-collator",
        default="padding",
        choices=["padding", "flattening"],
        help="DataCollatorWithPadding (default) or DataCollatorWithFlattening (refused where "
        "the model cannot keep a row's samples apart)",
    )
    parser.add_argument(
        "--hf-callback",
        default=None,
        choices=HF_CALLBACKS,
        help="hf_trainer with this project's FreezeCallback: 'freeze' (the config's freeze "
        "section as its keys) or 'embedding' (the embedding frozen, no layer)",
    )
    args = parser.parse_args(argv)
    setup_logging(0)
    config = load_config(args.config, args.overrides)
    if args.name == HF_TRAINER and args.hf_collator == "flattening":
        reason = flattening_refusal(meta_text_model(config))
        if reason is not None:  # one line, before any process starts
            parser.exit(2, f"{HF_TRAINER} with DataCollatorWithFlattening: refused: {reason}\n")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "metrics.jsonl", "events.jsonl"):
        (args.run_dir / stale).unlink(missing_ok=True)
    if args.hf_callback is not None:
        if args.name != HF_TRAINER:
            parser.exit(2, f"--hf-callback: a callback of {HF_TRAINER}, not of {args.name}\n")
        freeze_callback(config, args.hf_callback)  # its keys checked before any process starts
    launch_local(
        config.nproc_per_node,
        run_peer,
        (args.name, config, args.run_dir, args.hf_optim, args.hf_collator, args.hf_callback),
    )
    summary = RunSummary.from_dict(json.loads((args.run_dir / "summary.json").read_text()))
    print(summary.closing_line(str(args.run_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
