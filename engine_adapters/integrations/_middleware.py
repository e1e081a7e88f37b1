"""LangChain 1.x agent middleware: the harness hook of :mod:`._hooks` inside
``create_agent``.  Its own module because its base class comes from the ``langchain``
package (1.x), which the LangGraph and OpenAI Agents SDK hooks do not need: defined in
``_hooks``, it made them fail to import without it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import BaseMessage, SystemMessage

from promptsplice._validate import check_int
from promptsplice.assembler import ContextHook, PreparedContext
from promptsplice.errors import InvalidSaltError
from promptsplice.engine_adapters.integrations._handoff import handoff
from promptsplice.engine_adapters.integrations._hooks import (
    _check_hook,
    _check_session_key,
    _config_session,
    _PassThrough,
)
from promptsplice.engine_adapters.integrations._langchain_chat import PromptspliceChatModel
from promptsplice.engine_adapters.integrations._langchain_convert import format_tools, lc_messages_to_openai
from promptsplice.engine_adapters.integrations._langchain_match import messages_from_openai
from promptsplice.errors import NonTextContentError

__all__ = ["PromptspliceMiddleware"]

logger = logging.getLogger(__name__)

def _structured_output_tools(request: Any) -> list[Any]:
    """The tools ``create_agent`` binds after the middleware ran, for a ``response_format``
    answered through tools (``ToolStrategy``: what a PromptspliceChatModel gets, as it has
    no provider strategy), so the hook renders the prompt the model will see.  Without
    them every step's hand-off missed (other schemas in the system turn) and the model
    rendered anew: a new session each step, never spliced."""
    fmt = getattr(request, "response_format", None)
    if fmt is None or not isinstance(getattr(request, "model", None), PromptspliceChatModel):
        return []
    from langchain.agents.structured_output import AutoStrategy, OutputToolBinding, ProviderStrategy, ToolStrategy

    if isinstance(fmt, ProviderStrategy):
        return []
    if not isinstance(fmt, ToolStrategy):
        fmt = ToolStrategy(schema=fmt.schema if isinstance(fmt, AutoStrategy) else fmt)
    tools = [OutputToolBinding.from_schema_spec(spec).tool for spec in fmt.schema_specs]
    if any(isinstance(spec.schema, Mapping) and not spec.schema.get("title") for spec in fmt.schema_specs):
        # LangChain names such a tool response_format_<random> per ToolStrategy built:
        # create_agent's is not this one, so the hand-off cannot match
        logger.warning("response_format is a JSON schema without a 'title': LangChain names its tool at "
                       "random each time, so the model renders it anew every step; give the schema a 'title'")
    return tools


class PromptspliceMiddleware(AgentMiddleware):  # type: ignore[misc]
    """LangChain agent middleware: ``create_agent(..., middleware=[PromptspliceMiddleware(hook)])``.

    ``wrap_model_call`` runs the hook on the request's system message, messages and
    tools, replaces the messages with the policy-edited ones and hands the prepared
    context to a :class:`PromptspliceChatModel`.  ``on_prepared`` (optional) is called
    with every :class:`PreparedContext` (observability); ``self.history`` keeps the
    last ``keep_history`` of them.
    """

    def __init__(
        self,
        hook: ContextHook,
        session_key: str = "thread_id",
        *,
        default_session: str | None = None,
        on_prepared: Callable[[PreparedContext], None] | None = None,
        keep_history: int = 64,
    ) -> None:
        super().__init__()
        self.hook = _check_hook(hook)
        self.session_key = _check_session_key(session_key)
        self.default_session = default_session
        self.on_prepared = on_prepared
        # (a str or a float failed at the first call's history trim; a negative count
        # kept everything but the last -n)
        self.keep_history = check_int(keep_history, "keep_history", minimum=0)
        self.history: list[PreparedContext] = []
        self._passed = _PassThrough()

    def _prepare(self, request: Any) -> tuple[Any, PreparedContext | None]:
        sid = _config_session(self.session_key, self.default_session)
        originals: list[BaseMessage] = list(request.messages)
        system = request.system_message
        lc = ([system] if system is not None else []) + originals
        origins: list[int] = []
        dicts = lc_messages_to_openai(lc, origins=origins)
        bound = [*(request.tools or ()), *_structured_output_tools(request)]
        tools = format_tools(bound) if bound else None
        try:
            prepared = self.hook(sid, dicts, tools)
        except NonTextContentError as exc:
            self._passed.note("PromptspliceMiddleware", sid, exc)
            return request, None
        edited = prepared.messages
        new_system = system
        if system is not None:
            if edited and edited[0].get("role") == "system":
                if edited[0] != dicts[0]:
                    new_system = SystemMessage(content=edited[0].get("content", ""))
                edited = edited[1:]
            else:  # a policy removed the system message
                new_system = None
        skip = 1 if system is not None else 0
        messages = messages_from_openai(edited, originals, dicts[skip:], [o - skip for o in origins[skip:]])
        self.history.append(prepared)
        del self.history[: max(0, len(self.history) - self.keep_history)]
        if self.on_prepared is not None:
            self.on_prepared(prepared)
        return request.override(messages=messages, system_message=new_system), prepared

    def _give(self, new: Any, prepared: PreparedContext | None) -> tuple[Any, bool]:
        """Hand the prepared context to a PromptspliceChatModel, under the session id it
        was prepared for (passed along: the model reads ``thread_id`` otherwise, so a
        ``session_key`` of another name never met its hand-off)."""
        if prepared is None or not isinstance(new.model, PromptspliceChatModel):
            return new, False
        model_salt = (new.model_settings or {}).get("cache_salt") or new.model.cache_salt
        if model_salt is not None and prepared.render.salt is not None and model_salt != prepared.render.salt:
            # two tenants' salts: the model would render the session anew under its own,
            # another tenant's than the hook's (until 2026-12-07 accepted, the hand-off
            # lost); an unsalted hook before a salted model stays allowed
            raise InvalidSaltError(
                f"the middleware's hook prepared session {prepared.session_id!r} under salt "
                f"{prepared.render.salt!r}, the model's cache_salt is {model_salt!r}: give both one tenant's salt")
        handoff.put(prepared)
        settings = {**(new.model_settings or {}), "session_id": prepared.session_id}
        if new.model.cache_salt is None and prepared.render.salt is not None:
            # a call option: the model's LLM-cache key then names the tenant (a model's own
            # salt is left alone, so a mismatch with the hook's stays an InvalidSaltError)
            settings.setdefault("cache_salt", prepared.render.salt)
        return new.override(model_settings=settings), True

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        new, prepared = self._prepare(request)
        new, give = self._give(new, prepared)
        try:
            return handler(new)
        finally:
            if give:
                handoff.discard(prepared)  # type: ignore[arg-type]

    async def awrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        # off the event loop: the policies may call a model (a summarizer) or tokenize a
        # long history (the whole loop stalled for them)
        new, prepared = await asyncio.to_thread(self._prepare, request)
        new, give = self._give(new, prepared)
        try:
            return await handler(new)
        finally:
            if give:
                handoff.discard(prepared)  # type: ignore[arg-type]
