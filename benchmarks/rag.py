"""``promptsplice bench rag``: a RAG trace through the embedded vLLM engine, judged by vLLM.

This is one module (~800 lines): the modes share one run loop, one set of bounds and one report
format, which the suite (``rag_suite``) and the CLI job call as a unit; split, each
piece would import the others.

Two modes run the same requests on the same engine, each from an empty prefix cache:

* ``naive``: what user code does today: the retrieved chunks in retrieval order, no
  dedup, joined as plain text and tokenized whole by vLLM's tokenizer (the ids
  ``generate(text)`` would send, tokenized inside the timed preparation);
* ``promptsplice``: :class:`promptsplice.assembler.Assembler` with the engine's block size and a
  mirror as large as the engine's KV cache, sent as token ids.

``cached_tokens`` is vLLM's own ``num_cached_tokens`` per request (summed), and
``prefill_tokens = prompt_tokens - cached_tokens``.  The mirror block compares what the
assembler predicted with what vLLM measured (they are equal when nothing else uses the
engine).  The bounds are those of :mod:`promptsplice.benchmarks.bounds`, with the engine's tokenizer.

JSON (names fixed)::

    {"modes": {"naive": M, "promptsplice": M},
     "mirror": {"predicted_cached_tokens", "measured_cached_tokens"},
     "radix_prefill_tokens": int, "oracle_prefill_tokens": int, ...}
    M = {"requests", "prompt_tokens", "prefill_tokens", "cached_tokens", "hit_rate",
         "wall_s", "ttft_p50_ms", "ttft_p99_ms", "small_sample", "percentile_min_n"}

(``small_sample``: a TTFT percentile rests on fewer requests than it needs, so it is
their slowest or fastest; ``percentile_min_n`` says how many each needs: 100 for p99.)
A request's TTFT runs from the call: its preparation (the naive text and its
tokenization, the assembly) and then the engine's time to first token, as PIC's counts
its planning.  Tokenizing counts in every mode: ``naive`` tokenizes its whole text with
vLLM's own tokenizer (``EmbeddedEngine.encode_prompt``, what ``generate(text)`` does before
its clock starts) and sends the ids; each exact mode's assembler starts with an empty
token cache (the fit check below runs on an assembler of its own; until 2026-12-08 it
ran on ``promptsplice``'s, whose chunks were then all tokenized before its timed loop).

With a second engine that runs the splice connector (``kv_engine``; the CLI always
starts one), a third mode ``promptsplice_pic`` runs the same requests through
:class:`promptsplice.engine_adapters.RagRunner` in mode ``position_independent``: after the prefix
hit, every chunk computed before anywhere is relocated from the block store (new
chunks are precomputed exactly, then relocated too), when the runner predicts that
this computes fewer tokens than one exact request (``exact_requests`` counts those sent
exact instead, ``StepFallback.NO_GAIN``).  Its ``prefill_tokens`` count
every token the engine computed for a request (the precompute included), ``cached =
max(prompt - prefill, 0)`` (a precompute larger than the prompt's hits would make it
negative), ``wall_s`` and TTFTs cover all its engine requests.  Beside it::

    "pic": {"relocated_tokens", "precomputed_tokens", "engine_requests", "exact_requests",
            "too_long_requests", "recompute_blocks", "exact_alignment", "recompute_at", "run_max_deviation", "guard", "gap_closed", "kv_cache_blocks",
            "store_dram_bytes", "probe_traffic", "shared_store"},
    "fidelity": {"tf_top1_agreement", "first_token_kl", "greedy_agreement", "steps",
                 "first_token_kl_p50", "first_token_kl_p90", "first_token_kl_max",
                 "first_token_kl_ci95", "tf_top1_p50", "tf_top1_p10", "tf_top1_min",
                 "tf_top1_ci95", "requested", "probes", "control": {...}}

Fidelity (:mod:`promptsplice.benchmarks.fidelity`) is measured on requests whose plan
relocates chunks (32 by default), spread over the trace, against a one-pass exact
prefill of the same tokens (``probes``: one record per probe, its KL and top-1 beside
the request's counts, :func:`_probe_signals`); the control is a second exact prefill of them whose first
half came from the prefix cache.  Each probed request must have relocated what its
plan did and each probe request must be served its KV from the cache, else
:class:`~promptsplice.benchmarks.fidelity.FidelityError` fails the bench.  Probes run
after a request's timing and are not counted in any mode.

**Equal capacity.**  ``promptsplice_store`` is the control for PIC: exact assembly with
PIC's own exact layout (same policy and format, alignment ``pic_exact_alignment``: until
2026-12-03 it took ``alignment``, so a PIC run with whole-block chunks was compared with
a control laid out otherwise) sent as token ids under its own salt to an engine with the
*same* tiered block store as ``promptsplice_pic`` (offload hits served by the connector
count as cached, as vLLM counts them).  PIC's gain over it is position-independent
reuse alone, not extra offload capacity or another layout.  Fidelity probes run on the
PIC engine between its requests (refreshing that prompt's blocks in its LRU): take
``gap_closed_vs_store`` from a run with ``fidelity_requests=0``; ``pic.probe_traffic`` says
whether probes ran there (the suite then skips the family's ``pic_gap_closed_vs_store``).
Every engine has the same KV cache (blocks, block size, dtype, prefix caching,
``max_model_len``) and both store modes the same store tiers (DRAM, disk, remote): a
difference is a ``ConfigError``.  No mode sees
another's traffic: ``naive`` and ``promptsplice`` run one after the other on the plain
engine, its prefix cache emptied in between; with a ``kv_engine`` *factory* (the CLI)
each store mode gets a fresh engine and an empty store, closed after it; with one
``kv_engine`` instance (the tests, ``--suite --one-store-engine``) the two store modes
run under salts that cannot meet and share the store's budget: PIC starts on a store the
control filled (``reset_prefix_cache`` empties vLLM's cache, not the store), which
``pic.shared_store`` says, and the suite then skips the family's PIC-vs-store figures.  Beside the modes::

    "store": {"predicted_cached_tokens", "measured_cached_tokens", "external_cached_tokens", "alignment",
              "kv_cache_blocks", "store_dram_bytes", "store_disk_bytes", "store_remote_bytes"}
    "pic": {..., "gap_closed_vs_store",   # share of the promptsplice_store -> oracle gap
            "gap_closed_vs_store_whole_block",  # ... -> whole-block oracle gap (below)
            "gap_closed_vs_store_ceiling",      # ... -> PIC's ceiling (below)
            "ceiling_gap_closed_vs_store"}      # the ceiling's share of the store -> oracle gap

(the engine's mirror predicts its own prefix cache; the store adds the external hits).

**Bounds.**  ``"bounds"`` holds the radix ideal and the oracle of
:mod:`promptsplice.benchmarks.bounds`, unbounded and *capacity-matched* (LRU over the
engine's usable KV blocks, in tokens: ``capacity_tokens``; both oracles floored per
request by the prefix-caching modes' radix ideals, the capacity-matched one by their
LRUs of that capacity, as ``bench assemble`` floors its bounded oracle: until 2026-12-08
it was not, and could exceed the capacity-matched radix ideal), and per mode the bound it is
checked against (``"checks"``).  A bound a mode may not beat must hold for every cache
of every size, so it is the unbounded one: an LRU over N blocks is not the best a cache
of N blocks can do (Belady's eviction keeps more), and vLLM's block pool does not evict
in the radix tree's order, so a capacity-matched LRU figure is a like-for-like
*reference* (the target "promptsplice prefills no more than the capacity-matched radix
ideal"), never a floor.  The modes with a store hold more than the KV cache, which is
one more reason they are checked against the unbounded bounds.  Per mode:

* ``naive``: the unbounded radix ideal over naive's own prompts (vLLM reuses a prompt
  only up to a block-aligned prefix it shares with an earlier one, never its last token);
* ``promptsplice``, ``promptsplice_store``: the unbounded oracle (exact reuse of the
  trimmed segments anywhere is at least as good as a prefix hit), or the unbounded radix
  ideal of the mode's own prompts where that is higher (``own_radix_prefill_tokens``:
  mode -> tokens; whatever vLLM's cache or the store serves came from the mode's own
  earlier prompts, so an over-count of its hits fails here, where the oracle, the least
  over every mode, let it pass; until 2026-12-07 ``bench rag`` checked the oracle only);
* ``promptsplice_pic``: the unbounded oracle (relocation reuses whole stored chunks at
  new positions, which the oracle already credits, and PIC counts its precompute).

Beside them a reference that is no bound: ``oracle_whole_block_prefill_tokens``, the
oracle with every segment but the query padded to whole blocks
(:func:`~promptsplice.benchmarks.bounds.whole_block_segments`), as both store modes lay
chunks out with ``--pic-exact-alignment all``.  The padding between it and the oracle
is prefill that no reuse of whole-block chunks avoids, so
``pic.gap_closed_vs_store_whole_block`` (PIC's share of the store -> whole-block oracle
gap) says how much of what relocation could reach in that layout it reached.
``pic_ceiling_prefill_tokens`` (:class:`~promptsplice.benchmarks.bounds.RelocationCeiling`,
a reference too, fed the store modes' layouts) narrows it to PIC's recompute settings:
every chunk seen before relocated, none computed by the guard, but the first
``recompute_blocks`` blocks of each (``recompute_at="chunk"``; of each run at ``"run"``)
computed.  So ``pic.ceiling_gap_closed_vs_store`` is about the most
``gap_closed_vs_store`` can be at those settings on the trace (re-asks' query blocks,
which it charges, make it a little low), and ``pic.gap_closed_vs_store_ceiling`` PIC's
share of that.

A mode that prefills fewer tokens than its bound is a bug in the bound or the bench:
:func:`promptsplice.benchmarks.bounds.check_bounds` fails the bench (exit status
``BOUND_EXIT``) after the report is written.

**Coverage.**  A request whose prompt (naive text or assembly, plus a small margin)
would not fit the engine's ``max_model_len`` is skipped in every mode (so the modes stay
comparable); the report carries ``coverage``, ``steps_run``, ``steps_total``,
``skipped_steps`` (:mod:`promptsplice.benchmarks.coverage`) and ``skipped_requests``
(trace indices), and the CLI exits ``COVERAGE_EXIT`` below 0.95 unless ``--allow-skips``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks._stats import capacity_shape, error_report, percentile, sample_flags
from promptsplice.benchmarks.assemble import _chunks, _oracle_segments, gap_closed
from promptsplice.benchmarks.bounds import (
    BOUND_EXIT,
    BoundError,
    OracleCounter,
    RadixPrefill,
    RelocationCeiling,
    whole_block_segments,
    bound_checks,
    check_bounds,
    floor_per_request,
)
from promptsplice.benchmarks.coverage import COVERAGE_EXIT, Coverage, CoverageError, check_coverage
from promptsplice.benchmarks.fidelity import (
    DEFAULT_PROBES,
    PROBE_TOKENS,
    Fidelity,
    check_probes,
    probe_coverage,
    probe_relocated_request,
)
from promptsplice.benchmarks.traces import RagRequest, read_rag_trace
from promptsplice.errors import ConfigError, ContextLengthError

__all__ = ["run_modes", "run_rag_bench", "format_modes", "mode_bounds", "MODES", "STORE_MODE", "PIC_MODE",
           "FIT_MARGIN",
           "start_rag_engines", "bench_status"]

MODES = ("naive", "promptsplice")
STORE_MODE = "promptsplice_store"
STORE_LAYOUTS = ("store_aware", "cache_only")
PIC_MODE = "promptsplice_pic"
FIT_MARGIN = 8
"""Tokens kept free below ``max_model_len`` when deciding that a request fits."""




def _mode_metrics(completions: list[Any], wall: float, prep_s: Sequence[float]) -> dict[str, Any]:
    """A mode's metrics from its completions; each TTFT counts the request's preparation
    (``prep_s``: formatting and tokenizing, or assembly) before the engine's own time to first token, as
    PIC's step TTFT counts its planning (until 2026-12-07 these left it out: against PIC)."""
    prompt = sum(c.prompt_tokens for c in completions)
    cached = sum(c.num_cached_tokens for c in completions)
    ttfts = [(p + c.ttft_s) * 1e3 for c, p in zip(completions, prep_s, strict=True)]
    return _metrics(len(completions), prompt, cached, ttfts, wall)


