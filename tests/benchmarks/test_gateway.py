"""``promptsplice.benchmarks.gateway``: the real Shepherd Model Gateway (``smg``) in front of
the session's two real loopback ``vllm serve`` (shared with the routing tests), a
handful of requests.  The servers' ``/metrics`` are the judge."""

from __future__ import annotations

import json

import httpx
import pytest

from promptsplice.benchmarks.gateway import (
    MODES,
    ROUTING_KEY_HEADER,
    format_gateway,
    gateway,
    main,
    send_through,
)
from promptsplice.errors import ConfigError


@pytest.fixture(scope="module")
def model(two_servers):
    return httpx.get(two_servers[0].base_url + "/v1/models").json()["data"][0]["id"]


def test_consistent_hashing_pins_each_prefix_key_to_one_worker(live_servers, model, default_tok):
    urls = [s.base_url for s in live_servers]
    text = " ".join(f"Row {i} of the gateway probe holds {i * 11}." for i in range(30))
    n = len(default_tok.encode(text))
    keys = ["k-alpha", "k-beta", "k-gamma", "k-delta"]
    items = [(f"{k}: {text}", len(default_tok.encode(f"{k}: {text}")), k) for k in keys]
    items += items  # every key twice
    with gateway(urls, "consistent_hashing") as gw, httpx.Client(timeout=300) as client:
        out = send_through(client, urls, items, route=lambda _t, k: (gw.base_url, {ROUTING_KEY_HEADER: k}),
                           salt=f"gw-test-{id(items)}", model=model)
    served = out["served_by"]
    assert len(served) == 8 and set(served) <= set(urls)
    for i, k in enumerate(keys):
        assert served[i] == served[i + 4], k  # the same key went to the same worker
    # the second copy of each prompt hit the cache its first copy left on that worker
    assert out["cached_tokens"] >= 4 * (n // 32 - 1) * 32
    assert out["cached_tokens"] == out["response_cached_tokens"]  # /metrics == the responses
    assert sum(s["requests"] for s in out["per_server"].values()) == 8
    assert out["prompt_tokens"] == sum(n_tok for _, n_tok, _ in items)


def test_main_writes_the_report_of_a_real_run(tmp_path, capsys, live_servers):
    out = tmp_path / "gw.json"
    urls = [arg for s in live_servers for arg in ("--url", s.base_url)]
    assert main(["--requests", "3", "--family", "support", "--mode", "smg:prefix_hash",
                 "--mode", "affinity", *urls, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    fam = report["families"]["support"]
    assert set(fam) == {"naive", "assembled"} and report["servers"] == 2
    for kind in fam.values():
        assert set(kind) == {"smg:prefix_hash", "affinity"}
        for r in kind.values():
            assert r["requests"] == 3
            assert r["cached_tokens"] == r["response_cached_tokens"]
            assert r["prefill_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
            assert set(r["per_server"]) == {s.base_url for s in live_servers}
            assert sum(s["requests"] for s in r["per_server"].values()) == 3
            assert 0 < r["bound_prefill_tokens"] <= r["prefill_tokens"]  # one cache, never evicting: no routing does better
    assert all(c["holds"] for c in report["bound_checks"].values()) and len(report["bound_checks"]) == 4
    assert report["complete"] is True  # (the JSON written after each family says false)
    assert "smg:prefix_hash" in capsys.readouterr().out


def test_table_from_a_report_and_bad_arguments():
    row = {"requests": 2, "prompt_tokens": 100, "cached_tokens": 40, "prefill_tokens": 60,
           "cluster_hit_rate": 0.4, "per_server": {"a": {"requests": 1}, "b": {"requests": 1}}}
    report = {"families": {"diverse": {"naive": {"affinity": row}, "assembled": {"affinity": dict(row, cluster_hit_rate=0.5)}}},
              "modes": ["affinity"], "servers": 2, "block_size": 32, "requests": 2, "max_tokens": 1}
    table = format_gateway(report)
    assert "40.0%" in table and "50.0%" in table and "diverse" in table
    assert "worst case: diverse affinity, assembled - naive hit rate = +10.0%" in table
    with pytest.raises(ConfigError, match="unknown trace families"):
        main(["--family", "nope"])
    with pytest.raises(SystemExit) as info:  # a usage error before anything starts
        main(["--requests", "0"])
    assert info.value.code == 2
    with pytest.raises(ConfigError, match="unknown modes"):
        main(["--mode", "smg:nope"])
    with pytest.raises(ConfigError, match="unknown smg policy"):
        with gateway(["http://127.0.0.1:1"], "bogus"):
            pass
    assert MODES[:3] == ("smg:cache_aware", "smg:prefix_hash", "smg:consistent_hashing")
    # one server under two spellings: refused before the prompts, servers and gateways
    from promptsplice.benchmarks.gateway import run_gateway_bench

    with pytest.raises(ConfigError, match="name the same one"):
        run_gateway_bench(2, urls=["http://127.0.0.1:9", "http://127.0.0.1:9/"])


def test_naive_and_assembled_prompts_carry_the_same_kind_of_routing_key():
    """The header consistent_hashing hashes: the chain hash of the first 4 blocks for
    both (PrefixRouter's key).  The assembled prompts carried ``prefix_key`` (system
    prompt and tools only), which sent a whole family to one server."""
    from promptsplice.benchmarks.gateway import _prompts
    from promptsplice.engine_adapters._router import prefix_route_key

    prompts = _prompts("apidocs", 12, 0)
    for kind in ("naive", "assembled"):
        assert len({key for _, _, key in prompts[kind]}) > 1, kind
    # the key is the route key of what is sent (ids of the text, re-tokenized exactly)
    from promptsplice.assembler import default_tokenizer

    tok = default_tokenizer()
    for text, _, key in prompts["assembled"]:
        assert key == prefix_route_key(tok.encode(text), block_size=32).hex()


def test_assembled_prompts_are_what_assemble_sends_in_trace_order(default_tok):
    """The bench sends what a user's ``Assembler.assemble`` sends, learning popularity as
    the trace goes; ``preview`` (which learns nothing) put every request's chunks in
    first-seen order and understated the assembled hit rate (apidocs tied with naive).
    Nothing is padded, so every text re-tokenizes to its ids (the bench checks it)."""
    from promptsplice.assembler import Assembler, PromptFormat
    from promptsplice.benchmarks.gateway import _prompts
    from promptsplice.benchmarks.traces import generate_family_trace

    got = [text for text, _, _ in _prompts("apidocs", 20, 0)["assembled"]]
    def make():
        return Assembler(default_tok, block_size=32, policy="stable", alignment="none", prompt_format=PromptFormat.chatml())

    user, frozen = make(), make()
    sent, previews = [], []
    for r in generate_family_trace("apidocs", requests=20, seed=0):
        chunks = [{"id": c.id, "text": c.text, "metadata": c.metadata} for c in r.chunks]
        sent.append(user.assemble(chunks, query=r.query, system=r.system or None).text)
        previews.append(frozen.preview(chunks, query=r.query, system=r.system or None).text)
    assert got == sent
    assert sum(a != b for a, b in zip(sent, previews)) >= 1  # the learned order differs from first-seen


class _FakeServers:
    """Two servers' ``/metrics`` and ``/v1/completions`` (no vLLM: a server whose counters
    disagree with its responses cannot be made on demand).  Each request goes to
    ``srvA``; ``counted`` and ``external`` say what its counters add per request,
    ``reported`` what the response says."""

    def __init__(self, reported, counted, external=None):
        self.reported, self.counted, self.external = reported, counted, external
        self.n = 0

    def get(self, url):
        mine = "srvA" in url
        lines = [f"vllm:prefix_cache_hits_total {self.counted * self.n if mine else 0}",
                 f"vllm:prompt_tokens_total {100 * self.n if mine else 0}",
                 f"vllm:request_success_total {self.n if mine else 0}"]
        if self.external is not None:
            lines.append(f'vllm:external_prefix_cache_hits_total{{engine="0"}} {self.external * self.n if mine else 0}')
        return httpx.Response(200, text="\n".join(lines) + "\n", request=httpx.Request("GET", url))

    def post(self, url, json, headers):
        self.n += 1
        usage = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": self.reported}}
        return httpx.Response(200, json={"usage": usage}, request=httpx.Request("POST", url))


def _send(client):
    return send_through(client, ["http://srvA", "http://srvB"], [("t", 100, "k")] * 3,
                        route=lambda text, key: ("http://srvA", {}), salt="s", model="m")


def test_responses_that_disagree_with_the_servers_metrics_fail_the_run():
    from promptsplice.errors import EngineError

    with pytest.raises(EngineError, match=r"request 0 on http://srvA: the response reported 96 cached tokens, "
                                          r"the server's /metrics counted 64 \(64 prefix-cache hits \+ 0 external\)"):
        _send(_FakeServers(reported=96, counted=64))


def test_a_connectors_hits_count_on_the_metrics_side_of_the_agreement():
    out = _send(_FakeServers(reported=96, counted=64, external=32))  # 64 local + 32 loaded = the responses' 96
    assert out["response_cached_tokens"] == 3 * 96
    assert out["cached_tokens"] == 3 * 64 and out["external_cached_tokens"] == 3 * 32
    # the loaded tokens were not prefilled either (counted as prefilled before)
    assert out["prefill_tokens"] == out["prompt_tokens"] - 3 * 96
    out = _send(_FakeServers(reported=64, counted=64))  # no connector: no external counter
    assert out["cached_tokens"] == out["response_cached_tokens"] == 3 * 64 and out["external_cached_tokens"] == 0
