"""Conversions between LangChain objects and the chat dicts the renderer takes, and the
Hermes-style tool-call text format SmolLM2's ChatML template lacks.

* :func:`lc_messages_to_openai`, :func:`format_tools`: LangChain messages and tools to
  OpenAI chat dicts and tool schemas (conversion errors become ``InputError``).
* :func:`parse_tool_calls`: ``<tool_call>{...}</tool_call>`` blocks out of generated
  text into LangChain tool calls, and blocks that are no valid call into invalid ones.
* :func:`forced_prefix`, :func:`check_tool_choice`, :func:`disables_parallel`: the
  decoding prefix that forces a call for a ``tool_choice``, the check of the choice
  itself, and Anthropic's ``disable_parallel_tool_use`` flag in it.
* :func:`streamable`, :func:`call_chunks`: what of a partial output may be streamed as
  content, and tool calls as stream chunks.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage, convert_to_openai_messages
from langchain_core.utils.function_calling import convert_to_openai_tool

from promptsplice.errors import ConfigError, InputError, InvalidMessageError

__all__ = [
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
    "lc_messages_to_openai",
    "format_tools",
    "parse_tool_calls",
    "forced_prefix",
    "check_tool_choice",
    "disables_parallel",
    "streamable",
    "call_chunks",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def lc_messages_to_openai(messages: Sequence[BaseMessage], *, origins: list[int] | None = None) -> list[dict[str, Any]]:
    """LangChain messages -> OpenAI chat dicts (``convert_to_openai_messages``), keeping
    a tool message's ``status="error"`` (which the failed-call policy reads) on that
    message's own dict: servers that number calls per turn (``call_0`` every turn) repeat
    a ``tool_call_id``, and marking every output of a failed call's id (as was done) made
    the policy drop the successful ones; an Anthropic ``tool_result`` block's
    ``is_error: true`` marks its output so too.  A
    ``developer`` message stays one: the renderer gives it to the template as vLLM's
    chat endpoint does (a ``system`` message where the template knows no developer role).
    ``origins``: a list to fill with each dict's message index (one message may give
    several dicts: a user message holding tool_result blocks)."""
    out: list[dict[str, Any]] = []
    origins = [] if origins is None else origins
    i = 0
    try:
        for i, m in enumerate(messages):  # message by message (the conversion has no state across them)
            one = convert_to_openai_messages([m])
            one = [one] if isinstance(one, dict) else list(one)
            if isinstance(m, AIMessage) and one:
                _drop_call_blocks(one[-1])
                if m.invalid_tool_calls:
                    _keep_invalid_calls(one[-1], m.invalid_tool_calls)
            failed = isinstance(m, ToolMessage) and getattr(m, "status", None) == "error"
            # Anthropic's tool_result blocks flag a failure with is_error, which the
            # conversion drops: their outputs are marked as a failed ToolMessage's are
            errored = {b.get("tool_use_id") for b in (m.content if isinstance(m.content, list) else ())
                       if isinstance(b, dict) and b.get("type") == "tool_result" and b.get("is_error") is True}
            for d in one:  # a developer message stays one: the renderer applies vLLM's rule
                if d.get("role") == "tool" and (failed or d.get("tool_call_id") in errored):
                    d["status"] = "error"
            if len(one) > 1:
                # a user message of tool_result blocks and text: the conversion puts its
                # text first, between the calls and their results (Anthropic refuses that
                # order once a policy edit rebuilds the messages); the results come first
                one = [d for d in one if d.get("role") == "tool"] + [d for d in one if d.get("role") != "tool"]
            out.extend(one)
            origins.extend([i] * len(one))
    except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise InvalidMessageError(
            f"message {i} ({type(messages[i]).__name__}) cannot be converted to a chat message ({detail}): "
            "give its content as a str or a list of LangChain content blocks ({'type': 'text', 'text': ...}, "
            "each with its 'type')") from exc
    return out


_CALL_BLOCKS = frozenset({"tool_call", "tool_call_chunk", "invalid_tool_call", "server_tool_call",
                          "server_tool_call_chunk", "server_tool_result", "reasoning", "thinking",
                          "redacted_thinking"})
"""LangChain v1 content blocks of an assistant turn that are not its text: the calls
(already in ``tool_calls``) and reasoning (which chat templates leave out of history;
Anthropic's ``thinking``/``redacted_thinking`` too, which made the session's hooks pass
it through unedited for good)."""


def _drop_call_blocks(d: dict[str, Any]) -> None:
    """An assistant turn in LangChain's v1 format (``output_version="v1"``) keeps its
    calls as content blocks too: the conversion copies them to ``tool_calls`` and leaves
    the blocks, which no template renders (the next step raised NonTextContentError)."""
    content = d.get("content")
    if isinstance(content, list):
        kept = [p for p in content if not (isinstance(p, Mapping) and p.get("type") in _CALL_BLOCKS)]
        if len(kept) != len(content):
            d["content"] = kept or ""


def _keep_invalid_calls(d: dict[str, Any], invalid: Sequence[Mapping[str, Any]]) -> None:
    """An assistant turn's calls whose arguments did not parse (LangChain's
    ``invalid_tool_calls``, from another model) stay in the history as the model wrote
    them (OpenAI keeps ``arguments`` as text too); the conversion dropped them, leaving
    an empty assistant turn."""
    calls = list(d.get("tool_calls") or [])
    have = {c.get("id") for c in calls if isinstance(c, Mapping)}
    for c in invalid:
        if c.get("id") and c.get("id") in have:  # also in the content (a tool_use block): once
            continue
        calls.append({"id": c.get("id") or "", "type": "function",
                      "function": {"name": c.get("name") or "", "arguments": c.get("args") or ""}})
    d["tool_calls"] = calls


def format_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """Tools (BaseTool, functions, pydantic models, dict schemas) -> OpenAI tool dicts."""
    out = []
    for t in tools:
        try:
            tool = convert_to_openai_tool(t)
        except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
            raise InputError(f"cannot convert tool {t!r:.80} to an OpenAI tool schema: {exc}") from exc
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not (tool.get("type") == "function" and isinstance(fn, Mapping) and isinstance(fn.get("name"), str)
                and fn["name"]):
            # a provider's built-in tool ({"type": "web_search_preview"}) passes the
            # conversion as it is; a local model cannot run it (until 2026-12-08 it was
            # rendered as a nameless function, and a forced choice made up a call)
            raise InputError(
                f"tool {t!r:.80} is not a function tool (converted: {tool!r:.80}): a provider's built-in "
                "tool runs on that provider's servers only; pass a function, a BaseTool or a JSON schema")
        out.append(tool)
    return out


_OPEN_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*")
_NAME_RE = re.compile(r'\{\s*"name"\s*:\s*(?=")')
"""What comes before the name at the head of a call (read when its JSON does not parse)."""


def parse_tool_calls(
    text: str, *, truncated: bool = False
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Split ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks out of
    ``text``: returns the remaining text, LangChain tool calls (``name``, ``args``,
    ``id``, ``type``) and invalid tool calls.  Every block is a call, forced or not: one
    that is not a JSON object with a string ``name`` and object ``arguments`` (or their JSON text) is an invalid call with ``error`` saying
    why, ``name`` when it can be read, and ``args`` the block as written, tags included
    (LangChain re-parses streamed calls' args leniently: JSON would come back as a valid
    call, a truncated one completed).  ``truncated``: the output hit its length limit
    (an unclosed last block says so).  A missing closing tag is tolerated (the call ends
    with its JSON); a block that does not parse, or has text between its JSON and its
    closing tag, ends at that tag, else at the next block or the text's end.  JSON nested
    too deeply for Python's parser is an invalid call too, never a ``RecursionError``."""
    decoder = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)
    calls: list[dict[str, Any]] = []
    invalid: list[dict[str, Any]] = []
    parts: list[str] = []
    pos = 0
    while (m := _OPEN_RE.search(text, pos)) is not None:
        parts.append(text[pos : m.start()])
        close = text.find(TOOL_CALL_CLOSE, m.end())
        nxt = _OPEN_RE.search(text, m.end())
        if nxt is not None and close > nxt.start():
            close = -1  # that tag closes the next block
        block_end = close + len(TOOL_CALL_CLOSE) if close >= 0 else (nxt.start() if nxt else len(text))
        try:
            obj, end = decoder.raw_decode(text, m.end())
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, NaN or Infinity
            end = block_end
            name = _read_name(decoder, text, m.end())
            if truncated and close < 0 and nxt is None:
                error = "the output ended at its length limit (max_tokens) before the call was complete"
            elif isinstance(exc, RecursionError):
                error = "the call's JSON is nested too deeply to parse"
            elif not isinstance(exc, json.JSONDecodeError):
                error = f"the call is not valid JSON: {exc}"
            else:
                error = f"the call is not valid JSON: {exc.msg} at character {exc.pos - m.end()}"
        else:
            # the tags from the JSON's end on (one inside a string argument is no tag)
            close = text.find(TOOL_CALL_CLOSE, end)
            nxt = _OPEN_RE.search(text, end)
            if nxt is not None and close > nxt.start():
                close = -1
            block_end = close + len(TOOL_CALL_CLOSE) if close >= 0 else len(text)
            stripped = text[end:].lstrip()
            end = len(text) - len(stripped)
            if stripped.startswith(TOOL_CALL_CLOSE) or (
                    stripped and close < 0 and nxt is None and TOOL_CALL_CLOSE.startswith(stripped)):
                end += min(len(stripped), len(TOOL_CALL_CLOSE))  # a closing tag cut off at the end is the tag
                name, args, error = _read_call(obj)
            elif close >= 0:  # text between the JSON and the closing tag: no clean call
                end = block_end
                name = obj.get("name") if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None
                error = "text follows the call's JSON before its closing tag"
            else:  # no closing tag: the call ends with its JSON, the text after it is content
                name, args, error = _read_call(obj)
            if error is None:
                calls.append({"name": name, "args": args, "id": _call_id(), "type": "tool_call"})
        if error is not None:
            invalid.append({"name": name, "args": text[m.start() : end], "id": _call_id(), "error": error,
                            "type": "invalid_tool_call"})
        pos = end
    parts.append(text[pos:])
    content = "".join(parts)
    return ("" if (calls or invalid) and not content.strip() else content), calls, invalid


