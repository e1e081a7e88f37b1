"""The shared tier (``_redis``) on a real ``redis-server`` on loopback, no mocks.

Two ``BlockStore`` instances on one server stand for two engines.  Same blocks as
``test_store.py``: 16 tokens, float32 payload ``[2, 2, 16, 4]`` = 1024 bytes.  Faults are
real: values damaged with the redis client, the server SIGKILLed, SIGSTOPped (slow) or
filled past its ``maxmemory``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import redis
import torch

from promptsplice.benchmarks._redis_server import RedisServer, free_port
from promptsplice.blocks import HASH_BYTES, content_digest, token_bytes
from promptsplice.engine_adapters.store import _format as fmt
from promptsplice.engine_adapters.store._redis import RedisTier, record_key
from promptsplice.engine_adapters.store._store import (
    BlockStore,
    LookupStatus,
    Namespace,
    PutStatus,
    StoreConfig,
    chain_refs,
)
from promptsplice.errors import ConfigError

from .test_store import HIT_DISK, HIT_DRAM, MISS, P, SALT, kv, make_refs, put_all, rec_file_size

FP_TEXT = "smollm2/bf16/block16/test"
FP = content_digest(FP_TEXT.encode())
CORRUPT, MISMATCH = LookupStatus.CORRUPT, LookupStatus.MISMATCH


def open_store(url: str, dram_blocks: int = 2, **kw) -> BlockStore:
    kw.setdefault("write_behind_bytes", 0)
    kw.setdefault("remote_bytes", 64 * 1024 * 1024)
    kw.setdefault("fingerprint", FP_TEXT)
    return BlockStore(StoreConfig(dram_bytes=dram_blocks * P, remote_url=url, **kw))


def remote(store: BlockStore) -> RedisTier:
    tier = store._lower[-1]
    assert isinstance(tier, RedisTier)
    return tier


def wait_for(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def value_key(ref, salt=SALT, ns: int = 0, fp: bytes = FP) -> str:
    """The Redis key of ``ref``'s block (to damage its value with the client)."""
    meta = fmt.BlockMeta(ns, ref.key, fmt.salt_bytes(salt), ref.parent, token_bytes(ref.tokens), (2, 2, 16, 4), "float32")
    return record_key(fp, meta)


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"remote_bytes": 1024}, "remote_bytes > 0 needs remote_url"),
        ({"remote_bytes": 1024, "remote_url": "http://127.0.0.1:6379"}, "remote_url must start with redis://"),
        ({"remote_bytes": 1024, "remote_url": "redis://"}, "remote_url names no host"),
        ({"remote_bytes": 1024, "remote_url": "redis://127.0.0.1:notaport"}, "remote_url is not a valid URL"),
        ({"remote_bytes": 1024, "remote_url": 6379}, "remote_url must be a redis:// URL"),
        ({"remote_url": "redis://127.0.0.1:6379"}, "remote_url needs remote_bytes > 0"),
        ({"remote_bytes": -1}, "remote_bytes must be an int >= 0"),
        ({"remote_bytes": 1024, "remote_url": "redis://h:1", "remote_timeout_s": 0}, "remote_timeout_s must be > 0"),
        ({"remote_bytes": 1024, "remote_url": "redis://h:1", "remote_retry_s": -1}, "remote_retry_s must be"),
        ({"remote_bytes": 1024, "remote_url": "redis://h:1", "remote_retry_s": 0}, "remote_retry_s must be > 0"),
        # options the client cannot take: every call raised TypeError (the writer died)
        ({"remote_bytes": 1024, "remote_url": "redis://h:1/0?foo=1"}, "remote_url has options the redis client"),
        ({"remote_bytes": 1024, "remote_url": "redis://h:1/0?max_connections=1"}, "remote_url sets max_connections"),
        # options that override the tier's own timeouts (a paused server held a load 4 s)
        ({"remote_bytes": 1024, "remote_url": "redis://h:1/0?socket_timeout=4"}, "remote_url sets socket_timeout"),
        ({"remote_bytes": 1024, "remote_url": "redis://h:1/0?retry_on_timeout=1&health_check_interval=3"},
         "remote_url sets health_check_interval, retry_on_timeout"),
        ({"remote_bytes": 1024, "remote_url": "redis://h:1/x/"}, "remote_url names database 'x'"),
        # replies decoded to str: every read of a binary value failed, the tier never served
        ({"remote_bytes": 1024, "remote_url": "redis://h:1/0?decode_responses=true"},
         "remote_url sets decode_responses: the tier reads binary values"),
        ({"remote_bytes": 1024, "remote_url": "redis://h:99999/0"}, r"remote_url is not a valid URL \(Port out of range"),
        # the client raises its own ConnectionError for this value: it escaped StoreConfig
        ({"remote_bytes": 1024, "remote_url": "redis://h:1/0?protocol=9"},
         r"remote_url has options the redis client does not take \(protocol must be"),
    ],
)
def test_config_names_the_remote_field_to_fix(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        StoreConfig(dram_bytes=P, **kwargs)


# ---------------------------------------------------------------------------- sharing


def test_round_trip_through_the_server(redis_url):
    refs = make_refs(3)
    with open_store(redis_url) as a:
        assert put_all(a, refs) == [PutStatus.STORED] * 3
        assert a.stats().remote_writes == 3  # written when stored, not only on eviction
    with open_store(redis_url) as b:  # a restart: the listener scans the server
        assert remote(b).wait_synced(5.0)
        assert b.match_prefix(refs, salt=SALT) == 3
        for i, ref in enumerate(refs):
            got = b.get(ref, salt=SALT)
            assert got.status is HIT_DISK and torch.equal(got.payload, kv(i))
        assert b.get(refs[2], salt=SALT).status is HIT_DRAM  # promoted (DRAM: 2 blocks)
        st = b.stats()
        assert (st.remote_hits, st.disk_hits, st.remote_blocks, st.remote_corrupt) == (3, 3, 3, 0)
        # discard() removes the server's copy too (by the writer thread: no I/O under the lock).
        assert b.discard(refs[0].key)
        assert wait_for(lambda: client(redis_url).exists(value_key(refs[0])) == 0)
        assert client(redis_url).exists(value_key(refs[1])) == 1


def test_two_stores_on_one_server_load_each_others_blocks(redis_url):
    refs_a, refs_b = make_refs(4, start=0), make_refs(4, start=5000)
    with open_store(redis_url, write_behind_bytes=8 * P) as a, open_store(redis_url, write_behind_bytes=8 * P) as b:
        assert remote(a).wait_synced(5.0) and remote(b).wait_synced(5.0)
        put_all(a, refs_a)
        put_all(b, refs_b, first=10)
        a.drain()
        b.drain()
        # Announcements reach the other store's index: its match_prefix makes no call.
        assert wait_for(lambda: b.match_prefix(refs_a, salt=SALT) == 4)
        assert wait_for(lambda: a.match_prefix(refs_b, salt=SALT) == 4)
        for i, ref in enumerate(refs_a):
            got = b.get(ref, salt=SALT)
            assert got.status is HIT_DISK and torch.equal(got.payload, kv(i))
        for i, ref in enumerate(refs_b):
            got = a.get(ref, salt=SALT)
            assert got.status is HIT_DISK and torch.equal(got.payload, kv(10 + i))
        assert a.stats().remote_hits == 4 and b.stats().remote_hits == 4
        assert a.stats().remote_writes == 4 and b.stats().remote_writes == 4


def test_tenant_salts_never_meet(redis_url):
    tokens = list(range(300, 300 + 32))
    mine, theirs = chain_refs(tokens, 16, salt="tenant-a"), chain_refs(tokens, 16, salt="tenant-b")
    with open_store(redis_url) as a, open_store(redis_url) as b:
        assert remote(b).wait_synced(5.0)
        put_all(a, mine, salt="tenant-a")
        assert wait_for(lambda: b.match_prefix(mine, salt="tenant-a") == 2)
        assert b.match_prefix(theirs, salt="tenant-b") == 0
        assert b.get(theirs[0], salt="tenant-b").status is MISS
        # Content keys: the same 16-byte key under two salts is two Redis keys, and
        # the other tenant's block under it is never served.
        key = bytes(range(16))
        ref = (key, bytes(16), list(range(16)))
        assert a.put(ref, kv(7), salt="tenant-a", namespace=Namespace.CONTENT) is PutStatus.STORED
        assert wait_for(lambda: b.contains(ref, salt="tenant-a", namespace=Namespace.CONTENT))
        assert b.get(ref, salt="tenant-b", namespace=Namespace.CONTENT).status is MISMATCH
        names = sorted(n.decode() for n in client(redis_url).keys("psk:*"))
        assert len(names) == 3 and len({n.split(":")[2] for n in names}) == 1  # one salt's keys


# ---------------------------------------------------------------------------- bad values


@pytest.mark.reliability
def test_damaged_foreign_and_short_values_are_counted_never_served(redis_url):
    refs = make_refs(4)
    r = client(redis_url)
    with open_store(redis_url) as a, open_store(redis_url, dram_blocks=8) as b:
        assert remote(b).wait_synced(5.0)
        put_all(a, refs)
        assert wait_for(lambda: b.match_prefix(refs, salt=SALT) == 4)
        names = [value_key(ref) for ref in refs]
        good = r.get(names[0])
        flipped = bytearray(good)
        flipped[-100] ^= 0x01  # one payload bit
        r.set(names[0], bytes(flipped))
        r.set(names[1], good[: len(good) - 8])  # wrong length
        meta = fmt.parse_header(r.get(names[2])).meta
        other = fmt.encode_record(meta, memoryview(kv(2).numpy()).cast("B"), content_digest(b"another model"))
        r.set(names[2], bytes(other))  # written by another model or layout
        assert [b.get(ref, salt=SALT).status for ref in refs] == [CORRUPT, CORRUPT, CORRUPT, HIT_DISK]
        st = b.stats()
        assert (st.remote_corrupt, st.remote_foreign, st.remote_hits) == (2, 1, 1)
        assert r.exists(*names[:3]) == 0  # deleted, so no one else loads them
        assert b.match_prefix(refs, salt=SALT) == 0  # forgotten by the index
        # A damaged value the listener finds when it scans is deleted and counted too.
        r.set(names[3], good[:40])
    with open_store(redis_url) as c:
        assert remote(c).wait_synced(5.0)
        assert c.match_prefix(refs, salt=SALT) == 0
        assert (c.stats().remote_corrupt, r.exists(names[3]), r.keys("*")) == (1, 0, [])


def test_a_key_of_another_type_under_the_prefix_is_dropped_not_an_outage_for_good(redis_url):
    """One hash under the tier's prefix failed the scan's pipeline (WRONGTYPE), which the
    listener read as a refused scan: the index was cleared and every engine's shared tier
    stayed off, rescanning into the same key forever."""
    refs = make_refs(3)
    r = client(redis_url)
    with open_store(redis_url) as a:
        put_all(a, refs)
        assert wait_for(lambda: len(_psk_keys(redis_url)) == 3)
        stray = remote(a)._prefix + "stray"
        r.hset(stray, "field", "value")
    with open_store(redis_url) as b:
        tier = remote(b)
        assert tier.wait_synced(5.0) and tier.readable and tier.writable
        assert b.match_prefix(refs, salt=SALT) == 3 and b.stats().remote_blocks == 3
        assert r.exists(stray) == 0 and b.stats().remote_corrupt == 1
    r.flushdb()


@pytest.mark.reliability
def test_a_url_that_does_not_answer_costs_one_timeout_per_back_off(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    refs = make_refs(20)
    with open_store(url, dram_blocks=4, remote_retry_s=30.0) as store:
        t0 = time.monotonic()
        statuses = put_all(store, refs)
        looked = [store.get(ref, salt=SALT).status for ref in refs]
        elapsed = time.monotonic() - t0
        assert statuses == [PutStatus.STORED] * 20  # kept in DRAM: the request goes on
        assert looked[-4:] == [HIT_DRAM] * 4 and set(looked[:-4]) == {MISS}
        st = store.stats()
        assert st.remote_outages == 1 and not st.remote_available
        assert st.remote_writes == 0 and st.remote_skipped >= 19
        assert elapsed < 1.0  # one refused connect, then the breaker skips the server


# ---------------------------------------------------------------------------- outages


@pytest.mark.reliability
def test_redis_killed_mid_run_fails_nothing_and_hits_recover(redis_server, redis_url):
    """SIGKILL the server halfway through two stores' puts and lookups: every call
    answers, every payload served is the right one, the outage is counted, and after
    the restart (empty) and the back-off the stores share blocks again."""
    fast = {"remote_retry_s": 0.3, "write_behind_bytes": 64 * P}
    with open_store(redis_url, **fast) as a, open_store(redis_url, **fast) as b:
        assert remote(a).wait_synced(5.0) and remote(b).wait_synced(5.0)
        wrong = served = 0
        for step in range(60):
            if step == 30:
                redis_server.kill()
            refs = make_refs(2, start=10_000 + 100 * step)
            put_all(a, refs, first=step)
            a.drain()
            time.sleep(0.02)
            for i, ref in enumerate(refs):
                got = b.get(ref, salt=SALT)
                if got.status.hit:
                    served += 1
                    wrong += not torch.equal(got.payload, kv(step + i))
        assert wrong == 0 and served > 0
        assert a.stats().remote_outages >= 1 and b.stats().remote_outages >= 1
        kept = make_refs(2, start=10_000 + 100 * 59)  # still in A's DRAM, lost by the server
        redis_server.start()  # back, empty
        time.sleep(0.35)  # past the back-off
        assert wait_for(lambda: remote(a).wait_synced(0.01) and remote(b).wait_synced(0.01))
        # A writes its DRAM blocks again when the server is back: B finds them.
        assert wait_for(lambda: b.match_prefix(kept, salt=SALT) == 2)
        assert all(torch.equal(b.get(r, salt=SALT).payload, kv(59 + i)) for i, r in enumerate(kept))
        refs = make_refs(3, start=90_000)
        put_all(a, refs, first=3)
        a.drain()
        assert wait_for(lambda: b.match_prefix(refs, salt=SALT) == 3)
        got = [b.get(ref, salt=SALT) for ref in refs]
        assert [g.status for g in got] == [HIT_DISK] * 3
        assert all(torch.equal(g.payload, kv(3 + i)) for i, g in enumerate(got))
        assert a.stats().remote_available and b.stats().remote_available


@pytest.mark.reliability
def test_a_stopped_server_never_blocks_a_put(redis_server, redis_url):
    """SIGSTOP (a server that stops answering): puts return at once, the writer's one
    timeout opens the breaker, and what it could not write is counted as skipped."""
    with open_store(redis_url, dram_blocks=64, write_behind_bytes=2 * P, remote_retry_s=30.0) as store:
        assert remote(store).wait_synced(5.0)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            slowest = 0.0
            for i, ref in enumerate(make_refs(40)):
                t0 = time.monotonic()
                assert store.put(ref, kv(i), salt=SALT) is PutStatus.STORED
                slowest = max(slowest, time.monotonic() - t0)
            store.drain()
            st = store.stats()
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert slowest < 0.1  # the timeout is 0.2 s: no put waited for the server
        assert st.remote_outages == 1 and st.remote_skipped >= 30 and st.remote_writes == 0
        assert st.dram_blocks == 40 and st.dropped == 0  # DRAM kept every block


@pytest.mark.reliability
def test_blocks_the_server_evicts_miss_never_wrong():
    """A server bounded by 4 MB of ``maxmemory`` (allkeys-lru) given ~6.5 MB of blocks:
    what it evicted answers MISS, everything served is the block asked for."""
    with RedisServer(maxmemory="4mb") as server:
        refs = make_refs(5000, start=0)
        with open_store(server.url) as a, open_store(server.url) as b:
            assert remote(b).wait_synced(5.0)
            put_all(a, refs)
            assert wait_for(lambda: remote(b).stats().blocks >= 5000)
            counts = {"hit": 0, "miss": 0, "other": 0}
            for i, ref in enumerate(refs):
                got = b.get(ref, salt=SALT)
                if got.status is HIT_DISK:
                    counts["hit"] += 1
                    assert torch.equal(got.payload, kv(i))
                elif got.status is MISS:
                    counts["miss"] += 1
                else:
                    counts["other"] += 1
            assert counts["other"] == 0
            assert counts["miss"] > 1000 and counts["hit"] > 1000  # evicted by the server, not lost
            assert a.stats().remote_write_errors == 0


# ------------------------------------------------------------- races and refusals


def _psk_keys(url: str) -> list[bytes]:
    c = client(url)
    try:
        return c.keys("psk:*")
    finally:
        c.close()


def _writer_idle(store: BlockStore) -> bool:
    tier = remote(store)
    with tier._cond:
        return tier._writer is None and not tier._deletes and not tier._wipe


@pytest.mark.reliability
def test_a_write_in_flight_when_the_store_is_cleared_never_comes_back(redis_url):
    """``clear()`` (reset_prefix_cache) while a write-down is inside its SET: the value
    landed after the clear, was announced and indexed again, and both this store and
    another engine's served the cleared block."""
    cfg = {"write_behind_bytes": 64 * P, "remote_timeout_s": 3.0}
    with open_store(redis_url, dram_blocks=4, **cfg) as a, open_store(redis_url, dram_blocks=8, **cfg) as b:
        assert remote(a).wait_synced(5.0) and remote(b).wait_synced(5.0)
        ref = make_refs(1)[0]
        admin = client(redis_url)
        admin.client_pause(800, all=False)  # CLIENT PAUSE WRITE: the SET waits 0.8 s
        admin.close()
        assert a.put(ref, kv(7), salt=SALT) is PutStatus.STORED
        time.sleep(0.2)  # the writer is inside the SET now
        a.clear()
        assert not a.contains(ref, salt=SALT)
        a.drain()
        assert wait_for(lambda: _writer_idle(a))
        time.sleep(0.3)  # any announcement has reached the listeners
        assert _psk_keys(redis_url) == []
        assert a.get(ref, salt=SALT).status is MISS and b.get(ref, salt=SALT).status is MISS
        assert not a.contains(ref, salt=SALT) and a.stats().remote_blocks == 0


def _land_before_deletes(monkeypatch, tier: RedisTier, name: str, good: bytes, admin: redis.Redis) -> list[str]:
    """Another engine's SET of ``good`` lands between this tier's read of a damaged
    value and its delete (the window cannot be hit on demand, so the SET is sent right
    before whichever delete call the tier makes, on another connection)."""
    sent: list[str] = []
    for method in ("delete", "eval"):
        real = getattr(tier._client, method)

        def landing(*args, _real=real, _method=method, **kwargs):
            if not sent:
                admin.set(name, good)
            sent.append(_method)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tier._client, method, landing)
    return sent


@pytest.mark.reliability
def test_a_good_value_set_after_a_damaged_read_is_not_deleted(redis_url, monkeypatch):
    """Engine b reads a damaged value and deletes it; engine a's SET of a good value
    landed between the read and the DEL, so the DEL removed the good value (a lost
    block for every engine).  The delete now goes only while the damaged bytes are
    still there."""
    ref = make_refs(1)[0]
    admin = client(redis_url)
    with open_store(redis_url) as a, open_store(redis_url, dram_blocks=8) as b:
        assert remote(b).wait_synced(5.0)
        put_all(a, [ref])
        assert wait_for(lambda: b.match_prefix([ref], salt=SALT) == 1)
        name = value_key(ref)
        good = admin.get(name)
        damaged = bytearray(good)
        damaged[-100] ^= 0x01
        admin.set(name, bytes(damaged))
        sent = _land_before_deletes(monkeypatch, remote(b), name, good, admin)
        assert b.get(ref, salt=SALT).status is CORRUPT and sent  # it read the damaged value
        assert admin.get(name) == good  # a's value stays
    with open_store(redis_url) as c:  # and serves the next engine
        assert remote(c).wait_synced(5.0)
        got = c.get(ref, salt=SALT)
        assert got.status is HIT_DISK and torch.equal(got.payload, kv(0))
    admin.close()


@pytest.mark.reliability
def test_a_good_value_set_after_a_damaged_scan_is_not_deleted(redis_url, monkeypatch):
    """The listener's scan finds a damaged value (a wrong length) and deletes it; a good
    SET landing between the scan's read and its DEL was deleted with it."""
    ref = make_refs(1)[0]
    admin = client(redis_url)
    with open_store(redis_url) as a:
        put_all(a, [ref])
        a.drain()
    name = value_key(ref)
    good = admin.get(name)
    admin.delete(name)
    with open_store(redis_url, dram_blocks=8) as b:
        tier = remote(b)
        assert tier.wait_synced(5.0)
        admin.set(name, good[: len(good) - 8])  # damaged: shorter than its header says
        sent = _land_before_deletes(monkeypatch, tier, name, good, admin)
        assert tier._rescan() is not None and sent  # the scan read the damaged value
        assert admin.get(name) == good and b.stats().remote_corrupt == 1
        monkeypatch.undo()
        admin.set(name, good[:40])  # no SET in between: deleted
        assert tier._rescan() is not None and admin.exists(name) == 0
    admin.close()


@pytest.mark.reliability
def test_a_damaged_delete_retried_later_still_spares_a_good_value(redis_url):
    """A damaged value's delete the server refused goes back to the writer; its retry
    was a plain DEL, so another engine's good value SET during the back-off went with
    it.  The retry keeps the condition."""
    ref = make_refs(1)[0]
    admin = client(redis_url)
    with open_store(redis_url) as a, open_store(redis_url, dram_blocks=8, remote_retry_s=0.3) as b:
        assert remote(b).wait_synced(5.0)
        put_all(a, [ref])
        assert wait_for(lambda: b.match_prefix([ref], salt=SALT) == 1)
        name = value_key(ref)
        good = admin.get(name)
        try:
            admin.execute_command("ACL", "SETUSER", "default", "-del")
            admin.set(name, good[:-8])
            assert b.get(ref, salt=SALT).status is CORRUPT
            assert admin.get(name) == good[:-8]  # the server refused the delete
            admin.set(name, good)  # another engine's good value, during the back-off
        finally:
            admin.execute_command("ACL", "SETUSER", "default", "+del")
        assert wait_for(lambda: _writer_idle(b), timeout=3.0)  # retried
        assert admin.get(name) == good
    admin.close()


@pytest.mark.reliability
def test_a_value_gone_between_the_scans_two_reads_is_not_damaged(redis_url, monkeypatch):
    """A header over the scan's first read (4,096 bytes: 1,200 tokens here) is read
    again; a value deleted in between read as an empty header: counted damaged, and
    its delete, comparing only the length, removed another engine's good SET."""
    meta = fmt.BlockMeta(0, b"\x11" * HASH_BYTES, fmt.salt_bytes(SALT), b"\x22" * HASH_BYTES, token_bytes(list(range(1200))),
                         (2, 2, 16, 4), "float32")
    good = bytes(fmt.encode_record(meta, memoryview(kv(1).numpy()).cast("B"), FP))
    assert fmt.header_size(meta) > 4096
    name = record_key(FP, meta)
    admin = client(redis_url)
    with open_store(redis_url) as b:
        tier = remote(b)
        assert tier.wait_synced(5.0)
        admin.set(name, good)
        real_getrange = tier._client.getrange

        def getrange(key, start, end):  # the value is evicted between the two reads
            admin.delete(key)
            return real_getrange(key, start, end)

        monkeypatch.setattr(tier._client, "getrange", getrange)
        sent = _land_before_deletes(monkeypatch, tier, name, good, admin)
        assert tier._rescan() is not None
        assert (b.stats().remote_corrupt, sent) == (0, [])  # nothing damaged, nothing deleted
        admin.set(name, good)
        monkeypatch.undo()
        assert tier._rescan() is not None and admin.get(name) == good
    admin.close()

@pytest.mark.reliability
def test_a_server_that_refuses_scripts_still_loses_its_damaged_values(redis_url):
    """The conditional delete is a script; a user whose ACL denies scripting gets the
    plain DEL, so a damaged value is still deleted (and counted, never served)."""
    ref = make_refs(1)[0]
    admin = client(redis_url)
    admin.acl_setuser("noscript", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-@scripting"])
    url = redis_url.replace("redis://", "redis://noscript:pw@")
    try:
        with open_store(url) as a, open_store(url, dram_blocks=8) as b:
            assert remote(b).wait_synced(5.0)
            put_all(a, [ref])
            assert wait_for(lambda: b.match_prefix([ref], salt=SALT) == 1)
            name = value_key(ref)
            with pytest.raises(redis.exceptions.NoPermissionError):
                client(url).eval("return 1", 0)
            admin.set(name, admin.get(name)[:-8])
            assert b.get(ref, salt=SALT).status is CORRUPT
            assert admin.exists(name) == 0 and b.stats().remote_corrupt == 1
    finally:
        admin.acl_deluser("noscript")
        admin.close()

def test_a_url_error_never_quotes_the_password():
    """A password with a '#' or '/' in it, not percent-encoded: the URL parser's message
    quoted the text it read as a port (part of the password) into the ConfigError."""
    for url in ("redis://:s3cr#et@10.0.0.5:6379/0", "redis://admin:s3cr/2@10.0.0.5:6379/0"):
        with pytest.raises(ConfigError, match=r"percent-encode the password") as err:
            StoreConfig(dram_bytes=P, remote_bytes=1024, remote_url=url)
        assert "s3cr" not in str(err.value)


@pytest.mark.reliability
def test_a_block_only_the_shared_index_names_is_kept_when_computed_here(redis_url):
    """Engine b's index names a's blocks, which the server has since evicted; b computes
    them itself: ``put`` answered EXISTS and kept nothing, so b's next get was a MISS
    (and b never held a local copy of a block another engine shared)."""
    with open_store(redis_url, dram_blocks=8) as a, open_store(redis_url, dram_blocks=8) as b:
        assert remote(b).wait_synced(5.0)
        refs = make_refs(3)
        put_all(a, refs)
        assert wait_for(lambda: b.match_prefix(refs, salt=SALT) == 3)
        admin = client(redis_url)
        for name in _psk_keys(redis_url):  # what the server's maxmemory LRU does
            admin.delete(name)
        admin.close()
        assert [b.put(ref, kv(i), salt=SALT) for i, ref in enumerate(refs)] == [PutStatus.STORED] * 3
        for i, ref in enumerate(refs):
            got = b.get(ref, salt=SALT)
            assert got.status is HIT_DRAM and torch.equal(got.payload, kv(i))
        assert b.stats().dram_blocks == 3 and b.stats().remote_writes == 0  # named there already: not re-sent
        assert b.put(refs[0], kv(0), salt=SALT) is PutStatus.EXISTS  # held here now


def test_a_shared_named_put_that_evicts_still_writes_the_evicted_block_down(redis_url, tmp_path):
    """The put above, on a full DRAM in front of a disk tier: the write-downs of the blocks
    it evicted were dropped with the shared write it skips, so each evicted block stayed
    in memory outside every budget, never reached the disk and was lost at a restart."""
    disk = {"disk_bytes": 1 << 20, "disk_dir": str(tmp_path / "kv")}
    with open_store(redis_url, dram_blocks=8) as a, open_store(redis_url, dram_blocks=2, **disk) as b:
        assert remote(b).wait_synced(5.0)
        refs = make_refs(6)
        put_all(a, refs[3:], first=3)
        assert wait_for(lambda: b.match_prefix(refs[3:], salt=SALT) == 3)
        admin = client(redis_url)
        for name in _psk_keys(redis_url):
            admin.delete(name)
        admin.close()
        assert put_all(b, refs) == [PutStatus.STORED] * 6  # 3 of its own, then the 3 the index names
        b.drain()
        assert b.stats().disk_blocks == 4 and b.stats().dram_blocks == 2
    with open_store(redis_url, dram_blocks=2, **disk) as again:  # a restart: the disk holds them
        for i, ref in enumerate(refs[:4]):
            got = again.get(ref, salt=SALT)
            assert got.status is HIT_DISK and torch.equal(got.payload, kv(i))


@pytest.mark.reliability
def test_a_full_server_announces_nothing_it_refused(caplog):
    """A server at ``maxmemory`` with Redis's default policy (``noeviction``) refuses
    every SET with OOM; the PUBLISH that went with it still ran, so every store indexed
    (and pinned, and answered EXISTS for) blocks the server never held."""
    with RedisServer(maxmemory="64mb") as server:
        admin = client(server.url)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.set("filler", b"x" * (3 << 20))
        admin.config_set("maxmemory", str(admin.info("memory")["used_memory"] + 1000))  # full
        with open_store(server.url) as a, open_store(server.url) as b:
            assert remote(a).wait_synced(5.0) and remote(b).wait_synced(5.0)
            refs = make_refs(6)
            put_all(a, refs)
            # the writer thread's refusals (not a fixed sleep: a loaded machine ran late)
            assert wait_for(lambda: a.stats().remote_write_errors >= 6, timeout=10.0), a.stats()
            time.sleep(0.3)  # what b would have indexed from an announcement has arrived
            sa, sb = a.stats(), b.stats()
            assert sa.remote_write_errors >= 6 and sa.remote_writes == 0  # at put, and again when DRAM evicts
            assert sa.remote_blocks == 0 and sb.remote_blocks == 0
            assert b.match_prefix(refs, salt=SALT) == 0
            assert sa.dropped == 4  # evicted from DRAM (2 blocks), written nowhere: counted
            assert a.put(refs[0], kv(0), salt=SALT) is PutStatus.STORED  # not EXISTS
            assert a.get(refs[0], salt=SALT).status is HIT_DRAM
            # one warning for the whole refusal, not one per block (a log line a step)
            refusals = [r for r in caplog.records if "refused a write" in r.getMessage()]
            assert len(refusals) == 1 and sa.remote_write_errors >= 6
        admin.close()


@pytest.mark.reliability
def test_one_slow_read_does_not_lose_the_index_for_good(redis_url):
    """A read that hits the socket timeout opens the breaker and forgets the index; the
    listener's own connection never failed, so it never rescanned: every block on the
    server stayed unreachable."""
    fast = {"remote_timeout_s": 0.2, "remote_retry_s": 0.3}
    with open_store(redis_url, **fast) as a:
        refs = make_refs(20)
        put_all(a, refs)
        with open_store(redis_url, **fast) as b:
            assert wait_for(lambda: b.stats().remote_blocks == 20)
            admin = client(redis_url)
            admin.client_pause(600)  # every command waits 0.6 s
            admin.close()
            assert b.get(refs[0], salt=SALT).status is MISS  # timed out: an outage
            assert b.stats().remote_outages == 1
            assert wait_for(lambda: b.stats().remote_blocks == 20, timeout=5.0), b.stats()
            assert remote(b).wait_synced(1.0) and b.match_prefix(refs, salt=SALT) == 20
            got = b.get(refs[1], salt=SALT)
            assert got.status is HIT_DISK and torch.equal(got.payload, kv(1))


@pytest.mark.reliability
def test_a_clear_while_the_server_is_stopped_holds_once_it_answers(redis_server, redis_url):
    """The deletes of a clear that cannot reach the server were dropped: once it
    answered again, the rescan indexed the cleared values and the store served them."""
    with open_store(redis_url, remote_timeout_s=0.2, remote_retry_s=0.3) as a:
        refs = make_refs(5)
        put_all(a, refs)
        assert remote(a).wait_synced(5.0) and a.stats().remote_blocks == 5
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            a.clear()
            assert wait_for(lambda: a.stats().remote_outages == 1)  # the delete timed out
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: _psk_keys(redis_url) == [] and _writer_idle(a), timeout=5.0)
        assert remote(a).wait_synced(5.0)
        assert a.stats().remote_blocks == 0 and [status for status in (a.get(r, salt=SALT).status for r in refs)] == [MISS] * 5


@pytest.mark.reliability
def test_a_clear_removes_values_its_index_never_held(redis_url):
    """The index is bounded (``remote_bytes``) and fills from announcements: a clear
    deleted only the indexed names, so values of this model that another engine wrote
    (or that did not fit the index) stayed on the server, and every engine's next
    rescan served them again.  Blocks stored after the clear are kept."""
    refs = make_refs(6)
    with open_store(redis_url, remote_bytes=2 * max(map(rec_file_size, refs)) + 8) as a, open_store(redis_url, dram_blocks=8) as b:
        assert remote(a).wait_synced(5.0) and remote(b).wait_synced(5.0)
        put_all(b, refs)
        b.drain()
        assert wait_for(lambda: a.stats().remote_blocks == 2)  # its index holds 2 of the 6
        assert len(_psk_keys(redis_url)) == 6
        a.clear()
        assert wait_for(lambda: _writer_idle(a))
        assert _psk_keys(redis_url) == []
        late = make_refs(1, start=9000)[0]
        a.put(late, kv(3), salt=SALT)
        a.drain()
        a.clear()  # a second clear removes the later block too, and nothing else is left
        assert wait_for(lambda: _writer_idle(a))
        assert _psk_keys(redis_url) == []
    with open_store(redis_url) as c:  # a restart's rescan finds nothing to serve
        assert remote(c).wait_synced(5.0)
        assert c.match_prefix(refs, salt=SALT) == 0 and c.stats().remote_blocks == 0


@pytest.mark.reliability
def test_a_clear_during_a_rescan_never_lets_the_scan_index_what_it_removed(redis_url, monkeypatch):
    """A rescan (at start-up, after every outage) is not stopped by a clear: the page it
    had read before the clear was indexed after it, so cleared blocks stayed in the
    index (``match_prefix`` counted and pinned them; their loads missed) and, when the
    clear's wipe took its snapshot of the index after that, stayed on the server and
    were served.  Now a clear overtakes the scan: nothing it read is indexed, and the
    listener scans again once the wipe is over."""
    refs = make_refs(6)
    with open_store(redis_url, dram_blocks=8) as a:
        put_all(a, refs)
        a.drain()
    assert len(_psk_keys(redis_url)) == 6
    with open_store(redis_url) as b:
        tier = remote(b)
        assert tier.wait_synced(5.0) and b.stats().remote_blocks == 6
        me = threading.current_thread()
        real_pipeline = tier._client.pipeline

        def pipeline(*args, **kw):  # the rescan's page: its headers read, then the clear lands
            pipe = real_pipeline(*args, **kw)
            if threading.current_thread() is me:
                real_execute = pipe.execute

                def execute(*a2, **k2):
                    replies = real_execute(*a2, **k2)
                    b.clear()
                    assert wait_for(lambda: _writer_idle(b) and _psk_keys(redis_url) == [])
                    return replies

                pipe.execute = execute
            return pipe

        monkeypatch.setattr(tier._client, "pipeline", pipeline)
        assert tier._rescan() is None  # overtaken: the listener scans again after the wipe
        monkeypatch.undo()
        assert b.stats().remote_blocks == 0 and b.match_prefix(refs, salt=SALT) == 0
        assert [b.get(r, salt=SALT).status for r in refs] == [MISS] * 6
        assert tier.wait_synced(5.0)
        with open_store(redis_url, dram_blocks=8) as c:  # the listener still indexes what comes after
            put_all(c, refs[:2])
            c.drain()
        assert wait_for(lambda: b.stats().remote_blocks == 2)
        assert b.match_prefix(refs, salt=SALT) == 2


def test_the_listener_rescans_only_once_a_clears_wipe_is_over(redis_url, monkeypatch):
    """A rescan while a clear's wipe of the server runs would index the values the wipe
    is about to delete; the listener now waits for the wipe before it scans again.  Here
    the wipe is held at its first scan and an outage makes the listener rescan."""
    refs = make_refs(6)
    with open_store(redis_url, dram_blocks=8) as a:
        put_all(a, refs)
        a.drain()
    with open_store(redis_url, remote_retry_s=0.2) as b:
        tier = remote(b)
        assert tier.wait_synced(5.0) and b.stats().remote_blocks == 6
        hold, held = threading.Event(), threading.Event()
        real_scan = tier._client.scan

        def scan(*args, **kw):  # the writer's wipe waits here; the listener's scans go on
            if threading.current_thread().name == "promptsplice-kv-redis-writer":
                held.set()
                assert hold.wait(10.0)
            return real_scan(*args, **kw)

        monkeypatch.setattr(tier._client, "scan", scan)
        with tier._cond:  # the indexed values are not deleted, so the wipe is what removes them
            tier._lru.clear()
        b.clear()
        assert held.wait(5.0)
        # a rescan that starts now (the listener had left its wait to subscribe when the
        # clear came) answers "scan again": it read the values the held wipe deletes
        assert tier._rescan() is None and b.stats().remote_blocks == 0
        with tier._cond:
            tier._outage(ConnectionError("test: the listener reconnects and rescans"))
        assert not tier.wait_synced(1.5)  # no scan while the wipe is held (the back-off is 0.2 s)
        assert b.stats().remote_blocks == 0
        hold.set()
        assert wait_for(lambda: _writer_idle(b) and _psk_keys(redis_url) == [])
        assert tier.wait_synced(5.0)
        assert b.stats().remote_blocks == 0 and b.match_prefix(refs, salt=SALT) == 0
        assert all(b.get(r, salt=SALT).status == MISS for r in refs)


def test_the_write_behind_bound_holds_for_a_batch_planned_at_once(redis_server, redis_url):
    """After an outage the store writes its DRAM blocks again in one batch; each was
    checked against the same (empty) queue, so the queue grew to 10x its bound."""
    with open_store(redis_url, dram_blocks=64, write_behind_bytes=4 * P, remote_retry_s=0.3) as store:
        tier = remote(store)
        assert tier.wait_synced(5.0)
        peak = [0]
        queue = tier._queue

        class Spy(type(queue)):  # records the deepest the real queue got
            def append(self, job):
                super().append(job)
                peak[0] = max(peak[0], sum(j.held.meta.nbytes for j in self))

        tier._queue = Spy(queue)
        redis_server.kill()
        for i, ref in enumerate(make_refs(40)):
            store.put(ref, kv(i), salt=SALT)
        redis_server.start()  # back, empty: the store re-shares its 40 DRAM blocks
        assert wait_for(lambda: store.stats().remote_writes >= 4 and _writer_idle(store), timeout=10.0)
        assert 0 < peak[0] <= 4 * P
        assert store.stats().remote_skipped > 0 and store.stats().dropped == 0  # DRAM kept them


def test_a_client_failure_of_another_kind_never_stops_the_writer(redis_url, monkeypatch):
    """An exception that is not a Redis error (a client bug) killed the writer thread
    with its job still queued: ``drain()`` and ``close()`` then waited forever."""
    with open_store(redis_url, dram_blocks=8, write_behind_bytes=64 * P) as store:
        tier = remote(store)
        assert tier.wait_synced(5.0)
        real = tier._client.set

        def broken(*args, **kwargs):
            raise RuntimeError("a client bug")

        monkeypatch.setattr(tier._client, "set", broken)
        refs = make_refs(3)
        put_all(store, refs[:2])
        store.drain()  # returns: the jobs left the queue
        assert store.stats().remote_write_errors == 2 and store.stats().remote_blocks == 0
        monkeypatch.setattr(tier._client, "set", real)
        put_all(store, refs[2:], first=2)
        store.drain()
        assert wait_for(lambda: store.stats().remote_blocks == 1)


def test_a_remote_tier_that_fails_to_build_releases_the_disk_tier(tmp_path, monkeypatch):
    """The disk tier opens first; a remote tier that raised while being built left the
    disk tier's folder locked (``ConfigError: already used``) and its descriptors open."""
    from promptsplice.engine_adapters.store import _store

    def refuse(*args, **kwargs):
        raise ConnectionRefusedError("no tier")  # a constructor failure of any kind

    cfg = StoreConfig(dram_bytes=2 * P, disk_bytes=1 << 20, disk_dir=str(tmp_path / "kv"),
                      remote_url="redis://127.0.0.1:1/0", remote_bytes=1 << 20, fingerprint=FP_TEXT)
    monkeypatch.setattr(_store, "RedisTier", refuse)
    with pytest.raises(ConnectionRefusedError):
        BlockStore(cfg)
    monkeypatch.undo()
    plain = StoreConfig(dram_bytes=2 * P, disk_bytes=1 << 20, disk_dir=str(tmp_path / "kv"), fingerprint=FP_TEXT)
    with BlockStore(plain) as store:  # the folder is free again
        assert store.stats().disk_writable


@pytest.mark.reliability
def test_a_server_that_refuses_deletes_is_retried_after_the_back_off(redis_url, caplog):
    """A server that answers DEL with an error (an ACL here; a read-only replica or
    MISCONF alike) had the writer retry at once: ~6,000 refusals and warnings a second,
    a core burnt.  Now one warning, a retry per back-off, and the value is removed once
    the server takes deletes again."""
    with open_store(redis_url, dram_blocks=8, remote_retry_s=0.5) as a:
        assert remote(a).wait_synced(5.0)
        refs = make_refs(2)
        put_all(a, refs)
        a.drain()
        admin = client(redis_url)
        try:
            admin.execute_command("ACL", "SETUSER", "default", "-del")
            with caplog.at_level(logging.WARNING, logger="promptsplice.engine_adapters.store"):
                cpu0 = time.process_time()
                assert a.discard(refs[0].key)
                time.sleep(1.2)
                cpu = time.process_time() - cpu0
            refused = [r for r in caplog.records if "refused a delete" in r.getMessage()]
            assert len(refused) == 1 and cpu < 0.5, (len(refused), cpu)
            assert admin.exists(value_key(refs[0])) == 1  # still there: the server refused
            assert a.get(refs[0], salt=SALT).status is MISS  # and never served meanwhile
        finally:
            admin.execute_command("ACL", "SETUSER", "default", "+del")
        assert wait_for(lambda: admin.exists(value_key(refs[0])) == 0, timeout=3.0)
        assert admin.exists(value_key(refs[1])) == 1
        admin.close()


def test_a_clear_on_a_server_that_refuses_deletes_never_serves_what_it_cleared(redis_url):
    """A clear's wipe of values its (bounded) index never held stopped at the first DEL
    the server refused (an ACL here; a read-only replica alike), and the next rescan
    indexed those values and served them.  They now stay doomed (never indexed or
    served) and their delete is retried after the back-off until the server takes it."""
    refs = make_refs(6)
    with open_store(redis_url, dram_blocks=8) as a:
        put_all(a, refs)
        a.drain()
    admin = client(redis_url)
    try:
        with open_store(redis_url, remote_bytes=2 * max(map(rec_file_size, refs)) + 8, remote_retry_s=0.3) as b:
            tier = remote(b)
            assert tier.wait_synced(5.0) and b.stats().remote_blocks == 2  # its index holds 2 of the 6
            admin.execute_command("ACL", "SETUSER", "default", "-del")
            b.clear()
            assert wait_for(lambda: tier._since_clear is None)  # the wipe went through the server
            assert len(_psk_keys(redis_url)) == 6  # every delete refused
            assert tier._rescan() is not None  # a rescan now (after an outage, say) indexes none of them
            assert b.stats().remote_blocks == 0 and b.match_prefix(refs, salt=SALT) == 0
            assert all(b.get(r, salt=SALT).status is MISS for r in refs)
            admin.execute_command("ACL", "SETUSER", "default", "+del")
            assert wait_for(lambda: _psk_keys(redis_url) == [], timeout=5.0)
    finally:
        admin.execute_command("ACL", "SETUSER", "default", "+del")
        admin.close()


# ---------------------------------------------------------------------------- review of 2026-12-03


class _SlowLink:
    """A TCP relay in front of the real server that holds each answer ``delay`` seconds:
    a server that answers, just under the socket timeout (nothing real does so on demand)."""

    def __init__(self, upstream_port: int, delay: float, first: int | None = None) -> None:
        import socket
        import threading

        self.delay, self.port, self.first = delay, free_port(), first  # first: only a connection's first answers
        self._up = upstream_port
        self._ls = socket.create_server(("127.0.0.1", self.port))
        self._socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                c, _ = self._ls.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self._up))
            self._socks += [c, u]
            threading.Thread(target=self._pump, args=(c, u, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, self.delay), daemon=True).start()

    def _pump(self, src, dst, delay: float) -> None:
        n = 0
        try:
            while data := src.recv(1 << 16):
                n += 1
                if self.first is None or n <= self.first:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in (self._ls, *self._socks):
            s.close()


