"""Input forms, ids, metadata and every kind of bad input."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document

from promptsplice.dedup import InputChunk, Relation, dedup, normalize_chunks
from promptsplice.blocks import content_digest
from promptsplice.errors import (
    ConflictingChunkIdError,
    InputError,
    InvalidChunkError,
    InvalidUTF8Error,
)

VIENNA = (
    "The Congress of Vienna met in 1814 and 1815 to redraw the map of Europe after the "
    "Napoleonic Wars. Its balance of power kept the continent largely at peace for decades."
)
GHENT = "The Treaty of Ghent, signed in December 1814, ended the War of 1812."
GHENT_NEXT = "Treaty of Ghent, signed in December 1814, ended the War of 1812. News of it reached"


def derived_id(text: str) -> str:
    return "c:" + content_digest(text.encode("utf-8")).hex()[:16]


# -- accepted forms ---------------------------------------------------------------------


def test_every_accepted_form_normalizes_to_the_same_text_and_bytes():
    class Doc:  # duck-typed document, like a LangChain Document
        def __init__(self, page_content, metadata=None, id=None):
            self.page_content, self.metadata, self.id = page_content, metadata, id

    got = normalize_chunks(
        [
            "Zürich",
            "Zürich".encode("utf-8"),
            bytearray("Zürich".encode("utf-8")),
            {"text": "Zürich"},
            {"text": b"Z\xc3\xbcrich", "id": 7, "metadata": {"lang": "de"}},
            Doc("Zürich", {"lang": "de"}, "doc-9"),
        ]
    )
    assert [c.index for c in got] == [0, 1, 2, 3, 4, 5]
    assert {c.text for c in got} == {"Zürich"} and {c.data for c in got} == {b"Z\xc3\xbcrich"}
    assert {c.digest for c in got} == {content_digest(b"Z\xc3\xbcrich")}
    assert [c.id for c in got] == [derived_id("Zürich")] * 4 + ["7", "doc-9"]
    assert got[4].metadata == {"lang": "de"} and got[0].metadata == {}
    assert all(isinstance(c, InputChunk) and isinstance(c.data, bytes) for c in got)


def test_content_derived_ids_are_stable_across_calls():
    first, second = normalize_chunks([VIENNA])[0].id, normalize_chunks([VIENNA])[0].id
    assert first == second == derived_id(VIENNA)
    assert derived_id(VIENNA) != derived_id(GHENT)


def test_metadata_is_copied_never_mutated():
    meta = {"source": "congress.txt", "score": 0.7}
    chunks = [
        {"text": VIENNA, "id": "v", "metadata": meta},
        {"text": VIENNA, "id": "v2", "metadata": meta},
    ]
    result = dedup(chunks)
    kept = result.chunks[0]
    assert kept.metadata == meta and kept.metadata is not meta
    kept.metadata["score"] = 0.0
    assert meta == {"source": "congress.txt", "score": 0.7}
    assert chunks[0]["metadata"] is meta


def test_generators_are_accepted():
    result = dedup(t for t in [VIENNA, GHENT, VIENNA])
    assert [k.text for k in result.chunks] == [VIENNA, GHENT]


def test_langchain_documents_keep_id_and_metadata():
    docs = [
        Document(page_content=GHENT, metadata={"source": "ghent.txt", "page": 1}, id="ghent-1"),
        Document(page_content=VIENNA, metadata={"source": "vienna.txt", "id": "vienna-3"}),
        Document(page_content=GHENT_NEXT + " Washington in February 1815.",
                 metadata={"source": "ghent.txt", "page": 2}, id="ghent-2"),  # fmt: skip
        Document(page_content=VIENNA, metadata={"source": "mirror.txt"}),
    ]
    result = dedup(docs)
    assert [k.id for k in result.chunks] == ["ghent-1", "vienna-3"]
    ghent, vienna = result.chunks
    # Two windows of ghent.txt that overlap: merged, the first document's id and metadata.
    assert ghent.text == GHENT + " News of it reached Washington in February 1815."
    assert ghent.metadata == {"source": "ghent.txt", "page": 1}
    assert [(o.id, o.relation, o.span, o.metadata) for o in ghent.origins] == [
        ("ghent-1", Relation.KEPT, (0, 68), {"source": "ghent.txt", "page": 1}),
        ("ghent-2", Relation.MERGED, (4, 116), {"source": "ghent.txt", "page": 2}),
    ]
    assert vienna.metadata == {"source": "vienna.txt", "id": "vienna-3"}
    assert vienna.origins[1].id == derived_id(VIENNA)
    assert vienna.origins[1].relation is Relation.DUPLICATE
    assert docs[0].metadata == {"source": "ghent.txt", "page": 1}  # untouched
    assert result.input_ids() == {"ghent-1", "vienna-3", "ghent-2", derived_id(VIENNA)}


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (42, "chunk 1: unsupported chunk type int"),
        (None, "chunk 1: unsupported chunk type NoneType"),
        (["a list"], "chunk 1: unsupported chunk type list"),
        ({"txt": "typo"}, "chunk 1: dict has no 'text' key (keys: ['txt'])"),
        ({"text": 3.5}, "chunk 1: dict 'text' must be str or bytes, got float"),
        ({"text": "x", "metadata": ["a"]}, "chunk 1: metadata must be a dict, got list"),
        ({"text": "x", "id": 1.5}, "chunk 1: id must be a str (or int), got float"),
        ({"text": "x", "id": True}, "chunk 1: id must be a str (or int), got bool"),
        ({"text": "x", "id": ""}, "chunk 1: id is an empty string"),
        (Document(page_content="x", metadata={"id": ("t",)}), "chunk 1: id must be a str"),
    ],
)
def test_non_text_chunks_are_refused_naming_the_index(bad, message):
    with pytest.raises(InvalidChunkError) as err:
        dedup([VIENNA, bad])
    assert message in str(err.value)
    assert isinstance(err.value, InputError) and isinstance(err.value, ValueError)


def test_document_with_non_str_page_content_is_refused():
    class Odd:
        page_content = b"bytes"
        metadata: dict = {}

    with pytest.raises(InvalidChunkError, match="chunk 0: Odd.page_content must be str"):
        dedup([Odd()])


def test_a_single_string_instead_of_a_list_is_refused():
    with pytest.raises(InvalidChunkError, match="got a single str chunk; wrap it in a list"):
        dedup(VIENNA)
    with pytest.raises(InvalidChunkError, match="expected an iterable of chunks"):
        dedup(42)


def test_invalid_utf8_bytes_raise_with_index_and_offset():
    with pytest.raises(InvalidUTF8Error) as err:
        dedup([VIENNA, b"caf\xc3\xa9 cr\xe8me br\xfbl\xe9e"])
    assert (err.value.index, err.value.offset) == (1, 8)
    assert "chunk 1: bytes are not valid UTF-8" in str(err.value)
    assert "on_invalid_utf8='replace'" in str(err.value)


def test_lone_surrogate_in_str_raises_with_utf8_offset():
    with pytest.raises(InvalidUTF8Error) as err:
        dedup(["éé\ud800x"])
    assert (err.value.index, err.value.offset) == (0, 4)


def test_invalid_utf8_replace_policy_decodes_and_counts():
    result = dedup(
        [b"caf\xc3\xa9 cr\xe8me", "ok", "bad \udcff surrogate"], on_invalid_utf8="replace"
    )
    assert [k.text for k in result.chunks] == ["café cr\ufffdme", "ok", "bad \ufffd surrogate"]
    assert result.chunks[0].data == "café cr\ufffdme".encode("utf-8")
    assert result.stats.replaced_invalid_utf8 == 2
    assert normalize_chunks([b"\xff"], on_invalid_utf8="replace")[0].text == "\ufffd"


def test_one_id_for_two_texts_is_refused():
    with pytest.raises(ConflictingChunkIdError) as err:
        dedup([{"text": GHENT, "id": "t-1"}, VIENNA, {"text": VIENNA, "id": "t-1"}])
    assert "id 't-1' names two different texts: chunk 0 (68 bytes) and chunk 2 (168 bytes)" in str(
        err.value
    )


def test_one_id_for_one_text_twice_is_a_duplicate():
    result = dedup([{"text": GHENT, "id": 5}, {"text": GHENT, "id": "5"}])
    assert [(o.id, o.relation) for o in result.chunks[0].origins] == [
        ("5", Relation.KEPT), ("5", Relation.DUPLICATE),
    ]  # fmt: skip


def test_an_unhashable_source_without_a_truth_value_is_not_an_error():
    """A numpy array as ``metadata["source"]`` raised numpy's ValueError from ``==``."""
    np = pytest.importorskip("numpy")
    text = "alpha beta gamma delta " * 8
    chunks = [
        {"text": text[:120], "id": "a", "metadata": {"source": np.array([1, 2])}},
        {"text": text[60:], "id": "b", "metadata": {"source": np.array([1, 2])}},
        {"text": "other text entirely, long enough to stay", "id": "c", "metadata": {"source": [3]}},
    ]
    res = dedup(chunks)
    assert sorted(o.id for k in res.chunks for o in k.origins) == ["a", "b", "c"]


