"""Context policies: the edits agents make to their own context, as explicit edits.

An agent keeps its message list; a policy returns an edited copy and names what it
changed (:class:`MessageEdit`: which input messages were replaced by which output
messages).  The input is never mutated.  Rendering the edited list and diffing it
against the previous render (:class:`~promptsplice.assembler.ContextHook` does both) turns the edit
into token directives; the edits themselves say *why* a span changed (the benches
report savings by edit kind).

Three policies, as real agents apply them:

* :class:`TruncateToolOutputs` (the "ten-line rule"): a tool output over ``max_lines``
  lines keeps its first and last ``keep_lines`` lines around one marker line,
  ``[... 37 lines truncated ...]``.  ``keep_lines`` defaults to ``(max_lines - 1) // 2``
  (4 for the default 10), so a truncated output has at most ``max_lines`` lines and
  truncating again changes nothing (idempotent: the same input always gives the same
  tokens).  The outputs of the latest ``keep_recent`` turns (default 1; a turn's
  outputs: a run of consecutive tool messages, all of one turn's parallel calls) stay
  whole so the agent can read what it just got; an output is truncated once a newer
  turn's arrives, which is the edit that makes splicing pay.  Lines are ``"\\n"``-separated; a trailing newline is
  kept.
* :class:`DropFailedCalls`: a tool call whose output is an error, once the agent
  retried, is dropped with its output (an assistant's legacy ``function_call`` and its
  ``function`` output too).  *Failed*: the tool message has
  ``status == "error"`` / ``"failed"`` or ``is_error: true``, or its text starts with an
  error word (``Error``, ``error:``, ``TypeError: ...``, ``Exception``, ``Traceback (most
  recent call last)``; case-insensitive, the word not running on into a hyphen or a
  word character and not led by ``no``/``non``, so ``Errors found: 0``, ``Error-free
  run`` and ``no_error: true`` are not one),
  or it is a JSON object whose ``"error"`` is set (as BFCL's simulated APIs answer; ``null``, ``""`` or ``false`` is a success).
  *Retried*: a later assistant message calls a function of the same name.  Outputs are
  matched to calls by ``tool_call_id``, else by order among the tool messages that
  follow the assistant message.  An assistant message left with no call and no text is
  dropped too.
* :class:`SummarizeTurns`: once the list is longer than ``max_messages``, the turns
  after the leading system (or developer) message and before the latest ``keep_recent``
  messages are replaced by one summary message from the user's
  ``summarize(messages) -> str``; a system or developer message among them stays, as
  it is, right after the summary.  The
  stretch never ends on a tool output (a call and its output stay together).
  Summaries are memoized by the content of the stretch, so the next steps reuse the
  same summary (the same tokens) until the list outgrows ``max_messages`` again; then a
  longer stretch is summarized (the callable gets the raw messages).
  :func:`summarize_turns` replaces a given stretch ``messages[start:end]`` once.

Kept as one module (~650 lines): the three policies share one reading of a message
list (which outputs answer which calls, which roles are tool outputs, the checks of
both), and a summary that split a call from its output would break the pairing
:class:`DropFailedCalls` relies on.
"""

from __future__ import annotations

import enum
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from promptsplice._validate import check_format, check_messages, is_int
from promptsplice.assembler._chat_template import join_text_parts
from promptsplice.assembler._content_format import part_text
from promptsplice.assembler._render import canonical_json
from promptsplice.blocks import content_digest
from promptsplice.errors import ConfigError, InputError, InvalidMessageError, InvalidUTF8Error, NonTextContentError

__all__ = [
    "EditKind",
    "MessageEdit",
    "PolicyResult",
    "ContextPolicy",
    "TruncateToolOutputs",
    "DropFailedCalls",
    "SummarizeTurns",
    "summarize_turns",
    "is_error_output",
]

Message = dict[str, Any]


class EditKind(enum.Enum):
    TRUNCATE = "truncate"
    DROP = "drop"
    SUMMARIZE = "summarize"


@dataclass(frozen=True, slots=True)
class MessageEdit:
    """``input[old[0]:old[1]]`` became ``output[new[0]:new[1]]`` (an empty ``new``
    range: dropped)."""

    kind: EditKind
    old: tuple[int, int]
    new: tuple[int, int]


