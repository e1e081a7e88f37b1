"""GPU check of the splice connector's worker core: correctness and the three speed
ratios of issue #17, on tensors in vLLM's GPU cache layouts.  Not part of CI.

Run on a machine with an NVIDIA GPU, PyTorch and Triton (vLLM is not needed)::

    python -m promptsplice.benchmarks.gpu_connector_check --json OUT.json

It drives :class:`~promptsplice.engine_adapters.connector._worker.SpliceWorker` (the code
the connector runs inside vLLM) with a real :class:`BlockStore`, for the geometry of an
8B model (32 layers, 8 KV heads, head 128, block 16, bf16, Llama-3 RoPE) and of
SmolLM2-135M (30 layers, 3 KV heads, head 64), in FlashAttention's ``[2, nb, bs, H, hd]``,
FlashInfer's ``[nb, 2, bs, H, hd]`` and vLLM's unified ``[nb, H, bs, 2*hd]`` layouts.

1. Correctness: blocks saved from random caches, then loaded with per-block deltas
   (relocated per layer through ``wait_for_layer``) into NaN-poisoned caches: K within
   one rounding of bf16 of the float64 reference (plus float32 arithmetic), V and
   saved payloads bit for bit, every other block still NaN, a deferred layer untouched
   until waited on.
2. Speed (8B geometry, unified layout): ``load``: the worker's load of n stored blocks
   (pinned DRAM -> staging -> relocation into the cache) vs a plain pinned host-to-device
   copy of the same bytes (target >= 0.80); ``relocate``: the relocation kernel on one
   layer (prepared arguments, launches queued behind a device sleep so the kernels are
   timed, not Python launching them; the connector's per-layer call and the one-off public
   ``relocate_blocks`` call are reported too) vs a device-to-device ``copy_`` of the same
   bytes, timed alike (target >= 0.70); ``save``: a
   chain of matmuls (the forward pass's stand-in) timed alone and with a save of n
   blocks issued before it (target: <= 5% slower).

``--device cpu --quick`` runs the same code paths on CPU tensors (torch, or the Triton
interpreter with ``--impl triton`` and ``TRITON_INTERPRET=1``): its timings mean nothing.
Prints the results, a markdown table for the README and one JSON document (also written
to ``--json``).  Exit status: 0 correct, 1 a correctness check failed, 2 nothing run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from promptsplice.engine_adapters.connector._scheduler import LoadItem, SaveItem, SpliceMetadata
from promptsplice.engine_adapters.connector._worker import SpliceWorker
from promptsplice.engine_adapters.store._store import BlockStore
from promptsplice.engine_adapters.store._types import StoreConfig, chain_refs
from promptsplice.errors import ConfigError
from promptsplice.kernels import (
    Llama3Scaling,
    RopeConfig,
    prepare_relocation,
    relocate_blocks,
    rotate_keys,
    select_impl,
)
from promptsplice.kernels._torch_impl import cos_sin_table, relocate_torch
from promptsplice.kernels._triton_impl import relocate_triton

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
F32_EPS = 2.0**-24
TARGETS = {"load_vs_h2d": 0.80, "relocate_vs_d2d": 0.70, "save_compute_slowdown": 0.05}
SALT = "gpu-check"


@dataclass(frozen=True, slots=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    rope: RopeConfig
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    def payload_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.block_size * self.head_size * self.dtype.itemsize


GEOMETRIES = (
    Geometry("llama3-8b", 32, 8, 128, RopeConfig(128, 128, 500000.0, True, Llama3Scaling(8.0, 1.0, 4.0, 8192))),
    Geometry("smollm2-135m", 30, 3, 64, RopeConfig(64, 64, 100000.0)),
)
LAYOUTS = ("FLASH_ATTN", "FLASHINFER", "UNIFIED")


def make_caches(g: Geometry, layout: str, nb: int, device, *, layers: int | None = None, fill=None):
    """``{layer name: cache}`` in ``layout`` and the vLLM backend name it is read as."""
    h, bs, hd = g.kv_heads, g.block_size, g.head_size
    out = {}
    for i in range(layers or g.layers):
        if layout == "FLASH_ATTN":
            t, backend = torch.empty(2, nb, bs, h, hd, dtype=g.dtype, device=device), "FLASH_ATTN"
        elif layout == "FLASHINFER":
            t, backend = torch.empty(nb, 2, bs, h, hd, dtype=g.dtype, device=device), "FLASHINFER"
        else:  # vLLM's unified per-layer cache, NHD physical order
            t = torch.empty(nb, bs, h, 2 * hd, dtype=g.dtype, device=device).permute(0, 2, 1, 3)
            backend = "FLASH_ATTN"
        if fill is None:
            t.fill_(float("nan"))
        else:
            t.copy_(torch.randn(t.shape, generator=fill).to(g.dtype))
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out, backend


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _store(nbytes: int) -> BlockStore:
    return BlockStore(StoreConfig(dram_bytes=nbytes, write_behind_bytes=0))


def _items(g: Geometry, n: int, src_ids, dst_ids, deltas, tag: str):
    tokens = list(range(7, 7 + n * g.block_size))
    refs = tuple(chain_refs(tokens, g.block_size, salt=SALT))
    save = SaveItem(f"save-{tag}", SALT, refs, tuple(src_ids))
    load = LoadItem(f"load-{tag}", SALT, refs, tuple(deltas), tuple(dst_ids), 0)
    return save, load


# --------------------------------------------------------------------------- correctness


def check(g: Geometry, layout: str, device, *, impl: str, quick: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    layers = 2 if quick else g.layers
    n, nb = (4, 12) if quick else (48, 160)
    src, backend = make_caches(g, layout, nb, device, layers=layers, fill=gen)
    dst, _ = make_caches(g, layout, nb, device, layers=layers)
    src_ids = torch.randperm(nb, generator=gen)[:n].tolist()
    dst_ids = torch.randperm(nb, generator=gen)[:n].tolist()
    deltas = [int(x) for x in torch.randint(-6000, 6000, (n,), generator=gen)]
    deltas[0] = 0  # an offload hit among the relocations
    payload = layers * g.payload_bytes() // g.layers
    with _store(2 * n * payload) as store:
        saver = SpliceWorker(store, block_size=g.block_size, caches=src, backend=backend, rope=g.rope, impl=impl)
        loader = SpliceWorker(store, block_size=g.block_size, caches=dst, backend=backend, rope=g.rope, impl=impl)
        save, load = _items(g, n, src_ids, dst_ids, deltas, "check")
        saver.save(SpliceMetadata(saves=[save]))
        saver.settle()  # what a finished request does: its copies complete, blocks stored
        stored = saver.stats.saved_blocks
        kids = torch.tensor(src_ids, device=device)
        bd = saver.block_dim
        saved_exact = stored == n and all(
            torch.equal(
                store.get(ref, salt=SALT).payload[layer].to(device),
                cache.index_select(bd, kids[i : i + 1]),
            )
            for i, ref in enumerate(save.refs)
            for layer, cache in enumerate(src.values())
        )
        pinned = all(store.get(ref, salt=SALT).payload.is_pinned() for ref in save.refs) if device.type == "cuda" else None
        loader.start_load(SpliceMetadata(loads=[load]), per_layer=True)
        names = list(dst)
        _sync(device)
        deferred_ok = bool(torch.isnan(dst[names[-1]]).all())  # not written before its wait
        for name in names:
            loader.wait_for_layer(name)
        _sync(device)
        errors = loader.take_load_errors()

    u = UNIT_ROUNDOFF[g.dtype]
    worst, k_ok, v_ok, rest_ok = 0.0, True, True, True
    layout_obj = saver.paged.layout
    d = torch.tensor(deltas, device=device).reshape(-1, 1, 1)
    others = torch.ones(nb, dtype=torch.bool)
    others[dst_ids] = False
    for s_cache, d_cache in zip(src.values(), dst.values()):
        ks, vs = layout_obj.kv_views(s_cache)
        kd, vd = layout_obj.kv_views(d_cache)
        k_in = ks[src_ids]
        ref = rotate_keys(k_in.double(), d, g.rope)  # float64 reference
        got = kd[dst_ids].double()
        err = (got - ref).abs()
        bound = u * ref.abs() + 8 * F32_EPS * float(k_in.abs().max()) + 1e-30
        worst = max(worst, float((err / bound).max()))
        k_ok &= bool((err <= bound).all()) and not bool(torch.isnan(got).any())
        v_ok &= torch.equal(vd[dst_ids], vs[src_ids])
        rest_ok &= bool(torch.isnan(kd[others.to(device)]).all() and torch.isnan(vd[others.to(device)]).all())
    ok = saved_exact and deferred_ok and k_ok and v_ok and rest_ok and not errors and pinned is not False
    return {
        "geometry": g.name, "layout": layout, "layers": layers, "blocks": n, "saved_exact": saved_exact,
        "pinned_in_store": pinned, "deferred_until_waited": deferred_ok, "k_ok": k_ok,
        "k_err_over_bound": worst, "v_exact": v_ok, "untouched_ok": rest_ok,
        "load_errors": sorted(errors), "ok": ok,
    }


# --------------------------------------------------------------------------- speed


def timed(fn, device, reps: int) -> float:
    """Median wall seconds of ``fn`` including a device sync (host work counts)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def device_timed(fn, device, reps: int, *, queued: bool = False) -> float:
    """Median seconds of ``fn``'s device work (CUDA events; wall clock on CPU).

    ``queued``: the stream first sleeps ~5 ms on the device, so that ``fn``'s launches
    are all queued before the first runs and the interval times the kernels, not the
    host launching them (a 20 us kernel launched from Python is otherwise launch-bound,
    and by how much depends on the host's speed).
    """
    if device.type != "cuda":
        return timed(fn, device, reps)
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(10_000_000)  # cycles: ~5 ms at 2 GHz
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000.0)
    return statistics.median(times)


