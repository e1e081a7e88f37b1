"""CUDA check of the splice kernel: correctness against the float64 torch reference, and
bandwidth against a plain device copy of the same bytes.  Not part of CI.

Run on a machine with an NVIDIA GPU and Triton::

    python -m promptsplice.benchmarks.gpu_splice_check [--json OUT.json] [--quick]

1. Correctness: for bf16/fp16/fp32 caches, neox and GPT-J pairing, partial rotary,
   Llama-3 and linear scaling, positive/negative/per-block deltas and every layout
   (FlashAttention ``[2, B, N, H, D]``, vLLM's unified ``[B, H, N, 2D]`` in two physical
   orders, and CPU_ATTN's transposed-K blocks), blocks are relocated by the Triton kernel
   into a NaN-poisoned cache and compared with ``rotate_keys`` in float64 on the CPU:
   K within one rounding of the dtype (plus float32 arithmetic), V bit for bit, every
   other block still NaN.
2. Bandwidth: one layer of a Llama-3-8B-like cache (8 KV heads, head 128, block 16,
   bf16: 64 KiB per block) relocating n blocks to scattered slots, timed with CUDA
   events.  GB/s counts bytes read + bytes written (2 x the blocks' size), the same for
   every row: ``triton kernel`` (prepared arguments), ``relocate_blocks`` (the public
   call, with its argument checks), ``torch impl`` (the CPU path run on the GPU),
   ``index_copy_`` (a scatter copy without rotation) and ``copy_`` (a contiguous device
   copy of the same bytes: the ceiling).

Prints a table, then one JSON document (also written to ``--json``).  Exit status: 0 all
checks passed, 1 a correctness check failed, 2 nothing run (no CUDA device or no Triton).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from promptsplice.kernels import (
    TRITON_AVAILABLE,
    ConcatKVLayout,
    CpuAttnLayout,
    FlashAttnLayout,
    Llama3Scaling,
    RopeConfig,
    gather_blocks,
    relocate_blocks,
    rotate_keys,
)

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
F32_EPS = 2.0**-24


# --------------------------------------------------------------------------- correctness


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    head_size: int
    rotary_dim: int
    neox: bool
    theta: float = 10000.0
    llama3: bool = False
    linear: float = 1.0
    heads: int = 8
    block_size: int = 16
    delta: int = 37
    per_block: bool = False

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
    Case("llama3-8b-bf16", "bfloat16", 128, 128, True, 500000.0, llama3=True, delta=-4096),
    Case("smollm2-bf16", "bfloat16", 64, 64, True, 100000.0, heads=3, block_size=32, delta=333),
    Case("gptj-partial-fp16", "float16", 256, 64, False, per_block=True),
    Case("neox-partial-fp32", "float32", 128, 64, True, per_block=True, delta=100003),
    Case("gptj-linear-bf16", "bfloat16", 96, 96, False, linear=4.0, block_size=32, delta=-7),
]
LAYOUTS = ["flash_attn", "concat_kv", "concat_kv_nhd", "cpu_attn"]


def make_cache(layout_name: str, nb: int, c: Case, dtype: torch.dtype, device):
    h, bs, hd = c.heads, c.block_size, c.head_size
    if layout_name == "flash_attn":
        return FlashAttnLayout(), torch.empty(2, nb, bs, h, hd, dtype=dtype, device=device)
    if layout_name == "concat_kv":
        return ConcatKVLayout(), torch.empty(nb, h, bs, 2 * hd, dtype=dtype, device=device)
    if layout_name == "concat_kv_nhd":
        cache = torch.empty(nb, bs, h, 2 * hd, dtype=dtype, device=device).permute(0, 2, 1, 3)
        return ConcatKVLayout(), cache
    if layout_name == "cpu_attn":
        layout = CpuAttnLayout("vec" if hd % 32 == 0 else "vec16")
        return layout, torch.empty(nb, h, bs, 2 * hd, dtype=dtype, device=device)
    raise ValueError(layout_name)


def check_case(c: Case, layout_name: str, device, seed: int) -> dict:
    dtype = getattr(torch, c.dtype)
    rope = c.rope()
    g = torch.Generator(device="cpu").manual_seed(seed)
    layout, store = make_cache(layout_name, 24, c, dtype, device)
    k_store, v_store = layout.kv_views(store)
    k_store.copy_(torch.randn(k_store.shape, generator=g).to(dtype))
    v_store.copy_(torch.randn(v_store.shape, generator=g).to(dtype))
    src_ids = torch.randperm(24, generator=g)[:16]
    dst_ids = torch.randperm(64, generator=g)[:16]
    # per block: random deltas, the case's own delta among them (it was never used)
    delta = (torch.randint(-50000, 50000, (16,), generator=g) if c.per_block else c.delta)
    if c.per_block and c.delta:
        delta[0] = c.delta
    src = gather_blocks(layout, store, src_ids)
    _, dst = make_cache(layout_name, 64, c, dtype, device)
    dst.fill_(float("nan"))
    relocate_blocks(dst, src, dst_ids.to(device), delta, rope, layout)  # auto: Triton on CUDA
    _sync(device)

    k_dst, v_dst = layout.kv_views(dst)
    k_in = layout.kv_views(src)[0].cpu()
    d = torch.as_tensor(delta).reshape(-1, 1, 1)
    ref = rotate_keys(k_in.double(), d, rope)  # the torch implementation in float64
    got = k_dst[dst_ids.to(device)].cpu()
    u = UNIT_ROUNDOFF[dtype]
    err = (got.double() - ref).abs()
    bound = u * ref.abs() + 8 * F32_EPS * float(k_in.abs().max()) + 1e-30
    worst = float((err / bound).max())  # <= 1 passes
    v_ok = torch.equal(v_dst[dst_ids.to(device)].cpu(), layout.kv_views(src)[1].cpu())
    others = torch.ones(64, dtype=torch.bool)
    others[dst_ids] = False
    untouched_ok = bool(torch.isnan(k_dst[others.to(device)]).all()) and bool(
        torch.isnan(v_dst[others.to(device)]).all()
    )
    k_ok = bool((err <= bound).all()) and not bool(torch.isnan(got).any())
    rel = float((got.double() - ref).norm() / ref.norm())
    return {
        "case": c.name,
        "layout": layout_name,
        "dtype": c.dtype,
        "k_ok": k_ok,
        "v_exact": v_ok,
        "untouched_ok": untouched_ok,
        "k_rel_err": rel,
        "k_err_over_bound": worst,
        "ok": k_ok and v_ok and untouched_ok,
    }


# --------------------------------------------------------------------------- bandwidth


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, device, min_time: float = 0.2, max_iters: int = 50) -> float:
    """Median seconds per call after warm-up (CUDA events on a GPU; wall clock else,
    which only serves to dry-run this script on a CPU)."""
    for _ in range(3):
        fn()
    _sync(device)
    times: list[float] = []
    start_wall = time.perf_counter()
    while len(times) < max_iters and (time.perf_counter() - start_wall < min_time or len(times) < 5):
        if device.type == "cuda":
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1000.0)
        else:
            w = time.perf_counter()
            fn()
            times.append(time.perf_counter() - w)
    return statistics.median(times)


def bench(sizes: list[int], device, heads: int = 8) -> list[dict]:
    from promptsplice.kernels._torch_impl import cos_sin_table
    from promptsplice.kernels._triton_impl import relocate_triton

    c = Case("llama3-8b-layer", "bfloat16", 128, 128, True, 500000.0, llama3=True,
             heads=heads, delta=-1024)
    rope = c.rope()
    rows = []
    for layout_name in ("concat_kv_nhd", "flash_attn"):
        nb = max(sizes) * 2
        layout, cache = make_cache(layout_name, nb, c, torch.bfloat16, device)
        cache.normal_()
        for n in sizes:
            g = torch.Generator(device="cpu").manual_seed(n)
            src = gather_blocks(layout, cache, torch.arange(n, device=device))
            ids = torch.randperm(nb, generator=g)[:n].to(device)
            nbytes = src.numel() * src.element_size()
            moved = 2 * nbytes  # read + write
            k_dst, v_dst = layout.kv_views(cache)
            k_src, v_src = layout.kv_views(src)
            cos, sin = cos_sin_table(torch.tensor([c.delta], device=device), rope)
            flat_src = src.reshape(-1)
            flat_dst = torch.empty_like(flat_src)
            fns = {
                "triton kernel": lambda: relocate_triton(
                    k_dst, v_dst, k_src, v_src, ids, cos, sin, rope
                ),
                "relocate_blocks": lambda: relocate_blocks(cache, src, ids, c.delta, rope, layout),
                "torch impl": lambda: relocate_blocks(
                    cache, src, ids, c.delta, rope, layout, impl="torch"
                ),
                "index_copy_": lambda: cache.index_copy_(layout.block_dim, ids, src),
                "copy_": lambda: flat_dst.copy_(flat_src),
            }
            base = None
            for label, fn in fns.items():
                t = time_op(fn, device)
                gbs = moved / t / 1e9
                if label == "copy_":
                    base = gbs
                rows.append({"layout": layout_name, "blocks": n, "mib": nbytes / 2**20,
                             "op": label, "seconds": t, "gb_per_s": gbs})
            for r in rows[-len(fns):]:
                r["vs_copy"] = r["gb_per_s"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.gpu_splice_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the JSON result here")
    ap.add_argument("--quick", action="store_true", help="smaller bandwidth sizes")
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little") >> 1)
    args = ap.parse_args(argv)
    if args.json:  # checked before the GPU runs, as the CLI's (it was written only at the end)
        from promptsplice.benchmarks.cli import UsageError, _check_writable

        try:
            _check_writable("--json", args.json, "the result's", None)
        except UsageError as exc:
            print(f"gpu_splice_check: {exc}; nothing was checked", file=sys.stderr)
            return 2

    if not torch.cuda.is_available():
        print("gpu_splice_check: no CUDA device here (torch.cuda.is_available() is False); "
              "this check needs an NVIDIA GPU. Nothing was checked.", file=sys.stderr)
        return 2
    if not TRITON_AVAILABLE:
        print("gpu_splice_check: Triton is not installed; nothing was checked.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_splice_check: unset TRITON_INTERPRET to time the compiled kernel.",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    t0 = time.perf_counter()

    checks = []
    for i, c in enumerate(CASES):
        for layout_name in LAYOUTS:
            checks.append(check_case(c, layout_name, device, args.seed + i))
    print(f"correctness (seed {args.seed}): Triton vs float64 torch reference, poisoned cache")
    print(f"{'case':<20} {'layout':<14} {'dtype':<9} {'K':>4} {'V':>4} {'rest':>5} "
          f"{'K rel err':>10} {'err/bound':>10}")
    for r in checks:
        print(f"{r['case']:<20} {r['layout']:<14} {r['dtype']:<9} "
              f"{'ok' if r['k_ok'] else 'FAIL':>4} {'ok' if r['v_exact'] else 'FAIL':>4} "
              f"{'ok' if r['untouched_ok'] else 'FAIL':>5} {r['k_rel_err']:>10.2e} "
              f"{r['k_err_over_bound']:>10.3f}")

    sizes = [16, 256, 2048] if args.quick else [16, 256, 2048, 16384]
    rows = bench(sizes, device)
    print("\nbandwidth: one bf16 layer, 8 KV heads x head 128 x block 16 (64 KiB/block), "
          "scattered destinations; GB/s = (read + write) / time")
    print(f"{'layout':<14} {'blocks':>7} {'MiB':>8} {'op':<16} {'us':>10} {'GB/s':>9} {'vs copy_':>9}")
    for r in rows:
        print(f"{r['layout']:<14} {r['blocks']:>7} {r['mib']:>8.1f} {r['op']:<16} "
              f"{r['seconds'] * 1e6:>10.1f} {r['gb_per_s']:>9.1f} {r['vs_copy']:>9.2f}")

    ok = all(r["ok"] for r in checks)
    doc = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "seed": args.seed,
        "correct": ok,
        "checks": checks,
        "bandwidth": rows,
        "cases": [asdict(c) for c in CASES],
        "wall_s": time.perf_counter() - t0,
    }
    text = json.dumps(doc, indent=2)
    if args.json:  # (printed only without a file: its ~16 KB pushed the tables out of a bounded log tail)
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    else:
        print("\n" + text)
    if not ok:
        print("gpu_splice_check: CORRECTNESS FAILED (see the table)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
