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
    assert report["engines"]["block_size"] == 32 and set(report["bound_checks"]) == {"local", "shared", "outage"}
    assert report["bound_checks"]["outage"]["bound_prefill_tokens"] == bound["shared_prefill"]
    assert "pair prefill shared/local" in format_shared_tier(report)