@pytest.mark.reliability
def test_a_server_that_answers_slowly_is_an_outage_not_a_stalled_load(redis_server, redis_url):
    """Every answer 0.12 s late, under the 0.2 s socket timeout: 20 loads took 2.4 s and
    no outage was counted.  Reads averaging over half the timeout now open the breaker;
    the rest of the loads miss at once (vLLM recomputes them)."""
    with open_store(redis_url) as writer:
        refs = make_refs(20)
        put_all(writer, refs)
    link = _SlowLink(int(redis_url.rsplit(":", 1)[1].split("/")[0]), delay=0.12)
    try:
        with open_store(f"redis://127.0.0.1:{link.port}/0", remote_timeout_s=0.2, remote_retry_s=30) as b:
            assert wait_for(lambda: b.stats().remote_blocks == 20, timeout=10.0)
            t0 = time.monotonic()
            got = [b.get(r, salt=SALT).status for r in refs]
            took = time.monotonic() - t0
            assert got[:4] == [HIT_DISK] * 4 and set(got[6:]) == {MISS}, got  # served, then the breaker
            assert b.stats().remote_outages == 1 and took < 1.5, (took, b.stats())
    finally:
        link.close()


def test_a_slow_handshake_on_a_healthy_server_is_not_a_slow_server(redis_server, redis_url):
    """Only each connection's first answers late (the handshake over a far link): the
    first read took 0.36 s and, as the first sample of an average, tripped the breaker
    on a server that then answered every read at once."""
    with open_store(redis_url) as writer:
        refs = make_refs(20)
        put_all(writer, refs)
    link = _SlowLink(int(redis_url.rsplit(":", 1)[1].split("/")[0]), delay=0.15, first=2)
    try:
        with open_store(f"redis://127.0.0.1:{link.port}/0", remote_timeout_s=0.2, remote_retry_s=30) as b:
            assert wait_for(lambda: b.stats().remote_blocks == 20, timeout=10.0)
            remote(b)._client.connection_pool.disconnect(inuse_connections=False)  # the next read connects
            got = [b.get(r, salt=SALT).status for r in refs]
            assert got == [HIT_DISK] * 20 and b.stats().remote_outages == 0, (got, b.stats())
    finally:
        link.close()


