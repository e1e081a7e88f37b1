"""Position-independent reuse of retrieved chunks' KV, in front of an unmodified vLLM.

Prefix caching reuses a chunk only when everything before it matches.  In mode
``position_independent`` a :class:`RagRunner` also reuses a chunk that was computed
before *anywhere*: after the prefix-cache hit, every chunk whose exact KV is in the
block store is loaded and its keys re-rotated to its new position by the splice
connector (the agent's relocation machinery, :mod:`promptsplice.engine_adapters.connector._plans`).

How a request runs (``position_independent``):

1. The assembler lays the prompt out with every segment block-aligned (``alignment
   "all"``), so each chunk owns whole blocks, in cache-aware order (the chunks that
   extend the prefix-cache hit first, under the runner's *reuse salt*).
2. Each chunk after the predicted hit is looked up in the :class:`ChunkIndex` by its
   *content key* (:func:`promptsplice.blocks.chunk_key`: its tokens, the block size,
   the tenant salt and the engine identity: model, KV layout, RoPE, tokenizer).  The
   index maps the key to where the chunk's exact KV lives in the store (the chain
   parent and position it was computed at); every lookup checks the store, so an
   evicted or damaged chunk answers :attr:`ChunkStatus.STALE`, never a load.
3. Chunks the index lacks are *precomputed* or *computed where they stand*.  A
   precompute is one exact request, under the tenant's salt, holding the system/tool
   head and the missing chunks after it in prompt order (``precompute="packed"``; the
   head hits the prefix cache): the connector saves their blocks like any exact
   prefill, and the index records them, so later requests relocate them.  Computed
   where they stand (inline), they cost no request and no recomputed block of their
   own; the assembler lays them before the chunks that will be relocated (``defer``),
   so they attend to exact KV only, and the connector stores them under the tenant's
   salt too (its known-exact blocks): the index records them after the request.
   ``precompute="standalone"`` (one request per chunk, each right after the head, as
   CacheBlend and EPIC precompute chunks) is not the default: a chunk that attended
   to other retrieved text carries KV closer to its next use than one that saw only
   the system prompt (README, "Beyond prefix caching", for the measured KL of both and
   of the orders tried).
   Before any precompute, :class:`GuardRates` (:func:`pic_choice`) predicts the prefill
   of both plans (the precompute, each run's recomputed blocks, what the guard is
   expected to add at the runner's measured trip rates) against one exact request of
   the same tokens under the tenant's salt (its prefix cache, the store's exact
   blocks).  The cheapest wins, the precompute on a tie; unless a plan computes fewer
   than the exact request, the request goes out exact (``StepFallback.NO_GAIN``: new
   chunks, short chunks that start no run, exact repeats).  (The precompute was the
   only way until 2026-12-07; it computes a chunk's first ``r`` blocks twice, and the
   guard trips far more often at a just-precomputed chunk: 7 of 7 on wiki.)  Every
   exact request indexes its chunks that stand on whole blocks (exact KV, saved by
   the connector), so a chunk first seen in one is later relocated from there with no
   precompute at all: with ``exact_alignment="all"`` every chunk; under the default
   ``"auto"`` only those its layout padded, usually none, so a runner whose chunk sets
   are all new stays exact (README, "Results on vLLM: the trace suite").
4. The prompt is sent under the reuse salt with a splice plan: the head (loaded from
   the tenant's exact blocks on the salt's first use; with it every leading chunk the
   tenant's store holds in this very order, where an exact request left them) and
   every other chunk, each from its own source, re-rotated by its position delta.
   Only the query is prefilled.  With ``recompute_blocks=r`` the first ``r`` blocks of
   each run are computed instead (they then attend to their real neighbours: EPIC's
   attention-sink fix); a chunk stored right behind the chunk now before it continues that run
   (:func:`~._chunk_plans.continued_chunks`).  vLLM only
   extends its prefix hit contiguously, so each run behind a recomputed block needs
   a request of its own (:func:`~promptsplice.engine_adapters.connector._plans.plan_segment_phases`).

Isolation: requests that reuse approximate KV run under a *reuse salt* derived from
the tenant's salt and the fidelity settings (``RagRunner.reuse_salt_for``), so vLLM
files the spliced blocks where only position-independent requests of the same tenant
at the same settings meet them; exact requests of the tenant never do.  Under tenant
salts the store keeps exact blocks only.  A position-independent request's plans are
scoped to the reuse salt (:attr:`SplicePlan.scope`): the connector saves what they load
and compute under it, where again only the tenant's position-independent requests at
those settings reach them.  So a prompt asked again after vLLM's cache lost it loads
whole from the store, as the exact request's re-ask does from the tenant's chain (the
reuse salt's stored prefix counts as the request's hit); without that, PIC lost to its
exact store control on wiki's re-asks (2026-12-07: 58,689 against 53,857 prefill tokens
at 200 requests).

**Over a server** (:class:`~promptsplice.engine_adapters.RemoteEngine` on a ``vllm
serve`` that loads the splice connector): the same code path.  The chunk index lives
in the client, the store in the server, asked by one store query per lookup round
(:meth:`~promptsplice.engine_adapters.RemoteEngine.match_chains`): one for every chunk
behind the hit, the prompt's reuse-salt chain and both exact alternatives, one more
after a precompute; at ``exact``
fidelity one, only when the index holds one of the chunks.  Plans go out as
``kv_transfer_params``, probe deviations come back in the acks; the hit prediction is
the client-side mirror's (exact while the runner's client is the server's only user).

Fidelity (:mod:`~promptsplice.engine_adapters.runners._fidelity`): ``fidelity`` on the
runner (default ``exact``: approximate KV is opt-in) or per request picks the recompute (``recompute_blocks``
overrides the level's).  A position-independent request at ``exact`` relocates nothing:
it is assembled the same way (whole-block chunks) and sent as one plain request under
the tenant's salt, whose cache and store hold exact blocks only; its
``recomputed_tokens`` count the stored chunks it computed instead.

Failures fall back to prefill, never to wrong KV: a block the store no longer serves
when the request runs ends the load there and vLLM computes the rest of the prompt
(the connector's load-error path); a plan that does not fit the prompt is logged and
the prompt sent as a plain request (:attr:`RagStep.fallback`, a
:class:`~promptsplice.engine_adapters.runners.StepFallback`).  A request whose
whole-block layout does not fit the context, where the exact layout (``auto``) does,
goes out in that layout (``StepFallback.TOO_LONG``); only its chunks that are whole
blocks there are indexed.

Kept as one module (~700 lines): one request's gate, precompute, plan, guard and
what it learns run under the runner's lock on the runner's state (its index, its
learnt rates per setting); the pure parts live in
:mod:`~promptsplice.engine_adapters.runners._chunk_plans`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from promptsplice.assembler import AssembledPrompt, SegmentKind
from promptsplice.engine_adapters._requests import check_sampling
from promptsplice.engine_adapters.connector._plans import SplicePhase, in_place_blocks
from promptsplice.engine_adapters.runners._chunk_plans import (
    ChunkIndex,
    ChunkPlacement,
    ChunkSource,
    ChunkStatus,
    GuardRates,
    PicChoice,
    chunk_list,
    computed_chunk_tokens,
    continued_chunks,
    pic_choice,
    plan_chunk_phases,
    precompute_sources,
)
from promptsplice.engine_adapters.runners._fidelity import (
    DEFAULT_FIDELITY, FIDELITY_TABLE, FidelityLevel, FidelitySettings, RunnerFidelity, step_level,
)
from promptsplice.engine_adapters.runners._steps import (
    RAG_SURFACE,
    AdaptiveRecompute,
    RunnerEngine,
    StepFallback,
    cached_tokens,
    check_runner_engine,
    planned_relocated_tokens,
)
from promptsplice.engine_adapters.store._store import BlockRef, chain_refs
from promptsplice.blocks import cacheable_blocks, chain_hashes, root_hash, round_down
from promptsplice._validate import DERIVED_SALT_MARK, check_derived_salt_room, check_enum, check_int, check_tenant_salt
from promptsplice.errors import ConfigError, ContextLengthError, InputError

if TYPE_CHECKING:
    from promptsplice.engine_adapters._embedded import Completion

__all__ = [
    "RagRunner",
    "RagStep",
    "ReuseMode",
    "DEFAULT_PIC_RECOMPUTE_BLOCKS",
    "RELOCATE_CHOICES",
]

_log = logging.getLogger(__name__)
_TENANT = object()
"""``_exact_chain``'s default salt: the runner's tenant salt."""

RELOCATE_CHOICES = ("when_it_pays", "always")
"""``RagRunner(relocate=...)``: relocate only when :func:`pic_choice` predicts fewer tokens computed than
one exact request (default; :class:`GuardRates` explores a few it refused), or every time (tests, studies)."""

DEFAULT_PIC_RECOMPUTE_BLOCKS = FIDELITY_TABLE[FidelityLevel.BOUNDED].recompute_blocks
"""Blocks of each relocated chunk recomputed at ``bounded`` fidelity."""


class ReuseMode(enum.Enum):
    EXACT = "exact"
    """Prefix caching only: the assembler's stable, block-aligned prefix (the default)."""
    POSITION_INDEPENDENT = "position_independent"
    """Also relocate stored chunks after the prefix hit (approximate deep layers)."""


