"""The store's public records: its config, the names of blocks and the outcomes.

Kept apart from the tiering policy (``_store``, which re-exports them all) so that
module holds only the policy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from promptsplice.blocks import BlockHash, chain_hashes, root_hash
from promptsplice.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockRef",
    "Lookup",
    "LookupStatus",
    "PutStatus",
    "StoreConfig",
    "StoreStats",
    "chain_refs",
]


class LookupStatus(Enum):
    """Outcome of :meth:`BlockStore.get` (never an exception)."""

    HIT_DRAM = "hit_dram"
    HIT_DISK = "hit_disk"
    MISS = "miss"
    MISMATCH = "mismatch"
    """The key is present but its tokens, parent or salt differ: not served."""
    CORRUPT = "corrupt"
    """The disk record failed its checks: deleted and counted, not served."""

    @property
    def hit(self) -> bool:
        return self is LookupStatus.HIT_DRAM or self is LookupStatus.HIT_DISK


class PutStatus(Enum):
    """Outcome of :meth:`BlockStore.put`."""

    STORED = "stored"
    """Kept: in DRAM, or sent straight to disk when DRAM had no room for it."""
    EXISTS = "exists"
    """The identical block was already stored (put is idempotent); it was touched."""
    MISMATCH = "mismatch"
    """Another block (other tokens, parent, salt or layout) holds the key: kept as is."""
    REJECTED = "rejected"
    """No tier could take it (larger than the budgets, budgets pinned, disk failing)."""


class BlockRef(NamedTuple):
    """One block as the caller names it: key, parent key and the block's token ids."""

    key: bytes
    parent: bytes
    tokens: Sequence[int]


class Lookup(NamedTuple):
    """A lookup's outcome and, on a hit, the payload (shared: do not modify it)."""

    status: LookupStatus
    payload: torch.Tensor | None = None


class StoreStats(NamedTuple):
    """Counters of a :class:`BlockStore` (cumulative since it was opened)."""

    dram_blocks: int
    dram_bytes: int
    """Payload bytes held in DRAM (always <= ``dram_bytes`` of the config)."""
    disk_blocks: int
    disk_bytes: int
    """Bytes of record files (always <= ``disk_bytes`` of the config)."""
    dram_hits: int
    dram_misses: int
    """Lookups DRAM did not serve."""
    disk_hits: int
    disk_misses: int
    """Lookups that reached the disk tier and were not served by it."""
    mismatches: int
    """Lookups and puts that found another block under the key."""
    corrupt: int
    """Damaged records and leftover temporary files deleted (at open or on load)."""
    foreign: int
    """Records of another fingerprint deleted when the folder was opened."""
    dram_evictions: int
    disk_evictions: int
    disk_writes: int
    write_errors: int
    dropped: int
    """Blocks let go without a copy because no tier could take them."""
    pinned_blocks: int
    pending_writes: int
    """Evicted blocks waiting for the background writer (still served from memory)."""
    disk_writable: bool


def chain_refs(
    tokens: Sequence[int],
    block_size: int,
    *,
    salt: str | bytes | None = None,
    parent: BlockHash | None = None,
) -> list[BlockRef]:
    """:class:`BlockRef` of every full block of ``tokens`` (``chain_hashes`` + parents)."""
    keys = chain_hashes(tokens, block_size, parent=parent, salt=salt)
    prev = parent if parent is not None else root_hash(salt)
    refs = []
    for i, key in enumerate(keys):
        refs.append(BlockRef(key, prev, tuple(tokens[i * block_size : (i + 1) * block_size])))
        prev = key
    return refs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Budgets and folder of a :class:`BlockStore` (validated when built)."""

    dram_bytes: int
    """Payload bytes kept in memory (> 0)."""
    disk_bytes: int = 0
    """Bytes of record files kept on disk; 0: no disk tier."""
    disk_dir: str | None = None
    """Folder of the record files (created if missing); required when ``disk_bytes > 0``."""
    fingerprint: str = ""
    """The model and KV layout that write the blocks (e.g. model, dtype, block size,
    cache layout); records of another fingerprint are not served."""
    fsync: bool = True
    """fsync each record before its rename, and the folder after it, so a record
    counted as written survives a power cut (off only for throwaway folders)."""
    disk_retry_s: float = 30.0
    """After a failed write, disk writes pause this long (then are tried again)."""
    write_behind_bytes: int = 64 * 1024 * 1024
    """Payload bytes of evicted blocks that may wait in memory for the background
    writer (so a put or a load never waits for an fsync); a caller waits only when it
    is full.  0: write in the calling thread (deterministic; tests and tools)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raise :class:`ConfigError` saying how to fix it."""
        if not _is_int(self.dram_bytes) or self.dram_bytes <= 0:
            raise ConfigError(
                f"dram_bytes must be a positive int (bytes of KV payload kept in memory, "
                f"e.g. 2 * 1024**3), got {self.dram_bytes!r}"
            )
        if not _is_int(self.disk_bytes) or self.disk_bytes < 0:
            raise ConfigError(
                f"disk_bytes must be an int >= 0 (bytes of block files on disk; 0 turns the "
                f"disk tier off), got {self.disk_bytes!r}"
            )
        if self.disk_dir is not None:
            try:
                path = os.fspath(self.disk_dir)
            except TypeError:
                path = None
            if not isinstance(path, str) or not path:
                raise ConfigError(f"disk_dir must be a folder path or None, got {self.disk_dir!r}")
            object.__setattr__(self, "disk_dir", os.path.abspath(os.path.expanduser(path)))
        if self.disk_bytes > 0 and self.disk_dir is None:
            raise ConfigError(
                "disk_bytes > 0 needs disk_dir: pass the folder for the block files, "
                "or disk_bytes=0 to keep blocks in DRAM only"
            )
        if not isinstance(self.fingerprint, str):
            raise ConfigError(f"fingerprint must be a str (model and KV layout), got {self.fingerprint!r}")
        if not isinstance(self.fsync, bool):
            raise ConfigError(f"fsync must be True or False, got {self.fsync!r}")
        if not _is_int(self.write_behind_bytes) or self.write_behind_bytes < 0:
            raise ConfigError(
                f"write_behind_bytes must be an int >= 0 (0 writes records in the calling "
                f"thread), got {self.write_behind_bytes!r}"
            )
        retry = self.disk_retry_s
        if isinstance(retry, bool) or not isinstance(retry, (int, float)) or not retry >= 0:
            raise ConfigError(f"disk_retry_s must be a number of seconds >= 0, got {retry!r}")
