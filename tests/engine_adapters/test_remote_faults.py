"""RemoteEngine against misbehaving servers: fakes on 127.0.0.1 (a raw socket server
that trickles, stalls or answers nothing) and ``httpx.MockTransport`` replies that a
real ``vllm serve`` never sends (extra choices, impossible usage counts, odd statuses).
Each test runs in well under 5 s; a hang fails through ``pytest.mark.timeout``."""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import json
import socket
import threading
import time

import httpx
import pytest

from promptsplice.engine_adapters import PrefixRouter
from promptsplice.engine_adapters._remote import DEFAULT_TIMEOUT, DEFAULT_TOTAL_TIMEOUT, RemoteEngine
from promptsplice.engine_adapters._wire import MAX_RETRY_AFTER_S, retry_after
from promptsplice.errors import (
    ConfigError,
    EngineError,
    EngineRequestError,
    EngineResponseError,
    EngineTimeoutError,
    EngineUnavailableError,
)

from tests.engine_adapters.test_remote import _mock, _ok_body, _sse, _stream_body

SSE = {"content-type": "text/event-stream"}
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
"""A usage for a prompt of 3 token ids (a prompt sent as ids is checked against it)."""


class FakeServer:
    """A socket server on 127.0.0.1 that runs ``handle(conn)`` for each connection (after
    reading the request head); ``stop()`` closes it and every connection."""

    def __init__(self, handle):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.handle = handle
        self.conns: list[socket.socket] = []
        self.closed_by_client = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn):
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            self.handle(conn)
        except OSError:
            pass

    def stop(self):
        self.sock.close()
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass


@pytest.fixture
def fake_server():
    servers = []

    def make(handle):
        servers.append(FakeServer(handle))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def _trickle(head: bytes, piece: bytes, seconds: float = 4.0):
    """Send ``head``, then ``piece`` every 0.1 s for ``seconds`` (then hang up): each read
    comes well inside any read timeout, the response never ends on its own."""

    def handle(conn):
        conn.sendall(head)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(piece)
            time.sleep(0.1)

    return handle


# ------------------------------------------------------------------ 1. total deadline


def test_the_timeouts_default_to_connect_read_and_total():
    eng = RemoteEngine("http://127.0.0.1:9", model="m")
    assert (eng.timeout.connect, eng.timeout.read, eng.total_timeout) == (5.0, 120.0, 600.0)
    assert DEFAULT_TOTAL_TIMEOUT == 600.0 and DEFAULT_TIMEOUT.read == 120.0
    # a number keeps httpx's meaning (each phase); the total is 600 s, or longer with it
    assert RemoteEngine("http://127.0.0.1:9", model="m", timeout=2).total_timeout == 600.0
    assert RemoteEngine("http://127.0.0.1:9", model="m", timeout=900).total_timeout == 900.0
    # the longest phase, whichever it is (a long write or pool wait was cut to 600 s)
    long_write = RemoteEngine("http://127.0.0.1:9", model="m", timeout=httpx.Timeout(10, write=1000, pool=900))
    assert (long_write.total_timeout, long_write.timeout.write, long_write.timeout.pool) == (1000.0, 1000.0, 900.0)
    short = RemoteEngine("http://127.0.0.1:9", model="m", total_timeout=1.5)
    assert short.timeout.read == 1.5 and short.timeout.connect == 1.5  # no read outlasts the whole
    import math

    none = RemoteEngine("http://127.0.0.1:9", model="m", timeout=httpx.Timeout(None))  # "no timeout" stays none
    assert none.total_timeout == math.inf and none.timeout.read is None
    assert RemoteEngine("http://127.0.0.1:9", model="m", total_timeout=math.inf).timeout.read == 120.0
    for bad in (0, -1, float("nan"), "600", True, -math.inf):
        with pytest.raises(ConfigError, match="total_timeout"):
            RemoteEngine("http://127.0.0.1:9", model="m", total_timeout=bad)


