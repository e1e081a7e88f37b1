"""The connector's worker side: loads (and relocates) stored blocks into the paged KV
cache before the forward pass, saves newly computed blocks after it.  Torch and the
kernels; never vLLM: tests drive it with plain tensors shaped like the engine's cache.

A stored block is one payload ``[layers, r, *block]`` (``r`` cache-tensor blocks per
vLLM block, 1 on CPU) in the cache's own per-block layout.  Where the blocks sit in a
cache tensor and where K and V sit in a block is read once, through
:func:`promptsplice.kernels.paged_kv` (the backend's name and the cache tensor); the
worker itself only indexes the block axis it names.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from promptsplice.engine_adapters.connector._scheduler import LoadItem, SaveItem, SpliceMetadata
from promptsplice.engine_adapters.store._store import BlockStore, PutStatus
from promptsplice.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from promptsplice.kernels import RopeConfig

__all__ = ["SpliceWorker", "WorkerStats"]

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerStats:
    """Counters of the worker side (blocks, since the worker was built)."""

    loaded_blocks: int = 0
    relocated_blocks: int = 0
    load_errors: int = 0
    saved_blocks: int = 0
    save_errors: int = 0
    skipped_saves: int = 0
    """Blocks not saved because the step's forward pass failed (their KV is partial)."""


