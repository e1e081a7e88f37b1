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


def _family_report(gap_vs_store, traffic):
    checks = {"naive": {"holds": True}, "promptsplice": {"holds": True}}
    return {"coverage": 1.0, "gap_closed": 0.5, "oracle_prefill_tokens": 100,
            "modes": {"naive": {"prefill_tokens": 1000}, "promptsplice": {"prefill_tokens": 500},
                      "promptsplice_store": {"prefill_tokens": 400}, "promptsplice_pic": {"prefill_tokens": 300}},
            "bounds": {"radix_capacity_prefill_tokens": 600, "oracle_capacity_prefill_tokens": 200, "checks": checks},
            "mirror": {"predicted_cached_tokens": 1, "measured_cached_tokens": 1},
            "pic": {"gap_closed": 0.7, "gap_closed_vs_store": gap_vs_store,
                    "gap_closed_vs_store_whole_block": None if gap_vs_store is None else 2 * gap_vs_store,
                    "ceiling_gap_closed_vs_store": 0.45, "probe_traffic": traffic},
            "fidelity": {"steps": 2 if traffic else 0}}


def test_a_family_whose_pic_ran_with_probe_traffic_is_left_out_of_pic_vs_store(monkeypatch, tmp_path):
    """Probes on the PIC engine between its requests are traffic the store control never
    gets: such a family's PIC-vs-store gap was the suite's worst line all the same (no
    engine: ``run_modes`` is replaced by one that returns a report per family)."""
    from promptsplice.benchmarks import rag_suite as rs

    reports = {"support": _family_report(0.1, True), "tools": _family_report(0.4, False)}
    seen = []

    def fake_run_modes(engine, reqs, **kw):
        fam = ("support", "tools")[len(seen)]
        seen.append(fam)
        return reports[fam], {}

    monkeypatch.setattr(rs, "run_modes", fake_run_modes)
    rep = rs.rag_suite(None, families=["support", "tools"], requests=2, trace_dir=tmp_path)
    assert seen == ["support", "tools"] and rep["suite"]["one_store_engine"] is False
    import types  # an engine instance for the store modes: one store for every family and mode

    seen.clear()
    shared = types.SimpleNamespace(generate=None)
    assert rs.rag_suite(None, kv_engine=shared, families=["support", "tools"], requests=2,
                        trace_dir=tmp_path)["suite"]["one_store_engine"] is True
    seen.clear()
    c = rep["checks"]
    assert c["support"]["pic_gap_closed_vs_store"] is None and "probe traffic" in c["support"]["pic_gap_closed_vs_store_skipped"]
    assert c["tools"]["pic_gap_closed_vs_store"] == 0.4 and c["tools"]["pic_gap_closed_vs_store_skipped"] is None
    assert rep["worst"]["promptsplice_pic_vs_store"] == {"gap_closed": 0.4, "family": "tools"}
    # the same share of the way to the whole-block oracle (a reference), skipped alike
    assert c["support"]["pic_gap_closed_vs_store_whole_block"] is None
    assert c["tools"]["pic_gap_closed_vs_store_whole_block"] == 0.8
    # the ceiling comes from the trace: kept with probe traffic too
    assert c["support"]["pic_ceiling_gap_closed_vs_store"] == c["tools"]["pic_ceiling_gap_closed_vs_store"] == 0.45
    assert rep["worst"]["promptsplice_pic_vs_store_whole_block"] == {"gap_closed": 0.8, "family": "tools"}
    # naive -> oracle: kept, and said to carry the probes' traffic (it did not say so)
    assert rep["worst"]["promptsplice_pic"] == {"gap_closed": 0.7, "family": "support", "probe_traffic": True}
    assert list(rep["pic_vs_store_skipped"]) == ["support"]
    text = rs.format_suite(rep)
    assert "pic vs store: skipped support" in text and "--fidelity-requests 0" in text
    assert "worst promptsplice_pic: gap 0.70 (support) (PIC ran with fidelity probe traffic)" in text
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert rows["support"][9] == "0.70*" and not rows["tools"][9].endswith("*")  # gap pic, marked where probed
    # a report from before the flag: probes made means traffic
    old = _family_report(0.1, True)
    del old["pic"]["probe_traffic"]
    assert rs.family_checks(old)["pic_gap_closed_vs_store"] is None


def test_an_unexpected_error_in_one_family_fails_that_family_only(monkeypatch, tmp_path):
    """Only the library's errors and OSError were caught per family: a KeyError in one
    ended the whole suite with a traceback, the families after it never ran."""
    from promptsplice.benchmarks import rag_suite as rs

    seen = []

    def fake_run_modes(engine, reqs, **kw):
        seen.append(len(seen))
        if len(seen) == 1:
            raise KeyError("modes")
        return {**_family_report(0.4, False), "steps_run": 2, "steps_total": 2}, {}

    monkeypatch.setattr(rs, "run_modes", fake_run_modes)
    rep = rs.rag_suite(None, families=["support", "tools"], requests=2, trace_dir=tmp_path)
    assert seen == [0, 1] and rep["failed"] == {"support": "KeyError: 'modes'"}
    assert "report" in rep["families"]["tools"] and rep["families"]["support"] == {"error": "KeyError: 'modes'"}


def test_a_family_whose_pic_ran_on_the_store_the_control_filled_is_left_out_of_pic_vs_store(monkeypatch, tmp_path):
    """``--one-store-engine``: one store engine serves the store control and then PIC
    (``reset_prefix_cache`` empties vLLM's cache, not the store), so PIC starts on a
    store the control filled; its gap over the control was reported as like for like."""
    from promptsplice.benchmarks import rag_suite as rs

    def report(shared, traffic=False):
        r = _family_report(0.1 if shared else 0.4, traffic)
        r["pic"]["shared_store"] = shared
        return r

    reports = iter([report(True), report(False), report(True, traffic=True)])
    monkeypatch.setattr(rs, "run_modes", lambda engine, reqs, **kw: (next(reports), {}))
    rep = rs.rag_suite(None, families=["support", "tools", "wiki"], requests=2, trace_dir=tmp_path)
    c = rep["checks"]
    assert c["support"]["pic_gap_closed_vs_store"] is None and c["support"]["pic_gap_closed_vs_store_whole_block"] is None
    assert c["support"]["pic_gap_closed_vs_store_skipped"] == rs.SHARED_STORE_SKIP
    assert c["wiki"]["pic_gap_closed_vs_store_skipped"] == f"{rs.PROBE_TRAFFIC_SKIP}; {rs.SHARED_STORE_SKIP}"
    assert c["tools"]["pic_gap_closed_vs_store"] == 0.4 and c["tools"]["pic_gap_closed_vs_store_skipped"] is None
    assert rep["worst"]["promptsplice_pic_vs_store"] == {"gap_closed": 0.4, "family": "tools"}
    assert rep["worst"]["promptsplice_pic_vs_store_whole_block"] == {"gap_closed": 0.8, "family": "tools"}
    assert rep["pic_vs_store_skipped"] == {"support": rs.SHARED_STORE_SKIP,
                                           "wiki": f"{rs.PROBE_TRAFFIC_SKIP}; {rs.SHARED_STORE_SKIP}"}
    text = rs.format_suite(rep)
    assert f"pic vs store: skipped support: {rs.SHARED_STORE_SKIP}" in text and "without --one-store-engine" in text

