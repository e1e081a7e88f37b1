"""``promptsplice bench agent``: agent sessions in three engine modes, with bounds and
measured fidelity.

Every session of an agent trace (:mod:`promptsplice.benchmarks.agent_traces`) is replayed step by
step through :class:`promptsplice.assembler.ContextHook` (the renders already hold the agent's own
edits, so the hook runs without policies) and :class:`promptsplice.engine_adapters.AgentRunner` in
each mode: ``full`` (no cache) and ``apc`` (vLLM's prefix cache) on one engine,
``splice`` on a second engine started with the splice connector (its store saves add
their cost to ``splice``, never to the others).  Modes use different tenant salts, so
none reads another's cache.  The steps of a session run interleaved: ``full``, ``apc``,
``splice``, then the fidelity probes of that step when it is sampled.

Bounds reported beside the modes:

* ``ideal_prefill_tokens``: message-level reuse: per step, a segment is free when the
  same message (same rendered text and padding) was in the session's previous render or
  lies in the prefix the ``apc`` run served from its cache; everything else is
  prefilled, with the renderer's block alignment.
* per edit kind (:func:`promptsplice.benchmarks.agent_traces.classify_step`) the steps and each
  mode's prefill, so users see where splicing pays (deep edits) and where it cannot
  (an edit of the last message leaves nothing to relocate).

Fidelity (edit steps that relocate KV, at least 32 by default, sampled across edit
kinds and depths: :func:`probe_ranks`; each probe verified to have measured relocated
KV, :func:`promptsplice.benchmarks.fidelity.verify_step`; measured on the real model against a one-pass full
prefill ``R`` of the same render with 32 greedy tokens ``c``): teacher-forced top-1
agreement (the context plus ``c[:k]`` predicts ``c[k]``, k < 32), the KL divergence
``KL(R || mode)`` of the first-token distributions over the whole vocabulary (nats),
and greedy agreement (the mode's own 32 greedy tokens: the fraction equal to ``c``
before the first divergence).  ``control`` measures ``apc`` the same way: exact KV that
differs from ``R`` only by bf16 rounding (cached vs one-pass attention).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.agent_traces import AgentSession, classify_step, edit_depth, read_agent_trace
from promptsplice.benchmarks.fidelity import (
    DEFAULT_PROBES,
    FIDELITY_FIELDS,
    PROBE_TOKENS,
    Fidelity,
    full_blocks,
    reference,
    verify_step,
)

__all__ = ["MODE_FIELDS", "FIDELITY_FIELDS", "run_agent_modes", "run_agent_bench", "format_agent", "probe_ranks"]

_log = logging.getLogger(__name__)

MODES = ("full", "apc", "splice")
MODE_FIELDS = (
    "steps",
    "prompt_tokens",
    "prefill_tokens",
    "cached_tokens",
    "relocated_tokens",
    "hit_rate",
    "wall_s",
    "ttft_p50_ms",
    "edit_steps_prefill_tokens",
    "edit_steps_ttft_p50_ms",
)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _Totals:
    def __init__(self) -> None:
        self.steps = 0
        self.prompt = self.prefill = self.cached = self.relocated = 0
        self.wall = 0.0
        self.ttft: list[float] = []
        self.edit_prefill = 0
        self.edit_ttft: list[float] = []

    def add(self, st: Any, edit: bool) -> None:
        self.steps += 1
        self.prompt += st.prompt_tokens
        self.prefill += st.prefill_tokens
        self.cached += st.cached_tokens
        self.relocated += st.relocated_tokens
        self.wall += st.wall_s
        self.ttft.append(st.ttft_s)
        if edit:
            self.edit_prefill += st.prefill_tokens
            self.edit_ttft.append(st.ttft_s)

    def report(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt,
            "prefill_tokens": self.prefill,
            "cached_tokens": self.cached,
            "relocated_tokens": self.relocated,
            "hit_rate": round(1 - self.prefill / self.prompt, 4) if self.prompt else 0.0,
            "wall_s": round(self.wall, 3),
            "ttft_p50_ms": round(_pct(self.ttft, 0.5) * 1e3, 2),
            "edit_steps_prefill_tokens": self.edit_prefill,
            "edit_steps_ttft_p50_ms": round(_pct(self.edit_ttft, 0.5) * 1e3, 2),
        }


def _ideal_step(render: Any, prev: Any, apc_cached: int) -> int:
    """Prefill of message-level reuse for one step (see the module doc)."""
    seen = set()
    if prev is not None:
        seen = {(s.key, s.padding) for s in prev.body_segments}
    out = 0
    for seg in render.segments:
        if seg.end <= apc_cached:
            continue
        if (seg.key, seg.padding) in seen:
            continue
        out += seg.end - max(seg.start, apc_cached)
    return out


def _depth_bucket(messages_after: int) -> str:
    """Depth of an edit: messages from the first changed one to the end, in powers of 2."""
    for hi, name in ((1, "1"), (3, "2-3"), (7, "4-7")):
        if messages_after <= hi:
            return name
    return "8+"


def _spread(n: int) -> list[int]:
    """0..n-1 in an order that spreads any prefix over the range (bisection order)."""
    out: list[int] = []
    seen: set[int] = set()
    parts = 1
    while len(out) < n:
        for j in range(parts):
            i = min(n - 1, (2 * j + 1) * n // (2 * parts))
            if i not in seen:
                seen.add(i)
                out.append(i)
        parts *= 2
        if parts > 2 * n:
            out += [i for i in range(n) if i not in seen]
    return out


def probe_ranks(sessions: Sequence[AgentSession]) -> dict[tuple[int, int], tuple[int, str]]:
    """The probe order of every edit step, ``(session index, step) -> (rank, stratum)``.

    Strata are (edit kind, depth: messages from the first changed one to the end of the
    render, 1 / 2-3 / 4-7 / 8+); rank ``r`` takes the ``r // strata``-th pick of each
    stratum in turn, each stratum's picks spread over its steps.  The bench probes the
    steps of lowest rank that relocate KV (a step that relocates nothing is not
    approximate and passes its turn to the next rank)."""
    strata: dict[str, list[tuple[int, int]]] = {}
    for si, sess in enumerate(sessions):
        for i, rnd in enumerate(sess.renders):
            prev = sess.renders[i - 1] if i else None
            kind = classify_step(prev, rnd)
            if kind in ("first", "append"):
                continue
            label = f"{kind}/{_depth_bucket(len(rnd) - edit_depth(prev, rnd))}"
            strata.setdefault(label, []).append((si, i))
    queues = {k: [v[j] for j in _spread(len(v))] for k, v in sorted(strata.items())}
    ranks: dict[tuple[int, int], tuple[int, str]] = {}
    r = 0
    while queues:
        for k in list(queues):
            ranks[queues[k].pop(0)] = (r, k)
            r += 1
            if not queues[k]:
                del queues[k]
    return ranks


def run_agent_modes(
    sessions: Sequence[AgentSession],
    *,
    engine: Any,
    kv_engine: Any,
    recompute_blocks: int | None = None,
    max_tokens: int = PROBE_TOKENS,
    fidelity_steps: int = DEFAULT_PROBES,
    scope: str = "session",
    log: Any = None,
) -> dict[str, Any]:
    """Replay ``sessions`` in the three modes; returns the report dict (module doc).

    ``engine``: a plain :class:`EmbeddedEngine` (``full`` and ``apc``); ``kv_engine``:
    one with ``kv_store`` (``splice``); both started with ``max_logprobs=-1`` for the
    KL probes.  ``fidelity_steps``: how many edit steps that relocate KV to probe
    (:func:`probe_ranks`); a probe that did not measure relocated KV raises
    :class:`~promptsplice.benchmarks.fidelity.FidelityError`.
    """
    from promptsplice.assembler import ContextHook
    from promptsplice.engine_adapters import AgentRunner
    from promptsplice.engine_adapters.runners._agent import DEFAULT_RECOMPUTE_BLOCKS
    from promptsplice.errors import ContextLengthError

    r = DEFAULT_RECOMPUTE_BLOCKS if recompute_blocks is None else recompute_blocks
    salts = {m: f"bench-agent-{m}" for m in MODES}
    runners = {
        "full": AgentRunner(engine, mode="full", salt=salts["full"]),
        "apc": AgentRunner(engine, mode="apc", salt=salts["apc"]),
        "splice": AgentRunner(kv_engine, mode="splice", salt=salts["splice"], recompute_blocks=r, scope=scope),
    }
    # One hook for all modes: the render does not depend on the mode (each runner sends
    # it under its own salt), so every step is rendered and diffed once.
    hook = ContextHook(engine.tokenizer, block_size=engine.block_size)
    totals = {m: _Totals() for m in MODES}
    by_kind: dict[str, dict[str, Any]] = {}
    fid = {"splice": Fidelity(), "apc": Fidelity()}
    ideal = 0
    skipped = 0
    fallbacks = 0
    ranks = probe_ranks(sessions) if fidelity_steps else {}
    limit = fidelity_steps  # ranks below it are probed; one that relocates nothing passes its turn on
    passed = 0
    t_start = time.perf_counter()
    for si, sess in enumerate(sessions):
        prev_render = None
        for i, msgs in enumerate(sess.renders):
            kind = classify_step(sess.renders[i - 1] if i else None, msgs)
            edit = kind not in ("first", "append")
            sid = f"{sess.id}"
            prepared = hook(sid, msgs, sess.tools or None)
            steps = {}
            try:
                for m in MODES:
                    steps[m] = runners[m].step(prepared, max_tokens=max_tokens)
            except ContextLengthError as exc:
                skipped += 1
                _log.warning("bench agent: session %s step %d skipped: %s", sess.id, i, exc)
                hook.forget(sid)
                for m in MODES:
                    runners[m].forget(sid)
                prev_render = None
                continue
            fallbacks += int(steps["splice"].fallback is not None and edit)
            for m in MODES:
                totals[m].add(steps[m], edit)
            render = prepared.render
            ideal += _ideal_step(render, prev_render, steps["apc"].cached_tokens)
            prev_render = render
            k = by_kind.setdefault(kind, {"steps": 0, **{m: {"prefill_tokens": 0, "ttft_ms": []} for m in MODES}})
            k["steps"] += 1
            for m in MODES:
                k[m]["prefill_tokens"] += steps[m].prefill_tokens
                k[m]["ttft_ms"].append(steps[m].ttft_s * 1e3)
            rank, label = ranks.get((si, i), (limit, ""))
            if rank < limit:
                if steps["splice"].planned_relocated_tokens > 0:
                    _measure(engine, kv_engine, prepared.token_ids, steps, runners, sid, fid, label=label)
                else:
                    limit += 1
                    passed += 1
            if log is not None:
                log(f"{sess.id} step {i} {kind:9s} prefill full {steps['full'].prefill_tokens:5d} "
                    f"apc {steps['apc'].prefill_tokens:5d} splice {steps['splice'].prefill_tokens:5d} "
                    f"(relocated {steps['splice'].relocated_tokens}, {steps['splice'].requests} req)")
    report: dict[str, Any] = {
        "modes": {m: totals[m].report() for m in MODES},
        "ideal_prefill_tokens": ideal,
        "fidelity": {**fid["splice"].report(), "control": fid["apc"].report(), "tokens": PROBE_TOKENS,
                     "requested": fidelity_steps, "passed_without_relocation": passed},
        "recompute_blocks": r,
        "scope": scope,
        "sessions": len(sessions),
        "skipped_steps": skipped,
        "splice_fallback_steps": fallbacks,
        "by_kind": {
            kind: {"steps": v["steps"], **{m: {"prefill_tokens": v[m]["prefill_tokens"],
                                             "ttft_p50_ms": round(_pct(v[m]["ttft_ms"], 0.5), 2)} for m in MODES}}
            for kind, v in sorted(by_kind.items())
        },
        "bench_wall_s": round(time.perf_counter() - t_start, 1),
    }
    apc, spl = report["modes"]["apc"]["prefill_tokens"], report["modes"]["splice"]["prefill_tokens"]
    report["gap_closed"] = round((apc - spl) / (apc - ideal), 4) if apc > ideal else None
    return report


def _measure(engine, kv_engine, tokens, steps, runners, sid, fid, *, label=None) -> None:
    """Fidelity probes of one step (:mod:`promptsplice.benchmarks.fidelity`): one-pass reference,
    then ``apc`` (control) and ``splice`` teacher-forced on its continuation.  The splice
    step must have relocated what its plan did, and each of its probes must be served
    the step's KV (else :class:`~promptsplice.benchmarks.fidelity.FidelityError`)."""
    verify_step(steps["splice"], f"agent step {sid}/{steps['splice'].step}")
    cont, p_ref = reference(engine, tokens)
    if not cont:  # EOS at once: nothing to probe
        return
    need = {"apc": None, "splice": full_blocks(kv_engine, tokens)}
    for m, eng in (("apc", engine), ("splice", kv_engine)):
        fid[m].measure(eng, tokens, cont, p_ref, runners[m].session_salt(sid), steps[m].completion.token_ids,
                       need_cached=need[m], label=label)


