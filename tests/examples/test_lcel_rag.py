"""The LCEL RAG example runs on the real engine, answers from its passages, and its
repeated question hits the cache (vLLM's own counters say so)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _words(text: str) -> set[str]:
    return {w.strip(".,?!:;'\"()").lower() for w in text.split()}


def _example():
    path = Path(__file__).resolve().parents[2] / "examples" / "lcel_rag.py"
    spec = importlib.util.spec_from_file_location("lcel_rag", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lcel_rag"] = mod  # pydantic resolves the retriever's field types there
    spec.loader.exec_module(mod)
    return mod


def test_the_example_chain_reads_from_the_prefix_cache(fresh_engine):
    mod = _example()
    q = mod.QUESTIONS
    assert q[0] == q[2]
    before = fresh_engine.counters()
    out = mod.run(fresh_engine, q[:3])
    counted = fresh_engine.counters().since(before)
    assert out[0][1] < out[0][0]  # the first call meets an empty cache (but for the prefix rule)
    bs = fresh_engine.block_size
    assert out[2][0] == out[0][0] and out[2][1] == (out[2][0] - 1) // bs * bs  # the same prompt again
    # cache_read is vLLM's own count: the chain's usage adds up to the engine's counters.
    assert sum(cached for _, cached, _ in out) == counted.prefix_cache_hits
    assert sum(tokens for tokens, _, _ in out) == counted.prefix_cache_queries
    # The answers are the model's (greedy): non-empty, on the question's topic, and the
    # repeated question, served from the cache, opens with the same words as the first.
    for (_, _, answer), question in zip(out, q):
        assert answer.strip()
        topic = {w for w in _words(question) if len(w) > 4}
        assert topic & _words(answer), (question, answer)
    assert out[2][2].split()[:5] == out[0][2].split()[:5], (out[0][2], out[2][2])


@pytest.mark.parametrize(("questions", "says"), [
    ("0", "must be >= 1, got 0"),  # asked nothing
    ("-1", "must be >= 1, got -1"),  # dropped the last question
    ("x", "'x' is not an int"),
    ("7", "at most 6"),  # asked 6, silently
])
def test_a_question_count_out_of_range_is_refused_before_the_engine_starts(monkeypatch, capsys, questions, says):
    mod = _example()

    def start(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr(mod, "EmbeddedEngine", start)
    with pytest.raises(SystemExit) as info:
        mod.main(["--questions", questions])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--questions" in err and says in err
