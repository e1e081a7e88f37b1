"""Offsets across a passage cut (:meth:`promptsplice.dedup._passes.Passes._cut`), by
bisection: from a chunk's bytes before a cut to the bytes left (:class:`CutMap`), and
from the bytes a chunk has now back to its bytes before any passage removal, the
coordinates of its :class:`~promptsplice.dedup.RemovedPassage` records (:class:`Unmap`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate

from ._types import KeptChunk

__all__ = ["CutMap", "Unmap"]


class CutMap:
    """Offsets of the old bytes in the bytes left after removing ``cuts`` (sorted,
    disjoint byte ranges), by bisection: ``m(x)``; ``m.hits(s, e)``: whether a cut
    overlaps ``[s, e)``."""

    __slots__ = ("cuts", "starts", "ends", "shift")

    def __init__(self, cuts: list[tuple[int, int]]) -> None:
        self.cuts = cuts
        self.starts = [s for s, _ in cuts]
        self.ends = [e for _, e in cuts]
        self.shift = list(accumulate((e - s for s, e in cuts), initial=0))

    def __call__(self, x: int) -> int:
        j = bisect_left(self.starts, x) - 1  # the last cut starting before x
        if j < 0:
            return x
        s, e = self.cuts[j]
        return s - self.shift[j] if x < e else x - self.shift[j + 1]

    def hits(self, s: int, e: int) -> bool:
        j = bisect_right(self.ends, s)  # the first cut ending after s
        return j < len(self.starts) and self.starts[j] < e


class Unmap:
    """Offsets of a chunk's bytes now in its bytes before passage removal (the
    coordinates of its own records): the inverse of the cuts, undone the way the
    records are put back (in offset order, each paragraph with the separator after
    it, or before it when it follows everything left).  ``start``: a range starting
    where a removed paragraph was starts after it; ``end``: one ending there ends
    before it."""

    __slots__ = ("points", "shift")

    def __init__(self, k: KeptChunk) -> None:
        own = sorted((r.offset, r.length) for r in k.removed_passages if r.chunk_id == k.id)
        points: list[int] = []
        shift = [0]
        acc = 0
        size = len(k.data)
        for offset, length in own:
            if size != offset - 2:  # put back inside (after it, all go at the end)
                points.append(offset - acc)
                acc += length + 2
                shift.append(acc)
            size += length + 2
        self.points = points
        self.shift = shift

    def start(self, x: int) -> int:
        return x + self.shift[bisect_right(self.points, x)] if self.points else x

    def end(self, x: int) -> int:
        return x + self.shift[bisect_left(self.points, x)] if self.points else x
