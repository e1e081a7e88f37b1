"""The connector's scheduler side without an engine: how many tokens the store serves
after the local hit, the exact destination block ids, what each step saves; and the
module's promise to import neither torch nor vLLM."""

from __future__ import annotations

import pytest
import torch

from promptsplice.blocks import chain_hashes, root_hash
from promptsplice.engine_adapters import SplicePlan, SpliceSegment, chain_refs
from promptsplice.engine_adapters.connector._plans import approximate_tokens, in_place_blocks
from promptsplice.engine_adapters.connector._scheduler import SaveItem, SpliceScheduler, plan_load
from promptsplice.errors import InputError
from tests._imports import modules_after
from tests.engine_adapters.connector._kv import BS, SALT, deletion_case, fill_store, toks


def test_the_scheduler_side_imports_neither_torch_nor_vllm():
    mods = modules_after("import promptsplice.engine_adapters.connector._scheduler")
    assert "promptsplice.engine_adapters.connector._scheduler" in mods
    assert not {m.split(".")[0] for m in mods} & {"torch", "vllm"}


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


def test_a_step_that_fails_midway_keeps_the_loaded_blocks_to_save(store):
    """A whole-step build that raised on a later request had already cleared an earlier
    request's ``save_from``: the connector's per-request retry then saved only the blocks
    computed, never the loaded ones before them (a scope's later steps missed from 0)."""
    from promptsplice.engine_adapters.connector._scheduler import _ReqState

    sched = SpliceScheduler(store, BS)
    sched._reqs["a"] = _ReqState(toks(6 * BS + 1), SALT + "\x1fscope", None, save_from=0)
    sched._reqs["b"] = _ReqState(toks(4 * BS + 1, start=5000), SALT)

    def block_ids(req_id):
        if req_id == "b":
            raise RuntimeError("bad block table")
        return list(range(100, 110))

    steps = [("a", 2 * BS, 4 * BS), ("b", 0, 4 * BS)]
    with pytest.raises(RuntimeError, match="bad block table"):
        sched.build_connector_meta(steps, block_ids)
    work = sched.build_connector_meta(steps[:1], block_ids)
    assert [s.block_ids for s in work.saves] == [(100, 101, 102, 103, 104, 105)]  # blocks 0-1 loaded, 2-5 computed
    assert sched._reqs["a"].save_from is None


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


@pytest.mark.reliability
def test_a_later_request_over_relocated_blocks_of_the_tenant_saves_nothing(store):
    """A plan without a scope relocated KV under the tenant's own salt: vLLM's prefix
    cache then held those blocks under the new prompt's exact hashes, and a later plain
    request extending the prompt hit them and saved the blocks it computed after them
    under the tenant's exact chain keys (measured: 4 blocks, 3.7-5.5% off exact in the
    last layer, served by every tier as offload hits).  Derived salts are unaffected."""
    P, X, S = toks(2 * BS), toks(2 * BS, 5000), toks(3 * BS, 9000)
    old, new = P + X + S + [1, 2], P + S + toks(BS + 7, 20000)
    fill_store(store, old)
    moved = SplicePlan(BS, (SpliceSegment(2 * BS, 3, -2 * BS, chain_hashes(old, BS, salt=SALT)[3]),))

    run = _one_request

    sched = SpliceScheduler(store, BS)
    meta = run(sched, "splice", new, 2 * BS, params=moved.to_params())
    assert meta.loads[0].approximate() == 3 and meta.saves == []
    later = new + toks(2 * BS, 30000)  # the prefix cache serves new's 6 full blocks
    assert run(sched, "plain", later, 6 * BS).saves == []
    # a hit of every cacheable block (a prompt of whole blocks): its last block is still
    # computed, and was saved under its exact key (the taint check needs the chain)
    whole = later[: 7 * BS]
    assert run(sched, "retry", whole, 6 * BS).saves == []
    assert [r.key for s in run(SpliceScheduler(store, BS), "clean", whole, 6 * BS).saves for r in s.refs] == [
        chain_refs(whole, BS, salt=SALT)[6].key]  # untainted: saved
    other = P + toks(6 * BS, 40000)  # a hit of P alone (exact blocks): saved as before
    assert [r.key for s in run(sched, "exact", other, 2 * BS).saves for r in s.refs] == [
        r.key for r in chain_refs(other, BS, salt=SALT)[2:8]]
    scoped = f"{SALT}\x1fsplice-scope:abc"  # a scope's chains hold approximate KV by design
    fresh = SpliceScheduler(store, BS)
    assert run(fresh, "plain", later, 6 * BS).saves != []  # nothing tainted on this engine
    assert run(sched, "scope", later, 6 * BS, salt=scoped).saves != []


