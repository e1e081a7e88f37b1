"""``promptsplice bench ttft``: what a prefix-cache hit is worth on this hardware.

For each prompt length, a prompt of real text (Wikipedia leads, the engine's tokenizer)
is sent uncached (first time) and then again (all but the last partial block cached);
time to first token is measured by the embedded engine per request.  Each length is
repeated ``repeats`` times with fresh text and the median is reported, with the ratio
uncached / cached measured in the same run.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.traces import load_wiki_leads

__all__ = ["run_ttft_table", "format_ttft", "run_ttft_bench"]

LENGTHS = (128, 256, 512, 1024, 2048, 3072)


def _text_tokens(tokenizer: Any, start: int, n: int) -> list[int]:
    leads = load_wiki_leads()
    ids: list[int] = []
    i = start
    while len(ids) < n:
        ids.extend(tokenizer.encode("\n\n" + leads[i % len(leads)][1]))
        i += 1
    return ids[:n]


def run_ttft_table(engine: Any, lengths: tuple[int, ...] = LENGTHS, repeats: int = 3) -> list[dict[str, Any]]:
    rows = []
    offset = 0
    for n in lengths:
        if n >= engine.max_model_len:
            continue
        unc, hit, cached = [], [], []
        for _ in range(repeats):
            offset += 97
            prompt = _text_tokens(engine.tokenizer, offset, n)
            first = engine.generate(prompt, max_tokens=1)
            second = engine.generate(prompt, max_tokens=1)
            unc.append(first.ttft_s * 1e3)
            hit.append(second.ttft_s * 1e3)
            cached.append(second.num_cached_tokens)
        u, c = statistics.median(unc), statistics.median(hit)
        rows.append(
            {
                "prompt_tokens": n,
                "cached_tokens": int(statistics.median(cached)),
                "ttft_uncached_ms": round(u, 1),
                "ttft_cached_ms": round(c, 1),
                "speedup": round(u / c, 1) if c else None,
            }
        )
    return rows


def format_ttft(rows: list[dict[str, Any]]) -> str:
    lines = ["| prompt tokens | cached by vLLM | TTFT uncached (ms) | TTFT cached (ms) | speedup |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_uncached_ms']} | "
            f"{r['ttft_cached_ms']} | {r['speedup']}x |"
        )
    return "\n".join(lines)


def run_ttft_bench(*, json_out: str | Path | None = None, repeats: int = 3) -> int:
    from promptsplice.engine_adapters import EmbeddedEngine

    engine = EmbeddedEngine()
    rows = run_ttft_table(engine, repeats=repeats)
    print(f"block size {engine.block_size}, {engine.num_blocks} KV blocks")
    print(format_ttft(rows))
    if json_out:
        Path(json_out).write_text(json.dumps({"block_size": engine.block_size, "rows": rows}, indent=2) + "\n")
    return 0
