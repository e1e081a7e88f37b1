"""Chunks that are mostly runs of one byte (log padding, rulers, separator lines).

CPython's ``bytes.find`` runs its linear two-way search only for a needle of >= 100
bytes in a haystack of >= 2,500 that it is at most ~3/4 of; otherwise it compares up to
the needle's length at each offset, which on runs of one byte is len(needle) *
len(haystack).  The passes searched each candidate chunk in turn (and checked every
overlap edge with ``in``), so 200 such chunks of < 2 KB took 5.5 s (4 KB ones 47 s)
while random text of that shape took 0.02 s; the search budget, charged the
haystack's bytes, never saw it.  ``dedup/_finder.py``'s ``find`` gives every long
needle a haystack that takes the linear path.
"""

from __future__ import annotations

import random
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import promptsplice.dedup._finder as finder
import promptsplice.dedup._overlap as _overlap
import promptsplice.dedup._passes as passes
from promptsplice.dedup import DedupConfig, dedup
from tests.dedup.test_properties import check_result


def padded_chunks(pad: str = " ", source: bool = True, n: int = 200, top: int = 2040) -> list:
    """The reviewer's case: n chunks of at most ``top`` bytes, each a run of ``pad`` with
    its number in a paragraph of its own (a log's padded records)."""
    rng = random.Random(0)
    chunks = []
    for i in range(n):
        x = rng.randint(top // 2 - 20, top - 140)
        text = pad * x + f"\n\n{i}" + pad * rng.randint(50, top - x)
        chunks.append({"text": text, "metadata": {"source": "log"} if source else {}})
    return chunks


@pytest.mark.parametrize(("pad", "source", "top", "bound"), [(" ", False, 3000, 2.0), ("-", True, 2040, 2.0)])
def test_runs_of_one_byte_take_linear_time(pad, source, top, bound):
    # CPU seconds, measured on a slow shared machine: 0.4 without a source, 0.6 with one
    # (the overlap pass's pairs); they took 3.1 and 5.7.  On a 2-core AVX2 machine the
    # first took 0.83-1.0 alone and 1.56 once inside the full suite, over its old bound
    # of 1.5.  This thread's CPU time (the process's also counts the engines' threads).
    chunks = padded_chunks(pad, source, top=top)
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        result = dedup(chunks)
        best = min(best, time.thread_time() - start)
        if best < bound:
            break
    assert best < bound, best
    check_result(chunks, DedupConfig(), result)
    if source:  # every pair's seam is a run of pad bytes: any length could be the overlap
        assert result.stats.removed["overlap"] == 0 and result.stats.removed["passage"] > 0
    else:
        assert result.stats.removed["passage"] > 0


# -- every long needle takes CPython's linear search ------------------------------------

_HERE = (finder.__file__, passes.__file__, _overlap.__file__)
_TAIL = 2001  # the adaptive search's last 2,000 offsets end in bytes no needle holds


def _linear(hay: bytes, n: int, m: int) -> bool:
    """Whether CPython 3.10-3.13 searches ``needle`` (m bytes) in ``hay[:n]`` in linear
    time (Objects/stringlib/fastsearch.h): a short needle compares fewer than 100
    bytes an offset; a long one needs the two-way search, or the adaptive one on a
    haystack whose last offsets end where no needle's last byte can be."""
    if m < 100:
        return True
    if n < 2500:
        return False
    return (m >> 2) * 3 < (n >> 2) or hay[n - _TAIL : n] == b"\xff" * _TAIL


def _nonlinear_searches(chunks) -> list[tuple[int, int]]:
    """(haystack, needle) lengths of the ``bytes.find`` calls of the passes that CPython
    does not run in linear time."""
    bad = []

    def hook(frame, event, arg):
        if event != "c_call" or getattr(arg, "__name__", "") != "find":
            return
        hay = getattr(arg, "__self__", None)
        if type(hay) is not bytes or frame.f_code.co_filename not in _HERE:
            return
        local = frame.f_locals
        needle = local.get("needle")
        if needle is None:
            needle = local.get("piece")
        if needle is None:
            return
        n = len(hay)
        if local.get("hay") is hay and "end" in local:  # find(): hay.find(needle, 0, end)
            n = local["end"]
        elif "limit" in local and "starts" in local and hay is getattr(local.get("self"), "hay", None):
            n = local["starts"][local["limit"]] - 1  # the joined bytes, up to limit
        if not _linear(hay, n, len(needle)):
            bad.append((n, len(needle)))

    sys.setprofile(hook)
    try:
        dedup(chunks)
    finally:
        sys.setprofile(None)
    return bad


@pytest.mark.parametrize("source", [True, False])
def test_no_long_needle_is_searched_in_quadratic_time(source):
    # It was 1,000s of searches of a chunk in another chunk of < 2,500 bytes.
    assert _nonlinear_searches(padded_chunks("=", source, n=80)) == []


# -- a containment pass is not repeated over the chunks it just checked -----------------


def test_containment_is_not_repeated_over_the_chunks_it_just_checked(monkeypatch):
    """dedup runs containment before the overlap merge; the merge of a same-source
    group ran it again over those very chunks (a group of more than 2 always), which
    can find nothing new."""
    outputs: list[dict[int, tuple[object, bytes]]] = []
    repeats = []
    real = passes.Passes.absorb_contained

    def absorb_contained(self, kept):
        for seen in outputs:
            if len(kept) >= 2 and all(seen.get(id(k), (None, None)) == (k, k.data) for k in kept):
                repeats.append(len(kept))
        out = real(self, kept)
        outputs.append({id(k): (k, k.data) for k in out})
        return out

    monkeypatch.setattr(passes.Passes, "absorb_contained", absorb_contained)
    chunks = padded_chunks(" ", True, n=60)
    result = dedup(chunks)
    assert outputs and repeats == []
    check_result(chunks, DedupConfig(), result)


# -- the linear searches give bytes.find's answers ---------------------------------------

_BYTES = st.sampled_from([b" ", b"a", b"ab", b"\n\n", b"\xc3\xa9", b"x" * 7])
_RUNS = st.lists(st.tuples(_BYTES, st.integers(0, 900)), max_size=6).map(lambda r: b"".join(p * k for p, k in r))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_RUNS, _RUNS, st.data())
def test_find_answers_as_bytes_find(hay, needle, data):
    end = data.draw(st.integers(0, len(hay)))
    if data.draw(st.booleans()) and len(hay) > 1:  # a needle that occurs
        a = data.draw(st.integers(0, len(hay) - 1))
        needle = hay[a : data.draw(st.integers(a + 1, len(hay)))]
    assert finder.find(hay, needle, end) == hay.find(needle, 0, end)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_RUNS, min_size=1, max_size=12), _RUNS, st.data())
def test_candidates_answer_as_if_searched_in_turn(datas, needle, data):
    order = sorted(data.draw(st.sets(st.integers(0, len(datas) - 1))))
    if order and data.draw(st.booleans()):  # a needle that occurs in a candidate
        d = datas[data.draw(st.sampled_from(order))]
        if d:
            a = data.draw(st.integers(0, len(d) - 1))
            needle = d[a : data.draw(st.integers(a + 1, len(d)))]
    expected, scanned = None, 0
    for i in order:
        scanned += len(datas[i])
        pos = datas[i].find(needle)
        if pos >= 0:
            expected = (i, pos)
            break
    assert finder._first_of(datas, order, needle) == (expected, scanned)
