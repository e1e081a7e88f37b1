"""``promptsplice bench agent`` on a short real session: the JSON fields (fixed: outside
checks read them), equal capacity, the bounds, coverage and the fidelity probes.

Three engines, one per mode: ``full`` on the session's plain engine, ``splice`` on the
session's ``kv_engine`` and ``apc`` on one more engine started here with the same KV
cache and store sizes as ``kv_engine`` (the one engine this module adds)."""

from __future__ import annotations

import json

import pytest

from promptsplice.benchmarks.agent import (
    FIDELITY_FIELDS,
    MODE_FIELDS,
    BoundError,
    check_bounds,
    run_agent_modes,
)
from promptsplice.benchmarks.coverage import COVERAGE_EXIT
from promptsplice.errors import ConfigError
from promptsplice.benchmarks.fidelity import kl as _kl
from promptsplice.benchmarks.agent_traces import AgentSession, read_agent_trace, write_agent_trace

SAMPLE = "benchmarks/data/agent-sample.jsonl"


@pytest.fixture(scope="module")
def engines(engine, kv_engine, tmp_path_factory):
    """One engine per mode; ``apc`` gets the same KV cache and store sizes as ``splice``."""
    import dataclasses

    from tests.conftest import start_default_engine

    store = dataclasses.replace(kv_engine.config.kv_store, disk_dir=str(tmp_path_factory.mktemp("apc-store")))
    apc = start_default_engine(kv_store=store, kv_cache_bytes=kv_engine.config.kv_cache_bytes)
    yield {"full": engine, "apc": apc, "splice": kv_engine}
    apc.close()


@pytest.fixture(scope="module")
def report(engines):
    sess = read_agent_trace(SAMPLE)[0]
    short = AgentSession(sess.id, sess.tools, sess.renders[:6])
    # r=1: this short session's relocated runs are 2-3 blocks, so r=1 leaves blocks to
    # probe.  Three probes asked; its two masking steps are the edits ranked for probing
    # (the truncation is not predicted to relocate), so at most two are made
    # (probe_ranks' rank 0 is the last one, and a step that relocates nothing passes its
    # turn only to later steps).
    return run_agent_modes([short], engines=engines, max_tokens=4, fidelity_steps=3, recompute_blocks=1)


def test_the_report_has_the_fixed_fields(report):
    assert set(report["modes"]) == {"full", "apc", "splice"}
    for m in report["modes"].values():
        assert set(MODE_FIELDS) <= set(m) and m["steps"] == 6 and m["steps_below_ideal"] == 0
    assert report["coverage"] == 1.0 and report["steps_run"] == report["steps_total"] == 6
    assert report["skipped_steps"] == 0
    assert isinstance(report["ideal_prefill_tokens"], int)
    fid = report["fidelity"]
    assert set(FIDELITY_FIELDS) <= set(fid) and set(FIDELITY_FIELDS) <= set(fid["control"])
    json.dumps(report)  # JSON-safe


def test_each_mode_is_checked_against_its_own_floor_in_the_report(report):
    """One shared ideal for every mode let ``full`` hit the cache and ``apc`` relocate
    and still pass; now each mode's floor is in ``bounds.checks`` (and the intervals
    resample sessions: the probes of a session share its context)."""
    checks = report["bounds"]["checks"]
    full, apc, spl = (report["modes"][m] for m in ("full", "apc", "splice"))
    assert {m: c["bound"] for m, c in checks.items()} == {"full": "prompt", "apc": "prefix_ideal", "splice": "ideal"}
    assert checks["full"]["bound_prefill_tokens"] == full["prompt_tokens"]
    assert checks["splice"]["bound_prefill_tokens"] == report["ideal_prefill_tokens"]
    # no relocation frees less: the prefix ideal lies between the ideal and apc's prefill
    assert report["ideal_prefill_tokens"] <= report["prefix_ideal_prefill_tokens"] <= apc["prefill_tokens"]
    assert checks["apc"]["bound_prefill_tokens"] == report["prefix_ideal_prefill_tokens"]
    assert checks["apc"]["relocated_tokens"] == 0
    assert all(c["holds"] for c in checks.values()) and spl["steps_below_bound"] == 0
    assert all(m["steps_below_bound"] == 0 for m in report["modes"].values())
    for f in (report["fidelity"], report["fidelity"]["control"]):
        assert f["ci_unit"] == "session" and f["ci_units"] == 1  # one session: the interval says nothing
        assert f["ci95_undefined"] == ["first_token_kl_ci95", "tf_top1_ci95"]
        assert f["small_sample"] is True  # 2 probes at most: the p90 is their max


