"""The phase loop every engine runs (``run_phases``): what the adaptive recompute sees."""

from __future__ import annotations

from promptsplice.engine_adapters._requests import PhaseResult, run_phases
from promptsplice.engine_adapters.connector._plans import BlockDeviation, plan_phases
from promptsplice.engine_adapters.runners._steps import AdaptiveRecompute

BS = 16


def _phases():
    """A block inserted at block 2 of a 12-block prompt: new blocks 3-12 are old blocks
    2-11 moved by one block, the first of them recomputed (and probed)."""
    old = list(range(1000, 1000 + 12 * BS))
    new = old[: 2 * BS] + [7] * BS + old[2 * BS :]
    phases = plan_phases(old, new, [(2 * BS, 12 * BS, BS)], block_size=BS, recompute_blocks=1, probe=True)
    return new, phases


def _run(new, phases, deviations):
    adapt = AdaptiveRecompute(0.25, new)
    sent = []

    def run_one(prompt, plan, gen):
        sent.append((len(prompt), plan))
        return PhaseResult(object(), 0, deviations(plan))

    return adapt, sent, run_phases(new, phases, run_one, {"max_tokens": 1}, adapt)


def test_a_planned_probe_the_connector_did_not_measure_fails_closed():
    """A probe dropped by the connector (its block split by a chunked prefill, or a
    quarantined step) gave no deviation, and the guard read that as "small": it loaded
    the relocated run without the recompute the probe was there to decide."""
    new, phases = _phases()
    assert len(phases) == 2 and phases[0].plan.probes, phases
    probe = phases[0].plan.probes[0]

    def small(plan):
        return tuple(BlockDeviation(p.dst_start, p.delta, (0.01,), (0.01,)) for p in (plan.probes if plan is not None else ()))

    adapt, sent, run = _run(new, phases, small)
    assert adapt.extra == 0 and len(sent) == 2  # measured and small: the run is loaded

    def first_dropped(plan):
        return tuple(d for d in small(plan) if d.dst_start != probe.dst_start)

    adapt, sent, run = _run(new, phases, first_dropped)
    assert adapt.extra == 1 and len(sent) == 3  # unmeasured: one more block recomputed first
    extra = run.phases[1].plan
    assert not extra.segments and extra.probes[0].dst_start == probe.dst_start + BS  # block 4, probed
    assert run.phases[2].plan.segments[0].dst_start == probe.dst_start + 2 * BS  # the rest loaded
    assert all(d.value < 1 for d in run.deviations)  # the stand-in infinity is the guard's alone

    adapt, sent, run = _run(new, phases, lambda plan: ())  # nothing ever measured: nothing loaded
    assert not any(ph.plan is not None and ph.plan.segments for ph in run.phases)


def test_an_assembled_prompt_sent_under_another_tenants_salt_is_refused(make_assembler):
    """The embedded engine sent tenant a's assembled prompt under an explicit
    ``cache_salt="b"`` (RemoteEngine and PrefixRouter refuse it): one rule at every door."""
    import pytest

    from promptsplice.engine_adapters._requests import normalize_prompt
    from promptsplice.errors import InvalidSaltError

    asm = make_assembler(block_size=32)
    prompt = asm.assemble([{"id": "c", "text": "A chunk of text."}], query="What?", salt="a")
    norm = normalize_prompt(prompt, None, block_size=32, encode=lambda t: [])
    assert norm.salt == "a" and norm.ids == prompt.token_ids
    assert normalize_prompt(prompt, "a", block_size=32, encode=lambda t: []).salt == "a"
    with pytest.raises(InvalidSaltError, match="differs from the prompt's salt 'a'"):
        normalize_prompt(prompt, "b", block_size=32, encode=lambda t: [])
    unsalted = asm.assemble([{"id": "c", "text": "A chunk of text."}], query="What?")
    assert normalize_prompt(unsalted, "b", block_size=32, encode=lambda t: []).salt == "b"  # salting an unsalted prompt


def test_a_prompt_whose_ids_were_replaced_is_sent_as_replaced(make_assembler):
    """``dataclasses.replace(prompt, token_ids=...)`` kept the assembler's block hashes:
    the engine's mirror raised on them after vLLM had run the request."""
    import dataclasses

    from promptsplice.engine_adapters._requests import normalize_prompt

    prompt = make_assembler(block_size=32).assemble([{"id": "c", "text": "A chunk of text. " * 12}], query="What?")
    assert len(prompt.block_hashes) >= 2
    longer = dataclasses.replace(prompt, token_ids=list(prompt.token_ids) * 2)
    norm = normalize_prompt(longer, None, block_size=32, encode=lambda t: [])
    assert norm.ids == list(prompt.token_ids) * 2


