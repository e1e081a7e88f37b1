"""``python -m promptsplice.benchmarks.gateway``: a real gateway (smg) in front of real servers.

Starts two loopback ``vllm serve`` (:func:`promptsplice.benchmarks.servers.loopback_servers`)
unless ``--url`` names running ones, and for each RAG trace family (``--family`` of the
suite, ``--suite`` for all of them, or a wiki ``--profile``) sends
the same requests twice, as *naive* prompts (retrieval order, no dedup, tokenized whole)
and as promptsplice-*assembled* prompts (``Assembler.assemble`` in trace order, as a user
sends them: the stable order learns the chunks' popularity as the trace goes; alignment
``none``, since padding does not survive the text hop), through:

* the Shepherd Model Gateway (PyPI ``smg``, a Rust router; a fresh gateway per
  ``cache_aware`` run, so it never starts with another run's tree; one gateway for all
  runs of each stateless policy) with ``--policy cache_aware``,
  ``prefix_hash`` and ``consistent_hashing`` (header ``X-SMG-Routing-Key`` carrying
  ``prefix_route_key(prompt).hex()``, naive and assembled alike: the chain hash of the
  prompt's first 4 blocks, ``PrefixRouter``'s key);
* :class:`promptsplice.engine_adapters.PrefixRouter` and ``RoundRobinRouter`` direct.

Every prompt is sent as *text* to ``/v1/completions`` in every mode: smg 1.13 refuses
token-id prompts (its ``prompt`` is a string or strings), so the server tokenizes, and
the bench checks that it got exactly the assembled token ids (``prompt_tokens`` equals
their count; the assembled text re-tokenizes to the same ids).  Every run has its own
``cache_salt``, so it starts from an empty cache on every server.  The judge is the
servers' own ``/metrics`` (``vllm:prefix_cache_hits_total``, ``vllm:prompt_tokens_total``,
``vllm:request_success_total``), read before and after each request, so each request is
attributed to the server that ran it; the responses' ``cached_tokens`` must agree.

**Agreement, checked per request** (:class:`~promptsplice.errors.EngineError` naming
both numbers when not): a response's ``cached_tokens`` must equal what its server's
``vllm:prefix_cache_hits_total`` plus ``vllm:external_prefix_cache_hits_total`` (a KV
connector's hits; 0 when the server exposes none) rose by over the request.  No
tolerance: in vLLM 0.32 both sides come from one count made when the request is
admitted (``PrefillStats``: local + external cached tokens; the counters count the
same two, and a preempted request's re-admission is counted by neither), and the
server records a step's stats before it answers, so ``/metrics`` read after the
response already holds them (the per-request attribution by
``vllm:request_success_total`` relies on that too).  ``prefix_cache_hits`` alone
leaves out a connector's hits, hence the sum.  The servers must serve nothing else
during a run: another client's traffic moves their counters.

JSON written by ``--json``::

    {"families": {profile: {"naive" | "assembled": {mode: {"requests", "prompt_tokens",
     "cached_tokens", "prefill_tokens", "cluster_hit_rate", "response_cached_tokens",
     "external_cached_tokens",
     "per_server": {url: {"requests", "prompt_tokens", "cached_tokens"}}}}}},
     "modes": [...], "servers": 2, "block_size": 32, "requests": n, "max_tokens": 1}

(``cached_tokens``: the servers' ``prefix_cache_hits``; ``external_cached_tokens``: their
``external_prefix_cache_hits``, 0 without a connector.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.bounds import BOUND_EXIT, BoundError, check_bounds, prefix_bound
from promptsplice.benchmarks.routing import write_report
from promptsplice.benchmarks.servers import (
    BLOCK_SIZE, START_ENV, LoopbackServer, _free_ports, answered_by, loopback_servers, spawn_logged,
    start_deadline,
)
from promptsplice.errors import ConfigError, EngineError, EngineResponseError, EngineStartError, EngineUnavailableError
from promptsplice.benchmarks.cli import _check_writable, count_arg, run_tool

__all__ = [
    "GATEWAY_POLICIES",
    "MODES",
    "ROUTING_KEY_HEADER",
    "format_gateway",
    "gateway",
    "main",
    "run_gateway_bench",
    "send_through",
    "served_model",
    "server_totals",
]

GATEWAY_POLICIES: tuple[str, ...] = ("cache_aware", "prefix_hash", "consistent_hashing")
"""smg policies the bench runs (``smg launch --policy``)."""

MODES: tuple[str, ...] = (*(f"smg:{p}" for p in GATEWAY_POLICIES), "affinity", "round_robin")
"""Every mode of a run: the gateway policies, then promptsplice's routers direct."""

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""The header smg's ``consistent_hashing`` policy hashes (its session-affinity key)."""