def _check_roles(roles: Any, what: str) -> tuple[str, ...]:
    """A sequence of role names (a lone str would be read as its characters)."""
    if isinstance(roles, (str, bytes)) or not isinstance(roles, Sequence) or not all(isinstance(r, str) for r in roles):
        raise ConfigError(f"{what} must be a list or tuple of role names, e.g. ('tool', 'function'), got {roles!r}")
    return tuple(roles)


class PolicyResult(NamedTuple):
    """The edited message list and the edits, in input/output index coordinates."""

    messages: list[Message]
    edits: tuple[MessageEdit, ...]

    @property
    def changed(self) -> bool:
        return bool(self.edits)


@runtime_checkable
class ContextPolicy(Protocol):
    """A context policy: ``apply(messages) -> PolicyResult``, never mutating its input."""

    name: str

    def apply(self, messages: Sequence[Mapping[str, Any]]) -> PolicyResult: ...


def _check_messages(messages: Any) -> None:
    check_messages(messages)  # the shared rule: a message without a role is refused here too


def _text(content: Any) -> str | None:
    """A message's content as the text the model reads (``None``: not text only): text
    parts joined as the renderer and vLLM join them for a template of the ``"string"``
    content format (``join_text_parts``: with a newline, empty ones left out; a tool
    output of the ``"openai"`` format keeps its empty parts as empty lines, which this
    count leaves out), so the ten-line rule counts the lines the model sees and a
    truncated output written back as one str renders as its parts did (joined with
    nothing, two parts' lines ran together)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # text parts, or plain strings (the renderer takes both)
        try:
            texts = [part_text(p, -1) for p in content]
        except NonTextContentError:
            return None
        return join_text_parts(t for t in texts if t is not None)
    return None


def _has_content(content: Any) -> bool:
    """Whether a message says anything besides its tool calls: text, or any part (an
    image, a list of strings) the renderer takes; an empty text is nothing."""
    text = _text(content)
    if text is not None:
        return bool(text)
    return content is not None and not (isinstance(content, (list, tuple)) and not content)


def _merge(edits: list[MessageEdit]) -> tuple[MessageEdit, ...]:
    """Merge edits whose old ranges touch (then their new ranges touch too)."""
    out: list[MessageEdit] = []
    for e in edits:
        if out and out[-1].kind is e.kind and out[-1].old[1] == e.old[0]:
            prev = out.pop()
            e = MessageEdit(e.kind, (prev.old[0], e.old[1]), (prev.new[0], e.new[1]))
        out.append(e)
    return tuple(out)


# -- (a) the ten-line rule -----------------------------------------------------------


class TruncateToolOutputs:
    """Truncate tool outputs over ``max_lines`` lines to their first and last
    ``keep_lines`` lines around a marker line (see the module docstring)."""

    name = "truncate"

    def __init__(
        self,
        max_lines: int = 10,
        keep_lines: int | None = None,
        *,
        keep_recent: int = 1,
        marker: str = "[... {n} lines truncated ...]",
        roles: Sequence[str] = ("tool", "function"),
    ) -> None:
        if not is_int(max_lines) or max_lines < 1:
            raise ConfigError(f"max_lines must be a positive int, got {max_lines!r}")
        keep = (max_lines - 1) // 2 if keep_lines is None else keep_lines
        if not is_int(keep) or keep < 0 or 2 * keep + 1 > max_lines:
            raise ConfigError(
                f"keep_lines must be an int in [0, (max_lines - 1) // 2] = [0, {(max_lines - 1) // 2}] so "
                f"that a truncated output (2 * keep_lines + 1 lines) is not truncated again, got {keep!r}"
            )
        if not is_int(keep_recent) or keep_recent < 0:
            raise ConfigError(f"keep_recent must be a non-negative int, got {keep_recent!r}")
        if "\n" in check_format(marker, "marker", "n", 0):
            raise ConfigError("the marker must be one line")
        self.max_lines = max_lines
        self.keep_lines = keep
        self.keep_recent = keep_recent
        self.marker = marker
        self.roles = _check_roles(roles, "roles")

    def truncate(self, text: str) -> str:
        """``text`` itself when it has at most ``max_lines`` lines, else its first and
        last ``keep_lines`` lines around the marker line."""
        if not isinstance(text, str):
            raise InputError(f"truncate takes a tool output's text (a str), got {type(text).__name__}")
        lines = text.split("\n")
        trailing = text.endswith("\n")
        if trailing:
            lines.pop()
        n = len(lines)
        if n <= self.max_lines:
            return text
        k = self.keep_lines
        kept = lines[:k] + [self.marker.format(n=n - 2 * k)] + lines[n - k :]
        return "\n".join(kept) + ("\n" if trailing else "")

    def apply(self, messages: Sequence[Mapping[str, Any]]) -> PolicyResult:
        _check_messages(messages)
        # the outputs of the latest keep_recent turns stay whole: a turn's outputs are a
        # run of consecutive tool messages (counting single messages truncated a turn's
        # parallel calls but the last before the agent had read them)
        turns: list[list[int]] = []
        for i, m in enumerate(messages):
            if m.get("role") in self.roles:
                if turns and turns[-1][-1] == i - 1:
                    turns[-1].append(i)
                else:
                    turns.append([i])
        cut_here = {i for turn in turns[: max(0, len(turns) - self.keep_recent)] for i in turn}  # a set: 20,000 messages took 1.4 s
        out: list[Message] = []
        edits: list[MessageEdit] = []
        for i, m in enumerate(messages):
            msg = dict(m)
            if i in cut_here:
                text = _text(m.get("content"))
                if text is not None:
                    cut = self.truncate(text)
                    if cut != text:
                        msg["content"] = cut
                        edits.append(MessageEdit(EditKind.TRUNCATE, (i, i + 1), (i, i + 1)))
            out.append(msg)
        return PolicyResult(out, tuple(edits))

    __call__ = apply

    def __repr__(self) -> str:
        return f"TruncateToolOutputs(max_lines={self.max_lines}, keep_lines={self.keep_lines}, keep_recent={self.keep_recent})"


# -- (b) drop failed calls once retried ----------------------------------------------

_MARKER_RE = re.compile(r"\s*(?:\[(?:error|errno)\b|fatal:|traceback \(most recent call last\))", re.IGNORECASE)
_HEAD_RE = re.compile(r"\s*([A-Za-z_][\w.]*)")
_NO_RE = re.compile(r"(?:^|_)non?_?$", re.IGNORECASE)
_NO_CAMEL_RE = re.compile(r"(?:^|[a-z0-9])Non?$")
_ERROR_FIRST_RE = re.compile(r'\{\s*"error"\s*:\s*(?!null\b|false\b|""|0\b|\{\s*\}|\[\s*\])\S')
"""A JSON object's head whose first key is ``"error"`` with a value that is not empty."""
_NULL_VALUE_RE = re.compile(r"[:=]\s*(?:null|none|false|0)\s*(?:[,;\n]|$)", re.IGNORECASE)


