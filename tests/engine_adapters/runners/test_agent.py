"""Agent steps on the engine: the phase planner (pure) and AgentRunner's three modes on
the real engine, scoping of spliced KV, chained edits and fallbacks."""

from __future__ import annotations

import logging

import pytest

from promptsplice.assembler import ContextHook, StepKind, TruncateToolOutputs
from promptsplice.engine_adapters import (
    AgentRunner,
    SplicePhase,
    SplicePlan,
    SpliceSegment,
    StepFallback,
    plan_phases,
)
from promptsplice.blocks import chain_hashes, root_hash
from promptsplice.errors import ConfigError, InputError

# -------------------------------------------------------------------- plan_phases (pure)

BS4 = 4


def seq(start, n):
    return list(range(start, start + n))


A, X, B, Y, C = seq(100, 8), seq(200, 4), seq(300, 8), seq(400, 4), seq(500, 8)
R, T = seq(600, 4), seq(700, 3)


def parent(tokens, salt=None):
    return chain_hashes(tokens, BS4, salt=salt)[-1] if tokens else root_hash(salt)


def test_a_deletion_is_one_request_that_relocates_after_the_hit():
    old, new = A + X + B + C, A + B + C + T
    phases = plan_phases(old, new, [(12, 28, -4)], block_size=BS4)
    assert phases == [SplicePhase(27, SplicePlan(BS4, (SpliceSegment(8, 4, -4, parent(old[:12])),)))]


def test_recomputed_blocks_after_an_edit_need_a_prefill_phase_first():
    old, new = A + X + B + C, A + B + C + T
    phases = plan_phases(old, new, [(12, 28, -4)], block_size=BS4, recompute_blocks=1)
    assert phases == [
        SplicePhase(12, SplicePlan(BS4)),  # computes B's first block after the hit A
        SplicePhase(27, SplicePlan(BS4, (SpliceSegment(12, 3, -4, parent(old[:16])),))),
    ]


def test_a_replacement_then_two_runs_with_different_deltas():
    old = A + X + B + Y + C
    new = A + R + B + C + T  # X -> R (same length), Y deleted
    phases = plan_phases(old, new, [(12, 20, 0), (24, 32, -4)], block_size=BS4, salt="s")
    segs = (SpliceSegment(12, 2, 0, parent(old[:12], "s")), SpliceSegment(20, 2, -4, parent(old[:24], "s")))
    assert phases == [SplicePhase(12, SplicePlan(BS4)), SplicePhase(31, SplicePlan(BS4, segs))]


def test_a_new_scope_loads_the_prefix_from_the_old_salt():
    old = A + X + B + Y + C
    new = A + R + B + C + T
    phases = plan_phases(
        old, new, [(12, 20, 0), (24, 32, -4)], block_size=BS4, salt="scope", src_salt="tenant",
        load_prefix=8, scope=True,
    )
    p0 = SpliceSegment(0, 2, 0, root_hash("tenant"))
    rest = (SpliceSegment(12, 2, 0, parent(old[:12], "tenant")), SpliceSegment(20, 2, -4, parent(old[:24], "tenant")))
    assert phases == [
        SplicePhase(12, SplicePlan(BS4, (p0,), "tenant", True)),  # loads A, computes R
        SplicePhase(31, SplicePlan(BS4, rest, "tenant", True)),
    ]
    assert phases[1].plan.to_params()["splice"]["src_salt"] == "tenant"
    assert SplicePlan.from_params(phases[1].plan.to_params()) == phases[1].plan


def test_a_short_run_is_not_worth_a_request_of_its_own():
    old = A + X + B + Y + C
    new = A + R + B + C + T
    runs = [(12, 20, 0), (24, 32, -4)]  # one group of 4 blocks after the computed R
    assert plan_phases(old, new, runs, block_size=BS4, min_group_blocks=5) == [SplicePhase(31, SplicePlan(BS4))]
    assert len(plan_phases(old, new, runs, block_size=BS4, min_group_blocks=4)) == 2
    # the prefix load of a new scope is never dropped: without it the prefix is computed
    phases = plan_phases(old, new, runs, block_size=BS4, load_prefix=8, scope=True, min_group_blocks=5)
    assert [ph.end for ph in phases] == [31] and phases[0].plan.segments[0].dst_start == 0


def test_runs_that_cannot_move_whole_blocks_are_computed():
    old, new = A + X + B + C, A + X[:3] + B + C + T  # delta -1: not a block multiple
    assert plan_phases(old, new, [(12, 28, -1)], block_size=BS4) == [SplicePhase(len(new), SplicePlan(BS4))]
    # the last request keeps at least one token to compute: the run stops before it
    old, new = A + X + B, A + B + [1]
    (phase,) = plan_phases(old, new, [(12, 20, -4)], block_size=BS4)
    assert phase.plan.segments == (SpliceSegment(8, 2, -4, parent(old[:12])),) and phase.end == 17


