"""A real Redis server on loopback for the shared-tier tests (one per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def redis_server():
    """``redis-server`` on a free port, no persistence, 64 MB ``maxmemory`` (LRU)."""
    from promptsplice.benchmarks._redis_server import RedisServer

    with RedisServer(maxmemory="64mb") as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    """The session server, running and empty (a test may have killed or filled it)."""
    import redis

    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
