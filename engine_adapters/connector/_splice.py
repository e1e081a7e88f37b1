"""The splice connector's core: the plan format, the scheduler-side planner and the
worker-side executor.  Pure Python + torch (imported lazily); never imports vLLM, so
tests drive it with plain tensors shaped like the engine's cache.

Three jobs, one store (:mod:`promptsplice.engine_adapters.store._store`, keyed by the chain hash of
:mod:`promptsplice.blocks` with the request's ``cache_salt``):

* **Save**: every full prompt block a request computes is saved, all layers in one
  payload ``[layers, r, *block]`` (``r`` kernel blocks per vLLM block, 1 on CPU).
  Loaded blocks are not saved again, and neither is anything a request computes after
  relocated KV (its deep layers attended to approximate KV): the store holds exact
  blocks only.  Generated tokens' blocks are not saved.
* **Offload hits**: on a local prefix-cache miss, the blocks that follow the local hit
  and are really in the store (``match_prefix``, pinned for the request) are loaded
  instead of computed.
* **Relocation**: a request that carries a :class:`SplicePlan` gets the planned old
  blocks (stored under the *old* prompt's chain hashes) loaded and their keys re-rotated
  by the position delta (``promptsplice.kernels.relocate_blocks``).

vLLM's contiguity rule shapes the planner: the loaded tokens start exactly at the local
hit and at least one prompt token is left to compute, so one request loads one
contiguous run of blocks; each block of the run is either an offload hit (delta 0) or a
relocated block of a plan segment (delta ``d``).

The plan format (what travels in ``SamplingParams.extra_args["kv_transfer_params"]``,
JSON/msgpack-safe)::

    {"splice": {"version": 1, "block_size": 32,
                "segments": [{"dst_start": 64, "num_blocks": 4, "delta": -64,
                              "src_parent": "<32 hex digits>"}]}}

Two optional plan fields scope spliced KV (see ``promptsplice.engine_adapters.runners._agent``):
``"src_salt"`` is the salt the old prompt's blocks were stored under when it differs from
this request's ``cache_salt`` (absent: the same), and ``"scope": true`` says this
request's salt is a *splice scope* that only its session uses: the blocks it loads and
the blocks it computes after relocated KV are then saved under that salt too (they are
approximate, and only requests with the scope's salt can reach them), so later edits of
the session can relocate them again.  Without a scope nothing approximate is saved.

A segment says: the ``num_blocks`` blocks of the *new* prompt starting at token
``dst_start`` were computed before at ``dst_start - delta`` in an old prompt, right after
the old block whose chain hash is ``src_parent`` (``root_hash(salt)`` when the old run
started at 0).  Their store keys are rebuilt by chaining ``src_parent`` over the new
prompt's own tokens, so a plan whose tokens do not match the old prompt simply finds
nothing in the store and those blocks are computed: a plan can never load KV for other
tokens (the store compares tokens, parent and salt on every lookup).  Segments are
contiguous in the new prompt (each starts where the previous ends).
"""

from __future__ import annotations

import logging
import numbers
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

from promptsplice.engine_adapters.store._store import BlockRef, BlockStore, StoreConfig, chain_refs
from promptsplice.blocks import (
    HASH_BYTES,
    BlockHash,
    cdiv,
    chain_hashes,
    hash_block,
    root_hash,
    round_down,
    round_up,
)
from promptsplice.errors import ConfigError, InputError

if TYPE_CHECKING:
    import torch

    from promptsplice.kernels import KVLayout, RopeConfig

__all__ = [
    "PLAN_KEY",
    "PLAN_VERSION",
    "SAME_SALT",
    "LoadItem",
    "LoadPlan",
    "SaveItem",
    "SpliceMetadata",
    "SplicePlan",
    "SpliceScheduler",
    "SpliceSegment",
    "SpliceWorker",
    "WorkerStats",
    "plan_deletion",
    "plan_load",
    "plan_phases",
    "plan_relocation",
    "plan_segment_phases",
    "SplicePhase",
    "store_config_from_extra",
    "store_config_to_extra",
]

_log = logging.getLogger(__name__)

class _SameSalt:
    """The default of :attr:`SplicePlan.src_salt`: the request's own ``cache_salt``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SAME_SALT"


SAME_SALT: Any = _SameSalt()
"""``SplicePlan.src_salt`` default: the old blocks were stored under the request's salt."""

PLAN_KEY = "splice"
"""The key of a plan inside ``kv_transfer_params``."""
PLAN_VERSION = 1


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ----------------------------------------------------------------------------- plans


