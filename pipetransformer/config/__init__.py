"""Typed run configuration: YAML in, checked dataclasses out.

Owns: one small dataclass per component, each in its own module with the checks of its keys
(trainer.py, optimizer.py, pipeline.py, freeze.py, autopipe.py for AutoPipe and AutoDP,
cache.py, checkpoint.py, model.py, data.py, logging.py), the Config that holds them
(run.py), what each pipeline schedule needs of a layout (schedules.py: torch's rules, the
chunks a rank holds), the checks across sections (checks.py), the YAML loader and `key.sub=value`
overrides (loader.py) and `resolve` (resolve.py): every check that can be made before a
process starts, each error naming the key. Callers import from here, not from the modules.
Must not: import any other part of the package (it is the bottom layer), touch torch.
"""

from pipetransformer.config.autopipe import AutoDPConfig, AutoPipeConfig
from pipetransformer.config.cache import CacheConfig
from pipetransformer.config.checkpoint import CheckpointConfig
from pipetransformer.config.checks import (
    check_config,
    check_model_path,
    frozen_random_embedding,
    initial_pipe_lens,
    pipe_len_candidates,
    random_embedding_warning,
    reachable_pipe_lens,
    split_backward_compile_problem,
)
from pipetransformer.config.data import (
    REGRESSION_METRICS,
    TABLE_DATASETS,
    TEXT_DATASETS,
    DataConfig,
    DatasetName,
    MetricName,
)
from pipetransformer.config.errors import ConfigError
from pipetransformer.config.freeze import FreezeConfig
from pipetransformer.config.loader import (
    WHEN_PRETRAINED,
    apply_overrides,
    config_changes,
    config_from_dict,
    config_yaml,
    load_config,
    parse_override,
    pretrained_settings,
    read_config_data,
    section_from_dict,
)
from pipetransformer.config.logging import LoggingConfig
from pipetransformer.config.model import TEXT_MODEL_TYPES, ModelConfig, looks_like_path
from pipetransformer.config.optimizer import OptimizerConfig
from pipetransformer.config.pipeline import PipelineConfig
from pipetransformer.config.resolve import (
    World,
    decided_by_measured_time,
    resolve,
    resolve_padding,
)
from pipetransformer.config.run import Config
from pipetransformer.config.schedules import (
    AUTO_VIRTUAL_STAGES,
    MULTI_CHUNK_SCHEDULES,
    SCHEDULE_PROPERTIES,
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    TORCH_SCHEDULE_CLASS,
    ScheduleName,
    ScheduleProperties,
    layout_schedule,
    micro_batch_problem,
    smallest_micro_batches,
    virtual_stages_for,
    virtual_stages_problem,
)
from pipetransformer.config.trainer import TrainerConfig

__all__ = [
    "AUTO_VIRTUAL_STAGES",
    "MULTI_CHUNK_SCHEDULES",
    "REGRESSION_METRICS",
    "SCHEDULES",
    "SCHEDULE_PROPERTIES",
    "SPLIT_BACKWARD_SCHEDULES",
    "TABLE_DATASETS",
    "TEXT_DATASETS",
    "TEXT_MODEL_TYPES",
    "TORCH_SCHEDULE_CLASS",
    "WHEN_PRETRAINED",
    "AutoDPConfig",
    "AutoPipeConfig",
    "CacheConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DatasetName",
    "FreezeConfig",
    "LoggingConfig",
    "MetricName",
    "ModelConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "ScheduleName",
    "ScheduleProperties",
    "TrainerConfig",
    "World",
    "apply_overrides",
    "check_config",
    "check_model_path",
    "frozen_random_embedding",
    "config_changes",
    "config_from_dict",
    "config_yaml",
    "decided_by_measured_time",
    "initial_pipe_lens",
    "layout_schedule",
    "load_config",
    "looks_like_path",
    "micro_batch_problem",
    "parse_override",
    "pretrained_settings",
    "pipe_len_candidates",
    "read_config_data",
    "section_from_dict",
    "random_embedding_warning",
    "reachable_pipe_lens",
    "split_backward_compile_problem",
    "resolve",
    "resolve_padding",
    "smallest_micro_batches",
    "virtual_stages_for",
    "virtual_stages_problem",
]
