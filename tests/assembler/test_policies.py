"""Context policies: truncate long tool outputs, drop failed calls once retried,
summarize old turns; each reports its edit, and the edit becomes token directives."""

from __future__ import annotations

import copy

import pytest

from promptsplice.assembler import (
    ChatRenderer,
    ContextPolicy,
    DropFailedCalls,
    EditKind,
    MessageEdit,
    PolicyResult,
    SummarizeTurns,
    TruncateToolOutputs,
    apply_diff,
    is_error_output,
    summarize_turns,
)
from promptsplice.errors import ConfigError, InputError, InvalidMessageError


def call(cid, name, args="{}"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def lines(n, prefix="row"):
    return "\n".join(f"{prefix} {i}" for i in range(n))


# -- the ten-line rule -----------------------------------------------------------------


def test_truncate_keeps_first_and_last_lines_around_a_marker():
    pol = TruncateToolOutputs()
    assert (pol.max_lines, pol.keep_lines, pol.keep_recent) == (10, 4, 1)
    assert pol.truncate(lines(45)) == "row 0\nrow 1\nrow 2\nrow 3\n[... 37 lines truncated ...]\nrow 41\nrow 42\nrow 43\nrow 44"
    assert pol.truncate(lines(11) + "\n") == "row 0\nrow 1\nrow 2\nrow 3\n[... 3 lines truncated ...]\nrow 7\nrow 8\nrow 9\nrow 10\n"
    assert pol.truncate(lines(10)) == lines(10)  # at most ten lines: untouched
    assert pol.truncate(lines(10) + "\n") == lines(10) + "\n"
    cut = pol.truncate(lines(200))
    assert cut.count("\n") + 1 == 9 and pol.truncate(cut) == cut  # idempotent
    assert TruncateToolOutputs(3, 0).truncate("a\nb\nc\nd") == "[... 4 lines truncated ...]"


def test_truncate_spares_the_latest_outputs_and_reports_edits():
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [call("a", "ls")]},
        {"role": "tool", "tool_call_id": "a", "content": lines(30)},
        {"role": "assistant", "tool_calls": [call("b", "ls")]},
        {"role": "tool", "tool_call_id": "b", "content": lines(3)},
        {"role": "assistant", "tool_calls": [call("c", "cat")]},
        {"role": "tool", "tool_call_id": "c", "content": lines(40)},
    ]
    before = copy.deepcopy(msgs)
    res = TruncateToolOutputs().apply(msgs)
    assert isinstance(res, PolicyResult) and msgs == before  # the input is not mutated
    assert res.edits == (MessageEdit(EditKind.TRUNCATE, (2, 3), (2, 3)),)
    assert res.messages[2] == {"role": "tool", "tool_call_id": "a", "content": TruncateToolOutputs().truncate(lines(30))}
    assert res.messages[6]["content"] == lines(40)  # the latest output stays whole
    assert res.messages[4] == msgs[4]
    everything = TruncateToolOutputs(keep_recent=0).apply(msgs)
    assert [e.old for e in everything.edits] == [(2, 3), (6, 7)]
    assert TruncateToolOutputs(keep_recent=5).apply(msgs).edits == ()
    assert isinstance(TruncateToolOutputs(), ContextPolicy)


def test_the_outputs_of_one_turns_parallel_calls_stay_whole_together():
    """``keep_recent`` counted tool messages: of a turn's two parallel calls the first
    output was truncated in the very step it arrived, before the agent had read it.  A
    turn's outputs (a run of consecutive tool messages) now count as one."""
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [call("a", "ls"), call("b", "cat")]},
        {"role": "tool", "tool_call_id": "a", "content": lines(30)},
        {"role": "tool", "tool_call_id": "b", "content": lines(30)},
    ]
    assert TruncateToolOutputs().apply(msgs).edits == ()
    later = msgs + [{"role": "assistant", "tool_calls": [call("c", "ls")]},
                    {"role": "tool", "tool_call_id": "c", "content": lines(30)}]
    res = TruncateToolOutputs().apply(later)
    assert [e.old for e in res.edits] == [(2, 3), (3, 4)] and res.messages[5]["content"] == lines(30)
    assert [e.old for e in TruncateToolOutputs(keep_recent=2).apply(later).edits] == []
    assert [e.old for e in TruncateToolOutputs(keep_recent=0).apply(later).edits] == [(2, 3), (3, 4), (5, 6)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_lines": 0}, "max_lines"),
        ({"keep_lines": 5}, "keep_lines"),
        ({"keep_recent": -1}, "keep_recent"),
        ({"marker": "a\nb"}, "one line"),
        # a marker other than {n} raised KeyError/IndexError at the first long output
        ({"marker": "[{count} lines cut]"}, r"marker .*only \{n\}"),
        ({"marker": "[{} cut]"}, r"marker .*only \{n\}"),
        ({"marker": "[{n lines]"}, r"marker .*only \{n\}"),
        ({"marker": 3}, "marker must be a str"),
        # a lone str was read as its characters: ("t", "o", "o", "l"), truncating nothing
        ({"roles": "tool"}, "roles must be a list or tuple of role names"),
    ],
)
def test_truncate_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TruncateToolOutputs(**kwargs)


