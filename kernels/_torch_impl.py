"""The torch implementation of key rotation and block relocation (any device; used on CPU).

The rotation angles ``delta * inv_freq`` are formed in float64 and their cosines and
sines rounded once to the compute dtype, so a large delta (tens of thousands of
positions) loses no accuracy to a float32 angle; the multiply-adds then run in float32
(float64 for float64 inputs) and the result is rounded once to the cache dtype.
"""

from __future__ import annotations

import functools

import torch

from promptsplice.kernels._layout import PackedKVLayout
from promptsplice.kernels._rope import RopeConfig

__all__ = ["cos_sin_table", "rotate_inplace", "relocate_packed_torch", "relocate_torch"]


@functools.lru_cache(maxsize=64)
def _inv_freq64(rope: RopeConfig, device: torch.device) -> torch.Tensor:
    """``rope.inv_freq()`` as float64 on ``device``, cached (read-only: never mutate)."""
    return rope.inv_freq().to(device=device, dtype=torch.float64)


def cos_sin_table(
    delta: torch.Tensor, rope: RopeConfig, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``delta[..., None] * inv_freq``, shape ``delta.shape + [P]``.

    ``delta`` is an integer tensor; the table lands on its device in ``dtype``.
    """
    device = delta.device
    work = device if device.type in ("cpu", "cuda") else torch.device("cpu")
    angle = delta.to(device=work, dtype=torch.float64).unsqueeze(-1) * _inv_freq64(rope, work)
    return angle.cos().to(device=device, dtype=dtype), angle.sin().to(device=device, dtype=dtype)


def rotate_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeConfig) -> None:
    """Rotate the channel pairs of ``x`` (``[..., head_size]``, compute dtype) in place.

    ``cos``/``sin`` broadcast against ``[..., rotary_dim // 2]``.  Channels past
    ``rotary_dim`` are left as they are.  Each output is ``x1*cos - x2*sin`` /
    ``x2*cos + x1*sin`` with every product rounded before the sum (no fused
    multiply-add): the Triton kernel's arithmetic under the interpreter; compiled
    Triton may fuse it into a multiply-add, so GPU keys may differ in the last bit.
    """
    half = rope.num_pairs
    rot = rope.rotary_dim
    if rope.is_neox_style:
        x1, x2 = x[..., :half], x[..., half:rot]
    else:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
    x1_sin = x1 * sin
    x2_sin = x2 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)


def relocate_torch(
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    dst_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope: RopeConfig,
) -> None:
    """Write rotated ``k_src`` and unchanged ``v_src`` into blocks ``dst_ids``.

    All four K/V tensors are ``[blocks, kv_heads, block_size, head_size]`` views (any
    strides); ``cos``/``sin`` are float32 ``[n or 1, P]``.  Validation is the caller's.
    Passes over the data: one copy to float32, the rotation in place on it, one cast
    back, and the scatter of K and V into the cache.
    """
    compute = torch.float64 if k_src.dtype == torch.float64 else torch.float32
    k = k_src.to(compute, copy=True)
    rotate_inplace(k, cos.to(compute)[:, None, None, :], sin.to(compute)[:, None, None, :], rope)
    k_dst.index_copy_(0, dst_ids, k.to(k_dst.dtype))
    v_dst.index_copy_(0, dst_ids, v_src)


def relocate_packed_torch(
    dst_cache: torch.Tensor,
    src_blocks: torch.Tensor,
    k_src: torch.Tensor,
    dst_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope: RopeConfig,
    layout: PackedKVLayout,
) -> None:
    """:func:`relocate_torch` for a layout that packs its blocks: ``k_src`` (unpacked
    from ``src_blocks``) is rotated and written back packed, V is copied as stored."""
    compute = torch.float64 if k_src.dtype == torch.float64 else torch.float32
    k = k_src.to(compute)
    rotate_inplace(k, cos.to(compute)[:, None, None, :], sin.to(compute)[:, None, None, :], rope)
    layout.write_blocks(dst_cache, dst_ids, k.to(dst_cache.dtype), src_blocks)
