"""Engine adapters: run the assembled prompts on an inference engine.

``EmbeddedEngine`` starts vLLM in this process (prefix caching on, a bounded KV cache,
eager mode on CPU), sends assembled token ids with their ``cache_salt``, and reports
vLLM's own ``num_cached_tokens`` and TTFT per request.  The engine owns the mirror of
its prefix cache and admits every request it ran; ``make_assembler()`` builds an
``promptsplice.assembler.Assembler`` that predicts from that mirror, so its predictions
equal what vLLM serves.

The splice KV connector: ``EngineConfig(kv_store=StoreConfig(...))`` makes the engine
save prefilled KV blocks to a tiered ``BlockStore`` (DRAM, then disk), serve them back
when vLLM's own cache lost them (offload hits), and relocate stored blocks into an edited
prompt: ``generate(new_tokens, splice=plan_deletion(old_tokens, new_tokens, span, ...))``.

``RagRunner`` assembles and runs RAG requests; in mode ``position_independent`` it also
reuses a retrieved chunk's stored KV wherever the chunk lands (relocated after the
prefix hit, found by its content key in a ``ChunkIndex``).

``RemoteEngine`` talks to OpenAI-compatible servers (``vllm serve``, SGLang, OpenAI) over
httpx, sync and async, streaming with client-side TTFT, retries with backoff on 429/5xx,
and reads ``usage.prompt_tokens_details.cached_tokens`` (``None`` when the server does not
report it: unknown, never 0) and the server's ``/metrics`` counters.  Over a ``vllm
serve`` that loads the splice connector, the runners work as on the embedded engine
(plans in ``kv_transfer_params``, the block store asked through store queries).

Importing this package starts nothing and does not import vLLM or torch; the engine
imports them when it starts.
"""

from promptsplice.engine_adapters._config import (
    CPU_BLOCK_MULTIPLE,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    EngineConfig,
)
from promptsplice.engine_adapters._embedded import Completion, EmbeddedEngine, EngineCounters, PromptLike, StreamDelta
from promptsplice.engine_adapters._requests import PhasedRun
from promptsplice.engine_adapters.runners import (
    AgentMode,
    AgentRunner,
    AgentStep,
    ChunkIndex,
    ChunkLookup,
    ChunkSource,
    ChunkStatus,
    FidelityLevel,
    FidelitySettings,
    FIDELITY_TABLE,
    RagRunner,
    RagStep,
    ReuseMode,
    RunnerEngine,
    StepFallback,
)
from promptsplice.engine_adapters._remote import RemoteCompletion, RemoteEngine, ServerCounters
from promptsplice.engine_adapters._router import Lease, PrefixRouter, RoundRobinRouter, prefix_route_key
from promptsplice.engine_adapters.connector import (
    SpliceAck,
    SplicePhase,
    SplicePlan,
    SpliceSegment,
    plan_deletion,
    plan_phases,
    plan_relocation,
    plan_segment_phases,
    kv_transfer_config_json,
)
from promptsplice.engine_adapters.store import (
    BlockRef,
    BlockStore,
    Lookup,
    LookupStatus,
    Namespace,
    PutStatus,
    StoreConfig,
    StoreStats,
    chain_refs,
    shared_store,
)

# Framework integrations import their framework (LangChain ...) on first use only, and
# are not in ``__all__``: a star import would load every framework, and fail without
# the optional ones (``promptsplice.engine_adapters.integrations`` lists them).
_INTEGRATIONS = frozenset(
    {
        "PromptspliceRetriever",
        "PromptspliceCompressor",
        "PromptspliceChatModel",
        "PromptspliceMiddleware",
        "PromptsplicePreModelHook",
        "PromptspliceInputFilter",
    }
)


def __getattr__(name: str):
    if name not in _INTEGRATIONS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from promptsplice.engine_adapters import integrations

    value = getattr(integrations, name)
    globals()[name] = value
    return value


__all__ = [
    "AgentMode",
    "AgentRunner",
    "AgentStep",
    "BlockRef",
    "BlockStore",
    "CPU_BLOCK_MULTIPLE",
    "ChunkIndex",
    "ChunkLookup",
    "ChunkSource",
    "ChunkStatus",
    "Completion",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_MAX_MODEL_LEN",
    "EmbeddedEngine",
    "EngineConfig",
    "EngineCounters",
    "FIDELITY_TABLE",
    "FidelityLevel",
    "FidelitySettings",
    "Lease",
    "Lookup",
    "LookupStatus",
    "Namespace",
    "PrefixRouter",
    "PhasedRun",
    "PromptLike",
    "PutStatus",
    "RagRunner",
    "RagStep",
    "RemoteCompletion",
    "ReuseMode",
    "RemoteEngine",
    "RoundRobinRouter",
    "RunnerEngine",
    "ServerCounters",
    "SpliceAck",
    "SplicePhase",
    "SplicePlan",
    "SpliceSegment",
    "StoreConfig",
    "StoreStats",
    "StepFallback",
    "StreamDelta",
    "chain_refs",
    "kv_transfer_config_json",
    "plan_deletion",
    "plan_phases",
    "plan_relocation",
    "plan_segment_phases",
    "prefix_route_key",
    "shared_store",
]
