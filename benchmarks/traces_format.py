"""The RAG trace format: records, the strict reader and the writer (shared by every family).

Trace format
------------
JSONL, one request per line (blank lines are skipped)::

    {"id": str, "system": str,
     "chunks": [{"id": str, "text": str, "metadata": {...}}, ...],
     "query": str}

``metadata`` is optional in a chunk (default ``{}``); every other key is required and no
other key is allowed.  :func:`read_rag_trace` / :func:`iter_rag_trace` validate every
line and raise :class:`~promptsplice.errors.TraceFormatError` with ``FILE:LINE: field:
what was expected`` for invalid JSON, missing or unknown fields, wrong types, invalid
UTF-8 bytes, lone surrogates (metadata included), numbers out of the float range,
nesting too deep to parse, duplicate keys or request ids, and for a file with no
requests at all.  So whatever it reads, :func:`dump_rag_trace` writes back as a valid
trace.

Metadata is free-form except one key: ``byte_span: [start, end]`` names where the
chunk's UTF-8 bytes sit in its source document (``metadata["source"]``).  The reader
checks that the span is two integers ``0 <= start <= end`` as long as the text, and,
across the whole file, that two chunks of one source agree on every byte their spans
share; a chunk whose offsets do not match its text is a ``TraceFormatError``.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from promptsplice.errors import ConfigError, TraceFormatError

__all__ = [
    "RagChunk",
    "RagRequest",
    "BYTE_SPAN",
    "read_rag_trace",
    "iter_rag_trace",
    "dump_rag_trace",
]

BYTE_SPAN = "byte_span"
"""The metadata key of a chunk's ``[start, end]`` UTF-8 byte offsets in its source."""

_REQUEST_KEYS = ("id", "system", "chunks", "query")
_CHUNK_KEYS = ("id", "text", "metadata")
_CHUNK_REQUIRED = ("id", "text")


# --------------------------------------------------------------------------- data model


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _fail(where: str, msg: str) -> TraceFormatError:
    return TraceFormatError(f"{where}: {msg}" if where else msg)


def _check_text(value: Any, where: str, fld: str, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"field {fld!r}: expected a string, got {_type_name(value)}")
    if nonempty and not value:
        raise _fail(where, f"field {fld!r}: expected a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _fail(
            where, f"field {fld!r}: not valid Unicode (lone surrogate at offset {exc.start})"
        ) from None
    return value


def _check_keys(obj: dict, allowed: tuple[str, ...], required: tuple[str, ...],
                where: str, prefix: str) -> None:
    for key in required:
        if key not in obj:
            raise _fail(where, f"missing field {prefix + key!r}")
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise _fail(
            where,
            f"unknown field {prefix + str(unknown[0])!r} (expected only {', '.join(allowed)})",
        )


@dataclass(slots=True)
class RagChunk:
    """One retrieved chunk: a stable ``id``, its ``text`` and free-form ``metadata``."""

    id: str
    text: str
    metadata: dict = field(default_factory=dict)


@dataclass(slots=True)
class RagRequest:
    """One RAG request: a system prompt, the retrieved chunks in rank order, the query."""

    id: str
    system: str
    chunks: list[RagChunk]
    query: str

    def to_json(self) -> dict:
        """The request as a trace-line object (exactly the four keys; chunks with
        ``id``, ``text`` and ``metadata``)."""
        return {
            "id": self.id,
            "system": self.system,
            "chunks": [
                {"id": c.id, "text": c.text, "metadata": dict(c.metadata)} for c in self.chunks
            ],
            "query": self.query,
        }

    @classmethod
    def from_json(cls, obj: Any, *, where: str = "") -> RagRequest:
        """Validate a parsed trace line and build the request.

        Raises :class:`TraceFormatError` naming ``where`` (e.g. ``"trace.jsonl:12"``), the
        field (e.g. ``chunks[3].text``) and what was expected.  Metadata is copied.
        """
        if not isinstance(obj, dict):
            raise _fail(where, f"expected a JSON object, got {_type_name(obj)}")
        _check_keys(obj, _REQUEST_KEYS, _REQUEST_KEYS, where, "")
        rid = _check_text(obj["id"], where, "id", nonempty=True)
        system = _check_text(obj["system"], where, "system")
        query = _check_text(obj["query"], where, "query")
        raw_chunks = obj["chunks"]
        if not isinstance(raw_chunks, list):
            raise _fail(where, f"field 'chunks': expected an array, got {_type_name(raw_chunks)}")
        chunks: list[RagChunk] = []
        for i, raw in enumerate(raw_chunks):
            prefix = f"chunks[{i}]"
            if not isinstance(raw, dict):
                raise _fail(where, f"field {prefix!r}: expected an object, got {_type_name(raw)}")
            _check_keys(raw, _CHUNK_KEYS, _CHUNK_REQUIRED, where, prefix + ".")
            cid = _check_text(raw["id"], where, f"{prefix}.id", nonempty=True)
            text = _check_text(raw["text"], where, f"{prefix}.text")
            meta = raw.get("metadata", {})
            if not isinstance(meta, dict):
                raise _fail(
                    where, f"field '{prefix}.metadata': expected an object, got {_type_name(meta)}"
                )
            bad = _lone_surrogate(meta)
            if bad is not None:
                raise _fail(
                    where, f"field '{prefix}.metadata': not valid Unicode (lone surrogate at {bad})"
                )
            _check_span(meta, text, where, prefix)
            chunks.append(RagChunk(id=cid, text=text, metadata=dict(meta)))
        texts: dict[str, int] = {}
        for i, c in enumerate(chunks):  # one id, one text (dedup's rule), said here with the line
            j = texts.setdefault(c.id, i)
            if chunks[j].text != c.text:
                raise _fail(where, f"field 'chunks[{i}].id': id {c.id!r} names two different texts "
                                   f"(chunks[{j}] and chunks[{i}]); give each text its own id")
        return cls(id=rid, system=system, chunks=chunks, query=query)


