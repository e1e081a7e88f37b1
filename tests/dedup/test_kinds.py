"""Each kind of redundancy on hand-written text: exact spans, ids and stats numbers."""

from __future__ import annotations

import pytest

import promptsplice.dedup._normalize
from promptsplice.dedup import DedupConfig, Origin, Relation, RemovedPassage, dedup as run_dedup
from promptsplice.blocks import content_digest

WESTPHALIA = (
    "The Peace of Westphalia, signed in 1648, ended the Thirty Years' War. It established "
    "the principle that each state has sovereignty over its territory and domestic affairs."
)
VIENNA = (
    "The Congress of Vienna met in 1814 and 1815 to redraw the map of Europe after the "
    "Napoleonic Wars. Its balance of power kept the continent largely at peace for decades."
)
VERSAILLES = (
    "The Treaty of Versailles, signed on 28 June 1919, ended the state of war between "
    "Germany and the Allied Powers. It required Germany to accept responsibility for the war."
)
UTRECHT = (
    "The Peace of Utrecht of 1713 ended the War of the Spanish Succession. Philip V kept "
    "the Spanish throne but renounced any claim to the French one for himself and his heirs."
)
LICENSE = (
    "Text is available under the Creative Commons Attribution-ShareAlike License. "
    "Additional terms may apply. By using this site, you agree to the Terms of Use and "
    "the Privacy Policy."
)
# A sentence of WESTPHALIA, as a finer-grained chunker returns it.
SENTENCE = "It established the principle that each state has sovereignty"
# One source document, cut by a sliding-window chunker into 300-byte windows that
# overlap by 100 bytes.
DOC = "\n\n".join([WESTPHALIA, VIENNA, VERSAILLES, UTRECHT])
W0, W1, W2 = DOC[0:300], DOC[200:500], DOC[400:]
SRC = {"source": "treaties.txt"}


def b(text: str) -> bytes:
    return text.encode("utf-8")


def test_text_fixture_sizes():
    # The numbers the tests below are written against.
    assert [len(b(t)) for t in (WESTPHALIA, VIENNA, VERSAILLES, UTRECHT, LICENSE)] == [
        171, 168, 169, 171, 178,
    ]  # fmt: skip
    assert len(b(DOC)) == 685 and len(b(SENTENCE)) == 60
    assert WESTPHALIA.find(SENTENCE) == 70


def assert_accounting(result) -> None:
    st = result.stats
    assert st.bytes_in - st.bytes_out == st.removed_bytes_total
    assert st.bytes_out == sum(len(k.data) for k in result.chunks)
    assert st.chunks_out == len(result.chunks)
    for k in result.chunks:
        assert k.text.encode("utf-8") == k.data
        assert k.digest == content_digest(k.data)


# -- exact duplicates -------------------------------------------------------------------


def test_exact_duplicates_become_duplicate_origins_of_the_first_copy():
    result = run_dedup(
        [
            {"text": WESTPHALIA, "id": "w"},
            {"text": VIENNA, "id": "v"},
            {"text": WESTPHALIA, "id": "w-mirror"},
            {"text": WESTPHALIA, "id": "w"},  # the same chunk retrieved twice
        ]
    )
    assert [k.id for k in result.chunks] == ["w", "v"]
    w = result.chunks[0]
    assert w.text == WESTPHALIA and w.removed_passages == []
    assert w.origins == [
        Origin(0, "w", {}, Relation.KEPT, (0, 171)),
        Origin(2, "w-mirror", {}, Relation.DUPLICATE, (0, 171)),
        Origin(3, "w", {}, Relation.DUPLICATE, (0, 171)),
    ]
    assert result.chunks[1].origins == [Origin(1, "v", {}, Relation.KEPT, (0, 168))]
    st = result.stats
    assert (st.chunks_in, st.chunks_out, st.bytes_in, st.bytes_out) == (4, 2, 681, 339)
    assert st.removed == {"duplicate": 2, "contained": 0, "overlap": 0, "passage": 0, "empty": 0}
    assert st.removed_bytes["duplicate"] == 342 and st.removed_bytes_total == 342
    assert result.find("w-mirror") is w
    assert result.input_ids() == {"w", "v", "w-mirror"}
    assert_accounting(result)


