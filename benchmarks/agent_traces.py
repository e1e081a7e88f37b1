"""Agent workload traces: the JSONL format, its strict reader, and a BFCL-based generator.

Trace format
------------
JSONL, one agent session a line (blank lines are skipped)::

    {"id": str, "tools": [tool schema, ...], "renders": [[message, ...], ...]}

Each render is the *full* OpenAI-style chat message list the agent sends at one model
call, in order.  A tool schema is ``{"type": "function", "function": {"name": str,
"description": str (optional), "parameters": object (optional)}}``.  A message has a
``role`` (``system``, ``developer``, ``user``, ``assistant``, ``tool``) and ``content``:
a string, or a list of text parts (``[{"type": "text", "text": ...}]``, read as their
joined text); an assistant message may carry ``tool_calls`` (``[{"id", "type":
"function", "function": {"name", "arguments": <JSON text, or an object, read as its JSON
text; "" for none>}}]``, then ``content`` may be null or absent; a call without an
``id`` can be answered by no tool message); a tool message's ``tool_call_id``, when it
has one, names a call of an earlier assistant message *in the same render*.  Unknown extra keys (top level, in messages, in schemas) are tolerated and
ignored, so traces from other harnesses load (but ``name`` and ``tool_call_id``, which
the template renders, must be strings or null, and a legacy ``function_call`` object is
read as the message's one tool call, as the renderer reads it); :func:`write_agent_trace` writes only the
three keys.  :func:`iter_agent_trace` raises
:class:`~promptsplice.errors.TraceFormatError` (``FILE:LINE: field: what is wrong; how
to fix it``) on invalid UTF-8 or JSON (a number out of the float range and nesting too
deep to parse included), a lone surrogate anywhere (a ``\\udXXX`` escape without its
pair), a missing key, a wrong type, an empty ``renders``
or render, a message without or with an unknown role, a tool message with a dangling
``tool_call_id``, a duplicate session id, and a file with no session at all.
So whatever it reads, :func:`write_agent_trace` writes back as a valid trace.

Step labels
-----------
:func:`classify_step` labels a step from two successive renders alone: ``first``,
``append``, or by what changed at the first changed message: ``truncate`` (the ten-line
rule's marker, as :class:`promptsplice.assembler.TruncateToolOutputs` writes it), ``mask`` (a tool
output replaced by a short one-line placeholder), ``drop`` (messages removed, nothing
put in), ``summarize`` (several messages replaced by one), else ``other``.

The generator lives in :mod:`promptsplice.benchmarks.agent_traces_bfcl`.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from promptsplice.assembler._chat_template import canonical_json, join_text_parts
from promptsplice.benchmarks.traces import (  # one strict JSON reader
    _finite_float,
    bare_cr_hint,
    JSON_WHITESPACE,
    decode_line,
    _lone_surrogate,
    _reject_constant,
    _strict_object,
)
from promptsplice.errors import TraceFormatError

__all__ = [
    "AgentSession",
    "STEP_KINDS",
    "MASK_PLACEHOLDER",
    "iter_agent_trace",
    "read_agent_trace",
    "write_agent_trace",
    "classify_step",
    "edit_depth",
    "trace_summary",
]

Message = dict[str, Any]
ROLES = ("system", "developer", "user", "assistant", "tool")
STEP_KINDS = ("first", "append", "truncate", "drop", "mask", "summarize", "other")
"""Every label :func:`classify_step` returns."""
MASK_PLACEHOLDER = "[output omitted]"
"""What observation masking puts in place of an old tool output."""
# TruncateToolOutputs' default marker "[... {n} lines truncated ...]", as a pattern.
_TRUNC_MARKER = re.compile(r"^\[\.\.\. \d+ lines truncated \.\.\.\]$", re.MULTILINE)


@dataclass(slots=True, frozen=True)
class AgentSession:
    """One agent session: its ``id``, the tool schemas it offers, and the full message
    list of every model call (``renders``), in order."""

    id: str
    tools: list[dict]
    renders: list[list[dict]]

    def to_json(self) -> dict:
        """The session as a trace-line object (exactly ``id``, ``tools``, ``renders``)."""
        return {"id": self.id, "tools": self.tools, "renders": self.renders}


# --------------------------------------------------------------------------- reading


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


class _Where:
    """Builds ``FILE:LINE: field: problem; fix`` errors."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, fld: str, problem: str, fix: str) -> TraceFormatError:
        return TraceFormatError(f"{self.where}: {fld}: {problem}; {fix}")

    def typed(self, value: Any, typ: type, fld: str, expected: str, fix: str) -> Any:
        if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
            raise self.fail(fld, f"expected {expected}, got {_type_name(value)}", fix)
        return value


