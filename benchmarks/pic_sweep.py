"""The r sweep of position-independent reuse: ``promptsplice_pic`` of ``bench rag`` once
per configuration, each on a fresh store engine (an empty KV cache and store of the
bench's sizes, so no configuration runs on what an earlier one left: equal capacity),
beside one plain engine for the fidelity probes' exact prefills.  Every request relocates what it can
(``relocate="always"``): the sweep studies relocation itself, not the runner's gate.

    python -m promptsplice.benchmarks.pic_sweep --trace T --baseline RAG.json --requests 40 \\
        --fidelity-requests 6 packed:0 packed:1 packed:2 standalone:0

``--baseline``: a ``bench rag`` JSON of the same trace and request count, for the naive
prefill and the oracle (the gap's ends).  Prints one JSON line per configuration.

**The baseline must be of the same run.**  ``gap_closed`` divides by the baseline's
naive -> oracle gap, so a baseline of another trace, request count or cache says
nothing of the sweep.  Before any engine starts, its ``trace`` must be the ``--trace``
file (the same path, resolved from here) and its ``steps_total`` the requests read
(``--requests``); once the engines are up, its ``bounds.kv_cache_blocks`` and
``block_size`` must be the engines', its store (``pic.store_dram_bytes``,
``store.store_disk_bytes``) the sweep's, and its ``skipped_requests`` the requests
that do not fit here (:func:`promptsplice.benchmarks.rag._fitting`: the sweep runs
the same requests as the baseline).  Else :class:`BaselineMismatchError` (a
``ConfigError``: exit status 2) names the field and both values.

**Checks, as ``bench rag`` applies them to ``promptsplice_pic``**
(:func:`promptsplice.benchmarks.rag.bench_status`): coverage of the trace
(``COVERAGE_EXIT``, 3, below 0.95 unless ``--allow-skips``), fidelity probes made of
those owed (``check_probes``, also 3), and the PIC mode's bound (the baseline's
unbounded oracle, ``bound_checks``: ``BOUND_EXIT``, 4, which wins).  Every
configuration runs and prints its line (with ``coverage``, ``steps_run``,
``steps_total``, ``probe_coverage``, ``probes_eligible``, ``bound_prefill_tokens``,
``bound_holds`` and ``status``); the exit status is the worst of them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from promptsplice.assembler import PromptFormat
from promptsplice.benchmarks.agent import start_mode_engine
from promptsplice.benchmarks.bounds import BOUND_EXIT, bound_checks
from promptsplice.benchmarks.coverage import Coverage
from promptsplice.benchmarks.rag import PIC_MODE, _fitting, _run_pic, bench_status
from promptsplice.benchmarks.traces import read_rag_trace
from promptsplice.benchmarks.cli import UsageError, count_arg, run_tool
from promptsplice.errors import ConfigError

__all__ = ["BaselineMismatchError", "check_baseline_run", "check_baseline_engines", "main"]


class BaselineMismatchError(ConfigError):
    """``--baseline`` is a ``bench rag`` report of another run (trace, request count,
    skipped requests, KV cache, block size or store): its gap is not the sweep's.  Pass
    the report of ``promptsplice bench rag`` on the same trace and ``--requests``, with
    the engines' default sizes, or rerun it."""


def _field(base: dict, path: str, baseline: str) -> Any:
    node: Any = base
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise BaselineMismatchError(
                f"--baseline {baseline}: lacks {path}, so it cannot be checked to be of this run; rerun "
                "promptsplice bench rag --json on the same trace and --requests"
            )
        node = node[key]
    return node


def _differs(baseline: str, path: str, theirs: Any, ours: Any, how: str) -> BaselineMismatchError:
    return BaselineMismatchError(
        f"--baseline {baseline}: its {path} is {theirs!r}, this sweep's {ours!r}: the gap's ends would come from "
        f"another run; {how}"
    )


def check_baseline_run(base: dict, baseline: str, trace: str, requests: int) -> None:
    """The baseline's trace and request count are the sweep's (before any engine starts)."""
    theirs = _field(base, "trace", baseline)
    if Path(str(theirs)).resolve() != Path(trace).resolve():
        raise _differs(baseline, "trace", str(theirs), trace,
                       "pass the baseline's --trace (the same file, by the same path from this folder), or "
                       "rerun bench rag on this trace")
    total = _field(base, "steps_total", baseline)
    if total != requests:
        raise _differs(baseline, "steps_total (requests read)", total, requests,
                       f"pass --requests {total} (the baseline's), or rerun bench rag with --requests {requests}")


def check_baseline_engines(base: dict, baseline: str, engine: Any, kv: Any, skipped: list[int]) -> None:
    """The baseline's KV cache, block size, store and skipped requests are the sweep's."""
    how = "rerun bench rag with the engines' default KV cache and store sizes (no --kv-cache-bytes)"
    for path, ours in (("bounds.kv_cache_blocks", engine.num_blocks), ("pic.kv_cache_blocks", kv.num_blocks),
                       ("block_size", engine.block_size), ("pic.store_dram_bytes", kv.kv_store.config.dram_bytes),
                       ("store.store_disk_bytes", kv.kv_store.config.disk_bytes)):
        theirs = _field(base, path, baseline)
        if theirs != ours:
            raise _differs(baseline, path, theirs, ours, how)
    theirs = _field(base, "skipped_requests", baseline)
    if list(theirs) != skipped:
        raise _differs(baseline, "skipped_requests", theirs, skipped,
                       "the engines' context differs from the baseline's; " + how)