# -- failed calls ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg, failed",
    [
        ({"content": "Error: file not found"}, True),
        ({"content": "  error: timeout"}, True),
        ({"content": "TypeError: 'int' object is not iterable"}, True),
        ({"content": "Traceback (most recent call last):\n  ..."}, True),
        ({"content": '{"error": "No such city"}'}, True),
        ({"content": "ok", "status": "error"}, True),
        ({"content": "ok", "is_error": True}, True),
        ({"content": "Errors found: 0"}, False),
        ({"content": '{"result": "error-free"}'}, False),
        ({"content": "The error was fixed."}, False),
        ({"content": "Error-free run: 12 files"}, False),  # (user review: both read as failures)
        ({"content": "no_error: true"}, False),
        ({"content": "NonError"}, False),
        ({"content": "ValueError"}, True),
        ({"content": "KeyError 'x'"}, True),
        ({"content": "NotFoundError: no such file"}, True),
        ({"content": ["Error: ", "timeout"]}, True),  # plain-string parts (the renderer takes them)
        ({"content": "ValueError('invalid literal')"}, True),  # an exception's repr (diff review)
        ({"content": "OSError(2, 'No such file')"}, True),
        ({"content": "S3Error: NoSuchKey"}, True),
        ({"content": "HTTP_ERROR: 503"}, True),
        ({"content": "Error, could not connect"}, True),
        ({"content": "Error!"}, True),
        ({"content": "error=timeout"}, True),
        ({"content": "error_count: 0"}, False),
        ({"content": "errorless"}, False),
        # the second review's table: successes the second rule read as failures, and failures
        # every rule so far missed
        ({"content": "error.log\naccess.log"}, False),
        ({"content": "error/404.html"}, False),
        ({"content": "error=None, result=42"}, False),
        ({"content": "error=0"}, False),
        ({"content": "Error(s): 0  Warning(s): 2"}, False),
        ({"content": "GL_NO_ERROR"}, False),
        ({"content": "STATUS_NO_ERROR: ok"}, False),
        ({"content": "kNoError"}, False),
        ({"content": "error: null"}, False),
        ({"content": "Error: None"}, False),
        ({"content": "Terror (film) - Wikipedia"}, False),
        ({"content": "sqlite3.OperationalError: no such table: t"}, True),
        ({"content": "java.lang.NullPointerException"}, True),
        ({"content": "[Errno 2] No such file or directory: 'a.py'"}, True),
        ({"content": "[ERROR] build failed"}, True),
        ({"content": "fatal: not a git repository"}, True),
        ({"content": "ERROR-42: quota"}, True),
        ({"content": "Error. The call failed."}, True),
        ({"content": "IOError: disk"}, True),
        ({"content": "Win32Error: 5"}, True),
        ({"content": "ConnectionError(MaxRetryError('x'))"}, True),
        ({"content": ""}, False),
    ],
)
def test_failure_rule(msg, failed):
    assert is_error_output({"role": "tool", **msg}) is failed


FAILED_SESSION = [
    {"role": "system", "content": "Agent."},
    {"role": "user", "content": "weather in Lyon"},
    {"role": "assistant", "content": None, "tool_calls": [call("1", "weather", '{"city": "Lyn"}')]},
    {"role": "tool", "tool_call_id": "1", "content": "Error: unknown city Lyn"},
    {"role": "assistant", "content": None, "tool_calls": [call("2", "weather", '{"city": "Lyon"}')]},
    {"role": "tool", "tool_call_id": "2", "content": "21 C, sunny"},
    {"role": "assistant", "content": "21 C and sunny."},
]


def test_a_failed_call_is_dropped_once_retried():
    res = DropFailedCalls().apply(FAILED_SESSION)
    assert res.edits == (MessageEdit(EditKind.DROP, (2, 4), (2, 2)),)
    assert res.messages == [dict(m) for m in FAILED_SESSION[:2] + FAILED_SESSION[4:]]
    # not retried yet: kept
    assert DropFailedCalls().apply(FAILED_SESSION[:4]).edits == ()
    # retried with another function: kept
    other = copy.deepcopy(FAILED_SESSION)
    other[4]["tool_calls"] = [call("2", "forecast")]
    assert DropFailedCalls().apply(other).edits == ()


