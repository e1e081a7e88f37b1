"""Public surface of ``kernels``: exported names, import isolation, Triton optional."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from promptsplice import kernels
from tests._imports import rooms_after

REPO = Path(__file__).resolve().parents[2]

KERNELS_API = [
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


def test_public_names_are_pinned():
    assert sorted(kernels.__all__) == KERNELS_API
    for name in KERNELS_API:
        assert hasattr(kernels, name), name
    assert kernels.__doc__ and "RoPE" in kernels.__doc__


def test_layouts_satisfy_the_protocol():
    for layout in (kernels.CpuAttnLayout("vec"), kernels.FlashAttnLayout(), kernels.FlashInferLayout(),
                   kernels.ConcatKVLayout()):
        assert isinstance(layout, kernels.KVLayout)


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True,
        timeout=120,
    )
    return out.stdout


def test_kernels_never_imports_vllm_or_other_project_packages():
    rooms = rooms_after("import promptsplice.kernels")
    assert not rooms & {
        "vllm", "promptsplice.engine_adapters", "promptsplice.assembler", "promptsplice.dedup",
        "promptsplice.benchmarks", "transformers",
    }


def test_package_works_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import torch\nfrom promptsplice import kernels\n"
        "from promptsplice.errors import ConfigError\n"
        "assert kernels.TRITON_AVAILABLE is False\n"
        "rope = kernels.RopeConfig(head_size=64, rotary_dim=64)\n"
        "lay = kernels.CpuAttnLayout('vec')\n"
        "cache = torch.randn(3, 2, 32, 128).bfloat16()\n"
        "kernels.relocate_blocks(cache, cache[[0]], [2], 5, rope, lay)\n"
        "try:\n"
        "    kernels.relocate_blocks(cache, cache[[0]], [2], 5, rope, lay, impl='triton')\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    assert "refused: impl='triton' but Triton is not installed" in _run(code)


def test_auto_dispatch_is_by_device():
    import torch

    assert kernels.select_impl(torch.device("cpu")) == "torch"
    expected = "triton" if kernels.TRITON_AVAILABLE else "torch"
    assert kernels.select_impl(torch.device("cuda")) == expected