def format_agent(report: dict[str, Any]) -> str:
    lines = [f"{'mode':8s} {'prefill':>9s} {'relocated':>9s} {'hit':>6s} {'TTFT p50':>9s} {'edit TTFT p50':>13s}"]
    for m in MODES:
        x = report["modes"][m]
        lines.append(f"{m:8s} {x['prefill_tokens']:9d} {x['relocated_tokens']:9d} {x['hit_rate']:6.3f} "
                     f"{x['ttft_p50_ms']:7.0f}ms {x['edit_steps_ttft_p50_ms']:11.0f}ms")
    lines.append(f"ideal prefill (message-level reuse): {report['ideal_prefill_tokens']}; "
                 f"splice closes {report['gap_closed']} of the apc -> ideal gap")
    f = report["fidelity"]
    c = f["control"]
    lines.append(f"fidelity over {f['steps']} verified edit steps: splice tf-top1 {f['tf_top1_agreement']} "
                 f"{f['tf_top1_ci95']} (p10 {f['tf_top1_p10']}) KL {f['first_token_kl']} {f['first_token_kl_ci95']} "
                 f"(p50 {f['first_token_kl_p50']}, p90 {f['first_token_kl_p90']}, max {f['first_token_kl_max']}) "
                 f"greedy {f['greedy_agreement']} | control (apc) tf-top1 {c['tf_top1_agreement']} KL "
                 f"{c['first_token_kl']} (p90 {c['first_token_kl_p90']}) greedy {c['greedy_agreement']}")
    for kind, v in report["by_kind"].items():
        lines.append(f"  {kind:9s} {v['steps']:4d} steps  prefill apc {v['apc']['prefill_tokens']:7d} "
                     f"splice {v['splice']['prefill_tokens']:7d}  TTFT p50 apc {v['apc']['ttft_p50_ms']:6.0f} "
                     f"splice {v['splice']['ttft_p50_ms']:6.0f} ms")
    return "\n".join(lines)


