"""Overlap merges on periodic seams, and the windows' ``start_index`` (new-user review).

The overlap pass merged two windows of one source at the *longest* match of one's tail
with the other's head.  Where the text at the seam repeats (log lines, table rows,
code) that match is longer than the true overlap, and the merged chunk silently lost
the rows between: 30 WARN lines of a log came back as 19, a 40-row table as 28, while
every input's bytes were still found in the merged chunk.  Now a seam with more than
one match of at least ``min_overlap`` bytes is left unmerged (nothing lost, some
redundancy kept), unless both windows carry their offset in the source
(``metadata["start_index"]``, LangChain's ``add_start_index=True``), which places the
overlap exactly.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import promptsplice.dedup._native as _native
import promptsplice.dedup._overlap as _overlap
from promptsplice import assemble_prompt
from promptsplice.dedup import DedupConfig, dedup
from promptsplice.errors import ConfigError
from tests.dedup.test_properties import check_idempotent, check_result

LOG = "Log db-7\n" + "WARN disk latency high on /dev/sda\n" * 30 + "ERROR disk failed\n"
TABLE = "| host | disk | state |\n" + "| db-7 | sda | ok |\n" * 40 + "| end |\n"


def windows(src: str, size: int, stride: int, source: str = "doc", start: bool = True) -> list[dict]:
    """A sliding-window splitter's chunks of ``src`` (LangChain's ``add_start_index``)."""
    out = []
    i = 0
    while True:
        meta = {"source": source, "start_index": i} if start else {"source": source}
        out.append({"id": f"{source}#{i}", "text": src[i : i + size], "metadata": meta})
        if i + size >= len(src):
            return out
        i += stride


def _both_ways(chunks, cfg=None):
    """dedup with the C core and with the Python passes: the same result (its texts)."""
    result = dedup(chunks, cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "core", None)
        python = dedup(chunks, cfg)
    assert [(k.id, k.text, k.metadata) for k in python.chunks] == [(k.id, k.text, k.metadata) for k in result.chunks]
    assert python.stats == result.stats
    return result


# -- the review's cases ------------------------------------------------------------------


# 20-character rows; a stride of 210 cuts every window at another place of its row (at
# 200 the middle windows were equal: exact duplicates, see the test at the end)
SEAMS = [(LOG, "WARN", 600, 450), (TABLE, "| db-7", 300, 210)]


@pytest.mark.parametrize("src, line, size, stride", SEAMS)
def test_a_periodic_seam_loses_no_lines(src, line, size, stride):
    """Without positions the seams (150 / 90 characters of repeated rows) are ambiguous:
    the windows stay apart, each the source's text, none of their lines lost."""
    chunks = windows(src, size, stride, start=False)
    assert len(chunks) >= 3
    result = _both_ways(chunks)
    assert [k.text for k in result.chunks] == [c["text"] for c in chunks]
    assert result.stats.removed["overlap"] == 0
    assert sum(k.text.count(line) for k in result.chunks) >= src.count(line)
    check_result(chunks, DedupConfig(), result)


@pytest.mark.parametrize("src, line, size, stride", SEAMS)
def test_with_start_index_a_periodic_seam_merges_exactly_at_the_true_overlap(src, line, size, stride):
    chunks = windows(src, size, stride)
    chunks.reverse()  # retrieval order is not document order
    result = _both_ways(chunks)
    [merged] = result.chunks
    assert merged.text == src and merged.text.count(line) == src.count(line)
    assert result.stats.removed["overlap"] == len(chunks) - 1
    # the merged chunk is named by its earliest retrieved member (the last window); its
    # start_index says where the merged text starts, its origin keeps the window's own
    assert merged.id == chunks[0]["id"] and merged.metadata["start_index"] == 0
    assert merged.origins[0].metadata == chunks[0]["metadata"]
    for o in merged.origins:
        s, e = o.span
        assert merged.text.encode()[s:e].decode() == src[o.metadata["start_index"] :][: e - s]
    check_result(chunks, DedupConfig(), result)
    check_idempotent(chunks, DedupConfig())


