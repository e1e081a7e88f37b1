"""Reference bounds a bench reports beside its own numbers, so a trace cannot flatter it.

* :func:`radix_prefill_tokens`: what a token-granular radix tree (SGLang's ideal, no
  eviction) leaves to prefill on a sequence of prompts: each prompt minus its longest
  common prefix with any earlier prompt (at least one token is always computed, as in
  vLLM and SGLang).
* :class:`OracleCounter`: the bound for any reuse of exact content: after exact dedup,
  only the query and the chunk texts never seen in an earlier request are prefilled; the
  system prompt and the tool schemas after their first use are free.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["radix_prefill_tokens", "RadixPrefill", "OracleCounter"]


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


class RadixPrefill:
    """Online radix-ideal prefill: feed prompts in arrival order."""

    def __init__(self) -> None:
        self._sorted: list[tuple[int, ...]] = []
        self._arrays: dict[tuple[int, ...], np.ndarray] = {}
        self.prefill_tokens = 0
        self.prompt_tokens = 0

    def add(self, tokens: Sequence[int]) -> int:
        """Tokens this prompt leaves to prefill; records the prompt."""
        key = tuple(tokens)
        arr = np.asarray(key, dtype=np.int64)
        pos = bisect.bisect_left(self._sorted, key)
        best = 0
        # The longest common prefix with any member of a sorted set is reached at a
        # neighbour of the insertion point.
        for j in (pos - 1, pos):
            if 0 <= j < len(self._sorted):
                best = max(best, _lcp(arr, self._arrays[self._sorted[j]]))
        cached = min(best, max(len(key) - 1, 0))
        if key not in self._arrays:
            self._sorted.insert(pos, key)
            self._arrays[key] = arr
        prefill = len(key) - cached
        self.prefill_tokens += prefill
        self.prompt_tokens += len(key)
        return prefill


def radix_prefill_tokens(prompts: Iterable[Sequence[int]]) -> int:
    radix = RadixPrefill()
    for p in prompts:
        radix.add(p)
    return radix.prefill_tokens


class OracleCounter:
    """Exact-content oracle: new content is prefilled once, the query always."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()
        self.prefill_tokens = 0

    def add(self, segments: Iterable[tuple[bytes, int]], query_tokens: int) -> int:
        """``segments``: (content digest, token count) of system, tools and chunks."""
        total = query_tokens
        for digest, n in segments:
            if digest not in self._seen:
                self._seen.add(digest)
                total += n
        self.prefill_tokens += total
        return total
