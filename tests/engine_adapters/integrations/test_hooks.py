"""Harness hooks on real frameworks and the real engine: LangChain ``create_agent``
middleware, LangGraph ``create_react_agent`` pre_model_hook, OpenAI Agents SDK input
filter (called with the SDK's own types; the SDK's Runner needs an OpenAI-compatible
server and is not run here)."""

from __future__ import annotations

import logging

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from promptsplice.assembler import ContextHook, DropFailedCalls, StepKind, SummarizeTurns, TruncateToolOutputs
from promptsplice.engine_adapters.integrations._hooks import (
    PromptspliceInputFilter,
    PromptsplicePreModelHook,
    chat_to_items,
    items_to_chat,
)
from promptsplice.engine_adapters.integrations._langchain_match import messages_from_openai
from promptsplice.engine_adapters.integrations._middleware import PromptspliceMiddleware
from promptsplice.engine_adapters.integrations._langchain_convert import lc_messages_to_openai
from promptsplice.errors import InputError
from promptsplice.engine_adapters.integrations._langchain_chat import PromptspliceChatModel

MARKER = "lines truncated ..."


class RecordingRunner:
    """A recorder around the real engine: keeps the prepared contexts, runs ``generate``."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    def step(self, prepared, *, max_tokens, temperature=0.0, stop=None):
        self.calls.append(prepared)
        c = self.engine.generate(list(prepared.token_ids), max_tokens=max_tokens, temperature=temperature, stop=stop)
        return type("Step", (), {"completion": c})()


def read_log() -> str:
    """Read the application log (returns 40 lines)."""
    return "\n".join(f"line {i}: status ok, app.log" for i in range(40))


def _force_tool_calls(n: int):
    """Test-only middleware: the first ``n`` model calls are forced to call ``read_log``
    (tool_choice names it: the model decodes after a fixed call prefix); later calls get
    ``tool_choice="none"`` so the loop ends.  Deterministic with greedy decoding."""
    from langchain.agents.middleware import AgentMiddleware

    class Force(AgentMiddleware):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def wrap_model_call(self, request, handler):
            self.calls += 1
            return handler(request.override(tool_choice="read_log" if self.calls <= n else "none"))

    return Force()


@pytest.mark.parametrize("keep_recent,calls", [(0, 2), (1, 3)])
def test_middleware_agent_loop_truncates_and_classifies(engine, keep_recent, calls):
    from langchain.agents import create_agent

    hook = ContextHook(engine.tokenizer, block_size=engine.block_size, policies=[TruncateToolOutputs(10, keep_recent=keep_recent)])
    mw = PromptspliceMiddleware(hook)
    runner = RecordingRunner(engine)
    model = PromptspliceChatModel(engine=engine, runner=runner, max_tokens=24)
    agent = create_agent(model=model, tools=[read_log], middleware=[_force_tool_calls(calls - 1), mw])
    sid = f"mw-loop-{keep_recent}"
    state = agent.invoke({"messages": [HumanMessage("Read the log app.log")]}, config={"configurable": {"thread_id": sid}})

    steps = mw.history
    assert len(steps) == calls and {p.session_id for p in steps} == {sid}
    assert [p.step for p in steps] == list(range(1, calls + 1))
    # the model sent exactly the prepared contexts (handed off, not re-rendered); a
    # forced call adds its fixed call prefix after the generation prompt
    assert [(p.session_id, p.step) for p in runner.calls] == [(p.session_id, p.step) for p in steps]
    assert all(r.token_ids[: len(p.token_ids)] == p.token_ids for r, p in zip(runner.calls, steps))
    tool_msgs = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert len(tool_msgs) == calls - 1 and all(m.content.count("\n") == 39 for m in tool_msgs)  # state keeps them whole
    sent = [engine.tokenizer.decode(p.token_ids) for p in runner.calls]
    assert steps[0].kind is StepKind.NEW_SESSION
    if keep_recent == 0:
        # the only output is truncated the first time the model sees it: new tokens only
        assert MARKER in sent[1] and "line 20:" not in sent[1]
        assert steps[1].policy_edits and steps[1].kind is StepKind.APPEND and not steps[1].directives[:-1]
    else:
        # call 2 sees output 1 whole; call 3 truncates it (an edit of earlier context)
        assert MARKER not in sent[1] and "line 20:" in sent[1] and steps[1].kind is StepKind.APPEND
        assert not steps[1].policy_edits
        assert MARKER in sent[2] and steps[2].policy_edits and steps[2].kind is StepKind.EDIT
        assert steps[2].first_changed_token < steps[1].render.body_end
    ai = [m for m in state["messages"] if isinstance(m, AIMessage)]
    assert [m.response_metadata["step"] for m in ai] == list(range(1, calls + 1))


def test_langgraph_pre_model_hook_edits_llm_input_only(engine):
    from langgraph.prebuilt import create_react_agent

    hook = ContextHook(engine.tokenizer, block_size=engine.block_size, policies=[TruncateToolOutputs(10, keep_recent=0)])
    pre = PromptsplicePreModelHook(hook, tools=[read_log])
    runner = RecordingRunner(engine)
    model = PromptspliceChatModel(engine=engine, runner=runner, max_tokens=8)
    graph = create_react_agent(model, [read_log], pre_model_hook=pre)
    history = [
        HumanMessage("Read the log app.log"),
        AIMessage("", tool_calls=[{"name": "read_log", "args": {}, "id": "c1", "type": "tool_call"}]),
        ToolMessage(read_log(), tool_call_id="c1", name="read_log"),
        HumanMessage("Summarize it."),
    ]
    out = graph.invoke({"messages": history}, config={"configurable": {"thread_id": "lg-pre"}})
    assert len(pre.history) == 1 and pre.history[0].policy_edits
    assert runner.calls and runner.calls[0] is pre.history[0]  # the model sent the hook's ids
    assert MARKER in engine.tokenizer.decode(runner.calls[0].token_ids)
    whole = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert whole[0].content == read_log()  # the state keeps the full output
    assert isinstance(out["messages"][-1], AIMessage)


def read_app_log() -> str:
    """Read the application log (returns 40 lines)."""
    return "\n".join(f"app {i}: request served in {10 + i % 7} ms, status ok" for i in range(40))


def read_db_log() -> str:
    """Read the database log (returns 40 lines)."""
    return "\n".join(f"db {i}: query plan cached, {3 + i % 5} rows, status ok" for i in range(40))


class CountingRunner:
    """The real ``AgentRunner``, with vLLM's own counters read around each step."""

    def __init__(self, runner):
        self.runner = runner
        self.steps = []

    def step(self, prepared, **kwargs):
        before = self.runner.engine.counters()
        step = self.runner.step(prepared, **kwargs)
        self.steps.append((prepared, step, self.runner.engine.counters().since(before)))
        return step


@pytest.fixture(scope="module")
def splice_engine(kv_engine, tmp_path_factory):
    """An engine with the splice connector that can relocate: the session's
    ``kv_engine`` where it can; on a CPU whose bf16 cache takes the AMX layout (which
    the connector refuses to rotate, unverified) one in float32, which takes the
    verified ``vec`` layout.  ``kv_engine`` is requested either way so this engine is
    never the last one alive."""
    if kv_engine.kv_connector.worker.can_relocate:
        yield kv_engine
        return
    from promptsplice.engine_adapters import StoreConfig
    from tests.conftest import start_default_engine

    mib = 1 << 20
    store = StoreConfig(dram_bytes=64 * mib, disk_bytes=256 * mib, disk_dir=str(tmp_path_factory.mktemp("lg-store")), fsync=False)
    eng = start_default_engine(dtype="float32", kv_store=store, kv_cache_bytes=256 * mib)
    assert eng.kv_connector.worker.can_relocate
    yield eng
    eng.close()


