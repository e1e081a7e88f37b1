"""The splice connector inside ``vllm serve``: what a request carries next to its plan,
what the connector checks, and what it answers.  Torch-free and vLLM-free, so the client
(:class:`~promptsplice.engine_adapters.RemoteEngine`) and the connector share it.

A served request sends its plan in the body's ``kv_transfer_params`` (vLLM passes it on
as ``SamplingParams.extra_args["kv_transfer_params"]``, exactly as the embedded engine
does), with a check of the prompt the plan was made for::

    {"splice": {...the plan...}, "splice_check": {"num_tokens": 412, "digest": "<32 hex>"}}

The connector compares the check and the plan with the request (:func:`plan_verdict`):
token ids that differ, a plan that runs past the prompt's full blocks, a plan for another
block size or a malformed plan make the request fall back to plain prefill (the plan is
dropped; never a wrong splice).  When the request finishes, ``request_finished``
returns :func:`ack_params`, which vLLM's OpenAI server puts in the response body's
``kv_transfer_params``::

    {"splice_ack": {"applied": true, "reason": "", "planned_tokens": 192,
                    "loaded_tokens": 192, "relocated_tokens": 192, "block_size": 32}}

No ``splice_ack`` in the response means the server was not started with the connector.
A request carrying only ``{"splice_probe": true}`` (:data:`PROBE_KEY`) asks just that:
the connector answers an ack with ``applied`` False, reason :data:`PROBE_REASON` and
its ``block_size`` (how :class:`~promptsplice.engine_adapters.RemoteEngine` learns the
server's block size and that it runs the connector).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from promptsplice.engine_adapters.connector._plans import PLAN_KEY, SplicePlan
from promptsplice.errors import ConfigError, InputError

__all__ = ["ACK_KEY", "CHECK_KEY", "PROBE_KEY", "PROBE_REASON", "SpliceAck", "ack_params", "Verdict", "plan_check", "plan_verdict", "splice_params", "token_digest"]

CHECK_KEY = "splice_check"
"""``kv_transfer_params`` key of the prompt check sent with a plan."""
ACK_KEY = "splice_ack"
"""``kv_transfer_params`` key of the connector's answer in the response."""
PROBE_KEY = "splice_probe"
"""``kv_transfer_params`` key of a request that only asks whether the connector runs."""
PROBE_REASON = "a probe: no plan sent"
"""The ack's reason for a probe."""


def token_digest(tokens: Sequence[int]) -> str:
    """A short digest of a prompt's token ids (what the plan was made for)."""
    return hashlib.blake2b(",".join(str(int(t)) for t in tokens).encode(), digest_size=16).hexdigest()


def plan_check(tokens: Sequence[int]) -> dict[str, Any]:
    """The ``splice_check`` entry for a plan made for the prompt ``tokens``."""
    return {"num_tokens": len(tokens), "digest": token_digest(tokens)}


class Verdict(NamedTuple):
    """What :func:`plan_verdict` found in a request's ``kv_transfer_params``."""

    has_plan: bool
    reason: str
    """Empty when the plan may be applied, else what differs from the request."""
    planned_tokens: int = 0


def splice_params(plan: Any, ids: Sequence[int] | None, stream: bool = False) -> dict[str, Any]:
    """A served request's ``kv_transfer_params``: ``plan`` and the check of the prompt
    ``ids`` it is sent with (the client side; :class:`InputError` for what cannot work)."""
    if not isinstance(plan, SplicePlan):
        raise ConfigError(f"splice must be a SplicePlan (plan_deletion / plan_relocation), got {type(plan).__name__}")
    if ids is None:
        raise InputError(
            "a splice plan needs the prompt sent as token ids (pass an AssembledPrompt or "
            "token ids, and keep send_token_ids on): a server tokenizing text may not "
            "reproduce the tokens the plan was made for"
        )
    if stream:
        raise InputError(
            "splice plans need stream=False: the connector's answer comes back in the "
            "non-streamed response's kv_transfer_params"
        )
    if plan.dst_end > len(ids):
        raise InputError(
            f"the splice plan covers tokens [{plan.dst_start}, {plan.dst_end}) but the "
            f"prompt has {len(ids)}: it was made for another prompt"
        )
    return {**plan.to_params(), CHECK_KEY: plan_check(ids)}