def test_tool_calls_in_a_tuple_are_dropped_like_a_list():
    """The renderer and the pairing take tool calls in a tuple; the retry check took
    lists only, so a failed call in a tuple was kept and no edit was reported."""
    as_tuples = [dict(m, tool_calls=tuple(m["tool_calls"])) if "tool_calls" in m else m for m in FAILED_SESSION]
    res = DropFailedCalls().apply(as_tuples)
    assert res.edits == (MessageEdit(EditKind.DROP, (2, 4), (2, 2)),)
    assert res.messages == [dict(m) for m in as_tuples[:2] + as_tuples[4:]]


def test_drop_failed_options_are_checked():
    with pytest.raises(ConfigError, match="tool_roles must be a list or tuple"):
        DropFailedCalls(tool_roles="tool")
    with pytest.raises(ConfigError, match="is_error must be a callable"):
        DropFailedCalls(is_error="Error:")


def test_only_the_failed_call_of_several_goes():
    msgs = [
        {"role": "user", "content": "two things"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("a", "weather"), call("b", "time")]},
        # answered out of order, matched by tool_call_id
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
        {"role": "tool", "tool_call_id": "a", "content": "Error: timeout"},
        {"role": "assistant", "tool_calls": [call("c", "weather")]},
        {"role": "tool", "tool_call_id": "c", "content": "21 C"},
    ]
    res = DropFailedCalls().apply(msgs)
    assert res.messages[1] == {"role": "assistant", "content": "Checking.", "tool_calls": [call("b", "time")]}
    assert [m.get("tool_call_id") for m in res.messages] == [None, None, "b", None, "c"]
    assert res.edits == (MessageEdit(EditKind.DROP, (1, 2), (1, 2)), MessageEdit(EditKind.DROP, (3, 4), (3, 3)))
    # without ids: matched by order
    no_ids = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in msgs]
    no_ids[2], no_ids[3] = no_ids[3], no_ids[2]
    res = DropFailedCalls().apply(no_ids)
    assert [m.get("content") for m in res.messages[2:]] == ["12:00", None, "21 C"]
    # a text-less assistant message left without calls goes too; custom failure rule
    res = DropFailedCalls(lambda m: "timeout" in (m.get("content") or "")).apply(msgs)
    assert len(res.messages) == 5


# -- summaries ---------------------------------------------------------------------------


def test_summarize_turns_replaces_a_stretch():
    seen = []

    def summarize(stretch):
        seen.append(stretch)
        return f"{len(stretch)} messages about the weather."

    res = summarize_turns(FAILED_SESSION, 1, 6, summarize)
    assert res.messages == [
        FAILED_SESSION[0],
        {"role": "user", "content": "Summary of the earlier conversation:\n5 messages about the weather."},
        FAILED_SESSION[6],
    ]
    assert res.edits == (MessageEdit(EditKind.SUMMARIZE, (1, 6), (1, 2)),)
    assert seen == [[dict(m) for m in FAILED_SESSION[1:6]]]
    with pytest.raises(InputError, match="between a tool call and its output"):
        summarize_turns(FAILED_SESSION, 1, 3, summarize)
    with pytest.raises(InputError, match="not a non-empty range"):
        summarize_turns(FAILED_SESSION, 3, 3, summarize)
    with pytest.raises(InputError, match="must return a str"):
        summarize_turns(FAILED_SESSION, 1, 2, lambda s: None)
    # a template with another field raised KeyError once a summary came back
    for bad in ("Summary: {text}", "Summary: {}", "Summary: {summary"):
        with pytest.raises(ConfigError, match=r"template .*only \{summary\}"):
            summarize_turns(FAILED_SESSION, 1, 6, summarize, template=bad)
        with pytest.raises(ConfigError, match=r"template .*only \{summary\}"):
            SummarizeTurns(summarize, template=bad)
    assert summarize_turns(FAILED_SESSION, 1, 6, summarize, template="{{{summary}}}").messages[1]["content"] == (
        "{5 messages about the weather.}"
    )


