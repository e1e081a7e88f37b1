"""``python -m promptsplice.benchmarks.shared_tier``: two engines sharing blocks on Redis.

Two engines (the default model, each with the splice connector, the same small KV cache,
the same DRAM store and the same Redis tier) serve one repeat-heavy RAG trace
round-robin (request ``i`` goes to engine ``i % 2``), in up to three modes, same prompts,
caches and stores emptied between modes:

* ``local``: each engine uses its own ``cache_salt``, so neither can load the other's
  blocks (tenants never meet): the pair without sharing, at equal capacity (each
  engine's own blocks still come back from Redis, as in the other modes);
* ``shared``: one salt, so an engine loads the blocks the other computed;
* ``outage``: as ``shared``, but the server is SIGKILLed after a third of the trace and
  restarted (empty) after two thirds.

Per mode: ``prefill_tokens`` (prompt tokens minus vLLM's ``num_cached_tokens``, both
engines), ``external_hits`` (vLLM's ``external_prefix_cache_hits``), ``failed``
(requests that raised), the stores' remote counters, and the outputs compared with
``local`` request by request (greedy: a wrong block would change them).

**Failed requests.**  A request that raises is counted, not hidden: each mode reports
``coverage``, ``steps_run``, ``steps_total``, ``skipped_steps``
(:mod:`promptsplice.benchmarks.coverage`), ``failed_requests`` (trace indices) and
``errors`` (the first few, ``"index: Type: message"``); its ``prompt_tokens`` and
``prefill_tokens`` count the requests that ran.  Every mode stays in ``bound_checks``:
a mode with failures is checked against the bound of the requests it ran
(:func:`prefix_bound` with ``failed``: a failed prompt counts no tokens but may have
left its blocks behind, so the bound stays a lower bound), and the check names the
requests it covers (``requests_run``).  ``shared_over_local_prefill`` compares the
pair's prefill over the same requests only: when ``local`` or ``shared`` had a failed
request it is ``null`` and ``shared_over_local_prefill_reason`` says why.

Exit status (``main``): a mode below its bound ``BOUND_EXIT`` (4); else a mode that ran
less than ``MIN_COVERAGE`` of the trace ``COVERAGE_EXIT`` (3) unless ``--allow-skips``;
and any failed request of ``outage`` is ``COVERAGE_EXIT`` whatever ``--allow-skips``
says: that mode's point is that every request survives a killed Redis.

``coverage_of_other_blocks``: of the blocks an engine needed beyond its own prefix cache
that the other engine had already computed (the leading blocks of its prompt whose
chain hashes the other prefilled earlier in the mode), the share its connector loaded.
``shared_over_local_prefill``: the pair's prefill, shared / local.  After each request
the bench waits for that engine's write-behind to reach the server (plus 50 ms for the
other engine's listener): it measures the tier, not thread scheduling.  The outage mode
reports the share of cacheable tokens served from cache before, during and after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.bounds import BOUND_EXIT, BoundError, _leading_run, check_bounds, prefix_bound
from promptsplice.benchmarks.coverage import COVERAGE_EXIT, Coverage, CoverageError, check_coverage
from promptsplice.errors import ConfigError
from promptsplice.benchmarks.cli import _check_writable, count_arg, run_tool

__all__ = ["run_shared_tier_bench", "format_shared_tier", "prefix_bound", "suite_bounds", "shared_tier_status",
           "MODES"]

MODES = ("local", "shared", "outage")
DEFAULT_REQUESTS = 40
"""Requests of a generated trace (a ``--trace`` file runs whole unless ``--requests``)."""


def _prompts(engine: Any, requests: Sequence[Any]) -> list[list[int]]:
    from promptsplice.assembler import PromptFormat
    from promptsplice.benchmarks.assemble import _chunks

    asm = engine.make_assembler(prompt_format=PromptFormat.chatml())
    out = []
    for req in requests:
        prompt = asm.assemble(_chunks(req), query=req.query, system=req.system or None)
        out.append(list(prompt.token_ids))
    return out


def _family_requests(family: str | None, requests: int | None, seed: int, trace: str | Path | None) -> list[Any]:
    from promptsplice.benchmarks.traces import generate_family_trace, generate_rag_trace, read_rag_trace

    if trace:
        if family is not None:
            raise ConfigError(f"pass a trace or a family, not both (--trace {trace}, --family {family})")
        return read_rag_trace(trace, limit=requests)  # (None: the whole file)
    requests = DEFAULT_REQUESTS if requests is None else requests
    if family is None:
        return generate_rag_trace(requests=requests, seed=seed, profile="repeat-heavy")
    return generate_family_trace(family, requests=requests, seed=seed)


def suite_bounds(requests: int = 200, *, seed: int = 0, block_size: int = 32,
                 kv_cache_blocks: int = 160) -> dict[str, dict[str, Any]]:
    """:func:`prefix_bound` of every family of the suite, on the prompts the bench sends
    (ChatML, assembled at ``block_size``); no engine needed."""
    from promptsplice.assembler import Assembler, MirrorView, PrefixCacheMirror, PromptFormat, default_tokenizer
    from promptsplice.benchmarks.assemble import _chunks
    from promptsplice.benchmarks.traces import SUITE

    # as the bench's assembler: a view of its engine's mirror, empty while it assembles
    # every prompt before the first runs (one that admitted its own prompts laid out
    # 151 of 200 wiki prompts otherwise)
    mirror = MirrorView(PrefixCacheMirror(block_size, capacity_blocks=kv_cache_blocks - 1))
    asm = Assembler(default_tokenizer(), block_size=block_size, prompt_format=PromptFormat.chatml(), max_tokens=4095,
                    mirror=mirror)
    out = {}
    for family in SUITE:
        reqs = _family_requests(family, requests, seed, None)
        prompts = [list(asm.assemble(_chunks(r), query=r.query, system=r.system or None).token_ids) for r in reqs]
        out[family] = dict(prefix_bound(prompts, block_size), requests=len(reqs))
    return out


def _run_mode(
    mode: str,
    engines: Sequence[Any],
    prompts: list[list[int]],
    *,
    server: Any,
    max_tokens: int,
    settle_s: float = 0.05,
    progress: bool = False,
) -> tuple[dict[str, Any], list[list[int]]]:
    from promptsplice.blocks import chain_hashes

    bs = engines[0].block_size
    salts = (f"{mode}-a", f"{mode}-b") if mode == "local" else (mode, mode)
    n = len(prompts)
    kill_at, back_at = (n // 3, 2 * n // 3) if mode == "outage" else (-1, -1)
    computed: tuple[set[bytes], set[bytes]] = (set(), set())  # chain hashes each engine prefilled
    eligible = covered = 0
    failed: list[int] = []  # indices of the requests that raised
    errors: list[str] = []
    prompt_tokens = cached = external = 0
    per_request: list[tuple[int, int]] = []  # (cacheable tokens, cached tokens)
    outputs: list[list[int]] = []
    stats0 = [e.kv_store.stats() for e in engines]
    t0 = time.perf_counter()
    for i, tokens in enumerate(prompts):
        if i == kill_at:
            server.kill()
        if i == back_at:
            server.start()
        engine = engines[i % 2]
        before = engine.counters()
        try:
            comp = engine.generate(tokens, max_tokens=max_tokens, cache_salt=salts[i % 2])
        except Exception as exc:  # noqa: BLE001 - the bench counts failures (and fails on them)
            failed.append(i)
            if len(errors) < 5:
                errors.append(f"{i}: {type(exc).__name__}: {exc}"[:300])
            outputs.append([])
            per_request.append(((len(tokens) - 1) // bs * bs, 0))
            continue
        seen = engine.counters().since(before)
        # The blocks it saved reach the server (and the other engine's index) before
        # the next request: requests on two machines are not a millisecond apart, and
        # this measures the tier, not thread scheduling on a loaded bench machine.
        engine.kv_store.drain()
        time.sleep(settle_s)
        if progress:
            print(f"[shared_tier] {mode} {i + 1}/{n}", file=sys.stderr, flush=True)
        outputs.append(list(comp.token_ids))
        prompt_tokens += len(tokens)
        cached += comp.num_cached_tokens
        external += seen.external_hits
        per_request.append(((len(tokens) - 1) // bs * bs, comp.num_cached_tokens))
        every = chain_hashes(tokens, bs)  # the full blocks it computed or was served
        hashes = every[: (len(tokens) - 1) // bs]  # those it could be served
        local = seen.prefix_cache_hits // bs
        loaded = seen.external_hits // bs
        run = _leading_run(hashes, computed[1 - i % 2])
        eligible += max(0, run - local)
        covered += max(0, min(local + loaded, run) - local)
        computed[i % 2].update(every[local + loaded :])
    wall = time.perf_counter() - t0
    stats = [e.kv_store.stats() for e in engines]
    keys = ("remote_hits", "remote_writes", "remote_outages", "remote_corrupt", "remote_skipped")
    report: dict[str, Any] = {
        "requests": n,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "prefill_tokens": prompt_tokens - cached,
        "external_hits": external,
        "failed": len(failed),
        "failed_requests": failed,
        "errors": errors,
        **Coverage(n - len(failed), n).report(),
        "wall_s": round(wall, 2),
        "coverage_of_other_blocks": round(covered / eligible, 4) if eligible else None,
        "eligible_blocks": eligible,
        "stores": [{k: getattr(b, k) - getattr(a, k) for k in keys} for a, b in zip(stats0, stats)],
    }
    if mode == "outage":

        def share(lo: int, hi: int) -> float | None:
            part = per_request[lo:hi]
            total = sum(p for p, _ in part)
            return round(sum(c for _, c in part) / total, 4) if total else None

        report["hit_share"] = {"before": share(0, kill_at), "during": share(kill_at, back_at), "after": share(back_at, n)}
    return report, outputs


def _empty(engines: Sequence[Any], url: str) -> None:
    """Empty both engines' prefix caches and stores, and the server."""
    import redis

    for e in engines:
        e.reset_prefix_cache()
        e.kv_store.clear()
        e.kv_store.drain()
    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def run_shared_tier_bench(
    *,
    json_out: str | Path | None = None,
    requests: int | None = None,
    trace: str | Path | None = None,
    family: str | None = None,
    modes: Sequence[str] = MODES,
    kv_cache_blocks: int = 160,
    dram_blocks: int = 64,
    max_tokens: int = 4,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the modes on one pair of engines; returns the report."""
    from promptsplice.benchmarks._redis_server import RedisServer
    from promptsplice.benchmarks.offload import _bytes_per_block
    from promptsplice.engine_adapters import EmbeddedEngine, StoreConfig

    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}: use some of {', '.join(MODES)}")
    reqs = _family_requests(family, requests, seed, trace)
    per_block = _bytes_per_block({"block_size": 32})
    report: dict[str, Any] = {"modes": {}}
    outputs: dict[str, list[list[int]]] = {}
    with RedisServer(maxmemory="1gb") as server:
        engines = []
        try:
            for i in range(2):
                # dram_bytes differ by a byte: two configs, so the process opens two
                # stores (one per "machine") instead of sharing one (shared_store()).
                store = StoreConfig(
                    dram_bytes=dram_blocks * per_block + i, remote_bytes=1 << 30, remote_url=server.url
                )
                engines.append(
                    EmbeddedEngine(kv_store=store, kv_cache_bytes=kv_cache_blocks * per_block, max_model_len=4096)
                )
            prompts = _prompts(engines[0], reqs)
            block_size = engines[0].block_size  # the bound's unit: the engines' own blocks
            held = [e.num_blocks for e in engines]  # what each really holds (the ask assumes block 32, a dtype)
            if held[0] != held[1]:
                raise ConfigError(f"shared_tier: the two engines hold {held[0]} and {held[1]} KV blocks; "
                                  "they must run at equal capacity")
            for mode in modes:
                _empty(engines, server.url)
                report["modes"][mode], outputs[mode] = _run_mode(
                    mode, engines, prompts, server=server, max_tokens=max_tokens, progress=progress
                )
        finally:
            for e in engines:
                e.close()
    report["bound"] = prefix_bound(prompts, block_size)
    report["bound_checks"] = {}
    for mode, m in report["modes"].items():  # every mode: one with failures over the requests it ran
        kind = "local" if mode == "local" else "shared"
        b = prefix_bound(prompts, block_size, failed=set(m["failed_requests"])) if m["failed"] else report["bound"]
        report["bound_checks"][mode] = {"bound": kind, "bound_prefill_tokens": b[f"{kind}_prefill"],
                                        "prefill_tokens": m["prefill_tokens"], "requests_run": m["steps_run"]}
    ref = outputs.get("local")
    for mode, outs in outputs.items():
        if ref is not None and mode != "local":
            report["modes"][mode]["outputs_identical_to_local"] = sum(a == b for a, b in zip(outs, ref) if a)
    local, shared = report["modes"].get("local"), report["modes"].get("shared")
    if local and shared:
        ratio, why = None, None
        if local["failed"] or shared["failed"]:  # the two would sum prefill over different requests
            why = (f"requests failed (local {local['failed']}, shared {shared['failed']} of {local['requests']}): "
                   "the two modes' prefill covers different requests")
        elif not local["prefill_tokens"]:
            why = "local prefilled no tokens"
        else:
            ratio = round(shared["prefill_tokens"] / local["prefill_tokens"], 4)
        report["shared_over_local_prefill"] = ratio
        if why:
            report["shared_over_local_prefill_reason"] = why
    source = str(trace) if trace else (f"family {family}" if family else "generated repeat-heavy")
    report["trace"] = {"requests": len(reqs), "source": source}
    report["engines"] = {"kv_cache_blocks": kv_cache_blocks, "num_blocks": held[0], "dram_blocks": dram_blocks,
                         "block_size": block_size}
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def format_shared_tier(report: dict[str, Any]) -> str:
    lines = [
        "| mode | prefill tokens | cached | external hits | failed | same output as local | coverage of the other's blocks |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, m in report["modes"].items():
        same = m.get("outputs_identical_to_local", "-")
        lines.append(
            f"| {mode} | {m['prefill_tokens']} | {m['cached_tokens']} | {m['external_hits']} | {m['failed']} "
            f"| {same} | {m['coverage_of_other_blocks']} |"
        )
    if report.get("shared_over_local_prefill_reason"):
        lines.append(f"pair prefill shared/local: n/a ({report['shared_over_local_prefill_reason']})")
    elif "shared_over_local_prefill" in report:
        b = report.get("bound") or {}
        lines.append(f"pair prefill shared/local: {report['shared_over_local_prefill']} (bound with caches that "
                     f"never evict: {b.get('shared_over_local')}, local {b.get('local_prefill')}, "
                     f"shared {b.get('shared_prefill')} tokens)")
    out = report["modes"].get("outage")
    if out:
        lines.append(f"outage hit share before/during/after: {out['hit_share']}")
    return "\n".join(lines)


def shared_tier_status(report: dict[str, Any], *, allow_skips: bool = False) -> int:
    """0, or the exit status of a failed check (printed): a mode that ran too little of
    the trace, or any failed request of ``outage`` (``COVERAGE_EXIT``), then a mode below
    its bound (``BOUND_EXIT``, which wins)."""
    rc = 0
    for mode, m in report["modes"].items():
        first = f"; first error: {m['errors'][0]}" if m.get("errors") else ""
        if mode == "outage" and m["failed"]:
            print(f"promptsplice: error: shared_tier outage: {m['failed']} of {m['requests']} requests failed "
                  f"(requests {m['failed_requests']}){first}: this mode's requirement is that every request "
                  "survives a killed or restarted Redis (the connector computes what it cannot load), so "
                  "--allow-skips does not apply; fix the connector's outage path", file=sys.stderr)
            rc = COVERAGE_EXIT
            continue
        try:
            check_coverage(Coverage(m["steps_run"], m["steps_total"]), allow_skips=allow_skips,
                           what=f"shared_tier {mode}")
        except CoverageError as exc:
            print(f"promptsplice: error: {exc} (here: {m['failed']} requests raised, "
                  f"modes.{mode}.failed_requests names them{first})", file=sys.stderr)
            rc = COVERAGE_EXIT
    try:
        check_bounds(report["bound_checks"], what="shared_tier")
    except BoundError as exc:
        print(f"promptsplice: error: {exc}", file=sys.stderr)
        rc = BOUND_EXIT
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.shared_tier", description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where to write the report")
    p.add_argument("--requests", type=count_arg(1), default=None,
                   help=f"requests to run (default: a --trace file's all, else {DEFAULT_REQUESTS}; --bounds-only: 200)")
    p.add_argument("--trace", default=None, help="a RAG trace (promptsplice bench gen-trace); default: generated")
    p.add_argument("--family", default=None, help="a trace family of the suite (default: wiki's repeat-heavy)")
    p.add_argument("--bounds-only", action="store_true",
                   help="only the prefill bounds of every family of the suite (no engine)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--allow-skips", action="store_true",
                   help="accept a mode that ran under 95%% of its requests (never outage's failures)")
    args = p.parse_args(argv)
    _check_writable("--json", args.json, "the report's", args.trace)  # before the run, as the CLI's
    if args.bounds_only:
        ignored = [flag for flag, value, default in (("--trace", args.trace, None), ("--family", args.family, None),
                                                      ("--modes", args.modes, ",".join(MODES)),
                                                      ("--allow-skips", args.allow_skips, False))
                   if value != default]
        if ignored:  # the bounds are the suite's generated families': they say nothing of these
            p.error(f"--bounds-only computes the suite's families' bounds; drop {', '.join(ignored)}")
        bounds = suite_bounds(200 if args.requests is None else args.requests)
        Path(args.json).write_text(json.dumps({"bounds": bounds}, indent=2) + "\n")
        print("| family | requests | prompt tokens | local prefill | shared prefill | shared/local |")
        print("|---|---|---|---|---|---|")
        for fam, b in bounds.items():
            print(f"| {fam} | {b['requests']} | {b['prompt_tokens']} | {b['local_prefill']} | "
                  f"{b['shared_prefill']} | {b['shared_over_local']} |")
        print(f"wrote {args.json}")
        return 0
    modes = args.modes.split(",")
    for name in modes:  # before any engine or server starts
        if name not in MODES:
            p.error(f"--modes: {name!r} is not one of {','.join(MODES)}")
    if args.trace and not os.path.isfile(args.trace):
        p.error(f"--trace {args.trace}: no such file")
    report = run_shared_tier_bench(
        json_out=args.json, requests=args.requests, trace=args.trace, family=args.family,
        modes=modes, progress=True,
    )
    print(format_shared_tier(report))
    print(f"wrote {args.json}")
    return shared_tier_status(report, allow_skips=args.allow_skips)


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