def test_stores_on_two_databases_of_one_server_never_index_each_other(redis_server, redis_url):
    """Pub/sub ignores database numbers: a store on /1 indexed every block announced on
    /0, then missed each (pinned, a load error and a recompute apiece)."""
    base = redis_url.rsplit("/", 1)[0]
    with open_store(f"{base}/1") as other, open_store(f"{base}/0") as a:
        assert remote(other).wait_synced(5.0)
        refs = make_refs(8)
        put_all(a, refs)
        with open_store(f"{base}/0") as same:
            assert wait_for(lambda: same.stats().remote_blocks == 8)
        time.sleep(0.3)  # announcements had time to reach /1's listener
        assert other.stats().remote_blocks == 0 and other.match_prefix(refs, salt=SALT) == 0
    admin = redis.Redis.from_url(f"{base}/1")
    admin.flushdb()
    admin.close()


def test_a_database_the_server_lacks_is_one_logged_outage(redis_server, redis_url, caplog):
    """The server refuses SELECT of a database it does not have at every connect: the
    listener logged an ERROR with a traceback each back-off, forever, and counted no
    outage.  Now: one outage, one warning naming the database, blocks kept locally."""
    url = redis_server.url.rsplit("/", 1)[0] + "/99999"  # the server has 16 databases
    refs = make_refs(6)
    with caplog.at_level(logging.WARNING), open_store(url, dram_blocks=8, remote_retry_s=0.2) as store:
        assert put_all(store, refs) == [PutStatus.STORED] * 6
        time.sleep(1.5)  # seven back-offs: the listener tried again after each
        assert [store.get(ref, salt=SALT).status for ref in refs] == [HIT_DRAM] * 6
        st = store.stats()
        assert st.remote_outages == 1 and not st.remote_available and st.remote_writes == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    refusals = [r.getMessage() for r in caplog.records if "refuses the tier's subscribe" in r.getMessage()]
    assert len(refusals) == 1 and "DB index is out of range" in refusals[0] and "database number" in refusals[0]


