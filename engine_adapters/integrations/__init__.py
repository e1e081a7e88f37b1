"""Framework integrations: LangChain retriever, compressor and chat model; harness hooks
for LangChain agents, LangGraph and the OpenAI Agents SDK.

Each name imports its framework on first use only.
"""

import importlib

_LAZY = {
    "PromptspliceRetriever": "promptsplice.engine_adapters.integrations._langchain_retrieval",
    "PromptspliceCompressor": "promptsplice.engine_adapters.integrations._langchain_retrieval",
    "PromptspliceChatModel": "promptsplice.engine_adapters.integrations._langchain_chat",
    "PromptspliceMiddleware": "promptsplice.engine_adapters.integrations._hooks",
    "PromptsplicePreModelHook": "promptsplice.engine_adapters.integrations._hooks",
    "PromptspliceInputFilter": "promptsplice.engine_adapters.integrations._hooks",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