def test_other_keys_of_a_chunk_dict_join_its_metadata():
    """``{"text", "meta": {...}}`` (a typo) or a retriever's ``score`` were dropped."""
    result = dedup([
        {"text": "alpha beta", "meta": {"a": 1}},
        {"id": "x", "text": "gamma delta", "score": 0.5, "metadata": {"score": 1, "source": "s"}},
    ])
    first, second = (k.origins[0].metadata for k in result.chunks)
    assert first == {"meta": {"a": 1}}
    assert second == {"score": 1, "source": "s"}  # the metadata's own key wins
    assert normalize_chunks([{"id": "y", "text": "t", "rank": 3}])[0].metadata == {"rank": 3}


def test_a_bytes_subclass_is_read_as_its_bytes_not_its_bytes_method():
    """``bytes(raw)`` called a subclass's ``__bytes__``: the chunk was another text."""

    class B(bytes):
        def __bytes__(self):
            return b"something else entirely"

    (kept,) = dedup([B(b"own bytes"), bytearray(b"")]).chunks
    assert kept.text == "own bytes" and kept.data == b"own bytes"


def test_a_str_subclass_is_read_as_its_characters_not_its_str():
    """An enum of snippets (``class S(str, Enum)``) has a ``__str__`` of ``"S.NAME"``:
    the chunk was that name, not the text (user review)."""
    import enum

    class Snippet(str, enum.Enum):
        DISCLAIMER = "Past performance is no guarantee of future results."

    assert dedup([Snippet.DISCLAIMER]).chunks[0].text == "Past performance is no guarantee of future results."


