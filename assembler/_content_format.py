"""What vLLM's chat endpoint hands a chat template: content in its ``"string"`` or
``"openai"`` form, and only the message fields and call arguments it passes on.

vLLM's chat endpoint reads the template's jinja AST (``vllm/renderers/hf.py``:
``_detect_content_format``): a template that loops over a message's ``content`` (or
over a macro parameter a message's content is passed in, or over a top-level
``content`` variable) gets every message's content as a list of parts
(``{"type": "text", "text": ...}``); any other template gets one str, the text parts
joined with a newline.  Such templates (Gemma 3, Llama 4, Mistral Small) usually join
the parts with nothing, so the two forms render differently, and the renderer must
hand the template what vLLM hands it for the prefix cache to hit.  This module is that
detection, ported node for node so that the two agree on every template, and the
content as vLLM passes it on: the part list of the ``"openai"`` format
(:func:`content_parts`) and a system message without Claude Code's per-request
billing-header line (:func:`strip_billing_header`); the fields it passes on
(:func:`template_fields`) and its calls with their arguments parsed
(:func:`template_calls`, :func:`template_arguments`).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from promptsplice.errors import InvalidMessageError, NonTextContentError

__all__ = [
    "BILLING_HEADER",
    "TEXT_PART_FIELDS",
    "ContentFormat",
    "content_parts",
    "detect_content_format",
    "part_text",
    "strip_billing_header",
    "template_arguments",
    "template_calls",
    "template_fields",
]

ContentFormat = Literal["string", "openai"]


def _is_var(node: Any, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: Any, name: str, key: str) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: Any, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name[key]`` / ``name.key``), through filters, tests and slices."""
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root: Any, name: str) -> Iterator[str]:
    """``name`` and every variable assigned from it (``{% set ms = messages %}``)."""
    from jinja2 import nodes

    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                _name_target(assign.target)
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_loop_targets(root: Any) -> list[str]:
    """The loop variables of ``{% for message in messages %}`` (or an alias of it)."""
    from jinja2 import nodes

    names = list(_names_bound_to(root, "messages"))
    out: list[str] = []
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, n) for n in names):
            out.append(_name_target(loop.target))
    return out


def _loops_over_content(root: Any) -> bool:
    from jinja2 import nodes

    messages = _message_loop_targets(root)
    # macro parameters that get a message's content as an argument
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = [a.name for a in macro.args]
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(names) and any(_is_var_or_elems(arg, m, "content") for m in messages):
                    params.add(names[i])
            for kw in call.kwargs:
                if kw.key in names and any(_is_var_or_elems(kw.value, m, "content") for m in messages):
                    params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(nodes.For):
        it = loop.iter
        params = params_by_loop.get(id(loop))
        if (
            any(_is_var_or_elems(it, m, "content") for m in messages)
            or (isinstance(it, nodes.Name) and params is not None and it.name in params)
            or (isinstance(it, nodes.Name) and id(loop) not in in_macros and it.name == "content")
        ):
            _name_target(loop.target)
            return True
    return False


def _name_target(node: Any) -> str:
    """The variable a matched loop or assignment binds; vLLM asserts it is one name (a
    tuple there makes its detection fail, and the template read as ``"string"``)."""
    from jinja2 import nodes

    if not isinstance(node, nodes.Name):
        raise ValueError("not one name")
    return node.name


def detect_content_format(env: Any, source: str) -> ContentFormat:
    """``"openai"`` if the template (parsed by ``env``) loops over message content, else
    ``"string"``; a template that does not parse is ``"string"``, vLLM's default."""
    try:
        ast = env.parse(source)
    except Exception:  # vLLM: "Error when compiling Jinja template" -> the default
        return "string"
    try:
        return "openai" if _loops_over_content(ast) else "string"
    except Exception:  # vLLM: "Error when parsing AST" -> the default
        return "string"


_KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio",
    "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url",
})  # fmt: skip
"""The content-part fields vLLM reads (``_KNOWN_CONTENT_PART_FIELDS``); any other field of
a text part reaches an ``"openai"``-format template with it."""


TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}
"""Content-part types vLLM's chat endpoint reads as text (``TEXT_PART_TYPES``), each with
the field its text is in; a part with no ``type`` is read as ``text`` here."""


def part_text(part: Any, index: int) -> str | None:
    """A content part's text as vLLM's chat endpoint reads it: a bare str, or a part of
    a :data:`TEXT_PART_FIELDS` type; ``None`` for a text or refusal part whose text is
    ``None`` (vLLM leaves it out).  Any other part raises :class:`NonTextContentError`."""
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        kind = part.get("type", "text")
        field = TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
        if field is not None:
            text = part.get(field)
            if isinstance(text, str):
                return text
            if text is None and kind in ("text", "refusal"):
                return None
    raise NonTextContentError(f"message {index}: only text content parts can be rendered, got {part!r:.80}")


