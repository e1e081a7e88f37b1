"""``python -m promptsplice.benchmarks.routing``: prefix-affinity vs round-robin routing over real servers.

Starts ``endpoints`` real ``vllm serve`` processes on loopback (the default model, block
32, prefix caching, a small KV cache each), assembles the built-in RAG sample with a
stable-order :class:`promptsplice.assembler.Assembler`, and sends the same prompts (token ids) through
:class:`promptsplice.engine_adapters.PrefixRouter` and through :class:`promptsplice.engine_adapters.RoundRobinRouter`.
Each router's run has its own ``cache_salt``, so both start from an empty cache on every
server.  The cluster hit rate is the servers' own count: ``cached_tokens`` from each
response's ``usage.prompt_tokens_details`` summed over requests, divided by prompt
tokens; the servers' ``/metrics`` counters are read too and must agree.

**Agreement** (checked when every server exposes ``vllm:prefix_cache_hits_total``;
else ``metrics_cached_tokens`` is only a partial sum and nothing is compared): the
responses' ``cached_tokens`` summed over the run must equal the rise of the servers'
``prefix_cache_hits`` plus ``external_prefix_cache_hits`` (a KV connector's hits,
``metrics_external_cached_tokens``; ``null`` when no server exposes it), else
:class:`~promptsplice.errors.EngineError` names both numbers.  No tolerance: in vLLM
0.32 both sides count one admission-time figure (local + external cached tokens, a
preempted request's re-admission in neither), and a server records a step's stats
before it answers, so counters read after the last response hold every request (with
``--concurrency`` too: they are read once all answered).  The servers must serve
nothing else during a run.

JSON written by ``--json``::

    {"routers": {"affinity" | "round_robin": {"requests", "prompt_tokens",
     "cached_tokens", "hit_rate", "per_endpoint_requests", "metrics_cached_tokens",
     "metrics_external_cached_tokens"}},
     "endpoints": 2, "block_size": 32, "key_blocks": 4, "load_factor": 1.25,
     "concurrency": 1}

The servers come from :func:`promptsplice.benchmarks.servers.loopback_servers` (their
process groups, watchdog, readiness and ``PROMPTSPLICE_SERVER_START_S`` live there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from promptsplice.errors import ConfigError, EngineError
from promptsplice._validate import check_int
from promptsplice.benchmarks.bounds import BOUND_EXIT, BoundError, check_bounds, prefix_bound
from promptsplice.benchmarks.cli import _check_writable, count_arg, run_tool
from promptsplice.benchmarks.servers import BLOCK_SIZE, loopback_servers

__all__ = [
    "RoutedResult",
    "assemble_trace",
    "format_routing",
    "main",
    "route_trace",
    "run_routing_bench",
    "write_report",
]



def assemble_trace(requests: int, *, seed: int = 0, block_size: int = BLOCK_SIZE, tokenizer: Any = None) -> list:
    """The built-in RAG sample, assembled (stable order, ChatML) at ``block_size``."""
    from promptsplice.assembler import Assembler, PromptFormat
    from promptsplice.benchmarks.traces import sample_rag_requests

    asm = Assembler(tokenizer, block_size=block_size, policy="stable", prompt_format=PromptFormat.chatml())
    return [  # assemble(), as sent: the stable order learns popularity as the trace goes
        asm.assemble(
            [{"id": c.id, "text": c.text, "metadata": c.metadata} for c in r.chunks],
            query=r.query, system=r.system or None,
        )
        for r in sample_rag_requests(requests, seed=seed)
    ]


@dataclass(slots=True)
class RoutedResult:
    """One request's outcome: where it went and what the server reported."""

    index: int
    endpoint: str
    prompt_tokens: int
    cached_tokens: int


def route_trace(
    router: Any,
    engines: dict[str, Any],
    prompts: Sequence[Any],
    *,
    salt: str,
    max_tokens: int = 1,
    concurrency: int = 1,
) -> dict[str, Any]:
    """Send ``prompts`` (token ids, under ``salt``) through ``router`` to ``engines``
    (endpoint -> ``RemoteEngine``); return the router's totals and every result.

    Raises :class:`EngineError` when a server does not report cached tokens (then the
    hit rate is unknown, not 0), and when the responses' cached tokens disagree with the
    servers' ``/metrics`` (module doc; only when every server exposes the counter).
    """
    before = {e: engines[e].server_counters() for e in engines}

    def one(i: int) -> RoutedResult:
        prompt = prompts[i]
        with router.acquire(prompt) as lease:
            done = engines[lease.endpoint].complete(list(prompt.token_ids), max_tokens=max_tokens, cache_salt=salt)
        if done.cached_tokens is None or done.prompt_tokens is None:
            raise EngineError(
                f"{lease.endpoint} did not report usage.prompt_tokens_details.cached_tokens; "
                "start vllm serve with --enable-prompt-tokens-details"
            )
        return RoutedResult(i, lease.endpoint, done.prompt_tokens, done.cached_tokens)

    if concurrency <= 1:
        results = [one(i) for i in range(len(prompts))]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, range(len(prompts))))
    after = {e: engines[e].server_counters() for e in engines}
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    metrics = sum((after[e].prefix_cache_hits or 0) - (before[e].prefix_cache_hits or 0) for e in engines)
    exposed = [e for e in engines if after[e].external_hits is not None and before[e].external_hits is not None]
    external = sum(after[e].external_hits - before[e].external_hits for e in exposed) if exposed else None
    if all(after[e].prefix_cache_hits is not None and before[e].prefix_cache_hits is not None for e in engines):
        if cached != metrics + (external or 0):  # module doc: one count on both sides, no tolerance
            raise EngineError(
                f"the responses reported {cached} cached tokens, the servers' /metrics counted "
                f"{metrics + (external or 0)} ({metrics} prefix-cache hits + {external or 0} external): they must "
                "agree; is another client using the servers, or do they count cached tokens another way?"
            )
    per_endpoint = {e: 0 for e in engines}
    for r in results:
        per_endpoint[r.endpoint] += 1
    return {
        "requests": len(results),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "per_endpoint_requests": per_endpoint,
        "metrics_cached_tokens": metrics,
        "metrics_external_cached_tokens": external,
        "results": results,
    }


