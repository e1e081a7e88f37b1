"""The trace families built from public text: deterministic, valid, different in shape;
``byte_span`` offsets checked by the reader; ``gen-trace --family``."""

from __future__ import annotations

import json

import pytest

from promptsplice.benchmarks import traces
from promptsplice.benchmarks.cli import main
from promptsplice.benchmarks.traces import (
    BYTE_SPAN,
    SUITE,
    generate_family_trace,
    read_rag_trace,
    shape_stats,
    write_rag_trace,
)
from promptsplice.errors import TraceFormatError, UnknownPolicyError

NEW = ("support", "pydocs", "apidocs", "tools")


@pytest.fixture(scope="module")
def suite() -> dict:
    return {f: generate_family_trace(f, requests=120, seed=0) for f in SUITE}


def test_every_family_is_deterministic_and_round_trips(tmp_path, suite):
    assert SUITE == ("wiki", "wiki-diverse", *NEW)
    for fam, reqs in suite.items():
        assert len(reqs) == 120
        path = tmp_path / f"{fam}.jsonl"
        assert write_rag_trace(path, requests=120, seed=0, family=fam) == 120
        assert read_rag_trace(path) == reqs  # the reader checks every byte_span too
    assert generate_family_trace("support", requests=120, seed=1) != suite["support"]
    assert generate_family_trace("wiki", requests=120, seed=0, profile="repeat-heavy") == suite["wiki"]


def test_families_differ_in_shape(suite):
    s = {f: shape_stats(r) for f, r in suite.items()}
    assert s["support"]["system_words_mean"] >= 200 and s["support"]["reask_rate"] >= 0.5
    assert s["support"]["overlap_rate"] > 0.3  # overlapping windows
    assert s["pydocs"]["overlap_rate"] == 0 and s["pydocs"]["duplicate_rate"] > 0.1  # paragraphs, a second index
    assert s["apidocs"]["contained_rate"] > 0.1 and s["apidocs"]["system_words_mean"] < 20
    assert s["apidocs"]["reask_rate"] < s["support"]["reask_rate"]
    assert s["tools"]["chunks_per_request"] == 6 and s["tools"]["duplicate_rate"] == s["tools"]["contained_rate"] == 0
    assert s["wiki"]["reordered_rate"] > 0.2  # the generator's swaps
    for fam in NEW:  # a real retriever returns the same list for the same question:
        # only a reformulation can bring a set back in another order
        assert s[fam]["reordered_rate"] <= s[fam]["reformulated_rate"] + 0.05 < s["wiki"]["reordered_rate"]
    assert len({(x["system_words_mean"], x["chunk_bytes_mean"]) for x in s.values()}) == len(SUITE)


def test_new_family_chunks_carry_their_source_and_byte_span(suite):
    for fam in NEW:
        for req in suite[fam]:
            for c in req.chunks:
                a, b = c.metadata[BYTE_SPAN]
                assert isinstance(c.metadata["source"], str)
                assert b - a == len(c.text.encode("utf-8"))


