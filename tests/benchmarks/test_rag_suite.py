"""`promptsplice bench rag --suite`: every trace family through the real engine."""

from __future__ import annotations


def test_rag_suite_runs_every_family_on_the_engine_and_survives_an_empty_one(engine, tmp_path, monkeypatch):
    from promptsplice.benchmarks import traces
    from promptsplice.benchmarks.rag_suite import format_suite, rag_suite, suite_status

    monkeypatch.setitem(traces._FAMILIES, "empty", lambda **kw: [])
    rep = rag_suite(engine, families=["support", "empty", "tools"], requests=4, trace_dir=tmp_path, max_tokens=1)
    assert list(rep["families"]) == ["support", "empty", "tools"] and set(rep["failed"]) == {"empty"}
    for fam in ("support", "tools"):
        r = rep["families"][fam]["report"]
        assert r["modes"]["promptsplice"]["requests"] == 4
        # vLLM measured what the mirror predicted, and nothing beats the trimmed oracle
        assert r["mirror"]["predicted_cached_tokens"] == r["mirror"]["measured_cached_tokens"]
        assert r["modes"]["promptsplice"]["prefill_tokens"] >= r["oracle_prefill_tokens"]
        c = rep["checks"][fam]
        assert c["coverage"] == 1.0 and c["mirror_equal"] and c["bounds_hold"]
        assert c["le_radix_capacity"] == (r["modes"]["promptsplice"]["prefill_tokens"]
                                          <= r["bounds"]["radix_capacity_prefill_tokens"])
    assert rep["worst"]["coverage"]["coverage"] == 1.0
    worst = rep["worst"]["promptsplice"]
    assert worst["gap_closed"] == min(rep["families"][f]["report"]["gap_closed"] for f in ("support", "tools"))
    assert "failed: empty" in format_suite(rep)
    assert suite_status(rep) == 1  # bounds and coverage hold; a family failed
