"""The overlap pass: chains of same-source chunks whose tail equals the next one's head
are merged into one chunk (see :mod:`promptsplice.dedup` for the rules).

Each ordered pair of a group tries one reverse search of A's ``min_overlap``-byte tail
in B; groups of more than ``_GROUP_GRID`` chunks only try the pairs that the grid anchor
index finds (the chunks that may hold A's tail).  Every edge is verified by comparing
bytes, so it is exact by construction; on periodic text, where nearly every offset is a
candidate, a pair whose comparisons pass a budget linear in its size is answered by a
linear KMP search instead (the same edge), so a pair costs O(its bytes).  The other
groups' pairs are tried by the optional C core where it was built (``overlap_edges``:
the same edges), and its ``overlap_len`` answers each pair of the large groups.

Only certain edges merge (:func:`_settle`): a pair that both know their offset in the
source (``DedupConfig.start_key``) at the overlap those offsets give, if their bytes
agree there; the others at their longest match, unless a shorter match of >= m bytes
fits the seam too (repeating text: one more ``overlap_len`` of A with B's head, the
same search) or the edges of the chunks they join disagree on where a chunk sits:
those are left apart.  Offsets are tracked while a chunk is one slice of its source
(``Passes.starts``) and written back to the output's metadata (:func:`publish_starts`).
"""

from __future__ import annotations

from . import _native
from ._anchors import MIN_NEEDLE, GridIndex
from ._finder import find
from ._types import KeptChunk, Origin, Relation

__all__ = ["merge_overlaps", "note_starts", "publish_starts"]

_GROUP_GRID = 16  # same-source groups larger than this find overlap partners by index
# Bytes the candidate comparisons of one pair may cost, per byte of the pair (and at
# least), before the linear search (_longest_border) answers instead.
_BUDGET = 64
_BUDGET_MIN = 1 << 16
_KEPT = Relation.KEPT
_MERGED = Relation.MERGED


def _offset(value: object) -> int | None:
    """A ``start_key`` value as an offset in the source: a non-negative int (not a bool:
    LangChain's splitters wrote -1 for a chunk they could not find), else None."""
    return value if type(value) is int and value >= 0 else None


def note_starts(ctx, kept: list[KeptChunk]) -> None:
    """Record where each chunk's text starts in its source (its input's ``start_key``
    value), before any pass changes a chunk's bytes; nothing when no input has one."""
    key = ctx.cfg.start_key
    if key is None:
        return
    for k in kept:  # (most calls have none: one look-up a chunk)
        if type(k.metadata.get(key)) is int:
            break
    else:
        return
    ctx.starts = {id(k): (k, k.data, _offset(k.metadata.get(key))) for k in kept}


def _entry(starts: dict, k: KeptChunk) -> tuple | None:
    """``k``'s record in ``starts`` if its bytes are still the ones recorded (a chunk cut
    by the passage pass is no longer one slice of its source)."""
    e = starts.get(id(k))
    return e if e is not None and e[0] is k and e[1] is k.data else None


def publish_starts(ctx, kept: list[KeptChunk]) -> None:
    """Make each kept chunk's ``start_key`` value say where its text starts (or ``None``
    where no offset does), in a copy of its metadata: a merged chunk carries its first
    retrieved member's metadata, whose offset was that member's, and a second dedup of
    the output places windows by these values."""
    starts = ctx.starts
    if starts is None:
        return
    key = ctx.cfg.start_key
    for k in kept:
        meta = k.metadata
        value = meta.get(key)
        if _offset(value) is None:
            continue
        e = _entry(starts, k)
        start = None if e is None else e[2]
        if start != value:
            k.metadata = {**meta, key: start}


def _pos(k: KeptChunk) -> int:
    """Output-order key: the input index of the chunk's KEPT origin."""
    return k.origins[0].index


