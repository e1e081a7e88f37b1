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
  (``[block_size, head_size]``).
* :class:`CpuAttnAmxLayout`: the same cache with the ``amx`` ISA, where K and V are
  packed in VNNI tiles: per (block, head), K is ``[block_size/16, head_size/2, 16, 2]``
  (tokens in tiles of 16, channel pairs innermost) and V ``[head_size/16,
  block_size/2, 16, 2]`` (token pairs innermost).  No strided view reads that as
  ``[block_size, head_size]``, so this layout *packs*: it copies K out, and writes it
  back packed.  Other ISAs (``neon``, ``vsx``, ...) are refused until verified.
* :class:`FlashAttnLayout`: the classic FlashAttention paged cache
  ``[2, num_blocks, block_size, kv_heads, head_size]`` (K then V on dim 0).
* :class:`FlashInferLayout`: FlashInfer's paged cache ``[num_blocks, 2, block_size,
  kv_heads, head_size]`` (K then V on dim 1; the HND order is the same logical shape
  with other strides).
* :class:`ConcatKVLayout`: vLLM's unified per-layer cache of the GPU backends (logical
  ``[num_blocks, kv_heads, block_size, 2 * head_size]``, K in the first ``head_size``
  channels, V in the last; any physical stride order, e.g. ``LBHNC`` or ``LBNHC``).

:func:`paged_kv` is the one place that maps an attention backend's name and a layer's
cache tensor to its layout: the splice connector's worker side reads every layout
through it, and any backend not listed in :data:`SUPPORTED_ATTN_BACKENDS` is refused
by name.
"""

from __future__ import annotations

import numbers

import platform
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch

from promptsplice.errors import ConfigError, InputError

__all__ = [
    "KVLayout",
    "CpuAttnLayout",
    "FlashAttnLayout",
    "FlashInferLayout",
    "ConcatKVLayout",
    "CpuAttnAmxLayout",
    "PackedKVLayout",
    "PagedKV",
    "SUPPORTED_ATTN_BACKENDS",
    "VERIFIED_CPU_ATTN_ISAS",
    "detect_cpu_attn_isa",
    "gather_blocks",
    "paged_kv",
]

#: CPU_ATTN ISAs whose block layout is verified against vLLM's write op: ``vec`` and
#: ``vec16`` (:class:`CpuAttnLayout`; bf16/fp16/fp32), ``amx`` (:class:`CpuAttnAmxLayout`; bf16).
VERIFIED_CPU_ATTN_ISAS = ("vec", "vec16", "amx")
_STRIDED_CPU_ATTN_ISAS = ("vec", "vec16")


@runtime_checkable
class KVLayout(Protocol):
    """How one layer's paged KV cache stores K and V.

    ``block_dim`` is the axis of the cache tensor that indexes blocks (a stack of saved
    blocks uses the same axis).  ``kv_views`` returns strided, aliasing views
    ``K, V`` of shape ``[num_blocks, kv_heads, block_size, head_size]``.
    """

    name: ClassVar[str]
    block_dim: ClassVar[int]

    def kv_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every block as ``[num_blocks, kv_heads, block_size, head_size]``."""
        ...


def check_layout(layout: Any) -> bool:
    """``layout`` is a :class:`KVLayout` or a :class:`PackedKVLayout` (returned: packed),
    checked cheaply by what relocation uses (else :class:`ConfigError`)."""
    packed = hasattr(layout, "unpack") and hasattr(layout, "write_blocks")
    if not (packed or hasattr(layout, "kv_views")) or not hasattr(layout, "block_dim"):
        raise ConfigError(f"layout must be a KVLayout (e.g. CpuAttnLayout), got {layout!r}")
    return packed


def gather_blocks(layout: KVLayout, cache: torch.Tensor, block_ids) -> torch.Tensor:
    """Copy the given blocks out of ``cache``: what a block store saves.

    The result keeps the cache's per-block layout (blocks stacked on ``block_dim``), so
    it is a valid ``src_blocks`` argument of ``relocate_blocks`` for the same layout.
    """
    check_layout(layout)
    _check_tensor(cache)
    ids = block_id_tensor(block_ids, "block_ids").cpu().reshape(-1)  # checked on the host, as relocation's
    num_blocks = cache.shape[layout.block_dim]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise InputError(f"block_ids must lie in [0, {num_blocks}), got [{int(ids.min())}, {int(ids.max())}]")
    return cache.index_select(layout.block_dim, ids.to(cache.device))


