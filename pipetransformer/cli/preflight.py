"""Checks that need more than the config itself, run before any worker starts (`train`,
`compare`): the devices, the data (fetched once, local files parsed), the model built on
the meta device, a classifier head against the data's labels and the metric against the
task. A mistake is one ConfigError line naming the key or the file, not a stack trace from
each of N workers.

Owns: `preflight` and its checks. Must not: start a process or write a run directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipetransformer.config import Config, ConfigError


def preflight(config: Config) -> Config:
    """Checks that need more than the config itself, before any worker starts; raise
    ConfigError naming the key or the file. Fetches datasets from the network (once: the
    workers find them on disk) and parses local data files, so bad contents are one line
    here rather than one traceback per worker. Returns the config the run is to train
    with: `config` with the label names and task of a data.name 'hf' or 'hf_image' table
    written in (data.labels, data.task), so the run keeps them."""
    import dataclasses

    from pipetransformer.data.checks import check_data_config
    from pipetransformer.data.fetch import fetch_data
    from pipetransformer.data.validate import validate_data_files
    from pipetransformer.planning import describe_model

    check_devices(config)
    check_data_config(config.data)
    labelled = config.data.name in ("hf", "hf_image")  # its head's size is read from the data
    if not labelled:
        # builds the model on the meta device: bad names/kwargs fail here
        check_virtual_stages_fit(config, describe_model(config).num_units)
    fetch_data(config.data)
    config = dataclasses.replace(config, data=validate_data_files(config.data))
    if labelled:
        check_head_fits_labels(config)
        check_virtual_stages_fit(config, describe_model(config).num_units)
    check_metric_fits_classes(config)
    return config


def resolve_model_settings(config: Config) -> tuple[Config, list[str], list[str]]:
    """Settings a run takes from its model where the config leaves them unset, after the
    preflight: the config with them, the same as overrides (every variant of a comparison
    loads its config again), and the notes its start line gives. A pretrained timm model's
    own input size becomes data.image_size (the quickstart's digits would reach it at 16
    pixels otherwise); one's own images say the size they are resized to."""
    import dataclasses

    from pipetransformer.data.checks import data_facts
    from pipetransformer.models import pretrained_image_size

    model, data = config.model, config.data
    if model.resolved_family() != "vit":
        return config, [], []
    own = pretrained_image_size(model.name) if model.pretrained else None
    if own is not None and data.image_size is None:
        resolved = dataclasses.replace(config, data=dataclasses.replace(data, image_size=own))
        note = f"data.image_size {own} ({model.name}'s pretrained input size)"
        return resolved, [f"data.image_size={own}"], [note]
    if own is not None and data.image_size != own:
        note = (
            f"data.image_size {data.image_size}, where {model.name} was pretrained at {own} "
            "(timm resamples its position embeddings)"
        )
        return config, [], [note]
    if data.name in ("hf_image", "imagefolder") and data.image_size is None:
        size = data_facts(data).image_size
        return config, [], [f"data.image_size {size}: your images are resized to {size}x{size}"]
    return config, [], []


def check_virtual_stages_fit(config: Config, num_units: int) -> None:
    """A configured pipeline.virtual_stages must fit the model's active units at a configured
    pipeline.initial_pipe_len (ConfigError naming the key; later layouts fall back to fewer
    chunks). With initial_pipe_len 'auto' the workers check it at the length they choose."""
    from pipetransformer.planning.context import check_virtual_stages

    if isinstance(config.pipeline.initial_pipe_len, int):
        check_virtual_stages(config, num_units, config.pipeline.initial_pipe_len)


def check_metric_fits_classes(config: Config) -> None:
    """data.metric must score the data's task (pearson/spearman a regression, the others a
    classifier), and 'f1' is binary F1 (of class 1): two classes; else a ConfigError."""
    from pipetransformer.config import REGRESSION_METRICS
    from pipetransformer.data.checks import data_facts

    facts = data_facts(config.data)
    metric = config.data.metric
    if metric == "auto":
        return
    if facts.task not in ("classification", "regression") or (
        (metric in REGRESSION_METRICS) != (facts.task == "regression")
    ):
        choices = "pearson, spearman" if facts.task == "regression" else "accuracy, f1_macro, mcc"
        raise ConfigError(f"data.metric: '{metric}' does not score a {facts.task} ({choices})")
    if metric == "f1" and facts.num_classes != 2:
        names = config.data.label_names
        raise ConfigError(
            f"data.metric: 'f1' is binary F1; the data has {facts.num_classes} classes"
            f"{f' {names}' if names else ''}: use f1_macro (or accuracy, mcc)"
        )


def check_head_fits_labels(config: Config) -> None:
    """A classifier head the model config fixes (model.kwargs num_labels or id2label, timm's
    num_classes, or a fine-tuned sequence-classification checkpoint) must have one output
    per label."""
    labels = config.data.label_names or []
    kwargs = config.model.kwargs
    sizes = []
    for key in ("num_labels", "num_classes"):
        if key in kwargs:
            sizes.append((f"model.kwargs.{key}", int(kwargs[key])))
    if "id2label" in kwargs:
        sizes.append(("model.kwargs.id2label", len(kwargs["id2label"])))
    path = config.model.model_name_or_path
    saved = Path(path).expanduser() / "config.json" if path else None
    if saved is not None and saved.is_file():
        fields = json.loads(saved.read_text())
        fine_tuned = any(
            a.endswith("ForSequenceClassification") for a in fields.get("architectures") or []
        )
        if fine_tuned and "id2label" in fields:
            sizes.append((f"model.model_name_or_path ({saved})", len(fields["id2label"])))
    regression = config.data.task == "regression"
    for key, size in sizes:
        if regression and size != 1:
            raise ConfigError(f"{key}: a head of {size} outputs, but a regression has one")
        if not regression and size != len(labels):
            raise ConfigError(
                f"{key}: a head of {size} outputs, but the data has {len(labels)} labels "
                f"{labels} (data.labels, or the training split's)"
            )


def check_devices(config: Config) -> None:
    """More processes on a node than visible GPUs would put two ranks on one GPU, which NCCL
    refuses (raises ConfigError naming trainer.nproc_per_node); bf16 on a GPU older than
    Ampere (the paper's Turing Quadro) is emulated or refused (ConfigError naming
    trainer.precision)."""
    import torch

    from pipetransformer.trainer.distributed import (
        check_visible_gpus,
        cuda_unusable_reason,
        uses_cuda,
    )

    if config.trainer.device == "cuda" and not torch.cuda.is_available():
        reason = cuda_unusable_reason() or "no GPU is visible"
        raise ConfigError(
            f"trainer.device: 'cuda' but CUDA is unusable here ({reason}); set "
            "trainer.device=cpu to train on CPU processes"
        )
    if config.trainer.device != "cpu" and uses_cuda(config.trainer.device):
        check_visible_gpus(config.nproc_per_node, torch.cuda.device_count())
        major, minor = torch.cuda.get_device_capability(0)
        if config.trainer.precision == "bf16" and major < 8:  # bfloat16 needs Ampere or later
            raise ConfigError(
                f"trainer.precision: bf16 but {torch.cuda.get_device_name(0)} (compute "
                f"capability {major}.{minor}) has no bfloat16 support; set "
                "trainer.precision=fp16 or fp32"
            )