def test_summaries_are_memoized_across_steps():
    calls = []

    def summarize(stretch):
        calls.append(len(stretch))
        return f"summary of {len(stretch)}"

    pol = SummarizeTurns(summarize, max_messages=8, keep_recent=3)
    msgs = [{"role": "system", "content": "Agent."}]
    results = []
    for i in range(14):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"})
        results.append(pol.apply(msgs))
    # 9 messages > 8: summarize [1, 6); later steps reuse it until the list outgrows 8 again
    assert calls == [5, 9]
    assert [len(r.messages) for r in results] == [2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    assert results[7].edits == (MessageEdit(EditKind.SUMMARIZE, (1, 6), (1, 2)),)
    assert results[10].messages[1]["content"].endswith("summary of 5")
    assert results[11].edits == (MessageEdit(EditKind.SUMMARIZE, (1, 10), (1, 2)),)
    with pytest.raises(ConfigError, match="max_messages"):
        SummarizeTurns(summarize, max_messages=4, keep_recent=3)


def test_the_summary_stretch_keeps_calls_with_their_outputs():
    msgs = [{"role": "system", "content": "Agent."}]
    for i in range(4):
        msgs += [{"role": "assistant", "tool_calls": [call(str(i), "ls")]}, {"role": "tool", "tool_call_id": str(i), "content": "x"}]
    res = SummarizeTurns(lambda s: "s", max_messages=6, keep_recent=3).apply(msgs)
    # n=9, keep 3 -> end 6 is a tool output: the stretch ends at 5 (before its call)
    assert res.edits == (MessageEdit(EditKind.SUMMARIZE, (1, 5), (1, 2)),)
    assert res.messages[2]["role"] == "assistant"


# -- policy edits become directives ---------------------------------------------------------


def test_a_policy_edit_becomes_directives_inside_the_edited_message(default_tok):
    r = ChatRenderer(default_tok, block_size=16)
    msgs = [
        {"role": "system", "content": "Agent."},
        {"role": "user", "content": "list"},
        {"role": "assistant", "tool_calls": [call("a", "ls")]},
        {"role": "tool", "tool_call_id": "a", "content": lines(30)},
        {"role": "assistant", "tool_calls": [call("b", "ls")]},
        {"role": "tool", "tool_call_id": "b", "content": lines(30, "file")},
    ]
    old = r.render(msgs[:4])  # the step before: output 3 was the latest, whole
    res = TruncateToolOutputs().apply(msgs)
    new = r.render(res.messages)
    diff = r.diff(old, new)
    (edit,) = res.edits
    s, e = old.message_span(edit.old[0])
    (d,) = diff.directives
    assert s < d.start < d.end <= e  # inside the tool output, after its header
    assert d.text.startswith("[... 22 lines truncated ...]\nrow 26\n")
    assert d.delta % 16 == 0 and d.delta < 0
    assert apply_diff(old.token_ids, diff) == new.token_ids
    # dropping the failed call: one directive over exactly the two dropped messages
    old = r.render(FAILED_SESSION)
    res = DropFailedCalls().apply(FAILED_SESSION)
    new = r.render(res.messages)
    diff = r.diff(old, new)
    (d,) = diff.directives
    assert (d.start, d.end) == (old.message_span(2)[0], old.message_span(3)[1]) and d.replacement == ()
    assert diff.relocations[0].delta == -(d.end - d.start)
    assert apply_diff(old.token_ids, diff) == new.token_ids


# -- review 2026-12-02: summaries, failed calls, bad input -----------------------------


def test_a_remembered_summary_never_swallows_the_recent_turns_of_another_list():
    """Summaries are remembered by content: a stretch summarized for an 8-message list
    was reused on the first 6 of them (another session of the same task), and its
    summary then covered every message, the latest turns too."""
    p = SummarizeTurns(lambda ms: f"summary of {len(ms)}", max_messages=6, keep_recent=2)
    full = [{"role": "system", "content": "S"}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(7)
    ]
    first = p.apply(full)
    assert [m["content"] for m in first.messages][2:] == ["m5", "m6"] and first.edits[0].old == (1, 6)
    short = full[:6]
    assert p.apply(short).messages == short  # fits: nothing summarized, as a fresh policy does
    grown = full + [{"role": "user", "content": "m7"}]  # the same session, one step on
    assert p.apply(grown).edits[0].old == (1, 6)  # the same summary: a stable prefix


def test_a_summary_never_starts_or_ends_between_a_call_and_its_output():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "f")]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "next"},
    ]
    with pytest.raises(InputError, match="starts between a tool call and its output"):
        summarize_turns(msgs, 3, 5, lambda ms: "s")
    # keep_head=3 ended the head on the call: the head now keeps its output
    longer = msgs[:5] + [{"role": "user", "content": "more"}] + msgs[5:]
    r = SummarizeTurns(lambda ms: "s", max_messages=5, keep_recent=1, keep_head=3).apply(longer)
    assert r.messages[:4] == longer[:4] and r.edits[0].old == (4, 6)
    # tool outputs under another role (Llama-3's "ipython") are named by tool_roles
    ipy = [dict(m, role="ipython") if m["role"] == "tool" else m for m in msgs] + [
        {"role": "assistant", "content": None, "tool_calls": [call("c2", "f")]},
        {"role": "ipython", "tool_call_id": "c2", "content": "out2"},
    ]
    r = SummarizeTurns(lambda ms: "s", max_messages=4, keep_recent=1, tool_roles=("ipython",)).apply(ipy)
    assert r.messages[2]["role"] == "assistant" and r.messages[3]["role"] == "ipython"  # call kept with output


