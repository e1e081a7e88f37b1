"""Smoke test of the dedup benchmark on a tiny workload."""

from promptsplice.benchmarks.dedup_bench import make_requests, run_dedup_bench


def test_workload_has_the_advertised_shape():
    requests = make_requests(total_mb=0.2, chunk_bytes=512, seed=1)
    assert requests and all(len(r) == 20 for r in requests)
    texts = [c["text"] for c in requests[0]]
    assert len(set(texts)) < len(texts)  # exact duplicates are planted
    assert all(c["metadata"]["source"].startswith("doc") for c in requests[0])


def test_bench_reports_throughput_baseline_and_removals():
    result = run_dedup_bench(total_mb=0.2, chunk_bytes=512, seed=1)
    assert result["chunks"] == 20 * result["requests"]
    assert result["dedup_mb_s"] > 0 and result["baseline_digest_mb_s"] > 0
    assert result["ratio_dedup_to_baseline"] == round(
        result["dedup_mb_s"] / result["baseline_digest_mb_s"], 4
    )
    removed = result["removed"]
    assert removed["duplicate"] >= result["requests"]  # ~4 per request
    assert removed["contained"] >= 1 and removed["overlap"] >= 1
    assert 0.5 < result["bytes_out_fraction"] < 1.0
