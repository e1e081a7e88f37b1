"""``promptsplice.benchmarks.pic_sweep``: the baseline must be of the same run, and each
configuration gets ``bench rag``'s checks of ``promptsplice_pic`` (coverage, probes,
bound).

No engine: a real PIC run cannot be made to beat its oracle or miss its probes on
demand, so the engines are fakes with the attributes the sweep reads (block size, KV
blocks, context, store sizes, an assembler on the real tokenizer) and ``_run_pic``
fills the report as the real one does.  Whether a baseline is refused, and when, is
the sweep's own code, run as it is.
"""

from __future__ import annotations

import json
import types

import pytest

import promptsplice.benchmarks.pic_sweep as ps
from promptsplice.benchmarks.cli import run_tool
from promptsplice.benchmarks.fidelity import probe_coverage
from promptsplice.benchmarks.rag import PIC_MODE
from promptsplice.benchmarks.traces_format import RagChunk, RagRequest, dump_rag_trace

BLOCKS = 128


class _Plain:
    block_size = 32
    num_blocks = BLOCKS
    max_model_len = 4096

    def __init__(self, tok):
        self.tokenizer = tok

    def make_assembler(self, **kw):
        from promptsplice.assembler import Assembler

        return Assembler(self.tokenizer, block_size=self.block_size, max_tokens=self.max_model_len - 1, **kw)

    def close(self):
        pass


class _Kv:
    num_blocks = BLOCKS

    def __init__(self):
        self.kv_store = types.SimpleNamespace(config=types.SimpleNamespace(dram_bytes=1 << 30, disk_bytes=4 << 30))

    def close(self):
        pass


@pytest.fixture
def sweep(tmp_path, monkeypatch, default_tok):
    """(trace, baseline path, write(baseline), the runs of the fake _run_pic, set(prefill, probes))."""
    trace = tmp_path / "t.jsonl"
    dump_rag_trace(trace, [RagRequest(f"r{i}", "sys", [RagChunk("c", f"chunk text {i}")], f"q{i}") for i in range(3)])
    base = {
        "trace": str(trace), "steps_total": 3, "skipped_requests": [], "coverage": 1.0,
        "modes": {"naive": {"prefill_tokens": 3000}}, "oracle_prefill_tokens": 1000, "radix_prefill_tokens": 2000,
        "bounds": {"kv_cache_blocks": BLOCKS}, "block_size": 32, "max_tokens": 8, "policy": "cache_aware",
        "alignment": "auto", "pic": {"kv_cache_blocks": BLOCKS, "store_dram_bytes": 1 << 30},
        "store": {"store_disk_bytes": 4 << 30},
    }
    path = tmp_path / "base.json"

    def write(b):
        path.write_text(json.dumps(b))

    write(base)
    runs: list[int] = []
    plan = {"prefill": 1500, "probed": 3}

    def fake_run_pic(report, outs, engine, kv, reqs, *, fidelity_requests, **kw):
        from promptsplice.benchmarks.assemble import gap_closed

        runs.append(len(reqs))
        prefill = plan["prefill"]
        report["modes"][PIC_MODE] = {"requests": len(reqs), "prefill_tokens": prefill, "ttft_p50_ms": 1.0}
        report["pic"] = {"gap_closed": gap_closed(report["modes"]["naive"]["prefill_tokens"], prefill,
                                                  report["oracle_prefill_tokens"]), "engine_requests": len(reqs),
                         "recompute_at": kw.get("recompute_at") or "chunk"}
        report["fidelity"] = {"tf_top1_agreement": None, "first_token_kl": None, "first_token_kl_p50": None,
                              "first_token_kl_max": None, "greedy_agreement": None, "control": {},
                              "steps": plan["probed"], "requested": fidelity_requests,
                              **probe_coverage(fidelity_requests, len(reqs), plan["probed"])}

    monkeypatch.setattr(ps, "_run_pic", fake_run_pic)
    monkeypatch.setattr(ps, "start_mode_engine", lambda mode, **kw: _Plain(default_tok) if mode == "full" else _Kv())
    return types.SimpleNamespace(trace=str(trace), path=str(path), base=base, write=write, runs=runs, plan=plan)


def _argv(s, *more):
    return ["--trace", s.trace, "--baseline", s.path, "--requests", "3", "--fidelity-requests", "3", *more, "packed:1"]


