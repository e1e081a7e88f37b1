"""The coding-agent trace family: valid traces, deterministic, long outputs, every edit
kind, renders within the model's context."""

from __future__ import annotations

import json

import pytest

from promptsplice.assembler import ContextHook
from promptsplice.benchmarks.agent_traces import MASK_PLACEHOLDER, read_agent_trace, trace_summary, write_agent_trace
from promptsplice.benchmarks.agent_traces_coding import generate_coding_trace
from promptsplice.errors import ConfigError


@pytest.fixture(scope="module")
def trace():
    return generate_coding_trace(4, seed=3)


def test_it_round_trips_and_is_deterministic(trace, tmp_path):
    path = tmp_path / "c.jsonl"
    write_agent_trace(path, trace)
    assert read_agent_trace(path) == trace  # the strict reader accepts it unchanged
    again = generate_coding_trace(4, seed=3)
    assert [s.renders for s in again] == [s.renders for s in trace]
    assert [s.renders for s in generate_coding_trace(4, seed=4)] != [s.renders for s in trace]


def test_long_outputs_and_every_edit_kind(trace):
    summary = trace_summary(trace)
    kinds = summary["kinds"]
    assert kinds["first"] == 4 and kinds["other"] == 0
    for k in ("append", "truncate", "mask", "summarize", "drop"):
        assert kinds[k] >= 1, (k, kinds)
    outputs = [m["content"] for s in trace for r in s.renders for m in r if m["role"] == "tool"]
    assert max(o.count("\n") for o in outputs) >= 100  # file reads and test logs of hundreds of lines
    assert MASK_PLACEHOLDER in outputs


def test_renders_fit_the_models_context(trace, default_tok):
    longest = 0
    for s in trace:
        hook = ContextHook(default_tok, block_size=32)
        for r in s.renders:
            longest = max(longest, len(hook(s.id, r, s.tools).token_ids))
    assert 3000 < longest < 8192  # long contexts, within SmolLM2's 8,192


def test_bad_arguments():
    with pytest.raises(ConfigError, match="num_sessions"):
        generate_coding_trace(0)
    with pytest.raises(ConfigError, match="max_chars"):
        generate_coding_trace(1, max_chars=100)


def test_the_cli_writes_a_coding_trace(tmp_path, capsys):
    from promptsplice.benchmarks.cli import main

    out = tmp_path / "t.jsonl"
    assert main(["bench", "gen-agent-trace", "--family", "coding", "--sessions", "2", "--out", str(out)]) == 0
    assert len(read_agent_trace(out)) == 2
    assert json.loads(capsys.readouterr().out.splitlines()[0])["sessions"] == 2
    assert main(["bench", "gen-agent-trace", "--family", "nope", "--out", str(out)]) == 2
