"""AutoCache in a run: the node's daemon, this process's client, when caching pays, metrics.

Local rank 0 of each node starts the node's cache daemon, watching every trainer process
of the node (if they all die, SIGKILL included, the daemon removes the store); every rank
attaches a client. Whether the cache serves the frozen prefix at boundary F is decided by
measurement, identically on every rank: a cache read of a batch (timed here, averaged
over ranks) against recomputing the prefix (the measured no-grad forward times of its
units). The paper found recomputation faster while few layers are frozen. Text is stored
at each sample's real length (so the memory budget holds more of it, and a read moves
only real rows), and the prefix recomputes a batch at the length the replica runs it at
(its padded length, in a pipeline's bucket): the recompute side scales the units' times,
measured at max_seq_length, by the starting layout's mean such length over max_seq_length
(`length_share`, trainer/step.py); the read is timed on stored samples as they are.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from pipetransformer.autocache import CacheClient, CacheDaemon, default_memory_budget
from pipetransformer.autodp.control import Control
from pipetransformer.autopipe.planner import UnitCosts
from pipetransformer.config import Config, ConfigError
from pipetransformer.data import DataBundle
from pipetransformer.models import ModelSpec
from pipetransformer.pipe.prefix import CachedPrefix
from pipetransformer.runs.records import CacheCounters
from pipetransformer.utils.units import prefix_end

logger = logging.getLogger(__name__)

READ_REPEATS = 5
# /dev/shm kept free per GPU process of a node for NCCL's shared-memory transport and proxy
# buffers, which every transition's new communicators allocate again (a container's
# default /dev/shm is 64 MiB: docs/gpus.md).
NCCL_SHM_BYTES_PER_PROCESS = 256 << 20


def check_augmentation(config: Config, data: DataBundle) -> None:
    if not data.train.random_inputs:
        return
    if not config.cache.allow_augmented:
        raise ConfigError(
            "cache.allow_augmented: the training inputs are randomly augmented, so a sample's "
            "frozen-layer output differs every epoch and a cached one would be stale; set "
            "data.augment=false, cache.enabled=false, or cache.allow_augmented=true to cache "
            "each sample's first view (the paper's behaviour)"
        )
    logger.warning(
        "training inputs are augmented: the cache serves each sample's first augmented view"
    )


class RunCache:
    def __init__(
        self,
        config: Config,
        spec: ModelSpec,
        data: DataBundle,
        world,
        control: Control,
        read_s_per_sample: float | None = None,
    ) -> None:
        """`read_s_per_sample`: the read time an earlier attempt of the run measured (a
        resumed run decides where the cache pays as the run did); None: measure it."""
        check_augmentation(config, data)
        self.config = config
        self.world = world
        self.control = control
        self.daemon: CacheDaemon | None = None
        pids = control.all_gather(os.getpid())
        node_ranks = range(
            world.node * world.devices_per_node, (world.node + 1) * world.devices_per_node
        )
        if world.rank == node_ranks[0]:
            specs = list(spec.activation_specs)
            self.daemon = CacheDaemon.start(
                splits={
                    name: (len(split), specs, split.lengths, spec.max_seq_length)
                    for name, split in (("train", data.train), ("eval", data.eval))
                },
                memory_budget_bytes=config.cache.memory_budget_bytes or default_memory_budget(),
                disk_dir=config.cache.dir,
                storage_dtype=config.cache_dtype,
                keep=config.cache.keep,
                watched_pids=[pids[r] for r in node_ranks],
                shm_reserve_bytes=NCCL_SHM_BYTES_PER_PROCESS * world.devices_per_node
                if world.device.type == "cuda"
                else 0,
            )
            started = {
                "node": world.node,
                "rank": world.rank,
                "daemon_pid": self.daemon.pid,
                "address": self.daemon.address,
            }
        else:
            started = None
        gathered = control.all_gather(started)
        # One daemon per node (what the run's start event reports).
        self.daemons = [
            {k: v for k, v in e.items() if k != "address"} for e in gathered if e is not None
        ]
        # cache.prefetch_batches of the largest batch a replica of this node can read (one
        # replica a node: the fewest replicas any layout has).
        window = config.cache.prefetch_batches * config.trainer.replica_batch_size(world.num_nodes)
        self.client = CacheClient.attach(
            gathered[node_ranks[0]]["address"], prefetch_window_rows=window
        )
        if read_s_per_sample is None:
            read_s_per_sample = self._measure_read(min(len(data.train), 64))
        self.read_s_per_sample = read_s_per_sample
        self.counts = {"hits": 0, "upgrades": 0, "misses": 0}  # filled by CachedPrefix
        self._said: dict[int, bool] = {}  # boundaries whose decision was logged
        logger.info(
            "AutoCache attached (%s); a cached sample reads in %.1f us",
            self.client.address,
            1e6 * self.read_s_per_sample,
        )

    def _measure_read(self, rows: int) -> float:
        """Seconds to read one sample from the store and bring it to the device as a step
        does, through the step's own path (pipe/prefix.py `CachedPrefix.read_rows`: the
        stored dtype into pinned buffers allocated once and reused, a copy without waiting,
        float32 made on the device; read into pageable memory and pinned at every repeat,
        the read cost more than a step pays and caching switched on later than it should),
        the device waited for once per repeat; averaged over every rank (collective)."""
        device = self.world.device
        reader = CachedPrefix({}, 0, self.client, device)
        ids = list(range(rows))
        times = []
        for _ in range(READ_REPEATS):
            start = time.perf_counter()
            on_device = reader.read_rows("train", ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            del on_device
        self.client.reset_stats()
        return self.control.sum(statistics.median(times) / rows) / self.world.world_size

    def profitable(
        self,
        num_frozen_layers: int,
        costs: UnitCosts,
        micro_batch_size: int,
        length_share: float = 1.0,
    ) -> bool:
        """Does reading beat recomputing the frozen prefix? (`costs` measured, in seconds
        per micro-batch of `micro_batch_size` at max_seq_length; `length_share`: the mean
        padded length of the run's batches over max_seq_length, 1 for images.)"""
        if num_frozen_layers == 0 or not self.config.cache.profile:
            return num_frozen_layers > 0
        frozen = sum(costs.frozen[: prefix_end(num_frozen_layers)])
        recompute = frozen * length_share / micro_batch_size
        decision = self.read_s_per_sample < recompute
        if self._said.get(num_frozen_layers) == decision:
            return decision  # asked again for the same boundary: said once
        self._said[num_frozen_layers] = decision
        logger.info(
            "frozen prefix of %d layers: recompute %.1f us vs cache read %.1f us per sample: %s",
            num_frozen_layers,
            1e6 * recompute,
            1e6 * self.read_s_per_sample,
            "cache" if decision else "recompute",
        )
        return decision

    def prefix_cost(self, micro_batch_size: int) -> float:
        """The frozen prefix's cost on stage 0 when it is read from the cache."""
        return self.read_s_per_sample * micro_batch_size

    def epoch_counters(self) -> CacheCounters:
        """This epoch's counters, summed over all ranks (collective); resets them."""
        stats = self.client.stats()
        self.client.reset_stats()
        holds_node_totals = self.world.rank % self.world.devices_per_node == 0
        counts = self.counts
        values = self.control.all_sum(
            [
                counts["hits"],
                counts["misses"],
                counts["upgrades"],
                stats.bytes_read,
                stats.read_seconds,
                stats.bytes_in_memory if holds_node_totals else 0,
                stats.bytes_on_disk if holds_node_totals else 0,
            ]
        )
        by_rank = torch.zeros(self.world.world_size, dtype=torch.float64)
        by_rank[self.world.rank] = counts["hits"]
        by_rank = self.control.all_sum(by_rank)
        self.counts.update(hits=0, upgrades=0, misses=0)
        hits, misses, upgrades, bytes_read, read_s, in_memory, on_disk = values.tolist()
        return CacheCounters(
            cache_hits=int(hits),
            cache_misses=int(misses),
            cache_upgrades=int(upgrades),
            cache_bytes_in_memory=int(in_memory),
            cache_bytes_on_disk=int(on_disk),
            cache_read_mb_per_s=bytes_read / read_s / 1e6 if read_s > 0 else 0.0,
            cache_hits_by_rank=[int(h) for h in by_rank.tolist()],
        )

    def close(self) -> None:
        self.client.close()
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None