_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:request_success_total")
_EXTERNAL = "vllm:external_prefix_cache_hits_total"  # a KV connector's hits (absent: none)
GATEWAY_DEADLINE_S = 60.0
_WIKI_PROFILES = ("repeat-heavy", "diverse")
_STATELESS = ("prefix_hash", "consistent_hashing")  # route by the request alone: no state to reset
MAX_MODEL_LEN = 4096
"""The servers' context: the longest prompt of the suite (pydocs, naive) is ~2.4K tokens."""


@contextlib.contextmanager
def gateway(
    worker_urls: Sequence[str],
    policy: str,
    *,
    block_size: int = BLOCK_SIZE,
    deadline_s: float | None = None,
) -> Iterator[LoopbackServer]:
    """Start ``smg launch`` on 127.0.0.1 in front of ``worker_urls`` with ``policy``; wait
    until it answers ``/readiness`` with every worker healthy; stop it on exit (its log
    folder too, kept when it failed to start).  ``deadline_s``: default
    ``PROMPTSPLICE_SERVER_START_S`` or 60 s.

    Loopback only: router and metrics bound to 127.0.0.1, no tokenizer download (the
    gateway routes on the request as sent), no tracing, no mesh, HF offline.
    """
    import httpx

    known = GATEWAY_POLICIES + ("round_robin", "random", "power_of_two")
    if policy not in known:
        raise ConfigError(f"unknown smg policy {policy!r}; expected one of {', '.join(known)}")
    if len(worker_urls) < 1:
        raise ConfigError("gateway needs at least one worker url")
    if deadline_s is None:
        deadline_s = start_deadline(GATEWAY_DEADLINE_S)
    port, metrics_port = _free_ports(2)
    log = Path(tempfile.mkdtemp(prefix="smg-")) / "gateway.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", NO_PROXY="127.0.0.1,localhost")
    cmd = [
        sys.executable, "-m", "smg", "launch",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--block-size", str(block_size),
        "--disable-tokenizer-autoload",
        "--log-level", "warn",
    ]
    if policy == "consistent_hashing":
        cmd += ["--routing-key-headers", ROUTING_KEY_HEADER]
    gw = spawn_logged(cmd, log, f"http://127.0.0.1:{port}", env)
    proc = gw.proc
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            if proc.poll() is not None:
                gw.keep_log = True
                raise EngineStartError(f"smg ({policy}) exited with {proc.returncode}:\n{gw.tail()}")
            try:  # loopback: never through a proxy from the environment
                if (httpx.get(gw.base_url + "/readiness", timeout=2, trust_env=False).status_code == 200
                        and answered_by(proc, port)):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                gw.keep_log = True
                raise EngineStartError(f"smg ({policy}) not ready after {deadline_s:.0f} s (on a busy machine, "
                                       f"set {START_ENV} to more seconds):\n{gw.tail()}")
            time.sleep(0.5)
        yield gw
    finally:
        gw.stop()


