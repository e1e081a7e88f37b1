"""Block identity: the one chain hash, content digests and the alignment helpers.

Like vLLM's ``kv_cache_utils.py``, this module is the single owner of how a block of
tokens is named.  The prefix-cache mirror, the tiered KV store's keys, the stable prefix
key and the benches all import it; no other module hashes tokens or content.

Rules (the same as vLLM's automatic prefix caching):

* only *full* blocks of ``block_size`` tokens get a hash;
* a block's hash covers its parent's hash, so a hash names the whole prefix up to and
  including the block;
* the tenant salt enters the root of the chain (vLLM puts ``cache_salt`` in the first
  block's extra keys), so two tenants never share a single block hash.

The digest is xxh3-128 over ``parent || token ids as little-endian uint32``.  xxh3 is
fast but not collision-resistant: whoever serves data by these keys (the KV store) also
compares the stored token ids before serving (vLLM moved off Python's ``hash`` after
CVE-2025-25183 for the same reason).
"""

from __future__ import annotations

import sys
import threading
from array import array
from itertools import compress, count
from operator import not_
from collections.abc import Container, Iterable, Iterator, Sequence
from collections.abc import Set as AbcSet
from typing import NewType

import xxhash

from promptsplice._validate import check_block_size, check_salt
from promptsplice.errors import ConfigError, InputError, InvalidSaltError

__all__ = [
    "BlockHash",
    "HASH_BYTES",
    "cdiv",
    "round_up",
    "round_down",
    "cacheable_blocks",
    "content_digest",
    "salt_bytes",
    "chunk_key",
    "root_hash",
    "token_bytes",
    "hash_block",
    "hash_block_bytes",
    "chain_hashes",
    "iter_block_hashes",
    "hash_while_cached",
    "next_blocks_cached",
]

BlockHash = NewType("BlockHash", bytes)
"""16 bytes: the xxh3-128 digest naming a full block *and everything before it*."""

HASH_BYTES = 16

_ROOT_TAG = b"promptsplice/chain/v1\x00"
_CHUNK_TAG = b"promptsplice/chunk/pic/v1\x00"
_LITTLE = sys.byteorder == "little"


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return cdiv(x, multiple) * multiple


