"""RemoteEngine under load and when its server dies, against real ``vllm serve`` on loopback.

* 64 concurrent streams (one ``httpx.AsyncClient``) against one server, in rounds:
  every stream comes back, whole and matched to its own prompt (prompts of 64
  distinct lengths: the server's ``usage.prompt_tokens`` names which prompt a response
  answers), and the client's memory is bounded (traced Python allocations: the peak
  of a round, and no growth between rounds).
* A server SIGKILLed while 8 streams are generating: every stream raises a documented
  error (at once: a stream cut once it began is never sent again), none returns a
  partial completion, and later calls say
  the server is unreachable.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import threading
import time
import tracemalloc

import httpx
import pytest

from promptsplice.benchmarks.servers import loopback_servers
from promptsplice.engine_adapters import RemoteEngine
from promptsplice.errors import EngineUnavailableError

STREAMS = 64
ROUNDS = 3
MAX_TOKENS = 8


def _prompt(i: int, salt: int) -> list[int]:
    """Prompt i has 40 + i tokens (distinct lengths identify the responses)."""
    return [1000 + 37 * salt + 13 * i] + [(3000 + 101 * i + 7 * k + salt) % 40000 + 100 for k in range(39 + i)]


async def _round(eng: RemoteEngine, salt: int):
    return await asyncio.gather(
        *(eng.acomplete(_prompt(i, salt), max_tokens=MAX_TOKENS, stream=True, cache_salt=f"load-{salt}") for i in range(STREAMS)),
        return_exceptions=True,
    )


@pytest.mark.reliability
def test_64_concurrent_streams_lose_nothing_and_memory_stays_bounded(live_servers, measured):
    base = live_servers[0].base_url
    eng = RemoteEngine(base)

    async def main():
        peaks, kept = [], []
        try:
            for r in range(ROUNDS):
                gc.collect()
                tracemalloc.start()
                out = await _round(eng, r)
                _, peak = tracemalloc.get_traced_memory()
                gc.collect()
                current, _ = tracemalloc.get_traced_memory()
                tracemalloc.stop()
                peaks.append(peak)
                kept.append(current)
                errors = [o for o in out if isinstance(o, BaseException)]
                assert errors == []
                assert len(out) == STREAMS
                for i, done in enumerate(out):
                    assert done.prompt_tokens == 40 + i  # its own prompt's answer
                    assert done.completion_tokens == MAX_TOKENS or done.finish_reason == "stop"
                    assert done.finish_reason in ("length", "stop") and done.text is not None
                    assert done.ttft_s is not None and done.ttft_s <= done.total_s
        finally:
            await eng.aclose()
        return peaks, kept

    t0 = time.perf_counter()
    peaks, kept = asyncio.run(main())
    measured.update(streams=STREAMS * ROUNDS, lost=0, wrong=0, wall_s=round(time.perf_counter() - t0, 1),
                    peak_kib=[p // 1024 for p in peaks], kept_kib=[k // 1024 for k in kept])
    # Bounded: a round of 64 streams peaks under 16 MiB of Python allocations (~250 KiB
    # a stream), and what a round leaves behind does not grow with the rounds.
    assert max(peaks) < 16 * 2**20, peaks
    assert kept[-1] - kept[1] < 512 * 2**10, kept


@pytest.fixture(scope="module")
def doomed_server():
    """A server of its own (the test kills it)."""
    with loopback_servers(1) as servers:
        servers[0].keep_log = False  # its death is the test's own doing: no log to keep
        yield servers[0]


def _running(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.reliability
def test_a_server_killed_mid_stream_surfaces_on_every_stream(doomed_server, measured):
    srv = doomed_server
    eng = RemoteEngine(srv.base_url, max_retries=2, backoff=0.2)
    assert eng.complete(_prompt(0, 9), max_tokens=2).completion_tokens == 2
    n = 8
    results: list = []

    def client():
        async def main():
            try:
                return await asyncio.gather(
                    *(eng.acomplete(_prompt(i, 9), max_tokens=1000, stream=True) for i in range(n)),
                    return_exceptions=True,
                )
            finally:
                await eng.aclose()

        results.extend(asyncio.run(main()))

    th = threading.Thread(target=client)
    th.start()
    deadline = time.monotonic() + 120
    while _running(srv.base_url) < n:  # all 8 are generating
        assert time.monotonic() < deadline, "the streams never all started"
        time.sleep(0.2)
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(timeout=30)
    th.join(timeout=120)
    assert not th.is_alive()

    assert len(results) == n
    for out in results:  # no partial completion is returned as if it were whole
        assert isinstance(out, EngineUnavailableError), repr(out)
        assert srv.base_url in str(out)
    with pytest.raises(EngineUnavailableError, match="is it running"):
        eng.complete(_prompt(1, 9), max_tokens=2)
    measured.update(streams=n, raised=sum(isinstance(o, EngineUnavailableError) for o in results),
                    partial_returned=0, causes=sorted({type(o.__cause__).__name__ for o in results}))
