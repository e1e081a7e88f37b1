"""Tokenizer protocol and adapters (Hugging Face ``tokenizers``, ``tiktoken``), and
*marked text*: untrusted text is tokenized as text.

Assembly happens in token space, so every adapter encodes *without* special tokens
(no BOS): segments are tokenized separately and concatenated, and the chat template or
the engine adds what the model needs.  Each adapter names a ``filler_token_id``: one
token that decodes to whitespace, used to pad a segment to a block boundary.

Backends are imported lazily so that ``import assembler`` stays light.

Untrusted text is text.  A retrieved chunk, a query, a tool output or a user message
that contains ``<|im_start|>system`` must not become the model's control tokens (a
poisoned document would speak as the system).  The assembler and the renderer therefore
tokenize *marked text* (:class:`Markup`): control-token strings written raw come from a
template or format (trusted) and become control tokens; in caller content they are
escaped (:meth:`Markup.escape`, a noncharacter ``U+FDD0`` plus the token's index) and
are encoded as ordinary text (:func:`encode_marked_batch`).  Marked text without an
escape is encoded whole, exactly as before.  The adapters name their control tokens
(``special_tokens``) and encode text with markup kept as text (``encode_text_batch``:
``encode_special_tokens`` for HF, ``encode_ordinary`` for tiktoken) or recognized
(``encode_markup_batch``).  A tokenizer without these attributes is used through its
``encode_batch`` alone (no protection: wrap it in an adapter).  Added tokens that a
vocabulary does not flag special but that are spelled like markup (Qwen's
``<tool_call>``) are control tokens here too.

Kept as one module (~700 lines): what counts as a control token, how each adapter
encodes text around it and how :class:`Markup` escapes it are one rule, and a change to
one of them without the others let caller text produce control tokens.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import json
import operator
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from promptsplice.errors import InputError, InvalidUTF8Error, TokenizerError

__all__ = [
    "Tokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "load_tokenizer",
    "same_tokenizer",
    "default_tokenizer",
    "tiktoken_cache_dir",
    "Markup",
    "markup_for",
    "tokenizer_key",
    "encode_marked_batch",
    "MARKUP_ESCAPE",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What the assembler needs from a tokenizer."""

    name: str
    """A name for messages and cache keys (which add what the tokenizer makes of a probe
    text and its control tokens, :func:`tokenizer_key`)."""
    filler_token_id: int
    """A single token that decodes to whitespace (block padding)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _single_token(encode: Any, candidates: Sequence[str], who: str) -> int:
    for text in candidates:
        ids = encode(text)
        if len(ids) == 1:
            return ids[0]
    raise TokenizerError(
        f"{who} has no single token for any of {list(candidates)!r}; pass "
        "filler_token_id= explicitly (a token that decodes to whitespace)"
    )


def _unencodable(texts: Sequence[Any], exc: Exception) -> InputError:
    """What a tokenizer's ``TypeError`` on ``texts`` means, as the library's error."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            return InputError(f"text {i} to encode is a {type(text).__name__}, not a str")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as bad:
            return InvalidUTF8Error.lone_surrogate(f"text {i}", text, bad, index=i)
    return InputError(f"the tokenizer could not encode the text: {exc}")


def _ids_hint(ids: Any) -> str:
    try:
        shown = list(ids)
    except TypeError:
        return repr(ids)
    return repr(shown[:8]) + ("..." if len(shown) > 8 else "")


