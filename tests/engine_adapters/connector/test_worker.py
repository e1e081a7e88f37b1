"""The connector's worker side on plain tensors laid out like vLLM's CPU_ATTN cache
(poisoned first): saves of every layer, offload loads bit for bit, relocating loads
(K rotated, V copied), kernel blocks smaller than vLLM's, load errors by block id, and
the KV layout read from the backend's name."""

from __future__ import annotations

import pytest
import torch

from promptsplice.blocks import chain_hashes
from promptsplice.engine_adapters import BlockStore, LookupStatus, StoreConfig, chain_refs
from promptsplice.engine_adapters.connector._scheduler import (
    LoadItem,
    SaveItem,
    SpliceMetadata,
    SpliceScheduler,
    plan_load,
)
from promptsplice.errors import ConfigError
from promptsplice.kernels import CpuAttnAmxLayout, gather_blocks, rotate_keys
from tests.engine_adapters.connector._kv import (
    BS,
    HD,
    HEADS,
    LAYERS,
    LAYOUT,
    NB,
    PAYLOAD,
    ROPE,
    SALT,
    deletion_case,
    fill_store,
    poisoned_caches,
    random_caches,
    toks,
    worker,
)


def test_save_stores_exactly_the_blocks_of_every_layer(store):
    caches = random_caches()
    w = worker(store, caches)
    prompt = toks(3 * BS)
    refs = chain_refs(prompt, BS, salt=SALT)
    assert w.save(SpliceMetadata(saves=[SaveItem("r", SALT, tuple(refs), (7, 2, 19))])) == 3
    for ref, b in zip(refs, (7, 2, 19)):
        got = store.get(ref, salt=SALT)
        assert got.status is LookupStatus.HIT_DRAM and got.payload.shape == (LAYERS, 1, HEADS, BS, 2 * HD)
        for layer, cache in enumerate(caches.values()):
            assert torch.equal(got.payload[layer], gather_blocks(LAYOUT, cache, [b]))
    assert w.stats.saved_blocks == 3


def test_saves_still_copying_reach_the_store_when_settled(store):
    """On CUDA a save's host copy completes after the step: the blocks reach the store
    at a later poll, or at ``settle`` (a finished request), which waits for the copy.
    The copy's event is the one stand-in here: it completes only when waited on."""
    caches = random_caches()
    w = worker(store, caches)
    w.io.done = lambda ev, *, block: block  # in flight until someone waits
    refs = chain_refs(toks(2 * BS), BS, salt=SALT)
    later = chain_refs(toks(3 * BS)[::-1], BS, salt=SALT)
    assert w.save(SpliceMetadata(saves=[SaveItem("r", SALT, tuple(refs), (4, 9))])) == 0
    assert w.pending_saves == 1 and store.match_prefix(refs, salt=SALT) == 0
    assert w.flush_saves() == 0 and w.pending_saves == 1  # a poll does not wait
    w.save(SpliceMetadata(saves=[SaveItem("q", SALT, tuple(later), (1, 2, 3))]))  # the next step's
    assert w.settle("other") == 0 and w.pending_saves == 2  # nothing of its own in flight
    assert w.settle("r") == 2 and w.pending_saves == 1  # r's copies, not the later ones
    assert store.match_prefix(refs, salt=SALT) == 2 and store.match_prefix(later, salt=SALT) == 0
    assert w.settle() == 3 and w.pending_saves == 0 and w.settle() == 0
    assert store.match_prefix(later, salt=SALT) == 3
    for ref, b in zip(refs, (4, 9)):
        assert torch.equal(store.get(ref, salt=SALT).payload[0], gather_blocks(LAYOUT, caches["layers.0.attn"], [b]))


