"""The optional C core of the overlap, containment and passage searches (dedup/_speedups.c).

It must answer exactly what the Python passes answer (the first occurrence of each
needle in the earliest chunk searched), so every test compares it with the Python
passes or with a brute-force search; the Python passes stay the reference.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import promptsplice.dedup as dedup_pkg
import promptsplice.dedup._native as _native
import promptsplice.dedup._overlap as _overlap
import promptsplice.dedup._passes as passes
from promptsplice.benchmarks.dedup_bench import make_requests, scaling_workload
from promptsplice.dedup import dedup
from tests.dedup.test_anchors import _canon, texts
from tests.dedup.test_properties import check_result, configs, retrievals

speedups = _native.core


@pytest.fixture(autouse=True, scope="module")
def _built():
    # scripts/setup.sh requires the build (PROMPTSPLICE_REQUIRE_C_CORE=1): without it
    # every test here would only fail on None, so say what is missing once, clearly.
    assert speedups is not None, "dedup's C core is not built: run `make setup` (a C compiler is needed)"


def _python(chunks, *args, **options):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "core", None)
        return dedup(chunks, *args, **options)


def test_the_c_core_is_built_by_the_setup():
    # scripts/setup.sh installs the package with setup.py's optional extension; on a
    # machine with a C compiler (every machine the README's commands run on) it is there.
    assert speedups is not None
    assert dedup_pkg.ACCELERATED is True


_WITHOUT_CORE = """
import importlib.abc, sys, warnings
class NoCore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "promptsplice.dedup._speedups":
            raise ImportError("no C compiler on this machine")
sys.meta_path.insert(0, NoCore())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import promptsplice.dedup as d
assert d.ACCELERATED is False
assert len(d.dedup([{"id": "a", "text": "x. " * 40}, {"id": "b", "text": "x. " * 40}]).chunks) == 1
print([str(w.message) for w in caught if w.category is RuntimeWarning])
"""


def test_a_missing_c_core_says_so_once_at_import_and_dedup_still_answers():
    # pip hides setup.py's warning when the optional build fails; the user learns it here.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _WITHOUT_CORE], capture_output=True, text=True, cwd="/", timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    (message,) = eval(run.stdout.strip().splitlines()[-1])  # exactly one warning
    assert "C core" in message and "not built" in message and "install a C compiler" in message
    assert "PROMPTSPLICE_REQUIRE_C_CORE=1" in message


def _first(datas, limit, needle):
    for h in range(limit):
        at = datas[h].find(needle)
        if at >= 0:
            return h, at
    return None


def _contained_reference(datas):
    """The Python pass's answer: longest first (stable), each chunk searched in those
    before it, a host that was itself found followed to its own host."""
    order = sorted(range(len(datas)), key=lambda i: len(datas[i]), reverse=True)
    ranked = [datas[i] for i in order]
    host, out = {}, []
    for r in range(1, len(ranked)):
        found = _first(ranked, r, ranked[r])
        if found is not None:
            h, at = found
            if h in host:
                h, extra = host[h]
                at += extra
            host[r] = (h, at)
            out.append((order[r], order[h], at))
    return out


def _scan_reference(datas, mp, whole, cut):
    """The Python pass's loop: each chunk's paragraphs searched in the chunks before it
    (as cut so far), ``cut(j, hits)`` giving the chunk's new bytes or None (gone)."""
    datas = list(datas)
    j = 1
    while j < len(datas):
        d = datas[j]
        paras = d.split(b"\n\n")
        hits, offset = [], 0
        if len(d) >= mp and (len(paras) > 1 or whole):
            for i, p in enumerate(paras):
                if len(p) >= mp:
                    found = _first(datas, j, p)
                    if found is not None:
                        hits.append((i, offset, len(p), *found))
                offset += len(p) + 2
        if hits:
            new = cut(j, hits)
            if new is None:
                del datas[j]
                continue
            datas[j] = new
        j += 1


def _cutter(log, datas):
    """A cut that drops the hit paragraphs (None when nothing is left) and logs its calls."""
    current = list(datas)

    def cut(j, hits):
        log.append((j, hits))
        gone = {h[0] for h in hits}
        paras = current[j].split(b"\n\n")
        kept = [p for i, p in enumerate(paras) if i not in gone]
        if not kept:
            del current[j]
            return None
        current[j] = b"\n\n".join(kept)
        return current[j]

    return cut


