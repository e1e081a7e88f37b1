"""Where K and V of each token live inside a paged KV cache, per attention backend.

Every layout turns one layer's cache tensor (or a stack of blocks saved from it, which
has the same per-block layout) into two *strided views* ``K, V`` of logical shape
``[num_blocks, kv_heads, block_size, head_size]``.  The views alias the cache, so writing
through them writes the cache; their strides carry the layout, so the torch code and the
Triton kernel are layout-agnostic and only the view construction differs per backend.

Layouts implemented (all verified against vLLM's own source; CPU_ATTN also by writing
keys through vLLM's cache-write op and reading them back, see tests/kernels):

* :class:`CpuAttnLayout`: vLLM's CPU backend (``CPU_ATTN``).  A layer's cache is
  ``[num_blocks, kv_heads, block_size, 2 * head_size]``; each (block, head) region of
  ``2 * block_size * head_size`` elements holds K first, then V.  With the ``vec`` and
  ``vec16`` ISAs, K is stored *column-major* (``[head_size, block_size]``: element ``i``
  of the token at offset ``o`` is at ``o + i * block_size``) and V row-major
  (``[block_size, head_size]``).  With the ``amx`` ISA (bf16 on CPUs with AMX tiles)
  both halves are tiled for the AMX dot products: K as ``[block_size/16, head_size/2,
  16, 2]`` (channel pairs of 16-token groups) and V as ``[head_size/16, block_size/2,
  16, 2]`` (token pairs of 16-channel groups); verified element by element through
  vLLM's own write op.  Other ISAs (``neon``, ...) are refused until verified.
* :class:`FlashAttnLayout`: the classic FlashAttention paged cache
  ``[2, num_blocks, block_size, kv_heads, head_size]`` (K then V on dim 0).
* :class:`ConcatKVLayout`: vLLM's unified per-layer cache of the GPU backends (logical
  ``[num_blocks, kv_heads, block_size, 2 * head_size]``, K in the first ``head_size``
  channels, V in the last; any physical stride order, e.g. ``LBHNC`` or ``LBNHC``).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from promptsplice.errors import ConfigError, InputError

__all__ = [
    "KVLayout",
    "CpuAttnLayout",
    "FlashAttnLayout",
    "ConcatKVLayout",
    "VERIFIED_CPU_ATTN_ISAS",
    "detect_cpu_attn_isa",
    "gather_blocks",
]

#: CPU_ATTN ISAs whose block layout is verified through vLLM's write op (``vec``/``vec16``:
#: bf16, fp16, fp32; ``amx``: bf16, the only dtype vLLM picks it for).
VERIFIED_CPU_ATTN_ISAS = ("vec", "vec16", "amx")


@runtime_checkable
class KVLayout(Protocol):
    """How one layer's paged KV cache stores K and V.

    ``block_dim`` is the axis of the cache tensor that indexes blocks (a stack of saved
    blocks uses the same axis).  ``kv_views`` returns aliasing views ``K, V`` with the
    block axis first; for most layouts they are strided views of the logical shape
    ``[num_blocks, kv_heads, block_size, head_size]``.  A tiled layout (CPU_ATTN ``amx``)
    cannot be one strided view: its views keep the storage's tile axes, and
    ``to_logical`` / ``from_logical`` convert a K or V view to the logical shape (a copy)
    and back (a view of the given tensor in storage form, for ``index_copy_``).
    """

    name: ClassVar[str]
    block_dim: ClassVar[int]

    def kv_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every block, block axis first (see the class docstring)."""
        ...

    def to_logical(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """A K (``which="k"``) or V view as ``[blocks, kv_heads, block_size, head_size]``."""
        ...

    def from_logical(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """The inverse of :meth:`to_logical`: ``x`` in the storage form of the views."""
        ...


class _StridedLayout:
    """Mixin of the layouts whose views already have the logical shape."""

    __slots__ = ()

    def to_logical(self, x: torch.Tensor, which: str) -> torch.Tensor:
        return x

    def from_logical(self, x: torch.Tensor, which: str) -> torch.Tensor:
        return x


def gather_blocks(layout: KVLayout, cache: torch.Tensor, block_ids) -> torch.Tensor:
    """Copy the given blocks out of ``cache``: what a block store saves.

    The result keeps the cache's per-block layout (blocks stacked on ``block_dim``), so
    it is a valid ``src_blocks`` argument of ``relocate_blocks`` for the same layout.
    """
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device).reshape(-1)
    return cache.index_select(layout.block_dim, ids)


def _check_tensor(cache: torch.Tensor) -> None:
    if not isinstance(cache, torch.Tensor):
        raise InputError(f"expected a torch.Tensor KV cache, got {type(cache).__name__}")


@dataclass(frozen=True, slots=True)
class CpuAttnLayout:
    """vLLM's CPU attention cache for one layer (backend ``CPU_ATTN``).

    ``isa`` is the attention ISA vLLM chose for the layer: read it from the engine
    (``layer.isa``, set by ``CPUAttentionMetadataBuilder``) or, outside the engine, from
    :func:`detect_cpu_attn_isa`.  Only :data:`VERIFIED_CPU_ATTN_ISAS` are accepted: each
    ISA orders K its own way (``vec`` transposed, ``amx`` tiled), and rotating a wrongly
    read K corrupts it (relative error above 1, worse than not rotating at all).
    """

    isa: str = "vec"
    name: ClassVar[str] = "cpu_attn"
    block_dim: ClassVar[int] = 0
    #: Tile edge of the ``amx`` layout (tokens of a K tile, channels of a V tile).
    AMX_TILE: ClassVar[int] = 16

    def __post_init__(self) -> None:
        if self.isa not in VERIFIED_CPU_ATTN_ISAS:
            raise ConfigError(
                f"CPU_ATTN ISA {self.isa!r}: its KV block layout is not verified for "
                f"relocation (verified: {', '.join(VERIFIED_CPU_ATTN_ISAS)})"
            )

    def kv_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K as ``[nb, H, bs, hd]`` over column-major storage, V over row-major."""
        _check_tensor(cache)
        if cache.dim() != 4 or cache.shape[-1] % 2:
            raise InputError(
                "CPU_ATTN cache must be [num_blocks, kv_heads, block_size, 2*head_size], "
                f"got shape {tuple(cache.shape)}"
            )
        nb, heads, bs, two_hd = cache.shape
        hd = two_hd // 2
        try:
            # Same memory as vLLM's view [nb, H, 2*bs, hd] chunked on dim 2.
            flat = cache.view(nb, heads, bs * two_hd)
        except RuntimeError as exc:
            raise InputError(
                "CPU_ATTN cache blocks must be dense per (block, head): "
                f"strides {cache.stride()} do not allow it"
            ) from exc
        if self.isa == "amx":
            tile = self.AMX_TILE
            if cache.dtype != torch.bfloat16 or bs % tile or hd % tile:
                raise InputError(
                    f"CPU_ATTN amx cache must be bfloat16 with block_size and head_size "
                    f"multiples of {tile}, got {cache.dtype}, block_size {bs}, head_size {hd}"
                )
            # K: [bs/16, hd/2, 16 tokens, 2 channels]; V: [hd/16, bs/2, 16 channels, 2 tokens].
            k = flat[..., : bs * hd].unflatten(-1, (bs // tile, hd // 2, tile, 2))
            v = flat[..., bs * hd :].unflatten(-1, (hd // tile, bs // 2, tile, 2))
            return k, v
        k = flat[..., : bs * hd].unflatten(-1, (hd, bs)).transpose(-1, -2)
        v = flat[..., bs * hd :].unflatten(-1, (bs, hd))
        return k, v

    def to_logical(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """``[n, H, bs, hd]``: the view itself (``vec``), a copy out of the tiles (``amx``)."""
        if self.isa != "amx":
            return x
        n, heads = x.shape[:2]
        if which == "k":  # [n, H, bs/16, hd/2, 16, 2] -> [n, H, bs/16, 16, hd/2, 2]
            g, p, t, two = x.shape[2:]
            return x.permute(0, 1, 2, 4, 3, 5).reshape(n, heads, g * t, p * two)
        cg, tp, c, two = x.shape[2:]  # [n, H, hd/16, bs/2, 16, 2] -> [n, H, bs/2, 2, hd/16, 16]
        return x.permute(0, 1, 3, 5, 2, 4).reshape(n, heads, tp * two, cg * c)

    def from_logical(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """``x`` (``[n, H, bs, hd]``) viewed in the storage form of :meth:`kv_views`."""
        if self.isa != "amx":
            return x
        n, heads, bs, hd = x.shape
        tile = self.AMX_TILE
        if which == "k":
            return x.reshape(n, heads, bs // tile, tile, hd // 2, 2).permute(0, 1, 2, 4, 3, 5)
        return x.reshape(n, heads, bs // 2, 2, hd // tile, tile).permute(0, 1, 4, 2, 5, 3)


@dataclass(frozen=True, slots=True)
class FlashAttnLayout(_StridedLayout):
    """The classic FlashAttention paged cache ``[2, num_blocks, block_size, kv_heads,
    head_size]``: K at index 0, V at index 1 (vLLM's FlashAttention backend before the
    unified per-layer cache)."""

    name: ClassVar[str] = "flash_attn"
    block_dim: ClassVar[int] = 1

    def kv_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[nb, H, bs, hd]`` (a head/token transpose of the storage)."""
        _check_tensor(cache)
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise InputError(
                "FlashAttention cache must be [2, num_blocks, block_size, kv_heads, "
                f"head_size], got shape {tuple(cache.shape)}"
            )
        return cache[0].transpose(1, 2), cache[1].transpose(1, 2)


@dataclass(frozen=True, slots=True)
class ConcatKVLayout(_StridedLayout):
    """vLLM's unified per-layer cache of its GPU backends: logical ``[num_blocks,
    kv_heads, block_size, 2 * head_size]`` with K in channels ``[0, head_size)`` and V
    in ``[head_size, 2 * head_size)``.  The tensor's own strides give the physical
    order (``LBHNC``, ``LBNHC``, ...), so any of them works as handed over by vLLM."""

    name: ClassVar[str] = "concat_kv"
    block_dim: ClassVar[int] = 0

    def kv_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as channel slices of the cache (no copy)."""
        _check_tensor(cache)
        if cache.dim() != 4 or cache.shape[-1] % 2:
            raise InputError(
                "cache must be [num_blocks, kv_heads, block_size, 2*head_size], "
                f"got shape {tuple(cache.shape)}"
            )
        hd = cache.shape[-1] // 2
        return cache[..., :hd], cache[..., hd:]


def detect_cpu_attn_isa(
    dtype: torch.dtype,
    block_size: int,
    head_size: int,
    kv_cache_dtype: str = "auto",
) -> str:
    """The CPU attention ISA vLLM 0.32 would pick (``cpu_attn._get_attn_isa``).

    A mirror of vLLM's decision from torch's CPU feature probes, for callers without
    the engine at hand; inside the engine prefer the layer's own ``isa`` attribute
    (the ground truth).  Returns ``"vec16"``, ``"amx"``, ``"neon"``, ``"vec"``, or on
    RISC-V / s390x / POWER ``"rvv"`` / ``"vxe"`` / ``"vsx"`` (conservatively: those are
    refused by :class:`CpuAttnLayout` anyway).  Raises :class:`ConfigError` for a
    quantized (fp8) KV cache, whose scales relocation does not handle.
    """
    if str(kv_cache_dtype).startswith("fp8"):
        raise ConfigError(
            f"kv_cache_dtype {kv_cache_dtype!r}: quantized KV caches are not supported for "
            "relocation"
        )
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    machine = platform.machine().lower()
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    if machine.startswith(("arm", "aarch")):
        return "neon"
    if block_size % 32 != 0:
        return "vec16"
    if machine.startswith("riscv"):
        return "rvv"
    if machine == "s390x":
        return "vxe"
    if machine.startswith("ppc"):
        return "vsx"
    return "vec"