@pytest.mark.timeout(15)
@pytest.mark.parametrize("stream", [True, False], ids=["sse-keepalives", "body-a-byte-at-a-time"])
def test_a_server_that_trickles_forever_is_cut_at_the_total_timeout(fake_server, stream):
    """Each read came inside the read timeout, so a server sending ``: ping`` comments
    (or a body a byte every 0.5 s) held ``complete()`` forever with ``timeout=2``."""
    if stream:
        srv = fake_server(_trickle(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n", b": ping\n\n"))
    else:
        srv = fake_server(_trickle(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                   b"content-length: 100000\r\n\r\n", b" "))
    eng = RemoteEngine(srv.url, model="m", timeout=0.6, total_timeout=0.6, max_retries=0)
    for call in (lambda: eng.complete([1, 2], max_tokens=2, stream=stream),
                 lambda: asyncio.run(eng.acomplete([1, 2], max_tokens=2, stream=stream))):
        t0 = time.monotonic()
        with pytest.raises(EngineTimeoutError, match=r"total timeout of 0.6 s .*total_timeout="):
            call()
        assert time.monotonic() - t0 < 2.5
    if stream:  # the served engine's own stream() too
        t0 = time.monotonic()
        with pytest.raises(EngineTimeoutError, match="total timeout"):
            list(eng.stream([1, 2], max_tokens=2))
        assert time.monotonic() - t0 < 2.5


# ------------------------------------------------------------------ 3. choices


def test_a_reply_with_a_choice_other_than_index_0_is_an_error_not_a_pick_or_a_join():
    """choices [{index 1: B}, {index 0: A}] answered "B"; streamed ones were joined ("A1B1A2")."""
    body = {"choices": [{"index": 1, "text": "B", "finish_reason": "stop"},
                        {"index": 0, "text": "A", "finish_reason": "stop"}]}
    with pytest.raises(EngineResponseError, match="index 1.*only one choice"):
        _mock(lambda r: httpx.Response(200, json=body)).complete([1], max_tokens=2)
    sse = _sse(json.dumps({"choices": [{"index": 0, "text": "A1", "token_ids": [5]},
                                       {"index": 1, "text": "B1", "token_ids": [6]}]}),
               json.dumps({"choices": [{"index": 0, "text": "A2", "finish_reason": "stop"}], "usage": USAGE}),
               "[DONE]")
    eng = _mock(lambda r: httpx.Response(200, content=sse, headers=SSE))
    with pytest.raises(EngineResponseError, match="index 1"):
        eng.complete([1], max_tokens=2, stream=True)
    with pytest.raises(EngineResponseError, match="index 1"):
        list(eng.stream([1], max_tokens=2))  # never into the cache mirror
    two_zero = {"choices": [{"index": 0, "text": "A", "finish_reason": "stop"}] * 2}
    with pytest.raises(EngineResponseError, match="2 choices where one was asked for"):
        _mock(lambda r: httpx.Response(200, json=two_zero)).complete([1], max_tokens=2)
    no_index = {"choices": [{"text": "A", "finish_reason": "stop"}]}  # a missing index is 0
    assert _mock(lambda r: httpx.Response(200, json=no_index)).complete([1], max_tokens=2).text == "A"


# ------------------------------------------------------------------ 4. usage counts


@pytest.mark.parametrize("usage, field", [
    ({"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": -5}}, "cached_tokens=-5"),
    ({"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 999}}, "cached_tokens=999 over prompt_tokens=3"),
    ({"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2.9}}, "cached_tokens=2.9"),
    ({"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1e300}}, "cached_tokens=1e\\+300"),
    ({"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": "2"}}, "cached_tokens='2'"),
    ({"prompt_tokens": 3, "completion_tokens": -1}, "completion_tokens=-1"),
    ({"prompt_tokens": -3}, "prompt_tokens=-3"),
])
def test_usage_counts_that_are_not_counts_are_response_errors(usage, field):
    """They were returned as they came (or truncated: 2.9 -> 2) and reached LangChain's
    usage_metadata."""
    eng = _mock(lambda r: httpx.Response(200, json={**_ok_body(), "usage": usage}))
    with pytest.raises(EngineResponseError, match=field):
        eng.complete([1, 2, 3], max_tokens=2)
    chunks = ['{"choices": [{"text": "x", "finish_reason": "stop"}]}', json.dumps({"choices": [], "usage": usage}), "[DONE]"]
    streamed = _mock(lambda r: httpx.Response(200, content=_sse(*chunks), headers=SSE))
    with pytest.raises(EngineResponseError, match=field):
        streamed.complete([1, 2, 3], max_tokens=2, stream=True)


def test_missing_or_null_counts_stay_unknown_and_whole_floats_are_counts():
    usage = {"prompt_tokens": 3.0, "completion_tokens": None, "prompt_tokens_details": {"cached_tokens": None}}
    got = _mock(lambda r: httpx.Response(200, json={**_ok_body(), "usage": usage})).complete([1, 2, 3], max_tokens=2)
    assert (got.prompt_tokens, got.completion_tokens, got.cached_tokens) == (3, None, None)


@pytest.mark.parametrize("usage, says", [
    ({"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}, "prompt_tokens=2 for a prompt sent as 3 token ids"),
    ({"prompt_tokens": 100000, "prompt_tokens_details": {"cached_tokens": 0}},
     "prompt_tokens=100000 for a prompt sent as 3 token ids"),
    ({"prompt_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}, "prompt_tokens=0 for a prompt sent as 3 token ids"),
    ({"prompt_tokens_details": {"cached_tokens": 5}}, "cached_tokens=5 for a prompt sent as 3 token ids"),
])
def test_usage_that_does_not_fit_the_token_ids_sent_is_a_response_error(usage, says):
    """usage.prompt_tokens was never compared with the ids sent (100000 was reported
    for 3 ids, 0 replaced by their count), and cached_tokens only with the server's own
    prompt_tokens: without one, 5 cached of a 3-token prompt (a prefill of -2)."""
    usage = {"completion_tokens": 1, **usage}
    body = {"choices": [{"index": 0, "text": "x", "token_ids": [5], "finish_reason": "length"}], "usage": usage}
    eng = _mock(lambda r: httpx.Response(200, json=body), block_size=16)
    with pytest.raises(EngineResponseError, match=says):
        eng.complete([1, 2, 3], max_tokens=1)
    with pytest.raises(EngineResponseError, match=says):
        eng.generate([1, 2, 3], max_tokens=1)  # the served engine's record (prefill_tokens)
    chunks = [json.dumps({"choices": body["choices"]}), json.dumps({"choices": [], "usage": usage}), "[DONE]"]
    streamed = _mock(lambda r: httpx.Response(200, content=_sse(*chunks), headers=SSE), block_size=16)
    with pytest.raises(EngineResponseError, match=says):
        streamed.complete([1, 2, 3], max_tokens=1, stream=True)
    with pytest.raises(EngineResponseError, match=says):
        list(streamed.stream([1, 2, 3], max_tokens=1))


def test_a_prompt_sent_as_ids_counts_them_and_one_sent_as_text_keeps_the_servers_count():
    no_count = {"completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}}
    body = {"choices": [{"index": 0, "text": "x", "token_ids": [5], "finish_reason": "length"}], "usage": no_count}
    eng = _mock(lambda r: httpx.Response(200, json=body), block_size=16)
    got = eng.complete([1, 2, 3], max_tokens=1)
    assert (got.prompt_tokens, got.cached_tokens) == (3, 2)
    rec = eng.generate([1, 2, 3], max_tokens=1)
    assert (rec.prompt_tokens, rec.num_cached_tokens, rec.prefill_tokens) == (3, 2, 1)
    # text: the server tokenizes it, so its count stands (nothing to compare it with) ...
    counted = {**body, "usage": {**no_count, "prompt_tokens": 7}}
    assert _mock(lambda r: httpx.Response(200, json=counted)).complete("seven tokens of text", max_tokens=1).prompt_tokens == 7
    # ... and without one, the served engine's record has no prompt length to take the
    # cached tokens from (it took 0: a prefill of -2)
    with pytest.raises(EngineResponseError, match="cached_tokens=2 for a prompt of unknown length"):
        eng.generate("some text", max_tokens=1)


def _ack_reply(ack):
    def handler(request):
        n = len(json.loads(request.content)["prompt"])
        return httpx.Response(200, json={
            "choices": [{"index": 0, "text": "ok", "token_ids": [5], "finish_reason": "length"}],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
            "kv_transfer_params": {"splice_ack": {"reason": "" if ack[0] else "dropped", "planned_tokens": 32,
                                                  "block_size": 16, "relocation": True, **dict(zip(
                                                      ("applied", "loaded_tokens", "relocated_tokens"), ack))}},
        })
    return handler


@pytest.mark.parametrize("ack, says", [
    ((False, 0, 10**6), r"relocated_tokens \(1000000\) exceed its loaded_tokens \(0\)"),
    ((True, 32, 48), r"relocated_tokens \(48\) exceed its loaded_tokens \(32\)"),
    ((True, 112, 0), r"loaded_tokens \(112\) exceed the prompt's 100 tokens"),
])
def test_a_splice_ack_whose_counts_contradict_themselves_or_the_prompt_is_a_response_error(ack, says):
    """An ack with applied=false, nothing loaded and 1,000,000 relocated tokens of a
    100-token prompt was taken as it came: the agent step reported them relocated."""
    from promptsplice.blocks import root_hash
    from promptsplice.engine_adapters import SplicePlan, SpliceSegment

    plan = SplicePlan(16, (SpliceSegment(32, 2, 16, root_hash(None)),))
    eng = _mock(_ack_reply(ack), block_size=16)
    with pytest.raises(EngineResponseError, match=says):
        eng.generate(list(range(10, 110)), max_tokens=1, splice=plan)


@pytest.mark.parametrize("ack", [(True, 96, 32), (False, 32, 0), (False, 0, 0)])
def test_a_splice_ack_whose_counts_fit_is_taken(ack):
    """A dropped plan (applied false) may still count loads: the plain prefill's offload hits."""
    from promptsplice.blocks import root_hash
    from promptsplice.engine_adapters import SplicePlan, SpliceSegment

    plan = SplicePlan(16, (SpliceSegment(32, 2, 16, root_hash(None)),))
    rc = _mock(_ack_reply(ack), block_size=16)._generate_served(list(range(10, 110)), max_tokens=1, splice=plan)[1]
    assert (rc.splice.applied, rc.splice.loaded_tokens, rc.splice.relocated_tokens) == ack


# ------------------------------------------------------------------ 5. silent drops


@pytest.mark.parametrize("choice, message", [
    ({"finish_reason": "stop"}, "without a message"),
    ({"text": "X", "finish_reason": "stop"}, "without a message"),
])
def test_a_chat_choice_without_its_message_is_an_error_not_an_empty_answer(choice, message):
    eng = _mock(lambda r: httpx.Response(200, json={"choices": [choice]}))
    with pytest.raises(EngineResponseError, match=message):
        eng.chat([{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.mark.parametrize("message, finish", [
    ({"content": None, "tool_calls": [{"id": "1"}]}, "tool_calls"),  # OpenAI's documented shape
    ({"content": None, "refusal": "I can't help with that."}, "stop"),  # an OpenAI refusal
    ({"content": None, "audio": {"id": "a1"}}, "stop"),  # an audio reply
    ({"content": None, "tool_calls": [], "reasoning_content": None}, "length"),  # vLLM, nothing but reasoning cut short
])
def test_a_message_with_null_content_is_an_answer_without_text(message, finish):
    """The first version of the stricter reply check refused all but tool calls and
    reasoning (diff review), where a stream's null delta was still an empty answer."""
    body = {"choices": [{"message": {"role": "assistant", **message}, "finish_reason": finish}]}
    got = _mock(lambda r: httpx.Response(200, json=body)).chat([{"role": "user", "content": "hi"}], max_tokens=2)
    assert (got.text, got.finish_reason) == ("", finish)


def test_a_completion_choice_without_text_is_an_error():
    with pytest.raises(EngineResponseError, match="without text"):
        _mock(lambda r: httpx.Response(200, json={"choices": [{"finish_reason": "stop"}]})).complete([1], max_tokens=2)


def test_a_stream_of_only_done_is_not_an_empty_answer():
    eng = _mock(lambda r: httpx.Response(200, content=b"data: [DONE]\n\n", headers=SSE))
    with pytest.raises(EngineResponseError, match=r"\[DONE\] without a finish_reason"):
        eng.complete([1], max_tokens=2, stream=True)


def test_what_follows_done_is_ignored():
    body = _stream_body() + _sse('{"choices": [{"text": "EXTRA", "token_ids": [9], "finish_reason": "stop"}]}')
    eng = _mock(lambda r: httpx.Response(200, content=body, headers=SSE))
    got = eng.complete([1, 2, 3], max_tokens=2, stream=True)
    assert (got.text, got.token_ids, got.finish_reason) == ("Hello", [1, 2], "length")
    deltas = list(eng.stream([1, 2, 3], max_tokens=2))
    assert "".join(d.text for d in deltas) == "Hello" and deltas[-1].completion.token_ids == [1, 2]


def test_invalid_utf8_in_a_stream_is_an_error_as_in_a_body():
    """The stream decoded it to U+FFFD (a wrong answer) where a JSON body raised."""
    body = b'data: {"choices": [{"text": "\xff\xfe", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    eng = _mock(lambda r: httpx.Response(200, content=body, headers=SSE))
    with pytest.raises(EngineResponseError, match="not valid UTF-8"):
        eng.complete([1], max_tokens=2, stream=True)
    with pytest.raises(EngineResponseError, match="not valid UTF-8"):
        list(eng.stream([1], max_tokens=2))
    with pytest.raises(EngineResponseError):
        _mock(lambda r: httpx.Response(200, content=body.split(b"\n")[0][6:])).complete([1], max_tokens=2)
    split = 'data: {"choices": [{"text": "é ok", "finish_reason": "stop"}]}\r\n\r\ndata: [DONE]\r\n\r\n'.encode()

    def pieces():  # a character and a CRLF cut between reads
        cut = split.index("é".encode()) + 1
        yield split[:cut]
        yield split[cut:cut + 40]
        yield split[cut + 40:]

    eng = _mock(lambda r: httpx.Response(200, content=pieces(), headers=SSE))
    assert eng.complete([1], max_tokens=2, stream=True).text == "é ok"


# ------------------------------------------------------------------ 6. Retry-After


def test_retry_after_reads_seconds_and_http_dates_and_drops_nonsense():
    def ra(value):
        return retry_after(httpx.Response(429, headers={"retry-after": value}))

    assert ra("2") == 2.0 and ra("120") == 120.0
    soon = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= ra(soon) <= 31
    assert ra("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date past: now
    for nonsense in ("-1", "nan", "inf", "soon", ""):
        assert ra(nonsense) is None, nonsense


@pytest.mark.parametrize("value", ["120", "Wed, 21 Oct 2099 07:28:00 GMT", "1e300"])
def test_a_retry_after_over_the_cap_gives_up_at_once_saying_so(monkeypatch, value):
    """They were ignored and the retries went out after 0.1 s."""
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail(f"slept {s}"))
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(429, json={"error": {"message": "rate"}}, headers={"retry-after": value})

    with pytest.raises(EngineRequestError, match=r"asked to retry after \d+ s, more than the 60 s") as info:
        _mock(handler, max_retries=3, backoff=0.1).complete([1], max_tokens=1)
    assert len(calls) == 1 and info.value.status_code == 429 and MAX_RETRY_AFTER_S == 60


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_nonsense_retry_after_falls_back_to_the_backoff(monkeypatch, value):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    eng = _mock(lambda r: httpx.Response(429, json={"error": {"message": "rate"}}, headers={"retry-after": value}),
                max_retries=2, backoff=0.1)
    with pytest.raises(EngineRequestError, match="gave up after 3 attempts"):
        eng.complete([1], max_tokens=1)
    assert slept == [0.1, 0.2]


def test_a_retry_after_date_is_waited_for(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    soon = email.utils.formatdate(time.time() + 20, usegmt=True)
    answers = iter([httpx.Response(503, headers={"retry-after": soon}), httpx.Response(200, json=_ok_body())])
    assert _mock(lambda r: next(answers), backoff=0.1).complete([1], max_tokens=1).text == "ok"
    assert len(slept) == 1 and 15 <= slept[0] <= 21


# ------------------------------------------------------------------ 7. close


@pytest.mark.timeout(20)
def test_requests_racing_close_get_a_promptsplice_error_and_a_closed_engine_stays_closed():
    """httpx's builtin RuntimeError ("the client has been closed") escaped, and a call
    after close() quietly opened a new client."""
    eng = _mock(lambda r: httpx.Response(200, json=_ok_body()))
    errors: list[BaseException] = []
    stop = threading.Event()

    def work():
        while not stop.is_set():
            try:
                eng.complete([1], max_tokens=1)
            except BaseException as exc:  # noqa: BLE001 - what escapes is the point
                errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(4)]
    for t in workers:
        t.start()
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        eng.close()
        time.sleep(0.001)
    stop.set()
    for t in workers:
        t.join()
    assert errors and all(type(e) is EngineError and "is closed" in str(e) for e in errors), {repr(e) for e in errors}
    with pytest.raises(EngineError, match="is closed; make a new RemoteEngine"):
        eng.complete([1], max_tokens=1)
    with pytest.raises(EngineError, match="is closed"):
        asyncio.run(eng.acomplete([1], max_tokens=1))
    with pytest.raises(EngineError, match="is closed"):
        list(eng.stream([1], max_tokens=1))
    assert eng._client is None and not eng._aclients  # no client opened behind the caller's back
    with _mock(lambda r: httpx.Response(200, json=_ok_body())) as ctx:
        ctx.complete([1], max_tokens=1)
    with pytest.raises(EngineError, match="is closed"):
        ctx.complete([1], max_tokens=1)


def test_aclose_lets_go_of_clients_but_the_engine_stays_usable():
    eng = _mock(lambda r: httpx.Response(200, json=_ok_body()))

    async def twice():
        await eng.acomplete([1], max_tokens=1)
        await eng.aclose()
        return await eng.acomplete([1], max_tokens=1)

    assert asyncio.run(twice()).text == "ok" and eng.complete([1], max_tokens=1).text == "ok"


def _slow_completion(seconds: float, requests: list):
    """A server that answers a completion after ``seconds``, counting the requests."""

    def handle(conn):
        requests.append(time.monotonic())
        time.sleep(seconds)
        body = json.dumps(_ok_body()).encode()
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
        except OSError:
            pass

    return handle


@pytest.mark.timeout(20)
def test_aclose_with_a_request_in_flight_fails_it_instead_of_sending_it_again(fake_server):
    """aclose() (or leaving ``async with``) closed the socket under a request on the
    loop: its ReadError read as a server that broke the connection, so the completion
    was sent a second time, on a new client nothing closed."""
    requests: list[float] = []
    srv = fake_server(_slow_completion(0.8, requests))

    async def main():
        async with RemoteEngine(srv.url, model="m", max_retries=3, backoff=0.01) as eng:
            task = asyncio.create_task(eng.acomplete([1, 2], max_tokens=2))
            await asyncio.sleep(0.3)
        with pytest.raises(EngineError, match=r"closed \(aclose\(\)\) while this request was in flight"):
            await task
        await asyncio.sleep(1.0)  # a resent request would have reached the server by now
        return eng

    eng = asyncio.run(main())
    assert len(requests) == 1
    assert all(c.is_closed for c in eng._aclients.values())


@pytest.mark.timeout(20)
def test_close_inside_a_running_loop_closes_that_loops_client_too(fake_server):
    """close() on a live loop only dropped the engine's reference to the loop's
    AsyncClient: its pooled socket stayed open until garbage collection (the README
    said close() lets go of every client)."""
    requests: list[float] = []
    srv = fake_server(_slow_completion(0.0, requests))

    async def main():
        eng = RemoteEngine(srv.url, model="m", max_retries=0)
        assert (await eng.acomplete([1, 2], max_tokens=2)).text == "ok"
        client = eng._aclients[asyncio.get_running_loop()]
        eng.close()
        await asyncio.sleep(0.2)  # the scheduled aclose runs on this loop
        with pytest.raises(EngineError, match="is closed"):
            await eng.acomplete([1, 2], max_tokens=2)
        return client, eng

    client, eng = asyncio.run(main())
    assert client.is_closed and not eng._aclients and len(requests) == 1


def test_a_transport_of_one_kind_refuses_the_other_kind_of_call_by_name():
    """An HTTPTransport passed the constructor and then failed acomplete() with a raw
    AttributeError (handle_async_request); an AsyncHTTPTransport failed complete()."""
    sync_only = RemoteEngine("http://127.0.0.1:9", model="m", transport=httpx.HTTPTransport(), max_retries=0)
    with pytest.raises(ConfigError, match=r"transport HTTPTransport cannot carry async calls: use the sync"):
        asyncio.run(sync_only.acomplete([1], max_tokens=1))
    async_only = RemoteEngine("http://127.0.0.1:9", model="m", transport=httpx.AsyncHTTPTransport(), max_retries=0)
    for call in (lambda: async_only.complete([1], max_tokens=1), lambda: list(async_only.stream([1], max_tokens=1))):
        with pytest.raises(ConfigError, match=r"AsyncHTTPTransport cannot carry sync calls: use the a\* methods"):
            call()
    with _mock(lambda r: httpx.Response(200, json=_ok_body())) as both:  # MockTransport: both kinds
        assert both.complete([1], max_tokens=1).text == asyncio.run(both.acomplete([1], max_tokens=1)).text == "ok"


# ------------------------------------------------------------------ 8. messages


@pytest.mark.parametrize("body, ctype", [
    (json.dumps({"choices": [{"text": "hello", "finish_reason": "stop"}]}), "application/json"),
    ("<html>proxy</html>", "text/html"),
    ("", "text/plain"),
])
def test_a_reply_that_is_not_sse_to_a_stream_request_says_so(body, ctype):
    """It said the stream "ended before a finish_reason... the server closed it early"."""
    eng = _mock(lambda r: httpx.Response(200, content=body.encode(), headers={"content-type": ctype}))
    for call in (lambda: eng.complete([1], max_tokens=2, stream=True), lambda: list(eng.stream([1], max_tokens=2))):
        with pytest.raises(EngineResponseError, match=f"no SSE data lines \\(content-type {ctype}\\).*ignored stream=True") as info:
            call()
        assert body[:10] in str(info.value)


@pytest.mark.parametrize("stream", [False, True])
def test_redirects_and_no_content_are_named(stream):
    """Both said "a body that is not JSON: ''"."""
    moved = _mock(lambda r: httpx.Response(301, headers={"location": "https://elsewhere/v1/completions"}))
    with pytest.raises(EngineResponseError, match="HTTP 301, a redirect to https://elsewhere.*not followed"):
        moved.complete([1], max_tokens=1, stream=stream)
    with pytest.raises(EngineResponseError, match="HTTP 204 with no content"):
        _mock(lambda r: httpx.Response(204)).complete([1], max_tokens=1, stream=stream)


@pytest.mark.parametrize("stream", [False, True])
def test_a_body_that_does_not_decode_as_its_content_encoding_is_a_response_error(stream):
    """It was a plain EngineError."""
    eng = _mock(lambda r: httpx.Response(200, content=b"notgzip", headers={"content-encoding": "gzip"}))
    with pytest.raises(EngineResponseError, match="content-encoding"):
        eng.complete([1], max_tokens=1, stream=stream)
    zipped = gzip.compress(json.dumps(_ok_body()).encode())
    good = _mock(lambda r: httpx.Response(200, content=zipped, headers={"content-encoding": "gzip"}))
    assert good.complete([1], max_tokens=1).text == "ok"


# ------------------------------------------------------------------ 9. router


def test_an_endpoint_that_is_down_behind_a_router_names_the_way_around_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed: connection refused
    router = PrefixRouter([down], block_size=4)
    eng = RemoteEngine(down, model="m", max_retries=0)
    with pytest.raises(EngineUnavailableError, match=rf"router.remove_endpoint\('{down}'\)"):
        with router.acquire([1] * 16) as lease:
            assert lease.endpoint == down
            eng.complete([1] * 16, max_tokens=1)
    assert router.loads() == {down: 0}


# ------------------------------------------------------------------ diff review


def _sse_chunk(text: str, finish: str | None = None) -> bytes:
    data = {"choices": [{"index": 0, "text": text, "token_ids": [7] if text else [], "finish_reason": finish}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


_SSE_END = b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\ndata: [DONE]\n\n"


@pytest.mark.timeout(15)
def test_a_stream_that_keeps_sending_data_is_not_cut_by_the_total_timeout(fake_server):
    """The total timeout bounded a whole stream, so a long answer that kept streaming
    (a 13-minute reasoning answer against the 600 s default) failed; it is the time
    without a data event now (keep-alive comments are none: the trickle test above)."""
    def handle(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        for _ in range(12):  # 1.2 s of data, 0.1 s apart, against a 0.5 s total
            conn.sendall(b": ping\n\n" + _sse_chunk("a"))
            time.sleep(0.1)
        conn.sendall(_sse_chunk("", "stop") + _SSE_END)
        conn.shutdown(socket.SHUT_WR)  # not close(): the unread request body would reset the connection

    srv = fake_server(handle)
    eng = RemoteEngine(srv.url, model="m", timeout=5, total_timeout=0.5, max_retries=0, block_size=16)
    assert eng.complete([1, 2, 3], max_tokens=20, stream=True).text == "a" * 12
    assert asyncio.run(eng.acomplete([1, 2, 3], max_tokens=20, stream=True)).text == "a" * 12
    assert "".join(d.text for d in eng.stream([1, 2, 3], max_tokens=20)) == "a" * 12


@pytest.mark.timeout(15)
def test_a_stream_held_open_after_done_is_complete_at_done(fake_server):
    """A proxy that keeps the body open after ``data: [DONE]`` (keep-alive pings, no end of
    the chunked body) turned a whole answer into ``EngineTimeoutError``: the client read
    on until the server closed.  ``[DONE]`` ends the answer, on all three paths."""
    def handle(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        conn.sendall(_sse_chunk("Hi", "length") + _SSE_END)
        for _ in range(40):  # 4 s of pings against a 0.5 s total timeout
            conn.sendall(b": ping\n\n")
            time.sleep(0.1)

    srv = fake_server(handle)
    eng = RemoteEngine(srv.url, model="m", timeout=5, total_timeout=0.5, max_retries=0, block_size=16)
    for call in (lambda: eng.complete([1, 2, 3], max_tokens=1, stream=True),
                 lambda: asyncio.run(eng.acomplete([1, 2, 3], max_tokens=1, stream=True))):
        t0 = time.monotonic()
        done = call()
        assert (done.text, done.token_ids, done.finish_reason) == ("Hi", [7], "length")
        assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    deltas = list(eng.stream([1, 2, 3], max_tokens=1))
    assert "".join(d.text for d in deltas) == "Hi" and deltas[-1].completion.finish_reason == "length"
    assert time.monotonic() - t0 < 0.5


@pytest.mark.timeout(15)
def test_aborting_a_finished_stream_leaves_its_pooled_connection_alone():
    """``abort()`` after the stream ended (what ``astream`` does when its consumer left
    before reading the end) shut the socket that had gone back to the pool: the next,
    unrelated request on it failed (or, with retries, was sent and prefilled twice)."""
    import http.server
    import socketserver

    count = {"n": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            count["n"] += 1
            if count["n"] == 2:
                time.sleep(0.8)  # the unrelated request is in flight when the abort comes
            body = _sse_chunk("a") + _sse_chunk("b", "stop") + _SSE_END
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        eng = RemoteEngine(f"http://127.0.0.1:{srv.server_address[1]}", model="m", max_retries=0, block_size=16)
        finished = eng.stream([1, 2, 3], max_tokens=2)
        assert "".join(d.text for d in finished) == "ab"
        out = {}

        def other():
            try:
                out["text"] = eng.complete([4, 5, 6], max_tokens=2, stream=True).text
            except Exception as exc:  # noqa: BLE001 - reported below
                out["text"] = f"{type(exc).__name__}: {exc}"

        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.3)
        finished.abort()
        t.join()
        assert out["text"] == "ab" and count["n"] == 2
    finally:
        srv.shutdown()
        srv.server_close()


# ------------------------------------------------------------------ what a completion is sent again for


@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_completion_is_not_sent_again_after_a_500_502_or_504(status):
    """A gateway's 504 (the vLLM behind it still runs the request), a 502 or a 500 was
    retried like a 503: one completion was POSTed (and prefilled) ``max_retries + 1``
    times.  A GET (``/metrics``) and a one-token probe are still retried."""
    posts, gets = [], []

    def handler(request):
        (posts if request.method == "POST" else gets).append(request.url.path)
        return httpx.Response(status, text="upstream request timeout")

    eng = _mock(handler, max_retries=3)
    with pytest.raises(EngineRequestError, match=rf"HTTP {status}: upstream request timeout \(not sent again") as info:
        eng.complete([1, 2, 3], max_tokens=4)
    assert info.value.status_code == status and len(posts) == 1
    with pytest.raises(EngineRequestError, match="not sent again"):
        asyncio.run(eng.acomplete([1, 2, 3], max_tokens=4, stream=True))
    with pytest.raises(EngineRequestError, match="not sent again"):
        next(eng.stream([1, 2, 3], max_tokens=4))
    assert len(posts) == 3
    with pytest.raises(EngineRequestError, match="gave up after 4 attempts"):
        eng.server_counters()
    assert len(gets) == 4
    posts.clear()
    with pytest.raises(EngineRequestError, match="gave up after 4 attempts"):
        eng.splice_probe()  # one token: sent again as a GET is
    assert len(posts) == 4


def test_429_and_503_are_still_retried_for_a_completion():
    statuses = [429, 503]

    def handler(request):
        if statuses:
            return httpx.Response(statuses.pop(0), text="busy")
        return httpx.Response(200, json=_ok_body(USAGE))

    assert _mock(handler, max_retries=3).complete([1, 2, 3], max_tokens=1).text == "ok" and not statuses


def _head_then_cut(ctype: bytes, head_body: bytes):
    """A server that answers a response head (and ``head_body``) and then dies."""

    def handle(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: 1000\r\n\r\n" + head_body)
        time.sleep(0.05)
        conn.shutdown(socket.SHUT_WR)  # not close(): the unread request body would reset the connection

    return handle


@pytest.mark.timeout(20)
@pytest.mark.parametrize("how", ["complete", "acomplete", "stream"])
def test_a_connection_cut_after_the_response_began_is_not_sent_again(fake_server, how):
    """A server that crashed mid-response (it had run the request) got it re-sent
    ``max_retries`` times: three more prefills before one error."""
    if how == "stream":
        srv = fake_server(_head_then_cut(b"text/event-stream", b": ping\n\n"))
    else:
        srv = fake_server(_head_then_cut(b"application/json", b'{"choices": '))
    eng = RemoteEngine(srv.url, model="m", max_retries=3, backoff=0.01, block_size=16)
    with pytest.raises(EngineUnavailableError, match="broke before the response ended"):
        if how == "complete":
            eng.complete([1, 2], max_tokens=2)
        elif how == "acomplete":
            asyncio.run(eng.acomplete([1, 2], max_tokens=2))
        else:
            list(eng.stream([1, 2], max_tokens=2))
    time.sleep(0.2)  # a resent request would have connected by now
    assert len(srv.conns) == 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize("how", ["complete", "acomplete", "stream"])
def test_a_connection_closed_before_any_response_is_sent_again(fake_server, how):
    """Closed before a byte of the response (a pooled connection the server had
    closed): the server did not run it, so it is sent again."""
    seen = []

    def handle(conn):
        seen.append(1)
        if len(seen) == 1:
            conn.shutdown(socket.SHUT_WR)  # httpx: "Server disconnected without sending a response"
            return
        body = _sse_chunk("a") + _sse_chunk("b", "stop") + _SSE_END
        if how != "stream":
            body = json.dumps(_ok_body(USAGE, text="ab")).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: " + (b"text/event-stream" if how == "stream" else
                                                             b"application/json")
                     + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    srv = fake_server(handle)
    eng = RemoteEngine(srv.url, model="m", max_retries=3, backoff=0.01, block_size=16)
    if how == "complete":
        assert eng.complete([1, 2, 3], max_tokens=2).text == "ab"
    elif how == "acomplete":
        assert asyncio.run(eng.acomplete([1, 2, 3], max_tokens=2)).text == "ab"
    else:
        assert "".join(d.text for d in eng.stream([1, 2, 3], max_tokens=2)) == "ab"
    assert len(seen) == 2


@pytest.mark.timeout(15)
def test_abort_ends_a_streams_retry_backoff_at_once():
    """abort() during the pause before a retry (a 503 asking Retry-After: 6) took
    effect only when the pause ended: ``time.sleep`` cannot be woken."""
    posts = []

    def handler(request):
        posts.append(1)
        return httpx.Response(503, headers={"retry-after": "6"}, text="busy")

    stream = _mock(handler, max_retries=3).stream([1, 2, 3], max_tokens=4)
    timer = threading.Timer(0.3, stream.abort)
    timer.start()
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"aborted \(ServedStream.abort\)"):
        next(stream)
    assert time.monotonic() - start < 2.0 and len(posts) == 1
    timer.join()


def test_a_transport_passed_in_serves_a_second_event_loop():
    """One ``AsyncHTTPTransport`` serves every loop's client, and its pool kept a
    keep-alive connection of the first ``asyncio.run``: the second run failed with a raw
    ``RuntimeError: Event loop is closed``.  Nothing was sent on it: retried on a new
    connection (with ``max_retries=0``, an :class:`EngineUnavailableError` that says why)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # the connection stays open between requests

        def log_message(self, *args):
            pass

        def do_POST(self):
            n = len(json.loads(self.rfile.read(int(self.headers["content-length"])))["prompt"])
            data = json.dumps({"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                               "usage": {**USAGE, "prompt_tokens": n}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    srv.handle_error = lambda request, address: None  # a client dropping its dead-loop connection
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        eng = RemoteEngine(url, model="m", transport=httpx.AsyncHTTPTransport(), backoff=0)
        assert [asyncio.run(eng.acomplete([1, 2, 3], max_tokens=1)).text for _ in range(4)] == ["ok"] * 4
        once = RemoteEngine(url, model="m", transport=httpx.AsyncHTTPTransport(), max_retries=0)
        outcomes = []
        for _ in range(2):
            try:
                outcomes.append(asyncio.run(once.acomplete([1, 2, 3], max_tokens=1)).text)
            except EngineUnavailableError as exc:
                outcomes.append("closed loop" if "event loop that has closed" in str(exc) else str(exc))
        assert outcomes == ["ok", "closed loop"]
    finally:
        srv.shutdown()
        srv.server_close()
