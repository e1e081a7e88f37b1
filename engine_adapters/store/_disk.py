"""The disk tier of the block store: one checked record file per block, written behind.

Kept as one module (~860 lines): the index, the byte budget, the writer and the fault
handling all change one folder under one lock, and each fault rule (an obstacle at a
record's path, an unlink that fails, a failed folder fsync) has to keep the index, the
budget and the files in agreement at once.

A :class:`DiskTier` owns a folder: the record files (``_format``), their index (LRU by
last use, mirrored in the files' mtimes so a restart rebuilds it), the byte budget of
the files, and the background writer that carries out write-downs.  It keeps the
storage-tier contract of ``_tier``:

* Verified loads.  Opening the folder deletes temporary files and records whose header
  is wrong or whose size does not match it (counted in ``corrupt``), and records of
  another fingerprint (``foreign``); every load checks the whole record's xxh3-128
  digest and its header against the index, and a damaged record is deleted, counted and
  answered ``CORRUPT``.  Only regular files are read, never through a symlink and
  without blocking (a FIFO at a record's path hung the load and the open): anything else
  there is damage, removed when it can be (a folder only when empty).  A read the
  process may not make now (no descriptors, memory or permission) is a miss; the record
  stays.  At open too: such a record is kept (never deleted as damage), charged and not
  served until a later open reads it, and is the first deleted when a write needs room.
* Bounded in bytes of disk.  Each record is charged its size rounded up to the folder's
  allocation unit, so many small records cannot use more than ``budget`` of the folder.
  An eviction whose ``unlink`` fails (a read-only folder) keeps the record indexed,
  counts a write error and loses the write that needed the room.  A file the tier could
  not delete (a record ``remove()``, ``clear()`` or a damaged load let go, a temporary
  file) is never served again but stays charged (``bytes``; a write error) until a
  later write deletes it or writes over it; a restart before then indexes it again (the
  folder still holds it, verified as any record).
* Durable writes.  A record is written to a temporary file in the folder, fsynced,
  renamed into place (atomic), and the folder is fsynced, so the rename itself survives
  a power cut; only then is it counted in ``writes``.  The writer commits in groups:
  one folder fsync covers every rename of the write-downs queued when it started.  A crash at any point leaves the
  old state, the whole record, or a ``.tmp`` file the next open deletes.
* Outages.  A failing write (``ENOSPC``, an unwritable folder) logs one warning per
  outage (re-armed by the next successful write), reports the block lost, and suspends
  writes for ``retry_s`` seconds (``writable`` false); reads go on.  A rename that fails
  because of what sits at one record's path (a folder) loses that record only: a write
  error, no pause.  A failed folder fsync leaves the renamed records indexed and served
  (verified on load) but uncounted in ``writes``.  A folder that
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
import stat
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
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.EACCES, errno.EPERM})
"""Read errors of the process (descriptors, memory, permissions), not of the record:
a miss, and the record stays (a later read, or the LRU, deals with it); it is not
damage, so it is neither deleted nor counted ``corrupt``."""
_OBSTACLE = frozenset({errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR})
"""Rename errors about the destination (something not a record sits at one record's
path): that one record is lost, the folder is fine (the tier was paused for everyone)."""
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
"""How a record is opened for reading: a FIFO or device at a record's path cannot block
the open (it hung ``get`` and the store's constructor), and a symlink is not followed."""
_DEFAULT_UNIT = 4096
_LOCK_WAIT_S = 0.25


def _open_record(path: str) -> int:
    """A read descriptor of the regular file at ``path`` (see :data:`_OPEN_FLAGS`);
    ``ValueError`` when something else (FIFO, device, folder) sits there."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"not a regular file (mode {stat.filemode(mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def allocation_unit(folder: str) -> int:
    """The bytes a file in ``folder`` takes at least (its filesystem's fragment size,
    else 4096, and at most 64 KiB): a record is charged to the budget rounded up to it, so
    the budget bounds what the folder uses, not only the records' lengths (3,000 tiny
    records used 12 MB of a 1 MiB budget).  The cap: NFS reports its transfer size
    (often 1 MiB) as the fragment size, which would charge a 0.74 MB block 1 MiB."""
    try:
        unit = os.statvfs(folder).f_frsize
    except (OSError, AttributeError):
        unit = 0
    return min(unit, 1 << 16) if unit >= 512 else _DEFAULT_UNIT



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
        self._unit = _DEFAULT_UNIT
        self._lru: ByteLru[StoredRecord] = ByteLru(budget, self._charge)
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
        # files whose unlink failed (removed, cleared or damaged records, by key; temporary
        # files, by path): never served, still charged, deleted by a later write
        self._undeleted: dict[Key | str, int] = {}
        # records the open could not read now (kept, charged, not served: _keep_unread)
        self._unread: dict[Key, int] = {}
        self._undeleted_bytes = 0  # the bytes of both: files outside the index
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
        # Records hold tenants' token ids and KV in the clear: the folder and its files
        # are the owner's alone (0700/0600); a folder others may write to is named.
        os.makedirs(folder, mode=0o700, exist_ok=True)
        mode = os.stat(folder).st_mode
        if mode & 0o022:
            _log.warning(
                "KV block store: %s is writable by other users (mode %o), who could plant blocks "
                "that verify; use a folder only this user can write (chmod 700)", folder, stat.S_IMODE(mode),
            )
        self._unit = allocation_unit(folder)
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
        """Take the folder's ``flock``, or :class:`ConfigError` if another store holds it.

        A busy lock is retried for :data:`_LOCK_WAIT_S`: a child forked a moment ago
        holds a copy of a closing store's lock descriptor until its after-fork hook
        closes it (``BlockStore``'s ``_after_fork_in_child``)."""
        if fcntl is None:  # pragma: no cover - not POSIX
            return
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                break
            except OSError as exc:  # e.g. a filesystem without flock
                _log.warning("KV block store: cannot lock %s (%s); use it from one store only", folder, exc)
                return
        raise ConfigError(
            f"disk_dir {folder!r} is already used by another BlockStore (in this or "
            "another process, or a child forked from it without exec that still "
            "runs): give each store its own folder, or share one store in a process "
            "with shared_store(config)"
        )

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
        size = self._round(fmt.record_size(held.meta))  # what the folder will use
        if size > self._lru.budget or self._writes_blocked():
            self._lost(k, held)
            return None
        self._writing[k] = held
        return WriteJob(k, held, size)

    def remove(self, k: Key) -> bool:
        found = self._writing.pop(k, None) is not None
        if k in self._unread:
            self._drop_unread(k)
            found = True
        record = self._lru.pop(k)
        if record is not None:
            self._delete_record(k, record)
            found = True
        return found

    def clear(self) -> None:
        for k in list(self._unread):  # or the next open served a cleared block
            self._drop_unread(k)
        for k, record in list(self._lru.items()):
            self._delete_record(k, record)
        self._lru.clear()
        self._writing.clear()

    def _delete_record(self, k: Key, record: StoredRecord) -> None:
        """Unlink a record already out of the index; one that stays on disk (a
        read-only folder) is remembered, charged, and deleted by a later write."""
        if self._remove_file(self._path(k)) is not None:
            self._keep_charged(k, self._charge(record))

    def _left_behind(self, item: Key | str) -> None:
        """Under the lock: the file of ``item`` (a record's key or a temporary file's
        path) out of the index could not be deleted: charged at its size, as a removed
        record is (:meth:`_delete_record`), or the folder outgrew the budget.  A folder
        at a record's path is not ours (see :meth:`_remove_obstacle`) and is not charged."""
        try:
            st = os.lstat(self._undeleted_path(item))
        except OSError:  # gone meanwhile
            return
        if not stat.S_ISDIR(st.st_mode):
            self._keep_charged(item, self._round(st.st_size))

    def _keep_charged(self, item: Key | str, charge: int) -> None:
        """Under the lock: remember a file whose unlink failed (a write error): never
        served, charged, deleted by the next write (:meth:`_retry_undeleted`)."""
        self._write_errors += 1
        self._undeleted_bytes += charge - self._undeleted.get(item, 0)
        self._undeleted[item] = charge

    def _undeleted_path(self, item: Key | str) -> str:
        return item if isinstance(item, str) else self._path(item)

    def _retry_undeleted(self) -> None:
        """Delete remembered files until one still fails (a read-only folder fails
        them all: one syscall per write, not one per file).  The failing one moves to
        the back, so a file that alone stays undeletable does not keep the others
        charged for good."""
        for item in list(self._undeleted):
            try:
                os.unlink(self._undeleted_path(item))
            except FileNotFoundError:
                pass
            except OSError:
                self._undeleted[item] = self._undeleted.pop(item)  # the next write tries the others first
                return
            self._forget_undeleted(item)

    def _forget_undeleted(self, item: Key | str) -> None:
        """Under the lock: the file of ``item`` is gone or written over (an unread
        record's too: see :meth:`_keep_unread`)."""
        for charges in (self._undeleted, self._unread):
            charge = charges.pop(item, None)  # type: ignore[call-overload]
            if charge is not None:
                self._undeleted_bytes -= charge

    def _keep_unread(self, k: Key, path: str) -> None:
        """Under the lock, at open: a record the process could not read now (out of
        descriptors or memory, no permission: :data:`_TRANSIENT`) is not damage: kept
        in the folder, never served, charged at its size (the budget holds), and
        deleted first when a write needs room (a delete needs no read), or by a
        ``remove``/``clear`` of it; the next open indexes it again."""
        try:
            charge = self._round(os.lstat(path).st_size)
        except OSError:  # gone meanwhile
            return
        self._undeleted_bytes += charge - self._unread.get(k, 0)
        self._unread[k] = charge

    def _evict_unread(self, size: int) -> None:
        """Under the lock: delete unread records (:meth:`_keep_unread`) until ``size``
        more bytes fit or none is left; counted as evictions."""
        while self._unread and self._lru.used + self._reserved + self._undeleted_bytes + size > self._lru.budget:
            self._evictions += 1
            if not self._drop_unread(next(iter(self._unread))):
                return  # still on disk (a folder that refuses deletes): the next write retries

    def _drop_unread(self, k: Key) -> bool:
        """Under the lock: delete ``k``'s unread record; False when its file stays (then
        remembered as undeleted: charged, deleted by a later write)."""
        charge = self._unread.pop(k)
        self._undeleted_bytes -= charge
        if self._remove_file(self._path(k)) is not None:
            self._keep_charged(k, charge)
            return False
        return True

    def keys(self) -> Iterator[Key]:
        return iter(self._lru)

    @property
    def writable(self) -> bool:
        return not self._writes_blocked()

    def stats(self) -> TierStats:
        stats = self.base_stats()
        if self._undeleted_bytes:
            stats = stats._replace(bytes=stats.bytes + self._undeleted_bytes)
        return stats

    def _round(self, size: int) -> int:
        """``size`` bytes of file rounded up to the folder's allocation unit."""
        return -(-size // self._unit) * self._unit

    def _charge(self, record: StoredRecord) -> int:
        """What a record costs the budget: its file's bytes, allocation unit rounded."""
        return self._round(record.size)

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
            if self._undeleted:
                self._retry_undeleted()
            self._evict_unread(job.size)
            victims = self._lru.victims(job.size, self._pinned, self._reserved + self._undeleted_bytes)
        if victims is None:  # writes suspended, or the rest of the folder is pinned
            del self._writing[job.key]
            self._lost(job.key, job.held)
            return False
        for vk in victims:
            err = self._remove_file(self._path(vk))
            if err is not None:  # still on disk (a read-only folder): still indexed and
                self._failed(err)  # charged; no eviction, no room, this write is lost
                del self._writing[job.key]
                self._lost(job.key, job.held)
                return False
            self._lru.pop(vk)
            self._evictions += 1
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
        if tmp is not None and (err is not None or not current or self._closed):
            # a failed write's partial file, or removed or cleared while being written
            if self._remove_file(tmp) is not None and not self._closed:
                self._left_behind(tmp)
        if err is None and (tmp is None or not current or self._closed):
            return False
        obstacle = False  # the rename failed because of what sits at the record's path
        if err is None:
            assert tmp is not None
            path = self._path(job.key)
            try:
                os.replace(tmp, path)
            except OSError as exc:
                if exc.errno in _OBSTACLE and self._remove_obstacle(path):
                    try:
                        os.replace(tmp, path)
                        exc = None
                    except OSError as again:
                        exc = again
                if exc is not None:
                    if self._remove_file(tmp) is not None:
                        self._left_behind(tmp)
                    err, obstacle = exc, exc.errno in _OBSTACLE
            if err is None:
                self._forget_undeleted(job.key)  # written over: its bytes are the new record's
                t = self._next_tick()
                try:
                    os.utime(path, ns=(t, t))
                except OSError:
                    pass
                self._lru.add(job.key, StoredRecord(job.held.meta, fmt.record_size(job.held.meta)))
                return True
        if current:
            self._lost(job.key, job.held)
        if obstacle:
            # something not a record sits at this record's path: this one record is
            # lost; pausing the tier would cost every tenant's writes
            self._write_errors += 1
            _log.warning("KV block store: cannot write record %s (%s); the block is lost", self._path(job.key), err)
        elif isinstance(err, OSError):
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
                    if not self._remove_obstacle(path):
                        self._left_behind(k)  # still in the folder: still charged
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
            self._dir_fd = -1  # its number may be reused: never closed again (a forked child's hook)
            writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join()

    def close_in_forked_child(self) -> None:
        """In a child of ``fork()``: let go of the folder without touching the parent's
        hold.  The child's copy of the lock descriptor shares the parent's open file
        description, and a ``flock`` lasts until every descriptor of it is closed, so a
        child that kept it blocked the parent from reopening the folder after its own
        close.  Closing (never unlocking: that would unlock the parent) drops the
        child's share; no thread of the tier exists here, so nothing else is waited for.
        A tier closed before the fork holds no descriptor: its numbers may belong to
        others by now (subprocess's error pipe: closing it failed every Popen with a
        ``preexec_fn`` after a store had closed)."""
        if self._closed:
            return
        self._closed = True
        self._queue.clear()
        self._writer = None
        self._lru.clear()
        self._writing.clear()
        try:
            self._lock_file.close()  # close(2) only: flock's LOCK_UN is never called
        except OSError:
            pass
        if self._dir_fd >= 0:
            try:
                os.close(self._dir_fd)
            except OSError:
                pass
            self._dir_fd = -1

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
                    return self._kept(done, renamed)
            err = None
            try:
                os.fsync(dir_fd)  # the renames reach the disk: only now are they written
            except OSError as exc:
                err = exc
            finally:
                os.close(dir_fd)
            if err is not None:
                with self._cond:
                    self._failed(err)
                return self._kept(done, renamed)
        with self._cond:
            for i in renamed:
                self._landed()
                done[i] = True
        return done

    @staticmethod
    def _kept(done: list[bool], renamed: list[int]) -> list[bool]:
        """The folder fsync failed: the renamed records stay indexed and served (verified
        on load), so their writes answer kept, as the index says; they are not counted
        in ``writes`` (a power cut may undo the renames)."""
        for i in renamed:
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
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, data)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            return tmp, exc  # its partial file: deleted by _finish, under the lock
        return tmp, None

    def _read_record(self, path: str, entry: StoredRecord) -> tuple[torch.Tensor | None, str | None]:
        """Read and verify a whole record: ``(payload, None)`` or ``(None, reason)``."""
        try:
            with open(_open_record(path), "rb", buffering=0) as f:
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
        except ValueError as exc:  # a FIFO, device or folder where the record was
            return None, str(exc)
        except OSError as exc:
            if exc.errno in _TRANSIENT:  # the process (or its rights), not the record: keep it
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
        unread: list[tuple[str, Key, OSError]] = []
        with os.scandir(self.folder) as it:
            entries = list(it)
        for item in entries:
            name = item.name
            if fmt.is_temp_name(name):
                if self._remove_file(item.path) is not None:
                    self._left_behind(item.path)
                self._corrupt += 1
                continue
            k = fmt.parse_record_name(name)
            if k is None:
                continue
            try:
                st = item.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):  # never opened: a FIFO would block
                    raise ValueError(f"not a regular file (mode {stat.filemode(st.st_mode)})")
                header = _read_header(item.path)
                meta = header.meta
                if (meta.namespace, meta.key) != k or k[0] not in NAMESPACES:
                    raise ValueError("file name does not match the header")
                if st.st_size != header.total_size:
                    raise ValueError(f"{st.st_size} bytes, the header says {header.total_size}")
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                if isinstance(exc, OSError) and exc.errno in _TRANSIENT:  # the process, not the record
                    unread.append((item.path, k, exc))
                    continue
                _log.warning("KV block store: deleting damaged record %s (%s)", item.path, exc)
                if not self._remove_obstacle(item.path):
                    self._left_behind(k)
                self._corrupt += 1
                continue
            if header.fingerprint != self._fp:
                if self._remove_file(item.path) is not None:
                    self._left_behind(k)
                self._foreign += 1
                continue
            found.append((st.st_mtime_ns, name, k, StoredRecord(meta, header.total_size)))
        found.sort(key=lambda f: (f[0], f[1]))
        for mtime, _, k, record in found:
            self._lru.add(k, record)
            self._tick = max(self._tick, mtime)
        for path, k, _ in unread:
            self._keep_unread(k, path)
        if unread:
            _log.warning(
                "KV block store: could not read %d records of %s now (%s); kept for the next open, "
                "not served until then", len(unread), self.folder, unread[0][2],
            )  # fmt: skip
        self._evict_unread(0)
        # The budget shrank since: evict LRU records.  One whose unlink fails leaves the
        # index for the undeleted charge (a later write retries it), so the sum does not
        # fall for it; when not one unlink succeeds (a folder that refuses deletes), the
        # records stay indexed and served rather than the whole index emptied.
        tried: list[tuple[Key, StoredRecord]] = []
        deleted = False
        for k, record in list(self._lru.items()):
            if self._lru.used + self._undeleted_bytes <= self._lru.budget:
                break
            self._lru.pop(k)
            err = self._remove_file(self._path(k))
            if err is None:
                deleted = True
                self._evictions += 1
            else:
                self._keep_charged(k, self._charge(record))
                tried.append((k, record))
        if tried and not deleted:
            for k, record in tried:  # back in the index, in their LRU order, uncharged
                self._undeleted_bytes -= self._undeleted.pop(k)
            rest = list(self._lru.items())
            self._lru.clear()
            for k, record in [*tried, *rest]:
                self._lru.add(k, record)
            self._failed(OSError(f"{len(tried)} records of {self.folder} could not be deleted to fit the budget"))

    def _path(self, k: Key) -> str:
        return os.path.join(self.folder, fmt.record_name(*k))

    @staticmethod
    def _remove_file(path: str) -> OSError | None:
        """Delete ``path``; the error when it is still there (``None``: gone)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("KV block store: could not delete %s: %s", path, exc)
            return exc
        return None

    @staticmethod
    def _remove_obstacle(path: str) -> bool:
        """Free a record's path of whatever sits there: a damaged record, a FIFO, a
        device or a symlink (``unlink``), an empty folder (``rmdir``); a folder with
        files stays (not ours to delete).  True when the path is free."""
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            _log.warning("KV block store: could not delete %s: %s", path, exc)
            return False
        return True


def _read_header(path: str) -> fmt.Header:
    with open(_open_record(path), "rb") as f:
        data = f.read(4096)
        header = fmt.parse_header(data)
        # A damaged count may claim gigabytes of header: never read past the file's end.
        if isinstance(header, int) and len(data) < header <= os.fstat(f.fileno()).st_size:
            data += f.read(header - len(data))
            header = fmt.parse_header(data)
    if isinstance(header, int):
        raise ValueError(f"truncated header ({len(data)} bytes)")
    return header