def _scan_both(datas, mp, whole):
    fast, slow = [], []
    assert speedups.passage_scan(list(datas), mp, whole, _cutter(fast, datas)) is None
    _scan_reference(datas, mp, whole, _cutter(slow, datas))
    return fast, slow


# Dots and paragraph breaks from a small alphabet: pieces repeat, needles hold 0, 1 or
# many dots, and the dot walk runs past its budget into memmem.
dotted = st.lists(st.sampled_from([b"ab", b"a", b".", b". ", b"\n", b"\n\n", b"\xc3\xa9"]), max_size=80).map(
    b"".join
)


@pytest.mark.reliability
@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(dotted, texts), min_size=1, max_size=10), st.data())
def test_contained_and_passage_scan_match_a_brute_force_search(datas, data):
    assert speedups.contained(datas) == _contained_reference(datas)
    mp = data.draw(st.sampled_from([1, 2, 5, 16]))
    whole = data.draw(st.booleans())
    fast, slow = _scan_both(datas, mp, whole)
    assert fast == slow


@pytest.mark.reliability
@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(dotted, texts), min_size=1, max_size=8), st.sampled_from([1, 2, 4, 16]))
def test_overlap_edges_match_the_python_search(datas, m):
    lens = list(map(len, datas))
    assert sorted(speedups.overlap_edges(datas, m)) == sorted(_overlap._edges(datas, lens, m, False))


def test_overlap_edges_take_the_longest_overlap_and_skip_containment():
    a = b"0123456789abcdefXYZXYZ"
    b = b"XYZXYZtail and more"
    # Both 3 and 6 bytes overlap; the longest wins.  A chunk inside the other is no edge.
    assert speedups.overlap_edges([a, b], 3) == [(6, 0, 1)]
    assert speedups.overlap_edges([a, b"abcdefXYZ"], 3) == []
    with pytest.raises(ValueError):
        speedups.overlap_edges([a, b], 0)


def test_a_needle_after_many_dots_is_found_by_the_fallback_search():
    # 1,000 dots before the match: the dot walk gives up after its budget and memmem
    # finds the first occurrence from where it stopped.
    hay = b"." * 1000 + b"xy.z"
    assert speedups.contained([b"xy.z", hay]) == [(0, 1, 1000)]
    assert speedups.contained([hay, b"y.q"]) == []
    fast, slow = _scan_both([hay, b"k\n\nxy.z"], 3, False)
    assert fast == slow == [(1, [(1, 3, 4, 0, 1000)])]


def test_bad_arguments_raise_type_errors():
    with pytest.raises(TypeError):
        speedups.contained([b"a", "b"])
    with pytest.raises(TypeError):
        speedups.contained((b"a",))
    with pytest.raises(TypeError):
        speedups.passage_scan([b"a"], "1", False, lambda j, h: None)
    with pytest.raises(TypeError, match="cut must be callable"):
        speedups.passage_scan([b"a"], 1, False, None)
    with pytest.raises(TypeError, match="cut must return bytes or None"):
        speedups.passage_scan([b"a para", b"a para\n\nb"], 1, False, lambda j, h: "text")
    with pytest.raises(ZeroDivisionError):  # an error in the callback propagates
        speedups.passage_scan([b"a para", b"a para\n\nb"], 1, False, lambda j, h: 1 / 0)


def test_a_chunk_emptied_by_its_cut_is_gone_for_the_chunks_after_it():
    # chunk 1 is all repeated paragraphs: cut away; chunk 2's paragraph then can only be
    # found in chunk 0 (index 0), and indices after the gone chunk move down
    datas = [b"alpha\n\nbeta", b"alpha\n\nbeta", b"beta\n\ngamma"]
    fast, slow = _scan_both(datas, 2, False)
    assert fast == slow == [(1, [(0, 0, 5, 0, 0), (1, 7, 4, 0, 7)]), (1, [(0, 0, 4, 0, 7)])]


@pytest.mark.reliability
def test_many_paragraphs_of_dots_take_linear_time():
    # each paragraph asked the filter from the chunk's first dot (quadratic): 3 s here
    import time

    datas = [b"x" * 20, b".\n\n" * 80000]
    start = time.thread_time()
    speedups.passage_scan(datas, 1, False, lambda j, h: None)
    assert time.thread_time() - start < 0.5


