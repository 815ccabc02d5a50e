"""timm image models: building one by name, the spec every image adapter shares, and export.

Owns: `create_timm_model` (random init, timm's pretrained loader, or a local checkpoint),
`image_spec`, and export as a timm hub directory whose config.json carries the run's own
preprocessing, so `timm.create_model("local-dir:...", pretrained=True)` +
`resolve_data_config` + `create_transform` reproduce what the run trained and evaluated on.
Must not: know any family's internals (the adapters do), pipelines, freezing or ranks.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from pipetransformer.models.layered import (
    LayeredModel,
    ModelSpec,
    TensorSpec,
    count_params,
    layer_unit_names,
)
from pipetransformer.models.registry import ExportInfo, ModelAdapter, adapter_for_timm_class

logger = logging.getLogger(__name__)

# pretrained_cfg fields that describe where pretrained weights came from: an export of a
# model trained from scratch has none of them.
_PROVENANCE = (
    "tag",
    "license",
    "hf_hub_id",
    "hf_hub_filename",
    "url",
    "file",
    "source",
    "paper_ids",
    "paper_name",
    "notes",
    "origin_url",
    "architecture_tag",
)


# timm constructor arguments that change a named architecture's weights (their shapes, or
# what a weight means: a head count splits the same matrices differently). Pretrained
# weights of the named model fit none of them but their own values.
TIMM_ARCHITECTURE_KWARGS = (
    "patch_size",
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
    "qkv_bias",
    "class_token",
    "reg_tokens",
    "no_embed_class",
    "pre_norm",
    "fc_norm",
)


def pretrained_image_size(name: str) -> int | None:
    """The image size a timm model's pretrained weights were trained at (its
    pretrained_cfg, without downloading anything); None where timm has no such record."""
    try:
        cfg = timm.models.get_pretrained_cfg(name)
    except (RuntimeError, ValueError):
        return None
    return int(cfg.input_size[-1]) if cfg is not None and cfg.input_size else None


def check_kwargs_fit_pretrained(name: str, kwargs: dict[str, Any]) -> None:
    """model.kwargs that change a pretrained timm model's architecture: its weights would
    not load (or load into a model they were not trained for); refused in one line."""
    changed = [key for key in TIMM_ARCHITECTURE_KWARGS if key in kwargs]
    if changed:
        raise ValueError(
            f"model.kwargs: {', '.join(changed)} would change {name}'s architecture, which its "
            "pretrained weights (model.pretrained) do not fit; drop them (the override "
            "model.kwargs={}) or set model.pretrained=false"
        )


def create_timm_model(
    name: str,
    *,
    num_classes: int,
    in_chans: int,
    img_size: int,
    pretrained: bool = False,
    checkpoint_path: str | None = None,
    kwargs: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, ModelAdapter]:
    """A timm model by name and the adapter that cuts it; `kwargs` override the named
    architecture (depth, embed_dim...)."""
    if pretrained:
        check_kwargs_fit_pretrained(name, kwargs or {})
    options = {"num_classes": num_classes, "in_chans": in_chans, "img_size": img_size}
    options.update(kwargs or {})
    if checkpoint_path is not None and not Path(checkpoint_path).is_file():
        raise FileNotFoundError(f"model.checkpoint_path: no such file: {checkpoint_path}")
    try:
        with torch.device(device):
            model = timm.create_model(name, pretrained=pretrained and device != "meta", **options)
    except RuntimeError as exc:
        if "Unknown model" in str(exc):
            raise ValueError(f"model.name: timm has no model named '{name}'") from exc
        raise
    except TypeError as exc:
        raise ValueError(f"model.kwargs: {exc}") from exc
    adapter = adapter_for_timm_class(type(model))
    if adapter is None:
        raise ValueError(
            f"model.name: '{name}' is a timm {type(model).__name__}, which no adapter cuts "
            "(VisionTransformer, VisionTransformerDistilled, Eva, Beit; docs/models.md adds one)"
        )
    if checkpoint_path is not None and device != "meta":
        # What create_model(checkpoint_path=...) does, but never unpickling arbitrary objects:
        # timm before 1.0.31 loads with weights_only=False by default.
        timm.models.load_checkpoint(model, checkpoint_path, weights_only=True)
    return model, adapter


def image_spec(
    *,
    family: str,
    model: nn.Module,
    units: Sequence[nn.Module],
    num_tokens: int,
    extra_activations: Sequence[TensorSpec] = (),
) -> ModelSpec:
    """The spec of a timm image classifier: input (in_chans, H, W), activations (tokens,
    embed_dim) plus `extra_activations`, output (num_classes,), in the weights' dtype."""
    in_chans = model.patch_embed.proj.in_channels
    height, width = model.patch_embed.img_size
    dtype = model.patch_embed.proj.weight.dtype
    num_layers = (len(units) - 2) // 2
    return ModelSpec(
        family=family,
        task="classification",
        num_layers=num_layers,
        unit_names=layer_unit_names(num_layers),
        unit_param_counts=tuple(count_params(u) for u in units),
        input_specs=(TensorSpec((in_chans, height, width), dtype),),
        activation_specs=(TensorSpec((num_tokens, model.embed_dim), dtype), *extra_activations),
        output_spec=TensorSpec((model.num_classes,), dtype),
    )


def export_timm_model(model: LayeredModel, out_dir: Path, info: ExportInfo) -> list[str]:
    """Write the model as timm writes a hub checkpoint: model.safetensors (what
    `timm.create_model(name, checkpoint_path=...)` loads, with the run's model kwargs) and
    config.json (architecture, `model_args`: what create_model was given, and a
    pretrained_cfg with the run's preprocessing: mean/std per channel, input size,
    interpolation, crop 1.0, class count). A model trained from scratch carries no
    pretrained tag or licence; a fine-tuned one keeps its source checkpoint's. Returns the
    files written."""
    from timm.models import save_for_hf

    in_chans, height, width = model.spec.input_specs[0].shape
    data_config: dict[str, Any] = {
        "input_size": (in_chans, height, width),
        "interpolation": info.interpolation,
        "crop_pct": info.crop_pct,
    }
    if info.image_mean is not None:
        data_config["mean"] = tuple(info.image_mean)
        data_config["std"] = tuple(info.image_std)
    # Newer timm resolves the preprocessing it writes (and warns about a mean whose channels
    # do not match the model's, unless given the run's); older timm copies the source
    # checkpoint's. Either way the run's values are written below.
    options = {}
    if "data_config" in inspect.signature(save_for_hf).parameters:
        options["data_config"] = data_config
    save_for_hf(
        model.source,
        str(out_dir),
        model_args=dict(info.model_args),
        safe_serialization=True,
        **options,
    )
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    pretrained_cfg = config["pretrained_cfg"]
    if not info.pretrained:
        for key in _PROVENANCE:
            pretrained_cfg.pop(key, None)
    for key in ("test_input_size", "test_crop_pct"):  # recommendations for the source weights
        pretrained_cfg.pop(key, None)
    pretrained_cfg.update(
        {k: list(v) if isinstance(v, tuple) else v for k, v in data_config.items()}
    )
    pretrained_cfg["num_classes"] = model.spec.output_spec.shape[0]
    if info.labels is not None:
        pretrained_cfg["label_names"] = list(info.labels)
    config_path.write_text(json.dumps(config, indent=2))
    return sorted(p.name for p in out_dir.iterdir())
