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


def test_the_weights_identity_tells_two_fine_tunes_at_one_path_apart(tmp_path):
    """The store fingerprint named the model by its path and revision (None for a local
    folder): two fine-tunes served from one path, or weights replaced under it, shared a
    disk or Redis tier and loaded each other's KV."""
    from promptsplice.engine_adapters.connector._settings import weights_identity

    def folder(name, weights):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors").write_bytes(weights)
        (d / "README.md").write_text(name)  # not a weight file: not read
        return str(d)

    base = bytes(range(256)) * 20_000  # 5 MB: head and tail sampled
    tuned = base[:3_000_000] + b"\x01" + base[3_000_001:]  # one byte in the middle differs...
    tuned_tail = base[:-5] + b"tuned"
    a, b, c = folder("a", base), folder("b", base), folder("c", tuned_tail)
    assert weights_identity(a) == weights_identity(b)  # the same files, wherever they are
    assert weights_identity(a) != weights_identity(c)
    assert weights_identity(folder("d", tuned)) == weights_identity(a)  # ...unread between the samples
    one = tmp_path / "m.gguf"
    one.write_bytes(b"GGUF" + bytes(100))
    assert weights_identity(str(one)) != weights_identity(a)
    assert weights_identity("org/model", "abc123") == "commit:abc123"
    assert weights_identity("org/model") == "unpinned"
