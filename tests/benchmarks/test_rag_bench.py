"""`promptsplice bench rag` and the engine demo on the real engine (vLLM's numbers)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from promptsplice.engine_adapters import FIDELITY_TABLE, FidelityLevel

from promptsplice.benchmarks.rag import MODES, run_modes
from promptsplice.errors import ConfigError
from promptsplice.benchmarks.traces import dump_rag_trace, sample_rag_requests

MODE_FIELDS = {"requests", "prompt_tokens", "prefill_tokens", "cached_tokens", "hit_rate", "wall_s", "ttft_p50_ms", "ttft_p99_ms",
               "small_sample", "percentile_min_n"}
REPO = Path(__file__).resolve().parents[2]


def test_run_modes_reports_vllms_own_numbers(engine):
    # eight requests: their chunks recur out of order (e.g. requests 2, 3, 4, 7 reuse 0's;
    # 5, 6 reuse 1's), which is all the prefill comparison below needs
    reqs = sample_rag_requests(16, seed=1)[:8]
    before = engine.counters()
    report, outs = run_modes(engine, reqs, max_tokens=2)
    after = engine.counters()
    assert set(report["modes"]) == set(MODES)
    for mode in MODES:
        m = report["modes"][mode]
        assert set(m) == MODE_FIELDS
        assert m["requests"] == 8
        assert m["cached_tokens"] == sum(c.num_cached_tokens for c in outs[mode])
        assert m["prefill_tokens"] == m["prompt_tokens"] - m["cached_tokens"]
        assert 0 < m["ttft_p50_ms"] <= m["ttft_p99_ms"]
    # vLLM's own counters moved by exactly what the two modes report
    delta = after.since(before)
    total_prompt = sum(report["modes"][m]["prompt_tokens"] for m in MODES)
    total_cached = sum(report["modes"][m]["cached_tokens"] for m in MODES)
    assert (delta.prefix_cache_queries, delta.prefix_cache_hits) == (total_prompt, total_cached)
    # the mirror sized like the engine predicts vLLM exactly
    assert report["mirror"]["predicted_cached_tokens"] == report["mirror"]["measured_cached_tokens"]
    assert report["modes"]["promptsplice"]["prefill_tokens"] < report["modes"]["naive"]["prefill_tokens"]
    assert report["block_size"] == engine.block_size == 32 and report["dtype"] == engine.config.dtype != "auto"


def _cli(*args, timeout=600):
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    return subprocess.run(
        [sys.executable, "-m", "promptsplice.benchmarks.cli", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_bench_rag_command_writes_the_fixed_schema(tmp_path):
    trace = tmp_path / "trace.jsonl"
    dump_rag_trace(trace, sample_rag_requests(10, seed=2))
    out = tmp_path / "rag.json"
    # the trace by a path relative to the CLI's folder: the report names it absolute (a
    # pic_sweep run from another folder refused the baseline of the same file)
    # a guard that never trips (--pic-max-deviation 1): the request of these six that
    # relocates must relocate whatever the default guard finds in it (the default's bar
    # is tests/engine_adapters/runners/test_fidelity.py's)
    proc = _cli("bench", "rag", "--trace", os.path.relpath(trace, REPO), "--json", str(out), "--requests", "6",
                "--max-tokens", "1", "--fidelity-requests", "1", "--allow-skips", "--pic-exact-alignment", "all",
                "--pic-max-deviation", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["trace"] == str(trace.resolve())
    assert set(report["modes"]) == {"naive", "promptsplice", "promptsplice_store", "promptsplice_pic"}
    assert report["pic"]["exact_alignment"] == "all"  # exact requests index their chunks: relocation follows
    # fresh store engines per mode, at the plain engine's KV size, with the same store
    assert report["store"]["kv_cache_blocks"] == report["pic"]["kv_cache_blocks"] == report["bounds"]["kv_cache_blocks"]
    assert report["store"]["store_dram_bytes"] == report["pic"]["store_dram_bytes"]
    assert report["coverage"] == 1.0 and all(c["holds"] for c in report["bounds"]["checks"].values())
    for m in report["modes"].values():
        assert set(m) == MODE_FIELDS and m["requests"] == 6
        assert m["prefill_tokens"] == m["prompt_tokens"] - m["cached_tokens"]
    pic = report["pic"]
    assert set(pic) == {"relocated_tokens", "precomputed_tokens", "engine_requests", "exact_requests", "too_long_requests", "recompute_blocks", "exact_alignment", "recompute_at", "index_computed",
                        "run_max_deviation", "guard", "gap_closed", "kv_cache_blocks", "store_dram_bytes", "gap_closed_vs_store",
                        "gap_closed_vs_store_whole_block", "gap_closed_vs_store_ceiling", "ceiling_gap_closed_vs_store",
                        "probe_traffic", "shared_store"}
    assert pic["shared_store"] is False  # the CLI: a fresh store engine per mode
    assert pic["run_max_deviation"] == 1.0  # the guard it ran with
    assert set(pic["guard"]) == {"stored", "precomputed", "refused_requests", "explored_requests"}
    assert all(set(pic["guard"][k]) == {"chunks", "trip_rate"} for k in ("stored", "precomputed"))
    assert all(pic["guard"][k]["trip_rate"] is None or 0 <= pic["guard"][k]["trip_rate"] <= 1
               for k in ("stored", "precomputed"))
    assert pic["probe_traffic"] is True  # one fidelity probe ran on the PIC engine
    # the default fidelity's r; precomputes, phases
    assert pic["recompute_blocks"] == FIDELITY_TABLE[FidelityLevel.BOUNDED].recompute_blocks
    assert pic["engine_requests"] > 6
    # chunks repeat in the sample: some were relocated, and fewer tokens prefilled than naive
    assert pic["relocated_tokens"] > 0
    assert report["modes"]["promptsplice_pic"]["prefill_tokens"] < report["modes"]["naive"]["prefill_tokens"]
    fid = report["fidelity"]
    assert {"tf_top1_agreement", "first_token_kl", "greedy_agreement", "control"} <= set(fid)
    assert fid["steps"] == fid["control"]["steps"] == 1
    assert 0 <= fid["tf_top1_agreement"] <= 1 and fid["first_token_kl"] >= -1e-6
    assert fid["control"]["first_token_kl"] <= fid["first_token_kl"] + 0.01  # exact KV: the noise floor
    # one record per probe: its KL beside what its request relocated (for budget sweeps)
    (rec,) = fid["probes"]
    assert abs(rec["kl"] - fid["first_token_kl"]) <= 1e-4 and rec["relocated_tokens"] > 0
    assert rec["relocated_tokens"] <= pic["relocated_tokens"] and rec["prefill_tokens"] < rec["prompt_tokens"]
    assert {"request", "relocated_chunks", "recomputed_tokens", "extra_recompute_blocks", "max_deviation"} <= set(rec)
    assert "probes" not in fid["control"]  # the control's probes carry no signals
    assert set(report["mirror"]) == {"predicted_cached_tokens", "measured_cached_tokens"}
    assert report["mirror"]["predicted_cached_tokens"] == report["mirror"]["measured_cached_tokens"]
    assert isinstance(report["radix_prefill_tokens"], int) and isinstance(report["oracle_prefill_tokens"], int)
    # each gap is the mode's share of its baseline's way to the oracle, from the counts above
    naive, store, oracle = (report["modes"]["naive"]["prefill_tokens"],
                            report["modes"]["promptsplice_store"]["prefill_tokens"], report["oracle_prefill_tokens"])
    mine, pic_prefill = report["modes"]["promptsplice"]["prefill_tokens"], report["modes"]["promptsplice_pic"]["prefill_tokens"]
    assert oracle < naive and oracle <= min(mine, store, pic_prefill)
    assert report["gap_closed"] == round((naive - mine) / (naive - oracle), 4) <= 1
    assert pic["gap_closed"] == round((naive - pic_prefill) / (naive - oracle), 4) <= 1
    if store > oracle:
        assert pic["gap_closed_vs_store"] == round((store - pic_prefill) / (store - oracle), 4)
    else:  # the store at the oracle: no gap, unless PIC prefilled more (then its loss, negative)
        assert pic["gap_closed_vs_store"] == (round((store - pic_prefill) / max(store, 1), 4)
                                              if pic_prefill > store else None)
    # the whole-block oracle: a reference between the oracle and the modes that pad chunks
    whole = report["bounds"]["oracle_whole_block_prefill_tokens"]
    assert report["bounds"]["oracle_content_prefill_tokens"] <= whole <= store
    if store > whole:
        assert pic["gap_closed_vs_store_whole_block"] == round((store - pic_prefill) / (store - whole), 4)
    # PIC's ceiling at its settings (r blocks computed at every relocated chunk): above the
    # whole-block oracle (it always computes the query), and the most of the gap PIC can close
    ceiling = report["bounds"]["pic_ceiling_prefill_tokens"]
    assert whole <= ceiling and pic["recompute_at"] == "chunk"
    if store > ceiling:
        assert pic["gap_closed_vs_store_ceiling"] == round((store - pic_prefill) / (store - ceiling), 4)
    if store > oracle:
        assert pic["ceiling_gap_closed_vs_store"] == round((store - ceiling) / (store - oracle), 4) <= 1
    assert "tokens prefilled" in proc.stdout


def test_bench_rag_rejects_an_unknown_policy_before_starting_the_engine(tmp_path):
    trace = tmp_path / "trace.jsonl"
    dump_rag_trace(trace, sample_rag_requests(2))
    proc = _cli("bench", "rag", "--trace", str(trace), "--json", str(tmp_path / "o.json"), "--policy", "fastest", timeout=120)
    assert proc.returncode == 2
    assert "unknown ordering policy 'fastest'" in proc.stderr


def test_demo_runs_on_the_engine_and_writes_a_chart(tmp_path):
    chart = tmp_path / "demo.png"
    proc = _cli("demo", "--requests", "2", "--chart", str(chart))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("tokens prefilled", "cached tokens (vLLM)", "TTFT p50 (ms)", "wall time (s)", "sample question"):
        assert row in proc.stdout
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_offload_command(tmp_path):
    out = tmp_path / "offload.json"
    proc = _cli("bench", "offload", "--json", str(out), "--prompts", "3", "--rounds", "2", "--prompt-tokens", "256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"apc", "tiered"}
    for m in report["modes"].values():
        assert {"prefill_tokens", "cached_tokens", "external_cached_tokens", "wall_s"} <= set(m)
    apc, tiered = report["modes"]["apc"], report["modes"]["tiered"]
    # the pool cannot keep 3 prompts: vLLM alone keeps only some head blocks (it evicts a
    # finished request's tail blocks first) and never an external hit
    assert apc["external_cached_tokens"] == 0 and apc["cached_tokens"] < 3 * 224
    # with the store every revisit is served but its last block (7 of 8 blocks, vLLM's
    # count): what the local pool still had, plus exactly the rest from the connector
    assert tiered["cached_tokens"] == 3 * 224
    assert tiered["external_cached_tokens"] == 3 * 224 - apc["cached_tokens"]
    assert report["outputs_identical"] is True
    assert set(report["load_vs_recompute"]) == {"dram", "disk"}
    assert all(v > 0 for v in report["load_vs_recompute"].values())



@pytest.fixture(scope="module")
def small_plain(kv_engine):
    """A plain engine with ``kv_engine``'s KV cache size (182 blocks): the pair runs
    every mode at equal capacity."""
    from tests.conftest import start_default_engine

    eng = start_default_engine(kv_cache_bytes=kv_engine.config.kv_cache_bytes)
    yield eng
    eng.close()


def test_store_mode_runs_at_equal_capacity_and_every_mode_holds_its_bound(small_plain, kv_engine):
    """``promptsplice_store``: the promptsplice assembly on an engine with PIC's store, at
    the KV cache size of the plain engine; every mode at or above its bound."""
    from promptsplice.benchmarks.bounds import RadixPrefill
    from promptsplice.benchmarks.rag import PIC_MODE, STORE_MODE, bench_status

    reqs = sample_rag_requests(4, seed=3)
    report, outs = run_modes(small_plain, reqs, kv_engine=kv_engine, max_tokens=1, fidelity_requests=0)
    assert set(report["modes"]) == {*MODES, STORE_MODE, PIC_MODE}
    st = report["store"]
    assert st["layout"] == "store_aware"  # the engine's own assemblers
    assert st["kv_cache_blocks"] == report["bounds"]["kv_cache_blocks"] == kv_engine.num_blocks == small_plain.num_blocks
    assert st["store_dram_bytes"] == report["pic"]["store_dram_bytes"] == kv_engine.kv_store.config.dram_bytes
    # the same assembly as promptsplice, sent as the same tokens
    assert [c.prompt_token_ids for c in outs[STORE_MODE]] == [c.prompt_token_ids for c in outs["promptsplice"]]
    m = report["modes"][STORE_MODE]
    assert m["requests"] == 4 and m["cached_tokens"] == sum(c.num_cached_tokens for c in outs[STORE_MODE])
    # same cache size, same prompts, its own salt: the store can only add hits
    assert m["prefill_tokens"] <= report["modes"]["promptsplice"]["prefill_tokens"]
    assert 0 <= st["external_cached_tokens"] <= st["measured_cached_tokens"] == m["cached_tokens"]
    checks, bounds = report["bounds"]["checks"], report["bounds"]
    own = {}
    for mode in ("promptsplice", STORE_MODE):  # each exact mode: the radix ideal of its own prompts too
        radix = RadixPrefill()
        for c in outs[mode]:
            radix.add(c.prompt_token_ids)
        own[mode] = radix.prefill_tokens
    assert bounds["own_radix_prefill_tokens"] == own
    assert checks["naive"]["bound"] == "radix" and checks[PIC_MODE]["bound"] == "oracle"
    for mode, tokens in own.items():
        want = ("own_radix", tokens) if tokens > bounds["oracle_prefill_tokens"] else ("oracle", bounds["oracle_prefill_tokens"])
        assert (checks[mode]["bound"], checks[mode]["bound_prefill_tokens"]) == want
    assert all(c["holds"] for c in checks.values()), checks
    assert report["coverage"] == 1.0 and report["skipped_requests"] == []
    assert bench_status(report) == 0
    assert report["pic"]["gap_closed_vs_store"] is None or report["pic"]["gap_closed_vs_store"] <= 1
    assert report["pic"]["probe_traffic"] is False  # fidelity_requests=0: no probe traffic
    assert report["pic"]["shared_store"] is True  # one kv_engine instance: PIC on the store the control filled
    assert st["store_remote_bytes"] == 0


def test_every_mode_s_ttft_counts_its_assembly_as_pic_s_counts_its_planning(small_plain, kv_engine, monkeypatch):
    """A request's TTFT runs from the call: the naive text's formatting and the exact
    modes' assembly count, as PIC's planning does (until 2026-12-07 they were left out
    of ``naive``, ``promptsplice`` and ``promptsplice_store``: a bias against PIC)."""
    import time

    from promptsplice.assembler import Assembler, PromptFormat
    from promptsplice.benchmarks.rag import PIC_MODE, STORE_MODE

    slow = 0.4

    def slowed(fn):
        def run(*a, **k):
            time.sleep(slow)
            return fn(*a, **k)
        return run

    for cls, name in ((Assembler, "assemble"), (Assembler, "preview"), (PromptFormat, "naive_text")):
        monkeypatch.setattr(cls, name, slowed(getattr(cls, name)))
    reqs = sample_rag_requests(4, seed=3)[:1]  # one request: its TTFT is the p50
    report, outs = run_modes(small_plain, reqs, kv_engine=kv_engine, max_tokens=1, fidelity_requests=0)
    for mode in (*MODES, STORE_MODE):
        engine_ms = outs[mode][0].ttft_s * 1e3
        assert report["modes"][mode]["ttft_p50_ms"] >= engine_ms + slow * 1e3 - 0.01, mode
    assert report["modes"][PIC_MODE]["ttft_p50_ms"] >= slow * 1e3


def test_the_store_control_takes_pic_s_exact_layout(small_plain, kv_engine):
    """With whole-block chunks for PIC's exact requests (``pic_exact_alignment="all"``),
    the store control is laid out the same way, so PIC's gap over it is relocation
    alone; it used to take ``alignment`` (``auto``: a control laid out otherwise)."""
    from promptsplice.benchmarks.rag import STORE_MODE

    reqs = sample_rag_requests(3, seed=5)
    report, outs = run_modes(small_plain, reqs, kv_engine=kv_engine, max_tokens=1, fidelity_requests=0,
                             pic_exact_alignment="all")
    assert report["store"]["alignment"] == "all" and report["pic"]["exact_alignment"] == "all"
    padded = [len(c.prompt_token_ids) for c in outs[STORE_MODE]]
    auto = [len(c.prompt_token_ids) for c in outs["promptsplice"]]  # alignment auto
    assert all(p >= a for p, a in zip(padded, auto)) and padded != auto


def test_a_request_over_the_context_is_skipped_and_fails_coverage(small_plain):
    from promptsplice.benchmarks.coverage import COVERAGE_EXIT
    from promptsplice.benchmarks.rag import bench_status
    from promptsplice.benchmarks.traces import RagChunk, RagRequest

    reqs = sample_rag_requests(1, seed=4)
    huge = RagRequest("huge", "Answer.", [RagChunk("big", "the harbor wall was old " * 1200)], "Who built it?")
    reqs.insert(0, huge)  # ~6K tokens: over the engine's max_model_len of 4,096
    report, outs = run_modes(small_plain, reqs, max_tokens=1)
    assert (report["coverage"], report["steps_run"], report["steps_total"]) == (0.5, 1, 2)
    assert report["skipped_requests"] == [0] and report["modes"]["naive"]["requests"] == 1
    assert bench_status(report) == COVERAGE_EXIT
    assert bench_status(report, allow_skips=True) == 0


@pytest.fixture
def tiny_pair(kv_engine):
    """A plain engine and a store engine of 40 blocks each (1,280 tokens): a request at
    the context limit costs a fifth of one at ``small_plain``'s (this test took 94 s)."""
    from promptsplice.engine_adapters import StoreConfig
    from tests.conftest import started_engines

    kv_bytes = 40 * (kv_engine.config.kv_cache_bytes // kv_engine.num_blocks)
    store = StoreConfig(dram_bytes=kv_engine.kv_store.config.dram_bytes, disk_bytes=0, disk_dir=None)
    with started_engines({"kv_cache_bytes": kv_bytes}, {"kv_cache_bytes": kv_bytes, "kv_store": store}) as pair:
        yield pair


def test_a_request_that_fits_only_without_whole_block_chunks_runs_in_every_mode(tiny_pair):
    """A request that fit the ``auto`` layout but not PIC's whole-block one (a block of
    padding per chunk) failed the whole bench in its last mode; then it was skipped in
    every mode, and a trace of many short chunks exited 3 for requests that fit.  PIC
    now sends it exact in the ``auto`` layout (``too_long_requests``), like the others,
    and so does the store control in PIC's whole-block exact layout."""
    from promptsplice.assembler import PromptFormat
    from promptsplice.benchmarks.rag import FIT_MARGIN, PIC_MODE, _chunks, _fitting, bench_status
    from promptsplice.benchmarks.traces import RagChunk, RagRequest
    from promptsplice.errors import ContextLengthError

    small_plain, kv_engine = tiny_pair
    assert small_plain.num_blocks == kv_engine.num_blocks and small_plain.max_model_len < 1400
    asm = small_plain.make_assembler(prompt_format=PromptFormat.chatml())
    limit = small_plain.max_model_len - FIT_MARGIN

    def request(n: int) -> RagRequest:  # chunks of just over one block: ~a block of padding each
        return RagRequest(f"r{n}", "Answer.", [RagChunk(f"c{i}", f"Item {i}: " + "the harbor wall " * 9)
                                                for i in range(n)], "Which?")

    def size(req: RagRequest, align: str | None) -> float:
        try:
            return len(asm.preview(_chunks(req), query=req.query, system=req.system, alignment=align).token_ids)
        except ContextLengthError:  # over the engine's context or its cache: no fit at all
            return math.inf

    n = next(n for n in range(2, 400) if size(request(n), "all") >= limit)
    req = request(n)
    assert size(req, None) < limit <= size(req, "all")  # fits the auto layout only
    assert _fitting(small_plain, asm, asm.format, [req, request(4)]) == [0, 1]
    report, _ = run_modes(small_plain, [req], kv_engine=kv_engine, max_tokens=1, fidelity_requests=0)
    assert report["coverage"] == 1.0 and report["skipped_requests"] == []
    assert report["pic"]["too_long_requests"] == 1 and report["pic"]["relocated_tokens"] == 0
    assert report["modes"][PIC_MODE]["prompt_tokens"] < limit
    assert bench_status(report) == 0
    # the store control in PIC's exact layout (``--pic-exact-alignment all``, the suite's
    # commands) raised ContextLengthError on it after two modes had run: now sent in auto
    report, _ = run_modes(small_plain, [req], kv_engine=kv_engine, max_tokens=1, fidelity_requests=0,
                          pic_exact_alignment="all")
    assert report["store"]["too_long_requests"] == 1 and report["pic"]["too_long_requests"] == 1
    assert report["modes"]["promptsplice_store"]["prompt_tokens"] < limit and bench_status(report) == 0


def test_the_pic_sweep_gives_each_configuration_its_own_store_engine(monkeypatch, tmp_path, capsys, engine, kv_engine):
    """``pic_sweep`` unpacked the agent bench's engines as a pair (it returns three by
    name) and ran every configuration on what the last one left; now one plain engine
    and a fresh store engine per configuration, the baseline's ``max_tokens``."""
    import json

    from promptsplice.benchmarks import pic_sweep
    from promptsplice.benchmarks.traces_format import dump_rag_trace

    trace = tmp_path / "t.jsonl"
    dump_rag_trace(trace, sample_rag_requests(2, seed=6))
    base = tmp_path / "base.json"
    # a baseline of this run: its trace, requests, skips, KV caches, block size and store
    kv_store = kv_engine.kv_store.config
    base.write_text(json.dumps({
        "modes": {"naive": {"prefill_tokens": 5000}}, "oracle_prefill_tokens": 100, "radix_prefill_tokens": 4000,
        "max_tokens": 1, "trace": str(trace), "steps_total": 2, "skipped_requests": [],
        "bounds": {"kv_cache_blocks": engine.num_blocks}, "block_size": engine.block_size,
        "pic": {"kv_cache_blocks": kv_engine.num_blocks, "store_dram_bytes": kv_store.dram_bytes},
        "store": {"store_disk_bytes": kv_store.disk_bytes},
    }))
    started, closed = [], []
    for eng in (engine, kv_engine):  # lent, not closed: close() is recorded instead
        monkeypatch.setattr(eng, "close", lambda eng=eng: closed.append(eng))

    def start(mode, **_kw):
        started.append(mode)
        return kv_engine if mode == "splice" else engine

    monkeypatch.setattr(pic_sweep, "start_mode_engine", start)
    assert pic_sweep.main(["--trace", str(trace), "--baseline", str(base), "--requests", "2",
                           "--fidelity-requests", "0", "packed:1:run", "standalone:2"]) == 0
    assert started == ["full", "splice", "splice"] and closed == [kv_engine, kv_engine, engine]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["config"] for r in rows] == ["packed:1:run", "standalone:2"]
    assert [r["recompute_at"] for r in rows] == ["run", "chunk"]  # the sweep runs at bounded: chunk
    assert all(r["prefill_tokens"] > 0 and r["engine_requests"] >= 2 for r in rows)
    from promptsplice.benchmarks.cli import UsageError

    for bad in ("packed:1:block", "packed:x", "packed"):  # refused before any engine starts
        with pytest.raises(UsageError, match="PRECOMPUTE:R"):
            pic_sweep.main(["--trace", str(trace), "--baseline", str(base), bad])


