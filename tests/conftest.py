"""Shared fixtures: the real default tokenizer, ONE real vLLM engine per session, and
factories for requests and assemblers.

``start_default_engine()`` is the one way the tests start an engine, so the whole
session starts a single one (~4 s, ~1 GiB of RAM) and every test folder shares it.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_tok():
    """SmolLM2-135M-Instruct's tokenizer (the real default; converted once by setup)."""
    from assembler import default_tokenizer

    return default_tokenizer()


@pytest.fixture
def make_assembler(default_tok):
    """Factory for fresh assemblers on the default tokenizer."""
    from assembler import Assembler

    def make(**kwargs):
        kwargs.setdefault("block_size", 16)
        return Assembler(kwargs.pop("tokenizer", default_tok), **kwargs)

    return make



def start_default_engine(**overrides):
    """The default model on vLLM in this process: block 32 on CPU, 512 MiB of KV cache
    (728 blocks of 32 tokens), max_model_len 4096, greedy sampling by default."""
    from engine_adapters import EmbeddedEngine

    return EmbeddedEngine(**overrides)


@pytest.fixture(scope="session")
def engine():
    """The session's engine (shared: tests that need an empty cache use fresh_engine)."""
    eng = start_default_engine()
    yield eng
    eng.close()


@pytest.fixture
def fresh_engine(engine):
    """The session's engine with an empty prefix cache (and empty engine mirrors)."""
    engine.reset_prefix_cache()
    return engine


@pytest.fixture(scope="session")
def rag_requests():
    """The demo's built-in RAG sample: 40 requests (repeat-heavy: chunks recur)."""
    from benchmarks.traces import sample_rag_requests

    return sample_rag_requests(40)