def _config(cfg: str) -> tuple[str, int, str | None]:
    """``PRECOMPUTE:R[:AT]`` -> (precompute, recomputed blocks, where: run, chunk or None,
    the level's)."""
    precompute, sep, rest = cfg.partition(":")
    r, _, at = rest.partition(":")
    if not sep or not precompute or not r.isdigit() or at not in ("", "run", "chunk"):
        raise UsageError(f"config {cfg!r}: write PRECOMPUTE:R[:AT] with R a count of blocks and AT run "
                         "or chunk (default: the level's), e.g. packed:1 or packed:2:run")
    return precompute, int(r), at or None


def _baseline(path: str) -> dict:
    """A ``bench rag`` report: its naive mode and oracle are the sweep's gap's two ends."""
    try:
        with open(path, encoding="utf-8") as fh:
            base = json.load(fh)
        base["modes"]["naive"], base["oracle_prefill_tokens"]  # noqa: B018 - both must be there
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--baseline {path}: not a bench rag report ({type(exc).__name__}: {exc}); "
                         "pass the JSON of promptsplice bench rag --json") from None
    return base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.pic_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--requests", type=count_arg(1), default=40)
    ap.add_argument("--fidelity-requests", type=count_arg(0), default=6)
    ap.add_argument("configs", nargs="+", help="PRECOMPUTE:R[:AT], e.g. packed:1, standalone:0 or packed:2:chunk")
    ap.add_argument("--allow-skips", action="store_true",
                    help="accept coverage (requests run, probes made) below 95%% (as bench rag)")
    args = ap.parse_args(argv)
    configs = [_config(cfg) for cfg in args.configs]  # every bad input fails before an engine starts
    base = _baseline(args.baseline)
    reqs = read_rag_trace(args.trace, limit=args.requests)
    check_baseline_run(base, args.baseline, args.trace, len(reqs))
    _field(base, "radix_prefill_tokens", args.baseline)  # the bound check's other end
    max_tokens = int(base.get("max_tokens") or 8)  # the baseline's, so both ends of the gap match
    rc = 0
    engine = start_mode_engine("full")
    try:
        # the requests the baseline ran: those that fit, as bench rag decides it
        fmt = PromptFormat.chatml()
        asm = engine.make_assembler(policy=base.get("policy") or "cache_aware",
                                    alignment=base.get("alignment") or "auto", prompt_format=fmt)
        keep = _fitting(engine, asm, asm.format, reqs)
        kept = set(keep)
        skipped = [i for i in range(len(reqs)) if i not in kept]
        run = [reqs[i] for i in keep]
        for cfg, (precompute, r, at) in zip(args.configs, configs):
            root = tempfile.mkdtemp(prefix="promptsplice-pic-sweep-")  # its store's disk tier, removed after it
            kv = start_mode_engine("splice", store_dir=root)
            report: dict[str, Any] = {"modes": {"naive": base["modes"]["naive"]},
                                      "oracle_prefill_tokens": base["oracle_prefill_tokens"],
                                      **Coverage(len(keep), len(reqs)).report(), "skipped_requests": skipped}
            t0 = time.time()
            try:
                check_baseline_engines(base, args.baseline, engine, kv, skipped)  # before the mode runs
                _run_pic(report, {}, engine, kv, run, policy="cache_aware", max_tokens=max_tokens, progress=None,
                         prompt_format=fmt, recompute_blocks=r,
                         fidelity_requests=args.fidelity_requests, precompute=precompute,
                         salt=f"sweep-{cfg}-{time.time()}", relocate="always", recompute_at=at)  # what relocation does
            finally:
                kv.close()
                shutil.rmtree(root, ignore_errors=True)
            m, p, f = report["modes"][PIC_MODE], report["pic"], report["fidelity"]
            # the PIC mode's bound, as bench rag checks it: the baseline's unbounded oracle
            report["bounds"] = {"checks": bound_checks({PIC_MODE: m["prefill_tokens"]},
                                                       radix=base["radix_prefill_tokens"],
                                                       oracle=base["oracle_prefill_tokens"])}
            check = report["bounds"]["checks"][PIC_MODE]
            status = bench_status(report, allow_skips=args.allow_skips, what=f"pic_sweep {cfg}")
            print(json.dumps({
                "config": cfg, "recompute_at": p["recompute_at"], "prefill_tokens": m["prefill_tokens"],
                "gap_closed": p["gap_closed"],
                "ttft_p50_ms": m["ttft_p50_ms"], "engine_requests": p["engine_requests"],
                "tf_top1_agreement": f["tf_top1_agreement"], "first_token_kl": f["first_token_kl"],
                "first_token_kl_p50": f["first_token_kl_p50"], "first_token_kl_p90": f.get("first_token_kl_p90"),
                "first_token_kl_max": f["first_token_kl_max"],
                "greedy_agreement": f["greedy_agreement"], "control": f["control"], "bench_s": round(time.time() - t0),
                "coverage": report["coverage"], "steps_run": report["steps_run"], "steps_total": report["steps_total"],
                "probe_coverage": f.get("probe_coverage"), "probes_eligible": f.get("eligible"),
                "bound_prefill_tokens": check["bound_prefill_tokens"], "bound_holds": check["holds"],
                "status": status,
            }), flush=True)
            if status == BOUND_EXIT or (status and rc != BOUND_EXIT):
                rc = status
    finally:
        engine.close()
    return rc


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