def test_a_matching_baseline_runs_and_reports_its_checks(sweep, capsys):
    assert ps.main(_argv(sweep)) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["gap_closed"] == 0.75 and line["status"] == 0
    assert line["coverage"] == 1.0 and line["steps_run"] == line["steps_total"] == 3
    assert line["probe_coverage"] == 1.0 and line["bound_prefill_tokens"] == 1000 and line["bound_holds"]
    assert sweep.runs == [3]


@pytest.mark.parametrize("field, value, named", [
    ("trace", "some/other.jsonl", "its trace is 'some/other.jsonl'"),
    ("steps_total", 400, "its steps_total (requests read) is 400, this sweep's 3"),
    ("steps_total", None, "lacks steps_total"),
])
def test_a_baseline_of_another_trace_or_count_is_refused_before_any_engine_starts(sweep, monkeypatch, capsys,
                                                                                  field, value, named):
    def no_engine(*a, **k):
        raise AssertionError("an engine started for a baseline of another run")

    monkeypatch.setattr(ps, "start_mode_engine", no_engine)
    b = dict(sweep.base)
    if value is None:
        del b[field]
    else:
        b[field] = value
    sweep.write(b)
    with pytest.raises(ps.BaselineMismatchError, match="--baseline"):
        ps.main(_argv(sweep))
    assert run_tool(ps.main, _argv(sweep)) == 2  # the CLI's bad-input status, one line
    err = capsys.readouterr().err
    assert named in err and "bench rag" in err


@pytest.mark.parametrize("path, value", [
    (("bounds", "kv_cache_blocks"), 182), (("pic", "kv_cache_blocks"), 182), (("block_size",), 16),
    (("pic", "store_dram_bytes"), 1 << 27), (("store", "store_disk_bytes"), 1 << 28), (("skipped_requests",), [1]),
])
def test_a_baseline_of_another_cache_store_or_skip_list_is_refused_before_the_mode_runs(sweep, capsys, path, value):
    b = json.loads(json.dumps(sweep.base))
    node = b
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    sweep.write(b)
    assert run_tool(ps.main, _argv(sweep)) == 2
    assert f"its {'.'.join(path)} is {value!r}" in capsys.readouterr().err
    assert sweep.runs == []  # refused before _run_pic


def test_pic_below_the_baseline_oracle_fails_the_sweep_with_the_bound_status(sweep, capsys):
    sweep.plan.update(prefill=500)  # below the oracle's 1000: gap_closed 1.2
    assert ps.main(_argv(sweep)) == 4
    out = capsys.readouterr()
    line = json.loads(out.out.strip().splitlines()[-1])
    assert line["gap_closed"] > 1 and not line["bound_holds"] and line["status"] == 4
    assert "promptsplice_pic prefilled 500 tokens, below its bound (oracle) of 1000" in out.err


def test_missing_fidelity_probes_fail_the_sweep_unless_skips_are_allowed(sweep, capsys):
    sweep.plan.update(probed=0)  # 3 owed, 0 made
    assert ps.main(_argv(sweep)) == 3
    assert "pic_sweep packed:1 probed 0 steps for fidelity of the 3 it owed" in capsys.readouterr().err
    assert ps.main(_argv(sweep, "--allow-skips")) == 0


def test_requests_that_do_not_fit_are_the_baselines_skips_and_fail_the_coverage_bar(sweep, monkeypatch, capsys):
    dump_rag_trace(sweep.trace, [RagRequest(f"r{i}", "sys", [RagChunk("c", "word " * (5 if i < 2 else 400))], "q")
                                 for i in range(3)])
    monkeypatch.setattr(_Plain, "max_model_len", 128)  # request 2 does not fit, as in the baseline's run
    sweep.write({**sweep.base, "skipped_requests": [2]})
    assert ps.main(_argv(sweep)) == 3  # 2 of 3 requests: below 0.95
    out = capsys.readouterr()
    assert "pic_sweep packed:1 ran 2 of 3 steps" in out.err
    assert json.loads(out.out.strip().splitlines()[-1])["coverage"] == round(2 / 3, 4)
    assert ps.main(_argv(sweep, "--allow-skips")) == 0
    assert sweep.runs == [2, 2]  # the requests the baseline ran, not the skipped one