def test_bad_relocations_are_refused():
    old, new = A + X + B + C, A + B + C + T
    with pytest.raises(InputError, match="differ inside the run"):
        plan_phases(old, A + C + B + T, [(12, 28, -4)], block_size=BS4)
    with pytest.raises(InputError, match="outside the prompts"):
        plan_phases(old, new, [(12, 99, -4)], block_size=BS4)
    with pytest.raises(InputError, match="overlaps"):
        plan_phases(old, new, [(12, 28, -4), (16, 20, -4)], block_size=BS4)
    with pytest.raises(InputError, match=r"\(old_start, old_end, delta\)"):
        plan_phases(old, new, [(12, 28)], block_size=BS4)
    with pytest.raises(ConfigError, match="recompute_blocks"):
        plan_phases(old, new, [], block_size=BS4, recompute_blocks=-1)
    with pytest.raises(InputError, match="load_prefix"):
        plan_phases(old, new, [], block_size=BS4, load_prefix=12)


# ------------------------------------------------------------------ the real engine

TOOLS = [{"type": "function", "function": {"name": "grep", "description": "search files",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def call(cid, q):
    return {"id": cid, "type": "function", "function": {"name": "grep", "arguments": f'{{"q": "{q}"}}'}}


@pytest.fixture(scope="module")
def renders(text_tokens_text):
    """Three renders of one session: a long tool output, then more calls (appends),
    then the ten-line rule truncates the first output: an edit with context after it."""
    lines = text_tokens_text
    system = {"role": "system", "content": "You are a code agent. Answer briefly."}
    user = {"role": "user", "content": "Where is the scheduler configured?"}
    out1 = "\n".join(lines[:40])
    out2 = "\n".join(lines[40:52])
    msgs = [system, user, {"role": "assistant", "content": "", "tool_calls": [call("c1", "sched")]},
            {"role": "tool", "tool_call_id": "c1", "content": out1}]
    r1 = list(msgs)
    msgs += [{"role": "assistant", "content": "", "tool_calls": [call("c2", "config")]},
             {"role": "tool", "tool_call_id": "c2", "content": out2}]
    r2 = list(msgs)
    r3 = TruncateToolOutputs(max_lines=10, keep_recent=1).apply(r2).messages + [
        {"role": "user", "content": "Now in one sentence: what did you find?"}]
    assert r3[3]["content"] != out1 and r3[5]["content"] == out2
    return [r1, r2, r3]


@pytest.fixture(scope="module")
def text_tokens_text():
    from promptsplice.benchmarks.traces import load_wiki_leads

    return [lead.split(". ")[0][:160] for _, lead in load_wiki_leads()[300:360]]


def run_session(runner, engine, sid, renders, salt):
    hook = ContextHook(engine.tokenizer, block_size=engine.block_size, salt=salt)
    out = []
    for msgs in renders:
        prepared = hook(sid, msgs, TOOLS)
        out.append((prepared, runner.step(prepared, max_tokens=4)))
    return out


def test_splice_relocates_what_follows_the_edit_and_prefills_less_than_apc(engine, kv_engine, renders):
    apc = run_session(AgentRunner(engine, mode="apc", salt="t-apc"), engine, "s1", renders, "t-apc")
    runner = AgentRunner(kv_engine, mode="splice", salt="t-splice", recompute_blocks=1, fidelity="bounded")
    spl = run_session(runner, kv_engine, "s1", renders, "t-splice")
    kinds = [p.kind for p, _ in spl]
    assert kinds == [StepKind.NEW_SESSION, StepKind.APPEND, StepKind.EDIT]
    for (p, a), (_, s) in zip(apc, spl):
        assert a.prompt_tokens == s.prompt_tokens == len(p.token_ids)
        # cached_tokens means what RagStep's means: vLLM's num_cached_tokens (prefix
        # cache + connector loads), the relocated tokens a part of it
        assert s.prompt_tokens == s.prefill_tokens + s.cached_tokens and s.relocated_tokens <= s.cached_tokens
    prepared, step = spl[2]
    bs = kv_engine.block_size
    phases = plan_phases(
        prepared.previous.token_ids, prepared.token_ids, prepared.diff.relocations, block_size=bs,
        recompute_blocks=1, salt=step.salt, src_salt="t-splice",
        load_prefix=prepared.first_changed_token // bs * bs, scope=True,
    )
    moved = sum(s.num_blocks * bs for ph in phases for s in ph.plan.segments if s.delta)
    assert moved > 0 and step.relocated_tokens == moved and step.requests == len(phases)
    assert step.fallback is None and step.salt != "t-splice"  # the session is scoped now
    assert step.prefill_tokens < apc[2][1].prefill_tokens
    assert apc[2][1].relocated_tokens == 0 and apc[1][1].prefill_tokens == spl[1][1].prefill_tokens


@pytest.mark.reliability
def test_spliced_kv_never_reaches_a_request_outside_the_session(kv_engine, renders):
    runner = AgentRunner(kv_engine, mode="splice", salt="t-iso", fidelity="bounded")
    steps = run_session(runner, kv_engine, "s-iso", renders, "t-iso")
    prepared, step = steps[2]
    assert step.relocated_tokens > 0
    bs = kv_engine.block_size
    exact = prepared.first_changed_token // bs * bs  # what the tenant's exact blocks cover
    before = kv_engine.counters()
    outside = kv_engine.generate(prepared.token_ids, max_tokens=1, cache_salt="t-iso")
    assert outside.num_cached_tokens == exact
    assert kv_engine.counters().since(before).external_hits == 0
    # opting in with the session's salt reuses the whole spliced context
    inside = kv_engine.generate(prepared.token_ids, max_tokens=1, cache_salt=runner.session_salt("s-iso"))
    assert inside.num_cached_tokens == (len(prepared.token_ids) - 1) // bs * bs


@pytest.mark.reliability
def test_an_edit_step_that_failed_leaves_the_session_unscoped(kv_engine, renders):
    """The first splice of a session opens a scope salt; when its request fails (a
    decoder layer raises once, the engine survives), the retry must open one again: the
    session is still under the tenant's exact salt, where approximate KV is never filed."""
    import uuid

    from promptsplice.errors import EngineRequestError
    from tests.engine_adapters.test_engine_faults import layer_fault

    tenant = f"t-fail-{uuid.uuid4().hex[:8]}"
    runner = AgentRunner(kv_engine, mode="splice", salt=tenant, fidelity="bounded")
    hook = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt=tenant)
    for msgs in renders[:2]:
        runner.step(hook("s-fail", msgs, TOOLS), max_tokens=4)
    prepared = hook("s-fail", renders[2], TOOLS)
    assert prepared.kind is StepKind.EDIT
    with layer_fault(kv_engine), pytest.raises(EngineRequestError):
        runner.step(prepared, max_tokens=4)
    retry = runner.step(prepared, max_tokens=4)
    assert retry.salt != tenant and retry.salt == runner.session_salt("s-fail") and retry.relocated_tokens > 0
    # the tenant's salt still holds exact KV only: the edited prompt finds its unchanged
    # prefix (in vLLM's cache or, after the failed pass, the store), no more
    bs = kv_engine.block_size
    exact = prepared.first_changed_token // bs * bs
    before = kv_engine.counters()
    outside = kv_engine.generate(prepared.token_ids, max_tokens=1, cache_salt=tenant)
    assert outside.num_cached_tokens == exact and kv_engine.counters().since(before).external_hits <= exact


def test_a_second_edit_relocates_blocks_the_scope_saved(kv_engine, renders):
    """Chained edits: the scope keeps what it loaded and computed, so an edit of an
    already spliced context relocates again."""
    r4 = renders[2][:2] + renders[2][4:]  # drop the (truncated) first call and its output
    runner = AgentRunner(kv_engine, mode="splice", salt="t-chain", recompute_blocks=0, fidelity="bounded")
    steps = run_session(runner, kv_engine, "s-chain", [*renders, r4], "t-chain")
    assert [p.kind for p, _ in steps][2:] == [StepKind.EDIT, StepKind.EDIT]
    assert steps[2][1].relocated_tokens > 0 and steps[3][1].relocated_tokens > 0
    assert steps[3][1].salt == steps[2][1].salt  # one scope for the session


def test_a_repeated_tool_output_is_relocated_on_an_append_step(kv_engine, renders):
    """The agent repeats a call and gets the same output: that message equals one of
    the previous render, so its blocks move from there instead of being prefilled."""
    first = renders[1]
    again = first + [{"role": "assistant", "content": "", "tool_calls": [call("c3", "sched")]},
                     {"role": "tool", "tool_call_id": "c3", "content": first[3]["content"]}]
    runner = AgentRunner(kv_engine, mode="splice", salt="t-rep", recompute_blocks=0, fidelity="bounded")
    steps = run_session(runner, kv_engine, "s-rep", [first, again], "t-rep")
    prepared, step = steps[1]
    assert prepared.kind is StepKind.APPEND
    seg = next(sg for sg in prepared.render.segments if sg.message_index == 7)
    old = next(sg for sg in prepared.previous.segments if sg.message_index == 3)
    assert (seg.key, seg.padding) == (old.key, old.padding)
    seen = {(o.key, o.padding) for o in prepared.previous.body_segments}
    repeated = [sg for sg in prepared.render.segments if sg.message_index in (6, 7) and (sg.key, sg.padding) in seen]
    assert seg in repeated  # (the repeated call itself renders like the first one too)
    assert step.relocated_tokens == sum(sg.end - sg.start for sg in repeated) and step.salt != "t-rep"
    assert step.prompt_tokens == step.prefill_tokens + step.cached_tokens and 0 < step.relocated_tokens <= step.cached_tokens
    plain = AgentRunner(kv_engine, mode="splice", salt="t-rep2", reuse_repeats=False, fidelity="bounded")
    steps2 = run_session(plain, kv_engine, "s-rep2", [first, again], "t-rep2")
    assert steps2[1][1].relocated_tokens == 0
    assert steps2[1][1].prefill_tokens - step.prefill_tokens == step.relocated_tokens


def test_full_mode_prefills_everything_every_step(engine, renders):
    steps = run_session(AgentRunner(engine, mode="full", salt="t-full"), engine, "s-full", renders, "t-full")
    assert all(s.prefill_tokens == s.prompt_tokens and s.cached_tokens == 0 for _, s in steps)


@pytest.mark.parametrize("level", ["bounded", "exact"])
def test_a_render_the_runner_did_not_send_falls_back_to_a_plain_request(kv_engine, renders, caplog, level):
    """At every level (at ``exact`` the fallback was dropped: ``None``, nothing logged)."""
    hook = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt="t-fb")
    runner = AgentRunner(kv_engine, mode="splice", salt="t-fb", fidelity=level)
    sid = f"s-fb-{level}"
    hook(sid, renders[0], TOOLS)
    hook(sid, renders[1], TOOLS)  # the runner never saw these two steps
    prepared = hook(sid, renders[2], TOOLS)
    with caplog.at_level(logging.WARNING, logger="promptsplice.engine_adapters.runners._agent"):
        step = runner.step(prepared, max_tokens=2)
    assert prepared.kind is StepKind.EDIT and step.fallback is StepFallback.FOREIGN_RENDER
    assert step.requests == 1 and step.relocated_tokens == 0 and "full prefill" in caplog.text


def test_a_runner_needs_an_engine_and_a_bool_for_reuse_repeats(kv_engine):
    """AgentRunner(None) raised AttributeError deep inside; reuse_repeats="no" was True."""
    from promptsplice.engine_adapters import RagRunner
    from promptsplice.errors import ConfigError

    for make in (lambda: AgentRunner(None), lambda: RagRunner(None), lambda: AgentRunner("engine")):
        with pytest.raises(ConfigError, match="needs an EmbeddedEngine or a RemoteEngine"):
            make()
    with pytest.raises(ConfigError, match="reuse_repeats must be True or False"):
        AgentRunner(kv_engine, mode="splice", salt="t-rr", reuse_repeats="no")
    with pytest.raises(ConfigError, match="index must be a ChunkIndex"):
        RagRunner(kv_engine, mode="position_independent", salt="t-rr", index="x")

    class Lazy:  # properties are looked up, never run (a RemoteEngine's ask the server)
        generate = generate_phases = make_assembler = staticmethod(lambda *a, **k: None)

        @property
        def block_size(self):
            raise AssertionError("the server was asked")

        can_splice = can_relocate = block_size

    AgentRunner(Lazy(), mode="apc", salt="t-rr")


def test_with_scope_none_the_session_salt_is_the_one_its_last_step_ran_under(kv_engine, renders):
    """After an exact step (its own salt) session_salt() named the tenant's salt, where
    the session's KV was not."""
    hook = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt="t-sn")
    runner = AgentRunner(kv_engine, mode="splice", salt="t-sn", scope="none")
    for msgs in renders[:2]:
        prepared = hook("s-sn", msgs, TOOLS)
        step = runner.step(prepared, max_tokens=1)
        assert runner.session_salt("s-sn") == step.salt != "t-sn"
    again = kv_engine.generate(list(prepared.token_ids), max_tokens=1, cache_salt=runner.session_salt("s-sn"))
    assert again.num_cached_tokens >= (step.prompt_tokens - 1) // kv_engine.block_size * kv_engine.block_size


