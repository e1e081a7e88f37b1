"""The store against other threads and fork(): a fork while a store is built, while
shared_store() opens a folder, while a store opens its disk tier, and close() racing
a second close(), shared_store() and a put (review of the store's concurrency, items
1-5).  Real files in tmp_path; a slow step (fsync, an index load, a write) is slowed
by monkeypatching, since a slow disk cannot be made on demand.  A forked child never
returns into pytest: it answers through a pipe and leaves with ``os._exit``."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from promptsplice.engine_adapters.store import _disk
from promptsplice.engine_adapters.store import _store
from promptsplice.engine_adapters.store._store import BlockStore, PutStatus, StoreConfig, shared_store
from promptsplice.errors import InputError

from .test_store import HIT_DISK, P, REC, SALT, kv, make_refs, record_files, wait_until


def config(folder, **kw) -> StoreConfig:
    """DRAM holds one block, so each put writes the previous one down."""
    base = dict(dram_bytes=P, disk_bytes=32 * REC, disk_dir=str(folder), fsync=False,
                write_behind_bytes=0, fingerprint="test-model/float32/16")
    base.update(kw)
    return StoreConfig(**base)


def in_thread(fn, timeout: float = 1.5) -> list:
    """``[result]`` of ``fn()`` run in a daemon thread, ``[]`` if it still blocks."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return out


