"""The runners over a served engine: ``AgentRunner`` and ``RagRunner`` (exact) run on a
``RemoteEngine`` pointed at a real ``vllm serve`` on loopback that loads the splice
connector (``served_kv``), through the same code path as on the embedded engine
(``kv_engine``, same store sizes), and give the same cached, relocated and prefilled
token counts on the same steps; a PIC-style relocation sent through ``generate`` too.
The engine surface itself: block size from the connector's probe, the tokenizer
checked against the server's ``/tokenize``, bad values refused by name."""

from __future__ import annotations

import itertools

import pytest

from promptsplice.assembler import ContextHook, StepKind
from promptsplice.engine_adapters import AgentRunner, RagRunner, RemoteEngine, plan_phases, plan_relocation
from promptsplice.errors import ConfigError

from tests.engine_adapters._engine import agent_renders, wiki_lines
from tests.engine_adapters.runners.test_agent import TOOLS

BS = 32
_n = itertools.count()


def salt(name: str) -> str:
    return f"served-eng-{name}-{next(_n)}"


@pytest.fixture
def remote(served_kv):
    if served_kv.proc.poll() is not None:
        pytest.fail(f"vllm serve exited with {served_kv.proc.returncode}:\n{served_kv.tail()}")
    with RemoteEngine(served_kv.base_url, max_retries=0, timeout=600) as eng:  # a loaded CI machine is slow
        yield eng


@pytest.fixture(scope="module")
def renders():
    return agent_renders(wiki_lines())


def agent_counts(engine, renders, tenant):
    """Per step: kind, prompt, prefilled, cached, relocated tokens, requests, output, the
    probes' deviations (bounded's guard reads them: in process, or in the served acks)."""
    runner = AgentRunner(engine, mode="splice", salt=tenant, recompute_blocks=1, fidelity="bounded")
    hook = ContextHook(engine.tokenizer, block_size=engine.block_size, salt=tenant)
    rows, last = [], None
    for msgs in renders:
        prepared = hook("s", msgs, TOOLS)
        step = runner.step(prepared, max_tokens=4)
        rows.append((prepared.kind, step.prompt_tokens, step.prefill_tokens, step.cached_tokens,
                     step.relocated_tokens, step.requests, step.completion.token_ids,
                     tuple(round(d, 4) for d in step.deviations)))
        last = (prepared, step)
    return rows, last


@pytest.mark.reliability
def test_the_served_engine_says_its_block_size_and_checks_its_tokenizer(remote, served_kv, default_tok):
    assert remote.can_splice and remote.block_size == BS
    assert remote.tokenizer.encode("Hello world") == default_tok.encode("Hello world")
    with RemoteEngine(served_kv.base_url, block_size=16) as wrong:
        with pytest.raises(ConfigError, match=r"block_size=16\) but the splice connector .* runs block_size 32"):
            _ = wrong.block_size

    class Shifted:  # a tokenizer of another model: same text, other ids
        name = "shifted"
        filler_token_id = default_tok.filler_token_id

        def encode(self, text):
            return [t + 1 for t in default_tok.encode(text)]

        def encode_batch(self, texts):
            return [self.encode(t) for t in texts]

        def decode(self, ids):
            return default_tok.decode([t - 1 for t in ids])

    with RemoteEngine(served_kv.base_url, tokenizer=Shifted()) as other:
        with pytest.raises(ConfigError, match="'shifted' splits the probe text into .* pass RemoteEngine\\(tokenizer=...\\)"):
            _ = other.tokenizer
    # make_assembler: the server's block size (a TypeError before), the server's tokenizer
    with pytest.raises(ConfigError, match="block_size=16 differs from the server's 32"):
        remote.make_assembler(block_size=16)
    assert remote.make_assembler(block_size=BS).block_size == BS
    with pytest.raises(ConfigError, match="'shifted'.*splits text otherwise"):
        remote.make_assembler(tokenizer=Shifted())
    with RemoteEngine(served_kv.base_url) as unknown:  # given none: the server is asked
        with pytest.raises(ConfigError, match="'shifted' splits the probe text"):
            unknown.make_assembler(tokenizer=Shifted())
    with pytest.raises(ConfigError, match="logprobs must be"):
        remote.generate([1, 2, 3], max_tokens=1, logprobs=-2)