def test_a_tenant_salt_may_not_hold_the_derived_salt_mark(engine, kv_engine):
    """Runners derive salts as ``salt + "\x1f" + tag``: tenant ``"acme\x1fpic"`` would
    share tenant ``"acme"``'s relocated KV."""
    from promptsplice.engine_adapters import RagRunner
    from promptsplice.errors import InvalidSaltError

    with pytest.raises(InvalidSaltError, match="U\\+001F"):
        AgentRunner(kv_engine, salt="acme\x1fexact")
    with pytest.raises(InvalidSaltError, match="U\\+001F"):
        RagRunner(kv_engine, salt="acme\x1fpic")
    with pytest.raises(InvalidSaltError, match="U\\+001F"):
        ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt="\x1fpic")


def test_runner_options_are_checked(engine, kv_engine):
    with pytest.raises(ConfigError, match="kv_store"):
        AgentRunner(engine, mode="splice")
    with pytest.raises(ConfigError, match="mode"):
        AgentRunner(kv_engine, mode="fast")
    with pytest.raises(ConfigError, match="recompute_blocks"):
        AgentRunner(kv_engine, recompute_blocks=-1)
    with pytest.raises(ConfigError, match="scope"):
        AgentRunner(kv_engine, scope="tenant")
    with pytest.raises(InputError, match="PreparedContext"):
        AgentRunner(kv_engine).step([1, 2, 3])
    for bad in (0, -0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ConfigError, match="max_deviation"):
            AgentRunner(kv_engine, max_deviation=bad)
    with pytest.raises(ConfigError, match="recompute_blocks >= 1"):
        AgentRunner(kv_engine, max_deviation=0.1, recompute_blocks=0, fidelity="bounded")


