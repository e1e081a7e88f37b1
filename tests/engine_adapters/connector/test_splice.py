"""The splice connector's core without vLLM: plan format and builders, the planner's
decisions (tokens to load, exact destination block ids, saves), and the executor
writing into plain tensors laid out like vLLM's CPU_ATTN cache (poisoned first).

Blocks are real chain-hash blocks of 32 tokens; caches are ``[num_blocks, kv_heads=2,
32, 2 * head_size=128]`` bf16 per layer, 3 layers, ISA ``vec`` (K stored transposed).
"""

from __future__ import annotations

import os

import pytest
import torch

from promptsplice.engine_adapters import (
    BlockStore,
    LookupStatus,
    SplicePlan,
    SpliceSegment,
    StoreConfig,
    chain_refs,
    plan_deletion,
    plan_relocation,
)
from promptsplice.engine_adapters.connector._splice import (
    LoadItem,
    SaveItem,
    SpliceMetadata,
    SpliceScheduler,
    SpliceWorker,
    plan_load,
    store_config_from_extra,
    store_config_to_extra,
)
from promptsplice.kernels import CpuAttnLayout, RopeConfig, gather_blocks, rotate_keys
from promptsplice.blocks import chain_hashes, hash_block, root_hash
from promptsplice.errors import ConfigError, InputError

BS = 32
SALT = "tenant-a"
LAYERS, HEADS, HD, NB = 3, 2, 64, 24
ROPE = RopeConfig(head_size=HD, rotary_dim=HD, theta=100000.0)  # SmolLM2-135M's
LAYOUT = CpuAttnLayout("vec")
PAYLOAD = LAYERS * HEADS * BS * 2 * HD * 2  # bytes of one block (bf16)


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def store():
    with BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0)) as s:
        yield s


def random_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.attn": torch.randn(NB, HEADS, BS, 2 * HD, generator=g).bfloat16() for i in range(LAYERS)
    }


def poisoned_caches() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.attn": torch.full((NB, HEADS, BS, 2 * HD), float("nan"), dtype=torch.bfloat16) for i in range(LAYERS)}


def worker(store, caches, **kw) -> SpliceWorker:
    kw.setdefault("layout", LAYOUT)
    kw.setdefault("rope", ROPE)
    return SpliceWorker(store, block_size=BS, caches=caches, **kw)


def fill_store(store, tokens, salt=SALT, blocks=None, seed=1):
    """Save the full blocks of ``tokens`` (all, or the indices ``blocks``) with random KV;
    returns {block index: payload}."""
    g = torch.Generator().manual_seed(seed)
    refs = chain_refs(tokens, BS, salt=salt)
    out = {}
    for j, ref in enumerate(refs):
        if blocks is not None and j not in blocks:
            continue
        p = torch.randn(LAYERS, 1, HEADS, BS, 2 * HD, generator=g).bfloat16()
        store.put(ref, p, salt=salt)
        out[j] = p
    return out


# ------------------------------------------------------------------------- the plan


def test_plan_params_round_trip_and_are_json_safe():
    import json

    seg = SpliceSegment(64, 4, -64, root_hash("x"))
    plan = SplicePlan(BS, (seg, SpliceSegment(192, 1, -96, bytes(16))))
    params = plan.to_params()
    assert json.loads(json.dumps(params)) == params
    assert params["splice"]["segments"][0] == {
        "dst_start": 64, "num_blocks": 4, "delta": -64, "src_parent": root_hash("x").hex()
    }
    assert SplicePlan.from_params(params) == plan
    assert SplicePlan.from_params({"other": 1}) is None and SplicePlan.from_params(None) is None
    assert (plan.dst_start, plan.dst_end, plan.num_tokens) == (64, 224, 160)
    assert seg.src_start == 128 and not SplicePlan(BS)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"splice": {"version": 2, "block_size": 32, "segments": []}}, "version"),
        ({"splice": {"version": 1, "block_size": 32, "segments": {}}}, "list"),
        ({"splice": {"version": 1, "block_size": 32, "segments": [{"dst_start": 0}]}}, "lacks"),
        ({"splice": {"version": 1, "block_size": 32, "segments": [
            {"dst_start": 0, "num_blocks": 1, "delta": 0, "src_parent": "zz"}]}}, "segment 0"),
        ({"splice": {"version": 1, "block_size": 32, "segments": [
            {"dst_start": 16, "num_blocks": 1, "delta": 0, "src_parent": "00" * 16}]}}, "multiples"),
        ({"splice": {"version": 1, "block_size": 32, "segments": [
            {"dst_start": 0, "num_blocks": 1, "delta": 32, "src_parent": "00" * 16}]}}, "negative"),
        ({"splice": {"version": 1, "block_size": 32, "segments": [
            {"dst_start": 0, "num_blocks": 1, "delta": 0, "src_parent": "00" * 16},
            {"dst_start": 64, "num_blocks": 1, "delta": 0, "src_parent": "00" * 16}]}}, "contiguous"),
        ({"splice": "yes"}, "mapping"),
    ],
)
def test_malformed_plans_are_refused_naming_the_field(params, match):
    with pytest.raises(InputError, match=match):
        SplicePlan.from_params(params)


