"""Render diffs -> (span, replacement) directives, and applying them (real tokenizer)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptsplice.assembler import (
    ChatRenderer,
    Diff,
    DiffKind,
    Directive,
    Relocation,
    apply_diff,
    apply_directives,
    diff_renders,
)
from promptsplice.errors import DirectiveError, InputError

IM_START, IM_END, NL, FILL = 1, 2, 198, 216
GEN = (IM_START, 520, 9531, NL)
SYSTEM = {"role": "system", "content": "Be brief."}
BASE = [
    SYSTEM,
    {"role": "user", "content": "Hi"},
    {"role": "tool", "content": "a\nb\nc\nd"},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def renderer(default_tok):
    return ChatRenderer(default_tok, block_size=16)


def test_an_edit_inside_a_message_gives_a_token_span(renderer):
    old = renderer.render(BASE)
    new_msgs = list(BASE)
    new_msgs[2] = {"role": "tool", "content": "a\nX\nc\nd"}
    new = renderer.render(new_msgs)
    # message 2 is tokens [32, 48): <|im_start|> tool \n a \n b \n c \n d <|im_end|> \n + 4 fill
    assert old.token_ids[32:48] == [IM_START, 19324, NL, 81, NL, 82, NL, 83, NL, 84, IM_END, NL] + [FILL] * 4
    diff = renderer.diff(old, new)
    assert diff.kind is DiffKind.EDIT
    assert diff.directives == (Directive(37, 38, (72,), "X", 0),)
    assert diff.relocations == [Relocation(38, 64, 0)]
    assert (diff.base, diff.old_len, diff.new_len, diff.first_changed_token) == (64, 68, 68, 37)
    assert diff.appended == GEN and diff.appended_text == "<|im_start|>assistant\n"
    assert apply_diff(old.token_ids, diff) == new.token_ids


def test_a_deletion_shifts_the_rest_by_whole_blocks(renderer):
    long_out = "\n".join(f"row {i}: value {i * 7}" for i in range(30))
    msgs = [SYSTEM, {"role": "user", "content": "Go"}, {"role": "tool", "content": long_out}, *BASE[1:]]
    old = renderer.render(msgs)
    new = renderer.render([msgs[0], msgs[1], *msgs[3:]])
    s, e = old.message_span(2)
    assert (s, e) == (32, 352)
    diff = renderer.diff(old, new)
    # the tool message goes, padding included: the rest moves by whole blocks
    (d,) = diff.directives
    assert (d.start, d.end, d.replacement, d.delta) == (32, 352, (), -320)
    assert diff.relocations == [Relocation(352, old.body_end, -320)]
    assert apply_diff(old.token_ids, diff) == new.token_ids
    # 320 of the 352 tokens the moved run attended to are gone
    assert diff.changed_share(diff.relocations[0]) == 320 / 352


def test_changed_share_counts_removed_and_inserted_tokens_before_the_run():
    d1 = Directive(10, 20, (1, 2, 3), "", -7)
    d2 = Directive(50, 50, (4,), "", -6)
    diff = Diff((d1, d2), (), "", 100, 100, 94, 10)
    r1, r2 = diff.relocations
    assert (r1, r2) == (Relocation(20, 50, -7), Relocation(50, 100, -6))
    assert diff.changed_share(r1) == (10 + 3) / 20
    assert diff.changed_share(r2) == (10 + 3 + 0 + 1) / 50
    assert diff.changed_share(Relocation(0, 5, 0)) == 0.0


def test_pure_appends_give_no_directive(renderer):
    old = renderer.render(BASE)
    # the assistant answers: the old generation prompt is the start of its message, so
    # the old tokens are an exact prefix of the new ones
    step = renderer.render([*BASE, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Bye"}])
    diff = renderer.diff(old, step)
    assert diff.directives == () and diff.kind is DiffKind.APPEND and diff.is_append
    assert diff.base == old.body_end == 64
    assert diff.appended == tuple(step.token_ids[64:])
    assert step.token_ids[: old.num_tokens] == old.token_ids
    assert diff.first_changed_token == old.num_tokens == 68
    assert apply_diff(old.token_ids, diff) == step.token_ids
    # appending a user message: the old generation prompt is dropped, still no directive
    nxt = renderer.render([*BASE, {"role": "user", "content": "More"}])
    diff = renderer.diff(old, nxt)
    assert diff.directives == () and diff.first_changed_token == 65
    assert diff.appended == tuple(nxt.token_ids[64:])
    assert apply_diff(old.token_ids, diff) == nxt.token_ids
    # the same render again: only the generation prompt is appended
    same = renderer.diff(old, renderer.render(BASE))
    assert same.directives == () and same.appended == GEN and same.first_changed_token == 68


def test_an_edit_plus_an_append(renderer):
    old = renderer.render(BASE)
    msgs = [SYSTEM, {"role": "user", "content": "Hello"}, *BASE[2:], {"role": "assistant", "content": "Ok."}]
    new = renderer.render(msgs)
    diff = renderer.diff(old, new)
    assert [d.span for d in diff.directives] == [(19, 20)]  # "Hi" -> "Hello"
    assert diff.appended == tuple(new.token_ids[64:])
    assert apply_diff(old.token_ids, diff) == new.token_ids


def test_a_system_or_tools_change_is_an_ordinary_edit(renderer):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    old = renderer.render(BASE, tools)
    new = renderer.render([{"role": "system", "content": "Be very brief."}, *BASE[1:]], tools)
    diff = renderer.diff(old, new)
    # "Be brief." -> "Be very brief.": one token less of padding, so the span runs to it
    (d,) = diff.directives
    assert old.token_ids[4:7] == [5453, 30, FILL]
    assert (d.span, d.replacement, d.text, d.delta) == ((4, 7), (1035, 5453, 30), " very brief.", 0)
    assert apply_diff(old.token_ids, diff) == new.token_ids
    other = renderer.render(BASE, [{"type": "function", "function": {"name": "g", "parameters": {}}}])
    diff = renderer.diff(old, other)
    assert len(diff.directives) == 1 and diff.directives[0].start >= 16  # inside the tools segment
    assert apply_diff(old.token_ids, diff) == other.token_ids


def test_apply_directives_validates_spans():
    toks = list(range(10))
    assert apply_directives(toks, [((2, 4), [99]), ((6, 6), [7, 7]), ((9, 10), [])]) == [0, 1, 99, 4, 5, 7, 7, 6, 7, 8]
    assert apply_directives(toks, [Directive(0, 10, (5,))]) == [5]
    assert apply_directives(toks, []) == toks
    cases = [
        ([((8, 11), [])], "out_of_range", 0),
        ([((-1, 2), [])], "out_of_range", 0),
        ([((5, 4), [])], "out_of_range", 0),
        ([((1, 2), []), ((2.5, 3), [])], "out_of_range", 1),
        ([((1, 5), []), ((4, 6), [])], "overlapping", 1),
        ([((3, 3), [1]), ((3, 4), [2])], "overlapping", 1),
        ([((5, 6), []), ((1, 2), [])], "unsorted", 1),
        (["nonsense"], "out_of_range", 0),
        # a replacement is a list or tuple of token ids: not a str, a dict, floats,
        # negative ids or bools (each was spliced in as it came)
        ([((0, 2), "78")], "out_of_range", 0),
        ([((1, 2), [5]), ((3, 4), {"k": 1})], "out_of_range", 1),
        ([((0, 1), [None, 2.5])], "out_of_range", 0),
        ([((0, 1), [3, -1])], "out_of_range", 0),
        ([((0, 1), (True,))], "out_of_range", 0),
        ([((0, 1), iter([1]))], "out_of_range", 0),
    ]
    for directives, problem, index in cases:
        with pytest.raises(DirectiveError) as info:
            apply_directives(toks, directives)
        assert (info.value.problem, info.value.index) == (problem, index)
        assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)
    for tokens in (None, "abc", [1, None], [True]):  # a raw TypeError from len() or a silent splice
        with pytest.raises(InputError, match="tokens must be a list or tuple of token ids"):
            apply_directives(tokens, [])


def test_apply_diff_checks_the_old_render(renderer):
    old = renderer.render(BASE)
    diff = renderer.diff(old, renderer.render(BASE[:3]))
    with pytest.raises(DirectiveError, match="made for an old render of 68 tokens"):
        apply_diff(old.token_ids[:-1], diff)
    bad = Diff((Directive(70, 71, ()),), (), "", 64, 68, 60, 0)
    with pytest.raises(DirectiveError, match="out of range"):
        bad.apply(old.token_ids)


# -- the round-trip property ----------------------------------------------------------

TEXTS = [
    "Hi",
    "What is the capital of France?",
    "Paris.",
    "line one\nline two\nline three",
    "Error: connection refused",
    "{\"temp\": 21, \"unit\": \"C\"}",
    "  leading spaces and trailing  ",
    "\n\nnewlines first",
    "ünïcödé — text 東京",
    "",
    "x" * 40,
    "The quick brown fox jumps over the lazy dog. " * 3,
]
ROLES = ["user", "assistant", "tool"]


@st.composite
def message(draw):
    role = draw(st.sampled_from(ROLES))
    msg = {"role": role, "content": draw(st.sampled_from(TEXTS))}
    if role == "assistant" and draw(st.booleans()):
        msg["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": draw(st.sampled_from(["f", "g"])), "arguments": "{}"}}]
    return msg


@st.composite
def session_step(draw):
    """A render and a successor: edits, deletions, insertions, appends, moves."""
    msgs = draw(st.lists(message(), min_size=1, max_size=7))
    if draw(st.booleans()):
        msgs = [{"role": "system", "content": draw(st.sampled_from(TEXTS[:4]))}, *msgs]
    new = list(msgs)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["edit", "delete", "insert", "append", "move"]))
        i = draw(st.integers(0, max(0, len(new) - 1)))
        if op == "edit" and new:
            new[i] = {**new[i], "content": draw(st.sampled_from(TEXTS))}
        elif op == "delete" and len(new) > 1:
            del new[i]
        elif op == "insert":
            new.insert(i, draw(message()))
        elif op == "append":
            new.extend(draw(st.lists(message(), min_size=1, max_size=3)))
        elif op == "move" and len(new) > 1:
            j = draw(st.integers(0, len(new) - 1))
            new.insert(j, new.pop(i))
    tools_old = draw(st.sampled_from([None, [{"type": "function", "function": {"name": "f"}}]]))
    tools_new = tools_old if draw(st.booleans()) else draw(st.sampled_from([None, [{"type": "function", "function": {"name": "g"}}]]))
    return msgs, tools_old, new, tools_new


def check_diff(old, new, diff):
    assert apply_diff(old.token_ids, diff) == new.token_ids
    prev_start, prev_end = -1, 0
    for d in diff.directives:
        assert prev_end <= d.start <= d.end <= diff.base and d.start > prev_start
        prev_start, prev_end = d.start, d.end
        # the replacement lands where new_start says, and was trimmed at both ends
        assert tuple(new.token_ids[d.new_start : d.new_end]) == d.replacement
    for r in diff.relocations:
        assert old.token_ids[r.old_start : r.old_end] == new.token_ids[r.new_start : r.new_start + r.length]
    n = diff.first_changed_token
    assert old.token_ids[:n] == new.token_ids[:n]
    assert n == min(old.num_tokens, new.num_tokens) or old.token_ids[n] != new.token_ids[n]


@pytest.mark.reliability
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=session_step())
def test_apply_of_diff_rebuilds_the_new_render(renderer, step):
    msgs, tools_old, new_msgs, tools_new = step
    old = renderer.render(msgs, tools_old)
    new = renderer.render(new_msgs, tools_new)
    diff = diff_renders(old, new)
    check_diff(old, new, diff)
    # directives come out sorted and non-overlapping: apply_directives accepts them
    apply_directives(old.token_ids[: diff.base], diff.directives)
    starts = [d.start for d in diff.directives]
    assert starts == sorted(set(starts))
    if new_msgs[: len(msgs)] == msgs and tools_new == tools_old:
        assert diff.directives == ()  # a pure append


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(message(), min_size=1, max_size=6), extra=st.lists(message(), min_size=1, max_size=3))
def test_pure_appends_never_give_a_directive(renderer, msgs, extra):
    old = renderer.render(msgs)
    new = renderer.render(msgs + extra)
    diff = renderer.diff(old, new)
    assert diff.directives == () and diff.base == old.body_end
    assert apply_diff(old.token_ids, diff) == new.token_ids
    assert new.token_ids[: old.body_end] == old.token_ids[: old.body_end]


def test_apply_takes_its_arguments_of_their_types_or_says_so():
    """apply_directives([1], None) was a TypeError, apply_diff([1], None) an AttributeError."""
    from promptsplice.errors import InputError

    with pytest.raises(InputError, match="directives must be a list"):
        apply_directives([1], None)
    with pytest.raises(InputError, match="diff must be a Diff"):
        apply_diff([1], None)


def test_a_long_history_of_repeated_messages_diffs_only_the_changed_stretch(renderer, monkeypatch):
    """The messages both renders share at either end are matched without the
    SequenceMatcher (it grows ~quadratically with repeated messages): masking one of
    2,000 identical tool outputs gives one directive over exactly that message."""
    from promptsplice.assembler import _directives

    polls = [SYSTEM, {"role": "user", "content": "Wait for the job"}]
    polls += [{"role": "tool", "content": "status: pending"}] * 2000
    old = renderer.render(polls)
    masked = list(polls)
    masked[1500] = {"role": "tool", "content": "[masked]"}
    new = renderer.render(masked)
    seen = []
    real = _directives.SequenceMatcher
    monkeypatch.setattr(
        _directives, "SequenceMatcher", lambda junk, a, b, **kw: seen.append((len(a), len(b))) or real(junk, a, b, **kw)
    )
    diff = renderer.diff(old, new)
    assert seen == [(1, 1)]
    (d,) = diff.directives
    s, e = old.message_span(1500)
    assert s <= d.start < d.end <= e and d.delta == len(d.replacement) - (d.end - d.start)
    assert apply_diff(old.token_ids, diff) == new.token_ids


@pytest.mark.parametrize("appended", [("a", -1), (1.5,), "ab", None, (True,)])
def test_apply_diff_refuses_appended_tokens_that_are_not_ids(renderer, appended):
    """A diff's ``appended`` was extended into the prompt as given: ``['a', -1]``."""
    import dataclasses

    old = renderer.render(BASE[:2])
    diff = renderer.diff(old, renderer.render(BASE))
    assert apply_diff(old.token_ids, diff) == renderer.render(BASE).token_ids
    with pytest.raises(DirectiveError, match="appended tokens must be a list or tuple of token ids"):
        apply_diff(old.token_ids, dataclasses.replace(diff, appended=appended))


def test_a_decode_that_is_not_callable_is_an_input_error(renderer):
    """``diff_renders(decode=5)`` raised a bare TypeError from inside the diff."""
    old = renderer.render([{"role": "user", "content": "hi"}])
    new = renderer.render([{"role": "user", "content": "hi there"}])
    with pytest.raises(InputError, match="decode must be a callable"):
        diff_renders(old, new, decode=5)
