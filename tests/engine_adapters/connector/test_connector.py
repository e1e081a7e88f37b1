"""The splice KV connector on the real engine and model (vLLM CPU, SmolLM2-135M), no mocks.

One engine with the connector serves the module (``kv_engine`` in conftest.py); every
test uses its own ``cache_salt``, so the shared block store and prefix cache never leak
between tests.  vLLM is the judge: ``num_cached_tokens`` and its prefix-cache counters
(``vllm:prefix_cache_hits`` local, ``vllm:external_prefix_cache_hits`` connector).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from promptsplice.engine_adapters import (
    EngineConfig,
    SplicePlan,
    SpliceSegment,
    StoreConfig,
    chain_refs,
    plan_deletion,
    plan_relocation,
)
from promptsplice.kernels import VERIFIED_CPU_ATTN_ISAS, CpuAttnAmxLayout, CpuAttnLayout
from promptsplice.errors import ConfigError
from tests.engine_adapters._engine import ENGINE_BLOCK, salt_maker

BS = ENGINE_BLOCK
salt = salt_maker("")


@pytest.fixture(scope="module")
def text_tokens(kv_engine, rag_requests):
    """Real text (Wikipedia leads of the demo sample), tokenized by the engine's tokenizer."""
    seen, texts = set(), []
    for req in rag_requests:
        for c in req.chunks:
            if c.text not in seen:
                seen.add(c.text)
                texts.append(c.text)
    ids = kv_engine.tokenizer.encode("\n\n".join(texts))
    assert len(ids) > 2000
    return list(ids)


def loads(engine):
    return [(item, n) for kind, item, n in engine.kv_connector.worker.history if kind == "load"]


def saves(engine):
    return [(item, n) for kind, item, n in engine.kv_connector.worker.history if kind == "save"]


def layer0_blocks(engine, block_ids) -> torch.Tensor:
    """Copy of the engine's layer-0 KV cache blocks (the tensor vLLM registered)."""
    w = engine.kv_connector.worker
    assert w.names[0].endswith("layers.0.self_attn.attn")
    return w.caches[0][list(block_ids)].clone()


