"""Reference bounds a bench reports beside its own numbers, so a trace cannot flatter it.

* :class:`RadixPrefill` / :func:`radix_prefill_tokens`: what a token-granular radix tree
  (SGLang's ideal) leaves to prefill on a sequence of prompts: each prompt minus its
  longest common prefix with any earlier prompt (at least one token is always computed,
  as in vLLM and SGLang).  With ``capacity_tokens`` the tree holds at most that many
  tokens and evicts least-recently-used leaves, as SGLang does.
* :class:`OracleCounter`: the bound for any reuse of exact content.  It is fed the
  segments an assembly would send -- the system prompt, the chunks *after dedup's
  trimming* (exact duplicates, containment, overlap, repeated passages) and the query,
  each as the very tokens the assembler gives it -- and counts to prefill only what an
  earlier request never held: a segment seen before is free, a new segment is free for
  its longest token prefix shared with a segment seen before, and at least one token per
  request is computed.  An assembled prompt's cached tokens are a block-aligned prefix
  equal to an earlier prompt's prefix, made of the same segments (or token prefixes of
  them) plus padding -- unless a chunk's text holds a separator, and the hit runs over
  content another request sent segmented otherwise; so the reported oracle is, per
  request, the least of this content bound and each prefix-caching mode's radix ideal on
  its own prompts (:func:`floor_per_request`), and no such mode prefills less than it:
  ``gap closed <= 1`` by construction (tested as a property over random traces, chunks
  with separators included).  With ``capacity_tokens`` the seen segments live in an LRU
  of that many tokens (a like-for-like reference, per segment only).
* :func:`whole_block_segments`: a request's segments as a whole-block layout pads
  them, for the oracle of such layouts (a reference: how much of a gap padding holds).
* :class:`RelocationCeiling`: about the least position-independent reuse of such
  segments can prefill when it recomputes the first ``r`` blocks of each relocated chunk
  (or run): a reference for what a recompute setting leaves reachable, not a bound.
* :func:`prefix_bound`: what block-granular prefix caches that never evict leave to
  prefill when requests go round robin to engines with caches of their own (``local``)
  or one shared between them (``shared``; with one engine, the floor of any routing
  over any number of servers).

Only the unbounded figures are lower bounds for *every* cache: an LRU over N blocks is
not the best N blocks can do (Belady's eviction keeps more), so the capacity-matched
ones are like-for-like references.  :func:`check_bounds` fails a bench (``BoundError``,
exit status :data:`BOUND_EXIT`) when a mode prefilled less than its bound.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from promptsplice.blocks import chain_hashes, round_up
from promptsplice.errors import PromptspliceError

__all__ = [
    "radix_prefill_tokens", "RadixPrefill", "OracleCounter", "whole_block_segments", "RelocationCeiling",
    "floor_per_request",
    "bound_checks", "BoundError",
    "BOUND_EXIT", "check_bounds", "prefix_bound",
]


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    neq = np.flatnonzero(x != y)
    return int(neq[0]) if len(neq) else n


class _SortedSet:
    """Token sequences kept sorted: the longest common prefix of a query with any member
    is reached at a neighbour of its insertion point."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, ...]] = []

    def lcp(self, key: tuple[int, ...]) -> int:
        pos = bisect.bisect_left(self._keys, key)
        return max((_lcp(key, self._keys[j]) for j in (pos - 1, pos) if 0 <= j < len(self._keys)), default=0)

    def add(self, key: tuple[int, ...]) -> None:
        pos = bisect.bisect_left(self._keys, key)
        if pos == len(self._keys) or self._keys[pos] != key:
            self._keys.insert(pos, key)

    def discard(self, key: tuple[int, ...]) -> None:
        pos = bisect.bisect_left(self._keys, key)
        if pos < len(self._keys) and self._keys[pos] == key:
            del self._keys[pos]


class _Node:
    __slots__ = ("edge", "children", "parent", "last")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last = 0


