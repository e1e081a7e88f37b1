"""The OpenAI-compatible wire format, without I/O: what a response means.

:class:`~promptsplice.engine_adapters.RemoteEngine` sends the requests; this module
reads what comes back, the same for its sync and async halves: a JSON completion, a
streamed (SSE) one chunk by chunk, an error body (a 400 saying the prompt is too long
becomes :class:`ContextLengthError`), a model list, Prometheus ``/metrics``
counters, and the splice connector's answer in ``kv_transfer_params``.  A body that is not what the format promises is an
:class:`EngineResponseError` carrying a snippet of it: no ``message`` in a chat choice
(its ``content: null`` reads as empty text: a tool call, a refusal or a turn of
reasoning only), a choice other than index 0 (no
request asks for ``n > 1``: several choices are not an answer to it, and joining or
picking among them would be a wrong answer), a usage count that is negative, not a
whole number or a ``cached_tokens`` over the prompt's tokens (a count that is missing or
``null`` is ``None``: unknown), a ``prompt_tokens`` other than the number of token ids
the prompt was sent as (:func:`reply_counts`), a splice ack whose counts contradict
each other or the prompt (:func:`_splice_ack`), a stream that is not UTF-8, a stream without a
``finish_reason`` or without any ``data:`` line (the server or a proxy ignored
``stream=True``), a redirect (not followed) or a 204.  Whatever follows ``data: [DONE]``
is ignored.

Kept as one module (~780 lines): every rule of what a response means sits in one place,
read by both halves of ``RemoteEngine`` and by the served engine's stream, so a rule
cannot hold for one path and not another (the streamed and the whole reply disagreed
on choices and UTF-8 before they shared it).
"""

from __future__ import annotations

import codecs
import email.utils
import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from promptsplice._validate import encodable
from promptsplice.engine_adapters.connector._served import SpliceAck
from promptsplice.errors import ContextLengthError, EngineRequestError, EngineResponseError, InputError

__all__ = [
    "RemoteCompletion",
    "ServerCounters",
    "parse_prometheus_counters",
]

MAX_RETRY_AFTER_S = 60.0
"""A server's ``Retry-After`` is honoured up to this many seconds."""
_SNIPPET = 200
_CONTEXT_RE = re.compile(
    r"maximum context length|context length|max_model_len|maximum model length|context window"
    r"|(?:prompt|input|request|sequence) (?:\(length \d+\) )?is (?:too long|longer than)",
    re.IGNORECASE,
)
# The sizes in OpenAI's, vLLM's and SGLang's wordings ("maximum context length is
# 8192 tokens", "longer than the maximum model length of 8192", "context length (8192
# tokens)"; "contains 9000 input tokens", "your request has 9000 input tokens", "(length
# 9000)", "(9000 in the messages",
# "input (9000 tokens)").  The limit is -1 and the prompt the request's own length when
# the message names none: never a number taken from elsewhere in the text.
_LIMIT_RE = re.compile(
    r"context length (?:is|of) (\d+)|context length \((\d+)|maximum model length of (\d+)"
    r"|max_model_len\D{0,4}(\d+)|context window (?:of|is) (\d+)",
    re.IGNORECASE,
)
# vLLM: "max_tokens=3000 cannot be greater than max_model_len=2048"; and, for a prompt
# that fills the context, its max_tokens clamped to the room left: "... at least 1, got 0".
_OUTPUT_OVER_CONTEXT_RE = re.compile(r"max_(?:completion_)?tokens=(\d+) cannot be greater than max_model_len=(\d+)")
# the output asked for, in older vLLM's, OpenAI's and SGLang's wordings of a request
# over the context ("'max_tokens' ... is too large: 9000", "(10 in the messages, 9000 in
# the completion)", "9000 tokens for the completion"): over the whole context on its
# own, the prompt is not what is too long
_OUTPUT_ASKED_RE = re.compile(r"is too large: (\d+)|(\d+) in the completion|(\d+) tokens for the completion",
                              re.IGNORECASE)