def _error_head(text: str) -> bool:
    """Whether ``text`` starts with an error word: ``Error``/``error:``, an exception's
    name, qualified or not (``TypeError``, ``HTTP_ERROR``, ``S3Error``,
    ``sqlite3.OperationalError: ...``, ``ValueError('x')``), ``[ERROR]``, ``[Errno 2]``,
    ``fatal:`` or a traceback.  Not: a name led by "no"/"non" (``no_error``,
    ``GL_NO_ERROR``, ``kNoError``), a word with the letters inside another (``Terror``,
    ``errorless``, ``error_count``), a file name or path (``error.log``, ``error/404``),
    ``Error-free``, ``Error(s): 0``, or an error key with a null value (``error: null``,
    ``error=0``)."""
    if _MARKER_RE.match(text):
        return True
    m = _HEAD_RE.match(text)
    if m is None:
        return False
    word = m.group(1).rstrip(".")
    rest = text[m.start(1) + len(word):]
    name = word.rsplit(".", 1)[-1]  # a qualified name's last part; "error.log" ends in "log"
    low = name.lower()
    suffix = next((x for x in ("error", "exception") if low.endswith(x)), None)
    if suffix is None:
        return False
    prefix = name[: len(name) - len(suffix)]
    if prefix and not (prefix[-1] in "_0123456789" or name[len(prefix)] == "E" or name.isupper()):
        return False  # "Terror": the letters inside another word
    if _NO_RE.search(prefix) or _NO_CAMEL_RE.search(prefix):
        return False
    if not rest or rest[0] in " \t\r\n(,!;'\"":
        return not rest.startswith("(s)")
    if rest[0] in ":=":
        return _NULL_VALUE_RE.match(rest) is None
    if rest[0] == "-":
        return rest[1:2].isdigit()  # "ERROR-42: ..." is one, "Error-free run" is not
    return rest[0] == "." and rest[1:2] in ("", " ", "\n")  # "Error. It failed", not "error.log"