def block_id_tensor(block_ids: Any, what: str) -> torch.Tensor:
    """Block ids (an integer tensor or a sequence of ints) as an int64 tensor; floats,
    bools and strings are :class:`InputError` (``1.7`` was taken as block 1)."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
            raise InputError(f"{what} must be an integer tensor, got {block_ids.dtype}")
        return block_ids.to(torch.int64)
    try:
        items = list(block_ids)
    except TypeError:
        raise InputError(f"{what} must be a sequence of ints or an integer tensor, got {type(block_ids).__name__}") from None
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in items):
        raise InputError(f"{what} must hold ints, got {[type(x).__name__ for x in items][:4]}")
    try:
        return torch.tensor([int(x) for x in items], dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError) as exc:  # ValueError: past 2**64
        raise InputError(f"{what} holds an id outside int64: {exc}") from exc


def _check_tensor(cache: torch.Tensor) -> None:
    if not isinstance(cache, torch.Tensor):
        raise InputError(f"expected a torch.Tensor KV cache, got {type(cache).__name__}")


@dataclass(frozen=True, slots=True)
class CpuAttnLayout:
    """vLLM's CPU attention cache for one layer (backend ``CPU_ATTN``).

    ``isa`` is the attention ISA vLLM chose for the layer: read it from the engine
    (``layer.isa``, set by ``CPUAttentionMetadataBuilder``) or, outside the engine, from
    :func:`detect_cpu_attn_isa`.  Only ``vec`` and ``vec16`` are accepted (``amx`` packs
    its tiles: :class:`CpuAttnAmxLayout`): rotating a wrongly read K corrupts it
    (relative error above 1, worse than not rotating at all).
    """

    isa: str = "vec"
    name: ClassVar[str] = "cpu_attn"
    block_dim: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if self.isa == "amx":
            raise ConfigError("CPU_ATTN ISA 'amx' packs K and V in tiles: use CpuAttnAmxLayout")
        if self.isa not in _STRIDED_CPU_ATTN_ISAS:
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
        k = flat[..., : bs * hd].unflatten(-1, (hd, bs)).transpose(-1, -2)
        v = flat[..., bs * hd :].unflatten(-1, (bs, hd))
        return k, v


@runtime_checkable
class PackedKVLayout(Protocol):
    """A cache layout no strided view can read (tiles): K and V are copied out
    (``unpack``) and K written back packed (``write_blocks``)."""

    name: ClassVar[str]
    block_dim: ClassVar[int]

    def unpack(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V as ``[num_blocks, kv_heads, block_size, head_size]``."""
        ...

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Blocks in this layout holding K and V (``[n, kv_heads, block_size, head_size]``)."""
        ...

    def write_blocks(self, cache: torch.Tensor, ids: torch.Tensor, k: torch.Tensor, src: torch.Tensor) -> None:
        """Cache blocks ``ids`` get K ``k`` (logical) packed, and the V of ``src``
        (blocks in this layout) unchanged."""
        ...


@dataclass(frozen=True, slots=True)
class CpuAttnAmxLayout:
    """vLLM's CPU attention cache with the ``amx`` ISA (bf16): per (block, head), K as
    ``[block_size/16, head_size/2, 16, 2]`` and V as ``[head_size/16, block_size/2, 16,
    2]`` (VNNI tiles; see the module doc).  A :class:`PackedKVLayout`."""

    name: ClassVar[str] = "cpu_attn_amx"
    block_dim: ClassVar[int] = 0

    @staticmethod
    def _halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        _check_tensor(cache)
        if cache.dim() != 4 or cache.shape[-1] % 32 or cache.shape[2] % 16:
            raise InputError(
                "CPU_ATTN (amx) cache must be [num_blocks, kv_heads, block_size, 2*head_size] with "
                f"block_size a multiple of 16 and head_size of 16, got shape {tuple(cache.shape)}"
            )
        nb, heads, bs, two_hd = cache.shape
        hd = two_hd // 2
        try:
            flat = cache.view(nb, heads, bs * two_hd)
        except RuntimeError as exc:
            raise InputError(
                f"CPU_ATTN cache blocks must be dense per (block, head): strides {cache.stride()}"
            ) from exc
        return flat[..., : bs * hd], flat[..., bs * hd :], bs, hd

    def unpack(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kr, vr, bs, hd = self._halves(blocks)
        nb, heads = kr.shape[:2]
        k = kr.unflatten(-1, (bs // 16, hd // 2, 16, 2)).permute(0, 1, 2, 4, 3, 5)
        v = vr.unflatten(-1, (hd // 16, bs // 2, 16, 2)).permute(0, 1, 3, 5, 2, 4)
        return k.reshape(nb, heads, bs, hd), v.reshape(nb, heads, bs, hd)

    @staticmethod
    def _pack_k(k: torch.Tensor) -> torch.Tensor:
        n, heads, bs, hd = k.shape
        return k.reshape(n, heads, bs // 16, 16, hd // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, heads, bs * hd)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, heads, bs, hd = k.shape
        pv = v.reshape(n, heads, bs // 2, 2, hd // 16, 16).permute(0, 1, 4, 2, 5, 3).reshape(n, heads, bs * hd)
        return torch.cat([self._pack_k(k), pv], dim=-1).view(n, heads, bs, 2 * hd)

    def write_blocks(self, cache: torch.Tensor, ids: torch.Tensor, k: torch.Tensor, src: torch.Tensor) -> None:
        kr, vr, _, _ = self._halves(cache)
        _, src_v, _, _ = self._halves(src)
        kr.index_copy_(0, ids, self._pack_k(k).to(cache.dtype))
        vr.index_copy_(0, ids, src_v)


@dataclass(frozen=True, slots=True)
class FlashAttnLayout:
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
class FlashInferLayout:
    """FlashInfer's paged cache ``[num_blocks, 2, block_size, kv_heads, head_size]``: K
    at index 0 of dim 1, V at index 1 (vLLM's FlashInfer backend before the unified
    per-layer cache).  Its ``HND`` variant is the same logical shape with permuted
    strides, so both read correctly."""

    name: ClassVar[str] = "flashinfer"
    block_dim: ClassVar[int] = 0

    def kv_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[nb, H, bs, hd]`` (a head/token transpose of the storage)."""
        _check_tensor(cache)
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise InputError(
                "FlashInfer cache must be [num_blocks, 2, block_size, kv_heads, "
                f"head_size], got shape {tuple(cache.shape)}"
            )
        return cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)