def test_max_deviation_recomputes_one_more_block_only_while_above_the_threshold(kv_engine, renders):
    """The same session under two thresholds.  Above every deviation (1.0, the largest threshold allowed): the planned
    phases, each recomputed block probed, nothing extra.  Below every deviation (1e-12):
    each run's next block is recomputed by one more request, up to the run's end, so
    nothing is relocated and exactly those blocks are prefilled on top."""
    from promptsplice.engine_adapters.connector import extend_recompute

    bs = kv_engine.block_size
    hi = run_session(AgentRunner(kv_engine, salt="t-dev-hi", max_deviation=1.0, recompute_blocks=1, fidelity="bounded"), kv_engine, "s-dev", renders, "t-dev-hi")
    lo = run_session(AgentRunner(kv_engine, salt="t-dev-lo", max_deviation=1e-12, recompute_blocks=1, fidelity="bounded"), kv_engine, "s-dev", renders, "t-dev-lo")
    prepared, step_hi = hi[2]
    _, step_lo = lo[2]
    phases = plan_phases(
        prepared.previous.token_ids, prepared.token_ids, prepared.diff.relocations, block_size=bs,
        recompute_blocks=1, salt=step_hi.salt, src_salt="t-dev-hi",
        load_prefix=prepared.first_changed_token // bs * bs, scope=True, probe=True,
    )
    probes = [p for ph in phases for p in ph.plan.probes]
    runs = [s for ph in phases if ph.plan.dst_start > 0 for s in ph.plan.segments]
    assert probes and runs and all(s.delta for s in runs)
    assert step_hi.requests == len(phases) and step_hi.extra_recompute_blocks == 0
    assert len(step_hi.deviations) == sum(p.num_blocks for p in probes)
    assert all(d > 0 for d in step_hi.deviations)
    # Below every deviation: every relocated run is recomputed block by block.
    new, expected = prepared.token_ids, []
    for ph in phases:
        while ph.plan.dst_start > 0 and (out := extend_recompute(ph, new)) is not None:
            expected += out[:-1]  # the request that computes the run's next block
            ph = out[-1]
        expected.append(ph)
    extra = sum(s.num_blocks for s in runs)
    assert step_lo.extra_recompute_blocks == extra and step_lo.requests == len(expected)
    assert step_lo.relocated_tokens == 0 < step_hi.relocated_tokens == extra * bs
    assert step_lo.prefill_tokens == step_hi.prefill_tokens + extra * bs
    assert len(step_lo.deviations) == len(step_hi.deviations) + extra
    # what the step says it planned is what ran: the guard's blocks count as recomputed
    assert step_lo.planned_relocated_tokens == 0 and step_hi.planned_relocated_tokens == extra * bs
    assert step_lo.recomputed_tokens == step_hi.recomputed_tokens + extra * bs
    # at r=1 each run's first block is computed instead of relocated
    phases0 = plan_phases(
        prepared.previous.token_ids, prepared.token_ids, prepared.diff.relocations, block_size=bs,
        recompute_blocks=0, salt=step_hi.salt, src_salt="t-dev-hi",
        load_prefix=prepared.first_changed_token // bs * bs, scope=True,
    )
    runs0 = [s for ph in phases0 for s in ph.plan.segments if s.dst_start >= prepared.first_changed_token // bs * bs]
    assert step_hi.recomputed_tokens == bs * len(runs0) > 0
    # Steps without an edit probe nothing.
    assert hi[0][1].deviations == hi[1][1].deviations == () and lo[1][1].extra_recompute_blocks == 0


def test_an_edit_step_reports_how_much_of_its_runs_old_context_changed(kv_engine, renders):
    """``changed_share``: removed + inserted tokens before a run over the old tokens
    before it, the largest over the diff's runs; 0 on steps without an edit."""
    steps = run_session(AgentRunner(kv_engine, salt="t-share", recompute_blocks=1, fidelity="bounded"), kv_engine, "s-sh", renders, "t-share")
    prepared, step = steps[2]
    diff = prepared.diff
    (d,) = diff.directives
    (run,) = diff.relocations
    assert step.changed_share == diff.changed_share(run) == (d.end - d.start + len(d.replacement)) / run.old_start > 0
    assert steps[0][1].changed_share == steps[1][1].changed_share == 0.0


def test_recompute_tail_blocks_computes_the_last_runs_last_blocks(kv_engine, renders):
    """``recompute_tail_blocks=k``: the last k blocks of the step's last relocated run
    are computed (they sit next to the query), everything else as planned."""
    bs = kv_engine.block_size
    base = run_session(AgentRunner(kv_engine, salt="t-tail0", recompute_blocks=1, fidelity="bounded"),
                       kv_engine, "s-tail", renders, "t-tail0")[2][1]
    tail = run_session(AgentRunner(kv_engine, salt="t-tail1", recompute_blocks=1, fidelity="bounded", recompute_tail_blocks=1),
                       kv_engine, "s-tail", renders, "t-tail1")[2][1]
    assert base.relocated_tokens >= 2 * bs
    assert tail.relocated_tokens == base.relocated_tokens - bs and tail.prefill_tokens == base.prefill_tokens + bs
    assert tail.recomputed_tokens == base.recomputed_tokens + bs
    # with no recompute at the front the tail's block is still counted (it was 0)
    tail0 = run_session(AgentRunner(kv_engine, salt="t-tail2", recompute_blocks=0, fidelity="fast", recompute_tail_blocks=1),
                        kv_engine, "s-tail", renders, "t-tail2")[2][1]
    assert tail0.recomputed_tokens == bs
    assert tail0.planned_relocated_tokens + tail0.recomputed_tokens == base.planned_relocated_tokens + base.recomputed_tokens
    with pytest.raises(ConfigError, match="recompute_tail_blocks"):
        AgentRunner(kv_engine, recompute_tail_blocks=-1)


def test_a_hook_full_prefill_is_reported_at_the_exact_level_too(kv_engine, renders):
    """At ``exact`` every step is one plain request anyway; the hook's FULL_PREFILL is
    still what the step says, as at the relocating levels."""
    from promptsplice.assembler import ChatTemplate

    # (a salt change made the FULL_PREFILL here: the hook keeps sessions per salt now, and
    # the runner refuses another salt's context; no token in common is one too)
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", name="plain")
    hook = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt="t-fp", template=plain)
    runner = AgentRunner(kv_engine, mode="splice", salt="t-fp")
    assert runner.fidelity.value == "exact"
    first = runner.step(hook("s-fp", [{"role": "user", "content": "alpha beta"}]), max_tokens=2)
    prepared = hook("s-fp", [{"role": "user", "content": "gamma delta"}])  # none of the old KV applies
    assert prepared.kind is StepKind.FULL_PREFILL
    step = runner.step(prepared, max_tokens=2)
    assert first.fallback is None and step.fallback is StepFallback.HOOK_FULL_PREFILL
    assert step.requests == 1 and step.relocated_tokens == 0 and step.salt == "t-fp"


