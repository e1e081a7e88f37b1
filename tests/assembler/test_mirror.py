"""The prefix-cache mirror against vLLM's rules and a brute-force reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptsplice.assembler import BlockState, PrefixCacheMirror
from promptsplice.blocks import cdiv, chain_hashes
from promptsplice.errors import ConfigError, InputError


class ReferencePool:
    """Brute force: vLLM's block pool as plain lists (free queue head = index 0).

    ``copies[h]`` lists the slots holding hash ``h`` in insertion order: vLLM serves
    a hit from the first inserted copy (``BlockHashToBlockMap.get_one_block``).
    """

    def __init__(self, bs, capacity):
        self.bs = bs
        self.slot = [None] * capacity  # hash held by each slot
        self.copies = {}
        self.free = list(range(capacity))

    def run(self, tokens):
        bs = self.bs
        hashes = chain_hashes(tokens, bs)
        limit = (len(tokens) - 1) // bs
        hit = 0
        while hit < min(limit, len(hashes)) and self.copies.get(hashes[hit]):
            hit += 1
        used = []
        for h in hashes[:hit]:
            s = self.copies[h][0]
            if s in self.free:
                self.free.remove(s)
            used.append(s)
        for i in range(hit, cdiv(len(tokens), bs)):
            s = self.free.pop(0)
            if self.slot[s] is not None:
                self.copies[self.slot[s]].remove(s)
            self.slot[s] = hashes[i] if i < len(hashes) else None
            if self.slot[s] is not None:
                self.copies.setdefault(self.slot[s], []).append(s)
            used.append(s)
        freed = list(reversed(used))
        # vLLM's free_blocks: uncached blocks to the head, cached ones to the tail.
        head = [s for s in freed if self.slot[s] is None]
        self.free = head + self.free + [s for s in freed if self.slot[s] is not None]
        return hit * bs


def test_exact_numbers_and_last_token_rule():
    bs = 4
    m = PrefixCacheMirror(bs)
    p = list(range(10))
    h = chain_hashes(p, bs)
    assert m.admit(h, 10).cached_tokens == 0
    assert m.predict(h, 10).cached_tokens == 8  # 2 full blocks, last token excluded anyway
    eight = p[:8]
    # 8 tokens = 2 full blocks, but the last prompt token is never served from cache
    assert m.predict(chain_hashes(eight, bs), 8).cached_tokens == 4
    nine = p[:9]
    assert m.predict(chain_hashes(nine, bs), 9).cached_tokens == 8
    other = [99] + p[1:]
    assert m.predict(chain_hashes(other, bs), 10).cached_tokens == 0
    assert m.state(h[0]) is BlockState.CACHED
    assert m.state(chain_hashes(other, bs)[0]) is BlockState.ABSENT


def test_tail_blocks_are_evicted_first():
    bs = 2
    m = PrefixCacheMirror(bs, capacity_blocks=4)
    a = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks + partial: takes all 4 slots
    ha = chain_hashes(a, bs)
    m.admit(ha, len(a))
    assert [m.state(h) for h in ha] == [BlockState.CACHED] * 3
    b = [9, 9, 8]  # needs 2 slots: the partial slot of a (uncached, freed first), then a's last block
    m.admit(chain_hashes(b, bs), len(b))
    assert [m.state(h) for h in ha] == [BlockState.CACHED, BlockState.CACHED, BlockState.ABSENT]


def test_salted_chains_never_hit_each_other():
    m = PrefixCacheMirror(16)
    toks = list(range(100))
    m.admit(chain_hashes(toks, 16, salt="tenant-a"), 100)
    assert m.predict(chain_hashes(toks, 16, salt="tenant-b"), 100).cached_tokens == 0
    assert m.predict(chain_hashes(toks, 16, salt="tenant-a"), 100).cached_tokens == 96


def test_bad_config():
    with pytest.raises(ConfigError, match="block_size"):
        PrefixCacheMirror(0)
    with pytest.raises(ConfigError, match="capacity_blocks"):
        PrefixCacheMirror(16, capacity_blocks=0)
    m = PrefixCacheMirror(4, capacity_blocks=2)
    with pytest.raises(ConfigError, match="raise capacity_blocks"):
        m.admit(chain_hashes(list(range(12)), 4), 12)


prompts = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=25
)


@settings(max_examples=150, deadline=None)
@given(prompts, st.integers(1, 4), st.integers(6, 30))
def test_mirror_matches_brute_force(seq, bs, capacity):
    m = PrefixCacheMirror(bs, capacity_blocks=capacity)
    ref = ReferencePool(bs, capacity)
    for p in seq:
        if cdiv(len(p), bs) > capacity:
            continue
        want = ref.run(p)
        got = m.admit(chain_hashes(p, bs), len(p)).cached_tokens
        assert got == want
        # the same slots too: which copy serves a hit decides what a later eviction keeps
        assert {h: v for h, v in m._cached.items()} == {h: v for h, v in ref.copies.items() if v}


@settings(max_examples=100, deadline=None)
@given(prompts, st.integers(1, 4))
def test_unbounded_mirror_is_the_set_of_all_seen_blocks(seq, bs):
    m = PrefixCacheMirror(bs)
    seen = set()
    for p in seq:
        hashes = chain_hashes(p, bs)
        limit = (len(p) - 1) // bs
        want = 0
        while want < min(limit, len(hashes)) and hashes[want] in seen:
            want += 1
        assert m.admit(hashes, len(p)).cached_tokens == want * bs
        seen.update(hashes)
    assert len(m) == len(seen)


def test_a_refused_request_leaves_the_mirror_as_it_was():
    """Slots were taken off the free queue before the refusal: the pool stayed full for
    good and every later request, even a 2-block one, was refused."""
    m = PrefixCacheMirror(4, capacity_blocks=8)
    first = chain_hashes(list(range(12)), 4)
    m.admit(first, 12)
    with pytest.raises(ConfigError, match="more than the mirror's 8 blocks"):
        m.admit(chain_hashes(list(range(100, 136)), 4), 36)  # 9 blocks
    assert (len(m), m.queries_tokens, m.hit_tokens) == (3, 12, 0)
    assert m.admit(first, 12).cached_blocks == 2  # the last token's block is computed again
    assert m.admit(chain_hashes(list(range(200, 208)), 4), 8) == (0, 0, 2)


def test_an_unbounded_mirror_keeps_one_slot_per_block_however_often_it_is_computed():
    """Blocks computed again (under ``min_hit_tokens``, past the last-token limit) got a
    new slot each time: 10,000 identical requests held 70,001 slots for 7 blocks."""
    m = PrefixCacheMirror(16, min_hit_tokens=1024)
    hashes = chain_hashes(list(range(7 * 16)), 16)
    for _ in range(1000):
        m.admit(hashes, 7 * 16)
    assert len(m) == 7 and sum(map(len, m._cached.values())) == 7
    assert len(m._slot_hash) <= 2 * 7


def test_a_view_reads_the_owner_and_cannot_update_it():
    m = PrefixCacheMirror(4, 8)
    view = m.view()
    hashes = chain_hashes(list(range(12)), 4)
    assert view.predict(hashes, 12).cached_tokens == 0
    m.admit(hashes, 12)
    assert view.predict(hashes, 12) == m.predict(hashes, 12) and view.predict(hashes, 12).cached_tokens == 8
    assert len(view) == len(m) == 3 and view.match(hashes) == 3 and hashes[0] in view
    assert view.state(hashes[0]) is BlockState.CACHED and view.has(hashes[2])
    assert (view.block_size, view.capacity_blocks, view.min_hit_tokens) == (4, 8, 0)
    assert not hasattr(view, "admit") and not hasattr(view, "clear")
    m.clear()
    assert len(view) == 0


def test_a_bounded_pool_creates_its_slots_as_requests_use_them():
    """262,144 slots were made at construction (60-90 ms and ~33 MB for every
    ``Assembler()``); never-used slots now stand uncreated where vLLM's free queue has
    them: behind freed slots without a hash, ahead of every cached one."""
    m = PrefixCacheMirror(4, capacity_blocks=262_144)
    assert m._slot_hash == [] and len(m._free) == 0
    first = chain_hashes(list(range(10)), 4)  # 2 full blocks + a partial one
    m.admit(first, 10)
    assert m._slot_hash == [first[0], first[1], None]
    assert list(m._free) == [2, 1, 0]  # the partial block's slot at the head, then LRU
    m.admit(chain_hashes(list(range(100, 108)), 4), 8)  # takes slot 2, then a new one
    assert m._cached[first[0]] == [0] and len(m._slot_hash) == 4
    m.clear()
    assert m._slot_hash == [] and m.capacity_blocks == 262_144


def test_clear_can_resize_the_pool():
    m = PrefixCacheMirror(4, 2)
    with pytest.raises(ConfigError):
        m.admit(chain_hashes(list(range(12)), 4), 12)  # 3 blocks do not fit 2
    m.clear(capacity_blocks=3)
    assert m.capacity_blocks == 3
    assert m.admit(chain_hashes(list(range(12)), 4), 12).cached_tokens == 0
    with pytest.raises(ConfigError, match="capacity_blocks"):
        m.clear(capacity_blocks=0)



def test_a_hit_at_the_head_of_a_full_pool_is_admitted_in_linear_time():
    """A prefix used long ago sits at the LRU head of a full pool: the allocation took
    and re-queued every one of its slots once per new block (2,000 hit + 2,000 new
    blocks: ~1 s under the mirror's lock; linear: ~2 ms)."""
    import time

    bs, hit, new, cap = 16, 2000, 2000, 6000
    a = list(range(hit * bs))
    m = PrefixCacheMirror(bs, cap)
    m.admit(chain_hashes(a, bs), len(a))
    filler = [7] + list(range(10**7, 10**7 + (cap - hit) * bs - 1))
    m.admit(chain_hashes(filler, bs), len(filler))  # a's slots now at the head of the queue
    longer = a + list(range(10**6, 10**6 + new * bs))
    t0 = time.perf_counter()
    pred = m.admit(chain_hashes(longer, bs), len(longer))
    assert pred.cached_blocks == hit and time.perf_counter() - t0 < 0.2
    assert m.match(chain_hashes(longer, bs)) == hit + new  # every block of it cached now


def test_a_view_with_blocks_behind_the_cache_lends_them_to_the_layout_walk_only():
    """``view(behind=...)``: an engine's block store.  The walk that orders and pads
    (``reusable_hashes``) counts those blocks; ``predict``/``match``/``has`` stay the
    cache's own (what vLLM's prefix cache serves)."""
    m = PrefixCacheMirror(16, 64)
    hashes = chain_hashes(list(range(64)), 16)
    m.admit(hashes[:1], 17)
    stored = set(hashes[1:3])
    view = m.view(behind=stored.__contains__)
    walk = view.reusable_hashes()
    assert [h in walk for h in hashes] == [True, True, True, False]
    assert 7 not in walk  # not a hash: never asked of the store
    assert view.match(hashes) == 1 and view.predict(hashes, 64).cached_tokens == 16
    assert not view.has(hashes[1]) and hashes[1] not in view
    assert [h in m.view().reusable_hashes() for h in hashes] == [True, False, False, False]
    blind = view.cache_only()  # the same mirror, the store left out (the bench's ablation)
    assert [h in blind.reusable_hashes() for h in hashes] == [True, False, False, False]
    m.admit(hashes[3:4], 64)
    assert blind.has(hashes[3]) and view.has(hashes[3])  # both read the owner's current state
    with pytest.raises(ConfigError, match="behind must be a callable"):
        m.view(behind={hashes[1]})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.admit([], -5), "num_tokens must be the request's prompt length, an int >= 1"),
        (lambda m: m.admit([], 0), "num_tokens must be the request's prompt length, an int >= 1"),
        (lambda m: m.predict([], 4.0), "num_tokens must be the request's prompt length, an int >= 1"),
        (lambda m: m.predict([], True), "num_tokens must be the request's prompt length, an int >= 1"),
        (lambda m: m.predict("not hashes", 10), "hashes must be a list of block hashes"),
        (lambda m: m.admit(b"x" * 16, 10), "hashes must be a list of block hashes"),
        (lambda m: m.predict({b"x" * 16}, 10), "hashes must be a list of block hashes"),
        (lambda m: m.predict([1, 2], 10), "hashes must hold block hashes (bytes"),
        (lambda m: m.admit([b"x" * 16] * 3, 4), "3 block hashes cover 12 tokens at block_size 4, more than the request's 4"),
        (lambda m: m.predict([b"x" * 16] * 2, 7), "2 block hashes cover 8 tokens at block_size 4, more than the request's 7"),
        (lambda m: m.admit([], 10, num_computed_tokens=2), "num_computed_tokens must be None or an int >= num_tokens (10)"),
        (lambda m: m.admit([], 10, num_computed_tokens=12.0), "num_computed_tokens must be None or an int >= num_tokens (10)"),
    ],
    ids=["negative", "zero", "float", "bool", "str-hashes", "bytes-hashes", "set-hashes", "int-hashes",
         "admit-too-many", "predict-too-many", "computed-short", "computed-float"],
)
def test_admit_and_predict_refuse_nonsense_and_change_nothing(call, message):
    """They took a negative length (the hit rate went negative), a str as hashes (one
    "hash" per character) and more hashes than the prompt has full blocks."""
    m = PrefixCacheMirror(4, 8)
    first = chain_hashes(list(range(8)), 4)
    m.admit(first, 8)
    with pytest.raises(InputError) as info:
        call(m)
    assert message in str(info.value)
    assert (m.queries_tokens, m.hit_tokens, len(m)) == (8, 0, 2)
    assert m.view().predict(first, 9).cached_tokens == 8  # still usable; a view checks the same
    with pytest.raises(InputError, match="num_tokens must be"):
        m.view().predict(first, -1)


def test_hashes_may_cover_the_computed_tokens_past_the_prompt():
    """With generated tokens computed, the hashes run past the prompt (``admit_run``)."""
    m = PrefixCacheMirror(4, 8)
    hashes = chain_hashes(list(range(12)), 4)
    assert m.admit(hashes, 6, num_computed_tokens=12) == (0, 0, 3)
    assert m.predict(hashes[:1], 6) == (4, 1, 1)
    assert m.admit(tuple(hashes[:2]), 9).cached_blocks == 2
