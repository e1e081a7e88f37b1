"""The connector's worker side: loads (and relocates) stored blocks into the paged KV
cache before the forward pass, saves newly computed blocks after it.  Torch and the
kernels; never vLLM: tests and ``benchmarks/gpu_connector_check`` drive it with plain
tensors shaped like the engine's cache.  Kept as one module (~620 lines): loads, saves,
probes and the device streams order against each other (a save's gather before the next
step's writes, a failed load quarantining the saves after it), in one place.

A stored block is one payload ``[layers, r, *block]`` (``r`` cache-tensor blocks per
vLLM block, 1 on CPU) in the cache's own per-block layout.  Where the blocks sit in a
cache tensor and where K and V sit in a block is read once, through
:func:`promptsplice.kernels.paged_kv` (the backend's name and the cache tensor); the
worker itself only indexes the block axis it names.

Device-generic (:class:`_DeviceIO`): on CPU every copy runs inline.  With CUDA caches a
save gathers the blocks on a side stream that first waits on an event recorded after
the forward pass's writes, copies them into page-locked host buffers without blocking
the host, and hands them to the store only once the copy's event has completed
(:meth:`SpliceWorker.flush_saves`, polled at every step: never on the forward path);
the next step's cache writes wait on the device for the gather only (a block vLLM
freed may be rewritten then), not for the host-bound copy.  When a request finishes,
:meth:`SpliceWorker.settle` waits for its copies still in flight (the connector calls
it), so that the next lookup finds a finished request's blocks, as on CPU: a precompute
followed by a relocating request, an agent's next turn after an idle engine.
A load copies each stored block (page-locked when this worker saved it) into a device
staging buffer on a load stream; the relocation kernel then reads the staged blocks and
writes rotated K / copied V into the destination blocks (the relocation *is* the copy
into the cache).  ``start_load(meta, per_layer=True)`` leaves each layer's relocation to
:meth:`SpliceWorker.wait_for_layer` (vLLM's ``wait_for_layer_load``), so layer ``l+1``'s
relocation is queued only when layer ``l`` is reached; the host-to-device copies are
whole blocks (one DMA of all layers) issued by ``start_load``, because per-layer copies
(64 KiB for an 8B model) run far below the link's bandwidth.  The connector loads per
layer (and asks vLLM for piecewise CUDA graphs, whose replays keep the hooks); a layer
whose hook never came is written after the forward pass and its blocks are reported as
load errors, so a skipped hook costs a recompute, never a wrong answer.

Probes (:meth:`SpliceWorker.probe`): after the forward pass, in ``save``, each probed
block's fresh KV (all layers) is compared with its old KV from the store, the old keys
re-rotated by the delta (:func:`promptsplice.kernels.kv_deviation`); the forward pass
itself is untouched.  Measured on CPU only: on CUDA the result's ``tolist`` waits for
the comparison on the host.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from promptsplice.engine_adapters.connector._plans import BlockDeviation
from promptsplice.engine_adapters.connector._scheduler import LoadItem, ProbeItem, SaveItem, SpliceMetadata
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
    """Loaded blocks of approximate KV: moved, or in place after other tokens."""
    load_errors: int = 0
    saved_blocks: int = 0
    save_errors: int = 0
    skipped_saves: int = 0
    """Blocks not saved because the step's forward pass failed (their KV is partial)."""
    probed_blocks: int = 0
    """Recomputed blocks compared with their relocated old KV (:attr:`SpliceWorker.deviations`)."""
    probe_s: float = 0.0
    """Host time spent on those comparisons (after the forward pass, in ``save``)."""
    late_layers: int = 0
    """Deferred layer loads no ``wait_for_layer`` asked for before the forward pass
    ended: their blocks were reported as load errors (vLLM recomputes them)."""
    quarantined_saves: int = 0
    """Blocks not saved because a load failed in their step or the step before: any
    request of those steps may have attended to the failed blocks (vLLM shares them
    through its prefix cache the moment they are allocated, and an asynchronously
    scheduled next step was built before the error was known)."""