def _check_tool(w: _Where, tool: Any, fld: str) -> None:
    fix = 'write each tool as {"type": "function", "function": {"name": ..., "parameters": {...}}}'
    w.typed(tool, dict, fld, "an object", fix)
    if tool.get("type") != "function":
        raise w.fail(f"{fld}.type", f'expected "function", got {tool.get("type")!r}', fix)
    fn = w.typed(tool.get("function"), dict, f"{fld}.function", "an object", fix)
    name = w.typed(fn.get("name"), str, f"{fld}.function.name", "a string", fix)
    if not name:
        raise w.fail(f"{fld}.function.name", "empty tool name", fix)
    if "description" in fn:
        w.typed(fn["description"], str, f"{fld}.function.description", "a string", fix)
    if "parameters" in fn:
        w.typed(fn["parameters"], dict, f"{fld}.function.parameters", "an object (JSON schema)", fix)


def _text_parts(w: _Where, content: Any, fld: str) -> Any:
    """Content given as a list of text parts (``[{"type": "text", "text": ...}]``, as
    frameworks send it) as the one string the renderer makes of it; anything else as is."""
    if not isinstance(content, list):
        return content
    texts = []
    for k, part in enumerate(content):
        if isinstance(part, str):  # a bare string part, as the renderer takes it
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise w.fail(f"{fld}.content[{k}]", f"not a text part ({_type_name(part)})",
                         'only text parts {"type": "text", "text": ...} can be rendered')
    return join_text_parts(texts)


