"""Tokenizer protocol and adapters (Hugging Face ``tokenizers``, ``tiktoken``).

Assembly happens in token space, so every adapter encodes *without* special tokens
(no BOS): segments are tokenized separately and concatenated, and the chat template or
the engine adds what the model needs.  Each adapter names a ``filler_token_id``: one
token that decodes to whitespace, used to pad a segment to a block boundary.

Backends are imported lazily so that ``import assembler`` stays light.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from promptsplice.errors import TokenizerError

__all__ = [
    "Tokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "load_tokenizer",
    "default_tokenizer",
    "tiktoken_cache_dir",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What the assembler needs from a tokenizer."""

    name: str
    """Identity used in cache keys: two tokenizers with one name must encode alike."""
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


class HFTokenizer:
    """Adapter over a Hugging Face fast tokenizer (``tokenizers.Tokenizer``)."""

    __slots__ = ("name", "filler_token_id", "_tok")

    def __init__(self, tokenizer: Any, *, name: str, filler_token_id: int | None = None):
        # Accept a transformers PreTrainedTokenizerFast too: use its backend.
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "encode_batch"):
            raise TokenizerError(
                f"{type(tokenizer).__name__} is not a Hugging Face fast tokenizer; pass a "
                "tokenizers.Tokenizer, a PreTrainedTokenizerFast or a tokenizer.json path"
            )
        self._tok = backend
        self.name = name
        self.filler_token_id = (
            filler_token_id
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
        return cls(tok, **kwargs)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


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
        self._enc = encoding
        self.name = f"tiktoken:{encoding.name}"
        self.filler_token_id = (
            filler_token_id
            if filler_token_id is not None
            else _single_token(self.encode, (" ", "\n"), self.name)
        )

    @staticmethod
    def _load(name: str) -> Any:
        import tiktoken

        with _TIKTOKEN_LOCK:
            # Offline: use litellm's copy unless the user set their own cache folder.
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

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids))

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.name!r})"


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> HFTokenizer:
    """The default model's tokenizer (SmolLM2-135M-Instruct), read from the packaged
    GGUF's metadata once and cached (:mod:`promptsplice.assets`): no weights, no torch."""
    from promptsplice.assets import DEFAULT_MODEL_NAME, ensure_default_tokenizer

    folder = ensure_default_tokenizer()
    return HFTokenizer.from_file(folder / "tokenizer.json", name=f"hf:{DEFAULT_MODEL_NAME}")


def load_tokenizer(spec: str | Tokenizer | None = None) -> Tokenizer:
    """Resolve a tokenizer spec.

    ``None`` or ``"default"``: the default model's tokenizer; ``"tiktoken:NAME"``: a
    tiktoken encoding (e.g. ``cl100k_base``); a path: a ``tokenizer.json`` file or a
    folder holding one; an object with ``encode``/``decode``: used as is.
    """
    if spec is None or spec == "default":
        return default_tokenizer()
    if not isinstance(spec, str):
        if isinstance(spec, Tokenizer):
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


@functools.lru_cache(maxsize=8)
def _tiktoken(name: str) -> TiktokenTokenizer:
    return TiktokenTokenizer(name)


@functools.lru_cache(maxsize=8)
def _hf_file(path: str) -> HFTokenizer:
    return HFTokenizer.from_file(path)
