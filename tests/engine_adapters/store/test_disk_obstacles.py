"""The disk tier against what sits in its folder besides records, and against failing
metadata calls: FIFOs and folders at a record's path, a forked child's copy of the folder
lock, a reused folder without a fingerprint, tiny records, failing unlinks, a failing
folder fsync and a record the process may not read (review of 2026-12, items 1-7)."""

from __future__ import annotations

import errno
import os
import stat
import threading

import pytest
import torch

from promptsplice.engine_adapters.store import _disk
from promptsplice.engine_adapters.store import _format as fmt
from promptsplice.engine_adapters.store._store import BlockStore, LookupStatus, PutStatus, StoreConfig
from promptsplice.errors import ConfigError

from .test_store import P, REC, SALT, charged, kv, make_refs, record_files

HIT_DISK, MISS, CORRUPT = LookupStatus.HIT_DISK, LookupStatus.MISS, LookupStatus.CORRUPT


def config(folder, **kw) -> StoreConfig:
    """DRAM holds one block, so each put writes the previous one down (inline)."""
    base = dict(dram_bytes=P, disk_bytes=16 * REC, disk_dir=str(folder), fsync=False,
                write_behind_bytes=0, fingerprint="test-model/float32/16", disk_retry_s=30.0)
    base.update(kw)
    return StoreConfig(**base)


def path_of(folder, ref) -> str:
    return os.path.join(str(folder), fmt.record_name(0, ref.key))


def in_thread(fn, timeout: float = 5.0) -> list:
    """``[result]`` of ``fn()`` run in a daemon thread, ``[]`` if it still blocks."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return out


def test_a_fifo_or_a_symlink_at_a_record_path_never_blocks_a_load(tmp_path):
    """A FIFO where a record was hung ``get`` forever (open() waited for a writer)."""
    store = BlockStore(config(tmp_path / "kv"))
    a, b, c = make_refs(3)
    for i, r in enumerate((a, b, c)):
        store.put(r, kv(i), salt=SALT)  # a, b on disk, c in DRAM
    os.unlink(path_of(tmp_path / "kv", a))
    os.mkfifo(path_of(tmp_path / "kv", a))
    outside = tmp_path / "fifo"
    os.mkfifo(outside)
    os.unlink(path_of(tmp_path / "kv", b))
    os.symlink(outside, path_of(tmp_path / "kv", b))  # never followed
    got = in_thread(lambda: [store.get(r, salt=SALT).status for r in (a, b)])
    assert got == [[CORRUPT, CORRUPT]]
    assert store.stats().corrupt == 2 and record_files(tmp_path / "kv") == []
    assert stat.S_ISFIFO(os.lstat(outside).st_mode)  # what the link named is left alone
    store.close()


def test_a_fifo_at_a_record_path_never_blocks_the_open(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir()
    a, b = make_refs(2)
    os.mkfifo(path_of(folder, a))
    os.symlink("/dev/zero", path_of(folder, b))
    opened = in_thread(lambda: BlockStore(config(folder)))
    assert opened, "BlockStore() blocked on a FIFO in its folder"
    s = opened[0].stats()
    assert (s.corrupt, s.disk_blocks) == (2, 0) and record_files(folder) == []
    opened[0].close()


def test_a_folder_at_a_record_path_loses_that_record_only(tmp_path):
    """A folder at one record's path failed the rename (EISDIR), which paused every
    tenant's disk writes for ``disk_retry_s``."""
    folder = tmp_path / "kv"
    store = BlockStore(config(folder))
    a, b, c, d = make_refs(4)
    os.makedirs(path_of(folder, a))  # empty: cleared, the record takes its place
    os.makedirs(os.path.join(path_of(folder, b), "keep"))  # not ours to delete
    for i, r in enumerate((a, b, c, d)):
        assert store.put(r, kv(i), salt=SALT) is PutStatus.STORED
    s = store.stats()
    assert (s.disk_writes, s.write_errors, s.dropped, s.disk_writable) == (2, 1, 1, True)
    assert [store.get(r, salt=SALT).status for r in (a, b, c)] == [HIT_DISK, MISS, HIT_DISK]
    store.close()
    # at the next open the folder with files is counted once and left; nothing else lost
    again = BlockStore(config(folder))
    s = again.stats()
    assert (s.corrupt, s.disk_blocks) == (1, 3) and os.path.isdir(path_of(folder, b))
    again.close()