def test_plan_deletion_points_at_the_old_chain():
    P, X, S = toks(64), toks(64, 5000), toks(100, 9000)  # S: 3 whole blocks + 4 tokens
    old, new = P + X + S + [7], P + S + [8, 9]
    plan = plan_deletion(old, new, (64, 128), block_size=BS, salt=SALT)
    (seg,) = plan.segments
    assert (seg.dst_start, seg.num_blocks, seg.delta, seg.src_start) == (64, 3, -64, 128)
    old_keys = chain_hashes(old, BS, salt=SALT)
    assert seg.src_parent == old_keys[3]  # the block that ends where S started (P + X)
    # The keys rebuilt from the new prompt's tokens are the old prompt's keys of S.
    parent, rebuilt = seg.src_parent, []
    for j in range(2, 5):
        parent = hash_block(parent, new[j * BS : (j + 1) * BS])
        rebuilt.append(parent)
    assert rebuilt == old_keys[4:7]


def test_plan_relocation_rules():
    old, new = toks(128), toks(32, 7) + toks(128)
    plan = plan_relocation(old, new, old_start=0, new_start=32, block_size=BS)
    assert plan.segments == (SpliceSegment(32, 4, 32, root_hash(None)),)
    half = plan_relocation(old, new, old_start=0, new_start=32, num_tokens=70, block_size=BS, salt="s")
    assert half.segments[0].num_blocks == 2 and half.segments[0].src_parent == root_hash("s")
    assert not plan_relocation(old, new, old_start=0, new_start=32, num_tokens=31, block_size=BS)
    with pytest.raises(InputError, match="multiple of block_size"):
        plan_relocation(old, new, old_start=0, new_start=16, block_size=BS)
    with pytest.raises(InputError, match="differ inside"):
        plan_relocation(old, new, old_start=32, new_start=32, num_tokens=32, block_size=BS)
    with pytest.raises(InputError, match="does not start with"):
        plan_deletion(toks(96), toks(64, 1) + toks(32), (32, 64), block_size=BS)


# ----------------------------------------------------------------------- the planner


def test_offload_hits_count_the_blocks_really_stored_and_leave_one_token(store):
    prompt = toks(6 * BS)  # exactly 6 blocks: the 6th cannot be served (one token to compute)
    fill_store(store, prompt)
    lp = plan_load(store, prompt, 0, block_size=BS, salt=SALT)
    assert lp.num_tokens == 5 * BS == (len(prompt) - 1) // BS * BS and set(lp.deltas) == {0}
    assert [r.key for r in lp.refs] == chain_hashes(prompt, BS, salt=SALT)[:5]
    # After a local hit of 2 blocks: the following ones.
    lp = plan_load(store, prompt, 2 * BS, block_size=BS, salt=SALT)
    assert (lp.start, lp.num_tokens) == (64, 3 * BS)
    assert plan_load(store, prompt + [1], 0, block_size=BS, salt=SALT).num_tokens == 6 * BS
    # A hole stops the run; other salts and unaligned hits get nothing.
    store.discard(chain_hashes(prompt, BS, salt=SALT)[3])
    assert plan_load(store, prompt, 0, block_size=BS, salt=SALT).num_tokens == 3 * BS
    assert plan_load(store, prompt, 0, block_size=BS, salt="tenant-b").num_tokens == 0
    assert plan_load(store, prompt, 0, block_size=BS, salt=None).num_tokens == 0
    assert plan_load(store, prompt, 16, block_size=BS, salt=SALT).num_tokens == 0


