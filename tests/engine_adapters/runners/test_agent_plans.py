"""AgentRunner's plans and step records on a fake engine (no vLLM): the real
``run_phases`` over a per-salt prefix cache that serves every whole block it has seen
under the salt, and computes everything else the plan does not load (probed blocks
deviate by 0.01: under any threshold)."""

from __future__ import annotations

import logging

import pytest

from promptsplice.assembler import ContextHook, StepKind
from promptsplice.engine_adapters import AgentRunner, FidelityLevel, SplicePhase, SpliceSegment
from promptsplice.engine_adapters._requests import Completion, PhaseResult, run_phases
from promptsplice.engine_adapters.connector._plans import BlockDeviation
from promptsplice.engine_adapters.runners._fidelity import step_level
from promptsplice.blocks import root_hash
from tests.engine_adapters._engine import agent_renders

BS = 16


class _CacheEngine:
    """The runner surface: a request hits the longest prefix of whole blocks its salt
    has cached, loads what its plan names after that hit, computes the rest."""

    block_size = BS
    can_splice = can_relocate = True
    kv_store = tokenizer = None

    def __init__(self):
        self.cache: dict[str | None, set[tuple[int, ...]]] = {}
        self.calls: list[tuple[list[SplicePhase], str | None]] = []

    def generate_phases(self, tokens, phases, *, cache_salt=None, adapt=None, **gen):
        self.calls.append((list(phases), cache_salt))

        def run_one(prompt, plan, kwargs):
            cache = self.cache.setdefault(cache_salt, set())
            hit = 0
            for end in range(BS, len(prompt), BS):
                if tuple(prompt[:end]) not in cache:
                    break
                hit = end
            segs = [s for s in (plan.segments if plan is not None else ()) if s.dst_start >= hit]
            loaded = sum(s.num_blocks * BS for s in segs)
            relocated = sum(s.num_blocks * BS for s in segs if s.delta)
            cache.update(tuple(prompt[:end]) for end in range(BS, len(prompt) + 1, BS))
            out = Completion(text="x", token_ids=[1], prompt_token_ids=list(prompt), prompt_tokens=len(prompt),
                             num_cached_tokens=min(len(prompt) - 1, hit + loaded), ttft_s=0.001, total_s=0.002,
                             finish_reason="length")
            # each probed (recomputed) block deviates little from its relocated old KV
            devs = tuple(BlockDeviation(p.dst_start + b * BS, p.delta, (0.01,), (0.01,))
                         for p in (plan.probes if plan is not None else ()) for b in range(p.num_blocks))
            return PhaseResult(out, relocated, devs)

        return run_phases(tokens, phases, run_one, gen, adapt)

    def _called(self, *a, **k):
        raise AssertionError("an AgentRunner sends its steps through generate_phases")

    generate = make_assembler = _called