def is_error_output(message: Mapping[str, Any]) -> bool:
    """The default failure rule for a tool message (see the module docstring)."""
    if not isinstance(message, Mapping):
        raise InputError(f"is_error_output takes a tool message (a dict), got {type(message).__name__}")
    status = message.get("status")
    if isinstance(status, str) and status.lower() in ("error", "failed", "failure"):
        return True
    if message.get("is_error") is True:
        return True
    text = _text(message.get("content"))
    if not text:
        return False
    if _error_head(text):
        return True
    stripped = text.strip()
    if stripped.startswith("{") and '"error"' in stripped:
        try:
            obj = json.loads(stripped)
        except ValueError:
            # not whole JSON (a body TruncateToolOutputs cut in the middle, when it runs
            # before DropFailedCalls): an object whose first key is a non-empty "error"
            return _ERROR_FIRST_RE.match(stripped) is not None
        return isinstance(obj, dict) and bool(obj.get("error"))  # {"error": null, ...} is a success
    return False


def _calls_of(m: Mapping[str, Any]) -> list[Any]:
    """An assistant message's calls: its ``tool_calls`` (a list or a tuple), or its
    legacy ``function_call`` as the one call (it was never paired with its ``function``
    output, so a failed legacy call stayed in the context for good)."""
    if m.get("role") != "assistant":
        return []
    calls = m.get("tool_calls")
    if calls and isinstance(calls, Sequence) and not isinstance(calls, (str, bytes)):
        return list(calls)
    legacy = m.get("function_call")
    return [legacy] if not calls and isinstance(legacy, Mapping) else []


def _call_name(call: Any) -> str | None:
    if not isinstance(call, Mapping):
        return None
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) else None