def _source_key(value: object) -> object:
    """A source value as the merge groups it: ``True`` and ``1`` (``False`` and ``0``) are
    equal in Python but name two documents, also inside a tuple or a frozenset."""
    if isinstance(value, bool):
        return ("bool", value)
    if type(value) is tuple:
        return ("tuple", tuple(_source_key(v) for v in value))
    if type(value) is frozenset:
        return ("frozenset", frozenset(_source_key(v) for v in value))
    return value


def shares_a_source(kept: list[KeptChunk], key: str) -> bool:
    """Whether two chunks may share a source (the only chunks an overlap merge joins);
    ``True`` when a source value is unhashable (grouped by ``==`` in the merge)."""
    sources = [_source_key(k.metadata.get(key)) for k in kept]
    try:
        distinct = set(sources)
    except TypeError:  # an unhashable source value (a list)
        return True
    return len(distinct) - (None in distinct) != len(sources) - sources.count(None)


def merge_overlaps(ctx, kept: list[KeptChunk], after_passages: bool = False) -> list[KeptChunk]:
    """Merge chains of same-source chunks whose tail/head overlap by >= min_overlap;
    ``ctx`` is the call's :class:`~promptsplice.dedup._passes.Passes` (config, counters).

    ``after_passages``: the chunks may have lost passages, which can expose a new edge
    (a cut chunk's new head equals a neighbour's tail).  A chain is then merged only if
    its keeper lost no passage of its own: those records locate paragraphs in the
    keeper's bytes as they were when cut, which a merge would move."""
    key = ctx.cfg.source_key
    if not shares_a_source(kept, key):
        return kept
    sources = [_source_key(k.metadata.get(key)) for k in kept]
    groups: dict = {}
    unhashable: dict[object, list[tuple[object, list[KeptChunk]]]] = {}
    for k, source in zip(kept, sources):
        if source is None:
            continue
        try:
            groups.setdefault(source, []).append(k)
        except TypeError:
            # compared by == only within a bucket of equal canonical forms (every such
            # chunk compared with every group was quadratic: 4,000 list sources 1.6 s)
            bucket = unhashable.setdefault(_bucket(source), [])
            for value, members in bucket:
                if _same_source(value, source):
                    members.append(k)
                    break
            else:
                bucket.append((source, [k]))
    multi = [g for g in groups.values() if len(g) >= 2]
    multi.extend(g for bucket in unhashable.values() for _, g in bucket if len(g) >= 2)
    gone: set[int] = set()
    for group in multi:
        # Without containment a member can lie inside another one (A=T[0:200],
        # B=T[100:300], C=T[100:330]): greedy merging takes A+B and leaves C beside the
        # chain, overlapping it, so dedup(output) would merge again.  The merged chains
        # are matched again until a round merges nothing: each round removes a member.
        # (With containment those members are absorbed first and no merge opens a new
        # edge; see _merge_group.)
        while _merge_group(ctx, group, gone, after_passages) and not ctx.cfg.containment:
            group = [k for k in group if id(k) not in gone]
            if len(group) < 2:
                break
    if not gone:
        return kept
    return [k for k in kept if id(k) not in gone]


def _group_edges(datas: list[bytes], lens: list[int], m: int, apart: bool = False) -> list[tuple[int, int, int]]:
    """The overlap edges of one same-source group (by index, in C, or by pairs);
    ``apart``: no member lies inside another (containment checked them all)."""
    core = _native.core
    if len(datas) > _GROUP_GRID and m >= MIN_NEEDLE:
        return _edges(datas, lens, m, True, apart)
    if core is not None:
        return core.overlap_edges(datas, m)  # the same pairs and answers, in C
    return _edges(datas, lens, m, False, apart)


def _holds_another(datas: list[bytes], lens: list[int], exact: bool) -> bool:
    """Whether a member lies inside another (members of one length cannot, once exact
    duplicates are gone)."""
    if exact and min(lens) == max(lens):
        return False
    if len(datas) == 2:
        a, b = datas
        return find(b, a, lens[1]) >= 0 if lens[0] <= lens[1] else find(a, b, lens[0]) >= 0
    return True  # larger groups: the containment pass finds out


