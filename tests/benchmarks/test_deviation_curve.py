"""The deviation curve's pure helpers (the bench itself runs the real engine:
``python -m promptsplice.benchmarks.deviation_curve``, README's agent section)."""

from __future__ import annotations

import json

import pytest

from promptsplice.benchmarks.deviation_curve import AGGREGATES, BUDGETS, aggregate, approximate_tokens, budget_sweep, spearman
from promptsplice.engine_adapters.connector import BlockDeviation


def test_spearman_is_a_rank_correlation():
    xs = [0.01, 0.2, 0.05, 0.4, 0.3]
    assert spearman(xs, [x**3 for x in xs]) == 1.0  # any increasing map: the same ranks
    assert spearman(xs, [-x for x in xs]) == -1.0
    assert spearman(xs[:2], xs[:2]) is None and spearman(xs, [1.0] * 5) is None
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9487, abs=1e-4)  # ties share a rank


def test_aggregates_read_the_block_deviation():
    d = BlockDeviation(64, -32, (0.0, 0.2, 0.4), (0.0, 0.1, 0.9))
    got = {a: aggregate(d, a) for a in AGGREGATES}
    assert got["mean_kv"] == d.value == pytest.approx(1.6 / 6)
    assert got["mean_k"] == pytest.approx(0.2) and got["mean_v"] == pytest.approx(1.0 / 3)
    assert got["max_layer"] == d.max_layer == 0.9 and got["last_layer"] == pytest.approx(0.65)
    with pytest.raises(ValueError, match="aggregate"):
        aggregate(d, "median")


def _rows(kls, devs, extra=0):
    from promptsplice.benchmarks.deviation_curve import AGGREGATES

    return {"rows": [{"session": "s", "step": i, "kind": "mask", "kl": k, "prefill_tokens": 100 + 32 * extra,
                      "relocated_tokens": 64, "requests": 2, "extra_blocks": extra, "dev": dict.fromkeys(AGGREGATES, d)}
                     for i, (k, d) in enumerate(zip(kls, devs))], "probe_s": 0.1, "wall_s": 10.0, "unverified": 0}


def test_the_chosen_threshold_is_the_cheapest_that_keeps_the_kl_bar():
    from promptsplice.benchmarks.deviation_curve import curve_report

    devs = [0.1, 0.12, 0.2, 0.22]
    # r1 already meets the bar: nothing extended is cheapest, the next 0.05 above its deviations.
    rep = curve_report({"r1": _rows([0.01] * 4, devs), "t=0.15": _rows([0.005] * 4, devs, 1)}, [0.15], 32)
    assert rep["chosen_max_deviation"] == 0.25 and rep["configs"]["t=0.15"]["extra_prefill_blocks"] == 4
    # r1 misses it (p90 0.05), the threshold meets it: the threshold.
    rep = curve_report({"r1": _rows([0.01, 0.01, 0.05, 0.05], devs), "t=0.15": _rows([0.005] * 4, devs, 1)}, [0.15], 32)
    assert rep["chosen_max_deviation"] == 0.15
    assert rep["spearman_r1"]["mean_kv"] > 0.8 and len(rep["pairs_r1"]) == 4
    # Neither: none.
    rep = curve_report({"r1": _rows([0.05] * 4, devs), "t=0.15": _rows([0.05] * 4, devs, 1)}, [0.15], 32)
    assert rep["chosen_max_deviation"] is None
    # A config whose probes did not all meet its KV is never chosen (its rows miss them;
    # they were measured on exact KV and kept out): it was, at KL 0.0.
    unverified = {**_rows([0.005] * 4, devs, 1), "unverified": 10}
    rep = curve_report({"r1": _rows([0.01, 0.01, 0.05, 0.05], devs), "t=0.15": unverified}, [0.15], 32)
    assert rep["configs"]["t=0.15"]["unverified_probes"] == 10 and rep["chosen_max_deviation"] is None


