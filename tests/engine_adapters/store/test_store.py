"""The tiered KV block store: DRAM and disk tiers on real files in tmp_path, no mocks
except the one ENOSPC error path (a full disk cannot be made on demand here).

Blocks are real chain-hash blocks (``chain_refs``: 16 tokens each, salted chain) with a
float32 payload of ``[layers=2, 2, 16, 4]`` = 1024 bytes, so budgets below are exact
multiples of blocks (DRAM) and of record files (disk).
"""

from __future__ import annotations

import errno
import gc
import logging
import math
import os
import random
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptsplice.engine_adapters.store import _disk
from promptsplice.engine_adapters.store import _format as fmt
from promptsplice.engine_adapters.store._store import (
    BlockRef,
    BlockStore,
    Lookup,
    LookupStatus,
    Namespace,
    PutStatus,
    StoreConfig,
    StoreStats,
    chain_refs,
    shared_store,
)
from promptsplice.blocks import content_digest, hash_block, root_hash, token_bytes
from promptsplice.errors import ConfigError, InputError, PromptspliceWarning

BS = 16
SALT = "tenant-a"
SHAPE = (2, 2, BS, 4)
P = 1024  # payload bytes of one block: 2*2*16*4 float32

STORE_LOGGER = "promptsplice.engine_adapters.store"  # the policy's and every tier's logs
HIT_DRAM, HIT_DISK = LookupStatus.HIT_DRAM, LookupStatus.HIT_DISK
MISS, MISMATCH, CORRUPT = LookupStatus.MISS, LookupStatus.MISMATCH, LookupStatus.CORRUPT


def make_refs(n: int, salt=SALT, start: int = 1000) -> list[BlockRef]:
    return chain_refs(list(range(start, start + n * BS)), BS, salt=salt)


def kv(i: int, dtype=torch.float32, shape=SHAPE) -> torch.Tensor:
    """Payload of block ``i``: distinct, exactly representable values."""
    return (torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) % 256 + 1000 * i).to(dtype)


def rec_file_size(ref: BlockRef, salt=SALT, shape=SHAPE, dtype: str = "float32", ns: int = 0) -> int:
    """Bytes of one record file."""
    meta = fmt.BlockMeta(ns, ref.key, fmt.salt_bytes(salt), ref.parent, token_bytes(ref.tokens), shape, dtype)
    return fmt.record_size(meta)


UNIT = _disk.allocation_unit(tempfile.gettempdir())  # tmp_path's filesystem


def charged(nbytes: int) -> int:
    """What a file of ``nbytes`` costs the disk budget: rounded up to the allocation unit."""
    return -(-nbytes // UNIT) * UNIT


def rec_size(ref: BlockRef, salt=SALT, shape=SHAPE, dtype: str = "float32", ns: int = 0) -> int:
    """What one record costs the disk budget (``disk_bytes`` counts this)."""
    return charged(rec_file_size(ref, salt, shape, dtype, ns))


REC_FILE = rec_file_size(make_refs(1)[0])  # one record file: header + 1024 payload bytes + digest
REC = charged(REC_FILE)  # what it costs the budget


def rec_path(folder, ref: BlockRef, ns: int = 0):
    return folder / fmt.record_name(ns, ref.key)


def record_files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n != _disk.LOCK_NAME)


def disk_keys(store: BlockStore) -> list[tuple[int, bytes]]:
    """Keys the store's storage tiers hold, least recently used first."""
    return [k for tier in store._lower for k in tier.keys()]


def names(*refs: BlockRef) -> list[str]:
    return sorted(fmt.record_name(0, r.key) for r in refs)


def open_store(tmp_path, dram_blocks: int, disk_bytes: int = 0, **kw) -> BlockStore:
    """A store with ``dram_blocks`` blocks of DRAM; writes in the calling thread unless
    ``write_behind_bytes`` is given, so every call's effect on disk is exact."""
    disk = {"disk_bytes": disk_bytes, "disk_dir": str(tmp_path / "kv")} if disk_bytes else {}
    kw.setdefault("write_behind_bytes", 0)
    if disk_bytes:  # a folder with records refuses an empty fingerprint
        kw.setdefault("fingerprint", "test-model/float32/16")
    return BlockStore(StoreConfig(dram_bytes=dram_blocks * P, **disk, **kw))


def put_all(store: BlockStore, refs, salt=SALT, first: int = 0) -> list[PutStatus]:
    return [store.put(r, kv(first + i), salt=salt) for i, r in enumerate(refs)]


def status(store: BlockStore, ref: BlockRef, salt=SALT) -> LookupStatus:
    return store.get(ref, salt=salt).status


def test_sizes_the_tests_rely_on():
    assert kv(0).nbytes == P
    assert REC_FILE == 1024 + 16 + 256  # payload + record digest + header padded to 64 bytes
    assert make_refs(1)[0].parent == root_hash(SALT)


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dram_bytes": 0}, "dram_bytes must be a positive int"),
        ({"dram_bytes": True}, "dram_bytes must be a positive int"),
        ({"dram_bytes": 1.5}, "dram_bytes must be a positive int"),
        ({"dram_bytes": 10, "disk_bytes": -1}, "disk_bytes must be an int >= 0"),
        ({"dram_bytes": 10, "disk_bytes": 100}, "disk_bytes > 0 needs disk_dir"),
        ({"dram_bytes": 10, "disk_bytes": 100, "disk_dir": ""}, "disk_dir must be a folder path"),
        ({"dram_bytes": 10, "fingerprint": 3}, "fingerprint must be a str"),
        ({"dram_bytes": 10, "fsync": 1}, "fsync must be True or False"),
        ({"dram_bytes": 10, "disk_retry_s": -1}, "disk_retry_s must be a number"),
        # an infinite back-off turned the disk tier off for good after one failed write;
        # an infinite Redis timeout raised OverflowError in every call (never an outage)
        ({"dram_bytes": 10, "disk_retry_s": float("inf")}, "disk_retry_s must be a number of seconds from 0 to 86400"),
        ({"dram_bytes": 10, "remote_bytes": 1, "remote_url": "redis://h:1", "remote_timeout_s": float("inf")},
         "remote_timeout_s must be a number of seconds from 0 to 86400"),
        ({"dram_bytes": 10, "remote_bytes": 1, "remote_url": "redis://h:1", "remote_retry_s": 1e300},
         "remote_retry_s must be a number of seconds"),
        # raw UnicodeEncodeError / ValueError when the store opened
        ({"dram_bytes": 10, "fingerprint": "model\udc80"}, "fingerprint must be a str without lone surrogates"),
        ({"dram_bytes": 10, "disk_bytes": 100, "disk_dir": "/tmp/a\x00b"}, "disk_dir must be a folder path"),
        ({"dram_bytes": 10, "disk_bytes": 100, "disk_dir": __file__}, "exists and is not a folder"),
        # the client read /abc as database 0 and /1/2 as database 12
        ({"dram_bytes": 10, "remote_bytes": 1, "remote_url": "redis://h:1/abc"}, "remote_url names database 'abc'"),
        ({"dram_bytes": 10, "remote_bytes": 1, "remote_url": "redis://h:1/1/2"}, "remote_url names database '1/2'"),
    ],
)
def test_config_errors_say_how_to_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        StoreConfig(**kwargs)
    assert isinstance(info.value, ValueError)


def test_config_normalizes_the_folder_and_is_frozen(tmp_path):
    cfg = StoreConfig(dram_bytes=P, disk_bytes=REC, disk_dir=tmp_path / "a" / ".." / "kv")
    assert cfg.disk_dir == str(tmp_path / "kv")
    with pytest.warns(PromptspliceWarning, match="disk_bytes=0 turns the disk tier off"):  # was silent
        assert StoreConfig(dram_bytes=P, disk_bytes=0, disk_dir=tmp_path).disk_bytes == 0
    with pytest.raises(AttributeError):
        cfg.dram_bytes = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match="takes a StoreConfig"):
        BlockStore({"dram_bytes": P})  # type: ignore[arg-type]