@pytest.mark.reliability
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(retrievals(), configs)
def test_dedup_with_the_c_core_equals_the_python_passes(chunks, cfg):
    calls = []
    real = speedups.contained
    with pytest.MonkeyPatch.context() as mp:  # the small requests here must take the C path
        mp.setattr(speedups, "contained", lambda d: calls.append(1) or real(d))
        fast = dedup(chunks, cfg)
    if cfg.containment and len(fast.chunks) + fast.stats.removed["contained"] >= 2:
        assert calls
    check_result(chunks, cfg, fast)
    assert _canon(fast) == _canon(_python(chunks, cfg))


def test_the_bench_workload_gives_the_same_result_both_ways():
    for request in make_requests(total_mb=0.3, chunk_bytes=1024, seed=5, n_docs=30):
        assert _canon(dedup(request)) == _canon(_python(request))


def test_a_request_of_a_few_shared_sentences_within_the_cores_limits_gives_the_same_result_both_ways():
    """64 chunks of ~4 KB made of 30 sentences (254 KB): the Python passes' search budget
    ran out and left 34 of 99 repeated passages in, while the C core (no budget) removed
    them; within the core's limits the Python passes now search without a budget."""
    import random

    from promptsplice.dedup import DedupConfig

    rng = random.Random(1)
    sentences = [("word%02d " % i) * 2 + "sentence number %d." % i for i in range(30)]
    chunks = []
    for c in range(64):
        paras, size = [], 0
        while size < 3900:
            p = " ".join(rng.choice(sentences) for _ in range(3))
            paras.append(p)
            size += len(p) + 2
        chunks.append({"text": "\n\n".join(paras), "id": f"c{c}"})
    assert sum(len(c["text"].encode()) for c in chunks) <= passes._C_MAX_BYTES
    cfg = DedupConfig(min_passage=32)
    fast, slow = dedup(chunks, cfg), _python(chunks, cfg)
    assert fast.stats.removed["passage"] == slow.stats.removed["passage"] == 99
    assert _canon(fast) == _canon(slow)


def test_large_requests_fall_back_to_the_python_passes_and_agree(monkeypatch):
    chunks = scaling_workload(300, chunk_bytes=200, seed=1)
    calls = []
    real = speedups.contained
    monkeypatch.setattr(speedups, "contained", lambda d: calls.append(len(d)) or real(d))
    default = dedup(chunks)
    # 300 chunks > _C_MAX_CHUNKS: the Python passes with their index (only the small
    # same-source groups of the overlap pass, checked for containment first, use the core)
    assert max(calls, default=0) <= passes._C_MAX_CHUNKS
    calls.clear()
    monkeypatch.setattr(passes, "_C_MAX_CHUNKS", 10**9)
    monkeypatch.setattr(passes, "_C_MAX_BYTES", 10**12)
    forced = dedup(chunks)
    assert max(calls) > 64 and _canon(forced) == _canon(default)


def test_requests_over_the_byte_limit_fall_back_to_the_python_passes(monkeypatch):
    # 10 chunks of ~30 KB: under _C_MAX_CHUNKS, over _C_MAX_BYTES (256 KiB)
    chunks = [f"doc {i}: " + c["text"] * 40 for i, c in enumerate(scaling_workload(10, chunk_bytes=1000, seed=2))]
    chunks.append(chunks[3][5000:9000])  # contained in chunk 3
    calls = []
    real = speedups.contained
    monkeypatch.setattr(speedups, "contained", lambda d: calls.append(len(d)) or real(d))
    default = dedup(chunks)
    assert default.stats.bytes_out > passes._C_MAX_BYTES and calls == []
    assert default.stats.removed["contained"] >= 1
    monkeypatch.setattr(passes, "_C_MAX_BYTES", 10**12)
    forced = dedup(chunks)
    assert calls and _canon(forced) == _canon(default)


# -- text without ASCII dots: the gram index -------------------------------------------
# The dot filter keys on b".": CJK full stops, Thai, tables and code give it nothing, so
# needles without dot keys ask the core's grid-gram index instead of a search of every
# earlier chunk.  The answers must not change; the counters show which search ran.

