"""Agent workload traces: the JSONL format, its strict reader, and a BFCL-based generator.

Trace format
------------
JSONL, one agent session a line (blank lines are skipped)::

    {"id": str, "tools": [tool schema, ...], "renders": [[message, ...], ...]}

Each render is the *full* OpenAI-style chat message list the agent sends at one model
call, in order.  A tool schema is ``{"type": "function", "function": {"name": str,
"description": str (optional), "parameters": object (optional)}}``.  A message has a
``role`` (``system``, ``user``, ``assistant``, ``tool``) and string ``content``; an
assistant message may carry ``tool_calls`` (``[{"id", "type": "function", "function":
{"name", "arguments": <JSON text>}}]``, then ``content`` may be null or absent); a tool
message carries ``tool_call_id`` naming a call of an earlier assistant message *in the
same render*.  Unknown extra keys (top level, in messages, in schemas) are tolerated and
ignored, so traces from other harnesses load; :func:`write_agent_trace` writes only the
three keys.  :func:`iter_agent_trace` raises
:class:`~promptsplice.errors.TraceFormatError` (``FILE:LINE: field: what is wrong; how
to fix it``) on invalid UTF-8 or JSON (a number out of the float range and nesting too
deep to parse included), a lone surrogate anywhere (a ``\\udXXX`` escape without its
pair), a missing key, a wrong type, an empty ``renders``
or render, a message without or with an unknown role, a tool message without (or with a
dangling) ``tool_call_id``, a duplicate session id, and a file with no session at all.
So whatever it reads, :func:`write_agent_trace` writes back as a valid trace.

Step labels
-----------
:func:`classify_step` labels a step from two successive renders alone: ``first``,
``append``, or by what changed at the first changed message: ``truncate`` (the ten-line
rule's marker, as :class:`promptsplice.assembler.TruncateToolOutputs` writes it), ``mask`` (a tool
output replaced by a short one-line placeholder), ``drop`` (messages removed, nothing
put in), ``summarize`` (several messages replaced by one), else ``other``.

The generator (:func:`generate_agent_trace`)
--------------------------------------------
Sessions are built from the 200 BFCL multi-turn base tasks shipped by the PyPI package
``bfcl-eval`` (installed ``--no-deps``; only its JSON data and pure-Python simulated APIs
are used).  Per task: the ground-truth calls are executed against the simulated API
instances, loaded with ``_load_scenario(initial_config)`` as BFCL does, so every tool
output is the API's real answer (dicts as ``json.dumps(result, indent=2)``: the harness
pretty-prints, so listings have one line per entry; ``indent=None`` gives BFCL's compact
strings).  The agent writes one call per assistant message, gets its output, and ends
each user turn with a short answer; each model call is one render.  Realism knobs, all
drawn from one seeded ``random.Random``:

* the starting directory of the file system gets 10-22 extra plausible files, and turns
  sometimes start with a read-only look-around call (``ls``, ``list_all_airports`` ...),
  so some outputs are long listings;
* failed calls: a ground-truth call preceded by a wrong attempt (a mistyped value whose
  real API answer is an error, else a wrong argument name whose real ``TypeError`` is
  reported as BFCL's executor does: ``Error during execution: ...``); the failed call and
  its output are dropped once retried, immediately or one or two user turns later (the
  first failure sits at the session's first call: an early failure dropped late);
* context policies per session: the ten-line rule (:class:`promptsplice.assembler.TruncateToolOutputs`,
  defaults), observation masking (all but the two latest tool outputs become
  ``[output omitted]``; in half the masking sessions a new user turn masks all earlier
  outputs, as context editing that clears old tool results does), forgetting (in some
  sessions a new user turn drops the earlier turns' calls and outputs, keeping the
  requests and answers, as chat front-ends do), and a summary of the completed first half of the turns
  (:func:`promptsplice.assembler.summarize_turns`, deterministic text listing the replaced calls and
  short results), also forced whenever a render would exceed ``max_tokens``.

Edits persist (a truncated output stays truncated), as in a real agent.  Tools are the
functions the session calls plus 2-4 distractors of the involved APIs, with BFCL's
per-API preamble cut from the descriptions, so renders stay within SmolLM2's 4096-token
context (estimated conservatively at 3 characters a token).  Tasks that give fewer than
6 steps are skipped (the next task is taken); a session with fewer than half its steps
edits is redrawn (see :func:`generate_agent_trace`); ``num_sessions`` beyond 200 reuses
tasks with new draws.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import json
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.traces import (  # one strict JSON reader
    _finite_float,
    _lone_surrogate,
    _reject_constant,
    _strict_object,
)
from promptsplice.errors import AssetError, ConfigError, TraceFormatError

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
    "generate_agent_trace",
]

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
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


def _check_message(w: _Where, msg: Any, fld: str, call_ids: set[str]) -> None:
    w.typed(msg, dict, fld, "an object (a chat message)", 'write each message as {"role": ..., "content": ...}')
    if "role" not in msg:
        raise w.fail(fld, "message without 'role'", f"add a role, one of {', '.join(ROLES)}")
    role = msg["role"]
    if role not in ROLES:
        raise w.fail(f"{fld}.role", f"unknown role {role!r}", f"use one of {', '.join(ROLES)}")
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise w.fail(f"{fld}.tool_calls", f"tool_calls on a {role} message", "only assistant messages call tools")
        fix = 'write calls as [{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON>"}}]'
        w.typed(calls, list, f"{fld}.tool_calls", "an array", fix)
        for k, call in enumerate(calls):
            cf = f"{fld}.tool_calls[{k}]"
            w.typed(call, dict, cf, "an object", fix)
            cid = w.typed(call.get("id"), str, f"{cf}.id", "a string", fix)
            if call.get("type", "function") != "function":
                raise w.fail(f"{cf}.type", f'expected "function", got {call.get("type")!r}', fix)
            fn = w.typed(call.get("function"), dict, f"{cf}.function", "an object", fix)
            w.typed(fn.get("name"), str, f"{cf}.function.name", "a string", fix)
            args = w.typed(fn.get("arguments"), str, f"{cf}.function.arguments", "a string of JSON", fix)
            try:
                json.loads(args)
            except (ValueError, RecursionError) as exc:
                raise w.fail(f"{cf}.function.arguments", f"not JSON text ({exc})", fix) from None
            call_ids.add(cid)
    content = msg.get("content")
    if role == "assistant" and calls:
        if content is not None and not isinstance(content, str):
            raise w.fail(f"{fld}.content", f"expected a string or null, got {_type_name(content)}",
                         "put the assistant's text in content as a string")
    elif not isinstance(content, str):
        got = "no 'content'" if "content" not in msg else f"content is {_type_name(content)}"
        raise w.fail(f"{fld}.content", f"expected a string, {got}", f"give the {role} message its text as a string")
    if role == "tool":
        tcid = msg.get("tool_call_id")
        if tcid is None:
            raise w.fail(fld, "tool message without 'tool_call_id'",
                         "add the id of the assistant tool call it answers")
        w.typed(tcid, str, f"{fld}.tool_call_id", "a string", "use the call's id")
        if tcid not in call_ids:
            raise w.fail(f"{fld}.tool_call_id", f"{tcid!r} answers no tool call of an earlier assistant message "
                         "in this render", "keep the assistant message that made the call, or drop this output too")


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
        for m, msg in enumerate(render):
            _check_message(w, msg, f"renders[{r}][{m}]", call_ids)
    return AgentSession(sid, tools, renders)


def iter_agent_trace(path: str | os.PathLike[str]) -> Iterator[AgentSession]:
    """Yield the sessions of a JSONL agent trace one by one, validating each line
    (see the module docstring for the errors).  ``OSError`` propagates unchanged."""
    name = os.fspath(path)
    seen: dict[str, int] = {}
    with open(name, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            w = _Where(f"{name}:{lineno}")
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise w.fail("line", f"invalid UTF-8 at byte {exc.start}", "write the trace as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line, object_pairs_hook=_strict_object, parse_constant=_reject_constant,
                                 parse_float=_finite_float)
            except (ValueError, RecursionError) as exc:
                raise w.fail("line", f"not JSON ({exc})", "write one JSON object per line") from None
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
    Creates the parent folder when missing."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(p, "w", encoding="utf-8", newline="\n") as fh:
        for s in sessions:
            fh.write(json.dumps(s.to_json(), ensure_ascii=False, separators=(",", ":")))
            fh.write("\n")
            n += 1
    return n


# --------------------------------------------------------------------------- step labels


def edit_depth(prev_render: list[dict] | None, render: list[dict]) -> int:
    """Index of the first message of ``render`` that differs from ``prev_render``
    (0 = the system message): ``len(prev_render)`` for a pure append, 0 for the first
    step (``prev_render`` None or empty)."""
    if not prev_render:
        return 0
    n = min(len(prev_render), len(render))
    for i in range(n):
        if prev_render[i] != render[i]:
            return i
    return n


def _text(msg: dict) -> str:
    c = msg.get("content")
    return c if isinstance(c, str) else ""


def classify_step(prev_render: list[dict] | None, render: list[dict]) -> str:
    """Label the step from ``prev_render`` to ``render`` (one of :data:`STEP_KINDS`).

    ``first`` without a previous render; ``append`` when it is a prefix of ``render``.
    Otherwise, from the first changed message ``i``, the removed stretch ``prev[i:j]``
    and the inserted one ``render[i:k]`` run up to the first message of ``render`` that
    reappears later in ``prev`` (messages compare as whole dicts); when none does, the
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
    i = edit_depth(prev_render, render)
    if i == len(prev_render):
        return "append"
    k = j = -1
    for kk in range(i, len(render)):
        try:
            j = prev_render.index(render[kk], i)
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
        if not ids & {m.get("tool_call_id") for m in render}:
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

