"""``EmbeddedEngine``: vLLM in this process, driven one request at a time.

The engine sends assembled token ids straight to vLLM (``prompt_token_ids`` with the
prompt's ``cache_salt``), so the segment boundaries the assembler aligned to KV blocks
are exactly the engine's, and it reports vLLM's own ``num_cached_tokens`` next to the
prediction of its prefix-cache mirror.

The engine owns the mirror of its cache (:attr:`EmbeddedEngine.mirror`, a
:class:`~promptsplice.assembler.PrefixCacheMirror` of :attr:`~EmbeddedEngine.usable_blocks`):
every request it runs is admitted there after it finished, with what really ran (the
prompt's blocks and those the generated tokens filled), and the mirror is emptied with
vLLM's cache (reset, failed step, a request cut short after a step ran, restart).  Assemblers made by
:meth:`EmbeddedEngine.make_assembler` read it for their predictions and never update it;
on an engine with a block store they choose order and padding on the store's blocks
too (they load back as external hits), while predictions stay vLLM's own cache.

Requests run **sequentially** through one step loop (``_request``, used by ``generate``
and ``stream``): it adds one request and steps the engine until it finishes, under a
lock that keeps other threads out.  That makes the prefix-cache state after each
request deterministic (benches and the mirror depend on it) and lets TTFT be measured
exactly: the clock starts before ``LLMEngine.add_request`` and the first-token time is
taken when the ``step()`` that returns the first output token comes back (with chunked
prefill that can be a later step than the first).  Batched serving is out of scope.

With ``EngineConfig(kv_store=StoreConfig(...))`` the engine runs the splice KV connector
(``promptsplice.engine_adapters.connector._connector``): prefilled blocks are saved to
the tiered store, served back as offload hits after vLLM's own cache lost them, and
``generate(..., splice=plan)`` relocates stored blocks into a new prompt.  vLLM's
counters (``counters()``, ``num_cached_tokens``) include the connector's tokens as
external hits, which the mirror (a model of vLLM's own cache) does not predict.  vLLM
keeps the worker-side connector in one process-wide slot; each engine installs its own
(or none) while it runs (``_vllm.agent_installed``), so engines with and without a
connector can live in one process.

Failures: when a step raises (the model's forward pass, the scheduler), the engine's
state is unknown.  The adapter aborts what is left, empties the prefix cache (vLLM files
a block's hash when it *allocates* the block, before the forward pass writes it, so the
failed step's blocks would otherwise be served later with KV that was never written;
the splice connector likewise skips the step's saves) and runs a one-token health
probe.  A healthy engine keeps serving (the request raises
:class:`~promptsplice.errors.EngineRequestError`); a dead one raises
:class:`~promptsplice.errors.EngineDeadError`, after restarting vLLM if
``EngineConfig.max_restarts`` allows.  A request vLLM finishes with ``finish_reason``
``"error"`` (its retryable internal error, e.g. a failed KV load) or ``"abort"`` is one
cut short: never admitted, cache and mirror emptied, ``EngineRequestError`` (a served
engine answers HTTP 500).

Facts of vLLM's block pool that the adapter relies on (vllm 0.32.0,
``v1/core/block_pool.py``): the pool holds ``num_gpu_blocks`` blocks, but block 0 is
taken at start as the *null block* and never holds KV, so ``num_gpu_blocks - 1`` blocks
can cache prefixes (:attr:`EmbeddedEngine.usable_blocks`, the mirror's capacity).

Kept as one module (~740 lines): the request loop, its failure handling and the mirror
share one lock and one order of events (what ran is what the mirror admits).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from promptsplice.assembler import AssembledPrompt, Assembler, MirrorView, PrefixCacheMirror, Tokenizer
from promptsplice.engine_adapters import _vllm
from promptsplice.engine_adapters._config import EngineConfig
from promptsplice.engine_adapters._lifecycle import load_tokenizer, release, start_llm
from promptsplice.engine_adapters._requests import (
    PROMPT_TOKENIZER_FIX,
    Adapt,
    Completion,
    EngineCounters,
    NormalizedPrompt,
    PhasedRun,
    PhaseResult,
    PromptLike,
    StreamDelta,
    admit_run,
    check_context,
    check_phase_options,
    check_request_limits,
    check_sampling,
    check_splice,
    check_tokenizer,
    logprob_dicts,
    normalize_prompt,
    phase_list,
    run_phases,
    sent_plan,
    stream_deltas,
)
from promptsplice.engine_adapters.connector._plans import SplicePhase, SplicePlan, latest_per_block
from promptsplice.errors import (
    ConfigError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    InputError,
    TokenizerError,
)
from promptsplice._validate import check_salt, check_token_ids
from promptsplice.tenancy import SaltGuard

_log = logging.getLogger(__name__)

__all__ = ["EmbeddedEngine", "Completion", "EngineCounters", "PromptLike", "StreamDelta"]

_PROBE_STEPS = 8
"""Steps a one-token health probe may take (it needs one prefill step)."""

_CUT_FINISHES = {
    "error": "failed it with a retryable internal error (vLLM's FinishReason.ERROR, e.g. a KV load that failed)",
    "abort": "aborted it (a pause or shutdown of vLLM while it ran)",
}
"""vLLM's finish reasons of a request that did not run to its end: no answer, and
what it computed is unknown (a served engine answers HTTP 500 or a partial answer,
both ``EngineRequestError``)."""


class EmbeddedEngine:
    """A vLLM engine in this process with prefix caching, one request at a time.

    ``EmbeddedEngine(config=None, **overrides)`` starts ``vllm.LLM`` once (seconds on
    CPU for the default model; see the README for this machine's numbers); ``overrides``
    replace fields of ``config`` (or of the default :class:`EngineConfig`).  Close it
    with :meth:`close` (or use it as a context manager); several engines may live in one
    process.

    Raises :class:`~promptsplice.errors.ConfigError` for invalid options and
    :class:`~promptsplice.errors.EngineStartError` when vLLM cannot start (a KV cache
    too small for one ``max_model_len`` request names ``kv_cache_bytes``).
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is None:
            try:
                config = EngineConfig(**overrides)
            except TypeError as exc:
                raise ConfigError(f"unknown EngineConfig option: {exc}") from exc
        elif not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        elif overrides:
            try:
                config = dataclasses.replace(config, **overrides)
            except TypeError as exc:
                raise ConfigError(f"unknown EngineConfig option: {exc}") from exc

        if config.model is None:
            from promptsplice.engine_adapters._model import ensure_default_model

            model = str(ensure_default_model())  # AssetError when it cannot be prepared
        else:
            model = config.model
        self._config = dataclasses.replace(config, model=model)
        # the request _request runs (a stream may pause it, and go on in another thread)
        self._lock, self._open_request = _vllm.PassingRLock(), None
        self._ids = itertools.count()
        self._mirror: PrefixCacheMirror | None = None  # made at the first start
        self._tokenizer: Tokenizer | None = None
        self._salts = SaltGuard("EmbeddedEngine", require=self._config.require_salt)
        self._restarts = 0
        self._dead: str | None = None
        self._closed_by_user = False  # close() ran: a failure after it is never a crash to restart from
        self._start()

    def _start(self) -> None:
        """Start vLLM (at construction, and again on a restart) and size the mirror."""
        self._handle = start_llm(self._config)
        self._finalizer = weakref.finalize(self, release, self._handle)
        self._num_blocks, self._block_size, self._max_model_len = _vllm.engine_geometry(self._handle.llm)
        self._limits = _vllm.request_limits(self._handle.llm)  # checked before a request is sent
        if self._mirror is None:
            self._mirror = PrefixCacheMirror(self._block_size, self.usable_blocks)
            # Assemblers lay prompts out on what loads back too: the store's blocks (a
            # weak reference: the view must not keep a dropped engine's vLLM alive).
            me = weakref.ref(self)
            behind = (lambda h: (e := me()) is not None and e._in_store(h)) if self._config.kv_store else None
            self._mirror_view = self._mirror.view(behind)
        else:  # a restart: the old cache is gone
            self._mirror.clear(capacity_blocks=self.usable_blocks)

    def _in_store(self, block_hash: bytes) -> bool:
        agent = None if self.closed else self._handle.kv.agent
        return agent is not None and agent.store.holds(block_hash)

    # -- properties ------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        """The resolved configuration (``model`` is the folder actually loaded)."""
        return self._config

    @property
    def block_size(self) -> int:
        """vLLM's KV block size in tokens (prefix-cache hits land on its multiples)."""
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """The KV cache's block count as vLLM reports it (``num_gpu_blocks``)."""
        return self._num_blocks

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold KV: ``num_blocks - 1`` (vLLM reserves the null block)."""
        return self._num_blocks - 1

    @property
    def max_model_len(self) -> int:
        """Context length; a prompt may hold at most ``max_model_len - 1`` tokens."""
        return self._max_model_len

    @property
    def closed(self) -> bool:
        return self._handle.llm is None

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM`` (for what this adapter does not wrap)."""
        llm = self._handle.llm
        if llm is None:
            if self._dead is not None:
                raise EngineDeadError(
                    f"the engine is down ({self._dead}; max_restarts={self._config.max_restarts}, "
                    f"{self._restarts} used): start a new EmbeddedEngine",
                    restarted=False,
                )
            raise EngineError("the engine is closed; start a new EmbeddedEngine")
        return llm

    @property
    def mirror(self) -> MirrorView:
        """A read-only view of the engine's prefix-cache mirror: vLLM's block pool
        replayed over block hashes, sized :attr:`usable_blocks`, fed every request the
        engine ran and emptied with vLLM's cache (reset, failure, restart)."""
        return self._mirror_view

    @property
    def restarts(self) -> int:
        """How many times the engine died and was restarted (``max_restarts``)."""
        return self._restarts

    @property
    def kv_connector(self) -> Any:
        """The worker-side splice connector (``None`` without ``kv_store``).

        Its ``worker`` (:class:`promptsplice.engine_adapters.connector._worker.SpliceWorker`) holds the KV
        caches vLLM registered (``names``, ``caches``), load/save counters (``stats``)
        and the recent loads and saves (``history``).
        """
        if self._config.kv_store is None:
            return None
        _ = self.llm  # raises when closed
        return self._handle.kv.agent

    @property
    def can_splice(self) -> bool:
        """Whether splice plans can run here (started with ``kv_store``); what the
        runners check, as on a served engine (``RemoteEngine.can_splice``)."""
        return self._config.kv_store is not None

    @property
    def can_relocate(self) -> bool:
        """Whether the connector can relocate KV here (``RemoteEngine.can_relocate``)."""
        return self.kv_connector is not None and self.kv_connector.worker.can_relocate

    @property
    def kv_store(self) -> Any:
        """The connector's :class:`~promptsplice.engine_adapters.BlockStore` (``None`` without
        ``kv_store``): its ``stats()`` count DRAM/disk hits, evictions and damage."""
        agent = self.kv_connector
        return None if agent is None else agent.store

    @property
    def tokenizer(self) -> Tokenizer:
        """An :class:`promptsplice.assembler.HFTokenizer` over the model's own ``tokenizer.json``, so
        prompts assembled with it tokenize exactly as the engine does."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._config.model, lambda: self.llm)  # type: ignore[arg-type]
        return self._tokenizer

    # -- assembly --------------------------------------------------------------------
    def make_assembler(self, **kwargs: Any) -> Assembler:
        """An :class:`promptsplice.assembler.Assembler` that predicts from this engine's mirror.

        Block size = the engine's, mirror = a read-only view of :attr:`mirror` (so, with
        nothing else using the engine, predictions equal vLLM's ``num_cached_tokens``
        less the connector's external hits; the assembler never admits: :meth:`generate`
        admits what ran; with a block store its layout walk counts the store's blocks
        too), tokenizer =
        :attr:`tokenizer`, ``max_tokens`` = ``max_model_len - 1``.  Other keyword
        arguments go to ``Assembler``.
        """
        if "mirror" in kwargs:
            raise ConfigError(
                "the engine's assemblers read the engine's own mirror; leave mirror unset "
                "(build an Assembler directly for a mirror of your own)"
            )
        for key, mine in (("block_size", self.block_size), ("capacity_blocks", self.usable_blocks)):
            if key in kwargs and kwargs[key] != mine:
                raise ConfigError(
                    f"{key}={kwargs[key]!r} differs from the engine's {mine}: the mirror "
                    "would predict another cache; leave it unset"
                )
            kwargs.pop(key, None)
        kwargs.setdefault("max_tokens", self.max_model_len - 1)
        tokenizer = kwargs.pop("tokenizer", None)
        if tokenizer is None:
            tokenizer = self.tokenizer
        else:  # another model's tokenizer would assemble other tokens than the text says
            tokenizer = check_tokenizer(self.tokenizer, tokenizer, "tokenizer=", "leave it unset (the engine's model's tokenizer)")
        return Assembler(tokenizer, block_size=self.block_size, mirror=self._mirror_view, **kwargs)

    # -- requests --------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptLike,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None,
        splice: SplicePlan | None = None,
        logprobs: int | None = None,
    ) -> Completion:
        """Run one request to completion.

        ``prompt``: an :class:`promptsplice.assembler.AssembledPrompt` (its token ids, and its salt
        unless ``cache_salt`` is given), a list of token ids, or a ``str`` (tokenized by
        vLLM's tokenizer like a plain completion prompt).  ``temperature=0`` is greedy.

        Afterwards the engine's :attr:`mirror` admits what really ran: the prompt's
        blocks plus the blocks that the first ``k - 1`` generated tokens filled (their
        KV is computed and cached too; the last sampled token's is not).  Replays are
        exact (tested) for requests that end by EOS or ``max_tokens``; a request cut by
        a stop *string* is replayed from the token ids vLLM returns for it.
        ``predicted_cached_tokens`` is the mirror's prediction for the request.

        ``splice``: a :class:`~promptsplice.engine_adapters.SplicePlan` (``plan_deletion`` /
        ``plan_relocation``, made with this request's ``cache_salt``) for an engine
        started with ``kv_store``: the planned old blocks are loaded from the store and
        their keys re-rotated to their new positions, as long as they continue the
        local prefix-cache hit (vLLM's rule: loaded tokens start exactly at the local
        hit, and at least one prompt token is computed); blocks the store lacks are
        computed.  vLLM counts the loaded tokens as external hits.  The loaded blocks
        then enter vLLM's prefix cache under this prompt's hashes: a later identical
        prompt reuses them (deep layers of relocated blocks are approximate).

        Raises :class:`~promptsplice.errors.ContextLengthError` (before submitting)
        when the prompt has ``max_model_len`` tokens or more, ``InputError`` for an
        empty or malformed prompt, ``ConfigError`` for bad options, and
        :class:`~promptsplice.errors.EngineRequestError` when vLLM fails the request
        (a step raised, or it finished with ``finish_reason`` ``"error"`` or
        ``"abort"``; the engine keeps serving, with an empty prefix cache: see the module doc; a
        failure of the text's detokenization after the run keeps cache and mirror), and
        :class:`~promptsplice.errors.EngineDeadError` when the engine died (restarted
        if ``max_restarts`` allows).  A generation cut by ``max_model_len`` is not an
        error: ``finish_reason == "length"``.
        """
        req = self._normalize(prompt, cache_salt)
        sampling = check_sampling(max_tokens, temperature, stop, logprobs)
        kv_params = check_splice(splice, has_store=self._config.kv_store is not None, block_size=self.block_size)
        self._check_prompt(req.ids, logprobs)
        completion = None
        for _, completion in self._request(req, self._params(sampling, kv_params), logprobs is not None):
            pass
        assert completion is not None  # the loop ends with the completion or raises
        return completion

    def stream(
        self,
        prompt: PromptLike,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[StreamDelta]:
        """Run one request, yielding what each engine step adds.

        Same prompt forms, options and errors as :meth:`generate`: invalid options and
        prompts raise here, engine failures while the generator is advanced.  Each
        :class:`StreamDelta` carries the text and token ids that step produced (vLLM's
        cumulative output, differenced); the last one has ``completion`` set: the whole
        request as :meth:`generate` returns it (vLLM's ``num_cached_tokens``, TTFT,
        finish reason).  The engine stays locked from the first ``next()`` until the
        generator finishes or is closed (any thread may advance or close it, one at a
        time), so close it (or exhaust it) promptly: closing it early aborts the request
        and frees its blocks, and, once a step ran, empties vLLM's prefix cache and the
        mirror (the blocks vLLM computed for it would stay cached, unknown to the mirror).
        """
        req = self._normalize(prompt, cache_salt)
        sampling = check_sampling(max_tokens, temperature, stop)
        self._check_prompt(req.ids, None)
        return stream_deltas(self._request(req, self._params(sampling, None), False))

    def generate_phases(
        self,
        tokens: Sequence[int],
        phases: Sequence[SplicePhase],
        *,
        cache_salt: str | None = None,
        adapt: Adapt | None = None,
        **gen: Any,
    ) -> PhasedRun:
        """Run a multi-phase splice (``plan_phases`` / ``plan_segment_phases``): each
        phase's request is ``tokens[:phase.end]`` with its plan; every phase but the
        last only prefills (``max_tokens=1``), the last takes ``gen`` (``generate``'s
        keyword arguments).  ``adapt(deviations, next_phase)``, called after each phase
        but the last with what its probes measured, may return phases replacing
        ``next_phase`` (adaptive recompute: ``_plans.extend_recompute``).

        Everything :meth:`generate` refuses before submitting is refused here before the
        first phase goes out, for the whole prompt and every phase's plan (a prompt over
        ``max_model_len`` raised :class:`~promptsplice.errors.ContextLengthError` from its
        last phase, after the earlier phases had run): nothing reaches vLLM."""
        check_phase_options(gen)  # a typo or a bad value fails before the first phase runs
        phases = phase_list(phases)  # (read twice: by the checks and by run_phases)
        check_salt(cache_salt, "cache_salt")
        ids = check_token_ids(tokens, "tokens")
        self._check_prompt(ids, gen.get("logprobs"))
        has_store = self._config.kv_store is not None
        for phase in phases:
            if isinstance(phase, SplicePhase):  # (run_phases names anything else)
                check_splice(sent_plan(phase), has_store=has_store, block_size=self.block_size)
        agent = self.kv_connector
        worker = agent.worker if agent is not None else None

        def run_one(prompt: list[int], plan: SplicePlan | None, kwargs: dict[str, Any]) -> PhaseResult:
            if worker is None:
                return PhaseResult(self.generate(prompt, cache_salt=cache_salt, splice=plan, **kwargs), 0)
            with self._lock:  # the worker's counts then move for this request only
                reloc, probed = worker.stats.relocated_blocks, worker.stats.probed_blocks
                out = self.generate(prompt, cache_salt=cache_salt, splice=plan, **kwargs)
                new = min(worker.stats.probed_blocks - probed, len(worker.deviations))
                seen = latest_per_block(list(worker.deviations)[len(worker.deviations) - new :]) if new else ()
                moved = worker.stats.relocated_blocks - reloc
            return PhaseResult(out, moved * self.block_size, seen)

        return run_phases(ids, phases, run_one, gen, adapt)

    def generate_many(
        self,
        prompts: Iterable[PromptLike],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> list[Completion]:
        """:meth:`generate` each prompt in order, one after the other (never batched),
        so the cache state each request meets is deterministic.  One prompt (a str, an
        :class:`AssembledPrompt`) is an :class:`InputError`: a str ran as one request per
        character until 2026-12-07."""
        if isinstance(prompts, (str, bytes, bytearray, AssembledPrompt)) or not isinstance(prompts, Iterable):
            raise InputError(f"generate_many takes an iterable of prompts, got one {type(prompts).__name__}: "
                             "wrap it in a list, or call generate")
        return [self.generate(p, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt, stop=stop)
                for p in prompts]

    def _check_prompt(self, ids: Sequence[int], logprobs: int | None) -> None:
        """A request's prompt against the engine, before anything is submitted (every
        request path: ``generate``, ``stream``, the whole prompt of ``generate_phases``):
        :class:`~promptsplice.errors.ContextLengthError` over ``max_model_len``, then
        vLLM's vocabulary and ``max_logprobs`` (``check_request_limits``)."""
        check_context(len(ids), self.max_model_len)
        check_request_limits(ids, logprobs, self._limits)

    def _normalize(self, prompt: Any, cache_salt: str | None) -> NormalizedPrompt:
        theirs = getattr(prompt, "tokenizer", None) if isinstance(prompt, AssembledPrompt) else None
        if theirs is not None:  # its ids are tokens of the tokenizer it was assembled with
            check_tokenizer(self.tokenizer, theirs, "the prompt", PROMPT_TOKENIZER_FIX)
        req = normalize_prompt(prompt, cache_salt, block_size=self.block_size, encode=self.encode_prompt)
        self._salts.check(req.salt, stacklevel=4)  # warns at the caller of generate/stream
        return req

    def encode_prompt(self, text: str) -> list[int]:
        """The token ids :meth:`generate` sends for a ``str`` prompt: vLLM's plain-prompt
        path, its own tokenizer with ``add_special_tokens=True``.  Sending them is the same
        request; a caller that times its own preparation (``bench rag``'s ``naive`` mode)
        tokenizes with this, since the engine's TTFT starts after the prompt is tokenized."""
        llm = self.llm  # a closed or dead engine: its EngineError, not a TokenizerError
        try:
            return list(llm.get_tokenizer().encode(text, add_special_tokens=True))
        except Exception as exc:
            raise TokenizerError(f"vLLM's tokenizer could not encode the prompt: {exc}") from exc

    # -- the step loop -------------------------------------------------------------------
    @staticmethod
    def _params(sampling: dict[str, Any], kv_params: dict[str, Any] | None) -> Any:
        try:
            return _vllm.make_sampling_params(kv_transfer_params=kv_params, **sampling)
        except Exception as exc:  # vLLM validates its own ranges
            raise ConfigError(f"vLLM refused the sampling options: {exc}") from exc

    def _request(self, req: NormalizedPrompt, params: Any, logprobs: bool) -> Iterator[tuple[Any, Completion | None]]:
        """The one request/step loop: submit, step until finished, admit into the mirror.

        Yields ``(output, None)`` for each unfinished step output of the request (vLLM's
        cumulative ``RequestOutput``), then ``(final output, completion)`` once.  The
        engine is locked until the generator ends; an error or an early close aborts
        the request.  Once a step ran, vLLM has computed (and keeps caching) blocks of a
        request the mirror never admits (what an unfinished request filled is not known
        here), so the engine then empties vLLM's prefix cache and the mirror together,
        as after a failed step; before the first step nothing was computed and the
        abort alone frees what was allocated.
        """
        inputs = _vllm.tokens_input(req.ids, prompt=req.text, cache_salt=req.salt)
        with self._lock:  # the mirror replays requests in the order they ran
            engine = self.llm.llm_engine
            rid = f"promptsplice-{next(self._ids)}"
            if self._open_request is not None:  # this thread's suspended stream (a re-entrant lock)
                raise EngineRequestError(
                    f"a stream of this engine is still open in this thread (request {self._open_request}): exhaust "
                    "or close it first; the embedded engine runs one request at a time (a served one runs many)"
                )
            # vLLM's worker sees this engine's connector for each vLLM call, under the
            # process-wide agent lock, never across a yield: held while a stream was paused
            # (until 2026-12-07), it let two engines' streams, resumed in two threads, each
            # adopt it and step at once, and it blocked every other engine meanwhile
            kv = self._handle.kv
            with _vllm.agent_installed(kv):
                if engine.has_unfinished_requests():  # a leftover from an interrupted call
                    _vllm.abort_all(engine)
            t0 = time.perf_counter()
            final = None
            stepped = False  # a step ran and returned: vLLM cached blocks the mirror lacks
            ttft: float | None = None
            self._open_request = rid
            try:
                try:
                    with _vllm.agent_installed(kv):
                        engine.add_request(rid, inputs, params)
                except Exception as exc:
                    raise self._refused(exc) from exc
                while final is None:
                    if self._closed_by_user:  # close() ran while the stream was paused (re-entrant lock)
                        raise EngineError(f"the engine was closed (close()) while request {rid} ran: start a "
                                          "new EmbeddedEngine to send it again")
                    if not engine.has_unfinished_requests():
                        raise EngineRequestError(f"vLLM dropped request {rid} without a final output")
                    try:
                        with _vllm.agent_installed(kv):
                            outputs = engine.step()
                    except Exception as exc:
                        stepped = False  # handled there: the cache is emptied (or the engine died)
                        with _vllm.agent_installed(kv):
                            failure = self._step_failed(engine, rid, exc)
                        raise failure from exc
                    except BaseException:  # Ctrl-C, SystemExit: the same unwritten blocks
                        stepped = False
                        with _vllm.agent_installed(kv):
                            self._step_interrupted(engine)
                        raise
                    stepped = True
                    now = time.perf_counter()
                    for out in outputs:
                        if ttft is None and out.outputs and len(out.outputs[0].token_ids) >= 1:
                            ttft = now - t0
                        if out.finished:
                            reason = out.outputs[0].finish_reason if out.outputs else None
                            if reason in _CUT_FINISHES:  # cut: the finally empties cache and mirror
                                raise EngineRequestError(
                                    f"vLLM {_CUT_FINISHES[reason]}: request {rid} finished with "
                                    f"finish_reason {reason!r}, no answer; the engine keeps serving, with "
                                    "an empty prefix cache: send the request again")
                            final = out
                            break
                        yield out, None
                        self._lock.adopt()  # resumed, perhaps in another thread: it holds the lock
            finally:
                self._open_request = None
                if final is None and not self._closed_by_user:  # an error, or the stream closed early
                    # closed perhaps in another thread than the one it last ran in (the
                    # lines after the yield did not run): that thread holds the lock now
                    self._lock.adopt()
                    with _vllm.agent_installed(self._handle.kv):  # (a restart put in a new one)
                        _vllm.abort_all(engine)
                        if stepped:
                            self._forget_cut_request()
            total = time.perf_counter() - t0
            gen = final.outputs[0] if final.outputs else None
            token_ids = list(gen.token_ids) if gen is not None else []
            predicted = self._admit(req.ids, token_ids, req.salt)  # what ran, whatever follows
            try:
                text = "" if gen is None else _vllm.completion_text(engine, rid, req.ids, params, gen)
            except Exception as exc:  # vLLM's detokenizer, run here for a logprob request
                raise EngineRequestError(f"vLLM's detokenizer failed on the output of request {rid}: {exc}") from exc
            completion = Completion(
                text=text,
                token_ids=token_ids,
                prompt_token_ids=list(req.ids),
                prompt_tokens=len(req.ids),
                num_cached_tokens=int(final.num_cached_tokens or 0),
                ttft_s=total if ttft is None else ttft,
                total_s=total,
                finish_reason=gen.finish_reason if gen is not None else None,
                predicted_cached_tokens=predicted,
                request_id=rid,
                logprobs=logprob_dicts(final) if logprobs else None,
            )
        yield final, completion

    def _admit(self, ids: list[int], gen: list[int], salt: str | None) -> int | None:
        """Replay what ran into the engine's mirror; the mirror's prediction for it
        (``None`` without prefix caching)."""
        if not self._config.enable_prefix_caching:
            return None
        assert self._mirror is not None
        return admit_run(self._mirror, ids, gen, salt)

    # -- failures ------------------------------------------------------------------------
    @staticmethod
    def _refused(exc: BaseException) -> EngineError | ConfigError | InputError:
        """The error for a request ``add_request`` refused: vLLM's validation errors as
        the documented ones (a sampling option: ``ConfigError``; the prompt, or no
        parameter named: ``InputError``), anything else ``EngineRequestError``."""
        param = _vllm.validation_parameter(exc)
        cause = f"{type(exc).__name__}: {exc}"
        if param is None:
            return EngineRequestError(f"vLLM refused the request: {cause}")
        if param and "prompt" not in param and "token_ids" not in param:
            return ConfigError(f"vLLM refused the sampling option {param}: {cause}")
        return InputError(f"vLLM refused the prompt: {cause}")

    def _forget_cut_request(self) -> None:
        """A request cut short after a step ran (a stream closed early, an error or
        ``KeyboardInterrupt`` between steps), already aborted: vLLM keeps the blocks
        it computed cached, and the mirror never admitted them, so both are emptied
        together.  Where vLLM refuses, its cache stays (its KV was written, so it is
        sound) and the mirror's predictions may fall short of it until the next reset."""
        try:
            emptied = self._reset_cache()
        except Exception:  # noqa: BLE001 - the caller's own error (or close) is what it sees
            emptied = False
        if not emptied:
            _log.warning("could not empty vLLM's prefix cache after a request was cut short; the "
                         "mirror may predict fewer cached tokens than vLLM serves until the next reset")

    def _step_failed(self, engine: Any, rid: str, exc: BaseException) -> EngineError:
        """A step raised: abort, empty the prefix cache, probe; the error to raise.

        The cache must go: vLLM files a block's hash when it allocates the block, before
        the forward pass writes it, so the failed step's blocks would be served later
        with KV that was never computed (a wrong answer, not an error).
        """
        cause = f"{type(exc).__name__}: {exc}"
        if self._closed_by_user:  # not a crash: nothing to probe, never restarted behind the caller
            return EngineError(f"the engine was closed (close()) while request {rid} ran ({cause}): start a new "
                               "EmbeddedEngine to send it again")
        _vllm.abort_all(engine)
        try:
            usable = self._healthy(engine) and self._reset_cache()
        except Exception:  # noqa: BLE001 - vLLM failing to reset its cache: dead too
            usable = False
        if usable:
            return EngineRequestError(
                f"vLLM failed request {rid} ({cause}); the engine passed its health probe and "
                "keeps serving, with an empty prefix cache"
            )
        return self._die(cause)

    def _step_interrupted(self, engine: Any) -> None:
        """A step stopped by ``KeyboardInterrupt``/``SystemExit`` (not an error of vLLM):
        abort and empty the prefix cache as :meth:`_step_failed` does (the interrupted
        step's blocks were filed unwritten), without a probe; a cache that cannot be
        emptied leaves the engine unusable rather than serving them."""
        if self._closed_by_user:
            return
        _vllm.abort_all(engine)
        try:
            emptied = self._reset_cache()
        except Exception:  # noqa: BLE001 - the interrupt is what the caller sees
            emptied = False
        if not emptied:
            assert self._mirror is not None
            self._mirror.clear()
            self._dead = "a step was interrupted and vLLM's prefix cache could not be emptied"
            # shut down, not only marked: the next request went on to its unwritten blocks
            self._finalizer()

    def _healthy(self, engine: Any) -> bool:
        """One one-token request (it fills no block: nothing enters the cache)."""
        rid = f"promptsplice-probe-{next(self._ids)}"
        try:
            params = _vllm.make_sampling_params(max_tokens=1, temperature=0.0)
            engine.add_request(rid, _vllm.tokens_input([0]), params)
            for _ in range(_PROBE_STEPS):
                if any(out.finished for out in engine.step()):
                    return True
                if not engine.has_unfinished_requests():
                    return False
        except Exception:  # noqa: BLE001 - any failure of the probe means dead
            pass
        _vllm.abort_all(engine)
        return False

    def _reset_cache(self) -> bool:
        """Empty vLLM's prefix cache and the engine's mirror; False if vLLM refused."""
        if not self.llm.reset_prefix_cache():
            return False
        assert self._mirror is not None
        self._mirror.clear()
        return True

    def _die(self, cause: str) -> EngineDeadError:
        """Shut the dead vLLM down; start a new one if ``max_restarts`` allows."""
        assert self._mirror is not None
        self._mirror.clear()  # whatever happens next, the old cache is gone
        self._finalizer()
        limit = self._config.max_restarts
        if self._restarts < limit:
            self._restarts += 1
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - a ConfigError too (start_llm's checks): down, never "closed"
                self._dead = f"{cause}; the restart failed: {type(exc).__name__}: {exc}"
                return EngineDeadError(
                    f"the engine died ({cause}) and could not be restarted ({type(exc).__name__}: {exc}): start "
                    "a new EmbeddedEngine", restarted=False)
            return EngineDeadError(
                f"the engine died ({cause}); restarted it (restart {self._restarts} of "
                f"max_restarts={limit}) with an empty prefix cache: send the request again",
                restarted=True,
            )
        self._dead = cause
        return EngineDeadError(
            f"the engine died ({cause}); max_restarts={limit}, so it stays down: start a new "
            "EmbeddedEngine, or set EngineConfig(max_restarts=N) to restart automatically",
            restarted=False,
        )

    # -- cache and counters ------------------------------------------------------------
    def counters(self) -> EngineCounters:
        """vLLM's prefix-cache counters of this engine (tokens since start)."""
        return EngineCounters(*_vllm.read_counters(self.llm))

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache and the engine's mirror.  Raises
        :class:`~promptsplice.errors.EngineError` if vLLM refuses (it does while a
        request holds blocks, which sequential use never leaves)."""
        with self._lock, _vllm.agent_installed(self._handle.kv):
            if not self._reset_cache():
                raise EngineError("vLLM refused to reset its prefix cache: a request still holds blocks")

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine down and free its memory (idempotent).

        With other engines alive in the process, only this engine's executor and
        scheduler are shut down: vLLM's full shutdown also destroys the process-wide
        distributed groups that the others still use.
        """
        with self._lock:
            self._closed_by_user = True
            self._finalizer()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.num_blocks} blocks of {self.block_size}"
        return f"EmbeddedEngine({self._config.model!r}, {state})"