def test_langgraph_agent_loop_splices_through_the_agent_runner(splice_engine):
    """A LangGraph ReAct loop on the engine with the splice connector: the ten-line rule
    truncates the earlier log once a newer one arrives, and what followed it in the last
    render (the agent's answer, the user's next request) is relocated, not prefilled."""
    from langgraph.prebuilt import create_react_agent

    from promptsplice.engine_adapters import AgentRunner

    eng = splice_engine
    tools = [read_app_log, read_db_log]
    hook = ContextHook(eng.tokenizer, block_size=eng.block_size, policies=[TruncateToolOutputs(10, keep_recent=1)])
    pre = PromptsplicePreModelHook(hook, tools=tools)
    runner = CountingRunner(AgentRunner(eng, mode="splice", salt="lg-splice", fidelity="bounded"))
    model = PromptspliceChatModel(engine=eng, runner=runner, max_tokens=16)
    # Greedy SmolLM2-135M rarely calls tools unprompted: the first model call is forced
    # to read the database log, the next one may not call a tool, so the loop ends.
    choices = iter([model.bind_tools(tools, tool_choice="read_db_log")])
    answer = model.bind_tools(tools, tool_choice="none")
    graph = create_react_agent(lambda state, runtime: next(choices, answer), tools, pre_model_hook=pre)
    history = [
        HumanMessage("Read the application log."),
        AIMessage("", tool_calls=[{"name": "read_app_log", "args": {}, "id": "c1", "type": "tool_call"}]),
        ToolMessage(read_app_log(), tool_call_id="c1", name="read_app_log"),
        AIMessage("The application log has 40 lines; every request was served and every status is ok."),
        HumanMessage("Now read the database log, then compare it with the application log: do both "
                     "logs report only ok statuses, and which one shows slower operations? Answer in "
                     "one short sentence that names both logs."),
    ]
    out = graph.invoke({"messages": history}, config={"configurable": {"thread_id": "lg-splice"}})

    assert [p.kind for p in pre.history] == [StepKind.NEW_SESSION, StepKind.EDIT]
    assert [(p.session_id, p.step) for p, _, _ in runner.steps] == [(p.session_id, p.step) for p in pre.history]
    first, edit = runner.steps[0][1], runner.steps[1]
    assert first.relocated_tokens == 0
    prepared, step, counted = edit
    assert prepared is pre.history[1]  # no forcing prefix on this call: the very context the hook made
    assert prepared.policy_edits and MARKER in eng.tokenizer.decode(prepared.token_ids)
    assert step.fallback is None and step.requests >= 2 and step.salt != "lg-splice"  # spliced, scoped
    assert step.relocated_tokens > 0
    # cached_tokens is vLLM's num_cached_tokens (prefix cache + connector loads); relocated is a part of it
    assert step.prompt_tokens == step.prefill_tokens + step.cached_tokens
    assert 0 < step.relocated_tokens <= step.cached_tokens
    # vLLM's own counters: the relocated blocks (and the scope's prefix copy) were loaded
    # by the connector, and every computed token is one vLLM did not serve from a cache.
    assert counted.external_hits >= step.relocated_tokens > 0
    assert counted.prefix_cache_queries - counted.prefix_cache_hits - counted.external_hits == step.prefill_tokens
    assert step.prefill_tokens < step.prompt_tokens - prepared.first_changed_token  # less than apc would prefill
    # the graph ran its loop: model -> tool -> model, the state keeps both logs whole
    tool_msgs = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert [m.content for m in tool_msgs] == [read_app_log(), read_db_log()]
    assert isinstance(out["messages"][-1], AIMessage) and not out["messages"][-1].tool_calls
    # the step's usage, not its last request's (whose cache count includes what the
    # step's earlier requests computed: it read 352 where the step had 160 cached)
    last = out["messages"][-1]
    assert last.usage_metadata["input_token_details"]["cache_read"] == step.cached_tokens
    assert last.response_metadata["prefill_tokens"] == step.prefill_tokens
    assert last.response_metadata["requests"] == step.requests


def _sdk_items() -> list[Any]:
    return [
        {"role": "user", "content": "Read the log app.log"},
        {"type": "function_call", "call_id": "c1", "name": "read_log", "arguments": '{}'},
        {"type": "function_call_output", "call_id": "c1", "output": read_log()},
        {"role": "user", "content": "Summarize it."},
    ]


def test_openai_agents_input_filter(engine):
    from agents import Agent
    from agents.run_config import CallModelData, ModelInputData

    agent = Agent(name="reader", instructions="You read logs.")
    items = _sdk_items()
    # no policy applies: the very same items come back
    plain = PromptspliceInputFilter(ContextHook(engine.tokenizer, block_size=engine.block_size), session_id="sdk-plain")
    out = plain(CallModelData(model_data=ModelInputData(input=items, instructions="You read logs."), agent=agent, context=None))
    assert isinstance(out, ModelInputData)
    assert out.instructions == "You read logs." and len(out.input) == len(items)
    assert all(a is b for a, b in zip(out.input, items))
    assert plain.history[0].kind is StepKind.NEW_SESSION

    hook = ContextHook(engine.tokenizer, block_size=engine.block_size, policies=[TruncateToolOutputs(10, keep_recent=0)])
    filt = PromptspliceInputFilter(hook)
    data = CallModelData(model_data=ModelInputData(input=items, instructions="You read logs."), agent=agent, context={"session_id": "sdk-edit"})
    out = filt(data)
    assert [i.get("type", "message") for i in out.input] == ["message", "function_call", "function_call_output", "message"]
    assert MARKER in out.input[2]["output"] and out.input[2]["call_id"] == "c1"
    assert out.input[2]["output"].count("\n") == 8
    assert items[2]["output"] == read_log()  # the caller's items are not mutated
    assert out.input[0] is items[0] and out.input[1] is items[1] and out.input[3] is items[3]
    assert filt.history[0].session_id == "sdk-edit" and MARKER in filt.history[0].render.text


