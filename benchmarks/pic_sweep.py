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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.pic_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--fidelity-requests", type=int, default=6)
    ap.add_argument("configs", nargs="+", help="PRECOMPUTE:R, e.g. packed:1 or standalone:0")
    args = ap.parse_args(argv)
    base = json.loads(open(args.baseline).read())
    reqs = read_rag_trace(args.trace, limit=args.requests)
    max_tokens = int(base.get("max_tokens") or 8)  # the baseline's, so both ends of the gap match
    engine = start_mode_engine("full")
    try:
        for cfg in args.configs:
            precompute, r = cfg.split(":")
            root = tempfile.mkdtemp(prefix="promptsplice-pic-sweep-")  # its store's disk tier, removed after it
            kv = start_mode_engine("splice", store_dir=root)
            report = {"modes": {"naive": base["modes"]["naive"]}, "oracle_prefill_tokens": base["oracle_prefill_tokens"]}
            t0 = time.time()
            try:
                _run_pic(report, {}, engine, kv, reqs, policy="cache_aware", max_tokens=max_tokens, progress=None,
                         prompt_format=PromptFormat.chatml(), recompute_blocks=int(r),
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
    raise SystemExit(main())