def test_full_and_apc_fail_below_their_own_floors():
    """The reviewer's report: ``full`` served 80% of its prompt from cache (a salt bug)
    and ``apc`` relocated 3,000 tokens; both above the shared ideal, so both passed."""
    modes = {"full": {"prompt_tokens": 82204, "prefill_tokens": 82204, "relocated_tokens": 0, "steps_below_ideal": 0},
             "apc": {"prompt_tokens": 82204, "prefill_tokens": 9500, "relocated_tokens": 0, "steps_below_ideal": 0},
             "splice": {"prompt_tokens": 82204, "prefill_tokens": 12540, "relocated_tokens": 5000,
                        "steps_below_ideal": 0}}
    ok = {"ideal_prefill_tokens": 9000, "prefix_ideal_prefill_tokens": 9400, "modes": modes}
    check_bounds(ok)
    hit = {**ok, "modes": {**modes, "full": {**modes["full"], "prefill_tokens": 16000}}}
    with pytest.raises(BoundError, match=r"full prefilled 16000 tokens, against its floor \(prompt\) of 82204"):
        check_bounds(hit)
    moved = {**ok, "modes": {**modes, "apc": {**modes["apc"], "relocated_tokens": 3000}}}
    with pytest.raises(BoundError, match=r"apc prefilled 9500 tokens.*relocated 3000 tokens \(it must relocate none\)"):
        check_bounds(moved)
    # apc below the ideal without relocation (above the shared ideal): fails
    low = {**ok, "prefix_ideal_prefill_tokens": 9600}
    with pytest.raises(BoundError, match=r"apc prefilled 9500 tokens, against its floor \(prefix_ideal\) of 9600"):
        check_bounds(low)
    # a step of full below its prompt, whatever the totals say
    step = {**ok, "modes": {**modes, "full": {**modes["full"], "steps_below_bound": 1}}}
    with pytest.raises(BoundError, match=r"own step floor: \{'full': 1\}"):
        check_bounds(step)


def test_the_prefix_ideal_is_the_ideal_without_relocation():
    """apc's floor comes from the same per-step bound with the relocation credits off:
    free is only the exact prefix (or the prefix shared with the previous render)."""
    from types import SimpleNamespace as NS

    from promptsplice.benchmarks.agent import _ideal_step

    seg = lambda key, start, end: NS(key=key, padding=0, start=start, end=end)  # noqa: E731
    prev = NS(body_segments=[seg("a", 0, 40), seg("b", 40, 100)])
    render = NS(token_ids=list(range(200)), segments=[seg("a", 0, 40), seg("c", 40, 60), seg("b", 60, 120)])
    diff = NS(relocations=[NS(new_start=60, length=60)])
    prepared = NS(render=render, previous=prev, diff=diff, first_changed_token=40)
    assert _ideal_step(prepared, 32, 32) == 200 - 40 - 60  # the prefix and the relocated run are free
    assert _ideal_step(prepared, 32, 32, relocation=False) == 200 - 40  # the prefix alone
    assert _ideal_step(prepared, 192, 32, relocation=False) == 8  # at least the last block's tokens