def test_a_store_layout_that_is_not_one_of_the_two_is_refused_before_anything_runs():
    from promptsplice.benchmarks.rag import STORE_LAYOUTS

    from promptsplice.benchmarks.rag import run_rag_bench
    from promptsplice.benchmarks.rag_suite import run_rag_suite

    with pytest.raises(ConfigError, match="store_layout must be one of .*'blind'"):
        run_modes(None, sample_rag_requests(1, seed=4), store_layout="blind")
    for bad, says in ((0, "--pic-max-deviation must be"), (float("nan"), "--pic-max-deviation"),
                      (1.5, r"--pic-max-deviation must be a relative deviation in \(0, 1\], got 1.5")):
        for job in (lambda: run_rag_bench(trace="t.jsonl", json_out="r.json", pic_max_deviation=bad),
                    lambda: run_rag_suite(json_out="r.json", pic_max_deviation=bad)):
            with pytest.raises(ConfigError, match=says):
                job()
    with pytest.raises(ConfigError, match="leave it unset with --recompute-blocks 0"):
        run_rag_bench(trace="t.jsonl", json_out="r.json", pic_max_deviation=0.3, recompute_blocks=0)
    for job in (lambda: run_rag_bench(trace="t.jsonl", json_out="r.json", pic_recompute_at="block"),
                lambda: run_rag_suite(json_out="r.json", pic_recompute_at="block")):
        with pytest.raises(ConfigError, match="pic_recompute_at must be 'run', 'chunk' or None, got 'block'"):
            job()
    # the CLI's jobs refuse it before the engines start (the suite caught it per family)
    for job in (lambda: run_rag_bench(trace="t.jsonl", json_out="r.json", store_layout="blind"),
                lambda: run_rag_suite(json_out="r.json", store_layout="blind")):
        with pytest.raises(ConfigError, match="store_layout must be one of"):
            job()
    assert STORE_LAYOUTS == ("store_aware", "cache_only")


