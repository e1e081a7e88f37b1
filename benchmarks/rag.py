"""``promptsplice bench rag``: a RAG trace through the embedded vLLM engine, judged by vLLM.

Two modes run the same requests on the same engine, each from an empty prefix cache:

* ``naive``: what user code does today: the retrieved chunks in retrieval order, no
  dedup, joined as plain text and sent as text (vLLM tokenizes it);
* ``promptsplice``: :class:`promptsplice.assembler.Assembler` with the engine's block size and a
  mirror as large as the engine's KV cache, sent as token ids.

``cached_tokens`` is vLLM's own ``num_cached_tokens`` per request (summed), and
``prefill_tokens = prompt_tokens - cached_tokens``.  The mirror block compares what the
assembler predicted with what vLLM measured (they are equal when nothing else uses the
engine).  The bounds are those of :mod:`promptsplice.benchmarks.bounds`, with the engine's tokenizer.

JSON (names fixed)::

    {"modes": {"naive": M, "promptsplice": M},
     "mirror": {"predicted_cached_tokens", "measured_cached_tokens"},
     "radix_prefill_tokens": int, "oracle_prefill_tokens": int, ...}
    M = {"requests", "prompt_tokens", "prefill_tokens", "cached_tokens", "hit_rate",
         "wall_s", "ttft_p50_ms", "ttft_p99_ms"}

With a second engine that runs the splice connector (``kv_engine``; the CLI always
starts one), a third mode ``promptsplice_pic`` runs the same requests through
:class:`promptsplice.engine_adapters.RagRunner` in mode ``position_independent``: after the prefix
hit, every chunk computed before anywhere is relocated from the block store (new
chunks are precomputed exactly, then relocated too).  Its ``prefill_tokens`` count
every token the engine computed for a request (the precompute included), ``cached =
prompt - prefill``, ``wall_s`` and TTFTs cover all its engine requests.  Beside it::

    "pic": {"relocated_tokens", "precomputed_tokens", "engine_requests",
            "recompute_blocks", "gap_closed", "kv_cache_blocks", "store_dram_bytes"},
    "fidelity": {"tf_top1_agreement", "first_token_kl", "greedy_agreement", "steps",
                 "first_token_kl_p50", "first_token_kl_p90", "first_token_kl_max",
                 "first_token_kl_ci95", "tf_top1_p50", "tf_top1_p10", "tf_top1_min",
                 "tf_top1_ci95", "requested", "control": {...}}

Fidelity (:mod:`promptsplice.benchmarks.fidelity`) is measured on requests whose plan
relocates chunks (32 by default), spread over the trace, against a one-pass exact
prefill of the same tokens; the control is a second exact prefill of them whose first
half came from the prefix cache.  Each probed request must have relocated what its
plan did and each probe request must be served its KV from the cache, else
:class:`~promptsplice.benchmarks.fidelity.FidelityError` fails the bench.  Probes run
after a request's timing and are not counted in any mode.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.assemble import _chunks, _oracle_segments, gap_closed
from promptsplice.benchmarks.bounds import OracleCounter, RadixPrefill
from promptsplice.benchmarks.fidelity import (
    DEFAULT_PROBES,
    PROBE_TOKENS,
    Fidelity,
    FidelityError,
    full_blocks,
    reference,
    verify_step,
)
from promptsplice.benchmarks.traces import RagRequest, read_rag_trace

__all__ = ["run_modes", "run_rag_bench", "format_modes", "MODES", "PIC_MODE"]

MODES = ("naive", "promptsplice")
PIC_MODE = "promptsplice_pic"


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _mode_metrics(completions: list[Any], wall: float) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in completions)
    cached = sum(c.num_cached_tokens for c in completions)
    return _metrics(len(completions), prompt, cached, [c.ttft_s * 1e3 for c in completions], wall)


def _metrics(n: int, prompt: int, cached: int, ttfts: list[float], wall: float) -> dict[str, Any]:
    return {
        "requests": n,
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
    kv_engine: Any = None,
    recompute_blocks: int | None = None,
    fidelity_requests: int = DEFAULT_PROBES,
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Run naive then promptsplice on ``engine`` (then ``promptsplice_pic`` on
    ``kv_engine`` when given); returns (report, completions by mode).

    All modes render the same pieces with the same :class:`promptsplice.assembler.PromptFormat`
    (default: ChatML, the default model's chat format).  Fidelity probes need both
    engines started with ``extra_kwargs={"max_logprobs": -1}``.
    """
    from promptsplice.assembler import PromptFormat

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
        prompt = asm.assemble(_chunks(req), query=req.query, system=req.system or None)
        comp = engine.generate(prompt, max_tokens=max_tokens)
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
        oracle.add(_oracle_segments(asm, req))  # the trimmed segments (a preview: learns nothing)
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
    if kv_engine is not None:
        _run_pic(
            report, outs, engine, kv_engine, requests, policy=policy, max_tokens=max_tokens,
            progress=progress, prompt_format=fmt_obj, recompute_blocks=recompute_blocks,
            fidelity_requests=fidelity_requests,
        )
    return report, outs


