"""A remote OpenAI-compatible engine over httpx (vLLM serve, SGLang, OpenAI).

Kept as one module (~900 lines): the sync and async twins of every call share one
request builder, one retry loop and one error translation, which must not drift apart;
the wire format lives in ``_wire`` and the served-engine surface in ``_served_engine``.

``RemoteEngine(base_url)`` sends an assembled prompt to ``/v1/completions`` (token ids
where the server accepts them: vLLM, SGLang; text elsewhere) or messages to
``/v1/chat/completions``, sync or async, streaming or not, and returns a
:class:`RemoteCompletion` with the server's usage and client-side timings.

Cached tokens are read from ``usage.prompt_tokens_details.cached_tokens``.  A server
that does not report them (vLLM without ``--enable-prompt-tokens-details``, many
proxies) gives ``cached_tokens=None``: *unknown*, never reported as 0.
``server_counters()`` reads the server's Prometheus ``/metrics``
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``, and the KV
connector's ``vllm:external_prefix_cache_*``).

``complete(..., splice=plan)`` sends a splice plan to a ``vllm serve`` running the splice
connector (wire format: ``connector._served``; its answer: ``RemoteCompletion.splice``).
What runners and the chat model use (``generate``, ``generate_phases``...): ``_served_engine``.

Timeouts (:data:`DEFAULT_TIMEOUT`): 5 s to connect, 120 s for each read, write or pool
wait, and ``total_timeout`` (default :data:`DEFAULT_TOTAL_TIMEOUT` = 600 s) for a request
that makes no progress, however the server trickles it (SSE keep-alive comments, a body
a byte at a time kept each read under the read timeout forever): a non-streamed request's
whole response; a stream's time to its first data event and between two (a long answer
that keeps streaming is never cut); ``math.inf``: no limit.  A
number ``timeout=T`` sets each phase to ``T`` (httpx's meaning; the total stays 600 s,
or ``T`` when longer).

Errors: a completion (a POST) is retried only where the failure says it was not run:
connect errors, connect and pool timeouts, a connection closed before any response byte
(a pooled one the server had closed meanwhile; a server that died before answering looks
the same, and the retry then finds it down), and 429 and 503.  A 500, a gateway's 502 or 504
(the server behind it may still run the request), a read or write timeout and a
connection cut once the response began are final: sending it again would prefill it
again.  A GET (``/v1/models``, ``/metrics``) and a probe (``/tokenize``, the splice
connector's one-token probes) are also retried on 500, 502, 504, any timeout and a
connection broken mid-response.  Retries: ``max_retries`` times with exponential
backoff (``backoff * 2**attempt`` seconds, or longer when the server's ``Retry-After``
asks for it: seconds or an HTTP-date; one over 60 s gives up at once, saying how long
the server asked for; a nonsense one is ignored); a completion is only returned whole,
so a retry never repeats output.  Then, or at once for anything else:

* server unreachable, or the connection broke -> :class:`EngineUnavailableError` naming the URL;
* timeout -> :class:`EngineTimeoutError` saying which timeout (connect, read, write, pool, total);
* a body that is not the JSON expected, a redirect (not followed), a body that cannot be
  decoded -> :class:`EngineResponseError` with a snippet;
* HTTP 4xx and 5xx (those retried once retries are spent; a completion's 500, 502 or
  504 at once, saying it was not sent again) -> :class:`EngineRequestError` with the
  server's message; a 400 saying the prompt exceeds the context ->
  :class:`ContextLengthError`.

httpx exceptions never escape: they are translated with ``raise ... from exc``.  After
``close()`` every call raises :class:`EngineError` (the engine is closed), also one
racing the close from another thread; ``aclose()`` only lets go of this loop's client
and the sync one (a later call opens new ones).

The sync and async halves share everything but the I/O: one request builder (a
:class:`~promptsplice.engine_adapters._wire.Request` from the arguments, checked by
:mod:`promptsplice._validate` before anything is sent), one exchange written once as a
generator (resolve the model, attempt, back off, retry: it yields each HTTP call and
each pause) that a sync and an async driver run, and one response parser
(:mod:`promptsplice.engine_adapters._wire`).
"""

from __future__ import annotations

import asyncio
import math
import contextlib
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import httpx

from promptsplice._validate import (
    check_bool,
    check_int,
    check_messages,
    check_number,
    check_salt,
    check_text,
    check_token_ids,
    encodable,
)
from promptsplice.engine_adapters._served_engine import ServedEngineSurface
from promptsplice.engine_adapters._wire import (
    Accumulator,
    Call as _Call,
    Retry as _Retry,
    RemoteCompletion,
    Request,
    ServerCounters,
    check_splice_ack,
    completion_from_json,
    counters_from,
    model_from_list,
    parse_json,
    parse_prometheus_counters,
    MAX_RETRY_AFTER_S,
    SSELines,
    retry_after,
    status_error,
    unexpected_status,
    wants_usage,
)
from promptsplice.engine_adapters.connector._plans import SplicePlan
from promptsplice.engine_adapters.connector._served import splice_params
from promptsplice.errors import (
    ConfigError,
    EngineConnectTimeoutError,
    EngineError,
    EngineResponseError,
    EngineTimeoutError,
    EngineUnavailableError,
    InputError,
    InvalidSaltError,
    PromptspliceError,
)
from promptsplice.tenancy import SaltGuard

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TOTAL_TIMEOUT",
    "RemoteCompletion",
    "RemoteEngine",
    "ServerCounters",
    "parse_prometheus_counters",
]

