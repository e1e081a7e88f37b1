"""The passes' search shortcuts: the grid anchor index (dedup/_anchors.py), the switch
to it (dedup/_finder.py), and the sentence-piece filter (dedup/_passes.py).

The index must reach every chunk that holds a needle, and dedup must give the same
result whichever search answers: the plain search of the joined bytes (what small
requests use) or the index (what a pass switches to after a few dozen searches).  The
filter must only skip searches that find nothing: the result with it off is the same.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import promptsplice.dedup._native as _native
import promptsplice.dedup._overlap as _overlap
import promptsplice.dedup._finder as finder
import promptsplice.dedup._passes as passes
from promptsplice.benchmarks.dedup_bench import make_requests, scaling_workload
from promptsplice.dedup import DedupConfig, Relation, dedup
from promptsplice.dedup._anchors import MIN_NEEDLE, GridIndex
from tests.dedup.test_properties import check_result, configs, retrievals


@pytest.fixture(autouse=True, scope="module")
def _python_passes():
    """These shortcuts are the Python passes'; the C core (test_speedups.py) would answer
    the small requests here without them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "core", None)
        yield


# Few distinct bytes (one of them multi-byte UTF-8): grams repeat across chunks.
texts = st.lists(st.sampled_from(["ab", "a", "b", ". ", "é", "\n\n", "abba"]), max_size=60).map(
    lambda parts: "".join(parts).encode("utf-8")
)


@settings(max_examples=300, deadline=None)
@given(st.lists(texts, min_size=1, max_size=12), st.data())
def test_candidates_reach_every_chunk_holding_the_needle(datas, data):
    grid = GridIndex()
    for key, d in enumerate(datas):
        grid.add(key, d)
    source = data.draw(st.sampled_from(datas))
    a = data.draw(st.integers(0, len(source)))
    needle = source[a : data.draw(st.integers(a, len(source)))]
    holders = {key for key, d in enumerate(datas) if needle in d}
    got = grid.candidates(needle)
    if len(needle) < MIN_NEEDLE:
        assert got is None
    else:  # None only when more than a few hundred chunks qualify: never with 12
        assert got is not None and holders <= got


def test_needle_held_nowhere_has_no_candidates():
    grid = GridIndex()
    grid.add("x", b"The treaty was signed in 1648 at Osnabrueck and Muenster.")
    assert grid.candidates(b"The treaty was signed in 1649 at Osnabrueck.") == set()
    assert grid.candidates(b"treaty was signed in 1648 at Osnabrueck and") == {"x"}


def _canon(result):
    chunks = [
        (k.id, k.text, k.data, k.digest, k.metadata,
         [(o.index, o.id, o.relation, o.span) for o in k.origins],
         [(r.chunk_id, r.offset, r.length, r.found_in, r.found_at) for r in k.removed_passages])
        for k in result.chunks
    ]  # fmt: skip
    return chunks, [(d.index, d.id, d.reason) for d in result.dropped], result.stats


