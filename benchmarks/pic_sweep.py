"""The r sweep of position-independent reuse: ``promptsplice_pic`` of ``bench rag`` once
per configuration, each on a fresh store engine (an empty KV cache and store of the
bench's sizes, so no configuration runs on what an earlier one left: equal capacity),
beside one plain engine for the fidelity probes' exact prefills.  Every request relocates what it can
(``relocate="always"``): the sweep studies relocation itself, not the runner's gate.

    python -m promptsplice.benchmarks.pic_sweep --trace T --baseline RAG.json --requests 40 \\
        --fidelity-requests 6 packed:0 packed:1 packed:2 standalone:0

``--baseline``: a ``bench rag`` JSON of the same trace and request count, for the naive
prefill and the oracle (the gap's ends).  Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

from promptsplice.assembler import PromptFormat
from promptsplice.benchmarks.agent import start_mode_engine
from promptsplice.benchmarks.rag import PIC_MODE, _run_pic
from promptsplice.benchmarks.traces import read_rag_trace
from promptsplice.benchmarks.cli import UsageError, count_arg, run_tool


def _config(cfg: str) -> tuple[str, int]:
    """``PRECOMPUTE:R`` -> (precompute, recomputed blocks)."""
    precompute, sep, r = cfg.partition(":")
    if not sep or not precompute or not r.isdigit():
        raise UsageError(f"config {cfg!r}: write PRECOMPUTE:R with R a count of blocks, e.g. packed:1")
    return precompute, int(r)


def _baseline(path: str) -> dict:
    """A ``bench rag`` report: its naive mode and oracle are the sweep's gap's two ends."""
    try:
        with open(path, encoding="utf-8") as fh:
            base = json.load(fh)
        base["modes"]["naive"], base["oracle_prefill_tokens"]  # noqa: B018 - both must be there
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--baseline {path}: not a bench rag report ({type(exc).__name__}: {exc}); "
                         "pass the JSON of promptsplice bench rag --json") from None
    return base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.pic_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--requests", type=count_arg(1), default=40)
    ap.add_argument("--fidelity-requests", type=count_arg(0), default=6)
    ap.add_argument("configs", nargs="+", help="PRECOMPUTE:R, e.g. packed:1 or standalone:0")
    args = ap.parse_args(argv)
    configs = [_config(cfg) for cfg in args.configs]  # every bad input fails before an engine starts
    base = _baseline(args.baseline)
    reqs = read_rag_trace(args.trace, limit=args.requests)
    max_tokens = int(base.get("max_tokens") or 8)  # the baseline's, so both ends of the gap match
    engine = start_mode_engine("full")
    try:
        for cfg, (precompute, r) in zip(args.configs, configs):
            root = tempfile.mkdtemp(prefix="promptsplice-pic-sweep-")  # its store's disk tier, removed after it
            kv = start_mode_engine("splice", store_dir=root)
            report = {"modes": {"naive": base["modes"]["naive"]}, "oracle_prefill_tokens": base["oracle_prefill_tokens"]}
            t0 = time.time()
            try:
                _run_pic(report, {}, engine, kv, reqs, policy="cache_aware", max_tokens=max_tokens, progress=None,
                         prompt_format=PromptFormat.chatml(), recompute_blocks=r,
                         fidelity_requests=args.fidelity_requests, precompute=precompute,
                         salt=f"sweep-{cfg}-{time.time()}", relocate="always")  # what relocation does
            finally:
                kv.close()
                shutil.rmtree(root, ignore_errors=True)
            m, p, f = report["modes"][PIC_MODE], report["pic"], report["fidelity"]
            print(json.dumps({
                "config": cfg, "prefill_tokens": m["prefill_tokens"], "gap_closed": p["gap_closed"],
                "ttft_p50_ms": m["ttft_p50_ms"], "engine_requests": p["engine_requests"],
                "tf_top1_agreement": f["tf_top1_agreement"], "first_token_kl": f["first_token_kl"],
                "first_token_kl_p50": f["first_token_kl_p50"], "first_token_kl_max": f["first_token_kl_max"],
                "greedy_agreement": f["greedy_agreement"], "control": f["control"], "bench_s": round(time.time() - t0),
            }), flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