def _decodable(ids: Any, vocab_size: int, who: str) -> list[int]:
    """``ids`` as a list of ids this vocabulary decodes (ints, numpy's too, from 0 to
    ``vocab_size - 1``); else :class:`InputError`: Hugging Face's decoder dropped an id
    past the vocabulary silently, and both read ``True`` as id 1.  Checked by the list's
    min and max, and its types only where 0 or 1 is (C loops: decode runs per diff)."""
    if isinstance(ids, str | bytes | bytearray | Mapping):
        raise InputError(f"{who}: decode takes a list of token ids, got {type(ids).__name__}")
    try:
        out = list(ids)
    except TypeError as exc:
        raise InputError(f"{who}: decode takes a list of token ids, got {type(ids).__name__}") from exc
    if not out:
        return out
    try:
        lo, hi = min(out), max(out)
    except TypeError:  # None, a str: not comparable with ints
        lo = hi = None
    # a bool can only hide where 0 or 1 is; a float or a str makes lo or hi not an int
    if (type(lo) is not int or type(hi) is not int or lo <= 1) and set(map(type, out)) != {int}:
        for i, t in enumerate(out):
            try:
                if type(t).__name__ in ("bool", "bool_"):  # Python's and numpy's
                    raise TypeError
                out[i] = operator.index(t)
            except TypeError:
                raise InputError(
                    f"{who}: cannot decode {_ids_hint(out)}: item {i} ({t!r:.40}) is not a token id (an int)"
                ) from None
        lo, hi = min(out), max(out)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(
            f"{who}: cannot decode {_ids_hint(out)}: id {bad} is not in this vocabulary (0 to "
            f"{vocab_size - 1}); pass token ids of this tokenizer"
        )
    return out


def _texts(texts: Any, who: str) -> list[Any]:
    """``encode_batch``'s texts as a list: a str would be encoded character by character."""
    if isinstance(texts, str | bytes | bytearray):
        raise InputError(f"{who}: encode_batch takes a list of str, got one {type(texts).__name__}: pass [text]")
    return list(texts)


def check_filler(tok: Any, filler: Any, who: str) -> int:
    """``filler`` as a padding token of ``tok``, or ``TokenizerError`` naming
    ``filler_token_id``: an int id in the vocabulary, not a control token, that decodes
    to whitespace only (a letter or ``<|endoftext|>`` would be padded into the prompt)."""
    if isinstance(filler, bool) or not isinstance(filler, int):
        raise TokenizerError(f"{who}: filler_token_id must be an int token id, got {type(filler).__name__} {filler!r}")
    size = getattr(tok, "vocab_size", None)
    if filler < 0 or (isinstance(size, int) and filler >= size):
        raise TokenizerError(
            f"{who}: filler_token_id={filler} is not a token id of this vocabulary"
            + (f" (0 to {size - 1})" if isinstance(size, int) else "")
        )
    specials = getattr(tok, "special_tokens", None)
    if isinstance(specials, Mapping) and filler in specials.values():
        raise TokenizerError(f"{who}: filler_token_id={filler} is a control token; pick one that decodes to whitespace")
    try:
        text = tok.decode([filler])
    except Exception as exc:  # a foreign decoder's own error: the id is not usable
        raise TokenizerError(f"{who}: filler_token_id={filler} does not decode ({exc})") from exc
    if not text or text.strip():
        raise TokenizerError(
            f"{who}: filler_token_id={filler} decodes to {text!r}, not whitespace: padding would put "
            "it into the prompt's text; pick a token that decodes to whitespace (' ' or '\\n')"
        )
    return filler


def _check_segment_safe(tok: Any, who: str) -> None:
    """Refuse a tokenizer whose encode of two texts, concatenated, is not the encode of
    the two texts joined: assembly tokenizes segment by segment and sends the ids
    concatenated.  SentencePiece's dummy prefix does that (a "▁" before every call's
    text: Llama-2, Mistral v0.1-v0.3, Mixtral, TinyLlama): each segment would start with
    a space the caller never wrote."""
    joined = tok.decode(tok.encode("a") + tok.encode("b"))
    if joined != tok.decode(tok.encode("ab")):
        raise TokenizerError(
            f"{who} adds text at the start of every encode call ({joined!r} for 'a' then 'b'; "
            "a SentencePiece dummy prefix, as Llama-2 and Mistral v0.1-v0.3 have): "
            "promptsplice encodes segment by segment, so every segment would start with a "
            "space nobody wrote. Use a tokenizer.json without the prefix (Metaspace "
            "prepend_scheme 'never', or the Prepend normalizer removed), or a byte-level BPE model"
        )