def test_an_assembled_prompt_s_ids_take_the_one_token_id_rule(make_assembler):
    """An assembled prompt's ids were copied unchecked (plain lists and the router take
    ``check_token_ids``): a float or a bool put in place reached vLLM."""
    import pytest

    from promptsplice.engine_adapters._requests import normalize_prompt
    from promptsplice.errors import InputError

    prompt = make_assembler(block_size=32).assemble([{"id": "c", "text": "A chunk of text."}], query="What?")
    for bad in (2.7, True, -1):
        edited = list(prompt.token_ids)
        edited[3] = bad
        prompt.token_ids = edited
        with pytest.raises(InputError, match=r"prompt.token_ids\[3\] is not a token id"):
            normalize_prompt(prompt, None, block_size=32, encode=lambda t: [])


def test_malformed_phases_are_an_input_error_before_any_request():
    """Plain tuples, a float or bool end, a dict plan: raw AttributeError or TypeError
    from the phase loop (a bool end even ran), now an InputError naming the fix."""
    import pytest

    from promptsplice.engine_adapters import SplicePhase
    from promptsplice.engine_adapters._requests import run_phases
    from promptsplice.errors import InputError

    sent = []

    def run_one(prompt, plan, gen):
        sent.append(len(prompt))
        raise AssertionError("no phase may run")

    for phases in ([(2, None), (3, None)], [SplicePhase(2.0, None), SplicePhase(3, None)],
                   [SplicePhase(True, None), SplicePhase(3, None)], [SplicePhase(3, {})]):
        with pytest.raises(InputError, match="each phase must be a SplicePhase"):
            run_phases([1, 2, 3], phases, run_one, {})
    assert sent == []


def test_a_completion_names_its_cached_tokens_as_every_other_record_does():
    from promptsplice.engine_adapters import Completion

    c = Completion(text="", token_ids=[], prompt_token_ids=[1] * 70, prompt_tokens=70, num_cached_tokens=64,
                   ttft_s=0.0, total_s=0.0, finish_reason="length")
    assert (c.cached_tokens, c.prefill_tokens) == (64, 6)


def test_generate_phases_options_are_checked_before_any_phase_on_both_engines():
    """``generate_phases(**gen)`` forwarded gen to the last phase's ``generate``: a typo
    (``max_token=4``) or a key the phases set (``splice=``) raised a bare ``TypeError``
    there, after the earlier phases had already run; a bad value likewise."""
    import pytest

    from promptsplice.engine_adapters import RemoteEngine
    from promptsplice.engine_adapters._requests import check_phase_options
    from promptsplice.errors import ConfigError

    served = RemoteEngine("http://127.0.0.1:9", model="m", tokenizer="tiktoken:cl100k_base", block_size=BS,
                          max_retries=0)
    for gen, match in (
        ({"max_token": 4}, r"generate_phases got max_token=4, which is not an option of generate: pass only "
                           r"max_tokens, temperature, stop, logprobs"),
        ({"splice": None}, r"splice=None, which is set by generate_phases itself"),
        ({"max_tokens": 0}, r"max_tokens must be an int >= 1, got 0"),
        ({"temperature": -1.0}, r"temperature must be a number >= 0, got -1.0"),
        ({"temperature": 3.0}, r"temperature must be in \[0, 2\] \(vLLM's range\), got 3.0"),  # was: after the early phases
        ({"logprobs": -2}, r"logprobs must be None, -1 \(all\) or an int >= 0, got -2"),
    ):
        with pytest.raises(ConfigError, match=match):
            check_phase_options(gen)
        with pytest.raises(ConfigError, match=match):  # before the served engine sends anything
            served.generate_phases([1, 2, 3], [(2, None), (3, None)], **gen)
    check_phase_options({"max_tokens": 4, "temperature": 0.5, "stop": ["\n"], "logprobs": -1})
    check_phase_options({"temperature": 2})  # vLLM's top


def test_request_limits_refuse_out_of_vocabulary_ids_and_too_many_logprobs():
    import pytest

    from promptsplice.engine_adapters._requests import check_request_limits
    from promptsplice.errors import ConfigError, InputError

    limits = (20, 49152, 49151)  # max_logprobs 20, SmolLM2's vocabulary
    check_request_limits([0, 49151], 20, limits)
    check_request_limits([5], 0, limits)
    with pytest.raises(InputError, match=r"token id 49152, outside the model's vocabulary \(ids 0\.\.49151\)"):
        check_request_limits([1, 49152], None, limits)
    with pytest.raises(InputError, match=r"token id -1, outside"):
        check_request_limits([-1, 3], None, limits)
    with pytest.raises(ConfigError, match=r"logprobs=21 asks for 21 .*max_logprobs \(20\)"):
        check_request_limits([1], 21, limits)
    with pytest.raises(ConfigError, match=r"logprobs=-1 asks for 49152 .*max_logprobs \(20\)"):
        check_request_limits([1], -1, limits)
    # an engine started with max_logprobs=-1: resolved to the vocabulary, so -1 and all fit
    full = (49152, 49152, 49151)
    check_request_limits([1], -1, full)
    check_request_limits([1], 49152, full)
    with pytest.raises(ConfigError, match=r"logprobs=49153 asks for 49153"):
        check_request_limits([1], 49153, full)