def test_modes_and_bounds_are_consistent(report):
    full, apc, spl = (report["modes"][m] for m in ("full", "apc", "splice"))
    assert full["prompt_tokens"] == apc["prompt_tokens"] == spl["prompt_tokens"]
    assert full["prefill_tokens"] == full["prompt_tokens"] and full["hit_rate"] == 0.0
    assert spl["prefill_tokens"] <= apc["prefill_tokens"] < full["prefill_tokens"]
    assert 0 < report["ideal_prefill_tokens"] <= spl["prefill_tokens"]
    ideal = report["ideal_prefill_tokens"]
    assert report["gap_closed"] == round((apc["prefill_tokens"] - spl["prefill_tokens"]) / (apc["prefill_tokens"] - ideal), 4) <= 1
    check_bounds(report)  # no mode below its bound
    # equal capacity: apc had the same store, so the first step (nothing to splice) costs the same
    assert report["by_kind"]["first"]["apc"]["prefill_tokens"] == report["by_kind"]["first"]["splice"]["prefill_tokens"]
    for m in (apc, spl):
        # cached_tokens: vLLM's num_cached_tokens (prefix cache + connector loads), relocated a part
        assert m["prompt_tokens"] == m["prefill_tokens"] + m["cached_tokens"] >= m["prefill_tokens"] + m["relocated_tokens"]
    assert apc["relocated_tokens"] == 0 and spl["relocated_tokens"] > 0
    assert sum(k["steps"] for k in report["by_kind"].values()) == 6


def test_fidelity_was_measured_on_the_real_model(report):
    fid = report["fidelity"]
    assert fid["requested"] == 3 and 1 <= fid["steps"] <= 2
    assert fid["steps"] == min(3, fid["eligible"]) and fid["probe_coverage"] == 1.0
    for f in (fid, fid["control"]):
        assert 0.0 <= f["tf_top1_agreement"] <= 1.0 and 0.0 <= f["greedy_agreement"] <= 1.0
        assert f["first_token_kl"] >= -1e-6
    # the control is exact KV: its teacher-forced agreement is high on any context
    assert fid["control"]["tf_top1_agreement"] >= 0.8
    # greedy agreement compares 32 greedy tokens of the mode's KV, whatever --max-tokens
    # (4 here): the step's own 4-token completion capped it at 4/32 for exact KV too
    assert fid["control"]["greedy_agreement"] > 4 / 32
    # the per-probe records pair up by step; only the splice ones carry its relocated KV
    pairs = zip(fid["probes"], fid["control"]["probes"], strict=True)
    for sp, ctl in pairs:
        assert (sp["session"], sp["step"], sp["changed_share"]) == (ctl["session"], ctl["step"], ctl["changed_share"])
        assert sp["relocated_tokens"] > 0 and ctl["relocated_tokens"] == 0 and ctl["deviation_max"] is None


def test_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    p = {1: -0.1053605, 2: -2.3025851}  # 0.9, 0.1
    q = {1: -0.6931472, 2: -0.6931472}  # 0.5, 0.5
    assert _kl(p, p) == pytest.approx(0.0, abs=1e-9)
    assert _kl(p, q) == pytest.approx(0.9 * (-0.1053605 + 0.6931472) + 0.1 * (-2.3025851 + 0.6931472), rel=1e-6)


def test_a_mode_below_the_ideal_fails_the_bench():
    rep = {"ideal_prefill_tokens": 1000,
           "modes": {"apc": {"prefill_tokens": 1500, "steps_below_ideal": 0},
                     "splice": {"prefill_tokens": 900, "steps_below_ideal": 2}}}
    with pytest.raises(BoundError, match=r"splice prefilled 900 tokens, below the ideal of 1000"):
        check_bounds(rep)
    # a step below its own bound fails too, whatever the totals say
    steps = {"ideal_prefill_tokens": 1000,
             "modes": {"apc": {"prefill_tokens": 1500, "steps_below_ideal": 0},
                       "splice": {"prefill_tokens": 1100, "steps_below_ideal": 1}}}
    with pytest.raises(BoundError, match=r"splice prefilled 1100 tokens.*'splice': 1"):
        check_bounds(steps)
    from promptsplice.benchmarks import bounds

    assert BoundError is bounds.BoundError  # one error, one exit status (BOUND_EXIT) for every bench


