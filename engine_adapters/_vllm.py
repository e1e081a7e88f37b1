"""Everything that touches vLLM's own objects, in one module: the lazy import and its
environment, the engine's geometry, requests (sampling parameters, token inputs,
aborts), the worker-side KV connector slot, reading the prefix-cache counters,
checking ``extra_kwargs`` against vLLM's arguments, recognizing a KV cache too small
(or larger than the machine), and shutting an in-process engine down.

vLLM is imported only here and only when an engine is built, so ``import
engine_adapters`` stays cheap.  The adapter runs vLLM's engine core *in this process*
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vLLM is imported unless the user set
it): it starts in seconds instead of 13-23 s, and ``LLMEngine.step()`` runs the
scheduler and the forward pass in the caller's thread, so a request's first-token time
is measured without inter-process hops.

vLLM's logs: by default vLLM prints ~90 INFO lines per engine start on *stdout*.  The
adapter sends them to stderr and keeps only warnings and errors
(``VLLM_LOGGING_STREAM`` / ``VLLM_LOGGING_LEVEL``, set before vLLM is imported unless
the user set them; vLLM reads them when it configures its logging, at each engine
start, and :func:`quiet_logs` re-applies them after the start).  ``PROMPTSPLICE_VLLM_LOGS=1`` keeps vLLM's INFO lines (or name a
level: ``debug``, ``info``, ``warning``, ``error``), still on stderr.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_log = logging.getLogger(__name__)

__all__ = [
    "AgentBox",
    "abort_all",
    "agent_installed",
    "completion_text",
    "detach_vllm_finalizer",
    "device_type",
    "engine_geometry",
    "import_vllm",
    "import_vllm_platform",
    "is_kv_cache_too_small",
    "is_kv_cache_over_memory",
    "check_engine_kwargs",
    "make_sampling_params",
    "quiet_logs",
    "read_counters",
    "request_limits",
    "validation_parameter",
    "shutdown_llm",
    "tokens_input",
    "vllm_log_level",
]

_MULTIPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
LOGS_ENV = "PROMPTSPLICE_VLLM_LOGS"
_import_lock = threading.Lock()
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def vllm_log_level() -> str:
    """The level vLLM logs at: ``VLLM_LOGGING_LEVEL`` if the user set it, else from
    ``PROMPTSPLICE_VLLM_LOGS`` (unset, ``0``: ``WARNING``; ``1``: ``INFO``; a level name)."""
    user = os.environ.get("VLLM_LOGGING_LEVEL")
    if user and not _set_level_here:
        return user.upper()
    switch = os.environ.get(LOGS_ENV, "").strip().upper()
    if switch in ("", "0", "FALSE", "NO", "OFF"):
        return "WARNING"
    if switch in ("1", "TRUE", "YES", "ON"):
        return "INFO"
    if switch in _LEVELS:
        return switch
    from promptsplice.errors import ConfigError

    raise ConfigError(
        f"{LOGS_ENV}={os.environ[LOGS_ENV]!r}: use 1 (vLLM's INFO logs), 0 (warnings only, the "
        f"default) or a level name ({', '.join(lvl.lower() for lvl in _LEVELS)})"
    )


_set_level_here = False  # VLLM_LOGGING_LEVEL came from _prepare_env, not the user


def check_in_process(platform: str | None = None) -> None:
    """The embedded engine runs vLLM's engine core in this process: a user's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` put it in a child, where the connector, its
    store and the shutdown of :func:`shutdown_llm` cannot reach it (silently).  On CPU,
    vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE`` replaces the KV cache size the config
    sets (the engine ran with another size than ``kv_cache_bytes`` said)."""
    from promptsplice.errors import ConfigError

    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if platform == "cpu" and space != "":
        raise ConfigError(f"VLLM_CPU_KVCACHE_SPACE={space!r} replaces EngineConfig.kv_cache_bytes on CPU "
                          "(vLLM's legacy setting): unset it for EmbeddedEngine and set kv_cache_bytes")
    value = os.environ.get(_MULTIPROC_ENV, "0")
    try:  # vLLM reads it as bool(int(value)) (envs.py): "", "false" failed its start, unnamed
        in_process = int(value) == 0
    except ValueError:
        raise ConfigError(f"{_MULTIPROC_ENV}={value!r} is not an int, which vLLM reads it as; set it to 0 "
                          "or unset it for EmbeddedEngine") from None
    if not in_process:
        raise ConfigError(f"{_MULTIPROC_ENV}={value!r}: the embedded engine runs vLLM in this process; "
                          f"unset it (or set it to 0) for EmbeddedEngine (vllm serve runs its own processes)")


def _prepare_env() -> None:
    # Must happen before vLLM reads its environment; the user's choice wins.
    global _set_level_here
    os.environ.setdefault(_MULTIPROC_ENV, "0")
    level = vllm_log_level()
    if "VLLM_LOGGING_LEVEL" not in os.environ or _set_level_here:
        os.environ["VLLM_LOGGING_LEVEL"] = level
        _set_level_here = True
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def quiet_logs() -> None:
    """Apply the log level to vLLM's logger and move its stdout handlers to stderr
    (after an engine start, which reconfigures vLLM's logging)."""
    logger = logging.getLogger("vllm")
    logger.setLevel(vllm_log_level())
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def import_vllm() -> Any:
    """``import vllm`` with the adapter's environment defaults."""
    with _import_lock, _naming_the_extra():
        _prepare_env()
        import vllm

    return vllm


def import_vllm_platform() -> Any:
    """vLLM's ``current_platform`` (imports torch and vllm.platforms, not the engine)."""
    with _import_lock, _naming_the_extra():
        _prepare_env()
        from vllm.platforms import current_platform

    return current_platform


@contextmanager
def _naming_the_extra() -> Iterator[None]:
    """A missing vLLM (the ``[engine]`` install: vLLM comes with ``[cpu]`` or ``[gpu]``)
    is a ``ModuleNotFoundError`` that names the extra, as the integrations' are; it
    escaped as ``No module named 'vllm'``."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("vllm", "torch"):
            raise
        raise ModuleNotFoundError(
            f"the embedded engine needs vLLM, which this install lacks ({exc}): pip install "
            "'promptsplice[cpu]' (or [gpu] on CUDA), or use RemoteEngine with a vllm serve", name=exc.name
        ) from exc


def device_type() -> str:
    """vLLM's device type for this machine (``"cpu"``, ``"cuda"``, ...)."""
    return import_vllm_platform().device_type


def engine_geometry(llm: Any) -> tuple[int, int, int]:
    """``(num_gpu_blocks, block_size, max_model_len)`` of a started ``vllm.LLM``."""
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    return int(cache.num_gpu_blocks), int(cache.block_size), int(config.model_config.max_model_len)


def model_context_len(llm: Any) -> int:
    """The loaded model's own context length as vLLM derives it from its config
    (``max_position_embeddings`` with RoPE scaling), whatever the engine was started with."""
    return int(llm.llm_engine.vllm_config.model_config.get_and_verify_max_len(None))


# -- requests ------------------------------------------------------------------------
def request_limits(llm: Any) -> tuple[int, int, int]:
    """``(max_logprobs, vocab_size, max_token_id)`` of a started ``vllm.LLM``, as vLLM's
    own request checks read them: ``SamplingParams._validate_logprobs`` (``max_logprobs``
    of the model config, ``-1`` resolved to the model's vocabulary size; a request's
    ``logprobs=-1`` counts as the vocabulary size) and ``BaseRenderer.validate_token_ids``
    (a prompt id above the larger of the tokenizer's ``max_token_id`` and the model's
    last vocabulary id is out of vocabulary)."""
    engine = llm.llm_engine
    model_config = engine.vllm_config.model_config
    vocab = int(model_config.get_vocab_size())
    max_logprobs = int(model_config.max_logprobs)
    if max_logprobs == -1:
        max_logprobs = vocab
    tokenizer = getattr(getattr(engine, "renderer", None), "tokenizer", None)
    tok_max = int(tokenizer.max_token_id) if tokenizer is not None else -1
    return max_logprobs, vocab, max(tok_max, vocab - 1)


def validation_parameter(exc: BaseException) -> str | None:
    """For vLLM's ``VLLMValidationError`` (a request vLLM refused as invalid): the
    parameter it names (``""`` when it names none); ``None`` for any other exception."""
    from vllm.exceptions import VLLMValidationError

    if not isinstance(exc, VLLMValidationError):
        return None
    return exc.parameter or ""


def make_sampling_params(
    *,
    max_tokens: int,
    temperature: float,
    stop: list[str] | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    logprobs: int | None = None,
) -> Any:
    """``vllm.SamplingParams``; ``kv_transfer_params`` reach the KV connector as
    ``request.kv_transfer_params`` (through ``extra_args``).  vLLM's own range checks
    raise as vLLM raises them.

    With ``logprobs`` and no stop strings, vLLM does not detokenize (``detokenize=False``):
    it would turn every one of the ``k`` logprob token ids of every step into a string
    (most of a full-vocabulary probe's time on a CPU).  The caller then takes
    the text from :func:`completion_text` (vLLM's own detokenizer, run once over the
    output ids: the same text).  Stop strings need vLLM's detokenizer while it runs."""
    from vllm import SamplingParams

    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, stop=stop, extra_args=extra, logprobs=logprobs,
        detokenize=logprobs is None or bool(stop),
    )


def completion_text(engine: Any, request_id: str, prompt_ids: Sequence[int], params: Any, output: Any) -> str:
    """The text of a finished ``CompletionOutput``: vLLM's own, or, where ``params`` did
    not detokenize (``make_sampling_params``), the text vLLM would have returned: its
    incremental detokenizer for the engine's tokenizer, primed with the prompt and fed
    the output ids, a final stop token (EOS or a stop token id: ``finish_reason ==
    "stop"`` with no stop *string* as ``stop_reason``) left out and an unfinished UTF-8
    sequence held back, as vLLM does."""
    if params.detokenize:
        return output.text
    from types import SimpleNamespace

    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    tokenizer = engine.output_processor.tokenizer
    if tokenizer is None or not output.token_ids:  # an engine started with skip_tokenizer_init
        return ""
    # the detokenizer reads the stop strings and special-token options, never detokenize
    request = SimpleNamespace(request_id=request_id, sampling_params=params,
                              prompt_token_ids=list(prompt_ids), prompt_embeds=None)
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    stop_token = output.finish_reason == "stop" and not isinstance(output.stop_reason, str)
    detokenizer.update(list(output.token_ids), stop_token)
    return detokenizer.get_next_output_text(finished=True, delta=False)


def tokens_input(ids: Sequence[int], *, prompt: str | None = None, cache_salt: str | None = None) -> Any:
    """vLLM's input for a prompt given as token ids (with its ``cache_salt``)."""
    from vllm.inputs.engine import tokens_input as make

    return make(list(ids), prompt=prompt, cache_salt=cache_salt)


def abort_all(engine: Any) -> None:
    """Abort every unfinished request of ``LLMEngine`` and step until it is idle, so
    their blocks are freed (best effort: callers are already handling an error)."""
    try:
        internal_ids = list(getattr(engine.output_processor, "request_states", {}))
        if internal_ids:
            engine.abort_request(internal_ids, internal=True)
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
    except Exception:  # noqa: BLE001 - best effort, but said: blocks may stay held
        _log.warning("could not abort every unfinished vLLM request; their KV blocks may stay "
                     "held until the engine is closed", exc_info=True)


# -- the worker-side KV connector slot -----------------------------------------------
# vLLM keeps the worker-side KV connector in one module global
# (``vllm.distributed.kv_transfer.kv_transfer_state._KV_CONNECTOR_AGENT``), created once
# per *process* and read by every model runner in it.  With several in-process engines
# that is wrong twice (measured on vllm-cpu 0.32.0): while an engine with a connector
# lives, an engine *without* one fails every request (its model runner sees the global
# connector and asserts on its missing metadata); and a second engine with a connector
# would reuse the first one's worker connector, whose registered KV caches are the
# first engine's.  So each engine owns an agent (``None`` without a connector), captured
# right after its start, and installs it in the slot for each vLLM call of its start,
# requests and shutdown, under one process-wide lock (in-process engines also share
# vLLM's global forward context, so they never run concurrently), never across a paused
# stream's yield (until 2026-12-07 it was: two engines' streams resumed in two threads
# each adopted it and stepped at once, each reading the other's connector).
class PassingRLock:
    """A re-entrant lock whose holder may move to another thread: a stream's generator,
    paused in one thread and advanced or closed in another (Starlette's
    ``iterate_in_threadpool`` runs each ``next()`` in a pool thread), releases what it
    took.  With ``threading.RLock`` that release raised ``RuntimeError`` and the lock
    stayed owned by the first thread: every engine of the process then hung, ``close()``
    and exit too.  :meth:`adopt` makes the current thread the holder (a resumed stream
    calls it, so a call of that thread re-enters instead of waiting on itself)."""

    __slots__ = ("_lock", "_guard", "_owner", "_count")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # any thread may release a Lock
        self._guard = threading.Lock()
        self._owner: int | None = None
        self._count = 0

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._guard:
            if self._count and self._owner == me:
                self._count += 1
                return True
        self._lock.acquire()
        with self._guard:
            self._owner, self._count = me, 1
        return True

    def release(self) -> None:
        with self._guard:
            if not self._count:
                raise RuntimeError("release of a PassingRLock that is not held")
            self._count -= 1
            if self._count:
                return
            self._owner = None
        self._lock.release()

    def adopt(self) -> None:
        """The current thread holds the lock now (it must be held)."""
        with self._guard:
            if self._count:
                self._owner = threading.get_ident()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


_agent_lock = PassingRLock()


class AgentBox:
    """Holds one engine's worker-side connector (or ``None``)."""

    __slots__ = ("agent",)

    def __init__(self, agent: Any = None) -> None:
        self.agent = agent


@contextmanager
def agent_installed(box: AgentBox, *, capture: bool = False) -> Iterator[None]:
    """Install ``box.agent`` in vLLM's slot for the block, then put the previous one back.

    ``capture``: after the block, keep what the slot then holds in ``box`` (used around
    an engine's start, which creates its agent, and its shutdown, which destroys it).
    """
    from vllm.distributed.kv_transfer import kv_transfer_state as state

    with _agent_lock:
        previous = state._KV_CONNECTOR_AGENT
        state._KV_CONNECTOR_AGENT = box.agent
        try:
            yield
        finally:
            if capture:
                box.agent = state._KV_CONNECTOR_AGENT
            state._KV_CONNECTOR_AGENT = previous


# vLLM raises a plain ValueError from kv_cache_utils._check_enough_kv_cache_memory when
# the KV cache cannot hold one request of max_model_len tokens (or is empty).
_KV_TOO_SMALL_MARKERS = (
    "KV cache is needed, which is larger than the available KV cache memory",
    "No available memory for the cache blocks",
    "Cannot auto-fit max_model_len",  # max_model_len=-1 and not even one block fits
)


def is_kv_cache_too_small(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, ValueError) and any(m in text for m in _KV_TOO_SMALL_MARKERS)


def is_kv_cache_over_memory(exc: BaseException) -> bool:
    """vllm-cpu's refusal of a ``kv_cache_memory_bytes`` above the NUMA node's free
    memory (``CPUWorker.determine_available_memory``: "Decrease --kv-cache-memory-bytes")."""
    return isinstance(exc, ValueError) and "less than requested memory for kv" in str(exc)


def check_engine_kwargs(kwargs: Any, what: str = "extra_kwargs") -> None:
    """:class:`ConfigError` for a key that neither ``vllm.LLM`` nor vLLM's ``EngineArgs``
    takes (a typo failed the start as a ``TypeError``, "vLLM could not start"), with the
    closest names."""
    import dataclasses
    import difflib
    import inspect

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from promptsplice.errors import ConfigError

    params = inspect.signature(LLM.__init__).parameters.values()
    known = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
    known |= {f.name for f in dataclasses.fields(EngineArgs) if f.init}
    for key in kwargs:
        if not isinstance(key, str):
            raise ConfigError(f"{what} keys must be str (vllm.LLM keyword arguments), got {key!r}")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "see vLLM's EngineArgs for its options"
            raise ConfigError(f"{what} sets {key!r}, which vllm.LLM does not take (neither its argument nor an "
                              f"EngineArgs field of vLLM {_version()}): {hint}")


def _version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


_COUNTER_ATTRS = (
    "counter_prefix_cache_queries",
    "counter_prefix_cache_hits",
    "counter_connector_prefix_cache_queries",
    "counter_connector_prefix_cache_hits",
)
_METRIC_NAMES = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
)


def _prometheus_logger(llm: Any) -> Any | None:
    manager = getattr(llm.llm_engine, "logger_manager", None)
    for stat_logger in getattr(manager, "stat_loggers", ()):
        if hasattr(stat_logger, _COUNTER_ATTRS[0]):
            return stat_logger
    return None


def _counter_value(per_engine: Any) -> int:
    if not per_engine:
        return 0
    child = per_engine[min(per_engine)] if isinstance(per_engine, dict) else per_engine
    total = 0.0
    for metric in child.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                total += sample.value
    return int(total)


def read_counters(llm: Any) -> tuple[int, int, int, int]:
    """(queries, hits, external queries, external hits) in tokens, of *this* engine.

    ``LLM.get_metrics()`` reads prometheus' process-wide registry, and every new vLLM
    engine unregisters the previous engine's metrics there (measured: with two engines
    in one process, the first one's ``get_metrics()`` shows the second one's counts).
    So the counters are read from the engine's own Prometheus stat logger, whose
    counter objects keep counting after they leave the registry; ``get_metrics()`` is
    the fallback where that logger is not found.
    """
    prom = _prometheus_logger(llm)
    if prom is not None:
        return tuple(_counter_value(getattr(prom, a, None)) for a in _COUNTER_ATTRS)  # type: ignore[return-value]
    values = dict.fromkeys(_METRIC_NAMES, 0)
    for metric in llm.get_metrics():
        if metric.name in values:
            values[metric.name] += int(getattr(metric, "value", 0))
    return tuple(values[n] for n in _METRIC_NAMES)  # type: ignore[return-value]


def detach_vllm_finalizer(llm: Any) -> None:
    """Stop vLLM's own GC finalizer from tearing down process-wide state.

    In-process, vLLM's ``InprocClient`` shuts its engine core down when collected, and
    that shutdown destroys the process's torch.distributed groups, which every other
    in-process engine still uses (measured: after closing a second engine the first one
    fails with "pipeline model parallel group is not initialized").  The adapter's own
    finalizer (:func:`shutdown_llm`) tears that state down only with the last engine.
    """
    client = getattr(llm.llm_engine, "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def shutdown_llm(llm: Any, *, last_engine: bool) -> None:
    """Shut an in-process vLLM engine down.

    ``last_engine``: no other engine lives in this process, so the full shutdown
    (which also destroys the distributed groups) is safe.  Otherwise only this engine's
    executor, scheduler and structured-output backend are shut down.
    """
    client = getattr(llm.llm_engine, "engine_core", None)
    try:
        if last_engine:
            # the core itself: the client's shutdown() runs only while its finalizer is
            # attached, and detach_vllm_finalizer detached it (nothing was shut down:
            # start-up memory stayed gc-frozen, the KV-event publisher kept its socket)
            core = getattr(client, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            elif client is not None:
                client.shutdown()
            return
        core = getattr(client, "engine_core", None)
        if core is None:
            return
        som = getattr(core, "structured_output_manager", None)
        if som is not None:
            som.clear_backend()
        if getattr(core, "model_executor", None) is not None:
            core.model_executor.shutdown()
        if getattr(core, "scheduler", None) is not None:
            core.scheduler.shutdown()
        # EngineCore.__init__ gc.freeze()s start-up objects; let them be collected.
        gc.unfreeze()
    finally:
        gc.collect()


# ---------------------------------------------------------------- the splice connector
# vLLM internals the connector (``engine_adapters/connector``) reads beyond the public
# ``KVConnectorBase_V1`` API it subclasses.

__all__ += [
    "allocated_block_ids",
    "attention_layers",
    "bound_block_ids",
    "cpu_attn_isa",
    "request_fields",
    "request_identity",
    "plain_prefix_tokens",
    "scheduled_steps",
    "is_quantized_cache",
    "preempted_ids",
]


def is_quantized_cache(cache_dtype: str) -> bool:
    """Whether vLLM stores this ``kv_cache_dtype`` quantized (fp8, nvfp4, per-token-head
    scales: its own ``is_quantized_kv_cache``); the connector serves none of them."""
    from vllm.utils.torch_utils import is_quantized_kv_cache

    return bool(is_quantized_kv_cache(cache_dtype))


def cpu_attn_isa(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The CPU attention ISA vLLM picks for these settings (its own
    ``cpu_attn._get_attn_isa``, the ground truth inside the engine)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from promptsplice.errors import ConfigError

    try:
        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except NotImplementedError as exc:
        raise ConfigError(f"vLLM's CPU attention refuses these KV cache settings: {exc}") from exc


def attention_layers(vllm_config: Any, layer_names: Any) -> dict[str, tuple[str, str | None]]:
    """``{layer: (attention backend name, CPU attention ISA or None)}`` of the given KV
    cache layers, read from the compilation config's forward context (the ISA is set on
    each layer by ``CPUAttentionMetadataBuilder``; ``None`` where it is not set yet)."""
    from promptsplice.errors import ConfigError

    ctx = vllm_config.compilation_config.static_forward_context
    out: dict[str, tuple[str, str | None]] = {}
    for name in layer_names:
        layer = ctx.get(name)
        get_backend = getattr(layer, "get_attn_backend", None)
        if get_backend is None:
            raise ConfigError(f"KV cache layer {name!r} is not an attention layer vLLM registered")
        isa = getattr(layer, "isa", None)
        out[name] = (str(get_backend().get_name()), None if isa is None else str(isa))
    return out


def request_fields(request: Any) -> tuple[str, Any, str | bytes | None, Any]:
    """``(request_id, prompt_token_ids, cache_salt, kv_transfer_params)`` of a scheduler
    ``Request``."""
    return request.request_id, request.prompt_token_ids, request.cache_salt, request.kv_transfer_params


def request_identity(request: Any) -> str | None:
    """What besides its tokens and salt a scheduler ``Request``'s KV depends on, as vLLM's
    block hashes key it (``kv_cache_utils``' extra keys): its LoRA adapter (name and
    path), its multimodal inputs (their hashes and placeholder offsets), prompt
    embeddings (the request id: never shared).  ``None`` for a plain text request.
    Encoded as JSON, so no name holding a separator can spell another's fields (an
    adapter ``x`` at ``y@/p`` and ``x@y`` at ``/p`` were one identity: one adapter's KV
    served to the other), as vLLM keys them by tuples."""
    parts: list[list[Any]] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        parts.append(["lora", str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", ""))])
    for f in getattr(request, "mm_features", None) or ():
        ident = getattr(f, "identifier", None)
        pos = getattr(getattr(f, "mm_position", None), "offset", None)
        parts.append(["mm", str(ident), pos if isinstance(pos, int) else str(pos)] if ident
                     else ["mm-unnamed", str(request.request_id)])
    if getattr(request, "prompt_embeds", None) is not None:
        parts.append(["embeds", str(request.request_id)])
    return json.dumps(parts, separators=(",", ":"), ensure_ascii=True) if parts else None


def plain_prefix_tokens(request: Any) -> int:
    """How many leading tokens of a scheduler ``Request`` vLLM hashes as a plain
    request's: up to its first multimodal input when that is all that sets it apart
    (a LoRA adapter or prompt embeddings key every block); 0 for those, and for a plain
    request its whole prompt is its own chain anyway."""
    if getattr(request, "lora_request", None) or getattr(request, "prompt_embeds", None) is not None:
        return 0
    offsets = [getattr(getattr(f, "mm_position", None), "offset", None)
               for f in getattr(request, "mm_features", None) or ()]
    offsets = [o for o in offsets if isinstance(o, int)]
    return max(0, min(offsets)) if offsets else 0


def allocated_block_ids(blocks: Any) -> list[int]:
    """The block ids of ``KVCacheBlocks`` (the single KV cache group's)."""
    return list(blocks.get_block_ids()[0])


def scheduled_steps(scheduler_output: Any) -> tuple[list[tuple[str, int, int]], dict[str, list[int]]]:
    """A ``SchedulerOutput`` as ``(req_id, num_computed_tokens, num_scheduled_tokens)``
    per scheduled request (new ones first, computed tokens *before* this step) and the
    new requests' block ids (all of them, the local prefix-cache hit's included)."""
    scheduled = scheduler_output.num_scheduled_tokens
    new = scheduler_output.scheduled_new_reqs
    steps = [(r.req_id, r.num_computed_tokens, scheduled.get(r.req_id, 0)) for r in new]
    cached = scheduler_output.scheduled_cached_reqs
    steps += [(rid, computed, scheduled.get(rid, 0)) for rid, computed in zip(cached.req_ids, cached.num_computed_tokens)]
    return steps, {r.req_id: list(r.block_ids[0]) for r in new}


def preempted_ids(scheduler_output: Any) -> frozenset[str]:
    """The requests vLLM preempted in this ``SchedulerOutput`` (their blocks freed)."""
    return frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ())


def bound_block_ids(connector: Any, req_id: str) -> list[int]:
    """A running request's block ids, from the KV cache manager vLLM bound to a
    scheduler-side connector (``KVConnectorBase_V1._kv_cache_manager``)."""
    from promptsplice.errors import EngineError

    manager = connector._kv_cache_manager
    if manager is None:
        raise EngineError("vLLM bound no KV cache manager to the splice connector (vLLM's API changed?)")
    return list(manager.get_block_ids(req_id)[0])


def connector_num_blocks(connector: Any) -> int:
    """The KV cache's block count a connector was built for (``num_gpu_blocks``: the
    ``KVCacheConfig`` vLLM passes to ``KVConnectorBase_V1``); 0 when vLLM gave none."""
    config = getattr(connector, "_kv_cache_config", None)
    return int(getattr(config, "num_blocks", 0) or 0)