def test_a_tail_percentile_of_few_requests_is_flagged():
    """``ttft_p99_ms`` of 30 requests is their slowest: the field stays, ``small_sample``
    says so (p99 needs 100 requests)."""
    from promptsplice.benchmarks.rag import _metrics

    m = _metrics(30, 1000, 500, [float(i) for i in range(30)], 1.0)
    assert m["ttft_p99_ms"] == 29.0 and m["small_sample"] is True
    assert m["percentile_min_n"] == {"ttft_p50_ms": 3, "ttft_p99_ms": 100}
    big = _metrics(100, 1000, 500, [float(i) for i in range(100)], 1.0)
    assert big["small_sample"] is False and big["ttft_p99_ms"] == 98.0


def _fake_engine(*, blocks=182, bs=32, dtype="bfloat16", prefix=True, mml=4096, store=None):
    import types

    cfg = types.SimpleNamespace(dtype=dtype, enable_prefix_caching=prefix, max_model_len=mml, kv_store=store)
    return types.SimpleNamespace(num_blocks=blocks, block_size=bs, max_model_len=mml, config=cfg)


def test_the_rag_capacity_guard_compares_every_setting_of_the_cache_and_the_stores():
    """It compared the KV block count alone: a store engine without prefix caching, with
    a shorter context or another dtype, or a PIC store with a remote tier the control's
    lacks, ran as "equal capacity"."""
    import types

    from promptsplice.benchmarks.rag import _check_capacity

    def store(remote=0, dram=1 << 30):
        return types.SimpleNamespace(dram_bytes=dram, disk_bytes=4 << 30, remote_bytes=remote)

    plain = _fake_engine()
    shape = _check_capacity(plain, _fake_engine(store=store()))
    assert shape["kv_store"] == {"dram_bytes": 1 << 30, "disk_bytes": 4 << 30, "remote_bytes": 0, "remote_tier": False}
    for other in (dict(prefix=False), dict(mml=2048), dict(dtype="float32"), dict(bs=16), dict(blocks=181)):
        with pytest.raises(ConfigError, match="equal KV cache capacity"):
            _check_capacity(plain, _fake_engine(store=store(), **other))
    with pytest.raises(ConfigError, match="no kv_store"):
        _check_capacity(plain, _fake_engine())
    # the PIC engine's store against the control's: every tier
    for other in (dict(remote=1 << 30), dict(dram=1 << 29)):
        with pytest.raises(ConfigError, match="identical stores"):
            _check_capacity(plain, _fake_engine(store=store(**other)), shape)
    assert _check_capacity(plain, _fake_engine(store=store()), shape) == shape


