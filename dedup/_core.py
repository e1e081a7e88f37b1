"""The dedup passes: empty -> exact -> overlap merge -> containment -> repeated passages.

Everything is byte-exact on UTF-8.  Hash matches (xxh3-128 via ``content_digest``) are
always confirmed by comparing bytes; every other match comes from ``bytes.find`` /
``bytes.rfind`` (CPython's two-way search, in C), so it is exact by construction.

This module runs empty + exact (one pass over the inputs, creating the output
records) and the finish; the later passes are in :mod:`promptsplice.dedup._passes`,
with their filter and search index.

Cost (n chunks, N their total bytes, g / N_g the size / bytes of one same-source group,
m = min_overlap):

* normalize + empty + exact: O(N) (one encode and one xxh3 per input, dict look-ups);
* overlap: only for groups with >= 2 same-source chunks; per ordered pair one reverse
  search of A's m-byte tail in B, O(g^2 * max_len) in C; groups of more than 16 chunks
  (with m >= 31) only try the pairs the anchor index finds, O(N_g) on average.  Each
  candidate is verified by one comparison; periodic text can give O(max_len)
  candidates per pair, and past a budget linear in the pair's bytes a KMP search
  answers instead, so the worst case is O(g^2 * max_len).  Without containment the
  merged chains are matched again until nothing merges (at most g rounds, rare past one);
* piece filter (only when containment or passages can apply): O(N);
* containment and passages: each needle not excluded by the filter is searched, first
  in the joined bytes (O(N) in C each), and once a pass has made 32 such searches
  through the anchor index: N/16 dict insertions once per call, then 16 to 32 look-ups
  per needle and a C search of each surviving candidate, so O(N) in total for typical
  text.  Needles shorter than 31 bytes are still searched in the joined bytes: O(n *
  N) in C in the worst case.  Longer needles scan at most 64 * N bytes + 64 MiB in all
  (the call's search budget, ``dedup/_finder.py``); past it, chunks made of the same
  few sentences are less deduplicated (a needle then scans at most 16 times its
  bytes + 16 KiB), never wrong.  If passages shortened a chunk, containment runs once more, and with
  overlap on, the overlap pass too; a merge then starts another round of containment
  and passages (rare past the first: each round removes bytes).  In content order a
  round whose cuts reordered the chunks is followed by another, at most 8 more
  (``_CONTENT_ROUNDS``): on typical text none or one; a chunk that sinks one place a
  round, losing a paragraph to the next each time, takes all 8 (each a passage pass).

The Python-level work is O(n + pieces + edges + paragraphs) per call, and it is what
bounds the throughput (measured by ``python -m promptsplice.benchmarks.dedup_bench``;
the figure is in the README).  The optional C core (:mod:`promptsplice.dedup._native`)
runs the containment and passage searches of calls up to 64 chunks and 256 KiB, and the
overlap edges of same-source groups up to 16 chunks (any call size): the same answers
with no Python object per piece; the records are made here either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from operator import attrgetter

from promptsplice import blocks as _blocks
from promptsplice.errors import ConfigError

from ._normalize import _normalize, is_blank
from ._overlap import note_starts, publish_starts, shares_a_source
from ._passes import Passes
from ._types import (
    REMOVAL_KINDS,
    DedupConfig,
    DedupResult,
    DedupStats,
    DroppedChunk,
    KeptChunk,
    Origin,
    Relation,
)

__all__ = ["dedup"]

_KEPT = Relation.KEPT
_MERGED = Relation.MERGED
_DUPLICATE = Relation.DUPLICATE

_BY_INDEX = attrgetter("index")
_CONTENT_ROUNDS = 8
"""Passage rounds content order runs again after cuts reordered the chunks (each cuts
bytes; past these a second call may cut more: a pathological input could otherwise ask
for one round per paragraph, each re-indexing the call)."""
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


def _content_rank(t: tuple, source_key: str) -> tuple:
    """An input tuple's place in content order: longest first (a longer chunk is the one
    likelier to hold the paragraphs a shorter one repeats, so they are cut from the
    shorter: on the trace suite retrieval order's removals are kept, digest or id first
    lost some), then digest; among equal bytes the copy that names a source first (the
    one that can merge with its source's windows: the same chunk from a second index
    without one must not stop the merge), then id, and index (one id: retrieval order)."""
    return -len(t[3]), t[4], (t[5] or {}).get(source_key) is None, t[1], t[0]


def _kept_rank(k: KeptChunk) -> tuple:
    """A kept chunk's place in content order, from its bytes now (:func:`_content_rank`'s
    key for an input of those bytes: a second call orders the output so)."""
    return -len(k.data), k.digest if k.digest is not None else _blocks.content_digest(k.data), k.id


def _restore_positions(kept: list[KeptChunk], dropped: list[DroppedChunk], positions: list[int]) -> None:
    """Give every record its input's index in the caller's order (the passes ran on the
    inputs in content order) and list kept chunks, and dropped ones, in that order."""
    for k in kept:
        for o in k.origins:
            o.index = positions[o.index]
    for d in dropped:
        d.index = positions[d.index]
    kept.sort(key=lambda k: k.origins[0].index)
    dropped.sort(key=_BY_INDEX)


def _relabel_owners(kept: list[KeptChunk], earliest: bool) -> None:
    """Give a chunk the owner its records should name.

    A merged chunk whose first (KEPT) member lost every byte to passage removal (its
    paragraphs found in other chunks) still carried that member's id and metadata: page
    2's text cited as page 1.  The earliest merged member that keeps bytes becomes the
    owner (its id names the chunk in every record), the old owner a merged member with
    an empty span.  ``earliest`` (content order, where the member first *in that order*
    kept the chain): a merged member that keeps bytes and was retrieved earlier takes
    its place too, so a merged chunk is named by its earliest retrieved merged member in
    either order.  (Not an exact duplicate's copy: the copy kept decided the overlap merges by
    its own metadata's source.)  The chunks stay in the retrieval order of their owners."""
    renames: dict[str, str] = {}
    names: set[str] | None = None  # every chunk name in use: an heir's id must name no other
    for k in kept:
        first = k.origins[0]
        emptied = first.span is not None and first.span[0] == first.span[1]
        if not emptied and not earliest:
            continue
        if names is None:
            names = {c.id for c in kept} | {r.chunk_id for c in kept for r in c.removed_passages}
        heirs = [o for o in k.origins[1:] if o.relation is _MERGED and o.span is not None and o.span[1] > o.span[0]
                 and o.id not in names and (emptied or o.index < first.index)]  # fmt: skip
        if not heirs:  # (o.id in names: inputs of one id, exact dedup off, equal texts)
            continue
        heir = min(heirs, key=_BY_INDEX)
        names.add(heir.id)
        first.relation, heir.relation = _MERGED, _KEPT
        k.origins = [heir, *sorted((o for o in k.origins if o is not heir), key=_BY_INDEX)]
        renames[k.id] = heir.id
        k.id, k.metadata = heir.id, heir.metadata
    if not renames:
        return
    for k in kept:
        for r in k.removed_passages:
            r.chunk_id = renames.get(r.chunk_id, r.chunk_id)
            r.found_in = renames.get(r.found_in, r.found_in)
    kept.sort(key=lambda k: k.origins[0].index)


def dedup(chunks: Iterable, config: DedupConfig | None = None, **overrides) -> DedupResult:
    """Remove redundant chunks and passages from one request's retrieved chunks.

    ``chunks`` are str, UTF-8 bytes, dicts with ``"text"`` or LangChain-style documents
    (see :func:`normalize_chunks`).  ``overrides`` are :class:`DedupConfig` field names
    applied on top of ``config``.  The result lists kept chunks in retrieval order and
    records, for every input, which kept chunk stands for it and where; which copy of a
    repeat keeps its bytes follows :attr:`DedupConfig.order`.
    """
    cfg = _resolve_config(config, overrides)
    inputs, replaced = _normalize(chunks, cfg.on_invalid_utf8)
    # In content order the passes run on the inputs sorted by content under new
    # indices; ``positions`` maps those back to the caller's at the finish.
    positions: list[int] | None = None
    if cfg.order == "content" and len(inputs) > 1:
        key = cfg.source_key
        ranked = sorted(inputs, key=lambda t: _content_rank(t, key))
        positions = [t[0] for t in ranked]
        inputs = [(i, *t[1:]) for i, t in enumerate(ranked)]

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
        if not size or is_blank(text):
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

    # From here on a KeptChunk whose ``data`` changes gets ``digest = None`` (and
    # ``text = None`` unless the pass rebuilt it); both are recomputed at the end.
    # ``origins[0]`` is always the KEPT origin.
    ctx = Passes(cfg, removed, removed_bytes)
    note_starts(ctx, kept)  # where each chunk starts in its source (start_key), if known
    contained_done = False  # containment already ran over exactly these chunks
    if cfg.overlap and len(kept) >= 2:
        if cfg.containment and shares_a_source(kept, cfg.source_key):
            # A window already inside another chunk is CONTAINED there before merging:
            # merged, it would repeat bytes the other chunk holds and could later lose
            # all its own text to the passage pass while still naming the merged chunk.
            kept = ctx.absorb_contained(kept)
            contained_done = True
        merged = removed["overlap"]
        kept = ctx.merge_overlaps(kept)
        contained_done = contained_done and removed["overlap"] == merged
        if removed["overlap"] != merged and not cfg.containment and cfg.exact:
            # A merged chain can equal another chunk (A+B == a window D of both), which
            # only containment caught: the same fixpoint without it.
            kept = ctx.merge_identical(kept)
    if cfg.containment and len(kept) >= 2 and not contained_done:
        kept = ctx.absorb_contained(kept)
    content = positions is not None
    reorders = 0
    while cfg.passages and len(kept) >= 2:
        if content:
            # Each round in the content order of the chunks as they are now: the round
            # that ends the loop cut nothing in the order a second call sees, so the
            # output is a fixpoint in content order too (up to _CONTENT_ROUNDS rounds).
            kept = sorted(kept, key=_kept_rank)
        cut = removed["passage"]
        kept = ctx.remove_passages(kept)
        if removed["passage"] == cut or len(kept) < 2:
            break
        if cfg.overlap:
            # A cut chunk's new head can equal a same-source neighbour's tail: merge those
            # too, then containment and passages again, so that the output is a fixpoint.
            # Each round removes bytes, so the loop ends; it is rare past the first.
            merged = removed["overlap"]
            kept = ctx.merge_overlaps(kept, after_passages=True)
            if removed["overlap"] != merged:
                if cfg.containment and len(kept) >= 2:
                    kept = ctx.absorb_contained(kept)
                elif cfg.exact:
                    kept = ctx.merge_identical(kept)
                continue
        if not content or [id(k) for k in sorted(kept, key=_kept_rank)] == list(map(id, kept)):
            break  # (content order: the cuts reordered the chunks, so another round)
        reorders += 1
        if reorders > _CONTENT_ROUNDS:
            break  # a chunk that sinks one place a round can ask for one round a paragraph

    # -- finish -----------------------------------------------------------------------
    if positions is not None:
        _restore_positions(kept, dropped, positions)
    _relabel_owners(kept, earliest=positions is not None)
    publish_starts(ctx, kept)
    digest_of = _blocks.content_digest
    bytes_out = 0
    for k in kept:
        if k.digest is None:
            if k.text is None:
                k.text = k.data.decode("utf-8")
            k.digest = digest_of(k.data)
        origins = k.origins
        if len(origins) > 2:
            origins[1:] = sorted(origins[1:], key=_BY_INDEX)
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
