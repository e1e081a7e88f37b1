"""The layout builder's probes against the mirror."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from promptsplice.assembler import AlignPolicy, PrefixCacheMirror
from promptsplice.assembler._layout import LayoutBuilder, SegmentKind
from promptsplice.blocks import chain_hashes, token_bytes

FILLER = 0
segs = st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=9), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(segs, st.integers(0, 6), st.one_of(st.just([]), segs), segs, st.sampled_from([2, 4]), st.sampled_from(list(AlignPolicy)))
@example([[1, 2, 3, 1, 2], [3, 3, 1], [2, 2, 2, 2, 1]], 1, [], [[9]], 4, AlignPolicy.ALL)  # padded hits
@example([[1, 2, 3, 1, 2], [3, 3, 1], [2, 2, 2, 2, 1]], 1, [], [[9]], 4, AlignPolicy.NONE)
def test_first_block_hits_is_a_one_block_probe_of_each_head(seen, k, laid, candidates, bs, align):
    """``first_block_hits`` (one digest per candidate, the greedy walk's filter) answers
    ``probe(seg, pad, limit=1) > 0`` for every candidate and padding choice."""
    mirror = PrefixCacheMirror(bs)
    b = LayoutBuilder(bs, FILLER, AlignPolicy.ALL, None)
    for s in seen:  # earlier requests: some padded layouts, so padded blocks hit too
        b.append(SegmentKind.CHUNK, (), s, paddable=True)
    for tokens in (b.tokens, [t for s in seen for t in s]):
        mirror.admit(chain_hashes(tokens, bs), len(tokens) + 1)
    builder = LayoutBuilder(bs, FILLER, align, mirror)
    for s in seen[:k] + laid:  # a prefix of what was seen, then anything
        if not builder.hitting:
            break
        builder.append(SegmentKind.CHUNK, (), s, paddable=True)
    candidates = seen + candidates  # the seen segments are the candidates that can hit
    heads = [token_bytes(c[:bs]) for c in candidates]
    for pad in builder.pad_choices():
        want = [builder.probe(c, pad, limit=1) > 0 for c in candidates]
        assert builder.first_block_hits(heads, pad) == want