def test_assembled_prompt_keeps_every_log_line():
    src = LOG
    for start in (False, True):
        wins = windows(src, 600, 450, source="log", start=start)
        p = assemble_prompt(wins, query="How many of these lines are warnings?", block_size=16)
        counted = p.text.count("WARN")
        assert counted == 30 if start else counted >= 30, (start, counted)


# -- the rule ---------------------------------------------------------------------------


def test_a_seam_with_one_match_still_merges_at_it():
    # The longest match has no shorter one of >= min_overlap inside it: merged as before.
    a = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    b = a[30:] + " nu xi omicron pi rho sigma tau upsilon phi chi psi omega"
    chunks = [{"id": "a", "text": a, "metadata": {"source": "s"}}, {"id": "b", "text": b, "metadata": {"source": "s"}}]
    result = _both_ways(chunks, DedupConfig(min_overlap=8))
    assert [k.text for k in result.chunks] == [a[:30] + b]


def test_a_seam_is_ambiguous_only_with_a_second_match_of_min_overlap_bytes():
    # "xyzxy" ends A and starts B; inside it "xy" also does (2 bytes): below min_overlap 3
    # it is no second candidate, so the seam merges; at min_overlap 2 it is ambiguous.
    a, b = "qqqqqxyzxy", "xyzxyppppp"
    chunks = [{"id": "a", "text": a, "metadata": {"source": "s"}}, {"id": "b", "text": b, "metadata": {"source": "s"}}]
    assert [k.text for k in _both_ways(chunks, DedupConfig(min_overlap=3)).chunks] == ["qqqqqxyzxyppppp"]
    assert [k.text for k in _both_ways(chunks, DedupConfig(min_overlap=2)).chunks] == [a, b]


@pytest.mark.parametrize("use_core", [True, False])
def test_second_border_matches_a_brute_force_search(use_core):
    cases = [(b"xxabab", b"ababyy"), (b"q" + b"ab" * 20, b"ab" * 20 + b"z"), (b"xyzxy", b"xyzxyq"),
             (b"\xc3\xa9" * 9, b"\xc3\xa9" * 9 + b"!"), (b"abcabcab", b"abcabcabX")]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        if not use_core:
            mp.setattr(_native, "core", None)
        for a, b in cases:
            for m in (1, 2, 3, 5):
                ls = [x for x in range(m, min(len(a), len(b))) if a.endswith(b[:x])]
                if not ls:
                    continue
                assert _overlap._ambiguous(a, b, max(ls), m) == (len(ls) > 1), (a, b, m)


def test_windows_whose_matches_disagree_on_their_order_stay_apart():
    # a = src[0:9], b = src[2:16]: a's tail matches b's head over 7 bytes (the overlap)
    # and b's tail matches a's head over 8 (a repeat); the longest put b first.
    src = "INFO ok\nINFO ok\n"
    a, b = src[0:9], src[2:16]
    chunks = [{"id": "a", "text": a, "metadata": {"source": "s"}}, {"id": "b", "text": b, "metadata": {"source": "s"}}]
    assert [k.text for k in _both_ways(chunks, DedupConfig(min_overlap=2)).chunks] == [a, b]
    # three windows: 0 -> 1 -> 2 overlap by 5 bytes each, and 0's tail matches 2's head
    # over 8 bytes (a repeat), which would put 2 where 1 says it is not
    src = "x\nINFO ok\nINFO ok\nx\n"
    wins = [src[0:10], src[5:15], src[10:20]]
    chunks = [{"id": f"w{i}", "text": w, "metadata": {"source": "s"}} for i, w in enumerate(wins)]
    assert [k.text for k in _both_ways(chunks, DedupConfig(min_overlap=4)).chunks] == wins
    with_start = [{**c, "metadata": {"source": "s", "start_index": 5 * i}} for i, c in enumerate(chunks)]
    assert [k.text for k in _both_ways(with_start, DedupConfig(min_overlap=4)).chunks] == [src]


