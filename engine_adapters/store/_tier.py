"""What a storage tier of the block store is, and the pieces every tier shares.

The :class:`~promptsplice.engine_adapters.store.BlockStore` is a policy over an ordered
list of tiers: first the memory tier (``_dram.DramTier``: the payload tensors), then the
storage tiers (:class:`StorageTier`: ``_disk.DiskTier``, then the shared
``_redis.RedisTier``).  The policy decides *what* goes *where* (promotion on a hit,
write-down on an eviction, pins, lookup counters); a tier only keeps blocks, evicts its
least recently used unpinned ones to stay within its byte budget (:class:`ByteLru`, the
one eviction rule), and counts what happens to its storage (:class:`TierStats`).

What a storage tier must guarantee, so the policy needs no change for a new one:

* Verification on load.  :meth:`StorageTier.get` serves a payload only after checking
  the stored bytes against a digest and the stored identity (:class:`BlockMeta`: key,
  salt, parent, token ids, layout; and the store's fingerprint) against its index.
  Anything else is answered :attr:`Loaded.CORRUPT` (the bad copy removed and counted in
  ``corrupt``) or :attr:`Loaded.MISS` (gone behind the store's back): never a payload.
* Never raising on an outage.  A failing write (full disk, unreachable server) is
  counted in ``write_errors``, logged once per outage, and pauses that tier's writes
  (``writable`` false); a failing read answers ``MISS`` or ``CORRUPT``.  The other
  tiers keep serving.
* Pins and losses.  Eviction never removes a key the store's ``pinned`` test names,
  and every planned write-down that will not happen (no room, writes paused, failed)
  is reported through the store's ``on_lost`` callback, which counts it ``dropped``
  unless another tier keeps the block.
* Non-blocking writes.  :meth:`StorageTier.put` only plans a write-down (no I/O); the
  write itself (:meth:`StorageTier.write`) runs in the tier's background writer, or in
  the calling thread when write-behind is off, and the block is served from memory
  (:meth:`StorageTier.pending`) until it landed.  A write counted in ``writes`` is
  durable: it survives a crash (and, where the tier promises it, a power cut).
* Answers from memory.  :meth:`~StorageTier.find` and :meth:`~StorageTier.locate`
  consult the tier's in-memory index only (``match_prefix`` reads no file and makes no
  network call); a tier indexes what it holds when it opens.  A tier whose reads are
  skipped for a while (``readable`` false: a slow shared server) keeps its index, but
  the policy counts none of its indexed blocks as loadable meanwhile.

* Shared tiers.  A tier whose ``shared`` attribute is true (a server other engines
  read) is written when a block is stored, not only when DRAM evicts it; its index
  also learns of blocks other stores wrote, and may name a block the server has since
  evicted (its ``get`` answers ``MISS``).

A storage tier is built with the store's lock (``cond``), ``pinned`` test and
``on_lost`` callback, its byte ``budget`` and the store's ``fingerprint``.
Locking: a tier shares the store's lock (a :class:`threading.Condition`).
The policy calls the index methods with that lock held; they never block on I/O.
``get``, ``write``, ``drain`` and ``close`` are called without it and take it around
their index updates.

This module also owns the tier-neutral identity of a stored block (:class:`BlockMeta`,
the salt encoding, the dtypes a store can hold); ``_format`` writes it to disk.
It never imports torch at import time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

from promptsplice.blocks import salt_bytes  # the one salt encoding (chain roots and records alike)

if TYPE_CHECKING:
    import torch

__all__ = [
    "Namespace",
    "NAMESPACES",
    "Key",
    "BlockMeta",
    "Held",
    "ByteLru",
    "Loaded",
    "Fetched",
    "TierStats",
    "Located",
    "StorageTier",
    "IndexedTier",
    "StoredRecord",
    "WriteJob",
    "record_size",
    "salt_bytes",
    "dtype_name",
    "supported_dtypes",
    "never_pinned",
    "new_condition",
]



class Namespace(IntEnum):
    """The two key spaces of the store."""

    CHAIN = 0
    """Chain hashes (``promptsplice.blocks``): a key names a block and its whole prefix."""
    CONTENT = 1
    """Caller-derived content keys (position-independent reuse); fold the salt in."""


NAMESPACES = frozenset(int(ns) for ns in Namespace)

Key = tuple[int, bytes]
"""A block's place in the store: ``(namespace, key)``."""

_E = TypeVar("_E")

