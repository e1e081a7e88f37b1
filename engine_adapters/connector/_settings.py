"""What the connector derives from vLLM's config, identically in both roles (so they
open the same store): the store config in ``kv_connector_extra_config``, the block size,
the attention ISA and RoPE, and whether relocation is possible.

``store_config_to_extra`` is what ``EngineConfig(kv_store=...)`` writes into vLLM's
config, ``kv_transfer_config`` the whole entry (``kv_transfer_config_json`` the
``vllm serve --kv-transfer-config`` argument); ``connector_settings`` reads it back
inside the engine.  Importing this module
imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from promptsplice.engine_adapters.store._store import StoreConfig
from promptsplice.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from promptsplice.kernels import RopeConfig

__all__ = [
    "CONNECTOR_BACKENDS",
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "ConnectorSettings",
    "check_load_failure_policy",
    "check_single_worker",
    "connector_backend",
    "connector_settings",
    "kv_transfer_config",
    "kv_transfer_config_json",
    "store_config_from_extra",
    "store_config_to_extra",
    "weights_identity",
]

#: Per vLLM platform (``device_type``), the attention backends whose KV cache layout
#: the worker reads (``promptsplice.kernels.paged_kv``); anything else is refused.
CONNECTOR_BACKENDS: dict[str, tuple[str, ...]] = {
    "cpu": ("CPU_ATTN",),
    "cuda": ("FLASH_ATTN", "FLASHINFER"),
}
AUTO_BACKEND = "auto"
"""The backend when vLLM picks it at startup: the worker checks the layers' own."""

CONNECTOR_CLASS = "SpliceConnector"
CONNECTOR_MODULE = "promptsplice.engine_adapters.connector._connector"

_STORE_FIELDS = tuple(f.name for f in fields(StoreConfig))


def store_config_to_extra(config: StoreConfig) -> dict[str, Any]:
    """A :class:`StoreConfig` as ``kv_connector_extra_config`` (plain values)."""
    if not isinstance(config, StoreConfig):
        raise ConfigError(f"expected a StoreConfig, got {type(config).__name__}")
    return {name: getattr(config, name) for name in _STORE_FIELDS}