def _fake_pic(monkeypatch, relocates=lambda i: True):
    """``rag._run_pic`` on a fake runner (no engine) whose request ``i`` relocates when
    ``relocates(i)``; returns ``run(requests, fidelity_requests) -> report`` and the list
    of probed request names."""
    import types

    import promptsplice.benchmarks.rag as rag
    import promptsplice.engine_adapters as ea
    from promptsplice.benchmarks.traces import RagChunk, RagRequest
    from promptsplice.engine_adapters.runners._chunk_plans import GuardRates

    class Runner:
        reuse_salt = "s"
        max_deviation = 0.22

        def __init__(self, *a, **kw):
            self.i = -1

        def recompute_at_for(self, fidelity=None):
            return "chunk"

        def guard_rates(self, fidelity=None):
            return GuardRates()

        def run(self, chunks, **kw):
            self.i += 1
            moved = 64 if relocates(self.i) else 0
            return types.SimpleNamespace(planned_relocated_tokens=moved, relocated_tokens=moved, prompt_tokens=300,
                                         prefill_tokens=100, precomputed_tokens=0, requests=2, fallback=None,
                                         ttft_s=0.01, wall_s=0.02, completion=None, relocated_chunks=1,
                                         recomputed_tokens=32, extra_recompute_blocks=0, deviations=(0.1,))

    probed = []

    def probe(engine, kv, st, salt, fid, ctl, what, signals=None):
        probed.append(what)
        fid.records.append(signals)
        fid.add(1.0, 0.01, 1.0)
        ctl.add(1.0, 0.0, 1.0)

    monkeypatch.setattr(ea, "RagRunner", Runner)
    monkeypatch.setattr(rag, "probe_relocated_request", probe)
    kv = types.SimpleNamespace(reset_prefix_cache=lambda: None, num_blocks=182,
                               kv_store=types.SimpleNamespace(config=types.SimpleNamespace(dram_bytes=1 << 30)))

    def run(n: int, k: int, trace_index=None) -> dict:
        reqs = [RagRequest(f"r{i}", "sys", [RagChunk("c", "text")], "q") for i in range(n)]
        report = {"modes": {"naive": {"prefill_tokens": 1000}}, "oracle_prefill_tokens": 100}
        rag._run_pic(report, {}, None, kv, reqs, policy="cache_aware", max_tokens=1, progress=None,
                     prompt_format=None, recompute_blocks=1, fidelity_requests=k, trace_index=trace_index)
        return report

    return run, probed


