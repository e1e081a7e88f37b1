"""``promptsplice bench rag --suite``: every trace family through the embedded engine.

The engine-side twin of ``bench assemble --suite``: each family of
:data:`promptsplice.benchmarks.traces.SUITE` is generated, written as JSONL and read
back (validated), then run by :func:`promptsplice.benchmarks.rag.run_modes` on the same
two engines (each mode starts from an empty prefix cache).  The report holds each
family's ``rag`` report, the worst family per mode by gap closed (vLLM's own cached
tokens), and the families that failed; one broken family does not stop the others.
With a ``kv_engine`` factory (the CLI) every family's two store modes get fresh
engines and stores (:mod:`promptsplice.benchmarks.rag`: equal capacity, no shared traffic);
``--one-store-engine`` starts one store engine for the whole suite instead (each mode
of each family under salts no other used; they share the store's budget), which saves
two engine starts per family; PIC then starts on a store the store control (and earlier
families) filled, so PIC's gap over the control is skipped as with probe traffic
(below).

Per family the report carries ``coverage`` and the bound checks of ``bench rag``; the
suite's ``checks`` say, per family, whether promptsplice prefilled no more than the
capacity-matched radix ideal (the target), whether the mirror equalled vLLM's count, and
PIC's share of the ``promptsplice_store`` -> oracle gap.  Exit status: a mode below its
bound (``BOUND_EXIT``), then a family whose fidelity probe failed (``FIDELITY_EXIT``,
as ``bench rag``), then a family below the coverage bar without ``--allow-skips``
(``COVERAGE_EXIT``), then a failed family (1).

JSON::

    {"suite": {...}, "families": {FAMILY: {"trace", "shape", "report": RAG_REPORT} | {"error": str}},
     "worst": {"promptsplice": {"gap_closed", "family"}, "promptsplice_pic": {...},
               "promptsplice_pic_vs_store": {...}, "promptsplice_pic_vs_store_whole_block": {...},
               "coverage": {"coverage", "family"}},
     "checks": {FAMILY: {"coverage", "le_radix_capacity", "mirror_equal", "bounds_hold",
                         "pic_gap_closed_vs_store", "pic_gap_closed_vs_store_whole_block",
                         "pic_gap_closed_vs_store_skipped", "pic_ceiling_gap_closed_vs_store"}},
     "pic_vs_store_skipped": {FAMILY: str},
     "failed": {FAMILY: str}, "fidelity_failed": [FAMILY, ...] (only when one failed so)}

A family whose PIC engine served fidelity probes between its requests
(``pic.probe_traffic``), or whose PIC ran on the store engine the control filled
(``pic.shared_store``: ``--one-store-engine``), has no like-for-like gap over
``promptsplice_store``: its ``pic_gap_closed_vs_store`` (and ``..._whole_block``) is
``None``, ``pic_gap_closed_vs_store_skipped`` says why, the worst lines
``promptsplice_pic_vs_store*`` leave it out and ``pic_vs_store_skipped`` lists it (run the
suite with ``--fidelity-requests 0`` and without ``--one-store-engine`` for that figure).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.bounds import BOUND_EXIT
from promptsplice.benchmarks.coverage import MIN_COVERAGE
from promptsplice.benchmarks.fidelity import FIDELITY_EXIT, FidelityError
from promptsplice.benchmarks.rag import PIC_MODE, check_store_layout, format_modes, run_modes, start_rag_engines
from promptsplice.benchmarks.traces import SUITE, read_rag_trace, shape_stats, suite_trace_dir, write_rag_trace
from promptsplice.errors import PromptspliceError

_log = logging.getLogger(__name__)

__all__ = ["rag_suite", "run_rag_suite", "format_suite", "family_checks", "suite_status"]


PROBE_TRAFFIC_SKIP = ("PIC ran with fidelity probe traffic (pic.probe_traffic): its gap over "
                      "promptsplice_store is no like-for-like figure; rerun with --fidelity-requests 0")
SHARED_STORE_SKIP = ("PIC ran on the store engine the store control filled (pic.shared_store, "
                     "--one-store-engine): its gap over promptsplice_store is no like-for-like figure; "
                     "rerun without --one-store-engine")


def probe_traffic(report: dict[str, Any]) -> bool:
    """Whether PIC's engine served fidelity probes between its requests (``pic.probe_traffic``;
    a report from before the flag: whether it made any probe)."""
    pic = report.get("pic") or {}
    if "probe_traffic" in pic:
        return bool(pic["probe_traffic"])
    return bool(pic) and (report.get("fidelity") or {}).get("steps", 0) > 0


def pic_vs_store_skip(report: dict[str, Any]) -> str | None:
    """Why the family's PIC-vs-store figures are skipped (:data:`PROBE_TRAFFIC_SKIP`,
    :data:`SHARED_STORE_SKIP`, both joined by ``"; "``), or None: they are like for like."""
    shared = bool((report.get("pic") or {}).get("shared_store"))
    why = [msg for hit, msg in ((probe_traffic(report), PROBE_TRAFFIC_SKIP), (shared, SHARED_STORE_SKIP)) if hit]
    return "; ".join(why) or None


def _gap(report: dict[str, Any], mode: str) -> float | None:
    if mode == "promptsplice":
        return report.get("gap_closed")
    if mode in ("promptsplice_pic_vs_store", "promptsplice_pic_vs_store_whole_block"):
        if pic_vs_store_skip(report) is not None:  # skipped, and why
            return None
        key = "gap_closed_vs_store" + mode.removeprefix("promptsplice_pic_vs_store")
        return (report.get("pic") or {}).get(key)
    return (report.get("pic") or {}).get("gap_closed")


def family_checks(r: dict[str, Any]) -> dict[str, Any]:
    """The suite's per-family verdicts (module doc) from one ``bench rag`` report."""
    m, b = r["modes"], r["bounds"]
    return {
        "coverage": r["coverage"],
        "le_radix_capacity": m["promptsplice"]["prefill_tokens"] <= b["radix_capacity_prefill_tokens"],
        "mirror_equal": r["mirror"]["predicted_cached_tokens"] == r["mirror"]["measured_cached_tokens"],
        "bounds_hold": all(c["holds"] for c in b["checks"].values()),
        "pic_gap_closed_vs_store": _gap(r, "promptsplice_pic_vs_store"),
        # the same to the whole-block oracle (a reference: bench rag's module doc)
        "pic_gap_closed_vs_store_whole_block": _gap(r, "promptsplice_pic_vs_store_whole_block"),
        # why pic_gap_closed_vs_store is None though PIC ran (else None)
        "pic_gap_closed_vs_store_skipped": pic_vs_store_skip(r),
        # about the most pic_gap_closed_vs_store can be at PIC's recompute settings (from
        # the trace, probes or not: bench rag's pic.ceiling_gap_closed_vs_store)
        "pic_ceiling_gap_closed_vs_store": (r.get("pic") or {}).get("ceiling_gap_closed_vs_store"),
    }


