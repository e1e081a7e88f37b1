"""The fidelity probes prove what they measure: a probe not served the step's KV, or a
step that relocated nothing, is a bench failure; the distributions and the seeded
bootstrap interval are deterministic."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptsplice.assembler import ContextHook
from promptsplice.benchmarks.agent import probe_ranks
from promptsplice.benchmarks.agent_traces import classify_step, read_agent_trace
from promptsplice.benchmarks.fidelity import Fidelity, FidelityError, bootstrap_ci, full_blocks, probe, verify_step
from promptsplice.engine_adapters import AgentRunner

SAMPLE = "benchmarks/data/agent-sample.jsonl"


def test_the_distribution_fields_and_a_seeded_bootstrap_interval():
    f = Fidelity()
    kls = [0.001 * i for i in range(40)]
    for i, v in enumerate(kls):
        f.add(1.0 - v, v, 1.0, label="mask/1" if i % 2 else "drop/2-3")
    rep = f.report()
    assert rep["steps"] == 40 and rep["probes_by"] == {"drop/2-3": 20, "mask/1": 20}
    assert rep["first_token_kl_max_by"] == {"drop/2-3": 0.038, "mask/1": 0.039}  # where the tail is
    # nearest rank (promptsplice.benchmarks._stats): p50 of 40 is the 20th value, p90 the 36th
    assert rep["first_token_kl_p50"] == 0.019 and rep["first_token_kl_p90"] == 0.035 and rep["first_token_kl_max"] == 0.039
    lo, hi = rep["first_token_kl_ci95"]
    assert lo < rep["first_token_kl"] < hi and hi - lo < 0.02
    assert rep["tf_top1_p10"] == pytest.approx(1 - 0.036) and rep["tf_top1_min"] == pytest.approx(1 - 0.039)
    assert bootstrap_ci(kls) == bootstrap_ci(list(kls)) == [lo, hi]  # same values, same interval
    assert bootstrap_ci([]) is None and Fidelity().report()["first_token_kl_p90"] is None


def test_probes_are_spread_over_edit_kinds_and_depths():
    sessions = read_agent_trace(SAMPLE)
    ranks = probe_ranks(sessions)
    edits = {(si, i) for si, s in enumerate(sessions) for i, r in enumerate(s.renders)
             if classify_step(s.renders[i - 1] if i else None, r) not in ("first", "append")}
    assert set(ranks) == edits and sorted(r for r, _ in ranks.values()) == list(range(len(edits)))
    strata = {label for _, label in ranks.values()}
    first = {label for r, label in ranks.values() if r < len(strata)}
    assert first == strata  # the first picks visit every (kind, depth) stratum once
    assert {label.split("/")[0] for label in strata} >= {"mask", "drop", "truncate"}


@pytest.mark.parametrize("requested", [8, 32, 48])
def test_every_probe_owed_is_taken_when_steps_that_relocate_nothing_pass_their_turn(requested):
    """A step that relocated nothing passed its turn to the next rank, whose step had
    often been replayed already: 30 probes of 32 requested with 182 eligible steps (the
    reviewer's replay of this selection on a 24-session trace, truncations relocating
    nothing).  Now every relocating edit step is probed while probes are owed."""
    from promptsplice.benchmarks.agent import ProbeTurns
    from promptsplice.benchmarks.agent_traces_bfcl import generate_agent_trace
    from promptsplice.benchmarks.fidelity import check_probes, probe_coverage
    from promptsplice.benchmarks.coverage import CoverageError

    sessions = generate_agent_trace(24, seed=0)
    ranks = probe_ranks(sessions)
    turns = ProbeTurns(ranks, requested)
    probed = []
    for si, sess in enumerate(sessions):  # replay order
        for i, render in enumerate(sess.renders):
            kind = classify_step(sess.renders[i - 1] if i else None, render)
            label = turns.take((si, i), relocates=kind != "truncate")
            if label is not None:
                assert label.split("/")[0] == kind != "truncate"
                probed.append((si, i))
    assert turns.passed > 0 and turns.eligible > requested
    assert len(probed) == len(set(probed)) == requested
    cov = probe_coverage(requested, turns.eligible, len(probed))
    assert cov["probe_coverage"] == 1.0
    half = requested // 2
    short = {"steps": half, "requested": requested, **probe_coverage(requested, turns.eligible, half)}
    with pytest.raises(CoverageError, match=f"probed {half} steps for fidelity of the {requested} it owed"):
        check_probes(short, what="bench agent")
    check_probes(short, allow_skips=True)


def test_a_probe_not_served_the_steps_kv_fails_loudly(engine):
    toks = engine.tokenizer.encode("The capital of France is Paris. " * 20)
    # a fresh salt: nothing cached, so the probe would measure recomputed (exact) KV
    with pytest.raises(FidelityError, match="served 0"):
        probe(engine, toks, [1, 2], f"fresh-{uuid.uuid4().hex}", need_cached=full_blocks(engine, toks))


def test_a_step_that_relocated_nothing_cannot_be_probed(engine):
    sess = read_agent_trace(SAMPLE)[0]
    hook = ContextHook(engine.tokenizer, block_size=engine.block_size)
    runner = AgentRunner(engine, mode="apc", salt=f"t-{uuid.uuid4().hex[:8]}")
    for msgs in sess.renders[:4]:  # ... truncate, mask: edits, but apc relocates nothing
        step = runner.step(hook(sess.id, msgs, sess.tools or None), max_tokens=1)
    with pytest.raises(FidelityError, match="relocates 0 tokens but the connector relocated 0"):
        verify_step(step)


def test_every_bench_reads_one_percentile_rule():
    """Nearest rank, one rule for every report: p90 of 10 probes is the 9th value (it was
    the maximum), p10 the lowest (it hid a probe at 0.2), a p50 of 2 values the lower."""
    from promptsplice.benchmarks._stats import percentile

    ten = [0.2] + [1.0] * 9
    assert percentile(ten, 0.1) == 0.2 and percentile(list(range(1, 11)), 0.9) == 9
    assert percentile([1, 2], 0.5) == 1 and percentile([1, 2, 3, 4], 0.5) == 2 and percentile([], 0.5) == 0.0
    import promptsplice.benchmarks.agent as agent
    import promptsplice.benchmarks.assemble as assemble
    import promptsplice.benchmarks.fidelity as fidelity
    import promptsplice.benchmarks.rag as rag

    assert all(not hasattr(m, "_pct") for m in (agent, assemble, fidelity, rag))


def test_the_bootstrap_interval_takes_nearest_rank_percentiles():
    """It took means[int(q * R)], one order statistic above the nearest rank every other
    percentile of the benches uses ([0.0, 0.125] instead of [0.0, 0.075] at R=40)."""
    import random

    from promptsplice.benchmarks._stats import percentile
    from promptsplice.benchmarks.fidelity import bootstrap_ci

    xs = [0.0] * 39 + [1.0]
    for resamples in (40, 2000):
        rng = random.Random(0)
        means = sorted(sum(xs[rng.randrange(len(xs))] for _ in range(len(xs))) / len(xs) for _ in range(resamples))
        assert bootstrap_ci(xs, resamples=resamples, seed=0) == [round(percentile(means, 0.025), 4),
                                                         round(percentile(means, 0.975), 4)]


def test_kl_stays_finite_with_masked_tokens_on_either_side():
    """A -inf logprob (a token the sampler masks) made KL NaN in p (0 x -inf) and
    infinite in q: the report's JSON then held NaN/Infinity, which JSON cannot."""
    import math

    from promptsplice.benchmarks.fidelity import LOGPROB_FLOOR, kl

    p = {0: math.log(0.5), 1: math.log(0.5), 2: -math.inf}
    q = {0: math.log(0.5), 1: math.log(0.5), 2: math.log(1e-9)}
    assert kl(p, q) == pytest.approx(0.0, abs=1e-12)
    masked = {0: 0.0, 1: -math.inf}
    value = kl({0: math.log(0.5), 1: math.log(0.5)}, masked)
    assert math.isfinite(value) and value == pytest.approx(0.5 * math.log(0.5) + 0.5 * (math.log(0.5) - LOGPROB_FLOOR))
    assert kl({0: 0.0}, {0: 0.0}) == 0.0 and kl({0: 0.0}, {}) == pytest.approx(-LOGPROB_FLOOR)


