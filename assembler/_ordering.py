"""Chunk ordering policies: ``retrieval``, ``stable`` and ``cache_aware``.

Prefix caching only pays when the same chunks come in the same order, so the order must
not depend on the retriever's whims.  ``stable`` orders a chunk set canonically:
popularity learned online from the traffic first (popular chunks come first, so they
form the shared prefix), content hash as the tie break.

Tried and dropped: ordering by the raw online count.  The order then flaps between two
repeats of one question (a chunk overtakes another by one request) and every flap
misses the cache; on a repeat-heavy trace that was worse than retrieval order.  Counts
are therefore bucketed into log2 *tiers* (hysteresis: a chunk changes rank only when its
count doubles), and a chunk set seen before keeps the order it got the first time
(bounded memo), so the same set always gives the same prefix.

``cache_aware`` is a greedy walk over the mirror: it starts from the stable order and
repeatedly takes the remaining chunk that extends the cached prefix by the most blocks
(see :mod:`promptsplice.assembler._layout`), then falls back to the stable order.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Sequence

from promptsplice.blocks import content_digest
from promptsplice.errors import UnknownPolicyError

__all__ = ["OrderPolicy", "AlignPolicy", "PopularityTracker", "parse_order", "parse_align"]


class _Policy(enum.Enum):
    """A policy named by a string; :meth:`parse` names the valid values on error."""

    @classmethod
    def parse(cls, name: str | enum.Enum) -> _Policy:
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise UnknownPolicyError(
                f"unknown {cls._what()} policy {name!r}; use one of: {names}"
            ) from None

    @classmethod
    def _what(cls) -> str:
        return "ordering" if cls is OrderPolicy else "alignment"


class OrderPolicy(_Policy):
    RETRIEVAL = "retrieval"
    STABLE = "stable"
    CACHE_AWARE = "cache_aware"


class AlignPolicy(_Policy):
    NONE = "none"
    ALL = "all"
    AUTO = "auto"


def parse_order(policy: str | OrderPolicy) -> OrderPolicy:
    return OrderPolicy.parse(policy)  # type: ignore[return-value]


def parse_align(policy: str | AlignPolicy) -> AlignPolicy:
    return AlignPolicy.parse(policy)  # type: ignore[return-value]


class PopularityTracker:
    """Online chunk popularity with log2 tiers and a memo of orders per chunk set."""

    def __init__(self, max_chunks: int = 1_000_000, max_sets: int = 100_000) -> None:
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self._orders: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._max_chunks = max_chunks
        self._max_sets = max_sets
        self._lock = threading.Lock()

    @staticmethod
    def tier(count: int) -> int:
        return count.bit_length()  # 0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3, ...

    def count(self, digest: bytes) -> int:
        with self._lock:
            return self._counts.get(digest, 0)

    def order(self, digests: Sequence[bytes]) -> list[int]:
        """Indices of ``digests`` in canonical order (does not learn; see observe)."""
        key = content_digest(b"".join(sorted(digests)))
        with self._lock:
            memo = self._orders.get(key)
            if memo is not None and len(memo) == len(digests):
                self._orders.move_to_end(key)
                pos = {d: i for i, d in enumerate(digests)}
                if all(d in pos for d in memo):
                    return [pos[d] for d in memo]
            counts = self._counts
            tiers = [self.tier(counts.get(d, 0)) for d in digests]
        idx = sorted(range(len(digests)), key=lambda i: (-tiers[i], digests[i]))
        with self._lock:
            self._orders[key] = tuple(digests[i] for i in idx)
            while len(self._orders) > self._max_sets:
                self._orders.popitem(last=False)
        return idx

    def remember(self, digests_in_order: Sequence[bytes]) -> None:
        """Pin the order a chunk set was actually sent in (used by cache_aware)."""
        key = content_digest(b"".join(sorted(digests_in_order)))
        with self._lock:
            self._orders[key] = tuple(digests_in_order)
            self._orders.move_to_end(key)
            while len(self._orders) > self._max_sets:
                self._orders.popitem(last=False)

    def observe(self, digests: Sequence[bytes]) -> None:
        """Learn from one request's chunks (after it was assembled)."""
        with self._lock:
            counts = self._counts
            for d in digests:
                counts[d] = counts.get(d, 0) + 1
                counts.move_to_end(d)
            while len(counts) > self._max_chunks:
                counts.popitem(last=False)