def speed(g: Geometry, device, *, impl: str, quick: bool, reps: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    layers = 2 if quick else g.layers
    n = 4 if quick else 512  # 8B: 512 blocks = 1 GiB (8192 tokens)
    nb = 2 * n
    payload = layers * g.payload_bytes() // g.layers
    nbytes = n * payload
    src, backend = make_caches(g, "UNIFIED", nb, device, layers=layers, fill=gen)
    dst, _ = make_caches(g, "UNIFIED", nb, device, layers=layers)
    deltas = [-1024] * n
    out: dict = {"geometry": g.name, "layers": layers, "blocks": n, "mib": nbytes / 2**20}
    with _store(2 * nbytes) as store:
        w_src = SpliceWorker(store, block_size=g.block_size, caches=src, backend=backend, rope=g.rope, impl=impl)
        w_dst = SpliceWorker(store, block_size=g.block_size, caches=dst, backend=backend, rope=g.rope, impl=impl)
        save, load = _items(g, n, range(n), range(n, 2 * n), deltas, "speed")
        w_src.save(SpliceMetadata(saves=[save]))
        w_src.flush_saves(wait=True)

        # 1. load with relocation vs a plain pinned host-to-device copy of the same bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        t_h2d = timed(lambda: dev.copy_(host, non_blocking=True), device, reps)
        t_load = timed(lambda: w_dst.start_load(SpliceMetadata(loads=[load])), device, reps)
        out["load"] = {"seconds": t_load, "gb_per_s": nbytes / t_load / 1e9,
                       "h2d_seconds": t_h2d, "h2d_gb_per_s": nbytes / t_h2d / 1e9, "ratio": t_h2d / t_load}

        # 2. the relocation kernel vs a device-to-device copy (one layer, read + write);
        # ``inner`` launches per timing so launch latency does not dominate 32 MiB.
        cache = next(iter(dst.values()))
        blocks = next(iter(src.values()))[:n].clone()
        layout = w_dst.paged.layout
        ids = torch.arange(n, 2 * n)
        ids_dev = ids.to(device)
        k_dst, v_dst = layout.kv_views(cache)
        k_src, v_src = layout.kv_views(blocks)
        cos, sin = (t.to(device).contiguous() for t in cos_sin_table(torch.tensor([-1024]), g.rope))
        run = relocate_triton if select_impl(device, impl) == "triton" else relocate_torch
        flat_src = blocks.reshape(-1).clone()
        flat_dst = torch.empty_like(flat_src)
        inner = 1 if quick else 20

        def repeat(fn):
            return lambda: [fn() for _ in range(inner)]

        t_rel = device_timed(repeat(lambda: run(k_dst, v_dst, k_src, v_src, ids_dev, cos, sin, g.rope)), device, reps,
                             queued=True) / inner
        t_d2d = device_timed(repeat(lambda: flat_dst.copy_(flat_src)), device, reps, queued=True) / inner
        # What the connector pays a layer (prepared once a load), and a one-off public call
        # (its checks and host-to-device tables every time), launches included:
        prepared = prepare_relocation(cache, blocks, ids, -1024, g.rope, layout, impl=impl)
        t_prep = device_timed(repeat(lambda: prepared(cache, blocks)), device, reps) / inner
        t_call = device_timed(repeat(lambda: relocate_blocks(cache, blocks, ids, -1024, g.rope, layout, impl=impl)), device, reps) / inner
        lb = flat_src.numel() * flat_src.element_size()
        out["relocate"] = {"seconds": t_rel, "gb_per_s": 2 * lb / t_rel / 1e9, "kernel": run.__name__,
                           "prepared_seconds": t_prep, "relocate_blocks_seconds": t_call,
                           "d2d_seconds": t_d2d, "d2d_gb_per_s": 2 * lb / t_d2d / 1e9, "ratio": t_d2d / t_rel}

        # 3. a save overlapped with the forward pass's stand-in (matmuls) vs the matmuls alone
        side = 256 if quick else 8192
        # scaled so the chained products stay finite (unscaled, bf16 overflowed after ~20)
        a = (torch.randn(side, side, device=device) / side**0.5).to(g.dtype)
        chain = 2 if quick else 24

        def compute():
            x = a
            for _ in range(chain):
                x = a @ x
            return x

        save2, _ = _items(g, n, range(n), range(n), deltas, "overlap")
        t_alone = device_timed(compute, device, reps)
        overlapped: list[float] = []
        host: list[float] = []
        with _store(2 * nbytes) as store2:
            w_save = SpliceWorker(store2, block_size=g.block_size, caches=src, backend=backend, rope=g.rope, impl=impl)

            def step():
                t = time.perf_counter()
                w_save.save(SpliceMetadata(saves=[save2]))  # the save's host side delays the compute too
                host.append(time.perf_counter() - t)
                compute()

            for _ in range(reps + 1):  # the first one warms the pinned-buffer cache
                _sync(device)
                overlapped.append(device_timed_once(step, device))
                w_save.flush_saves(wait=True)
            saved = w_save.stats.saved_blocks
            host_s = statistics.median(host[1:])
        t_over = statistics.median(overlapped[1:])
        out["save"] = {"compute_seconds": t_alone, "overlapped_seconds": t_over,
                       "slowdown": t_over / t_alone - 1.0, "blocks_saved": saved,
                       "save_host_seconds": host_s}
    return out


def device_timed_once(fn, device) -> float:
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1000.0


# --------------------------------------------------------------------------- report


def readme_table(doc: dict) -> str:
    s = doc["speed"]
    rows = [
        ("load with relocation / pinned H2D copy", s["load"]["ratio"], f">= {TARGETS['load_vs_h2d']:.2f}",
         f"{s['load']['gb_per_s']:.1f} / {s['load']['h2d_gb_per_s']:.1f} GB/s"),
        ("relocation kernel / D2D copy", s["relocate"]["ratio"], f">= {TARGETS['relocate_vs_d2d']:.2f}",
         f"{s['relocate']['gb_per_s']:.1f} / {s['relocate']['d2d_gb_per_s']:.1f} GB/s"),
        ("compute slowdown under a save", s["save"]["slowdown"], f"<= {TARGETS['save_compute_slowdown']:.2f}",
         f"{s['save']['overlapped_seconds'] * 1e3:.2f} / {s['save']['compute_seconds'] * 1e3:.2f} ms"),
    ]
    lines = [f"| {doc['device_name']} ({s['geometry']}, {s['blocks']} blocks) | ratio | target | measured |",
             "|---|---|---|---|"]
    lines += [f"| {a} | {b:.3f} | {c} | {d} |" for a, b, c, d in rows]
    ok = sum(r["ok"] for r in doc["checks"])
    lines.append(f"| correctness ({len(doc['checks'])} geometry x layout checks) | {ok}/{len(doc['checks'])} ok | all | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.gpu_connector_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the JSON result here")
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run of the same code)")
    ap.add_argument("--impl", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--quick", action="store_true", help="2 layers and a few blocks (for CPU tests)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args(argv)
    if args.json:  # checked before minutes of GPU time are spent, as the CLI's (``out/`` was a folder)
        from promptsplice.benchmarks.cli import UsageError, _check_writable

        try:
            _check_writable("--json", args.json, "the result's", None)
        except UsageError as exc:
            print(f"gpu_connector_check: {exc}; nothing was run", file=sys.stderr)
            return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_connector_check: no CUDA device here (torch.cuda.is_available() is False); "
              "run with --device cpu --quick for a dry run. Nothing was checked.", file=sys.stderr)
        return 2
    try:  # what runs: "auto" on CUDA without Triton ran torch, and the JSON said only "auto"
        impl_ran = select_impl(device, args.impl)
    except ConfigError as exc:
        print(f"gpu_connector_check: {exc}; nothing was checked", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    checks = [
        check(g, layout, device, impl=args.impl, quick=args.quick, seed=args.seed + i)
        for i, (g, layout) in enumerate((g, lay) for g in GEOMETRIES for lay in LAYOUTS)
    ]
    for r in checks:
        print(f"{r['geometry']:<14} {r['layout']:<11} {'ok' if r['ok'] else 'FAIL':<5} "
              f"err/bound {r['k_err_over_bound']:.3f}  V {'exact' if r['v_exact'] else 'DIFF'}  "
              f"saved {'exact' if r['saved_exact'] else 'DIFF'}")
    reps = args.reps or (2 if args.quick else 10)
    sp = speed(GEOMETRIES[0], device, impl=args.impl, quick=args.quick, reps=reps)
    doc = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "module": os.path.abspath(__file__),  # which copy of the tree ran
        "impl": args.impl,
        "impl_ran": impl_ran,
        "quick": args.quick,
        "correct": all(r["ok"] for r in checks),
        "checks": checks,
        "speed": sp,
        "targets": TARGETS,
        "targets_met": {
            "load_vs_h2d": sp["load"]["ratio"] >= TARGETS["load_vs_h2d"],
            "relocate_vs_d2d": sp["relocate"]["ratio"] >= TARGETS["relocate_vs_d2d"],
            "save_compute_slowdown": sp["save"]["slowdown"] <= TARGETS["save_compute_slowdown"],
        },
        "wall_s": 0.0,
    }
    doc["wall_s"] = time.perf_counter() - t0
    print("\n" + readme_table(doc))
    text = json.dumps(doc, indent=2)
    if args.json:  # (printed only without a file: it pushed the tables out of a bounded log tail)
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    else:
        print("\n" + text)
    if not doc["correct"]:
        print("gpu_connector_check: CORRECTNESS FAILED (see above)", file=sys.stderr)
    return 0 if doc["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