def test_equal_capacity_compares_every_setting_of_the_cache_and_the_store():
    """The guard compared (blocks, block size, dtype, DRAM, disk): an ``apc`` engine
    without prefix caching, with a shorter context or without the remote tier passed."""
    import types

    from promptsplice.benchmarks import agent

    def eng(prefix=True, mml=8192, remote=0, blocks=728, bs=32, dtype="bfloat16", dram=1 << 30):
        store = types.SimpleNamespace(dram_bytes=dram, disk_bytes=4 << 30, remote_bytes=remote)
        cfg = types.SimpleNamespace(kv_store=store, dtype=dtype, enable_prefix_caching=prefix, max_model_len=mml)
        return types.SimpleNamespace(num_blocks=blocks, block_size=bs, config=cfg, max_model_len=mml)

    agent._check_capacity({"apc": agent._store_shape(eng()), "splice": agent._store_shape(eng())}, True)
    for other in (dict(prefix=False), dict(mml=4096), dict(remote=1 << 30), dict(blocks=364), dict(bs=16),
                  dict(dtype="float32"), dict(dram=1 << 29)):
        with pytest.raises(ConfigError, match="equal capacity"):
            agent._check_capacity({"apc": agent._store_shape(eng(**other)), "splice": agent._store_shape(eng())}, True)


def test_a_full_engine_of_another_block_size_is_refused():
    """The one hook pads renders, and the ideal counts blocks, in full's block size: a
    ``full`` engine of block 16 beside apc and splice of 32 passed unchecked."""
    import types

    def eng(bs):
        store = types.SimpleNamespace(dram_bytes=1 << 30, disk_bytes=4 << 30, remote_bytes=0)
        cfg = types.SimpleNamespace(kv_store=store, dtype="float32", enable_prefix_caching=True, max_model_len=4096)
        return types.SimpleNamespace(num_blocks=182, block_size=bs, config=cfg, max_model_len=4096,
                                     kv_store=object())

    engines = {"full": eng(16), "apc": eng(32), "splice": eng(32)}
    with pytest.raises(ConfigError, match="full's block size 16 differs from apc's 32"):
        run_agent_modes([read_agent_trace(SAMPLE)[0]], engines=engines)


def test_a_full_engine_of_another_dtype_or_modes_that_skipped_other_steps_are_refused(monkeypatch):
    """``full``'s dtype was never compared with the other engines'; and in sequential
    mode a step over full's shorter context was skipped there only while apc and splice
    ran it (traffic the report counted as skipped; the merged records then paired
    full's fresh step with the others' edit)."""
    import types

    from promptsplice.benchmarks import agent

    def eng(mml=4096, dtype="float32", blocks=182):
        store = types.SimpleNamespace(dram_bytes=1 << 30, disk_bytes=4 << 30, remote_bytes=0)
        cfg = types.SimpleNamespace(kv_store=store, dtype=dtype, enable_prefix_caching=True, max_model_len=mml)
        return types.SimpleNamespace(num_blocks=blocks, block_size=32, config=cfg, max_model_len=mml,
                                     kv_store=object(), close=lambda: None, tokenizer=None)

    sess = [read_agent_trace(SAMPLE)[0]]
    n = len(sess[0].renders)
    with pytest.raises(ConfigError, match="full's dtype 'bfloat16' differs from apc's 'float32'"):
        run_agent_modes(sess, engines={"full": eng(dtype="bfloat16"), "apc": eng(), "splice": eng()},
                        fidelity_steps=0)
    monkeypatch.setattr("promptsplice.engine_adapters.AgentRunner", lambda *a, **k: None)
    ran = {"full": [None] * n, "apc": [("first", None, None, {})] * n}  # full skipped every step

    def replay(sessions, runners, *a, **k):
        (mode,) = runners
        return ran[mode]

    monkeypatch.setattr(agent, "_replay", replay)
    fleet, started = {"full": eng(mml=1200), "apc": eng(), "splice": eng()}, []
    with pytest.raises(ConfigError, match=r"apc skipped steps \[\] and the modes before it \[0, 1"):
        run_agent_modes(sess, start_engine=lambda m: started.append(m) or fleet[m], fidelity_steps=0)
    assert started == ["full", "apc"]  # refused before splice started
    # full's own KV blocks and context may differ (fresh salts; interleaved skips are shared)
    agent._check_full(agent._full_shape(eng(blocks=99, mml=1200)), "apc", agent._full_shape(eng()))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sessions": -1}, "sessions must be an int >= 1"),
    ({"sessions": 0}, "sessions must be an int >= 1"),
    ({"fidelity_steps": -1}, "fidelity_steps must be an int >= 0"),
    ({"fidelity_steps": 2.5}, "fidelity_steps must be an int >= 0"),
    ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
])
def test_bad_bench_agent_arguments_are_refused_before_any_engine_starts(tmp_path, monkeypatch, kwargs, match):
    """The library entry points took ``sessions=-1`` (the last session dropped, coverage
    still 1.0), ``sessions=0`` (blamed on max_model_len) and a negative or fractional
    ``fidelity_steps`` (probe coverage -0.0 or 1.2); the CLI guarded them, they did not."""
    from promptsplice.benchmarks import agent as bench

    def no_engines(**_):
        raise AssertionError("an engine started")

    monkeypatch.setattr(bench, "start_engines", no_engines)
    with pytest.raises(ConfigError, match=match):
        bench.run_agent_bench(SAMPLE, tmp_path / "r.json", verbose=False, **kwargs)


