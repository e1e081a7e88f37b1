"""``SpliceConnector``: the thin vLLM ``KVConnectorBase_V1`` that forwards to the core.

Load it with::

    kv_transfer_config={"kv_connector": "SpliceConnector",
                        "kv_connector_module_path": "promptsplice.engine_adapters.connector._connector",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"dram_bytes": ..., ...StoreConfig fields}}

(``EngineConfig(kv_store=StoreConfig(...))`` does exactly that).  vLLM builds one
instance per role: the scheduler-side one answers ``get_num_new_matched_tokens`` and
builds each step's metadata (:class:`~promptsplice.engine_adapters.connector._splice.SpliceScheduler`), the
worker-side one loads, relocates and saves blocks in the paged cache
(:class:`~promptsplice.engine_adapters.connector._splice.SpliceWorker`).  Both open the same process-wide
:class:`~promptsplice.engine_adapters.store._store.BlockStore` through ``shared_store`` (the scheduler and
the worker live in one process: the engine core's).

Scope: vLLM's CPU backend (``CPU_ATTN``).  Offload hits (delta 0) copy whole cache
blocks and work for any CPU attention ISA; relocation needs a verified block layout
(``promptsplice.kernels.VERIFIED_CPU_ATTN_ISAS``) and a RoPE that ``promptsplice.kernels.RopeConfig`` implements,
otherwise plans fall back to computing.  ``kv_load_failure_policy="recompute"`` is what
makes a block that fails to load be recomputed instead of failing the request.

vLLM facts this relies on (0.32): ``get_num_new_matched_tokens`` is asked after the local
prefix-cache hit, with that hit rounded down to a block; a synchronous load (``(n,
False)``) makes ``has_sync_kv_loads`` true, so ``start_load_kv`` runs before the step's
forward pass; ``update_state_after_alloc`` gets *all* of the request's blocks, the local
hit's first; ``wait_for_save`` runs once per step after the forward pass, with the
metadata still bound; loaded tokens count in ``num_cached_tokens`` and in
``vllm:external_prefix_cache_hits``; ``reset_prefix_cache()`` leaves the connector alone
(``reset_connector=True`` calls :meth:`SpliceConnector.reset_cache`, which empties the
store, for every engine sharing it).  A request with ``prompt_logprobs`` gets
``skip_reading_prefix_cache=True`` from vLLM, which silently drops connector loads:
pass ``skip_reading_prefix_cache=False`` to keep them.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from promptsplice.engine_adapters.connector._splice import (
    SpliceMetadata,
    SpliceScheduler,
    SpliceWorker,
    store_config_from_extra,
)
from promptsplice.engine_adapters.store._store import BlockStore, StoreConfig, shared_store
from promptsplice.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from promptsplice.kernels import RopeConfig

__all__ = ["SpliceConnector", "SpliceConnectorMetadata", "ConnectorSettings", "connector_settings"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What both roles derive from vLLM's config (identically, so they share a store)."""

    store_config: StoreConfig
    block_size: int
    isa: str
    rope: RopeConfig | None
    relocation: bool
    why_no_relocation: str = ""


def connector_settings(vllm_config: VllmConfig) -> ConnectorSettings:
    """The store config (with the engine's fingerprint), block size, attention ISA and
    RoPE of an engine; :class:`ConfigError` when the connector cannot serve it."""
    from vllm.platforms import current_platform

    from promptsplice.kernels import VERIFIED_CPU_ATTN_ISAS, RopeConfig, detect_cpu_attn_isa

    if not current_platform.is_cpu():
        raise ConfigError(
            "SpliceConnector supports vLLM's CPU backend (CPU_ATTN) only; on "
            f"{current_platform.device_type} use vLLM's own offloading connectors"
        )
    kv = vllm_config.kv_transfer_config
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    cache_dtype = str(cache.cache_dtype)
    if cache_dtype.startswith("fp8"):
        raise ConfigError(f"SpliceConnector: kv_cache_dtype {cache_dtype!r} (quantized) is not supported")
    block_size = int(cache.block_size)
    head_size = int(model.get_head_size())
    isa = detect_cpu_attn_isa(model.dtype, block_size, head_size, cache_dtype)
    rope = None
    why = ""
    try:
        rope = RopeConfig.from_hf_config(model.hf_config)
    except ConfigError as exc:
        why = f"RoPE: {exc}"
    # The RoPE is part of the identity: relocated keys are rotated with it, so blocks
    # written under another RoPE configuration must never be served.
    fingerprint = "|".join(
        [
            "promptsplice-kv/1",
            str(model.model),
            str(model.dtype),
            cache_dtype,
            f"block{block_size}",
            f"cpu_attn:{isa}",
            f"layers{model.get_num_layers(parallel)}",
            f"kv_heads{model.get_num_kv_heads(parallel)}",
            f"head{head_size}",
            f"rope:{rope!r}",
        ]
    )
    extra = kv.kv_connector_extra_config if kv is not None else {}
    store_config = store_config_from_extra(extra, fingerprint=fingerprint)
    if rope is not None and isa not in VERIFIED_CPU_ATTN_ISAS:
        why = f"CPU_ATTN ISA {isa!r} has an unverified K layout"
    relocation = rope is not None and not why
    return ConnectorSettings(store_config, block_size, isa, rope, relocation, why)


