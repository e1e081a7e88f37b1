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
                    "loaded_tokens": 192, "relocated_tokens": 192, "block_size": 32,
                    "relocation": true, "matched": [], "deviations": [[64, -96, [...], [...]]],
                    "num_blocks": 1456, "max_query_tokens": 2048}}

``deviations`` are the plan's probes (:class:`~._plans.BlockDeviation`: first token,
delta, per-layer K and V errors), so a served engine's adaptive recompute reads what
the embedded engine reads from its worker.

No ``splice_ack`` in the response means the server was not started with the connector.
A request carrying only ``{"splice_probe": true}`` (:data:`PROBE_KEY`) asks just that:
the connector answers an ack with ``applied`` False, reason :data:`PROBE_REASON`, its
``block_size``, whether it can relocate and ``max_query_tokens`` (how
:class:`~promptsplice.engine_adapters.RemoteEngine` learns the server's block size, that
it runs the connector and how long a store query may be).  Every ack carries these.

**Store queries.**  The block store lives in the server's process, so a client that
plans position-independent reuse (:class:`~promptsplice.engine_adapters.RagRunner`)
asks it what it holds: a one-token request carrying ``{"splice_query": [...]}``
(:func:`query_params`), one entry per chain of whole blocks::

    {"parent": "<hex of the block before the chain>", "salt": "tenant" | null, "tokens": [...]}

The connector answers when vLLM schedules the request (the store as it is then), in
the ack's ``matched``: how many leading blocks of each chain the store holds with the
same tokens, parent and salt (:func:`answer_query`; ``BlockStore.match_prefix``, the
count the embedded engine reads in process).  The server rebuilds the chain keys
itself (:func:`~promptsplice.engine_adapters.store._store.chain_refs`), so a client
cannot name a block it does not have the tokens of.  One query per planned request;
a malformed query is answered with a reason and no counts, and so is one carrying more
tokens in all than the ack's ``max_query_tokens`` (the engine's ``max_model_len``, at
most :data:`MAX_QUERY_TOKENS`): the client splits its queries under it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from promptsplice.blocks import HASH_BYTES, BlockHash, content_digest, hash_block, token_bytes
from promptsplice.engine_adapters.connector._plans import PLAN_KEY, SAME_SALT, BlockDeviation, SplicePlan
from promptsplice.engine_adapters.store._store import BlockRef
from promptsplice.errors import ConfigError, InputError, InvalidSaltError
from promptsplice._validate import (
    VLLM_MAX_CACHE_SALT_LENGTH, DERIVED_SALT_MARK, check_salt, holds_exact_kv_only, salt_tenant,
)

__all__ = [
    "ACK_KEY", "CHECK_KEY", "IDENTITY_REASON", "MAX_QUERY_TOKENS", "PROBE_KEY", "PROBE_REASON", "QUERY_KEY", "QUERY_REASON",
    "SpliceAck", "Verdict", "ack_params", "answer_query", "plan_check", "plan_verdict", "query_params",
    "splice_params", "token_digest",
]

CHECK_KEY = "splice_check"
"""``kv_transfer_params`` key of the prompt check sent with a plan."""
ACK_KEY = "splice_ack"
"""``kv_transfer_params`` key of the connector's answer in the response."""
PROBE_KEY = "splice_probe"
"""``kv_transfer_params`` key of a request that only asks whether the connector runs."""
PROBE_REASON = "a probe: no plan sent"
"""The ack's reason for a probe."""
QUERY_KEY = "splice_query"
"""``kv_transfer_params`` key of a store query (module doc)."""
QUERY_REASON = "a store query: no plan sent"
"""The ack's reason for a store query that was answered."""
IDENTITY_REASON = (
    "a LoRA, multimodal or prompt-embeddings request: plans and store queries name the "
    "plain tokens' KV, so it runs as plain prefill (offload hits only from its own inputs)"
)
"""The ack's reason for a plan or query sent with such a request."""
MAX_QUERY_TOKENS = 1 << 18
"""The most tokens one store query may carry (a bound on what a request makes the
scheduler hash); the connector caps it further at the engine's ``max_model_len``, so a
one-token query costs no more scheduler time than one long prompt."""


def token_digest(tokens: Sequence[int]) -> str:
    """A short digest of a prompt's token ids (what the plan was made for): the one
    content hash of ``promptsplice.blocks`` over their uint32 bytes (not a second hash)."""
    return content_digest(token_bytes(tokens)).hex()


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


