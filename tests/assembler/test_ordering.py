"""Ordering policies: ``cache_aware`` never predicts fewer cached tokens than ``stable`` or
``retrieval`` on the same mirror state, and an exact repeat keeps its cached order."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptsplice.assembler import Assembler, PopularityTracker
from promptsplice.assembler._ordering import OrderSource, pick_best
from promptsplice.blocks import content_digest
from promptsplice.errors import ConfigError

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega river mountain city harbor bridge castle forest").split()


def _pool(n: int) -> list[dict]:
    """``n`` chunks of real-looking text of different lengths (some shorter than a block)."""
    out = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + (i * 5) % 23)]
        out.append({"id": f"c{i}", "text": f"Passage {i}: " + " ".join(words) + "."})
    return out


POOL = _pool(12)
requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=6, unique=True),
        st.integers(0, 2),  # query
        st.integers(0, 1),  # system prompt
    ),
    min_size=2,
    max_size=14,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests, st.sampled_from([4, 16]), st.sampled_from(["auto", "none", "all"]))
def test_cache_aware_never_predicts_fewer_cached_tokens_than_stable_or_retrieval(default_tok, reqs, bs, align):
    asm = Assembler(default_tok, block_size=bs, policy="cache_aware", alignment=align, capacity_blocks=None)
    systems = ("You answer from the passages.", None)
    for chunk_ids, q, sys_i in reqs:
        chunks = [POOL[i] for i in chunk_ids]
        kw = {"query": f"question {q}?", "system": systems[sys_i]}
        previews = {
            p: asm.preview(chunks, policy=p, **kw).predicted_cached_tokens
            for p in ("stable", "retrieval")
        }
        sent = asm.assemble(chunks, **kw)
        assert sent.predicted_cached_tokens >= max(previews.values()), (previews, sent.predicted_cached_tokens)


def test_the_prediction_matches_the_mirror(default_tok):
    asm = Assembler(default_tok, block_size=16, policy="cache_aware", capacity_blocks=None)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [0, 1, 2, 3], [1, 4, 0]):
        chunks = [POOL[i] for i in order]
        preview = asm.preview(chunks, query="q?")
        again = asm.preview(chunks, query="q?")
        assert asm.mirror.predict(preview.block_hashes, preview.num_tokens).cached_tokens == preview.predicted_cached_tokens
        assert (again.token_ids, again.chunk_order) == (preview.token_ids, preview.chunk_order)  # previews learn nothing
        sent = asm.assemble(chunks, query="q?")
        assert sent.predicted_cached_tokens == preview.predicted_cached_tokens


def test_an_exact_repeat_keeps_the_order_whose_blocks_are_cached(default_tok):
    asm = Assembler(default_tok, block_size=16, policy="cache_aware", capacity_blocks=None)
    system = "You are a careful assistant. Answer from the passages and cite them by number."
    first = asm.assemble([POOL[i] for i in (5, 2, 7, 1)], query="where?", system=system)
    # other traffic: the same chunks in other combinations and orders fill the mirror
    for order in ((1, 2), (7, 5, 3), (2, 1, 5, 7, 9), (1, 7)):
        asm.assemble([POOL[i] for i in order], query="other?", system=system)
    # the same set comes back in another retrieval order: it goes out as it was sent
    again = asm.assemble([POOL[i] for i in (1, 7, 2, 5)], query="where?", system=system)
    assert again.chunk_order == first.chunk_order
    assert again.token_ids == first.token_ids
    assert again.predicted_cached_tokens == (again.num_tokens - 1) // 16 * 16


def test_a_longer_cached_branch_does_not_reorder_an_exact_repeat(default_tok):
    """The greedy walk alone re-ordered this repeat: the set {short, long} was sent as
    [short, long]; a later request cached [long, ...] right after the system prompt, so
    for the repeat the walk took ``long`` first (more cached blocks) and lost the rest."""
    system = "You are a careful assistant. Answer from the passages and cite them by number."
    short = {"id": "short", "text": "Passage S: " + " ".join(WORDS[:20]) + "."}
    for k in range(8):
        long = {"id": "long", "text": f"Passage L{k}: " + " ".join(WORDS * 3) + "."}
        probe = Assembler(default_tok, block_size=16, policy="cache_aware", capacity_blocks=None)
        if probe.preview([long, short], query="q", system=system).chunk_order[0] == "short":
            break
    asm = Assembler(default_tok, block_size=16, policy="cache_aware", capacity_blocks=None)
    first = asm.assemble([long, short], query="which?", system=system)
    assert first.chunk_order == ["short", "long"]
    other = asm.assemble([POOL[3], long], query="other?", system=system)
    assert other.chunk_order[0] == "long"  # more popular now: it comes first
    again = asm.assemble([long, short], query="which?", system=system)
    assert again.chunk_order == ["short", "long"]
    assert again.predicted_cached_tokens == (again.num_tokens - 1) // 16 * 16


def test_remember_keeps_the_stable_order_apart_from_the_sent_order():
    tracker = PopularityTracker()
    digests = [content_digest(bytes([i])) for i in range(4)]
    stable = tracker.order(digests)
    assert tracker.last_sent(digests) is None
    sent = [digests[i] for i in (3, 0, 2, 1)]
    tracker.remember(sent)
    assert tracker.order(digests) == stable  # the stable order is not what was sent
    rev = list(reversed(digests))
    assert [rev[i] for i in tracker.last_sent(rev)] == sent  # whatever order the set comes in
    assert tracker.last_sent(digests[:3]) is None  # another set


def test_pick_best_prefers_the_most_cached_then_the_earliest():
    assert pick_best([0, 32, 32, 16]) == 1
    assert pick_best([48, 48]) == 0
    assert [s.value for s in OrderSource] == ["last_sent", "stable", "retrieval", "greedy"]


def test_equal_chunks_kept_apart_keep_their_ids_on_a_repeat(default_tok):
    """With dedup's exact pass off, two chunks of equal bytes reach the ordering; the
    memo of the set's order mapped both to one index, so the repeat listed chunk ``b``
    twice and lost ``a`` (the tokens happened to be the same)."""
    from promptsplice.dedup import DedupConfig

    chunks = [{"id": "a", "text": "Alpha chunk text."}, {"id": "b", "text": "Alpha chunk text."}]
    for policy in ("stable", "cache_aware"):
        asm = Assembler(default_tok, block_size=16, policy=policy, dedup_config=DedupConfig(exact=False, containment=False))
        for _ in range(3):
            out = asm.assemble(chunks, query="q")
            assert sorted(out.chunk_order) == ["a", "b"], (policy, out.chunk_order)
            assert sorted(s.chunk_ids for s in out.segments if s.kind.value == "chunk") == [("a",), ("b",)]
    tracker = PopularityTracker()
    d = content_digest(b"same")
    assert tracker.order([d, d]) == [0, 1] and tracker.order([d, d]) == [0, 1]


def test_a_repeated_set_with_equal_chunks_keeps_its_first_order(default_tok):
    """A set holding equal chunks skipped the kept order and was sorted by popularity
    again: once the repeated chunk had been seen twice it moved to the front, the
    prompt changed and the prefix cache missed (0, 0, 16 cached tokens)."""
    from promptsplice.dedup import DedupConfig

    off = DedupConfig(exact=False, containment=False, overlap=False, passages=False)
    asm = Assembler(default_tok, block_size=16, policy="stable", alignment="none", dedup_config=off)
    outs = [asm.assemble(["same text here", "other", "same text here"], query="q") for _ in range(4)]
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert [o.predicted_cached_tokens for o in outs] == [0, 16, 16, 16]
    tracker, a, b = PopularityTracker(), content_digest(b"a"), content_digest(b"b")
    first = tracker.order([a, b, a])
    tracker.observe([a, a, a, b])  # a's tier now above b's: a fresh sort would differ
    assert sorted(range(3), key=lambda i: (-tracker.tier(tracker.count([a, b, a][i])), [a, b, a][i])) != first
    assert tracker.order([a, b, a]) == first


def test_one_tenants_traffic_never_shapes_another_tenants_order(default_tok):
    """The tracker was keyed by chunk content only: B's own prompt came out ordered by
    what A had sent (G first after A used G four times), readable with a preview that
    leaves no trace."""
    docs = {c: f"Document {c}: " + ("lorem ipsum %s " % c) * 30 for c in "ABCDEFGH"}
    chunks = [docs["F"], docs["B"], docs["G"]]

    def order(prompt):
        return [k for _, k in sorted((prompt.text.find(v), k) for k, v in docs.items() if v in prompt.text)]

    for policy in ("stable", "cache_aware"):
        alone = order(Assembler(default_tok, block_size=16, policy=policy).preview(chunks, query="q?", salt="tenant-B"))
        asm = Assembler(default_tok, block_size=16, policy=policy)
        for i, c in enumerate("ACDE"):
            asm.assemble([docs["G"], docs[c]], query=f"a{i}", salt="tenant-A")
        assert order(asm.preview(chunks, query="q?", salt="tenant-B")) == alone == ["F", "B", "G"]
        # the tenant's own traffic still teaches its own order
        assert order(asm.preview(chunks, query="q?", salt="tenant-A"))[0] == "G"


def test_a_runners_derived_salts_learn_their_tenants_order(default_tok):
    """PIC assembles under a reuse salt derived from the tenant's and sends exact
    prompts under the tenant's own: both learn and read one order."""
    from promptsplice._validate import DERIVED_SALT_MARK

    docs = {c: f"Document {c}: " + ("lorem ipsum %s " % c) * 30 for c in "FBG"}
    asm = Assembler(default_tok, block_size=16, policy="stable")
    for i in range(4):
        asm.assemble([docs["G"]], query=f"a{i}", salt="tenant-A")
    for salt in ("tenant-A", f"tenant-A{DERIVED_SALT_MARK}pic:bounded"):
        prompt = asm.preview(list(docs.values()), query="q?", salt=salt)
        assert prompt.text.find(docs["G"]) < prompt.text.find(docs["F"]) < prompt.text.find(docs["B"])


