"""The splice connector inside a real ``vllm serve`` on loopback (``served_kv``): it loads
by module path from ``--kv-transfer-config``, serves offload hits after vLLM's own cache
was emptied, relocates an agent-style deletion sent as ``RemoteEngine.complete(...,
splice=plan)`` with the same counts as the embedded engine (``kv_engine``), answers a
plan that does not match its request with plain prefill and a reason, and a server
without the connector makes a plan an ``EngineRequestError``."""

from __future__ import annotations


import time

import httpx
import pytest

from promptsplice.engine_adapters import RemoteEngine, plan_deletion, plan_relocation
from promptsplice.engine_adapters.connector._served import CHECK_KEY, plan_check
from promptsplice.errors import EngineRequestError, InputError
from tests.engine_adapters._engine import ENGINE_BLOCK, salt_maker

BS = ENGINE_BLOCK
salt = salt_maker("served-")


@pytest.fixture(scope="module")
def text_tokens(default_tok, rag_requests):
    """Real text (the demo sample's passages) as token ids of the default tokenizer."""
    seen, texts = set(), []
    for req in rag_requests:
        for c in req.chunks:
            if c.text not in seen:
                seen.add(c.text)
                texts.append(c.text)
    ids = list(default_tok.encode("\n\n".join(texts)))
    assert len(ids) > 2000
    return ids


@pytest.fixture
def remote(served_kv):
    if served_kv.proc.poll() is not None:
        pytest.fail(f"vllm serve exited with {served_kv.proc.returncode}:\n{served_kv.tail()}")
    with RemoteEngine(served_kv.base_url, max_retries=0) as eng:
        yield eng


def reset_local_cache(base_url: str) -> None:
    """Empty vLLM's own prefix cache (dev mode); the connector's store is kept."""
    r = httpx.post(base_url + "/reset_prefix_cache", timeout=60)
    assert r.status_code == 200 and r.json() == {"success": True}, r.text


def deletion_prompts(text_tokens):
    """old = P + X + S + q1, new = P + S + q2 (P 2 blocks, X 3 blocks, S 6 blocks)."""
    P, X, S = text_tokens[: 2 * BS], text_tokens[2 * BS : 5 * BS], text_tokens[5 * BS : 11 * BS]
    old = P + X + S + text_tokens[1500:1520]
    new = P + S + text_tokens[1600:1625]
    return P, X, S, old, new


def test_connector_loads_in_vllm_serve_and_serves_offload_hits(remote, served_kv, kv_engine, text_tokens):
    prompt = text_tokens[:10 * BS + 7]  # 10 full blocks + 7 tokens
    # The embedded engine on the same steps: compute, empty vLLM's cache, again.
    s = salt("offload-embedded")
    kv_engine.generate(prompt, max_tokens=1, cache_salt=s)
    kv_engine.reset_prefix_cache()
    before = kv_engine.counters()
    again = kv_engine.generate(prompt, max_tokens=1, cache_salt=s)
    seen = kv_engine.counters().since(before)
    embedded = (again.num_cached_tokens, seen.prefix_cache_hits, seen.external_hits)
    assert embedded == (10 * BS, 0, 10 * BS)

    s = salt("offload")
    first = remote.complete(prompt, max_tokens=1, cache_salt=s)
    assert first.cached_tokens == 0
    reset_local_cache(served_kv.base_url)
    before_metrics = connector_metrics(served_kv.base_url)
    before = remote.server_counters()
    again = remote.complete(prompt, max_tokens=1, cache_salt=s)
    seen = remote.server_counters()
    # vLLM's own cache is empty: every full block comes from the connector's store.
    served = (again.cached_tokens, seen.prefix_cache_hits - before.prefix_cache_hits,
              seen.external_hits - before.external_hits)
    assert served == embedded
    assert again.splice is None  # no plan sent: no ack asked for
    # The connector's counters reach the server's /metrics: 10 blocks loaded from the
    # store's DRAM (the first request's saves counted before: its 10 blocks saved).
    assert connector_counters_reach(served_kv.base_url, {"loaded_blocks": 10, "store_dram_hits": 10}, before_metrics)


def connector_metrics(base_url: str) -> dict[str, float]:
    from promptsplice.engine_adapters._wire import parse_prometheus_counters
    from promptsplice.engine_adapters.connector._metrics import COUNTERS

    text = httpx.get(base_url + "/metrics", timeout=30).text
    found = parse_prometheus_counters(text, [f"vllm:promptsplice_{n}_total" for n in COUNTERS])
    return {k[len("vllm:promptsplice_"):-len("_total")]: v for k, v in found.items()}


