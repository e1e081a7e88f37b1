"""The shared-tier bench on a real pair of engines and a real Redis (tiny trace).

The numbers of the issue come from a larger run (README); here: the bench's accounting
holds, sharing prefills less than the salted pair, and an outage fails no request and
changes no output.
"""

from __future__ import annotations

import pytest

from promptsplice.benchmarks.shared_tier import _leading_run, format_shared_tier, run_shared_tier_bench
from promptsplice.errors import ConfigError


def test_leading_run_counts_the_known_prefix_only():
    assert _leading_run([b"a", b"b", b"c"], {b"a", b"b"}) == 2
    assert _leading_run([b"a", b"b", b"c"], {b"b", b"c"}) == 0
    assert _leading_run([], {b"a"}) == 0


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
    assert "pair prefill shared/local" in format_shared_tier(report)