# Dotless pieces (CJK full stop and ideographs, spaces, breaks) that repeat, so that
# needles of >= 31 bytes (the index's minimum) occur in several chunks, at every phase.
dotless = st.lists(
    st.sampled_from([b"ab", b"a", b" ", b"\n", b"\n\n", b"\xe3\x80\x82", b"\xe6\x9d\xb1\xe4\xba\xac", b"0123456789abcdef"]),
    max_size=120,
).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(dotless, min_size=1, max_size=10), st.data())
def test_dotless_text_matches_a_brute_force_search(datas, data):
    # copies of slices of earlier items: containment and passage hits at any offset
    for _ in range(data.draw(st.integers(0, 4))):
        src = data.draw(st.sampled_from(datas))
        a = data.draw(st.integers(0, len(src)))
        b = data.draw(st.integers(a, len(src)))
        datas.append(data.draw(dotless) + src[a:b] + data.draw(dotless))
    assert speedups.contained(datas) == _contained_reference(datas)
    mp = data.draw(st.sampled_from([1, 16, 31, 32, 64]))
    fast, slow = _scan_both(datas, mp, data.draw(st.booleans()))
    assert fast == slow


def _cjk_chunks(n, paras, seed=1, pool=None):
    """n chunks of paras CJK paragraphs (60-140 ideographs and a full stop), drawn from
    a pool of that many paragraphs (every one distinct when pool is None)."""
    import random

    rng = random.Random(seed)
    ideographs = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    made = ["".join(rng.choices(ideographs, k=rng.randint(60, 140))) + "\u3002" for _ in range(pool or n * paras)]
    if pool is None:
        return ["\n\n".join(made[i * paras : (i + 1) * paras]) for i in range(n)]
    return ["\n\n".join(rng.sample(made, paras)) for _ in range(n)]


def _code_chunks(n, seed=2):
    import random

    rng = random.Random(seed)
    blocks = [
        "\n".join(
            "    " * rng.randint(0, 3) + f"{rng.choice(['x', 'total', 'value'])} = compute_{rng.randint(0, 999)}(arg{k}, {b})"
            for k in range(rng.randint(3, 8))
        )
        for b in range(30)
    ]
    return ["\n\n".join(rng.sample(blocks, 5)) for _ in range(n)]


@pytest.mark.parametrize("make", [_cjk_chunks.__name__, _code_chunks.__name__])
def test_dotless_requests_give_the_python_passes_answer(make):
    chunks = _cjk_chunks(40, 6, pool=18) if make == "_cjk_chunks" else _code_chunks(40)
    assert all("." not in c for c in chunks)
    # repeats of every kind: exact copies, a contained slice, an emptied chunk
    chunks += [chunks[3], chunks[7][50:400], chunks[1].split("\n\n")[0] + "\n\n" + chunks[2].split("\n\n")[1]]
    before = speedups.counters()
    fast = dedup(chunks)
    scans, indexed, _ = (b - a for a, b in zip(before, speedups.counters()))
    assert indexed > 0  # the core ran, with its index
    assert fast.stats.removed["passage"] > 0 and fast.stats.removed["contained"] > 0
    assert _canon(fast) == _canon(_python(chunks))
    for cfg in ({"containment": False}, {"passages": False}, {"min_passage": 32}):
        assert _canon(dedup(chunks, **cfg)) == _canon(_python(chunks, **cfg))


def test_dotless_needles_ask_the_gram_index_instead_of_every_chunk():
    # 64 chunks of 10 paragraphs, no ASCII dot, nothing repeated: the dot filter cannot
    # skip one needle.  A search of every earlier chunk per needle made ~20,000 plain
    # searches here (32 ms against 8 ms for the Python passes); the first needle of each
    # call is still searched plainly, the index answers the rest.
    datas = [c.encode() for c in _cjk_chunks(64, 10, seed=3)]
    paragraphs = sum(len(d.split(b"\n\n")) for d in datas[1:])
    before = speedups.counters()
    assert speedups.contained(datas) == _contained_reference(datas) == []
    speedups.passage_scan(datas, 128, False, lambda j, h: pytest.fail("no paragraph repeats"))
    scans, indexed, over_budget = (b - a for a, b in zip(before, speedups.counters()))
    assert scans <= 2 and over_budget == 0
    assert indexed >= len(datas) - 2 + paragraphs - 1


def test_periodic_text_falls_back_to_a_plain_search():
    # one gram at every grid point: walking its places would cost more than a plain
    # search, which answers instead (the same answer)
    datas = [b"a" * 5000, b"a" * 900 + b"b", b"a" * 64, b"a" * 40 + b"b", b"\n\n".join([b"a" * 70, b"a" * 50 + b"b"])]
    before = speedups.counters()
    assert speedups.contained(datas) == _contained_reference(datas)
    fast, slow = _scan_both(datas, 32, True)
    assert fast == slow
    assert speedups.counters()[2] > before[2]