def _check_message(w: _Where, msg: Any, fld: str, call_ids: set[str]) -> dict[str, Any]:
    """The message, checked; text parts joined and dict arguments written as JSON text
    (what the renderer makes of them), so the rest of the bench reads one form."""
    w.typed(msg, dict, fld, "an object (a chat message)", 'write each message as {"role": ..., "content": ...}')
    if _nesting(msg) > MAX_NESTING:
        raise w.fail(fld, f"nested more than {MAX_NESTING} levels deep", "flatten the message (its extra keys too)")
    if "role" not in msg:
        raise w.fail(fld, "message without 'role'", f"add a role, one of {', '.join(ROLES)}")
    role = msg["role"]
    if role not in ROLES:
        raise w.fail(f"{fld}.role", f"unknown role {role!r}", f"use one of {', '.join(ROLES)}")
    msg = dict(msg)
    for key in ("name", "tool_call_id"):  # the renderer's rule (rendered by the template)
        if msg.get(key) is not None and not isinstance(msg[key], str):
            raise w.fail(f"{fld}.{key}", f"expected a string or null, got {_type_name(msg[key])}",
                         f"write {key} as a string, or leave it out")
    if "function_call" in msg:  # the legacy form of one call: rendered as one, so read as one
        legacy = msg.pop("function_call")
        if legacy is not None:
            if msg.get("tool_calls"):
                raise w.fail(f"{fld}.function_call", "both tool_calls and the legacy function_call",
                             "write the call in tool_calls only")
            w.typed(legacy, dict, f"{fld}.function_call", "an object",
                    'write calls as tool_calls [{"id": ..., "type": "function", "function": {...}}]')
            if role != "assistant":
                raise w.fail(f"{fld}.function_call", f"a function_call on a {role} message",
                             "only assistant messages call tools")
            # no arguments: rendered as none ("" in a trace), as the renderer reads it
            msg["tool_calls"] = [{"type": "function", "function": {"arguments": "", **legacy}}]
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise w.fail(f"{fld}.tool_calls", f"tool_calls on a {role} message", "only assistant messages call tools")
        fix = 'write calls as [{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON>"}}]'
        w.typed(calls, list, f"{fld}.tool_calls", "an array", fix)
        calls = msg["tool_calls"] = [dict(c) if isinstance(c, dict) else c for c in calls]
        for k, call in enumerate(calls):
            cf = f"{fld}.tool_calls[{k}]"
            w.typed(call, dict, cf, "an object", fix)
            cid = call.get("id")
            if cid is not None:  # a call without an id can be answered by no tool message
                w.typed(cid, str, f"{cf}.id", "a string", fix)
                if cid and cid in call_ids:  # two calls of one id: a tool message could answer either ("" names none)
                    raise w.fail(f"{cf}.id", f"call id {cid!r} is used twice in this render", "give every call its own id")
                call_ids.add(cid)
            if call.get("type", "function") != "function":
                raise w.fail(f"{cf}.type", f'expected "function", got {call.get("type")!r}', fix)
            fn = call["function"] = dict(w.typed(call.get("function"), dict, f"{cf}.function", "an object", fix))
            if not w.typed(fn.get("name"), str, f"{cf}.function.name", "a string", fix):
                raise w.fail(f"{cf}.function.name", "an empty name", "name the function the call invokes (as its tool schema does)")
            args = fn.get("arguments")
            if isinstance(args, dict):
                fn["arguments"] = json.dumps(args, ensure_ascii=False)
                continue
            args = w.typed(args, str, f"{cf}.function.arguments", "a string of JSON (or an object)", fix)
            try:  # as strict as a trace line: NaN, 1e999 or a repeated key is not JSON a model can read back
                parsed = json.loads(args, object_pairs_hook=_strict_object, parse_constant=_reject_constant,
                                    parse_float=_finite_float) if args.strip() else None  # "": no arguments
            except (ValueError, RecursionError) as exc:
                raise w.fail(f"{cf}.function.arguments", f"not JSON text ({exc})", fix) from None
            if "\\ud" in args.lower() and (bad := _lone_surrogate(parsed)) is not None:
                raise w.fail(f"{cf}.function.arguments", f"lone surrogate at {bad}, which is not valid Unicode",
                             "escape characters outside the BMP as a pair (\\ud83d\\ude00), never one half")
    has_content = "content" in msg
    content = _text_parts(w, msg.get("content"), fld)
    if has_content:
        msg["content"] = content
    if role == "assistant" and calls is not None:  # [] too: frameworks send an empty list
        if content is not None and not isinstance(content, str):
            raise w.fail(f"{fld}.content", f"expected a string or null, got {_type_name(content)}",
                         "put the assistant's text in content as a string")
    elif not isinstance(content, str):
        got = "no 'content'" if not has_content else f"content is {_type_name(content)}"
        raise w.fail(f"{fld}.content", f"expected a string, {got}", f"give the {role} message its text as a string")
    if role == "tool":
        tcid = msg.get("tool_call_id")
        if tcid is None:  # a harness that does not number its calls: rendered all the same
            return msg
        w.typed(tcid, str, f"{fld}.tool_call_id", "a string", "use the call's id")
        if tcid not in call_ids:
            raise w.fail(f"{fld}.tool_call_id", f"{tcid!r} answers no tool call of an earlier assistant message "
                         "in this render", "keep the assistant message that made the call, or drop this output too")
    return msg


MAX_NESTING = 100
"""Levels a message may nest (its extra keys included): the hook walks every key, and
one nested ~500 deep failed a run after its engines had started."""