@dataclass(slots=True)
class RagStep:
    """One RAG request as it ran (all engine requests it took together).

    Token counts mean what they mean on ``AgentStep``
    (:mod:`~promptsplice.engine_adapters.runners._steps`): ``prefill_tokens``: every
    token the engine computed for it (the precompute of new chunks included);
    ``cached_tokens = prompt_tokens - prefill_tokens`` (at least 0): not computed
    (vLLM's ``num_cached_tokens``: its prefix cache plus connector loads), of which
    ``relocated_tokens`` were loaded at another position than they were computed at;
    after a precompute (``precomputed_tokens`` > 0, counted in ``prefill_tokens``) the
    final request loads chunks the precompute computed, so ``relocated_tokens`` may then
    exceed ``cached_tokens``.
    """

    mode: ReuseMode
    completion: Completion
    prompt: AssembledPrompt
    prompt_tokens: int
    prefill_tokens: int
    cached_tokens: int
    relocated_tokens: int
    precomputed_tokens: int
    relocated_chunks: int
    """Stored chunks some of whose KV the plan loaded (relocated; a chunk it computed
    whole, short or below ``min_group_blocks``, is not counted; 0 for a plain request)."""
    requests: int
    ttft_s: float
    wall_s: float
    salt: str | None
    fallback: StepFallback | None = None
    """Why the request was sent as a plain request (``None``: as planned)."""
    deviations: tuple[float, ...] = ()
    """With a deviation threshold: each probed (recomputed) block's deviation from the
    chunk's stored KV, in the order measured (``AgentStep.deviations``)."""
    extra_recompute_blocks: int = 0
    """Blocks recomputed beyond ``recompute_blocks`` (a deviation over the threshold)."""
    fidelity: FidelityLevel = FidelityLevel.EXACT
    """The level the request ran at: ``exact`` when its plan relocated nothing under the
    tenant's own salt (an ``exact``-mode runner, the gate's exact requests, a fallback;
    ``step_level``); under the reuse salt the asked level (its cache may hold relocated KV)."""
    planned_relocated_tokens: int = 0
    """Tokens the plan relocates; ``relocated_tokens`` below it means the store did not
    serve some of them (they were computed: exact)."""
    recomputed_tokens: int = 0
    """Tokens of stored chunks computed for fidelity (the level's recompute at each
    chunk start; at ``exact``, every stored chunk after the prefix hit)."""

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class RagRunner:
    """Assembles and runs RAG requests on an :class:`~promptsplice.engine_adapters.EmbeddedEngine`
    or a :class:`~promptsplice.engine_adapters.RemoteEngine` (module doc, "Over a server").

    ``mode``: ``"exact"`` (default: prefix caching of the assembled prompt) or
    ``"position_independent"`` (needs the splice connector: an engine started with
    ``kv_store``, or a server that loads it; see the module doc).  ``salt``: the tenant's ``cache_salt``.  ``recompute_blocks``: blocks
    computed at the start of each relocated chunk.  ``policy``: the chunk order
    (``cache_aware`` default).  ``index``: a :class:`ChunkIndex` to share between
    runners of one engine (default: one per runner).  ``min_group_blocks``: a chunk
    needing a request of its own must move at least this many blocks.  ``precompute``:
    ``"packed"`` (default) or ``"standalone"`` (module doc).  ``fidelity``: ``"exact"`` (default),
    ``"bounded"`` or ``"fast"`` for ``position_independent`` (module doc),
    per request too; ``recompute_blocks`` (when given) overrides the level's.
    ``relocate``: ``"when_it_pays"`` (default: a request whose plan is predicted to
    compute no fewer tokens than one exact request is sent exact under the tenant's
    salt, ``StepFallback.NO_GAIN``; the gate also picks whether missing chunks are
    precomputed or computed where they stand) or ``"always"`` (relocate, and precompute
    every missing chunk).  ``exact_alignment``: the layout
    of those exact requests: ``"auto"`` (default: the exact runner's, so the gate never
    prefills more than exact assembly) or ``"all"`` (whole-block chunks, indexed where
    they stand: later relocations need no precompute; pays on long chunks, README).
    ``recompute_at``: ``"run"`` (``recompute_blocks`` at the start of each run of chunks
    stored together, :func:`~._chunk_plans.continued_chunks`: more reuse) or ``"chunk"``
    (at every chunk: closer to exact); ``None`` (default): ``"chunk"`` at ``bounded``,
    ``"run"`` at ``fast`` (README, "Runs of chunks").
    ``max_deviation`` (``None``: the level's, needs ``recompute_blocks >= 1``): a run whose
    recomputed blocks deviate beyond it is computed whole, and so is every later run of
    the request (``AdaptiveRecompute(whole_run=True)``).
    ``index_computed`` (default ``False``): the chunks a request computes go before those
    it relocates (the assembler's ``defer``), the connector stores them exact under the
    tenant's salt too, and the index records them (module doc; README: on pydocs it
    prefilled more than without, so it is opt-in).
    """

    def __init__(
        self,
        engine: RunnerEngine,
        *,
        mode: str | ReuseMode = ReuseMode.EXACT,
        salt: str | None = None,
        recompute_blocks: int | None = None,
        policy: str = "cache_aware",
        prompt_format: Any = None,
        index: ChunkIndex | None = None,
        min_group_blocks: int = 1,
        precompute: str = "packed",
        max_deviation: float | None = None,
        fidelity: str | FidelityLevel = DEFAULT_FIDELITY,
        relocate: str = "when_it_pays",
        exact_alignment: str = "auto",
        recompute_at: str | None = None,
        index_computed: bool = False,
    ) -> None:
        if not isinstance(index_computed, bool):
            raise ConfigError(f"index_computed must be a bool, got {index_computed!r}")
        if precompute not in ("standalone", "packed"):
            raise ConfigError(f"precompute must be 'standalone' or 'packed', got {precompute!r}")
        if relocate not in RELOCATE_CHOICES:
            raise ConfigError(f"relocate must be one of {', '.join(RELOCATE_CHOICES)}, got {relocate!r}")
        if exact_alignment not in ("auto", "all"):
            raise ConfigError(f"exact_alignment must be 'auto' or 'all', got {exact_alignment!r}")
        if recompute_at not in (None, "run", "chunk"):
            raise ConfigError(f"recompute_at must be 'run', 'chunk' or None, got {recompute_at!r}")
        check_runner_engine(engine, "RagRunner", RAG_SURFACE)
        if index is not None and not isinstance(index, ChunkIndex):
            raise ConfigError(f"index must be a ChunkIndex (or None: the runner makes one), got {type(index).__name__}")
        self.precompute = precompute
        self.relocate = relocate
        self.exact_alignment = exact_alignment
        self.recompute_at = recompute_at
        self.index_computed = index_computed
        self.mode = check_enum(mode, ReuseMode, "mode")
        pic = self.mode is ReuseMode.POSITION_INDEPENDENT
        if pic and not engine.can_splice:
            raise ConfigError(
                "position_independent reuse needs the splice connector's block store (its "
                "chunk index checks every chunk there): start an EmbeddedEngine with "
                "EngineConfig(kv_store=StoreConfig(...)), or vllm serve with "
                "--kv-transfer-config kv_transfer_config_json(StoreConfig(...))"
            )
        if pic and not engine.can_relocate:
            raise ConfigError(
                "this engine's splice connector cannot relocate KV (its log says why: an "
                "unverified attention ISA or RoPE); use mode='exact'"
            )
        if not pic:  # options of position-independent reuse: taken, then ignored (review)
            given = [name for name, value, default in (
                ("index", index, None), ("min_group_blocks", min_group_blocks, 1), ("precompute", precompute, "packed"),
                ("relocate", relocate, "when_it_pays"), ("exact_alignment", exact_alignment, "auto"),
                ("recompute_at", recompute_at, None), ("index_computed", index_computed, False)) if value != default]
            if given:
                raise ConfigError(
                    f"RagRunner(mode={self.mode.value!r}) takes no {', '.join(given)}: they shape "
                    "position-independent reuse; pass mode='position_independent' or leave them out"
                )
        self._fidelity = RunnerFidelity(fidelity, recompute_blocks=recompute_blocks, max_deviation=max_deviation,
                                        relocating_mode=None if pic else self.mode.value)
        self.fidelity = self._fidelity.level
        check_int(min_group_blocks, "min_group_blocks")
        check_derived_salt_room(check_tenant_salt(salt, "salt"), "salt")  # reuse salts derive from it
        self.engine = engine
        self.salt = salt
        default = self.settings(self.fidelity)
        self.recompute_blocks = default.recompute_blocks
        self.max_deviation = default.run_max_deviation
        self.min_group_blocks = min_group_blocks
        bs = engine.block_size
        self.assembler = engine.make_assembler(
            policy=policy, alignment="all" if pic else "auto", prompt_format=prompt_format
        )
        if pic:
            # in process: the engine's store; served: the server, asked by store queries
            store = engine.kv_store if engine.kv_store is not None else engine
            if index is None:
                where = store.config.fingerprint if engine.kv_store is not None else f"served:{getattr(engine, 'base_url', type(engine).__name__)}"
                identity = f"{where}|tokenizer:{self.assembler.tokenizer.name}"
                index = ChunkIndex(store, block_size=bs, identity=identity)
            elif index.store is not store or index.block_size != bs:
                raise ConfigError("the chunk index belongs to another engine's store or block size")
        self.index = index
        self._lock = threading.Lock()
        self._guards: dict[FidelitySettings, GuardRates] = {}

    def guard_rates(self, fidelity: str | FidelityLevel | None = None) -> GuardRates:  # the gate's, per setting
        return self._guards.setdefault(self.settings(fidelity), GuardRates())

    def settings(self, fidelity: str | FidelityLevel | None = None) -> FidelitySettings:
        """The settings a request at ``fidelity`` (default: the runner's) runs with."""
        return self._fidelity.settings(fidelity)

    @property
    def reuse_salt(self) -> str:
        """The ``cache_salt`` of requests that reuse relocated chunks at the runner's
        fidelity (module doc): the explicit opt-in for a request that may meet their
        approximate KV."""
        return self.reuse_salt_for()

    def reuse_salt_for(self, fidelity: str | FidelityLevel | None = None) -> str:
        """:attr:`reuse_salt` of requests at ``fidelity``: one per setting that shapes the
        approximate KV (level, recomputed blocks, deviation threshold), so a ``bounded``
        request never hits the blocks a ``fast`` one left (it was served them, bit for
        bit, while reporting nothing relocated and nothing recomputed)."""
        cfg = self._fidelity.settings(fidelity, request=False)
        # the settings as a fixed-length digest: a long tenant salt (check_derived_salt_room)
        # and any recompute_blocks / max_deviation stay within vLLM's 128-character rule
        # (how chunks were precomputed and grouped shapes their relocated KV too: a packed
        # runner was served a standalone runner's blocks under one salt)
        shape = hashlib.sha256(
            f"r{cfg.recompute_blocks}:d{cfg.run_max_deviation!r}:p{self.precompute}:g{self.min_group_blocks}"
            f":a{self.recompute_at_for(cfg.level)}".encode()
        ).hexdigest()[:16]
        return f"{self.salt or ''}{DERIVED_SALT_MARK}pic:{cfg.level.value}:{shape}"

    # -- requests -------------------------------------------------------------------
    def run(
        self,
        chunks: Iterable[Any],
        *,
        query: str,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
        fidelity: str | FidelityLevel | None = None,
    ) -> RagStep:
        """Assemble and run one request (``fidelity``: this request's level, default the
        runner's); raises what ``Assembler.assemble`` and :meth:`EmbeddedEngine.generate`
        raise."""
        gen = {"max_tokens": max_tokens, "temperature": temperature, "stop": stop, "logprobs": logprobs}
        cfg = self.settings(fidelity)
        check_sampling(max_tokens, temperature, stop, logprobs)  # before a precompute or any phase
        with self._lock:
            if self.mode is ReuseMode.EXACT or not cfg.relocate:
                return self._run_exact(chunks, query, system, tools, gen)
            return self._run_pic(chunks, query, system, tools, gen, cfg)

    def _run_exact(self, chunks, query, system, tools, gen) -> RagStep:
        asm = self.assembler
        t0 = time.perf_counter()
        pic = self.mode is ReuseMode.POSITION_INDEPENDENT
        what = {"query": query, "system": system, "tools": tools, "salt": self.salt}
        chunks, long = chunk_list(chunks), False
        try:
            prompt = asm.assemble(chunks, alignment="all" if pic else "auto", **what)
        except ContextLengthError:
            if not pic:
                raise
            # whole-block chunks do not fit where the exact layout may: TOO_LONG
            prompt, long = asm.assemble(chunks, alignment="auto", **what), True
        looked = 0.0
        if pic:  # what relocation would have served: the chunks stored before it ran
            toks, bs = prompt.token_ids, self.engine.block_size
            # whole-block chunks (all of them, unless the step is TOO_LONG)
            chunk_segs = [s for s in prompt.segments if s.kind is SegmentKind.CHUNK and not s.start % bs
                          and not (s.end - s.start) % bs]
            # asks the store only when the index holds one of them (none on first sight);
            # for the record only, so its time stays out of the step's TTFT
            t_look = time.perf_counter()
            looks, _ = self.index.lookup_many([toks[s.start : s.end] for s in chunk_segs], salt=self.salt)
            stored = {s.chunk_ids for s, look in zip(chunk_segs, looks) if look.status is ChunkStatus.HIT}
            looked = time.perf_counter() - t_look
        t_send = time.perf_counter()
        out = self.engine.generate(prompt, **gen)
        why = StepFallback.TOO_LONG if long else None
        step = self._step(prompt, [out], out, t0, t_send - looked, self.salt, 0, 0, 0, why)
        if pic:
            self._index_chunks(prompt.token_ids, chunk_segs)
            step.recomputed_tokens = computed_chunk_tokens(prompt, stored, step.cached_tokens)
        return step

    def _run_pic(self, chunks, query, system, tools, gen, cfg: FidelitySettings) -> RagStep:
        asm, eng, bs, r = self.assembler, self.engine, self.engine.block_size, cfg.recompute_blocks
        t0 = time.perf_counter()
        salt = self.reuse_salt_for(cfg.level)
        chunks = chunk_list(chunks)
        what = {"query": query, "system": system, "tools": tools}
        gate = self.relocate == "when_it_pays"
        try:
            prompt: AssembledPrompt | None = (asm.preview if gate else asm.assemble)(chunks, salt=salt, **what)
        except ContextLengthError:
            prompt = None
        if prompt is None:  # whole-block chunks do not fit: one exact request
            # sent after the handler, never inside it: code below (the embedded engine's
            # connector, a caller's hook) would see an exception in flight
            return self._run_exact(chunks, query, system, tools, gen)
        outs: list[Completion] = []
        # Which chunks behind the hit are stored; precompute the others (exactly) or
        # compute them where they stand, whichever the gate predicts cheaper.  The
        # exact alternative under the tenant's salt: the exact runner's layout ("auto":
        # no padding where reuse cannot pay) or whole-block chunks ("all": indexed where
        # they stand, relocatable later without a precompute).  One store query for all.
        # (chunks of at most r blocks move only where they continue a stored run: never precomputed)
        # (it fits: whole-block chunks, as in ``prompt``, or fewer padded blocks)
        exact = asm.preview(chunks, salt=self.salt, alignment=self.exact_alignment, **what) if gate else None
        defer: tuple[str, ...] = ()
        while True:
            toks = prompt.token_ids
            hit = min(round_down(prompt.predicted_cached_tokens, bs), cacheable_blocks(len(toks), bs) * bs)
            chunk_segs = [s for s in prompt.segments if s.kind is SegmentKind.CHUNK]
            head_end = chunk_segs[0].start if chunk_segs else 0
            # the store's blocks of this very prompt under the reuse salt (an earlier request
            # of these tokens at these settings saved them: re-asks) load as offload hits
            # behind vLLM's hit; the chunks they cover are not relocated.  Then the tenant's
            # chain of the prompt (its exact lead, below) and of the exact alternative.
            also = [self._exact_chain(toks, salt), self._exact_chain(toks)]
            if exact is not None:
                also.append(self._exact_chain(exact.token_ids))
            cands = [s for s in chunk_segs if s.end > hit]
            looks, stored = self.index.lookup_many([toks[s.start : s.end] for s in cands], salt=self.salt, also=also)
            reuse_hit, stored = stored[0] * bs, stored[1:]
            hit = max(hit, reuse_hit)
            # the tenant's store holds this prompt's leading blocks (an exact request of the
            # same chunks in the same order saved them): the plan loads its chunks up to the
            # last chunk boundary there exactly, as it loads the head, instead of relocating
            # them (until 2026-12-07 only the head: a request whose first chunks an exact one
            # had sent recomputed r blocks of each and risked the guard on exact KV)
            lead = max([head_end] + [s.end for s in chunk_segs if s.end <= stored[0] * bs])
            found = {s.start: look for s, look in zip(cands, looks)}
            todo = [s for s in cands if s.end > max(hit, lead)]
            # The chunks it will compute go before those it relocates (the assembler's
            # ``defer``): computed right behind exact KV they are exact, stored under the
            # tenant's salt by the connector and indexed below, so the next request that
            # holds one relocates it (until 2026-12-07 a new chunk behind a relocated one
            # attended to approximate KV, and was computed again whenever it came back).
            # One more survey of the reordered prompt (one more store query), at most.
            stored_first = [s for s in todo if found[s.start].status is ChunkStatus.HIT]
            if defer or not gate or not self.index_computed or not stored_first or len(stored_first) == len(todo) or all(
                    found[s.start].status is ChunkStatus.HIT for s in todo[len(todo) - len(stored_first):]):
                break
            defer = tuple(i for s in stored_first for i in s.chunk_ids)
            prompt = asm.preview(chunks, salt=salt, defer=defer, **what)  # (the same blocks: it fits)
        missing = [s for s in todo if found[s.start].status is not ChunkStatus.HIT and (s.end - s.start) // bs > r]
        groups = [[s] for s in missing] if self.precompute == "standalone" else [missing] if missing else []
        if exact is not None:
            n_exact = len(exact.token_ids)
            # stored chunks, and where the precompute would put the missing ones
            will = [ChunkPlacement(s.start, s.end, src) for s in todo if (src := found[s.start].source) is not None]
            for group in groups:
                _, srcs = precompute_sources(toks, head_end, [(s.start, s.end) for s in group], block_size=bs, salt=self.salt)
                will += [ChunkPlacement(s.start, s.end, src) for s, src in zip(group, srcs, strict=True)]
            will.sort(key=lambda c: c.start)
            common = dict(
                # the head loads from the store only: the tenant's vLLM cache is under
                # another salt than the plan's (counting it predicted too little prefill)
                head_hit=stored[0] * bs,
                exact_tokens=n_exact - self._exact_hit(exact.token_ids, stored[1], exact),
                recompute_blocks=r, block_size=bs, min_group_blocks=self.min_group_blocks,
            )
            with_pre = functools.partial(
                pic_choice, len(toks), hit, lead, [(c.start, c.end) for c in will], [(s.start, s.end) for s in missing],
                continued=self._continued(toks, will, lead, r, cfg.level), **common,
            )
            known = [c for c in will if found[c.start].source is not None]
            inline = functools.partial(
                pic_choice, len(toks), hit, lead, [(c.start, c.end) for c in known], [],
                continued=self._continued(toks, known, lead, r, cfg.level), **common,
            )

            def predict(extra_blocks: tuple[float, float] = (0.0, 0.0)) -> PicChoice:
                a = with_pre(extra_blocks=extra_blocks)
                if not missing:
                    return a
                b = inline(extra_blocks=extra_blocks)
                return a if a.pic_tokens <= b.pic_tokens else b._replace(precompute=False)

            rates = self._guards.setdefault(cfg, GuardRates())
            choice = rates.choose(predict) if cfg.run_max_deviation else predict()
            why = None if choice.pays else StepFallback.NO_GAIN  # one exact request computes no more
            if why is None and not choice.precompute:
                missing, groups = [], []
            if why is None:
                prompt = asm.assemble(chunks, salt=salt, defer=defer, **what)  # what the preview showed ...
                if prompt.token_ids != toks:
                    # ... unless another runner on the engine's mirror changed the order
                    # in between: the plan was made for other tokens, never splice it
                    _log.warning("rag runner: the assembled prompt differs from its preview; one exact request")
                    why = StepFallback.INVALID_PLAN
            if why is not None:
                exact = asm.assemble(chunks, salt=self.salt, alignment=self.exact_alignment, **what)
                t_send = time.perf_counter()
                out = eng.generate(exact, **gen)
                self._index_chunks(exact.token_ids, [s for s in exact.segments if s.kind is SegmentKind.CHUNK])
                step = self._step(exact, [out], out, t0, t_send, self.salt, 0, 0, 0, why)
                # (every chunk behind vLLM's hit: the exact request computes those the
                # reuse salt's stored prefix covers too)
                stored = {s.chunk_ids for s in cands if found[s.start].status is ChunkStatus.HIT}
                step.recomputed_tokens = computed_chunk_tokens(exact, stored, step.cached_tokens)
                return step
        precomputed = 0
        if missing:
            # standalone: each chunk right after the head (its KV attended to the system
            # prompt only, whatever request it later lands in); packed: all missing
            # chunks after the head in one request (later ones attended to earlier ones).
            for group in groups:
                pre, sources = precompute_sources(
                    toks, head_end, [(s.start, s.end) for s in group], block_size=bs, salt=self.salt
                )
                out = eng.generate(pre, max_tokens=1, cache_salt=self.salt)
                outs.append(out)
                precomputed += out.prefill_tokens
                for s, src in zip(group, sources, strict=True):
                    self.index.record(toks[s.start : s.end], src)
            looks, _ = self.index.lookup_many([toks[s.start : s.end] for s in missing], salt=self.salt)
            found.update((s.start, look) for s, look in zip(missing, looks))

            # The precompute ran under the tenant's salt and may have evicted blocks.
            local = asm.mirror.predict(prompt.block_hashes, len(toks)).cached_tokens
            hit = round_down(max(min(local, hit), min(reuse_hit, hit)), bs)

        placed = []
        for s in todo:
            look = found[s.start]
            if look.status is ChunkStatus.HIT and look.source is not None:
                placed.append(ChunkPlacement(s.start, s.end, look.source))
            # else the store refused it: computed where it stands
        fallback, recomputed = None, 0
        try:
            phases = plan_chunk_phases(
                toks, placed, block_size=bs, hit=hit, head_end=lead, recompute_blocks=r,
                src_salt=self.salt, min_group_blocks=self.min_group_blocks, probe=cfg.run_max_deviation is not None,
                continue_runs=self.recompute_at_for(cfg.level) == "run", scope=True,
            )
        except InputError as exc:  # never splice a plan that does not fit the prompt
            _log.warning("rag runner: %s; plain request", exc)
            phases, fallback = [SplicePhase(len(toks), None)], StepFallback.INVALID_PLAN
        adapt = None if (dev := cfg.run_max_deviation) is None else AdaptiveRecompute(dev, toks, window=r, whole_run=True)
        if r and fallback is None:  # what r = 0 would have relocated, for the record
            try:
                full = plan_chunk_phases(toks, placed, block_size=bs, hit=hit, head_end=lead,
                                         src_salt=self.salt, min_group_blocks=self.min_group_blocks)
                recomputed = max(0, planned_relocated_tokens(full, toks, salt) - planned_relocated_tokens(phases, toks, salt))
            except InputError:
                recomputed = 0
        if self.index_computed:  # the connector saves its exact blocks under the tenant's salt too
            phases = [ph if ph.plan is None else ph._replace(plan=dataclasses.replace(ph.plan, save_exact=True))
                      for ph in phases]
        run = eng.generate_phases(toks, phases, cache_salt=salt, adapt=adapt, **gen)
        outs.extend(run.completions)
        if fallback is None and self.index_computed:
            # the chunks it computed before its first relocated block attended to exact KV
            # only: the connector saved them under the tenant's salt too (its known-exact
            # blocks), so they are indexed like a plain request's; the store check of
            # every lookup drops any it did not save (until 2026-12-07 none was indexed:
            # a chunk first computed in a PIC request was computed again when it came back)
            moved = min((g.dst_start for ph in run.phases if ph.plan
                         for g in ph.plan.segments if not _in_place(ph.plan, g, toks, salt)), default=len(toks))
            self._index_chunks(toks, [s for s in todo if s.end <= moved and found[s.start].status is not ChunkStatus.HIT])
        step = self._step(
            prompt, outs, outs[-1], t0, run.t_last, salt, run.relocated_tokens, precomputed,
            0 if fallback is not None else len(placed), fallback,
        )
        step.deviations = tuple(d.value for d in run.deviations)
        step.extra_recompute_blocks = adapt.extra if adapt is not None else 0
        # probed: past the hit, a run of its own (an unmeasured probe says nothing of it)
        if adapt is not None and fallback is None and r and not adapt.unmeasured:
            new, runs = {s.start for s in missing}, {g.dst_start for ph in phases if ph.plan for g in ph.plan.segments}
            cont = self._continued(toks, placed, lead, r, cfg.level)
            probed = [(c.start + r * bs, c.end, c.start in new) for c in placed
                      if hit <= c.start and c.start not in cont and c.start + r * bs in runs and c.end - c.start > r * bs]
            self._guards.setdefault(cfg, GuardRates()).observe(probed, adapt.deviated, bs)
        step.planned_relocated_tokens = planned_relocated_tokens(run.phases, toks, salt)
        # the stored chunks some loaded segment covers (a short chunk recomputed whole, a
        # group below min_group_blocks: placed, and nothing of it loaded)
        loaded = [(g.dst_start, g.dst_start + g.num_blocks * bs) for ph in run.phases if ph.plan
                  for g in ph.plan.segments]
        step.relocated_chunks = sum(any(a < c.end and c.start < b for a, b in loaded) for c in placed)
        step.fidelity = step_level(cfg.level, step.planned_relocated_tokens, salt)
        # blocks the deviation guard recomputed were relocatable too
        step.recomputed_tokens = min(step.prefill_tokens, recomputed + planned_relocated_tokens(phases, toks, salt)
                                     - step.planned_relocated_tokens)
        return step

    def recompute_at_for(self, fidelity: str | FidelityLevel | None = None) -> str:
        """Where requests at ``fidelity`` recompute: ``recompute_at``, else ``chunk`` at ``bounded``."""
        if self.recompute_at is not None:
            return self.recompute_at
        level = self._fidelity.settings(fidelity, request=False).level
        return "chunk" if level is FidelityLevel.BOUNDED else "run"

    def _continued(self, toks: Sequence[int], chunks: Sequence[ChunkPlacement], head_end: int, r: int,
                   level: FidelityLevel) -> frozenset[int]:
        """The chunks that continue their source run (none when recomputing at every chunk)."""
        if self.recompute_at_for(level) == "chunk":
            return frozenset()
        return continued_chunks(toks, chunks, block_size=self.engine.block_size, head_end=head_end, src_salt=self.salt,
                                recompute_blocks=r)

    def _exact_chain(self, toks: Sequence[int], salt: Any = _TENANT) -> tuple[list[BlockRef], str | None]:
        """The store chain a plain request of ``toks`` under ``salt`` (default the
        tenant's) could load (its full blocks but the last token's)."""
        bs = self.engine.block_size
        salt = self.salt if salt is _TENANT else salt
        return chain_refs(list(toks[: cacheable_blocks(len(toks), bs) * bs]), bs, salt=salt), salt

    def _exact_hit(self, toks: Sequence[int], stored_blocks: int, prompt: AssembledPrompt | None = None) -> int:
        """Tokens one plain request of ``toks`` under the tenant's salt would not compute:
        vLLM's prefix cache (the mirror; ``prompt``'s prediction when given) or the
        store's exact blocks (``stored_blocks`` of :meth:`_exact_chain`: offload hits)."""
        bs = self.engine.block_size
        if prompt is not None:
            cached = prompt.predicted_cached_tokens
        else:
            cached = self.assembler.mirror.predict(chain_hashes(toks, bs, salt=self.salt), len(toks)).cached_tokens
        return max(cached, stored_blocks * bs)

    def _index_chunks(self, toks: Sequence[int], chunk_segs: Sequence[Any]) -> None:
        """Record the chunks of a plain request under the tenant's salt: their KV is exact
        where they stand (the connector saved it), so a later request relocates them
        without a precompute.  The index checks the store on every lookup."""
        bs = self.engine.block_size
        chain = chain_hashes(toks, bs, salt=self.salt)
        for s in chunk_segs:
            if s.start % bs or s.end % bs or s.end >= len(toks) or s.end <= s.start:
                continue
            parent = chain[s.start // bs - 1] if s.start else root_hash(self.salt)
            self.index.record(toks[s.start : s.end], ChunkSource(parent, s.start, (s.end - s.start) // bs, self.salt))

    def _step(self, prompt, outs, out, t0, t_last, salt, relocated, precomputed, nchunks, fallback) -> RagStep:
        n = len(prompt.token_ids)
        prefill = sum(o.prefill_tokens for o in outs)
        return RagStep(
            mode=self.mode,
            completion=out,
            prompt=prompt,
            prompt_tokens=n,
            prefill_tokens=prefill,
            cached_tokens=cached_tokens(n, prefill),
            relocated_tokens=relocated,
            precomputed_tokens=precomputed,
            relocated_chunks=nchunks,
            requests=len(outs),
            ttft_s=(t_last - t0) + out.ttft_s,
            wall_s=time.perf_counter() - t0,
            salt=salt,
            fallback=fallback,
        )

    def __repr__(self) -> str:
        return (
            f"RagRunner(mode={self.mode.value!r}, fidelity={self.fidelity.value!r}, "
            f"recompute_blocks={self.recompute_blocks})"
        )


def _in_place(plan: Any, segment: Any, toks: Sequence[int], salt: str) -> bool:
    """Whether every block ``segment`` loads is exact where it lands (an offload hit by
    another name: :func:`~promptsplice.engine_adapters.connector._plans.in_place_blocks`)."""
    first = segment.dst_start // plan.block_size
    return set(range(first, first + segment.num_blocks)) <= in_place_blocks(plan, toks, salt)