def test_a_shared_tier_needs_a_fingerprint(redis_url):
    """Without one, a bfloat16 store was served a float32 block of another shape."""
    cfg = StoreConfig(dram_bytes=P, remote_bytes=1 << 20, remote_url=redis_url)
    with pytest.raises(ConfigError, match="fingerprint is empty"):
        BlockStore(cfg)


def test_credentials_never_reach_a_log_line_or_a_repr(caplog):
    from promptsplice.engine_adapters.store._redis import _redact

    url = f"redis://user:pw-one@127.0.0.1:{free_port()}/0?password=pw-two"
    assert "pw-" not in _redact(url) and "127.0.0.1" in _redact(url)
    cfg = StoreConfig(dram_bytes=P, remote_bytes=1 << 20, remote_url=url, fingerprint=FP_TEXT, remote_timeout_s=0.05)
    assert "pw-" not in repr(cfg)
    with caplog.at_level(logging.WARNING), BlockStore(cfg) as store:
        ref = make_refs(1)[0]
        store.put(ref, kv(0), salt=SALT)  # the server is not there: one outage, logged
        assert wait_for(lambda: store.stats().remote_outages >= 1)
    assert "out of reach" in caplog.text and "pw-" not in caplog.text


def test_without_the_redis_client_the_config_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "redis", None)  # an install without the extra
    with pytest.raises(ConfigError, match=r"pip install 'promptsplice\[redis\]'"):
        StoreConfig(dram_bytes=P, remote_bytes=1 << 20, remote_url="redis://127.0.0.1:6379/0")


