"""The records of assembly: how segments are rendered (:class:`PromptFormat`), what
:func:`~promptsplice.assembler.assemble_prompt` returns (:class:`AssembledPrompt`) and
the naive baseline (:class:`NaivePrompt`)."""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from promptsplice.assembler._layout import Segment, SegmentKind
from promptsplice.assembler._ordering import AlignPolicy, OrderPolicy
from promptsplice.assembler._tokenizers import Markup, Tokenizer
from promptsplice.blocks import BlockHash
from promptsplice._validate import check_format, check_text, encodable
from promptsplice.errors import ConfigError
from promptsplice.dedup import DedupResult

__all__ = ["PromptFormat", "AssembledPrompt", "NaivePrompt"]


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """How segments are rendered to text before tokenization.

    ``default_system``: the system text when a call gives none; ``None`` (default)
    renders no system segment then, ``""`` renders ``system_template`` with an empty
    system (ChatML's system turn, which opens the user turn)."""

    separator: str = "\n\n"
    tools_header: str = "Tools:\n"
    query_template: str = "Question: {query}\nAnswer:"
    system_template: str = "{system}"
    default_system: str | None = None

    def __post_init__(self) -> None:
        # Checked when built: a template without its field dropped the query (or the
        # system text) silently; other fields or a non-str failed at the first assembly.
        check_text(self.separator, "PromptFormat.separator", error=ConfigError)
        check_text(self.tools_header, "PromptFormat.tools_header", error=ConfigError)
        check_format(self.query_template, "PromptFormat.query_template", "query", "q", required=True)
        check_format(self.system_template, "PromptFormat.system_template", "system", "s", required=True)
        check_text(self.default_system, "PromptFormat.default_system", optional=True, error=ConfigError)
        for name in ("separator", "tools_header", "query_template", "system_template", "default_system"):
            value = getattr(self, name)
            if value is not None and not encodable(value):  # blamed on the query or a chunk at assembly
                raise ConfigError(f"PromptFormat.{name} holds a lone surrogate (not UTF-8 text); "
                                  "fix the string (e.g. value.encode('utf-8', 'replace').decode())")

    @classmethod
    def chatml(cls, default_system: str = "You are a helpful assistant.") -> PromptFormat:
        """ChatML turns (SmolLM2, Qwen): system turn, documents and question in one user
        turn, then the assistant's header.  The system segment always exists: it opens
        the user turn, so ``default_system=""`` gives an empty system turn and ``None``
        is a :class:`ConfigError` (without it the prompt had no user turn)."""
        if default_system is None:
            raise ConfigError("PromptFormat.chatml(default_system=None): the system segment opens the "
                              "user turn and cannot be left out; pass default_system=\"\" for an empty system turn")
        return cls(
            system_template="<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nDocuments:",
            query_template="Question: {query}<|im_end|>\n<|im_start|>assistant\n",
            default_system=default_system,
        )

    def system_value(self, system: str | None) -> str | None:
        """The system text a prompt renders: ``system`` when given (non-empty), else
        ``default_system``; ``None`` (no system segment) only when both are unset.  A
        ``default_system`` of ``""`` still renders the template (ChatML's system turn
        opens the user turn: skipping it left a prompt without one)."""
        return system or self.default_system

    def system_text(self, system: str | None) -> str | None:
        text = self.system_value(system)
        return (self.system_template.format(system=text) or None) if text is not None else None

    def tools_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        # Canonical JSON: the same schemas always give the same bytes (and blocks).
        lines = [json.dumps(t, sort_keys=True, separators=(",", ":"), ensure_ascii=False) for t in tools]
        return self.tools_header + "\n".join(lines)

    def query_text(self, query: str) -> str:
        return self.query_template.format(query=query)

    def marked(self, template: str, escape: Any, **values: str) -> str:
        """``template.format(**values)`` as marked text: the template's own text is
        trusted (its control-token strings are control tokens), each value is passed
        through ``escape`` (caller content: its markup stays text)."""
        out: list[str] = []
        for literal, field_name, spec, conv in string.Formatter().parse(template):
            out.append(Markup.trusted(literal))
            if field_name is not None:
                value = values[field_name]
                if conv:
                    value = {"r": repr, "s": str, "a": ascii}[conv](value)
                out.append(escape(format(value, spec or "")))
        return "".join(out)

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
    markup_as_text: bool = False
    """Caller content held control-token markup that was tokenized as ordinary text;
    the text form cannot carry that (a server reads the markup as control tokens)."""
    tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)
    _text_is_exact: bool | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def padding_tokens(self) -> int:
        return sum(s.padding for s in self.segments)

    @property
    def text_is_exact(self) -> bool:
        """Whether :attr:`text`, tokenized whole (control-token markup recognized, as a
        server that takes text does), gives exactly :attr:`token_ids`.

        Computed on first access (one tokenization of the text, so it is exact).  It
        is ``False`` when caller content held control-token markup
        (:attr:`markup_as_text`), and in practice when a segment was padded (runs of
        filler spaces merge) or BPE merges across a segment boundary: for byte-level
        BPE when a segment ends in whitespace (``" "`` or ``"\\n"`` before the
        ``"\\n\\n"`` separator), for tiktoken also after punctuation (``".\\n\\n"`` is
        one token).  Send ``token_ids`` where the server takes them."""
        if self._text_is_exact is None:
            self._text_is_exact = (
                not self.markup_as_text
                and self.tokenizer is not None
                and _reencodes(self.tokenizer, self.text, self.token_ids)
            )
        return self._text_is_exact

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


def _reencodes(tokenizer: Tokenizer, text: str, token_ids: list[int]) -> bool:
    """Whether ``text`` tokenized whole (markup recognized) gives ``token_ids``, with
    what the tokenizer puts before any text (a BOS), as vLLM's text path encodes it."""
    whole = getattr(tokenizer, "encode_markup_batch", tokenizer.encode_batch)
    return [*getattr(tokenizer, "prefix_ids", ()), *whole([text])[0]] == list(token_ids)
