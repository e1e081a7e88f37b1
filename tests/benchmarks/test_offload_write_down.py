"""``bench offload``'s ``write_down`` field: the disk tier's inline write rate with and
without the folder fsync, measured in one run on real files (no engine needed)."""

from __future__ import annotations

import os
import stat

import torch

from promptsplice.benchmarks.offload import _write_down, format_offload


def test_write_down_times_both_modes_and_only_one_fsyncs_the_folder(monkeypatch):
    real = os.fsync
    kinds: list[str] = []

    def fsync(fd: int) -> None:
        kinds.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    wd = _write_down(torch.ones(2, 2, 32, 4, dtype=torch.bfloat16), blocks=4, repeats=1)
    assert set(wd) == {"blocks", "record_bytes", "records_per_s", "records_per_s_without_dir_fsync",
                       "dir_fsync_slowdown", "records_per_s_write_behind", "write_behind_over_inline"}
    assert wd["blocks"] == 4 and wd["record_bytes"] > 2 * 2 * 32 * 4 * 2  # payload + header
    # with the folder fsync: file, folder per record; without: the file only; behind the
    # forward pass: every file, and a folder fsync after each batch (how many records a
    # batch holds depends on when the writer thread wakes: 1 to 4 batches)
    assert kinds[:12] == ["file", "dir"] * 4 + ["file"] * 4
    behind = kinds[12:]
    assert behind.count("file") == 4 and 1 <= behind.count("dir") <= 4 and behind[-1] == "dir"
    assert wd["records_per_s_write_behind"] > 0
    assert abs(wd["write_behind_over_inline"] - wd["records_per_s_write_behind"] / wd["records_per_s"]) < 0.02
    assert wd["records_per_s"] > 0 and wd["records_per_s_without_dir_fsync"] > 0
    ratio = wd["records_per_s_without_dir_fsync"] / wd["records_per_s"]
    assert abs(wd["dir_fsync_slowdown"] - ratio) < 0.01 * ratio + 0.01


def test_the_offload_table_reports_the_write_down_line():
    report = {
        "modes": {"apc": {"prefill_tokens": 1, "cached_tokens": 0, "external_cached_tokens": 0, "wall_s": 1.0}},
        "tiered_over_apc_prefill": 1.0,
        "outputs_identical": True,
        "load_vs_recompute": {"dram": 2.0, "disk": 1.5},
        "write_down": {
            "blocks": 32,
            "record_bytes": 983312,
            "records_per_s": 28.5,
            "records_per_s_without_dir_fsync": 73.2,
            "dir_fsync_slowdown": 2.572,
        },
    }
    line = format_offload(report).splitlines()[-1]
    assert line == (
        "write-down (32 records of 983312 bytes, inline): 28.5 records/s with the folder fsync, "
        "73.2 without (2.572x)"
    )
    report["write_down"].update(records_per_s_write_behind=61.0, write_behind_over_inline=2.14)
    assert format_offload(report).splitlines()[-1].endswith(
        "(2.572x); write-behind, one folder fsync per batch: 61.0 records/s (2.14x inline)"
    )


def test_the_two_modes_must_run_at_equal_capacity(monkeypatch):
    """The modes got the same ``kv_cache_bytes``, but their block counts were only
    reported: a connector that reserved memory would have compared a smaller pool.
    A mismatch is a ConfigError before the second trace runs (fake engines: no vLLM)."""
    import types

    import pytest

    import promptsplice.engine_adapters as ea
    from promptsplice.benchmarks.offload import run_offload_bench
    from promptsplice.errors import ConfigError

    traced = []

    class Engine:
        def __init__(self, kv_store=None, **kw):
            self.num_blocks = 40 if kv_store is None else 39  # the tiered one holds a block less
            self.block_size, self.max_model_len, self.usable_blocks = 32, kw["max_model_len"], self.num_blocks - 1
            self.config = types.SimpleNamespace(dtype="float32", enable_prefix_caching=True, kv_store=kv_store)
            from promptsplice.assembler import default_tokenizer
            self.tokenizer = default_tokenizer()

        def counters(self):
            return types.SimpleNamespace(since=lambda before: types.SimpleNamespace(external_hits=0))

        def generate(self, prompt, max_tokens):
            traced.append(self.num_blocks)
            return types.SimpleNamespace(token_ids=[1], prompt_tokens=len(prompt), num_cached_tokens=0, ttft_s=0.1)

        def close(self):
            pass

    monkeypatch.setattr(ea, "EmbeddedEngine", Engine)
    with pytest.raises(ConfigError, match="apc and tiered must run at equal capacity"):
        run_offload_bench(prompts=2, rounds=1, prompt_tokens=64)
    assert set(traced) == {40}  # the tiered trace never ran
