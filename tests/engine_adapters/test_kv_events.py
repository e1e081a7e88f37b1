"""vLLM's KV-event publisher on an engine promptsplice starts, as an external router sees
it: a real engine with the splice connector publishes over ZMQ to a subscriber that binds
at a local ``ipc://`` endpoint.  Blocks the connector loads (an offload hit after the
prefix cache is reset) must arrive as ``BlockStored``, with the prompt's tokens, so a
prefix-aware router counts them as cached on this engine."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from promptsplice.engine_adapters import EngineConfig, StoreConfig
from promptsplice.errors import ConfigError

BS = 32


def test_the_endpoint_sets_vllms_kv_events_config():
    kw = EngineConfig(kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_topic="kv@a@m").llm_kwargs("/m")
    assert kw["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": "tcp://127.0.0.1:5557", "topic": "kv@a@m"}
    assert "kv_events_config" not in EngineConfig().llm_kwargs("/m")
    with pytest.raises(ConfigError, match="ZMQ endpoint"):
        EngineConfig(kv_events_endpoint="127.0.0.1:5557")
    with pytest.raises(ConfigError, match="kv_events_endpoint owns"):
        EngineConfig(kv_events_endpoint="tcp://127.0.0.1:5557", extra_kwargs={"kv_events_config": {}})
    # endpoints vLLM's publisher cannot use (tcp:// without a port raised zmq's own error
    # at start), or that publish nothing (inproc://, a topic alone, prefix caching off)
    for bad, why in (("tcp://", "needs a host and a port"), ("tcp://*", "needs a host and a port"),
                     ("tcp://gpu-router", "needs a host and a port"), ("tcp://h:0", "needs a host and a port"),
                     ("inproc://events", "only inside vLLM's engine process"), ("ipc://", "names no path"),
                     # vLLM connects to 0.0.0.0 (it binds '*' only): no subscriber heard anything
                     ("tcp://0.0.0.0:5557", r"use tcp://\*:5557"), ("tcp://[::]:5557", "publishes to nobody")):
        with pytest.raises(ConfigError, match=why):
            EngineConfig(kv_events_endpoint=bad)
    with pytest.raises(ConfigError, match="without kv_events_endpoint publishes nothing"):
        EngineConfig(kv_events_topic="kv@a@m")
    with pytest.raises(ConfigError, match="turn prefix caching on"):
        EngineConfig(kv_events_endpoint="ipc:///tmp/kv-events", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="binds an address with '::' without turning IPv6 on"):
        EngineConfig(kv_events_endpoint="tcp://[::1]:5557")
    for good in ("tcp://*:5557", "tcp://*:0", "tcp://10.0.0.7:5557", "tcp://router.local:5557", "ipc:///tmp/kv-events"):
        assert EngineConfig(kv_events_endpoint=good).llm_kwargs("/m")["kv_events_config"]["endpoint"] == good


@pytest.fixture(scope="module")
def events_engine(tmp_path_factory):
    """The default model with the splice connector (16 MiB DRAM store) and the publisher
    on, bound at an ``ipc://`` endpoint (nothing leaves the machine)."""
    from promptsplice.engine_adapters import EmbeddedEngine

    mib = 1024 * 1024 * (1 if EngineConfig().dtype == "bfloat16" else 2)
    folder = tmp_path_factory.mktemp("kv-events")
    store = StoreConfig(dram_bytes=16 * mib, disk_bytes=64 * mib, disk_dir=str(folder / "store"), fsync=False)
    eng = EmbeddedEngine(kv_store=store, kv_cache_bytes=128 * mib,
                         kv_events_endpoint=f"ipc://{folder}/events.sock", kv_events_topic="kv@test@smollm2")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def subscriber(events_engine):
    """A ZMQ SUB connected to the engine's publisher, subscribed to every topic."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events_engine.config.kv_events_endpoint)
    yield sub
    sub.close(linger=0)
    ctx.term()


def drain(sub, seconds: float = 3.0) -> list:
    """Every event received within ``seconds`` (the publisher sends from its own thread)."""
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, _seq, payload = sub.recv_multipart()
            assert topic == b"kv@test@smollm2"
            events.extend(decoder.decode(payload).events)
    return events


def stored_tokens(events) -> list[list[int]]:
    """The token ids of every block announced as stored (one event may name several)."""
    blocks = []
    for e in events:
        if type(e).__name__ == "BlockStored":
            assert len(e.token_ids) == len(e.block_hashes) * e.block_size == len(e.block_hashes) * BS
            blocks += [list(e.token_ids[i:i + BS]) for i in range(0, len(e.token_ids), BS)]
    return blocks


def test_blocks_loaded_by_the_connector_are_published_as_stored(events_engine, subscriber, default_tok):
    sub = subscriber
    text = " ".join(f"Item {i} of the kv-events probe is the number {i * 7}." for i in range(40))
    prompt = default_tok.encode(text)[:203]
    full = (len(prompt) - 1) // BS * BS  # 192: six whole blocks (the last token is never cached)
    drain(sub, 1.0)  # lets the subscription reach the publisher

    first = events_engine.generate(prompt, max_tokens=2, cache_salt="kv-events")
    assert first.num_cached_tokens == 0
    computed = stored_tokens(drain(sub))
    want = [prompt[i:i + BS] for i in range(0, full, BS)]
    assert [b for b in computed if b in want] == want  # computed blocks: published as usual

    events_engine.reset_prefix_cache()  # vLLM's cache is empty; the connector's store is not
    before = events_engine.counters()
    again = events_engine.generate(prompt, max_tokens=2, cache_salt="kv-events")
    seen = events_engine.counters().since(before)
    assert again.num_cached_tokens == seen.external_hits == full  # loaded by the connector
    assert seen.prefix_cache_hits == 0
    events = drain(sub)
    names = [type(e).__name__ for e in events]
    assert "AllBlocksCleared" in names  # the reset is published with the next step's batch
    loaded = stored_tokens(events[names.index("AllBlocksCleared"):])
    assert [b for b in loaded if b in want] == want  # ...and published as stored blocks
