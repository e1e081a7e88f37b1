"""The bounds: a radix tree with LRU eviction, the trimmed exact-content oracle, and the
property that no assembly beats the oracle (gap closed <= 1 by construction)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptsplice.benchmarks.assemble import bench_policies
from promptsplice.benchmarks.bounds import (
    OracleCounter,
    RadixPrefill,
    RelocationCeiling,
    radix_prefill_tokens,
    whole_block_segments,
)
from promptsplice.benchmarks.traces import RagChunk, RagRequest


def test_bounded_radix_evicts_least_recently_used_leaves():
    assert radix_prefill_tokens([[1, 2, 3, 4], [1, 2, 3, 4]], capacity_tokens=None) == 4 + 1
    r = RadixPrefill(capacity_tokens=6)
    assert r.add([1, 2, 3, 4]) == 4
    assert r.add([9, 8, 7]) == 3  # 7 tokens > 6: the LRU leaf [1, 2, 3, 4] goes
    assert r.add([1, 2, 3, 4]) == 4  # evicted: computed again
    assert r.add([1, 2, 3, 5]) == 1  # shares [1, 2, 3]
    assert r.prompt_tokens == 15 and r.prefill_tokens == 12
    unbounded = RadixPrefill()
    assert [unbounded.add(p) for p in ([1, 2, 3, 4], [9, 8, 7], [1, 2, 3, 4], [1, 2, 3, 5])] == [4, 3, 1, 1]


def test_oracle_credits_seen_segments_shared_prefixes_and_repeats():
    o = OracleCounter()
    assert o.add([(b"s", [1, 2, 3]), (b"a", [4, 5, 6, 7]), (b"q", [8, 9])]) == 9
    # a new chunk that starts like a seen one only pays for its new tail; a re-asked
    # query is free; one token is always computed
    assert o.add([(b"s", [1, 2, 3]), (b"b", [4, 5, 0]), (b"q", [8, 9])]) == 1
    assert o.add([(b"s", [1, 2, 3]), (b"q", [8, 9])]) == 1
    bounded = OracleCounter(capacity_tokens=5)
    assert bounded.add([(b"a", [1, 2, 3]), (b"b", [4, 5, 6])]) == 6  # a is evicted (6 > 5)
    assert bounded.add([(b"a", [1, 2, 3])]) == 3
    assert bounded.add([(b"b", [4, 5, 6])]) == 3  # evicted by a's return


def test_the_whole_block_oracle_pads_every_segment_but_the_query():
    segs = [(b"s", [1, 2, 3]), (b"a", [4, 5, 6, 7, 8]), (b"q", [9, 10])]
    assert whole_block_segments(segs, 4) == [(b"s", 4), (b"a", 8), (b"q", [9, 10])]
    assert whole_block_segments([(b"q", [9])], 4) == [(b"q", [9])]
    o, padded = OracleCounter(), OracleCounter()
    assert padded.add(whole_block_segments(segs, 4)) == 4 + 8 + 2 > o.add(segs) == 10
    # a seen segment is free in both; a new one that starts like a seen one pays in full
    # once padded (whole-segment reuse only)
    again = [(b"s", [1, 2, 3]), (b"b", [4, 5, 6, 0]), (b"q", [9, 10])]
    assert padded.add(whole_block_segments(again, 4)) == 4 and o.add(again) == 1


def test_the_relocation_ceiling_charges_the_recompute_of_each_relocated_chunk():
    """Block 4, r=1: a leading run seen before is free, a chunk seen elsewhere costs one
    block (its size when smaller), a new one its size, the query always; at
    ``recompute_at="run"`` a chunk behind the segment it followed before is free too."""
    q = (b"q", [9, 9])
    first = [(b"s", 4), (b"a", 8), (b"b", 12), q]
    moved = [(b"s", 4), (b"b", 12), (b"a", 8), (b"c", 4), q]  # b and a moved, c new
    pair = [(b"s", 4), (b"x", 4), (b"a", 8), (b"b", 12), q]  # a, b together again, behind new x
    chunk, run = RelocationCeiling(4, 1), RelocationCeiling(4, 1, per_chunk=False)
    assert chunk.add(first) == run.add(first) == 4 + 8 + 12 + 2
    assert chunk.add(moved) == run.add(moved) == 4 + 4 + 4 + 2  # s: the lead; b, a: a block each; c new
    assert chunk.add(pair) == 4 + 4 + 4 + 2 and run.add(pair) == 4 + 4 + 0 + 2  # a, then b after a
    assert chunk.add(first) == run.add(first) == 2  # a re-ask: the whole lead
    assert (chunk.prefill_tokens, run.prefill_tokens) == (26 + 14 + 14 + 2, 26 + 14 + 10 + 2)
    big = RelocationCeiling(4, 3)  # r blocks past a chunk's size: its size
    big.add(first)
    assert big.add(moved) == 12 + 8 + 4 + 2  # b and a computed whole (s: the lead)


@given(st.lists(st.lists(st.tuples(st.sampled_from([b"s", b"a", b"b", b"c", b"d"]), st.integers(1, 4)),
                         min_size=1, max_size=5, unique_by=lambda t: t[0]), min_size=1, max_size=12))
@settings(max_examples=200, deadline=None)
def test_the_ceiling_rises_with_r_and_never_beats_the_whole_block_oracle(reqs):
    """More recompute never prefills less; recomputing at every chunk never less than at
    run starts; r=0 never below the whole-block oracle (which also credits repeated
    queries)."""
    bs, q = 4, (b"q", [7])
    reqs = [[(d, n * bs) for d, n in segs] + [q] for segs in reqs]
    oracle = OracleCounter()
    totals = {}
    for r in (0, 1, 2):
        for per_chunk in (True, False):
            c = RelocationCeiling(bs, r, per_chunk=per_chunk)
            for segs in reqs:
                c.add(segs)
            totals[r, per_chunk] = c.prefill_tokens
    for segs in reqs:
        oracle.add(segs)
    for per_chunk in (True, False):
        assert oracle.prefill_tokens <= totals[0, per_chunk] <= totals[1, per_chunk] <= totals[2, per_chunk]
    for r in (0, 1, 2):
        assert totals[r, False] <= totals[r, True]


# -- the property ---------------------------------------------------------------------

WORDS = ("the river city bridge north harbor old castle was built in by king queen and of a "
         "trade market church tower wall gate").split()


@st.composite
def traces(draw):
    """Random RAG traces with the shapes dedup trims: windows of one document that
    overlap, sentences inside windows, exact duplicates under a second id, re-asked
    questions, shuffled orders and two system prompts."""
    doc_words = draw(st.lists(st.sampled_from(WORDS), min_size=40, max_size=120))
    doc = " ".join(doc_words)
    words = doc.split(" ")
    win, stride = draw(st.integers(6, 20)), draw(st.integers(3, 12))
    pool = []
    for k, start in enumerate(range(0, len(words), stride)):
        pool.append(RagChunk(f"w{k}", " ".join(words[start:start + win])))
    sentences = [RagChunk(f"s{k}", " ".join(words[a:a + 5])) for k, a in enumerate(range(0, len(words) - 5, 9))]
    reqs = []
    for n in range(draw(st.integers(2, 10))):
        picks = draw(st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=6, unique=True))
        chunks = [pool[i] for i in picks]
        if draw(st.booleans()):
            chunks.append(RagChunk("mirror:" + chunks[0].id, chunks[0].text))
        if draw(st.booleans()) and sentences:
            chunks.insert(draw(st.integers(0, len(chunks))), sentences[draw(st.integers(0, len(sentences) - 1))])
        if draw(st.booleans()) and len(pool) >= 2:
            # one chunk that is two others joined by the prompt's separator (Markdown, a
            # second index): a prefix hit can run across another request's boundaries
            a, b = draw(st.integers(0, len(pool) - 2)), draw(st.integers(0, len(pool) - 1))
            chunks.insert(draw(st.integers(0, len(chunks))), RagChunk(f"j{a}-{b}", pool[a].text + "\n\n" + pool[b].text))
        reqs.append(RagRequest(f"r{n}", draw(st.sampled_from(["Answer briefly.", "You are a guide. Cite passages."])),
                               chunks, draw(st.sampled_from(["Who built it?", "When?", "Where is the gate?"]))))
    return reqs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(traces(), st.sampled_from([4, 16]), st.sampled_from(["auto", "none", "all"]))
def test_no_policy_beats_the_oracle(reqs, bs, align):
    rep = bench_policies(reqs, block_size=bs, alignment=align)
    oracle = rep["oracle_prefill_tokens"]
    for name, m in rep["policies"].items():
        assert m["predicted_prefill_tokens"] >= oracle, (name, m["predicted_prefill_tokens"], oracle)
    for name, gap in rep["gap_closed"].items():
        assert gap is None or gap <= 1.0, (name, gap)
    assert rep["radix_prefill_tokens"] <= rep["radix_prefill_tokens_bounded"]
    assert rep["oracle_prefill_tokens"] <= rep["oracle_prefill_tokens_bounded"]


def test_a_chunk_holding_the_separator_cannot_beat_the_oracle():
    """Request 2 sends as chunks (p1+p2, p3) what request 1 sent as (p1, p2+p3): the same
    tokens, so a prefix cache hits across the segment boundaries the content bound works
    on; the content bound alone (206) was above what ``retrieval`` prefilled (143)."""
    p1 = ("The old harbor of the northern city was built by a king who wanted trade with the "
          "islands across the strait, and merchants came from every coast to sell salt and wool.")
    p2 = ("Later a bridge joined the two banks of the river, so that carts no longer waited for "
          "the ferry, and the market square grew around the church tower near the western gate.")
    p3 = ("In the last century the castle walls were restored, the towers were opened to visitors, "
          "and a museum of maritime history moved into the former customs house by the docks.")
    system = "Answer briefly from the passages."
    reqs = [
        RagRequest("r1", system, [RagChunk("a", p1), RagChunk("b", p2 + "\n\n" + p3)], "Who built the harbor?"),
        RagRequest("r2", system, [RagChunk("c", p1 + "\n\n" + p2), RagChunk("d", p3)], "When was the castle restored?"),
    ]
    for align in ("none", "auto"):
        rep = bench_policies(reqs, block_size=16, alignment=align)
        assert rep["oracle_prefill_tokens"] < rep["oracle_content_prefill_tokens"]  # the floor took the radix
        assert all(c["holds"] for c in rep["bound_checks"].values()), rep["bound_checks"]
        assert all(g is None or g <= 1.0 for g in rep["gap_closed"].values())


def test_bench_assemble_fails_when_a_policy_beats_its_bound(capsys):
    from promptsplice.benchmarks.assemble import bound_status as _bound_status
    from promptsplice.benchmarks.bounds import BOUND_EXIT

    ok = {"bound_checks": {"naive": {"bound": "radix", "bound_prefill_tokens": 10, "prefill_tokens": 12},
                           "stable": {"bound": "oracle", "bound_prefill_tokens": 5, "prefill_tokens": 5}}}
    assert _bound_status({"bench assemble": ok}) == 0
    bad = {"bound_checks": {**ok["bound_checks"], "cache_aware": {"bound": "oracle", "bound_prefill_tokens": 5,
                                                                  "prefill_tokens": 4}}}
    assert _bound_status({"bench assemble": ok, "bench assemble --suite (x, block 16)": bad}) == BOUND_EXIT
    assert "cache_aware prefilled 4 tokens, below its bound (oracle) of 5" in capsys.readouterr().err


def test_a_mode_below_its_bound_fails_the_bench():
    import pytest

    from promptsplice.benchmarks.bounds import BOUND_EXIT, BoundError, check_bounds

    ok = {"naive": {"bound": "radix", "bound_prefill_tokens": 100, "prefill_tokens": 100},
          "promptsplice": {"bound": "oracle", "bound_prefill_tokens": 40, "prefill_tokens": 70}}
    check_bounds(ok)  # at or above the bound: fine
    bad = {**ok, "promptsplice_store": {"bound": "oracle", "bound_prefill_tokens": 40, "prefill_tokens": 39}}
    with pytest.raises(BoundError, match=r"promptsplice_store prefilled 39 tokens, below its bound \(oracle\) of 40"):
        check_bounds(bad, what="bench rag")
    assert BOUND_EXIT not in (0, 1, 2, 3)  # distinct from usage errors and coverage


def test_a_mode_that_over_counts_its_hits_fails_against_its_own_radix_ideal():
    """The oracle is the least over every mode per request: a policy whose mirror
    over-predicted 31K cached tokens on ``tools`` still passed it.  A prefix cache never
    holds more than a radix tree fed the same prompts, so that ideal is the bound."""
    from promptsplice.benchmarks.bounds import bound_checks

    checks = bound_checks({"naive": 900, "stable": 500, "cache_aware": 300}, radix=800, oracle=200,
                          own_radix={"naive": 800, "stable": 450, "cache_aware": 420})
    assert checks["naive"] == {"bound": "radix", "bound_prefill_tokens": 800, "prefill_tokens": 900, "holds": True}
    assert checks["stable"] == {"bound": "own_radix", "bound_prefill_tokens": 450, "prefill_tokens": 500, "holds": True}
    assert checks["cache_aware"] == {"bound": "own_radix", "bound_prefill_tokens": 420, "prefill_tokens": 300,
                                     "holds": False}  # above the oracle (200), below its own prompts' ideal
    below = bound_checks({"stable": 250}, radix=800, oracle=300, own_radix={"stable": 260})
    assert below["stable"]["bound"] == "oracle" and not below["stable"]["holds"]  # the higher bound binds
