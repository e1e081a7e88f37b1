"""The store's tiers on their own (``_tier``, ``_dram``, ``_disk``) and the policy over
more than one storage tier: real record files in tmp_path, no mocks.

Same blocks as ``test_store.py``: 16 tokens each, float32 payload ``[2, 2, 16, 4]`` =
1024 bytes.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from promptsplice.blocks import token_bytes
from promptsplice.engine_adapters.store import _format as fmt
from promptsplice.engine_adapters.store._disk import DiskTier
from promptsplice.engine_adapters.store._dram import DramTier
from promptsplice.engine_adapters.store._store import BlockStore, LookupStatus, PutStatus, StoreConfig
from promptsplice.engine_adapters.store._tier import (
    BlockMeta,
    ByteLru,
    Held,
    Loaded,
    StorageTier,
    salt_bytes,
)

from .test_store import P, REC, SALT, SHAPE, kv, make_refs, names, record_files

FP = bytes(range(16))


def held(i: int, ref, shape=SHAPE) -> Held:
    meta = BlockMeta(0, ref.key, salt_bytes(SALT), ref.parent, token_bytes(ref.tokens), shape, "float32")
    return Held(meta, kv(i, shape=shape))


def test_byte_lru_names_least_recently_used_unpinned_victims():
    lru: ByteLru[int] = ByteLru(10, size_of=lambda n: n)
    for name, size in [(b"a", 3), (b"b", 3), (b"c", 3)]:
        lru.add((0, name), size)
    lru.touch((0, b"a"))  # order: b, c, a
    assert (len(lru), lru.used) == (3, 9)
    assert lru.victims(1, pinned=lambda k: False) == []
    assert lru.victims(2, pinned=lambda k: False) == [(0, b"b")]
    assert lru.victims(2, pinned=lambda k: k == (0, b"b")) == [(0, b"c")]
    assert lru.victims(2, pinned=lambda k: False, reserved=3) == [(0, b"b"), (0, b"c")]
    assert lru.victims(4, pinned=lambda k: k != (0, b"a")) == [(0, b"a")]
    assert lru.victims(5, pinned=lambda k: k != (0, b"a")) is None  # 3 bytes unpinned
    assert lru.victims(11, pinned=lambda k: False) is None  # over the whole budget
    assert lru.pop_lru() == ((0, b"b"), 3) and lru.used == 6


def test_dram_tier_hands_back_what_it_evicted_and_skips_pins():
    a, b, c = make_refs(3)
    pinned = {(0, a.key)}
    dram = DramTier(2 * P, pinned=lambda k: k in pinned)
    ha, hb, hc = held(0, a), held(1, b), held(2, c)
    assert dram.admit((0, a.key), ha) == [] and dram.admit((0, b.key), hb) == []
    assert dram.admit((0, c.key), hc) == [((0, b.key), hb)]  # a is pinned: b goes
    assert list(dram.keys()) == [(0, a.key), (0, c.key)]
    assert dram.holds((0, c.key), hc) and not dram.holds((0, c.key), held(2, c))
    pinned.add((0, c.key))
    assert dram.admit((0, b.key), hb) is None  # all pinned: nothing changes
    assert dram.stats()[:3] == (2, 2 * P, 1)


def test_disk_tier_on_its_own_writes_verifies_and_reports_losses(tmp_path):
    a, b, c = make_refs(3)
    lost = []
    tier = DiskTier(
        str(tmp_path), budget=2 * REC, fingerprint=FP, on_lost=lambda k, h: lost.append(k[1])
    )
    for i, ref in enumerate((a, b)):
        job = tier.put((0, ref.key), held(i, ref))
        assert tier.find((0, ref.key)) is not None and tier.pending((0, ref.key)) is not None
        assert tier.write(job) is True
    assert record_files(tmp_path) == names(a, b)
    entry = tier.locate((0, a.key))
    got = tier.get((0, a.key), entry)
    assert got.outcome is Loaded.HIT and torch.equal(got.payload, kv(0))
    # b is now the LRU record: a third one evicts it
    assert tier.write(tier.put((0, c.key), held(2, c))) is True
    assert record_files(tmp_path) == names(a, c)
    # a record too large for the budget is reported lost, never written
    assert tier.put((0, b.key), held(1, b, shape=(16, 2, 16, 4))) is None and lost == [b.key]
    # a damaged record is removed and counted, a missing one is a miss
    path = tmp_path / fmt.record_name(0, c.key)
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    assert tier.get((0, c.key), tier.locate((0, c.key))) == (Loaded.CORRUPT, None)
    os.unlink(tmp_path / fmt.record_name(0, a.key))
    assert tier.get((0, a.key), tier.locate((0, a.key))).outcome is Loaded.MISS
    s = tier.stats()
    assert (s.blocks, s.writes, s.evictions, s.corrupt, s.write_errors) == (0, 3, 1, 1, 0)
    tier.close()
    tier.close()  # idempotent


def test_the_disk_tier_has_every_member_of_the_storage_tier_protocol():
    members = {
        name for name, _ in inspect.getmembers(StorageTier) if not name.startswith("_")
    } | {"name"}
    for name in members:
        assert hasattr(DiskTier, name), name
        want = getattr(StorageTier, name, None)
        if callable(want):
            got = inspect.signature(getattr(DiskTier, name))
            assert list(got.parameters) == list(inspect.signature(want).parameters), name


def _plug_second_tier(store: BlockStore, folder, budget: int) -> DiskTier:
    """A second storage tier after the disk (where a remote tier goes), sharing the
    store's lock, pins and loss reports: the policy itself is unchanged."""
    tier = DiskTier(
        str(folder), budget=budget, fingerprint=FP, cond=store._cond, pinned=store._pinned, on_lost=store._lost
    )
    store._lower.append(tier)
    return tier


