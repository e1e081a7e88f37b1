"""The front door: :func:`assemble_prompt` over one process-wide default
:class:`~promptsplice.assembler.Assembler` per ``(tokenizer, block_size)``."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence, Mapping
from typing import Any

from promptsplice.assembler._assemble import Assembler
from promptsplice.assembler._ordering import AlignPolicy, OrderPolicy, parse_align, parse_order
from promptsplice.assembler._prompt import AssembledPrompt
from promptsplice.assembler._tokenizers import Tokenizer, load_tokenizer, same_tokenizer
from promptsplice._validate import check_block_size, check_bool
from promptsplice.errors import ConfigError

__all__ = ["assemble_prompt"]


_DEFAULTS: dict[tuple[str, int, bool], Assembler] = {}
_DEFAULTS_LOCK = threading.Lock()


def _default_assembler(tokenizer: Tokenizer | str | None, block_size: int, trust_markup: bool = False) -> Assembler:
    tok = load_tokenizer(tokenizer)
    key = (tok.name, block_size, check_bool(trust_markup, "trust_markup"))
    with _DEFAULTS_LOCK:
        asm = _DEFAULTS.get(key)
        if asm is None:
            asm = _DEFAULTS[key] = Assembler(tok, block_size=block_size, trust_markup=trust_markup)
    if asm.tokenizer is not tok and (not same_tokenizer(asm.tokenizer, tok) or _settings(asm.tokenizer) != _settings(tok)):
        # keyed by name: another tokenizer under one name would get the first one's ids,
        # padding or control tokens (HFTokenizer.from_file(path, filler_token_id=...) and
        # tokenizer=path share their name)
        raise ConfigError(
            f"two tokenizers that differ (in how they split text, their filler token, control tokens "
            f"or BOS) are both named {tok.name!r}: give each its own name (HFTokenizer(..., name=...)), "
            "or pass assembler=Assembler(tokenizer)"
        )
    return asm


def _settings(tok: Tokenizer) -> tuple[Any, ...]:
    """What besides its splitting a tokenizer gives an assembler."""
    return (tok.filler_token_id, tuple(getattr(tok, "prefix_ids", ())), dict(getattr(tok, "special_tokens", None) or {}))


def assemble_prompt(
    chunks: Iterable[Any],
    *,
    query: str,
    system: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tokenizer: Tokenizer | str | None = None,
    block_size: int | None = None,
    policy: str | OrderPolicy | None = None,
    alignment: str | AlignPolicy | None = None,
    salt: str | None = None,
    max_tokens: int | None = None,
    assembler: Assembler | None = None,
    trust_markup: bool = False,
) -> AssembledPrompt:
    """Dedup, order and tokenize ``chunks`` into a block-aligned prompt.

    ``chunks`` are str, bytes, dicts with ``text``/``id``/``metadata`` or LangChain
    ``Document``s.  ``block_size`` defaults to 16 (take it from the engine).  It is
    :meth:`Assembler.assemble`: a prompt to send (learned, and admitted where the
    assembler owns its mirror).  ``policy``
    is ``retrieval``, ``stable`` or ``cache_aware`` (the default: best on the worst trace
    family of ``promptsplice bench assemble --suite``); ``alignment`` is ``auto``
    (default), ``none`` or ``all``.  ``salt`` isolates a tenant's cache entries (a
    non-empty str; pass the same value to the engine as ``cache_salt``).  Without an
    ``assembler``, a process-wide default per ``(tokenizer, block_size)`` keeps the
    popularity and mirror state between calls.  With one, its tokenizer, block size,
    policy, alignment and ``trust_markup`` apply, and a different ``tokenizer``,
    ``block_size``, ``policy`` or ``alignment`` (or ``trust_markup=True`` against an
    assembler without it) is a :class:`ConfigError` (per-call overrides:
    ``assembler.assemble(...)``).

    Caller content is text: control-token markup (``<|im_start|>``...) in chunks, the
    query, the system prompt or the tools is tokenized as ordinary text, so a poisoned
    document cannot speak as the system; only the prompt format's own markup gives
    control tokens.  ``trust_markup=True`` (for callers who pass markup on purpose,
    e.g. a pre-rendered system turn) reads it as control tokens.
    """
    if assembler is not None:
        if not isinstance(assembler, Assembler):
            raise ConfigError(f"assembler must be an Assembler, got {type(assembler).__name__}")
        _check_same_as_assembler(assembler, tokenizer=tokenizer, block_size=block_size,
                                 policy=policy, alignment=alignment)
        if check_bool(trust_markup, "trust_markup") and not assembler.trust_markup:
            raise ConfigError(
                "trust_markup=True differs from the assembler's trust_markup=False; build "
                "the assembler with Assembler(..., trust_markup=True)"
            )
        asm = assembler
    else:
        size = 16 if block_size is None else check_block_size(block_size)
        # Parsed here so a bad name fails before the default assembler is built.
        policy = "cache_aware" if policy is None else parse_order(policy)
        alignment = "auto" if alignment is None else parse_align(alignment)
        asm = _default_assembler(tokenizer, size, trust_markup)
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


def _check_same_as_assembler(asm: Assembler, **given: Any) -> None:
    """``assemble_prompt(assembler=asm, ...)``: every setting passed must be the assembler's."""
    own = {"block_size": asm.block_size, "policy": asm.policy, "alignment": asm.alignment}
    parse = {"block_size": check_block_size, "policy": parse_order, "alignment": parse_align}
    for name, value in given.items():
        if value is None:
            continue
        if name == "tokenizer":
            tok = load_tokenizer(value)
            # by what they make of a probe, not by name: a copy of the same tokenizer.json
            # was refused, another tokenizer under the same name accepted
            # (its filler, BOS and control tokens too: a tokenizer that splits alike but
            # adds a BOS or pads otherwise was accepted, and the assembler's were used)
            if not same_tokenizer(tok, asm.tokenizer) or _settings(tok) != _settings(asm.tokenizer):
                raise ConfigError(
                    f"tokenizer {tok.name!r} differs from the assembler's {asm.tokenizer.name!r}; "
                    "leave tokenizer unset when passing an assembler"
                )
            continue
        if parse[name](value) != own[name]:
            fix = (
                f"call assembler.assemble(..., {name}=...) for one call"
                if name != "block_size"  # the engine's: an assembler has one
                else "build an Assembler(..., block_size=...) for that engine"
            )
            raise ConfigError(
                f"{name}={value!r} differs from the assembler's {own[name]!r}; leave {name} unset "
                f"when passing an assembler (or {fix})"
            )