def test_store_module_imports_neither_vllm_nor_torch():
    code = "import sys, promptsplice.engine_adapters.store; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "'vllm'" not in out
    assert "'torch'" not in out


# ------------------------------------------------------------------------ round trip


def test_put_get_round_trip_in_dram_keeps_bytes_shape_and_dtype():
    store = BlockStore(StoreConfig(dram_bytes=4 * P))
    ref = make_refs(1)[0]
    payload = kv(7, dtype=torch.bfloat16, shape=(3, 2, BS, 8))
    assert store.put(ref, payload, salt=SALT) is PutStatus.STORED
    payload.fill_(0)  # put copied it: the caller may reuse its buffer
    got = store.get(ref, salt=SALT)
    assert got.status is HIT_DRAM
    assert got.payload.dtype == torch.bfloat16
    assert got.payload.shape == (3, 2, BS, 8)
    assert torch.equal(got.payload, kv(7, dtype=torch.bfloat16, shape=(3, 2, BS, 8)))
    s = store.stats()
    assert (s.dram_blocks, s.dram_bytes) == (1, 3 * 2 * BS * 8 * 2)
    assert (s.dram_hits, s.dram_misses, s.disk_misses) == (1, 0, 0)
    assert s.disk_writable is False


def test_put_is_idempotent_and_a_different_block_never_replaces_a_key():
    store = BlockStore(StoreConfig(dram_bytes=4 * P))
    ref = make_refs(1)[0]
    assert store.put(ref, kv(1), salt=SALT) is PutStatus.STORED
    assert store.put(ref, kv(2), salt=SALT) is PutStatus.EXISTS  # same block: payload kept
    assert store.put(ref, kv(1).double(), salt=SALT) is PutStatus.MISMATCH  # other layout
    assert store.put(ref, kv(1), salt="tenant-b") is PutStatus.MISMATCH  # other salt, same key
    assert torch.equal(store.get(ref, salt=SALT).payload, kv(1))
    s = store.stats()
    assert (s.dram_blocks, s.dram_bytes, s.mismatches) == (1, P, 2)


def test_put_refuses_a_chain_key_that_is_not_the_chain_hash_and_bad_payloads():
    store = BlockStore(StoreConfig(dram_bytes=4 * P))
    a, b = make_refs(2)
    with pytest.raises(InputError, match="not the chain hash"):
        store.put(BlockRef(a.key, a.parent, b.tokens), kv(0), salt=SALT)
    with pytest.raises(InputError, match="16 bytes"):
        store.put(BlockRef(a.key[:8], a.parent, a.tokens), kv(0), salt=SALT)
    with pytest.raises(InputError, match="torch.Tensor"):
        store.put(a, [1.0, 2.0], salt=SALT)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="cannot be stored"):
        store.put(a, torch.zeros(4, dtype=torch.complex64), salt=SALT)
    with pytest.raises(InputError, match="token ids"):
        store.get(BlockRef(a.key, a.parent, [-1] * BS), salt=SALT)
    # refs read once: a ref that is an iterator, or whose tokens are one, was indexed (a
    # raw TypeError) or hashed used up ("not the chain hash") a second time
    assert store.put(iter((a.key, a.parent, a.tokens)), kv(0), salt=SALT) is PutStatus.STORED
    assert store.put(BlockRef(b.key, b.parent, iter(b.tokens)), kv(1), salt=SALT) is PutStatus.STORED
    with pytest.raises(InputError, match="owner must be hashable"):
        store.match_prefix([a], salt=SALT, owner=[1])
    # a tuple holding a list passes isinstance(.., Hashable): a raw TypeError came later
    with pytest.raises(InputError, match=r"owner must be hashable \(a request id\), got \(1, \[2\]\)"):
        store.match_prefix([a], salt=SALT, owner=(1, [2]))
    # True == 1 and 1.0 == 1: both were taken for Namespace.CONTENT, silently
    for bad in (True, 1.0):
        with pytest.raises(InputError, match=f"namespace must be a Namespace, got {bad!r}"):
            store.put(b, kv(1), salt=SALT, namespace=bad)
    assert store.stats().dram_blocks == 2
    import numpy as np  # a numpy int is an integer: still a namespace

    assert store.contains(b, salt=SALT, namespace=np.int64(0)) and not store.contains(b, salt=SALT, namespace=np.int64(1))


def test_disk_round_trip_after_dram_eviction(tmp_path):
    store = open_store(tmp_path, dram_blocks=2, disk_bytes=10 * REC)
    a, b, c = make_refs(3)
    assert put_all(store, [a, b, c]) == [PutStatus.STORED] * 3
    assert record_files(tmp_path / "kv") == names(a)  # a was written down when c came
    assert os.path.getsize(rec_path(tmp_path / "kv", a)) == REC_FILE
    got = store.get(a, salt=SALT)
    assert got.status is HIT_DISK
    assert got.payload.shape == SHAPE and got.payload.dtype == torch.float32
    assert torch.equal(got.payload, kv(0))
    s = store.stats()
    assert (s.disk_hits, s.dram_misses, s.disk_writes, s.dram_evictions) == (1, 1, 2, 2)


def test_dram_lru_evicts_exactly_the_least_recently_used():
    store = BlockStore(StoreConfig(dram_bytes=3 * P))
    a, b, c, d = make_refs(4)
    put_all(store, [a, b, c])
    assert status(store, a) is HIT_DRAM  # a is now the most recent: b is the LRU
    assert store.put(d, kv(3), salt=SALT) is PutStatus.STORED
    assert [status(store, r) for r in (a, b, c, d)] == [HIT_DRAM, MISS, HIT_DRAM, HIT_DRAM]
    s = store.stats()
    assert (s.dram_blocks, s.dram_bytes, s.dram_evictions, s.dropped) == (3, 3 * P, 1, 0)


def test_disk_lru_evicts_exactly_the_least_recently_used(tmp_path):
    # DRAM holds one block, disk two records (and a half): every put writes one down.
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=2 * REC + REC // 2)
    a, b, c = make_refs(3)
    put_all(store, [a, b, c])  # DRAM [c], disk [a, b]
    assert record_files(tmp_path / "kv") == names(a, b)
    # The disk hit on a makes it the disk's most recent record and promotes it into
    # DRAM, which writes c down: the disk must drop its LRU record, b.
    assert status(store, a) is HIT_DISK
    assert record_files(tmp_path / "kv") == names(a, c)
    assert [status(store, r) for r in (b, c)] == [MISS, HIT_DISK]
    s = store.stats()
    assert (s.disk_blocks, s.disk_bytes, s.disk_evictions, s.disk_writes) == (2, 2 * REC, 1, 3)
    assert (s.dram_blocks, s.dram_bytes) == (1, P)


def test_disk_hit_is_promoted_and_keeps_its_record(tmp_path):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    a, b = make_refs(2)
    put_all(store, [a, b])  # DRAM [b], disk [a]
    assert status(store, a) is HIT_DISK  # promoted: DRAM [a], b written down
    assert status(store, a) is HIT_DRAM
    writes = store.stats().disk_writes
    assert status(store, b) is HIT_DISK  # evicts a again: its record exists, no write
    assert store.stats().disk_writes == writes == 2
    assert record_files(tmp_path / "kv") == names(a, b)


def test_restart_serves_the_disk_blocks(tmp_path):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    a, b, c = make_refs(3)
    put_all(store, [a, b, c])  # disk [a, b], DRAM [c] (lost at restart)
    store.close()
    with pytest.raises(InputError, match="closed"):
        store.get(a, salt=SALT)
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    s = again.stats()
    assert (s.disk_blocks, s.disk_bytes, s.dram_blocks, s.corrupt) == (2, 2 * REC, 0, 0)
    assert again.match_prefix([a, b, c], salt=SALT) == 2
    got = again.get(b, salt=SALT)
    assert got.status is HIT_DISK and torch.equal(got.payload, kv(1))
    assert status(again, c) is MISS


