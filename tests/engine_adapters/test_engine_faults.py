"""An engine that fails, or dies, mid-request: the error surfaces, nothing wrong is served.

The fault is injected into the real model: one decoder layer's ``forward`` raises (a
worker crash cannot be produced on demand inside this process).  Layer 15 of 30, so a
failed prefill has written half of its layers' KV: exactly the partial state that must
never be served (vLLM files a block's hash when it allocates the block, before the
forward pass writes it).
"""

from __future__ import annotations

import contextlib

import pytest

from promptsplice.blocks import chain_hashes
from promptsplice.errors import EngineDeadError, EngineError, EngineRequestError
from tests.conftest import start_default_engine

FAULT_LAYER = 15


def _layer(eng, index: int = FAULT_LAYER):
    runner = eng.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return runner.model.model.layers[index]


@contextlib.contextmanager
def layer_fault(eng, *, after_calls: int = 0, times: int | None = 1, raises: type[BaseException] = RuntimeError):
    """Make one decoder layer raise ``raises``: after ``after_calls`` good forward passes,
    for ``times`` passes (``None``: for ever, a dead engine).  Yields the call counter."""
    layer = _layer(eng)
    orig = layer.forward
    state = {"calls": 0, "raised": 0}

    def forward(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] > after_calls and (times is None or state["raised"] < times):
            state["raised"] += 1
            raise raises(f"injected fault in layer {FAULT_LAYER}")
        return orig(*args, **kwargs)

    layer.forward = forward
    try:
        yield state
    finally:
        layer.__dict__.pop("forward", None)


def _prompt(seed: int, n: int = 330) -> list[int]:
    return [(7 * i + 131 * seed) % 40000 + 50 for i in range(n)]


@pytest.mark.reliability
def test_a_failed_prefill_never_leaves_unwritten_blocks_in_the_cache(fresh_engine, measured):
    eng = fresh_engine
    prompt = _prompt(1)
    ref = eng.generate(prompt, max_tokens=8)
    eng.reset_prefix_cache()
    with layer_fault(eng) as fault:
        with pytest.raises(EngineRequestError, match="empty prefix cache") as info:
            eng.generate(prompt, max_tokens=8)
    assert fault["raised"] == 1
    assert isinstance(info.value.__cause__, RuntimeError)
    assert len(eng.mirror) == 0  # the engine emptied its mirror with the cache
    again = eng.generate(prompt, max_tokens=8)
    # Without the adapter's cache drop vLLM served 320 of these tokens from blocks whose
    # layers 15-29 were never written, and answered other tokens (measured).
    assert again.num_cached_tokens == 0
    assert again.predicted_cached_tokens == 0
    assert again.token_ids == ref.token_ids
    measured.update(failed=1, cached_after_failure=again.num_cached_tokens, wrong=0)


@pytest.mark.reliability
def test_an_interrupted_prefill_never_leaves_unwritten_blocks_in_the_cache(fresh_engine):
    """Ctrl-C (KeyboardInterrupt) in a forward pass skipped the cache drop that an error
    gets: the same prompt was then served 320 cached tokens never written, another
    answer.  The interrupt still reaches the caller, and the engine serves on."""
    eng = fresh_engine
    prompt = _prompt(21)
    ref = eng.generate(prompt, max_tokens=8)
    eng.reset_prefix_cache()
    with layer_fault(eng, raises=KeyboardInterrupt) as fault:
        with pytest.raises(KeyboardInterrupt):
            eng.generate(prompt, max_tokens=8)
    assert fault["raised"] == 1 and len(eng.mirror) == 0
    again = eng.generate(prompt, max_tokens=8)
    assert again.num_cached_tokens == 0 and again.predicted_cached_tokens == 0
    assert again.token_ids == ref.token_ids


def test_an_interrupted_prefill_whose_cache_cannot_be_emptied_shuts_the_engine_down(monkeypatch):
    """The engine was marked dead but the next request still ran, on the blocks the
    interrupted step filed unwritten: it is shut down now, and says why.  (An engine of
    its own: the session's must survive.)"""
    from promptsplice.errors import EngineDeadError
    from tests.conftest import start_default_engine

    eng = start_default_engine(kv_cache_bytes=64 << 20, max_model_len=1024)
    try:
        monkeypatch.setattr(eng.llm, "reset_prefix_cache", lambda *a, **k: False)
        with layer_fault(eng, raises=KeyboardInterrupt):
            with pytest.raises(KeyboardInterrupt):
                eng.generate(_prompt(22), max_tokens=4)
        assert eng.closed and len(eng.mirror) == 0
        with pytest.raises(EngineDeadError, match="prefix cache could not be emptied"):
            eng.generate(_prompt(22), max_tokens=4)
    finally:
        eng.close()


