"""The search of the passes (:mod:`promptsplice.dedup._passes`): the first
occurrence of a needle among a pass's chunks, through their joined bytes, then the
call's grid index (:mod:`promptsplice.dedup._anchors`), within the call's search budget.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from typing import Protocol

from ._anchors import MIN_NEEDLE, GridIndex
from ._types import KeptChunk

__all__ = ["Finder", "search_budget"]

# Joins chunks into one haystack.  0xFF never occurs in valid UTF-8 and every needle is
# a slice of valid UTF-8, so no match can cross a separator.
_SEP = b"\xff"
_SWITCH = 32  # plain searches (or haystack rebuilds) of one pass before it indexes
# Bytes the indexed searches of one call may scan (candidates' bytes, plain searches and
# rebuilds of the joined bytes, for needles of >= MIN_NEEDLE bytes): _BUDGET times the
# call's bytes, plus _BUDGET_FLOOR.  Typical text scans a few times its bytes; chunks
# made of the same few sentences made it O(n * N) (2.2 MB: 6.7 s).  See _Finder.first.
_BUDGET = 64
_BUDGET_FLOOR = 1 << 26
_OWN = 16  # past the budget, a needle may still scan _OWN times its bytes + _OWN_FLOOR
_OWN_FLOOR = 1 << 14


def search_budget(num_bytes: int) -> int:
    """The bytes the indexed searches of a call over ``num_bytes`` bytes may scan."""
    return _BUDGET * num_bytes + _BUDGET_FLOOR


def _starts(datas: list[bytes]) -> list[int]:
    """Offsets of each item in ``_SEP.join(datas)``."""
    out = []
    p = 0
    for d in datas:
        out.append(p)
        p += len(d) + 1
    return out


class _Call(Protocol):
    """What a search needs of its call (:class:`~promptsplice.dedup._passes.Passes`)."""

    budget: int | None  # bytes the indexed searches may still scan

    def grid(self) -> tuple[GridIndex, dict[int, bytes]]: ...


class Finder:
    """The first occurrence of a needle in ``datas[:limit]``: ``(item, offset)`` or None.

    ``chunks`` are the KeptChunks whose bytes ``datas`` holds; the caller may append to
    both, and ``limit`` never decreases.  Searches the joined bytes until ``_SWITCH``
    searches (or rebuilds of the joined bytes) were made, then the call's grid index,
    shared by every pass (a chunk is indexed again only when its bytes changed);
    needles the index cannot answer still go through the joined bytes.
    """

    __slots__ = ("passes", "chunks", "datas", "joined", "hay", "starts", "rank", "searches", "scanned")

    def __init__(
        self,
        passes: _Call,
        chunks: list[KeptChunk],
        datas: list[bytes],
        joined: Callable[[], list[bytes]] | None = None,
    ) -> None:
        self.passes = passes
        self.chunks = chunks
        self.datas = datas
        self.joined = joined  # () -> the byte strings to join, datas[:limit] first
        self.hay = b""
        self.starts: list[int] = []
        self.rank: dict[int, int] | None = None  # id(chunk) -> item, once indexing
        self.searches = 0
        self.scanned = 0  # bytes the indexed searches scanned (charged to passes.budget)

    def reset(self) -> None:
        """Bytes in the joined haystack changed: join again at the next plain search."""
        self.starts = []

    def first(self, needle: bytes, limit: int) -> tuple[int, int] | None:
        """The first occurrence of ``needle`` in ``datas[:limit]``: ``(item, offset)``.

        Once indexing, a needle of >= MIN_NEEDLE bytes costs its candidates' bytes, or,
        when the index cannot tell, the joined bytes.  Past the call's budget (``_BUDGET``
        times its bytes; never on typical text) it is searched only in the candidates
        that fit in ``_OWN`` times its bytes, else reported as found nowhere: adversarial
        input (chunks of a few shared sentences) is then less deduplicated, never wrong.
        """
        if self.rank is None and self.searches >= _SWITCH and len(needle) >= MIN_NEEDLE:
            self.rank = {}
        rank = self.rank
        charged = rank is not None and len(needle) >= MIN_NEEDLE
        spent = charged and self.passes.budget <= 0  # then: only what the index answers
        if rank is not None:
            grid, indexed = self.passes.grid()
            chunks = self.chunks
            for i in range(len(rank), limit):
                k = chunks[i]
                key = id(k)
                if indexed.get(key) is not k.data:
                    indexed[key] = k.data
                    grid.add(key, k.data)
                rank[key] = i
            keys = grid.candidates(needle)
            if keys is not None:
                # Earliest candidate first: the first one holding the needle answers.
                datas = self.datas
                scanned = 0
                found = None
                # Past the budget, a needle scans at most a few times its own bytes.
                allowed = _OWN * len(needle) + _OWN_FLOOR if spent else -1
                for i in sorted([i for i in map(rank.get, keys) if i is not None]):
                    if i >= limit:
                        break
                    d = datas[i]
                    scanned += len(d)
                    if scanned > allowed >= 0:
                        break
                    pos = d.find(needle)
                    if pos >= 0:
                        found = i, pos
                        break
                self.charge(scanned)
                return found
        if spent:
            return None  # the call's search budget is spent: found nowhere (see above)
        self.searches += 1
        starts = self.starts
        if len(starts) <= limit:  # the joined bytes do not cover datas[:limit]
            self.searches += 1
            items = self.datas if self.joined is None else self.joined()
            self.hay = _SEP.join(items)
            starts = self.starts = _starts(items)
            starts.append(len(self.hay) + 1)
            if charged:
                self.charge(len(self.hay))
        if charged:
            self.charge(starts[limit])
        pos = self.hay.find(needle, 0, starts[limit] - 1)
        if pos < 0:
            return None
        f = bisect_right(starts, pos) - 1
        return f, pos - starts[f]

    def charge(self, scanned: int) -> None:
        self.scanned += scanned
        self.passes.budget -= scanned
