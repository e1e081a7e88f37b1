"""The timing side channel of a shared prefix cache, measured, with and without salts.

A victim sends a prompt holding a private document; an attacker then sends guesses
that share the victim's first ``prefix_tokens`` tokens (a right guess) or not (a wrong
guess) and watches its own time to first token.  Without salts (or with one salt for
both) a right guess hits the victim's blocks and answers faster: the attacker learns
that the victim sent that prefix.  With a salt per tenant a guess can only hit its own
tenant's blocks, so right and wrong guesses take the same time.

    python -m promptsplice.benchmarks.side_channel --json out/bench/side-channel.json

Reports per setting (``shared``: no salts; ``salted``: victim and attacker under their
own salts) the attacker's TTFT p50 for right and wrong guesses, their ratio, the
cached tokens vLLM reported (the exact form of the same signal) and how often a
threshold halfway between the two p50s classifies a guess correctly (0.5: chance).
Every repetition starts from an empty prefix cache.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from promptsplice.benchmarks._stats import percentile
from promptsplice.benchmarks.traces import load_wiki_leads
from promptsplice.benchmarks.cli import _check_writable, count_arg, run_tool

DOC_TOKENS = 672
"""Tokens of the private document (21 blocks of 32): right and wrong guesses hold
exactly as many, so only the cache can make one faster than the other."""


def run(engine, *, reps: int = 12) -> dict:
    tok = engine.tokenizer
    leads = [t for _, t in load_wiki_leads()]

    def doc(texts: list[str]) -> list[int]:
        ids = tok.encode("Private notes:\n" + " ".join(texts))[:DOC_TOKENS]
        if len(ids) < DOC_TOKENS:
            raise RuntimeError(f"the document has {len(ids)} tokens, fewer than {DOC_TOKENS}")
        return ids

    secret, other = doc(leads[:20]), doc(leads[20:40])
    ask = tok.encode("\n\nQuestion: What is this about?\nAnswer:")
    question = tok.encode("\n\nQuestion: Summarize it in one line.\nAnswer:")
    victim, right, wrong = secret + ask, secret + question, other + question
    shared = DOC_TOKENS + next(i for i, (a, b) in enumerate(zip(ask, question)) if a != b)
    out: dict = {"prompt_tokens": len(victim), "guess_tokens": len(right), "shared_prefix_tokens": shared,
                 "reps": reps, "settings": {}}
    for setting, (v_salt, a_salt) in {"shared": (None, None), "salted": ("tenant-victim", "tenant-attacker")}.items():
        ttft: dict[str, list[float]] = {"right": [], "wrong": []}
        cached: dict[str, list[int]] = {"right": [], "wrong": []}
        for i in range(reps):
            for guess, ids in (("right", right), ("wrong", wrong)) if i % 2 else (("wrong", wrong), ("right", right)):
                engine.reset_prefix_cache()
                engine.generate(victim, max_tokens=1, cache_salt=v_salt)
                done = engine.generate(ids, max_tokens=1, cache_salt=a_salt)
                ttft[guess].append(done.ttft_s * 1000)
                cached[guess].append(done.num_cached_tokens)
        p50 = {g: percentile(v, 0.5) for g, v in ttft.items()}  # nearest rank, as every bench
        cut = (p50["right"] + p50["wrong"]) / 2
        faster = p50["right"] < p50["wrong"]
        correct = sum((t < cut) == faster for t in ttft["right"]) + sum((t >= cut) == faster for t in ttft["wrong"])
        out["settings"][setting] = {
            "ttft_p50_ms": {g: round(v, 2) for g, v in p50.items()},
            "right_over_wrong": round(p50["right"] / p50["wrong"], 3),
            "cached_tokens": {g: sorted(set(v)) for g, v in cached.items()},
            "threshold_accuracy": round(correct / (2 * reps), 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m promptsplice.benchmarks.side_channel", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--reps", type=count_arg(1), default=12)
    args = ap.parse_args(argv)
    if args.json is not None:  # before the engine starts, as the CLI's
        _check_writable("--json", args.json, "the report's", None)
    from promptsplice.engine_adapters import EmbeddedEngine

    t0 = time.time()
    with EmbeddedEngine() as engine:
        report = run(engine, reps=args.reps)
    report["bench_s"] = round(time.time() - t0, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
