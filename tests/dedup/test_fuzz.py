"""Fuzzing dedup (issue #8): arbitrary bytes, unicode (lone surrogates included), odd
ids and metadata, and values that are not chunks at all.

Only the documented errors escape, naming the right chunk (checked against an oracle
written from the docstrings, ``tests/fuzz/_checks.py``), and every result keeps every
input id.  ``test_properties.py`` covers structured retrieval results; here the text is
arbitrary, but drawn from a small pool of pieces so that duplicates, containment,
overlaps and repeated paragraphs still occur.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from promptsplice.errors import InvalidChunkError
from tests.fuzz._checks import NOT_CHUNKS, DuckDocument, dedup_oracle, note, run_dedup

pytestmark = pytest.mark.reliability

SETTINGS = settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # `measured` is per test
)

valid_unicode = st.text(max_size=24)
# Lone surrogates: st.text() never draws them and st.characters(codec=None) rarely
# (about one string in 250), so one is also put in a valid string at a random place.
any_unicode = st.one_of(
    st.text(st.characters(codec=None), max_size=24),
    valid_unicode,
    st.builds(
        lambda t, c, i: t[: i % (len(t) + 1)] + c + t[i % (len(t) + 1) :],
        valid_unicode,
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        st.integers(0, 24),
    ),
)
separators = st.sampled_from(["\n\n", ".", " ", "\n", "", ". ", "\t"])


@st.composite
def piece_pool(draw, unicode=valid_unicode):
    """A few pieces of text that chunks are built from, so they share bytes."""
    return draw(st.lists(unicode, min_size=1, max_size=5))


@st.composite
def texts_from(draw, pool):
    """Pieces of ``pool`` joined by separators (paragraph breaks and dots included)."""
    parts = draw(st.lists(st.tuples(st.sampled_from(pool), separators), max_size=6))
    return "".join(p + s for p, s in parts)


valid_ids = st.one_of(st.none(), st.none(), st.text(min_size=1, max_size=4), st.integers(-3, 3))
ids = st.one_of(
    valid_ids,
    st.sampled_from(["", "c:0", "\x00", "\ud800", " "]),  # "" is refused
    st.booleans(),  # refused
    st.floats(allow_nan=False) | st.lists(st.integers(), max_size=2),  # refused
)
valid_metadata = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from(["source", "id", "rank"]), st.sampled_from(["doc-a", "doc-b", 1, None, ["x"]]), max_size=3
    ),
)
metadata = st.one_of(valid_metadata, st.sampled_from([[], "source", 3]))  # refused: not a dict


def chunk_of(text, ids, metadata):
    """One chunk carrying ``text`` in any accepted form."""
    raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate gives invalid UTF-8
    return st.one_of(
        st.just(text),
        st.just(raw),
        st.just(bytearray(raw)),
        st.builds(lambda i, m: {"text": text, "id": i, "metadata": m}, ids, metadata),
        st.builds(lambda i, m: {"text": raw, "id": i, "metadata": m}, ids, metadata),
        st.builds(lambda m, i: DuckDocument(text, m, i), metadata, ids),
    )


@st.composite
def chunk_lists(draw, unicode=valid_unicode, bad=False):
    """Chunks cut from a few pieces of text: fresh texts, sliding windows of one
    document (same source, so overlap merges apply), exact repeats; with ``bad``, also
    malformed ids, metadata and values that are not chunks."""
    pool = draw(piece_pool(unicode))
    doc = draw(texts_from(pool))
    id_s, meta_s = (ids, metadata) if bad else (valid_ids, valid_metadata)
    out = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["text", "window", "windows", "repeat", "bad"]))
        if kind == "repeat" and out:
            out.append(draw(st.sampled_from(out)))
        elif kind in ("window", "windows"):  # one window, or a sliding-window chunker's 2-3
            cuts = sorted(draw(st.lists(st.integers(0, len(doc)), min_size=2, max_size=2 if kind == "window" else 5)))
            for text in [doc[cuts[j] : cuts[j + 2]] for j in range(len(cuts) - 2)] or [doc[cuts[0] : cuts[1]]]:
                meta = {"source": "doc", "rank": len(out)}
                out.append({"text": text, "metadata": meta} if draw(st.booleans()) else DuckDocument(text, meta))
        elif kind == "bad" and bad:
            out.append(draw(st.sampled_from(NOT_CHUNKS)))
        else:
            out.append(draw(chunk_of(draw(texts_from(pool)), id_s, meta_s)))
    return out


def note_result(measured, result) -> None:
    """Count the outcome (the error refusing the input, or a result keeping every id)
    and, for results, each kind of redundancy that was removed."""
    if isinstance(result, Exception):
        note(measured, f"refused: {type(result).__name__}")
        return
    note(measured, "deduplicated, every id kept")
    removing = measured.setdefault("examples removing", {})
    for kind, n in result.stats.removed.items():
        removing[kind] = removing.get(kind, 0) + (n > 0)


on_mostly = st.sampled_from([True, True, True, False])
configs = st.fixed_dictionaries(
    {
        "min_overlap": st.sampled_from([1, 2, 4, 8, 64]),
        "min_passage": st.sampled_from([1, 4, 128]),
        "exact": on_mostly,
        "containment": on_mostly,
        "overlap": on_mostly,
        "passages": on_mostly,
    }
)


@SETTINGS
@given(chunks=chunk_lists(), options=configs, policy=st.sampled_from(["error", "replace"]))
@example(chunks=[], options={}, policy="error")
@example(chunks=["é", "é".encode()[:1]], options={}, policy="replace")
def test_valid_unicode_chunks_keep_every_id(measured, chunks, options, policy):
    """Valid text in every form: dedup succeeds unless an id is misused, and the
    result keeps every input once under its own id, with exact spans."""
    note_result(measured, run_dedup(chunks, policy, **options))


@SETTINGS
@given(chunks=chunk_lists(any_unicode, bad=True), options=configs, policy=st.sampled_from(["error", "replace"]))
@example(chunks=["ok", "bad \udcff"], options={}, policy="error")
@example(chunks=[b"caf\xc3\xa9 cr\xe8me", None], options={}, policy="replace")
def test_arbitrary_unicode_and_malformed_chunks(measured, chunks, options, policy):
    """Lone surrogates, invalid UTF-8, bad ids, metadata and non-chunks: the documented
    error names the first bad chunk (``InvalidUTF8Error`` also its byte offset), or
    the result keeps every id (``replace`` decodes with U+FFFD and counts it)."""
    note_result(measured, run_dedup(chunks, policy, **options))


@SETTINGS
@given(blobs=st.lists(st.binary(max_size=40), max_size=8), policy=st.sampled_from(["error", "replace"]), data=st.data())
@example(blobs=[b"\xff", b"\xc3"], policy="replace", data=None)
def test_arbitrary_bytes(measured, blobs, policy, data):
    """Raw bytes, mostly invalid UTF-8, sharing bytes (tails of earlier blobs start new
    ones), all of one source or none (so overlap merges run on them too)."""
    chunks: list = blobs
    if data is not None and blobs:
        for _ in range(data.draw(st.integers(0, 4))):
            b = data.draw(st.sampled_from(blobs))
            i = data.draw(st.integers(0, len(b)))
            blobs.append(b[i:] + data.draw(st.binary(max_size=8)))
        if data.draw(st.booleans()):
            chunks = [{"text": b, "metadata": {"source": "doc"}} for b in blobs]
    note_result(measured, run_dedup(chunks, policy, min_overlap=1, min_passage=1))


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.binary(max_size=5),
                 st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
                 st.builds(DuckDocument, st.text(max_size=5)), st.floats()))
def test_not_a_list_of_chunks(value):
    """A single chunk or a non-iterable where the list goes: InvalidChunkError."""
    assert dedup_oracle(value, "error").error_index == -1
    assert isinstance(run_dedup(value), InvalidChunkError)
