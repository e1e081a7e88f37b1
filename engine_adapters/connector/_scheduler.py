"""The connector's scheduler side: how many tokens the store can serve after the local
prefix-cache hit, where they go, and which computed blocks to save.  Plain values in,
plain records out (:class:`SpliceMetadata`, the step's work for the worker side); no
torch, no vLLM (the glue in ``_connector`` translates vLLM's objects).

Three jobs, one store (:mod:`promptsplice.engine_adapters.store._store`, keyed by the
chain hash of :mod:`promptsplice.blocks` with the request's ``cache_salt``):

* **Save**: every full prompt block a request computes is saved, all layers in one
  payload.  Loaded blocks are not saved again, and neither is anything a request
  computes after relocated KV (its deep layers attended to approximate KV): the store
  holds exact blocks only, except under a splice scope (:mod:`._plans`).  Generated
  tokens' blocks are not saved.
* **Offload hits**: on a local prefix-cache miss, the blocks that follow the local hit
  and are really in the store (``match_prefix``, pinned for the request) are loaded
  instead of computed.
* **Relocation**: a request that carries a :class:`~._plans.SplicePlan` gets the planned
  old blocks (stored under the *old* prompt's chain hashes) loaded, and the worker side
  re-rotates their keys by the position delta.

vLLM's contiguity rule: the loaded tokens start exactly at the local hit and at least
one prompt token is left to compute, so one request loads one contiguous run of blocks;
each block of the run is either an offload hit (delta 0) or a relocated block of a plan
segment (delta ``d``).

What vLLM's cache holds, as far as the connector can tell: under a tenant's (exact)
salt the keys a relocation *tainted*; under a salt that may hold approximate KV (a
scope, a reuse salt) the keys known *clean*, computed or loaded exact with nothing
approximate before them, and never *dirty* (filed anything else, from the moment
vLLM schedules it: vLLM caches a block as it allocates it, and a hit takes the first
of several blocks under one key).  A scoped request's clean blocks are saved under the tenant's
salt too (:attr:`SpliceScheduler.exact_saved_blocks`), where the tenant's requests and
a chunk index find them.

Kept as one module (~780 lines): the loads, saves, taints and clean and dirty keys of one request
are decided together, from one state per request, in vLLM's call order.
"""

from __future__ import annotations

import bisect

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from promptsplice.blocks import BlockHash, cacheable_blocks, cdiv, hash_block, round_down
from promptsplice.engine_adapters.connector._plans import SAME_SALT, SplicePlan, in_place_blocks
from promptsplice.engine_adapters.store._store import BlockRef, BlockStore, chain_refs
from promptsplice.errors import InputError
from promptsplice._validate import DERIVED_SALT_MARK, check_block_size, holds_exact_kv_only

__all__ = [
    "LoadItem",
    "LoadPlan",
    "ProbeItem",
    "SaveItem",
    "SpliceMetadata",
    "SpliceScheduler",
    "plan_load",
]

_log = logging.getLogger(__name__)
_SAME = object()
"""``hit_salt``'s default: the request's own salt."""


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What the connector will load for a request: blocks ``refs`` (with per-block
    position ``deltas``) into the request's blocks from token ``start`` on."""

    start: int
    block_size: int
    refs: tuple[BlockRef, ...] = ()
    deltas: tuple[int, ...] = ()
    salts: tuple[str | bytes | None, ...] | None = None
    """Per-ref salts when some refs come from another salt (``None``: the request's)."""
    approx: tuple[bool, ...] = ()
    """Per ref: its KV is approximate (a plan's block, moved or after other tokens;
    :func:`~promptsplice.engine_adapters.connector._plans.in_place_blocks`)."""

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    @property
    def num_tokens(self) -> int:
        return len(self.refs) * self.block_size


def _plan_refs(
    tokens: Sequence[int], plan: SplicePlan, block_size: int, *, probes: bool = False
) -> dict[int, tuple[BlockRef, int]]:
    """Block index in the new prompt -> (ref of the old block, delta), per segment (per
    probe with ``probes``)."""
    out: dict[int, tuple[BlockRef, int]] = {}
    for seg in plan.probes if probes else plan.segments:
        parent = BlockHash(seg.src_parent)
        first = seg.dst_start // block_size
        for j in range(first, first + seg.num_blocks):
            blk = tuple(tokens[j * block_size : (j + 1) * block_size])
            if len(blk) < block_size:
                return out  # the plan runs past the prompt: the rest cannot be whole blocks
            key = hash_block(parent, blk)
            out[j] = (BlockRef(key, parent, blk), seg.delta)
            parent = key
    return out


