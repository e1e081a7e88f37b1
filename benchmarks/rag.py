"""``promptsplice bench rag``: a RAG trace through the embedded vLLM engine, judged by vLLM.

Two modes run the same requests on the same engine, each from an empty prefix cache:

* ``naive``: what user code does today: the retrieved chunks in retrieval order, no
  dedup, joined as plain text and sent as text (vLLM tokenizes it);
* ``promptsplice``: :class:`assembler.Assembler` with the engine's block size and a
  mirror as large as the engine's KV cache, sent as token ids.

``cached_tokens`` is vLLM's own ``num_cached_tokens`` per request (summed), and
``prefill_tokens = prompt_tokens - cached_tokens``.  The mirror block compares what the
assembler predicted with what vLLM measured (they are equal when nothing else uses the
engine).  The bounds are those of :mod:`benchmarks.bounds`, with the engine's tokenizer.

JSON (names fixed)::

    {"modes": {"naive": M, "promptsplice": M},
     "mirror": {"predicted_cached_tokens", "measured_cached_tokens"},
     "radix_prefill_tokens": int, "oracle_prefill_tokens": int, ...}
    M = {"requests", "prompt_tokens", "prefill_tokens", "cached_tokens", "hit_rate",
         "wall_s", "ttft_p50_ms", "ttft_p99_ms"}
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.assemble import _chunks, _oracle_segments, gap_closed
from benchmarks.bounds import OracleCounter, RadixPrefill
from benchmarks.traces import RagRequest, read_rag_trace

__all__ = ["run_modes", "run_rag_bench", "format_modes", "MODES"]

MODES = ("naive", "promptsplice")


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _mode_metrics(completions: list[Any], wall: float) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in completions)
    cached = sum(c.num_cached_tokens for c in completions)
    ttfts = [c.ttft_s * 1e3 for c in completions]
    return {
        "requests": len(completions),
        "prompt_tokens": prompt,
        "prefill_tokens": prompt - cached,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
        "wall_s": round(wall, 3),
        "ttft_p50_ms": round(_pct(ttfts, 0.5), 2),
        "ttft_p99_ms": round(_pct(ttfts, 0.99), 2),
    }


def run_modes(
    engine: Any,
    requests: Sequence[RagRequest],
    *,
    policy: str = "cache_aware",
    alignment: str = "auto",
    max_tokens: int = 8,
    progress: Callable[[str, int], None] | None = None,
    prompt_format: Any = None,
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Run naive then promptsplice on ``engine``; returns (report, completions by mode).

    Both modes render the same pieces with the same :class:`assembler.PromptFormat`
    (default: ChatML, the default model's chat format).
    """
    from assembler import PromptFormat

    fmt_obj = prompt_format if prompt_format is not None else PromptFormat.chatml()
    asm = engine.make_assembler(policy=policy, alignment=alignment, prompt_format=fmt_obj)
    fmt = asm.format
    report: dict[str, Any] = {"modes": {}}
    outs: dict[str, list[Any]] = {}

    engine.reset_prefix_cache()
    completions = []
    t0 = time.perf_counter()
    for req in requests:
        text = fmt.naive_text([c.text for c in req.chunks], query=req.query, system=req.system or None)
        completions.append(engine.generate(text, max_tokens=max_tokens))
        if progress:
            progress("naive", 1)
    report["modes"]["naive"] = _mode_metrics(completions, time.perf_counter() - t0)
    outs["naive"] = completions

    engine.reset_prefix_cache()
    completions = []
    predicted = 0
    t0 = time.perf_counter()
    for req in requests:
        prompt = asm.assemble(
            _chunks(req), query=req.query, system=req.system or None, admit=False, learn=True
        )
        comp = engine.generate(prompt, max_tokens=max_tokens, mirror=asm.mirror)
        predicted += prompt.predicted_cached_tokens
        completions.append(comp)
        if progress:
            progress("promptsplice", 1)
    report["modes"]["promptsplice"] = _mode_metrics(completions, time.perf_counter() - t0)
    outs["promptsplice"] = completions
    report["mirror"] = {
        "predicted_cached_tokens": predicted,
        "measured_cached_tokens": report["modes"]["promptsplice"]["cached_tokens"],
    }

    radix, oracle = RadixPrefill(), OracleCounter()
    for comp in outs["naive"]:
        radix.add(comp.prompt_token_ids)
    for req in requests:
        oracle.add(*_oracle_segments(req, asm.tokenizer, fmt))
    report["radix_prefill_tokens"] = radix.prefill_tokens
    report["oracle_prefill_tokens"] = oracle.prefill_tokens
    report["block_size"] = engine.block_size
    report["policy"] = policy
    report["alignment"] = alignment
    report["max_tokens"] = max_tokens
    report["gap_closed"] = gap_closed(
        report["modes"]["naive"]["prefill_tokens"],
        report["modes"]["promptsplice"]["prefill_tokens"],
        oracle.prefill_tokens,
    )
    return report, outs


def format_modes(report: dict[str, Any]) -> str:
    n, p = report["modes"]["naive"], report["modes"]["promptsplice"]
    rows = [
        ("requests", n["requests"], p["requests"]),
        ("prompt tokens", n["prompt_tokens"], p["prompt_tokens"]),
        ("tokens prefilled", n["prefill_tokens"], p["prefill_tokens"]),
        ("cached tokens (vLLM)", n["cached_tokens"], p["cached_tokens"]),
        ("hit rate", f"{n['hit_rate']:.1%}", f"{p['hit_rate']:.1%}"),
        ("wall time (s)", n["wall_s"], p["wall_s"]),
        ("TTFT p50 (ms)", n["ttft_p50_ms"], p["ttft_p50_ms"]),
        ("TTFT p99 (ms)", n["ttft_p99_ms"], p["ttft_p99_ms"]),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':<{w}}  {'naive':>12}  {'promptsplice':>12}"]
    lines += [f"{name:<{w}}  {a!s:>12}  {b!s:>12}" for name, a, b in rows]
    gap = report["gap_closed"]
    lines.append(
        f"bounds on prefill: radix ideal {report['radix_prefill_tokens']}, oracle "
        f"{report['oracle_prefill_tokens']}; promptsplice closes "
        f"{'n/a' if gap is None else f'{gap:.0%}'} of the naive->oracle gap. Mirror "
        f"predicted {report['mirror']['predicted_cached_tokens']} cached tokens, vLLM "
        f"measured {report['mirror']['measured_cached_tokens']} "
        f"(block {report['block_size']}, {report['policy']}, alignment {report['alignment']})"
    )
    return "\n".join(lines)


def run_rag_bench(
    *,
    trace: str | Path,
    json_out: str | Path,
    requests: int | None = None,
    policy: str = "cache_aware",
    alignment: str = "auto",
    max_tokens: int = 8,
) -> int:
    from assembler import AlignPolicy, OrderPolicy
    from engine_adapters import EmbeddedEngine

    OrderPolicy.parse(policy)  # fail fast, before the engine starts
    AlignPolicy.parse(alignment)
    reqs = read_rag_trace(trace, limit=requests)
    engine = EmbeddedEngine()
    report, _ = run_modes(engine, reqs, policy=policy, alignment=alignment, max_tokens=max_tokens)
    report["trace"] = str(trace)
    print(format_modes(report))
    Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {json_out}")
    return 0
