"""What the runners and the chat model use of an engine, for a served one.

:class:`~promptsplice.engine_adapters.AgentRunner`,
:class:`~promptsplice.engine_adapters.RagRunner` and
:class:`~promptsplice.engine_adapters.integrations.PromptspliceChatModel` call an engine
through one small surface, which :class:`~promptsplice.engine_adapters.EmbeddedEngine`
has and :class:`ServedEngineSurface` gives :class:`~promptsplice.engine_adapters.RemoteEngine`:

* ``block_size``, ``tokenizer``, ``can_splice``, ``make_assembler(**kwargs)``;
* ``generate(prompt, *, max_tokens, temperature, cache_salt, stop, splice)`` returning a
  :class:`~promptsplice.engine_adapters.Completion` (vLLM's ``num_cached_tokens`` is the
  server's ``usage.prompt_tokens_details.cached_tokens``; the generated token ids come
  from vLLM's ``return_token_ids``);
* ``stream(...)`` yielding :class:`~promptsplice.engine_adapters.StreamDelta` (SSE);
* ``generate_phases(tokens, phases, *, cache_salt, **gen)`` returning a
  :class:`~promptsplice.engine_adapters.PhasedRun`: each phase one completion request
  carrying its plan in ``kv_transfer_params``; ``relocated_tokens`` is the sum of the
  connector's acks (``splice_ack.relocated_tokens``), the probes' deviations come in
  the acks too (``splice_ack.deviations``: the adaptive recompute runs as embedded).

Where a served engine's facts come from:

* **block size**: the splice connector says it.  The first use sends one probe request
  (one token, ``max_tokens=1``, ``kv_transfer_params={"splice_probe": true}``); the
  connector's ack carries its ``block_size``.  ``RemoteEngine(block_size=...)`` is
  checked against it (:class:`ConfigError` naming both); a server without the
  connector needs ``block_size=`` given (vLLM's API does not expose it).
* **tokenizer**: ``RemoteEngine(tokenizer=...)`` (anything ``Assembler`` takes), else
  the server's model when its id is a local model folder.  Either way it is checked
  once against the server's ``/tokenize`` on a probe text; a tokenizer that splits it
  differently is a :class:`ConfigError` (a splice plan or an assembled prompt made with
  other token ids than the server's would never hit its cache).
* **max_model_len**: the server's ``/v1/models`` entry for the model (asked once, by a
  multi-phase splice, which checks the whole prompt against it before its first phase);
  ``None`` from a server that does not list it.
* **can_splice**: the probe got an ack (the server runs the splice connector);
  **can_relocate**: the ack says the connector can relocate.
* **mirror**: the client keeps the mirror of the server's prefix cache, as the embedded
  engine keeps its own: every token-id completion it ran (``generate``, ``stream``,
  ``complete``, their async twins) is replayed there when its answer arrives (the
  prompt, the generated tokens' blocks when their ids came back, under its
  ``cache_salt``; ``chat`` is not: the server applies the template), with the
  capacity the connector's ack names (vLLM's ``num_gpu_blocks``; the assembler's default
  from a server without the connector), from the first use of :attr:`mirror` (which
  ``make_assembler`` lends its assemblers; the runners make one at construction) on:
  no request sends a probe for it.  Prompts sent as text are not replayed (their ids are
  not known here): with ``send_token_ids=False`` assemblers keep mirrors of their own.  It equals
  the server's cache while this client is the server's only user and sends token ids;
  other traffic makes it a prediction (the counts reported always come from the server).
* **the block store** lives in the server's process: ``kv_store`` is ``None`` and
  :meth:`~ServedEngineSurface.match_chains` asks the connector what it holds (one store
  query per call: a one-token request whose ack carries the counts; split into queries
  of at most the ``max_query_tokens`` the probe's ack names, the server's
  ``max_model_len``, which the connector refuses to exceed), which is what
  :class:`~promptsplice.engine_adapters.RagRunner`'s chunk index reads for
  position-independent reuse over a server.

Requirements on the server: ``--enable-prompt-tokens-details`` (cached-token counts;
without it ``generate`` raises :class:`EngineResponseError` rather than report 0) and
vLLM's ``return_token_ids`` (vLLM >= 0.10).  ``logprobs=k`` (``-1``: the whole
vocabulary, which needs ``--max-logprobs -1``) are asked with
``return_tokens_as_token_ids``, so they come back keyed by token id as on the embedded
engine (vLLM floors them at -9999).  ``ttft_s`` of a
non-streamed completion is its whole time (the server does not report its first-token
time); :meth:`stream` measures it.

Kept as one module (~700 lines): the surface is one contract with the embedded engine's,
and its parts (the mirror a client keeps, the probes, the phased runs and the stream
with its abort) share the engine's locks and the rules of what is replayed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from promptsplice._validate import check_int, check_salt, check_stop, check_token_ids, salt_tenant
from promptsplice.assembler import (
    DEFAULT_CAPACITY_BLOCKS,
    Assembler,
    MirrorView,
    PrefixCacheMirror,
    Tokenizer,
    load_tokenizer,
)
from promptsplice.engine_adapters._requests import (
    PROMPT_TOKENIZER_FIX,
    Adapt,
    Completion,
    PhasedRun,
    PhaseResult,
    StreamDelta,
    admit_run,
    check_context,
    check_logprobs,
    check_phase_options,
    check_tokenizer,
    phase_list,
    run_phases,
    sent_plan,
)
from promptsplice.engine_adapters._wire import (
    Accumulator,
    Call,
    RemoteCompletion,
    Retry,
    Request,
    SSELines,
    completion_from_json,
    context_len_from_list,
    model_from_list,
    wants_usage,
    parse_json,
    snippet,
)
from promptsplice.engine_adapters.connector._plans import SplicePhase, SplicePlan
from promptsplice.engine_adapters.connector._served import MAX_QUERY_TOKENS, PROBE_KEY, QUERY_REASON, SpliceAck, query_params
from promptsplice.engine_adapters.store._store import BlockRef
from promptsplice.errors import ConfigError, EngineError, EngineRequestError, EngineResponseError, TokenizerError

__all__ = ["ServedEngineSurface", "TOKENIZER_PROBE_TEXT"]

_log = logging.getLogger(__name__)

TOKENIZER_PROBE_TEXT = "Hello, world! Prompt assembly: 12345 tokens, ünïcode — and   spaces.\n\tdone"
"""The text a served engine's tokenizer is checked on (words, digits, unicode, spaces)."""