def _nesting(value: Any) -> int:
    """How deep ``value`` nests (a str or number: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list | tuple):
            deepest = max(deepest, d + 1)
            if d + 1 <= MAX_NESTING:
                stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest



def _session_from_json(obj: Any, w: _Where) -> AgentSession:
    w.typed(obj, dict, "line", "a JSON object (one session)", 'write {"id": ..., "tools": [...], "renders": [...]}')
    for key in ("id", "tools", "renders"):
        if key not in obj:
            raise w.fail(key, f"missing key {key!r}", 'a session line needs "id", "tools" and "renders"')
    sid = w.typed(obj["id"], str, "id", "a string", "give the session a string id")
    if not sid:
        raise w.fail("id", "empty session id", "give the session a non-empty id")
    tools = w.typed(obj["tools"], list, "tools", "an array of tool schemas", "use [] for a session without tools")
    for i, tool in enumerate(tools):
        _check_tool(w, tool, f"tools[{i}]")
    renders = w.typed(obj["renders"], list, "renders", "an array of renders", "list each step's messages")
    if not renders:
        raise w.fail("renders", "empty renders", "a session needs at least one render (one model call)")
    for r, render in enumerate(renders):
        w.typed(render, list, f"renders[{r}]", "an array of messages", "write each render as a message list")
        if not render:
            raise w.fail(f"renders[{r}]", "empty render", "a render needs at least one message")
        call_ids: set[str] = set()
        render[:] = [_check_message(w, msg, f"renders[{r}][{m}]", call_ids) for m, msg in enumerate(render)]
    return AgentSession(sid, tools, renders)


def iter_agent_trace(path: str | os.PathLike[str]) -> Iterator[AgentSession]:
    """Yield the sessions of a JSONL agent trace one by one, validating each line
    (see the module docstring for the errors).  ``OSError`` propagates unchanged."""
    name = os.fspath(path)
    seen: dict[str, int] = {}
    with open(name, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            w = _Where(f"{name}:{lineno}")
            line = decode_line(raw, lineno, w.where)
            if not line.strip(JSON_WHITESPACE):
                continue
            try:
                obj = json.loads(line, object_pairs_hook=_strict_object, parse_constant=_reject_constant,
                                 parse_float=_finite_float)
            except (ValueError, RecursionError) as exc:
                raise w.fail("line", f"not JSON ({exc})", "write one JSON object per line" + bare_cr_hint(line)) from None
            session = _session_from_json(obj, w)
            # Only a \udXXX escape makes a lone surrogate (UTF-8 bytes cannot), so only
            # lines holding one are searched.
            if "\\ud" in line.lower() and (bad := _lone_surrogate(obj)) is not None:
                raise w.fail("line", f"lone surrogate at {bad}, which is not valid Unicode",
                             "escape characters outside the BMP as a pair (\\ud83d\\ude00), never one half")
            if session.id in seen:
                raise w.fail("id", f"duplicate session id {session.id!r} (first on line {seen[session.id]})",
                             "give every session its own id")
            seen[session.id] = lineno
            yield session
    if not seen:
        raise TraceFormatError(f"{name}: no sessions (the trace file is empty); write at least one session line")


def read_agent_trace(path: str | os.PathLike[str]) -> list[AgentSession]:
    """Read and validate a whole JSONL agent trace (see :func:`iter_agent_trace`)."""
    return list(iter_agent_trace(path))


def write_agent_trace(path: str | os.PathLike[str], sessions: Iterable[AgentSession]) -> int:
    """Write sessions as a JSONL agent trace (UTF-8, one line each); return how many.
    Creates the parent folder when missing.  Each session is checked as the reader
    checks it (:class:`TraceFormatError` naming ``session N``), so a file it writes is
    one the reader reads: an infinity, a duplicate id or an empty render was written,
    then refused."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    seen: dict[str, int] = {}
    for n, s in enumerate(sessions):
        w = _Where(f"session {n}")
        obj = s.to_json()
        try:
            line = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise w.fail("line", f"not JSON ({exc})", "give the session JSON values only (finite numbers)") from None
        _session_from_json(json.loads(line), w)
        if s.id in seen:
            raise w.fail("id", f"duplicate session id {s.id!r} (first: session {seen[s.id]})", "give every session its own id")
        seen[s.id] = n
        lines.append(line)
    with open(p, "w", encoding="utf-8", newline="\n") as fh:
        fh.writelines(line + "\n" for line in lines)
    return len(lines)


# --------------------------------------------------------------------------- step labels


def _rendered(msg: dict) -> tuple:
    """What of a message the renderer renders, in one form: its role, content, name,
    tool_call_id and calls (arguments as canonical JSON: ``'{"a":true}'``, ``{"a": True}``
    and ``'{"a": true}'`` alike; ``""`` as ``{}``); other keys are ignored (README), as the
    hook ignores them."""
    calls = []
    for c in msg.get("tool_calls") or ():
        fn = (c.get("function") or {}) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        try:
            parsed = (json.loads(args) if args.strip() else {}) if isinstance(args, str) else args
            args = canonical_json(parsed)  # the renderer's one form
        except (ValueError, TypeError, RecursionError):
            pass  # as written
        calls.append((c.get("id") if isinstance(c, dict) else None, fn.get("name"), args))
    return (msg.get("role"), msg.get("content"), msg.get("name"), msg.get("tool_call_id"), tuple(calls))


def edit_depth(prev_render: list[dict] | None, render: list[dict]) -> int:
    """Index of the first message of ``render`` that differs from ``prev_render`` in what
    is rendered (:func:`_rendered`; 0 = the system message): ``len(prev_render)`` for a
    pure append, 0 for the first step (``prev_render`` None or empty)."""
    if not prev_render:
        return 0
    return _first_change([_rendered(m) for m in prev_render], [_rendered(m) for m in render])