@pytest.mark.reliability
def test_a_new_session_for_a_scoped_session_id_leaves_the_old_scope(kv_engine, renders):
    """A restarted harness renders the session from its start (``NEW_SESSION``) while the
    runner still holds the id scoped: the step runs under the tenant's salt, so the
    prefix cache serves it exact blocks, never the old scope's approximate KV."""
    tenant = "t-restart"
    runner = AgentRunner(kv_engine, mode="splice", salt=tenant, fidelity="bounded")
    steps = run_session(runner, kv_engine, "s-restart", renders, tenant)
    scope = steps[2][1].salt
    assert scope != tenant and runner.session_salt("s-restart") == scope
    prepared = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt=tenant)(
        "s-restart", renders[0], TOOLS
    )
    assert prepared.kind is StepKind.NEW_SESSION
    step = runner.step(prepared, max_tokens=2)
    bs = kv_engine.block_size
    assert step.salt == tenant and runner.session_salt("s-restart") == tenant
    assert step.fallback is None and step.relocated_tokens == 0
    # the first render ran under the tenant's salt before: its blocks are cached there
    assert step.cached_tokens == (len(prepared.token_ids) - 1) // bs * bs


def test_a_relocating_level_on_an_engine_that_cannot_relocate_is_refused(kv_engine, renders, monkeypatch):
    """The connector recomputes every moved block where it cannot relocate (an unverified
    ISA or RoPE): a bounded step then cost several requests for nothing while saying it
    relocated.  RagRunner refused such an engine; AgentRunner ran on."""
    runner = AgentRunner(kv_engine, mode="splice", salt="t-norel", fidelity="bounded")
    hook = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt="t-norel")
    monkeypatch.setattr(kv_engine.kv_connector.worker, "rope", None)  # as for an unverified RoPE
    with pytest.raises(ConfigError, match="cannot .*fidelity='exact'"):
        runner.step(hook("s-norel", renders[0], TOOLS), max_tokens=1)
    step = runner.step(hook("s-norel2", renders[0], TOOLS), max_tokens=1, fidelity="exact")
    assert step.relocated_tokens == 0 and step.fidelity.value == "exact"