# --------------------------------------------------------------------------- reading


JSON_WHITESPACE = " \t\r\n"
"""What JSON allows around a value: a line of only these is blank (``str.strip()`` also
took NBSP, form feeds and U+001C-U+001F, which JSON does not allow, for a blank line)."""


def decode_line(raw: bytes, lineno: int, where: str) -> str:
    """One JSONL line as text: a byte-order mark is allowed at the start of the file
    only (one inside it means two files were joined), and bytes that are not UTF-8 fail
    naming the offset and the fix.  Shared by the RAG and agent trace readers."""
    if raw.startswith(b"\xef\xbb\xbf"):
        if lineno != 1:
            raise TraceFormatError(
                f"{where}: line: a byte-order mark (BOM) starts this line, not the file (two files "
                "joined?); remove it: a BOM may only open the file"
            )
        raw = raw[3:]
    if lineno == 1:  # whole files in another form: the latin-1 advice below would garble them
        if raw.startswith(b"\x1f\x8b"):
            raise TraceFormatError(f"{where}: line: the file is gzip-compressed; gunzip it first (a trace "
                                   "is plain JSONL)")
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise TraceFormatError(f"{where}: line: the file is UTF-16; write it as UTF-8 "
                                   "(iconv -f utf-16 -t utf-8)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            f"{where}: line: invalid UTF-8 at byte {exc.start} of the line; write the trace as UTF-8 "
            "(re-encode it, e.g. iconv -f latin1 -t utf-8)"
        ) from None


def bare_cr_hint(line: str) -> str:
    """What to add to a JSON error when the line holds a bare ``\\r`` (old Mac line ends)."""
    if "\r" in line.rstrip("\r\n"):
        return "; the line holds a bare \\r: JSONL lines end in \\n (convert old Mac line ends)"
    return ""


def _strict_object(pairs: list[tuple[str, Any]]) -> dict:
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """A JSON number as a float; one beyond the float range (``1e400``) would come back
    as ``inf``, which JSON cannot hold, so it is refused like ``Infinity``."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of the float range")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """Where the first lone surrogate sits in parsed JSON (a key or a value), as a
    subscript path such as ``['tags'][2]`` (keys as reprs, so the path itself is valid
    Unicode; ``value`` itself: ``"the value"``), or None.  Iterative: any depth the
    parser accepted is fine."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the value"
        elif isinstance(v, dict):
            for k, item in reversed(v.items()):
                stack.append((f"{path}[{k!r}]", item))
                stack.append((f"{path}[{k!r}]", k))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", v[i]) for i in reversed(range(len(v))))
    return None


def _check_span(meta: dict, text: str, where: str, prefix: str) -> None:
    """A ``byte_span`` must be ``[start, end]`` integers spanning exactly the text."""
    if BYTE_SPAN not in meta:
        return
    span = meta[BYTE_SPAN]
    fld = f"{prefix}.metadata.{BYTE_SPAN}"
    if (not isinstance(span, list) or len(span) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in span)
            or not 0 <= span[0] <= span[1]):
        raise _fail(where, f"field {fld!r}: expected [start, end] integers with "
                           f"0 <= start <= end, got {json.dumps(span)[:60]}")
    n = len(text.encode("utf-8"))
    if span[1] - span[0] != n:
        raise _fail(where, f"field {fld!r}: the span {span[0]}..{span[1]} covers "
                           f"{span[1] - span[0]} bytes but the text has {n}; fix the "
                           f"offsets or the text")