def test_planner_pins_for_the_request(store):
    prompt = toks(4 * BS + 1)
    fill_store(store, prompt)
    lp = plan_load(store, prompt, 0, block_size=BS, salt=SALT, owner="req-1")
    assert lp.num_blocks == 4 and store.stats().pinned_blocks == 4
    plan_load(store, prompt, 2 * BS, block_size=BS, salt=SALT, owner="req-1")  # asked again
    assert store.stats().pinned_blocks == 2
    assert store.release("req-1") == 2 and store.stats().pinned_blocks == 0


def deletion_case(store):
    """old = P + X + S + q, stored; new = P + S + tail."""
    P, X, S = toks(2 * BS), toks(2 * BS, 5000), toks(3 * BS, 9000)
    old, new = P + X + S + [1, 2], P + S + toks(10, 20000)
    payloads = fill_store(store, old)
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS, salt=SALT)
    return old, new, plan, payloads


def test_planner_relocates_the_planned_blocks_after_the_local_hit(store):
    old, new, plan, _ = deletion_case(store)
    lp = plan_load(store, new, 2 * BS, block_size=BS, salt=SALT, plan=plan)
    assert (lp.start, lp.num_blocks, lp.deltas) == (64, 3, (-64, -64, -64))
    assert [r.key for r in lp.refs] == chain_hashes(old, BS, salt=SALT)[4:7]
    # P lost from vLLM's cache: P comes from the store too (delta 0), then S relocated.
    lp = plan_load(store, new, 0, block_size=BS, salt=SALT, plan=plan)
    assert lp.deltas == (0, 0, -64, -64, -64)
    # No relocation on this engine: the planned blocks are not offered.
    assert plan_load(store, new, 0, block_size=BS, salt=SALT, plan=plan, relocation=False).deltas == (0, 0)
    # The plan under another salt finds nothing to relocate.
    assert plan_load(store, new, 2 * BS, block_size=BS, salt="tenant-b", plan=plan).num_blocks == 0
    # A plan that points at blocks not in the store: nothing loaded (computed instead).
    bogus = SplicePlan(BS, (SpliceSegment(64, 3, -64, bytes(16)),))
    assert plan_load(store, new, 2 * BS, block_size=BS, salt=SALT, plan=bogus).num_blocks == 0


def test_scheduler_turns_the_count_into_exact_destination_blocks(store):
    old, new, plan, _ = deletion_case(store)
    sched = SpliceScheduler(store, BS)
    n = sched.get_num_new_matched_tokens("r1", new, SALT, 2 * BS, plan.to_params())
    assert n == 3 * BS and store.stats().pinned_blocks == 3
    # vLLM's list holds the local-hit blocks first: the load goes after them.
    block_ids = [17, 4, 9, 12, 3, 21]  # 2 hit + 3 loaded + 1 computed (the tail)
    item = sched.update_state_after_alloc("r1", block_ids, n)
    assert item.block_ids == (9, 12, 3) and item.deltas == (-64,) * 3 and item.start == 64
    meta = sched.build_connector_meta([("r1", 2 * BS + n, len(new) - 5 * BS)], lambda rid: block_ids)
    assert meta.loads == [item]
    assert meta.saves == []  # after a relocation the tail is approximate: not stored
    assert sched.build_connector_meta([], lambda rid: block_ids).loads == []  # loads go once
    sched.request_finished("r1")
    assert store.stats().pinned_blocks == 0 and sched.num_tracked == 0