_NO_ROOM_RE = re.compile(r"max_(?:completion_)?tokens must be at least 1, got 0\b")
_PROMPT_LEN_RE = re.compile(
    r"(?:contains|has) (?:at least )?(\d+) (?:input |prompt )?tokens|\(length (\d+)\)|\((\d+) in the messages"
    r"|input \((\d+) tokens\)|prompt (?:has|is) (\d+) tokens|(\d+) prompt tokens",
    re.IGNORECASE,
)

@dataclass(frozen=True, slots=True)
class RemoteCompletion:
    """One completion from a remote server.

    ``cached_tokens`` is ``None`` when the server did not report it (unknown, not 0).
    ``prompt_tokens``/``completion_tokens`` are ``None`` when the server sent no usage.
    ``ttft_s`` (time to first token, measured client-side from sending the request to
    the first streamed token, with or without text) is ``None`` for non-streaming requests; ``total_s`` is the
    client-side wall time of the whole request (retries included).
    """

    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    ttft_s: float | None
    total_s: float
    finish_reason: str | None
    kv_transfer_params: Mapping[str, Any] | None = None
    """What the server returned in the response's ``kv_transfer_params`` (non-streamed)."""
    splice: SpliceAck | None = None
    """The splice connector's answer to a request sent with ``splice=plan``: whether the
    plan was applied (``reason`` says what differed when it was not: the request then ran
    as plain prefill) and the tokens it loaded and relocated."""
    token_ids: list[int] | None = None
    """The generated token ids, when the request asked for them (vLLM's
    ``return_token_ids``, sent by :meth:`RemoteEngine.generate`); else ``None``."""
    request_id: str = ""
    """The server's id of the completion (empty when it sent none)."""
    logprobs: list[dict[int, float]] | None = None
    """Per generated token, ``{token_id: logprob}`` of the top tokens, when the request
    asked for them with ``return_tokens_as_token_ids`` (:func:`token_logprobs`)."""


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """The server's prefix-cache counters (token counts), summed over label sets.

    A field is ``None`` when the server's ``/metrics`` does not expose that counter.
    ``external_*``: the KV connector's lookups and hits (tokens it loaded).
    """

    prefix_cache_queries: int | None
    prefix_cache_hits: int | None
    external_queries: int | None = None
    external_hits: int | None = None

    @property
    def hit_rate(self) -> float | None:
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