def kv(engine, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of cache blocks as [n, kv_heads, block_size, head_size], read through the
    layout the engine's worker uses (strided for ISA vec, tiles for amx)."""
    layout = engine.kv_connector.worker.paged.layout
    return layout.unpack(blocks) if hasattr(layout, "unpack") else layout.kv_views(blocks)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------- config (no engine start)

def scheduler_glue(store):
    """The connector's scheduler-side glue built without a vLLM config (the ack and load
    paths need only its store and the scheduler side; no real part is stood in for)."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters.connector._connector import SpliceConnector
    from promptsplice.engine_adapters.connector._scheduler import SpliceScheduler
    from tests.engine_adapters.connector._kv import BS

    conn = object.__new__(SpliceConnector)
    conn.settings = SimpleNamespace(block_size=BS, relocation=True)
    conn.store, conn.scheduler = store, SpliceScheduler(store, BS)
    conn._acks, conn._probes, conn._loads, conn._offered = {}, {}, {}, {}
    return conn



def test_kv_store_is_one_option_that_sets_the_connector():
    store = StoreConfig(dram_bytes=1 << 26)
    kwargs = EngineConfig(kv_store=store).llm_kwargs("/m")
    kv = kwargs["kv_transfer_config"]
    assert kv["kv_connector"] == "SpliceConnector"
    assert kv["kv_connector_module_path"] == "promptsplice.engine_adapters.connector._connector"
    assert kv["kv_role"] == "kv_both" and kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"]["dram_bytes"] == 1 << 26
    assert "kv_transfer_config" not in EngineConfig().llm_kwargs("/m")
    with pytest.raises(ConfigError, match="kv_store must be"):
        EngineConfig(kv_store={"dram_bytes": 1})
    with pytest.raises(ConfigError, match="kv_store owns"):
        EngineConfig(kv_store=store, extra_kwargs={"kv_transfer_config": {}})
    assert EngineConfig(kv_store=store, platform="cuda", kv_cache_bytes=None).kv_store is store
    with pytest.raises(ConfigError, match="cpu and cuda platforms only, not on 'xpu'"):
        EngineConfig(kv_store=store, platform="xpu", kv_cache_bytes=None)
    for name in ("CPU", "gpu", "rocm"):  # not vLLM device types: another platform's defaults
        with pytest.raises(ConfigError, match="platform must be a vLLM device type"):
            EngineConfig(platform=name)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineConfig(dtype="flaot32")



# --------------------------------------------------------------------------- engine


def test_the_connector_is_loaded_with_the_engines_caches(kv_engine):
    conn = kv_engine.kv_connector
    w = conn.worker
    assert type(conn).__name__ == "SpliceConnector" and conn.settings.relocation
    assert len(w.caches) == 30 and w.payload_shape == (30, 1, 3, BS, 128)
    assert w.caches[0].shape[0] == kv_engine.num_blocks and w.can_relocate
    # The layout is read from the layers' backend and ISA (vec without AMX, amx with it).
    isa = conn.settings.isa
    assert conn.settings.backend == "CPU_ATTN" and isa in VERIFIED_CPU_ATTN_ISAS
    expected = CpuAttnAmxLayout() if isa == "amx" else CpuAttnLayout(isa)
    assert tuple(w.paged) == ("CPU_ATTN", 0, BS, expected, "")
    assert kv_engine.kv_store is conn.store


def test_offload_hit_after_the_prefix_cache_is_reset(kv_engine, text_tokens):
    s = salt("offload")
    prompt = text_tokens[:203]
    first = kv_engine.generate(prompt, max_tokens=12, cache_salt=s)  # a fresh full computation
    assert first.num_cached_tokens == 0
    assert saves(kv_engine)[-1][1] == 6  # the 6 full blocks went to the store
    kv_engine.reset_prefix_cache()  # vLLM's own cache is empty; the store is not
    before = kv_engine.counters()
    again = kv_engine.generate(prompt, max_tokens=12, cache_salt=s)
    seen = kv_engine.counters().since(before)
    expected = (len(prompt) - 1) // BS * BS
    assert again.num_cached_tokens == seen.external_hits == expected == 192
    assert seen.prefix_cache_hits == 0 and seen.external_queries == len(prompt)
    assert again.token_ids == first.token_ids  # greedy: the loaded KV is the computed KV
    item, n = loads(kv_engine)[-1]
    assert n == 6 and set(item.deltas) == {0} and item.start == 0


def test_a_finished_request_leaves_its_blocks_in_the_store_while_copies_are_in_flight(
    kv_engine, text_tokens, monkeypatch
):
    """On CUDA a save's host copy completes after the step, and an idle engine runs no
    later step to hand it over: the connector settles when a request finishes, so the
    next lookup (a precompute's relocating request, a store query, an agent's next
    turn) finds its blocks.  The copy's event is the stand-in (this CPU copies inline):
    it completes only when waited on."""
    worker = kv_engine.kv_connector.worker
    monkeypatch.setattr(worker.io, "done", lambda ev, *, block: block)
    s = salt("in-flight")
    prompt = text_tokens[300:503]  # 6 full blocks and a token
    refs = chain_refs(prompt, BS, salt=s)
    stored0 = worker.stats.saved_blocks
    out = kv_engine.generate(prompt, max_tokens=1, cache_salt=s)
    assert out.num_cached_tokens == 0 and worker.pending_saves == 0
    assert worker.stats.saved_blocks - stored0 == 6 and kv_engine.kv_store.match_prefix(refs, salt=s) == 6
    kv_engine.reset_prefix_cache()
    again = kv_engine.generate(prompt, max_tokens=1, cache_salt=s)
    assert again.num_cached_tokens == 192 and again.token_ids == out.token_ids  # served from the store


def test_a_damaged_block_file_is_recomputed_and_the_output_is_unchanged(kv_engine, text_tokens):
    """A block counted from the store's index but damaged on disk fails its checksum at
    load: the connector reports it (and the blocks after it) as load errors, vLLM
    (``kv_load_failure_policy="recompute"``) recomputes them, the answer is unchanged."""
    s = salt("damaged")
    store, worker = kv_engine.kv_store, kv_engine.kv_connector.worker
    prompt = text_tokens[3000:3200]  # 6 full blocks
    first = kv_engine.generate(prompt, max_tokens=8, cache_salt=s)
    filler = text_tokens[3300 : 3300 + 24 * BS + 1]  # 24 new blocks push those out of DRAM
    kv_engine.generate(filler, max_tokens=1, cache_salt=salt("filler"))
    store.drain()
    victim = chain_refs(prompt, BS, salt=s)[3].key.hex()
    (path,) = Path(store.config.disk_dir).glob(f"*{victim}*")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))

    kv_engine.reset_prefix_cache()
    before, corrupt, errors = kv_engine.counters(), store.stats().corrupt, worker.stats.load_errors
    again = kv_engine.generate(prompt, max_tokens=8, cache_salt=s)
    assert again.token_ids == first.token_ids
    assert store.stats().corrupt == corrupt + 1 and not path.exists()  # counted, deleted
    assert worker.stats.load_errors == errors + 3  # blocks 3, 4, 5: recomputed by vLLM
    item, n = loads(kv_engine)[-1]
    assert n == 3 and len(item.block_ids) == 6
    # vLLM counts hits when it schedules: the recomputed blocks stay in both figures.
    assert kv_engine.counters().since(before).external_hits == 6 * BS
    assert again.num_cached_tokens == 6 * BS


def test_store_hits_never_cross_salts(kv_engine, text_tokens):
    a, b = salt("tenant-a"), salt("tenant-b")
    prompt = text_tokens[300:430]
    kv_engine.generate(prompt, max_tokens=1, cache_salt=a)
    kv_engine.reset_prefix_cache()
    for other in (b, None):
        before = kv_engine.counters()
        out = kv_engine.generate(prompt, max_tokens=1, cache_salt=other)
        assert out.num_cached_tokens == 0 and kv_engine.counters().since(before).external_hits == 0
    kv_engine.reset_prefix_cache()
    assert kv_engine.generate(prompt, max_tokens=1, cache_salt=a).num_cached_tokens == 128


def test_layer0_of_a_relocated_block_is_what_vllm_computes_there(kv_engine, text_tokens):
    """S computed at p = 64, relocated to p + d = 224 (d = +160): layer-0 K equals the
    keys vLLM computes at 224 to bf16 rounding, V bit for bit; unrotated K is far off."""
    s = salt("layer0")
    late0 = kv_engine.kv_connector.worker.stats.late_layers  # (a fault test before may have left some)
    A, S = text_tokens[1000:1064], text_tokens[1100:1228]  # 2 blocks, 4 blocks
    A2 = text_tokens[1300:1524]  # 7 blocks: S moves from 64 to 224
    old = A + S + text_tokens[1600:1610]
    new = A2 + S + text_tokens[1700:1705]
    kv_engine.generate(old, max_tokens=1, cache_salt=s)  # S computed at 64, saved
    kv_engine.generate(A2 + [text_tokens[0]], max_tokens=1, cache_salt=s)  # A2 in vLLM's cache
    plan = plan_relocation(old, new, old_start=len(A), new_start=len(A2), block_size=BS, salt=s)
    assert plan.segments[0].delta == 160 and plan.segments[0].num_blocks == 4
    out = kv_engine.generate(new, max_tokens=1, cache_salt=s, splice=plan)
    assert out.num_cached_tokens == len(A2) + len(S)
    item, n = loads(kv_engine)[-1]
    assert n == 4 and item.deltas == (160,) * 4 and item.start == len(A2)
    assert kv_engine.kv_connector.worker.stats.late_layers == late0  # every layer's hook came
    spliced = layer0_blocks(kv_engine, item.block_ids)

    # vLLM's own keys at 224: the same prompt computed from scratch (another salt).
    kv_engine.generate(new, max_tokens=1, cache_salt=salt("layer0-ref"))
    ref_item, _ = saves(kv_engine)[-1]
    assert ref_item.block_ids and len(ref_item.block_ids) == len(new) // BS
    ref = layer0_blocks(kv_engine, ref_item.block_ids[7:11])

    k_s, v_s = kv(kv_engine, spliced)
    k_r, v_r = kv(kv_engine, ref)
    assert torch.equal(v_s, v_r), "layer-0 V must not depend on the position"
    err = rel(k_s, k_r)
    assert err < 0.01, f"relocated layer-0 K relative error {err:.4f}"
    # Without the rotation (a delta-0 load writes the stored block as it is): far off.
    stored = [kv_engine.kv_store.get(ref, salt=s) for ref in item.refs]
    assert all(x.status.hit for x in stored)
    k_old, v_old = kv(kv_engine, torch.cat([x.payload[0] for x in stored]))
    assert torch.equal(v_old, v_r)
    assert rel(k_old, k_r) > 0.3


def test_deletion_splice_end_to_end(kv_engine, text_tokens, record_property):
    """old = P + X + S + q, new = P + S + tail: P hits vLLM's cache, S's blocks are
    relocated by -len(X), the tail is computed; the continuation stays close to a full
    recompute (reported, not asserted: one greedy sample flips on bf16 near-ties)."""
    s = salt("deletion")
    late0 = kv_engine.kv_connector.worker.stats.late_layers
    enc = kv_engine.tokenizer.encode
    header = enc("<|im_start|>system\nYou are a helpful assistant. Use the passages.<|im_end|>\n"
                 "<|im_start|>user\nPassages:\n")
    P = (list(header) + text_tokens[2000:2064])[:64]  # 2 blocks
    X, S = text_tokens[2100:2196], text_tokens[2200:2392]  # 3 blocks deleted, 6 kept
    question = enc("\n\nIn one sentence, what are these passages about?<|im_end|>\n"
                   "<|im_start|>assistant\n")
    old = P + X + S + enc("\n\nSummarize them.<|im_end|>\n")
    new = P + S + list(question)
    kv_engine.generate(old, max_tokens=1, cache_salt=s)
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS, salt=s)
    assert plan.segments == (SpliceSegment(64, 6, -96, plan.segments[0].src_parent),)

    before = kv_engine.counters()
    spliced = kv_engine.generate(new, max_tokens=24, cache_salt=s, splice=plan)
    seen = kv_engine.counters().since(before)
    assert seen.prefix_cache_hits == len(P)  # local: vLLM's own cache
    assert seen.external_hits == len(S)  # the connector: relocated blocks
    assert spliced.num_cached_tokens == len(P) + len(S)
    item, n = loads(kv_engine)[-1]
    assert n == 6 and item.deltas == (-96,) * 6 and item.start == len(P)
    assert kv_engine.kv_connector.worker.stats.relocated_blocks >= 6
    # loaded layer by layer: vLLM called wait_for_layer_load for every layer in time
    assert kv_engine.kv_connector.worker.stats.late_layers == late0
    k_spliced = kv(kv_engine, layer0_blocks(kv_engine, item.block_ids))[0]

    full = kv_engine.generate(new, max_tokens=24, cache_salt=salt("deletion-ref"))
    assert full.num_cached_tokens == 0
    ref_item, _ = saves(kv_engine)[-1]
    k_full = kv(kv_engine, layer0_blocks(kv_engine, ref_item.block_ids[2:8]))[0]
    assert rel(k_spliced, k_full) < 0.01
    # The same blocks without the rotation (delta forced to 0) differ from the recompute.
    stored = torch.cat([kv_engine.kv_store.get(r, salt=s).payload[0] for r in item.refs])
    assert rel(kv(kv_engine, stored)[0], k_full) > 0.3

    # Fidelity, teacher-forced: both contexts are fed the full run's continuation and
    # predict each next token (the spliced context stays in vLLM's prefix cache under
    # the new prompt's hashes, so these requests reuse the relocated KV).  The control
    # feeds the recomputed context the same way: it differs from the greedy run only by
    # bf16 noise (cached vs in-one-pass attention).
    cont = full.token_ids[:16]
    ref_salt = saves(kv_engine)[-1][0].salt

    def predicted(salt_):
        out = []
        for k in range(len(cont)):
            c = kv_engine.generate(new + cont[:k], max_tokens=1, cache_salt=salt_)
            assert c.num_cached_tokens >= len(P) + len(S)
            out.append(c.token_ids[0])
        return out

    tf_splice = sum(a == b for a, b in zip(predicted(s), cont)) / len(cont)
    tf_control = sum(a == b for a, b in zip(predicted(ref_salt), cont)) / len(cont)
    same = [a == b for a, b in zip(spliced.token_ids, full.token_ids)]
    greedy = same.index(False) if False in same else len(same)
    record_property("teacher_forced_top1_splice", tf_splice)
    record_property("teacher_forced_top1_control", tf_control)
    record_property("greedy_tokens_until_divergence", greedy)
    print(f"\ndeletion splice vs full recompute: teacher-forced top-1 agreement {tf_splice:.2f} "
          f"(control {tf_control:.2f}) over {len(cont)} tokens; greedy identical for {greedy} "
          f"tokens; TTFT splice {spliced.ttft_s * 1e3:.0f} ms vs full {full.ttft_s * 1e3:.0f} ms\n"
          f"  splice: {spliced.text!r}\n  full:   {full.text!r}")
    assert len(cont) == 16 and tf_control >= 0.8  # the measure itself works


def test_a_plan_pointing_at_missing_blocks_falls_back_to_computing(kv_engine, text_tokens):
    s = salt("missing")
    prompt = text_tokens[2500:2650]
    kv_engine.generate(prompt[:64] + [1], max_tokens=1, cache_salt=s)  # the prefix is local
    bogus = SplicePlan(BS, (SpliceSegment(64, 2, -64, bytes(16)),))
    before = kv_engine.counters()
    out = kv_engine.generate(prompt, max_tokens=8, cache_salt=s, splice=bogus)
    assert out.num_cached_tokens == 64 and kv_engine.counters().since(before).external_hits == 0
    full = kv_engine.generate(prompt, max_tokens=8, cache_salt=salt("missing-ref"))
    assert out.token_ids == full.token_ids


def test_engines_with_and_without_the_connector_coexist(engine, kv_engine, text_tokens):
    prompt = text_tokens[2700:2780]
    plain = engine.generate(prompt, max_tokens=4)  # vLLM alone would assert here
    with_kv = kv_engine.generate(prompt, max_tokens=4, cache_salt=salt("both"))
    assert plain.token_ids == with_kv.token_ids
    assert engine.kv_connector is None and engine.kv_store is None
    with pytest.raises(ConfigError, match="kv_store"):
        engine.generate(prompt, splice=SplicePlan(BS))
    with pytest.raises(ConfigError, match="block_size"):
        kv_engine.generate(prompt, splice=SplicePlan(64))
    with pytest.raises(ConfigError, match="SplicePlan"):
        kv_engine.generate(prompt, splice={"splice": {}})


def test_probes_measure_how_far_recomputed_blocks_are_from_their_relocated_old_kv(kv_engine, text_tokens):
    """old = A + X + S: S's first two blocks recomputed in new prompts and compared, by
    the connector as it saves them, with S's stored old KV.  Same tokens at the same
    positions after the same context: ~0.  After X is deleted (S moves by -64, the
    context before it changed): layer 0 still ~0 (position-only, keys re-rotated), the
    deep layers deviate, and the block's deviation is far above the exact one."""
    from promptsplice.blocks import chain_hashes
    from promptsplice.engine_adapters import SplicePhase

    s = salt("probe-old")
    A, X, S = text_tokens[3000:3064], text_tokens[3064:3128], text_tokens[3128:3256]
    old = A + X + S + text_tokens[3300:3310]
    kv_engine.generate(old, max_tokens=1, cache_salt=s)  # S computed at 128, saved
    parent = chain_hashes(old[:128], BS, salt=s)[-1]
    worker = kv_engine.kv_connector.worker

    def probe(new, dst, delta):
        plan = SplicePlan(BS, src_salt=s, probes=(SpliceSegment(dst, 2, delta, parent),))
        before = worker.stats.probed_blocks
        # the new prompt under a salt derived from the old one's (a scope of the same
        # tenant): a plan may read another salt only of the request's own tenant
        run = kv_engine.generate_phases(new, [SplicePhase(len(new), plan)], cache_salt=f"{s}\x1f{salt('probe-new')}",
                                        max_tokens=1)
        assert worker.stats.probed_blocks - before == 2 and run.relocated_tokens == 0
        assert [d.dst_start for d in run.deviations] == [dst, dst + BS]
        assert all(d.delta == delta and len(d.k) == len(d.v) == len(worker.caches) for d in run.deviations)
        return run.deviations

    exact = probe(A + X + S + text_tokens[3400:3405], 128, 0)
    moved = probe(A + S + text_tokens[3400:3405], 64, -64)
    assert max(d.max_layer for d in exact) < 1e-3, exact
    for d in moved:
        assert d.k[0] < 0.01 and d.v[0] < 1e-3  # layer 0: the token at its position
        assert max(d.v[1:]) > 0.01
        assert d.value > 20 * max(e.value for e in exact) and d.value > 0.005
    assert worker.stats.probe_s > 0


def test_a_served_ack_counts_what_was_loaded_not_what_was_planned():
    """The served ack's loaded/relocated tokens added what each allocation planned: a load
    that failed (vLLM recomputes it) still counted as relocated, and a request vLLM
    preempted and resumed counted its reload twice (relocated above the prompt's size).
    The glue is built without a vLLM config: the ack path needs only its store and the
    scheduler side; the worker is the real one."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters import BlockStore
    from promptsplice.engine_adapters.connector._served import SpliceAck, splice_params
    from tests.engine_adapters.connector._kv import BS, HD, HEADS, LAYERS, PAYLOAD, SALT, deletion_case, random_caches, worker

    def run(break_block: bool):
        store = BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0))
        old, new, plan, _ = deletion_case(store)  # a run of 3 blocks relocated by -64
        if break_block:  # the run's first old block cannot be served (a damaged record in life)
            ref = chain_refs(old, BS, salt=SALT)[4]
            store.discard(ref.key)
            store.put(ref, torch.randn(LAYERS, 1, HEADS, BS, 2 * HD), salt=SALT)
        conn = scheduler_glue(store)
        req = SimpleNamespace(request_id="r", prompt_token_ids=new, cache_salt=SALT,
                              kv_transfer_params=splice_params(plan, new))
        ids = list(range(10, 10 + len(new) // BS + 1))
        blocks = SimpleNamespace(get_block_ids=lambda: (ids,))
        w = worker(store, random_caches())
        for _ in range(2):  # scheduled, then preempted and resumed
            n, _ = conn.get_num_new_matched_tokens(req, 2 * BS)
            conn.update_state_after_alloc(req, blocks, n)
            meta = conn.scheduler.build_connector_meta([("r", 2 * BS + n, len(new) - 2 * BS - n)], lambda _: ids)
            w.start_load(meta)
            w.save(meta)
            conn.update_connector_output(SimpleNamespace(invalid_block_ids=w.take_load_errors()))
        _, kv = conn.request_finished(req, ids)
        return SpliceAck.from_params(kv), w, len(new)

    ack, w, n_tokens = run(break_block=False)
    assert ack.relocated_tokens == 3 * BS == w.stats.relocated_blocks * BS // 2  # one load's worth, not two
    assert ack.loaded_tokens <= n_tokens
    ack, w, _ = run(break_block=True)
    assert w.stats.load_errors > 0 and w.stats.relocated_blocks == 0
    assert ack.relocated_tokens == 0 and ack.loaded_tokens == 0


@pytest.mark.parametrize("how", ["resumed without a load", "preempted"])
def test_another_requests_failed_load_into_freed_blocks_leaves_an_ack_alone(how):
    """A load's record stayed with its request until it finished: once vLLM preempted the
    request (its blocks freed), another request's failed load into those block ids took
    the first request's served tokens out of its ack (64 relocated tokens became 0)."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters import BlockStore
    from promptsplice.engine_adapters.connector._served import SpliceAck, splice_params
    from tests.engine_adapters.connector._kv import BS, PAYLOAD, SALT, deletion_case, random_caches, worker

    store = BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0))
    old, new, plan, _ = deletion_case(store)
    conn = scheduler_glue(store)
    req = SimpleNamespace(request_id="r", prompt_token_ids=new, cache_salt=SALT, kv_transfer_params=splice_params(plan, new))
    ids = list(range(10, 10 + len(new) // BS + 1))
    blocks = SimpleNamespace(get_block_ids=lambda: (ids,))
    w = worker(store, random_caches())
    n, _ = conn.get_num_new_matched_tokens(req, 2 * BS)
    conn.update_state_after_alloc(req, blocks, n)
    meta = conn.scheduler.build_connector_meta([("r", 2 * BS + n, len(new) - 2 * BS - n)], lambda _: ids)
    w.start_load(meta)
    conn.update_connector_output(SimpleNamespace(invalid_block_ids=w.take_load_errors()))
    loaded = set(meta.loads[0].block_ids)
    assert loaded and w.stats.relocated_blocks > 0  # its load was served (else the setup is wrong)
    if how == "preempted":
        out = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], preempted_req_ids={"r"},
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
        conn.build_connector_meta(out)
    else:
        conn.get_num_new_matched_tokens(req, 0)
        conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    # another request's load into the same (freed, reused) block ids fails
    conn.update_connector_output(SimpleNamespace(invalid_block_ids=loaded))
    _, kv = conn.request_finished(req, ids)
    assert SpliceAck.from_params(kv).relocated_tokens == 3 * BS



@pytest.mark.reliability
def test_a_plan_or_store_query_naming_another_tenants_salt_is_refused(kv_engine, text_tokens):
    """kv_transfer_params come from the client; its cache_salt is the tenant's (a gateway
    sets it from its auth).  A plan naming another tenant's src_salt loaded that tenant's
    KV (15 of 15 blocks bit for bit), and a store query answered what another salt holds
    (a guessing oracle).  Now both are refused by reason: plain prefill, no answer."""
    from promptsplice.blocks import chain_hashes, root_hash
    from promptsplice.engine_adapters import SplicePhase
    from promptsplice.engine_adapters.connector._served import answer_query, plan_verdict, splice_params

    victim, attacker = salt("victim"), salt("attacker")
    prompt = text_tokens[3500:3500 + 5 * BS + 3]
    kv_engine.generate(prompt, max_tokens=1, cache_salt=victim)
    plan = SplicePlan(BS, (SpliceSegment(0, 5, 0, bytes(root_hash(victim))),), src_salt=victim)
    before = kv_engine.counters()
    run = kv_engine.generate_phases(prompt, [SplicePhase(len(prompt), plan)], cache_salt=attacker, max_tokens=1)
    assert run.relocated_tokens == 0 and kv_engine.counters().since(before).external_hits == 0
    verdict = plan_verdict(splice_params(plan, prompt), prompt, BS, attacker)
    assert "another tenant" in verdict.reason
    assert plan_verdict(splice_params(plan, prompt), prompt, BS, f"{victim}\x1fscope").reason == ""  # its own scope
    query = [{"parent": bytes(root_hash(victim)).hex(), "salt": victim, "tokens": list(prompt[: 4 * BS])}]
    match = lambda refs, s: kv_engine.kv_store.match_prefix(refs, salt=s)  # noqa: E731
    assert answer_query(query, match, BS, victim) == ((4,), "")
    matched, why = answer_query(query, match, BS, attacker)
    assert matched == () and "another tenant" in why
    assert chain_hashes(prompt, BS, salt=victim)  # (the victim's blocks are there to be found)


def _random_lora(folder: Path, model: str) -> str:
    """A rank-8 LoRA on SmolLM2's k/v projections (576 -> 192, 30 layers), large enough
    to change what the model computes."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    t = {}
    for i in range(30):
        for name in ("k_proj", "v_proj"):
            t[f"base_model.model.model.layers.{i}.self_attn.{name}.lora_A.weight"] = (torch.randn(8, 576, generator=g) * 0.05).bfloat16()
            t[f"base_model.model.model.layers.{i}.self_attn.{name}.lora_B.weight"] = (torch.randn(192, 8, generator=g) * 0.5).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj"], "peft_type": "LORA",
        "base_model_name_or_path": model, "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
    }))
    return str(folder)


@pytest.mark.reliability
def test_a_lora_request_never_shares_store_blocks_with_the_base_model(tmp_path):
    """The store keyed blocks by tokens and salt only, while vLLM's own hash names the
    LoRA adapter: a base request after a LoRA request of the same tokens and salt missed
    vLLM's cache and loaded the LoRA's KV from the store (output changed)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from promptsplice.engine_adapters import EmbeddedEngine, _vllm

    mib = 1024 * 1024 * (1 if EngineConfig().dtype == "bfloat16" else 2)
    eng = EmbeddedEngine(kv_store=StoreConfig(dram_bytes=32 * mib), kv_cache_bytes=64 * mib, max_model_len=1024,
                         extra_kwargs={"enable_lora": True, "max_lora_rank": 8, "max_loras": 1})
    try:
        lora = LoRARequest("kv", 1, _random_lora(tmp_path / "lora", eng.config.model))
        toks = list(range(1000, 1200))

        def run(salt_: str, lr=None):
            with _vllm.agent_installed(eng._handle.kv):
                out = eng.llm.generate([{"prompt_token_ids": toks, "cache_salt": salt_}],
                                       SamplingParams(max_tokens=8, temperature=0.0), lora_request=lr, use_tqdm=False)[0]
            return list(out.outputs[0].token_ids), out.num_cached_tokens

        clean = run(salt("lora-clean"))
        shared = salt("lora-shared")
        with_lora = run(shared, lora)
        assert with_lora[0] != clean[0]  # the adapter changes what the model computes
        assert eng.kv_connector.worker.stats.saved_blocks >= 12  # both requests saved their 6 blocks
        base = run(shared)
        assert base == (clean[0], 0)  # nothing served from the LoRA's blocks, same answer
        eng.reset_prefix_cache()
        again = run(shared, lora)  # the LoRA's own blocks still come back from the store
        assert again == (with_lora[0], 192)
    finally:
        eng.close()


def test_assemblers_lay_prompts_out_on_what_the_store_loads_back(kv_engine, default_tok):
    """On an engine with a block store, blocks vLLM's own cache lost but the store holds
    load back (external hits), so the assembler's walk counts them: ``cache_aware``
    picks the order the store holds, although the mirror (vLLM's cache) is empty and a
    store-blind walk would pick the stable order.  Predictions stay vLLM's own cache."""
    from promptsplice.assembler import Assembler

    s = salt("store-aware")
    chunks = [{"id": k, "text": f"Passage {k}: " + " ".join(f"{k}{i} rows of the ledger held {i * 7}." for i in range(40))}
              for k in ("alpha", "beta", "gamma")]
    q = "What do the ledgers say?"
    blind = Assembler(default_tok, block_size=BS, policy="cache_aware", alignment="all")
    fresh = [seg.chunk_ids for seg in blind.preview(chunks, query=q, salt=s).segments if seg.chunk_ids]
    held = fresh[::-1]  # the order the store will hold: not the one a blind walk picks
    by_id = {c["id"]: c for c in chunks}
    first = kv_engine.make_assembler(policy="retrieval", alignment="all").assemble(
        [by_id[ids[0]] for ids in held], query=q, salt=s)
    kv_engine.generate(first, max_tokens=1)
    kv_engine.reset_prefix_cache()  # vLLM's cache and the mirror are empty; the store is not
    asm = kv_engine.make_assembler(policy="cache_aware", alignment="all")
    again = asm.assemble(chunks, query=q, salt=s)
    assert [seg.chunk_ids for seg in again.segments if seg.chunk_ids] == held
    assert again.predicted_cached_tokens == 0  # the mirror predicts vLLM's own cache
    before = kv_engine.counters()
    done = kv_engine.generate(again, max_tokens=1)
    assert done.num_cached_tokens == kv_engine.counters().since(before).external_hits >= len(first.token_ids) // BS * BS - BS


@pytest.mark.reliability
def test_scheduler_side_errors_become_plain_prefill_not_a_dead_engine():
    """vLLM's scheduler does not catch what the connector raises: a request whose salt
    was "" raised InvalidSaltError there and stopped the engine core for every tenant.
    Now the request gets no external tokens, and a step's other loads still go out."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters import BlockStore
    from tests.engine_adapters.connector._kv import BS, PAYLOAD, SALT

    store = BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0))
    toks = list(range(100, 100 + 4 * BS + 3))
    for ref in chain_refs(toks, BS, salt=SALT):
        store.put(ref, torch.zeros(4), salt=SALT)
    conn = scheduler_glue(store)
    conn.max_query_tokens = 1 << 18
    bad = SimpleNamespace(request_id="bad", prompt_token_ids=toks, cache_salt="", kv_transfer_params=None)
    good = SimpleNamespace(request_id="good", prompt_token_ids=toks, cache_salt=SALT, kv_transfer_params=None)
    ids = list(range(10, 15))
    blocks = SimpleNamespace(get_block_ids=lambda: (ids,))
    assert conn.get_num_new_matched_tokens(bad, 0) == (0, False)
    conn.update_state_after_alloc(bad, blocks, 0)
    assert conn.get_num_new_matched_tokens(good, 0) == (4 * BS, False)
    conn.update_state_after_alloc(good, blocks, 4 * BS)
    # a request whose state holds a salt that cannot be hashed (reached past the door)
    conn.scheduler.get_num_new_matched_tokens("odd", toks, "", len(toks), None)
    meta = conn.build_connector_meta(SimpleNamespace(
        num_scheduled_tokens={"odd": 2 * BS}, scheduled_new_reqs=[SimpleNamespace(req_id="odd", num_computed_tokens=0, block_ids=(ids,))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    ))
    assert [(item.req_id, item.block_ids) for item in meta.work.loads] == [("good", (10, 11, 12, 13))]
    assert meta.work.saves == [] and conn.scheduler._reqs["odd"].no_save
    assert conn.request_finished(bad, ids) == (False, None)


def test_a_request_the_connector_failed_on_says_so_in_its_ack():
    """The allocation fallback left a plan's ack as it was (applied, blocks loaded): a
    client read that its splice ran, though vLLM recomputed every block offered."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters import BlockStore
    from promptsplice.engine_adapters.connector._served import splice_params
    from tests.engine_adapters.connector._kv import BS, PAYLOAD, SALT, deletion_case

    store = BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0))
    _, new, plan, _ = deletion_case(store)
    conn = scheduler_glue(store)
    req = SimpleNamespace(request_id="r", prompt_token_ids=new, cache_salt=SALT, kv_transfer_params=splice_params(plan, new))
    assert conn.get_num_new_matched_tokens(req, 0) == (5 * BS, False)  # prefix 2 blocks + 3 relocated
    ids = list(range(10, 17))

    def broken(*args):
        raise RuntimeError("a bug in the allocation bookkeeping")

    conn._after_alloc = broken  # (no real part fails here on demand)
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), 5 * BS)
    reason, _, loaded, relocated, _ = conn._acks["r"]
    assert reason == "the splice connector failed on this request (RuntimeError): plain prefill"
    assert (loaded, relocated) == (0, 0)
    load = conn.scheduler._loads[0]
    assert (load.req_id, load.block_ids, load.refs) == ("r", (10, 11, 12, 13, 14), ())  # recomputed by vLLM


