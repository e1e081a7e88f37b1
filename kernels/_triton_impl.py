"""The Triton implementation of block relocation (CUDA; also runs under TRITON_INTERPRET=1).

One program handles one (source block, kv head, tile of tokens): it copies V, copies the
pass-through channels of K, and rotates K's channel pairs by the block's ``cos``/``sin``
row, reading and writing through the strides of the layout's K/V views, so every
layout shares this kernel.  The import of Triton is guarded: without it
:data:`TRITON_AVAILABLE` is False and the package still imports (CPU uses torch).
"""

from __future__ import annotations

import torch

from promptsplice.kernels._rope import RopeConfig

__all__ = ["TRITON_AVAILABLE", "relocate_triton"]

try:  # Triton is optional: absent on many CPU machines, and it has no CPU backend.
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    TRITON_AVAILABLE = False
except Exception as _exc:  # noqa: BLE001 - pragma: no cover - a broken install: said, then torch
    import logging

    logging.getLogger(__name__).warning("Triton is installed but failed to import (%s); the torch kernels run", _exc)
    triton = None
    tl = None
    TRITON_AVAILABLE = False


if TRITON_AVAILABLE:

    @triton.jit
    def _f32_to_bf16_rtne(x):
        """float32 -> bfloat16, round to nearest even, done on the bits.

        Compiled Triton already rounds this way, but the interpreter
        (TRITON_INTERPRET=1) truncates; rounding explicitly keeps one code path whose
        results are the same on both, so the CPU test checks what the GPU runs.
        """
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # keep NaN a NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _relocate_kernel(
        ks_ptr,
        vs_ptr,
        kd_ptr,
        vd_ptr,
        ids_ptr,
        cos_ptr,
        sin_ptr,
        ks_sb,
        ks_sh,
        ks_st,
        ks_sd,
        vs_sb,
        vs_sh,
        vs_st,
        vs_sd,
        kd_sb,
        kd_sh,
        kd_st,
        kd_sd,
        vd_sb,
        vd_sh,
        vd_st,
        vd_sd,
        cs_sb,
        block_size,
        head_size,
        IS_NEOX: tl.constexpr,
        ROT_DIM: tl.constexpr,
        HAS_PASS: tl.constexpr,
        OUT_BF16: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)
        dst_b = tl.load(ids_ptr + b).to(tl.int64)

        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < block_size
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_size

        ks = ks_ptr + b * ks_sb + h * ks_sh
        vs = vs_ptr + b * vs_sb + h * vs_sh
        kd = kd_ptr + dst_b * kd_sb + h * kd_sh
        vd = vd_ptr + dst_b * vd_sb + h * vd_sh

        # V: plain copy.
        m = t_ok[:, None] & d_ok[None, :]
        v = tl.load(vs + t[:, None] * vs_st + d[None, :] * vs_sd, mask=m)
        tl.store(vd + t[:, None] * vd_st + d[None, :] * vd_sd, v, mask=m)

        # K channels past rotary_dim: plain copy.
        if HAS_PASS:
            mp = m & (d[None, :] >= ROT_DIM)
            kp = tl.load(ks + t[:, None] * ks_st + d[None, :] * ks_sd, mask=mp)
            tl.store(kd + t[:, None] * kd_st + d[None, :] * kd_sd, kp, mask=mp)

        # K channel pairs: (j, j + P) for neox, (2j, 2j + 1) for GPT-J.
        j = tl.arange(0, BLOCK_P)
        j_ok = j < ROT_DIM // 2
        if IS_NEOX:
            i1 = j
            i2 = j + ROT_DIM // 2
        else:
            i1 = 2 * j
            i2 = 2 * j + 1
        c = tl.load(cos_ptr + b * cs_sb + j, mask=j_ok, other=0.0)
        s = tl.load(sin_ptr + b * cs_sb + j, mask=j_ok, other=0.0)
        mr = t_ok[:, None] & j_ok[None, :]
        x1 = tl.load(ks + t[:, None] * ks_st + i1[None, :] * ks_sd, mask=mr, other=0.0)
        x2 = tl.load(ks + t[:, None] * ks_st + i2[None, :] * ks_sd, mask=mr, other=0.0)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        o1 = x1 * c[None, :] - x2 * s[None, :]
        o2 = x2 * c[None, :] + x1 * s[None, :]
        if OUT_BF16:
            o1 = _f32_to_bf16_rtne(o1)
            o2 = _f32_to_bf16_rtne(o2)
        else:
            o1 = o1.to(kd_ptr.dtype.element_ty)
            o2 = o2.to(kd_ptr.dtype.element_ty)
        tl.store(kd + t[:, None] * kd_st + i1[None, :] * kd_sd, o1, mask=mr)
        tl.store(kd + t[:, None] * kd_st + i2[None, :] * kd_sd, o2, mask=mr)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def relocate_triton(
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    dst_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope: RopeConfig,
) -> None:
    """Launch the kernel: same contract as ``relocate_torch`` (float32 ``cos``/``sin``
    ``[n or 1, P]`` contiguous, int64 ``dst_ids`` ``[n]``; validation is the caller's)."""
    if not TRITON_AVAILABLE:  # pragma: no cover - guarded by the dispatcher
        raise RuntimeError("Triton is not installed")
    n, heads, block_size, head_size = k_src.shape
    if n == 0:
        return
    block_d = _next_pow2(head_size)
    block_p = _next_pow2(rope.num_pairs)
    block_t = min(_next_pow2(block_size), max(16, 4096 // block_d))
    grid = (n, heads, triton.cdiv(block_size, block_t))
    cs_sb = cos.stride(0) if cos.shape[0] > 1 else 0
    _relocate_kernel[grid](
        k_src,
        v_src,
        k_dst,
        v_dst,
        dst_ids,
        cos,
        sin,
        *k_src.stride(),
        *v_src.stride(),
        *k_dst.stride(),
        *v_dst.stride(),
        cs_sb,
        block_size,
        head_size,
        IS_NEOX=rope.is_neox_style,
        ROT_DIM=rope.rotary_dim,
        HAS_PASS=rope.rotary_dim < head_size,
        OUT_BF16=k_dst.dtype == torch.bfloat16,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        BLOCK_P=block_p,
    )