def _merge_group(ctx, group: list[KeptChunk], gone: set[int], after_passages: bool) -> bool:
    """Merge the chains of one same-source group; whether a chain was merged."""
    m = ctx.cfg.min_overlap
    datas = [k.data for k in group]
    lens = [len(d) for d in datas]
    # Containment may have searched these very chunks already (dedup runs it before the
    # merge, and after cutting passages): then no member lies inside another, which
    # spares the edges their containment checks and the group a containment pass.
    apart = ctx.cfg.containment and ctx.apart(group)
    edges = _group_edges(datas, lens, m, apart)
    if not edges:
        return False
    if ctx.cfg.containment and not apart and _holds_another(datas, lens, ctx.cfg.exact):
        # A member inside another one is absorbed first: greedy merging could take its
        # edge and leave the chunk holding it beside the chain, overlapping it
        # (A=T[0:200], B=T[100:300], C=T[100:330]: A+B, with C left apart), so
        # dedup(output) would merge again.  Without contained members no merge opens a
        # new edge.  (Members of one length cannot hold each other once duplicates are gone.)
        inner = ctx.absorb_contained(group)
        if len(inner) < len(group):
            kept = set(map(id, inner))
            gone.update(id(k) for k in group if id(k) not in kept)
            group = inner
            datas = [k.data for k in group]
            lens = [len(d) for d in datas]
            edges = _group_edges(datas, lens, m, ctx.apart(group)) if len(group) >= 2 else []
            if not edges:
                return False
    edges = _settle(ctx.starts, group, datas, edges, m)
    if not edges:
        return False

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

    merged = False
    for head in succ:
        if head in pred:
            continue
        # Cutting B at L keeps whole characters: B[:L] equals A's last L bytes,
        # which start with B's first byte, a UTF-8 lead byte; so A[:-L] ends on a
        # character boundary and the merged bytes A[:-L] + B are valid UTF-8.
        chain_ = [(head, 0)]
        parts = [datas[head]]
        # B[L:] decodes to B's text after B[:L]'s chars; a chunk cut by the passage
        # pass has no text (None) until the finish, which then decodes the merge.
        texts = None if group[head].text is None else [group[head].text]
        size = lens[head]
        saved = 0
        x = head
        while x in succ:
            y, L = succ[x]
            chain_.append((y, size - L))
            parts.append(datas[y][L:])
            t = group[y].text
            if t is None:
                texts = None
            elif texts is not None:
                texts.append(t[len(datas[y][:L].decode("utf-8")) :])
            size += lens[y] - L
            saved += L
            x = y
        keeper = min((group[i] for i, _ in chain_), key=_pos)
        if after_passages and any(r.chunk_id == keeper.id for r in keeper.removed_passages):
            continue
        starts = ctx.starts
        placed = None if starts is None else _placed_members(starts, group, chain_)
        shifted: list[Origin] = []
        found_in_chain = []  # records of passages found in members, shifted once each
        for i, offset in chain_:
            member = group[i]
            for o in member.origins:
                if o.span is not None:  # None: an input emptied by passage removal
                    s, e = o.span
                    o.span = (s + offset, e + offset)
                if o.relation is _KEPT and member is not keeper:
                    o.relation = _MERGED
            found_in_chain.extend(ctx.take_refs(member, keeper, offset))
            if member is not keeper:
                shifted.extend(member.origins)
                keeper.removed_passages.extend(member.removed_passages)
                gone.add(id(member))
        if found_in_chain:
            ctx.refs[id(keeper)] = found_in_chain
        keeper.origins.extend(shifted)
        keeper.data = b"".join(parts)
        keeper.text = None if texts is None else "".join(texts)  # type: ignore[assignment]
        if placed is not None:  # every member one slice of the source: so is the merge
            start = _merged_start(placed, keeper, keeper.data)
            starts[id(keeper)] = (keeper, keeper.data, start)  # type: ignore[index]
        keeper.digest = None  # type: ignore[assignment]
        ctx.counts = None
        ctx.removed["overlap"] += len(chain_) - 1
        ctx.removed_bytes["overlap"] += saved
        merged = True
    return merged