def test_a_second_storage_tier_after_the_disk_serves_what_the_disk_evicted(tmp_path):
    store = BlockStore(
        StoreConfig(dram_bytes=P, disk_bytes=REC, disk_dir=str(tmp_path / "kv"), write_behind_bytes=0)
    )
    second = _plug_second_tier(store, tmp_path / "far", 8 * REC)
    a, b, c = make_refs(3)
    assert [store.put(r, kv(i), salt=SALT) for i, r in enumerate((a, b, c))] == [PutStatus.STORED] * 3
    # Each block leaving DRAM went to both tiers; the disk (one record) kept only b.
    assert record_files(tmp_path / "kv") == names(b)
    assert record_files(tmp_path / "far") == names(a, b)
    assert store.match_prefix([a, b, c], salt=SALT) == 3
    got = store.get(a, salt=SALT)  # from the second tier, verified, promoted to DRAM
    assert got.status is LookupStatus.HIT_DISK and torch.equal(got.payload, kv(0))
    assert store.get(a, salt=SALT).status is LookupStatus.HIT_DRAM
    # c left DRAM: written to both (the disk evicted b), the second tier keeps all three
    assert record_files(tmp_path / "kv") == names(c)
    assert record_files(tmp_path / "far") == names(a, b, c)
    assert store.get(b, salt=SALT).status is LookupStatus.HIT_DISK
    s = store.stats()
    assert (s.disk_hits, s.dropped, s.disk_blocks) == (2, 0, 1)
    assert second.stats().writes == 3
    store.close()


def test_a_block_one_storage_tier_refuses_is_not_dropped_when_another_takes_it(tmp_path):
    big = kv(0, shape=(8, 2, 16, 4))  # too large for DRAM and for the disk's budget (one unit)
    store = BlockStore(
        StoreConfig(dram_bytes=P, disk_bytes=REC, disk_dir=str(tmp_path / "kv"), write_behind_bytes=0)
    )
    _plug_second_tier(store, tmp_path / "far", 8 * REC)
    ref = make_refs(1)[0]
    assert store.put(ref, big, salt=SALT) is PutStatus.STORED
    assert (store.stats().dropped, record_files(tmp_path / "kv")) == (0, [])
    got = store.get(ref, salt=SALT)
    assert got.status is LookupStatus.HIT_DISK and torch.equal(got.payload, big)
    store.close()


@pytest.mark.parametrize("write_behind", [0, 8 * P])
def test_closing_the_store_closes_every_storage_tier(tmp_path, write_behind):
    store = BlockStore(
        StoreConfig(dram_bytes=P, disk_bytes=4 * REC, disk_dir=str(tmp_path / "kv"), write_behind_bytes=write_behind)
    )
    _plug_second_tier(store, tmp_path / "far", 4 * REC)
    refs = make_refs(3)
    for i, r in enumerate(refs):
        store.put(r, kv(i), salt=SALT)
    store.close()  # pending write-downs finish, both folders are released
    for folder in ("kv", "far"):
        again = DiskTier(str(tmp_path / folder), budget=4 * REC, fingerprint=FP if folder == "far" else _fp(""))
        assert list(again.keys()) == [(0, r.key) for r in refs[:2]], folder
        again.close()


def _fp(fingerprint: str) -> bytes:
    from promptsplice.blocks import content_digest

    return content_digest(fingerprint.encode("utf-8"))
