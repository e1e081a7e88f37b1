"""Block identity: the one chain hash and the alignment helpers."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from promptsplice.errors import ConfigError, InputError

from promptsplice.blocks import (
    HASH_BYTES,
    cacheable_blocks,
    cdiv,
    chain_hashes,
    chunk_key,
    content_digest,
    hash_block,
    hash_while_cached,
    next_blocks_cached,
    root_hash,
    round_down,
    round_up,
    token_bytes,
)


@pytest.mark.parametrize(
    ("x", "m", "up", "down", "div"),
    [(0, 16, 0, 0, 0), (1, 16, 16, 0, 1), (16, 16, 16, 16, 1), (17, 16, 32, 16, 2), (95, 32, 96, 64, 3)],
)
def test_alignment_helpers(x, m, up, down, div):
    assert round_up(x, m) == up
    assert round_down(x, m) == down
    assert cdiv(x, m) == div


@given(st.integers(0, 10**6), st.integers(1, 512))
def test_alignment_properties(x, m):
    assert round_down(x, m) <= x <= round_up(x, m)
    assert round_up(x, m) % m == 0 and round_down(x, m) % m == 0
    assert round_up(x, m) - round_down(x, m) in (0, m)


def test_hash_format_is_pinned():
    # Store keys persist on disk: the format must not drift silently.
    root = root_hash(None)
    assert root == xxhash.xxh3_128_digest(b"promptsplice/chain/v1\x00")
    block = [1, 2, 3, 49151]
    expected = xxhash.xxh3_128_digest(root + struct.pack("<4I", *block))
    assert hash_block(root, block) == expected
    assert chain_hashes(block, 4) == [expected]
    assert len(expected) == HASH_BYTES
    assert token_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    with pytest.raises(InputError, match="sequence of ints, got set"):
        token_bytes({3, 1, 2})  # no order: hashed as whatever order the set iterates
    assert content_digest(b"abc") == xxhash.xxh3_128_digest(b"abc")


def test_only_full_blocks_are_hashed():
    assert chain_hashes(list(range(31)), 16) == chain_hashes(list(range(16)), 16)
    assert len(chain_hashes(list(range(32)), 16)) == 2
    assert chain_hashes([1, 2, 3], 16) == []


def test_chain_covers_the_whole_prefix():
    a = list(range(64))
    b = [999] + a[1:]
    ha, hb = chain_hashes(a, 16), chain_hashes(b, 16)
    assert all(x != y for x, y in zip(ha, hb)), "a change in block 0 must change every later hash"
    c = a[:48] + [7] * 16
    assert chain_hashes(c, 16)[:3] == ha[:3] and chain_hashes(c, 16)[3] != ha[3]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 40), st.data())
def test_continuing_a_chain_equals_hashing_whole(tokens, bs, data):
    whole = chain_hashes(tokens, bs)
    cut = data.draw(st.integers(0, len(whole))) * bs
    head = chain_hashes(tokens[:cut], bs)
    parent = head[-1] if head else root_hash(None)
    assert head + chain_hashes(tokens[cut:], bs, parent=parent) == whole


def test_salt_isolates_every_block():
    toks = list(range(64))
    plain, t1, t2 = chain_hashes(toks, 16), chain_hashes(toks, 16, salt="t1"), chain_hashes(toks, 16, salt="t2")
    assert not set(plain) & set(t1) and not set(t1) & set(t2)
    assert chain_hashes(toks, 16, salt="t1") == t1
    assert root_hash("x") != root_hash(b"x"), "str and bytes salts are distinct namespaces"


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):  # ConfigError is a ValueError
        chain_hashes([1], 0)
    with pytest.raises(ValueError, match="either parent or salt"):
        chain_hashes([1], 1, parent=root_hash(None), salt="s")
    with pytest.raises(InputError, match="parent must be a 16-byte BlockHash"):
        chain_hashes([1], 1, parent="abc")  # a raw TypeError from the hash
    # bytes were read as machine ints (b"abcd" hashed as one token); odd lengths raised ValueError
    for raw in (b"abcd", b"abc", bytearray(4), "ab"):
        with pytest.raises(InputError, match="token ids must be a sequence of ints"):
            chain_hashes(raw, 1)
    with pytest.raises(InputError, match="identity must be a str"):
        chunk_key([1], block_size=1, identity=5)
    with pytest.raises(InputError, match="identity is not encodable as UTF-8"):
        chunk_key([1], block_size=1, identity="\ud800")


def test_chunk_key_names_tokens_block_size_salt_and_identity():
    toks = list(range(100, 164))
    k = chunk_key(toks, block_size=32, salt="t", identity="m|rope")
    assert len(k) == HASH_BYTES and k == chunk_key(list(toks), block_size=32, salt="t", identity="m|rope")
    others = {
        chunk_key(toks[:-1] + [1], block_size=32, salt="t", identity="m|rope"),
        chunk_key(toks, block_size=16, salt="t", identity="m|rope"),
        chunk_key(toks, block_size=32, salt="u", identity="m|rope"),
        chunk_key(toks, block_size=32, salt=b"t", identity="m|rope"),
        chunk_key(toks, block_size=32, salt=None, identity="m|rope"),
        chunk_key(toks, block_size=32, salt="t", identity="m|rope2"),
        # the length prefixes keep salt and identity apart
        chunk_key(toks, block_size=32, salt="tm", identity="|rope"),
    }
    assert k not in others and len(others) == 7
    # position-independent: no parent, and never a chain hash of the same tokens
    assert k not in chain_hashes(toks, 32, salt="t") + chain_hashes(toks, 64, salt="t")
    with pytest.raises(ValueError):
        chunk_key(toks, block_size=0)


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=200),
    st.sampled_from([1, 2, 4, 16]),
    st.integers(0, 60),
    st.booleans(),
)
def test_hash_while_cached_stops_at_the_first_missing_block(tokens, bs, cached_blocks, twice):
    """Short and memoised (>= 4 blocks) paths alike: the leading cached blocks' hashes
    plus the first missing one, the same hashes as chain_hashes (twice: from the memo)."""
    full = chain_hashes(tokens, bs)
    cached = set(full[:cached_blocks])
    for _ in range(2 if twice else 1):
        out: list[bytes] = []
        n = hash_while_cached(root_hash(), token_bytes(tokens), bs, cached, out)
        assert n == min(cached_blocks, len(full))
        assert out == full[: n + 1]


def test_the_chain_memo_is_bounded_by_the_hashes_it_holds(monkeypatch):
    """Bounded by entries only, a few segments of 100K tokens each held hundreds of MB."""
    import promptsplice.blocks as blocks

    monkeypatch.setattr(blocks, "_MEMO_MAX_HASHES", 100)
    monkeypatch.setattr(blocks, "_memo", {})
    monkeypatch.setattr(blocks, "_memo_hashes", 0)
    for seed in range(30):
        tokens = [seed * 1000 + i for i in range(10 * 16)]
        out: list[bytes] = []
        assert hash_while_cached(root_hash(), token_bytes(tokens), 16, set(), out) == 0
        assert out == chain_hashes(tokens, 16)[:1]
        assert sum(len(v) for v in blocks._memo.values()) <= 100
    big = list(range(300 * 16))  # more than the whole memo: computed, not kept
    hash_while_cached(root_hash(), token_bytes(big), 16, set(chain_hashes(big, 16)), [])
    assert sum(len(v) for v in blocks._memo.values()) <= 100


def test_a_salt_is_none_a_str_or_bytes_never_converted():
    """An int salt was hashed as ``bytes(n)``: salt 5 shared the chain of five zero
    bytes; "" (no salt to vLLM) hashed apart from None; a float raised a raw TypeError."""
    from promptsplice.errors import InvalidSaltError

    toks = list(range(16))
    for bad in (5, 5.0, "", ["t"]):
        with pytest.raises(InvalidSaltError):
            root_hash(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidSaltError):
            chunk_key(toks, block_size=16, salt=bad)  # type: ignore[arg-type]
    assert root_hash(b"\0" * 5) != root_hash("\0" * 5) != root_hash(None)
    # a salt the library derives past vLLM's front door (a LoRA request's identity salt
    # names its adapter's path) is hashed, though a caller's salt may not hold '@' or '/'
    assert root_hash("acme\x1fidentity:lora=sql@/adapters/sql") != root_hash("acme")


def test_a_miss_at_the_first_block_hashes_no_chain():
    """A long segment whose first block is not cached was hashed whole into the memo
    (the greedy walk probes every chunk at every step: O(n^2) chains)."""
    import promptsplice.blocks as blocks

    tokens = list(range(40 * 16))
    blocks._memo.clear()
    out: list[bytes] = []
    assert hash_while_cached(root_hash("x"), token_bytes(tokens), 16, set(), out) == 0
    assert out == chain_hashes(tokens, 16, salt="x")[:1] and blocks._memo == {}


def test_next_blocks_cached_names_the_block_each_head_completes():
    bs, parent = 4, hash_block(root_hash(), [1, 2, 3, 4])
    tail = token_bytes([5, 6])
    done = hash_block(parent, [5, 6, 7, 8])
    heads = [token_bytes([7, 8, 9]), token_bytes([7]), token_bytes([9, 9]), token_bytes([7, 8])]
    assert next_blocks_cached(parent, tail, heads, bs, {done}) == [True, False, False, True]
    assert next_blocks_cached(parent, b"", [token_bytes([5, 6, 7, 8])], bs, set()) == [False]
    with pytest.raises(ValueError, match="fewer than a block"):
        next_blocks_cached(parent, token_bytes([1, 2, 3, 4]), heads, bs, {done})


def test_bad_arguments_are_the_hierarchy_s_errors_not_builtins():
    """``chain_hashes`` raised a bare ValueError for a block size of 0 and OverflowError
    for a token id past uint32: a caller catching ``PromptspliceError`` missed both."""
    from promptsplice.blocks import chain_hashes, chunk_key, next_blocks_cached, root_hash, token_bytes
    from promptsplice.errors import ConfigError, InputError

    for bad in (0, -1, True, 10**9):
        with pytest.raises(ConfigError, match="block_size"):
            chain_hashes([1, 2], bad)
        with pytest.raises(ConfigError, match="block_size"):
            chunk_key([1, 2], block_size=bad)
    for ids in ([2**32], [-1], [1.5], ["7"]):
        with pytest.raises(InputError, match=r"token ids must be ints in \[0, 2\*\*32\)"):
            token_bytes(ids)
        with pytest.raises(InputError):
            chain_hashes(ids * 16, 16)
    with pytest.raises(ConfigError, match="either parent or salt"):
        chain_hashes([1] * 16, 16, parent=root_hash(), salt="t")
    with pytest.raises(InputError, match="tail holds"):
        next_blocks_cached(root_hash(), token_bytes([1] * 16), [], 16, set())


def test_cacheable_blocks_never_include_the_last_prompt_token():
    """vLLM computes the last prompt token to sample from it (``max_cache_hit_length =
    num_tokens - 1``): the one rule the mirror, the planners and the runners share."""
    from promptsplice.blocks import cacheable_blocks

    assert [cacheable_blocks(n, 32) for n in (0, 1, 32, 33, 64, 65, 300)] == [0, 0, 0, 1, 1, 2, 9]


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True, None])
def test_cacheable_blocks_refuses_a_block_size_that_is_not_one(block_size):
    """``cacheable_blocks(10, 0)`` raised ZeroDivisionError; -16 answered 0 blocks."""
    with pytest.raises(ConfigError, match="block_size must be an int from 1"):
        cacheable_blocks(10, block_size)