def test_ids_of_odd_types_are_read_as_written_or_refused_by_name():
    """A str subclass's id was its ``__str__`` (an enum gave ``"S.NAME"``, as text once
    did); an int id over Python's digit limit raised a raw ValueError; a Document id
    without a truth value leaked its error."""
    import enum

    class Key(str, enum.Enum):
        A = "doc-a"

    class NoTruth:
        def __bool__(self):
            raise RuntimeError("no truth value")

    assert normalize_chunks([{"text": "t", "id": Key.A}])[0].id == "doc-a"
    assert normalize_chunks([{"text": "t", "id": 0}])[0].id == "0"
    assert normalize_chunks([Document(page_content="t", id="")])[0].id.startswith("c:")
    with pytest.raises(InvalidChunkError, match=r"chunk 0: an int id of \d+ bits is over Python's int-to-str limit"):
        normalize_chunks([{"text": "t", "id": 10**5000}])

    class Doc:
        page_content, metadata, id = "t", {}, NoTruth()

    with pytest.raises(InvalidChunkError, match="id must be a str \\(or int\\), got NoTruth"):
        normalize_chunks([Doc()])


def test_many_unhashable_sources_are_grouped_in_near_linear_time():
    """Each list-valued source was compared with every unhashable group so far: 4,000
    chunks of distinct list sources took 1.6 s (0.16 s with str sources).  Equal ones
    still group, and merge."""
    import time

    text = "".join(f"Sentence {i} about the harbor wall and the tide. " for i in range(40))
    merged = dedup([{"text": text[:900], "metadata": {"source": ["a", {"p": 1}]}},
                    {"text": text[700:1600], "metadata": {"source": ["a", {"p": 1}]}}])
    assert [len(k.data) for k in merged.chunks] == [1600]

    def timed(n):
        import gc

        chunks = [{"text": f"chunk number {i} " * 5, "metadata": {"source": [i, "x"]}} for i in range(n)]
        gc.collect()  # earlier tests' garbage collected inside the timed call read as quadratic time
        gc.disable()
        try:
            t0 = time.perf_counter()
            dedup(chunks)
            return time.perf_counter() - t0
        finally:
            gc.enable()

    small = min(timed(500) for _ in range(3))
    assert timed(4000) <= 24 * max(small, 1e-3)  # 8x the chunks: linear ~8x, quadratic ~64x