def test_restart_keeps_the_disk_lru_order(tmp_path):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    a, b, c, d = make_refs(4)
    put_all(store, [a, b, c, d])  # disk [a, b, c] in write order
    assert status(store, a) is HIT_DISK  # disk order now [b, c, a] (+ d written down)
    store.close()
    # A smaller budget at the next open keeps the most recently used records: a and d.
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=2 * REC)
    assert record_files(tmp_path / "kv") == names(a, d)
    assert again.stats().disk_evictions == 2
    assert [status(again, r) for r in (a, b, c, d)] == [HIT_DISK, MISS, MISS, HIT_DISK]


def test_a_smaller_budget_on_a_folder_that_refuses_deletes_keeps_its_records(tmp_path, monkeypatch):
    """Each failed unlink moved a record from the index to the undeleted charge, so the
    sum never fell under the budget and the open unindexed every record (10 of 10
    evicted, none served), over the budget all the same."""
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=12 * REC)
    refs = make_refs(11)
    put_all(store, refs)  # 10 records on disk, the last block in DRAM
    store.close()

    unlink = os.unlink
    stuck = {str(rec_path(tmp_path / "kv", r)) for r in refs[:10]}  # every record, then one

    def refuse(path, *a, **k):
        if str(path) in stuck:
            raise PermissionError(errno.EACCES, "read-only", path)
        return unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", refuse)
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC)
    s = again.stats()
    assert (s.disk_blocks, s.disk_evictions) == (10, 0) and s.write_errors >= 1
    assert [status(again, r) for r in refs[:10]] == [HIT_DISK] * 10  # still served
    again.close()
    # only the oldest refuses (another user's file in a sticky folder): it is charged and
    # left for a later write to retry, the next ones evicted, and writes go on
    stuck = {str(rec_path(tmp_path / "kv", refs[0]))}
    third = open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC)
    s = third.stats()
    assert (s.disk_blocks, s.disk_evictions) == (7, 2)  # 7 records + 1 undeleted charged = 8
    assert [status(third, r) for r in refs[:3]] == [MISS, MISS, MISS] and status(third, refs[3]) is HIT_DISK
    third.close()


def test_flush_writes_dram_blocks_for_the_next_start(tmp_path):
    store = open_store(tmp_path, dram_blocks=4, disk_bytes=4 * REC)
    refs = make_refs(3)
    put_all(store, refs)
    assert record_files(tmp_path / "kv") == []
    assert store.flush() == 3
    assert store.flush() == 0
    assert store.stats().dram_blocks == 3  # still served from memory
    store.close()
    again = open_store(tmp_path, dram_blocks=4, disk_bytes=4 * REC)
    assert [status(again, r) for r in refs] == [HIT_DISK] * 3


def test_one_store_per_folder_and_shared_store(tmp_path):
    cfg = StoreConfig(dram_bytes=P, disk_bytes=REC, disk_dir=str(tmp_path))
    first = BlockStore(cfg)
    with pytest.raises(ConfigError, match="already used by another BlockStore"):
        BlockStore(cfg)
    first.close()
    one = shared_store(cfg)
    assert shared_store(cfg) is one
    one.close()
    two = shared_store(cfg)
    assert two is not one and not two.closed
    two.close()


def test_a_store_dropped_without_close_releases_its_folder_at_once(tmp_path):
    """Its tiers called back through bound methods, a cycle: the folder's lock stayed
    held until a garbage-collector cycle, and reopening the folder raised ConfigError.
    Dropped, it now closes as a file does (pending write-behinds finish) and warns."""
    refs = make_refs(3)
    gc.disable()  # the release must come from the drop itself, not from a collection
    try:
        store = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC, write_behind_bytes=8 * REC)
        put_all(store, refs)  # two write-downs queued behind
        with pytest.warns(ResourceWarning, match="unclosed BlockStore"):
            del store
        again = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    finally:
        gc.enable()
    assert [status(again, r) for r in refs] == [HIT_DISK, HIT_DISK, MISS]  # DRAM's block forgotten, as close()
    again.close()


def test_discard_and_clear_remove_records(tmp_path):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    a, b, c = make_refs(3)
    put_all(store, [a, b, c])
    assert store.discard(a.key) is True
    assert store.discard(a.key) is False
    assert record_files(tmp_path / "kv") == names(b)
    assert [status(store, r) for r in (a, c, b)] == [MISS, HIT_DRAM, HIT_DISK]
    store.clear()
    assert record_files(tmp_path / "kv") == []
    s = store.stats()
    assert (s.dram_blocks, s.dram_bytes, s.disk_blocks, s.disk_bytes) == (0, 0, 0, 0)
    assert status(store, c) is MISS


def test_a_block_cleared_while_it_is_read_is_not_promoted_back(tmp_path, monkeypatch):
    """A load from disk that a clear (reset_prefix_cache) overtakes: the caller gets the
    block (its read began first), but it was promoted into DRAM and served afterwards."""
    import threading

    store, a, _ = _evicted_to_disk(tmp_path)
    disk = store._lower[0]
    read = disk._read_record

    def read_then_clear(path, entry):
        out = read(path, entry)
        clearing = threading.Thread(target=store.clear)
        clearing.start()
        clearing.join(0.2)  # blocks on the store's lock until this read returns
        return out

    monkeypatch.setattr(disk, "_read_record", read_then_clear)
    assert status(store, a) is HIT_DISK
    monkeypatch.setattr(disk, "_read_record", read)
    assert wait_until(lambda: store.stats().disk_blocks == 0)
    assert not store.contains(a, salt=SALT) and status(store, a) is MISS
    assert store.stats().dram_blocks == 0


