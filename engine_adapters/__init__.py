"""Engine adapters: run the assembled prompts on an inference engine.

``EmbeddedEngine`` starts vLLM in this process (prefix caching on, a bounded KV cache,
eager mode on CPU), sends assembled token ids with their ``cache_salt``, and reports
vLLM's own ``num_cached_tokens`` and TTFT per request; ``make_assembler()`` builds an
``assembler.Assembler`` whose prefix-cache mirror is sized like the engine, so its
predictions equal what vLLM serves.  Importing this package starts nothing and does not
import vLLM; the engine imports it when it starts.
"""

from engine_adapters._config import (
    CPU_BLOCK_MULTIPLE,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    EngineConfig,
)
from engine_adapters._embedded import Completion, EmbeddedEngine, EngineCounters, PromptLike

__all__ = [
    "CPU_BLOCK_MULTIPLE",
    "Completion",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_MAX_MODEL_LEN",
    "EmbeddedEngine",
    "EngineConfig",
    "EngineCounters",
    "PromptLike",
]