def test_a_forked_child_never_waits_for_threads_or_locks_it_did_not_inherit(redis_url, tmp_path):
    """The child's writers and listener do not exist (drain() and close() waited for
    them for good), and a store lock another thread held at the fork was copied held
    (the child's first get hung).  Now the fork waits for the lock, and the child keeps
    its DRAM tier only."""
    import threading

    with open_store(redis_url, write_behind_bytes=1 << 20, disk_bytes=1 << 20, disk_dir=str(tmp_path)) as store:
        refs = make_refs(3)
        put_all(store, refs)
        held = threading.Event()

        def hold():
            with store._cond:
                held.set()
                time.sleep(0.3)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait()
        pid = os.fork()  # while the other thread holds the store's lock
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                signal.alarm(10)
                store.put(make_refs(1, start=9000)[0], kv(5), salt=SALT)
                ok = store.get(refs[-1], salt=SALT).status in (HIT_DRAM, MISS)
                store.drain()
                store.close()
                code = 0 if ok and not store._lower else 2
            finally:
                os._exit(code)
        holder.join()
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert store.match_prefix(refs, salt=SALT) == 3 and len(store._lower) == 2  # the parent's tiers work


# ------------------------------------------- a delete and a later put of one name; rescans


def _hold_deletes_of(tier: RedisTier, name: str, monkeypatch, hold_s: float = 3.0):
    """The tier's DEL of ``name`` waits (at most ``hold_s``) until the returned ``gate``
    is set, as on a slow link; ``entered`` is set once it is on its way."""
    import threading

    entered, gate = threading.Event(), threading.Event()
    real = tier._client.delete

    def delete(*names):
        if name in (n.decode() if isinstance(n, bytes) else n for n in names):
            entered.set()
            gate.wait(hold_s)
        return real(*names)

    monkeypatch.setattr(tier._client, "delete", delete)
    return entered, gate