def rag_suite(
    engine: Any,
    *,
    kv_engine: Any = None,
    families: Sequence[str] = SUITE,
    requests: int = 60,
    seed: int = 0,
    trace_dir: str | Path,
    on_family: Any = None,
    **modes: Any,
) -> dict[str, Any]:
    """Run every family on ``engine`` (and ``kv_engine``: the store modes, an engine or a
    factory); ``modes`` go to :func:`run_modes` (policy, alignment, max_tokens, ...).
    ``on_family(report)`` is called after each family (the CLI writes a partial JSON)."""
    out_dir = suite_trace_dir(trace_dir, families)
    report: dict[str, Any] = {
        "suite": {"families": list(families), "requests": requests, "seed": seed, **modes,
                  # one store engine for every family and mode (not a factory): PIC then
                  # runs on a store the store mode (and earlier families) filled
                  "one_store_engine": kv_engine is not None and hasattr(kv_engine, "generate")},
        "families": {},
        "failed": {},
    }
    for fam in families:
        path = out_dir / f"{fam}.jsonl"
        try:
            write_rag_trace(path, requests=requests, seed=seed, family=fam)
            reqs = read_rag_trace(path)
            rep, _ = run_modes(engine, reqs, kv_engine=kv_engine, **modes)
        except Exception as exc:  # a bug in one family (a KeyError...) ended the whole suite with a traceback
            if not isinstance(exc, PromptspliceError | OSError):
                _log.exception("bench rag --suite: family %s failed unexpectedly", fam)
            report["failed"][fam] = f"{type(exc).__name__}: {exc}"
            report["families"][fam] = {"error": report["failed"][fam]}
            if isinstance(exc, FidelityError):  # a probe that measured no approximate KV: exit 5
                report.setdefault("fidelity_failed", []).append(fam)
            continue
        report["families"][fam] = {"trace": str(path), "shape": shape_stats(reqs), "report": rep}
        if on_family is not None:
            on_family(report)
    report["checks"] = {f: family_checks(e["report"]) for f, e in report["families"].items() if "report" in e}
    worst: dict[str, Any] = {}
    for mode in ("promptsplice", "promptsplice_pic", "promptsplice_pic_vs_store", "promptsplice_pic_vs_store_whole_block"):
        gaps = [(_gap(e["report"], mode), f) for f, e in report["families"].items() if "report" in e]
        gaps = [(g, f) for g, f in gaps if g is not None]
        if gaps:
            g, f = min(gaps)
            worst[mode] = {"gap_closed": g, "family": f}
            if mode == "promptsplice_pic":  # naive -> oracle: kept, but its PIC figure may carry probes
                worst[mode]["probe_traffic"] = probe_traffic(report["families"][f]["report"])
    # families left out of the pic-vs-store check and worst line, and why
    report["pic_vs_store_skipped"] = {f: why for f, e in report["families"].items()
                                      if "report" in e and (why := pic_vs_store_skip(e["report"])) is not None}
    covs = [(c["coverage"], f) for f, c in report["checks"].items()]
    if covs:
        c, f = min(covs)
        worst["coverage"] = {"coverage": c, "family": f}
    report["worst"] = worst
    return report