# The dtypes a store holds (torch dtype names without ``torch.``) and their item sizes.
_ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What identifies one stored block, besides its payload bytes.

    ``salt`` is in the encoding of :func:`salt_bytes`, ``tokens`` the block's token ids as
    ``token_bytes`` (little-endian uint32), so comparisons are plain byte comparisons.
    """

    namespace: int
    key: bytes
    salt: bytes
    parent: bytes
    tokens: bytes
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without ``torch.`` (``"bfloat16"``)."""

    @property
    def nbytes(self) -> int:
        """Payload bytes (shape x item size)."""
        n = _ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    @property
    def num_layers(self) -> int:
        """Size of the payload's first dimension (the layer dimension by convention)."""
        return self.shape[0] if self.shape else 1

    def matches(self, salt: bytes, parent: bytes, tokens: bytes) -> bool:
        """True when this block has exactly these salt, parent and token ids."""
        return self.tokens == tokens and self.parent == parent and self.salt == salt


def dtype_name(dtype: torch.dtype) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``; ``None`` when a store cannot hold it."""
    name = str(dtype).removeprefix("torch.")
    return name if name in _ITEMSIZE else None


def supported_dtypes() -> tuple[str, ...]:
    return tuple(_ITEMSIZE)


@dataclass(slots=True)
class Held:
    """A block in memory: in the memory tier, or on its way into a storage tier."""

    meta: BlockMeta
    payload: torch.Tensor


class ByteLru(Generic[_E]):
    """Entries in least-recently-used order with their bytes, under a byte budget.

    The one eviction rule of every tier: :meth:`victims` names the least recently used
    unpinned entries whose removal makes room, or ``None`` when nothing can.
    """

    __slots__ = ("budget", "used", "_entries", "_size_of")

    def __init__(self, budget: int, size_of: Callable[[_E], int]) -> None:
        self.budget = budget
        self.used = 0
        self._entries: OrderedDict[Key, _E] = OrderedDict()
        self._size_of = size_of

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, k: object) -> bool:
        return k in self._entries

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def get(self, k: Key) -> _E | None:
        return self._entries.get(k)

    def items(self) -> Iterator[tuple[Key, _E]]:
        return iter(self._entries.items())

    def add(self, k: Key, entry: _E) -> None:
        """Insert ``entry`` as the most recent (room must have been made)."""
        self._entries[k] = entry
        self.used += self._size_of(entry)

    def pop(self, k: Key) -> _E | None:
        entry = self._entries.pop(k, None)
        if entry is not None:
            self.used -= self._size_of(entry)
        return entry

    def pop_lru(self) -> tuple[Key, _E]:
        k, entry = self._entries.popitem(last=False)
        self.used -= self._size_of(entry)
        return k, entry

    def touch(self, k: Key) -> None:
        self._entries.move_to_end(k)

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0

    def victims(self, size: int, pinned: Callable[[Key], bool], reserved: int = 0) -> list[Key] | None:
        """Least recently used unpinned keys to evict so ``size`` more bytes fit.

        ``reserved``: bytes promised to writes in flight.  ``None`` when ``size`` cannot
        fit even after evicting every unpinned entry.
        """
        if size > self.budget:
            return None
        excess = self.used + reserved + size - self.budget
        out: list[Key] = []
        if excess <= 0:
            return out
        for k, entry in self._entries.items():
            if pinned(k):
                continue
            out.append(k)
            excess -= self._size_of(entry)
            if excess <= 0:
                return out
        return None


class Loaded(Enum):
    """Outcome of a storage tier's :meth:`StorageTier.get`."""

    HIT = "hit"
    MISS = "miss"
    """Not there any more (removed behind the store's back, or evicted meanwhile)."""
    CORRUPT = "corrupt"
    """Failed verification: removed and counted, never served."""


class Fetched(NamedTuple):
    """A storage tier's answer: the outcome and, on a hit, the verified payload."""

    outcome: Loaded
    payload: torch.Tensor | None = None


class TierStats(NamedTuple):
    """What happened to one tier's storage (lookups are counted by the policy)."""

    blocks: int
    bytes: int
    evictions: int
    writes: int = 0
    write_errors: int = 0
    corrupt: int = 0
    """Damaged copies (and leftovers of interrupted writes) removed."""
    foreign: int = 0
    """Copies of another fingerprint removed when the tier opened."""
    pending: int = 0
    """Write-downs waiting for the tier's writer."""
    writable: bool = False
    outages: int = 0
    """Times the tier's backend went out of reach (a remote tier's server)."""
    skipped: int = 0
    """Write-downs not attempted: backend out of reach, or the write-behind queue full."""


class Located(Protocol):
    """A storage tier's index entry of a block it holds."""

    meta: BlockMeta


