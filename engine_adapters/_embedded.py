"""``EmbeddedEngine``: vLLM in this process, driven one request at a time.

The engine sends assembled token ids straight to vLLM (``prompt_token_ids`` with the
prompt's ``cache_salt``), so the segment boundaries the assembler aligned to KV blocks
are exactly the engine's, and it reports vLLM's own ``num_cached_tokens`` next to the
assembler's prediction.

Requests run **sequentially**: ``generate`` adds one request and steps the engine until
it finishes, and a lock keeps other threads out meanwhile.  That makes the prefix-cache
state after each request deterministic (benches and the mirror depend on it) and lets
TTFT be measured exactly: the clock starts before ``LLMEngine.add_request`` and the
first-token time is taken when the ``step()`` that returns the first output token comes
back (with chunked prefill that can be a later step than the first).  Batched serving
is out of scope for this adapter.

With ``EngineConfig(kv_store=StoreConfig(...))`` the engine runs the splice KV connector
(``promptsplice.engine_adapters.connector._connector``): prefilled blocks are saved to the tiered store, served
back as offload hits after vLLM's own cache lost them, and ``generate(..., splice=plan)``
relocates stored blocks into a new prompt.  vLLM's counters (``counters()``,
``num_cached_tokens``) include the connector's tokens as external hits, which a prefix
cache mirror (a model of vLLM's own cache) does not predict.  vLLM keeps the
worker-side connector in one process-wide slot; each engine installs its own (or none)
while it runs (``promptsplice.engine_adapters._kv_agent``), so engines with and without a connector
can live in one process.

Failures: when a step raises (the model's forward pass, the scheduler), the engine's
state is unknown.  The adapter aborts what is left, empties the prefix cache (vLLM files
a block's hash when it *allocates* the block, before the forward pass writes it, so the
failed step's blocks would otherwise be served later with KV that was never written;
the splice connector likewise skips the step's saves) and runs a one-token health
probe.  A healthy engine keeps serving (the request raises
:class:`~promptsplice.errors.EngineRequestError`); a dead one raises
:class:`~promptsplice.errors.EngineDeadError`, after restarting vLLM if
``EngineConfig.max_restarts`` allows.

Facts of vLLM's block pool that the adapter relies on (vllm 0.32.0,
``v1/core/block_pool.py``): the pool holds ``num_gpu_blocks`` blocks, but block 0 is
taken at start as the *null block* and never holds KV, so ``num_gpu_blocks - 1`` blocks
can cache prefixes (:attr:`EmbeddedEngine.usable_blocks`, the mirror's capacity).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from promptsplice.assembler import AssembledPrompt, Assembler, HFTokenizer, PrefixCacheMirror, Tokenizer
from promptsplice.engine_adapters import _vllm
from promptsplice.engine_adapters._config import EngineConfig
from promptsplice.engine_adapters._kv_agent import AgentBox, installed
from promptsplice.engine_adapters.connector._plans import SplicePhase, SplicePlan
from promptsplice.blocks import BlockHash, chain_hashes, root_hash
from promptsplice._validate import check_int, check_number, check_salt
from promptsplice.errors import (
    ConfigError,
    ContextLengthError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    EngineStartError,
    InputError,
    PromptspliceError,
    TokenizerError,
)
from promptsplice.tenancy import SaltGuard

__all__ = ["EmbeddedEngine", "Completion", "EngineCounters", "PromptLike", "StreamDelta"]

PromptLike = AssembledPrompt | Sequence[int] | str
"""What :meth:`EmbeddedEngine.generate` takes."""


@dataclass(slots=True)
class Completion:
    """One finished request."""

    text: str
    """The generated text (vLLM's detokenization, stop strings removed)."""
    token_ids: list[int]
    """The generated token ids."""
    prompt_token_ids: list[int]
    prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens vLLM served from its prefix cache (its own ``num_cached_tokens``)."""
    ttft_s: float
    """Seconds from submitting the request to the step that returned its first token."""
    total_s: float
    """Seconds from submitting the request until it finished."""
    finish_reason: str | None
    """vLLM's reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_tokens``
    reached, or the context ``max_model_len`` filled up)."""
    predicted_cached_tokens: int | None = None
    """The mirror's prediction for this request, where one was known: the assembled
    prompt's (same block size and salt), or the ``mirror`` passed to ``generate``."""
    request_id: str = ""
    logprobs: list[dict[int, float]] | None = None
    """With ``generate(..., logprobs=k)``: per generated token, the log-probabilities
    of the ``k`` most likely tokens (``k=-1``: the whole vocabulary, for an engine
    started with ``extra_kwargs={"max_logprobs": -1}``) and of the sampled one."""

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the engine computed (not served from the cache)."""
        return self.prompt_tokens - self.num_cached_tokens


class StreamDelta(NamedTuple):
    """What one engine step added to a streamed request (:meth:`EmbeddedEngine.stream`)."""

    text: str
    """New text since the previous delta (may be empty while vLLM holds text back
    to check a stop string)."""
    token_ids: list[int]
    """New token ids since the previous delta."""
    completion: Completion | None
    """Set on the last delta only: the finished request, as ``generate`` returns it."""


class PhasedRun(NamedTuple):
    """What :meth:`EmbeddedEngine.generate_phases` ran."""

    completions: list[Completion]
    """One per phase, in order; the last one carries the generation."""
    t_last: float
    """``time.perf_counter()`` when the last phase was submitted (TTFT = up to there + its ttft)."""
    relocated_tokens: int
    """Tokens the splice connector loaded at another position than they were computed at."""


class EngineCounters(NamedTuple):
    """vLLM's prefix-cache counters (tokens, cumulative since the engine started)."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    external_queries: int
    external_hits: int

    def since(self, earlier: EngineCounters) -> EngineCounters:
        """The counts between ``earlier`` and this reading."""
        return EngineCounters(*(a - b for a, b in zip(self, earlier)))

    @property
    def hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0