def test_bad_messages_and_options_of_summaries_are_the_documented_errors():
    from promptsplice.errors import InvalidMessageError, InvalidUTF8Error

    p = SummarizeTurns(lambda ms: "s", max_messages=4, keep_recent=1)
    with pytest.raises(InvalidUTF8Error, match="message 1"):
        p.apply([{"role": "user", "content": "a"}, {"role": "tool", "content": "x\ud800"}])
    with pytest.raises(InvalidMessageError, match=r"messages\[0\] has a key that is not a str"):
        p.apply([{"role": "user", "content": "a", 1: "b"}])
    for kwargs, field in (({"max_memo": "4"}, "max_memo"), ({"max_memo": -1}, "max_memo"),
                          ({"role": None}, "role"), ({"tool_roles": "tool"}, "tool_roles")):
        with pytest.raises(ConfigError, match=field):
            SummarizeTurns(lambda ms: "s", **kwargs)


def test_a_failed_call_drops_only_an_assistant_turn_with_nothing_else_to_say():
    """Content the renderer takes as text (a list of strings, parts in a tuple) or an
    image part read as "no content": the assistant turn was dropped with its call."""
    tail = [
        {"role": "tool", "tool_call_id": "a", "content": "Error: timeout"},
        {"role": "assistant", "content": "retrying", "tool_calls": [call("b", "search")]},
        {"role": "tool", "tool_call_id": "b", "content": "ok"},
    ]
    for content in (["Let me look."], ({"type": "text", "text": "Let me look."},),
                    [{"type": "text", "text": "A chart:"}, {"type": "image_url", "image_url": {"url": "data:,"}}]):
        msgs = [{"role": "user", "content": "find"},
                {"role": "assistant", "content": content, "tool_calls": [call("a", "search")]}, *tail]
        r = DropFailedCalls().apply(msgs)
        assert r.messages[1] == {"role": "assistant", "content": content}  # the call went, the words stay
    empty = [{"role": "user", "content": "find"}, {"role": "assistant", "content": [], "tool_calls": [call("a", "search")]}, *tail]
    assert len(DropFailedCalls().apply(empty).messages) == 3


def test_a_json_output_is_failed_only_when_its_error_is_set():
    assert not is_error_output({"role": "tool", "content": '{"error": null, "content": "def a(): return 1"}'})
    assert not is_error_output({"role": "tool", "content": '{"error": "", "rows": 3}'})
    assert is_error_output({"role": "tool", "content": '{"error": "No such file: a.py"}'})


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda: TruncateToolOutputs(marker="{n[0]}"), r"marker '\{n\[0\]\}' is not a format string"),  # TypeError escaped
        (lambda: TruncateToolOutputs(marker="{n.x}"), r"marker '\{n\.x\}' is not a format string"),  # AttributeError
        (lambda: SummarizeTurns(lambda ms: "s", template="{summary:d}", max_messages=4, keep_recent=1),
         r"template '\{summary:d\}' is not a format string"),  # failed per step
        (lambda: TruncateToolOutputs(max_lines=True), "max_lines must be a positive int, got True"),  # a bool read as 1
        (lambda: TruncateToolOutputs(keep_recent=True), "keep_recent must be a non-negative int, got True"),
        (lambda: TruncateToolOutputs(keep_lines=False), r"keep_lines must be an int in \[0, .*got False"),
        (lambda: SummarizeTurns(lambda ms: "s", max_messages=4, keep_recent=False),
         "keep_recent must be a non-negative int, got False"),
        (lambda: SummarizeTurns(lambda ms: "s", max_messages=4, keep_recent=1, keep_head=True),
         "keep_head must be a non-negative int or None, got True"),
    ],
)
def test_policy_options_of_the_wrong_type_are_config_errors(build, says):
    with pytest.raises(ConfigError, match=says):
        build()


def test_an_is_error_answer_that_is_not_a_bool_is_refused():
    """``is_error`` returning "no" was read as True: the call was dropped."""
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "oops"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "ok"},
    ]
    with pytest.raises(ConfigError, match="is_error must return True or False"):
        DropFailedCalls(is_error=lambda m: "no").apply(msgs)
    import re  # a match object or None is read by its truth value, as before

    kept = DropFailedCalls(is_error=lambda m: re.search("oops", m["content"])).apply(msgs).messages
    assert [m.get("tool_call_id") for m in kept if m["role"] == "tool"] == ["b"]
    with pytest.raises(InputError, match="truncate takes"):
        TruncateToolOutputs().truncate(None)  # type: ignore[arg-type]


