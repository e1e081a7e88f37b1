"""The served connector's wire (``_served``), engine-free: what the connector finds when
a request's ``kv_transfer_params`` and its prompt disagree, and the ack round trip.
(The real ``vllm serve`` runs are in ``tests/engine_adapters/test_served_connector.py``.)"""

from __future__ import annotations

from promptsplice.engine_adapters import plan_deletion
from promptsplice.engine_adapters.connector._served import (
    CHECK_KEY,
    PROBE_KEY,
    PROBE_REASON,
    SpliceAck,
    ack_params,
    plan_check,
    plan_verdict,
    splice_params,
)

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


def test_ack_round_trip():
    ack = SpliceAck(True, "", 96, 96, 96)
    assert SpliceAck.from_params(ack_params(ack)) == ack
    assert SpliceAck.from_params({"splice_ack": {"applied": True}}) is None
    assert SpliceAck.from_params(None) is None
    with_bs = SpliceAck(True, "", 96, 96, 96, 32)
    assert SpliceAck.from_params(ack_params(with_bs)) == with_bs
    # an ack from a connector that did not send its block size reads as 0 (unknown)
    raw = {k: v for k, v in ack_params(with_bs)["splice_ack"].items() if k != "block_size"}
    assert SpliceAck.from_params({"splice_ack": raw}).block_size == 0


def test_a_probe_is_answered_without_a_plan():
    new, _ = case()
    assert plan_verdict({PROBE_KEY: True}, new, BS) == (True, PROBE_REASON, 0)
    assert plan_verdict({PROBE_KEY: "yes"}, new, BS) == (False, "", 0)  # only a literal true asks
