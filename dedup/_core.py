"""The dedup passes: empty -> exact -> overlap merge -> containment -> repeated passages.

Everything is byte-exact on UTF-8.  Hash matches (xxh3-128 via ``content_digest``) are
always confirmed by comparing bytes; every other match comes from ``bytes.find`` /
``bytes.rfind`` (CPython's two-way search, in C), so it is exact by construction.

The passes work directly on the output records: each :class:`KeptChunk` is created
when its first input is seen and is then mutated (data, origins) as later passes merge
other chunks into it, or absorbed into another one (its origins move there, with their
spans shifted).  So provenance is carried through every pass and nothing is lost.

**Sentence-piece filter.**  Containment and passage matches are found with
``bytes.find``, but most searches are skipped by a necessary condition that costs one
``split`` and one hash per byte: every chunk is split into pieces on the byte ``b"."``
and the pieces are counted.  If a needle occurs inside a chunk H, each *interior*
piece of the needle (one with a dot on both sides inside the needle) is also a whole
piece of H, because a one-byte delimiter cannot be misaligned; so that piece is counted
at least twice (the needle's own chunk and H).  A needle with an interior piece counted
once cannot occur in another chunk, and is not searched.  Needles with fewer than two
dots have no interior piece and are always searched.

Cost (n chunks, N their total bytes, g / N_g the size / bytes of one same-source group,
m = min_overlap):

* normalize + empty + exact: O(N) (one encode and one xxh3 per input, dict look-ups);
* overlap: only for groups with >= 2 same-source chunks; per ordered pair one reverse
  search of A's m-byte tail in B, O(g^2 * max_len) in C; each candidate is verified by
  one comparison, and periodic text can give O(max_len) candidates per pair, so the
  degenerate worst case is O(g^2 * max_len^2);
* piece index (only when containment or passages can apply): O(N);
* containment: each chunk not excluded by the filter is searched (two-way, linear) in
  the joined bytes of the chunks at least as long as it: O(n * N) byte comparisons in C
  in the worst case (every chunk shares sentences with another), O(N) when nothing
  is shared;
* passages: chunks are split into paragraphs (a chunk that is one paragraph is skipped
  when containment ran); each paragraph of >= min_passage bytes not excluded by the
  filter is searched in the earlier chunks: O(p * N) in C for p such paragraphs.  If a
  chunk was shortened, containment runs once more over the kept chunks.

The Python-level work is O(n + pieces + edges + paragraphs) per call, and it is what
bounds the throughput (measured by ``python -m promptsplice.benchmarks.dedup_bench``;
the figure is in the README).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable
from itertools import chain

from promptsplice import blocks as _blocks
from promptsplice.errors import ConfigError

from ._normalize import _normalize
from ._types import (
    REMOVAL_KINDS,
    DedupConfig,
    DedupResult,
    DedupStats,
    DroppedChunk,
    KeptChunk,
    Origin,
    Relation,
    RemovedPassage,
)

__all__ = ["dedup"]

# Joins chunks into one haystack.  0xFF never occurs in valid UTF-8 and every needle is
# a slice of valid UTF-8, so no match can cross a separator.
_SEP = b"\xff"
_PARA = b"\n\n"
_DOT = b"."

_KEPT = Relation.KEPT
_DUPLICATE = Relation.DUPLICATE
_CONTAINED = Relation.CONTAINED
_MERGED = Relation.MERGED
_PASSAGES = Relation.PASSAGES

_DEFAULT = DedupConfig()
_FIELDS = DedupConfig.field_names()


def _resolve_config(config: DedupConfig | None, overrides: dict) -> DedupConfig:
    if config is None:
        base = _DEFAULT
    elif isinstance(config, DedupConfig):
        base = config
    else:
        raise ConfigError(
            f"config must be a DedupConfig or None, got {type(config).__name__}; "
            f"or pass options as keyword arguments ({', '.join(_FIELDS)})"
        )
    if not overrides:
        return base
    unknown = sorted(set(overrides).difference(_FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown dedup option(s) {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(_FIELDS)}"
        )
    return dataclasses.replace(base, **overrides)


def dedup(chunks: Iterable, config: DedupConfig | None = None, **overrides) -> DedupResult:
    """Remove redundant chunks and passages from one request's retrieved chunks.

    ``chunks`` are str, UTF-8 bytes, dicts with ``"text"`` or LangChain-style documents
    (see :func:`normalize_chunks`).  ``overrides`` are :class:`DedupConfig` field names
    applied on top of ``config``.  The result keeps retrieval order and records, for
    every input, which kept chunk stands for it and where.
    """
    cfg = _resolve_config(config, overrides)
    inputs, replaced = _normalize(chunks, cfg.on_invalid_utf8)

    removed = dict.fromkeys(REMOVAL_KINDS, 0)
    removed_bytes = dict.fromkeys(REMOVAL_KINDS, 0)
    dropped: list[DroppedChunk] = []
    kept: list[KeptChunk] = []  # in input order of their first member
    bytes_in = 0
    collisions = 0
    n_dup = 0
    dup_bytes = 0

    # -- empty + exact duplicates (one pass over the inputs) ---------------------------
    exact = cfg.exact
    seen: dict[bytes, KeptChunk] = {}
    by_data: dict[bytes, KeptChunk] | None = None  # only filled after a digest collision
    for index, cid, text, data, digest, metadata in inputs:
        size = len(data)
        bytes_in += size
        if not size or text.isspace():
            dropped.append(DroppedChunk(index, cid, metadata, "empty"))
            removed["empty"] += 1
            removed_bytes["empty"] += size
            continue
        if exact:
            node = seen.get(digest)
            if node is not None:
                if node.data != data:  # digest match, bytes differ: collision or sibling
                    if by_data is None:
                        by_data = {}
                    by_data.setdefault(node.data, node)
                    node = by_data.get(data)
                if node is not None:
                    node.origins.append(Origin(index, cid, metadata, _DUPLICATE, (0, size)))
                    n_dup += 1
                    dup_bytes += size
                    continue
                collisions += 1
                node = KeptChunk(
                    cid, text, data, digest, metadata,
                    [Origin(index, cid, metadata, _KEPT, (0, size))], [],
                )  # fmt: skip
                by_data[data] = node  # type: ignore[index]
                kept.append(node)
                continue
        node = KeptChunk(
            cid, text, data, digest, metadata,
            [Origin(index, cid, metadata, _KEPT, (0, size))], [],
        )  # fmt: skip
        if exact:
            seen[digest] = node
        kept.append(node)
    removed["duplicate"] = n_dup
    removed_bytes["duplicate"] = dup_bytes

    # From here on a KeptChunk whose ``data`` changes gets ``text = digest = None``;
    # both are recomputed at the end.  ``origins[0]`` is always the KEPT origin.
    ctx = _Passes(cfg, removed, removed_bytes)
    if cfg.overlap and len(kept) >= 2:
        kept = ctx.merge_overlaps(kept)
    if cfg.containment and len(kept) >= 2:
        kept = ctx.absorb_contained(kept)
    if cfg.passages and len(kept) >= 2:
        kept = ctx.remove_passages(kept)

    # -- finish -----------------------------------------------------------------------
    digest_of = _blocks.content_digest
    bytes_out = 0
    for k in kept:
        if k.digest is None:
            k.text = k.data.decode("utf-8")
            k.digest = digest_of(k.data)
        origins = k.origins
        if len(origins) > 2:
            origins[1:] = sorted(origins[1:], key=_by_index)
        bytes_out += len(k.data)

    stats = DedupStats(
        chunks_in=len(inputs),
        chunks_out=len(kept),
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        removed=removed,
        removed_bytes=removed_bytes,
        replaced_invalid_utf8=replaced,
        hash_collisions=collisions,
    )
    return DedupResult(kept, dropped, stats)


def _by_index(origin: Origin) -> int:
    return origin.index


def _pos(k: KeptChunk) -> int:
    """Output-order key: the input index of the chunk's KEPT origin."""
    return k.origins[0].index