def test_the_rag_guard_reads_every_recomputed_block_and_computes_the_whole_run():
    """``AdaptiveRecompute(window=r, whole_run=True)`` (the RAG runner's): the largest
    deviation over a run start's r recomputed blocks decides, and the run is computed
    whole.  The agent's guard (the last block only, one more block) missed a chunk
    whose first recomputed block deviated most; on the trace suite that largest
    deviation ranked first-token KL at Spearman 0.70 (README, "deviation guard")."""
    old = list(range(1000, 1000 + 12 * BS))
    new = old[: 2 * BS] + [7] * BS + old[2 * BS :]
    phases = plan_phases(old, new, [(2 * BS, 12 * BS, BS)], block_size=BS, recompute_blocks=2, probe=True)
    probe = phases[0].plan.probes[0]
    assert probe.num_blocks == 2 and phases[1].plan.segments[0].dst_start == probe.dst_start + 2 * BS

    def first_high(plan):  # the first recomputed block deviates, the last one does not
        return tuple(BlockDeviation(probe.dst_start + i * BS, probe.delta, (v,), (v,)) for i, v in enumerate((0.4, 0.01))
                     ) if plan is not None and plan.probes else ()

    def run(adapt):
        return run_phases(new, phases, lambda prompt, plan, gen: PhaseResult(object(), 0, first_high(plan)),
                          {"max_tokens": 1}, adapt)

    agent = AdaptiveRecompute(0.25, new)
    assert run(agent).phases == tuple(phases) and agent.extra == 0  # the last block read 0.01: loaded
    rag = AdaptiveRecompute(0.25, new, window=2, whole_run=True)
    out = run(rag)
    seg = phases[1].plan.segments[0]
    assert not any(ph.plan is not None and ph.plan.segments for ph in out.phases)  # nothing loaded
    assert rag.extended == [seg.dst_start + i * BS for i in range(seg.num_blocks)]  # every block of the run
    calm = AdaptiveRecompute(0.5, new, window=2, whole_run=True)  # under the threshold: loaded as planned
    assert run(calm).phases == tuple(phases) and calm.extra == 0


def test_the_rag_guard_computes_every_later_run_of_a_request_once_one_deviates():
    """Once a run start deviates beyond the threshold, the RAG guard computes the rest of
    the request's runs too, calm starts included: computing only the deviating run left
    the worst probes of wiki-diverse and pydocs at first-token KL 0.050 and 0.038 (other
    runs of the same request stayed relocated; README, "The run-start guard")."""
    old = list(range(1000, 1000 + 12 * BS))
    new = old[: 2 * BS] + [7] * BS + old[2 * BS : 6 * BS] + [8] * BS + old[6 * BS :]
    phases = plan_phases(old, new, [(2 * BS, 6 * BS, BS), (6 * BS, 12 * BS, 2 * BS)], block_size=BS,
                         recompute_blocks=2, probe=True)
    runs = [ph.plan.segments for ph in phases if ph.plan is not None and ph.plan.segments]
    assert len(runs) == 2  # two loaded runs, each after its own two recomputed blocks
    first = phases[0].plan.probes[0].dst_start

    def deviations(plan):  # the first run's start deviates, the second's is calm
        if plan is None or not plan.probes:
            return ()
        return tuple(BlockDeviation(q.dst_start + i * BS, q.delta, (v,), (v,)) for q in plan.probes
                     for i, v in enumerate((0.4, 0.01) if q.dst_start == first else (0.01, 0.01)))

    def run(adapt):
        return run_phases(new, phases, lambda prompt, plan, gen: PhaseResult(object(), 0, deviations(plan)),
                          {"max_tokens": 1}, adapt)

    rag = AdaptiveRecompute(0.25, new, window=2, whole_run=True)
    out = run(rag)
    assert not any(ph.plan is not None and ph.plan.segments for ph in out.phases)  # neither run loaded
    assert rag.extended == [g.dst_start + i * BS for segs in runs for g in segs for i in range(g.num_blocks)]
    # what the gate learns from (GuardRates): the run whose own start deviated, only
    assert rag.deviated == [g.dst_start + i * BS for g in runs[0] for i in range(g.num_blocks)]
    assert not rag.unmeasured
    calm = AdaptiveRecompute(0.5, new, window=2, whole_run=True)
    assert run(calm).phases == tuple(phases) and calm.extra == 0 and not calm.unmeasured
    # a first-run probe the connector did not measure: computed (fails closed), and
    # flagged, so the gate learns no deviation from it
    blind = AdaptiveRecompute(0.5, new, window=2, whole_run=True)
    out = run_phases(new, phases, lambda prompt, plan, gen: PhaseResult(
        object(), 0, () if plan is not None and plan.probes and plan.probes[0].dst_start == first else deviations(plan)),
        {"max_tokens": 1}, blind)
    assert not any(ph.plan is not None and ph.plan.segments for ph in out.phases) and blind.unmeasured
    # a measured trip, then a later run's probe unmeasured: the trip is still learnt (the
    # request was flagged and taught the gate nothing, a review found)
    late = AdaptiveRecompute(0.25, new, window=2, whole_run=True)
    run_phases(new, phases, lambda prompt, plan, gen: PhaseResult(
        object(), 0, deviations(plan) if plan is not None and plan.probes and plan.probes[0].dst_start == first else ()),
        {"max_tokens": 1}, late)
    assert late.deviated == rag.deviated and not late.unmeasured