def test_the_pic_section_says_whether_probes_ran_on_its_engine(monkeypatch):
    """Fidelity probes run on the PIC engine between its requests (traffic the store
    control never gets): ``pic.probe_traffic`` says so (no engine: a fake runner)."""
    run, probed = _fake_pic(monkeypatch)
    for k, traffic in ((2, True), (0, False)):
        report = run(4, k)
        assert report["pic"]["probe_traffic"] is traffic and report["fidelity"]["steps"] == k
    assert len(probed) == 2


def test_probes_owed_are_made_when_relocation_stops_early(monkeypatch):
    """Probes were spread pro rata over the trace: when relocation stopped after 40 of
    100 requests (the guard learning it does not pay, a store that evicts), the deferred
    ones were never made, and a correct run exited 3 on 14 of 32 probes.  The first
    relocating requests are now probed while probes are owed."""
    from promptsplice.benchmarks.rag import bench_status

    run, probed = _fake_pic(monkeypatch, relocates=lambda i: 3 <= i < 40)
    report = run(100, 32)
    fid = report["fidelity"]
    assert (fid["steps"], fid["eligible"], fid["probe_coverage"]) == (32, 37, 1.0)
    assert probed == [f"promptsplice_pic request {i}" for i in range(3, 35)]
    assert bench_status({"steps_run": 100, "steps_total": 100, "fidelity": fid, "bounds": {"checks": {}}}) == 0


