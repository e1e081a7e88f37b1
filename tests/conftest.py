"""Shared fixtures: the real default tokenizer, request and assembler factories."""

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