def test_exact_off_leaves_duplicates_to_containment_or_keeps_them():
    chunks = [{"text": WESTPHALIA, "id": "w"}, {"text": WESTPHALIA, "id": "w2"}]
    # Containment still sees the second copy inside the first.
    result = run_dedup(chunks, exact=False)
    assert [k.id for k in result.chunks] == ["w"]
    assert result.chunks[0].origins[1] == Origin(1, "w2", {}, Relation.CONTAINED, (0, 171))
    assert result.stats.removed["duplicate"] == 0 and result.stats.removed["contained"] == 1
    # With every kind off, both copies are kept unchanged.
    off = run_dedup(chunks, exact=False, containment=False, overlap=False, passages=False)
    assert [k.id for k in off.chunks] == ["w", "w2"]
    assert off.stats.removed_bytes_total == 0


def test_hash_collision_keeps_both_and_is_counted(monkeypatch):
    # Force every digest to collide: only the byte comparison tells chunks apart.
    monkeypatch.setattr(promptsplice.dedup._normalize, "content_digest", lambda data: b"\x00" * 16)
    result = run_dedup(
        [
            {"text": WESTPHALIA, "id": "a"},
            {"text": VIENNA, "id": "b"},
            {"text": WESTPHALIA, "id": "c"},
            {"text": UTRECHT, "id": "d"},
            {"text": VIENNA, "id": "e"},
        ]
    )
    assert [k.id for k in result.chunks] == ["a", "b", "d"]
    assert [(o.id, o.relation) for o in result.chunks[0].origins] == [
        ("a", Relation.KEPT), ("c", Relation.DUPLICATE),
    ]  # fmt: skip
    assert [(o.id, o.relation) for o in result.chunks[1].origins] == [
        ("b", Relation.KEPT), ("e", Relation.DUPLICATE),
    ]  # fmt: skip
    assert result.stats.hash_collisions == 2
    assert result.stats.removed["duplicate"] == 2


# -- containment ------------------------------------------------------------------------


def test_contained_chunk_becomes_an_origin_with_the_span_where_it_was_found():
    result = run_dedup(
        [
            {"text": SENTENCE, "id": "s", "metadata": {"chunker": "sentence"}},
            {"text": WESTPHALIA, "id": "w"},
            {"text": VIENNA, "id": "v"},
            {"text": SENTENCE, "id": "s-again"},
        ]
    )
    assert [k.id for k in result.chunks] == ["w", "v"]
    w = result.chunks[0]
    assert w.text == WESTPHALIA
    assert w.origins == [
        Origin(1, "w", {}, Relation.KEPT, (0, 171)),
        Origin(0, "s", {"chunker": "sentence"}, Relation.CONTAINED, (70, 130)),
        Origin(3, "s-again", {}, Relation.CONTAINED, (70, 130)),
    ]
    assert w.data[70:130] == b(SENTENCE)
    assert result.stats.removed["contained"] == 1 and result.stats.removed["duplicate"] == 1
    assert result.stats.removed_bytes == {
        "duplicate": 60, "contained": 60, "overlap": 0, "passage": 0, "empty": 0,
    }  # fmt: skip
    assert result.find("s") is w and result.find("s-again") is w
    assert_accounting(result)


def test_containment_off_keeps_the_contained_chunk():
    result = run_dedup([SENTENCE, WESTPHALIA], containment=False)
    assert [k.text for k in result.chunks] == [SENTENCE, WESTPHALIA]
    assert result.stats.removed_bytes_total == 0


def test_containment_follows_a_chain_to_the_outermost_chunk():
    doc = WESTPHALIA + "\n\n" + VIENNA
    result = run_dedup([{"text": SENTENCE, "id": "s"}, {"text": WESTPHALIA, "id": "w"},
                        {"text": doc, "id": "d"}])  # fmt: skip
    assert [k.id for k in result.chunks] == ["d"]
    assert [(o.id, o.relation, o.span) for o in result.chunks[0].origins] == [
        ("d", Relation.KEPT, (0, 341)),
        ("s", Relation.CONTAINED, (70, 130)),
        ("w", Relation.CONTAINED, (0, 171)),
    ]
    assert result.stats.removed["contained"] == 2


# -- sliding-window overlap -------------------------------------------------------------


