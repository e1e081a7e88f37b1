"""The hand-off of prepared contexts from the harness hooks to the chat model.

A hook (:mod:`promptsplice.engine_adapters.integrations._hooks`) runs the
:class:`~promptsplice.assembler.ContextHook` before the framework calls the model and puts
the :class:`~promptsplice.assembler.PreparedContext` here, per session;
:class:`~promptsplice.engine_adapters.integrations._langchain_chat.PromptspliceChatModel`
takes it when its own render of the messages it received has the same token ids and the
same cache salt, and so sends exactly the hook's ids (and directives).  Entries are kept per
(session id, salt): the hand-off is process-wide, and two tenants' threads may share an id
(a LangGraph thread "1" each) and opening messages; a model never takes a context another
salt rendered (it would send that tenant's blocks under that tenant's salt).  Its own module because both sides use
it and neither should import the other for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from promptsplice.assembler import PreparedContext, Render
from promptsplice.errors import InvalidSaltError

__all__ = ["handoff", "RETRY_WINDOW_S"]

RETRY_WINDOW_S = 300.0
"""How long a taken context waits for a retry of its call (LangChain's retries back off
for seconds, not minutes); after it, its salt no longer names the session."""

logger = logging.getLogger(__name__)


class _Handoff:
    """The last :class:`PreparedContext` a harness hook made per (session, salt), for the
    chat model to pick up (bounded LRU, thread-safe).  The model takes it only when its
    own render of the messages it received has the same salt and token ids, so a stale
    or foreign entry (another tenant's) is never sent."""

    def __init__(self, max_sessions: int = 1024) -> None:
        self._items: OrderedDict[tuple[str, str | None], PreparedContext] = OrderedDict()
        self._taken: OrderedDict[tuple[str, str | None], tuple[PreparedContext, float]] = OrderedDict()
        """Per (session, salt), the context a model took and has not yet answered (with
        when): a retry of that call (``with_retry``, a node's retry policy) finds it and
        its salt (until 2026-12-07 the retry found nothing and went out unsalted).  A
        taken salt counts as a pending one in :meth:`salt_of`, so two tenants' calls on
        one session id stay an :class:`InvalidSaltError`, never one sent under the
        other's salt; :meth:`settle` drops it once the model answered, and it lapses
        after :data:`RETRY_WINDOW_S`."""
        self._lock = threading.Lock()
        self._max = max_sessions

    def put(self, prepared: PreparedContext) -> None:
        with self._lock:
            key = (prepared.session_id, prepared.render.salt)
            self._items[key] = prepared
            self._items.move_to_end(key)
            self._taken.pop(key, None)  # a new step of the session: no retry of the last
            while len(self._items) > self._max:
                self._items.popitem(last=False)

    def salt_of(self, session_id: str) -> str | None:
        """The salt a hook prepared ``session_id`` under (``None``: no entry, or one
        unsalted), for a model without a salt of its own: it renders under it, and a
        render that then differs from the hook's is an :class:`InvalidSaltError` (a
        mismatch sent the hook's tenant unsalted).  Two or more salts are an
        :class:`InvalidSaltError`, as in :meth:`take`."""
        with self._lock:
            self._expire()
            salts = {k[1] for k in self._items if k[0] == session_id}
            salts |= {k[1] for k in self._taken if k[0] == session_id}  # a call not answered yet
        if len(salts) > 1:
            raise InvalidSaltError(
                f"hooks of {len(salts)} salts prepared session {session_id!r} for a model "
                "with no cache_salt: which tenant's call this is cannot be told; give the "
                "model (or the call) cache_salt=<the tenant's salt>"
            )
        return next(iter(salts), None)

    def take(self, session_id: str, render: Render) -> PreparedContext | None:
        """The session's prepared context when its salt and tokens are ``render``'s (the
        model's own render of what it received, under the salt its request goes out with:
        for a model without a salt of its own, the one :meth:`salt_of` names).  An entry
        of another salt is another tenant's: left where it is, ``None``.

        A token mismatch is logged and the model renders anew; a hook rendering other
        blocks than the engine caches is named with its fix (the entry may come from a
        hook in front of another model, so it is no error)."""
        key = (session_id, render.salt)
        with self._lock:
            self._expire()
            p = self._items.pop(key, None)
            if p is None:
                last = self._taken.get(key)
                # a retry of the call that took it: the same salt and tokens
                if last is not None and list(last[0].token_ids) == list(render.token_ids):
                    return last[0]
                return None
        if p.render.block_size != render.block_size:  # never matches: say why, and how to fix it
            logger.warning(
                "the hook prepared session %r in blocks of %d tokens, the model's engine caches blocks of "
                "%d: its contexts are never used (rendered anew); build its ContextHook with block_size=%d",
                session_id, p.render.block_size, render.block_size, render.block_size,
            )
            return None
        token_ids = render.token_ids
        if list(p.token_ids) != list(token_ids):
            logger.warning(
                "prepared context of session %r (step %d) does not match the messages the "
                "model received (%d vs %d tokens): rendering them anew",
                session_id, p.step, len(p.token_ids), len(token_ids),
            )
            return None
        with self._lock:  # taken (the checks passed): a retry of this call finds it
            self._taken[key] = (p, time.monotonic())
            self._taken.move_to_end(key)
            while len(self._taken) > self._max:
                self._taken.popitem(last=False)
        return p

    def settle(self, prepared: PreparedContext) -> None:
        """The model answered the call that took ``prepared``: no retry will come."""
        with self._lock:
            key = (prepared.session_id, prepared.render.salt)
            taken = self._taken.get(key)
            if taken is not None and taken[0] is prepared:
                del self._taken[key]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._taken:
            key, (_, at) = next(iter(self._taken.items()))
            if now - at <= RETRY_WINDOW_S:
                break
            del self._taken[key]

    def discard(self, prepared: PreparedContext) -> None:
        with self._lock:
            key = (prepared.session_id, prepared.render.salt)
            if self._items.get(key) is prepared:
                del self._items[key]
        self.settle(prepared)


handoff = _Handoff()
"""Process-wide hand-off used by :mod:`promptsplice.engine_adapters.integrations._hooks`."""