def round_down(x: int, multiple: int) -> int:
    """Largest multiple of ``multiple`` that is <= ``x``."""
    return (x // multiple) * multiple


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a ``num_tokens``-token prompt that a prefix cache can serve: vLLM
    always computes the last prompt token (it samples from it), so never the block that
    holds it: ``(num_tokens - 1) // block_size`` (vLLM's ``max_cache_hit_length``).
    A ``block_size`` that is not one (an int from 1 to 16,384) is a :class:`ConfigError`."""
    check_block_size(block_size)
    return max(0, (num_tokens - 1) // block_size)


#: ``content_digest(data) -> bytes``: xxh3-128 of raw bytes, the content key of chunks
#: (dedup, token cache).  The C function itself, not a Python wrapper around it: dedup
#: calls it once per input, and the wrapper's frame was ~10% of its time per chunk.
content_digest = xxhash.xxh3_128_digest


def salt_bytes(salt: str | bytes | None) -> bytes:
    """A salt's hashed and stored form, the one encoding (chain roots, chunk keys, the
    block store's records): ``None`` -> ``b""``; a tenant's str (:func:`check_salt`'s
    rule, so ``""``, a lone surrogate or an int is an :class:`InvalidSaltError`: an int
    was once taken as ``bytes(n)``, so salt ``5`` shared ``b"\\0" * 5``'s chain) ->
    ``b"s"`` + UTF-8; bytes (the store's own namespaces) -> ``b"b"`` + raw."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        return b"s" + check_salt(salt, "salt", vllm_rule=False).encode("utf-8")
    if isinstance(salt, bytes | bytearray | memoryview):
        return b"b" + bytes(salt)
    raise InvalidSaltError(
        f"salt must be a non-empty str (the tenant's salt), bytes or None, got {type(salt).__name__} {salt!r:.60}"
    )


def chunk_key(
    tokens: Sequence[int], *, block_size: int, salt: str | bytes | None = None, identity: str = ""
) -> bytes:
    """The *content* key of a block-aligned chunk: position-independent (no parent).

    Covers the chunk's token ids, the block size, the tenant salt and ``identity``
    (whatever else the KV depends on: the tokenizer, the model and its RoPE), each
    length-prefixed, under a tag of its own, so it can never equal a chain hash.  Used
    by the chunk index of position-independent reuse
    (:class:`promptsplice.engine_adapters.ChunkIndex`).
    """
    check_block_size(block_size)
    salt_b = salt_bytes(salt)
    if not isinstance(identity, str):
        raise InputError(f"identity must be a str (what the KV depends on), got {type(identity).__name__}")
    try:
        ident = identity.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"identity is not encodable as UTF-8 ({exc.reason} at {exc.start})") from None
    head = b"%d:%d:%d:" % (block_size, len(salt_b), len(ident))
    return xxhash.xxh3_128_digest(_CHUNK_TAG + head + salt_b + ident + token_bytes(tokens))


def root_hash(salt: str | bytes | None = None) -> BlockHash:
    """The parent of the first block.  Differs per salt, so salts isolate whole chains."""
    return BlockHash(xxhash.xxh3_128_digest(_ROOT_TAG + salt_bytes(salt)))


def token_bytes(tokens: Sequence[int] | Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (the hashed representation)."""
    if isinstance(tokens, str | bytes | bytearray | memoryview | AbcSet):
        # array("I", b"abcd") reads the bytes as machine ints: one wrong token, no error;
        # a set has no order
        raise InputError(f"token ids must be a sequence of ints, got {type(tokens).__name__}")
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError, ValueError) as exc:
        raise InputError(f"token ids must be ints in [0, 2**32): {exc}") from exc
    if not _LITTLE:  # pragma: no cover - no big-endian CI machine
        arr.byteswap()
    return arr.tobytes()


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    return hash_block_bytes(parent, token_bytes(tokens))


def hash_block_bytes(parent: BlockHash | bytes, tokens: bytes) -> BlockHash:
    """:func:`hash_block` of tokens already in :func:`token_bytes` form."""
    return BlockHash(xxhash.xxh3_128_digest(parent + tokens))


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    parent: BlockHash | None = None,
    salt: str | bytes | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``tokens``, chained from ``parent``.

    ``parent`` defaults to :func:`root_hash` of ``salt``; pass the hash of the block
    before ``tokens[0]`` to continue a chain (then ``salt`` must be ``None``).
    A trailing partial block gets no hash.
    """
    check_block_size(block_size)
    if parent is None:
        parent = root_hash(salt)
    elif salt is not None:
        raise ConfigError("pass either parent or salt: the salt only enters the root")
    elif not isinstance(parent, bytes) or len(parent) != 16:
        raise InputError(f"parent must be a 16-byte BlockHash (a chain_hashes result), got {parent!r:.60}")
    return list(iter_block_hashes(parent, memoryview(token_bytes(tokens)), block_size))


def iter_block_hashes(parent: BlockHash, data: memoryview, block_size: int) -> Iterator[BlockHash]:
    """Chain hashes of the full blocks of ``data`` (:func:`token_bytes` output), lazily.

    For hot loops that stop at the first block a cache lacks (the assembler's layout
    walk): they hash only up to the miss and convert the tokens to bytes only once.
    """
    step = 4 * block_size
    full = (len(data) // step) * step
    digest = xxhash.xxh3_128_digest
    h = parent
    for start in range(0, full, step):
        h = digest(h + data[start : start + step])
        yield h  # type: ignore[misc]


_MEMO_MIN_BLOCKS = 4
_MEMO_MAX_HASHES = 1 << 18
_memo: dict[tuple[bytes, int, bytes], tuple[BlockHash, ...]] = {}
_memo_hashes = 0  # hashes held
_memo_lock = threading.Lock()  # (without it, lost counts let the memo outgrow its bound)


def _memo_chain(parent: BlockHash, data: bytes, block_size: int) -> tuple[BlockHash, ...]:
    """Chain hashes of every full block of ``data``, remembered per (parent, block size,
    digest of ``data``): a popular chunk is hashed block by block once, not on every
    request that sends it.  Keyed by the same xxh3-128 as the hashes themselves; the
    memo is cleared whole once it holds 2^18 hashes (~15 MB)."""
    global _memo_hashes
    key = (parent, block_size, xxhash.xxh3_128_digest(data))
    hashes = _memo.get(key)
    if hashes is None:
        hashes = tuple(iter_block_hashes(parent, memoryview(data), block_size))  # (outside the lock)
        with _memo_lock:
            if _memo_hashes + len(hashes) > _MEMO_MAX_HASHES:
                _memo.clear()
                _memo_hashes = 0
            if len(hashes) <= _MEMO_MAX_HASHES and key not in _memo:
                _memo[key] = hashes
                _memo_hashes += len(hashes)
    return hashes


def hash_while_cached(
    parent: BlockHash, data: bytes | memoryview, block_size: int, cached: Container[bytes], out: list[BlockHash]
) -> int:
    """Chain-hash the full blocks of ``data`` (:func:`token_bytes` output) from ``parent``
    into ``out`` until one is not in ``cached``; returns how many leading blocks are.

    The first missing block's hash is appended too (the caller continues the chain from
    it).  The assembler's layout walk runs this once per segment on every request, so
    it is one tight loop (no generator, no per-block call beyond the digest).
    """
    step = 4 * block_size
    if len(data) >= _MEMO_MIN_BLOCKS * step:
        first = xxhash.xxh3_128_digest(parent + data[:step])
        if first not in cached:  # a miss at once needs no chain (nor a memo entry)
            out.append(first)
            return 0
        hashes = _memo_chain(parent, bytes(data), block_size)
        n = next(compress(count(), map(not_, map(cached.__contains__, hashes))), len(hashes))
        out.extend(hashes[: n + 1])
        return n
    digest = xxhash.xxh3_128_digest
    append = out.append
    h = parent
    n = 0
    for start in range(0, (len(data) // step) * step, step):
        h = digest(h + data[start : start + step])
        append(h)  # type: ignore[arg-type]
        if h not in cached:
            return n
        n += 1
    return n


def next_blocks_cached(
    parent: BlockHash, tail: bytes, heads: Sequence[bytes], block_size: int, cached: Container[bytes]
) -> list[bool]:
    """For each of ``heads`` (the :func:`token_bytes` of a segment's first tokens):
    whether the block that ``tail`` (token bytes of a partial block after ``parent``)
    completes with it is in ``cached``; False where it completes none.  One digest per
    head: what a walk trying every candidate at every step needs first."""
    need = 4 * block_size - len(tail)
    if need <= 0:
        raise InputError(f"tail holds {len(tail) // 4} tokens, not fewer than a block of {block_size}")
    prefix = parent + tail
    digest = xxhash.xxh3_128_digest
    return [len(h) >= need and digest(prefix + h[:need]) in cached for h in heads]