class RadixPrefill:
    """Online radix-ideal prefill: feed prompts in arrival order.

    ``capacity_tokens=None``: unbounded.  Otherwise the tree keeps at most that many
    tokens, evicting least-recently-used leaves after each prompt.
    """

    def __init__(self, capacity_tokens: int | None = None) -> None:
        self.capacity_tokens = capacity_tokens
        self._root = _Node((), None)
        self._size = 0
        self._clock = 0
        self.prefill_tokens = 0
        self.prompt_tokens = 0

    def add(self, tokens: Sequence[int]) -> int:
        """Tokens this prompt leaves to prefill; records the prompt."""
        key = tuple(tokens)
        self._clock += 1
        matched = self._insert(key)
        cached = min(matched, max(len(key) - 1, 0))
        if self.capacity_tokens is not None:
            self._evict()
        prefill = len(key) - cached
        self.prefill_tokens += prefill
        self.prompt_tokens += len(key)
        return prefill

    def _insert(self, key: tuple[int, ...]) -> int:
        """Insert ``key``; returns how many leading tokens were already in the tree."""
        node, i = self._root, 0
        node.last = self._clock
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = _Node(key[i:], node)
                leaf.last = self._clock
                node.children[key[i]] = leaf
                self._size += len(key) - i
                return i
            n = _lcp(child.edge, key[i:])
            if n < len(child.edge):  # split the edge
                mid = _Node(child.edge[:n], node)
                node.children[key[i]] = mid
                child.edge = child.edge[n:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                mid.last = child.last
                child = mid
            child.last = self._clock
            node, i = child, i + n
            if n < len(child.edge):
                break
        return i

    def _evict(self) -> None:
        cap = self.capacity_tokens or 0
        while self._size > cap:
            leaves: list[_Node] = []
            stack = [self._root]
            while stack:
                nd = stack.pop()
                if nd.children:
                    stack.extend(nd.children.values())
                elif nd is not self._root:
                    leaves.append(nd)
            if not leaves:
                return
            leaves.sort(key=lambda nd: nd.last)
            for leaf in leaves:
                if self._size <= cap:
                    break
                parent = leaf.parent
                assert parent is not None
                del parent.children[leaf.edge[0]]
                self._size -= len(leaf.edge)


def radix_prefill_tokens(prompts: Iterable[Sequence[int]], capacity_tokens: int | None = None) -> int:
    radix = RadixPrefill(capacity_tokens)
    for p in prompts:
        radix.add(p)
    return radix.prefill_tokens


class OracleCounter:
    """Exact-content oracle over trimmed segments (see the module docstring).

    ``add`` takes ``(digest, tokens)`` pairs: ``tokens`` is either the segment's token
    ids (prefix credit applies) or just its token count (whole-segment reuse only).
    """

    def __init__(self, capacity_tokens: int | None = None) -> None:
        self.capacity_tokens = capacity_tokens
        self._seen: OrderedDict[bytes, tuple[int, ...] | int] = OrderedDict()
        self._prefixes = _SortedSet()
        self._size = 0
        self.prefill_tokens = 0

    def add(self, segments: Iterable[tuple[bytes, Sequence[int] | int]], query_tokens: int = 0) -> int:
        """Tokens this request leaves to prefill (at least 1 with ``query_tokens`` 0 and
        nothing new); ``query_tokens``: tokens always computed (legacy callers)."""
        total = query_tokens
        new: list[tuple[bytes, tuple[int, ...] | int]] = []
        for digest, toks in segments:
            if digest in self._seen:
                self._seen.move_to_end(digest)
                continue
            if isinstance(toks, int):
                total += toks
                new.append((digest, toks))
            else:
                key = tuple(toks)
                total += len(key) - self._prefixes.lcp(key)
                new.append((digest, key))
        for digest, key in new:
            if digest not in self._seen:
                self._seen[digest] = key
                self._size += key if isinstance(key, int) else len(key)
                if not isinstance(key, int):
                    self._prefixes.add(key)
        if self.capacity_tokens is not None:
            while self._size > self.capacity_tokens and self._seen:
                _, old = self._seen.popitem(last=False)
                self._size -= old if isinstance(old, int) else len(old)
                if not isinstance(old, int):
                    self._prefixes.discard(old)
        total = max(total, 1)
        self.prefill_tokens += total
        return total


def whole_block_segments(
    segments: Sequence[tuple[bytes, Sequence[int] | int]], block_size: int
) -> list[tuple[bytes, Sequence[int] | int]]:
    """``segments`` (an :class:`OracleCounter` request) as a whole-block layout sends
    them: every segment but the last (the query) padded to whole blocks, as a token count
    (whole-segment reuse only).  Fed to an :class:`OracleCounter`, the exact-content
    oracle of the layouts ``bench rag``'s store modes send with
    ``--pic-exact-alignment all``: padding is prefill no reuse of whole-block chunks
    avoids.  A reference, not a bound (a mode may send a chunk unpadded)."""
    out: list[tuple[bytes, Sequence[int] | int]] = [
        (digest, round_up(toks if isinstance(toks, int) else len(toks), block_size)) for digest, toks in segments[:-1]
    ]
    return out + list(segments[-1:])


class RelocationCeiling:
    """What position-independent reuse of whole-block segments can prefill at best when
    it recomputes ``recompute_blocks`` blocks at the start of each relocated chunk
    (``per_chunk``, ``recompute_at="chunk"``) or only where a chunk does not stand
    behind the segment it followed before (``recompute_at="run"``).

    Fed :func:`whole_block_segments` requests: a segment of a leading run some earlier
    request began with is free (prefix cache, the exact lead, a re-ask's stored
    blocks); any other segment seen before costs ``min(r blocks, its size)``, free at
    ``"run"`` when it follows the segment it followed before; a new one costs its size;
    the query is always computed, and at least one token per request.  It assumes
    every chunk seen before is stored and relocated and no guard ever computes a run.
    A reference, not a bound (``bench rag`` reports it as ``pic_ceiling_prefill_tokens``):
    a mode may still prefill a little less, where a re-ask's prefix hit covers its query's
    whole blocks (charged here in full), where its own layout orders the segments
    otherwise than the requests fed here, or where two trimmed versions of a chunk share
    leading blocks (different digests here)."""

    def __init__(self, block_size: int, recompute_blocks: int, *, per_chunk: bool = True) -> None:
        self.recompute_tokens = recompute_blocks * block_size
        self.per_chunk = per_chunk
        self._seen: set[bytes] = set()
        self._pairs: set[tuple[bytes | None, bytes]] = set()
        self._prefixes: set[tuple[bytes, ...]] = set()
        self.prefill_tokens = 0

    def add(self, segments: Sequence[tuple[bytes, Sequence[int] | int]]) -> int:
        """Tokens this request leaves to prefill (the last segment is the query)."""
        def size(toks: Sequence[int] | int) -> int:
            return toks if isinstance(toks, int) else len(toks)

        digests = [d for d, _ in segments[:-1]]
        total, lead = sum(size(t) for _, t in segments[-1:]), True
        for i, (digest, toks) in enumerate(segments[:-1]):
            lead = lead and tuple(digests[: i + 1]) in self._prefixes
            prev = digests[i - 1] if i else None
            if lead or (digest in self._seen and not self.per_chunk and (prev, digest) in self._pairs):
                continue
            total += min(self.recompute_tokens, size(toks)) if digest in self._seen else size(toks)
        for i, digest in enumerate(digests):
            self._seen.add(digest)
            self._pairs.add((digests[i - 1] if i else None, digest))
            self._prefixes.add(tuple(digests[: i + 1]))
        total = max(total, 1)
        self.prefill_tokens += total
        return total


def floor_per_request(content: Sequence[int], *streams_prefill: Sequence[int]) -> int:
    """The oracle's total: per request the least of the content bound (``content``, what
    :meth:`OracleCounter.add` returned) and each prefix-caching mode's radix ideal on its
    own prompts (what :meth:`RadixPrefill.add` returned for them).

    The content bound credits a new segment only for its token prefix shared with a seen
    *segment*; a prefix-cache hit can run across segment boundaries when one chunk's text
    holds what another request sent as two chunks (a separator inside a chunk: Markdown,
    paragraphs, a second index).  No prefix-caching mode prefills less than its own radix
    ideal on any request, so the least of the two is a lower bound for every such mode.
    """
    total = 0
    for i, c in enumerate(content):
        total += min([c, *(s[i] for s in streams_prefill)])
    return total


def bound_checks(prefill: Mapping[str, int], *, radix: int, oracle: int,
                 own_radix: Mapping[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Each mode's bound as the RAG benches report it (``naive``: the radix ideal of its
    prompts; every other mode: the oracle, or the radix ideal of the mode's own prompts
    when that is higher, ``own_radix``: mode -> tokens, for the prefix-caching modes)
    and whether it holds; ``prefill``: mode -> tokens it prefilled (measured or
    predicted).  The oracle is the least over every mode per request, so a mode that
    over-counts its own hits passed it by a wide margin; a prefix cache never holds
    more than a radix tree fed the same prompts, so its own radix ideal catches that."""
    out = {}
    for mode, tokens in prefill.items():
        name, bound = ("radix", radix) if mode == "naive" else ("oracle", oracle)
        own = (own_radix or {}).get(mode)
        if own is not None and own > bound:
            name, bound = "own_radix", own
        out[mode] = {"bound": name, "bound_prefill_tokens": bound, "prefill_tokens": tokens, "holds": tokens >= bound}
    return out


BOUND_EXIT = 4
"""The CLI's exit status when a mode prefilled less than its lower bound."""


class BoundError(PromptspliceError, RuntimeError):
    """A mode prefilled fewer tokens than its lower bound: a bug in the bound or the bench
    (a cache shared between modes, a bound that does not apply), never a result."""


def check_bounds(checks: Mapping[str, Mapping[str, Any]], *, what: str = "bench") -> None:
    """Raise :class:`BoundError` naming every mode whose ``prefill_tokens`` is below its
    ``bound_prefill_tokens`` (``checks``: mode -> {"bound", "bound_prefill_tokens",
    "prefill_tokens"}, as the benches report them)."""
    bad = [
        f"{mode} prefilled {c['prefill_tokens']} tokens, below its bound ({c['bound']}) of "
        f"{c['bound_prefill_tokens']}"
        for mode, c in checks.items()
        if c["prefill_tokens"] < c["bound_prefill_tokens"]
    ]
    if bad:
        raise BoundError(
            f"{what}: " + "; ".join(bad) + ": no mode can beat its lower bound, so the bound or the "
            "bench is wrong (a cache or store shared between modes, a bound that does not apply to the mode)"
        )


def _leading_run(hashes: Sequence[bytes], known: set[bytes]) -> int:
    n = 0
    for h in hashes:
        if h not in known:
            break
        n += 1
    return n


def _held_run(hashes: Sequence[bytes], held: Mapping[bytes, int], mine: set[bytes]) -> int:
    """The leading run of ``hashes`` some other request holds (``held``: per block, the
    requests that hold it, ``mine`` among them)."""
    n = 0
    for h in hashes:
        if held.get(h, 0) - (h in mine) <= 0:
            break
        n += 1
    return n


def prefix_bound(prompts: Sequence[Sequence[int]], block_size: int, engines: int = 2,
                 failed: Collection[int] = (), *, any_order: bool = False) -> dict[str, Any]:
    """The least prefill the pair can reach, with caches that never evict: request ``i``
    on engine ``i % engines`` computes every token after the longest leading run of
    whole blocks (never the last token) already computed by that engine (``local``) or
    by any engine (``shared``).  A prefix cache, and a connector that extends it, reuse
    nothing else, so no mode may prefill less than its bound.

    ``failed``: indices of requests that raised: they count no tokens, but every block of
    their prompt counts as computed (a request may fail after its prefill), so the bound
    of the requests that ran stays a lower bound.  ``any_order``: requests in flight
    together may finish in any order, so a block counts as computed for a request when
    any other request holds it, earlier or later (a weaker bound, for concurrent runs)."""
    own: list[set[bytes]] = [set() for _ in range(engines)]
    union: set[bytes] = set()
    if any_order:  # every request's blocks, held before any request runs (less its own)
        fulls = [chain_hashes(list(t), block_size) for t in prompts]
        on_engine = [Counter() for _ in range(engines)]  # type: list[Counter[bytes]]
        everywhere: Counter[bytes] = Counter()
        for i, full in enumerate(fulls):
            on_engine[i % engines].update(set(full))
            everywhere.update(set(full))
    local = shared = total = 0
    for i, tokens in enumerate(prompts):
        # a request is served at most its blocks before the last token, and caches every
        # full block it computed (a prompt of whole blocks is a later one's prefix whole)
        full = fulls[i] if any_order else chain_hashes(list(tokens), block_size)
        hashes = full[: (len(tokens) - 1) // block_size]
        if i in failed:
            own[i % engines].update(full)
            union.update(full)
            continue
        total += len(tokens)
        if any_order:
            mine = set(full)
            local += len(tokens) - _held_run(hashes, on_engine[i % engines], mine) * block_size
            shared += len(tokens) - _held_run(hashes, everywhere, mine) * block_size
            continue
        local += len(tokens) - _leading_run(hashes, own[i % engines]) * block_size
        shared += len(tokens) - _leading_run(hashes, union) * block_size
        own[i % engines].update(full)
        union.update(full)
    return {
        "prompt_tokens": total,
        "local_prefill": local,
        "shared_prefill": shared,
        "shared_over_local": round(shared / local, 4) if local else None,
    }