@pytest.mark.reliability
def test_blocks_in_place_after_other_tokens_are_approximate_and_nothing_after_them_is_saved(store):
    """A same-length edit before a run: the run's old blocks land where they were
    (delta 0), but they attended to other tokens. They load as approximate KV, counted
    as such, and what the request computes after them is never filed under its own,
    exact chain keys (a later exact request would load it as an offload hit)."""
    P, X, Y, S = toks(2 * BS), toks(2 * BS, 5000), toks(2 * BS, 7000), toks(3 * BS, 9000)
    old, new = P + X + S + [1, 2], P + Y + S + toks(40, 20000)  # one full block after S
    fill_store(store, old)
    old_chain = chain_hashes(old, BS, salt=SALT)
    stale = SplicePlan(BS, (SpliceSegment(4 * BS, 3, 0, old_chain[3]),))
    lp = plan_load(store, new, 4 * BS, block_size=BS, salt=SALT, plan=stale)
    assert lp.deltas == (0, 0, 0) and lp.approx == (True, True, True)
    assert [r.key for r in lp.refs] == old_chain[4:7]
    # the prefix P, planned where it was after the same (no) tokens: exact, an offload hit
    same = SplicePlan(BS, (SpliceSegment(0, 2, 0, root_hash(SALT)),))
    assert plan_load(store, new, 0, block_size=BS, salt=SALT, plan=same).approx == (False, False)
    assert approximate_tokens(stale, new, SALT) == 3 * BS and approximate_tokens(same, new, SALT) == 0
    assert in_place_blocks(same, new, SALT) == {0, 1} and in_place_blocks(stale, new, SALT) == set()
    moved = SplicePlan(BS, (SpliceSegment(2 * BS, 3, -2 * BS, old_chain[3]),))
    assert approximate_tokens(moved, new, SALT) == 3 * BS
    # in place from a session scope's chains (which may hold KV computed after relocated
    # KV) into a request under the tenant's salt: approximate, though its chain matches
    # (counted exact before, also in the served connector's ack); under the scope itself
    # it is the scope's own prefix hit
    scope = f"{SALT}\x1fsplice-scope:{'0' * 32}"
    fill_store(store, new, salt=scope)
    from_scope = SplicePlan(BS, (SpliceSegment(0, 2, 0, root_hash(scope)),), src_salt=scope)
    assert in_place_blocks(from_scope, new, SALT) == set() and approximate_tokens(from_scope, new, SALT) == 2 * BS
    assert plan_load(store, new, 0, block_size=BS, salt=SALT, plan=from_scope).approx == (True, True)
    assert in_place_blocks(from_scope, new, scope) == {0, 1}
    # an exact salt (an AgentRunner(scope="none")'s exact steps) holds exact KV only: its
    # unchanged prefix loaded in place stays exact (counted relocated after the scope fix)
    exact = f"{SALT}\x1fexact"
    from_exact = SplicePlan(BS, (SpliceSegment(0, 2, 0, root_hash(exact)),), src_salt=exact)
    assert in_place_blocks(from_exact, new, scope) == {0, 1} and approximate_tokens(from_exact, new, scope) == 0

    sched = SpliceScheduler(store, BS)
    n = sched.get_num_new_matched_tokens("r", new, SALT, 4 * BS, stale.to_params())
    assert n == 3 * BS
    ids = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    item = sched.update_state_after_alloc("r", ids, n)
    assert item.block_ids == (15, 16, 17) and item.approximate() == 3
    meta = sched.build_connector_meta([("r", 4 * BS + n, len(new) - 7 * BS)], lambda rid: ids)
    assert meta.loads == [item] and meta.saves == []  # the block after S: approximate, not stored
    sched.request_finished("r")


