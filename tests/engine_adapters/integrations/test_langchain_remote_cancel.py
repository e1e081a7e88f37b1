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


@pytest.mark.timeout(20)
def test_cancelling_astream_does_not_wait_for_the_engine_timeout():
    """``asyncio.wait_for(astream, 1)`` returned only after the engine's 8 s timeout: the
    cancel awaited the worker thread, blocked reading a server that never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    hung_up = threading.Event()

    def serve():  # reads the request, never answers; notes when the client hangs up
        conn, _ = srv.accept()
        with conn:
            while conn.recv(65536):
                pass
            hung_up.set()

    threading.Thread(target=serve, daemon=True).start()
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