def test_logprobs_over_the_served_engine_are_keyed_by_token_id_as_in_process(remote, kv_engine, default_tok):
    prompt = list(default_tok.encode("The capital of France is Paris. The capital of Italy is"))
    s = salt("lp")
    mine = kv_engine.generate(prompt, max_tokens=2, cache_salt=s, logprobs=5)
    theirs = remote.generate(prompt, max_tokens=2, cache_salt=s, logprobs=5)
    assert theirs.token_ids == mine.token_ids and len(theirs.logprobs) == 2
    for a, b in zip(mine.logprobs, theirs.logprobs):
        assert set(a) == set(b) and 5 <= len(b) <= 6  # the top 5, and the sampled token
        assert all(abs(a[t] - b[t]) < 1e-3 for t in a)
    full = remote.generate(prompt, max_tokens=1, cache_salt=s, logprobs=-1).logprobs[0]
    assert len(full) == len(kv_engine.generate(prompt, max_tokens=1, cache_salt=s, logprobs=-1).logprobs[0]) > 40_000


def test_a_fidelity_probe_over_the_served_engine_measures_what_it_measures_in_process(remote, kv_engine, renders):
    from promptsplice.benchmarks.fidelity import full_blocks, kl, probe, reference

    results = {}
    for name, eng in (("embedded", kv_engine), ("served", remote)):
        rows, (prepared, step) = agent_counts(eng, renders, salt(f"fid-{name}"))
        assert rows[2][4] > 0  # the edit relocated KV
        toks = list(prepared.token_ids)
        # the probe first, while the step's spliced blocks are in vLLM's cache (checked)
        cont = eng.generate(toks, max_tokens=8, cache_salt=step.salt).token_ids
        tf, first = probe(eng, toks, list(cont), step.salt, need_cached=full_blocks(eng, toks))
        ref_cont, p_ref = reference(eng, toks)
        results[name] = (list(cont), tf, kl(p_ref, first), ref_cont[:8])
    print("fidelity probe (tf top-1, first-token KL):", {k: v[1:3] for k, v in results.items()})
    (c1, tf1, kl1, r1), (c2, tf2, kl2, r2) = results["embedded"], results["served"]
    assert (c1, r1, tf1) == (c2, r2, tf2) and abs(kl1 - kl2) < 1e-4 and kl2 > 0


def test_agent_runner_over_the_served_engine_gives_the_embedded_counts(remote, kv_engine, renders):
    embedded, _ = agent_counts(kv_engine, renders, salt("agent-emb"))
    tenant = salt("agent-srv")
    served, (prepared, step) = agent_counts(remote, renders, tenant)
    assert [r[0] for r in served] == [StepKind.NEW_SESSION, StepKind.APPEND, StepKind.EDIT]
    # kind, prompt, prefilled, cached, relocated tokens, requests, greedy output: equal
    assert served == embedded
    print("agent counts (kind, prompt, prefill, cached, relocated, requests):", [r[:6] for r in served])
    phases = plan_phases(
        prepared.previous.token_ids, prepared.token_ids, prepared.diff.relocations, block_size=BS,
        recompute_blocks=1, salt=step.salt, src_salt=tenant,
        load_prefix=prepared.first_changed_token // BS * BS, scope=True,
    )
    moved = sum(s.num_blocks * BS for ph in phases for s in ph.plan.segments if s.delta)
    assert moved > 0 and served[2][4] == moved and served[2][5] == len(phases)
    assert served[2][2] < served[2][1] - moved  # the edit prefilled less than all but the moved blocks
    assert len(served[2][7]) == 1 and 0 < served[2][7][0] < 1  # the edit's recomputed block was probed


def test_rag_runner_exact_over_the_served_engine_gives_the_embedded_counts(remote, kv_engine, rag_requests):
    reqs = rag_requests[:3]
    counts = {}
    for name, eng in (("embedded", kv_engine), ("served", remote)):
        runner = RagRunner(eng, mode="exact", salt=salt(f"rag-{name}"), policy="stable")
        steps = [runner.run(chunks(r), query=r.query, system=r.system or None, max_tokens=4) for r in reqs]
        counts[name] = [(s.prompt_tokens, s.prefill_tokens, s.cached_tokens, s.requests, s.completion.token_ids)
                        for s in steps]
        predicted = [s.completion.predicted_cached_tokens for s in steps]
    assert counts["served"] == counts["embedded"]
    print("rag exact counts (prompt, prefill, cached, requests):", [c[:4] for c in counts["served"]])
    # the client's mirror of the server's cache predicted every count, with its capacity
    assert [p for p in predicted] == [c[2] for c in counts["served"]]
    assert remote.mirror.capacity_blocks == remote.splice_probe().num_blocks - 1 > 500  # 1 GiB of KV
    assert counts["served"][0][2] == 0 and any(c[2] > 0 for c in counts["served"][1:])