def test_overlapping_windows_of_one_source_merge_into_one_chunk():
    assert len(b(W0)) == len(b(W1)) == 300 and len(b(W2)) == 285
    result = run_dedup(
        [
            {"text": W1, "id": "doc#1", "metadata": {**SRC, "window": 1}},
            {"text": LICENSE, "id": "footer", "metadata": {"source": "footer.txt"}},
            {"text": W0, "id": "doc#0", "metadata": {**SRC, "window": 0}},
            {"text": W2, "id": "doc#2", "metadata": {**SRC, "window": 2}},
        ]
    )
    assert [k.id for k in result.chunks] == ["doc#1", "footer"]
    merged = result.chunks[0]
    # The merged chunk stands where its earliest member was retrieved, under its id.
    assert merged.text == DOC and merged.metadata == {**SRC, "window": 1}
    assert [(o.index, o.id, o.relation, o.span) for o in merged.origins] == [
        (0, "doc#1", Relation.KEPT, (200, 500)),
        (2, "doc#0", Relation.MERGED, (0, 300)),
        (3, "doc#2", Relation.MERGED, (400, 685)),
    ]
    for o, window in zip(merged.origins, [W1, W0, W2]):
        assert merged.data[o.span[0] : o.span[1]] == b(window)
    st = result.stats
    assert st.removed["overlap"] == 2 and st.removed_bytes["overlap"] == 200
    assert (st.bytes_in, st.bytes_out) == (1063, 863)
    assert_accounting(result)


@pytest.mark.parametrize(
    "second_meta, overrides",
    [
        ({"source": "another.txt"}, {}),  # different source document
        ({}, {}),  # no source at all
        (SRC, {"min_overlap": 101}),  # the 100-byte overlap is below the threshold
        (SRC, {"overlap": False}),  # the kind is switched off
        ({"doc": "treaties.txt"}, {}),  # the source lives under another key...
    ],
)
def test_overlap_is_not_merged(second_meta, overrides):
    result = run_dedup(
        [
            {"text": W0, "id": "a", "metadata": SRC},
            {"text": W1, "id": "b", "metadata": second_meta},
        ],
        **overrides,
    )
    assert [k.text for k in result.chunks] == [W0, W1]
    assert result.stats.removed["overlap"] == 0


def test_sources_true_and_1_are_two_documents():
    """``True == 1`` in Python: windows of ``source=1`` and ``source=True`` merged into one."""
    for a, b_ in ((1, True), (0, False)):
        result = run_dedup([{"text": W0, "id": "a", "metadata": {"source": a}},
                            {"text": W1, "id": "b", "metadata": {"source": b_}}])
        assert [k.id for k in result.chunks] == ["a", "b"], (a, b_)
    for a, b_ in (([1], [True]), ((1,), (True,)), ({"d": 1}, {"d": True})):  # inside containers too
        result = run_dedup([{"text": W0, "id": "a", "metadata": {"source": a}},
                            {"text": W1, "id": "b", "metadata": {"source": b_}}])
        assert [k.id for k in result.chunks] == ["a", "b"], (a, b_)
    same = run_dedup([{"text": W0, "id": "a", "metadata": {"source": True}},
                      {"text": W1, "id": "b", "metadata": {"source": True}}])
    assert [k.id for k in same.chunks] == ["a"]


def test_overlap_source_key_is_configurable():
    meta = {"doc": "treaties.txt"}
    result = run_dedup(
        [{"text": W0, "id": "a", "metadata": meta}, {"text": W1, "id": "b", "metadata": meta}],
        source_key="doc",
    )
    assert [k.text for k in result.chunks] == [DOC[:500]]


def test_a_window_inside_another_is_containment_not_overlap():
    tail = DOC[200:300]  # W0's last 100 bytes: overlap length would equal len(tail)
    result = run_dedup(
        [{"text": W0, "id": "a", "metadata": SRC}, {"text": tail, "id": "t", "metadata": SRC}]
    )
    assert [k.id for k in result.chunks] == ["a"]
    assert result.chunks[0].origins[1] == Origin(1, "t", SRC, Relation.CONTAINED, (200, 300))
    assert result.stats.removed == {
        "duplicate": 0, "contained": 1, "overlap": 0, "passage": 0, "empty": 0,
    }  # fmt: skip