class _DeviceIO:
    """Streams, events and host buffers for the caches' device.

    CUDA: a side stream for saves, a load stream for host-to-device copies, events
    between them and the compute (current) stream, page-locked host buffers.  CPU: no
    streams, events complete at once, plain host memory: the same call sequence runs
    inline, so CPU tests walk the code paths the GPU runs.
    """

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self.cuda = device.type == "cuda"
        self.side: Any = None
        self.load_stream: Any = None
        if self.cuda:
            try:
                torch.empty(1, pin_memory=True)
            except RuntimeError as exc:
                raise ConfigError(
                    f"the KV caches are on {device}, whose blocks reach the store through "
                    f"page-locked (pinned) host memory, and this platform cannot pin memory "
                    f"({exc}); run the engine without kv_store"
                ) from exc
            self.side = torch.cuda.Stream(device)
            self.load_stream = torch.cuda.Stream(device)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def mark(self, stream: Any = None) -> Any:
        """An event after the work queued so far on ``stream`` (default: the current
        one); ``None`` on CPU, where that work is already done."""
        if not self.cuda:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        import torch

        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait_on(self, ev: Any) -> None:
        """The current stream waits (on the device, not the host) for ``ev``."""
        if ev is not None:
            import torch

            torch.cuda.current_stream(self.device).wait_event(ev)

    @staticmethod
    def done(ev: Any, *, block: bool) -> bool:
        if ev is None:
            return True
        if block:
            ev.synchronize()
            return True
        return bool(ev.query())


@dataclass(slots=True)
class _LoadJob:
    """One item's staged blocks: ``stage`` ``[n, layers, ...]`` on the device, ready
    after ``ready``; ``layers_done`` relocated so far."""

    item: LoadItem
    stage: Any
    ready: Any
    kids: list[int]
    kdeltas: list[int]
    layers_done: set[int] = field(default_factory=set)
    failed: bool = False
    relocate: Any = None
    """The job's :class:`~promptsplice.kernels.PreparedRelocation` (checked and shipped
    to the device at the first layer, applied to every layer)."""


