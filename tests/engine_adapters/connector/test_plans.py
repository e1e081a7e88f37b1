"""Splice plans without an engine: the wire format, the plan builders, the phases of
an edit, and the module's promise to import neither torch nor vLLM."""

from __future__ import annotations

import pytest

from promptsplice.blocks import chain_hashes, hash_block, root_hash
from promptsplice.engine_adapters import (
    SplicePhase,
    SplicePlan,
    SpliceSegment,
    plan_deletion,
    plan_phases,
    plan_relocation,
    plan_segment_phases,
)
from promptsplice.errors import InputError
from tests._imports import modules_after
from tests.engine_adapters.connector._kv import BS, SALT, toks


def test_plans_import_neither_torch_nor_vllm():
    for stmt in (
        "import promptsplice.engine_adapters.connector._plans",
        "import promptsplice.engine_adapters.connector",
    ):
        mods = modules_after(stmt)
        assert "promptsplice.engine_adapters.connector._plans" in mods
        assert not {m.split(".")[0] for m in mods} & {"torch", "vllm", "numpy"}, stmt


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


# ------------------------------------------------------------------- the phases of an edit


def test_plan_segment_phases_one_request_per_contiguous_run():
    a, b, c = (SpliceSegment(64, 2, -32, bytes(16)), SpliceSegment(128, 1, -32, bytes(16)),
               SpliceSegment(256, 1, 64, bytes(16)))
    phases = plan_segment_phases([a, b, c], 300, block_size=BS)
    # A plain request computes up to the first run, each run loads and computes up to the next.
    assert phases == [
        SplicePhase(64, SplicePlan(BS)),
        SplicePhase(256, SplicePlan(BS, (a, b))),
        SplicePhase(300, SplicePlan(BS, (c,))),
    ]
    # A run of fewer than min_group_blocks blocks after 0 is computed instead.
    assert plan_segment_phases([a, b, c], 300, block_size=BS, min_group_blocks=2) == phases[:1] + [
        SplicePhase(300, SplicePlan(BS, (a, b)))
    ]
    # The prefix cache already reaches the first run: no plain request.
    assert plan_segment_phases([c], 300, block_size=BS, hit=256) == [SplicePhase(300, SplicePlan(BS, (c,)))]
    assert plan_segment_phases([], 300, block_size=BS, scope=True) == [SplicePhase(300, SplicePlan(BS, scope=True))]
    with pytest.raises(InputError, match="overlaps"):
        plan_segment_phases([b, a], 300, block_size=BS)


def test_plan_phases_relocates_whole_blocks_and_recomputes_the_first_r():
    P, X, S = toks(64), toks(64, 5000), toks(128, 9000)
    old, new = P + X + S + [1], P + S + [2]
    old_keys = chain_hashes(old, BS, salt=SALT)
    (only,) = plan_phases(old, new, [(128, 256, -64)], block_size=BS, salt=SALT)
    # P hits the prefix cache, S's 4 blocks move by -64, the last token is computed.
    assert only == SplicePhase(len(new), SplicePlan(BS, (SpliceSegment(64, 4, -64, old_keys[3]),)))
    # r=1: S's first block is computed by a request of its own, the other 3 relocate.
    first, second = plan_phases(old, new, [(128, 256, -64)], block_size=BS, salt=SALT, recompute_blocks=1)
    assert first == SplicePhase(96, SplicePlan(BS))
    assert second.plan.segments == (SpliceSegment(96, 3, -64, old_keys[4]),)
    # A delta that is not a block multiple cannot move whole blocks: all computed.
    assert plan_phases(old, new[:32] + new[36:], [(128, 256, -68)], block_size=BS, salt=SALT) == [
        SplicePhase(len(new) - 4, SplicePlan(BS))
    ]
    # Scoped plans name the source salt and the scope on every phase.
    (scoped,) = plan_phases(old, new, [(128, 256, -64)], block_size=BS, salt="scope", src_salt=SALT, scope=True)
    assert scoped.plan.src_salt == SALT and scoped.plan.scope
    assert scoped.plan.segments[0].src_parent == old_keys[3]  # the old chain, under its own salt
    with pytest.raises(InputError, match="differ inside"):
        plan_phases(old, P + toks(128, 7000) + [2], [(128, 256, -64)], block_size=BS, salt=SALT)


