"""The tiered KV block store the splice connector forwards to (torch-free interface).

Keys are the chain hash of a block plus the tenant salt; every lookup compares the stored
token ids and parent key, so a hash collision never serves wrong KV.

Rooms: ``_store`` the tiering policy (:class:`BlockStore`), ``_tier`` what a tier is and
must guarantee, ``_dram`` the memory tier, ``_disk`` the disk tier (its record format in
``_format``), ``_redis`` the shared tier on a Redis server (same record format),
``_types`` the config, records and input checks.
"""

from promptsplice.engine_adapters.store._store import (
    BlockRef,
    BlockStore,
    Lookup,
    LookupStatus,
    Namespace,
    PutStatus,
    StoreConfig,
    StoreStats,
    chain_refs,
    shared_store,
)

__all__ = [
    "BlockRef",
    "BlockStore",
    "Lookup",
    "LookupStatus",
    "Namespace",
    "PutStatus",
    "StoreConfig",
    "StoreStats",
    "chain_refs",
    "shared_store",
]
