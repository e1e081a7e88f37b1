"""Fuzzing the trace readers (issue #8): ``read_rag_trace`` and ``read_agent_trace`` on
files of random bytes, random JSON lines, and near-valid lines mutated from a line of
the documented format.

Only TraceFormatError escapes (naming the file), and whatever a reader accepts is a
valid trace: writing it back and reading that gives the same requests.  Valid traces
of arbitrary unicode round-trip.  The checks live in ``tests/fuzz/_checks.py``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from promptsplice.benchmarks.agent_traces import AgentSession, read_agent_trace, write_agent_trace
from promptsplice.benchmarks.traces import RagChunk, RagRequest, dump_rag_trace, read_rag_trace
from tests.fuzz._checks import (
    VALID_AGENT_LINE,
    VALID_RAG_LINE,
    check_trace_bytes,
    mutate_bytes,
    mutate_json,
    note,
)

pytestmark = pytest.mark.reliability

# `measured` (the numbers RELIABILITY.md quotes) is one dict per test, shared by its examples.
HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=HEALTH)


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return tmp_path_factory.mktemp("trace-fuzz") / "trace.jsonl"


# Text with lone surrogates: json.dumps writes them as \udXXX escapes.
unicode = st.text(st.characters(codec=None), max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | unicode,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(unicode, inner, max_size=3),
    max_leaves=10,
)
odd_lines = st.sampled_from([
    b"", b"   ", b"\xef\xbb\xbf", b"NaN", b"-Infinity", b"1e400", b"[" * 100_000, b"{" * 50_000,
    b'{"a": 1, "a": 2}', b"\xff\xfe", b"\x00", b'"\\ud800"', b"{}", b"[]", b"null",
])


@SETTINGS
@given(st.lists(st.binary(max_size=60) | odd_lines, max_size=5))
@example([b"[" * 100_000])  # was RecursionError in both readers
@example([b"\xef\xbb\xbf" + b"{}"])
def test_random_bytes(trace_path, measured, lines):
    """Lines of random bytes (invalid UTF-8, control bytes, deep nesting): only
    TraceFormatError."""
    note(measured, check_trace_bytes(b"\n".join(lines), trace_path))


@SETTINGS
@given(st.lists(st.tuples(json_values, st.booleans()), min_size=1, max_size=4))
def test_random_json_lines(trace_path, measured, values):
    """Lines of arbitrary JSON (NaN, huge floats, lone-surrogate escapes included):
    only TraceFormatError, and what is read is written back unchanged."""
    lines = [json.dumps(v, ensure_ascii=ascii).encode("utf-8", "surrogatepass") for v, ascii in values]
    note(measured, check_trace_bytes(b"\n".join(lines), trace_path))


def near_valid(template):
    """A line of the documented format with one structural edit (a value replaced,
    a key or item deleted or added, a value wrapped in a list), then maybe a few byte
    edits; sometimes after a valid line of another id."""
    other = json.dumps({**template, "id": "other"}).encode() + b"\n"

    def line(pick, op, value, ascii, edits, first):
        mutated = json.dumps(mutate_json(template, pick, op, value), ensure_ascii=ascii)
        return (other if first else b"") + mutate_bytes(mutated.encode("utf-8", "surrogatepass"), edits)

    inserts = st.binary(max_size=3) | st.sampled_from([b'"', b"{", b"]", b",", b"\\"])
    edits = st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 3), inserts), max_size=2)
    return st.builds(
        line,
        st.integers(0, 200),
        st.integers(0, 3),
        json_values | unicode,  # a string often keeps the line valid
        st.booleans(),
        edits | st.just([]),
        st.booleans(),
    )


@settings(max_examples=1000, deadline=None, suppress_health_check=HEALTH)
@given(st.one_of(near_valid(VALID_RAG_LINE), near_valid(VALID_AGENT_LINE)))
# Regressions, each a slot of the templates (see _checks._nodes) set to a value:
# metadata["source"] = 1e400 was read as inf and written back as Infinity, which no
# reader accepts; a lone surrogate in metadata or a message was read, then could not be
# written (UnicodeEncodeError); tool call arguments nested too deeply: RecursionError.
@example(json.dumps(mutate_json(VALID_RAG_LINE, 7, 0, 1e400)).encode().replace(b"Infinity", b"1e400"))
@example(json.dumps(mutate_json(VALID_RAG_LINE, 7, 0, "\ud800")).encode())
@example(json.dumps(mutate_json(VALID_AGENT_LINE, 16, 0, "x\udc00")).encode())
@example(json.dumps(mutate_json(VALID_AGENT_LINE, 33, 0, "[" * 5000)).encode())
def test_near_valid_lines(trace_path, measured, data):
    """Mutations of a valid RAG or agent line: only TraceFormatError, and an accepted
    line round-trips through the writer."""
    note(measured, check_trace_bytes(data, trace_path))


@pytest.mark.parametrize("template", [VALID_RAG_LINE, VALID_AGENT_LINE], ids=["rag", "agent"])
def test_the_templates_are_valid(trace_path, template):
    """The lines the mutations start from are read as they are (else the near-valid
    fuzzing would only ever test rejection)."""
    trace_path.write_text(json.dumps(template) + "\n")
    reader = read_rag_trace if template is VALID_RAG_LINE else read_agent_trace
    (got,) = reader(trace_path)
    assert got.to_json() == template


text = st.text(max_size=20)  # valid unicode: what a trace can hold
finite_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
ids = st.text(min_size=1, max_size=8)
rag_requests = st.lists(
    st.builds(
        RagRequest,
        id=ids,
        system=text,
        # one id names one text within a request (the reader's rule, dedup's)
        # (``byte_span`` is reserved: a span of the chunk's bytes, checked on its own below)
        chunks=st.lists(st.builds(RagChunk, id=ids, text=text, metadata=st.dictionaries(
                            text.filter(lambda k: k != "byte_span"), finite_json, max_size=3)),
                        max_size=3).map(lambda cs: [dataclasses.replace(c, id=f"{c.id}#{i}") for i, c in enumerate(cs)]),
        query=text,
    ),
    min_size=1,
    max_size=4,
).map(lambda reqs: [dataclasses.replace(r, id=f"{r.id}#{i}") for i, r in enumerate(reqs)])  # ids must be unique
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": text},
    optional={"name": text, "x-extra": finite_json},  # unknown keys are kept
)
tools = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": ids},
            optional={"description": text, "parameters": st.dictionaries(text, finite_json, max_size=2)},
        ),
    }
)
agent_sessions = st.lists(
    st.builds(
        AgentSession,
        id=ids,
        tools=st.lists(tools, max_size=2),
        renders=st.lists(st.lists(messages, min_size=1, max_size=3), min_size=1, max_size=3),
    ),
    min_size=1,
    max_size=3,
).map(lambda ss: [dataclasses.replace(s, id=f"{s.id}#{i}") for i, s in enumerate(ss)])


@settings(max_examples=150, deadline=None, suppress_health_check=HEALTH)
@given(rag_requests, agent_sessions)
def test_valid_traces_of_arbitrary_unicode_round_trip(trace_path, measured, requests, sessions):
    """Valid traces (any unicode, any finite JSON metadata and extra keys) are written
    and read back unchanged."""
    assert dump_rag_trace(trace_path, requests) == len(requests)
    assert read_rag_trace(trace_path) == requests
    assert write_agent_trace(trace_path, sessions) == len(sessions)
    assert read_agent_trace(trace_path) == sessions
    note(measured, "round-tripped")


def test_the_writer_refuses_what_the_reader_refuses(tmp_path):
    """A chunk's ``byte_span`` of ``None`` (hypothesis found it) was written, then the
    reader refused the file; a duplicate id likewise.  Nothing is written then."""
    from promptsplice.benchmarks.traces_format import TraceFormatError

    trace_path = tmp_path / "t.jsonl"
    bad = RagRequest("r", "", [RagChunk("c", "text", metadata={"byte_span": None})], "q?")
    with pytest.raises(TraceFormatError, match=r"request 1 \(line 1\): field 'chunks\[0\]\.metadata\.byte_span'"):
        dump_rag_trace(trace_path, [bad])
    ok = RagRequest("r", "", [RagChunk("c", "text")], "q?")
    with pytest.raises(TraceFormatError, match=r"request 2 \(line 2\): field 'id': duplicate request id 'r' \(first on line 1\)"):
        dump_rag_trace(trace_path, [ok, ok])
    with pytest.raises(TraceFormatError, match="no requests to write"):
        dump_rag_trace(trace_path, [])
    assert not trace_path.exists()
    assert dump_rag_trace(trace_path, [ok]) == 1 and read_rag_trace(trace_path) == [ok]