@pytest.mark.reliability
def test_a_window_inside_another_chunk_is_contained_there_before_windows_merge():
    """p1 sits inside the FAQ chunk and overlaps p2 (same source).  Merged first, the
    chunk was labelled p1 (page 1) while the passage pass then cut all of p1's text out
    of it: a citation of page 1 for page 2's text.  Now p1 is CONTAINED in the FAQ and
    p2 keeps its own id, page and bytes (user review)."""
    P = ("The Treaty of Westphalia was signed in 1648 and ended the Thirty Years War in the Holy "
         "Roman Empire, reshaping the sovereignty of states across Europe.")
    Q = "Its clauses recognised the sovereignty of the princes and redrew the borders of central Europe for a century."
    p1 = {"source": "doc", "page": 1}
    p2 = {"source": "doc", "page": 2}
    result = run_dedup([{"id": "faq", "text": "FAQ.\n\n" + P}, {"id": "doc#p1", "text": P, "metadata": p1},
                        {"id": "doc#p2", "text": P[-70:] + "\n\n" + Q, "metadata": p2}])
    faq, page2 = result.chunks
    assert faq.origins[1] == Origin(1, "doc#p1", p1, Relation.CONTAINED, (6, 6 + len(P)))
    assert (page2.id, page2.metadata, page2.text) == ("doc#p2", p2, P[-70:] + "\n\n" + Q)
    assert result.stats.removed == {
        "duplicate": 0, "contained": 1, "overlap": 0, "passage": 0, "empty": 0,
    }  # fmt: skip


@pytest.mark.reliability
def test_a_merged_owner_whose_paragraphs_are_all_found_elsewhere_gives_the_chunk_to_its_heir():
    """p1's two paragraphs each sit in another chunk (x and y), so containment cannot
    take p1 whole, and it merges with p2 first: the passage pass then cut all of p1's
    text, and the chunk still carried p1's id and page over page 2's text (dedup review).
    Now p2, the member that kept bytes, owns the chunk, in every record too."""
    P1 = ("The Peace of Westphalia was signed in 1648 at Osnabrueck and Muenster, ending the Thirty Years "
          "War in the Holy Roman Empire of the German Nation.")
    P2 = ("It established the principle of state sovereignty, under which each state has exclusive "
          "authority over its own territory and domestic affairs.")
    Q = "Page two continues: Sweden received Western Pomerania and France gained most of Alsace from the Habsburg monarchy."
    page1, page2 = {"source": "w.pdf", "page": 1}, {"source": "w.pdf", "page": 2}
    chunks = [{"id": "x", "text": "Background.\n\n" + P1, "metadata": {"source": "other.pdf"}},
              {"id": "y", "text": P2 + "\n\nSee also.", "metadata": {"source": "third.pdf"}},
              {"id": "p1", "text": P1 + "\n\n" + P2, "metadata": page1},
              {"id": "p2", "text": P2 + "\n\n" + Q, "metadata": page2}]
    result = run_dedup(chunks)
    x, y, merged = result.chunks
    assert (merged.id, merged.metadata, merged.text) == ("p2", page2, Q)
    assert [(o.id, o.relation, o.span) for o in merged.origins] == [
        ("p2", Relation.KEPT, (0, len(Q))), ("p1", Relation.MERGED, (0, 0))]
    assert {r.chunk_id for r in merged.removed_passages} == {"p2"}  # the records name the chunk by its owner
    assert {r.found_in for r in merged.removed_passages} == {"x", "y"}
    assert result.find("p1") is merged and result.find("p2") is merged


def test_overlap_merge_cuts_on_utf8_character_boundaries():
    text = (
        "Zürich ist die größte Stadt der Schweiz und liegt am Zürichsee. "
        "Die Altstadt beiderseits der Limmat ist ein beliebtes Ziel für Besucher aus aller Welt. "
        "東京都は日本の首都であり、世界最大級の都市圏を形成している。"
    )
    a, c = text[:160], text[17:]  # the overlap starts and ends on multibyte characters
    assert (a[-1], c[0]) == ("首", "ö")
    la, lc = len(b(a)), len(b(c))
    overlap = len(b(text[17:160]))
    assert (la, lc, overlap) == (181, 229, 163)
    result = run_dedup([{"text": a, "metadata": SRC}, {"text": c, "metadata": SRC}])
    [merged] = result.chunks
    assert merged.text == text and merged.data.decode("utf-8") == text
    assert [o.span for o in merged.origins] == [(0, la), (la - overlap, la - overlap + lc)]
    assert result.stats.removed_bytes["overlap"] == overlap


# -- repeated passages ------------------------------------------------------------------


