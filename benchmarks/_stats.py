"""What every bench shares: the one percentile rule (``*_p50``, ``*_p90``, ``*_p10``, ...),
the sample size below which a percentile is an extreme (:func:`min_sample`), and the
capacity shape of an engine that modes at equal capacity must share
(:func:`capacity_shape`), and the report a run that raised writes (:func:`error_report`).

Nearest rank: the smallest value with at least ``q`` of the values at or below it,
``sorted(values)[ceil(q * n) - 1]``.  Each bench had its own rule (``int(q * n)``,
``round(q * (n - 1))``), so one field meant another order statistic in each report,
p90 of 10 probes was their maximum and p10 hid the worst probe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["percentile", "min_sample", "sample_flags", "capacity_shape", "error_report"]


def error_report(trace: Any, exc: BaseException) -> dict[str, Any]:
    """The JSON a bench writes when its run raised (a probe that failed its check, an
    engine error): ``{"trace", "error": {"type", "message"}}``, so a ``--json`` file never
    holds an earlier run's report."""
    return {"trace": str(trace), "error": {"type": type(exc).__name__, "message": str(exc)}}


def _rank(q: float, n: int) -> int:
    """1-based nearest rank of the ``q`` quantile of ``n`` values."""
    return min(n, max(1, math.ceil(q * n)))


def percentile(values: Sequence[float], q: float, empty: float | None = 0.0) -> float | None:
    """The nearest-rank ``q`` quantile of ``values`` (``q`` in [0, 1]); ``empty`` for none."""
    if not values:
        return empty
    s = sorted(values)
    return s[_rank(q, len(s)) - 1]


def min_sample(q: float) -> int:
    """The fewest values whose nearest-rank ``q`` quantile (``0 < q < 1``) is neither
    their minimum nor their maximum: below it a ``p90`` is the max (10 values needed),
    a ``p10`` the min (11), a ``p99`` the max (100), a ``p50`` an extreme (3)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must lie strictly between 0 and 1, got {q!r}")
    n = 3
    while not 2 <= _rank(q, n) <= n - 1:
        n += 1
    return n


def sample_flags(n: int, quantiles: Mapping[str, float]) -> dict[str, Any]:
    """``{"small_sample", "percentile_min_n"}`` for a report of ``n`` values whose fields
    ``quantiles`` (name -> q) are nearest-rank percentiles: ``small_sample`` is true when
    some field rests on fewer values than :func:`min_sample` asks (it is then an extreme
    of the sample, not a percentile)."""
    need = {name: min_sample(q) for name, q in quantiles.items()}
    return {"small_sample": any(n < m for m in need.values()), "percentile_min_n": need}


def capacity_shape(engine: Any, *, store: bool = True) -> dict[str, Any]:
    """Every setting that sets what an engine can cache, for equal-capacity guards: KV
    blocks and block size, dtype, prefix caching, context length and (``store``) the
    block store's tier sizes, the shared (remote) tier included (``None`` without a
    store).  Two modes at equal capacity have equal shapes."""
    cfg = engine.config
    shape: dict[str, Any] = {
        "num_blocks": engine.num_blocks,
        "block_size": engine.block_size,
        "dtype": cfg.dtype,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "max_model_len": engine.max_model_len,
    }
    if store:
        kv = cfg.kv_store
        shape["kv_store"] = None if kv is None else {
            "dram_bytes": kv.dram_bytes, "disk_bytes": kv.disk_bytes, "remote_bytes": kv.remote_bytes,
            "remote_tier": kv.remote_bytes > 0 and bool(getattr(kv, "remote_url", None)),
        }
    return shape