def _first_change(prev: list[tuple], new: list[tuple]) -> int:
    n = min(len(prev), len(new))
    return next((i for i in range(n) if prev[i] != new[i]), n)


def _text(msg: dict) -> str:
    c = msg.get("content")
    return c if isinstance(c, str) else ""


def classify_step(prev_render: list[dict] | None, render: list[dict]) -> str:
    """Label the step from ``prev_render`` to ``render`` (one of :data:`STEP_KINDS`).

    ``first`` without a previous render; ``append`` when it is a prefix of ``render``.
    Otherwise, from the first changed message ``i``, the removed stretch ``prev[i:j]``
    and the inserted one ``render[i:k]`` run up to the first message of ``render`` that
    reappears later in ``prev`` (messages compare by what is rendered, :func:`_rendered`); when none does, the
    whole tail ``prev[i:]`` counts as removed and ``render[i:]`` as inserted (the edit
    was followed by new messages).  A tool output replaced by a shorter one (same
    ``tool_call_id``): ``truncate`` if it gained the ten-line rule's marker line,
    ``mask`` if it became one short line; nothing inserted, or a removed tail made only
    of tool calls and outputs whose ids are gone from ``render``: ``drop``; two or more
    messages replaced by one non-tool message without calls (or, in a replaced tail,
    starting with one): ``summarize``; anything else: ``other``.
    """
    if not prev_render:
        return "first"
    prev_r, new_r = [_rendered(m) for m in prev_render], [_rendered(m) for m in render]
    i = _first_change(prev_r, new_r)
    if i == len(prev_render):
        return "append"
    k = j = -1
    for kk in range(i, len(render)):
        try:
            j = prev_r.index(new_r[kk], i)
        except ValueError:
            continue
        k = kk
        break
    tail = k < 0  # nothing after the change resyncs: prev's tail replaced, new messages follow
    removed, inserted = (prev_render[i:], render[i:]) if tail else (prev_render[i:j], render[i:k])
    if not removed:
        return "other"
    if not inserted:
        return "drop"
    old, new = removed[0], inserted[0]
    if old.get("role") == new.get("role") == "tool" and old.get("tool_call_id") == new.get("tool_call_id"):
        ot, nt = _text(old), _text(new)
        if len(nt) < len(ot) and (tail or len(removed) == len(inserted) == 1):
            if _TRUNC_MARKER.search(nt) and not _TRUNC_MARKER.search(ot):
                return "truncate"
            if "\n" not in nt.strip() and len(nt) <= 80:
                return "mask"
        return "other"
    if tail and all(m.get("role") == "tool" or m.get("tool_calls") and not _text(m) for m in removed):
        ids = {c.get("id") for m in removed for c in m.get("tool_calls") or ()}
        ids |= {m.get("tool_call_id") for m in removed if m.get("role") == "tool"}
        ids.discard(None)  # (calls without ids: every message without one matched them)
        gone = (not ids & {m.get("tool_call_id") for m in render} if ids
                else not any(r in new_r for r in prev_r[i:]))
        if gone:
            return "drop"  # call/output pairs dropped from the end, then new messages
    summary_like = new.get("role") != "tool" and not new.get("tool_calls")
    if summary_like and len(removed) >= 2 and (tail or len(inserted) == 1):
        return "summarize"
    return "other"


def trace_summary(sessions: Iterable[AgentSession]) -> dict:
    """Counts over a trace: sessions, steps, steps per kind (:func:`classify_step`),
    edit steps (neither ``first`` nor ``append``) and their share, and the mean / max
    render length in messages."""
    kinds: Counter[str] = Counter({k: 0 for k in STEP_KINDS})
    lengths: list[int] = []
    n_sessions = 0
    for s in sessions:
        n_sessions += 1
        prev = None
        for r in s.renders:
            kinds[classify_step(prev, r)] += 1
            lengths.append(len(r))
            prev = r
    steps = len(lengths)
    edits = steps - kinds["first"] - kinds["append"]
    return {
        "sessions": n_sessions,
        "steps": steps,
        "kinds": dict(kinds),
        "edit_steps": edits,
        "edit_share": round(edits / steps, 4) if steps else 0.0,
        "mean_messages": round(sum(lengths) / steps, 2) if steps else 0.0,
        "max_messages": max(lengths, default=0),
    }


# --------------------------------------------------------------------------- BFCL data
