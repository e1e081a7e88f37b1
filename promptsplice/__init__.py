"""promptsplice: prompt assembly that makes the engine's prefix cache hit.

The front door is :func:`assemble_prompt` (``from promptsplice import assemble_prompt``).
The rooms install under this namespace: :mod:`promptsplice.dedup` (byte-exact chunk
dedup, a leaf), :mod:`promptsplice.assembler` (token-space assembly, agent context),
:mod:`promptsplice.engine_adapters` (vLLM embedded and served, the splice connector, the
tiered block store, runners, framework integrations), :mod:`promptsplice.kernels` (the
RoPE splice kernel) and :mod:`promptsplice.benchmarks` (benches and the CLI, on top).
This module itself is the bottom of the house: :mod:`promptsplice.errors` and
:mod:`promptsplice.blocks` import nothing above them, and the front-door names below are
resolved on first use, so ``import promptsplice.errors`` stays light.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("promptsplice")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# The front door: names re-exported from the assembler, imported on first use.
_FRONT_DOOR = {
    "assemble_prompt": "promptsplice.assembler",
    "Assembler": "promptsplice.assembler",
    "AssembledPrompt": "promptsplice.assembler",
    "PromptFormat": "promptsplice.assembler",
    "ContextHook": "promptsplice.assembler",
}


def __getattr__(name: str):
    module = _FRONT_DOOR.get(name)
    if module is None:
        raise AttributeError(f"module 'promptsplice' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["AssembledPrompt", "Assembler", "ContextHook", "PromptFormat", "__version__", "assemble_prompt"]