def _step_output(steps, ids_of):
    """A ``SchedulerOutput`` of new requests: ``steps`` ``(req_id, computed, scheduled)``."""
    from types import SimpleNamespace

    return SimpleNamespace(
        num_scheduled_tokens={r: n for r, _, n in steps},
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(ids_of[r],)) for r, c, _ in steps],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    )


@pytest.mark.reliability
def test_a_load_the_connector_could_not_build_marks_its_keys_when_it_fails():
    """When the allocation bookkeeping failed, the connector sent a load without a source
    (vLLM recomputes its blocks) but recorded nothing: the worker's report of those
    blocks marked no key, and a request aborted before recomputing them left vLLM's
    stale blocks under clean tenant keys, which later requests saved behind."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters import BlockStore
    from promptsplice.engine_adapters.connector._served import splice_params
    from tests.engine_adapters.connector._kv import BS, PAYLOAD, SALT, deletion_case

    store = BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0))
    _, new, plan, _ = deletion_case(store)
    conn = scheduler_glue(store)
    req = SimpleNamespace(request_id="r", prompt_token_ids=new, cache_salt=SALT, kv_transfer_params=splice_params(plan, new))
    assert conn.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
    ids = list(range(10, 17))

    def broken(*args):
        raise RuntimeError("a bug in the allocation bookkeeping")

    conn._after_alloc = broken  # (no real part fails here on demand)
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), 5 * BS)
    meta = conn.build_connector_meta(_step_output([("r", 5 * BS, 2 * BS)], {"r": ids}))
    assert [(item.req_id, item.block_ids, item.refs) for item in meta.work.loads] == [("r", (10, 11, 12, 13, 14), ())]
    conn.update_connector_output(SimpleNamespace(invalid_block_ids={10, 11, 12, 13, 14}))
    keys = [ref.key for ref in chain_refs(new[: len(new) // BS * BS], BS, salt=SALT)]
    assert list(conn.scheduler._tainted) == keys  # every key from the first failed block


@pytest.mark.reliability
def test_the_one_request_fallback_keeps_every_load_for_the_failure_report():
    """After a step it could not build, the connector builds each request alone; each of
    those builds ended a step, so from the third on the step's loads were forgotten
    before vLLM reported which of them failed, and their keys stayed clean."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters import BlockStore
    from tests.engine_adapters.connector._kv import BS, PAYLOAD, SALT

    store = BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0))
    prompts = {f"g{i}": list(range(1000 * i, 1000 * i + 4 * BS + 3)) for i in (1, 2, 3)}
    for toks in prompts.values():
        for ref in chain_refs(toks, BS, salt=SALT):
            store.put(ref, torch.zeros(4), salt=SALT)
    conn = scheduler_glue(store)
    conn.max_query_tokens = 1 << 18
    ids_of = {r: list(range(10 * i, 10 * i + 5)) for i, r in enumerate(prompts, 1)}
    for rid, toks in prompts.items():
        req = SimpleNamespace(request_id=rid, prompt_token_ids=toks, cache_salt=SALT, kv_transfer_params=None)
        assert conn.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
        conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda rid=rid: (ids_of[rid],)), 4 * BS)
    # a request whose state holds a salt that cannot be hashed: the whole step fails
    odd = list(range(9000, 9000 + 2 * BS + 1))
    conn.scheduler.get_num_new_matched_tokens("odd", odd, "", len(odd), None)
    ids_of["odd"] = [90, 91, 92]
    steps = [(r, 4 * BS, 3) for r in prompts] + [("odd", 0, 2 * BS)]
    meta = conn.build_connector_meta(_step_output(steps, ids_of))
    assert [item.req_id for item in meta.work.loads] == ["g1", "g2", "g3"]
    conn.update_connector_output(SimpleNamespace(invalid_block_ids={10, 20, 30}))
    marked = set(conn.scheduler._tainted)
    for toks in prompts.values():
        assert {ref.key for ref in chain_refs(toks, BS, salt=SALT)} <= marked