DEFAULT_TIMEOUT = httpx.Timeout(120.0, connect=5.0)
"""Default timeouts: 5 s to connect, 120 s for each read/write/pool wait."""
DEFAULT_TOTAL_TIMEOUT = 600.0
"""Default bound on one whole request and its response, in seconds (the per-read
timeouts alone let a server that trickles keep-alives hold a call forever)."""

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
"""Statuses a GET (or a probe) is retried on: sending it again changes nothing."""
_RETRY_STATUS_POST = frozenset({429, 503})
"""Statuses a completion is retried on: those saying it was not run (rate limited,
overloaded or not ready).  A 500 may come after the server ran it, a gateway's 502 or
504 while the server still runs it: sending it again would prefill it again."""
_BROKEN = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""A connection that broke before the response ended (the server died or dropped it, also
while the request was being written)."""
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Transport errors before the request went out: nothing reached the server."""
_NO_RESPONSE = "Server disconnected without sending a response"
"""httpcore's RemoteProtocolError for a connection closed before any response (a pooled
connection the server had closed meanwhile)."""


def _never_ran(exc: httpx.HTTPError) -> bool:
    """Whether a transport error says the server did not run the request: no
    connection, or one closed before it answered anything."""
    return isinstance(exc, _NOT_SENT) or (
        isinstance(exc, httpx.RemoteProtocolError) and str(exc).startswith(_NO_RESPONSE))

_CLOSING: set[asyncio.Task[None]] = set()
"""``aclose`` tasks that :meth:`RemoteEngine.close` scheduled (a task only weakly held
by its loop may be collected before it runs)."""


def _close_on_loop(client: httpx.AsyncClient) -> None:
    """On ``client``'s own loop: start its ``aclose``."""
    task = asyncio.get_running_loop().create_task(client.aclose())
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


SendTokenIds = Literal["auto"] | bool


def _timeout_name(exc: httpx.TimeoutException) -> str:
    for cls, name in ((httpx.ConnectTimeout, "connect"), (httpx.ReadTimeout, "read"),
                      (httpx.WriteTimeout, "write"), (httpx.PoolTimeout, "pool")):
        if isinstance(exc, cls):
            return name
    return "request"


_Exchange = Generator["_Call | float", Any, Any]
"""An exchange: yields HTTP calls (sent back their result) and pauses in seconds."""


# --------------------------------------------------------------------------- engine


def _whole(response: httpx.Response, content: bytes) -> httpx.Response:
    """``response`` with its body read (decoded) as ``content``: read chunk by chunk
    to check the total timeout between chunks, which ``Response.read`` cannot."""
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
    return httpx.Response(response.status_code, headers=headers, content=content, request=response.request)


def _accumulator(call: _Call, response: httpx.Response) -> Accumulator:
    return Accumulator(call.req.chat, call.start, expect_usage=wants_usage(call.req),
                       content_type=response.headers.get("content-type"))


