"""The worker's device-generic paths on CPU tensors in vLLM's GPU cache layouts
(FlashAttention 5-D, FlashInfer 5-D, the unified 4-D): per-layer deferred loads written
only when their layer is waited on, saves through the pending queue, the platform and
backend decision of ``connector_backend``, and a platform that cannot pin memory."""

from __future__ import annotations

import pytest
import torch

from promptsplice.engine_adapters import BlockStore, StoreConfig, chain_refs
from promptsplice.engine_adapters.connector._scheduler import LoadItem, SaveItem, SpliceMetadata
from promptsplice.engine_adapters.connector._settings import (
    CONNECTOR_BACKENDS,
    check_single_worker,
    connector_backend,
    connector_settings,
)
from promptsplice.engine_adapters.connector._worker import SpliceWorker, _DeviceIO
from promptsplice.errors import ConfigError
from promptsplice.kernels import RopeConfig, rotate_keys

BS, HEADS, HD, LAYERS, NB = 16, 2, 64, 3, 10
ROPE = RopeConfig(head_size=HD, rotary_dim=HD, theta=100000.0)
SALT = "t"


def caches(layout: str, fill: torch.Generator | None):
    out = {}
    for i in range(LAYERS):
        if layout == "FLASH_ATTN":
            t = torch.empty(2, NB, BS, HEADS, HD, dtype=torch.bfloat16)
        elif layout == "FLASHINFER":
            t = torch.empty(NB, 2, BS, HEADS, HD, dtype=torch.bfloat16)
        else:
            t = torch.empty(NB, BS, HEADS, 2 * HD, dtype=torch.bfloat16).permute(0, 2, 1, 3)
        t.copy_(torch.randn(t.shape, generator=fill) if fill is not None else torch.full(t.shape, float("nan")))
        out[f"l{i}"] = t
    return out


@pytest.fixture
def store():
    with BlockStore(StoreConfig(dram_bytes=1 << 24, write_behind_bytes=0)) as s:
        yield s


@pytest.mark.parametrize("layout", ["FLASH_ATTN", "FLASHINFER", "UNIFIED"])
def test_per_layer_load_writes_each_layer_when_waited_on(store, layout):
    backend = "FLASHINFER" if layout == "FLASHINFER" else "FLASH_ATTN"
    src, dst = caches(layout, torch.Generator().manual_seed(3)), caches(layout, None)
    saver = SpliceWorker(store, block_size=BS, caches=src, backend=backend, rope=ROPE)
    loader = SpliceWorker(store, block_size=BS, caches=dst, backend=backend, rope=ROPE)
    refs = tuple(chain_refs(list(range(3 * BS)), BS, salt=SALT))
    assert saver.save(SpliceMetadata(saves=[SaveItem("s", SALT, refs, (1, 6, 4))])) == 3
    assert saver.pending_saves == 0
    deltas, dst_ids = (0, 500, -77), (9, 0, 3)
    loader.start_load(SpliceMetadata(loads=[LoadItem("r", SALT, refs, deltas, dst_ids, 0)]), per_layer=True)
    assert all(torch.isnan(c).all() for c in dst.values())  # nothing written yet
    layout_obj = loader.paged.layout
    for name in dst:
        loader.wait_for_layer(name)
        ks, vs = layout_obj.kv_views(src[name])
        kd, vd = layout_obj.kv_views(dst[name])
        ref = rotate_keys(ks[[1, 6, 4]].double(), torch.tensor(deltas).reshape(-1, 1, 1), ROPE)
        got = kd[list(dst_ids)].double()
        assert float(((got - ref).abs() / (ref.abs() * 2.0**-8 + 1e-6)).max()) <= 1.0
        assert torch.equal(vd[list(dst_ids)], vs[[1, 6, 4]])
        assert torch.isnan(kd[[2, 5]]).all() and torch.isnan(vd[[2, 5]]).all()
    later = list(dst)[-1]
    assert not torch.isnan(dst[later]).all()
    loader.finish_loads()  # idempotent: every layer is written once
    assert loader.take_load_errors() == set() and loader.stats.relocated_blocks == 2


def test_a_save_finishes_deferred_loads_first(store):
    src, dst = caches("UNIFIED", torch.Generator().manual_seed(4)), caches("UNIFIED", None)
    saver = SpliceWorker(store, block_size=BS, caches=src, backend="FLASH_ATTN", rope=ROPE)
    loader = SpliceWorker(store, block_size=BS, caches=dst, backend="FLASH_ATTN", rope=ROPE)
    refs = tuple(chain_refs(list(range(BS)), BS, salt=SALT))
    saver.save(SpliceMetadata(saves=[SaveItem("s", SALT, refs, (2,))]))
    loader.start_load(SpliceMetadata(loads=[LoadItem("r", SALT, refs, (0,), (5,), 0)]), per_layer=True)
    loader.save(SpliceMetadata())  # the forward pass is over: no layer may stay unwritten
    for name in dst:
        assert torch.equal(dst[name][5], src[name][2])
    # ... but it ran without them: the block is a load error (recomputed), never served
    assert loader.take_load_errors() == {5}
    assert loader.stats.late_layers == len(dst) and loader.stats.loaded_blocks == 0