def test_a_put_right_after_a_discard_keeps_its_value(redis_url, monkeypatch):
    """Inline writes: discard() queued the DEL of the name for the writer thread, the
    next put() of the block SET and announced it at once, and the DEL landed after the
    SET: the value was gone though counted written and announced to other engines.
    Now the put hands its write to the writer, which sends it after the DEL."""
    with open_store(redis_url, dram_blocks=8) as a, open_store(redis_url, dram_blocks=8) as b:
        assert remote(a).wait_synced(5.0) and remote(b).wait_synced(5.0)
        ref = make_refs(1)[0]
        name = value_key(ref)
        entered, gate = _hold_deletes_of(remote(a), name, monkeypatch)
        assert a.put(ref, kv(1), salt=SALT) is PutStatus.STORED
        assert a.discard(ref.key) is True
        assert entered.wait(2.0)  # the writer's DEL is on its way
        t0 = time.monotonic()
        assert a.put(ref, kv(1), salt=SALT) is PutStatus.STORED
        assert time.monotonic() - t0 < 1.0  # the put never waited for the DEL
        gate.set()
        a.drain()
        admin = client(redis_url)
        assert admin.exists(name) == 1
        admin.close()
        assert a.stats().remote_writes == 2 and a.stats().remote_blocks == 1
        assert wait_for(lambda: remote(b).find((0, ref.key)) is not None)
        got = b.get(ref, salt=SALT)
        assert got.status is HIT_DISK and torch.equal(got.payload, kv(1))