def test_the_index_answers_the_first_occurrence_in_the_earliest_chunk():
    # needles placed at every phase, twice in one chunk, with pieces of them (whose
    # grams sit before offset 0 or past the end of a match) in front: the first
    # occurrence in the earliest chunk, as a brute-force search finds it
    import random

    rng = random.Random(4)
    ideographs = [chr(c).encode() for c in range(0x4E00, 0x4E00 + 50)]
    for _ in range(300):
        needle = b"".join(rng.choices(ideographs, k=rng.randint(11, 40)))
        pieces = [needle, needle[: rng.randint(16, len(needle) - 1)], needle[rng.randint(1, len(needle) - 16) :], b" "]
        datas = [b"".join(rng.choice(pieces) + b" " * rng.randint(0, 17) for _ in range(rng.randint(1, 6))) for _ in range(6)]
        datas.append(needle)
        datas.append(b"\n\n".join([b"x" * rng.randint(0, 3), needle, needle[:20]]))
        assert speedups.contained(datas) == _contained_reference(datas)
        fast, slow = _scan_both(datas, 31, rng.random() < 0.5)
        assert fast == slow


# -- overlap on periodic text: the linear search gives the same edges --------------------

periodic = st.lists(st.sampled_from([b"a", b"ab", b"aab", b"b", b"\xc3\xa9"]), max_size=30).map(b"".join)


def _overlap_reference(datas, m):
    out = []
    for a, A in enumerate(datas):
        for b, B in enumerate(datas):
            if a == b or len(A) <= m or len(B) <= m:
                continue
            ls = [L for L in range(m, min(len(A), len(B))) if A.endswith(B[:L])]
            if ls and not ((len(B) <= len(A) and B in A) or (len(A) <= len(B) and A in B)):
                out.append((max(ls), a, b))
    return sorted(out)