def test_repeated_paragraph_is_removed_with_one_separator():
    a = WESTPHALIA + "\n\n" + LICENSE
    c = VIENNA + "\n\n" + LICENSE + "\n\n" + VERSAILLES
    result = run_dedup([{"text": a, "id": "a"}, {"text": c, "id": "c"}])
    assert [k.id for k in result.chunks] == ["a", "c"]
    first, second = result.chunks
    assert first.text == a and first.removed_passages == []
    assert second.text == VIENNA + "\n\n" + VERSAILLES
    assert second.removed_passages == [RemovedPassage("c", 170, 178, "a", 173)]
    assert first.data[173 : 173 + 178] == b(LICENSE)
    assert second.origins == [Origin(1, "c", {}, Relation.KEPT, (0, 339))]
    assert result.stats.removed["passage"] == 1 and result.stats.removed_bytes["passage"] == 180
    assert_accounting(result)


def test_trailing_repeated_paragraph_takes_the_separator_before_it():
    result = run_dedup([WESTPHALIA + "\n\n" + LICENSE, VIENNA + "\n\n" + LICENSE])
    assert result.chunks[1].text == VIENNA
    assert result.chunks[1].removed_passages[0].offset == 170
    assert result.stats.removed_bytes["passage"] == 180


def test_chunk_made_only_of_repeated_paragraphs_is_attached_with_passages():
    a = WESTPHALIA + "\n\n" + LICENSE
    c = LICENSE + "\n\n" + WESTPHALIA  # both paragraphs are in a, in another order
    result = run_dedup([{"text": a, "id": "a"}, {"text": VIENNA, "id": "v"},
                        {"text": c, "id": "c", "metadata": {"page": 7}}])  # fmt: skip
    assert [k.id for k in result.chunks] == ["a", "v"]
    host = result.chunks[0]
    assert host.text == a
    assert host.origins == [
        Origin(0, "a", {}, Relation.KEPT, (0, 351)),
        Origin(2, "c", {"page": 7}, Relation.PASSAGES, None, ("c", 0, 351)),
    ]
    assert host.removed_passages == [
        RemovedPassage("c", 0, 178, "a", 173),
        RemovedPassage("c", 180, 171, "a", 0),
    ]
    assert result.find("c") is host
    st = result.stats
    assert st.removed["passage"] == 2 and st.removed_bytes["passage"] == 351
    assert st.chunks_out == 2
    assert_accounting(result)


def test_short_paragraphs_are_kept_and_min_passage_applies():
    see_also = "See also: the Treaty of Utrecht."
    c = see_also + "\n\n" + LICENSE
    result = run_dedup([WESTPHALIA + "\n\n" + LICENSE, c, VIENNA])
    assert [k.text for k in result.chunks] == [WESTPHALIA + "\n\n" + LICENSE, see_also, VIENNA]
    # A passage must be at least min_passage bytes.
    result = run_dedup([WESTPHALIA + "\n\n" + LICENSE, c], min_passage=179)
    assert result.chunks[1].text == c


def test_chunk_shortened_by_passages_is_absorbed_if_now_contained():
    # After its repeated paragraph goes, the rest of the second chunk is a part of the
    # third chunk; containment runs again so the output has no redundancy left.
    see_also = "See also: the Treaty of Utrecht."
    result = run_dedup(
        [
            {"text": WESTPHALIA + "\n\n" + LICENSE, "id": "a"},
            {"text": see_also + "\n\n" + LICENSE, "id": "b"},
            {"text": see_also + "\n\n" + VIENNA, "id": "c"},
        ]
    )
    assert [k.id for k in result.chunks] == ["a", "c"]
    c = result.chunks[1]
    assert c.origins == [
        Origin(2, "c", {}, Relation.KEPT, (0, 202)),
        Origin(1, "b", {}, Relation.CONTAINED, (0, 32)),
    ]
    assert c.removed_passages == [RemovedPassage("b", 34, 178, "a", 173)]
    st = result.stats
    assert st.removed["passage"] == 1 and st.removed["contained"] == 1
    assert st.removed_bytes["passage"] == 180 and st.removed_bytes["contained"] == 32
    assert_accounting(result)


def test_passages_off_keeps_repeated_paragraphs():
    chunks = [WESTPHALIA + "\n\n" + LICENSE, VIENNA + "\n\n" + LICENSE]
    result = run_dedup(chunks, passages=False)
    assert [k.text for k in result.chunks] == chunks