def _plain(chunks, **options):
    """dedup with the index switched off: every search goes through the joined bytes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(finder, "_SWITCH", 10**9)
        mp.setattr(_overlap, "_GROUP_GRID", 10**9)
        return dedup(chunks, **options)


@pytest.mark.parametrize("placed", [True, False])
@pytest.mark.parametrize(
    "options", [{}, {"exact": False}, {"containment": False}, {"min_passage": 40}]
)
def test_large_request_uses_the_index_and_matches_the_plain_search(options, placed, monkeypatch):
    chunks = scaling_workload(1500, chunk_bytes=200, seed=3)
    # One long document seen through 60 overlapping windows: a same-source group above
    # _GROUP_GRID, whose overlap partners are found through the index.  The document
    # joins the workload's chunks, duplicates and overlapping windows among them, so it
    # repeats passages: window 4's tail matches window 0's head over 118 bytes, and
    # without offsets the longest matches merged windows out of order (4 chunks that
    # are not its text).  Those seams disagree, so only offsets (start_index) merge them.
    doc = " ".join(c["text"] for c in chunks[:100])
    chunks += [
        {"text": doc[a : a + 300], "id": f"one/{a}",
         "metadata": {"source": "one", "start_index": a} if placed else {"source": "one"}}
        for a in range(0, 200 * 60, 200)
    ]  # fmt: skip
    plain = _plain(chunks, **options)
    queries = []
    real = GridIndex.candidates
    monkeypatch.setattr(GridIndex, "candidates", lambda self, n: queries.append(n) or real(self, n))
    indexed = dedup(chunks, **options)
    assert len(queries) > 100  # the passes did switch to the index
    assert _canon(indexed) == _canon(plain)
    removed = indexed.stats.removed
    assert removed["contained"] > 0 or options.get("containment") is False
    merged = {o.id for k in indexed.chunks for o in k.origins if o.relation is Relation.MERGED}
    if placed:
        assert len({m for m in merged if m.startswith("one/")}) > 10  # the long group merged
    # The windows alone (no passage cut) merge only into the document's text: without
    # offsets they stay apart (the longest matches made 6 chunks, none of them its text).
    alone = dedup([c for c in chunks if c.get("id", "").startswith("one/")], **{**options, "passages": False})
    assert all(k.text in doc for k in alone.chunks)
    assert len(alone.chunks) == (1 if placed else 60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(retrievals(), configs)
def test_index_from_the_first_search_gives_the_same_result(chunks, cfg):
    plain = _plain(chunks, config=cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(finder, "_SWITCH", 0)
        mp.setattr(_overlap, "_GROUP_GRID", 0)
        indexed = dedup(chunks, cfg)
    check_result(chunks, cfg, indexed)
    assert _canon(indexed) == _canon(plain)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(retrievals(), configs)
def test_partners_found_by_their_heads_give_the_same_result(chunks, cfg):
    """A tail the index cannot narrow (common text) finds its partners by their heads:
    forced here for every tail (a candidate cap of 1), the merges are the plain ones."""
    import promptsplice.dedup._anchors as anchors

    plain = _plain(chunks, config=cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_overlap, "_GROUP_GRID", 0)
        mp.setattr(anchors, "_MAX_CANDIDATES", 1)
        indexed = dedup(chunks, cfg)
    check_result(chunks, cfg, indexed)
    assert _canon(indexed) == _canon(plain)


def test_windows_whose_tails_are_common_text_are_not_checked_pair_by_pair(monkeypatch):
    """Windows of a log cut at line ends share their 64-byte tail (one suffix on every
    line): the index gave up on it and every ordered pair was checked (3,200 windows:
    10.2M checks, 6.3 s; a review, 2026-12-07).  Their heads are unique: the partners
    come from them, two checks a window, and the windows merge back into the log."""
    import random

    suffix = ' level=INFO service=checkout-api region=eu-west-1 msg="heartbeat ok, all subsystems nominal"'
    rnd = random.Random(0)
    lines = [f"{i:08d} {rnd.getrandbits(40):010x}{suffix}" for i in range(4 * 400 + 8)]
    chunks = [{"text": "\n".join(lines[4 * w : 4 * w + 8]), "id": f"w{w}", "metadata": {"source": "app.log"}}
              for w in range(400)]
    rnd.shuffle(chunks)
    checks = []
    real = _overlap._overlap_len
    monkeypatch.setattr(_native, "core", None)  # the Python pair check, counted
    monkeypatch.setattr(_overlap, "_overlap_len", lambda *a: checks.append(1) or real(*a))
    out = dedup(chunks)
    assert [k.text for k in out.chunks] == ["\n".join(lines[: 4 * 399 + 8])]
    assert len(checks) < 4 * 400


def _unfiltered(chunks, cfg):
    """dedup with the sentence-piece filter off: every needle is searched."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(passes, "_FILTER", False)
        return dedup(chunks, cfg)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(retrievals(), configs)
def test_piece_filter_only_skips_searches_that_find_nothing(chunks, cfg):
    assert _canon(dedup(chunks, cfg)) == _canon(_unfiltered(chunks, cfg))


def test_piece_filter_skips_most_searches_on_the_bench_workload(monkeypatch):
    requests = make_requests(total_mb=0.1, chunk_bytes=1024, seed=4, n_docs=20)
    searches = []
    real = finder.Finder.first
    monkeypatch.setattr(finder.Finder, "first", lambda self, *a: searches.append(1) or real(self, *a))
    cfg = DedupConfig()
    filtered = [_canon(dedup(r, cfg)) for r in requests]
    n_filtered = len(searches)
    searches.clear()
    plain = [_canon(_unfiltered(r, cfg)) for r in requests]
    assert filtered == plain
    removed = sum(c[2].removed["contained"] + c[2].removed["passage"] for c in filtered)
    assert removed >= len(requests)  # the workload has hits for the filter to keep
    assert 0 < n_filtered * 5 < len(searches), (n_filtered, len(searches))