def _run_pic(report, outs, engine, kv_engine, requests, *, policy, max_tokens, progress,
             prompt_format, recompute_blocks, fidelity_requests, precompute="packed",
             salt="bench-rag-pic") -> None:
    """The ``promptsplice_pic`` mode and its fidelity (module doc)."""
    from promptsplice.engine_adapters import RagRunner
    from promptsplice.engine_adapters.runners._rag import DEFAULT_PIC_RECOMPUTE_BLOCKS

    r = DEFAULT_PIC_RECOMPUTE_BLOCKS if recompute_blocks is None else recompute_blocks
    kv_engine.reset_prefix_cache()
    runner = RagRunner(
        kv_engine, mode="position_independent", salt=salt, recompute_blocks=r,
        policy=policy, prompt_format=prompt_format, precompute=precompute,
    )
    fid, ctl = Fidelity(), Fidelity()
    steps = []
    n = len(requests)
    for i, req in enumerate(requests):
        st = runner.run(_chunks(req), query=req.query, system=req.system or None, max_tokens=max_tokens)
        steps.append(st)
        if progress:
            progress(PIC_MODE, 1)
        # Requests whose plan relocates, spread over the trace: probe while behind the
        # pro-rata quota (a stretch without relocation is caught up after it).
        if st.planned_relocated_tokens and len(fid.tf) < min(fidelity_requests, fidelity_requests * (i + 1) / n + 0.5):
            _probe_pic(engine, kv_engine, st, runner.reuse_salt, fid, ctl, f"request {i}")
    prompt = sum(st.prompt_tokens for st in steps)
    prefill = sum(st.prefill_tokens for st in steps)
    report["modes"][PIC_MODE] = _metrics(
        len(steps), prompt, prompt - prefill, [st.ttft_s * 1e3 for st in steps], sum(st.wall_s for st in steps)
    )
    outs[PIC_MODE] = [st.completion for st in steps]
    store = kv_engine.kv_store
    report["pic"] = {
        "relocated_tokens": sum(st.relocated_tokens for st in steps),
        "precomputed_tokens": sum(st.precomputed_tokens for st in steps),
        "engine_requests": sum(st.requests for st in steps),
        "recompute_blocks": r,
        "gap_closed": gap_closed(report["modes"]["naive"]["prefill_tokens"], prefill, report["oracle_prefill_tokens"]),
        "kv_cache_blocks": kv_engine.num_blocks,
        "store_dram_bytes": store.config.dram_bytes,
    }
    report["fidelity"] = {**fid.report(), "control": ctl.report(), "tokens": PROBE_TOKENS,
                          "requested": fidelity_requests}


