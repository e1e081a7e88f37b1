"""The connector's counters in vLLM's metrics: the worker reports what changed since its
last report (loads, saves, store hits), never a decrease; the stats sum per interval and
survive the dict vLLM sends between processes; the Prometheus counters count them per
engine.  The end-to-end path (``/metrics`` of a real ``vllm serve``) is in
``tests/engine_adapters/test_served_connector.py``."""

from __future__ import annotations

from types import SimpleNamespace

import prometheus_client
import pytest

from promptsplice.engine_adapters import chain_refs
from promptsplice.engine_adapters.connector._connector import SpliceConnector
from promptsplice.engine_adapters.connector._metrics import (
    COUNTERS,
    CounterReporter,
    SpliceConnectorStats,
    SplicePromMetrics,
)
from promptsplice.engine_adapters.connector._scheduler import LoadItem, SpliceMetadata
from promptsplice.engine_adapters.connector._worker import WorkerStats
from tests.engine_adapters.connector._kv import BS, SALT, fill_store, poisoned_caches, toks, worker


def test_a_load_reports_its_blocks_and_the_store_hits_once(store):
    prompt = toks(4 * BS)
    fill_store(store, prompt)
    w = worker(store, poisoned_caches())
    reporter = CounterReporter(store_every_s=0)
    reporter.take(w.stats, store)  # what filling the store counted
    refs = chain_refs(prompt, BS, salt=SALT)
    w.start_load(SpliceMetadata(loads=[LoadItem("r", SALT, tuple(refs[:3]), (0, 0, 0), (11, 3, 20), 0)]))
    stats = reporter.take(w.stats, store)
    assert stats is not None
    assert stats.data == {"loaded_blocks": 3, "store_dram_hits": 3}
    assert reporter.take(w.stats, store) is None  # nothing new: no stats sent with the step


def test_store_counters_come_with_the_step_that_used_the_store(store):
    """Read at most once a second, a short request's store hits reached /metrics only at
    a step a second later, on an idle server never (diff review): now with every step
    that loaded or saved, and otherwise once a second."""
    prompt = toks(2 * BS)
    fill_store(store, prompt)
    refs = chain_refs(prompt, BS, salt=SALT)
    reporter = CounterReporter(store_every_s=3600)
    stats = WorkerStats()
    reporter.take(stats, store)
    store.get(refs[0], salt=SALT)
    assert reporter.take(stats, store) is None  # an idle step: the store waits for its second
    stats.loaded_blocks = 1
    assert reporter.take(stats, store).data == {"loaded_blocks": 1, "store_dram_hits": 1}


def test_a_new_worker_counts_from_zero():
    """Caches registered again build a new worker with counters at 0: its loads were
    lost until they passed the old worker's highest values (diff review)."""
    reporter = CounterReporter()
    assert reporter.take(WorkerStats(loaded_blocks=10), None).data == {"loaded_blocks": 10}
    assert reporter.take(WorkerStats(loaded_blocks=3), None).data == {"loaded_blocks": 3}


def test_a_counter_that_went_down_is_reported_past_its_highest_value():
    reporter = CounterReporter()
    stats = WorkerStats(loaded_blocks=10)
    assert reporter.take(stats, None).data == {"loaded_blocks": 10}
    stats.loaded_blocks, stats.load_errors = 8, 2  # a deferred load failed late
    assert reporter.take(stats, None).data == {"load_errors": 2}
    stats.loaded_blocks = 11
    assert reporter.take(stats, None).data == {"loaded_blocks": 1}


def test_stats_sum_per_interval_and_cross_processes_as_a_dict():
    a = SpliceConnector.build_kv_connector_stats({"loaded_blocks": 3, "probe_seconds": 0.25})
    b = SpliceConnector.build_kv_connector_stats(SpliceConnectorStats(data={"loaded_blocks": 2}).to_dict())
    total = a.aggregate(b)
    assert total.reduce() == {"loaded_blocks": 5, "probe_seconds": 0.25}
    assert not total.is_empty() and SpliceConnector.build_kv_connector_stats(None).is_empty()
    total.reset()
    assert total.is_empty() and total.to_dict() == {}