def _pic_metrics(steps: list[Any]) -> dict[str, Any]:
    """PIC's mode metrics from its step records: ``prefill_tokens`` counts every token
    its engine requests computed, the precompute included, so it can exceed the prompt;
    ``cached_tokens`` is then 0, never negative."""
    prompt = sum(st.prompt_tokens for st in steps)
    prefill = sum(st.prefill_tokens for st in steps)
    return _metrics(len(steps), prompt, max(prompt - prefill, 0), [st.ttft_s * 1e3 for st in steps],
                    sum(st.wall_s for st in steps), prefill=prefill)


TTFT_PERCENTILES = {"ttft_p50_ms": 0.5, "ttft_p99_ms": 0.99}
"""The nearest-rank percentiles of a mode's metrics: below 100 requests ``ttft_p99_ms``
is their slowest (``small_sample``, ``percentile_min_n``)."""


def _metrics(n: int, prompt: int, cached: int, ttfts: list[float], wall: float, *,
             prefill: int | None = None) -> dict[str, Any]:
    """``prefill`` (default ``prompt - cached``): PIC's, which counts its precompute and
    can exceed the prompt; ``cached`` is then never below 0."""
    return {
        "requests": n,
        "prompt_tokens": prompt,
        "prefill_tokens": prompt - cached if prefill is None else prefill,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
        "wall_s": round(wall, 3),
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 2),
        "ttft_p99_ms": round(percentile(ttfts, 0.99), 2),
        **sample_flags(len(ttfts), TTFT_PERCENTILES),
    }


