"""Agent steps on an engine: carry out a render's edit directives.

The engine is an :class:`~promptsplice.engine_adapters.EmbeddedEngine` or a
:class:`~promptsplice.engine_adapters.RemoteEngine` over a ``vllm serve`` that loads the
splice connector: one code path, through the surface both have (``block_size``,
``can_splice``, ``generate_phases``: :mod:`~promptsplice.engine_adapters._served_engine`).

:class:`AgentRunner` takes the hook's :class:`~promptsplice.assembler.PreparedContext` for each step
of an agent session and runs it in one of three modes:

* ``full``: no cache at all (every request gets a fresh salt): the reference.
* ``apc``: vLLM's prefix caching only: after an edit everything behind it is prefilled.
* ``splice``: the unchanged prefix hits the prefix cache, the replacements and the first
  ``recompute_blocks`` blocks after each edit are prefilled, the unchanged runs behind
  them are *relocated* from the block store by the splice connector (keys re-rotated by
  their position delta), and only the new tail is computed.  Runs separated by computed
  tokens need one request each (:func:`~promptsplice.engine_adapters.connector._plans.plan_phases`); a run
  too short to pay for its request is computed.  New messages identical to one of the
  previous render (a repeated call's output) are relocated from there too
  (``reuse_repeats``), on append steps as well.

**Scope of spliced KV.**  Relocated KV is approximate (its deep layers attended to the
old context), and vLLM files the blocks it loads in its prefix cache under the new
prompt's hashes, where any request with the same tokens and salt would reuse them.  A
per-session ``cache_salt`` from the first step would keep that in the session but also
stop sessions from sharing the system prompt and tool schemas (the salt enters the
first block).  Here a session keeps the tenant's salt, sharing everything exact, until
its first edit; from then on its requests use a *scope salt* of its own
(``scope="session"``).  That first scoped request loads the unchanged prefix from the
store (exact blocks, stored under the tenant's salt, copied without rotation) instead
of hitting the prefix cache, and the scope keeps every block it loads or computes, so
the session's later edits relocate them again.  Requests outside the session never
meet spliced KV: they do not know the scope salt (a caller opts in with
:meth:`AgentRunner.session_salt`).  The cost: one store copy of the prefix per session
at its first edit, and the prefix cached twice in vLLM (tenant + scope).
``scope="none"`` keeps the tenant's salt (spliced KV is then shared with any request
of the same tokens: for measurements only; a step there at a relocating level reports
that level even when it relocated nothing itself).

Fallbacks, never a wrong splice: a step whose previous render is not what this runner
last sent for the session (another runner, a restart), or whose hook step is a
``FULL_PREFILL``, is sent as a plain request (the prefix cache still serves whatever
matches exactly), and the reason is logged and kept in :attr:`AgentStep.fallback`
(a :class:`~promptsplice.engine_adapters.runners.StepFallback`; a ``FULL_PREFILL`` says
so at every fidelity level).  A ``NEW_SESSION`` step for a session the runner knows (a
restarted harness, a session the hook evicted) starts it afresh: the tenant's salt, out
of its old scope, whose KV may be approximate.

**Fidelity** (:mod:`~promptsplice.engine_adapters.runners._fidelity`): ``fidelity`` on the
runner (default ``exact``: approximate KV is opt-in) or per step picks the recompute (``recompute_blocks``
overrides the level's).  At ``exact`` a splice runner relocates nothing: the step runs
as one plain request under a salt whose cache holds exact blocks only (the tenant's
salt with ``scope="session"``, whose spliced KV lives under scope salts; a salt of its
own with ``scope="none"``), and a scoped session starts a new scope at its next edit.
Every step says what it relocated (``relocated_tokens``, measured by the connector, and
``planned_relocated_tokens``, the plan's), what it computed that could have been
relocated (``recomputed_tokens``) and at which level (``fidelity``).

Kept as one module (~600 lines): a step's salt, scope and plan, and what its session
keeps (last tokens, scope, the weakest settings the scope served), are decided under the
session's lock on the session's state; the pure planning lives in
:mod:`~promptsplice.engine_adapters.connector._plans` and
:mod:`~promptsplice.engine_adapters.runners._steps`.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import math
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from promptsplice.assembler import PreparedContext, StepKind
from promptsplice.engine_adapters._requests import check_sampling
from promptsplice.engine_adapters.connector._plans import SAME_SALT, SplicePhase, plan_phases
from promptsplice.engine_adapters.runners._fidelity import (
    DEFAULT_FIDELITY,
    FIDELITY_TABLE,
    FidelityLevel,
    FidelitySettings,
    RunnerFidelity,
    step_level,
)
from promptsplice.engine_adapters.runners._steps import (
    AdaptiveRecompute,
    RunnerEngine,
    StepFallback,
    cached_tokens,
    check_runner_engine,
    planned_relocated_tokens,
)
from promptsplice.blocks import round_down
from promptsplice._validate import (
    DERIVED_SALT_MARK, EXACT_SALT_TAG, check_bool, check_derived_salt_room, check_enum, check_int, check_tenant_salt, check_text,
)
from promptsplice.errors import ConfigError, InputError, InvalidSaltError

if TYPE_CHECKING:
    from promptsplice.engine_adapters._embedded import Completion

__all__ = ["AgentMode", "AgentRunner", "AgentStep", "DEFAULT_RECOMPUTE_BLOCKS"]

_log = logging.getLogger(__name__)

DEFAULT_RECOMPUTE_BLOCKS = FIDELITY_TABLE[FidelityLevel.BOUNDED].recompute_blocks
"""Blocks recomputed after each edit in ``splice`` mode at ``bounded`` fidelity."""
DEFAULT_MIN_GROUP_BLOCKS = 1
"""A run of relocated blocks that needs a request of its own must move at least this
many blocks.  Measured here (SmolLM2 on 2 CPU cores, 1,024 cached tokens): one more
request costs 24 ms, the prefill of 22 tokens (1.1 ms a token); loading a block costs
~0.6 ms; so one relocated block (32 tokens, 36 ms) already pays for its request."""


def _repeat_runs(prepared: PreparedContext, runs: list[Any]) -> list[tuple[int, int, int]]:
    """Relocations for new messages identical to a message of the previous render (an
    agent repeating a call gets the same output): whole segments, moved from where the
    old render had them.  Only after the diff's own runs, so the runs stay sorted."""
    prev, new, diff = prepared.previous, prepared.render, prepared.diff
    if prev is None or diff is None:
        return []
    old_segs: dict[tuple[bytes, int], Any] = {}
    for seg in prev.body_segments:
        old_segs.setdefault((seg.key, seg.padding), seg)
    pos = runs[-1][1] + runs[-1][2] if runs else diff.base + diff.delta
    out: list[tuple[int, int, int]] = []
    for seg in new.segments:
        if seg.start < pos:
            continue
        old = old_segs.get((seg.key, seg.padding))
        if old is not None and old.end - old.start == seg.end - seg.start:
            out.append((old.start, old.end, seg.start - old.start))
            pos = seg.end
    return out


