"""Framework integrations: LangChain retriever, compressor and chat model; harness hooks
for LangChain agents, LangGraph and the OpenAI Agents SDK.

Each name imports its framework on first use only.
"""

import importlib

_LAZY = {
    "PromptspliceRetriever": "promptsplice.engine_adapters.integrations._langchain_retrieval",
    "PromptspliceCompressor": "promptsplice.engine_adapters.integrations._langchain_retrieval",
    "PromptspliceChatModel": "promptsplice.engine_adapters.integrations._langchain_chat",
    "PromptspliceMiddleware": "promptsplice.engine_adapters.integrations._middleware",
    "PromptsplicePreModelHook": "promptsplice.engine_adapters.integrations._hooks",
    "PromptspliceInputFilter": "promptsplice.engine_adapters.integrations._hooks",
}


_PACKAGES = {"langchain": "langchain>=1.0", "langchain_core": "langchain-core>=1.0"}
"""pip's name of a framework package a lazy name imports."""


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:  # a framework this name needs is not installed
        top = (exc.name or "").partition(".")[0]
        if top not in _PACKAGES:
            raise
        raise ModuleNotFoundError(
            f"{name} needs the {top!r} package, which is not installed: pip install {_PACKAGES[top]!r}",
            name=exc.name,
        ) from exc
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
