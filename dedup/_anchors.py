"""Grid anchors: which indexed chunks can contain a needle, found by dict look-ups.

Each indexed chunk contributes its ``K``-byte grams at offsets 0, S, 2S, ... (a grid),
each mapped to the keys of the chunks holding it.  A needle of at least
``MIN_NEEDLE = K + S - 1`` bytes that occurs in a chunk at offset ``o`` covers the grid
point ``o + j`` with ``j = (-o) mod S < S``, and the gram there lies entirely inside the
needle: it is ``needle[j:j + K]``.  So looking up the needle's first ``S`` grams reaches
every chunk that contains it, and the needle's last gram of the same phase ``j`` must be
in that chunk too (it prunes the candidates).  Callers confirm every candidate with a
byte search, so matches are exact by construction.

Cost: ``len / S`` dict insertions per indexed chunk, ``S`` to ``2S`` look-ups per
needle, instead of one search through every indexed byte.  Shorter needles, and needles
with very many candidates (periodic text), get ``None``: the caller searches plainly.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["GridIndex", "MIN_NEEDLE"]

K = 16  # gram length
S = 16  # grid stride
MIN_NEEDLE = K + S - 1
_MAX_CANDIDATES = 256  # per needle; beyond this a plain search is as cheap


class GridIndex:
    """Grid grams of chunks under caller-chosen keys.

    A key may be added again with new bytes (a chunk that was cut): its old grams stay
    behind as harmless extra candidates.  ``grams`` maps a gram to the first key holding
    it and ``more`` to the later ones: most grams are held by one chunk, and one key
    object shared by all of a chunk's grams is cheaper to store than a list per gram.
    """

    __slots__ = ("grams", "more")

    def __init__(self) -> None:
        self.grams: dict[bytes, Hashable] = {}
        self.more: dict[bytes, list] = {}

    def add(self, key: Hashable, data: bytes) -> None:
        """Index the grid grams of ``data`` under ``key``."""
        stop = len(data) - K + 1
        if stop <= 0:
            return
        new = dict.fromkeys(
            map(data.__getitem__, map(slice, range(0, stop, S), range(K, stop + K, S))), key
        )
        grams = self.grams
        common = new.keys() & grams.keys()
        if common:
            more = self.more
            for gram in common:
                del new[gram]
                lst = more.get(gram)
                if lst is None:
                    more[gram] = [key]
                else:
                    lst.append(key)
        grams.update(new)

    def _keys(self, gram: bytes, first: Hashable) -> list:
        lst = self.more.get(gram)
        return [first] if lst is None else [first, *lst]

    def candidates(self, needle: bytes) -> set | None:
        """Keys of every indexed chunk that may hold ``needle`` (a superset of those that
        do), or ``None`` when the index cannot tell: the needle is shorter than
        MIN_NEEDLE, or more than a few hundred chunks qualify."""
        if len(needle) < MIN_NEEDLE:
            return None
        get = self.grams.get
        heads = list(map(get, map(needle.__getitem__, map(slice, range(S), range(K, K + S)))))
        found: set = set()
        if heads.count(None) == S:
            return found
        last_start = len(needle) - K
        for j, first in enumerate(heads):
            if first is None:
                continue
            keys = self._keys(needle[j : j + K], first)
            last = j + (last_start - j) // S * S
            if last != j:
                gram = needle[last : last + K]
                other = get(gram)
                if other is None:
                    continue
                if len(keys) > 1:
                    found.update(set(keys).intersection(self._keys(gram, other)))
                    if len(found) > _MAX_CANDIDATES:
                        return None
                    continue
            found.update(keys)
            if len(found) > _MAX_CANDIDATES:
                return None
        return found
