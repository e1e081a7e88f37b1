"""``promptsplice bench rag --suite``: every trace family through the embedded engine.

The engine-side twin of ``bench assemble --suite``: each family of
:data:`promptsplice.benchmarks.traces.SUITE` is generated, written as JSONL and read
back (validated), then run by :func:`promptsplice.benchmarks.rag.run_modes` on the same
two engines (each mode starts from an empty prefix cache).  The report holds each
family's ``rag`` report, the worst family per mode by gap closed (vLLM's own cached
tokens), and the families that failed; one broken family does not stop the others.

JSON::

    {"suite": {...}, "families": {FAMILY: {"trace", "shape", "report": RAG_REPORT} | {"error": str}},
     "worst": {"promptsplice": {"gap_closed", "family"}, "promptsplice_pic": {...}},
     "failed": {FAMILY: str}}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.rag import format_modes, run_modes
from promptsplice.benchmarks.traces import SUITE, read_rag_trace, shape_stats, write_rag_trace
from promptsplice.errors import PromptspliceError

__all__ = ["rag_suite", "run_rag_suite"]


def _gap(report: dict[str, Any], mode: str) -> float | None:
    if mode == "promptsplice":
        return report.get("gap_closed")
    return (report.get("pic") or {}).get("gap_closed")


def rag_suite(
    engine: Any,
    *,
    kv_engine: Any = None,
    families: Sequence[str] = SUITE,
    requests: int = 60,
    seed: int = 0,
    trace_dir: str | Path,
    **modes: Any,
) -> dict[str, Any]:
    """Run every family on ``engine`` (and ``kv_engine``: the splice mode); ``modes``
    go to :func:`run_modes` (policy, alignment, max_tokens, ...)."""
    out_dir = Path(trace_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "suite": {"families": list(families), "requests": requests, "seed": seed, **modes},
        "families": {},
        "failed": {},
    }
    for fam in families:
        path = out_dir / f"{fam}.jsonl"
        try:
            write_rag_trace(path, requests=requests, seed=seed, family=fam)
            reqs = read_rag_trace(path)
            rep, _ = run_modes(engine, reqs, kv_engine=kv_engine, **modes)
        except (PromptspliceError, OSError) as exc:
            report["failed"][fam] = f"{type(exc).__name__}: {exc}"
            report["families"][fam] = {"error": report["failed"][fam]}
            continue
        report["families"][fam] = {"trace": str(path), "shape": shape_stats(reqs), "report": rep}
    worst: dict[str, Any] = {}
    for mode in ("promptsplice", "promptsplice_pic"):
        gaps = [(_gap(e["report"], mode), f) for f, e in report["families"].items() if "report" in e]
        gaps = [(g, f) for g, f in gaps if g is not None]
        if gaps:
            g, f = min(gaps)
            worst[mode] = {"gap_closed": g, "family": f}
    report["worst"] = worst
    return report


def format_suite(report: dict[str, Any]) -> str:
    lines = [
        "| family | naive prefill | promptsplice | promptsplice_pic | oracle | gap promptsplice | gap pic |",
        "|---|---|---|---|---|---|---|",
    ]
    for fam, e in report["families"].items():
        if "error" in e:
            lines.append(f"| {fam} | failed: {e['error']} |")
            continue
        r, m = e["report"], e["report"]["modes"]
        pic = m.get("promptsplice_pic", {}).get("prefill_tokens", "-")
        g1, g2 = _gap(r, "promptsplice"), _gap(r, "promptsplice_pic")
        lines.append(
            f"| {fam} | {m['naive']['prefill_tokens']} | {m['promptsplice']['prefill_tokens']} | {pic} | "
            f"{r['oracle_prefill_tokens']} | {'-' if g1 is None else f'{g1:.2f}'} | {'-' if g2 is None else f'{g2:.2f}'} |"
        )
    for mode, w in report["worst"].items():
        lines.append(f"worst {mode}: gap {w['gap_closed']:.2f} ({w['family']})")
    if report["failed"]:
        lines.append("failed: " + "; ".join(f"{k}: {v}" for k, v in report["failed"].items()))
    return "\n".join(lines)


def run_rag_suite(
    *,
    json_out: str | Path,
    families: Sequence[str] | None = None,
    requests: int | None = None,
    seed: int = 0,
    trace_dir: str | Path | None = None,
    policy: str = "cache_aware",
    alignment: str = "auto",
    max_tokens: int = 8,
    recompute_blocks: int | None = None,
    fidelity_requests: int = 32,
) -> int:
    """The CLI's job: start the two engines once, run the suite, print, write the JSON;
    exit status 1 when a family failed."""
    from promptsplice.assembler import AlignPolicy, OrderPolicy
    from promptsplice.benchmarks.agent import start_engines

    OrderPolicy.parse(policy)  # fail fast, before the engines start
    AlignPolicy.parse(alignment)
    out = Path(json_out)
    engine, kv_engine = start_engines()
    try:
        report = rag_suite(
            engine, kv_engine=kv_engine, families=SUITE if families is None else families,
            requests=60 if requests is None else requests, seed=seed,
            trace_dir=trace_dir if trace_dir is not None else out.with_name(out.stem + "-traces"),
            policy=policy, alignment=alignment, max_tokens=max_tokens,
            recompute_blocks=recompute_blocks, fidelity_requests=fidelity_requests,
        )
    finally:
        kv_engine.close()
        engine.close()
    for fam, e in report["families"].items():
        if "report" in e:
            print(f"## {fam}\n{format_modes(e['report'])}\n")
    print(format_suite(report))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if report["failed"] else 0