@pytest.mark.reliability
def test_a_failed_decode_step_surfaces_and_the_engine_keeps_serving(fresh_engine):
    eng = fresh_engine
    prompt = _prompt(2, 100)
    ref = eng.generate(prompt, max_tokens=6)
    # calls: 1 prefill + decode steps; fail the third pass (mid-generation)
    with layer_fault(eng, after_calls=2):
        with pytest.raises(EngineRequestError):
            eng.generate(prompt, max_tokens=6)
    assert not eng.llm.llm_engine.has_unfinished_requests()
    assert eng.generate(prompt, max_tokens=6).token_ids == ref.token_ids


@pytest.mark.reliability
def test_a_failed_stream_raises_after_its_first_deltas(fresh_engine):
    eng = fresh_engine
    prompt = _prompt(3, 100)
    got = []
    with layer_fault(eng, after_calls=3):
        with pytest.raises(EngineRequestError):
            for delta in eng.stream(prompt, max_tokens=8):
                got.append(delta)
    assert got and all(d.completion is None for d in got)  # some text came, then the error
    done = list(eng.stream(prompt, max_tokens=8))
    assert done[-1].completion is not None and done[-1].completion.finish_reason == "length"


@contextlib.contextmanager
def finish_with_error(eng):
    """vLLM's own scheduler finishes the next request with ``FinishReason.ERROR`` after
    its prefill ran (the path of a failed KV load under ``kv_load_failure_policy="fail"``:
    ``Scheduler.update_from_output`` finishing its error set), marked once at its arrival."""
    sched = eng.llm.llm_engine.engine_core.engine_core.scheduler
    orig = sched.add_request
    marked = []

    def add_request(request):
        orig(request)
        if not marked:
            marked.append(request.request_id)
            sched.encoder_cache_mismatch_reqs.add(request.request_id)

    sched.add_request = add_request
    try:
        yield marked
    finally:
        sched.__dict__.pop("add_request", None)


@pytest.mark.reliability
def test_a_request_vllm_finishes_with_an_error_raises_and_is_never_admitted(fresh_engine):
    """vLLM finished a request with ``finish_reason="error"`` (its retryable internal
    error; a server answers HTTP 500): the engine returned an empty Completion as an
    answer and admitted the prompt's blocks into its mirror.  Now it raises, and cache and
    mirror are emptied as for a request cut short."""
    eng = fresh_engine
    prompt = _prompt(31)
    ref = eng.generate(prompt, max_tokens=6)
    eng.reset_prefix_cache()
    with finish_with_error(eng) as marked:
        with pytest.raises(EngineRequestError, match="finish_reason 'error'.*send the request again"):
            eng.generate(prompt, max_tokens=6)
    assert marked and len(eng.mirror) == 0
    again = eng.generate(prompt, max_tokens=6)
    assert again.num_cached_tokens == again.predicted_cached_tokens == 0
    assert again.token_ids == ref.token_ids