def plan_load(
    store: BlockStore,
    prompt_tokens: Sequence[int],
    num_computed_tokens: int,
    *,
    block_size: int,
    salt: str | bytes | None = None,
    plan: SplicePlan | None = None,
    owner: Hashable | None = None,
    relocation: bool = True,
    chain: Sequence[BlockRef] | None = None,
) -> LoadPlan:
    """How many blocks after the local hit the store can serve, and which.

    Candidates run from block ``num_computed_tokens // block_size`` up to the last full
    block that still leaves one prompt token to compute (``(len - 1) // block_size``
    blocks in all): a block covered by ``plan`` is its old block (delta of its segment),
    any other block is the new prompt's own chain block (an offload hit, delta 0).  The
    count is the leading run present in the store (``match_prefix``), pinned for
    ``owner`` until ``store.release(owner)``.  ``relocation=False`` ignores plan
    segments with a non-zero delta (the engine cannot rotate keys).  ``chain`` may pass
    the prompt's precomputed ``chain_refs``.  A local hit that is not a block multiple
    loads nothing.
    """
    bs = block_size
    start = int(num_computed_tokens)
    empty = LoadPlan(start, bs)
    if start % bs or start < 0:
        if owner is not None:
            store.release(owner)
        return empty
    first, last = start // bs, cacheable_blocks(len(prompt_tokens), bs)
    if first >= last:
        if owner is not None:
            store.release(owner)
        return empty
    planned: dict[int, tuple[BlockRef, int]] = {}
    if plan:
        if plan.block_size != bs:
            raise InputError(f"the splice plan is for block_size {plan.block_size}, the engine's is {bs}")
        planned = _plan_refs(prompt_tokens, plan, bs)
        if not relocation:
            planned = {j: rd for j, rd in planned.items() if rd[1] == 0}
    if chain is None or len(chain) < last:
        chain = chain_refs(prompt_tokens[: last * bs], bs, salt=salt)
    src_salt = salt if plan is None or plan.src_salt is SAME_SALT else plan.src_salt
    exact = in_place_blocks(plan, prompt_tokens, salt) if planned else set()
    refs: list[BlockRef] = []
    deltas: list[int] = []
    salts: list[str | bytes | None] = []
    approx: list[bool] = []
    for j in range(first, last):
        if j in planned:
            ref, delta = planned[j]
            salts.append(src_salt)
            approx.append(j not in exact)
        else:
            ref, delta = chain[j], 0
            salts.append(salt)
            approx.append(False)
        refs.append(ref)
        deltas.append(delta)
    mixed = any(x != salt for x in salts)
    count = store.match_prefix(refs, salt=salt, owner=owner, salts=salts if mixed else None)
    return LoadPlan(
        start, bs, tuple(refs[:count]), tuple(deltas[:count]), tuple(salts[:count]) if mixed else None,
        tuple(approx[:count]),
    )


# ------------------------------------------------------------------- metadata items


@dataclass(frozen=True, slots=True)
class LoadItem:
    """Load ``refs`` into vLLM blocks ``block_ids`` (keys rotated by ``deltas``).

    Blocks of ``block_ids`` past the end of ``refs`` have no source: load errors."""

    req_id: str
    salt: str | bytes | None
    refs: tuple[BlockRef, ...]
    deltas: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    """The first loaded token (the request's local prefix-cache hit)."""
    ref_salts: tuple[str | bytes | None, ...] | None = None
    """Per-ref salts (``None``: every ref is stored under ``salt``)."""
    approx: tuple[bool, ...] = ()
    """Per ref: approximate KV (see :class:`LoadPlan`); empty: those with a delta."""

    def salt_of(self, index: int) -> str | bytes | None:
        return self.salt if self.ref_salts is None else self.ref_salts[index]

    def approximate(self, n: int | None = None) -> int:
        """How many of the first ``n`` blocks (all by default) are approximate KV."""
        if self.approx:
            return sum(self.approx[:n])
        return sum(1 for d in self.deltas[:n] if d)


@dataclass(frozen=True, slots=True)
class SaveItem:
    """Save vLLM blocks ``block_ids`` (just computed) under ``refs``."""

    req_id: str
    salt: str | bytes | None
    refs: tuple[BlockRef, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ProbeItem:
    """Compare vLLM blocks ``block_ids`` (just computed, first tokens ``starts``) with
    the old blocks ``refs`` (stored under ``salt``, keys rotated by ``deltas``)."""

    req_id: str
    salt: str | bytes | None
    refs: tuple[BlockRef, ...]
    deltas: tuple[int, ...]
    block_ids: tuple[int, ...]
    starts: tuple[int, ...]


@dataclass(slots=True)
class SpliceMetadata:
    """One engine step's work for the worker side: loads before the forward pass,
    saves (and probes) after it."""

    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)
    probes: list[ProbeItem] = field(default_factory=list)