def _review_pool() -> list[str]:
    """The review's chunk pool: 25 texts of 3 to 60 common words (seeded)."""
    import random

    rng = random.Random(0)
    wl = "the of and to in is was for on that with as by at from his her it an were are which this be".split()
    return [" ".join(rng.choice(wl) for _ in range(rng.randint(3, 60))) for _ in range(25)]


def test_cache_aware_auto_keeps_the_hits_of_none_when_the_greedy_walk_pads(default_tok):
    """The greedy walk under ``auto`` padded a segment boundary because that added a
    cached block at that step, and then cached 64 tokens where the unpadded walk (the one
    ``none`` takes) caches 96: ``auto`` must keep every hit ``none`` would get."""
    pool = _review_pool()
    system = "You answer from documents."
    asm = Assembler(default_tok, block_size=16, policy="cache_aware", alignment="auto", capacity_blocks=None)
    for ids, query in (([2, 6, 7], "q2?"), ([6, 4], "q1?"), ([0], "q2?"), ([3, 8, 1, 9, 5], "what is it?"),
                       ([7, 8, 5, 3], "q1?")):
        asm.assemble([pool[i] for i in ids], query=query, system=system)
    chunks = [pool[i] for i in (7, 0, 3, 8)]
    auto = asm.preview(chunks, query="q2?", system=system, alignment="auto")
    none = asm.preview(chunks, query="q2?", system=system, alignment="none")
    assert none.predicted_cached_tokens == 96
    assert auto.predicted_cached_tokens == 96


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests, st.sampled_from([4, 16]), st.booleans())
def test_cache_aware_auto_never_predicts_fewer_cached_tokens_than_none(default_tok, reqs, bs, bounded):
    cap = 2000 // bs if bounded else None  # bounded: a few prompts' worth, so blocks get evicted
    asm = Assembler(default_tok, block_size=bs, policy="cache_aware", alignment="auto", capacity_blocks=cap)
    systems = ("You answer from the passages.", None)
    for chunk_ids, q, sys_i in reqs:
        chunks = [POOL[i] for i in chunk_ids]
        kw = {"query": f"question {q}?", "system": systems[sys_i]}
        auto = asm.preview(chunks, alignment="auto", **kw).predicted_cached_tokens
        none = asm.preview(chunks, alignment="none", **kw).predicted_cached_tokens
        assert auto >= none, (auto, none)
        asm.assemble(chunks, **kw)


