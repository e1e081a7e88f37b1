"""The public relocation op: validate once, then dispatch by device to torch or Triton."""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from typing import Literal

import torch

from promptsplice.errors import ConfigError, InputError

from promptsplice.kernels._layout import KVLayout, PackedKVLayout, block_id_tensor, check_layout
from promptsplice.kernels._rope import RopeConfig
from promptsplice.kernels._torch_impl import cos_sin_table, relocate_packed_torch, relocate_torch, rotate_inplace
from promptsplice.kernels._triton_impl import TRITON_AVAILABLE, relocate_triton

__all__ = [
    "SUPPORTED_CACHE_DTYPES", "Impl", "PreparedRelocation", "kv_deviation", "prepare_relocation",
    "relocate_blocks", "rotate_keys", "select_impl",
]

#: Cache dtypes relocation handles; quantized (fp8) caches need their scales and are refused.
SUPPORTED_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Impl = Literal["auto", "torch", "triton"]


def select_impl(device: torch.device | str, impl: Impl = "auto") -> str:
    """Which implementation runs for tensors on ``device``: ``"triton"`` for CUDA when
    Triton is installed, else ``"torch"``.  Forcing ``"triton"`` on CPU tensors is only
    possible under ``TRITON_INTERPRET=1`` (set before Triton is imported)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device must be a torch.device or a device name such as 'cuda', got {device!r}") from exc
    if impl == "auto":
        return "triton" if device.type == "cuda" and TRITON_AVAILABLE else "torch"
    if impl == "torch":
        return "torch"
    if impl == "triton":
        if not TRITON_AVAILABLE:
            raise ConfigError("impl='triton' but Triton is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                "(set before Triton is imported)"
            )
        return "triton"
    raise ConfigError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")


MAX_DELTA = 1 << 29
"""The largest |position delta|: a float32 frequency (24 bits) times a delta of at most
29 bits is exact in the float64 angle table; past it the rotation degrades silently
(an angle error of 1e-7 at 2**31, meaningless at 2**53).  No model's context is near it."""


