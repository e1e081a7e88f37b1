"""Shared fixtures: the real default tokenizer, ONE real vLLM engine per session, and
factories for requests and assemblers.

``start_default_engine()`` is the one way the tests start an engine, so the whole
session starts a single one (~4 s, ~1 GiB of RAM) and every test folder shares it.

Hypothesis properties run derandomized (profile ``ci``): the same examples every run,
so a red CI run reproduces and a green one is not luck.  Exploring new examples is a
separate run: ``pytest --hypothesis-profile=explore tests/...`` (a random seed each run,
or ``--hypothesis-seed=N``; ``--hypothesis-seed`` does nothing under ``ci``).
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("ci")  # --hypothesis-profile (read after this file) overrides it


@pytest.fixture(scope="session")
def default_tok():
    """SmolLM2-135M-Instruct's tokenizer (the real default; converted once by setup)."""
    from promptsplice.assembler import default_tokenizer

    return default_tokenizer()


@pytest.fixture
def make_assembler(default_tok):
    """Factory for fresh assemblers on the default tokenizer."""
    from promptsplice.assembler import Assembler

    def make(**kwargs):
        kwargs.setdefault("block_size", 16)
        return Assembler(kwargs.pop("tokenizer", default_tok), **kwargs)

    return make



def start_default_engine(**overrides):
    """The default model on vLLM in this process: block 32 on CPU, 512 MiB of KV cache
    (728 blocks of 32 tokens), max_model_len the model's own (8,192; the smaller ``kv_engine``
    below holds less and gets what fits), greedy sampling by default."""
    from promptsplice.engine_adapters import EmbeddedEngine

    overrides.setdefault("extra_kwargs", {"max_logprobs": -1})  # full-vocabulary logprobs for KL probes
    return EmbeddedEngine(**overrides)


@contextlib.contextmanager
def started_engines(*configs: dict):
    """One engine per dict of ``start_default_engine`` overrides (e.g. a plain engine
    and one with a block store, for modes at equal capacity), closed in reverse order
    however the block ends."""
    with contextlib.ExitStack() as stack:
        engines = []
        for overrides in configs:
            eng = start_default_engine(**overrides)
            stack.callback(eng.close)
            engines.append(eng)
        yield tuple(engines)


@pytest.fixture(scope="session")
def engine():
    """The session's engine (shared: tests that need an empty cache use fresh_engine)."""
    eng = start_default_engine()
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def kv_engine(tmp_path_factory):
    """A second session engine, WITH the splice KV connector: a block store of 16 MiB of
    DRAM (22 blocks of SmolLM2's 0.7 MB in bf16) over 256 MiB of disk in a temporary
    folder, and a 128 MiB KV cache (182 blocks); twice the bytes in float32.  It coexists with ``engine`` (each engine installs
    its own worker-side connector, or none, while it runs).  Tests isolate themselves
    with their own ``cache_salt``."""
    from promptsplice.engine_adapters import EngineConfig, StoreConfig

    # The same block counts in float32 (dtype "auto" on a CPU without AVX-512): twice the bytes.
    mib = 1024 * 1024 * (1 if EngineConfig().dtype == "bfloat16" else 2)
    store = StoreConfig(
        dram_bytes=16 * mib,
        disk_bytes=256 * mib,
        disk_dir=str(tmp_path_factory.mktemp("kv-store")),
        fsync=False,
    )
    eng = start_default_engine(kv_store=store, kv_cache_bytes=128 * mib)
    yield eng
    eng.close()


@pytest.fixture
def fresh_engine(engine):
    """The session's engine with an empty prefix cache (and empty engine mirrors)."""
    engine.reset_prefix_cache()
    return engine


@pytest.fixture(scope="session")
def rag_requests():
    """The demo's built-in RAG sample: 40 requests (repeat-heavy: chunks recur)."""
    from promptsplice.benchmarks.traces import sample_rag_requests

    return sample_rag_requests(40)


@pytest.fixture(scope="session")
def two_servers():
    """Two real ``vllm serve`` on loopback (default model, block 32, 1 GiB of KV cache
    each), started once for the session and shared by the router, gateway, load, served
    and remote tests and the routing bench: each run uses a fresh ``cache_salt`` or token
    ids no one else sends, and reads ``/metrics`` as deltas, so sharing changes nothing
    measured."""
    from promptsplice.benchmarks.servers import BLOCK_SIZE, loopback_servers

    with loopback_servers(2, block_size=BLOCK_SIZE) as servers:
        yield servers


def running(servers):
    """``servers``, failing the test with a server's log tail if it has exited."""
    for srv in servers:
        if srv.proc.poll() is not None:
            pytest.fail(f"vllm serve at {srv.base_url} exited with {srv.proc.returncode}:\n{srv.tail()}")
    return servers


@pytest.fixture
def live_servers(two_servers):
    """``two_servers``, checked to be still running."""
    return running(two_servers)


@pytest.fixture(scope="session")
def served_kv(tmp_path_factory):
    """One real ``vllm serve`` on loopback that loads the splice connector by module
    path (``--kv-transfer-config``): the same store as ``kv_engine`` (16 MiB of DRAM
    over 256 MiB of disk, in bf16 blocks; twice the bytes in float32), block 32, 1 GiB
    of KV cache, dev mode on (``/reset_prefix_cache`` empties vLLM's own cache and
    leaves the connector's store alone), full-vocabulary logprobs (fidelity probes)."""
    from promptsplice.benchmarks.servers import BLOCK_SIZE, loopback_servers
    from promptsplice.engine_adapters import EngineConfig, StoreConfig
    from promptsplice.engine_adapters.connector._settings import kv_transfer_config_json

    mib = 1024 * 1024 * (1 if EngineConfig().dtype == "bfloat16" else 2)
    store = StoreConfig(
        dram_bytes=16 * mib,
        disk_bytes=256 * mib,
        disk_dir=str(tmp_path_factory.mktemp("served-kv-store")),
        fsync=False,
    )
    with loopback_servers(
        1,
        block_size=BLOCK_SIZE,
        extra_args=["--kv-transfer-config", kv_transfer_config_json(store), "--max-logprobs=-1"],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as servers:
        yield servers[0]


# -- numbers the reliability tests measured (RELIABILITY.md quotes them) ---------------
_MEASURED: dict[str, dict] = {}


@pytest.fixture
def measured(request):
    """A dict a test fills with what it measured; the session writes them all to
    ``out/reliability.json`` (merged with earlier runs, keyed by test id)."""
    numbers: dict = {}
    yield numbers
    if numbers:
        _MEASURED[request.node.nodeid] = numbers


def pytest_sessionfinish(session):
    if not _MEASURED:
        return
    import json
    from pathlib import Path

    path = Path(session.config.rootpath) / "out" / "reliability.json"
    try:
        old = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        old = {}
    old.update(_MEASURED)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
