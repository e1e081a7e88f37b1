"""``assemble_prompt()``: dedup, order, tokenize per segment, align, predict.

The prompt is built in token space: the system prompt, the tool schemas, each kept chunk
and the query are tokenized separately (each once, through the token cache) and their
ids concatenated, so segment boundaries are exact and a chunk's tokens never depend on
its neighbours.  Segments after the first start with the format's separator (``"\\n\\n"``);
a separator at the *start* of a segment re-tokenizes identically inside a whole text
for byte-level BPE tokenizers when the previous segment ends in a non-space character,
which keeps the text form close to the token form (:attr:`AssembledPrompt.text_is_exact`
says when it is exact).  Caller content is tokenized as text: its control-token markup
never becomes control tokens (marked text, :mod:`promptsplice.assembler._tokenizers`).

An :class:`Assembler` holds the state that makes ordering stable and cache-aware: the
token cache, the online popularity tracker and the prefix-cache mirror.  The module
function :func:`assemble_prompt` uses one shared default assembler per
``(tokenizer, block_size)``, so popularity is learned across calls in one process.

Who updates the mirror: a standalone assembler owns its mirror and admits every prompt
it assembles (it models an engine that receives each of them); an assembler made by an
engine (``EmbeddedEngine.make_assembler()``) holds a read-only
:class:`~promptsplice.assembler.MirrorView` of the engine's mirror, asks it for
predictions and never admits: the engine admits what really ran.

Kept as one module (~750 lines): one assembly takes the assembler's lock once, and
ordering, layout, the size checks and what the call learns (orders, branch points,
popularity) must happen in that order under it: a prompt refused for its size learns
nothing, which holds only while they sit in one method.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from promptsplice.assembler._layout import BranchMemory, LayoutBuilder, Segment, SegmentKind
from promptsplice.assembler._mirror import MirrorView, PrefixCacheMirror
from promptsplice.assembler._prompt import AssembledPrompt, NaivePrompt, PromptFormat
from promptsplice.assembler._ordering import (
    AlignPolicy,
    OrderPolicy,
    PeekBranches,
    PopularityTracker,
    parse_align,
    parse_order,
    pick_best,
)
from promptsplice.assembler._token_cache import TokenCache
from promptsplice.assembler._tokenizers import (
    Markup,
    Tokenizer,
    encode_marked_batch,
    load_tokenizer,
    markup_for,
    tokenizer_key,
)
from promptsplice.dedup import DedupConfig, KeptChunk, dedup, normalize_chunks
from promptsplice.blocks import cacheable_blocks, content_digest, root_hash, token_bytes
from promptsplice._validate import (
    check_block_size,
    check_bool,
    check_fits,
    check_optional_int,
    check_salt,
    check_text,
    check_tools,
    salt_tenant,
)
from promptsplice.errors import ConfigError, ContextLengthError, InputError, InvalidUTF8Error

__all__ = ["Assembler", "DEFAULT_CAPACITY_BLOCKS"]

_CHUNK_KEYS = "\x00chunk\x00"
"""Token-cache key prefix of chunks (keyed by their raw text's digest, see ``assemble``)."""

DEFAULT_CAPACITY_BLOCKS = 262_144
"""Default mirror size when no engine tells us its own (4M tokens at block 16)."""


class _Unset(enum.Enum):
    """A keyword left out (``capacity_blocks`` beside a mirror must agree with it)."""

    UNSET = "unset"


_UNSET = _Unset.UNSET


_TEXT_FORM_PADS = (
    "Assembler.for_openai sends prompts as text, and block padding does not survive that "
    "(OpenAI's tokenizer merges the filler spaces), so its predicted hits would be wrong: "
    "alignment must be 'none', got {!r}"
)


class Assembler:
    """Stateful prompt assembler (token cache, popularity, prefix-cache mirror).

    ``mirror``: a :class:`PrefixCacheMirror` the assembler owns and admits each
    assembled prompt into (default: a new one of ``capacity_blocks``, by default
    ``DEFAULT_CAPACITY_BLOCKS``), or a :class:`MirrorView` of an engine's mirror, only
    read (the engine admits).  ``capacity_blocks`` beside a ``mirror`` must equal the
    mirror's (a :class:`ConfigError` otherwise: the mirror's capacity decides).

    Thread-safe: tokenization and dedup run outside the lock; ordering, layout and the
    mirror update of one request run under it, so concurrent requests see a consistent
    mirror.  ``trust_markup`` (default ``False``): see :func:`assemble_prompt`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | None = None,
        *,
        block_size: int = 16,
        policy: str | OrderPolicy = "stable",
        alignment: str | AlignPolicy = "auto",
        mirror: PrefixCacheMirror | MirrorView | None = None,
        capacity_blocks: int | None | _Unset = _UNSET,
        token_cache: TokenCache | None = None,
        prompt_format: PromptFormat | None = None,
        dedup_config: DedupConfig | None = None,
        max_tokens: int | None = None,
        trust_markup: bool = False,
    ) -> None:
        check_block_size(block_size)
        _check_max_tokens(max_tokens)
        given_capacity = capacity_blocks is not _UNSET
        capacity_blocks = DEFAULT_CAPACITY_BLOCKS if capacity_blocks is _UNSET else capacity_blocks
        check_optional_int(capacity_blocks, "capacity_blocks")
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
        if mirror is not None and given_capacity and capacity_blocks != mirror.capacity_blocks:
            # the mirror's own capacity decides; a different one asked for was ignored
            raise ConfigError(
                f"capacity_blocks={capacity_blocks!r} differs from the mirror's capacity_blocks "
                f"{mirror.capacity_blocks!r}; build the mirror with that capacity, or leave capacity_blocks out"
            )
        self.mirror = mirror if mirror is not None else PrefixCacheMirror(block_size, capacity_blocks)
        self._admits = isinstance(self.mirror, PrefixCacheMirror)  # owner, not a reader
        for value, cls, what in (
            (token_cache, TokenCache, "token_cache"),
            (prompt_format, PromptFormat, "prompt_format"),
            (dedup_config, DedupConfig, "dedup_config"),
        ):
            if value is not None and not isinstance(value, cls):
                raise ConfigError(f"{what} must be a {cls.__name__} (or None for the default), got {type(value).__name__}")
        self.token_cache = token_cache if token_cache is not None else TokenCache()
        self.format = prompt_format or PromptFormat()
        self.dedup_config = dedup_config or DedupConfig()
        self.max_tokens = max_tokens
        self.popularity = PopularityTracker()
        self.branches = BranchMemory()
        self._lock = threading.Lock()
        # Caller content (chunks, query, system, tools) is untrusted: control-token
        # markup in it is tokenized as text.  trust_markup=True reads it as controls.
        self.trust_markup = check_bool(trust_markup, "trust_markup")
        self._text_form = False  # for_openai: prompts are sent as text, so padding is refused
        self._markup: Markup = markup_for(self.tokenizer)
        self._cache_name = tokenizer_key(self.tokenizer) + ("\x00markup" if self.trust_markup else "")

    @classmethod
    def for_openai(cls, encoding: str = "o200k_base", **kwargs: Any) -> Assembler:
        """An assembler for OpenAI's prompt caching: the model's tiktoken encoding,
        128-token blocks, and no hit predicted below 1,024 tokens (OpenAI caches
        prompts of 1,024 tokens or more, in 128-token increments).  Send the text form
        with ``prefix_key`` as ``prompt_cache_key``.  Alignment is ``"none"``, the only
        one allowed: block padding is filler tokens, which the text form does not keep
        (OpenAI's tokenizer merges a run of spaces into a few tokens), so a padded prompt
        would be predicted hits OpenAI does not give."""
        kwargs.setdefault("block_size", 128)
        if parse_align(kwargs.setdefault("alignment", "none")) is not AlignPolicy.NONE:
            raise ConfigError(_TEXT_FORM_PADS.format(kwargs["alignment"]))
        if "mirror" not in kwargs:
            block_size = check_block_size(kwargs["block_size"])
            if 1024 % block_size:  # the mirror's min_hit_tokens, a field the caller never named
                raise ConfigError(
                    f"for_openai needs a block_size that divides 1,024 (OpenAI caches prompts from "
                    f"1,024 tokens on), got {block_size}; leave it at 128 (OpenAI's increment) or pass a divisor"
                )
            kwargs["mirror"] = PrefixCacheMirror(
                kwargs["block_size"], kwargs.pop("capacity_blocks", None), min_hit_tokens=1024
            )
        asm = cls(f"tiktoken:{encoding}", **kwargs)
        asm._text_form = True
        return asm

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
        defer: Collection[str] = (),
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

        ``defer``: ids of chunks (:attr:`KeptChunk.id`) laid after every other chunk the
        predicted prefix-cache hit does not cover, each part in its order.  A
        position-independent runner defers the chunks it will relocate, so the chunks it
        computes attend to exact KV only (and are stored exact, found later by content).
        """
        return self._assemble(
            chunks, query=query, system=system, tools=tools, salt=salt, policy=policy, alignment=alignment,
            max_tokens=max_tokens, defer=defer, commit=True
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
        defer: Collection[str] = (),
    ) -> AssembledPrompt:
        """The prompt :meth:`assemble` would build now, changing no state (nothing
        learned, nothing admitted): for a prompt that will not be sent as such."""
        return self._assemble(
            chunks, query=query, system=system, tools=tools, salt=salt, policy=policy, alignment=alignment,
            max_tokens=max_tokens, defer=defer, commit=False
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
        dedup_config: DedupConfig | None = None,
        defer: Collection[str] = (),
    ) -> AssembledPrompt:
        """``dedup_config``: in place of ``self.dedup_config`` for this call
        (``splice_documents`` passes one that keeps its deduplicated documents as they are)."""
        learn, admit = commit, commit and self._admits
        check_text(query, "query")
        check_text(system, "system", optional=True)
        _utf8(query, SegmentKind.QUERY)  # the offset in the caller's text, not in its template
        if system is not None:
            _utf8(system, SegmentKind.SYSTEM)
        tools = check_tools(tools)
        salt = check_salt(salt, "salt")  # a runner's derived salts come through here too
        order_policy = self.policy if policy is None else parse_order(policy)
        align = self.alignment if alignment is None else parse_align(alignment)
        if self._text_form and align is not AlignPolicy.NONE:
            raise ConfigError(_TEXT_FORM_PADS.format(alignment))
        limit = self.max_tokens if max_tokens is None else _check_max_tokens(max_tokens)
        deferred = _check_defer(defer)
        report = dedup(chunks, dedup_config if dedup_config is not None else self.dedup_config)
        kept = report.chunks

        fmt = self.format
        sep = fmt.separator
        esc = Markup.trusted if self.trust_markup else self._markup.escape
        m_sep = Markup.trusted(sep)
        head: list[tuple[SegmentKind, str]] = []
        m_head: list[str] = []
        sys_value = fmt.system_value(system)
        if (sys_text := fmt.system_text(system)) is not None:
            head.append((SegmentKind.SYSTEM, sys_text))
            m_head.append(fmt.marked(fmt.system_template, esc, system=sys_value))
        tools_text = ""
        if tools:
            tools_text = fmt.tools_text(tools)
            head.append((SegmentKind.TOOLS, tools_text))
            m_head.append(Markup.trusted(fmt.tools_header) + esc(tools_text[len(fmt.tools_header) :]))
        # What the tokenizer puts before any text (a BOS: vLLM's text path adds it, token
        # ids must carry it): before the head's tokens, or a head of its own without one
        # (a chunk's tokens never depend on its position); never in the text, which a
        # server given text encodes with it.
        bos = list(getattr(self.tokenizer, "prefix_ids", ()))
        alone = bool(bos) and not head
        if alone:
            head.append((SegmentKind.SYSTEM, ""))
            m_head.append("")
        items: list[tuple[str, bytes, str]] = []
        for i, ((kind, text), marked) in enumerate(zip(head, m_head)):
            prefix = sep if i else ""
            _utf8(text, kind)
            marked = (m_sep if i else "") + marked
            items.append((prefix, content_digest(marked.encode("utf-8")), marked))
        # Every chunk carries the separator, also when it comes first (no system/tools):
        # its tokens then never depend on its position.  Chunks are keyed by their *raw*
        # text's digest (dedup's, no hashing here), so under a key space of their own:
        # head and query keys digest the marked text, and a document whose raw text
        # equalled a query's marked text was served that query's tokens (control tokens).
        chunk_marks = [esc(k.text) for k in kept]
        chunk_space = _CHUNK_KEYS + sep
        items.extend((chunk_space, k.digest, m_sep + m) for k, m in zip(kept, chunk_marks))
        q_text = sep + fmt.query_text(query)
        _utf8(q_text, SegmentKind.QUERY)
        m_query = m_sep + fmt.marked(fmt.query_template, esc, query=query)
        items.append((sep, content_digest(m_query.encode("utf-8")), m_query))
        self._check_size(items, kept, limit)
        holds = self._markup.holds
        markup_as_text = not self.trust_markup and (
            # the tools header is the format's own markup: only the tools' JSON is caller text
            any(holds(v) for v in (sys_value or "", tools_text[len(fmt.tools_header) :] if tools else "", query))
            or any(m is not k.text and holds(k.text) for k, m in zip(kept, chunk_marks))
        )
        toks = self.token_cache.get_many(self._cache_name, items, self._encode)
        head_toks = toks[: len(head)]
        if bos and list(head_toks[0][: len(bos)]) != bos:  # (a format that writes the BOS itself has it)
            head_toks = [bos + list(head_toks[0]), *head_toks[1:]]
        chunk_toks = toks[len(head) : len(head) + len(kept)]
        query_toks = toks[-1]

        # Layouts learn nothing (orders not kept, sent sets not touched, branch points not
        # counted) until the prompt is known to fit: one refused with ContextLengthError
        # is never sent, and it kept its chunk set's order for the later prompts.
        def lay(branches: Any, align: AlignPolicy) -> tuple[LayoutBuilder, list[int]]:
            trial = PeekBranches(branches) if deferred else branches
            if order_policy is OrderPolicy.CACHE_AWARE:
                builder, order = self._cache_aware(trial, salt, align, head, head_toks, kept, chunk_toks, query_toks, False)
            else:
                order = self._order(kept, order_policy, False, salt)
                builder = self._layout(trial, salt, align, head, head_toks, kept, chunk_toks, order, query_toks)
            if deferred:
                later = self._deferred_order(builder, kept, order, deferred)
                if later is None:
                    trial.replay()
                else:  # laid again in the new order (its branch queries, not the first layout's)
                    order, peek = later, PeekBranches(branches)
                    builder = self._layout(peek, salt, align, head, head_toks, kept, chunk_toks, order, query_toks)
                    peek.replay()
            return builder, order

        with self._lock:
            room = self._capacity_tokens()
            # A preview (learn=False) pads as the real send would, without counting.
            branches = PeekBranches(self.branches)
            if align is AlignPolicy.AUTO:
                # Padding pays only in a prompt that fits: over the context or the cache, unpadded.
                trial = PeekBranches(branches)  # (a layout not sent learns nothing)
                builder, order = lay(trial, align)
                if any(b is not None and len(builder.tokens) > b for b in (limit, room)):
                    builder, order = lay(branches, AlignPolicy.NONE)
                else:
                    trial.replay()
            else:
                builder, order = lay(branches, align)
            hashes = builder.finish()
            tokens = builder.tokens
            if not tokens:  # (the mirror's own check said "num_tokens ... got 0")
                raise InputError(
                    "the assembled prompt is empty: no chunk, system prompt or query has text, and the "
                    "prompt format adds none; give a query (or a prompt_format whose templates add text)"
                )
            if limit is not None and len(tokens) > limit:
                padded = sum(seg.padding for seg in builder.segments)
                pads = (f" ({padded} of them block padding of alignment={align.value!r}: 'auto' or "
                        f"'none' pads less)" if padded and align is AlignPolicy.ALL else "")
                raise ContextLengthError(
                    f"the assembled prompt has {len(tokens)} tokens{pads} but the context holds "
                    f"{limit}; pass fewer or shorter chunks (a smaller top-k), or raise "
                    f"max_tokens",
                    prompt_tokens=len(tokens),
                    max_tokens=limit,
                )
            if room is not None and len(tokens) > room:
                raise ContextLengthError(
                    f"the assembled prompt has {len(tokens)} tokens but the prefix-cache mirror "
                    f"holds {room} ({self.mirror.capacity_blocks} blocks); {_CAPACITY_FIX}",
                    prompt_tokens=len(tokens),
                    max_tokens=room,
                )
            if admit:
                pred = self.mirror.admit(hashes, len(tokens))  # type: ignore[union-attr]
            else:
                pred = self.mirror.predict(hashes, len(tokens))
            if learn:
                branches.replay()
                if order_policy is not OrderPolicy.RETRIEVAL:
                    self._order(kept, OrderPolicy.STABLE, True, salt)  # keep the set's stable order
                scope = _scope(salt)
                if order_policy is OrderPolicy.CACHE_AWARE and len(kept) > 1:
                    self.popularity.last_sent([k.digest for k in kept], touch=True, scope=scope)
                digests = [kept[i].digest for i in order]
                self.popularity.observe(digests, scope=scope)
                if order_policy is OrderPolicy.CACHE_AWARE:
                    self.popularity.remember(digests, scope=scope)

        key = self._prefix_key(tokens, builder.segments[alone:], len(head) - alone, salt)
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
            markup_as_text=markup_as_text,
            tokenizer=self.tokenizer,
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
        check_text(query, "query")
        check_text(system, "system", optional=True)
        _utf8(query, SegmentKind.QUERY)  # as assemble: the error names the query
        if system is not None:
            _utf8(system, SegmentKind.SYSTEM)
        tools = check_tools(tools)  # a lone surrogate: InvalidUTF8Error naming tools[i]
        texts = [c.text for c in normalize_chunks(chunks, on_invalid_utf8=self.dedup_config.on_invalid_utf8)]
        text = self.format.naive_text(texts, query=query, system=system, tools=tools)
        bos = list(getattr(self.tokenizer, "prefix_ids", ()))  # as a server given the text encodes it
        return NaivePrompt(text=text, token_ids=bos + self.tokenizer.encode(text))

    # -- internals -----------------------------------------------------------------
    def _encode(self, marked: list[str]) -> list[list[int]]:
        return encode_marked_batch(self.tokenizer, marked)

    def _capacity_tokens(self) -> int | None:
        cap = self.mirror.capacity_blocks
        return None if cap is None else cap * self.block_size

    def _check_size(self, items: list[tuple[str, bytes, str]], kept: list[KeptChunk], limit: int | None) -> None:
        """Refuse, before tokenizing, a prompt over ``_EARLY_REFUSAL_BYTES`` whose UTF-8
        size alone proves it cannot fit the context (``max_tokens``) or the mirror: a
        20 MB chunk fails in milliseconds instead of after seconds of tokenization and
        gigabytes of token lists.  Its error's ``prompt_tokens`` is then a lower bound
        (the message says "at least"); smaller prompts are tokenized and get the exact size."""
        room = self._capacity_tokens()
        bounds = [b for b in (limit, room) if b is not None]
        if not bounds:
            return
        sep = len(self.format.separator.encode("utf-8"))
        n_head = len(items) - len(kept) - 1
        nbytes = sum(len(k.data) + sep for k in kept)
        nbytes += sum(len(text.encode("utf-8")) for _, _, text in (*items[:n_head], items[-1]))
        if nbytes <= max(min(bounds), _EARLY_REFUSAL_BYTES):  # cheap to tokenize, or may fit
            return
        per_token = _max_token_bytes(self.tokenizer)
        if limit is not None:
            check_fits(nbytes, max_token_bytes=per_token, limit=limit, what="max_tokens",
                       fix="pass fewer or shorter chunks (a smaller top-k), or raise max_tokens")
        check_fits(nbytes, max_token_bytes=per_token, limit=room, what="the prefix-cache mirror's capacity",
                   fix=_CAPACITY_FIX)

    def _order(self, kept: list[KeptChunk], policy: OrderPolicy, learn: bool, salt: str | None) -> list[int]:
        if policy is OrderPolicy.RETRIEVAL or len(kept) < 2:
            return list(range(len(kept)))
        return self.popularity.order([k.digest for k in kept], memo=learn, scope=_scope(salt))

    def _append_chunk(
        self,
        builder: LayoutBuilder,
        chunk: KeptChunk,
        toks: Sequence[int],
        *,
        pad_prev: bool | None = None,
        following: Iterable[Sequence[int]] | None = None,
    ) -> None:
        ids = tuple(o.id for o in chunk.origins)
        builder.append(SegmentKind.CHUNK, ids, toks, paddable=True, pad_prev=pad_prev, following=following)

    def _layout(
        self,
        branches: Any,
        salt: str | None,
        align: AlignPolicy,
        head: list[tuple[SegmentKind, str]],
        head_toks: Sequence[Sequence[int]],
        kept: list[KeptChunk],
        chunk_toks: Sequence[Sequence[int]],
        order: Sequence[int] | None,
        query_toks: Sequence[int] | None,
        upcoming: Sequence[Sequence[int]] | None = None,
    ) -> LayoutBuilder:
        """Lay out the head, the chunks in ``order`` (none when None) and the query (none
        when None) on the mirror; the builder is not finished.  ``upcoming``: the segments
        the caller will append after these (the head's lookahead), when known."""
        builder = LayoutBuilder(
            self.block_size, self.tokenizer.filler_token_id, align, self.mirror, salt, branches
        )
        segs = [*head_toks, *(chunk_toks[idx] for idx in order or ())]
        if query_toks is not None:
            segs.append(query_toks)
        segs.extend(upcoming or ())
        known = upcoming is not None or query_toks is not None  # else what follows is unknown
        for i, ((kind, _), t) in enumerate(zip(head, head_toks)):
            builder.append(kind, (), t, paddable=True, following=_after(segs, i + 1) if known else None)
        for j, idx in enumerate(order or (), start=len(head_toks)):
            self._append_chunk(builder, kept[idx], chunk_toks[idx], following=_after(segs, j + 1) if known else None)
        if query_toks is not None:
            builder.append(SegmentKind.QUERY, (), query_toks, paddable=False, following=())
        return builder

    def _deferred_order(
        self, builder: LayoutBuilder, kept: list[KeptChunk], order: list[int], deferred: frozenset[str]
    ) -> list[int] | None:
        """``order`` with the deferred chunks past the cached prefix moved behind the
        others (each part keeping its order), or ``None`` when nothing moves."""
        hit = self._cached_tokens(builder, len(builder.tokens))
        segs = [seg for seg in builder.segments if seg.kind is SegmentKind.CHUNK]
        lead = 0
        while lead < len(segs) and segs[lead].end <= hit:
            lead += 1
        rest = order[lead:]
        later = order[:lead] + [i for i in rest if kept[i].id not in deferred] + [i for i in rest if kept[i].id in deferred]
        return None if later == order else later

    def _cached_tokens(self, builder: LayoutBuilder, num_tokens: int) -> int:
        """Cached tokens the mirror predicts for a layout of ``num_tokens`` tokens whose
        first blocks are in ``builder`` (unfinished)."""
        bs = self.block_size
        hit = min(builder.hit_blocks, cacheable_blocks(num_tokens, bs))
        return 0 if hit * bs < self.mirror.min_hit_tokens else hit * bs

    def _cache_aware(
        self,
        branches: BranchMemory | PeekBranches,
        salt: str | None,
        align: AlignPolicy,
        head: list[tuple[SegmentKind, str]],
        head_toks: Sequence[Sequence[int]],
        kept: list[KeptChunk],
        chunk_toks: Sequence[Sequence[int]],
        query_toks: Sequence[int],
        learn: bool,
    ) -> tuple[LayoutBuilder, list[int]]:
        """Lay out every candidate order on the mirror and keep the best (see
        :mod:`promptsplice.assembler._ordering`): the last-sent order, the stable order,
        the retrieval order, and -- unless one of those is cached to its last full
        block -- the greedy walk (under ``auto``, when that walk padded, also the walk
        without padding).  The winner's branch-memory queries are replayed.

        A trial stops appending at its first miss (nothing after it hits, and ``auto``
        and ``none`` add no padding there): only the winner is completed."""
        stable = self._order(kept, OrderPolicy.STABLE, learn, salt)
        orders: list[list[int]] = []
        last = (self.popularity.last_sent([k.digest for k in kept], touch=learn, scope=_scope(salt))
                if len(kept) > 1 else None)
        for order in (last, stable, list(range(len(kept)))):
            if order is not None and order not in orders:
                orders.append(order)
        lazy = align is not AlignPolicy.ALL
        # (builder, order, branch peek, chunks laid, tokens, each segment's lookahead)
        trials: list[tuple[LayoutBuilder, list[int], PeekBranches, int, int, list[Sequence[int]]]] = []
        for order in orders:
            peek = PeekBranches(branches)
            rest = [*(chunk_toks[i] for i in order), query_toks]  # each segment's lookahead
            builder = self._layout(peek, salt, align, head, head_toks, kept, chunk_toks, None, None, rest)
            done = 0
            for idx in order:
                if lazy and not builder.hitting:
                    break
                self._append_chunk(builder, kept[idx], chunk_toks[idx], following=_after(rest, done + 1))
                done += 1
            if done == len(order):
                builder.append(SegmentKind.QUERY, (), query_toks, paddable=False, following=())
                n = len(builder.tokens)
            else:
                n = len(builder.tokens) + sum(len(chunk_toks[i]) for i in order[done:]) + len(query_toks)
            trials.append((builder, order, peek, done, n, rest))
        if len(kept) > 1 and not any(t[0].hitting for t in trials):
            # Under ``auto`` the walk is myopic about padding (a padded boundary that adds
            # a block now can cost more blocks later): a walk that padded is joined by the
            # unpadded walk, the one ``none`` takes, so ``auto`` never caches less than it.
            for walk_align in (align, AlignPolicy.NONE):
                peek = PeekBranches(branches)
                builder = self._layout(peek, salt, walk_align, head, head_toks, kept, chunk_toks, None, None)
                order = self._greedy(builder, kept, chunk_toks, stable, query_toks)
                builder.append(SegmentKind.QUERY, (), query_toks, paddable=False, following=())
                trials.append((builder, order, peek, len(order), len(builder.tokens), []))
                if align is not AlignPolicy.AUTO or not any(seg.padding for seg in builder.segments):
                    break  # a walk that padded nothing is the unpadded walk
        builder, order, peek, done, _, rest = trials[pick_best([self._cached_tokens(t[0], t[4]) for t in trials])]
        if done < len(order):  # complete the winner (never the greedy walk: it lays every chunk)
            for j in range(done, len(order)):
                self._append_chunk(builder, kept[order[j]], chunk_toks[order[j]], following=_after(rest, j + 1))
            builder.append(SegmentKind.QUERY, (), query_toks, paddable=False, following=())
        peek.replay()
        return builder, order

    def _greedy(
        self,
        builder: LayoutBuilder,
        kept: list[KeptChunk],
        chunk_toks: Sequence[Sequence[int]],
        stable: list[int],
        query_toks: Sequence[int],
    ) -> list[int]:
        """Greedy chunk-trie walk over the mirror, then the stable order."""
        remaining = list(stable)
        order: list[int] = []
        heads = {idx: token_bytes(chunk_toks[idx][: self.block_size]) for idx in remaining}
        while remaining and builder.hitting:
            best: tuple[int, int, bool] | None = None  # (score, idx, pad)
            choices = builder.pad_choices()
            # Every chunk is tried at every step: one digest each decides most of them,
            # and only a chunk whose first block hits is hashed further.
            hits = [builder.first_block_hits([heads[i] for i in remaining], pad) for pad in choices]
            for j, idx in enumerate(remaining):
                for c, pad in enumerate(choices):
                    if not hits[c][j]:
                        continue
                    score = builder.probe(chunk_toks[idx], pad)
                    if score > 0 and (best is None or score > best[0]):
                        best = (score, idx, pad)
            if best is None:
                break
            _, idx, pad = best
            remaining.remove(idx)
            order.append(idx)
            self._append_chunk(builder, kept[idx], chunk_toks[idx], pad_prev=pad)
        rest = [*(chunk_toks[i] for i in remaining), query_toks]  # the caller appends the query
        for j, idx in enumerate(remaining):
            order.append(idx)
            self._append_chunk(builder, kept[idx], chunk_toks[idx], following=_after(rest, j + 1))
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


def _check_defer(defer: Any) -> frozenset[str]:
    """``defer``: chunk ids, a collection of str (a bare str would defer its letters)."""
    if isinstance(defer, (str, bytes)) or not isinstance(defer, Iterable):
        raise ConfigError(f"defer must be a collection of chunk ids (str), got {type(defer).__name__}: "
                          "pass defer=[chunk_id, ...]")
    out = frozenset(defer)
    bad = next((d for d in out if not isinstance(d, str)), None)
    if bad is not None:
        raise ConfigError(f"defer holds chunk ids (str), got {bad!r}")
    return out


def _check_max_tokens(max_tokens: Any) -> Any:
    """``max_tokens`` (the context the prompt must fit): None or a positive int."""
    return check_optional_int(max_tokens, "max_tokens")


_CAPACITY_FIX = (
    "pass fewer or shorter chunks, or assemble with an assembler whose mirror is larger: "
    "assemble_prompt(..., assembler=Assembler(tokenizer, block_size=..., capacity_blocks=N)) "
    "with the engine's block count"
)

_EARLY_REFUSAL_BYTES = 1 << 20
"""Texts up to 1 MiB are tokenized (well under a second) before a size error, so the
error carries the exact prompt size; larger ones may be refused from their bytes."""

_TOKEN_BYTES: dict[str, int] = {}


def _max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes one token of ``tokenizer`` decodes to (plus a margin of 4
    for decoders that drop a leading space), 0 when the vocabulary cannot be listed.
    Computed once per :func:`tokenizer_key` (about 30 ms for a 49K vocabulary)."""
    key = tokenizer_key(tokenizer)
    cached = _TOKEN_BYTES.get(key)
    if cached is not None:
        return cached
    size = getattr(tokenizer, "vocab_size", None)
    longest = 0
    if isinstance(size, int) and size > 0:
        for i in range(size):
            try:
                longest = max(longest, len(tokenizer.decode([i]).encode("utf-8", "surrogatepass")))
            except Exception:  # noqa: BLE001 - an id without a token (gaps in tiktoken's ranks)
                continue
    value = longest + 4 if longest else 0
    _TOKEN_BYTES[key] = value
    return value


def _scope(salt: str | None) -> bytes:
    """The popularity tracker's scope of a tenant: what one tenant's prompts teach orders
    only that tenant's.  A runner's derived salts (PIC's reuse salt) share their tenant's
    scope, so its exact and reuse prompts learn one order; unsalted: the empty scope."""
    tenant = salt_tenant(salt)
    return b"" if tenant is None else root_hash(tenant)


def _utf8(text: str, kind: SegmentKind) -> bytes:
    """A segment's text as UTF-8; a lone surrogate (no UTF-8 form) is InvalidUTF8Error
    (``index=-1``: not a chunk; ``offset``: its UTF-8 byte offset in the segment text)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidUTF8Error.lone_surrogate(f"the {kind.value} segment", text, exc, index=-1) from None


def _after(segments: Sequence[Sequence[int]], start: int) -> Iterator[Sequence[int]]:
    """The segments from ``start`` on, lazily (a layout's lookahead reads at most a
    block's worth of them; slicing copied the rest once per segment)."""
    return (segments[i] for i in range(start, len(segments)))
