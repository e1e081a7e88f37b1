"""The connector's counters in vLLM's own metrics: the periodic ``KV Transfer metrics:``
log line and Prometheus counters ``vllm:promptsplice_<name>_total`` on ``/metrics``.

vLLM asks the worker-side connector for its stats after every step
(``get_kv_connector_stats``), sends them with the step's output to the scheduler and on
to the front end, which sums them per logging interval (:class:`SpliceConnectorStats`)
and hands each step's to the Prometheus logger (:class:`SplicePromMetrics`).  The
worker reports what changed since its last report (:class:`CounterReporter`): its own
counters every step (no lock), the block store's with every step that loaded or saved
anything and otherwise at most once a second (they take the store's lock).  A counter that went down (a load counted, then failed late) is reported
as it climbs back past its highest value, so the exported counters never decrease.

The store's counters are the store's: engines of one process opened on the same
``StoreConfig`` share one store, and each increment is reported once, by whichever of
them reads it first (the highest values reported are kept per store, not per engine:
per engine, every sharing engine reported all of the store's hits, so totals summed
over engines were N times the store's own).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from promptsplice.engine_adapters.connector._worker import WorkerStats
    from promptsplice.engine_adapters.store._store import BlockStore
    from promptsplice.engine_adapters.store._types import StoreStats

__all__ = ["COUNTERS", "CounterReporter", "SpliceConnectorStats", "SplicePromMetrics"]

COUNTERS: dict[str, str] = {
    # the worker side (WorkerStats)
    "loaded_blocks": "Blocks loaded from the block store into vLLM's paged cache.",
    "relocated_blocks": "Loaded blocks of approximate KV: moved, or in place after other tokens.",
    "load_errors": "Blocks that failed to load (vLLM recomputed them).",
    "saved_blocks": "Blocks saved to the block store (or found there already).",
    "save_errors": "Blocks a save could not store (an error, or the store refused them).",
    "skipped_saves": "Blocks not saved because their step's forward pass failed.",
    "quarantined_saves": "Blocks not saved because a load failed in their step or the step before.",
    "late_layers": "Deferred layer loads nothing waited for (their blocks became load errors).",
    "probed_blocks": "Recomputed blocks compared with their relocated old KV.",
    "probe_seconds": "Host time spent on those comparisons.",
    # the block store (StoreStats)
    "store_dram_hits": "Block-store lookups served from DRAM.",
    "store_disk_hits": "Block-store lookups served from the disk tier.",
    "store_remote_hits": "Block-store lookups served from the shared (Redis) tier.",
    "store_misses": "Block-store lookups no tier served (counted when the last tier answered).",
    "store_evictions": "Blocks evicted from DRAM or disk.",
    "store_dropped": "Blocks let go without a copy because no tier could take them.",
    "store_damaged": "Damaged records (disk or shared tier) deleted, not served.",
    "store_write_errors": "Failed writes to the disk or shared tier.",
    "remote_outages": "Times the shared tier's server went out of reach.",
    "remote_skipped": "Writes to the shared tier not attempted (out of reach, or queue full).",
}
"""Every counter the connector exports, with its help text."""

_WORKER_FIELDS = {
    "loaded_blocks": "loaded_blocks",
    "relocated_blocks": "relocated_blocks",
    "load_errors": "load_errors",
    "saved_blocks": "saved_blocks",
    "save_errors": "save_errors",
    "skipped_saves": "skipped_saves",
    "quarantined_saves": "quarantined_saves",
    "late_layers": "late_layers",
    "probed_blocks": "probed_blocks",
    "probe_seconds": "probe_s",
}


def worker_counters(stats: WorkerStats) -> dict[str, float]:
    """The worker's cumulative counters under their exported names."""
    return {name: getattr(stats, field) for name, field in _WORKER_FIELDS.items()}


def store_counters(s: StoreStats) -> dict[str, float]:
    """The store's cumulative counters under their exported names (``disk_hits`` of
    :class:`StoreStats` counts every storage tier; here each tier has its own).
    Misses are the lookups no tier served, counted when the lookup ends (DRAM's are
    counted before a tier read, which may still hit; which tier's count to read
    changed in a forked child, whose store has no tiers below DRAM)."""
    return {
        "store_dram_hits": s.dram_hits,
        "store_disk_hits": s.disk_hits - s.remote_hits,
        "store_remote_hits": s.remote_hits,
        "store_misses": s.misses,
        "store_evictions": s.dram_evictions + s.disk_evictions,
        "store_dropped": s.dropped,
        "store_damaged": s.corrupt + s.remote_corrupt,
        "store_write_errors": s.write_errors + s.remote_write_errors,
        "remote_outages": s.remote_outages,
        "remote_skipped": s.remote_skipped,
    }


# The store counters' highest values reported, per store (shared by its engines' reporters).
_STORE_HIGH: weakref.WeakKeyDictionary[BlockStore, dict[str, float]] = weakref.WeakKeyDictionary()
_STORE_HIGH_LOCK = threading.Lock()


class CounterReporter:
    """What changed since the last report, as a :class:`SpliceConnectorStats`, or
    ``None`` when nothing did (vLLM then sends no stats with the step)."""

    def __init__(self, store_every_s: float = 1.0) -> None:
        self._high: dict[str, float] = {}
        self._stats: WorkerStats | None = None
        self._store_every_s = store_every_s
        self._store_due = 0.0

    def take(self, worker: WorkerStats, store: BlockStore | None) -> SpliceConnectorStats | None:
        if worker is not self._stats:  # a new worker (caches registered again) counts from 0
            self._stats = worker
            for name in _WORKER_FIELDS:
                self._high.pop(name, None)
        delta = self._rise(worker_counters(worker))
        if store is not None and not store.closed and (delta or time.monotonic() >= self._store_due):
            now = store_counters(store.stats())
            with _STORE_HIGH_LOCK:
                delta.update(_rise(_STORE_HIGH.setdefault(store, {}), now))
            self._store_due = time.monotonic() + self._store_every_s
        return SpliceConnectorStats(data=delta) if delta else None

    def _rise(self, now: dict[str, float]) -> dict[str, float]:
        return _rise(self._high, now)


def _rise(highs: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """What of ``now`` lies above ``highs`` (which it raises): never a decrease."""
    delta: dict[str, float] = {}
    for name, value in now.items():
        high = highs.get(name, 0)
        if value > high:
            delta[name] = value - high
            highs[name] = value
    return delta


class SpliceConnectorStats(KVConnectorStats):
    """Counter increments, flat ``{name: amount}`` (it crosses processes as a dict)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class SplicePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry, a child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for name, doc in COUNTERS.items():
            # The "vllm:" prefix: vLLM unregisters its metrics by that prefix when the
            # next engine of the process starts, so a second engine can register them.
            counter = self._counter_cls(name=f"vllm:promptsplice_{name}", documentation=doc,
                                        labelnames=labelnames)
            for idx, values in per_engine_labelvalues.items():
                self._counters[(idx, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            child = self._counters.get((engine_idx, name))
            if child is not None and value > 0:
                child.inc(value)
