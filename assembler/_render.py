"""Agent renders in token space: chat messages -> one block-aligned segment per message.

The template itself and the message helpers live in
:mod:`promptsplice.assembler._chat_template`, the records in
:mod:`promptsplice.assembler._render_types`.  Kept as one module (~730 lines): the piece
renders, their memo, the preamble split and the tools cut (checked by encoding) all work
on one renderer's state (its template, tokenizer, escaping and memo).

An agent sends its whole context every step: OpenAI-style chat messages (``role``,
``content``, optional ``tool_calls``, ``tool_call_id``, ``name``) plus tool schemas.
:class:`ChatRenderer` turns such a *render* into token ids through the model's chat
template, one segment per message, so that two successive renders can be diffed message
by message (:mod:`promptsplice.assembler._directives`) and unchanged messages keep identical tokens.

How a message's text is found.  The chat template renders a whole conversation, not one
message, so the text of message ``i`` is taken as the template's rendering of
``[m(i-1), m(i)]`` minus its rendering of ``[m(i-1)]`` (the first message: the rendering
of ``[m(0)]``).  The concatenation of these pieces is then checked against the
template's rendering of the whole list; a template whose pieces depend on more than the
previous message falls back to prefix differences (``render(m[:i+1]) - render(m[:i])``,
quadratic but exact).  Where even a prefix does not render as the start of the whole
(a later message changes how earlier ones render: Qwen's consecutive tool results share
one user turn) there is no boundary after that message: its text joins the next
message's segment and its own segment is empty.  Probe renders the template refuses
(templates that enforce role alternation: Mistral, Llama-2, Gemma) count as no piece.
So the segments' texts concatenate to exactly what
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` gives
(tested on the default model's template).  Piece renders are memoized per
``(previous message, message)``, so a session step renders only its new messages plus
one whole-list check.

Segments, in order:

* ``SYSTEM`` (no message index): text the template puts before the first message on its
  own, e.g. ChatML's default system turn when the first message is not a system
  message; also the default system turn that carries the tools (below).
* ``MESSAGE`` (message index ``i``): the template's text for message ``i``.
* ``TOOLS``: the tool schemas.  Templates without tool support (SmolLM2's ChatML) get
  them the Hermes/Qwen way, inside the system turn after the system text:
  ``"\\n\\n# Tools\\n\\n...<tools>\\n{one canonical JSON schema per line}\\n</tools>"``
  (keys sorted, compact separators, so the same tools give the same bytes and blocks);
  without a system message, a system message with the template's default system text
  is added to carry them (the default text is read off the template).  The system turn
  is then cut where the tools begin: the system segment is ``<|im_start|>system\\n{text}``
  and the tools segment is the tools block plus the rest of the turn, so changing the
  tools leaves the system segment's tokens alone and vice versa.  Templates that handle
  ``tools`` themselves get them natively; the TOOLS cut is made the same way when the
  tools text is one insertion in the first segment, else it stays inside that segment.
  Assistant ``tool_calls`` are rendered, for templates that ignore them, as
  ``<tool_call>\\n{"arguments":{...},"name":"f"}\\n</tool_call>`` lines after the
  content; ``tool`` messages keep their role (``<|im_start|>tool\\n...``) and the
  template ignores ``tool_call_id``/``name``.  Templates that render ``tool_calls``
  themselves get them as vLLM's chat endpoint passes them on
  (:func:`~._content_format.template_calls`): JSON-text ``arguments`` parsed into the
  object, ``{}`` where that is no JSON object.  Content reaches the template in the form
  vLLM's chat endpoint detects for it (:mod:`promptsplice.assembler._content_format`):
  one text, the parts joined with ``"\\n"`` and empty ones left out, or, for a template
  that loops over content parts (Gemma 3), the list of text parts.  Developer messages
  follow vLLM's rule too: where the template never quotes ``"developer"``, they are system
  messages and every system message merges into one in front (the others keep empty
  segments); a system message's Claude Code billing-header line is left out.
* ``GENERATION``: the generation prompt (``<|im_start|>assistant\\n``), never padded.

Every segment is tokenized on its own (through the token cache) and the ids are
concatenated, as in :mod:`promptsplice.assembler._assemble`.  ChatML segments start with a special
token (``<|im_start|>``) and end with ``"\\n"``, so for byte-level BPE the whole text
re-tokenizes to the same ids when nothing is padded (tested).

Alignment: ``all`` (the default here) pads every segment but the generation prompt to a
block boundary, so every message starts at a block boundary and its tokens, padding
included, depend on its text alone.  That is what lets the engine *relocate* the blocks
of the unchanged messages after an edit: the position delta is then a whole number of
blocks and every unchanged block keeps its content.  Without padding the delta is
arbitrary, the blocks after an edit straddle message boundaries and none can be moved
whole.  Measured on 30-step agent sessions with real text (Wikipedia sentences as
tool outputs, one call in five failing and retried; the ten-line rule with
``keep_recent=3`` and :class:`~promptsplice.assembler.DropFailedCalls`; seeds 0-2; prefill counted
as prompt minus the block-rounded prefix hit minus the whole blocks that can be
relocated): padding costs 5-6% more prompt tokens at block 16 and 11-14% at block 32,
and 4-5% (block 16) or 9-12% (block 32) more prefill under prefix caching alone, but
with splicing it leaves 10-31% (block 16) and 22-40% (block 32) fewer tokens to prefill
than ``none``, because without padding the shift after an edit is almost never a whole
number of blocks.  That is why ``all`` is the default here (the RAG assembler, which
relocates nothing, defaults to ``auto``).  ``auto`` needs the mirror to decide and would
pad a message differently from one step to the next; for messages it means ``all``.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from promptsplice.assembler._chat_template import (
    TOOLS_HEADER,
    ChatTemplate,
    _content_text,
    _lone_surrogate,
    _tool_call_text,
    canonical_calls,
    canonical_json,
    check_message_json,
    template_for,
    tools_block,
)
from promptsplice.assembler._content_format import content_parts, strip_billing_header, template_calls, template_fields
from promptsplice.assembler._directives import Diff, diff_renders
from promptsplice.assembler._layout import LayoutBuilder, SegmentKind
from promptsplice.assembler._ordering import AlignPolicy, parse_align
from promptsplice.assembler._render_types import MessageSegment, Render
from promptsplice.assembler._token_cache import TokenCache
from promptsplice.assembler._tokenizers import (
    Markup,
    Tokenizer,
    encode_marked_batch,
    load_tokenizer,
    markup_for,
    tokenizer_key,
)
from promptsplice.blocks import content_digest
from promptsplice._validate import check_block_size, check_bool, check_int, check_messages, check_salt, check_tools
from promptsplice.errors import ConfigError, InputError, InvalidMessageError

__all__ = [
    "ChatTemplate",
    "ChatRenderer",
    "Render",
    "MessageSegment",
    "TOOLS_HEADER",
    "canonical_json",
]

# -- renderer ----------------------------------------------------------------------------

_Piece = tuple[SegmentKind, "int | None", "str | None", str]  # kind, message index, role, text


class _Normalized(NamedTuple):
    """The messages as a template gets them: ``messages`` each with its index in the
    caller's list (``None`` for an added system message); ``plain`` the first message
    without the injected tools (``None`` when nothing was injected); ``merged`` the
    indices of the system messages merged into the first one (their segments are
    empty); ``each`` every caller message as normalized before that merge (what a
    lone surrogate is searched in, so the error names the message that holds it)."""

    messages: list[tuple[int | None, dict[str, Any]]]
    plain: dict[str, Any] | None
    merged: list[int]
    each: list[tuple[int | None, dict[str, Any]]]


_NO_TEXT = "\x00"
"""A probe render's answer where there is no text to take (the template refused it)."""


