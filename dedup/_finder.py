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

__all__ = ["Finder", "find", "search_budget"]

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

# CPython's bytes.find (Objects/stringlib/fastsearch.h, 3.10 to 3.13) is linear, the
# two-way search, only for a needle of >= 100 bytes in >= 2,500 bytes (or any of >= 6
# in >= 30,000) that is at most about 3/4 of them.  A shorter haystack gets a simple
# search that may compare up to the needle's length at each offset: on runs of one byte
# that is len(needle) * len(haystack) (200 chunks of < 2 KB took 5.5 s while the budget
# was charged 37 MB); a longer needle an adaptive one that does the same over the last
# 2,000 offsets.  find() gives such searches a haystack that takes the linear path: the
# bytes searched, then _PAD (never in a needle, see _SEP), which makes the haystack
# long enough and, > 2,000 bytes, leaves the adaptive search's last offsets on bytes
# that end no match.  Needles under 100 bytes compare fewer than 100 bytes an offset.
_LINEAR_HAY = 2500
_LINEAR_NEEDLE = 100
_PAD = _SEP * 2560


def search_budget(num_bytes: int) -> int:
    """The bytes the indexed searches of a call over ``num_bytes`` bytes may scan."""
    return _BUDGET * num_bytes + _BUDGET_FLOOR


def find(hay: bytes, needle: bytes, end: int) -> int:
    """``hay.find(needle, 0, end)`` (``end <= len(hay)``) in O(end + len(needle)) time
    for needles of >= _LINEAR_NEEDLE bytes (see _PAD); ``needle`` holds no 0xFF byte
    (valid UTF-8).  A copy of the ``end`` bytes only where CPython's own choice would not
    be linear (short haystacks, or needles of more than 3/4 of them)."""
    m = len(needle)
    if m >= _LINEAR_NEEDLE and (end < _LINEAR_HAY or (m >> 2) * 3 >= (end >> 2)):
        if m > end:
            return -1
        return (hay[:end] + _PAD).find(needle)
    return hay.find(needle, 0, end)


def _first_of(datas: list[bytes], order: list[int], needle: bytes) -> tuple[tuple[int, int] | None, int]:
    """The first occurrence of ``needle`` in ``datas[i]`` for ``i`` in ``order``, earliest
    first: ``(i, offset)`` or None, the answer of searching each in turn; and the bytes of
    the items up to the one holding it (of all of them when none does).

    An item that CPython searches linearly on its own is searched on its own; runs of the
    others are joined (``_SEP``: no match spans two) into haystacks of at least 4 times the
    needle's length, each one linear search (:func:`find`), so the whole costs O(their
    bytes) plus a few times the needle's length."""
    m = len(needle)
    short = m < _LINEAR_NEEDLE  # a simple search, fewer than 100 bytes an offset: as is
    target = max(4 * m + 8, 1 << 14)  # long enough for the two-way search
    scanned = 0
    parts: list[bytes] = []  # a run of items to search joined
    first = 0  # its first item's place in order
    size = -1  # its joined length
    last = len(order) - 1

    def joined() -> tuple[tuple[int, int], int] | None:  # the run's answer, as the one-by-one search's
        hit = _first_in_run(parts, needle, size)
        if hit is None:
            return None
        f, pos = hit
        return (order[first + f], pos), scanned - sum(map(len, parts[f + 1 :]))

    for x, i in enumerate(order):
        d = datas[i]
        n = len(d)
        if short or (n >= _LINEAR_HAY and (m >> 2) * 3 < (n >> 2)):
            if parts:  # the run before it first
                if (found := joined()) is not None:
                    return found
                parts = []
                size = -1
            scanned += n
            pos = d.find(needle)
            if pos >= 0:
                return (i, pos), scanned
            continue
        if not parts:
            first = x
        parts.append(d)
        size += n + 1
        scanned += n
        if size >= target or x == last:
            if (found := joined()) is not None:
                return found
            parts = []
            size = -1
    return None, scanned


def _first_in_run(parts: list[bytes], needle: bytes, size: int) -> tuple[int, int] | None:
    """The first occurrence of ``needle`` in ``parts`` (``size``: their joined length):
    ``(part, offset)``, through one linear search of their joined bytes."""
    if len(parts) == 1:
        pos = find(parts[0], needle, size)
        return None if pos < 0 else (0, pos)
    pos = find(_SEP.join(parts), needle, size)
    if pos < 0:
        return None
    f = 0
    for d in parts:
        if pos <= len(d):  # (a match never starts at a separator)
            return f, pos
        pos -= len(d) + 1
        f += 1
    raise AssertionError("a match past the joined bytes")  # pragma: no cover


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

    __slots__ = (
        "passes", "chunks", "datas", "joined", "hay", "starts", "rank", "searches", "scanned", "cut_short",
    )

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
        self.cut_short = False  # a needle went unsearched in some chunks (budget spent)

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
                order = sorted([i for i in map(rank.get, keys) if i is not None and i < limit])
                over = 0  # the bytes of the first candidate past ``allowed``, not searched
                if spent:  # past the budget, a needle scans at most a few times its bytes
                    allowed = _OWN * len(needle) + _OWN_FLOOR
                    scanned = 0
                    for x, i in enumerate(order):
                        scanned += len(datas[i])
                        if scanned > allowed:
                            over = len(datas[i])
                            del order[x:]
                            self.cut_short = True  # a needle that was not searched everywhere
                            break
                found, scanned = _first_of(datas, order, needle)
                # Charged as if each candidate were searched in turn (the search is linear
                # in their bytes): every one up to the one holding the needle, or all of
                # them and the one past ``allowed``.
                self.charge(scanned if found is not None else scanned + over)
                return found
        if spent:
            self.cut_short = True
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
        pos = find(self.hay, needle, starts[limit] - 1)
        if pos < 0:
            return None
        f = bisect_right(starts, pos) - 1
        return f, pos - starts[f]

    def charge(self, scanned: int) -> None:
        self.scanned += scanned
        self.passes.budget -= scanned