class _SourceBytes:
    """What the chunks read so far say about each source document's bytes: per source,
    disjoint pieces sorted by offset, each with the line that first gave its bytes
    (sparse, so a huge offset costs nothing).  A span is compared with the pieces it
    overlaps (found by bisection) and fills the gaps between them: linear in the bytes
    read, where comparing with every earlier span of a source was quadratic (8,000
    windows of one book took 14 s)."""

    def __init__(self) -> None:
        # source -> (piece starts, pieces as (end, bytes, line)), aligned
        self._docs: dict[str, tuple[list[int], list[tuple[int, bytes, int]]]] = {}

    def check(self, req: RagRequest, where: str, lineno: int) -> None:
        for i, c in enumerate(req.chunks):
            src = c.metadata.get("source")
            if BYTE_SPAN not in c.metadata or not isinstance(src, str):
                continue
            a, b = c.metadata[BYTE_SPAN]
            data = c.text.encode("utf-8")
            starts, pieces = self._docs.setdefault(src, ([], []))
            j = bisect_right(starts, a) - 1
            if j < 0 or pieces[j][0] <= a:
                j += 1  # the last piece starting at or before a ends before it
            pos, gaps = a, []
            while j < len(starts) and starts[j] < b:
                x, (y, old, line) = starts[j], pieces[j]
                lo, hi = max(a, x), min(b, y)
                if data[lo - a : hi - a] != old[lo - x : hi - x]:
                    k = next(k for k in range(hi - lo) if data[lo - a + k] != old[lo - x + k])
                    raise _fail(where, f"field 'chunks[{i}].metadata.{BYTE_SPAN}': byte {lo + k} of "
                                       f"source {src!r} differs from what line {line} gave for it; "
                                       f"the offsets do not match the text")
                if x > pos:
                    gaps.append((pos, x))
                pos = max(pos, y)
                j += 1
            if pos < b:
                gaps.append((pos, b))
            for lo, hi in gaps:
                k = bisect_left(starts, lo)
                starts.insert(k, lo)
                pieces.insert(k, (hi, data[lo - a : hi - a], lineno))


def iter_rag_trace(path: str | os.PathLike[str]) -> Iterator[RagRequest]:
    """Yield the requests of a JSONL trace one by one, validating each line.

    Raises :class:`TraceFormatError` (``FILE:LINE: ...``) on the first bad line, on a
    request id seen before, on a ``byte_span`` that disagrees with an earlier line, and -- once the file is exhausted -- if it held no request.
    ``OSError`` (missing file) propagates unchanged.
    """
    name = os.fspath(path)
    seen: dict[str, int] = {}
    sources = _SourceBytes()
    with open(name, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{name}:{lineno}"
            line = decode_line(raw, lineno, where)
            if not line.strip(JSON_WHITESPACE):
                continue
            try:
                obj = json.loads(
                    line, object_pairs_hook=_strict_object, parse_constant=_reject_constant,
                    parse_float=_finite_float,
                )
            except (ValueError, RecursionError) as exc:
                raise TraceFormatError(f"{where}: invalid JSON: {exc}{bare_cr_hint(line)}") from None
            req = RagRequest.from_json(obj, where=where)
            if req.id in seen:
                raise TraceFormatError(
                    f"{where}: field 'id': duplicate request id {req.id!r} "
                    f"(first on line {seen[req.id]})"
                )
            sources.check(req, where, lineno)
            seen[req.id] = lineno
            yield req
    if not seen:
        raise TraceFormatError(f"{name}: no requests (the trace file is empty)")


def read_rag_trace(path: str | os.PathLike[str], *, limit: int | None = None) -> list[RagRequest]:
    """Read and validate a whole JSONL trace; return its first ``limit`` requests (all
    with ``None``).

    See :func:`iter_rag_trace` for the errors.  The whole file is validated whatever
    ``limit`` is (until 2026-12-08 reading stopped at the limit, so a duplicate id or a
    bad line after it passed, though the commands promise the whole trace is checked
    before any engine starts).  ``limit=0`` returns ``[]`` without opening the file; a
    negative limit is a :class:`ConfigError`.
    """
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(f"limit must be None or an integer >= 0, got {limit!r}")
        if limit == 0:
            return []
    out: list[RagRequest] = []
    it = iter_rag_trace(path)
    try:
        for req in it:
            if limit is None or len(out) < limit:
                out.append(req)
    finally:
        it.close()
    return out


def dump_rag_trace(path: str | os.PathLike[str], requests: Iterable[RagRequest]) -> int:
    """Write requests as a JSONL trace (UTF-8, one line each); return how many.  Each
    request is checked as the reader checks it (:class:`TraceFormatError` naming
    ``request N (line N)``), before anything is written, so a file it writes is one the
    reader reads: a ``byte_span`` of ``None`` in a chunk's metadata was written, then
    refused; so was an empty trace."""
    p = Path(path)
    lines: list[str] = []
    seen: dict[str, int] = {}
    sources = _SourceBytes()
    for n, req in enumerate(requests):
        where = f"request {n + 1} (line {n + 1})"  # one numbering: the line it would be on
        try:
            line = json.dumps(req.to_json(), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TraceFormatError(f"{where}: not JSON ({exc}); give the request JSON values only "
                                   "(finite numbers)") from None
        RagRequest.from_json(json.loads(line), where=where)
        if req.id in seen:
            raise TraceFormatError(f"{where}: field 'id': duplicate request id {req.id!r} (first on line "
                                   f"{seen[req.id]}); give every request its own id")
        sources.check(req, where, n + 1)
        seen[req.id] = n + 1
        lines.append(line)
    if not lines:  # the reader refuses an empty trace
        raise TraceFormatError(f"{p}: no requests to write (a trace holds at least one)")
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8", newline="\n") as fh:
        fh.writelines(line + "\n" for line in lines)
    return len(lines)
