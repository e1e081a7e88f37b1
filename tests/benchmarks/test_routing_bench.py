"""``promptsplice.benchmarks.routing``: a short REAL run (two loopback ``vllm serve``, the session's
pair shared with tests/engine_adapters/test_router.py, passed as ``--url``) through
``main``, checking the JSON report and the table."""

from __future__ import annotations

import json

import pytest

from promptsplice.benchmarks.routing import format_routing, main, write_report

KEYS = {"requests", "prompt_tokens", "cached_tokens", "hit_rate", "per_endpoint_requests"}


def test_main_writes_the_report_of_a_real_run(tmp_path, capsys, live_servers):
    out = tmp_path / "sub" / "route.json"
    urls = [arg for s in live_servers for arg in ("--url", s.base_url)]
    assert main(["--requests", "6", *urls, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["endpoints"] == 2 and report["block_size"] == 32
    assert set(report["routers"]) == {"affinity", "round_robin"}
    for name, r in report["routers"].items():
        assert KEYS <= set(r), name
        assert r["requests"] == 6
        assert sum(r["per_endpoint_requests"].values()) == 6
        assert set(r["per_endpoint_requests"]) == {s.base_url for s in live_servers}
        assert 0 < r["cached_tokens"] < r["prompt_tokens"]  # the sample repeats its system prompt
        assert r["hit_rate"] == pytest.approx(r["cached_tokens"] / r["prompt_tokens"])
        assert r["metrics_cached_tokens"] == r["cached_tokens"]
    assert report["routers"]["affinity"]["prompt_tokens"] == report["routers"]["round_robin"]["prompt_tokens"]
    # each router's floor (one prefix cache that never evicts: no routing prefills less)
    for name, c in report["bound_checks"].items():
        r = report["routers"][name]
        assert c["holds"] and c["bound_prefill_tokens"] == r["bound_prefill_tokens"] <= r["prefill_tokens"]
        assert 0 < c["bound_prefill_tokens"] < r["prompt_tokens"]
    printed = capsys.readouterr().out
    assert "affinity" in printed and "round_robin" in printed and str(out) in printed


def test_table_and_json_from_a_report(tmp_path):
    report = {
        "routers": {
            "affinity": {"requests": 4, "prompt_tokens": 1000, "cached_tokens": 500, "hit_rate": 0.5,
                         "per_endpoint_requests": {"http://a": 3, "http://b": 1}, "metrics_cached_tokens": 500},
            "round_robin": {"requests": 4, "prompt_tokens": 1000, "cached_tokens": 250, "hit_rate": 0.25,
                            "per_endpoint_requests": {"http://a": 2, "http://b": 2}, "metrics_cached_tokens": 250},
        },
        "endpoints": 2, "block_size": 32, "key_blocks": 4, "load_factor": 1.25, "concurrency": 1,
    }
    table = format_routing(report)
    assert "50.0%" in table and "25.0%" in table and "3 1" in table
    path = write_report(report, tmp_path / "r.json")
    assert json.loads(path.read_text()) == report
    with pytest.raises(SystemExit) as info:  # a usage error before anything starts
        main(["--requests", "0"])
    assert info.value.code == 2


def test_bad_router_options_fail_before_any_server_starts(monkeypatch):
    """A load factor of 1.0 (or NaN), or one server under two URL spellings, failed only
    after the loopback servers had started (minutes of vLLM start-up)."""
    from promptsplice.benchmarks import routing
    from promptsplice.errors import ConfigError

    started = []
    monkeypatch.setattr(routing, "loopback_servers", lambda n: started.append(n))
    for bad in (1.0, float("nan"), 0.5):
        with pytest.raises(ConfigError, match="load_factor"):
            routing.run_routing_bench(2, load_factor=bad)
    with pytest.raises(ConfigError, match="key_blocks"):
        routing.run_routing_bench(2, key_blocks=0)
    with pytest.raises(ConfigError, match="name the same one"):
        routing.run_routing_bench(2, urls=["http://127.0.0.1:9", "http://127.0.0.1:9/"])
    with pytest.raises(ConfigError, match="endpoints"):
        routing.run_routing_bench(2, endpoints=0)
    assert started == []


def test_stopping_a_server_whose_api_process_died_stops_its_engine_process_too(tmp_path):
    """``vllm serve``'s EngineCore is a child that outlives a dead API server (vLLM sets
    no parent-death signal): ``stop()`` returned once the API server had exited and left
    the engine process (~2.5 GB) behind.  The log of a server that died before it was
    stopped is kept (a crash mid-bench: it holds the reason)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from promptsplice.benchmarks.servers import LoopbackServer

    log_dir = tmp_path / "route-vllm-x"
    log_dir.mkdir()
    log = log_dir / "server.log"
    log.write_text("INFO start\n(EngineCore pid=7) ERROR boom\nValueError: dram_bytes must be >= 0\n"
                   + "\n".join(f"line {i}" for i in range(60)) + "\nRuntimeError: see root cause above\n")
    child = "import time; time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                             f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"],
                            start_new_session=True)
    srv = LoopbackServer("http://127.0.0.1:9", proc, log, log_dir=log_dir)
    time.sleep(1.0)  # the child has started
    os.kill(proc.pid, signal.SIGKILL)  # the API server dies; its child lives on
    proc.wait(timeout=10)
    os.killpg(proc.pid, 0)  # (raises if the group were empty)
    tail = srv.tail(5)
    assert tail.startswith("exceptions in the log:\nValueError: dram_bytes must be >= 0\n")
    assert tail.endswith(f"(whole log: {log})")
    srv.stop()
    from promptsplice.benchmarks.servers import _group_gone

    assert _group_gone(proc.pid)  # no member left but zombies an init may take seconds to reap
    # the server had died before stop(): its log is kept (stop() names it on stderr)
    assert log.exists()
    # a server whose log is the caller's: its folder stays (it held other files)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.json").write_text("{}")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    LoopbackServer("http://127.0.0.1:9", other, mine / "server.log").stop()
    assert other.poll() is not None and (mine / "results.json").exists()
    # a process that leads no group of its own (started without a new session) is stopped alone
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    from promptsplice.benchmarks.servers import stop_process_group

    stop_process_group(plain, grace_s=5)
    assert plain.poll() is not None


class _Lease:
    def __init__(self, endpoint):
        self.endpoint = endpoint


class _OneRouter:
    import contextlib

    @contextlib.contextmanager
    def acquire(self, prompt):
        yield _Lease("a")


class _FakeRemote:
    """A ``RemoteEngine``'s ``complete`` and ``server_counters`` (no vLLM: counters that
    disagree with the responses cannot be made on demand)."""

    def __init__(self, reported, counted, external=None, exposed=True):
        self.reported, self.counted, self.external, self.exposed = reported, counted, external, exposed
        self.hits = self.ext = 0

    def server_counters(self):
        from promptsplice.engine_adapters._wire import ServerCounters

        return ServerCounters(None, self.hits if self.exposed else None, None,
                              self.ext if self.external is not None else None)

    def complete(self, ids, max_tokens, cache_salt):
        import types

        self.hits += self.counted
        self.ext += self.external or 0
        return types.SimpleNamespace(prompt_tokens=len(ids), cached_tokens=self.reported)


def _route(engine):
    import types

    from promptsplice.benchmarks.routing import route_trace

    return route_trace(_OneRouter(), {"a": engine}, [types.SimpleNamespace(token_ids=list(range(64)))] * 3, salt="x")


def test_responses_that_disagree_with_the_servers_metrics_fail_the_run():
    from promptsplice.errors import EngineError

    with pytest.raises(EngineError, match=r"the responses reported 96 cached tokens, the servers' /metrics counted "
                                          r"0 \(0 prefix-cache hits \+ 0 external\)"):
        _route(_FakeRemote(reported=32, counted=0))


def test_metrics_agreement_counts_a_connectors_hits_and_needs_the_counters():
    out = _route(_FakeRemote(reported=32, counted=0, external=32))  # all loaded by a connector
    assert out["cached_tokens"] == 96 and out["metrics_cached_tokens"] == 0
    assert out["metrics_external_cached_tokens"] == 96
    out = _route(_FakeRemote(reported=32, counted=0, exposed=False))  # no counter: nothing to compare
    assert out["cached_tokens"] == 96 and out["metrics_external_cached_tokens"] is None


def test_a_router_below_its_floor_fails_the_run(monkeypatch, tmp_path, capsys):
    """The routing and gateway benches reported no bound, so a cache leaking between
    runs (a salt reused) could not be caught: a run below the floor of one cache that
    never evicts is exit 4 now (a fake run: no server)."""
    import promptsplice.benchmarks.routing as routing

    def fake(*a, **kw):
        check = {"bound": "prefix", "bound_prefill_tokens": 500, "prefill_tokens": 400, "holds": False}
        return {"routers": {"affinity": {"requests": 1, "prompt_tokens": 600, "cached_tokens": 200, "hit_rate": 0.33,
                                         "per_endpoint_requests": {"a": 1}}},
                "bound_checks": {"affinity": check}, "endpoints": 1, "block_size": 32, "key_blocks": 2,
                "load_factor": 1.25, "concurrency": 1}

    monkeypatch.setattr(routing, "run_routing_bench", fake)
    assert routing.main(["--requests", "1"]) == 4
    assert "routing: affinity prefilled 400 tokens, below its bound (prefix) of 500" in capsys.readouterr().err
