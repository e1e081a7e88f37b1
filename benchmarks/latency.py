"""Latency of ``assemble_prompt`` on a 20-chunk, ~8K-token request (real text, real tokenizer).

* warm: the chunks' tokens are in the token cache (the common case: popular chunks);
  the whole pipeline runs (dedup, ordering, layout, hashing, mirror update).
* cold: the token cache is cleared before every call, so every segment is tokenized;
  the baseline, measured in the same run, is tokenizing the same prompt text once,
  whole, with the same tokenizer (what user code pays today).

Run: ``python -m promptsplice.benchmarks.latency [--iters N]``.  Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from promptsplice.assembler import Assembler, load_tokenizer
from promptsplice.benchmarks._stats import percentile
from promptsplice.benchmarks.traces import load_wiki_leads

__all__ = ["build_request", "run_latency_bench"]


def build_request(tokenizer: Any, *, chunks: int = 20, target_tokens: int = 8192) -> list[dict[str, Any]]:
    """``chunks`` chunks of real Wikipedia text, about ``target_tokens`` tokens in all."""
    per_chunk = target_tokens // chunks
    leads = [t for _, t in load_wiki_leads() if len(t) > 400]
    out: list[dict[str, Any]] = []
    i = 0
    while len(out) < chunks:
        text = ""
        while len(tokenizer.encode(text)) < per_chunk:
            text = (text + "\n\n" + leads[i]).strip()
            i += 1
        ids = tokenizer.encode(text)[:per_chunk]
        out.append({"id": f"lat-{len(out)}", "text": tokenizer.decode(ids), "metadata": {"source": f"doc{len(out)}"}})
    return out


def run_latency_bench(
    iters: int = 200, block_size: int = 16, tokenizer: str = "default", policy: str = "cache_aware"
) -> dict[str, Any]:
    """``policy``: ``assemble_prompt``'s default unless told otherwise."""
    tok = load_tokenizer(tokenizer)
    req = build_request(tok)
    system = "You are a helpful assistant. Answer from the documents and cite them by number."
    query = "Summarise what these documents say about the history of each place."
    asm = Assembler(tok, block_size=block_size, policy=policy)
    first = asm.assemble(req, query=query, system=system)
    warm: list[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        asm.assemble(req, query=query, system=system)
        warm.append((time.perf_counter() - t0) * 1e3)

    text = asm.naive(req, query=query, system=system).text
    cold: list[float] = []
    whole: list[float] = []
    cold_iters = max(10, iters // 4)
    for _ in range(cold_iters):
        asm.token_cache.clear()
        t0 = time.perf_counter()
        asm.assemble(req, query=query, system=system)
        cold.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        tok.encode(text)
        whole.append((time.perf_counter() - t0) * 1e3)
    report = {
        "chunks": len(req),
        "prompt_tokens": first.num_tokens,
        "block_size": block_size,
        "policy": policy,
        "warm_p50_ms": round(percentile(warm, 0.5), 4),
        "warm_p99_ms": round(percentile(warm, 0.99), 4),
        "cold_p50_ms": round(percentile(cold, 0.5), 4),
        "tokenize_whole_p50_ms": round(percentile(whole, 0.5), 4),
        "cold_over_tokenize": round(statistics.median(c / w for c, w in zip(cold, whole)), 3),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--policy", default="cache_aware", help="retrieval | stable | cache_aware")
    args = ap.parse_args(argv)
    if args.iters < 1:
        ap.error(f"--iters must be >= 1, got {args.iters}")
    r = run_latency_bench(args.iters, args.block_size, policy=args.policy)
    print(
        f"assemble_prompt ({r['policy']}), {r['chunks']} chunks, {r['prompt_tokens']} tokens: warm p50 "
        f"{r['warm_p50_ms']} ms (p99 {r['warm_p99_ms']}); cold p50 {r['cold_p50_ms']} ms vs "
        f"tokenizing the text once {r['tokenize_whole_p50_ms']} ms: "
        f"{r['cold_over_tokenize']}x"
    )
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
