"""Relocation against an independent float64 reference, torch here and Triton under
TRITON_INTERPRET=1 in a subprocess, on fresh random inputs with poisoned destinations.

The reference rotates each channel pair as a complex number by ``exp(i * d * inv_freq)``
in float64, with the pairs listed explicitly; it shares nothing with the implementation
but ``RopeConfig.inv_freq`` (itself pinned to vLLM's values in test_vllm_ground_truth).
Inputs are drawn from a fresh seed each run (``PROMPTSPLICE_TEST_SEED`` pins one); a
failure message names the seed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from promptsplice.kernels import (
    PreparedRelocation,
    prepare_relocation,
    ConcatKVLayout,
    CpuAttnAmxLayout,
    CpuAttnLayout,
    FlashAttnLayout,
    FlashInferLayout,
    Llama3Scaling,
    RopeConfig,
    gather_blocks,
    relocate_blocks,
    rotate_keys,
)
from promptsplice.errors import ConfigError, InputError

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("PROMPTSPLICE_TEST_SEED") or secrets.randbits(31))

# Unit roundoff of each cache dtype (half an ulp, relative).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
F32_EPS = 2.0**-24


def gen(offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


# --------------------------------------------------------------------------- reference


def pairs(rope: RopeConfig) -> tuple[list[int], list[int]]:
    """Channel indices of each rotated pair, written out explicitly."""
    p = rope.rotary_dim // 2
    if rope.is_neox_style:
        return list(range(p)), [i + p for i in range(p)]
    return [2 * i for i in range(p)], [2 * i + 1 for i in range(p)]


def ref_rotate(k: torch.Tensor, delta, rope: RopeConfig) -> torch.Tensor:
    """float64 ``R(delta) k`` for ``k`` ``[..., head_size]`` (delta broadcasts to k[..., 0])."""
    k = k.to(torch.float64)
    a, b = pairs(rope)
    inv = rope.inv_freq().to(torch.float64)
    d = torch.as_tensor(delta, dtype=torch.float64)
    z = torch.complex(k[..., a], k[..., b]) * torch.polar(
        torch.ones((), dtype=torch.float64), d[..., None] * inv
    )
    out = k.clone()
    out[..., a] = z.real
    out[..., b] = z.imag
    return out


def assert_matches_ref(out: torch.Tensor, ref: torch.Tensor, inputs: torch.Tensor, what: str):
    """``out`` (cache dtype) is ``ref`` (float64) rounded once, up to float32 arithmetic:
    |out - ref| <= u * |ref| + 8 eps32 * max|input| (+ the dtype's subnormal step)."""
    u = UNIT_ROUNDOFF[out.dtype]
    scale = float(inputs.detach().abs().max().double()) if inputs.numel() else 0.0
    tiny = float(torch.finfo(out.dtype).smallest_normal) * u
    err = (out.to(torch.float64) - ref).abs()
    bound = u * ref.abs() + 8 * F32_EPS * scale + tiny
    bad = err > bound
    assert not torch.isnan(out).any(), f"{what}: NaN in output (seed {SEED})"
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off; worst err "
        f"{float(err.max()):.3g} (seed {SEED})"
    )


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    head_size: int
    rotary_dim: int
    neox: bool
    theta: float = 10000.0
    llama3: bool = False
    linear: float = 1.0
    heads: int = 2
    block_size: int = 32
    per_block_delta: bool = False
    delta: int = 37

    def rope(self) -> RopeConfig:
        return RopeConfig(
            head_size=self.head_size,
            rotary_dim=self.rotary_dim,
            theta=self.theta,
            is_neox_style=self.neox,
            llama3_scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192) if self.llama3 else None,
            linear_factor=self.linear,
        )


