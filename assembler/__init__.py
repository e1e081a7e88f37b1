"""Token-space prompt assembly that makes the engine's prefix cache hit.

``assemble_prompt(chunks, query=...)`` dedups retrieved chunks (:mod:`dedup`), orders
them canonically (``stable``) or by what the cache holds (``cache_aware``), tokenizes
each segment once (bounded token cache), pads segment ends to KV block boundaries where
that pays (``auto``), and predicts the cached tokens with a mirror of the engine's
prefix cache.

Agent context: :class:`ChatRenderer` renders chat messages through the model's chat
template into one block-aligned segment per message, :func:`diff_renders` turns two
successive renders into ``(span, replacement)`` directives, the context policies
(:class:`TruncateToolOutputs`, :class:`DropFailedCalls`, :class:`SummarizeTurns`) make
the edits agents make, and :class:`ContextHook` keeps the last render per session.

This package never imports vLLM or the engine adapters, and it imports
tokenizer backends only when a tokenizer is loaded.
"""

from promptsplice.assembler._assemble import DEFAULT_CAPACITY_BLOCKS, Assembler
from promptsplice.assembler._front import assemble_prompt
from promptsplice.assembler._prompt import AssembledPrompt, NaivePrompt, PromptFormat
from promptsplice.assembler._directives import (
    Diff,
    DiffKind,
    Directive,
    Relocation,
    apply_diff,
    apply_directives,
    diff_renders,
)
from promptsplice.assembler._hook import ContextHook, FallbackReason, PreparedContext, StepKind
from promptsplice.assembler._layout import Segment, SegmentKind
from promptsplice.assembler._mirror import BlockState, MirrorView, Prediction, PrefixCacheMirror
from promptsplice.assembler._ordering import AlignPolicy, OrderPolicy, PopularityTracker
from promptsplice.assembler._policies import (
    ContextPolicy,
    DropFailedCalls,
    EditKind,
    MessageEdit,
    PolicyResult,
    SummarizeTurns,
    TruncateToolOutputs,
    is_error_output,
    summarize_turns,
)
from promptsplice.assembler._render import ChatRenderer, ChatTemplate, MessageSegment, Render
from promptsplice.assembler._token_cache import TokenCache, TokenCacheStats
from promptsplice.assembler._tokenizers import (
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    default_tokenizer,
    load_tokenizer,
    same_tokenizer,
)

__all__ = [
    "AlignPolicy",
    "AssembledPrompt",
    "Assembler",
    "BlockState",
    "ChatRenderer",
    "ChatTemplate",
    "ContextHook",
    "ContextPolicy",
    "DEFAULT_CAPACITY_BLOCKS",
    "Diff",
    "DiffKind",
    "Directive",
    "DropFailedCalls",
    "EditKind",
    "FallbackReason",
    "HFTokenizer",
    "MessageEdit",
    "MessageSegment",
    "NaivePrompt",
    "OrderPolicy",
    "PolicyResult",
    "PopularityTracker",
    "Prediction",
    "MirrorView",
    "PrefixCacheMirror",
    "PreparedContext",
    "PromptFormat",
    "Relocation",
    "Render",
    "Segment",
    "SegmentKind",
    "StepKind",
    "SummarizeTurns",
    "TiktokenTokenizer",
    "TokenCache",
    "TokenCacheStats",
    "Tokenizer",
    "TruncateToolOutputs",
    "apply_diff",
    "apply_directives",
    "assemble_prompt",
    "default_tokenizer",
    "diff_renders",
    "is_error_output",
    "load_tokenizer",
    "same_tokenizer",
    "summarize_turns",
]