class DropFailedCalls:
    """Drop a failed tool call and its output once a later call retried the function."""

    name = "drop_failed"

    def __init__(
        self,
        is_error: Callable[[Mapping[str, Any]], bool] = is_error_output,
        *,
        tool_roles: Sequence[str] = ("tool", "function"),
    ) -> None:
        if not callable(is_error):
            raise ConfigError("is_error must be a callable: is_error(tool_message) -> bool")
        self.is_error = is_error
        self.tool_roles = _check_roles(tool_roles, "tool_roles")

    def _pairs(self, messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, int, str]]:
        """``(assistant index, call index, output index, function name)`` of every
        answered call."""
        pairs: list[tuple[int, int, int, str]] = []
        for a, m in enumerate(messages):
            calls = _calls_of(m)
            if not calls:
                continue
            outs: list[int] = []
            j = a + 1
            while j < len(messages) and messages[j].get("role") in self.tool_roles:
                outs.append(j)
                j += 1
            # outputs in order per call id: a message repeating an id pairs its calls with
            # that id's outputs first to first (a dict kept the last output only, and the
            # first call took the second call's output: a success dropped, a failure kept)
            by_id: dict[Any, list[int]] = {}
            for t in outs:
                if messages[t].get("tool_call_id"):
                    by_id.setdefault(messages[t].get("tool_call_id"), []).append(t)
            free = [t for t in outs if not messages[t].get("tool_call_id")]
            for k, call in enumerate(calls):
                name = _call_name(call)
                if name is None:
                    continue
                cid = call.get("id") if isinstance(call, Mapping) else None
                if cid and by_id.get(cid):
                    pairs.append((a, k, by_id[cid].pop(0), name))
                elif free:
                    pairs.append((a, k, free.pop(0), name))
        return pairs

    def apply(self, messages: Sequence[Mapping[str, Any]]) -> PolicyResult:
        _check_messages(messages)
        # the first call of each function name per assistant message index, for "later"
        calls_after: list[tuple[int, str]] = []
        for a, m in enumerate(messages):
            for call in _calls_of(m):  # a list or a tuple, as _pairs and the renderer take them
                name = _call_name(call)
                if name is not None:
                    calls_after.append((a, name))
        drop_calls: dict[int, set[int]] = {}
        drop_msgs: set[int] = set()
        for a, k, t, name in self._pairs(messages):
            failed = self.is_error(messages[t])
            if isinstance(failed, str | bytes):  # a label such as "no" would read as True
                raise ConfigError(f"is_error must return True or False, got {type(failed).__name__} {failed!r:.60}")
            if not failed:  # None, a match object, numpy's bool: by their truth value
                continue
            if any(a2 > t and n2 == name for a2, n2 in calls_after):
                drop_calls.setdefault(a, set()).add(k)
                drop_msgs.add(t)
        if not drop_msgs:
            return PolicyResult([dict(m) for m in messages], ())
        out: list[Message] = []
        edits: list[MessageEdit] = []
        for i, m in enumerate(messages):
            if i in drop_msgs:
                edits.append(MessageEdit(EditKind.DROP, (i, i + 1), (len(out), len(out))))
                continue
            if i in drop_calls:
                remaining = [c for k, c in enumerate(_calls_of(m)) if k not in drop_calls[i]]
                if not remaining and not _has_content(m.get("content")):
                    edits.append(MessageEdit(EditKind.DROP, (i, i + 1), (len(out), len(out))))
                    continue
                msg = dict(m)
                if remaining:
                    msg["tool_calls"] = remaining
                else:
                    msg.pop("tool_calls", None)
                    msg.pop("function_call", None)
                edits.append(MessageEdit(EditKind.DROP, (i, i + 1), (len(out), len(out) + 1)))
                out.append(msg)
                continue
            out.append(dict(m))
        return PolicyResult(out, _merge(edits))

    __call__ = apply

    def __repr__(self) -> str:
        return "DropFailedCalls()"


# -- (c) summaries ---------------------------------------------------------------------

SUMMARY_TEMPLATE = "Summary of the earlier conversation:\n{summary}"


def _check_summary(summary: Any) -> str:
    """What ``summarize()`` returned, as the summary text: a str of valid Unicode (a
    lone surrogate was cached, and every later step of the session failed on it)."""
    if not isinstance(summary, str):
        raise InputError(f"summarize() must return a str, got {type(summary).__name__}")
    try:
        summary.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidUTF8Error.lone_surrogate("the text summarize() returned", summary, exc, index=-1,
                                              fix="return valid Unicode from summarize()") from None
    return summary


def _summary_message(summary: Any, role: str, template: str) -> Message:
    return {"role": role, "content": template.format(summary=_check_summary(summary))}


def summarize_turns(
    messages: Sequence[Mapping[str, Any]],
    start: int,
    end: int,
    summarize: Callable[[list[Message]], str],
    *,
    role: str = "user",
    template: str = SUMMARY_TEMPLATE,
) -> PolicyResult:
    """Replace ``messages[start:end]`` by one summary message (``role``, ``template``
    filled with ``summarize(messages[start:end])``).  The stretch may not end between a
    tool call and its output (``messages[end]`` a tool message)."""
    _check_messages(messages)
    check_format(template, "template", "summary", "a summary", required=True)
    if not callable(summarize):
        raise ConfigError("summarize must be a callable: summarize(messages) -> str")
    if not isinstance(role, str) or not role:  # as SummarizeTurns checks it
        raise ConfigError(f"role (of the summary message) must be a non-empty str, got {role!r}")
    if not (is_int(start) and is_int(end)) or not 0 <= start < end <= len(messages):
        raise InputError(f"summary stretch ({start}, {end}) is not a non-empty range of {len(messages)} messages")
    if end < len(messages) and messages[end].get("role") in ("tool", "function"):
        raise InputError(
            f"summary stretch ({start}, {end}) ends between a tool call and its output "
            f"(message {end} is a tool output); end the stretch after the outputs"
        )
    if start > 0 and messages[start].get("role") in ("tool", "function"):
        raise InputError(
            f"summary stretch ({start}, {end}) starts between a tool call and its output "
            f"(message {start} is a tool output); start the stretch before the call or after the outputs"
        )
    stretch = [dict(m) for m in messages[start:end]]
    msg = _summary_message(summarize(stretch), role, template)
    out = [dict(m) for m in messages[:start]] + [msg] + [dict(m) for m in messages[end:]]
    return PolicyResult(out, (MessageEdit(EditKind.SUMMARIZE, (start, end), (start, start + 1)),))


