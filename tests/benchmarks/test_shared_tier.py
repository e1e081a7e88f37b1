"""The shared-tier bench on a real pair of engines and a real Redis (tiny trace).

The numbers of the issue come from a larger run (README); here: the bench's accounting
holds, sharing prefills less than the salted pair, and an outage fails no request and
changes no output.
"""

from __future__ import annotations

import pytest

from promptsplice.benchmarks.shared_tier import (
    _leading_run,
    format_shared_tier,
    main,
    prefix_bound,
    run_shared_tier_bench,
)
from promptsplice.errors import ConfigError


def test_leading_run_counts_the_known_prefix_only():
    assert _leading_run([b"a", b"b", b"c"], {b"a", b"b"}) == 2
    assert _leading_run([b"a", b"b", b"c"], {b"b", b"c"}) == 0
    assert _leading_run([], {b"a"}) == 0


def test_prefix_bound_counts_what_each_engine_or_the_pair_computed_before():
    a, b, c = list(range(0, 8)), list(range(100, 108)), list(range(200, 208))  # blocks of 8
    tail = [999]
    prompts = [a + b + tail, a + c + tail, a + b + [998], a + c + [997]]  # engines 0, 1, 0, 1
    bound = prefix_bound(prompts, 8)
    assert bound["prompt_tokens"] == 4 * 17
    # local: each engine computes a once; request 2 repeats request 0 on engine 0 (1
    # token left), request 3 repeats request 1 on engine 1: 17 + 17 + 1 + 1
    assert bound["local_prefill"] == 36
    # shared: request 1 finds a (computed by engine 0): 17 + 9 + 1 + 1
    assert bound["shared_prefill"] == 28
    assert bound["shared_over_local"] == round(28 / 36, 4)
    # the last token is never served from cache: a prompt of whole blocks keeps one block
    assert prefix_bound([a + b, a + b], 8)["shared_prefill"] == 16 + 8
    # ... but every full block it computed is cached: a later prompt that extends it is
    # served all of it (the bound counted only the blocks before its last token: 16 + 24,
    # above the 16 + 8 vLLM computes, and a correct engine failed the bench)
    assert prefix_bound([a + b, a + b + c], 8, engines=1)["shared_prefill"] == 16 + 8


def test_a_trace_file_runs_whole_and_never_with_a_family(tmp_path, monkeypatch):
    """``--requests`` defaulted to 40, so a 100-request ``--trace`` ran its first 40 and
    reported coverage 1.0 of them; ``--family`` beside it was ignored."""
    import promptsplice.benchmarks.shared_tier as st
    from promptsplice.benchmarks.traces import dump_rag_trace, sample_rag_requests

    trace = tmp_path / "t.jsonl"
    dump_rag_trace(trace, sample_rag_requests(45, seed=3))
    assert len(st._family_requests(None, None, 0, trace)) == 45
    assert len(st._family_requests(None, 10, 0, trace)) == 10
    assert len(st._family_requests(None, None, 0, None)) == st.DEFAULT_REQUESTS == 40
    with pytest.raises(ConfigError, match="a trace or a family, not both"):
        st._family_requests("support", None, 0, trace)