def test_offload_load_writes_exactly_the_stored_blocks(store):
    prompt = toks(4 * BS)
    payloads = fill_store(store, prompt)
    caches = poisoned_caches()
    w = worker(store, caches)
    refs = chain_refs(prompt, BS, salt=SALT)
    item = LoadItem("r", SALT, tuple(refs[:3]), (0, 0, 0), (11, 3, 20), 0)
    w.start_load(SpliceMetadata(loads=[item]))
    assert w.take_load_errors() == set()
    for layer, cache in enumerate(caches.values()):
        for j, b in enumerate((11, 3, 20)):
            assert torch.equal(cache[b], payloads[j][layer, 0])  # bit for bit
        others = [i for i in range(NB) if i not in (11, 3, 20)]
        assert torch.isnan(cache[others]).all()  # nothing else written
    assert (w.stats.loaded_blocks, w.stats.relocated_blocks) == (3, 0)


def test_relocating_load_rotates_k_and_copies_v(store):
    old, new, plan, payloads = deletion_case(store)
    lp = plan_load(store, new, 2 * BS, block_size=BS, salt=SALT, plan=plan, owner="r")
    caches = poisoned_caches()
    w = worker(store, caches)
    dst = (5, 0, 9)
    w.load(LoadItem("r", SALT, lp.refs, lp.deltas, dst, lp.start))
    assert w.take_load_errors() == set() and w.stats.relocated_blocks == 3
    assert store.stats().pinned_blocks == 0  # released after the load
    for layer, cache in enumerate(caches.values()):
        k_dst, v_dst = LAYOUT.kv_views(cache)
        for j, b in zip((4, 5, 6), dst):  # old blocks 4-6 are S
            src = payloads[j][layer]  # [1, H, BS, 2*HD]
            k_src, v_src = LAYOUT.kv_views(src)
            want = rotate_keys(k_src[0].transpose(0, 1), -64, ROPE).transpose(0, 1)  # [H, BS, HD]
            torch.testing.assert_close(k_dst[b], want, rtol=0, atol=0)
            assert torch.equal(v_dst[b], v_src[0])
            assert not torch.equal(k_dst[b], k_src[0])  # it did rotate
        assert torch.isnan(cache[[i for i in range(NB) if i not in dst]]).all()


