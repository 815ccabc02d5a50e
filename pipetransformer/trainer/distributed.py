"""The process's place in the world, read from the launcher's environment (torchrun's names)."""

from __future__ import annotations

import datetime
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipetransformer.autodp.control import Control
from pipetransformer.config import ConfigError, World
from pipetransformer.utils.allocator import use_expandable_segments

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    devices_per_node: int
    device: torch.device
    # Who said how many processes a node runs: "torchrun" (LOCAL_WORLD_SIZE, which overrules
    # trainer.nproc_per_node) or "local launcher" (trainer.nproc_per_node or --nproc).
    devices_per_node_from: str = "local launcher"

    @property
    def node(self) -> int:
        return self.rank // self.devices_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.devices_per_node

    def note_processes_per_node(self, configured: int | None) -> None:
        """Under torchrun the launcher says how many processes a node runs; a different
        trainer.nproc_per_node in the config is overruled (said once, by rank 0)."""
        if configured is not None and configured != self.devices_per_node and self.rank == 0:
            logger.warning(
                "trainer.nproc_per_node is %d but the launcher started %d processes per node: "
                "using %d",
                configured,
                self.devices_per_node,
                self.devices_per_node,
            )

    def describe(self, tf32: bool = True) -> str:
        """The start line: where the processes compute and how they talk."""
        if self.device.type == "cuda":
            math = "TF32 matmuls" if tf32 else "full float32 matmuls (trainer.tf32=false)"
            where = f"{torch.cuda.get_device_name(self.device)}, NCCL, {math}"
        else:
            where = f"CPU, gloo, {torch.get_num_threads()} thread(s) each"
        return (
            f"{self.world_size} process(es) on {self.num_nodes} node(s) ({where}; "
            "control group gloo)"
        )

    @property
    def shape(self) -> World:
        """What the config's `auto` settings are resolved against."""
        return World(self.world_size, self.devices_per_node, self.device.type)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"environment variable {name} is not set (start through the CLI or torchrun)"
            )
        return default
    return int(value)


class DeviceError(ConfigError):
    """The processes cannot have the devices they ask for. One line, naming the key."""


def check_visible_gpus(processes_per_node: int, visible: int) -> None:
    """NCCL refuses two ranks on one GPU: a node runs at most one process per visible GPU."""
    if processes_per_node > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise DeviceError(
            f"trainer.nproc_per_node: {processes_per_node} processes per node but {visible} "
            f"visible GPU(s){where}; NCCL needs one GPU per process: run at most {visible} "
            "(torchrun --nproc-per-node, --nproc) or trainer.device=cpu"
        )


def cuda_unusable_reason() -> str | None:
    """Why CUDA cannot be used on a machine that looks as if it had a GPU (a driver too old
    for this wheel, a container started without its GPUs), else None."""
    if torch.cuda.is_available() or torch.version.cuda is None:
        return None
    signs = [os.path.exists("/dev/nvidiactl")] + [
        bool(os.environ.get(name)) for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
    ]
    if not any(signs):
        return None
    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - torch's own words are the reason
        return str(exc).splitlines()[0]
    return "torch.cuda.is_available() is False"


def uses_cuda(device_kind: str) -> bool:
    """Whether `trainer.device` means CUDA here ('auto': when CUDA is usable)."""
    return device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())


def configure_math(device: torch.device, tf32: bool) -> None:
    """TF32 tensor cores for float32 matmuls and convolutions on CUDA (trainer.tf32): an
    A100/H100 runs float32 several times slower without them."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def init_distributed(device_kind: str, timeout_s: float, tf32: bool = True) -> WorldInfo:
    rank = _env_int("RANK")
    world_size = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    devices_per_node = _env_int("LOCAL_WORLD_SIZE", world_size)
    use_cuda = uses_cuda(device_kind)
    if use_cuda:
        if not torch.cuda.is_available():
            reason = cuda_unusable_reason() or "no GPU is visible"
            raise DeviceError(
                f"trainer.device: 'cuda' was asked for but CUDA is unusable: {reason}"
            )
        check_visible_gpus(devices_per_node, torch.cuda.device_count())
        # Before set_device initialises CUDA here, for a trainer not started by the command
        # line (which sets them before its preflight can initialise CUDA): utils/allocator.py.
        use_expandable_segments()
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        configure_math(device, tf32)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Several processes share the cores: one thread each, or they slow each other 5-15x.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices_per_node))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = None
        if os.environ.get(LOOPBACK_ENV) == "1":
            store = _loopback_store(rank, world_size, timeout)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            _warn_if_restarts_may_hang(rank)
            store = _attempt_store(timeout)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if use_cuda else None,
        )
    source = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "local launcher"
    world = WorldInfo(rank, world_size, local_rank, devices_per_node, device, source)
    if rank == 0:
        launched = os.environ.get("PIPETRANSFORMER_LAUNCHED_AT")
        up = f"; workers up {time.time() - float(launched):.1f} s after launch" if launched else ""
        logger.info("%s%s", world.describe(tf32), up)
        reason = cuda_unusable_reason() if device_kind == "auto" and not use_cuda else None
        if reason is not None:
            logger.warning(
                "trainer.device auto: this machine looks as if it had a GPU, but CUDA is "
                "unusable (%s): training on CPU processes; set trainer.device=cuda to fail instead",
                reason,
            )
    return world


# Set by the local launcher: every process of the run is on this machine, so nothing it
# opens needs to be reachable from elsewhere.
LOOPBACK_ENV = "PIPETRANSFORMER_LOOPBACK"
_listening: list[socket.socket] = []  # the store's socket lives as long as the process


def _attempt_store(timeout: datetime.timedelta) -> dist.PrefixStore:
    """torchrun's agent store seen under a prefix of its own per restart. Measured on torch
    2.14: with the default env:// init, the workers of a restarted round (after one was
    SIGKILLed mid-collective) fail or hang in gloo's connectFullMesh, connecting to the dead
    round's addresses; keys under a per-attempt prefix avoid that."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"pipetransformer/attempt_{attempt}", client)


def _warn_if_restarts_may_hang(rank: int) -> None:
    """Several torchrun agents sharing one worker store across rendezvous rounds (torchrun's
    default) can restart into a hang: a node whose own workers did not fail restarts without
    counting the restart, so `_attempt_store`'s prefixes differ between nodes and one node's
    workers meet the dead round's keys. launch/run_multi_node.sh turns the sharing off."""
    restarts = _env_int("TORCHELASTIC_MAX_RESTARTS", 0)
    if rank == 0 and restarts > 0 and _env_int("GROUP_WORLD_SIZE", 1) > 1:
        logger.warning(
            "torchrun --max-restarts %d across %s nodes with a shared rendezvous store: a "
            "restart may hang in gloo's connectFullMesh; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "(launch/run_multi_node.sh does) or restart the whole run from its checkpoint",
            restarts,
            os.environ.get("GROUP_WORLD_SIZE"),
        )


def _loopback_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store of a local run, listening on 127.0.0.1 only (a TCPStore on its
    own binds every interface), and gloo's / NCCL's sockets on the loopback interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(world_size * 4)
    _listening.append(listener)
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.fileno()
    )


def peak_memory(control: Control, device: torch.device) -> tuple[int, int | None]:
    """(largest resident set, largest CUDA allocation) over the ranks (collective)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    allocated = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    peak_rss, peak_allocated = control.all_max([rss, allocated]).tolist()
    return int(peak_rss), int(peak_allocated) if device.type == "cuda" else None