def _settle(starts: dict | None, group: list[KeptChunk], datas: list[bytes], edges: list, m: int) -> list:
    """The edges whose overlap is certain.

    Two chunks that know where they start in their source (``start_key``) overlap where
    those offsets say, if their bytes agree there (>= m bytes; else no edge).  The other
    edges (the longest match L of A's tail and B's head) are kept only where their seams
    tell one story.  Where a seam's text repeats (log lines, table rows) a shorter match
    of >= m bytes is as likely as the longest (merging at the longest dropped the rows
    between: 30 WARN lines of a log became 19); and where the matches of a set of
    chunks joined by them disagree on where each chunk sits (A's tail matching B's head
    and B's tail A's head, or A -> B -> C and a match A -> C that puts C elsewhere), one
    of them is a repeat, not known which.  The chunks of a set whose edges disagree merge
    only where offsets place them; elsewhere a repeating seam's edge alone is dropped
    (until 2026-12-06 it kept its whole connected set apart: 41 windows of a log with
    one run of repeated lines came out as 41 chunks, not 2).  Left apart, nothing is lost, some
    redundancy is kept.  None of this happens on text whose seams do not repeat."""
    placed = []
    rest = edges
    if starts is not None:
        at = [_entry(starts, k) for k in group]
        s = [None if e is None else e[2] for e in at]
        rest = []
        for L, a, b in edges:
            if s[a] is not None and s[b] is not None:
                L = _placed_overlap(group[a], group[b], s[a], s[b], datas[a], datas[b], m)
                if L:
                    placed.append((L, a, b))
            else:
                rest.append((L, a, b))
        if not rest:
            return placed
    if len(edges) < 2:  # one edge cannot disagree with another
        comp, bad = [0] * len(group), set()
    else:  # over every edge: a repeating seam's edge still says where its chunks meet
        comp, bad = _layout(len(group), [len(d) for d in datas], placed + rest)
    sure = [e for e in rest if comp[e[1]] not in bad and not _ambiguous(datas[e[1]], datas[e[2]], e[0], m)]
    if not placed and len(sure) == len(rest):
        return edges
    return placed + sure


def _layout(n: int, lens: list[int], edges: list) -> tuple[list[int], set[int]]:
    """The connected component of each of ``n`` chunks under ``edges`` (``(L, a, b)``:
    b starts ``lens[a] - L`` bytes after a), and the components whose edges disagree on
    where a chunk starts (a circle of edges always does: each one moves forward)."""
    adj: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for L, a, b in edges:
        d = lens[a] - L
        adj[a].append((b, d))
        adj[b].append((a, -d))
    comp = [-1] * n
    at = [0] * n
    bad: set[int] = set()
    for root in range(n):
        if comp[root] >= 0 or not adj[root]:
            continue
        comp[root] = root
        todo = [root]
        while todo:
            x = todo.pop()
            for y, d in adj[x]:
                if comp[y] < 0:
                    comp[y] = root
                    at[y] = at[x] + d
                    todo.append(y)
                elif at[y] != at[x] + d:
                    bad.add(root)
    return comp, bad


def _chars(k: KeptChunk) -> str:
    return k.text if k.text is not None else k.data.decode("utf-8")


def _placed_overlap(ka: KeptChunk, kb: KeptChunk, sa: int, sb: int, A: bytes, B: bytes, m: int) -> int:
    """The bytes B's head shares with A's tail where their offsets in the source put
    them (``sa``, ``sb``, in characters), 0 if they do not overlap by >= m bytes there
    (or one would lie inside the other) or their bytes differ there."""
    ta, tb = _chars(ka), _chars(kb)
    over = sa + len(ta) - sb  # characters
    if not 0 < over < min(len(ta), len(tb)):
        return 0
    L = len(tb[:over].encode("utf-8"))
    return L if L >= m and A.endswith(B[:L]) else 0