def kv_transfer_config(config: StoreConfig) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` that loads the splice connector over the store
    ``config`` (``kv_load_failure_policy="recompute"``: a block that fails to load is
    recomputed instead of failing the request)."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": store_config_to_extra(config),
    }


def kv_transfer_config_json(config: StoreConfig) -> str:
    """:func:`kv_transfer_config` as ``vllm serve --kv-transfer-config`` takes it."""
    return json.dumps(kv_transfer_config(config), sort_keys=True)


def store_config_from_extra(extra: Mapping[str, Any], *, fingerprint: str = "") -> StoreConfig:
    """The :class:`StoreConfig` named by ``kv_connector_extra_config``.

    ``fingerprint`` (the engine's model and KV layout) is prepended to the one given,
    so blocks of another model or layout are never served.
    """
    if not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config must be a mapping of StoreConfig fields")
    unknown = sorted(set(extra) - set(_STORE_FIELDS))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown keys {unknown}; the splice connector "
            f"takes StoreConfig fields: {', '.join(_STORE_FIELDS)}"
        )
    if "dram_bytes" not in extra:
        raise ConfigError("kv_connector_extra_config needs dram_bytes (the store's DRAM budget)")
    values = dict(extra)
    user = values.get("fingerprint") or ""
    values["fingerprint"] = fingerprint if not user else f"{fingerprint}|{user}"
    try:
        return StoreConfig(**values)
    except TypeError as exc:
        raise ConfigError(f"bad store configuration: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What both roles derive from vLLM's config (identically, so they share a store)."""

    store_config: StoreConfig
    block_size: int
    backend: str
    isa: str
    rope: RopeConfig | None
    relocation: bool
    why_no_relocation: str = ""


def check_single_worker(parallel: Any) -> None:
    """The connector serves an engine of one worker: one store per engine, keyed by
    chain hashes that do not name a rank, with the whole layer stack and every KV head
    in each record.  Tensor or pipeline parallelism would have each rank file its own
    slice of a block under the same key (and the shared tier hand one rank's heads to
    another), so it is refused.  An executor that runs the worker in another process
    than the scheduler (``mp``, ``ray``) is refused too, and with it vLLM's data
    parallelism (``data_parallel_size > 1`` defaults to ``mp``): run one engine or
    server per replica behind PrefixRouter or a gateway instead."""
    sizes = {name: getattr(parallel, name, 1) for name in ("tensor_parallel_size", "pipeline_parallel_size")}
    many = {name: size for name, size in sizes.items() if size != 1}
    if many:
        shown = ", ".join(f"{name}={size}" for name, size in many.items())
        raise ConfigError(
            f"SpliceConnector: {shown}: the connector runs with one worker per engine (its "
            "block keys do not name a rank); run one engine per GPU (tensor_parallel_size=1, "
            "pipeline_parallel_size=1) behind PrefixRouter or a gateway, or run without kv_store"
        )
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend not in (None, "uni", "external_launcher"):
        # "mp" and "ray" run the worker in another process than the scheduler: each half
        # would get its own store, and nothing saved would ever be found (silently)
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
        raise ConfigError(
            f"SpliceConnector: distributed_executor_backend={name!r} runs the worker in another "
            "process than the scheduler, and the connector's two halves share one store in one "
            "process; use distributed_executor_backend='uni' (one worker; data_parallel_size > 1 "
            "picks 'mp': run one engine per replica behind PrefixRouter or a gateway instead), "
            "or run without kv_store"
        )


def connector_backend(device_type: str, backend: str | None) -> str:
    """The attention backend the connector serves on platform ``device_type`` (vLLM's
    ``current_platform.device_type``) with the configured ``backend`` (``None`` or
    ``"auto"``: vLLM picks; the CPU platform has one, ``CPU_ATTN``).

    Raises :class:`ConfigError` naming the platform or backend that differs from what
    the connector reads, and what it accepts there.
    """
    device_type = str(device_type).lower()
    accepted = CONNECTOR_BACKENDS.get(device_type)
    if accepted is None:
        raise ConfigError(
            f"SpliceConnector does not run on vLLM platform {device_type!r} (supported: "
            f"{', '.join(sorted(CONNECTOR_BACKENDS))}); use vLLM's own offloading connectors"
        )
    name = getattr(backend, "name", backend)  # vLLM's AttentionBackendEnum or a str
    if name is None or str(name).lower() == AUTO_BACKEND:
        return accepted[0] if len(accepted) == 1 else AUTO_BACKEND
    name = str(name).upper()
    if name not in accepted:
        raise ConfigError(
            f"SpliceConnector: attention backend {name!r} on {device_type}: its KV cache "
            f"layout is not one the connector reads (on {device_type}: {', '.join(accepted)}); "
            "choose one of those or run without kv_store"
        )
    return name


def check_load_failure_policy(kv: Any) -> None:
    """The connector's loads may fail (a damaged record, an allocation it could not
    serve), and vLLM must then recompute the blocks: ``kv_load_failure_policy`` other
    than ``"recompute"`` (vLLM's default is ``"fail"``: the request ends with an error)
    is :class:`ConfigError` naming the fix."""
    policy = getattr(kv, "kv_load_failure_policy", "recompute") if kv is not None else "recompute"
    if policy != "recompute":
        raise ConfigError(
            f"SpliceConnector needs kv_load_failure_policy='recompute' in kv_transfer_config, got {policy!r} "
            "(vLLM's default): under it a block that fails to load ends its request with an error; build the "
            "config with kv_transfer_config_json(...) / kv_transfer_config(...) or add the field"
        )


_WEIGHT_SAMPLES = 16
_WEIGHT_SAMPLE = 64 * 1024


def _weight_files(folder: str) -> list[str]:
    """The files of ``folder`` vLLM loads weights from: its safetensors when it has any,
    else its ``.bin``/``.pt``/``.pth`` (not a trainer's ``optimizer.pt``,
    ``training_args.bin`` or ``rng_state*.pth``), else its ``.gguf``."""
    import os

    names = sorted(os.listdir(folder))
    for suffixes in ((".safetensors",), (".bin", ".pt", ".pth"), (".gguf",)):
        found = [n for n in names if n.endswith(suffixes)
                 and not n.startswith(("optimizer", "training_args", "rng_state", "scheduler", "trainer_state"))]
        if found:
            return found
    return []


def weights_identity(model: str, commit: str | None = None) -> str:
    """A digest naming the weights behind ``model``: for a local folder or file, its
    ``config.json`` and the weight files vLLM loads, each by name, size, and either the
    content hash the Hugging Face cache names its blob by or 16 samples of 64 KiB spread
    over it (a fine-tune that changes any layer's weights changes some; 1 MiB read a file
    keeps an engine's start fast); else the hub's commit hash, ``unpinned`` without one.
    A file that cannot be read counts by name (vLLM says why when it loads it).  Part of
    the store fingerprint: KV of other weights is not served (weights that differ only
    between the samples are not told apart: give ``StoreConfig(fingerprint=...)`` a
    version then)."""
    import os

    import xxhash

    if os.path.isfile(model):
        paths = [model]
    elif os.path.isdir(model):
        paths = [os.path.join(model, n) for n in ["config.json", *_weight_files(model)]]
    else:
        return f"commit:{commit}" if commit else "unpinned"
    h = xxhash.xxh3_128()
    for path in paths:
        h.update(os.path.basename(path).encode() + b"\0")
        try:
            blob = os.path.realpath(path)
            if os.sep + "blobs" + os.sep in blob and len(os.path.basename(blob)) >= 40:
                h.update(b"blob:" + os.path.basename(blob).encode())  # the cache's content hash
                continue
            size = os.path.getsize(path)
            h.update(f"{size}:".encode())
            with open(path, "rb") as f:
                step = max(_WEIGHT_SAMPLE, (size - _WEIGHT_SAMPLE) // (_WEIGHT_SAMPLES - 1))
                for at in range(0, max(size - _WEIGHT_SAMPLE, 0) + 1, step):
                    f.seek(at)
                    h.update(f.read(_WEIGHT_SAMPLE))
                f.seek(max(size - _WEIGHT_SAMPLE, 0))
                h.update(f.read(_WEIGHT_SAMPLE))  # the tail, whatever the step
        except OSError:
            h.update(b"unreadable")
    return h.hexdigest()[:16]


def connector_settings(vllm_config: VllmConfig) -> ConnectorSettings:
    """The store config (with the engine's fingerprint), block size, attention ISA and
    RoPE of an engine; :class:`ConfigError` when the connector cannot serve it."""
    from promptsplice.engine_adapters._vllm import cpu_attn_isa, import_vllm_platform, is_quantized_cache
    from promptsplice.kernels import VERIFIED_CPU_ATTN_ISAS, RopeConfig

    check_single_worker(vllm_config.parallel_config)
    platform = import_vllm_platform()
    attention = getattr(vllm_config, "attention_config", None)
    backend = connector_backend(platform.device_type, getattr(attention, "backend", None))
    kv = vllm_config.kv_transfer_config
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    cache_dtype = str(cache.cache_dtype)
    if is_quantized_cache(cache_dtype):  # fp8*, nvfp4* (uint8 caches), *_per_token_head
        raise ConfigError(
            f"SpliceConnector: kv_cache_dtype {cache_dtype!r} (quantized) is not supported; "
            "use kv_cache_dtype='auto' (the model's dtype)"
        )
    block_size = int(cache.block_size)
    head_size = int(model.get_head_size())
    isa = cpu_attn_isa(model.dtype, block_size, head_size, cache_dtype) if backend == "CPU_ATTN" else ""
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
            # the weights the KV came from: another revision or quantization of the same
            # model name computes other KV (engines sharing a disk or Redis tier)
            f"rev:{getattr(model, 'revision', None)}",
            # ...and what the files say, for a local path or an unpinned id: two fine-tunes
            # served from one path (or weights replaced under it) shared a fingerprint
            f"weights:{weights_identity(str(model.model), getattr(model.hf_config, '_commit_hash', None))}",
            f"quant:{getattr(model, 'quantization', None)}",
            str(model.dtype),
            cache_dtype,
            f"block{block_size}",
            f"cpu_attn:{isa}" if backend == "CPU_ATTN" else f"{platform.device_type}:{backend}",
            f"layers{model.get_num_layers(parallel)}",
            f"kv_heads{model.get_num_kv_heads(parallel)}",
            f"head{head_size}",
            f"rope:{rope!r}",
        ]
    )
    check_load_failure_policy(kv)
    extra = kv.kv_connector_extra_config if kv is not None else {}
    store_config = store_config_from_extra(extra, fingerprint=fingerprint)
    if rope is not None and backend == "CPU_ATTN" and isa not in VERIFIED_CPU_ATTN_ISAS:
        why = f"CPU_ATTN ISA {isa!r} has an unverified K layout"
    relocation = rope is not None and not why
    return ConnectorSettings(store_config, block_size, backend, isa, rope, relocation, why)