def _logprob_dicts(out: Any) -> list[dict[int, float]]:
    """vLLM's per-token logprobs as plain ``{token_id: logprob}`` dicts."""
    lps = out.outputs[0].logprobs if out.outputs else None
    return [{int(t): float(lp.logprob) for t, lp in step.items()} for step in (lps or [])]


class _Handle:
    """Holds the vLLM object for the engine and its finalizer (never the engine), and
    the engine's worker-side KV connector (``None`` without one)."""

    __slots__ = ("llm", "kv")

    def __init__(self, llm: Any, kv: AgentBox) -> None:
        self.llm = llm
        self.kv = kv


_live_lock = threading.Lock()
_live_engines = 0


def _release(handle: _Handle) -> None:
    """Shut the engine's vLLM down; the process-wide state goes with the last one."""
    global _live_engines
    llm, handle.llm = handle.llm, None
    if llm is None:
        return
    with _live_lock:
        _live_engines -= 1
        last = _live_engines == 0
    with installed(handle.kv, capture=True):  # vLLM shuts down the slot's connector
        _vllm.shutdown_llm(llm, last_engine=last)


_PROBE_STEPS = 8
"""Steps a one-token health probe may take (it needs one prefill step)."""


def _is_default_model(folder: Path) -> bool:
    from promptsplice.assets import default_model_dir

    try:
        return folder.resolve() == default_model_dir().resolve()
    except OSError:
        return False