def test_a_budget_sweep_counts_steps_over_budget_as_exact_and_what_it_keeps():
    def row(kl, *lengths):
        return {"kl": kl, "runs": [{"length": n, "delta": 0} for n in lengths]}

    # approximate tokens at block 32, 2 recomputed blocks per run: 100 -> 96 - 64 = 32;
    # 300 + 70 -> (288 - 64) + (64 - 64) = 224; 50 -> 0 (inherited KL only)
    rows = [row(0.05, 300, 70), row(0.01, 100), row(0.03, 50)] + [row(0.0, 100)] * 7  # 10: p90 is the 9th
    assert [approximate_tokens(r, 32, 2) for r in rows[:3]] == [224, 32, 0]
    rep = budget_sweep(rows, block_size=32, budgets=(0, 32, 224))
    by = {s["budget"]: s for s in rep["sweep"]}
    # budget 0: both approximate steps count as exact; the inherited 0.03 stays
    assert by[0]["kl_max"] == 0.03 and by[0]["kept_share"] == 0.0
    assert by[32]["kept_share"] == round(32 * 8 / (224 + 32 * 8), 3) and by[32]["kl_p90"] == 0.01
    assert by[224]["kept_share"] == 1.0 and by[224]["kl_max"] == 0.05 and by[224]["kl_p90"] == 0.03  # over the bar
    assert rep["largest_budget_meeting_bar"] == 32 and rep["inherited"]["steps"] == 1


@pytest.mark.parametrize(("thresholds", "says"), [
    ("abc", "'abc' is not a number"),  # a ValueError traceback
    ("0.05,", "'' is not a number"),
    ("0", "in (0, 1], got 0"),
    ("0.1,1.5", "in (0, 1], got 1.5"),
    ("nan", "in (0, 1], got nan"),
])
def test_bad_thresholds_are_usage_errors(tmp_path, capsys, thresholds, says):
    from promptsplice.benchmarks.deviation_curve import main

    with pytest.raises(SystemExit) as info:
        main(["--trace", str(tmp_path / "t.jsonl"), "--json", str(tmp_path / "r.json"), "--thresholds", thresholds])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--thresholds" in err and says in err


@pytest.mark.parametrize("flag", ["--budget-sweep", "--report-from"])
@pytest.mark.parametrize(("content", "says"), [
    ("{not json", "not JSON"),  # a JSONDecodeError traceback
    (b"\xff\xfe{", "not JSON"),
    ("[1, 2]", "not a --raw file of this bench"),
    ('{"r1": {"runs": []}}', "not a --raw file of this bench"),
    ('{"r1": {"rows": [{"kl": 0.1}]}}', "a row this bench cannot read (KeyError"),
])
def test_a_raw_file_it_cannot_read_is_one_line(tmp_path, capsys, flag, content, says):
    from promptsplice.benchmarks.cli import run_tool
    from promptsplice.benchmarks.deviation_curve import main

    raw = tmp_path / "raw.json"
    (raw.write_bytes if isinstance(content, bytes) else raw.write_text)(content)
    out = tmp_path / "r.json"
    assert run_tool(main, [flag, str(raw), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{flag} {raw}: {says}" in err and not out.exists()


def test_report_from_needs_the_r1_config(tmp_path, capsys):
    from promptsplice.benchmarks.cli import run_tool
    from promptsplice.benchmarks.deviation_curve import main

    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"bounded": _rows([0.01] * 3, [0.1] * 3)}))  # a --bounded-only run
    assert run_tool(main, ["--report-from", str(raw), "--json", str(tmp_path / "r.json")]) == 2
    assert "with config 'r1'" in capsys.readouterr().err