def suite_status(report: dict[str, Any], *, allow_skips: bool = False) -> int:
    """The suite's exit status (module doc), each failure printed."""
    import sys

    from promptsplice.benchmarks.rag import bench_status

    rc = 0
    for fam, e in report["families"].items():
        if "report" in e:
            frc = bench_status(e["report"], allow_skips=allow_skips, what=f"bench rag --suite, family {fam}")
            if frc == BOUND_EXIT or (frc and rc != BOUND_EXIT):
                rc = frc
    if report.get("fidelity_failed") and rc != BOUND_EXIT:
        rc = FIDELITY_EXIT
    if report["failed"] and not rc:
        rc = 1
    if report["failed"]:
        print("promptsplice: error: failed families: " + ", ".join(report["failed"]), file=sys.stderr)
    return rc


def format_suite(report: dict[str, Any]) -> str:
    lines = [
        "| family | naive | promptsplice | promptsplice_store | promptsplice_pic | radix (cache) | oracle "
        "| oracle (cache) | gap promptsplice | gap pic | pic vs store | mirror = vLLM | coverage |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fam, e in report["families"].items():
        if "error" in e:
            lines.append(f"| {fam} | failed: {e['error']} |")
            continue
        r, m, b, c = e["report"], e["report"]["modes"], e["report"]["bounds"], report["checks"][fam]
        pic = m.get(PIC_MODE, {}).get("prefill_tokens", "-")
        sto = m.get("promptsplice_store", {}).get("prefill_tokens", "-")
        g = [_gap(r, k) for k in ("promptsplice", "promptsplice_pic", "promptsplice_pic_vs_store")]
        g1, g2, g3 = ("-" if x is None else f"{x:.2f}" for x in g)
        if g2 != "-" and probe_traffic(r):  # PIC's prefill carries the probes' traffic
            pic, g2 = f"{pic}*", f"{g2}*"
        lines.append(
            f"| {fam} | {m['naive']['prefill_tokens']} | {m['promptsplice']['prefill_tokens']} | {sto} | {pic} | "
            f"{b['radix_capacity_prefill_tokens']} | {r['oracle_prefill_tokens']} | "
            f"{b['oracle_capacity_prefill_tokens']} | {g1} | {g2} | {g3} | "
            f"{'yes' if c['mirror_equal'] else 'NO'} | {c['coverage']:.2f} |"
        )
    for mode, w in report["worst"].items():
        if mode == "coverage":
            flag = "" if w["coverage"] >= MIN_COVERAGE else " (below the bar)"
            lines.append(f"worst coverage: {w['coverage']:.2f} ({w['family']}){flag}")
        else:
            traffic = " (PIC ran with fidelity probe traffic)" if w.get("probe_traffic") else ""
            lines.append(f"worst {mode}: gap {w['gap_closed']:.2f} ({w['family']}){traffic}")
    skipped = report.get("pic_vs_store_skipped") or {}
    for why in dict.fromkeys(skipped.values()):  # one line per reason, its families
        lines.append(f"pic vs store: skipped {', '.join(f for f, w in skipped.items() if w == why)}: {why}")
    if any(PROBE_TRAFFIC_SKIP in why for why in skipped.values()):
        lines.append("*: promptsplice_pic's prefill and gap include the fidelity probes' traffic on its "
                     "engine (no like-for-like figure; take it from a run with --fidelity-requests 0)")
    for fam, c in report["checks"].items():
        if not c["le_radix_capacity"]:
            lines.append(f"{fam}: promptsplice prefilled more than the capacity-matched radix ideal")
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
    allow_skips: bool = False,
    one_store_engine: bool = False,
    pic_exact_alignment: str = "auto",
    kv_cache_bytes: int | None = None,
    store_layout: str = "store_aware",
    pic_recompute_at: str | None = None,
    pic_max_deviation: float | None = None,
    dtype: str = "auto",
    pic_index_computed: bool = False,
) -> int:
    """The CLI's job: start the plain engine once (and fresh store engines per family and
    mode), run the suite, print, write the JSON; exit status from :func:`suite_status`."""
    import shutil
    import tempfile

    from promptsplice.assembler import AlignPolicy, OrderPolicy

    OrderPolicy.parse(policy)  # fail fast, before the engines start
    AlignPolicy.parse(alignment)
    check_store_layout(store_layout, pic_exact_alignment=pic_exact_alignment, recompute_blocks=recompute_blocks,
                       pic_recompute_at=pic_recompute_at, pic_max_deviation=pic_max_deviation)
    out = Path(json_out)
    trace_dir = trace_dir if trace_dir is not None else out.with_name(out.stem + "-traces")
    suite_trace_dir(trace_dir, SUITE if families is None else families)  # a bad folder fails before the engines start
    root = tempfile.mkdtemp(prefix="promptsplice-rag-store-")
    engine, kv_factory = start_rag_engines(root, kv_cache_bytes=kv_cache_bytes, dtype=dtype)
    kv_engine = kv_factory() if one_store_engine else kv_factory
    partial = out.with_name(out.stem + ".partial.json")
    try:
        report = rag_suite(
            engine, kv_engine=kv_engine, on_family=lambda r: partial.write_text(json.dumps(r, indent=2) + "\n"), families=SUITE if families is None else families,
            requests=60 if requests is None else requests, seed=seed,
            trace_dir=trace_dir,
            policy=policy, alignment=alignment, max_tokens=max_tokens,
            recompute_blocks=recompute_blocks, fidelity_requests=fidelity_requests,
            pic_exact_alignment=pic_exact_alignment, store_layout=store_layout, pic_recompute_at=pic_recompute_at,
            pic_max_deviation=pic_max_deviation, pic_index_computed=pic_index_computed,
        )
    finally:
        if one_store_engine:
            kv_engine.close()
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
    for fam, e in report["families"].items():
        if "report" in e:
            print(f"## {fam}\n{format_modes(e['report'])}\n")
    print(format_suite(report))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return suite_status(report, allow_skips=allow_skips)
