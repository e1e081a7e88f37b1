"""Invariant checks of issue #8, shared by the hypothesis fuzz tests and the atheris
harnesses (``tests/fuzz/fuzz_*.py``).

Each ``run_*`` / ``check_*`` function calls the code under test, lets through only the
exceptions the API documents for that input (checked against a small oracle written
from the docstrings), and raises ``AssertionError`` when an invariant breaks.  Any other
exception propagates: for hypothesis that fails the test, for atheris it is a crash.
No pytest import here, so the harnesses run as plain scripts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from promptsplice.assembler import Diff, Directive, Render, SegmentKind, apply_diff, apply_directives, diff_renders
from promptsplice.assembler._ordering import AlignPolicy, parse_align
from promptsplice.assembler._render import MessageSegment
from promptsplice.benchmarks.agent_traces import read_agent_trace, write_agent_trace
from promptsplice.benchmarks.traces import dump_rag_trace, read_rag_trace
from promptsplice.dedup import DedupConfig, DedupResult, Relation, dedup
from promptsplice.blocks import content_digest
from promptsplice.errors import (
    ConflictingChunkIdError,
    ContextLengthError,
    DirectiveError,
    InvalidChunkError,
    InvalidToolsError,
    InvalidUTF8Error,
    PromptspliceError,
    TraceFormatError,
)
from promptsplice.dedup._normalize import is_blank  # dedup's blank (not str.isspace)


def note(measured: dict, label: str) -> None:
    """Count one example and its outcome in the test's ``measured`` numbers (written to
    ``out/reliability.json``) and as a hypothesis event (``--hypothesis-show-statistics``)."""
    from hypothesis import event  # only the hypothesis tests call this

    event(label)
    measured["examples"] = measured.get("examples", 0) + 1
    outcomes = measured.setdefault("outcomes", {})
    outcomes[label] = outcomes.get(label, 0) + 1


# -- dedup --------------------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


class DuckDocument:
    """A duck-typed LangChain Document (``page_content``, ``metadata``, ``id``)."""

    def __init__(self, page_content: Any, metadata: Any = None, id: Any = None) -> None:
        self.page_content, self.metadata, self.id = page_content, metadata, id

    def __repr__(self) -> str:
        return f"DuckDocument({self.page_content!r}, {self.metadata!r}, {self.id!r})"


NOT_CHUNKS = [None, 3, 2.5, ["x"], {"id": "no-text"}, {"text": 7}, DuckDocument(b"bytes"), DuckDocument(None)]
"""Values dedup must refuse with InvalidChunkError where a chunk goes."""


class DedupExpectation(NamedTuple):
    """What the docstrings of :mod:`dedup` promise for one input list.

    ``error_index`` is the first chunk that must be refused (-1: the argument is not a
    list of chunks at all) and ``errors`` the classes it may raise (a chunk can have
    several problems; the order of the checks inside one chunk is not documented);
    ``utf8_offset`` is the byte offset an InvalidUTF8Error must report.  Without an
    error: ``inputs`` are the normalized ``(id, data)`` pairs and ``replaced`` the
    number of inputs decoded with U+FFFD.
    """

    inputs: list[tuple[str, bytes]]
    replaced: int
    error_index: int | None = None
    errors: tuple[type, ...] = ()
    utf8_offset: int | None = None


def dedup_oracle(chunks: Any, policy: str) -> DedupExpectation:
    """The documented contract of ``dedup(chunks, on_invalid_utf8=policy)``
    (:mod:`promptsplice.dedup._normalize`'s docstring), written independently of its code."""
    if isinstance(chunks, (str, bytes, bytearray, dict)) or hasattr(chunks, "page_content"):
        return DedupExpectation([], 0, -1, (InvalidChunkError,))
    try:
        chunks = list(chunks)
    except TypeError:
        return DedupExpectation([], 0, -1, (InvalidChunkError,))
    inputs: list[tuple[str, bytes]] = []
    by_id: dict[str, bytes] = {}
    replaced = 0
    for index, chunk in enumerate(chunks):
        problems: list[type] = []
        offset = None
        cid = metadata = None
        raw = chunk
        if isinstance(chunk, dict):
            if "text" not in chunk:
                return DedupExpectation([], 0, index, (InvalidChunkError,))
            raw, cid, metadata = chunk["text"], chunk.get("id"), chunk.get("metadata")
        elif not isinstance(chunk, (str, bytes, bytearray)):
            if not hasattr(chunk, "page_content"):
                return DedupExpectation([], 0, index, (InvalidChunkError,))
            raw = chunk.page_content
            if not isinstance(raw, str):
                return DedupExpectation([], 0, index, (InvalidChunkError,))
            metadata = getattr(chunk, "metadata", None)
            cid = getattr(chunk, "id", None) or None
            if cid is None and isinstance(metadata, dict):
                cid = metadata.get("id")
        if not isinstance(raw, (str, bytes, bytearray)):
            return DedupExpectation([], 0, index, (InvalidChunkError,))
        data = None
        if isinstance(raw, str):
            bad = _SURROGATE.search(raw)
            if bad is None:
                data = raw.encode("utf-8")
            elif policy == "replace":
                data = _SURROGATE.sub("\ufffd", raw).encode("utf-8")
                replaced += 1
            else:
                problems.append(InvalidUTF8Error)
                offset = len(raw[: bad.start()].encode("utf-8"))
        else:
            try:
                data = bytes(raw).decode("utf-8").encode("utf-8")
            except UnicodeDecodeError as exc:
                if policy == "replace":
                    data = bytes(raw).decode("utf-8", "replace").encode("utf-8")
                    replaced += 1
                else:
                    problems.append(InvalidUTF8Error)
                    offset = exc.start
        if metadata is not None and not isinstance(metadata, dict):
            problems.append(InvalidChunkError)
        if cid is None:
            if data is not None:
                cid = "c:" + content_digest(data).hex()[:16]
        elif isinstance(cid, int) and not isinstance(cid, bool):
            cid = str(cid)
        elif not isinstance(cid, str) or not cid:
            problems.append(InvalidChunkError)
        if problems:
            return DedupExpectation([], 0, index, tuple(problems), offset)
        assert isinstance(cid, str) and data is not None
        if by_id.setdefault(cid, data) != data:
            return DedupExpectation([], 0, index, (ConflictingChunkIdError,))
        inputs.append((cid, data))
    return DedupExpectation(inputs, replaced)


def run_dedup(chunks: Any, policy: str = "error", **options: Any) -> DedupResult | PromptspliceError:
    """``dedup`` on anything: only the documented error of the oracle may be raised
    (naming the right chunk; it is returned); a result must satisfy
    :func:`check_dedup_result`."""
    expected = dedup_oracle(chunks, policy)
    cfg = DedupConfig(on_invalid_utf8=policy, **options)
    try:
        result = dedup(chunks, cfg)
    except PromptspliceError as err:
        assert expected.error_index is not None, f"dedup refused valid input: {err!r}"
        assert isinstance(err, expected.errors), (err, expected)
        if expected.error_index >= 0:
            assert f"chunk {expected.error_index}" in str(err), (err, expected)
        if isinstance(err, InvalidUTF8Error):
            assert (err.index, err.offset) == (expected.error_index, expected.utf8_offset), err
        return err
    assert expected.error_index is None, f"dedup accepted bad input: expected {expected}"
    check_dedup_result(expected, cfg, result)
    return result


def _is_subsequence(small: bytes, big: bytes) -> bool:
    it = iter(big)
    return all(c in it for c in small)


def check_dedup_result(expected: DedupExpectation, cfg: DedupConfig, result: DedupResult) -> None:
    """Dedup keeps every id: each input exactly once (as an origin or dropped, under its
    own id); spans slice the kept bytes back to the input; the accounting adds up; the
    output is valid UTF-8, in retrieval order, and (with containment on) a fixpoint of
    dedup."""
    inputs = expected.inputs
    where: dict[int, str] = {}
    for k in result.chunks:
        for o in k.origins:
            assert o.index not in where, f"input {o.index} appears twice"
            where[o.index] = o.id
    for d in result.dropped:
        assert d.index not in where, f"input {d.index} appears twice"
        assert d.reason == "empty"
        data = inputs[d.index][1]
        assert not data or is_blank(data.decode("utf-8")), f"non-blank input {d.index} dropped"
        where[d.index] = d.id
    assert sorted(where) == list(range(len(inputs))), "an input is missing from the output"
    assert all(where[i] == cid for i, (cid, _) in enumerate(inputs)), "an input lost its id"
    assert result.input_ids() == {cid for cid, _ in inputs}

    stats = result.stats
    assert (stats.chunks_in, stats.chunks_out) == (len(inputs), len(result.chunks))
    assert stats.bytes_in == sum(len(data) for _, data in inputs)
    assert stats.bytes_out == sum(len(k.data) for k in result.chunks)
    assert stats.bytes_in - stats.bytes_out == stats.removed_bytes_total
    assert min(stats.removed_bytes.values()) >= 0 and min(stats.removed.values()) >= 0
    assert stats.replaced_invalid_utf8 == expected.replaced

    positions = []
    for k in result.chunks:
        assert k.data and k.data.decode("utf-8") == k.text and not is_blank(k.text)
        assert k.digest == content_digest(k.data)
        first = k.origins[0]
        assert first.relation is Relation.KEPT and (first.id, first.metadata) == (k.id, k.metadata)
        assert all(o.relation is not Relation.KEPT for o in k.origins[1:])
        positions.append(first.index)
        for o in k.origins:
            if o.relation is Relation.PASSAGES:
                assert o.span is None
                continue
            s, e = o.span
            assert 0 <= s <= e <= len(k.data), (o, len(k.data))
            if k.removed_passages:  # the span covers what is left of the input
                assert _is_subsequence(k.data[s:e], inputs[o.index][1]), o
            else:
                assert k.data[s:e] == inputs[o.index][1], o
    assert positions == sorted(positions), "kept chunks left retrieval order"

    # The fixpoint comes from containment running again over chunks that passage
    # removal shortened (dedup's docstring); without containment a shortened chunk may
    # equal or sit inside another one.
    if cfg.containment:
        texts = [k.text for k in result.chunks]
        again = dedup(texts, cfg)
        assert [k.text for k in again.chunks] == texts, "the output is not a fixpoint of dedup"
        assert again.stats.removed_bytes_total == 0 and not again.dropped


# -- assembly -----------------------------------------------------------------------------


def no_utf8(value: Any) -> bool:
    """True when ``value`` (a str, or JSON-like data) holds a lone surrogate."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _non_str_key(value: Any) -> bool:
    if isinstance(value, dict):
        return any(not isinstance(k, str) or _non_str_key(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_non_str_key(v) for v in value)
    return False


def expected_assembly_error(chunks: Any, kwargs: dict) -> tuple[type, ...] | None:
    """The documented refusal of ``assemble(chunks, **kwargs)``, or None: the arguments
    first (a lone surrogate in the query or system prompt; tools that are not JSON: a
    non-str key, NaN, infinity; a lone surrogate in the tools), then a bad chunk (dedup
    runs next)."""
    if any(no_utf8(kwargs.get(k)) for k in ("query", "system")):
        return (InvalidUTF8Error,)
    tools = kwargs.get("tools")
    if tools is not None:
        try:
            if _non_str_key(tools):
                return (InvalidToolsError,)
            json.dumps(tools, allow_nan=False, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            return (InvalidToolsError,)
        if no_utf8(tools):
            return (InvalidUTF8Error,)
    exp = dedup_oracle(chunks, "error")
    if exp.error_index is not None:
        return exp.errors
    return None


def run_assembly(asm: Any, chunks: Any, kwargs: dict, limit: int) -> str:
    """One request: the documented refusal, or :func:`check_assembly` and then
    :func:`check_limit_respected`; returns what happened (a label)."""
    want = expected_assembly_error(chunks, kwargs)
    got = check_assembly(asm, chunks, limit=limit, **kwargs)
    if want is not None:
        assert got is None, f"expected {want}, got a prompt"
        try:
            asm.preview(chunks, **kwargs)
        except PromptspliceError as err:
            assert isinstance(err, want), (err, want)
            return f"refused: {type(err).__name__}"
        raise AssertionError(f"expected {want}")
    sent = check_limit_respected(asm, chunks, limit=limit, **kwargs)  # admits and learns
    if got is None:
        return "ContextLengthError"
    hit = ", cache hit" if sent is not None and sent.predicted_cached_tokens else ""
    return f"fits{', padded' if got.padding_tokens else ''}{hit}"


def check_assembly(asm: Any, chunks: Any, *, limit: int, **kwargs: Any) -> Any:
    """No assembled prompt exceeds the context it was given: with ``max_tokens=limit``
    the prompt is the one assembled without a limit when that fits; else, under ``auto``
    alignment, the unpadded one (``alignment="none"``) when that fits; else
    ContextLengthError carries the size of the last layout tried and the limit.  Every
    call is a preview (``Assembler.preview``), so the assembler's state, and with it the
    layout, is the same."""
    try:
        free = asm.preview(chunks, **kwargs)
    except PromptspliceError as err:
        if isinstance(err, ContextLengthError):  # no limit given: only the mirror's capacity
            cap = asm.mirror.capacity_blocks
            assert cap is not None and err.max_tokens == cap * asm.block_size, ("no limit was given", err)
        try:
            asm.preview(chunks, max_tokens=limit, **kwargs)
        except PromptspliceError as again:
            assert type(again) is type(err), (err, again)
            return None
        raise AssertionError(f"refused without a limit ({err!r}) but accepted with one")
    check_prompt(free, chunks)
    want = free
    align = kwargs.get("alignment")
    if free.num_tokens > limit and (asm.alignment if align is None else parse_align(align)) is AlignPolicy.AUTO:
        want = asm.preview(chunks, **{**kwargs, "alignment": "none"})  # padding never overflows
    try:
        got = asm.preview(chunks, max_tokens=limit, **kwargs)
    except ContextLengthError as err:
        assert want.num_tokens > limit, f"a prompt of {want.num_tokens} tokens fits {limit}"
        assert (err.prompt_tokens, err.max_tokens) == (want.num_tokens, limit)
        return None
    assert got.num_tokens <= limit and got.token_ids == want.token_ids
    return got


def check_prompt(prompt: Any, chunks: Any) -> None:
    """Segments cover the tokens without gaps, the query comes last, every input chunk
    is accounted for in the dedup report, and the prompt holds each kept chunk."""
    pos = 0
    for seg in prompt.segments:
        assert seg.start == pos and seg.start <= seg.content_end <= seg.end
        pos = seg.end
    assert pos == prompt.num_tokens and prompt.segments[-1].kind is SegmentKind.QUERY
    report = prompt.dedup
    seen = sorted([o.index for k in report.chunks for o in k.origins] + [d.index for d in report.dropped])
    assert seen == list(range(len(list(chunks)))) == list(range(report.stats.chunks_in))
    assert set(prompt.chunk_order) == {k.id for k in report.chunks}


def check_limit_respected(asm: Any, chunks: Any, *, limit: int, **kwargs: Any) -> Any:
    """A stateful call (admits and learns): it fits the limit or raises ContextLengthError."""
    try:
        got = asm.assemble(chunks, max_tokens=limit, **kwargs)
    except ContextLengthError as err:
        assert err.max_tokens == limit < err.prompt_tokens
        return None
    assert got.num_tokens <= limit
    return got


# -- directives ---------------------------------------------------------------------------


def synthetic_render(segments: Sequence[Sequence[int]], generation: Sequence[int] = ()) -> Render:
    """A :class:`Render` over arbitrary token ids: one MESSAGE segment per item of
    ``segments`` (its key the digest of its ids, so equal keys mean equal tokens) and
    ``generation`` as the generation prompt when not empty."""
    tokens: list[int] = []
    segs: list[MessageSegment] = []
    keys: list[bytes] = []
    for i, seg in enumerate(segments):
        key = content_digest(repr(list(seg)).encode())
        segs.append(MessageSegment(SegmentKind.MESSAGE, i, "user", len(tokens), len(tokens) + len(seg), 0, key, ""))
        keys.append(key)
        tokens.extend(seg)
    if generation:
        key = content_digest(repr(list(generation)).encode())
        end = len(tokens) + len(generation)
        segs.append(MessageSegment(SegmentKind.GENERATION, None, "assistant", len(tokens), end, 0, key, ""))
        tokens.extend(generation)
    return Render(tokens, "", segs, keys, 16, [], None, None)  # type: ignore[arg-type]


def check_diff(old: Render, new: Render, diff: Diff | None = None) -> Diff:
    """apply(diff(a, b), a) == b, plus what the directives promise: sorted, disjoint,
    inside the old body, trimmed at both ends, landing where ``new_start`` says, and the
    relocated runs really unchanged; no directive when the new body extends the old."""
    if diff is None:
        diff = diff_renders(old, new)
    ot, nt = old.token_ids, new.token_ids
    assert apply_diff(ot, diff) == nt
    assert diff.apply(ot) == nt
    assert (diff.base, diff.old_len, diff.new_len) == (old.body_end, len(ot), len(nt))
    assert apply_directives(ot[: diff.base], diff.directives) + list(diff.appended) == nt
    prev_start, prev_end, delta = -1, 0, 0
    for d in diff.directives:
        assert prev_end <= d.start <= d.end <= diff.base and d.start > prev_start, diff.directives
        assert d.replacement or d.end > d.start, "an empty directive"
        assert not d.start == d.end == diff.base, "an insertion at the end of the body is the append"
        if d.replacement and d.end > d.start:  # common ends were trimmed
            assert ot[d.start] != d.replacement[0] and ot[d.end - 1] != d.replacement[-1], d
        delta += len(d.replacement) - d.removed
        assert d.delta == delta
        assert tuple(nt[d.new_start : d.new_end]) == d.replacement
        prev_start, prev_end = d.start, d.end
    for r in diff.relocations:
        assert ot[r.old_start : r.old_end] == nt[r.new_start : r.new_start + r.length]
    n = diff.first_changed_token
    assert ot[:n] == nt[:n] and (n == min(len(ot), len(nt)) or ot[n] != nt[n])
    ob, nb = old.body_segments, new.body_segments
    if [(s.key, s.padding) for s in nb[: len(ob)]] == [(s.key, s.padding) for s in ob]:
        assert diff.directives == () and diff.appended == tuple(nt[diff.base :])
    return diff


def expected_apply(tokens: Sequence[int], directives: Sequence[Any]) -> tuple[list[int] | None, tuple[str, int] | None]:
    """The documented contract of :func:`apply_directives`: ``(output, None)`` or
    ``(None, (problem, index))`` of the first directive that cannot be applied."""
    out: list[int] = []
    pos, prev_start = 0, -1
    for i, d in enumerate(directives):
        if isinstance(d, Directive):
            start, end, rep = d.start, d.end, d.replacement
        else:
            try:
                (start, end), rep = d
            except (TypeError, ValueError):
                return None, ("out_of_range", i)
        if type(start) is not int or type(end) is not int or not 0 <= start <= end <= len(tokens):
            return None, ("out_of_range", i)
        if start < prev_start:
            return None, ("unsorted", i)
        if start < pos or start == prev_start:
            return None, ("overlapping", i)
        if not isinstance(rep, (list, tuple)) or any(type(t) is not int or t < 0 for t in rep):
            return None, ("out_of_range", i)
        out.extend(tokens[pos:start])
        out.extend(rep)
        pos, prev_start = end, start
    out.extend(tokens[pos:])
    return out, None


def check_apply_directives(tokens: Sequence[int], directives: Sequence[Any]) -> str:
    """Arbitrary directives: the documented output, or DirectiveError naming the
    documented problem and directive; nothing else escapes.  Returns what happened."""
    want, problem = expected_apply(tokens, directives)
    try:
        got = apply_directives(tokens, directives)
    except DirectiveError as err:
        assert (err.problem, err.index) == problem, (err, problem, directives)
        assert f"directive {err.index}" in str(err)
        return f"DirectiveError: {err.problem}"
    assert problem is None, f"accepted bad directives {directives!r}: expected {problem}"
    assert got == want
    return "applied"


# -- trace readers ------------------------------------------------------------------------


def read_or_reject(reader: Any, path: Path) -> list | None:
    """``reader(path)``: the requests, or None after a TraceFormatError naming the file."""
    try:
        return reader(path)
    except TraceFormatError as err:
        assert str(err).startswith(str(path)), err
        return None


def check_trace_bytes(data: bytes, path: Path) -> str:
    """Both readers on the same bytes: only TraceFormatError escapes, and what is read
    is valid: writing it back and reading that gives the same requests.  Returns what
    each reader did."""
    path.write_bytes(data)
    back = path.with_name(path.name + ".back")
    reqs = read_or_reject(read_rag_trace, path)
    if reqs is not None:
        dump_rag_trace(back, reqs)
        assert read_rag_trace(back) == reqs
    sessions = read_or_reject(read_agent_trace, path)
    if sessions is not None:
        write_agent_trace(back, sessions)
        assert read_agent_trace(back) == sessions
    return f"rag {'read' if reqs is not None else 'refused'}, agent {'read' if sessions is not None else 'refused'}"


VALID_RAG_LINE = {
    "id": "r00001",
    "system": "You answer from the passages.",
    "chunks": [
        {"id": "congress#0", "text": "The Congress of Vienna met in 1814.", "metadata": {"source": "Congress", "chunk": 0}},
        {
            "id": "ghent#s1",
            "text": "Zürich, 東京 — and the Treaty of Ghent.",
            "metadata": {"score": 0.5, "tags": ["a", None]},
        },
    ],
    "query": "When did the Congress of Vienna meet?",
}
"""A request of the documented RAG trace format, to mutate into near-valid lines."""

VALID_AGENT_LINE = {
    "id": "session-1",
    "tools": [
        {"type": "function", "function": {"name": "ls", "description": "List files.", "parameters": {"type": "object"}}},
    ],
    "renders": [
        [{"role": "system", "content": "You help."}, {"role": "user", "content": "List the files."}],
        [
            {"role": "system", "content": "You help."},
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"a": true}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "notes.txt\nmain.py"},
        ],
    ],
}
"""A session of the documented agent trace format, to mutate into near-valid lines."""


def _nodes(obj: Any, out: list) -> list:
    """Every (container, key) slot of a JSON value, depth first."""
    if isinstance(obj, dict):
        for k in list(obj):
            out.append((obj, k))
            _nodes(obj[k], out)
    elif isinstance(obj, list):
        for i in range(len(obj)):
            out.append((obj, i))
            _nodes(obj[i], out)
    return out


def mutate_json(obj: Any, pick: int, op: int, value: Any) -> Any:
    """A near-valid copy of ``obj``: at the ``pick``-th slot, ``op`` 0 replaces the
    value by ``value``, 1 deletes the slot, 2 adds ``value`` next to it (a new key
    named by ``str(value)`` in an object), 3 wraps the value in a list."""
    obj = json.loads(json.dumps(obj))
    nodes = _nodes(obj, [])
    if not nodes:
        return value
    container, key = nodes[pick % len(nodes)]
    op %= 4
    if op == 0:
        container[key] = value
    elif op == 1:
        del container[key]
    elif op == 2:
        if isinstance(container, dict):
            container[str(value)[:20]] = value
        else:
            container.insert(key, value)
    else:
        container[key] = [container[key]]
    return obj


def mutate_bytes(line: bytes, edits: Sequence[tuple[int, int, bytes]]) -> bytes:
    """``line`` with each ``(position, bytes to delete, bytes to insert)`` edit applied."""
    buf = bytearray(line)
    for pos, drop, insert in edits:
        pos %= len(buf) + 1
        buf[pos : pos + drop] = insert
    return bytes(buf)
