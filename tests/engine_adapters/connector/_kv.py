"""Shared pieces of the connector's engine-free tests: real chain-hash blocks of 32
tokens, caches ``[num_blocks, kv_heads=2, 32, 2 * head_size=128]`` bf16 per layer,
3 layers, laid out like vLLM's CPU_ATTN cache with ISA ``vec`` (K stored transposed)."""

from __future__ import annotations

import torch

from promptsplice.engine_adapters import chain_refs, plan_deletion
from promptsplice.engine_adapters.connector._worker import SpliceWorker
from promptsplice.kernels import CpuAttnLayout, RopeConfig

BS = 32
SALT = "tenant-a"
LAYERS, HEADS, HD, NB = 3, 2, 64, 24
ROPE = RopeConfig(head_size=HD, rotary_dim=HD, theta=100000.0)  # SmolLM2-135M's
LAYOUT = CpuAttnLayout("vec")
PAYLOAD = LAYERS * HEADS * BS * 2 * HD * 2  # bytes of one block (bf16)


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def random_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.attn": torch.randn(NB, HEADS, BS, 2 * HD, generator=g).bfloat16() for i in range(LAYERS)
    }


def poisoned_caches() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.attn": torch.full((NB, HEADS, BS, 2 * HD), float("nan"), dtype=torch.bfloat16) for i in range(LAYERS)}


def worker(store, caches, **kw) -> SpliceWorker:
    """A worker over CPU_ATTN caches (ISA ``vec``) with SmolLM2's RoPE unless told."""
    kw.setdefault("backend", "CPU_ATTN")
    kw.setdefault("isa", "vec")
    kw.setdefault("rope", ROPE)
    kw.setdefault("block_size", BS)
    return SpliceWorker(store, caches=caches, **kw)


def fill_store(store, tokens, salt=SALT, blocks=None, seed=1):
    """Save the full blocks of ``tokens`` (all, or the indices ``blocks``) with random KV;
    returns {block index: payload}."""
    g = torch.Generator().manual_seed(seed)
    refs = chain_refs(tokens, BS, salt=salt)
    out = {}
    for j, ref in enumerate(refs):
        if blocks is not None and j not in blocks:
            continue
        p = torch.randn(LAYERS, 1, HEADS, BS, 2 * HD, generator=g).bfloat16()
        store.put(ref, p, salt=salt)
        out[j] = p
    return out


def deletion_case(store):
    """old = P + X + S + q, stored; new = P + S + tail."""
    P, X, S = toks(2 * BS), toks(2 * BS, 5000), toks(3 * BS, 9000)
    old, new = P + X + S + [1, 2], P + S + toks(10, 20000)
    payloads = fill_store(store, old)
    plan = plan_deletion(old, new, (len(P), len(P) + len(X)), block_size=BS, salt=SALT)
    return old, new, plan, payloads
