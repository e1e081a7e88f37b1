"""``paged_kv``: the one map from an attention backend's name and cache tensor to its
layout; every backend it does not know is refused by name."""

from __future__ import annotations

import pytest
import torch

from promptsplice.errors import ConfigError
from promptsplice.kernels import (
    SUPPORTED_ATTN_BACKENDS,
    ConcatKVLayout,
    CpuAttnAmxLayout,
    CpuAttnLayout,
    FlashAttnLayout,
    FlashInferLayout,
    KVLayout,
    PackedKVLayout,
    PagedKV,
    gather_blocks,
    paged_kv,
)

NB, H, BS, HD = 5, 2, 16, 8


def test_cpu_attn_with_a_verified_isa_relocates():
    got = paged_kv("CPU_ATTN", torch.zeros(NB, H, BS, 2 * HD), isa="vec")
    assert got == PagedKV("CPU_ATTN", 0, BS, CpuAttnLayout("vec"), "")


def test_cpu_attn_with_an_unverified_isa_copies_whole_blocks_only():
    got = paged_kv("CPU_ATTN", torch.zeros(NB, H, 32, 2 * HD), isa="neon")
    assert (got.block_dim, got.block_size, got.layout) == (0, 32, None)
    assert "'neon'" in got.why_not and "not verified" in got.why_not


def test_cpu_attn_amx_packs_its_tiles():
    got = paged_kv("CPU_ATTN", torch.zeros(NB, H, 32, 2 * 64, dtype=torch.bfloat16), isa="amx")
    assert got == PagedKV("CPU_ATTN", 0, 32, CpuAttnAmxLayout(), "")
    assert isinstance(got.layout, PackedKVLayout) and not isinstance(got.layout, KVLayout)
    with pytest.raises(ConfigError, match="use CpuAttnAmxLayout"):
        CpuAttnLayout("amx")


def test_amx_tiles_element_by_element():
    """K of token t, channel c sits at (t//16)*16*hd + (c//2)*32 + (t%16)*2 + c%2 of its
    (block, head) region; V at (c//16)*16*bs + (t//2)*32 + (c%16)*2 + t%2."""
    bs, hd = 32, 64
    k = torch.randn(2, H, bs, hd)
    v = torch.randn(2, H, bs, hd)
    blocks = CpuAttnAmxLayout().pack(k, v)
    assert blocks.shape == (2, H, bs, 2 * hd)
    flat = blocks.reshape(2, H, 2 * bs * hd)
    for t, c in ((0, 0), (1, 0), (0, 1), (17, 5), (31, 63), (16, 32)):
        assert flat[1, 1, (t // 16) * 16 * hd + (c // 2) * 32 + (t % 16) * 2 + c % 2] == k[1, 1, t, c]
        assert flat[0, 1, bs * hd + (c // 16) * 16 * bs + (t // 2) * 32 + (c % 16) * 2 + t % 2] == v[0, 1, t, c]
    k2, v2 = CpuAttnAmxLayout().unpack(blocks)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_cpu_attn_needs_the_isa_and_its_own_shape():
    with pytest.raises(ConfigError, match="isa="):
        paged_kv("CPU_ATTN", torch.zeros(NB, H, BS, 2 * HD))
    with pytest.raises(ConfigError, match=r"CPU_ATTN cache must be .* got \(2, 5, 16, 2, 8\)"):
        paged_kv("CPU_ATTN", torch.zeros(2, NB, BS, H, HD), isa="vec")


@pytest.mark.parametrize(
    "backend, shape, block_dim, layout",
    [
        ("FLASH_ATTN", (2, NB, BS, H, HD), 1, FlashAttnLayout()),
        ("FLASHINFER", (NB, 2, BS, H, HD), 0, FlashInferLayout()),
        ("FLASH_ATTN", (NB, H, BS, 2 * HD), 0, ConcatKVLayout()),
        ("FLASHINFER", (NB, H, BS, 2 * HD), 0, ConcatKVLayout()),
    ],
)
def test_gpu_backends_by_cache_shape(backend, shape, block_dim, layout):
    cache = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    got = paged_kv(backend, cache)
    assert got == PagedKV(backend, block_dim, BS, layout, "")
    # The block axis is the one the layout's K/V views index blocks on.
    k, v = got.layout.kv_views(cache)
    assert k.shape == v.shape == (NB, H, BS, HD)
    saved = gather_blocks(got.layout, cache, [3])
    k3, v3 = got.layout.kv_views(saved)
    assert torch.equal(k3[0], k[3]) and torch.equal(v3[0], v[3])


def test_flashinfer_views_read_k_then_v_on_dim_1():
    cache = torch.randn(NB, 2, BS, H, HD)
    k, v = FlashInferLayout().kv_views(cache)
    assert torch.equal(k[2, 1, 7], cache[2, 0, 7, 1]) and torch.equal(v[4, 0, 3], cache[4, 1, 3, 0])
    k[1, 0, 2] = 42.0  # the views alias the cache
    assert torch.all(cache[1, 0, 2, 0] == 42.0)


def test_other_backends_and_shapes_are_refused_by_name():
    assert SUPPORTED_ATTN_BACKENDS == ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER")
    with pytest.raises(ConfigError, match="'TRITON_ATTN'.*supported: CPU_ATTN, FLASH_ATTN, FLASHINFER"):
        paged_kv("TRITON_ATTN", torch.zeros(NB, H, BS, 2 * HD))
    with pytest.raises(ConfigError, match=r"FLASHINFER cache of shape \(2, 5, 16, 2, 8\)"):
        paged_kv("FLASHINFER", torch.zeros(2, NB, BS, H, HD))
    with pytest.raises(ConfigError, match="FLASH_ATTN cache of shape"):
        paged_kv("FLASH_ATTN", torch.zeros(NB, BS, H * HD))
