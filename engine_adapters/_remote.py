"""A remote OpenAI-compatible engine over httpx (vLLM serve, SGLang, OpenAI).

``RemoteEngine(base_url)`` sends an assembled prompt to ``/v1/completions`` (token ids
where the server accepts them: vLLM, SGLang; text elsewhere) or messages to
``/v1/chat/completions``, sync or async, streaming or not, and returns a
:class:`RemoteCompletion` with the server's usage and client-side timings.

Cached tokens are read from ``usage.prompt_tokens_details.cached_tokens``.  A server
that does not report them (vLLM without ``--enable-prompt-tokens-details``, many
proxies) gives ``cached_tokens=None``: *unknown*, never reported as 0.
``server_counters()`` reads the server's Prometheus ``/metrics``
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``).

Errors: 429, 5xx, connect errors, connections broken mid-response (a server that died
while streaming) and timeouts are retried ``max_retries`` times with exponential
backoff (``backoff * 2**attempt`` seconds, or the server's ``Retry-After`` when it is
shorter than 60 s); a completion is only returned whole, so a retry never repeats
output.  Then, or at once for anything else:

* server unreachable, or the connection broke -> :class:`EngineUnavailableError` naming the URL;
* timeout -> :class:`EngineTimeoutError` saying which timeout (connect, read, write, pool);
* a body that is not the JSON expected -> :class:`EngineRequestError` with a snippet;
* HTTP 4xx (and 429/5xx once retries are spent) -> :class:`EngineRequestError` with the
  server's message; a 400 saying the prompt exceeds the context ->
  :class:`ContextLengthError`.

httpx exceptions never escape: they are translated with ``raise ... from exc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from promptsplice._validate import (
    check_bool,
    check_int,
    check_messages,
    check_number,
    check_salt,
    check_text,
)
from promptsplice.errors import (
    ConfigError,
    ContextLengthError,
    EngineError,
    EngineRequestError,
    EngineResponseError,
    EngineTimeoutError,
    EngineUnavailableError,
    InputError,
    InvalidSaltError,
)
from promptsplice.tenancy import SaltGuard

__all__ = [
    "DEFAULT_TIMEOUT",
    "RemoteCompletion",
    "RemoteEngine",
    "ServerCounters",
    "parse_prometheus_counters",
]

DEFAULT_TIMEOUT = httpx.Timeout(120.0, connect=5.0)
"""Default timeouts: 5 s to connect, 120 s for each read/write/pool wait."""

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_MAX_RETRY_AFTER_S = 60.0
_BROKEN = (httpx.RemoteProtocolError, httpx.ReadError)
"""A connection that broke before the response ended (the server died or dropped it)."""
_SNIPPET = 200
_CONTEXT_RE = re.compile(
    r"maximum context length|context length|max_model_len|too long|context window",
    re.IGNORECASE,
)

SendTokenIds = Literal["auto"] | bool


@dataclass(frozen=True, slots=True)
class RemoteCompletion:
    """One completion from a remote server.

    ``cached_tokens`` is ``None`` when the server did not report it (unknown, not 0).
    ``prompt_tokens``/``completion_tokens`` are ``None`` when the server sent no usage.
    ``ttft_s`` (time to first token, measured client-side from sending the request to
    the first streamed text) is ``None`` for non-streaming requests; ``total_s`` is the
    client-side wall time of the whole request (retries included).
    """

    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    ttft_s: float | None
    total_s: float
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """The server's prefix-cache counters (token counts), summed over label sets.

    A field is ``None`` when the server's ``/metrics`` does not expose that counter.
    """

    prefix_cache_queries: int | None
    prefix_cache_hits: int | None

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


# --------------------------------------------------------------------------- helpers


def _snippet(body: str | bytes) -> str:
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    body = body.strip()
    return body if len(body) <= _SNIPPET else body[:_SNIPPET] + "..."


def _server_message(response: httpx.Response) -> str:
    """The error message a server put in its body (OpenAI / vLLM / SGLang shapes)."""
    try:
        data = response.json()
    except (ValueError, UnicodeDecodeError):
        return _snippet(response.content) or response.reason_phrase
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key])
    return _snippet(response.content)


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _cached_from_usage(usage: Any) -> int | None:
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, Mapping):
        return None
    return _int_or_none(details.get("cached_tokens"))


def _timeout_name(exc: httpx.TimeoutException) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect"
    if isinstance(exc, httpx.ReadTimeout):
        return "read"
    if isinstance(exc, httpx.WriteTimeout):
        return "write"
    if isinstance(exc, httpx.PoolTimeout):
        return "pool"
    return "request"


class _Retry(Exception):
    """Internal: this attempt failed in a retryable way."""

    def __init__(self, error: Exception, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds <= _MAX_RETRY_AFTER_S else None


@dataclass(slots=True)
class _Request:
    path: str
    body: dict[str, Any]
    chat: bool
    prompt_len: int | None


class _Accumulator:
    """Collects a streamed (SSE) response chunk by chunk."""

    def __init__(self, chat: bool, start: float) -> None:
        self.chat = chat
        self.start = start
        self.parts: list[str] = []
        self.ttft: float | None = None
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.done = False

    def feed(self, line: str, url: str) -> None:
        line = line.strip()
        if not line or line.startswith(":") or not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise EngineResponseError(
                f"malformed stream chunk from {url}: {_snippet(data)!r}"
            ) from exc
        if not isinstance(chunk, Mapping):
            raise EngineResponseError(f"malformed stream chunk from {url}: {_snippet(data)!r}")
        if isinstance(chunk.get("error"), Mapping):
            raise EngineRequestError(
                f"{url} failed mid-stream: {chunk['error'].get('message', _snippet(data))}"
            )
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, Mapping):
                continue
            if self.chat:
                delta = choice.get("delta") or {}
                text = delta.get("content") if isinstance(delta, Mapping) else None
            else:
                text = choice.get("text")
            if text:
                if self.ttft is None:
                    self.ttft = time.perf_counter() - self.start
                self.parts.append(text)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def result(self, prompt_len: int | None, url: str) -> RemoteCompletion:
        if not self.done and self.finish_reason is None:
            raise EngineResponseError(
                f"the stream from {url} ended before a finish_reason or [DONE] "
                f"(got {len(self.parts)} text chunks): the server closed it early"
            )
        usage = self.usage if isinstance(self.usage, Mapping) else {}
        total = time.perf_counter() - self.start
        return RemoteCompletion(
            text="".join(self.parts),
            prompt_tokens=_int_or_none(usage.get("prompt_tokens")) or prompt_len,
            completion_tokens=_int_or_none(usage.get("completion_tokens")),
            cached_tokens=_cached_from_usage(self.usage),
            ttft_s=self.ttft,
            total_s=total,
            finish_reason=self.finish_reason,
        )


# --------------------------------------------------------------------------- engine


class RemoteEngine:
    """A client for one OpenAI-compatible server.

    ``base_url``: the server root or its ``/v1`` (``http://127.0.0.1:8000``,
    ``https://api.openai.com/v1``).  ``model``: the model name; ``None`` asks the
    server's ``/v1/models`` once and takes the first.  ``send_token_ids``: ``"auto"``
    sends token ids to ``/v1/completions`` except to OpenAI (api.openai.com), which gets
    the prompt's text; ``True``/``False`` force it.  ``prompt_cache_key``: an
    assembled prompt's ``prefix_key`` is sent as ``prompt_cache_key`` where the server
    supports it (OpenAI); one passed explicitly is always sent.  ``transport``: an
    ``httpx`` transport (tests).  ``require_salt``: refuse requests without a
    ``cache_salt`` (:class:`~promptsplice.errors.MissingSaltError`); either way, mixing
    salted and unsalted requests warns once
    (:class:`~promptsplice.errors.UnsaltedTenantWarning`).
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = 3,
        backoff: float = 0.5,
        send_token_ids: SendTokenIds = "auto",
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        require_salt: bool = False,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.strip():
            raise ConfigError("base_url must be a non-empty URL such as http://127.0.0.1:8000")
        parts = urlsplit(base_url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"base_url must be an http(s) URL, got {base_url!r}")
        root = base_url.strip().rstrip("/")
        if root.endswith("/v1"):
            root = root[: -len("/v1")]
        self.base_url = root
        self._host = (parts.hostname or "").lower()
        check_int(max_retries, "max_retries", minimum=0)
        check_number(backoff, "backoff")
        check_text(model, "model", optional=True)
        check_text(api_key, "api_key", optional=True)
        if send_token_ids not in ("auto", True, False):
            raise ConfigError(f"send_token_ids must be 'auto', True or False, got {send_token_ids!r}")
        if isinstance(timeout, bool):
            raise ConfigError(f"timeout must be seconds or an httpx.Timeout, got {timeout!r}")
        if isinstance(timeout, int | float):
            timeout = httpx.Timeout(float(check_number(timeout, "timeout (seconds)", strict=True)))
        if not isinstance(timeout, httpx.Timeout):
            raise ConfigError(f"timeout must be seconds or an httpx.Timeout, got {timeout!r}")
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
        self._aclient: httpx.AsyncClient | None = None

    # ----------------------------------------------------------------- lifecycle

    def _sync_client(self) -> httpx.Client:
        if self._client is None:
            kwargs: dict[str, Any] = {"headers": self._headers, "timeout": self.timeout}
            if self._transport is not None:
                kwargs["transport"] = self._transport
            self._client = httpx.Client(**kwargs)
        return self._client

    def _async_client(self) -> httpx.AsyncClient:
        if self._aclient is None:
            kwargs: dict[str, Any] = {"headers": self._headers, "timeout": self.timeout}
            if self._transport is not None:
                kwargs["transport"] = self._transport
            self._aclient = httpx.AsyncClient(**kwargs)
        return self._aclient

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None
        self.close()

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
    ) -> _Request:
        derived_key: str | None = None
        text: str | None = None
        ids: list[int] | None = None
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("prompt is an empty string")
            text = prompt
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            ids = self._check_ids(prompt, "prompt")
        elif hasattr(prompt, "token_ids"):
            ids = self._check_ids(prompt.token_ids, "prompt.token_ids")
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
        return _Request("/v1/completions", body, False, len(ids) if ids is not None else None)

    def _chat_request(
        self,
        messages: Any,
        *,
        max_tokens: int,
        temperature: float,
        cache_salt: str | None,
        prompt_cache_key: str | None,
        stream: bool,
    ) -> _Request:
        check_messages(messages, allow_empty=False, require_content=True)
        clean = [dict(message) for message in messages]
        body = self._common_body(max_tokens, temperature, cache_salt, stream, prompt_cache_key)
        body["messages"] = clean
        if prompt_cache_key is not None:
            body["prompt_cache_key"] = prompt_cache_key
        return _Request("/v1/chat/completions", body, True, None)

    @staticmethod
    def _check_ids(ids: Any, what: str) -> list[int]:
        out = list(ids)
        if not out:
            raise InputError(f"{what} is empty")
        for i, t in enumerate(out):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InputError(f"{what}[{i}] is not a token id (an int >= 0): {t!r}")
        return out

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

    # ----------------------------------------------------------------- error mapping

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _transport_error(self, exc: httpx.HTTPError, url: str) -> Exception:
        if isinstance(exc, httpx.TimeoutException):
            name = _timeout_name(exc)
            seconds = getattr(self.timeout, name, None) if name != "request" else None
            limit = f" of {seconds:g} s" if isinstance(seconds, int | float) else ""
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
        return EngineError(f"request to {url} failed: {type(exc).__name__}: {exc}")

    def _status_error(self, response: httpx.Response, url: str, req: _Request | None) -> Exception:
        message = _server_message(response)
        if response.status_code == 400 and _CONTEXT_RE.search(message):
            nums = [int(n) for n in re.findall(r"\d+", message)]
            m = re.search(r"context length is (\d+)", message)
            limit = int(m.group(1)) if m else (nums[0] if nums else -1)
            m = re.search(r"(\d+) (?:input|prompt) tokens", message)
            prompt_len = int(m.group(1)) if m else (req.prompt_len if req and req.prompt_len else -1)
            return ContextLengthError(
                f"{url} refused the prompt as too long: {message}",
                prompt_tokens=prompt_len,
                max_tokens=limit,
            )
        return EngineRequestError(f"{url} answered HTTP {response.status_code}: {message}")

    def _check_response(self, response: httpx.Response, url: str, req: _Request | None) -> None:
        if response.status_code < 400:
            return
        error = self._status_error(response, url, req)
        if response.status_code in _RETRY_STATUS:
            raise _Retry(error, _retry_after(response))
        raise error

    def _delay(self, attempt: int, retry: _Retry) -> float:
        delay = self.backoff * (2**attempt)
        if retry.retry_after is not None:
            delay = max(delay, retry.retry_after) if self.backoff else retry.retry_after
        return delay

    def _parse_json(self, response: httpx.Response, url: str) -> Mapping[str, Any]:
        try:
            data = response.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise EngineResponseError(
                f"{url} answered HTTP {response.status_code} with a body that is not JSON: "
                f"{_snippet(response.content)!r}"
            ) from exc
        if not isinstance(data, Mapping):
            raise EngineResponseError(f"{url} answered JSON that is not an object: {_snippet(response.content)!r}")
        return data

    def _completion_from_json(
        self, data: Mapping[str, Any], req: _Request, url: str, start: float
    ) -> RemoteCompletion:
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise EngineResponseError(f"{url} answered without choices: {_snippet(json.dumps(data))!r}")
        choice = choices[0]
        if req.chat:
            message = choice.get("message")
            text = message.get("content") if isinstance(message, Mapping) else None
        else:
            text = choice.get("text")
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise EngineResponseError(f"{url} answered a non-text completion: {_snippet(json.dumps(data))!r}")
        usage = data.get("usage")
        usage_map = usage if isinstance(usage, Mapping) else {}
        return RemoteCompletion(
            text=text,
            prompt_tokens=_int_or_none(usage_map.get("prompt_tokens")) or req.prompt_len,
            completion_tokens=_int_or_none(usage_map.get("completion_tokens")),
            cached_tokens=_cached_from_usage(usage),
            ttft_s=None,
            total_s=time.perf_counter() - start,
            finish_reason=choice.get("finish_reason"),
        )

    # ----------------------------------------------------------------- sync

    def _resolve_model(self) -> str:
        if self.model is None:
            self.model = self._model_from_list(self._get("/v1/models"))
        return self.model

    def _model_from_list(self, response: httpx.Response) -> str:
        url = self._url("/v1/models")
        data = self._parse_json(response, url)
        models = data.get("data")
        if not isinstance(models, list) or not models or not isinstance(models[0], Mapping) or "id" not in models[0]:
            raise EngineResponseError(
                f"{url} lists no model; pass RemoteEngine(model=...): {_snippet(response.content)!r}"
            )
        return str(models[0]["id"])

    def _with_retries(self, attempt_fn: Any) -> Any:
        attempt = 0
        while True:
            try:
                return attempt_fn()
            except _Retry as retry:
                if attempt >= self.max_retries:
                    raise retry.error from retry.error.__cause__
                time.sleep(self._delay(attempt, retry))
                attempt += 1

    @contextlib.contextmanager
    def _translating(self, url: str) -> Iterator[None]:
        """httpx's errors -> ours, at the boundary: connect errors and timeouts become
        retryable (``_Retry``), every other transport error is final.  Plain ``with``
        works inside the async twins too (nothing here awaits)."""
        try:
            yield
        except (httpx.ConnectError, httpx.TimeoutException, *_BROKEN) as exc:
            # A connection broken mid-response (the server died or dropped it) is retried
            # like a refused one: a completion is returned only whole, so a retry never
            # repeats output.
            raise _Retry(self._chain(self._transport_error(exc, url), exc)) from exc
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, url) from exc

    def _get(self, path: str) -> httpx.Response:
        url = self._url(path)

        def once() -> httpx.Response:
            with self._translating(url):
                response = self._sync_client().get(url)
            self._check_response(response, url, None)
            return response

        return self._with_retries(once)

    @staticmethod
    def _chain(error: Exception, cause: BaseException) -> Exception:
        error.__cause__ = cause
        return error

    def _send(self, req: _Request) -> RemoteCompletion:
        req.body["model"] = self._resolve_model()
        url = self._url(req.path)
        start = time.perf_counter()

        def once() -> RemoteCompletion:
            client = self._sync_client()
            with self._translating(url):
                if not req.body.get("stream"):
                    response = client.post(url, json=req.body)
                    self._check_response(response, url, req)
                    return self._completion_from_json(self._parse_json(response, url), req, url, start)
                with client.stream("POST", url, json=req.body) as response:
                    if response.status_code >= 400:
                        response.read()
                        self._check_response(response, url, req)
                    acc = _Accumulator(req.chat, start)
                    for line in response.iter_lines():
                        acc.feed(line, url)
                    return acc.result(req.prompt_len, url)

        return self._with_retries(once)

    def complete(
        self,
        prompt: Any,
        *,
        max_tokens: int,
        temperature: float = 0,
        cache_salt: str | None = None,
        prompt_cache_key: str | None = None,
        stream: bool = False,
    ) -> RemoteCompletion:
        """Complete ``prompt`` (an ``AssembledPrompt``, token ids or a str) via ``/v1/completions``."""
        req = self._completion_request(
            prompt, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt,
            prompt_cache_key=prompt_cache_key, stream=stream,
        )
        return self._send(req)

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
        return self._send(req)

    def server_counters(self) -> ServerCounters:
        """The server's prefix-cache counters from its Prometheus ``/metrics``."""
        return self._counters_from(self._get("/metrics"))

    @staticmethod
    def _counters_from(response: httpx.Response) -> ServerCounters:
        values = parse_prometheus_counters(
            response.text, ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
        )
        q = values.get("vllm:prefix_cache_queries_total")
        h = values.get("vllm:prefix_cache_hits_total")
        return ServerCounters(
            prefix_cache_queries=None if q is None else int(q),
            prefix_cache_hits=None if h is None else int(h),
        )

    # ----------------------------------------------------------------- async

    async def _awith_retries(self, attempt_fn: Any) -> Any:
        attempt = 0
        while True:
            try:
                return await attempt_fn()
            except _Retry as retry:
                if attempt >= self.max_retries:
                    raise retry.error from retry.error.__cause__
                await asyncio.sleep(self._delay(attempt, retry))
                attempt += 1

    async def _aget(self, path: str) -> httpx.Response:
        url = self._url(path)

        async def once() -> httpx.Response:
            with self._translating(url):
                response = await self._async_client().get(url)
            self._check_response(response, url, None)
            return response

        return await self._awith_retries(once)

    async def _aresolve_model(self) -> str:
        if self.model is None:
            self.model = self._model_from_list(await self._aget("/v1/models"))
        return self.model

    async def _asend(self, req: _Request) -> RemoteCompletion:
        req.body["model"] = await self._aresolve_model()
        url = self._url(req.path)
        start = time.perf_counter()

        async def once() -> RemoteCompletion:
            client = self._async_client()
            with self._translating(url):
                if not req.body.get("stream"):
                    response = await client.post(url, json=req.body)
                    self._check_response(response, url, req)
                    return self._completion_from_json(self._parse_json(response, url), req, url, start)
                async with client.stream("POST", url, json=req.body) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        self._check_response(response, url, req)
                    acc = _Accumulator(req.chat, start)
                    async for line in response.aiter_lines():
                        acc.feed(line, url)
                    return acc.result(req.prompt_len, url)

        return await self._awith_retries(once)

    async def acomplete(
        self,
        prompt: Any,
        *,
        max_tokens: int,
        temperature: float = 0,
        cache_salt: str | None = None,
        prompt_cache_key: str | None = None,
        stream: bool = False,
    ) -> RemoteCompletion:
        """Async twin of :meth:`complete`."""
        req = self._completion_request(
            prompt, max_tokens=max_tokens, temperature=temperature, cache_salt=cache_salt,
            prompt_cache_key=prompt_cache_key, stream=stream,
        )
        return await self._asend(req)

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
        return await self._asend(req)

    async def aserver_counters(self) -> ServerCounters:
        """Async twin of :meth:`server_counters`."""
        return self._counters_from(await self._aget("/metrics"))