def server_totals(client: Any, url: str) -> dict[str, int]:
    """``url``'s counters that judge a run: prefix-cache hits, prompt tokens, requests,
    and ``external_cached_tokens`` (a KV connector's hits; 0 when not exposed)."""
    from promptsplice.engine_adapters._remote import parse_prometheus_counters

    try:
        text = client.get(url + "/metrics").raise_for_status().text
    except Exception as exc:  # httpx errors: translated at the boundary
        raise EngineError(f"cannot read {url}/metrics: {exc}") from exc
    values = parse_prometheus_counters(text, (*_COUNTERS, _EXTERNAL))
    missing = [n for n in _COUNTERS if n not in values]
    if missing:
        raise EngineError(f"{url}/metrics lacks {', '.join(missing)} (is it a vLLM server?)")
    return {
        "cached_tokens": int(values["vllm:prefix_cache_hits_total"]),
        "prompt_tokens": int(values["vllm:prompt_tokens_total"]),
        "requests": int(values["vllm:request_success_total"]),
        "external_cached_tokens": int(values.get(_EXTERNAL, 0)),
    }


def send_through(
    client: Any,
    servers: Sequence[str],
    items: Sequence[tuple[str, int, str]],
    *,
    route: Any,
    salt: str,
    model: str,
    max_tokens: int = 1,
) -> dict[str, Any]:
    """Send ``items`` (prompt text, its token count, routing key) one at a time;
    ``route(text, key)`` returns ``(url, headers)`` of where to post.  Each request is attributed to the one server
    whose ``/metrics`` counted it.  Returns the run's totals (see the module doc) and
    ``served_by``: the server of each request, in order."""
    per_server = {u: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0} for u in servers}
    served_by: list[str] = []
    response_cached = external = 0
    before = {u: server_totals(client, u) for u in servers}
    for text, n_tokens, key in items:
        url, headers = route(text, key)
        body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                "cache_salt": salt}
        try:
            resp = client.post(url + "/v1/completions", json=body, headers=headers)
        except Exception as exc:
            raise EngineError(f"POST {url}/v1/completions failed: {exc}") from exc
        if resp.status_code != 200:
            raise EngineError(f"{url}/v1/completions answered {resp.status_code}: {resp.text[:300]}")
        try:
            usage = resp.json().get("usage") or {}
        except (ValueError, AttributeError) as exc:  # not JSON, or not an object
            raise EngineResponseError(f"{url}/v1/completions answered what is not a completion: "
                                      f"{resp.text[:300]!r}") from exc
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:
            raise EngineError(f"{url} did not report usage.prompt_tokens_details.cached_tokens; "
                              "start vllm serve with --enable-prompt-tokens-details")
        if usage.get("prompt_tokens") != n_tokens:
            raise EngineError(f"request {len(served_by)}: the server counted {usage.get('prompt_tokens')} "
                              f"prompt tokens, the assembler {n_tokens}: the text did not re-tokenize "
                              "to the same ids")
        response_cached += int(cached)
        after = {u: server_totals(client, u) for u in servers}
        moved = [u for u in servers if after[u]["requests"] > before[u]["requests"]]
        if len(moved) != 1:
            raise EngineError(f"request {len(served_by)} was counted by {len(moved)} servers, expected 1")
        u = moved[0]
        local = after[u]["cached_tokens"] - before[u]["cached_tokens"]
        ext = after[u]["external_cached_tokens"] - before[u]["external_cached_tokens"]
        if int(cached) != local + ext:  # module doc: one count on both sides, no tolerance
            raise EngineError(
                f"request {len(served_by)} on {u}: the response reported {int(cached)} cached tokens, the server's "
                f"/metrics counted {local + ext} ({local} prefix-cache hits + {ext} external): they must agree; "
                "is another client using the server, or does it count cached tokens another way?"
            )
        external += ext
        for k in per_server[u]:
            per_server[u][k] += after[u][k] - before[u][k]
        served_by.append(u)
        before = after
    prompt = sum(s["prompt_tokens"] for s in per_server.values())
    cached = sum(s["cached_tokens"] for s in per_server.values())
    return {
        "requests": len(items),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        # what a KV connector loaded (--url servers running one) was not prefilled either
        "prefill_tokens": prompt - cached - external,
        "cluster_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "response_cached_tokens": response_cached,
        "external_cached_tokens": external,
        "per_server": per_server,
        "served_by": served_by,
    }


