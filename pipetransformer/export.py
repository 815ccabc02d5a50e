"""Export: a run's trained model, taken from one of its checkpoints, in the format its own
library loads (transformers `from_pretrained` for BERT, `timm.create_model` for ViT).

The model is rebuilt on the meta device from the config and build arguments the checkpoint
recorded (no weights are initialised or downloaded), materialised empty, and filled with
every unit's tensors from the checkpoint, frozen layers included. One process, no
torch.distributed: `pipetransformer export` runs anywhere the run directory is readable.

Owns: that assembly. Must not: know a library's file format (the model adapters do).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from pipetransformer.config import Config, config_from_dict
from pipetransformer.data import image_normalization, label_names
from pipetransformer.models import ExportInfo, LayeredModel, build_model, export_model, materialize
from pipetransformer.runs.checkpoint import find_checkpoint, read_run_state
from pipetransformer.runs.state import CheckpointRecord, model_key
from pipetransformer.utils.units import param_key

logger = logging.getLogger(__name__)


def load_trained_model(
    run_dir: str | Path, which: str = "latest"
) -> tuple[LayeredModel, Config, Path, CheckpointRecord]:
    """The model of a run's `latest` or `best` checkpoint, in eval mode on the CPU, with its
    config, the checkpoint and its record."""
    run_dir = Path(run_dir)
    checkpoint = find_checkpoint(run_dir, which)
    if checkpoint is None:
        raise FileNotFoundError(f"{run_dir}: no {which} checkpoint under {run_dir / 'checkpoints'}")
    record = read_run_state(checkpoint)
    config = config_from_dict(record.config)
    # Weights come from the checkpoint: build the structure only.
    model_config = dataclasses.replace(config.model, pretrained=False, checkpoint_path=None)
    model = materialize(build_model(model_config, device="meta", **record.model.build_args))
    destinations = {}
    for index, unit in enumerate(model.units):
        for name, tensor in [*unit.named_parameters(), *unit.named_buffers()]:
            destinations[model_key(param_key(index, name))] = tensor.detach()
    covered = {t.untyped_storage().data_ptr() for t in destinations.values()}
    missing = [
        n
        for n, p in model.source.named_parameters()
        if p.untyped_storage().data_ptr() not in covered
    ]
    if missing:  # an adapter that leaves parameters outside its units would export garbage
        raise RuntimeError(f"parameters outside every unit: {missing[:5]}")
    with torch.no_grad(), warnings.catch_warnings():
        # One process by design: DCP's "assuming the intent is to load in a single process".
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(destinations, storage_reader=dcp.FileSystemReader(str(checkpoint)), no_dist=True)
    model.eval()
    return model, config, checkpoint, record


def export_run(
    run_dir: str | Path, out_dir: str | Path, which: str = "latest"
) -> tuple[Path, list[str]]:
    """Write the model of the run's `which` checkpoint to `out_dir`; returns (the checkpoint
    exported, the files written)."""
    model, config, checkpoint, record = load_trained_model(run_dir, which)
    build = record.model.build_args
    normalization = image_normalization(config.data)
    info = ExportInfo(
        tokenizer=config.data.tokenizer or config.model.model_name_or_path,
        # What timm.create_model was given (recorded explicitly: older timm does not infer it).
        model_args={
            **config.model.kwargs,
            "num_classes": build["num_classes"],
            "in_chans": build["in_chans"],
            "img_size": build["image_size"],
        },
        image_mean=normalization.mean if normalization else None,
        image_std=normalization.std if normalization else None,
        interpolation=normalization.interpolation if normalization else "bilinear",
        crop_pct=normalization.crop_pct if normalization else 1.0,
        pretrained=config.model.pretrained and config.model.checkpoint_path is None,
        labels=label_names(config.data) if build["task"] == "classification" else None,
    )
    files = export_model(model, out_dir, info)
    # debug: the command line says it, once (`export`, and `train` with trainer.save_model)
    logger.debug("exported %s to %s: %s", checkpoint, out_dir, ", ".join(files))
    return checkpoint, files