def test_plan_phases_starts_a_run_where_the_prompts_shared_prefix_ends():
    # A moved message that begins with the header that stood there before: the run
    # old[128:256] -> new[64:192] starts inside the prompts' shared prefix P + H (96
    # tokens).  Its part there is exact where it stands: only old[160:256] moves, to 96.
    P, H, X, S = toks(64), toks(32, 3000), toks(32, 5000), toks(96, 9000)
    old, new = P + H + X + H + S + [1], P + H + S + [2]
    keys = chain_hashes(old, BS, salt=SALT)
    (only,) = plan_phases(old, new, [(128, 256, -64)], block_size=BS, salt=SALT)
    assert only == SplicePhase(len(new), SplicePlan(BS, (SpliceSegment(96, 3, -64, keys[4]),)))
    # Recompute starts at the edit (96), not inside the prefix.
    first, second = plan_phases(old, new, [(128, 256, -64)], block_size=BS, salt=SALT, recompute_blocks=1)
    assert first == SplicePhase(128, SplicePlan(BS))
    assert second.plan.segments == (SpliceSegment(128, 2, -64, keys[5]),)
    # A new scope loads the prefix from the old chain: the run follows it, no overlap.
    (scoped,) = plan_phases(
        old, new, [(128, 256, -64)], block_size=BS, salt="scope", src_salt=SALT, load_prefix=96, scope=True
    )
    assert scoped.plan.segments == (
        SpliceSegment(0, 3, 0, root_hash(SALT)),
        SpliceSegment(96, 3, -64, keys[4]),
    )
    # A run wholly inside the shared prefix moves nothing.
    assert plan_phases(old, new, [(0, 64, 0), (128, 256, -64)], block_size=BS, salt=SALT) == [only]


# ------------------------------------------------------------ probes (adaptive recompute)


def test_probe_segments_round_trip_through_the_wire_format():
    import json

    probe = SpliceSegment(32, 1, -64, root_hash("x"))
    plan = SplicePlan(BS, (SpliceSegment(64, 2, -64, bytes(16)),), "old", True, (probe,))
    params = plan.to_params()
    assert json.loads(json.dumps(params)) == params
    assert params["splice"]["probes"] == [{"dst_start": 32, "num_blocks": 1, "delta": -64, "src_parent": root_hash("x").hex()}]
    assert SplicePlan.from_params(params) == plan and SplicePlan.from_params(params).probes == (probe,)
    # A probe-only plan loads nothing (falsy) but still carries its probes.
    only = SplicePlan(BS, probes=(probe,))
    assert not only and SplicePlan.from_params(only.to_params()).probes == (probe,)
    assert "probes" not in SplicePlan(BS).to_params()["splice"]  # absent unless used
    bad = {"splice": {"version": 1, "block_size": 32, "segments": [], "probes": [{"dst_start": 16, "num_blocks": 1,
           "delta": 0, "src_parent": "00" * 16}]}}
    with pytest.raises(InputError, match="multiples"):
        SplicePlan.from_params(bad)
    with pytest.raises(InputError, match="probe 0 lacks"):
        SplicePlan.from_params({"splice": {"version": 1, "block_size": 32, "segments": [], "probes": [{}]}})


def test_plan_phases_probes_the_recomputed_blocks_in_the_request_that_computes_them():
    from promptsplice.engine_adapters.connector import extend_recompute

    P, X, S = toks(64), toks(64, 5000), toks(160, 9000)
    old, new = P + X + S + [1], P + S + [2]
    keys = chain_hashes(old, BS, salt=SALT)
    first, second = plan_phases(old, new, [(128, 288, -64)], block_size=BS, salt=SALT, recompute_blocks=2, probe=True)
    # Blocks 64..128 of the new prompt are recomputed by the first request: it probes them
    # against the old blocks at 128..192 (parent: the old block ending at 128).
    assert first == SplicePhase(128, SplicePlan(BS, probes=(SpliceSegment(64, 2, -64, keys[3]),)))
    assert second.plan.segments == (SpliceSegment(128, 3, -64, keys[5]),) and not second.plan.probes
    # Without probe=True the phases are today's.
    assert plan_phases(old, new, [(128, 288, -64)], block_size=BS, salt=SALT, recompute_blocks=2) == [
        SplicePhase(128, SplicePlan(BS)), second
    ]
    # One more block recomputed: a request computes block 128 (probed), the run starts at 160.
    extra, rest = extend_recompute(second, new)
    assert extra == SplicePhase(160, SplicePlan(BS, probes=(SpliceSegment(128, 1, -64, keys[5]),)))
    assert rest == SplicePhase(len(new), SplicePlan(BS, (SpliceSegment(160, 2, -64, keys[6]),)))
    extra2, rest2 = extend_recompute(rest, new)
    assert extra2.end == 192 and rest2.plan.segments == (SpliceSegment(192, 1, -64, keys[7]),)
    # The run's last block: one plain request computes the rest, probing it.
    (last,) = extend_recompute(rest2, new)
    assert last == SplicePhase(len(new), SplicePlan(BS, probes=(SpliceSegment(192, 1, -64, keys[7]),)))
    assert extend_recompute(last, new) is None