@pytest.mark.reliability
def test_a_shared_summarizer_policy_summarizes_a_stretch_once_for_concurrent_callers():
    """Threads applying one ``SummarizeTurns`` to the same long list each called the
    summarizer (an LLM call) and the last one's text stayed: 8 calls, 8 summaries, and
    sessions that had seen another version met an edit at their next step."""
    import itertools
    import threading
    import time

    from promptsplice.assembler import SummarizeTurns

    made = itertools.count(1)

    def summarize(stretch):
        n = next(made)
        time.sleep(0.05)  # an LLM call
        return f"summary version {n}"

    pol = SummarizeTurns(summarize, max_messages=8, keep_recent=3)
    msgs = [{"role": "system", "content": "sys"}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20)
    ]
    start, seen = threading.Barrier(8), []

    def go():
        start.wait()
        seen.append(pol.apply(msgs).messages[1]["content"])

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert next(made) == 2  # one call
    assert len(set(seen)) == 1 and "summary version 1" in seen[0]
    assert pol.apply(msgs).messages[1]["content"] == seen[0]


def test_a_failed_summary_lets_the_next_caller_make_it():
    from promptsplice.assembler import SummarizeTurns

    calls = []

    def flaky(stretch):
        calls.append(len(stretch))
        if len(calls) == 1:
            raise RuntimeError("LLM down")
        return "the summary"

    pol = SummarizeTurns(flaky, max_messages=8, keep_recent=3)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20)]
    with pytest.raises(RuntimeError, match="LLM down"):
        pol.apply(msgs)
    assert "the summary" in pol.apply(msgs).messages[0]["content"] and len(calls) == 2


def test_a_summarizer_that_reenters_the_policy_for_its_own_stretch_is_an_error():
    """A summarizer whose own LLM call went through the same policy waited for itself:
    every caller of that stretch hung."""
    from promptsplice.assembler import SummarizeTurns

    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20)]

    def summarize(stretch):
        return pol.apply(msgs).messages[0]["content"]  # the LLM call, through the same policy

    pol = SummarizeTurns(summarize, max_messages=8, keep_recent=3)
    with pytest.raises(InputError, match="re-entered the policy"):
        pol.apply(msgs)
    pol.summarize = lambda stretch: "the summary"  # nothing left pending: the next caller makes it
    assert "the summary" in pol.apply(msgs).messages[0]["content"]


def test_a_summary_template_without_its_summary_field_is_refused():
    # "Earlier turns omitted." dropped every summary silently (the summary message said only that)
    summarize = lambda ms: "SUMMARY"  # noqa: E731
    for bad in ("Earlier turns omitted.", "{{summary}}"):
        with pytest.raises(ConfigError, match=r"must hold \{summary\}"):
            SummarizeTurns(summarize, template=bad, max_messages=4, keep_recent=1)
        with pytest.raises(ConfigError, match=r"must hold \{summary\}"):
            summarize_turns(FAILED_SESSION, 1, 6, summarize, template=bad)
    pol = SummarizeTurns(summarize, template="Before: {summary}", max_messages=4, keep_recent=1)
    msgs = [{"role": "system", "content": "s"}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(8)
    ]
    assert pol.apply(msgs).messages[1]["content"] == "Before: SUMMARY"


@pytest.mark.parametrize(
    "bad_call_id, bad_output_id",
    [("1", ["1"]), (["1"], "1"), ({"id": 1}, "1"), (1, "1"), ("1", 1)],
)
def test_drop_failed_calls_refuses_call_ids_that_are_not_str(bad_call_id, bad_output_id):
    # an unhashable id raised a raw TypeError; an int one matched nothing and dropped nothing
    msgs = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call(bad_call_id, "f")]},
        {"role": "tool", "tool_call_id": bad_output_id, "content": "Error: x"},
        {"role": "assistant", "content": "", "tool_calls": [call("2", "f")]},
        {"role": "tool", "tool_call_id": "2", "content": "ok"},
    ]
    with pytest.raises(InvalidMessageError, match=r"messages\[[12]\]\[.*(tool_call_id|id)'\] must be a str or None"):
        DropFailedCalls().apply(msgs)


def test_a_call_id_repeated_in_one_message_pairs_its_outputs_in_order():
    """Outputs were keyed by id in a dict: the last output with the id won, so the
    first call (``f``, a success) took ``g``'s error and was dropped with it, leaving
    ``g`` answered by ``f``'s output although ``g`` was never retried."""
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "f"), call("c1", "g")]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok from f"},
        {"role": "tool", "tool_call_id": "c1", "content": "Error: g failed"},
        {"role": "assistant", "content": None, "tool_calls": [call("c2", "f")]},
        {"role": "tool", "tool_call_id": "c2", "content": "ok again"},
    ]
    res = DropFailedCalls().apply(msgs)
    assert res.edits == ()  # f's call succeeded; g failed but was never retried
    assert res.messages == [dict(m) for m in msgs]
    msgs[4]["tool_calls"] = [call("c2", "g")]  # now g is retried: g's call and its error go
    res = DropFailedCalls().apply(msgs)
    assert res.messages[1]["tool_calls"] == [call("c1", "f")]
    assert [m["content"] for m in res.messages if m["role"] == "tool"] == ["ok from f", "ok again"]


