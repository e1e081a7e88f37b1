"""``PromptspliceChatModel(engine=RemoteEngine(url))``: LangChain's standard chat-model
integration suite (langchain-tests) against a real ``vllm serve`` on loopback (the
session's ``served_kv``, which runs the splice connector), with the same capability
flags as on the embedded engine (tests/engine_adapters/integrations/
test_langchain_standard.py says why each is set); and the framework hook path (a
``ContextHook`` with an ``AgentRunner`` over the served engine) splicing an edit."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

import tests.engine_adapters.integrations.test_langchain_standard as standard
from promptsplice.assembler import ContextHook, TruncateToolOutputs
from promptsplice.engine_adapters import AgentRunner, RemoteEngine
from promptsplice.engine_adapters.integrations._langchain_chat import PromptspliceChatModel, set_default_engine


@pytest.fixture(scope="module")
def served_engine(served_kv):
    with RemoteEngine(served_kv.base_url, max_retries=0, timeout=600) as eng:  # a loaded CI machine is slow
        yield eng


@pytest.fixture(autouse=True)
def _default_engine(served_kv, served_engine):
    if served_kv.proc.poll() is not None:
        pytest.fail(f"vllm serve exited with {served_kv.proc.returncode}:\n{served_kv.tail()}")
    prev = set_default_engine(served_engine)
    yield
    set_default_engine(prev)


class TestPromptspliceChatServed(standard.TestPromptspliceChatIntegration):
    """The whole integration suite, the model's engine a ``RemoteEngine``."""


standard._mark_async_tests(TestPromptspliceChatServed)


def test_chat_model_over_the_server_reports_its_usage(served_engine):
    model = PromptspliceChatModel(engine=served_engine, max_tokens=4, cache_salt="served-chat-usage")
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 12
    first = model.invoke(prompt)
    again = model.invoke(prompt)
    n = first.usage_metadata["input_tokens"]
    bs = served_engine.block_size
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    assert again.usage_metadata["input_token_details"]["cache_read"] == (n - 1) // bs * bs
    assert again.content == first.content and first.usage_metadata["output_tokens"] == 4
    assert first.response_metadata["model_name"] == served_engine.model.rsplit("/", 1)[-1]


class Recording:
    """The real runner, its steps kept."""

    def __init__(self, runner):
        self.runner, self.steps = runner, []

    def step(self, prepared, **kwargs):
        out = self.runner.step(prepared, **kwargs)
        self.steps.append((prepared, out))
        return out


def test_hook_and_runner_splice_an_edit_over_the_server(served_engine):
    """The framework path: the model's hook truncates an old tool output once a newer
    one arrives (an edit) and its ``AgentRunner`` relocates what follows through the
    server's connector."""
    from promptsplice.benchmarks.traces import load_wiki_leads

    eng = served_engine
    hook = ContextHook(eng.tokenizer, block_size=eng.block_size, salt="served-hook",
                       policies=[TruncateToolOutputs(max_lines=10, keep_recent=1)])
    runner = Recording(AgentRunner(eng, mode="splice", salt="served-hook", recompute_blocks=1, fidelity="bounded"))
    model = PromptspliceChatModel(engine=eng, hook=hook, runner=runner, max_tokens=4,
                                  cache_salt="served-hook", session_id="t1")
    lines = [lead.split(". ")[0][:160] for _, lead in load_wiki_leads()[300:360]]
    c1 = {"name": "grep", "args": {"q": "sched"}, "id": "c1", "type": "tool_call"}
    c2 = {"name": "grep", "args": {"q": "config"}, "id": "c2", "type": "tool_call"}
    msgs = [SystemMessage("You are a code agent. Answer briefly."), HumanMessage("Where is the scheduler configured?"),
            AIMessage("", tool_calls=[c1]), ToolMessage("\n".join(lines[:40]), tool_call_id="c1"),
            AIMessage("The search found forty lines; none of them names the scheduler's configuration file."),
            HumanMessage("Now search the configuration, then answer in one sentence: where is it configured?")]
    model.invoke(msgs)
    msgs += [AIMessage("", tool_calls=[c2]), ToolMessage("\n".join(lines[40:46]), tool_call_id="c2")]
    out = model.invoke(msgs)  # the first output, no longer the most recent, is truncated
    (_, first), (prepared, step) = runner.steps
    assert out.response_metadata["step_kind"] == "edit" and prepared.policy_edits
    assert first.relocated_tokens == 0 and step.fallback is None and step.salt != "served-hook"
    assert step.prompt_tokens == step.prefill_tokens + step.cached_tokens
    assert 0 < step.relocated_tokens <= step.cached_tokens
    assert step.prefill_tokens < step.prompt_tokens - prepared.first_changed_token  # less than apc would prefill
    # the step's own cache reads, not its last request's (which include what the step's
    # earlier requests computed)
    assert out.usage_metadata["input_token_details"]["cache_read"] == step.cached_tokens