def _message_digest(message: Mapping[str, Any], index: int) -> bytes:
    """The content digest of one message's canonical JSON (the summary memo's key)."""
    try:
        text = canonical_json(message)
    except (TypeError, ValueError, RecursionError) as exc:  # mixed key types, cycles, depth
        raise InvalidMessageError(f"message {index} is not a JSON value ({type(exc).__name__}: {exc})") from None
    try:
        return content_digest(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidUTF8Error.lone_surrogate(f"message {index} (as JSON)", text, exc, index=index) from None


_INSTRUCTION_ROLES = ("system", "developer")
"""Roles whose messages a summary keeps as they are (a leading one heads the list)."""


@dataclass(slots=True)
class _Making:
    """A summary being made: by which thread, set when done, its text (None: it failed)."""

    thread: int
    done: threading.Event = field(default_factory=threading.Event)
    text: str | None = None


class SummarizeTurns:
    """Summarize old turns once the list outgrows ``max_messages`` (module docstring).

    Thread-safe; the summary memo is bounded (``max_memo`` stretches)."""

    name = "summarize"

    def __init__(
        self,
        summarize: Callable[[list[Message]], str],
        *,
        max_messages: int = 40,
        keep_recent: int = 10,
        keep_head: int | None = None,
        role: str = "user",
        template: str = SUMMARY_TEMPLATE,
        max_memo: int = 4096,
        tool_roles: Sequence[str] = ("tool", "function"),
    ) -> None:
        if not callable(summarize):
            raise ConfigError("summarize must be a callable: summarize(messages) -> str")
        if not is_int(keep_recent) or keep_recent < 0:
            raise ConfigError(f"keep_recent must be a non-negative int, got {keep_recent!r}")
        if not is_int(max_messages) or max_messages < keep_recent + 2:
            raise ConfigError(
                f"max_messages must be at least keep_recent + 2 = {keep_recent + 2} (head, summary, "
                f"recent turns), got {max_messages!r}"
            )
        if keep_head is not None and (not is_int(keep_head) or keep_head < 0):
            raise ConfigError(f"keep_head must be a non-negative int or None, got {keep_head!r}")
        if keep_head is not None and max_messages < keep_head + 1 + keep_recent:
            # a list over max_messages could never come back under it (left unchanged)
            raise ConfigError(
                f"max_messages must be at least keep_head + 1 + keep_recent = {keep_head + 1 + keep_recent} "
                f"(head, summary, recent turns), got {max_messages!r}; lower keep_head or keep_recent"
            )
        if not is_int(max_memo) or max_memo < 1:
            raise ConfigError(f"max_memo must be an int >= 1 (summaries remembered), got {max_memo!r}")
        if not isinstance(role, str) or not role:
            raise ConfigError(f"role (of the summary message) must be a non-empty str, got {role!r}")
        self.tool_roles = _check_roles(tool_roles, "tool_roles")
        self.summarize = summarize
        self.max_messages = max_messages
        self.keep_recent = keep_recent
        self.keep_head = keep_head
        self.role = role
        self.template = check_format(template, "template", "summary", "a summary", required=True)
        self._memo: OrderedDict[bytes, str] = OrderedDict()
        self._pending: dict[bytes, _Making] = {}  # summaries being made
        self._max_memo = max_memo
        self._lock = threading.Lock()

    def _summary(self, key: bytes, stretch: Sequence[Mapping[str, Any]]) -> str:
        """The summary of ``stretch`` (its chain digest ``key``), made once: callers
        that ask while another makes it wait for that one (one ``summarize`` call, one
        text for every session; concurrent callers each called it and kept the last)."""
        me = threading.get_ident()
        while True:
            with self._lock:
                done = self._memo.get(key)
                if done is not None:
                    return done
                making = self._pending.get(key)
                if making is None:
                    mine = self._pending[key] = _Making(me)
                elif making.thread == me:  # waiting on itself would hang every caller
                    raise InputError(
                        "summarize() re-entered the policy for the stretch it is summarizing: give the "
                        "summarizer's own LLM calls a ContextHook without this SummarizeTurns"
                    )
            if making is None:
                break
            making.done.wait()
            if making.text is not None:  # its maker's text, even if the memo evicted it since
                return making.text
            # its maker failed: make it here
        try:
            summary = _check_summary(self.summarize([dict(m) for m in stretch]))
            mine.text = summary
            with self._lock:
                self._memo[key] = summary
                while len(self._memo) > self._max_memo:
                    self._memo.popitem(last=False)
            return summary
        finally:
            with self._lock:
                del self._pending[key]
            mine.done.set()

    def _head(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """Messages kept before the summary; a head that would end between a call and
        its outputs keeps the outputs too."""
        if self.keep_head is not None:
            head = min(self.keep_head, len(messages))
            while 0 < head < len(messages) and messages[head].get("role") in self.tool_roles:
                head += 1
            return head
        return 1 if messages and messages[0].get("role") in _INSTRUCTION_ROLES else 0

    def _can_end(self, messages: Sequence[Mapping[str, Any]], end: int) -> bool:
        """Whether a summary of ``messages[head:end]`` keeps the latest ``keep_recent``
        messages and does not end between a call and its outputs."""
        n = len(messages)
        return end <= n - self.keep_recent and (end == n or messages[end].get("role") not in self.tool_roles)

    def apply(self, messages: Sequence[Mapping[str, Any]]) -> PolicyResult:
        _check_messages(messages)
        n = len(messages)
        head = self._head(messages)
        # rolling digests of messages[head:e] for every e: find the longest stretch
        # summarized before
        chain: list[bytes] = [b""] * (n + 1)
        h = b"summary-stretch"
        found_end, found = head, None
        with self._lock:
            for e in range(head + 1, n + 1):
                h = content_digest(h + _message_digest(messages[e - 1], e - 1))
                chain[e] = h
                hit = self._memo.get(h)
                # a stretch summarized for a longer list (another session's, or before an
                # edit) is reused only where it leaves this list's recent turns whole, and
                # only in a list over max_messages (until 2026-12-08 a list that fit lost
                # turns to a summary made for another session's longer list)
                if hit is not None and n > self.max_messages and self._can_end(messages, e):
                    found_end, found = e, hit
            if found is not None:
                self._memo.move_to_end(chain[found_end])
        size = n if found is None else head + 1 + (n - found_end)
        if size > self.max_messages:
            end = n - self.keep_recent
            while head < end < n and messages[end].get("role") in self.tool_roles:
                end -= 1
            said = [m for m in messages[head:end] if m.get("role") not in _INSTRUCTION_ROLES]
            if end > found_end and end - head >= 2 and said:
                found_end, found = end, self._summary(chain[end], said)
        if found is None:
            return PolicyResult([dict(m) for m in messages], ())
        msg = _summary_message(found, self.role, self.template)
        # instructions given mid-session stay, verbatim, right after the summary: a
        # summary swallowed them (and, where vLLM merges them into the system message
        # in front, edited the front)
        kept = [dict(m) for m in messages[head:found_end] if m.get("role") in _INSTRUCTION_ROLES]
        out = [dict(m) for m in messages[:head]] + [msg] + kept + [dict(m) for m in messages[found_end:]]
        return PolicyResult(out, (MessageEdit(EditKind.SUMMARIZE, (head, found_end), (head, head + 1 + len(kept))),))

    __call__ = apply

    def __repr__(self) -> str:
        return f"SummarizeTurns(max_messages={self.max_messages}, keep_recent={self.keep_recent})"
