"""RAG workload traces: one format, several families of real text, their shape statistics.

* the format, its strict reader and writer: :mod:`promptsplice.benchmarks.traces_format`;
* the ``wiki`` family (the original generator, profiles ``repeat-heavy`` and
  ``diverse``): :mod:`promptsplice.benchmarks.traces_wiki`;
* the ``support``, ``pydocs``, ``apidocs`` and ``tools`` families built from public
  text in PyPI packages and the standard library, with real retrievers:
  :mod:`promptsplice.benchmarks.traces_families` over
  :mod:`promptsplice.benchmarks.traces_retrieval`.

:data:`SUITE` lists every family; :func:`generate_family_trace` builds one by name and
:func:`shape_stats` measures what a trace looks like (system prompt length, chunk size,
overlap, duplicates, containment, re-asks, reformulations, popularity skew), so two
families can be compared by more than their names.
"""

from __future__ import annotations

import importlib.util  # noqa: F401  (tests patch importlib.util.find_spec through here)
import os
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from promptsplice.benchmarks.traces_families import (
    generate_apidocs,
    generate_pydocs,
    generate_support,
    generate_tools,
)
from promptsplice.benchmarks.traces_format import (  # the strict JSON helpers: agent_traces reads them here
    BYTE_SPAN,
    JSON_WHITESPACE,
    RagChunk,
    RagRequest,
    _finite_float,
    _lone_surrogate,
    _reject_constant,
    _strict_object,
    bare_cr_hint,
    decode_line,
    dump_rag_trace,
    iter_rag_trace,
    read_rag_trace,
)
from promptsplice.benchmarks.traces_wiki import (
    PROFILES,
    _wiki_records,
    generate_rag_trace,
    load_wiki_leads,
    sample_rag_requests,
)
from promptsplice.errors import ConfigError, TraceFormatError, UnknownPolicyError

__all__ = [
    "PROFILES",
    "SUITE",
    "BYTE_SPAN",
    "RagChunk",
    "RagRequest",
    "read_rag_trace",
    "iter_rag_trace",
    "dump_rag_trace",
    "write_rag_trace",
    "suite_trace_dir",
    "generate_rag_trace",
    "generate_family_trace",
    "sample_rag_requests",
    "load_wiki_leads",
    "shape_stats",
]

# re-exported: tests clear the leads cache here; agent_traces shares the strict reader
_ = (_wiki_records, _finite_float, _lone_surrogate, _reject_constant, _strict_object, bare_cr_hint, decode_line,
     JSON_WHITESPACE)


def _wiki(profile: str) -> Callable[..., list[RagRequest]]:
    return lambda *, requests, seed: generate_rag_trace(requests=requests, seed=seed, profile=profile)


_FAMILIES: dict[str, Callable[..., list[RagRequest]]] = {
    "wiki": _wiki("repeat-heavy"),
    "wiki-diverse": _wiki("diverse"),
    "support": generate_support,
    "pydocs": generate_pydocs,
    "apidocs": generate_apidocs,
    "tools": generate_tools,
}
SUITE: tuple[str, ...] = tuple(_FAMILIES)
"""Every trace family, in report order (``wiki`` is the original generator's
``repeat-heavy`` profile, ``wiki-diverse`` its ``diverse`` profile)."""


def generate_family_trace(family: str, *, requests: int = 400, seed: int = 0,
                          profile: str | None = None) -> list[RagRequest]:
    """Generate a trace of family ``family`` (one of :data:`SUITE`).

    ``profile`` applies to ``wiki`` only (``repeat-heavy`` or ``diverse``).  Raises
    :class:`UnknownPolicyError` for an unknown family or a profile given to another
    family, :class:`TraceFormatError` if the family produced no request.
    """
    if profile is not None:
        if family != "wiki":
            raise UnknownPolicyError(f"--profile applies to the wiki family only, not {family!r}")
        reqs = generate_rag_trace(requests=requests, seed=seed, profile=profile)
    else:
        try:
            gen = _FAMILIES[family]
        except (KeyError, TypeError):
            raise UnknownPolicyError(
                f"unknown trace family {family!r}; expected one of {', '.join(SUITE)}"
            ) from None
        reqs = gen(requests=requests, seed=seed)
    if not reqs:
        raise TraceFormatError(f"trace family {family!r}: no requests (the family is empty)")
    return reqs


def write_rag_trace(
    path: str | os.PathLike[str],
    *,
    requests: int = 400,
    seed: int = 0,
    profile: str | None = None,
    family: str = "wiki",
) -> int:
    """Generate a trace of ``family`` and write it to ``path`` as JSONL (``profile``:
    the wiki family's, default ``repeat-heavy``).  Returns the number of requests."""
    if family == "wiki" and profile is None:
        profile = "repeat-heavy"
    reqs = generate_family_trace(family, requests=requests, seed=seed, profile=profile)
    return dump_rag_trace(path, reqs)


