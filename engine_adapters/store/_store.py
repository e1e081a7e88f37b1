"""The tiered KV block store: a policy over DRAM, disk, then a shared Redis, keyed by
the chain hash.

The splice connector saves the KV of every full block it prefills here, and asks for
blocks back when vLLM's own prefix cache misses (offload hits) or when an agent edit
moved them (relocation).  This module is the testable core the connector forwards to:
it never imports vLLM, and it imports torch only when a tensor goes in or out.
Kept as one module (~870 lines): it is the one tiering policy over every tier (put,
get, write-down, promotion, pins, re-share), and each of those steps takes the one lock
with the others; the tiers' mechanisms live in their own modules.  A store inherited
through ``fork()`` keeps its DRAM tier only in the child (its tiers' threads and folder
lock stay with the parent), and no store lock is copied held.

Tiers and policy
    The store is an ordered list of tiers (the split of vLLM's ``BlockPool`` from its
    ``KVCacheManager``, of LMCache's storage backends from its cache policy): the memory
    tier (``_dram``: payload tensors, at most ``dram_bytes``), then the storage tiers
    (``_tier.StorageTier``: the disk tier of ``_disk`` when ``disk_bytes > 0``, at most
    ``disk_bytes`` of record files; then the shared tier of ``_redis`` when
    ``remote_bytes > 0``, on a Redis server other engines use too).  Each tier is an LRU
    bounded in bytes; this module decides what moves between them:

    * the storage tiers are *inclusive*: a block evicted from DRAM is written down to
      every storage tier that does not hold it yet; a hit in a storage tier is promoted
      back into DRAM and keeps its copy there, so evicting it again costs no write;
    * a *shared* tier (``shared`` true: Redis) is also written when a block is stored,
      not only when DRAM evicts it, since other engines can only load what reached it;
    * budgets are never exceeded: a block that does not fit in DRAM (larger than the
      budget, or the budget held by pinned blocks) goes straight to the storage tiers;
      one that fits nowhere is refused (:attr:`PutStatus.REJECTED`); blocks on their way
      down are held outside the DRAM budget: the write-behind queue holds at most
      ``write_behind_bytes`` of them (the shared tier's: or one block, when a block is
      larger), plus the blocks one put evicts while each putting thread waits for room
      in it (about one block per thread when blocks are of one size);
    * lookups are counted here (``*_hits``/``*_misses``, ``mismatches``, ``dropped``);
      what happens to a tier's storage (evictions, writes, damaged copies) by the tier.
      A hit in any storage tier answers ``HIT_DISK`` and counts in ``disk_hits``; the
      ``disk_*`` block, byte and storage counts are the disk tier's, the ``remote_*``
      ones the shared tier's (``remote_hits`` is the part of ``disk_hits`` it served).

Identity and collision safety
    A block is stored under ``(namespace, key)``.  In :attr:`Namespace.CHAIN` the key is
    the chain hash of ``promptsplice.blocks`` (the salt already entered the root), and
    ``put`` checks that it *is* ``hash_block(parent, tokens)``.  Beside the key every
    block keeps its tenant salt, its parent key (``root_hash(salt)`` for a first block)
    and its token ids, and every lookup compares all three with the caller's: a key
    that is present with other tokens, parent or salt answers
    :attr:`LookupStatus.MISMATCH` and never its payload.  xxh3 is fast but not
    collision-resistant (vLLM moved off Python's ``hash`` after CVE-2025-25183), so
    the key alone is never trusted.  Limit: the parent is compared as a hash, so a block
    stored after a *colliding earlier block* of another prefix would still match; only
    a collision-resistant chain hash closes that (see ``promptsplice.blocks``).
    :attr:`Namespace.CONTENT` is a second key space for position-independent reuse: any
    16-byte key the caller derives (fold the salt into it), same checks, no chain check.
    ``StoreConfig.fingerprint`` names the model and KV layout that wrote the blocks; a
    stored copy written under another fingerprint is never served.

match_prefix / load contract
    ``match_prefix(refs, salt=..., owner=...)`` counts the leading ``refs`` whose block
    is present and valid (same tokens, parent and salt) in any tier, from the in-memory
    indexes only: it reads no file.  A tier whose reads are skipped for now (a shared
    server that answers too slowly: ``readable`` false) counts only its pending writes.
    With ``owner`` (the connector passes the request id) the counted blocks are
    *pinned* for that owner, replacing the owner's earlier pins (so asking again for
    the same request is idempotent), until :meth:`release`
    (after the load, or when the request ends); :meth:`discard` and :meth:`clear`
    remove pinned blocks too.  A pinned block is never evicted from the tier it is in,
    so a ``get`` of a counted block returns ``HIT_DRAM`` or ``HIT_DISK``, with one
    exception: its stored copy was damaged or removed behind the store's back, or its
    write-down failed, in which case ``get`` answers ``CORRUPT`` or ``MISS`` and the
    connector must recompute those blocks (vLLM's ``get_block_ids_with_load_errors``).
    Without ``owner`` the count is advisory: eviction may remove a counted block before
    it is loaded.

Faults (details in ``_disk``)
    A crash mid-write never serves a partial block, every load verifies the whole
    stored copy, and a damaged one is deleted, counted and answered ``CORRUPT``.  A
    failing tier logs one warning per outage, drops the blocks it could not take
    (counted in ``dropped``) and pauses its writes for ``disk_retry_s`` seconds: the
    store keeps serving from DRAM and from the copies it has.

Threads
    One lock guards every tier's index; reads, writes and fsyncs run outside it.
    Write-downs go to the storage tier's background writer, so ``put`` and ``get`` on the
    engine's step do not wait for an fsync; ``drain()`` waits for the writers and
    ``close()`` drains (the write-downs of calls still running included) before it lets
    the folder go, and a second ``close()`` returns only then.  One store owns a folder;
    in one process share one instance through :func:`shared_store` (the connector's
    scheduler and worker sides both use it).  ``fork()`` waits for the stores' locks, a
    store still opening and :func:`shared_store` (locks taken in one order: the shared
    registry's, the live stores', then each store's).

Payload tensors are shared, not copied, on the way out: treat what ``get`` returns as
read-only.  ``put`` copies by default (``copy=False`` hands the tensor over).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from promptsplice.blocks import content_digest, hash_block_bytes
from promptsplice.engine_adapters.store import _format as fmt
from promptsplice.engine_adapters.store._disk import DiskTier
from promptsplice.engine_adapters.store._dram import DramTier
from promptsplice.engine_adapters.store._redis import RedisTier
from promptsplice.engine_adapters.store._tier import (
    BlockMeta,
    Held,
    Key,
    Loaded,
    Namespace,
    StorageTier,
    new_condition,
)
from promptsplice.engine_adapters.store._types import (
    BlockRef,
    Lookup,
    LookupStatus,
    PutStatus,
    Ref,
    StoreConfig,
    StoreStats,
    block_key,
    chain_refs,
    check_stored_salt,
    own_payload,
    parse_ref,
)
from promptsplice.errors import ConfigError, InputError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockRef",
    "BlockStore",
    "Lookup",
    "LookupStatus",
    "Namespace",
    "PutStatus",
    "StoreConfig",
    "StoreStats",
    "chain_refs",
    "shared_store",
]

_log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[BlockStore] = weakref.WeakSet()
# Lock order, in every path: _SHARED_LOCK, then _LIVE_LOCK, then the stores' locks (by id).
_LIVE_LOCK = threading.Lock()  # guards _LIVE: a store added mid-fork was released unlocked
_FORK_HELD: list[BlockStore] = []  # the stores _before_fork locked: the after-hooks release these
_SHARED: dict[StoreConfig, BlockStore] = {}
_SHARED_LOCK = threading.Lock()  # held by shared_store() while it opens a folder


def _before_fork() -> None:
    """Take the registry locks and every store's lock, so no lock is copied held by a
    thread the child lacks (a store still opening its tiers holds its lock: the fork
    waits for the open, so the child sees every tier, the folder's lock included)."""
    global _FORK_HELD
    _SHARED_LOCK.acquire()
    _LIVE_LOCK.acquire()
    stores = sorted(_LIVE, key=id)
    for store in stores:
        store._cond.acquire()
    _FORK_HELD = stores


def _release_fork_locks() -> list[BlockStore]:
    """Release what ``_before_fork`` took (exactly: a store built since is not in it)."""
    global _FORK_HELD
    stores, _FORK_HELD = _FORK_HELD, []
    for store in stores:
        store._cond.release()
    _LIVE_LOCK.release()
    _SHARED_LOCK.release()
    return stores


def _after_fork_in_parent() -> None:
    _release_fork_locks()


def _after_fork_in_child() -> None:
    """The child has the stores but none of their threads (disk writer, Redis writer and
    listener, callers in ``put`` or ``close``), and shares the disk folder with its
    parent: each keeps its DRAM tier only, and closes its copies of the disk tier's
    descriptors, so the folder's lock goes with the parent's close (a child that kept it
    made the parent's reopen fail)."""
    for store in _release_fork_locks():  # (one thread here: no lock needed)
        store._busy = 0  # write-downs of the parent's threads: none run here
        if store._closed:
            store._shut = True  # its closing thread is the parent's: nothing left to close here
        if store._lower:
            _log.warning("KV block store: inherited through fork(): this process keeps its DRAM tier only; "
                         "build the store after forking for the disk and shared tiers")
            for tier in store._lower:
                if isinstance(tier, DiskTier):
                    tier.close_in_forked_child()
            store._lower = []


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


class BlockStore:
    """A tiered store of KV blocks (see the module doc for tiers, checks and contracts)."""

    def __init__(self, config: StoreConfig) -> None:
        if not isinstance(config, StoreConfig):
            raise ConfigError(f"BlockStore takes a StoreConfig, got {type(config).__name__}")
        self._cfg = config
        self._cond = new_condition()
        self._pin_count: dict[Key, int] = {}
        self._pins: dict[Hashable, tuple[Key, ...]] = {}
        # The tiers call back through weak references: a store dropped without close() is
        # freed (and its folder released, ``__del__``) at once, not at a later GC cycle.
        self._dram = DramTier(config.dram_bytes, pinned=_weakly(self._pinned, False))
        self._lower: list[StorageTier] = []
        self._hits = [0, 0]  # per tier: DRAM, then the storage tiers' total
        self._misses = [0, 0]
        self._unserved = 0  # lookups that ended with no tier serving them
        self._mismatches = 0
        self._dropped = 0
        self._deferred: list[Key] | None = None
        self._closed = False  # close() began: calls are refused
        self._shut = False  # close() ended: write-downs finished, folder released
        self._busy = 0  # calls running planned write-downs outside the lock (close waits)
        self._tier_hits: dict[str, int] = {}  # storage-tier hits by tier name
        # Seen by the fork hooks before a tier opens, and locked until they all are: a
        # fork meanwhile waits, so the child never keeps a folder lock it cannot see.
        with _LIVE_LOCK:
            self._cond.acquire()
            _LIVE.add(self)
        try:
            self._open_tiers(config)
        except BaseException:
            self._closed = True
            self._cond.release()  # before closing the tiers: they take it
            try:
                for tier in self._lower:  # the disk tier's files and folder lock
                    tier.close()
            finally:
                with self._cond:
                    self._lower = []
                    self._shut = True
                with _LIVE_LOCK:
                    _LIVE.discard(self)
            raise
        self._cond.release()

    def _open_tiers(self, config: StoreConfig) -> None:
        """Open the storage tiers into ``_lower`` (the caller closes them on an error)."""
        if config.disk_bytes > 0:
            assert config.disk_dir is not None
            _check_anonymous_folder(config)
            disk = DiskTier.open(
                config.disk_dir,
                budget=config.disk_bytes,
                fingerprint=content_digest(config.fingerprint.encode("utf-8")),
                fsync=config.fsync,
                retry_s=config.disk_retry_s,
                write_behind_bytes=config.write_behind_bytes,
                cond=self._cond,
                pinned=_weakly(self._pinned, False),
                on_lost=_weakly(self._lost, None),
            )
            if disk is not None:
                self._lower.append(disk)
        if config.remote_bytes > 0:
            assert config.remote_url is not None
            if not config.fingerprint:
                # A shared server holds every engine's blocks: without a fingerprint a
                # bf16 engine was served a float32 engine's block of another shape.
                raise ConfigError(
                    "StoreConfig.fingerprint is empty but remote_url shares the blocks: name the "
                    "model and KV layout that write them (e.g. 'smollm2-135m/bfloat16/block32'); "
                    "the splice connector sets it for you"
                )
            self._lower.append(
                RedisTier(
                    config.remote_url,
                    budget=config.remote_bytes,
                    fingerprint=content_digest(config.fingerprint.encode("utf-8")),
                    timeout_s=config.remote_timeout_s,
                    retry_s=config.remote_retry_s,
                    write_behind_bytes=config.write_behind_bytes,
                    cond=self._cond,
                    pinned=_weakly(self._pinned, False),
                    on_lost=_weakly(self._lost, None),
                    on_back=_weakly(self._reshare, None),
                )
            )

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> StoreConfig:
        return self._cfg

    @property
    def tiered(self) -> bool:
        """Whether tiers below DRAM are open (not only configured: a disk folder that
        could not be opened, or a store in a forked child, has none)."""
        return bool(self._lower)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` began (calls are refused from then on); ``close()``
        itself returns only when the store is fully closed."""
        return self._closed

    def put(
        self,
        ref: Ref,
        payload: torch.Tensor,
        *,
        salt: str | bytes | None = None,
        namespace: Namespace = Namespace.CHAIN,
        copy: bool = True,
    ) -> PutStatus:
        """Store one block: ``payload`` is a CPU tensor with all layers of the block.

        Idempotent: an identical block already stored answers ``EXISTS`` (and counts as
        a use for LRU); another block under the key answers ``MISMATCH`` and stays.
        ``copy=False`` keeps ``payload`` itself (hand over a tensor that owns its storage
        and that nobody modifies).  Blocks this evicts from DRAM go to the background
        writer (written before ``put`` returns when ``write_behind_bytes`` is 0).
        """
        if not isinstance(copy, bool):
            raise InputError(f"copy must be True or False, got {copy!r}")
        k, salt_b, parent, tok = parse_ref(ref, salt, namespace)
        check_stored_salt(salt_b)
        if k[0] == Namespace.CHAIN and hash_block_bytes(parent, tok) != k[1]:
            raise InputError(
                "ref.key is not the chain hash of (ref.parent, ref.tokens): build refs with "
                "promptsplice.blocks.chain_hashes (or chain_refs), or use Namespace.CONTENT "
                "for keys of your own"
            )
        tensor, dtype = own_payload(payload, copy)
        held = Held(BlockMeta(k[0], k[1], salt_b, parent, tok, tuple(tensor.shape), dtype), tensor)
        with self._cond:
            self._check_open()
            old, where = self._find_where(k)
            if old is not None and old != held.meta:
                self._mismatches += 1
                return PutStatus.MISMATCH
            if old is not None and not getattr(where, "shared", False):
                self._touch(k)
                return PutStatus.EXISTS
            # Not held here (a shared tier's index may name it: another engine's copy,
            # which the server may have evicted since): keep this one in DRAM.
            jobs = self._admit(k, held)  # (the write-downs of the blocks it evicts)
            admitted = jobs is not None
            if jobs is None:  # no room in DRAM: straight to the storage tiers
                jobs = self._write_down(k, held)
                if not jobs:
                    if not self._lower:
                        self._dropped += 1
                    return PutStatus.REJECTED
            elif old is None:  # other engines read the shared tiers: write them now
                jobs += self._write_down(k, held, shared_only=True)
            self._begin(jobs)
        results = self._run_planned(jobs)
        if admitted or any(r is not False for r in results):
            return PutStatus.STORED
        return PutStatus.REJECTED

    def get(self, ref: Ref, *, salt: str | bytes | None = None, namespace: Namespace = Namespace.CHAIN) -> Lookup:
        """Load one block, if it is stored with exactly these tokens, parent and salt.

        A hit in a storage tier reads and verifies the whole stored copy, then promotes
        the block to DRAM.  The payload is shared with the store: do not modify it.
        """
        k, salt_b, parent, tok = parse_ref(ref, salt, namespace)
        with self._cond:
            self._check_open()
            held = self._dram.get(k)
            mem = held if held is not None else self._pending(k)
            if mem is not None:  # in DRAM, or in memory on its way down
                if mem.meta.matches(salt_b, parent, tok):
                    if held is not None:
                        self._touch(k)
                    self._hits[0] += 1
                    return Lookup(LookupStatus.HIT_DRAM, mem.payload)
                self._misses[0] += 1
                if self._lower:  # the lookup ends here: no tier below serves it either
                    self._misses[1] += 1
                self._unserved += 1
                self._mismatches += 1
                return Lookup(LookupStatus.MISMATCH)
            self._misses[0] += 1
            for tier in self._lower:
                entry = tier.locate(k)
                if entry is not None:
                    break
            else:
                if self._lower:
                    self._misses[1] += 1
                self._unserved += 1
                return Lookup(LookupStatus.MISS)
            if not entry.meta.matches(salt_b, parent, tok):
                self._misses[1] += 1
                self._unserved += 1
                self._mismatches += 1
                return Lookup(LookupStatus.MISMATCH)
        fetched = tier.get(k, entry)
        jobs: list[tuple[StorageTier, object]] = []
        with self._cond:
            if fetched.outcome is not Loaded.HIT:
                self._misses[1] += 1
                self._unserved += 1
                miss = fetched.outcome is Loaded.MISS
                return Lookup(LookupStatus.MISS if miss else LookupStatus.CORRUPT)
            self._hits[1] += 1
            self._tier_hits[tier.name] = self._tier_hits.get(tier.name, 0) + 1
            # promoted only if the tier still holds this very entry: a block cleared or
            # discarded while it was read goes back into no tier (the caller still gets
            # it: its read began before the clear)
            if not self._closed and self._dram.get(k) is None and tier.locate(k) is entry:
                assert fetched.payload is not None
                jobs = self._admit(k, Held(entry.meta, fetched.payload)) or []
                self._begin(jobs)
        self._run_planned(jobs)
        return Lookup(LookupStatus.HIT_DISK, fetched.payload)

    def contains(self, ref: Ref, *, salt: str | bytes | None = None, namespace: Namespace = Namespace.CHAIN) -> bool:
        """True when the block is stored (any tier) with these tokens, parent and salt.

        Index only: no file is read, no counter or LRU order changes.
        """
        k, salt_b, parent, tok = parse_ref(ref, salt, namespace)
        with self._cond:
            self._check_open()
            meta = self._find(k)
            return meta is not None and meta.matches(salt_b, parent, tok)

    def holds(self, key: bytes, *, namespace: Namespace = Namespace.CHAIN) -> bool:
        """Whether any tier holds a block under ``key`` (index only; no LRU change, tokens
        not compared: :meth:`contains` checks them, the load verifies them).  What an
        engine's assembler asks while it lays out a prompt: these blocks load back (so
        not the indexed blocks of a tier whose reads are skipped for now)."""
        k = block_key(key, namespace)
        with self._cond:
            return not self._closed and self._loadable(k) is not None

    def match_prefix(
        self,
        refs: Iterable[Ref],
        *,
        salt: str | bytes | None = None,
        namespace: Namespace = Namespace.CHAIN,
        owner: Hashable | None = None,
        salts: Sequence[str | bytes | None] | None = None,
    ) -> int:
        """How many *leading* ``refs`` are stored and valid (index only, reads no file).

        The counted blocks count as used (LRU).  With ``owner`` they are pinned for that
        owner until :meth:`release` (replacing the owner's earlier pins); see the module
        doc for what a pin guarantees to the load that follows.  ``salts``: one salt per
        ref, overriding ``salt`` (a run that continues an old prompt stored under another
        salt: the splice connector's scoped requests).
        """
        if owner is not None:
            try:  # (a tuple holding a list passes isinstance(.., Hashable), and hash() raises)
                hash(owner)
            except TypeError:
                raise InputError(f"owner must be hashable (a request id), got {owner!r:.80}") from None
        if salts is not None:
            refs = _ref_list(refs)
            if isinstance(salts, str | bytes) or not hasattr(salts, "__iter__"):
                raise InputError(f"salts must be a sequence of salts, one per ref, got {type(salts).__name__}")
            salts = list(salts)  # (a generator has no len)
            if len(salts) != len(refs):
                raise InputError(f"salts has {len(salts)} entries for {len(refs)} refs: give one per ref")
        else:
            _check_iterable(refs)
        # Refs are parsed (a lazy one hashed) outside the lock, in growing batches, each
        # matched before the next is parsed: a query that misses early costs up to about
        # twice its first miss, and a long one (8,192 blocks: ~20 ms of parsing) no longer
        # holds up the engine workers' puts and gets.  A bad ref after the first miss is
        # not an error (as when refs were read one by one).  The last batch's pass re-checks the
        # earlier batches (a block evicted between them ends the count there) and touches
        # and pins the matched blocks under that one lock.
        it = iter(refs)
        parsed: list[tuple[Key, bytes, bytes, bytes]] = []
        batch = _FIRST_BATCH
        while True:
            start, bad = len(parsed), None
            try:
                for ref in it:
                    parsed.append(parse_ref(ref, salt if salts is None else salts[len(parsed)], namespace))
                    if len(parsed) - start == batch:
                        break
            except Exception as exc:  # noqa: BLE001 - raised below unless a miss comes before it
                bad = exc
            with self._cond:
                self._check_open()
                end = self._matched(parsed, start)
                if bad is not None and end == len(parsed):
                    raise bad  # a bad ref (or salt) after only stored ones; one after a miss is never read
                if end == len(parsed) and end - start == batch:
                    batch *= 2  # all stored, and maybe more refs: parse the next batch
                    continue
                keys = [k for k, _, _, _ in parsed[: self._matched(parsed[:start], 0)]]
                if len(keys) == start:
                    keys += [k for k, _, _, _ in parsed[start:end]]
                for k in keys:
                    self._touch(k)
                if owner is not None:
                    self._unpin(self._pins.pop(owner, ()))
                    if keys:
                        self._pins[owner] = tuple(keys)
                        for k in keys:
                            self._pin_count[k] = self._pin_count.get(k, 0) + 1
                return len(keys)

    def _matched(self, parsed: list[tuple[Key, bytes, bytes, bytes]], start: int) -> int:
        """Under the lock: the index of the first of ``parsed[start:]`` not stored
        (``len(parsed)`` when all are)."""
        for i in range(start, len(parsed)):
            k, salt_b, parent, tok = parsed[i]
            meta = self._loadable(k)
            if meta is None or not meta.matches(salt_b, parent, tok):
                return i
        return len(parsed)

    def release(self, owner: Hashable) -> int:
        """Drop ``owner``'s pins; returns how many blocks it had pinned (0 if none)."""
        with self._cond:
            keys = self._pins.pop(owner, ())
            self._unpin(keys)
            return len(keys)

    def discard(self, key: bytes, *, namespace: Namespace = Namespace.CHAIN) -> bool:
        """Remove the block stored under ``key`` from every tier (even if pinned)."""
        k = block_key(key, namespace)
        with self._cond:
            self._check_open()
            found = self._dram.remove(k)
            for tier in self._lower:
                found = tier.remove(k) or found
            if self._pin_count.pop(k, None) is not None:
                # the pins went with the block (they outlived it: counted in pinned_blocks
                # and keeping a later block under the key from being evicted)
                for owner, keys in list(self._pins.items()):
                    if k in keys:
                        self._pins[owner] = tuple(x for x in keys if x != k)
            return found

    def flush(self) -> int:
        """Write the DRAM blocks that have no stored copy yet down (oldest first), and
        wait for every pending write.

        For a graceful shutdown: the next store on the folder then serves them.  Blocks
        stay in DRAM too.  Returns how many records the tiers wrote while the call ran
        (each tier's copy counts; on a store shared between threads or engines, their
        writes meanwhile too).
        """
        with self._cond:
            self._check_open()
            before = self._writes()
            jobs = []
            for k, held in self._dram.items():
                jobs += self._write_down(k, held)
            self._begin(jobs)
        self._run_planned(jobs)
        self.drain()
        with self._cond:
            return self._writes() - before

    def _reshare(self) -> None:
        """A shared tier is back after an outage (maybe empty): write the DRAM blocks it
        lacks, so other engines find them again (called from the tier's listener)."""
        with self._cond:
            if self._closed:
                return
            jobs = []
            for k, held in list(self._dram.items()):
                jobs += self._write_down(k, held, shared_only=True)
            self._begin(jobs)
        self._run_planned(jobs)

    def drain(self) -> None:
        """Wait until every block handed to a background writer is written (or failed)."""
        for tier in self._lower:
            tier.drain()

    def stats(self) -> StoreStats:
        """A consistent snapshot of block counts, bytes and counters."""
        with self._cond:
            dram = self._dram.stats()
            disk = next((t.stats() for t in self._lower if t.name == "disk"), None)
            remote = next((t.stats() for t in self._lower if t.name == "remote"), None)
            return StoreStats(
                dram_blocks=dram.blocks,
                dram_bytes=dram.bytes,
                disk_blocks=disk.blocks if disk else 0,
                disk_bytes=disk.bytes if disk else 0,
                dram_hits=self._hits[0],
                dram_misses=self._misses[0],
                disk_hits=self._hits[1],
                disk_misses=self._misses[1],
                mismatches=self._mismatches,
                corrupt=disk.corrupt if disk else 0,
                foreign=disk.foreign if disk else 0,
                dram_evictions=dram.evictions,
                disk_evictions=disk.evictions if disk else 0,
                disk_writes=disk.writes if disk else 0,
                write_errors=disk.write_errors if disk else 0,
                dropped=self._dropped,
                pinned_blocks=sum(1 for c in self._pin_count.values() if c > 0),
                pending_writes=disk.pending if disk else 0,
                disk_writable=disk.writable if disk else False,
                remote_blocks=remote.blocks if remote else 0,
                remote_hits=self._tier_hits.get("remote", 0),
                remote_writes=remote.writes if remote else 0,
                remote_write_errors=remote.write_errors if remote else 0,
                remote_corrupt=remote.corrupt if remote else 0,
                remote_foreign=remote.foreign if remote else 0,
                remote_outages=remote.outages if remote else 0,
                remote_skipped=remote.skipped if remote else 0,
                remote_available=remote.writable if remote else False,
                misses=self._unserved,
            )

    def clear(self) -> None:
        """Remove every block (every tier, stored copies included) and every pin.

        Counters are kept.  Writes in flight are discarded when they finish.
        """
        with self._cond:
            self._check_open()
            self._dram.clear()
            for tier in self._lower:
                tier.clear()
            self._pins.clear()
            self._pin_count.clear()

    def close(self) -> None:
        """Forget the DRAM tier and release the folder (its records stay for a restart).

        Waits for pending writes first, those of calls running in other threads too.
        Idempotent: a second call returns once the first has finished.  Any other call
        on a closed (or closing) store raises :class:`InputError`.
        """
        with self._cond:
            if self._closed:  # closing in another thread: return once it is done
                while not self._shut:
                    self._cond.wait()
                return
            self._closed = True
            # write-downs a put or get planned before: handed to the tiers before they
            # close (a tier closed first cancelled them, a block lost and not counted)
            while self._busy:
                self._cond.wait()
        try:
            for tier in self._lower:  # evicted blocks were promised to the disk: finished here
                tier.close()
        finally:
            with self._cond:
                self._dram.clear()
                self._pins.clear()
                self._pin_count.clear()
                self._shut = True
                self._cond.notify_all()

    def _wait_shut(self) -> None:
        """Wait until a :meth:`close` begun in another thread has finished."""
        with self._cond:
            while self._closed and not self._shut:
                self._cond.wait()

    def __del__(self) -> None:
        """A store dropped without :meth:`close` closes as a file does: pending writes
        finish and the folder is released (until 2026-12-08 its lock stayed held until a
        garbage-collector cycle, and reopening the folder raised ``ConfigError``)."""
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return  # (at interpreter teardown the writer threads are gone: the OS releases)
        name = repr(self)
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise; say what failed
            _log.debug("block store: closing a dropped store failed", exc_info=True)
        warnings.warn(f"unclosed {name}: call close() or use it as a context manager",
                      ResourceWarning, stacklevel=2, source=self)

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self._cfg
        disk = next((t for t in self._lower if isinstance(t, DiskTier)), None)
        where = f", disk_bytes={c.disk_bytes}, disk_dir={disk.folder!r}" if disk else ""
        if c.remote_bytes:
            where += f", remote_bytes={c.remote_bytes}"
        return f"BlockStore(dram_bytes={c.dram_bytes}{where}{', closed' if self._closed else ''})"

    # ------------------------------------------------------------ policy (under lock)

    def _check_open(self) -> None:
        if self._closed:
            raise InputError("the BlockStore is closed: open a new one on the same config")

    def _pinned(self, k: Key) -> bool:
        return bool(self._pin_count.get(k))

    def _find(self, k: Key) -> BlockMeta | None:
        return self._find_where(k)[0]

    def _find_where(self, k: Key) -> tuple[BlockMeta | None, object]:
        """The block's record and the tier that names it first (DRAM, then down)."""
        meta = self._dram.find(k)
        if meta is not None:
            return meta, self._dram
        for tier in self._lower:
            meta = tier.find(k)
            if meta is not None:
                return meta, tier
        return None, None

    def _loadable(self, k: Key) -> BlockMeta | None:
        """The block's record as :meth:`_find` names it, but only from where a ``get``
        would serve it now: a tier whose reads are skipped (``readable`` false: a slow
        shared server) counts for its pending writes only (served from memory), not for
        its index, or ``match_prefix`` pinned blocks whose every load then missed."""
        meta = self._dram.find(k)
        if meta is not None:
            return meta
        for tier in self._lower:
            if getattr(tier, "readable", True):
                meta = tier.find(k)
            else:
                held = tier.pending(k)
                meta = held.meta if held is not None else None
            if meta is not None:
                return meta
        return None

    def _pending(self, k: Key) -> Held | None:
        for tier in self._lower:
            held = tier.pending(k)
            if held is not None:
                return held
        return None

    def _touch(self, k: Key) -> None:
        """Count a use: every tier that holds the block moves it to its MRU end (until
        2026-12-07 only the first: a block hit in DRAM aged on disk, and the hottest
        block's disk copy, the one a restart serves, was the first to go)."""
        self._dram.touch(k)
        for tier in self._lower:
            tier.touch(k)

    def _unpin(self, keys: Iterable[Key]) -> None:
        for k in keys:
            left = self._pin_count.get(k, 0) - 1
            if left > 0:
                self._pin_count[k] = left
            else:
                self._pin_count.pop(k, None)

    def _admit(self, k: Key, held: Held) -> list[tuple[StorageTier, object]] | None:
        """Insert ``held`` into DRAM; the write-downs of the blocks it evicted, or
        ``None`` when it does not fit in DRAM."""
        evicted = self._dram.admit(k, held)
        if evicted is None:
            return None
        jobs = []
        for vk, gone in evicted:
            jobs += self._write_down(vk, gone)
        return jobs

    def _write_down(self, k: Key, held: Held, *, shared_only: bool = False) -> list[tuple[StorageTier, object]]:
        """Plan the write of ``held`` to every storage tier that does not hold it yet
        (``shared_only``: only to the shared ones)."""
        jobs = []
        self._deferred = []  # a tier's refusal counts only if no other tier takes it
        try:
            for tier in self._lower:
                if shared_only and not getattr(tier, "shared", False):
                    continue
                if tier.find(k) is None:
                    job = tier.put(k, held)
                    if job is not None:
                        jobs.append((tier, job))
        finally:
            refused, self._deferred = self._deferred, None
        if refused:
            self._lost(k, held)
        return jobs

    def _lost(self, k: Key, held: Held) -> None:
        """A storage tier will not write ``held``: dropped, unless another tier keeps it."""
        if self._deferred is not None:
            self._deferred.append(k)
        elif not self._dram.holds(k, held) and not any(t.find(k) is not None for t in self._lower):
            self._dropped += 1

    def _writes(self) -> int:
        return sum(t.stats().writes for t in self._lower)

    def _begin(self, jobs: list[tuple[StorageTier, object]]) -> None:
        """Under the lock, where write-downs were planned: :meth:`close` now waits for
        them (see :meth:`_run_planned`)."""
        if jobs:
            self._busy += 1

    def _run_planned(self, jobs: list[tuple[StorageTier, object]]) -> list[bool | None]:
        """Carry out write-downs, in order, without the lock (see ``StorageTier.write``),
        then let a waiting :meth:`close` go on."""
        if not jobs:
            return []
        try:
            return [tier.write(job) for tier, job in jobs]
        finally:
            with self._cond:
                self._busy -= 1
                if not self._busy:
                    self._cond.notify_all()


def _check_anonymous_folder(config: StoreConfig) -> None:
    """Refuse an empty ``fingerprint`` on a folder that already holds records.

    Records name the model and layout that wrote them only through the fingerprint: a
    folder reused by another model with the default ``""`` served its blocks (another
    dtype and shape).  A fresh folder stays allowed (a throwaway store of one model:
    ``promptsplice bench offload``); the connector always sets one.
    """
    if config.fingerprint:
        return
    try:
        with os.scandir(config.disk_dir) as it:
            held = sum(1 for e in it if fmt.parse_record_name(e.name) is not None)
    except OSError:  # missing (created on open) or unusable (the tier reports it)
        return
    if held:
        raise ConfigError(
            f"StoreConfig.fingerprint is empty but disk_dir {config.disk_dir!r} already holds "
            f"{held} records, which may be another model's or KV layout's: name the model and "
            "KV layout that write the blocks (e.g. 'smollm2-135m/bfloat16/block32'; the splice "
            "connector sets it for you), or start from an empty folder"
        )


_FIRST_BATCH = 8  # refs parsed before the first match (then 16, 32, ...)


def _check_iterable(refs: Any) -> None:
    """``None`` or a number as the refs of a query is :class:`InputError`."""
    if isinstance(refs, str | bytes) or not hasattr(refs, "__iter__"):
        raise InputError(f"refs must be a sequence of block refs (chain_refs(...)), got {type(refs).__name__}")


def _weakly(method: Any, default: Any) -> Any:
    """``method`` called through a weak reference (``default`` once its store is gone),
    so a tier holding the callback does not keep its store alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return default if bound is None else bound(*args)

    return call


def _ref_list(refs: Any) -> list:
    """The block refs of one query, as a list (``None`` or a number is :class:`InputError`)."""
    _check_iterable(refs)
    return list(refs)


def _close_shared_stores() -> None:
    """At interpreter exit: write the shared stores' DRAM blocks down, finish the
    pending write-downs (the writer is a daemon thread, so they would be dropped) and
    release their folders.  (Until 2026-12-07 DRAM was dropped: a restart served only
    the blocks evicted before it, not the most recent ones.)"""
    with _SHARED_LOCK:
        stores = list(_SHARED.values())
        _SHARED.clear()
    for store in stores:
        try:
            if not store.closed:
                store.flush()  # DRAM's blocks down to the disk (shared) tier: a restart serves them
            store.close()
        except Exception:  # noqa: BLE001 - exiting anyway; say what was lost
            _log.exception("block store: closing %s at exit failed", store.config.disk_dir)


atexit.register(_close_shared_stores)


def shared_store(config: StoreConfig) -> BlockStore:
    """The process's one open :class:`BlockStore` for ``config`` (opened on first use).

    The connector's scheduler and worker sides run in one process and must share a
    store (a folder admits one store); a closed store is replaced by a fresh one (a
    closing one once its close finished: it holds the folder till then).  The
    shared stores are closed at interpreter exit, so write-downs in flight finish.
    """
    if not isinstance(config, StoreConfig):  # (a dict was a TypeError: unhashable)
        raise ConfigError(f"shared_store takes a StoreConfig, got {type(config).__name__}: pass StoreConfig(...)")
    with _SHARED_LOCK:
        store = _SHARED.get(config)
        if store is not None and store.closed:
            store._wait_shut()  # a closing store still holds the folder: replaced once closed
            store = None
        if store is None:
            store = BlockStore(config)
            _SHARED[config] = store
        return store
