"""The disk tier of the block store: one checked record file per block, written behind.

A :class:`DiskTier` owns a folder: the record files (``_format``), their index (LRU by
last use, mirrored in the files' mtimes so a restart rebuilds it), the byte budget of
the files, and the background writer that carries out write-downs.  It keeps the
storage-tier contract of ``_tier``:

* Verified loads.  Opening the folder deletes temporary files and records whose header
  is wrong or whose size does not match it (counted in ``corrupt``), and records of
  another fingerprint (``foreign``); every load checks the whole record's xxh3-128
  digest and its header against the index, and a damaged record is deleted, counted and
  answered ``CORRUPT``.
* Durable writes.  A record is written to a temporary file in the folder, fsynced,
  renamed into place (atomic), and the folder is fsynced, so the rename itself survives
  a power cut; only then is it counted in ``writes``.  The writer commits in groups:
  one folder fsync covers every rename of the write-downs queued when it started.  A crash at any point leaves the
  old state, the whole record, or a ``.tmp`` file the next open deletes.
* Outages.  A failing write (``ENOSPC``, an unwritable folder) logs one warning per
  outage (re-armed by the next successful write), reports the block lost, and suspends
  writes for ``retry_s`` seconds (``writable`` false); reads go on.  A folder that
  cannot be created or opened leaves the store without a disk tier (:meth:`DiskTier.open`
  answers ``None`` with one warning).
* Non-blocking writes.  With ``write_behind_bytes`` > 0 write-downs queue for a
  background thread (an fsync costs about as much as recomputing the block) and are
  served from memory meanwhile; a caller waits only when that queue is full.  Disk room
  is reserved when a write *starts*, so records that finished before it count in the
  LRU exactly as if every write were inline.

One tier owns a folder (a ``flock`` on :data:`LOCK_NAME`).  Index methods run under the
store's lock; record reads, writes and fsyncs run outside it, so a slow fsync does not
stall lookups.  The metadata calls that keep the folder equal to the index do run under
it: the ``unlink`` of an evicted or removed record (done later, it could remove a
record of the same key renamed into place meanwhile), the ``utime`` that mirrors a hit
into the LRU order, and ``clear()``'s unlinks (about 25 us a record on a local disk:
5,000 records held the lock ~0.12 s; on a network folder these cost more).
"""

from __future__ import annotations

import logging
import errno
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from promptsplice.engine_adapters.store import _format as fmt
from promptsplice.engine_adapters.store._tier import (
    IndexedTier,
    StoredRecord,
    WriteJob,
    record_size,
    NAMESPACES,
    ByteLru,
    Fetched,
    Held,
    Key,
    Loaded,
    TierStats,
    never_pinned,
    new_condition,
)
from promptsplice.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import torch

__all__ = ["DiskTier", "LOCK_NAME"]

_log = logging.getLogger(__name__)

LOCK_NAME = ".promptsplice-store.lock"
_MISSING = "missing"
_BUSY = "busy"
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR})
"""Read errors of the process (descriptors, memory), not of the record: it stays
(it was deleted and counted as damaged)."""



