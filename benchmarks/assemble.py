"""``promptsplice bench assemble``: assembly policies on a RAG trace, no engine.

Every request of the trace is assembled as ``naive`` (what user code does today:
retrieval order, no dedup, plain text joined, tokenized whole, no alignment) and under
the ordering policies ``retrieval``, ``stable`` and ``cache_aware``; each feeds its own
prefix-cache mirror as it goes, so ``predicted_cached_tokens`` is what an engine with
that block size (and an unbounded cache unless ``capacity_blocks`` is given) would hit.
Beside them the report carries the two bounds of :mod:`promptsplice.benchmarks.bounds`, computed with
the same tokenizer: the radix ideal on the naive prompts and the exact-content oracle.

JSON (names fixed; outside checks read them)::

    {"policies": {NAME: {"requests", "prompt_tokens", "padding_tokens",
                         "dedup_removed_bytes", "predicted_cached_tokens",
                         "predicted_prefill_tokens", "predicted_hit_rate",
                         "assemble_p50_ms", "assemble_p99_ms"}},
     "radix_prefill_tokens": int, "oracle_prefill_tokens": int, ...}

Extra keys: ``block_size``, ``alignment``, ``tokenizer``, ``gap_closed`` (per policy,
``(naive - policy) / (naive - oracle)`` on prefill tokens) and ``best_policy``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from promptsplice.assembler import Assembler, PrefixCacheMirror, load_tokenizer
from promptsplice.benchmarks.bounds import OracleCounter, RadixPrefill
from promptsplice.benchmarks.traces import RagRequest, read_rag_trace
from promptsplice.dedup import dedup
from promptsplice.blocks import chain_hashes, content_digest

__all__ = ["POLICIES", "bench_policies", "run_assemble_bench", "format_table", "gap_closed"]

POLICIES = ("retrieval", "stable", "cache_aware")


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def _chunks(req: RagRequest) -> list[dict[str, Any]]:
    return [{"id": c.id, "text": c.text, "metadata": c.metadata} for c in req.chunks]


def _metrics(
    n: int, prompt: int, padding: int, removed: int, cached: int, times_ms: list[float]
) -> dict[str, Any]:
    return {
        "requests": n,
        "prompt_tokens": prompt,
        "padding_tokens": padding,
        "dedup_removed_bytes": removed,
        "predicted_cached_tokens": cached,
        "predicted_prefill_tokens": prompt - cached,
        "predicted_hit_rate": round(cached / prompt, 6) if prompt else 0.0,
        "assemble_p50_ms": round(_pct(times_ms, 0.50), 4),
        "assemble_p99_ms": round(_pct(times_ms, 0.99), 4),
    }


def gap_closed(naive: int, policy: int, oracle: int) -> float | None:
    """Share of the naive -> oracle prefill gap that ``policy`` closes."""
    if naive <= oracle:
        return None
    return round((naive - policy) / (naive - oracle), 4)


def bench_policies(
    requests: Sequence[RagRequest],
    *,
    tokenizer: Any = None,
    block_size: int = 16,
    alignment: str = "auto",
    capacity_blocks: int | None = None,
    policies: Sequence[str] = POLICIES,
) -> dict[str, Any]:
    """Run naive and each policy over ``requests``; returns the report dict."""
    tok = load_tokenizer(tokenizer)
    report: dict[str, Any] = {"policies": {}}

    # naive + the two bounds (same tokenizer, same separators)
    naive_asm = Assembler(tok, block_size=block_size, capacity_blocks=capacity_blocks)
    naive_mirror = PrefixCacheMirror(block_size, capacity_blocks)
    radix = RadixPrefill()
    oracle = OracleCounter()
    fmt = naive_asm.format
    times: list[float] = []
    prompt = cached = 0
    for req in requests:
        t0 = time.perf_counter()
        naive = naive_asm.naive(_chunks(req), query=req.query, system=req.system or None)
        times.append((time.perf_counter() - t0) * 1e3)
        hashes = chain_hashes(naive.token_ids, block_size)
        pred = naive_mirror.admit(hashes, len(naive.token_ids))
        prompt += len(naive.token_ids)
        cached += pred.cached_tokens
        radix.add(naive.token_ids)
        oracle.add(*_oracle_segments(req, tok, fmt))
    report["policies"]["naive"] = _metrics(len(requests), prompt, 0, 0, cached, times)

    for name in policies:
        asm = Assembler(
            tok,
            block_size=block_size,
            policy=name,
            alignment=alignment,
            capacity_blocks=capacity_blocks,
        )
        times = []
        prompt = cached = padding = removed = 0
        for req in requests:
            t0 = time.perf_counter()
            res = asm.assemble(_chunks(req), query=req.query, system=req.system or None)
            times.append((time.perf_counter() - t0) * 1e3)
            prompt += res.num_tokens
            cached += res.predicted_cached_tokens
            padding += res.padding_tokens
            removed += res.dedup.stats.removed_bytes_total
        report["policies"][name] = _metrics(len(requests), prompt, padding, removed, cached, times)

    report["radix_prefill_tokens"] = radix.prefill_tokens
    report["oracle_prefill_tokens"] = oracle.prefill_tokens
    report["block_size"] = block_size
    report["alignment"] = alignment
    report["tokenizer"] = tok.name
    naive_prefill = report["policies"]["naive"]["predicted_prefill_tokens"]
    report["gap_closed"] = {
        name: gap_closed(naive_prefill, m["predicted_prefill_tokens"], oracle.prefill_tokens)
        for name, m in report["policies"].items()
        if name != "naive"
    }
    best = min(
        (n for n in report["policies"] if n != "naive"),
        key=lambda n: report["policies"][n]["predicted_prefill_tokens"],
        default=None,
    )
    report["best_policy"] = best
    return report


def _oracle_segments(req: RagRequest, tok: Any, fmt: Any) -> tuple[list[tuple[bytes, int]], int]:
    """(digest, tokens) of the system prompt and each exact-deduped chunk; query tokens."""
    sep = fmt.separator
    segs: list[tuple[bytes, int]] = []
    if req.system:
        data = req.system.encode("utf-8")
        segs.append((b"S" + content_digest(data), len(tok.encode(req.system))))
    exact = dedup(_chunks(req), exact=True, containment=False, overlap=False, passages=False)
    texts = [sep + k.text for k in exact.chunks]
    for k, ids in zip(exact.chunks, tok.encode_batch(texts)):
        segs.append((b"C" + k.digest, len(ids)))
    q = len(tok.encode(sep + fmt.query_text(req.query)))
    return segs, q


def format_table(report: dict[str, Any]) -> str:
    cols = [
        ("policy", 12),
        ("prompt", 9),
        ("padding", 8),
        ("dedup B", 9),
        ("cached", 9),
        ("prefill", 9),
        ("hit", 7),
        ("gap", 7),
        ("p50 ms", 8),
        ("p99 ms", 8),
    ]
    lines = ["".join(f"{c:>{w}}" for c, w in cols)]
    for name, m in report["policies"].items():
        gap = report["gap_closed"].get(name)
        row = [
            f"{name:>12}",
            f"{m['prompt_tokens']:>9}",
            f"{m['padding_tokens']:>8}",
            f"{m['dedup_removed_bytes']:>9}",
            f"{m['predicted_cached_tokens']:>9}",
            f"{m['predicted_prefill_tokens']:>9}",
            f"{m['predicted_hit_rate']:>7.3f}",
            f"{'' if gap is None else f'{gap:.2f}':>7}",
            f"{m['assemble_p50_ms']:>8.3f}",
            f"{m['assemble_p99_ms']:>8.3f}",
        ]
        lines.append("".join(row))
    lines.append(
        f"bounds: radix ideal prefill {report['radix_prefill_tokens']}, "
        f"oracle prefill {report['oracle_prefill_tokens']} "
        f"(block {report['block_size']}, alignment {report['alignment']})"
    )
    return "\n".join(lines)


def run_assemble_bench(
    *,
    trace: str | Path,
    json_out: str | Path,
    block_size: int = 16,
    tokenizer: str = "default",
    alignment: str = "auto",
    requests: int | None = None,
    capacity_blocks: int | None = None,
) -> int:
    reqs = read_rag_trace(trace, limit=requests)
    report = bench_policies(
        reqs,
        tokenizer=tokenizer,
        block_size=block_size,
        alignment=alignment,
        capacity_blocks=capacity_blocks,
    )
    report["trace"] = str(trace)
    print(format_table(report))
    Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {json_out}")
    return 0
