"""A run's whole configuration: one section per component, and the values derived across
sections (the processes per node, AutoCache's storage dtype).

Owns: Config (the sections a YAML file has, in order) and its dict form. Must not: check
across sections (checks.py) or read files (loader.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipetransformer.config.autopipe import AutoDPConfig, AutoPipeConfig
from pipetransformer.config.cache import CacheConfig
from pipetransformer.config.checkpoint import CheckpointConfig
from pipetransformer.config.data import DataConfig
from pipetransformer.config.freeze import FreezeConfig
from pipetransformer.config.logging import LoggingConfig
from pipetransformer.config.model import ModelConfig
from pipetransformer.config.optimizer import OptimizerConfig
from pipetransformer.config.pipeline import PipelineConfig
from pipetransformer.config.trainer import TrainerConfig


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

    @property
    def names_pretrained_weights(self) -> bool:
        """Whether the model is a named pretrained one (model.model_name_or_path, or
        model.pretrained with a timm name), whose architecture and weights come with it: what
        a config's when_pretrained settings apply to (config/loader.py)."""
        return bool(self.model.pretrained or self.model.model_name_or_path)

    @property
    def starts_from_trained_weights(self) -> bool:
        """Whether the model's weights are loaded rather than random: pretrained weights
        (model.model_name_or_path, model.pretrained) or a checkpoint (model.checkpoint_path)."""
        return self.names_pretrained_weights or bool(self.model.checkpoint_path)

    @property
    def embedding_frozen(self) -> bool:
        """Whether the embedding is frozen from the start (freeze.embedding with 'auto'
        resolved): never for the baseline (strategy 'none' trains everything); for 'auto',
        where the model starts from trained weights."""
        if self.freeze.strategy == "none":
            return False
        if self.freeze.embedding == "auto":
            return self.starts_from_trained_weights
        return self.freeze.embedding

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.trainer.batch_per_replica is not None:  # not used, and refused beside it
            del data["trainer"]["global_batch_size"]
        return data