def test_a_layer_whose_hook_never_came_is_recomputed_and_not_saved(store):
    src, dst = caches("UNIFIED", torch.Generator().manual_seed(6)), caches("UNIFIED", None)
    saver = SpliceWorker(store, block_size=BS, caches=src, backend="FLASH_ATTN", rope=ROPE)
    loader = SpliceWorker(store, block_size=BS, caches=dst, backend="FLASH_ATTN", rope=ROPE)
    refs = tuple(chain_refs(list(range(2 * BS)), BS, salt=SALT))
    saver.save(SpliceMetadata(saves=[SaveItem("s", SALT, refs, (2, 3))]))
    loader.start_load(SpliceMetadata(loads=[LoadItem("r", SALT, refs[:1], (7,), (5,), 0)]), per_layer=True)
    names = list(dst)
    for name in names[:-1]:  # vLLM skipped the last layer's wait_for_layer_load
        loader.wait_for_layer(name)
    loader.save(SpliceMetadata(saves=[SaveItem("r", SALT, refs[1:], (6,))]))
    assert loader.take_load_errors() == {5}
    assert (loader.stats.late_layers, loader.stats.load_errors, loader.stats.saved_blocks) == (1, 1, 0)
    assert (loader.stats.loaded_blocks, loader.stats.relocated_blocks) == (0, 0)
    # every layer waited on: no error, the next step saves
    loader.start_load(SpliceMetadata(loads=[LoadItem("q", SALT, refs[:1], (0,), (8,), 0)]), per_layer=True)
    for name in names:
        loader.wait_for_layer(name)
    loader.save(SpliceMetadata(saves=[SaveItem("q", SALT, refs[1:], (6,))]))
    assert loader.take_load_errors() == set() and loader.stats.late_layers == 1
    assert loader.stats.loaded_blocks == 1


def test_a_deferred_load_that_fails_is_a_load_error(store):
    src, dst = caches("UNIFIED", torch.Generator().manual_seed(5)), caches("UNIFIED", None)
    saver = SpliceWorker(store, block_size=BS, caches=src, backend="FLASH_ATTN", rope=ROPE)
    loader = SpliceWorker(store, block_size=BS, caches=dst, backend="FLASH_ATTN", rope=ROPE)
    refs = tuple(chain_refs(list(range(BS)), BS, salt=SALT))
    saver.save(SpliceMetadata(saves=[SaveItem("s", SALT, refs, (2,))]))
    # A destination out of the cache's range is refused by the kernel at the layer's turn.
    loader.start_load(SpliceMetadata(loads=[LoadItem("r", SALT, refs, (5,), (NB + 3,), 0)]), per_layer=True)
    loader.wait_for_layer("l0")
    assert loader.take_load_errors() == {NB + 3}
    loader.save(SpliceMetadata(saves=[SaveItem("r", SALT, refs, (NB + 3,))]))  # a failed request is not saved
    assert loader.stats.saved_blocks == 0 and loader.stats.load_errors == 1
    assert (loader.stats.loaded_blocks, loader.stats.relocated_blocks) == (0, 0)


def test_the_connector_reads_these_backends_and_refuses_others_by_name():
    assert connector_backend("cpu", None) == "CPU_ATTN"
    assert connector_backend("cuda", None) == "auto" == connector_backend("cuda", "auto")
    assert connector_backend("cuda", "flash_attn") == "FLASH_ATTN"

    class Enum:  # vLLM's AttentionBackendEnum member: its name is the backend's
        name = "FLASHINFER"

    assert connector_backend("cuda", Enum()) == "FLASHINFER"
    with pytest.raises(ConfigError, match="'TRITON_ATTN' on cuda.*FLASH_ATTN, FLASHINFER"):
        connector_backend("cuda", "TRITON_ATTN")
    with pytest.raises(ConfigError, match="'FLASH_ATTN' on cpu.*CPU_ATTN"):
        connector_backend("cpu", "FLASH_ATTN")
    with pytest.raises(ConfigError, match="platform 'rocm'"):
        connector_backend("rocm", None)
    assert set(CONNECTOR_BACKENDS) == {"cpu", "cuda"}


def test_tensor_or_pipeline_parallel_engines_are_refused_naming_the_setting():
    """Each rank would file its slice of a block under the same chain key (and the
    shared tier hand one rank's heads to another): refused before anything is opened."""
    from types import SimpleNamespace

    check_single_worker(SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=4))
    with pytest.raises(ConfigError, match="tensor_parallel_size=2: the connector runs with one worker"):
        check_single_worker(SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))
    with pytest.raises(ConfigError, match="tensor_parallel_size=2, pipeline_parallel_size=2"):
        check_single_worker(SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="pipeline_parallel_size=4"):
        connector_settings(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                                           pipeline_parallel_size=4)))
    # one worker in another process than the scheduler ("mp"): each half had its own
    # store and nothing saved was ever found, silently
    for backend in (None, "uni", "external_launcher"):
        check_single_worker(SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                            distributed_executor_backend=backend))
    for backend in ("mp", "ray"):
        with pytest.raises(ConfigError, match=f"distributed_executor_backend='{backend}' runs the worker"):
            check_single_worker(SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                distributed_executor_backend=backend))


def test_a_worker_for_another_backend_is_refused_by_name(store):
    with pytest.raises(ConfigError, match="'TRITON_ATTN'"):
        SpliceWorker(store, block_size=BS, caches=caches("UNIFIED", None), backend="TRITON_ATTN", rope=ROPE)


def test_cuda_caches_need_pinned_host_memory():
    if torch.cuda.is_available():
        io = _DeviceIO(torch.device("cuda"))
        assert io.side is not None and io.host_empty((2,), torch.bfloat16).is_pinned()
    else:  # torch without CUDA cannot pin host memory: a platform the store cannot serve
        with pytest.raises(ConfigError, match="cannot pin memory"):
            _DeviceIO(torch.device("cuda"))