def plan_verdict(params: Mapping[str, Any] | None, tokens: Sequence[int], block_size: int) -> Verdict:
    """Whether a request's ``kv_transfer_params`` carry a plan, and whether it matches the
    request: a non-empty ``reason`` names what differs (the connector then drops the
    plan: plain prefill)."""
    if not isinstance(params, Mapping):
        return Verdict(False, "")
    if PLAN_KEY not in params and CHECK_KEY not in params:
        return Verdict(True, PROBE_REASON) if params.get(PROBE_KEY) is True else Verdict(False, "")
    reason = _mismatch(params, tokens, block_size)
    if reason:
        return Verdict(True, reason)
    plan = SplicePlan.from_params(params)
    return Verdict(True, "", plan.num_tokens if plan is not None else 0)


def _mismatch(params: Mapping[str, Any], tokens: Sequence[int], block_size: int) -> str:
    try:
        plan = SplicePlan.from_params(params)
    except InputError as exc:
        return f"malformed splice plan: {exc}"
    if plan is None:
        return f"kv_transfer_params has {CHECK_KEY!r} but no {PLAN_KEY!r} plan"
    if plan.block_size != block_size:
        return f"the plan was made for block_size {plan.block_size}, the server's is {block_size}"
    check = params.get(CHECK_KEY)
    if check is not None:
        if not isinstance(check, Mapping):
            return f"kv_transfer_params[{CHECK_KEY!r}] must be a mapping"
        n = check.get("num_tokens")
        if n != len(tokens):
            return (
                f"the plan was made for a prompt of {n} tokens, the request has {len(tokens)} "
                "(the server tokenized it differently? send token ids)"
            )
        if check.get("digest") != token_digest(tokens):
            return f"the request's {len(tokens)} token ids differ from those the plan was made for"
    full = len(tokens) // block_size * block_size
    if plan.dst_end > full:
        return (
            f"the plan covers tokens [{plan.dst_start}, {plan.dst_end}) "
            f"({plan.num_tokens // block_size} blocks) but the request's {len(tokens)} tokens "
            f"hold only {full // block_size} full blocks"
        )
    return ""


class SpliceAck(NamedTuple):
    """The connector's answer for a request that carried a plan."""

    applied: bool
    """The plan was accepted (its blocks may still be missing from the store: see the counts)."""
    reason: str
    """Why the plan was dropped (empty when applied)."""
    planned_tokens: int
    loaded_tokens: int
    """Tokens the connector loaded for the request (offload hits and relocated blocks)."""
    relocated_tokens: int
    """Loaded tokens that moved (a non-zero position delta)."""
    block_size: int = 0
    """The connector's (and so the server's) block size; 0 from a connector that did not say."""

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> SpliceAck | None:
        """The ack in a response's ``kv_transfer_params`` (``None`` when absent)."""
        raw = params.get(ACK_KEY) if isinstance(params, Mapping) else None
        if not isinstance(raw, Mapping):
            return None
        try:
            return cls(
                bool(raw["applied"]), str(raw.get("reason") or ""), int(raw["planned_tokens"]),
                int(raw["loaded_tokens"]), int(raw["relocated_tokens"]), int(raw.get("block_size") or 0),
            )
        except (KeyError, TypeError, ValueError):
            return None


def ack_params(ack: SpliceAck) -> dict[str, Any]:
    """``request_finished``'s ``kv_transfer_params`` for ``ack``."""
    return {ACK_KEY: ack._asdict()}