def test_scheduler_saves_what_each_step_completes(store):
    sched = SpliceScheduler(store, BS)
    prompt = toks(5 * BS + 7)
    assert sched.get_num_new_matched_tokens("r2", prompt, SALT, 0) == 0
    assert sched.update_state_after_alloc("r2", [], 0) is None
    ids = [5, 6, 7, 8, 9, 10]
    refs = chain_refs(prompt, BS, salt=SALT)
    # Chunked prefill: 70 tokens, then the rest, then a decode step.
    meta = sched.build_connector_meta([("r2", 0, 70)], lambda rid: ids)
    assert meta.saves == [SaveItem("r2", SALT, tuple(refs[:2]), (5, 6))]
    store.put(refs[2], torch.zeros(1), salt=SALT)  # already stored: skipped
    meta = sched.build_connector_meta([("r2", 70, len(prompt) - 70)], lambda rid: ids)
    assert meta.saves == [SaveItem("r2", SALT, (refs[3], refs[4]), (8, 9))]
    assert sched.build_connector_meta([("r2", len(prompt), 1)], lambda rid: ids).saves == []


def test_scheduler_offload_hit_and_vllm_declining_it(store):
    prompt = toks(4 * BS + 3)
    fill_store(store, prompt, blocks={0, 1, 2})
    sched = SpliceScheduler(store, BS)
    assert sched.get_num_new_matched_tokens("r3", prompt, SALT, 0) == 3 * BS
    # vLLM took 0 external tokens (e.g. skip_reading_prefix_cache): nothing loads, pins go.
    assert sched.update_state_after_alloc("r3", [1, 2, 3, 4, 5], 0) is None
    assert store.stats().pinned_blocks == 0
    meta = sched.build_connector_meta([("r3", 0, len(prompt))], lambda rid: [1, 2, 3, 4, 5])
    assert meta.loads == [] and [s.block_ids for s in meta.saves] == [(4,)]  # only block 3 is missing
    # Asked again (a new request, same prompt): blocks 0-2 load into the first three ids.
    assert sched.get_num_new_matched_tokens("r4", prompt, SALT, 0) == 3 * BS
    assert sched.update_state_after_alloc("r4", [30, 31, 32, 33, 34], 3 * BS).block_ids == (30, 31, 32)


def test_a_bad_plan_is_ignored_not_fatal(store, caplog):
    prompt = toks(3 * BS + 1)
    fill_store(store, prompt)
    sched = SpliceScheduler(store, BS)
    bad = {"splice": {"version": 1, "block_size": 16, "segments": []}}
    assert sched.get_num_new_matched_tokens("r5", prompt, SALT, 0, bad) == 3 * BS  # offload still
    assert "ignoring the splice plan" in caplog.text


# ---------------------------------------------------------------------- the executor


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


def test_kernel_blocks_smaller_than_vllm_blocks_are_mapped(store):
    """vLLM block of 64 tokens = 2 cache blocks of 32: ids b -> 2b, 2b+1."""
    caches = random_caches(3)
    w = SpliceWorker(store, block_size=64, caches=caches, kernel_block_size=32, layout=LAYOUT, rope=ROPE)
    assert w.kernel_ids([3, 1]) == [6, 7, 2, 3] and w.payload_shape == (LAYERS, 2, HEADS, 32, 2 * HD)
    prompt = toks(128)
    refs = chain_refs(prompt, 64, salt=SALT)
    assert w.save(SpliceMetadata(saves=[SaveItem("r", SALT, tuple(refs), (3, 1))])) == 2
    dst = poisoned_caches()
    w2 = SpliceWorker(store, block_size=64, caches=dst, kernel_block_size=32, layout=LAYOUT, rope=ROPE)
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
    with pytest.raises(ConfigError, match="multiple"):
        SpliceWorker(store, block_size=48, caches=random_caches(), kernel_block_size=32)


def test_a_load_with_a_delta_needs_relocation_support(store):
    old, new, plan, _ = deletion_case(store)
    lp = plan_load(store, new, 2 * BS, block_size=BS, salt=SALT, plan=plan)
    w = SpliceWorker(store, block_size=BS, caches=poisoned_caches())  # no layout / rope
    assert not w.can_relocate
    assert w.load(LoadItem("r", SALT, lp.refs, lp.deltas, (1, 2, 3), lp.start)) == 0
    assert w.take_load_errors() == {1, 2, 3}


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
