"""The served path against the embedded one: the same runners, the same traces, the
same counts, outputs and fidelity probes, and what the server's round trips cost.

One embedded engine and one loopback ``vllm serve`` that loads the splice connector,
started with the same KV cache (1 GiB), the same tiered block store (sizes, a fresh
folder each), the model's own context and full-vocabulary logprobs, both alive and
driven one step each in turn (the wall times then compare under the same machine
load).  On each:

* **rag**: ``RagRunner(mode="position_independent", fidelity=...)`` over the first
  ``--requests`` requests of a RAG trace (the store query per request, plans in
  ``kv_transfer_params``, the deviation guard reading the acks);
* **agent**: ``AgentRunner(mode="splice", fidelity=...)`` over the first ``--sessions``
  sessions of an agent trace;

and the fidelity probe of :mod:`promptsplice.benchmarks.fidelity` (first-token KL and
teacher-forced top-1 against a one-pass exact prefill on the same engine, each probe
served the step's whole context from cache) on up to ``--probes`` steps that relocated
KV, the same steps on both.  Per step the rows compared are: prompt, prefilled, cached,
relocated, precomputed tokens, engine requests, guard extensions, the greedy output and
the probes' deviations (4 decimals).

JSON (names fixed)::

    {"fidelity": "bounded", "relocate": "when_it_pays", "kv_cache_bytes": int, "store": {...},
     "kv_blocks": {"embedded", "served"}, "rag": P, "agent": P, "identical": bool}
    P = {"steps": int, "identical_steps": int, "mismatches": [first 5 {"step", "embedded", "served"}],
         "relocated_tokens": int, "prefill_tokens": int, "probes": int,
         "kl": {"embedded": [..], "served": [..]}, "kl_max_abs_diff": float | null,
         "wall_s": {"embedded", "served"}, "wall_ratio": served / embedded}

Exit status 1 when a step differs or a probe's KL differs by more than
:data:`KL_TOLERANCE` (the run is deterministic: the same CPU kernels in both).

Run:  ``python -m promptsplice.benchmarks.served_parity --rag-trace T --agent-trace A
--requests 20 --sessions 3 --probes 6 [--relocate always] --json OUT``
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.agent_traces import AgentSession, read_agent_trace
from promptsplice.benchmarks.assemble import _chunks
from promptsplice.benchmarks.fidelity import full_blocks, kl, probe, reference
from promptsplice.benchmarks.traces_format import RagRequest, read_rag_trace
from promptsplice.errors import ConfigError
from promptsplice.benchmarks.cli import _check_writable, count_arg, run_tool

__all__ = ["KL_TOLERANCE", "compare", "main", "run_on_engines", "run_served_parity"]

KL_TOLERANCE = 1e-4
"""Largest first-token KL difference between the two paths that counts as equal."""
KV_CACHE_BYTES = 1 << 30
STORE_DRAM_BYTES = 256 << 20
STORE_DISK_BYTES = 2 << 30
_PROBE_GREEDY = 8


def _rag_row(st: Any) -> tuple:
    return (st.prompt_tokens, st.prefill_tokens, st.cached_tokens, st.relocated_tokens, st.precomputed_tokens,
            st.requests, st.extra_recompute_blocks, list(st.completion.token_ids),
            [round(d, 4) for d in st.deviations])


def _agent_row(st: Any) -> tuple:
    return (st.prompt_tokens, st.prefill_tokens, st.cached_tokens, st.relocated_tokens, 0,
            st.requests, st.extra_recompute_blocks, list(st.completion.token_ids),
            [round(d, 4) for d in st.deviations])


def _probe(engine: Any, tokens: list[int], salt: str) -> dict[str, float]:
    """First-token KL and teacher-forced top-1 of ``tokens`` under ``salt`` (its
    spliced KV, checked to come from cache) against a one-pass exact prefill."""
    need = full_blocks(engine, tokens)
    cont = list(engine.generate(tokens, max_tokens=_PROBE_GREEDY, cache_salt=salt).token_ids)
    tf, first = probe(engine, tokens, cont, salt, need_cached=need)
    _, p_ref = reference(engine, tokens)
    return {"kl": kl(p_ref, first), "tf_top1": tf}


def run_on_engines(
    engines: dict[str, Any],
    *,
    rag: Sequence[RagRequest] = (),
    agent: Sequence[AgentSession] = (),
    fidelity: str = "bounded",
    probes: int = 6,
    max_tokens: int = 8,
    tag: str = "parity",
    relocate: str = "when_it_pays",
) -> dict[str, dict[str, Any]]:
    """Both runners over each engine (module doc), one step on every engine in turn, so
    that the wall times compare under the same machine load: per engine and kind, the
    step rows, the probes (the first ``probes`` relocating steps) and the wall time of
    the runs (probes excluded).  ``relocate``: the RAG runner's gate."""
    from promptsplice.assembler import ContextHook
    from promptsplice.engine_adapters import AgentRunner, RagRunner

    out: dict[str, dict[str, Any]] = {}
    for name, engine in engines.items():
        out[name] = {kind: {"rows": [], "probes": [], "wall_s": 0.0} for kind in ("rag", "agent")}
        out[name]["kv_blocks"] = engine.mirror.capacity_blocks + 1 if engine.mirror.capacity_blocks else None
    rag_runners = {
        name: RagRunner(eng, mode="position_independent", salt=f"{tag}-{name}-rag", fidelity=fidelity,
                        policy="stable", relocate=relocate)
        for name, eng in engines.items()
    }
    for req in rag:
        for name, runner in rag_runners.items():
            res = out[name]["rag"]
            t0 = time.perf_counter()
            st = runner.run(_chunks(req), query=req.query, system=req.system or None, max_tokens=max_tokens)
            res["wall_s"] += time.perf_counter() - t0
            res["rows"].append(_rag_row(st))
            if st.relocated_tokens and len(res["probes"]) < probes:
                res["probes"].append(_probe(engines[name], list(st.prompt.token_ids), runner.reuse_salt))
    agent_runners = {name: AgentRunner(eng, mode="splice", salt=f"{tag}-{name}-agent", fidelity=fidelity)
                     for name, eng in engines.items()}
    first = next(iter(engines.values()))
    hook = ContextHook(first.tokenizer, block_size=first.block_size)  # the render is the engines' own
    for sess in agent:
        for msgs in sess.renders:
            prepared = hook(sess.id, msgs, sess.tools or None)
            for name, runner in agent_runners.items():
                res = out[name]["agent"]
                t0 = time.perf_counter()
                st = runner.step(prepared, max_tokens=max_tokens)
                res["wall_s"] += time.perf_counter() - t0
                res["rows"].append(_agent_row(st))
                if st.relocated_tokens and len(res["probes"]) < probes:
                    res["probes"].append(_probe(engines[name], list(prepared.token_ids), runner.session_salt(sess.id)))
    return out


