"""The passes after exact dedup: overlap merge -> containment -> repeated passages.

They work directly on the output records: each :class:`KeptChunk` is mutated (data,
origins) as other chunks are merged into it, or absorbed into another one (its origins
move there, with their spans shifted), so provenance is carried through every pass.
Every match comes from ``bytes.find`` / ``bytes.rfind`` or is confirmed by one, so it
is exact by construction.

**Sentence-piece filter.**  Every chunk is split into pieces on the byte ``b"."`` and
the pieces are counted.  If a needle occurs inside another chunk H, each *interior*
piece of the needle (one with a dot on both sides inside the needle) is also a whole
piece of H, because a one-byte delimiter cannot be misaligned; so that piece is counted
at least twice (the needle's own chunk and H).  A needle with an interior piece counted
once cannot occur in another chunk, and is not searched.  Needles with fewer than two
dots have no interior piece and are always searched.

**Search.**  The first searches of a pass go through the joined bytes of the chunks it
may find the needle in (one C search each, linear in their bytes); once a pass has made
``_SWITCH`` of them (:mod:`promptsplice.dedup._finder`), it switches to the call's grid anchor index
(:mod:`promptsplice.dedup._anchors`), where a needle finds its candidate chunks by dict
look-ups, so the cost per needle no longer grows with the number of chunks.  Both give
the same answer: the first occurrence in the earliest chunk searched.  The overlap
pass is in :mod:`promptsplice.dedup._overlap`.

**C core.**  Where the optional extension was built (``dedup/_speedups.c``), calls of up
to ``_C_MAX_CHUNKS`` chunks and ``_C_MAX_BYTES`` bytes run the containment and passage
searches there, with a filter of their own (a key per dot, from the 16 bytes around it;
needles without one, in text without ASCII dots, ask a grid-gram index like the one
here) and the same answers (tests/dedup/test_speedups.py); the records are still made here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from itertools import accumulate, chain
from operator import attrgetter, itemgetter

from . import _native, _overlap
from ._anchors import GridIndex
from ._finder import Finder, find, search_budget
from ._normalize import is_blank
from ._offsets import CutMap as _CutMap, Unmap as _Unmap
from ._types import DedupConfig, KeptChunk, Relation, RemovedPassage

__all__ = ["Passes"]

_PARA = b"\n\n"
_DOT = b"."
# False: search every needle the filter would skip.  The filter only skips searches that
# cannot find anything, so the result must not change (tests/dedup checks it).
_FILTER = True
# The C core searches chunk by chunk, O(bytes) per needle its dot filter lets through,
# like the plain search here (needles without a dot key ask its gram index); larger
# calls use the Python passes, whose grid index answers in O(1) per needle.  Typical
# requests (tens of chunks) are far below both limits.
_C_MAX_CHUNKS = 64
_C_MAX_BYTES = 1 << 18
_DATA = attrgetter("data")
_UNBOUNDED = 1 << 62  # a budget no call within the C core's limits can spend
_OFFSET = itemgetter(1)
_KEPT = Relation.KEPT
_CONTAINED = Relation.CONTAINED
_PASSAGES = Relation.PASSAGES


def _core_for(kept: list[KeptChunk]):
    """The C core where it was built and the call is within its limits, else None."""
    core = _native.core
    if core is None or len(kept) > _C_MAX_CHUNKS:
        return None
    return core if sum(map(len, map(_DATA, kept))) <= _C_MAX_BYTES else None


def _probe(pieces: list[bytes]) -> bytes | None:
    """An interior piece of a dot-split needle (preferably a long one), or None."""
    if len(pieces) < 3:
        return None
    p = pieces[1]
    if len(p) >= 24 or len(pieces) == 3:
        return p
    return max(pieces[1:-1], key=len)


class Passes:
    """Overlap, containment and passage passes over the kept chunks of one call."""

    __slots__ = (
        "cfg", "removed", "removed_bytes", "refs", "partial", "counts", "_grid", "budget", "_apart", "_pass",
        "starts",
    )  # fmt: skip

    def __init__(self, cfg: DedupConfig, removed: dict, removed_bytes: dict) -> None:
        self.cfg = cfg
        self.removed = removed
        self.removed_bytes = removed_bytes
        # RemovedPassage records whose found_in is a given chunk, by id(chunk): fixed up
        # if that chunk is later absorbed by containment.
        self.refs: dict[int, list[RemovedPassage]] = {}
        # Origins (by id) whose span lost bytes to a cut: no longer their input's exact
        # bytes, so a later round never moves one elsewhere as CONTAINED.  The value:
        # (id of that chunk, the input's exact range in its bytes before passage removal).
        self.partial: dict[int, tuple[int, int, int]] = {}
        self.counts: Counter | None = None  # piece -> occurrences (see module doc)
        self._grid: tuple[GridIndex, dict[int, bytes]] | None = None
        self.budget: int | None = None  # bytes the indexed searches may still scan
        # The chunks out of each containment pass that searched every needle everywhere
        # (by id: the chunk, its bytes then, the pass): none lies inside another of its pass.
        self._apart: dict[int, tuple[KeptChunk, bytes, int]] = {}
        self._pass = 0  # containment passes run
        # Where each chunk's text starts in its source (DedupConfig.start_key), by id:
        # (the chunk, its bytes then, the offset or None); a chunk whose bytes are not
        # those any more (cut by the passage pass) is no slice of its source.  None: no
        # input carries an offset (:mod:`promptsplice.dedup._overlap`).
        self.starts: dict[int, tuple[KeptChunk, bytes, int | None]] | None = None

    def fund(self, kept: list[KeptChunk]) -> None:
        """Set the call's search budget from its bytes, at its first search pass (later
        passes see fewer bytes)."""
        if self.budget is None:
            size = sum(map(len, map(_DATA, kept)))
            # within the C core's limits the Python passes search as it does, without a
            # budget: a machine without the compiled core sent other prompts for the same
            # request once the budget ran out (64 chunks of a few shared sentences)
            within_core = len(kept) <= _C_MAX_CHUNKS and size <= _C_MAX_BYTES
            self.budget = _UNBOUNDED if within_core else search_budget(size)

    def grid(self) -> tuple[GridIndex, dict[int, bytes]]:
        """The call's grid index of chunks by ``id``, and the bytes indexed for each."""
        if self._grid is None:
            self._grid = (GridIndex(rarest=True), {})
        return self._grid

    def apart(self, chunks: list[KeptChunk]) -> bool:
        """Whether no chunk of ``chunks`` lies inside another: one containment pass left
        them all, with these bytes, and searched every needle (no budget cut one short)."""
        known = self._apart
        token = None
        for k in chunks:
            seen = known.get(id(k))
            if seen is None or seen[0] is not k or seen[1] is not k.data:
                return False
            if token is None:
                token = seen[2]
            elif seen[2] != token:
                return False
        return True

    def _contained_all(self, out: list[KeptChunk], exact: bool) -> list[KeptChunk]:
        """Record the chunks left by a containment pass for :meth:`apart`, if exact."""
        self._pass += 1
        if exact:
            known = self._apart
            token = self._pass
            for k in out:
                known[id(k)] = (k, k.data, token)
        return out

    # -- sentence-piece filter -----------------------------------------------------------

    def index(self, kept: list[KeptChunk]) -> tuple[Counter, list[list[bytes]]]:
        """Split every chunk on b"." and count the pieces; the split is aligned with
        ``kept`` as it was when the index was built (empty if it was built before).

        Built once and reset whenever a chunk's bytes change.  Counts only ever
        over-approximate (a piece repeated inside one chunk), which makes the filter
        search more, never less.
        """
        split: list[list[bytes]] = []
        if self.counts is None:
            split = [k.data.split(_DOT) for k in kept]
            self.counts = Counter(chain.from_iterable(split))
        return self.counts, split

    # -- overlap ---------------------------------------------------------------------

    def merge_overlaps(self, kept: list[KeptChunk], after_passages: bool = False) -> list[KeptChunk]:
        """Merge chains of same-source chunks whose tail/head overlap by >= min_overlap
        (:mod:`promptsplice.dedup._overlap`)."""
        return _overlap.merge_overlaps(self, kept, after_passages)

    # -- containment -----------------------------------------------------------------

    def absorb_contained(self, kept: list[KeptChunk]) -> list[KeptChunk]:
        """Absorb every chunk whose bytes occur inside another kept chunk.

        Chunks are ordered longest first; each one is searched only in the chunks
        before it (at least as long, so an identical chunk left by an overlap merge or
        with ``exact=False`` is caught too).
        """
        core = _core_for(kept)
        if core is not None:
            self.counts = None  # the C core keeps its own filter; no piece index here
            out = self._absorb_all(kept, core.contained(list(map(_DATA, kept))), None)
            return self._contained_all(out, True)
        lens = list(map(len, map(_DATA, kept)))
        order = sorted(range(len(kept)), key=lens.__getitem__, reverse=True)  # stable
        host: dict[int, tuple[int, int]] = {}  # rank in order -> (host rank, offset)
        self.counts = None  # containment always indexes the chunks it is given
        counts, split = self.index(kept)
        self.fund(kept)
        finder = datas = None
        for r in range(1, len(order)):
            pl = split[order[r]]
            if (
                len(pl) >= 3
                and counts[pl[1] if len(pl[1]) >= 24 else _probe(pl)] < 2
                and _FILTER
            ):
                continue  # an interior piece seen only here: not inside another chunk
            if finder is None:
                chunks = list(map(kept.__getitem__, order))
                datas = list(map(_DATA, chunks))
                finder = Finder(self, chunks, datas)
            found = finder.first(datas[r], r)  # type: ignore[index]
            if found is None:
                continue
            h, offset = found
            if h in host:  # found inside an absorbed chunk: map into that one's host
                h, extra = host[h]
                offset += extra
            host[r] = (h, offset)
        moves = [(order[r], order[h], offset) for r, (h, offset) in host.items()]
        out = self._absorb_all(kept, moves, split)
        return self._contained_all(out, finder is None or not finder.cut_short)

    def _absorb_all(self, kept, moves, split) -> list[KeptChunk]:
        """Absorb ``kept[z]`` into ``kept[h]`` at ``offset`` for each ``(z, h, offset)``
        of ``moves``; ``split`` (the piece index's split, aligned with ``kept``) keeps
        the counts exact for what is left, when there is a piece index."""
        if not moves:
            return kept
        gone = set()
        counts = self.counts
        for z_at, h, offset in moves:
            z = kept[z_at]
            if split is not None and counts is not None:
                counts.subtract(split[z_at])  # keep the filter exact for what is left
            self._absorb(kept[h], z, offset)
            gone.add(id(z))
            self.removed["contained"] += 1
            self.removed_bytes["contained"] += len(z.data)
        return [k for k in kept if id(k) not in gone]

    def _absorb(self, host: KeptChunk, z: KeptChunk, offset: int) -> None:
        """Move ``z``'s provenance into ``host``, where z's bytes sit at ``offset``."""
        for o in z.origins:
            if o.span is not None:
                s, e = o.span
                o.span = (s + offset, e + offset)
                o.relation = _CONTAINED
        host.origins.extend(z.origins)
        host.removed_passages.extend(z.removed_passages)
        moved = self.take_refs(z, host, offset)
        if moved:
            self.refs.setdefault(id(host), []).extend(moved)

    def take_refs(self, src: KeptChunk, host: KeptChunk, offset: int) -> list[RemovedPassage]:
        """Detach the records of passages found in ``src`` and point them at ``host``,
        where src's bytes sit at ``offset``; the caller files them under ``host``
        (after detaching every chunk that moves, so none is shifted twice)."""
        moved = self.refs.pop(id(src), None) or []
        for rp in moved:
            rp.found_in = host.id
            rp.found_at += offset
        return moved

    # -- repeated passages -----------------------------------------------------------

    def remove_passages(self, kept: list[KeptChunk]) -> list[KeptChunk]:
        """Remove paragraphs (>= min_passage bytes) already present in an earlier chunk."""
        cfg = self.cfg
        mp = cfg.min_passage
        # After containment no chunk sits inside another, so a chunk that is a single
        # paragraph cannot be found in an earlier one: only split chunks can match.
        whole_chunks = not cfg.containment
        core = _core_for(kept)
        if core is not None:
            out, changed = self._remove_passages_c(core, kept, mp, whole_chunks)
            return self._passages_fixpoint(out, changed)
        counts = self.index(kept)[0]
        self.fund(kept)
        out: list[KeptChunk] = []
        # A search for chunk j's paragraphs only sees the chunks before it, final by
        # then; the joined bytes also hold the chunks after them, unchanged until cut.
        out_datas: list[bytes] = []
        j = 0
        finder = Finder(self, out, out_datas, lambda: out_datas + list(map(_DATA, kept[j:])))
        changed = False
        for j, k in enumerate(kept):
            d = k.data
            if not out or len(d) < mp:
                out.append(k)
                out_datas.append(d)
                continue
            paras = _paragraphs(d)
            if len(paras) == 1 and not whole_chunks:
                out.append(k)
                out_datas.append(d)
                continue
            hits = None
            offsets = None  # each paragraph's offset in d, made at the first hit
            for i, p in enumerate(paras):
                if len(p) < mp:
                    continue
                first, dot, _ = p.partition(_DOT)[2].partition(_DOT)
                if dot and counts[first] < 2 and _FILTER:
                    continue  # its first interior piece occurs in no other chunk
                found = finder.first(p, len(out))
                if found is not None:
                    f, at = found
                    if offsets is None:  # (summed per hit, it was quadratic in paragraphs)
                        offsets = list(accumulate((len(q) + 2 for q in paras), initial=0))
                    offset = offsets[i]
                    if hits is None:
                        hits = []
                    hits.append((i, offset, len(p), out[f], at))
            if hits is not None:
                changed = True
                finder.reset()  # bytes change (or a chunk goes): join again when needed
                if not self._cut(k, paras, hits):
                    continue  # emptied: attached to an earlier chunk
            out.append(k)
            out_datas.append(k.data)
        return self._passages_fixpoint(out, changed)

    def _remove_passages_c(self, core, kept, mp, whole_chunks) -> tuple[list[KeptChunk], bool]:
        """The loop of :meth:`remove_passages` in the C core, one call for the pass: it
        calls back for each chunk with hits, which is cut here (its new bytes go back;
        ``None`` when it is gone, attached to an earlier chunk)."""
        out = list(kept)
        changed = False

        def cut(j: int, raw: list) -> bytes | None:
            nonlocal changed
            changed = True
            k = out[j]
            hits = [(i, offset, length, out[h], at) for i, offset, length, h, at in raw]
            if self._cut(k, _paragraphs(k.data), hits):
                return k.data
            del out[j]
            return None

        core.passage_scan(list(map(_DATA, out)), mp, whole_chunks, cut)
        return out, changed

    def _passages_fixpoint(self, out: list[KeptChunk], changed: bool) -> list[KeptChunk]:
        cfg = self.cfg
        if changed:
            self.counts = None  # some bytes changed: the piece index is stale
        if changed and cfg.containment and len(out) >= 2:
            # A shortened chunk may now sit inside another one (or contain one, through
            # a new paragraph junction): absorb those too, so that the output is a
            # fixpoint: dedup(output texts) changes nothing.
            out = self.absorb_contained(out)
        elif changed and cfg.exact and len(out) >= 2:
            out = self.merge_identical(out)  # the same fixpoint without containment
        return out

    def merge_identical(self, kept: list[KeptChunk]) -> list[KeptChunk]:
        """Passages or overlap merges can leave two chunks byte-identical: the later one
        is absorbed into the first (at offset 0) and counted as a duplicate."""
        first: dict[bytes, KeptChunk] = {}
        out = []
        for k in kept:
            host = first.setdefault(k.data, k)
            if host is k:
                out.append(k)
                continue
            self._absorb(host, k, 0)
            self.removed["duplicate"] += 1
            self.removed_bytes["duplicate"] += len(k.data)
        return out


    def _cut(self, k: KeptChunk, paras, hits) -> bool:
        """Apply passage hits to ``k``; False when nothing but whitespace is left.

        ``hits`` are ``(paragraph index, offset, length, chunk holding it, offset there)``,
        in paragraph order.  In a later round (see ``dedup``) ``k`` may hold passages found
        for earlier records; when one of them would lose its bytes, ``k`` is left as it is.
        Every origin is placed with one bisection over the hits and cuts (it compared
        each origin with every hit: quadratic for a chunk with many of both).
        """
        if any(hits[x][1] > hits[x + 1][1] for x in range(len(hits) - 1)):
            hits = sorted(hits, key=_OFFSET)
        gone = {h[0] for h in hits}
        new = _PARA.join([p for i, p in enumerate(paras) if i not in gone])
        old = k.data
        emptied = not new or is_blank(new.decode("utf-8"))
        cuts = None
        if not emptied:
            # Removed byte ranges in old coordinates: each paragraph with one adjacent
            # separator (the following one; the preceding one after the last kept
            # paragraph), which leaves exactly b"\n\n".join(kept paragraphs).
            last_kept = max(i for i in range(len(paras)) if i not in gone)
            cuts = []
            for i, offset, length, _, _ in hits:
                if i < last_kept:
                    cuts.append((offset, offset + length + 2))
                else:
                    cuts.append((offset - 2, offset + length))
        cut_map = None if cuts is None else _CutMap(cuts)
        hit_starts = [h[1] for h in hits]
        refs = self.refs
        found_here = refs.get(id(k))  # passages of earlier records found in k
        moves = None
        if found_here:
            moves = _relocate(found_here, old, new, hits, hit_starts, cut_map)
            if moves is None:
                return True  # a recorded passage would lose its bytes: k stays whole
            del refs[id(k)]

        records = []
        # A chunk cut again keeps its records in the coordinates of its bytes before
        # any passage removal (``unmap`` takes offsets there from the bytes it has now).
        unmap = _Unmap(k)
        for _, offset, length, found, at in hits:
            rp = RemovedPassage(k.id, unmap.start(offset), length, found.id, at)
            refs.setdefault(id(found), []).append(rp)
            records.append(rp)
        self.removed["passage"] += len(hits)
        if moves:
            for rp, host, at in moves:
                host = k if host is None else host
                rp.found_in, rp.found_at = host.id, at
                refs.setdefault(id(host), []).append(rp)

        # An input that lay inside one removed paragraph moves to the chunk where that
        # paragraph was found, as CONTAINED there; the KEPT input never moves (it names
        # the chunk and its records).  An input that lost bytes in an earlier round
        # does not move either: its span is not its text.
        partial = self.partial
        staying = [k.origins[0]]
        for o in k.origins[1:]:
            if o.span is not None and id(o) not in partial:
                s, e = o.span
                x = bisect_right(hit_starts, s) - 1  # the only paragraph that can hold it
                if x >= 0 and e <= hit_starts[x] + hits[x][2]:
                    _, offset, _, found, at = hits[x]
                    o.span = (at + s - offset, at + e - offset)
                    o.relation = _CONTAINED
                    found.origins.append(o)
                    continue
            staying.append(o)

        if emptied:
            # Every paragraph was already present: the chunk goes, and the inputs left
            # are attached to the chunk holding its first removed passage, as PASSAGES,
            # each with its byte range in k's bytes before passage removal (the
            # coordinates of k's records, which go with them): ``Origin.emptied``.
            kid = id(k)
            for o in staying:
                if o.span is None:  # emptied before, with records of its own chunk
                    continue
                s, e = o.span
                known = partial.get(id(o))
                if known is not None and known[0] == kid:
                    s, e = known[1], known[2]  # its exact range, kept when it lost bytes
                else:  # exact, or (lost bytes elsewhere before) what remains of it
                    s, e = unmap.start(s), unmap.end(e)
                    if e < s:
                        e = s
                o.relation = _PASSAGES
                o.span = None
                o.emptied = (k.id, s, e)
            host = hits[0][3]
            host.origins.extend(staying)
            host.removed_passages.extend(k.removed_passages)
            host.removed_passages.extend(records)
            self.removed_bytes["passage"] += len(old)
            return False

        # Spans shrink to what remains of each input (possibly nothing).  An input that
        # loses bytes here keeps its exact range in k's coordinates before passage
        # removal, for the PASSAGES origin it becomes if a later round empties k.
        k.origins = staying
        for o in staying:
            if o.span is not None:
                s, e = o.span
                if id(o) not in partial and cut_map.hits(s, e):  # type: ignore[union-attr]
                    partial[id(o)] = (id(k), unmap.start(s), unmap.end(e))
                o.span = (cut_map(s), cut_map(e))  # type: ignore[misc]
        k.removed_passages.extend(records)
        k.data = new
        k.text = k.digest = None  # type: ignore[assignment]
        self.removed_bytes["passage"] += len(old) - len(new)
        return True


