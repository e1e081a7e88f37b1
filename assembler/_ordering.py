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

``cache_aware`` cannot lose to the orders it could have sent: it lays out each candidate
order on the mirror -- the order this chunk set was last sent in, the ``stable`` order,
the retrieval order and a greedy walk (repeatedly take the remaining chunk that extends
the cached prefix by the most blocks, see :mod:`promptsplice.assembler._layout`, then
the stable order) -- and sends the one with the most predicted cached tokens, ties going
to that list's order.  So it never predicts fewer cached tokens than ``stable`` or
``retrieval`` on the same mirror state, and an exact repeat keeps the order whose blocks
are still cached.

Tried and dropped: the greedy walk alone.  On a customer-support trace (long system
prompt, overlapping windows, most requests re-asking an earlier question) it re-ordered
exact repeats whenever another chunk's blocks happened to be cached first, and lost to
plain canonical order (``promptsplice bench assemble --suite``; README "Trace suite").
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Sequence

from promptsplice.blocks import content_digest
from promptsplice._validate import check_enum, check_int
from promptsplice.errors import ConfigError, UnknownPolicyError

__all__ = [
    "OrderPolicy",
    "AlignPolicy",
    "PopularityTracker",
    "OrderSource",
    "PeekBranches",
    "pick_best",
    "parse_order",
    "parse_align",
]


class _Policy(enum.Enum):
    """A policy named by a string; :meth:`parse` names the valid values on error."""

    @classmethod
    def parse(cls, name: str | enum.Enum) -> _Policy:
        if isinstance(name, cls):
            return name
        try:  # the one enum rule (value or name, any case), as every other option takes it
            return check_enum(name, cls, "policy")
        except ConfigError:
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
    """Online chunk popularity with log2 tiers and a memo of orders per chunk set.

    Every method takes a ``scope`` (the assembler passes the salt's root hash): counts,
    kept orders and sent orders of one scope never shape another's order, so one tenant
    cannot read which chunks another sent from the order its own prompts come in."""

    def __init__(self, max_chunks: int = 1_000_000, max_sets: int = 100_000) -> None:
        check_int(max_chunks, "PopularityTracker max_chunks")  # -1 or "10" failed at the first observe
        check_int(max_sets, "PopularityTracker max_sets")
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self._orders: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._sent: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._max_chunks = max_chunks
        self._max_sets = max_sets
        self._lock = threading.Lock()

    @staticmethod
    def tier(count: int) -> int:
        return count.bit_length()  # 0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3, ...

    def count(self, digest: bytes, *, scope: bytes = b"") -> int:
        with self._lock:
            return self._counts.get(scope + digest, 0)

    def order(self, digests: Sequence[bytes], *, memo: bool = True, scope: bytes = b"") -> list[int]:
        """Indices of ``digests`` in canonical order (does not learn; see observe).  The
        first order of a chunk set is kept, so it stays stable as counts move; with
        ``memo=False`` (a preview) a set not yet seen is ordered without being kept."""
        key = content_digest(scope + b"".join(sorted(digests)))
        with self._lock:
            kept = self._orders.get(key)
            if kept is not None and len(kept) == len(digests):
                if memo:
                    self._orders.move_to_end(key)
                # equal digests (dedup's exact pass off) take their places in index
                # order: the canonical sort below gives them that order too (they were
                # re-sorted by popularity here, and a repeated set changed its prefix)
                places: dict[bytes, list[int]] = {}
                for i, d in enumerate(digests):
                    places.setdefault(d, []).append(i)
                out = []
                for d in kept:
                    free = places.get(d)
                    if not free:
                        break
                    out.append(free.pop(0))
                else:
                    return out
            counts = self._counts
            tiers = [self.tier(counts.get(scope + d, 0)) for d in digests]
        idx = sorted(range(len(digests)), key=lambda i: (-tiers[i], digests[i]))
        if not memo:
            return idx
        with self._lock:
            self._orders[key] = tuple(digests[i] for i in idx)
            while len(self._orders) > self._max_sets:
                self._orders.popitem(last=False)
        return idx

    def remember(self, digests_in_order: Sequence[bytes], *, scope: bytes = b"") -> None:
        """Record the order a chunk set was actually sent in (used by cache_aware); the
        stable order of the set is left as it was."""
        key = content_digest(scope + b"".join(sorted(digests_in_order)))
        with self._lock:
            self._sent[key] = tuple(digests_in_order)
            self._sent.move_to_end(key)
            while len(self._sent) > self._max_sets:
                self._sent.popitem(last=False)

    def last_sent(self, digests: Sequence[bytes], *, touch: bool = True, scope: bytes = b"") -> list[int] | None:
        """Indices of ``digests`` in the order this set was last sent in, or None;
        ``touch=False`` (a preview) leaves the set's place in the LRU as it was."""
        key = content_digest(scope + b"".join(sorted(digests)))
        with self._lock:
            memo = self._sent.get(key)
            if memo is None or len(memo) != len(digests):
                return None
            if touch:
                self._sent.move_to_end(key)
        pos = {d: i for i, d in enumerate(digests)}
        if len(pos) != len(digests) or not all(d in pos for d in memo):
            return None
        return [pos[d] for d in memo]

    def observe(self, digests: Sequence[bytes], *, scope: bytes = b"") -> None:
        """Learn from one request's chunks (after it was assembled)."""
        with self._lock:
            counts = self._counts
            for d in digests:
                k = scope + d
                counts[k] = counts.get(k, 0) + 1
                counts.move_to_end(k)
            while len(counts) > self._max_chunks:
                counts.popitem(last=False)


class OrderSource(enum.Enum):
    """Where a ``cache_aware`` candidate order came from, in tie-break priority."""

    LAST_SENT = "last_sent"
    STABLE = "stable"
    RETRIEVAL = "retrieval"
    GREEDY = "greedy"


class PeekBranches:
    """A read-only view of a branch memory for trial layouts.

    Answers ``check_and_record`` as the memory would, without counting; the keys asked
    are kept, so the layout that is finally sent can :meth:`replay` them into the memory.
    """

    def __init__(self, branches: object) -> None:
        self.branches = branches
        self.keys: list[bytes] = []

    def peek(self, key: bytes) -> bool:
        return self.branches.peek(key)  # type: ignore[attr-defined]

    def check_and_record(self, key: bytes) -> bool:
        self.keys.append(key)
        return self.branches.peek(key)  # type: ignore[attr-defined]

    def replay(self) -> None:
        for key in self.keys:
            self.branches.check_and_record(key)  # type: ignore[attr-defined]


def pick_best(cached_tokens: Sequence[int]) -> int:
    """Index of the candidate with the most predicted cached tokens; ties go to the
    earliest (candidates come in :class:`OrderSource` priority)."""
    best = 0
    for i, c in enumerate(cached_tokens):
        if c > cached_tokens[best]:
            best = i
    return best
