"""Runners: what turns an application's request into engine requests (RAG, agent)."""

from promptsplice.engine_adapters.runners._agent import AgentMode, AgentRunner, AgentStep
from promptsplice.engine_adapters.runners._fidelity import (
    DEFAULT_MAX_DEVIATION,
    DEFAULT_RUN_MAX_DEVIATION,
    FIDELITY_TABLE,
    FidelityLevel,
    FidelitySettings,
)
from promptsplice.engine_adapters.runners._chunk_plans import ChunkIndex, ChunkLookup, ChunkSource, ChunkStatus
from promptsplice.engine_adapters.runners._rag import RagRunner, RagStep, ReuseMode
from promptsplice.engine_adapters.runners._steps import RunnerEngine, StepFallback

__all__ = [
    "DEFAULT_MAX_DEVIATION",
    "DEFAULT_RUN_MAX_DEVIATION",
    "AgentMode",
    "AgentRunner",
    "AgentStep",
    "ChunkIndex",
    "ChunkLookup",
    "ChunkSource",
    "ChunkStatus",
    "FIDELITY_TABLE",
    "FidelityLevel",
    "FidelitySettings",
    "RagRunner",
    "RagStep",
    "ReuseMode",
    "RunnerEngine",
    "StepFallback",
]