def test_a_run_that_raises_writes_its_error_as_the_json(tmp_path, monkeypatch):
    """A probe that failed its check (exit 5) escaped ``run_modes`` and left no JSON, or
    an earlier run's report at that path: the error is the report now, and raised."""
    import types

    import promptsplice.benchmarks.rag as rag
    from promptsplice.benchmarks.fidelity import FidelityError

    def boom(*a, **kw):
        raise FidelityError("request 3: the greedy probe was served 0 cached tokens of the 96")

    closed = []
    monkeypatch.setattr(rag, "start_rag_engines", lambda root, **kw: (types.SimpleNamespace(
        close=lambda: closed.append(1)), None))
    monkeypatch.setattr(rag, "run_modes", boom)
    trace, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    dump_rag_trace(trace, sample_rag_requests(2, seed=2))
    out.write_text('{"stale": "an earlier run"}')
    with pytest.raises(FidelityError, match="greedy probe"):
        rag.run_rag_bench(trace=trace, json_out=out)
    assert json.loads(out.read_text()) == {"trace": str(trace), "error": {
        "type": "FidelityError", "message": "request 3: the greedy probe was served 0 cached tokens of the 96"}}
    assert closed == [1]


def test_pic_s_cached_tokens_never_go_below_zero_when_its_precompute_exceeds_the_prompt():
    """A precompute of new chunks larger than the prompt's hits: prefill counts every
    computed token (above the prompt), cached stays 0 and the hit rate 0, not negative."""
    import types

    from promptsplice.benchmarks.rag import _pic_metrics

    step = lambda prompt, prefill: types.SimpleNamespace(prompt_tokens=prompt, prefill_tokens=prefill,  # noqa: E731
                                                          ttft_s=0.01, wall_s=0.02)
    m = _pic_metrics([step(100, 160), step(100, 90)])
    assert (m["prompt_tokens"], m["prefill_tokens"], m["cached_tokens"], m["hit_rate"]) == (200, 250, 0, 0.0)
    m = _pic_metrics([step(100, 40), step(100, 90)])
    assert (m["prefill_tokens"], m["cached_tokens"], m["hit_rate"]) == (130, 70, 0.35)