@st.composite
def _replays(draw):
    """A replay: steps in order, a ranked subset of them (ranks a permutation), which
    steps relocate, and the probes requested."""
    n = draw(st.integers(1, 14))
    keys = [(draw(st.integers(0, 2)), i) for i in range(n)]
    keys = list(dict.fromkeys(keys))
    ranked = draw(st.lists(st.sampled_from(keys), unique=True, min_size=0, max_size=len(keys)))
    order = draw(st.permutations(list(range(len(ranked)))))
    ranks = {k: (r, f"kind{r % 3}/1") for k, r in zip(ranked, order)}
    reloc = {k: draw(st.booleans()) for k in keys}
    return keys, ranks, reloc, draw(st.integers(0, 8))


@settings(max_examples=500, deadline=None)
@given(_replays())
def test_probe_turns_probe_ranked_relocating_steps_and_all_owed_when_every_step_relocates(replay):
    """Whatever the replay order, ranks and relocations: at most ``min(requested,
    eligible)`` probes, each of a ranked step that relocates, with its stratum's label;
    exactly that many when every ranked step relocates.  (A probe runs right after its
    step and whether later steps relocate is unknown then, so only the first relocating
    steps guarantee more, and they probed 4 of 24 sessions of a BFCL trace.)"""
    from promptsplice.benchmarks.agent_probes import ProbeTurns

    keys, ranks, reloc, requested = replay
    for relocations in (reloc, {k: True for k in reloc}):
        turns = ProbeTurns(ranks, requested)
        probed = []
        for k in keys:
            label = turns.take(k, relocations[k])
            if label is not None:
                assert k in ranks and relocations[k] and label == ranks[k][1]
                probed.append(k)
        ranked = sum(relocations[k] for k in ranks)
        eligible = sum(relocations[k] for k in keys)  # every step that relocated, ranked or not
        assert turns.eligible == eligible and len(probed) == len(set(probed)) <= min(requested, ranked)
        if all(relocations[k] for k in ranks):
            assert len(probed) == min(requested, ranked)


