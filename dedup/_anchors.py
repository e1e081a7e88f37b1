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
    """Grid grams of chunks added in order; queries return slots (insertion numbers).

    ``grams`` maps a gram to the first slot holding it, ``more`` to the later ones (in
    ascending order): most grams are held by one chunk, and an int shared by all of
    one chunk's grams is cheaper to store than a list per gram.
    """

    __slots__ = ("grams", "more", "datas")

    def __init__(self) -> None:
        self.grams: dict[bytes, int] = {}
        self.more: dict[bytes, list[int]] = {}
        self.datas: list[bytes] = []

    def add(self, data: bytes) -> None:
        """Index ``data`` as the next slot."""
        slot = len(self.datas)
        self.datas.append(data)
        stop = len(data) - K + 1
        if stop <= 0:
            return
        new = dict.fromkeys(
            map(data.__getitem__, map(slice, range(0, stop, S), range(K, stop + K, S))), slot
        )
        grams = self.grams
        common = new.keys() & grams.keys()
        if common:
            more = self.more
            for gram in common:
                del new[gram]
                lst = more.get(gram)
                if lst is None:
                    more[gram] = [slot]
                else:
                    lst.append(slot)
        grams.update(new)

    def _slots(self, gram: bytes, first: int) -> list[int]:
        lst = self.more.get(gram)
        return [first] if lst is None else [first, *lst]

    def _classes(self, needle: bytes):
        """Per grid phase ``j``: the slots holding both the needle's gram at ``j`` and its
        last gram of the same phase (candidates for an occurrence at ``o = -j mod S``)."""
        get = self.grams.get
        heads = list(map(get, map(needle.__getitem__, map(slice, range(S), range(K, K + S)))))
        if heads.count(None) == S:
            return
        last_start = len(needle) - K
        for j, first in enumerate(heads):
            if first is None:
                continue
            last = j + (last_start - j) // S * S
            lst = self._slots(needle[j : j + K], first)
            if last != j:
                gram = needle[last : last + K]
                other = get(gram)
                if other is None:
                    continue
                if len(lst) > 1:
                    lst = sorted(set(lst).intersection(self._slots(gram, other)))
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