def test_a_put_during_a_clears_scan_keeps_its_value(redis_url, monkeypatch):
    """The second half of a clear (the writer's scan of the server) chose the names to
    delete, then a put of one of them SET it inline before that DEL landed: the value
    the put had stored and announced was deleted."""
    with open_store(redis_url, dram_blocks=8) as a:
        assert remote(a).wait_synced(5.0)
        ref = make_refs(1)[0]
        name = value_key(ref)
        meta = fmt.BlockMeta(0, ref.key, fmt.salt_bytes(SALT), ref.parent, token_bytes(ref.tokens), (2, 2, 16, 4), "float32")
        admin = client(redis_url)  # written by another engine, never announced: not in a's index
        admin.set(name, bytes(fmt.encode_record(meta, memoryview(kv(0).reshape(-1).view(torch.uint8).numpy()), FP)))
        entered, gate = _hold_deletes_of(remote(a), name, monkeypatch)
        a.clear()
        assert entered.wait(2.0)  # the scan's DEL of the name is on its way
        assert a.put(ref, kv(1), salt=SALT) is PutStatus.STORED
        gate.set()
        a.drain()
        assert wait_for(lambda: _writer_idle(a))
        assert admin.exists(name) == 1
        admin.close()
        assert a.stats().remote_writes == 1 and a.stats().remote_blocks == 1
        with open_store(redis_url) as b:  # a restart's rescan finds the put's value
            assert remote(b).wait_synced(5.0)
            got = b.get(ref, salt=SALT)
            assert got.status is HIT_DISK and torch.equal(got.payload, kv(1))


def test_an_outage_during_a_rescan_has_the_listener_scan_again(redis_server, redis_url, monkeypatch):
    """A write timed out (an outage: the index forgotten) while the listener was between
    two pages of its scan; the scan then finished and marked the index synced, so the
    listener never scanned again: the values of the pages before the outage stayed
    unindexed, and the block the outage lost was never written again."""
    import threading

    refs = make_refs(21)
    with open_store(redis_url) as b:
        put_all(b, refs[:20])
    real_scan = redis.Redis.scan
    entered, gate, calls = threading.Event(), threading.Event(), [0]

    def scan(self, cursor=0, **kwargs):
        if threading.current_thread().name == "promptsplice-kv-redis":
            kwargs["count"] = 5  # several pages of 20 values
            calls[0] += 1
            if calls[0] == 2:  # the listener's first scan, between two pages
                entered.set()
                gate.wait(3.0)
        return real_scan(self, cursor, **kwargs)

    monkeypatch.setattr(redis.Redis, "scan", scan)
    with open_store(redis_url, remote_retry_s=0.3, remote_timeout_s=0.2) as a:
        tier = remote(a)
        assert entered.wait(3.0)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the server stops answering: an outage
        try:
            assert a.put(refs[20], kv(20), salt=SALT) is PutStatus.STORED  # DRAM; the SET times out
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert a.stats().remote_outages == 1 and not tier.wait_synced(0)
        gate.set()
        assert wait_for(lambda: a.stats().remote_blocks == 21, timeout=4.0), a.stats()
        assert tier.wait_synced(0) and a.match_prefix(refs, salt=SALT) == 21
        assert a.stats().remote_outages == 1 and calls[0] > 2


