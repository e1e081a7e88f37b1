"""Splice plans: which old KV blocks go where in an edited prompt, and the requests
that carry an edit out.  What the runners build; torch-free and vLLM-free (importing
this module imports neither), so plans are made and tested without an engine.

A plan travels to the connector in ``SamplingParams.extra_args["kv_transfer_params"]``
(JSON/msgpack-safe)::

    {"splice": {"version": 1, "block_size": 32,
                "segments": [{"dst_start": 64, "num_blocks": 4, "delta": -64,
                              "src_parent": "<32 hex digits>"}]}}

A segment says: the ``num_blocks`` blocks of the *new* prompt starting at token
``dst_start`` were computed before at ``dst_start - delta`` in an old prompt, right after
the old block whose chain hash is ``src_parent`` (``root_hash(salt)`` when the old run
started at 0).  The connector rebuilds their store keys by chaining ``src_parent`` over
the new prompt's own tokens, so a plan whose tokens do not match the old prompt simply
finds nothing in the store and those blocks are computed: a plan can never load KV for
other tokens (the store compares tokens, parent and salt on every lookup).  Segments are
contiguous in the new prompt (each starts where the previous ends).

``"probes"`` (optional, same segment shape) names blocks the request *computes* whose
old KV is in the store (the blocks recomputed after an edit or at a chunk start): the
connector compares the fresh KV with the relocated old KV of the same tokens as it saves
them and reports a :class:`BlockDeviation` per block (embedded engine only, for now).

Two optional fields scope spliced KV (see ``promptsplice.engine_adapters.runners._agent``):
``"src_salt"`` is the salt the old prompt's blocks were stored under when it differs from
this request's ``cache_salt`` (absent: the same), and ``"scope": true`` says this
request's salt is a *splice scope* that only its session uses: the blocks it loads and
the blocks it computes after relocated KV are then saved under that salt too (they are
approximate, and only requests with the scope's salt can reach them), so later edits of
the session can relocate them again.  Without a scope nothing approximate is saved: not
by the request that loads it, nor by a later request of its salt whose prefix-cache hit
covers it (vLLM files relocated blocks under the new prompt's exact hashes; the
scheduler remembers those keys).  ``"save_exact": true`` (a scoped request whose
``src_salt`` holds exact KV only) asks the connector to save the blocks it holds that
are known exact under ``src_salt`` too.

vLLM's contiguity rule shapes the phases: the loaded tokens start exactly at the local
prefix-cache hit and at least one prompt token is left to compute, so one request loads
one contiguous run of blocks (:func:`plan_phases`, :func:`plan_segment_phases`).

Kept as one module (~700 lines): the wire format, the phases built from it and the probes that
extend them (:func:`extend_recompute`) share the segment record and its checks.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from promptsplice.blocks import HASH_BYTES, BlockHash, cacheable_blocks, chain_hashes, hash_block, root_hash, round_down, round_up
from promptsplice._validate import holds_exact_kv_only
from promptsplice.errors import ConfigError, InputError

__all__ = [
    "BlockDeviation",
    "PLAN_KEY",
    "PLAN_VERSION",
    "SAME_SALT",
    "SplicePhase",
    "SplicePlan",
    "SpliceSegment",
    "approximate_tokens",
    "compute_run",
    "extend_recompute",
    "in_place_blocks",
    "latest_per_block",
    "plan_deletion",
    "plan_phases",
    "plan_relocation",
    "plan_segment_phases",
]


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
    """Which old blocks go where in the new prompt (the module doc gives the wire format).

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
    probes: tuple[SpliceSegment, ...] = ()
    """Blocks this request computes whose old KV is in the store: the connector measures
    how far the fresh KV is from the relocated old KV (:class:`BlockDeviation`)."""
    save_exact: bool = False
    """A scoped request whose ``src_salt`` holds exact KV only: the connector also saves
    the blocks it holds that are known exact under ``src_salt`` (the tenant's), where a
    chunk index finds them (``RagRunner(index_computed=True)``)."""

    def __post_init__(self) -> None:
        bs = self.block_size
        if self.src_salt is not SAME_SALT and not isinstance(self.src_salt, (str, bytes, type(None))):
            raise InputError(f"splice plan src_salt must be a str, bytes or None, got {self.src_salt!r:.80}")
        if not isinstance(self.scope, bool):
            raise InputError(f"splice plan scope must be a bool, got {self.scope!r}")
        if not isinstance(self.save_exact, bool):
            raise InputError(f"splice plan save_exact must be a bool, got {self.save_exact!r}")
        if not _is_int(bs) or bs <= 0:
            raise InputError(f"splice plan block_size must be a positive int, got {bs!r}")
        segs = tuple(self.segments)
        probes = tuple(self.probes)
        for seg in segs + probes:
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
        object.__setattr__(self, "probes", probes)

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
            "segments": [_seg_params(s) for s in self.segments],
        }
        if self.probes:
            body["probes"] = [_seg_params(s) for s in self.probes]
        if self.src_salt is not SAME_SALT:
            salt = self.src_salt
            body["src_salt"] = {"hex": salt.hex()} if isinstance(salt, bytes) else salt
        if self.scope:
            body["scope"] = True
        if self.save_exact:
            body["save_exact"] = True
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
        segs = _segs_from(raw.get("segments"), "segments", "segment")
        probes = _segs_from(raw.get("probes", []), "probes", "probe")
        src_salt: Any = SAME_SALT
        if "src_salt" in raw:
            src_salt = raw["src_salt"]
            if isinstance(src_salt, Mapping):
                try:
                    src_salt = bytes.fromhex(src_salt["hex"])
                except (KeyError, TypeError, ValueError):
                    raise InputError("splice plan 'src_salt' must be a str, null or {'hex': ...}") from None
        return cls(raw.get("block_size"), segs, src_salt, raw.get("scope", False), probes, raw.get("save_exact", False))