def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (the one place record bytes hit the disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class DiskTier(IndexedTier):
    """Record files under one folder, at most ``budget`` bytes of them, LRU."""

    name = "disk"

    @classmethod
    def open(cls, folder: str, **kwargs: object) -> DiskTier | None:
        """The tier on ``folder``, or ``None`` (one warning) when the folder is unusable.

        Raises :class:`ConfigError` when another store holds the folder.
        """
        try:
            return cls(folder, **kwargs)  # type: ignore[arg-type]
        except OSError as exc:
            _log.warning("KV block store: disk tier off, cannot use folder %s (%s); DRAM only", folder, exc)
            return None

    def __init__(
        self,
        folder: str,
        *,
        budget: int,
        fingerprint: bytes,
        fsync: bool = True,
        fsync_dir: bool | None = None,
        retry_s: float = 30.0,
        write_behind_bytes: int = 0,
        cond: threading.Condition | None = None,
        pinned: Callable[[Key], bool] = never_pinned,
        on_lost: Callable[[Key, Held], None] | None = None,
    ) -> None:
        """Open ``folder`` (created if missing) and index its records.

        ``fingerprint``: digest of the writer's model and KV layout; ``fsync_dir``
        (default: ``fsync``) fsyncs the folder after each batch of renames.  ``cond`` is the
        store's lock, ``pinned`` says which keys eviction must skip, ``on_lost`` hears
        of every planned write-down that will not happen (all called under the lock).
        """
        self._lru: ByteLru[StoredRecord] = ByteLru(budget, record_size)
        self._fp = fingerprint
        self._fsync = fsync
        self._fsync_dir = fsync if fsync_dir is None else fsync_dir
        self._retry_s = retry_s
        self._limit = write_behind_bytes
        self._cond = cond if cond is not None else new_condition()
        self._pinned = pinned
        self._on_lost = on_lost
        self._writing: dict[Key, Held] = {}
        self._reserved = 0
        self._queue: deque[WriteJob] = deque()  # write-behind, head = being written
        self._queue_bytes = 0
        self._inline = 0  # write-downs running in callers' threads (no write-behind)
        self._writer: threading.Thread | None = None
        self._blocked_until: float | None = None
        self._warned = False
        self._tick = time.time_ns()
        self._closed = False
        self._evictions = self._writes = self._write_errors = self._corrupt = self._foreign = 0
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self._lock_file = open(os.path.join(folder, LOCK_NAME), "a+b")  # noqa: SIM115 - held open
        self._dir_fd = -1
        try:
            self._lock_folder(folder)
            self._dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            self._load_index()
        except BaseException:  # let the folder go: another store may use it
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
            self._lock_file.close()
            raise

    def _lock_folder(self, folder: str) -> None:
        if fcntl is None:  # pragma: no cover - not POSIX
            return
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"disk_dir {folder!r} is already used by another BlockStore (in this or "
                "another process): give each store its own folder, or share one store "
                "in a process with shared_store(config)"
            ) from None
        except OSError as exc:  # e.g. a filesystem without flock
            _log.warning("KV block store: cannot lock %s (%s); use it from one store only", folder, exc)

    # ------------------------------------------------------ index (under the lock)

    def touch(self, k: Key) -> bool:
        if k not in self._lru:
            return False
        # The file's mtime mirrors the LRU order, so a restart rebuilds it.
        self._lru.touch(k)
        t = self._next_tick()
        try:
            os.utime(self._path(k), ns=(t, t))
        except OSError:
            pass
        return True

    def put(self, k: Key, held: Held) -> WriteJob | None:
        """Plan a write-down; ``None`` (the block reported lost) when it can never fit
        or writes are suspended."""
        size = fmt.record_size(held.meta)
        if size > self._lru.budget or self._writes_blocked():
            self._lost(k, held)
            return None
        self._writing[k] = held
        return WriteJob(k, held, size)

    def remove(self, k: Key) -> bool:
        found = self._writing.pop(k, None) is not None
        if self._lru.pop(k) is not None:
            self._remove_file(self._path(k))
            found = True
        return found

    def clear(self) -> None:
        for k in self._lru:
            self._remove_file(self._path(k))
        self._lru.clear()
        self._writing.clear()

    def keys(self) -> Iterator[Key]:
        return iter(self._lru)

    @property
    def writable(self) -> bool:
        return not self._writes_blocked()

    def stats(self) -> TierStats:
        return self.base_stats()

    def _next_tick(self) -> int:
        self._tick = max(time.time_ns(), self._tick + 1)
        return self._tick

    def _writes_blocked(self) -> bool:
        return self._blocked_until is not None and time.monotonic() < self._blocked_until

    def _lost(self, k: Key, held: Held) -> None:
        if self._on_lost is not None:
            self._on_lost(k, held)

    def _reserve(self, job: WriteJob) -> bool:
        """Right before a write: make room (evicting LRU records) and reserve it."""
        if self._writing.get(job.key) is not job.held or self._closed:
            return False  # removed, cleared or closed meanwhile
        victims = None
        if not self._writes_blocked():
            victims = self._lru.victims(job.size, self._pinned, self._reserved)
        if victims is None:  # writes suspended, or the rest of the folder is pinned
            del self._writing[job.key]
            self._lost(job.key, job.held)
            return False
        for vk in victims:
            self._lru.pop(vk)
            self._evictions += 1
            self._remove_file(self._path(vk))
        self._reserved += job.size
        job.reserved = True
        return True

    def _finish(self, job: WriteJob, tmp: str | None, err: BaseException | None) -> bool:
        """Under the lock: rename the record into place and index it, or give up."""
        self._reserved -= job.size
        job.reserved = False
        current = self._writing.get(job.key) is job.held
        if current:
            del self._writing[job.key]
        if err is None and (tmp is None or not current or self._closed):
            if tmp is not None:
                self._remove_file(tmp)  # removed or cleared while it was being written
            return False
        if err is None:
            assert tmp is not None
            path = self._path(job.key)
            try:
                os.replace(tmp, path)
            except OSError as exc:
                self._remove_file(tmp)
                err = exc
            else:
                t = self._next_tick()
                try:
                    os.utime(path, ns=(t, t))
                except OSError:
                    pass
                self._lru.add(job.key, StoredRecord(job.held.meta, job.size))
                return True
        if current:
            self._lost(job.key, job.held)
        if isinstance(err, OSError):
            self._failed(err)
        else:  # this record could not be encoded (a bug, memory): lost, the disk is fine
            self._write_errors += 1
        return False

    def _failed(self, err: BaseException) -> None:
        """A write failed: count it, suspend writes, warn once per outage."""
        self._write_errors += 1
        self._blocked_until = time.monotonic() + self._retry_s
        if not self._warned:
            self._warned = True
            _log.warning(
                "KV block store: writing to %s failed (%s); serving from DRAM only, "
                "disk writes retried in %g s",
                self.folder,
                err,
                self._retry_s,
            )

    def _landed(self) -> None:
        self._writes += 1
        self._warned = False

    # ------------------------------------------------------ I/O (without the lock)

    def get(self, k: Key, entry: StoredRecord) -> Fetched:
        """Read and verify the record ``locate`` returned; a damaged one is deleted."""
        path = self._path(k)
        payload, problem = self._read_record(path, entry)
        with self._cond:
            current = self._lru.get(k) is entry
            if payload is None:
                if problem == _BUSY:  # out of file descriptors or memory: a miss, kept
                    return Fetched(Loaded.MISS)
                if current:
                    self._lru.pop(k)
                if problem == _MISSING:
                    return Fetched(Loaded.MISS)
                if current:
                    self._remove_file(path)
                    self._corrupt += 1
                    _log.warning("KV block store: deleted damaged record %s (%s)", path, problem)
                return Fetched(Loaded.CORRUPT)
            if current:
                self.touch(k)
        return Fetched(Loaded.HIT, payload)

    def write(self, job: WriteJob) -> bool | None:
        """Write inline (``True``/``False``), or queue for the writer (``None``); a
        caller waits while the queue is full, which keeps it FIFO and bounded."""
        size = job.held.meta.nbytes
        if not self._limit or size > self._limit:
            with self._cond:
                if self._closed:
                    if self._writing.get(job.key) is job.held:
                        del self._writing[job.key]
                    return False
                self._inline += 1  # close() waits for it (it lost the block and the lock)
            try:
                return self._write_job(job)
            finally:
                with self._cond:
                    self._inline -= 1
                    self._cond.notify_all()
        with self._cond:
            while self._queue and self._queue_bytes + size > self._limit and not self._closed:
                self._cond.wait()
            if self._closed:
                if self._writing.get(job.key) is job.held:
                    del self._writing[job.key]
                return False
            self._queue.append(job)
            self._queue_bytes += size
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_behind, name="promptsplice-kv-writer", daemon=True)
                self._writer.start()
            self._cond.notify_all()
        return None

    def drain(self) -> None:
        with self._cond:
            while self._queue:
                self._cond.wait()

    def close(self) -> None:
        """Finish queued write-downs, forget the index, release the folder (its records
        stay for the next open).  Idempotent."""
        with self._cond:
            if self._closed:
                return
            # evicted blocks were promised to the disk: finish them, queued or being
            # written in another thread (inline), before the folder is released
            while self._queue or self._inline:
                self._cond.wait()
            self._closed = True
            self._cond.notify_all()
            self._lru.clear()
            self._writing.clear()
            self._lock_file.close()
            os.close(self._dir_fd)
            writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join()

    def _write_job(self, job: WriteJob) -> bool:
        """One write-down inline: a batch of one."""
        return self._write_batch([job])[0]

    def _write_batch(self, jobs: list[WriteJob]) -> list[bool]:
        """Group commit: for each job reserve room, write and fsync the temporary file,
        rename it into place; then fsync the folder *once* for every rename of the batch,
        and only then count the records as written.  Per job: written or not."""
        renamed: list[int] = []
        for i, job in enumerate(jobs):
            with self._cond:
                if not self._reserve(job):
                    continue
            tmp: str | None = None
            err: BaseException | None = None
            try:
                tmp, err = self._write_temp(job)
            except Exception as exc:  # noqa: BLE001 - a bug must not lose the reservation
                _log.exception("KV block store: writing a record failed")
                err = exc
            with self._cond:
                if self._finish(job, tmp, err):
                    renamed.append(i)
        done = [False] * len(jobs)
        if not renamed:
            return done
        if self._fsync_dir:
            with self._cond:
                try:  # a duplicate: close() may close the tier's descriptor meanwhile
                    dir_fd = os.dup(self._dir_fd)
                except OSError as exc:
                    self._failed(exc)
                    return done
            err = None
            try:
                os.fsync(dir_fd)  # the renames reach the disk: only now are they written
            except OSError as exc:
                err = exc
            finally:
                os.close(dir_fd)
            if err is not None:
                with self._cond:
                    self._failed(err)  # the records stay indexed (verified on load), uncounted
                return done
        with self._cond:
            for i in renamed:
                self._landed()
                done[i] = True
        return done

    def _write_behind(self) -> None:
        """The background writer: writes what is queued, in order, one batch (one
        folder fsync) at a time; exits when idle."""
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(timeout=1.0)
                if not self._queue:
                    self._writer = None  # restarted by the next job; lets the tier be freed
                    return
                batch = list(self._queue)  # stays queued until done, so drain() waits for it
            self._write_batch(batch)
            with self._cond:
                for job in batch:
                    self._queue.popleft()
                    self._queue_bytes -= job.held.meta.nbytes
                self._cond.notify_all()

    def _write_temp(self, job: WriteJob) -> tuple[str, OSError | None]:
        import torch

        name = fmt.record_name(*job.key)
        tmp = os.path.join(self.folder, fmt.temp_name(name, secrets.token_hex(6)))
        payload = job.held.payload.reshape(-1).view(torch.uint8).numpy()
        data = fmt.encode_record(job.held.meta, memoryview(payload), self._fp)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, data)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self._remove_file(tmp)
            return tmp, exc
        return tmp, None

    def _read_record(self, path: str, entry: StoredRecord) -> tuple[torch.Tensor | None, str | None]:
        """Read and verify a whole record: ``(payload, None)`` or ``(None, reason)``."""
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry.size:
                    return None, f"{size} bytes, expected {entry.size}"
                buf = bytearray(size)
                view = memoryview(buf)
                got = 0
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        return None, f"truncated at {got} of {size} bytes"
                    got += n
        except FileNotFoundError:
            return None, _MISSING
        except OSError as exc:
            if exc.errno in _TRANSIENT:  # the process, not the record: keep it
                return None, _BUSY
            return None, f"read failed: {exc}"
        try:
            header, payload = fmt.decode_record(buf)
        except ValueError as exc:
            return None, str(exc)
        if header.meta != entry.meta or header.fingerprint != self._fp:
            return None, "header does not match the index"
        return payload, None

    def _load_index(self) -> None:
        """Rebuild the index from the folder: headers only, LRU order by mtime."""
        found: list[tuple[int, str, Key, StoredRecord]] = []
        with os.scandir(self.folder) as it:
            entries = list(it)
        for item in entries:
            name = item.name
            if fmt.is_temp_name(name):
                self._remove_file(item.path)
                self._corrupt += 1
                continue
            k = fmt.parse_record_name(name)
            if k is None:
                continue
            try:
                st = item.stat()
                header = _read_header(item.path)
                meta = header.meta
                if (meta.namespace, meta.key) != k or k[0] not in NAMESPACES:
                    raise ValueError("file name does not match the header")
                if st.st_size != header.total_size:
                    raise ValueError(f"{st.st_size} bytes, the header says {header.total_size}")
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                _log.warning("KV block store: deleted damaged record %s (%s)", item.path, exc)
                self._remove_file(item.path)
                self._corrupt += 1
                continue
            if header.fingerprint != self._fp:
                self._remove_file(item.path)
                self._foreign += 1
                continue
            found.append((st.st_mtime_ns, name, k, StoredRecord(meta, header.total_size)))
        found.sort(key=lambda f: (f[0], f[1]))
        for mtime, _, k, record in found:
            self._lru.add(k, record)
            self._tick = max(self._tick, mtime)
        while self._lru.used > self._lru.budget:  # the budget shrank since
            k, _ = self._lru.pop_lru()
            self._evictions += 1
            self._remove_file(self._path(k))

    def _path(self, k: Key) -> str:
        return os.path.join(self.folder, fmt.record_name(*k))

    @staticmethod
    def _remove_file(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("KV block store: could not delete %s: %s", path, exc)


def _read_header(path: str) -> fmt.Header:
    with open(path, "rb") as f:
        data = f.read(4096)
        header = fmt.parse_header(data)
        # A damaged count may claim gigabytes of header: never read past the file's end.
        if isinstance(header, int) and len(data) < header <= os.fstat(f.fileno()).st_size:
            data += f.read(header - len(data))
            header = fmt.parse_header(data)
    if isinstance(header, int):
        raise ValueError(f"truncated header ({len(data)} bytes)")
    return header