def _fitting(engine: Any, asm: Any, fmt: Any, requests: Sequence[RagRequest]) -> list[int]:
    """Indices of the requests whose naive text and assembly both fit ``max_model_len``
    (with a margin of :data:`FIT_MARGIN` tokens for tokenizer differences).  A request
    that fits only without whole-block chunks is run in every mode: position-independent
    reuse sends it exact in that layout (``StepFallback.TOO_LONG``, ``too_long_requests``)."""
    limit = engine.max_model_len - FIT_MARGIN
    tok = engine.tokenizer
    keep = []
    for i, req in enumerate(requests):
        text = fmt.naive_text([c.text for c in req.chunks], query=req.query, system=req.system or None)
        if len(tok.encode(text)) >= limit:
            continue
        try:
            fits = len(asm.preview(_chunks(req), query=req.query, system=req.system or None).token_ids) < limit
        except ContextLengthError:
            continue
        if fits:
            keep.append(i)
    return keep


def _shape_diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def _check_capacity(engine: Any, kv: Any, store_shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """Equal capacity (:func:`~promptsplice.benchmarks._stats.capacity_shape`): ``kv``'s KV
    cache as the plain engine's (blocks, block size, dtype, prefix caching,
    ``max_model_len``), a store, and (``store_shape``: the other store mode's engine)
    the same store tiers, the remote one included; returns ``kv``'s shape."""
    plain, mine = capacity_shape(engine, store=False), capacity_shape(kv, store=False)
    if plain != mine:
        raise ConfigError(
            f"kv_engine and the plain engine differ ({_shape_diff(mine, plain)}): modes must run at equal "
            "KV cache capacity; start both with the same kv_cache_bytes, dtype, block size, prefix caching "
            "and max_model_len"
        )
    shape = capacity_shape(kv)
    if shape["kv_store"] is None:
        raise ConfigError("kv_engine has no kv_store: the store modes need an engine with the splice connector")
    if store_shape is not None and shape != store_shape:
        raise ConfigError(
            f"the {STORE_MODE} and {PIC_MODE} engines differ ({_shape_diff(store_shape, shape)}): both store "
            "modes must run on identical stores (DRAM, disk and remote tiers)"
        )
    return shape


def check_store_layout(store_layout: str, *, pic_exact_alignment: str = "auto",
                       recompute_blocks: int | None = None, pic_recompute_at: str | None = None,
                       pic_max_deviation: float | None = None) -> str:
    """The store and PIC options of a bench job, checked before its engines start."""
    if store_layout not in STORE_LAYOUTS:
        raise ConfigError(f"store_layout must be one of {STORE_LAYOUTS}, got {store_layout!r}")
    if pic_exact_alignment not in ("auto", "all"):
        raise ConfigError(f"pic_exact_alignment must be 'auto' or 'all', got {pic_exact_alignment!r}")
    if pic_recompute_at not in (None, "run", "chunk"):
        raise ConfigError(f"pic_recompute_at must be 'run', 'chunk' or None, got {pic_recompute_at!r}")
    if recompute_blocks is not None and recompute_blocks < 0:
        raise ConfigError(f"--recompute-blocks must be >= 0, got {recompute_blocks}")
    from promptsplice.engine_adapters.runners._fidelity import check_max_deviation

    check_max_deviation(pic_max_deviation, "--pic-max-deviation")
    if pic_max_deviation is not None and recompute_blocks == 0:
        raise ConfigError("--pic-max-deviation measures the recomputed blocks: leave it unset with --recompute-blocks 0")
    return store_layout


def run_modes(
    engine: Any,
    requests: Sequence[RagRequest],
    *,
    policy: str = "cache_aware",
    alignment: str = "auto",
    max_tokens: int = 8,
    progress: Callable[[str, int], None] | None = None,
    prompt_format: Any = None,
    kv_engine: Any = None,
    recompute_blocks: int | None = None,
    fidelity_requests: int = DEFAULT_PROBES,
    pic_exact_alignment: str = "auto",
    store_layout: str = "store_aware",
    pic_recompute_at: str | None = None,
    pic_max_deviation: float | None = None,
    pic_index_computed: bool = False,
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Run naive then promptsplice on ``engine`` (then ``promptsplice_store`` and
    ``promptsplice_pic`` when ``kv_engine`` is given: an engine with the splice connector,
    or a zero-argument factory that starts a fresh one per mode, closed after it);
    returns (report, completions by mode).

    All modes render the same pieces with the same :class:`promptsplice.assembler.PromptFormat`
    (default: ChatML, the default model's chat format).  Fidelity probes need both
    engines started with ``extra_kwargs={"max_logprobs": -1}``.  ``store_layout``:
    ``"store_aware"`` (the engine's assemblers: layouts count the store's blocks) or
    ``"cache_only"`` (an ablation: layouts on vLLM's own cache alone).
    """
    from promptsplice.assembler import PromptFormat

    check_store_layout(store_layout, recompute_blocks=recompute_blocks, pic_max_deviation=pic_max_deviation)
    factory = kv_engine is not None and callable(kv_engine) and not hasattr(kv_engine, "generate")
    if kv_engine is not None and not factory:
        _check_capacity(engine, kv_engine)  # before anything runs
    fmt_obj = prompt_format if prompt_format is not None else PromptFormat.chatml()
    asm = engine.make_assembler(policy=policy, alignment=alignment, prompt_format=fmt_obj)
    fmt = asm.format
    report: dict[str, Any] = {"modes": {}}
    outs: dict[str, list[Any]] = {}

    # the fit check on an assembler of its own: on the timed one it left every chunk in its
    # token cache, so promptsplice's assembly tokenized nothing while the store modes paid
    fit_asm = engine.make_assembler(policy=policy, alignment=alignment, prompt_format=fmt_obj)
    keep = _fitting(engine, fit_asm, fmt, requests)
    report.update(Coverage(len(keep), len(requests)).report())
    kept = set(keep)
    report["skipped_requests"] = [i for i in range(len(requests)) if i not in kept]
    requests = [requests[i] for i in keep]

    engine.reset_prefix_cache()
    completions, preps = [], []
    t0 = time.perf_counter()
    for req in requests:
        t_req = time.perf_counter()
        text = fmt.naive_text([c.text for c in req.chunks], query=req.query, system=req.system or None)
        # vLLM's tokenization of the whole text, which generate(text) runs before its TTFT
        # clock starts: timed here, as the exact modes' assembly tokenizes their chunks
        ids = engine.encode_prompt(text)
        preps.append(time.perf_counter() - t_req)
        completions.append(engine.generate(ids, max_tokens=max_tokens))
        if progress:
            progress("naive", 1)
    report["modes"]["naive"] = _mode_metrics(completions, time.perf_counter() - t0, preps)
    outs["naive"] = completions

    engine.reset_prefix_cache()
    completions, preps = [], []
    predicted = 0
    t0 = time.perf_counter()
    for req in requests:
        t_req = time.perf_counter()
        prompt = asm.assemble(_chunks(req), query=req.query, system=req.system or None)
        preps.append(time.perf_counter() - t_req)
        comp = engine.generate(prompt, max_tokens=max_tokens)
        predicted += prompt.predicted_cached_tokens
        completions.append(comp)
        if progress:
            progress("promptsplice", 1)
    report["modes"]["promptsplice"] = _mode_metrics(completions, time.perf_counter() - t0, preps)
    outs["promptsplice"] = completions
    report["mirror"] = {
        "predicted_cached_tokens": predicted,
        "measured_cached_tokens": report["modes"]["promptsplice"]["cached_tokens"],
    }

    capacity = engine.usable_blocks * engine.block_size
    radix, oracle, oracle_blocks = RadixPrefill(), OracleCounter(), OracleCounter()
    radix_cap, oracle_cap = RadixPrefill(capacity), OracleCounter(capacity)
    for comp in outs["naive"]:
        radix.add(comp.prompt_token_ids)
        radix_cap.add(comp.prompt_token_ids)
    content, content_cap, block_segs = [], [], []
    for req in requests:
        segs = _oracle_segments(asm, req)  # the trimmed segments (a preview: learns nothing)
        content.append(oracle.add(segs))
        content_cap.append(oracle_cap.add(segs))
        block_segs.append(whole_block_segments(segs, engine.block_size))
        oracle_blocks.add(block_segs[-1])
    floor = _floor(content, outs)  # the prefix-caching modes so far; again once all ran
    report["radix_prefill_tokens"] = radix.prefill_tokens
    report["oracle_prefill_tokens"] = floor
    report["bounds"] = {
        "radix_prefill_tokens": radix.prefill_tokens,
        "oracle_prefill_tokens": floor,
        "oracle_content_prefill_tokens": oracle.prefill_tokens,
        "radix_capacity_prefill_tokens": radix_cap.prefill_tokens,
        # floored per request like the oracle, by each mode's radix under the same LRU
        # capacity (bench assemble's oracle_prefill_tokens_bounded): a chunk's last token
        # can merge with the next segment's first in a prompt, one token under the
        # segment-wise content bound, which then exceeded the capacity-matched radix
        "oracle_capacity_prefill_tokens": _floor(content_cap, outs, capacity),
        # a reference: the oracle of whole-block layouts (padding no such reuse avoids)
        "oracle_whole_block_prefill_tokens": oracle_blocks.prefill_tokens,
        "capacity_tokens": capacity,
        "kv_cache_blocks": engine.num_blocks,
    }
    report["block_size"] = engine.block_size
    report["dtype"] = engine.config.dtype  # every mode's (equal capacity); fidelity compares within one
    report["policy"] = policy
    report["alignment"] = alignment
    report["max_tokens"] = max_tokens
    report["gap_closed"] = gap_closed(
        report["modes"]["naive"]["prefill_tokens"],
        report["modes"]["promptsplice"]["prefill_tokens"],
        floor,
    )
    if kv_engine is not None:
        run_id = uuid.uuid4().hex[:12]  # salts no earlier run (or other mode) used
        store_shape = None
        for mode in (STORE_MODE, PIC_MODE):
            kv = kv_engine() if factory else kv_engine
            try:
                store_shape = _check_capacity(engine, kv, store_shape)
                if mode == STORE_MODE:
                    # PIC's own exact layout: the one difference between the two is relocation
                    _run_store(report, outs, kv, requests, policy=policy, alignment=pic_exact_alignment,
                               max_tokens=max_tokens, layout=store_layout,
                               progress=progress, prompt_format=fmt_obj, salt=f"bench-rag-store-{run_id}")
                else:
                    _run_pic(
                        report, outs, engine, kv, requests, policy=policy, max_tokens=max_tokens,
                        progress=progress, prompt_format=fmt_obj, recompute_blocks=recompute_blocks,
                        fidelity_requests=fidelity_requests, salt=f"bench-rag-pic-{run_id}",
                        exact_alignment=pic_exact_alignment, recompute_at=pic_recompute_at,
                        max_deviation=pic_max_deviation, trace_index=keep, block_segments=block_segs,
                        index_computed=pic_index_computed,
                    )
            finally:
                if factory:
                    kv.close()
        if "pic" in report:
            # one engine instance for both store modes: PIC started on a store the control
            # filled (vLLM's cache is emptied between them, the store is not), so its gap
            # over the control is no like-for-like figure (the suite skips it)
            report["pic"]["shared_store"] = not factory
    if STORE_MODE in outs:  # one more prefix-caching mode: its radix joins the floor
        floor = _floor(content, outs)
        report["oracle_prefill_tokens"] = report["bounds"]["oracle_prefill_tokens"] = floor
        report["bounds"]["oracle_capacity_prefill_tokens"] = _floor(content_cap, outs, capacity)
        report["gap_closed"] = gap_closed(
            report["modes"]["naive"]["prefill_tokens"], report["modes"]["promptsplice"]["prefill_tokens"], floor
        )
        if "pic" in report:
            pic = report["modes"][PIC_MODE]["prefill_tokens"]
            report["pic"]["gap_closed"] = gap_closed(report["modes"]["naive"]["prefill_tokens"], pic, floor)
            report["pic"]["gap_closed_vs_store"] = gap_closed(report["modes"][STORE_MODE]["prefill_tokens"], pic, floor)
            if "pic_ceiling_prefill_tokens" in report["bounds"]:  # the most of that gap PIC's settings reach
                report["pic"]["ceiling_gap_closed_vs_store"] = gap_closed(
                    report["modes"][STORE_MODE]["prefill_tokens"], report["bounds"]["pic_ceiling_prefill_tokens"], floor)
    report["bounds"]["own_radix_prefill_tokens"] = _own_radix(outs)
    report["bounds"]["checks"] = mode_bounds(report)
    return report, outs


def _floor(content: list[int], outs: dict[str, list[Any]], capacity: int | None = None) -> int:
    """The oracle (:func:`~promptsplice.benchmarks.bounds.floor_per_request`): per request
    the content bound or a prefix-caching mode's radix ideal on its own prompts, the least
    (``capacity``: the capacity-matched oracle, its content bound and each radix an LRU of
    that many tokens)."""
    return floor_per_request(content, *(_radix_stream(outs[m], capacity)
                                        for m in ("naive", "promptsplice", STORE_MODE) if m in outs))


def _radix_stream(completions: list[Any], capacity: int | None = None) -> list[int]:
    """Per request, what a radix tree fed the mode's own prompts prefills (unbounded, or
    an LRU of ``capacity`` tokens)."""
    radix = RadixPrefill(capacity)
    return [radix.add(c.prompt_token_ids) for c in completions]


def _own_radix(outs: dict[str, list[Any]]) -> dict[str, int]:
    """The radix ideal of each exact assembly mode's own prompts (``promptsplice``,
    ``promptsplice_store``): everything it can be served, by vLLM's cache or the store,
    came from its own earlier prompts, so it never prefills less; the oracle alone (the
    least over every mode per request) let an over-count of its hits pass."""
    return {m: sum(_radix_stream(outs[m])) for m in ("promptsplice", STORE_MODE) if m in outs}


def mode_bounds(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each mode's lower bound on prefill (module doc) and whether it holds."""
    b = report["bounds"]
    return bound_checks({mode: m["prefill_tokens"] for mode, m in report["modes"].items()},
                        radix=b["radix_prefill_tokens"], oracle=b["oracle_prefill_tokens"],
                        own_radix=b.get("own_radix_prefill_tokens"))


def _run_store(report, outs, kv, requests, *, policy, alignment, max_tokens, progress, prompt_format,
               salt, layout="store_aware") -> None:
    """The ``promptsplice_store`` mode: exact assembly on the store engine (module doc)."""
    from promptsplice.assembler import Assembler

    kv.reset_prefix_cache()
    if layout == "store_aware":
        asm = kv.make_assembler(policy=policy, alignment=alignment, prompt_format=prompt_format)
    else:  # the ablation: what the engine's assemblers did before they counted the store
        asm = Assembler(kv.tokenizer, block_size=kv.block_size, mirror=kv.mirror.cache_only(),
                        max_tokens=kv.max_model_len - 1, policy=policy, alignment=alignment,
                        prompt_format=prompt_format)
    before = kv.counters()
    completions, preps = [], []
    predicted = 0
    t0 = time.perf_counter()
    too_long = 0
    for req in requests:
        t_req = time.perf_counter()
        what = dict(query=req.query, system=req.system or None, salt=salt)
        try:
            prompt = asm.assemble(_chunks(req), **what)
        except ContextLengthError:
            if alignment in (None, "auto"):
                raise
            # whole-block chunks do not fit where the exact layout does (``_fitting`` kept
            # the request): PIC's fallback too (``StepFallback.TOO_LONG``)
            prompt = asm.assemble(_chunks(req), alignment="auto", **what)
            too_long += 1
        preps.append(time.perf_counter() - t_req)
        comp = kv.generate(prompt, max_tokens=max_tokens)
        predicted += prompt.predicted_cached_tokens
        completions.append(comp)
        if progress:
            progress(STORE_MODE, 1)
    report["modes"][STORE_MODE] = _mode_metrics(completions, time.perf_counter() - t0, preps)
    outs[STORE_MODE] = completions
    delta = kv.counters().since(before)
    store = kv.kv_store
    report["store"] = {
        "too_long_requests": too_long,
        "predicted_cached_tokens": predicted,
        "measured_cached_tokens": report["modes"][STORE_MODE]["cached_tokens"],
        "external_cached_tokens": delta.external_hits,
        "alignment": alignment,
        "layout": layout,
        "kv_cache_blocks": kv.num_blocks,
        "store_dram_bytes": store.config.dram_bytes,
        "store_disk_bytes": store.config.disk_bytes,
        "store_remote_bytes": store.config.remote_bytes,
    }


def _probe_signals(i: int, st: Any) -> dict[str, Any]:
    """What a probed PIC request did, beside its KL (``fidelity.probes``): the signals a
    per-request budget could use (``deviation_curve --rag-budget-sweep``)."""
    return {"request": i, "prompt_tokens": st.prompt_tokens, "prefill_tokens": st.prefill_tokens,
            "relocated_tokens": st.relocated_tokens, "relocated_chunks": st.relocated_chunks,
            "recomputed_tokens": st.recomputed_tokens, "extra_recompute_blocks": st.extra_recompute_blocks,
            "max_deviation": round(max(st.deviations), 5) if st.deviations else None}


def _run_pic(report, outs, engine, kv_engine, requests, *, policy, max_tokens, progress,
             prompt_format, recompute_blocks, fidelity_requests, precompute="packed",
             salt="bench-rag-pic", exact_alignment="auto", relocate="when_it_pays",
             recompute_at=None, max_deviation=None, trace_index=None, block_segments=None,
             index_computed=False) -> None:
    """The ``promptsplice_pic`` mode and its fidelity (module doc).  ``trace_index``: each
    request's line in the trace (requests that do not fit were left out before), which
    the probes' records and errors name.  ``block_segments``: each request's
    :func:`~promptsplice.benchmarks.bounds.whole_block_segments`, for PIC's ceiling."""
    from promptsplice.engine_adapters import RagRunner, StepFallback
    from promptsplice.engine_adapters.runners._rag import DEFAULT_PIC_RECOMPUTE_BLOCKS

    r = DEFAULT_PIC_RECOMPUTE_BLOCKS if recompute_blocks is None else recompute_blocks
    kv_engine.reset_prefix_cache()
    runner = RagRunner(
        kv_engine, mode="position_independent", salt=salt, recompute_blocks=r, fidelity="bounded",
        policy=policy, prompt_format=prompt_format, precompute=precompute, exact_alignment=exact_alignment,
        relocate=relocate, recompute_at=recompute_at, max_deviation=max_deviation, index_computed=index_computed,
    )
    fid, ctl = Fidelity(), Fidelity()
    steps = []
    eligible = probe_calls = 0
    for i, req in enumerate(requests):
        st = runner.run(_chunks(req), query=req.query, system=req.system or None, max_tokens=max_tokens)
        steps.append(st)
        if progress:
            progress(PIC_MODE, 1)
        # The first requests whose plan relocates, while probes are owed: a probe must
        # run right after its request, and a schedule spread over the trace lost the
        # probes it deferred whenever relocation stopped early (the guard learning it
        # does not pay, a store that evicts), failing a correct run on coverage.
        eligible += bool(st.planned_relocated_tokens)
        if st.planned_relocated_tokens and len(fid.tf) < fidelity_requests:
            probe_calls += 1
            line = trace_index[i] if trace_index is not None else i  # as skipped_requests names them
            probe_relocated_request(engine, kv_engine, st, runner.reuse_salt, fid, ctl, f"{PIC_MODE} request {line}",
                                    signals=_probe_signals(line, st))
    report["modes"][PIC_MODE] = _pic_metrics(steps)
    prefill = report["modes"][PIC_MODE]["prefill_tokens"]
    ceiling = None
    if block_segments is not None:  # what relocation at these settings could reach (a reference)
        counter = RelocationCeiling(kv_engine.block_size, r, per_chunk=runner.recompute_at_for() == "chunk")
        for segs in block_segments:
            counter.add(segs)
        ceiling = report["bounds"]["pic_ceiling_prefill_tokens"] = counter.prefill_tokens
    outs[PIC_MODE] = [st.completion for st in steps]
    store = kv_engine.kv_store
    report["pic"] = {
        "relocated_tokens": sum(st.relocated_tokens for st in steps),
        "precomputed_tokens": sum(st.precomputed_tokens for st in steps),
        "engine_requests": sum(st.requests for st in steps),
        "exact_requests": sum(st.fallback is StepFallback.NO_GAIN for st in steps),
        "too_long_requests": sum(st.fallback is StepFallback.TOO_LONG for st in steps),
        "recompute_blocks": r,
        "exact_alignment": exact_alignment,
        "recompute_at": runner.recompute_at_for(),
        "index_computed": index_computed,
        "run_max_deviation": runner.max_deviation,  # the run-start guard's threshold (None: no guard)
        "guard": runner.guard_rates().observed(),  # what its gate learnt: trip rates, requests explored
        "gap_closed": gap_closed(report["modes"]["naive"]["prefill_tokens"], prefill, report["oracle_prefill_tokens"]),
        "gap_closed_vs_store": gap_closed(report["modes"][STORE_MODE]["prefill_tokens"], prefill,
                                          report["oracle_prefill_tokens"]) if STORE_MODE in report["modes"] else None,
        # (final here: the whole-block oracle takes no floor from the modes)
        "gap_closed_vs_store_whole_block": gap_closed(
            report["modes"][STORE_MODE]["prefill_tokens"], prefill, report["bounds"]["oracle_whole_block_prefill_tokens"]
        ) if STORE_MODE in report["modes"] else None,
        # PIC's share of the store -> ceiling gap (what it reached of what its settings
        # leave reachable); ceiling_gap_closed_vs_store: the ceiling's share of the
        # store -> oracle gap, about the most gap_closed_vs_store can be at these settings
        "gap_closed_vs_store_ceiling": gap_closed(report["modes"][STORE_MODE]["prefill_tokens"], prefill, ceiling)
        if STORE_MODE in report["modes"] and ceiling is not None else None,
        "ceiling_gap_closed_vs_store": gap_closed(report["modes"][STORE_MODE]["prefill_tokens"], ceiling,
                                                  report["oracle_prefill_tokens"])
        if STORE_MODE in report["modes"] and ceiling is not None else None,
        "kv_cache_blocks": kv_engine.num_blocks,
        "store_dram_bytes": store.config.dram_bytes,
        # fidelity probes ran on this engine between its requests (traffic the store
        # control never got): gap_closed_vs_store is then no like-for-like figure
        "probe_traffic": probe_calls > 0,
    }
    report["fidelity"] = {**fid.report(), "control": ctl.report(), "tokens": PROBE_TOKENS,
                          "requested": fidelity_requests, **probe_coverage(fidelity_requests, eligible, len(fid.kl))}


def format_modes(report: dict[str, Any]) -> str:
    modes = [m for m in (*MODES, STORE_MODE, PIC_MODE) if m in report["modes"]]
    rows = [
        ("requests", "requests"), ("prompt tokens", "prompt_tokens"), ("tokens prefilled", "prefill_tokens"),
        ("cached tokens (vLLM)", "cached_tokens"), ("hit rate", "hit_rate"), ("wall time (s)", "wall_s"),
        ("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p99 (ms)", "ttft_p99_ms"),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':<{w}}" + "".join(f"  {m:>18}" for m in modes)]
    for name, key in rows:
        cells = []
        for m in modes:
            v = report["modes"][m][key]
            cells.append(f"{v:.1%}" if key == "hit_rate" else str(v))
        lines.append(f"{name:<{w}}" + "".join(f"  {c:>18}" for c in cells))
    gap = report["gap_closed"]
    b = report.get("bounds", {})
    lines.append(
        f"bounds on prefill: radix ideal {report['radix_prefill_tokens']}, oracle "
        f"{report['oracle_prefill_tokens']}; under the engine's cache ({b.get('capacity_tokens')} tokens, LRU): "
        f"radix {b.get('radix_capacity_prefill_tokens')}, oracle {b.get('oracle_capacity_prefill_tokens')}; "
        f"promptsplice closes {'n/a' if gap is None else f'{gap:.0%}'} of the naive->oracle gap. Mirror "
        f"predicted {report['mirror']['predicted_cached_tokens']} cached tokens, vLLM "
        f"measured {report['mirror']['measured_cached_tokens']} "
        f"(block {report['block_size']}, {report['policy']}, alignment {report['alignment']})"
    )
    lines.append(
        f"coverage {report.get('coverage')} ({report.get('steps_run')} of {report.get('steps_total')} requests); "
        "bounds: " + ", ".join(
            f"{m} >= {c['bound']} {c['bound_prefill_tokens']} {'ok' if c['holds'] else 'VIOLATED'}"
            for m, c in b.get("checks", {}).items()
        )
    )
    if STORE_MODE in report["modes"]:
        st = report["store"]
        lines.append(
            f"{STORE_MODE}: same store as {PIC_MODE} ({st['store_dram_bytes']} B DRAM over "
            f"{st['store_disk_bytes']} B disk, {st['kv_cache_blocks']} KV blocks); vLLM cached "
            f"{st['measured_cached_tokens']} tokens, {st['external_cached_tokens']} of them from the store "
            f"(mirror of the KV cache alone: {st['predicted_cached_tokens']})"
        )
    if PIC_MODE in report["modes"]:
        p, f = report["pic"], report["fidelity"]
        c = f["control"]
        pg, ps, pw = p["gap_closed"], p.get("gap_closed_vs_store"), p.get("gap_closed_vs_store_whole_block")
        lines.append(
            f"{PIC_MODE} (recompute_blocks={p['recompute_blocks']}): closes "
            f"{'n/a' if pg is None else f'{pg:.0%}'} of the naive->oracle gap and "
            f"{'n/a' if ps is None else f'{ps:.0%}'} of the {STORE_MODE}->oracle gap "
            f"({'n/a' if pw is None else f'{pw:.0%}'} of the way to the whole-block oracle"
            + (f"; about {p['ceiling_gap_closed_vs_store']:.0%} reachable at these recompute settings"
               if p.get("ceiling_gap_closed_vs_store") is not None else "")
            + "); relocated "
            f"{p['relocated_tokens']} tokens, precomputed {p['precomputed_tokens']}, {p['engine_requests']} engine requests, "
            f"{p.get('exact_requests', 0)} requests sent exact (relocation would not pay)"
            + (f", {p['too_long_requests']} exact in the unpadded layout (whole-block chunks did not fit the context)"
               if p.get("too_long_requests") else "")
        )
        lines.append(
            f"fidelity over {f['steps']} verified requests: tf-top1 {f['tf_top1_agreement']} {f['tf_top1_ci95']} "
            f"(p10 {f['tf_top1_p10']}) KL {f['first_token_kl']} {f['first_token_kl_ci95']} (p50 "
            f"{f['first_token_kl_p50']}, p90 {f['first_token_kl_p90']}, max {f['first_token_kl_max']}) greedy "
            f"{f['greedy_agreement']} | control tf-top1 {c['tf_top1_agreement']} KL {c['first_token_kl']} "
            f"greedy {c['greedy_agreement']}"
        )
    return "\n".join(lines)


STORE_DRAM_BYTES = 1 << 30
STORE_DISK_BYTES = 4 << 30


def start_rag_engines(store_root: str | Path, *, dram_bytes: int = STORE_DRAM_BYTES,
                      disk_bytes: int = STORE_DISK_BYTES,
                      kv_cache_bytes: int | None = None,
                      dtype: str = "auto") -> tuple[Any, Callable[[], Any]]:
    """The plain engine (``kv_cache_bytes`` of KV cache, default the engine's; ``dtype``,
    default the engine's ``auto``), and a factory of fresh engines with the splice
    connector over a fresh tiered store (``dram_bytes`` of DRAM over ``disk_bytes`` of
    disk, a new folder under ``store_root`` each), with the plain engine's KV cache size
    and resolved dtype."""
    import itertools
    import os

    from promptsplice.engine_adapters import EmbeddedEngine, StoreConfig

    extra = {"max_logprobs": -1}
    engine = EmbeddedEngine(extra_kwargs=extra, dtype=dtype,
                            **({} if kv_cache_bytes is None else {"kv_cache_bytes": kv_cache_bytes}))
    ids = itertools.count()

    def fresh_kv_engine() -> Any:
        folder = os.path.join(str(store_root), f"store-{next(ids)}")
        os.makedirs(folder, exist_ok=True)
        store = StoreConfig(dram_bytes=dram_bytes, disk_bytes=disk_bytes, disk_dir=folder, fsync=False)
        return EmbeddedEngine(kv_store=store, kv_cache_bytes=engine.config.kv_cache_bytes, dtype=engine.config.dtype,
                              extra_kwargs=extra)

    return engine, fresh_kv_engine


def bench_status(report: dict[str, Any], *, allow_skips: bool = False, what: str = "bench rag") -> int:
    """0, or the exit status of a failed check (printed): a mode below its bound
    (``BOUND_EXIT``), then coverage below the bar (``COVERAGE_EXIT``)."""
    import sys

    rc = 0
    try:
        check_coverage(Coverage(report["steps_run"], report["steps_total"]), allow_skips=allow_skips, what=what)
    except CoverageError as exc:
        print(f"promptsplice: error: {exc}", file=sys.stderr)
        rc = COVERAGE_EXIT
    try:
        if "probe_coverage" in report.get("fidelity", {}):
            check_probes(report["fidelity"], allow_skips=allow_skips, what=what)
    except CoverageError as exc:
        print(f"promptsplice: error: {exc}", file=sys.stderr)
        rc = COVERAGE_EXIT
    try:
        check_bounds(report["bounds"]["checks"], what=what)
    except BoundError as exc:
        print(f"promptsplice: error: {exc}", file=sys.stderr)
        rc = BOUND_EXIT
    return rc


def run_rag_bench(
    *,
    trace: str | Path,
    json_out: str | Path,
    requests: int | None = None,
    policy: str = "cache_aware",
    alignment: str = "auto",
    max_tokens: int = 8,
    recompute_blocks: int | None = None,
    fidelity_requests: int = DEFAULT_PROBES,
    allow_skips: bool = False,
    pic_exact_alignment: str = "auto",
    kv_cache_bytes: int | None = None,
    store_layout: str = "store_aware",
    pic_recompute_at: str | None = None,
    pic_max_deviation: float | None = None,
    dtype: str = "auto",
    pic_index_computed: bool = False,
) -> int:
    """The CLI's job: run the trace, print, write the JSON; exit status from
    :func:`bench_status`."""
    import shutil
    import tempfile

    from promptsplice.assembler import AlignPolicy, OrderPolicy

    OrderPolicy.parse(policy)  # fail fast, before the engine starts
    AlignPolicy.parse(alignment)
    check_store_layout(store_layout, pic_exact_alignment=pic_exact_alignment, recompute_blocks=recompute_blocks,
                       pic_recompute_at=pic_recompute_at, pic_max_deviation=pic_max_deviation)
    reqs = read_rag_trace(trace, limit=requests)
    root = tempfile.mkdtemp(prefix="promptsplice-rag-store-")
    try:
        engine, kv_factory = start_rag_engines(root, kv_cache_bytes=kv_cache_bytes, dtype=dtype)
        try:
            report, _ = run_modes(
                engine, reqs, policy=policy, alignment=alignment, max_tokens=max_tokens, kv_engine=kv_factory,
                recompute_blocks=recompute_blocks, fidelity_requests=fidelity_requests,
                pic_exact_alignment=pic_exact_alignment, store_layout=store_layout, pic_recompute_at=pic_recompute_at,
                pic_max_deviation=pic_max_deviation, pic_index_computed=pic_index_computed,
            )
        finally:
            engine.close()
    except Exception as exc:  # a probe that failed its check (exit 5), an engine error: the JSON says so
        Path(json_out).write_text(json.dumps(error_report(trace, exc), indent=2) + "\n")
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["trace"] = str(Path(trace).resolve())  # pic_sweep, run from another folder, compares it
    print(format_modes(report))
    Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {json_out}")
    return bench_status(report, allow_skips=allow_skips)