def content_parts(content: Any, index: int) -> list[dict[str, Any]]:
    """A message's content as the part list an ``"openai"``-format template gets from
    vLLM's chat endpoint: a str as one text part, ``None`` as no part, each text part
    (bare strings, ``input_text``, ``refusal``... too: :func:`part_text`) as ``{"type":
    "text", "text": ...}`` with its other fields, empty ones kept.  Non-text parts raise
    :class:`NonTextContentError`."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        out: list[dict[str, Any]] = []
        for part in content:
            text = part_text(part, index)
            if text is None:
                continue
            extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS} if isinstance(part, Mapping) else {}
            out.append({"type": "text", "text": text, **extra})
        return out
    raise InvalidMessageError(
        f"message {index}: content must be a str, a list of text parts or None, got {type(content).__name__}"
    )


BILLING_HEADER = "x-anthropic-billing-header"
"""The first line of Claude Code's system prompt: its ``cch`` value changes with every
request, so vLLM's chat endpoint drops it (``_strip_claude_code_billing_header``)."""


def strip_billing_header(content: Any) -> Any:
    """A system message's content as vLLM's chat endpoint keeps it: a text part (or the
    str) that starts with :data:`BILLING_HEADER` loses its first line, and is left out
    when nothing follows it.  Other content is returned as is."""
    if isinstance(content, str):
        if not content.startswith(BILLING_HEADER):
            return content
        rest = content.partition("\n")[2]
        return rest if rest else []
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        return content
    out: list[Any] = []
    changed = False
    for part in content:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        changed = True
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out if changed else content


def template_arguments(args: Any) -> Any:
    """A tool call's ``arguments`` as vLLM's chat endpoint hands them to a template that
    renders tool calls itself (``vllm/renderers/chat_utils.py::_postprocess_messages``):
    JSON text parsed with ``json.loads`` (a Qwen2.5, Llama-3.1 or Hermes template then
    prints the object, ``"arguments": {"q": "a"}``, not the text again as a JSON string),
    an object as it is, and whatever is no JSON object then as ``{}``: no arguments,
    ``""``, text that is not JSON (vLLM logs a warning and goes on), JSON that is not an
    object (``"[1]"``, ``"42"``).  Text vLLM itself fails on (nested too deeply for
    Python's parser, an int past its digit limit) is ``{}`` too, as text that is not JSON."""
    if not args:  # None, "", {}, []: vLLM's `if content := function.get("arguments")`
        return {}
    if isinstance(args, Mapping):  # a dict, as the request's JSON reaches vLLM
        return dict(args)
    parsed = args
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return {}
    return parsed if isinstance(parsed, dict) else {}


def template_fields(m: Mapping[str, Any]) -> dict[str, Any]:
    """``m`` with only the fields vLLM's chat endpoint passes on to a template
    (``_parse_chat_message_content``): ``role`` and ``content``; ``tool_calls`` (which
    :func:`template_calls` keeps for an assistant only); an assistant's ``reasoning`` (or
    its deprecated name ``reasoning_content``, which vLLM's request model renames), as
    both ``reasoning`` and ``reasoning_content`` (Qwen3's templates read that one); a
    tool output's ``tool_call_id``; a str ``name`` or ``task``; a developer message's
    ``tools``.  Any other key (an id, a status) never reaches the template there: it
    reached it here, and a template that reads it rendered another prompt than vLLM's.
    (A legacy ``function_call``, which vLLM drops, is rendered as the call it is:
    :func:`canonical_calls`.)"""
    role = m["role"]
    out: dict[str, Any] = {"role": role, "content": m.get("content")}
    if "tool_calls" in m:
        out["tool_calls"] = m["tool_calls"]
    # vLLM's request model renames a deprecated reasoning_content to reasoning first
    reasoning = m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content")
    if role == "assistant" and reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    if role == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def template_calls(m: Mapping[str, Any]) -> Mapping[str, Any]:
    """``m`` (its calls already in the OpenAI form, :func:`canonical_calls`) as vLLM's
    chat endpoint hands it to a template that renders ``tool_calls`` itself: an
    assistant message's calls with their ``arguments`` through :func:`template_arguments`
    (each call and its function copied: the caller's dicts are not touched); an empty or
    ``None`` ``tool_calls`` left out, as vLLM leaves it out (a Llama-3.1 template tests
    ``'tool_calls' in message``), and so are the calls of any other role, which vLLM never
    passes on.  A call without ``function`` (a flat ``{"name", "arguments"}``, which vLLM
    refuses) gets the same arguments, so JSON text and its object render alike."""
    if "tool_calls" not in m:
        return m
    calls = m["tool_calls"]
    if m.get("role") != "assistant" or not calls:
        return {k: v for k, v in m.items() if k != "tool_calls"}
    fixed = []
    for c in calls:  # dicts with a function name (checked by _tool_call_text first)
        if isinstance(c.get("function"), Mapping):
            fn = _fields_first({**c["function"], "arguments": template_arguments(c["function"].get("arguments"))},
                               ("arguments", "name"))
            c = _fields_first({**c, "function": fn}, ("id", "function", "type"))
        else:
            c = {**c, "arguments": template_arguments(c.get("arguments"))}
        fixed.append(c)
    return {k: (fixed if k == "tool_calls" else v) for k, v in m.items()}  # in its place: vLLM's key order


def _fields_first(d: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """``d`` with ``fields`` first, in that order, as vLLM's request model rebuilds a
    call (``{"id", "function": {"arguments", "name"}, "type"}``, any other key after):
    a template that prints a call as it is prints what vLLM's does."""
    return {**{k: d[k] for k in fields if k in d}, **{k: v for k, v in d.items() if k not in fields}}
