"""Token-space prompt assembly that makes the engine's prefix cache hit.

``assemble_prompt(chunks, query=...)`` dedups retrieved chunks (:mod:`dedup`), orders
them canonically (``stable``) or by what the cache holds (``cache_aware``), tokenizes
each segment once (bounded token cache), pads segment ends to KV block boundaries where
that pays (``auto``), and predicts the cached tokens with a mirror of the engine's
prefix cache.  This package never imports vLLM or the engine adapters, and it imports
tokenizer backends only when a tokenizer is loaded.
"""

from assembler._assemble import (
    DEFAULT_CAPACITY_BLOCKS,
    AssembledPrompt,
    Assembler,
    NaivePrompt,
    PromptFormat,
    assemble_prompt,
)
from assembler._layout import Segment, SegmentKind
from assembler._mirror import BlockState, Prediction, PrefixCacheMirror
from assembler._ordering import AlignPolicy, OrderPolicy, PopularityTracker
from assembler._token_cache import TokenCache, TokenCacheStats
from assembler._tokenizers import (
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    default_tokenizer,
    load_tokenizer,
)

__all__ = [
    "AlignPolicy",
    "AssembledPrompt",
    "Assembler",
    "BlockState",
    "DEFAULT_CAPACITY_BLOCKS",
    "HFTokenizer",
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
]
