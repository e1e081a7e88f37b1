"""Shared pieces of the tests that drive a real engine with the splice connector."""

from __future__ import annotations

import itertools
from collections.abc import Callable

ENGINE_BLOCK = 32
"""The CPU engine's block size (vLLM-CPU takes multiples of 32)."""

_counter = itertools.count()


def salt_maker(prefix: str) -> Callable[[str], str]:
    """``salt(name)``: a cache salt no other request of the session uses, so each test
    starts from an empty prefix cache and store under its own tenant."""
    return lambda name: f"{prefix}{name}-{next(_counter)}"
