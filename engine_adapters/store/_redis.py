"""The shared tier of the block store: checked records on a Redis server, written behind.

Engines on different machines point their stores at one Redis: a block one engine
computed is loaded by another that misses locally.  A :class:`RedisTier` keeps the
storage-tier contract of ``_tier`` the same way the disk tier does, and reuses its
record format (``_format``: header, token ids, payload, xxh3-128 digests):

* Keys.  ``psk:{fingerprint}:{salt digest}:{namespace}:{key}``: the model/layout
  fingerprint and the tenant salt are in the key name, so tenants and models never
  read each other's values; the record's header repeats both and is checked on load.
* Index from memory.  ``find``/``locate`` answer from an in-memory index (``match_prefix``
  makes no network call).  A listener thread fills it: every write is announced with
  the record's header on the channel ``psk:{fingerprint}:blocks:{db}`` (pub/sub ignores
  database numbers, so the channel names its database), and on every
  (re)connection the listener scans the server's keys of this fingerprint (headers
  only).  The index is bounded by ``budget`` bytes of records (LRU, pins kept); the
  server's own ``maxmemory`` LRU bounds what the server holds, so an indexed block may
  be gone: its load answers ``MISS``.
* Verified loads.  A value is served only if its length, digests, fingerprint and
  header (key, salt, parent, token ids, layout) match; anything else is deleted,
  counted (``corrupt``, or ``foreign`` for another fingerprint) and answered ``CORRUPT``.
  The delete is conditional (a server-side script): only a value still holding the
  bytes that were read goes, so another engine's SET of a good value between the read
  and the delete stays (a delete retried after an outage keeps its condition; a
  server that refuses scripts gets the plain DEL: at worst a lost hit, never a wrong
  block).
* Write-behind that never blocks.  Write-downs go to a bounded queue (at most
  ``write_behind_bytes`` of payload, or one block when an empty queue takes a larger
  one: a bound below one block wrote nothing, silently) and a writer thread; when it is
  full the block is not written (counted in ``skipped``, reported lost), the caller
  never waits.
* Announced once stored.  A value is announced after its SET succeeded (a refused one,
  out of memory, never is) and only while the write is still wanted; a write that a
  ``clear`` or a removal overtook is deleted again.  A clear overtakes a rescan too: what
  the scan read before it is never indexed, and the listener scans again once the
  clear's wipe of the server is over.  A removed value's name (clear,
  removal, damage) is never indexed or served until its delete reached the server;
  deletes that cannot reach it wait for it.  Calls on one name never overlap (two
  connections may land them in either order): a put whose name has a SET or DEL on its
  way is sent after it, by the writer thread (the caller does not wait), and a delete
  still queued when a put of its name is sent is dropped (the SET replaces the value).
* Slow servers.  The socket timeout bounds each socket read, not a call: a server
  that answers late is judged on the median of its last reads (over half the timeout)
  or one read over five timeouts, and its reads are then skipped for ``retry_s``
  (counted as an outage; the index is kept, but ``readable`` is false, so the store's
  ``match_prefix`` counts none of its blocks: each would load as ``MISS``).  A socket
  timeout bounds a whole send, so a SET's grows with the value (``_MIN_BANDWIDTH``),
  and a SET that times out is a write error; only a PING that fails after it opens the
  breaker (the server answers: this one write was too slow).
* Outages.  Connect and socket timeouts are short; a connection error or timeout (in
  any call) opens a circuit breaker: the tier counts one outage, logs one warning,
  forgets its index (the server may come back empty) and refuses reads and writes for
  ``retry_s`` seconds, so a dead server costs at most one short timeout per back-off
  period.  The listener then resubscribes and rescans (again if an outage came during
  its scan, which forgot what the scan had indexed).  A server that refuses a write
  (out of memory) counts a write error and drops the block, without opening the
  breaker.  A server that refuses the listener's subscribe or scan (a database number
  it does not have, an ACL without those commands) is an outage too, counted and
  logged once with its reason until a scan succeeds: the tier cannot keep an index
  there.  No exception of the client reaches
  the caller or stops the writer.

A forked child never uses an inherited tier (the store keeps its DRAM tier only there:
``_store``).  The ``redis`` client is imported when a tier is built, never at import time.  Kept as
one module (~1,120 lines): the index, the writer and the listener share one lock and one
set of rules (what is announced, what is doomed, when the breaker opens, what a clear's
scan of the server keeps), and each race between them is settled in this file.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from promptsplice.blocks import content_digest
from promptsplice.engine_adapters.store import _format as fmt
from promptsplice.engine_adapters.store._tier import (
    IndexedTier,
    StoredRecord,
    WriteJob,
    record_size,
    NAMESPACES,
    BlockMeta,
    ByteLru,
    Fetched,
    Held,
    Key,
    Loaded,
    TierStats,
    never_pinned,
    new_condition,
)

if TYPE_CHECKING:
    import torch

__all__ = ["RedisTier", "check_redis_url", "key_prefix", "record_key"]

_log = logging.getLogger(__name__)

_HEAD_READ = 4096  # bytes of a value the listener reads to index it (headers are shorter)
# DEL each key only while it holds what was read of it: ARGV has, per key, its ``_Read``
# (the length and SHA-1 of the bytes read from its start, the value's whole length).
_DELETE_IF_UNCHANGED = """
local deleted = 0
for i, key in ipairs(KEYS) do
  local at = 3 * (i - 1)
  local n = tonumber(ARGV[at + 1])
  if redis.call('STRLEN', key) == tonumber(ARGV[at + 3])
      and (n == 0 or redis.sha1hex(redis.call('GETRANGE', key, 0, n - 1)) == ARGV[at + 2]) then
    deleted = deleted + redis.call('DEL', key)
  end
