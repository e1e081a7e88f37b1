"""Throughput of :func:`promptsplice.dedup.dedup` on realistic RAG requests, against a hash baseline.

Workload: synthetic documents of Zipf-distributed words (some non-ASCII, paragraphs
split by blank lines, a shared boilerplate paragraph in some documents), cut by a
sliding-window chunker into ``chunk_bytes`` windows that overlap by about 1/8.  Each
request holds 20 chunks as retrievers return them (dicts with id and ``metadata``):
about 20% exact duplicates, one chunk contained in another (a finer-grained chunker's
piece), one pair of neighbouring windows of one document (overlap), the rest distinct
windows; order shuffled.  Requests are deduplicated one by one, as in serving.

The baseline, measured in the same run over the same bytes, is ``content_digest``
(xxh3-128) alone: the floor cost of looking at every byte once from Python.  Both are
timed ``_REPEATS`` times over the whole set and the best run is reported (shared
machines are noisy; the best run is the one least disturbed).  ``dedup_cpu_mb_s`` is
the same throughput in CPU seconds of this process, which a machine busy with other
jobs inflates far less than wall-clock time.

**Scaling** (``--scaling``): one request of n chunks of about 200 bytes, the same mix
drawn from n/5 documents (so the share of duplicates, contained pieces and overlaps is
the same at every n), deduplicated at a small and a large n.  The reference is
:func:`normalize_chunks` over the same chunks, linear by construction: on a shared
machine even linear code slows down as the data outgrows the caches, so the ratio of
the two sizes is reported next to the reference's.  Times are CPU seconds of this
process (best of ``_REPEATS``, sizes interleaved), which waiting for a busy CPU does
not inflate.

**Without ASCII dots** (``--dotless``): the same requests with every ``.`` written ``。``
(CJK full stops; also what tables and code look like to the C core's dot filter).

Run:  ``python -m promptsplice.benchmarks.dedup_bench [--dotless] [total_mb] [chunk_bytes] [seed]``
      ``python -m promptsplice.benchmarks.dedup_bench --scaling [n_small n_large]``
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from typing import Any
from collections.abc import Sequence

from promptsplice.dedup import ACCELERATED, dedup, normalize_chunks
from promptsplice.dedup import _native
from promptsplice.benchmarks._stats import percentile
from promptsplice.benchmarks.cli import UsageError, run_tool
from promptsplice.blocks import content_digest

__all__ = ["run_dedup_bench", "make_requests", "run_scaling_bench", "scaling_workload", "main"]

_REQUEST_CHUNKS = 20
_MIN_TOTAL_MB = 0.001  # 1 kB: below it the workload has no request (an IndexError)
_MAX_TOTAL_MB = 100_000.0  # 100 GB: above it the workload does not fit a machine (and 1e303 overflowed)
_MAX_CHUNK_BYTES = 1 << 20  # 1 MiB: a request holds 400 documents of 12 chunks
_SCALING_SLACK = 1.2  # --scaling's target: time ratio <= 1.2 x the size ratio (near-linear)
_MIN_CHUNK_BYTES = 200  # a window at least twice the >= 100-char overlap with the next one
_REPEATS = 3
_SYLLABLES = ("ka", "lo", "re", "mi", "to", "sa", "ne", "ri", "po", "di", "an", "el", "or", "us")
_UNICODE_WORDS = ("café", "naïve", "Zürich", "東京", "résumé", "Ελλάδα", "straße")
_BOILERPLATE = (
    "This document is provided for informational purposes only and does not constitute "
    "professional advice. Reproduction is permitted with attribution under the terms "
    "of the applicable license."
)


def _vocabulary(rng: random.Random, size: int = 4000) -> tuple[list[str], list[float]]:
    words = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(size)})
    words.extend(_UNICODE_WORDS)
    rng.shuffle(words)
    weights = [1.0 / (rank + 1) for rank in range(len(words))]  # Zipf
    return words, weights


def _document(rng: random.Random, words, weights, size: int) -> str:
    paragraphs = []
    total = 0
    while total < size:
        sentences = []
        for _ in range(rng.randint(2, 6)):
            w = rng.choices(words, weights, k=rng.randint(6, 20))
            sentences.append(w[0].capitalize() + " " + " ".join(w[1:]) + ".")
        p = " ".join(sentences)
        paragraphs.append(p)
        total += len(p) + 2
    if rng.random() < 0.3:
        paragraphs.insert(rng.randrange(len(paragraphs) + 1), _BOILERPLATE)
    return "\n\n".join(paragraphs)


def _windows(doc: str, size: int) -> list[str]:
    """Sliding-window chunker: ``size``-char windows at word boundaries that overlap
    by about 1/8 (at least 100 chars, so the overlap is above dedup's min_overlap)."""
    out = []
    start = 0
    step_back = max(size // 8, 100)
    while start < len(doc):
        end = min(len(doc), start + size)
        if end < len(doc):
            cut = doc.rfind(" ", start + size // 2, end)
            end = cut if cut > start else end  # never an empty window
        out.append(doc[start:end])
        if end >= len(doc):
            break
        nxt = doc.find(" ", end - step_back, end)
        # always forward: under 2 x step_back a space before ``start`` sent the loop back
        # (chunk_bytes 50 never finished)
        start = nxt + 1 if nxt >= start else max(end, start + 1)
    return out


def make_requests(
    total_mb: float = 64, chunk_bytes: int = 1024, seed: int = 0, n_docs: int = 400
) -> list[list]:
    """Requests of 20 chunk dicts totalling about ``total_mb`` MB of chunk text, drawn
    from ``n_docs`` documents."""
    rng = random.Random(seed)
    words, weights = _vocabulary(rng)
    docs = []
    for d in range(n_docs):
        windows = _windows(_document(rng, words, weights, 12 * chunk_bytes), chunk_bytes)
        docs.append((f"doc{d}", windows))
    target = int(total_mb * 1e6)
    requests: list[list] = []
    made = 0
    serial = 0
    while made < target:
        picked: list[dict] = []

        def add(source, k, text, kind="window"):
            nonlocal serial
            serial += 1
            picked.append(
                {
                    "text": text,
                    "id": f"{source}#{k}" if kind == "window" else f"{source}#{k}/{serial}",
                    "metadata": {"source": source, "chunk": k, "kind": kind},
                }
            )

        # one pair of neighbouring windows (overlap merge)
        source, windows = rng.choice(docs)
        k = rng.randrange(len(windows) - 1)
        add(source, k, windows[k])
        add(source, k + 1, windows[k + 1])
        # distinct windows
        while len(picked) < _REQUEST_CHUNKS - 5:
            source, windows = rng.choice(docs)
            k = rng.randrange(len(windows))
            add(source, k, windows[k])
        # one contained piece of a picked chunk (a finer chunker's output)
        host = rng.choice(picked)
        text = host["text"]
        a = rng.randrange(len(text) // 2)
        meta = host["metadata"]
        add(meta["source"], meta["chunk"], text[a : a + len(text) // 3], "piece")
        # ~20% exact duplicates (same id: the same chunk retrieved twice)
        while len(picked) < _REQUEST_CHUNKS:
            picked.append(dict(rng.choice(picked[: _REQUEST_CHUNKS - 5])))
        rng.shuffle(picked)
        requests.append(picked)
        made += sum(len(c["text"].encode("utf-8")) for c in picked)
    return requests


def _kept(result: Any) -> tuple:
    """What a dedup result kept and dropped, to compare two runs request by request."""
    return (tuple((k.id, k.digest, k.data, tuple(o.id for o in k.origins)) for k in result.chunks),
            tuple(sorted(d.id for d in result.dropped)))


def run_dedup_bench(total_mb: float = 64, chunk_bytes: int = 1024, seed: int = 0, *, dotless: bool = False) -> dict:
    """Dedup MB/s over the whole workload, the content_digest baseline and their ratio.

    The dedup time is the sum of the per-request ``dedup()`` calls (best of
    ``_REPEATS`` runs over the whole set); the baseline hashes the same bytes.
    ``dotless``: every ``.`` of the chunks written ``。`` (text the dot filter cannot key).
    """
    requests = make_requests(total_mb, chunk_bytes, seed)
    if dotless:
        requests = [[{**c, "text": c["text"].replace(".", "\u3002")} for c in req] for req in requests]
    encoded = [[c["text"].encode("utf-8") for c in req] for req in requests]
    total_bytes = sum(len(b) for req in encoded for b in req)
    n_chunks = sum(len(req) for req in requests)

    dedup(requests[0])  # warm up imports and caches
    clock = time.perf_counter
    cpu = time.process_time
    dedup_s = cpu_s = float("inf")
    for _ in range(_REPEATS):
        run_latencies = []
        run_results = []
        cpu0 = cpu()
        for req in requests:
            t0 = clock()
            result = dedup(req)
            run_latencies.append(clock() - t0)
            run_results.append(result)
        cpu_s = min(cpu_s, cpu() - cpu0)
        run_stats = [r.stats for r in run_results]
        kept = [_kept(r) for r in run_results]  # the same each run (deterministic)
        elapsed = sum(run_latencies)
        if elapsed < dedup_s:
            dedup_s, latencies, stats = elapsed, run_latencies, run_stats
    removed = {kind: sum(st.removed[kind] for st in stats) for kind in stats[0].removed}
    removed_bytes = {kind: sum(st.removed_bytes[kind] for st in stats) for kind in removed}
    bytes_out = sum(st.bytes_out for st in stats)

    # The same requests through the pure-Python passes (what a machine without a C
    # compiler runs), in CPU time, to state the C core's share in the same run.
    py_cpu_s = float("inf")
    py_differ = None
    if ACCELERATED:
        core, _native.core = _native.core, None
        try:
            for _ in range(_REPEATS):
                cpu0 = cpu()
                py_results = [dedup(req) for req in requests]
                py_cpu_s = min(py_cpu_s, cpu() - cpu0)
        finally:
            _native.core = core
        # per request, what each kept and dropped (a byte total let differences cancel)
        py_differ = sum(_kept(r) != k for r, k in zip(py_results, kept))

    digest = content_digest
    base_s = base_cpu_s = float("inf")
    for _ in range(_REPEATS):
        start = clock()
        cpu0 = cpu()
        for req in encoded:
            for data in req:
                digest(data)
        base_s = min(base_s, clock() - start)
        base_cpu_s = min(base_cpu_s, cpu() - cpu0)

    latencies.sort()
    dedup_mbs = total_bytes / dedup_s / 1e6
    base_mbs = total_bytes / base_s / 1e6
    return {
        "total_mb": round(total_bytes / 1e6, 3),
        "dotless": dotless,
        "chunk_bytes": chunk_bytes,
        "requests": len(requests),
        "chunks": n_chunks,
        "dedup_s": round(dedup_s, 4),
        "dedup_mb_s": round(dedup_mbs, 1),
        "dedup_chunks_per_s": round(n_chunks / dedup_s),
        "request_p50_us": round(percentile(latencies, 0.5) * 1e6, 1),
        "request_p99_us": round(percentile(latencies, 0.99) * 1e6, 1),
        "baseline_digest_s": round(base_s, 4),
        "baseline_digest_mb_s": round(base_mbs, 1),
        "ratio_dedup_to_baseline": round(dedup_mbs / base_mbs, 4),
        # CPU seconds of this process (best run): what a busy machine's waiting does
        # not inflate, unlike the wall-clock figures above.
        "dedup_cpu_s": round(cpu_s, 4),
        "dedup_cpu_mb_s": round(total_bytes / cpu_s / 1e6, 1),
        "baseline_digest_cpu_mb_s": round(total_bytes / max(base_cpu_s, 1e-9) / 1e6, 1),
        "bytes_out_fraction": round(bytes_out / total_bytes, 4),
        # Whether the optional C core ran (promptsplice.dedup.ACCELERATED); if so, the
        # pure-Python passes on the same requests (None otherwise), and whether they kept
        # the same bytes.
        "accelerated": ACCELERATED,
        "python_passes_cpu_mb_s": (
            round(total_bytes / py_cpu_s / 1e6, 1) if py_differ is not None else None
        ),
        # every request kept the same chunks (ids, bytes, merged members) and dropped the same
        "python_passes_same_bytes_out": py_differ == 0 if py_differ is not None else None,
        "python_passes_requests_differing": py_differ,
        "removed": removed,
        "removed_bytes": removed_bytes,
        "target_mb_s": 200,
        "meets_target": dedup_mbs >= 200,
    }


def scaling_workload(n: int, chunk_bytes: int = 200, seed: int = 0) -> list[dict]:
    """One request of ``n`` chunk dicts: :func:`make_requests`' mix from n/5 documents."""
    total_mb = n * chunk_bytes * 1.2 / 1e6
    while True:
        requests = make_requests(total_mb, chunk_bytes, seed, n_docs=max(2, n // 5))
        chunks = [c for req in requests for c in req]
        if len(chunks) >= n:
            return chunks[:n]
        total_mb *= 1.5


def run_scaling_bench(
    sizes: tuple[int, int] = (2000, 20000), chunk_bytes: int = 200, seed: int = 0
) -> dict:
    """CPU seconds of one ``dedup()`` call at each size, and the time ratio of the large
    to the small size next to the same ratio for ``normalize_chunks`` (linear)."""
    workloads = {n: scaling_workload(n, chunk_bytes, seed) for n in sizes}
    clock = time.process_time
    best: dict[tuple[str, int], float] = {}
    stats = {}
    for _ in range(_REPEATS):
        for n, chunks in workloads.items():
            for name, fn in (("dedup", dedup), ("reference", normalize_chunks)):
                start = clock()
                out = fn(chunks)
                elapsed = clock() - start
                best[name, n] = min(best.get((name, n), elapsed), elapsed)
                if name == "dedup":
                    stats[n] = out.stats  # type: ignore[union-attr]
    small, large = sizes
    target = _SCALING_SLACK * large / small  # near-linear: 12 for the default 10x
    ratio = best["dedup", large] / best["dedup", small]
    reference = best["reference", large] / best["reference", small]
    return {
        "chunk_bytes": chunk_bytes,
        "sizes": {
            n: {
                "chunks": n,
                "bytes": stats[n].bytes_in,
                "dedup_cpu_s": round(best["dedup", n], 4),
                "reference_cpu_s": round(best["reference", n], 4),
                "removed": stats[n].removed,
            }
            for n in sizes
        },
        "ratio": round(ratio, 2),
        "reference_ratio": round(reference, 2),
        "ratio_over_reference": round(ratio / reference, 2),
        "size_ratio": large / small,
        "target_ratio": round(target, 2),
        "meets_target": ratio <= target,
    }


def _scaling_table(r: dict) -> str:
    (small, a), (large, b) = r["sizes"].items()
    rows = [
        ("workload", f"one request of n chunks of ~{r['chunk_bytes']} B (n/5 documents)"),
        (f"dedup, n = {small}", f"{a['dedup_cpu_s']} s CPU ({a['bytes'] / 1e6:.2f} MB)"),
        (f"dedup, n = {large}", f"{b['dedup_cpu_s']} s CPU ({b['bytes'] / 1e6:.2f} MB)"),
        (f"time ratio ({r['size_ratio']:g}x the chunks)", f"{r['ratio']}"),
        ("normalize_chunks alone (linear)", f"{r['reference_ratio']}"),
        ("ratio / reference", f"{r['ratio_over_reference']}"),
        (f"target ratio <= {r['target_ratio']:g}", "met" if r["meets_target"] else "NOT met"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _table(r: dict) -> str:
    rows = [
        ("workload", f"{r['total_mb']} MB, {r['chunks']} chunks of ~{r['chunk_bytes']} B, "
                     f"{r['requests']} requests of {_REQUEST_CHUNKS}"),
        ("dedup", f"{r['dedup_mb_s']} MB/s ({r['dedup_chunks_per_s']} chunks/s), "
                  f"request p50 {r['request_p50_us']} us, p99 {r['request_p99_us']} us"),
        ("dedup, CPU time", f"{r['dedup_cpu_mb_s']} MB/s (this process's CPU seconds)"),
        ("C core", "built" if r["accelerated"] else "not built (pure-Python passes)"),
        ("pure-Python passes, CPU time", f"{r['python_passes_cpu_mb_s']} MB/s"
                                         f" (same chunks kept: {r['python_passes_same_bytes_out']})"),
        ("content_digest alone", f"{r['baseline_digest_mb_s']} MB/s"),
        ("dedup / baseline", f"{r['ratio_dedup_to_baseline']}"),
        ("bytes kept", f"{r['bytes_out_fraction']:.1%}"),
        ("removed (count)", ", ".join(f"{k} {v}" for k, v in r["removed"].items())),
        ("target >= 200 MB/s", "met" if r["meets_target"] else "NOT met"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


_USAGE = (
    "usage: python -m promptsplice.benchmarks.dedup_bench [--dotless] [total_mb [chunk_bytes [seed]]]\n"
    "       python -m promptsplice.benchmarks.dedup_bench --scaling [n_small n_large]\n"
    f"total_mb: {_MIN_TOTAL_MB} to {_MAX_TOTAL_MB:g} (default 64); chunk_bytes: {_MIN_CHUNK_BYTES} to "
    f"{_MAX_CHUNK_BYTES} (default 1024); seed: an int (default 0); n_small, n_large: 1 <= n_small < n_large "
    f"(default 2000 20000; target: time ratio <= {_SCALING_SLACK:g} x n_large / n_small)"
)
_USAGE_LINE = "see python -m promptsplice.benchmarks.dedup_bench --help"


def _int(name: str, text: str, minimum: int | None = None, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"dedup_bench: {name} {text!r} is not an int; {_USAGE_LINE}") from None
    if minimum is not None and value < minimum:
        raise UsageError(f"dedup_bench: {name} must be >= {minimum}, got {value}; {_USAGE_LINE}")
    if maximum is not None and value > maximum:
        raise UsageError(f"dedup_bench: {name} must be <= {maximum}, got {value}; {_USAGE_LINE}")
    return value


def _total_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not _MIN_TOTAL_MB <= value <= _MAX_TOTAL_MB:  # inf, 1e303: OverflowError; 1e-9: IndexError; nan
        raise UsageError(f"dedup_bench: total_mb must be a number of MB from {_MIN_TOTAL_MB} to {_MAX_TOTAL_MB:g}, "
                         f"got {text!r}; {_USAGE_LINE}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module doc); a bad number is one line on stderr, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    if argv[:1] == ["--scaling"]:
        if len(argv) not in (1, 3):
            raise UsageError(f"dedup_bench: --scaling takes two chunk counts, or none; {_USAGE_LINE}")
        sizes = tuple(_int(name, a, 1) for name, a in zip(("n_small", "n_large"), argv[1:]))
        if sizes and sizes[0] >= sizes[1]:  # equal sizes crashed the table; reversed ones "met" the target
            raise UsageError(f"dedup_bench: --scaling needs n_small < n_large, got {sizes[0]} {sizes[1]}; "
                             f"{_USAGE_LINE}")
        result = run_scaling_bench(sizes or (2000, 20000))  # type: ignore[arg-type]
        table = _scaling_table(result)
    else:
        dotless = "--dotless" in argv
        argv = [a for a in argv if a != "--dotless"]
        if len(argv) > 3 or any(a.startswith("--") for a in argv):
            raise UsageError(f"dedup_bench: takes at most total_mb, chunk_bytes and seed; {_USAGE_LINE}")
        total_mb = _total_mb(argv[0]) if argv else 64.0
        chunk_bytes = _int("chunk_bytes", argv[1], _MIN_CHUNK_BYTES, _MAX_CHUNK_BYTES) if len(argv) > 1 else 1024
        seed = _int("seed", argv[2]) if len(argv) > 2 else 0
        result = run_dedup_bench(total_mb, chunk_bytes, seed, dotless=dotless)
        table = _table(result)
    print(table)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