def test_an_exact_mode_below_the_radix_ideal_of_its_own_prompts_fails_its_bound():
    """``bench rag`` checked ``promptsplice`` and ``promptsplice_store`` against the oracle
    only (the least over every mode per request): an over-count of their hits by up to
    (own radix - oracle) passed.  ``bench assemble`` had this check; now ``bench rag``
    has it too."""
    from promptsplice.benchmarks.bounds import BoundError, check_bounds
    from promptsplice.benchmarks.rag import STORE_MODE, mode_bounds

    report = {
        "modes": {"naive": {"prefill_tokens": 300}, "promptsplice": {"prefill_tokens": 120},
                  STORE_MODE: {"prefill_tokens": 250}},
        "bounds": {"radix_prefill_tokens": 300, "oracle_prefill_tokens": 110,
                   "own_radix_prefill_tokens": {"promptsplice": 200, STORE_MODE: 90}},
    }
    checks = mode_bounds(report)
    assert checks["promptsplice"] == {"bound": "own_radix", "bound_prefill_tokens": 200, "prefill_tokens": 120, "holds": False}
    assert checks[STORE_MODE] == {"bound": "oracle", "bound_prefill_tokens": 110, "prefill_tokens": 250, "holds": True}
    with pytest.raises(BoundError, match=r"promptsplice prefilled 120 tokens, below its bound \(own_radix\) of 200"):
        check_bounds(checks)


def test_a_probe_names_its_trace_line_when_requests_were_skipped(monkeypatch):
    """Requests that do not fit the engine are left out before the modes run; the probes
    then named their place among the kept requests, while ``skipped_requests`` names
    trace lines: with a skip, ``fidelity.probes[].request`` and a failed probe's message
    pointed at other requests of the trace."""
    run, probed = _fake_pic(monkeypatch, relocates=lambda i: i >= 1)
    report = run(3, 2, trace_index=[0, 2, 5])  # trace lines 1, 3 and 4 were skipped
    assert probed == ["promptsplice_pic request 2", "promptsplice_pic request 5"]
    assert [p["request"] for p in report["fidelity"]["probes"]] == [2, 5]


