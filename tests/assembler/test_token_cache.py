"""The per-segment token cache: a repeated chunk is never tokenized twice."""

from __future__ import annotations

import threading

import pytest

from promptsplice.assembler import Assembler, TokenCache
from promptsplice.blocks import content_digest
from promptsplice.errors import ConfigError


class CountingTokenizer:
    """The real default tokenizer, counting the texts it encodes."""

    def __init__(self, inner):
        self._inner = inner
        self.name = inner.name
        self.filler_token_id = inner.filler_token_id
        self.encoded: list[str] = []
        self._lock = threading.Lock()

    def encode(self, text):
        from promptsplice.assembler._tokenizers import _IDENTITY_PROBE

        if text != _IDENTITY_PROBE:  # what the caches key a tokenizer by (once per object)
            with self._lock:
                self.encoded.append(text)
        return self._inner.encode(text)

    def encode_batch(self, texts):
        with self._lock:
            self.encoded.extend(texts)
        return self._inner.encode_batch(texts)

    def decode(self, ids):
        return self._inner.decode(ids)


def test_repeated_chunks_are_tokenized_once(default_tok):
    tok = CountingTokenizer(default_tok)
    asm = Assembler(tok, block_size=16)
    docs = [{"id": "a", "text": "Alpha is the first letter."}, {"id": "b", "text": "Beta is the second letter."}]
    asm.assemble(docs, query="which?", system="sys")
    first = list(tok.encoded)
    assert sorted(first) == sorted(["sys", "\n\nAlpha is the first letter.", "\n\nBeta is the second letter.", "\n\nQuestion: which?\nAnswer:"])
    asm.assemble(list(reversed(docs)) + [{"id": "c", "text": "Gamma is the third."}], query="which?", system="sys")
    assert tok.encoded[len(first):] == ["\n\nGamma is the third."]
    hits, misses, entries, _ = asm.token_cache.stats()
    assert (hits, misses, entries) == (4, 5, 5)


def test_cache_is_bounded_by_tokens_lru():
    cache = TokenCache(max_tokens=6)
    enc = lambda texts: [[len(t)] * len(t) for t in texts]  # noqa: E731 - n tokens for n chars
    k = lambda t: ("", content_digest(t.encode()), t)  # noqa: E731
    cache.get_many("t", [k("aaa"), k("bb")], enc)
    assert cache.stats().tokens == 5
    cache.get_many("t", [k("aaa")], enc)  # touch: "bb" is now least recent
    cache.get_many("t", [k("cc")], enc)  # 7 > 6: evicts "bb"
    s = cache.stats()
    assert (s.entries, s.tokens) == (2, 5)
    cache.get_many("t", [k("toolongtext")], enc)  # bigger than the cache: not stored
    assert cache.stats().entries == 2
    for bad in (0, "10", True, 1.5):  # a str raised a bare TypeError, True was taken as 1
        with pytest.raises(ConfigError, match="max_tokens"):
            TokenCache(max_tokens=bad)


def test_a_digest_collision_of_equal_length_is_a_miss_not_another_texts_tokens():
    """A hit was confirmed by the text's length only: xxh3 is not collision-resistant,
    and a crafted document of equal length colliding with another (another tenant's)
    was handed its tokens.  The stored text confirms a hit now."""
    cache = TokenCache()
    enc = lambda texts: [[ord(c) for c in t] for t in texts]  # noqa: E731
    digest = content_digest(b"secret")
    assert cache.get_many("t", [("", digest, "secret")], enc) == [tuple(map(ord, "secret"))]
    assert cache.get_many("t", [("", digest, "public")], enc) == [tuple(map(ord, "public"))]  # same digest, length
    assert cache.stats().hits == 0 and cache.stats().misses == 2


def test_concurrent_assembly_is_consistent(default_tok):
    # alignment "none": padding under "auto" depends on the cache state, which differs
    # with thread interleaving; the order must not (the stable memo pins it).
    asm = Assembler(default_tok, block_size=16, alignment="none")
    docs = [{"id": f"d{i}", "text": f"Document number {i} talks about topic {i % 3}."} for i in range(12)]
    results: dict[int, list[int]] = {}

    def work(n):
        res = asm.assemble(docs[n % 4 : n % 4 + 6], query=f"q{n % 2}", system="shared system prompt")
        results[n] = res.token_ids

    threads = [threading.Thread(target=work, args=(n,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 32
    # the same request always gives the same tokens, whichever thread assembled it
    by_key: dict[tuple[int, int], list[int]] = {}
    for n, toks in results.items():
        by_key.setdefault((n % 4, n % 2), toks)
        assert toks == by_key[(n % 4, n % 2)]
    hits, misses, entries, _ = asm.token_cache.stats()
    assert entries == 9 + 2 + 1  # chunks d0..d8, 2 queries, the system prompt  # every distinct segment once: chunks, 2 queries, system