def _starts(datas: list[bytes]) -> list[int]:
    """Offsets of each item in ``_SEP.join(datas)``."""
    out = []
    p = 0
    for d in datas:
        out.append(p)
        p += len(d) + 1
    return out


def _probe(pieces: list[bytes]) -> bytes | None:
    """An interior piece of a dot-split needle (preferably a long one), or None."""
    if len(pieces) < 3:
        return None
    p = pieces[1]
    if len(p) >= 24 or len(pieces) == 3:
        return p
    return max(pieces[1:-1], key=len)


class _Passes:
    """Overlap, containment and passage passes over the kept chunks of one call."""

    __slots__ = ("cfg", "removed", "removed_bytes", "refs", "counts", "split")

    def __init__(self, cfg: DedupConfig, removed: dict, removed_bytes: dict) -> None:
        self.cfg = cfg
        self.removed = removed
        self.removed_bytes = removed_bytes
        # RemovedPassage records whose found_in is a given chunk, by id(chunk): fixed up
        # if that chunk is later absorbed by containment.
        self.refs: dict[int, list[RemovedPassage]] = {}
        self.counts: Counter | None = None  # piece -> occurrences (see module doc)
        self.split: list[list[bytes]] = []  # each chunk's dot-split pieces

    # -- sentence-piece filter -----------------------------------------------------------

    def index(self, kept: list[KeptChunk]) -> tuple[Counter, list[list[bytes]]]:
        """Split every chunk on b"." and count the pieces; the split is aligned with
        ``kept`` as it was when the index was built.

        Built once and reset whenever a chunk's bytes change.  Counts only ever
        over-approximate (a piece repeated inside one chunk), which makes the filter
        search more, never less.
        """
        if self.counts is None:
            split = [k.data.split(_DOT) for k in kept]
            self.counts = Counter(chain.from_iterable(split))
            self.split = split
        return self.counts, self.split

    # -- overlap ---------------------------------------------------------------------

    def merge_overlaps(self, kept: list[KeptChunk]) -> list[KeptChunk]:
        """Merge chains of same-source chunks whose tail/head overlap by >= min_overlap."""
        key = self.cfg.source_key
        groups: dict = {}
        unhashable: list[tuple[object, list[KeptChunk]]] = []
        n_sourced = 0
        for k in kept:
            md = k.metadata
            if not md:
                continue
            source = md.get(key)
            if source is None:
                continue
            n_sourced += 1
            try:
                groups.setdefault(source, []).append(k)
            except TypeError:  # an unhashable source value (a list): compare by ==
                for value, members in unhashable:
                    if value == source:
                        members.append(k)
                        break
                else:
                    unhashable.append((source, [k]))
        if len(groups) == n_sourced:  # all sources distinct: nothing to merge
            return kept
        multi = [g for g in groups.values() if len(g) >= 2]
        multi.extend(g for _, g in unhashable if len(g) >= 2)
        gone: set[int] = set()
        for group in multi:
            self._merge_group(group, gone)
        if not gone:
            return kept
        return [k for k in kept if id(k) not in gone]

    def _merge_group(self, group: list[KeptChunk], gone: set[int]) -> None:
        m = self.cfg.min_overlap
        datas = [k.data for k in group]
        lens = [len(d) for d in datas]
        edges: list[tuple[int, int, int]] = []  # (L, a, b): tail of a == head of b
        for a, A in enumerate(datas):
            la = lens[a]
            if la <= m:
                continue
            tail = A[la - m :]
            for b, B in enumerate(datas):
                lb = lens[b]
                if b == a or lb <= m:
                    continue
                # Longest L first: the last occurrence of A's tail in B ending at or
                # before min(la, lb) - 1 (L == len(B) or len(A) would be containment).
                q = B.rfind(tail, 0, min(la, lb) - 1)
                while q >= 0:
                    L = q + m
                    if A.endswith(B[:L]):
                        # A chunk inside the other one is containment, not overlap.
                        if not ((lb <= la and B in A) or (la <= lb and A in B)):
                            edges.append((L, a, b))
                        break
                    q = B.rfind(tail, 0, L - 1)
        if not edges:
            return

        # Greedy by overlap length: each chunk gets at most one successor and one
        # predecessor, and no cycles.
        edges.sort(key=lambda e: (-e[0], _pos(group[e[1]]), _pos(group[e[2]])))
        succ: dict[int, tuple[int, int]] = {}
        pred: dict[int, int] = {}
        for L, a, b in edges:
            if a in succ or b in pred:
                continue
            x = b
            while x in succ:
                x = succ[x][0]
            if x == a:
                continue
            succ[a] = (b, L)
            pred[b] = a

        for head in succ:
            if head in pred:
                continue
            # Cutting B at L keeps whole characters: B[:L] equals A's last L bytes,
            # which start with B's first byte, a UTF-8 lead byte; so A[:-L] ends on a
            # character boundary and the merged bytes A[:-L] + B are valid UTF-8.
            chain_ = [(head, 0)]
            parts = [datas[head]]
            size = lens[head]
            saved = 0
            x = head
            while x in succ:
                y, L = succ[x]
                chain_.append((y, size - L))
                parts.append(datas[y][L:])
                size += lens[y] - L
                saved += L
                x = y
            keeper = min((group[i] for i, _ in chain_), key=_pos)
            shifted: list[Origin] = []
            for i, offset in chain_:
                member = group[i]
                for o in member.origins:
                    s, e = o.span  # type: ignore[misc]
                    o.span = (s + offset, e + offset)
                    if o.relation is _KEPT and member is not keeper:
                        o.relation = _MERGED
                if member is not keeper:
                    shifted.extend(member.origins)
                    gone.add(id(member))
            keeper.origins.extend(shifted)
            keeper.data = b"".join(parts)
            keeper.text = keeper.digest = None  # type: ignore[assignment]
            self.counts = None
            self.removed["overlap"] += len(chain_) - 1
            self.removed_bytes["overlap"] += saved

    # -- containment -----------------------------------------------------------------

    def absorb_contained(self, kept: list[KeptChunk]) -> list[KeptChunk]:
        """Absorb every chunk whose bytes occur inside another kept chunk.

        Chunks are ordered longest first; each one is searched only in the chunks
        before it (at least as long, so an identical chunk left by an overlap merge or
        with ``exact=False`` is caught too).
        """
        self.counts = None  # containment always indexes the chunks it is given
        counts, split = self.index(kept)
        lens = [len(k.data) for k in kept]
        order = sorted(range(len(kept)), key=lens.__getitem__, reverse=True)  # stable
        hay = starts = None
        host: dict[int, tuple[int, int]] = {}  # rank in order -> (host rank, offset)
        for r in range(1, len(order)):
            pl = split[order[r]]
            if len(pl) >= 3 and counts[pl[1] if len(pl[1]) >= 24 else _probe(pl)] < 2:
                continue  # an interior piece seen only here: not inside another chunk
            if hay is None:
                datas = [kept[i].data for i in order]
                hay = _SEP.join(datas)
                starts = _starts(datas)
            pos = hay.find(kept[order[r]].data, 0, starts[r] - 1)  # type: ignore[index]
            if pos < 0:
                continue
            h = bisect_right(starts, pos) - 1  # type: ignore[arg-type]
            offset = pos - starts[h]  # type: ignore[index]
            if h in host:  # found inside an absorbed chunk: map into that one's host
                h, extra = host[h]
                offset += extra
            host[r] = (h, offset)
        if not host:
            return kept
        gone = set()
        for r, (h, offset) in host.items():
            z = kept[order[r]]
            counts.subtract(split[order[r]])  # keep the filter exact for what is left
            self._absorb(kept[order[h]], z, offset)
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
        refs = self.refs.pop(id(z), None)
        if refs:
            for rp in refs:
                rp.found_in = host.id
                rp.found_at += offset
            self.refs.setdefault(id(host), []).extend(refs)

    # -- repeated passages -----------------------------------------------------------

    def remove_passages(self, kept: list[KeptChunk]) -> list[KeptChunk]:
        """Remove paragraphs (>= min_passage bytes) already present in an earlier chunk."""
        cfg = self.cfg
        mp = cfg.min_passage
        counts = self.index(kept)[0]
        # After containment no chunk sits inside another, so a chunk that is a single
        # paragraph cannot be found in an earlier one: only split chunks can match.
        whole_chunks = not cfg.containment
        out: list[KeptChunk] = []
        changed = False
        # All chunks joined in output order, built when first needed; a search for
        # chunk j stops before j's own bytes, so it only sees earlier (final) chunks.
        # Rebuilt after a chunk is cut, since that changes the bytes.
        hay = b""
        hay_chunks: list[KeptChunk] = []
        starts: list[int] = []
        for j, k in enumerate(kept):
            d = k.data
            if not out or len(d) < mp:
                out.append(k)
                continue
            paras = _paragraphs(d)
            if len(paras) == 1 and not whole_chunks:
                out.append(k)
                continue
            hits = None
            for i, p in enumerate(paras):
                if len(p) < mp:
                    continue
                a = p.find(_DOT)
                if a >= 0:
                    b = p.find(_DOT, a + 1)
                    if b >= 0 and counts[p[a + 1 : b]] < 2:
                        continue  # its first interior piece occurs in no other chunk
                if not hay_chunks or hay_chunks[len(out)] is not k:
                    hay_chunks = out + kept[j:]
                    datas = [c.data for c in hay_chunks]
                    hay = _SEP.join(datas)
                    starts = _starts(datas)
                pos = hay.find(p, 0, starts[len(out)] - 1)
                if pos >= 0:
                    f = bisect_right(starts, pos) - 1
                    offset = sum(map(len, paras[:i])) + 2 * i
                    if hits is None:
                        hits = []
                    hits.append((i, offset, len(p), hay_chunks[f], pos - starts[f]))
            if hits is not None:
                changed = True
                hay_chunks = []  # bytes change (or a chunk goes): rebuild when needed
                if not self._cut(k, paras, hits):
                    continue  # emptied: attached to an earlier chunk
            out.append(k)
        if changed:
            self.counts = None  # some bytes changed: the piece index is stale
        if changed and cfg.containment and len(out) >= 2:
            # A shortened chunk may now sit inside another one (or contain one, through
            # a new paragraph junction): absorb those too, so that the output is a
            # fixpoint: dedup(output texts) changes nothing.
            out = self.absorb_contained(out)
        return out

    def _cut(self, k: KeptChunk, paras, hits) -> bool:
        """Apply passage hits to ``k``; False when nothing but whitespace is left.

        ``hits`` are ``(paragraph index, offset, length, chunk holding it, offset there)``.
        """
        records = []
        refs = self.refs
        for _, offset, length, found, at in hits:
            rp = RemovedPassage(k.id, offset, length, found.id, at)
            refs.setdefault(id(found), []).append(rp)
            records.append(rp)
        self.removed["passage"] += len(hits)

        gone = {h[0] for h in hits}
        new = _PARA.join([p for i, p in enumerate(paras) if i not in gone])
        old = k.data
        if not new or new.decode("utf-8").isspace():
            # Every paragraph was already present: the chunk goes, and its inputs are
            # attached to the chunk holding its first removed passage.
            host = hits[0][3]
            for o in k.origins:
                o.relation = _PASSAGES
                o.span = None
            host.origins.extend(k.origins)
            host.removed_passages.extend(k.removed_passages)
            host.removed_passages.extend(records)
            self.removed_bytes["passage"] += len(old)
            return False

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
        # Spans shrink to what remains of each input (possibly nothing).  An input that
        # lay inside one removed paragraph moves to the chunk where that paragraph was
        # found, as CONTAINED there; the KEPT input always stays (it names the chunk).
        staying = [k.origins[0]]
        for o in k.origins[1:]:
            if o.span is not None:
                s, e = o.span
                for _, offset, length, found, at in hits:
                    if offset <= s and e <= offset + length:
                        o.span = (at + s - offset, at + e - offset)
                        o.relation = _CONTAINED
                        found.origins.append(o)
                        break
                else:
                    staying.append(o)
            else:
                staying.append(o)
        k.origins = staying
        for o in staying:
            if o.span is not None:
                o.span = (_map_offset(o.span[0], cuts), _map_offset(o.span[1], cuts))
        k.removed_passages.extend(records)
        k.data = new
        k.text = k.digest = None  # type: ignore[assignment]
        self.removed_bytes["passage"] += len(old) - len(new)
        return True


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


def _map_offset(x: int, cuts: list[tuple[int, int]]) -> int:
    """Offset ``x`` of the old bytes in the bytes left after removing ``cuts`` (sorted)."""
    shift = 0
    for s, e in cuts:
        if x <= s:
            break
        if x < e:
            return s - shift
        shift += e - s
    return x - shift
