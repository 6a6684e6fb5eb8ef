"""Paged KV bookkeeping: page hashes, the block pool with its prefix cache, cache events.

Pure Python by design (no torch, no numpy): the scheduler and routers import it on any host.
"""

from kvmesh.engine.kv.block_manager import BlockManager, BlockManagerConfig, PrefixMatch
from kvmesh.engine.kv.events import AllCleared, KvEvent, PagesRemoved, PagesStored
from kvmesh.engine.kv.free_queue import FreePageQueue, Page
from kvmesh.engine.kv.hashing import HASH_SEED, BlockHasher, hash_page, salt_root

__all__ = [
    "HASH_SEED",
    "AllCleared",
    "BlockHasher",
    "BlockManager",
    "BlockManagerConfig",
    "FreePageQueue",
    "KvEvent",
    "Page",
    "PagesRemoved",
    "PagesStored",
    "PrefixMatch",
    "hash_page",
    "salt_root",
]