class HFTokenizer:
    """Adapter over a Hugging Face fast tokenizer (``tokenizers.Tokenizer``).

    ``model_dir``: the model folder it was read from (as given, symlinks unresolved: a
    Hugging Face cache snapshot links its files into a shared blob folder), where a chat
    renderer finds the model's template; ``None`` when it came from no folder."""

    __slots__ = ("name", "filler_token_id", "model_dir", "prefix_ids", "_tok", "_text_tok", "_lock", "_ids")

    def __init__(self, tokenizer: Any, *, name: str, filler_token_id: int | None = None,
                 model_dir: str | os.PathLike[str] | None = None):
        # Accept a transformers PreTrainedTokenizerFast too: use its backend.
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "encode_batch"):
            raise TokenizerError(
                f"{type(tokenizer).__name__} is not a Hugging Face fast tokenizer; pass a "
                "tokenizers.Tokenizer, a PreTrainedTokenizerFast or a tokenizer.json path"
            )
        if not isinstance(name, str) or not name:
            raise TokenizerError(f"HFTokenizer needs a name (a non-empty str), got {name!r}")
        # A private copy without truncation or padding: a transformers call elsewhere
        # switches them on in a shared backend (every segment then came out cut, and the
        # token cache kept the cut ids), and tokens added to it later were not escaped in
        # caller text (until 2026-12-08 the caller's backend object was used as it was)
        from tokenizers import Tokenizer as _HFTok

        try:
            backend = _HFTok.from_str(backend.to_str())
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise TokenizerError(f"cannot copy the tokenizer {name!r}: {exc}") from exc
        backend.no_truncation()
        backend.no_padding()
        self._tok = backend
        self._text_tok: Any = None
        self._ids: tuple[int, int, frozenset[int] | None] | None = None
        self._lock = threading.Lock()
        self.name = name
        self.model_dir = None if model_dir is None else Path(model_dir).absolute()
        _check_segment_safe(self, name)
        # what its post-processor puts before any text (Llama-3's <|begin_of_text|>,
        # Gemma's <bos>): vLLM's text path adds it, prompt_token_ids carry it or not
        plain, added = (backend.encode(t, add_special_tokens=f).ids for t, f in (("a", False), ("a", True)))
        cut = next((i for i in range(len(added) + 1) if added[i:i + len(plain)] == plain), 0)
        self.prefix_ids: tuple[int, ...] = tuple(added[:cut])
        self.filler_token_id = (
            check_filler(self, filler_token_id, name)
            if filler_token_id is not None
            else _single_token(self.encode, (" ", "\n"), name)
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> HFTokenizer:
        """Load ``tokenizer.json`` (or a folder holding it)."""
        from tokenizers import Tokenizer as _HFTok

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        try:
            tok = _HFTok.from_file(str(p))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise TokenizerError(f"cannot load a tokenizer from {p}: {exc}") from exc
        kwargs.setdefault("name", f"hf:{p.resolve()}")
        kwargs.setdefault("model_dir", p.parent)
        return cls(tok, **kwargs)

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError as exc:  # not a str, or a lone surrogate (no UTF-8 form)
            raise _unencodable([text], exc) from exc

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        try:
            return [e.ids for e in self._tok.encode_batch(_texts(texts, self.name), add_special_tokens=False)]
        except TypeError as exc:
            raise _unencodable(texts, exc) from exc

    def encode_markup_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Special-token markup in ``texts`` becomes control tokens (trusted text)."""
        return self.encode_batch(texts)

    def encode_text_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Special-token markup in ``texts`` stays ordinary text (untrusted text)."""
        if self._text_tok is None:
            with self._lock:
                if self._text_tok is None:
                    from tokenizers import Tokenizer as _HFTok

                    spec = json.loads(self._tok.to_str())
                    for added in spec.get("added_tokens") or ():  # markup that is not flagged special
                        if _is_markup(added.get("content") or "", bool(added.get("special"))):
                            added["special"] = True  # (Qwen's <tool_call>): text too, not matched
                    copy = _HFTok.from_str(json.dumps(spec))
                    copy.encode_special_tokens = True
                    self._text_tok = copy
        return [e.ids for e in self._text_tok.encode_batch(_texts(texts, self.name), add_special_tokens=False)]

    @property
    def special_tokens(self) -> dict[str, int]:
        """The control tokens: text -> id of the added tokens marked special, and of those
        not marked but spelled as markup (not whitespace: Qwen's ``<tool_call>``)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if _is_markup(t.content, t.special)}

    def _id_range(self) -> tuple[int, frozenset[int] | None]:
        """One past the vocabulary's largest id, and the ids it lists when they have gaps
        (``None`` when they run 0 to the largest).  A vocabulary with a hole has ids at or
        past its token count, and Hugging Face's decoder drops a missing id silently.
        Listed again when the token count changes."""
        count = self._tok.get_vocab_size(with_added_tokens=True)
        known = self._ids
        if known is None or known[0] != count:
            listed = frozenset(self._tok.get_vocab(with_added_tokens=True).values())
            upper = max(max(listed, default=-1) + 1, count)
            known = self._ids = (count, upper, None if len(listed) == upper else listed)
        return known[1], known[2]

    def decode(self, ids: Sequence[int]) -> str:
        upper, listed = self._id_range()
        ids = _decodable(ids, upper, self.name)
        if listed is not None and not listed.issuperset(ids):
            for i in ids:  # get_vocab maps text to ids: a piece listed twice hides an id
                if i not in listed and self._tok.id_to_token(i) is None:
                    raise InputError(
                        f"{self.name}: cannot decode {_ids_hint(ids)}: id {i} is not in this vocabulary "
                        "(it has no token with that id); pass token ids of this tokenizer"
                    )
        try:
            return self._tok.decode(ids, skip_special_tokens=False)
        except (TypeError, OverflowError) as exc:  # ids that are not token ids
            raise InputError(f"{self.name}: cannot decode {_ids_hint(ids)}: pass token ids of this vocabulary") from exc

    @property
    def vocab_size(self) -> int:
        """One past the largest token id (added tokens included), as tiktoken's
        ``n_vocab``: the ids are 0 to ``vocab_size - 1``, with gaps in some vocabularies."""
        return self._id_range()[0]

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def _is_markup(content: str, special: bool) -> bool:
    """An added token untrusted text must not produce: special, or spelled like markup
    (whitespace runs that some vocabularies add unflagged are ordinary text)."""
    return bool(content) and (special or not content.isspace())


def tiktoken_cache_dir() -> Path | None:
    """The folder in the ``litellm`` package that holds tiktoken's encoding files.

    litellm ships cl100k/o200k/p50k files under the names tiktoken's cache expects, so
    pointing ``TIKTOKEN_CACHE_DIR`` there makes tiktoken work without internet.
    """
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
    return folder if folder.is_dir() else None


_TIKTOKEN_LOCK = threading.Lock()


class TiktokenTokenizer:
    """Adapter over a ``tiktoken`` encoding (OpenAI models)."""

    __slots__ = ("name", "filler_token_id", "_enc")

    def __init__(self, encoding: str | Any, *, filler_token_id: int | None = None):
        if isinstance(encoding, str):
            encoding = self._load(encoding)
        elif not isinstance(getattr(encoding, "name", None), str) or not hasattr(encoding, "encode_ordinary_batch"):
            raise TokenizerError(
                f"TiktokenTokenizer takes an encoding name (such as 'cl100k_base') or a tiktoken "
                f"Encoding, got {type(encoding).__name__}"
            )
        self._enc = encoding
        self.name = f"tiktoken:{encoding.name}"
        self.filler_token_id = (
            check_filler(self, filler_token_id, self.name)
            if filler_token_id is not None
            else _single_token(self.encode, (" ", "\n"), self.name)
        )

    @staticmethod
    def _load(name: str) -> Any:
        try:
            import tiktoken
        except ImportError as exc:
            raise TokenizerError(
                "tiktoken is not installed: pip install 'promptsplice[tiktoken]' (offline, also "
                "pip install --no-deps litellm==1.110.2, which ships the encoding files)"
            ) from exc

        known = tiktoken.list_encoding_names()
        if name not in known:
            raise TokenizerError(f"unknown tiktoken encoding {name!r}; known: {', '.join(sorted(known))}")
        with _TIKTOKEN_LOCK:
            # Offline: use litellm's copy unless the user set their own cache folder, for
            # this load only (set for the whole process, it sent every later tiktoken
            # user, and subprocesses, to a folder inside site-packages).
            folder = None
            if "TIKTOKEN_CACHE_DIR" not in os.environ and "DATA_GYM_CACHE_DIR" not in os.environ:
                folder = tiktoken_cache_dir()
            if folder is not None:
                os.environ["TIKTOKEN_CACHE_DIR"] = str(folder)
            try:
                return tiktoken.get_encoding(name)
            except Exception as exc:
                raise TokenizerError(
                    f"cannot load tiktoken encoding {name!r}: {exc}. Offline, install "
                    "litellm (it ships the encoding files) or set TIKTOKEN_CACHE_DIR"
                ) from exc
            finally:
                if folder is not None:
                    os.environ.pop("TIKTOKEN_CACHE_DIR", None)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(_texts(texts, self.name))

    def encode_markup_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Special-token markup in ``texts`` becomes control tokens (trusted text)."""
        return self._enc.encode_batch(_texts(texts, self.name), allowed_special="all")

    def encode_text_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Special-token markup in ``texts`` stays ordinary text (untrusted text)."""
        return self._enc.encode_ordinary_batch(_texts(texts, self.name))

    @property
    def special_tokens(self) -> dict[str, int]:
        """The encoding's special tokens: text -> id."""
        return {t: self._enc.encode_single_token(t) for t in self._enc.special_tokens_set}

    def decode(self, ids: Sequence[int]) -> str:
        ids = _decodable(ids, self._enc.n_vocab, self.name)
        try:
            return self._enc.decode(ids)
        except (KeyError, TypeError, OverflowError, ValueError) as exc:  # ids that are not token ids
            raise InputError(f"{self.name}: cannot decode {_ids_hint(ids)}: pass token ids of this vocabulary") from exc

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.name!r})"


