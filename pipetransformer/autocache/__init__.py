"""AutoCache: a per-node store of frozen-prefix outputs in shared memory, with a disk tier.

`CacheDaemon` (daemon.py) starts the node's daemon process, which owns every file;
`CacheClient` (client.py) attaches from any process on the node and reads and writes rows
in place; layout.py plans the slots, store.py maps them, prefetch.py reads ahead.

The client names are imported lazily (PEP 562) so that the daemon process, which starts
through this package, never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipetransformer.autocache.daemon import CacheDaemon, default_memory_budget

if TYPE_CHECKING:
    from pipetransformer.autocache.client import CacheClient, CacheStats

__all__ = ["CacheClient", "CacheDaemon", "CacheStats", "default_memory_budget"]


def __getattr__(name: str) -> Any:
    if name in ("CacheClient", "CacheStats"):
        from pipetransformer.autocache import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