def fork(child) -> tuple[int, int]:
    """Fork; the child runs ``child(w)`` (``w``: its end of a pipe) and exits.
    Returns ``(pid, r)``: read the child's answer from ``r``, then reap it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: never return into pytest
        code = 1
        try:
            signal.alarm(10)  # a hang here must not outlive the test
            os.close(r)
            child(w)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def answer(pid: int, r: int) -> bytes:
    """What the child wrote (until it exited), after reaping it."""
    with os.fdopen(r, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return out


def slow_index_load(monkeypatch, delay: float = 0.3):
    """Opening a folder takes ``delay`` (a folder of many records to index); returns
    the real step."""
    real = _disk.DiskTier._load_index

    def slow(self):
        time.sleep(delay)
        real(self)

    monkeypatch.setattr(_disk.DiskTier, "_load_index", slow)
    return real


def slow_fsync(monkeypatch, delay: float = 0.05) -> None:
    real = os.fsync

    def slow(fd):
        time.sleep(delay)
        real(fd)

    monkeypatch.setattr(os, "fsync", slow)


def test_a_store_built_while_a_fork_waits_for_a_lock_is_not_released_by_the_fork(monkeypatch):
    """Item 1: the after-fork hooks walked ``_LIVE`` again, so a store built while the
    fork waited for another store's lock was released without being locked: a
    RuntimeError mid-walk, and the stores after it stayed locked in the parent for
    good.  Now the build waits for the fork, and the hooks release what they took."""
    errors: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: errors.append(u.exc_value))
    old = [BlockStore(StoreConfig(dram_bytes=P)) for _ in range(8)]
    held = threading.Event()

    def hold():  # e.g. a stats() in progress: the fork waits for it
        with old[0]._cond:
            held.set()
            time.sleep(0.4)

    late: list[BlockStore] = []

    def build():  # another engine builds its store while the fork waits
        time.sleep(0.15)
        late.append(BlockStore(StoreConfig(dram_bytes=P)))

    holder = threading.Thread(target=hold)
    builder = threading.Thread(target=build)
    holder.start()
    held.wait()
    builder.start()

    def child(w):
        free = [s._cond.acquire(timeout=0.5) for s in old]
        os.write(w, b"ok" if all(free) else b"locked")

    pid, r = fork(child)
    in_child = answer(pid, r)
    holder.join()
    builder.join()
    locked = [s for s in old if not s._cond.acquire(timeout=0.05) or s._cond.release()]
    for s in locked:  # (left locked, they would hang the next fork)
        s._cond.release()
    assert (in_child, errors, locked) == (b"ok", [], [])
    assert len(late) == 1 and late[0] in _store._LIVE and late[0].stats().dram_blocks == 0


def test_a_fork_while_shared_store_opens_a_folder_leaves_the_child_shared_store(tmp_path, monkeypatch):
    """Item 2: the fork hooks did not cover ``_SHARED_LOCK``: a child forked while
    ``shared_store()`` opened a folder inherited it held, and its own
    ``shared_store()`` (and its exit's close) hung for good."""
    slow_index_load(monkeypatch)
    cfg = config(tmp_path / "kv")
    opener = threading.Thread(target=shared_store, args=(cfg,))
    opener.start()
    time.sleep(0.1)  # the folder is being indexed, under _SHARED_LOCK

    def child(w):
        got = in_thread(lambda: shared_store(StoreConfig(dram_bytes=P)).stats().dram_blocks)
        inherited = in_thread(lambda: shared_store(cfg)._lower)
        os.write(w, repr((got, inherited)).encode())

    pid, r = fork(child)
    assert answer(pid, r) == b"([0], [[]])"  # the inherited store keeps DRAM only
    opener.join()
    store = shared_store(cfg)
    assert len(store._lower) == 1
    store.close()


def _pending_writes(tmp_path, monkeypatch, n: int, *, shared: bool = False) -> tuple[StoreConfig, BlockStore]:
    """A store with ``n - 1`` blocks queued for a slow background writer."""
    cfg = config(tmp_path / "kv", write_behind_bytes=1 << 20, fsync=True)
    store = shared_store(cfg) if shared else BlockStore(cfg)
    slow_fsync(monkeypatch)
    for i, ref in enumerate(make_refs(n)):
        store.put(ref, kv(i), salt=SALT)  # each evicts the one before to the writer
    assert store.stats().pending_writes > 0
    return cfg, store


def test_a_second_close_returns_only_once_the_first_has_finished(tmp_path, monkeypatch):
    """Item 3: close() marked the store closed before its tiers drained: a second
    close() returned at once, with the writes still in flight."""
    _, store = _pending_writes(tmp_path, monkeypatch, 12)
    first = threading.Thread(target=store.close)
    first.start()
    assert wait_until(lambda: store.closed)
    store.close()
    assert len(record_files(tmp_path / "kv")) == 11  # every block the writer had queued
    first.join()


def test_shared_store_replaces_a_closing_store_only_once_it_has_let_the_folder_go(tmp_path, monkeypatch):
    """Item 3: shared_store() saw a closing store as closed and opened a new one on its
    folder, still locked: ConfigError."""
    cfg, store = _pending_writes(tmp_path, monkeypatch, 12, shared=True)
    closing = threading.Thread(target=store.close)
    closing.start()
    assert wait_until(lambda: store.closed)
    again = shared_store(cfg)
    assert again is not store and not again.closed
    assert again.stats().disk_blocks == 11
    closing.join()
    again.close()


def test_a_fork_while_a_store_opens_its_folder_leaves_the_folder_to_the_parent(tmp_path, monkeypatch):
    """Item 4: a child forked while a store opened its disk tier (the folder's lock
    taken, the store not yet known to the fork hooks) kept the lock's descriptor: the
    parent could not open the folder again after closing the store."""
    real_load = slow_index_load(monkeypatch)
    cfg = config(tmp_path / "kv")
    box: list[BlockStore] = []
    opener = threading.Thread(target=lambda: box.append(BlockStore(cfg)))
    opener.start()
    time.sleep(0.1)  # the folder is locked and being indexed
    go_r, go_w = os.pipe()

    def child(w):  # a worker started with fork, alive while the parent reopens
        os.close(go_w)
        os.write(w, b"up")
        os.read(go_r, 1)  # until the parent closes its end

    pid, r = fork(child)
    os.close(go_r)
    try:
        opener.join()
        monkeypatch.setattr(_disk.DiskTier, "_load_index", real_load)
        box[0].put(make_refs(1)[0], kv(0), salt=SALT)
        box[0].flush()
        box[0].close()
        again = BlockStore(cfg)  # ConfigError while the child held the lock
        assert again.stats().disk_blocks == 1
        again.close()
    finally:
        os.close(go_w)  # the child leaves
        assert answer(pid, r) == b"up"


def test_a_put_racing_close_has_its_write_down_done_before_the_folder_goes(tmp_path, monkeypatch):
    """Item 5: a put that planned a write-down, then lost the race to close(), found
    the tier closed: the evicted block was thrown away, not even counted.  close() now
    waits for the write-downs planned before it began."""
    store = BlockStore(config(tmp_path / "kv"))
    a, b = make_refs(2)
    store.put(a, kv(0), salt=SALT)
    real_write = _disk.DiskTier.write

    def slow_write(self, job):
        time.sleep(0.3)  # the put has planned the write-down and let the lock go
        return real_write(self, job)

    monkeypatch.setattr(_disk.DiskTier, "write", slow_write)
    put = []
    putting = threading.Thread(target=lambda: put.append(store.put(b, kv(1), salt=SALT)))  # evicts a
    putting.start()
    time.sleep(0.1)
    store.close()
    assert len(record_files(tmp_path / "kv")) == 1  # a was written before close returned
    putting.join()
    assert put == [PutStatus.STORED] and store.stats().dropped == 0
    monkeypatch.setattr(_disk.DiskTier, "write", real_write)
    again = BlockStore(config(tmp_path / "kv"))
    got = again.get(a, salt=SALT)
    assert got.status is HIT_DISK and torch.equal(got.payload, kv(0))
    again.close()


def test_a_put_after_close_began_is_refused_with_the_closed_store_error(tmp_path, monkeypatch):
    """Item 5: what close() refuses from its start: a put raises, never loses a block
    silently."""
    store = BlockStore(config(tmp_path / "kv", write_behind_bytes=1 << 20, fsync=True))
    slow_fsync(monkeypatch)
    refs = make_refs(4)
    for i, ref in enumerate(refs[:3]):
        store.put(ref, kv(i), salt=SALT)
    closing = threading.Thread(target=store.close)
    closing.start()
    assert wait_until(lambda: store.closed)
    try:
        store.put(refs[3], kv(3), salt=SALT)
        raised = False
    except InputError as exc:
        raised = "closed" in str(exc)
    closing.join()
    assert raised and len(record_files(tmp_path / "kv")) == 2


def test_a_child_forked_mid_put_or_mid_close_can_close_its_copy(tmp_path, monkeypatch):
    """The child has none of the parent's threads: a put's write-down or a close()
    running there at the fork never finishes in the child, so its close() must not
    wait for them (it waited for good)."""
    store = BlockStore(config(tmp_path / "kv"))
    a, b = make_refs(2)
    store.put(a, kv(0), salt=SALT)
    real_write = _disk.DiskTier.write

    def slow_write(self, job):
        time.sleep(0.6)
        return real_write(self, job)

    monkeypatch.setattr(_disk.DiskTier, "write", slow_write)
    putting = threading.Thread(target=store.put, args=(b, kv(1)), kwargs={"salt": SALT})
    putting.start()
    time.sleep(0.1)  # the put runs its write-down, outside the lock

    def mid_put(w):
        os.write(w, repr(in_thread(store.close)).encode())

    pid, r = fork(mid_put)
    assert answer(pid, r) == b"[None]"
    closing = threading.Thread(target=store.close)  # waits for the put's write-down
    closing.start()
    assert wait_until(lambda: store.closed)

    def mid_close(w):
        os.write(w, repr((in_thread(store.close), store._lower)).encode())

    pid, r = fork(mid_close)
    assert answer(pid, r) == b"([None], [])"
    putting.join()
    closing.join()
    assert len(record_files(tmp_path / "kv")) == 1
