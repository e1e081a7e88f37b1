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
A phase whose first and last grams are both held by many chunks (chunks made of the
same few sentences) costs the smaller holder count, never the larger; with ``rarest``
up to _PROBES of its other grams are looked up too and the rarest ones decide.
"""

from __future__ import annotations

from collections.abc import Hashable
from operator import itemgetter

__all__ = ["GridIndex", "MIN_NEEDLE"]

K = 16  # gram length
S = 16  # grid stride
MIN_NEEDLE = K + S - 1
_MAX_CANDIDATES = 256  # per needle; beyond this a plain search is as cheap
_FEW = 8  # with ``rarest``, a phase whose two ends leave more keys asks _rarest
_PROBES = 8  # grams between the ends that _rarest looks up, per phase
_ROUNDS = 8  # grams _rarest intersects
_BIG = 64  # a gram held by more chunks than this keeps a set of their keys (``sets``)


class GridIndex:
    """Grid grams of chunks under caller-chosen keys.

    A key may be added again with new bytes (a chunk that was cut): its old grams stay
    behind as harmless extra candidates.  ``grams`` maps a gram to the first key holding
    it and ``more`` to the later ones: most grams are held by one chunk, and one key
    object shared by all of a chunk's grams is cheaper to store than a list per gram.
    """

    __slots__ = ("grams", "more", "sets", "rarest")

    def __init__(self, rarest: bool = False) -> None:
        self.rarest = rarest  # see ``candidates``
        self.grams: dict[bytes, Hashable] = {}
        self.more: dict[bytes, list] = {}
        # gram -> every key holding it, for grams held by more than _BIG keys that were
        # looked up: membership in O(1), so a look-up never walks a long ``more`` list.
        self.sets: dict[bytes, set] = {}

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
            sets = self.sets
            for gram in common:
                del new[gram]
                lst = more.get(gram)
                if lst is None:
                    more[gram] = [key]
                else:
                    lst.append(key)
                    if sets:
                        held = sets.get(gram)
                        if held is not None:
                            held.add(key)
        grams.update(new)

    def _keys(self, gram: bytes, first: Hashable) -> list:
        lst = self.more.get(gram)
        return [first] if lst is None else [first, *lst]

    def _count(self, gram: bytes) -> int:
        """How many keys hold ``gram`` (held by one at least)."""
        lst = self.more.get(gram)
        return 1 if lst is None else 1 + len(lst)

    def _keyset(self, gram: bytes, first: Hashable) -> set:
        """The keys holding ``gram`` as a set (a shared one, not to be changed, for a gram
        held by more than _BIG keys)."""
        lst = self.more.get(gram)
        if lst is None:
            return {first}
        if len(lst) < _BIG:
            return {first, *lst}
        held = self.sets.get(gram)
        if held is None:
            held = self.sets[gram] = {first, *lst}
        return held

    def _both(self, a: bytes, first_a: Hashable, b: bytes, first_b: Hashable) -> list:
        """The keys holding both grams, in O(the smaller holder count)."""
        if self._count(a) > self._count(b):
            a, first_a, b, first_b = b, first_b, a, first_a
        held = self._keyset(b, first_b)
        return [key for key in self._keys(a, first_a) if key in held]

    def candidates(self, needle: bytes) -> set | None:
        """Keys of every indexed chunk that may hold ``needle`` (a superset of those that
        do), or ``None`` when the index cannot tell: the needle is shorter than
        MIN_NEEDLE, or more than a few hundred chunks qualify.

        ``rarest`` (the passes' index): a phase whose first and last grams leave more
        than _FEW keys looks up some of its other grams and keeps the chunks holding the
        rarest ones (:meth:`_rarest`); when both ends are
        held by more than _MAX_CANDIDATES keys, ``None`` only if the rarest is as common.
        Without it a phase keeps the chunks holding both ends, however many (the answer
        it always gave).  Either way every chunk holding the needle is in the answer.
        """
        if len(needle) < MIN_NEEDLE:
            return None
        rarest = self.rarest
        get = self.grams.get
        heads = list(map(get, map(needle.__getitem__, map(slice, range(S), range(K, K + S)))))
        found: set = set()
        if heads.count(None) == S:
            return found
        last_start = len(needle) - K
        for j, first in enumerate(heads):
            if first is None:
                continue
            head = needle[j : j + K]
            last = j + (last_start - j) // S * S
            if last != j:
                gram = needle[last : last + K]
                other = get(gram)
                if other is None:
                    continue
                if self._count(head) > 1:
                    if rarest and min(self._count(head), self._count(gram)) > _MAX_CANDIDATES:
                        keys = self._rarest(needle, j, last, head, first, gram, other)
                        if keys is None:
                            return None
                    else:
                        keys = self._both(head, first, gram, other)
                        if rarest and len(keys) > _FEW:
                            fewer = self._rarest(needle, j, last, head, first, gram, other)
                            if fewer is not None and len(fewer) < len(keys):
                                keys = fewer
                    found.update(keys)
                    if len(found) > _MAX_CANDIDATES:
                        return None
                    continue
            elif self._count(head) > _MAX_CANDIDATES:
                return None  # these keys alone are too many
            found.update(self._keys(head, first))
            if len(found) > _MAX_CANDIDATES:
                return None
        return found

    def _rarest(self, needle, j, last, head, first, gram, other) -> list | None:
        """The keys holding both ends of phase ``j`` (``head`` at ``j``, ``gram`` at
        ``last``) and up to _PROBES grams between them, starting from the rarest one (and
        intersecting up to _ROUNDS); ``[]`` when one of them is held nowhere, ``None`` when
        even the rarest is held by more than _MAX_CANDIDATES keys."""
        get = self.grams.get
        count = self._count
        held = [(count(head), head, first), (count(gram), gram, other)]
        inner = range(j + S, last, S)
        if len(inner) > _PROBES:  # a few, spread over the needle: O(1) look-ups a phase
            inner = inner[:: -(-len(inner) // _PROBES)]
        for at in inner:
            g = needle[at : at + K]
            f = get(g)
            if f is None:
                return []  # no chunk holds this gram: none holds the needle at phase j
            held.append((count(g), g, f))
        held.sort(key=itemgetter(0))
        n, g, f = held[0]
        if n > _MAX_CANDIDATES:
            return None
        keys = self._keys(g, f)
        for _, g, f in held[1:_ROUNDS]:  # the next rarest, while more than one is left
            if len(keys) <= 1:
                break
            has = self._keyset(g, f)
            keys = [key for key in keys if key in has]
        return keys