def wait_until(check, timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_empty_payload_is_refused_and_a_lazy_negative_view_is_stored_resolved(tmp_path):
    """A zero-element payload raised a raw torch RuntimeError from the copy; then it was
    stored, outside every budget (it took no bytes): 100,000 of them fit a 1 KiB DRAM
    tier, a review found (2026-12-07).  No KV block is empty: an InputError.  A lazy
    negative view (no raw bytes of its own) raised a raw RuntimeError: stored resolved."""
    store = open_store(tmp_path, dram_blocks=2, disk_bytes=4 * REC)
    a, b = make_refs(2)
    for empty in (torch.zeros((2, 0, BS, 4), dtype=torch.float16), torch.empty(0)):
        with pytest.raises(InputError, match="is empty: a block's KV has at least one element"):
            store.put(a, empty, salt=SALT)
    assert store.stats().dram_blocks == 0
    assert store.put(b, torch._neg_view(kv(1)), salt=SALT) is PutStatus.STORED
    assert torch.equal(store.get(b, salt=SALT).payload, -kv(1))


def test_a_block_hit_in_dram_stays_young_on_disk(tmp_path):
    """Its disk copy aged while DRAM served it: the hottest block's record was the first
    the disk evicted, and a restart lost exactly it (a review, 2026-12-07)."""
    store = open_store(tmp_path, dram_blocks=4, disk_bytes=3 * REC)
    hot, x1, x2, x3 = make_refs(4)
    put_all(store, [hot, x1])
    assert store.flush() == 2  # disk [hot, x1]
    for _ in range(3):
        assert status(store, hot) is HIT_DRAM
    put_all(store, [x2, x3], first=2)
    store.flush()  # one record too many: the disk's least recently used goes
    assert record_files(tmp_path / "kv") == names(hot, x2, x3)


def test_the_shared_stores_write_their_dram_blocks_down_at_exit(tmp_path, monkeypatch):
    """At interpreter exit (and when vLLM shuts the connector down) DRAM's blocks go to
    the disk tier: a restart serves the most recent blocks, not only those evicted
    before (until 2026-12-07 they were dropped)."""
    from promptsplice.engine_adapters.store import _store as store_module

    # the exit hook closes every shared store of the process: only this test's here (the
    # session's engines share theirs)
    monkeypatch.setattr(store_module, "_SHARED", {})
    cfg = StoreConfig(dram_bytes=8 * P, disk_bytes=8 * REC, disk_dir=str(tmp_path / "kv"),
                      write_behind_bytes=0, fingerprint="test-model/float32/16")
    store = shared_store(cfg)
    refs = make_refs(3)
    put_all(store, refs)
    assert record_files(tmp_path / "kv") == []
    store_module._close_shared_stores()
    assert store.closed
    again = BlockStore(cfg)
    try:
        assert [status(again, r) for r in refs] == [HIT_DISK] * 3
    finally:
        again.close()


def test_a_block_too_large_for_dram_goes_to_disk_or_is_rejected(tmp_path):
    big = kv(0, shape=(4, 2, BS, 4))  # 2 KiB > 1 KiB of DRAM
    ref = make_refs(1)[0]
    dram_only = BlockStore(StoreConfig(dram_bytes=P))
    assert dram_only.put(ref, big, salt=SALT) is PutStatus.REJECTED
    assert (dram_only.stats().dropped, dram_only.stats().dram_blocks) == (1, 0)
    tiered = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    assert tiered.put(ref, big, salt=SALT) is PutStatus.STORED
    assert status(tiered, ref) is HIT_DISK
    assert status(tiered, ref) is HIT_DISK  # not promoted: it cannot fit in DRAM
    assert tiered.stats().dram_blocks == 0


# ------------------------------------------------------------------- collision safety


def _other(ref: BlockRef, what: str) -> tuple[BlockRef, str]:
    """The same key with other tokens, parent or salt: what a hash collision looks like."""
    if what == "tokens":
        return BlockRef(ref.key, ref.parent, [t + 1 for t in ref.tokens]), SALT
    if what == "parent":
        return BlockRef(ref.key, root_hash("another chain"), ref.tokens), SALT
    return ref, "tenant-b"


@pytest.mark.parametrize("tier", ["dram", "disk"])
@pytest.mark.parametrize("what", ["tokens", "parent", "salt"])
def test_same_key_with_other_tokens_parent_or_salt_is_a_mismatch(tmp_path, tier, what):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    a, b = make_refs(2)
    put_all(store, [a, b])  # a on disk only, b in DRAM
    ref = a if tier == "disk" else b
    wrong, salt = _other(ref, what)
    got = store.get(wrong, salt=salt)
    assert got == Lookup(MISMATCH, None)
    assert store.contains(wrong, salt=salt) is False
    assert store.match_prefix([wrong], salt=salt) == 0
    s = store.stats()
    assert (s.mismatches, s.dram_hits, s.disk_hits) == (1, 0, 0)
    assert s.disk_misses == 1  # a tiered store's lookup no tier served (a DRAM mismatch ends it too)
    assert store.get(ref, salt=SALT).status is (HIT_DISK if tier == "disk" else HIT_DRAM)


def test_salts_isolate_whole_chains():
    store = BlockStore(StoreConfig(dram_bytes=8 * P))
    mine = make_refs(3, salt="tenant-a")
    theirs = make_refs(3, salt="tenant-b")  # same tokens, other chain
    put_all(store, mine, salt="tenant-a")
    assert [r.key for r in mine] != [r.key for r in theirs]
    assert store.match_prefix(theirs, salt="tenant-b") == 0
    assert store.match_prefix(mine, salt="tenant-b") == 0
    assert store.match_prefix(mine, salt=None) == 0
    assert store.match_prefix(mine, salt=b"tenant-a") == 0  # bytes salt != str salt
    assert store.match_prefix(mine, salt="tenant-a") == 3


@pytest.mark.parametrize("salt", ["", "bad\ud800", 5])
def test_a_salt_the_chain_hash_refuses_is_refused_by_the_store_too(salt):
    """One salt encoding (``blocks.salt_bytes``): the store took ``""`` (which vLLM reads
    as no salt), raised a bare UnicodeEncodeError for a lone surrogate and a TypeError
    for an int; each is now the chain hash's ``InvalidSaltError``, at every call."""
    from promptsplice.errors import InvalidSaltError

    store = BlockStore(StoreConfig(dram_bytes=8 * P))
    ref = make_refs(1)[0]
    with pytest.raises(InvalidSaltError):
        root_hash(salt)
    for call in (lambda: store.put(ref, kv(0), salt=salt), lambda: store.get(ref, salt=salt),
                 lambda: store.contains(ref, salt=salt), lambda: store.match_prefix([ref], salt=salt)):
        with pytest.raises(InvalidSaltError):
            call()
    assert store.stats().dram_blocks == 0


def test_content_namespace_finds_the_same_payload_by_another_key():
    store = BlockStore(StoreConfig(dram_bytes=8 * P))
    ref = make_refs(1)[0]
    content_key = content_digest(b"chunk/" + SALT.encode() + token_bytes(ref.tokens))
    by_content = BlockRef(content_key, bytes(16), ref.tokens)  # position-independent
    assert store.put(ref, kv(3), salt=SALT) is PutStatus.STORED
    assert store.put(by_content, kv(3), salt=SALT, namespace=Namespace.CONTENT) is PutStatus.STORED
    assert status(store, ref) is HIT_DRAM
    got = store.get(by_content, salt=SALT, namespace=Namespace.CONTENT)
    assert got.status is HIT_DRAM and torch.equal(got.payload, kv(3))
    assert store.get(by_content, salt=SALT).status is MISS  # key spaces are separate
    collision = BlockRef(content_key, bytes(16), [1] * BS)
    assert store.put(collision, kv(4), salt=SALT, namespace=Namespace.CONTENT) is PutStatus.MISMATCH
    assert store.get(collision, salt=SALT, namespace=Namespace.CONTENT).status is MISMATCH
    with pytest.raises(InputError, match="namespace"):
        store.get(ref, salt=SALT, namespace=7)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- faults


def _evicted_to_disk(tmp_path, **kw) -> tuple[BlockStore, BlockRef, object]:
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC, **kw)
    a, b = make_refs(2)
    put_all(store, [a, b])  # a is on disk only
    return store, a, rec_path(tmp_path / "kv", a)


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.reliability
def test_flipped_payload_byte_is_corrupt_deleted_and_counted(tmp_path):
    store, a, path = _evicted_to_disk(tmp_path)
    _flip(path, REC_FILE - 16 - 100)  # inside the payload
    assert store.match_prefix([a], salt=SALT) == 1  # index only: it reads no file
    assert store.get(a, salt=SALT) == Lookup(CORRUPT, None)
    assert not path.exists()
    s = store.stats()
    assert (s.corrupt, s.disk_blocks, s.disk_bytes, s.disk_misses, s.disk_hits) == (1, 0, 0, 1, 0)
    assert status(store, a) is MISS
    assert store.match_prefix([a], salt=SALT) == 0


@pytest.mark.reliability
def test_flipped_payload_byte_is_caught_after_a_restart_too(tmp_path):
    store, a, path = _evicted_to_disk(tmp_path)
    store.close()
    _flip(path, REC_FILE - 16 - 1)  # the last payload byte
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    assert again.stats().corrupt == 0  # the header is fine: opening reads only headers
    assert again.get(a, salt=SALT).status is CORRUPT
    assert (again.stats().corrupt, path.exists()) == (1, False)