_BFCL = "bfcl_eval"
_API_PREFIX = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code."
_API_MODULES = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
_STATELESS = ("MathAPI",)
# Read-only look-around calls an agent makes before acting (valid in any state).
_EXPLORE = {
    "GorillaFileSystem": ("ls", {"a": True}),
    "TravelAPI": ("list_all_airports", {}),
    "TradingBot": ("get_available_stocks", {"sector": "Technology"}),
    "MessageAPI": ("list_users", {}),
    "VehicleControlAPI": ("check_tire_pressure", {}),
}
_EXTRA_FILES = (
    "README.md", "notes.txt", "todo.md", "budget_2024.xlsx", "meeting_minutes.docx", "backup.tar.gz",
    "draft_v2.docx", "summary.pdf", "invoice_0042.pdf", "photo_001.jpg", "photo_002.jpg", "setup.sh",
    "requirements.txt", "data_export.csv", "old_config.yaml", "presentation.pptx", "contacts.vcf",
    "schedule.ics", "archive_2022.zip", "index.html", "styles.css", "main.py", "utils.py", "test_main.py",
    ".gitignore", ".env.example", "LICENSE", "CHANGELOG.md", "reading_list.txt", "passwords.kdbx",
    "travel_itinerary.pdf", "tax_return_2023.pdf", "resume.docx", "cover_letter.docx", "scratch.txt",
    "diagram.svg", "Makefile", "server.log", "error.log", "metrics.json",
)