class AgentMode(enum.Enum):
    FULL = "full"
    APC = "apc"
    SPLICE = "splice"


@dataclass(slots=True)
class AgentStep:
    """What one step cost and returned.

    Token counts cover every request of the step (a splice may take several) and mean
    what they mean on ``RagStep`` (:mod:`~promptsplice.engine_adapters.runners._steps`):
    ``prefill_tokens`` computed, ``cached_tokens = prompt_tokens - prefill_tokens`` not
    computed (vLLM's ``num_cached_tokens``: its prefix cache plus connector loads), of
    which ``relocated_tokens`` were loaded with re-rotated keys.  ``ttft_s`` runs from
    the step's start (its planning included, as a RAG step's; the plans made only for
    the record excluded) to the final request's first token (until 2026-12-07 from its
    first request: splice's planning, which apc and full do not do, was left out).
    """

    session_id: str
    step: int
    kind: StepKind
    mode: AgentMode
    completion: Completion
    prompt_tokens: int
    prefill_tokens: int
    cached_tokens: int
    relocated_tokens: int
    requests: int
    ttft_s: float
    wall_s: float
    salt: str | None
    """The ``cache_salt`` of the final request (a caller reusing this context uses it)."""
    fallback: StepFallback | None = None
    """Why the step was sent as a plain request (``None``: as planned)."""
    deviations: tuple[float, ...] = ()
    """With a deviation threshold: each probed (recomputed) block's deviation from its
    relocated old KV (``BlockDeviation.value``), in the order measured."""
    extra_recompute_blocks: int = 0
    """Blocks recomputed beyond ``recompute_blocks`` because a deviation exceeded
    the threshold."""
    fidelity: FidelityLevel = FidelityLevel.EXACT
    """The level the step ran at: ``exact`` when its plan relocated nothing under the
    tenant's own salt (``full``/``apc``, a new session, a fallback; :func:`step_level`);
    a step under the session's scope salt keeps the asked level (its cache may hold
    relocated KV), and so does every ``splice`` step at a relocating level with
    ``scope="none"`` (relocated KV then lives under the tenant's salt itself)."""
    planned_relocated_tokens: int = 0
    """Tokens the step's plan relocates; ``relocated_tokens`` below it means the store
    did not serve some of them (they were computed: exact)."""
    recomputed_tokens: int = 0
    """Tokens computed for fidelity that the plan could have relocated (the recompute
    after each edit; at ``exact``, everything relocatable that vLLM's cache did not
    serve); at most ``prefill_tokens``."""
    changed_share: float = 0.0
    """The largest :meth:`~promptsplice.assembler.Diff.changed_share` over the edit's
    relocatable runs, whether or not the step relocated them (0 without a diff or runs:
    new sessions, full prefills, plain appends): reported, not acted on (it did not rank
    first-token KL on the calibration traces; README, agent section)."""

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.prefill_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class _Session:
    lock: threading.Lock = field(default_factory=threading.Lock)
    tokens: array | None = None
    """What the last step sent, 4 bytes a token (a list of ints took ~36: 300 MB for
    1,024 sessions of 8K tokens)."""
    salt: str | None = None
    scoped: bool = False
    kv_salt: str | None = None
    """The salt the last step's KV was computed under (differs from ``salt`` after an
    ``exact`` step under another salt)."""
    served: tuple[int, float] | None = None
    """The weakest settings the session's scope has relocated at: the fewest
    ``recompute_blocks`` and the largest ``max_deviation`` (infinity: none); a step that
    asks stricter ones leaves the scope (its cache holds that KV)."""
    busy: int = 0
    """Steps holding or waiting for this session (under the runner's lock): the LRU bound
    never evicts a session while a step uses it."""
    forgotten: bool = False
    """:meth:`AgentRunner.forget` while a step used it: the next step starts it afresh
    (under the session's lock, so steps of one session stay serialized)."""