@pytest.mark.reliability
def test_truncated_record_while_open_and_at_open(tmp_path):
    store, a, path = _evicted_to_disk(tmp_path)
    os.truncate(path, REC_FILE - 1)
    assert store.get(a, salt=SALT).status is CORRUPT
    assert (store.stats().corrupt, path.exists()) == (1, False)
    store.put(a, kv(0), salt=SALT)  # back in DRAM; b goes down
    b = make_refs(2)[1]
    path_b = rec_path(tmp_path / "kv", b)
    assert path_b.exists()
    store.close()
    os.truncate(path_b, REC_FILE // 2)
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    assert (again.stats().corrupt, again.stats().disk_blocks, path_b.exists()) == (1, 0, False)
    assert status(again, b) is MISS


@pytest.mark.parametrize(
    ("field", "value"),
    [("MAGIC", b"NOTAKVB\x00"), ("VERSION", 2)],
)
@pytest.mark.reliability
def test_record_with_wrong_magic_or_version_is_removed_at_open(tmp_path, monkeypatch, field, value):
    # A record written by "another format" (digests valid, only the field differs).
    with monkeypatch.context() as m:
        m.setattr(fmt, field, value)
        store, a, path = _evicted_to_disk(tmp_path)
        store.close()
    assert path.exists()
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    assert (again.stats().corrupt, again.stats().disk_blocks, path.exists()) == (1, 0, False)
    assert status(again, a) is MISS


@pytest.mark.reliability
def test_damaged_header_is_removed_at_open(tmp_path):
    store, a, path = _evicted_to_disk(tmp_path)
    store.close()
    _flip(path, 150)  # a token id inside the header: the header digest fails
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    assert (again.stats().corrupt, path.exists()) == (1, False)
    assert status(again, a) is MISS


@pytest.mark.reliability
def test_leftover_partial_writes_are_never_served(tmp_path):
    store, a, path = _evicted_to_disk(tmp_path)
    store.close()
    whole = path.read_bytes()
    b = make_refs(2)[1]
    # A process killed mid-write leaves a temporary file with part of a record...
    tmp_file = tmp_path / "kv" / fmt.temp_name(fmt.record_name(0, b.key), "1a2b3c")
    tmp_file.write_bytes(whole[: len(whole) // 2])
    # ...or, after a power loss, a renamed record whose data never reached the disk.
    path.write_bytes(whole[: len(whole) // 3])
    (tmp_path / "kv" / "notes.txt").write_text("not ours")
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC)
    assert again.stats().corrupt == 2
    assert record_files(tmp_path / "kv") == ["notes.txt"]  # other files are left alone
    assert [status(again, r) for r in (a, b)] == [MISS, MISS]


def test_records_of_another_fingerprint_are_not_served(tmp_path):
    store, a, path = _evicted_to_disk(tmp_path, fingerprint="SmolLM2-135M/bf16/32")
    store.close()
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=4 * REC, fingerprint="SmolLM2-360M/bf16/32")
    s = again.stats()
    assert (s.foreign, s.corrupt, s.disk_blocks, path.exists()) == (1, 0, 0, False)
    assert status(again, a) is MISS


def _disk_full(fd, data):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.reliability
def test_full_disk_keeps_serving_from_dram_with_one_warning(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path, dram_blocks=2, disk_bytes=10 * REC)
    a, b, c, d = make_refs(4)
    monkeypatch.setattr(_disk, "_write_all", _disk_full)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert put_all(store, [a, b, c]) == [PutStatus.STORED] * 3  # a's write-down fails
        assert store.put(d, kv(3), salt=SALT) is PutStatus.STORED  # writes paused: b dropped
    warnings = [r for r in caplog.records if "serving from DRAM only" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert [status(store, r) for r in (a, b, c, d)] == [MISS, MISS, HIT_DRAM, HIT_DRAM]
    s = store.stats()
    assert (s.write_errors, s.dropped, s.disk_writes, s.disk_blocks) == (1, 2, 0, 0)
    assert s.disk_writable is False
    assert record_files(tmp_path / "kv") == []  # no temporary file left behind


def test_disk_writes_resume_after_the_retry_interval(tmp_path, monkeypatch):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=10 * REC, disk_retry_s=0)
    a, b, c = make_refs(3)
    with monkeypatch.context() as m:
        m.setattr(_disk, "_write_all", _disk_full)
        put_all(store, [a, b])  # a lost
    store.put(c, kv(2), salt=SALT)  # b written: the disk has room again
    assert [status(store, r) for r in (a, b, c)] == [MISS, HIT_DISK, HIT_DISK]
    s = store.stats()
    assert (s.write_errors, s.dropped, s.disk_writes, s.disk_writable) == (1, 1, 2, True)


def _watch_fsyncs(monkeypatch, folder, writes=lambda: None) -> list[tuple[str, list[str], object]]:
    """Wrap the real ``os.fsync``: log each call as ("dir"|"file", the record files under
    their final names, ``writes()``) at that moment.  A power cut cannot be produced on
    demand; the order of what makes a record survive one can be checked."""
    real = os.fsync
    calls: list[tuple[str, list[str], object]] = []

    def fsync(fd: int) -> None:
        st_fd = os.fstat(fd)
        records = [n for n in record_files(folder) if fmt.parse_record_name(n)]
        if stat.S_ISDIR(st_fd.st_mode):
            assert st_fd.st_ino == os.stat(folder).st_ino  # the store's folder, no other
            calls.append(("dir", records, writes()))
        else:
            calls.append(("file", records, writes()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.mark.reliability
def test_each_rename_is_followed_by_a_folder_fsync_before_the_write_counts(tmp_path, monkeypatch):
    # A rename lives in the folder's entries: without an fsync of the folder, a power
    # cut may lose a record the store already counted as written.
    opened: list[BlockStore] = []
    calls = _watch_fsyncs(monkeypatch, tmp_path / "kv", lambda: opened[0].stats().disk_writes)
    opened.append(open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC))
    store = opened[0]
    a, b, c = make_refs(3)
    put_all(store, [a, b, c])  # a, then b written down
    store.drain()
    assert store.stats().disk_writes == 2
    # fsync the temporary file, rename it, fsync the folder; only then count the write
    assert calls == [
        ("file", [], 0),
        ("dir", names(a), 0),
        ("file", names(a), 1),
        ("dir", names(a, b), 1),
    ]
    assert store.flush() == 1  # c: the same steps
    assert calls[4:] == [("file", names(a, b), 2), ("dir", names(a, b, c), 2)]
    store.close()


@pytest.mark.reliability
def test_the_background_writer_commits_what_queued_meanwhile_with_one_folder_fsync(tmp_path, monkeypatch):
    # Group commit: while the writer is busy with a, the write-downs of b, c, d queue;
    # its next batch fsyncs each file, renames them, fsyncs the folder once, and only
    # then counts the three writes.
    opened: list[BlockStore] = []
    calls = _watch_fsyncs(monkeypatch, tmp_path / "kv", lambda: opened[0].stats().disk_writes)
    watched, gate, busy = os.fsync, threading.Event(), threading.Event()

    def fsync(fd: int) -> None:
        if not busy.is_set():  # the writer's first fsync (a's file) waits for the gate
            busy.set()
            assert gate.wait(30)
        watched(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    opened.append(open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC, write_behind_bytes=8 * P))
    store = opened[0]
    a, b, c, d, e = make_refs(5)
    put_all(store, [a, b])  # a written down: the writer starts and waits in a's fsync
    assert busy.wait(30)
    put_all(store, [c, d, e], first=2)  # b, c, d queue behind it
    gate.set()
    store.drain()
    assert store.stats().disk_writes == 4
    assert calls == [
        ("file", [], 0),
        ("dir", names(a), 0),
        ("file", names(a), 1),
        ("file", names(a, b), 1),
        ("file", names(a, b, c), 1),
        ("dir", names(a, b, c, d), 1),  # one folder fsync for the batch; then 4 writes
    ]
    store.close()


def test_no_fsync_at_all_when_the_config_says_so(tmp_path, monkeypatch):
    calls = _watch_fsyncs(monkeypatch, tmp_path / "kv")
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC, fsync=False)
    put_all(store, make_refs(3))
    assert (store.stats().disk_writes, calls) == (2, [])


def test_a_failed_folder_fsync_is_a_write_error_not_a_write(tmp_path, monkeypatch, caplog):
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    store = open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC, disk_retry_s=0)
    a, b, c = make_refs(3)
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        m.setattr(os, "fsync", fsync)
        put_all(store, [a, b])  # a renamed into place, its folder fsync fails
    assert len([r for r in caplog.records if "Input/output error" in r.getMessage()]) == 1
    s = store.stats()
    assert (s.write_errors, s.disk_writes, s.dropped, s.disk_blocks) == (1, 0, 0, 1)
    # The record is in place and verified on load like any other; the next write counts.
    assert status(store, a) is HIT_DISK and torch.equal(store.get(a, salt=SALT).payload, kv(0))
    store.put(c, kv(2), salt=SALT)
    assert store.stats().disk_writes == 1


def test_unusable_folder_means_dram_only_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store = BlockStore(StoreConfig(dram_bytes=P, disk_bytes=4 * REC, disk_dir=str(blocker / "kv")))
    assert len([r for r in caplog.records if "disk tier off" in r.getMessage()]) == 1
    a, b = make_refs(2)
    assert put_all(store, [a, b]) == [PutStatus.STORED] * 2
    assert [status(store, r) for r in (a, b)] == [MISS, HIT_DRAM]
    assert store.stats().disk_writable is False


# ------------------------------------------------------------------------ match_prefix


def test_match_prefix_counts_only_leading_valid_blocks(tmp_path):
    store = open_store(tmp_path, dram_blocks=2, disk_bytes=8 * REC)
    refs = make_refs(6)
    put_all(store, refs[:3])  # 0 on disk, 1-2 in DRAM
    store.put(refs[4], kv(4), salt=SALT)  # 3 missing
    before = store.stats()
    assert store.match_prefix(refs, salt=SALT) == 3
    assert store.match_prefix(refs[:2], salt=SALT) == 2
    assert store.match_prefix([], salt=SALT) == 0
    assert store.match_prefix(refs[1:], salt=SALT) == 2  # any list: counts from its start
    assert store.match_prefix(refs[3:], salt=SALT) == 0
    bad = [refs[0], _other(refs[1], "tokens")[0], refs[2]]
    assert store.match_prefix(bad, salt=SALT) == 1
    after = store.stats()
    assert (after.dram_hits, after.disk_hits, after.dram_misses, after.mismatches) == (
        before.dram_hits,
        before.disk_hits,
        before.dram_misses,
        before.mismatches,
    )  # a probe, not a load


def test_match_prefix_takes_salts_from_any_iterable_and_names_a_wrong_one(tmp_path):
    """``salts=`` as a generator was a TypeError (``len``), a str was read per character."""
    store = open_store(tmp_path, dram_blocks=4, disk_bytes=8 * REC)
    refs = make_refs(3)
    put_all(store, refs)
    assert store.match_prefix(refs, salts=(SALT for _ in refs)) == 3
    for bad in (SALT, 5):
        with pytest.raises(InputError, match="salts must be a sequence of salts"):
            store.match_prefix(refs, salts=bad)


def test_match_prefix_parses_a_long_query_outside_the_lock():
    """Refs were parsed (a lazy query's hashed) under the store's lock: a query of
    8,192 blocks held every put and get of the engine's workers ~20 ms."""
    store = BlockStore(StoreConfig(dram_bytes=64 * P))
    refs = make_refs(40)
    put_all(store, refs)
    other = make_refs(1, start=99_000)[0]
    waited = []

    def lazy():
        for i, ref in enumerate(refs):
            if i == 30:  # mid-query, from another thread: a worker's put
                t = threading.Thread(target=store.put, args=(other, kv(99)), kwargs={"salt": SALT}, daemon=True)
                started = time.monotonic()
                t.start()
                t.join(5.0)
                waited.append((t.is_alive(), time.monotonic() - started))
            yield ref

    assert store.match_prefix(lazy(), salt=SALT, owner="req") == 40
    assert waited and waited[0][0] is False and waited[0][1] < 5.0
    assert store.stats().pinned_blocks == 40
    assert status(store, other) is HIT_DRAM


def test_match_prefix_reads_no_ref_after_the_first_miss_even_in_a_batch():
    """Batched parsing raised on a bad ref (or salt) after the first miss, which the
    store had never read before."""
    store = BlockStore(StoreConfig(dram_bytes=8 * P))
    refs = make_refs(3)
    store.put(refs[0], kv(0), salt=SALT)
    assert store.match_prefix([refs[0], refs[1], ("bad",)], salt=SALT) == 1
    assert store.match_prefix(refs, salts=[SALT, SALT, 123]) == 1
    with pytest.raises(InputError, match="a block ref is"):
        store.match_prefix([refs[0], ("bad",)], salt=SALT)
    with pytest.raises(InputError):
        store.match_prefix(refs[:2], salts=[SALT, 123])


def test_match_prefix_ends_at_a_block_evicted_between_its_batches():
    """A block matched in an earlier batch and gone by the last one ends the count
    there: only the blocks before it are touched and pinned."""
    store = BlockStore(StoreConfig(dram_bytes=64 * P))
    refs = make_refs(40)
    put_all(store, refs)

    def lazy():
        for i, ref in enumerate(refs):
            if i == 20:  # the first batch (blocks 0-7) was matched already
                assert store.discard(refs[5].key) is True
            yield ref

    assert store.match_prefix(lazy(), salt=SALT, owner="req") == 5
    assert store.stats().pinned_blocks == 5
    assert store.release("req") == 5


def test_shared_store_names_a_config_that_is_not_a_store_config():
    """``shared_store({})`` was a TypeError (unhashable dict)."""
    for bad in ({}, None, "cfg"):
        with pytest.raises(ConfigError, match="shared_store takes a StoreConfig"):
            shared_store(bad)


def test_match_prefix_counted_blocks_load_unless_the_record_is_damaged(tmp_path):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC)
    a, b, c = make_refs(3)
    put_all(store, [a, b, c])  # a, b on disk
    assert store.match_prefix([a, b, c], salt=SALT, owner="req-1") == 3
    os.unlink(rec_path(tmp_path / "kv", b))  # removed behind the store's back
    # The load re-validates: a is served, b is reported missing so the caller recomputes.
    # (a is not promoted: the one DRAM slot holds c, pinned.)
    assert [status(store, r) for r in (a, b, c)] == [HIT_DISK, MISS, HIT_DRAM]
    assert store.release("req-1") == 3


def test_pinned_blocks_are_not_evicted_until_released():
    store = BlockStore(StoreConfig(dram_bytes=2 * P))
    a, b, c = make_refs(3)
    put_all(store, [a, b])
    assert store.match_prefix([a, b], salt=SALT, owner="req-1") == 2
    assert store.match_prefix([a, b], salt=SALT, owner="req-1") == 2  # asked again: same pins
    assert store.match_prefix([b], salt=SALT, owner="req-2") == 1
    assert store.stats().pinned_blocks == 2
    assert store.put(c, kv(2), salt=SALT) is PutStatus.REJECTED  # no room that is not pinned
    assert [status(store, r) for r in (a, b, c)] == [HIT_DRAM, HIT_DRAM, MISS]
    assert store.release("req-1") == 2
    assert store.release("req-1") == 0
    assert store.stats().pinned_blocks == 1  # b, by req-2
    assert store.put(c, kv(2), salt=SALT) is PutStatus.STORED  # evicts a, the unpinned one
    assert [status(store, r) for r in (a, b, c)] == [MISS, HIT_DRAM, HIT_DRAM]
    assert store.match_prefix([a], salt=SALT, owner="req-2") == 0  # re-asking drops b's pin
    assert store.stats().pinned_blocks == 0


def test_pinned_disk_records_stay_and_new_blocks_go_around_them(tmp_path):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=2 * REC)
    a, b, c, d = make_refs(4)
    put_all(store, [a, b, c])  # disk [a, b] (full), DRAM [c]
    assert store.match_prefix([a, b, c], salt=SALT, owner="req") == 3
    assert store.put(d, kv(3), salt=SALT) is PutStatus.REJECTED  # DRAM and disk pinned
    assert store.stats().dropped == 1
    assert [status(store, r) for r in (a, b, c)] == [HIT_DISK, HIT_DISK, HIT_DRAM]
    store.release("req")
    assert store.put(d, kv(3), salt=SALT) is PutStatus.STORED