def _bfcl_root() -> Path:
    spec = importlib.util.find_spec(_BFCL)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(
            "the BFCL data package 'bfcl_eval' is not installed; run `make setup` "
            "(or `pip install --no-deps bfcl-eval`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def _bfcl_tasks() -> tuple[tuple[dict, list[list[str]]], ...]:
    """The multi-turn base tasks with their ground-truth call strings, in file order."""
    root = _bfcl_root() / "data"
    try:
        with open(root / "BFCL_v4_multi_turn_base.json", encoding="utf-8") as fh:
            tasks = [json.loads(line) for line in fh if line.strip()]
        with open(root / "possible_answer" / "BFCL_v4_multi_turn_base.json", encoding="utf-8") as fh:
            answers = {(a := json.loads(line))["id"]: a["ground_truth"] for line in fh if line.strip()}
    except (OSError, ValueError) as exc:
        raise AssetError(f"cannot read the BFCL multi-turn data under {root}: {exc}; reinstall bfcl-eval") from exc
    out = []
    for t in tasks:
        if t["id"] not in answers or len(answers[t["id"]]) != len(t["question"]):
            raise AssetError(f"BFCL task {t['id']} has no matching ground truth; reinstall bfcl-eval")
        if all(c in _API_MODULES for c in t["involved_classes"]):
            out.append((t, answers[t["id"]]))
    return tuple(out)


def _bfcl_type(schema: Any) -> Any:
    """A BFCL parameter schema as JSON schema (``dict`` -> ``object``, ``float`` ->
    ``number``, ``tuple`` -> ``array``, ``any`` -> no type)."""
    if isinstance(schema, list):
        return [_bfcl_type(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bfcl_type(v) for k, v in schema.items()}
    t = schema.get("type")
    if isinstance(t, str):
        mapped = {"dict": "object", "float": "number", "tuple": "array", "any": None}.get(t, t)
        if mapped is None:
            out.pop("type")
        else:
            out["type"] = mapped
    return out


@lru_cache(maxsize=1)
def _bfcl_tools() -> dict[str, list[dict]]:
    """Per API class, its functions as OpenAI tool schemas (doc order); descriptions keep
    only the text after BFCL's per-API preamble ``... Tool description: ``."""
    root = _bfcl_root() / "data" / "multi_turn_func_doc"
    out: dict[str, list[dict]] = {}
    for cls, (_, doc) in _API_MODULES.items():
        with open(root / doc, encoding="utf-8") as fh:
            docs = [json.loads(line) for line in fh if line.strip()]
        out[cls] = [
            {"type": "function", "function": {
                "name": d["name"],
                "description": d["description"].split("Tool description: ", 1)[-1].strip(),
                "parameters": _bfcl_type(d["parameters"]),
            }}
            for d in docs
        ]
    return out


def _format_result(result: Any, indent: int | None) -> str:
    """An API result as BFCL's executor formats it (str as is, dicts as JSON, else
    ``str``), with ``indent`` for dicts and lists."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result, indent=indent)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


class _Env:
    """The task's simulated API instances, loaded as BFCL loads them."""

    def __init__(self, task: dict, rng: random.Random, enlarge: bool) -> None:
        config = copy.deepcopy(task["initial_config"])
        if enlarge and "GorillaFileSystem" in task["involved_classes"]:
            _enlarge_fs(config.setdefault("GorillaFileSystem", {}), rng, json.dumps(task))
        self.instances: dict[str, Any] = {}
        self.owner: dict[str, str] = {}
        for cls in task["involved_classes"]:
            module, _ = _API_MODULES[cls]
            try:
                inst = getattr(importlib.import_module(_API_PREFIX + module), cls)()
            except ImportError as exc:
                raise AssetError(f"cannot import BFCL's simulated API {cls}: {exc}; reinstall bfcl-eval") from exc
            if cls not in _STATELESS:
                inst._load_scenario(copy.deepcopy(config.get(cls, {})))
            self.instances[cls] = inst
            for name, _m in inspect.getmembers(inst, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.owner.setdefault(name, cls)

    def call(self, name: str, kwargs: dict, *, dry: bool = False, indent: int | None = 2) -> str:
        """Run ``name(**kwargs)``; errors come back as BFCL reports them.  ``dry`` runs it
        on a copy of the instance (the state is untouched)."""
        inst = self.instances[self.owner[name]]
        if dry:
            inst = copy.deepcopy(inst)
        try:
            return _format_result(getattr(inst, name)(**kwargs), indent)
        except Exception as exc:  # noqa: BLE001 - BFCL reports every API error as text
            return f"Error during execution: {exc}"

    def kwargs(self, call: str) -> tuple[str, dict]:
        """A ground-truth call string as (name, keyword arguments)."""
        node = ast.parse(call.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise AssetError(f"unexpected BFCL ground-truth call {call!r}; reinstall bfcl-eval")
        name = node.func.id
        args = [ast.literal_eval(a) for a in node.args]
        kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        method = getattr(self.instances[self.owner[name]], name)
        return name, dict(inspect.signature(method).bind(*args, **kw).arguments)


def _enlarge_fs(config: dict, rng: random.Random, avoid: str) -> None:
    """Add 10-22 plausible files to the starting directory (names used nowhere in the
    task), so ``ls`` there is a long listing."""
    root = config.get("root")
    if not isinstance(root, dict) or not root:
        return
    top = next(iter(root.values()))
    contents = top.setdefault("contents", {})
    pool = [n for n in _EXTRA_FILES if n not in avoid and n.rsplit(".", 1)[0] not in avoid]
    for name in sorted(rng.sample(pool, min(len(pool), rng.randint(10, 22)))):
        contents.setdefault(name, {"type": "file", "content": f"Contents of {name}."})


# --------------------------------------------------------------------------- generator

SYSTEM_PROMPT = (
    "You are a capable assistant that completes the user's requests by calling the tools "
    "provided. Call one tool at a time and read its result before the next call. If a call "
    "fails, fix the arguments and retry. When a request is done, reply with a short summary "
    "of what you did."
)


def _short(text: str, n: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: n - 3] + "..."


def _summarize(messages: list[Message]) -> str:
    """Deterministic summary of a stretch: user requests, calls with short results."""
    lines: list[str] = []
    outputs = {m.get("tool_call_id"): _text(m) for m in messages if m.get("role") == "tool"}
    for m in messages:
        if m["role"] == "user":
            lines.append(f"- The user asked: {_short(_text(m), 100)}")
        elif m["role"] == "assistant" and m.get("tool_calls"):
            for c in m["tool_calls"]:
                fn = c["function"]
                args = ", ".join(f"{k}={v!r}" for k, v in json.loads(fn["arguments"]).items())
                lines.append(f"  - {fn['name']}({args}) -> {_short(outputs.get(c['id'], 'no output'))}")
    return "\n".join(lines)


def _mistake(env: _Env, name: str, kwargs: dict, rng: random.Random, indent: int | None) -> tuple[dict, str]:
    """A wrong attempt at ``name(**kwargs)`` and its real error output."""
    strs = [k for k, v in kwargs.items() if isinstance(v, str) and len(v) > 2]
    if strs:
        key = rng.choice(strs)
        val = kwargs[key]
        cut = rng.randrange(1, len(val) - 1)
        bad = {**kwargs, key: val[:cut] + val[cut + 1:]}  # a typo: one character lost
        out = env.call(name, bad, dry=True, indent=indent)
        if _is_error(out):
            return bad, out
    params = set(inspect.signature(getattr(env.instances[env.owner[name]], name)).parameters)
    wrong = next(w for w in rng.sample(["verbose", "path", "id", "name", "value", "query", "target"], 7)
                 if w not in params)  # an argument name the function does not take: a real TypeError
    if kwargs:
        key = rng.choice(sorted(kwargs))
        bad = {(wrong if k == key else k): v for k, v in kwargs.items()}
    else:
        bad = {wrong: True}
    return bad, env.call(name, bad, dry=True, indent=indent)


def _is_error(text: str) -> bool:
    from promptsplice.assembler import is_error_output

    return is_error_output({"role": "tool", "content": text})


@dataclass(slots=True)
class _Call:
    name: str
    kwargs: dict
    failed_of: int | None = None  # set on a wrong attempt: drop once retried, this many turns later


def _default_count(tools: list[dict], messages: list[Message]) -> int:
    """Conservative token estimate: 3 characters a token plus 20 per message (template
    tokens and block padding)."""
    chars = len(json.dumps(tools)) + sum(len(json.dumps(m)) for m in messages)
    return chars // 3 + 20 * len(messages) + 40


def _build_session(
    sid: str, task: dict, truth: list[list[str]], rng: random.Random, *, indent: int | None,
    max_tokens: int, count_tokens: Callable[[list[dict], list[dict]], int],
) -> AgentSession:
    from promptsplice.assembler import TruncateToolOutputs, summarize_turns

    env = _Env(task, rng, enlarge=True)
    use_trunc = rng.random() < 0.85
    use_mask = rng.random() < 0.95
    mask_turns = rng.random() < 0.5  # a new user turn also masks the last turn's outputs
    use_fail = rng.random() < 0.75
    forget_turns = rng.random() < 0.25  # a new user turn drops the earlier turns' calls and outputs
    use_summary = not forget_turns and len(truth) >= 3 and rng.random() < 0.6
    # plan: per turn, the calls to make (look-arounds, wrong attempts, ground truth)
    plan: list[list[_Call]] = []
    first_fail = use_fail
    for turn in truth:
        calls: list[_Call] = []
        gt = [env.kwargs(c) for c in turn]
        classes = {env.owner[n] for n, _ in gt}
        for cls in sorted(classes):
            if cls in _EXPLORE and rng.random() < 0.75:
                calls.append(_Call(*_EXPLORE[cls]))
        for name, kw in gt:
            if use_fail and (first_fail or rng.random() < 0.4):
                delay = rng.choice([1, 2]) if first_fail and len(truth) > 1 else rng.choice([0, 1, 1])
                calls.append(_Call(name, kw, failed_of=delay))
                first_fail = False
            calls.append(_Call(name, kw))
        plan.append(calls)
    used = {c.name for turn in plan for c in turn}
    schemas = {t["function"]["name"]: t for cls in task["involved_classes"] for t in _bfcl_tools()[cls]}
    excluded = set(task.get("excluded_function") or ())
    spare = sorted(n for n in schemas if n not in used and n not in excluded)
    chosen = used | set(rng.sample(spare, min(len(spare), rng.randint(2, 4))))
    tools = [t for n, t in schemas.items() if n in chosen]

    truncate = TruncateToolOutputs()
    ctx: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT}]
    renders: list[list[Message]] = []
    pending: list[tuple[int, str, str]] = []  # (drop at turn, failed call id, retry name)
    n_calls = 0
    summary_turn = (len(truth) + 1) // 2 if use_summary else None

    def step(turn_no: int, turn_start: bool) -> None:
        nonlocal ctx
        for entry in list(pending):
            at, cid, name = entry
            where = [(i, c) for i, m in enumerate(ctx) for c in m.get("tool_calls") or ()]
            a = next((i for i, c in where if c["id"] == cid), None)
            retried = a is not None and any(i > a + 1 and c["function"]["name"] == name for i, c in where)
            if a is None:  # summarized away
                pending.remove(entry)
            elif turn_no >= at and retried and any(
                m.get("tool_call_id") and i > a + 1 for i, m in enumerate(ctx)
            ):
                del ctx[a : a + 2]  # the wrong attempt and its error output
                pending.remove(entry)
        if forget_turns and turn_start:
            ctx = [m for m in ctx if m["role"] in ("system", "user") or not m.get("tool_calls") and m["role"] != "tool"]
        if use_trunc:
            ctx = truncate.apply(ctx).messages
        if use_mask:
            outs = [i for i, m in enumerate(ctx) if m["role"] == "tool"]
            for i in outs if (turn_start and mask_turns) else outs[:-2]:
                if len(ctx[i]["content"]) > len(MASK_PLACEHOLDER):
                    ctx[i] = {**ctx[i], "content": MASK_PLACEHOLDER}
        if turn_start and turn_no == summary_turn and len(ctx) > 3:
            ctx = summarize_turns(ctx, 1, len(ctx) - 1, _summarize).messages
        if count_tokens(tools, ctx) > max_tokens:
            # over budget: summarize everything but the latest call and its output
            end = len(ctx) - 2 if ctx[-1]["role"] == "tool" else len(ctx) - 1
            if end > 1:
                ctx = summarize_turns(ctx, 1, end, _summarize).messages
            if count_tokens(tools, ctx) > max_tokens:
                raise ConfigError(
                    f"session {sid}: a render needs more than max_tokens={max_tokens} tokens even after "
                    "summarizing; raise max_tokens"
                )
        renders.append(copy.deepcopy(ctx))

    for t, (question, calls) in enumerate(zip(task["question"], plan)):
        ctx.append({"role": "user", "content": question[0]["content"]})
        step(t, True)
        for call in calls:
            n_calls += 1
            cid = f"call_{n_calls:03d}"
            if call.failed_of is not None:
                kw, out = _mistake(env, call.name, call.kwargs, rng, indent)
                pending.append((t + call.failed_of, cid, call.name))
            else:
                kw, out = call.kwargs, env.call(call.name, call.kwargs, indent=indent)
            ctx.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": cid, "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(kw)}}]})
            ctx.append({"role": "tool", "tool_call_id": cid, "content": out})
            step(t, False)
        names = ", ".join(dict.fromkeys(c.name for c in calls if c.failed_of is None))
        last = _text(ctx[-1]) if ctx[-1]["role"] == "tool" else ""
        ctx.append({"role": "assistant", "content": f"Done: I called {names}. Last result: {_short(last, 100)}"})
    return AgentSession(sid, tools, renders)