def test_windows_that_disagree_on_their_overlap_stay_apart():
    # start_index says 20 characters overlap; the texts differ there (another version).
    a = {"id": "a", "text": "0123456789" * 5, "metadata": {"source": "s", "start_index": 0}}
    b = {"id": "b", "text": "ABCDEFGHIJ" * 2 + "0123456789" * 3, "metadata": {"source": "s", "start_index": 30}}
    assert [k.id for k in _both_ways([a, b], DedupConfig(min_overlap=8)).chunks] == ["a", "b"]


def test_start_index_can_veto_a_coincidental_match():
    # The tail of A equals the head of B over 40 characters, but the windows sit 100
    # characters apart in their source: not an overlap.  Without positions they merge.
    shared = "the same boilerplate sentence, 40 chars."
    a = "first window of the document, then " + shared
    b = shared + " and the window after a gap in the text"
    meta_a, meta_b = {"source": "s", "start_index": 0}, {"source": "s", "start_index": len(a) + 100}
    chunks = [{"id": "a", "text": a, "metadata": meta_a}, {"id": "b", "text": b, "metadata": meta_b}]
    assert [k.id for k in _both_ways(chunks, DedupConfig(min_overlap=16)).chunks] == ["a", "b"]
    assert [k.id for k in _both_ways(chunks, DedupConfig(min_overlap=16, start_key=None)).chunks] == ["a"]


def test_a_position_overlap_below_min_overlap_is_not_merged():
    src = "ab" * 100
    chunks = windows(src, 60, 50)  # 10 characters of overlap
    result = _both_ways(chunks, DedupConfig(min_overlap=16))
    assert result.stats.removed["overlap"] == 0


def test_positions_count_characters_not_bytes():
    src = "état ✓ ok\n" * 40  # multibyte characters at every seam
    chunks = windows(src, 95, 61)
    chunks.reverse()
    result = _both_ways(chunks, DedupConfig(min_overlap=16))
    [merged] = result.chunks
    assert merged.text == src and merged.metadata["start_index"] == 0


@pytest.mark.parametrize("value", [True, -1, 3.0, "0", None])
def test_a_start_index_that_is_no_offset_is_ignored(value):
    chunks = windows(LOG, 600, 450)
    chunks[1]["metadata"]["start_index"] = value  # the middle window: both seams ambiguous
    result = _both_ways(chunks)
    assert len(result.chunks) == 3 and result.stats.removed["overlap"] == 0
    assert result.chunks[1].metadata["start_index"] == value  # left as it was


def test_start_key_is_configurable_and_none_switches_positions_off():
    chunks = windows(LOG, 600, 450)
    for c in chunks:
        c["metadata"]["offset"] = c["metadata"].pop("start_index")
    assert [k.text for k in _both_ways(chunks, DedupConfig(start_key="offset")).chunks] == [LOG]
    assert len(_both_ways(chunks).chunks) == 3  # no "start_index": ambiguous seams
    plain = windows(LOG, 600, 450)
    assert len(_both_ways(plain, DedupConfig(start_key=None)).chunks) == 3


@pytest.mark.parametrize("value", ["", 3, b"start_index"])
def test_bad_start_key_raises_config_error(value):
    with pytest.raises(ConfigError, match=re.escape("DedupConfig.start_key must be a non-empty str or None")):
        DedupConfig(start_key=value)


