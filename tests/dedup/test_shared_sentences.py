"""Chunks made of the same few sentences: every gram is held by many chunks, so the
passes' index cannot narrow a needle's search much.  The searches must still scan a
number of bytes linear in the request (they scanned O(n * N): 2.2 MB took 6.7 s), and
the result must stay exact and complete, whatever the search budget cut short."""

from __future__ import annotations

import random
import sys

import pytest

import promptsplice.dedup._native as _native
import promptsplice.dedup._finder as finder
import promptsplice.dedup._passes as passes
from promptsplice.dedup import DedupConfig, dedup
from tests.dedup.test_properties import check_result


@pytest.fixture(autouse=True)
def _python_passes(monkeypatch):
    """The Python passes (the C core only takes calls of up to 64 chunks)."""
    monkeypatch.setattr(_native, "core", None)


def shared_sentence_chunks(n: int, seed: int = 0, repeated: bool = False) -> list[str]:
    """n chunks of 8 paragraphs, each the same 6 sentences in another order, with a
    number at the end; ``repeated``: the fourth paragraph of each is one of 20 shared
    ones (a repeated passage) and the sentences are drawn with repetition."""
    rnd = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    pool = [" ".join(rnd.choice(words) for _ in range(8)) + "." for _ in range(6)]
    shared = [" ".join(rnd.sample(pool, 6)) for _ in range(20)]
    chunks = []
    for _ in range(n):
        paras = []
        for p in range(8):
            if repeated and p == 3:
                paras.append(shared[rnd.randrange(20)])
            elif repeated:
                paras.append(" ".join(rnd.choice(pool) for _ in range(6)))
            else:
                paras.append(" ".join(rnd.sample(pool, 6)) + f" v{rnd.randrange(10**6)}.")
        chunks.append("\n\n".join(paras))
    return chunks


def _scanned(chunks: list[str]):
    """dedup's result, and the bytes of every ``bytes.find`` the passes called (the
    bytes each such search may scan: what their cost is proportional to)."""
    total = 0

    def hook(frame, event, arg):
        nonlocal total
        if event == "c_call" and getattr(arg, "__name__", "") == "find":
            hay = getattr(arg, "__self__", None)
            if type(hay) is bytes and frame.f_code.co_filename in (finder.__file__, passes.__file__):
                total += len(hay)

    sys.setprofile(hook)
    try:
        result = dedup(chunks)
    finally:
        sys.setprofile(None)
    return result, total


def test_searches_scan_bytes_linear_in_the_request_on_shared_sentences():
    small, large = shared_sentence_chunks(100), shared_sentence_chunks(400)
    _, s_small = _scanned(small)
    result, s_large = _scanned(large)
    check_result(large, DedupConfig(), result)
    n_large = sum(map(len, large))
    # linear: ~4x (measured 4.5x, 150 bytes a byte); it was ~32x (3,400 bytes a byte).
    assert s_large <= 8 * s_small, (s_small, s_large)
    assert s_large <= 400 * n_large, (s_large, n_large)


@pytest.mark.reliability
@pytest.mark.parametrize("budget", [0, 4])
def test_a_spent_search_budget_loses_nothing(budget, monkeypatch):
    chunks = shared_sentence_chunks(120, seed=5, repeated=True)
    full = dedup(chunks)
    monkeypatch.setattr(finder, "_BUDGET", budget)
    monkeypatch.setattr(finder, "_BUDGET_FLOOR", 0)
    capped = dedup(chunks)
    check_result(chunks, DedupConfig(), capped)  # every input rebuilt, provenance right
    assert 0 < capped.stats.removed_bytes["passage"] <= full.stats.removed_bytes["passage"]


def test_repeated_passages_of_shared_sentences_are_found_as_before():
    """Below the budget the index gives the plain search's answers."""
    chunks = shared_sentence_chunks(120, seed=5, repeated=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(finder, "_SWITCH", 10**9)  # every search through the joined bytes
        plain = dedup(chunks)
    indexed = dedup(chunks)
    assert [(k.id, k.data, [(o.index, o.relation, o.span) for o in k.origins]) for k in indexed.chunks] == [
        (k.id, k.data, [(o.index, o.relation, o.span) for o in k.origins]) for k in plain.chunks
    ]
    assert indexed.stats == plain.stats and indexed.stats.removed["passage"] > 0
