"""The one percentile every bench reports (``*_p50``, ``*_p90``, ``*_p10``, ...).

Nearest rank: the smallest value with at least ``q`` of the values at or below it,
``sorted(values)[ceil(q * n) - 1]``.  Each bench had its own rule (``int(q * n)``,
``round(q * (n - 1))``), so one field meant another order statistic in each report,
p90 of 10 probes was their maximum and p10 hid the worst probe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile"]


def percentile(values: Sequence[float], q: float, empty: float = 0.0) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (``q`` in [0, 1]); ``empty`` for none."""
    if not values:
        return empty
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