def test_probes_spread_over_sessions_and_strata():
    """The first relocating steps (a fix for lost turns) probed 4 of 24 sessions and 5 of
    8 strata of a BFCL trace: the fidelity figure rested on a corner of the trace."""
    from promptsplice.benchmarks.agent_probes import ProbeTurns
    from promptsplice.benchmarks.agent_traces_bfcl import generate_agent_trace

    sessions = generate_agent_trace(24, seed=0)
    ranks = probe_ranks(sessions)
    turns = ProbeTurns(ranks, 32)
    picked = [(si, label) for si, sess in enumerate(sessions) for i in range(len(sess.renders))
              if (label := turns.take((si, i), True)) is not None]
    assert len(picked) == 32
    assert len({si for si, _ in picked}) >= 16 and {label for _, label in picked} == {lab for _, lab in ranks.values()}


def test_the_reviewers_replay_probes_three_of_four_eligible():
    """r8's trial 5: 4 relocating ranked steps, 3 probes requested, 2 made (exit 3)."""
    from promptsplice.benchmarks.agent_probes import ProbeTurns
    from promptsplice.benchmarks.fidelity import check_probes, probe_coverage

    ranks = {(0, 8): (3, "a"), (0, 0): (4, "a"), (0, 7): (5, "a"), (0, 6): (2, "a"), (0, 1): (0, "a"), (0, 9): (1, "a")}
    reloc = {0: True, 1: True, 6: False, 7: True, 8: False, 9: True}
    t = ProbeTurns(ranks, 3)
    made = [i for i in sorted(reloc) if t.take((0, i), reloc[i]) is not None]
    assert made == [0, 1, 7] and t.eligible == 4 and t.passed == 1  # 0 and 7 out of turn: few steps to spare
    cov = probe_coverage(3, t.eligible, len(made))
    assert cov["probe_coverage"] == 1.0
    check_probes({**cov, "steps": len(made), "requested": 3})


