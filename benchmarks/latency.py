"""Latency of ``assemble_prompt`` on a 20-chunk, ~8K-token request (real text, real tokenizer).

* warm: the chunks' tokens are in the token cache (the common case: popular chunks);
  the whole pipeline runs (dedup, ordering, layout, hashing, mirror update).
* cold: the token cache is cleared before every call, so every segment is tokenized;
  the baseline, measured in the same run, is tokenizing the same prompt text once,
  whole, with the same tokenizer (what user code pays today).

With ``--agent-steps N``, also an agent session through ``ContextHook`` (the ten-line
rule and dropped failed calls): each step appends a tool call and a 1-5 KB tool output
of real text, one step in ten masks an older output; the time of one hook call at
steps 10, 50, 100, ... N (median over 3 sessions), against tokenizing that step's whole
prompt text once in the same run (the least a harness pays per model call).

Run: ``python -m promptsplice.benchmarks.latency [--iters N] [--agent-steps N]``.  Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from promptsplice.assembler import Assembler, ContextHook, DropFailedCalls, TruncateToolOutputs, load_tokenizer
from promptsplice.benchmarks._stats import percentile
from promptsplice.benchmarks.traces import load_wiki_leads
from promptsplice.benchmarks.cli import count_arg, run_tool

__all__ = ["build_request", "run_latency_bench", "run_hook_latency"]


def build_request(tokenizer: Any, *, chunks: int = 20, target_tokens: int = 8192) -> list[dict[str, Any]]:
    """``chunks`` chunks of real Wikipedia text, about ``target_tokens`` tokens in all."""
    per_chunk = target_tokens // chunks
    leads = [t for _, t in load_wiki_leads() if len(t) > 400]
    out: list[dict[str, Any]] = []
    i = 0
    while len(out) < chunks:
        text = ""
        while len(tokenizer.encode(text)) < per_chunk:
            text = (text + "\n\n" + leads[i]).strip()
            i += 1
        ids = tokenizer.encode(text)[:per_chunk]
        out.append({"id": f"lat-{len(out)}", "text": tokenizer.decode(ids), "metadata": {"source": f"doc{len(out)}"}})
    return out


def run_latency_bench(
    iters: int = 200, block_size: int = 16, tokenizer: str = "default", policy: str = "cache_aware"
) -> dict[str, Any]:
    """``policy``: ``assemble_prompt``'s default unless told otherwise."""
    tok = load_tokenizer(tokenizer)
    req = build_request(tok)
    system = "You are a helpful assistant. Answer from the documents and cite them by number."
    query = "Summarise what these documents say about the history of each place."
    asm = Assembler(tok, block_size=block_size, policy=policy)
    first = asm.assemble(req, query=query, system=system)
    warm: list[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        asm.assemble(req, query=query, system=system)
        warm.append((time.perf_counter() - t0) * 1e3)

    text = asm.naive(req, query=query, system=system).text
    cold: list[float] = []
    whole: list[float] = []
    cold_iters = max(10, iters // 4)
    for _ in range(cold_iters):
        asm.token_cache.clear()
        t0 = time.perf_counter()
        asm.assemble(req, query=query, system=system)
        cold.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        tok.encode(text)
        whole.append((time.perf_counter() - t0) * 1e3)
    report = {
        "chunks": len(req),
        "prompt_tokens": first.num_tokens,
        "block_size": block_size,
        "policy": policy,
        "warm_p50_ms": round(percentile(warm, 0.5), 4),
        "warm_p99_ms": round(percentile(warm, 0.99), 4),
        "cold_p50_ms": round(percentile(cold, 0.5), 4),
        "tokenize_whole_p50_ms": round(percentile(whole, 0.5), 4),
        "cold_over_tokenize": round(statistics.median(c / w for c, w in zip(cold, whole)), 3),
    }
    return report


def _agent_renders(steps: int, seed: int):
    """One session's renders (see the module docstring), deterministic per seed."""
    import random

    rng = random.Random(seed)
    leads = [t for _, t in load_wiki_leads()]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a research agent. Use the tools, then answer."},
        {"role": "user", "content": "Collect what is known about these places and summarise it."},
    ]
    for s in range(steps):
        name = rng.choice(["search", "read_page", "run"])
        out, size = [], rng.randint(1000, 5000)
        while sum(map(len, out)) < size:
            out.append(leads[rng.randrange(len(leads))].replace(". ", ".\n"))
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call_{s}", "type": "function", "function": {"name": name, "arguments": json.dumps({"q": f"q{s}"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{s}", "content": "\n".join(out)[:size]})
        if s > 3 and rng.random() < 0.1:
            j = rng.randrange(3, len(msgs) - 2)
            if msgs[j]["role"] == "tool":
                msgs[j] = {**msgs[j], "content": "[output masked]"}
        yield list(msgs)