def pic_counts(engine, reqs, tenant, **kw):
    """Per request: prompt, prefilled, cached, relocated, precomputed tokens, relocated
    chunks, requests, fallback, greedy output, deviations, planned relocated and
    recomputed tokens (position-independent reuse)."""
    runner = RagRunner(engine, mode="position_independent", salt=tenant, policy="stable", **kw)
    steps = [runner.run(chunks(r), query=r.query, system=r.system or None, max_tokens=4) for r in reqs]
    return [
        (s.prompt_tokens, s.prefill_tokens, s.cached_tokens, s.relocated_tokens, s.precomputed_tokens,
         s.relocated_chunks, s.requests, s.extra_recompute_blocks, s.fallback, s.completion.token_ids,
         tuple(round(d, 4) for d in s.deviations), s.planned_relocated_tokens, s.recomputed_tokens)
        for s in steps
    ]


def test_rag_runner_pic_over_the_served_engine_gives_the_embedded_counts(remote, kv_engine, rag_requests):
    # Requests whose chunks recur at other positions: relocated from the store.  Under a
    # guard that never trips every planned relocation lands; under a low one the
    # connector's measurements (in process, or in the served acks) extend the recompute
    # (the sticky guard computes every later run of a request after its first trip): the
    # same both ways.
    reqs = rag_requests[:6]
    results = {}
    for name, kw in (("relocated", {"fidelity": "bounded", "relocate": "always", "max_deviation": 1.0}),
                     ("guarded", {"fidelity": "bounded", "relocate": "always", "max_deviation": 0.1}),
                     ("default", {})):
        embedded = pic_counts(kv_engine, reqs, salt(f"pic-emb-{name}"), **kw)
        served = pic_counts(remote, reqs, salt(f"pic-srv-{name}"), **kw)
        print("pic counts", name, "(prompt, prefill, cached, relocated, precomputed, chunks, requests, extra):",
              [c[:8] for c in served])
        assert served == embedded
        results[name] = served
    relocated, guarded, default = results["relocated"], results["guarded"], results["default"]
    assert sum(c[3] for c in relocated) > 0 and sum(c[7] for c in relocated) == 0  # relocated, never extended
    assert sum(c[7] for c in guarded) > 0  # the guard extended
    assert sum(c[3] for c in guarded) < sum(c[3] for c in relocated)
    assert sum(c[-1] for c in default) > 0  # the store queries of the exact record answered alike
    for probed in (relocated, guarded):
        assert any(c[10] for c in probed) and all(d <= 1.0 for c in probed for d in c[10])
    assert all(c[3] == 0 and not c[10] for c in default)  # exact: nothing relocated or probed


@pytest.mark.reliability
def test_rag_runner_pic_needs_the_connector_on_the_server(live_servers):
    from promptsplice.engine_adapters import chain_refs

    with RemoteEngine(live_servers[0].base_url, block_size=BS, max_retries=0) as plain:
        with pytest.raises(ConfigError, match="splice connector"):
            RagRunner(plain, mode="position_independent")
        with pytest.raises(ConfigError, match="does not run the splice connector"):
            plain.match_chains([(chain_refs(list(range(BS)), BS), None)])


def test_store_queries_over_the_servers_max_model_len_are_split_and_answered(remote):
    """The connector refuses a store query carrying more tokens than its engine's
    max_model_len (2,048 here); the client batched at MAX_QUERY_TOKENS (2^18), so chains
    totalling more than that raised EngineResponseError.  The probe's ack now names the
    cap, and match_chains splits its queries under it (a chain over it: its lead)."""
    from promptsplice.engine_adapters import chain_refs

    s = salt("max-query")
    a = list(range(20_000, 20_000 + 12 * BS))
    b = list(range(30_000, 30_000 + 12 * BS))
    for toks in (a, b):  # 12 full blocks each reach the connector's store (5 tokens after them)
        remote.generate(toks + [7, 8, 9, 10, 11], max_tokens=1, cache_salt=s)
    more = list(range(1_000, 1_000 + 58 * BS))  # never sent
    ra, rb = chain_refs(a, BS, salt=s), chain_refs(b, BS, salt=s)
    chains = [
        (ra, s),                                              # 12 blocks, all stored
        (rb, s),                                              # 12 blocks, all stored
        (chain_refs(a + more[: 30 * BS], BS, salt=s), s),     # 42 blocks, its first 12 stored
        (chain_refs(more[: 20 * BS], BS, salt=s), s),         # 20 blocks, none stored
        (rb[:5], s),                                          # 5 blocks, stored
        (chain_refs(a + more, BS, salt=s), s),                # 70 blocks: over the cap (asked: its first 64)
    ]
    assert sum(len(refs) for refs, _ in chains) * BS == 161 * BS > 2048
    assert remote.match_chains(chains) == [12, 12, 12, 0, 5, 12]
    assert remote.match_chains(chains[:2]) == [12, 12]  # the same answers from one query under the cap
    assert remote.splice_probe().max_query_tokens == 2048  # loopback_servers' --max-model-len