TOOLS = [{"type": "function", "function": {"name": "grep", "description": "search files",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def renders():
    return agent_renders([f"line {i}: the quick brown fox jumps over the lazy dog number {i * 7}" for i in range(60)])


def _session(runner, tok, renders, salt="t", **step):
    hook = ContextHook(tok, block_size=BS, salt=salt)
    out = []
    for msgs in renders:
        prepared = hook("s", msgs, TOOLS)
        out.append((prepared, runner.step(prepared, max_tokens=4, **step)))
    return out


@pytest.mark.parametrize(("kwargs", "planned", "recomputed", "prefill", "first_load"), [
    ({}, 0, 272, 276, None),  # exact: the plain request computes all 272 relocatable tokens
    ({"fidelity": "bounded"}, 240, 32, 36, 240),  # 2 blocks recomputed after the edit at 208
    ({"fidelity": "fast"}, 256, 16, 20, 224),
    ({"fidelity": "bounded", "recompute_blocks": 0}, 272, 0, 4, 208),
])
def test_a_moved_message_that_starts_like_the_old_text_there_is_planned_after_the_exact_prefix(
    default_tok, renders, caplog, kwargs, planned, recomputed, prefill, first_load,
):
    """Dropping the session's first call and its output moves the second call up; its
    first block (the assistant header) equals the old tokens there, so the common prefix
    (208) reaches past where the moved run lands (192).  The prefix load of the new scope
    (round_down(208)) overlapped the run: at r=0 (every exact step's dry plan) the plan
    was refused, an INVALID_PLAN fallback with recomputed_tokens=0, and bounded/fast
    recomputed one block less than asked and reported 0 recomputed."""
    runner = AgentRunner(_CacheEngine(), mode="splice", salt="t", **kwargs)
    seq = [renders[0], renders[1], renders[1][:2] + renders[1][4:]]
    with caplog.at_level(logging.WARNING, logger="promptsplice.engine_adapters.runners._agent"):
        prepared, step = _session(runner, default_tok, seq)[-1]
    (run,) = prepared.diff.relocations
    assert prepared.kind is StepKind.EDIT and prepared.first_changed_token == 208 and run.old_start + run.delta == 192
    assert (step.fallback, step.planned_relocated_tokens, step.relocated_tokens) == (None, planned, planned)
    assert (step.recomputed_tokens, step.prefill_tokens, step.prompt_tokens) == (recomputed, prefill, 484)
    assert not caplog.records
    phases, salt = runner.engine.calls[-1]
    if first_load is None:
        assert phases == [SplicePhase(484, None)] and salt == "t"
    else:  # the exact prefix loaded from the tenant's blocks, the run from after it
        loads = [seg for ph in phases if ph.plan for seg in ph.plan.segments]
        assert loads[0] == SpliceSegment(0, 13, 0, root_hash("t"))
        assert (loads[1].dst_start, loads[1].num_blocks * BS, loads[1].delta) == (first_load, planned, run.delta)
        assert len(loads) == 2 and salt != "t"


def test_with_scope_none_every_step_at_a_relocating_level_reports_that_level(default_tok, renders):
    """scope="none" relocates under the tenant's own salt: a later plain step there may
    be served that relocated KV, yet it (and the session's first steps, after another
    session's edits) was recorded exact."""
    after = renders[2] + [{"role": "assistant", "content": "It is in config.py."}]
    runner = AgentRunner(_CacheEngine(), mode="splice", salt="t", fidelity="bounded", scope="none")
    out = _session(runner, default_tok, renders + [after])
    steps = [s for _, s in out]
    assert [p.kind for p, _ in out] == [StepKind.NEW_SESSION, StepKind.APPEND, StepKind.EDIT, StepKind.APPEND]
    assert [(s.salt, s.planned_relocated_tokens, s.fidelity) for s in steps] == [
        ("t", 0, FidelityLevel.BOUNDED), ("t", 0, FidelityLevel.BOUNDED),
        ("t", 256, FidelityLevel.BOUNDED), ("t", 0, FidelityLevel.BOUNDED),
    ]
    # an exact step there runs under a salt of its own: exact
    assert runner.step(ContextHook(default_tok, block_size=BS, salt="t")("s2", renders[0], TOOLS),
                       max_tokens=4, fidelity="exact").fidelity is FidelityLevel.EXACT
    # scope="session" keeps the tenant's salt exact: its plain steps there are exact
    scoped = AgentRunner(_CacheEngine(), mode="splice", salt="t", fidelity="bounded")
    steps = [s for _, s in _session(scoped, default_tok, renders + [after])]
    assert [s.fidelity for s in steps] == [FidelityLevel.EXACT, FidelityLevel.EXACT,
                                           FidelityLevel.BOUNDED, FidelityLevel.BOUNDED]
    assert steps[0].salt == steps[1].salt == "t" != steps[2].salt == steps[3].salt


def test_step_level_keeps_the_asked_level_when_the_caller_says_the_salt_may_hold_relocated_kv():
    bounded, exact = FidelityLevel.BOUNDED, FidelityLevel.EXACT
    assert step_level(bounded, 0, "t", salt_may_hold_relocated=True) is bounded
    assert step_level(bounded, 0, "t") is exact  # a RagRunner's (and scope="session"'s) tenant salt
    assert step_level(bounded, 16, "t") is bounded


@pytest.mark.parametrize("mode", ["apc", "full", "splice"])
def test_an_edit_reports_its_runs_changed_share_in_every_mode(default_tok, renders, mode):
    """changed_share is a property of the edit (the docstring: whether or not the step
    relocated its runs), yet apc and full steps reported 0."""
    prepared, step = _session(AgentRunner(_CacheEngine(), mode=mode, salt="t"), default_tok, renders)[-1]
    assert prepared.kind is StepKind.EDIT and len(prepared.diff.relocations) == 1
    assert step.changed_share == prepared.diff.changed_share(prepared.diff.relocations[0]) == pytest.approx(0.7992007992)


def test_a_step_stricter_than_its_scope_has_relocated_at_runs_exact_then_rescopes(default_tok, renders):
    """A session's scope carries the KV its steps relocated: a ``bounded`` step after
    ``fast`` ones was served the KV they relocated (one recomputed block) and reported
    ``bounded``.  It now runs exact (``STRICTER_THAN_SCOPE``), and the next relocating
    step opens a new scope from exact KV; steps as strict as the scope stay in it."""
    from promptsplice.engine_adapters import StepFallback

    after = renders[2] + [{"role": "assistant", "content": "It is in config.py."}]
    edit = [m for m in after if m.get("tool_call_id") != "c2" and not (
        m.get("tool_calls") and m["tool_calls"][0]["id"] == "c2")] + [{"role": "user", "content": "And again?"}]
    again = edit + [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Once more?"}]
    seq = [*renders, after, edit, again]
    for levels, want, salts in (
        (["fast"] * 4 + ["bounded", "bounded"], [None] * 4 + [StepFallback.STRICTER_THAN_SCOPE, None], "ttSStt"),
        (["bounded"] * 4 + ["fast", "bounded"], [None] * 5 + [StepFallback.STRICTER_THAN_SCOPE], "ttSSSt"),
        (["bounded"] * 6, [None] * 6, "ttSSSS"),
    ):
        runner = AgentRunner(_CacheEngine(), mode="splice", salt="t")
        hook = ContextHook(default_tok, block_size=BS, salt="t")
        steps = [runner.step(hook("s", msgs, TOOLS), max_tokens=4, fidelity=lv) for msgs, lv in zip(seq, levels)]
        assert [s.fallback for s in steps] == want, levels
        for s, w in zip(steps, want):
            if w is StepFallback.STRICTER_THAN_SCOPE:  # exact, under the tenant's own salt
                assert (s.salt, s.planned_relocated_tokens, s.fidelity) == ("t", 0, FidelityLevel.EXACT)
        assert "".join("t" if s.salt == "t" else "S" for s in steps) == salts, levels
        assert len({s.salt for s in steps if s.salt != "t"}) == 1


def test_a_stricter_step_the_hook_made_a_full_prefill_leaves_the_scope_too(default_tok, renders):
    """The reset keyed on the reported fallback: a stricter step the hook had made a
    FULL_PREFILL (reported as such) ran under the tenant's salt but left the session
    "scoped" there, and the next relocating step sent its plans under the tenant's
    own salt, which holds exact KV only."""
    from promptsplice.assembler import StepKind
    from promptsplice.engine_adapters import StepFallback

    after = renders[2] + [{"role": "assistant", "content": "It is in config.py."}]
    edit = [m for m in after if m.get("tool_call_id") != "c2" and not (
        m.get("tool_calls") and m["tool_calls"][0]["id"] == "c2")] + [{"role": "user", "content": "And again?"}]
    engine = _CacheEngine()
    runner = AgentRunner(engine, mode="splice", salt="t")
    hook = ContextHook(default_tok, block_size=BS, salt="t")
    steps = []
    for msgs, level, full in ((renders[0], "fast", 0), (renders[1], "fast", 0), (renders[2], "fast", 0),
                              (after, "bounded", 1), (edit, "fast", 0)):
        prepared = hook("s", msgs, TOOLS)
        if full:  # as the hook's own fallback makes it (no overlap, an invalid diff)
            prepared.kind, prepared.diff = StepKind.FULL_PREFILL, None
        steps.append(runner.step(prepared, max_tokens=4, fidelity=level))
    assert steps[3].fallback is StepFallback.HOOK_FULL_PREFILL and steps[3].salt == "t"
    assert steps[4].planned_relocated_tokens > 0 and steps[4].salt not in ("t", steps[2].salt)  # a new scope
    assert not any(ph.plan for phases, salt in engine.calls if salt == "t" for ph in phases)


def test_scope_none_loads_its_exact_salts_prefix_as_exact(default_tok, renders):
    """``scope="none"`` runs exact steps under ``tenant + "\\x1fexact"``, a derived salt
    that holds exact KV only: the next relocating step's unchanged prefix, loaded from it
    in place, counted as relocated (560 tokens, not the 272 moved) once in-place blocks
    from derived salts were counted approximate."""
    runner = AgentRunner(_CacheEngine(), mode="splice", salt="t", scope="none")
    hook = ContextHook(default_tok, block_size=BS, salt="t")
    steps = [runner.step(hook("s", msgs, TOOLS), max_tokens=4, fidelity=level)
             for msgs, level in ((renders[0], "exact"), (renders[1], "exact"), (renders[2], "fast"))]
    assert steps[0].salt == steps[1].salt == "t\x1fexact" and steps[2].salt == "t"
    assert steps[2].planned_relocated_tokens == 272


def test_a_splice_step_s_ttft_counts_its_planning_and_not_the_plans_made_for_the_record(
    default_tok, renders, monkeypatch,
):
    """Splice plans before its first request, which apc and full never do: that time
    counts in the step's TTFT and wall time, as a RAG step's planning does (until
    2026-12-07 its clock started at the first request); the dry plan made only for
    ``recomputed_tokens`` does not count."""
    import time

    from promptsplice.engine_adapters.runners import _agent

    slow, real = 0.3, _agent.plan_phases

    def slowed(*a, **k):
        time.sleep(slow)
        return real(*a, **k)

    monkeypatch.setattr(_agent, "plan_phases", slowed)
    seq = [renders[0], renders[1], renders[1][:2] + renders[1][4:]]
    for kwargs, plans in (({"fidelity": "bounded"}, 2), ({}, 1)):  # bounded: the plan and the dry plan
        runner = AgentRunner(_CacheEngine(), mode="splice", salt="t", **kwargs)
        t = time.perf_counter()
        prepared, step = _session(runner, default_tok, seq)[-1]
        took = time.perf_counter() - t
        assert prepared.kind is StepKind.EDIT and took >= plans * slow
        counted = slow if kwargs else 0.0  # exact: the dry plan only, for the record
        assert counted <= step.ttft_s < counted + slow and counted <= step.wall_s < counted + slow, kwargs
