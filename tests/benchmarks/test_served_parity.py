"""``served_parity``: the same runners on the embedded engine (``kv_engine``) and on a
real ``vllm serve`` with the connector (``served_kv``) give identical rows and probe
numbers on a short RAG trace and one agent session; ``compare`` names what differs."""

from __future__ import annotations

import pytest

from promptsplice.benchmarks.served_parity import KL_TOLERANCE, compare, run_on_engines
from promptsplice.engine_adapters import RemoteEngine


@pytest.fixture
def remote(served_kv):
    if served_kv.proc.poll() is not None:
        pytest.fail(f"vllm serve exited with {served_kv.proc.returncode}:\n{served_kv.tail()}")
    with RemoteEngine(served_kv.base_url, max_retries=0, timeout=600) as eng:
        yield eng


def test_the_served_path_gives_the_embedded_rows_and_probes(remote, kv_engine, rag_requests):
    from promptsplice.benchmarks.agent_traces import AgentSession
    from tests.engine_adapters.runners.test_agent import TOOLS
    from tests.engine_adapters._engine import agent_renders, wiki_lines

    session = AgentSession(id="parity", tools=TOOLS, renders=agent_renders(wiki_lines()))
    kw = {"rag": rag_requests[:5], "agent": [session], "probes": 1, "relocate": "always"}
    results = run_on_engines({"embedded": kv_engine, "served": remote}, **kw)
    embedded, served = results["embedded"], results["served"]
    report = compare(embedded, served)
    print({k: {f: report[k][f] for f in ("steps", "identical_steps", "relocated_tokens", "kl", "wall_ratio")}
           for k in ("rag", "agent")})
    assert report["identical"], report
    for kind, steps in (("rag", 5), ("agent", 3)):
        r = report[kind]
        assert r["steps"] == r["identical_steps"] == steps and r["mismatches"] == []
        assert r["relocated_tokens"] > 0 and r["probes"] == 1
        assert r["kl_max_abs_diff"] <= KL_TOLERANCE and r["kl"]["served"][0] > 0

    # what a difference looks like: one output token changed, one probe's KL moved
    served["rag"]["rows"][2] = served["rag"]["rows"][2][:7] + ([0],) + served["rag"]["rows"][2][8:]
    served["agent"]["probes"][0] = {**served["agent"]["probes"][0], "kl": served["agent"]["probes"][0]["kl"] + 0.01}
    bad = compare(embedded, served)
    assert not bad["identical"]
    assert [m["step"] for m in bad["rag"]["mismatches"]] == [2] and bad["rag"]["identical_steps"] == 4
    assert bad["agent"]["kl_max_abs_diff"] == pytest.approx(0.01, abs=2e-6)