def _ambiguous(A: bytes, B: bytes, L: int, m: int) -> bool:
    """Whether A's tail and B's head, whose longest match is ``L`` (>= m) bytes, also
    match over some shorter length >= m: the largest such is the longest overlap of A
    with ``B[:L]`` (the same search, in C where it was built)."""
    if L <= m:
        return False
    head = B[:L]
    core = _native.core
    if core is not None:
        return core.overlap_len(A, head, m) > 0
    la = len(A)
    return _overlap_len(A, head, la, L, m, A[la - m :]) > 0


def _placed_members(starts: dict, group: list[KeptChunk], chain_: list[tuple[int, int]]) -> list | None:
    """``(offset in the merged bytes, start in the source or None)`` of each member of a
    chain about to merge, read before their bytes change; None when one of them is no
    longer one slice of its source."""
    placed = []
    for i, offset in chain_:
        e = _entry(starts, group[i])
        if e is None:
            return None
        placed.append((group[i], offset, e[2]))
    return placed


def _merged_start(placed: list, keeper: KeptChunk, data: bytes) -> int | None:
    """Where the merged text starts in its source: the keeper's start less the
    characters before it; None if the keeper or the first or last member has none (its
    seam may be a coincidence: a published offset is taken as certain by the next
    dedup; one between two placed members is placed by them) or a member disagrees (a
    merge that cannot be placed)."""
    chars: dict[int, int] = {}  # byte offset -> characters before it, in one pass
    done = count = 0
    for off in sorted({offset for _, offset, _ in placed}):
        count += len(data[done:off].decode("utf-8"))  # members start on character bounds
        chars[off] = count
        done = off
    start = None
    for k, offset, s in placed:
        if k is keeper:
            if s is None:
                return None
            start = s - chars[offset]
    if start is None or start < 0:
        return None
    ends = sorted(placed, key=lambda p: p[1])
    if ends[0][2] is None or ends[-1][2] is None:  # an end without one may have met the rest by chance
        return None
    for k, offset, s in placed:
        if s is not None and s != start + chars[offset]:
            return None
    return start


def _bucket(value: object) -> object:
    """A hashable form that ``==``-equal source values share (lists and tuples alike,
    dicts by their items); values it cannot read share one bucket per type."""
    try:
        if isinstance(value, bool):  # (True == 1: [True] and [1] name two documents)
            return ("b", value)
        if isinstance(value, dict):
            return ("d", frozenset((_bucket(k), _bucket(v)) for k, v in value.items()))
        if isinstance(value, list | tuple):
            return ("l", tuple(_bucket(v) for v in value))
        if isinstance(value, set | frozenset):
            return ("s", frozenset(_bucket(v) for v in value))
        hash(value)
        return value
    except (TypeError, RecursionError):
        return ("?", type(value).__name__)


def _same_source(a: object, b: object) -> bool:
    """``a == b`` for unhashable source values, False when the comparison is not a
    plain truth value (a numpy array compares element-wise and has none)."""
    try:
        return bool(a is b or a == b)
    except (TypeError, ValueError):  # element-wise comparisons
        return False