def _delta_tensor(delta: int | torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """A position delta (int, integer tensor or sequence of ints) as an int64 tensor,
    each within ``MAX_DELTA`` (checked on the host: ints, CPU tensors, and a device
    tensor wanted on the host; one that stays on its device is not: the check would
    stall its stream on a host sync)."""
    if isinstance(delta, bool):
        raise InputError("delta must be an integer number of positions, got a bool")
    try:
        if isinstance(delta, numbers.Integral):
            host = torch.tensor(int(delta), dtype=torch.int64)
        elif isinstance(delta, torch.Tensor):
            if delta.dtype.is_floating_point or delta.dtype.is_complex or delta.dtype == torch.bool:
                raise InputError(f"delta must be an integer tensor, got {delta.dtype}")
            if delta.device.type != "cpu" and device.type != "cpu":
                return delta.to(device=device, dtype=torch.int64)  # stays on the device: unchecked
            host = delta.to(device="cpu", dtype=torch.int64)  # (a copy to the host syncs anyway: checked)
        elif isinstance(delta, Sequence) and all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in delta
        ):
            host = torch.tensor([int(x) for x in delta], dtype=torch.int64)
        else:
            raise InputError(f"delta must be an int or integer tensor, got {type(delta).__name__}")
    except (OverflowError, RuntimeError, ValueError) as exc:  # torch: "Overflow when unpacking long long"
        raise InputError(f"delta must fit in int64 positions: {exc}") from exc
    if host.numel() and (int(host.min()) < -MAX_DELTA or int(host.max()) > MAX_DELTA):  # (abs of -2**63 wraps)
        raise InputError(f"delta must lie within +-{MAX_DELTA} positions (2**29), got [{int(host.min())}, {int(host.max())}]")
    return host.to(device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``: through page-locked memory without blocking
    the host on CUDA, as is elsewhere."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.contiguous().pin_memory().to(device, non_blocking=True)
    return t.to(device)


def rotate_keys(k: torch.Tensor, delta: int | torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """``R(delta) k``: keys ``[..., head_size]`` moved by ``delta`` positions.

    ``delta`` is an int or an integer tensor broadcasting against ``k.shape[:-1]``
    (e.g. ``[tokens, 1]`` for ``k`` of ``[tokens, heads, head_size]``).  Rotating raw
    (unrotated) keys by their positions applies RoPE itself.  Angles are formed in
    float64, the arithmetic runs in float32 (float64 for float64 keys), and the result
    comes back in ``k.dtype`` on ``k.device``.  A new tensor; ``k`` is not modified.
    """
    if not isinstance(k, torch.Tensor) or not k.dtype.is_floating_point:
        raise InputError("k must be a floating-point tensor")
    if not isinstance(rope, RopeConfig):
        raise ConfigError(f"rope must be the model's RopeConfig, got {type(rope).__name__}")
    if k.dim() == 0 or k.shape[-1] != rope.head_size:
        raise ConfigError(
            f"k's last dimension must be rope.head_size={rope.head_size}, got shape "
            f"{tuple(k.shape)}"
        )
    d = _delta_tensor(delta, k.device)
    try:
        if torch.broadcast_shapes(d.shape, k.shape[:-1]) != k.shape[:-1]:
            raise ValueError
    except (RuntimeError, ValueError) as exc:
        raise InputError(
            f"delta of shape {tuple(d.shape)} does not broadcast against k.shape[:-1]="
            f"{tuple(k.shape[:-1])}"
        ) from exc
    compute = torch.float64 if k.dtype == torch.float64 else torch.float32
    cos, sin = cos_sin_table(d, rope, compute)
    out = k.to(compute, copy=True)
    rotate_inplace(out, cos, sin, rope)
    return out.to(k.dtype)


def relocate_blocks(
    dst_cache: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_block_ids: torch.Tensor | Sequence[int],
    delta: int | torch.Tensor | Sequence[int],
    rope: RopeConfig,
    layout: KVLayout | PackedKVLayout,
    *,
    impl: Impl = "auto",
) -> None:
    """Write whole KV blocks into one layer's paged cache at a new position.

    ``src_blocks`` holds ``n`` blocks in the cache's own per-block layout (what a block
    store saved, e.g. ``gather_blocks(layout, cache, ids)``); block ``i`` goes to cache
    block ``dst_block_ids[i]`` with its keys rotated by ``delta`` (an int for all, or
    one int per block) positions, ``K(p + d) = R(d) K(p)``, and its values copied
    unchanged.  Every other cache block is left untouched.

    One signature, two implementations: CUDA tensors run the Triton kernel, others the
    torch code (``impl`` forces one); a tiled layout (:class:`PackedKVLayout`, e.g.
    ``CpuAttnAmxLayout``) runs the torch code, which unpacks K, rotates it and packs it.  The destination ids must be distinct and in range;
    ``src_blocks`` may alias ``dst_cache`` (it is copied first).  Raises
    :class:`InputError` on mismatched tensors and :class:`ConfigError` on unsupported
    dtypes, layouts or RoPE/cache disagreement.  The same relocation applied to many
    layers: :func:`prepare_relocation`.
    """
    prepare_relocation(dst_cache, src_blocks, dst_block_ids, delta, rope, layout, impl=impl)._apply(dst_cache, src_blocks)


def prepare_relocation(
    dst_cache: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_block_ids: torch.Tensor | Sequence[int],
    delta: int | torch.Tensor | Sequence[int],
    rope: RopeConfig,
    layout: KVLayout | PackedKVLayout,
    *,
    impl: Impl = "auto",
) -> PreparedRelocation:
    """:func:`relocate_blocks`'s arguments checked, and its block ids and rotation
    tables shipped to the device, once: the result relocates any layer's blocks whose
    cache and source tensors have the shapes, dtype and device of ``dst_cache`` and
    ``src_blocks`` (``prepared(cache, blocks)``).  A connector loading ``n`` blocks into
    every layer of a model pays the checks and the host-to-device copies of ids and
    tables once instead of once a layer (~0.13 ms of host time each on CUDA).  Raises
    what :func:`relocate_blocks` raises."""
    packed = check_layout(layout)
    if not isinstance(rope, RopeConfig):
        raise ConfigError(f"rope must be the model's RopeConfig, got {type(rope).__name__}")
    for name, t in (("dst_cache", dst_cache), ("src_blocks", src_blocks)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_CACHE_DTYPES:
            raise ConfigError(
                f"{name} dtype {t.dtype} is not supported for relocation (supported: "
                "bfloat16, float16, float32; quantized caches are not)"
            )
    if src_blocks.dtype != dst_cache.dtype:
        raise InputError(
            f"src_blocks dtype {src_blocks.dtype} != dst_cache dtype {dst_cache.dtype}"
        )
    if src_blocks.device != dst_cache.device:
        raise InputError(f"src_blocks on {src_blocks.device}, dst_cache on {dst_cache.device}")
    device = dst_cache.device
    which = select_impl(device, impl)
    if packed and which == "triton":
        raise ConfigError(f"layout {layout.name!r} packs its blocks in tiles: the Triton kernel needs a strided layout")

    if packed:  # one block's K copied out: its shape is what the checks below read
        bd = layout.block_dim
        k_src = layout.unpack(src_blocks.narrow(bd, 0, min(1, src_blocks.shape[bd])))[0]
        k_src = k_src.expand(src_blocks.shape[bd], *k_src.shape[1:]) if k_src.shape[0] else k_src
        k_dst = layout.unpack(dst_cache[:1])[0].expand(dst_cache.shape[bd], -1, -1, -1)
    else:
        k_dst, k_src = layout.kv_views(dst_cache)[0], layout.kv_views(src_blocks)[0]
    _check_writable(dst_cache)
    if k_src.shape[1:] != k_dst.shape[1:]:
        raise InputError(
            f"src_blocks blocks are [kv_heads, block_size, head_size]={tuple(k_src.shape[1:])}, "
            f"the cache's are {tuple(k_dst.shape[1:])}"
        )
    if k_dst.shape[-1] != rope.head_size:
        raise ConfigError(
            f"rope.head_size={rope.head_size} does not match the cache's head size "
            f"{k_dst.shape[-1]}"
        )
    n, num_blocks = k_src.shape[0], k_dst.shape[0]

    ids = block_id_tensor(dst_block_ids, "dst_block_ids").cpu()
    if ids.dim() != 1 or ids.shape[0] != n:
        raise InputError(
            f"dst_block_ids must be 1-D with {n} entries, got shape {tuple(ids.shape)}"
        )
    if n:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            raise InputError(f"dst_block_ids must lie in [0, {num_blocks}), got [{lo}, {hi}]")
        if ids.unique().numel() != n:
            raise InputError("dst_block_ids must be distinct (two blocks cannot share a slot)")

    # The delta and its cos/sin table are formed on the host and shipped without a
    # blocking copy: on CUDA no host sync stalls the stream this runs on.
    d = _delta_tensor(delta, torch.device("cpu"))
    if d.dim() == 0:
        d = d.reshape(1)
    elif d.dim() != 1 or d.shape[0] != n:
        raise InputError(
            f"delta must be an int or have one entry per block ({n}), got {tuple(d.shape)}"
        )
    if n == 0:
        return PreparedRelocation._make(dst_cache, src_blocks, layout, packed, which, rope, None, None, None)
    # Angles once per distinct delta (a load moves runs of blocks by one delta each: the
    # float64 angles of 512 blocks took ~5 ms of host time); one delta for all blocks is
    # one row, which the implementations broadcast.
    distinct, row = torch.unique(d, return_inverse=True) if d.numel() > 1 else (d, None)
    cos, sin = cos_sin_table(distinct, rope, torch.float32)
    if distinct.numel() > 1:  # (sorted: re-indexed to the blocks' order)
        cos, sin = cos[row], sin[row]
    cos, sin = _to_device(cos, device), _to_device(sin, device)
    return PreparedRelocation._make(dst_cache, src_blocks, layout, packed, which, rope, _to_device(ids, device), cos, sin)


def _check_writable(dst_cache: torch.Tensor) -> None:
    if dst_cache.requires_grad or any(st == 0 and sz > 1 for st, sz in zip(dst_cache.stride(), dst_cache.shape)):
        # index_copy_ raised torch's own error; on CUDA the kernel would race on shared memory
        raise InputError("dst_cache must be a writable KV cache: not an expanded view (a stride of 0) "
                         "and not requiring grad")


class PreparedRelocation:
    """A relocation checked once: made by :func:`prepare_relocation`, called with a
    layer's ``(dst_cache, src_blocks)`` of the prepared shapes, dtype and device; each
    call checks only those, that the cache is writable, and aliasing (an aliasing source
    is copied first).

    CUDA: the ids and tables were copied to the device on the stream current at
    preparation; a call on another stream waits for those copies (on the device) and
    keeps the tables alive for that stream, so a prepared relocation may be applied on
    any stream.
    """

    __slots__ = ("_cache_shape", "_src_shape", "_dtype", "_device", "_layout", "_packed", "_run", "_rope",
                 "_ids", "_cos", "_sin", "_stream", "_ready", "_used_on")

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise InputError("a PreparedRelocation is made by prepare_relocation(dst_cache, src_blocks, ids, delta, rope, layout)")

    @classmethod
    def _make(cls, dst_cache, src_blocks, layout, packed, which, rope, ids, cos, sin) -> PreparedRelocation:
        self = object.__new__(cls)
        self._cache_shape, self._src_shape = dst_cache.shape, src_blocks.shape
        self._dtype, self._device = dst_cache.dtype, dst_cache.device
        self._layout, self._packed, self._rope = layout, packed, rope
        self._run = relocate_triton if which == "triton" else relocate_torch
        self._ids, self._cos, self._sin = ids, cos, sin
        self._stream = self._ready = None
        self._used_on: set = set()
        if ids is not None and self._device.type == "cuda":
            self._stream = torch.cuda.current_stream(self._device)
            self._ready = torch.cuda.Event()
            self._ready.record(self._stream)
        return self

    @property
    def num_blocks(self) -> int:
        """Blocks this relocation writes into each layer."""
        return 0 if self._ids is None else int(self._ids.shape[0])

    def __repr__(self) -> str:
        return (f"PreparedRelocation(num_blocks={self.num_blocks}, cache={tuple(self._cache_shape)}, "
                f"dtype={self._dtype}, device={self._device}, impl={self._run.__name__})")

    def __call__(self, dst_cache: torch.Tensor, src_blocks: torch.Tensor) -> None:
        """Relocate ``src_blocks`` into ``dst_cache`` (one layer)."""
        for name, t, shape in (("dst_cache", dst_cache, self._cache_shape), ("src_blocks", src_blocks, self._src_shape)):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != self._dtype or t.device != self._device:
                got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(
                    f"{name} must be {tuple(shape)} {self._dtype} on {self._device}, as prepared; got {got} "
                    "(prepare_relocation once per cache geometry)"
                )
        _check_writable(dst_cache)
        self._apply(dst_cache, src_blocks)

    def _apply(self, dst_cache: torch.Tensor, src_blocks: torch.Tensor) -> None:
        """The relocation itself, on tensors already checked."""
        if self._ids is None:
            return
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            if current != self._stream and current not in self._used_on:
                current.wait_event(self._ready)  # the ids and tables' copies landed
                for t in (self._ids, self._cos, self._sin):
                    t.record_stream(current)  # not reused while this stream may read them
                self._used_on.add(current)
        if src_blocks.numel() and dst_cache.numel() and _memory_overlaps(src_blocks, dst_cache):
            src_blocks = src_blocks.clone()  # source and destination blocks could overlap
        layout = self._layout
        if self._packed:
            k_src = layout.unpack(src_blocks)[0]
            relocate_packed_torch(dst_cache, src_blocks, k_src, self._ids, self._cos, self._sin, self._rope, layout)
            return
        k_dst, v_dst = layout.kv_views(dst_cache)
        k_src, v_src = layout.kv_views(src_blocks)
        self._run(k_dst, v_dst, k_src, v_src, self._ids, self._cos, self._sin, self._rope)


def kv_deviation(
    fresh: torch.Tensor,
    old: torch.Tensor,
    delta: int,
    rope: RopeConfig | None,
    layout: KVLayout | PackedKVLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative L2 distance, per block, between freshly computed blocks and old blocks
    of the same tokens computed ``delta`` positions earlier.

    ``fresh`` and ``old``: ``n`` blocks each in ``layout``'s per-block layout (stacked on
    its ``block_dim``).  The old keys are rotated by ``delta`` first (``rope`` needed when
    ``delta != 0``).  Returns ``(k, v)``, float32 tensors of ``n`` values
    ``||fresh - old|| / ||fresh||`` (0 where the fresh block is all zeros).
    """
    packed = check_layout(layout)
    for name, t in (("fresh", fresh), ("old", old)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise InputError(f"{name} must be a floating-point torch.Tensor, got {type(t).__name__}")
    if fresh.shape != old.shape:
        raise InputError(
            f"fresh {tuple(fresh.shape)} and old {tuple(old.shape)} must hold the same blocks in the same layout"
        )
    if isinstance(delta, bool) or not isinstance(delta, numbers.Integral):
        raise InputError(f"delta must be an int number of positions, got {type(delta).__name__} {delta!r}")
    kf, vf = layout.unpack(fresh) if packed else layout.kv_views(fresh)
    ko, vo = layout.unpack(old) if packed else layout.kv_views(old)
    if delta:
        if rope is None:
            raise ConfigError("kv_deviation of blocks moved by a delta needs the model's RopeConfig")
        ko = rotate_keys(ko, int(delta), rope)

    def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a32 = a.float()
        num = (a32 - b.float()).flatten(1).norm(dim=1)
        den = a32.flatten(1).norm(dim=1)
        return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))

    return rel(kf, ko), rel(vf, vo)


def _memory_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory behind ``a`` and ``b`` overlaps: the same storage, or two
    storages over one buffer (numpy slices, ``frombuffer``, DLPack).  Until 2026-12-07
    only the same storage counted, and V was scattered from a source it overwrote."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    a0, b0 = sa.data_ptr(), sb.data_ptr()
    return a0 < b0 + sb.nbytes() and b0 < a0 + sa.nbytes()