def _without_userinfo(url: str) -> str:
    """``url`` without the ``user:password@`` of its authority (string work only, so a URL
    that does not parse is shown without it too): what messages, logs and repr name."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:cut]
    return f"{scheme}://{authority.rpartition('@')[2]}{rest[cut:]}" if "@" in authority else url


def _check_json(body: dict[str, Any]) -> None:
    """The body must be sendable as JSON (httpx's encoder raised raw TypeError, ValueError
    or UnicodeEncodeError on a NaN, an object, a set or a lone surrogate)."""
    import json

    try:
        json.dumps(body, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as exc:
        raise InputError(
            f"the request cannot be sent as JSON ({type(exc).__name__}: {exc}); pass text, numbers "
            "that are finite, lists and dicts only, and text without lone surrogates"
        ) from None


class RemoteEngine(ServedEngineSurface):
    """A client for one OpenAI-compatible server.

    ``base_url``: the server root or its ``/v1`` (``http://127.0.0.1:8000``,
    ``https://api.openai.com/v1``); a ``user:password@`` in it is sent as Basic auth and
    left out of ``base_url``, error messages, logs and ``repr``.  ``model``: the model name; ``None`` asks the
    server's ``/v1/models`` once and takes the first.  ``send_token_ids``: ``"auto"``
    sends token ids to ``/v1/completions`` except to OpenAI (api.openai.com), which gets
    the prompt's text; ``True``/``False`` force it.  ``prompt_cache_key``: an
    assembled prompt's ``prefix_key`` is sent as ``prompt_cache_key`` where the server
    supports it (OpenAI); one passed explicitly is always sent.  ``transport``: an
    ``httpx`` transport (an ``HTTPTransport`` carries the sync calls only, an
    ``AsyncHTTPTransport`` the async ones; ``MockTransport`` both).  ``timeout``: seconds for everything, or an
    ``httpx.Timeout`` per phase; ``total_timeout``: seconds for one whole request and its
    response (default 600 s, or the longest phase timeout when that is longer): an async
    call ends at it; a sync call checks it after each read of the body (up to one read
    timeout late), and a server that sends the response *headers* a byte at a time holds
    it longer (httpx reads them whole, each read under the read timeout).  ``require_salt``: refuse requests without a
    ``cache_salt`` (:class:`~promptsplice.errors.MissingSaltError`); either way, mixing
    salted and unsalted requests warns once
    (:class:`~promptsplice.errors.UnsaltedTenantWarning`).  ``tokenizer``/``block_size``: for
    runners and the chat model, checked against the server (``_served_engine``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        total_timeout: float | None = None,
        max_retries: int = 3,
        backoff: float = 0.5,
        send_token_ids: SendTokenIds = "auto",
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        require_salt: bool = False,
        tokenizer: Any = None, block_size: int | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.strip():
            raise ConfigError("base_url must be a non-empty URL such as http://127.0.0.1:8000")
        try:
            parts = urlsplit(base_url.strip())
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            shown = _without_userinfo(base_url.strip())
            raise ConfigError(f"base_url {shown!r} is not a valid URL ({exc})") from exc
        shown = _without_userinfo(base_url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"base_url must be an http(s) URL, got {shown!r}")
        if parts.query or parts.fragment or base_url.strip().endswith(("?", "#")):
            # the request path is appended to the URL: it went after the query
            raise ConfigError(f"base_url {shown!r} has a query or fragment, which every request path would "
                              "follow; pass the server's URL without it")
        if any(c.isspace() for c in base_url.strip()):  # httpx quotes it and then cannot connect
            raise ConfigError(f"base_url {shown!r} holds whitespace: pass the server's URL without it")
        # user:password@ in the URL is Basic auth (as httpx reads it); kept out of base_url,
        # which every error message, log line and repr names
        self._auth = (httpx.BasicAuth(unquote(parts.username or ""), unquote(parts.password or ""))
                      if parts.username is not None or parts.password is not None else None)
        root = shown.rstrip("/")
        for endpoint in ("/chat/completions", "/completions", "/models", "/tokenize", "/metrics"):
            if root.endswith(endpoint):  # every call would go to .../v1/completions/v1/completions
                raise ConfigError(
                    f"base_url {shown!r} names an endpoint ({endpoint}): pass the server's root, "
                    f"{root[: -len(endpoint)].removesuffix('/v1')!r} (or with /v1)"
                )
        if root.endswith("/v1"):
            root = root[: -len("/v1")]
        try:  # what httpx refuses at the first request (control characters, a bad host name)
            httpx.URL(root + "/v1/models").host.encode("idna")
        except (httpx.InvalidURL, UnicodeError, ValueError) as exc:
            raise ConfigError(f"base_url {shown!r} is not a URL httpx can send to ({exc})") from None
        self.base_url = root
        self._host = (parts.hostname or "").lower()
        check_int(max_retries, "max_retries", minimum=0)
        check_number(backoff, "backoff")
        check_text(model, "model", optional=True, error=ConfigError)
        if model is not None and not encodable(model):
            raise ConfigError(f"model {model!r} holds a lone surrogate, which has no UTF-8 encoding; "
                              "pass the name as the server's /v1/models lists it")
        if model is not None and not model.strip():
            raise ConfigError("model is empty: pass the served model's name, or None to ask the server")
        check_text(api_key, "api_key", optional=True, error=ConfigError)
        if api_key is not None and not (api_key.isascii() and api_key.isprintable()):
            raise ConfigError("api_key must be printable ASCII (it is sent in the Authorization header)")
        if send_token_ids != "auto" and not isinstance(send_token_ids, bool):
            raise ConfigError(f"send_token_ids must be 'auto', True or False, got {send_token_ids!r}")
        if isinstance(timeout, bool):
            raise ConfigError(f"timeout must be seconds or an httpx.Timeout, got {timeout!r}")
        if isinstance(timeout, int | float):
            timeout = httpx.Timeout(float(check_number(timeout, "timeout (seconds)", strict=True)))
        if not isinstance(timeout, httpx.Timeout):
            raise ConfigError(f"timeout must be seconds or an httpx.Timeout, got {timeout!r}")
        for name in ("connect", "read", "write", "pool"):  # the float form's rule, field by field
            value = getattr(timeout, name)
            if value is not None:
                check_number(value, f"timeout.{name} (seconds)", strict=True)
        if total_timeout is None:  # httpx's meaning of timeout (per phase) stays; the total at least that
            total_timeout = (math.inf if timeout.read is None  # Timeout(None): no limit asked for
                             else max(DEFAULT_TOTAL_TIMEOUT, *(v for v in (timeout.connect, timeout.read,
                                                                          timeout.write, timeout.pool)
                                                               if v is not None)))
        if isinstance(total_timeout, bool) or not isinstance(total_timeout, int | float) or total_timeout != math.inf:
            total_timeout = check_number(total_timeout, "total_timeout (seconds, or math.inf: none)", strict=True)
        self.total_timeout = float(total_timeout)
        # no one read may outlast the whole request
        timeout = httpx.Timeout(**{name: min(v, self.total_timeout) if v is not None
                                   else (None if self.total_timeout == math.inf else self.total_timeout)
                                   for name in ("connect", "read", "write", "pool")
                                   for v in (getattr(timeout, name),)})
        if transport is not None and not isinstance(transport, httpx.BaseTransport | httpx.AsyncBaseTransport):
            raise ConfigError(f"transport must be an httpx transport (or None), got {type(transport).__name__}")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = float(backoff)
        self.model = model
        self._is_openai = self._host == "api.openai.com" or self._host.endswith(".openai.com")
        self.send_token_ids = (not self._is_openai) if send_token_ids == "auto" else send_token_ids
        headers = {"Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self._transport = transport
        self._salts = SaltGuard("RemoteEngine", require=require_salt)
        self._client: httpx.Client | None = None
        self._aclients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self._aclients_lock = threading.Lock()
        self._closed = False
        self._init_served(tokenizer, block_size)

    # ----------------------------------------------------------------- lifecycle

    def _closed_error(self) -> EngineError:
        return EngineError(f"this RemoteEngine({self.base_url!r}) is closed; make a new RemoteEngine to "
                           "send more requests")

    def _sync_client(self) -> httpx.Client:
        client = self._client
        if client is None:
            with self._aclients_lock:  # threads' first calls at once: one client, none leaked
                if self._closed:
                    raise self._closed_error()
                if self._client is None:
                    kwargs: dict[str, Any] = {"headers": self._headers, "timeout": self.timeout, "auth": self._auth}
                    if self._transport is not None:
                        kwargs["transport"] = self._kind_of_transport(httpx.BaseTransport, "sync")
                    self._client = httpx.Client(**kwargs)
                client = self._client
        return client

    def _async_client(self) -> httpx.AsyncClient:
        # An AsyncClient's pooled connections belong to the event loop that opened them:
        # each loop (a second asyncio.run, loops in other threads) gets a client of its
        # own, kept while the loop lives.  The client's connections hold their loop, so
        # the weak key alone never lets go: clients of closed loops are dropped here
        # (one per asyncio.run leaked a client and a socket).  Dropped, not closed: an
        # AsyncClient closes only on its own loop, which is gone, so its pooled socket
        # goes with the garbage collector (reference cycles: not at once).  A coroutine
        # run by asyncio.run that should leave no socket awaits aclose() before it ends.
        loop = asyncio.get_running_loop()
        with self._aclients_lock:
            if self._closed:
                raise self._closed_error()
            for done in [lp for lp in self._aclients if lp.is_closed()]:
                del self._aclients[done]
            client = self._aclients.get(loop)
            if client is None:
                kwargs: dict[str, Any] = {"headers": self._headers, "timeout": self.timeout, "auth": self._auth}
                if self._transport is not None:
                    kwargs["transport"] = self._kind_of_transport(httpx.AsyncBaseTransport, "async")
                client = self._aclients[loop] = httpx.AsyncClient(**kwargs)
            return client

    def _kind_of_transport(self, kind: type, calls: str) -> Any:
        """The transport, if it can carry ``calls`` (an ``httpx.HTTPTransport`` has no
        async side, an ``AsyncHTTPTransport`` no sync one: a raw AttributeError later)."""
        if not isinstance(self._transport, kind):
            other = "the a* methods (acomplete, achat)" if calls == "sync" else "the sync methods"
            raise ConfigError(
                f"transport {type(self._transport).__name__} cannot carry {calls} calls: use {other}, or "
                f"pass a transport of both kinds (httpx.MockTransport) or an httpx.{kind.__name__}"
            )
        return self._transport

    def close(self) -> None:
        """Close the engine: the sync client now, and each live loop's async client on
        its own loop (an async client can be closed only there: its ``aclose`` is
        scheduled on it, and runs if the loop keeps running; a coroutine about to end
        its loop should ``await aclose()`` first); clients of closed loops are let go.  Every later call, and one racing this from another thread,
        raises :class:`EngineError` (never a new client opened behind the caller's back)."""
        self._release_clients(final=True)

    def _release_clients(self, *, final: bool) -> None:
        with self._aclients_lock:
            self._closed = self._closed or final
            client, self._client = self._client, None
            for done in [lp for lp in self._aclients if lp.is_closed()]:
                del self._aclients[done]
            live = list(self._aclients.items()) if final else []
            if final:
                self._aclients.clear()
        if client is not None:
            client.close()
        for loop, aclient in live:
            try:
                loop.call_soon_threadsafe(_close_on_loop, aclient)
            except RuntimeError:  # the loop closed meanwhile: its sockets went with it
                pass

    async def aclose(self) -> None:
        """Close this loop's async client (each loop closes its own) and the sync one;
        the engine stays usable (a later call opens new clients): :meth:`close` ends it."""
        with self._aclients_lock:
            client = self._aclients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
        self._release_clients(final=False)

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"RemoteEngine({self.base_url!r}, model={self.model!r})"

    # ----------------------------------------------------------------- requests

    def _completion_request(
        self,
        prompt: Any,
        *,
        max_tokens: int,
        temperature: float,
        cache_salt: str | None,
        prompt_cache_key: str | None,
        stream: bool,
        splice: SplicePlan | None = None,
    ) -> Request:
        derived_key: str | None = None
        text: str | None = None
        ids: list[int] | None = None
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("prompt is an empty string")
            text = prompt
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            ids = check_token_ids(prompt, "prompt")
        elif hasattr(prompt, "token_ids"):
            ids = check_token_ids(prompt.token_ids, "prompt.token_ids")
            if self.send_token_ids:
                self._check_prompt_tokenizer(prompt)
            text = getattr(prompt, "text", None)
            salt = check_salt(getattr(prompt, "salt", None), "the prompt's salt")
            if salt is not None:
                if check_salt(cache_salt) is not None and cache_salt != salt:
                    raise InvalidSaltError(
                        f"cache_salt={cache_salt!r} differs from the prompt's salt {salt!r}: "
                        "assemble the prompt with the tenant's salt and leave cache_salt unset"
                    )
                cache_salt = salt
            derived_key = getattr(prompt, "prefix_key", None) or None
        else:
            raise InputError(
                "prompt must be an AssembledPrompt, a list of token ids or a str, "
                f"got {type(prompt).__name__}"
            )
        if ids is not None and self.send_token_ids:
            payload: Any = ids
        elif text:
            if getattr(prompt, "markup_as_text", False) is True:
                raise InputError(
                    "the prompt's content holds control-token markup (such as <|im_start|>) that "
                    "was tokenized as text (prompt.markup_as_text); sent as text, the server would "
                    f"read it as control tokens: send token ids (RemoteEngine({self.base_url!r}) on a "
                    "vLLM server, send_token_ids=True), remove the markup from the content, or "
                    "assemble with trust_markup=True where the markup is your own"
                )
            payload = text
        else:
            raise InputError(
                f"{self.base_url} is not sent token ids (send_token_ids=False or OpenAI) "
                "and the prompt has no text: pass a str or an AssembledPrompt"
            )
        body = self._common_body(max_tokens, temperature, cache_salt, stream, prompt_cache_key)
        body["prompt"] = payload
        key = prompt_cache_key if prompt_cache_key is not None else (
            derived_key if self._is_openai else None
        )
        if key is not None:
            body["prompt_cache_key"] = key
        if splice is not None:
            body["kv_transfer_params"] = splice_params(splice, ids if payload is ids else None, stream)
        _check_json(body)
        return Request("/v1/completions", body, False, len(ids) if ids is not None else None, splice is not None)

    def _chat_request(
        self,
        messages: Any,
        *,
        max_tokens: int,
        temperature: float,
        cache_salt: str | None,
        prompt_cache_key: str | None,
        stream: bool,
    ) -> Request:
        check_messages(messages, allow_empty=False, require_content=True)
        clean = [dict(message) for message in messages]
        body = self._common_body(max_tokens, temperature, cache_salt, stream, prompt_cache_key)
        body["messages"] = clean
        if prompt_cache_key is not None:
            body["prompt_cache_key"] = prompt_cache_key
        _check_json(body)
        return Request("/v1/chat/completions", body, True, None)

    def _common_body(
        self, max_tokens: int, temperature: float, cache_salt: str | None, stream: bool,
        prompt_cache_key: str | None = None,
    ) -> dict[str, Any]:
        check_int(max_tokens, "max_tokens")
        check_number(temperature, "temperature")
        check_bool(stream, "stream")
        check_text(prompt_cache_key, "prompt_cache_key", optional=True)
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
        if check_salt(cache_salt) is not None:
            if self._is_openai:
                raise ConfigError(
                    "OpenAI does not accept cache_salt; isolate tenants with "
                    "prompt_cache_key (or separate API keys) instead"
                )
            body["cache_salt"] = cache_salt
        if not self._is_openai:  # OpenAI isolates by API key; it takes no salt
            self._salts.check(cache_salt, stacklevel=5)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    # ----------------------------------------------------------------- errors

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _transport_error(self, exc: httpx.HTTPError, url: str) -> Exception:
        if isinstance(exc, httpx.TimeoutException):
            name = _timeout_name(exc)
            seconds = getattr(self.timeout, name, None) if name != "request" else None
            limit = f" of {seconds:g} s" if isinstance(seconds, int | float) else ""
            if isinstance(exc, httpx.ConnectTimeout):  # never connected: the host is down or unreachable
                return EngineConnectTimeoutError(
                    f"connect timeout{limit} talking to {url}: no connection (is the host up and "
                    "reachable? raise RemoteEngine(timeout=httpx.Timeout(..., connect=...)) if it is just loaded)"
                )
            return EngineTimeoutError(
                f"{name} timeout{limit} talking to {url} "
                f"(raise RemoteEngine(timeout=...) if the server is just slow)"
            )
        if isinstance(exc, httpx.ConnectError):
            return EngineUnavailableError(f"cannot connect to the remote engine at {url}: is it running? ({exc})")
        if isinstance(exc, _BROKEN):
            return EngineUnavailableError(
                f"the connection to {url} broke before the response ended (the server died or "
                f"closed it): {type(exc).__name__}: {exc}"
            )
        if isinstance(exc, httpx.DecodingError):
            return EngineResponseError(f"{url} answered a body its content-encoding header does not "
                                       f"describe (a proxy that re-encoded it?): {type(exc).__name__}: {exc}")
        return EngineError(f"request to {url} failed: {type(exc).__name__}: {exc}")

    @staticmethod
    def _check_response(response: httpx.Response, call: _Call) -> None:
        if response.status_code < 400:
            odd = unexpected_status(response, call.url)
            if odd is not None:
                raise odd
            return
        error = status_error(response, call.url, call.req)
        if response.status_code in (_RETRY_STATUS if call.resendable else _RETRY_STATUS_POST):
            raise _Retry(error, retry_after(response))
        if response.status_code in _RETRY_STATUS and error.args:  # a GET's retry: say why not this one
            error.args = (f"{error.args[0]} (not sent again: the server may have run it, or a gateway's "
                          "server may still be running it; send it again yourself if running it twice "
                          "is acceptable)", *error.args[1:])
        raise error

    @contextlib.contextmanager
    def _translating(self, url: str, resend: bool = True) -> Iterator[list[Any]]:
        """httpx's errors -> ours, at the boundary.  ``resend`` (a GET, a probe: see
        :attr:`Call.resendable`): connect errors, timeouts and connections broken
        mid-response become retryable (``_Retry``).  Otherwise (a completion) only what
        says the server did not run it: connect errors, connect and pool timeouts, and
        a connection closed before any response (a pooled one the server had closed).
        A read or write timeout, or a connection cut once the server answered, is
        final: the server ran or is running it, and a retry would prefill the prompt
        again (until 2026-12-04 a crash mid-response re-sent it ``max_retries`` times).
        Every other transport error is final.  Plain ``with`` works in the async
        driver too.  The caller appends the client it sends with to the yielded list:
        an error because that client was closed under the request (``aclose()`` or
        ``close()`` while it was in flight) is final, never a retry on a new client."""
        used: list[Any] = []
        try:
            yield used
        except RuntimeError as exc:  # httpx: "Cannot send a request, as the client has been closed"
            if isinstance(exc, PromptspliceError):
                raise
            if "Event loop is closed" in str(exc) and not self._closed:
                # A transport passed in is shared by every loop's client, and its pool kept
                # a connection opened on a loop that has ended (an earlier asyncio.run):
                # nothing was sent on it, the pool drops it, a retry takes a new one.
                # (Until 2026-12-07 the raw RuntimeError reached the caller.)
                error = EngineUnavailableError(
                    f"a pooled connection to {url} belongs to an event loop that has closed (the "
                    "transport passed to RemoteEngine serves every loop); pass a transport per "
                    "event loop, or none")
                error.__cause__ = exc
                raise _Retry(error) from exc
            if not (self._closed or "has been closed" in str(exc)):
                raise
            raise self._closed_under(url, "started") from exc
        except httpx.HTTPError as exc:
            if used and used[0].is_closed:  # the socket was closed under the request, by us
                raise self._closed_under(url, "was in flight") from exc
            error = self._transport_error(exc, url)
            if not (isinstance(exc, (httpx.ConnectError, httpx.TimeoutException, *_BROKEN)) if resend
                    else _never_ran(exc)):
                raise error from exc
            error.__cause__ = exc
            raise _Retry(error) from exc

    def _closed_under(self, url: str, when: str) -> EngineError:
        if self._closed:
            return self._closed_error()
        return EngineError(f"the client sending to {url} was closed (aclose()) while this request {when}; "
                           "send it again")

    # ----------------------------------------------------------------- the exchange (no I/O)

    def _attempts(self, call: _Call) -> _Exchange:
        """``call`` with retries: yields it until it succeeds, with a pause (seconds)
        before each retry; the last retryable error is raised once retries are spent."""
        attempt = 0
        while True:
            try:
                return (yield call)
            except _Retry as retry:
                wait = retry.retry_after
                if wait is not None and wait > MAX_RETRY_AFTER_S:  # hours of waiting is giving up
                    retry.error.args = (f"{retry.error.args[0]} (the server asked to retry after {wait:.0f} s, "
                                        f"more than the {MAX_RETRY_AFTER_S:g} s this client waits: try later)",
                                        *retry.error.args[1:])
                    raise retry.error from retry.error.__cause__
                if attempt >= self.max_retries:
                    if attempt:  # say what was tried: the caller waited for all of it
                        retry.error.args = (f"{retry.error.args[0]} (gave up after {attempt + 1} attempts)",
                                            *retry.error.args[1:])
                    raise retry.error from retry.error.__cause__
                delay = min(self.backoff * (2**attempt), MAX_RETRY_AFTER_S)  # no ceiling was days
                if retry.retry_after is not None:
                    delay = max(delay, retry.retry_after) if self.backoff else retry.retry_after
                yield float(delay)
                attempt += 1

    def _get(self, path: str) -> _Exchange:
        return (yield from self._attempts(_Call("GET", self._url(path))))

    def served_model(self) -> str:
        """The model this engine sends to: ``model``, else asked once from the
        server's ``/v1/models`` (what the first request would do)."""
        if self.model is None:
            url = self._url("/v1/models")
            self.model = model_from_list(self._run(self._attempts(_Call("GET", url))), url)
        return self.model

    def _completion(self, req: Request) -> _Exchange:
        if self.model is None:
            url = self._url("/v1/models")
            self.model = model_from_list((yield from self._attempts(_Call("GET", url))), url)
        req.body["model"] = self.model
        call = _Call("POST", self._url(req.path), req, time.perf_counter())
        out = yield from self._attempts(call)
        if call.stream:
            return out
        completion = completion_from_json(parse_json(out, call.url), req, call.url, call.start)
        return check_splice_ack(completion, call.url) if req.splice else completion

    # ----------------------------------------------------------------- drivers

    def _run(self, exchange: _Exchange) -> Any:
        """Drive an exchange with the sync client."""
        value: Any = None
        error: _Retry | None = None
        while True:
            try:
                step = exchange.throw(error) if error is not None else exchange.send(value)
            except StopIteration as done:
                return done.value
            value, error = None, None
            if isinstance(step, float):
                time.sleep(step)
                continue
            try:
                value = self._call(step)
            except _Retry as retry:
                error = retry

    def _total_error(self, url: str) -> EngineTimeoutError:
        return EngineTimeoutError(
            f"total timeout of {self.total_timeout:g} s for one request to {url} ran out (the server kept "
            "the response going without a finished answer or, streaming, without a data event); raise "
            "RemoteEngine(total_timeout=...) if it is just slow (math.inf: no limit)"
        )

    def _check_deadline(self, deadline: float, url: str) -> None:
        if time.monotonic() > deadline:
            raise self._total_error(url)

    def _progress_deadline(self) -> float:
        """When ``total_timeout`` runs out if nothing progresses from now on."""
        return time.monotonic() + self.total_timeout

    def _call(self, call: _Call) -> Any:
        """One HTTP call, bounded by ``total_timeout`` (checked after every read): the
        response (body read) or, for a stream, its :class:`RemoteCompletion`."""
        deadline = time.monotonic() + self.total_timeout
        with self._translating(call.url, call.resendable) as used:
            client = self._sync_client()
            used.append(client)
            body = call.req.body if call.req else None
            with client.stream(call.method, call.url, json=body) as response:
                if not call.stream or response.status_code >= 400:
                    chunks = []
                    for chunk in response.iter_bytes():
                        chunks.append(chunk)
                        self._check_deadline(deadline, call.url)
                    response = _whole(response, b"".join(chunks))
                    self._check_response(response, call)
                    return response
                self._check_response(response, call)
                acc = _accumulator(call, response)
                lines = SSELines(call.url)
                events = 0
                for chunk in response.iter_bytes():
                    for line in lines.feed(chunk):
                        acc.feed(line, call.url)
                    if acc.done:  # [DONE] ends the answer: a proxy may hold the body open after it
                        return acc.result(call.req, call.url)
                    if acc.events != events:  # a data event is progress (a keep-alive comment is not)
                        events, deadline = acc.events, self._progress_deadline()
                    self._check_deadline(deadline, call.url)
                for line in lines.close():
                    acc.feed(line, call.url)
                return acc.result(call.req, call.url)

    async def _arun(self, exchange: _Exchange) -> Any:
        """Drive an exchange with the async client."""
        value: Any = None
        error: _Retry | None = None
        while True:
            try:
                step = exchange.throw(error) if error is not None else exchange.send(value)
            except StopIteration as done:
                return done.value
            value, error = None, None
            if isinstance(step, float):
                await asyncio.sleep(step)
                continue
            try:
                value = await self._acall(step)
            except _Retry as retry:
                error = retry

    async def _acall(self, call: _Call) -> Any:
        """Async twin of :meth:`_call` (``total_timeout`` as an ``asyncio.timeout``,
        pushed back at each data event of a stream)."""
        deadline = asyncio.timeout(None if self.total_timeout == math.inf else self.total_timeout)
        try:
            async with deadline:
                return await self._acall_once(call, deadline)
        except TimeoutError as exc:
            if not deadline.expired():
                raise
            raise self._total_error(call.url) from exc

    async def _acall_once(self, call: _Call, deadline: asyncio.Timeout) -> Any:
        with self._translating(call.url, call.resendable) as used:
            client = self._async_client()
            used.append(client)
            if not call.stream:
                response = await client.request(call.method, call.url, json=call.req.body if call.req else None)
                self._check_response(response, call)
                return response
            async with client.stream(call.method, call.url, json=call.req.body) as response:
                if response.status_code >= 400:
                    await response.aread()
                self._check_response(response, call)
                acc = _accumulator(call, response)
                lines = SSELines(call.url)
                events = 0
                async for chunk in response.aiter_bytes():
                    for line in lines.feed(chunk):
                        acc.feed(line, call.url)
                    if acc.done:  # [DONE] ends the answer: a proxy may hold the body open after it
                        return acc.result(call.req, call.url)
                    if acc.events != events and self.total_timeout != math.inf:  # progress
                        events = acc.events
                        deadline.reschedule(asyncio.get_running_loop().time() + self.total_timeout)
                for line in lines.close():
                    acc.feed(line, call.url)
                return acc.result(call.req, call.url)

    # ----------------------------------------------------------------- public

    def complete(
        self,
        prompt: Any,
        *,
        max_tokens: int,
        temperature: float = 0,
        cache_salt: str | None = None,
        prompt_cache_key: str | None = None,
        stream: bool = False,
        splice: SplicePlan | None = None,
    ) -> RemoteCompletion:
        """Complete ``prompt`` (an ``AssembledPrompt``, token ids or a str) via ``/v1/completions``.

        ``splice``: a :class:`~promptsplice.engine_adapters.SplicePlan` for a ``vllm
        serve`` started with the splice connector (``--kv-transfer-config
        kv_transfer_config_json(...)``), sent in ``kv_transfer_params`` with a check of
        the prompt's token ids (the prompt must go as token ids, non-streamed).  The
        result's ``splice`` is the connector's answer: a plan that does not match the
        request (other token ids, more blocks than the prompt holds, another block size)
        is dropped and the request runs as plain prefill, with ``splice.applied`` False
        and ``splice.reason`` naming what differs.  A server without the connector:
        :class:`~promptsplice.errors.EngineRequestError` saying so.

        Once the engine's :attr:`mirror` exists, a prompt sent as token ids is replayed
        into it when its answer arrives, as ``generate`` replays its own (the generated
        tokens' blocks too when the server returned their ids; this request does not
        ask for them).  A prompt sent as text (OpenAI, ``send_token_ids=False``) is not:
        its ids are not known here.
        """
        req = self._completion_request(
            prompt, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt,
            prompt_cache_key=prompt_cache_key, stream=stream, splice=splice,
        )
        completion = self._run(self._completion(req))
        self._replay(req, completion)
        return completion

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int,
        temperature: float = 0,
        cache_salt: str | None = None,
        prompt_cache_key: str | None = None,
        stream: bool = False,
    ) -> RemoteCompletion:
        """Answer ``messages`` via ``/v1/chat/completions`` (the server applies its template)."""
        req = self._chat_request(
            messages, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt,
            prompt_cache_key=prompt_cache_key, stream=stream,
        )
        return self._run(self._completion(req))

    def server_counters(self) -> ServerCounters:
        """The server's prefix-cache counters from its Prometheus ``/metrics``."""
        return counters_from(self._run(self._get("/metrics")))

    async def acomplete(
        self,
        prompt: Any,
        *,
        max_tokens: int,
        temperature: float = 0,
        cache_salt: str | None = None,
        prompt_cache_key: str | None = None,
        stream: bool = False,
        splice: SplicePlan | None = None,
    ) -> RemoteCompletion:
        """Async twin of :meth:`complete`."""
        req = self._completion_request(
            prompt, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt,
            prompt_cache_key=prompt_cache_key, stream=stream, splice=splice,
        )
        completion = await self._arun(self._completion(req))
        self._replay(req, completion)
        return completion

    async def achat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int,
        temperature: float = 0,
        cache_salt: str | None = None,
        prompt_cache_key: str | None = None,
        stream: bool = False,
    ) -> RemoteCompletion:
        """Async twin of :meth:`chat`."""
        req = self._chat_request(
            messages, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt,
            prompt_cache_key=prompt_cache_key, stream=stream,
        )
        return await self._arun(self._completion(req))

    async def aserver_counters(self) -> ServerCounters:
        """Async twin of :meth:`server_counters`."""
        return counters_from(await self._arun(self._get("/metrics")))