def test_paragraph_found_mid_paragraph_in_an_earlier_chunk():
    # The repeated passage need not be a whole paragraph of the earlier chunk.
    a = "Background. " + WESTPHALIA + " Later treaties built on it."
    c = WESTPHALIA + "\n\n" + VIENNA
    result = run_dedup([{"text": a, "id": "a"}, {"text": c, "id": "c"}])
    assert result.chunks[1].text == VIENNA
    assert result.chunks[1].removed_passages == [RemovedPassage("c", 0, 171, "a", 12)]


def test_with_containment_off_a_whole_chunk_can_be_a_repeated_passage():
    result = run_dedup(
        [{"text": WESTPHALIA + "\n\n" + VIENNA, "id": "a"}, {"text": VIENNA, "id": "v"}],
        containment=False,
    )
    assert [k.id for k in result.chunks] == ["a"]
    assert result.chunks[0].origins[1] == Origin(1, "v", {}, Relation.PASSAGES, None, ("v", 0, 168))
    assert result.chunks[0].removed_passages == [RemovedPassage("v", 0, 168, "a", 173)]


# -- empty chunks -----------------------------------------------------------------------


def test_empty_and_whitespace_chunks_are_dropped_and_reported():
    result = run_dedup(
        [
            {"text": "", "id": "blank"},
            WESTPHALIA,
            {"text": "  \n\t", "id": "spaces", "metadata": {"page": 2}},
            b"",
            {"text": "\u3000", "id": "ideographic-space"},
        ]
    )
    assert [k.text for k in result.chunks] == [WESTPHALIA]
    assert [(d.index, d.id, d.metadata, d.reason) for d in result.dropped] == [
        (0, "blank", {}, "empty"),
        (2, "spaces", {"page": 2}, "empty"),
        (3, "c:" + content_digest(b"").hex()[:16], {}, "empty"),
        (4, "ideographic-space", {}, "empty"),
    ]
    assert result.stats.removed["empty"] == 4 and result.stats.removed_bytes["empty"] == 7
    assert result.find("blank") is None
    assert "spaces" in result.input_ids()
    assert_accounting(result)


def test_ascii_separators_are_content_not_whitespace():
    """``str.isspace`` counts U+001C-U+001F as space: a chunk of record separators was
    dropped as empty, and one a passage cut left with only them was rebuilt as ``\n``."""
    result = run_dedup([{"text": "\x1c\x1d", "id": "seps"}, WESTPHALIA])
    assert [k.id for k in result.chunks] == ["seps", result.chunks[1].id] and result.dropped == []
    para = ("The harbour was rebuilt after the war with money from the northern league, and its "
            "cranes stood until the flood of the next century swept the old quays away.")
    cut = run_dedup([{"text": "Intro of the first document.\n\n" + para, "id": "x"},
                     {"text": para + "\n\n\x1e\x1f\x1c", "id": "y"}], min_passage=32)
    assert cut.stats.removed["passage"] == 1 and cut.chunks[1].data == b"\x1e\x1f\x1c"  # the rest of y, kept
    assert_accounting(cut)


def test_all_empty_input_gives_no_chunks():
    result = run_dedup(["", " "])
    assert result.chunks == [] and len(result.dropped) == 2
    assert run_dedup([]).stats.chunks_in == 0


# -- order, identity, config -------------------------------------------------------------


def test_input_without_redundancy_comes_back_unchanged():
    chunks = [
        {"text": VIENNA, "id": "v", "metadata": {"score": 0.9}},
        {"text": WESTPHALIA, "id": "w", "metadata": {"score": 0.8}},
        {"text": UTRECHT, "id": "u", "metadata": {"score": 0.7}},
    ]
    result = run_dedup(chunks)
    assert [(k.id, k.text, k.metadata) for k in result.chunks] == [
        ("v", VIENNA, {"score": 0.9}), ("w", WESTPHALIA, {"score": 0.8}),
        ("u", UTRECHT, {"score": 0.7}),
    ]  # fmt: skip
    for k in result.chunks:
        assert len(k.origins) == 1 and k.origins[0].relation is Relation.KEPT
    assert result.stats.removed_bytes_total == 0 and result.dropped == []


def test_config_object_and_overrides_combine():
    cfg = DedupConfig(passages=False)
    chunks = [WESTPHALIA + "\n\n" + LICENSE, VIENNA + "\n\n" + LICENSE]
    assert run_dedup(chunks, cfg).chunks[1].text == chunks[1]
    assert run_dedup(chunks, cfg, passages=True).chunks[1].text == VIENNA
    assert cfg.passages is False  # the caller's config is not changed