def test_phases_that_do_not_end_at_the_prompt_are_refused_before_any_request():
    """Ends 64 then 40 on a 100-token prompt answered from the first 40 tokens; an end
    of 500 sent 100 tokens for a plan built for 500."""
    import pytest

    from promptsplice.engine_adapters.connector._plans import SplicePhase, SplicePlan
    from promptsplice.errors import InputError

    tokens, sent = list(range(100)), []
    plan = SplicePlan(32, ())

    def run_one(prompt, plan, gen):
        sent.append(len(prompt))
        return PhaseResult(object(), 0)

    for ends in ((64, 40), (64, 500), (64, 64, 100), (100, 100), (50,), (0, 100)):
        with pytest.raises(InputError, match=r"phase ends must rise and the last must be the prompt's 100 tokens"):
            run_phases(tokens, [SplicePhase(e, plan) for e in ends], run_one, {"max_tokens": 1})
    assert sent == []
    run_phases(tokens, [SplicePhase(64, plan), SplicePhase(100, plan)], run_one, {"max_tokens": 1})
    assert sent == [64, 100]


def test_a_text_prompt_with_a_lone_surrogate_is_refused_as_the_router_refuses_it():
    """vLLM's tokenizer raised on it, a ``TokenizerError`` (a RuntimeError, no fix in its
    message); the router raises ``InvalidUTF8Error`` naming the character."""
    import pytest

    from promptsplice.engine_adapters._requests import normalize_prompt
    from promptsplice.engine_adapters._router import prefix_route_key
    from promptsplice.errors import InvalidUTF8Error

    text = "hi \ud800 there"
    with pytest.raises(InvalidUTF8Error) as routed:
        prefix_route_key(text, block_size=32)
    encoded = []
    with pytest.raises(InvalidUTF8Error) as sent:
        normalize_prompt(text, None, block_size=32, encode=lambda t: encoded.append(t) or [1])
    assert str(sent.value) == str(routed.value) and "pass valid text" in str(sent.value)
    assert (sent.value.index, sent.value.offset) == (routed.value.index, routed.value.offset) == (0, 3)
    assert encoded == []  # refused before vLLM's tokenizer saw it


def test_phases_that_are_no_list_of_phases_are_an_input_error_on_both_engines():
    """``generate_phases(tokens, None)`` (or an int) raised a bare ``TypeError`` from
    ``list(phases)``; an empty list is refused by the same check."""
    import pytest

    from promptsplice.engine_adapters import RemoteEngine, SplicePhase
    from promptsplice.engine_adapters._requests import run_phases
    from promptsplice.errors import InputError

    served = RemoteEngine("http://127.0.0.1:9", model="m", tokenizer="tiktoken:cl100k_base", block_size=BS,
                          max_retries=0)
    for phases, match in ((None, "phases must be a list of SplicePhase, got NoneType"),
                          (3, "phases must be a list of SplicePhase, got int"),
                          (SplicePhase(3, None), "phases must be a list of SplicePhase, got SplicePhase"),
                          ([], "needs at least one phase")):
        with pytest.raises(InputError, match=match):
            served.generate_phases([1, 2, 3], phases)
        with pytest.raises(InputError, match=match):
            run_phases([1, 2, 3], phases, lambda *a: None, {})
