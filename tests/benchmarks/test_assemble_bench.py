"""`promptsplice bench assemble` and `promptsplice demo` end to end (real tokenizer)."""

from __future__ import annotations

import json

import pytest

from promptsplice.benchmarks.bounds import OracleCounter, RadixPrefill, radix_prefill_tokens
from promptsplice.benchmarks.traces import dump_rag_trace, sample_rag_requests
from promptsplice.benchmarks.cli import main

METRICS = {
    "requests",
    "prompt_tokens",
    "padding_tokens",
    "dedup_removed_bytes",
    "dedup_removed_chunks",
    "predicted_cached_tokens",
    "predicted_prefill_tokens",
    "predicted_hit_rate",
    "assemble_p50_ms",
    "assemble_p99_ms",
    "predicted_prefill_tokens_bounded",  # the same mode under the engine's cache
    "own_radix_prefill_tokens",  # the radix ideal of the mode's own prompts: a bound too
}


def test_radix_bound_by_hand():
    assert radix_prefill_tokens([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], [9]]) == 4 + 1 + 1 + 1
    r = RadixPrefill()
    assert r.add([5, 6]) == 2 and r.add([5, 6, 7]) == 1 and r.add([5]) == 1
    o = OracleCounter()
    assert o.add([(b"s", 10), (b"a", 5)], 3) == 18
    assert o.add([(b"s", 10), (b"a", 5), (b"b", 7)], 3) == 10
    assert o.prefill_tokens == 28


def test_bench_assemble_writes_the_fixed_schema(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    dump_rag_trace(trace, sample_rag_requests(80, seed=3))
    out = tmp_path / "report.json"
    assert main(["bench", "assemble", "--trace", str(trace), "--json", str(out), "--block-size", "16"]) == 0
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"naive", "retrieval", "stable", "cache_aware"}
    for m in report["policies"].values():
        assert set(m) == METRICS
        assert m["requests"] == 80
        assert m["predicted_prefill_tokens"] == m["prompt_tokens"] - m["predicted_cached_tokens"]
        assert m["predicted_prefill_tokens"] >= m["own_radix_prefill_tokens"] >= report["oracle_prefill_tokens"]
    for name, check in report["bound_checks"].items():  # each checked against the higher of its bounds
        m = report["policies"][name]
        want = report["radix_prefill_tokens"] if name == "naive" else max(
            report["oracle_prefill_tokens"], m["own_radix_prefill_tokens"])
        assert check["bound_prefill_tokens"] == want and check["holds"]
    assert report["policies"]["naive"]["own_radix_prefill_tokens"] == report["radix_prefill_tokens"]
    naive = report["policies"]["naive"]
    assert naive["padding_tokens"] == 0 and naive["dedup_removed_bytes"] == 0
    oracle, radix = report["oracle_prefill_tokens"], report["radix_prefill_tokens"]
    assert isinstance(oracle, int) and isinstance(radix, int)
    assert oracle < radix <= naive["predicted_prefill_tokens"]
    best = min(report["policies"][p]["predicted_prefill_tokens"] for p in ("retrieval", "stable", "cache_aware"))
    # the foundation issue's bar: at least half of the naive->oracle gap, and no worse than radix
    assert (naive["predicted_prefill_tokens"] - best) / (naive["predicted_prefill_tokens"] - oracle) >= 0.5
    assert best <= radix
    assert "cache_aware" in capsys.readouterr().out


def test_auto_alignment_is_no_worse_than_none(tmp_path):
    trace = tmp_path / "trace.jsonl"
    dump_rag_trace(trace, sample_rag_requests(120, seed=5))
    prefill = {}
    for align in ("none", "auto"):
        out = tmp_path / f"{align}.json"
        main(["bench", "assemble", "--trace", str(trace), "--json", str(out), "--block-size", "32", "--alignment", align])
        prefill[align] = {p: m["predicted_prefill_tokens"] for p, m in json.loads(out.read_text())["policies"].items()}
    assert prefill["auto"]["stable"] <= prefill["none"]["stable"]  # 32,814 vs 32,880
    # A speculative pad at a branch point is a bet that later requests bring the same
    # chunks in the same order.  Since dedup absorbs a contained window before merging
    # (2026-12-03) this sample's requests differ, and under retrieval and cache_aware
    # order auto's lost bets (23-26 tokens each) outweigh its wins: 42,687 vs 42,608
    # (0.19%) and 30,298 vs 30,256 (0.14%) tokens (README, "Alignment").  Held to 0.5%.
    for policy in ("retrieval", "cache_aware"):
        assert prefill["auto"][policy] <= prefill["none"][policy] * 1.005, policy


