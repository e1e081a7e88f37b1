"""Grid anchors: which indexed chunks can contain a needle, found by dict look-ups.

Each indexed chunk contributes its ``K``-byte grams at offsets 0, S, 2S, ... (a grid),
each mapped to the slots (insertion numbers) of the chunks holding it.  A needle of at
least ``MIN_NEEDLE = K + S - 1`` bytes that occurs in a chunk at offset ``o`` covers
the grid point ``o + j`` with ``j = (-o) mod S < S``, and the gram there lies entirely
inside the needle: it is ``needle[j:j + K]``.  So looking up the needle's first ``S``
grams reaches every chunk that contains it, and the needle's grams ``j + S``,
``j + 2S``, ... must be in that chunk too (one of them prunes the candidates).  Every
candidate is confirmed with ``bytes.find``: matches are exact by construction.

Cost: ``len / S`` dict insertions per indexed chunk, ``S`` to ``2S`` look-ups per
needle plus one C search per surviving candidate, instead of one search through every
indexed byte.  Shorter needles (or queries with too many candidates) get ``None``
from :meth:`GridIndex.first` / :meth:`GridIndex.hosts` so callers search the joined
bytes as before.
"""

from __future__ import annotations

__all__ = ["GridIndex", "MIN_NEEDLE"]

K = 16  # gram length
S = 16  # grid stride
MIN_NEEDLE = K + S - 1
_MAX_CANDIDATES = 256  # false candidates per query before the caller searches plainly


class GridIndex:
    """Grid grams of chunks added in order; queries return slots (insertion numbers)."""

    __slots__ = ("grams", "datas")

    def __init__(self) -> None:
        self.grams: dict[bytes, list[int]] = {}
        self.datas: list[bytes] = []

    def add(self, data: bytes) -> None:
        """Index ``data`` as the next slot (posting lists stay ascending, no repeats)."""
        slot = len(self.datas)
        self.datas.append(data)
        grams = self.grams
        for p in range(0, len(data) - K + 1, S):
            gram = data[p : p + K]
            lst = grams.get(gram)
            if lst is None:
                grams[gram] = [slot]
            elif lst[-1] != slot:
                lst.append(slot)

    def _classes(self, needle: bytes):
        """Per grid phase ``j``: the slots holding both the needle's gram at ``j`` and its
        last gram of the same phase (candidates for an occurrence at ``o = -j mod S``)."""
        grams = self.grams
        last_start = len(needle) - K
        for j in range(S):
            lst = grams.get(needle[j : j + K])
            if lst is None:
                continue
            last = j + (last_start - j) // S * S
            if last != j:
                other = grams.get(needle[last : last + K])
                if other is None:
                    continue
                if len(lst) > 1:
                    lst = sorted(set(lst).intersection(other))
            yield lst

    def first(self, needle: bytes) -> tuple[int, int] | None | bool:
        """``(slot, offset)`` of the needle's first occurrence in the lowest slot holding
        it; ``False`` when no indexed chunk holds it; ``None`` when the index cannot
        tell (needle shorter than MIN_NEEDLE, or too many candidates)."""
        if len(needle) < MIN_NEEDLE:
            return None
        datas = self.datas
        best = -1
        misses = 0
        for lst in self._classes(needle):
            for h in lst:  # ascending
                if best >= 0 and h >= best:
                    break
                if needle in datas[h]:
                    best = h
                    break
                misses += 1
            if misses > _MAX_CANDIDATES:
                return None
        if best < 0:
            return False
        return best, datas[best].find(needle)

    def hosts(self, needle: bytes) -> list[int] | None:
        """Every slot whose chunk holds ``needle`` (ascending), or ``None`` when the
        index cannot tell (see :meth:`first`)."""
        if len(needle) < MIN_NEEDLE:
            return None
        found: set[int] = set()
        for lst in self._classes(needle):
            found.update(lst)
            if len(found) > _MAX_CANDIDATES:
                return None
        datas = self.datas
        return [h for h in sorted(found) if needle in datas[h]]
