"""promptsplice.benchmarks.side_channel on the real engine: the cache signal it measures is there
without salts and gone with them (cached tokens; the timings are the bench's to report)."""

from __future__ import annotations

import pytest

from promptsplice.benchmarks.side_channel import DOC_TOKENS, run


@pytest.mark.reliability
def test_a_right_guess_hits_the_victims_blocks_only_without_salts(fresh_engine, measured):
    report = run(fresh_engine, reps=2)
    assert report["guess_tokens"] > DOC_TOKENS and report["shared_prefix_tokens"] >= DOC_TOKENS
    shared, salted = report["settings"]["shared"], report["settings"]["salted"]
    assert shared["cached_tokens"] == {"right": [DOC_TOKENS], "wrong": [0]}
    assert salted["cached_tokens"] == {"right": [0], "wrong": [0]}
    assert set(shared) == set(salted) == {"ttft_p50_ms", "right_over_wrong", "cached_tokens", "threshold_accuracy"}
    measured.update(shared_right_cached=DOC_TOKENS, salted_right_cached=0)
