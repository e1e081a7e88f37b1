"""The optional C core of dedup's searches (``dedup/_speedups.c``), or ``None``.

``setup.py`` builds it as an optional extension; without a C compiler the package
installs anyway and the passes run their pure-Python searches, which give the same
results (tests/dedup/test_speedups.py compares the two).  The passes read ``core`` at
call time, so tests switch it off by setting it to ``None``.  pip hides the build's own
warning, so a missing core says so once, at import, as a ``RuntimeWarning``.
"""

from __future__ import annotations

import warnings

__all__ = ["core"]

try:
    from . import _speedups as core
except ImportError:  # a machine without a C compiler (tests/dedup/test_speedups.py)
    core = None
    warnings.warn(
        "promptsplice.dedup: the optional C core (promptsplice.dedup._speedups) is not built, "
        "so dedup runs its pure-Python searches: the same results, slower on large requests "
        "(promptsplice.dedup.ACCELERATED is False). To build it, install a C compiler (e.g. "
        "`apt install gcc` or `xcode-select --install`) and reinstall promptsplice; install with "
        "PROMPTSPLICE_REQUIRE_C_CORE=1 to make a failed build an error. To silence this: "
        "warnings.filterwarnings('ignore', message='promptsplice.dedup: the optional C core').",
        RuntimeWarning,
        stacklevel=2,
    )
