"""The store's public records (its config, the names of blocks, the outcomes) and the
checks of what callers hand the store (refs, keys, payloads).

Kept apart from the tiering policy (``_store``, which re-exports the records) so that
module holds only the policy.
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from promptsplice.blocks import HASH_BYTES, BlockHash, chain_hashes, root_hash, token_bytes
from promptsplice._validate import encodable, is_int
from promptsplice.engine_adapters.store._format import MAX_SALT_BYTES
from promptsplice.engine_adapters.store._redis import check_redis_url
from promptsplice.engine_adapters.store._tier import Key, Namespace, dtype_name, salt_bytes, supported_dtypes
from promptsplice.errors import ConfigError, InputError, PromptspliceWarning

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockRef",
    "Lookup",
    "LookupStatus",
    "PutStatus",
    "StoreConfig",
    "StoreStats",
    "Ref",
    "block_key",
    "chain_refs",
    "own_payload",
    "parse_ref",
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
    """Bytes the record files take on disk: each file rounded up to the folder's
    allocation unit (usually 4 KiB), so the budget bounds what the folder uses
    (always <= ``disk_bytes`` of the config)."""
    dram_hits: int
    dram_misses: int
    """Lookups DRAM did not serve."""
    disk_hits: int
    disk_misses: int
    """Lookups of a store with tiers below DRAM that no tier served: not found or not
    served below, or a mismatch in DRAM (which ends the lookup)."""
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
    remote_blocks: int = 0
    """Blocks the shared tier's index knows on the server (theirs and ours)."""
    remote_hits: int = 0
    """Lookups the shared tier served (counted in ``disk_hits`` too)."""
    remote_writes: int = 0
    remote_write_errors: int = 0
    remote_corrupt: int = 0
    """Damaged values on the server (bad digest, wrong length, header) deleted, not served."""
    remote_foreign: int = 0
    """Values of another fingerprint under this store's keys: deleted, not served."""
    remote_outages: int = 0
    """Times the server went out of reach (each costs hits, never a request)."""
    remote_skipped: int = 0
    """Writes not attempted: server out of reach, or the write-behind queue full."""
    remote_available: bool = False
    misses: int = 0
    """Lookups no tier served (not found, another block under the key, a copy damaged
    or gone), counted when the lookup ends, however many tiers the store has open."""


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


Ref = BlockRef | tuple[bytes, bytes, Sequence[int]]
"""What the store's methods accept as a block ref."""


MAX_SECONDS = 86_400.0
"""The longest timeout or back-off a store accepts (a day): an infinite one turned a
tier off for good (disk) or could not be set on a socket (Redis)."""


