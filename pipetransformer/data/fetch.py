"""Fetching datasets from the network, once per node, before any worker starts.

The command line calls `fetch_data` in the launching process (under torchrun, in every
worker, serialised by a lock file next to the data), so the workers only read what is
already on disk. A failed fetch is one error line naming the dataset, where it was to go
and how to point the run at a local copy instead.

Owns: those downloads and their lock. Must not: parse or tokenise data (the loaders do).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipetransformer.config import ConfigError, DataConfig

logger = logging.getLogger(__name__)


@contextmanager
def fetch_lock(directory: Path) -> Iterator[None]:
    """One process of the machine fetches into `directory` at a time; the others wait, then
    find the files there."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(
        directory / ".pipetransformer-fetch.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def fetch_cifar(root: Path, num_classes: int) -> None:
    from torchvision import datasets

    cls = datasets.CIFAR10 if num_classes == 10 else datasets.CIFAR100
    with fetch_lock(root):
        try:
            for train in (True, False):
                cls(str(root), train=train, download=True)
        except Exception as exc:  # urllib, ssl, http, checksum: all mean the same to the user
            raise ConfigError(
                f"data.download: cannot fetch CIFAR-{num_classes} into {root} "
                f"({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
                "download it where there is network and point data.root at the directory "
                f"holding cifar-{num_classes}-python/, with data.download=false"
            ) from None


def fetch_hub_dataset(
    name: str, subset: str | None, local_form: str, key: str = "data.root"
) -> None:
    """`datasets.load_dataset(name, subset)` into datasets' cache, or one ConfigError line.
    The Hub is asked once, without retries, whether it has the dataset: out of reach, the
    dataset may still be in the cache (it is loaded offline); not there, the line says so
    at once instead of after half a minute of huggingface_hub's retry warnings."""
    import datasets

    label = f"{name}/{subset}" if subset else name
    where = "not set, and the" if key == "data.root" else "the"
    advice = f"point {key} at a local copy ({local_form})"
    reach = None if datasets.config.HF_HUB_OFFLINE else _hub_reach(name)
    if reach is not None and reach.startswith("no dataset"):
        raise ConfigError(f"{key}: {where} '{name}': {reach}; {advice}")
    offline = reach is not None  # out of reach: what the cache holds, or nothing
    try:
        with _quiet_hub(), _offline(offline):
            datasets.load_dataset(name, subset) if subset else datasets.load_dataset(name)
    except Exception as exc:  # offline, hub errors, a proxy: one line either way
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}"
        if offline:
            detail = f"the Hub is out of reach ({reach}) and datasets' cache does not hold it"
        raise ConfigError(
            f"{key}: {where} '{label}' dataset cannot be fetched through `datasets` "
            f"({detail}); {advice}"
        ) from None


def _hub_reach(name: str, timeout_s: float = 10.0) -> str | None:
    """None when the Hub answers that it has dataset `name`; else why not, in a few words
    ('no dataset ... on the Hub', or the connection error)."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        huggingface_hub.HfApi().dataset_info(name, timeout=timeout_s)
    except RepositoryNotFoundError:
        return "no dataset of that name on the Hub (or a private one: log in with `hf auth login`)"
    except HfHubHTTPError as exc:
        return f"the Hub answered {str(exc).splitlines()[0]}"
    except Exception as exc:  # DNS, a refused connection, a proxy, a timeout
        text = str(exc).splitlines()[0] if str(exc) else "no detail"
        return f"{type(exc).__name__}: {text}"
    return None


@contextmanager
def _quiet_hub() -> Iterator[None]:
    """huggingface_hub's retry warnings ('Retrying in 8s [Retry 4/5]') kept out of the
    user's terminal: the one error line says what failed."""
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_logger.setLevel(level)


@contextmanager
def _offline(offline: bool) -> Iterator[None]:
    """datasets reads only its cache while `offline` (no request, no retry)."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = saved or offline
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def fetch_data(config: DataConfig) -> None:
    """Download what a run of `config` reads from the network (nothing for local data)."""
    if config.name in ("cifar10", "cifar100") and config.download and config.root is not None:
        fetch_cifar(Path(config.root).expanduser(), 10 if config.name == "cifar10" else 100)
    elif config.name == "sst2" and config.root is None:
        fetch_hub_dataset("glue", "sst2", "a directory with train.tsv and dev.tsv")
    elif config.name in ("hf", "hf_image"):
        from pipetransformer.data.sources import check_local_paths
        from pipetransformer.data.table import hub_dataset

        try:
            check_local_paths(config)  # local: never fetched; missing: one line at once
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
        if hub_dataset(config):
            fetch_hub_dataset(
                config.path,
                config.config_name,
                "a save_to_disk directory, or csv/tsv/json/parquet with data.data_files",
                key="data.path",
            )
    elif config.name == "squad" and config.root is None:
        fetch_hub_dataset(
            "squad",
            None,
            "a SQuAD v1.1 JSON file, or a directory with train-v1.1.json and dev-v1.1.json",
        )