def _finite_float(text: str) -> float:
    """A JSON number that overflows a float (``1e999``) is no value JSON can carry back."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are no JSON (Python's parser takes them)."""
    raise ValueError(f"{name} is not a JSON value")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (Python's parser keeps the last of
    two: ``{"arguments": {"path": "a", "path": "b"}}`` ran with ``b`` unseen)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _read_name(decoder: json.JSONDecoder, text: str, at: int) -> str | None:
    """The name at the head of the call at ``at`` whose JSON does not parse, if whole."""
    head = _NAME_RE.match(text, at)
    try:
        return decoder.raw_decode(text, head.end())[0] if head else None
    except ValueError:  # cut off inside the name, or a bad escape in it
        return None


def _read_call(obj: Any) -> tuple[str | None, Any, str | None]:
    """A parsed block's name, arguments and what makes it no valid call (``None``: valid).
    The name is not checked against the bound tools: as with ``ChatOpenAI``, a call of a
    tool that does not exist is a call, which a tool node answers with the tools it has
    (the agent then retries; an invalid call ends a ``create_agent`` turn)."""
    if not isinstance(obj, dict):
        return None, None, "the call is not a JSON object"
    name = obj.get("name")
    if not isinstance(name, str):
        return None, None, 'the call has no "name" string'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys) if args.strip() else {}
        except ValueError as exc:
            return name, None, f"arguments are not valid JSON: {exc}"
        except RecursionError:
            return name, None, "arguments are nested too deeply to parse"
    if not isinstance(args, dict):
        return name, None, f"arguments must be a JSON object, got {type(args).__name__}"
    return name, args, None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_prefix(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """The decoding prefix that forces a tool call (``None``: no forcing)."""
    tool_choice = check_tool_choice(tool_choice)
    if tool_choice in (None, "auto", "none", False):
        return None
    names = [t.get("function", {}).get("name") for t in tools]
    if not names:
        raise ConfigError(
            f"tool_choice={tool_choice!r} forces a tool call, but no tools are bound: "
            "pass tools (bind_tools(...) or tools=[...]) or tool_choice=None"
        )
    name: str | None = None
    if tool_choice in ("any", "required", True):
        name = names[0] if len(names) == 1 else None
    elif isinstance(tool_choice, str):
        name = tool_choice
    elif isinstance(tool_choice, Mapping):  # check_tool_choice's one dict form
        name = tool_choice["function"]["name"]
    if name is not None and name not in names:
        raise ConfigError(f"tool_choice names {name!r}, which is not a bound tool ({names})")
    if name is None:
        return TOOL_CALL_OPEN + '\n{"name": "'
    head = TOOL_CALL_OPEN + "\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    fn = next(t.get("function", {}) for t in tools if t.get("function", {}).get("name") == name)
    params = fn.get("parameters") or {}
    props = list((params.get("properties") or {}))
    if not props:
        return head + "{}}"
    required = [p for p in params.get("required") or [] if p in props]
    first = required[0] if required else props[0]
    return head + "{" + json.dumps(first, ensure_ascii=False) + ": "


_CHOICE_FORMS = (
    "None, 'auto', 'none', 'any', 'required', a tool name, {'type': 'auto'|'none'|'any'|'required'}, "
    "{'type': 'function', 'function': {'name': ...}} or {'type': 'tool', 'name': ...}"
)


def check_tool_choice(tool_choice: Any) -> Any:
    """``tool_choice`` in one form: ``None``, a bool, a str (a mode or a tool name), or
    ``{"type": "function", "function": {"name": ...}}``.  The dict forms of OpenAI and
    Anthropic are read as what they say: ``{"type": "none"}`` is ``"none"`` (it forced a
    call before, as every dict without a name did); a function or tool dict without a
    name, or any other dict, is a :class:`ConfigError`."""
    if tool_choice is None or tool_choice is False or tool_choice is True:
        return tool_choice
    if isinstance(tool_choice, str) and tool_choice:
        return tool_choice
    if isinstance(tool_choice, Mapping):
        disables_parallel(tool_choice)  # the flag's type
        kind = tool_choice.get("type")
        if kind in ("auto", "none", "any", "required") and set(tool_choice) <= {"type", "disable_parallel_tool_use"}:
            return kind
        if kind in ("function", "tool"):
            fn = tool_choice.get("function")
            name = (fn.get("name") if isinstance(fn, Mapping) else None) or tool_choice.get("name")
            if isinstance(name, str) and name:
                return {"type": "function", "function": {"name": name}}
            raise ConfigError(f"tool_choice {dict(tool_choice)!r} names no tool: add the tool's name, or use 'any'")
    raise ConfigError(f"tool_choice must be {_CHOICE_FORMS}, got {tool_choice!r}")


def disables_parallel(tool_choice: Any) -> bool:
    """Whether ``tool_choice`` is an Anthropic dict with ``disable_parallel_tool_use``
    true: at most one call, what ``parallel_tool_calls=False`` says (the flag was
    accepted and ignored).  A flag that is not a bool is a :class:`ConfigError`."""
    if not isinstance(tool_choice, Mapping) or "disable_parallel_tool_use" not in tool_choice:
        return False
    flag = tool_choice["disable_parallel_tool_use"]
    if not isinstance(flag, bool):
        raise ConfigError(f"tool_choice's disable_parallel_tool_use must be True or False, got {flag!r}")
    return flag


def streamable(seen: str, parse: bool) -> int:
    """How much of ``seen`` can be streamed as content: all of it without tools; with
    tools, up to a ``<tool_call>`` (or a tail that could still become one), and nothing
    while that is only whitespace (a call after it makes the content empty, as
    :func:`parse_tool_calls` does for ``invoke``: the stream sent ``"\n"``)."""
    if not parse:
        return len(seen)
    at = seen.find(TOOL_CALL_OPEN)
    if at < 0:
        at = len(seen)
        for k in range(min(len(TOOL_CALL_OPEN) - 1, len(seen)), 0, -1):
            if TOOL_CALL_OPEN.startswith(seen[-k:]):
                at = len(seen) - k
                break
    return at if seen[:at].strip() else 0


def call_chunks(calls: Sequence[Mapping[str, Any]], invalid: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """Tool calls, then invalid ones, as stream chunks; LangChain parses chunks' args when
    it adds chunks up: an invalid call's (its block, tags included) stays invalid."""
    chunks = [{"name": c["name"], "args": json.dumps(c["args"], ensure_ascii=False), "id": c["id"]} for c in calls]
    chunks += [{"name": c["name"], "args": c["args"], "id": c["id"]} for c in invalid]
    return [{**c, "index": i, "type": "tool_call_chunk"} for i, c in enumerate(chunks)]
