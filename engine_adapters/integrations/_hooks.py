"""Harness hooks: run :class:`promptsplice.assembler.ContextHook` inside real agent frameworks.

Each adapter converts the framework's messages to OpenAI chat dicts, calls the hook
(context policies, render, diff against the session's previous render), and gives the
framework back the *policy-edited* messages, so any chat model sees the edited context.
The :class:`~promptsplice.assembler.PreparedContext` is also handed to
:class:`~promptsplice.engine_adapters.integrations._langchain_chat.PromptspliceChatModel` (per session, through
``_handoff.handoff``): when the model's own render of the messages it receives
has the same token ids, it sends exactly those ids (and, with a runner, the
directives); otherwise it renders anew and logs why.

* :class:`PromptspliceMiddleware` (in ``_middleware``, which needs the ``langchain`` 1.x
  package, so the other two import without it): LangChain 1.x agent middleware
  (``wrap_model_call``).
* :class:`PromptsplicePreModelHook`: LangGraph ``create_react_agent(pre_model_hook=...)``,
  returning ``{"llm_input_messages": [...]}`` (the state's history is left alone).
* :class:`PromptspliceInputFilter`: OpenAI Agents SDK ``RunConfig(call_model_input_filter=...)``
  over Responses-API input items.

Session ids: LangChain/LangGraph read ``config["configurable"][session_key]`` (default
``thread_id``); without one, ``default_session`` is used, else ``ConfigError``.  The
middleware passes its session id to a :class:`PromptspliceChatModel`; behind the
LangGraph hook, give the model the same ``session_key`` (it reads ``thread_id``
otherwise and never finds the hook's prepared context).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.messages import SystemMessage, convert_to_messages

from promptsplice._validate import check_text
from promptsplice.assembler import ContextHook, PreparedContext
from promptsplice.assembler._chat_template import join_text_parts
from promptsplice.assembler._content_format import part_text
from promptsplice.engine_adapters.integrations._handoff import handoff
from promptsplice.engine_adapters.integrations._langchain_convert import format_tools, lc_messages_to_openai
from promptsplice.engine_adapters.integrations._langchain_match import _align, messages_from_openai
from promptsplice.errors import ConfigError, InputError, InvalidMessageError, NonTextContentError

logger = logging.getLogger(__name__)

__all__ = [
    "PromptsplicePreModelHook",
    "PromptspliceInputFilter",
    "items_to_chat",
    "chat_to_items",
]


class _PassThrough:
    """Sessions whose messages hold content the hook cannot render (an image, a
    refusal): their calls go through unedited, said once per session."""

    def __init__(self) -> None:
        self._said: dict[str, None] = {}
        self._lock = threading.Lock()  # adapters serve concurrent agent runs

    def note(self, adapter: str, sid: str, exc: NonTextContentError) -> None:
        with self._lock:
            if sid in self._said:
                return
            self._said[sid] = None
            if len(self._said) > 1024:  # the oldest forgotten (said again if it comes back)
                del self._said[next(iter(self._said))]
        logger.warning("%s: session %r holds content the hook cannot render (%s); its messages go to the "
                       "model unedited (no policies, no hand-off)", adapter, sid, exc)


def _check_hook(hook: Any) -> ContextHook:
    if not isinstance(hook, ContextHook):
        raise ConfigError(f"hook must be an assembler.ContextHook, got {type(hook).__name__}")
    return hook


def _check_session_key(key: Any) -> str:
    """A session key is a non-empty str (another value named no config key: every call
    fell back to the default session or raised ``no session id``)."""
    check_text(key, "session_key", error=ConfigError)
    if not key:
        raise ConfigError("session_key must be a non-empty str (a config['configurable'] key), got ''")
    return key


def _config_session(session_key: str, default: str | None) -> str:
    from langgraph.config import get_config

    try:
        cfg = get_config()
    except RuntimeError:  # not inside a runnable context
        cfg = {}
    sid = (cfg.get("configurable") or {}).get(session_key)
    if sid is None:
        sid = default
    if sid is None:
        raise ConfigError(
            f"no session id: pass config={{'configurable': {{'{session_key}': ...}}}} to the agent "
            "or give the hook adapter a default_session"
        )
    return str(sid)


# -- LangGraph pre_model_hook ----------------------------------------------------------


class PromptsplicePreModelHook:
    """``create_react_agent(model, tools, pre_model_hook=PromptsplicePreModelHook(hook, tools=tools))``.

    Called with the graph state, it runs the hook on ``state["messages"]`` (and the
    tools' schemas, so the render matches what a :class:`PromptspliceChatModel` bound
    to the same tools renders) and returns ``{"llm_input_messages": edited}``: the model
    sees the edited context while the state keeps the full history.  ``system`` (the
    agent's ``prompt=``, if a string) is prepended for the render, as the agent does.
    """

    def __init__(
        self,
        hook: ContextHook,
        *,
        tools: Sequence[Any] | None = None,
        system: str | None = None,
        session_key: str = "thread_id",
        default_session: str | None = None,
    ) -> None:
        self.hook = _check_hook(hook)
        self.tools = format_tools(tools) if tools else None
        self.system = system
        self.session_key = _check_session_key(session_key)
        self.default_session = default_session
        self.history: list[PreparedContext] = []
        self._passed = _PassThrough()

    def __call__(self, state: Mapping[str, Any]) -> dict[str, Any]:
        sid = _config_session(self.session_key, self.default_session)
        msgs = state.get("messages") if isinstance(state, Mapping) else getattr(state, "messages", None)
        if msgs is None:
            raise InputError("the graph state has no 'messages'")
        try:
            originals = list(convert_to_messages(msgs))
        except (ValueError, TypeError, KeyError, NotImplementedError) as exc:  # LangChain's, translated
            raise InvalidMessageError(f"the graph state's messages cannot be read as LangChain messages: {exc}") from exc
        lc = ([SystemMessage(content=self.system)] if self.system else []) + originals
        origins: list[int] = []
        dicts = lc_messages_to_openai(lc, origins=origins)
        try:
            prepared = self.hook(sid, dicts, self.tools)
        except NonTextContentError as exc:
            self._passed.note("PromptsplicePreModelHook", sid, exc)
            return {"llm_input_messages": originals}
        edited = prepared.messages
        if self.system and edited and edited[0].get("role") == "system":
            edited = edited[1:]
        self.history.append(prepared)
        del self.history[:-64]
        handoff.put(prepared)
        skip = 1 if self.system else 0
        return {"llm_input_messages": messages_from_openai(edited, originals, dicts[skip:], [o - skip for o in origins[skip:]])}


# -- OpenAI Agents SDK call_model_input_filter -------------------------------------------


def _item_text(content: Any) -> str:
    """An input item's content as the one text of its chat dict: its text parts
    (``input_text``, ``output_text``...) joined with a newline, empty ones left out
    (``join_text_parts``), as vLLM's chat and Responses endpoints join a message's text
    parts for a template of its ``"string"`` content format (and as the renderer joins a
    chat dict's): joined with nothing, this hook rendered "Helloworld" where vLLM renders
    "Hello\\nworld", and a LangChain-fed hook rendered the same turn otherwise.  (A
    template of the ``"openai"`` format gets the one joined part here, where vLLM's
    Responses endpoint hands it a user item's parts.)"""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts as the renderer reads them (a refusal's too)
        texts = []
        for p in content:
            try:
                texts.append(part_text(p, -1))
            except NonTextContentError:
                raise NonTextContentError(f"only text content can be rendered, got {p!r:.80}") from None
        return join_text_parts(t for t in texts if t is not None)
    if content is None:
        return ""
    raise InputError(f"unsupported content {type(content).__name__}")


def _output_text(out: Any) -> str:
    """A ``function_call_output``'s ``output``: a str, or a list of content parts whose
    text parts join as a message's do (so policies read the text) and whose image or
    file parts raise :class:`NonTextContentError` (the session passes through; they
    were rendered as JSON, base64 and all); anything else as JSON."""
    if isinstance(out, str):
        return out
    if isinstance(out, list) and out and all(isinstance(p, Mapping) and "type" in p for p in out):
        return _item_text(out)
    return json.dumps(out, ensure_ascii=False)


def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return dict(item)
    dump = getattr(item, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=True)
    raise InputError(f"an input item must be a dict or a pydantic model, got {type(item).__name__}")


def items_to_chat(items: Sequence[Any], instructions: str | None) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Responses-API input items -> chat dicts, and for each chat dict the indices of
    the items it came from.  User/system/developer/assistant messages map to messages;
    ``function_call`` items join the preceding assistant message (or start one) as
    ``tool_calls``; ``function_call_output`` becomes a ``tool`` message.  Other items
    (reasoning, hosted tool calls) are not rendered; they travel with the next message.
    ``instructions`` become a leading system message (provenance ``[]``)."""
    chat: list[dict[str, Any]] = []
    prov: list[list[int]] = []
    if instructions:
        chat.append({"role": "system", "content": instructions})
        prov.append([])
    pending: list[int] = []
    for i, raw in enumerate(items):
        it = _as_dict(raw)
        typ = it.get("type")
        role = it.get("role")
        if typ in (None, "message") and isinstance(role, str):
            chat.append({"role": role, "content": _item_text(it.get("content"))})
            prov.append([*pending, i])
            pending = []
        elif typ == "function_call":
            call = {"id": it.get("call_id"), "type": "function", "function": {"name": it.get("name"), "arguments": it.get("arguments", "{}")}}
            if chat and chat[-1]["role"] == "assistant" and not pending and prov[-1]:
                chat[-1].setdefault("tool_calls", []).append(call)
                prov[-1].append(i)
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
                prov.append([*pending, i])
                pending = []
        elif typ == "function_call_output":
            chat.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": _output_text(it.get("output"))})
            prov.append([*pending, i])
            pending = []
        else:
            pending.append(i)
    if pending:  # trailing unrendered items: attach to the last message
        if prov:
            prov[-1].extend(pending)
        else:
            raise InputError("the input has no message the hook could render")
    return chat, prov


def chat_to_items(
    edited: Sequence[Mapping[str, Any]],
    chat: Sequence[Mapping[str, Any]],
    prov: Sequence[Sequence[int]],
    items: Sequence[Any],
) -> list[Any]:
    """Rebuild the input items from the policy-edited chat dicts: an unchanged message
    gives its original items back (the same objects), an edited tool output its item
    with the new ``output``, a message the policy dropped drops its items, and a new
    message (a summary) becomes ``{"role": ..., "content": ...}``.  Which original each
    edited dict came from is the LangChain side's order-keeping alignment
    (:func:`~promptsplice.engine_adapters.integrations._langchain_match._align`): until
    2026-12-07 the first later original of the same ``call_id`` was taken, and where a
    server repeats ids (``call_0`` every turn) an output was paired with a dropped call."""
    src, same = _align(edited, chat)
    out: list[Any] = []
    for x, d in enumerate(edited):
        k = src[x]
        if k is not None and same[x]:
            out.extend(items[i] for i in prov[k])
            continue
        if k is not None and d.get("role") == "tool" and chat[k].get("role") == "tool":
            for i in prov[k]:
                it = _as_dict(items[i])
                if it.get("type") == "function_call_output":
                    new = copy.deepcopy(it)
                    new["output"] = d.get("content", "")
                    out.append(new)
                else:
                    out.append(items[i])
            continue
        if d.get("role") == "assistant" and d.get("tool_calls"):
            mine = k if k is not None and chat[k].get("role") == "assistant" else None
            _assistant_items(d, chat, prov, items, mine, out)
            continue
        out.append({"role": d.get("role", "user"), "content": d.get("content") or ""})
    return out


def _assistant_items(
    d: Mapping[str, Any], chat: Sequence[Mapping[str, Any]], prov: Sequence[Sequence[int]], items: Sequence[Any],
    k: int | None, out: list[Any],
) -> None:
    """An edited assistant turn with tool calls (a policy dropped some of its calls),
    ``k`` its original: its original items, less the ``function_call`` items of the
    dropped calls (their outputs went with them), and its text as a new message if that
    changed.  A turn with no original gets new ``function_call`` items."""
    if k is None:
        if d.get("content"):
            out.append({"role": "assistant", "content": d["content"]})
        for c in d["tool_calls"]:
            fn = c.get("function") or {}
            out.append({"type": "function_call", "call_id": c.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments", "{}")})
        return
    # the kept calls, matched to the original's function_call items in order (an id may repeat in a turn)
    left = list(chat[k].get("tool_calls") or ())
    kept = []
    for c in d["tool_calls"]:
        at = next((n for n, o in enumerate(left) if o == c), None)
        if at is not None:
            kept.append(left.pop(at))
    calls = iter(chat[k].get("tool_calls") or ())
    for i in prov[k]:
        it = _as_dict(items[i])
        if it.get("type") == "function_call":
            call = next(calls, None)
            if call is not None and any(call is c for c in kept):
                out.append(items[i])
        elif it.get("type") in (None, "message") and isinstance(it.get("role"), str):
            if d.get("content") == chat[k].get("content"):
                out.append(items[i])
            elif d.get("content"):
                out.append({"role": "assistant", "content": d["content"]})
        else:  # reasoning and other items that rode with the turn
            out.append(items[i])


class PromptspliceInputFilter:
    """``RunConfig(call_model_input_filter=PromptspliceInputFilter(hook, session_id=...))``.

    Maps the SDK's Responses-API input items to chat messages (:func:`items_to_chat`),
    runs the hook, and returns a ``ModelInputData`` with the edited items
    (:func:`chat_to_items`); with no policy edit the original items come back as they
    were.  ``session_id``: a str, or a callable ``(CallModelData) -> str``; default: the
    run context's ``session_id`` (attribute or key), else ``ConfigError``.  ``tools``
    (OpenAI tool dicts or LangChain tools) are rendered with the context.
    """

    def __init__(
        self,
        hook: ContextHook,
        *,
        session_id: str | Callable[[Any], str] | None = None,
        tools: Sequence[Any] | None = None,
    ) -> None:
        self.hook = _check_hook(hook)
        self.session_id = session_id
        self.tools = format_tools(tools) if tools else None
        self.history: list[PreparedContext] = []
        self._passed = _PassThrough()

    def _session(self, data: Any) -> str:
        if callable(self.session_id):
            return str(self.session_id(data))
        if self.session_id is not None:
            return self.session_id
        ctx = getattr(data, "context", None)
        sid = ctx.get("session_id") if isinstance(ctx, Mapping) else getattr(ctx, "session_id", None)
        if sid is None:
            raise ConfigError("no session id: pass session_id= or run with a context that has session_id")
        return str(sid)

    def __call__(self, data: Any) -> Any:
        from agents.run_config import ModelInputData

        model_data = data.model_data
        items = list(model_data.input)
        sid = self._session(data)
        try:
            chat, prov = items_to_chat(items, model_data.instructions)
            prepared = self.hook(sid, chat, self.tools)
        except NonTextContentError as exc:
            self._passed.note("PromptspliceInputFilter", sid, exc)
            return ModelInputData(input=items, instructions=model_data.instructions)
        self.history.append(prepared)
        del self.history[:-64]
        if not prepared.policy_edits:
            return ModelInputData(input=items, instructions=model_data.instructions)
        edited = list(prepared.messages)
        instructions = model_data.instructions
        if instructions:
            if edited and edited[0].get("role") == "system" and prov and not prov[0]:
                instructions = edited[0].get("content") or instructions
                edited = edited[1:]
            chat_body, prov_body = chat[1:], prov[1:]
        else:
            chat_body, prov_body = chat, prov
        return ModelInputData(input=chat_to_items(edited, chat_body, prov_body, items), instructions=instructions)