class EmbeddedEngine:
    """A vLLM engine in this process with prefix caching, one request at a time.

    ``EmbeddedEngine(config=None, **overrides)`` starts ``vllm.LLM`` once (~4 s on CPU
    for the default model); ``overrides`` replace fields of ``config`` (or of the
    default :class:`EngineConfig`).  Close it with :meth:`close` (or use it as a
    context manager); several engines may live in one process.

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
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._mirrors: weakref.WeakSet[PrefixCacheMirror] = weakref.WeakSet()
        self._tokenizer: Tokenizer | None = None
        self._salts = SaltGuard("EmbeddedEngine", require=self._config.require_salt)
        self._restarts = 0
        self._dead: str | None = None
        self._start()

    def _start(self) -> None:
        """Start vLLM (at construction, and again on a restart)."""
        global _live_engines
        vllm = _vllm.import_vllm()
        kwargs = self._config.llm_kwargs(self._config.model)
        kv = AgentBox()
        try:
            with installed(kv, capture=True):  # a connector engine creates its agent here
                llm = vllm.LLM(**kwargs)
        except Exception as exc:
            raise self._start_error(exc) from exc
        _vllm.detach_vllm_finalizer(llm)
        with _live_lock:
            _live_engines += 1
        self._handle = _Handle(llm, kv)
        self._finalizer = weakref.finalize(self, _release, self._handle)

        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        self._SamplingParams = SamplingParams
        self._tokens_input = tokens_input
        cache = llm.llm_engine.vllm_config.cache_config
        self._num_blocks = int(cache.num_gpu_blocks)
        self._block_size = int(cache.block_size)
        self._max_model_len = int(llm.llm_engine.vllm_config.model_config.max_model_len)

    def _start_error(self, exc: BaseException) -> EngineStartError:
        cfg = self._config
        if _vllm.is_kv_cache_too_small(exc):
            size = (
                "vLLM's default size"
                if cfg.kv_cache_bytes is None
                else f"kv_cache_bytes={cfg.kv_cache_bytes} ({cfg.kv_cache_bytes / 2**20:.1f} MiB)"
            )
            return EngineStartError(
                f"the KV cache ({size}) cannot hold one request of max_model_len="
                f"{cfg.max_model_len} tokens: raise kv_cache_bytes or lower max_model_len. "
                f"vLLM said: {exc}"
            )
        return EngineStartError(f"vLLM could not start {cfg.model!r}: {type(exc).__name__}: {exc}")

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
                    f"the engine died ({self._dead}) and its max_restarts="
                    f"{self._config.max_restarts} restarts are used up: start a new EmbeddedEngine",
                    restarted=False,
                )
            raise EngineError("the engine is closed; start a new EmbeddedEngine")
        return llm

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
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> Tokenizer:
        folder = Path(self._config.model)  # type: ignore[arg-type]
        if folder.is_dir():
            if _is_default_model(folder):
                from promptsplice.assembler import default_tokenizer

                return default_tokenizer()  # shares the default assembler's token cache
            if (folder / "tokenizer.json").is_file():
                return HFTokenizer.from_file(folder / "tokenizer.json")
        try:  # a hub model: wrap the fast tokenizer vLLM loaded
            return HFTokenizer(self.llm.get_tokenizer(), name=f"hf:{self._config.model}")
        except TokenizerError:
            raise
        except Exception as exc:
            raise TokenizerError(
                f"cannot build an assembler tokenizer for {self._config.model!r}: {exc}"
            ) from exc

    # -- assembly --------------------------------------------------------------------
    def make_assembler(self, **kwargs: Any) -> Assembler:
        """An :class:`promptsplice.assembler.Assembler` sized like this engine.

        Block size = the engine's, mirror capacity = :attr:`usable_blocks` (so, with
        nothing else using the engine, predictions equal vLLM's ``num_cached_tokens``),
        tokenizer = :attr:`tokenizer`, ``max_tokens`` = ``max_model_len - 1``.  Other
        keyword arguments go to ``Assembler``.  :meth:`reset_prefix_cache` clears the
        mirrors of the assemblers made here.
        """
        for key, mine in (("block_size", self.block_size), ("capacity_blocks", self.usable_blocks)):
            if key in kwargs and kwargs[key] != mine:
                raise ConfigError(
                    f"{key}={kwargs[key]!r} differs from the engine's {mine}: the mirror "
                    "would predict another cache; leave it unset"
                )
            kwargs.pop(key, None)
        kwargs.setdefault("max_tokens", self.max_model_len - 1)
        tokenizer = kwargs.pop("tokenizer", None) or self.tokenizer
        asm = Assembler(
            tokenizer,
            block_size=self.block_size,
            capacity_blocks=self.usable_blocks,
            **kwargs,
        )
        self._mirrors.add(asm.mirror)
        return asm

    # -- requests --------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptLike,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None,
        mirror: PrefixCacheMirror | None = None,
        splice: SplicePlan | None = None,
        logprobs: int | None = None,
    ) -> Completion:
        """Run one request to completion.

        ``prompt``: an :class:`promptsplice.assembler.AssembledPrompt` (its token ids, and its salt
        unless ``cache_salt`` is given), a list of token ids, or a ``str`` (tokenized by
        vLLM's tokenizer like a plain completion prompt).  ``temperature=0`` is greedy.

        ``mirror``: after the request, replay in it what really ran: the prompt's
        blocks plus the blocks that the first ``k - 1`` generated tokens filled (their KV
        is computed and cached too; the last sampled token's is not).  Use it for
        prompts assembled with ``admit=False`` or raw token ids; a prompt assembled with
        ``admit=True`` was already admitted (as a one-token request) and must not be
        admitted twice.  With ``max_tokens=1`` both give the same mirror state.  Replays
        are exact (tested) for requests that end by EOS or ``max_tokens``; a request
        cut by a stop *string* is replayed from the token ids vLLM returns for it.

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
        (the engine keeps serving, with an empty prefix cache: see the module doc), and
        :class:`~promptsplice.errors.EngineDeadError` when the engine died (restarted
        if ``max_restarts`` allows).  A generation cut by ``max_model_len`` is not an
        error: ``finish_reason == "length"``.
        """
        ids, salt, text, predicted = self._normalize(prompt, cache_salt)
        params = self._sampling_params(max_tokens, temperature, stop, self._splice_params(splice), logprobs)
        if mirror is not None and mirror.block_size != self.block_size:
            raise ConfigError(
                f"the mirror's block_size {mirror.block_size} differs from the engine's "
                f"{self.block_size}; build it with engine.make_assembler()"
            )
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the engine's max_model_len is "
                f"{self.max_model_len} (a prompt may hold at most {self.max_model_len - 1}: "
                "one position is left for the first generated token); send fewer or "
                "shorter chunks, or start the engine with a larger max_model_len",
                prompt_tokens=len(ids),
                max_tokens=self.max_model_len,
            )
        if mirror is not None:
            self._mirrors.add(mirror)  # emptied with the cache (reset, failure, restart)
        inputs = self._tokens_input(ids, prompt=text, cache_salt=salt)
        with self._lock:  # the mirror replays requests in the order they ran
            out, ttft, total, rid = self._run(inputs, params)
            gen = list(out.outputs[0].token_ids) if out.outputs else []
            if mirror is not None:
                known = None
                if isinstance(prompt, AssembledPrompt) and prompt.salt == salt and prompt.block_size == self.block_size:
                    known = prompt.block_hashes  # the assembler hashed the prompt already
                predicted = self._admit(mirror, ids, gen, salt, known)
        return Completion(
            text=out.outputs[0].text if out.outputs else "",
            token_ids=gen,
            prompt_token_ids=list(ids),
            prompt_tokens=len(ids),
            num_cached_tokens=int(out.num_cached_tokens or 0),
            ttft_s=ttft,
            total_s=total,
            finish_reason=out.outputs[0].finish_reason if out.outputs else None,
            predicted_cached_tokens=predicted,
            request_id=rid,
            logprobs=_logprob_dicts(out) if logprobs is not None else None,
        )

    def generate_phases(
        self,
        tokens: Sequence[int],
        phases: Sequence[SplicePhase],
        *,
        cache_salt: str | None = None,
        mirror: PrefixCacheMirror | None = None,
        **gen: Any,
    ) -> PhasedRun:
        """Run a multi-phase splice (``plan_phases`` / ``plan_segment_phases``): each
        phase's request is ``tokens[:phase.end]`` with its plan; every phase but the
        last only prefills (``max_tokens=1``), the last takes ``gen`` (``generate``'s
        keyword arguments)."""
        agent = self.kv_connector
        worker = agent.worker if agent is not None else None
        reloc0 = worker.stats.relocated_blocks if worker is not None else 0
        outs: list[Completion] = []
        t_last = time.perf_counter()
        for i, phase in enumerate(phases):
            kwargs = gen if i == len(phases) - 1 else {"max_tokens": 1}  # earlier phases only prefill
            t_last = time.perf_counter()
            outs.append(
                self.generate(
                    list(tokens[: phase.end]), cache_salt=cache_salt, splice=phase.plan or None, mirror=mirror, **kwargs
                )
            )
        if not outs:
            raise InputError("generate_phases needs at least one phase")
        moved = (worker.stats.relocated_blocks - reloc0) * self.block_size if worker is not None else 0
        return PhasedRun(outs, t_last, moved)

    def generate_many(
        self,
        prompts: Iterable[PromptLike],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        cache_salt: str | None = None,
        stop: str | Sequence[str] | None = None,
        mirror: PrefixCacheMirror | None = None,
    ) -> list[Completion]:
        """:meth:`generate` each prompt in order, one after the other (never batched),
        so the cache state each request meets is deterministic."""
        return [
            self.generate(
                p,
                max_tokens=max_tokens,
                temperature=temperature,
                cache_salt=cache_salt,
                stop=stop,
                mirror=mirror,
            )
            for p in prompts
        ]

    def _normalize(
        self, prompt: Any, cache_salt: str | None
    ) -> tuple[list[int], str | None, str | None, int | None]:
        check_salt(cache_salt)
        text: str | None = None
        predicted: int | None = None
        if isinstance(prompt, AssembledPrompt):
            ids = list(prompt.token_ids)
            salt = prompt.salt if cache_salt is None else cache_salt
            if prompt.block_size == self.block_size and salt == prompt.salt:
                predicted = prompt.predicted_cached_tokens
        elif isinstance(prompt, str):
            if not prompt:
                raise InputError("the prompt is empty: pass at least one token of text")
            ids = self._encode_like_vllm(prompt)
            text = prompt
            salt = cache_salt
        elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
            raise InputError(
                f"prompt must be an AssembledPrompt, a list of token ids or a str, got "
                f"{type(prompt).__name__}"
            )
        else:
            ids = []
            for i, tok in enumerate(prompt):
                if isinstance(tok, bool):
                    raise InputError(f"prompt token {i} is a bool, not a token id")
                try:
                    value = operator.index(tok)
                except TypeError as exc:
                    raise InputError(
                        f"prompt token {i} is {type(tok).__name__}, not an int token id"
                    ) from exc
                if value < 0:
                    raise InputError(f"prompt token {i} is negative ({value})")
                ids.append(value)
            salt = cache_salt
        if not ids:
            raise InputError("the prompt is empty: vLLM needs at least one prompt token")
        self._salts.check(salt, stacklevel=4)
        return ids, salt, text, predicted

    def _encode_like_vllm(self, text: str) -> list[int]:
        # vLLM's plain-prompt path: its tokenizer with add_special_tokens=True.
        try:
            return list(self.llm.get_tokenizer().encode(text, add_special_tokens=True))
        except Exception as exc:
            raise TokenizerError(f"vLLM's tokenizer could not encode the prompt: {exc}") from exc

    def _splice_params(self, splice: SplicePlan | None) -> dict[str, Any] | None:
        if splice is None:
            return None
        if not isinstance(splice, SplicePlan):
            raise ConfigError(
                f"splice must be a SplicePlan (plan_deletion / plan_relocation), got "
                f"{type(splice).__name__}"
            )
        if self._config.kv_store is None:
            raise ConfigError(
                "splice plans need the splice connector: start the engine with "
                "kv_store=StoreConfig(...)"
            )
        if splice.block_size != self.block_size:
            raise ConfigError(
                f"the splice plan was made for block_size {splice.block_size}, the engine's "
                f"is {self.block_size}"
            )
        return splice.to_params()

    def _sampling_params(
        self,
        max_tokens: int,
        temperature: float,
        stop: str | Sequence[str] | None,
        kv_transfer_params: dict[str, Any] | None = None,
        logprobs: int | None = None,
    ) -> Any:
        check_int(max_tokens, "max_tokens")
        check_number(temperature, "temperature")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else list(stop)
            if not all(isinstance(s, str) and s for s in stops):
                raise ConfigError(f"stop must be a str or a list of non-empty str, got {stop!r}")
        else:
            stops = None
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < -1):
            raise ConfigError(f"logprobs must be None, -1 (all) or an int >= 0, got {logprobs!r}")
        try:
            return self._SamplingParams(
                max_tokens=max_tokens, temperature=float(temperature), stop=stops, extra_args=extra,
                logprobs=logprobs,
            )
        except Exception as exc:  # vLLM validates its own ranges
            raise ConfigError(f"vLLM refused the sampling options: {exc}") from exc

    def _run(self, inputs: Any, params: Any) -> tuple[Any, float, float, str]:
        engine = self.llm.llm_engine
        rid = f"promptsplice-{next(self._ids)}"
        with installed(self._handle.kv):  # vLLM's worker sees this engine's connector (or none)
            if engine.has_unfinished_requests():  # a leftover from an interrupted call
                self._abort_all(engine)
            return self._step_until_done(engine, rid, inputs, params)

    def _step_until_done(self, engine: Any, rid: str, inputs: Any, params: Any) -> tuple[Any, float, float, str]:
        t0 = time.perf_counter()
        final = None
        ttft: float | None = None
        try:
            try:
                engine.add_request(rid, inputs, params)
            except Exception as exc:
                raise EngineRequestError(f"vLLM refused the request: {type(exc).__name__}: {exc}") from exc
            while final is None:
                if not engine.has_unfinished_requests():
                    raise EngineRequestError(f"vLLM dropped request {rid} without a final output")
                try:
                    outputs = engine.step()
                except Exception as exc:
                    raise self._step_failed(engine, rid, exc) from exc
                now = time.perf_counter()
                for out in outputs:
                    if ttft is None and out.outputs and len(out.outputs[0].token_ids) >= 1:
                        ttft = now - t0
                    if out.finished:
                        final = out
        finally:
            if final is None:
                self._abort_all(engine)
        total = time.perf_counter() - t0
        return final, (total if ttft is None else ttft), total, rid

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
        prompts raise here, engine failures while the generator is advanced.  Each :class:`StreamDelta` carries the text
        and token ids that step produced (vLLM's cumulative output, differenced); the
        last one has ``completion`` set: the whole request as :meth:`generate` returns
        it (vLLM's ``num_cached_tokens``, TTFT, finish reason).  The engine stays
        locked from the first ``next()`` until the generator finishes or is closed, so
        consume it in one thread and close it (or exhaust it) promptly: closing it
        early aborts the request and frees its blocks.
        """
        ids, salt, text, predicted = self._normalize(prompt, cache_salt)
        params = self._sampling_params(max_tokens, temperature, stop)
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the engine's max_model_len is "
                f"{self.max_model_len} (a prompt may hold at most {self.max_model_len - 1}); "
                "send a shorter prompt or start the engine with a larger max_model_len",
                prompt_tokens=len(ids),
                max_tokens=self.max_model_len,
            )
        inputs = self._tokens_input(ids, prompt=text, cache_salt=salt)
        return self._stream_request(inputs, params, ids, predicted)

    def _stream_request(
        self, inputs: Any, params: Any, ids: list[int], predicted: int | None
    ) -> Iterator[StreamDelta]:
        with self._lock:
            engine = self.llm.llm_engine
            rid = f"promptsplice-{next(self._ids)}"
            with installed(self._handle.kv):
                if engine.has_unfinished_requests():  # a leftover from an interrupted call
                    self._abort_all(engine)
                t0 = time.perf_counter()
                final = None
                ttft: float | None = None
                sent_text, sent_ids = "", 0
                try:
                    try:
                        engine.add_request(rid, inputs, params)
                    except Exception as exc:
                        raise EngineRequestError(
                            f"vLLM refused the request: {type(exc).__name__}: {exc}"
                        ) from exc
                    while final is None:
                        if not engine.has_unfinished_requests():
                            raise EngineRequestError(f"vLLM dropped request {rid} without a final output")
                        try:
                            outputs = engine.step()
                        except Exception as exc:
                            raise self._step_failed(engine, rid, exc) from exc
                        now = time.perf_counter()
                        for out in outputs:
                            gen = out.outputs[0] if out.outputs else None
                            if gen is None:
                                continue
                            if ttft is None and len(gen.token_ids) >= 1:
                                ttft = now - t0
                            # cumulative output: send what is new since the last step
                            new_text = gen.text[len(sent_text) :] if gen.text.startswith(sent_text) else ""
                            new_ids = list(gen.token_ids[sent_ids:])
                            if out.finished:
                                final = out
                                break
                            if new_text or new_ids:
                                sent_text += new_text
                                sent_ids += len(new_ids)
                                yield StreamDelta(new_text, new_ids, None)
                finally:
                    if final is None:  # an error, or the consumer closed the stream early
                        self._abort_all(engine)
        total = time.perf_counter() - t0
        gen = final.outputs[0] if final.outputs else None
        full_text = gen.text if gen is not None else ""
        full_ids = list(gen.token_ids) if gen is not None else []
        completion = Completion(
            text=full_text,
            token_ids=full_ids,
            prompt_token_ids=list(ids),
            prompt_tokens=len(ids),
            num_cached_tokens=int(final.num_cached_tokens or 0),
            ttft_s=total if ttft is None else ttft,
            total_s=total,
            finish_reason=gen.finish_reason if gen is not None else None,
            predicted_cached_tokens=predicted,
            request_id=rid,
        )
        # the final step's text (stop strings removed); a stop string can end the text
        # before what was already sent, in which case nothing more is added
        tail = full_text[len(sent_text) :] if full_text.startswith(sent_text) else ""
        yield StreamDelta(tail, full_ids[sent_ids:], completion)

    def _abort_all(self, engine: Any) -> None:
        """Abort whatever is unfinished so the next request meets an idle engine (and the
        blocks it held are freed, as a mirror assumes)."""
        try:
            internal_ids = list(getattr(engine.output_processor, "request_states", {}))
            if internal_ids:
                engine.abort_request(internal_ids, internal=True)
            for _ in range(1000):
                if not engine.has_unfinished_requests():
                    break
                engine.step()
        except Exception:  # best effort: the caller is already handling an error
            pass

    # -- failures ------------------------------------------------------------------------
    def _step_failed(self, engine: Any, rid: str, exc: BaseException) -> EngineError:
        """A step raised: abort, empty the prefix cache, probe; the error to raise.

        The cache must go: vLLM files a block's hash when it allocates the block, before
        the forward pass writes it, so the failed step's blocks would be served later
        with KV that was never computed (a wrong answer, not an error).
        """
        cause = f"{type(exc).__name__}: {exc}"
        self._abort_all(engine)
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

    def _healthy(self, engine: Any) -> bool:
        """One one-token request (it fills no block: nothing enters the cache)."""
        rid = f"promptsplice-probe-{next(self._ids)}"
        try:
            engine.add_request(rid, self._tokens_input([0]), self._SamplingParams(max_tokens=1, temperature=0.0))
            for _ in range(_PROBE_STEPS):
                if any(out.finished for out in engine.step()):
                    return True
                if not engine.has_unfinished_requests():
                    return False
        except Exception:  # noqa: BLE001 - any failure of the probe means dead
            pass
        self._abort_all(engine)
        return False

    def _reset_cache(self) -> bool:
        """Empty vLLM's prefix cache and the mirrors that model it; False if vLLM refused."""
        if not self.llm.reset_prefix_cache():
            return False
        self._clear_mirrors()
        return True

    def _clear_mirrors(self) -> None:
        for m in list(self._mirrors):
            m.clear()

    def _die(self, cause: str) -> EngineDeadError:
        """Shut the dead vLLM down; start a new one if ``max_restarts`` allows."""
        self._clear_mirrors()  # whatever happens next, the old cache is gone
        self._finalizer()
        limit = self._config.max_restarts
        if self._restarts < limit:
            self._restarts += 1
            try:
                self._start()
            except EngineStartError as exc:
                self._dead = f"{cause}; the restart failed: {exc}"
                return EngineDeadError(
                    f"the engine died ({cause}) and could not be restarted ({exc}): start a new EmbeddedEngine",
                    restarted=False,
                )
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

    def _admit(
        self,
        mirror: PrefixCacheMirror,
        ids: list[int],
        gen: list[int],
        salt: str | None,
        known: Sequence[BlockHash] | None = None,
    ) -> int:
        """Replay what ran into ``mirror``; ``known``: the prompt's full-block hashes
        when the caller has them (the chain then continues over the generated tokens)."""
        bs = self.block_size
        computed = len(ids) + max(0, len(gen) - 1)
        tokens = ids + gen[: max(0, len(gen) - 1)]
        if known is None:
            hashes = chain_hashes(tokens, bs, salt=salt)
        else:
            done = len(known) * bs
            parent = known[-1] if known else root_hash(salt)
            hashes = [*known, *chain_hashes(tokens[done:], bs, parent=parent)]
        pred = mirror.admit(hashes, len(ids), num_computed_tokens=computed)
        return pred.cached_tokens

    # -- cache and counters ------------------------------------------------------------
    def counters(self) -> EngineCounters:
        """vLLM's prefix-cache counters of this engine (tokens since start)."""
        return EngineCounters(*_vllm.read_counters(self.llm))

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache and the mirrors of :meth:`make_assembler`'s
        assemblers.  Raises :class:`~promptsplice.errors.EngineError` if vLLM refuses
        (it does while a request holds blocks, which sequential use never leaves)."""
        with self._lock, installed(self._handle.kv):
            if not self._reset_cache():
                raise EngineError(
                    "vLLM refused to reset its prefix cache: a request still holds blocks"
                )

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine down and free its memory (idempotent).

        With other engines alive in the process, only this engine's executor and
        scheduler are shut down: vLLM's full shutdown also destroys the process-wide
        distributed groups that the others still use.
        """
        with self._lock:
            self._finalizer()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.num_blocks} blocks of {self.block_size}"
        return f"EmbeddedEngine({self._config.model!r}, {state})"