def _weakest(served: tuple[int, float] | None, cfg: FidelitySettings) -> tuple[int, float]:
    """``served`` (see ``_Session.served``) after a step at ``cfg`` ran in the scope."""
    dev = math.inf if cfg.max_deviation is None else cfg.max_deviation
    return (cfg.recompute_blocks, dev) if served is None else (min(served[0], cfg.recompute_blocks), max(served[1], dev))


def _covers(served: tuple[int, float] | None, cfg: FidelitySettings) -> bool:
    """Whether a scope that relocated at ``served`` is as strict as ``cfg`` asks."""
    if served is None:
        return True
    dev = math.inf if cfg.max_deviation is None else cfg.max_deviation
    return served[0] >= cfg.recompute_blocks and served[1] <= dev


class AgentRunner:
    """Runs agent steps on an :class:`~promptsplice.engine_adapters.EmbeddedEngine` or a
    :class:`~promptsplice.engine_adapters.RemoteEngine` (see the module doc).

    ``mode``: ``"full"``, ``"apc"`` or ``"splice"`` (needs an engine started with
    ``kv_store``).  ``salt``: the tenant's ``cache_salt``.  ``fidelity``: ``"exact"`` (default),
    ``"bounded"`` or ``"fast"`` (module doc), per step too.
    ``recompute_blocks``: blocks prefilled after each edit before relocation resumes
    (``None``: the fidelity level's).  ``scope``: ``"session"``
    (default) or ``"none"``.  Sessions are kept LRU-bounded (``max_sessions``); steps of
    one session are serialized.  ``max_deviation`` (``None``: the fidelity level's):
    while the last recomputed block in front of a relocated run deviates from its old KV
    by more than this (``BlockDeviation.value``, measured by the connector), the next
    block is recomputed too (one more request), up to the run's end (a served engine
    returns the measurements in the connector's acks).  ``recompute_tail_blocks``: the last blocks of the step's last relocated run
    (next to the query) are computed too (measured: it barely moved first-token KL on
    the coding family, README "Fidelity"; 0 by default).
    """

    def __init__(
        self,
        engine: RunnerEngine,
        *,
        mode: str | AgentMode = AgentMode.SPLICE,
        salt: str | None = None,
        recompute_blocks: int | None = None,
        scope: str = "session",
        max_sessions: int = 1024,
        reuse_repeats: bool = True,
        min_group_blocks: int = DEFAULT_MIN_GROUP_BLOCKS,
        max_deviation: float | None = None,
        fidelity: str | FidelityLevel = DEFAULT_FIDELITY,
        recompute_tail_blocks: int = 0,
    ) -> None:
        check_runner_engine(engine, "AgentRunner")
        self.mode = check_enum(mode, AgentMode, "mode")
        self.recompute_tail_blocks = recompute_tail_blocks
        if self.mode is AgentMode.SPLICE and not engine.can_splice:
            raise ConfigError(
                "splice mode needs the splice connector: start the engine with "
                "EngineConfig(kv_store=StoreConfig(...)), or the server with "
                "--kv-transfer-config kv_transfer_config_json(StoreConfig(...))"
            )
        if self.mode is not AgentMode.SPLICE:  # options of splicing: taken, then ignored (review)
            given = [name for name, value, default in (
                ("scope", scope, "session"), ("reuse_repeats", reuse_repeats, True),
                ("min_group_blocks", min_group_blocks, DEFAULT_MIN_GROUP_BLOCKS)) if value != default]
            if given:
                raise ConfigError(
                    f"AgentRunner(mode={self.mode.value!r}) takes no {', '.join(given)}: they shape "
                    "splicing; pass mode='splice' or leave them out"
                )
        self._fidelity = RunnerFidelity(
            fidelity, recompute_blocks=recompute_blocks, max_deviation=max_deviation,
            recompute_tail_blocks=recompute_tail_blocks,
            relocating_mode=None if self.mode is AgentMode.SPLICE else self.mode.value,
        )
        self.fidelity = self._fidelity.level
        if scope not in ("session", "none"):
            raise ConfigError(f"scope must be 'session' or 'none', got {scope!r}")
        check_derived_salt_room(check_tenant_salt(salt, "salt"), "salt")  # scope/exact salts derive from it
        check_int(max_sessions, "max_sessions")
        self.engine = engine
        self.salt = salt
        default = self.settings(self.fidelity)
        self.recompute_blocks = default.recompute_blocks
        self.max_deviation = default.max_deviation
        self.scope = scope
        self.max_sessions = max_sessions
        self.reuse_repeats = check_bool(reuse_repeats, "reuse_repeats")
        check_int(min_group_blocks, "min_group_blocks")
        self.min_group_blocks = min_group_blocks
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()

    def settings(self, fidelity: str | FidelityLevel | None = None) -> FidelitySettings:
        """The settings a step at ``fidelity`` (default: the runner's) runs with."""
        return self._fidelity.settings(fidelity)

    def _scope_salt(self, session_id: str) -> str:
        """A new scope salt for the session: the tenant's salt (what ``salt_tenant`` reads),
        the mark and a fixed-length tag, a digest of the session id and a random part, so
        it stays within vLLM's ``cache_salt`` rule (no ``@``, ``/``, ``\\``; 128 characters
        at most: ``check_derived_salt_room``) whatever the session id, and never shows the
        id in KV events or logs."""
        digest = hashlib.sha256(f"{session_id}\0{uuid.uuid4().hex}".encode("utf-8", "surrogatepass")).hexdigest()
        return f"{self.salt or ''}{DERIVED_SALT_MARK}splice-scope:{digest[:32]}"

    def _exact_salt(self) -> str | None:
        """A salt whose cache holds exact blocks only (module doc)."""
        return self.salt if self.scope == "session" else f"{self.salt or ''}{DERIVED_SALT_MARK}{EXACT_SALT_TAG}"

    # -- sessions -------------------------------------------------------------------
    @contextlib.contextmanager
    def _held(self, session_id: str) -> Iterator[_Session]:
        """The session, counted busy for the ``with`` block (a step's whole run)."""
        st = self._session(session_id)
        try:
            yield st
        finally:
            with self._lock:
                st.busy -= 1

    def _session(self, session_id: str) -> _Session:
        with self._lock:
            st = self._sessions.get(session_id)
            if st is None:
                st = self._sessions[session_id] = _Session(salt=self.salt, kv_salt=self.salt)
                # the least recent sessions no step uses (one evicted mid-step lost its
                # state, and the session's next step ran beside it unserialized)
                idle = (k for k, v in self._sessions.items() if not v.busy and k != session_id)
                for victim in [next(idle, None) for _ in range(len(self._sessions) - self.max_sessions)]:
                    if victim is None:
                        break  # every other session is in a step: over the bound until they end
                    del self._sessions[victim]
            else:
                self._sessions.move_to_end(session_id)
            st.busy += 1
            return st

    def session_salt(self, session_id: str) -> str | None:
        """The salt that reaches the session's KV (its scope salt once it spliced):
        the explicit opt-in for a request outside the session."""
        check_text(session_id, "session_id")
        with self._lock:
            st = self._sessions.get(session_id)
        # kv_salt: the salt the last step ran under (an exact step's own salt with
        # scope="none"; st.salt went back to the tenant's there)
        return self.salt if st is None else (st.kv_salt if st.kv_salt is not None else st.salt)

    def forget(self, session_id: str) -> bool:
        """Drop the session's state (its next step starts it afresh); False if unknown.
        A session a step is using stays until the step ends (it was removed, and its
        next step ran beside the one in flight, unserialized)."""
        check_text(session_id, "session_id")
        with self._lock:
            st = self._sessions.get(session_id)
            if st is None:
                return False
            if st.busy:
                st.forgotten = True
            else:
                del self._sessions[session_id]
            return True

    # -- steps ----------------------------------------------------------------------
    def step(
        self,
        prepared: PreparedContext,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
        fidelity: str | FidelityLevel | None = None,
    ) -> AgentStep:
        """Run one step (``fidelity``: this step's level, default the runner's); raises
        what :meth:`EmbeddedEngine.generate` raises."""
        if not isinstance(prepared, PreparedContext):
            raise InputError(f"step takes the hook's PreparedContext, got {type(prepared).__name__}")
        rendered = prepared.render.salt
        if rendered is not None and rendered != self.salt:
            # as the engines, PrefixRouter and the chat model: one tenant's context never
            # runs under another's salt (or none)
            raise InvalidSaltError(
                f"the prepared context's salt {rendered!r} differs from the runner's salt {self.salt!r}: "
                "the runner sends every step under its own salt; give the ContextHook and the runner "
                "the same tenant salt (one runner per tenant)"
            )
        cfg = self.settings(fidelity)
        check_sampling(max_tokens, temperature, stop, logprobs)  # before any request of the step
        if self.mode is AgentMode.SPLICE and cfg.relocate and not self.engine.can_relocate:
            # every relocated block would be recomputed, in more requests than one plain
            # request, under a level that claims relocation
            raise ConfigError(
                f"fidelity={cfg.level.value!r} relocates KV, and this engine's splice connector cannot "
                "(its log says why: an unverified attention ISA or RoPE); use fidelity='exact'"
            )
        gen = {"max_tokens": max_tokens, "temperature": temperature, "stop": stop, "logprobs": logprobs}
        with self._held(prepared.session_id) as st, st.lock:
            # the step's TTFT runs from here: its planning counts, as a RAG request's does;
            # the plans made for the record only (``recomputed_tokens``) do not
            t0, record_s = time.perf_counter(), 0.0
            if st.forgotten:  # forget() ran while another step used the session
                st.tokens, st.salt, st.scoped, st.kv_salt, st.forgotten = None, self.salt, False, self.salt, False
                st.served = None
            new = list(prepared.token_ids)
            plain = [SplicePhase(len(new), None)]
            fallback, level, recomputed, stricter = None, cfg.level, 0, False
            if prepared.kind is StepKind.NEW_SESSION:
                # the hook starts the session afresh (a restarted harness, an evicted
                # session): so does the runner, under the tenant's salt, out of any scope
                st.salt, st.scoped, st.kv_salt, st.tokens, st.served = self.salt, False, self.salt, None, None
            elif prepared.kind is StepKind.FULL_PREFILL:
                fallback = StepFallback.HOOK_FULL_PREFILL  # at every level, exact included
            if self.mode is AgentMode.FULL:
                salt, phases, level = f"full:{uuid.uuid4().hex}", plain, FidelityLevel.EXACT
            elif self.mode is AgentMode.APC:
                salt, phases, level = st.salt, plain, FidelityLevel.EXACT
            elif not cfg.relocate or (stricter := st.scoped and not _covers(st.served, cfg)):
                # exact: what could be relocated is computed; so it is for a step stricter
                # than its scope has relocated at (a bounded step after fast ones: the
                # scope's cache holds their KV), which then leaves the scope
                if stricter and fallback is None:
                    fallback = StepFallback.STRICTER_THAN_SCOPE
                salt, phases = self._exact_salt(), plain
                if prepared.kind in (StepKind.EDIT, StepKind.APPEND):
                    t_dry = time.perf_counter()
                    dry_salt, dry, why = self._plan(st, prepared, new, 0, dry=True)
                    recomputed = planned_relocated_tokens(dry, new, dry_salt)
                    record_s += time.perf_counter() - t_dry
                    if why in (StepFallback.FOREIGN_RENDER, StepFallback.INVALID_PLAN) and fallback is None:
                        fallback = why  # reported and logged at every level (silent here before)
                        _log.warning("agent runner: session %s: %s; full prefill", prepared.session_id, why.value)
            elif prepared.kind not in (StepKind.EDIT, StepKind.APPEND):
                salt, phases = st.salt, plain
            else:
                salt, phases, fallback = self._plan(
                    st, prepared, new, cfg.recompute_blocks, probe=cfg.max_deviation is not None
                )
                if (cfg.recompute_blocks or self.recompute_tail_blocks) and fallback is None:
                    t_dry = time.perf_counter()
                    dry_salt, dry, _ = self._plan(st, prepared, new, 0, dry=True)
                    every = planned_relocated_tokens(dry, new, dry_salt)
                    recomputed = max(0, every - planned_relocated_tokens(phases, new, salt))
                    record_s += time.perf_counter() - t_dry
            result = self._run(prepared, new, salt, phases, gen, cfg.max_deviation, t0=t0 + record_s)
            result.fallback = fallback
            if prepared.diff is not None:  # a property of the edit, in every mode
                diff = prepared.diff
                result.changed_share = max((diff.changed_share(r) for r in diff.relocations), default=0.0)
            # blocks the deviation guard recomputed were relocatable too
            # (never more than the step computed: vLLM's cache may have served some of them)
            result.recomputed_tokens = min(
                result.prefill_tokens,
                recomputed + planned_relocated_tokens(phases, new, salt) - result.planned_relocated_tokens,
            )
            # scope="none" relocates under the tenant's salt: its cache may serve relocated
            # KV to any later step under it, plain ones included
            shared = self.mode is AgentMode.SPLICE and self.scope == "none" and cfg.relocate
            result.fidelity = step_level(
                level, result.planned_relocated_tokens, salt, salt_may_hold_relocated=shared
            )
            st.tokens = array("I", new)  # token ids are checked to fit 32 bits
            if self.mode is AgentMode.SPLICE and (not cfg.relocate or stricter):
                # The exact salt's KV is the session's now; a scoped session rescopes from it.
                st.salt, st.scoped, st.served = self.salt, False, None
            elif self.mode is not AgentMode.FULL:
                # a step under a scope salt opened the scope (only once it ran: a step that
                # raised leaves the session where it was, under the tenant's exact salt)
                opened = not st.scoped and self.scope == "session" and salt != self.salt
                st.salt, st.scoped = salt, st.scoped or opened
                if self.mode is AgentMode.SPLICE and (opened or (st.scoped and result.planned_relocated_tokens)):
                    st.served = _weakest(None if opened else st.served, cfg)
            st.kv_salt = salt if self.mode is not AgentMode.FULL else st.kv_salt
            return result

    def _plan(
        self,
        st: _Session,
        prepared: PreparedContext,
        new: list[int],
        recompute_blocks: int,
        dry: bool = False,
        probe: bool = False,
    ) -> tuple[str | None, list[SplicePhase], StepFallback | None]:
        """The step's salt and phases at ``recompute_blocks`` (``dry``: only to count what
        a plan would relocate; the session is left as it is)."""
        prev = prepared.previous
        old = list(prev.token_ids) if prev is not None else None
        plain = [SplicePhase(len(new), None)]
        if old is None or prepared.diff is None:
            return st.salt, plain, StepFallback.NO_PREVIOUS_RENDER
        # What was sent may extend the render (a chat model's forced tool-call prefix):
        # its KV then starts with the old render, which is all the plan reads.
        if st.tokens is None or st.tokens[: len(old)] != array("I", old):
            if not dry:
                why = "the session's previous render is not what this runner sent last"
                _log.warning("agent runner: session %s: %s; full prefill", prepared.session_id, why)
            return st.salt, plain, StepFallback.FOREIGN_RENDER
        bs = self.engine.block_size
        # The prompts' whole blocks before the first changed token are the same tokens at
        # the same positions: exact KV (the prefix cache's, or loaded as ``load_prefix``).
        same = round_down(prepared.first_changed_token, bs)
        scope_now = self.scope == "session" and not st.scoped
        salt, src_salt, load_prefix = st.salt, SAME_SALT, 0
        if scope_now:
            salt = self._scope_salt(prepared.session_id)
            src_salt = st.kv_salt
            load_prefix = same
        elif st.kv_salt != salt:  # the last step ran exact under a salt of its own
            src_salt = st.kv_salt
            load_prefix = same
        runs = list(prepared.diff.relocations)
        if self.reuse_repeats:
            runs += _repeat_runs(prepared, runs)
        tail = self.recompute_tail_blocks * bs
        # the last run past the exact prefix (the planner never moves a run's part inside it)
        last = max((i for i, (_, e, d) in enumerate(runs) if e + d > same), default=None)
        if tail and last is not None and not dry:
            s0, e0, d0 = runs[last]
            runs[last] = (s0, max(s0, e0 - tail), d0)
        if prepared.kind is StepKind.APPEND and not runs:
            return st.salt, plain, None
        try:
            phases = plan_phases(
                old,
                new,
                runs,
                block_size=bs,
                recompute_blocks=recompute_blocks,
                salt=salt,
                src_salt=src_salt,
                load_prefix=load_prefix,
                # never a scope under the tenant's own salt: that keeps exact KV only
                scope=self.scope == "session" and salt != self.salt,
                min_group_blocks=self.min_group_blocks,
                probe=probe,
            )
        except InputError as exc:  # a diff that does not fit the tokens: never splice it
            if not dry:
                _log.warning("agent runner: session %s: %s; full prefill", prepared.session_id, exc)
            return st.salt, plain, StepFallback.INVALID_PLAN
        if prepared.kind is StepKind.APPEND and not any(ph.plan for ph in phases):
            return st.salt, plain, None  # nothing to move: a plain request, no scope needed
        if scope_now and not planned_relocated_tokens(phases, new, salt):
            # only the prefix load (exact) is planned: opening a scope for it left the
            # tenant's prefix cache for a store copy, and the session out of it for good
            return st.salt, plain, None
        return salt, phases, None  # a new scope salt opens the scope once the step ran

    def _run(
        self,
        prepared: PreparedContext,
        new: list[int],
        salt: str | None,
        phases: list[SplicePhase],
        gen: dict[str, Any],
        max_deviation: float | None = None,
        *,
        t0: float | None = None,
    ) -> AgentStep:
        """Send the step's phases; its TTFT and wall time run from ``t0`` (default: now)."""
        t0 = time.perf_counter() if t0 is None else t0
        adapt = None
        if max_deviation is not None and len(phases) > 1:
            adapt = AdaptiveRecompute(max_deviation, new)
        run = self.engine.generate_phases(new, phases, cache_salt=salt, adapt=adapt, **gen)
        out, t_last, relocated = run.completions[-1], run.t_last, run.relocated_tokens
        prefill = sum(o.prefill_tokens for o in run.completions)
        wall = time.perf_counter() - t0
        return AgentStep(
            session_id=prepared.session_id,
            step=prepared.step,
            kind=prepared.kind,
            mode=self.mode,
            completion=out,
            prompt_tokens=len(new),
            prefill_tokens=prefill,
            cached_tokens=cached_tokens(len(new), prefill),
            relocated_tokens=relocated,
            requests=len(run.completions),
            ttft_s=(t_last - t0) + out.ttft_s,
            wall_s=wall,
            salt=salt,
            deviations=tuple(d.value for d in run.deviations),
            extra_recompute_blocks=adapt.extra if adapt is not None else 0,
            planned_relocated_tokens=planned_relocated_tokens(run.phases, new, salt),
        )

    def __repr__(self) -> str:
        return (
            f"AgentRunner(mode={self.mode.value!r}, fidelity={self.fidelity.value!r}, "
            f"recompute_blocks={self.recompute_blocks}, max_deviation={self.max_deviation}, "
            f"scope={self.scope!r}, sessions={len(self._sessions)})"
        )