def served_model(client: Any, url: str) -> str:
    """The model ``url`` serves (its ``/v1/models``' first id); an unreachable server is
    an :class:`EngineUnavailableError`, a wrong answer an :class:`EngineResponseError`."""
    import httpx

    try:
        resp = client.get(url + "/v1/models")
    except httpx.TransportError as exc:  # translated at the boundary, as server_totals
        raise EngineUnavailableError(f"cannot reach {url}/v1/models: {exc}") from exc
    except httpx.HTTPError as exc:
        raise EngineError(f"GET {url}/v1/models failed: {exc}") from exc
    if resp.status_code != 200:
        raise EngineResponseError(f"{url}/v1/models answered {resp.status_code}: {resp.text[:300]}")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, LookupError, TypeError) as exc:
        raise EngineResponseError(f"{url}/v1/models answered no model: {resp.text[:300]!r}") from exc


def _prompts(family: str, requests: int, seed: int,
             bounds: dict[str, int] | None = None) -> dict[str, list[tuple[str, int, str]]]:
    """(text, token count, routing key) per request, naive and assembled, for one family:
    a name of the suite (``wiki``, ``support``, ...) or a wiki profile (``repeat-heavy``,
    ``diverse``); ``bounds`` gets each kind's prefill floor (:func:`prefix_bound` over one
    cache: no routing over any number of servers prefills less)."""
    bounds = {} if bounds is None else bounds
    ids: dict[str, list[list[int]]] = {"naive": [], "assembled": []}
    from promptsplice.assembler import Assembler, PromptFormat, default_tokenizer
    from promptsplice.benchmarks.traces import generate_family_trace
    from promptsplice.engine_adapters._router import prefix_route_key

    tok = default_tokenizer()
    fmt = PromptFormat.chatml()
    # Text travels, so nothing is padded: runs of padding spaces merge when the server
    # re-tokenizes the text (``AssembledPrompt.text_is_exact``), and the ids it caches
    # would no longer be the assembled ones.
    asm = Assembler(tok, block_size=BLOCK_SIZE, policy="stable", alignment="none", prompt_format=fmt)
    naive_asm = Assembler(tok, block_size=BLOCK_SIZE, prompt_format=fmt)
    naive, assembled = [], []
    if family in _WIKI_PROFILES:
        trace = generate_family_trace("wiki", requests=requests, seed=seed, profile=family)
    else:
        trace = generate_family_trace(family, requests=requests, seed=seed)
    for r in trace:
        chunks = [{"id": c.id, "text": c.text, "metadata": c.metadata} for c in r.chunks]
        n = naive_asm.naive(chunks, query=r.query, system=r.system or None)
        naive.append((n.text, len(n.token_ids), prefix_route_key(list(n.token_ids), block_size=BLOCK_SIZE).hex()))
        # assemble(), as a user sends them: the stable order learns which chunks are
        # popular as the trace goes (preview() learns nothing, so every request got
        # its chunks in first-seen order: apidocs tied on hit rate that way).
        a = asm.assemble(chunks, query=r.query, system=r.system or None)
        if tok.encode(a.text) != list(a.token_ids):
            raise EngineError(f"{family} request {r.id}: the assembled text does not re-tokenize "
                              "to its token ids, so it cannot travel as text")
        # The same key as the naive prompt's (the chain hash of the first blocks): the
        # coarser prefix_key (system prompt and tools only) pinned a family to one server.
        assembled.append((a.text, len(a.token_ids), prefix_route_key(a).hex()))
        ids["assembled"].append(list(a.token_ids))
        ids["naive"].append(list(n.token_ids))
    # the floor of any routing: one prefix cache that never evicts, shared by every server
    bounds.update({k: prefix_bound(v, BLOCK_SIZE, engines=1)["shared_prefill"] for k, v in ids.items()})
    return {"naive": naive, "assembled": assembled}


