"""The optional C core of dedup's searches (``dedup/_speedups.c``), or ``None``.

``setup.py`` builds it as an optional extension; without a C compiler the package
installs anyway and the passes run their pure-Python searches, which give the same
results (tests/dedup/test_speedups.py compares the two).  The passes read ``core`` at
call time, so tests switch it off by setting it to ``None``.
"""

from __future__ import annotations

__all__ = ["core"]

try:
    from . import _speedups as core
except ImportError:  # pragma: no cover - a machine without a C compiler
    core = None