def test_a_forked_child_does_not_keep_the_folder_locked(tmp_path):
    """The child's copy of the lock descriptor kept the ``flock`` after the parent's
    close, so the parent could not reopen the folder while the child lived."""
    folder = tmp_path / "kv"
    store = BlockStore(config(folder))
    ref = make_refs(1)[0]
    store.put(ref, kv(0), salt=SALT)
    store.flush()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: lives until the parent closes the pipe
        try:
            os.close(hold_w)
            os.read(hold_r, 1)
        finally:
            os._exit(0)
    os.close(hold_r)
    try:
        store.close()
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # the child still lives (and holds its copy)
        again = BlockStore(config(folder))  # ConfigError while the child held the lock
        try:
            assert again.stats().disk_blocks == 1  # the reopened folder serves what was saved
        finally:
            again.close()
    finally:
        os.close(hold_w)
        os.waitpid(pid, 0)


def test_the_already_used_message_names_forked_children(tmp_path):
    store = BlockStore(config(tmp_path / "kv"))
    with pytest.raises(ConfigError, match="forked"):
        BlockStore(config(tmp_path / "kv"))
    store.close()


def test_an_empty_fingerprint_is_refused_on_a_folder_that_holds_records(tmp_path):
    """Without a fingerprint a folder reused by another model served its blocks (another
    dtype and shape under the same tokens)."""
    folder = tmp_path / "kv"
    with BlockStore(config(folder, fingerprint="")) as fresh:  # a fresh folder: allowed
        a = make_refs(1)[0]
        fresh.put(a, kv(0), salt=SALT)
        fresh.flush()
    assert len(record_files(folder)) == 1
    with pytest.raises(ConfigError, match="fingerprint is empty.*already holds 1 records"):
        BlockStore(config(folder, dram_bytes=1 << 20, fingerprint=""))
    BlockStore(config(folder, fingerprint="another-model")).close()  # named: foreign, dropped


def test_the_disk_budget_counts_whole_allocation_units(tmp_path):
    """3,000 records of a few hundred bytes used 12 MB of a 1 MiB budget."""
    folder = tmp_path / "kv"
    budget = 64 * 1024
    store = BlockStore(config(folder, dram_bytes=4, disk_bytes=budget))
    refs = make_refs(200)
    for i, r in enumerate(refs):
        store.put(r, kv(i, shape=(1, 1, 1, 1)), salt=SALT)
    s = store.stats()
    used = sum(os.stat(folder / f).st_blocks * 512 for f in record_files(folder))
    unit = _disk.allocation_unit(str(folder))
    assert s.disk_bytes == s.disk_blocks * unit <= budget
    assert used <= budget and s.disk_blocks == budget // unit
    store.close()


