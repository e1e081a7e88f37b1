"""Load: ``Assembler.preview`` and the harness hook from 32 threads next to engine calls.

Every output is compared with the same call made single-threaded (nothing lost,
duplicated or crossed between threads), and the shared state is checked after: the
token cache did exactly the sequential run's lookups, the hook counted every step of
every session, the engine's mirror predicted every engine request exactly (the engine
admits under its lock in the order the requests ran) and vLLM's counters add up to the
requests' own numbers.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from promptsplice.assembler import Assembler, ContextHook, StepKind
from tests.engine_adapters.test_embedded import chunk_dicts

THREADS = 32
ENGINE_THREADS = 4
PROMPTS_PER_THREAD = 3
STEPS_PER_SESSION = 4


def work_items(rag_requests):
    """Per thread: which RAG requests it assembles and the messages of its session."""
    items = []
    for t in range(THREADS):
        reqs = [rag_requests[(t * PROMPTS_PER_THREAD + k) % len(rag_requests)] for k in range(PROMPTS_PER_THREAD)]
        base = rag_requests[t % len(rag_requests)]
        msgs = [{"role": "system", "content": base.system}]
        steps = []
        for k in range(STEPS_PER_SESSION):
            msgs = msgs + [
                {"role": "user", "content": f"thread {t} step {k}: {rag_requests[(t + k) % len(rag_requests)].query}"},
                {"role": "assistant", "content": rag_requests[(t + k) % len(rag_requests)].chunks[0].text[:400]},
            ]
            if k == STEPS_PER_SESSION - 1:  # the last step edits an earlier message
                msgs = [*msgs[:2], {"role": "user", "content": "(trimmed)"}, *msgs[3:]]
            steps.append(list(msgs))
        items.append((reqs, steps))
    return items


def run_one(t, reqs, steps, assembler, hook, salt):
    prompts = [
        assembler.preview(chunk_dicts(r), query=r.query, system=r.system, salt=salt)
        for r in reqs
    ]
    contexts = [hook(f"session-{t}", m, salt=salt) for m in steps]
    return prompts, contexts


@pytest.mark.reliability
def test_32_threads_assemble_and_hook_next_to_engine_calls(fresh_engine, rag_requests, default_tok, measured):
    eng = fresh_engine
    items = work_items(rag_requests)
    salts = [f"load-{t % 4}" for t in range(THREADS)]

    # The sequential reference: the same calls, one thread, fresh state.
    ref_asm = Assembler(default_tok, block_size=eng.block_size)
    ref_hook = ContextHook(ref_asm)
    ref = [run_one(t, *items[t], ref_asm, ref_hook, salts[t]) for t in range(THREADS)]
    ref_lookups = sum(ref_asm.token_cache.stats()[:2])

    asm = Assembler(default_tok, block_size=eng.block_size)
    hook = ContextHook(asm)
    results: list = [None] * THREADS
    completions: list = []
    errors: list = []
    barrier = threading.Barrier(THREADS)
    before = eng.counters()

    def worker(t):
        try:
            barrier.wait()
            results[t] = run_one(t, *items[t], asm, hook, salts[t])
            if t < ENGINE_THREADS:
                for prompt in results[t][0]:
                    done = eng.generate(prompt, max_tokens=1)
                    completions.append((t, prompt, done))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((t, exc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=600)
    assert not any(th.is_alive() for th in threads)
    assert errors == []

    # Nothing lost, duplicated or crossed: every output equals its sequential twin.
    for t in range(THREADS):
        prompts, contexts = results[t]
        ref_prompts, ref_contexts = ref[t]
        assert [p.token_ids for p in prompts] == [p.token_ids for p in ref_prompts]
        assert [p.block_hashes for p in prompts] == [p.block_hashes for p in ref_prompts]
        assert [c.token_ids for c in contexts] == [c.token_ids for c in ref_contexts]
        assert [c.kind for c in contexts] == [c.kind for c in ref_contexts]
        assert [c.step for c in contexts] == list(range(1, STEPS_PER_SESSION + 1))
        assert [c.directives for c in contexts] == [c.directives for c in ref_contexts]
    kinds = Counter(c.kind for _, contexts in results for c in contexts)
    assert kinds[StepKind.NEW_SESSION] == THREADS and kinds[StepKind.EDIT] == THREADS

    # Shared state is consistent.
    assert len(hook) == THREADS
    stats = asm.token_cache.stats()
    assert stats.hits + stats.misses == ref_lookups
    assert stats.entries == ref_asm.token_cache.stats().entries
    assert len(completions) == ENGINE_THREADS * PROMPTS_PER_THREAD
    assert len({d.request_id for _, _, d in completions}) == len(completions)
    for _, prompt, done in completions:
        assert done.prompt_token_ids == prompt.token_ids
        assert done.predicted_cached_tokens == done.num_cached_tokens
    delta = eng.counters().since(before)
    assert delta.prefix_cache_queries == sum(d.prompt_tokens for _, _, d in completions)
    assert delta.prefix_cache_hits == sum(d.num_cached_tokens for _, _, d in completions)
    measured.update(threads=THREADS, prompts=THREADS * PROMPTS_PER_THREAD, hook_steps=THREADS * STEPS_PER_SESSION,
                    engine_requests=len(completions), lost=0, duplicated=0, wrong=0,
                    cache_hits_tokens=delta.prefix_cache_hits)