def test_a_relocating_step_the_prediction_missed_is_owed_and_fails_coverage():
    """``take`` returned before counting a step outside the ranks: when the prediction
    (``relocating_edits``) missed every step that relocated, the run reported probe
    coverage 1.0 with no probe made.  Every relocating step is owed now."""
    from promptsplice.benchmarks.agent_probes import ProbeTurns
    from promptsplice.benchmarks.coverage import CoverageError
    from promptsplice.benchmarks.fidelity import check_probes, probe_coverage

    ranks = {(0, 1): (0, "mask/1"), (0, 2): (1, "mask/1")}  # predicted; they relocate nothing
    t = ProbeTurns(ranks, 4)
    made = [k for k in [(0, i) for i in range(1, 7)] if t.take(k, k not in ranks) is not None]
    assert made == [] and t.eligible == 4
    cov = probe_coverage(4, t.eligible, len(made))
    assert cov == {"eligible": 4, "probe_coverage": 0.0}
    with pytest.raises(CoverageError, match="probed 0 steps for fidelity of the 4 it owed"):
        check_probes({**cov, "steps": 0, "requested": 4}, what="bench agent")


def test_small_samples_are_flagged_and_a_one_probe_interval_is_undefined():
    """Below 10 probes ``first_token_kl_p90`` is their max, below 11 ``tf_top1_p10`` their
    min; an interval of one probe is [x, x].  The fields stay; flags say what they rest on."""
    from promptsplice.benchmarks._stats import min_sample

    assert [min_sample(q) for q in (0.5, 0.9, 0.1, 0.99)] == [3, 10, 11, 100]
    six = Fidelity()
    for v in (0.003, 0.0003, 0.01, 0.02, 0.03, 0.216):  # the README's coding run
        six.add(0.99, v, 0.5)
    r = six.report()
    assert r["first_token_kl_p90"] == r["first_token_kl_max"] == 0.216  # the field is kept, and flagged
    assert r["small_sample"] is True
    assert r["percentile_min_n"] == {"first_token_kl_p50": 3, "first_token_kl_p90": 10, "tf_top1_p50": 3,
                                     "tf_top1_p10": 11}
    assert r["ci95_undefined"] == [] and r["ci_unit"] == "probe" and r["ci_units"] == 6
    one = Fidelity()
    one.add(0.9, 0.05, 0.3)
    r1 = one.report()
    assert r1["first_token_kl_ci95"] == [0.05, 0.05]  # still a 2-list ...
    assert r1["ci95_undefined"] == ["first_token_kl_ci95", "tf_top1_ci95"] and r1["small_sample"] is True  # ... named undefined
    eleven = Fidelity()
    for i in range(11):
        eleven.add(1.0 - 0.01 * i, 0.001 * i, 1.0)
    r11 = eleven.report()
    assert r11["small_sample"] is False and r11["tf_top1_p10"] > r11["tf_top1_min"]
    assert r11["first_token_kl_p90"] < r11["first_token_kl_max"]
    assert Fidelity().report()["small_sample"] is True
    # the 32-probe floor of a claim: 11 probes are no claim, 32 are
    assert (r11["probe_floor"], r11["probe_floor_met"]) == (32, False)
    for i in range(21):
        eleven.add(1.0, 0.0, 1.0)
    assert eleven.report()["probe_floor_met"] is True