@pytest.mark.parametrize("bad", [-1, 0, "10", True, 1.5])
@pytest.mark.parametrize("field", ["max_chunks", "max_sets"])
def test_popularity_tracker_bounds_are_checked_when_built(field, bad):
    """``-1`` failed later with a raw KeyError, ``"10"`` with a TypeError, and ``0``
    learnt nothing."""
    from promptsplice.errors import ConfigError

    with pytest.raises(ConfigError, match=f"PopularityTracker {field} must be an int >= 1"):
        PopularityTracker(**{field: bad})


@pytest.mark.parametrize("policy", ["cache_aware", "retrieval"])
def test_deferred_chunks_go_behind_the_others_past_the_cached_prefix(default_tok, policy):
    """``defer``: the chunks a position-independent runner will relocate go behind those
    it computes (each part in its order); chunks inside the cached prefix stay put, a
    preview shows what the send lays, and the sent order is the one a repeat keeps."""
    asm = Assembler(default_tok, block_size=16, policy=policy, alignment="all", capacity_blocks=None)
    kw = {"query": "q?", "system": "You answer from the passages."}
    asm.assemble([POOL[0], POOL[1]], **kw)  # c0, c1 cached behind the system prompt
    chunks = [POOL[i] for i in (0, 1, 2, 3, 4, 5)]

    def ids(prompt):
        return [s.chunk_ids[0] for s in prompt.segments if s.chunk_ids]

    plain = asm.preview(chunks, **kw)
    assert ids(plain)[:2] == ["c0", "c1"] and plain.predicted_cached_tokens >= plain.segments[2].end
    moved = asm.preview(chunks, defer=["c0", "c2", "c4"], **kw)
    rest = ids(plain)[2:]
    assert ids(moved) == ["c0", "c1"] + [i for i in rest if i not in ("c2", "c4")] + [i for i in rest if i in ("c2", "c4")]
    assert moved.predicted_cached_tokens == plain.predicted_cached_tokens
    assert sorted(moved.token_ids) == sorted(plain.token_ids) and len(moved.block_hashes) == len(plain.block_hashes)
    assert asm.preview(chunks, defer=[ids(plain)[-1], "c1"], **kw).token_ids == plain.token_ids  # nothing moves
    sent = asm.assemble(chunks, defer=["c2", "c4"], **kw)
    assert sent.token_ids == moved.token_ids
    if policy == "cache_aware":  # the sent order is remembered: a repeat keeps it
        assert ids(asm.preview(chunks, **kw)) == ids(sent)
    for bad in ("c2", [2], None):
        with pytest.raises(ConfigError, match="defer"):
            asm.preview(chunks, defer=bad, **kw)