def _built_once(maxsize: int) -> Any:
    """``functools.lru_cache`` that builds each value once when threads ask together
    (a bare ``lru_cache`` runs the function in every thread that misses: 16 request
    threads on a cold start built the default tokenizer 16 times, in 10x the time)."""

    def wrap(fn: Any) -> Any:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        lock = threading.Lock()

        @functools.wraps(fn)
        def once(*args: Any) -> Any:
            with lock:
                return cached(*args)

        once.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return once

    return wrap


@_built_once(maxsize=1)
def default_tokenizer() -> HFTokenizer:
    """The default model's tokenizer (SmolLM2-135M-Instruct), read from the packaged
    GGUF's metadata once and cached (:mod:`promptsplice.assets`): no weights, no torch."""
    from promptsplice.assets import DEFAULT_MODEL_NAME, ensure_default_tokenizer

    folder = ensure_default_tokenizer()
    return HFTokenizer.from_file(folder / "tokenizer.json", name=f"hf:{DEFAULT_MODEL_NAME}")


def load_tokenizer(spec: str | Tokenizer | None = None) -> Tokenizer:
    """Resolve a tokenizer spec.

    ``None`` or ``"default"``: the default model's tokenizer; ``"tiktoken:NAME"``: a
    tiktoken encoding (e.g. ``cl100k_base``); a path (``str`` or ``os.PathLike``): a
    ``tokenizer.json`` file or a folder holding one; an object with ``encode``/``decode``: used as is.
    """
    if spec is None or spec == "default":
        return default_tokenizer()
    if isinstance(spec, os.PathLike):  # a pathlib.Path to tokenizer.json or its folder
        spec = os.fsdecode(os.fspath(spec))
    if not isinstance(spec, str):
        if isinstance(spec, Tokenizer):
            if not isinstance(spec, HFTokenizer | TiktokenTokenizer):  # those checked theirs when built
                check_filler(spec, spec.filler_token_id, getattr(spec, "name", type(spec).__name__))
            return spec
        raise TokenizerError(
            f"{type(spec).__name__} does not implement the Tokenizer protocol (name, "
            "filler_token_id, encode, encode_batch, decode); wrap it in HFTokenizer"
        )
    if spec.startswith("tiktoken:"):
        return _tiktoken(spec.split(":", 1)[1])
    if Path(spec).exists():
        return _hf_file(str(Path(spec).resolve()))
    raise TokenizerError(
        f"unknown tokenizer {spec!r}: use 'default', 'tiktoken:ENCODING' or a path to "
        "tokenizer.json"
    )


