"""The deviation -> first-token KL curve behind ``AgentRunner(max_deviation=...)`` and
:data:`~promptsplice.engine_adapters.runners._agent.DEFAULT_MAX_DEVIATION`.

Replays an agent trace (BFCL-derived: ``promptsplice bench gen-agent-trace``) on one
engine with the splice connector, in several *configurations* of the splice runner,
each under its own tenant salt (same engine, same capacity, same steps):

* ``r1``: one recomputed block per relocated run, probed (``max_deviation`` 1.0, the
  largest accepted: the connector measures each recomputed block, and a block off by
  more than its own size is the only one extended);
* ``r2``: two fixed recomputed blocks, no guard (``fast`` with ``recompute_blocks=2``:
  the fixed knob, for the cost comparison);
* ``t=<x>``: ``recompute_blocks=1, max_deviation=x`` (adaptive).

A probed step must have relocated what its plan did (the connector's count against the
plan's); one that relocated less read computed KV in place of some planned relocated
KV, so it is counted in ``unverified_probes`` and kept out of every statistic, like a
probe that did not meet the config's KV.  A step that planned nothing of its own stays
in (it reads its session's earlier spliced KV through the scope).

Every edit step is probed (up to ``max_steps``): first-token ``KL(reference || config)``
(:func:`promptsplice.benchmarks.fidelity.kl`) against a one-pass exact prefill of the
same prompt under a fresh salt, each config's distribution read from a request under
its session salt (so it meets the config's spliced KV; the probe checks vLLM served all
but the last block from cache).  From ``r1`` the report pairs each step's deviation
(the largest over its runs' recomputed blocks, several aggregates over layers) with its
KL: the curve (quartile bins), Spearman's rank correlation of each aggregate with KL,
and KL by edit kind.  Per config: KL mean/p50/p90/max, extra blocks prefilled over
``r1`` on edit steps, requests.  ``chosen`` is the threshold with the fewest extra
blocks whose KL p90 stays <= ``KL_BAR`` (``r1`` counts as the next 0.05 above its
largest deviation: nothing extended).  The probe cost: the worker's time comparing
blocks over the splice steps' wall time, in the same run.

    python -m promptsplice.benchmarks.deviation_curve --trace T.jsonl --json OUT.json

``--bounded-only`` replays the ``bounded`` level alone (``--runner`` JSON: AgentRunner
keyword overrides, e.g. ``{"recompute_blocks": 6}``) and probes every edit step; each
raw row also carries the step's relocated runs, each with its changed share
(:meth:`promptsplice.assembler.Diff.changed_share`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks._stats import percentile
from promptsplice.benchmarks.cli import UsageError, _check_writable, count_arg, run_tool

__all__ = [
    "AGGREGATES", "BUDGETS", "KL_BAR", "aggregate", "approximate_tokens", "budget_sweep", "config_kwargs", "RAG_THRESHOLDS", "rag_budget_sweep",
    "run_deviation_curve", "spearman",
]

KL_BAR = 0.02
"""First-token KL p90 (nats) the chosen threshold must keep (issue #16's bar)."""
AGGREGATES = ("mean_kv", "mean_v", "mean_k", "max_layer", "last_layer")
_PROBE_ALL = 1.0  # the largest threshold runners accept: probe, extend only a block off by its own size


def aggregate(dev: Any, how: str) -> float:
    """One number per :class:`BlockDeviation` (``how`` in :data:`AGGREGATES`)."""
    if how == "mean_kv":
        return dev.value
    if how == "mean_v":
        return sum(dev.v) / len(dev.v)
    if how == "mean_k":
        return sum(dev.k) / len(dev.k)
    if how == "max_layer":
        return dev.max_layer
    if how == "last_layer":
        return (dev.k[-1] + dev.v[-1]) / 2
    raise ValueError(f"unknown aggregate {how!r}")


def _pct(xs: Sequence[float], q: float) -> float:
    return percentile(xs, q, empty=float("nan"))


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (``None`` under 3 pairs or a constant side)."""
    if len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return round(cov / math.sqrt(va * vb), 4) if va and vb else None


def _kl_stats(kls: Sequence[float]) -> dict[str, Any]:
    if not kls:
        return {"steps": 0}
    return {"steps": len(kls), "kl_mean": round(sum(kls) / len(kls), 4), "kl_p50": round(_pct(kls, 0.5), 4),
            "kl_p90": round(_pct(kls, 0.9), 4), "kl_max": round(max(kls), 4)}


def _run_signals(prepared: Any) -> list[dict[str, Any]]:
    """Per relocated run of the step's diff: where it starts in the old render, its
    length and shift, and :meth:`~promptsplice.assembler.Diff.changed_share`."""
    diff = prepared.diff
    if diff is None:
        return []
    return [{"old_start": run.old_start, "length": run.length, "delta": run.delta,
             "changed_share": round(diff.changed_share(run), 5)} for run in diff.relocations]


BUDGETS = (0, 64, 128, 256, 512, 1024, 2048, 4096)
"""Per-step budgets of approximate tokens :func:`budget_sweep` tries."""


def approximate_tokens(row: dict[str, Any], block_size: int, recompute_blocks: int) -> int:
    """A probed step's approximate KV, estimated from its relocated runs: each run's whole
    blocks less the ``recompute_blocks`` computed at its start, whatever its shift (a run
    reused at delta 0 after an edit attended to the old context too)."""
    bs = block_size
    return sum(max(0, run["length"] // bs * bs - recompute_blocks * bs) for run in row["runs"])


def budget_sweep(
    rows: Sequence[dict[str, Any]], *, block_size: int, recompute_blocks: int = 2,
    budgets: Sequence[int] = BUDGETS, approx: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Would a per-step budget of approximate tokens meet :data:`KL_BAR`?  For each budget,
    steps over it are counted as exact (KL 0: an optimistic bound for agent steps, since
    their session's cache still holds the approximate KV of earlier steps; a RAG request
    over it is one exact request); the share of approximate tokens kept is what the
    budget leaves of the reuse.  ``inherited``: the steps with no approximate token of
    their own, whose KL comes from earlier steps' KV.  ``approx``: each row's approximate
    tokens when measured (a RAG probe's ``relocated_tokens``), else estimated from its
    runs (:func:`approximate_tokens`)."""
    if approx is None:
        approx = [approximate_tokens(r, block_size, recompute_blocks) for r in rows]
    kls = [r["kl"] for r in rows]
    total = sum(approx) or 1
    sweep = []
    for b in budgets:
        within = [a <= b for a in approx]
        sweep.append({"budget": b, **_kl_stats([k if w else 0.0 for k, w in zip(kls, within)]),
                      "kept_share": round(sum(a for a, w in zip(approx, within) if w) / total, 3)})
    met = [s["budget"] for s in sweep if s.get("kl_p90", 1.0) <= KL_BAR]
    return {"steps": len(rows), "spearman_approximate_tokens": spearman(kls, approx), "sweep": sweep,
            "largest_budget_meeting_bar": max(met) if met else None,
            "inherited": _kl_stats([k for k, a in zip(kls, approx) if a == 0])}


RAG_THRESHOLDS = (0.15, 0.2, 0.22, 0.24, 0.25, 0.26, 0.28, 0.3)
"""Largest-deviation thresholds :func:`rag_budget_sweep` tries."""


def _rag_sweeps(rows: Sequence[dict[str, Any]], budgets: Sequence[int], guard: float | None = None) -> dict[str, Any]:
    """A family's budget sweep, and beside it the same over the largest deviation its
    run starts' recomputed blocks measured (``max_deviation``): a request above the
    threshold counted as exact, as if the guard had sent it exact (optimistic: the
    guard computes the run that deviated and every later one, but still loads the runs
    before it); a request with no measured deviation
    (nothing probed) is kept.  ``guard``: the threshold the bench ran its guard at
    (``pic.run_max_deviation``): above it a probe's KL is the guarded one, so only the
    thresholds up to it are swept."""
    out = budget_sweep(rows, block_size=0, budgets=budgets, approx=[r["relocated_tokens"] for r in rows])
    devs = [r.get("max_deviation") for r in rows]
    if any(d is not None for d in devs):
        kls, approx = [r["kl"] for r in rows], [r["relocated_tokens"] for r in rows]
        total = sum(approx) or 1
        kept = [lambda t, d=d: d is None or d <= t for d in devs]
        out["spearman_max_deviation"] = spearman(*zip(*[(k, d) for k, d in zip(kls, devs) if d is not None]))
        out["deviation_sweep"] = [
            {"max_deviation": t, **_kl_stats([k if keep(t) else 0.0 for k, keep in zip(kls, kept)]),
             "kept_share": round(sum(a for a, keep in zip(approx, kept) if keep(t)) / total, 3)}
            for t in RAG_THRESHOLDS if guard is None or t <= guard]
        met = [x["max_deviation"] for x in out["deviation_sweep"] if x.get("kl_p90", 1.0) <= KL_BAR]
        out["largest_deviation_meeting_bar"] = max(met) if met else None
    return out


def rag_budget_sweep(report: dict[str, Any], *, budgets: Sequence[int] = BUDGETS) -> dict[str, Any]:
    """:func:`budget_sweep` over a ``bench rag`` report's probes (``fidelity.probes``),
    per family of a ``--suite`` report and over all of them (``all``), each probe's
    approximate tokens being the KV its request loaded relocated (``relocated_tokens``,
    vLLM's count through the connector).  ``worst``: the largest budget every family
    with probes meets the bar at (``None``: none does)."""
    families = report["families"] if "families" in report else {"trace": report}
    out: dict[str, Any] = {}
    pooled: list[dict[str, Any]] = []
    guards: list[float | None] = []
    for name, fam in families.items():
        rep = fam.get("report", fam) if isinstance(fam, dict) else None
        fid = (rep or {}).get("fidelity") or {}
        if fid.get("steps") and "probes" not in fid:
            raise ValueError(f"family {name!r} has {fid['steps']} probes but no per-probe records "
                             "(a report from before 2026-12-05: re-run bench rag)")
        rows = list(fid.get("probes") or ())
        if not rows:
            out[name] = {"steps": 0}
            continue
        pooled += rows
        guard = (rep or {}).get("pic", {}).get("run_max_deviation")
        guards.append(guard)
        out[name] = _rag_sweeps(rows, budgets, guard)
    low = min((g for g in guards if g is not None), default=None)
    out["all"] = _rag_sweeps(pooled, budgets, low) if pooled else {"steps": 0}
    met = [{s["budget"] for s in r["sweep"] if s.get("kl_p90", 1.0) <= KL_BAR}
           for k, r in out.items() if k != "all" and r["steps"]]
    common = set.intersection(*met) if met else set()
    fams = [r for k, r in out.items() if k != "all" and r["steps"]]
    devs = [{x["max_deviation"] for x in r["deviation_sweep"] if x.get("kl_p90", 1.0) <= KL_BAR}
            for r in fams if "deviation_sweep" in r]
    common_dev = set.intersection(*devs) if devs and len(devs) == len(fams) else set()
    out["worst"] = {"largest_budget_every_family_meets": max(common) if common else None,
                    "largest_deviation_every_family_meets": max(common_dev) if common_dev else None,
                    "families_with_probes": len(met)}
    return out


def config_kwargs(config: str | float) -> dict[str, Any]:
    """The :class:`~promptsplice.engine_adapters.AgentRunner` keywords of a configuration
    (module doc): ``"r1"``, ``"r2"`` or a threshold.  Each names its recompute:
    ``fidelity="bounded"`` alone runs 2 blocks and its 0.25 guard."""
    if config == "r1":
        return {"fidelity": "bounded", "recompute_blocks": 1, "max_deviation": _PROBE_ALL}
    if config == "r2":
        return {"fidelity": "fast", "recompute_blocks": 2}
    return {"fidelity": "bounded", "recompute_blocks": 1, "max_deviation": float(config)}


def run_deviation_curve(
    sessions: Sequence[Any], kv_engine: Any, *, thresholds: Sequence[float] | None = None,
    max_steps: int | None = None, log: Any = None, with_r2: bool = True, raw_out: str | None = None,
    bounded_only: bool = False, runner_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replay ``sessions`` in every configuration (module doc); returns the report.

    ``thresholds``: the adaptive configs (``None``: the r1 deviations' 50th, 75th and
    90th percentiles, measured in a first pass).  ``kv_engine``: an engine with
    ``kv_store``, started with ``max_logprobs=-1``.
    """
    from promptsplice.benchmarks.agent_traces import classify_step
    from promptsplice.benchmarks.fidelity import kl
    from promptsplice.engine_adapters import AgentRunner

    worker = kv_engine.kv_connector.worker
    bs = kv_engine.block_size
    refs: dict[tuple[str, int], dict[int, float]] = {}

    def replay(name: str, runner: Any) -> dict[str, Any]:
        from promptsplice.assembler import ContextHook

        hook = ContextHook(kv_engine.tokenizer, block_size=bs)
        rows, probe_s, wall_s, unverified, n = [], 0.0, 0.0, 0, 0
        for sess in sessions:
            for i, msgs in enumerate(sess.renders):
                kind = classify_step(sess.renders[i - 1] if i else None, msgs)
                prepared = hook(sess.id, msgs, sess.tools or None)
                seen0, p0 = worker.stats.probed_blocks, worker.stats.probe_s
                t0 = time.perf_counter()
                step = runner.step(prepared, max_tokens=1)
                wall_s += time.perf_counter() - t0
                probe_s += worker.stats.probe_s - p0
                new = min(worker.stats.probed_blocks - seen0, len(worker.deviations))
                devs = list(worker.deviations)[len(worker.deviations) - new:] if new else []
                if kind in ("first", "append") or (max_steps is not None and n >= max_steps):
                    continue
                n += 1
                if step.relocated_tokens != step.planned_relocated_tokens:
                    # the store served less than the plan: part of what the config
                    # would relocate was computed, so the probe would understate it
                    unverified += 1
                    continue
                toks = list(prepared.token_ids)
                key = (sess.id, i)
                if key not in refs:
                    refs[key] = kv_engine.generate(toks, max_tokens=1, cache_salt=f"ref:{uuid.uuid4().hex}",
                                                   logprobs=-1).logprobs[0]
                out = kv_engine.generate(toks, max_tokens=1, cache_salt=runner.session_salt(sess.id), logprobs=-1)
                if out.num_cached_tokens < (len(toks) - 1) // bs * bs:
                    # the probe did not meet the config's KV: its KL measures exact KV,
                    # so it is counted and kept out of every statistic, never a score
                    unverified += 1
                    continue
                rows.append({
                    "session": sess.id, "step": i, "kind": kind, "kl": kl(refs[key], out.logprobs[0]),
                    "runs": _run_signals(prepared),
                    "prefill_tokens": step.prefill_tokens, "relocated_tokens": step.relocated_tokens,
                    "planned_relocated_tokens": step.planned_relocated_tokens,
                    "requests": step.requests, "extra_blocks": step.extra_recompute_blocks,
                    "dev": {a: max((aggregate(d, a) for d in devs), default=None) for a in AGGREGATES},
                })
        if log:
            log(f"{name}: {len(rows)} edit steps probed, KL p90 {_kl_stats([r['kl'] for r in rows]).get('kl_p90')}")
        return {"rows": rows, "probe_s": probe_s, "wall_s": wall_s, "unverified": unverified}

    if bounded_only:  # the ``bounded`` level alone (r=2 and its guard; ``runner_kwargs`` override)
        kw = {"fidelity": "bounded", **(runner_kwargs or {})}
        results = {"bounded": replay("bounded", AgentRunner(kv_engine, salt="dev-bounded", **kw))}
        if raw_out is not None:
            Path(raw_out).write_text(json.dumps(results) + "\n")
        rows = results["bounded"]["rows"]
        return {"configs": {"bounded": {
            **_kl_stats([r["kl"] for r in rows]), "runner": kw, "unverified_probes": results["bounded"]["unverified"],
            "prefill_tokens": sum(r["prefill_tokens"] for r in rows),
            "relocated_tokens": sum(r["relocated_tokens"] for r in rows)}}, "block_size": bs}
    results = {"r1": replay("r1", AgentRunner(kv_engine, salt="dev-r1", **config_kwargs("r1")))}
    if raw_out is not None:
        Path(raw_out).write_text(json.dumps(results) + "\n")
    d1 = [r["dev"]["mean_kv"] for r in results["r1"]["rows"] if r["dev"]["mean_kv"] is not None]
    if thresholds is None:
        thresholds = sorted({round(_pct(d1, q), 4) for q in (0.5, 0.75, 0.9)}) if d1 else []
    for t in thresholds:
        results[f"t={t:g}"] = replay(f"t={t:g}", AgentRunner(kv_engine, salt=f"dev-t{t:g}", **config_kwargs(t)))
        if raw_out is not None:
            Path(raw_out).write_text(json.dumps(results) + "\n")
    if with_r2:
        results["r2"] = replay("r2", AgentRunner(kv_engine, salt="dev-r2", **config_kwargs("r2")))
    if raw_out is not None:
        Path(raw_out).write_text(json.dumps(results) + "\n")
    return curve_report(results, thresholds, bs)


def curve_report(results: dict[str, Any], thresholds: Sequence[float], bs: int) -> dict[str, Any]:
    """The report (module doc) from the configs' probed rows."""
    d1 = [r["dev"]["mean_kv"] for r in results["r1"]["rows"] if r["dev"]["mean_kv"] is not None]
    base = {(r["session"], r["step"]): r["prefill_tokens"] for r in results["r1"]["rows"]}
    configs = {}
    for name, res in results.items():
        rows = res["rows"]
        extra = sum(r["prefill_tokens"] - base.get((r["session"], r["step"]), r["prefill_tokens"]) for r in rows)
        configs[name] = {
            **_kl_stats([r["kl"] for r in rows]),
            "extra_prefill_blocks": extra // bs,
            "adaptive_extra_blocks": sum(r["extra_blocks"] for r in rows),
            "requests": sum(r["requests"] for r in rows),
            "relocated_tokens": sum(r["relocated_tokens"] for r in rows),
            "unverified_probes": res["unverified"],
            "probe_cost_ratio": round(res["probe_s"] / res["wall_s"], 4) if res["wall_s"] else None,
        }
    r1 = [r for r in results["r1"]["rows"] if r["dev"]["mean_kv"] is not None]
    curve = []
    if r1:
        qs = [_pct(d1, q) for q in (0.25, 0.5, 0.75)]
        edges = [-math.inf, *qs, math.inf]
        for lo, hi in zip(edges, edges[1:]):
            b = [r for r in r1 if lo < r["dev"]["mean_kv"] <= hi]
            if b:
                curve.append({"deviation_min": round(min(r["dev"]["mean_kv"] for r in b), 4),
                              "deviation_max": round(max(r["dev"]["mean_kv"] for r in b), 4),
                              **_kl_stats([r["kl"] for r in b])})
    by_kind: dict[str, Any] = {}
    for kind in sorted({r["kind"] for r in r1}):
        b = [r for r in r1 if r["kind"] == kind]
        by_kind[kind] = {**_kl_stats([r["kl"] for r in b]),
                         "deviation_mean": round(sum(r["dev"]["mean_kv"] for r in b) / len(b), 4),
                         "spearman_within_kind": spearman([r["dev"]["mean_kv"] for r in b], [r["kl"] for r in b])}
    # r1 is the threshold above every deviation it saw (no extra block): the next 0.05 up.
    above = math.ceil(max(d1) * 20) / 20 if d1 else None
    cands = [(t, configs[f"t={t:g}"]) for t in thresholds]
    if above is not None:
        cands.append((above, configs["r1"]))
    # a config with an unverified probe is never chosen: its statistics miss a step
    ok = [c for c in cands if c[1].get("kl_p90", math.inf) <= KL_BAR and not c[1]["unverified_probes"]]
    chosen = max(ok, key=lambda x: (-x[1]["extra_prefill_blocks"], x[0]))[0] if ok else None
    return {
        "kl_bar": KL_BAR, "thresholds": list(thresholds), "chosen_max_deviation": chosen,
        "configs": configs, "curve_r1": curve, "by_kind_r1": by_kind,
        "spearman_r1": {a: spearman([r["dev"][a] for r in r1], [r["kl"] for r in r1]) for a in AGGREGATES},
        "pairs_r1": [{"kind": r["kind"], "deviation": round(r["dev"]["mean_kv"], 5), "kl": round(r["kl"], 5)}
                     for r in r1],
        "block_size": bs,
    }


def _thresholds(text: str) -> list[float]:
    """``--thresholds 0.05,0.1``: each a ``max_deviation`` in (0, 1] (``abc`` was a
    traceback)."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a number (e.g. 0.05,0.1)") from None
        if not 0 < value <= 1:  # also NaN
            raise argparse.ArgumentTypeError(f"each max_deviation must be in (0, 1], got {part}")
        values.append(value)
    return values


def _read_raw(flag: str, path: str, *, need: str | None = None) -> dict[str, Any]:
    """A ``--raw`` file of this bench: ``{config: {"rows": [...], ...}}`` (a malformed
    file was a JSONDecodeError traceback)."""
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise UsageError(f"{flag} {path}: not JSON ({exc}); pass a file this bench wrote with --raw") from None
    bad = not isinstance(raw, dict) or not raw or any(
        not isinstance(cfg, dict) or not isinstance(cfg.get("rows"), list) for cfg in raw.values())
    if bad or (need is not None and need not in raw):
        raise UsageError(f"{flag} {path}: not a --raw file of this bench ({{config: {{\"rows\": [...]}}}}"
                         f"{f' with config {need!r}' if need else ''}); pass a file it wrote with --raw")
    return raw


def _read_rag_report(path: str) -> dict[str, Any]:
    """A ``bench rag --json`` report (one trace, or ``--suite``)."""
    flag = "--rag-budget-sweep"
    try:
        with open(path, encoding="utf-8") as fh:
            rep = json.load(fh)
    except ValueError as exc:
        raise UsageError(f"{flag} {path}: not JSON ({exc}); pass a report bench rag wrote with --json") from None
    if not isinstance(rep, dict) or not ("families" in rep or "fidelity" in rep):
        raise UsageError(f"{flag} {path}: not a bench rag report (no 'fidelity' or 'families'); "
                         "pass one written by promptsplice bench rag --json with --fidelity-requests above 0")
    return rep


def _from_raw(flag: str, path: str, build: Any) -> Any:
    """``build()`` over a ``--raw`` file's rows: a row missing a field is one line naming
    the file, not a KeyError traceback."""
    try:
        return build()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{flag} {path}: a row this bench cannot read ({type(exc).__name__}: {exc}); "
                         "pass a file it wrote with --raw") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.deviation_curve", description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=None, help="agent trace JSONL (promptsplice bench gen-agent-trace)")
    parser.add_argument("--json", required=True, help="where to write the report")
    parser.add_argument("--sessions", type=count_arg(1), default=None, help="only the first N sessions")
    parser.add_argument("--max-steps", type=count_arg(1), default=None, help="probe at most N edit steps per config")
    parser.add_argument("--thresholds", type=_thresholds, default=None,
                        help="comma-separated max_deviation values, each in (0, 1] (default: r1 quantiles)")
    parser.add_argument("--max-model-len", type=count_arg(1), default=8192, help="engine context (default 8192, the model's)")
    parser.add_argument("--no-r2", action="store_true", help="skip the fixed r=2 config")
    parser.add_argument("--bounded-only", action="store_true", help="only the bounded level (r=2 and its guard), every edit step probed")
    parser.add_argument("--runner", default=None, help="with --bounded-only: AgentRunner keyword overrides as JSON")
    parser.add_argument("--raw", default=None, help="also write the configs' rows here as they finish")
    parser.add_argument("--report-from", default=None, help="rebuild the report from a --raw file (no engine)")
    parser.add_argument("--block-size", type=count_arg(1), default=32, help="with --report-from: the engine's block size")
    parser.add_argument("--budget-sweep", default=None, help="a --raw file of one fixed recompute (--bounded-only): per-step approximate-token budgets vs the bar (no engine)")
    parser.add_argument("--recompute-blocks", type=count_arg(0), default=2, help="with --budget-sweep: the runs' recomputed blocks")
    parser.add_argument("--rag-budget-sweep", default=None, help="a bench rag --json report (one trace or --suite) with fidelity probes: per-request relocated-token budgets vs the bar (no engine)")
    args = parser.parse_args(argv)
    reads = (("--report-from", args.report_from), ("--budget-sweep", args.budget_sweep),
             ("--rag-budget-sweep", args.rag_budget_sweep))
    _check_writable("--json", args.json, "the report's", args.trace, reads)  # before the run, as the CLI's
    if args.raw is not None:
        _check_writable("--raw", args.raw, "the raw rows'", args.trace, reads)
    if args.rag_budget_sweep:
        raw = _read_rag_report(args.rag_budget_sweep)
        report = _from_raw("--rag-budget-sweep", args.rag_budget_sweep, lambda: rag_budget_sweep(raw))
        report["from_report"] = args.rag_budget_sweep
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        for name, r in report.items():
            if isinstance(r, dict) and r.get("steps"):
                print(name, json.dumps({k: r.get(k) for k in ("steps", "spearman_approximate_tokens",
                                                                "largest_budget_meeting_bar", "spearman_max_deviation",
                                                                "largest_deviation_meeting_bar")}))
                for row in r["sweep"] + r.get("deviation_sweep", []):
                    print("  ", json.dumps(row))
        print("worst", json.dumps(report["worst"]))
        return 0
    if args.budget_sweep:
        raw = _read_raw("--budget-sweep", args.budget_sweep)
        report = _from_raw("--budget-sweep", args.budget_sweep, lambda: {
            name: budget_sweep(cfg["rows"], block_size=args.block_size, recompute_blocks=args.recompute_blocks)
            for name, cfg in raw.items()})
        report["from_raw"] = args.budget_sweep
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        for name, r in report.items():
            if isinstance(r, dict):
                print(name, json.dumps({k: r[k] for k in ("steps", "spearman_approximate_tokens",
                                                            "largest_budget_meeting_bar", "inherited")}))
                for row in r["sweep"]:
                    print("  ", json.dumps(row))
        return 0
    if args.report_from:
        results = _read_raw("--report-from", args.report_from, need="r1")
        report = _from_raw("--report-from", args.report_from, lambda: curve_report(
            results, [float(k[2:]) for k in results if k.startswith("t=")], args.block_size))
        report["from_raw"] = args.report_from
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _print(report)
        return 0
    if not args.trace:
        parser.error("--trace is required (or --report-from)")
    from promptsplice.benchmarks.agent_traces import read_agent_trace
    from promptsplice.engine_adapters import EmbeddedEngine, StoreConfig

    try:  # before the engine starts
        runner_kwargs = json.loads(args.runner) if args.runner else None
    except ValueError as exc:
        parser.error(f"--runner must be a JSON object of AgentRunner keywords: {exc}")
    if runner_kwargs is not None and not isinstance(runner_kwargs, dict):
        parser.error(f"--runner must be a JSON object of AgentRunner keywords, got {args.runner}")
    sessions = read_agent_trace(args.trace)[: args.sessions]
    thresholds = args.thresholds
    eng = EmbeddedEngine(kv_store=StoreConfig(dram_bytes=1 << 30), max_model_len=args.max_model_len,
                         extra_kwargs={"max_logprobs": -1})
    try:
        report = run_deviation_curve(sessions, eng, thresholds=thresholds, max_steps=args.max_steps, log=print,
                                     with_r2=not args.no_r2, raw_out=args.raw, bounded_only=args.bounded_only,
                                     runner_kwargs=runner_kwargs)
    finally:
        eng.close()
    report["trace"] = args.trace
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.bounded_only:
        print(json.dumps(report["configs"]["bounded"]))
    else:
        _print(report)
    bad = {name: c["unverified_probes"] for name, c in report["configs"].items() if c.get("unverified_probes")}
    if bad:  # a probe that did not meet the config's KV fails the bench, as in bench agent / rag
        print(f"promptsplice: error: probes that did not meet their config's KV (left out of the statistics): {bad}",
              file=sys.stderr)
        from promptsplice.benchmarks.fidelity import FIDELITY_EXIT

        return FIDELITY_EXIT  # what the CLI returns for bench agent's and bench rag's FidelityError
    return 0


def _print(report: dict[str, Any]) -> None:
    for name, c in report["configs"].items():
        print(f"{name:10s} {c}")
    print(f"curve (r1): {report['curve_r1']}\nspearman: {report['spearman_r1']}\nby kind: {report['by_kind_r1']}")
    print(f"chosen max_deviation: {report['chosen_max_deviation']}")


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