end
return deleted
"""


def _read_mark(head: bytes, size: int) -> tuple[int, str, int]:
    """What was read of a damaged value (its first ``len(head)`` bytes, its length), as
    the conditional delete compares it: ``(len(head), SHA-1 hex of head, size)``."""
    return len(head), hashlib.sha1(head).hexdigest(), size
#: Client options the tier sets itself; a URL may not override them.
_OWN_OPTIONS = frozenset({
    "socket_timeout", "socket_connect_timeout", "retry_on_timeout", "retry_on_error", "retry",
    "health_check_interval",
    "max_connections",  # the listener, the writer and the readers each hold one: a cap starves them
})  # fmt: skip
#: Client options that turn replies into str: the tier's values are binary.
_DECODING = frozenset({"decode_responses"})
#: A slow server (one that answers, late): reads are skipped for ``retry_s`` when the
#: median of the last reads is over this share of the timeout (a median, so the few
#: reads that opened a connection, handshake included, do not count), or at once when
#: one read takes longer than ``_SLOW_AT_ONCE`` timeouts (more than a healthy handshake,
#: each of its calls bounded by the timeout, can take).
_SLOW_SHARE = 0.5
_SLOW_AFTER = 4  # reads seen before the median counts
_SLOW_WINDOW = 8
_SLOW_AT_ONCE = 5
#: The slowest link (bytes a second) a healthy server is expected to take a value over.
#: The socket timeout bounds a whole send, not each chunk: a SET's timeout is
#: ``remote_timeout_s`` plus the value's bytes over this (rounded up to a power of two
#: seconds, so values of one size share one client), or a 96 MiB block, ~0.1 s to send
#: on loopback, was an outage under ``remote_timeout_s=0.03``.  32 MiB/s is a quarter of
#: 1 Gbit/s Ethernet: a paused server holds a 2 MiB block's write ~0.06 s longer.
_MIN_BANDWIDTH = 32 << 20


def check_redis_url(url: object) -> str | None:
    """Why ``url`` is not a usable Redis URL (``None`` when it is)."""
    if not isinstance(url, str) or not url:
        return f"must be a redis:// URL string, got {type(url).__name__}"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        if "could not be cast" in str(exc):  # it quotes the URL's text: part of a password, say
            return ("is not a valid URL: its port is not a number, or a password holds a character a URL "
                    "cannot (percent-encode the password with urllib.parse.quote(password, safe=''))")
        return f"is not a valid URL ({exc})"
    if parts.scheme != "redis":
        return f"must start with redis:// (got scheme {parts.scheme or 'none'!r})"
    if not parts.hostname:
        return "names no host (e.g. redis://127.0.0.1:6379/0)"
    db = parts.path[1:].rstrip("/")  # redis-py reads /0/ as database 0
    if db and not (db.isdigit() and db.isascii()):
        # the client reads /abc as database 0 and /1/2 as database 12, silently
        return f"names database {db!r}: the path is a database number (e.g. redis://127.0.0.1:6379/0)"
    options = set(urllib.parse.parse_qs(parts.query))
    decoding = sorted(options & _DECODING)
    if decoding:
        # decoded replies broke every read of a binary value: the shared tier never served
        return (f"sets {', '.join(decoding)}: the tier reads binary values, so the client must "
                "return bytes; drop the option")
    overrides = sorted(options & _OWN_OPTIONS)
    if overrides:
        # redis-py lets a URL's options win over the tier's own: ?socket_timeout=4 made
        # a paused server hold a forward pass for 4 s under remote_timeout_s=0.2
        return (f"sets {', '.join(overrides)}, which the tier controls itself (its timeouts, retries and "
                "connections): drop them and use StoreConfig.remote_timeout_s / remote_retry_s")
    try:
        import redis
    except ImportError:
        return "needs the redis client: pip install 'promptsplice[redis]'"

    try:  # the client's own reading of the URL and its options (no I/O)
        pool = redis.ConnectionPool.from_url(url)
        pool.make_connection()
        pool.disconnect()
    except (TypeError, ValueError, redis.RedisError) as exc:
        # an unknown option, a value of the wrong type; the client raises its own
        # ConnectionError for some values (``?protocol=9``): translated here, never raised
        return f"has options the redis client does not take ({exc})"
    return None


def key_prefix(fingerprint: bytes) -> str:
    """The prefix of every key (and of the channel) of one fingerprint."""
    return f"psk:{fingerprint.hex()}:"


def record_key(fingerprint: bytes, meta: BlockMeta) -> str:
    """The Redis key of one block: fingerprint, salt digest, namespace, chain key."""
    salt = content_digest(meta.salt)[:8].hex()
    return f"{key_prefix(fingerprint)}{salt}:{meta.namespace:02x}:{meta.key.hex()}"



class RedisTier(IndexedTier):
    """Records on one Redis server, indexed in memory (see the module doc)."""

    name = "remote"
    shared = True
    """Written when a block is stored, not only when DRAM evicts it: other engines can
    only use what reached the server."""

    def __init__(
        self,
        url: str,
        *,
        budget: int,
        fingerprint: bytes,
        timeout_s: float = 0.2,
        retry_s: float = 5.0,
        write_behind_bytes: int = 0,
        cond: threading.Condition | None = None,
        pinned: Callable[[Key], bool] = never_pinned,
        on_lost: Callable[[Key, Held], None] | None = None,
        on_back: Callable[[], None] | None = None,
    ) -> None:
        """Connect lazily to ``url`` (no I/O here: a server that is down at start-up
        is an outage like any other) and start the listener that fills the index."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._timeouts: tuple[type[BaseException], ...] = (redis.TimeoutError, TimeoutError)
        self._refusals: tuple[type[BaseException], ...] = (redis.ResponseError,)
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        self._client = redis.Redis.from_url(url, **options)
        # Clients for large values, by the seconds their SET may take beyond the timeout
        # (see ``_MIN_BANDWIDTH``): built without I/O, closed with the tier.
        self._setters: dict[float, Any] = {}
        self._new_client: Callable[[float], Any] = lambda t: redis.Redis.from_url(
            url, **{**options, "socket_timeout": t}
        )
        self._url = url
        self._fp = fingerprint
        self._prefix = key_prefix(fingerprint)
        # Pub/sub is server-wide, database numbers are not: the channel names the
        # database, or a store on /1 indexed (and missed) every block written to /0.
        self._channel = f"{self._prefix}blocks:{self._client.connection_pool.connection_kwargs.get('db', 0)}"
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._limit = write_behind_bytes
        self._cond = cond if cond is not None else new_condition()
        self._pinned = pinned
        self._on_lost = on_lost
        self._on_back = on_back  # after an outage: the store writes its DRAM blocks again
        self._lru: ByteLru[StoredRecord] = ByteLru(budget, record_size)
        self._writing: dict[Key, Held] = {}
        self._queue: deque[WriteJob] = deque()
        self._queue_bytes = 0
        self._deletes: list[str] = []
        # Damaged values among ``_deletes``: deleted only while the server still holds
        # what was read (``_read_mark``); a plain delete of the name (remove, clear) or a
        # SET replacing it drops the condition.
        self._delete_if: dict[str, tuple[int, str, int]] = {}
        # Values removed here (clear, remove, damaged) whose delete has not reached the
        # server yet: never indexed again from an announcement or a rescan, never served.
        self._doomed: set[str] = set()
        # Names with a SET or DEL on its way to the server, sent by one thread without the
        # lock: a later call on the name waits for it, or the two (on two connections)
        # could land in either order (a delete queued before a put of the name, landing
        # after its SET, removed the value the put had counted written and announced).
        self._busy: dict[str, int] = {}
        self._wipe = False  # a clear's scan of the server for values never indexed here
        self._since_clear: set[str] | None = None  # names stored since a clear, till its scan ends
        self._deletes_until = 0.0  # after the server refused a delete: retried from then
        self._delete_warned = False
        self._refusal_warned = False  # a refused write was logged; reset by one that lands
        self._listen_refused = False  # the listener's subscribe or scan was refused (counted, logged)
        self._lost_index = False  # an outage forgot the index: the next rescan re-shares
        self._outage_epoch = 0  # outages so far: a rescan that one overtook scans again
        self._clears = 0  # clears so far: a rescan that one overtook scans again, after its wipe
        self._writer: threading.Thread | None = None
        self._down_until: float | None = None
        self._up = True
        self._warned = False
        self._synced = threading.Event()
        self._closed = False
        self._evictions = self._writes = self._write_errors = self._corrupt = self._foreign = 0
        self._outages = self._skipped = 0
        self._read_times: deque[float] = deque(maxlen=_SLOW_WINDOW)  # the last reads' wall times
        self._slow_until = 0.0  # reads skipped until then (the index is kept)
        self._listener = threading.Thread(target=self._listen, name="promptsplice-kv-redis", daemon=True)
        self._listener.start()

    # ------------------------------------------------------ index (under the lock)

    def touch(self, k: Key) -> bool:
        if k not in self._lru:
            return False
        self._lru.touch(k)
        return True

    def put(self, k: Key, held: Held) -> WriteJob | None:
        """Plan a write-down; ``None`` (reported lost) when the server is out of reach
        or the write-behind queue is full."""
        size = fmt.record_size(held.meta)
        if self._closed or not self._reachable() or size > self._lru.budget:
            self._skip(k, held)
            return None
        if self._limit and self._queue and self._queue_bytes + held.meta.nbytes > self._limit:
            # never block the engine's step on the network; an empty queue takes one block
            # larger than the bound (it was never shared: write_behind_bytes < one block)
            self._skip(k, held)
            return None
        self._writing[k] = held
        return WriteJob(k, held, size)

    def remove(self, k: Key) -> bool:
        held = self._writing.pop(k, None)
        record = self._lru.pop(k)
        for meta in {r.meta for r in (held, record) if r is not None}:
            self._delete_later(record_key(self._fp, meta))
        return held is not None or record is not None

    def clear(self) -> None:
        """Remove every value of this fingerprint from the server, not only the indexed
        ones (the index is bounded, and blocks other engines wrote may not be in it yet):
        the writer deletes the indexed names, then scans the server for the rest (blocks
        stored by this store after the clear are kept).  Other engines' indexes keep
        their entries: their loads of the removed values answer ``MISS``."""
        names = [record_key(self._fp, r.meta) for _, r in self._lru.items()]
        # writes in flight too: stored or not yet, their values must not come back
        names += [record_key(self._fp, held.meta) for held in self._writing.values()]
        self._lru.clear()
        self._writing.clear()
        self._delete_later(*names)
        self._clears += 1  # a rescan under way read values this clear removes: it starts again
        if not self._closed:
            self._wipe = True
            self._since_clear = set()
            self._start_writer()

    def keys(self) -> Iterator[Key]:
        return iter(self._lru)

    @property
    def writable(self) -> bool:
        return self._reachable()

    @property
    def readable(self) -> bool:
        """Whether loads are tried now: the breaker is shut and the server is not skipped
        as too slow (see ``_slow_down``; the index is kept meanwhile)."""
        return not self._closed and self._reachable() and time.monotonic() >= self._slow_until

    def stats(self) -> TierStats:
        return self.base_stats(outages=self._outages, skipped=self._skipped)

    def _reachable(self) -> bool:
        return self._down_until is None or time.monotonic() >= self._down_until

    def _skip(self, k: Key, held: Held) -> None:
        self._skipped += 1
        if self._on_lost is not None:
            self._on_lost(k, held)

    def _index(self, meta: BlockMeta, size: int) -> None:
        """Add a block the server holds to the index (evicting LRU entries of it)."""
        k = (meta.namespace, meta.key)
        if self._doomed and record_key(self._fp, meta) in self._doomed:
            return  # removed here; its delete is still on its way to the server
        old = self._lru.get(k)
        if old is not None:
            if old.meta == meta:
                return
            if self._pinned(k):
                return  # another block under the key (another tenant's content key)
            self._lru.pop(k)
        victims = self._lru.victims(size, self._pinned)
        if victims is None:
            return
        for vk in victims:  # forgotten here; the server keeps the value for others
            self._lru.pop(vk)
            self._evictions += 1
        self._lru.add(k, StoredRecord(meta, size))

    def _claim(self, names: list[str]) -> None:
        """Under the lock: a SET or DEL of ``names`` is about to be sent (see ``_busy``)."""
        for name in names:
            self._busy[name] = self._busy.get(name, 0) + 1

    def _release(self, names: list[str]) -> None:
        """Under the lock: the calls :meth:`_claim` announced are done (or never sent)."""
        for name in names:
            left = self._busy[name] - 1
            if left:
                self._busy[name] = left
            else:
                del self._busy[name]
        self._cond.notify_all()

    def _indexes_name(self, name: str) -> bool:
        """Under the lock: whether the index holds a value stored under ``name`` (a scan
        that read a damaged value may predate this store's SET of a good one)."""
        try:
            ns, key = name.rsplit(":", 2)[-2:]
            record = self._lru.get((int(ns, 16), bytes.fromhex(key)))
        except ValueError:
            return False
        return record is not None and record_key(self._fp, record.meta) == name

    def _slow(self, took: float) -> str | None:
        """Under the lock: why a server that answers is too slow to read from (``None``
        when it is not).  The socket timeout bounds each socket read, not a call: a
        large value over a slow link, or a server answering each read just under the
        timeout, held a forward pass for seconds while no outage was counted."""
        if took > _SLOW_AT_ONCE * self._timeout_s:
            return f"a read took {took:.2f} s, over {_SLOW_AT_ONCE} x remote_timeout_s={self._timeout_s:g}"
        times = self._read_times
        times.append(took)
        if len(times) >= _SLOW_AFTER:
            mid = sorted(times)[len(times) // 2]
            if mid > _SLOW_SHARE * self._timeout_s:
                return (f"the median of its last {len(times)} reads is {mid:.3f} s, over half of "
                        f"remote_timeout_s={self._timeout_s:g}")
        return None

    def _slow_down(self, why: str) -> None:
        """Under the lock: skip reads for ``retry_s`` (counted as an outage, logged once
        per episode); unlike an outage the index is kept (the server holds the blocks)."""
        self._slow_until = time.monotonic() + self._retry_s
        self._read_times.clear()
        self._outages += 1
        _log.warning(
            "KV block store: Redis at %s answers too slowly to load from (%s); serving from the "
            "local tiers, reads retried in %g s", _redact(self._url), why, self._retry_s,
        )  # fmt: skip

    def _outage(self, err: BaseException, *, refused: bool = False) -> None:
        """Under the lock: the server is out of reach (or, ``refused``, answers the
        listener's commands with an error); open the breaker.  A refusal is counted and
        logged once until a scan succeeds: the calls that reach the server in between
        (the subscribe before the scan, writes an ACL allows) do not re-arm it, or an
        ACL without SCAN counted an outage and logged a warning every back-off."""
        repeated = False
        if refused:
            repeated, self._listen_refused = self._listen_refused, True
        self._down_until = time.monotonic() + self._retry_s
        self._read_times.clear()  # a server back from the breaker starts afresh
        self._lru.clear()  # it may come back empty: the listener rescans it
        self._synced.clear()  # (and the listener leaves its subscription to do so)
        self._lost_index = True
        self._outage_epoch += 1  # a rescan running now must not mark the index synced
        if self._up:
            self._up = False
            if not repeated:
                self._outages += 1
        if not self._warned and not repeated:
            self._warned = True
            if refused:
                _log.warning(
                    "KV block store: Redis at %s refuses the tier's subscribe or scan (%s: %s; check "
                    "the URL's database number against the server's `databases` and the user's ACL); "
                    "serving from the local tiers, retried in %g s",
                    _redact(self._url), type(err).__name__, err, self._retry_s,
                )  # fmt: skip
            else:
                _log.warning(
                    "KV block store: Redis at %s is out of reach (%s); serving from the local "
                    "tiers, retried in %g s",
                    _redact(self._url),
                    err,
                    self._retry_s,
                )
        self._cond.notify_all()

    def _back(self) -> None:
        """Under the lock: a call reached the server."""
        if not self._up:
            self._up = True
            self._down_until = None
            self._warned = False

    # ------------------------------------------------------ I/O (without the lock)

    def get(self, k: Key, entry: StoredRecord) -> Fetched:
        """Fetch and verify the value ``locate`` returned ``entry`` for."""
        name = record_key(self._fp, entry.meta)
        with self._cond:
            if self._closed or not self._reachable() or time.monotonic() < self._slow_until or name in self._doomed:
                return Fetched(Loaded.MISS)
        t0 = time.monotonic()
        try:
            value = self._client.get(name)
        except self._errors as exc:
            with self._cond:
                self._outage(exc)
            return Fetched(Loaded.MISS)
        except Exception as exc:  # noqa: BLE001 - refused (redis.RedisError) or a client bug: a miss
            _log.warning("KV block store: Redis read failed (%s: %s)", type(exc).__name__, exc)
            return Fetched(Loaded.MISS)
        took = time.monotonic() - t0
        payload, problem, foreign = self._verify(value, entry.meta) if value is not None else (None, None, False)
        stale = False
        with self._cond:
            self._back()
            slow = self._slow(took)
            if slow is not None:  # this value is good; the next reads go to local tiers
                self._slow_down(slow)
            current = self._lru.get(k) is entry
            if name in self._doomed:  # removed while it was read
                return Fetched(Loaded.MISS)
            if value is None:  # evicted by the server's maxmemory, or deleted
                if current:
                    self._lru.pop(k)
                return Fetched(Loaded.MISS)
            if payload is None:
                if current:
                    self._lru.pop(k)
                if foreign:
                    self._foreign += 1
                else:
                    self._corrupt += 1
                _log.warning("KV block store: deleted damaged Redis value %s (%s)", name, problem)
                # not when this store's SET of the name is on its way or landed since the
                # read began (a put after a removal): its value is the good one
                stale = name in self._busy or self._indexes_name(name)
                if not stale:
                    self._claim([name])
            elif current:
                self._lru.touch(k)
        if payload is None:
            if not stale:
                self._delete_now([name], marks={name: _read_mark(value, len(value))})  # before anyone else loads it
            return Fetched(Loaded.CORRUPT)
        return Fetched(Loaded.HIT, payload)

    def _verify(self, value: bytes, meta: BlockMeta) -> tuple[torch.Tensor | None, str | None, bool]:
        """``(payload, None, False)``, or ``(None, reason, foreign)``."""
        try:
            header, payload = fmt.decode_record(bytearray(value))
        except ValueError as exc:
            return None, str(exc), False
        if header.fingerprint != self._fp:
            return None, "written by another model or layout", True
        if header.meta != meta:
            return None, "header does not match the index", False
        return payload, None, False

    def write(self, job: WriteJob) -> bool | None:
        """Write inline (no write-behind), or queue for the writer; never waits."""
        if not self._limit:
            return self._write_guarded(job, inline=True)
        with self._cond:
            if self._closed or self._writing.get(job.key) is not job.held:
                return False
            if self._queue and self._queue_bytes + job.held.meta.nbytes > self._limit:
                # jobs planned under one hold of the lock (a flush, a re-share after an
                # outage) were all checked against the same queue: the bound holds here
                # (an empty queue takes one block, even one larger than the bound)
                del self._writing[job.key]
                self._skip(job.key, job.held)
                return False
            self._queue.append(job)
            self._queue_bytes += job.held.meta.nbytes
            self._start_writer()
        return None

    def _write_job(self, job: WriteJob, *, inline: bool) -> bool | None:
        """One write: SET, then announce.  A SET or DEL of the same name sent earlier by
        another thread goes first: the writer thread waits for it (one call, bounded by
        the timeout), a caller (``inline``) hands the job to the writer (``None``)
        rather than wait in a forward pass."""
        import torch

        meta = job.held.meta
        name = record_key(self._fp, meta)
        with self._cond:
            while True:
                if self._writing.get(job.key) is not job.held:
                    return False  # removed or cleared meanwhile
                if not self._reachable():
                    del self._writing[job.key]
                    self._skip(job.key, job.held)
                    return False
                if name not in self._busy:
                    break
                if inline:
                    self._queue.append(job)
                    self._queue_bytes += meta.nbytes
                    self._start_writer()
                    return None
                self._cond.wait(timeout=1.0)
            if name in self._doomed:  # its delete, queued before this write, is not sent
                self._deletes = [n for n in self._deletes if n != name]  # the SET replaces
                self._delete_if.pop(name, None)
                self._doomed.discard(name)  # the value it would remove
            self._claim([name])
        try:
            payload = job.held.payload.reshape(-1).view(torch.uint8).numpy()
            data = fmt.encode_record(meta, memoryview(payload), self._fp)
            err: BaseException | None = None
            refused: BaseException | None = None
            late: BaseException | None = None
            try:
                self._setter(len(data)).set(name, bytes(data))
            except self._errors as exc:
                err = exc
                if isinstance(exc, self._timeouts) and self._answers():
                    err, late = None, exc  # a write that took too long, not a server gone
            except Exception as exc:  # noqa: BLE001 - refused (OOM: the value does not fit) or a client bug
                refused = exc
            if err is None and refused is None and late is None:
                # Announced only once stored (a refused value never is), and only while
                # still wanted; a clear or removal that overtakes the write dooms its name.
                with self._cond:
                    wanted = self._writing.get(job.key) is job.held and not self._closed
                if wanted:
                    try:
                        self._client.publish(self._channel, bytes(data[: fmt.header_size(meta)]))
                    except Exception as exc:  # noqa: BLE001 - stored: others find it at their next rescan
                        _log.warning("KV block store: Redis announcement failed (%s)", exc)
        except BaseException:
            with self._cond:
                self._release([name])
            raise
        overtaken = False
        with self._cond:
            self._release([name])
            current = self._writing.get(job.key) is job.held
            if current:
                del self._writing[job.key]
            if err is not None:
                self._write_errors += 1
                self._outage(err)
            elif refused is not None or late is not None:
                self._write_errors += 1
                if not self._refusal_warned:  # once until a write lands: a full server refuses each
                    self._refusal_warned = True
                    if late is not None:
                        _log.warning("KV block store: a Redis write of %d bytes timed out (%s) while the server "
                                     "answers; the block is not shared, further failed writes are counted "
                                     "(remote_write_errors) until a write succeeds", len(data), late)
                    else:
                        _log.warning("KV block store: Redis refused a write (%s); further refusals are counted "
                                     "(remote_write_errors) until a write succeeds", refused)
            else:
                self._refusal_warned = False
                self._back()
                self._writes += 1
                if current:
                    if self._closed:
                        return False
                    if self._since_clear is not None:  # a clear's scan must keep it
                        self._since_clear.add(name)
                    self._index(meta, len(data))
                    return True
                overtaken = True  # stored after its clear or removal: delete it again
                self._doomed.add(name)
                self._claim([name])  # a later write of the name waits for this delete
            if current and self._on_lost is not None:
                self._on_lost(job.key, job.held)
        if overtaken:
            self._delete_now([name])
        return False

    def _setter(self, nbytes: int) -> Any:
        """Without the lock: the client to SET a value of ``nbytes`` with, its socket
        timeout ``remote_timeout_s`` plus the time the value takes at ``_MIN_BANDWIDTH``
        (the socket timeout bounds a whole send: see ``_MIN_BANDWIDTH``)."""
        extra = nbytes / _MIN_BANDWIDTH
        if extra <= self._timeout_s / 4:
            return self._client
        step = 2.0 ** math.ceil(math.log2(extra))  # seconds: values of one size share a client
        with self._cond:
            client = self._setters.get(step)
            if client is None:
                client = self._setters[step] = self._new_client(self._timeout_s + step)
            return client

    def _answers(self) -> bool:
        """Without the lock: whether the server answers a PING (after a write timed out:
        a server that answers is no outage, the write alone failed).  A PING bounded by
        the timeout: a paused server costs a write that timed out one timeout more."""
        try:
            self._client.ping()
        except self._errors:
            return False
        except Exception:  # noqa: BLE001 - refused (an ACL without PING): it answered
            return True
        return True

    def _write_guarded(self, job: WriteJob, *, inline: bool) -> bool | None:
        """:meth:`_write_job` that never raises: a bug (an exception the client's error
        handling does not cover) loses this block, counted, and never leaves it pending
        (inline, it escaped ``put`` and the block stayed in memory outside every budget)."""
        try:
            return self._write_job(job, inline=inline)
        except Exception:  # noqa: BLE001 - a bug must not stop the writer with jobs queued
            _log.exception("KV block store: a Redis write failed")
            with self._cond:
                if self._writing.get(job.key) is job.held:
                    del self._writing[job.key]
                    self._write_errors += 1
            return False

    def _write_behind(self) -> None:
        """The background writer: deletes, then queued jobs in order; exits when idle."""
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    if not self._deletes and not self._wipe:
                        self._cond.wait(timeout=1.0)
                    elif not self._reachable():  # deletes wait for the server
                        assert self._down_until is not None
                        self._cond.wait(max(0.01, self._down_until - time.monotonic()))
                    elif not self._wipe and time.monotonic() < self._deletes_until:  # refused: back off
                        self._cond.wait(max(0.01, self._deletes_until - time.monotonic()))
                deletes: list[str] = []
                marks: dict[str, tuple[int, str, int]] = {}
                deletable = self._reachable() and time.monotonic() >= self._deletes_until
                if self._deletes and (deletable or self._closed):
                    deletes, self._deletes = self._deletes, []
                    marks = {n: self._delete_if.pop(n) for n in deletes if n in self._delete_if}
                    self._claim(deletes)
                wipe = self._wipe and self._reachable() and not self._closed
                self._wipe = self._wipe and not wipe and not self._closed
                if not self._queue and not deletes and not wipe:
                    if (self._deletes or self._wipe) and not self._closed:
                        continue  # waits above: for the server, or the refusal's back-off
                    self._writer = None
                    return
                job = self._queue[0] if self._queue else None
            self._delete_now(deletes, marks=marks)
            if wipe:
                self._wipe_server()
            if job is None:
                continue
            try:
                self._write_guarded(job, inline=False)
            finally:
                with self._cond:
                    self._queue.popleft()
                    self._queue_bytes -= job.held.meta.nbytes
                    self._cond.notify_all()

    def _delete_later(self, *names: str) -> None:
        """Under the lock: have the writer thread delete these values (no I/O here)."""
        if not names or self._closed:
            return
        self._doomed.update(names)
        for name in names:  # removed here: whatever the server holds goes
            self._delete_if.pop(name, None)
        self._deletes.extend(names)
        self._start_writer()

    def _delete_now(self, names: list[str], *, marks: dict[str, tuple[int, str, int]] | None = None) -> None:
        """Delete values on the server (without the lock; never raises); the caller
        claimed ``names`` (:meth:`_claim`) under the lock, released here.  Names that
        cannot be deleted now stay doomed and go back to the writer, which retries once
        the server is back (with their ``marks``: see :meth:`_send_delete`): a value
        removed here is never indexed or served again."""
        marks = marks or {}
        if not names:
            return
        with self._cond:
            self._doomed.update(names)
            if not self._reachable():
                self._release(names)
                self._retry_deletes(names, marks)
                return
        try:
            self._send_delete(names, marks)
        except self._errors as exc:
            with self._cond:
                self._release(names)
                self._outage(exc)
                self._retry_deletes(names, marks)
            return
        except Exception as exc:  # noqa: BLE001 - refused, or a client bug
            with self._cond:
                self._release(names)
                # A server that refuses DEL (read-only replica, MISCONF, an ACL) answers
                # at once: retried without a pause, the writer spun at ~6,000 refusals a
                # second.  Retry after the back-off, and warn once until one succeeds.
                self._deletes_until = time.monotonic() + self._retry_s
                warn, self._delete_warned = not self._delete_warned, True
                self._retry_deletes(names, marks)
            if warn:
                _log.warning("KV block store: Redis refused a delete (%s); retried every %g s", exc, self._retry_s)
            return
        with self._cond:
            self._release(names)
            self._doomed.difference_update([n for n in names if n not in self._busy])  # others still on their way
            self._delete_warned = False

    def _send_delete(self, names: list[str], marks: dict[str, tuple[int, str, int]] | None) -> None:
        """Without the lock: DEL ``names``; those in ``marks`` (damaged values:
        :func:`_read_mark`) only while the server still holds what was read, since
        another engine may have SET a good value meanwhile (a script, its socket timeout
        scaled to the value as a SET's: the server hashes it).  A server that refuses
        scripts (an ACL without them, a proxy without EVAL) gets the plain DEL."""
        marked = list(dict.fromkeys(n for n in names if marks and n in marks))
        plain = [n for n in names if not marks or n not in marks]
        if plain:
            self._client.delete(*plain)
        if not marked:
            return
        assert marks is not None
        args = [x for n in marked for x in marks[n]]
        try:
            self._setter(max(marks[n][2] for n in marked)).eval(_DELETE_IF_UNCHANGED, len(marked), *marked, *args)
        except self._errors:
            raise
        except Exception as exc:  # noqa: BLE001 - scripts refused (NOPERM, unknown command) or else
            if not _refuses_scripts(exc):
                raise
            self._client.delete(*marked)

    def _delete_claimed(self, names: list[str], marks: dict[str, tuple[int, str, int]] | None = None) -> None:
        """Without the lock: DEL ``names``, claimed under it (:meth:`_claim`); the claims
        are released whatever the call did (its errors are the caller's to handle).
        ``marks``: see :meth:`_send_delete`."""
        try:
            if names:
                self._send_delete(names, marks)
        finally:
            with self._cond:
                self._release(names)

    def _wipe_server(self) -> None:
        """A clear's second half (writer thread, without the lock; never raises): delete
        every value of this fingerprint on the server except those this store indexed
        when the scan began or stored since the clear (or is storing).  An outage has
        it run again once the server is back; a close stops it."""
        cursor = 0
        with self._cond:  # one snapshot: rebuilt per page it held the store's lock for long
            keep = {record_key(self._fp, r.meta) for _, r in self._lru.items()}
        try:
            while not self._closed:
                cursor, names = self._client.scan(cursor, match=self._prefix + "*", count=500)
                if names:
                    with self._cond:
                        since = self._since_clear or set()
                        writing = {record_key(self._fp, held.meta) for held in self._writing.values()}
                        gone = [t for n in names if (t := n.decode()) not in keep and t not in since
                                and t not in writing and t not in self._busy]
                        self._claim(gone)  # a put of one of them from now on waits for this delete
                    # doomed until deleted: a refused DEL (an ACL, a read-only replica) is
                    # retried after the back-off, and no rescan indexes them meanwhile (a
                    # refusal ended the wipe, and the next rescan served them again)
                    self._delete_now(gone)
                    with self._cond:
                        if not self._reachable():  # an outage met by the delete: the wipe runs again
                            self._wipe = not self._closed
                            return
                if cursor == 0:
                    with self._cond:
                        if not self._wipe:  # no later clear waits for its own scan
                            self._since_clear = None
                            self._cond.notify_all()  # a listener waits for it to rescan
                    return
        except self._errors as exc:
            with self._cond:
                self._outage(exc)
                if not self._closed:
                    self._wipe = True
        except Exception as exc:  # noqa: BLE001 - refused, or a client bug
            _log.warning("KV block store: Redis refused the scan or delete of a clear (%s)", exc)
            with self._cond:
                if not self._wipe:  # the wipe is over (as far as it got): the listener may rescan
                    self._since_clear = None
                    self._cond.notify_all()

    def _retry_deletes(self, names: list[str], marks: dict[str, tuple[int, str, int]] | None = None) -> None:
        """Under the lock: have the writer delete ``names`` again later (those in
        ``marks`` still only while they hold what was read)."""
        if self._closed:
            return
        for name, mark in (marks or {}).items():
            if name in names:
                self._delete_if[name] = mark
        self._deletes.extend(names)
        self._start_writer()

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_behind, name="promptsplice-kv-redis-writer", daemon=True)
            self._writer.start()
        self._cond.notify_all()

    def drain(self) -> None:
        with self._cond:
            while self._queue:
                self._cond.wait()

    def wait_synced(self, timeout: float) -> bool:
        """Wait until the listener has scanned the server since it (re)connected."""
        return self._synced.wait(timeout)

    def close(self) -> None:
        """Finish queued writes (each bounded by the timeout), stop the threads.
        The server keeps the values.  Idempotent."""
        with self._cond:
            if self._closed:
                return
            while self._queue:
                self._cond.wait()
            self._closed = True
            self._lru.clear()
            self._writing.clear()
            self._cond.notify_all()
            writer = self._writer
        for thread in (writer, self._listener):
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        self._client.close()
        for client in self._setters.values():
            client.close()

    # ------------------------------------------------------ the listener thread

    def _listen(self) -> None:
        """Keep the index in step with the server: subscribe, scan, then apply the
        announcements; on an outage wait for the back-off and start again."""
        while True:
            with self._cond:
                # a clear's wipe first: a scan while it runs would index what it deletes
                while not self._closed and (not self._reachable() or self._since_clear is not None):
                    left = self._down_until - time.monotonic() if self._down_until is not None else 0.0
                    self._cond.wait(max(0.01, left) if not self._reachable() else 0.25)
                if self._closed:
                    return
            pubsub = None
            try:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
                recovered = self._rescan()  # after subscribing: nothing announced meanwhile is missed
                if recovered is None:
                    continue  # an outage or a clear came during the scan: wait out its back-off or wipe, scan again
                if recovered and self._on_back is not None:
                    self._on_back()  # the server may have come back empty
                # An outage seen by any call (a slow read, a failed write) forgot the
                # index: leave, wait out the back-off, subscribe and rescan again.
                while not self._closed and self._synced.is_set():
                    msg = pubsub.get_message(timeout=0.25)
                    if msg is not None and msg.get("type") == "message":
                        self._announced(msg["data"])
            except self._errors as exc:
                with self._cond:
                    if not self._closed:
                        self._outage(exc)
            except self._refusals as exc:  # e.g. "DB index is out of range": logged once, not each retry
                with self._cond:
                    if not self._closed:
                        self._outage(exc, refused=True)
            except Exception:  # noqa: BLE001 - a bug must not stop the index for good
                _log.exception("KV block store: the Redis listener failed")
                with self._cond:
                    self._down_until = time.monotonic() + self._retry_s
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # noqa: BLE001 - closing a broken connection
                        pass

    def _announced(self, data: bytes) -> None:
        """Index a block another store (or this one) announced."""
        try:
            header = fmt.parse_header(data)
        except ValueError:
            header = None
        with self._cond:
            if isinstance(header, fmt.Header) and header.fingerprint == self._fp and header.meta.namespace in NAMESPACES:
                self._index(header.meta, header.total_size)
            elif isinstance(header, fmt.Header) and header.fingerprint != self._fp:
                self._foreign += 1
            else:
                self._corrupt += 1

    def _drop_wrong_type(self, names: list[bytes]) -> None:
        """Keys under this tier's prefix that hold no string (a hash, a list): not
        values this tier can read; deleted (while still of another type) and counted
        damaged, as a damaged value is."""
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.type(name)
        kinds = pipe.execute(raise_on_error=False)
        doomed = [name for name, kind in zip(names, kinds) if not isinstance(kind, Exception) and not _is_value(kind)]
        if doomed:
            self._client.delete(*doomed)
            with self._cond:
                self._corrupt += len(doomed)
            _log.warning("promptsplice: deleted %d keys under %s that are not values of this tier "
                           "(another type: %s)", len(doomed), self._prefix, doomed[:3])

    def _rescan(self) -> bool | None:
        """Index every value of this fingerprint on the server (headers only), delete
        damaged ones (counted), then mark the index synced.  True when this ends an
        outage; ``None`` when an outage (seen by any call) came meanwhile: it forgot the
        index, so this scan's result is partial and the listener scans again; also when a
        ``clear`` came meanwhile (its pages read before the clear hold values the clear
        removes: indexed after it, they were served; the listener scans again once the
        clear's wipe of the server is over)."""
        with self._cond:
            if self._since_clear is not None:  # a clear came while the listener subscribed:
                return None  # its wipe first (the listener waits for it), then the scan
            recovered, self._lost_index = self._lost_index, False
            self._back()
            epoch, clears = self._outage_epoch, self._clears
        cursor = 0
        while not self._closed:
            cursor, names = self._client.scan(cursor, match=self._prefix + "*", count=500)
            if names:
                pipe = self._client.pipeline(transaction=False)
                for name in names:
                    pipe.getrange(name, 0, _HEAD_READ - 1)
                    pipe.strlen(name)
                # per-key errors as replies: one key of another type under the prefix (a
                # hash: WRONGTYPE) failed the whole scan, read as a refused scan, for good
                replies = pipe.execute(raise_on_error=False)
                bad = []
                found = []
                wrong_type = []
                for i, name in enumerate(names):
                    head, size = replies[2 * i], replies[2 * i + 1]
                    err = next((r for r in (head, size) if isinstance(r, Exception)), None)
                    if err is not None:
                        if not str(err).startswith("WRONGTYPE"):
                            raise err  # a refused read (an ACL), as before: the listener's outage
                        wrong_type.append(name)
                        continue
                    if not head:
                        continue  # gone meanwhile
                    problem = None
                    try:
                        header = fmt.parse_header(head)
                        if isinstance(header, int):
                            head = self._client.getrange(name, 0, header - 1)
                            if not head:
                                continue  # gone meanwhile
                            header = fmt.parse_header(head)
                    except ValueError as exc:
                        header, problem = None, str(exc)
                    if isinstance(header, fmt.Header):
                        if header.fingerprint != self._fp:
                            problem = "foreign"
                        elif header.total_size != size:
                            problem = f"{size} bytes, the header says {header.total_size}"
                        elif name.decode() != record_key(self._fp, header.meta):
                            problem = "key name does not match the header"
                    elif problem is None:
                        problem = "truncated header"
                    if problem is None:
                        assert isinstance(header, fmt.Header)
                        found.append(header)
                    else:
                        bad.append((name, problem, _read_mark(bytes(head), size)))
                with self._cond:
                    if self._outage_epoch != epoch or self._clears != clears:
                        self._lost_index = self._lost_index or recovered  # the next scan re-shares
                        return None
                    for header in found:
                        self._index(header.meta, header.total_size)
                    for _, problem, _ in bad:
                        if problem == "foreign":
                            self._foreign += 1
                        else:
                            self._corrupt += 1
                    # not one this store's SET overwrote since the read (see ``_busy``)
                    drop = {t: mark for name, _, mark in bad
                            if (t := name.decode()) not in self._busy and not self._indexes_name(t)}
                    self._claim(list(drop))
                # only while each still holds the bytes read (another engine may SET it)
                self._delete_claimed(list(drop), drop)
                if wrong_type:
                    self._drop_wrong_type(wrong_type)
            if cursor == 0:
                break
        with self._cond:  # with the outage check: one right after it cleared ``_synced`` again
            if self._outage_epoch != epoch or self._clears != clears:
                self._lost_index = self._lost_index or recovered
                return None
            self._synced.set()
            self._listen_refused = False  # a later refusal is news again
        return recovered


def _is_value(kind: Any) -> bool:
    return kind in (b"string", "string", b"none", "none")


def _refuses_scripts(exc: BaseException) -> bool:
    """Whether ``exc`` is a server's refusal of EVAL itself (an ACL without scripting, a
    proxy that has no EVAL), not an error the script met."""
    import redis

    if isinstance(exc, redis.exceptions.NoPermissionError):
        return True
    text = str(exc).lower()
    return isinstance(exc, redis.exceptions.ResponseError) and ("unknown command" in text or "noperm" in text)


def _redact(url: str) -> str:
    """``url`` without its credentials (the netloc's and a ``?password=``), for log lines
    and reprs."""
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:
        parts = parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[-1])
    if parts.query:
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        parts = parts._replace(query="&".join(
            f"{k}=***" if k.lower() in ("password", "username", "user") else f"{k}={v}" for k, v in query
        ))
    return urllib.parse.urlunsplit(parts)
