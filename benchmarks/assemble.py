"""``promptsplice bench assemble``: assembly policies on a RAG trace, no engine.

Every request of the trace is assembled as ``naive`` (what user code does today:
retrieval order, no dedup, plain text joined, tokenized whole, no alignment) and under
the ordering policies ``retrieval``, ``stable`` and ``cache_aware``; each feeds its own
prefix-cache mirror as it goes, so ``predicted_cached_tokens`` is what an engine with
that block size (and an unbounded cache unless ``capacity_blocks`` is given) would hit.
Beside them the report carries the bounds of :mod:`promptsplice.benchmarks.bounds`, computed with
the same tokenizer: the radix ideal on the naive prompts and the exact-content oracle on
the segments dedup keeps, floored per request by each measured mode's radix ideal (so
``gap_closed <= 1`` holds for the measured modes by construction; the content bound
alone counts hits per whole segment, and a run of new segments can spell part of an
old one, so it is no bound for every conceivable order), each unbounded and under the
engine's cache capacity (``*_bounded``: LRU over ``bound_capacity_blocks`` blocks;
default the embedded engine's 512 MiB KV cache in bf16, 727 usable blocks, 23,264
tokens: :data:`ENGINE_CACHE_TOKENS`).
Without ``capacity_blocks`` every mode also runs under that capacity
(``predicted_prefill_tokens_bounded``), so the ``*_bounded`` bounds sit next to modes
of the same cache.

``--suite`` (:func:`run_suite_bench`) generates every trace family of
:data:`promptsplice.benchmarks.traces.SUITE`, writes each as JSONL and reads it back
(validated), runs each at every block size, and reports each family, the worst family
per policy and the policy whose worst family is best (choose defaults by the worst
family, never by the mean).  A family that fails (generation error, a malformed trace
file) is reported under ``failed`` and the others still run.

JSON (names fixed; outside checks read them)::

    {"policies": {NAME: {"requests", "prompt_tokens", "padding_tokens",
                         "dedup_removed_bytes", "predicted_cached_tokens",
                         "predicted_prefill_tokens", "predicted_hit_rate",
                         "assemble_p50_ms", "assemble_p99_ms"}},
     "radix_prefill_tokens": int, "oracle_prefill_tokens": int, ...}

Extra keys: ``block_size``, ``alignment``, ``tokenizer``, ``gap_closed`` (per policy,
``(naive - policy) / (naive - oracle)`` on prefill tokens; with no gap, ``None``, or
minus the share of naive's prefill a policy added), ``best_policy``,
``dedup_removed_chunks`` (per mode: chunks dedup removed, by reason, ``empty``
included), ``predicted_prefill_tokens_bounded`` (per mode),
``radix_prefill_tokens_bounded``, ``oracle_prefill_tokens_bounded`` (references under
the engine's LRU cache, not bounds: the oracle floored per request by each mode's LRU
radix on its own prompts, as the unbounded oracle is by the radix ideal),
``bound_capacity_blocks`` and ``bound_capacity_raised`` (a request longer than the
engine's cache, which no engine of that size runs, raises the capacity to fit the
longest request rather than failing the bench).  A suite report::

    {"suite": {...}, "families": {FAMILY: {"trace", "shape", "blocks": {"16": REPORT, ...}}
                                  | {"error": str}},
     "worst": {"16": {POLICY: {"gap_closed", "family"}, "cached_margin": {...}}, ...},
     "failed": {FAMILY: str}, "default_policy": POLICY}
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from promptsplice._validate import check_enum
from promptsplice.assembler import AlignPolicy, Assembler, PrefixCacheMirror, load_tokenizer
from promptsplice.benchmarks._stats import percentile
from promptsplice.benchmarks.bounds import (
    BOUND_EXIT,
    BoundError,
    OracleCounter,
    RadixPrefill,
    bound_checks,
    check_bounds,
    floor_per_request,
)
from promptsplice.benchmarks.traces import (
    SUITE,
    RagRequest,
    read_rag_trace,
    shape_stats,
    suite_trace_dir,
    write_rag_trace,
)
from promptsplice.blocks import chain_hashes, content_digest, token_bytes
from promptsplice.errors import ConfigError

__all__ = [
    "POLICIES",
    "ENGINE_CACHE_TOKENS",
    "bench_policies",
    "bench_suite",
    "bound_status",
    "run_assemble_bench",
    "run_suite_bench",
    "suite_reports",
    "format_table",
    "format_suite_table",
    "gap_closed",
]

POLICIES = ("retrieval", "stable", "cache_aware")
ENGINE_CACHE_TOKENS = 727 * 32
"""The embedded engine's default KV cache in bf16 (512 MiB: 728 blocks of 32 tokens for
SmolLM2-135M, 727 of them usable: vLLM reserves the null block): the capacity of the
``*_bounded`` figures, bounds and modes alike.  Fixed, so the figures compare across
machines; where ``dtype="auto"`` picks float32 (no AVX-512 BF16, or AMX tiles) the same
512 MiB hold half as many blocks (363 usable)."""




def _chunks(req: RagRequest) -> list[dict[str, Any]]:
    return [{"id": c.id, "text": c.text, "metadata": c.metadata} for c in req.chunks]


def _bound_capacity(naive_asm: Assembler, requests: Sequence[RagRequest], block_size: int) -> tuple[int, bool]:
    """The ``*_bounded`` capacity in blocks and whether it was raised: the engine's
    default cache, or, when a request would not fit it (a long-context trace), enough for
    the longest request of any mode (its naive tokens plus a block per segment for
    alignment and separators), since no engine of the default size runs such a trace."""
    default = max(1, ENGINE_CACHE_TOKENS // block_size)
    cap_tokens = default * block_size

    def slack(req: RagRequest) -> int:
        return (len(req.chunks) + 3) * (block_size + 8)

    # a token is at least one byte: most traces are settled without tokenizing
    if all(
        sum(len(c.text.encode()) for c in req.chunks) + len(req.query.encode()) + len((req.system or "").encode())
        + slack(req) + 64 <= cap_tokens
        for req in requests
    ):
        return default, False
    longest = max(
        len(naive_asm.naive(_chunks(req), query=req.query, system=req.system or None).token_ids) + slack(req)
        for req in requests
    )
    need = -(-longest // block_size) + 1
    return (need, True) if need > default else (default, False)


def _metrics(
    n: int, prompt: int, padding: int, removed: int, cached: int, times_ms: list[float],
    removed_chunks: dict[str, int] | None = None,
) -> dict[str, Any]:
    return {
        "requests": n,
        "prompt_tokens": prompt,
        "padding_tokens": padding,
        "dedup_removed_bytes": removed,
        # chunks dedup removed, by reason: an empty chunk removes no bytes, and was counted nowhere
        "dedup_removed_chunks": dict(removed_chunks or {}),
        "predicted_cached_tokens": cached,
        "predicted_prefill_tokens": prompt - cached,
        "predicted_hit_rate": round(cached / prompt, 6) if prompt else 0.0,
        "assemble_p50_ms": round(percentile(times_ms, 0.50), 4),
        "assemble_p99_ms": round(percentile(times_ms, 0.99), 4),
    }


def gap_closed(naive: int, policy: int, oracle: int) -> float | None:
    """Share of the naive -> oracle prefill gap that ``policy`` closes.  With no gap
    (naive at the oracle): ``None``, unless ``policy`` prefilled more than naive, then
    minus the share of naive's prefill it added (a loss the worst-family ranking sees)."""
    if naive <= oracle:
        return round((naive - policy) / max(naive, 1), 4) if policy > naive else None
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
    alignment = _alignment(alignment)
    tok = load_tokenizer(tokenizer)
    report: dict[str, Any] = {"policies": {}}
    # naive + the bounds (same tokenizer, same separators)
    naive_asm = Assembler(tok, block_size=block_size, capacity_blocks=capacity_blocks)  # checks block_size
    raised = False
    if capacity_blocks is not None:
        cap_blocks = capacity_blocks
    else:
        cap_blocks, raised = _bound_capacity(naive_asm, requests, block_size)
    cap_tokens = cap_blocks * block_size
    naive_mirror = PrefixCacheMirror(block_size, capacity_blocks)
    oracle_asm = Assembler(tok, block_size=block_size, policy="retrieval", alignment="none",
                           capacity_blocks=None, token_cache=naive_asm.token_cache)
    radix, radix_b = RadixPrefill(), RadixPrefill(cap_tokens)
    oracle, oracle_b = OracleCounter(), OracleCounter(cap_tokens)
    content: list[int] = []  # the oracle's content bound per request
    content_b: list[int] = []  # the same under the bounded capacity
    per_mode: list[list[int]] = []  # each mode's radix ideal per request, on its own prompts
    naive_radix: list[int] = []
    naive_radix_b: list[int] = []  # the same under the bounded capacity
    naive_runs: list[tuple[list[Any], int]] = []
    times: list[float] = []
    prompt = cached = 0
    for req in requests:
        t0 = time.perf_counter()
        naive = naive_asm.naive(_chunks(req), query=req.query, system=req.system or None)
        times.append((time.perf_counter() - t0) * 1e3)
        hashes = chain_hashes(naive.token_ids, block_size)
        naive_runs.append((hashes, len(naive.token_ids)))
        pred = naive_mirror.admit(hashes, len(naive.token_ids))
        prompt += len(naive.token_ids)
        cached += pred.cached_tokens
        naive_radix.append(radix.add(naive.token_ids))
        naive_radix_b.append(radix_b.add(naive.token_ids))
        segs = _oracle_segments(oracle_asm, req)
        content.append(oracle.add(segs))
        content_b.append(oracle_b.add(segs))
    per_mode.append(naive_radix)
    report["policies"]["naive"] = _metrics(len(requests), prompt, 0, 0, cached, times)
    report["policies"]["naive"]["own_radix_prefill_tokens"] = sum(naive_radix)

    for name in policies:
        metrics, own_radix = _run_policy(tok, requests, block_size, name, alignment, capacity_blocks)
        metrics["own_radix_prefill_tokens"] = sum(own_radix)  # its bound when above the oracle
        report["policies"][name] = metrics
        per_mode.append(own_radix)
    per_mode_b = [naive_radix_b]  # each mode's LRU radix on the prompts it sent under the bounded capacity
    if capacity_blocks is None:
        # the same modes under the capacity of the *_bounded bounds: like for like
        mirror = PrefixCacheMirror(block_size, cap_blocks)
        report["policies"]["naive"]["predicted_prefill_tokens_bounded"] = sum(
            n - mirror.admit(h, n).cached_tokens for h, n in naive_runs
        )
        for name in policies:
            metrics, own_radix_b = _run_policy(tok, requests, block_size, name, alignment, cap_blocks, cap_tokens)
            report["policies"][name]["predicted_prefill_tokens_bounded"] = metrics["predicted_prefill_tokens"]
            per_mode_b.append(own_radix_b)

    floor = floor_per_request(content, *per_mode)
    report["radix_prefill_tokens"] = radix.prefill_tokens
    report["oracle_prefill_tokens"] = floor
    report["oracle_content_prefill_tokens"] = oracle.prefill_tokens
    report["radix_prefill_tokens_bounded"] = radix_b.prefill_tokens
    # floored per request like the unbounded oracle, by each mode's radix under the same
    # LRU capacity: a chunk's last token can merge with the next segment's first in a
    # mode's prompt ("word " + "Q?"), one token under the segment-wise content bound
    report["oracle_prefill_tokens_bounded"] = floor_per_request(content_b, *per_mode_b)
    report["bound_capacity_blocks"] = cap_blocks
    report["bound_capacity_raised"] = raised
    report["block_size"] = block_size
    report["alignment"] = alignment
    report["tokenizer"] = tok.name
    naive_prefill = report["policies"]["naive"]["predicted_prefill_tokens"]
    report["gap_closed"] = {
        name: gap_closed(naive_prefill, m["predicted_prefill_tokens"], floor)
        for name, m in report["policies"].items()
        if name != "naive"
    }
    best = min(
        (n for n in report["policies"] if n != "naive"),
        key=lambda n: report["policies"][n]["predicted_prefill_tokens"],
        default=None,
    )
    report["best_policy"] = best
    report["bound_checks"] = policy_bounds(report)
    return report