@pytest.mark.reliability
def test_a_dead_engine_restarts_once_then_stays_down(engine, tmp_path, measured):
    """One extra engine (with the splice connector: its store outlives vLLM) dies
    twice: restarted the first time, down for good the second."""
    from promptsplice.engine_adapters import EngineConfig, StoreConfig, chain_refs

    # `engine` is requested so this extra engine is never the last one alive (vLLM's
    # process-wide state goes with the last engine).
    mib = 1 << 20
    scale = 1 if EngineConfig().dtype == "bfloat16" else 2
    store = StoreConfig(dram_bytes=16 * mib * scale, disk_bytes=64 * mib * scale, disk_dir=str(tmp_path), fsync=False)
    eng = start_default_engine(kv_store=store, kv_cache_bytes=96 * mib, max_model_len=2048, max_restarts=1)
    try:
        salt = "faults-restart"
        prompt = _prompt(4, 330)
        ref = eng.generate(prompt, max_tokens=6, cache_salt=salt)
        own_hit = eng.generate(prompt, max_tokens=6, cache_salt=salt)  # vLLM's own cache hit
        assert own_hit.num_cached_tokens == 320 and own_hit.token_ids[0] == ref.token_ids[0]
        eng.kv_store.drain()
        with layer_fault(eng, after_calls=2, times=None):  # dies mid-decode; the probe fails too
            with pytest.raises(EngineDeadError, match="restarted") as info:
                eng.generate(_prompt(8, 330), max_tokens=6, cache_salt=salt)
        assert info.value.restarted is True and eng.restarts == 1
        assert len(eng.mirror) == 0  # the restarted engine's mirror is empty, like its cache
        refs = chain_refs(prompt, eng.block_size, salt=salt)
        assert eng.kv_store.match_prefix(refs, salt=salt) == 10  # the store outlived vLLM
        before = eng.counters()
        redo = eng.generate(prompt, max_tokens=6, cache_salt=salt)
        assert redo.token_ids == own_hit.token_ids  # from the store = from vLLM's own cache
        assert redo.num_cached_tokens == 320 == eng.counters().since(before).external_hits  # new vLLM cache: all from the store
        assert redo.predicted_cached_tokens == 0  # the mirror models vLLM's own cache only

        with layer_fault(eng, times=None):
            with pytest.raises(EngineDeadError, match="max_restarts=1") as info:
                eng.generate(prompt, max_tokens=6, cache_salt=salt)
        assert info.value.restarted is False and eng.restarts == 1
        with pytest.raises(EngineDeadError, match="start a new EmbeddedEngine"):
            eng.generate(prompt, max_tokens=6, cache_salt=salt)
        assert eng.closed
        measured.update(deaths=2, restarts=eng.restarts, wrong=0, served_from_store_after_restart=redo.num_cached_tokens)
    finally:
        eng.close()
    assert engine.generate(_prompt(5, 40), max_tokens=2).token_ids  # the others live on


def test_a_restart_refused_by_a_config_check_leaves_the_engine_dead_not_closed(monkeypatch):
    """The restart's ``start_llm`` raised a ``ConfigError`` (here vLLM's multiprocessing
    switch set meanwhile): it escaped from the failed step instead of EngineDeadError,
    and every later call said the engine was closed.  (An engine of its own.)"""
    eng = start_default_engine(kv_cache_bytes=64 << 20, max_model_len=1024, max_restarts=1)
    try:
        with layer_fault(eng, times=None):  # dies: the probe fails too
            monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
            with pytest.raises(EngineDeadError, match="could not be restarted \\(ConfigError: "
                                                      "VLLM_ENABLE_V1_MULTIPROCESSING='1'") as info:
                eng.generate(_prompt(23), max_tokens=4)
        assert info.value.restarted is False and eng.restarts == 1 and eng.closed
        with pytest.raises(EngineDeadError, match="the engine is down .*the restart failed: ConfigError"):
            eng.generate(_prompt(23), max_tokens=4)
    finally:
        eng.close()


@pytest.mark.reliability
def test_an_engine_without_a_store_restarts_with_a_consistent_cache_and_mirror(engine, measured):
    """The plain engine (no connector, no store) dies mid-decode and comes back: vLLM's
    new cache is empty, the mirror was emptied with it, and both agree again from the
    first request on."""
    mib = 1 << 20
    eng = start_default_engine(kv_cache_bytes=96 * mib, max_model_len=2048, max_restarts=1)
    assert eng.kv_store is None
    try:
        prompt = _prompt(10, 330)  # 10 full blocks
        ref = eng.generate(prompt, max_tokens=6)
        warm = eng.generate(prompt, max_tokens=6)
        assert warm.num_cached_tokens == warm.predicted_cached_tokens == 320
        assert warm.token_ids == ref.token_ids
        assert eng.mirror.match(chain_hashes(prompt, eng.block_size)) == 10  # the engine's own mirror
        with layer_fault(eng, after_calls=2, times=None):  # dies mid-decode; the probe fails too
            with pytest.raises(EngineDeadError, match="restarted") as info:
                eng.generate(_prompt(11, 330), max_tokens=6)
        assert info.value.restarted is True and eng.restarts == 1 and not eng.closed
        assert eng.mirror.match(chain_hashes(prompt, eng.block_size)) == 0  # emptied with the old cache
        before = eng.counters()
        redo = eng.generate(prompt, max_tokens=6)
        assert redo.num_cached_tokens == redo.predicted_cached_tokens == 0  # a new vLLM: empty cache
        assert redo.token_ids == ref.token_ids
        again = eng.generate(prompt, max_tokens=6)
        assert again.num_cached_tokens == again.predicted_cached_tokens == 320
        assert again.token_ids == ref.token_ids
        delta = eng.counters().since(before)
        assert delta.prefix_cache_hits == 320 and delta.external_hits == 0  # vLLM's own counters agree
        measured.update(deaths=1, restarts=eng.restarts, wrong=0, cached_after_restart=redo.num_cached_tokens)
    finally:
        eng.close()
    assert engine.generate(_prompt(12, 40), max_tokens=2).token_ids  # the others live on