# ------------------------------------------- tenant salts, decided before the engine runs


class _IdleEngine:
    """The runner surface with nothing behind it: ``generate*`` fail the test if called
    (what these tests check is decided before any request)."""

    block_size = 16
    can_splice = can_relocate = True  # a splice connector that can relocate
    kv_store = tokenizer = None

    def _called(self, *a, **k):
        raise AssertionError("the engine was called")

    generate = generate_phases = _called

    def make_assembler(self, **kw):  # a RagRunner builds its assembler up front
        from promptsplice.assembler import Assembler

        return Assembler(block_size=self.block_size, **kw)


def test_a_context_rendered_for_another_tenant_is_refused_before_any_request(default_tok):
    """AgentRunner.step never compared the hook's salt with its own: tenant A's context
    ran under the runner's salt (another tenant's, or none)."""
    from promptsplice.errors import InvalidSaltError

    hook = ContextHook(default_tok, block_size=16, salt="tenant-A")
    prepared = hook("s-salt", [{"role": "user", "content": "tenant A's private question"}])
    for salt in (None, "tenant-B"):
        with pytest.raises(InvalidSaltError, match=f"salt 'tenant-A' differs from the runner's salt {salt!r}: .*same tenant salt"):
            AgentRunner(_IdleEngine(), mode="apc", salt=salt).step(prepared)