# ------------------------------------------------------------------------ threads


@pytest.mark.reliability
def test_sixteen_threads_put_and_get_concurrently(tmp_path):
    store = open_store(tmp_path, dram_blocks=8, disk_bytes=16 * REC, fsync=False, write_behind_bytes=4 * P)
    refs = make_refs(48)
    errors: list[BaseException] = []
    wrong: list[int] = []
    gets = [0] * 16

    def work(t: int) -> None:
        rng = random.Random(t)
        try:
            for _ in range(150):
                i = rng.randrange(len(refs))
                op = rng.random()
                if op < 0.45:
                    store.put(refs[i], kv(i), salt=SALT)
                elif op < 0.9:
                    gets[t] += 1
                    got = store.get(refs[i], salt=SALT)
                    if got.status.hit and not torch.equal(got.payload, kv(i)):
                        wrong.append(i)
                elif op < 0.95:
                    store.match_prefix(refs[i : i + 4], salt=SALT, owner=t)
                    store.release(t)
                else:
                    store.stats()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and wrong == []
    store.drain()
    s = store.stats()
    assert s.dram_bytes == s.dram_blocks * P <= 8 * P
    assert s.disk_bytes == s.disk_blocks * REC <= 16 * REC
    files = record_files(tmp_path / "kv")
    assert len(files) == s.disk_blocks
    assert sum(charged(os.path.getsize(tmp_path / "kv" / f)) for f in files) == s.disk_bytes
    assert s.dram_hits + s.dram_misses == sum(gets)
    assert s.disk_hits + s.disk_misses == s.dram_misses
    assert (s.corrupt, s.mismatches, s.write_errors, s.pinned_blocks, s.pending_writes) == (0, 0, 0, 0, 0)
    present = [i for i, r in enumerate(refs) if store.contains(r, salt=SALT)]
    assert len(present) == len(set(store._dram.keys()) | set(disk_keys(store)))
    for i in present:  # pinned, every present block must load with its own payload
        assert store.match_prefix([refs[i]], salt=SALT, owner=("final", i)) == 1
    for i in present:
        assert torch.equal(store.get(refs[i], salt=SALT).payload, kv(i))