def _read_only_records(monkeypatch):
    """``os.unlink`` of a record fails as in a read-only folder; returns the undo."""
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if str(path).endswith(".kvb"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    return lambda: monkeypatch.setattr(os, "unlink", real_unlink)


def test_an_eviction_whose_unlink_fails_keeps_the_record_indexed(tmp_path, monkeypatch):
    """In a read-only folder the victim was dropped from the index and counted as
    evicted although its file stayed: the index emptied, the folder did not."""
    folder = tmp_path / "kv"
    store = BlockStore(config(folder, disk_bytes=2 * REC))
    a, b, c, d = make_refs(4)
    for i, r in enumerate((a, b, c)):
        store.put(r, kv(i), salt=SALT)  # a, b on disk (full), c in DRAM
    undo = _read_only_records(monkeypatch)
    assert store.put(d, kv(3), salt=SALT) is PutStatus.STORED  # c's write-down needs a's room
    undo()
    s = store.stats()
    assert (s.disk_blocks, s.disk_bytes, s.disk_evictions, s.write_errors, s.dropped) == (2, 2 * REC, 0, 1, 1)
    assert len(record_files(folder)) == 2 and s.disk_writable is False
    assert [store.get(r, salt=SALT).status for r in (a, b)] == [HIT_DISK, HIT_DISK]
    store.close()


@pytest.mark.parametrize("how", ["discard", "clear"])
def test_a_removed_record_whose_unlink_fails_is_never_served_and_stays_charged(tmp_path, monkeypatch, how):
    """remove()/clear() dropped the index entry of a record whose file stayed: the
    folder then held bytes the budget no longer counted, and nothing deleted them."""
    folder = tmp_path / "kv"
    store = BlockStore(config(folder, disk_bytes=2 * REC))
    a, b, c, d, e = make_refs(5)
    for i, r in enumerate((a, b, c)):
        store.put(r, kv(i), salt=SALT)  # a, b on disk (full), c in DRAM
    undo = _read_only_records(monkeypatch)
    if how == "discard":
        assert store.discard(a.key) is True
    else:
        store.clear()
    undo()
    stuck = [a] if how == "discard" else [a, b]
    assert [store.get(r, salt=SALT).status for r in stuck] == [MISS] * len(stuck)
    s = store.stats()
    assert (s.disk_blocks, s.disk_bytes, s.write_errors) == (2 - len(stuck), 2 * REC, len(stuck))
    assert record_files(folder) == sorted(os.path.basename(path_of(folder, r)) for r in (a, b))
    # The next write-down deletes them first: no live record is evicted for their room.
    for i, r in enumerate((d, e)):
        store.put(r, kv(3 + i), salt=SALT)  # each put writes the DRAM block before it down
    # discard: c's write-down found a's room (no eviction), d's then evicted b (LRU);
    # clear: d's write-down, the first, found the whole budget free
    on_disk, evicted = ([c, d], 1) if how == "discard" else ([d], 0)
    s = store.stats()
    assert (s.disk_evictions, s.disk_blocks, s.disk_bytes) == (evicted, len(on_disk), len(on_disk) * REC)
    assert record_files(folder) == sorted(os.path.basename(path_of(folder, r)) for r in on_disk)
    assert [store.get(r, salt=SALT).status for r in stuck] == [MISS] * len(stuck)
    store.close()


def test_one_file_that_stays_undeletable_does_not_keep_the_others_charged(tmp_path, monkeypatch):
    """The retry stopped at the first remembered file that still failed, always the
    same one: a single undeletable file (say one another user made immutable) kept
    every other undeleted file in the folder and charged for good."""
    folder = tmp_path / "kv"
    store = BlockStore(config(folder, disk_bytes=2 * REC))
    a, b, c, d, e = make_refs(5)
    for i, r in enumerate((a, b, c)):
        store.put(r, kv(i), salt=SALT)  # a, b on disk (full), c in DRAM
    undo = _read_only_records(monkeypatch)
    assert store.discard(a.key) is True and store.discard(b.key) is True
    undo()
    real_unlink, stuck = os.unlink, path_of(folder, a)

    def unlink(path, *args, **kwargs):
        if str(path) == stuck:
            raise OSError(errno.EPERM, "Operation not permitted")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    for i, r in enumerate((d, e)):
        store.put(r, kv(3 + i), salt=SALT)  # each put writes the DRAM block before it down
    s = store.stats()
    # d's write-down retried a (failed); e's tried b first and freed d's room
    assert sorted(os.path.basename(f) for f in record_files(folder)) == sorted(
        os.path.basename(path_of(folder, r)) for r in (a, d))
    assert (s.disk_blocks, s.disk_bytes) == (1, 2 * REC)
    assert store.get(d, salt=SALT).status is HIT_DISK
    store.close()


def test_a_failed_folder_fsync_answers_as_the_index_says(tmp_path, monkeypatch):
    """The put said REJECTED while the record stayed indexed and was served."""
    store = BlockStore(config(tmp_path / "kv", fsync=True))
    a, b = make_refs(2)
    store.put(a, kv(0), salt=SALT)
    store.match_prefix([a], salt=SALT, owner="req")  # DRAM full and pinned: b goes straight down
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    status = store.put(b, kv(1), salt=SALT)
    monkeypatch.setattr(os, "fsync", real)
    got = store.get(b, salt=SALT)
    assert (status, got.status) == (PutStatus.STORED, HIT_DISK) and torch.equal(got.payload, kv(1))
    s = store.stats()
    assert (s.disk_writes, s.write_errors, s.dropped) == (0, 1, 0)
    store.close()


def test_a_record_the_process_may_not_read_is_a_miss_and_stays(tmp_path, monkeypatch):
    """EACCES on a load deleted the record and counted it as damaged."""
    folder = tmp_path / "kv"
    store = BlockStore(config(folder))
    a, b = make_refs(2)
    store.put(a, kv(0), salt=SALT)
    store.put(b, kv(1), salt=SALT)  # a on disk only
    real_open = os.open

    def denied(path, *args, **kwargs):
        if str(path).endswith(".kvb"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    assert store.get(a, salt=SALT).status is MISS
    monkeypatch.setattr(os, "open", real_open)
    s = store.stats()
    assert (s.corrupt, s.disk_blocks, s.disk_misses) == (0, 1, 1) and len(record_files(folder)) == 1
    got = store.get(a, salt=SALT)
    assert got.status is HIT_DISK and torch.equal(got.payload, kv(0))
    store.close()


def test_a_store_closed_before_a_fork_leaves_the_childs_descriptors_alone(tmp_path):
    """The fork hook closed a closed tier's folder descriptor again in the child: its
    number belonged to subprocess's pipes by then, so every ``Popen`` with a
    ``preexec_fn`` (which runs the fork hooks) failed with EBADF after a store closed."""
    import subprocess
    import sys

    store = BlockStore(config(tmp_path / "kv"))
    store.close()  # still referenced: the fork hook sees it
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, preexec_fn=lambda: None)
        assert out.stdout == b"ok\n"
    assert store.stats().disk_blocks == 0


def test_the_allocation_unit_is_capped_where_the_fragment_size_is_a_transfer_size(monkeypatch):
    """NFS reports its transfer size (often 1 MiB) as the fragment size: a 0.74 MB
    block record would have been charged 1 MiB (diff review)."""
    class Vfs:
        f_frsize = 1 << 20

    monkeypatch.setattr(_disk.os, "statvfs", lambda folder: Vfs())
    assert _disk.allocation_unit("/anywhere") == 1 << 16
    Vfs.f_frsize = 4096
    assert _disk.allocation_unit("/anywhere") == 4096
    Vfs.f_frsize = 0
    assert _disk.allocation_unit("/anywhere") == 4096


def test_records_are_the_owners_alone_and_a_folder_others_may_write_is_named(tmp_path, caplog):
    """Records (a tenant's salt, token ids and KV in the clear) were 0644 in a 0755
    folder: any local user could read them."""
    folder = tmp_path / "kv"
    store = BlockStore(config(folder))
    a, b = make_refs(2)
    store.put(a, kv(0), salt=SALT)
    store.put(b, kv(1), salt=SALT)  # a written down
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert [stat.S_IMODE(os.stat(folder / n).st_mode) for n in record_files(folder)] == [0o600]
    store.close()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with caplog.at_level("WARNING"):
        BlockStore(config(shared)).close()
    assert "writable by other users (mode 777)" in caplog.text


def test_a_damaged_record_whose_unlink_fails_stays_charged_until_a_write_deletes_it(tmp_path, monkeypatch):
    """get() of a damaged record whose unlink failed dropped it from the index and from
    the budget, while its file stayed: the folder then held more than ``disk_bytes``.
    Now it is charged as a removed record is, and the next write-down deletes it."""
    folder = tmp_path / "kv"
    store = BlockStore(config(folder, disk_bytes=2 * REC))
    a, b, c, d, e = make_refs(5)
    for i, r in enumerate((a, b, c)):
        store.put(r, kv(i), salt=SALT)  # a, b on disk (full), c in DRAM
    with open(path_of(folder, a), "r+b") as f:  # one payload byte flipped
        f.seek(os.path.getsize(path_of(folder, a)) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    undo = _read_only_records(monkeypatch)
    assert store.get(a, salt=SALT).status is CORRUPT
    undo()
    assert store.get(a, salt=SALT).status is MISS  # never served again
    s = store.stats()
    assert (s.disk_blocks, s.disk_bytes, s.corrupt, s.write_errors) == (1, 2 * REC, 1, 1)
    assert record_files(folder) == sorted(os.path.basename(path_of(folder, r)) for r in (a, b))
    for i, r in enumerate((d, e)):
        store.put(r, kv(3 + i), salt=SALT)  # c's write-down deletes a first, d's evicts b
    s = store.stats()
    assert (s.disk_evictions, s.disk_blocks, s.disk_bytes) == (1, 2, 2 * REC)
    assert record_files(folder) == sorted(os.path.basename(path_of(folder, r)) for r in (c, d))
    store.close()


def test_files_the_open_could_not_delete_stay_charged_until_a_write_deletes_them(tmp_path, monkeypatch):
    """Opening the folder deletes foreign records and temporary files; one whose unlink
    failed stayed in the folder outside the budget (nothing deleted it later)."""
    folder = tmp_path / "kv"
    with BlockStore(config(folder, fingerprint="another-model")) as other:
        a, b, c, d = make_refs(4)
        for i, r in enumerate((a, b, c)):
            other.put(r, kv(i), salt=SALT)  # a, b on disk
    tmp = folder / fmt.temp_name(fmt.record_name(0, c.key), "0123456789ab")
    tmp.write_bytes(b"x" * 100)  # a write cut short
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if str(path).endswith((".kvb", ".tmp")):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    store = BlockStore(config(folder))
    monkeypatch.setattr(os, "unlink", real_unlink)
    s = store.stats()
    assert (s.disk_blocks, s.foreign, s.corrupt, s.write_errors) == (0, 2, 1, 3)
    assert s.disk_bytes == 2 * REC + charged(100) and len(record_files(folder)) == 3
    store.put(c, kv(2), salt=SALT)
    store.put(d, kv(3), salt=SALT)  # c's write-down deletes them first
    s = store.stats()
    assert (s.disk_blocks, s.disk_bytes) == (1, REC)
    assert record_files(folder) == [os.path.basename(path_of(folder, c))]
    store.close()


@pytest.mark.reliability
def test_records_the_open_cannot_read_now_are_kept_not_deleted_as_damage(tmp_path, monkeypatch):
    """EMFILE (the process briefly out of descriptors) while a store opened its folder
    deleted every record as damaged, though a load treats the same error as a miss that
    keeps the record.  Now such a record stays in the folder, charged and not served,
    and the next open serves it; a write that needs room, or a clear, deletes it.
    (EMFILE is mocked: a real descriptor limit cannot be hit on demand without starving
    the test process.)"""
    folder = tmp_path / "kv"
    refs = make_refs(5)
    with BlockStore(config(folder)) as store:
        for i, ref in enumerate(refs):
            store.put(ref, kv(i), salt=SALT)
        store.flush()
    names = record_files(folder)
    assert len(names) == 5

    def emfile(path):
        raise OSError(errno.EMFILE, "Too many open files", path)

    monkeypatch.setattr(_disk, "_open_record", emfile)
    store = BlockStore(config(folder))
    monkeypatch.undo()
    s = store.stats()
    assert (s.corrupt, s.disk_blocks, s.disk_bytes) == (0, 0, 5 * REC) and record_files(folder) == names
    assert store.match_prefix(refs, salt=SALT) == 0 and store.get(refs[0], salt=SALT).status is MISS
    store.close()
    with BlockStore(config(folder, disk_bytes=5 * REC)) as store:  # the next open reads them
        assert store.stats().disk_blocks == 5
        got = store.get(refs[0], salt=SALT)
        assert got.status is HIT_DISK and torch.equal(got.payload, kv(0))

    monkeypatch.setattr(_disk, "_open_record", emfile)
    store = BlockStore(config(folder, disk_bytes=5 * REC))  # full: a write needs room
    monkeypatch.undo()
    new = make_refs(2, start=9000)
    for i, ref in enumerate(new):
        store.put(ref, kv(10 + i), salt=SALT)  # the second put writes the first down
    s = store.stats()
    assert (s.disk_blocks, s.disk_bytes, s.disk_evictions, s.corrupt) == (1, 5 * REC, 1, 0), s
    assert len(record_files(folder)) == 5
    store.clear()  # or the next open served cleared blocks
    assert record_files(folder) == [] and store.stats().disk_bytes == 0
    store.close()