def _probe_pic(engine: Any, kv_engine: Any, step: Any, salt: str, fid: Fidelity, ctl: Fidelity,
               what: str = "request") -> None:
    """Fidelity of one request's relocated KV (reached through ``salt`` on ``kv_engine``)
    and of the control (exact, half of it from the prefix cache) on ``engine``.  The
    request must have relocated what its plan did and every probe must be served its
    KV (else :class:`~promptsplice.benchmarks.fidelity.FidelityError`)."""
    verify_step(step, f"{PIC_MODE} {what}")
    tokens = list(step.prompt.token_ids)
    cont, p_ref = reference(engine, tokens)
    if not cont:
        return
    need = full_blocks(kv_engine, tokens)
    out = kv_engine.generate(tokens, max_tokens=PROBE_TOKENS, cache_salt=salt)
    if out.num_cached_tokens < need:
        raise FidelityError(f"{PIC_MODE} {what}: the greedy probe was served {out.num_cached_tokens} "
                            f"cached tokens of the {need} the relocated KV covers")
    fid.measure(kv_engine, tokens, cont, p_ref, salt, out.token_ids, need_cached=need)
    c_salt = f"control:{uuid.uuid4().hex}"
    half = max(engine.block_size, (len(tokens) // 2) // engine.block_size * engine.block_size)
    engine.generate(tokens[:half], max_tokens=1, cache_salt=c_salt)
    greedy = engine.generate(tokens, max_tokens=PROBE_TOKENS, cache_salt=c_salt).token_ids
    ctl.measure(engine, tokens, cont, p_ref, c_salt, greedy)


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
    if PIC_MODE in report["modes"]:
        q = report["modes"][PIC_MODE]
        for i, (name, key) in enumerate((
            ("tokens prefilled", "prefill_tokens"), ("wall time (s)", "wall_s"),
            ("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p99 (ms)", "ttft_p99_ms"),
        )):
            lines[1 + [r[0] for r in rows].index(name)] += f"  {q[key]!s:>12}"
        lines[0] += f"  {PIC_MODE:>16}"
    gap = report["gap_closed"]
    lines.append(
        f"bounds on prefill: radix ideal {report['radix_prefill_tokens']}, oracle "
        f"{report['oracle_prefill_tokens']}; promptsplice closes "
        f"{'n/a' if gap is None else f'{gap:.0%}'} of the naive->oracle gap. Mirror "
        f"predicted {report['mirror']['predicted_cached_tokens']} cached tokens, vLLM "
        f"measured {report['mirror']['measured_cached_tokens']} "
        f"(block {report['block_size']}, {report['policy']}, alignment {report['alignment']})"
    )
    if PIC_MODE in report["modes"]:
        p, f = report["pic"], report["fidelity"]
        c = f["control"]
        pg = p["gap_closed"]
        lines.append(
            f"{PIC_MODE} (recompute_blocks={p['recompute_blocks']}): closes "
            f"{'n/a' if pg is None else f'{pg:.0%}'} of the gap; relocated {p['relocated_tokens']} tokens, "
            f"precomputed {p['precomputed_tokens']}, {p['engine_requests']} engine requests"
        )
        lines.append(
            f"fidelity over {f['steps']} verified requests: tf-top1 {f['tf_top1_agreement']} {f['tf_top1_ci95']} "
            f"(p10 {f['tf_top1_p10']}) KL {f['first_token_kl']} {f['first_token_kl_ci95']} (p50 "
            f"{f['first_token_kl_p50']}, p90 {f['first_token_kl_p90']}, max {f['first_token_kl_max']}) greedy "
            f"{f['greedy_agreement']} | control tf-top1 {c['tf_top1_agreement']} KL {c['first_token_kl']} "
            f"greedy {c['greedy_agreement']}"
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
    recompute_blocks: int | None = None,
    fidelity_requests: int = DEFAULT_PROBES,
) -> int:
    from promptsplice.assembler import AlignPolicy, OrderPolicy
    from promptsplice.benchmarks.agent import start_engines
    from promptsplice.errors import ConfigError

    OrderPolicy.parse(policy)  # fail fast, before the engine starts
    AlignPolicy.parse(alignment)
    if recompute_blocks is not None and recompute_blocks < 0:
        raise ConfigError(f"--recompute-blocks must be >= 0, got {recompute_blocks}")
    reqs = read_rag_trace(trace, limit=requests)
    engine, kv_engine = start_engines()
    try:
        report, _ = run_modes(
            engine, reqs, policy=policy, alignment=alignment, max_tokens=max_tokens, kv_engine=kv_engine,
            recompute_blocks=recompute_blocks, fidelity_requests=fidelity_requests,
        )
    finally:
        kv_engine.close()
        engine.close()
    report["trace"] = str(trace)
    print(format_modes(report))
    Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {json_out}")
    return 0