@dataclass(frozen=True, slots=True)
class ConcatKVLayout:
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
    refused by :func:`paged_kv` for relocation anyway).  Raises :class:`ConfigError` for a
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


#: vLLM attention backends (their ``get_name()``) whose paged caches :func:`paged_kv` reads.
SUPPORTED_ATTN_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER")


class PagedKV(NamedTuple):
    """How one layer's paged cache is indexed: blocks on axis ``block_dim``, each of
    ``block_size`` tokens; ``layout`` reads K and V for relocation, or is ``None`` when
    only whole blocks can be copied (``why_not`` says why)."""

    backend: str
    block_dim: int
    block_size: int
    layout: KVLayout | PackedKVLayout | None
    why_not: str = ""


def paged_kv(backend: str, cache: torch.Tensor, *, isa: str | None = None) -> PagedKV:
    """The layout of ``cache``, one layer's paged KV cache of attention backend
    ``backend`` (vLLM's backend name; ``isa``: the layer's CPU attention ISA, needed for
    ``CPU_ATTN``).

    ``CPU_ATTN``: ``[num_blocks, kv_heads, block_size, 2 * head_size]``
    (:class:`CpuAttnLayout`, :class:`CpuAttnAmxLayout` for ``amx``); an ISA whose K
    order is not verified still copies whole blocks (``layout`` ``None``).
    ``FLASH_ATTN``: ``[2, num_blocks, block_size, kv_heads, head_size]``; ``FLASHINFER``:
    ``[num_blocks, 2, block_size, kv_heads, head_size]``; either as vLLM's unified
    per-layer cache ``[num_blocks, kv_heads, block_size, 2 * head_size]``
    (:class:`ConcatKVLayout`).  Raises :class:`ConfigError` for any other backend (by
    name) or a cache of another shape.
    """
    _check_tensor(cache)
    shape = tuple(cache.shape)
    layout: KVLayout | PackedKVLayout | None
    if backend == "CPU_ATTN":
        if len(shape) != 4 or shape[-1] % 2:
            raise ConfigError(
                f"CPU_ATTN cache must be [num_blocks, kv_heads, block_size, 2*head_size], got {shape}"
            )
        if not isinstance(isa, str) or not isa:
            raise ConfigError("CPU_ATTN: pass the layer's attention ISA (isa=...), its K order depends on it")
        try:
            layout = CpuAttnAmxLayout() if isa == "amx" else CpuAttnLayout(isa)
        except ConfigError as exc:
            return PagedKV(backend, 0, shape[2], None, str(exc))
        return PagedKV(backend, 0, shape[2], layout)
    if backend in ("FLASH_ATTN", "FLASHINFER"):
        if len(shape) == 4 and shape[-1] % 2 == 0:
            return PagedKV(backend, 0, shape[2], ConcatKVLayout())
        if backend == "FLASH_ATTN" and len(shape) == 5 and shape[0] == 2:
            return PagedKV(backend, 1, shape[2], FlashAttnLayout())
        if backend == "FLASHINFER" and len(shape) == 5 and shape[1] == 2:
            return PagedKV(backend, 0, shape[2], FlashInferLayout())
        raise ConfigError(
            f"{backend} cache of shape {shape}: expected vLLM's unified [num_blocks, kv_heads, "
            "block_size, 2*head_size] or the backend's own 5-D paged layout"
        )
    raise ConfigError(
        f"attention backend {backend!r}: its KV cache layout is not supported "
        f"(supported: {', '.join(SUPPORTED_ATTN_BACKENDS)}); run the engine with one of those"
    )