def test_derived_salts_pass_vllms_cache_salt_rule_for_any_session_id(default_tok):
    """The scope salt embedded the raw session id ("alice@example.com", "org/acme/x", a
    long id): vllm serve refused it (HTTP 400) and the id showed in KV events and logs;
    a long tenant salt made the RAG reuse salt exceed vLLM's 128 characters."""
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    from promptsplice.engine_adapters import RagRunner
    from promptsplice._validate import MAX_DERIVING_SALT_LENGTH, salt_tenant
    from promptsplice.errors import InvalidSaltError

    tenant = "t" * MAX_DERIVING_SALT_LENGTH  # the longest a runner accepts
    assert MAX_DERIVING_SALT_LENGTH == 80
    runner = AgentRunner(_IdleEngine(), mode="splice", salt=tenant)
    for sid in ("thread-42", "alice@example.com", "org/acme/thread-1", "a\\b", "x" * 300):
        for owner, r in ((tenant, runner), (None, AgentRunner(_IdleEngine(), mode="splice"))):
            scope = r._scope_salt(sid)
            validate_cache_salt(scope)  # raises as vllm serve's request validation does
            assert salt_tenant(scope) == owner and sid not in scope and scope != r._scope_salt(sid)
            validate_cache_salt(r._exact_salt() or "unsalted")
    rag = RagRunner(_IdleEngine(), salt=tenant)
    for level in ("exact", "bounded", "fast"):
        validate_cache_salt(rag.reuse_salt_for(level))
        assert salt_tenant(rag.reuse_salt_for(level)) == tenant
    assert len({rag.reuse_salt_for(level) for level in ("exact", "bounded", "fast")}) == 3
    # a tenant salt too long for any derived salt to fit is refused where runners take it
    for make in (AgentRunner, RagRunner):
        with pytest.raises(InvalidSaltError, match="81 characters.*at most 80 characters"):
            make(_IdleEngine(), salt=tenant + "t")


def test_a_session_in_a_step_is_never_evicted_by_the_lru_bound(kv_engine, renders):
    """``max_sessions=2``: session A's first step is inside the engine while three new
    sessions step; the bound evicted A mid-step, so its state was lost (its next step
    fell back to a full prefill) and a second step of A would have run beside the first."""
    import threading

    class Gate:  # the engine, with A's first request held until released
        def __init__(self, engine):
            self._engine, self.entered, self.go = engine, threading.Event(), threading.Event()

        def __getattr__(self, name):
            return getattr(self._engine, name)

        block_size = property(lambda self: self._engine.block_size)
        can_relocate = property(lambda self: self._engine.can_relocate)
        can_splice = property(lambda self: self._engine.can_splice)

        def generate(self, *a, **k):
            return self._engine.generate(*a, **k)

        def make_assembler(self, **kw):
            return self._engine.make_assembler(**kw)

        def generate_phases(self, *a, **k):
            if not self.entered.is_set():
                self.entered.set()
                assert self.go.wait(120)
            return self._engine.generate_phases(*a, **k)

    gate = Gate(kv_engine)
    runner = AgentRunner(gate, mode="splice", salt="t-lru", max_sessions=2)
    hook = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt="t-lru")
    first = hook("A", renders[0], TOOLS)
    done = []
    worker = threading.Thread(target=lambda: done.append(runner.step(first, max_tokens=2)))
    worker.start()
    try:
        assert gate.entered.wait(120)
        for sid in ("B", "C", "D"):
            runner.step(hook(sid, renders[0], TOOLS), max_tokens=2)
    finally:
        gate.go.set()
        worker.join(120)
    assert len(done) == 1
    assert len(runner._sessions) == 2 and "A" in runner._sessions  # the bound holds, A kept
    step = runner.step(hook("A", renders[1], TOOLS), max_tokens=2)
    assert step.fallback is None and step.cached_tokens > 0  # A's state survived its step


def test_forget_during_a_step_keeps_the_sessions_steps_serialized(kv_engine, renders):
    """``forget`` removed a session a step was using: the session's next step made a new
    one and ran inside the engine beside the step still in flight (steps of one session
    are serialized).  Now the session stays until its steps end, and the next starts
    afresh.  A session id that is not a str was a raw TypeError."""
    import threading

    from promptsplice.errors import InvalidTextError

    inside, peak, lock, go, entered = [0], [0], threading.Lock(), threading.Event(), threading.Event()
    real = kv_engine.generate_phases

    def gated(*a, **k):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        entered.set()
        try:
            assert go.wait(120)
            return real(*a, **k)
        finally:
            with lock:
                inside[0] -= 1

    runner = AgentRunner(kv_engine, mode="splice", salt="t-forget")
    hook = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt="t-forget")
    first = hook("A", renders[0], TOOLS)
    kv_engine.generate_phases = gated
    try:
        steps = [threading.Thread(target=runner.step, args=(first,), kwargs={"max_tokens": 1}) for _ in range(3)]
        steps[0].start()
        assert entered.wait(120)
        steps[1].start()  # queued on the session's lock
        assert runner.forget("A") is True
        steps[2].start()  # after the forget
        steps[2].join(1.0)
        assert inside[0] == 1, "a second step of session A entered the engine"
    finally:
        go.set()
        for t in steps:
            t.join(120)
        del kv_engine.generate_phases
    assert peak[0] == 1
    with pytest.raises(InvalidTextError, match="session_id"):
        runner.forget([])
    with pytest.raises(InvalidTextError, match="session_id"):
        runner.session_salt([])