def test_a_message_that_converts_to_several_dicts_comes_back_whole_and_in_place():
    """A user message holding a tool_result block gives two chat dicts; the mapping back
    was by position, so every later message was shifted and the hook died on an
    IndexError (a raw error, not the library's)."""
    msgs = [
        HumanMessage("look it up", id="h1"),
        AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "t1", "type": "tool_call"}], id="a1"),
        HumanMessage(content=[{"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                              {"type": "text", "text": "and now?"}], id="h2"),
        AIMessage("final answer", id="a2"),
        HumanMessage("thanks", id="h3"),
    ]
    origins: list[int] = []
    dicts = lc_messages_to_openai(msgs, origins=origins)
    assert origins == [0, 1, 2, 2, 3, 4] and len(dicts) == 6
    hook = ContextHook("default", block_size=32)
    out = PromptsplicePreModelHook(hook, default_session="split")({"messages": msgs})["llm_input_messages"]
    assert [m.id for m in out] == ["h1", "a1", "h2", "a2", "h3"]
    assert out[2] is msgs[2]
    with pytest.raises(InputError, match="pass their origins"):
        messages_from_openai(dicts, msgs, dicts)


def test_tool_results_with_text_keep_anthropics_order_and_their_error_status_through_an_edit():
    """A user message of two ``tool_result`` blocks and a text: the conversion put the
    text first, between the calls and their results, and a policy edit of one result
    rebuilt the messages in that order (Anthropic refuses it); and the other result's
    ``is_error`` came back as ``status="success"``."""
    msgs = [
        HumanMessage("find it"),
        AIMessage("", tool_calls=[{"name": "read", "args": {}, "id": "t1", "type": "tool_call"},
                                  {"name": "read", "args": {}, "id": "t2", "type": "tool_call"}]),
        HumanMessage(content=[{"type": "tool_result", "tool_use_id": "t1", "content": "x" * 3000},
                              {"type": "tool_result", "tool_use_id": "t2", "content": "Error: boom", "is_error": True},
                              {"type": "text", "text": "Now summarise."}]),
    ]
    origins: list[int] = []
    dicts = lc_messages_to_openai(msgs, origins=origins)
    assert [(d["role"], d.get("tool_call_id"), d.get("status")) for d in dicts] == [
        ("user", None, None), ("assistant", None, None), ("tool", "t1", None), ("tool", "t2", "error"), ("user", None, None)]
    assert origins == [0, 1, 2, 2, 2]
    edited = [dict(d) for d in dicts]
    edited[2]["content"] = "x" * 100  # one result truncated: the message is rebuilt dict by dict
    out = messages_from_openai(edited, msgs, dicts, origins)
    assert [type(m).__name__ for m in out] == ["HumanMessage", "AIMessage", "ToolMessage", "ToolMessage", "HumanMessage"]
    assert [(m.tool_call_id, m.status) for m in out[2:4]] == [("t1", "success"), ("t2", "error")]
    assert out[4].content == "Now summarise."


@pytest.mark.reliability
def test_agents_sdk_items_rebuilt_after_an_edit_keep_each_output_with_its_own_call_where_ids_repeat():
    """A server that numbers calls per turn (``call_0`` every turn): after the failed-call
    policy dropped a turn, the rebuilt items paired the kept ``fetch`` call's output with
    the dropped, failed ``search(q=a)`` call (the first earlier turn whose ids included
    the kept one), and the ``fetch`` call was lost: the model was told a failed search
    returned the fetched page."""
    def fc(cid, name, args):
        return {"type": "function_call", "call_id": cid, "name": name, "arguments": args}

    def fo(cid, output):
        return {"type": "function_call_output", "call_id": cid, "output": output}

    items = [
        {"role": "user", "content": "go"},
        fc("call_0", "search", '{"q":"a"}'), fo("call_0", "Error: timeout"),
        fc("call_0", "fetch", '{"u":"x"}'), fc("call_1", "search", '{"q":"b"}'),
        fo("call_0", "page text"), fo("call_1", "Error: timeout"),
        fc("call_0", "search", '{"q":"c"}'), fo("call_0", "results c"),
    ]
    chat, prov = items_to_chat(items, None)
    edited = DropFailedCalls().apply(chat).messages
    out = chat_to_items(edited, chat, prov, items)
    assert out == [items[0], items[3], items[5], items[7], items[8]]
    assert out[1] is items[3] and out[2] is items[5]  # the originals, not copies


def test_an_edited_assistant_turn_keeps_the_calls_whose_outputs_stay():
    """DropFailedCalls removing one of a turn's two calls rebuilt the turn as a plain
    message: the surviving call's function_call item was lost and its output orphaned
    (OpenAI refuses such input: "No tool call found for function call output")."""
    items = [
        {"role": "user", "content": "weather in Paris and time in Tokyo"},
        {"type": "function_call", "call_id": "A", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "B", "name": "clock", "arguments": '{"city": "Tokyo"}'},
        {"type": "function_call_output", "call_id": "A", "output": "Error: timeout"},
        {"type": "function_call_output", "call_id": "B", "output": "09:00"},
        {"type": "function_call", "call_id": "C", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "C", "output": "sunny"},
    ]
    chat, prov = items_to_chat(items, None)
    prepared = ContextHook("default", block_size=32, policies=[DropFailedCalls()])("s", chat, None)
    assert prepared.policy_edits  # the failed call A was dropped
    out = chat_to_items(list(prepared.messages), chat, prov, items)
    assert out == [items[0], items[2], items[4], items[5], items[6]]
    assert out[1] is items[2]  # the original item objects come back


def _search_turn(call_id: str, output: str, n: int, **tool_kwargs):
    """One turn of an agent whose server numbers calls per turn: a ``search`` call and
    its output, each message with an id of its own (and the output an artifact)."""
    return [AIMessage("", tool_calls=[{"name": "search", "args": {}, "id": call_id, "type": "tool_call"}], id=f"a{n}"),
            ToolMessage(output, tool_call_id=call_id, id=f"t{n}", artifact={"n": n}, **tool_kwargs)]


def test_a_failed_output_under_a_repeated_call_id_drops_only_itself():
    """Servers that number calls per turn repeat ``call_0``: one output with
    ``status="error"`` marked every output of that id failed, and DropFailedCalls
    dropped the successful ones ("found: 42 results" was lost)."""
    msgs = [HumanMessage("go", id="h"), *_search_turn("call_0", "found: 42 results", 1),
            *_search_turn("call_0", "timeout", 2, status="error"), *_search_turn("call_0", "found: 7 results", 3)]
    assert [d.get("status") for d in lc_messages_to_openai(msgs)] == [None, None, None, None, "error", None, None]
    hook = PromptsplicePreModelHook(ContextHook("default", block_size=32, policies=[DropFailedCalls()]),
                                    default_session="repeated-ids")
    out = hook({"messages": msgs})["llm_input_messages"]
    assert [m.id for m in out] == ["h", "a1", "t1", "a3", "t3"]  # the failed turn dropped, its retry kept
    assert all(m is msgs[i] for m, i in zip(out, [0, 1, 2, 5, 6], strict=True))  # the messages themselves


def test_a_truncated_output_under_a_repeated_call_id_comes_back_as_its_own_message():
    """The edited dicts were mapped back by ``tool_call_id`` (the last message of each
    id won): a truncated output came back with another message's id, status and
    artifact, and rendered again, with another status than the one the hook rendered."""
    long = "\n".join(f"line {i}" for i in range(30))
    msgs = [HumanMessage("go", id="h"), *_search_turn("call_0", long, 1), *_search_turn("call_0", "timeout", 2, status="error"),
            *_search_turn("call_0", long + "\nmore", 3), HumanMessage("and now?", id="h2")]
    origins: list[int] = []
    dicts = lc_messages_to_openai(msgs, origins=origins)
    edited = TruncateToolOutputs(keep_recent=0).apply(dicts).messages
    out = messages_from_openai(edited, msgs, dicts, origins)
    assert [(m.id, getattr(m, "status", None), getattr(m, "artifact", None)) for m in out if isinstance(m, ToolMessage)] == [
        ("t1", "success", {"n": 1}), ("t2", "error", {"n": 2}), ("t3", "success", {"n": 3})]
    assert MARKER in out[2].content and MARKER in out[6].content
    assert all(out[i] is msgs[i] for i in (0, 1, 3, 4, 5, 7))  # equal assistant turns, each its own
    assert lc_messages_to_openai(out) == edited  # what the model renders is what the hook rendered
    # and with the failed turn dropped too (an assistant turn then equals a dropped one)
    edited = DropFailedCalls().apply(edited).messages
    out = messages_from_openai(edited, msgs, dicts, origins)
    assert [m.id for m in out] == ["h", "a1", "t1", "a3", "t3", "h2"] and out[3] is msgs[5]
    assert lc_messages_to_openai(out) == edited


def test_the_middleware_gives_each_output_of_a_repeated_call_id_back_as_its_own(default_tok):
    """The same through ``create_agent``'s middleware: behind a system message, the
    truncated first output came back as the last one (its id, status and artifact), or
    with the failure's status dropped altogether."""
    from types import SimpleNamespace

    long = "\n".join(f"line {i}" for i in range(30))
    msgs = [HumanMessage("go", id="h"), *_search_turn("call_0", long, 1), *_search_turn("call_0", "timeout", 2, status="error"),
            *_search_turn("call_0", "found: 7 results", 3)]
    mw = PromptspliceMiddleware(ContextHook(default_tok, block_size=16, policies=[TruncateToolOutputs(), DropFailedCalls()]),
                                default_session="mw-repeated-ids")
    request = SimpleNamespace(messages=msgs, system_message=SystemMessage("Be brief."), tools=[], response_format=None,
                              model=object(), override=lambda **kw: SimpleNamespace(**{**vars(request), **kw}))
    new, prepared = mw._prepare(request)
    assert [(m.id, getattr(m, "status", None), getattr(m, "artifact", None)) for m in new.messages] == [
        ("h", None, None), ("a1", None, None), ("t1", "success", {"n": 1}), ("a3", None, None), ("t3", "success", {"n": 3})]
    assert MARKER in new.messages[2].content and new.messages[3] is msgs[5] and new.messages[4] is msgs[6]
    assert lc_messages_to_openai([new.system_message, *new.messages]) == prepared.messages


def _sources(n: int, edits) -> list[int | None]:
    """Which input message each output message of a policy is (``None``: a new one, or
    one of several inputs an edit merged), from its edits."""
    out: list[int | None] = []
    at = 0
    for e in sorted(edits, key=lambda e: e.old[0]):
        out.extend(range(at, e.old[0]))
        (a, b), (c, d) = e.old, e.new
        out.extend(range(a, b) if b - a == d - c else [None] * (d - c))
        at = b
    return out + list(range(at, n))


_OUTPUTS = ["found: 1", "found: 2", "timeout", "Error: boom",
            "\n".join(f"line {i} of a long output" for i in range(15)),
            "\n".join(f"line {i} of another long output" for i in range(15))]  # fmt: skip


@st.composite
def _agent_histories(draw):
    """Agent histories whose call ids repeat (``call_0`` every turn, or twice in one
    turn), with equal outputs, failures by ``status`` or by text, final answers and user
    turns; every message has an id of its own."""
    msgs = [HumanMessage("go", id="h0")]
    for t in range(draw(st.integers(1, 7))):
        ids = draw(st.lists(st.sampled_from(["call_0", "call_1", f"u{t}"]), min_size=1, max_size=3))
        calls = [{"name": draw(st.sampled_from(["search", "fetch"])), "args": draw(st.sampled_from([{}, {"q": 1}])),
                  "id": i, "type": "tool_call"} for i in ids]  # fmt: skip
        msgs.append(AIMessage(draw(st.sampled_from(["", "Let me look."])), tool_calls=calls, id=f"a{t}"))
        for k, i in enumerate(ids):
            out = draw(st.sampled_from(_OUTPUTS))
            status = "error" if out == "timeout" else "success"
            msgs.append(ToolMessage(out, tool_call_id=i, status=status, id=f"t{t}.{k}", artifact=(t, k)))
        if draw(st.booleans()):
            msgs.append(draw(st.sampled_from([AIMessage("done", id=f"f{t}"), HumanMessage("again", id=f"h{t + 1}")])))
    policies = draw(st.permutations([TruncateToolOutputs(keep_recent=draw(st.integers(0, 2))), DropFailedCalls(),
                                     SummarizeTurns(lambda ms: f"{len(ms)} messages", max_messages=8, keep_recent=4)]))
    return msgs, policies[: draw(st.integers(1, 3))]


@settings(max_examples=300, deadline=None)
@given(_agent_histories())
def test_property_every_edited_message_comes_back_as_its_own_original(case):
    """Whatever the policies drop, truncate or summarize in a history whose call ids and
    outputs repeat, each message that comes back is its own original (an unchanged
    one the very object, an edited output a copy with its own id, status and artifact),
    and the model's render of them is the hook's."""
    msgs, policies = case
    origins: list[int] = []
    dicts = lc_messages_to_openai(msgs, origins=origins)
    edited, src = dicts, list(range(len(dicts)))
    for p in policies:
        res = p.apply(edited)
        src = [None if s is None else src[s] for s in _sources(len(edited), res.edits)]
        edited = res.messages
    out = messages_from_openai(edited, msgs, dicts, origins)
    assert lc_messages_to_openai(out) == edited
    for m, d, s in zip(out, edited, src, strict=True):
        if s is None:
            continue
        own = msgs[origins[s]]
        if d == dicts[s]:
            assert m is own, (m.id, own.id)
        elif d["role"] == "tool":
            assert (m.id, m.status, m.artifact, m.content) == (own.id, own.status, own.artifact, d["content"])


def test_middleware_hands_off_under_a_session_key_of_another_name(engine):
    """The middleware filed the prepared context under ``config[session_key]`` while the
    model looked it up under ``thread_id``: with ``session_key="conv"`` the hand-off
    never happened and the model rendered again, outside the hook's session."""
    from langchain.agents import create_agent

    hook = ContextHook(engine.tokenizer, block_size=engine.block_size)
    mw = PromptspliceMiddleware(hook, session_key="conv")
    runner = RecordingRunner(engine)
    model = PromptspliceChatModel(engine=engine, runner=runner, max_tokens=8)
    agent = create_agent(model=model, tools=[read_log], middleware=[_force_tool_calls(1), mw])
    agent.invoke({"messages": [HumanMessage("Read the log app.log")]}, config={"configurable": {"conv": "conv-1"}})
    assert [(p.session_id, p.step) for p in runner.calls] == [(p.session_id, p.step) for p in mw.history]
    assert [p.session_id for p in runner.calls] == ["conv-1", "conv-1"]


def test_middleware_hands_off_with_a_structured_response_format(engine, caplog):
    """``create_agent(..., response_format=Schema)`` binds the schema's tool after the
    middleware ran: the hook rendered without it, the hand-off missed on every step and
    the model rendered anew as a new session (never spliced)."""
    from langchain.agents import create_agent
    from pydantic import BaseModel

    class Answer(BaseModel):
        """The final answer."""

        text: str

    hook = ContextHook(engine.tokenizer, block_size=engine.block_size)
    mw = PromptspliceMiddleware(hook)
    runner = RecordingRunner(engine)
    model = PromptspliceChatModel(engine=engine, runner=runner, max_tokens=24)
    agent = create_agent(model=model, tools=[read_log], middleware=[mw], response_format=Answer)
    with caplog.at_level(logging.WARNING, logger="promptsplice"):
        agent.invoke({"messages": [HumanMessage("Say hello.")]}, config={"configurable": {"thread_id": "rf-1"}})
    assert not [r for r in caplog.records if "does not match" in r.getMessage()]
    # the hook's contexts (with the forced call's prefix after them: tool_choice "any")
    assert runner.calls and len(runner.calls) == len(mw.history)
    for sent, made in zip(runner.calls, mw.history):
        assert (sent.session_id, sent.step) == (made.session_id, made.step)
        assert sent.token_ids[: len(made.token_ids)] == made.token_ids
    assert '"Answer"' in engine.tokenizer.decode(mw.history[0].token_ids)  # the schema's tool, rendered by the hook


def test_the_langgraph_hook_and_the_model_share_a_session_key_of_another_name(engine):
    """Behind ``PromptsplicePreModelHook(session_key="conv")`` the model looked its
    prepared context up under ``thread_id``: never found (rendered again, session '')."""
    from langgraph.prebuilt import create_react_agent

    hook = ContextHook(engine.tokenizer, block_size=engine.block_size, policies=[TruncateToolOutputs(10, keep_recent=0)])
    pre = PromptsplicePreModelHook(hook, tools=[read_log], session_key="conv")
    runner = RecordingRunner(engine)
    model = PromptspliceChatModel(engine=engine, runner=runner, max_tokens=8, session_key="conv")
    graph = create_react_agent(model, [read_log], pre_model_hook=pre)
    history = [HumanMessage("Read the log app.log"),
               AIMessage("", tool_calls=[{"name": "read_log", "args": {}, "id": "c1", "type": "tool_call"}]),
               ToolMessage(read_log(), tool_call_id="c1", name="read_log"),
               HumanMessage("Summarize it.")]
    graph.invoke({"messages": history}, config={"configurable": {"conv": "conv-2", "thread_id": "t-2"}})
    assert runner.calls[0] is pre.history[0] and runner.calls[0].session_id == "conv-2"


def test_an_untitled_json_schema_response_format_is_named_in_a_warning(caplog):
    """LangChain names the tool of a JSON schema without a "title" at random per
    ToolStrategy built: the middleware's render can never match create_agent's, so it says so."""
    from types import SimpleNamespace

    from promptsplice.engine_adapters.integrations._middleware import _structured_output_tools

    model = PromptspliceChatModel(max_tokens=1)
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    with caplog.at_level(logging.WARNING, logger="promptsplice"):
        (tool,) = _structured_output_tools(SimpleNamespace(response_format=schema, model=model))
        titled = _structured_output_tools(SimpleNamespace(response_format={**schema, "title": "Answer"}, model=model))
    assert tool.name.startswith("response_format_") and [t.name for t in titled] == ["Answer"]
    assert sum("without a 'title'" in r.getMessage() for r in caplog.records) == 1  # the untitled one only
    assert _structured_output_tools(SimpleNamespace(response_format=schema, model=object())) == []  # not our model


def test_the_hand_off_never_serves_a_context_of_another_salt(default_tok):
    """The process-wide hand-off was keyed by session id and matched on token ids only:
    tenant B's model on a thread also named "1" with the same opening messages took
    tenant A's prepared context, and its request went out under A's salt (or failed)."""
    from promptsplice.engine_adapters.integrations._handoff import handoff

    msgs = [HumanMessage("hand-off salt test: hi")]
    hook_a = ContextHook(default_tok, block_size=16, salt="tenant-A")
    pre_a = PromptsplicePreModelHook(hook_a, default_session="handoff-salt-1")
    pre_a({"messages": msgs})
    dicts = lc_messages_to_openai(msgs)
    # B's own context for the same thread id does not replace A's
    pre_b = PromptsplicePreModelHook(ContextHook(default_tok, block_size=16, salt="tenant-B"), default_session="handoff-salt-1")
    pre_b({"messages": msgs})
    for salt in (None, "tenant-C"):  # same ids, another (or no) salt: never taken, left in place
        assert handoff.take("handoff-salt-1", hook_a.renderer.render(dicts, salt=salt)) is None
    taken = handoff.take("handoff-salt-1", hook_a.renderer.render(dicts, salt="tenant-A"))
    assert taken is pre_a.history[-1] and taken.render.salt == "tenant-A"
    # taken again only by a retry of that call (its salt, its tokens), never under another salt
    assert handoff.take("handoff-salt-1", hook_a.renderer.render(dicts, salt="tenant-A")) is taken
    assert handoff.take("handoff-salt-1", hook_a.renderer.render(dicts, salt="tenant-C")) is None
    taken_b = handoff.take("handoff-salt-1", hook_a.renderer.render(dicts, salt="tenant-B"))
    assert taken_b is pre_b.history[-1] and taken_b.render.salt == "tenant-B"


class _SendlessEngine:
    """What ``PromptspliceChatModel._request`` reads of an engine (nothing is sent)."""

    block_size = 16
    model_name = "SmolLM2-135M-Instruct"

    def __init__(self, tok: Any) -> None:
        self.tokenizer = tok

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the test only prepares requests")


def test_an_unsalted_model_takes_its_hooks_context_under_the_hooks_salt(default_tok):
    """With hand-offs kept per salt, a model without a salt of its own looked under salt
    None: a salted framework hook's context was never taken and the tenant's request went
    out unsalted; a model given the same hook ran it twice (step 2, policies on edited
    messages).  Hooks of two salts on one session before an unsalted model: which tenant
    the call is cannot be told, an InvalidSaltError."""
    from promptsplice.engine_adapters.integrations._handoff import handoff
    from promptsplice.errors import InvalidSaltError

    msgs = [HumanMessage("unsalted model, salted hook: " + "hello there " * 20)]
    hook = ContextHook(default_tok, block_size=16, salt="tenant-A")
    pre = PromptsplicePreModelHook(hook, default_session="unsalted-model-1")
    handed = pre({"messages": msgs})["llm_input_messages"]
    model = PromptspliceChatModel(engine=_SendlessEngine(default_tok), max_tokens=1)
    req = model._request(handed, None, {"session_id": "unsalted-model-1"}, None)
    assert req["prepared"] is pre.history[-1] and req["salt"] == "tenant-A"

    pre2 = PromptsplicePreModelHook(hook, default_session="unsalted-model-2")
    handed = pre2({"messages": msgs})["llm_input_messages"]
    with_hook = PromptspliceChatModel(engine=_SendlessEngine(default_tok), hook=hook, max_tokens=1)
    req = with_hook._request(handed, None, {"session_id": "unsalted-model-2"}, None)
    assert req["prepared"] is pre2.history[-1] and req["prepared"].step == 1 and req["salt"] == "tenant-A"

    for salt in ("tenant-A", "tenant-B"):
        PromptsplicePreModelHook(ContextHook(default_tok, block_size=16, salt=salt), default_session="unsalted-model-3")(
            {"messages": msgs}
        )
    with pytest.raises(InvalidSaltError, match="hooks of 2 salts prepared session 'unsalted-model-3'"):
        model._request(handed, None, {"session_id": "unsalted-model-3"}, None)
    salted = PromptspliceChatModel(engine=_SendlessEngine(default_tok), max_tokens=1, cache_salt="tenant-B")
    assert salted._request(handed, None, {"session_id": "unsalted-model-3"}, None)["salt"] == "tenant-B"
    assert handoff.take("unsalted-model-3", hook.renderer.render(lc_messages_to_openai(msgs), salt="tenant-A")) is not None


def test_an_unsalted_model_whose_render_differs_from_its_salted_hooks_says_so(default_tok):
    """The hook's tenant salt held only when the hand-off matched: tools the hook was not
    given (any mismatch) and the model rendered the messages anew, unsalted.  Taking the
    hook's salt instead would let another caller of the same session id reach that
    tenant's cache: which tenant the call is cannot be told, an InvalidSaltError."""
    from promptsplice.errors import InvalidSaltError

    msgs = [HumanMessage("salted hook, mismatched render: " + "hello there " * 20)]
    hook = ContextHook(default_tok, block_size=16, salt="tenant-A")
    pre = PromptsplicePreModelHook(hook, default_session="unsalted-mismatch-1")  # no tools given to it
    handed = pre({"messages": msgs})["llm_input_messages"]
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    model = PromptspliceChatModel(engine=_SendlessEngine(default_tok), max_tokens=1)
    with pytest.raises(InvalidSaltError, match="under cache_salt 'tenant-A', but the messages this model received"):
        model._request(handed, None, {"session_id": "unsalted-mismatch-1", "tools": [tool]}, None)
    # the tenant's salt on the model: sent under it, rendered anew
    salted = PromptspliceChatModel(engine=_SendlessEngine(default_tok), max_tokens=1, cache_salt="tenant-A")
    assert salted._request(handed, None, {"session_id": "unsalted-mismatch-1", "tools": [tool]}, None)["salt"] == "tenant-A"
    # no hook entry at all: an unsalted model's own request, unsalted as before
    assert model._request(handed, None, {"session_id": "unsalted-mismatch-2"}, None)["salt"] is None
    # a model with an unsalted hook of its own: the tenant hook's entry is taken under its
    # salt, a mismatch is the same error (its own hook re-prepared the session and sent
    # the tenant's prompt unsalted, for a day)
    own = PromptspliceChatModel(engine=_SendlessEngine(default_tok), max_tokens=1,
                                hook=ContextHook(default_tok, block_size=16))
    pre3 = PromptsplicePreModelHook(hook, default_session="unsalted-mismatch-3")
    handed = pre3({"messages": msgs})["llm_input_messages"]
    req = own._request(handed, None, {"session_id": "unsalted-mismatch-3"}, None)
    assert req["prepared"] is pre3.history[-1] and req["salt"] == "tenant-A"
    pre3({"messages": msgs})
    with pytest.raises(InvalidSaltError, match="under cache_salt 'tenant-A', but the messages this model received"):
        own._request(handed, None, {"session_id": "unsalted-mismatch-3", "tools": [tool]}, None)
    assert own._request(handed, None, {"session_id": "unsalted-mismatch-4"}, None)["salt"] is None  # its own, unsalted


def test_a_session_with_an_image_goes_through_unedited_instead_of_failing_every_call(default_tok, caplog):
    """One image (or a Responses refusal) in the history raised InputError in every later
    call of an agent behind a hook adapter: the agent stopped for good.  Such a session
    now goes to the model unedited, said once."""
    from types import SimpleNamespace

    from agents import Agent
    from agents.run_config import CallModelData, ModelInputData

    from promptsplice.errors import NonTextContentError

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    history = [HumanMessage(content=[{"type": "text", "text": "what is on this screen?"}, image])]

    def hook():
        return ContextHook(default_tok, block_size=16, policies=[TruncateToolOutputs(10, keep_recent=0)])

    with pytest.raises(NonTextContentError, match="only text content parts can be rendered"):
        hook()("direct", lc_messages_to_openai(history))  # the hook itself still refuses it

    mw = PromptspliceMiddleware(hook(), default_session="mw-img")
    request = SimpleNamespace(messages=history, system_message=None, tools=[], response_format=None,
                              model=object(), override=lambda **kw: pytest.fail("an unrenderable request was edited"))
    pre = PromptsplicePreModelHook(hook(), default_session="lg-img")
    filt = PromptspliceInputFilter(hook(), session_id="sdk-img")
    items = [{"role": "user", "content": [{"type": "input_text", "text": "and this?"},
                                          {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]
    data = CallModelData(model_data=ModelInputData(input=items, instructions="Look."), agent=Agent(name="a"),
                         context=None)
    with caplog.at_level(logging.WARNING, logger="promptsplice"):
        for _ in range(2):
            assert mw.wrap_model_call(request, lambda r: r) is request
            assert pre({"messages": history})["llm_input_messages"] == history
            out = filt(data)
            assert out.input == items and out.instructions == "Look."
    said = [r.getMessage() for r in caplog.records if "cannot render" in r.getMessage()]
    assert len(said) == 3 and all("unedited" in m for m in said)  # once per adapter and session
    assert not mw.history and not pre.history and not filt.history


@pytest.mark.reliability
def test_the_llm_cache_key_names_the_tenant_and_the_hooks_prompt(default_tok):
    """LangChain's LLM cache keyed an unsalted model by its settings alone: over a hook of
    tenant A and one of tenant B (or one with policies and one without), the two shared
    entries, and tenant B got tenant A's cached answer without a request."""
    from types import SimpleNamespace

    from langchain_core.caches import InMemoryCache

    def model(hook, **kw):
        return PromptspliceChatModel(engine=_SendlessEngine(default_tok), hook=hook, max_tokens=1, **kw)

    def hook(salt, *policies):
        return ContextHook(default_tok, block_size=16, salt=salt, policies=list(policies))

    key = {name: m._get_llm_string() for name, m in {
        "A": model(hook("tenant-A")), "A again": model(hook("tenant-A")), "B": model(hook("tenant-B")),
        "A truncating": model(hook("tenant-A", TruncateToolOutputs(10, keep_recent=0))),
        "A truncating again": model(hook("tenant-A", TruncateToolOutputs(10, keep_recent=0))),
        "A by lambda": model(hook("tenant-A", lambda ms: None)),
    }.items()}
    assert key["A"] == key["A again"] and key["A truncating"] == key["A truncating again"]
    assert len({key["A"], key["B"], key["A truncating"], key["A by lambda"]}) == 4
    assert "0x" not in key["A by lambda"]  # no address: a persistent cache keys alike in every process
    # a cache shared by both tenants: each gets its own entry
    cache, msgs = InMemoryCache(), [HumanMessage("what is my balance?")]
    a, b = model(hook("tenant-A")), model(hook("tenant-B"))
    cache.update("the same prompt", a._get_llm_string(), ["answer for A"])
    assert cache.lookup("the same prompt", b._get_llm_string()) is None
    assert cache.lookup("the same prompt", model(hook("tenant-A"))._get_llm_string()) == ["answer for A"]

    # the middleware's hand-off names its hook's salt as a call option of an unsalted model
    mw = PromptspliceMiddleware(hook("tenant-A"), default_session="mw-cache-key")
    request = SimpleNamespace(messages=msgs, system_message=None, tools=[], response_format=None,
                              model=model(None), model_settings={}, override=lambda **kw: SimpleNamespace(**{
                                  **vars(request), **kw}))
    new, prepared = mw._prepare(request)
    given, _ = mw._give(new, prepared)
    assert given.model_settings == {"session_id": "mw-cache-key", "cache_salt": "tenant-A"}
    own = SimpleNamespace(**{**vars(new), "model": model(None, cache_salt="tenant-A")})
    assert "cache_salt" not in mw._give(own, prepared)[0].model_settings  # the model's own salt decides
    handoff_discard(prepared)


def handoff_settle(prepared):
    from promptsplice.engine_adapters.integrations._handoff import handoff

    handoff.settle(prepared)


def handoff_discard(prepared):
    from promptsplice.engine_adapters.integrations._handoff import handoff

    handoff.discard(prepared)


def test_the_async_middleware_prepares_off_the_event_loop(default_tok):
    """``awrap_model_call`` ran the hook (policies, a summarizer's model call) on the event
    loop: every other task of the loop stalled for it."""
    import asyncio
    import threading
    from types import SimpleNamespace

    seen = []
    mw = PromptspliceMiddleware(ContextHook(default_tok, block_size=16), default_session="mw-async",
                                on_prepared=lambda p: seen.append(threading.current_thread()))
    request = SimpleNamespace(messages=[HumanMessage("hi")], system_message=None, tools=[], response_format=None,
                              model=object(), override=lambda **kw: SimpleNamespace(**{**vars(request), **kw}))

    async def handler(r):
        return r

    async def main():
        return threading.current_thread(), await mw.awrap_model_call(request, handler)

    loop_thread, out = asyncio.run(main())
    assert out.messages[0].content == "hi" and seen and seen[0] is not loop_thread


def test_messages_langchain_cannot_read_are_message_errors(default_tok):
    """A tool message without ``tool_call_id`` raised LangChain's raw KeyError from
    invoke/stream/batch and from the LangGraph hook."""
    from promptsplice.engine_adapters.integrations._langchain_options import convert_input
    from promptsplice.errors import InvalidMessageError

    model = PromptspliceChatModel(engine=_SendlessEngine(default_tok), max_tokens=1)
    for bad in ([{"role": "tool", "content": "42"}], [("tool", "42")]):
        with pytest.raises(InvalidMessageError, match="a message has no 'tool_call_id'"):
            convert_input(model, bad)
    pre = PromptsplicePreModelHook(ContextHook(default_tok, block_size=16), default_session="lg-keyerror")
    with pytest.raises(InvalidMessageError, match="cannot be read as LangChain messages"):
        pre({"messages": [{"role": "tool", "content": "42"}]})


def test_v1_content_blocks_of_an_assistant_turn_render(default_tok):
    """With ``output_version="v1"`` an assistant turn keeps its calls (and reasoning) as
    content blocks: they stayed in the content beside ``tool_calls`` and the next step of
    a tool loop raised NonTextContentError."""
    from promptsplice.assembler import ChatRenderer

    ai = AIMessage(
        content=[{"type": "reasoning", "reasoning": "think"}, {"type": "text", "text": "Calling f."},
                 {"type": "tool_call", "id": "c1", "name": "f", "args": {"a": 1}}],
        tool_calls=[{"id": "c1", "name": "f", "args": {"a": 1}}],
    )
    only_call = AIMessage(content=[{"type": "tool_call", "id": "c2", "name": "f", "args": {}}],
                          tool_calls=[{"id": "c2", "name": "f", "args": {}}])
    dicts = lc_messages_to_openai([HumanMessage("call f"), ai, ToolMessage("42", tool_call_id="c1"), only_call])
    assert [p.get("type") for p in dicts[1]["content"]] == ["text"] and dicts[3]["content"] == ""
    assert [c["id"] for c in dicts[1]["tool_calls"]] == ["c1"] and [c["id"] for c in dicts[3]["tool_calls"]] == ["c2"]
    render = ChatRenderer(default_tok, block_size=16).render(dicts)
    assert "Calling f." in render.text and '"name":"f"' in render.text and "think" not in render.text


def test_a_list_valued_tool_output_is_read_as_its_text_parts(default_tok, caplog):
    """The SDK's ``function_call_output`` may hold a list of content parts; the filter
    rendered the list as JSON: policies never saw the text (no truncation), and an image
    output was tokenized as base64 text instead of passing through."""
    from types import SimpleNamespace

    from agents.run_config import ModelInputData

    def items(output):
        return [
            {"role": "user", "content": "read the log"},
            {"type": "function_call", "call_id": "c1", "name": "read_log", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": output},
            {"role": "user", "content": "Summarize it."},
        ]

    text = read_log()
    cut = text.index("\n", 50)  # parts join with a newline, as vLLM joins them
    parts = [{"type": "input_text", "text": text[:cut]}, {"type": "input_text", "text": text[cut + 1:]}]
    chat, _ = items_to_chat(items(parts), None)
    assert chat[2] == {"role": "tool", "tool_call_id": "c1", "content": text}

    def run(output, sid):
        hook = ContextHook(default_tok, block_size=16, policies=[TruncateToolOutputs(10, keep_recent=0)])
        filt = PromptspliceInputFilter(hook, session_id=sid)
        given = items(output)
        out = filt(SimpleNamespace(model_data=ModelInputData(input=given, instructions=None), context=None))
        return filt, given, out

    as_str, _, out_str = run(text, "list-out-str")
    as_list, given, out_list = run(parts, "list-out-parts")
    assert len(as_list.history[0].policy_edits) == len(as_str.history[0].policy_edits) == 1
    assert as_list.history[0].token_ids == as_str.history[0].token_ids
    assert out_list.input[2]["output"] == out_str.input[2]["output"]
    assert MARKER in out_list.input[2]["output"] and given[2]["output"] == parts  # not mutated

    image = [{"type": "input_image", "image_url": "data:image/png;base64," + "iVBORw0KGgo" * 40}]
    with caplog.at_level(logging.WARNING, logger="promptsplice"):
        as_image, given, out = run(image, "list-out-image")
    assert out.input == given and not as_image.history  # passed through, unrendered
    assert [r.getMessage().count("'list-out-image' holds content the hook cannot render") for r in caplog.records] == [1]
    # a list that is not content parts is still data, rendered as JSON
    assert items_to_chat(items([1, 2]), None)[0][2]["content"] == "[1, 2]"


def test_text_parts_join_as_vllm_and_langchain_join_them(default_tok):
    """An Agents SDK message of two ``input_text`` parts rendered "Helloworld" (parts
    joined with nothing); vLLM's chat and Responses endpoints render "Hello\\nworld", and
    so did the same turn fed through LangChain (``convert_to_openai_messages``): one
    conversation, two renders, and neither hook's prefix matched the other's."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": ""},
                                          {"type": "input_text", "text": "world"}]}]
    chat, _ = items_to_chat(items, None)
    assert chat == [{"role": "user", "content": "Hello\nworld"}]  # an empty part adds no line, as in vLLM
    via_lc = lc_messages_to_openai([HumanMessage(content=[{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}])])
    raw = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    hook = ContextHook(default_tok, block_size=16)
    ids = {name: hook(name, msgs).token_ids for name, msgs in (("sdk", chat), ("lc", via_lc), ("raw", raw))}
    assert ids["sdk"] == ids["lc"] == ids["raw"]
    assert "Hello\nworld" in default_tok.decode(ids["raw"])
    # a function_call_output's parts too
    out = [{"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "a"},
                                                                         {"type": "input_text", "text": "b"}]}]
    assert items_to_chat(out, None)[0] == [{"role": "tool", "tool_call_id": "c1", "content": "a\nb"}]


def test_middleware_and_langgraph_hook_options_are_checked(default_tok):
    """``keep_history="3"`` failed at the first call's history trim and a negative one
    kept all but the last few; a session key that is not a str named no config key."""
    from promptsplice.errors import ConfigError

    hook = ContextHook(default_tok, block_size=16)
    for kwargs, message in [
        ({"keep_history": -1}, "keep_history must be an int >= 0, got -1"),
        ({"keep_history": "3"}, "keep_history must be an int >= 0, got '3'"),
        ({"keep_history": True}, "keep_history must be an int >= 0, got True"),
        ({"session_key": 3}, "session_key must be a str, got int 3"),
        ({"session_key": ""}, "session_key must be a non-empty str"),
    ]:
        with pytest.raises(ConfigError) as info:
            PromptspliceMiddleware(hook, **kwargs)
        assert str(info.value).startswith(message)
    with pytest.raises(ConfigError, match="session_key must be a str, got bytes"):
        PromptsplicePreModelHook(hook, session_key=b"thread_id")
    assert PromptspliceMiddleware(hook, "conversation", keep_history=0).keep_history == 0


def test_the_langgraph_and_agents_sdk_hooks_import_without_the_langchain_package():
    """The middleware's base class came from ``langchain`` (1.x) at the import of the
    module all three hooks live in: the two that need only langchain-core (and langgraph
    or the Agents SDK) failed with a raw ModuleNotFoundError."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['langchain'] = None\n"  # as if not installed
        "from promptsplice.engine_adapters.integrations import PromptsplicePreModelHook, PromptspliceInputFilter\n"
        "try:\n"
        "    from promptsplice.engine_adapters.integrations import PromptspliceMiddleware\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PromptspliceMiddleware needs the 'langchain' package" in out.stdout and "langchain>=1.0" in out.stdout


def test_a_developer_item_stays_a_developer_message_and_renders_as_vllm_renders_it():
    """The input filter turned ``developer`` items into ``system`` messages in place: a
    developer item after the first user turn rendered as a system turn there, where
    vLLM's chat endpoint (for a template without the role) merges it into the system
    message in front; and a template that knows the role never got it."""
    items = [{"role": "system", "content": "S."}, {"role": "user", "content": "hi"},
             {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "ok"}]
    chat, prov = items_to_chat(items, None)
    assert [m["role"] for m in chat] == ["system", "user", "developer", "user"] and prov == [[0], [1], [2], [3]]
    prepared = ContextHook("default", block_size=32)("s", chat, None)
    assert prepared.render.text.startswith("<|im_start|>system\nS.\n\nAnswer in French.<|im_end|>\n")
    assert "<|im_start|>developer" not in prepared.render.text


def test_an_anthropic_tool_result_flagged_is_error_counts_as_failed():
    """Anthropic's ``tool_result`` blocks say a failure with ``is_error: true``, which
    LangChain's conversion drops: an output such as "Timed out after 30 s" (no error
    word) was a success to DropFailedCalls and stayed in the context for good."""
    use = lambda cid: AIMessage("", tool_calls=[{"name": "search", "args": {}, "id": cid, "type": "tool_call"}])  # noqa: E731
    result = lambda cid, text, **kw: HumanMessage(content=[  # noqa: E731
        {"type": "tool_result", "tool_use_id": cid, "content": text, **kw}])
    msgs = [HumanMessage("go"), use("t1"), result("t1", "Timed out after 30 s", is_error=True),
            use("t2"), result("t2", "found: 42 results", is_error=False)]
    dicts = lc_messages_to_openai(msgs)
    assert [d.get("status") for d in dicts] == [None, None, "error", None, None]
    out = DropFailedCalls().apply(dicts)
    assert [d.get("content") for d in out.messages] == ["go", "", "found: 42 results"]


@pytest.mark.reliability
def test_a_retried_call_keeps_its_hooks_tenant_salt_and_cache_key(default_tok):
    """An unsalted model learns the tenant from the pre-model hook's hand-off, which the
    first attempt took: a retry of the same call (``with_retry``, a node's retry policy)
    found nothing and went out unsalted, into the cache every unsalted caller shares; and
    the LLM-cache key of such a model never named the hook's tenant, so tenant B was
    served tenant A's cached answer.  (A transient engine error cannot be produced on
    demand by vLLM: the engine here fails its first request.)"""
    from langchain_core.caches import InMemoryCache
    from langchain_core.outputs import ChatGeneration

    from promptsplice.errors import EngineUnavailableError

    sent: list[Any] = []

    class _Flaky(_SendlessEngine):
        def generate(self, prompt, **kwargs):
            sent.append(kwargs.get("cache_salt"))
            if len(sent) == 1:
                raise EngineUnavailableError("a transient failure")
            raise AssertionError("the answer comes from the second attempt's record")

    msgs = [HumanMessage("a tenant's private question " * 5)]
    model = PromptspliceChatModel(engine=_Flaky(default_tok), max_tokens=1)
    pre = PromptsplicePreModelHook(ContextHook(default_tok, block_size=16, salt="tenant-A"), default_session="retry-1")
    handed = pre({"messages": msgs})["llm_input_messages"]
    with pytest.raises(EngineUnavailableError):
        model._generate(handed, session_id="retry-1")
    with pytest.raises(AssertionError, match="second attempt"):
        model._generate(handed, session_id="retry-1")  # the retry: the same context, the same salt
    assert sent == ["tenant-A", "tenant-A"]
    # the next step of the session replaces it; another call of the session is refused, never unsalted
    other = [HumanMessage("something else")]
    req = PromptspliceChatModel(engine=_SendlessEngine(default_tok), max_tokens=1)
    from promptsplice.errors import InvalidSaltError

    with pytest.raises(InvalidSaltError):
        req._request(other, None, {"session_id": "retry-1"}, None)

    # two tenants on one session id: while A's call waits for its retry, B's call (and
    # A's retry) cannot tell whose it is: refused, never sent under the other's salt
    pre_b = PromptsplicePreModelHook(ContextHook(default_tok, block_size=16, salt="tenant-B"), default_session="retry-1")
    handed_b = pre_b({"messages": msgs})["llm_input_messages"]
    for call in (handed_b, handed):
        with pytest.raises(InvalidSaltError, match="hooks of 2 salts prepared session 'retry-1'"):
            req._request(call, None, {"session_id": "retry-1"}, None)
    assert sent == ["tenant-A", "tenant-A"]

    # LangChain's LLM cache: each hook's tenant keys its own entries (each call answered)
    cache = InMemoryCache()
    keys = {}
    for tenant in ("tenant-A", "tenant-B"):
        PromptsplicePreModelHook(ContextHook(default_tok, block_size=16, salt=tenant), default_session="cache-1")(
            {"messages": msgs})
        keys[tenant] = req._get_llm_string(session_id="cache-1")
        call = req._request(handed, None, {"session_id": "cache-1"}, None)  # the hook's hand-off taken
        handoff_settle(call["prepared"])  # ... and answered
    assert "salt='tenant-A'" in keys["tenant-A"] and "salt='tenant-B'" in keys["tenant-B"]
    # a setting changed after a call changes the key (LangChain cached the model's dumpd)
    before = req._get_llm_string()
    req.temperature = 0.5
    assert req._get_llm_string() != before and '"temperature": 0.5' in req._get_llm_string()
    assert req.model_copy(update={"max_tokens": 200})._get_llm_string() != req._get_llm_string()
    cache.update("prompt", keys["tenant-A"], [ChatGeneration(message=AIMessage("for A"))])
    assert cache.lookup("prompt", keys["tenant-B"]) is None


@pytest.mark.reliability
def test_a_middleware_whose_model_has_another_tenants_salt_is_refused(default_tok):
    """The middleware's hook prepared the session under tenant A's salt; a model salted
    for tenant B rendered the messages anew under B's salt, the hook's policy edits lost,
    with no error (its comment promised an InvalidSaltError)."""
    from types import SimpleNamespace

    from promptsplice.errors import InvalidSaltError

    mw = PromptspliceMiddleware(ContextHook(default_tok, block_size=16, salt="tenant-A"), default_session="mw-salt")
    model = PromptspliceChatModel(engine=_SendlessEngine(default_tok), max_tokens=1, cache_salt="tenant-B")
    request = SimpleNamespace(messages=[HumanMessage("hello " * 20)], system_message=None, tools=[],
                              response_format=None, model=model, model_settings={},
                              override=lambda **kw: SimpleNamespace(**{**vars(request), **kw}))
    new, prepared = mw._prepare(request)
    with pytest.raises(InvalidSaltError, match="under salt 'tenant-A', the model's cache_salt is 'tenant-B'"):
        mw._give(new, prepared)
    same = SimpleNamespace(**{**vars(new), "model": PromptspliceChatModel(
        engine=_SendlessEngine(default_tok), max_tokens=1, cache_salt="tenant-A")})
    given, give = mw._give(same, prepared)
    assert give and given.model_settings == {"session_id": "mw-salt"}
    handoff_discard(prepared)
    # a call-time cache_salt of another tenant counts as the model's
    unsalted = SimpleNamespace(**{**vars(new), "model": PromptspliceChatModel(engine=_SendlessEngine(default_tok),
                                                                               max_tokens=1),
                                  "model_settings": {"cache_salt": "tenant-B"}})
    with pytest.raises(InvalidSaltError, match="the model's cache_salt is 'tenant-B'"):
        mw._give(unsalted, prepared)
    # an unsalted hook before a salted model stays allowed (the model's salt decides)
    open_mw = PromptspliceMiddleware(ContextHook(default_tok, block_size=16), default_session="mw-open")
    req = SimpleNamespace(**{**vars(request), "model": model})
    new_open, prepared_open = open_mw._prepare(req)
    assert open_mw._give(new_open, prepared_open)[1] is True
    handoff_discard(prepared_open)


def test_an_edited_turn_that_holds_an_invalid_call_comes_back_with_it(default_tok):
    """A turn with a failed call and a call whose arguments did not parse: dropping the
    failed call edited the turn, and converting it back raised InputError (LangChain's
    converter refuses arguments that are not JSON) on this step and every later one."""
    hook = ContextHook(default_tok, block_size=16, policies=[DropFailedCalls()])
    pre = PromptsplicePreModelHook(hook, default_session="inv-1")
    bad = {"name": "lookup", "args": "{bad", "id": "c2", "error": "bad json", "type": "invalid_tool_call"}
    msgs = [
        HumanMessage("find x"),
        AIMessage("", tool_calls=[{"name": "search", "args": {"q": "x"}, "id": "c1"}], invalid_tool_calls=[bad]),
        ToolMessage("Error: timeout", tool_call_id="c1", status="error"),
        ToolMessage("Error: invalid arguments", tool_call_id="c2", status="error"),
        AIMessage("", tool_calls=[{"name": "search", "args": {"q": "x"}, "id": "c3"}]),  # the retry
        ToolMessage("x found", tool_call_id="c3"),
    ]
    out = pre({"messages": msgs})["llm_input_messages"]
    assert [type(m).__name__ for m in out] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage", "ToolMessage"]
    assert out[1].tool_calls == [] and out[1].invalid_tool_calls == [bad]  # the model's own record, its error too
    assert (out[2].tool_call_id, out[2].status) == ("c2", "error") and out[3:] == msgs[4:]
    # a new dict (no original) with arguments that are not a JSON object: an invalid call
    again = messages_from_openai(
        [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "n1", "type": "function", "function": {"name": "f", "arguments": "[3, 4]"}},
            {"id": "n2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}]}], [], [], [])
    assert [c["id"] for c in again[0].tool_calls] == ["n2"]
    assert [(c["id"], c["args"]) for c in again[0].invalid_tool_calls] == [("n1", "[3, 4]")]
