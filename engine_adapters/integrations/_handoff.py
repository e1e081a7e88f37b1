"""The hand-off of prepared contexts from the harness hooks to the chat model.

A hook (:mod:`promptsplice.engine_adapters.integrations._hooks`) runs the
:class:`~promptsplice.assembler.ContextHook` before the framework calls the model and puts
the :class:`~promptsplice.assembler.PreparedContext` here, per session;
:class:`~promptsplice.engine_adapters.integrations._langchain_chat.PromptspliceChatModel`
takes it when its own render of the messages it received has the same token ids, and so
sends exactly the hook's ids (and directives).  Its own module because both sides use
it and neither should import the other for it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from promptsplice.assembler import PreparedContext, Render

__all__ = ["handoff"]

logger = logging.getLogger(__name__)


class _Handoff:
    """The last :class:`PreparedContext` a harness hook made per session, for the chat
    model to pick up (bounded LRU, thread-safe).  The model takes it only when its own
    render of the messages it received has the same token ids, so a stale or foreign
    entry is never sent."""

    def __init__(self, max_sessions: int = 1024) -> None:
        self._items: OrderedDict[str, PreparedContext] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_sessions

    def put(self, prepared: PreparedContext) -> None:
        with self._lock:
            self._items[prepared.session_id] = prepared
            self._items.move_to_end(prepared.session_id)
            while len(self._items) > self._max:
                self._items.popitem(last=False)

    def take(self, session_id: str, render: Render) -> PreparedContext | None:
        """The session's prepared context when its tokens are ``render``'s (the model's own
        render of what it received).  A mismatch is logged and the model renders anew; a
        hook rendering other blocks than the engine caches is named with its fix (the
        entry may come from a hook in front of another model, so it is no error)."""
        with self._lock:
            p = self._items.get(session_id)
            if p is None:
                return None
            del self._items[session_id]
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
        return p

    def discard(self, prepared: PreparedContext) -> None:
        with self._lock:
            if self._items.get(prepared.session_id) is prepared:
                del self._items[prepared.session_id]


handoff = _Handoff()
"""Process-wide hand-off used by :mod:`promptsplice.engine_adapters.integrations._hooks`."""
