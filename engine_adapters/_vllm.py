"""Everything that touches vLLM's own objects: the lazy import, reading the prefix-cache
counters, recognizing a too-small KV cache, and shutting an in-process engine down.

vLLM is imported only here and only when an engine is built, so ``import
engine_adapters`` stays cheap.  The adapter runs vLLM's engine core *in this process*
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vLLM is imported unless the user set
it): it starts in ~4 s instead of 13-23 s, and ``LLMEngine.step()`` runs the scheduler
and the forward pass in the caller's thread, so a request's first-token time is
measured without inter-process hops.
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

__all__ = [
    "import_vllm",
    "import_vllm_platform",
    "is_kv_cache_too_small",
    "read_counters",
    "shutdown_llm",
]

_MULTIPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_import_lock = threading.Lock()


def _prepare_env() -> None:
    # Must happen before vLLM reads its environment; the user's choice wins.
    os.environ.setdefault(_MULTIPROC_ENV, "0")


def import_vllm() -> Any:
    """``import vllm`` with the adapter's environment defaults."""
    with _import_lock:
        _prepare_env()
        import vllm

    return vllm


def import_vllm_platform() -> Any:
    """vLLM's ``current_platform`` (imports torch and vllm.platforms, not the engine)."""
    with _import_lock:
        _prepare_env()
        from vllm.platforms import current_platform

    return current_platform


# vLLM raises a plain ValueError from kv_cache_utils._check_enough_kv_cache_memory when
# the KV cache cannot hold one request of max_model_len tokens (or is empty).
_KV_TOO_SMALL_MARKERS = (
    "KV cache is needed, which is larger than the available KV cache memory",
    "No available memory for the cache blocks",
)


def is_kv_cache_too_small(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, ValueError) and any(m in text for m in _KV_TOO_SMALL_MARKERS)


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
            if client is not None:
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
