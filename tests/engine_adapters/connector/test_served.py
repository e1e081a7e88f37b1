"""The served connector's wire (``_served``), engine-free: what the connector finds when
a request's ``kv_transfer_params`` and its prompt disagree, and the ack round trip.
(The real ``vllm serve`` runs are in ``tests/engine_adapters/test_served_connector.py``.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptsplice.blocks import root_hash
from promptsplice.engine_adapters import SplicePlan, SpliceSegment, plan_deletion
from promptsplice.engine_adapters.connector._served import (
    CHECK_KEY,
    MAX_QUERY_TOKENS,
    PROBE_KEY,
    PROBE_REASON,
    QUERY_KEY,
    QUERY_REASON,
    SpliceAck,
    ack_params,
    answer_query,
    plan_check,
    plan_verdict,
    query_params,
    splice_params,
)
from promptsplice.engine_adapters.store._store import chain_refs
from promptsplice.errors import ConfigError, InputError

BS = 32


def case():
    P, X, S = list(range(1000, 1064)), list(range(5000, 5064)), list(range(9000, 9096))
    old, new = P + X + S + [1, 2], P + S + [7] * 10
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS, salt="t")
    return new, plan


def test_a_matching_plan_is_applied():
    new, plan = case()
    assert plan_verdict(splice_params(plan, new), new, BS) == (True, "", 96)
    assert plan_verdict(None, new, BS) == (False, "", 0)
    assert plan_verdict({"other": 1}, new, BS) == (False, "", 0)


def test_each_mismatch_is_named():
    new, plan = case()
    params = splice_params(plan, new)
    other = list(new)
    other[70] += 1
    cases = [
        (other, params, f"request's {len(new)} token ids differ from those the plan was made for"),
        (new[:-1], params, f"plan was made for a prompt of {len(new)} tokens, the request has {len(new) - 1}"),
        (new[:100], {**plan.to_params(), CHECK_KEY: plan_check(new[:100])},
         "covers tokens [64, 160) (3 blocks) but the request's 100 tokens hold only 3 full blocks"),
        (new, {**params, "splice": {**params["splice"], "block_size": 16}}, "made for block_size 16, the server's is 32"),
        (new, {**params, "splice": {"version": 9}}, "malformed splice plan: splice plan version 9"),
        (new, {CHECK_KEY: plan_check(new)}, "has 'splice_check' but no 'splice' plan"),
        (new, {**params, CHECK_KEY: [1]}, "must be a mapping"),
    ]
    for tokens, p, reason in cases:
        verdict = plan_verdict(p, tokens, BS)
        assert verdict.has_plan and reason in verdict.reason, (reason, verdict)


def test_an_oversized_plan_or_query_is_refused_before_it_is_read(monkeypatch):
    """Both run in vLLM's scheduler loop, from the client's kv_transfer_params: 400,000
    segments were parsed (1.6 s) before the extent check refused them, and a store query
    of 4M tokens was type-checked token by token (0.3 s) before the cap refused it."""
    from promptsplice.engine_adapters.connector import _plans

    new, plan = case()
    params = splice_params(plan, new)
    huge = {**params, "splice": {**params["splice"], "segments": [params["splice"]["segments"][0]] * 400_000}}
    parsed = []
    monkeypatch.setattr(_plans.SplicePlan, "from_params", classmethod(lambda cls, p: parsed.append(p)))
    verdict = plan_verdict(huge, new, BS)
    assert parsed == [] and verdict.reason == f"the plan has 400000 segments and probes for a prompt of {len(new)} tokens"

    class Tokens(list):  # a list whose items may not be read
        def __iter__(self):
            raise AssertionError("the tokens were read")

    raw = [{"parent": "00" * 16, "salt": None, "tokens": Tokens([1] * (8 * BS))}]
    assert answer_query(raw, FakeStore().match, BS, None, 4 * BS) == (
        (), f"a store query carries at most {4 * BS} tokens (the engine's max_model_len)"
    )


def test_ack_round_trip():
    ack = SpliceAck(True, "", 96, 96, 96)
    assert SpliceAck.from_params(ack_params(ack)) == ack
    with pytest.raises(InputError, match="planned_tokens must be a count"):  # there, but malformed
        SpliceAck.from_params({"splice_ack": {"applied": True}})
    for field, bad in (("applied", "false"), ("relocated_tokens", -96), ("block_size", 32.0), ("matched", [1, -1])):
        with pytest.raises(InputError, match=f"the splice ack's {field} must be"):
            SpliceAck.from_params({"splice_ack": {**ack_params(ack)["splice_ack"], field: bad}})
    assert SpliceAck.from_params(None) is None
    with_bs = SpliceAck(True, "", 96, 96, 96, 32)
    assert SpliceAck.from_params(ack_params(with_bs)) == with_bs
    # an ack from a connector that did not send its block size reads as 0 (unknown)
    raw = {k: v for k, v in ack_params(with_bs)["splice_ack"].items() if k != "block_size"}
    assert SpliceAck.from_params({"splice_ack": raw}).block_size == 0
    # a query's answer and the relocation flag survive JSON (tuples come back as lists)
    answered = SpliceAck(False, QUERY_REASON, 0, 0, 0, 32, True, (3, 0, 1))
    assert SpliceAck.from_params(json.loads(json.dumps(ack_params(answered)))) == answered
    assert SpliceAck.from_params({"splice_ack": raw}).relocation is False  # unsaid: no


def test_an_ack_whose_counts_contradict_each_other_or_the_prompt_is_refused():
    """relocated <= loaded <= the prompt's tokens; an ack with applied false may still
    count loads (the plain prefill's offload hits, a load that went out before the
    connector failed on the request), so only the bounds hold there too."""
    for ack, prompt, says in (
        (SpliceAck(False, "dropped", 0, 0, 10**6), None, r"relocated_tokens \(1000000\) exceed its loaded_tokens \(0\)"),
        (SpliceAck(True, "", 96, 64, 96), 200, r"relocated_tokens \(96\) exceed its loaded_tokens \(64\)"),
        (SpliceAck(True, "", 96, 96, 0), 95, r"loaded_tokens \(96\) exceed the prompt's 95 tokens"),
    ):
        with pytest.raises(InputError, match=says):
            SpliceAck.from_params(ack_params(ack), prompt_tokens=prompt)
    for ack in (SpliceAck(True, "", 96, 96, 32), SpliceAck(False, "dropped", 96, 64, 0), SpliceAck(False, "failed", 96, 96, 96)):
        assert SpliceAck.from_params(ack_params(ack), prompt_tokens=96) == ack
    assert SpliceAck.from_params(ack_params(SpliceAck(True, "", 96, 96, 96))) == SpliceAck(True, "", 96, 96, 96)


def test_the_acks_max_query_tokens_round_trips_and_reads_as_unknown_from_an_older_connector():
    """The connector caps a store query at its engine's max_model_len; its acks say the
    cap (``max_query_tokens``) so the client splits its queries under it.  An ack
    without the field (an older connector) reads as 0: unknown."""
    ack = SpliceAck(False, PROBE_REASON, 0, 0, 0, BS, True, (), (), 1456, 2048)
    wire = json.loads(json.dumps(ack_params(ack)))
    assert wire["splice_ack"]["max_query_tokens"] == 2048 and wire["splice_ack"]["num_blocks"] == 1456
    assert SpliceAck.from_params(wire) == ack and SpliceAck.from_params(wire).max_query_tokens == 2048
    old = {k: v for k, v in wire["splice_ack"].items() if k != "max_query_tokens"}
    parsed = SpliceAck.from_params({"splice_ack": old})
    assert parsed == ack._replace(max_query_tokens=0)
    assert SpliceAck(True, "", 96, 96, 96).max_query_tokens == 0  # unsaid: unknown
    for unsaid in (None, 0):  # null reads as unknown too
        assert SpliceAck.from_params({"splice_ack": {**old, "max_query_tokens": unsaid}}).max_query_tokens == 0
    for bad in (-5, "many"):  # nonsense is malformed, never a negative or made-up cap
        with pytest.raises(InputError, match="max_query_tokens must be a count"):
            SpliceAck.from_params({"splice_ack": {**old, "max_query_tokens": bad}})


def test_a_served_store_query_is_split_at_the_cap_the_probe_ack_names(monkeypatch):
    """The client batches at the server's ``max_query_tokens`` (not MAX_QUERY_TOKENS),
    and cuts a longer chain to it; an ack without the field: MAX_QUERY_TOKENS."""
    from promptsplice.engine_adapters import RemoteEngine

    toks = list(range(100, 100 + 10 * BS))
    full = chain_refs(toks, BS, salt="t")
    store = FakeStore((full[:7], "t"))
    cap = 4 * BS  # the server's max_model_len
    sent = []

    def ack_request(params, salt=None):
        sent.append(sum(len(c["tokens"]) for c in params[QUERY_KEY]) // BS)
        matched, why = answer_query(json.loads(json.dumps(params))[QUERY_KEY], store.match, BS, salt, cap)
        return SpliceAck(False, why or QUERY_REASON, 0, 0, 0, BS, True, matched, (), 0, cap)

    chains = [(full, "t"), (full[:3], "t"), (full[4:7], "t"), (full[:2], "t")]
    eng = RemoteEngine("http://127.0.0.1:9", block_size=BS)
    eng._probe = SpliceAck(False, PROBE_REASON, 0, 0, 0, BS, True, (), (), 100, cap)
    monkeypatch.setattr(eng, "_ack_request", ack_request)
    assert eng.match_chains(chains) == [4, 3, 3, 2]
    assert sent == [4, 3, 3, 2]  # 4 (cut), then 3 + 3 > 4 and 3 + 2 > 4: every query under the cap
    sent.clear()
    old = RemoteEngine("http://127.0.0.1:9", block_size=BS)  # an older connector: the cap unsaid
    old._probe = SpliceAck(False, PROBE_REASON, 0, 0, 0, BS, True)
    monkeypatch.setattr(old, "_ack_request", ack_request)
    from promptsplice.errors import EngineResponseError
    with pytest.raises(EngineResponseError, match="at most 128 tokens"):
        old.match_chains(chains)  # one query of 18 blocks: MAX_QUERY_TOKENS is the client's only bound
    assert sent == [18]


def test_a_probe_is_answered_without_a_plan():
    new, _ = case()
    assert plan_verdict({PROBE_KEY: True}, new, BS) == (True, PROBE_REASON, 0)
    assert plan_verdict({PROBE_KEY: "yes"}, new, BS) == (False, "", 0)  # only a literal true asks


class FakeStore:
    """What ``answer_query`` reads of a store: ``match_prefix`` over a set of chain keys
    (a stand-in for the store's index, exercised for real in the served tests)."""

    def __init__(self, *chains):
        self.keys = {(ref.key, salt) for refs, salt in chains for ref in refs}
        self.asked = []

    def match(self, refs, salt):
        self.asked.append((tuple(r.key for r in refs), salt))
        n = 0
        for ref in refs:
            if (ref.key, salt) not in self.keys:
                break
            n += 1
        return n


def test_a_store_query_round_trip_counts_the_leading_stored_blocks():
    toks = list(range(100, 100 + 6 * BS))
    head = chain_refs(toks, BS, salt="t")  # 6 blocks from the root of salt "t"
    chunk = chain_refs(toks[2 * BS :], BS, parent=head[1].key)  # the same blocks 2.. from their parent
    store = FakeStore((head[:4], "t"))
    params = json.loads(json.dumps(query_params([(head, "t"), (chunk, "t"), (head, "t\x1fu"), (head[3:], "t")])))
    assert plan_verdict(params, [0], BS) == (True, QUERY_REASON, 0)
    matched, why = answer_query(params[QUERY_KEY], store.match, BS, "t")
    # the server rebuilds the same keys from tokens and parent: 4 stored of 6; from
    # block 2 on, 2 (blocks 2 and 3); another salt of the tenant, none; from block 3, one
    assert (matched, why) == ((4, 2, 0, 1), "")
    # asked by another tenant (the request's cache_salt): no answer at all
    assert answer_query(params[QUERY_KEY], store.match, BS, "u") == ((), "splice_query[0].salt belongs to another tenant than the request's cache_salt")
    assert store.asked[0] == (tuple(r.key for r in head), "t")
    assert params[QUERY_KEY][0]["parent"] == root_hash("t").hex()


@settings(max_examples=40, deadline=None)
@given(n_blocks=st.integers(1, 5), stored=st.integers(0, 5), start=st.integers(0, 4))
def test_a_store_query_answers_what_match_prefix_answers_in_process(n_blocks, stored, start):
    toks = list(range(7, 7 + (start + n_blocks) * BS))
    full = chain_refs(toks, BS, salt=None)
    store = FakeStore((full[:stored], None))
    chain = full[start:]
    (got,), why = answer_query(query_params([(chain, None)])[QUERY_KEY], store.match, BS)
    assert why == "" and got == store.match(chain, None) == max(0, min(stored - start, len(chain)))


@pytest.mark.reliability
@pytest.mark.parametrize(
    "raw, expected",
    [
        ([], "non-empty list"),
        ({"tokens": [1]}, "non-empty list"),
        ([7], r"\[0\] must be a mapping"),
        ([{"tokens": [1, 2], "parent": "00" * 16}], "whole blocks of 32"),
        ([{"tokens": [-1] * BS, "parent": "00" * 16}], "token ids in"),
        ([{"tokens": [True] * BS, "parent": "00" * 16}], "token ids in"),
        ([{"tokens": [1] * BS, "parent": "zz"}], "parent must be a block hash"),
        ([{"tokens": [1] * BS, "parent": "00" * 8}], "parent must be a block hash"),
        ([{"tokens": [1] * BS, "parent": "00" * 16, "salt": 5}], "salt must be a string"),
        ([{"tokens": [1] * BS, "parent": "00" * 16}] * (MAX_QUERY_TOKENS // BS + 1), "at most"),
    ],
)
def test_a_malformed_store_query_is_answered_with_a_reason_and_no_counts(raw, expected):
    import re

    matched, why = answer_query(raw, FakeStore().match, BS)
    assert matched == () and re.search(expected, why), why


def test_query_params_refuses_what_cannot_be_sent():
    refs = chain_refs(list(range(BS)), BS)
    with pytest.raises(InputError, match="at least one block"):
        query_params([([], None)])
    with pytest.raises(ConfigError, match="str salts"):
        query_params([(refs, b"bytes")])


def test_a_served_store_query_is_split_under_the_cap_and_long_chains_ask_their_lead(monkeypatch):
    from promptsplice.engine_adapters import RemoteEngine
    from promptsplice.engine_adapters import _served_engine

    toks = list(range(100, 100 + 10 * BS))
    full = chain_refs(toks, BS, salt="t")
    store = FakeStore((full[:7], "t"))
    sent = []

    def ack_request(params, salt=None):
        sent.append((sum(len(c["tokens"]) for c in params[QUERY_KEY]) // BS, salt))
        matched, why = answer_query(json.loads(json.dumps(params))[QUERY_KEY], store.match, BS, salt)
        return SpliceAck(False, why or QUERY_REASON, 0, 0, 0, BS, True, matched)

    monkeypatch.setattr(_served_engine, "MAX_QUERY_TOKENS", 4 * BS)  # 4 blocks per query
    eng = RemoteEngine("http://127.0.0.1:9", block_size=BS)
    eng._probe = SpliceAck(False, PROBE_REASON, 0, 0, 0, BS, True)  # as if the probe had answered
    monkeypatch.setattr(eng, "_ack_request", ack_request)
    # 10 blocks (asked: its first 4), then 2 and 3 blocks: queries of 4, 2 and 3; the
    # last chain is another tenant's: a query of its own, under that tenant's salt
    chains = [(full, "t"), (full[:2], "t"), (full[4:7], "t"), (full[:1], "u")]
    assert eng.match_chains(chains) == [4, 2, 3, 0]
    assert sent == [(4, "t"), (2, "t"), (3, "t"), (1, "u")]


def test_a_non_finite_deviation_reaches_the_ack_as_a_large_finite_one():
    from promptsplice.engine_adapters.connector._connector import _NOT_FINITE, _finite
    from promptsplice.engine_adapters.connector._plans import BlockDeviation

    dev = _finite(BlockDeviation(64, -32, (0.1, float("nan")), (float("inf"), 0.2)))
    assert dev == BlockDeviation(64, -32, (0.1, _NOT_FINITE), (_NOT_FINITE, 0.2))
    ack = SpliceAck(True, "", 32, 32, 32, BS, True, (), (dev,))
    assert SpliceAck.from_params(json.loads(json.dumps(ack_params(ack), allow_nan=False))) == ack


def test_a_plan_reads_only_its_own_tenants_salts_and_scopes_only_under_a_derived_salt():
    """The client sends kv_transfer_params; its cache_salt is the tenant's (a gateway
    sets it from its auth).  Salts of one tenant: its own and those derived from it
    (after U+001F).  A scope files approximate KV under the request's salt, so it needs a
    derived salt: the tenant's own salt holds exact KV only."""
    from promptsplice.engine_adapters import SplicePlan, SpliceSegment

    new = list(range(1000, 1000 + 6 * BS + 3))
    seg = (SpliceSegment(0, 4, 0, bytes(root_hash("acme"))),)
    params = lambda **kw: splice_params(SplicePlan(BS, seg, **kw), new)  # noqa: E731
    assert plan_verdict(params(src_salt="acme"), new, BS, "acme\x1fpic").reason == ""
    assert plan_verdict(params(src_salt="acme\x1fexact"), new, BS, "acme").reason == ""
    assert plan_verdict(params(src_salt=None), new, BS, "\x1fpic").reason == ""  # the unsalted tenant
    for src, salt in (("globex", "acme"), ("acme", None), (None, "acme"), ("acme", "globex\x1facme")):
        assert "another tenant" in plan_verdict(params(src_salt=src), new, BS, salt).reason, (src, salt)
    assert "src_salt" in plan_verdict(params(src_salt=b"acme"), new, BS, None).reason  # bytes: only the request's own
    # the salt the connector keys a LoRA's (or an image's) KV under shares the tenant's
    # prefix: a plain request loaded that KV, counted exact
    from promptsplice.engine_adapters.connector._served import identity_salt

    lora = identity_salt("acme", "lora=sql@/adapters/sql")
    assert "LoRA, multimodal or embeddings" in plan_verdict(params(src_salt=lora), new, BS, "acme").reason
    assert "LoRA, multimodal or embeddings" in plan_verdict(params(src_salt=lora), new, BS, "acme\x1fpic").reason
    assert "derived salt" in plan_verdict(params(src_salt="acme", scope=True), new, BS, "acme").reason
    assert plan_verdict(params(src_salt="acme", scope=True), new, BS, "acme\x1fsplice-scope:s:1").reason == ""
    # the tenant's derived "exact" salt holds exact KV only (exact steps read it): no scope there
    assert "holds exact KV only" in plan_verdict(params(src_salt="acme", scope=True), new, BS, "acme\x1fexact").reason
    probes = SplicePlan(BS, (), src_salt="acme", probes=(SpliceSegment(4 * BS, 3, 0, bytes(root_hash("acme"))),))
    assert "probes run past" in plan_verdict(splice_params(probes, new), new, BS, "acme").reason


@pytest.mark.reliability
def test_an_empty_or_invalid_salt_in_a_plan_or_store_query_is_refused_by_reason():
    """``salt_tenant("")`` was ``None``, so an unsalted request's plan naming ``src_salt
    ""`` (or a query chain naming salt ``""``) passed the tenant check, then raised
    InvalidSaltError in vLLM's scheduler: the engine core died for every tenant."""
    from promptsplice.engine_adapters.connector._plans import SplicePlan, SpliceSegment

    toks = list(range(100, 100 + 5 * BS + 3))
    for bad in ("", "a\ud800"):
        params = {**SplicePlan(BS, (SpliceSegment(0, 4, 0, b"\0" * 16),), src_salt=bad).to_params(),
                  CHECK_KEY: plan_check(toks)}
        for salt in (None, "tenant-A"):
            verdict = plan_verdict(params, toks, BS, salt)
            assert verdict.has_plan and verdict.reason.startswith("the plan's src_salt ")
        raw = [{"parent": "00" * 16, "salt": bad, "tokens": list(range(BS))}]
        assert answer_query(raw, FakeStore().match, BS) == (
            (), "splice_query[0].salt must be a string or null (a salt: non-empty, valid text)"
        )


def test_a_store_query_is_capped_at_the_engines_max_model_len_and_hashed_up_to_its_first_miss():
    """A one-token request could make the scheduler hash 2^18 tokens; now at most the
    engine's max_model_len, and only up to each chain's first block the store lacks."""
    from promptsplice.engine_adapters import BlockStore, StoreConfig
    from promptsplice.engine_adapters.connector._connector import query_token_cap
    from types import SimpleNamespace

    raw = [{"parent": "00" * 16, "salt": None, "tokens": [1] * (4 * BS)}]
    assert answer_query(raw, FakeStore().match, BS, None, 4 * BS)[1] == ""
    assert answer_query(raw, FakeStore().match, BS, None, 4 * BS - 1) == (
        (), f"a store query carries at most {4 * BS - 1} tokens (the engine's max_model_len)"
    )
    assert query_token_cap(SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096))) == 4096
    assert query_token_cap(SimpleNamespace(model_config=SimpleNamespace(max_model_len=1 << 30))) == MAX_QUERY_TOKENS
    assert query_token_cap(None) == MAX_QUERY_TOKENS

    store = BlockStore(StoreConfig(dram_bytes=1 << 20, write_behind_bytes=0))
    toks = list(range(7, 7 + 40 * BS))
    refs = chain_refs(toks, BS, salt="t")
    import torch
    for ref in refs[:2]:
        store.put(ref, torch.zeros(4), salt="t")
    seen = []

    def match(chain, salt):
        n = store.match_prefix(chain, salt=salt)
        seen.append(len(chain._refs))  # the blocks hashed to answer
        return n

    q = query_params([(refs, "t"), (refs[1:], "t"), (refs[3:], "t")])[QUERY_KEY]
    assert answer_query(q, match, BS, "t") == ((2, 1, 0), "")
    # in batches of 8, 16, ...: each chain's first batch holds its first miss, so 8 of
    # its 40, 39, 37 blocks are hashed
    assert seen == [8, 8, 8]


@pytest.mark.reliability
def test_overlapping_probes_are_refused_and_a_plans_probes_hashed_once(monkeypatch):
    """A plan's probes were checked by count and end only: B probes of B blocks passed,
    and the scheduler re-hashed all B^2 blocks on every step of the request (decode steps
    too), 0.29 s a step at 8K tokens, 4.7 s at 32K, for every request of the engine."""
    from promptsplice.engine_adapters import BlockStore, StoreConfig
    from promptsplice.engine_adapters.connector import _scheduler
    from promptsplice.engine_adapters.connector._scheduler import SpliceScheduler

    tokens = list(range(1000, 1000 + 8 * BS))
    probe = {"dst_start": 0, "num_blocks": 8, "delta": 0, "src_parent": root_hash("t").hex()}
    params = {"splice": {"version": 1, "block_size": BS, "segments": [], "probes": [probe] * 8},
              CHECK_KEY: plan_check(tokens)}
    verdict = plan_verdict(params, tokens, BS, "t")
    assert verdict.has_plan and "the plan's probes cover 64 blocks, more than the request's 8 full blocks" in verdict.reason
    one = {**params, "splice": {**params["splice"], "probes": [probe]}}
    assert plan_verdict(one, tokens, BS, "t").reason == ""

    hashed = []
    real = _scheduler._plan_refs
    monkeypatch.setattr(_scheduler, "_plan_refs", lambda *a, **k: hashed.append(k.get("probes")) or real(*a, **k))
    with BlockStore(StoreConfig(dram_bytes=1 << 20, write_behind_bytes=0)) as store:
        sched = SpliceScheduler(store, BS)
        sched.get_num_new_matched_tokens("r", tokens, "t", 0, one)
        ids = list(range(9))
        for computed in (0, 4 * BS, len(tokens) - 1, len(tokens)):  # prefill chunks, then decode steps
            sched.build_connector_meta([("r", computed, 4 * BS if computed < len(tokens) - 1 else 1)], lambda rid: ids)
        assert hashed.count(True) == 1  # the probe blocks, hashed once for the request
        sched.request_finished("r")


def test_an_acks_deviations_hold_ints_and_finite_numbers_only():
    """``[[True, "64", ["0.5"], ["nan"]]]`` read as BlockDeviation(1, 64, (0.5,), (nan,)):
    a NaN deviation never exceeds ``max_deviation``, so the guard failed open."""
    from promptsplice.engine_adapters.connector._plans import BlockDeviation

    dev = BlockDeviation(64, -32, (0.5, 0.25), (0.125, 0.0))
    ack = SpliceAck(True, "", 96, 96, 96, deviations=(dev,))
    assert SpliceAck.from_params(json.loads(json.dumps(ack_params(ack)))) == ack
    good = ack_params(ack)["splice_ack"]
    for bad, says in (
        ([[True, 64, [0.5], [0.5]]], "deviation blocks must be a position and a delta"),
        ([["64", 1, [0.5], [0.5]]], "deviation blocks must be a position and a delta"),
        ([[-32, 1, [0.5], [0.5]]], "deviation blocks must be a position and a delta"),
        ([[64, 1, ["0.5"], [0.5]]], "must hold finite numbers, got '0.5'"),
        ([[64, 1, [0.5], [float("nan")]]], "must hold finite numbers, got nan"),
        ([[64, 1, [0.5], [1e400]]], "must hold finite numbers, got inf"),
        ([[64, 1, [0.5]]], r"\[dst_start, delta, k, v\] each"),
        ([[64, 1, 0.5, [0.5]]], "must list k and v per layer"),
        ({"64": 1}, "deviations must be a list"),
    ):
        with pytest.raises(InputError, match=says):
            SpliceAck.from_params({"splice_ack": {**good, "deviations": bad}})


def test_a_salt_over_vllms_length_in_a_plan_or_a_store_query_is_refused_before_it_is_hashed():
    """``check_salt(vllm_rule=False)`` let a 10 MB derived salt through, hashed in vLLM's
    scheduler loop; a runner's derived salts fit vLLM's 128 characters."""
    ids = list(range(100, 100 + 3 * 32))
    long = "alice\x1f" + "x" * 200
    plan = SplicePlan(32, (SpliceSegment(32, 1, -32, bytes(16)),), src_salt=long)
    verdict = plan_verdict(plan.to_params(), ids, 32, "alice")
    assert verdict.has_plan and "src_salt is 206 characters, over 128" in verdict.reason
    ok = SplicePlan(32, (SpliceSegment(32, 1, -32, bytes(16)),), src_salt="alice\x1f" + "x" * 100)
    assert plan_verdict(ok.to_params(), ids, 32, "alice").reason == ""
    query = [{"tokens": ids[:32], "salt": long, "parent": root_hash(long).hex()}]
    matched, why = answer_query(query, lambda refs, salt: 1, 32, "alice", 2048)
    assert matched == () and "salt is 206 characters, over 128" in why
