"""``PromptspliceChatModel.astream`` over a ``RemoteEngine`` whose server never answers:
cancelling the consumer returns at once and shuts the worker's request (a fake server on
127.0.0.1; no vLLM)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import warnings

import pytest

from promptsplice.assembler import load_tokenizer
from promptsplice.engine_adapters import RemoteEngine
from promptsplice.engine_adapters.integrations import PromptspliceChatModel
from promptsplice.errors import EngineRequestError


def _silent_server() -> tuple[socket.socket, threading.Event]:
    """A server on 127.0.0.1 that reads one request and never answers; the event is set
    when the client hangs up."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    hung_up = threading.Event()

    def serve():
        conn, _ = srv.accept()
        with conn:
            while conn.recv(65536):
                pass
            hung_up.set()

    threading.Thread(target=serve, daemon=True).start()
    return srv, hung_up


@pytest.mark.timeout(20)
def test_cancelling_astream_does_not_wait_for_the_engine_timeout():
    """``asyncio.wait_for(astream, 1)`` returned only after the engine's 8 s timeout: the
    cancel awaited the worker thread, blocked reading a server that never answers."""
    srv, hung_up = _silent_server()
    eng = RemoteEngine(f"http://127.0.0.1:{srv.getsockname()[1]}", model="m", block_size=16, timeout=8)
    eng._tok, eng._probe = load_tokenizer("default"), None  # no /tokenize or probe: the server answers nothing
    chat = PromptspliceChatModel(engine=eng, max_tokens=4)

    async def consume():
        async for _ in chat.astream("hello"):
            pass

    async def main():
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consume(), 1)
        return time.monotonic() - t0

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            took = asyncio.run(main())
        assert took < 2.5
        assert hung_up.wait(3), "the worker's request was left open"
        deadline = time.monotonic() + 3
        while any(t.name == "promptsplice-astream" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the worker thread is still blocked"
            time.sleep(0.05)
    finally:
        srv.close()
        eng.close()


@pytest.mark.timeout(20)
def test_ainvoke_with_an_llm_cache_asks_the_model_name_off_the_event_loop():
    """With a LangChain LLM cache, ``ainvoke`` built the cache key on the event loop and
    a served engine given no model asked its server there: a blocking GET (1 s here)
    froze every other task on the loop."""
    from langchain_core.caches import InMemoryCache

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    body = b'{"object": "list", "data": [{"id": "served-m", "object": "model"}]}'

    def serve():  # /v1/models after 1 s; any other request: 400
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                if head.startswith(b"GET /v1/models"):
                    time.sleep(1.0)
                    reply = body
                    status = b"200 OK"
                else:
                    reply, status = b'{"error": {"message": "no"}}', b"400 Bad Request"
                conn.sendall(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: " + str(len(reply)).encode() + b"\r\n\r\n" + reply)

    threading.Thread(target=serve, daemon=True).start()
    eng = RemoteEngine(f"http://127.0.0.1:{srv.getsockname()[1]}", block_size=16, max_retries=0)
    eng._tok, eng._probe = load_tokenizer("default"), None
    chat = PromptspliceChatModel(engine=eng, max_tokens=4, cache=InMemoryCache())

    async def main():
        gaps, last = [], time.monotonic()

        async def ticker():
            nonlocal last
            while True:
                await asyncio.sleep(0.02)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        with pytest.raises(EngineRequestError):  # the completion itself is refused (400): only the wait matters
            await chat.ainvoke("hello")
        t.cancel()
        return max(gaps)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stall = asyncio.run(main())
        assert stall < 0.5, f"the event loop stalled {stall:.2f} s"
        assert eng.model == "served-m"
    finally:
        srv.close()


@pytest.mark.timeout(20)
def test_cancelling_ainvoke_closes_the_request_on_a_served_engine():
    """``asyncio.wait_for(ainvoke, 1)`` returned, but LangChain's default ran the call in
    an executor thread that kept the request open until the engine's 8 s timeout: the
    server went on generating an answer nobody read."""
    srv, hung_up = _silent_server()
    eng = RemoteEngine(f"http://127.0.0.1:{srv.getsockname()[1]}", model="m", block_size=16, timeout=8,
                       max_retries=0)
    eng._tok, eng._probe = load_tokenizer("default"), None
    chat = PromptspliceChatModel(engine=eng, max_tokens=4)

    async def main():
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(chat.ainvoke("hello"), 1)
        # (asyncio.run's exit waits for executor threads: look before it)
        return time.monotonic() - t0, await asyncio.to_thread(hung_up.wait, 3)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            took, closed = asyncio.run(main())
        assert took < 2.5
        assert closed, "the request was left open after the cancel"
    finally:
        srv.close()


@pytest.mark.timeout(20)
def test_a_model_name_lookup_that_fails_reaches_the_callbacks():
    """With a LangChain LLM cache, ``ainvoke`` asked a served engine for its model before
    LangChain's callbacks began: a server that was down raised with no
    ``on_chat_model_start`` or ``on_llm_error`` (tracing saw nothing; invoke reported both)."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.callbacks import BaseCallbackHandler

    from promptsplice.errors import EngineUnavailableError

    class Seen(BaseCallbackHandler):
        def __init__(self):
            self.events = []

        def on_chat_model_start(self, *args, **kwargs):
            self.events.append("start")

        def on_llm_error(self, *args, **kwargs):
            self.events.append("error")

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: the lookup is refused at once
    for call in ("invoke", "ainvoke"):
        eng = RemoteEngine(f"http://127.0.0.1:{port}", block_size=16, max_retries=0)
        eng._tok, eng._probe = load_tokenizer("default"), None
        chat, seen = PromptspliceChatModel(engine=eng, max_tokens=4, cache=InMemoryCache()), Seen()
        with pytest.raises(EngineUnavailableError):
            if call == "invoke":
                chat.invoke("hello", {"callbacks": [seen]})
            else:
                asyncio.run(chat.ainvoke("hello", {"callbacks": [seen]}))
        assert seen.events == ["start", "error"], call