@dataclass
class SpliceConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker: this step's :class:`SpliceMetadata`."""

    work: SpliceMetadata


class SpliceConnector(KVConnectorBase_V1):
    """Tiered block store, offload hits and relocation for vLLM (see the module doc).

    Every method forwards to :class:`SpliceScheduler` or :class:`SpliceWorker`.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = connector_settings(vllm_config)
        if not self.settings.relocation:
            _log.warning("SpliceConnector: relocation disabled (%s); offload hits only", self.settings.why_no_relocation)
        self.store: BlockStore = shared_store(self.settings.store_config)
        self.scheduler: SpliceScheduler | None = None
        self.worker: SpliceWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SpliceScheduler(
                self.store, self.settings.block_size, relocation=self.settings.relocation
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, nothing more

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from promptsplice.kernels import CpuAttnLayout

        ctx = self._vllm_config.compilation_config.static_forward_context
        isas = {getattr(ctx.get(name), "isa", self.settings.isa) for name in kv_caches}
        if isas != {self.settings.isa}:
            raise ConfigError(
                f"SpliceConnector: the attention layers use ISA {sorted(isas)}, the connector "
                f"expected {self.settings.isa!r} (vLLM's _get_attn_isa changed?)"
            )
        first = next(iter(kv_caches.values()))
        relocation = self.settings.relocation
        self.worker = SpliceWorker(
            self.store,
            block_size=self.settings.block_size,
            caches=kv_caches,
            block_dim=0,  # CPU_ATTN: [num_blocks, kv_heads, block_size, 2 * head_size]
            kernel_block_size=int(first.shape[2]),
            layout=CpuAttnLayout(self.settings.isa) if relocation else None,
            rope=self.settings.rope if relocation else None,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load(self._work())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: done in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # saved whole (all layers of a block in one payload) in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        # vLLM calls this from a ``finally`` around the forward pass: when that raised,
        # the step's blocks hold partial KV (some layers, or none), which must never be
        # stored under their chain keys.
        if sys.exc_info()[1] is not None:
            self.worker.skip_saves(self._work())
            return
        self.worker.save(self._work())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if not self.store.closed:
            self.store.drain()

    def _work(self) -> SpliceMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SpliceConnectorMetadata)
        return meta.work

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        n = self.scheduler.get_num_new_matched_tokens(
            request.request_id,
            request.prompt_token_ids,
            request.cache_salt,
            num_computed_tokens,
            request.kv_transfer_params,
        )
        return n, False  # synchronous: loaded in start_load_kv before this step's forward

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else ()
        self.scheduler.update_state_after_alloc(request.request_id, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        new_ids = {r.req_id: r.block_ids[0] for r in scheduler_output.scheduled_new_reqs}
        steps = [
            (r.req_id, r.num_computed_tokens, scheduler_output.num_scheduled_tokens.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        steps += [
            (rid, computed, scheduler_output.num_scheduled_tokens.get(rid, 0))
            for rid, computed in zip(cached.req_ids, cached.num_computed_tokens)
        ]

        def block_ids(req_id: str) -> list[int]:
            ids = new_ids.get(req_id)
            if ids is None:
                assert self._kv_cache_manager is not None
                ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            return ids

        return SpliceConnectorMetadata(self.scheduler.build_connector_meta(steps, block_ids))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.request_finished(request.request_id)
        return False, None

    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)``: empty the block store."""
        self.store.clear()
        return True