def suite_trace_dir(trace_dir: str | os.PathLike[str], families: Sequence[str], traces: Sequence[str | os.PathLike[str]] = ()) -> Path:
    """The folder a suite writes its families' generated traces to, made here; a
    :class:`ConfigError` when it is a file, or when a user's ``traces`` file is one of
    the paths the suite would overwrite (a ``--trace`` inside ``--trace-dir`` was replaced
    by the generated family and never benched)."""
    out_dir = Path(trace_dir)
    for parent in (out_dir, *out_dir.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"trace_dir {str(out_dir)!r}: {str(parent)!r} is a file; name a folder "
                                  "for the generated traces (--trace-dir)")
            break
    generated = {(out_dir / f"{f}.jsonl").resolve(): f for f in families}
    for t in traces:
        family = generated.get(Path(t).resolve())
        if family is not None:
            raise ConfigError(
                f"trace {str(t)!r} is where the suite writes family {family!r}'s generated trace "
                "(it would be overwritten and never benched): move it, or pass another --trace-dir"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


# --------------------------------------------------------------------------- shape


def _overlaps(a: RagChunk, b: RagChunk) -> bool:
    """Two chunks of one source whose text overlaps (a window's tail is the next one's head)."""
    sa, sb = a.metadata.get(BYTE_SPAN), b.metadata.get(BYTE_SPAN)
    if sa and sb:
        if a.metadata.get("source") != b.metadata.get("source"):
            return False
        return sa[0] < sb[1] and sb[0] < sa[1] and not (sa[0] <= sb[0] and sb[1] <= sa[1]) \
            and not (sb[0] <= sa[0] and sa[1] <= sb[1])
    if a.text in b.text or b.text in a.text:
        return False
    probe = 40
    return len(a.text) > probe and len(b.text) > probe and (
        a.text[-probe:] in b.text[: len(a.text)] or b.text[-probe:] in a.text[: len(b.text)])


def shape_stats(requests: Sequence[RagRequest]) -> dict[str, Any]:
    """What a trace looks like, as rates over its requests (see the README's table).

    ``reask_rate``: the query text was asked before; ``reformulated_rate``: the same chunk
    set was retrieved before for another query; ``reordered_rate``: that set came before
    in another order; ``duplicate_rate`` / ``contained_rate`` / ``overlap_rate``: requests
    holding two chunks of the same text / one chunk inside another / two overlapping
    windows; ``top10_share``: share of requests asking the 10% most asked questions.
    """
    if not requests:
        return {"requests": 0}
    seen_q: set[str] = set()
    sets: dict[frozenset, tuple[tuple[str, ...], set[str]]] = {}
    reask = reform = reorder = dup = cont = over = 0
    for r in requests:
        texts = [c.text for c in r.chunks]
        reask += r.query in seen_q
        seen_q.add(r.query)
        key = frozenset(c.text for c in r.chunks)
        order = tuple(texts)
        if key in sets:
            first, queries = sets[key]
            reform += r.query not in queries
            reorder += order != first
            queries.add(r.query)
        else:
            sets[key] = (order, {r.query})
        dup += len(set(texts)) < len(texts)
        cont += any(a != b and a in b for a in texts for b in texts)
        over += any(_overlaps(a, b) for i, a in enumerate(r.chunks) for b in r.chunks[i + 1:])
    n = len(requests)
    counts = sorted(Counter(r.query for r in requests).values(), reverse=True)
    top = max(1, len(counts) // 10)
    chunk_bytes = [len(c.text.encode("utf-8")) for r in requests for c in r.chunks]
    return {
        "requests": n,
        "system_words_mean": round(statistics.fmean(len(r.system.split()) for r in requests), 1),
        "distinct_systems": len({r.system for r in requests}),
        "chunks_per_request": round(statistics.fmean(len(r.chunks) for r in requests), 2),
        "chunk_bytes_mean": round(statistics.fmean(chunk_bytes), 1) if chunk_bytes else 0.0,
        "distinct_queries": len(counts),
        "top10_share": round(sum(counts[:top]) / n, 3),
        "reask_rate": round(reask / n, 3),
        "reformulated_rate": round(reform / n, 3),
        "reordered_rate": round(reorder / n, 3),
        "duplicate_rate": round(dup / n, 3),
        "contained_rate": round(cont / n, 3),
        "overlap_rate": round(over / n, 3),
    }