def test_close_during_a_paused_stream_is_never_undone_by_a_restart(engine):
    """close() from the stream's own thread (a re-entrant lock), then the stream read on:
    the closed vLLM's failed step looked like a crash, and with max_restarts the engine
    started a new vLLM behind the caller who had just freed it."""
    mib = 1 << 20
    eng = start_default_engine(kv_cache_bytes=96 * mib, max_model_len=2048, max_restarts=1)
    try:
        stream = eng.stream(_prompt(13, 330), max_tokens=8)
        next(stream)
        eng.close()
        with pytest.raises(EngineError, match=r"closed \(close\(\)\) while request .* ran"):
            for _ in stream:
                pass
        assert eng.closed and eng.restarts == 0
        with pytest.raises(EngineError, match="the engine is closed"):
            eng.generate(_prompt(14, 40), max_tokens=2)
    finally:
        eng.close()
    assert engine.generate(_prompt(15, 40), max_tokens=2).token_ids  # the others live on


@pytest.mark.reliability
def test_a_failed_forward_pass_saves_no_partial_block(kv_engine, measured):
    eng = kv_engine
    salt = "faults-partial-save"
    prompt = _prompt(6, 330)  # 10 full blocks
    worker = eng.kv_connector.worker
    store = eng.kv_store
    skipped0 = worker.stats.skipped_saves
    from promptsplice.engine_adapters import chain_refs

    refs = chain_refs(prompt, eng.block_size, salt=salt)
    assert len(refs) == 10
    with layer_fault(eng):
        with pytest.raises(EngineRequestError):
            eng.generate(prompt, max_tokens=4, cache_salt=salt)
    assert worker.stats.skipped_saves - skipped0 == 10
    assert store.match_prefix(refs, salt=salt) == 0  # nothing of the failed step stored
    first = eng.generate(prompt, max_tokens=4, cache_salt=salt)
    store.drain()
    assert first.num_cached_tokens == 0
    assert store.match_prefix(refs, salt=salt) == 10
    # The reference is vLLM's own cache hit on the same 320 tokens: a hit runs attention
    # over cached KV, which on some CPUs (AMX bf16) rounds differently from a fresh
    # prefill, so only a hit compares like with like.
    own_hit = eng.generate(prompt, max_tokens=4, cache_salt=salt)
    assert own_hit.num_cached_tokens == 320 and own_hit.token_ids[0] == first.token_ids[0]
    eng.reset_prefix_cache()
    served = eng.generate(prompt, max_tokens=4, cache_salt=salt)  # from the store
    assert served.num_cached_tokens == 320
    assert served.token_ids == own_hit.token_ids
    measured.update(blocks_skipped=10, partial_blocks_stored=0, served_from_store_after=served.num_cached_tokens)


def test_dead_engine_error_is_an_engine_error():
    err = EngineDeadError("x", restarted=True)
    assert isinstance(err, EngineError) and not isinstance(err, EngineRequestError)
    assert err.restarted is True


def test_a_shutdown_that_fails_is_logged_and_the_count_of_live_engines_still_drops(monkeypatch, caplog):
    """A dead engine's shutdown that raised escaped ``release`` (so ``_die`` never ran the
    restart ``max_restarts`` allowed).  The failure is injected: a real vLLM cannot be
    made to fail its shutdown on demand."""
    import logging

    from promptsplice.engine_adapters import _lifecycle, _vllm

    def broken(llm, *, last_engine):
        raise RuntimeError("injected: the engine core is gone")

    monkeypatch.setattr(_vllm, "shutdown_llm", broken)
    with _lifecycle._live_lock:
        _lifecycle._live_engines += 1
        before = _lifecycle._live_engines
    handle = _lifecycle.Handle(object(), _vllm.AgentBox())
    with caplog.at_level(logging.ERROR, logger="promptsplice.engine_adapters._lifecycle"):
        _lifecycle.release(handle)
    assert handle.llm is None and _lifecycle._live_engines == before - 1
    assert "shutting down a vLLM engine failed" in caplog.text and "injected" in caplog.text