def test_a_merge_through_a_window_without_position_keeps_the_keepers_offset_true():
    # The middle window has no start_index: its seams are settled by their bytes (one
    # match each here), and the merged chunk's start_index still says where it starts.
    src = "".join(f"line {i:03d} of a log that does not repeat itself\n" for i in range(30))
    chunks = windows(src, 400, 300)
    del chunks[1]["metadata"]["start_index"]
    chunks.reverse()
    [merged] = _both_ways(chunks).chunks
    assert merged.text == src and merged.metadata["start_index"] == 0


def test_a_chunk_cut_by_the_passage_pass_no_longer_claims_an_offset():
    # Its text is no longer one slice of its source: start_index None (the origin keeps
    # the window's own), so that a second dedup does not place it by the old offset.
    para = "A boilerplate paragraph that every page of the manual repeats, word for word, again."
    src = "Intro.\n\n" + para + "\n\nPage one text.\n\n" + para + "\n\nPage two text that follows."
    first = src.index("Page one")
    chunks = [{"id": "p0", "text": src[:first], "metadata": {"source": "m", "start_index": 0}},
              {"id": "p1", "text": src[first:], "metadata": {"source": "m", "start_index": first}}]  # fmt: skip
    result = _both_ways(chunks, DedupConfig(min_passage=32))
    p0, p1 = result.chunks
    assert result.stats.removed["passage"] == 1 and para not in p1.text
    assert p0.metadata["start_index"] == 0 and p1.metadata["start_index"] is None
    assert p1.origins[0].metadata["start_index"] == first
    check_idempotent(chunks, DedupConfig(min_passage=32))


# -- properties --------------------------------------------------------------------------

# A few distinct lines (one multibyte), so that windows' seams are often periodic.
LINES = ["WARN disk latency high\n", "INFO ok\n", "| db-7 | sda | ok |\n", "état ✓\n", "x\n"]


@st.composite
def periodic_sources(draw):
    alphabet = draw(st.lists(st.sampled_from(LINES), min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):  # a pattern of lines repeated, between a head and a tail
        pattern = draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=4))
        body = pattern * draw(st.integers(2, 25))
        ends = st.lists(st.sampled_from(LINES), max_size=2)
        lines = draw(ends) + body + draw(ends)
    else:
        lines = draw(st.lists(st.sampled_from(alphabet), min_size=2, max_size=60))
    return "".join(lines)


@st.composite
def sliding_windows(draw, start: bool):
    src = draw(periodic_sources())
    m = draw(st.sampled_from([4, 8, 16, 64]))
    size = draw(st.integers(m + 1, max(m + 1, min(len(src), 400))))
    stride = draw(st.integers(1, max(1, size - m)))  # consecutive windows overlap by >= m characters
    chunks = windows(src, size, stride, start=start)
    order = draw(st.permutations(range(len(chunks))))
    return src, [chunks[i] for i in order], DedupConfig(min_overlap=m, order=draw(st.sampled_from([None, "content"])))


def _apart(texts: list[str]) -> bool:
    """No window lies inside another one (nor equals it): containment and exact dedup
    then keep every window's place, and the merge alone decides the output."""
    return not any(i != j and a in b for i, a in enumerate(texts) for j, b in enumerate(texts))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sliding_windows(start=True))
def test_with_start_index_merged_windows_are_their_source(case):
    src, chunks, cfg = case
    result = dedup(chunks, cfg)
    check_result(chunks, cfg, result)
    for k in result.chunks:
        assert k.text in src, k.text  # merging never makes text that is not in the source
        s = k.metadata["start_index"]
        assert src[s : s + len(k.text)] == k.text  # and says where the text is
    if _apart([c["text"] for c in chunks]):
        assert [k.text for k in result.chunks] == [src]
    check_idempotent(chunks, cfg)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(periodic_sources(), st.data())
