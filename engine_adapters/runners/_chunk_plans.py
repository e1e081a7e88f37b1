"""The pure half of position-independent reuse: where a chunk's exact KV lives
(:class:`ChunkIndex`, checked against the block store on every lookup), whether
relocating pays (:func:`pic_choice`) and the engine requests of a plan
(:func:`plan_chunk_phases`).  No engine, no torch; :mod:`._rag` runs them.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from promptsplice.assembler import AssembledPrompt, SegmentKind
from promptsplice.blocks import HASH_BYTES, BlockHash, chain_hashes, chunk_key, root_hash
from promptsplice.engine_adapters.connector._plans import SplicePhase, SpliceSegment, plan_segment_phases
from promptsplice.engine_adapters.store._store import BlockRef, BlockStore, chain_refs
from promptsplice.errors import ConfigError, InputError
from promptsplice._validate import check_block_size, check_int

__all__ = [
    "ChunkIndex",
    "ChunkLookup",
    "ChunkPlacement",
    "ChunkSource",
    "ChunkStatus",
    "GuardRates",
    "PicChoice",
    "StoreQuery",
    "continued_chunks",
    "match_chains",
    "pic_choice",
    "plan_chunk_phases",
    "precompute_sources",
]


class ChunkStatus(enum.Enum):
    HIT = "hit"
    """Indexed, and every block is in the store with the same tokens, parent and salt."""
    MISS = "miss"
    """Never indexed (or forgotten by the index's LRU bound)."""
    STALE = "stale"
    """Indexed, but the store no longer serves all its blocks (evicted, damaged)."""


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Where a chunk's exact KV lives: computed at token ``start`` of a prompt whose
    block before it has chain hash ``parent``, stored under ``salt``."""

    parent: bytes
    start: int
    num_blocks: int
    salt: str | None


class ChunkLookup(NamedTuple):
    status: ChunkStatus
    source: ChunkSource | None = None


class StoreQuery(Protocol):
    """What a chunk index asks of a block store it cannot read in process: a served
    engine's (:meth:`RemoteEngine.match_chains
    <promptsplice.engine_adapters.RemoteEngine.match_chains>`, one request per call;
    every chain it is given is non-empty)."""

    def match_chains(self, chains: Sequence[tuple[Sequence[BlockRef], str | None]]) -> list[int]: ...


def match_chains(store: BlockStore | StoreQuery, chains: Sequence[tuple[Sequence[BlockRef], str | None]]) -> list[int]:
    """Stored leading blocks of each (refs, salt) chain: ``store.match_prefix`` per chain
    in process, one store query for all of them on a served engine."""
    if isinstance(store, BlockStore):
        return [store.match_prefix(refs, salt=salt) if refs else 0 for refs, salt in chains]
    asked = [i for i, (refs, _) in enumerate(chains) if refs]
    out = [0] * len(chains)
    if asked:
        for i, n in zip(asked, store.match_chains([chains[i] for i in asked]), strict=True):
            out[i] = n
    return out


class ChunkIndex:
    """Content key -> :class:`ChunkSource`, checked against the store on every lookup.

    The index holds no KV: the payloads stay in the store under their chain keys (one
    copy in DRAM, whichever way a block is reached); the content key is an alias that
    finds them from the chunk's tokens alone.  ``store``: the engine's
    :class:`BlockStore`, or a served engine (a :class:`StoreQuery`: the index lives in
    the client, the store in the server, asked once per :meth:`lookup_many`).
    ``identity`` names whatever else the KV depends on (model, layout, RoPE, tokenizer)
    and enters every key.  LRU-bounded to ``max_entries``; thread-safe.
    """

    def __init__(
        self, store: BlockStore | StoreQuery, *, block_size: int, identity: str = "", max_entries: int = 100_000
    ) -> None:
        check_block_size(block_size)
        check_int(max_entries, "max_entries")
        if not isinstance(identity, str):
            raise ConfigError(f"identity must be a str, got {type(identity).__name__}")
        self.store = store
        self.block_size = block_size
        self.identity = identity
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, ChunkSource] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, tokens: Sequence[int], *, salt: str | None) -> bytes:
        return chunk_key(tokens, block_size=self.block_size, salt=salt, identity=self.identity)

    def _check(self, tokens: Sequence[int]) -> list[int]:
        toks = [int(t) for t in tokens]
        if not toks or len(toks) % self.block_size:
            raise InputError(
                f"a chunk of {len(toks)} tokens is not whole blocks of {self.block_size}: "
                "assemble with alignment='all' so every chunk owns whole blocks"
            )
        return toks

    def record(self, tokens: Sequence[int], source: ChunkSource) -> None:
        """Remember that ``tokens`` (whole blocks) were computed exactly at ``source``."""
        toks = self._check(tokens)
        if source.num_blocks != len(toks) // self.block_size:
            raise InputError(f"source has {source.num_blocks} blocks, the chunk {len(toks) // self.block_size}")
        k = self.key(toks, salt=source.salt)
        with self._lock:
            self._entries[k] = source
            self._entries.move_to_end(k)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def refs(self, tokens: Sequence[int], source: ChunkSource) -> list[BlockRef]:
        """The store refs of the chunk's blocks at ``source`` (chained from its parent)."""
        return chain_refs(list(tokens), self.block_size, parent=BlockHash(source.parent))

    def lookup(self, tokens: Sequence[int], *, salt: str | None) -> ChunkLookup:
        """Is the chunk's exact KV stored?  Reads the store's index only (no file)."""
        return self.lookup_many([tokens], salt=salt)[0][0]

    def lookup_many(
        self,
        chunks: Sequence[Sequence[int]],
        *,
        salt: str | None,
        also: Sequence[tuple[Sequence[BlockRef], str | None]] = (),
    ) -> tuple[list[ChunkLookup], list[int]]:
        """:meth:`lookup` of each chunk, and the stored leading blocks of each (refs,
        salt) chain in ``also``, with one store query for all of them."""
        keyed = []
        for tokens in chunks:
            toks = self._check(tokens)
            k = self.key(toks, salt=salt)
            with self._lock:
                source = self._entries.get(k)
                if source is not None:
                    self._entries.move_to_end(k)
            keyed.append((toks, k, source))
        asked = [(self.refs(toks, src), src.salt) for toks, _, src in keyed if src is not None]
        asked += also
        answers = match_chains(self.store, asked) if asked else []
        counts = iter(answers)
        out = []
        for toks, k, source in keyed:
            if source is None:
                out.append(ChunkLookup(ChunkStatus.MISS))
            elif next(counts) < source.num_blocks:
                with self._lock:
                    if self._entries.get(k) is source:
                        del self._entries[k]
                out.append(ChunkLookup(ChunkStatus.STALE))
            else:
                out.append(ChunkLookup(ChunkStatus.HIT, source))
        return out, answers[len(answers) - len(also):]

    def __len__(self) -> int:
        return len(self._entries)


class PicChoice(NamedTuple):
    """Predicted prefill (tokens) of a position-independent request both ways."""

    pic_tokens: int
    """Its plan: the precompute of missing chunks, each chunk's recomputed blocks (those
    the deviation guard is expected to add included), the rest not relocated."""
    exact_tokens: int
    """One plain request under the tenant's salt (prefix cache and store hits only)."""
    precompute: bool = True
    """The plan precomputes the missing chunks (``False``: computes them where they
    stand, behind relocated KV: cheaper now, but they are then not stored exact)."""

    @property
    def pays(self) -> bool:
        return self.pic_tokens < self.exact_tokens


def pic_choice(
    num_tokens: int,
    hit: int,
    head_end: int,
    chunks: Sequence[tuple[int, int]],
    missing: Sequence[tuple[int, int]],
    *,
    head_hit: int,
    exact_tokens: int,
    recompute_blocks: int,
    block_size: int,
    min_group_blocks: int = 1,
    extra_blocks: tuple[float, float] = (0.0, 0.0),
    continued: Collection[int] = frozenset(),
) -> PicChoice:
    """Compare the plan's predicted prefill with one exact request's (pure).

    ``num_tokens``, ``hit``, ``head_end``, ``chunks`` describe the plan's prompt: its
    length, its prefix-cache hit under the reuse salt, where the head (loaded from the
    tenant's exact blocks) ends, and ``(start, end)`` of every chunk it would relocate,
    ``missing`` those of them to precompute first; ``head_hit``: the leading tokens of
    that prompt the tenant's store holds (the plan loads its head from there: vLLM's
    cache under the tenant's salt is not the plan's).  ``exact_tokens``: the predicted
    prefill of the exact request (its own layout).  The plan is grouped into requests as
    :func:`plan_chunk_phases` groups it (a run moving fewer than ``min_group_blocks``
    blocks is computed); more requests cost no prefill (each starts at the last one's
    end, a prefix hit).  ``extra_blocks``: the chance that a probed chunk's own run start
    deviates (the share of its loaded blocks the guard computed for that), for stored and
    for precomputed chunks (the runner's measured rates, :class:`GuardRates`); the guard
    is sticky, so each probed run is charged the chance that it or an earlier one
    deviates.  ``continued``: the starts of chunks that continue their
    source run (:func:`continued_chunks`: nothing recomputed, no guard).  Relocation
    pays only when chunks move more than that and the precompute is repaid: short
    chunks that start no run, new chunks and exact repeats go out exact.
    """
    bs, r = block_size, recompute_blocks
    start = max(hit, min(head_end, head_hit))
    new = set(missing)
    nil = bytes(HASH_BYTES)  # parents play no part in the grouping
    segs = [SpliceSegment(0, head_end // bs, 0, nil)] if head_end > hit and head_end >= bs else []
    for s, e in chunks:
        a = max(s + (0 if s in continued else r) * bs, hit)
        if e - a >= bs:
            segs.append(SpliceSegment(a, (e - a) // bs, 0, nil))
    try:
        phases = plan_segment_phases(segs, num_tokens, block_size=bs, hit=hit, min_group_blocks=min_group_blocks)
    except InputError:  # not a plan plan_chunk_phases would make (unsorted, overlapping): it never pays
        return PicChoice(num_tokens + 1, exact_tokens)
    moved = {seg.dst_start: seg.num_blocks for ph in phases if ph.plan for seg in ph.plan.segments
             if seg.dst_start >= head_end and seg.dst_start >= hit}
    # what the guard computes when a run start deviates: the phase's whole loaded run
    run = {ph.plan.segments[0].dst_start: sum(g.num_blocks for g in ph.plan.segments)
           for ph in phases if ph.plan and ph.plan.segments}
    extra = 0.0
    calm = 1.0  # the chance that no earlier run start deviated: the guard is sticky
    for s, e in chunks:
        if s in continued:
            continue  # not probed: the guard never recomputes more of it
        a = max(s + r * bs, hit)
        if a in moved and a < e and r and hit <= s:  # probed: computed if it or an earlier start deviates
            calm *= 1.0 - min(extra_blocks[(s, e) in new], 1.0)
            extra += (1.0 - calm) * run.get(a, moved[a]) * bs
    pic = num_tokens - start - bs * sum(moved.values()) + sum(e - s for s, e in missing) + round(extra)
    return PicChoice(pic, exact_tokens)


class GuardRates:
    """What the deviation guard (``AdaptiveRecompute``) costs a probed chunk, learnt per
    runner, and the gate that reads it.

    The rate, for stored and for just-precomputed chunks apart: the share of a probed
    chunk's loaded blocks the guard computed because the chunk's *own* run start
    deviated (``AdaptiveRecompute.deviated``, not the runs a sticky guard computed after
    an earlier one), a running mean over the runner's requests starting from
    :attr:`PRIOR` worth :attr:`PRIOR_CHUNKS` chunks.  :func:`pic_choice` reads it as the
    chance of a trip at that chunk.  (A share, not a count: the RAG guard computes a
    chunk's whole run, so what it costs grows with the chunk.  Chunks met in another
    request's context deviate more than chunks precomputed in this request's order.)

    A request's chunks count up to the first whose own start deviated: the gate's
    product of chances needs the chance of a trip *given no earlier one* (trips cluster
    within a request, and chunks behind a trip were measured behind computed runs).
    The rate is learnt only from requests that relocate, so a rate pushed up by a few
    unlucky requests (or a prior) could send every later one exact and never be
    corrected: while a kind has fewer than :attr:`EXPLORE_CHUNKS` chunks learnt,
    :meth:`choose` lets one in :attr:`EXPLORE_EVERY` of the requests the rates refused,
    and that would pay were chunks of that kind never to trip, relocate anyway, at most
    :attr:`EXPLORE_LIMIT` per kind in a runner's life (each may prefill more than its
    exact request; :attr:`explored` counts them).  Per kind: precomputed chunks are
    probed rarely (2 against 76 stored ones by the end of 80 pydocs requests, 6 against
    37 on wiki), so one count for both would close the window before the kind a prior
    most needs corrected was seen; the limit bounds what a window left open costs.  An
    exploration is charged to each learning kind whose zeroed rate alone lowers the
    request's prediction, and refunded for a kind of which :meth:`observe` then counted
    no chunk (a stored chunk ahead of it tripped first): one life limit for both, or a
    charge for what was never learnt, let tripping stored chunks end the precomputed
    kind's window for good (two reviews found).  At most ``2 * EXPLORE_LIMIT``
    explorations in all, so a kind never reached does not keep the window open.
    """

    PRIOR = (0.2, 0.9)
    """Stored chunks: near the own-trip rates measured at ``bounded`` on 80 requests of
    wiki, wiki-diverse and pydocs (0.13, 0.22, 0.13; README, "The run-start guard").
    The guard is sticky, so a prior of 0.5 charged a request's third probed run 0.875 of
    its blocks: the gate refused most multi-chunk requests before it had learnt
    anything.  Precomputed chunks: every one probed in those runs tripped, its whole
    run computed (11 of 11, rate 1.00 in each family), so near that too (0.1 until
    2026-12-06: the gate's rate rose to 0.49-0.64 by the runs' end).  Both were measured
    at the 0.20 threshold; a runner at another ``max_deviation`` (a guard that never
    trips, 1.0) starts from them too and learns its own through exploration."""
    PRIOR_CHUNKS = 4
    EXPLORE_EVERY = 8
    EXPLORE_CHUNKS = 32
    EXPLORE_LIMIT = 8

    __slots__ = ("_sums", "_counts", "_explored", "_charged", "refused", "explored")

    def __init__(self) -> None:
        self._sums = [0.0, 0.0]
        self._counts = [0, 0]
        self._explored = [0, 0]  # explorations charged per kind (EXPLORE_LIMIT each)
        self._charged: tuple[int, ...] = ()  # the kinds the last exploration was charged to, until observed
        self.refused = 0  # requests the rates refused, counted while exploring, that would
        # pay with rate zero for the kinds still being learnt (learnt rates kept)
        self.explored = 0  # of those, relocated anyway

    def expected(self) -> tuple[float, float]:
        """(stored, precomputed): the mean share of a probed chunk's loaded blocks computed."""
        n = self.PRIOR_CHUNKS
        return tuple((p * n + s) / (n + c) for p, s, c in zip(self.PRIOR, self._sums, self._counts))  # type: ignore[return-value]

    def observed(self) -> dict[str, Any]:
        """What was learnt, without the prior (the bench's report): per chunk kind the
        probed chunks and their mean share computed for their own deviation."""
        return {kind: {"chunks": c, "trip_rate": round(s / c, 4) if c else None}
                for kind, s, c in zip(("stored", "precomputed"), self._sums, self._counts)} | {
            "refused_requests": self.refused, "explored_requests": self.explored}

    def observe(self, chunks: Sequence[tuple[int, int, bool]], extended: Sequence[int], block_size: int) -> None:
        """Count one request: its probed chunks ``(first loaded token, end, precomputed)``
        in prompt order and the starts of the blocks the guard computed for their own
        deviation, up to the first chunk that tripped (class doc).  An exploration's
        charge is refunded for a kind it counted no chunk of."""
        counted: set[int] = set()
        for a, e, new in chunks:
            loaded = max(1, (e - a) // block_size)
            share = min(1.0, sum(a <= x < e for x in extended) / loaded)
            self._sums[new] += share
            self._counts[new] += 1
            counted.add(int(new))
            if share:
                break
        for k in self._charged:
            if k not in counted:
                self._explored[k] -= 1
        self._charged = ()

    def choose(self, predict: Callable[[tuple[float, float]], PicChoice]) -> PicChoice:
        """The gate: ``predict(rates)`` is :func:`pic_choice` of the request with
        ``extra_blocks=rates``.  The choice at the expected rates, but for every
        :attr:`EXPLORE_EVERY`-th request it refused that pays with rate zero for each
        kind of which fewer than :attr:`EXPLORE_CHUNKS` chunks are learnt and fewer than
        :attr:`EXPLORE_LIMIT` explorations charged, that prediction (which relocates)."""
        self._charged = ()  # an exploration that taught nothing (sent exact, unmeasured) keeps its charge
        rates = self.expected()
        choice = predict(rates)
        if choice.pays:
            return choice
        learning = [c < self.EXPLORE_CHUNKS and e < self.EXPLORE_LIMIT for c, e in zip(self._counts, self._explored)]
        if not any(learning) or self.explored >= 2 * self.EXPLORE_LIMIT:
            return choice
        free = predict(tuple(0.0 if k else r for k, r in zip(learning, rates)))  # type: ignore[arg-type]
        if not free.pays:
            return choice
        self.refused += 1
        if self.refused % self.EXPLORE_EVERY:
            return choice
        self.explored += 1
        # charged to the kinds it teaches (zeroing each alone lowers its prediction), to
        # every learning kind when only both together do: none goes unbounded
        teaches = [k for k in (0, 1) if learning[k] and predict(
            tuple(0.0 if i == k else r for i, r in enumerate(rates))).pic_tokens < choice.pic_tokens]  # type: ignore[arg-type]
        self._charged = tuple(teaches or [k for k in (0, 1) if learning[k]])
        for k in self._charged:
            self._explored[k] += 1
        return free


class ChunkPlacement(NamedTuple):
    """A stored chunk placed at ``tokens[start:end]`` of the new prompt (block multiples)."""

    start: int
    end: int
    source: ChunkSource


def continued_chunks(
    tokens: Sequence[int],
    chunks: Sequence[ChunkPlacement],
    *,
    block_size: int,
    head_end: int = 0,
    src_salt: str | None = None,
    recompute_blocks: int = 0,
) -> frozenset[int]:
    """The starts of the chunks whose stored KV was computed right behind what precedes
    them now: the chunk before them from the same source chain at the same offset, or
    the head's exact blocks (pure).

    Such a chunk continues one relocated run, as an unchanged stretch of an agent's
    edited prompt does: its first blocks already attended to their real neighbour, so
    the recompute at chunk starts (EPIC's attention-sink fix) is due only where a run
    starts.  The chain hash decides: the chunk's source parent must be the hash of the
    source block that ended the element before it, so both stood together there.  A
    run starts with a chunk that keeps blocks to load after its ``recompute_blocks``:
    behind a chunk the plan computes whole (at most that many blocks, itself no
    continuation) a chunk starts a run of its own, recomputed and probed.
    """
    bs, toks = block_size, tokens
    out: set[int] = set()
    end, src_end, salt, loaded = head_end, head_end, src_salt, True
    tail = chain_hashes(list(toks[:head_end]), bs, salt=src_salt)[-1] if head_end >= bs else root_hash(src_salt)
    for c in chunks:
        src = c.source
        cont = loaded and c.start == end and src.start == src_end and src.salt == salt and src.parent == tail
        if cont:
            out.add(c.start)
        loaded = cont or c.end - c.start > recompute_blocks * bs
        if c.end - c.start >= bs:
            tail = chain_hashes(list(toks[c.start : c.end]), bs, parent=BlockHash(src.parent))[-1]
        end, src_end, salt = c.end, src.start + (c.end - c.start), src.salt
    return frozenset(out)


def precompute_sources(
    tokens: Sequence[int], head_end: int, group: Sequence[tuple[int, int]], *, block_size: int, salt: str | None
) -> tuple[list[int], list[ChunkSource]]:
    """The exact request that precomputes ``group`` (``(start, end)`` chunks of
    ``tokens``): the head, then the chunks in that order; and where each chunk's KV
    then lives (pure: the runner sends it, the gate predicts from it)."""
    bs = block_size
    pre = list(tokens[:head_end])
    at = []
    for s, e in group:
        at.append(len(pre))
        pre.extend(tokens[s:e])
    chain = chain_hashes(pre, bs, salt=salt)
    return pre, [
        ChunkSource(chain[a // bs - 1] if a else root_hash(salt), a, (e - s) // bs, salt)
        for (s, e), a in zip(group, at, strict=True)
    ]


def plan_chunk_phases(
    tokens: Sequence[int],
    chunks: Sequence[ChunkPlacement],
    *,
    block_size: int,
    hit: int = 0,
    head_end: int = 0,
    recompute_blocks: int = 0,
    src_salt: str | None = None,
    min_group_blocks: int = 1,
    probe: bool = False,
    continue_runs: bool = True,
    scope: bool = False,
) -> list[SplicePhase]:
    """The requests of a position-independent prompt (pure; see the module doc).

    ``hit``: the prefix-cache hit expected under the reuse salt (a block multiple).
    ``tokens[:head_end]`` (system prompt and tools) is loaded from the tenant's exact
    blocks (``src_salt``, delta 0) where the hit does not cover it; each chunk after the
    hit is loaded from its source, re-rotated by ``start - source.start``, except its
    first ``recompute_blocks`` blocks, which are computed (``probe``: and compared with
    the chunk's stored KV by the connector, ``BlockDeviation``), unless the chunk
    continues its source run (:func:`continued_chunks`: all of it loaded;
    ``continue_runs=False``: never).  ``scope``: the requests' salt is a reuse salt
    whose store chains may hold approximate KV (the connector then saves what each
    request loads and computes under it, :class:`SplicePlan.scope`).  Raises
    :class:`~promptsplice.errors.InputError` for chunks that are not sorted, not whole
    blocks, overlapping, or not followed by at least one token.
    """
    bs = block_size
    check_int(recompute_blocks, "recompute_blocks", minimum=0)
    if hit % bs or head_end % bs:
        raise InputError(f"hit {hit} and head_end {head_end} must be multiples of block_size {bs}")
    toks = list(tokens)
    segs: list[SpliceSegment] = []
    probes: list[SpliceSegment] = []
    if head_end > hit:
        segs.append(SpliceSegment(0, head_end // bs, 0, root_hash(src_salt)))
    continued = continued_chunks(
        toks, chunks, block_size=bs, head_end=head_end, src_salt=src_salt, recompute_blocks=recompute_blocks
    ) if continue_runs else ()
    prev_end = head_end
    for c in chunks:
        if c.start % bs or c.end % bs or not prev_end <= c.start < c.end <= len(toks) - 1:
            raise InputError(
                f"chunk at [{c.start}, {c.end}) must be whole blocks of {bs}, sorted, after the "
                f"head and before the prompt's last token ({len(toks)} tokens)"
            )
        if c.source.num_blocks != (c.end - c.start) // bs:
            raise InputError(f"chunk at [{c.start}, {c.end}) has a source of {c.source.num_blocks} blocks")
        prev_end = c.end
        a = max(c.start + (0 if c.start in continued else recompute_blocks) * bs, hit)
        if a >= c.end:
            continue
        parent = BlockHash(c.source.parent)
        if a > c.start:
            if probe and hit <= c.start:
                probes.append(SpliceSegment(c.start, (a - c.start) // bs, c.start - c.source.start, parent))
            parent = chain_hashes(toks[c.start : a], bs, parent=parent)[-1]
        segs.append(SpliceSegment(a, (c.end - a) // bs, c.start - c.source.start, parent))
    return plan_segment_phases(
        segs, len(toks), block_size=bs, hit=hit, src_salt=src_salt, min_group_blocks=min_group_blocks,
        probes=probes, scope=scope,
    )


def chunk_list(chunks: Any) -> Any:
    """``chunks`` as a list (the request reads them more than once); anything that is not
    an iterable of chunks is passed on as it is, for the assembler to refuse with its own
    message (``list()`` ran a str as one chunk per character, and raised a bare
    TypeError on None)."""
    if isinstance(chunks, (str, bytes, bytearray, Mapping)) or hasattr(chunks, "page_content"):
        return chunks
    try:
        return list(chunks)
    except TypeError:
        return chunks


def computed_chunk_tokens(prompt: AssembledPrompt, stored: set[tuple[str, ...]], cached: int) -> int:
    """Tokens of the ``stored`` chunks (by their ids) that one request of ``prompt``
    computed: those behind the ``cached`` tokens vLLM served it (prefix cache or store)."""
    return sum(
        max(0, s.end - max(s.start, cached))
        for s in prompt.segments
        if s.kind is SegmentKind.CHUNK and s.chunk_ids in stored
    )
