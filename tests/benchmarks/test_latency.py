"""The latency bench's agent session: the hook's time per step beside tokenizing the prompt."""

from __future__ import annotations

import pytest

from promptsplice.benchmarks.latency import _agent_renders, main, run_hook_latency


def test_the_agent_session_grows_edits_and_is_deterministic():
    a, b = list(_agent_renders(30, 1)), list(_agent_renders(30, 1))
    assert a == b and len(a) == 30 and len(a[-1]) == 2 + 2 * 30
    masked = [m for m in a[-1] if m["role"] == "tool" and m["content"] == "[output masked]"]
    assert masked and all(1000 <= len(m["content"]) <= 5000 for m in a[-1] if m["role"] == "tool" and m not in masked)


def test_hook_latency_reports_each_mark_beside_tokenizing_the_prompt():
    r = run_hook_latency(12)
    assert list(r["steps"]) == ["10", "12"]
    ten, twelve = r["steps"]["10"], r["steps"]["12"]
    assert 0 < ten["prompt_tokens"] < twelve["prompt_tokens"]
    for m in (ten, twelve):
        assert m["hook_ms"] > 0 and m["tokenize_whole_ms"] > 0
        assert abs(m["hook_over_tokenize"] - m["hook_ms"] / m["tokenize_whole_ms"]) < 0.01 * m["hook_over_tokenize"] + 2e-3


def test_agent_steps_must_not_be_negative(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--agent-steps", "-1"])
    assert exc.value.code == 2 and "--agent-steps: must be >= 0, got -1" in capsys.readouterr().err