class SpliceWorker:
    """The worker-side half: loads (and relocates) stored blocks into the paged cache
    before the forward pass, saves newly computed blocks after it.

    ``caches``: every attention layer's cache tensor, in layer order (the order the
    payload's first axis follows), all of attention backend ``backend`` (vLLM's name,
    e.g. ``"CPU_ATTN"``, ``"FLASH_ATTN"``, ``"FLASHINFER"``; ``isa``: the layers' CPU
    attention ISA).  vLLM may split its ``block_size`` blocks into smaller cache-tensor
    blocks; the cache's shape says.  ``rope`` enables relocation
    (``promptsplice.kernels.prepare_relocation``, implementation ``impl``) where the layout
    is readable; without it only delta-0 loads (offload hits) are possible.
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
        impl: str = "auto",
    ) -> None:
        import torch

        from promptsplice.kernels import paged_kv

        if not caches:
            raise ConfigError("the splice worker needs at least one KV cache tensor")
        self.store = store
        self.block_size = int(block_size)
        self.names = list(caches)
        self.caches = [caches[n] for n in self.names]
        self._layer_of = {n: i for i, n in enumerate(self.names)}
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
        self.impl = impl
        self.io = _DeviceIO(first.device)
        self.stats = WorkerStats()
        self.history: deque[tuple[str, LoadItem | SaveItem, int]] = deque(maxlen=history)
        """Recent work: ``("load", item, blocks loaded)`` and ``("save", item, blocks
        stored)`` (for tests and debugging)."""
        self.deviations: deque[BlockDeviation] = deque(maxlen=1024)
        """The latest probes' results, oldest first (``stats.probed_blocks`` counts all)."""
        self.on_probe: Callable[[str, BlockDeviation], None] | None = None
        """Told each probe's result with its request id (the connector passes them to
        the request's ack: served engines)."""
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        self._quarantine = 0  # saves still to skip after a load error (this step, the next)
        self._jobs: list[_LoadJob] = []
        self._saves: deque[tuple[Any, list[torch.Tensor], SaveItem, Any]] = deque()
        self._saves_lock = threading.Lock()  # settle may come from another thread
        self._gathered: Any = None
        """Event after the last save's gather: the next step's writes wait on it (a block
        freed by vLLM may be rewritten then), the host-bound copy does not."""

    @property
    def can_relocate(self) -> bool:
        from promptsplice.kernels import SUPPORTED_CACHE_DTYPES

        # a cache dtype the kernels cannot rotate (a quantized uint8 cache) failed every
        # relocating load, and each failure quarantined the engine's saves
        return self.paged.layout is not None and self.rope is not None and self.dtype in SUPPORTED_CACHE_DTYPES

    def kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        """Cache-tensor block ids of vLLM blocks ``block_ids`` (``r`` each, in order)."""
        r = self.blocks_per_block
        return [b * r + i for b in block_ids for i in range(r)]

    # -- loads ------------------------------------------------------------------
    def start_load(self, meta: SpliceMetadata, *, per_layer: bool = False) -> None:
        """Start every load of this step (before the forward pass).

        ``per_layer``: leave each layer's write to :meth:`wait_for_layer` (every layer
        must be waited on, or :meth:`finish_loads` called, before the forward pass
        reads it); otherwise every layer is written before this returns (as ordered
        work on the compute stream, on CUDA).
        """
        self.flush_saves()
        self.finish_loads(late=True)
        self.io.wait_on(self._gathered)  # this step's writes come after the last gather
        self._gathered = None
        self._failed = set()
        for item in meta.loads:
            self.load(item, defer=per_layer)

    def load(self, item: LoadItem, *, defer: bool = False) -> int:
        """Load one item; returns the blocks staged (written, unless ``defer``).

        The leading blocks the store serves are loaded; from the first block it does
        not serve (gone, damaged, wrong shape) on, every block of the item is reported
        by :meth:`take_load_errors` and vLLM recomputes from there.  Pins of the
        request are released.
        """
        payloads = []
        job = None
        stage = None
        io = self.io
        try:
            with io.on(io.load_stream):  # entered once: per block it cost ~20 us of host time on CUDA
                stage = self._fetch(item, payloads)
            n = len(payloads)
            deltas = list(item.deltas[:n])
            if n and any(deltas) and not self.can_relocate:
                _log.warning("splice connector: cannot relocate on this engine; recomputing")
                n = 0
            if n:
                job = self._stage(item, payloads[:n], stage, item.block_ids[:n], deltas[:n])
                if not defer:
                    self._write_layers(job, range(len(self.caches)))
        except Exception:  # noqa: BLE001 - a failed load is recomputed, never fatal
            _log.exception("splice connector: loading blocks for %s failed", item.req_id)
            n, job = 0, None
        finally:
            self.store.release(item.req_id)
        if job is not None and defer:
            self._jobs.append(job)
        if n < len(item.block_ids):
            self._errors.update(item.block_ids[n:])
            self._failed.add(item.req_id)
            self._quarantine = 2
            self.stats.load_errors += len(item.block_ids) - n
        self.stats.loaded_blocks += n
        self.stats.relocated_blocks += item.approximate(n)
        self.history.append(("load", item, n))
        return n

    def _fetch(self, item: LoadItem, payloads: list[torch.Tensor]) -> torch.Tensor | None:
        """The leading blocks of ``item`` the store serves, appended to ``payloads`` and
        copied into a device staging buffer (non-blocking copies on the current stream:
        the load stream, on CUDA, where each block's DMA starts while the next one is
        looked up).  Returns the staging buffer (None when nothing was served)."""
        import torch

        stage = None
        for i, ref in enumerate(item.refs):
            found = self.store.get(ref, salt=item.salt_of(i))
            p = found.payload
            if not found.status.hit or p is None or tuple(p.shape) != self.payload_shape or p.dtype != self.dtype:
                if found.status.hit:
                    _log.warning(
                        "splice connector: stored block has shape %s %s, the engine needs %s %s; "
                        "discarded (the recomputed block is saved in its place)",
                        tuple(p.shape), p.dtype, self.payload_shape, self.dtype,
                    )
                    self.store.discard(ref.key)
                break
            payloads.append(p)
            if stage is None:
                stage = torch.empty((len(item.refs), *self.payload_shape), dtype=self.dtype, device=self.io.device)
            stage[i].copy_(p, non_blocking=True)
        return stage

    def _stage(
        self, item: LoadItem, payloads: list[torch.Tensor], stage: torch.Tensor | None,
        block_ids: Sequence[int], deltas: list[int],
    ) -> _LoadJob:
        """The job of the staged blocks (their copies issued: ready after an event on
        the load stream, at once on CPU)."""
        assert stage is not None
        stage, ready = stage[: len(payloads)], self.io.mark(self.io.load_stream)
        kdeltas = [d for d in deltas for _ in range(self.blocks_per_block)]
        return _LoadJob(item, stage, ready, self.kernel_ids(block_ids), kdeltas)

    def _write_layers(self, job: _LoadJob, layers) -> None:
        """Relocate (or copy) the staged blocks of ``layers`` into their caches, on the
        current stream, after the staging copy."""
        from promptsplice.kernels import prepare_relocation

        import torch

        if job.ready is not None:
            self.io.wait_on(job.ready)
            job.stage.record_stream(torch.cuda.current_stream(self.io.device))
        bd = self.block_dim
        moved = any(job.kdeltas)
        kids = torch.tensor(job.kids, dtype=torch.int64)
        kids_dev = kids if not moved else None
        for layer in layers:
            if layer in job.layers_done:
                continue
            cache = self.caches[layer]
            # [n, *per_layer] -> blocks stacked on the cache's block axis (a view when r == 1)
            src = job.stage[:, layer].movedim(0, bd).flatten(bd, bd + 1)
            if moved:
                if job.relocate is None:
                    job.relocate = prepare_relocation(
                        cache, src, kids, job.kdeltas, self.rope, self.paged.layout, impl=self.impl
                    )
                job.relocate(cache, src)
            else:
                if kids_dev is None or kids_dev.device != cache.device:
                    kids_dev = kids.to(cache.device, non_blocking=True)
                cache.index_copy_(bd, kids_dev, src)
            job.layers_done.add(layer)

    def wait_for_layer(self, layer_name: str) -> None:
        """Write layer ``layer_name``'s share of this step's deferred loads (vLLM's
        ``wait_for_layer_load``); a failure is reported as load errors of its items."""
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for job in self._jobs:
            self._guarded(job, (layer,))

    def finish_loads(self, *, late: bool = False) -> None:
        """Write every layer of the deferred loads not written yet.

        ``late``: the forward pass is over (``save``, ``skip_saves``, the next
        ``start_load``), so a layer written now was read unwritten: its blocks are
        reported as load errors and vLLM recomputes them (the request is not saved).
        That happens only when vLLM skipped a layer's ``wait_for_layer_load``."""
        jobs, self._jobs = self._jobs, []
        n_layers = len(self.caches)
        for job in jobs:
            missed = n_layers - len(job.layers_done)
            self._guarded(job, range(n_layers))
            if late and missed and not job.failed:
                _log.error(
                    "splice connector: %d layer(s) of %s were loaded after the forward pass "
                    "(no wait_for_layer_load); recomputing its blocks", missed, job.item.req_id,
                )
                self.stats.late_layers += missed
                self._fail(job)

    def _fail(self, job: _LoadJob) -> None:
        """Report ``job``'s blocks as load errors (vLLM recomputes them)."""
        job.failed = True
        n = len(job.kids) // self.blocks_per_block
        self._errors.update(job.item.block_ids)
        self._failed.add(job.item.req_id)
        self._quarantine = 2
        self.stats.load_errors += n
        self.stats.loaded_blocks -= n
        self.stats.relocated_blocks -= job.item.approximate(n)

    def _guarded(self, job: _LoadJob, layers) -> None:
        if job.failed:
            return
        try:
            self._write_layers(job, layers)
        except Exception:  # noqa: BLE001 - a failed load is recomputed, never fatal
            _log.exception("splice connector: writing loaded blocks for %s failed", job.item.req_id)
            self._fail(job)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids that failed to load since the last call (then cleared)."""
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ------------------------------------------------------------------
    def save(self, meta: SpliceMetadata) -> int:
        """Store this step's newly computed blocks (after the forward pass).

        Nothing is saved in a step with a failed load or the step after it
        (``WorkerStats.quarantined_saves``): vLLM recomputes the failed blocks, and any
        block computed meanwhile may have attended to them.  On
        CUDA the copies run on the side stream and the blocks reach the store in a
        later :meth:`flush_saves`; returns the blocks stored by this call (on CPU:
        all of this step's).
        """
        self.finish_loads(late=True)
        if self._quarantine:
            # A load failed in this step or the one before: every block computed in
            # either step may have attended to the failed blocks (see
            # WorkerStats.quarantined_saves), so none is saved under its exact keys.
            self._quarantine -= 1
            self.stats.quarantined_saves += sum(len(item.refs) for item in meta.saves)
            return self.flush_saves()
        for item in meta.saves:
            if item.req_id in self._failed or not item.refs:
                continue
            try:
                self._queue_save(item)
            except Exception:  # noqa: BLE001 - a save is best effort
                _log.exception("splice connector: saving blocks of %s failed", item.req_id)
                self.stats.save_errors += len(item.refs)
        for probe in meta.probes:
            if probe.req_id not in self._failed:
                self.probe(probe)
        # The next forward pass may write these blocks (a preempted request's blocks are
        # reused at once, and this vLLM may call start_load only after that pass): the
        # compute stream waits on the device for the gather, the host never does.
        self.io.wait_on(self._gathered)
        return self.flush_saves()

    def probe(self, item: ProbeItem) -> int:
        """Compare ``item``'s freshly computed blocks with their old KV in the store (the
        old keys re-rotated by the delta); appends a :class:`BlockDeviation` per block
        found to :attr:`deviations`.  Best effort: a block the store lacks, or a failure,
        is skipped.  Returns the blocks compared."""
        import torch

        from promptsplice.kernels import kv_deviation

        t0 = time.perf_counter()
        done = 0
        layout, bd, r = self.paged.layout, self.block_dim, self.blocks_per_block
        try:
            for i, ref in enumerate(item.refs):
                delta = item.deltas[i]
                if layout is None or (delta and self.rope is None):
                    break
                found = self.store.get(ref, salt=item.salt)
                p = found.payload
                if not found.status.hit or p is None or tuple(p.shape) != self.payload_shape:
                    continue
                kids = torch.tensor(self.kernel_ids([item.block_ids[i]]), dtype=torch.int64, device=self.io.device)
                fresh = torch.stack([c.index_select(bd, kids) for c in self.caches])  # [layers, *per_layer]
                old = p.to(self.io.device, self.dtype)
                k, v = kv_deviation(
                    fresh.movedim(0, bd).flatten(bd, bd + 1),
                    old.movedim(0, bd).flatten(bd, bd + 1),
                    delta, self.rope, layout,
                )
                n = len(self.caches)
                k = k.view(n, r).mean(dim=1).tolist()
                v = v.view(n, r).mean(dim=1).tolist()
                dev = BlockDeviation(item.starts[i], delta, tuple(k), tuple(v))
                self.deviations.append(dev)
                if self.on_probe is not None:
                    self.on_probe(item.req_id, dev)
                done += 1
        except Exception:  # noqa: BLE001 - a probe is a measurement, never fatal
            _log.exception("splice connector: probing blocks of %s failed", item.req_id)
        self.stats.probed_blocks += done
        self.stats.probe_s += time.perf_counter() - t0
        return done

    def skip_saves(self, meta: SpliceMetadata) -> int:
        """Count, and do not store, this step's blocks: its forward pass failed."""
        self.finish_loads(late=True)
        n = sum(len(item.refs) for item in meta.saves)
        if n:
            _log.warning("splice connector: the forward pass failed; %d block(s) of this step not saved", n)
        self.stats.skipped_saves += n
        return n

    def _queue_save(self, item: SaveItem) -> None:
        """Gather ``item``'s blocks into host buffers: on CUDA after an event that marks
        the forward pass's writes, on the side stream, without blocking the host."""
        import torch

        io = self.io
        n = len(item.refs)
        r, bd = self.blocks_per_block, self.block_dim
        written = io.mark()
        with io.on(io.side):
            if written is not None:
                io.side.wait_event(written)
            device = self.caches[0].device
            kids = torch.tensor(self.kernel_ids(item.block_ids), dtype=torch.int64).to(device, non_blocking=True)
            gathered = torch.empty((n, *self.payload_shape), dtype=self.dtype, device=device)
            for layer, cache in enumerate(self.caches):
                if r == 1:  # one pass: gathered straight into the payloads (a strided view)
                    torch.index_select(cache, bd, kids, out=gathered[:, layer].movedim(0, bd).squeeze(bd + 1))
                else:
                    gathered[:, layer].copy_(cache.index_select(bd, kids).unflatten(bd, (n, r)).movedim(bd, 0))
            self._gathered = io.mark(io.side)
            if io.cuda:
                hosts = [io.host_empty(self.payload_shape, self.dtype) for _ in range(n)]
                for h, g in zip(hosts, gathered):
                    h.copy_(g, non_blocking=True)
            else:
                hosts = list(gathered)
            done = io.mark(io.side)
        # ``gathered`` is kept alive with the entry until its copies completed; under the
        # lock: ``settle`` may iterate the queue from another thread
        with self._saves_lock:
            self._saves.append((done, hosts, item, gathered))

    def flush_saves(self, *, wait: bool = False) -> int:
        """Hand to the store the pending saves whose copies completed (all of them,
        waiting, with ``wait``); returns the blocks stored."""
        with self._saves_lock:
            return self._flush_saves(len(self._saves) if wait else 0)

    def _flush_saves(self, wait_for: int) -> int:
        """Store the completed saves in queue order, waiting for the first ``wait_for``."""
        stored_all = 0
        while self._saves:
            done, hosts, item, _ = self._saves[0]
            if not self.io.done(done, block=wait_for > 0):
                break
            wait_for -= 1
            self._saves.popleft()
            stored = refused = 0
            try:
                for i, ref in enumerate(item.refs):
                    # Pinned host buffers are the store's own (no copy): its DRAM tier
                    # then holds page-locked memory, ready for the next load's DMA.
                    status = self.store.put(ref, hosts[i], salt=item.salt, copy=not self.io.cuda)
                    if status in (PutStatus.STORED, PutStatus.EXISTS):
                        stored += 1
                    else:  # refused (no room, or another block under the key): counted nowhere before
                        refused += 1
            except Exception:  # noqa: BLE001 - a save is best effort
                _log.exception("splice connector: saving blocks of %s failed", item.req_id)
                self.stats.save_errors += len(item.refs) - stored - refused
            self.stats.save_errors += refused
            self.stats.saved_blocks += stored
            self.history.append(("save", item, stored))
            stored_all += stored
        return stored_all

    def settle(self, req_id: str | None = None) -> int:
        """Hand the pending saves to the store, waiting for the copies of ``req_id``'s
        (every one's without it) and those queued before them, so that the next lookup
        finds a finished request's blocks; later saves (the next step's, under vLLM's
        async scheduling) are only polled.  Returns the blocks stored.  Nothing to wait
        for on CPU, where saves are stored inline."""
        if not self._saves:
            return 0
        with self._saves_lock:
            saves = self._saves
            if req_id is None:
                upto = len(saves)
            else:
                upto = next((len(saves) - i for i, e in enumerate(reversed(saves)) if e[2].req_id == req_id), 0)
            return self._flush_saves(upto)

    @property
    def pending_saves(self) -> int:
        """Saves copied or copying, not in the store yet."""
        return len(self._saves)