def parse_prometheus_counters(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum the samples of each metric in ``names`` over all its label sets.

    Names absent from ``text`` are absent from the result.
    """
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out



def snippet(body: str | bytes) -> str:
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    body = body.strip()
    return body if len(body) <= _SNIPPET else body[:_SNIPPET] + "..."


def server_message(response: httpx.Response) -> str:
    """The error message a server put in its body (OpenAI / vLLM / SGLang shapes)."""
    try:
        data = response.json()
    except (ValueError, UnicodeDecodeError, RecursionError):
        return snippet(response.content) or response.reason_phrase
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key])
    return snippet(response.content)


def _int_or_none(value: Any) -> int | None:
    """A Prometheus counter's value as an int (``None`` when absent or not finite)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


_MAX_COUNT = 2**53
"""A token count above this is not one (1e300 passed as a count before)."""


def _count(value: Any, name: str, url: str) -> int | None:
    """A usage count: ``None`` when missing or ``null`` (unknown), else a whole number
    from 0 to 2**53; anything else (negative, 2.9, "2", NaN, 1e300) is an
    :class:`EngineResponseError` naming the field: a count is reported, never guessed."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or (isinstance(value, float) and not value.is_integer()) or not 0 <= value <= _MAX_COUNT):
        raise EngineResponseError(f"{url} answered {name}={value!r:.40}, which is not a token count "
                                  "(a whole number, 0 or more)")
    return int(value)


def usage_counts(usage: Any, url: str) -> tuple[int | None, int | None, int | None]:
    """``(prompt_tokens, completion_tokens, cached_tokens)`` of a ``usage`` object, each
    checked by :func:`_count`; ``cached_tokens`` over ``prompt_tokens`` is an
    :class:`EngineResponseError` too.  No usage object: all ``None``."""
    if not isinstance(usage, Mapping):
        return None, None, None
    prompt = _count(usage.get("prompt_tokens"), "usage.prompt_tokens", url)
    completion = _count(usage.get("completion_tokens"), "usage.completion_tokens", url)
    details = usage.get("prompt_tokens_details")
    cached = None
    if isinstance(details, Mapping):
        cached = _count(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens", url)
    if cached is not None and prompt is not None and cached > prompt:
        raise EngineResponseError(f"{url} answered cached_tokens={cached} over prompt_tokens={prompt}: "
                                  "a prompt cannot have more tokens cached than it has")
    return prompt, completion, cached


def sent_ids_len(req: Request | None) -> int | None:
    """How many token ids ``req`` sent as its prompt (``None``: a chat, or a prompt sent
    as text, whose tokens the server counts)."""
    prompt = req.body.get("prompt") if req is not None and not req.chat else None
    return len(prompt) if isinstance(prompt, list) else None


def reply_counts(usage: Any, req: Request | None, url: str) -> tuple[int | None, int | None, int | None]:
    """:func:`usage_counts` of the answer to ``req``, its ``prompt_tokens`` resolved.

    A prompt sent as token ids has exactly that many tokens: a ``prompt_tokens`` that
    says otherwise (0 included) is an :class:`EngineResponseError` (a proxy that
    rewrote or truncated the prompt, or counts of another request: never reported as
    this one's); a missing one is the ids' count, and ``cached_tokens`` over it is an
    error too.  A prompt sent as text: the server's count (``cached_tokens`` checked
    against it), else (missing or 0) the caller's own length (``Request.prompt_len``)."""
    prompt, completion, cached = usage_counts(usage, url)
    sent = sent_ids_len(req)
    if sent is None:
        return prompt or (req.prompt_len if req is not None else None), completion, cached
    if prompt is not None and prompt != sent:
        raise EngineResponseError(f"{url} answered usage.prompt_tokens={prompt} for a prompt sent as {sent} "
                                  "token ids: counts that are not this prompt's are never reported as its own")
    if cached is not None and cached > sent:
        raise EngineResponseError(f"{url} answered cached_tokens={cached} for a prompt sent as {sent} token ids: "
                                  "a prompt cannot have more tokens cached than it has")
    return sent, completion, cached


def _token_ids(ids: Any, url: str) -> list[int] | None:
    """A reply's ``token_ids``: ints (``None`` when absent), else :class:`EngineResponseError`."""
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise EngineResponseError(f"{url} answered token_ids that are not token ids: {snippet(repr(ids).encode())!r}")
    return ids


def _text(value: Any, url: str) -> str | None:
    """A reply's text (``None`` when absent), else :class:`EngineResponseError`."""
    if value is None or isinstance(value, str):
        return value
    raise EngineResponseError(f"{url} answered text that is not a string: {snippet(repr(value).encode())!r}")


def retry_after(response: httpx.Response) -> float | None:
    """The wait a ``Retry-After`` header asks for, in seconds: a number of seconds or an
    HTTP-date (a date past is 0).  May be over :data:`MAX_RETRY_AFTER_S` (the caller
    then gives up).  ``None`` when absent or nonsense (negative, NaN, infinite,
    unparseable): the caller's backoff applies."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # an HTTP-date is GMT
            return None
        seconds = max(0.0, when.timestamp() - time.time())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def unexpected_status(response: httpx.Response, url: str) -> EngineResponseError | None:
    """The error for a status below 400 that carries no completion: a redirect (httpx
    follows none: the URL must be the server's own) or a 204/205 (no content)."""
    status = response.status_code
    if 300 <= status < 400:
        where = response.headers.get("location")
        return EngineResponseError(
            f"{url} answered HTTP {status}, a redirect{f' to {where}' if where else ''}; redirects are "
            "not followed: pass the URL the server answers at as base_url", status_code=status)
    if status in (204, 205):
        return EngineResponseError(f"{url} answered HTTP {status} with no content, not a completion",
                                   status_code=status)
    return None


_NEWLINE_RE = re.compile(r"\r\n|\r|\n")
MAX_SSE_LINE_CHARS = 16 * 1024 * 1024
"""The longest SSE line read (a chunk of a few tokens is under a kilobyte; a full
vocabulary of logprobs some megabytes): a longer one is an
:class:`EngineResponseError`, not a buffer that grows without bound."""


class SSELines:
    """Bytes of an SSE stream to its lines, decoded as strict UTF-8 (the SSE format's
    encoding): invalid UTF-8 is an :class:`EngineResponseError`, as in a non-streamed
    body, never U+FFFD.  Lines end at ``\\n``, ``\\r\\n`` or ``\\r``."""

    def __init__(self, url: str) -> None:
        self.url = url
        # utf-8-sig: the SSE format's decoding drops a leading BOM (it hid the first event)
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
        self._pending: list[str] = []  # an unfinished line, in pieces (re-joined once per line)
        self._pending_len = 0

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        try:
            new = self._decoder.decode(data, final)
        except UnicodeDecodeError as exc:
            raise EngineResponseError(f"the stream from {self.url} is not valid UTF-8 ({exc.reason} "
                                      f"near {snippet(exc.object[max(0, exc.start - 40):exc.end + 10])!r})") from exc
        if not _NEWLINE_RE.search(new) and not final:  # the line goes on: no re-split of what came
            if new:
                self._pending.append(new)
                self._pending_len += len(new)
                self._check_length()
            return []
        text = "".join(self._pending) + new
        self._pending, self._pending_len = [], 0
        parts = _NEWLINE_RE.split(text)  # not str.splitlines: U+2028 may stand in a JSON string
        rest = parts.pop()  # after the last line break: unfinished
        if parts and text.endswith("\r") and not final:  # its "\n" may come in the next bytes
            rest = parts.pop() + "\r"
        if final:
            if rest:
                parts.append(rest)
        elif rest:
            self._pending, self._pending_len = [rest], len(rest)
            self._check_length()
        return parts

    def _check_length(self) -> None:
        if self._pending_len > MAX_SSE_LINE_CHARS:
            raise EngineResponseError(
                f"the stream from {self.url} sent a line of over {MAX_SSE_LINE_CHARS} characters without a "
                "line break: not an SSE stream (a proxy that ignored stream=True?)")

    def close(self) -> list[str]:
        return self.feed(b"", final=True)


@dataclass(slots=True)
class Request:
    """One request as built from the caller's arguments: the path, the JSON body,
    whether it is a chat request, the prompt's length (for error messages), and whether
    it carries a splice plan (the answer must then hold the connector's ack)."""

    path: str
    body: dict[str, Any]
    chat: bool
    prompt_len: int | None
    splice: bool = False


class Retry(Exception):
    """Internal: this attempt failed in a retryable way."""

    def __init__(self, error: Exception, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


@dataclass(slots=True)
class Call:
    """One HTTP call the exchange asks its driver to make.  ``req`` is set for a
    completion (``stream``: read it as SSE into an :class:`Accumulator` started at
    ``start``); a plain ``GET`` returns the response."""

    method: str
    url: str
    req: Request | None = None
    start: float = 0.0
    probe: bool = False
    """A one-token probe or a tokenization: sent again after any retryable failure, as
    a GET is (running it twice costs nothing and changes nothing worth keeping)."""

    @property
    def resendable(self) -> bool:
        """Whether any retryable failure may send it again (a GET, a probe); a
        completion is sent again only when the failure says the server did not run it
        (``RemoteEngine``'s module doc)."""
        return self.method == "GET" or self.probe

    @property
    def stream(self) -> bool:
        return self.req is not None and bool(self.req.body.get("stream"))


def wants_usage(req: Request) -> bool:
    """Whether a streamed request asked for the final usage chunk."""
    opts = req.body.get("stream_options")
    return isinstance(opts, Mapping) and bool(opts.get("include_usage"))


def _check_index(choice: Mapping[str, Any], url: str, data: Any) -> None:
    """Only choice 0 answers a request (none asks for ``n > 1``; a missing index is 0)."""
    index = choice.get("index", 0)
    if index is not None and index != 0:
        raise EngineResponseError(
            f"{url} answered a choice with index {index!r:.20}, but only one choice (index 0) was asked "
            f"for: not an answer to this request (a proxy that fans out?): {snippet(str(data))!r}"
        )


class Accumulator:
    """Collects a streamed (SSE) response chunk by chunk."""

    def __init__(self, chat: bool, start: float, *, expect_usage: bool = False, content_type: str | None = None) -> None:
        self.chat = chat
        self.content_type = content_type
        self.events = 0  # data lines read: none means the server did not stream at all
        self.other: list[str] = []  # the start of what came instead (for the error)
        self.start = start
        # the request asked for a usage chunk (``stream_options.include_usage``): it comes
        # after the finish_reason, so a stream cut between them is cut, not complete
        self.expect_usage = expect_usage
        self.parts: list[str] = []
        self.ttft: float | None = None
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.done = False
        self.ids: list[int] | None = None
        self.request_id = ""

    def feed(self, line: str, url: str) -> tuple[str, list[int]]:
        """Take one SSE line; returns the text and token ids it added."""
        added: tuple[str, list[int]] = ("", [])
        line = line.strip()
        if self.done:  # nothing after [DONE] belongs to the answer
            return added
        if not line or line.startswith(":") or not line.startswith("data:"):
            if line and not line.startswith(":") and sum(map(len, self.other)) < _SNIPPET:
                self.other.append(line)
            return added
        self.events += 1
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return added
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise EngineResponseError(
                f"malformed stream chunk from {url}: {snippet(data)!r}"
            ) from exc
        if not isinstance(chunk, Mapping):
            raise EngineResponseError(f"malformed stream chunk from {url}: {snippet(data)!r}")
        err = chunk.get("error")
        if err is not None or chunk.get("object") == "error":
            # vLLM's shapes: {"error": {...}} (now), {"object": "error", "message": ...}
            # (older), or an error string; never a partial answer passed off as complete.
            message = err.get("message") if isinstance(err, Mapping) else err if isinstance(err, str) else None
            code = err.get("code") if isinstance(err, Mapping) else chunk.get("code")
            raise EngineRequestError(  # the HTTP status it stands for, as a non-streamed error's
                f"{url} failed mid-stream: {message or chunk.get('message') or snippet(data)}",
                status_code=code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else None,
            )
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        self.request_id = self.request_id or str(chunk.get("id") or "")
        choices = chunk.get("choices")
        if choices is not None and not isinstance(choices, list):
            raise EngineResponseError(f"malformed stream chunk from {url} (choices is not a list): {snippet(data)!r}")
        for choice in choices or ():
            if not isinstance(choice, Mapping):
                raise EngineResponseError(f"malformed stream chunk from {url} (a choice is not an object): "
                                          f"{snippet(data)!r}")
            _check_index(choice, url, data)
            if self.chat:
                delta = choice.get("delta") or {}
                if not isinstance(delta, Mapping):  # as a non-streamed choice's message
                    raise EngineResponseError(f"malformed stream chunk from {url} (a delta is not an object): "
                                              f"{snippet(data)!r}")
                text = _text(delta.get("content"), url)
            else:
                text = _text(choice.get("text"), url)
            ids = _token_ids(choice.get("token_ids"), url) or []
            if ids:
                self.ids = (self.ids or []) + ids
            if (text or ids) and self.ttft is None:  # the first token, with or without text yet
                self.ttft = time.perf_counter() - self.start
            if text:
                self.parts.append(text)
            if text or ids:
                added = (added[0] + (text or ""), added[1] + ids)
            if choice.get("finish_reason"):
                self.finish_reason = check_finish_reason(choice["finish_reason"], url)
        return added

    def result(self, req: Request | None, url: str) -> RemoteCompletion:
        """The streamed completion (``req``: what was sent, to check the usage against)."""
        if not self.events:
            raise EngineResponseError(
                f"{url} answered no SSE data lines (content-type {self.content_type or 'none'}): the server "
                f"or a proxy ignored stream=True; it sent: {snippet(chr(10).join(self.other))!r}"
            )
        if self.done and self.finish_reason is None:
            raise EngineResponseError(
                f"the stream from {url} reached [DONE] without a finish_reason "
                f"(got {len(self.parts)} text chunks): not a complete answer"
            )
        if not self.done and self.finish_reason is None:
            raise EngineResponseError(
                f"the stream from {url} ended before a finish_reason or [DONE] "
                f"(got {len(self.parts)} text chunks): the server closed it early"
            )
        if not self.done and self.expect_usage and self.usage is None:
            raise EngineResponseError(
                f"the stream from {url} ended after its finish_reason but before the usage "
                "chunk it was asked for and [DONE]: the server closed it early"
            )
        prompt_tokens, completion_tokens, cached = reply_counts(self.usage, req, url)
        total = time.perf_counter() - self.start
        return RemoteCompletion(
            text="".join(self.parts),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached,
            ttft_s=self.ttft,
            total_s=total,
            finish_reason=self.finish_reason,
            token_ids=self.ids,
            request_id=self.request_id,
        )




_FAILED_REASONS = {"abort": "aborted it (a /sleep, /pause or shutdown of the server)",
                   "error": "failed it (an internal error, e.g. a KV load that failed; retry it)"}
"""vLLM's finish reasons of a request that did not complete: the text so far is a
partial answer, never a success."""


def check_finish_reason(reason: Any, url: str) -> str | None:
    """``reason`` as the completion's ``finish_reason``: :class:`EngineRequestError` for
    vLLM's ``abort`` and ``error`` (a partial answer), :class:`EngineResponseError` for
    one that is not a string."""
    if reason is None or (isinstance(reason, str) and reason not in _FAILED_REASONS):
        return reason
    if isinstance(reason, str):
        raise EngineRequestError(f"{url} {_FAILED_REASONS[reason]}: finish_reason {reason!r}, a partial answer")
    raise EngineResponseError(f"{url} answered a finish_reason that is not a string: {snippet(repr(reason))!r}")


def status_error(response: httpx.Response, url: str, req: Request | None) -> Exception:
    """The error for an HTTP status >= 400: :class:`ContextLengthError` for a 400 that
    says the prompt is too long (sizes read from the message), else
    :class:`EngineRequestError` with the server's message."""
    message = server_message(response)
    too_many = _OUTPUT_OVER_CONTEXT_RE.search(message) if response.status_code == 400 else None
    if too_many:  # names max_model_len, but the prompt is not the problem
        return EngineRequestError(
            f"{url} refused max_tokens={too_many[1]}: more output tokens than the whole context "
            f"({too_many[2]} tokens) holds; request fewer ({message})",
            status_code=400,
        )
    if response.status_code == 400 and _NO_ROOM_RE.search(message):
        # vLLM clamps max_tokens to the context left after the prompt: 0 left (a caller's
        # own max_tokens is checked >= 1 before sending); a chat's length is not known here
        n = req.prompt_len if req is not None and req.prompt_len else -1
        size = f"its {n} tokens fill" if n > 0 else "it fills"
        return ContextLengthError(
            f"{url} refused the prompt: {size} the whole context, leaving no room for an "
            f"output token; shorten the prompt ({message})",
            prompt_tokens=n,
            max_tokens=n,
        )
    if response.status_code == 400 and _CONTEXT_RE.search(message):
        m = _LIMIT_RE.search(message)
        limit = int(next(g for g in m.groups() if g is not None)) if m else -1
        m = _OUTPUT_ASKED_RE.search(message)
        asked = int(next(g for g in m.groups() if g is not None)) if m else None
        if asked is None and req is not None:
            sent = req.body.get("max_tokens", req.body.get("max_completion_tokens"))
            asked = sent if isinstance(sent, int) and not isinstance(sent, bool) else None
        if limit > 0 and asked is not None and asked > limit:  # vLLM trims one of exactly the context
            return EngineRequestError(
                f"{url} refused max_tokens={asked}: more than the whole context ({limit} tokens) for the "
                f"output alone; request fewer ({message})",
                status_code=400,
            )
        m = _PROMPT_LEN_RE.search(message)
        prompt_len = (int(next(g for g in m.groups() if g is not None)) if m
                      else (req.prompt_len if req and req.prompt_len else -1))
        if 0 < prompt_len < limit and asked is not None and prompt_len + asked > limit:
            # the prompt fits; the output asked for does not fit behind it (until
            # 2026-12-07 a ContextLengthError: a caller shortened a 10-token prompt for it)
            return EngineRequestError(
                f"{url} refused max_tokens={asked}: the prompt's {prompt_len} tokens leave "
                f"{limit - prompt_len} of the context's {limit}; request at most that ({message})",
                status_code=400,
            )
        return ContextLengthError(
            f"{url} refused the prompt as too long: {message}",
            prompt_tokens=prompt_len,
            max_tokens=limit,
        )
    hint = ""
    if response.status_code == 404 and req is not None and "model" in message.lower():
        hint = " (the model name is not one the server serves: pass RemoteEngine(model=...) as its /v1/models lists it)"
    elif response.status_code in (401, 403):  # vLLM's --api-key middleware answers 401 "Unauthorized"
        hint = (" (the server wants a key: pass RemoteEngine(api_key=...) with the key it was started with, "
                "vllm serve --api-key or VLLM_API_KEY)")
    return EngineRequestError(f"{url} answered HTTP {response.status_code}: {message}{hint}",
                              status_code=response.status_code)


def parse_json(response: httpx.Response, url: str) -> Mapping[str, Any]:
    """The response's JSON object, else :class:`EngineResponseError` with a snippet."""
    try:
        data = response.json()
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise EngineResponseError(
            f"{url} answered HTTP {response.status_code} with a body that is not JSON: "
            f"{snippet(response.content)!r}"
        ) from exc
    if not isinstance(data, Mapping):
        raise EngineResponseError(f"{url} answered JSON that is not an object: {snippet(response.content)!r}")
    return data


def completion_from_json(data: Mapping[str, Any], req: Request, url: str, start: float) -> RemoteCompletion:
    """A non-streamed completion (``/v1/completions`` or ``/v1/chat/completions``)."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise EngineResponseError(f"{url} answered without choices: {snippet(json.dumps(data))!r}")
    for extra in choices:
        if not isinstance(extra, Mapping):
            raise EngineResponseError(f"{url} answered a choice that is not an object: {snippet(json.dumps(data))!r}")
        _check_index(extra, url, data)  # the snippet is made only for an error
    if len(choices) > 1:
        raise EngineResponseError(f"{url} answered {len(choices)} choices where one was asked for: "
                                  f"{snippet(json.dumps(data))!r}")
    choice = choices[0]
    if req.chat:
        message = choice.get("message")
        if not isinstance(message, Mapping):
            raise EngineResponseError(f"{url} answered a chat choice without a message: {snippet(json.dumps(data))!r}")
        text = message.get("content")
        if text is None:  # a tool call, a refusal, audio, a turn of reasoning only: no text (as a stream's null delta)
            text = ""
    else:
        text = choice.get("text")
        if text is None:
            raise EngineResponseError(f"{url} answered a completion choice without text: {snippet(json.dumps(data))!r}")
    if not isinstance(text, str):
        raise EngineResponseError(f"{url} answered a non-text completion: {snippet(json.dumps(data))!r}")
    usage = data.get("usage")
    prompt_tokens, completion_tokens, cached = reply_counts(usage, req, url)
    kv_params = data.get("kv_transfer_params")
    kv_params = kv_params if isinstance(kv_params, Mapping) else None
    # the prompt's length as sent or as the server counted it (not the caller's own
    # count of a text prompt): what the ack's loads must fit in
    counted = prompt_tokens if sent_ids_len(req) is not None or usage_counts(usage, url)[0] else None
    return RemoteCompletion(
        text=text,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached,
        ttft_s=None,
        total_s=time.perf_counter() - start,
        finish_reason=check_finish_reason(choice.get("finish_reason"), url),
        kv_transfer_params=kv_params,
        splice=_splice_ack(kv_params, url, counted),
        token_ids=_token_ids(choice.get("token_ids"), url),
        request_id=str(data.get("id") or ""),
        logprobs=token_logprobs(choice, url) if req.body.get("return_tokens_as_token_ids") else None,
    )


def _splice_ack(kv_params: Mapping[str, Any] | None, url: str, prompt_tokens: int | None) -> SpliceAck | None:
    """The connector's ack, its counts checked against each other and the prompt's
    ``prompt_tokens`` (:meth:`SpliceAck.from_params`); :class:`EngineResponseError` for
    one that is malformed or contradicts itself."""
    try:
        return SpliceAck.from_params(kv_params, prompt_tokens=prompt_tokens)
    except InputError as exc:
        raise EngineResponseError(f"{url} answered a malformed splice ack ({exc}): a connector of another "
                                  "promptsplice version?") from exc


_TOKEN_ID_PREFIX = "token_id:"


def token_logprobs(choice: Mapping[str, Any], url: str) -> list[dict[int, float]]:
    """vLLM's ``top_logprobs`` of a completion choice keyed by token id (the request sent
    ``return_tokens_as_token_ids``: keys ``"token_id:123"``), as ``{123: logprob}`` per
    generated token.  :class:`EngineResponseError` for anything else (keys by text
    would map several ids to one string)."""
    lp = choice.get("logprobs")
    tops = lp.get("top_logprobs") if isinstance(lp, Mapping) else None
    if not isinstance(tops, list):
        raise EngineResponseError(f"{url} answered no top_logprobs although logprobs were asked for")
    out = []
    for top in tops:
        if not isinstance(top, Mapping):
            raise EngineResponseError(f"{url} answered a top_logprobs entry that is not a mapping")
        row = {}
        for key, value in top.items():
            if not (isinstance(key, str) and key.startswith(_TOKEN_ID_PREFIX) and _is_token_id(key[len(_TOKEN_ID_PREFIX):])):
                raise EngineResponseError(
                    f"{url} keyed logprobs by text ({key!r:.40}), not token id: a vLLM without "
                    "return_tokens_as_token_ids?"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise EngineResponseError(f"{url} answered a logprob that is not a number: {value!r:.40}")
            row[int(key[len(_TOKEN_ID_PREFIX):])] = float(value)
        out.append(row)
    return out


def _is_token_id(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes ``"²"``, which ``int()`` refuses."""
    return text.isascii() and text.isdigit()


def check_splice_ack(completion: RemoteCompletion, url: str) -> RemoteCompletion:
    """A completion of a request sent with a splice plan must carry the connector's ack;
    none means the server ignored the plan: it was not started with the connector."""
    if completion.splice is None:
        raise EngineRequestError(
            f"{url} ignored the splice plan: the server was not started with the splice "
            "connector (start vllm serve with --kv-transfer-config "
            "kv_transfer_config_json(StoreConfig(...)) from "
            "promptsplice.engine_adapters.connector._settings)"
        )
    return completion


def model_from_list(response: httpx.Response, url: str) -> str:
    """The first model id of a ``/v1/models`` answer."""
    data = parse_json(response, url)
    models = data.get("data")
    if not isinstance(models, list) or not models or not isinstance(models[0], Mapping) or "id" not in models[0]:
        raise EngineResponseError(
            f"{url} lists no model; pass RemoteEngine(model=...): {snippet(response.content)!r}"
        )
    model = models[0]["id"]
    if not isinstance(model, str) or not model or not encodable(model):  # sent back in every request body
        raise EngineResponseError(f"{url} lists a model id that is not a name ({snippet(repr(model))!r}); "
                                  "pass RemoteEngine(model=...)")
    return model


def context_len_from_list(response: httpx.Response, url: str, model: str) -> int | None:
    """``model``'s context length as a ``/v1/models`` answer lists it (vLLM's
    ``max_model_len`` in the model's own entry), ``None`` where the server does not say
    (OpenAI, a proxy, a gateway listing other models): a limit is never guessed."""
    data = parse_json(response, url)
    models = [m for m in data.get("data") or () if isinstance(m, Mapping)] if isinstance(data.get("data"), list) else []
    card = next((m for m in models if m.get("id") == model), None)
    n = card.get("max_model_len") if card is not None else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 2 else None


def counters_from(response: httpx.Response) -> ServerCounters:
    """The prefix-cache counters of a ``/metrics`` answer."""
    names = (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
    )
    values = parse_prometheus_counters(response.text, names)
    return ServerCounters(*(_int_or_none(values.get(n)) for n in names))