def run_routing_bench(
    requests: int = 40,
    *,
    endpoints: int = 2,
    seed: int = 0,
    key_blocks: int | None = None,
    load_factor: float = 1.25,
    max_tokens: int = 1,
    concurrency: int = 1,
    urls: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the trace under both routers; start ``endpoints`` loopback servers unless
    ``urls`` of running servers (block 32, prefix caching, prompt-token details) are given."""
    from promptsplice.engine_adapters import RemoteEngine
    from promptsplice.engine_adapters._router import DEFAULT_KEY_BLOCKS, PrefixRouter, RoundRobinRouter

    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ConfigError(f"requests must be an int >= 1, got {requests!r}")
    kb = DEFAULT_KEY_BLOCKS if key_blocks is None else key_blocks
    if urls is None:
        check_int(endpoints, "endpoints")
    # The router's options (and the URLs: distinct servers) checked before any server
    # starts: a bad load factor failed after minutes of vLLM start-up.
    PrefixRouter(list(urls) if urls is not None else [f"probe-{i}" for i in range(endpoints)],
                 load_factor=load_factor, key_blocks=kb, block_size=BLOCK_SIZE)
    prompts = assemble_trace(requests, seed=seed)
    with contextlib.ExitStack() as stack:
        if urls is None:
            urls = [s.base_url for s in stack.enter_context(loopback_servers(endpoints))]
        engines = {u: stack.enter_context(RemoteEngine(u)) for u in urls}
        routers = {
            "affinity": PrefixRouter(list(engines), load_factor=load_factor, key_blocks=kb, block_size=BLOCK_SIZE),
            "round_robin": RoundRobinRouter(list(engines)),
        }
        run_id = uuid.uuid4().hex[:8]
        report: dict[str, Any] = {"routers": {}, "bound_checks": {}}
        # the floor of any routing: one prefix cache that never evicts, shared by every server
        # (requests in flight together may finish in any order: then the order-free floor)
        floor = prefix_bound([list(p.token_ids) for p in prompts], BLOCK_SIZE, engines=1,
                             any_order=concurrency > 1)["shared_prefill"]
        for name, router in routers.items():
            out = route_trace(router, engines, prompts, salt=f"route-{name}-{run_id}",
                              max_tokens=max_tokens, concurrency=concurrency)
            out.pop("results")
            out["prefill_tokens"] = out["prompt_tokens"] - out["cached_tokens"]
            out["bound_prefill_tokens"] = floor
            report["routers"][name] = out
            report["bound_checks"][name] = {"bound": "prefix", "bound_prefill_tokens": floor,
                                            "prefill_tokens": out["prefill_tokens"],
                                            "holds": out["prefill_tokens"] >= floor}
    report.update(endpoints=len(urls), block_size=BLOCK_SIZE, key_blocks=kb,
                  load_factor=load_factor, concurrency=concurrency)
    return report


def format_routing(report: dict[str, Any]) -> str:
    """A small table: one row per router."""
    lines = [f"{'router':<12} {'requests':>8} {'prompt tok':>10} {'cached tok':>10} {'hit rate':>8}  per endpoint"]
    for name, r in report["routers"].items():
        spread = " ".join(str(v) for v in r["per_endpoint_requests"].values())
        lines.append(
            f"{name:<12} {r['requests']:>8} {r['prompt_tokens']:>10} {r['cached_tokens']:>10} "
            f"{r['hit_rate']:>8.1%}  {spread}"
        )
    lines.append(
        f"{report['endpoints']} loopback vllm serve, block {report['block_size']}, "
        f"key {report['key_blocks']} blocks, load factor {report['load_factor']}"
    )
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``report`` as JSON (parent folders created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.routing", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=count_arg(1), default=40, help="RAG requests (built-in sample)")
    parser.add_argument("--endpoints", type=count_arg(1), default=2, help="loopback servers to start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--key-blocks", type=count_arg(1), default=None, help="blocks in the routing key")
    parser.add_argument("--load-factor", type=float, default=1.25)
    parser.add_argument("--concurrency", type=count_arg(1), default=1, help="requests in flight")
    parser.add_argument("--url", action="append", default=None, help="use a running server (repeat)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.json is not None:  # before the servers start, as the CLI's
        _check_writable("--json", args.json, "the report's", None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    report = run_routing_bench(
        args.requests, endpoints=args.endpoints, seed=args.seed, key_blocks=args.key_blocks,
        load_factor=args.load_factor, concurrency=args.concurrency, urls=args.url,
    )
    print(format_routing(report))
    if args.json:
        print(f"json: {write_report(report, args.json)}")
    try:
        check_bounds(report["bound_checks"], what="routing")
    except BoundError as exc:
        print(f"promptsplice: error: {exc}", file=sys.stderr)
        return BOUND_EXIT
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