# ------------------------------------------------------------------ write-behind


def test_background_writer_serves_pending_blocks_and_ends_like_the_inline_one(tmp_path):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=2 * REC + REC // 2, write_behind_bytes=8 * P)
    a, b, c = make_refs(3)
    put_all(store, [a, b, c])  # a and b handed to the writer
    store.drain()
    assert store.stats().pending_writes == 0
    assert record_files(tmp_path / "kv") == names(a, b)
    # As in test_disk_lru_evicts_exactly_the_least_recently_used: the hit on a writes c
    # down, and the room for it is taken from b when the write is planned.
    assert status(store, a) is HIT_DISK
    got = store.get(c, salt=SALT)  # from memory while pending, else from its record
    assert got.status in (HIT_DRAM, HIT_DISK) and torch.equal(got.payload, kv(2))
    store.drain()
    assert record_files(tmp_path / "kv") == names(a, c)
    s = store.stats()
    assert (s.disk_writes, s.disk_blocks, s.disk_bytes) == (3, 2, 2 * REC)
    assert (s.disk_evictions, s.write_errors) == (1, 0)


def test_close_finishes_pending_writes_for_the_next_start(tmp_path):
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC, write_behind_bytes=8 * P)
    refs = make_refs(5)
    put_all(store, refs)  # four write-downs queued
    store.close()
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=8 * REC)
    assert again.stats().disk_blocks == 4
    assert again.match_prefix(refs, salt=SALT) == 4


@pytest.mark.reliability
def test_full_disk_on_the_background_writer(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path, dram_blocks=2, disk_bytes=10 * REC, write_behind_bytes=8 * P)
    a, b, c = make_refs(3)
    monkeypatch.setattr(_disk, "_write_all", _disk_full)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert put_all(store, [a, b, c]) == [PutStatus.STORED] * 3
        store.drain()
    assert len([r for r in caplog.records if "serving from DRAM only" in r.getMessage()]) == 1
    assert [status(store, r) for r in (a, b, c)] == [MISS, HIT_DRAM, HIT_DRAM]
    s = store.stats()
    assert (s.write_errors, s.dropped, s.disk_blocks, s.pending_writes) == (1, 1, 0, 0)
    assert record_files(tmp_path / "kv") == []


# ------------------------------------------------------------- model-based (hypothesis)


class _Model:
    """What must be present where: two byte-bounded LRU tiers, inclusive, no pins."""

    def __init__(self, dram_budget: int, disk_budget: int, psize: dict, rsize: dict) -> None:
        self.dram: OrderedDict[int, None] = OrderedDict()
        self.disk: OrderedDict[int, None] = OrderedDict()
        self.dram_budget, self.disk_budget = dram_budget, disk_budget
        self.psize, self.rsize = psize, rsize

    @staticmethod
    def _room(lru, size_of, budget, size):
        if size > budget:
            return None
        excess = sum(map(size_of, lru)) + size - budget
        victims = []
        for k in lru:
            if excess <= 0:
                break
            victims.append(k)
            excess -= size_of(k)
        return victims

    def _write(self, k) -> bool:
        if not self.disk_budget:
            return False
        victims = self._room(self.disk, self.rsize.__getitem__, self.disk_budget, self.rsize[k])
        if victims is None:
            return False
        for v in victims:
            del self.disk[v]
        self.disk[k] = None
        return True

    def _admit(self, k) -> bool:
        victims = self._room(self.dram, self.psize.__getitem__, self.dram_budget, self.psize[k])
        if victims is None:
            return False
        for v in victims:
            del self.dram[v]
            if v not in self.disk:
                self._write(v)
        self.dram[k] = None
        return True

    def _touch(self, k) -> bool:
        for tier in (self.dram, self.disk):
            if k in tier:
                tier.move_to_end(k)
                return True
        return False

    def put(self, k) -> PutStatus:
        if self._touch(k):
            return PutStatus.EXISTS
        return PutStatus.STORED if self._admit(k) or self._write(k) else PutStatus.REJECTED

    def get(self, k) -> LookupStatus:
        if k in self.dram:
            self.dram.move_to_end(k)
            return HIT_DRAM
        if k in self.disk:
            self.disk.move_to_end(k)
            self._admit(k)
            return HIT_DISK
        return MISS

    def match(self, ks) -> int:
        n = 0
        for k in ks:
            if k not in self.dram and k not in self.disk:
                break
            n += 1
        for k in ks[:n]:
            self._touch(k)
        return n


