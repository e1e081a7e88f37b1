"""Splice kernel: move cached KV blocks to a new position in a paged KV cache.

RoPE rotates each key by its position, and ``K(p + d) = R(d) K(p)`` exactly, per
frequency pair; values do not depend on position.  So a block of K/V computed at
positions ``p..p+B-1`` becomes the block at ``p+d..`` by rotating its keys by ``d`` and
copying its values: :func:`relocate_blocks` does that for whole blocks of one layer,
writing them into given slots of the layer's paged cache (:func:`prepare_relocation`
checks the arguments once for many layers of one geometry).

* :class:`RopeConfig` (with :meth:`RopeConfig.from_hf_config`) says which RoPE applies:
  neox or GPT-J pairing, partial rotary, Llama-3 or linear frequency scaling; other
  scalings are refused with :class:`~promptsplice.errors.ConfigError`.
* Layouts (:class:`CpuAttnLayout`, :class:`CpuAttnAmxLayout`, :class:`FlashAttnLayout`,
  :class:`FlashInferLayout`, :class:`ConcatKVLayout`) hold all knowledge of where K and V sit inside a backend's
  cache blocks; :func:`paged_kv` picks one from a backend's name and cache tensor.
* One op, two implementations: a Triton kernel for CUDA tensors and torch code for the
  rest, chosen by device.  Triton is optional (:data:`TRITON_AVAILABLE`).

Pure tensor code: imports torch (Triton guarded), never vLLM.
"""

from __future__ import annotations

from promptsplice.kernels._layout import (
    SUPPORTED_ATTN_BACKENDS,
    VERIFIED_CPU_ATTN_ISAS,
    ConcatKVLayout,
    CpuAttnAmxLayout,
    CpuAttnLayout,
    FlashAttnLayout,
    FlashInferLayout,
    KVLayout,
    PackedKVLayout,
    PagedKV,
    detect_cpu_attn_isa,
    gather_blocks,
    paged_kv,
)
from promptsplice.kernels._relocate import (
    SUPPORTED_CACHE_DTYPES,
    PreparedRelocation,
    kv_deviation,
    prepare_relocation,
    relocate_blocks,
    rotate_keys,
    select_impl,
)
from promptsplice.kernels._rope import SUPPORTED_ROPE_TYPES, Llama3Scaling, RopeConfig
from promptsplice.kernels._triton_impl import TRITON_AVAILABLE

__all__ = [
    "ConcatKVLayout",
    "CpuAttnAmxLayout",
    "CpuAttnLayout",
    "FlashAttnLayout",
    "FlashInferLayout",
    "KVLayout",
    "Llama3Scaling",
    "PackedKVLayout",
    "PagedKV",
    "PreparedRelocation",
    "RopeConfig",
    "SUPPORTED_ATTN_BACKENDS",
    "SUPPORTED_CACHE_DTYPES",
    "SUPPORTED_ROPE_TYPES",
    "TRITON_AVAILABLE",
    "VERIFIED_CPU_ATTN_ISAS",
    "detect_cpu_attn_isa",
    "gather_blocks",
    "kv_deviation",
    "paged_kv",
    "prepare_relocation",
    "relocate_blocks",
    "rotate_keys",
    "select_impl",
]