def _alignment(alignment: str) -> str:
    """The alignment policy's canonical name (``"ALL"`` and ``" all"`` ran as ``all`` and
    were reported as typed)."""
    return check_enum(alignment, AlignPolicy, "alignment").value


def _run_policy(
    tok: Any, requests: Sequence[RagRequest], block_size: int, name: str, alignment: str, capacity_blocks: int | None,
    radix_tokens: int | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """One policy over ``requests`` on a mirror of ``capacity_blocks`` (None: unbounded):
    its metrics and the radix ideal of its own prompts, per request (an LRU radix of
    ``radix_tokens`` when given)."""
    asm = Assembler(tok, block_size=block_size, policy=name, alignment=alignment, capacity_blocks=capacity_blocks)
    times: list[float] = []
    prompt = cached = padding = removed = 0
    removed_chunks: dict[str, int] = {}
    own, own_radix = RadixPrefill(radix_tokens), []
    for req in requests:
        t0 = time.perf_counter()
        res = asm.assemble(_chunks(req), query=req.query, system=req.system or None)
        times.append((time.perf_counter() - t0) * 1e3)
        own_radix.append(own.add(res.token_ids))
        prompt += res.num_tokens
        cached += res.predicted_cached_tokens
        padding += res.padding_tokens
        removed += res.dedup.stats.removed_bytes_total
        for reason, count in res.dedup.stats.removed.items():
            removed_chunks[reason] = removed_chunks.get(reason, 0) + count
    return _metrics(len(requests), prompt, padding, removed, cached, times, removed_chunks), own_radix


def policy_bounds(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each policy's lower bound on predicted prefill, as ``bench rag`` reports them:
    ``naive`` the radix ideal of its prompts, every policy the oracle.  (The ``*_bounded``
    figures are references under an LRU cache, not bounds: LRU is not the best eviction,
    so a mode may prefill less; they are not checked.)"""
    return bound_checks({name: m["predicted_prefill_tokens"] for name, m in report["policies"].items()},
                        radix=report["radix_prefill_tokens"], oracle=report["oracle_prefill_tokens"],
                        own_radix={name: m["own_radix_prefill_tokens"] for name, m in report["policies"].items()
                                   if "own_radix_prefill_tokens" in m})


def bound_status(reports: dict[str, dict[str, Any]]) -> int:
    """0, or ``BOUND_EXIT`` (printed) when a policy predicted less than its bound."""
    import sys

    rc = 0
    for what, report in reports.items():
        try:
            check_bounds(report["bound_checks"], what=what)
        except BoundError as exc:
            print(f"promptsplice: error: {exc}", file=sys.stderr)
            rc = BOUND_EXIT
    return rc


def _oracle_segments(asm: Assembler, req: RagRequest) -> list[tuple[bytes, list[int]]]:
    """The segments an assembly sends for ``req`` (system, the chunks dedup keeps after
    trimming, the query), each as (content digest, its tokens), unpadded."""
    res = asm.preview(_chunks(req), query=req.query, system=req.system or None)
    out = []
    for seg in res.segments:
        toks = res.token_ids[seg.start : seg.content_end]
        out.append((content_digest(token_bytes(toks)), toks))
    return out


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
        f"oracle prefill {report['oracle_prefill_tokens']}; under the engine's cache "
        f"({report['bound_capacity_blocks']} blocks, LRU"
        f"{', raised to fit the longest request' if report.get('bound_capacity_raised') else ''}): radix {report['radix_prefill_tokens_bounded']}, "
        f"oracle {report['oracle_prefill_tokens_bounded']} "
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
    return bound_status({"bench assemble": report})


# --------------------------------------------------------------------------- the suite


def _summarize(report: dict[str, Any], policies: Sequence[str], default: str) -> None:
    """Fill ``worst`` (per block size: each policy's worst family by gap closed, and the
    worst margin of ``default`` over the better of retrieval and stable, in cached
    tokens and in prefill tokens saved: ``prefill_margin``, the one that does not count
    padding) and ``default_policy`` (the policy whose worst family is best)."""
    worst: dict[str, Any] = {}
    for bs in report["suite"]["block_sizes"]:
        key = str(bs)
        row: dict[str, Any] = {}
        ok = {f: e["blocks"][key] for f, e in report["families"].items() if "blocks" in e}
        for pol in policies:
            gaps = [(r["gap_closed"].get(pol), f) for f, r in ok.items() if r["gap_closed"].get(pol) is not None]
            g, f = min(gaps, default=(None, None))
            row[pol] = {"gap_closed": g, "family": f}
        margins, prefill_margins = [], []
        for f, r in ok.items():
            pol = r["policies"]
            if default in pol and "retrieval" in pol and "stable" in pol:
                base = max(pol["retrieval"]["predicted_cached_tokens"], pol["stable"]["predicted_cached_tokens"])
                margins.append((pol[default]["predicted_cached_tokens"] - base, f))
                # in prefill: cached tokens count a policy's own padding (a padded block
                # that hits), so the cached margin credited extra padding as a win
                least = min(pol["retrieval"]["predicted_prefill_tokens"], pol["stable"]["predicted_prefill_tokens"])
                prefill_margins.append((least - pol[default]["predicted_prefill_tokens"], f))
        m, f = min(margins, default=(None, None))
        row["cached_margin"] = {"policy": default, "tokens": m, "family": f}
        m, f = min(prefill_margins, default=(None, None))
        row["prefill_margin"] = {"policy": default, "tokens": m, "family": f}
        worst[key] = row
    report["worst"] = worst
    # each policy's gaps over every family and block size, worst first: the policy whose
    # worst family is best wins, a tie goes to the next-worst family (not list order)
    gaps = {
        pol: sorted(
            r["gap_closed"][pol]
            for e in report["families"].values() if "blocks" in e
            for r in e["blocks"].values() if r["gap_closed"].get(pol) is not None
        )
        for pol in policies
    }
    ranked = [p for p in policies if gaps[p]]
    report["default_policy"] = max(ranked, key=lambda p: gaps[p]) if ranked else None


def bench_suite(
    *,
    families: Sequence[str] = SUITE,
    traces: Sequence[str | Path] = (),
    requests: int | None = None,
    seed: int = 0,
    block_sizes: Sequence[int] = (16, 32),
    tokenizer: Any = "default",
    alignment: str = "auto",
    trace_dir: str | Path,
    default_policy: str = "cache_aware",
) -> dict[str, Any]:
    """Every family (and every extra trace file) at every block size (module docstring).
    ``requests``: generated per family (default 200), and the first N of each extra file
    (default: the whole file; a file cut silently to the families' count was a user's
    trace benched in part)."""
    per_family = 200 if requests is None else requests
    alignment = _alignment(alignment)
    if not block_sizes:
        raise ConfigError("block_sizes must name at least one block size, e.g. 16,32")
    out_dir = suite_trace_dir(trace_dir, families, traces)
    tok = load_tokenizer(tokenizer)
    report: dict[str, Any] = {
        "suite": {"families": list(families), "traces": [str(t) for t in traces], "requests": per_family,
                  "seed": seed, "block_sizes": list(block_sizes), "tokenizer": tok.name,
                  "alignment": alignment},
        "families": {},
        "failed": {},
    }
    jobs: list[tuple[str, Path, bool]] = [(f, out_dir / f"{f}.jsonl", True) for f in families]
    jobs += [(f"file:{Path(t).stem}", Path(t), False) for t in traces]
    for name, path, generate in jobs:
        try:
            if generate:
                write_rag_trace(path, requests=per_family, seed=seed, family=name)
            reqs = read_rag_trace(path, limit=per_family if generate else requests)
            entry: dict[str, Any] = {"trace": str(path), "shape": shape_stats(reqs), "blocks": {}}
            for bs in block_sizes:
                entry["blocks"][str(bs)] = bench_policies(reqs, tokenizer=tok, block_size=bs, alignment=alignment)
        except Exception as exc:  # noqa: BLE001 - any family's failure is reported, the others still run
            report["failed"][name] = f"{type(exc).__name__}: {exc}"
            report["families"][name] = {"error": report["failed"][name]}
            continue
        report["families"][name] = entry
    _summarize(report, POLICIES, default_policy)
    return report


def format_suite_table(report: dict[str, Any]) -> str:
    """One row per family and block size: prefill tokens and gap closed per policy, the
    bounds; then the worst family per policy."""
    lines = [
        "| family | block | naive | retrieval | stable | cache_aware | oracle | radix | naive (cache) | "
        "cache_aware (cache) | oracle (cache) | radix (cache) | gap retrieval | gap stable | gap cache_aware |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fam, entry in report["families"].items():
        if "error" in entry:
            lines.append(f"| {fam} | failed: {entry['error']} |")
            continue
        for bs, r in entry["blocks"].items():
            p = r["policies"]
            gaps = " | ".join(
                "-" if r["gap_closed"].get(n) is None else f"{r['gap_closed'][n]:.2f}" for n in POLICIES
            )
            lines.append(
                f"| {fam} | {bs} | {p['naive']['predicted_prefill_tokens']} | "
                + " | ".join(str(p[n]["predicted_prefill_tokens"]) for n in POLICIES)
                + f" | {r['oracle_prefill_tokens']} | {r['radix_prefill_tokens']} | "
                f"{p['naive'].get('predicted_prefill_tokens_bounded', '-')} | "
                f"{p['cache_aware'].get('predicted_prefill_tokens_bounded', '-')} | "
                f"{r['oracle_prefill_tokens_bounded']} | {r['radix_prefill_tokens_bounded']} | {gaps} |"
            )
    for bs, row in report["worst"].items():
        cells = []
        for n in POLICIES:
            g = row[n]["gap_closed"]
            cells.append("-" if g is None else f"{g:.2f} ({row[n]['family']})")
        lines.append(f"| **worst** | {bs} | | | | | | | | | | | " + " | ".join(cells) + " |")
    lines.append(f"default policy by the worst family: {report['default_policy']}")
    for bs, row in report["worst"].items():
        m = row["cached_margin"]
        lines.append(
            f"block {bs}: {m['policy']} minus the better of retrieval and stable, cached tokens, "
            f"worst family: {m['tokens']} ({m['family']})"
        )
    if report["failed"]:
        lines.append("failed: " + "; ".join(f"{k}: {v}" for k, v in report["failed"].items()))
    return "\n".join(lines)


def run_suite_bench(
    *,
    json_out: str | Path,
    families: Sequence[str] | None = None,
    traces: Sequence[str | Path] = (),
    requests: int | None = None,
    seed: int = 0,
    block_sizes: Sequence[int] = (16, 32),
    tokenizer: str = "default",
    alignment: str = "auto",
    trace_dir: str | Path | None = None,
) -> int:
    """``promptsplice bench assemble --suite``: prints the table, writes the JSON; exit
    status ``BOUND_EXIT`` when a policy predicted less than its bound, else 1 when a
    family failed (the others are reported, the failures on stderr too).  A user's
    ``traces`` file that does not read fails first, as ``--trace`` without ``--suite``
    (one line, exit 2)."""
    for t in traces:
        read_rag_trace(t, limit=requests)
    out = Path(json_out)
    report = bench_suite(
        families=SUITE if families is None else families,
        traces=traces,
        requests=requests,
        seed=seed,
        block_sizes=block_sizes,
        tokenizer=tokenizer,
        alignment=alignment,
        trace_dir=trace_dir if trace_dir is not None else out.with_name(out.stem + "-traces"),
    )
    print(format_suite_table(report))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    rc = bound_status(suite_reports(report, "bench assemble --suite"))
    if report["failed"]:
        print("promptsplice: error: failed families: " + "; ".join(f"{k}: {v}" for k, v in report["failed"].items()),
              file=sys.stderr)
    return rc or (1 if report["failed"] else 0)


def suite_reports(report: dict[str, Any], what: str) -> dict[str, dict[str, Any]]:
    """A suite report's per-family, per-block-size reports, named for error messages."""
    return {
        f"{what} ({name}, block {bs})": rep
        for name, fam in report["families"].items()
        for bs, rep in fam.get("blocks", {}).items()
    }
