"""Bounded, thread-safe per-segment token cache keyed by content digest.

A retrieved chunk that comes back in many requests is tokenized once: the cache maps
``(tokenizer key, segment prefix, content digest)`` to its token ids (the key:
:func:`~promptsplice.assembler._tokenizers.tokenizer_key`, never the name alone).  The digest comes
from :mod:`promptsplice.blocks` (the one content hash, which is not collision-resistant),
and a hit is confirmed against the stored text itself, so a crafted collision can never
hand one document (one tenant's) the tokens of another: the text confirmed a hit by its
length before, which a collision of equal length passed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from promptsplice._validate import check_int

__all__ = ["TokenCache", "TokenCacheStats"]


class TokenCacheStats(NamedTuple):
    hits: int
    misses: int
    entries: int
    tokens: int


class TokenCache:
    """LRU over token-id tuples (each with its text), bounded by total tokens held."""

    def __init__(self, max_tokens: int = 4_000_000) -> None:
        check_int(max_tokens, "TokenCache max_tokens")
        self.max_tokens = max_tokens
        self._data: OrderedDict[tuple[str, str, bytes], tuple[str, tuple[int, ...]]] = OrderedDict()
        self._tokens = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get_many(
        self,
        tokenizer_name: str,
        items: Sequence[tuple[str, bytes, str]],
        encode_batch: Callable[[list[str]], list[list[int]]],
    ) -> list[tuple[int, ...]]:
        """Token ids for each ``(prefix, digest, text)``; misses are encoded in one batch.

        ``text`` is the full segment text (prefix included) and is only encoded on a miss.
        """
        out: list[tuple[int, ...] | None] = [None] * len(items)
        missing: list[int] = []
        with self._lock:
            data = self._data
            for i, (prefix, digest, text) in enumerate(items):
                key = (tokenizer_name, prefix, digest)
                entry = data.get(key)
                if entry is not None and entry[0] == text:  # (a memcmp; the digest already read it)
                    data.move_to_end(key)
                    out[i] = entry[1]
                else:
                    missing.append(i)
            self._hits += len(items) - len(missing)
            self._misses += len(missing)
        if missing:
            encoded = encode_batch([items[i][2] for i in missing])
            with self._lock:
                for i, ids in zip(missing, encoded):
                    tup = tuple(ids)
                    out[i] = tup
                    prefix, digest, text = items[i]
                    self._put((tokenizer_name, prefix, digest), (text, tup))
        return out  # type: ignore[return-value]

    def _put(self, key: tuple[str, str, bytes], value: tuple[str, tuple[int, ...]]) -> None:
        old = self._data.pop(key, None)
        if old is not None:
            self._tokens -= len(old[1])
        if len(value[1]) > self.max_tokens:
            return  # larger than the whole cache: not worth evicting everything
        self._data[key] = value
        self._tokens += len(value[1])
        while self._tokens > self.max_tokens:
            _, (_, ids) = self._data.popitem(last=False)
            self._tokens -= len(ids)

    def stats(self) -> TokenCacheStats:
        with self._lock:
            return TokenCacheStats(self._hits, self._misses, len(self._data), self._tokens)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._tokens = 0