def _relocate(found_here: list[RemovedPassage], old: bytes, new: bytes, hits, hit_starts, cut_map):
    """Where each record of a passage found in a chunk about to be cut (only in a later
    round) finds its bytes afterwards: ``[(record, chunk, offset)]``, ``k`` itself named
    by ``None`` until the caller knows it, or None when one would find them nowhere.

    Inside a removed paragraph: where that paragraph was found.  Otherwise where its
    offset maps to in what is left, if the bytes are there (a passage can hold one byte
    of a separator the cut takes), else anywhere in what is left or in those chunks.
    """
    moves = []
    for rp in found_here:
        s, e = rp.found_at, rp.found_at + rp.length
        piece = old[s:e]
        place = None
        x = bisect_right(hit_starts, s) - 1
        if x >= 0 and e <= hit_starts[x] + hits[x][2]:
            _, offset, _, found, at = hits[x]
            place = (found, at + s - offset)
        else:
            at = cut_map(s) if cut_map is not None else -1
            if at < 0 or new[at : at + len(piece)] != piece:
                at = find(new, piece, len(new)) if cut_map is not None else -1
            if at >= 0:
                moves.append((rp, None, at))
                continue
            for _, _, _, found, _ in hits:
                at = find(found.data, piece, len(found.data))
                if at >= 0:
                    place = (found, at)
                    break
        if place is None:
            return None
        moves.append((rp, *place))
    return moves


def _paragraphs(d: bytes) -> list[bytes]:
    """``d.split(b"\\n\\n")``, faster for the common layout of one line per paragraph.

    Splitting on one byte uses memchr; when the lines alternate text / empty (an odd
    count), the text lines are exactly the paragraphs.
    """
    if b"\n" not in d:
        return [d]
    lines = d.split(b"\n")
    if len(lines) & 1 and not any(lines[1::2]):
        return lines[::2]
    return d.split(_PARA)
