"""``promptsplice bench offload``: revisiting prefixes after vLLM's own pool evicted them.

The trace: ``prompts`` prompts of real text (``prompt_tokens`` tokens each) visited
round-robin for ``rounds`` rounds, on an engine whose KV pool is sized small on purpose
(about ``pool_prompts`` prompts), so from the second round on vLLM's prefix cache has
evicted every prefix it is asked for.  Two modes, each on its own engine, same trace:

* ``apc``: vLLM alone (prefix caching only);
* ``tiered``: vLLM with the splice connector and the tiered store (DRAM, then disk).

The two run at equal capacity (the same KV blocks, block size, dtype and context; else
:class:`~promptsplice.errors.ConfigError` before the second trace).

Per mode: ``prefill_tokens`` (prompt tokens minus vLLM's cached tokens),
``cached_tokens`` (vLLM's ``num_cached_tokens``, local + connector), ``external_cached_tokens``
(vLLM's ``external_prefix_cache_hits`` counter) and ``wall_s``; ``outputs_identical``
compares the greedy outputs of the two modes request by request.

``load_vs_recompute``: recompute time / load time for the same blocks, in one run.
Recompute time is the marginal prefill time of the prompt's full blocks (uncached TTFT
minus TTFT when they are all cached, both measured by the ``apc`` engine, which saves
nothing; ``None`` when the two are equal within noise); load time is what the
connector's worker spends getting those blocks from the store tier and writing them into
the paged cache (from DRAM; from disk via a second store whose DRAM tier holds one block,
files written just before, so the OS page cache may hold them: the disk figure is an
upper bound on what a cold disk gives).

``write_down``: what durability costs the disk tier's writer, in one run: records per
second written inline (encode, write, fsync the file, rename) with the fsync of the
folder after each rename (what the store does: a power cut cannot lose a record counted
as written) and without it, same payload (one block of the bench's engine), same
filesystem, the modes interleaved; ``dir_fsync_slowdown`` is the ratio of the two.
``records_per_s_write_behind``: the same records queued to the background writer, which
commits in groups (one folder fsync per batch), until drained; ``write_behind_over_inline``
its ratio to ``records_per_s``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from promptsplice.benchmarks._stats import capacity_shape
from promptsplice.benchmarks.ttft import _text_tokens
from promptsplice.errors import ConfigError

__all__ = ["run_offload_bench", "OFFLOAD_MODES"]

OFFLOAD_MODES = ("apc", "tiered")


def _bytes_per_block(engine_cfg: dict[str, Any]) -> int:
    """KV bytes of one block of the default model in the dtype the engine picks."""
    from promptsplice.engine_adapters import EngineConfig
    from promptsplice.assets import default_model_dir

    cfg = json.loads((default_model_dir() / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # (a GPU's "auto": the default model's bfloat16, or float16)
    itemsize = {"bfloat16": 2, "float16": 2, "half": 2, "auto": 2, "float32": 4, "float": 4}[EngineConfig().dtype]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head * engine_cfg["block_size"] * itemsize


def _run_trace(engine: Any, prompts: list[list[int]], rounds: int, max_tokens: int) -> tuple[dict[str, Any], list[list[int]]]:
    before = engine.counters()
    outs: list[list[int]] = []
    prompt_tokens = cached = 0
    t0 = time.perf_counter()
    for _ in range(rounds):
        for p in prompts:
            c = engine.generate(p, max_tokens=max_tokens)
            outs.append(list(c.token_ids))
            prompt_tokens += c.prompt_tokens
            cached += c.num_cached_tokens
    wall = time.perf_counter() - t0
    delta = engine.counters().since(before)
    return {
        "requests": rounds * len(prompts),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prompt_tokens - cached,
        "cached_tokens": cached,
        "external_cached_tokens": delta.external_hits,
        "wall_s": round(wall, 3),
    }, outs


def _time_loads(engine: Any, tokens: list[int], repeats: int = 5) -> tuple[float, float, int]:
    """Seconds to load ``tokens``' full blocks into the paged cache: (DRAM, disk, blocks)."""
    import torch

    from promptsplice.engine_adapters import BlockStore, LookupStatus, StoreConfig, chain_refs

    worker = engine.kv_connector.worker
    store = engine.kv_store
    refs = chain_refs(tokens, engine.block_size)[: (len(tokens) - 1) // engine.block_size]
    payloads = [store.get(r, salt=None).payload for r in refs]
    if any(p is None for p in payloads):
        raise RuntimeError("the tiered store lost blocks the bench just saved")
    # Write into blocks 1..n of a cache that holds nothing of value (prefix cache reset).
    engine.reset_prefix_cache()
    block_ids = list(range(1, len(refs) + 1))

    kids = torch.tensor(worker.kernel_ids(block_ids), dtype=torch.int64)
    bd = worker.block_dim

    def write(got: list[Any]) -> None:
        # What the worker does for an offload hit (no relocation): every layer's blocks
        # copied into the cache on its block axis.
        stage = torch.stack([g.payload for g in got])
        for layer, cache in enumerate(worker.caches):
            cache.index_copy_(bd, kids, stage[:, layer].movedim(0, bd).flatten(bd, bd + 1))

    def load_from(s: BlockStore) -> float:
        t0 = time.perf_counter()
        write([s.get(r, salt=None) for r in refs])
        return time.perf_counter() - t0

    dram = min(load_from(store) for _ in range(repeats))
    disk_times = []
    with tempfile.TemporaryDirectory(prefix="promptsplice-disk-") as folder:
        one = int(payloads[0].numel() * payloads[0].element_size())
        cfg = StoreConfig(dram_bytes=one, disk_bytes=4 * one * len(refs), disk_dir=folder, write_behind_bytes=0)
        with BlockStore(cfg) as disk_store:
            for r, p in zip(refs, payloads):
                disk_store.put(r, p, salt=None)
            disk_store.drain()
            for _ in range(repeats):
                # DRAM holds one block: every get but at most one reads its file
                t0 = time.perf_counter()
                got = [disk_store.get(r, salt=None) for r in refs]
                write(got)
                disk_times.append(time.perf_counter() - t0)
                from_disk = sum(g.status is LookupStatus.HIT_DISK for g in got)
                if from_disk < len(refs) - 1:
                    raise RuntimeError(f"only {from_disk} of {len(refs)} blocks came from disk")
    engine.reset_prefix_cache()
    return dram, min(disk_times), len(refs)


def _write_down(payload: Any, blocks: int = 32, repeats: int = 3) -> dict[str, Any]:
    """Inline write-down rate of the disk tier with and without the folder fsync."""
    from promptsplice.blocks import token_bytes
    from promptsplice.engine_adapters import chain_refs
    from promptsplice.engine_adapters.store._disk import DiskTier
    from promptsplice.engine_adapters.store._format import record_size
    from promptsplice.engine_adapters.store._tier import BlockMeta, Held, dtype_name, salt_bytes

    shape, dtype = tuple(payload.shape), dtype_name(payload.dtype)
    held = [
        Held(BlockMeta(0, r.key, salt_bytes(None), r.parent, token_bytes(r.tokens), shape, dtype), payload)
        for r in chain_refs(list(range(16 * blocks)), 16)
    ]
    size = record_size(held[0].meta)
    seconds: dict[str, list[float]] = {"inline": [], "no_dir_fsync": [], "behind": []}
    for _ in range(repeats):
        for mode in seconds:
            with tempfile.TemporaryDirectory(prefix="promptsplice-write-") as folder:
                tier = DiskTier(folder, budget=size * blocks, fingerprint=bytes(16), fsync=True,
                                fsync_dir=mode != "no_dir_fsync",
                                write_behind_bytes=size * blocks if mode == "behind" else 0)
                try:
                    t0 = time.perf_counter()
                    for h in held:
                        job = tier.put((0, h.meta.key), h)
                        if job is None or tier.write(job) is not (None if mode == "behind" else True):
                            raise RuntimeError(f"the disk tier failed to write a record in {folder}")
                    tier.drain()
                    seconds[mode].append(time.perf_counter() - t0)
                    if tier.stats().writes != blocks:
                        raise RuntimeError("the disk tier counted another number of writes")
                finally:
                    tier.close()
    with_dir = blocks / statistics.median(seconds["inline"])
    without = blocks / statistics.median(seconds["no_dir_fsync"])
    behind = blocks / statistics.median(seconds["behind"])
    return {
        "blocks": blocks,
        "record_bytes": size,
        "records_per_s": round(with_dir, 1),
        "records_per_s_without_dir_fsync": round(without, 1),
        "dir_fsync_slowdown": round(without / with_dir, 3),
        "records_per_s_write_behind": round(behind, 1),
        "write_behind_over_inline": round(behind / with_dir, 3),
    }


def _recompute_time(engine: Any, make_prompt: Any, repeats: int = 3) -> tuple[float, list[int]]:
    """Marginal prefill time of a prompt's full blocks: uncached TTFT - cached TTFT."""
    times = []
    prompt: list[int] = []
    for i in range(repeats):
        prompt = make_prompt(10_000 + 131 * i)
        first = engine.generate(prompt, max_tokens=1)
        second = engine.generate(prompt, max_tokens=1)
        times.append(first.ttft_s - second.ttft_s)
    return statistics.median(times), prompt


def run_offload_bench(
    *,
    json_out: str | Path | None = None,
    prompts: int = 8,
    rounds: int = 4,
    prompt_tokens: int = 1024,
    pool_prompts: float = 2.5,
    max_tokens: int = 8,
) -> dict[str, Any]:
    from promptsplice.engine_adapters import EmbeddedEngine, StoreConfig, chain_refs

    max_len = 2 * prompt_tokens
    cfg = {"block_size": 32}
    per_block = _bytes_per_block(cfg)
    pool_blocks = max(int(pool_prompts * prompt_tokens / 32), max_len // 32 + 2)
    common = {"kv_cache_bytes": pool_blocks * per_block, "max_model_len": max_len}
    report: dict[str, Any] = {"modes": {}}

    with tempfile.TemporaryDirectory(prefix="promptsplice-store-") as folder:
        store_cfg = StoreConfig(
            dram_bytes=(prompts * prompt_tokens // 32 + 8) * per_block,
            disk_bytes=2 * prompts * (prompt_tokens // 32 + 2) * per_block,
            disk_dir=folder,
        )
        outputs: dict[str, list[list[int]]] = {}
        shapes: dict[str, Any] = {}
        rec, sample = 0.0, []
        for mode in OFFLOAD_MODES:
            engine = EmbeddedEngine(**common, kv_store=store_cfg if mode == "tiered" else None)
            try:
                shapes[mode] = capacity_shape(engine, store=False)
                if len(shapes) == 2 and shapes["apc"] != shapes["tiered"]:  # before the second trace runs
                    raise ConfigError(f"bench offload: apc and tiered must run at equal capacity, got apc "
                                      f"{shapes['apc']} and tiered {shapes['tiered']}")
                tok = engine.tokenizer
                texts = [_text_tokens(tok, 7 * i + 1, prompt_tokens) for i in range(prompts)]
                m, outs = _run_trace(engine, texts, rounds, max_tokens)
                m["pool_blocks"] = engine.usable_blocks
                report["modes"][mode] = m
                outputs[mode] = outs
                if mode == "apc":
                    # recompute timed without a connector (on tiered its first prefill also
                    # saved every block, which flattered the loads)
                    rec, sample = _recompute_time(engine, lambda off: _text_tokens(tok, off, prompt_tokens))
                else:
                    # the trace's own store traffic, read before the timing loads below
                    # add theirs (about 6 DRAM hits per sampled block)
                    report["store"] = engine.kv_store.stats()._asdict()
                    engine.generate(sample, max_tokens=1)  # its blocks into the store
                    engine.kv_store.drain()
                    dram, disk, n = _time_loads(engine, sample)
                    ok = rec > 0  # (a prompt too short to time: its cached TTFT as long as the uncached)
                    report["load_vs_recompute"] = {
                        "dram": round(rec / dram, 1) if ok else None,
                        "disk": round(rec / disk, 1) if ok else None,
                    }
                    report["load_timing"] = {
                        "blocks": n,
                        "recompute_ms": round(rec * 1e3, 2),
                        "dram_load_ms": round(dram * 1e3, 2),
                        "disk_load_ms": round(disk * 1e3, 2),
                    }
                    one = engine.kv_store.get(chain_refs(sample, engine.block_size)[0]).payload
                    if one is None:
                        raise RuntimeError("the tiered store lost a block the bench just loaded")
                    report["write_down"] = _write_down(one)
            finally:
                engine.close()
    report["outputs_identical"] = outputs["apc"] == outputs["tiered"]
    apc, tiered = report["modes"]["apc"]["prefill_tokens"], report["modes"]["tiered"]["prefill_tokens"]
    report["tiered_over_apc_prefill"] = round(tiered / apc, 4) if apc else None
    report["trace"] = {"prompts": prompts, "rounds": rounds, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens}
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def format_offload(report: dict[str, Any]) -> str:
    lines = ["| mode | prefill tokens | cached (vLLM) | external cached | wall s |", "|---|---|---|---|---|"]
    for mode, m in report["modes"].items():
        lines.append(f"| {mode} | {m['prefill_tokens']} | {m['cached_tokens']} | {m['external_cached_tokens']} | {m['wall_s']} |")
    lt = report.get("load_timing", {})
    lines.append(
        f"tiered/apc prefill {report['tiered_over_apc_prefill']}; outputs identical: "
        f"{report['outputs_identical']}; load vs recompute ({lt.get('blocks')} blocks, recompute "
        f"{lt.get('recompute_ms')} ms): DRAM {report['load_vs_recompute']['dram']}x "
        f"({lt.get('dram_load_ms')} ms), disk {report['load_vs_recompute']['disk']}x ({lt.get('disk_load_ms')} ms)"
    )
    wd = report.get("write_down")
    if wd:
        lines.append(
            f"write-down ({wd['blocks']} records of {wd['record_bytes']} bytes, inline): "
            f"{wd['records_per_s']} records/s with the folder fsync, "
            f"{wd['records_per_s_without_dir_fsync']} without ({wd['dir_fsync_slowdown']}x)"
            + (f"; write-behind, one folder fsync per batch: {wd['records_per_s_write_behind']} records/s "
               f"({wd['write_behind_over_inline']}x inline)" if "records_per_s_write_behind" in wd else "")
        )
    return "\n".join(lines)