class SpliceWorker:
    """The worker-side half: loads (and relocates) stored blocks into the paged cache
    before the forward pass, saves newly computed blocks after it.

    ``caches``: every attention layer's cache tensor, in layer order (the order the
    payload's first axis follows), all of attention backend ``backend`` (vLLM's name,
    e.g. ``"CPU_ATTN"``; ``isa``: the layers' CPU attention ISA).  vLLM may split its
    ``block_size`` blocks into smaller cache-tensor blocks; the cache's shape says.
    ``rope`` enables relocation (``promptsplice.kernels.relocate_blocks``) where the
    layout is readable; without it only delta-0 loads (offload hits) are possible.
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        block_size: int,
        caches: Mapping[str, torch.Tensor],
        backend: str,
        isa: str | None = None,
        rope: RopeConfig | None = None,
        history: int = 32,
    ) -> None:
        import torch

        from promptsplice.kernels import paged_kv

        if not caches:
            raise ConfigError("the splice worker needs at least one KV cache tensor")
        self.store = store
        self.block_size = int(block_size)
        self.names = list(caches)
        self.caches = [caches[n] for n in self.names]
        first = self.caches[0]
        for name, t in zip(self.names, self.caches):
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"KV cache {name!r} is not a tensor ({type(t).__name__})")
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ConfigError(
                    f"KV cache {name!r} is {tuple(t.shape)} {t.dtype}, the first layer's is "
                    f"{tuple(first.shape)} {first.dtype}: one payload layout needs equal layers"
                )
        self.paged = paged_kv(backend, first, isa=isa)
        """Block axis, cache-tensor block size and K/V layout of the caches."""
        kbs = self.paged.block_size
        if kbs <= 0 or self.block_size % kbs:
            raise ConfigError(
                f"vLLM's block_size {self.block_size} is not a multiple of the cache's "
                f"kernel block size {kbs}"
            )
        self.block_dim = self.paged.block_dim
        self.blocks_per_block = self.block_size // kbs
        per_layer = list(first.shape)
        per_layer[self.block_dim] = self.blocks_per_block
        self.payload_shape = (len(self.caches), *per_layer)
        self.dtype = first.dtype
        self.rope = rope
        self.stats = WorkerStats()
        self.history: deque[tuple[str, LoadItem | SaveItem, int]] = deque(maxlen=history)
        """Recent work: ``("load", item, blocks loaded)`` and ``("save", item, blocks
        stored)`` (for tests and debugging)."""
        self._errors: set[int] = set()
        self._failed: set[str] = set()

    @property
    def can_relocate(self) -> bool:
        return self.paged.layout is not None and self.rope is not None

    def kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        """Cache-tensor block ids of vLLM blocks ``block_ids`` (``r`` each, in order)."""
        r = self.blocks_per_block
        return [b * r + i for b in block_ids for i in range(r)]

    # -- loads ------------------------------------------------------------------
    def start_load(self, meta: SpliceMetadata) -> None:
        """Carry out every load of this step (before the forward pass)."""
        self._failed = set()
        for item in meta.loads:
            self.load(item)

    def load(self, item: LoadItem) -> int:
        """Load one item; returns the blocks written.

        The leading blocks the store serves are written; from the first block it does
        not serve (gone, damaged, wrong shape) on, every block of the item is reported
        by :meth:`take_load_errors` and vLLM recomputes from there.  Pins of the
        request are released.
        """
        payloads = []
        try:
            for i, ref in enumerate(item.refs):
                found = self.store.get(ref, salt=item.salt_of(i))
                p = found.payload
                if not found.status.hit or p is None or tuple(p.shape) != self.payload_shape or p.dtype != self.dtype:
                    if found.status.hit:
                        _log.warning(
                            "splice connector: stored block has shape %s %s, the engine needs %s %s",
                            tuple(p.shape), p.dtype, self.payload_shape, self.dtype,
                        )
                    break
                payloads.append(p)
            n = len(payloads)
            deltas = list(item.deltas[:n])
            if n and any(deltas) and not self.can_relocate:
                _log.warning("splice connector: cannot relocate on this engine; recomputing")
                n = 0
            if n:
                self._write(payloads[:n], item.block_ids[:n], deltas[:n])
        except Exception:  # noqa: BLE001 - a failed load is recomputed, never fatal
            _log.exception("splice connector: loading blocks for %s failed", item.req_id)
            n = 0
        finally:
            self.store.release(item.req_id)
        if n < len(item.block_ids):
            self._errors.update(item.block_ids[n:])
            self._failed.add(item.req_id)
            self.stats.load_errors += len(item.block_ids) - n
        self.stats.loaded_blocks += n
        self.stats.relocated_blocks += sum(1 for d in item.deltas[:n] if d)
        self.history.append(("load", item, n))
        return n

    def _write(self, payloads: list[torch.Tensor], block_ids: Sequence[int], deltas: list[int]) -> None:
        import torch

        from promptsplice.kernels import relocate_blocks

        r = self.blocks_per_block
        kids = torch.tensor(self.kernel_ids(block_ids), dtype=torch.int64, device=self.caches[0].device)
        kdeltas = [d for d in deltas for _ in range(r)]
        moved = any(kdeltas)
        for layer, cache in enumerate(self.caches):
            src = torch.cat([p[layer] for p in payloads], dim=self.block_dim).to(cache.device)
            if moved:
                relocate_blocks(cache, src, kids, kdeltas, self.rope, self.paged.layout)
            else:
                cache.index_copy_(self.block_dim, kids, src)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids that failed to load since the last call (then cleared)."""
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ------------------------------------------------------------------
    def save(self, meta: SpliceMetadata) -> int:
        """Store this step's newly computed blocks (after the forward pass).

        Requests whose load failed in this step are skipped: vLLM recomputes them.
        Returns the blocks stored.
        """
        stored = 0
        for item in meta.saves:
            if item.req_id in self._failed:
                continue
            stored += self._save_item(item)
        return stored

    def skip_saves(self, meta: SpliceMetadata) -> int:
        """Count, and do not store, this step's blocks: its forward pass failed."""
        n = sum(len(item.refs) for item in meta.saves)
        if n:
            _log.warning("splice connector: the forward pass failed; %d block(s) of this step not saved", n)
        self.stats.skipped_saves += n
        return n

    def _save_item(self, item: SaveItem) -> int:
        import torch

        n = len(item.refs)
        if n == 0:
            return 0
        stored = 0
        try:
            kids = torch.tensor(self.kernel_ids(item.block_ids), dtype=torch.int64, device=self.caches[0].device)
            out = torch.empty((n, *self.payload_shape), dtype=self.dtype)
            r, bd = self.blocks_per_block, self.block_dim
            for layer, cache in enumerate(self.caches):
                g = cache.index_select(bd, kids).unflatten(bd, (n, r)).movedim(bd, 0)
                out[:, layer].copy_(g)
            for i, ref in enumerate(item.refs):
                status = self.store.put(ref, out[i], salt=item.salt)
                if status in (PutStatus.STORED, PutStatus.EXISTS):
                    stored += 1
        except Exception:  # noqa: BLE001 - a save is best effort
            _log.exception("splice connector: saving blocks of %s failed", item.req_id)
            self.stats.save_errors += n - stored
        self.stats.saved_blocks += stored
        self.history.append(("save", item, stored))
        return stored