def test_bench_rejects_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "r1", "system": "s", "chunks": [], "query": 3}\n')
    assert main(["bench", "assemble", "--trace", str(bad), "--json", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1" in err and "query" in err
    good = tmp_path / "good.jsonl"
    dump_rag_trace(good, sample_rag_requests(3))
    with pytest.raises(SystemExit) as info:  # a usage error, before the trace is read
        main(["bench", "assemble", "--trace", str(good), "--json", str(tmp_path / "o.json"), "--block-size", "0"])
    assert info.value.code == 2 and "--block-size: must be >= 1" in capsys.readouterr().err


def test_demo_prints_the_side_by_side_table(capsys):
    assert main(["demo", "--requests", "30", "--no-engine"]) == 0
    out = capsys.readouterr().out
    for row in ("prompt tokens", "bytes removed by dedup", "padding tokens", "predicted cached tokens", "predicted hit rate"):
        assert row in out
    assert "naive" in out and "promptsplice" in out and "oracle" in out


def test_bench_reports_the_bounds_under_the_engine_cache(tmp_path):
    trace = tmp_path / "trace.jsonl"
    dump_rag_trace(trace, sample_rag_requests(60, seed=2))
    out = tmp_path / "r.json"
    assert main(["bench", "assemble", "--trace", str(trace), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["bound_capacity_blocks"] == 727 * 32 // 16  # vLLM's null block is not usable
    assert rep["radix_prefill_tokens"] <= rep["radix_prefill_tokens_bounded"]
    assert rep["oracle_prefill_tokens"] <= rep["oracle_prefill_tokens_bounded"]
    assert all(g is None or g <= 1 for g in rep["gap_closed"].values())
    # every mode also ran under that capacity (the bounded bounds beside unbounded modes
    # compared two caches): never below its unbounded run
    for name, m in rep["policies"].items():
        assert m["predicted_prefill_tokens_bounded"] >= m["predicted_prefill_tokens"], name


def test_a_request_longer_than_the_engine_cache_raises_the_bounded_capacity():
    """One request over the default cache's 23,264 tokens failed the whole bench ("raise
    capacity_blocks", an option the command does not have): a long-context trace now
    runs, under a capacity raised to fit its longest request, and says so."""
    from promptsplice.benchmarks.assemble import bench_policies
    from promptsplice.benchmarks.traces import RagChunk, RagRequest

    words = " ".join(f"w{i % 997}" for i in range(26_000))
    reqs = [*sample_rag_requests(3, seed=4), RagRequest("long", "Answer.", [RagChunk("big", words)], "Which?")]
    rep = bench_policies(reqs, block_size=32)
    assert rep["bound_capacity_raised"] is True and rep["bound_capacity_blocks"] > 727
    assert all(check["holds"] for check in rep["bound_checks"].values())
    short = bench_policies(reqs[:3], block_size=32)
    assert short["bound_capacity_raised"] is False and short["bound_capacity_blocks"] == 727


def test_a_tiny_capacity_shows_in_the_bounded_modes():
    from promptsplice.benchmarks.assemble import bench_policies

    reqs = sample_rag_requests(40, seed=3)
    wide = bench_policies(reqs, block_size=16)
    tight = bench_policies(reqs, block_size=16, capacity_blocks=200)  # every mode on the small cache
    for name, m in tight["policies"].items():
        assert "predicted_prefill_tokens_bounded" not in m  # asked for: that is the run
        assert m["predicted_prefill_tokens"] >= wide["policies"][name]["predicted_prefill_tokens"]


def test_the_worst_family_counts_a_loss_where_there_was_no_gap_and_ties_go_to_the_next_family():
    """A family with naive at the oracle (no gap) where a policy prefilled more than
    naive had gap None and left the ranking: the losing family was never the worst.
    And a tie in the worst family went to the first policy in the list."""
    from promptsplice.benchmarks.assemble import _summarize, gap_closed

    assert gap_closed(60, 66, 60) == -0.1 and gap_closed(60, 60, 60) is None and gap_closed(60, 50, 70) is None

    def fam(gaps):
        return {"blocks": {"16": {"gap_closed": gaps, "policies": {}}}}

    report = {"suite": {"block_sizes": [16]}, "families": {
        "wiki": fam({"retrieval": 0.54, "stable": 0.60, "cache_aware": 0.65}),
        "flat": fam({"retrieval": None, "stable": -0.1, "cache_aware": None}),
    }}
    _summarize(report, ("retrieval", "stable", "cache_aware"), "cache_aware")
    assert report["worst"]["16"]["stable"] == {"gap_closed": -0.1, "family": "flat"}
    assert report["default_policy"] == "cache_aware"
    report["families"]["tie"] = fam({"retrieval": 0.0, "stable": 0.0, "cache_aware": 0.0})
    report["families"]["flat"] = fam({"retrieval": None, "stable": None, "cache_aware": None})
    _summarize(report, ("retrieval", "stable", "cache_aware"), "cache_aware")
    assert report["default_policy"] == "cache_aware"  # all 0.0 on "tie": wiki decides (was retrieval)


def test_suite_reports_each_family_and_the_worst_and_survives_broken_ones(tmp_path, monkeypatch, capsys):
    from promptsplice.benchmarks import traces
    from promptsplice.benchmarks.assemble import POLICIES, bench_suite

    monkeypatch.setitem(traces._FAMILIES, "empty", lambda **kw: [])
    malformed = tmp_path / "malformed.jsonl"
    dump_rag_trace(malformed, sample_rag_requests(3))
    with open(malformed, "a") as fh:
        fh.write('{"id": "x", "system": "s", "chunks": [], "query": 3}\n')
    offsets = tmp_path / "offsets.jsonl"
    offsets.write_text(json.dumps({"id": "r", "system": "s", "query": "q", "chunks": [
        {"id": "c", "text": "hello", "metadata": {"source": "D", "byte_span": [0, 9]}}]}) + "\n")
    rep = bench_suite(families=["support", "tools", "empty"], traces=[malformed, offsets], requests=40,
                      block_sizes=(16, 32), trace_dir=tmp_path / "tr")
    assert list(rep["families"]) == ["support", "tools", "empty", "file:malformed", "file:offsets"]
    assert set(rep["failed"]) == {"empty", "file:malformed", "file:offsets"}
    assert "'empty'" in rep["failed"]["empty"]
    assert f"{malformed}:4:" in rep["failed"]["file:malformed"] and "query" in rep["failed"]["file:malformed"]
    assert f"{offsets}:1:" in rep["failed"]["file:offsets"] and "chunks[0].metadata.byte_span" in rep["failed"]["file:offsets"]
    ok = {f: e for f, e in rep["families"].items() if "blocks" in e}
    assert set(ok) == {"support", "tools"}
    for entry in ok.values():
        assert entry["shape"]["requests"] == 40 and set(entry["blocks"]) == {"16", "32"}
        for r in entry["blocks"].values():
            assert set(r["policies"]) == {"naive", *POLICIES}
            assert all(set(m) == METRICS for m in r["policies"].values())
            assert all(g is None or g <= 1 for g in r["gap_closed"].values())
            pol = r["policies"]  # the default cannot lose to the baselines it considers
            assert pol["cache_aware"]["predicted_cached_tokens"] >= max(
                pol["retrieval"]["predicted_cached_tokens"], pol["stable"]["predicted_cached_tokens"])
    for bs in ("16", "32"):
        for p in POLICIES:
            worst = min((e["blocks"][bs]["gap_closed"][p], f) for f, e in ok.items())
            assert (rep["worst"][bs][p]["gap_closed"], rep["worst"][bs][p]["family"]) == worst
        assert rep["worst"][bs]["cached_margin"]["tokens"] >= 0
        margin = min((min(e["blocks"][bs]["policies"][p]["predicted_prefill_tokens"] for p in ("retrieval", "stable"))
                      - e["blocks"][bs]["policies"]["cache_aware"]["predicted_prefill_tokens"], f) for f, e in ok.items())
        assert (rep["worst"][bs]["prefill_margin"]["tokens"], rep["worst"][bs]["prefill_margin"]["family"]) == margin
    scores = {p: min(rep["worst"][bs][p]["gap_closed"] for bs in ("16", "32")) for p in POLICIES}
    assert scores[rep["default_policy"]] == max(scores.values())

    out = tmp_path / "suite.json"
    rc = main(["bench", "assemble", "--suite", "--families", "tools,empty", "--requests", "20",
               "--block-sizes", "32", "--json", str(out), "--trace-dir", str(tmp_path / "tr2")])
    assert rc == 1  # a family failed; the others were reported
    text = capsys.readouterr().out
    assert "| tools | 32 |" in text and "**worst**" in text and "failed: empty" in text
    assert set(json.loads(out.read_text())["families"]) == {"tools", "empty"}
    assert main(["bench", "assemble", "--json", str(out)]) == 2  # neither --trace nor --suite



def test_a_trace_file_in_the_suite_is_benched_whole_unless_requests_is_given(tmp_path):
    """``--suite --trace FILE`` read the file's first 200 requests (the families' default
    count) and said nothing: a user's 230-request trace was benched in part."""
    from promptsplice.benchmarks.assemble import bench_suite

    long = tmp_path / "long.jsonl"
    dump_rag_trace(long, sample_rag_requests(230, seed=1))
    rep = bench_suite(families=[], traces=[long], block_sizes=(32,), trace_dir=tmp_path / "tr")
    assert rep["families"]["file:long"]["shape"]["requests"] == 230 and not rep["failed"]
    assert rep["suite"]["requests"] == 200  # what each generated family gets
    cut = bench_suite(families=[], traces=[long], requests=40, block_sizes=(32,), trace_dir=tmp_path / "tr")
    assert cut["families"]["file:long"]["shape"]["requests"] == 40


def test_the_bounded_oracle_is_floored_per_request_like_the_unbounded_one():
    """One chunk ending in a space: its last token merges with the query's first in a
    prompt tokenized whole, so naive predicted 15 tokens under the engine's cache against
    a bounded "oracle" of 16, with nothing evicted.  Under a capacity the figure is an
    LRU reference (not checked), but where nothing is evicted it is the unbounded one."""
    from promptsplice.benchmarks.assemble import bench_policies
    from promptsplice.benchmarks.traces import RagChunk, RagRequest

    for text in ("word word word ", "a b c\n"):
        rep = bench_policies([RagRequest("r1", "S", [RagChunk("c1", text)], "Q?")])
        bounded = {n: m["predicted_prefill_tokens_bounded"] for n, m in rep["policies"].items()}
        assert rep["oracle_prefill_tokens_bounded"] == rep["oracle_prefill_tokens"] <= min(bounded.values()), (
            text, rep["oracle_prefill_tokens_bounded"], bounded)
        assert all(c["holds"] for c in rep["bound_checks"].values())


def test_empty_chunks_dedup_dropped_are_counted_in_the_report():
    """An all-empty-chunk trace reported dedup 0 bytes and nothing else: the dropped
    chunks were counted nowhere."""
    from promptsplice.benchmarks.assemble import bench_policies
    from promptsplice.benchmarks.traces import RagChunk, RagRequest

    reqs = [RagRequest("r1", "S", [RagChunk("a", ""), RagChunk("b", "")], "Q?"),
            RagRequest("r2", "S", [RagChunk("c", "text"), RagChunk("d", "text")], "Q?")]
    rep = bench_policies(reqs)
    for name in ("retrieval", "stable", "cache_aware"):
        removed = rep["policies"][name]["dedup_removed_chunks"]
        assert removed["empty"] == 2 and removed["duplicate"] == 1, (name, removed)
    assert rep["policies"]["naive"]["dedup_removed_chunks"] == {}


def test_the_report_names_the_alignment_that_ran():
    """``--alignment ALL`` ran as ``all`` and was reported as typed."""
    from promptsplice.benchmarks.assemble import bench_policies

    assert bench_policies(sample_rag_requests(2, seed=1), alignment=" ALL")["alignment"] == "all"