def _check_seconds(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECONDS:
        raise ConfigError(f"{what} must be a number of seconds from 0 to {MAX_SECONDS:g}, got {value!r}")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Budgets, folder and shared server of a :class:`BlockStore` (validated when built)."""

    dram_bytes: int
    """Payload bytes kept in memory (> 0)."""
    disk_bytes: int = 0
    """Bytes of record files kept on disk, each file counted in whole allocation units
    of its folder (usually 4 KiB: a small block costs at least that); 0: no disk tier."""
    disk_dir: str | None = None
    """Folder of the record files (created if missing); required when ``disk_bytes > 0``.
    A folder the process cannot use (no permission, a full or read-only disk) turns the
    disk tier off with one warning: the store serves from DRAM, ``disk_writable`` is
    false in its stats."""
    fingerprint: str = ""
    """The model and KV layout that write the blocks (e.g. model, dtype, block size,
    cache layout); records of another fingerprint are not served.  Empty is refused
    (``ConfigError`` when the store opens) on a ``disk_dir`` that already holds records,
    and with a shared tier: nothing would tell another model's blocks apart."""
    fsync: bool = True
    """fsync each record before its rename, and the folder after it, so a record
    counted as written survives a power cut (off only for throwaway folders)."""
    disk_retry_s: float = 30.0
    """After a failed write, disk writes pause this long (then are tried again)."""
    write_behind_bytes: int = 64 * 1024 * 1024
    """Payload bytes of evicted blocks that may wait in memory for the background
    writer (so a put or a load never waits for an fsync); a caller waits only when it
    is full (the shared tier never waits: what does not fit its queue is not written,
    counted in ``remote_skipped``; an empty queue takes one block, even a larger one,
    as the disk tier writes such a block inline).  0: write in the calling thread
    (deterministic; tests and tools)."""
    remote_bytes: int = 0
    """Bytes of records on the shared Redis tier that this store indexes (LRU); 0: no
    shared tier.  The server's own ``maxmemory`` LRU bounds what it holds."""
    remote_url: str | None = field(default=None, repr=False)  # it may carry a password
    """``redis://host:port/db`` of the shared tier; required when ``remote_bytes > 0``.
    Options that set the client's timeouts or retries (``?socket_timeout=``...) are
    refused: the tier sets them from ``remote_timeout_s``.  A shared tier needs a
    ``fingerprint`` (the splice connector sets one)."""
    remote_timeout_s: float = 0.2
    """Connect and socket timeout of each call to the shared tier's server.  A read
    that takes longer in all (a large value over a slow link), or reads that average
    over half of it, mark the server down like a timeout does."""
    remote_retry_s: float = 5.0
    """After the server went out of reach, the shared tier is skipped this long."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raise :class:`ConfigError` saying how to fix it."""
        if not is_int(self.dram_bytes) or self.dram_bytes <= 0:
            raise ConfigError(
                f"dram_bytes must be a positive int (bytes of KV payload kept in memory, "
                f"e.g. 2 * 1024**3), got {self.dram_bytes!r}"
            )
        if not is_int(self.disk_bytes) or self.disk_bytes < 0:
            raise ConfigError(
                f"disk_bytes must be an int >= 0 (bytes of block files on disk; 0 turns the "
                f"disk tier off), got {self.disk_bytes!r}"
            )
        if self.disk_dir is not None:
            try:
                path = os.fspath(self.disk_dir)
            except TypeError:
                path = None
            if not isinstance(path, str) or not path or "\x00" in path:
                raise ConfigError(f"disk_dir must be a folder path or None, got {self.disk_dir!r}")
            path = os.path.abspath(os.path.expanduser(path))
            if os.path.exists(path) and not os.path.isdir(path):
                raise ConfigError(f"disk_dir {path!r} exists and is not a folder: pass a folder (created if missing)")
            object.__setattr__(self, "disk_dir", path)
        if self.disk_bytes > 0 and self.disk_dir is None:
            raise ConfigError(
                "disk_bytes > 0 needs disk_dir: pass the folder for the block files, "
                "or disk_bytes=0 to keep blocks in DRAM only"
            )
        if self.disk_dir is not None and self.disk_bytes == 0:  # the documented off switch, said aloud
            warnings.warn(
                f"StoreConfig: disk_dir={self.disk_dir!r} is not used: disk_bytes=0 turns the disk tier "
                "off; pass disk_bytes > 0 for a disk tier",
                PromptspliceWarning,
                stacklevel=3,
            )
        if not isinstance(self.fingerprint, str) or not encodable(self.fingerprint):
            raise ConfigError(
                f"fingerprint must be a str without lone surrogates (model and KV layout), got {self.fingerprint!r}"
            )
        if not isinstance(self.fsync, bool):
            raise ConfigError(f"fsync must be True or False, got {self.fsync!r}")
        if not is_int(self.write_behind_bytes) or self.write_behind_bytes < 0:
            raise ConfigError(
                f"write_behind_bytes must be an int >= 0 (0 writes records in the calling "
                f"thread), got {self.write_behind_bytes!r}"
            )
        _check_seconds(self.disk_retry_s, "disk_retry_s")
        self._validate_remote()

    def _validate_remote(self) -> None:
        if not is_int(self.remote_bytes) or self.remote_bytes < 0:
            raise ConfigError(
                f"remote_bytes must be an int >= 0 (bytes of records indexed on the shared "
                f"Redis tier; 0 turns it off), got {self.remote_bytes!r}"
            )
        if self.remote_url is not None:
            problem = check_redis_url(self.remote_url)
            if problem is not None:
                raise ConfigError(f"remote_url {problem}: pass e.g. redis://127.0.0.1:6379/0")
        if self.remote_bytes > 0 and self.remote_url is None:
            raise ConfigError(
                "remote_bytes > 0 needs remote_url: pass the shared tier's redis://host:port, "
                "or remote_bytes=0 to keep blocks local"
            )
        if self.remote_url is not None and self.remote_bytes == 0:
            raise ConfigError(
                "remote_url needs remote_bytes > 0 (bytes of records indexed on the server, "
                "e.g. its maxmemory), or drop remote_url"
            )
        for name in ("remote_timeout_s", "remote_retry_s"):
            _check_seconds(getattr(self, name), name)
        if not self.remote_timeout_s > 0:
            raise ConfigError(f"remote_timeout_s must be > 0 seconds (e.g. 0.2), got {self.remote_timeout_s!r}")
        if not self.remote_retry_s > 0:  # 0: a failing server retried (and logged) in a tight loop
            raise ConfigError(f"remote_retry_s must be > 0 seconds (e.g. 5), got {self.remote_retry_s!r}")


def _as_hash(value: object, what: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value)
        if len(b) == HASH_BYTES:
            return b
    raise InputError(f"{what} must be {HASH_BYTES} bytes (a BlockHash), got {value!r:.80}")


def _namespace(namespace: object) -> int:
    if isinstance(namespace, bool) or not hasattr(type(namespace), "__index__"):  # True, 1.0: never a namespace
        raise InputError(f"namespace must be a Namespace, got {namespace!r}")
    try:
        return int(Namespace(operator.index(namespace)))  # (a numpy int is one)
    except ValueError:
        raise InputError(f"namespace must be a Namespace, got {namespace!r}") from None


def block_key(key: object, namespace: object) -> Key:
    """Check a bare key (``discard``): ``(namespace, key)``."""
    return _namespace(namespace), _as_hash(key, "key")


def parse_ref(ref: Ref, salt: str | bytes | None, namespace: object) -> tuple[Key, bytes, bytes, bytes]:
    """Check a caller's block ref: ``((namespace, key), salt, parent, tokens)`` as bytes."""
    try:
        key, parent, tokens = ref
    except (TypeError, ValueError):
        raise InputError(f"a block ref is (key, parent, tokens), got {ref!r:.80}") from None
    try:
        tok = token_bytes(tokens)
    except (TypeError, OverflowError, ValueError) as exc:
        raise InputError(f"block tokens must be token ids in [0, 2**32): {exc}") from exc
    salt_b = salt_bytes(salt)  # InvalidSaltError (an InputError) names a bad salt
    return block_key(key, namespace), salt_b, _as_hash(parent, "parent"), tok


def check_stored_salt(salt_b: bytes) -> None:
    """A salt a record can hold (``put`` only: a lookup under a longer salt just finds
    nothing).  The record keeps the salt's length in 16 bits: one longer salt (any
    client's ``cache_salt`` over ``vllm serve``) failed every write and paused the disk
    tier for every tenant."""
    if len(salt_b) > MAX_SALT_BYTES:
        raise InputError(
            f"a salt of {len(salt_b) - 1} bytes is over the {MAX_SALT_BYTES - 1} a stored block can "
            "carry: use a shorter salt (a random 32-character one isolates a tenant)"
        )


def own_payload(payload: object, copy: bool) -> tuple[torch.Tensor, str]:
    """Check a payload and take it (a copy unless ``copy`` is false): (tensor, dtype name)."""
    import torch

    if not isinstance(payload, torch.Tensor):
        raise InputError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
    if payload.device.type != "cpu" or payload.layout != torch.strided:
        raise InputError(
            f"payload must be a dense CPU tensor (copy it off the device first), got "
            f"{payload.layout} on {payload.device}"
        )
    name = dtype_name(payload.dtype)
    if name is None:
        raise InputError(f"payload dtype {payload.dtype} cannot be stored; use one of {supported_dtypes()}")
    if payload.numel() == 0:
        # (no KV block is empty: each one took DRAM for its record and none of the budget,
        # so 100,000 of them fit a 1 KiB tier, a review found on 2026-12-07)
        raise InputError(f"payload of shape {tuple(payload.shape)} is empty: a block's KV has at least one element")
    if payload.is_neg() or payload.is_conj():
        payload = payload.resolve_neg().resolve_conj()  # (a lazy view: no raw bytes to copy)
    tensor = payload.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    elif copy:
        # A plain memcpy in this thread: torch's clone() goes through its intra-op
        # thread pool, which the model's forward pass is using (measured 5-20 ms for
        # a 0.7 MB block on a busy 2-core machine, vs 0.02 ms for this copy).
        raw = tensor.reshape(-1).view(torch.uint8).numpy().copy()
        tensor = torch.from_numpy(raw).view(tensor.dtype).reshape(tensor.shape)
    return tensor, name