class StorageTier(Protocol):
    """A tier below memory (disk, remote): see the module doc for what it guarantees.

    ``put`` returns the tier's own write-down job; the policy only hands it to ``write``.
    """

    name: str

    # ---- index, under the store's lock, no I/O
    def find(self, k: Key) -> BlockMeta | None:
        """The block under ``k`` if the tier holds it or is writing it (``contains``)."""

    def pending(self, k: Key) -> Held | None:
        """The block under ``k`` while it waits for its write-down (served from memory)."""

    def locate(self, k: Key) -> Located | None:
        """The tier's index entry of a block it holds (not one still pending)."""

    def touch(self, k: Key) -> bool:
        """Count a use of ``k`` (most recent in the tier's LRU); False if not held."""

    @property
    def readable(self) -> bool:
        """Whether a ``get`` of what the index names may be served now (True for a local
        tier).  A shared tier whose server answers too slowly skips its reads for a
        while: ``match_prefix`` and ``holds`` then count none of its indexed blocks
        (each would load as ``MISS``), only its pending writes (served from memory)."""

    def put(self, k: Key, held: Held) -> object | None:
        """Plan the write-down of ``held`` (no I/O); ``None`` when there will be none
        (the tier reported the block lost through its ``on_lost`` callback)."""

    def remove(self, k: Key) -> bool:
        """Remove ``k`` (its copy and any pending write-down) even if pinned."""

    def clear(self) -> None:
        """Remove every block; writes in flight are discarded when they finish."""

    def keys(self) -> Iterator[Key]:
        """Held keys, least recently used first."""

    def stats(self) -> TierStats: ...

    # ---- I/O, without the lock
    def get(self, k: Key, entry: Located) -> Fetched:
        """Read and verify the block ``locate`` returned ``entry`` for."""

    def write(self, job: object) -> bool | None:
        """Carry out a planned write-down: ``True`` written, ``False`` failed or
        cancelled, ``None`` handed to the background writer."""

    def drain(self) -> None:
        """Wait until every write-down handed to the background writer is done."""

    def close(self) -> None:
        """Finish pending write-downs, then release the backend (idempotent)."""


def never_pinned(_k: Key) -> bool:
    """The pin test of a tier used on its own (no policy pins anything)."""
    return False


def new_condition() -> threading.Condition:
    """The lock of a tier used on its own (a store hands its tiers its own)."""
    return threading.Condition(threading.Lock())


@dataclass(slots=True)
class StoredRecord:
    """A block a storage tier holds (as far as its index knows); ``size``: its bytes
    there (a record file, a server value)."""

    meta: BlockMeta
    size: int


def record_size(record: StoredRecord) -> int:
    """The LRU size of a :class:`StoredRecord`."""
    return record.size


@dataclass(slots=True)
class WriteJob:
    """A planned write-down: ``held`` waits in the tier's pending map (served from
    memory) until it lands; ``reserved``: its bytes were reserved (disk)."""

    key: Key
    held: Held
    size: int
    reserved: bool = False


class IndexedTier:
    """The index half shared by storage tiers that keep an in-memory LRU of what they
    hold (``_lru``: key -> :class:`StoredRecord`) and of planned writes (``_writing``:
    key -> :class:`Held`); answers lookups from memory, as the contract asks."""

    __slots__ = ()
    _lru: ByteLru[StoredRecord]
    _writing: dict[Key, Held]
    _queue: Sized  # the planned write-downs waiting for the writer
    _evictions: int
    _writes: int
    _write_errors: int
    _corrupt: int
    _foreign: int
    writable: bool

    def find(self, k: Key) -> BlockMeta | None:
        entry = self._writing.get(k) or self._lru.get(k)
        return None if entry is None else entry.meta

    def pending(self, k: Key) -> Held | None:
        return self._writing.get(k)

    def locate(self, k: Key) -> StoredRecord | None:
        return self._lru.get(k)

    @property
    def readable(self) -> bool:
        return True

    def base_stats(self, **extra: int | bool) -> TierStats:
        """The counters every indexed tier keeps (``_evictions``, ``_writes``,
        ``_write_errors``, ``_corrupt``, ``_foreign``, ``_queue``, ``writable``) as a
        :class:`TierStats`; ``extra`` adds a tier's own fields (``outages=...``)."""
        return TierStats(
            blocks=len(self._lru),
            bytes=self._lru.used,
            evictions=self._evictions,
            writes=self._writes,
            write_errors=self._write_errors,
            corrupt=self._corrupt,
            foreign=self._foreign,
            pending=len(self._queue),
            writable=self.writable,
            **extra,
        )