def test_summary_settings_that_could_never_fit_max_messages_are_refused():
    """``keep_head=5, keep_recent=10, max_messages=12``: 13-16 messages came back
    unchanged and 30 came back as 16, over the maximum."""
    with pytest.raises(ConfigError, match=r"keep_head \+ 1 \+ keep_recent = 16"):
        SummarizeTurns(lambda ms: "s", max_messages=12, keep_recent=10, keep_head=5)
    p = SummarizeTurns(lambda ms: "s", max_messages=16, keep_recent=10, keep_head=5)
    msgs = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(30)]
    assert len(p.apply(msgs).messages) == 16


def test_the_summary_function_checks_its_options_like_the_policy():
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    for role in (123, ""):
        with pytest.raises(ConfigError, match="role"):
            summarize_turns(msgs, 0, 2, lambda ms: "s", role=role)
    with pytest.raises(ConfigError, match="summarize must be a callable"):
        summarize_turns(msgs, 0, 2, "not callable")
    with pytest.raises(InputError, match="is_error_output takes a tool message"):
        is_error_output("Error: x")


def test_a_summary_keeps_a_leading_developer_message_as_it_keeps_a_system_one():
    """OpenAI's ``developer`` role is the instructions' role too: a summary swallowed it
    (only a leading ``system`` message counted as the head)."""
    for role in ("system", "developer"):
        msgs = [{"role": role, "content": "Be terse."}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(8)]
        res = SummarizeTurns(lambda ms: "s", max_messages=5, keep_recent=2).apply(msgs)
        assert res.messages[0] == {"role": role, "content": "Be terse."}
        assert res.edits[0].old == (1, 7) and len(res.messages) == 4


