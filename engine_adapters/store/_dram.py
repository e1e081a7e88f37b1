"""The memory tier of the block store: payload tensors in an LRU bounded in bytes.

The first tier of a :class:`~promptsplice.engine_adapters.store.BlockStore`: a hit here
costs no I/O and no verification (the tensor is the one ``put`` stored).  Admitting a
block evicts the least recently used unpinned ones and hands them back to the policy,
which writes them down to the storage tiers that lack them.  Like every tier it runs
under the store's lock (see ``_tier``) and imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from promptsplice.engine_adapters.store._tier import BlockMeta, ByteLru, Held, Key, TierStats, never_pinned

__all__ = ["DramTier"]


def _payload_size(held: Held) -> int:
    return held.meta.nbytes


class DramTier:
    """At most ``budget`` bytes of payload, least recently used evicted first."""

    name = "dram"

    def __init__(self, budget: int, *, pinned: Callable[[Key], bool] = never_pinned) -> None:
        self._lru: ByteLru[Held] = ByteLru(budget, _payload_size)
        self._pinned = pinned
        self._evictions = 0

    def get(self, k: Key) -> Held | None:
        """The block under ``k`` (no LRU change: the policy touches it on a hit)."""
        return self._lru.get(k)

    def find(self, k: Key) -> BlockMeta | None:
        held = self._lru.get(k)
        return None if held is None else held.meta

    def holds(self, k: Key, held: Held) -> bool:
        """True while this very entry is the tier's block under ``k``."""
        return self._lru.get(k) is held

    def touch(self, k: Key) -> bool:
        if k not in self._lru:
            return False
        self._lru.touch(k)
        return True

    def admit(self, k: Key, held: Held) -> list[tuple[Key, Held]] | None:
        """Insert ``held`` as the most recent block; returns the blocks it evicted.

        ``None`` (nothing changed) when it does not fit: larger than the budget, or the
        rest of the budget is pinned.
        """
        victims = self._lru.victims(held.meta.nbytes, self._pinned)
        if victims is None:
            return None
        gone = []
        for vk in victims:
            entry = self._lru.pop(vk)
            assert entry is not None
            self._evictions += 1
            gone.append((vk, entry))
        self._lru.add(k, held)
        return gone

    def remove(self, k: Key) -> bool:
        return self._lru.pop(k) is not None

    def clear(self) -> None:
        self._lru.clear()

    def keys(self) -> Iterator[Key]:
        return iter(self._lru)

    def items(self) -> Iterator[tuple[Key, Held]]:
        return self._lru.items()

    def stats(self) -> TierStats:
        return TierStats(blocks=len(self._lru), bytes=self._lru.used, evictions=self._evictions)