CASES = [
    Case("smollm2-bf16-neox", torch.bfloat16, 64, 64, True, theta=100000.0, heads=3, delta=37),
    Case("bf16-neox-negative", torch.bfloat16, 128, 128, True, delta=-1000, block_size=16),
    Case("fp32-gptj-partial", torch.float32, 128, 64, False, per_block_delta=True),
    Case("fp32-neox-partial-llama3", torch.float32, 64, 32, True, theta=500000.0, llama3=True,
         per_block_delta=True),
    Case("bf16-llama3-bigdelta", torch.bfloat16, 80, 80, True, theta=500000.0, llama3=True,
         delta=123457),
    Case("fp16-gptj-linear", torch.float16, 64, 48, False, linear=2.0, delta=-5),
    Case("bf16-gptj-odd-block", torch.bfloat16, 96, 96, False, heads=1, block_size=48,
         per_block_delta=True),
]
LAYOUTS = ["cpu_attn", "flash_attn", "flashinfer", "flashinfer_hnd", "concat_kv", "concat_kv_lbnhc"]
PACKED_LAYOUTS = ["cpu_attn_amx"]  # tiles: torch only (the Triton kernel needs strides)


def views(layout, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every block as [nb, H, bs, hd] (copies for a packed layout)."""
    return layout.unpack(cache) if hasattr(layout, "unpack") else layout.kv_views(cache)


def make_cache(layout_name: str, nb: int, case: Case, fill: torch.Tensor | float):
    """(layout, cache) with ``nb`` blocks, filled from ``fill`` (a tensor of the logical
    [nb, H, bs, 2*hd] contents, or a scalar poison)."""
    h, bs, hd = case.heads, case.block_size, case.head_size
    if layout_name == "cpu_attn":
        layout = CpuAttnLayout("vec" if hd % 32 == 0 else "vec16")
        cache = torch.empty(nb, h, bs, 2 * hd, dtype=case.dtype)
    elif layout_name == "flash_attn":
        layout = FlashAttnLayout()
        cache = torch.empty(2, nb, bs, h, hd, dtype=case.dtype)
    elif layout_name == "flashinfer":
        layout = FlashInferLayout()
        cache = torch.empty(nb, 2, bs, h, hd, dtype=case.dtype)
    elif layout_name == "flashinfer_hnd":  # heads outside tokens in memory
        layout = FlashInferLayout()
        cache = torch.empty(nb, 2, h, bs, hd, dtype=case.dtype).transpose(2, 3)
    elif layout_name == "cpu_attn_amx":
        layout = CpuAttnAmxLayout()
        cache = torch.empty(nb, h, bs, 2 * hd, dtype=case.dtype)
        if isinstance(fill, torch.Tensor):
            return layout, layout.pack(fill[0], fill[1])
    elif layout_name == "concat_kv":
        layout = ConcatKVLayout()
        cache = torch.empty(nb, h, bs, 2 * hd, dtype=case.dtype)
    elif layout_name == "concat_kv_lbnhc":  # tokens outside heads in memory
        layout = ConcatKVLayout()
        cache = torch.empty(nb, bs, h, 2 * hd, dtype=case.dtype).permute(0, 2, 1, 3)
    else:
        raise AssertionError(layout_name)
    if isinstance(fill, torch.Tensor):
        k, v = layout.kv_views(cache)
        k.copy_(fill[0])
        v.copy_(fill[1])
    else:
        cache.fill_(fill)
    return layout, cache


def run_case(case: Case, layout_name: str, impl: str, offset: int = 0) -> torch.Tensor:
    """Relocate 3 random blocks of a 5-block store into a poisoned 7-block cache and check
    every element: moved K against the reference, V exact, other blocks still poison."""
    rope = case.rope()
    g = gen(offset)
    h, bs, hd = case.heads, case.block_size, case.head_size
    store_kv = torch.randn(2, 5, h, bs, hd, generator=g).to(case.dtype)
    layout, store = make_cache(layout_name, 5, case, store_kv)
    src_ids = [3, 0, 4]
    src = gather_blocks(layout, store, src_ids)
    dst_ids = [5, 1, 2]
    if case.per_block_delta:
        delta = torch.tensor([case.delta, -case.delta * 3 - 1, 0])
    else:
        delta = case.delta
    _, dst = make_cache(layout_name, 7, case, float("nan"))
    relocate_blocks(dst, src, dst_ids, delta, rope, layout, impl=impl)

    k_dst, v_dst = views(layout, dst)
    d = torch.as_tensor(delta).reshape(-1, 1, 1).expand(3, 1, 1)
    for i, (s, t) in enumerate(zip(src_ids, dst_ids)):
        k_in = store_kv[0, s]
        ref = ref_rotate(k_in, d[i], rope)
        where = f"{case.name}/{layout_name}/{impl} block {s}->{t}"
        assert_matches_ref(k_dst[t], ref, k_in, where + " K")
        assert torch.equal(v_dst[t], store_kv[1, s]), where + f" V differs (seed {SEED})"
        if rope.rotary_dim < hd:  # pass-through channels exact
            assert torch.equal(k_dst[t][..., rope.rotary_dim :], k_in[..., rope.rotary_dim :])
    untouched = [b for b in range(7) if b not in dst_ids]
    assert torch.isnan(k_dst[untouched]).all() and torch.isnan(v_dst[untouched]).all(), (
        f"{case.name}/{layout_name}/{impl}: a block outside dst_block_ids was written"
    )
    # The raw cache: exactly the moved blocks' elements changed from poison.
    raw_written = (~torch.isnan(dst)).sum()
    assert int(raw_written) == 3 * 2 * h * bs * hd
    return dst


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (so NaN poison compares equal to itself)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints)


# --------------------------------------------------------------------------- torch


@pytest.mark.parametrize("layout_name", LAYOUTS + PACKED_LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_relocation_matches_float64_reference(case, layout_name):
    run_case(case, layout_name, "torch")


def test_untouched_blocks_keep_their_content_bit_for_bit():
    case = CASES[0]
    g = gen(1)
    kv = torch.randn(2, 6, case.heads, case.block_size, case.head_size, generator=g)
    layout, cache = make_cache("cpu_attn", 6, case, kv.to(case.dtype))
    before = cache.clone()
    src = gather_blocks(layout, cache, [0, 1])
    relocate_blocks(cache, src, [4, 5], 64, case.rope(), layout)
    assert torch.equal(cache[:4], before[:4])
    assert not torch.equal(cache[4], before[4])


def test_source_may_alias_the_destination_cache():
    """Moving blocks 0,1 -> 1,2 inside one cache reads the old block 1, not the new."""
    case = CASES[2]
    g = gen(2)
    kv = torch.randn(2, 4, case.heads, case.block_size, case.head_size, generator=g)
    layout, cache = make_cache("flash_attn", 4, case, kv.to(case.dtype))
    k_old = layout.kv_views(cache)[0].clone()
    relocate_blocks(cache, cache[:, 0:2], [1, 2], 10, case.rope(), layout)
    k_new = layout.kv_views(cache)[0]
    for s, t in ((0, 1), (1, 2)):
        assert_matches_ref(k_new[t], ref_rotate(k_old[s], 10, case.rope()), k_old[s], "alias")


def test_a_source_over_the_caches_memory_in_another_storage_is_read_before_it_is_written():
    """A source made from the same buffer as the cache but as a storage of its own (a
    numpy slice, ``frombuffer``, DLPack): only the same storage counted as aliasing
    until 2026-12-07, and V was scattered from blocks it was overwriting (max abs
    error 5.2 in a review's repro)."""
    import numpy as np

    rope = RopeConfig(head_size=64, rotary_dim=64)
    buf = np.random.default_rng(0).standard_normal((6, 2, 16, 128)).astype(np.float32)
    expected = torch.from_numpy(buf.copy())
    relocate_blocks(expected, torch.from_numpy(buf[1:4].copy()), [2, 3, 4], 7, rope, ConcatKVLayout())
    cache, src = torch.from_numpy(buf), torch.from_numpy(buf[1:4])
    assert src.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()
    relocate_blocks(cache, src, [2, 3, 4], 7, rope, ConcatKVLayout())
    assert torch.equal(cache, expected)


def test_packed_layout_reads_an_aliased_source_and_stays_off_triton(monkeypatch):
    case = CASES[0]
    kv = torch.randn(2, 4, case.heads, case.block_size, case.head_size, generator=gen(4))
    layout, cache = make_cache("cpu_attn_amx", 4, case, kv.to(case.dtype))
    k_old, v_old = views(layout, cache)
    relocate_blocks(cache, cache[0:2], [1, 2], 10, case.rope(), layout)
    k_new, v_new = views(layout, cache)
    for s, t in ((0, 1), (1, 2)):
        assert_matches_ref(k_new[t], ref_rotate(k_old[s].double(), 10, case.rope()), k_old[s], "amx alias")
        assert torch.equal(v_new[t], v_old[s])
    assert torch.equal(k_new[[0, 3]], k_old[[0, 3]])
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton is a pinned dependency of the tests
    with pytest.raises(ConfigError, match="strided layout"):
        relocate_blocks(cache, cache[0:1], [3], 10, case.rope(), layout, impl="triton")


@pytest.mark.parametrize("layout_name", ["flash_attn", "concat_kv_lbnhc", "cpu_attn_amx"])
def test_prepared_relocation_applies_to_every_layer_as_relocate_blocks_does(layout_name):
    """One prepare, three layers: each layer bit for bit what relocate_blocks writes."""
    case = CASES[3]
    rope = case.rope()
    delta = [7, -300, 0]
    want, got, srcs = [], [], []
    for layer in range(3):
        kv = torch.randn(2, 5, case.heads, case.block_size, case.head_size, generator=gen(10 + layer))
        layout, store = make_cache(layout_name, 5, case, kv.to(case.dtype))
        srcs.append(gather_blocks(layout, store, [4, 0, 2]))
        _, a = make_cache(layout_name, 6, case, float("nan"))
        relocate_blocks(a, srcs[-1], [5, 1, 3], delta, rope, layout)
        want.append(a)
        got.append(make_cache(layout_name, 6, case, float("nan"))[1])
    prepared = prepare_relocation(got[0], srcs[0], torch.tensor([5, 1, 3]), delta, rope, layout)
    assert isinstance(prepared, PreparedRelocation) and prepared.num_blocks == 3
    assert repr(prepared).startswith("PreparedRelocation(num_blocks=3, ")
    for cache, src in zip(got, srcs):
        prepared(cache, src)
    for layer, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(bits(a), bits(b)), f"{layout_name} layer {layer}"


def test_prepared_relocation_refuses_another_geometry_and_copies_an_aliased_source():
    case = CASES[2]
    rope = case.rope()
    kv = torch.randn(2, 4, case.heads, case.block_size, case.head_size, generator=gen(5))
    layout, cache = make_cache("flash_attn", 4, case, kv.to(case.dtype))
    prepared = prepare_relocation(cache, cache[:, 0:2], [1, 2], 10, rope, layout)
    _, bigger = make_cache("flash_attn", 5, case, 0.0)
    with pytest.raises(InputError, match=r"dst_cache must be \(2, 4, .*as prepared; got \(2, 5"):
        prepared(bigger, cache[:, 0:2])
    with pytest.raises(InputError, match="src_blocks must be .* torch.float32 on cpu, as prepared; got .* torch.float16"):
        prepared(cache, cache[:, 0:2].half())
    with pytest.raises(InputError, match="src_blocks must be .*got list"):
        prepared(cache, [1, 2])
    with pytest.raises(InputError, match="writable"):
        prepared(cache.new_zeros(1).expand(cache.shape), cache[:, 0:2])
    k_old = layout.kv_views(cache)[0].clone()
    prepared(cache, cache[:, 0:2])  # blocks 0,1 -> 1,2: reads the old block 1
    k_new = layout.kv_views(cache)[0]
    for s, t in ((0, 1), (1, 2)):
        assert_matches_ref(k_new[t], ref_rotate(k_old[s], 10, rope), k_old[s], "prepared alias")
    empty = prepare_relocation(cache, cache[:, 0:0], [], 10, rope, layout)
    before = cache.clone()
    empty(cache, cache[:, 0:0])
    assert empty.num_blocks == 0 and torch.equal(bits(cache), bits(before))
    with pytest.raises(InputError, match="made by prepare_relocation"):
        PreparedRelocation(cache, cache, layout)
    # one delta for every block: one row of angles (the kernels broadcast it), not one a block
    same = prepare_relocation(cache, cache[:, 0:3], [0, 1, 2], [5, 5, 5], rope, layout)
    assert same._cos.shape[0] == 1 and same.num_blocks == 3


def test_delta_zero_is_a_plain_copy():
    case = CASES[0]
    kv = torch.randn(2, 3, case.heads, case.block_size, case.head_size, generator=gen(3))
    layout, cache = make_cache("cpu_attn", 3, case, kv.to(case.dtype))
    dst = torch.full_like(cache, float("nan"))
    relocate_blocks(dst, gather_blocks(layout, cache, [2, 0]), [0, 1], 0, case.rope(), layout)
    assert torch.equal(dst[0], cache[2]) and torch.equal(dst[1], cache[0])


# --------------------------------------------------------------------------- rotate_keys


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rotate_keys_matches_reference(case):
    rope = case.rope()
    k = torch.randn(9, 3, case.head_size, generator=gen(4)).to(case.dtype)
    d = torch.arange(9).reshape(9, 1) * 1001 - 4000
    assert_matches_ref(rotate_keys(k, d, rope), ref_rotate(k, d, rope), k, case.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_rotate_there_and_back_is_identity(case, dtype):
    rope = case.rope()
    k = torch.randn(16, 2, case.head_size, generator=gen(5)).to(dtype)
    back = rotate_keys(rotate_keys(k, 777, rope), -777, rope)
    # Two roundings to the dtype, the middle one spread over its pair by the rotation
    # back: each element is within 3u of its pair's norm; pass-through channels exact.
    a, b = pairs(rope)
    k64 = k.double()
    norm = torch.sqrt(k64[..., a] ** 2 + k64[..., b] ** 2)
    bound = torch.zeros_like(k64)
    bound[..., a] = norm
    bound[..., b] = norm
    bound = (3 * UNIT_ROUNDOFF[dtype] + 16 * F32_EPS) * bound + 1e-30
    assert ((back.double() - k64).abs() <= bound).all(), f"seed {SEED}"


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_rotations_compose(case):
    rope = case.rope()
    k = torch.randn(16, 2, case.head_size, generator=gen(6))
    twice = rotate_keys(rotate_keys(k, 1234, rope), -5000, rope)
    once = rotate_keys(k, 1234 - 5000, rope)
    torch.testing.assert_close(twice, once, rtol=1e-5, atol=1e-5)


def test_rotate_keys_applies_rope_from_position_zero():
    """Rotating raw keys by their positions is RoPE itself: channel pair (0, 2) of a neox
    head of 4 has inv_freq 1, so (1, 0) at position 3 becomes (cos 3, sin 3)."""
    import math

    rope = RopeConfig(head_size=4, rotary_dim=4, theta=10000.0, is_neox_style=True)
    k = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    out = rotate_keys(k, 3, rope)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out[0, [0, 2]], torch.tensor([math.cos(3), math.sin(3)],
                                                            dtype=torch.float64))
    assert out[0, 1] == 0 and out[0, 3] == 0


# --------------------------------------------------------------------------- bad input


def test_relocate_refuses_bad_arguments():
    case = CASES[0]
    rope = case.rope()
    layout, cache = make_cache("cpu_attn", 4, case, 0.0)
    src = gather_blocks(layout, cache, [0, 1])
    with pytest.raises(InputError, match="distinct"):
        relocate_blocks(cache, src, [2, 2], 1, rope, layout)
    with pytest.raises(InputError, match="lie in"):
        relocate_blocks(cache, src, [2, 4], 1, rope, layout)
    with pytest.raises(InputError, match="entries"):
        relocate_blocks(cache, src, [2], 1, rope, layout)
    with pytest.raises(InputError, match="one entry per block"):
        relocate_blocks(cache, src, [2, 3], torch.tensor([1, 2, 3]), rope, layout)
    with pytest.raises(InputError, match="integer"):
        relocate_blocks(cache, src, [2, 3], torch.tensor([1.5, 2.0]), rope, layout)
    with pytest.raises(InputError, match="dtype"):
        relocate_blocks(cache, src.float(), [2, 3], 1, rope, layout)
    with pytest.raises(ConfigError, match="head_size"):
        relocate_blocks(cache, src, [2, 3], 1, RopeConfig(head_size=128, rotary_dim=128), layout)
    with pytest.raises(ConfigError, match="not supported"):
        relocate_blocks(cache.to(torch.float8_e4m3fn), src.to(torch.float8_e4m3fn), [2, 3], 1,
                        rope, layout)
    with pytest.raises(ConfigError, match="KVLayout"):
        relocate_blocks(cache, src, [2, 3], 1, rope, "cpu_attn")
    with pytest.raises(InputError):
        relocate_blocks(cache, gather_blocks(FlashAttnLayout(), torch.zeros(2, 4, 32, 3, 64,
                        dtype=cache.dtype), [0, 1]), [2, 3], 1, rope, layout)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
            relocate_blocks(cache, src, [2, 3], 1, rope, layout, impl="triton")
    relocate_blocks(cache, src[:0], [], 1, rope, layout)  # nothing to move is fine
    # block ids that are not ints: 1.5 and a float tensor [1.7] were written to block 1
    before = cache.clone()
    for ids in ([2, 3.5], torch.tensor([2.0, 3.7]), ["a", "b"], [True, 3]):
        with pytest.raises(InputError, match="dst_block_ids"):
            relocate_blocks(cache, src, ids, 1, rope, layout)
    assert torch.equal(cache, before)
    with pytest.raises(InputError, match="int64"):  # a delta beyond int64 (raw ValueError)
        relocate_blocks(cache, src, [2, 3], [1, 2**63], rope, layout)
    with pytest.raises(InputError, match="block_ids"):
        gather_blocks(layout, cache, [0.5])


def test_rotate_keys_refuses_bad_arguments():
    rope = RopeConfig(head_size=64, rotary_dim=64)
    with pytest.raises(ConfigError, match="head_size"):
        rotate_keys(torch.zeros(3, 32), 1, rope)
    with pytest.raises(InputError, match="broadcast"):
        rotate_keys(torch.zeros(3, 2, 64), torch.arange(3), rope)
    with pytest.raises(InputError, match="integer"):
        rotate_keys(torch.zeros(3, 64), 1.5, rope)
    with pytest.raises(InputError, match="int64"):
        rotate_keys(torch.zeros(3, 64), 2**63, rope)


# --------------------------------------------------------------------------- Triton

_TRITON_SCRIPT = """
import json, sys, traceback
from tests.kernels import test_relocate as t
from promptsplice import kernels
assert kernels.TRITON_AVAILABLE
results = []
for i, case in enumerate(t.CASES):
    for layout_name in t.LAYOUTS:
        try:
            got = t.run_case(case, layout_name, "triton", offset=100 + i)
            # Same inputs through torch: without FMA contraction (the interpreter runs
            # numpy) both round identically, so the caches agree bit for bit.
            want = t.run_case(case, layout_name, "torch", offset=100 + i)
            assert t.torch.equal(t.bits(got), t.bits(want)), "triton != torch bitwise"
            results.append([case.name, layout_name, "ok"])
        except Exception:
            results.append([case.name, layout_name, traceback.format_exc()])
print("RESULTS" + json.dumps(results))
"""


def test_triton_kernel_under_interpreter_matches_reference():
    import triton  # noqa: F401 - a pinned dependency: missing it is a failure, not a skip
    env = dict(os.environ, TRITON_INTERPRET="1", PROMPTSPLICE_TEST_SEED=str(SEED))
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS") :])
    assert len(results) == len(CASES) * len(LAYOUTS)
    failed = [r for r in results if r[2] != "ok"]
    assert not failed, "\n".join(f"{c}/{lay}:\n{tb}" for c, lay, tb in failed)


@pytest.mark.parametrize("layout", [CpuAttnLayout("vec"), CpuAttnAmxLayout()], ids=["vec", "amx"])
def test_kv_deviation_rotates_the_old_keys_then_compares(layout):
    """Blocks computed at p and the same blocks at p + d: after the rotation ~0; a V
    perturbed by 10% reads 0.1; without rope for a moved block: refused."""
    from promptsplice.kernels import kv_deviation

    rope = RopeConfig(head_size=64, rotary_dim=64, theta=10000.0)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 32, 64, generator=g)
    v = torch.randn(2, 2, 32, 64, generator=g)
    pack = (lambda kk, vv: layout.pack(kk, vv)) if hasattr(layout, "pack") else (
        lambda kk, vv: torch.cat([kk.transpose(-1, -2).flatten(-2), vv.flatten(-2)], -1).view(2, 2, 32, 128))
    old = pack(k, v)
    fresh = pack(rotate_keys(k, 96, rope), v * 1.1)
    dk, dv = kv_deviation(fresh, old, 96, rope, layout)
    assert dk.shape == dv.shape == (2,)
    assert float(dk.max()) < 1e-5 and torch.allclose(dv, torch.full((2,), 0.1 / 1.1), atol=1e-5)
    dk0, _ = kv_deviation(fresh, old, 0, rope, layout)  # no rotation: far off
    assert float(dk0.min()) > 0.3
    same_k, same_v = kv_deviation(old, old, 0, None, layout)
    assert float(same_k.abs().max()) == float(same_v.abs().max()) == 0.0
    with pytest.raises(ConfigError, match="RopeConfig"):
        kv_deviation(fresh, old, 96, None, layout)


def test_kv_deviation_and_gather_check_their_inputs():
    """kv_deviation broadcast 1 block against 2 (answers [0, 1.41]), truncated delta 0.5
    to 0 and read "3" as 3; gather_blocks let torch raise IndexError on an id out of
    range; a layout or rope of the wrong kind raised AttributeError."""
    from promptsplice.kernels import kv_deviation

    layout = CpuAttnLayout()
    cache = torch.randn(4, 2, 32, 128)
    rope = RopeConfig(64, 64)
    two = gather_blocks(layout, cache, [0, 1])
    assert torch.equal(two, cache[:2])
    for ids in ([4], [-1]):
        with pytest.raises(InputError, match=r"block_ids must lie in \[0, 4\)"):
            gather_blocks(layout, cache, ids)
    with pytest.raises(ConfigError, match="layout must be a KVLayout"):
        gather_blocks("cpu", cache, [0])  # type: ignore[arg-type]
    with pytest.raises(InputError, match="same blocks"):
        kv_deviation(two, two[:1], 0, None, layout)
    for delta in (0.5, "3", True):
        with pytest.raises(InputError, match="delta must be an int"):
            kv_deviation(two, two, delta, rope, layout)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="layout must be a KVLayout"):
        kv_deviation(two, two, 0, None, None)  # type: ignore[arg-type]
    k, v = kv_deviation(two, two, 0, None, layout)
    assert k.tolist() == [0.0, 0.0] and v.tolist() == [0.0, 0.0]
    with pytest.raises(ConfigError, match="rope must be the model's RopeConfig"):
        rotate_keys(torch.randn(4, 2, 64), 1, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rope must be the model's RopeConfig"):
        relocate_blocks(cache, two, [2, 3], 1, None, layout)  # type: ignore[arg-type]


def test_inputs_past_what_relocation_does_exactly_are_refused():
    """A kernel review: a delta past 2**29 (the float64 angle table's exact range) was
    rotated silently, an id past 2**64 raised a bare ValueError, an expanded (stride-0)
    destination raised torch's own error (on CUDA the kernel would race on it)."""
    case = CASES[0]
    kv = torch.randn(2, 4, case.heads, case.block_size, case.head_size, generator=gen(9))
    layout, cache = make_cache("cpu_attn", 4, case, kv.to(case.dtype))
    src = gather_blocks(layout, cache, [0])
    before = cache.clone()
    with pytest.raises(InputError, match="within"):
        relocate_blocks(cache, src, [1], 2**31, case.rope(), layout)
    with pytest.raises(InputError, match="within"):  # abs() of the int64 minimum wraps to itself
        relocate_blocks(cache, src, [1], torch.tensor(-(2**63)), case.rope(), layout)
    relocate_blocks(cache, src, [1], -(2**29), case.rope(), layout)  # the bound itself is fine
    cache.copy_(before)
    with pytest.raises(InputError, match="outside int64"):
        relocate_blocks(cache, src, [2**64], 3, case.rope(), layout)
    with pytest.raises(InputError, match="writable"):
        relocate_blocks(cache[:1].expand(4, *cache.shape[1:]), src, [1], 3, case.rope(), layout)
    assert torch.equal(cache, before)  # nothing written by a refused call
