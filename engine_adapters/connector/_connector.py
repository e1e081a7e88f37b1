"""``SpliceConnector``: the thin vLLM ``KVConnectorBase_V1`` that forwards to the
scheduler side and the worker side.  Whatever it needs from vLLM beyond that base API
(request and scheduler-output fields, the attention layers, the bound KV cache
manager) goes through :mod:`promptsplice.engine_adapters._vllm`.

Load it with::

    kv_transfer_config={"kv_connector": "SpliceConnector",
                        "kv_connector_module_path": "promptsplice.engine_adapters.connector._connector",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"dram_bytes": ..., ...StoreConfig fields}}

(``EngineConfig(kv_store=StoreConfig(...))`` does exactly that).  vLLM builds one
instance per role: the scheduler-side one answers ``get_num_new_matched_tokens`` and
builds each step's metadata (:class:`~promptsplice.engine_adapters.connector._scheduler.SpliceScheduler`),
the worker-side one loads, relocates and saves blocks in the paged cache
(:class:`~promptsplice.engine_adapters.connector._worker.SpliceWorker`).  Both open the same process-wide
:class:`~promptsplice.engine_adapters.store._store.BlockStore` through ``shared_store`` (the scheduler and
the worker live in one process: the engine core's).

Scope: the attention backends of ``_settings.CONNECTOR_BACKENDS`` (vLLM's CPU backend,
``CPU_ATTN``; on CUDA ``FLASH_ATTN`` and ``FLASHINFER``; others are refused by name).
Offload hits (delta 0) copy whole cache blocks and work for any CPU attention ISA;
relocation needs a verified block layout (on CPU ``promptsplice.kernels.VERIFIED_CPU_ATTN_ISAS``)
and a RoPE that ``promptsplice.kernels.RopeConfig`` implements, otherwise plans fall
back to computing.  When a request finishes, the scheduler side has the worker settle
that request's in-flight saves (CUDA), through a per-store board, as the worker passes
it probe results: both sides share one process, the engine core's.
Its counters reach vLLM's metrics (``/metrics``, the ``KV Transfer metrics:`` log line)
through ``get_kv_connector_stats`` (:mod:`~promptsplice.engine_adapters.connector._metrics`).
``kv_load_failure_policy="recompute"`` is what makes a block that fails to load be
recomputed instead of failing the request.

vLLM facts this relies on (0.32): ``get_num_new_matched_tokens`` is asked after the local
prefix-cache hit, with that hit rounded down to a block; a synchronous load (``(n,
False)``) makes ``has_sync_kv_loads`` true, so ``start_load_kv`` runs before the step's
forward pass; ``update_state_after_alloc`` gets *all* of the request's blocks, the local
hit's first; ``bind_connector_metadata`` runs before each step's forward pass and
``wait_for_save`` once per step after it, from a ``finally``, with the metadata still
bound and no outcome passed (a failed pass is the exception in flight there, other than
the one in flight at the bind: :meth:`SpliceConnector._forward_failed`); loaded tokens
count in ``num_cached_tokens`` and in ``vllm:external_prefix_cache_hits``; ``reset_prefix_cache()`` leaves the connector alone
(``reset_connector=True`` calls :meth:`SpliceConnector.reset_cache`, which empties the
store, for every engine sharing it).  A request with ``prompt_logprobs`` gets
``skip_reading_prefix_cache=True`` from vLLM, which silently drops connector loads:
pass ``skip_reading_prefix_cache=False`` to keep them.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from promptsplice.engine_adapters import _vllm
from promptsplice.engine_adapters.connector._metrics import (
    CounterReporter,
    SpliceConnectorStats,
    SplicePromMetrics,
)
from promptsplice.engine_adapters.connector._plans import BlockDeviation, latest_per_block
from promptsplice.engine_adapters.connector._scheduler import SpliceMetadata, SpliceScheduler
from promptsplice.engine_adapters.connector._served import (
    IDENTITY_REASON,
    identity_salt,
    MAX_QUERY_TOKENS,
    PROBE_REASON,
    QUERY_KEY,
    QUERY_REASON,
    SpliceAck,
    ack_params,
    answer_query,
    plan_verdict,
)
from promptsplice.engine_adapters.connector._settings import connector_settings
from promptsplice.engine_adapters.connector._worker import SpliceWorker
from promptsplice.engine_adapters.store._store import BlockStore, shared_store
from promptsplice._validate import check_salt
from promptsplice.errors import ConfigError, InputError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["SpliceConnector", "SpliceConnectorMetadata"]

_log = logging.getLogger(__name__)


_BOARD_LOCK = threading.Lock()
_BOARDS: dict[int, dict[str, list[BlockDeviation]]] = {}
_MAX_BOARD = 4096


def _finite(dev: BlockDeviation) -> BlockDeviation:
    """``dev`` with non-finite errors (KV that overflowed) as :data:`_NOT_FINITE`: the ack
    is JSON, which has no NaN, and a huge deviation makes the guard recompute (safe)."""
    fix = lambda xs: tuple(x if math.isfinite(x) else _NOT_FINITE for x in xs)  # noqa: E731
    return dev._replace(k=fix(dev.k), v=fix(dev.v))


_NOT_FINITE = 1e9


_SETTLERS: dict[int, list[weakref.WeakMethod]] = {}


def _add_settler(store: BlockStore, settle: Callable[[str], int]) -> None:
    """Register a worker's :meth:`SpliceWorker.settle` for ``store`` (weakly: an engine
    that is gone leaves its entry dead, pruned here)."""
    with _BOARD_LOCK:
        live = [ref for ref in _SETTLERS.get(id(store), []) if ref() is not None]
        _SETTLERS[id(store)] = [*live, weakref.WeakMethod(settle)]  # type: ignore[arg-type]


def _settle(store: BlockStore, req_id: str) -> None:
    """Wait for the pending saves of ``req_id`` on the workers in this process that save
    to ``store`` (:meth:`SpliceWorker.settle`)."""
    with _BOARD_LOCK:
        refs = list(_SETTLERS.get(id(store), ()))
    for ref in refs:
        settle = ref()
        if settle is not None:
            settle(req_id)


def _probe_board(store: BlockStore) -> dict[str, list[BlockDeviation]]:
    """The probe results of the engine(s) on ``store`` (one per process-wide store)."""
    with _BOARD_LOCK:
        return _BOARDS.setdefault(id(store), {})


_FAILED: set[tuple[str, str]] = set()


def _log_failure(where: str, req_id: str, exc: BaseException) -> None:
    """Log a scheduler-side failure with its traceback once per (method, error type),
    then briefly: one bad request per step must not flood the log."""
    kind = (where, type(exc).__name__)
    if kind in _FAILED:
        _log.warning("splice connector: %s failed for %s (%s: %s); plain prefill", where, req_id, kind[1], exc)
        return
    _FAILED.add(kind)
    _log.exception("splice connector: %s failed for %s; plain prefill (logged once per kind)", where, req_id)


def query_token_cap(vllm_config: Any) -> int:
    """The most tokens a store query may carry on this engine: its ``max_model_len``
    (what one prompt makes the scheduler hash), never above ``MAX_QUERY_TOKENS``."""
    n = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    return min(int(n), MAX_QUERY_TOKENS) if isinstance(n, int) and n > 0 else MAX_QUERY_TOKENS


@dataclass
class SpliceConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker: this step's :class:`SpliceMetadata`."""

    work: SpliceMetadata