def run_hook_latency(steps: int = 200, block_size: int = 32, tokenizer: str = "default") -> dict[str, Any]:
    """Per-call time of ``ContextHook`` over a growing agent session (module docstring)."""
    tok = load_tokenizer(tokenizer)
    tools = [{"type": "function", "function": {"name": n, "description": f"the {n} tool",
              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
             for n in ("search", "read_page", "run")]
    marks = sorted({m for m in (10, 50, *range(100, steps + 1, 100), steps) if m <= steps})
    hook_ms: dict[int, list[float]] = {m: [] for m in marks}
    tok_ms: dict[int, list[float]] = {m: [] for m in marks}
    tokens: dict[int, int] = {}
    for seed in range(3):
        hook = ContextHook(tok, block_size=block_size, policies=[TruncateToolOutputs(), DropFailedCalls()])
        for step, msgs in enumerate(_agent_renders(steps, seed), 1):
            t0 = time.perf_counter()
            ctx = hook(f"s{seed}", msgs, tools=tools)
            dt = (time.perf_counter() - t0) * 1e3
            if step in hook_ms:
                hook_ms[step].append(dt)
                t0 = time.perf_counter()
                tok.encode(ctx.render.text)
                tok_ms[step].append((time.perf_counter() - t0) * 1e3)
                tokens[step] = len(ctx.token_ids)
    return {
        "block_size": block_size,
        "steps": {str(m): {"prompt_tokens": tokens[m], "hook_ms": round(statistics.median(hook_ms[m]), 3),
                           "tokenize_whole_ms": round(statistics.median(tok_ms[m]), 3),
                           "hook_over_tokenize": round(statistics.median(hook_ms[m]) / statistics.median(tok_ms[m]), 3)}
                  for m in marks},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.latency", description=__doc__)
    ap.add_argument("--iters", type=count_arg(1), default=200)
    ap.add_argument("--block-size", type=count_arg(1), default=16)
    ap.add_argument("--policy", default="cache_aware", help="retrieval | stable | cache_aware")
    ap.add_argument("--agent-steps", type=count_arg(0), default=0, help="also an agent session of N steps (ContextHook)")
    args = ap.parse_args(argv)
    r = run_latency_bench(args.iters, args.block_size, policy=args.policy)
    print(
        f"assemble_prompt ({r['policy']}), {r['chunks']} chunks, {r['prompt_tokens']} tokens: warm p50 "
        f"{r['warm_p50_ms']} ms (p99 {r['warm_p99_ms']}); cold p50 {r['cold_p50_ms']} ms vs "
        f"tokenizing the text once {r['tokenize_whole_p50_ms']} ms: "
        f"{r['cold_over_tokenize']}x"
    )
    if args.agent_steps:
        r["agent"] = run_hook_latency(args.agent_steps)
        for m, a in r["agent"]["steps"].items():
            print(f"ContextHook, step {m} ({a['prompt_tokens']} tokens): {a['hook_ms']} ms vs tokenizing the "
                  f"prompt once {a['tokenize_whole_ms']} ms: {a['hook_over_tokenize']}x")
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
