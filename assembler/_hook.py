"""The generic harness hook: ``hook(session_id, messages, tools=None)``.

An agent harness calls the hook with the full message list it is about to send.  The
hook applies the context policies, renders the result into block-aligned per-message
segments (:class:`~promptsplice.assembler.ChatRenderer`), diffs it against the session's previous
render (:func:`~promptsplice.assembler.diff_renders`) and returns the prepared context: token ids,
segment map, directives, and what kind of step this is (:class:`StepKind`).  It keeps
the last render of each session, bounded (LRU over sessions) and thread-safe.

A session is a (cache salt, session id) pair: the salt names the tenant, so two tenants
calling one hook with the same session id (a thread "1" each) keep separate sessions, and
neither ever sees the other's render (``PreparedContext.previous``) or resets the other's
diff.  A call under another salt than the session's earlier steps therefore starts (or
continues) that salt's own session: a ``NEW_SESSION`` step, a full prefill, while the
session under the old salt stays as it was.

Which steps fall back to a full prefill (``StepKind.FULL_PREFILL``, logged through
:mod:`logging`), never a wrong splice:

* ``SALT_CHANGED``: the previous render's cache salt differs from the new one, so none
  of the old KV is reachable under the new chain (sessions are kept per salt, so the
  hook itself no longer produces it: kept for callers that diff renders of their own);
* ``NO_OVERLAP``: no old token survives at all: nothing to splice.  A template whose
  messages share a header (ChatML's ``<|im_start|>``) keeps its first tokens, so a step
  that changed every message is an ``EDIT`` whose runs hold no whole block: the engine
  computes it as it would a full prefill;
* ``INVALID_DIFF``: the directives do not rebuild the new render from the old one
  exactly (a safety check that runs on every step; it should never trigger).

A different tools list or an edited system message is an ordinary edit (a directive).
An unknown (or evicted) session starts a new one: no directives, full prefill.
Steps of one session are serialized (a per-session lock), so every step's directives
are relative to the render that the session's previous step returned.  Rendering runs
outside every lock; a step in flight while its session is evicted completes against
the state it started with, and the session's next call starts a new one.
"""

from __future__ import annotations

import enum
import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from promptsplice.assembler._directives import Diff, Directive
from promptsplice.assembler._ordering import AlignPolicy
from promptsplice.assembler._policies import MessageEdit, PolicyResult
from promptsplice.assembler._render import ChatRenderer, ChatTemplate, MessageSegment, Render
from promptsplice._validate import check_block_size, check_int, check_messages, check_tenant_salt, check_text, check_tools
from promptsplice.errors import ConfigError, InputError, InvalidTextError

__all__ = ["StepKind", "FallbackReason", "PreparedContext", "ContextHook"]

logger = logging.getLogger(__name__)


class StepKind(enum.Enum):
    """What the engine has to do for a step."""

    NEW_SESSION = "new_session"
    """First render of the session (or the session was evicted): full prefill."""
    APPEND = "append"
    """The previous context is untouched: only the appended tokens are new."""
    EDIT = "edit"
    """Earlier context changed: carry out the directives (splice)."""
    FULL_PREFILL = "full_prefill"
    """The render cannot be spliced onto the session's state: full prefill."""


class FallbackReason(enum.Enum):
    SALT_CHANGED = "salt_changed"
    NO_OVERLAP = "no_overlap"
    INVALID_DIFF = "invalid_diff"


@dataclass(slots=True)
class PreparedContext:
    """What the hook returns for one step.

    ``render`` is the new render (token ids, segments, block hashes); ``diff`` is set
    for ``APPEND`` and ``EDIT`` steps (relative to ``previous``, the session's previous
    render); ``step`` counts the session's steps from 1.  ``messages`` is the list that
    was rendered (after the policies) and ``policy_edits`` what each policy changed in
    its input.
    """

    session_id: str
    step: int
    kind: StepKind
    render: Render
    messages: list[dict[str, Any]]
    diff: Diff | None = None
    previous: Render | None = None
    fallback: FallbackReason | None = None
    policy_edits: tuple[tuple[str, tuple[MessageEdit, ...]], ...] = field(default_factory=tuple)

    @property
    def token_ids(self) -> list[int]:
        return self.render.token_ids

    @property
    def segments(self) -> list[MessageSegment]:
        return self.render.segments

    @property
    def directives(self) -> tuple[Directive, ...]:
        return self.diff.directives if self.diff is not None else ()

    @property
    def is_append(self) -> bool:
        return self.kind is StepKind.APPEND

    @property
    def first_changed_token(self) -> int:
        """Where the previous render's tokens stop matching (0 without a usable diff)."""
        return self.diff.first_changed_token if self.diff is not None else 0


@dataclass(slots=True)
class _Session:
    lock: threading.Lock = field(default_factory=threading.Lock)
    render: Render | None = None
    steps: int = 0


