"""Two real engines (vLLM CPU, SmolLM2-135M) sharing blocks through the Redis tier.

Engine A computes a prompt; engine B, whose own prefix cache and local store have never
seen it, loads A's blocks from the server.  vLLM is the judge: B's
``vllm:external_prefix_cache_hits`` and ``num_cached_tokens``.  B publishes vLLM's KV
events: the blocks it loaded from the server reach a ZMQ subscriber as ``BlockStored``,
so an external prefix-aware router (llm-d, Dynamo) counts them as cached on B.  Kept to
two requests: engines are slow to start on a loaded machine.
"""

from __future__ import annotations

import time

from promptsplice.engine_adapters import EngineConfig, StoreConfig
from tests.conftest import start_default_engine
from tests.engine_adapters.test_kv_events import drain, stored_tokens


BS = 32


def _store(url: str, dram_blocks: int, mib: int) -> StoreConfig:
    # Different DRAM budgets: two configs, so the process opens two stores (one per
    # "machine") instead of sharing one through shared_store().
    return StoreConfig(
        dram_bytes=dram_blocks * mib * 3 // 4,
        remote_bytes=64 * 1024 * 1024,
        remote_url=url,
    )


def test_engine_b_loads_the_blocks_engine_a_computed(redis_url, rag_requests, tmp_path):
    import zmq

    mib = 1024 * 1024 * (1 if EngineConfig().dtype == "bfloat16" else 2)
    text = "\n\n".join(dict.fromkeys(c.text for r in rag_requests for c in r.chunks))
    engine_a = start_default_engine(kv_store=_store(redis_url, 16, mib), kv_cache_bytes=64 * mib, max_model_len=1024)
    try:
        prompt = list(engine_a.tokenizer.encode(text))[:203]
        first = engine_a.generate(prompt, max_tokens=8, cache_salt="shared-tier")
        assert first.num_cached_tokens == 0
        engine_a.kv_store.drain()  # A's write-behind reached the server
        assert engine_a.kv_store.stats().remote_writes >= 6
    finally:
        engine_a.close()
    engine_b = start_default_engine(kv_store=_store(redis_url, 20, mib), kv_cache_bytes=64 * mib, max_model_len=1024,
                                    kv_events_endpoint=f"ipc://{tmp_path}/events.sock",
                                    kv_events_topic="kv@test@smollm2")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(engine_b.config.kv_events_endpoint)
        drain(sub, 1.0)  # lets the subscription reach the publisher
        store_b = engine_b.kv_store
        deadline = time.monotonic() + 10
        while store_b.stats().remote_blocks < 6 and time.monotonic() < deadline:
            time.sleep(0.05)  # B's listener scans the server when it connects
        before = engine_b.counters()
        again = engine_b.generate(prompt, max_tokens=8, cache_salt="shared-tier")
        seen = engine_b.counters().since(before)
        expected = (len(prompt) - 1) // BS * BS  # 192: every full block but the last token's
        assert again.num_cached_tokens == seen.external_hits == expected
        assert seen.prefix_cache_hits == 0
        assert store_b.stats().remote_hits == expected // BS
        assert again.token_ids == first.token_ids  # greedy: the loaded KV is A's exact KV
        # the shared-tier hits are published as stored blocks, with the prompt's tokens
        want = [prompt[i:i + BS] for i in range(0, expected, BS)]
        assert [b for b in stored_tokens(drain(sub)) if b in want] == want
        other = engine_b.generate(prompt, max_tokens=1, cache_salt="another-tenant")
        assert other.num_cached_tokens == 0  # A's blocks never serve another salt
    finally:
        sub.close(linger=0)
        ctx.term()
        engine_b.close()