def test_the_session_bootstrap_resamples_whole_sessions():
    """25 probes from 4 sessions whose KL levels differ: resampling probes one by one
    gave an interval too narrow; ``ci_unit="session"`` resamples sessions."""
    import random

    rng = random.Random(1)
    sessions = [[max(0.0, rng.gauss(m, 0.002)) for _ in range(6 + (m > 0.02))] for m in (0.006, 0.010, 0.016, 0.030)]
    by_probe, by_session = Fidelity(), Fidelity(ci_unit="session")
    for sid, xs in enumerate(sessions):
        for step, x in enumerate(xs):
            for f in (by_probe, by_session):
                f.add(1.0, x, 1.0, label="mask/1", signals={"session": f"s{sid}", "step": step})
    p, c = by_probe.report(), by_session.report()
    assert (p["ci_unit"], p["ci_units"]) == ("probe", 25) and (c["ci_unit"], c["ci_units"]) == ("session", 4)
    assert c["first_token_kl"] == p["first_token_kl"]  # the same mean
    (plo, phi), (clo, chi) = p["first_token_kl_ci95"], c["first_token_kl_ci95"]
    assert clo < plo and chi > phi and (chi - clo) > 2 * (phi - plo)
    keys = [f"s{sid}" for sid, xs in enumerate(sessions) for _ in xs]
    flat = [x for xs in sessions for x in xs]
    assert c["first_token_kl_ci95"] == bootstrap_ci(flat, clusters=keys) != bootstrap_ci(flat)
    # one session: its interval is undefined whatever the probe count
    one = Fidelity(ci_unit="session")
    for x in sessions[0]:
        one.add(1.0, x, 1.0, signals={"session": "s0"})
    assert one.report()["ci95_undefined"] == ["first_token_kl_ci95", "tf_top1_ci95"]
    assert one.report()["first_token_kl_ci95"][0] == one.report()["first_token_kl_ci95"][1]


def test_a_probe_given_back_goes_to_the_next_relocating_step():
    """A probe whose reference ended at once (EOS) was counted and never made: the run
    ended one short of what it owed.  ``give_back`` owes the turn to a later step."""
    from promptsplice.benchmarks.agent_probes import ProbeTurns

    ranks = {(0, 1): (0, "a"), (0, 2): (1, "a"), (0, 3): (2, "a")}
    t = ProbeTurns(ranks, 1)
    assert t.take((0, 1), True) == "a"
    t.give_back()  # its reference was empty
    assert t.probed == 0 and t.take((0, 2), True) == "a" and t.probed == 1
    assert t.take((0, 3), True) is None  # one requested, one made
    with pytest.raises(ValueError, match="no probe was taken"):
        ProbeTurns(ranks, 1).give_back()


def test_a_control_not_served_its_first_half_from_cache_fails_loudly(monkeypatch):
    """The RAG control (an exact prefill whose first half comes from the prefix cache)
    was never checked: a control that recomputed everything is the reference's own
    computation again, a perfect noise floor (top-1 1.000, KL 0.000) that says nothing.
    It is now verified as the probe is (fake engines: the plain one caches nothing)."""
    import types

    import promptsplice.benchmarks.fidelity as fidelity

    tokens = list(range(100, 100 + 5 * 32 + 7))
    step = types.SimpleNamespace(prompt=types.SimpleNamespace(token_ids=tokens), planned_relocated_tokens=64,
                                 relocated_tokens=64)
    measured = []
    monkeypatch.setattr(fidelity, "reference", lambda engine, toks: ([1, 2], {1: 0.0}))
    monkeypatch.setattr(fidelity.Fidelity, "measure", lambda self, *a, need_cached=None, **k: measured.append(need_cached))

    def engine(cached):
        return types.SimpleNamespace(block_size=32, generate=lambda toks, **kw: types.SimpleNamespace(
            num_cached_tokens=min(cached, len(toks)), token_ids=[1, 2]))

    kv = engine(5 * 32)
    with pytest.raises(FidelityError, match="request 7: the control was served 0 cached tokens of the 64 its first half holds"):
        fidelity.probe_relocated_request(engine(0), kv, step, "s", Fidelity(), Fidelity(), "request 7")
    assert measured == [160]  # the relocated probe's own check ran; the control's did not pass
    measured.clear()
    fidelity.probe_relocated_request(engine(64), kv, step, "s", Fidelity(), Fidelity(), "request 7")
    assert measured == [160, 64]  # the control's teacher-forced probe is checked too