_UNSET = object()
_PROBE_REFUSED = (400, 404, 415, 422)
"""HTTP statuses of a server that refuses the splice probe's shape: it has no connector."""


class ServedEngineSurface:
    """The runner/chat-model surface of :class:`~promptsplice.engine_adapters.RemoteEngine`
    (module doc).  A mixin: it drives the engine's own exchange machinery."""

    def _init_served(self, tokenizer: Any, block_size: int | None) -> None:
        if block_size is not None:
            check_int(block_size, "block_size")
        self._given_block_size = block_size
        self._given_tokenizer = tokenizer
        self._probe: Any = _UNSET  # SpliceAck | None once asked
        self._context_len: Any = _UNSET  # int | None once asked
        self._tok: Tokenizer | None = None
        self._mirror: PrefixCacheMirror | None = None
        # one lock per fact asked once: threads' first uses at once ask the server once
        # and share what it said (two mirrors were made, one never replayed into); each
        # is held over its own question only, never over an unrelated call
        self._probe_lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._mirror_lock = threading.Lock()
        self._context_lock = threading.Lock()

    # -- facts from the server -------------------------------------------------------
    def _model_id(self) -> str:
        if self.model is None:  # type: ignore[attr-defined]
            url = self._url("/v1/models")  # type: ignore[attr-defined]
            self.model = model_from_list(self._run(self._get("/v1/models")), url)  # type: ignore[attr-defined]
        return self.model  # type: ignore[attr-defined]

    @property
    def max_model_len(self) -> int | None:
        """The server's context length for its model, as its ``/v1/models`` lists it
        (vLLM's ``max_model_len``; asked once), ``None`` from a server that does not say,
        or that has no ``/v1/models`` (a proxy's 404 or 405: the prompt then meets the
        server's own check; a prompt may hold at most ``max_model_len - 1`` tokens, as
        embedded)."""
        if self._context_len is _UNSET:
            with self._context_lock:
                if self._context_len is _UNSET:
                    model = self._model_id()
                    url = self._url("/v1/models")  # type: ignore[attr-defined]
                    try:
                        listed = self._run(self._get("/v1/models"))  # type: ignore[attr-defined]
                    except EngineRequestError as exc:
                        if exc.status_code not in (404, 405):
                            raise
                        self._context_len = None
                    else:
                        self._context_len = context_len_from_list(listed, url, model)
        return self._context_len  # type: ignore[return-value]

    def splice_probe(self) -> SpliceAck | None:
        """The splice connector's ack to a probe request (once; module doc), ``None``
        when the server does not run the connector."""
        if self._probe is _UNSET:
            with self._probe_lock:  # a thread that waited here reads the first one's answer
                if self._probe is _UNSET:
                    try:
                        probe = self._ack_request({PROBE_KEY: True})
                    except EngineRequestError as exc:
                        # a server that refuses the probe itself (a text-only gateway: no
                        # token-id prompts, no kv_transfer_params) runs no connector; until
                        # 2026-12-07 its refusal failed block_size even when it was given
                        if exc.status_code not in _PROBE_REFUSED:
                            raise
                        _log.info("%s refused the splice probe (HTTP %s): no splice connector",
                                  self.base_url, exc.status_code)  # type: ignore[attr-defined]
                        probe = None
                    self._probe = probe  # kept: asked once, also when refused below
        ack = self._probe
        if ack is not None and self._given_block_size not in (None, ack.block_size) and ack.block_size:
            raise ConfigError(
                f"RemoteEngine(block_size={self._given_block_size}) but the splice connector "
                f"at {self.base_url} runs block_size {ack.block_size}: drop block_size= or "  # type: ignore[attr-defined]
                "pass the server's --block-size"
            )
        return ack

    def _ack_request(self, params: dict[str, Any], salt: str | None = None) -> SpliceAck | None:
        """One token, ``max_tokens=1``, carrying ``params`` (under ``salt``): the
        connector's ack (``None`` from a server without it)."""
        body = {"model": self._model_id(), "prompt": [0], "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": params}
        if salt is not None:
            body["cache_salt"] = salt
        req = Request("/v1/completions", body, False, 1)
        call = Call("POST", self._url(req.path), req, time.perf_counter(), probe=True)  # type: ignore[attr-defined]
        out = self._run(self._attempts(call))  # type: ignore[attr-defined]
        return completion_from_json(parse_json(out, call.url), req, call.url, call.start).splice

    @property
    def can_splice(self) -> bool:
        """Whether the server runs the splice connector (asks it once)."""
        return self.splice_probe() is not None

    @property
    def can_relocate(self) -> bool:
        """Whether the server's connector can relocate KV (its probe ack says)."""
        ack = self.splice_probe()
        return ack is not None and ack.relocation

    def match_chains(self, chains: Sequence[tuple[Sequence[BlockRef], str | None]]) -> list[int]:
        """How many leading blocks of each (non-empty) chain the server's block store
        holds: one store query for all of them
        (:mod:`~promptsplice.engine_adapters.connector._served`).  :class:`ConfigError`
        without the connector, :class:`InputError` for an empty chain."""
        if not self.can_splice:
            raise ConfigError(
                f"{self.base_url} does not run the splice connector: its block store cannot "  # type: ignore[attr-defined]
                "be queried (start vllm serve with --kv-transfer-config kv_transfer_config_json(...))"
            )
        # Queries of at most the server's cap each (its ack's max_query_tokens: its
        # max_model_len; MAX_QUERY_TOKENS from a connector that does not say); a longer
        # chain is asked for its leading blocks only (a count is a leading run: the rest
        # cannot add to a shorter one).
        # A query carries its tenant's salt as its cache_salt (the connector answers only
        # for salts of that tenant), so chains of different tenants go in separate queries.
        cap_blocks = max(1, self._query_token_cap() // self.block_size)
        batches: list[list[tuple[list[BlockRef], str | None]]] = [[]]
        size = 0
        chains = list(chains)
        for _, salt in chains:  # generate()'s salt rules: a query's salt is its cache_salt
            self._salts.check(salt)  # type: ignore[attr-defined]
        for refs, salt in chains:
            cut = list(refs)[:cap_blocks]
            other_tenant = batches[-1] and salt_tenant(batches[-1][0][1]) != salt_tenant(salt)
            if batches[-1] and (size + len(cut) > cap_blocks or other_tenant):
                batches.append([])
                size = 0
            batches[-1].append((cut, salt))
            size += len(cut)
        out: list[int] = []
        for batch in filter(None, batches):
            ack = self._ack_request(query_params(batch), salt=batch[0][1])
            if ack is None or ack.reason != QUERY_REASON or len(ack.matched) != len(batch):
                why = "no ack" if ack is None else ack.reason or f"{len(ack.matched)} answers for {len(batch)} chains"
                raise EngineResponseError(f"{self.base_url}'s splice connector did not answer the store query: {why}")  # type: ignore[attr-defined]
            out += [min(int(k), len(refs)) for k, (refs, _) in zip(ack.matched, batch)]
        return out

    def _query_token_cap(self) -> int:
        """The most tokens one store query may carry: what the connector's probe ack
        says (``max_query_tokens``), else :data:`MAX_QUERY_TOKENS`."""
        ack = self.splice_probe()
        said = ack.max_query_tokens if ack is not None else 0
        return min(said, MAX_QUERY_TOKENS) if said > 0 else MAX_QUERY_TOKENS

    @property
    def kv_store(self) -> None:
        """The block store lives in the server's process: not reachable from here."""
        return None

    @property
    def block_size(self) -> int:
        """The server's KV block size (module doc)."""
        ack = self.splice_probe()
        if ack is not None and ack.block_size:
            return ack.block_size
        if self._given_block_size is None:
            raise ConfigError(
                f"{self.base_url} does not say its block size (no splice connector): pass "  # type: ignore[attr-defined]
                "RemoteEngine(block_size=...) with the server's --block-size"
            )
        return self._given_block_size

    @property
    def tokenizer(self) -> Tokenizer:
        """The server's tokenizer (module doc), checked against its ``/tokenize`` once."""
        if self._tok is None:
            with self._tok_lock:  # asked and checked once, whichever thread comes first
                if self._tok is None:
                    self._tok = self._find_tokenizer()
        return self._tok

    def _find_tokenizer(self) -> Tokenizer:
        """The tokenizer given or the server's model's, checked against the server."""
        given = self._given_tokenizer
        if given is None:
            model = self._model_id()
            if not Path(model).is_dir():
                raise ConfigError(
                    f"the server's model {model!r} is not a local folder: pass "
                    "RemoteEngine(tokenizer=...) with its tokenizer (a tokenizer.json path, "
                    "an HFTokenizer, or 'default')"
                )
            from promptsplice.engine_adapters._lifecycle import load_tokenizer as load_model_tokenizer

            def no_llm() -> Any:
                raise TokenizerError(f"{model} has no tokenizer.json: pass RemoteEngine(tokenizer=...) "
                                     "with the server's tokenizer (a tokenizer.json path or an HFTokenizer)")

            tok = load_model_tokenizer(model, no_llm)
        else:
            tok = load_tokenizer(given)
        self._check_tokenizer(tok)
        return tok

    def _check_tokenizer(self, tok: Tokenizer) -> None:
        url = self._url("/tokenize")  # type: ignore[attr-defined]
        body = {"model": self._model_id(), "prompt": TOKENIZER_PROBE_TEXT, "add_special_tokens": False}
        req = Request("/tokenize", body, False, None)
        out = self._run(self._attempts(Call("POST", url, req, probe=True)))  # type: ignore[attr-defined]
        server = parse_json(out, url).get("tokens")
        mine = list(tok.encode(TOKENIZER_PROBE_TEXT))
        if not isinstance(server, list) or not all(type(t) is int for t in server):
            raise EngineResponseError(f"{url} answered no token list: {snippet(out.content)!r}")
        if [int(t) for t in server] != mine:
            raise ConfigError(
                f"the tokenizer {getattr(tok, 'name', type(tok).__name__)!r} splits the probe text into "
                f"{len(mine)} tokens, the server's model {self.model!r} into {len(server)} "  # type: ignore[attr-defined]
                "(or other ids): pass RemoteEngine(tokenizer=...) with the served model's tokenizer"
            )

    def _check_prompt_tokenizer(self, prompt: Any) -> None:
        """Before a prompt's ids are sent: they must be tokens of the tokenizer this
        engine was given or found (nothing to compare with when it has none yet)."""
        theirs = getattr(prompt, "tokenizer", None)
        mine = self._known_tokenizer()
        if theirs is not None and mine is not None:
            check_tokenizer(mine, theirs, "the prompt", PROMPT_TOKENIZER_FIX)

    def _known_tokenizer(self) -> Tokenizer | None:
        """The tokenizer found or given, without asking the server (``None``: neither)."""
        if self._tok is not None:
            return self._tok
        return None if self._given_tokenizer is None else load_tokenizer(self._given_tokenizer)

    def _served_mirror(self) -> PrefixCacheMirror:
        mirror = self._mirror
        if mirror is None:
            ack = self.splice_probe()  # asked once under its own lock, not this one
            capacity = ack.num_blocks - 1 if ack is not None and ack.num_blocks > 1 else DEFAULT_CAPACITY_BLOCKS
            block_size = self.block_size
            with self._mirror_lock:  # one mirror, whichever thread comes first: the one replayed into
                if self._mirror is None:
                    self._mirror = PrefixCacheMirror(block_size, capacity)
                mirror = self._mirror
        return mirror

    @property
    def mirror(self) -> MirrorView:
        """A read-only view of this client's mirror of the server's prefix cache (module
        doc): what the engine's assemblers and the runners predict from."""
        return self._served_mirror().view()

    def make_assembler(self, **kwargs: Any) -> Assembler:
        """An :class:`~promptsplice.assembler.Assembler` for this server: its tokenizer,
        block size and (unless ``mirror=`` is given) a view of :attr:`mirror`."""
        tokenizer = kwargs.pop("tokenizer", None)
        if tokenizer is None:
            tokenizer = self.tokenizer
        elif self.send_token_ids:  # type: ignore[attr-defined]
            # its ids go to the server as they are: they must be the served model's tokens
            mine = self._known_tokenizer()
            if mine is not None:
                tokenizer = check_tokenizer(mine, tokenizer, "tokenizer=", "leave it unset (the server's tokenizer)")
            else:  # the engine was given none: ask the server itself
                tokenizer = load_tokenizer(tokenizer)
                self._check_tokenizer(tokenizer)
        if "block_size" in kwargs:  # the server's, or the mirror would predict another cache
            if kwargs["block_size"] != self.block_size:
                raise ConfigError(
                    f"block_size={kwargs['block_size']!r} differs from the server's {self.block_size}: "
                    "the mirror would predict another cache; leave it unset"
                )
            del kwargs["block_size"]
        if self.send_token_ids and "capacity_blocks" not in kwargs:  # type: ignore[attr-defined]
            kwargs.setdefault("mirror", self.mirror)
        # prompts sent as text are not replayed here: such an assembler keeps (and admits
        # into) a mirror of its own, as before the engine kept one
        return Assembler(tokenizer, block_size=self.block_size, **kwargs)

    # -- requests --------------------------------------------------------------------
    def _served_request(
        self, prompt: Any, max_tokens: int, temperature: float, cache_salt: str | None,
        stop: str | Sequence[str] | None, splice: SplicePlan | None, logprobs: int | None, stream: bool,
    ) -> Request:
        check_logprobs(logprobs)
        if isinstance(splice, SplicePlan):
            self._check_plan_block_size(splice)
        req = self._completion_request(  # type: ignore[attr-defined]
            prompt, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt,
            prompt_cache_key=None, stream=stream, splice=splice,
        )
        if stop is not None:
            stops = check_stop(stop)
            if stops:
                req.body["stop"] = stops
        req.body["return_token_ids"] = True
        if logprobs is not None:  # keyed by token id, as the embedded engine keys them
            req.body["logprobs"] = logprobs
            req.body["return_tokens_as_token_ids"] = True
        return req

    def _check_plan_block_size(self, plan: SplicePlan) -> None:
        """The connector would drop a plan of another block size (the embedded engine
        refuses it): say so first.  The block size given to the engine, else the
        connector's (a server without it answers the plan with its EngineRequestError)."""
        given = self._given_block_size
        ack = self.splice_probe() if given is None else None
        server_bs = given if given is not None else (ack.block_size if ack is not None else 0)
        if server_bs and plan.block_size != server_bs:
            raise ConfigError(f"the splice plan was made for block_size {plan.block_size}, the engine's is {server_bs}")

    def _completion_record(self, rc: RemoteCompletion, req: Request) -> Completion:
        if rc.cached_tokens is None:
            raise EngineResponseError(
                f"{self.base_url} does not report cached tokens: start vllm serve with "  # type: ignore[attr-defined]
                "--enable-prompt-tokens-details (counts are never guessed)"
            )
        if rc.token_ids is None and rc.completion_tokens != 0:
            raise EngineResponseError(
                f"{self.base_url} did not return the generated token ids it was asked for "  # type: ignore[attr-defined]
                "(return_token_ids): a vLLM of 0.10.2 or later, not behind a proxy that drops "
                "fields, is needed (counts and the cache mirror are never guessed)"
            )
        # a prompt sent as token ids has their count (_wire.reply_counts checked the
        # server's against it); one sent as text has the server's, or the caller's own
        if rc.prompt_tokens is None or rc.cached_tokens > rc.prompt_tokens:
            raise EngineResponseError(
                f"{self.base_url} answered cached_tokens={rc.cached_tokens} for a prompt of "  # type: ignore[attr-defined]
                f"{'unknown length' if rc.prompt_tokens is None else rc.prompt_tokens} tokens: "
                "the prefilled tokens are not known (counts are never guessed)"
            )
        prompt = req.body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else []
        predicted = self._replay(req, rc)
        return Completion(
            text=rc.text,
            token_ids=list(rc.token_ids or []),
            prompt_token_ids=ids,
            prompt_tokens=rc.prompt_tokens,
            num_cached_tokens=rc.cached_tokens,
            ttft_s=rc.ttft_s if rc.ttft_s is not None else rc.total_s,
            total_s=rc.total_s,
            finish_reason=rc.finish_reason,
            request_id=rc.request_id,
            logprobs=rc.logprobs,
            predicted_cached_tokens=predicted,
        )

    def _replay(self, req: Request, rc: RemoteCompletion) -> int | None:
        """Replay a finished completion request into the mirror once it exists (module
        doc): its prompt when sent as token ids, and the generated tokens when the
        server returned their ids (``return_token_ids``; without them only the prompt's
        blocks); the mirror's prediction for it, ``None`` when not replayed (no mirror
        yet, or the prompt went as text: its ids are not known here)."""
        prompt = req.body.get("prompt")
        mirror = self._mirror
        if mirror is None or req.chat or not isinstance(prompt, list) or not prompt:
            return None
        return admit_run(mirror, list(prompt), list(rc.token_ids or []), req.body.get("cache_salt"))

    def _generate_served(
        self, prompt: Any, *, max_tokens: int = 16, temperature: float = 0.0, cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None, splice: SplicePlan | None = None, logprobs: int | None = None,
    ) -> tuple[Completion, RemoteCompletion]:
        req = self._served_request(prompt, max_tokens, temperature, cache_salt, stop, splice, logprobs, False)
        rc = self._run(self._completion(req))  # type: ignore[attr-defined]
        if rc.splice is not None and rc.splice.reason:
            # the server's connector logged it in the server's log: the caller's log says it too
            _log.warning("served splice plan ran as plain prefill: %s", rc.splice.reason)
        return self._completion_record(rc, req), rc

    def generate(
        self, prompt: Any, *, max_tokens: int = 16, temperature: float = 0.0, cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None, splice: SplicePlan | None = None, logprobs: int | None = None,
    ) -> Completion:
        """:meth:`EmbeddedEngine.generate <promptsplice.engine_adapters.EmbeddedEngine.generate>`
        over the server (module doc): a plan of another block size than the server's is a
        :class:`ConfigError` (as embedded); one the connector dropped (other tokens, another
        tenant's source) runs as plain prefill, logged with the connector's reason."""
        return self._generate_served(
            prompt, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt,
            stop=stop, splice=splice, logprobs=logprobs,
        )[0]

    async def agenerate(
        self, prompt: Any, *, max_tokens: int = 16, temperature: float = 0.0, cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None, logprobs: int | None = None,
    ) -> Completion:
        """:meth:`generate` on the event loop: cancelling it closes the request's
        connection (the server stops the request) instead of leaving a thread waiting
        for an answer nobody reads.  The request is built in a thread (the first one
        may ask the server for its tokenizer)."""
        req = await asyncio.to_thread(
            self._served_request, prompt, max_tokens, temperature, cache_salt, stop, None, logprobs, False
        )
        rc = await self._arun(self._completion(req))  # type: ignore[attr-defined]
        return self._completion_record(rc, req)

    def stream(
        self, prompt: Any, *, max_tokens: int = 16, temperature: float = 0.0, cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[StreamDelta]:
        """What the server streams (SSE), one :class:`StreamDelta` per chunk; the last
        has ``completion`` set.  Invalid options raise here, server errors while it is
        advanced (retried until the first delta, as ``generate``; never after)."""
        req = self._served_request(prompt, max_tokens, temperature, cache_salt, stop, None, None, True)
        req.body["model"] = self._model_id()
        control = _StreamControl()
        return ServedStream(self._stream_deltas(req, control), control)

    def _stream_deltas(self, req: Request, control: _StreamControl) -> Iterator[StreamDelta]:
        """The SSE deltas, with the engine's retries while nothing was yielded yet (a
        refused connection, a 503, a connect timeout: as ``generate``);
        once a delta is out, an error is final (a retry would repeat output).  Each
        attempt is bounded by ``total_timeout`` (checked after every read; the time the
        consumer holds a delta counts); an aborted stream is never retried, and an
        abort during the pause before a retry ends it at once."""
        call = Call("POST", self._url(req.path), req, time.perf_counter())  # type: ignore[attr-defined]
        attempts = self._attempts(call)  # type: ignore[attr-defined]
        step = next(attempts)
        while True:
            if isinstance(step, float):  # the pause before a retry, cut short by abort()
                control.wait(step)
                control.check(call.url)
                step = next(attempts)
                continue
            started = False
            deadline = time.monotonic() + self.total_timeout  # type: ignore[attr-defined]
            try:
                control.check(call.url)
                with self._translating(call.url, call.resendable) as used:  # type: ignore[attr-defined]
                    client = self._sync_client()  # type: ignore[attr-defined]
                    used.append(client)
                    with client.stream("POST", call.url, json=req.body, extensions={"trace": control.trace}) as response:
                        control.connected(response)
                        if response.status_code >= 400:
                            response.read()
                        self._check_response(response, call)  # type: ignore[attr-defined]
                        acc = Accumulator(False, call.start, expect_usage=wants_usage(req),
                                          content_type=response.headers.get("content-type"))
                        lines = SSELines(call.url)
                        events = 0
                        for chunk in response.iter_bytes():
                            for line in lines.feed(chunk):
                                text, ids = acc.feed(line, call.url)
                                if text or ids:
                                    started = True
                                    yield StreamDelta(text, ids, None)
                            if acc.done:  # [DONE] ends the answer: a proxy may hold the body open after it
                                break
                            if acc.events != events:  # a data event is progress (a keep-alive comment is not)
                                events, deadline = acc.events, self._progress_deadline()  # type: ignore[attr-defined]
                            self._check_deadline(deadline, call.url)  # type: ignore[attr-defined]
                        for line in lines.close():  # an unterminated last line's text is a delta too
                            text, ids = acc.feed(line, call.url)
                            if text or ids:
                                started = True
                                yield StreamDelta(text, ids, None)
                        rc = acc.result(req, call.url)
                break
            except Retry as retry:  # type: ignore[attr-defined]
                control.check(call.url, retry.error)
                if started:
                    raise retry.error from retry.error.__cause__
                step = attempts.throw(retry)  # the pause, or the error once retries are spent
            except EngineError as exc:
                control.check(call.url, exc)
                raise
            finally:  # the connection went back to the pool (or closed): never shut it from here on
                control.release()
        control.end()
        yield StreamDelta("", [], self._completion_record(rc, req))

    def generate_phases(
        self,
        tokens: Sequence[int],
        phases: Sequence[SplicePhase],
        *,
        cache_salt: str | None = None,
        adapt: Adapt | None = None,
        **gen: Any,
    ) -> PhasedRun:
        """:meth:`EmbeddedEngine.generate_phases
        <promptsplice.engine_adapters.EmbeddedEngine.generate_phases>` over the server
        (the same loop, :func:`~promptsplice.engine_adapters._requests.run_phases`):
        relocated tokens are the connector's acks summed, and ``adapt`` reads the
        deviations the acks carry (the server's probes), as on the embedded engine.

        What the server would refuse of a later phase is refused before the first one
        goes out, as embedded: the whole prompt over the server's ``max_model_len``
        (:class:`~promptsplice.errors.ContextLengthError`; the earlier phases' prefill
        ran before the server answered the last one's 400), ids that are not token ids,
        a bad salt, a plan of another block size."""
        check_phase_options(gen)  # a typo or a bad value fails before the first phase runs
        phases = phase_list(phases)  # (read twice: by the checks and by run_phases)
        check_salt(cache_salt, "cache_salt")
        tokens = check_token_ids(tokens, "tokens")
        if len(phases) > 1 and (limit := self.max_model_len) is not None:  # one phase: the server says it
            check_context(len(tokens), limit)
        for phase in phases:
            plan = sent_plan(phase) if isinstance(phase, SplicePhase) else None  # (run_phases names anything else)
            if plan is not None:
                self._check_plan_block_size(plan)

        def run_one(prompt: list[int], plan: SplicePlan | None, kwargs: dict[str, Any]) -> PhaseResult:
            out, rc = self._generate_served(prompt, cache_salt=cache_salt, splice=plan, **kwargs)  # probes-only plans too
            if rc.splice is None:
                return PhaseResult(out, 0)
            return PhaseResult(out, rc.splice.relocated_tokens, rc.splice.deviations)

        return run_phases(tokens, phases, run_one, gen, adapt)


class _StreamControl:
    """What :meth:`ServedStream.abort` reaches from another thread: a flag, and the
    connection of the request in flight (from httpcore's trace when it connects, from
    the response once it answers) until the request lets go of it (:meth:`release`):
    a pooled connection then carries other requests, which an abort must never shut."""

    def __init__(self) -> None:
        self.aborted = False
        self._network: Any = None
        self._ended = False
        self._lock = threading.Lock()
        self._abort_event = threading.Event()  # wakes a retry's backoff (a Retry-After of up to 60 s)

    def trace(self, event: str, info: dict[str, Any]) -> None:
        stream = info.get("return_value") if event.endswith(".complete") else None
        if hasattr(stream, "get_extra_info"):  # connect_tcp / start_tls: the new connection
            with self._lock:
                if self._ended:
                    return
                self._network = stream
                if self.aborted:
                    self._shut()

    def connected(self, response: Any) -> None:
        self.trace("response.complete", {"return_value": response.extensions.get("network_stream")})

    def release(self) -> None:
        """The request is over (answered, failed or retried): its connection is not ours."""
        with self._lock:
            self._network = None

    def end(self) -> None:
        """The stream is complete: a later :meth:`abort` does nothing."""
        with self._lock:
            self._ended = True
            self._network = None

    def abort(self) -> None:
        with self._lock:
            if self._ended:
                return
            self.aborted = True
            self._abort_event.set()
            self._shut()

    def wait(self, seconds: float) -> None:
        """The pause before a retry; an :meth:`abort` ends it at once."""
        self._abort_event.wait(seconds)

    def _shut(self) -> None:
        sock = self._network.get_extra_info("socket") if self._network is not None else None
        if sock is not None:
            try:  # wakes a read blocked on it (a close() from another thread does not)
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def check(self, url: str, cause: BaseException | None = None) -> None:
        if self.aborted:
            raise EngineError(f"the stream from {url} was aborted (ServedStream.abort)") from cause


class ServedStream(Iterator[StreamDelta]):
    """What :meth:`ServedEngineSurface.stream` returns: the deltas, iterated and closed as
    a generator, and :meth:`abort` for another thread (an async caller that was
    cancelled: LangChain's ``astream``) to end a request still waiting on the server."""

    def __init__(self, deltas: Iterator[StreamDelta], control: _StreamControl) -> None:
        self._deltas = deltas
        self._control = control

    def __next__(self) -> StreamDelta:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()  # type: ignore[attr-defined]

    def abort(self) -> None:
        """Shut the request's connection from any thread: the thread iterating it gets
        :class:`EngineError` at once, with no retry.  A request on a pooled connection
        that has not answered yet is not reachable: it ends at the engine's timeouts."""
        self._control.abort()