def plan_verdict(
    params: Mapping[str, Any] | None, tokens: Sequence[int], block_size: int, salt: str | None = None
) -> Verdict:
    """Whether a request's ``kv_transfer_params`` carry a plan, and whether it matches the
    request (``salt``: its ``cache_salt``): a non-empty ``reason`` names what differs (the
    connector then drops the plan: plain prefill)."""
    if not isinstance(params, Mapping):
        return Verdict(False, "")
    if PLAN_KEY not in params and CHECK_KEY not in params:
        if QUERY_KEY in params:
            return Verdict(True, QUERY_REASON)
        return Verdict(True, PROBE_REASON) if params.get(PROBE_KEY) is True else Verdict(False, "")
    reason = _mismatch(params, tokens, block_size, salt)
    if reason:
        return Verdict(True, reason)
    plan = SplicePlan.from_params(params)
    return Verdict(True, "", plan.num_tokens if plan is not None else 0)


IDENTITY_SALT_TAG = "identity:"
"""After the derived-salt mark: the salt under which the connector keys a LoRA,
multimodal or prompt-embeddings request's blocks (their KV is not the plain tokens')."""


def identity_salt(salt: str | None, identity: str) -> str:
    """The salt of a request whose KV depends on ``identity`` besides its tokens."""
    return f"{salt or ''}{DERIVED_SALT_MARK}{IDENTITY_SALT_TAG}{identity}"


