"""Turning a config's `auto` settings into values for the world a run has.

Owns: World (the processes, per node, and the device type) and resolve, which returns a new
config (what RUN_DIR/config.yaml records), resolve_padding (data.padding for a model that
cannot run packed batches), and the settings a run decides from measured time. Must not:
import anything outside config/ or look at the machine itself (the launcher builds the
World).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipetransformer.config.checks import check_config
from pipetransformer.config.errors import _fail
from pipetransformer.config.run import Config


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


def resolve_padding(config: Config, packed_refusal: str | None) -> tuple[Config, str | None]:
    """data.padding for a model whose units cannot run a packed batch (`packed_refusal`: why,
    from models/packed.py; None: they can). 'auto' becomes 'batch' (per-batch padding), with
    the note the start line gives; 'packed' is a ConfigError naming the key. Returns the
    config (itself where nothing changes) and the note (None)."""
    if packed_refusal is None or config.data.padding not in ("packed", "auto"):
        return config, None
    if config.data.padding == "packed":
        _fail("data.padding", f"'packed' needs attention confined to each sample: {packed_refusal}")
    data = dataclasses.replace(config.data, padding="batch")
    note = f"data.padding auto: per-batch padding ({packed_refusal})"
    return dataclasses.replace(config, data=data), note


def decided_by_measured_time(config: Config) -> list[str]:
    """The settings a run of `config` decides from times it measures ('measured', opt-in):
    what may differ between an idle and a busy machine. Empty: the same config and seed
    make the same decisions anywhere."""
    settings = {
        "pipeline.num_micro_batches": config.pipeline.num_micro_batches,
        "freeze.interval_steps": config.freeze.interval_steps,
    }
    return [key for key, value in settings.items() if value == "measured"]