def test_a_step_that_relocates_nothing_opens_no_scope(kv_engine):
    """An append whose only repeated output is no longer than the recompute (r=2 at
    bounded) relocated nothing, yet opened a session scope for its exact prefix load:
    the session left the tenant's prefix cache for a store copy, for good."""
    runner = AgentRunner(kv_engine, mode="splice", salt="t-noscope", fidelity="bounded")
    hook = ContextHook(kv_engine.tokenizer, block_size=kv_engine.block_size, salt="t-noscope")

    def call(cid):
        return {"id": cid, "type": "function", "function": {"name": "ls", "arguments": "{}"}}

    first = [{"role": "system", "content": "You are a helpful agent. " * 30}, {"role": "user", "content": "list"},
             {"role": "assistant", "content": "", "tool_calls": [call("c1")]},
             {"role": "tool", "tool_call_id": "c1", "content": "a.txt b.txt"}]
    again = first + [{"role": "assistant", "content": "", "tool_calls": [call("c2")]},
                     {"role": "tool", "tool_call_id": "c2", "content": "a.txt b.txt"}]  # the same short output
    runner.step(hook("s", first), max_tokens=1)
    prepared = hook("s", again)
    assert prepared.kind is StepKind.APPEND
    step = runner.step(prepared, max_tokens=1)
    assert step.planned_relocated_tokens == 0 and step.relocated_tokens == 0
    assert step.salt == "t-noscope" and runner.session_salt("s") == "t-noscope"  # still the tenant's cache
    assert step.cached_tokens > 0  # its prefix served by the tenant's prefix cache


@pytest.mark.reliability
def test_a_splice_step_over_the_context_fails_before_any_phase_runs(text_tokens_text, measured):
    """A multi-phase splice step checked the context only in its last phase's request:
    on a 512-token engine, an edit growing a 452-token session to 548 tokens ran its
    earlier phases (vLLM's counters moved: prefix-cache queries, external hits) before
    ``ContextLengthError``.  Now nothing reaches vLLM, and the session is left as it was:
    an edit that fits still splices from the last render."""
    from promptsplice.engine_adapters import StoreConfig
    from promptsplice.errors import ContextLengthError
    from tests.conftest import start_default_engine
    from tests.engine_adapters._engine import grep_call

    lines = text_tokens_text
    system = {"role": "system", "content": "You are a code agent. Answer briefly."}
    user = {"role": "user", "content": "Where is the scheduler configured?"}

    def render(first: int) -> list[dict]:  # the first tool output's lines: an edit of it relocates what follows
        return [system, user, {"role": "assistant", "content": "", "tool_calls": [grep_call("c1", "sched")]},
                {"role": "tool", "tool_call_id": "c1", "content": "\n".join(lines[:first])},
                {"role": "assistant", "content": "", "tool_calls": [grep_call("c2", "config")]},
                {"role": "tool", "tool_call_id": "c2", "content": "\n".join(lines[40:43])}]

    mib = 1024 * 1024
    # (room for every block in float32 too, 1.5 MB each: with 32 MiB on an AVX2 machine
    # the scope's saves evicted the run the edit relocates, and it loaded nothing)
    eng = start_default_engine(kv_store=StoreConfig(dram_bytes=96 * mib, write_behind_bytes=0),
                               kv_cache_bytes=64 * mib, max_model_len=512)
    try:
        runner = AgentRunner(eng, mode="splice", salt="t-long", fidelity="bounded")
        hook = ContextHook(eng.tokenizer, block_size=eng.block_size, salt="t-long")
        first = runner.step(hook("s", render(1), TOOLS), max_tokens=1)
        assert first.prompt_tokens == 452
        long = hook("s", render(5), TOOLS)
        assert long.kind is StepKind.EDIT and len(long.token_ids) == 548
        bs = eng.block_size
        would = plan_phases(long.previous.token_ids, long.token_ids, long.diff.relocations, block_size=bs,
                            recompute_blocks=runner.recompute_blocks, salt="scope", src_salt="t-long",
                            load_prefix=long.first_changed_token // bs * bs, scope=True)
        assert len(would) > 1 and any(ph.plan for ph in would[:-1])  # earlier phases that load
        before, loaded = eng.counters(), eng.kv_connector.worker.stats.loaded_blocks
        with pytest.raises(ContextLengthError, match="the prompt has 548 tokens but the engine's max_model_len is 512"):
            runner.step(long, max_tokens=1)
        assert eng.counters() == before  # no phase reached vLLM
        assert eng.kv_connector.worker.stats.loaded_blocks == loaded
        assert runner.session_salt("s") == "t-long"  # the step opened no scope
        # the session is where the failed step found it: an edit of the last render that
        # fits splices (a harness whose hook saw the failed render forgets the session)
        again = ContextHook(eng.tokenizer, block_size=bs, salt="t-long")
        again("s", render(1), TOOLS)
        shorter = again("s", render(3), TOOLS)
        assert shorter.kind is StepKind.EDIT and len(shorter.token_ids) < 512
        fits = runner.step(shorter, max_tokens=1)
        assert fits.fallback is None and fits.relocated_tokens > 0 and fits.requests > 1
        measured.update(prompt_tokens=548, max_model_len=512, counters_moved=0,
                        shorter_edit_relocated_tokens=fits.relocated_tokens)
    finally:
        eng.close()
