"""``promptsplice demo``: the built-in RAG sample, naive vs promptsplice, on real vLLM.

The sample is made from real text (Wikipedia lead paragraphs, see
:mod:`promptsplice.benchmarks.traces`) with a real retriever's noise: duplicate chunks from two
indexes, sentence chunks contained in window chunks, overlapping sliding windows,
reordered results, Zipf-popular questions.  Both modes run on the embedded vLLM engine
with the default model (SmolLM2-135M-Instruct), each from an empty prefix cache, in the
model's chat format; the cached tokens are vLLM's own count.  ``--no-engine`` runs the
assembly side alone (tokenizer + mirror), as on a machine without vLLM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.assemble import bench_policies
from promptsplice.benchmarks.traces import sample_rag_requests

__all__ = ["run_demo", "demo_table", "write_chart", "chart_formats"]

POLICY = "cache_aware"


def demo_table(report: dict[str, Any], policy: str = POLICY) -> str:
    """Assembly-only table (predicted by the mirror)."""
    naive = report["policies"]["naive"]
    ours = report["policies"][policy]
    rows = [
        ("requests", naive["requests"], ours["requests"]),
        ("prompt tokens", naive["prompt_tokens"], ours["prompt_tokens"]),
        ("bytes removed by dedup", naive["dedup_removed_bytes"], ours["dedup_removed_bytes"]),
        ("padding tokens", naive["padding_tokens"], ours["padding_tokens"]),
        ("predicted cached tokens", naive["predicted_cached_tokens"], ours["predicted_cached_tokens"]),
        ("predicted prefill tokens", naive["predicted_prefill_tokens"], ours["predicted_prefill_tokens"]),
        ("predicted hit rate", f"{naive['predicted_hit_rate']:.1%}", f"{ours['predicted_hit_rate']:.1%}"),
        ("assemble p50 (ms)", naive["assemble_p50_ms"], ours["assemble_p50_ms"]),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':<{w}}  {'naive':>12}  {'promptsplice':>12}"]
    lines += [f"{name:<{w}}  {a!s:>12}  {b!s:>12}" for name, a, b in rows]
    gap = report["gap_closed"].get(policy)
    lines.append(
        f"bounds on prefill: radix ideal {report['radix_prefill_tokens']}, oracle "
        f"{report['oracle_prefill_tokens']}; promptsplice closes "
        f"{'n/a' if gap is None else f'{gap:.0%}'} of the naive->oracle gap "
        f"(block {report['block_size']}, order {policy}, alignment {report['alignment']})"
    )
    return "\n".join(lines)


def chart_formats() -> set[str]:
    """The file suffixes (no dot, lower case) :func:`write_chart` can write: matplotlib's
    formats, read before the engine runs (``--chart``'s check); matplotlib is the
    ``bench`` extra, so its absence is a usage error then, not after the run."""
    from promptsplice.errors import ConfigError

    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise ConfigError(f"demo: the chart needs matplotlib ({exc}); install promptsplice[bench], "
                          "or pass --no-engine for the assembly side alone") from None
    return set(FigureCanvasBase.get_supported_filetypes())


def write_chart(report: dict[str, Any], path: Path) -> Path:
    """A PNG beside the table: tokens prefilled/cached and TTFT p50, naive vs promptsplice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["naive", "promptsplice"]
    m = report["modes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    prefill = [m[k]["prefill_tokens"] for k in modes]
    cached = [m[k]["cached_tokens"] for k in modes]
    ax1.bar(modes, prefill, label="prefilled", color="#d62728")
    ax1.bar(modes, cached, bottom=prefill, label="cached (vLLM)", color="#2ca02c")
    ax1.axhline(report["oracle_prefill_tokens"], ls="--", color="k", lw=1, label="oracle prefill")
    ax1.set_ylabel("prompt tokens")
    ax1.set_title("Prompt tokens over the sample")
    ax1.legend(fontsize=8)
    ttft = [m[k]["ttft_p50_ms"] for k in modes]
    ax2.bar(modes, ttft, color=["#7f7f7f", "#1f77b4"])
    ax2.set_ylabel("ms")
    ax2.set_title("Time to first token, p50")
    for i, v in enumerate(ttft):
        ax2.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    fig.suptitle(f"promptsplice demo: {m['naive']['requests']} RAG requests, vLLM block {report['block_size']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class _Progress:
    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr, leave=False)

    def __call__(self, mode: str, n: int) -> None:
        self._bar.set_description(mode)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


def run_demo(
    requests: int = 60,
    block_size: int | None = None,
    seed: int = 0,
    *,
    engine: bool = True,
    chart: str | Path | None = "out/demo.png",
    max_tokens: int = 8,
    answer_tokens: int = 48,
) -> int:
    reqs = sample_rag_requests(requests, seed=seed)
    if not engine:
        bs = 16 if block_size is None else block_size
        print(f"promptsplice demo (assembly only): {len(reqs)} RAG requests over real Wikipedia text, block size {bs}")
        report = bench_policies(reqs, block_size=bs, policies=(POLICY,))
        print(demo_table(report))
        return 0

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from promptsplice.assembler import PromptFormat
    from promptsplice.benchmarks.rag import format_modes, run_modes
    from promptsplice.engine_adapters import EmbeddedEngine

    print(f"promptsplice demo: {len(reqs)} RAG requests over real Wikipedia text on vLLM "
          "(SmolLM2-135M-Instruct); starting the engine...", flush=True)
    eng = EmbeddedEngine() if block_size is None else EmbeddedEngine(block_size=block_size)
    progress = _Progress(2 * len(reqs))
    try:
        report, outs = run_modes(
            eng, reqs, policy=POLICY, max_tokens=max_tokens, progress=progress,
            prompt_format=PromptFormat.chatml(),
        )
    finally:
        progress.close()
    print(format_modes(report))
    # one sample question with both answers (the most popular question of the sample)
    counts: dict[str, int] = {}
    for r in reqs:
        counts[r.query] = counts.get(r.query, 0) + 1
    q = max(counts, key=lambda k: counts[k])
    req = next(r for r in reversed(reqs) if r.query == q)
    fmt = PromptFormat.chatml()
    naive = eng.generate(
        fmt.naive_text([c.text for c in req.chunks], query=req.query, system=req.system or None),
        max_tokens=answer_tokens,
    )
    asm = eng.make_assembler(prompt_format=fmt)
    ours = eng.generate(
        asm.assemble([{"id": c.id, "text": c.text, "metadata": c.metadata} for c in req.chunks],
                     query=req.query, system=req.system or None),
        max_tokens=answer_tokens,
    )
    print(f"\nsample question: {q}")
    print(f"  naive:        {naive.text.strip()!r}")
    print(f"  promptsplice: {ours.text.strip()!r}")
    if chart:
        path = write_chart(report, Path(chart))
        print(f"chart: {path}")
    return 0