class SpliceConnector(KVConnectorBase_V1):
    """Tiered block store, offload hits and relocation for vLLM (see the module doc).

    Every method forwards to :class:`SpliceScheduler` or :class:`SpliceWorker`.
    """

    max_query_tokens: int = MAX_QUERY_TOKENS
    """The most tokens a store query may carry here (:func:`query_token_cap`: the
    engine's ``max_model_len``); every ack says it (``_served``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = connector_settings(vllm_config)
        self.max_query_tokens = query_token_cap(vllm_config)
        if not self.settings.relocation:
            _log.warning("SpliceConnector: relocation disabled (%s); offload hits only", self.settings.why_no_relocation)
        self.store: BlockStore = shared_store(self.settings.store_config)
        self.scheduler: SpliceScheduler | None = None
        self.worker: SpliceWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SpliceScheduler(
                self.store, self.settings.block_size, relocation=self.settings.relocation,
                num_blocks=_vllm.connector_num_blocks(self),
            )
        self._acks: dict[str, list] = {}
        """Requests that carry a plan, a probe or a store query: [reason, planned, loaded,
        relocated tokens, a query's matched blocks] (``_served``)."""
        self._loads: dict[str, Any] = {}  # request id -> its last load item (scheduler side)
        self._offered: dict[str, int] = {}  # request id -> the local hit its last offer starts at
        self._probes = _probe_board(self.store)
        self._reporter = CounterReporter()
        """Request id -> its probes' deviations: the worker-side instance writes, the
        scheduler-side one (same process, same store) reads them into the ack."""
        self._exc_at_bind: BaseException | None = None
        """The exception in flight when vLLM bound this step's metadata (before the forward
        pass): the caller's, never the pass's (:meth:`_forward_failed`)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, nothing more

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = _vllm.attention_layers(self._vllm_config, kv_caches)
        backend = self.settings.backend
        if backend == "auto":  # vLLM picked at startup: the layers say (the worker refuses others by name)
            backend = next(iter(layers.values()))[0]
        expected = (backend, self.settings.isa)
        found = {(b, expected[1] if isa is None else isa) for b, isa in layers.values()}
        if found != {expected}:
            raise ConfigError(
                f"SpliceConnector: the attention layers use (backend, ISA) {sorted(found)}, the "
                f"connector expected {expected} (vLLM's _get_attn_isa changed?)"
            )
        self.worker = SpliceWorker(
            self.store,
            block_size=self.settings.block_size,
            caches=kv_caches,
            backend=backend,
            isa=self.settings.isa or None,
            rope=self.settings.rope if self.settings.relocation else None,
        )
        self.worker.on_probe = self._record_probe
        _add_settler(self.store, self.worker.settle)

    def _record_probe(self, req_id: str, dev: BlockDeviation) -> None:
        with _BOARD_LOCK:
            self._probes.setdefault(req_id, []).append(dev)
            while len(self._probes) > _MAX_BOARD:  # requests never finished here: oldest go
                self._probes.pop(next(iter(self._probes)))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # per-layer loads: a full CUDA graph's replay would skip wait_for_layer_load

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is not None:  # reads from the store, copies in; layers written per layer
            self.worker.start_load(self._work(), per_layer=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:  # layer l's relocation runs as the forward pass reaches it
            self.worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # saved whole (all layers of a block in one payload) in wait_for_save

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM binds the step's metadata before its forward pass, always (also before a
        # step without one, and before start_load_kv, which for a step without
        # synchronous loads only runs after the forward pass): what is in flight now is
        # an exception the caller was handling, never the forward pass's (wait_for_save)
        self._exc_at_bind = sys.exc_info()[1]

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._exc_at_bind = None  # (its traceback holds the caller's frames)

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        if self._forward_failed():
            self.worker.skip_saves(self._work())
            return
        self.worker.save(self._work())

    def _forward_failed(self) -> bool:
        """Whether this step's forward pass raised: its blocks then hold partial KV (some
        layers, or none), which must never be stored under their chain keys.

        vLLM passes no outcome: it calls :meth:`wait_for_save` from a ``finally`` around
        the forward pass (``KVConnectorModelRunnerMixin._get_kv_connector_output``), where
        the pass's exception is the one in flight (``sys.exc_info``).  But in the embedded
        engine the forward pass runs in the caller's thread, so a request sent inside an
        ``except`` block (a fallback, a retry, the engine's own health probe) has the
        caller's exception in flight too, after a pass that succeeded: only an exception
        other than the one in flight when the metadata was bound, before the pass, is the
        pass's own (one raised while handling another is a new object)."""
        exc = sys.exc_info()[1]
        return exc is not None and exc is not self._exc_at_bind

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # The worker side reports (its counters and the store's); the scheduler side,
        # in the same process, adds nothing, so nothing is counted twice.
        if self.worker is None:
            return None
        return self._reporter.take(self.worker.stats, self.store)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return SpliceConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return SplicePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """vLLM is shutting down: the store's DRAM blocks go down to its disk (and shared)
        tier, so the next engine on the folder serves them."""
        if not self.store.closed:
            try:
                self.store.flush()
            except InputError:  # closed meanwhile (the store is shared): nothing left to write
                pass

    def _work(self) -> SpliceMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SpliceConnectorMetadata)
        return meta.work

    # ==============================
    # Scheduler-side methods
    # ==============================

    # vLLM calls these from its scheduler, which does not catch what they raise: one
    # request's bad input (or a bug of ours) would stop the engine core for every tenant.
    # So an unexpected error is logged and answered as "nothing to load" (plain
    # prefill), as the worker side answers a failed load by recomputing.

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        try:
            return self._matched_tokens(request, num_computed_tokens)
        except Exception as exc:  # noqa: BLE001 - never fatal for the engine (see above)
            req_id = request.request_id
            _log_failure("get_num_new_matched_tokens", req_id, exc)
            self._offered.pop(req_id, None)
            self.scheduler.request_finished(req_id)  # its state and pins: nothing is loaded
            self._fail_ack(req_id, exc)
            return 0, False

    def _fail_ack(self, req_id: str, exc: BaseException, *, loaded: bool = False) -> None:
        """A request the connector failed on says so in its ack: before its load went out,
        plain prefill (nothing counts as loaded); after (``loaded``), its load stands and
        its saves and probes stop."""
        ack = self._acks.get(req_id)
        if ack is not None and not ack[0]:
            what = "its load stands, nothing more is saved or probed" if loaded else "plain prefill"
            ack[0] = f"the splice connector failed on this request ({type(exc).__name__}): {what}"
            if not loaded:
                ack[2] = ack[3] = 0

    def _matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        req_id, tokens, salt, params = _vllm.request_fields(request)
        if isinstance(salt, bytes):  # (vLLM keeps cache_salt as a str)
            salt = salt.decode("utf-8", "replace")
        check_salt(salt, vllm_rule=False)  # ("" would name the unsalted chains; refused: plain prefill)
        identity = _vllm.request_identity(request)
        taint: dict[str, Any] = {}
        if identity is not None:
            # vLLM hashes a multimodal request's blocks before its first input as a plain
            # request's: its hit there may be blocks a relocation tainted
            taint = {"hit_salt": salt, "hit_limit": _vllm.plain_prefix_tokens(request)}
            # a LoRA, multimodal or embeddings request: its KV is not the plain tokens' KV,
            # so it keys the store under a salt of its own (offload hits only from the
            # same adapter and inputs), and plans naming the tenant's chains are refused
            salt = identity_salt(salt, identity)
            if params and req_id not in self._acks:
                _log.warning("splice connector: plain prefill for %s: %s", req_id, IDENTITY_REASON)
                self._acks[req_id] = [IDENTITY_REASON, 0, 0, 0, ()]
            params = None
        ack = self._acks.get(req_id)
        if ack is None:
            verdict = plan_verdict(params, tokens or (), self.settings.block_size, salt)
            if verdict.has_plan:
                matched: tuple[int, ...] = ()
                reason = verdict.reason
                if reason == QUERY_REASON:  # answered from the store as it is now
                    assert params is not None
                    matched, why = answer_query(
                        params[QUERY_KEY], self._match, self.settings.block_size, salt, self.max_query_tokens
                    )
                    reason = why or reason
                elif reason and reason != PROBE_REASON:
                    _log.warning("splice connector: plain prefill for %s: %s", req_id, reason)
                ack = self._acks[req_id] = [reason, verdict.planned_tokens, 0, 0, matched]
                with _BOARD_LOCK:  # a reused request id never inherits older probes
                    self._probes.pop(req_id, None)
        if ack is not None and ack[0]:
            params = None  # the plan does not match the request: plain prefill
        self._offered.pop(req_id, None)
        n = self.scheduler.get_num_new_matched_tokens(req_id, tokens, salt, num_computed_tokens, params, **taint)
        if n:
            self._offered[req_id] = num_computed_tokens
        return n, False  # synchronous: loaded in start_load_kv before this step's forward

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        req_id = request.request_id
        start = self._offered.pop(req_id, None)
        try:
            self._after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:  # noqa: BLE001 - never fatal for the engine (see above)
            _log_failure("update_state_after_alloc", req_id, exc)
            self._fail_ack(req_id, exc)
            self._loads.pop(req_id, None)
            if num_external_tokens > 0 and start is not None:
                # vLLM counts these tokens as loaded: a load with no source makes the
                # worker report their blocks as load errors, so vLLM recomputes them
                bs = self.settings.block_size
                first = start // bs
                dst = _vllm.allocated_block_ids(blocks)[first : first + -(-num_external_tokens // bs)]
                self.scheduler.load_without_source(req_id, dst, start)
                return
            self.scheduler.request_finished(req_id)
            if num_external_tokens > 0:
                raise  # no offer on record: the blocks cannot be named (never expected)

    def _after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        ids = _vllm.allocated_block_ids(blocks) if num_external_tokens > 0 else ()
        item = self.scheduler.update_state_after_alloc(request.request_id, ids, num_external_tokens)
        ack = self._acks.get(request.request_id)
        if item is None:
            # a request resumed without a load: its last load's blocks went back to vLLM
            # (another request's failed load into them is not this request's)
            self._loads.pop(request.request_id, None)
        elif ack is not None:
            # what this allocation loads (a request vLLM preempted and resumes loads
            # again: the ack says what its context was served, not the sum of loads);
            # update_connector_output takes back what then failed to load
            ack[2] = len(item.refs) * self.settings.block_size
            ack[3] = item.approximate() * self.settings.block_size
            self._loads[request.request_id] = item

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load (vLLM recomputes them) leave the acks' loaded and
        relocated counts: from a load's first failed block on, none of it was served."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if self.scheduler is not None:
            try:  # (every step: the loads of earlier steps are forgotten)
                self.scheduler.loads_failed(invalid or ())
            except Exception as exc:  # noqa: BLE001 - never fatal for the engine (see above)
                _log_failure("update_connector_output", "a step", exc)
        if not invalid:
            return
        bs = self.settings.block_size
        for req_id, item in list(self._loads.items()):
            ack = self._acks.get(req_id)
            failed = [i for i, b in enumerate(item.block_ids) if b in invalid]
            if ack is not None and failed:
                served = min(failed)
                ack[2] = min(ack[2], served * bs)
                ack[3] = min(ack[3], item.approximate(served) * bs)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        steps, new_ids = _vllm.scheduled_steps(scheduler_output)
        for req_id in _vllm.preempted_ids(scheduler_output):
            # its blocks are free for other requests now: their load failures are theirs
            self._loads.pop(req_id, None)

        def block_ids(req_id: str) -> list[int]:
            ids = new_ids.get(req_id)
            return ids if ids is not None else _vllm.bound_block_ids(self, req_id)

        try:
            return SpliceConnectorMetadata(self.scheduler.build_connector_meta(steps, block_ids))
        except Exception as exc:  # noqa: BLE001 - never fatal for the engine (see above)
            _log_failure("build_connector_meta", "a step", exc)
        # One request at a time: the loads vLLM counts on all go out (the first call that
        # succeeds takes them); a request that fails saves and probes nothing from now on.
        loads: list[Any] = []
        saves: list[Any] = []
        probes: list[Any] = []
        for step in steps:
            try:
                work = self.scheduler.build_connector_meta([step], block_ids, end_step=False)
            except Exception as exc:  # noqa: BLE001
                _log_failure("build_connector_meta", step[0], exc)
                self._fail_ack(step[0], exc, loaded=True)
                self.scheduler.stop_saving(step[0])
                continue
            loads += work.loads
            saves += work.saves
            probes += work.probes
        loads += self.scheduler._loads
        self.scheduler._loads = []
        self.scheduler.end_step()
        return SpliceConnectorMetadata(SpliceMetadata(loads, saves, probes))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            try:
                self.scheduler.request_finished(request.request_id)
                # its last blocks may still be on their way to the store (CUDA): the next
                # lookup, a store query or a client's index, must find them
                _settle(self.store, request.request_id)
            except Exception as exc:  # noqa: BLE001 - never fatal for the engine (see above)
                _log_failure("request_finished", request.request_id, exc)
        self._offered.pop(request.request_id, None)
        ack = self._acks.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        with _BOARD_LOCK:
            devs = tuple(_finite(d) for d in latest_per_block(self._probes.pop(request.request_id, ())))
        if ack is None:
            return False, None
        # The answer vLLM's OpenAI server returns in the response's kv_transfer_params.
        reason, planned, loaded, relocated, matched = ack
        return False, ack_params(SpliceAck(
            not reason, reason, planned, loaded, relocated, self.settings.block_size,
            self.settings.relocation, matched, devs, _vllm.connector_num_blocks(self), self.max_query_tokens,
        ))

    def _match(self, refs: list[Any], salt: str | None) -> int:
        return self.store.match_prefix(refs, salt=salt)

    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)``: empty the block store."""
        self.store.clear()
        return True
