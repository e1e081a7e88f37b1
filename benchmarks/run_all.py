"""Every number the README reports, in one run: ``make bench`` (or ``python -m promptsplice.benchmarks.run_all``).

Writes the traces and JSON reports under ``--out`` (default ``out/bench``) and prints
the README's tables as Markdown.  Ratios are against baselines measured in the same run.
Exit status as ``bench assemble --suite``: ``BOUND_EXIT`` when a policy predicted less
than its bound, else 1 when a suite family failed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from promptsplice.benchmarks.assemble import (
    bound_status,
    bench_policies,
    bench_suite,
    format_suite_table,
    suite_reports,
)
from promptsplice.benchmarks.traces import read_rag_trace, write_rag_trace
from promptsplice.benchmarks.cli import count_arg, run_tool

__all__ = ["main"]


def _gap(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"  # None: no gap to close


def _assembly_rows(out: Path, requests: int, reports: dict[str, dict]) -> list[str]:
    rows = [
        "| trace | block | alignment | naive prefill | retrieval | stable | cache_aware | radix ideal | oracle | best gap closed | padding (best) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for profile in ("repeat-heavy", "diverse"):
        trace = out / f"rag-{profile}.jsonl"
        write_rag_trace(trace, requests=requests, seed=0, profile=profile)
        reqs = read_rag_trace(trace)
        for bs in (16, 32):
            for align in ("none", "auto", "all"):
                rep = bench_policies(reqs, block_size=bs, alignment=align)
                reports[f"{profile}, block {bs}, alignment {align}"] = rep
                (out / f"assemble-{profile}-b{bs}-{align}.json").write_text(json.dumps(rep, indent=2))
                pol = rep["policies"]
                best = rep["best_policy"]
                rows.append(
                    f"| {profile} | {bs} | {align} | {pol['naive']['predicted_prefill_tokens']} | "
                    f"{pol['retrieval']['predicted_prefill_tokens']} | {pol['stable']['predicted_prefill_tokens']} | "
                    f"{pol['cache_aware']['predicted_prefill_tokens']} | {rep['radix_prefill_tokens']} | "
                    f"{rep['oracle_prefill_tokens']} | {_gap(rep['gap_closed'][best])} ({best}) | "
                    f"{pol[best]['padding_tokens']} |"
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.run_all", description=__doc__)
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--requests", type=count_arg(1), default=400)  # 0 ended in a traceback
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print("## Assembly: predicted prefill tokens (SmolLM2 tokenizer, mirror with vLLM's rules)\n")
    reports: dict[str, dict] = {}
    print("\n".join(_assembly_rows(out, args.requests, reports)))

    suite_requests = min(args.requests, 200)
    print(f"\n## Trace suite: every family, {suite_requests} requests, blocks 16 and 32\n")
    suite = bench_suite(requests=suite_requests, block_sizes=(16, 32), trace_dir=out / "suite")
    (out / "suite.json").write_text(json.dumps(suite, indent=2))
    print(format_suite_table(suite))
    reports.update(suite_reports(suite, "suite"))

    from promptsplice.benchmarks.latency import run_latency_bench

    lat = run_latency_bench()
    (out / "latency.json").write_text(json.dumps(lat, indent=2))
    print("\n## assemble_prompt latency (20 chunks)\n")
    print(json.dumps(lat, indent=2))

    from promptsplice.benchmarks.dedup_bench import run_dedup_bench

    dd = run_dedup_bench()
    (out / "dedup.json").write_text(json.dumps(dd, indent=2))
    print("\n## dedup throughput\n")
    print(json.dumps(dd, indent=2))
    # A policy below its bound, or a family that failed, fails the run (the tables
    # above are printed either way, with the failures named on stderr).
    rc = bound_status(reports)
    if suite["failed"]:
        import sys

        for name, why in suite["failed"].items():
            print(f"promptsplice: error: suite family {name} failed: {why}", file=sys.stderr)
    return rc or (1 if suite["failed"] else 0)


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
