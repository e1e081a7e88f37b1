"""Tests of the agent trace format, its strict reader, the step labels and the BFCL-based
generator."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptsplice.assembler import ContextHook, TruncateToolOutputs, is_error_output
from promptsplice.benchmarks.agent_traces import (
    MASK_PLACEHOLDER,
    STEP_KINDS,
    AgentSession,
    classify_step,
    edit_depth,
    iter_agent_trace,
    read_agent_trace,
    trace_summary,
    write_agent_trace,
)
from promptsplice.benchmarks.agent_traces_bfcl import _bfcl_tasks, _Env, generate_agent_trace
from promptsplice.errors import TraceFormatError

SAMPLE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "agent-sample.jsonl"

SYS = {"role": "system", "content": "You help."}
USER = {"role": "user", "content": "List the files."}


def _call(cid: str, name: str = "ls", args: str = "{}") -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]}


def _out(cid: str, text: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": text}


@pytest.fixture(scope="module")
def sessions() -> list[AgentSession]:
    return generate_agent_trace(24, seed=0)


# --------------------------------------------------------------------------- format


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@st.composite
def _sessions(draw: st.DrawFn) -> list[AgentSession]:
    out = []
    for n in range(draw(st.integers(1, 3))):
        renders = []
        for _ in range(draw(st.integers(1, 3))):
            msgs = [{"role": "system", "content": draw(_text)}, {"role": "user", "content": draw(_text)}]
            for k in range(draw(st.integers(0, 2))):
                cid = f"c{k}"
                args = json.dumps({"x": draw(_text)})
                msgs += [_call(cid, draw(st.sampled_from(["ls", "cd"])), args), _out(cid, draw(_text))]
            renders.append(msgs)
        tools = [{"type": "function", "function": {"name": "ls", "description": draw(_text),
                                                   "parameters": {"type": "object", "properties": {}}}}]
        out.append(AgentSession(f"s{n}-{draw(_text)}", tools, renders))
    return out


@settings(max_examples=40, deadline=None)
@given(_sessions())
def test_write_read_round_trip(tmp_path_factory: pytest.TempPathFactory, sessions_in: list[AgentSession]) -> None:
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    assert write_agent_trace(path, sessions_in) == len(sessions_in)
    assert read_agent_trace(path) == sessions_in


def _line(**over: object) -> str:
    obj = {"id": "s1", "tools": [], "renders": [[SYS, USER]]}
    obj.update(over)
    return json.dumps(obj)


BAD = [
    ("{not json", r":3: line: not JSON"),
    ("[1, 2]", r":3: line: expected a JSON object"),
    (json.dumps({"id": "s1", "tools": []}), r":3: renders: missing key 'renders'"),
    (_line(id=7), r":3: id: expected a string, got integer"),
    (_line(tools={}), r":3: tools: expected an array"),
    (_line(tools=[{"type": "function", "function": {}}]), r":3: tools\[0\]\.function\.name: expected a string"),
    (_line(renders=[]), r":3: renders: empty renders"),
    (_line(renders=[[]]), r":3: renders\[0\]: empty render"),
    (_line(renders=[[SYS, {"content": "hi"}]]), r":3: renders\[0\]\[1\]: message without 'role'"),
    (_line(renders=[[SYS, {"role": "robot", "content": "hi"}]]), r":3: renders\[0\]\[1\]\.role: unknown role 'robot'"),
    (_line(renders=[[SYS, {"role": "user", "content": 3}]]), r":3: renders\[0\]\[1\]\.content: expected a string"),
    (_line(renders=[[SYS, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]]),
     r":3: renders\[0\]\[1\]\.content\[0\]: not a text part"),
    (_line(renders=[[SYS, _out("c9", "x")]]), r":3: renders\[0\]\[1\]\.tool_call_id: 'c9' answers no tool call"),
    (_line(renders=[[SYS, _call("c1", args="{bad")]]), r":3: renders\[0\]\[1\]\.tool_calls\[0\]\.function\.arguments: not JSON"),
    # arguments as strict as a trace line (NaN, 1e999, a repeated key and a lone surrogate passed)
    (_line(renders=[[SYS, _call("c1", args='{"x": NaN}')]]), r":3: renders\[0\]\[1\]\.tool_calls\[0\]\.function\.arguments: not JSON text \(NaN is not valid JSON\)"),
    (_line(renders=[[SYS, _call("c1", args='{"x": 1e999}')]]), r":3: renders\[0\]\[1\]\.tool_calls\[0\]\.function\.arguments: not JSON text \(number 1e999 is out"),
    (_line(renders=[[SYS, _call("c1", args='{"a": 1, "a": 2}')]]), r":3: renders\[0\]\[1\]\.tool_calls\[0\]\.function\.arguments: not JSON text \(duplicate key 'a'\)"),
    (_line(renders=[[SYS, _call("c1", args='{"a": "\\ud800"}')]]), r":3: renders\[0\]\[1\]\.tool_calls\[0\]\.function\.arguments: lone surrogate at \['a'\]"),
    (_line(renders=[[SYS, _call("c1", name="")]]), r":3: renders\[0\]\[1\]\.tool_calls\[0\]\.function\.name: an empty name"),
    # what the hook refuses, refused at read time with the line (the bench raised it after
    # starting three engines, as the hook's InvalidMessageError and no FILE:LINE)
    (_line(renders=[[SYS, {**USER, "name": 3}]]), r":3: renders\[0\]\[1\]\.name: expected a string or null, got integer"),
    (_line(renders=[[SYS, {**USER, "tool_call_id": 7}]]), r":3: renders\[0\]\[1\]\.tool_call_id: expected a string or null"),
    (_line(renders=[[SYS, {"role": "assistant", "content": None, "function_call": "f()"}]]),
     r":3: renders\[0\]\[1\]\.function_call: expected an object"),
    (_line(renders=[[SYS, {**_call("c1"), "function_call": {"name": "f", "arguments": "{}"}}]]),
     r":3: renders\[0\]\[1\]\.function_call: both tool_calls and the legacy function_call"),
    (_line(renders=[[SYS, {**USER, "function_call": {"name": "f"}}]]),
     r":3: renders\[0\]\[1\]\.function_call: a function_call on a user message"),
    (_line(renders=[[SYS, _call(""), _call(""), _call("c1"), _out("c1", "a"), _call("c1"), _out("c1", "b")]]),
     r":3: renders\[0\]\[5\]\.tool_calls\[0\]\.id: call id 'c1' is used twice in this render"),  # "" ids: no identity
]


@pytest.mark.parametrize(("line", "match"), BAD)
def test_bad_lines_name_file_line_and_field(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_line(id="s0") + "\n\n" + line + "\n", encoding="utf-8")  # blank line 2 skipped
    with pytest.raises(TraceFormatError, match=str(path).replace(".", r"\.") + match):
        read_agent_trace(path)


def test_duplicate_ids_empty_file_and_invalid_utf8(tmp_path: Path) -> None:
    dup = tmp_path / "dup.jsonl"
    dup.write_text(_line() + "\n" + _line() + "\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r":2: id: duplicate session id 's1' \(first on line 1\)"):
        read_agent_trace(dup)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="no sessions"):
        read_agent_trace(empty)
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(_line().encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError, match=r":2: line: invalid UTF-8 at byte 0 of the line; write the trace as UTF-8"):
        list(iter_agent_trace(raw))


def test_a_bom_inside_the_file_and_a_bare_cr_say_what_to_fix(tmp_path: Path) -> None:
    """A BOM on line 2 said "decode using utf-8-sig" (advice for a programmer); a bare
    \\r gave no hint in the agent reader, where the RAG reader explains it."""
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(b"\xef\xbb\xbf" + _line(id="a").encode() + b"\n\xef\xbb\xbf" + _line(id="b").encode() + b"\n")
    with pytest.raises(TraceFormatError, match=r":2: line: a byte-order mark \(BOM\) starts this line, not the file"):
        read_agent_trace(joined)
    mac = tmp_path / "mac.jsonl"
    mac.write_bytes(_line(id="a").encode() + b"\r" + _line(id="b").encode() + b"\n")
    with pytest.raises(TraceFormatError, match=r"bare \\r: JSONL lines end in \\n"):
        read_agent_trace(mac)


def test_framework_forms_are_read_as_the_renderer_reads_them(tmp_path: Path) -> None:
    """Text parts, a developer message, object or empty arguments, calls and outputs
    without ids: what OpenAI-style harnesses send, which the hook renders."""
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}  # a bare string part too
    no_calls = {"role": "assistant", "content": None, "tool_calls": []}  # an empty call list, no text
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                           {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]}
    path = tmp_path / "forms.jsonl"
    render = [SYS, {"role": "developer", "content": "d"}, parts, call, {"role": "tool", "content": "out"}, _out("c2", "y"),
              no_calls]
    path.write_text(_line(renders=[render]) + "\n", encoding="utf-8")
    (s,) = read_agent_trace(path)
    msgs = s.renders[0]
    assert msgs[2]["content"] == "a\nb" and msgs[3]["content"] is None  # joined as vLLM joins them
    assert [c["function"]["arguments"] for c in msgs[3]["tool_calls"]] == ['{"x": 1}', ""]
    assert "tool_call_id" not in msgs[4] and msgs[1]["role"] == "developer"
    assert msgs[6]["content"] is None and msgs[6]["tool_calls"] == []
    ContextHook(block_size=32)("s", msgs)  # and the hook renders what the reader took


def test_a_legacy_function_call_is_read_as_the_call_the_hook_renders(tmp_path: Path) -> None:
    """The reader called ``function_call`` an ignored extra key, but the renderer renders
    it as the message's tool call: the reader now reads it so, and checks it."""
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": {"x": 1}}}
    path = tmp_path / "legacy.jsonl"
    path.write_text(_line(renders=[[SYS, USER, legacy]]) + "\n", encoding="utf-8")
    (s,) = read_agent_trace(path)
    msg = s.renders[0][2]
    assert "function_call" not in msg
    assert msg["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    hook = ContextHook(block_size=32)
    assert hook("a", s.renders[0]).token_ids == hook("b", [SYS, USER, legacy]).token_ids
    bare = {"role": "assistant", "content": None, "function_call": {"name": "f"}}  # no arguments: none
    path.write_text(_line(renders=[[SYS, USER, bare]]) + "\n", encoding="utf-8")
    (s,) = read_agent_trace(path)
    assert s.renders[0][2]["tool_calls"][0]["function"] == {"arguments": "", "name": "f"}
    assert hook("c", s.renders[0]).token_ids == hook("d", [SYS, USER, bare]).token_ids


def test_unknown_extra_keys_are_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "extra.jsonl"
    path.write_text(_line(meta={"harness": "x"}, renders=[[SYS, {**USER, "name": "alex"}]]) + "\n", encoding="utf-8")
    (s,) = read_agent_trace(path)
    assert s.id == "s1" and s.renders[0][1]["name"] == "alex"
    write_agent_trace(path, [s])
    assert set(json.loads(path.read_text(encoding="utf-8"))) == {"id", "tools", "renders"}


# --------------------------------------------------------------------------- step labels


def test_classify_step_synthetic_cases() -> None:
    long = "\n".join(f"line {i}" for i in range(30))
    base = [SYS, USER, _call("c1"), _out("c1", long), _call("c2", "cd"), _out("c2", "ok, moved into the folder")]
    grown = base + [_call("c3"), _out("c3", "x")]
    assert classify_step(None, base) == "first"
    assert classify_step(base, grown) == "append" and edit_depth(base, grown) == len(base)
    cut = TruncateToolOutputs(keep_recent=0).truncate(long)
    truncated = base[:3] + [_out("c1", cut)] + grown[4:]
    assert classify_step(base, truncated) == "truncate" and edit_depth(base, truncated) == 3
    masked = base[:3] + [_out("c1", MASK_PLACEHOLDER)] + grown[4:]
    assert classify_step(base, masked) == "mask"
    failed = [SYS, USER, _call("c1", "cd"), _out("c1", "Error: no such folder"), _call("c2", "cd"), _out("c2", "ok")]
    dropped = [SYS, USER, _call("c2", "cd"), _out("c2", "ok"), {"role": "assistant", "content": "Done."}]
    assert classify_step(failed, dropped) == "drop" and edit_depth(failed, dropped) == 2
    tail_drop = [SYS, USER, _call("c2", "cd"), _out("c2", "ok")]  # failed pair at the end replaced by the retry
    assert classify_step(failed[:4], tail_drop) == "drop"
    summary = {"role": "user", "content": "Summary of the earlier conversation:\n- ls() -> ..."}
    summarized = [SYS, summary, *grown[4:]]
    assert classify_step(grown, summarized) == "summarize" and edit_depth(grown, summarized) == 1
    rewritten = [SYS, {"role": "user", "content": "Something else."}, *base[2:]]
    assert classify_step(base, rewritten) == "other"


# --------------------------------------------------------------------------- generator


def test_generator_is_deterministic_per_seed(sessions: list[AgentSession]) -> None:
    again = generate_agent_trace(6, seed=0)
    assert again == sessions[:6]
    assert generate_agent_trace(6, seed=1) != again


def test_generated_sessions_are_valid_and_sized(tmp_path: Path, sessions: list[AgentSession]) -> None:
    path = tmp_path / "gen.jsonl"
    write_agent_trace(path, sessions)
    assert read_agent_trace(path) == sessions  # the strict reader accepts them (no dangling ids)
    for s in sessions:
        assert 6 <= len(s.renders) <= 30
        for r in s.renders:
            issued = set()
            for m in r:
                issued |= {c["id"] for c in m.get("tool_calls") or ()}
                if m["role"] == "tool":
                    assert m["tool_call_id"] in issued
            assert len(json.dumps([s.tools, r])) / 3.0 < 3500


def test_half_of_steps_are_edits_of_every_kind(sessions: list[AgentSession]) -> None:
    summary = trace_summary(sessions)
    assert summary["sessions"] == 24 and summary["steps"] == sum(summary["kinds"].values())
    assert summary["edit_share"] >= 0.5
    for kind in ("truncate", "drop", "mask", "summarize"):
        assert summary["kinds"][kind] > 0, kind
    assert set(summary["kinds"]) == set(STEP_KINDS)


def test_deep_edits_early_failure_dropped_late_and_first_half_summary(sessions: list[AgentSession]) -> None:
    late_drop = first_half_summary = False
    for s in sessions:
        first_output: dict[str, str] = {}  # call id -> its output when it first appeared (whole)
        for r in s.renders:
            if r[-1]["role"] == "tool":
                first_output.setdefault(r[-1]["tool_call_id"], r[-1]["content"])
        for prev, cur in zip(s.renders, s.renders[1:]):
            kind, depth = classify_step(prev, cur), edit_depth(prev, cur)
            if kind == "drop":
                kept = {m["tool_call_id"] for m in cur if m["role"] == "tool"}
                for i, m in enumerate(prev):
                    if m["role"] == "tool" and m["tool_call_id"] not in kept and i <= 5:
                        failed = is_error_output({"content": first_output[m["tool_call_id"]]})
                        later_turns = any(x["role"] == "user" for x in prev[i:])
                        late_drop |= failed and later_turns  # an early failed call, dropped turns later
            if kind == "summarize" and depth == 1:
                assert cur[1]["content"].startswith("Summary of the earlier conversation:")
                assert sum(m["role"] == "user" for m in prev[1:]) >= 2
                first_half_summary = True
    assert late_drop and first_half_summary


def test_tool_outputs_are_the_simulated_apis_answers(sessions: list[AgentSession]) -> None:
    task, truth = next(t for t in _bfcl_tasks() if t[0]["id"] == "multi_turn_base_1")
    assert truth[0] == ["ls(a=True)"]
    env = _Env(task, random.Random(0), enlarge=False)
    assert env.call("ls", {"a": True}) == '{\n  "current_directory_content": [\n    "workspace"\n  ]\n}'
    assert env.call("cd", {"folder": "nope"}) == '{\n  "error": "cd: \'nope\': No such file or directory"\n}'
    assert env.call("cd", {"dir": "x"}) == (
        "Error during execution: GorillaFileSystem.cd() got an unexpected keyword argument 'dir'")
    checked = 0
    for s in sessions:
        for r in s.renders:
            calls = {c["id"]: c["function"] for m in r for c in m.get("tool_calls") or ()}
            last = r[-1]
            if last["role"] == "tool" and calls[last["tool_call_id"]]["name"] == "cd":
                folder = json.loads(calls[last["tool_call_id"]]["arguments"]).get("folder")
                out = json.loads(last["content"])
                if "error" not in out:
                    assert out == {"current_working_directory": folder.rstrip("/").split("/")[-1]} or folder == ".."
                    checked += 1
    assert checked > 0


def test_committed_sample_is_valid_and_small() -> None:
    assert SAMPLE.stat().st_size < 300_000
    sample = read_agent_trace(SAMPLE)
    summary = trace_summary(sample)
    assert summary["edit_share"] >= 0.5
    assert all(summary["kinds"][k] > 0 for k in ("truncate", "drop", "mask", "summarize"))


def test_steps_are_labelled_by_what_is_rendered_as_the_hook_sees_them():
    """Messages compared as whole dicts: an earlier message that gained an ignored key,
    or a call whose arguments changed from JSON text to the same object, made the
    hook's append an "other" edit step (edit-step counts, TTFT and strata skewed); and
    a dropped tail of calls without ids was never "drop" (None matched every message)."""
    sys_, user = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}

    def call(cid, args):
        c = {"type": "function", "function": {"name": "cd", "arguments": args}}
        return {"role": "assistant", "content": None, "tool_calls": [c | ({"id": cid} if cid else {})]}

    def out(cid, text):
        return {"role": "tool", "content": text} | ({"tool_call_id": cid} if cid else {})

    first = [sys_, user, call("c1", '{"a":true, "b": 1}'), out("c1", "ok")]
    same = [{**sys_, "ts": 2}, user, call("c1", {"b": 1, "a": True}), out("c1", "ok"), {"role": "assistant", "content": "done"}]
    assert classify_step(first, same) == "append" and edit_depth(first, same) == 4
    empty = [sys_, user, call("c1", ""), out("c1", "ok")]
    assert classify_step(empty, [sys_, user, call("c1", {}), out("c1", "ok")]) == "append"
    for cid in ("c1", None):  # a failed call dropped from the tail, retried: with and without ids
        failed = [sys_, user, call(cid, '{"f": "fo"}'), out(cid, "Error: no such folder: fo")]
        retry = [sys_, user, call(cid and "c2", '{"f": "foo"}'), out(cid and "c2", "Moved into folder foo")]
        assert classify_step(failed, retry) == "drop", cid