@settings(max_examples=300, deadline=None)
@given(st.lists(periodic, min_size=1, max_size=5), st.sampled_from([1, 2, 3, 5]))
def test_overlap_edges_after_the_budget_match_a_brute_force_search(datas, m):
    # per_byte=0, least=0 (and _BUDGET* = 0): every failed candidate hands the pair to
    # the KMP search, which must give the longest overlap the comparisons give.
    expected = _overlap_reference(datas, m)
    lens = list(map(len, datas))
    assert sorted(speedups.overlap_edges(datas, m)) == expected
    assert sorted(speedups.overlap_edges(datas, m, 0, 0)) == expected
    for a, A in enumerate(datas):
        for b, B in enumerate(datas):
            if len(A) > m and len(B) > m:
                L = speedups.overlap_len(A, B, m)
                assert L == speedups.overlap_len(A, B, m, 0, 0)
                assert L == _overlap._overlap_len(A, B, len(A), len(B), m, A[-m:])
                assert L == max([x for x in range(m, min(len(A), len(B))) if A.endswith(B[:x])] or [0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "core", None)
        assert sorted(_overlap._edges(datas, lens, m, False)) == expected
        mp.setattr(_overlap, "_BUDGET", 0)
        mp.setattr(_overlap, "_BUDGET_MIN", 0)
        assert sorted(_overlap._edges(datas, lens, m, False)) == expected
        assert sorted(_overlap._edges(datas, lens, m, True)) == sorted(_overlap._edges(datas, lens, m, False))


def test_overlap_len_checks_its_arguments():
    assert speedups.overlap_len(b"xxabab", b"ababyy", 1) == 4
    assert speedups.overlap_len(b"ab", b"ab", 5) == 0
    with pytest.raises(ValueError):
        speedups.overlap_len(b"ab", b"ab", 0)
    with pytest.raises(ValueError):
        speedups.overlap_edges([b"ab"], 1, -1, 0)
    with pytest.raises(TypeError):
        speedups.overlap_len("ab", b"ab", 1)


def _best(f, runs=3):
    """The least CPU time of ``runs`` calls of ``f``, this thread's (the process's
    counted the threads of the session's vLLM engines too)."""
    import time

    import gc

    best = float("inf")
    gc.collect()  # a collection of earlier tests' garbage inside one timed call read as quadratic time
    gc.disable()
    try:
        for _ in range(runs):
            start = time.thread_time()
            f()
            best = min(best, time.thread_time() - start)
    finally:
        gc.enable()
    return best


@pytest.mark.parametrize("use_core", [True, False])
def test_the_overlap_search_takes_linear_time_on_periodic_text(use_core):
    # A = b + a^n, B = a^(n/2) c a^n: A's tail occurs at nearly every offset of B and each
    # comparison fails at the c, O(n) each: 1 MB took 1.0 s in C and 6.7 s in Python.
    # The longest overlap, B's n/2 leading a's, holds shorter ones: the seam repeats, so
    # the pair stays apart (any run of a's could be the overlap); the check is linear too.
    def pair(n):
        a = {"text": "b" + "a" * n, "metadata": {"source": "s"}}
        return [a, {"text": "a" * (n // 2) + "c" + "a" * n, "metadata": {"source": "s"}}]

    small, large = pair(25_000), pair(400_000)  # 16x the bytes
    with pytest.MonkeyPatch.context() as mp:
        if not use_core:
            mp.setattr(_native, "core", None)
        for n, chunks in ((25_000, small), (400_000, large)):
            result = dedup(chunks)
            assert [k.text for k in result.chunks] == [c["text"] for c in chunks]
            assert result.stats.removed_bytes["overlap"] == 0
            assert _overlap._edges([c["text"].encode() for c in chunks], [n + 1, n // 2 + 1 + n], 64, False) == [
                (n // 2, 0, 1)]  # fmt: skip
        t_small = _best(lambda: dedup(small))
        t_large = _best(lambda: dedup(large), runs=1)
    # linear: ~16x; quadratic: ~256x
    assert t_large <= 60 * max(t_small, 1e-3), (t_small, t_large)


def _cut_case(n):
    """A chunk of n unique paragraphs Q_i each followed by a repeated one P_i (found in
    a holder), with every Q_i an input contained in it: n origins, n hits."""
    from promptsplice.dedup import DedupConfig, KeptChunk, Origin, Relation

    ps = [f"repeated paragraph {i:06d} lorem ipsum".encode() for i in range(n)]
    qs = [f"unique paragraph {i:06d} consectetur".encode() for i in range(n)]
    holder_data = b"\n\n".join(ps)
    holder = KeptChunk("h", None, holder_data, None, {}, [Origin(0, "h", {}, Relation.KEPT, (0, len(holder_data)))], [])
    paras = [p for pair in zip(qs, ps) for p in pair]
    data = b"\n\n".join(paras)
    origins = [Origin(1, "k", {}, Relation.KEPT, (0, len(data)))]
    hits = []
    offset = found_at = 0
    for i, p in enumerate(paras):
        if i % 2:
            hits.append((i, offset, len(p), holder, found_at))
            found_at += len(p) + 2
        else:
            origins.append(Origin(2 + i // 2, f"q{i}", {}, Relation.CONTAINED, (offset, offset + len(p))))
        offset += len(p) + 2
    k = KeptChunk("k", None, data, None, {}, origins, [])
    ctx = passes.Passes(DedupConfig(), dict.fromkeys(("passage", "contained"), 0), dict.fromkeys(("passage",), 0))
    return ctx, k, paras, hits, qs


def test_cutting_many_paragraphs_with_many_inputs_takes_near_linear_time():
    # Each origin was compared with every hit (and every cut): 4,000 of each, 1.8 s.
    ctx, k, paras, hits, qs = _cut_case(50)
    assert ctx._cut(k, paras, hits) is True
    assert k.data == b"\n\n".join(qs)
    assert [o.span for o in k.origins[1:]] == [(i * (len(qs[0]) + 2), i * (len(qs[0]) + 2) + len(qs[0])) for i in range(50)]
    assert [k.data[s:e] for s, e in (o.span for o in k.origins[1:])] == qs
    assert k.origins[0].span == (0, len(k.data)) and len(k.removed_passages) == 50

    def timed(n):
        case = _cut_case(n)
        return _best(lambda: case[0]._cut(*case[1:4]), runs=1)

    t_small = min(timed(500) for _ in range(3))
    t_large = timed(8000)  # 16x: linear ~16x (plus a log), quadratic ~256x
    assert t_large <= 64 * max(t_small, 1e-3), (t_small, t_large)