def test_a_pic_relocation_through_generate_gives_the_embedded_counts(remote, kv_engine, default_tok, rag_requests):
    text = "\n\n".join(dict.fromkeys(c.text for r in rag_requests for c in r.chunks))
    toks = list(default_tok.encode(text))
    chunk, head_a, head_b = toks[700 : 700 + 4 * BS], toks[: 3 * BS], toks[1000 : 1000 + BS]
    old = head_a + chunk + toks[1300:1310]
    new = head_b + chunk + toks[1400:1412]
    counts = {}
    for name, eng in (("embedded", kv_engine), ("served", remote)):
        s = salt(f"pic-{name}")
        eng.generate(old, max_tokens=1, cache_salt=s)
        eng.generate(head_b + [1, 2, 3], max_tokens=1, cache_salt=s)  # head_b in the prefix cache
        plan = plan_relocation(old, new, old_start=3 * BS, new_start=BS, num_tokens=4 * BS, block_size=BS, salt=s)
        run = eng.generate_phases(new, [plan_phase(new, plan)], cache_salt=s, max_tokens=4)
        out = run.completions[-1]
        counts[name] = (out.num_cached_tokens, out.prefill_tokens, run.relocated_tokens, out.token_ids)
    assert counts["served"] == counts["embedded"]
    assert counts["served"][:3] == (5 * BS, len(new) - 5 * BS, 4 * BS)


def chunks(req):
    from promptsplice.benchmarks.assemble import _chunks

    return _chunks(req)


def plan_phase(tokens, plan):
    from promptsplice.engine_adapters import SplicePhase

    return SplicePhase(len(tokens), plan)


@pytest.mark.reliability
def test_generate_phases_refuses_what_the_server_would_before_any_phase_runs(remote):
    """Over the served engine the phases went out one by one: a prompt over the server's
    ``max_model_len`` (2,048 here) failed with the last phase's 400, after the earlier
    phases had prefilled on the server; a bad id or a plan of another block size in a
    later phase likewise.  Now each is refused before the first phase goes out, as on
    the embedded engine: the first phase's blocks are not in the server's cache after."""
    from promptsplice.blocks import root_hash
    from promptsplice.engine_adapters import SplicePhase, SplicePlan, SpliceSegment
    from promptsplice.errors import ContextLengthError, InputError

    assert remote.max_model_len == 2048  # loopback_servers' --max-model-len, from /v1/models
    s = salt("phase-checks")
    over = [(7 * i) % 30000 + 50 for i in range(2048 + 8)]
    with pytest.raises(ContextLengthError, match="the prompt has 2056 tokens but the engine's max_model_len is 2048"):
        remote.generate_phases(over, [SplicePhase(2 * BS, None), SplicePhase(len(over), None)], cache_salt=s, max_tokens=1)
    bad = [(11 * i) % 30000 + 60 for i in range(3 * BS)]
    with pytest.raises(InputError, match=r"tokens\[95\]"):
        remote.generate_phases(bad[:-1] + [-1], [SplicePhase(2 * BS, None), SplicePhase(3 * BS, None)], cache_salt=s, max_tokens=1)
    other_bs = SplicePlan(2 * BS, (SpliceSegment(0, 1, 0, root_hash(None)),))
    with pytest.raises(ConfigError, match="made for block_size 64, the engine's is 32"):
        remote.generate_phases(bad, [SplicePhase(2 * BS, None), SplicePhase(3 * BS, other_bs)], cache_salt=s, max_tokens=1)
    for toks in (over, bad):  # no phase ran: the first phase's two blocks were never cached
        assert remote.generate(toks[: 2 * BS + 1], max_tokens=1, cache_salt=s).num_cached_tokens == 0
    run = remote.generate_phases(bad, [SplicePhase(2 * BS, None), SplicePhase(3 * BS, None)], cache_salt=s, max_tokens=2)
    assert [c.prompt_tokens for c in run.completions] == [2 * BS, 3 * BS]
    assert run.completions[1].num_cached_tokens == 2 * BS  # the blocks the check above cached