def test_a_trace_without_edit_steps_reports_no_edit_ttft_not_0_ms():
    from promptsplice.benchmarks.agent import _fmt_ms, _Totals

    rep = _Totals().report()
    assert rep["edit_steps_ttft_p50_ms"] is None and rep["ttft_p50_ms"] is None
    assert _fmt_ms(None, 11).strip() == "n/a" and _fmt_ms(12.4, 7) == "     12ms"  # the table's cells


def test_a_run_that_raises_still_writes_its_json(tmp_path, monkeypatch):
    """The JSON was promised "in every case", but a probe that failed its check (or an
    engine error) late in a run left none: the error is in the report now, and raised."""
    import promptsplice.benchmarks.agent as bench

    def boom(**kw):
        raise ConfigError("no engine for this test")

    monkeypatch.setattr(bench, "start_engines", boom)
    out = tmp_path / "deep" / "r.json"
    with pytest.raises(ConfigError, match="no engine for this test"):
        bench.run_agent_bench(SAMPLE, out, fidelity_steps=0, verbose=False)
    assert json.loads(out.read_text()) == {"trace": SAMPLE, "error": {"type": "ConfigError",
                                                                    "message": "no engine for this test"}}


def test_apc_and_splice_on_one_shared_store_are_refused():
    """Engines of one process on equal StoreConfigs share one block store: splice then
    loaded what apc saved (the engine objects differed, so the check passed)."""
    import types

    store = object()
    engines = {"full": types.SimpleNamespace(), "apc": types.SimpleNamespace(kv_store=store),
               "splice": types.SimpleNamespace(kv_store=store)}
    with pytest.raises(ConfigError, match="apc and splice share one block store"):
        run_agent_modes([read_agent_trace(SAMPLE)[0]], engines=engines)


def test_modes_must_run_at_equal_capacity_on_engines_of_their_own(engines):
    sess = read_agent_trace(SAMPLE)[0]
    with pytest.raises(ConfigError, match="engine of its own"):
        run_agent_modes([sess], engines={**engines, "apc": engines["splice"]})
    with pytest.raises(ConfigError, match="equal capacity"):  # apc without the store
        run_agent_modes([sess], engines={**engines, "apc": engines["full"], "full": engines["apc"]})