@pytest.mark.reliability
def test_a_request_sent_while_an_exception_is_handled_is_saved(kv_engine, measured):
    """The connector took any exception in flight at ``wait_for_save`` for a failed
    forward pass; in this engine the pass runs in the caller's thread, so a request sent
    inside an ``except`` block (a fallback: ``RagRunner``'s ``TOO_LONG`` request) was
    never stored, although its pass succeeded.  A pass that fails there still saves
    nothing."""
    from promptsplice.errors import EngineRequestError
    from tests.engine_adapters.test_engine_faults import layer_fault

    s = salt("in-except")
    worker, store = kv_engine.kv_connector.worker, kv_engine.kv_store
    prompt = [(13 * i + 5) % 40000 + 60 for i in range(330)]  # 10 full blocks
    failing = [(17 * i + 9) % 40000 + 60 for i in range(330)]
    refs, failing_refs = chain_refs(prompt, BS, salt=s), chain_refs(failing, BS, salt=s)
    assert len(refs) == len(failing_refs) == 10
    skipped0 = worker.stats.skipped_saves
    try:
        raise KeyError("the caller's own error, being handled")
    except KeyError:
        first = kv_engine.generate(prompt, max_tokens=2, cache_salt=s)
        with layer_fault(kv_engine), pytest.raises(EngineRequestError):
            kv_engine.generate(failing, max_tokens=2, cache_salt=s)
    store.drain()
    assert worker.stats.skipped_saves - skipped0 == 10  # the failed pass's blocks only
    assert store.match_prefix(refs, salt=s) == 10
    assert store.match_prefix(failing_refs, salt=s) == 0
    kv_engine.reset_prefix_cache()
    before = kv_engine.counters()
    again = kv_engine.generate(prompt, max_tokens=2, cache_salt=s)  # vLLM's cache is empty: the store
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == kv_engine.counters().since(before).external_hits == 320
    measured.update(saved_blocks_sent_in_except=store.match_prefix(refs, salt=s), reloaded_tokens=320,
                    failed_pass_blocks_skipped=10, failed_pass_blocks_stored=0)
