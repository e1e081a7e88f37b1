"""``promptsplice bench agent`` on a short real session: the JSON fields (fixed: outside
checks read them), the bounds and the fidelity probes."""

from __future__ import annotations

import json

import pytest

from promptsplice.benchmarks.agent import FIDELITY_FIELDS, MODE_FIELDS, run_agent_modes
from promptsplice.benchmarks.fidelity import kl as _kl
from promptsplice.benchmarks.agent_traces import AgentSession, read_agent_trace, write_agent_trace

SAMPLE = "benchmarks/data/agent-sample.jsonl"


@pytest.fixture(scope="module")
def report(engine, kv_engine):
    sess = read_agent_trace(SAMPLE)[0]
    short = AgentSession(sess.id, sess.tools, sess.renders[:6])
    return run_agent_modes([short], engine=engine, kv_engine=kv_engine, max_tokens=4, fidelity_steps=1)


def test_the_report_has_the_fixed_fields(report):
    assert set(report["modes"]) == {"full", "apc", "splice"}
    for m in report["modes"].values():
        assert set(MODE_FIELDS) <= set(m) and m["steps"] == 6
    assert isinstance(report["ideal_prefill_tokens"], int)
    fid = report["fidelity"]
    assert set(FIDELITY_FIELDS) <= set(fid) and set(FIDELITY_FIELDS) <= set(fid["control"])
    json.dumps(report)  # JSON-safe


def test_modes_and_bounds_are_consistent(report):
    full, apc, spl = (report["modes"][m] for m in ("full", "apc", "splice"))
    assert full["prompt_tokens"] == apc["prompt_tokens"] == spl["prompt_tokens"]
    assert full["prefill_tokens"] == full["prompt_tokens"] and full["hit_rate"] == 0.0
    assert spl["prefill_tokens"] <= apc["prefill_tokens"] < full["prefill_tokens"]
    assert report["ideal_prefill_tokens"] <= spl["prefill_tokens"]
    for m in (apc, spl):
        # cached_tokens: vLLM's num_cached_tokens (prefix cache + connector loads), relocated a part
        assert m["prompt_tokens"] == m["prefill_tokens"] + m["cached_tokens"] >= m["prefill_tokens"] + m["relocated_tokens"]
    assert apc["relocated_tokens"] == 0 and spl["relocated_tokens"] > 0
    assert sum(k["steps"] for k in report["by_kind"].values()) == 6


def test_fidelity_was_measured_on_the_real_model(report):
    fid = report["fidelity"]
    assert fid["steps"] == 1
    for f in (fid, fid["control"]):
        assert 0.0 <= f["tf_top1_agreement"] <= 1.0 and 0.0 <= f["greedy_agreement"] <= 1.0
        assert f["first_token_kl"] >= -1e-6
    # the control is exact KV: its teacher-forced agreement is high on any context
    assert fid["control"]["tf_top1_agreement"] >= 0.8


def test_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    p = {1: -0.1053605, 2: -2.3025851}  # 0.9, 0.1
    q = {1: -0.6931472, 2: -0.6931472}  # 0.5, 0.5
    assert _kl(p, p) == pytest.approx(0.0, abs=1e-9)
    assert _kl(p, q) == pytest.approx(0.9 * (-0.1053605 + 0.6931472) + 0.1 * (-2.3025851 + 0.6931472), rel=1e-6)


def test_the_cli_runs_on_a_trace_file(tmp_path, monkeypatch, engine, kv_engine):
    """The command's own path: trace file in, JSON out (engines injected: the session's)."""
    import promptsplice.benchmarks.agent as bench

    sess = read_agent_trace(SAMPLE)[1]
    trace = tmp_path / "t.jsonl"
    write_agent_trace(trace, [AgentSession(sess.id, sess.tools, sess.renders[:3])])
    monkeypatch.setattr(bench, "start_engines", lambda **kw: (engine, kv_engine))
    monkeypatch.setattr(engine, "close", lambda: None)
    monkeypatch.setattr(kv_engine, "close", lambda: None)
    from promptsplice.benchmarks.cli import main

    out = tmp_path / "r.json"
    assert main(["bench", "agent", "--trace", str(trace), "--json", str(out), "--max-tokens", "2",
                 "--fidelity-steps", "0", "--recompute-blocks", "0"]) == 0
    rep = json.loads(out.read_text())
    assert rep["recompute_blocks"] == 0 and rep["modes"]["splice"]["steps"] == 3
    assert rep["fidelity"]["steps"] == 0 and rep["fidelity"]["tf_top1_agreement"] is None