def start_engines(*, store_dir: str | None = None, dram_bytes: int = 1 << 30) -> tuple[Any, Any]:
    """The bench's two engines: plain, and with the splice connector (DRAM then disk)."""
    from promptsplice.engine_adapters import EmbeddedEngine, StoreConfig

    extra = {"max_logprobs": -1}
    engine = EmbeddedEngine(extra_kwargs=extra)
    folder = store_dir or tempfile.mkdtemp(prefix="promptsplice-agent-store-")
    store = StoreConfig(dram_bytes=dram_bytes, disk_bytes=4 << 30, disk_dir=folder, fsync=False)
    kv_engine = EmbeddedEngine(kv_store=store, extra_kwargs=extra)
    return engine, kv_engine


def run_agent_bench(
    trace: str | Path,
    json_out: str | Path,
    *,
    recompute_blocks: int | None = None,
    sessions: int | None = None,
    max_tokens: int = PROBE_TOKENS,
    fidelity_steps: int = DEFAULT_PROBES,
    scope: str = "session",
    verbose: bool = True,
) -> int:
    """The CLI's job: read the trace, run the modes, write the JSON, print a table."""
    data = read_agent_trace(trace)
    if sessions is not None:
        data = data[:sessions]
    engine, kv_engine = start_engines()
    try:
        report = run_agent_modes(
            data, engine=engine, kv_engine=kv_engine, recompute_blocks=recompute_blocks,
            max_tokens=max_tokens, fidelity_steps=fidelity_steps, scope=scope,
            log=print if verbose else None,
        )
    finally:
        kv_engine.close()
        engine.close()
    report["trace"] = str(trace)
    out = Path(json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_agent(report))
    print(f"wrote {out}")
    return 0
