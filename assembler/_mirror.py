"""A mirror of the engine's prefix cache, by the same rules as vLLM's block pool.

The mirror does not store KV; it replays what vLLM's v1 ``BlockPool`` does with block
*hashes*, so the assembler can predict hits before a request is sent:

* only full blocks have a hash (:mod:`promptsplice.blocks`, chained, salted at the root);
* a request hits the longest run of leading cached blocks, but never its last prompt
  token (``max_cache_hit_length = num_tokens - 1``), so at most
  ``(num_tokens - 1) // block_size`` blocks;
* a running request takes one slot per block it needs (the partial last block too) from
  the head of the free queue, evicting whatever hash that slot held;
* a finished request frees its blocks in *reverse* order: cached blocks to the tail of
  the free queue (so its tail blocks are evicted before its head blocks), blocks without
  a hash (the partial last block) to the *head*, reused before any cached block is
  evicted (vLLM's ``BlockPool.free_blocks``).

With ``capacity_blocks`` equal to the engine's block count and nothing else using the
engine, predictions equal vLLM's ``num_cached_tokens`` exactly.  ``capacity_blocks=None``
is an unbounded cache (slots are created on demand).  ``min_hit_tokens`` models servers
that serve no hit below a minimum prefix (OpenAI: 1,024 tokens, then 128-token steps:
``PrefixCacheMirror(128, min_hit_tokens=1024)``, see ``Assembler.for_openai``).

One owner updates a mirror: the engine whose cache it models (``EmbeddedEngine`` admits
every request it ran), or a standalone ``Assembler`` (it models an engine that receives
every prompt it assembles).  Others read it through a :class:`MirrorView`, which has
the queries and none of the updates.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, KeysView, Sequence
from typing import Any, NamedTuple

from promptsplice.blocks import BlockHash, cacheable_blocks, cdiv
from promptsplice._validate import check_block_size, check_int, check_optional_int, is_int
from promptsplice.errors import ConfigError, InputError

__all__ = ["PrefixCacheMirror", "MirrorView", "Prediction", "BlockState"]


class BlockState(enum.Enum):
    """What the mirror knows about one block hash."""

    CACHED = "cached"
    ABSENT = "absent"


class Prediction(NamedTuple):
    """Predicted prefix-cache outcome of one request."""

    cached_tokens: int
    cached_blocks: int
    full_blocks: int


class PrefixCacheMirror:
    """Thread-safe replay of vLLM's prefix-cache block pool over block hashes."""

    def __init__(
        self, block_size: int, capacity_blocks: int | None = None, *, min_hit_tokens: int = 0
    ) -> None:
        check_block_size(block_size)
        check_int(min_hit_tokens, "min_hit_tokens", minimum=0)
        if min_hit_tokens % block_size:
            raise ConfigError(
                f"min_hit_tokens must be a non-negative multiple of block_size {block_size}, "
                f"got {min_hit_tokens}"
            )
        self.min_hit_tokens = min_hit_tokens
        check_optional_int(capacity_blocks, "capacity_blocks")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._lock = threading.Lock()
        # hash -> slots holding it (vLLM keeps a second copy when a block is recomputed).
        self._cached: dict[BlockHash, list[int]] = {}
        # Slots are created when first used (slot i is the i-th ever allocated): a
        # bounded mirror of 262K blocks costs nothing until requests fill it.
        self._slot_hash: list[BlockHash | None] = []
        # Free queue: slot id -> None, head (next evicted) first.  The bounded pool's
        # never-used slots (``capacity_blocks - len(_slot_hash)``) stand, uncreated,
        # behind the freed slots without a hash (always a head run of the queue) and
        # ahead of every cached one: vLLM's queue in the same order.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._spare: list[int] = []  # unbounded mode: uncached slots to reuse
        self.queries_tokens = 0
        self.hit_tokens = 0

    # -- queries -------------------------------------------------------------------
    def state(self, block_hash: BlockHash) -> BlockState:
        with self._lock:
            return BlockState.CACHED if block_hash in self._cached else BlockState.ABSENT

    def has(self, block_hash: bytes) -> bool:
        """Lock-free membership test (one atomic dict lookup), for hot loops."""
        return block_hash in self._cached

    def cached_hashes(self) -> KeysView[BlockHash]:
        """A live, read-only view of the cached hashes: ``h in view`` is the lock-free
        test of :meth:`has` without a call per block (the layout walk's hot loop)."""
        return self._cached.keys()

    def reusable_hashes(self) -> Container[bytes]:
        """What a layout can count on finding (the walk that orders and pads a prompt):
        here the cached hashes; an engine whose connector loads a block store's blocks
        back adds those (:meth:`MirrorView.reusable_hashes`).  Predictions
        (:meth:`predict`) stay those of the cache alone."""
        return self._cached.keys()

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._cached

    def __len__(self) -> int:
        with self._lock:
            return len(self._cached)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading hashes that are cached (no side effect)."""
        with self._lock:
            return self._match(hashes)

    def _match(self, hashes: Sequence[BlockHash]) -> int:
        cached = self._cached
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def predict(self, hashes: Sequence[BlockHash], num_tokens: int) -> Prediction:
        """What a request of ``num_tokens`` tokens with these full-block hashes would hit.

        Raises :class:`~promptsplice.errors.InputError` when ``num_tokens`` is not an
        int >= 1, ``hashes`` is not a list or tuple of ``bytes`` block hashes, or there
        are more hashes than full blocks in ``num_tokens`` tokens."""
        _check_request(hashes, num_tokens, num_tokens, self.block_size)
        with self._lock:
            return self._predict(hashes, num_tokens)

    def _predict(self, hashes: Sequence[BlockHash], num_tokens: int) -> Prediction:
        limit = cacheable_blocks(num_tokens, self.block_size)
        hit = self._match(hashes[:limit])
        if hit * self.block_size < self.min_hit_tokens:
            hit = 0  # e.g. OpenAI: nothing is served from cache below 1024 tokens
        return Prediction(hit * self.block_size, hit, len(hashes))

    # -- updates -------------------------------------------------------------------
    def admit(
        self,
        hashes: Sequence[BlockHash],
        num_tokens: int,
        *,
        num_computed_tokens: int | None = None,
        record: bool = True,
    ) -> Prediction:
        """Replay one request that runs to completion; returns its prediction.

        ``num_tokens`` is the prompt length (the hit rule's limit).  ``hashes`` are the
        full-block hashes of every token whose KV the request computes: the prompt, and
        with ``max_tokens = k`` the first ``k - 1`` generated tokens (the last sampled
        token is never computed).  ``num_computed_tokens`` (default: the prompt length)
        sizes the slots the request holds while it runs: ``cdiv(num_computed_tokens,
        block_size)``, the partial last block included.

        Raises :class:`~promptsplice.errors.InputError` when ``num_tokens`` is not an
        int >= 1, ``num_computed_tokens`` is not None or an int >= ``num_tokens``,
        ``hashes`` is not a list or tuple of ``bytes`` block hashes, or there are more
        hashes than full blocks in the computed tokens; :class:`ConfigError` when the
        request needs more blocks than the mirror holds (nothing changes then).
        """
        bs = self.block_size
        computed = num_tokens if num_computed_tokens is None else num_computed_tokens
        if num_computed_tokens is not None and (
            not is_int(num_computed_tokens) or (is_int(num_tokens) and num_computed_tokens < num_tokens)
        ):
            raise InputError(
                f"num_computed_tokens must be None or an int >= num_tokens ({num_tokens!r}): the "
                f"prompt's tokens plus the generated tokens whose KV was computed, got "
                f"{num_computed_tokens!r}"
            )
        _check_request(hashes, num_tokens, computed, bs)
        unbounded = self.capacity_blocks is None
        with self._lock:
            pred = self._predict(hashes, num_tokens)
            total = cdiv(max(computed, len(hashes) * bs), bs)
            hit_slots = [self._cached[h][0] for h in hashes[: pred.cached_blocks]]
            new_blocks = total - pred.cached_blocks
            if not unbounded and new_blocks > self._free_count() - len(hit_slots):
                # refused before anything changes (the mirror stays usable); the hit
                # slots that sit in the free queue are taken out of it first
                free_slots = self._free_count() - sum(slot in self._free for slot in hit_slots)
                if new_blocks > free_slots:
                    raise ConfigError(
                        f"a request needs more than the mirror's {self.capacity_blocks} blocks; "
                        "raise capacity_blocks (the engine would refuse this request too)"
                    )
            if record:
                self.queries_tokens += num_tokens
                self.hit_tokens += pred.cached_tokens
            free = self._free
            # The hit slots stay in the free queue while the request "runs" (moved, not
            # popped and re-added: 4x cheaper for a 500-block hit); allocation skips them.
            in_use = set(hit_slots) if hit_slots and total > pred.cached_blocks else None
            skipped: list[int] = []  # hit slots met at the head: out of the queue until moved back
            slots: list[int] = []
            for i in range(pred.cached_blocks, total):
                slot = self._allocate(in_use, skipped)
                # A block computed again (past the hit limit or min_hit_tokens) is a
                # second copy, as in vLLM's pool; unbounded, where nothing is evicted,
                # one copy answers every query, so the slot goes back as a spare.
                if i < len(hashes) and not (unbounded and hashes[i] in self._cached):
                    self._cached.setdefault(hashes[i], []).append(slot)
                    self._slot_hash[slot] = hashes[i]
                slots.append(slot)
            # Freed in reverse order (tail blocks first).  Like vLLM's
            # BlockPool.free_blocks, slots without a hash (the partial last block) go to
            # the *head* of the free queue, reused before any cached block is evicted;
            # cached slots go to the tail (LRU), the hit slots (the request's first
            # blocks) last.
            uncached: list[int] = []
            slot_hash = self._slot_hash
            for slot in reversed(slots):
                if slot_hash[slot] is not None:
                    free[slot] = None
                elif unbounded:
                    self._spare.append(slot)  # unbounded: an uncached slot is just reused
                else:
                    uncached.append(slot)
            move = free.move_to_end
            for slot in reversed(hit_slots):
                if slot in free:
                    move(slot)
                else:  # taken out at the head by _allocate: back at the tail
                    free[slot] = None
            for slot in reversed(uncached):  # prepend, keeping their order at the head
                free[slot] = None
                free.move_to_end(slot, last=False)
            return pred

    def _free_count(self) -> int:
        """Free slots of a bounded pool: the queue and the never-used ones."""
        return len(self._free) + self.capacity_blocks - len(self._slot_hash)  # type: ignore[operator]

    def _new_slot(self) -> int:
        self._slot_hash.append(None)
        return len(self._slot_hash) - 1

    def _allocate(self, in_use: set[int] | None = None, skipped: list[int] | None = None) -> int:
        """A free slot from the head of the queue, evicting its hash; ``in_use``: slots
        of the running request, never taken: met at the head, they leave the queue into
        ``skipped`` (:meth:`admit` puts them back at the tail), once per request."""
        if self.capacity_blocks is None:  # unbounded: never evict
            if self._spare:
                return self._spare.pop()
            return self._new_slot()
        free = self._free
        if free and self._slot_hash[next(iter(free))] is None:
            return free.popitem(last=False)[0]  # a freed slot without a hash (the head run)
        if len(self._slot_hash) < self.capacity_blocks:
            return self._new_slot()  # a never-used slot, before any cached one
        while True:
            if not self._free:
                raise ConfigError(
                    f"a request needs more than the mirror's {self.capacity_blocks} blocks; "
                    "raise capacity_blocks (the engine would refuse this request too)"
                )
            slot, _ = self._free.popitem(last=False)
            if in_use is None or slot not in in_use:
                break
            assert skipped is not None
            skipped.append(slot)
        old = self._slot_hash[slot]
        if old is not None:
            holders = self._cached[old]
            holders.remove(slot)
            if not holders:
                del self._cached[old]
            self._slot_hash[slot] = None
        return slot

    def clear(self, *, capacity_blocks: int | None | object = ...) -> None:
        """Forget every hash (like vLLM's ``reset_prefix_cache``); ``capacity_blocks``
        (optional): the new pool size, for an engine restarted with another one."""
        if capacity_blocks is not ... and capacity_blocks is not None:
            if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
                raise ConfigError(
                    f"capacity_blocks must be positive (or None for unbounded), got {capacity_blocks}"
                )
        with self._lock:
            if capacity_blocks is not ...:
                self.capacity_blocks = capacity_blocks  # type: ignore[assignment]
            self._cached.clear()
            self._slot_hash, self._free, self._spare = [], OrderedDict(), []

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queries_tokens if self.queries_tokens else 0.0

    def view(self, behind: Callable[[bytes], bool] | None = None) -> MirrorView:
        """A read-only view of this mirror (what an engine lends its assemblers).
        ``behind``: whether a block the cache lacks is held behind it and loaded back on
        a hit (an engine's block store), for the layout walk (:meth:`reusable_hashes`)."""
        return MirrorView(self, behind)


def _check_request(hashes: Any, num_tokens: Any, covered: Any, block_size: int) -> None:
    """The arguments of one request (:meth:`PrefixCacheMirror.predict`, ``admit``):
    ``num_tokens`` an int >= 1; ``hashes`` a list or tuple of ``bytes`` (the container
    and its first element are checked, not every hash: this runs once per request); at
    most ``covered // block_size`` of them.  Else :class:`InputError`."""
    if not is_int(num_tokens) or num_tokens < 1:
        raise InputError(
            f"num_tokens must be the request's prompt length, an int >= 1 (len(token_ids)), "
            f"got {num_tokens!r}"
        )
    if type(hashes) is not list and type(hashes) is not tuple:
        if isinstance(hashes, (str, bytes, bytearray, memoryview)) or not isinstance(hashes, Sequence):
            raise InputError(
                f"hashes must be a list of block hashes (bytes, e.g. "
                f"promptsplice.blocks.chain_hashes(token_ids, block_size)), got {type(hashes).__name__}"
            )
    if hashes and not isinstance(hashes[0], bytes):
        raise InputError(
            f"hashes must hold block hashes (bytes, e.g. from promptsplice.blocks.chain_hashes), "
            f"got a {type(hashes[0]).__name__} first"
        )
    n = len(hashes)
    if n * block_size > covered:
        raise InputError(
            f"{n} block hashes cover {n * block_size} tokens at block_size {block_size}, more "
            f"than the request's {covered} tokens (only full blocks have a hash: at most "
            f"{covered // block_size}); pass the hashes of this request's own tokens, "
            f"chain_hashes(token_ids, block_size)"
        )


class MirrorView:
    """Read-only access to a :class:`PrefixCacheMirror` owned by someone else.

    It answers the same queries (``predict``, ``match``, ``has``, ``len``, the sizes),
    always from the owner's current state, and has no ``admit`` or ``clear``: an
    assembler holding a view predicts hits and never updates the engine's mirror.
    """

    __slots__ = ("_mirror", "_behind")

    def __init__(self, mirror: PrefixCacheMirror, behind: Callable[[bytes], bool] | None = None) -> None:
        if not isinstance(mirror, PrefixCacheMirror):
            raise ConfigError(f"a MirrorView wraps a PrefixCacheMirror, got {type(mirror).__name__}")
        if behind is not None and not callable(behind):
            raise ConfigError(f"behind must be a callable block_hash -> bool, got {type(behind).__name__}")
        self._mirror = mirror
        self._behind = behind

    @property
    def block_size(self) -> int:
        return self._mirror.block_size

    @property
    def capacity_blocks(self) -> int | None:
        return self._mirror.capacity_blocks

    @property
    def min_hit_tokens(self) -> int:
        return self._mirror.min_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self._mirror.hit_rate

    def cache_only(self) -> MirrorView:
        """A view of the same mirror without what is held behind the cache (no
        ``behind``): layouts planned on the engine's own prefix cache alone."""
        return MirrorView(self._mirror)

    def state(self, block_hash: BlockHash) -> BlockState:
        return self._mirror.state(block_hash)

    def has(self, block_hash: bytes) -> bool:
        return self._mirror.has(block_hash)

    def cached_hashes(self) -> KeysView[BlockHash]:
        return self._mirror.cached_hashes()

    def reusable_hashes(self) -> Container[bytes]:
        """The mirror's cached hashes, and the blocks held behind the cache (the view's
        ``behind``: what a layout reuses on an engine with a block store, although
        :meth:`predict` counts vLLM's own cache only)."""
        cached = self._mirror.reusable_hashes()
        return cached if self._behind is None else _Either(cached, self._behind)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._mirror

    def __len__(self) -> int:
        return len(self._mirror)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        return self._mirror.match(hashes)

    def predict(self, hashes: Sequence[BlockHash], num_tokens: int) -> Prediction:
        return self._mirror.predict(hashes, num_tokens)

    def __repr__(self) -> str:
        return f"MirrorView(block_size={self.block_size}, capacity_blocks={self.capacity_blocks}, cached={len(self)})"


class _Either:
    """``h in cached or behind(h)``: the cache first (a lock-free lookup), then what is
    held behind it."""

    __slots__ = ("_cached", "_behind")

    def __init__(self, cached: Container[bytes], behind: Callable[[bytes], bool]) -> None:
        self._cached, self._behind = cached, behind

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._cached or (isinstance(block_hash, bytes) and self._behind(block_hash))