@dataclass(frozen=True, slots=True)
class SpliceSegment:
    """``num_blocks`` whole blocks of the new prompt, from token ``dst_start``, that an
    old prompt computed at ``dst_start - delta`` right after the block ``src_parent``."""

    dst_start: int
    num_blocks: int
    delta: int
    src_parent: bytes

    def __post_init__(self) -> None:
        for name in ("dst_start", "num_blocks", "delta"):
            if not _is_int(getattr(self, name)):
                raise InputError(f"splice segment {name} must be an int, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.dst_start < 0 or self.num_blocks < 1:
            raise InputError(
                f"splice segment needs dst_start >= 0 and num_blocks >= 1, got "
                f"{self.dst_start} and {self.num_blocks}"
            )
        if self.src_start < 0:
            raise InputError(
                f"splice segment moves blocks from position {self.src_start} (dst_start "
                f"{self.dst_start} - delta {self.delta}): the old start cannot be negative"
            )
        parent = self.src_parent
        if not isinstance(parent, (bytes, bytearray)) or len(parent) != HASH_BYTES:
            raise InputError(f"splice segment src_parent must be {HASH_BYTES} bytes, got {parent!r:.80}")
        object.__setattr__(self, "src_parent", bytes(parent))

    @property
    def src_start(self) -> int:
        """Where the blocks were computed in the old prompt."""
        return self.dst_start - self.delta


@dataclass(frozen=True, slots=True)
class SplicePlan:
    """Which old blocks go where in the new prompt (see the module doc for the format).

    Build it with :func:`plan_relocation` or :func:`plan_deletion`; send it with
    ``EmbeddedEngine.generate(..., splice=plan)`` or put :meth:`to_params` into
    ``SamplingParams(extra_args={"kv_transfer_params": ...})``.  An empty plan (no
    segments) is valid and loads nothing by relocation.
    """

    block_size: int
    segments: tuple[SpliceSegment, ...] = ()
    src_salt: str | bytes | None = SAME_SALT
    """The salt the old blocks were stored under (:data:`SAME_SALT`: the request's)."""
    scope: bool = False
    """The request's salt is a splice scope: save what it loads and what it computes
    after relocated KV under it (see the module doc)."""

    def __post_init__(self) -> None:
        bs = self.block_size
        if self.src_salt is not SAME_SALT and not isinstance(self.src_salt, (str, bytes, type(None))):
            raise InputError(f"splice plan src_salt must be a str, bytes or None, got {self.src_salt!r:.80}")
        if not isinstance(self.scope, bool):
            raise InputError(f"splice plan scope must be a bool, got {self.scope!r}")
        if not _is_int(bs) or bs <= 0:
            raise InputError(f"splice plan block_size must be a positive int, got {bs!r}")
        segs = tuple(self.segments)
        for seg in segs:
            if not isinstance(seg, SpliceSegment):
                raise InputError(f"splice plan segments must be SpliceSegment, got {type(seg).__name__}")
            if seg.dst_start % bs or seg.delta % bs:
                raise InputError(
                    f"splice segment dst_start={seg.dst_start} and delta={seg.delta} must be "
                    f"multiples of block_size={bs}: only whole blocks move"
                )
        for a, b in zip(segs, segs[1:]):
            if b.dst_start != a.dst_start + a.num_blocks * bs:
                raise InputError(
                    f"splice segments must be contiguous in the new prompt: one ends at "
                    f"{a.dst_start + a.num_blocks * bs}, the next starts at {b.dst_start}"
                )
        object.__setattr__(self, "segments", segs)

    def __bool__(self) -> bool:
        return bool(self.segments)

    @property
    def dst_start(self) -> int:
        """First token of the new prompt the plan covers (0 for an empty plan)."""
        return self.segments[0].dst_start if self.segments else 0

    @property
    def dst_end(self) -> int:
        """One past the last token the plan covers."""
        if not self.segments:
            return 0
        last = self.segments[-1]
        return last.dst_start + last.num_blocks * self.block_size

    @property
    def num_tokens(self) -> int:
        return self.dst_end - self.dst_start

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` dict that carries this plan (JSON-safe)."""
        body: dict[str, Any] = {
            "version": PLAN_VERSION,
            "block_size": self.block_size,
            "segments": [
                {
                    "dst_start": s.dst_start,
                    "num_blocks": s.num_blocks,
                    "delta": s.delta,
                    "src_parent": s.src_parent.hex(),
                }
                for s in self.segments
            ],
        }
        if self.src_salt is not SAME_SALT:
            salt = self.src_salt
            body["src_salt"] = {"hex": salt.hex()} if isinstance(salt, bytes) else salt
        if self.scope:
            body["scope"] = True
        return {PLAN_KEY: body}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> SplicePlan | None:
        """The plan in ``kv_transfer_params`` (``None`` when it carries none).

        Raises :class:`InputError` for a malformed plan, naming the field.
        """
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise InputError(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
        raw = params.get(PLAN_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise InputError(f"kv_transfer_params[{PLAN_KEY!r}] must be a mapping, got {type(raw).__name__}")
        if raw.get("version") != PLAN_VERSION:
            raise InputError(f"splice plan version {raw.get('version')!r} is not supported (expected {PLAN_VERSION})")
        segments = raw.get("segments")
        if not isinstance(segments, (list, tuple)):
            raise InputError("splice plan 'segments' must be a list")
        segs = []
        for i, s in enumerate(segments):
            if not isinstance(s, Mapping):
                raise InputError(f"splice plan segment {i} must be a mapping")
            try:
                parent = bytes.fromhex(s["src_parent"])
                segs.append(SpliceSegment(s["dst_start"], s["num_blocks"], s["delta"], parent))
            except KeyError as exc:
                raise InputError(f"splice plan segment {i} lacks {exc.args[0]!r}") from None
            except (TypeError, ValueError) as exc:
                raise InputError(f"splice plan segment {i}: {exc}") from None
        src_salt: Any = SAME_SALT
        if "src_salt" in raw:
            src_salt = raw["src_salt"]
            if isinstance(src_salt, Mapping):
                try:
                    src_salt = bytes.fromhex(src_salt["hex"])
                except (KeyError, TypeError, ValueError):
                    raise InputError("splice plan 'src_salt' must be a str, null or {'hex': ...}") from None
        return cls(raw.get("block_size"), tuple(segs), src_salt, raw.get("scope", False))


def _as_token_list(tokens: Sequence[int], what: str) -> list[int]:
    try:
        out = [int(t) for t in tokens]
    except (TypeError, ValueError):
        raise InputError(f"{what} must be a sequence of token ids") from None
    return out


def _parent_at(tokens: Sequence[int], start: int, block_size: int, salt: str | bytes | None) -> BlockHash:
    """Chain hash of the block that ends at ``start`` (the root for ``start == 0``)."""
    if start == 0:
        return root_hash(salt)
    return chain_hashes(tokens[:start], block_size, salt=salt)[-1]


def plan_relocation(
    old_tokens: Sequence[int],
    new_tokens: Sequence[int],
    *,
    old_start: int,
    new_start: int,
    num_tokens: int | None = None,
    block_size: int,
    salt: str | bytes | None = None,
) -> SplicePlan:
    """A plan that moves the run ``old_tokens[old_start:]`` to ``new_start`` in the new prompt.

    ``num_tokens``: how many tokens move (``None``: the longest run on which both
    prompts agree); only whole blocks move, so it is rounded down to ``block_size``
    (the rest is computed).  ``old_start`` and ``new_start`` must be block multiples:
    the old blocks were stored whole at old block boundaries, and they land on new
    block boundaries (the assembler aligns segments for this).  ``salt`` is the
    ``cache_salt`` both requests use.  Raises :class:`InputError` when the prompts differ
    inside the requested run or the starts are not aligned.  May return an empty plan.
    """
    if not _is_int(block_size) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    old = _as_token_list(old_tokens, "old_tokens")
    new = _as_token_list(new_tokens, "new_tokens")
    for name, value, seq in (("old_start", old_start, old), ("new_start", new_start, new)):
        if not _is_int(value) or not 0 <= value <= len(seq):
            raise InputError(f"{name} must be an int in [0, {len(seq)}], got {value!r}")
        if value % block_size:
            raise InputError(
                f"{name}={value} is not a multiple of block_size={block_size}: whole-block "
                "relocation needs block-aligned segments (pad the segments before it)"
            )
    common = 0
    limit = min(len(old) - old_start, len(new) - new_start)
    while common < limit and old[old_start + common] == new[new_start + common]:
        common += 1
    if num_tokens is None:
        num_tokens = common
    elif not _is_int(num_tokens) or num_tokens < 0:
        raise InputError(f"num_tokens must be an int >= 0 or None, got {num_tokens!r}")
    elif num_tokens > common:
        raise InputError(
            f"the prompts differ inside the run to relocate: they agree on {common} tokens "
            f"from old {old_start} / new {new_start}, not {num_tokens}"
        )
    blocks = num_tokens // block_size
    if blocks == 0:
        return SplicePlan(block_size)
    seg = SpliceSegment(new_start, blocks, new_start - old_start, _parent_at(old, old_start, block_size, salt))
    return SplicePlan(block_size, (seg,))


def plan_deletion(
    old_tokens: Sequence[int],
    new_tokens: Sequence[int],
    span: tuple[int, int],
    *,
    block_size: int,
    salt: str | bytes | None = None,
) -> SplicePlan:
    """The plan for deleting ``old_tokens[span[0]:span[1]]``.

    ``old = P + X + S (+ old tail)``, ``new = P + S (+ new tail)`` with ``P =
    old[:span[0]]`` and ``X`` the deleted span: ``P`` hits the prefix cache, the blocks
    of ``S`` (the run on which ``old[span[1]:]`` and ``new[span[0]:]`` agree, whole
    blocks) are relocated by ``delta = -len(X)``, the rest is computed.  ``len(P)`` and
    ``len(X)`` must be block multiples.  Raises :class:`InputError` when ``new`` does not
    start with ``P``.
    """
    try:
        start, end = (int(x) for x in span)
    except (TypeError, ValueError):
        raise InputError(f"span must be (start, end) token positions, got {span!r}") from None
    old = _as_token_list(old_tokens, "old_tokens")
    new = _as_token_list(new_tokens, "new_tokens")
    if not 0 <= start <= end <= len(old):
        raise InputError(f"span {span!r} is not inside the old prompt of {len(old)} tokens")
    if new[:start] != old[:start]:
        raise InputError("the new prompt does not start with the old prompt's tokens before the span")
    return plan_relocation(old, new, old_start=end, new_start=start, block_size=block_size, salt=salt)


class SplicePhase(NamedTuple):
    """One request of a multi-phase splice: prompt ``new_tokens[:end]``, loading
    ``plan`` right after its local prefix-cache hit."""

    end: int
    plan: SplicePlan


def plan_phases(
    old_tokens: Sequence[int],
    new_tokens: Sequence[int],
    relocations: Iterable[tuple[int, int, int]],
    *,
    block_size: int,
    recompute_blocks: int = 0,
    salt: str | bytes | None = None,
    src_salt: Any = SAME_SALT,
    load_prefix: int = 0,
    scope: bool = False,
    min_group_blocks: int = 1,
) -> list[SplicePhase]:
    """The requests that carry out an edit: unchanged old runs are relocated, the rest
    is computed, every request extending the prefix-cache hit of the one before.

    ``relocations``: ``(old_start, old_end, delta)`` runs of old tokens that reappear at
    ``old_start + delta`` in the new prompt (:attr:`promptsplice.assembler.Diff.relocations`), sorted.
    Only whole blocks move, from old block boundaries to new ones (a run whose ``delta``
    is not a block multiple is computed); the first ``recompute_blocks`` blocks of each
    run are computed too (their attention to the edited context is fresh: the fix
    for the attention-sink drift EPIC reports).  ``load_prefix`` tokens (a block
    multiple, equal in both prompts) are loaded from the old chain instead of hitting
    the prefix cache: the first request of a new splice scope, whose salt has nothing
    cached yet.  ``salt`` is the requests' ``cache_salt``; ``src_salt`` the salt the old
    prompt's blocks were stored under (:data:`SAME_SALT`: ``salt``).

    vLLM loads one contiguous run right after the local hit and computes at least one
    token per request, so each maximal run of contiguous loaded blocks is one request:
    it loads the run and computes up to the next run (its blocks are then cached for
    the next request); a first request without a plan computes what precedes the first
    run when the prefix cache cannot reach it.  The last phase ends at
    ``len(new_tokens)``.  A run of contiguous loads that would need a request of its
    own but moves fewer than ``min_group_blocks`` blocks is computed instead (a request
    costs more than prefilling a block or two).  Raises :class:`InputError` when a run's
    tokens differ between the prompts or runs overlap.
    """
    bs = block_size
    if not _is_int(bs) or bs <= 0:
        raise ConfigError(f"block_size must be a positive int, got {bs!r}")
    if not _is_int(recompute_blocks) or recompute_blocks < 0:
        raise ConfigError(f"recompute_blocks must be an int >= 0, got {recompute_blocks!r}")
    old = _as_token_list(old_tokens, "old_tokens")
    new = _as_token_list(new_tokens, "new_tokens")
    if not new:
        raise InputError("the new prompt is empty")
    src = salt if src_salt is SAME_SALT else src_salt
    limit = round_down(len(new) - 1, bs)  # the last request computes at least one token
    old_chain: list[BlockHash] = []

    def parent(old_pos: int) -> BlockHash:
        if old_pos == 0:
            return root_hash(src)
        if not old_chain:
            old_chain.extend(chain_hashes(old[: round_down(len(old), bs)], bs, salt=src))
        return old_chain[old_pos // bs - 1]

    segs: list[SpliceSegment] = []
    if load_prefix:
        if not _is_int(load_prefix) or load_prefix < 0 or load_prefix % bs:
            raise InputError(f"load_prefix must be a block multiple >= 0, got {load_prefix!r}")
        if new[:load_prefix] != old[:load_prefix]:
            raise InputError("load_prefix covers tokens on which the old and new prompts differ")
        n = min(load_prefix, limit) // bs
        if n:
            segs.append(SpliceSegment(0, n, 0, root_hash(src)))
    for i, run in enumerate(relocations):
        try:
            o_start, o_end, delta = (int(x) for x in run)
        except (TypeError, ValueError):
            raise InputError(f"relocation {i} must be (old_start, old_end, delta), got {run!r}") from None
        if not 0 <= o_start <= o_end <= len(old) or not 0 <= o_start + delta <= o_end + delta <= len(new):
            raise InputError(f"relocation {i} {run!r} is outside the prompts ({len(old)} / {len(new)} tokens)")
        if delta % bs:
            continue  # not block-aligned in both prompts: computed
        a = round_up(o_start + delta, bs) + recompute_blocks * bs
        e = min(round_down(o_end + delta, bs), limit)
        if e - a < bs:
            continue
        if new[a:e] != old[a - delta : e - delta]:
            raise InputError(f"relocation {i} {run!r}: the prompts differ inside the run")
        if segs and a < segs[-1].dst_start + segs[-1].num_blocks * bs:
            raise InputError(f"relocation {i} {run!r} overlaps the run before it (sort them, no overlaps)")
        segs.append(SpliceSegment(a, (e - a) // bs, delta, parent(a - delta)))

    hit = 0
    while hit < min(len(old), len(new)) and old[hit] == new[hit]:
        hit += 1
    return plan_segment_phases(
        segs,
        len(new),
        block_size=bs,
        hit=round_down(hit, bs),
        src_salt=src_salt,
        scope=scope,
        min_group_blocks=min_group_blocks,
    )


def plan_segment_phases(
    segments: Iterable[SpliceSegment],
    num_tokens: int,
    *,
    block_size: int,
    hit: int = 0,
    src_salt: Any = SAME_SALT,
    scope: bool = False,
    min_group_blocks: int = 1,
) -> list[SplicePhase]:
    """The requests that load ``segments`` (sorted, non-overlapping, inside a prompt of
    ``num_tokens`` tokens) and compute everything between them.

    ``hit``: the prefix-cache hit expected for the first request (a block multiple).
    Each maximal run of contiguous segments is one request that loads it right after
    its local hit and computes up to the next run; a first plain request computes what
    lies between ``hit`` and the first run.  A run that starts after 0 and moves fewer
    than ``min_group_blocks`` blocks is dropped (computed).  Shared by the agent's
    edits (:func:`plan_phases`) and position-independent chunk reuse
    (:mod:`promptsplice.engine_adapters.runners._rag`).
    """
    bs = block_size
    groups: list[list[SpliceSegment]] = []
    for seg in segments:
        if groups and seg.dst_start < groups[-1][-1].dst_start + groups[-1][-1].num_blocks * bs:
            raise InputError(f"splice segment at {seg.dst_start} overlaps the one before it (sort them)")
        if groups and groups[-1][-1].dst_start + groups[-1][-1].num_blocks * bs == seg.dst_start:
            groups[-1].append(seg)
        else:
            groups.append([seg])
    groups = [
        g for g in groups if g[0].dst_start == 0 or sum(x.num_blocks for x in g) >= min_group_blocks
    ]
    phases: list[SplicePhase] = []
    if groups:
        first = groups[0][0].dst_start
        if first > hit:
            phases.append(SplicePhase(first, SplicePlan(bs, src_salt=src_salt, scope=scope)))
    for k, group in enumerate(groups):
        end = groups[k + 1][0].dst_start if k + 1 < len(groups) else num_tokens
        phases.append(SplicePhase(end, SplicePlan(bs, tuple(group), src_salt, scope)))
    if not phases:
        phases.append(SplicePhase(num_tokens, SplicePlan(bs, src_salt=src_salt, scope=scope)))
    return phases


# --------------------------------------------------------------------- planning loads


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What the connector will load for a request: blocks ``refs`` (with per-block
    position ``deltas``) into the request's blocks from token ``start`` on."""

    start: int
    block_size: int
    refs: tuple[BlockRef, ...] = ()
    deltas: tuple[int, ...] = ()
    salts: tuple[str | bytes | None, ...] | None = None
    """Per-ref salts when some refs come from another salt (``None``: the request's)."""

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    @property
    def num_tokens(self) -> int:
        return len(self.refs) * self.block_size

    @property
    def num_relocated(self) -> int:
        return sum(1 for d in self.deltas if d)


def _plan_refs(
    tokens: Sequence[int], plan: SplicePlan, block_size: int
) -> dict[int, tuple[BlockRef, int]]:
    """Block index in the new prompt -> (ref of the old block, delta), per segment."""
    out: dict[int, tuple[BlockRef, int]] = {}
    for seg in plan.segments:
        parent = BlockHash(seg.src_parent)
        first = seg.dst_start // block_size
        for j in range(first, first + seg.num_blocks):
            blk = tuple(tokens[j * block_size : (j + 1) * block_size])
            if len(blk) < block_size:
                return out  # the plan runs past the prompt: the rest cannot be whole blocks
            key = hash_block(parent, blk)
            out[j] = (BlockRef(key, parent, blk), seg.delta)
            parent = key
    return out


def plan_load(
    store: BlockStore,
    prompt_tokens: Sequence[int],
    num_computed_tokens: int,
    *,
    block_size: int,
    salt: str | bytes | None = None,
    plan: SplicePlan | None = None,
    owner: Hashable | None = None,
    relocation: bool = True,
    chain: Sequence[BlockRef] | None = None,
) -> LoadPlan:
    """How many blocks after the local hit the store can serve, and which.

    Candidates run from block ``num_computed_tokens // block_size`` up to the last full
    block that still leaves one prompt token to compute (``(len - 1) // block_size``
    blocks in all): a block covered by ``plan`` is its old block (delta of its segment),
    any other block is the new prompt's own chain block (an offload hit, delta 0).  The
    count is the leading run present in the store (``match_prefix``), pinned for
    ``owner`` until ``store.release(owner)``.  ``relocation=False`` ignores plan
    segments with a non-zero delta (the engine cannot rotate keys).  ``chain`` may pass
    the prompt's precomputed ``chain_refs``.  A local hit that is not a block multiple
    loads nothing.
    """
    bs = block_size
    start = int(num_computed_tokens)
    empty = LoadPlan(start, bs)
    if start % bs or start < 0:
        if owner is not None:
            store.release(owner)
        return empty
    first, last = start // bs, (len(prompt_tokens) - 1) // bs
    if first >= last:
        if owner is not None:
            store.release(owner)
        return empty
    planned: dict[int, tuple[BlockRef, int]] = {}
    if plan:
        if plan.block_size != bs:
            raise InputError(f"the splice plan is for block_size {plan.block_size}, the engine's is {bs}")
        planned = _plan_refs(prompt_tokens, plan, bs)
        if not relocation:
            planned = {j: rd for j, rd in planned.items() if rd[1] == 0}
    if chain is None or len(chain) < last:
        chain = chain_refs(prompt_tokens[: last * bs], bs, salt=salt)
    src_salt = salt if plan is None or plan.src_salt is SAME_SALT else plan.src_salt
    refs: list[BlockRef] = []
    deltas: list[int] = []
    salts: list[str | bytes | None] = []
    for j in range(first, last):
        if j in planned:
            ref, delta = planned[j]
            salts.append(src_salt)
        else:
            ref, delta = chain[j], 0
            salts.append(salt)
        refs.append(ref)
        deltas.append(delta)
    mixed = any(x != salt for x in salts)
    count = store.match_prefix(refs, salt=salt, owner=owner, salts=salts if mixed else None)
    return LoadPlan(
        start, bs, tuple(refs[:count]), tuple(deltas[:count]), tuple(salts[:count]) if mixed else None
    )


# ------------------------------------------------------------------- metadata items


@dataclass(frozen=True, slots=True)
class LoadItem:
    """Load ``refs`` into vLLM blocks ``block_ids`` (keys rotated by ``deltas``).

    Blocks of ``block_ids`` past the end of ``refs`` have no source: load errors."""

    req_id: str
    salt: str | bytes | None
    refs: tuple[BlockRef, ...]
    deltas: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    """The first loaded token (the request's local prefix-cache hit)."""
    ref_salts: tuple[str | bytes | None, ...] | None = None
    """Per-ref salts (``None``: every ref is stored under ``salt``)."""

    def salt_of(self, index: int) -> str | bytes | None:
        return self.salt if self.ref_salts is None else self.ref_salts[index]


@dataclass(frozen=True, slots=True)
class SaveItem:
    """Save vLLM blocks ``block_ids`` (just computed) under ``refs``."""

    req_id: str
    salt: str | bytes | None
    refs: tuple[BlockRef, ...]
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class SpliceMetadata:
    """One engine step's work for the worker side: loads before the forward pass,
    saves after it."""

    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)


# ------------------------------------------------------------------ scheduler side


@dataclass(slots=True)
class _ReqState:
    tokens: Sequence[int]
    salt: str | bytes | None
    plan: SplicePlan | None = None
    chain: list[BlockRef] | None = None
    pending: LoadPlan | None = None
    no_save: bool = False
    """Set after a relocation: blocks computed after relocated KV are not exact."""
    save_from: int | None = None
    """Scoped requests: the first loaded block, saved (under the scope) with the step."""


class SpliceScheduler:
    """The scheduler-side half of the connector (one per engine).

    The connector forwards vLLM's scheduler calls here with plain values:
    :meth:`get_num_new_matched_tokens` (count and pin), :meth:`update_state_after_alloc`
    (turn the count into a :class:`LoadItem` with the destination block ids),
    :meth:`build_connector_meta` (this step's loads and saves) and
    :meth:`request_finished`.
    """

    def __init__(self, store: BlockStore, block_size: int, *, relocation: bool = True) -> None:
        if not _is_int(block_size) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        self.store = store
        self.block_size = int(block_size)
        self.relocation = bool(relocation)
        self._reqs: dict[str, _ReqState] = {}
        self._loads: list[LoadItem] = []
        self._warned_plan = False

    def _state(self, req_id: str, tokens: Sequence[int], salt, params) -> _ReqState:
        st = self._reqs.get(req_id)
        if st is None or st.tokens is not tokens:
            try:
                plan = SplicePlan.from_params(params)
            except InputError as exc:
                # A bad plan must not fail the engine: the request is computed instead.
                _log.warning("splice connector: ignoring the splice plan of %s: %s", req_id, exc)
                plan = None
            if plan is not None and plan.block_size != self.block_size:
                _log.warning(
                    "splice connector: ignoring the splice plan of %s: made for block_size %d, "
                    "the engine's is %d", req_id, plan.block_size, self.block_size,
                )
                plan = None
            if plan and not self.relocation and not self._warned_plan:
                self._warned_plan = True
                _log.warning(
                    "splice connector: relocation is unavailable on this engine (RoPE or KV "
                    "layout not supported); splice plans fall back to computing"
                )
            st = _ReqState(tokens, salt, plan)
            self._reqs[req_id] = st
        return st

    def get_num_new_matched_tokens(
        self,
        req_id: str,
        prompt_tokens: Sequence[int] | None,
        salt: str | bytes | None,
        num_computed_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> int:
        """Tokens to load after the local hit ``num_computed_tokens`` (block multiple).

        Idempotent: asking again replaces the earlier answer and its pins.
        """
        if not prompt_tokens:
            return 0
        st = self._state(req_id, prompt_tokens, salt, kv_transfer_params)
        bs = self.block_size
        last = (len(prompt_tokens) - 1) // bs
        if st.chain is None and num_computed_tokens // bs < last:
            st.chain = chain_refs(prompt_tokens[: last * bs], bs, salt=salt)
        lp = plan_load(
            self.store,
            prompt_tokens,
            num_computed_tokens,
            block_size=bs,
            salt=salt,
            plan=st.plan,
            owner=req_id,
            relocation=self.relocation,
            chain=st.chain,
        )
        st.pending = lp if lp.num_blocks else None
        return lp.num_tokens

    def update_state_after_alloc(
        self, req_id: str, block_ids: Sequence[int], num_external_tokens: int
    ) -> LoadItem | None:
        """vLLM allocated the request's blocks (``block_ids``: all of them, the local
        hit's included) and accepted ``num_external_tokens`` (0: load nothing)."""
        st = self._reqs.get(req_id)
        if st is None:
            return None
        lp, st.pending = st.pending, None
        bs = self.block_size
        n = num_external_tokens // bs if num_external_tokens > 0 else 0
        if lp is None or n == 0:
            self.store.release(req_id)
            return None
        if num_external_tokens % bs or n > lp.num_blocks:
            # Not what was offered (vLLM trims only to 0 or to whole blocks): the blocks
            # without a source are reported as load errors, so vLLM recomputes them.
            _log.error(
                "splice connector: vLLM accepted %d external tokens for %s, the connector "
                "offered %d in blocks of %d", num_external_tokens, req_id, lp.num_tokens, bs,
            )
            n = cdiv(num_external_tokens, bs)
        first = lp.start // bs
        dst = tuple(int(b) for b in block_ids[first : first + n])
        salts = None if lp.salts is None else lp.salts[:n]
        item = LoadItem(req_id, st.salt, lp.refs[:n], lp.deltas[:n], dst, lp.start, salts)
        if st.plan is not None and st.plan.scope:
            st.save_from = first  # approximate or not, the scope keeps what it loaded
        elif any(item.deltas) or salts is not None:
            st.no_save = True
        self._loads.append(item)
        return item

    def build_connector_meta(
        self,
        steps: Iterable[tuple[str, int, int]],
        block_ids: Callable[[str], Sequence[int]],
    ) -> SpliceMetadata:
        """This step's work: the pending loads, and a save of every full prompt block
        the step completes that the store lacks.

        ``steps``: ``(req_id, num_computed_tokens, num_scheduled_tokens)`` of each
        scheduled request (computed tokens *before* this step, loaded ones included);
        ``block_ids(req_id)``: all of the request's vLLM block ids.
        """
        bs = self.block_size
        saves: list[SaveItem] = []
        for req_id, computed, scheduled in steps:
            st = self._reqs.get(req_id)
            if st is None or st.no_save:
                continue
            prompt_len = len(st.tokens)
            end = min(computed + scheduled, prompt_len)
            first, stop = computed // bs, end // bs  # blocks [first, stop) complete now
            if st.save_from is not None:
                first, st.save_from = min(first, st.save_from), None
            if stop <= first:
                continue
            if st.chain is None or len(st.chain) < stop:
                st.chain = chain_refs(st.tokens[: round_down(prompt_len, bs)], bs, salt=st.salt)
            ids = None
            refs, dst = [], []
            for j in range(first, stop):
                ref = st.chain[j]
                if self.store.contains(ref, salt=st.salt):
                    continue
                if ids is None:
                    ids = block_ids(req_id)
                refs.append(ref)
                dst.append(int(ids[j]))
            if refs:
                saves.append(SaveItem(req_id, st.salt, tuple(refs), tuple(dst)))
        loads, self._loads = self._loads, []
        return SpliceMetadata(loads, saves)

    def request_finished(self, req_id: str) -> None:
        """Forget the request and drop its pins."""
        self._reqs.pop(req_id, None)
        self.store.release(req_id)

    @property
    def num_tracked(self) -> int:
        return len(self._reqs)


# --------------------------------------------------------------------- worker side


@dataclass(slots=True)
class WorkerStats:
    """Counters of the worker side (blocks, since the worker was built)."""

    loaded_blocks: int = 0
    relocated_blocks: int = 0
    load_errors: int = 0
    saved_blocks: int = 0
    save_errors: int = 0
    skipped_saves: int = 0
    """Blocks not saved because the step's forward pass failed (their KV is partial)."""


class SpliceWorker:
    """The worker-side half: loads (and relocates) stored blocks into the paged cache
    before the forward pass, saves newly computed blocks after it.

    ``caches``: every attention layer's cache tensor, in layer order (the order the
    payload's first axis follows).  ``block_dim``: the axis of a cache tensor that
    indexes its blocks (0 for vLLM's CPU_ATTN and its unified GPU caches).
    ``kernel_block_size``: tokens per cache-tensor block when vLLM splits its
    ``block_size`` blocks into smaller kernel blocks (``None``: the same).  ``layout``
    and ``rope`` enable relocation (``promptsplice.kernels.relocate_blocks``); without them only
    delta-0 loads (offload hits) are possible.
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        block_size: int,
        caches: Mapping[str, torch.Tensor],
        block_dim: int = 0,
        kernel_block_size: int | None = None,
        layout: KVLayout | None = None,
        rope: RopeConfig | None = None,
        history: int = 32,
    ) -> None:
        import torch

        if not caches:
            raise ConfigError("the splice worker needs at least one KV cache tensor")
        self.store = store
        self.block_size = int(block_size)
        self.names = list(caches)
        self.caches = [caches[n] for n in self.names]
        first = self.caches[0]
        for name, t in zip(self.names, self.caches):
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"KV cache {name!r} is not a tensor ({type(t).__name__})")
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ConfigError(
                    f"KV cache {name!r} is {tuple(t.shape)} {t.dtype}, the first layer's is "
                    f"{tuple(first.shape)} {first.dtype}: one payload layout needs equal layers"
                )
        if not 0 <= block_dim < first.dim():
            raise ConfigError(f"block_dim {block_dim} is not an axis of the cache {tuple(first.shape)}")
        self.block_dim = block_dim
        kbs = self.block_size if kernel_block_size is None else int(kernel_block_size)
        if kbs <= 0 or self.block_size % kbs:
            raise ConfigError(
                f"vLLM's block_size {self.block_size} is not a multiple of the cache's "
                f"kernel block size {kbs}"
            )
        self.blocks_per_block = self.block_size // kbs
        per_layer = list(first.shape)
        per_layer[block_dim] = self.blocks_per_block
        self.payload_shape = (len(self.caches), *per_layer)
        self.dtype = first.dtype
        self.layout = layout
        self.rope = rope
        self.stats = WorkerStats()
        self.history: deque[tuple[str, LoadItem | SaveItem, int]] = deque(maxlen=history)
        """Recent work: ``("load", item, blocks loaded)`` and ``("save", item, blocks
        stored)`` (for tests and debugging)."""
        self._errors: set[int] = set()
        self._failed: set[str] = set()

    @property
    def can_relocate(self) -> bool:
        return self.layout is not None and self.rope is not None

    def kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        """Cache-tensor block ids of vLLM blocks ``block_ids`` (``r`` each, in order)."""
        r = self.blocks_per_block
        return [b * r + i for b in block_ids for i in range(r)]

    # -- loads ------------------------------------------------------------------
    def start_load(self, meta: SpliceMetadata) -> None:
        """Carry out every load of this step (before the forward pass)."""
        self._failed = set()
        for item in meta.loads:
            self.load(item)

    def load(self, item: LoadItem) -> int:
        """Load one item; returns the blocks written.

        The leading blocks the store serves are written; from the first block it does
        not serve (gone, damaged, wrong shape) on, every block of the item is reported
        by :meth:`take_load_errors` and vLLM recomputes from there.  Pins of the
        request are released.
        """
        import torch

        payloads = []
        try:
            for i, ref in enumerate(item.refs):
                found = self.store.get(ref, salt=item.salt_of(i))
                p = found.payload
                if not found.status.hit or p is None or tuple(p.shape) != self.payload_shape or p.dtype != self.dtype:
                    if found.status.hit:
                        _log.warning(
                            "splice connector: stored block has shape %s %s, the engine needs %s %s",
                            tuple(p.shape), p.dtype, self.payload_shape, self.dtype,
                        )
                    break
                payloads.append(p)
            n = len(payloads)
            deltas = list(item.deltas[:n])
            if n and any(deltas) and not self.can_relocate:
                _log.warning("splice connector: cannot relocate on this engine; recomputing")
                n = 0
            if n:
                self._write(payloads[:n], item.block_ids[:n], deltas[:n], torch)
        except Exception:  # noqa: BLE001 - a failed load is recomputed, never fatal
            _log.exception("splice connector: loading blocks for %s failed", item.req_id)
            n = 0
        finally:
            self.store.release(item.req_id)
        if n < len(item.block_ids):
            self._errors.update(item.block_ids[n:])
            self._failed.add(item.req_id)
            self.stats.load_errors += len(item.block_ids) - n
        self.stats.loaded_blocks += n
        self.stats.relocated_blocks += sum(1 for d in item.deltas[:n] if d)
        self.history.append(("load", item, n))
        return n

    def _write(self, payloads, block_ids, deltas, torch) -> None:
        from promptsplice.kernels import relocate_blocks

        r = self.blocks_per_block
        kids = torch.tensor(self.kernel_ids(block_ids), dtype=torch.int64, device=self.caches[0].device)
        kdeltas = [d for d in deltas for _ in range(r)]
        moved = any(kdeltas)
        for layer, cache in enumerate(self.caches):
            src = torch.cat([p[layer] for p in payloads], dim=self.block_dim).to(cache.device)
            if moved:
                relocate_blocks(cache, src, kids, kdeltas, self.rope, self.layout)
            else:
                cache.index_copy_(self.block_dim, kids, src)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids that failed to load since the last call (then cleared)."""
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ------------------------------------------------------------------
    def save(self, meta: SpliceMetadata) -> int:
        """Store this step's newly computed blocks (after the forward pass).

        Requests whose load failed in this step are skipped: vLLM recomputes them.
        Returns the blocks stored.
        """
        stored = 0
        for item in meta.saves:
            if item.req_id in self._failed:
                continue
            stored += self.save_item(item)
        return stored

    def skip_saves(self, meta: SpliceMetadata) -> int:
        """Count, and do not store, this step's blocks: its forward pass failed."""
        n = sum(len(item.refs) for item in meta.saves)
        if n:
            _log.warning("splice connector: the forward pass failed; %d block(s) of this step not saved", n)
        self.stats.skipped_saves += n
        return n

    def save_item(self, item: SaveItem) -> int:
        import torch

        from promptsplice.engine_adapters.store._store import PutStatus

        n = len(item.refs)
        if n == 0:
            return 0
        stored = 0
        try:
            kids = torch.tensor(self.kernel_ids(item.block_ids), dtype=torch.int64, device=self.caches[0].device)
            out = torch.empty((n, *self.payload_shape), dtype=self.dtype)
            r, bd = self.blocks_per_block, self.block_dim
            for layer, cache in enumerate(self.caches):
                g = cache.index_select(bd, kids).unflatten(bd, (n, r)).movedim(bd, 0)
                out[:, layer].copy_(g)
            for i, ref in enumerate(item.refs):
                status = self.store.put(ref, out[i], salt=item.salt)
                if status in (PutStatus.STORED, PutStatus.EXISTS):
                    stored += 1
        except Exception:  # noqa: BLE001 - a save is best effort
            _log.exception("splice connector: saving blocks of %s failed", item.req_id)
            self.stats.save_errors += n - stored
        self.stats.saved_blocks += stored
        self.history.append(("save", item, stored))
        return stored


# ------------------------------------------------------ store config in vLLM's config

_STORE_FIELDS = tuple(f.name for f in fields(StoreConfig))


def store_config_to_extra(config: StoreConfig) -> dict[str, Any]:
    """A :class:`StoreConfig` as ``kv_connector_extra_config`` (plain values)."""
    if not isinstance(config, StoreConfig):
        raise ConfigError(f"expected a StoreConfig, got {type(config).__name__}")
    return {name: getattr(config, name) for name in _STORE_FIELDS}


def store_config_from_extra(extra: Mapping[str, Any], *, fingerprint: str = "") -> StoreConfig:
    """The :class:`StoreConfig` named by ``kv_connector_extra_config``.

    ``fingerprint`` (the engine's model and KV layout) is prepended to the one given,
    so blocks of another model or layout are never served.
    """
    if not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config must be a mapping of StoreConfig fields")
    unknown = sorted(set(extra) - set(_STORE_FIELDS))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown keys {unknown}; the splice connector "
            f"takes StoreConfig fields: {', '.join(_STORE_FIELDS)}"
        )
    if "dram_bytes" not in extra:
        raise ConfigError("kv_connector_extra_config needs dram_bytes (the store's DRAM budget)")
    values = dict(extra)
    user = values.get("fingerprint") or ""
    values["fingerprint"] = fingerprint if not user else f"{fingerprint}|{user}"
    try:
        return StoreConfig(**values)
    except TypeError as exc:
        raise ConfigError(f"bad store configuration: {exc}") from exc