def _probe(tmpl: ChatTemplate, msgs: list[dict[str, Any]], tools: list | None) -> str:
    """The template's text of a partial conversation the renderer builds to find the
    segments, or :data:`_NO_TEXT` where the template refuses it (templates that enforce
    role alternation refuse some; the real messages' own render is never a probe)."""
    try:
        return tmpl.render(msgs, tools=tools)
    except InputError:
        return _NO_TEXT


def _prefix_meta(tmpl: ChatTemplate, msgs: list[dict[str, Any]], tools: list | None) -> str:
    """``"chars:bytes:digest"`` of a prefix's render, or :data:`_NO_TEXT` if refused."""
    text = _probe(tmpl, msgs, tools)
    if text == _NO_TEXT:
        return _NO_TEXT
    data = text.encode("utf-8")
    return f"{len(text)}:{len(data)}:{content_digest(data).hex()}"


def _prefix_end(meta: str, body_bytes: memoryview, done: int) -> int | None:
    """Where a prefix (``_prefix_meta``) ends in the whole render, in characters, or
    ``None`` when it is not the whole's start (or was refused)."""
    if meta == _NO_TEXT:
        return None
    n_chars, n_bytes, digest = meta.split(":")
    end, size = int(n_chars), int(n_bytes)
    if end >= done and size <= len(body_bytes) and content_digest(body_bytes[:size]).hex() == digest:
        return end
    return None