def test_reports_are_rebuilt_from_raw_files_without_an_engine(tmp_path, capsys):
    from promptsplice.benchmarks.deviation_curve import main

    devs = [0.1, 0.12, 0.2, 0.22]
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"r1": _rows([0.01] * 4, devs), "t=0.15": _rows([0.005] * 4, devs, 1)}))
    out = tmp_path / "r.json"
    assert main(["--report-from", str(raw), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["chosen_max_deviation"] == 0.25
    rows = [{"kl": 0.01, "runs": [{"length": 100, "delta": 0}]}] * 3
    raw.write_text(json.dumps({"bounded": {"rows": rows}}))
    assert main(["--budget-sweep", str(raw), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["bounded"]["steps"] == 3
    capsys.readouterr()
    # neither may be overwritten by the report
    from promptsplice.benchmarks.cli import run_tool

    assert run_tool(main, ["--budget-sweep", str(raw), "--json", str(tmp_path / "." / "raw.json")]) == 2
    assert "is the --budget-sweep file" in capsys.readouterr().err
    assert json.loads(raw.read_text()) == {"bounded": {"rows": rows}}


def _rag_family(*probes):
    """A bench rag family entry with per-probe records (kl, relocated_tokens)."""
    return {"report": {"fidelity": {"steps": len(probes),
                                    "probes": [{"kl": kl, "relocated_tokens": t} for kl, t in probes]}}}


def test_a_rag_budget_sweep_uses_each_probes_relocated_tokens_per_family_and_pooled():
    from promptsplice.benchmarks.deviation_curve import rag_budget_sweep

    suite = {"families": {
        "a": _rag_family((0.001, 64), (0.05, 1024), (0.01, 128)),
        "b": _rag_family((0.03, 256), (0.001, 32)),
        "failed": {"error": "engine died"},  # a family that failed has no report
        "none": {"report": {"fidelity": {"steps": 0}}},  # nothing relocated: nothing probed
    }}
    rep = rag_budget_sweep(suite, budgets=(0, 128, 256, 1024))
    a = {s["budget"]: s for s in rep["a"]["sweep"]}
    # a: 1024 keeps the 0.05 probe (over the bar); 128 and 256 send it exact (KL 0)
    assert a[1024]["kl_max"] == 0.05 and a[1024]["kept_share"] == 1.0
    assert a[256]["kl_max"] == 0.01 and a[256]["kept_share"] == round(192 / 1216, 3)
    assert rep["a"]["largest_budget_meeting_bar"] == 256
    # b: its 0.03 probe relocated 256 tokens, so only 128 and below meet the bar
    assert rep["b"]["largest_budget_meeting_bar"] == 128
    assert rep["failed"] == {"steps": 0} and rep["none"] == {"steps": 0}
    assert rep["all"]["steps"] == 5
    # the worst family decides: the largest budget both a and b meet
    assert rep["worst"] == {"largest_budget_every_family_meets": 128, "largest_deviation_every_family_meets": None,
                            "families_with_probes": 2}
    # records without a measured deviation (no guard): no deviation sweep, none claimed
    assert "deviation_sweep" not in rep["a"] and rep["worst"]["largest_deviation_every_family_meets"] is None
    # one trace's report (not --suite) is one family
    one = rag_budget_sweep(_rag_family((0.03, 256))["report"], budgets=(0, 256))
    assert one["trace"]["largest_budget_meeting_bar"] == 0 and one["worst"]["families_with_probes"] == 1


def test_a_rag_report_without_probe_records_is_refused(tmp_path, capsys):
    from promptsplice.benchmarks.cli import run_tool
    from promptsplice.benchmarks.deviation_curve import main

    old = tmp_path / "old.json"  # probes ran, but the report predates per-probe records
    old.write_text(json.dumps({"families": {"wiki": {"report": {"fidelity": {"steps": 8}}}}}))
    out = tmp_path / "r.json"
    assert run_tool(main, ["--rag-budget-sweep", str(old), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "8 probes but no per-probe records" in err and "re-run bench rag" in err and not out.exists()
    other = tmp_path / "raw.json"  # an agent --raw file is not a bench rag report
    other.write_text(json.dumps({"bounded": {"rows": []}}))
    assert run_tool(main, ["--rag-budget-sweep", str(other), "--json", str(out)]) == 2
    assert "not a bench rag report" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"families": {"wiki": _rag_family((0.01, 64), (0.002, 32))}}))
    assert main(["--rag-budget-sweep", str(good), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["wiki"]["steps"] == 2 and rep["from_report"] == str(good)
    assert rep["worst"]["largest_budget_every_family_meets"] == max(BUDGETS)  # both probes under the bar


def test_a_rag_deviation_sweep_sends_requests_over_the_threshold_exact():
    from promptsplice.benchmarks.deviation_curve import rag_budget_sweep

    def fam(*probes):
        return {"report": {"fidelity": {"steps": len(probes), "probes": [
            {"kl": kl, "relocated_tokens": t, "max_deviation": d} for kl, t, d in probes]}}}

    suite = {"families": {"a": fam((0.05, 100, 0.27), (0.001, 300, 0.1), (0.01, 100, 0.21)),
                          "b": fam((0.03, 100, 0.23), (0.002, 100, 0.12))}}
    rep = rag_budget_sweep(suite)
    a = {x["max_deviation"]: x for x in rep["a"]["deviation_sweep"]}
    assert a[0.22]["kl_max"] == 0.01 and a[0.22]["kept_share"] == 0.8  # the 0.27 request exact
    assert a[0.3]["kl_max"] == 0.05 and a[0.3]["kept_share"] == 1.0
    assert rep["a"]["largest_deviation_meeting_bar"] == 0.26 and rep["b"]["largest_deviation_meeting_bar"] == 0.22
    assert rep["a"]["spearman_max_deviation"] == 1.0
    assert rep["worst"]["largest_deviation_every_family_meets"] == 0.22  # the worst family decides


def test_a_rag_deviation_sweep_keeps_unprobed_requests_and_stops_at_the_guard_it_ran():
    """A probe with no measured deviation (it relocated only unprobed runs) dropped its
    family's whole deviation sweep; a report made with the guard on swept thresholds
    above it, where the probes' KL is the guarded one."""
    from promptsplice.benchmarks.deviation_curve import rag_budget_sweep

    probes = [{"kl": 0.05, "relocated_tokens": 100, "max_deviation": 0.21},
              {"kl": 0.001, "relocated_tokens": 100, "max_deviation": None},
              {"kl": 0.002, "relocated_tokens": 100, "max_deviation": 0.1}]
    rep = rag_budget_sweep({"fidelity": {"steps": 3, "probes": probes}})["trace"]
    by = {x["max_deviation"]: x for x in rep["deviation_sweep"]}
    assert by[0.2]["kept_share"] == round(2 / 3, 3) and by[0.2]["kl_max"] == 0.002  # the unprobed one kept
    guarded = rag_budget_sweep({"fidelity": {"steps": 3, "probes": probes}, "pic": {"run_max_deviation": 0.22}})
    assert max(x["max_deviation"] for x in guarded["trace"]["deviation_sweep"]) == 0.22


def test_every_configuration_is_one_a_runner_accepts_and_runs_what_its_name_says():
    """``r1`` asked for a 1e6 threshold, which runners refuse (the default run died
    after the engine started); ``r1`` and ``t=x`` ran 2 recomputed blocks (``bounded``'s)
    and ``r2`` carried the 0.25 guard."""
    from promptsplice.benchmarks.deviation_curve import config_kwargs
    from promptsplice.engine_adapters.runners._fidelity import RunnerFidelity

    def settings(config):
        kw = dict(config_kwargs(config))
        return RunnerFidelity(kw.pop("fidelity"), **kw).settings()

    r1, r2, t = settings("r1"), settings("r2"), settings(0.12)
    assert (r1.recompute_blocks, r1.max_deviation) == (1, 1.0)  # probes every recomputed block
    assert (r2.recompute_blocks, r2.max_deviation, r2.run_max_deviation) == (2, None, None)  # no guard
    assert (t.recompute_blocks, t.max_deviation) == (1, 0.12)