def _seg_params(s: SpliceSegment) -> dict[str, Any]:
    return {"dst_start": s.dst_start, "num_blocks": s.num_blocks, "delta": s.delta, "src_parent": s.src_parent.hex()}


def _segs_from(raw: Any, key: str, what: str) -> tuple[SpliceSegment, ...]:
    if not isinstance(raw, (list, tuple)):
        raise InputError(f"splice plan {key!r} must be a list")
    segs = []
    for i, s in enumerate(raw):
        if not isinstance(s, Mapping):
            raise InputError(f"splice plan {what} {i} must be a mapping")
        try:
            parent = bytes.fromhex(s["src_parent"])
            segs.append(SpliceSegment(s["dst_start"], s["num_blocks"], s["delta"], parent))
        except KeyError as exc:
            raise InputError(f"splice plan {what} {i} lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise InputError(f"splice plan {what} {i}: {exc}") from None
    return tuple(segs)


class BlockDeviation(NamedTuple):
    """How far a recomputed block's fresh KV is from its relocated old KV (a probe).

    ``k`` and ``v``: per attention layer, ``||fresh - old|| / ||fresh||`` of the block's
    keys (the old keys re-rotated by ``delta``) and values.  Layer 0 depends only on the
    token and its position, so it is ~0 (rounding) for any probe; deeper layers grow as
    the context before the block differs from the one the old KV attended to.
    """

    dst_start: int
    """First token of the block in the new prompt."""
    delta: int
    k: tuple[float, ...]
    v: tuple[float, ...]

    @property
    def value(self) -> float:
        """The signal the adaptive recompute compares with ``max_deviation``: the mean
        over layers of the K and V relative errors (every aggregate tried ranked
        first-token KL weakly on the calibration, Spearman 0.09-0.23: README)."""
        n = len(self.k) + len(self.v)
        return (sum(self.k) + sum(self.v)) / n if n else 0.0

    @property
    def max_layer(self) -> float:
        """The largest K or V relative error of any layer."""
        return max((*self.k, *self.v), default=0.0)


def in_place_blocks(plan: SplicePlan, tokens: Sequence[int], salt: str | bytes | None) -> set[int]:
    """The blocks (indices into ``tokens``) of ``plan``'s segments whose old KV is
    exact for a request of ``tokens`` under ``salt``: a delta-0 segment whose old blocks
    followed the very same tokens (its ``src_parent`` is ``tokens``' own chain at
    ``dst_start`` under the old blocks' salt), an offload hit by another name, when that
    salt is the request's own or one that holds exact KV only (a tenant's, an exact
    salt: ``holds_exact_kv_only``).  Every other
    planned block is approximate: moved, in place after other tokens (a same-length edit
    before it), or taken from another derived salt (a session scope's chains may hold
    KV computed after relocated KV)."""
    src_salt = salt if plan.src_salt is SAME_SALT else plan.src_salt
    if src_salt != salt and not holds_exact_kv_only(src_salt):
        return set()
    bs = plan.block_size
    same = [s for s in plan.segments if s.delta == 0 and s.dst_start <= len(tokens)]
    if not same:
        return set()
    chain = chain_hashes(tokens[: max(s.dst_start for s in same)], bs, salt=src_salt)
    out: set[int] = set()
    for s in same:
        first = s.dst_start // bs
        if s.src_parent == (chain[first - 1] if first else root_hash(src_salt)):
            out.update(range(first, first + s.num_blocks))
    return out


def approximate_tokens(plan: SplicePlan, tokens: Sequence[int], salt: str | bytes | None) -> int:
    """Tokens whose KV ``plan`` loads approximately into a request of ``tokens`` under
    ``salt`` (every planned block but the exact ones of :func:`in_place_blocks`)."""
    planned = sum(s.num_blocks for s in plan.segments)
    return (planned - len(in_place_blocks(plan, tokens, salt))) * plan.block_size


def latest_per_block(devs: Sequence[BlockDeviation]) -> tuple[BlockDeviation, ...]:
    """One deviation per block (``dst_start``), the latest, in first-probed order: a
    request that vLLM preempted and recomputed probes its blocks again."""
    last = {d.dst_start: d for d in devs}
    return tuple(last.values()) if len(last) < len(devs) else tuple(devs)


def _as_token_list(tokens: Sequence[int], what: str) -> list[int]:
    """``tokens`` as a list of ints; a float, str or bool among them is an
    :class:`InputError` (``int()`` read 1.9 as token 1: two prompts that differ planned
    as one)."""
    try:
        out = list(tokens)
    except TypeError:
        raise InputError(f"{what} must be a sequence of token ids") from None
    ids = [_index(t) for t in out]  # numpy's and torch's ints as Python's
    bad = next((i for i, t in enumerate(ids) if t is None), None)
    if bad is not None:
        raise InputError(f"{what} must be a sequence of token ids (ints), got {out[bad]!r} at {bad}")
    return ids  # type: ignore[return-value]


def _index(value: Any) -> int | None:
    """``value`` as an int when it is one (``operator.index``: numpy's and torch's
    integers too), else ``None`` (a float, a str, a bool)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _ints(values: Any, n: int) -> tuple[int, ...] | None:
    """``values`` as ``n`` ints, ``None`` when they are not (``int()`` read 8.9 as 8)."""
    try:
        out = tuple(_index(v) for v in values)
    except TypeError:
        return None
    return out if len(out) == n and None not in out else None  # type: ignore[return-value]


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
    ends = _ints(span, 2)
    if ends is None:
        raise InputError(f"span must be (start, end) token positions (ints), got {span!r}")
    start, end = ends
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
    probe: bool = False,
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
    costs more than prefilling a block or two).  ``probe``: the recomputed blocks of
    each relocated run become probes of the request that computes them (the connector
    measures their deviation from the old KV).  A run's part inside the prompts' shared
    whole-block prefix is exact KV where it stands and never moved: the run starts where
    that prefix ends.  Raises :class:`InputError` when a run's tokens differ between the
    prompts or runs overlap.
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
    limit = cacheable_blocks(len(new), bs) * bs  # the last request computes at least one token
    old_chain: list[BlockHash] = []

    def parent(old_pos: int) -> BlockHash:
        if old_pos == 0:
            return root_hash(src)
        if not old_chain:
            old_chain.extend(chain_hashes(old[: round_down(len(old), bs)], bs, salt=src))
        return old_chain[old_pos // bs - 1]

    hit = 0
    while hit < min(len(old), len(new)) and old[hit] == new[hit]:
        hit += 1
    exact = round_down(hit, bs)  # whole blocks both prompts share at the same positions
    segs: list[SpliceSegment] = []
    probes: list[SpliceSegment] = []
    if load_prefix:
        if not _is_int(load_prefix) or load_prefix < 0 or load_prefix % bs:
            raise InputError(f"load_prefix must be a block multiple >= 0, got {load_prefix!r}")
        if new[:load_prefix] != old[:load_prefix]:
            raise InputError("load_prefix covers tokens on which the old and new prompts differ")
        n = min(load_prefix, limit) // bs
        if n:
            segs.append(SpliceSegment(0, n, 0, root_hash(src)))
    for i, run in enumerate(relocations):
        parts = _ints(run, 3)
        if parts is None:
            raise InputError(f"relocation {i} must be (old_start, old_end, delta) ints, got {run!r}")
        o_start, o_end, delta = parts
        if not 0 <= o_start <= o_end <= len(old) or not 0 <= o_start + delta <= o_end + delta <= len(new):
            raise InputError(f"relocation {i} {run!r} is outside the prompts ({len(old)} / {len(new)} tokens)")
        if delta % bs:
            continue  # not block-aligned in both prompts: computed
        if o_end + delta <= exact:
            continue  # all inside the exact prefix: its KV is exact where it stands
        # A run may begin inside that prefix (a moved message starting with the header
        # that stood there before): it starts where the exact blocks end, so it never
        # overlaps the prefix and its recompute starts at the edit.
        o_start = max(o_start, exact - delta)
        a = round_up(o_start + delta, bs) + recompute_blocks * bs
        e = min(round_down(o_end + delta, bs), limit)
        if e - a < bs:
            continue
        if new[a:e] != old[a - delta : e - delta]:
            raise InputError(f"relocation {i} {run!r}: the prompts differ inside the run")
        if segs and a < segs[-1].dst_start + segs[-1].num_blocks * bs:
            raise InputError(f"relocation {i} {run!r} overlaps the run before it (sort them, no overlaps)")
        segs.append(SpliceSegment(a, (e - a) // bs, delta, parent(a - delta)))
        a0 = a - recompute_blocks * bs
        if probe and recompute_blocks and new[a0:a] == old[a0 - delta : a - delta]:
            probes.append(SpliceSegment(a0, recompute_blocks, delta, parent(a0 - delta)))

    return plan_segment_phases(
        segs,
        len(new),
        block_size=bs,
        hit=exact,
        src_salt=src_salt,
        scope=scope,
        min_group_blocks=min_group_blocks,
        probes=probes,
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
    probes: Iterable[SpliceSegment] = (),
) -> list[SplicePhase]:
    """The requests that load ``segments`` (sorted, non-overlapping, inside a prompt of
    ``num_tokens`` tokens) and compute everything between them.

    ``hit``: the prefix-cache hit expected for the first request (a block multiple).
    Each maximal run of contiguous segments is one request that loads it right after
    its local hit and computes up to the next run; a first plain request computes what
    lies between ``hit`` and the first run.  A run that starts after 0 and moves fewer
    than ``min_group_blocks`` blocks is dropped (computed).  Shared by the agent's
    edits (:func:`plan_phases`) and position-independent chunk reuse
    (:mod:`promptsplice.engine_adapters.runners._rag`).  ``probes``: blocks computed
    right before a run (its recomputed blocks, ending where the run starts), attached
    to the request that computes them; probes of a dropped run are dropped.
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
    return _attach_probes(phases, probes, groups, hit)


def _attach_probes(
    phases: list[SplicePhase], probes: Iterable[SpliceSegment], groups: list[list[SpliceSegment]], hit: int
) -> list[SplicePhase]:
    """Each probe ending where a run starts goes into the request that computes it."""
    starts = {g[0].dst_start for g in groups}
    bs = phases[0].plan.block_size
    extra: dict[int, list[SpliceSegment]] = {}
    for p in probes:
        end = p.dst_start + p.num_blocks * bs
        if end not in starts:
            continue
        prev_end = hit
        for i, ph in enumerate(phases):
            lo = ph.plan.dst_end if ph.plan else prev_end
            if lo <= p.dst_start and end <= ph.end:
                extra.setdefault(i, []).append(p)
                break
            prev_end = ph.end
    out = []
    for i, ph in enumerate(phases):
        if i in extra:
            pl = ph.plan
            ph = SplicePhase(ph.end, replace(pl, probes=pl.probes + tuple(extra[i])))
        out.append(ph)
    return out


def extend_recompute(phase: SplicePhase, tokens: Sequence[int]) -> list[SplicePhase] | None:
    """Recompute one more block in front of ``phase``'s loaded run (the adaptive
    recompute: the last recomputed block still deviated too much).

    Returns the requests that replace ``phase``: one that computes the run's first
    block (a probe of it, so its deviation is measured in turn), then ``phase`` with
    the run starting one block later (its first segment's ``src_parent`` moves along
    the old chain).  When the run was that one block, a single plain request computes
    it all.  ``None`` when ``phase`` loads nothing.
    """
    plan = phase.plan
    if plan is None or not plan.segments:
        return None
    bs = plan.block_size
    seg = plan.segments[0]
    a = seg.dst_start
    blk = [int(t) for t in tokens[a : a + bs]]
    if len(blk) < bs:
        return None
    probe = SpliceSegment(a, 1, seg.delta, seg.src_parent)
    rest = plan.segments[1:]
    if seg.num_blocks > 1:
        moved = hash_block(BlockHash(seg.src_parent), blk)
        rest = (SpliceSegment(a + bs, seg.num_blocks - 1, seg.delta, bytes(moved)),) + rest
    if not rest:
        return [SplicePhase(phase.end, replace(plan, segments=(), probes=(probe,) + plan.probes))]
    return [
        SplicePhase(a + bs, replace(plan, segments=(), probes=(probe,))),
        SplicePhase(phase.end, replace(plan, segments=rest)),
    ]


def compute_run(phase: SplicePhase) -> list[SplicePhase] | None:
    """Compute ``phase``'s loaded run instead of loading it (the run-start guard of
    position-independent reuse: the run's recomputed blocks deviated too much from its
    stored KV, so none of it is trusted).  A phase loads one run, its segments
    contiguous behind its hit (chunks that continue each other included); the request
    that replaces it computes them all, probing what ``phase`` probed.  ``None`` when
    ``phase`` loads nothing.
    """
    plan = phase.plan
    if plan is None or not plan.segments:
        return None
    return [SplicePhase(phase.end, replace(plan, segments=()))]
