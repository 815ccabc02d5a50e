"""Profiling as part of setup and transitions: measured unit costs and the micro-batch count.

Every rank takes part (the measurements run collectives), and every rank must decide the
same: rank 0 loads the profile file and broadcasts it, measurements are reduced over the
control group, and only rank 0 writes the file back.

Unit costs are measured once per (model, device, micro-batch size): at setup each rank
times the units u with u % world_size == rank from the full model it has just built, and
the pieces are gathered. The micro-batch count ('auto') is measured the first time a
layout (K, replica batch) is seen: a few forward+backward steps per candidate M on a fixed
batch, without an optimizer step, RNG use or gradients left behind; the slowest rank's
time is the layout's time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pipetransformer.autopipe.profiles import ProfileStore, UnitProfile, choose_micro_batches
from pipetransformer.config import Config
from pipetransformer.models import ModelSpec
from pipetransformer.pipe.measure import measure_unit_costs, time_schedule_steps
from pipetransformer.planning.profile_keys import (
    device_type_for,
    micro_batch_candidates,
    micro_batch_key_for,
    profile_path_for,
    unit_profile_key_for,
)
from pipetransformer.trainer.control import Control

logger = logging.getLogger(__name__)

PROFILE_WARMUP_STEPS = 1
PROFILE_STEPS = 3


class RunProfiler:
    def __init__(
        self,
        config: Config,
        spec: ModelSpec,
        run_dir,
        device: torch.device,
        control: Control,
        carried: Path | None = None,
    ) -> None:
        """`carried`: a profile file to take measurements from too (a checkpoint's copy), so
        that a resumed run reuses what its earlier attempts measured."""
        self.config = config
        self.spec = spec
        self.rank = control.rank
        self.world_size = control.size
        self.device = device
        self.control = control
        self.device_type = device_type_for(device)
        self.path = profile_path_for(config, run_dir)
        store = None
        if self.rank == 0:
            store = ProfileStore(self.path).load()
            if carried is not None and carried.is_file():
                store.update(ProfileStore(carried).load())
        self.store: ProfileStore = control.broadcast(store)
        self.seconds = 0.0  # time spent measuring (not reading) since the last take()

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _save(self) -> None:
        if self.rank == 0:
            self.store.save()

    # ------------------------------------------------------------------ unit costs

    def unit_profile(self, units: list[nn.Module], micro: int) -> UnitProfile:
        """Measured per-unit times and bytes of the whole model at micro-batch size `micro`,
        from the profile file when it has them (collective). `units`: every unit."""
        key = unit_profile_key_for(self.config, self.spec, self.device_type, micro)
        profile = self.store.unit_profile(key)
        if profile is None:
            start = time.perf_counter()
            mine = {u: units[u] for u in range(len(units)) if u % self.world_size == self.rank}
            on_device = {u: unit.to(self.device) for u, unit in mine.items()}
            name = self.config.trainer.autocast_dtype
            measured = measure_unit_costs(
                on_device,
                self.spec,
                micro,
                self.device,
                autocast_dtype=getattr(torch, name) if name else None,
            )
            for unit in mine.values():
                unit.to("cpu")
            gathered = self.control.all_gather(measured)
            merged = {u: m for part in gathered for u, m in part.items()}
            profile = UnitProfile.from_measurements(merged, micro)
            self.store.put_unit_profile(key, profile)
            self._save()
            self.seconds += time.perf_counter() - start
            logger.info(
                "measured %d unit costs at micro-batch %d in %.2f s",
                len(merged),
                micro,
                time.perf_counter() - start,
            )
        else:
            logger.info("unit costs from %s", self.store.path)
        return profile

    # ------------------------------------------------------------------ micro-batches

    def micro_batches(
        self, pipe_len: int, replica_batch: int, measure_step: Callable[[int], Callable[[], None]]
    ) -> int:
        """The fastest M for this layout, measured the first time it is seen (collective).

        `measure_step(m)` returns a function running one forward+backward step of this
        rank's part of the layout with m micro-batches (a no-op on an idle rank).
        """
        candidates = micro_batch_candidates(self.config, pipe_len, replica_batch)
        key = micro_batch_key_for(self.config, self.spec, self.device_type, pipe_len, replica_batch)
        timings = self.store.micro_batch_timings(key)
        missing = [m for m in candidates if m not in timings]
        if missing:
            start = time.perf_counter()
            for m in missing:
                step = measure_step(m)
                with torch.random.fork_rng(
                    devices=[self.device] if self.device.type == "cuda" else []
                ):
                    local = time_schedule_steps(
                        step, PROFILE_STEPS, PROFILE_WARMUP_STEPS, self.device
                    )
                timings[m] = float(self.control.all_max([local])[0])
                del step  # this trial's runtime goes before the next one is built
            self.store.put_micro_batch_timings(key, {m: timings[m] for m in missing})
            self._save()
            self.seconds += time.perf_counter() - start
            logger.info(
                "micro-batch timings for pipe_len %d, replica batch %d: %s",
                pipe_len,
                replica_batch,
                ", ".join(f"M={m}: {timings[m] * 1000:.1f} ms" for m in candidates),
            )
        return choose_micro_batches({m: timings[m] for m in candidates}, candidates)