def _mismatch(params: Mapping[str, Any], tokens: Sequence[int], block_size: int, salt: str | None) -> str:
    raw = params.get(PLAN_KEY)
    if isinstance(raw, Mapping):
        # A plan has at most one segment and one probe a block of the prompt: refused by
        # its size before it is parsed (this runs in vLLM's scheduler loop; 400,000
        # segments took 1.6 s to parse, then failed the extent check)
        parts = sum(len(raw.get(k)) for k in ("segments", "probes") if isinstance(raw.get(k), Sequence))
        if parts > 2 * max(1, len(tokens) // max(1, block_size)):
            return f"the plan has {parts} segments and probes for a prompt of {len(tokens)} tokens"
    try:
        plan = SplicePlan.from_params(params)
    except InputError as exc:
        return f"malformed splice plan: {exc}"
    if plan is None:
        return f"kv_transfer_params has {CHECK_KEY!r} but no {PLAN_KEY!r} plan"
    src = plan.src_salt
    if isinstance(src, str):
        try:  # "" passed the tenant check as None's, then failed the engine where it was hashed
            check_salt(src, "the plan's src_salt", vllm_rule=False)  # derived salts: refused by reason below
        except InvalidSaltError as exc:
            return str(exc)
        if len(src) > VLLM_MAX_CACHE_SALT_LENGTH:  # (a runner's derived salts fit: check_derived_salt_room)
            return f"the plan's src_salt is {len(src)} characters, over {VLLM_MAX_CACHE_SALT_LENGTH}"
    if src is not SAME_SALT and (
        isinstance(src, bytes) if salt is None else (isinstance(src, bytes) and src != salt.encode("utf-8"))
    ):
        return "a served plan's src_salt must be the request's own salt or another of its tenant's (a str)"
    if isinstance(src, str) and DERIVED_SALT_MARK + IDENTITY_SALT_TAG in src:
        # a LoRA's or an image's KV, loaded into a plain request (and counted exact)
        return "a plan's src_salt may not name the salt of a LoRA, multimodal or embeddings request's KV"
    if src is not SAME_SALT and isinstance(src, str | None) and salt_tenant(src) != salt_tenant(salt):
        # the request's cache_salt is the caller's (a gateway sets it from its auth): a plan
        # may name another salt of the same tenant (a scope, its relocation salt), never
        # another tenant's, whose KV it would load
        return "the plan's src_salt belongs to another tenant than the request's cache_salt"
    if plan.scope and holds_exact_kv_only(salt):
        # a scope files what the request loads and computes after relocated KV under its
        # salt: never under a salt that holds exact KV only (the tenant's own, or its
        # derived "exact" salt, which exact steps read)
        return "a scope plan needs a derived salt (a session scope), not a salt that holds exact KV only"
    full_blocks = len(tokens) // block_size
    if len(plan.probes) > full_blocks or any(p.dst_start + p.num_blocks * block_size > full_blocks * block_size
                                             for p in plan.probes):
        return f"the plan's probes run past the request's {full_blocks} full blocks"
    probed = sum(p.num_blocks for p in plan.probes)
    if probed > full_blocks:  # overlapping probes: B probes of B blocks hashed B^2 blocks a step
        return f"the plan's probes cover {probed} blocks, more than the request's {full_blocks} full blocks"
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


def _deviations(raw: Any) -> tuple[BlockDeviation, ...]:
    """An ack's ``deviations``: ``[dst_start, delta, [k per layer], [v per layer]]``
    each, ints and finite numbers as the connector writes them (``_finite``); else
    :class:`InputError` (``"64"`` read as 64 and ``"nan"`` as NaN, which no
    ``max_deviation`` ever exceeded: the guard failed open)."""
    def number(x: Any) -> float:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise InputError(f"the splice ack's deviations must hold finite numbers, got {x!r}")
        return float(x)

    if raw is not None and not isinstance(raw, list | tuple):
        raise InputError(f"the splice ack's deviations must be a list, got {raw!r}")
    out = []
    for entry in raw or ():
        if not isinstance(entry, list | tuple) or len(entry) != 4:
            raise InputError(f"the splice ack's deviations are [dst_start, delta, k, v] each, got {entry!r}")
        start, n, k, v = entry
        if any(isinstance(x, bool) or not isinstance(x, int) for x in (start, n)) or start < 0:
            raise InputError(f"the splice ack's deviation blocks must be a position and a delta (ints), got {start!r}, {n!r}")
        if not isinstance(k, list | tuple) or not isinstance(v, list | tuple):
            raise InputError(f"the splice ack's deviations must list k and v per layer, got {k!r}, {v!r}")
        out.append(BlockDeviation(start, n, tuple(number(x) for x in k), tuple(number(x) for x in v)))
    return tuple(out)


class SpliceAck(NamedTuple):
    """The connector's answer for a request that carried a plan, a probe or a store query."""

    applied: bool
    """The plan was accepted (its blocks may still be missing from the store: see the counts)."""
    reason: str
    """Why the plan was dropped (empty when applied)."""
    planned_tokens: int
    loaded_tokens: int
    """Tokens the connector loaded for the request (offload hits and relocated blocks)."""
    relocated_tokens: int
    """Loaded tokens whose KV is approximate: moved (a non-zero position delta) or in
    place after other tokens (``_plans.in_place_blocks``)."""
    block_size: int = 0
    """The connector's (and so the server's) block size; 0 from a connector that did not say."""
    relocation: bool = False
    """The connector can relocate KV (a verified layout and RoPE; else offload hits only)."""
    matched: tuple[int, ...] = ()
    """A store query's answer: the stored leading blocks of each chain (module doc)."""
    deviations: tuple[BlockDeviation, ...] = ()
    """The plan's probes: each recomputed block's deviation from its relocated old KV,
    measured by the connector (what ``max_deviation`` reads on the embedded engine)."""
    num_blocks: int = 0
    """The server's KV cache in blocks (vLLM's ``num_gpu_blocks``; 0: not said): the
    capacity of the client's mirror of that cache."""
    max_query_tokens: int = 0
    """The most tokens one store query may carry on this server, all chains together
    (its ``max_model_len``, at most :data:`MAX_QUERY_TOKENS`; 0: not said, from an older
    connector): a longer query is answered with a reason and no counts."""

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None, *, prompt_tokens: int | None = None) -> SpliceAck | None:
        """The ack in a response's ``kv_transfer_params`` (``None`` when absent); one
        that is there but malformed (a flag that is not a bool, a count that is not a
        non-negative int) is an :class:`InputError` naming the field, and so is one
        whose counts contradict each other or the prompt: ``relocated_tokens <=
        loaded_tokens <= prompt_tokens`` (the prompt's length, when the caller knows it).
        An ack with ``applied`` false may still count loads: offload hits of the plain
        prefill it fell back to, or a load that went out before the connector failed on
        the request (``_connector._fail_ack``)."""
        raw = params.get(ACK_KEY) if isinstance(params, Mapping) else None
        if not isinstance(raw, Mapping):
            return None

        def count(key: str, *, required: bool = False, value: Any = None) -> int:
            v = raw.get(key) if value is None else value
            if v is None and not required:
                return 0
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InputError(f"the splice ack's {key} must be a count (an int >= 0), got {v!r}")
            return v

        applied = raw.get("applied")
        if not isinstance(applied, bool):
            raise InputError(f"the splice ack's applied must be true or false, got {applied!r}")
        matched = raw.get("matched") or ()
        if not isinstance(matched, list | tuple):
            raise InputError(f"the splice ack's matched must be a list of counts, got {matched!r}")
        deviations = _deviations(raw.get("deviations"))
        planned = count("planned_tokens", required=True)
        loaded, relocated = count("loaded_tokens", required=True), count("relocated_tokens", required=True)
        if relocated > loaded:
            raise InputError(f"the splice ack's relocated_tokens ({relocated}) exceed its loaded_tokens ({loaded})")
        if prompt_tokens is not None and loaded > prompt_tokens:
            raise InputError(f"the splice ack's loaded_tokens ({loaded}) exceed the prompt's {prompt_tokens} tokens")
        return cls(
            applied, str(raw.get("reason") or ""), planned, loaded, relocated, count("block_size"),
            raw.get("relocation") is True, tuple(count("matched", value=n) for n in matched),
            deviations, count("num_blocks"), count("max_query_tokens"),
        )


def ack_params(ack: SpliceAck) -> dict[str, Any]:
    """``request_finished``'s ``kv_transfer_params`` for ``ack``."""
    return {ACK_KEY: ack._asdict()}