def _edges(
    datas: list[bytes], lens: list[int], m: int, by_index: bool, apart: bool = False
) -> list[tuple[int, int, int]]:
    """``(L, a, b)`` for each ordered pair whose tail of a equals the head of b over the
    longest L >= m; ``by_index``: only the pairs the grid index finds (large groups);
    ``apart``: no chunk lies inside another (else each edge checks, in linear time)."""
    edges: list[tuple[int, int, int]] = []  # (L, a, b): tail of a == head of b
    everyone = range(len(datas))
    core = _native.core  # its overlap_len: the same L as _overlap_len, in C
    pair = None if core is None else core.overlap_len
    grid = None
    heads: tuple[dict[int, set[int]], list[int]] | None = None
    if by_index:
        grid = GridIndex()  # partners are the chunks that may hold A's tail
        for b, d in enumerate(datas):
            grid.add(b, d)
    for a, A in enumerate(datas):
        la = lens[a]
        if la <= m:
            continue
        tail = A[la - m :]
        partners = None if grid is None else grid.candidates(tail)
        if partners is None and grid is not None:
            # A's tail is common text (log lines with one suffix): the other way round,
            # a partner's head lies inside A (B[:m] == A[la - L : la - L + m]).  Until
            # 2026-12-07 every pair was tried: 3,200 such windows took 6.3 s, 10.2M checks.
            if heads is None:
                heads = _heads_inside(grid, datas, lens, m)
            held, common = heads
            if len(common) <= _MAX_COMMON_HEADS:
                partners = held.get(a, set()).union(common)
        for b in everyone if partners is None else partners:
            B = datas[b]
            lb = lens[b]
            if b == a or lb <= m:
                continue
            L = _overlap_len(A, B, la, lb, m, tail) if pair is None else pair(A, B, m)
            # A chunk inside the other one is containment, not overlap.
            if L and (
                apart or not ((lb <= la and find(A, B, la) >= 0) or (la <= lb and find(B, A, lb) >= 0))
            ):
                edges.append((L, a, b))
    return edges


_MAX_COMMON_HEADS = 256
"""Chunks whose head is common text too, beyond which a chunk with a common tail tries
every partner (periodic text: no index helps)."""


def _heads_inside(
    grid: GridIndex, datas: list[bytes], lens: list[int], m: int
) -> tuple[dict[int, set[int]], list[int]]:
    """Which chunks may hold each chunk's first ``m`` bytes: ``(holder -> chunks whose
    head it may hold, chunks whose head the index cannot narrow)``."""
    held: dict[int, set[int]] = {}
    common: list[int] = []
    for b, B in enumerate(datas):
        if lens[b] <= m:
            continue
        holders = grid.candidates(B[:m])
        if holders is None:
            common.append(b)
            continue
        for a in holders:
            held.setdefault(a, set()).add(b)
    return held, common


def _overlap_len(A: bytes, B: bytes, la: int, lb: int, m: int, tail: bytes) -> int:
    """The largest L in [m, min(la, lb) - 1] with ``A.endswith(B[:L])``, else 0.

    Longest L first: the last occurrence of A's m-byte ``tail`` in B ending at or before
    min(la, lb) - 1 (L == len(B) or len(A) would be containment), each candidate checked
    by one comparison.  Periodic text has a candidate at nearly every offset, each
    costing O(L) (quadratic: 17 s for a 1 MB pair of ``a``-runs); once the comparisons
    have cost more than a budget linear in the pair's size, the answer comes from
    :func:`_longest_border` instead, linear: the same L either way.
    """
    top = min(la, lb) - 1
    q = B.rfind(tail, 0, top)
    budget = _BUDGET * top + _BUDGET_MIN
    while q >= 0:
        L = q + m
        if A.endswith(B[:L]):
            return L
        budget -= L + m
        if budget < 0:
            L = _longest_border(A, B, top)
            return L if L >= m else 0
        q = B.rfind(tail, 0, L - 1)
    return 0


def _longest_border(A: bytes, B: bytes, top: int) -> int:
    """The largest L <= top with ``B[:L] == A[len(A) - L:]`` (0 if none), in O(top):
    the Knuth-Morris-Pratt automaton of ``B[:top]`` run over A's last ``top`` bytes,
    whose final state is the longest prefix of B that A ends with."""
    if top <= 0:
        return 0
    P = B[:top]
    pi = [0] * top  # pi[i]: the longest proper border of P[: i + 1]
    k = 0
    for i in range(1, top):
        c = P[i]
        while k and P[k] != c:
            k = pi[k - 1]
        if P[k] == c:
            k += 1
        pi[i] = k
    q = 0
    for c in A[len(A) - top :]:
        while q and (q == top or P[q] != c):
            q = pi[q - 1]
        if P[q] == c:
            q += 1
    return q