def test_a_relocating_load_checks_its_arguments_once_for_every_layer(store, monkeypatch):
    """The ids and rotation tables are prepared once per loaded item, not once a layer
    (on CUDA each preparation is ~0.13 ms of host time: 4 ms for 32 layers)."""
    from promptsplice import kernels

    old, new, plan, _ = deletion_case(store)
    lp = plan_load(store, new, 2 * BS, block_size=BS, salt=SALT, plan=plan, owner="r")
    calls = []
    real = kernels.prepare_relocation
    monkeypatch.setattr(kernels, "prepare_relocation", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    caches = poisoned_caches()
    w = worker(store, caches)
    w.load(LoadItem("r", SALT, lp.refs, lp.deltas, (5, 0, 9), lp.start))
    assert LAYERS > 1 and len(calls) == 1 and calls[0].tolist() == [5, 0, 9]
    assert w.stats.relocated_blocks == 3
    assert not any(torch.isnan(c[[5, 0, 9]]).any() for c in caches.values())


def test_kernel_blocks_smaller_than_vllm_blocks_are_mapped(store):
    """vLLM block of 64 tokens = 2 cache blocks of 32: ids b -> 2b, 2b+1."""
    caches = random_caches(3)
    w = worker(store, caches, block_size=64)  # the caches' blocks are 32 tokens
    assert w.paged.block_size == 32 and w.kernel_ids([3, 1]) == [6, 7, 2, 3] and w.payload_shape == (LAYERS, 2, HEADS, 32, 2 * HD)
    prompt = toks(128)
    refs = chain_refs(prompt, 64, salt=SALT)
    assert w.save(SpliceMetadata(saves=[SaveItem("r", SALT, tuple(refs), (3, 1))])) == 2
    dst = poisoned_caches()
    w2 = worker(store, dst, block_size=64)
    w2.load(LoadItem("r", SALT, tuple(refs), (64, 64), (5, 10), 0))
    for src, out in zip(caches.values(), dst.values()):
        for sb, db in ((6, 10), (7, 11), (2, 20), (3, 21)):
            assert torch.equal(LAYOUT.kv_views(out)[1][db], LAYOUT.kv_views(src)[1][sb])
            want = rotate_keys(LAYOUT.kv_views(src)[0][sb].transpose(0, 1), 64, ROPE).transpose(0, 1)
            assert torch.equal(LAYOUT.kv_views(out)[0][db], want)
        assert torch.isnan(out[[i for i in range(NB) if i not in (10, 11, 20, 21)]]).all()


def test_blocks_that_fail_to_load_are_reported_by_block_id(store):
    prompt = toks(4 * BS + 1)
    payloads = fill_store(store, prompt)
    sched = SpliceScheduler(store, BS)
    n = sched.get_num_new_matched_tokens("r", prompt, SALT, 0)
    assert n == 4 * BS
    item = sched.update_state_after_alloc("r", [8, 6, 4, 2, 1], n)
    meta = sched.build_connector_meta([("r", n, 1)], lambda rid: [8, 6, 4, 2, 1])
    store.discard(chain_hashes(prompt, BS, salt=SALT)[2])  # gone behind the pin's back
    caches = poisoned_caches()
    w = worker(store, caches)
    w.start_load(meta)
    assert w.take_load_errors() == {4, 2} and w.take_load_errors() == set()
    assert w.stats.load_errors == 2 and w.stats.loaded_blocks == 2
    first = next(iter(caches.values()))
    assert torch.equal(first[8], payloads[0][0, 0]) and torch.equal(first[6], payloads[1][0, 0])
    assert torch.isnan(first[[4, 2]]).all()  # vLLM recomputes them
    # This step's saves of the failed request are skipped (its forward pass was wrong).
    bad_save = SaveItem("r", SALT, (chain_refs(prompt, BS, salt=SALT)[2],), (4,))
    assert w.save(SpliceMetadata(saves=[bad_save])) == 0
    assert item.block_ids == (8, 6, 4, 2)


def test_a_damaged_disk_record_is_a_load_error(tmp_path):
    cfg = StoreConfig(dram_bytes=PAYLOAD, disk_bytes=16 * PAYLOAD + 65536, disk_dir=str(tmp_path),
                      fsync=False, write_behind_bytes=0)
    with BlockStore(cfg) as store:
        prompt = toks(3 * BS + 1)
        payloads = fill_store(store, prompt)  # DRAM holds one block: the others went to disk
        refs = chain_refs(prompt, BS, salt=SALT)
        records = sorted(p for p in tmp_path.iterdir() if p.name.endswith(".kvb"))
        assert len(records) >= 2
        lp = plan_load(store, prompt, 0, block_size=BS, salt=SALT, owner="r")
        assert lp.num_blocks == 3  # counted from the index: no file read
        victim = refs[1].key.hex()
        path = next(p for p in tmp_path.iterdir() if victim in p.name)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
        caches = poisoned_caches()
        w = worker(store, caches)
        w.load(LoadItem("r", SALT, lp.refs, lp.deltas, (1, 2, 3), 0))
        assert w.take_load_errors() == {2, 3}
        assert store.stats().corrupt == 1
        assert torch.equal(next(iter(caches.values()))[1], payloads[0][0, 0])


def test_worker_refuses_mismatched_layers(store):
    caches = random_caches()
    caches["odd"] = torch.zeros(NB, HEADS, BS, 2 * HD, dtype=torch.float32)
    with pytest.raises(ConfigError, match="equal layers"):
        worker(store, caches)
    with pytest.raises(ConfigError, match="not a multiple of the cache's kernel block size 32"):
        worker(store, random_caches(), block_size=48)


def test_the_layout_is_read_from_the_backend_and_others_are_refused_by_name(store):
    w = worker(store, random_caches())
    assert w.paged.layout == LAYOUT and (w.block_dim, w.blocks_per_block) == (0, 1) and w.can_relocate
    with pytest.raises(ConfigError, match="'TRITON_ATTN'.*supported: CPU_ATTN, FLASH_ATTN, FLASHINFER"):
        worker(store, random_caches(), backend="TRITON_ATTN")
    with pytest.raises(ConfigError, match="isa="):
        worker(store, random_caches(), isa=None)


def test_relocating_load_into_amx_tiles(store):
    """ISA amx packs K and V in tiles: the relocated K unpacks to the rotated K, the V
    tiles are the stored ones bit for bit."""
    old, new, plan, payloads = deletion_case(store)
    lp = plan_load(store, new, 2 * BS, block_size=BS, salt=SALT, plan=plan, owner="r")
    caches = poisoned_caches()
    w = worker(store, caches, isa="amx")
    assert w.paged.layout == CpuAttnAmxLayout() and w.can_relocate
    dst = (5, 0, 9)
    assert w.load(LoadItem("r", SALT, lp.refs, lp.deltas, dst, lp.start)) == 3
    amx = CpuAttnAmxLayout()
    for layer, cache in enumerate(caches.values()):
        k_dst, _ = amx.unpack(cache)
        for j, b in zip((4, 5, 6), dst):
            src = payloads[j][layer]  # [1, H, BS, 2*HD] in amx tiles
            want = rotate_keys(amx.unpack(src)[0][0].transpose(0, 1), -64, ROPE).transpose(0, 1)
            torch.testing.assert_close(k_dst[b], want, rtol=0, atol=0)
            half = BS * HD
            assert torch.equal(cache[b].reshape(HEADS, -1)[:, half:], src[0].reshape(HEADS, -1)[:, half:])
        assert torch.isnan(cache[[i for i in range(NB) if i not in dst]]).all()


@pytest.mark.parametrize("why", ["no rope", "unverified isa"])
def test_a_load_with_a_delta_needs_relocation_support(store, why):
    old, new, plan, _ = deletion_case(store)
    lp = plan_load(store, new, 2 * BS, block_size=BS, salt=SALT, plan=plan)
    kw = {"rope": None} if why == "no rope" else {"isa": "neon"}
    w = worker(store, poisoned_caches(), **kw)
    assert not w.can_relocate
    assert w.load(LoadItem("r", SALT, lp.refs, lp.deltas, (1, 2, 3), lp.start)) == 0
    assert w.take_load_errors() == {1, 2, 3}


def test_a_quantized_cache_cannot_relocate(store):
    """A FLASHINFER engine with ``kv_cache_dtype="nvfp4"`` hands the worker uint8 caches:
    it said it could relocate, so runners planned relocations and every one failed in
    the kernel (each failure quarantining the engine's saves for two steps)."""
    caches = {f"l{i}": torch.randint(0, 255, (NB, 2, BS, HEADS, HD), dtype=torch.uint8) for i in range(LAYERS)}
    w = worker(store, caches, backend="FLASHINFER")
    assert w.paged.layout is not None and w.rope is not None and not w.can_relocate


def test_quantized_cache_dtypes_are_named_by_vllm():
    """The connector refuses every cache vLLM stores quantized, not only ``fp8*``."""
    from promptsplice.engine_adapters._vllm import is_quantized_cache

    assert [is_quantized_cache(d) for d in ("fp8", "fp8_e5m2", "nvfp4", "int8_per_token_head", "auto", "bfloat16")] == [
        True, True, True, True, False, False]


def test_an_unverified_isa_still_serves_offload_hits_bit_for_bit(store):
    """NEON's K order is unverified: no relocation, but whole blocks copy as stored."""
    prompt = toks(3 * BS)
    payloads = fill_store(store, prompt)
    caches = poisoned_caches()
    w = worker(store, caches, isa="neon")
    assert w.paged.layout is None and "'neon'" in w.paged.why_not
    refs = chain_refs(prompt, BS, salt=SALT)
    assert w.load(LoadItem("r", SALT, tuple(refs), (0, 0, 0), (4, 9, 2), 0)) == 3
    for layer, cache in enumerate(caches.values()):
        for j, b in enumerate((4, 9, 2)):
            assert torch.equal(cache[b], payloads[j][layer, 0])


def test_tokens_vllm_takes_beyond_the_offer_become_load_errors(store, caplog):
    prompt = toks(4 * BS + 1)
    fill_store(store, prompt, blocks={0, 1})
    sched = SpliceScheduler(store, BS)
    assert sched.get_num_new_matched_tokens("r", prompt, SALT, 0) == 2 * BS
    item = sched.update_state_after_alloc("r", [4, 5, 6, 7, 8], 3 * BS)  # never happens in 0.32
    assert "offered" in caplog.text
    assert (len(item.refs), item.block_ids) == (2, (4, 5, 6))
    w = worker(store, poisoned_caches())
    assert w.load(item) == 2 and w.take_load_errors() == {6}  # recomputed by vLLM


@pytest.mark.reliability
def test_blocks_computed_over_a_failed_load_are_never_saved_under_exact_keys():
    """A's block 2 fails to load.  vLLM had cached A's blocks when it allocated them, so
    B, in the same step, got them as its prefix hit and computed its blocks 4-5 over the
    failed block; with asynchronous scheduling A's next chunk (blocks 6-7, step N+1) was
    built before the error was known.  Only A's step-N saves were skipped: B's and A's
    later blocks were stored under their exact keys, served later as offload hits, and
    never repaired (the scheduler does not re-save what the store holds).  Now nothing is
    saved in the failing step and the next, and the unusable record is discarded."""
    store = BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0))
    P = toks(4 * BS)
    fill_store(store, P, blocks={0, 1, 3})
    # block 2 is indexed but cannot be used (wrong dtype: a record the engine refuses)
    store.put(chain_refs(P, BS, salt=SALT)[2], torch.randn(LAYERS, 1, HEADS, BS, 2 * HD), salt=SALT)
    sched = SpliceScheduler(store, BS)
    A = P + toks(4 * BS, 5000) + [7]
    B = P + toks(2 * BS, 7000) + [9]
    ids = {"A": list(range(0, 9)), "B": [0, 1, 2, 3, 20, 21, 22]}
    nA = sched.get_num_new_matched_tokens("A", A, SALT, 0)
    sched.update_state_after_alloc("A", ids["A"], nA)
    assert nA == 4 * BS
    nB = sched.get_num_new_matched_tokens("B", B, SALT, 4 * BS)
    sched.update_state_after_alloc("B", ids["B"], nB)
    step_n = sched.build_connector_meta([("A", nA, 2 * BS), ("B", 4 * BS, len(B) - 4 * BS)], ids.__getitem__)
    step_n1 = sched.build_connector_meta([("A", nA + 2 * BS, len(A) - nA - 2 * BS)], ids.__getitem__)
    assert {s.req_id for s in step_n.saves} == {"A", "B"} and [s.req_id for s in step_n1.saves] == ["A"]

    w = worker(store, random_caches())
    w.start_load(step_n, per_layer=True)
    for name in w.names:
        w.wait_for_layer(name)
    w.save(step_n)
    assert sorted(w.take_load_errors()) == [2, 3]
    w.start_load(step_n1, per_layer=True)
    w.save(step_n1)
    refs_a, refs_b = chain_refs(A, BS, salt=SALT), chain_refs(B, BS, salt=SALT)
    assert [store.contains(r, salt=SALT) for r in refs_b[4:6]] == [False, False]
    assert [store.contains(r, salt=SALT) for r in refs_a[4:8]] == [False] * 4
    assert w.stats.quarantined_saves == 2 + 2 + 2  # A's 4-5 and B's 4-5, then A's 6-7
    assert not store.contains(refs_a[2], salt=SALT)  # discarded: its recompute is saved again
    # the step after next saves as usual
    step_n2 = sched.build_connector_meta([("A", 2 * BS, len(A) - 2 * BS)], ids.__getitem__)
    w.start_load(step_n2, per_layer=True)
    w.save(step_n2)
    assert store.contains(refs_a[2], salt=SALT) and w.stats.quarantined_saves == 6


def test_a_save_the_store_refuses_is_a_save_error():
    """A put the store refused (no room, or another block under the key) was counted
    nowhere: a store refusing every put showed no save error."""
    caches = random_caches()
    tiny = BlockStore(StoreConfig(dram_bytes=PAYLOAD // 2))  # no tier holds one block
    try:
        w = worker(tiny, caches)
        refs = chain_refs(toks(2 * BS), BS, salt=SALT)
        assert w.save(SpliceMetadata(saves=[SaveItem("r", SALT, tuple(refs), (3, 4))])) == 0
        assert (w.stats.saved_blocks, w.stats.save_errors) == (0, 2)
    finally:
        tiny.close()