def test_two_overlapping_windows_merge_only_into_their_source_text(src, data):
    """Without positions: two windows of one source that overlap by >= min_overlap
    characters merge into the source's text or stay apart, never into other text."""
    m = data.draw(st.sampled_from([2, 4, 8, 16]))
    i = data.draw(st.integers(0, max(0, len(src) - m - 2)))
    j = data.draw(st.integers(i + 1, max(i + 1, len(src) - m - 1)))
    end_a = data.draw(st.integers(min(j + m, len(src)), len(src)))
    end_b = data.draw(st.integers(end_a, len(src)))
    a, b = src[i:end_a], src[j:end_b]
    chunks = [{"id": "a", "text": a, "metadata": {"source": "s"}}, {"id": "b", "text": b, "metadata": {"source": "s"}}]
    if data.draw(st.booleans()):
        chunks.reverse()
    cfg = DedupConfig(min_overlap=m)
    result = _both_ways(chunks, cfg)
    for k in result.chunks:
        assert k.text in src, (a, b, k.text)
    if result.stats.removed["overlap"]:
        assert [k.text for k in result.chunks] == [src[i:end_b]]
    check_result(chunks, cfg, result)


def test_equal_windows_at_two_offsets_are_still_exact_duplicates():
    """Not an overlap question, and unchanged: where the stride is a multiple of the
    rows' period, two windows have the same text and exact dedup keeps one (the other is
    its DUPLICATE origin, nothing of its bytes lost); the table then shows fewer rows
    than its source, with or without offsets (dedup removes repeated text by design)."""
    chunks = windows(TABLE, 300, 200)
    assert chunks[1]["text"] == chunks[2]["text"]
    result = _both_ways(chunks)
    assert result.stats.removed["duplicate"] == 1
    assert sum(k.text.count("| db-7") for k in result.chunks) < TABLE.count("| db-7")
    for k in result.chunks:
        assert k.text in TABLE


def test_one_repeating_seam_keeps_only_its_own_windows_apart():
    """A repeating seam kept its whole connected set of windows apart: 41 windows of a
    log with one run of repeated lines came out as 41 chunks (16,243 bytes for a
    12,243-byte source).  Now only that seam's edge is dropped: two chunks, each text
    of the source, together the whole of it (review)."""
    from promptsplice.dedup import dedup

    def uniq(a, b):
        return "".join(f"line {i} value {i * 7919 % 10007}\n" for i in range(a, b))

    src = uniq(0, 300) + "WARN disk latency high on /dev/sda\n" * 12 + uniq(300, 600)
    wins = [{"id": f"w{i}", "text": src[i : i + 400], "metadata": {"source": "log"}} for i in range(0, len(src), 300)]
    assert len(wins) == 41
    texts = [c.text for c in dedup(wins).chunks]
    assert len(texts) == 2 and all(t in src for t in texts)
    assert src.startswith(texts[0]) and src.endswith(texts[1])
    assert len(texts[0]) + len(texts[1]) - len(src) == 100  # the one seam left: its windows' overlap, kept twice


def test_a_merge_with_a_window_without_offset_publishes_no_offset():
    """A window without ``start_index`` met a placed one by chance (a sentence repeated
    in the source): the merged chunk published the placed window's offset moved back,
    0, where the source does not hold its text, and a second dedup takes a published
    offset as certain (review)."""
    from promptsplice.dedup import dedup

    rep = "The quick brown fox jumps over the lazy dog near the riverbank at dawn.\n"
    src = ("intro text one two three four five six seven eight nine ten\n" + rep
           + "first follow-up paragraph with unique words alpha beta gamma\n" + "middle filler " * 20
           + "\nlate section lorem ipsum dolor sit amet consectetur\n" + rep + "tail words\n")
    p0, p1 = src.index(rep), src.rindex(rep)
    (chunk,) = dedup([
        {"id": "P", "text": src[p0 : p0 + 150], "metadata": {"source": "d", "start_index": p0}},
        {"id": "U", "text": src[p1 - 60 : p1 + len(rep)], "metadata": {"source": "d"}},
    ]).chunks
    assert chunk.metadata == {"source": "d", "start_index": None}