# ------------------------------------------------------------------ scheduler side


@dataclass(slots=True)
class _ReqState:
    tokens: Sequence[int]
    salt: str | bytes | None
    plan: SplicePlan | None = None
    chain: list[BlockRef] | None = None
    pending: LoadPlan | None = None
    no_save: bool = False
    """Set after a relocation: blocks computed after relocated KV are not exact."""
    save_from: int | None = None
    """Scoped requests: the first loaded block, saved (under the scope) with the step."""
    probe_refs: dict[int, tuple[BlockRef, int]] | None = None
    """The plan's probe blocks, hashed once (not on every step the request runs)."""
    probe_order: list[int] = field(default_factory=list)
    """``probe_refs``' block indexes, sorted once."""
    hit_exact: int | None = None
    """Requests under a salt that may hold approximate KV: the leading blocks of its
    local hit known exact (``None``: all of them)."""
    exact_blocks: int | None = None
    """... and of all it holds, the hit, its loads and what it computes (``None``: all)."""
    asked: bool = False
    """vLLM asked for its hit since its last allocation (else an allocation continues a
    request, a streaming input's next chunk: what it holds is never more exact)."""
    exact_target: str | bytes | None | object = _SAME
    """Scoped requests whose plan takes blocks from an exact-only salt (a tenant's) and
    asks for it (``save_exact``): that salt, under which its exact blocks are saved too
    (``_SAME``: none)."""
    target_chain: list[BlockRef] | None = None
    """The prompt's chain under ``exact_target``, hashed once."""


def _first_inexact(refs: Sequence[BlockRef], approx: Sequence[bool], salts: Sequence[Any]) -> int:
    """The first loaded block that is approximate, or comes from a salt that may hold
    approximate KV (``len(refs)``: none)."""
    return next((i for i in range(len(refs)) if approx[i] or not holds_exact_kv_only(salts[i])), len(refs))


def _drop_oldest(keys: OrderedDict[bytes, Any], bound: int, salts: set[Any]) -> int:
    """Drop the oldest of ``keys`` (key -> salt) beyond ``bound``, their salts into
    ``salts`` (trusted no more); returns how many."""
    over = max(len(keys) - bound, 0)
    for _ in range(over):
        salts.add(keys.popitem(last=False)[1])
    return over


_MIN_TAINTED = 1 << 16

_MAX_DISTRUSTED = 4096
"""Distrusted salts kept one by one before they fold into their tenants."""


def _tenant_part(salt: str | bytes) -> str | bytes:
    """A salt's tenant part (a derived salt's part before the mark; a tenant's own
    salt is its own), as the same type."""
    mark = DERIVED_SALT_MARK.encode() if isinstance(salt, bytes) else DERIVED_SALT_MARK
    return salt.split(mark, 1)[0]  # type: ignore[arg-type]


def tainted_bound(num_blocks: int) -> int:
    """How many tainted keys a scheduler remembers for a KV cache of ``num_blocks``
    blocks: twice the cache (a key leaves only after twice as many newer taints and
    hits as vLLM can hold blocks), never fewer than 65,536.  Until 2026-12-07 it was
    65,536 whatever the cache: on a cache larger than that (a small model on a large
    GPU) an idle tenant's approximate blocks outlived their taint in vLLM's cache, and
    a later hit over them saved what it computed after them under exact keys."""
    return max(2 * max(int(num_blocks), 0), _MIN_TAINTED)