def query_params(chains: Sequence[tuple[Sequence[BlockRef], str | None]]) -> dict[str, Any]:
    """A store query's ``kv_transfer_params`` for ``chains``: (refs of consecutive whole
    blocks, as :func:`~promptsplice.engine_adapters.store._store.chain_refs` makes them;
    the salt they are stored under).  Every chain must be non-empty."""
    entries = []
    for refs, salt in chains:
        if not refs:
            raise InputError("a store query chain needs at least one block")
        if salt is not None and not isinstance(salt, str):
            raise ConfigError(f"a served store query carries str salts, got {type(salt).__name__}")
        tokens = [int(t) for ref in refs for t in ref.tokens]
        entries.append({"parent": bytes(refs[0].parent).hex(), "salt": salt, "tokens": tokens})
    return {QUERY_KEY: entries}


class _LazyChain:
    """``chain_refs(tokens, block_size, parent=parent)``, each block hashed when an
    iteration first reaches it: ``match_prefix`` reads refs in batches (8, 16, ...) and
    stops at the batch of the first block the store lacks, so a query's blocks past that
    batch are never hashed."""

    __slots__ = ("_tokens", "_bs", "_refs", "_next")

    def __init__(self, tokens: Sequence[int], block_size: int, parent: BlockHash) -> None:
        self._tokens, self._bs, self._refs, self._next = tokens, block_size, [], parent

    def __len__(self) -> int:
        return len(self._tokens) // self._bs

    def __iter__(self) -> Iterator[BlockRef]:
        bs = self._bs
        for i in range(len(self)):
            if i == len(self._refs):
                block = tuple(self._tokens[i * bs : (i + 1) * bs])
                key = hash_block(self._next, block)
                self._refs.append(BlockRef(key, self._next, block))
                self._next = key
            yield self._refs[i]


def answer_query(
    raw: Any,
    match: Callable[[list[BlockRef], str | None], int],
    block_size: int,
    request_salt: str | None = None,
    max_tokens: int = MAX_QUERY_TOKENS,
) -> tuple[tuple[int, ...], str]:
    """The connector's answer to a store query: (stored leading blocks per chain, ``""``)
    or ((), what is malformed).  ``match(refs, salt)`` is the store's ``match_prefix``
    (its refs are hashed as it reads them).  Every chain's salt must be one of the
    tenant of ``request_salt`` (the request's ``cache_salt``): what another tenant's salt
    holds is not the caller's to learn.  ``max_tokens``: the engine's cap on a query's
    tokens (its ``max_model_len``; never above :data:`MAX_QUERY_TOKENS`)."""
    cap = min(int(max_tokens), MAX_QUERY_TOKENS)
    if not isinstance(raw, list) or not raw:
        return (), f"{QUERY_KEY} must be a non-empty list of chains"
    chains = []
    total = 0
    for i, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            return (), f"{QUERY_KEY}[{i}] must be a mapping"
        tokens, salt, parent = entry.get("tokens"), entry.get("salt"), entry.get("parent")
        if not isinstance(tokens, list) or not tokens or len(tokens) % block_size:
            return (), f"{QUERY_KEY}[{i}].tokens must be whole blocks of {block_size} token ids"
        total += len(tokens)
        if total > cap:  # before reading them: this runs in vLLM's scheduler loop
            return (), f"a store query carries at most {cap} tokens (the engine's max_model_len)"
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens):
            return (), f"{QUERY_KEY}[{i}].tokens must be token ids in [0, 2**32)"
        try:  # "" passed the tenant check as None's, then failed the engine where it was hashed
            check_salt(salt, f"{QUERY_KEY}[{i}].salt", vllm_rule=False)
        except InvalidSaltError:
            return (), f"{QUERY_KEY}[{i}].salt must be a string or null (a salt: non-empty, valid text)"
        if salt is not None and len(salt) > VLLM_MAX_CACHE_SALT_LENGTH:  # hashed in the scheduler loop
            return (), f"{QUERY_KEY}[{i}].salt is {len(salt)} characters, over {VLLM_MAX_CACHE_SALT_LENGTH}"
        if salt_tenant(salt) != salt_tenant(request_salt):
            return (), f"{QUERY_KEY}[{i}].salt belongs to another tenant than the request's cache_salt"
        try:
            parent_b = bytes.fromhex(parent) if isinstance(parent, str) else None
        except ValueError:
            parent_b = None
        if parent_b is None or len(parent_b) != HASH_BYTES:
            return (), f"{QUERY_KEY}[{i}].parent must be a block hash in hex"
        chains.append((tokens, salt, BlockHash(parent_b)))
    return tuple(match(_LazyChain(t, block_size, p), s) for t, s, p in chains), ""  # type: ignore[arg-type]