# -- chunks emptied by passage removal: every input keeps its place ------------------------

_ALPHA = " ".join(f"alpha{i}" for i in range(30))  # one paragraph, 229 bytes
_BRAVO = " ".join(f"bravo{i}" for i in range(30))


def test_a_duplicate_of_an_emptied_chunk_keeps_its_range_among_the_records():
    # c2 is all repeated paragraphs (one in a, one in b) and c3 is its exact duplicate:
    # c3 became a PASSAGES origin that named nothing (no record has its id).
    c2 = _ALPHA + "\n\n" + _BRAVO
    chunks = [{"id": "a", "text": _ALPHA + "\n\nxray one"}, {"id": "b", "text": "yankee two\n\n" + _BRAVO},
              {"id": "c2", "text": c2}, {"id": "c3", "text": c2}]  # fmt: skip
    result = run_dedup(chunks)
    a, b_ = result.chunks
    assert [(o.id, o.relation, o.span, o.emptied) for o in a.origins] == [
        ("a", Relation.KEPT, (0, 239), None),
        ("c2", Relation.PASSAGES, None, ("c2", 0, 460)),
        ("c3", Relation.PASSAGES, None, ("c2", 0, 460)),
    ]
    assert a.removed_passages == [RemovedPassage("c2", 0, 229, "a", 0), RemovedPassage("c2", 231, 229, "b", 12)]
    assert b_.origins == [Origin(1, "b", {}, Relation.KEPT, (0, 241))]
    rebuilt = bytearray(b"\n" * 460)
    for r in a.removed_passages:
        host = {"a": a, "b": b_}[r.found_in]
        rebuilt[r.offset : r.offset + r.length] = host.data[r.found_at : r.found_at + r.length]
    assert bytes(rebuilt) == c2.encode()
    assert result.stats.removed == {"duplicate": 1, "contained": 0, "overlap": 0, "passage": 2, "empty": 0}


def test_an_input_inside_one_paragraph_of_an_emptied_chunk_moves_as_contained():
    # z lies inside c2's first paragraph; c2 is emptied: z moves, CONTAINED, to where that
    # paragraph was found (a, at 0), as it does when c2 keeps a paragraph of its own.
    z = _ALPHA[10:120]
    chunks = [{"id": "a", "text": _ALPHA + "\n\nxray one"}, {"id": "b", "text": "yankee two\n\n" + _BRAVO},
              {"id": "c2", "text": _ALPHA + "\n\n" + _BRAVO}, {"id": "z", "text": z}]  # fmt: skip
    result = run_dedup(chunks)
    a = result.chunks[0]
    assert [(o.id, o.relation, o.span, o.emptied) for o in a.origins] == [
        ("a", Relation.KEPT, (0, 239), None),
        ("c2", Relation.PASSAGES, None, ("c2", 0, 460)),
        ("z", Relation.CONTAINED, (10, 120), None),
    ]
    assert a.data[10:120] == z.encode()
    chunks[2]["text"] += "\n\nfresh tail paragraph"  # not emptied: the same place
    kept = run_dedup(chunks).find("z")
    assert kept is not None and kept.id == "a"
    assert [(o.relation, o.span) for o in kept.origins if o.id == "z"] == [(Relation.CONTAINED, (10, 120))]


def test_an_input_across_paragraphs_of_an_emptied_chunk_is_located_in_its_records():
    # w spans the end of one paragraph, the separator and the start of the next: it
    # cannot move to one chunk; its range in c's bytes rebuilds it.
    c = _ALPHA + "\n\n" + _BRAVO
    w = c[200:260]
    chunks = [{"id": "a", "text": _ALPHA + "\n\nxray one"}, {"id": "b", "text": "yankee two\n\n" + _BRAVO},
              {"id": "c", "text": c}, {"id": "w", "text": w}]  # fmt: skip
    result = run_dedup(chunks)
    a = result.chunks[0]
    [o] = [o for o in a.origins if o.id == "w"]
    assert (o.relation, o.span, o.emptied) == (Relation.PASSAGES, None, ("c", 200, 260))
    by_id = {k.id: k for k in result.chunks}
    rebuilt = bytearray(b"\n" * len(c))
    for r in a.removed_passages:
        rebuilt[r.offset : r.offset + r.length] = by_id[r.found_in].data[r.found_at : r.found_at + r.length]
    assert bytes(rebuilt) == c.encode() and bytes(rebuilt)[200:260] == w.encode()