def generate_agent_trace(
    num_sessions: int,
    *,
    seed: int = 0,
    max_tokens: int = 3500,
    indent: int | None = 2,
    min_steps: int = 6,
    min_edit_share: float = 0.5,
    count_tokens: Callable[[list[dict], list[dict]], int] | None = None,
) -> list[AgentSession]:
    """Generate ``num_sessions`` realistic agent sessions from BFCL's multi-turn tasks
    (see the module docstring).  Deterministic per ``seed``.

    ``count_tokens(tools, messages)`` sizes a render (default: a conservative
    characters/3 estimate); a render over ``max_tokens`` triggers a summary.
    ``indent`` formats dict/list tool outputs (``None``: BFCL's compact JSON).  Tasks
    giving fewer than ``min_steps`` renders are skipped.  A session whose share of edit
    steps is below ``min_edit_share`` is rebuilt with a new draw of its policy mix and
    failures (up to 8 draws; the draw with the most edits is kept).
    """
    if isinstance(num_sessions, bool) or not isinstance(num_sessions, int) or num_sessions < 0:
        raise ConfigError(f"num_sessions must be an int >= 0, got {num_sessions!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1000:
        raise ConfigError(f"max_tokens must be an int >= 1000 (tool schemas alone take ~1k), got {max_tokens!r}")
    tasks = list(_bfcl_tasks())
    rng = random.Random(f"agent-trace:{seed}")
    counter = count_tokens or _default_count
    out: list[AgentSession] = []
    rounds = 0
    while len(out) < num_sessions:
        order = list(range(len(tasks)))
        rng.shuffle(order)
        before = len(out)
        for ti in order:
            if len(out) >= num_sessions:
                break
            task, truth = tasks[ti]
            best: tuple[float, AgentSession] | None = None
            for attempt in range(8):  # redraw the policy mix until half the steps are edits
                sub = random.Random(f"{seed}:{rounds}:{task['id']}:{attempt}")
                session = _build_session(f"s{len(out):04d}-{task['id']}", task, truth, sub, indent=indent,
                                         max_tokens=max_tokens, count_tokens=counter)
                share = trace_summary([session])["edit_share"]
                if best is None or share > best[0]:
                    best = (share, session)
                if share >= min_edit_share:
                    break
            if len(best[1].renders) >= min_steps:
                out.append(best[1])
        if len(out) == before:
            raise ConfigError(f"no BFCL task gives {min_steps} steps or more; lower min_steps")
        rounds += 1
    return out