def test_bounds_of_the_suite_need_no_engine(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["--bounds-only", "--requests", "12", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for family in ("wiki", "wiki-diverse", "support", "pydocs", "apidocs", "tools"):
        assert f"| {family} | 12 |" in text
    assert '"bounds"' in out.read_text()


def test_an_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown mode 'remote'"):
        run_shared_tier_bench(modes=("local", "remote"), requests=1)


def test_two_engines_share_blocks_and_survive_an_outage(tmp_path):
    report = run_shared_tier_bench(json_out=tmp_path / "r.json", requests=9, max_tokens=2)
    local, shared, outage = (report["modes"][m] for m in ("local", "shared", "outage"))
    assert (tmp_path / "r.json").is_file()
    for m in (local, shared, outage):
        assert m["failed"] == 0 and m["requests"] == 9
        assert m["prefill_tokens"] + m["cached_tokens"] == m["prompt_tokens"]
    assert local["prompt_tokens"] == shared["prompt_tokens"] == outage["prompt_tokens"]
    # Salted apart, neither engine loads the other's blocks; sharing loads them.
    assert shared["prefill_tokens"] < local["prefill_tokens"]
    assert sum(s["remote_hits"] for s in shared["stores"]) > 0
    assert shared["eligible_blocks"] > 0 and shared["coverage_of_other_blocks"] >= 0.5
    assert shared["outputs_identical_to_local"] == 9 and outage["outputs_identical_to_local"] == 9
    assert all(s["remote_outages"] >= 1 for s in outage["stores"])
    assert report["shared_over_local_prefill"] < 1.0
    # No mode prefills less than its bound (caches that never evict, prefix reuse only)
    bound = report["bound"]
    assert bound["prompt_tokens"] == local["prompt_tokens"]
    assert local["prefill_tokens"] >= bound["local_prefill"]
    assert shared["prefill_tokens"] >= bound["shared_prefill"]
    # the bound is in the engines' own blocks, and the report checks every mode against it
    assert report["engines"]["block_size"] == 32 and report["engines"]["num_blocks"] > 0 and set(report["bound_checks"]) == {"local", "shared", "outage"}
    assert report["bound_checks"]["outage"]["bound_prefill_tokens"] == bound["shared_prefill"]
    assert "pair prefill shared/local" in format_shared_tier(report)


# --- failed requests (no engine: a request that fails cannot be produced on demand) ---
# Fakes shaped like the parts of EmbeddedEngine / RedisServer the bench touches.


class _Counters:
    def __init__(self, prefix=0, external=0):
        self.prefix_cache_hits, self.external_hits = prefix, external

    def since(self, other):
        return _Counters(self.prefix_cache_hits - other.prefix_cache_hits, self.external_hits - other.external_hits)


class _Store:
    class _Stats:
        remote_hits = remote_writes = remote_outages = remote_corrupt = remote_skipped = 0

    def stats(self):
        return self._Stats()

    def drain(self):
        pass


class _FailingEngine:
    """Caches nothing (every prompt fully prefilled); ``fail(salt, i)`` says which of
    the pair's requests raise (``i``: the pair's request count, from 1)."""

    fail = staticmethod(lambda salt, i: False)
    calls = 0

    def __init__(self, **kw):
        self.block_size, self.num_blocks = 32, 160
        self.kv_store = _Store()

    def counters(self):
        return _Counters()

    def close(self):
        pass

    def generate(self, tokens, max_tokens, cache_salt):
        import types

        type(self).calls += 1
        if type(self).fail(cache_salt, type(self).calls):
            raise RuntimeError("connector blew up")
        return types.SimpleNamespace(token_ids=[1], num_cached_tokens=0)


class _Server:
    url = "redis://fake"

    def __init__(self, **kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def kill(self):
        pass

    def start(self):
        pass


@pytest.fixture
def failing_pair(monkeypatch):
    import promptsplice.benchmarks._redis_server as redis_server
    import promptsplice.benchmarks.offload as offload
    import promptsplice.benchmarks.shared_tier as st
    import promptsplice.engine_adapters as ea

    monkeypatch.setattr(redis_server, "RedisServer", _Server)
    monkeypatch.setattr(ea, "EmbeddedEngine", _FailingEngine)
    monkeypatch.setattr(ea, "StoreConfig", lambda **kw: None)
    monkeypatch.setattr(offload, "_bytes_per_block", lambda cfg: 1)
    monkeypatch.setattr(st, "_empty", lambda engines, url: None)
    monkeypatch.setattr(st, "_prompts", lambda engine, reqs: [[i] * 320 for i in range(10)])  # 10 blocks each
    monkeypatch.setattr(st, "_family_requests", lambda *a: list(range(10)))
    monkeypatch.setattr(_FailingEngine, "calls", 0)
    return _FailingEngine


def test_a_mode_with_failed_requests_keeps_its_bound_check_and_voids_the_ratio(failing_pair):
    failing_pair.fail = staticmethod(lambda salt, i: salt == "shared" and i % 2 == 0)  # half of shared fails
    report = run_shared_tier_bench(modes=("local", "shared"))
    shared = report["modes"]["shared"]
    assert shared["failed"] == 5 and shared["failed_requests"] == [1, 3, 5, 7, 9]
    assert shared["coverage"] == 0.5 and shared["steps_run"] == 5 and shared["steps_total"] == 10
    assert "RuntimeError: connector blew up" in shared["errors"][0]
    assert report["modes"]["local"]["coverage"] == 1.0
    # never dropped from the bound checks: checked over the requests it ran
    assert set(report["bound_checks"]) == {"local", "shared"}
    check = report["bound_checks"]["shared"]
    assert check["requests_run"] == 5 and check["prefill_tokens"] == 5 * 320
    assert check["bound_prefill_tokens"] == 5 * 320  # nothing repeats: every run prompt is prefilled
    # local prefilled 10 prompts, shared 5: no ratio over different requests
    assert report["shared_over_local_prefill"] is None
    assert "shared 5 of 10" in report["shared_over_local_prefill_reason"]
    assert "n/a" in format_shared_tier(report)


def test_the_bound_of_a_mode_with_failures_counts_the_failed_prompts_as_computed():
    a = list(range(0, 8)) + [1]
    # request 0 fails (on engine 0) but may have left its blocks: request 2 (engine 0)
    # may reuse them; request 1 (engine 1) only under sharing
    bound = prefix_bound([a, a, a], 8, failed={0})
    assert bound["prompt_tokens"] == 18
    assert bound["local_prefill"] == 9 + 1 and bound["shared_prefill"] == 1 + 1


def test_failed_requests_fail_the_bench_below_the_coverage_bar(failing_pair, tmp_path, capsys):
    failing_pair.fail = staticmethod(lambda salt, i: salt == "shared" and i % 2 == 0)
    out = tmp_path / "r.json"
    assert main(["--json", str(out), "--requests", "10", "--modes", "local,shared"]) == 3
    err = capsys.readouterr().err
    assert "shared_tier shared ran 5 of 10 steps" in err and "connector blew up" in err
    assert main(["--json", str(out), "--requests", "10", "--modes", "local,shared", "--allow-skips"]) == 0


def test_one_failed_request_in_the_outage_mode_fails_the_bench_even_with_allow_skips(failing_pair, tmp_path,
                                                                                     capsys):
    failing_pair.fail = staticmethod(lambda salt, i: salt == "outage" and i == 4)  # 1 of 10: coverage 0.9
    out = tmp_path / "r.json"
    assert main(["--json", str(out), "--requests", "10", "--modes", "outage", "--allow-skips"]) == 3
    err = capsys.readouterr().err
    assert "shared_tier outage: 1 of 10 requests failed" in err and "survives a killed" in err


def test_the_order_free_bound_holds_for_every_completion_order():
    """Requests in flight together (the routing bench's --concurrency) may finish in any
    order, and the trace-order bound holds for one order only: the order-free bound is
    at most the ordered bound of every permutation (random prompts sharing prefixes)."""
    import itertools
    import random

    rng = random.Random(7)
    blocks = [list(range(100 * k, 100 * k + 8)) for k in range(4)]
    for _ in range(40):
        prompts = [sum(rng.sample(blocks, rng.randint(1, 3)), []) + ([rng.randint(1, 9)] * rng.randint(0, 2))
                   for _ in range(4)]
        free = prefix_bound(prompts, 8, engines=1, any_order=True)
        worst = min(prefix_bound(list(p), 8, engines=1)["shared_prefill"] for p in itertools.permutations(prompts))
        assert free["shared_prefill"] <= worst and free["prompt_tokens"] == sum(map(len, prompts))
    a = list(range(0, 8))
    assert prefix_bound([a + [1], list(range(200, 208)) + [2]], 8, engines=1, any_order=True)["shared_prefill"] == 18
