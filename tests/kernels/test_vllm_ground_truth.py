"""kernels/ against the installed vLLM itself (a pinned dependency of the test set-up).

* the frequencies are vLLM's, bit for bit, and a key vLLM rotated to ``p``, moved by
  ``d`` with :func:`rotate_keys`, is the key vLLM rotates to ``p + d``;
* the CPU_ATTN layout adapters (strided ``vec``/``vec16``, tiled ``amx``) read what
  vLLM's own cache-write op (``cpu_attn_reshape_and_cache``, the op
  ``CPUAttentionBackendImpl`` stores K/V with) wrote, and a block relocated through
  them is the block vLLM writes for ``p + d``;
* the ISA mirror agrees with ``cpu_attn._get_attn_isa`` on this machine.
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm import _custom_ops as ops  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from promptsplice.kernels import (  # noqa: E402
    ConcatKVLayout,
    CpuAttnAmxLayout,
    CpuAttnLayout,
    Llama3Scaling,
    RopeConfig,
    detect_cpu_attn_isa,
    gather_blocks,
    relocate_blocks,
    rotate_keys,
)
from promptsplice.errors import ConfigError  # noqa: E402

from .test_relocate import SEED, gen, ref_rotate  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# (our RopeConfig, vLLM get_rope arguments: head_size, is_neox_style, rope_parameters)
VARIANTS = [
    (RopeConfig(head_size=64, rotary_dim=64, theta=100000.0),
     (64, True, {"rope_type": "default", "rope_theta": 100000.0})),
    (RopeConfig(head_size=128, rotary_dim=64, theta=10000.0, is_neox_style=False),
     (128, False, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    (RopeConfig(head_size=128, rotary_dim=128, theta=500000.0,
                llama3_scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192)),
     (128, True, LLAMA3)),
    (RopeConfig(head_size=64, rotary_dim=32, theta=10000.0, is_neox_style=False,
                llama3_scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192)),
     (64, False, dict(LLAMA3, rope_theta=10000.0, partial_rotary_factor=0.5))),
    (RopeConfig(head_size=64, rotary_dim=64, theta=10000.0, linear_factor=2.0),
     (64, True, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
]


@pytest.fixture(scope="module")
def vllm_config():
    with set_current_vllm_config(VllmConfig()):
        yield


def vllm_rope(args):
    head_size, neox, params = args
    return get_rope(head_size, 4096, neox, dict(params), torch.float32)


@pytest.mark.parametrize("ours,theirs", VARIANTS, ids=lambda v: "")
def test_inv_freq_is_vllms_bit_for_bit(vllm_config, ours, theirs):
    rope = vllm_rope(theirs)
    assert rope.rotary_dim == ours.rotary_dim and rope.is_neox_style == ours.is_neox_style
    if ours.linear_factor == 1.0:  # linear scaling divides positions inside vLLM instead
        assert torch.equal(ours.inv_freq(), rope._compute_inv_freq(rope.base))


@pytest.mark.parametrize("ours,theirs", VARIANTS, ids=lambda v: "")
def test_moving_vllms_key_by_d_gives_vllms_key_at_p_plus_d(vllm_config, ours, theirs):
    rope = vllm_rope(theirs)
    heads, tokens = 2, 24
    raw = torch.randn(tokens, heads * ours.head_size, generator=gen(10))
    p = torch.arange(tokens) * 7 + 300
    for d in (333, -250):

        def at(pos):
            q = torch.zeros(tokens, ours.head_size)
            return rope.forward_native(pos, q, raw.clone())[1].view(tokens, heads, -1)

        moved = rotate_keys(at(p), d, ours)
        # vLLM forms angles in float32 (p * inv_freq), so compare at float32-angle accuracy.
        torch.testing.assert_close(moved, at(p + d), rtol=2e-4, atol=2e-4)


def test_from_hf_config_on_the_real_model_is_what_vllm_applies(vllm_config):
    from promptsplice.engine_adapters._model import ensure_default_model

    path = ensure_default_model() / "config.json"
    cfg = json.loads(path.read_text())
    ours = RopeConfig.from_hf_config(cfg)
    # LlamaAttention: get_rope(head_dim, max_position, rope_parameters, is_neox_style=True)
    theirs = get_rope(cfg["head_dim"], cfg["max_position_embeddings"], True,
                      cfg["rope_parameters"], torch.float32)
    assert torch.equal(ours.inv_freq(), theirs._compute_inv_freq(theirs.base))
    assert ours.rotary_dim == theirs.rotary_dim and ours.is_neox_style == theirs.is_neox_style


def test_from_hf_config_reads_transformers_config_objects():
    import transformers
    cfg = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3.items() if k != "rope_theta"},
    )
    rope = RopeConfig.from_hf_config(cfg)
    assert rope == VARIANTS[2][0]


# --------------------------------------------------------------------------- CPU_ATTN


def need_vllm_isa(isa: str) -> None:
    """Skip when vLLM's CPU attention cannot write ``isa`` on this CPU: its AMX write op
    runs only where the CPU has AMX tiles (the CI machine does; a Xeon or EPYC without
    them answers "Unsupported CPU attention configuration ... isa=0")."""
    if isa != "amx":
        return
    cache = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    if torch.cpu._is_amx_tile_supported():
        return  # a failing AMX write here is a failure, never a skip
    try:
        vllm_write(cache, k, k, [0], "amx")
    except RuntimeError as exc:
        if "Unsupported CPU attention configuration" not in str(exc):
            raise
        pytest.skip(f"vLLM's CPU attention cannot write ISA amx on this CPU (no AMX tiles): {exc}")


def vllm_write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots, isa: str):
    """Store k, v ([tokens, heads, head]) the way CPUAttentionBackendImpl does."""
    nb, heads, bs, two_hd = cache.shape
    view = cache.view(nb, heads, 2 * bs, two_hd // 2)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache,
                                   torch.as_tensor(slots, dtype=torch.int64), isa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("isa,head_size", [("vec", 64), ("vec", 128), ("vec16", 80)])
def test_cpu_attn_adapter_reads_what_vllm_writes(isa, head_size, dtype):
    nb, heads, bs = 4, 3, 32
    cache = torch.full((nb, heads, bs, 2 * head_size), float("nan"), dtype=dtype)
    tokens = 45  # block 1 whole, block 2 partly, starting mid-block 0
    k = torch.randn(tokens, heads, head_size, generator=gen(11)).to(dtype)
    v = torch.randn(tokens, heads, head_size, generator=gen(12)).to(dtype)
    slots = torch.arange(tokens) + 19
    vllm_write(cache, k, v, slots, isa)
    kv, vv = CpuAttnLayout(isa).kv_views(cache)
    for t in range(tokens):
        b, o = divmod(int(slots[t]), bs)
        assert torch.equal(kv[b, :, o], k[t]) and torch.equal(vv[b, :, o], v[t])
    # Nothing else was written: exactly the written tokens are non-poison.
    assert int((~torch.isnan(cache)).sum()) == tokens * heads * 2 * head_size


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("bs", [32, 64])
def test_amx_adapter_reads_what_vllm_writes(bs, head_size):
    """The AMX tiles (bf16): what vLLM's write op stores with ISA amx, unpacked."""
    need_vllm_isa("amx")
    nb, heads, dtype = 4, 3, torch.bfloat16
    cache = torch.full((nb, heads, bs, 2 * head_size), float("nan"), dtype=dtype)
    tokens = bs + 13  # block 1 whole, block 2 partly, starting mid-block 0
    k = torch.randn(tokens, heads, head_size, generator=gen(15)).to(dtype)
    v = torch.randn(tokens, heads, head_size, generator=gen(16)).to(dtype)
    slots = torch.arange(tokens) + bs // 2 + 3
    vllm_write(cache, k, v, slots, "amx")
    kv, vv = CpuAttnAmxLayout().unpack(cache)
    for t in range(tokens):
        b, o = divmod(int(slots[t]), bs)
        assert torch.equal(kv[b, :, o], k[t]) and torch.equal(vv[b, :, o], v[t]), t
    assert int((~torch.isnan(cache)).sum()) == tokens * heads * 2 * head_size


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_block_relocated_through_the_adapter_is_the_block_vllm_writes_at_p_plus_d(isa):
    """Layer-0 in miniature: keys rotated to p, stored by vLLM, relocated by d, equal the
    keys rotated to p + d stored by vLLM (to bf16 rounding); values bit for bit.  The
    comparison is on raw cache memory, so it does not trust the adapter's reading."""
    need_vllm_isa(isa)
    rope = RopeConfig(head_size=64, rotary_dim=64, theta=100000.0)  # SmolLM2-135M
    nb, heads, bs = 6, 3, 32
    raw = torch.randn(bs, heads, 64, generator=gen(13), dtype=torch.float64)
    v = torch.randn(bs, heads, 64, generator=gen(14)).bfloat16()
    p = torch.arange(bs) + 4 * bs
    d = 1000 - 4 * bs
    k_p = ref_rotate(raw, p[:, None], rope).bfloat16()
    k_pd = ref_rotate(raw, (p + d)[:, None], rope).bfloat16()

    store = torch.zeros(nb, heads, bs, 2 * 64, dtype=torch.bfloat16)
    vllm_write(store, k_p, v, torch.arange(bs) + 1 * bs, isa)  # saved at block 1
    expected = torch.zeros_like(store)
    vllm_write(expected, k_pd, v, torch.arange(bs) + 4 * bs, isa)  # vLLM's own at block 4

    layout = CpuAttnAmxLayout() if isa == "amx" else CpuAttnLayout(isa)
    dst = torch.full_like(store, float("nan"))
    relocate_blocks(dst, gather_blocks(layout, store, [1]), [4], d, rope, layout)

    got, want = dst[4].view(heads, 2, bs * 64), expected[4].view(heads, 2, bs * 64)
    assert torch.equal(got[:, 1], want[:, 1]), "V half differs"
    rel = (got[:, 0].double() - want[:, 0].double()).norm() / want[:, 0].double().norm()
    assert rel < 0.006, f"K relative error {rel:.4f} (seed {SEED})"  # bf16 rounding: ~0.003
    assert torch.isnan(dst[[0, 1, 2, 3, 5]]).all()

    # Reading K as rows (the FlashAttention-style mistake) is far off: the test can tell.
    wrong = torch.full_like(store, float("nan"))
    relocate_blocks(wrong, store[[1]], [4], d, rope, ConcatKVLayout())
    bad = wrong[4].view(heads, 2, bs * 64)[:, 0].double()
    assert (bad - want[:, 0].double()).norm() / want[:, 0].double().norm() > 0.5


def test_isa_mirror_agrees_with_vllm_here():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for block_size in (16, 32, 128):
            for head_size in (64, 80, 128):
                assert detect_cpu_attn_isa(dtype, block_size, head_size) == _get_attn_isa(
                    dtype, block_size, head_size, "auto"
                ), (dtype, block_size, head_size)


def test_unverified_isas_and_fp8_are_refused():
    for isa in ("amx", "neon", "vsx", "vxe", "rvv"):  # amx: CpuAttnAmxLayout's
        with pytest.raises(ConfigError, match=isa):
            CpuAttnLayout(isa)
    with pytest.raises(ConfigError, match="fp8"):
        detect_cpu_attn_isa(torch.bfloat16, 32, 64, "fp8_e4m3")