class _PlainEngine:
    """A plain engine without vLLM for ``run_modes``'s two first modes: the real default
    tokenizer, an assembler per ``make_assembler`` call, nothing cached.  ``generate``
    tokenizes a ``str`` prompt untimed, as ``EmbeddedEngine`` does before its TTFT clock
    starts; ``encode_prompt`` (the ids it would send) costs ``encode_s``."""

    def __init__(self, tok, *, block_size=16, blocks=64, encode_s=0.0):
        import types

        self.tokenizer, self.block_size, self.num_blocks = tok, block_size, blocks
        self.usable_blocks, self.max_model_len, self.encode_s = blocks - 1, 4096, encode_s
        self.config = types.SimpleNamespace(dtype="float32")
        self.sent = []

    def make_assembler(self, **kw):
        from promptsplice.assembler import Assembler

        return Assembler(self.tokenizer, block_size=self.block_size, max_tokens=self.max_model_len - 1, **kw)

    def reset_prefix_cache(self):
        pass

    def encode_prompt(self, text):
        import time

        time.sleep(self.encode_s)
        return self.tokenizer.encode(text)

    def generate(self, prompt, max_tokens):
        import types

        self.sent.append(prompt)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(getattr(prompt, "token_ids", prompt))
        return types.SimpleNamespace(prompt_token_ids=ids, prompt_tokens=len(ids), num_cached_tokens=0, ttft_s=0.001)


def test_naive_s_ttft_counts_tokenizing_its_text(default_tok):
    """``naive`` sent its text, which the engine tokenized before its TTFT clock started,
    while the exact modes' timed assembly tokenizes their chunks: its preparation now
    tokenizes the text as vLLM does (``encode_prompt``) and sends the ids."""
    from promptsplice.assembler import PromptFormat

    slow = 0.3
    eng = _PlainEngine(default_tok, encode_s=slow)
    req = sample_rag_requests(2, seed=3)[0]
    report, _ = run_modes(eng, [req], max_tokens=1)
    assert report["modes"]["naive"]["ttft_p50_ms"] >= slow * 1e3
    text = PromptFormat.chatml().naive_text([c.text for c in req.chunks], query=req.query, system=req.system or None)
    assert eng.sent[0] == default_tok.encode(text)  # the ids encode_prompt gave: the same request


def test_promptsplice_s_timed_assembly_starts_from_a_cold_token_cache(default_tok, monkeypatch):
    """The fit check previewed every request on the assembler ``promptsplice``'s timed
    loop then used: its token cache held every chunk, so its TTFT left tokenizing out,
    while the store and PIC modes (fresh assemblers) paid it."""
    from promptsplice.assembler import Assembler

    seen = []
    assemble = Assembler.assemble

    def spy(self, *a, **kw):
        seen.append(self.token_cache.stats().entries)
        return assemble(self, *a, **kw)

    monkeypatch.setattr(Assembler, "assemble", spy)
    run_modes(_PlainEngine(default_tok), sample_rag_requests(4, seed=3), max_tokens=1)
    assert seen and seen[0] == 0, seen


def test_the_capacity_matched_oracle_is_floored_as_the_oracle_is(default_tok):
    """``oracle_capacity_prefill_tokens`` was the segment-wise content bound alone, where
    ``bench assemble`` floors its bounded oracle per request by each mode's radix under
    the same capacity: a chunk ending in a space merges with the next segment's first
    token in the prompt, so the "oracle (cache)" figure exceeded the capacity-matched
    radix ideal (40 against 39 tokens)."""
    from promptsplice.benchmarks.traces import RagChunk, RagRequest

    req = RagRequest("r", "", [RagChunk("a", "The capital of France is Paris. ")], "What is it?")
    report, outs = run_modes(_PlainEngine(default_tok), [req], max_tokens=1)
    b = report["bounds"]
    assert b["oracle_capacity_prefill_tokens"] <= b["radix_capacity_prefill_tokens"]
    assert b["oracle_capacity_prefill_tokens"] == b["oracle_prefill_tokens"] == min(
        len(outs[m][0].prompt_token_ids) for m in MODES)  # one request: nothing to reuse


def test_pic_says_when_it_ran_on_the_store_engine_of_the_control(monkeypatch, default_tok):
    """``run_modes`` with one store engine instance (what ``--one-store-engine`` passes)
    sets ``pic.shared_store``; a factory (a fresh engine and store per mode) does not
    (no engine: the store modes' runs are replaced)."""
    import types

    import promptsplice.benchmarks.rag as rag

    def store(report, outs, kv, requests, **kw):
        report["modes"][rag.STORE_MODE] = {"prefill_tokens": 10}
        outs[rag.STORE_MODE] = outs["promptsplice"]

    def pic(report, outs, engine, kv, requests, **kw):
        report["modes"][rag.PIC_MODE] = {"prefill_tokens": 5}
        report["pic"] = {}

    monkeypatch.setattr(rag, "_check_capacity", lambda engine, kv, shape=None: {})
    monkeypatch.setattr(rag, "_run_store", store)
    monkeypatch.setattr(rag, "_run_pic", pic)
    eng, reqs = _PlainEngine(default_tok), sample_rag_requests(2, seed=3)
    one = types.SimpleNamespace(generate=None)
    assert rag.run_modes(eng, reqs, kv_engine=one, max_tokens=1)[0]["pic"]["shared_store"] is True
    fresh = lambda: types.SimpleNamespace(close=lambda: None)  # noqa: E731
    assert rag.run_modes(eng, reqs, kv_engine=fresh, max_tokens=1)[0]["pic"]["shared_store"] is False