def _line(rid, chunks):
    return json.dumps({"id": rid, "system": "s", "query": "q", "chunks": chunks})


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        ({"id": "c", "text": "hello", "metadata": {"source": "D", BYTE_SPAN: [0, 4]}}, "covers 4 bytes but the text has 5"),
        ({"id": "c", "text": "hello", "metadata": {"source": "D", BYTE_SPAN: [3]}}, "expected [start, end]"),
        ({"id": "c", "text": "hello", "metadata": {"source": "D", BYTE_SPAN: [5, 0]}}, "expected [start, end]"),
        ({"id": "c", "text": "xyz w", "metadata": {"source": "D", BYTE_SPAN: [2, 7]}}, "byte 2 of source 'D' differs from what line 1"),
    ],
)
def test_offsets_that_do_not_match_the_text_name_file_line_and_field(tmp_path, second, expected):
    path = tmp_path / "t.jsonl"
    first = {"id": "a", "text": "hello", "metadata": {"source": "D", BYTE_SPAN: [0, 5]}}
    path.write_text(_line("r1", [first]) + "\n" + _line("r2", [second]) + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_rag_trace(path)
    msg = str(info.value)
    assert f"{path}:2:" in msg and f"chunks[0].metadata.{BYTE_SPAN}" in msg and expected in msg
    # agreeing overlaps and other sources are fine
    ok = {"id": "b", "text": "llo w", "metadata": {"source": "D", BYTE_SPAN: [2, 7]}}
    other = {"id": "o", "text": "xyz w", "metadata": {"source": "E", BYTE_SPAN: [2, 7]}}
    path.write_text(_line("r1", [first]) + "\n" + _line("r2", [ok, other]) + "\n")
    assert len(read_rag_trace(path)) == 2


def test_unknown_family_or_profile(tmp_path):
    with pytest.raises(UnknownPolicyError) as info:
        generate_family_trace("nope", requests=5)
    assert all(f in str(info.value) for f in SUITE)
    with pytest.raises(UnknownPolicyError, match="wiki family only"):
        generate_family_trace("support", requests=5, profile="diverse")


def test_an_empty_family_is_a_trace_format_error(monkeypatch):
    monkeypatch.setitem(traces._FAMILIES, "empty", lambda **kw: [])
    with pytest.raises(TraceFormatError, match="'empty'.*no requests"):
        generate_family_trace("empty", requests=5)


def test_gen_trace_cli_takes_a_family(tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    assert main(["bench", "gen-trace", "--family", "pydocs", "--requests", "20", "--out", str(out)]) == 0
    assert read_rag_trace(out) == generate_family_trace("pydocs", requests=20, seed=0)
    wiki = tmp_path / "w.jsonl"
    assert main(["bench", "gen-trace", "--profile", "diverse", "--requests", "20", "--out", str(wiki)]) == 0
    assert read_rag_trace(wiki) == generate_family_trace("wiki-diverse", requests=20, seed=0)
    assert main(["bench", "gen-trace", "--family", "bogus", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "bogus" in capsys.readouterr().err


def test_families_do_not_depend_on_the_hash_seed(suite):
    import hashlib
    import os
    import subprocess
    import sys

    code = ("import hashlib, json\nfrom promptsplice.benchmarks.traces import generate_family_trace as g\n"
            "print(' '.join(hashlib.sha256(json.dumps([r.to_json() for r in g(f, requests=120, seed=0)]).encode())"
            ".hexdigest() for f in %r))" % (NEW,))
    want = " ".join(hashlib.sha256(json.dumps([r.to_json() for r in suite[f]]).encode()).hexdigest() for f in NEW)
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


def test_a_huge_offset_costs_nothing(tmp_path):
    """Spans are kept sparse: an offset of 10**15 is checked without a buffer that large."""
    path = tmp_path / "t.jsonl"
    far = {"id": "c", "text": "hello", "metadata": {"source": "D", BYTE_SPAN: [10**15, 10**15 + 5]}}
    clash = {"id": "d", "text": "jello", "metadata": {"source": "D", BYTE_SPAN: [10**15, 10**15 + 5]}}
    path.write_text(_line("r1", [far]) + "\n")
    assert len(read_rag_trace(path)) == 1
    path.write_text(_line("r1", [far]) + "\n" + _line("r2", [clash]) + "\n")
    with pytest.raises(TraceFormatError, match=f":2: .*byte {10**15} of source 'D' differs from what line 1"):
        read_rag_trace(path)


def test_a_span_is_checked_against_every_piece_it_overlaps(tmp_path):
    """Spans are kept as disjoint pieces (the check was quadratic per source): a span
    across two earlier pieces and the gap between them is compared with both, and
    names the line that gave the byte that differs."""
    doc = b"abcdefghijklmnopqrstuvwxyz"

    def chunk(cid, a, b, text=None):
        return {"id": cid, "text": (text or doc[a:b]).decode(), "metadata": {"source": "D", BYTE_SPAN: [a, b]}}

    path = tmp_path / "t.jsonl"
    lines = [_line("r1", [chunk("a", 0, 5)]), _line("r2", [chunk("b", 10, 15)]), _line("r3", [chunk("c", 3, 12)]),
             _line("r4", [chunk("d", 0, 26)])]
    path.write_text("\n".join(lines) + "\n")
    assert len(read_rag_trace(path)) == 4
    bad = doc[2:14].replace(b"l", b"L")  # byte 11: first given by line 2
    lines[3] = _line("r4", [chunk("d", 2, 14, bad)])
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=":4: .*byte 11 of source 'D' differs from what line 2"):
        read_rag_trace(path)
    bad = doc[6:9].replace(b"h", b"H")  # byte 7: inside the gap line 3 filled
    lines[3] = _line("r4", [chunk("d", 6, 9, bad)])
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=":4: .*byte 7 of source 'D' differs from what line 3"):
        read_rag_trace(path)


def test_one_id_naming_two_texts_in_a_request_names_file_line_and_field(tmp_path):
    """It passed the reader and failed later in dedup, without file, line or request
    (in bench rag after the engines had started)."""
    path = tmp_path / "t.jsonl"
    same = [{"id": "x", "text": "one"}, {"id": "x", "text": "one"}]  # a duplicate: fine
    path.write_text(_line("r1", same) + "\n" + _line("r2", [{"id": "x", "text": "one"}, {"id": "y", "text": "b"},
                                                          {"id": "x", "text": "two"}]) + "\n")
    with pytest.raises(TraceFormatError, match=r":2: field 'chunks\[2\].id': id 'x' names two different texts"):
        read_rag_trace(path)