def test_a_served_plans_probes_cost_a_decode_step_no_more_than_a_plain_request():
    """A client may send one probe per full block; every decode step of its request
    sorted and scanned them all: 64 such requests of 32K tokens cost 3.1 ms of
    scheduler time per decode step against 0.02 ms without a plan (every tenant waits
    for the scheduler loop).  The probe blocks are sorted once and bisected."""
    import time

    from promptsplice.engine_adapters import BlockStore, StoreConfig
    from promptsplice.engine_adapters.connector._served import splice_params

    bs, n_tok, reqs = 16, 32768, 64
    toks = list(range(n_tok))
    plan = SplicePlan(bs, (), "t", False, tuple(SpliceSegment(j * bs, 1, 0, root_hash("t")) for j in range(n_tok // bs)))
    ids = list(range(n_tok // bs + 100))

    def per_step(params) -> float:
        sch = SpliceScheduler(BlockStore(StoreConfig(dram_bytes=1 << 20, write_behind_bytes=0)), bs)
        for i in range(reqs):
            sch.get_num_new_matched_tokens(f"r{i}", toks, "t", 0, params)
        sch.build_connector_meta([(f"r{i}", n_tok, 1) for i in range(reqs)], lambda _: ids)  # hashed once here
        t0 = time.perf_counter()
        for s in range(1, 21):
            sch.build_connector_meta([(f"r{i}", n_tok + s, 1) for i in range(reqs)], lambda _: ids)
        return (time.perf_counter() - t0) / 20

    assert per_step(splice_params(plan, toks)) < 30 * per_step(None) + 2e-4


def test_relocation_under_the_tenants_exact_salt_taints_it_as_the_tenants_own(store):
    """The derived ``exact`` salt holds exact KV only (``AgentRunner`` runs exact steps
    under it): the taint checks tested ``is_derived_salt``, so a relocation under it
    tainted nothing and a later request over those blocks saved what it computed after
    them under its exact keys."""
    exact = f"{SALT}\x1fexact"
    P, X, S = toks(2 * BS), toks(2 * BS, 5000), toks(3 * BS, 9000)
    old, new = P + X + S + [1, 2], P + S + toks(BS + 7, 20000)
    fill_store(store, old, salt=exact)
    moved = SplicePlan(BS, (SpliceSegment(2 * BS, 3, -2 * BS, chain_hashes(old, BS, salt=exact)[3]),))

    def run(sched, rid, tokens, hit, params=None):
        return _one_request(sched, rid, tokens, hit, salt=exact, params=params)

    sched = SpliceScheduler(store, BS)
    meta = run(sched, "splice", new, 2 * BS, params=moved.to_params())
    assert meta.loads[0].approximate() == 3 and meta.saves == []
    assert run(sched, "plain", new + toks(2 * BS, 30000), 6 * BS).saves == []  # was: saved under exact keys


def test_a_multimodal_request_over_tainted_text_blocks_saves_nothing(store):
    """A multimodal request's store keys are under its identity salt, but vLLM hashes
    its text blocks before the image as plain ones: its local hit could be the blocks a
    relocation left under the tenant's exact hashes, and it saved what it computed after
    them (the taint check ran on the identity chain, and skipped derived salts)."""
    from promptsplice.engine_adapters.connector._served import identity_salt

    P, X, S = toks(2 * BS), toks(2 * BS, 5000), toks(3 * BS, 9000)
    old, new = P + X + S + [1, 2], P + S + toks(BS + 7, 20000)
    fill_store(store, old)
    moved = SplicePlan(BS, (SpliceSegment(2 * BS, 3, -2 * BS, chain_hashes(old, BS, salt=SALT)[3]),))
    mm = identity_salt(SALT, '[["mm","img-1",200]]')

    run = _one_request

    sched = SpliceScheduler(store, BS)
    assert run(sched, "splice", new, 2 * BS, params=moved.to_params()).loads[0].approximate() == 3
    later = new + toks(2 * BS, 30000)
    # its first input after the hit: every block of the hit hashed as plain, tainted ones among them
    assert run(sched, "mm", later, 6 * BS, salt=mm, hit_salt=SALT, hit_limit=len(later)).saves == []
    assert run(sched, "mm-unchecked", later, 6 * BS, salt=mm).saves != []  # what it did before
    # an input at block 2: the tainted blocks (2-4) were hashed with it, never plain ones
    assert run(sched, "mm-early", later, 6 * BS, salt=mm, hit_salt=SALT, hit_limit=2 * BS).saves != []


def _one_request(sched, rid, tokens, hit, salt=SALT, params=None, **kw):
    """One request through the scheduler side, start to finish, on blocks 100-119: the
    step's metadata (its loads and saves)."""
    ids = list(range(100, 120))
    n = sched.get_num_new_matched_tokens(rid, tokens, salt, hit, params, **kw)
    sched.update_state_after_alloc(rid, ids, n)
    meta = sched.build_connector_meta([(rid, hit + n, len(tokens) - hit - n)], lambda r: ids)
    sched.request_finished(rid)
    return meta


@pytest.mark.reliability
def test_exact_offload_hits_before_a_relocated_run_stay_untainted(store):
    """A relocation whose local hit lost the system prompt loads it as exact offload
    hits, then the relocated run: only the run and what follows are tainted, so a
    later exact request over the system prompt still saves (until 2026-12-07 every
    loaded block was tainted, and every such request saved nothing)."""
    SYS, X, S = toks(4 * BS, 100), toks(2 * BS, 5000), toks(3 * BS, 9000)
    old, new = SYS + X + S + [1, 2], SYS + S + toks(10, 20000)
    fill_store(store, old)
    moved = SplicePlan(BS, (SpliceSegment(4 * BS, 3, -2 * BS, chain_hashes(old, BS, salt=SALT)[5]),))
    sched = SpliceScheduler(store, BS)
    meta = _one_request(sched, "splice", new, 0, params=moved.to_params())
    assert meta.loads[0].approx == (False,) * 4 + (True,) * 3
    chain = chain_hashes(new, BS, salt=SALT)
    assert [k in sched._tainted for k in chain] == [False] * 4 + [True] * 3
    other = SYS + toks(6 * BS, 40000)
    saved = _one_request(sched, "exact", other, 4 * BS).saves
    assert [r.key for s in saved for r in s.refs] == chain_hashes(other, BS, salt=SALT)[4:10]
    # and a request over the relocated run still saves nothing
    assert _one_request(sched, "over", new + toks(2 * BS, 30000), 7 * BS).saves == []


@pytest.mark.reliability
def test_the_taint_list_is_sized_from_the_kv_cache_and_warns_when_it_drops(store, caplog):
    """A KV cache of more than 32,768 blocks keeps more taints than 65,536: an idle
    tenant's approximate blocks must outlive their taint in vLLM's cache no longer
    (a reviewer's repro: 33 relocations of 2,048-block prompts dropped an earlier
    request's taints, and a hit over its blocks then saved under exact keys)."""
    from promptsplice.engine_adapters.connector._scheduler import tainted_bound

    assert tainted_bound(0) == tainted_bound(1000) == 65536 and tainted_bound(300_000) == 600_000
    assert SpliceScheduler(store, BS, num_blocks=300_000).max_tainted == 600_000
    old, new, plan, _ = deletion_case(store)
    sched = SpliceScheduler(store, BS)
    sched.max_tainted = 2  # the bound, made small: the oldest taints go, with one warning
    with caplog.at_level("WARNING"):
        _one_request(sched, "splice", new, 2 * BS, params=plan.to_params())
    assert len(sched._tainted) == 2 and sched.tainted_dropped == 1
    assert [m for m in caplog.messages if "tainted keys" in m]


def test_a_probe_block_split_by_a_chunked_prefill_boundary_is_measured(store):
    """A probe block whose first tokens one step computes and whose rest the next does
    is measured in the step that completes it (until 2026-12-07 in neither: the guard
    read it as unmeasured and paid one more request)."""
    old = toks(8 * BS, 100)
    fill_store(store, old)
    new = toks(2 * BS, 7000) + old[2 * BS :] + [5]
    parent = chain_hashes(old[: 2 * BS], BS, salt=SALT)[-1]
    plan = SplicePlan(BS, (), probes=(SpliceSegment(2 * BS, 1, 0, parent),))
    sched = SpliceScheduler(store, BS)
    n = sched.get_num_new_matched_tokens("r", new, SALT, 0, plan.to_params())
    sched.update_state_after_alloc("r", list(range(10)), n)
    ids = lambda r: list(range(10))  # noqa: E731
    first = sched.build_connector_meta([("r", 0, 80)], ids)
    second = sched.build_connector_meta([("r", 80, len(new) - 80)], ids)
    assert first.probes == [] and [p.starts for p in second.probes] == [(2 * BS,)]
    assert [s.block_ids for s in second.saves] == [(2, 3, 4, 5, 6, 7)]


REUSE = f"{SALT}\x1fpic:bounded:abc"  # a reuse salt: its chains may hold approximate KV


def _saved(meta, salt):
    return [(r.key, b) for s in meta.saves if s.salt == salt for r, b in zip(s.refs, s.block_ids)]


@pytest.mark.reliability
def test_a_scoped_request_saves_what_it_computes_exactly_under_the_tenants_salt_too(store):
    """A position-independent request (scoped to a reuse salt, its head loaded in place
    from the tenant's exact blocks) computes a new chunk before its first relocated
    run: that chunk is exact, so it is saved under the tenant's chain as well, where a
    chunk index finds it later (before, only under the reuse salt: 21,024 chunk tokens
    on wiki-diverse were computed again).  What follows a relocated run is not."""
    HEAD, NEW, X = toks(2 * BS, 100), toks(2 * BS, 5000), toks(2 * BS, 9000)
    old = HEAD + X + [1]
    fill_store(store, old)  # the tenant's exact head and X (computed after it)
    tenant = chain_hashes(old, BS, salt=SALT)
    head = SpliceSegment(0, 2, 0, root_hash(SALT))
    sched = SpliceScheduler(store, BS)
    first = HEAD + NEW + [7]  # phase 1: the head loaded, the new chunk computed
    meta = _one_request(sched, "p1", first, 0, salt=REUSE, params=SplicePlan(BS, (head,), SALT, True, save_exact=True).to_params())
    assert meta.loads[0].approx == (False, False)
    reuse, new_tenant = chain_hashes(first, BS, salt=REUSE), chain_hashes(first, BS, salt=SALT)
    assert _saved(meta, REUSE) == [(reuse[j], 100 + j) for j in range(4)]
    # the head's tenant blocks exist: only the new chunk's are saved there
    assert _saved(meta, SALT) == [(new_tenant[2], 102), (new_tenant[3], 103)]
    assert sched.exact_saved_blocks == 2
    # a later request whose local hit is those (known exact) blocks extends them exactly
    more = first[: 4 * BS] + toks(2 * BS + 1, 40000)
    meta = _one_request(sched, "more", more, 4 * BS, salt=REUSE, params=SplicePlan(BS, (), SALT, True, save_exact=True).to_params())
    assert _saved(meta, SALT) == [(k, 100 + j) for j, k in enumerate(chain_hashes(more, BS, salt=SALT)) if j >= 4]
    # phase 2: its local hit is phase 1's (clean) blocks; X relocated behind them
    second = HEAD + NEW + X + toks(BS + 3, 20000)
    moved = SplicePlan(BS, (SpliceSegment(4 * BS, 2, 2 * BS, tenant[1]),), SALT, True, save_exact=True)
    meta = _one_request(sched, "p2", second, 4 * BS, salt=REUSE, params=moved.to_params())
    assert meta.loads[0].approx == (True, True)
    assert _saved(meta, SALT) == []  # X and what follows it attended to relocated KV
    assert [k in sched._clean for k in chain_hashes(second, BS, salt=REUSE)] == [True] * 4 + [False] * 3
    # a later request over the relocated run computes nothing exact either
    third = second[: 7 * BS] + toks(BS + 1, 30000)
    assert _saved(_one_request(sched, "p3", third, 7 * BS, salt=REUSE,
                               params=SplicePlan(BS, (), SALT, True, save_exact=True).to_params()), SALT) == []


@pytest.mark.reliability
def test_a_block_computed_after_approximate_kv_is_no_longer_known_exact(store):
    """The same reuse-salt key can hold exact or approximate KV, depending on which
    request computed it last (vLLM evicted the other): a request that computes it after
    relocated KV takes it out of the known-exact set, and a later hit over it saves
    nothing under the tenant's salt; a scheduler that never saw a hit's blocks (a new
    engine, a dropped key) knows nothing exact either."""
    HEAD, A = toks(2 * BS, 100), toks(2 * BS, 5000)
    elsewhere = toks(BS, 777) + HEAD + [1]  # the head's tokens, computed one block later
    fill_store(store, HEAD + [1])
    fill_store(store, elsewhere)
    head = SpliceSegment(0, 2, 0, root_hash(SALT))
    plan = SplicePlan(BS, (head,), SALT, True, save_exact=True).to_params()
    sched = SpliceScheduler(store, BS)
    prompt = HEAD + A + [7]
    _one_request(sched, "exact", prompt, 0, salt=REUSE, params=plan)
    keys = chain_hashes(prompt, BS, salt=REUSE)
    assert [k in sched._clean for k in keys] == [True] * 4
    # vLLM evicted those blocks; the same tokens come again, the head relocated from
    # where it stood one block later: every block of the prompt is approximate now
    moved = SpliceSegment(0, 2, -BS, chain_hashes(elsewhere, BS, salt=SALT)[0])
    meta = _one_request(sched, "approx", prompt, 0, salt=REUSE, params=SplicePlan(BS, (moved,), SALT, True, save_exact=True).to_params())
    assert meta.loads[0].approx == (True, True) and _saved(meta, SALT) == []
    assert [k in sched._clean for k in keys] == [False] * 4
    later = prompt[: 4 * BS] + toks(2 * BS + 1, 30000)
    meta = _one_request(sched, "later", later, 4 * BS, salt=REUSE, params=plan)
    assert _saved(meta, SALT) == [] and len(_saved(meta, REUSE)) == 2
    fresh = SpliceScheduler(store, BS)
    meta = _one_request(fresh, "new-engine", later, 4 * BS, salt=REUSE, params=plan)
    assert _saved(meta, SALT) == []


def test_requests_under_a_reuse_salt_without_a_scope_save_nothing_under_the_tenants(store):
    """A plain request under the reuse salt (a plan that did not fit) is tracked, and
    its exact blocks are known exact, but only a scoped plan names the tenant's salt."""
    sched = SpliceScheduler(store, BS)
    prompt = toks(4 * BS + 1, 100)
    meta = _one_request(sched, "plain", prompt, 0, salt=REUSE)
    assert _saved(meta, SALT) == [] and len(_saved(meta, REUSE)) == 4
    assert all(k in sched._clean for k in chain_hashes(prompt, BS, salt=REUSE))
    assert _one_request(sched, "tenant", prompt, 0).saves  # the tenant's own: untracked
    assert len(sched._clean) == 4


def _head_plan(scope=True):
    """The RAG runner's head: loaded in place from the tenant's exact chain."""
    return SplicePlan(BS, (SpliceSegment(0, 2, 0, root_hash(SALT)),), SALT, scope, save_exact=True).to_params()


_SCOPED = SplicePlan(BS, (), SALT, True, save_exact=True).to_params()  # no segment: what a phase past its loads sends


@pytest.mark.reliability
def test_a_key_once_approximate_stays_unknown_when_an_exact_copy_comes_after(store):
    """vLLM keeps several blocks under one key and a hit takes the first: R2 loads
    relocated KV under K2, K3 while R1 (chunked prefill) has yet to compute them; R1's
    exact copies come second.  The key once filed approximate stays dirty, so R3 over
    them saves nothing under the tenant's salt (a review's repro of the first version:
    R3's 2 blocks were saved there).  R1's own blocks are exact: saved."""
    HEAD, A = toks(2 * BS, 100), toks(2 * BS, 5000)
    elsewhere = toks(BS, 777) + A + [1]
    fill_store(store, HEAD + A + [1])
    fill_store(store, elsewhere, seed=2)
    sched = SpliceScheduler(store, BS)
    ids1, ids2, ids3 = list(range(100, 120)), list(range(200, 220)), list(range(300, 320))
    r1 = HEAD + A + toks(2 * BS + 1, 20000)
    n = sched.get_num_new_matched_tokens("R1", r1, REUSE, 0, _head_plan())
    sched.update_state_after_alloc("R1", ids1, n)
    sched.build_connector_meta([("R1", n, 16)], lambda r: ids1)  # half of block 2
    r2 = HEAD + A + toks(BS + 3, 30000)
    moved = SplicePlan(BS, (SpliceSegment(2 * BS, 2, BS, chain_hashes(elsewhere, BS, salt=SALT)[0]),), SALT, True, save_exact=True)
    n2 = sched.get_num_new_matched_tokens("R2", r2, REUSE, 2 * BS, moved.to_params())
    assert sched.update_state_after_alloc("R2", ids2, n2).approx == (True, True)
    sched.build_connector_meta([("R2", 2 * BS + n2, len(r2) - 2 * BS - n2)], lambda r: ids2)
    meta = sched.build_connector_meta([("R1", n + 16, len(r1) - n - 16)], lambda r: ids1)
    tenant1 = chain_hashes(r1, BS, salt=SALT)
    # R1's own blocks are exact: saved (blocks 2, 3, A after the head, were stored already)
    assert _saved(meta, SALT) == [(tenant1[j], 100 + j) for j in (4, 5)]
    keys = chain_hashes(r1, BS, salt=REUSE)
    # (R1's last two are exact too, and only R1 filed them: a hit reaches them through K2, K3)
    assert [k in sched._clean and k not in sched._dirty for k in keys] == [True, True, False, False, True, True]
    r3 = HEAD + A + toks(2 * BS, 40000) + [9]
    n3 = sched.get_num_new_matched_tokens("R3", r3, REUSE, 4 * BS, _SCOPED)
    sched.update_state_after_alloc("R3", ids3, n3)
    meta = sched.build_connector_meta([("R3", 4 * BS + n3, len(r3) - 4 * BS - n3)], lambda r: ids3)
    assert _saved(meta, SALT) == [] and len(_saved(meta, REUSE)) == 2


@pytest.mark.reliability
def test_a_request_scheduled_in_the_same_step_never_trusts_blocks_filed_before_the_step_is_built(store):
    """vLLM caches a request's blocks when it schedules it: RB, scheduled after RA in one
    step, hits RA's relocated head before any metadata is built.  RA's blocks are dirty
    from its scheduling on (the first version marked them at the step's build: RB's 2
    blocks were saved under the tenant's salt)."""
    HEAD = toks(2 * BS, 100)
    elsewhere = toks(BS, 777) + HEAD + [1]
    fill_store(store, HEAD + [1])
    fill_store(store, elsewhere, seed=2)
    sched = SpliceScheduler(store, BS)
    prompt = HEAD + toks(2 * BS, 5000) + [7]
    _one_request(sched, "R1", prompt, 0, salt=REUSE, params=_head_plan())
    assert all(k in sched._clean for k in chain_hashes(prompt, BS, salt=REUSE))
    ida, idb = list(range(200, 220)), list(range(300, 320))
    ra = HEAD + toks(BS + 5, 60000)
    mv = SplicePlan(BS, (SpliceSegment(0, 2, -BS, chain_hashes(elsewhere, BS, salt=SALT)[0]),), SALT, True, save_exact=True)
    na = sched.get_num_new_matched_tokens("RA", ra, REUSE, 0, mv.to_params())
    assert sched.update_state_after_alloc("RA", ida, na).approx == (True, True)
    rb = HEAD + toks(2 * BS, 40000) + [9]
    nb = sched.get_num_new_matched_tokens("RB", rb, REUSE, 2 * BS, _SCOPED)
    sched.update_state_after_alloc("RB", idb, nb)
    meta = sched.build_connector_meta([("RA", na, len(ra) - na), ("RB", 2 * BS + nb, len(rb) - 2 * BS - nb)],
                                      lambda r: ida if r == "RA" else idb)
    assert _saved(meta, SALT) == []


@pytest.mark.reliability
@pytest.mark.parametrize("variant", ["offload hits of the reuse salt", "a relocation without a scope"])
def test_blocks_loaded_without_a_scoped_plan_are_never_known_exact(store, variant):
    """A request under the reuse salt without a scoped plan (a plan that did not fit,
    sent plain: offload hits of the reuse salt's store, which scopes fill with
    approximate KV; or a plan without a scope) loaded approximate KV under keys the first
    version still held clean (it tracked what a request computed, not what it loaded):
    a later scoped request over them saved under the tenant's salt."""
    HEAD, A = toks(2 * BS, 100), toks(2 * BS, 5000)
    elsewhere = toks(BS, 777) + HEAD + [1]
    fill_store(store, HEAD + [1])
    fill_store(store, elsewhere, seed=2)
    sched = SpliceScheduler(store, BS)
    keys = chain_hashes(HEAD + A, BS, salt=REUSE)
    _one_request(sched, "R1", HEAD + A + [7], 0, salt=REUSE, params=_head_plan())
    if variant == "offload hits of the reuse salt":
        fill_store(store, HEAD + A + [7], salt=REUSE, seed=9)  # (the harness has no worker: R1 saved nothing)
        params, hit = None, 4 * BS
    else:
        params = SplicePlan(BS, (SpliceSegment(0, 2, -BS, chain_hashes(elsewhere, BS, salt=SALT)[0]),), SALT,
                            False).to_params()
        hit = 2 * BS
    r2 = HEAD + A + toks(BS + 1, 50000)
    meta = _one_request(sched, "R2", r2, 0, salt=REUSE, params=params)
    assert len(meta.loads[0].refs) == hit // BS
    assert not any(k in sched._clean for k in keys) and all(k in sched._dirty for k in keys)
    r3 = r2[:hit] + toks(2 * BS, 40000) + [9]
    assert _saved(_one_request(sched, "R3", r3, hit, salt=REUSE, params=_SCOPED), SALT) == []


@pytest.mark.reliability
def test_a_streaming_inputs_next_chunk_is_never_more_exact_than_what_it_held(store):
    """A resumable request's next input chunk extends its prompt in place and is
    allocated with no hit asked: its frontier went back to its first hit's (all exact),
    and 3 blocks computed after its relocated chunk were saved under the tenant's salt
    (a review's repro).  It keeps the frontier its loads set."""
    HEAD, A = toks(2 * BS, 100), toks(2 * BS, 5000)
    elsewhere = toks(BS, 777) + A + [1]
    fill_store(store, HEAD + [1])
    fill_store(store, elsewhere, seed=2)
    sched = SpliceScheduler(store, BS)
    prompt = HEAD + A + toks(5, 60000)  # vLLM's request.prompt_token_ids: extended in place
    plan = SplicePlan(BS, (SpliceSegment(0, 2, 0, root_hash(SALT)),
                           SpliceSegment(2 * BS, 2, -BS, chain_hashes(elsewhere, BS, salt=SALT)[0])), SALT, True, save_exact=True)
    ids = list(range(100, 120))
    n = sched.get_num_new_matched_tokens("S", prompt, REUSE, 0, plan.to_params())
    assert sched.update_state_after_alloc("S", ids, n).approx == (False, False, True, True)
    assert _saved(sched.build_connector_meta([("S", n, len(prompt) - n)], lambda r: ids), SALT) == []
    computed = len(prompt) + 2
    prompt.extend([7, 8] + toks(3 * BS, 90000))
    sched.update_state_after_alloc("S", (), 0)  # the next chunk: no hit asked
    meta = sched.build_connector_meta([("S", computed, len(prompt) - computed)], lambda r: ids)
    assert _saved(meta, SALT) == [] and sched._reqs["S"].exact_blocks == 2
    keys = chain_hashes(prompt, BS, salt=REUSE)
    assert all(k in sched._dirty for k in keys[2:])


@pytest.mark.reliability
def test_a_dropped_dirty_or_tainted_key_ends_what_its_salt_trusts(store, caplog):
    """The bounds assumed a block nobody hits leaves vLLM's cache after twice the cache of
    newer keys; a running request holds its blocks however long it decodes, and another
    tenant's traffic fills the bound (a review's repro: a relocated key dropped, an exact
    second copy made it clean, and a request over vLLM's first, approximate copy saved 3
    blocks under the tenant's salt).  A drop now ends trust in the dropped key's salt:
    known-exact under a reuse salt, saves after a hit under a tenant's."""
    HEAD, C = toks(2 * BS, 100), toks(2 * BS, 5000)
    elsewhere = toks(BS, 777) + C + [1]
    fill_store(store, HEAD + [1])
    fill_store(store, elsewhere, seed=2)
    relocate_c = SpliceSegment(2 * BS, 2, -BS, chain_hashes(elsewhere, BS, salt=SALT)[0])
    sched = SpliceScheduler(store, BS)
    sched.max_tainted = 8  # the bound, made small
    a = HEAD + C + toks(5, 60000)
    ids = list(range(100, 120))
    plan = SplicePlan(BS, (SpliceSegment(0, 2, 0, root_hash(SALT)), relocate_c), SALT, True, save_exact=True)
    n = sched.get_num_new_matched_tokens("A", a, REUSE, 0, plan.to_params())
    sched.update_state_after_alloc("A", ids, n)
    sched.build_connector_meta([("A", n, len(a) - n)], lambda r: ids)  # A decodes on, holding its blocks
    other = "tenant-b\x1fpic:bounded:xyz"
    with caplog.at_level("WARNING"):
        _one_request(sched, "traffic", toks(12 * BS, 700_000), BS, salt=other)  # its tail: 11 dirty keys
    assert sched.dirty_dropped > 0 and REUSE in sched._distrusted and [m for m in caplog.messages if "dirty keys" in m]
    r = HEAD + C[:BS]  # the first 3 blocks again: a second, exact copy of K2
    _one_request(sched, "R", r, 2 * BS, salt=REUSE)
    s = HEAD + C[:BS] + toks(3 * BS, 40000) + [9]
    assert _saved(_one_request(sched, "S", s, 3 * BS, salt=REUSE, params=_SCOPED), SALT) == []
    # under the tenant's own salt: a relocation without a scope, its taints pushed out
    taint = SpliceScheduler(store, BS)
    taint.max_tainted = 4
    n = taint.get_num_new_matched_tokens("A", a, SALT, 2 * BS, SplicePlan(BS, (relocate_c,)).to_params())
    taint.update_state_after_alloc("A", ids, n)
    other_src = toks(2 * BS, 3000)
    fill_store(store, other_src + [1], salt="tenant-b", seed=3)
    moved = SplicePlan(BS, (SpliceSegment(0, 1, -BS, chain_hashes(other_src, BS, salt="tenant-b")[0]),))
    _one_request(taint, "traffic", other_src[BS:] + toks(8 * BS, 800_000), 0, salt="tenant-b",
                 params=moved.to_params())
    assert taint.tainted_dropped > 0 and SALT in taint._taint_lost
    p = HEAD + C + toks(3 * BS, 40000) + [9]
    assert _one_request(taint, "P", p, 4 * BS).saves == []


def test_a_resumed_request_whose_hit_reaches_its_own_output_is_not_an_error(store):
    """Preempted, then resumed: vLLM's local hit covers its generated blocks too.  The
    known-exact walk indexed past the prompt's chain (IndexError: the connector dropped
    the request's state); those blocks are simply not known."""
    sched = SpliceScheduler(store, BS)
    p = toks(3 * BS + 5, 100)
    _one_request(sched, "P", p, 0, salt=REUSE)
    assert sched.get_num_new_matched_tokens("P2", p, REUSE, 4 * BS) == 0
    assert sched._reqs["P2"].hit_exact == 3


@pytest.mark.reliability
@pytest.mark.parametrize("salt", [SALT, REUSE])
def test_a_failed_load_leaves_its_keys_untrusted_after_the_quarantine(store, salt):
    """vLLM may keep a block whose load failed in its prefix cache, stale, until the
    request recomputes it; a request aborted first never does.  The worker skips two
    steps' saves, and then a hit over the stale block saved what it computed after it
    (under the tenant's salt: a normal save; under a reuse salt: a dual save of blocks
    whose hit was "known exact").  The report of failed blocks now taints (or dirties)
    the request's keys from its first failed block on (a review's repro, 2026-12-07)."""
    import torch

    from tests.engine_adapters.connector._kv import HD, HEADS, LAYERS, random_caches, worker

    HEAD = toks(4 * BS, 100)
    fill_store(store, HEAD + [1], blocks={0, 1, 3})
    bad = torch.randn(LAYERS, 1, HEADS, BS, 2 * HD)  # float32: the engine's bf16 load refuses it
    store.put(chain_refs(HEAD, BS, salt=SALT)[2], bad, salt=SALT)
    sched = SpliceScheduler(store, BS)
    w = worker(store, random_caches())
    params = SplicePlan(BS, (SpliceSegment(0, 4, 0, root_hash(SALT)),), SALT, True, save_exact=True).to_params() if salt == REUSE else None
    r = HEAD + toks(3 * BS, 5000) + [7]
    ids = list(range(0, 8))
    n = sched.get_num_new_matched_tokens("R", r, salt, 0, params)
    sched.update_state_after_alloc("R", ids, n)
    meta = sched.build_connector_meta([("R", n, BS)], lambda q: ids)
    w.start_load(meta, per_layer=True)
    for name in w.names:
        w.wait_for_layer(name)
    w.save(meta)
    errors = w.take_load_errors()
    assert sorted(errors) == [2, 3]
    assert sched.loads_failed(errors) == 7 - 2  # the request's keys from block 2 on
    sched.request_finished("R")  # aborted before it recomputed them
    for _ in range(2):
        assert sched.loads_failed(()) == 0
        sched.build_connector_meta([], lambda q: [])
    x = HEAD + toks(2 * BS, 9000) + [3]
    meta = _one_request(sched, "X", x, 4 * BS, salt=salt, params=_SCOPED if salt == REUSE else None)
    assert _saved(meta, SALT) == []


def test_a_request_told_to_stop_saving_saves_under_no_salt(store):
    """The connector builds each request alone after a step it could not build, and a
    request that fails there saves nothing more: its dual saves under the tenant's
    salt went on (a review, 2026-12-07)."""
    HEAD = toks(2 * BS, 100)
    fill_store(store, HEAD + [1])
    sched = SpliceScheduler(store, BS)
    prompt = HEAD + toks(4 * BS, 5000) + [7]
    ids = list(range(100, 120))
    n = sched.get_num_new_matched_tokens("R", prompt, REUSE, 0, _head_plan())
    sched.update_state_after_alloc("R", ids, n)
    first = sched.build_connector_meta([("R", n, BS)], lambda r: ids)
    assert _saved(first, SALT) and _saved(first, REUSE)
    sched.stop_saving("R")
    assert sched.build_connector_meta([("R", n + BS, len(prompt) - n - BS)], lambda r: ids).saves == []


def test_only_a_plan_that_asks_saves_exact_blocks_under_the_tenants_salt(store):
    """``save_exact`` is opt-in (``RagRunner(index_computed=True)``): a scoped plan
    without it (the agent runner's, the RAG runner's default) saves under its scope
    only, and the flag survives the wire."""
    HEAD = toks(2 * BS, 100)
    fill_store(store, HEAD + [1])
    prompt = HEAD + toks(2 * BS, 5000) + [7]
    plain = SplicePlan(BS, (SpliceSegment(0, 2, 0, root_hash(SALT)),), SALT, True)
    meta = _one_request(SpliceScheduler(store, BS), "R", prompt, 0, salt=REUSE, params=plain.to_params())
    assert _saved(meta, SALT) == [] and len(_saved(meta, REUSE)) == 4
    asks = SplicePlan(BS, plain.segments, SALT, True, save_exact=True)
    assert SplicePlan.from_params(asks.to_params()) == asks and "save_exact" not in str(plain.to_params())
    meta = _one_request(SpliceScheduler(store, BS), "R", prompt, 0, salt=REUSE, params=asks.to_params())
    assert len(_saved(meta, SALT)) == 2
    with pytest.raises(InputError, match="save_exact must be a bool"):
        SplicePlan(BS, (), SALT, True, save_exact=1)


def test_distrusted_salts_fold_into_their_tenants_beyond_a_bound(store):
    """A salt whose dirty key the bound dropped stays distrusted; with a scope salt per
    agent session the set grew by one per session for good (a review: 173 -> 1,673 over
    2,000 sessions).  Beyond ``max_distrusted`` it folds into the salts' tenants: every
    derived salt of those tenants is distrusted (sound: coarser, never less), others not."""
    sched = SpliceScheduler(store, BS)
    sched.max_tainted, sched.max_distrusted = 4, 8
    for s in range(40):
        salt = f"tenant-a\x1fsplice-scope:{s:04x}"
        sched._mark_dirty(chain_refs(toks(3 * BS, 1000 * s), BS, salt=salt), salt)
        assert len(sched._distrusted) <= sched.max_distrusted + 1
    assert sched._distrusted_tenants == {"tenant-a"}
    assert sched._is_distrusted("tenant-a\x1fsplice-scope:0000") and sched._is_distrusted("tenant-a\x1fsplice-scope:new")
    assert not sched._is_distrusted("tenant-b\x1fsplice-scope:0000")
    assert not sched._is_distrusted(None)