# ------------------------------------------------------ review: slow reads, large values, ACLs


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


@pytest.mark.reliability
def test_a_server_skipped_as_slow_counts_none_of_its_blocks_in_match_prefix(redis_url, monkeypatch):
    """While a slow server's reads were skipped, ``match_prefix`` and ``holds`` still
    counted (and pinned) its indexed blocks: the connector reported external hits that
    then all loaded as MISS (each a load error and a recompute).  Now they count none
    until reads resume; the tier's pending writes (served from memory) still count.
    (The slow reads are mocked, each GET held 0.35 s before the real one, under the
    0.6 s timeout: a slow socket is not something a real server does on demand; the
    listener's calls stay real.)"""
    import threading

    refs = make_refs(16)
    with open_store(redis_url) as writer:
        put_all(writer, refs)
    with open_store(redis_url, remote_timeout_s=0.6, remote_retry_s=30.0, write_behind_bytes=64 * P) as b:
        tier = remote(b)
        assert tier.wait_synced(10.0) and b.stats().remote_blocks == 16
        assert b.match_prefix(refs, salt=SALT) == 16 and b.holds(refs[15].key)
        real_get = tier._client.get

        def slow_get(*args, **kwargs):  # answered under the timeout, but late
            time.sleep(0.35)
            return real_get(*args, **kwargs)

        monkeypatch.setattr(tier._client, "get", slow_get)
        assert [b.get(ref, salt=SALT).status for ref in refs[:4]] == [HIT_DISK] * 4
        # skipped as slow, index kept (not an outage that forgot it)
        st = b.stats()
        assert st.remote_outages == 1 and st.remote_blocks == 16 and tier.wait_synced(0), st
        rest = refs[8:]
        assert b.match_prefix(rest, salt=SALT, owner="req-1") == 0
        assert b.stats().pinned_blocks == 0 and not b.holds(rest[0].key) and not tier.readable
        assert b.contains(rest[0], salt=SALT)  # still stored: a save skips it
        # a block on its way to the slow server is served from memory: it counts
        gate = threading.Event()
        real_set = tier._client.set

        def held_set(*args, **kwargs):  # the SET is still on its way
            gate.wait(5.0)
            return real_set(*args, **kwargs)

        monkeypatch.setattr(tier._client, "set", held_set)
        big = make_refs(1, start=90_000)[0]
        try:
            assert b.put(big, kv(7, shape=(2, 2, 16, 64)), salt=SALT) is PutStatus.STORED  # > DRAM
            assert b.match_prefix([big], salt=SALT) == 1 and b.holds(big.key)
            assert b.get(big, salt=SALT).status is HIT_DRAM
        finally:
            gate.set()
            b.drain()
        # reads resume after the back-off (ended here): the index counts again, no read needed
        with b._cond:
            tier._slow_until = time.monotonic()
        assert tier.readable and b.match_prefix(rest, salt=SALT) == 8


@pytest.mark.reliability
def test_a_value_slower_to_send_than_the_timeout_is_written_not_an_outage():
    """The socket timeout bounds a whole send: a 64 MiB block (~0.1 s to send on
    loopback) under ``remote_timeout_s=0.03`` was an outage at each write (index
    forgotten, breaker open) on a healthy server, and never written.  A SET's timeout
    now grows with the value."""
    with RedisServer(maxmemory="256mb") as server:
        with open_store(server.url, remote_timeout_s=0.03, remote_retry_s=0.2, remote_bytes=256 << 20) as store:
            # (a loaded machine may time the listener out at 0.03 s: it is back 0.2 s later)
            assert wait_for(lambda: remote(store).wait_synced(0) and store.stats().remote_available, 10.0)
            before = store.stats()
            ref = make_refs(1)[0]
            block = torch.zeros(64 << 20, dtype=torch.uint8)
            assert store.put(ref, block, salt=SALT, copy=False) is PutStatus.STORED  # > DRAM: written inline
            st = store.stats()
            assert (st.remote_writes, st.remote_write_errors, st.remote_outages) == (1, 0, before.remote_outages), st
            assert st.remote_available and st.remote_blocks == 1
        del block
        admin = client(server.url)
        assert admin.dbsize() == 1
        admin.close()


def test_a_write_that_times_out_while_the_server_answers_is_a_write_error_not_an_outage(redis_url):
    """A SET that timed out opened the breaker and forgot the index even when the server
    answered everything else.  Now it is a write error; only a PING that fails after it
    opens the breaker.  (The real server holds writes only: CLIENT PAUSE WRITE.)"""
    with open_store(redis_url, dram_blocks=8, remote_timeout_s=0.3) as store:
        tier = remote(store)
        assert tier.wait_synced(5.0)
        a, b, c = make_refs(3)
        assert store.put(a, kv(0), salt=SALT) is PutStatus.STORED
        admin = client(redis_url)
        admin.client_pause(1000, all=False)  # writes wait 1 s, past the 0.3 s timeout; PING answers
        admin.close()
        t0 = time.monotonic()
        assert store.put(b, kv(1), salt=SALT) is PutStatus.STORED  # DRAM keeps it
        store.drain()
        st = store.stats()
        assert (st.remote_writes, st.remote_write_errors, st.remote_outages) == (1, 1, 0), st
        assert st.remote_available and st.remote_blocks == 1 and tier.wait_synced(0)  # index kept
        time.sleep(max(0.0, 1.1 - (time.monotonic() - t0)))  # the pause is over
        assert store.put(c, kv(2), salt=SALT) is PutStatus.STORED
        store.drain()
        assert store.stats().remote_writes == 2


def test_a_block_larger_than_the_write_behind_bound_is_still_shared(redis_url):
    """``write_behind_bytes`` below one block: the disk tier writes such a block inline,
    the shared tier skipped every one, silently (other engines never found a block).
    An empty queue now takes one block, whatever its size."""
    refs = make_refs(3)
    with open_store(redis_url, write_behind_bytes=P // 2, remote_timeout_s=1.0) as a, \
            open_store(redis_url, remote_timeout_s=1.0) as b:
        assert remote(b).wait_synced(5.0)
        for i, ref in enumerate(refs):
            assert a.put(ref, kv(i), salt=SALT) is PutStatus.STORED
            a.drain()
        st = a.stats()
        assert (st.remote_writes, st.remote_skipped) == (3, 0), st
        assert wait_for(lambda: b.match_prefix(refs, salt=SALT) == 3)


def test_a_user_refused_scan_is_one_outage_and_one_warning(redis_url, caplog):
    """An ACL user that may read and write but not SCAN (common hardening): each
    back-off the listener's subscribe, or a write, reached the server and re-armed the
    breaker, so every retry counted an outage and logged a warning, forever.  Now: one
    of each until a scan succeeds."""
    admin = client(redis_url)
    admin.execute_command("ACL", "SETUSER", "noscan", "on", ">pw", "~*", "&*", "+@all", "-scan")
    try:
        url = f"redis://noscan:pw@127.0.0.1:{_port(redis_url)}/0"
        with caplog.at_level(logging.WARNING), \
                open_store(url, dram_blocks=8, remote_retry_s=0.2, remote_timeout_s=1.0) as store:
            deadline = time.monotonic() + 1.5  # seven back-offs, writes landing in between
            i = 0
            while time.monotonic() < deadline:
                store.put(make_refs(1, start=20_000 + i * 16)[0], kv(i % 8), salt=SALT)
                i += 1
                time.sleep(0.05)
            st = store.stats()
            assert st.remote_outages == 1 and st.remote_writes > 0, st
        refusals = [r.getMessage() for r in caplog.records if "refuses the tier's subscribe" in r.getMessage()]
        assert len(refusals) == 1 and "scan" in refusals[0], refusals
    finally:
        admin.execute_command("ACL", "DELUSER", "noscan")
        admin.close()