# Words, code, digits, spaces, accents, CJK, emoji: vocabularies that split it alike agree on our texts.
_IDENTITY_PROBE = (
    "Hello, world! The quick brown fox: 12345 tokens, 3.14159 and 2026-12-04.\n"
    "def f(x):\n    return {'k': [x, None]}  # ünïcode — naïve café\n\t"
    "東京の天気は晴れです。 Привет, мир! 🚀🙂 <div class=\"a\">&amp;</div>   end"
)
_IDENTITY_LOCK = threading.Lock()
_IDENTITIES: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _identity(tok: Tokenizer) -> tuple[int, ...]:
    """What ``tok`` makes of the probe text (memoized per tokenizer object)."""
    with _IDENTITY_LOCK:
        known = _IDENTITIES.get(id(tok))
        if known is not None and known[0] is tok:
            return known[1]
    ids = tuple(int(i) for i in tok.encode(_IDENTITY_PROBE))
    with _IDENTITY_LOCK:
        if len(_IDENTITIES) >= 64:
            _IDENTITIES.pop(next(iter(_IDENTITIES)))
        _IDENTITIES[id(tok)] = (tok, ids)  # the object is kept, so its id is not reused
    return ids


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether ``a`` and ``b`` split text alike (the same object, or the same ids for a
    probe of words, code, digits, spaces and several scripts).  Names are not compared:
    one tokenizer.json loaded from two paths has two names and one vocabulary."""
    for what, tok in (("a", a), ("b", b)):  # a spec (str: it has encode) is no tokenizer
        if not (callable(getattr(tok, "encode", None)) and callable(getattr(tok, "decode", None))):
            raise TokenizerError(f"same_tokenizer: {what} must be a Tokenizer, got {type(tok).__name__}; use load_tokenizer")
    return a is b or _identity(a) == _identity(b)


@_built_once(maxsize=8)
def _tiktoken(name: str) -> TiktokenTokenizer:
    return TiktokenTokenizer(name)


@_built_once(maxsize=8)
def _hf_file(path: str) -> HFTokenizer:
    return HFTokenizer.from_file(path)


# -- marked text -------------------------------------------------------------------------

MARKUP_ESCAPE = "\ufdd0"
"""Starts an escape in marked text (a Unicode noncharacter, reserved for internal use)."""
_INDEX_BASE = 0xF0000  # escaped control token k is MARKUP_ESCAPE + chr(_INDEX_BASE + k)


class Markup:
    """Marked text for one tokenizer's control tokens (see the module docstring).

    In marked text a control-token string written raw is a control token; ``U+FDD0``
    followed by ``chr(0xF0000 + k)`` is control token ``k``'s string as ordinary text,
    and ``U+FDD0`` followed by any other character is that character as ordinary text
    (``U+FDD0 U+FDD0``: a literal ``U+FDD0``).  Escaped characters never take part in
    a control token, so caller content cannot complete one that a template starts or
    ends next to it (``'<|' + role + '|>'``).
    """

    __slots__ = ("specials", "ids", "_index", "_by_id", "_firsts", "_find", "_split", "_heads", "_tails", "_maxlen")

    def __init__(self, special_tokens: Mapping[str, int]) -> None:
        self.specials = sorted((s for s in special_tokens if s), key=lambda s: (-len(s), s))
        self.ids = [special_tokens[s] for s in self.specials]
        self._index = {s: k for k, s in enumerate(self.specials)}
        self._by_id = dict(zip(self.ids, self.specials))
        self._firsts = "".join(sorted({s[0] for s in self.specials} | {MARKUP_ESCAPE}))
        alts = [re.escape(s) for s in self.specials]
        self._find = re.compile("|".join([*alts, MARKUP_ESCAPE]))
        self._split = re.compile("|".join([*alts, MARKUP_ESCAPE + "."]), re.S)
        # Proper suffixes (by first character) and prefixes (by last character) of the
        # control tokens: content that starts or ends with one (or lies inside one)
        # could complete a control token with the template text next to it.
        self._maxlen = max((len(t) for t in self.specials), default=0)
        heads = {t[j:] for t in self.specials for j in range(1, len(t))}
        tails = {t[:j][::-1] for t in self.specials for j in range(1, len(t))}  # reversed
        never = re.compile(r"(?!)")
        self._heads = re.compile("|".join(map(re.escape, sorted(heads, key=len)))) if heads else never
        self._tails = re.compile("|".join(map(re.escape, sorted(tails, key=len)))) if tails else never

    def _may_hold(self, text: str) -> bool:
        return any(c in text for c in self._firsts)

    def escape(self, text: str) -> str:
        """Untrusted ``text`` as marked text: its control-token strings stay text, and
        so do its edges where they could complete a control token with a neighbour."""
        if not text:
            return text
        head = tail = ""
        inside = len(text) < self._maxlen and any(text in t[1:] for t in self.specials)
        if (inside or self._heads.match(text)) and self._plain(text[0]):
            head, text = MARKUP_ESCAPE + text[0], text[1:]
        if text and self._tails.match(text[: -self._maxlen - 1 : -1]) and self._plain(text[-1]):
            tail, text = MARKUP_ESCAPE + text[-1], text[:-1]
        if self._may_hold(text):
            text = self._find.sub(self._escape_one, text)
        return head + text + tail if head or tail else text

    def escape_name(self, text: str) -> str:
        """A fixed word a template looks up or compares (a structural key such as
        ``"name"``, a standard role such as ``"tool"``) as marked text: its control-token
        strings stay text, but its edges are kept, so the lookup or comparison still
        matches.  Only for the renderer's own allowlists of words: caller text (an
        argument's name too) goes through :meth:`escape`, whose edges cannot finish a
        control token the template starts."""
        if MARKUP_ESCAPE in text or self.holds(text):
            return self._find.sub(self._escape_one, text)
        return text

    def holds(self, text: str) -> bool:
        """Whether ``text`` contains a control-token string."""
        return self._may_hold(text) and any(s in text for s in self.specials)

    def _plain(self, c: str) -> bool:
        """Whether ``U+FDD0 + c`` reads back as the literal ``c``."""
        return c != MARKUP_ESCAPE and not 0 <= ord(c) - _INDEX_BASE < len(self.specials)

    def _escape_one(self, m: re.Match[str]) -> str:
        s = m.group()
        if s == MARKUP_ESCAPE:
            return MARKUP_ESCAPE + MARKUP_ESCAPE
        return MARKUP_ESCAPE + chr(_INDEX_BASE + self._index[s])

    @staticmethod
    def trusted(text: str) -> str:
        """Trusted ``text`` (a template's) as marked text: its control-token strings
        are control tokens."""
        return text.replace(MARKUP_ESCAPE, MARKUP_ESCAPE + MARKUP_ESCAPE) if MARKUP_ESCAPE in text else text

    def split(self, marked: str) -> list[str | int]:
        """Marked text as pieces: ``str`` (ordinary text) and ``int`` (a control id)."""
        out: list[str | int] = []
        buf: list[str] = []
        pos = 0
        for m in self._split.finditer(marked):
            buf.append(marked[pos : m.start()])
            s = m.group()
            pos = m.end()
            if s[0] == MARKUP_ESCAPE and len(s) == 2 and s not in self._index:
                k = ord(s[1]) - _INDEX_BASE
                buf.append(self.specials[k] if 0 <= k < len(self.specials) else s[1])
                continue
            if buf:
                text = "".join(buf)
                if text:
                    out.append(text)
                buf = []
            out.append(self.ids[self._index[s]])
        buf.append(marked[pos:])
        text = "".join(buf)
        if text:
            out.append(text)
        return out

    def unescape(self, marked: str) -> str:
        """The real text of ``marked`` (what the tokens decode to)."""
        if MARKUP_ESCAPE not in marked:
            return marked
        return "".join(p if isinstance(p, str) else self._by_id[p] for p in self.split(marked))


_MARKUPS: dict[str, Markup] = {}
_MARKUPS_LOCK = threading.Lock()


def tokenizer_key(tokenizer: Tokenizer) -> str:
    """The key of what is cached per tokenizer (its markup escaper, segment tokens, the
    longest token's bytes): its name, the ids it makes of a probe text and its control
    tokens.  Two tokenizers of one name that split text or mark control tokens
    differently never share an entry (until 2026-12-07 the name alone was the key: a
    second tokenizer of a cached name, with one more control token, had caller text
    holding that token encoded as the control token, unescaped)."""
    specials = getattr(tokenizer, "special_tokens", None) or {}
    what = repr((_identity(tokenizer), sorted(specials.items())))
    return f"{tokenizer.name}\x00{hashlib.blake2b(what.encode('utf-8', 'surrogatepass'), digest_size=8).hexdigest()}"


def markup_for(tokenizer: Tokenizer) -> Markup:
    """The :class:`Markup` of ``tokenizer``'s control tokens (none for a tokenizer
    without ``special_tokens``), one per :func:`tokenizer_key`."""
    key = tokenizer_key(tokenizer)
    hit = _MARKUPS.get(key)
    if hit is None:
        specials = getattr(tokenizer, "special_tokens", None) or {}
        hit = Markup(specials)
        with _MARKUPS_LOCK:
            hit = _MARKUPS.setdefault(key, hit)
    return hit


def encode_marked_batch(tokenizer: Tokenizer, marked: Sequence[str]) -> list[list[int]]:
    """Token ids of marked texts: raw control-token strings (a template's) become
    control tokens, escaped ones (caller content) ordinary text.  A text without an
    escape is encoded whole, so its ids equal those of encoding the plain text."""
    markup = markup_for(tokenizer)
    whole = getattr(tokenizer, "encode_markup_batch", tokenizer.encode_batch)
    as_text = getattr(tokenizer, "encode_text_batch", tokenizer.encode_batch)
    out: list[list[int]] = [[] for _ in marked]
    plain = [i for i, t in enumerate(marked) if MARKUP_ESCAPE not in t]
    if plain:
        for i, ids in zip(plain, whole([marked[i] for i in plain])):
            out[i] = list(ids)
    if len(plain) == len(marked):
        return out
    split = {i: markup.split(t) for i, t in enumerate(marked) if MARKUP_ESCAPE in t}
    texts = [p for pieces in split.values() for p in pieces if isinstance(p, str)]
    encoded = iter(as_text(texts) if texts else [])
    for i, pieces in split.items():
        ids: list[int] = []
        for p in pieces:
            if isinstance(p, str):
                ids.extend(next(encoded))
            else:
                ids.append(p)
        out[i] = ids
    return out
