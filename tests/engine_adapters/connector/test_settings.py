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
    from promptsplice.engine_adapters.connector import _settings
    from promptsplice.engine_adapters.connector._settings import weights_identity

    def folder(name, weights, extra=()):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors").write_bytes(weights)
        (d / "README.md").write_text(name)  # not a weight file: not read
        for n in extra:
            os.symlink(tmp_path / "nowhere", d / n)  # files vLLM does not load, dangling
        return str(d)

    base = bytes(range(256)) * 20_000  # 5 MB: 16 samples spread over it, and its tail
    step = (len(base) - _settings._WEIGHT_SAMPLE) // (_settings._WEIGHT_SAMPLES - 1)

    def edit(at):
        return base[:at] + bytes([base[at] ^ 1]) + base[at + 1:]

    a = folder("a", base)
    assert weights_identity(a) == weights_identity(folder("b", base, extra=["training_args.bin", "optimizer.pt"]))
    for at in (8 * step + 5, len(base) - 3):  # a layer in the middle, the last norm
        assert weights_identity(folder(f"at{at}", edit(at))) != weights_identity(a)
    # between two samples: not told apart (the documented limit; a fingerprint= says more)
    assert weights_identity(folder("between", edit(8 * step + _settings._WEIGHT_SAMPLE + 10))) == weights_identity(a)
    one = tmp_path / "m.gguf"
    one.write_bytes(b"GGUF" + bytes(100))
    assert weights_identity(str(one)) != weights_identity(a)
    # a Hugging Face cache snapshot: the blob's name is its content hash
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    snap = tmp_path / "hub" / "snapshots" / "c0ffee"
    snap.mkdir(parents=True)
    for name, digest in (("config.json", "1" * 64), ("model.safetensors", "2" * 64)):
        (blobs / digest).write_bytes(b"x")
        os.symlink(blobs / digest, snap / name)
    first = weights_identity(str(snap))
    (blobs / ("2" * 64)).write_bytes(b"y")  # same blob name: the same content by construction
    assert weights_identity(str(snap)) == first != weights_identity(a)
    assert weights_identity("org/model", "abc123") == "commit:abc123"
    assert weights_identity("org/model") == "unpinned"