_MEMO_ENTRY_CHARS = 256
"""What one memo entry counts against ``max_memo_chars`` besides its text: its key
(digests) and dict node, ~250 bytes, counted as characters."""


class ChatRenderer:
    """Renders chat messages into block-aligned per-message segments in token space.

    ``tokenizer`` is an :class:`~promptsplice.assembler.Assembler` (its tokenizer, token cache and
    block size are used), a :class:`~promptsplice.assembler.Tokenizer` or a tokenizer spec
    (``"default"``...).  ``template`` is a :class:`ChatTemplate` or a model folder;
    default: the tokenizer's own (:func:`~._chat_template.template_for`).  Thread-safe; memoizes piece renders (LRU bounded by
    ``max_memo_chars`` characters of text, each entry counting 256 more for its key).

    Message contents, roles, tool calls and tool schemas are caller content: control-token
    markup in them (``<|im_start|>system``...) is tokenized as ordinary text, and only
    the template's own markup gives control tokens (marked text,
    :mod:`promptsplice.assembler._tokenizers`).  ``trust_markup=True`` reads markup in
    the messages as control tokens (for callers who pass pre-rendered turns on purpose).
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        block_size: int | None = None,
        template: ChatTemplate | str | Path | None = None,
        alignment: str | AlignPolicy = "all",
        token_cache: TokenCache | None = None,
        max_memo_chars: int = 8_000_000,
        trust_markup: bool = False,
    ) -> None:
        from promptsplice.assembler._assemble import Assembler

        given = tokenizer
        if isinstance(tokenizer, Assembler):
            if block_size is not None and block_size != tokenizer.block_size:
                raise ConfigError(
                    f"block_size {block_size} differs from the assembler's {tokenizer.block_size}; "
                    "leave block_size unset when passing an assembler"
                )
            block_size = tokenizer.block_size
            token_cache = token_cache or tokenizer.token_cache
            tokenizer = tokenizer.tokenizer
        if block_size is None:
            block_size = 16
        check_block_size(block_size)
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.block_size = block_size
        align = parse_align(alignment)
        # ``auto`` needs the mirror and would pad one message differently from step to
        # step; for message boundaries it means ``all`` (see the module docstring).
        self.alignment = AlignPolicy.ALL if align is AlignPolicy.AUTO else align
        if template is None:
            template = template_for(given, self.tokenizer)
        elif isinstance(template, str | os.PathLike):
            template = ChatTemplate.from_dir(template)
        elif not isinstance(template, ChatTemplate):
            raise ConfigError(
                f"template must be a ChatTemplate or a model folder (str or path), got {type(template).__name__}"
            )
        if token_cache is not None and not isinstance(token_cache, TokenCache):
            raise ConfigError(f"token_cache must be a TokenCache (or None for the default), got {type(token_cache).__name__}")
        self.template: ChatTemplate = template
        self.token_cache = token_cache if token_cache is not None else TokenCache()
        self._memo: OrderedDict[tuple[bytes, ...], str] = OrderedDict()
        self._memo_chars = 0
        self._max_memo_chars = check_int(max_memo_chars, "max_memo_chars", minimum=0)
        self._memo_lock = threading.Lock()
        self._filler_text: str | None = None
        self.trust_markup = check_bool(trust_markup, "trust_markup")
        self._markup = markup_for(self.tokenizer)
        self._esc = Markup.trusted if self.trust_markup else self._markup.escape
        self._esc_name = Markup.trusted if self.trust_markup else self._markup.escape_name
        self._cache_name = tokenizer_key(self.tokenizer) + ("\x00markup" if self.trust_markup else "")

    # -- public --------------------------------------------------------------------
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        salt: str | None = None,
        add_generation_prompt: bool = True,
    ) -> Render:
        """Render ``messages`` (and ``tools``) into token ids, one segment per message.

        Bad messages raise :class:`InputError`; a lone surrogate (no UTF-8 encoding) in
        a message or the tools raises :class:`InvalidUTF8Error` naming it."""
        check_salt(salt)
        pieces = self._marked_pieces(messages, tools, add_generation_prompt=check_bool(
            add_generation_prompt, "add_generation_prompt"))
        tok = self.tokenizer
        # Keyed by the marked text: equal keys mean equal tokens.
        items = [("", content_digest(text.encode("utf-8")), text) for _, _, _, text in pieces]
        toks = self.token_cache.get_many(self._cache_name, items, self._encode)
        builder = LayoutBuilder(self.block_size, tok.filler_token_id, self.alignment, None, salt)
        for (kind, _, _, _), ids in zip(pieces, toks):
            builder.append(kind, (), ids, paddable=kind is not SegmentKind.GENERATION)
        hashes = builder.finish()
        if self._filler_text is None:
            self._filler_text = tok.decode([tok.filler_token_id])
        filler = self._filler_text
        segments: list[MessageSegment] = []
        keys: list[bytes] = [b""] * len(messages)
        text_parts: list[str] = []
        unescape = self._markup.unescape
        for (kind, idx, role, marked), (_, digest, _), seg in zip(pieces, items, builder.segments):
            text = unescape(marked)
            segments.append(MessageSegment(kind, idx, role, seg.start, seg.end, seg.padding, digest, text))
            text_parts.append(text + filler * seg.padding)
            if idx is not None and kind is SegmentKind.MESSAGE:
                keys[idx] = digest
        return Render(
            token_ids=builder.tokens,
            text="".join(text_parts),
            segments=segments,
            message_keys=keys,
            block_size=self.block_size,
            block_hashes=hashes,
            alignment=self.alignment,
            salt=salt,
        )

    __call__ = render

    def diff(self, old: Render, new: Render) -> Diff:
        """:func:`~promptsplice.assembler.diff_renders` with this renderer's tokenizer for the texts."""
        return diff_renders(old, new, decode=self.tokenizer.decode)

    def pieces(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[_Piece]:
        """The segment texts (kind, message index, role, text) before tokenization."""
        unescape = self._markup.unescape
        gen = check_bool(add_generation_prompt, "add_generation_prompt")  # as render() ("no" was true)
        return [
            (kind, idx, role, unescape(text))
            for kind, idx, role, text in self._marked_pieces(messages, tools, add_generation_prompt=gen)
        ]

    # -- internals -----------------------------------------------------------------
    def _encode(self, marked: list[str]) -> list[list[int]]:
        return encode_marked_batch(self.tokenizer, marked)

    def _marked_pieces(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[_Piece]:
        """:meth:`pieces` as marked text (caller markup escaped, the template's raw)."""
        tmpl = self.template
        norm, norm_plain, merged, each = self._normalize(messages, tools)
        native_tools = [_escaped(t, self._esc, self._esc_name) for t in tools] if (tools and tmpl.native_tools) else None
        msgs = [m for _, m in norm]
        try:
            texts = self._piece_texts(msgs, native_tools)  # encodes every message first
        except UnicodeEncodeError:
            raise _lone_surrogate(each, tools) from None
        body = tmpl.render(msgs, tools=native_tools, add_generation_prompt=False)
        if norm_plain is not None and TOOLS_HEADER not in body:
            raise ConfigError(
                f"chat template {tmpl.name} has no tools support and leaves out the system text promptsplice "
                "puts the tools in; pass tools=None, or a template that renders tools or the system message"
            )
        if "".join(texts) != body:
            texts = self._prefix_texts(msgs, native_tools, body)
        preamble, texts[0] = self._split_preamble(msgs[0], texts[0], native_tools)
        pieces: list[_Piece] = []
        if preamble:
            pieces.append((SegmentKind.SYSTEM, None, None, preamble))
        for (idx, m), text in zip(norm, texts):
            kind = SegmentKind.MESSAGE if idx is not None else SegmentKind.SYSTEM
            pieces.append((kind, idx, m["role"], text))
        if tools:
            pieces = self._cut_tools(pieces, norm, norm_plain, native_tools)
        for i in merged:  # an empty segment where the caller put the message
            at = next((k for k, p in enumerate(pieces) if p[1] is not None and p[1] > i), len(pieces))
            pieces.insert(at, (SegmentKind.MESSAGE, i, "system", ""))
        if add_generation_prompt:
            full = tmpl.render(msgs, tools=native_tools, add_generation_prompt=True)
            if not full.startswith(body):
                raise ConfigError(f"chat template {tmpl.name}: the generation prompt changes the text before it")
            if len(full) > len(body):
                pieces.append((SegmentKind.GENERATION, None, "assistant", full[len(body) :]))
        return pieces

    def _normalize(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> _Normalized:
        """The caller's messages in the form the template gets them (:class:`_Normalized`)."""
        # the shared rules (InvalidMessageError, InvalidToolsError: InputErrors), as the hook's
        check_messages(messages, allow_empty=False)
        check_tools(tools)
        tmpl = self.template
        # vLLM's chat endpoint renders a developer message as a system message where the
        # template does not know the role, and then merges every system message into one
        # in front ("\n\n" between the non-empty texts; the others keep no text)
        convert = not tmpl.knows_developer and any(m["role"] == "developer" for m in messages)
        openai = tmpl.content_format == "openai"
        out: list[tuple[int | None, dict[str, Any]]] = []
        system_texts: list[str] = []
        for i, m in enumerate(messages):
            if m["role"] == "system" and m.get("content") is not None:
                m = {**m, "content": strip_billing_header(m["content"])}
            elif convert and m["role"] == "developer":
                m = {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
            if convert and m["role"] == "system":  # as vLLM joins them, in either format
                system_texts.append(_content_text(m.get("content"), i) if not openai else "\n".join(
                    p["text"] for p in content_parts(m.get("content"), i)))
            m = canonical_calls(m, i)
            calls = m.get("tool_calls")
            if calls:
                if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
                    raise InvalidMessageError(f"message {i}: tool_calls must be a list, got {type(calls).__name__}")
                call_texts = [_tool_call_text(c, i) for c in calls]  # checked for every template
            if not isinstance(m.get("content"), (str, type(None))):
                # a non-text part first: NonTextContentError, which the integrations pass
                # through unrendered (an image's bytes were an InvalidMessageError)
                _content_text(m.get("content"), i)
            check_message_json(m, i)  # every field: the hook and the policies key whole messages
            fields = template_fields(m)  # only what vLLM passes on (name, tool_call_id, ...)
            if tmpl.native_tool_calls:
                # the calls as vLLM's chat endpoint passes them on: JSON-text arguments
                # parsed (the template printed the text as a JSON string, escaped twice)
                msg = _escaped(template_calls(fields), self._esc, self._esc_name, i)
                msg["content"] = self._content(m, i, None)
            else:
                # an assistant's tool_calls, folded into the content, is dropped (another
                # role's calls too: vLLM never passes them on)
                msg = _escaped({k: v for k, v in fields.items() if k != "tool_calls"}, self._esc, self._esc_name, i)
                folded = "\n".join(call_texts) if calls and m["role"] == "assistant" else None
                msg["content"] = self._content(m, i, folded)
            out.append((i, msg))
        each = list(out)
        merged: list[int] = []
        if convert:
            at = [k for k, (i, _) in enumerate(out) if messages[i]["role"] in ("system", "developer")]
            if at[-1] > 0:  # a system message after the first: one, in front
                first = out[at[0]][0]
                merged = [out[k][0] for k in at[1:]]  # type: ignore[misc]
                text = "\n\n".join(t for t in system_texts if t)
                one = (first, {"role": self._esc_name("system"), "content": _mark(self._esc, text)})
                out = [one, *(e for k, e in enumerate(out) if k not in at)]
        plain: dict[str, Any] | None = None
        if tools and not tmpl.native_tools:
            block = tools_block(tools, self._esc)
            if out[0][1]["role"] == "system":
                idx, first = out[0]
                plain = first
                out[0] = (idx, {**first, "content": self._with_text(first["content"], block)})
            else:
                default = Markup.trusted(tmpl.default_system() or "")
                plain = {"role": "system", "content": default}
                out.insert(0, (None, {"role": "system", "content": default + block}))
        return _Normalized(out, plain, merged, each)

    def _content(self, m: Mapping[str, Any], i: int, calls: str | None) -> Any:
        """Message ``i``'s content (marked) in the form the template gets it: one text
        in vLLM's ``"string"`` format, a list of text parts in its ``"openai"`` format
        (a tool output's text parts one text, as vLLM joins them).  ``calls``: the
        calls' lines, on a line of their own after the content."""
        content = m.get("content")
        if self.template.content_format == "string":
            text = _content_text(content, i)
            return _mark(self._esc, f"{text}\n{calls}" if text and calls else text or calls or "")
        parts = content_parts(content, i)
        if m["role"] == "tool":
            text = "\n".join(p["text"] for p in parts)
            return _mark(self._esc, f"{text}\n{calls}" if text and calls else text or calls or "")
        if calls:
            if parts and parts[-1]["text"]:
                parts[-1] = {**parts[-1], "text": f"{parts[-1]['text']}\n{calls}"}
            else:
                parts.append({"type": "text", "text": calls})
        return _escaped(parts, self._esc, self._esc_name, i)

    def _with_text(self, content: Any, marked: str) -> Any:
        """``content`` (marked, in the template's form) with ``marked`` text after it: in
        a part list, after the first part's text (the part every template prints: Gemma
        3 prints only the first of a system message's)."""
        if isinstance(content, str):
            return content + marked
        if not content:
            return [{self._esc_name("type"): self._esc_name("text"), self._esc_name("text"): marked}]
        first = content[0]
        key = self._esc_name("text")
        return [{**first, key: first[key] + marked}, *content[1:]]

    def _memo_get(self, key: tuple[bytes, ...], make: Callable[[], str]) -> str:
        with self._memo_lock:
            hit = self._memo.get(key)
            if hit is not None:
                self._memo.move_to_end(key)
                return hit
        text = make()
        self._memo_put(key, text)
        return text

    def _memo_put(self, key: tuple[bytes, ...], text: str) -> None:
        # each entry counts its key and node too (_MEMO_ENTRY_CHARS): most are short (a
        # one-character "no text", ~75-character metas), so text alone let the bound
        # hold several times its size
        with self._memo_lock:
            old = self._memo.pop(key, None)
            if old is not None:
                self._memo_chars -= len(old) + _MEMO_ENTRY_CHARS
            self._memo[key] = text
            self._memo_chars += len(text) + _MEMO_ENTRY_CHARS
            while self._memo_chars > self._max_memo_chars and len(self._memo) > 1:
                _, dropped = self._memo.popitem(last=False)
                self._memo_chars -= len(dropped) + _MEMO_ENTRY_CHARS

    def _piece_texts(self, msgs: list[dict[str, Any]], tools: list | None) -> list[str]:
        """Message ``i``'s text as ``render([m(i-1), m(i)]) - render([m(i-1)])``."""
        tmpl = self.template
        tkey = content_digest(canonical_json(tools).encode()) if tools else b""
        digests = [content_digest(canonical_json(m).encode("utf-8")) for m in msgs]
        texts: list[str] = []
        for i, m in enumerate(msgs):
            if i == 0:
                texts.append(self._memo_get((b"1", tkey, digests[0]), lambda m=m: _probe(tmpl, [m], tools)))
                continue
            prev = msgs[i - 1]

            def make(prev: dict = prev, m: dict = m) -> str:
                a = _probe(tmpl, [prev], tools)
                b = _probe(tmpl, [prev, m], tools)
                return b[len(a) :] if a != _NO_TEXT and b.startswith(a) else _NO_TEXT

            texts.append(self._memo_get((b"2", tkey, digests[i - 1], digests[i]), make))
        return texts

    def _prefix_texts(self, msgs: list[dict[str, Any]], tools: list | None, body: str) -> list[str]:
        """Fallback: message ``i``'s text as ``render(m[:i+1]) - render(m[:i])``.

        Where a prefix does not render as the start of the whole (a template that closes
        a turn differently when another message follows, e.g. Qwen's consecutive tool
        results in one user turn) or is refused (a template that enforces alternation),
        there is no boundary after message ``i``: its text joins the next message's
        segment, and its own segment is empty."""
        tmpl = self.template
        tkey = content_digest(canonical_json(tools).encode()) if tools else b""
        body_bytes = memoryview(body.encode("utf-8"))
        texts: list[str] = []
        done = 0
        chain = b""
        for i in range(len(msgs) - 1):
            # Each prefix is rendered once per session (memoized by the chained digest of
            # its messages, as its size and digest: a step renders only its new prefixes)
            # and compared with the whole by digest.
            chain = content_digest(chain + content_digest(canonical_json(msgs[i]).encode("utf-8")))
            key = (b"P", tkey, chain)
            meta = self._memo_get(key, lambda i=i: _prefix_meta(tmpl, msgs[: i + 1], tools))
            end = _prefix_end(meta, body_bytes, done)
            if end is None and meta != _NO_TEXT:
                # Not the start of the whole: so it is (Qwen's grouped tool results), or the
                # memo went stale (a template that prints today's date): render it again.
                meta = _prefix_meta(tmpl, msgs[: i + 1], tools)
                self._memo_put(key, meta)
                end = _prefix_end(meta, body_bytes, done)
            if end is None:
                texts.append("")
            else:
                texts.append(body[done:end])
                done = end
        texts.append(body[done:])
        return texts

    def _split_preamble(self, first: dict[str, Any], text: str, tools: list | None) -> tuple[str, str]:
        """Split what the template puts before the first message (e.g. a default system
        turn) off the first message's text: the first message rendered second is its
        own text; the rest in front of it is the preamble."""
        tmpl = self.template
        d = content_digest(canonical_json(first).encode("utf-8"))
        tkey = content_digest(canonical_json(tools).encode()) if tools else b""

        def make() -> str:
            a = _probe(tmpl, [first], tools)
            b = _probe(tmpl, [first, first], tools)
            return b[len(a) :] if a != _NO_TEXT and b.startswith(a) else _NO_TEXT

        own = self._memo_get((b"2", tkey, d, d), make)
        if own != _NO_TEXT and own and len(own) < len(text) and text.endswith(own):
            return text[: len(text) - len(own)], own
        return "", text

    def _cut_tools(
        self,
        pieces: list[_Piece],
        norm: list[tuple[int | None, dict[str, Any]]],
        plain: dict[str, Any] | None,
        native_tools: list | None,
    ) -> list[_Piece]:
        """Cut the tools text out of the segment that carries it into a ``TOOLS`` segment.

        Compared with the same segment rendered without tools: when the difference is
        one insertion, the segment is cut where it starts."""
        tmpl = self.template
        has_preamble = pieces[0][0] is SegmentKind.SYSTEM and pieces[0][2] is None
        if native_tools is not None:
            # the first segment (preamble or first message) rendered without tools
            m0 = norm[0][1]
            alone = _probe(tmpl, [m0], None)
            if alone == _NO_TEXT:
                return pieces  # no tools-free text to compare with: the tools stay inside
            pre, _ = self._split_preamble(m0, alone, None)
            at_index, without = 0, (pre if has_preamble else alone)
        elif plain is not None:
            # the system message that carries the injected tools, rendered without them
            alone = _probe(tmpl, [plain], None)
            if alone == _NO_TEXT:
                return pieces
            _, without = self._split_preamble(plain, alone, None)
            at_index = 1 if has_preamble else 0
        else:
            return pieces
        kind, idx, role, text = pieces[at_index]
        at = _insertion_point(text, without, None if native_tools is not None else TOOLS_HEADER)
        if at is None:
            return pieces
        a, n = at
        if a > 0:
            # before the whitespace the caller's text ends in, if the cut there splits no
            # token the whole text has ("Answer.\n" + "\n\n# Tools" encoded apart is not
            # the whole's encoding); where neither point is safe the tools stay inside
            a = next((c for c in dict.fromkeys((a, len(text[:a].rstrip()))) if c > 0 and self._cut_is_safe(text, c)), 0)
            if not a:
                return pieces
            cut = [(kind, idx, role, text[:a]), (SegmentKind.TOOLS, None, None, text[a:])]
        elif n < len(text):
            if not self._cut_is_safe(text, n):
                return pieces
            cut = [(SegmentKind.TOOLS, None, None, text[:n]), (kind, idx, role, text[n:])]
        else:
            cut = [(SegmentKind.TOOLS, None, None, text)]
        return [*pieces[:at_index], *cut, *pieces[at_index + 1 :]]

    def _cut_is_safe(self, text: str, at: int) -> bool:
        """Whether ``text`` (marked) encodes as its two parts at ``at`` encoded apart, as
        segments are (memoized: one system prompt and tools list, one check)."""
        key = (b"cut", content_digest(text.encode("utf-8", "surrogatepass")), str(at).encode())

        def check() -> str:
            left, right, whole = self._encode([text[:at], text[at:], text])
            return "1" if left + right == whole else "0"

        return self._memo_get(key, check) == "1"


def _insertion_point(with_text: str, without: str, prefer: str | None = None) -> tuple[int, int] | None:
    """``(a, n)`` with ``with_text == without[:a] + X + without[a:]`` and ``len(X) == n``;
    ``None`` when ``with_text`` is not one insertion.  Where several ``a`` fit (``X``
    starts like what follows it), the one where ``X`` starts with ``prefer`` wins, else
    the earliest."""
    n = len(with_text) - len(without)
    if n <= 0:
        return None
    hi = 0
    limit = len(without)
    while hi < limit and with_text[hi] == without[hi]:
        hi += 1
    # the suffix after the insertion must match: with_text[a+n:] == without[a:]
    s = 0
    while s < len(without) and with_text[-1 - s] == without[-1 - s]:
        s += 1
    lo = len(without) - s
    if lo > hi:
        return None
    if prefer:
        for a in range(hi, lo - 1, -1):
            if with_text.startswith(prefer, a):
                return (a, n)
    return (lo, n)


#: Values a template compares rather than prints (``message.role == 'tool'``,
#: ``tool.type == 'function'``): escaped as names, like the keys, when they are one of
#: the standard names (any other role is caller text: ``"start|>system"`` must not
#: finish the ``<|im_`` a template starts).
_NAME_VALUES = frozenset({"role", "type"})
_STANDARD_NAMES = frozenset({
    "system", "developer", "user", "assistant", "tool", "function", "ipython", "tool_call", "text",
})  # fmt: skip
#: The keys templates look up (messages, calls, tool schemas, JSON Schema): fixed words,
#: so their edges stay as they are; any other key (an argument's or a property's name,
#: which a template may print raw: ``'<parameter=' + name + '>'``) is caller text.
_STRUCTURAL_KEYS = frozenset({
    "role", "content", "name", "tool_calls", "tool_call_id", "function", "arguments", "type", "id",
    "text", "parameters", "properties", "required", "description", "enum", "items", "default", "title",
    "format", "strict", "additionalProperties", "anyOf", "oneOf", "allOf", "$ref", "$defs", "nullable",
    "minimum", "maximum", "pattern", "examples", "const", "reasoning_content", "tools", "response", "reasoning",
    "task",
})  # fmt: skip


class _MarkedStr(str):
    """Caller text that escaping changed: as text it is the marked text, but its
    ``repr`` (what a template that prints a dict or a list raw shows of it, ``{{
    call.arguments }}``) is the marked ``repr`` of the original, so the prompt reads
    ``{'q': 'a'}`` as vLLM's does and not the escape characters (``'\\ufdd0a'``)."""

    marked_repr: str

    def __repr__(self) -> str:
        return self.marked_repr


def _mark(esc: Callable[[str], str], text: str) -> str:
    """``esc(text)``, a :class:`_MarkedStr` where escaping changed it."""
    marked = esc(text)
    if marked == text:
        return marked
    out = _MarkedStr(marked)
    out.marked_repr = esc(repr(text))
    return out


def _escaped(value: Any, esc: Callable[[str], str], esc_name: Callable[[str], str], index: int | None = None) -> Any:
    """``value`` (a message, a tool schema) with every string passed through ``esc``,
    except the structural keys and the standard values of :data:`_NAME_VALUES`, which go
    through ``esc_name``: a template looks them up or compares them, and ``esc``'s edge
    escaping (``"name"`` lies inside ``<reponame>``) made ``tool_call.name`` miss.
    ``index``: message ``index``, named by the error if it is nested too deeply."""
    if index is not None:
        try:
            return _escaped(value, esc, esc_name)
        except RecursionError as exc:
            raise InvalidMessageError(f"message {index} is nested too deeply to render: flatten it") from exc
    if isinstance(value, str):
        return _mark(esc, value)
    if isinstance(value, Mapping):
        return {
            (esc_name(k) if k in _STRUCTURAL_KEYS else _mark(esc, k) if isinstance(k, str) else k): (
                esc_name(v) if k in _NAME_VALUES and isinstance(v, str) and v in _STANDARD_NAMES else _escaped(v, esc, esc_name)
            )
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_escaped(v, esc, esc_name) for v in value]
    return value