def test_prometheus_counters_count_per_engine():
    registry = prometheus_client.CollectorRegistry()

    class Counter(prometheus_client.Counter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    types = {prometheus_client.Gauge: None, prometheus_client.Counter: Counter, prometheus_client.Histogram: None}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = SpliceConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(prom, SplicePromMetrics)
    prom.observe({"loaded_blocks": 3, "store_remote_hits": 2}, engine_idx=1)
    prom.observe({"loaded_blocks": 4, "not_ours": 9}, engine_idx=1)  # unknown names are ignored

    def value(name, engine):
        return registry.get_sample_value(f"vllm:promptsplice_{name}_total", {"model_name": "m", "engine": engine})

    assert (value("loaded_blocks", "1"), value("store_remote_hits", "1"), value("loaded_blocks", "0")) == (7, 2, 0)
    assert {m.name for m in registry.collect()} == {f"vllm:promptsplice_{n}" for n in COUNTERS}


@pytest.mark.parametrize("field", sorted(WorkerStats.__dataclass_fields__))
def test_every_worker_counter_is_exported(field):
    from promptsplice.engine_adapters.connector._metrics import worker_counters

    assert set(worker_counters(WorkerStats())) <= set(COUNTERS)
    stats = WorkerStats()
    setattr(stats, field, 5)
    assert 5 in worker_counters(stats).values(), f"WorkerStats.{field} is counted but not exported"


def test_misses_are_counted_when_the_lookup_ends(store, tmp_path):
    """``dram_misses - disk_hits`` read mid-lookup (DRAM missed, the disk read still
    running) counted a hit as a miss for good (second review): a tiered store's misses
    are its lower tiers' final answers."""
    from promptsplice.engine_adapters import BlockStore, StoreConfig
    from promptsplice.engine_adapters.connector._metrics import store_counters
    from tests.engine_adapters.connector._kv import PAYLOAD

    ref = chain_refs(toks(BS), BS, salt=SALT)[0]
    store.get(ref, salt=SALT)
    assert CounterReporter(store_every_s=0).take(WorkerStats(), store).data["store_misses"] == 1
    with BlockStore(StoreConfig(dram_bytes=4 * PAYLOAD, disk_bytes=64 * PAYLOAD, disk_dir=str(tmp_path),
                                write_behind_bytes=0)) as tiered:
        tiered.get(ref, salt=SALT)
        mid_lookup = tiered.stats()._replace(dram_misses=tiered.stats().dram_misses + 1)  # a read in flight
        assert store_counters(mid_lookup)["store_misses"] == 1
        assert CounterReporter(store_every_s=0).take(WorkerStats(), tiered).data["store_misses"] == 1


def test_engines_sharing_a_store_report_each_store_hit_once(store):
    """Each engine's reporter kept its own highest values, so every engine on a shared
    store reported all of the store's hits: A's 4 loads read 4 on A and 4 on B, 8 in
    all (a store review).  Now each increment goes to the reporter that reads it first."""
    prompt = toks(4 * BS)
    fill_store(store, prompt)
    a, b = CounterReporter(store_every_s=0), CounterReporter(store_every_s=0)
    a.take(WorkerStats(), store), b.take(WorkerStats(), store)  # what filling the store counted
    for ref in chain_refs(prompt, BS, salt=SALT):
        store.get(ref, salt=SALT)
    got_a, got_b = a.take(WorkerStats(), store), b.take(WorkerStats(), store)
    assert got_a.data == {"store_dram_hits": 4} and got_b is None
    store.get(chain_refs(prompt, BS, salt=SALT)[0], salt=SALT)
    assert b.take(WorkerStats(), store).data == {"store_dram_hits": 1}  # B reads the next one first
    assert a.take(WorkerStats(), store) is None


def test_misses_count_when_the_configured_disk_tier_did_not_open(tmp_path):
    """``tiered`` was read from the config: a disk folder that could not be opened left
    a DRAM-only store whose misses were never exported (``store_misses`` 0 of 4)."""
    from promptsplice.engine_adapters import BlockStore, StoreConfig
    from tests.engine_adapters.connector._kv import PAYLOAD

    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    cfg = StoreConfig(dram_bytes=4 * PAYLOAD, disk_bytes=64 * PAYLOAD, disk_dir=str(blocked / "kv"), write_behind_bytes=0)
    with BlockStore(cfg) as s:
        assert not s.tiered and not s.stats().disk_writable
        for ref in chain_refs(toks(4 * BS), BS, salt=SALT):
            s.get(ref, salt=SALT)
        assert s.stats().misses == 4
        assert CounterReporter(store_every_s=0).take(WorkerStats(), s).data["store_misses"] == 4


def test_a_mismatch_in_dram_is_a_miss_of_a_tiered_store(tmp_path):
    """It counted in ``dram_misses`` only, which a tiered store does not export."""
    import torch

    from promptsplice.engine_adapters import BlockStore, StoreConfig
    from promptsplice.engine_adapters.store import BlockRef, LookupStatus, Namespace
    from tests.engine_adapters.connector._kv import PAYLOAD

    key, parent = bytes(range(16)), bytes(16)
    cfg = StoreConfig(dram_bytes=4 * PAYLOAD, disk_bytes=64 * PAYLOAD, disk_dir=str(tmp_path), write_behind_bytes=0)
    with BlockStore(cfg) as s:
        assert s.tiered
        s.put(BlockRef(key, parent, [1, 2]), torch.zeros(4), salt="a", namespace=Namespace.CONTENT)
        assert s.get(BlockRef(key, parent, [1, 2]), salt="b", namespace=Namespace.CONTENT).status is LookupStatus.MISMATCH
        assert (s.stats().disk_misses, s.stats().mismatches, s.stats().misses) == (1, 1, 1)
        s.get(BlockRef(bytes(range(1, 17)), parent, [1, 2]), salt="a", namespace=Namespace.CONTENT)  # not stored
        assert s.stats().misses == 2 and s.stats().dram_misses == s.stats().disk_hits + s.stats().misses
        assert CounterReporter(store_every_s=0).take(WorkerStats(), s).data["store_misses"] == 2