N_BLOCKS = 6
_OPS = st.one_of(
    st.tuples(st.just("put"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("get"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("get_other_tokens"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("discard"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("match"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("restart"), st.just(0)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.lists(st.integers(1, 3), min_size=N_BLOCKS, max_size=N_BLOCKS),
    dram_units=st.integers(1, 6),
    disk_recs=st.sampled_from([0, 1, 2, 3, 5]),
    write_behind=st.booleans(),
    ops=st.lists(_OPS, max_size=40),
)
def test_store_matches_a_two_tier_lru_model(layers, dram_units, disk_recs, write_behind, ops):
    """After every operation (and, with the background writer, once it drained) the
    store holds exactly the model's blocks in the model's LRU order, within budget."""
    refs = make_refs(N_BLOCKS)
    shapes = {i: (layers[i], 2, BS, 4) for i in range(N_BLOCKS)}  # 512 bytes per layer
    psize = {i: math.prod(shapes[i]) * 4 for i in range(N_BLOCKS)}
    rsize = {i: rec_size(refs[i], shape=shapes[i]) for i in range(N_BLOCKS)}
    dram_budget = dram_units * 512
    disk_budget = disk_recs * rec_size(refs[0], shape=(2, 2, BS, 4))
    model = _Model(dram_budget, disk_budget, psize, rsize)
    by_key = {r.key: i for i, r in enumerate(refs)}
    with tempfile.TemporaryDirectory() as folder:
        cfg = StoreConfig(
            dram_bytes=dram_budget,
            disk_bytes=disk_budget,
            disk_dir=folder if disk_budget else None,
            fsync=False,
            write_behind_bytes=2048 if write_behind else 0,
            fingerprint="test-model",
        )
        store = BlockStore(cfg)
        try:
            for op, i in ops:
                if op == "put":
                    assert store.put(refs[i], kv(i, shape=shapes[i]), salt=SALT) is model.put(i)
                elif op == "get":
                    got = store.get(refs[i], salt=SALT)
                    assert got.status is model.get(i)
                    if got.status.hit:
                        assert torch.equal(got.payload, kv(i, shape=shapes[i]))
                elif op == "get_other_tokens":
                    present = i in model.dram or i in model.disk
                    assert store.get(_other(refs[i], "tokens")[0], salt=SALT).status is (
                        MISMATCH if present else MISS
                    )
                elif op == "discard":
                    present = i in model.dram or i in model.disk
                    model.dram.pop(i, None)
                    model.disk.pop(i, None)
                    assert store.discard(refs[i].key) is present
                elif op == "match":
                    assert store.match_prefix(refs[i:], salt=SALT) == model.match(list(range(i, N_BLOCKS)))
                else:
                    store.close()
                    store = BlockStore(cfg)
                    model.dram.clear()
                store.drain()
                s = store.stats()
                assert [by_key[k] for _, k in store._dram.keys()] == list(model.dram)
                assert [by_key[k] for _, k in disk_keys(store)] == list(model.disk)
                assert s.dram_bytes == sum(psize[k] for k in model.dram) <= dram_budget
                assert s.disk_bytes == sum(rsize[k] for k in model.disk) <= disk_budget
                if disk_budget:
                    assert sorted(os.listdir(folder)) == sorted(
                        [_disk.LOCK_NAME] + [fmt.record_name(0, refs[k].key) for k in model.disk]
                    )
        finally:
            store.close()


def test_stats_is_a_named_tuple_of_counts():
    s = BlockStore(StoreConfig(dram_bytes=P)).stats()
    assert isinstance(s, StoreStats)
    assert s._fields[:4] == ("dram_blocks", "dram_bytes", "disk_blocks", "disk_bytes")
    assert hash_block(root_hash(SALT), make_refs(1)[0].tokens) == make_refs(1)[0].key


@pytest.mark.reliability
def test_a_salt_too_long_for_a_record_is_refused_at_put_and_costs_no_other_tenant(tmp_path):
    """The record keeps the salt's length in 16 bits: a put under a 70,000-byte salt (any
    client's cache_salt over vllm serve) failed its write-down, which paused the disk
    tier for every tenant (4 of 4 blocks of the next tenant dropped)."""
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=20 * REC, write_behind_bytes=0)
    long_salt = "x" * 70_000
    ref = make_refs(1, salt=long_salt)[0]
    with pytest.raises(InputError, match="a salt of 70000 bytes is over the 65534"):
        store.put(ref, kv(0), salt=long_salt)
    assert store.match_prefix([ref], salt=long_salt) == 0 and store.get(ref, salt=long_salt).status is MISS
    put_all(store, make_refs(4))
    st = store.stats()
    assert (st.disk_blocks, st.write_errors, st.dropped, st.disk_writable) == (3, 0, 0, True)
    store.close()


def test_a_record_that_cannot_be_encoded_is_lost_alone(tmp_path, monkeypatch):
    """An error that is not the disk's (a bug in encoding, memory) paused every disk write
    for disk_retry_s as if the disk had failed.  Such an error cannot be produced on
    demand, so the encoder raises here once."""
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=20 * REC, write_behind_bytes=0)
    real = fmt.encode_record
    calls = {"n": 0}

    def encode_once_broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("a bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(_disk.fmt, "encode_record", encode_once_broken)
    put_all(store, make_refs(4))
    st = store.stats()
    assert (st.write_errors, st.dropped, st.disk_blocks, st.disk_writable) == (1, 1, 2, True)
    store.close()


def test_close_waits_for_a_write_down_running_inline_in_another_thread(tmp_path, monkeypatch):
    """close() waited for the write-behind queue only: a block evicted by a put in another
    thread (written inline: no write-behind, or a block over write_behind_bytes) was
    thrown away mid-write and the folder released while it was still being written.  A
    busy disk cannot be made on demand, so fsync is slowed here."""
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=20 * REC, write_behind_bytes=0)
    refs = make_refs(2)
    store.put(refs[0], kv(0))
    real_fsync = os.fsync

    def slow_fsync(fd):
        time.sleep(0.4)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    evicting = threading.Thread(target=lambda: store.put(refs[1], kv(1)))  # evicts refs[0]: written inline
    evicting.start()
    time.sleep(0.1)
    store.close()
    # close returned after the write-down, not before: the record is in place already
    assert [f for f in os.listdir(tmp_path / "kv") if f.endswith(".kvb")]
    evicting.join(timeout=10)
    monkeypatch.setattr(os, "fsync", real_fsync)
    again = open_store(tmp_path, dram_blocks=1, disk_bytes=20 * REC)
    got = again.get(refs[0])
    assert got.status is HIT_DISK and torch.equal(got.payload, kv(0))
    again.close()


def test_a_discarded_block_takes_its_pins_with_it(tmp_path):
    """Pins outlived discard(): pinned_blocks counted a block that was gone, and a later
    block under the key could not be evicted until the old owner released."""
    store = open_store(tmp_path, dram_blocks=2)
    a, b, c = make_refs(3)
    put_all(store, [a])
    assert store.match_prefix([a], salt=SALT, owner="req-1") == 1 and store.stats().pinned_blocks == 1
    assert store.discard(a.key)
    assert store.stats().pinned_blocks == 0
    put_all(store, [a, b, c])  # a again, then two more into 2 blocks of DRAM: a (LRU) goes
    assert [store.get(r, salt=SALT).status for r in (a, b, c)] == [MISS, HIT_DRAM, HIT_DRAM]
    assert store.release("req-1") == 0


def test_a_read_the_process_cannot_make_now_is_a_miss_and_keeps_the_record(tmp_path, monkeypatch):
    """Out of file descriptors (EMFILE) the healthy record was deleted and counted as
    damaged.  The error is made by the process's limit, which a test cannot lower safely:
    open() raises it here once."""
    store = open_store(tmp_path, dram_blocks=1, disk_bytes=20 * REC)
    a, b = make_refs(2)
    put_all(store, [a, b])  # a is on disk only
    real_open = os.open
    calls = {"n": 0}

    def open_once_emfile(path, *args, **kwargs):
        if str(path).endswith(".kvb") and calls["n"] == 0:
            calls["n"] += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_once_emfile)
    assert store.get(a, salt=SALT).status is MISS
    assert store.stats().corrupt == 0 and store.stats().disk_blocks == 1
    got = store.get(a, salt=SALT)
    assert got.status is HIT_DISK and torch.equal(got.payload, kv(0))
    store.close()