def test_compute_run_computes_the_whole_loaded_run_and_keeps_the_probes():
    """The RAG guard's answer to a run start that deviated: the phase's whole loaded run
    (its segments are contiguous: chunks that continue each other at recompute_at='run'
    included) computed in the request that would have loaded it, probing what it did."""
    from promptsplice.engine_adapters.connector import compute_run

    a, b = SpliceSegment(128, 3, -64, b"\x01" * 16), SpliceSegment(224, 2, 32, b"\x02" * 16)
    probe = SpliceSegment(288, 2, 0, b"\x03" * 16)
    phase = SplicePhase(352, SplicePlan(BS, (a, b), SALT, False, (probe,)))
    (only,) = compute_run(phase)
    assert only == SplicePhase(352, SplicePlan(BS, (), SALT, False, (probe,)))  # both segments computed
    assert compute_run(only) is None and compute_run(SplicePhase(352, None)) is None


def test_a_recomputed_request_reports_one_deviation_per_block():
    """vLLM may preempt a request and compute its prompt again: its blocks are probed
    twice, and the ack carries the latest measurement of each, in first-probed order."""
    from promptsplice.engine_adapters.connector._plans import BlockDeviation, latest_per_block

    a, b, c = (BlockDeviation(s, -32, (0.1 * i,), (0.2 * i,)) for i, s in enumerate((64, 96, 128), 1))
    again_a, again_b = a._replace(k=(0.5,)), b._replace(v=(0.7,))
    assert latest_per_block([a, b, c]) == (a, b, c)
    assert latest_per_block([a, b, again_a, again_b]) == (again_a, again_b)
    assert latest_per_block([a, b, c, again_b]) == (a, again_b, c)
    assert latest_per_block([]) == ()


def test_spans_runs_and_token_ids_that_are_not_ints_are_input_errors():
    """``int()`` read a span of (8.9, 16.2) as (8, 16), "8" as 8, and a token id 1.9 as
    1: prompts that differ were planned as sharing a prefix.  Each is an InputError;
    numpy's ints stay ints."""
    import numpy as np

    old, new = toks(96), toks(32) + toks(32, 64)
    import torch

    want = plan_deletion(old, new, (32, 64), block_size=BS)
    assert plan_deletion(np.array(old), new, (np.int64(32), 64), block_size=BS) == want
    assert plan_deletion(torch.tensor(old), torch.tensor(new), (torch.tensor(32), 64), block_size=BS) == want
    for span in ((32.0, 64), ("32", 64), (True, 64), (32,)):
        with pytest.raises(InputError, match="span must be .start, end. token positions .ints."):
            plan_deletion(old, new, span, block_size=BS)
    with pytest.raises(InputError, match=r"old_tokens must be a sequence of token ids \(ints\), got 1.9 at 0"):
        plan_deletion([1.9] + old[1:], new, (32, 64), block_size=BS)
    with pytest.raises(InputError, match="new_tokens must be a sequence of token ids"):
        plan_deletion(old, 5, (32, 64), block_size=BS)
    with pytest.raises(InputError, match=r"relocation 0 must be \(old_start, old_end, delta\) ints"):
        plan_phases(old, new, [(64.5, 96, -32)], block_size=BS)


def test_a_plans_save_exact_survives_every_rewrite_and_is_sent():
    """``save_exact`` (the opt-in lever that indexes chunks PIC requests compute) was lost
    where plans are rebuilt: the guard's ``extend_recompute`` and ``compute_run``, and
    probes attached to a phase; and a plan with no segments or probes (a phase that
    computes the deferred chunks) was not sent at all.  The runner then indexed chunks the
    connector never stored under the tenant's salt."""
    from promptsplice.engine_adapters._requests import sent_plan
    from promptsplice.engine_adapters.connector._plans import compute_run, extend_recompute

    prompt = toks(6 * BS, 100)
    plan = SplicePlan(BS, (SpliceSegment(2 * BS, 3, BS, root_hash(SALT)),), SALT, True,
                      (SpliceSegment(BS, 1, BS, root_hash(SALT)),), save_exact=True)
    phase = SplicePhase(len(prompt), plan)
    for rewritten in (extend_recompute(phase, prompt), compute_run(phase)):
        assert rewritten and all(ph.plan.save_exact and ph.plan.scope for ph in rewritten)
    assert [ph.plan.segments for ph in extend_recompute(phase, prompt)] == [
        (), (SpliceSegment(3 * BS, 2, BS, bytes(hash_block(root_hash(SALT), prompt[2 * BS : 3 * BS]))),)]
    bare = SplicePhase(len(prompt), SplicePlan(BS, (), SALT, True, save_exact=True))
    assert sent_plan(bare) is bare.plan
    assert sent_plan(SplicePhase(len(prompt), SplicePlan(BS, (), SALT, True))) is None  # a plain prefill