class SpliceScheduler:
    """The scheduler-side half of the connector (one per engine).

    The connector forwards vLLM's scheduler calls here with plain values:
    :meth:`get_num_new_matched_tokens` (count and pin), :meth:`update_state_after_alloc`
    (turn the count into a :class:`LoadItem` with the destination block ids),
    :meth:`build_connector_meta` (this step's loads and saves) and
    :meth:`request_finished`.
    """

    def __init__(self, store: BlockStore, block_size: int, *, relocation: bool = True, num_blocks: int = 0) -> None:
        check_block_size(block_size)
        self.store = store
        self.block_size = int(block_size)
        self.relocation = bool(relocation)
        self.max_tainted = tainted_bound(num_blocks)
        """The taint list's bound (:func:`tainted_bound` of vLLM's ``num_blocks``)."""
        self.tainted_dropped = 0
        """Tainted keys dropped at the bound (a warning is logged at the first)."""
        self._reqs: dict[str, _ReqState] = {}
        self._loads: list[LoadItem] = []
        self._warned_plan = False
        # Exact chain keys under which vLLM's prefix cache holds approximate KV: the blocks
        # a request without a scope loaded approximately under its tenant's own salt, and
        # those it computed after them.  A later request whose local hit covers one of
        # them saves nothing (it filed blocks computed after approximate KV under exact
        # keys, and every tier then served them as exact offload hits).  Bounded; a key
        # vLLM evicted and computed again exactly only costs that request its saves.
        self._tainted: OrderedDict[bytes, str | bytes | None] = OrderedDict()  # key -> its salt
        # Salts one of whose taints the bound dropped (vLLM may still hold the block: a
        # running request holds its blocks however long it decodes): a request under
        # them with any local hit saves nothing.
        self._taint_lost: set[str | bytes | None] = set()
        # The converse, for salts that may hold approximate KV (a scope, a reuse salt):
        # ``_clean`` holds chain keys a request filed exact KV under (computed or loaded
        # exact, nothing approximate before it), ``_dirty`` those a request filed (or
        # will file) anything else under, from the moment vLLM schedules it (vLLM caches
        # a block when it allocates it, and keeps several blocks under one key, a hit
        # taking the first).  A key is known exact while it is clean and not dirty: a
        # dirty key stays so until the bound drops it (twice the cache, as the taints;
        # a hit keeps it young).  A scoped request whose local hit is known exact and
        # that loads nothing approximate computes exact blocks: those it holds are saved
        # under the tenant's salt too (``exact_target``), where the tenant's requests,
        # and a chunk index, find them.
        self._clean: OrderedDict[bytes, None] = OrderedDict()
        self._dirty: OrderedDict[bytes, str | bytes | None] = OrderedDict()  # key -> its salt
        self.dirty_dropped = 0
        """Dirty keys dropped at the bound (a warning is logged at the first)."""
        # Salts one of whose dirty keys the bound dropped: vLLM may still hold that key's
        # approximate copy (a running request holds its blocks however long it decodes,
        # and a later exact copy comes second), so nothing under them is known exact any
        # more: a request under them saves nothing under the tenant's salt.
        self._distrusted: set[str | bytes | None] = set()
        # Beyond max_distrusted salts (a scope per agent session: one more per session,
        # never forgotten) the set folds into their tenants: every derived salt of a
        # tenant there is distrusted (sound, coarser; until 2026-12-08 it grew for good)
        self._distrusted_tenants: set[str | bytes] = set()
        self.max_distrusted = _MAX_DISTRUSTED
        self.exact_saved_blocks = 0
        """Blocks of scoped requests also saved under the tenant's salt (known exact)."""
        # Loads issued this step, then those of the last two steps, until vLLM reports
        # which of their blocks failed (:meth:`loads_failed`): (item, tokens, salt).
        self._issued: list[tuple[LoadItem, Sequence[int], str | bytes | None]] = []
        self._awaiting: list[list[tuple[LoadItem, Sequence[int], str | bytes | None]]] = []

    def _state(self, req_id: str, tokens: Sequence[int], salt, params) -> _ReqState:
        st = self._reqs.get(req_id)
        if st is None or st.tokens is not tokens:
            try:
                plan = SplicePlan.from_params(params)
            except InputError as exc:
                # A bad plan must not fail the engine: the request is computed instead.
                _log.warning("splice connector: ignoring the splice plan of %s: %s", req_id, exc)
                plan = None
            if plan is not None and plan.block_size != self.block_size:
                _log.warning(
                    "splice connector: ignoring the splice plan of %s: made for block_size %d, "
                    "the engine's is %d", req_id, plan.block_size, self.block_size,
                )
                plan = None
            if plan and not self.relocation and not self._warned_plan:
                self._warned_plan = True
                _log.warning(
                    "splice connector: relocation is unavailable on this engine (RoPE or KV "
                    "layout not supported); splice plans fall back to computing"
                )
            st = _ReqState(tokens, salt, plan)
            self._reqs[req_id] = st
        return st

    def get_num_new_matched_tokens(
        self,
        req_id: str,
        prompt_tokens: Sequence[int] | None,
        salt: str | bytes | None,
        num_computed_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None = None,
        hit_salt: str | bytes | None | object = _SAME,
        hit_limit: int | None = None,
    ) -> int:
        """Tokens to load after the local hit ``num_computed_tokens`` (block multiple).

        ``hit_salt`` / ``hit_limit``: when the store keys the request under another salt
        than vLLM's hashes (a multimodal request's identity salt), the salt vLLM hashes
        the first ``hit_limit`` tokens of its hit with (its blocks before the first
        input are hashed as a plain request's, so they may be blocks a relocation
        tainted).  Idempotent: asking again replaces the earlier answer and its pins.
        """
        if not prompt_tokens:
            return 0
        st = self._state(req_id, prompt_tokens, salt, kv_transfer_params)
        bs = self.block_size
        last = cacheable_blocks(len(prompt_tokens), bs)
        hit_blocks = num_computed_tokens // bs
        if st.chain is None and (hit_blocks < last or ((self._tainted or self._taint_lost) and hit_blocks)):
            # (a hit of every cacheable block too, when anything is tainted: such a request
            # still computes and saves a whole last block, whose length is a block multiple)
            st.chain = chain_refs(prompt_tokens[: max(last, hit_blocks) * bs], bs, salt=salt)
        hsalt = salt if hit_salt is _SAME else hit_salt
        if (self._tainted or self._taint_lost) and st.chain is not None and not st.no_save and holds_exact_kv_only(hsalt):
            hit = min(hit_blocks, len(st.chain))
            if hit_salt is _SAME:
                hit_chain = st.chain
            else:  # only the blocks vLLM hashed as plain ones (before the first input)
                hit = min(hit, (hit_limit or 0) // bs)
                hit_chain = chain_refs(prompt_tokens[: hit * bs], bs, salt=hsalt) if hit else []
            tainted = [ref.key for ref in hit_chain[:hit] if ref.key in self._tainted]
            if hit and hsalt in self._taint_lost:
                st.no_save = True
            if tainted:
                st.no_save = True  # its local hit holds approximate KV: so is all it computes
                for key in tainted:  # still in vLLM's cache: the last to leave the bound
                    self._tainted.move_to_end(key)
        tracked = not holds_exact_kv_only(salt)
        if tracked:
            st.asked = True
            self._track_hit(st, prompt_tokens, hit_blocks, hit_salt, hit_limit)
        lp = plan_load(
            self.store,
            prompt_tokens,
            num_computed_tokens,
            block_size=bs,
            salt=salt,
            plan=st.plan,
            owner=req_id,
            relocation=self.relocation,
            chain=st.chain,
        )
        st.pending = lp if lp.num_blocks else None
        if tracked:
            # what it would hold were the offer taken: dirty from there on now (a
            # request vLLM schedules after it in this step may hit its blocks)
            st.exact_blocks = st.hit_exact
            if st.exact_blocks is None and lp.num_blocks:
                k = _first_inexact(lp.refs, lp.approx, lp.salts or (salt,) * lp.num_blocks)
                if k < lp.num_blocks:
                    st.exact_blocks = hit_blocks + k
            self._file_dirty(st)
        return lp.num_tokens

    def _track_hit(self, st: _ReqState, tokens: Sequence[int], hit_blocks: int, hit_salt: Any, hit_limit: int | None) -> None:
        """A request under a salt that may hold approximate KV: how much of its local hit
        is known exact (:attr:`_ReqState.hit_exact`), and where its exact blocks are
        saved too (:attr:`_ReqState.exact_target`)."""
        bs = self.block_size
        full = len(tokens) // bs
        if st.chain is None or len(st.chain) < full:
            st.chain = chain_refs(tokens[: full * bs], bs, salt=st.salt)
        if self._is_distrusted(st.salt):
            clean = 0
        elif hit_salt is _SAME:
            # (a resumed request's hit may reach its own generated blocks: not known)
            clean = self._known_exact(st.chain, min(hit_blocks, full))
        else:
            # a multimodal request: its hit was hashed under another salt, up to its first
            # input as plain blocks, which it also files there; unknown under its own
            clean = 0
            if not holds_exact_kv_only(hit_salt) and not self._is_distrusted(hit_salt):
                limit = (hit_limit or 0) // bs
                plain = chain_refs(tokens[: limit * bs], bs, salt=hit_salt) if limit else []
                ok = self._known_exact(plain, min(hit_blocks, limit))
                if ok < min(hit_blocks, limit):
                    self._mark_dirty(plain[ok:], hit_salt)
        st.hit_exact = None if clean == hit_blocks else clean
        plan = st.plan
        if (plan is not None and plan.scope and plan.save_exact and plan.src_salt is not SAME_SALT
                and holds_exact_kv_only(plan.src_salt)):
            st.exact_target = plan.src_salt

    def _known_exact(self, chain: Sequence[BlockRef], n: int) -> int:
        """How many of the first ``n`` keys of ``chain`` are known exact (clean, never
        dirty); the keys walked stay young in their sets."""
        for j in range(n):
            key = chain[j].key
            if key in self._dirty:
                self._dirty.move_to_end(key)  # still in vLLM's cache: the last to leave the bound
                return j
            if key not in self._clean:
                return j
            self._clean.move_to_end(key)
        return n

    def _file_dirty(self, st: _ReqState) -> None:
        """Mark dirty every full prompt block the request holds from its first block
        not known exact on: vLLM caches them as it schedules them."""
        if st.exact_blocks is None:
            return
        bs = self.block_size
        full = len(st.tokens) // bs
        if st.chain is None or len(st.chain) < full:  # (a streaming input's prompt grows)
            st.chain = chain_refs(st.tokens[: full * bs], bs, salt=st.salt)
        self._mark_dirty(st.chain[st.exact_blocks : full], st.salt)

    def _is_distrusted(self, salt: str | bytes | None) -> bool:
        """Whether nothing under ``salt`` counts as known exact (a dirty key of its, or
        of its tenant's once the set folded, was dropped at the bound)."""
        return salt in self._distrusted or (salt is not None and _tenant_part(salt) in self._distrusted_tenants)

    def _mark_dirty(self, refs: Iterable[BlockRef], salt: str | bytes | None) -> None:
        for ref in refs:
            self._dirty[ref.key] = salt
            self._dirty.move_to_end(ref.key)
            self._clean.pop(ref.key, None)
        over = _drop_oldest(self._dirty, self.max_tainted, self._distrusted)
        if not over:
            return
        if len(self._distrusted) > self.max_distrusted:
            self._distrusted_tenants.update(_tenant_part(x) for x in self._distrusted if x is not None)
            self._distrusted = {None} & self._distrusted
        if not self.dirty_dropped:
            _log.warning(
                "splice connector: dropped the oldest of %d dirty keys (more blocks filed after approximate KV "
                "than twice the KV cache): nothing under their salts counts as exact any more, and chunks "
                "computed in their requests are not saved under the tenant's salt", self.max_tainted)
        self.dirty_dropped += over

    def _track_computed(
        self, st: _ReqState, req_id: str, first: int, stop: int, block_ids: Callable[[str], Sequence[int]]
    ) -> SaveItem | None:
        """Blocks ``[first, stop)`` of a request under a salt that may hold approximate KV
        are complete this step: the known-exact ones join :attr:`_clean`, and those the
        request holds are saved under :attr:`_ReqState.exact_target` (its own blocks:
        exact whatever another request filed under the same keys)."""
        limit = stop if st.exact_blocks is None else max(first, min(stop, st.exact_blocks))
        assert st.chain is not None
        for j in range(first, limit):
            key = st.chain[j].key
            self._clean[key] = None
            self._clean.move_to_end(key)
        over = len(self._clean) - self.max_tainted
        for _ in range(max(over, 0)):
            self._clean.popitem(last=False)
        target = st.exact_target
        if target is _SAME or limit <= first:
            return None
        bs = self.block_size
        if st.target_chain is None or len(st.target_chain) < limit:
            st.target_chain = chain_refs(st.tokens[: round_down(len(st.tokens), bs)], bs, salt=target)
        refs = [(j, st.target_chain[j]) for j in range(first, limit)]
        refs = [(j, ref) for j, ref in refs if not self.store.contains(ref, salt=target)]
        if not refs:
            return None
        ids = block_ids(req_id)
        self.exact_saved_blocks += len(refs)
        return SaveItem(req_id, target, tuple(ref for _, ref in refs), tuple(int(ids[j]) for j, _ in refs))

    def update_state_after_alloc(
        self, req_id: str, block_ids: Sequence[int], num_external_tokens: int
    ) -> LoadItem | None:
        """vLLM allocated the request's blocks (``block_ids``: all of them, the local
        hit's included) and accepted ``num_external_tokens`` (0: load nothing)."""
        st = self._reqs.get(req_id)
        if st is None:
            return None
        lp, st.pending = st.pending, None
        bs = self.block_size
        n = num_external_tokens // bs if num_external_tokens > 0 else 0
        tracked = not holds_exact_kv_only(st.salt)
        asked, st.asked = st.asked, False
        if tracked and not asked:
            # a continuation (a streaming input's next chunk): nothing asked, nothing
            # loaded; it computes behind all it held (until 2026-12-07 its frontier went
            # back to its first hit's, and blocks after its relocated KV were saved exact)
            self._file_dirty(st)
        if lp is None or n == 0:
            self.store.release(req_id)
            if tracked and asked:  # it loads nothing: it holds its hit, then computes
                st.exact_blocks = st.hit_exact
                self._file_dirty(st)
            return None
        if num_external_tokens % bs or n > lp.num_blocks:
            # Not what was offered (vLLM trims only to 0 or to whole blocks): the blocks
            # without a source are reported as load errors, so vLLM recomputes them.
            _log.error(
                "splice connector: vLLM accepted %d external tokens for %s, the connector "
                "offered %d in blocks of %d", num_external_tokens, req_id, lp.num_tokens, bs,
            )
            n = cdiv(num_external_tokens, bs)
        first = lp.start // bs
        dst = tuple(int(b) for b in block_ids[first : first + n])
        salts = None if lp.salts is None else lp.salts[:n]
        item = LoadItem(req_id, st.salt, lp.refs[:n], lp.deltas[:n], dst, lp.start, salts, lp.approx[:n])
        if tracked and asked:
            # exact up to the first block loaded approximate, or from a salt that may hold
            # approximate KV (the scope's own offload hits, conservatively), or not loaded
            # at all (vLLM took fewer blocks than offered: load errors, recomputed)
            st.exact_blocks = st.hit_exact
            if st.exact_blocks is None:
                k = _first_inexact(item.refs, item.approx or tuple(bool(d) for d in item.deltas),
                                   [item.salt_of(i) for i in range(len(item.refs))])
                if k < len(item.refs) or len(item.refs) < n:
                    st.exact_blocks = first + k
            self._file_dirty(st)
        if st.plan is not None and st.plan.scope:
            st.save_from = first  # approximate or not, the scope keeps what it loaded
        elif item.approximate() or salts is not None:
            # what it computes after approximate KV is approximate too: never filed under
            # the request's own (exact) chain keys
            st.no_save = True
            if holds_exact_kv_only(st.salt) and st.chain is not None:
                # vLLM files them under those keys: taint them, from the first block that
                # is approximate or of another salt (the exact offload hits before it, a
                # system prompt, stay clean: until 2026-12-07 they were tainted too, and
                # every later request over them saved nothing)
                approx = item.approx or tuple(bool(d) for d in item.deltas)
                k = next((i for i in range(len(item.refs)) if approx[i] or item.salt_of(i) != st.salt),
                         len(item.refs))
                for ref in st.chain[first + k:]:
                    self._tainted[ref.key] = st.salt
                    self._tainted.move_to_end(ref.key)
                self._bound_taints()
        self._loads.append(item)
        self._issued.append((item, st.tokens, st.salt))
        return item

    def loads_failed(self, invalid: Collection[int]) -> int:
        """vLLM's report of a step's output: ``invalid`` vLLM block ids whose load failed.

        vLLM may keep such a block in its prefix cache, stale, until the request
        recomputes it (a request aborted or preempted first never does): from a load's
        first failed block on, its request's keys are tainted (an exact-only salt) or
        dirty (any other).  Until 2026-12-07 only the next two steps' saves were skipped,
        and a later hit over a stale block saved what it computed after it.  Returns the
        keys marked."""
        records = [rec for step in self._awaiting for rec in step]
        self._awaiting = self._awaiting[-1:]
        if not invalid:
            return 0
        bs, marked = self.block_size, 0
        for item, tokens, salt in records:
            failed = [i for i, b in enumerate(item.block_ids) if b in invalid]
            if not failed:
                continue
            keys = chain_refs(tokens[: len(tokens) // bs * bs], bs, salt=salt)[item.start // bs + min(failed):]
            marked += len(keys)
            if holds_exact_kv_only(salt):
                for ref in keys:
                    self._tainted[ref.key] = salt
                    self._tainted.move_to_end(ref.key)
                self._bound_taints()
            else:
                self._mark_dirty(keys, salt)
            # a request scheduled before the report (async scheduling) may hit them already
            failed_keys = {ref.key for ref in keys}
            for rid, st in list(self._reqs.items()):
                if st.chain and any(ref.key in failed_keys for ref in st.chain):
                    self.stop_saving(rid)
        return marked

    def _bound_taints(self) -> None:
        over = _drop_oldest(self._tainted, self.max_tainted, self._taint_lost)
        if not over:
            return
        if not self.tainted_dropped:
            _log.warning(
                "splice connector: dropped the oldest of %d tainted keys (more approximate blocks than "
                "twice the KV cache); a request under their salts with a local hit saves nothing from now on",
                self.max_tainted)
        self.tainted_dropped += over

    def build_connector_meta(
        self,
        steps: Iterable[tuple[str, int, int]],
        block_ids: Callable[[str], Sequence[int]],
        *,
        end_step: bool = True,
    ) -> SpliceMetadata:
        """This step's work: the pending loads, and a save of every full prompt block
        the step completes that the store lacks.

        ``steps``: ``(req_id, num_computed_tokens, num_scheduled_tokens)`` of each
        scheduled request (computed tokens *before* this step, loaded ones included);
        ``block_ids(req_id)``: all of the request's vLLM block ids.  ``end_step=False``
        builds part of a step (the connector's one-request-at-a-time fallback), which
        then ends with :meth:`end_step`.
        """
        bs = self.block_size
        saves: list[SaveItem] = []
        probes: list[ProbeItem] = []
        saved_from: list[_ReqState] = []
        for req_id, computed, scheduled in steps:
            st = self._reqs.get(req_id)
            if st is not None and st.plan is not None and st.plan.probes:
                item = self._probe_item(req_id, st, computed, scheduled, block_ids)
                if item is not None:
                    probes.append(item)
            if st is None:
                continue
            prompt_len = len(st.tokens)
            end = min(computed + scheduled, prompt_len)
            first, stop = computed // bs, end // bs  # blocks [first, stop) complete now
            if st.save_from is not None:
                first = min(first, st.save_from)
                saved_from.append(st)
            if stop <= first:
                continue
            if st.chain is None or len(st.chain) < stop:
                st.chain = chain_refs(st.tokens[: round_down(prompt_len, bs)], bs, salt=st.salt)
            ids = None
            if not holds_exact_kv_only(st.salt):
                # (before ``no_save``: a request under such a salt that saves nothing still
                # files what it computes in vLLM's cache)
                exact = self._track_computed(st, req_id, first, stop, block_ids)
                if exact is not None:
                    saves.append(exact)
            if st.no_save:
                continue
            refs, dst = [], []
            for j in range(first, stop):
                ref = st.chain[j]
                if self.store.contains(ref, salt=st.salt):
                    continue
                if ids is None:
                    ids = block_ids(req_id)
                refs.append(ref)
                dst.append(int(ids[j]))
            if refs:
                saves.append(SaveItem(req_id, st.salt, tuple(refs), tuple(dst)))
        # cleared once the whole step is built: after a call that fails midway (the
        # connector then builds each request on its own) the loaded blocks still save
        for st in saved_from:
            st.save_from = None
        loads, self._loads = self._loads, []
        if end_step:
            self.end_step()
        return SpliceMetadata(loads, saves, probes)

    def end_step(self) -> None:
        """The step's loads are out: :meth:`loads_failed` reads them in the next two
        reports (until 2026-12-08 the fallback's per-request builds each ended a step,
        and from the third on a step's earlier loads were forgotten before vLLM's report
        of their failed blocks)."""
        self._awaiting = [*self._awaiting[-1:], self._issued]
        self._issued = []

    def load_without_source(self, req_id: str, block_ids: Sequence[int], start: int) -> LoadItem:
        """A load vLLM counts on that the connector could not build (its allocation
        bookkeeping failed): the worker reports the blocks as load errors and vLLM
        recomputes them.  Recorded like any load, so that report marks the request's keys
        (until 2026-12-08 it went out unrecorded: a request aborted before recomputing
        left vLLM's stale blocks under clean keys).  Then the request is forgotten."""
        item = LoadItem(req_id, None, (), (), tuple(int(b) for b in block_ids), start)
        self._loads.append(item)
        st = self._reqs.get(req_id)
        if st is not None:
            self._issued.append((item, st.tokens, st.salt))
        self.request_finished(req_id)
        return item

    def _probe_item(
        self, req_id: str, st: _ReqState, computed: int, scheduled: int, block_ids: Callable[[str], Sequence[int]]
    ) -> ProbeItem | None:
        """The plan's probe blocks this step computes (whole blocks in ``[computed,
        computed + scheduled)``)."""
        bs, plan = self.block_size, st.plan
        assert plan is not None
        end = min(computed + scheduled, len(st.tokens))
        if st.probe_refs is None:
            st.probe_refs = _plan_refs(st.tokens, plan, bs, probes=True)
            st.probe_order = sorted(st.probe_refs)
        planned, order = st.probe_refs, st.probe_order
        # blocks j with j * bs >= computed and (j + 1) * bs <= end, by bisection: every
        # decode step of a request asks (a scan of 2,048 probes was 10 ms per step for 64)
        # (a block whose first tokens the step before computed counts: loads are whole
        # blocks, so it is this request's own; until 2026-12-07 such a block, split by a
        # chunked-prefill boundary, was never measured, and the guard paid a request for it)
        js = order[bisect.bisect_left(order, computed // bs) : bisect.bisect_right(order, end // bs - 1)]
        if not js or (any(planned[j][1] for j in js) and not self.relocation):
            return None
        ids = block_ids(req_id)
        salt = st.salt if plan.src_salt is SAME_SALT else plan.src_salt
        return ProbeItem(
            req_id, salt, tuple(planned[j][0] for j in js), tuple(planned[j][1] for j in js),
            tuple(int(ids[j]) for j in js), tuple(j * bs for j in js),
        )

    def stop_saving(self, req_id: str) -> None:
        """The request saves (and probes) nothing more, under its salt or the tenant's
        (a step the connector could not build for it; until 2026-12-07 its dual saves
        went on)."""
        st = self._reqs.get(req_id)
        if st is not None:
            st.no_save, st.plan, st.save_from, st.exact_target = True, None, None, _SAME

    def request_finished(self, req_id: str) -> None:
        """Forget the request and drop its pins."""
        self._reqs.pop(req_id, None)
        self.store.release(req_id)

    @property
    def num_tracked(self) -> int:
        return len(self._reqs)
