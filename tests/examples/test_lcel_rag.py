"""The LCEL RAG example runs on the real engine and its repeated question hits the cache."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def test_the_example_chain_reads_from_the_prefix_cache(fresh_engine):
    path = Path(__file__).resolve().parents[2] / "examples" / "lcel_rag.py"
    spec = importlib.util.spec_from_file_location("lcel_rag", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lcel_rag"] = mod  # pydantic resolves the retriever's field types there
    spec.loader.exec_module(mod)
    q = mod.QUESTIONS
    assert q[0] == q[2]
    out = mod.run(fresh_engine, q[:3])
    assert out[0][1] < out[0][0]  # the first call meets an empty cache (but for the prefix rule)
    bs = fresh_engine.block_size
    assert out[2][0] == out[0][0] and out[2][1] == (out[2][0] - 1) // bs * bs  # the same prompt again
    assert all(isinstance(a, str) for _, _, a in out)  # the answers themselves are the 135M model's