def test_a_message_nested_deeper_than_the_hook_walks_is_refused_where_it_is_read(tmp_path):
    """An ignored key nested ~500 levels deep was read, then failed the hook after the
    engines had started (no file or line)."""
    deep = "x"
    for _ in range(150):
        deep = {"k": deep}
    line = {"id": "s", "tools": [], "renders": [[{"role": "system", "content": "s", "meta": deep}, {"role": "user", "content": "u"}]]}
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(TraceFormatError, match=r"deep.jsonl:1: .*renders\[0\]\[0\].*nested more than 100 levels"):
        read_agent_trace(path)
    line["renders"][0][0]["meta"] = {"k": {"k": "fine"}}
    path.write_text(json.dumps(line) + "\n")
    assert read_agent_trace(path)[0].renders[0][0]["meta"] == {"k": {"k": "fine"}}  # kept (ignored)


def test_the_bfcl_generator_gives_one_trace_whatever_the_hash_seed():
    """BFCL's error messages print sets (``Must be one of {...}``) in hash-seed order:
    ``gen-agent-trace --seed 4`` wrote 3 different files over 4 hash seeds (the bench's
    numbers changed with them).  Checked in processes of different hash seeds."""
    import os
    import subprocess
    import sys

    code = ("import hashlib, json; from promptsplice.benchmarks.agent_traces_bfcl import generate_agent_trace; "
            "print(hashlib.sha256(json.dumps([s.to_json() for s in generate_agent_trace(24, seed=4)]).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(h)},
                              capture_output=True, text=True, check=True).stdout for h in (1, 2, 4)}
    assert len(digests) == 1, digests


def test_the_writer_refuses_what_the_reader_would(tmp_path):
    """``write_agent_trace`` wrote ``Infinity``, duplicate ids and empty renders, which
    the reader then refused: it checks each session as the reader does now."""
    ok = read_agent_trace(SAMPLE)[0]
    path = tmp_path / "w.jsonl"
    inf_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "maximum": float("inf")}}}]
    for sessions, says in (
        ([ok, ok], "session 1: id: duplicate session id"),
        ([AgentSession("x", inf_tool, ok.renders)], "session 0: line: not JSON"),
        ([AgentSession("x", ok.tools, [])], "session 0: renders"),
    ):
        with pytest.raises(TraceFormatError, match=says):
            write_agent_trace(path, sessions)
    assert write_agent_trace(path, [ok]) == 1 and read_agent_trace(path)[0] == ok