def connector_counters_reach(base_url: str, wanted: dict[str, float], before: dict[str, float]) -> dict:
    """The counters' increase since ``before`` once it reaches ``wanted`` (the front end
    records a step's stats as it hands out the step's output: polled for up to 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        now = connector_metrics(base_url)
        seen = {k: now.get(k, 0) - before.get(k, 0) for k in wanted}
        if seen == wanted or time.monotonic() > deadline:
            assert seen == wanted, (seen, now)
            return seen
        time.sleep(0.2)


def test_served_deletion_splice_matches_the_embedded_engine(remote, kv_engine, text_tokens):
    P, X, S, old, new = deletion_prompts(text_tokens)
    counts = {}
    # The embedded engine, with the same store sizes.
    s = salt("embedded")
    kv_engine.generate(old, max_tokens=1, cache_salt=s)
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS, salt=s)
    before = kv_engine.counters()
    done = kv_engine.generate(new, max_tokens=8, cache_salt=s, splice=plan)
    seen = kv_engine.counters().since(before)
    counts["embedded"] = (done.num_cached_tokens, seen.prefix_cache_hits, seen.external_hits)

    # The served engine, same prompts, its own salt.
    s = salt("served")
    remote.complete(old, max_tokens=1, cache_salt=s)
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS, salt=s)
    before = remote.server_counters()
    out = remote.complete(new, max_tokens=8, cache_salt=s, splice=plan)
    after = remote.server_counters()
    counts["served"] = (
        out.cached_tokens,
        after.prefix_cache_hits - before.prefix_cache_hits,
        after.external_hits - before.external_hits,
    )
    assert counts["served"] == counts["embedded"] == (len(P) + len(S), len(P), len(S))
    assert out.splice is not None and out.splice.applied and out.splice.reason == ""
    assert out.splice.planned_tokens == len(S)
    assert out.splice.relocated_tokens == out.splice.loaded_tokens == len(S)


@pytest.mark.reliability
def test_plan_for_other_tokens_falls_back_to_plain_prefill(remote, text_tokens):
    P, X, S, old, new = deletion_prompts(text_tokens)
    s = salt("mismatch")
    remote.complete(old, max_tokens=1, cache_salt=s)
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS, salt=s)
    other = list(new)
    other[len(P) + 5] += 1  # one token differs inside the relocated run
    before = remote.server_counters()
    # Sent raw (the client checks nothing here): the check names the prompt `new`, the
    # request is `other`.
    body = {"prompt": other, "max_tokens": 1, "temperature": 0, "cache_salt": s,
            "model": remote.model or _model(remote),
            "kv_transfer_params": {**plan.to_params(), CHECK_KEY: plan_check(new)}}
    r = httpx.post(remote.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ack = r.json()["kv_transfer_params"]["splice_ack"]
    after = remote.server_counters()
    assert ack["applied"] is False and ack["loaded_tokens"] == 0 and ack["relocated_tokens"] == 0
    assert f"request's {len(other)} token ids differ" in ack["reason"]
    assert after.external_hits - before.external_hits == 0
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P)  # vLLM's own hit only


@pytest.mark.reliability
def test_plan_with_more_blocks_than_the_prompt_is_refused(remote, text_tokens):
    P, X, S, old, new = deletion_prompts(text_tokens)
    s = salt("blocks")
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS, salt=s)
    short = new[: len(P) + 2 * BS + 3]  # the plan covers 6 blocks after P, the prompt 2
    # The client refuses it before sending (other tokens than the plan's) ...
    with pytest.raises(InputError, match=r"covers tokens \[64, 256\) but the prompt has 131"):
        remote.complete(short, max_tokens=1, cache_salt=s, splice=plan)
    # ... and the server, sent it anyway, runs plain prefill and says why.
    body = {"prompt": short, "max_tokens": 1, "temperature": 0, "cache_salt": s,
            "model": remote.model or _model(remote),
            "kv_transfer_params": {**plan.to_params(), CHECK_KEY: plan_check(short)}}
    r = httpx.post(remote.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ack = r.json()["kv_transfer_params"]["splice_ack"]
    assert ack["applied"] is False and ack["loaded_tokens"] == 0
    assert "covers tokens [64, 256) (6 blocks)" in ack["reason"] and "hold only 4 full blocks" in ack["reason"]


def test_relocation_plan_over_the_served_engine_reports_its_counts(remote, text_tokens):
    """A chunk computed at one position, reused at another (a PIC-style relocation)."""
    s = salt("pic")
    chunk = text_tokens[700 : 700 + 4 * BS]
    head_a, head_b = text_tokens[: 3 * BS], text_tokens[1000 : 1000 + BS]
    old = head_a + chunk + text_tokens[1300:1310]
    new = head_b + chunk + text_tokens[1400:1412]
    remote.complete(old, max_tokens=1, cache_salt=s)
    plan = plan_relocation(old, new, old_start=3 * BS, new_start=BS, num_tokens=4 * BS, block_size=BS, salt=s)
    # vLLM's contiguity rule: loads start at the local hit, and head_b is new: a plan
    # for a request whose first block misses loads nothing (plain prefill, applied).
    out = remote.complete(new, max_tokens=1, cache_salt=s, splice=plan)
    assert out.splice is not None and out.splice.applied and out.splice.planned_tokens == 4 * BS
    assert out.splice.loaded_tokens == out.cached_tokens == 0
    # With head_b cached (the same prefix sent once), the chunk's 4 blocks are relocated.
    s2 = salt("pic2")
    remote.complete(old, max_tokens=1, cache_salt=s2)
    remote.complete(head_b + [1, 2, 3], max_tokens=1, cache_salt=s2)
    plan = plan_relocation(old, new, old_start=3 * BS, new_start=BS, num_tokens=4 * BS, block_size=BS, salt=s2)
    out = remote.complete(new, max_tokens=1, cache_salt=s2, splice=plan)
    assert out.splice.applied and out.splice.relocated_tokens == 4 * BS
    assert out.cached_tokens == 5 * BS


@pytest.mark.reliability
def test_server_without_the_connector_refuses_a_plan(plain_server, text_tokens):
    P, X, S, old, new = deletion_prompts(text_tokens)
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS)
    with RemoteEngine(plain_server.base_url, max_retries=0) as eng:
        with pytest.raises(EngineRequestError, match="not started with the splice connector"):
            eng.complete(new, max_tokens=1, splice=plan)
        assert eng.complete(new, max_tokens=1).splice is None  # without a plan: as before


@pytest.fixture(scope="module")
def plain_server():
    """A real ``vllm serve`` without the connector."""
    from promptsplice.benchmarks.servers import loopback_servers

    with loopback_servers(1, block_size=BS) as servers:
        yield servers[0]


def _model(remote: RemoteEngine) -> str:
    return httpx.get(remote.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