PolicyLike = Any  # ContextPolicy or a callable messages -> PolicyResult
_HOOK_SALT: Any = object()  # last_render's default: the hook's own salt
_ANY_SALT: Any = object()  # forget's default: the session id under every salt
_EVICTED_IDS = 65_536  # evicted session ids remembered (~100 bytes each) at least


class ContextHook:
    """``hook(session_id, messages, tools=None)`` -> :class:`PreparedContext`.

    ``renderer`` is a :class:`ChatRenderer`, or what builds one: an
    :class:`~promptsplice.assembler.Assembler` (its tokenizer, token cache and block size), a
    tokenizer or a tokenizer spec, with ``block_size``, ``template`` and
    ``alignment`` (default ``all``: see :mod:`promptsplice.assembler._render`).  ``policies`` run in
    order on every step (objects with ``apply(messages) -> PolicyResult`` or such
    callables).  ``max_sessions`` bounds the sessions kept (least recently used
    evicted first): a session that comes back after it was evicted starts anew (a full
    prefill), counted in ``evicted_returns`` and logged as a warning (at the 1st, 2nd,
    4th, 8th, ... such step): raise ``max_sessions`` above the sessions in flight.
    ``salt`` is the default cache salt of every session; sessions are kept per (salt,
    session id), so tenants sharing a hook never share a session's state.
    """

    def __init__(
        self,
        renderer: Any = None,
        block_size: int | None = None,
        *,
        max_sessions: int = 1024,
        policies: Sequence[PolicyLike] = (),
        template: ChatTemplate | str | Path | None = None,
        alignment: str | AlignPolicy | None = None,
        salt: str | None = None,
    ) -> None:
        check_int(max_sessions, "max_sessions")
        if block_size is not None:
            check_block_size(block_size)
        salt = check_tenant_salt(salt, "salt")
        if isinstance(policies, str | bytes | Mapping) or not isinstance(policies, Sequence):
            raise ConfigError(f"policies must be a list of policies, got {type(policies).__name__}")
        if isinstance(renderer, ChatRenderer):
            if block_size is not None and block_size != renderer.block_size:
                raise ConfigError(f"block_size {block_size} differs from the renderer's {renderer.block_size}")
            if template is not None or alignment is not None:
                # the renderer has its own: taking it silently ignored what was asked for
                raise ConfigError(
                    "template and alignment belong to the ChatRenderer given as renderer: build it "
                    "with them (ChatRenderer(tokenizer, template=..., alignment=...)), or pass the tokenizer"
                )
            self.renderer = renderer
        else:
            self.renderer = ChatRenderer(
                renderer, block_size=block_size, template=template, alignment="all" if alignment is None else alignment
            )
        for p in policies:
            if isinstance(p, type) and inspect.isfunction(inspect.getattr_static(p, "apply", None)):
                # a class whose apply needs an instance: each step then failed
                raise ConfigError(f"policies holds the class {p.__name__}: pass an instance, {p.__name__}(...)")
            if not (hasattr(p, "apply") or callable(p)):
                raise ConfigError(f"a policy must have apply(messages) or be callable, got {p!r}")
        self.policies = list(policies)
        self.max_sessions = max_sessions
        self.salt = salt
        # keyed by (salt, session id): a tenant's session never serves another tenant
        self._sessions: OrderedDict[tuple[str | None, str], _Session] = OrderedDict()
        # The keys evicted last (at least 65,536 of them): N sessions taking turns over
        # max_sessions slots are each remembered until they return, however large N.
        self._evicted: OrderedDict[tuple[str | None, str], None] = OrderedDict()
        self._evicted_max = max(_EVICTED_IDS, 16 * max_sessions)
        self.evicted_returns = 0
        self._lock = threading.Lock()

    @property
    def block_size(self) -> int:
        return self.renderer.block_size

    # -- public --------------------------------------------------------------------
    def __call__(
        self,
        session_id: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        salt: str | None = None,
    ) -> PreparedContext:
        """Prepare one step of ``session_id`` (see the module docstring)."""
        check_text(session_id, "session_id")
        if not session_id:
            # (an empty id is what a harness sends when it has none: every conversation
            # would share one session, each one's render diffed against another's)
            raise InvalidTextError("session_id must be a non-empty str: pass each conversation's own id")
        salt = self.salt if check_tenant_salt(salt, "salt") is None else salt
        check_messages(messages, allow_empty=False)
        tools = check_tools(tools)
        msgs, edits = self._apply_policies(messages)
        # Rendering needs no session state: done outside the session's lock.
        new = self.renderer.render(msgs, tools, salt=salt)
        session = self._session((salt, session_id))
        with session.lock:
            prev = session.render
            session.steps += 1
            step = session.steps
            session.render = new
        # The previous render is immutable once stored: diff outside the lock.
        ctx = PreparedContext(session_id, step, StepKind.NEW_SESSION, new, msgs, previous=prev, policy_edits=edits)
        if prev is None:
            return ctx
        self._classify(ctx, prev, new)
        return ctx

    def last_render(self, session_id: str, *, salt: Any = _HOOK_SALT) -> Render | None:
        """The session's last render under ``salt`` (default: the hook's ``salt``);
        ``None`` for an unknown session."""
        key = (self.salt if salt is _HOOK_SALT else salt, session_id)
        with self._lock:
            s = self._sessions.get(key)
        return None if s is None else s.render

    def forget(self, session_id: str, *, salt: Any = _ANY_SALT) -> bool:
        """Drop a session's state (by default under every salt; with ``salt=`` only that
        salt's); ``True`` if one existed."""
        with self._lock:
            if salt is _ANY_SALT:
                keys = [k for k in self._sessions if k[1] == session_id]
                for k in [k for k in self._evicted if k[1] == session_id]:
                    del self._evicted[k]
            else:
                keys = [(salt, session_id)]
                self._evicted.pop((salt, session_id), None)
            return sum(self._sessions.pop(k, None) is not None for k in keys) > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        """Whether a session of that id is kept (under any salt)."""
        with self._lock:
            return any(k[1] == session_id for k in self._sessions)

    # -- internals -----------------------------------------------------------------
    def _session(self, key: tuple[str | None, str]) -> _Session:
        session_id = key[1]
        with self._lock:
            s = self._sessions.get(key)
            if s is None:
                s = self._sessions[key] = _Session()
                if self._evicted.pop(key, 0) is None:
                    self.evicted_returns += 1
                    n = self.evicted_returns
                    if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: loud, never a flood
                        logger.warning(
                            "context hook: session %r came back after it was evicted, so its step is a full "
                            "prefill (%d such steps so far); raise max_sessions (%d) above the sessions in flight",
                            session_id, n, self.max_sessions,
                        )  # fmt: skip
                while len(self._sessions) > self.max_sessions:
                    old_key, _ = self._sessions.popitem(last=False)
                    logger.debug("context hook: evicted session %r (max_sessions=%d)", old_key[1], self.max_sessions)
                    self._evicted[old_key] = None
                    if len(self._evicted) > self._evicted_max:
                        self._evicted.popitem(last=False)
            else:
                self._sessions.move_to_end(key)
            return s

    def _apply_policies(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[dict[str, Any]], tuple[tuple[str, tuple[MessageEdit, ...]], ...]]:
        cur: Sequence[Mapping[str, Any]] = messages
        edits: list[tuple[str, tuple[MessageEdit, ...]]] = []
        for p in self.policies:
            fn: Callable[[Any], Any] = p.apply if hasattr(p, "apply") else p
            res = fn(cur)
            if not isinstance(res, PolicyResult):
                try:
                    if not (isinstance(res, tuple) and len(res) == 2):
                        raise TypeError
                    res = PolicyResult(list(res[0]), tuple(res[1]))
                except TypeError:
                    raise ConfigError(
                        f"policy {p!r} must return a PolicyResult (or a (messages, edits) pair of "
                        f"sequences), got {res!r:.80}"
                    ) from None
            if not all(isinstance(e, MessageEdit) for e in res.edits):
                raise ConfigError(f"policy {p!r} returned edits that are not MessageEdit records: {res.edits!r:.80}")
            if res.edits:
                edits.append((_policy_name(p), res.edits))
            cur = res.messages
        return list(cur), tuple(edits)

    def _classify(self, ctx: PreparedContext, prev: Render, new: Render) -> None:
        sid = ctx.session_id
        if prev.salt != new.salt:
            self._fallback(ctx, FallbackReason.SALT_CHANGED, "the cache salt changed")
            return
        try:
            diff = self.renderer.diff(prev, new)
            ok = diff.apply(prev.token_ids) == new.token_ids
        except InputError as exc:  # DirectiveError: should not happen, never splice then
            logger.warning("context hook: session %r step %d: invalid directives (%s)", sid, ctx.step, exc)
            ok = False
        if not ok:
            self._fallback(ctx, FallbackReason.INVALID_DIFF, "the directives do not rebuild the new render")
            return
        kept = diff.first_changed_token + sum(r.length for r in diff.relocations)
        if diff.directives and kept == 0:
            self._fallback(ctx, FallbackReason.NO_OVERLAP, "no token of the previous render survives")
            return
        ctx.diff = diff
        ctx.kind = StepKind.APPEND if diff.is_append else StepKind.EDIT

    @staticmethod
    def _fallback(ctx: PreparedContext, reason: FallbackReason, why: str) -> None:
        ctx.kind = StepKind.FULL_PREFILL
        ctx.fallback = reason
        level = logging.WARNING if reason is FallbackReason.INVALID_DIFF else logging.INFO
        logger.log(level, "context hook: session %r step %d: full prefill (%s: %s)", ctx.session_id, ctx.step, reason.value, why)

    def __repr__(self) -> str:
        return f"ContextHook(block_size={self.block_size}, sessions={len(self)}/{self.max_sessions})"


def _policy_name(policy: Any) -> str:
    """How a step's ``policy_edits`` name ``policy``: its ``name``, a function's own
    name, else its class's (until 2026-12-08 every plain function read ``"function"``)."""
    name = getattr(policy, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(policy, "__name__", None) or type(policy).__name__
