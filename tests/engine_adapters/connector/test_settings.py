"""What the connector reads from vLLM's config: the store config round trip through
``kv_connector_extra_config``."""

from __future__ import annotations

import os

import pytest

from promptsplice.engine_adapters import StoreConfig
from promptsplice.engine_adapters.connector._settings import store_config_from_extra, store_config_to_extra
from promptsplice.errors import ConfigError


def test_store_config_travels_in_the_extra_config():
    cfg = StoreConfig(dram_bytes=1 << 20, disk_bytes=1 << 22, disk_dir="/tmp/x", fingerprint="mine")
    extra = store_config_to_extra(cfg)
    back = store_config_from_extra(extra, fingerprint="engine")
    assert back.fingerprint == "engine|mine" and back.disk_dir == cfg.disk_dir
    assert store_config_from_extra({"dram_bytes": 5}, fingerprint="e").fingerprint == "e"
    with pytest.raises(ConfigError, match="unknown keys"):
        store_config_from_extra({"dram_bytes": 5, "size": 1})
    with pytest.raises(ConfigError, match="dram_bytes"):
        store_config_from_extra({})
    assert os.path.isabs(back.disk_dir)


def test_a_kv_transfer_config_that_fails_requests_on_a_load_error_is_refused():
    """vLLM's default ``kv_load_failure_policy`` is "fail": a hand-written
    ``--kv-transfer-config`` without the field ended every request whose load failed (a
    damaged record, the connector's own fallback) with an error instead of recomputing."""
    import json

    from vllm.config import KVTransferConfig

    from promptsplice.engine_adapters.connector._settings import check_load_failure_policy, kv_transfer_config_json

    hand_written = KVTransferConfig(kv_connector="SpliceConnector", kv_role="kv_both")
    with pytest.raises(ConfigError, match="kv_load_failure_policy='recompute' in kv_transfer_config, got 'fail'"):
        check_load_failure_policy(hand_written)
    ours = KVTransferConfig(**json.loads(kv_transfer_config_json(StoreConfig(dram_bytes=1 << 20))))
    check_load_failure_policy(ours)  # (ours sets it)
    assert ours.kv_load_failure_policy == "recompute"
    check_load_failure_policy(None)  # no kv_transfer_config: no connector loads