def test_a_failed_legacy_function_call_is_dropped_once_retried():
    """An assistant's legacy ``function_call`` (and its ``function`` output) was never
    paired: its failure stayed in the context for good."""
    call = {"name": "weather", "arguments": '{"city": "Paris"}'}
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "function_call": call},
            {"role": "function", "name": "weather", "content": "Error: timeout"},
            {"role": "assistant", "content": "Retrying.", "function_call": call},
            {"role": "function", "name": "weather", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."}]
    res = DropFailedCalls().apply(msgs)
    assert res.messages == [msgs[0], msgs[3], msgs[4], msgs[5]]
    assert res.edits == (MessageEdit(EditKind.DROP, (1, 3), (1, 1)),)
    # a call with text of its own keeps the text
    said = [msgs[0], {**msgs[1], "content": "Checking."}, *msgs[2:]]
    res = DropFailedCalls().apply(said)
    assert res.messages[1] == {"role": "assistant", "content": "Checking."} and len(res.messages) == 5
    # the retried call succeeded: nothing to drop
    assert DropFailedCalls().apply(msgs[:2] + [{**msgs[2], "content": "rain"}] + msgs[3:]).edits == ()


def test_a_summary_keeps_a_mid_session_instruction_as_it_is(default_tok):
    """A developer (or system) message given mid-session was summarized away with the
    turns around it: its instruction was lost to the summarizer's wording, and where
    vLLM merges it into the system message in front, the summary edited the front."""
    from promptsplice.assembler import ChatRenderer

    seen = []
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "q0"},
            {"role": "assistant", "content": "a0"}, {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    res = SummarizeTurns(lambda ms: seen.append(ms) or "s", max_messages=5, keep_recent=2).apply(msgs)
    assert [m["role"] for m in seen[0]] == ["user", "assistant", "user", "assistant"]  # no instruction
    assert res.messages[2] == msgs[3] and res.messages[3:] == msgs[6:]
    assert res.edits == (MessageEdit(EditKind.SUMMARIZE, (1, 6), (1, 3)),)
    r = ChatRenderer(default_tok, block_size=16)
    before, after = r.render(msgs), r.render(res.messages)
    assert before.segments[0].text == after.segments[0].text  # the merged front is untouched
    # a stretch of instructions alone is not summarized
    only = [msgs[0], {"role": "developer", "content": "x"}, {"role": "system", "content": "y"}, *msgs[4:]]
    assert SummarizeTurns(lambda ms: "s", max_messages=6, keep_recent=4).apply(only).edits == ()


# -- a review's findings (2026-12-08) ---------------------------------------------------

GOOGLE_ERROR = (
    '{\n  "error": {\n    "code": 404,\n    "message": "File not found: 1AbC",\n    "errors": [\n'
    '      {\n        "message": "File not found: 1AbC",\n        "domain": "global",\n'
    '        "reason": "notFound",\n        "location": "fileId",\n        "locationType": "parameter"\n'
    '      }\n    ],\n    "status": "NOT_FOUND"\n  }\n}'
)


@pytest.mark.parametrize("order", ["truncate_first", "drop_first"])
def test_a_long_json_error_is_dropped_whichever_policy_runs_first(default_tok, order):
    """The README ran TruncateToolOutputs before DropFailedCalls: a 16-line JSON error
    body came out cut in the middle, no longer JSON, and read as a success, so the
    failed call stayed in the context for good."""
    from promptsplice.assembler import ContextHook

    assert GOOGLE_ERROR.count("\n") + 1 == 16 and is_error_output({"role": "tool", "content": GOOGLE_ERROR})
    cut = TruncateToolOutputs().truncate(GOOGLE_ERROR)
    assert "lines truncated" in cut and is_error_output({"role": "tool", "content": cut})
    msgs = [
        {"role": "user", "content": "Open the design doc."},
        {"role": "assistant", "tool_calls": [call("a", "drive_get")]},
        {"role": "tool", "tool_call_id": "a", "content": GOOGLE_ERROR},
        {"role": "assistant", "tool_calls": [call("b", "drive_get")]},
        {"role": "tool", "tool_call_id": "b", "content": "Design doc v2"},
    ]
    policies = [TruncateToolOutputs(), DropFailedCalls()]
    ctx = ContextHook(default_tok, block_size=16, policies=policies if order == "truncate_first" else policies[::-1])("s", msgs)
    assert ctx.messages == [msgs[0], msgs[3], msgs[4]]


@pytest.mark.parametrize("head, failed", [
    ('{"error": {"code": 4', True), ('{ "error" : "bad', True), ('{"error": null, "x', False),
    ('{"error": false, "x', False), ('{"error": {}, "x', False), ('{"result": 1, "error": {"a', False),
])
def test_a_json_body_cut_short_is_failed_by_its_first_key(head, failed):
    assert is_error_output({"role": "tool", "content": head + "\n[... 9 lines truncated ...]\n}"}) is failed


def test_a_summary_made_for_a_longer_list_is_not_applied_to_one_that_fits():
    """A shared SummarizeTurns applied a remembered stretch to a list of max_messages or
    fewer (another session's shorter list): its turns went into a summary it never
    needed, a summary made for someone else's conversation."""
    seen = []

    def summarize(ms):
        seen.append(len(ms))
        return "SUMMARY"

    p = SummarizeTurns(summarize, max_messages=12, keep_recent=4)
    base = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the repo."}]
    for k in range(1, 6):
        base += [{"role": "assistant", "tool_calls": [call(f"c{k}", "ls")]},
                 {"role": "tool", "tool_call_id": f"c{k}", "content": f"out {k}"}]
    longer = base + [{"role": "assistant", "content": "Done."}]  # 13 > 12
    assert [e.old for e in p.apply(longer).edits] == [(1, 8)] and seen == [7]
    fits = p.apply(base)  # 12: nothing to summarize
    assert fits.messages == base and fits.edits == ()
    assert [e.old for e in p.apply(longer + [{"role": "user", "content": "more"}]).edits] == [(1, 8)]
    assert seen == [7]  # the same session grown: its summary is reused, not made again


def test_tool_outputs_in_a_tuple_of_parts_are_read_like_a_list():
    """Content as a tuple of text parts rendered as text, but the policies read it as
    non-text: never truncated, and an error in it never seen."""
    long = tuple({"type": "text", "text": line} for line in lines(40).split("\n"))
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [call("a", "ls")]},
            {"role": "tool", "tool_call_id": "a", "content": long},
            {"role": "assistant", "tool_calls": [call("b", "ls")]},
            {"role": "tool", "tool_call_id": "b", "content": "ok"}]
    res = TruncateToolOutputs().apply(msgs)
    assert [e.old for e in res.edits] == [(2, 3)] and "32 lines truncated" in res.messages[2]["content"]
    failed = ({"type": "text", "text": "Error: no such file"},)
    assert is_error_output({"role": "tool", "content": failed})
    msgs[2] = {"role": "tool", "tool_call_id": "a", "content": failed}
    assert DropFailedCalls().apply(msgs).messages == [msgs[0], msgs[3], msgs[4]]


def test_a_summary_that_is_not_valid_unicode_is_refused_and_asked_again():
    """A summary with a lone surrogate was remembered: every later step failed on it in
    the renderer (naming "message 0", the policy's own message) and summarize() was
    never asked again."""
    from promptsplice.errors import InvalidUTF8Error

    calls = []

    def summarize(ms):
        calls.append(1)
        return "partial \ud83d" if len(calls) == 1 else "a good summary"

    p = SummarizeTurns(summarize, max_messages=4, keep_recent=2)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(6)]
    with pytest.raises(InvalidUTF8Error, match="the text summarize\\(\\) returned contains a lone surrogate"):
        p.apply(msgs)
    assert "a good summary" in p.apply(msgs).messages[0]["content"] and len(calls) == 2
    with pytest.raises(InvalidUTF8Error, match="summarize\\(\\) returned"):
        summarize_turns(msgs, 0, 4, lambda ms: "\udc80")
