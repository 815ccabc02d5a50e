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
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pipetransformer.autodp.control import Control
from pipetransformer.autopipe.profiles import ProfileStore, UnitProfile, choose_micro_batches
from pipetransformer.config import Config
from pipetransformer.models import ModelSpec
from pipetransformer.pipe.measure import (
    measure_unit_costs,
    relative_spread,
    time_schedule_samples,
)
from pipetransformer.planning.profile_keys import (
    device_type_for,
    micro_batch_candidates,
    micro_batch_key_for,
    profile_path_for,
    unit_profile_key_for,
)

logger = logging.getLogger(__name__)

PROFILE_WARMUP_STEPS = 1
PROFILE_STEPS = 3
# Repeats of one timing that differ by more than this share of their median (and by more
# than NOISY_MIN_S: a timer's jitter on a sub-millisecond step is not load) were taken under
# load (another job on the machine): measured again, and not kept if they still do.
NOISY_SPREAD = 0.5
NOISY_MIN_S = 0.002


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

    # ------------------------------------------------------------------ links

    def links(self) -> dict[str, list[float] | float]:
        """What the planner prices a sharded layout against a pipeline with
        (pipeline.sharding 'auto'), measured on the default group (NCCL on GPUs): FSDP2's
        all-gather and reduce-scatter and DDP's all-reduce, each a line (latency s, bytes/s of
        the whole tensor) through the medians of 3 calls at 4 and 16 MiB, and the device's
        memory bandwidth (a copy; the optimizer's step). The slowest rank's figures,
        identical on every rank (collective)."""
        import torch.distributed as dist

        start = time.perf_counter()
        world = dist.get_world_size()
        sizes = (4 * 2**20, 16 * 2**20)  # bytes of the whole tensor
        medians: dict[str, list[float]] = {}
        for size in sizes:
            numel = size // 4 // world * world
            full = torch.ones(numel, device=self.device)
            shard = torch.ones(numel // world, device=self.device)
            calls = {
                "all_gather": lambda f=full, s=shard: dist.all_gather_single(f, s),
                "reduce_scatter": lambda f=full, s=shard: dist.reduce_scatter_single(s, f),
                "all_reduce": lambda f=full: dist.all_reduce(f),
                "copy": lambda f=full, s=shard: f.copy_(torch.cat([s] * world)),
            }
            for name, call in calls.items():
                seconds = []
                for _ in range(4):  # the first call of each warms up
                    self.control.barrier()
                    began = time.perf_counter()
                    call()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    seconds.append(time.perf_counter() - began)
                medians.setdefault(name, []).append(statistics.median(seconds[1:]))
        names = list(medians)
        slowest = self.control.all_max([t for name in names for t in medians[name]]).tolist()
        costs: dict[str, list[float] | float] = {}
        for i, name in enumerate(names):
            small, large = slowest[2 * i], slowest[2 * i + 1]
            per_byte = max(1e-15, (large - small) / (sizes[1] - sizes[0]))
            costs[name] = [max(0.0, small - per_byte * sizes[0]), 1.0 / per_byte]
        # The copy reads and writes its bytes (and the cat made them once more).
        costs["memory_bytes_per_s"] = 3 * costs.pop("copy")[1]
        self.seconds += time.perf_counter() - start
        logger.info(
            "collectives for sharded layouts: all-gather %.2f GB/s, reduce-scatter %.2f GB/s, "
            "all-reduce %.2f GB/s (of the whole tensor), memory %.1f GB/s",
            costs["all_gather"][1] / 1e9,
            costs["reduce_scatter"][1] / 1e9,
            costs["all_reduce"][1] / 1e9,
            costs["memory_bytes_per_s"] / 1e9,
        )
        return costs

    # ------------------------------------------------------------------ micro-batches

    def _time_steps(self, step: Callable[[], None], steps: int) -> tuple[float, float]:
        """The slowest rank's median step and the largest relative spread of repeats (0
        below NOISY_MIN_S; collective: every rank gets the same two numbers)."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            samples = time_schedule_samples(step, steps, PROFILE_WARMUP_STEPS, self.device)
        spread = relative_spread(samples) if max(samples) - min(samples) > NOISY_MIN_S else 0.0
        median, spread = self.control.all_max([statistics.median(samples), spread]).tolist()
        return median, spread

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
        noisy: dict[int, float] = {}
        if missing:
            start = time.perf_counter()
            for m in missing:
                step = measure_step(m)
                timings[m], spread = self._time_steps(step, PROFILE_STEPS)
                if spread > NOISY_SPREAD:  # measured again, twice as long
                    timings[m], spread = self._time_steps(step, 2 * PROFILE_STEPS)
                    if spread > NOISY_SPREAD:
                        noisy[m] = spread
                del step  # this trial's runtime goes before the next one is built
            # A measurement whose repeats disagree this much was taken under load: used for
            # this layout now, but not kept for later layouts and runs to reuse.
            kept = {m: timings[m] for m in missing if m not in noisy}
            if kept:
                self.store.put_micro_batch_timings(key, kept)
                self._save()
            self.seconds += time.perf_counter() - start
            if noisy and self.rank == 0:
                logger.warning(
                    "micro-batch timings for pipe_len %d look taken under load (repeats differ "
                    "by %s): used now, not kept; pin pipeline.num_micro_batches for runs that "
                    "must decide alike",
                    pipe_len,
                    ", ".join(f"{100 * spread:.0f}% at M={m}" for m, spread in noisy.items()),
                )
        chosen = choose_micro_batches({m: timings[m] for m in candidates}, candidates)
        logger.info(
            "micro-batches for pipe_len %d, replica batch %d: M=%d (%s; %s; pin it with "
            "pipeline.num_micro_batches=%d)",
            pipe_len,
            replica_batch,
            chosen,
            ", ".join(f"M={m}: {timings[m] * 1000:.1f} ms" for m in candidates),
            "measured now" if missing else f"measured earlier, from {self.store.path}",
            chosen,
        )
        return chosen