def compare(embedded: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """The report of two :func:`run_on_engine` results (module doc's ``P`` per kind)."""
    report: dict[str, Any] = {"kv_blocks": {"embedded": embedded.get("kv_blocks"), "served": served.get("kv_blocks")}}
    for kind in ("rag", "agent"):
        a, b = embedded[kind], served[kind]
        same = [i for i, (x, y) in enumerate(zip(a["rows"], b["rows"])) if x == y]
        diff = [i for i in range(max(len(a["rows"]), len(b["rows"]))) if i not in set(same)]
        kl_a = [round(p["kl"], 6) for p in a["probes"]]
        kl_b = [round(p["kl"], 6) for p in b["probes"]]
        report[kind] = {
            "steps": len(a["rows"]),
            "identical_steps": len(same),
            "mismatches": [
                {"step": i, "embedded": a["rows"][i] if i < len(a["rows"]) else None,
                 "served": b["rows"][i] if i < len(b["rows"]) else None}
                for i in diff[:5]
            ],
            "relocated_tokens": sum(r[3] for r in b["rows"]),
            "prefill_tokens": sum(r[1] for r in b["rows"]),
            "probes": len(kl_b),
            "kl": {"embedded": kl_a, "served": kl_b},
            "tf_top1": {"embedded": [round(p["tf_top1"], 4) for p in a["probes"]],
                        "served": [round(p["tf_top1"], 4) for p in b["probes"]]},
            "kl_max_abs_diff": max((abs(x - y) for x, y in zip(kl_a, kl_b)), default=None)
            if len(kl_a) == len(kl_b) else None,
            "wall_s": {"embedded": round(a["wall_s"], 2), "served": round(b["wall_s"], 2)},
            "wall_ratio": round(b["wall_s"] / a["wall_s"], 3) if a["wall_s"] else None,
        }
    report["identical"] = all(
        r["identical_steps"] == r["steps"]
        and len(r["kl"]["embedded"]) == len(r["kl"]["served"])
        and (r["kl_max_abs_diff"] or 0.0) <= KL_TOLERANCE
        for r in (report["rag"], report["agent"])
    )
    return report


def run_served_parity(
    *,
    rag: Sequence[RagRequest],
    agent: Sequence[AgentSession],
    fidelity: str = "bounded",
    probes: int = 6,
    relocate: str = "when_it_pays",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Start the embedded engine and the server, drive both one step each in turn, stop
    them (module doc); the compared report."""
    from promptsplice.benchmarks.servers import loopback_servers
    from promptsplice.engine_adapters import EmbeddedEngine, RemoteEngine, StoreConfig
    from promptsplice.engine_adapters.connector._settings import kv_transfer_config_json

    say = log or (lambda msg: None)
    root = tempfile.mkdtemp(prefix="promptsplice-parity-")
    try:
        def store(name: str) -> Any:
            folder = Path(root) / name
            folder.mkdir()
            return StoreConfig(dram_bytes=STORE_DRAM_BYTES, disk_bytes=STORE_DISK_BYTES, disk_dir=str(folder),
                               fsync=False)

        say("served parity: the embedded engine and vllm serve, one step each in turn")
        eng = EmbeddedEngine(kv_store=store("embedded"), kv_cache_bytes=KV_CACHE_BYTES,
                             extra_kwargs={"max_logprobs": -1})
        try:
            max_len = eng.max_model_len
            args = ["--kv-transfer-config", kv_transfer_config_json(store("served")), "--max-logprobs=-1"]
            with loopback_servers(1, kv_cache_gib=KV_CACHE_BYTES >> 30, max_model_len=max_len,
                                  extra_args=args) as servers:
                with RemoteEngine(servers[0].base_url, max_retries=0, timeout=600) as remote:
                    results = run_on_engines({"embedded": eng, "served": remote}, rag=rag, agent=agent,
                                             fidelity=fidelity, probes=probes, relocate=relocate)
        finally:
            eng.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"fidelity": fidelity, "relocate": relocate, "kv_cache_bytes": KV_CACHE_BYTES, "max_model_len": max_len,
              "store": {"dram_bytes": STORE_DRAM_BYTES, "disk_bytes": STORE_DISK_BYTES}}
    report.update(compare(results["embedded"], results["served"]))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.served_parity", description=__doc__.split("\n")[0])
    ap.add_argument("--rag-trace", required=True, help="a RAG trace (promptsplice bench gen-trace / the suite)")
    ap.add_argument("--agent-trace", required=True, help="an agent trace (promptsplice bench gen-agent-trace)")
    ap.add_argument("--requests", type=count_arg(1), default=20)
    ap.add_argument("--sessions", type=count_arg(1), default=3)
    ap.add_argument("--probes", type=count_arg(0), default=6, help="relocating steps probed per kind")
    ap.add_argument("--fidelity", default="bounded", choices=("bounded", "fast", "exact"))
    ap.add_argument("--relocate", default="when_it_pays", choices=("when_it_pays", "always"),
                    help="the RAG runner's gate (always: every stored chunk relocated, the path under test)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    _check_writable("--json", a.json, "the report's", None,  # before the engines start, as the CLI's
                    reads=(("--rag-trace", a.rag_trace), ("--agent-trace", a.agent_trace)))
    for name in ("requests", "sessions", "probes"):
        if getattr(a, name) < 0:
            raise ConfigError(f"--{name} must be >= 0")
    rag = read_rag_trace(a.rag_trace, limit=a.requests)
    agent = read_agent_trace(a.agent_trace)[: a.sessions]
    report = run_served_parity(rag=rag, agent=agent, fidelity=a.fidelity, probes=a.probes, relocate=a.relocate,
                               log=lambda m: print(m, file=sys.stderr, flush=True))
    report.update({"rag_trace": a.rag_trace, "agent_trace": a.agent_trace})
    Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    for kind in ("rag", "agent"):
        r = report[kind]
        print(f"{kind}: {r['identical_steps']}/{r['steps']} steps identical, relocated {r['relocated_tokens']} tokens, "
              f"{r['probes']} probes, KL max |diff| {r['kl_max_abs_diff']}, wall served/embedded {r['wall_ratio']}")
    print(f"wrote {a.json}")
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