def test_the_cli_runs_on_a_trace_file_and_fails_below_the_coverage_bar(tmp_path, monkeypatch, engines):
    """The command's own path: trace file in, JSON out (engines injected: the session's).
    A session whose prompt exceeds every engine's context is skipped: 3 of 4 steps is
    coverage 0.75, exit 3 unless --allow-skips."""
    import promptsplice.benchmarks.agent as bench

    sess = read_agent_trace(SAMPLE)[1]
    huge = [[{"role": "user", "content": "word " * 9000}]]  # > 8,192 tokens: refused before any compute
    trace = tmp_path / "t.jsonl"
    write_agent_trace(trace, [AgentSession(sess.id, sess.tools, sess.renders[:3]), AgentSession("huge", [], huge)])
    monkeypatch.setattr(bench, "start_engines", lambda **kw: engines)
    for eng in engines.values():
        monkeypatch.setattr(eng, "close", lambda: None)
    from promptsplice.benchmarks.cli import main

    out = tmp_path / "r.json"
    assert main(["bench", "agent", "--trace", str(trace), "--json", str(out), "--max-tokens", "2",
                 "--fidelity-steps", "0", "--recompute-blocks", "0"]) == COVERAGE_EXIT
    rep = json.loads(out.read_text())
    assert rep["recompute_blocks"] == 0 and rep["modes"]["splice"]["steps"] == 3
    assert rep["fidelity"]["steps"] == 0 and rep["fidelity"]["tf_top1_agreement"] is None
    assert (rep["coverage"], rep["steps_run"], rep["steps_total"], rep["skipped_steps"]) == (0.75, 3, 4, 1)
    only_huge = tmp_path / "h.jsonl"
    write_agent_trace(only_huge, [AgentSession("huge", [], huge)])
    # nothing ran: a report of zeros is no partial result, --allow-skips or not
    assert main(["bench", "agent", "--trace", str(only_huge), "--json", str(out), "--allow-skips"]) == COVERAGE_EXIT
    assert json.loads(out.read_text())["coverage"] == 0.0


def test_modes_one_after_the_other(engines, monkeypatch):
    """``--sequential``: each mode alone on its engine (here the module's, not closed), the
    same report fields, bounds and coverage."""
    for eng in engines.values():
        monkeypatch.setattr(eng, "close", lambda: None)
    sess = read_agent_trace(SAMPLE)[2]
    short = AgentSession(sess.id, sess.tools, sess.renders[:3])  # new, append, edit
    with pytest.raises(ConfigError, match="fidelity_steps=1"):
        run_agent_modes([short], start_engine=engines.__getitem__, fidelity_steps=1)
    rep = run_agent_modes([short], start_engine=engines.__getitem__, fidelity_steps=0, max_tokens=2)
    assert rep["sequential"] is True and rep["coverage"] == 1.0 and rep["steps_run"] == 3
    assert {m["steps"] for m in rep["modes"].values()} == {3}
    full, apc, spl = (rep["modes"][m] for m in ("full", "apc", "splice"))
    assert full["prefill_tokens"] == full["prompt_tokens"] > apc["prefill_tokens"] >= rep["ideal_prefill_tokens"]
    check_bounds(rep)


def test_a_second_run_on_the_same_engines_hits_nothing_of_the_first(report, engines):
    """Fixed salts let a run hit the blocks an earlier run left on the same engines (a
    library caller's, a test's); the ideal, now counted from the blocks computed in the
    run itself, caught it: a mode prefilled below it."""
    sess = read_agent_trace(SAMPLE)[0]
    short = AgentSession(sess.id, sess.tools, sess.renders[:6])
    again = run_agent_modes([short], engines=engines, max_tokens=4, fidelity_steps=0, recompute_blocks=1)
    for m in ("full", "apc", "splice"):
        assert again["modes"][m]["prefill_tokens"] == report["modes"][m]["prefill_tokens"], m
    assert again["ideal_prefill_tokens"] == report["ideal_prefill_tokens"]


def test_the_exact_prefix_of_the_ideal_counts_computed_blocks_only():
    from promptsplice.benchmarks.agent import _Computed

    c = _Computed(4)
    assert c.hit(list(range(12))) == 0
    c.add(list(range(10)), [[100, 101, 102, 103]])  # blocks of the prompt and of prompt + 3 generated
    assert c.hit(list(range(12))) == 8  # 2 full blocks of the prompt; the last block's token is never served
    assert c.hit(list(range(10)) + [100, 101, 102, 7, 8]) == 12  # the cached generated tokens count
    # prompt + generated[:-1] is 13 tokens: 3 full blocks, so a 4th block is not served
    assert c.hit(list(range(10)) + [100, 101, 102, 103, 5, 6, 7]) == 12
    assert c.hit([0, 1, 2, 9] + list(range(4, 12))) == 0  # a different first block: nothing