def run_gateway_bench(
    requests: int = 30,
    *,
    profiles: Sequence[str] = _WIKI_PROFILES,
    seed: int = 0,
    max_tokens: int = 1,
    modes: Sequence[str] = MODES,
    urls: Sequence[str] | None = None,
    progress: bool = False,
    json_out: str | Path | None = None,
) -> dict[str, Any]:
    """Run every mode over naive and assembled prompts of each family in ``profiles`` (wiki
    profiles or suite families, :data:`promptsplice.benchmarks.traces.SUITE`); see the
    module doc."""
    import httpx

    from promptsplice.engine_adapters._router import PrefixRouter, RoundRobinRouter

    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ConfigError(f"requests must be an int >= 1, got {requests!r}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ConfigError(f"unknown modes {unknown!r}; choose from {', '.join(MODES)}")
    from promptsplice.benchmarks.traces import SUITE

    unknown = [p for p in profiles if p not in SUITE and p not in _WIKI_PROFILES]
    if unknown or not profiles:
        raise ConfigError(f"unknown trace families {unknown!r}; choose from {', '.join(SUITE + _WIKI_PROFILES)}")
    if urls is not None:  # distinct servers, checked before the prompts and the gateways
        urls = [u.rstrip("/") for u in RoundRobinRouter(urls).endpoints]
    floors: dict[str, dict[str, int]] = {p: {} for p in profiles}
    prompts = {p: _prompts(p, requests, seed, floors[p]) for p in profiles}
    report: dict[str, Any] = {"families": {}, "bound_checks": {}}
    run_id = uuid.uuid4().hex[:8]
    with contextlib.ExitStack() as stack:
        if urls is None:
            urls = [s.base_url for s in stack.enter_context(loopback_servers(2, max_model_len=MAX_MODEL_LEN))]
        urls = [u.rstrip("/") for u in urls]
        # A proxy from the environment for the given servers, never for loopback (the
        # servers started here, the gateways): mounted transports skip it.
        direct = {f"all://{h}": httpx.HTTPTransport() for h in ("127.0.0.1", "localhost", "[::1]")}
        client = stack.enter_context(httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0), mounts=direct))
        model = served_model(client, urls[0])
        kept: dict[str, str] = {}  # stateless policies: one gateway for every run

        def smg_url(policy: str, run: contextlib.ExitStack) -> str:
            if policy in _STATELESS:
                if policy not in kept:
                    kept[policy] = stack.enter_context(gateway(urls, policy)).base_url
                return kept[policy]
            return run.enter_context(gateway(urls, policy)).base_url

        for profile, kinds in prompts.items():
            fam = report["families"].setdefault(profile, {})
            for kind, items in kinds.items():
                for mode in modes:
                    salt = f"gw-{run_id}-{profile}-{kind}-{mode}"
                    t0 = time.perf_counter()
                    with contextlib.ExitStack() as run:
                        if mode.startswith("smg:"):

                            def route(text: str, key: str, _gw: str = smg_url(mode[4:], run)) -> tuple[str, dict]:
                                return _gw, {ROUTING_KEY_HEADER: key}
                        else:
                            router = (PrefixRouter(list(urls), block_size=BLOCK_SIZE) if mode == "affinity"
                                      else RoundRobinRouter(list(urls)))

                            def route(text: str, key: str, _r: Any = router) -> tuple[str, dict]:
                                with _r.acquire(text, salt=salt) as lease:
                                    return lease.endpoint, {}
                        out = send_through(client, urls, items, route=route, salt=salt,
                                           model=model, max_tokens=max_tokens)
                    if progress:
                        print(f"[gateway] {profile} {kind} {mode}: hit {out['cluster_hit_rate']:.1%} "
                              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                    out.pop("served_by")
                    out["bound_prefill_tokens"] = floors[profile][kind]
                    fam.setdefault(kind, {})[mode] = out
                    report["bound_checks"][f"{profile}/{kind}/{mode}"] = {
                        "bound": "prefix", "bound_prefill_tokens": floors[profile][kind],
                        "prefill_tokens": out["prefill_tokens"], "holds": out["prefill_tokens"] >= floors[profile][kind]}
            if json_out:  # after each family: a long run interrupted keeps what it measured, and says so
                write_report(dict(report, modes=list(modes), servers=len(urls), block_size=BLOCK_SIZE,
                                  requests=requests, max_tokens=max_tokens, seed=seed, complete=False), json_out)
    report.update(modes=list(modes), servers=len(urls), block_size=BLOCK_SIZE,
                  requests=requests, max_tokens=max_tokens, seed=seed, complete=True)
    return report


def format_gateway(report: dict[str, Any]) -> str:
    """One row per (family, mode): hit rate and prefill, naive vs assembled."""
    lines = [f"{'family':<13} {'mode':<23} {'naive hit':>9} {'assembled hit':>13} "
             f"{'naive prefill':>13} {'assembled prefill':>17}  per server (assembled)"]
    for fam, kinds in report["families"].items():
        for mode in report["modes"]:
            n, a = kinds["naive"][mode], kinds["assembled"][mode]
            spread = " ".join(str(s["requests"]) for s in a["per_server"].values())
            lines.append(f"{fam:<13} {mode:<23} {n['cluster_hit_rate']:>9.1%} {a['cluster_hit_rate']:>13.1%} "
                         f"{n['prefill_tokens']:>13} {a['prefill_tokens']:>17}  {spread}")
    margins = [(kinds["assembled"][m]["cluster_hit_rate"] - kinds["naive"][m]["cluster_hit_rate"], fam, m)
               for fam, kinds in report["families"].items() for m in report["modes"]]
    if margins:
        d, fam, m = min(margins)
        lines.append(f"worst case: {fam} {m}, assembled - naive hit rate = {d:+.1%}")
    lines.append(f"{report['servers']} loopback vllm serve, block {report['block_size']}, "
                 f"{report['requests']} requests per family, max_tokens {report['max_tokens']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.gateway",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=count_arg(1), default=30, help="RAG requests per family")
    parser.add_argument("--profile", action="append", default=None,
                        help="wiki trace profile (repeat-heavy | diverse; repeat; default: both)")
    parser.add_argument("--family", action="append", default=None,
                        help="a trace family of the suite (wiki | wiki-diverse | support | pydocs | apidocs | tools; repeat)")
    parser.add_argument("--suite", action="store_true", help="every family of the suite")
    parser.add_argument("--mode", action="append", default=None, help=f"repeat; default all: {', '.join(MODES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=count_arg(1), default=1)
    parser.add_argument("--url", action="append", default=None, help="use a running server (repeat)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.json is not None:  # before the servers start, as the CLI's
        _check_writable("--json", args.json, "the report's", None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from promptsplice.benchmarks.traces import SUITE

    families = [*(args.profile or ()), *(args.family or ()), *(SUITE if args.suite else ())]
    report = run_gateway_bench(
        args.requests, profiles=families or _WIKI_PROFILES, seed=args.seed,
        max_tokens=args.max_tokens, modes=args.mode or MODES, urls=args.url, progress=True,
        json_out=args.json,
    )
    print(format_gateway(report))
    if args.json:
        print(f"json: {write_report(report, args.json)}")
    try:
        check_bounds(report["bound_checks"], what="gateway")
    except BoundError as exc:
        print(f"promptsplice: error: {exc}", file=sys.stderr)
        return BOUND_EXIT
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
