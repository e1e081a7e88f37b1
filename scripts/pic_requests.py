"""Where position-independent reuse gains and loses prefill, request by request.

Runs ``bench rag``'s two store-engine modes on one RAG trace, each on a fresh engine
with its own store of the bench's sizes (equal capacity): ``promptsplice_store`` (exact
assembly, whole-block chunks) and ``promptsplice_pic`` at ``bounded`` (r=2, per-chunk
recompute, the runner's gate), then sums both modes' prefill over the PIC requests of
each outcome: sent exact (the gate's ``NO_GAIN``), run under the reuse salt without
relocating anything, relocating.  Per outcome it also splits the tokens of the chunks
behind each PIC request's hit by what the chunk index answered (``hit``, ``miss``,
``stale``) and whether an earlier request of the trace held the chunk (``seen``) or
not (``new``): ``miss_seen`` is reuse the index never learnt (a chunk computed inside a
PIC request is not indexed).  A developer's diagnostic (no naive mode, no oracle:
``bench rag`` is the benchmark); this is how PIC's loss on wiki's re-asks was found:

    python scripts/pic_requests.py TRACE.jsonl --requests 200 --json out/pic-requests.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import uuid
from collections import Counter, defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--json", required=True, help="per-request records of both modes")
    args = ap.parse_args()

    from promptsplice.assembler import PromptFormat
    from promptsplice.benchmarks.assemble import _chunks
    from promptsplice.benchmarks.rag import start_rag_engines
    from promptsplice.benchmarks.traces import read_rag_trace
    from promptsplice.engine_adapters import RagRunner
    from promptsplice.errors import ContextLengthError

    reqs = read_rag_trace(args.trace, limit=args.requests)
    root = tempfile.mkdtemp(prefix="pic-requests-")
    fmt, run_id = PromptFormat.chatml(), uuid.uuid4().hex[:8]
    out: dict[str, list[dict]] = {"store": [], "pic": []}
    engine, fresh = start_rag_engines(root, dtype=args.dtype)
    try:
        kv = fresh()  # the store control, as bench rag runs it (--pic-exact-alignment all)
        try:
            asm = kv.make_assembler(policy="cache_aware", alignment="all", prompt_format=fmt)
            for req in reqs:
                what = {"query": req.query, "system": req.system or None, "salt": f"store-{run_id}"}
                try:
                    prompt = asm.assemble(_chunks(req), **what)
                except ContextLengthError:
                    prompt = asm.assemble(_chunks(req), alignment="auto", **what)
                c = kv.generate(prompt, max_tokens=1)
                out["store"].append({"prompt": len(prompt.token_ids), "prefill": c.prefill_tokens})
        finally:
            kv.close()
        kv = fresh()
        try:
            runner = RagRunner(kv, mode="position_independent", salt=f"pic-{run_id}", recompute_blocks=2,
                               fidelity="bounded", policy="cache_aware", prompt_format=fmt, exact_alignment="all",
                               recompute_at="chunk")
            looked: list[tuple[list[tuple[int, ...]], list[str]]] = []
            real = runner.index.lookup_many

            def spy(chunks, *, salt, also=()):  # the request's own lookup (the one with chains)
                looks, stored = real(chunks, salt=salt, also=also)
                if also:
                    looked.append(([tuple(c) for c in chunks], [look.status.value for look in looks]))
                return looks, stored

            runner.index.lookup_many = spy
            seen: set[tuple[int, ...]] = set()
            for req in reqs:
                looked.clear()
                st = runner.run(_chunks(req), query=req.query, system=req.system or None, max_tokens=1)
                chunks = Counter()
                for toks, status in zip(*looked[0]) if looked else ():
                    chunks[f"{status}_{'seen' if toks in seen else 'new'}"] += len(toks)
                ids = st.prompt.token_ids
                seen.update(tuple(ids[s.start : s.end]) for s in st.prompt.segments if s.kind.name == "CHUNK")
                out["pic"].append({
                    "chunks": dict(chunks),
                    "prompt": st.prompt_tokens, "prefill": st.prefill_tokens,
                    "fallback": st.fallback.value if st.fallback else None,
                    "precomputed": st.precomputed_tokens, "planned_relocated": st.planned_relocated_tokens,
                    "relocated": st.relocated_tokens, "requests": st.requests,
                    "extra_recompute_blocks": st.extra_recompute_blocks,
                })
            guard = runner.guard_rates().observed()
        finally:
            kv.close()
    finally:
        engine.close()
        shutil.rmtree(root, ignore_errors=True)

    by: dict[str, Counter] = defaultdict(Counter)
    chunk_tokens: dict[str, Counter] = defaultdict(Counter)
    for s, p in zip(out["store"], out["pic"], strict=True):
        kind = p["fallback"] or ("relocating" if p["planned_relocated"] else "reuse salt, nothing relocated")
        by[kind].update({"requests": 1, "store_prefill_tokens": s["prefill"], "pic_prefill_tokens": p["prefill"],
                         "precomputed_tokens": p["precomputed"], "extra_recompute_blocks": p["extra_recompute_blocks"]})
        chunk_tokens[kind].update(p["chunks"])
    summary = {
        "store_prefill_tokens": sum(s["prefill"] for s in out["store"]),
        "pic_prefill_tokens": sum(p["prefill"] for p in out["pic"]),
        "by_outcome": {k: {**v, "chunk_tokens_behind_the_hit": dict(chunk_tokens[k])} for k, v in by.items()},
        "guard": guard,
    }
    print(json.dumps(summary, indent=2))
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump({"trace": args.trace, "summary": summary, **out}, fh)


if __name__ == "__main__":
    main()
