"""The public surface of each package is explicit, and dependencies point one way."""

from __future__ import annotations

from promptsplice import assembler
from promptsplice import dedup

from tests._imports import rooms_after

ASSEMBLER_API = [
    "AlignPolicy",
    "AssembledPrompt",
    "Assembler",
    "BlockState",
    "DEFAULT_CAPACITY_BLOCKS",
    "HFTokenizer",
    "MirrorView",
    "NaivePrompt",
    "OrderPolicy",
    "PopularityTracker",
    "Prediction",
    "PrefixCacheMirror",
    "PromptFormat",
    "Segment",
    "SegmentKind",
    "TiktokenTokenizer",
    "TokenCache",
    "TokenCacheStats",
    "Tokenizer",
    "assemble_prompt",
    "default_tokenizer",
    "load_tokenizer",
    "same_tokenizer",
    # agent context (render -> directives, policies, hook)
    "ChatRenderer",
    "ChatTemplate",
    "ContextHook",
    "ContextPolicy",
    "Diff",
    "DiffKind",
    "Directive",
    "DropFailedCalls",
    "EditKind",
    "FallbackReason",
    "MessageEdit",
    "MessageSegment",
    "PolicyResult",
    "PreparedContext",
    "Relocation",
    "Render",
    "StepKind",
    "SummarizeTurns",
    "TruncateToolOutputs",
    "apply_diff",
    "apply_directives",
    "diff_renders",
    "is_error_output",
    "summarize_turns",
]


def test_assembler_exports_are_pinned():
    assert sorted(assembler.__all__) == sorted(ASSEMBLER_API)
    for name in ASSEMBLER_API:
        assert getattr(assembler, name) is not None
    from promptsplice.assembler import assemble_prompt  # noqa: F401 - the documented entry point


def test_every_error_comes_from_one_hierarchy():
    from promptsplice import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        root = errors.PromptspliceWarning if issubclass(cls, Warning) else errors.PromptspliceError
        assert issubclass(cls, root)
    assert issubclass(errors.UnsaltedTenantWarning, errors.PromptspliceWarning)




def test_assembler_is_light_and_never_imports_the_engine_side():
    rooms = rooms_after("import promptsplice.assembler")
    heavy = {
        "vllm", "torch", "promptsplice.engine_adapters", "promptsplice.kernels", "promptsplice.benchmarks",
        "tokenizers", "tiktoken", "transformers", "langchain_core", "numpy",
    }
    assert not rooms & heavy


def test_engine_adapters_imports_no_engine_or_framework_until_used():
    mods = rooms_after("import promptsplice.engine_adapters")
    assert not mods & {"vllm", "torch", "langchain_core", "langchain", "langgraph", "agents", "promptsplice.benchmarks"}
    lazy = rooms_after("import promptsplice.engine_adapters as e; e.PromptspliceRetriever")
    assert "langchain_core" in lazy
    # a star import loaded every framework (and failed without the optional ones): the
    # lazy names are the integrations room's, reached by attribute here
    star = rooms_after("from promptsplice.engine_adapters import *")
    assert not star & {"vllm", "torch", "langchain_core", "langchain", "langgraph", "agents"}
    from promptsplice.engine_adapters import integrations

    assert set(integrations.__all__) <= set(dir(integrations)) | set(integrations._LAZY)


def test_dedup_is_a_leaf():
    mods = rooms_after("import promptsplice.dedup")
    assert not mods & {
        "promptsplice.assembler", "promptsplice.engine_adapters", "promptsplice.kernels",
        "promptsplice.benchmarks", "torch", "numpy", "langchain_core",
    }
    assert dedup.__all__


def test_engine_adapters_exports_are_pinned():
    from promptsplice import engine_adapters

    assert sorted(engine_adapters.__all__) == sorted(
        [
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
            "RemoteEngine",
            "ReuseMode",
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
    )
    for name in engine_adapters.__all__:
        # DEFAULT_MAX_MODEL_LEN is None by design: "the model's own context length"
        assert hasattr(engine_adapters, name)
        assert getattr(engine_adapters, name) is not None or name == "DEFAULT_MAX_MODEL_LEN"


# kernels.__all__ is pinned in tests/kernels/test_api.py (tests mirror the source tree).


def test_policy_names_parse_with_a_helpful_error():
    import pytest

    from promptsplice.assembler import AlignPolicy, OrderPolicy
    from promptsplice.errors import UnknownPolicyError

    assert OrderPolicy.parse("cache_aware") is OrderPolicy.CACHE_AWARE
    assert AlignPolicy.parse(AlignPolicy.ALL) is AlignPolicy.ALL
    with pytest.raises(UnknownPolicyError, match="retrieval, stable, cache_aware"):
        OrderPolicy.parse("fastest")
    # the one enum rule (value or name, any case), as RagRunner's mode and every option
    assert OrderPolicy.parse("CACHE_AWARE") is OrderPolicy.parse(" Cache_Aware ") is OrderPolicy.CACHE_AWARE
    assert AlignPolicy.parse("None") is AlignPolicy.NONE
    with pytest.raises(UnknownPolicyError):
        OrderPolicy.parse(3)
